"""One table from every `cola_syntax_prior.py` run: CoLA dev MCC and parent accuracy per prior weight,
with the MCC difference paired by seed against the baseline runs of the same settings.

The runs are deterministic per seed (CPU, one thread), so baselines and prior runs from different folders
pair up when their seeds, epochs and heads agree. Run after `cola_syntax_prior.py`:

    python benchmarks/cola_syntax_prior_summary.py            # reads and writes benchmarks/results/cola_syntax_prior/
    python benchmarks/cola_syntax_prior_summary.py --quick    # the same table, written to a temporary folder

It reads `<results>/*/results.json` (quick runs skipped) and writes `summary.{md,json}`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

from common import RESULTS, table, write_results


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"


def collect(results: Path) -> dict[tuple, dict[int, dict]]:
    """(variant, weight, warmup, epochs, heads) -> seed -> run (with its run folder's name)."""
    groups: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for path in sorted(results.glob("*/results.json")):
        report = json.loads(path.read_text())
        setup = report["setup"]
        if setup.get("quick"):
            continue
        for run in report["runs"]:
            baseline = run["variant"] == "baseline"  # the prior's weight and warmup do not touch it
            weight, warmup = (None, 0.0) if baseline else (setup["weight"], setup.get("weight_warmup", 0.0))
            key = (run["variant"], weight, warmup, setup["epochs"], str(setup["heads"]))
            seen = groups[key].get(run["seed"])
            if seen is not None and (seen["mcc"], seen["supervised_mean"]) != (run["mcc"], run["supervised_mean"]):
                raise SystemExit(f"{path}: {key} seed {run['seed']} differs from the same run in {seen['runs']}")
            runs = (seen["runs"] if seen else []) + [path.parent.name]  # the runs are deterministic per seed
            groups[key][run["seed"]] = {**run, "runs": runs}
    return groups


def summarize(groups: dict[tuple, dict[int, dict]]) -> list[dict]:
    """One row per group, prior weights from the largest down, with the MCC paired by seed."""
    rows = []
    for (variant, weight, warmup, epochs, heads), runs in sorted(groups.items(), key=lambda item: -(item[0][1] or 9)):
        baseline = groups.get(("baseline", None, 0.0, epochs, heads), {})
        seeds = sorted(runs)
        rows.append(
            {
                "variant": variant,
                "weight": weight,
                "warmup": warmup,
                "epochs": epochs,
                "heads": heads,
                "seeds": seeds,
                "mcc": [runs[s]["mcc"] for s in seeds],
                "paired_mcc_difference": [
                    runs[s]["mcc"] - baseline[s]["mcc"] for s in seeds if s in baseline and variant != "baseline"
                ],
                "supervised_mean": [runs[s]["supervised_mean"] for s in seeds],
                "best_head_accuracy": [runs[s]["best_head_accuracy"] for s in seeds],
                "best_head": runs[seeds[0]]["best_head"],
                "runs": sorted({name for s in seeds for name in runs[s]["runs"]}),
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    cells = [
        [
            row["variant"],
            "-" if row["weight"] is None else row["weight"],
            row["warmup"] or "-",
            row["epochs"],
            ",".join(map(str, row["seeds"])),
            _spread(row["mcc"]),
            _spread(row["paired_mcc_difference"]) if row["paired_mcc_difference"] else "-",
            _spread(row["supervised_mean"]),
            f"{_spread(row['best_head_accuracy'])} ({row['best_head']})",
            ", ".join(row["runs"]),
        ]
        for row in rows
    ]
    header = ["variant", "weight", "warmup", "epochs", "seeds", "CoLA dev MCC", "paired MCC difference"]
    header += ["supervised heads (mean)", "best head", "runs"]
    lines = [
        "# Syntax prior on CoLA: every run so far",
        "",
        "Pretrained MiniLM, one supervised head per layer; parent accuracy (word level) on EWT dev gold trees. "
        "MCC difference paired by seed against the baseline with the same epochs and heads. Each run is a "
        "folder beside this file. `python benchmarks/cola_syntax_prior_summary.py`",
        "",
        *table(header, cells, "lrrrlrrrrl"),
        "",
        "Run `default` (weight 1) predates the parent-accuracy rewrite that excludes a word's attention "
        "to itself (Clark et al.); the pretrained best head reads 43.3 under both.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS / "cola_syntax_prior", help="the runs' folder")
    parser.add_argument("--quick", action="store_true", help="smoke run: the same table, to a temporary folder")
    parser.add_argument("--out", type=Path, help="write summary.{md,json} here (default: --results)")
    args = parser.parse_args()
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="cola_syntax_prior_summary_")) if args.quick else args.results
    rows = summarize(collect(args.results))
    if not rows:
        raise SystemExit(f"no cola_syntax_prior results in {args.results}/*/results.json")
    text = markdown(rows)
    write_results(args.out, {"rows": rows}, text, args, name="summary")
    print(text)


if __name__ == "__main__":
    main()
