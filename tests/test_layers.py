"""The package's layers import only downward (README, Layout): the method objects and everything below
them know neither Lightning nor the Hugging Face Trainer, so every adapter can reuse them."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "attnreg"
FRAMEWORKS = ("lightning", "pytorch_lightning", "attnreg.callbacks", "attnreg.mixin", "attnreg.integrations")
APP = ("attnreg.train", "attnreg.models", "attnreg.evaluation", "attnreg.datamodules", "attnreg.configs")
LOWER = [
    "families.py",
    "hub.py",
    "losses.py",
    "blockwise.py",
    "schedules.py",
    "progress.py",
    "optim.py",
    "distill.py",
    "pruning",
    "syntax",
    "analysis",
    "methods",
]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def files(entry: str) -> list[Path]:
    path = PACKAGE / entry
    return sorted(path.rglob("*.py")) if path.is_dir() else [path]


@pytest.mark.parametrize(
    "path", [p for entry in LOWER for p in files(entry)], ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_lower_layers_import_no_framework_and_no_app(path):
    upward = [
        name
        for name in imported_modules(path)
        if any(name == banned or name.startswith(banned + ".") for banned in FRAMEWORKS + APP)
        or name == "transformers.Trainer"
    ]
    assert not upward, f"{path.relative_to(PACKAGE)} imports {sorted(upward)} from a layer above it"


def test_the_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from attnreg.callbacks.base import MethodCallback\nimport lightning as L\n")
    assert {"attnreg.callbacks.base", "lightning"} <= imported_modules(bad)
