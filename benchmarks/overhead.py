"""Train-step overhead of the attention hub against plain SDPA and eager attention.

Full run (from the repository root; about 20-25 minutes on 2 idle cores, far longer on a busy machine):

    .venv/bin/python benchmarks/overhead.py

Smoke run (128 tokens, 3 repetitions; the figures mean nothing):

    .venv/bin/python benchmarks/overhead.py --quick

Two model shapes, both MiniLM-sized (4 layers x 12 heads x 384, vocabulary 1,000, dropout 0) and
randomly initialised with `attnreg.tiny.tiny_model`: a BERT sequence classifier and a GPT-2 causal LM.
Batch 16 at 128 and 512 tokens (no padding). For each shape and length five copies of one model with
identical weights are trained side by side:

- `sdpa`: the plain model, transformers' SDPA attention;
- `eager`: the plain model, eager attention (the baseline for capture, which materialises probabilities too);
- `idle`: `attnreg.attach(model)` and nothing else;
- `gates`: attached, with `hub.gate(layer)` created on every layer (trainable, at 1);
- `capture`: attached, the forward runs inside `hub.capture()` (all layers): the hub's own cost;
- `capture_term`: as `capture`, and the loss adds
  `1e-3 * sum(p.diagonal(dim1=-2, dim2=-1).mean() for p in probs.values())` (mean self-attention mass),
  so the backward pass also runs through every captured probability tensor (the cost of any attention
  loss: a second gradient of attention size to accumulate).

At 128 tokens each variant gets twice the repetitions (steps are short and noisier).

A train step is forward + loss + backward + `zero_grad(set_to_none=True)`; there is no optimizer step.
After a warm-up, the variants are timed round-robin (the order rotated every repetition) so that load
from other processes hits all of them alike; ratios are medians of per-repetition ratios (the JSON also
has ratios of the fastest repetitions, `min_vs_sdpa` and `min_vs_eager`).

Memory kept for backward is the total size of the distinct storages autograd saves during one forward
(`torch.autograd.graph.saved_tensors_hooks`, parameters excluded): deterministic, unlike RSS. The peak
RSS growth over that same step is reported as well, but it depends on what the allocator kept from earlier
steps, so it is only indicative.

glibc returns large blocks to the OS and the kernel zeroes fresh pages at every large allocation; see
DESIGN.md. `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000` in the environment avoids that;
whether they were set is recorded in the results.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn

import attnreg
from attnreg.hub import AttentionHub
from attnreg.tiny import tiny_model

SHAPES = {"bert": "classification", "gpt2": "causal_lm"}
SIZES = dict(hidden=384, layers=4, heads=12, vocab=1000, positions=512)
BATCH = 16
CAPTURE_WEIGHT = 1e-3
VARIANTS = ("sdpa", "eager", "idle", "gates", "capture", "capture_term")
# (variant, baseline, largest allowed ratio of step times)
TARGETS = (("idle", "sdpa", 1.02), ("gates", "sdpa", 1.05), ("capture", "eager", 1.10))
MALLOC_VARS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")
MB = 2**20


@dataclass
class Variant:
    name: str
    model: nn.Module
    hub: AttentionHub | None = None
    capture: bool = False
    term: bool = False


def build_variants(family: str) -> list[Variant]:
    """Five copies of one randomly initialised model, set up as the variants above, in train mode."""
    base = tiny_model(family, head=SHAPES[family], **SIZES).train()
    variants = []
    for name in VARIANTS:
        model = copy.deepcopy(base)
        hub = None
        if name == "eager":
            model.set_attn_implementation("eager")
        elif name in ("idle", "gates", "capture", "capture_term"):
            hub = attnreg.attach(model)
            if name == "gates":
                for layer in range(hub.num_layers):
                    hub.gate(layer)
        variants.append(Variant(name, model, hub, capture=name.startswith("capture"), term=name == "capture_term"))
    return variants


def make_batch(family: str, tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, SIZES["vocab"], (BATCH, tokens), generator=generator)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if SHAPES[family] == "causal_lm":
        batch["labels"] = input_ids
    else:
        batch["labels"] = torch.randint(0, 2, (BATCH,), generator=generator)
    return batch


def forward_loss(variant: Variant, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss to train on and the model's own loss (equal for every variant but capture)."""
    if not variant.capture:
        loss = variant.model(**batch).loss
        return loss, loss
    assert variant.hub is not None
    with variant.hub.capture() as probs:
        model_loss = variant.model(**batch).loss
    if len(probs) != variant.hub.num_layers:
        raise RuntimeError(f"captured {len(probs)} layers, expected {variant.hub.num_layers}")
    if not variant.term:
        return model_loss, model_loss
    term = sum(p.diagonal(dim1=-2, dim2=-1).mean() for p in probs.values())
    return model_loss + CAPTURE_WEIGHT * term, model_loss


