"""Collect the `summary.json` of every job of a Hydra multirun into one table.

Each job's overrides (from its `.hydra/overrides.yaml`) name its row; the overrides that differ between
jobs become columns, and jobs that differ only in `seed` are grouped: every metric as mean ± std over
seeds. Writes `collected.md` and `collected.json` into the sweep folder, prints the markdown, and says on
stderr which of the metrics it looked for it found (and the numbers the summaries do hold when it found none).
Decoder runs bring their own columns (validation perplexity, the supervised heads' parent accuracy over left
parents, the best left offset's); `--baseline KEY=VALUE` adds paired differences: each group's runs minus the
baseline group's run of the same seed, mean ± std over the pairs.

Example:
    $ attnreg-train -m attnreg.syntax_prior_kl.weight=0,1 seed=0,1,2
    $ attnreg-collect multirun/2025-01-31/12-00-00
    | attnreg.syntax_prior_kl.weight | runs | accuracy.hard | accuracy.test | ... |
    $ attnreg-train -m data=agreement_lm attnreg.syntax_prior_kl.weight=0,0.3 seed=0,1,2 launcher=joblib
    $ attnreg-collect multirun/2025-01-31/13-00-00 --baseline attnreg.syntax_prior_kl.weight=0
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from attnreg.app.failed_jobs import failed_jobs

DEFAULT_METRICS = (
    "accuracy.val",
    "accuracy.test",
    "accuracy.hard",
    "perplexity.val",
    "parent_accuracy.supervised_mean",
    "parent_accuracy.best_offset_accuracy",
    "train_seconds",
)


def load_runs(sweep_dir: str | Path) -> list[dict[str, Any]]:
    r"""Every job under `sweep_dir` with a `summary.json`: `{"job", "overrides", "summary"}`, by job folder.

    Example:
        >>> import tempfile
        >>> sweep = Path(tempfile.mkdtemp())                       # multirun/DATE/TIME, two jobs
        >>> for job, seed, accuracy in [("0", 0, 0.8), ("1", 1, 0.9)]:
        ...     (sweep / job / ".hydra").mkdir(parents=True)
        ...     _ = (sweep / job / ".hydra" / "overrides.yaml").write_text(f"- seed={seed}\n- attnreg=none\n")
        ...     _ = (sweep / job / "summary.json").write_text(json.dumps({"accuracy": {"val": accuracy}}))
        >>> load_runs(sweep)[1]
        {'job': '1', 'overrides': {'seed': '1', 'attnreg': 'none'}, 'summary': {'accuracy': {'val': 0.9}}}
        >>> load_runs(sweep / "0" / ".hydra")
        Traceback (most recent call last):
        ...
        FileNotFoundError: no summary.json under /.../0/.hydra (is it the folder of a finished multirun?)
    """
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"sweep folder {str(sweep_dir)!r} does not exist")
    runs = []
    for path in sorted(sweep_dir.rglob("summary.json")):
        job = path.parent
        overrides_file = job / ".hydra" / "overrides.yaml"
        overrides = OmegaConf.to_container(OmegaConf.load(overrides_file)) if overrides_file.is_file() else []
        runs.append(
            {
                "job": str(job.relative_to(sweep_dir)),
                "overrides": dict(override.split("=", 1) for override in overrides or []),
                "summary": json.loads(path.read_text()),
            }
        )
    if not runs:
        raise FileNotFoundError(f"no summary.json under {sweep_dir} (is it the folder of a finished multirun?)")
    return runs


def value_at(summary: Mapping[str, Any], path: str) -> float | None:
    """The number at a dotted `path` of `summary` ("accuracy.hard"); None where it is missing.

    Example:
        >>> summary = {"accuracy": {"hard": 0.75, "val": 1}, "pruning": None, "passed": True}
        >>> [value_at(summary, path) for path in ("accuracy.hard", "accuracy.val", "accuracy.test", "passed")]
        [0.75, 1.0, None, None]
    """
    value: Any = summary
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def varying_keys(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Override keys whose value differs between runs (or that some runs lack), in first-seen order.

    Example:
        >>> runs = [{"overrides": {"seed": "0", "lr": "0.1"}}, {"overrides": {"seed": "1", "lr": "0.1", "a": "none"}}]
        >>> varying_keys(runs)                               # lr is the same everywhere; one run lacks a
        ['seed', 'a']
    """
    keys = list(dict.fromkeys(key for run in runs for key in run["overrides"]))
    return [key for key in keys if len({run["overrides"].get(key) for run in runs}) > 1]


