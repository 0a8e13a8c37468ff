"""One table and one figure from every `sst2_pruning` result: each method and setting, per seed, at 40%,
50% and 60% of MiniLM's 72 heads removed, against the unpruned fine-tune of the same seed.

Reads every `benchmarks/results/sst2_pruning/<run>/results.json` and writes `summary.{md,json,png}`
beside them. Every run of `sst2_pruning.py` is deterministic per seed (CPU, one thread), so runs in
different folders with the same seed share their unpruned baseline (checked here; a run made with
`--no-baseline` borrows its seed's). Run after them:

    python benchmarks/sst2_pruning_summary.py
    python benchmarks/sst2_pruning_summary.py --quick      # smoke run: the same table, to a temporary folder
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import RESULTS, write_results

REMOVED = (29, 36, 43)  # 40%, 50% and 60% of 72
NAMES = {
    "importance": "(a) importance, no retraining",
    "l1": "(b) L1 gates, then removal",
    "hard_concrete": "(c) hard-concrete, exact target",
    "progressive": "(d) progressive L1",
    "retrain": "(e) importance, then a recovery fine-tune",
    "distill": "(f) importance, then distillation",
}


def setting(method: str, settings: dict) -> str:
    """The options that set the method apart, as a short label."""
    if method in ("l1", "progressive"):
        return f"weight {settings['l1_weight']}"
    if method == "hard_concrete":
        at = settings.get("hc_prune_at", 1.0)
        removal = "removal at the end" if at >= 1 else f"removal at {at:.0%}, then fine-tuning"
        if "hc_lagrangian_lr" not in settings:  # before issue 18: plain dual ascent on a fractional gap
            return f"dual ascent on a fractional gap, gates lr {settings['hc_gate_lr']}, {removal}"
        return f"Adam ascent on a gap in heads, gates lr {settings['hc_gate_lr']}, {removal}"
    if method == "retrain":
        return f"{settings['retrain_epochs']} epoch at lr {settings['retrain_lr']}"
    if method == "distill":
        hidden = "logits" if settings["distill_hidden"] == 0 else f"logits + hidden x {settings['distill_hidden']}"
        return f"{settings['distill']} sentences, lr {settings['distill_lr']}, {hidden}"
    return ""


def collect(results: Path) -> tuple[dict[int, float], dict[tuple, dict[int, float]]]:
    """Unpruned accuracy per seed, and (seed, method, setting) -> heads removed -> accuracy."""
    baselines: dict[int, float] = {}
    curves: dict[tuple, dict[int, float]] = {}
    for path in sorted(results.glob("*/results.json")):
        report = json.loads(path.read_text())
        if report.get("quick"):
            continue
        settings = report.get("settings") or report["meta"]["settings"]
        seed = settings["seed"]
        unpruned = report["unpruned_accuracy"]
        if unpruned is not None and baselines.setdefault(seed, unpruned) != unpruned:
            raise SystemExit(f"{path}: unpruned {unpruned} differs from seed {seed}'s other runs")
        for p in report["points"]:
            if p["heads_removed"] == 0 and p["method"] == "importance":
                continue  # the unpruned model itself
            key = (seed, p["method"], setting(p["method"], settings))
            curve = curves.setdefault(key, {})
            if curve.setdefault(p["heads_removed"], p["accuracy"]) != p["accuracy"]:
                raise SystemExit(f"{path}: {key} at {p['heads_removed']} removed differs from an earlier run")
    return baselines, curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS / "sst2_pruning", help="the runs' folder")
    parser.add_argument("--quick", action="store_true", help="smoke run: the same table, to a temporary folder")
    parser.add_argument("--out", type=Path, help="write summary.{md,json,png} here (default: --results)")
    args = parser.parse_args()
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="sst2_pruning_summary_")) if args.quick else args.results
    baselines, curves = collect(args.results)
    if 0 not in baselines:
        raise SystemExit(f"no sst2_pruning result with an unpruned seed-0 baseline in {args.results}/*/results.json")
    lines = [
        "# SST-2 head pruning: every run so far (MiniLM, 72 heads)",
        "",
        "Accuracy on the 872 dev sentences and the gap to the unpruned fine-tune of the same seed (points); "
        "one sentence is 0.11 points. Targets: 40% removed within 0.5 point, 50% within 1.",
        "",
        "The 0-removed column is, for (b), the gated model before any removal, and for (e) and (f) their control: "
        "the unpruned model given the same recovery. Every gap is to the unpruned fine-tune.",
        "",
        "| seed | unpruned | method | setting | 0 removed | 40% (29) | 50% (36) | 60% (43) |",
        "|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for (seed, method, label), curve in sorted(
        curves.items(), key=lambda item: (item[0][0], list(NAMES).index(item[0][1]), item[0][2])
    ):
        base = baselines.get(seed)
        cells = [
            (
                "-"
                if k not in curve
                else f"{100 * curve[k]:.2f}" + (f" ({100 * (curve[k] - base):+.2f})" if base else "")
            )
            for k in (0, *REMOVED)
        ]
        unpruned = f"{100 * base:.2f}" if base else "-"
        lines.append(f"| {seed} | {unpruned} | {NAMES[method]} | {label} | " + " | ".join(cells) + " |")
    lines += ["", "![seed 0](summary.png)"]
    rows = [
        {"seed": seed, "method": method, "setting": label, "accuracy": {str(k): v for k, v in sorted(curve.items())}}
        for (seed, method, label), curve in sorted(curves.items())
    ]
    write_results(args.out, {"unpruned": baselines, "rows": rows}, "\n".join(lines), args, name="summary")
    plot(baselines[0], {key[1:]: curve for key, curve in curves.items() if key[0] == 0}, args.out)
    print("\n".join(lines))


def plot(base: float, curves: dict[tuple, dict[int, float]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(12, 5))
    for (method, label), curve in sorted(curves.items(), key=lambda item: (list(NAMES).index(item[0][0]), item[0][1])):
        removed = sorted(k for k in curve if k)  # without the controls
        style = dict(marker="o", linestyle="-" if len(removed) > 1 else "none")
        axes.plot(
            [100 * k / 72 for k in removed],
            [100 * curve[k] for k in removed],
            label=", ".join(filter(None, [NAMES[method], label])),
            **style,
        )
    axes.axhline(100 * base, color="black", linewidth=1, label=f"unpruned ({100 * base:.2f})")
    axes.axhline(100 * base - 0.5, color="gray", linestyle="--", linewidth=1, label="-0.5 point")
    axes.axhline(100 * base - 1.0, color="gray", linestyle=":", linewidth=1, label="-1 point")
    for x in (40, 50):
        axes.axvline(x, color="tab:green", alpha=0.3)
    axes.set_xlim(0, 85)
    axes.set_ylim(78, 100 * base + 1)
    axes.set_xlabel("heads removed (% of 72)")
    axes.set_ylabel("SST-2 dev accuracy (%)")
    axes.set_title("MiniLM on SST-2, seed 0: every pruning method (below 78% not shown)")
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(out / "summary.png", dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
