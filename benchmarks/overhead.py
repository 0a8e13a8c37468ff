"""What attnreg costs on the train step: the hub, gates and the attention regularizers against plain SDPA.

Full run (from the repository root; about 30 minutes on 2 idle cores, longer on a busy machine):

    .venv/bin/python benchmarks/overhead.py

Smoke run (`make bench`, and CI: the decoder shape, SmolLM2's heads and widths on 2 layers, 256 tokens, 3
repetitions, no compiled variants; the figures mean nothing):

    .venv/bin/python benchmarks/overhead.py --quick

A real decoder's shape, SmolLM2-135M's (`--shape smollm2`: 30 layers, 9 query / 3 key-value heads of 64, hidden 576,
feed-forward 1,536, vocabulary 49,152 with tied embeddings; a Llama config with random weights), at 2,048 tokens,
batch 1: `sdpa`, `idle`, `kl_head` and `entropy_all` only (the materialized variants would keep 4.5 GB of
probabilities), no length growth and no per-op profile; 39 minutes with 3 repetitions on 2 loaded cores:

    .venv/bin/python benchmarks/overhead.py --shape smollm2 --reps 3 --run smollm2

MiniLM-shaped models (6 layers x 12 heads x 384, vocabulary 1,000, dropout 0, random weights from
`attnreg.tiny.tiny_model`): a BERT classifier and a GPT-2 causal LM, at 512 tokens (batch 4) and 2,048
tokens (batch 1), no padding. Identical copies are trained side by side, the terms run as the adapters
run them (`attnreg.methods`, `hub.capture`):

- `sdpa`: the plain model (transformers' SDPA attention), not attached;
- `idle`: `attnreg.attach(model)` and nothing else;
- `gates`: attached, with a trainable gate (at 1) on every layer;
- `kl_head`: `SyntaxPriorKL` to a one-hot parent (the previous token) on head 0 of every layer, blockwise;
- `entropy_all`: `EntropyRegularizer(mode="max")` on every head of every layer, blockwise;
- `kl_head_materialized`, `entropy_all_materialized`: the same with `blockwise=False` (the layers run
  eager attention and keep their probabilities, the path before the blockwise one);
- with `--compile` (the default; BERT at 512 tokens only, since compiling takes minutes per variant):
  `compiled_sdpa`, `compiled_kl_head`, `compiled_entropy_all`: the step (forward and terms) through
  `torch.compile`; their ratios are to `compiled_sdpa`.

A step is forward + terms + backward + zero_grad (no optimizer step), timed round-robin after a warm-up
(order rotated every repetition); ratios are per-repetition ratios to `sdpa`, reported as median with min and max.
The 1-minute load average is read before and after every repetition; a run whose load exceeded 3/4 of the
machine's CPUs is marked loud, and a target whose per-repetition ratios straddle it is then not settled by it.
At SmolLM2's shape the issue's targets are checked (`TARGETS`). `--variants` times a subset, `--threads` sets
torch's threads (default 1), `--no-memory` skips the saved-bytes pass (for parallel processes), and `--merge
A.json B.json ...` pools the repetitions of such runs (each process interleaves its own variants) into one table.
Saved for backward: the bytes of the distinct storages autograd keeps in one step (parameters excluded), exact
(not measured for compiled steps, whose saved tensors the hooks do not see). The blockwise variants' saved
bytes are also measured at 512, 1,024 and 2,048 tokens (batch 1) to show they grow linearly in T. Last,
`torch.profiler` splits the steps of `sdpa`, `kl_head` and `entropy_all` by aten op (self CPU time), to
show where a regularized step's extra time goes (`--breakdown-only` runs just that; with `--analysis-tokens T` it also
splits the blockwise head statistics against a forward at T tokens; `--layers N` and `--tokens T` reduce a shape,
e.g. `--shape smollm2 --layers 4 --tokens 2048 --breakdown-only --analysis-tokens 8192`, the `smollm2_profile` run).

Compiled at SmolLM2's shape (`--shape smollm2 --compiled`; `--quick --compiled` at the quick shape, a few minutes):
`compiled_sdpa`, `compiled_kl_head` and `compiled_entropy_all`, and the graph breaks each regularizer adds to the plain
step (`torch._dynamo.explain`). Each compiled step has a code object of its own (`own_code`) and static shapes; after
the warm-up, rounds of compiled steps run until one compiles nothing, and the frames compiled during timed steps are
counted per variant: a compiled ratio with any reads "not settled".
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from common import add_output_arguments, output_dir, quick_banner, table, write_results

import attnreg
from attnreg import methods
from attnreg.syntax.data import PRIOR_KEY
from attnreg.tiny import tiny_model

VARIANTS = ("sdpa", "idle", "gates", "kl_head", "entropy_all", "kl_head_materialized", "entropy_all_materialized")
COMPILED = ("compiled_sdpa", "compiled_kl_head", "compiled_entropy_all")
MB = 2**20
STARTED = time.perf_counter()  # `--budget` counts from here


@dataclass(frozen=True)
class Shape:
    """Models measured (`tiny_model` family -> task head), their sizes, the (tokens, batch) configurations, the
    variants, and whether the saved bytes' growth with length and the per-op profile are measured."""

    name: str
    families: dict[str, str]
    sizes: dict
    configs: tuple[tuple[int, int], ...]
    variants: tuple[str, ...] = VARIANTS
    extras: bool = True

    def quick(self) -> Shape:
        """The smoke run's version: at most 2 layers, a vocabulary of at most 1,000 and 256 tokens (batch 1) for a
        decoder shape, 128 (batch 2) else."""
        sizes = {**self.sizes, "layers": min(self.sizes["layers"], 2), "vocab": min(self.sizes["vocab"], 1000)}
        return replace(self, configs=((256, 1),) if "num_key_value_heads" in sizes else ((128, 2),), sizes=sizes)


