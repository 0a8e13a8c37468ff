"""What the benchmark scripts share: where data and results live, reading SST-2, batching and scoring
a classifier, optimizer groups, the metadata of a run, and writing a results folder.

Every script writes `benchmarks/results/<script>/<run>/results.{json,md}` through `write_results`, which
puts `meta` first in the JSON (command line, git commit and whether the tree was dirty, date, machine,
library versions, every argparse setting, wall time) and appends the same as a "Run" section to the
markdown. `--quick` runs write to a temporary folder unless `--out` says where.

In a script (run as `python benchmarks/NAME.py`, so `common` is importable):

    parser = argparse.ArgumentParser()
    add_output_arguments(parser, "64 sentences, 4 steps")
    args = parser.parse_args()
    args.out = output_dir(args, "sst2_entropy")
    ...
    write_results(args.out, {"accuracy": 0.9}, "# SST-2\\n", args)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DATA = Path(os.environ.get("ATTNREG_DATA_DIR") or ROOT.parent / "shared" / "data")
VERSIONS = ("torch", "transformers", "lightning", "attnreg", "spacy")
META_KEYS = ("command", "git", "date", "machine", "versions", "settings", "wall_s")
STARTED = time.perf_counter()


# --- data and output folders ---------------------------------------------------------------------------


def data_path(*parts: str) -> Path:
    """`DATA/parts...` (the shared `../shared/data`, or `$ATTNREG_DATA_DIR`); exits saying what is missing."""
    path = DATA.joinpath(*parts)
    if not path.exists():
        raise SystemExit(
            f"{path} not found: this benchmark needs the shared data (SST-2, CoLA, UD English EWT) in {DATA}, "
            "the folder `shared/data` beside the repository; set ATTNREG_DATA_DIR to use another folder"
        )
    return path


def add_output_arguments(parser: argparse.ArgumentParser, quick: str) -> None:
    """`--quick` (help text `quick`), `--run NAME` and `--out DIR`: see `output_dir`."""
    parser.add_argument("--quick", action="store_true", help=f"smoke run, figures mean nothing: {quick}")
    parser.add_argument("--run", default="default", help="write to benchmarks/results/<script>/RUN/ (default: default)")
    parser.add_argument("--out", type=Path, help="write to this folder instead (--quick: a new temporary folder)")


def output_dir(args: argparse.Namespace, script: str) -> Path:
    """`--out` if given; with `--quick` a new temporary folder (never the committed results);
    else `benchmarks/results/<script>/<--run>`."""
    if args.out is not None:
        return Path(args.out)
    if args.quick:
        return Path(tempfile.mkdtemp(prefix=f"{script}_quick_"))
    return RESULTS / script / args.run


# --- SST-2 classification ------------------------------------------------------------------------------


def read_sst2(split: str, limit: int | None = None) -> tuple[list[str], list[int]]:
    """SST-2 `train` or `dev` from the shared data: sentences and 0/1 labels (the first `limit`)."""
    from attnreg.app.datasets import read_sst2 as read

    texts, labels = read(data_path("sst2"), split)
    return texts[:limit], labels[:limit]


def batches(tokenizer, texts: list[str], labels: list[int], size: int, max_length: int = 64) -> list[dict]:
    """Pre-collated batches of `size` (tensors), each padded to its longest sentence, with `labels`."""
    import torch

    out = []
    for start in range(0, len(texts), size):
        batch = tokenizer(
            texts[start : start + size], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        )
        out.append({**batch, "labels": torch.tensor(labels[start : start + size])})
    return out


def accuracy(model, data) -> float:
    """Share of examples whose argmax logit is the label (`attnreg.app.evaluation.accuracy`; any iterable of
    batches with `labels`; the model's train/eval mode is left as it was)."""
    from attnreg.app.evaluation import accuracy as score

    return score(model, data)


def parameter_groups(model, weight_decay: float, gate_lr: float | None = None) -> list[dict]:
    """AdamW groups as `attnreg.app.modules.SequenceClassifier` builds them: `decay`, `no_decay` (biases and
    norms) and `gates` (attnreg's head gates, no weight decay, at `gate_lr` when given)."""
    from attnreg.methods.pruning import gate_parameters

    gates = gate_parameters(model)
    gate_ids = {id(p) for p in gates}
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if id(parameter) not in gate_ids:
            (no_decay if parameter.ndim < 2 or "norm" in name.lower() else decay).append(parameter)
    gate_group = {"params": gates, "weight_decay": 0.0, "name": "gates"}
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
        gate_group if gate_lr is None else {**gate_group, "lr": gate_lr},
    ]


# --- metadata and results ------------------------------------------------------------------------------