def train_step(variant: Variant, batch: dict[str, torch.Tensor]) -> float:
    """One forward + backward + zero_grad; returns the model's own loss."""
    loss, model_loss = forward_loss(variant, batch)
    loss.backward()
    variant.model.zero_grad(set_to_none=True)
    return model_loss.item()


def saved_bytes(variant: Variant, batch: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward, parameters excluded."""
    exclude = {t.untyped_storage().data_ptr() for t in [*variant.model.parameters(), *variant.model.buffers()]}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in exclude:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss, _ = forward_loss(variant, batch)
    loss.backward()
    variant.model.zero_grad(set_to_none=True)
    return sum(storages.values())


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_growth(step: Callable[[], object]) -> int | None:
    """Peak RSS during `step` minus RSS before it, in bytes (Linux only; None elsewhere)."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        return None
    before = _status_kb("VmRSS")
    step()
    peak = _status_kb("VmHWM")
    if before is None or peak is None:
        return None
    return max(0, peak - before) * 1024


def run_config(family: str, tokens: int, reps: int, warmup: int) -> dict:
    """Warm up, measure memory, then time the variants round-robin; returns the raw and summary figures."""
    variants = build_variants(family)
    batch = make_batch(family, tokens)
    losses = {}
    for _ in range(warmup):
        for variant in variants:
            losses[variant.name] = train_step(variant, batch)
    reference = losses["sdpa"]
    for name, loss in losses.items():
        if abs(loss - reference) > 1e-3 * max(1.0, abs(reference)):
            raise RuntimeError(f"{family} {tokens}: {name} loss {loss:.6f} differs from sdpa {reference:.6f}")

    memory: dict[str, int] = {}
    rss: dict[str, int | None] = {}
    for variant in variants:
        rss[variant.name] = peak_rss_growth(lambda v=variant: memory.__setitem__(v.name, saved_bytes(v, batch)))

    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for rep in range(reps):
        shift = rep % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            start = time.perf_counter()
            train_step(variant, batch)
            times[variant.name].append(time.perf_counter() - start)
        print(f"  {family} {tokens} tokens: repetition {rep + 1}/{reps}", file=sys.stderr, flush=True)

    def ratio(name: str, baseline: str) -> float:
        return statistics.median(t / b for t, b in zip(times[name], times[baseline], strict=True))

    summary = {
        name: {
            "median_s": statistics.median(times[name]),
            "vs_sdpa": ratio(name, "sdpa"),
            "vs_eager": ratio(name, "eager"),
            "min_s": min(times[name]),
            "min_vs_sdpa": min(times[name]) / min(times["sdpa"]),
            "min_vs_eager": min(times[name]) / min(times["eager"]),
            "saved_bytes": memory[name],
            "saved_vs_sdpa": memory[name] / memory["sdpa"],
            "saved_vs_eager": memory[name] / memory["eager"],
            "peak_rss_growth_bytes": rss[name],
        }
        for name in times
    }
    checks = [
        {
            "variant": name,
            "baseline": baseline,
            "target": limit,
            "ratio": summary[name][f"vs_{baseline}"],
            "pass": summary[name][f"vs_{baseline}"] <= limit,
        }
        for name, baseline, limit in TARGETS
    ]
    del variants
    gc.collect()
    return {"model": family, "tokens": tokens, "times_s": times, "summary": summary, "targets": checks}


def machine() -> dict:
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "malloc_env": {name: os.environ.get(name) for name in MALLOC_VARS},
    }


