"""What the attention regularizers cost on the train step: the blockwise path against materialized attention.

Full run (from the repository root; about 15 minutes on 2 idle cores):

    .venv/bin/python benchmarks/blockwise_cost.py

Smoke run (128 tokens, 2 repetitions; the figures mean nothing):

    .venv/bin/python benchmarks/blockwise_cost.py --quick

MiniLM-shaped models (6 layers x 12 heads x 384, vocabulary 1,000, dropout 0, random weights from
`attnreg.tiny.tiny_model`): a BERT classifier and a GPT-2 causal LM, at 512 tokens (batch 4) and 2,048
tokens (batch 1). Identical copies are trained side by side, each attached to the hub, with the terms
run as the adapters run them (`attnreg.methods`, `hub.capture`):

- `sdpa`: no term (every layer on SDPA);
- `kl_head`: `PriorKL` to a one-hot parent (the previous token) on head 0 of every layer, blockwise;
- `kl_head_materialized`: the same with `blockwise=False` (the layers' attention materialized);
- `entropy_all`: `Entropy(mode="max")` on every head of every layer, blockwise;
- `entropy_all_materialized`: the same with `blockwise=False`.

A step is forward + terms + backward + zero_grad, timed round-robin after a warm-up (order rotated every
repetition); ratios are medians of per-repetition ratios to `sdpa`. Saved for backward: the bytes of the
distinct storages autograd keeps in one step (parameters excluded), exact. The blockwise variants' saved
bytes are also measured at 512, 1,024 and 2,048 tokens (batch 1) to show they grow linearly in T.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from overhead import command_line, machine

import attnreg
from attnreg import methods
from attnreg.syntax.data import PRIOR_KEY
from attnreg.tiny import tiny_model

SHAPES = {"bert": "classification", "gpt2": "causal_lm"}
SIZES = dict(hidden=384, layers=6, heads=12, vocab=1000, positions=2048)
CONFIGS = ((512, 4), (2048, 1))
VARIANTS = ("sdpa", "kl_head", "kl_head_materialized", "entropy_all", "entropy_all_materialized")
MB = 2**20


def terms_of(name: str) -> list[methods.LossTerm]:
    blockwise = not name.endswith("_materialized")
    if name.startswith("kl_head"):
        return [
            methods.PriorKL(weight=1.0, heads={layer: [0] for layer in range(SIZES["layers"])}, blockwise=blockwise)
        ]
    if name.startswith("entropy_all"):
        return [methods.Entropy(weight=0.01, mode="max", blockwise=blockwise)]
    return []


def build(family: str, name: str, base: torch.nn.Module) -> tuple[torch.nn.Module, list[methods.LossTerm]]:
    model = copy.deepcopy(base)
    terms = terms_of(name)
    for term in terms:
        term.bind(model)
        term.start(100)
    attnreg.attach(model)
    return model, terms


def make_batch(family: str, tokens: int, batch: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, SIZES["vocab"], (batch, tokens), generator=generator)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    inputs["labels"] = (
        input_ids if SHAPES[family] == "causal_lm" else torch.randint(0, 2, (batch,), generator=generator)
    )
    inputs[PRIOR_KEY] = (torch.arange(tokens) - 1).expand(batch, tokens)  # the previous token; row 0 left out
    return inputs


def step(model: torch.nn.Module, terms: list[methods.LossTerm], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward with the captures the terms need, plus the terms; returns the loss (backward not run)."""
    hub = attnreg.attach(model)
    model_inputs = {key: value for key, value in batch.items() if key != PRIOR_KEY}
    probs_layers = sorted({layer for t in terms if not t.inputs for layer in t.layers})
    input_layers = sorted({layer for t in terms if t.inputs for layer in t.layers})
    with hub.capture(probs_layers, True) as probs, hub.capture(input_layers, True, inputs=True) as inputs:
        loss = model(**model_inputs).loss
    for term in terms:
        loss = loss + term.term(inputs if term.inputs else probs, batch, 0)[0]
    return loss