def run_metadata(args: argparse.Namespace | None = None) -> dict[str, Any]:
    """Command line, git commit (and whether the tree was dirty), date, machine, library versions, the
    resolved settings (every argparse argument) and the wall time since the process started."""
    return {
        "command": command_line(),
        "git": GIT_AT_START,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        "settings": json.loads(json.dumps(vars(args) if args is not None else {}, default=str)),
        "wall_s": round(seconds_since_start(), 1),
    }


def write_results(
    out_dir: Path, results: dict, markdown: str, args: argparse.Namespace | None = None, name: str = "results"
) -> Path:
    """Write `out_dir/<name>.json` (`{"meta": run_metadata(args), **results}`) and `out_dir/<name>.md`
    (`markdown` followed by the run's metadata); returns the JSON's path."""
    meta = run_metadata(args)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(dumps({"meta": meta, **results}) + "\n")
    (out_dir / f"{name}.md").write_text(markdown.rstrip("\n") + "\n\n" + metadata_markdown(meta))
    print(f"wrote {path} and {name}.md ({meta['wall_s']:.0f} s)", flush=True)
    return path


def dumps(value: Any, indent: int = 0) -> str:
    """JSON indented by 2, with each list or object of plain values on one line (a per-step log, one head's
    figures), so that a results file stays short to read and to review.

    Example:
        >>> print(dumps({"loss": [0.5, 0.25], "grid": [[1, None], [3, 4]], "head": {"layer": 1, "name": "a, b"}}))
        {
          "loss": [0.5, 0.25],
          "grid": [
            [1, null],
            [3, 4]
          ],
          "head": {"layer": 1, "name": "a, b"}
        }
    """
    children = (
        list(value.values()) if isinstance(value, dict) else list(value) if isinstance(value, list | tuple) else []
    )
    if not any(isinstance(child, dict | list | tuple) for child in children):  # a plain value, or plain values
        return json.dumps(value, default=str)
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        inner = [f"{pad}{json.dumps(str(k))}: {dumps(v, indent + 2)}" for k, v in value.items()]
        return "{\n" + ",\n".join(inner) + "\n" + " " * indent + "}"
    return "[\n" + ",\n".join(f"{pad}{dumps(v, indent + 2)}" for v in value) + "\n" + " " * indent + "]"


def metadata_markdown(meta: dict[str, Any]) -> str:
    """The "Run" section `write_results` appends to every results.md."""
    git, box = meta["git"], meta["machine"]
    commit = f"{git['commit'][:12]}{' (uncommitted changes)' if git['dirty'] else ''}" if git["commit"] else "unknown"
    versions = ", ".join(f"{name} {version}" for name, version in meta["versions"].items() if version)
    threads = f"{box['torch_threads']} torch threads, " if box["torch_threads"] else ""
    return (
        "## Run\n\n"
        f"- Command: `{meta['command']}`\n"
        f"- Commit {commit}, {meta['date']}, wall time {meta['wall_s']:.0f} s\n"
        f"- Machine: {box['cpu']}, {box['cpus_available']} of {box['cpu_count']} CPUs, "
        f"{threads}{box['gpu'] or 'no GPU'}, {box['platform']}\n"
        f"- Versions: Python {box['python']}, {versions}\n"
    )


def quick_banner(quick: bool) -> list[str]:
    """The markdown lines that mark a `--quick` run (none for a real one)."""
    return ["**Quick smoke run (--quick): tiny model or subset; the figures mean nothing.**", ""] if quick else []


def table(header: list[str], rows: list[list[Any]], align: str = "") -> list[str]:
    """Markdown table lines; `align` has one letter per column, `l` or `r` (default: first left, rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def command_line() -> str:
    """How this process was started, as one could type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(shown), *sys.argv[1:]])


def git_state() -> dict[str, Any]:
    """The checked-out commit, and the files that differ from it (results folders aside)."""

    def git(*arguments: str) -> str | None:
        try:
            done = subprocess.run(["git", *arguments], cwd=ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain") or ""
    changed = [line[3:] for line in status.splitlines() if not line[3:].startswith("benchmarks/results/")]
    return {"commit": commit.strip() if commit else None, "dirty": bool(changed), "changed": changed[:20]}


def machine() -> dict[str, Any]:
    """CPU model and counts, torch threads, GPU, OS and Python."""
    cpu = platform.processor() or platform.machine()
    try:
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    torch = sys.modules.get("torch")  # only if the script uses it: importing torch takes seconds
    gpu = torch.cuda.get_device_name(0) if torch is not None and torch.cuda.is_available() else None
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "gpu": gpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def seconds_since_start() -> float:
    """Wall time since this process started (imports included), from /proc; else since this module loaded."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - STARTED


def versions() -> dict[str, str | None]:
    """Installed versions of torch, transformers, lightning, attnreg and spaCy (None when absent)."""
    found = {}
    for name in VERSIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


GIT_AT_START = git_state()  # the code that ran: taken when the script starts, not when it writes its results
