"""One table and one figure from every `sst2_pruning` result: each method and setting, per seed, at 40%,
50% and 60% of MiniLM's 72 heads removed, against the unpruned fine-tune of the same seed.

Every run of `sst2_pruning.py` is deterministic per seed (CPU, one thread), so runs in different
folders with the same seed share their unpruned baseline (checked here). Run after them:

    python benchmarks/sst2_pruning_summary.py
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
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
        return "removal at the end" if at >= 1 else f"removal at {at:.0%}, then fine-tuning"
    if method == "retrain":
        return f"{settings['retrain_epochs']} epoch at lr {settings['retrain_lr']}"
    if method == "distill":
        hidden = "logits" if settings["distill_hidden"] == 0 else f"logits + hidden x {settings['distill_hidden']}"
        return f"{settings['distill']} sentences, lr {settings['distill_lr']}, {hidden}"
    return ""


def collect() -> tuple[dict[int, float], dict[tuple, dict[int, float]]]:
    """Unpruned accuracy per seed, and (seed, method, setting) -> heads removed -> accuracy."""
    baselines: dict[int, float] = {}
    curves: dict[tuple, dict[int, float]] = {}
    for path in sorted([RESULTS / "sst2_pruning.json", *RESULTS.glob("sst2_pruning_*/sst2_pruning.json")]):
        report = json.loads(path.read_text())
        if report["quick"]:
            continue
        seed = report["settings"]["seed"]
        if baselines.setdefault(seed, report["unpruned_accuracy"]) != report["unpruned_accuracy"]:
            raise SystemExit(f"{path}: unpruned {report['unpruned_accuracy']} differs from seed {seed}'s other runs")
        for p in report["points"]:
            if p["heads_removed"] == 0 and p["method"] == "importance":
                continue  # the unpruned model itself
            key = (seed, p["method"], setting(p["method"], report["settings"]))
            curve = curves.setdefault(key, {})
            if curve.setdefault(p["heads_removed"], p["accuracy"]) != p["accuracy"]:
                raise SystemExit(f"{path}: {key} at {p['heads_removed']} removed differs from an earlier run")
    return baselines, curves


def main() -> None:
    baselines, curves = collect()
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
        base = baselines[seed]
        cells = [f"{100 * curve[k]:.2f} ({100 * (curve[k] - base):+.2f})" if k in curve else "-" for k in (0, *REMOVED)]
        lines.append(f"| {seed} | {100 * base:.2f} | {NAMES[method]} | {label} | " + " | ".join(cells) + " |")
    lines += ["", "![seed 0](sst2_pruning_summary.png)"]
    (RESULTS / "sst2_pruning_summary.md").write_text("\n".join(lines) + "\n")
    plot(baselines[0], {key[1:]: curve for key, curve in curves.items() if key[0] == 0})
    print("\n".join(lines))


def plot(base: float, curves: dict[tuple, dict[int, float]]) -> None:
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
    figure.savefig(RESULTS / "sst2_pruning_summary.png", dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