SHAPES = {
    "minilm": Shape(
        "minilm",
        {"bert": "classification", "gpt2": "causal_lm"},
        dict(hidden=384, layers=6, heads=12, vocab=1000, positions=2048),
        ((512, 4), (2048, 1)),
    ),
    "smollm2": Shape(  # SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M's config.json), random weights
        "smollm2",
        {"llama": "causal_lm"},
        dict(
            hidden=576,
            layers=30,
            heads=9,
            vocab=49152,
            positions=2048,
            num_key_value_heads=3,
            intermediate_size=1536,
            tie_word_embeddings=True,
        ),
        ((2048, 1),),
        variants=("sdpa", "idle", "kl_head", "entropy_all"),
        extras=False,
    ),
}

Step = Callable[[dict[str, torch.Tensor]], torch.Tensor]

TARGETS = {"kl_head": (1.05, 1.01), "entropy_all": (1.12, 1.01)}
"""Issue 40's targets at SmolLM2's shape, 2,048 tokens, batch 1: (time, saved bytes) as ratios to the SDPA step."""


def terms_of(name: str, layers: int) -> list[methods.LossTerm]:
    name = name.removeprefix("compiled_")
    blockwise = not name.endswith("_materialized")
    if name.startswith("kl_head"):
        heads = {layer: [0] for layer in range(layers)}
        return [methods.SyntaxPriorKL(weight=1.0, heads=heads, blockwise=blockwise)]
    if name.startswith("entropy_all"):
        return [methods.EntropyRegularizer(weight=0.01, mode="max", blockwise=blockwise)]
    return []


