"""Inference throughput of physically pruned models against the unpruned model.

Full run (from the repository root; BERT-base / GPT-2 small shape, 12 layers x 12 heads x 768, batch 64;
on 2 busy CPU cores a 512-token forward of that shape takes a minute or more, so budget several hours):

    .venv/bin/python benchmarks/pruning_speed.py

writes `benchmarks/results/pruning_speed/default/` (`--run NAME` or `--out DIR` for another folder).
A shorter run with the same per-layer shape but 4 layers (attention and feed-forward per layer are
unchanged, so the ratios differ only by the embedding and output-head share), held to about 15 minutes
on 2 idle cores by a time budget (at 128 tokens all 7 repetitions fit; at 512 tokens, where one round
of the four variants takes about a minute, about 5):

    .venv/bin/python benchmarks/pruning_speed.py --layers 4 --budget-min 15

Smoke run (tiny model, 3 repetitions, to a temporary folder; the figures mean nothing):

    .venv/bin/python benchmarks/pruning_speed.py --quick

Two shapes with random weights from `attnreg.tiny.tiny_model` (dropout 0, vocabulary 1,000, SDPA
attention, eval mode, `torch.inference_mode`): a BERT encoder (`BertModel`) and a GPT-2 decoder
(`GPT2Model`), no padding. For each shape and length, copies of one model with identical weights are
built: unpruned, and with 25%, 50% and 75% of the heads of every layer removed by
`attnreg.methods.pruning.prune_heads` (random heads, seeded; `--nonuniform` adds 50% removed with a different
count per layer). After a warm-up the variants are timed round-robin, the order rotated every
repetition, so that load from other processes hits all alike. Speed-up = median over repetitions of
(unpruned forward time / pruned forward time in the same repetition), i.e. the throughput ratio.
With `--budget-min`, each configuration (in order, short sequences first) gets an equal share of the
time left; the warm-up round tells how long a round takes, and it runs as many rounds as fit, at
least 3 and at most `--reps`.
"""

from __future__ import annotations

import argparse
import copy
import gc
import random
import statistics
import time

import torch
from common import add_output_arguments, output_dir, write_results
from torch import nn

from attnreg.methods.pruning import count_parameters, prune_heads
from attnreg.tiny import tiny_model

FAMILIES = ("bert", "gpt2")
FRACTIONS = (0.25, 0.5, 0.75)
TARGET_AT_HALF = 1.175  # Michel et al. 2019's GPU figure at 50% of heads removed


def build_variants(family: str, sizes: dict, nonuniform: bool, seed: int = 0) -> dict[str, nn.Module]:
    base = tiny_model(family, head="base", seed=seed, **sizes).eval()
    layers, heads = sizes["layers"], sizes["heads"]
    rng = random.Random(seed)
    variants = {"unpruned": base}
    plans = {f"{int(f * 100)}%": [round(f * heads)] * layers for f in FRACTIONS}
    if nonuniform:
        half, quarter = round(0.5 * heads), round(0.25 * heads)  # alternate 25% and 75% (50% on an odd last layer)
        counts = [half + (quarter if i % 2 else -quarter) for i in range(layers)]
        counts[-1] = half if layers % 2 else counts[-1]
        plans["50% non-uniform"] = counts
    for name, counts in plans.items():
        model = copy.deepcopy(base)
        prune_heads(model, {layer: rng.sample(range(heads), count) for layer, count in enumerate(counts)})
        variants[name] = model
    return variants


