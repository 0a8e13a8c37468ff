"""What removing key/value groups from SmolLM2-135M saves where the model is served (issue 48): the KV cache per
token, decode tokens/s at long contexts and peak memory, in transformers and in llama.cpp, against the unpruned
model in the same run.

Four models, one importance choice (head importance, Michel et al. 2019, on the LM loss of `--importance` EWT
training sentences in seed 0's order, as `decoder_pruning_lora.py` chooses; a group scores the sum of its query
heads'): `unpruned`; `uniform`, one key/value group removed from every layer, each layer's least important
(`select_groups(..., uniform=True)`; 30 of SmolLM2's 90 groups: a quarter cannot be uniform over 30 layers of 3);
`free_third`, the same 30 chosen globally (at least one group left per layer); `free_quarter`, 22 of 90 chosen
globally. Speed and memory depend on the architecture only, so no recovery fine-tune is run.

transformers (float32, SDPA, `DynamicCache`): real EWT text joined and cut to C tokens is prefilled ONCE per model
and context at batch 1 (timed, peak memory); the cache's key/value tensor bytes per token are measured there, beside
the analytic 2 x sum(kv heads) x head_dim x 4 bytes. Each decode repetition then starts from a fresh copy of that
cache, repeated along the batch for batch 8 (8 copies of one sequence: the decode's cost depends on the cache's sizes,
not its values), and decodes `--new-tokens` greedily one token at a time; repetitions interleaved across the models,
median and min-max. Peak memory: the process's peak RSS reset (`/proc/self/clear_refs`, 5) before the cache copy is
made, read (`VmHWM`) after the decode, reported above the RSS just before: the batch's cache plus what the decode
allocates. glibc's mmap threshold is set to 64 KiB at start so that freed caches go back to the OS.

llama.cpp (`llama-cpp-python`, skipped with `--no-llama-cpp` or where it is not installed): each model written by
`attnreg.export.export_gguf` (f32; `llama` architecture for uniform counts, `deci` for per-layer ones), loaded with
n_ctx = C + 32, the same C tokens prefilled with `Llama.eval`, then `--new-tokens` decoded one at a time (argmax of
the last logits), batch 1 only (the high-level API serves one sequence), repetitions interleaved, the cache cut back
to C between them. Peak RSS above the RSS before loading (weights, KV cache of n_ctx, buffers, prefill and a decode);
KV bytes per token from the cache type (f16) and each layer's kv heads. A sanity check: the greedy continuation of a
short prompt in llama.cpp against transformers', per model.

    python benchmarks/smollm2_serving.py --run smollm2   # SmolLM2-135M, 2,048 and 8,192 tokens, batch 1 and 8
    python benchmarks/smollm2_serving.py --quick         # tiny random Llama, 64 and 128 tokens, to a temp folder
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import importlib.util
import os
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import add_output_arguments, output_dir, quick_banner, table, write_results
from decoder_common import (
    GGUF,
    builtin_sentences,
    lm_batches,
    load_smollm2,
    quick_model,
    quick_tokenizer,
    read_ewt,
    smollm2_folder,
)
from decoder_pruning import choose_groups, group_scores
from decoder_pruning_lora import pruned_by_groups
from transformers import DynamicCache

from attnreg.export import export_gguf, head_layout
from attnreg.methods.pruning import count_parameters, head_importance, select_groups

PROMPT = "The capital of France is"
MIB = 1024 * 1024
M_MMAP_THRESHOLD = -3


# --- memory ----------------------------------------------------------------------------------------------------


def release_freed_memory() -> bool:
    """glibc: allocations from 64 KiB on are mmap'd, so that a freed cache goes back to the OS (RSS falls)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 65536))
    except (OSError, AttributeError):
        return False


def status_kib(field: str) -> int:
    """A `/proc/self/status` field in KiB (VmRSS, VmHWM); 0 where there is none."""
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        return 0
    return int(match.group(1)) if match else 0