def build(name: str, base: torch.nn.Module) -> tuple[torch.nn.Module, Step]:
    """A copy of `base` set up as variant `name`, and its step: the loss of one batch (terms included)."""
    model = copy.deepcopy(base)
    layers = model.config.num_hidden_layers if hasattr(model.config, "num_hidden_layers") else model.config.n_layer
    terms = terms_of(name, layers)
    for term in terms:
        term.bind(model)
        term.start(100)
    if name != "sdpa" and name != "compiled_sdpa":
        hub = attnreg.attach(model)
        if name == "gates":
            for layer in range(layers):
                hub.gate(layer)
    probs_layers = sorted({layer for t in terms if not t.inputs for layer in t.layers})
    input_layers = sorted({layer for t in terms if t.inputs for layer in t.layers})

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        model_inputs = {key: value for key, value in batch.items() if key != PRIOR_KEY}
        if not terms:
            return model(**model_inputs).loss
        hub = attnreg.attach(model)
        with hub.capture(probs_layers, True) as probs, hub.capture(input_layers, True, inputs=True) as inputs:
            loss = model(**model_inputs).loss
        for term in terms:
            loss = loss + term.term(inputs if term.inputs else probs, batch, 0)[0]
        return loss

    if not name.startswith("compiled_"):
        return model, step
    return model, torch.compile(own_code(step, name), dynamic=False)


def own_code(function: Callable, name: str) -> Callable:
    """`function` with a code object of its own. dynamo caches compiled code per code object, and every variant's
    `step` is a closure of one: compiled side by side they took turns failing each other's guards, so that a
    variant's first call was a recompilation that marked the step's numbers dynamic, the next graph broke on them,
    and dynamo fell back to running the step eagerly, compiling only the model's forward (the "compiled" SDPA step
    recompiled inside its timed step). A code object per variant, and `dynamic=False`, keep one graph each."""
    code = function.__code__.replace(co_name=f"step_{name}")
    return types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__, function.__closure__)


def compile_count() -> int:
    """Frames dynamo has been asked to compile so far in this process (a cache miss each: a compilation or a
    recompilation)."""
    return torch._dynamo.utils.counters["frames"]["total"]


def make_batch(shape: Shape, family: str, tokens: int, batch: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, shape.sizes["vocab"], (batch, tokens), generator=generator)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    inputs["labels"] = (
        input_ids if shape.families[family] == "causal_lm" else torch.randint(0, 2, (batch,), generator=generator)
    )
    inputs[PRIOR_KEY] = (torch.arange(tokens) - 1).expand(batch, tokens)  # the previous token; row 0 left out
    return inputs


def train_step(model: torch.nn.Module, step: Step, batch: dict[str, torch.Tensor]) -> None:
    step(batch).backward()
    model.zero_grad(set_to_none=True)