def run_config(
    family: str,
    tokens: int,
    sizes: dict,
    batch: int,
    reps: int,
    warmup: int,
    nonuniform: bool,
    budget_s: float | None = None,
) -> dict:
    """Time the variants round-robin; with `budget_s`, as many rounds as fit (3 to `reps`), warm-up included."""
    started = time.perf_counter()
    variants = build_variants(family, sizes, nonuniform)
    generator = torch.Generator().manual_seed(tokens)
    inputs = {"input_ids": torch.randint(3, sizes["vocab"], (batch, tokens), generator=generator)}

    def forward(model: nn.Module) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model(**inputs)
        return time.perf_counter() - start

    names = list(variants)
    for _ in range(warmup):
        round_s = sum(forward(variants[name]) for name in names)
    if budget_s is not None and warmup > 0:
        left = budget_s - (time.perf_counter() - started)
        reps = max(3, min(reps, int(left // round_s)))
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            times[name].append(forward(variants[name]))
        print(f"  {family} {tokens} rep {rep + 1}/{reps}: " + ", ".join(f"{n} {times[n][-1]:.2f}s" for n in names))
    summary = {}
    for name in names:
        ratios = [u / t for u, t in zip(times["unpruned"], times[name], strict=True)]
        summary[name] = {
            "median_s": statistics.median(times[name]),
            "speedup": statistics.median(ratios),
            "speedup_of_fastest": min(times["unpruned"]) / min(times[name]),
            "tokens_per_s": batch * tokens / statistics.median(times[name]),
            "parameters": count_parameters(variants[name]),
        }
    del variants
    gc.collect()
    return {"model": family, "tokens": tokens, "reps": reps, "times_s": times, "summary": summary}


def reps_text(results: dict) -> str:
    counts = [(config["model"], config["tokens"], config["reps"]) for config in results["configs"]]
    if len({reps for *_, reps in counts}) == 1:
        return str(counts[0][2])
    budget = f" (time budget {results['budget_min']} min)" if results["budget_min"] else ""
    return ", ".join(f"{model} {tokens}: {reps}" for model, tokens, reps in counts) + budget


def markdown(results: dict) -> str:
    sizes = results["sizes"]
    lines = [
        "# Inference throughput of pruned models",
        "",
        f"- Models: BertModel and GPT2Model, {sizes['layers']} layers x {sizes['heads']} heads x {sizes['hidden']}, "
        f"vocabulary {sizes['vocab']}, random weights, SDPA, eval, inference mode; batch {results['batch']}, "
        "no padding",
        f"- Heads removed with `attnreg.methods.pruning.prune_heads`, the same number in every layer (random heads; "
        f"'non-uniform' alternates 25% and 75%); "
        f"{results['warmup']} warm-up and {reps_text(results)} timed forwards per variant, interleaved round-robin",
        "- Speed-up: median over repetitions of (unpruned time / pruned time in the same repetition)",
    ]
    if results["quick"]:
        lines += ["", "**Quick smoke run: tiny model, too few repetitions for the figures to mean anything.**"]
    lines += [
        "",
        "| model | tokens | heads removed | parameters | forward s | tokens/s | speed-up |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for config in results["configs"]:
        for name, row in config["summary"].items():
            lines.append(
                f"| {config['model']} | {config['tokens']} | {name} | {row['parameters'] / 1e6:.1f}M | "
                f"{row['median_s']:.3f} | {row['tokens_per_s']:.0f} | {row['speedup']:.3f} |"
            )
    halves = [(c["model"], c["tokens"], c["summary"]["50%"]["speedup"]) for c in results["configs"]]
    met = sum(speedup >= TARGET_AT_HALF for *_, speedup in halves)
    lines += [
        "",
        f"Target at 50% of heads removed: >= {TARGET_AT_HALF}x (Michel et al. 2019, GPU); met in {met} of "
        f"{len(halves)}: " + ", ".join(f"{m} {t}: {s:.3f}x" for m, t, s in halves) + ".",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--reps", type=int, default=None, help="timed forwards per variant (default 7, quick 3)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--nonuniform", action="store_true", help="also 50%% removed, unevenly across layers")
    parser.add_argument(
        "--budget-min", type=float, default=None, help="time budget for the whole run: fewer reps (>= 3) to fit it"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, quick: 1)")
    add_output_arguments(parser, "2 layers x 4 heads x 64, batch 4, 32 tokens, 3 reps, 1 thread")
    args = parser.parse_args(argv)
    args.out = output_dir(args, "pruning_speed")
    if args.quick:
        args.layers, args.heads, args.hidden, args.batch, args.tokens = 2, 4, 64, 4, [32]
        args.threads = args.threads or 1  # on a busy 2-core machine two threads make tiny forwards 10x slower
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = args.reps if args.reps is not None else (3 if args.quick else 7)
    sizes = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=1000, positions=max(args.tokens))
    results = {
        "quick": args.quick,
        "reps": reps,
        "budget_min": args.budget_min,
        "warmup": args.warmup,
        "batch": args.batch,
        "sizes": sizes,
        "configs": [],
    }
    started = time.perf_counter()
    configs = [(tokens, family) for tokens in sorted(args.tokens) for family in FAMILIES]
    for index, (tokens, family) in enumerate(configs):
        budget_s = None
        if args.budget_min is not None:
            budget_s = (60 * args.budget_min - (time.perf_counter() - started)) / (len(configs) - index)
        config = run_config(family, tokens, sizes, args.batch, reps, args.warmup, args.nonuniform, budget_s)
        results["configs"].append(config)
    results["wall_s"] = time.perf_counter() - started
    table = markdown(results)
    print(table)
    write_results(args.out, results, table, args)


if __name__ == "__main__":
    main()