class Peak:
    """The peak RSS of a block above the RSS just before it, in MiB (None where `clear_refs` cannot be written).

    Example:
        >>> with Peak() as peak:
        ...     block = bytearray(64 * 1024 * 1024)
        >>> peak.mib is None or peak.mib >= 60
        True
    """

    def __enter__(self) -> Peak:
        gc.collect()
        self.before = status_kib("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.ok = True
        except OSError:
            self.ok = False
        self.mib = None
        return self

    def __exit__(self, *exc) -> None:
        if self.ok:
            self.mib = round((status_kib("VmHWM") - self.before) / 1024, 1)


# --- models ----------------------------------------------------------------------------------------------------


def kv_heads(model) -> list[int]:
    return [kv for _, kv in head_layout(model)]


def llama_cpp_bytes_per_token(kv_heads: list[int], head_dim: int, flash_attn: bool = False, element: int = 2) -> int:
    """Bytes per token of llama.cpp's f16 KV cache as it allocates it: keys by each layer's kv heads; values too,
    except that without flash attention, where the layers' value widths differ, llama.cpp pads every layer's values
    to the widest (its log: "the V embeddings have different sizes across layers and FA is not enabled - padding V
    cache").

    Example:
        >>> llama_cpp_bytes_per_token([3, 2, 1], 64), llama_cpp_bytes_per_token([3, 2, 1], 64, flash_attn=True)
        (1920, 1536)
    """
    values = kv_heads if flash_attn or len(set(kv_heads)) == 1 else [max(kv_heads)] * len(kv_heads)
    return (sum(kv_heads) + sum(values)) * head_dim * element


def analytic_bytes_per_token(model, head_dim: int, element: int) -> int:
    """2 (key and value) x sum over layers of kv heads x head_dim x bytes per element."""
    return 2 * sum(kv_heads(model)) * head_dim * element


def build_models(base, tokenizer, texts: list[str], args) -> tuple[dict, dict]:
    """The four models (unpruned first) and what was removed from each ({layer: [group]})."""
    config = base.config
    layers, groups = config.num_hidden_layers, config.num_key_value_heads
    per_group = config.num_attention_heads // groups
    batches = lm_batches(tokenizer, texts, 8, args.max_length)
    by_group = group_scores(head_importance(copy.deepcopy(base), batches), groups)
    scored = {layer: torch.tensor(values) for layer, values in by_group.items()}
    uniform = select_groups(scored, dict.fromkeys(scored, 1), keep=layers * groups - layers, uniform=True)
    removed = {
        "unpruned": {},
        "uniform": {int(layer): sorted(gs) for layer, gs in uniform.items()},
        "free_third": choose_groups(by_group, "global", 1 / 3),
        "free_quarter": choose_groups(by_group, "global", 1 / 4),
    }
    models = {name: (base if not gs else pruned_by_groups(base, gs, per_group).eval()) for name, gs in removed.items()}
    return models, {"removed": removed, "group_importance": by_group}


# --- transformers ------------------------------------------------------------------------------------------------


def cache_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def batched_copy(cache: DynamicCache, batch: int) -> DynamicCache:
    """A new cache holding `batch` copies of the (batch-1) `cache`'s sequence, contiguous."""
    return DynamicCache(
        [(layer.keys.expand(batch, -1, -1, -1), layer.values.expand(batch, -1, -1, -1)) for layer in cache.layers]
    )


@torch.no_grad()
def prefill(model, ids: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    """The cache after `ids` (batch 1) and the greedy next token, (1, 1)."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1].argmax(-1, keepdim=True)


@torch.no_grad()
def decode(model, cache: DynamicCache, token: torch.Tensor, new_tokens: int) -> list[int]:
    """Greedy decoding of `new_tokens`, one at a time with the cache; the tokens of the first row."""
    out = []
    for _ in range(new_tokens):
        logits = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(int(token[0, 0]))
    return out


def transformers_speed(models: dict, ids: torch.Tensor, contexts: list[int], batches: list[int], args) -> dict:
    """Per context: each model's prefill (batch 1) and the decode at each batch, repetitions interleaved."""
    out: dict = {}
    for context in contexts:
        prefills: dict = {}
        for name, model in models.items():
            with Peak() as peak:
                started = time.perf_counter()
                cache, token = prefill(model, ids[:, :context])
                seconds = time.perf_counter() - started
            measured = cache_bytes(cache)
            prefills[name] = (cache, token)
            out.setdefault(name, {})[str(context)] = {
                "prefill_s": round(seconds, 3),
                "prefill_peak_mib": peak.mib,
                "cache_mib": round(measured / MIB, 2),
                "bytes_per_token": measured / context,
                "decode": {},
            }
            print(f"  {name} C={context}: prefill {seconds:.1f} s, cache {measured / MIB:.1f} MiB", flush=True)
        for name, model in models.items():  # warm-up of the decode, untimed
            decode(model, batched_copy(prefills[name][0], 1), prefills[name][1], 2)
        runs: dict = {name: {str(b): [] for b in batches} for name in models}
        for repetition in range(args.repetitions):
            for batch in batches:
                for name, model in models.items():
                    cache, token = prefills[name]
                    with Peak() as peak:
                        copied = batched_copy(cache, batch)
                        started = time.perf_counter()
                        tokens = decode(model, copied, token.expand(batch, 1), args.new_tokens)
                        seconds = time.perf_counter() - started
                    runs[name][str(batch)].append(
                        {"s": seconds, "peak_mib": peak.mib, "cache_bytes": cache_bytes(copied), "tokens": tokens}
                    )
                    del copied
                print(f"  C={context} repetition {repetition + 1}/{args.repetitions} batch {batch} done", flush=True)
        for name in models:
            for batch in batches:
                entries = runs[name][str(batch)]
                rates = [batch * args.new_tokens / e["s"] for e in entries]
                peaks = [e["peak_mib"] for e in entries if e["peak_mib"] is not None]
                out[name][str(context)]["decode"][str(batch)] = {
                    "tokens_per_s": round(statistics.median(rates), 2),
                    "min": round(min(rates), 2),
                    "max": round(max(rates), 2),
                    "rates": [round(r, 2) for r in rates],
                    "peak_mib": round(statistics.median(peaks), 1) if peaks else None,
                    "cache_mib": round(entries[0]["cache_bytes"] / MIB, 2),
                    "cache_bytes": entries[0]["cache_bytes"],
                    "tokens": entries[0]["tokens"],
                }
        del prefills
        gc.collect()
    reference = next(iter(models))
    for name in models:
        for context in contexts:
            for batch in batches:
                entry = out[name][str(context)]["decode"][str(batch)]
                entry["ratio"] = round(entry["tokens_per_s"] / out[reference][str(context)]["decode"][str(batch)]
                                       ["tokens_per_s"], 3)  # fmt: skip
    return out


@torch.no_grad()
def greedy_tokens(model, ids: list[int], new_tokens: int) -> list[int]:
    cache, token = prefill(model, torch.tensor([ids]))
    return [int(token[0, 0]), *decode(model, cache, token, new_tokens - 1)]


# --- llama.cpp ---------------------------------------------------------------------------------------------------


def has_llama_cpp() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def last_logits(llm):
    """The logits of the last token `llm.eval` saw (a numpy vector of the vocabulary's size)."""
    import llama_cpp
    import numpy as np

    pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(pointer, shape=(llm.n_vocab(),))


def llama_decode(llm, context: int, token: int, new_tokens: int) -> list[int]:
    """Greedy decoding of `new_tokens` after the first `context` tokens in the cache (anything after them dropped)."""
    llm.n_tokens = context  # Llama.eval removes the cache's entries from n_tokens on before it evaluates
    out = []
    for _ in range(new_tokens):
        llm.eval([token])
        token = int(last_logits(llm).argmax())
        out.append(token)
    return out


def load_llama(path: Path, context: int, threads: int):
    import llama_cpp

    return llama_cpp.Llama(
        model_path=str(path), n_ctx=context + 32, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False
    )


def llama_kv_log(path: Path, context: int, threads: int) -> dict | None:
    """llama.cpp's own account of its KV cache, read from its log at load: the cells, and K and V MiB with their
    types; None where the log has no such line."""
    import contextlib
    import io

    import llama_cpp

    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=context + 32, n_threads=threads, n_batch=512, verbose=True)
        if hasattr(llm, "close"):
            llm.close()
    text = log.getvalue()
    found = re.search(r"\(\s*(\d+) cells.*?K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB", text)
    if found is None:
        return None
    cells, k_type, k_mib, v_type, v_mib = found.groups()
    return {"cells": int(cells), "k_type": k_type, "k_mib": float(k_mib), "v_type": v_type, "v_mib": float(v_mib),
            "v_padded": "padding V cache" in text}  # fmt: skip


def llama_cpp_speed(paths: dict, ids: list[int], contexts: list[int], args) -> dict:
    """Per context: each model loaded, prefilled and decoded once (peak memory), then timed decodes interleaved."""
    out: dict = {}
    for context in contexts:
        llms, first = {}, {}
        for name, path in paths.items():
            kv_log = llama_kv_log(path, context, args.llama_threads)
            with Peak() as peak:
                started = time.perf_counter()
                llm = load_llama(path, context, args.llama_threads)
                loaded = time.perf_counter()
                llm.eval(ids[:context])
                prefilled = time.perf_counter()
                first[name] = int(last_logits(llm).argmax())
                llama_decode(llm, context, first[name], args.new_tokens)
            llms[name] = llm
            out.setdefault(name, {})[str(context)] = {
                "load_s": round(loaded - started, 3),
                "prefill_s": round(prefilled - loaded, 3),
                "peak_mib": peak.mib,
                "kv_log": kv_log,
            }
            print(f"  llama.cpp {name} C={context}: prefill {prefilled - loaded:.1f} s, peak {peak.mib} MiB")
        rates: dict = {name: [] for name in paths}
        tokens: dict = {}
        for _ in range(args.repetitions):
            for name, llm in llms.items():
                started = time.perf_counter()
                tokens[name] = llama_decode(llm, context, first[name], args.new_tokens)
                rates[name].append(args.new_tokens / (time.perf_counter() - started))
        for name in paths:
            out[name][str(context)].update(
                tokens_per_s=round(statistics.median(rates[name]), 2),
                min=round(min(rates[name]), 2),
                max=round(max(rates[name]), 2),
                rates=[round(r, 2) for r in rates[name]],
                tokens=tokens[name],
            )
        for llm in llms.values():
            if hasattr(llm, "close"):
                llm.close()
        del llms
        gc.collect()
    reference = next(iter(paths))
    for name in paths:
        for context in contexts:
            entry = out[name][str(context)]
            entry["ratio"] = round(entry["tokens_per_s"] / out[reference][str(context)]["tokens_per_s"], 3)
    return out


def llama_greedy(path: Path, ids: list[int], new_tokens: int, threads: int) -> list[int]:
    llm = load_llama(path, len(ids) + new_tokens, threads)
    llm.eval(ids)
    token = int(last_logits(llm).argmax())
    tokens = [token, *llama_decode(llm, len(ids), token, new_tokens - 1)]
    if hasattr(llm, "close"):
        llm.close()
    return tokens


# --- report ------------------------------------------------------------------------------------------------------


def markdown(report: dict, args) -> str:
    setup, models = report["setup"], report["models"]
    hf, cpp = report["transformers"], report.get("llama_cpp")
    groups = setup["layers"] * setup["kv_groups"]
    lines = [
        f"# Serving a decoder with key/value groups removed ({setup['model']})",
        "",
        *quick_banner(args.quick),
        f"Groups chosen by head importance on {setup['importance_sentences']} {setup['importance_source']} (seed 0); "
        "no recovery fine-tune (speed and memory depend on the architecture only). Context: "
        f"{setup['context_source']}, cut to C tokens; greedy decoding of {args.new_tokens} tokens one at a time "
        f"with the KV cache, {args.repetitions} "
        f"repetitions interleaved across the models, median (min-max) tokens/s; {setup['threads']} torch thread(s), "
        f"llama.cpp {args.llama_threads} thread(s). Load average at start {setup['load_at_start']}, at the end "
        f"{setup.get('load_at_end')} (2 shared cores: times are noisy).",
        "",
        "## Models and KV cache per token",
        "",
    ]
    rows = []
    for name, entry in models.items():
        measured = {c: hf[name][c]["bytes_per_token"] for c in hf[name]}
        rows.append([
            name,
            f"{entry['removed_count']}/{groups}",
            entry["kv_heads_total"],
            entry["query_heads_total"],
            f"{entry['parameters'] / 1e6:.2f}M",
            entry["gguf_arch"] or "-",
            " / ".join(f"{v:,.0f}" for v in measured.values()),
            f"{entry['kv_bytes_per_token_f32']:,}",
            f"{entry['kv_bytes_per_token_f32'] / models['unpruned']['kv_bytes_per_token_f32']:.3f}",
            f"{entry['kv_bytes_per_token_f16']:,}",
            f"{llama_cpp_bytes_per_token(entry['kv_heads'], setup['head_dim']):,}",
        ])  # fmt: skip
    lines += table(
        ["model", "groups removed", "kv heads", "query heads", "parameters", "GGUF arch",
         f"KV bytes/token measured, transformers f32 (C = {' / '.join(map(str, hf['unpruned']))})",
         "analytic f32", "ratio", "f16, unpadded", "llama.cpp f16 as allocated"],
        rows,
    )  # fmt: skip
    lines += [
        "",
        "Measured: the sum of the `DynamicCache`'s key and value tensor bytes after the batch-1 prefill, divided by "
        "the tokens; analytic: 2 x sum over layers of kv heads x head_dim x bytes per element. llama.cpp as "
        "allocated: without flash attention (llama-cpp-python's default) llama.cpp pads every layer's value cache to "
        "the widest layer's where the widths differ (per-layer counts, `deci`), so only the keys shrink there.",
        "",
        "## transformers: decode tokens/s and peak memory",
        "",
        "Peak: the RSS high-water mark during [copy of the prefilled cache at this batch + the decode], above the "
        "RSS just before, MiB (median over repetitions); cache: its key/value bytes after the decode. Batch 8 "
        "repeats the batch-1 prefill's cache 8 times along the batch (the decode's cost depends on the cache's "
        "sizes, not its values); the prefill runs once per model and context, at batch 1.",
        "",
    ]
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            for name in models:
                entry = hf[name][str(context)]
                d = entry["decode"][str(batch)]
                rows.append([
                    context, batch, name,
                    f"{d['tokens_per_s']:.1f} ({d['min']:.1f}-{d['max']:.1f})",
                    f"{d['ratio']:.2f}x",
                    f"{d['peak_mib']:.0f}" if d["peak_mib"] is not None else "-",
                    f"{d['cache_mib']:.0f}",
                    f"{entry['prefill_s']:.1f}" if batch == args.batches[0] else "",
                    (f"{entry['prefill_peak_mib']:.0f}" if entry["prefill_peak_mib"] is not None else "-")
                    if batch == args.batches[0] else "",
                ])  # fmt: skip
    lines += table(
        ["context", "batch", "model", "tokens/s", "ratio", "peak MiB", "cache MiB", "prefill s (batch 1)",
         "prefill peak MiB"],
        rows,
    )  # fmt: skip
    checks = report.get("checks", {})
    if checks.get("batch_ratios"):
        lines += ["", "Sanity check, batch " + f"{max(args.batches)} over batch {min(args.batches)}:", ""]
        lines += table(
            ["context", "model", "cache bytes ratio", "peak MiB ratio"],
            [[c["context"], c["model"], f"{c['cache']:.2f}", f"{c['peak']:.2f}" if c["peak"] else "-"]
             for c in checks["batch_ratios"]],
        )  # fmt: skip
    lines += ["", "## llama.cpp", ""]
    if cpp is None:
        lines.append(f"Not run: {report.get('llama_cpp_skipped')}.")
    else:
        lines += [
            f"llama-cpp-python {setup.get('llama_cpp_version')}, f32 GGUF from `attnreg.export.export_gguf`, KV "
            f"cache f16, n_ctx = C + 32, n_batch 512. Batch 1 only: the high-level API serves one sequence. Peak: the "
            "RSS high-water mark during [load + prefill + one decode] above the RSS before loading, MiB (weights "
            "included, mapped from the file).",
            "",
        ]
        rows = []
        for context in args.contexts:
            for name in models:
                e = cpp[name][str(context)]
                rows.append([
                    context, name,
                    f"{e['tokens_per_s']:.1f} ({e['min']:.1f}-{e['max']:.1f})",
                    f"{e['ratio']:.2f}x",
                    f"{e['prefill_s']:.1f}",
                    f"{e['peak_mib']:.0f}" if e["peak_mib"] is not None else "-",
                    kv_cell(e.get("kv_log"), models[name]["kv_heads"], setup["head_dim"], context),
                ])  # fmt: skip
        lines += table(["context", "model", "tokens/s", "ratio", "prefill s", "peak MiB", "KV cache MiB, K + V"],
                       rows)  # fmt: skip
        logged = any(cpp[name][str(c)].get("kv_log") for name in models for c in args.contexts)
        lines += ["", "KV cache: " + ("llama.cpp's own log at load (its cells, K and V buffers)" if logged else
                  "computed as allocated (see above) for n_ctx = C + 32 rounded up to a multiple of 256 cells, as "
                  "llama.cpp does: this run did not read llama.cpp's log")]  # fmt: skip
    greedy = report.get("greedy_check")
    if greedy:
        lines += [
            "",
            f"Greedy check: the first {greedy['new_tokens']} greedy tokens after {greedy['prompt']!r} "
            f"({greedy['prompt_tokens']} tokens), llama.cpp against transformers"
            + (f"; llama.cpp's own tokenization of the prompt {greedy['tokenization']}" if greedy.get("tokenization")
               else "") + ":",
            "",
        ]  # fmt: skip
        lines += table(
            ["model", "next token agrees", "tokens agreeing", "transformers", "llama.cpp"],
            [[name, "yes" if g["first_agrees"] else "NO", f"{g['prefix']}/{len(g['transformers'])}",
              g.get("transformers_text", g["transformers"]), g.get("llama_cpp_text", g["llama_cpp"])]
             for name, g in greedy["models"].items()],
        )  # fmt: skip
    lines += ["", "## Groups removed", ""]
    for name, entry in models.items():
        if entry["removed_groups"]:
            lines += [f"- {name}: " + ", ".join(f"L{layer}: {gs}" for layer, gs in entry["removed_groups"].items())]
    return "\n".join(lines) + "\n"


def kv_cell(log: dict | None, kv_heads: list[int], head_dim: int, context: int) -> str:
    if log:
        return f"{log['k_mib']:.0f} + {log['v_mib']:.0f} ({log['cells']} cells)"
    cells = -(-(context + 32) // 256) * 256  # llama.cpp rounds n_ctx up to a multiple of 256
    keys = sum(kv_heads) * head_dim * 2 * cells / MIB
    total = llama_cpp_bytes_per_token(kv_heads, head_dim) * cells / MIB
    return f"{keys:.0f} + {total - keys:.0f} ({cells} cells)"


def batch_checks(hf: dict, contexts: list[int], batches: list[int]) -> list[dict]:
    low, high = str(min(batches)), str(max(batches))
    out = []
    for context in contexts:
        for name, entry in hf.items():
            a, b = entry[str(context)]["decode"][low], entry[str(context)]["decode"][high]
            peak = b["peak_mib"] / a["peak_mib"] if a["peak_mib"] and b["peak_mib"] else None
            out.append({"context": context, "model": name, "cache": b["cache_bytes"] / a["cache_bytes"], "peak": peak})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--importance", type=int, default=32, help="EWT training sentences for head importance")
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--llama-threads", type=int, default=2)
    parser.add_argument("--no-llama-cpp", action="store_true", help="transformers only")
    add_output_arguments(parser, "tiny random Llama, contexts 64 and 128, 8 new tokens, 1 repetition, 1 thread")
    args = parser.parse_args()
    args.out = output_dir(args, "smollm2_serving")
    if args.quick:  # one thread each: tiny matrices gain nothing from two on shared cores
        args.contexts, args.repetitions, args.importance, args.new_tokens = [64, 128], 1, 16, 8
        args.threads, args.llama_threads = args.threads or 1, 1
    released = release_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load_at_start = [round(v, 2) for v in os.getloadavg()]
    longest = max(args.contexts)
    if args.quick:
        pool = builtin_sentences(200, seed=10)  # not EWT: reading its train file takes 20 s
        tokenizer = quick_tokenizer([s.text for s in pool] + [PROMPT])
        base = quick_model(tokenizer, layers=4, heads=6, hidden=48, positions=longest + 64)
        description, tokenizer_gguf = "tiny random Llama", None
    else:
        base, tokenizer = load_smollm2()
        pool = read_ewt("train", min_words=5)
        description, tokenizer_gguf = "SmolLM2-135M-Instruct, float32", smollm2_folder() / GGUF
    order = random.Random(args.seed).sample(range(len(pool)), len(pool))
    importance_texts = [pool[i].text for i in order[: args.importance]]
    ids: list[int] = []
    for sentence in pool:  # EWT text in the file's order, joined until the longest context is filled
        ids += tokenizer(" " + sentence.text if ids else sentence.text, add_special_tokens=False)["input_ids"]
        if len(ids) >= longest:
            break
    ids = (ids * (longest // max(len(ids), 1) + 1))[:longest]  # short text (--quick): repeated
    del pool  # 12,000 parsed sentences make every garbage collection slow
    context_ids = torch.tensor([ids])

    print(f"{description}: head importance on {len(importance_texts)} sentences", flush=True)
    models, choice = build_models(base, tokenizer, importance_texts, args)
    config = base.config
    head_dim = config.head_dim
    entries = {}
    for name, model in models.items():
        layout = head_layout(model)
        entries[name] = {
            "removed_groups": {str(layer): gs for layer, gs in choice["removed"][name].items()},
            "removed_count": sum(len(gs) for gs in choice["removed"][name].values()),
            "kv_heads": [kv for _, kv in layout],
            "kv_heads_total": sum(kv for _, kv in layout),
            "query_heads_total": sum(q for q, _ in layout),
            "parameters": count_parameters(model),
            "kv_bytes_per_token_f32": analytic_bytes_per_token(model, head_dim, 4),
            "kv_bytes_per_token_f16": analytic_bytes_per_token(model, head_dim, 2),
            "gguf_arch": None,
        }
    report: dict = {
        "setup": {
            "model": description,
            "layers": config.num_hidden_layers,
            "kv_groups": config.num_key_value_heads,
            "heads": config.num_attention_heads,
            "head_dim": head_dim,
            "importance_sentences": len(importance_texts),
            "importance_source": "built-in grammar sentences" if args.quick else "EWT training sentences",
            "context_source": "built-in grammar sentences joined and repeated"
            if args.quick
            else "EWT train sentences in file order, joined with spaces",
            "threads": torch.get_num_threads(),
            "mmap_threshold_set": released,
            "load_at_start": load_at_start,
            "quick": args.quick,
        },
        "models": entries,
        "group_importance": {str(k): [round(v, 4) for v in vs] for k, vs in choice["group_importance"].items()},
    }

    print("transformers", flush=True)
    hf = transformers_speed(models, context_ids, args.contexts, args.batches, args)
    report["transformers"] = hf
    for name in models:
        for context in args.contexts:
            measured = hf[name][str(context)]["bytes_per_token"]
            if abs(measured - entries[name]["kv_bytes_per_token_f32"]) > 1e-6 * measured:
                print(f"  WARNING: {name} C={context}: measured {measured} bytes/token, analytic "
                      f"{entries[name]['kv_bytes_per_token_f32']}", flush=True)  # fmt: skip
    report["checks"] = {"batch_ratios": batch_checks(hf, args.contexts, args.batches) if len(args.batches) > 1 else []}

    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    greedy_new = 8
    reference = {name: greedy_tokens(model, prompt_ids, greedy_new) for name, model in models.items()}
    if args.no_llama_cpp:
        report["llama_cpp"], report["llama_cpp_skipped"] = None, "--no-llama-cpp"
    elif not has_llama_cpp():
        report["llama_cpp"], report["llama_cpp_skipped"] = None, "llama-cpp-python is not installed"
    else:
        import llama_cpp

        report["setup"]["llama_cpp_version"] = getattr(llama_cpp, "__version__", None)
        with tempfile.TemporaryDirectory(prefix="smollm2_serving_gguf_") as folder:
            paths = {}
            for name, model in models.items():
                paths[name] = export_gguf(model, Path(folder) / f"{name}.gguf", tokenizer_gguf=tokenizer_gguf)
                entries[name]["gguf_arch"] = "llama" if len(set(head_layout(model))) == 1 else "deci"
                entries[name]["gguf_mib"] = round(paths[name].stat().st_size / MIB, 1)
            print("llama.cpp", flush=True)
            greedy: dict = {"prompt": PROMPT, "prompt_tokens": len(prompt_ids), "new_tokens": greedy_new, "models": {}}
            for name, path in paths.items():
                theirs = llama_greedy(path, prompt_ids, greedy_new, args.llama_threads)
                ours = reference[name]
                prefix = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), len(ours))
                g = {"first_agrees": ours[0] == theirs[0], "prefix": prefix, "transformers": ours, "llama_cpp": theirs}
                if tokenizer_gguf is not None:
                    g["transformers_text"] = repr(tokenizer.decode(ours))
                    g["llama_cpp_text"] = repr(tokenizer.decode(theirs))
                greedy["models"][name] = g
                print(f"  greedy {name}: {prefix}/{greedy_new} tokens agree", flush=True)
            if tokenizer_gguf is not None:
                llm = load_llama(paths["unpruned"], 64, args.llama_threads)
                theirs = llm.tokenize(PROMPT.encode(), add_bos=False, special=False)
                greedy["tokenization"] = "agrees" if list(theirs) == prompt_ids else f"differs: {list(theirs)}"
                del llm
            report["greedy_check"] = greedy
            report["llama_cpp"] = llama_cpp_speed(paths, ids, args.contexts, args)
    report["setup"]["load_at_end"] = [round(v, 2) for v in os.getloadavg()]
    report["seconds"] = round(time.perf_counter() - started, 1)
    text = markdown(report, args)
    write_results(args.out, report, text, args)
    print(text)


if __name__ == "__main__":
    main()