def train_step(model: torch.nn.Module, terms: list[methods.LossTerm], batch: dict[str, torch.Tensor]) -> float:
    loss = step(model, terms, batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.item()


def saved_bytes(model: torch.nn.Module, terms: list[methods.LossTerm], batch: dict[str, torch.Tensor]) -> int:
    exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in exclude:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = step(model, terms, batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def run_config(family: str, tokens: int, batch_size: int, reps: int) -> dict:
    base = tiny_model(family, head=SHAPES[family], **SIZES).train()
    variants = {name: build(family, name, base) for name in VARIANTS}
    batch = make_batch(family, tokens, batch_size)
    memory = {name: saved_bytes(model, terms, batch) for name, (model, terms) in variants.items()}
    for model, terms in variants.values():
        train_step(model, terms, batch)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for rep in range(reps):
        shift = rep % len(order)
        for name in order[shift:] + order[:shift]:
            model, terms = variants[name]
            start = time.perf_counter()
            train_step(model, terms, batch)
            times[name].append(time.perf_counter() - start)
        print(f"  {family} {tokens} tokens: repetition {rep + 1}/{reps}", file=sys.stderr, flush=True)
    summary = {
        name: {
            "median_s": statistics.median(times[name]),
            "vs_sdpa": statistics.median(t / s for t, s in zip(times[name], times["sdpa"], strict=True)),
            "saved_bytes": memory[name],
            "saved_vs_sdpa": memory[name] / memory["sdpa"],
        }
        for name in variants
    }
    return {"model": family, "tokens": tokens, "batch": batch_size, "times_s": times, "summary": summary}


def growth(family: str, lengths: tuple[int, ...]) -> dict:
    """Saved bytes of the blockwise variants (and sdpa) at each length, batch 1."""
    base = tiny_model(family, head=SHAPES[family], **SIZES).train()
    table = {}
    for name in ("sdpa", "kl_head", "entropy_all"):
        model, terms = build(family, name, base)
        table[name] = {tokens: saved_bytes(model, terms, make_batch(family, tokens, 1)) for tokens in lengths}
    return {"model": family, "saved_bytes": table}


def markdown(results: dict) -> str:
    lines = [
        "# Attention regularizers: blockwise against materialized",
        "",
        f"- Date: {results['date']}; commit {results['commit']}",
        f"- Command: `{results['command']}`",
        f"- Machine: {results['machine']['cpu_count']} CPUs, torch {results['machine']['torch']} "
        f"({results['machine']['torch_threads']} threads)",
        f"- Models: {SIZES['layers']} layers x {SIZES['heads']} heads x {SIZES['hidden']}, random weights; "
        f"{results['reps']} timed repetitions, interleaved",
    ]
    if results["quick"]:
        lines += ["", "**Quick smoke run: the figures mean nothing.**"]
    lines += [
        "",
        "| model | tokens | batch | variant | step ms | x SDPA | saved MB | saved x SDPA |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for config in results["configs"]:
        for name, row in config["summary"].items():
            lines.append(
                f"| {config['model']} | {config['tokens']} | {config['batch']} | {name} | "
                f"{row['median_s'] * 1000:.0f} | {row['vs_sdpa']:.2f} | {row['saved_bytes'] / MB:.1f} | "
                f"{row['saved_vs_sdpa']:.3f} |"
            )
    lines += ["", "Saved for backward (MB, batch 1) by length:", ""]
    for entry in results["growth"]:
        lengths = list(next(iter(entry["saved_bytes"].values())))
        lines += [f"| {entry['model']} | " + " | ".join(f"{t} tokens" for t in lengths) + " |"]
        lines += ["|---|" + "---:|" * len(lengths)]
        for name, row in entry["saved_bytes"].items():
            lines.append(f"| {name} | " + " | ".join(f"{row[t] / MB:.1f}" for t in lengths) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 tokens, 2 repetitions: a smoke run")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5, quick 2)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "blockwise_cost")
    args = parser.parse_args(argv)
    reps = args.reps if args.reps is not None else (2 if args.quick else 5)
    configs = ((128, 2),) if args.quick else CONFIGS
    lengths = (64, 128) if args.quick else (512, 1024, 2048)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    results = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line().replace("overhead.py", "blockwise_cost.py"),
        "commit": commit,
        "machine": machine(),
        "quick": args.quick,
        "reps": reps,
        "sizes": SIZES,
        "configs": [run_config(family, tokens, batch, reps) for tokens, batch in configs for family in SHAPES],
        "growth": [growth(family, lengths) for family in SHAPES],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (args.out / "results.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
