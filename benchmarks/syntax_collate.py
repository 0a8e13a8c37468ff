"""Throughput of the syntax pipeline on one core: word-to-subword alignment plus prior building
(`SyntaxCollator.priors`, the part attnreg adds), and the whole collate including the fast tokenizer.

EWT dev sentences, the MiniLM WordPiece tokenizer, batches of 32, max_length 128. Variants are
interleaved over repeats; the median is reported. Target: >= 5,000 sentences/s for alignment and priors.

    python benchmarks/syntax_collate.py
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from attnreg.models import minilm_directory
from attnreg.syntax import SyntaxCollator, SyntaxPrior, read_conllu

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "ud_english_ewt"
RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 32
PRIORS = {
    "parent (indices)": SyntaxPrior("parent"),
    "parent, spread over pieces (dense)": SyntaxPrior("parent", key_pieces="spread"),
    "neighbors (dense)": SyntaxPrior("neighbors"),
    "tree_distance (dense)": SyntaxPrior("tree_distance"),
}


def main() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(minilm_directory())
    sentences = read_conllu(DATA / "en_ewt-ud-dev.conllu")
    batches = [sentences[i : i + BATCH] for i in range(0, len(sentences), BATCH)]
    offsets = [
        tokenizer([s.text for s in batch], padding=True, truncation=True, max_length=128,
                  return_offsets_mapping=True, return_tensors="np")["offset_mapping"]
        for batch in batches
    ]  # fmt: skip
    collators = {name: SyntaxCollator(tokenizer, prior=prior, max_length=128) for name, prior in PRIORS.items()}
    timings: dict[str, list[float]] = {}
    for _ in range(5):
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
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "syntax_collate.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Syntax pipeline throughput (one core)",
        "",
        f"EWT dev ({len(sentences)} sentences), MiniLM WordPiece, batches of {BATCH}, max_length 128, "
        "median of 5 interleaved repeats. Target: 5,000 sentences/s for alignment + prior.",
        "",
        "| what | sentences/s |",
        "|---|---:|",
        *[f"| {name} | {rate:,} |" for name, rate in rates.items()],
        "",
    ]
    (RESULTS / "syntax_collate.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
