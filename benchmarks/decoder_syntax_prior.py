"""The syntax prior on a real decoder: SmolLM2-135M fine-tuned as a causal LM on EWT, with and without a causal
parent prior on one head, paired seeds; parent accuracy on EWT dev and test, perplexity, agreement across attractors.

Per seed, every arm starts from the pretrained model and sees the same batches of EWT training sentences (AdamW,
constant learning rate). The LM arm minimises the next-token loss; each prior arm adds `weight` (optionally ramped
in linearly over the first `--warmup` share of the steps) times the blockwise KL of the supervised head's rows to
a one-hot on each word's parent, where the parent lies to the word's left (`SyntaxCollator(causal=True)`,
`attnreg.blockwise.prior_kl(causal=True)`: rows whose parent is to the right are left out).

Evaluated, for the base model and every trained one:
- parent accuracy of every head on EWT dev and test, dependent to head over the words whose parent is to their left
  (`attnreg.analysis.parent_accuracy`), per relation, with the best natural head (the base model's) and the best
  left-offset baseline on the same words;
- perplexity of EWT test (and dev) sentences, each alone;
- agreement across attractors: sentences of the built-in grammar (`attnreg.app.task`) cut before the main verb,
  scored by whether the LM gives the agreeing verb form a higher log-probability than the other form, by the
  number of attractors (nouns of the other number between the subject and its verb).

    python benchmarks/decoder_syntax_prior.py                 # 3 seeds x (LM, prior), 60 steps of 8 sentences
    python benchmarks/decoder_syntax_prior.py --quick         # tiny random Llama, a few sentences, to a temp folder

It writes `results.md` and `results.json`, a compact summary (metadata, settings, and per arm, seed and split the
figures the tables quote: the supervised head and its key/value siblings, per relation too); `--grids` also writes
`grids.json`, every head's parent accuracy for every evaluation (about 1 MB, not committed).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time

import numpy as np
import torch
from common import add_output_arguments, output_dir, quick_banner, table, write_results
from decoder_common import (
    builtin_sentences,
    has_ewt,
    load_smollm2,
    mean_sd,
    pm,
    quick_model,
    quick_tokenizer,
    read_ewt,
)
from torch.utils.data import DataLoader

import attnreg
from attnreg.analysis import ParentAccuracy, SyntaxTargets
from attnreg.app.task import MASK, Grammar, generate_example
from attnreg.app.train import fit_causal_lm
from attnreg.schedules import Constant, Warmup
from attnreg.syntax import SyntaxCollator, align_offsets

RELATIONS = 10  # per-relation rows: the most frequent relations by reachable words


# --- training ------------------------------------------------------------------------------------------------


def train(base, tokenizer, sentences, args, seed: int, weight: float) -> tuple[torch.nn.Module, dict]:
    """A copy of `base` fine-tuned on `sentences` (already in this seed's order) as a causal LM, plus `weight` times
    the causal parent-prior KL on (`args.layer`, `args.head`) when `weight` > 0 (ramped in over the first
    `args.warmup` of the steps): through the training app's loop (`attnreg.app.train.fit_causal_lm`, what
    `attnreg-train experiment=smollm2_syntax_prior` runs), AdamW at a constant rate, gradient norm clipped at 1."""
    torch.manual_seed(seed)
    model = copy.deepcopy(base).train()
    collate = SyntaxCollator(tokenizer, prior="parent", causal=True, lm_labels=True, max_length=args.max_length)
    loader = DataLoader(sentences[: args.steps * args.batch], batch_size=args.batch, collate_fn=collate)
    callbacks = []
    if weight > 0:
        schedule = Warmup(args.warmup, Constant(weight)) if args.warmup > 0 else weight
        callbacks.append(attnreg.SyntaxPriorKL(layers=[args.layer], heads=[args.head], weight=schedule))
    log = fit_causal_lm(model, loader, callbacks, steps=args.steps, lr=args.lr, clip=1.0, seed=seed)
    print(f"  seed {seed} weight {weight:g}: lm {log['train/loss'][-1]:.3f} after {args.steps} steps")
    log = {"lm_loss": log["train/loss"], "kl": log.get("attnreg/syntax_prior_kl"), "seconds": log["seconds"]}
    log["causal_rows"] = collate.stats.causal_rows
    log["causal_rows_dropped"] = collate.stats.causal_rows_dropped
    return model.eval(), log


# --- evaluation ----------------------------------------------------------------------------------------------


@torch.no_grad()
def syntax_scores(model, tokenizer, sentences, args, layers: list[int] | None = None) -> dict:
    """One pass over `sentences` (each alone, right-padded): parent accuracy of the heads of `layers` (None: all),
    dependent to head over reachable parents, overall and per relation (`attnreg.analysis.ParentAccuracy`, only
    the captured layers materialize attention), and the perplexity of the sentences (every token after the first)."""
    hub = attnreg.attach(model)
    model.eval()
    result = ParentAccuracy.empty(hub.num_layers, model.config.num_attention_heads, causal=True)
    encoding = tokenizer(
        [s.text for s in sentences], truncation=True, max_length=args.max_length, return_offsets_mapping=True
    )
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    order = sorted(range(len(sentences)), key=lambda index: len(ids[index]))
    pad = tokenizer.pad_token_id
    total, tokens = 0.0, 0
    for start in range(0, len(order), args.eval_batch):
        chunk = order[start : start + args.eval_batch]
        width = max(len(ids[index]) for index in chunk)
        input_ids = torch.tensor([ids[i] + [pad] * (width - len(ids[i])) for i in chunk])
        mask = torch.tensor([[1] * len(ids[i]) + [0] * (width - len(ids[i])) for i in chunk])
        alignments = [align_offsets(sentences[i], offsets[i]) for i in chunk]
        targets = SyntaxTargets.build([sentences[i] for i in chunk], alignments, width)
        with hub.capture(layers=layers) as record:
            logits = model(input_ids=input_ids, attention_mask=mask).logits
        result.update({layer: record[layer] for layer in record}, targets)
        predicted = mask[:, 1:].bool() & mask[:, :-1].bool()
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().transpose(1, 2), input_ids[:, 1:], reduction="none"
        )
        total += float(nll[predicted].sum())
        tokens += int(predicted.sum())
        del record, logits
    relations = [r for r, _ in sorted(result.relation_left_words.items(), key=lambda item: -item[1])[:RELATIONS]]
    per_relation = {}
    for relation in relations:
        layer, head, best = result.best_head(relation)
        offset, baseline = result.best_baseline(relation)
        per_relation[relation] = {
            "words": result.reachable_words(relation),
            "accuracy": _grid(result.relation_accuracy(relation)),
            "best_head": f"L{layer}H{head}",
            "best_head_accuracy": round(100 * best, 2),
            "best_offset": offset,
            "best_offset_accuracy": round(100 * baseline, 2),
        }
    layer, head, best = result.best_head()
    offset, baseline = result.best_baseline()
    return {
        "words": result.words,
        "reachable_words": result.reachable_words(),
        "reachable_share": round(100 * result.reachable_share(), 2),
        "accuracy": _grid(result.accuracy),
        "best_head": f"L{layer}H{head}",
        "best_head_accuracy": round(100 * best, 2),
        "best_offset": offset,
        "best_offset_accuracy": round(100 * baseline, 2),
        "relations": per_relation,
        "perplexity": math.exp(total / max(tokens, 1)),
        "predicted_tokens": tokens,
    }


def compact(report: dict, args) -> dict:
    """`report` without the per-head grids: in each evaluation, each split's (and each relation's) `accuracy` grid
    gives way to `supervised`, the supervised head's figure (a split also keeps its key/value `siblings`: what
    `markdown` quotes); the rest is kept as it is."""
    layer, head, size = args.layer, args.head, report["setup"]["heads_per_kv_head"]
    siblings = [h for h in range(head // size * size, (head // size + 1) * size) if h != head]

    def without_grid(result: dict, **more) -> dict:
        kept = {key: value for key, value in result.items() if key != "accuracy"}
        return {**kept, "supervised": result["accuracy"][layer][head], **more}

    def evaluation(result: dict) -> dict:
        out = dict(result)
        for split in result["perplexity"]:
            grid = result[split]["accuracy"]
            relations = {name: without_grid(r) for name, r in result[split]["relations"].items()}
            out[split] = without_grid(result[split], siblings=[grid[layer][h] for h in siblings], relations=relations)
        return out

    runs = {
        seed: {arm: {**run, "eval": evaluation(run["eval"])} for arm, run in arms.items()}
        for seed, arms in report["runs"].items()
    }
    return {**report, "base": evaluation(report["base"]), "runs": runs, "sibling_heads": siblings}


def _grid(accuracy: torch.Tensor) -> list[list[float | None]]:
    """Percentages, None for heads not captured (NaN)."""
    return [[None if math.isnan(float(v)) else round(100 * float(v), 2) for v in row] for row in accuracy]


def agreement_items(count: int, seed: int) -> list[dict]:
    """`count` prefixes per number of attractors (0, 1, 2) from the built-in grammar, each cut before the main verb,
    with the agreeing and the other verb form."""
    grammar = Grammar()
    plural_nouns, singular_nouns = set(grammar.nouns.values()), set(grammar.nouns)
    other_form = {**grammar.verbs, **{plural: singular for singular, plural in grammar.verbs.items()}}
    rng = np.random.default_rng(seed)
    buckets: dict[int, list[dict]] = {0: [], 1: [], 2: []}
    seen = set()
    for _ in range(2000 * (count + 1)):
        if all(len(items) >= count for items in buckets.values()):
            break
        example = generate_example(rng, grammar)
        words = list(example.sentence.words)
        subject = words.index(MASK)
        verb = example.sentence.heads[subject] - 1  # the main verb, the subject's parent
        singular = list(grammar.nouns)[int(rng.integers(len(grammar.nouns)))]
        words[subject] = grammar.nouns[singular] if example.label else singular
        between = words[subject + 1 : verb]
        attractors = sum(
            (w in plural_nouns) != bool(example.label) for w in between if w in plural_nouns | singular_nouns
        )
        verbs_between = [w for w in between if w in other_form]
        prefix = " ".join(words[:verb]).replace(" ,", ",")
        prefix = prefix[0].upper() + prefix[1:]
        if attractors not in buckets or len(buckets[attractors]) >= count or prefix in seen:
            continue
        seen.add(prefix)
        buckets[attractors].append(
            {
                "prefix": prefix,
                "good": words[verb],
                "bad": other_form[words[verb]],
                "attractors": attractors,
                "plural": example.label,
                "verbs_between": len(verbs_between),
            }
        )
    return [item for number in sorted(buckets) for item in buckets[number]]


@torch.no_grad()
def agreement_scores(model, tokenizer, items: list[dict], batch_size: int = 32) -> dict:
    """Per attractor count: share of items whose agreeing form has the higher log-probability, and the mean margin."""
    model.eval()
    device = next(model.parameters()).device
    margins = []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        sequences, spans = [], []
        for item in chunk:
            prefix = tokenizer(item["prefix"], add_special_tokens=False)["input_ids"]
            for form in (item["good"], item["bad"]):
                continuation = tokenizer(" " + form, add_special_tokens=False)["input_ids"]
                sequences.append(prefix + continuation)
                spans.append((len(prefix), len(prefix) + len(continuation)))
        width = max(len(s) for s in sequences)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences], device=device)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], device=device)
        logprobs = model(input_ids=input_ids, attention_mask=mask).logits.float().log_softmax(-1)
        scores = []
        for row, (begin, end) in enumerate(spans):
            positions = torch.arange(begin, end, device=device)
            scores.append(float(logprobs[row, positions - 1, input_ids[row, positions]].sum()))
        margins += [scores[i] - scores[i + 1] for i in range(0, len(scores), 2)]
    out = {}
    for attractors in sorted({item["attractors"] for item in items}):
        chosen = [m for m, item in zip(margins, items, strict=True) if item["attractors"] == attractors]
        out[str(attractors)] = {
            "items": len(chosen),
            "accuracy": round(100 * sum(m > 0 for m in chosen) / len(chosen), 2),
            "margin": round(float(np.mean(chosen)), 4),
        }
    out["all"] = {
        "items": len(margins),
        "accuracy": round(100 * sum(m > 0 for m in margins) / len(margins), 2),
        "margin": round(float(np.mean(margins)), 4),
    }
    return out


def evaluate(model, tokenizer, data: dict, args, layers: list[int] | None = None) -> dict:
    """Parent accuracy (heads of `layers`; None: all) and perplexity on dev and test, agreement across attractors."""
    started = time.perf_counter()
    out = {split: syntax_scores(model, tokenizer, sentences, args, layers) for split, sentences in data["eval"].items()}
    out["perplexity"] = {split: {"perplexity": out[split]["perplexity"]} for split in data["eval"]}
    out["agreement"] = agreement_scores(model, tokenizer, data["agreement"], args.eval_batch)
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


# --- summary -------------------------------------------------------------------------------------------------


def arm_name(weight: float, warmup: float) -> str:
    return "lm" if weight == 0 else f"prior_w{weight:g}" + (f"_warm{warmup:g}" if warmup > 0 else "")


def summarize(report: dict, args) -> dict:
    """Per prior arm, paired against the LM arm: the supervised head, perplexity, agreement, the targets."""
    base, runs = report["base"], report["runs"]
    layer, head = args.layer, args.head
    arms = [arm for arm in runs[str(args.seeds[0])] if arm != "lm"]
    splits = list(base["perplexity"])
    summary: dict = {}
    for arm in ["lm", *arms]:
        entry: dict = {}
        for split in splits:
            supervised = [runs[str(s)][arm]["eval"][split]["accuracy"][layer][head] for s in args.seeds]
            entry[f"{split}_supervised"] = mean_sd(supervised)
            entry[f"{split}_perplexity"] = mean_sd(
                [runs[str(s)][arm]["eval"]["perplexity"][split]["perplexity"] for s in args.seeds]
            )
        entry["agreement"] = {
            key: mean_sd([runs[str(s)][arm]["eval"]["agreement"][key]["accuracy"] for s in args.seeds])
            for key in base["agreement"]
        }
        summary[arm] = entry
    for arm in arms:
        paired: dict = {}
        for split in splits:
            lm = [runs[str(s)]["lm"]["eval"] for s in args.seeds]
            prior = [runs[str(s)][arm]["eval"] for s in args.seeds]
            paired[f"{split}_supervised_difference"] = mean_sd(
                [
                    p[split]["accuracy"][layer][head] - q[split]["accuracy"][layer][head]
                    for p, q in zip(prior, lm, strict=True)
                ]
            )
            ratios = [
                p["perplexity"][split]["perplexity"] / q["perplexity"][split]["perplexity"]
                for p, q in zip(prior, lm, strict=True)
            ]
            paired[f"{split}_perplexity_ratio"] = mean_sd(ratios)
            natural = base[split]["accuracy"][layer][head]
            values = [p[split]["accuracy"][layer][head] for p in prior]
            paired[f"{split}_targets"] = {
                "natural": natural,
                "best_natural_head": base[split]["best_head"],
                "best_natural_accuracy": base[split]["best_head_accuracy"],
                "best_offset_accuracy": base[split]["best_offset_accuracy"],
                "twice_natural": [v >= 2 * natural for v in values],
                "above_best_natural_head": [v > base[split]["best_head_accuracy"] for v in values],
                "above_best_offset": [v > base[split]["best_offset_accuracy"] for v in values],
                "perplexity_within_2pct": [r <= 1.02 for r in ratios],
            }
        paired["agreement_difference"] = {
            key: mean_sd(
                [
                    runs[str(s)][arm]["eval"]["agreement"][key]["accuracy"]
                    - runs[str(s)]["lm"]["eval"]["agreement"][key]["accuracy"]
                    for s in args.seeds
                ]
            )
            for key in base["agreement"]
        }
        summary[arm]["paired"] = paired
    return summary


def markdown(report: dict, args) -> str:
    base, summary, setup = report["base"], report["summary"], report["setup"]
    layer, head = args.layer, args.head
    arms = list(summary)
    n = len(args.seeds)
    size = setup["heads_per_kv_head"]
    siblings = [h for h in range(head // size * size, (head // size + 1) * size) if h != head]
    lines = [
        f"# Syntax prior on a decoder ({setup['model']})",
        "",
        *quick_banner(args.quick),
        f"Fine-tuned as a causal LM on EWT training sentences ({args.steps} steps of {args.batch}, AdamW lr "
        f"{args.lr:g}, max {args.max_length} tokens), seeds {args.seeds} paired (same batches in every arm). Prior "
        f"arms add the causal parent-prior KL on L{layer}H{head} (each word's row toward its parent where the parent "
        f"is to its left). Evaluated on the first {setup['eval_sentences']['dev']} sentences of EWT dev and "
        f"{setup['eval_sentences']['test']} of test. Accuracy in %, mean ± sd over seeds.",
        "",
        "## Supervised head and baselines (dependent to head, over reachable parents)",
        "",
    ]
    for split in base["perplexity"]:
        b = base[split]
        lines += [
            f"**EWT {split}**: {b['reachable_words']} of {b['words']} scored words ({b['reachable_share']:.1f}%) have "
            f"their parent to their left. Base model: L{layer}H{head} {b['accuracy'][layer][head]:.1f}, best head "
            f"{b['best_head']} {b['best_head_accuracy']:.1f}, best left offset ({b['best_offset']}) "
            f"{b['best_offset_accuracy']:.1f}.",
            "",
        ]
        rows = []
        for arm in arms:
            evals = [report["runs"][str(s)][arm]["eval"][split] for s in args.seeds]
            row = [
                arm,
                pm(summary[arm][f"{split}_supervised"]),
                " / ".join(pm(mean_sd([e["accuracy"][layer][h] for e in evals])) for h in siblings),
                pm(summary[arm][f"{split}_perplexity"], digits=2),
            ]
            if arm != "lm":
                p = summary[arm]["paired"]
                row += [pm(p[f"{split}_supervised_difference"]), f"{pm(p[f'{split}_perplexity_ratio'], 100, 2)}%"]
            else:
                row += ["", ""]
            rows.append(row)
        rows.insert(
            0,
            [
                "base",
                f"{b['accuracy'][layer][head]:.1f}",
                " / ".join(f"{b['accuracy'][layer][h]:.1f}" for h in siblings),
                f"{base['perplexity'][split]['perplexity']:.2f}",
                "",
                "",
            ],
        )
        lines += table(
            [
                "model",
                f"L{layer}H{head}",
                " / ".join(f"L{layer}H{h}" for h in siblings) + " (same kv head)",
                "perplexity",
                "paired diff. vs LM",
                "perplexity / LM",
            ],
            rows,
        )
        lines.append("")
        for arm in arms[1:]:
            t = summary[arm]["paired"][f"{split}_targets"]
            lines.append(
                f"Targets, {arm} on {split} (per seed): >= 2x natural ({2 * t['natural']:.1f}) {t['twice_natural']}; "
                f"above the best natural head {t['best_natural_head']} ({t['best_natural_accuracy']:.1f}) "
                f"{t['above_best_natural_head']}; above the best left offset ({t['best_offset_accuracy']:.1f}) "
                f"{t['above_best_offset']}; perplexity within 2% of LM {t['perplexity_within_2pct']}."
            )
        lines.append("")
    for split in base["perplexity"]:
        b = base[split]
        lines += [
            f"## Per relation, EWT {split} (L{layer}H{head}; the {RELATIONS} relations with most reachable words)",
            "",
        ]
        rows = []
        for relation, r in b["relations"].items():
            row = [relation, r["words"], f"{r['accuracy'][layer][head]:.1f}"]
            for arm in arms:
                values = [
                    report["runs"][str(s)][arm]["eval"][split]["relations"].get(relation, {}).get("accuracy")
                    for s in args.seeds
                ]
                values = [v[layer][head] for v in values if v is not None]
                row.append(pm(mean_sd(values)) if values else "")
            row += [
                f"{r['best_head']} {r['best_head_accuracy']:.1f}",
                f"{r['best_offset']}: {r['best_offset_accuracy']:.1f}",
            ]
            rows.append(row)
        lines += table(["relation", "words", "base", *arms, "best natural head", "best left offset"], rows)
        lines.append("")
    lines += ["## Agreement across attractors (built-in grammar, prefix up to the main verb)", ""]
    keys = list(base["agreement"])
    rows = [["base", *[f"{base['agreement'][k]['accuracy']:.1f}" for k in keys]]]
    for arm in arms:
        rows.append([arm, *[pm(summary[arm]["agreement"][k]) for k in keys]])
    for arm in arms[1:]:
        rows.append([f"{arm} - lm (paired)", *[pm(summary[arm]["paired"]["agreement_difference"][k]) for k in keys]])
    header = [
        "model",
        *[
            f"{k} attractors ({base['agreement'][k]['items']})"
            if k != "all"
            else f"all ({base['agreement'][k]['items']})"
            for k in keys
        ],
    ]
    lines += table(header, rows)
    lines += [
        "",
        "Accuracy: share of prefixes where the agreeing verb form gets the higher log-probability.",
        "",
        "Training time per run (s): "
        + "; ".join(
            f"{arm} {np.median([report['runs'][str(s)][arm]['train']['seconds'] for s in args.seeds]):.0f}"
            for arm in arms
        )
        + f" (median); {n} seeds. Per-seed values are in results.json; every head's accuracy in grids.json "
        "(rerun with --grids).",
        "",
    ]
    return "\n".join(lines)


# --- main ----------------------------------------------------------------------------------------------------


def load(args) -> tuple:
    """(model, tokenizer, data, description): SmolLM2 on EWT, or for --quick a tiny Llama on a few sentences."""
    if args.quick:
        if has_ewt():
            train = read_ewt("train", 64, min_words=5)
            evaluation = {"dev": read_ewt("dev", 16, min_words=3), "test": read_ewt("test", 16, min_words=3)}
            source = "EWT"
        else:
            train = builtin_sentences(64, seed=10)
            evaluation = {"dev": builtin_sentences(16, seed=11), "test": builtin_sentences(16, seed=12)}
            source = "built-in sentences"
        texts = [s.text for s in train] + [s.text for split in evaluation.values() for s in split]
        tokenizer = quick_tokenizer(texts)
        model = quick_model(tokenizer)
        return model, tokenizer, train, evaluation, f"tiny random Llama ({source})"
    model, tokenizer = load_smollm2()
    train = read_ewt("train", min_words=args.min_words)
    evaluation = {split: read_ewt(split, args.eval, min_words=2) for split in ("dev", "test")}
    return model, tokenizer, train, evaluation, "SmolLM2-135M-Instruct, float32"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weights", type=float, nargs="+", default=[1.0], help="prior weights, one arm each")
    parser.add_argument("--warmup", type=float, default=0.0, help="ramp the weight in over this share of the steps")
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--head", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--min-words", type=int, default=5, help="training sentences with at least this many words")
    parser.add_argument("--eval", type=int, default=500, help="sentences of EWT dev and of test to evaluate on")
    parser.add_argument("--eval-batch", type=int, default=32)
    parser.add_argument("--agreement", type=int, default=150, help="prefixes per number of attractors (0, 1, 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--grids", action="store_true", help="also write grids.json: every head of every evaluation")
    add_output_arguments(parser, "tiny random Llama, 64 training sentences, 2 steps, 1 seed")
    args = parser.parse_args()
    args.out = output_dir(args, "decoder_syntax_prior")
    if args.quick:
        args.seeds, args.steps, args.layer, args.head, args.agreement = args.seeds[:1], 2, 1, 0, 4
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, tokenizer, train_sentences, evaluation, description = load(args)
    data = {"eval": evaluation, "agreement": agreement_items(args.agreement, seed=1234)}
    print(f"{description}: {len(train_sentences)} training sentences; evaluating base model", flush=True)
    base = evaluate(model, tokenizer, data, args)
    print(
        f"  base: {base['test']['best_head']} {base['test']['best_head_accuracy']} "
        f"L{args.layer}H{args.head} {base['test']['accuracy'][args.layer][args.head]}, "
        f"test perplexity {base['perplexity']['test']['perplexity']:.2f} ({base['seconds']:.0f} s)",
        flush=True,
    )
    runs: dict = {}
    for seed in args.seeds:
        order = np.random.default_rng(seed).permutation(len(train_sentences))
        needed = args.steps * args.batch
        chosen = [train_sentences[i] for i in np.resize(order, needed)]
        runs[str(seed)] = {}
        for weight in [0.0, *args.weights]:
            arm = arm_name(weight, args.warmup)
            trained, log = train(model, tokenizer, chosen, args, seed, weight)
            result = evaluate(trained, tokenizer, data, args, layers=[args.layer])
            runs[str(seed)][arm] = {"train": log, "eval": result}
            print(
                f"  seed {seed} {arm}: L{args.layer}H{args.head} test "
                f"{result['test']['accuracy'][args.layer][args.head]:.1f}, test perplexity "
                f"{result['perplexity']['test']['perplexity']:.2f}, "
                f"agreement {result['agreement']['all']['accuracy']:.1f} "
                f"(train {log['seconds']:.0f} s, eval {result['seconds']:.0f} s)",
                flush=True,
            )
            del trained
    report = {
        "setup": {
            "model": description,
            "supervised_head": [args.layer, args.head],
            "heads_per_kv_head": model.config.num_attention_heads // model.config.num_key_value_heads,
            "train_sentences_pool": len(train_sentences),
            "eval_sentences": {split: len(s) for split, s in evaluation.items()},
            "agreement_items": len(data["agreement"]),
            "agreement_examples": data["agreement"][:3],
            "quick": args.quick,
        },
        "base": base,
        "runs": runs,
        "seconds": round(time.perf_counter() - started, 1),
    }
    report["summary"] = summarize(report, args)
    text = markdown(report, args)
    write_results(args.out, compact(report, args), text, args)
    if args.grids:
        grids = {
            "base": report["base"],
            "runs": {seed: {a: r["eval"] for a, r in arms.items()} for seed, arms in runs.items()},
        }
        (args.out / "grids.json").write_text(json.dumps(grids, separators=(",", ":")) + "\n")
    print(text)


if __name__ == "__main__":
    main()