def collect(
    runs: Sequence[Mapping[str, Any]], metrics: Iterable[str] = DEFAULT_METRICS, over: str = "seed"
) -> dict[str, Any]:
    """Group `runs` by their varying overrides except `over`, and summarize each metric per group.

    Returns `{"keys": [...], "metrics": [...], "missing": [...], "groups": [{"overrides", "runs", "<metric>":
    {"mean", "std", "values"}}]}`; metrics that no run has are left out of `metrics` and listed in `missing`.

    Example:
        >>> rows = [("0", "0", 0.5), ("0", "1", 0.7), ("1", "0", 0.9)]            # weight, seed, val accuracy
        >>> runs = [{"overrides": {"weight": w, "seed": s}, "summary": {"accuracy": {"val": v}}} for w, s, v in rows]
        >>> table = collect(runs, metrics=["accuracy.val", "accuracy.test"])
        >>> table["keys"], table["metrics"], table["missing"]               # no run has accuracy.test
        (['weight'], ['accuracy.val'], ['accuracy.test'])
        >>> table["groups"][0]
        {'overrides': {'weight': '0'}, 'runs': 2, 'accuracy.val': {'mean': 0.6, 'std': 0.141, 'values': [0.5, 0.7]}}
    """
    keys = [key for key in varying_keys(runs) if key != over]
    wanted = list(metrics)
    metrics = [m for m in wanted if any(value_at(run["summary"], m) is not None for run in runs)]
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for run in runs:
        groups.setdefault(tuple(run["overrides"].get(key) for key in keys), []).append(run)
    rows = []
    for values, members in groups.items():
        row: dict[str, Any] = {"overrides": dict(zip(keys, values, strict=True)), "runs": len(members)}
        for name in metrics:
            numbers = [v for v in (value_at(run["summary"], name) for run in members) if v is not None]
            row[name] = {
                "mean": statistics.mean(numbers) if numbers else math.nan,
                "std": statistics.stdev(numbers) if len(numbers) > 1 else 0.0,
                "values": numbers,
            }
        rows.append(row)
    return {"keys": keys, "metrics": metrics, "missing": [m for m in wanted if m not in metrics], "groups": rows}


def paired_differences(
    runs: Sequence[Mapping[str, Any]], table: Mapping[str, Any], baseline: Mapping[str, str], over: str = "seed"
) -> dict[str, Any]:
    """Per group of `table` other than the `baseline` one ({override: value}), each metric's differences to the
    baseline run with the same `over` value (the seed): `{"baseline", "groups": [{"overrides", "pairs", "<metric>":
    {"mean", "std", "values"}}]}`. Raises when no group matches `baseline`.

    Example:
        >>> rows = [("0", "0", 0.5), ("0", "1", 0.7), ("1", "0", 0.9), ("1", "1", 0.8)]      # weight, seed, accuracy
        >>> runs = [{"overrides": {"w": w, "seed": s}, "summary": {"accuracy": {"val": v}}} for w, s, v in rows]
        >>> table = collect(runs, metrics=["accuracy.val"])
        >>> paired_differences(runs, table, {"w": "0"})["groups"][0]["accuracy.val"]["values"]
        [0.4, 0.10000000000000009]
        >>> paired_differences(runs, table, {"w": "2"})
        Traceback (most recent call last):
        ...
        ValueError: --baseline w=2 matches no group; the groups are: {'w': '0'}, {'w': '1'}
        >>> paired_differences(runs[:2], collect(runs[:2], ["accuracy.val"]), {"w": "0"})   # seeds of one setting
        Traceback (most recent call last):
        ...
        ValueError: --baseline w=0: the sweep has one group (only seed varies), so there is nothing to pair with it; ...
    """
    keys = table["keys"]
    shown = ",".join(f"{k}={v}" for k, v in baseline.items())
    if not keys:
        raise ValueError(
            f"--baseline {shown}: the sweep has one group (only {over} varies), so there is nothing to pair with it; "
            f"sweep the baseline and the other settings together (attnreg-train -m {shown},... {over}=0,1,2)"
        )

    def group_of(run: Mapping[str, Any]) -> dict[str, Any]:
        return {key: run["overrides"].get(key) for key in keys}

    wanted = {key: str(value) for key, value in baseline.items()}
    base = {run["overrides"].get(over): run for run in runs if {k: group_of(run).get(k) for k in wanted} == wanted}
    if not base:
        groups = ", ".join(str(group["overrides"]) for group in table["groups"])
        raise ValueError(f"--baseline {shown} matches no group; the groups are: {groups}")
    rows = []
    for group in table["groups"]:
        if {k: group["overrides"].get(k) for k in wanted} == wanted:
            continue
        members = [run for run in runs if group_of(run) == group["overrides"] and run["overrides"].get(over) in base]
        row: dict[str, Any] = {"overrides": group["overrides"], "pairs": len(members)}
        for name in table["metrics"]:
            values = []
            for run in members:
                mine, theirs = (
                    value_at(run["summary"], name),
                    value_at(base[run["overrides"].get(over)]["summary"], name),
                )
                if mine is not None and theirs is not None:
                    values.append(mine - theirs)
            row[name] = {
                "mean": statistics.mean(values) if values else math.nan,
                "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "values": values,
            }
        rows.append(row)
    return {"baseline": wanted, "keys": keys, "metrics": table["metrics"], "groups": rows}


