"""Throughput of the syntax pipeline on one core: word-to-subword alignment plus prior building
(`SyntaxCollator.priors`, the part attnreg adds), and the whole collate including the fast tokenizer.

EWT dev sentences, the MiniLM WordPiece tokenizer, batches of 32, max_length 128. Variants are
interleaved over repeats; the median is reported. Target: >= 5,000 sentences/s for alignment and priors.

    python benchmarks/syntax_collate.py            # all 2,001 dev sentences, 5 repeats (under a minute)
    python benchmarks/syntax_collate.py --quick    # 128 sentences, 1 repeat, to a temporary folder
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from common import add_output_arguments, data_path, output_dir, table, write_results
from transformers import AutoTokenizer

from attnreg.app.models import minilm_directory
from attnreg.syntax import SyntaxCollator, SyntaxPrior, read_conllu

BATCH = 32
PRIORS = {
    "parent (indices)": SyntaxPrior("parent"),
    "parent, spread over pieces (dense)": SyntaxPrior("parent", key_pieces="spread"),
    "neighbors (dense)": SyntaxPrior("neighbors"),
    "tree_distance (dense)": SyntaxPrior("tree_distance"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed passes (median reported)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N dev sentences")
    add_output_arguments(parser, "128 sentences, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.limit, args.repeats = 128, 1
    args.out = output_dir(args, "syntax_collate")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(1)
    sentences = read_conllu(data_path("ud_english_ewt", "en_ewt-ud-dev.conllu"))[: args.limit]
    tokenizer = AutoTokenizer.from_pretrained(minilm_directory())
    batches = [sentences[i : i + BATCH] for i in range(0, len(sentences), BATCH)]
    offsets = [
        tokenizer([s.text for s in batch], padding=True, truncation=True, max_length=128,
                  return_offsets_mapping=True, return_tensors="np")["offset_mapping"]
        for batch in batches
    ]  # fmt: skip
    collators = {name: SyntaxCollator(tokenizer, prior=prior, max_length=128) for name, prior in PRIORS.items()}
    timings: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name, collate in collators.items():
            start = time.perf_counter()
            for batch, batch_offsets in zip(batches, offsets, strict=True):
                collate.priors(batch, batch_offsets)
            timings.setdefault(f"{name}: alignment + prior", []).append(time.perf_counter() - start)
        start = time.perf_counter()
        for batch in batches:
            collators["parent (indices)"](batch)
        timings.setdefault("parent (indices): whole collate with tokenizer", []).append(time.perf_counter() - start)
    rates = {name: round(len(sentences) / statistics.median(times)) for name, times in timings.items()}
    report = {
        "sentences": len(sentences),
        "batch_size": BATCH,
        "threads": 1,
        "sentences_per_second": rates,
        "target": 5000,
    }
    lines = [
        "# Syntax pipeline throughput (one core)",
        "",
        f"EWT dev ({len(sentences)} sentences), MiniLM WordPiece, batches of {BATCH}, max_length 128, "
        f"median of {args.repeats} interleaved repeats. Target: 5,000 sentences/s for alignment + prior.",
        "",
        *table(["what", "sentences/s"], [[name, f"{rate:,}"] for name, rate in rates.items()]),
    ]
    if args.quick:
        lines += ["", "**Quick smoke run (--quick): the figures mean little.**"]
    write_results(args.out, report, "\n".join(lines) + "\n", args)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