def saved_bytes(model: torch.nn.Module, step: Step, batch: dict[str, torch.Tensor]) -> int:
    exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in exclude:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = step(batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def load_average() -> float:
    """The 1-minute load average (0 where the platform has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def run_config(
    shape: Shape,
    family: str,
    tokens: int,
    batch_size: int,
    reps: int,
    compiled: bool,
    variants: tuple[str, ...] | None = None,
    memory: bool = True,
    budget: float | None = None,
) -> dict:
    base = tiny_model(family, head=shape.families[family], **shape.sizes).train()
    eager = tuple(name for name in shape.variants if variants is None or name in variants)
    names = eager + (COMPILED if compiled else ())
    built = {name: build(name, base) for name in names}
    del base
    batch = make_batch(shape, family, tokens, batch_size)
    saved = {name: saved_bytes(*built[name], batch) for name in eager} if memory else {}
    breaks = graph_breaks(built, batch) if compiled else {}
    for name, (model, step) in built.items():
        if name in saved:
            continue  # the saved-bytes step was its warm-up
        start = time.perf_counter()
        train_step(model, step, batch)  # warm-up (and, for the compiled steps, compiling)
        print(f"  {family} {tokens}: {name} warm-up {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    warm_compiled(built, batch)
    times: dict[str, list[float]] = {name: [] for name in built}
    recompiles = {name: 0 for name in built if name.startswith("compiled_")}
    loads = [load_average()]
    for rep in range(reps):
        order = list(built)[rep % len(built) :] + list(built)[: rep % len(built)]
        started = time.perf_counter()
        for name in order:
            compiles = compile_count()
            start = time.perf_counter()
            train_step(*built[name], batch)
            times[name].append(time.perf_counter() - start)
            if name in recompiles:
                recompiles[name] += compile_count() - compiles
        loads.append(load_average())
        print(f"  {family} {tokens} tokens: repetition {rep + 1}/{reps} (load {loads[-1]:.1f})", file=sys.stderr)
        if budget is not None and 2 * time.perf_counter() - started - STARTED > budget:
            break  # another repetition would not end within the budget
    entry = {"model": family, "tokens": tokens, "batch": batch_size, "times_s": times, "load": loads}
    entry |= {"saved_bytes": saved, "graph_breaks": breaks, "recompiles": recompiles}
    return entry | {"summary": summarize(entry)}


def warm_compiled(built: dict[str, tuple[torch.nn.Module, Step]], batch: dict[str, torch.Tensor], rounds: int = 3):
    """Step every compiled variant again, a round at a time, until a round compiles nothing (at most `rounds`): one
    variant's compilation can fail another's guards, which a timed step must not pay for."""
    compiled = [name for name in built if name.startswith("compiled_")]
    for _ in range(rounds if compiled else 0):
        compiles = compile_count()
        for name in compiled:
            train_step(*built[name], batch)
        if compile_count() == compiles:
            return
        print(f"  warm-up round compiled {compile_count() - compiles} frame(s); another round", file=sys.stderr)


def summarize(entry: dict) -> dict:
    """Per variant: median step time, and median, min and max of its per-repetition ratios to `sdpa` (to
    `compiled_sdpa` for a compiled variant), with its saved bytes and their ratio to SDPA's; for a compiled variant,
    the frames compiled during its timed steps and those of `compiled_sdpa` (any: its ratio is not settled)."""
    times, saved, recompiles = entry["times_s"], entry["saved_bytes"], entry.get("recompiles", {})

    def ratios(name: str, baseline: str) -> list[float] | None:
        if baseline not in times:
            return None
        return [t / s for t, s in zip(times[name], times[baseline], strict=True)]

    summary = {}
    for name in times:
        own = ratios(name, "sdpa")
        compiled = ratios(name, "compiled_sdpa") if name.startswith("compiled_") else None
        summary[name] = {
            "median_s": statistics.median(times[name]),
            "reps": len(times[name]),
            "vs_sdpa": spread(own),
            "vs_compiled_sdpa": spread(compiled),
            "saved_bytes": saved.get(name),
            "saved_vs_sdpa": saved[name] / saved["sdpa"] if name in saved and "sdpa" in saved else None,
        }
        if name.startswith("compiled_") and recompiles:  # its own, and its baseline's
            baseline = recompiles.get("compiled_sdpa", 0) if name != "compiled_sdpa" else 0
            summary[name]["recompiles"] = recompiles.get(name, 0) + baseline
    return summary


def spread(values: list[float] | None) -> dict | None:
    """{median, min, max} of `values` (None for None)."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def verdicts(config: dict, loud: bool) -> list[dict]:
    """Each target of `TARGETS` against the measured spread: met or missed by every repetition, else (the spread
    straddles it) by the median only, which a loud run cannot settle."""
    rows = []
    for name, (time_target, bytes_target) in TARGETS.items():
        row = config["summary"].get(name)
        if row is None or row["vs_sdpa"] is None:
            continue
        ratio = row["vs_sdpa"]
        if ratio["max"] <= time_target:
            time_verdict = "met by every repetition"
        elif ratio["min"] > time_target:
            time_verdict = "missed by every repetition"
        elif loud:
            time_verdict = "not settled: the spread straddles the target and the machine was loud"
        else:
            time_verdict = (
                f"{'met' if ratio['median'] <= time_target else 'missed'} by the median; the spread straddles it"
            )
        saved = row["saved_vs_sdpa"]
        bytes_verdict = None if saved is None else ("met" if saved <= bytes_target else "missed")
        rows.append(
            {"variant": name, "time_target": time_target, "time": time_verdict}
            | {"bytes_target": bytes_target, "bytes": bytes_verdict}
        )
    return rows


def graph_breaks(built: dict[str, tuple[torch.nn.Module, Step]], batch: dict[str, torch.Tensor]) -> dict:
    """The graph breaks `torch._dynamo.explain` finds in each compiled variant's step, beyond the plain step's."""
    found = {}
    for name, (_, step) in built.items():
        if not name.startswith("compiled_"):
            continue
        torch._dynamo.reset()
        explained = torch._dynamo.explain(step._torchdynamo_orig_callable)(batch)
        found[name] = {
            "graphs": explained.graph_count,
            "breaks": [str(getattr(reason, "reason", reason)).splitlines()[0] for reason in explained.break_reasons],
        }
    torch._dynamo.reset()
    plain = set(found.get("compiled_sdpa", {}).get("breaks", []))
    return {name: {**entry, "added": [b for b in entry["breaks"] if b not in plain]} for name, entry in found.items()}


def merge(paths: list[str]) -> dict:
    """The results of several runs of the same shape (parallel processes, each interleaving its own variants) as
    one: repetitions pooled per variant (each ratio still within its own process), the saved bytes of whichever
    run measured them, the loads of all."""
    runs = [json.loads(open(path).read()) for path in paths]
    first = runs[0]
    configs = []
    for index, config in enumerate(first["configs"]):
        parts = [run["configs"][index] for run in runs]
        names = [name for name in config["times_s"]]
        times = {name: [t for part in parts for t in part["times_s"].get(name, [])] for name in names}
        entry = {key: config[key] for key in ("model", "tokens", "batch")} | {"times_s": times}
        entry["load"] = [load for part in parts for load in part["load"]]
        entry["saved_bytes"] = {k: v for part in parts for k, v in part.get("saved_bytes", {}).items()}
        entry["graph_breaks"] = {k: v for part in parts for k, v in part.get("graph_breaks", {}).items()}
        compiled = {k for part in parts for k in part.get("recompiles", {})}
        entry["recompiles"] = {k: sum(part.get("recompiles", {}).get(k, 0) for part in parts) for k in compiled}
        configs.append(entry | {"summary": summarize(entry)})
    return {**{k: v for k, v in first.items() if k not in ("meta", "configs")}, "configs": configs, "merged": paths}


def growth(shape: Shape, family: str, lengths: tuple[int, ...]) -> dict:
    """Saved bytes of the blockwise variants (and sdpa) at each length, batch 1."""
    base = tiny_model(family, head=shape.families[family], **shape.sizes).train()
    rows = {}
    for name in ("sdpa", "kl_head", "entropy_all"):
        model, step = build(name, base)
        rows[name] = {tokens: saved_bytes(model, step, make_batch(shape, family, tokens, 1)) for tokens in lengths}
    return {"model": family, "saved_bytes": rows}


def breakdown(shape: Shape, family: str, tokens: int, batch_size: int, variants: tuple[str, ...], reps: int) -> dict:
    """Self CPU time per aten op (ms per step, median over `reps` profiled steps) of each variant: where
    the extra time of a regularized step goes."""
    base = tiny_model(family, head=shape.families[family], **shape.sizes).train()
    batch = make_batch(shape, family, tokens, batch_size)
    table_ms: dict[str, dict[str, float]] = {}
    for name in variants:
        model, step = build(name, base)
        train_step(model, step, batch)  # warm-up
        table_ms[name] = profiled(lambda: train_step(model, step, batch), reps)  # noqa: B023 (called at once)
    return {"model": family, "tokens": tokens, "batch": batch_size, "self_ms": table_ms}


def analysis_breakdown(shape: Shape, tokens: int, reps: int) -> dict:
    """Self CPU time per aten op (ms, median over `reps` profiled runs) of a plain no-grad forward of the shape's base
    model (`sdpa`) and of the blockwise head statistics (`attnreg.analysis.head_statistics(..., blockwise=True)`) on one
    sequence of `tokens`: where the analysis's time goes, as `benchmarks/decoder_analysis.py` times it."""
    from attnreg.analysis import head_statistics
    from attnreg.app.task import build_tokenizer

    tokenizer = build_tokenizer([f"w{i}" for i in range(64)])
    model = tiny_model(next(iter(shape.families)), **shape.sizes).eval()
    ids = torch.randint(5, len(tokenizer), (1, tokens), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    runs = {
        "sdpa": lambda: model(**batch, use_cache=False),
        "analysis": lambda: head_statistics(model, tokenizer, [batch], blockwise=True),
    }
    table_ms: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for name, run in runs.items():
            run()  # warm-up (and attaching the hub)
            table_ms[name] = profiled(run, reps)
    return {"model": "analysis", "tokens": tokens, "batch": 1, "self_ms": table_ms}


def profiled(run: Callable[[], object], reps: int) -> dict[str, float]:
    """Self CPU ms per aten op of `run`, the median over `reps` profiled calls."""
    per_op: dict[str, list[float]] = {}
    for _ in range(reps):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            run()
        for event in profile.key_averages():
            per_op.setdefault(event.key, []).append(event.self_cpu_time_total / 1000)
    return {op: statistics.median(times + [0.0] * (reps - len(times))) for op, times in per_op.items()}


def breakdown_markdown(entry: dict, top: int = 12) -> list[str]:
    """The ops that grow most from `sdpa` to each other variant, each with its share of that variant's own profiled
    step: shares within one profile hold on a busy machine, where the absolute times, and any difference between two
    profiles taken under different loads, do not."""
    sdpa = entry["self_ms"]["sdpa"]
    lines = [f"Where the time goes: {entry['model']}, {entry['tokens']} tokens (self CPU ms per step)", ""]
    for name, ops in entry["self_ms"].items():
        if name == "sdpa":
            continue
        own = sum(ops.values())
        growth = sorted(ops, key=lambda op: ops[op] - sdpa.get(op, 0.0), reverse=True)[:top]
        rows = [
            [op, f"{sdpa.get(op, 0.0):.1f}", f"{ops[op]:.1f}", f"{ops[op] - sdpa.get(op, 0.0):+.1f}"]
            + [f"{100 * ops[op] / own:.1f}%"]
            for op in growth
        ]
        new = sum(time for op, time in ops.items() if sdpa.get(op, 0.0) == 0.0)
        lines += [
            f"`{name}`: {own:.0f} ms of self CPU time against `sdpa`'s {sum(sdpa.values()):.0f} (profiled one after "
            "the other: on a busy machine compare shares, not times); the ops `sdpa` never runs take "
            f"{100 * new / own:.1f}% of this step",
            "",
        ]
        lines += table(["op", "sdpa", name, "difference", f"share of {name}'s step"], rows) + [""]
    return lines


LOUD = " (loud: more than 3/4 of the CPUs busy)"


def ratio_text(ratio: dict | None, recompiles: int = 0) -> str:
    """`median (min-max)`; a compiled ratio whose timed steps compiled anything reads "not settled"."""
    if ratio is None:
        return ""
    text = f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})"
    return f"{text}, not settled: {recompiles} recompile(s) in timed steps" if recompiles else text


