"""The SmolLM2 agreement study (`benchmarks/decoder_agreement.py`) runs seed by seed into one folder: a partial grid
is summarized per cell (its seeds), with the paired test only from 2 seeds on, and a folder run with other study
settings is refused naming the setting. No model: reports made by hand."""

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("lm", "nsubj_1", "nsubj_few", "nsubj_parent")


@pytest.fixture(scope="module")
def study():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        yield importlib.import_module("decoder_agreement")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def arguments(study, out: Path, *options: str) -> argparse.Namespace:
    args = argparse.Namespace(
        quick=False, out=out, steps=300, batch=8, lr=1e-4, weight=1.0, one="15:2", few="15:2 15:5 18:2 18:5",
        parent="15:3", max_length=64, min_words=5, eval_sentences=None,
    )  # fmt: skip
    for option in options:
        name, value = option.split("=")
        setattr(args, name, type(getattr(args, name))(value) if getattr(args, name) is not None else int(value))
    return args


def run(accuracy: float, perplexity: float, kinds: bool) -> dict:
    scores = {"accuracy": {"without_attractors": 0.9, "with_attractors": accuracy, "all": 0.9}}
    scores["margin"] = {"without_attractors": 4.0, "with_attractors": 10 * accuracy - 3, "all": 4.0}
    evaluation = {"dev": scores, "test": scores, "perplexity": {"perplexity": perplexity}, "seconds": 10.0}
    evaluation["kind_accuracy"] = {"dependents:nsubj L15H2": 40.0} if kinds else {}
    return {"train": {"seconds": 100.0}, "eval": evaluation}


def report(study, args) -> dict:
    """Seed 0 has every arm, seed 1 the LM arm and nsubj_1, seed 2 only nsubj_few (no LM arm to pair with)."""
    base = run(0.5, 90.0, True)["eval"]
    base["dev"]["baselines"] = base["test"]["baselines"] = {
        name: {"without_attractors": 1.0, "with_attractors": 0.2} for name in ("closest_noun", "always_singular")
    }
    grid = {0: ARMS, 1: ("lm", "nsubj_1"), 2: ("nsubj_few",)}
    runs = {
        str(seed): {arm: run(0.6 + 0.1 * (arm != "lm") + 0.05 * seed, 80.0, arm != "lm") for arm in arms}
        for seed, arms in grid.items()
    }
    counts = {"without_attractors": 389, "with_attractors": 22}
    setup = {
        "model": "test",
        "arms": {arm: None for arm in ARMS},
        "settings": study.study_settings(args),
        "kind_counts": "nsubj: rows",
        "pairs": {"dev": counts, "test": counts},
    }
    out = {"setup": setup, "base": base, "runs": runs, "invocations": []}
    out["summary"] = study.summarize(out)
    return out


def test_a_partial_grid_is_summarized_per_cell_with_tests_from_two_seeds(study, tmp_path):
    args = arguments(study, tmp_path)
    made = report(study, args)
    summary = made["summary"]
    assert {arm: entry["seeds"] for arm, entry in summary.items()} == {
        "lm": [0, 1],
        "nsubj_1": [0, 1],
        "nsubj_few": [0, 2],
        "nsubj_parent": [0],
    }
    paired = summary["nsubj_1"]["dev_with_attractors_paired"]
    assert paired["values"] == pytest.approx([10.0, 10.0]) and paired["seeds_up"] == 2
    few = summary["nsubj_few"]["dev_with_attractors_paired"]  # seed 2 has no LM arm: one pair, no test
    assert summary["nsubj_few"]["paired_seeds"] == [0] and few["p"] is None and few["sd"] is None
    assert summary["nsubj_few"]["dev_with_attractors"]["values"] == pytest.approx([70.0, 80.0])  # both seeds
    margin = summary["nsubj_1"]["dev_with_attractors_margin_paired"]  # 10 x the accuracy's 0.1, in nats
    assert margin["values"] == pytest.approx([1.0, 1.0]) and margin["seeds_up"] == 2
    assert summary["nsubj_1"]["dev_without_attractors_margin_paired"]["values"] == pytest.approx([0.0, 0.0])
    text = study.markdown(made, args)
    assert "a partial grid" in text
    assert (
        "| nsubj_few (dev) | 2 | 90.0 ± 0.0 | 75.0 ± 7.1 | 90.0 ± 0.0 | +10.0 (1 seed, no test) "
        "| +0.00 (1 seed, no test) | +1.00 (1 seed, no test) |" in text
    )
    assert (
        "| nsubj_1 (dev) | 2 | 90.0 ± 0.0 | 72.5 ± 3.5 | 90.0 ± 0.0 | 10.0 ± 0.0 (2/2 up) | 0.00 ± 0.00 (0/2 up) "
        in text
    )


def test_a_folder_of_other_settings_is_refused_naming_the_setting(study, tmp_path):
    args = arguments(study, tmp_path)
    (tmp_path / "results.json").write_text(json.dumps(report(study, args)))
    assert set(study.resume(args)["runs"]) == {"0", "1", "2"}  # the same settings: resumed
    with pytest.raises(SystemExit, match=r"was run with eval_sentences=None, this command has eval_sentences=200"):
        study.resume(arguments(study, tmp_path, "eval_sentences=200"))
    with pytest.raises(SystemExit, match=r"was run with steps=300, this command has steps=100: .*\(--steps\)"):
        study.resume(arguments(study, tmp_path, "steps=100"))
    assert study.resume(arguments(study, tmp_path / "new")) is None


def test_arms_runs_only_the_arms_named_and_refuses_one_that_does_not_exist(tmp_path):
    data = Path(os.environ.get("ATTNREG_DATA_DIR") or ROOT.parent / "shared" / "data")
    if not (data / "ud_english_ewt").is_dir():
        pytest.skip(f"UD English EWT not found under {data} (the agreement pairs)")
    script = [sys.executable, str(ROOT / "benchmarks" / "decoder_agreement.py"), "--quick", "--out", str(tmp_path)]
    wrong = subprocess.run([*script, "--arms", "lm", "nsubj_2"], capture_output=True, text=True, cwd=ROOT)
    assert wrong.returncode == 2 and "--arms: no arm nsubj_2 (the arms: lm, nsubj_1, nsubj_few" in wrong.stderr
    assert not (tmp_path / "results.json").exists()
    subprocess.run([*script, "--arms", "nsubj_few", "lm"], check=True, capture_output=True, cwd=ROOT)
    report = json.loads((tmp_path / "results.json").read_text())
    assert set(report["runs"]["0"]) == {"lm", "nsubj_few"}
    assert set(report["summary"]) == {"lm", "nsubj_few"}  # the arms not run yet are not summarized
    assert report["summary"]["nsubj_few"]["paired_seeds"] == [0]  # paired with the LM arm of the same seed
    summary = report.pop("summary")
    (tmp_path / "results.json").write_text(json.dumps(report))  # a summary gone stale: nothing to run rewrites it
    again = subprocess.run([*script, "--arms", "lm"], check=True, capture_output=True, text=True, cwd=ROOT)
    assert "nothing to run" in again.stdout
    assert json.loads((tmp_path / "results.json").read_text())["summary"] == summary
    pieces = (tmp_path / "results.md").read_text().split("## Pieces")[1]
    assert "--arms nsubj_few lm" in pieces and ": 0/nsubj_few, 0/lm" in pieces
