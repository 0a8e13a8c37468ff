"""A multirun's failed jobs, each named as it fails and all of them at the end.

Hydra runs every job of a multirun (`attnreg-train -m ...`) and then raises the first failed job's error alone: the
other failures are named nowhere, and a long sweep shows its first failure only at its end. `FailedJobs`, a Hydra
callback that `configs/train.yaml` registers, prints `attnreg-train: job N failed (OVERRIDES): ERROR` to stderr as
each job fails (in the job's process, under any launcher) and writes that line and the traceback to the job's
`error.txt`; `report_failed_jobs` lists every failed job of the sweep once the multirun has ended (`attnreg-train`
runs Hydra inside `failed_jobs_reported`), and `attnreg-collect` names them beside its table.

Example:
    >>> import tempfile
    >>> sweep = Path(tempfile.mkdtemp())
    >>> (sweep / "0").mkdir(); (sweep / "1").mkdir()
    >>> _ = (sweep / "1" / ERROR_FILE).write_text("job 1 failed (seed=1): ValueError: bad\\nTraceback ...\\n")
    >>> failed_jobs(sweep)
    ['job 1 failed (seed=1): ValueError: bad']
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

ERROR_FILE = "error.txt"
_sweeps: list[Path] = []  # the sweep folders of the multiruns this process started, in order


class FailedJobs(Callback):
    """Names each failed job of a multirun (see the module docstring); a single run is left to Hydra's report.

    Example:
        >>> import tempfile
        >>> from omegaconf import OmegaConf
        >>> sweep = Path(tempfile.mkdtemp())
        >>> hydra = {"mode": RunMode.MULTIRUN, "job": {"num": 3}, "runtime": {"output_dir": str(sweep / "3")}}
        >>> config = OmegaConf.create({"hydra": hydra})
        >>> job = JobReturn(overrides=["seed=1", "lr=x"], status=JobStatus.FAILED, _return_value=ValueError("lr: x"))
        >>> FailedJobs().on_job_end(config, job)      # printed to stderr, written to error.txt
        >>> failed_jobs(sweep)
        ['job 3 failed (seed=1 lr=x): ValueError: lr: x']
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _sweeps.append(Path(config.hydra.sweep.dir).absolute())

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.status != JobStatus.FAILED or config.hydra.mode != RunMode.MULTIRUN:
            return
        try:
            job_return.return_value  # noqa: B018 (the property raises the job's error, and Hydra logs it)
        except BaseException as raised:  # whatever the job raised is what this reports
            error = raised
        else:
            return
        overrides = " ".join(job_return.overrides or []) or "no overrides"
        line = f"job {config.hydra.job.num} failed ({overrides}): {type(error).__name__}: {error}"
        path = Path(config.hydra.runtime.output_dir) / ERROR_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(line + "\n" + "".join(traceback.format_exception(error)))
        print(f"attnreg-train: {line} (traceback: {path})", file=sys.stderr, flush=True)


def failed_jobs(sweep_dir: str | Path) -> list[str]:
    """The first lines of the `error.txt` files under `sweep_dir` (`job N failed (OVERRIDES): ERROR`), by job.

    Example:
        >>> import tempfile
        >>> failed_jobs(tempfile.mkdtemp())
        []
    """
    paths = Path(sweep_dir).rglob(ERROR_FILE)
    ordered = sorted(paths, key=lambda path: [(not p.isdigit(), int(p) if p.isdigit() else 0, p) for p in path.parts])
    return [path.read_text().split("\n", 1)[0] for path in ordered]


@contextmanager
def failed_jobs_reported() -> Iterator[None]:
    """Around a Hydra main function: when it exits (Hydra's report of the first failed job), `report_failed_jobs`.

    Example:
        >>> with failed_jobs_reported():
        ...     raise SystemExit(1)          # no multirun started: nothing more to say
        Traceback (most recent call last):
        ...
        SystemExit: 1
    """
    _sweeps.clear()
    try:
        yield
    except SystemExit:
        report_failed_jobs()
        raise


def report_failed_jobs() -> list[str]:
    """Print to stderr the failed jobs of the last multirun this process started (none: nothing) and return them.

    Example:
        >>> report_failed_jobs()
        []
    """
    if not _sweeps:
        return []
    sweep = _sweeps[-1]
    failed = failed_jobs(sweep)
    if failed:
        jobs = sum(1 for path in sweep.rglob("overrides.yaml") if path.parent.name == ".hydra")
        lines = "".join(f"\n  {line}" for line in failed)
        print(f"attnreg-train: {len(failed)} of {jobs} jobs failed in {sweep}:{lines}", file=sys.stderr, flush=True)
    return failed
