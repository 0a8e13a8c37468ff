"""An install without an extra a command needs stops with the `pip install "attnreg[...]"` line to run, not an
ImportError from deep inside (`attnreg.app.cli`). Nothing is uninstalled: a missing package is simulated with
`sys.modules[name] = None`, which makes its import fail as a missing one does."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from unittest import mock

import pytest

from attnreg.app import cli
from attnreg.app.cli import EXTRAS, MissingExtra

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# One interpreter for the three app commands: Lightning is missing, each command is run as its entry point runs it.
WITHOUT_LIGHTNING = """
import runpy, sys
sys.modules["lightning"] = None
from attnreg.app import cli
commands = {
    "attnreg-train": cli.train,
    "attnreg-analyze": lambda: cli.analyze(["model", "dev.conllu", "--no-plots"]),
    "view": lambda: runpy.run_module("attnreg.app.view", run_name="__main__"),
}
for name, command in commands.items():
    sys.argv = [name, "run"]
    try:
        command()
    except SystemExit as stop:
        print(name, "|", type(stop).__name__, "|", stop.code)
    else:
        print(name, "| ran")
"""


def test_app_without_lightning_stops_with_the_pip_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_LIGHTNING], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" | ", 1) for line in result.stdout.splitlines() if " | " in line)
    assert lines.keys() == {"attnreg-train", "attnreg-analyze", "view"}, result.stdout
    for name, line in lines.items():
        kind, message = line.split(" | ", 1)
        assert kind == "MissingExtra", (name, line)
        shown = "python -m attnreg.app.view" if name == "view" else name
        assert message.startswith(f"{shown} needs lightning (") and message.endswith('pip install "attnreg[lightning]"')


def test_analyze_without_matplotlib_stops_before_the_analysis(tmp_path):
    """Its PNGs need the plots extra: said before the model loads; `--no-plots` needs none."""
    with mock.patch.dict(sys.modules, {"matplotlib": None}), pytest.raises(MissingExtra) as stop:
        cli.analyze([str(tmp_path / "model"), str(tmp_path / "dev.conllu")])
    assert str(stop.value.code).endswith('pip install "attnreg[plots]"') and "--no-plots" in str(stop.value.code)
    with mock.patch.dict(sys.modules, {"matplotlib": None}), pytest.raises(SystemExit) as stop:
        cli.analyze([str(tmp_path / "model"), str(tmp_path / "dev.conllu"), "--no-plots"])
    assert not isinstance(stop.value, MissingExtra) and stop.value.code == 2  # on to the input check: no model there


def test_mlflow_logger_without_mlflow(tmp_path):
    from attnreg.app.loggers import mlflow_logger

    with mock.patch.dict(sys.modules, {"mlflow": None}), pytest.raises(MissingExtra) as stop:
        mlflow_logger(str(tmp_path))
    assert str(stop.value.code).startswith("logger=mlflow needs mlflow (")
    assert str(stop.value.code).endswith('pip install "attnreg[mlflow]"')
    assert not list(tmp_path.iterdir())  # stopped before creating its store


@pytest.mark.slow
def test_train_with_mlflow_logger_without_mlflow(tmp_path):
    """Through Hydra: `attnreg-train logger=mlflow` stops with the line, no traceback (Hydra lets SystemExit by)."""
    run = ["logger=mlflow", "data.train=8", "data.val=8", "data.test=8", "data.hard=8", f"hydra.run.dir={tmp_path}"]
    code = f"import sys; sys.modules['mlflow'] = None; sys.argv = ['attnreg-train', *{run!r}]"
    code += "; from attnreg.app import cli; cli.train()"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].endswith('pip install "attnreg[mlflow]"'), result.stderr
    assert "Traceback" not in result.stderr


def test_console_scripts_are_the_guarded_entries():
    scripts = PYPROJECT["project"]["scripts"]
    assert set(scripts) == {"attnreg-train", "attnreg-analyze", "attnreg-collect"}
    for target in scripts.values():
        module, function = target.split(":")
        assert module == "attnreg.app.cli" and callable(getattr(cli, function)), target


def test_every_extra_named_exists():
    """`EXTRAS` names only extras that pyproject.toml defines, and each lists its package."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert set(EXTRAS.values()) <= extras.keys()
    for package, extra in EXTRAS.items():
        if package in ("hydra", "omegaconf", "lightning_fabric", "lightning_utilities", "en_core_web_sm"):
            continue  # attnreg's own dependencies, the line reinstalls them; the others come with their extra
        listed = {requirement.split(">")[0].split("<")[0].replace("-", "_") for requirement in extras[extra]}
        assert any(name == package or name.startswith(package + "_") for name in listed), (package, extra)
