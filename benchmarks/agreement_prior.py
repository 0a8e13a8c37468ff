"""Does the syntax prior make the built-in agreement task generalise? Paired seeds, with and without it.

Runs the training app as one multirun, variants interleaved per seed:

    attnreg-train -m seed=0,1,2,3,4 attnreg.syntax_prior_kl.weight=0,1

(weight 0 keeps the same callback and attention capture, so the two variants differ only in the
prior's gradient), then pairs the runs by seed: accuracy on the hard split (2 distractor verbs; training
has 0-1), on held-out sentences like the training ones, and the supervised heads' parent accuracy,
as mean ± std, plus the per-seed differences and the median training time of each variant.
Writes `benchmarks/results/agreement_prior/<--run>/results.{json,md}` (default `default`) or `--out DIR`.

    python benchmarks/agreement_prior.py                 # full: 5 seeds x 2 variants (about 10 x 15-40 s on 2 cores)
    python benchmarks/agreement_prior.py --quick         # smoke run: 1 seed, 1 short epoch, to a temp folder
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_output_arguments, output_dir, write_results

from attnreg.app.collect import load_runs, value_at

WEIGHT = "attnreg.syntax_prior_kl.weight"
METRICS = {
    "hard": "accuracy.hard",
    "test": "accuracy.test",
    "supervised_heads": "parent_accuracy.supervised_mean",
    "train_seconds": "train_seconds",
}


def run_sweep(seeds: list[int], extra: list[str], sweep_dir: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "attnreg.app.train",
        "-m",
        f"seed={','.join(map(str, seeds))}",
        f"{WEIGHT}=0,1",
        "trainer.enable_progress_bar=false",
        f"hydra.sweep.dir={sweep_dir}",
        *extra,
    ]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True)


def paired(runs: list[dict]) -> dict:
    by_seed: dict[str, dict[str, dict]] = {}
    for run in runs:
        by_seed.setdefault(run["overrides"]["seed"], {})[run["overrides"][WEIGHT]] = run["summary"]
    seeds = sorted(seed for seed, variants in by_seed.items() if {"0", "1"} <= set(variants))
    per_seed = [
        {
            "seed": int(seed),
            **{
                f"{name}_{variant}": value_at(by_seed[seed][weight], path)
                for name, path in METRICS.items()
                for variant, weight in (("without", "0"), ("with", "1"))
            },
        }
        for seed in seeds
    ]
    summary = {}
    for name in METRICS:
        without = [row[f"{name}_without"] for row in per_seed]
        with_prior = [row[f"{name}_with"] for row in per_seed]
        differences = [b - a for a, b in zip(without, with_prior, strict=True)]
        summary[name] = {
            "without": _stats(without),
            "with": _stats(with_prior),
            "difference": _stats(differences),
            "prior_wins": sum(d > 0 for d in differences),
        }
    return {"seeds": [int(s) for s in seeds], "per_seed": per_seed, "summary": summary}


def _stats(values: list[float]) -> dict:
    return {
        "mean": statistics.mean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "median": statistics.median(values),
    }


def _pm(stats: dict, scale: float = 100.0) -> str:
    return f"{scale * stats['mean']:.1f} ± {scale * stats['std']:.1f}"


def markdown(report: dict) -> str:
    s, setup = report["summary"], report["setup"]
    n = len(report["seeds"])
    lines = [
        "# Syntax prior on the built-in agreement task",
        "",
        f"`{setup['command']}`",
        "",
        f"Tiny BERT (2 layers x 4 heads x 64), {setup['train_sentences']} training sentences with 0-1 distractor "
        f"verbs, {setup['epochs']} epochs; prior weight 1 (against 0) on head 0 of every layer. "
        f"Seeds {report['seeds']}, paired (same data and initialisation per seed). Accuracy in %, mean ± std.",
        "",
        "| | without prior | with prior | paired difference | prior better |",
        "|---|---:|---:|---:|---:|",
        f"| hard split (2 distractor verbs) | {_pm(s['hard']['without'])} | {_pm(s['hard']['with'])} | "
        f"{_pm(s['hard']['difference'])} | {s['hard']['prior_wins']}/{n} |",
        f"| held-out, 0-1 distractor verbs | {_pm(s['test']['without'])} | {_pm(s['test']['with'])} | "
        f"{_pm(s['test']['difference'])} | {s['test']['prior_wins']}/{n} |",
        f"| parent accuracy of head 0 (mean of layers) | {_pm(s['supervised_heads']['without'])} | "
        f"{_pm(s['supervised_heads']['with'])} | {_pm(s['supervised_heads']['difference'])} | "
        f"{s['supervised_heads']['prior_wins']}/{n} |",
        "",
        f"Median training time per run: {s['train_seconds']['without']['median']:.1f} s without, "
        f"{s['train_seconds']['with']['median']:.1f} s with the prior (ratio "
        f"{s['train_seconds']['with']['median'] / s['train_seconds']['without']['median']:.2f}); "
        f"whole sweep {report['seconds']:.0f} s. Per-seed values are in the JSON.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--sweep-dir", type=Path, default=None, help="keep the runs here (default: a temp folder)")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for every run")
    add_output_arguments(parser, "1 seed, 64 sentences, 1 epoch")
    args = parser.parse_args()
    args.out = output_dir(args, "agreement_prior")
    extra = list(args.overrides)
    seeds = args.seeds
    if args.quick:
        seeds = seeds[:1]
        extra += ["data.train=64", "data.val=32", "data.test=32", "data.hard=32", "trainer.max_epochs=1"]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        sweep_dir = args.sweep_dir or Path(scratch) / "sweep"
        run_sweep(seeds, extra, sweep_dir)
        runs = load_runs(sweep_dir)
    seconds = time.perf_counter() - started
    config = runs[0]["summary"]
    report = {
        "setup": {
            "command": f"attnreg-train -m seed={','.join(map(str, seeds))} {WEIGHT}=0,1 {' '.join(extra)}".strip(),
            "train_sentences": next((o.split("=")[1] for o in extra if o.startswith("data.train=")), "500"),
            "epochs": config["epochs"],
            "steps": config["steps"],
            "quick": args.quick,
        },
        **paired(runs),
        "seconds": round(seconds, 1),
    }
    write_results(args.out, report, markdown(report), args)
    print(markdown(report))


if __name__ == "__main__":
    main()