def markdown(results: dict) -> str:
    sizes = results["sizes"]
    kv = f" ({sizes['num_key_value_heads']} key/value heads)" if "num_key_value_heads" in sizes else ""
    loads = [load for config in results["configs"] for load in config.get("load", [])]
    load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "n/a"
    lines = [
        "# What attnreg costs on the train step (ratios to plain SDPA, same run)",
        "",
        f"Models ({results.get('shape', 'minilm')} shape): {sizes['layers']} layers x {sizes['heads']} heads{kv} x "
        f"{sizes['hidden']}, vocabulary {sizes['vocab']}, random weights; {results.get('threads', 1)} torch "
        f"thread(s) per process; timed repetitions interleaved; ratios are the median (min-max) of per-repetition "
        f"ratios; compiled ratios are to `compiled_sdpa`. 1-minute load average during the run: {load} on "
        f"{results.get('cpus', os.cpu_count())} CPUs{LOUD if results.get('loud') else ''}.",
        "",
        *quick_banner(results["quick"]),
    ]
    if results.get("merged"):
        lines += [
            f"Pooled from {len(results['merged'])} processes run side by side, each interleaving its variants.",
            "",
        ]
    rows = []
    for config in results["configs"]:
        for name, row in config["summary"].items():
            saved = f"{row['saved_bytes'] / MB:.1f}" if row["saved_bytes"] is not None else "n/a"
            saved_ratio = f"{row['saved_vs_sdpa']:.3f}" if row["saved_vs_sdpa"] is not None else "n/a"
            rows.append(
                [config["model"], config["tokens"], config["batch"], name, f"{row['median_s'] * 1000:.0f}", row["reps"]]
                + [ratio_text(row["vs_sdpa"]), ratio_text(row["vs_compiled_sdpa"], row.get("recompiles", 0))]
                + [saved, saved_ratio]
            )
    header = ["model", "tokens", "batch", "variant", "step ms", "reps", "x SDPA", "x compiled SDPA", "saved MB"]
    lines += table(header + ["saved x SDPA"], rows, "lrrlrrrrrr") if rows else []  # none in a --breakdown-only run
    for config in results["configs"]:
        for name, entry in config.get("graph_breaks", {}).items():
            added = "; ".join(entry["added"]) or "none"
            compiled = config.get("recompiles", {}).get(name, "n/a")
            lines += [
                "",
                f"`{name}`: {entry['graphs']} graph(s); graph breaks beyond the plain step's: {added}; frames compiled "
                f"during its timed steps: {compiled}",
            ]
    if results.get("verdicts"):
        lines += ["", "Against the targets (issue 40):", ""]
        verdict_rows = [
            [v["variant"], f"<= {v['time_target']}x: {v['time']}", f"<= {v['bytes_target']}x: {v['bytes'] or 'n/a'}"]
            for v in results["verdicts"]
        ]
        lines += table(["variant", "time", "saved bytes"], verdict_rows, "lll")
    lines += ["", "Saved for backward (MB, batch 1) by length:", ""] if results["growth"] else [""]
    for entry in results["growth"]:
        lengths = list(next(iter(entry["saved_bytes"].values())))
        growth_rows = [[name] + [f"{row[t] / MB:.1f}" for t in lengths] for name, row in entry["saved_bytes"].items()]
        lines += table([entry["model"], *(f"{t} tokens" for t in lengths)], growth_rows) + [""]
    for entry in results.get("breakdown", []):
        lines += breakdown_markdown(entry)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser, "the decoder shape on 2 layers, 256 tokens, 3 repetitions, nothing compiled")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="minilm: BERT and GPT-2 at MiniLM's shape, 512 and 2,048 tokens (the default of a full run); smollm2: "
        "a Llama at SmolLM2-135M's shape, 2,048 tokens, sdpa/idle/kl_head/entropy_all only (the default of --quick)",
    )
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5, quick 3)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: steadier on a shared machine)"
    )
    parser.add_argument("--variants", default=None, help="comma-separated variants to time (default: the shape's)")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the saved-bytes pass")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled variants")
    parser.add_argument("--compiled", action="store_true", help="add the compiled variants at SmolLM2's shape")
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds since start after which no repetition begins that would not end in time",
    )
    parser.add_argument("--merge", nargs="+", default=None, help="pool these results.json files into one table")
    parser.add_argument("--layers", type=int, default=None, help="the shape with this many layers (a reduced shape)")
    parser.add_argument("--tokens", type=int, default=None, help="this many tokens, batch 1, instead of the shape's")
    parser.add_argument(
        "--analysis-tokens",
        type=int,
        default=None,
        help="with --breakdown-only: also profile the blockwise head statistics against a forward at this length",
    )
    parser.add_argument(
        "--breakdown-only",
        action="store_true",
        help="only the per-op profile of sdpa, kl_head and entropy_all (written as its own run)",
    )
    args = parser.parse_args(argv)
    if args.merge:
        results = merge(args.merge)
        results["loud"] = max(load for c in results["configs"] for load in c["load"]) > 0.75 * results["cpus"]
        settles = results["shape"] == "smollm2" and not results["quick"]
        results["verdicts"] = verdicts(results["configs"][0], results["loud"]) if settles else []
        text = markdown(results)
        write_results(output_dir(args, "overhead"), results, text, args)
        print(text)
        return
    torch.set_num_threads(args.threads)  # one core per process by default: steadier timings on a shared machine
    torch._dynamo.config.cache_size_limit = 64  # one compiled step per variant, none falling back to eager
    reps = args.reps if args.reps is not None else (3 if args.quick else 5)
    name = args.shape or ("smollm2" if args.quick else "minilm")
    shape = SHAPES[name].quick() if args.quick else SHAPES[name]
    if args.layers is not None:
        shape = replace(shape, sizes={**shape.sizes, "layers": args.layers})
    if args.tokens is not None:
        shape = replace(
            shape,
            configs=((args.tokens, 1),),
            sizes={**shape.sizes, "positions": max(args.tokens, shape.sizes["positions"])},
        )
    configs = shape.configs
    variants = tuple(args.variants.split(",")) if args.variants else None
    lengths = (64, 128) if args.quick else (512, 1024, 2048)
    profiled = ("sdpa", "kl_head", "entropy_all")
    profile = (shape.extras and variants is None) or args.breakdown_only
    breakdowns = [
        breakdown(shape, family, tokens, batch, profiled, reps)
        for tokens, batch in (configs if profile else ())
        for family in shape.families
    ]
    results = {"quick": args.quick, "shape": shape.name, "reps": reps, "threads": args.threads}
    results |= {"cpus": os.cpu_count(), "sizes": shape.sizes}
    if args.breakdown_only:
        if args.analysis_tokens:
            analysis_shape = replace(shape, sizes={**shape.sizes, "positions": args.analysis_tokens})
            breakdowns.append(analysis_breakdown(analysis_shape, args.analysis_tokens, reps))
        results |= {"configs": [], "growth": [], "breakdown": breakdowns}
        text = markdown(results)
        write_results(output_dir(args, "overhead"), results, text, args)
        print(text)
        return

    def compiled(family: str, tokens: int) -> bool:
        if args.quick or not args.compile:
            return args.compile and args.compiled  # --quick --compiled: the compiled variants at the quick shape
        return args.compiled if shape.name == "smollm2" else family == "bert" and tokens == configs[0][0]

    results["configs"] = [
        run_config(shape, family, tokens, batch, reps, compiled(family, tokens), variants, args.memory, args.budget)
        for tokens, batch in configs
        for family in shape.families
    ]
    results["loud"] = max(load for config in results["configs"] for load in config["load"]) > 0.75 * os.cpu_count()
    settles = shape.name == "smollm2" and not args.quick  # the targets are at the full shape
    results["verdicts"] = verdicts(results["configs"][0], results["loud"]) if settles else []
    results["growth"] = [growth(shape, family, lengths) for family in shape.families] if shape.extras else []
    results["breakdown"] = breakdowns
    text = markdown(results)
    write_results(output_dir(args, "overhead"), results, text, args)
    print(text)


if __name__ == "__main__":
    main()