def paired_markdown(differences: Mapping[str, Any]) -> str:
    """The paired differences as markdown, one row per group (see `paired_differences`).

    Example:
        >>> rows = [("0", "0", 0.5), ("0", "1", 0.7), ("1", "0", 0.9), ("1", "1", 0.8)]
        >>> runs = [{"overrides": {"w": w, "seed": s}, "summary": {"accuracy": {"val": v}}} for w, s, v in rows]
        >>> print(paired_markdown(paired_differences(runs, collect(runs, ["accuracy.val"]), {"w": "0"})), end="")
        Paired differences against w=0 (same seed):
        <BLANKLINE>
        | w | pairs | accuracy.val |
        |---|---|---|
        | 1 | 2 | 0.250 ± 0.212 |
    """
    shown = ",".join(f"{k}={v}" for k, v in differences["baseline"].items())
    header = [*differences["keys"], "pairs", *differences["metrics"]]
    lines = [f"Paired differences against {shown} (same seed):", "", "| " + " | ".join(header) + " |"]
    lines.append("|" + "---|" * len(header))
    for row in differences["groups"]:
        cells = [str(row["overrides"][key]) for key in differences["keys"]] + [str(row["pairs"])]
        cells += [_mean_std(row[name]) for name in differences["metrics"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def numeric_paths(summaries: Iterable[Mapping[str, Any]]) -> list[str]:
    """The dotted paths of every number in `summaries`, in first-seen order: what `--metrics` can name.

    Example:
        >>> numeric_paths([{"accuracy": {"val": 0.9}, "seed": 0, "name": "a"}, {"metrics": {"val/mcc": 0.1}}])
        ['accuracy.val', 'seed', 'metrics.val/mcc']
    """
    found: dict[str, None] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, f"{prefix}{key}.")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            found[prefix[:-1]] = None

    for summary in summaries:
        walk(summary, "")
    return list(found)


def report(table: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> str:
    """What the collector looked for and found, for the user (an empty table must not pass unnoticed).

    Example:
        >>> runs = [{"overrides": {"seed": "0"}, "summary": {"metrics": {"val/mcc": 0.1}, "steps": 10}}]
        >>> print(report(collect(runs, metrics=["accuracy.val"]), runs))
        attnreg-collect: 1 run; none of the metrics looked for (accuracy.val) is in any summary.json.
        The summaries hold: metrics.val/mcc, steps; name them with --metrics.
        >>> print(report(collect(runs, metrics=["steps", "accuracy.val"]), runs))
        attnreg-collect: 1 run; metrics found: steps; in no summary.json: accuracy.val
    """
    looked_for = [*table["metrics"], *table["missing"]]
    counted = f"attnreg-collect: {len(runs)} run{'' if len(runs) == 1 else 's'}"
    if not table["metrics"]:
        held = ", ".join(numeric_paths(run["summary"] for run in runs)) or "no numbers"
        return (
            f"{counted}; none of the metrics looked for ({', '.join(looked_for) or 'none'}) is in any summary.json.\n"
            f"The summaries hold: {held}; name them with --metrics."
        )
    text = f"{counted}; metrics found: {', '.join(table['metrics'])}"
    return text + (f"; in no summary.json: {', '.join(table['missing'])}" if table["missing"] else "")


def markdown(table: Mapping[str, Any]) -> str:
    """The collected table as markdown: one row per group, `mean ± std` per metric.

    Example:
        >>> rows = [("0", "0", 0.5), ("0", "1", 0.7), ("1", "0", 0.9)]            # weight, seed, val accuracy
        >>> runs = [{"overrides": {"weight": w, "seed": s}, "summary": {"accuracy": {"val": v}}} for w, s, v in rows]
        >>> print(markdown(collect(runs, metrics=["accuracy.val"])), end="")
        | weight | runs | accuracy.val |
        |---|---|---|
        | 0 | 2 | 0.600 ± 0.141 |
        | 1 | 1 | 0.900 |
    """
    header = [*table["keys"], "runs", *table["metrics"]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in table["groups"]:
        cells = [str(row["overrides"][key]) for key in table["keys"]] + [str(row["runs"])]
        cells += [_mean_std(row[name]) for name in table["metrics"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _mean_std(stats: Mapping[str, Any]) -> str:
    if math.isnan(stats["mean"]):
        return "-"
    text = f"{stats['mean']:.3f}"
    return text + (f" ± {stats['std']:.3f}" if len(stats["values"]) > 1 else "")


def main(argv: Sequence[str] | None = None) -> None:
    r"""`attnreg-collect SWEEP_DIR [--metrics ...] [--over seed]`: see the module docstring.

    Example:
        >>> import tempfile
        >>> sweep = Path(tempfile.mkdtemp())                       # multirun/DATE/TIME, two jobs
        >>> for job, seed, accuracy in [("0", 0, 0.8), ("1", 1, 0.9)]:
        ...     (sweep / job / ".hydra").mkdir(parents=True)
        ...     _ = (sweep / job / ".hydra" / "overrides.yaml").write_text(f"- seed={seed}\n- attnreg=none\n")
        ...     _ = (sweep / job / "summary.json").write_text(json.dumps({"accuracy": {"val": accuracy}}))
        >>> main([str(sweep), "--metrics", "accuracy.val", "accuracy.test"])     # seeds grouped, no accuracy.test
        | runs | accuracy.val |
        |---|---|
        | 2 | 0.850 ± 0.071 |
        >>> sorted(path.name for path in sweep.iterdir())
        ['0', '1', 'collected.json', 'collected.md']
    """
    parser = argparse.ArgumentParser(description="Collect the summaries of an attnreg-train multirun into a table.")
    parser.add_argument("sweep_dir", help="the multirun folder (multirun/DATE/TIME)")
    parser.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS), help="dotted paths into summary.json")
    parser.add_argument("--over", default="seed", help="the override averaged over (default: seed)")
    parser.add_argument(
        "--baseline", nargs="+", default=None, metavar="KEY=VALUE", help="add paired differences against this group"
    )
    args = parser.parse_args(argv)
    failed = failed_jobs(args.sweep_dir) if Path(args.sweep_dir).is_dir() else []
    if failed:  # a table over fewer seeds than the sweep ran says so
        print(f"attnreg-collect: {len(failed)} failed jobs are not in the table:", *failed, sep="\n  ", file=sys.stderr)
    runs = load_runs(args.sweep_dir)
    table = collect(runs, args.metrics, args.over)
    text = markdown(table) + ("\n" if failed else "") + "".join(f"not in the table: {line}\n" for line in failed)
    collected: dict[str, Any] = {**table, "runs": runs, "failed": failed}
    if args.baseline:
        if not all("=" in item for item in args.baseline):
            parser.error(f"--baseline takes KEY=VALUE pairs, got {args.baseline}")
        try:
            differences = paired_differences(runs, table, dict(i.split("=", 1) for i in args.baseline), args.over)
        except ValueError as error:
            parser.error(str(error))  # a message and exit status 2, not a traceback
        text += "\n" + paired_markdown(differences)
        collected["paired"] = differences
    sweep_dir = Path(args.sweep_dir)
    (sweep_dir / "collected.md").write_text(text)
    (sweep_dir / "collected.json").write_text(json.dumps(collected, indent=2) + "\n")
    print(text, end="")
    print(report(table, runs), file=sys.stderr)  # stdout stays the markdown alone


if __name__ == "__main__":
    main()