def command_line() -> str:
    env = " ".join(f"{name}={os.environ[name]}" for name in MALLOC_VARS if name in os.environ)
    args = shlex.join([".venv/bin/python", "benchmarks/overhead.py", *sys.argv[1:]])
    return f"{env} {args}".strip()


def _mb(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MB:.0f}"


def markdown(results: dict) -> str:
    info = results["machine"]
    malloc = ", ".join(f"{k}={v}" for k, v in info["malloc_env"].items() if v is not None) or "not set"
    lines = [
        "# attnreg train-step overhead",
        "",
        f"- Date: {results['date']}",
        f"- Command: `{results['command']}`",
        f"- Machine: {info['cpu_count']} CPUs ({info['processor']}), torch {info['torch']} with "
        f"{info['torch_threads']} threads, transformers {info['transformers']}, Python {info['python']}",
        f"- glibc malloc variables ({', '.join(MALLOC_VARS)}): {malloc}",
        f"- Models: BERT classifier and GPT-2 causal LM, {SIZES['layers']} layers x {SIZES['heads']} heads x "
        f"{SIZES['hidden']}, vocabulary {SIZES['vocab']}, dropout 0, random weights; batch {BATCH}",
        f"- Step: forward + loss + backward + zero_grad (no optimizer step); {results['warmup']} warm-up and "
        f"{results['reps']} timed repetitions per variant (twice as many at 128 tokens), interleaved round-robin",
        f"- capture: all layers captured, probabilities kept; capture_term: also "
        f"`{CAPTURE_WEIGHT} * sum(p.diagonal(dim1=-2, dim2=-1).mean() for p in probs.values())` added to the loss",
        "- Ratios: median over repetitions of (variant step time / baseline step time in the same repetition)",
        "- Saved: bytes of distinct storages autograd keeps for backward (parameters excluded); peak RSS growth "
        "over one step depends on what the allocator kept from earlier steps",
    ]
    if results["quick"]:
        lines += ["", "**Quick smoke run: too few repetitions for the figures to mean anything.**"]
    lines += [
        "",
        "| model | tokens | variant | step ms | x SDPA | x eager | saved MB | saved x SDPA | peak RSS growth MB |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for config in results["configs"]:
        for name, row in config["summary"].items():
            lines.append(
                f"| {config['model']} | {config['tokens']} | {name} | {row['median_s'] * 1000:.0f} | "
                f"{row['vs_sdpa']:.3f} | {row['vs_eager']:.3f} | {_mb(row['saved_bytes'])} | "
                f"{row['saved_vs_sdpa']:.2f} | {_mb(row['peak_rss_growth_bytes'])} |"
            )
    lines += ["", "| model | tokens | target | measured | result |", "|---|---:|---|---:|---|"]
    for config in results["configs"]:
        for check in config["targets"]:
            lines.append(
                f"| {config['model']} | {config['tokens']} | {check['variant']} <= {check['target']:.2f}x "
                f"{check['baseline']} | {check['ratio']:.3f}x | {'PASS' if check['pass'] else 'FAIL'} |"
            )
    passed = sum(c["pass"] for config in results["configs"] for c in config["targets"])
    total = sum(len(config["targets"]) for config in results["configs"])
    lines += ["", f"{passed} of {total} targets met."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 tokens and 3 repetitions: a smoke run")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per variant (default 9, quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per variant (default 2, quick 1)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    reps = args.reps if args.reps is not None else (3 if args.quick else 9)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    lengths = (128,) if args.quick else (128, 512)

    results = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(),
        "machine": machine(),
        "quick": args.quick,
        "reps": reps,
        "warmup": warmup,
        "batch": BATCH,
        "sizes": SIZES,
        "capture_weight": CAPTURE_WEIGHT,
        "configs": [],
    }
    started = time.perf_counter()
    for tokens in lengths:
        for family in SHAPES:
            results["configs"].append(run_config(family, tokens, reps * 2 if tokens <= 128 else reps, warmup))
    results["wall_s"] = time.perf_counter() - started

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (args.out / "overhead.md").write_text(table)
    print(table)
    print(f"wrote {args.out / 'overhead.json'} and {args.out / 'overhead.md'} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
