"""A multirun whose jobs fail ends failed, naming every failed job's overrides and error (Hydra alone raises the
first one's and names no other), each failed job keeps its traceback in `error.txt`, and `attnreg-collect` says which
jobs its table lacks."""

import json
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from attnreg.app import collect
from attnreg.app.train import main

SMALL = ["data.val=32", "data.test=16", "data.hard=16", "trainer.max_epochs=1", "attnreg=none"]
QUIET = ["trainer.enable_progress_bar=False", "hydra/job_logging=none", "hydra/hydra_logging=none"]


def test_failed_jobs_are_named_and_fail_the_multirun(tmp_path, monkeypatch, capsys):
    """Three jobs from another folder; the first and the last have a bad `data.train`, the middle one trains."""
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    argv = ["attnreg-train", "-m", "data.train=-5,64,-7", *SMALL, *QUIET, f"hydra.sweep.dir={sweep}"]
    with mock.patch.object(sys, "argv", argv), pytest.raises(SystemExit) as exit:
        main()
    assert exit.value.code == 1
    err = capsys.readouterr().err
    first = f"job 0 failed (data.train=-5 {' '.join(SMALL + QUIET[:1])}): ValueError: count must be >= 0, got -5"
    last = f"job 2 failed (data.train=-7 {' '.join(SMALL + QUIET[:1])}): ValueError: count must be >= 0, got -7"
    for job, line in [(0, first), (2, last)]:
        assert f"attnreg-train: {line} (traceback: {sweep / str(job) / 'error.txt'})" in err  # as it failed
    assert f"attnreg-train: 2 of 3 jobs failed in {sweep}:\n  {first}\n  {last}\n" in err  # and at the end
    assert "job 1 failed" not in err and (sweep / "1" / "summary.json").is_file()
    traceback = (sweep / "2" / "error.txt").read_text()
    assert traceback.startswith(last + "\nTraceback") and 'raise ValueError(f"count must be >= 0' in traceback

    collect.main([str(sweep), "--metrics", "accuracy.val"])
    out, err = capsys.readouterr()
    assert f"attnreg-collect: 2 failed jobs are not in the table:\n  {first}\n  {last}\n" in err
    assert out.endswith(f"\nnot in the table: {first}\nnot in the table: {last}\n")
    assert json.loads((sweep / "collected.json").read_text())["failed"] == [first, last]


def test_a_single_run_is_left_to_hydras_report(tmp_path, monkeypatch, capsys):
    """A run (no -m) fails with Hydra's own report, without error.txt or a list of failed jobs."""
    monkeypatch.chdir(tmp_path)
    argv = ["attnreg-train", "data.train=-5", *SMALL, *QUIET, f"hydra.run.dir={tmp_path / 'run'}"]
    with mock.patch.object(sys, "argv", argv), pytest.raises(SystemExit):
        main()
    err = capsys.readouterr().err
    assert "count must be >= 0, got -5" in err and "failed" not in err
    assert not (tmp_path / "run" / "error.txt").exists()


@pytest.mark.slow
def test_joblib_workers_name_their_failed_jobs(tmp_path):
    """Under the joblib launcher (jobs in worker processes) the command names the failed job too."""
    script = Path(sys.executable).parent / "attnreg-train"
    command = [str(script), "-m", "launcher=joblib", "data.train=64,-5", *SMALL, *QUIET]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]
    overrides = " ".join(["launcher=joblib", "data.train=-5", *SMALL, QUIET[0]])
    line = f"job 1 failed ({overrides}): ValueError: count must be >= 0, got -5"
    assert f"attnreg-train: {line} (traceback: " in done.stderr
    assert f"attnreg-train: 1 of 2 jobs failed in {tmp_path}/multirun/" in done.stderr
    assert f"\n  {line}\n" in done.stderr
