"""`benchmarks/overhead.py --compiled`: every compiled step is one graph that its timed steps never recompile, and a
compiled ratio whose timed steps compiled anything reads "not settled"."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def overhead():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import overhead
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return overhead


def test_a_compiled_ratio_with_recompiles_in_its_timed_steps_reads_not_settled(overhead):
    times = {"sdpa": [1.0, 1.0], "compiled_sdpa": [0.5, 0.6], "compiled_kl_head": [0.55, 0.6]}
    entry = {"model": "llama", "tokens": 8, "batch": 1, "times_s": times, "saved_bytes": {}, "load": [0.1]}
    for recompiles, settled in (({"compiled_sdpa": 0, "compiled_kl_head": 0}, True), ({"compiled_sdpa": 1}, False)):
        summary = overhead.summarize(entry | {"recompiles": recompiles})
        breaks = {name: {"graphs": 1, "added": []} for name in recompiles}
        config = entry | {"summary": summary, "recompiles": recompiles, "graph_breaks": breaks}
        results = {"sizes": dict(layers=1, heads=2, hidden=8, vocab=10), "configs": [config], "quick": False}
        text = overhead.markdown(results | {"growth": []})
        kl_row = next(line for line in text.splitlines() if "| compiled_kl_head |" in line)
        assert ("not settled: 1 recompile(s) in timed steps" not in kl_row) == settled, kl_row  # sdpa's count too


@pytest.mark.slow
def test_compiled_variants_are_one_graph_each_and_never_recompile_in_timed_steps(overhead):
    """At a tiny Llama (1 layer, 4 query heads on 2 key/value heads, 32 tokens) the three compiled steps, built side by
    side as the benchmark builds them, trace as one graph each and compile nothing during two timed rounds. Before each
    step had a code object of its own, the variants failed each other's guards: the second variant's recompilation
    marked the step's numbers dynamic, broke its graph, and dynamo ran the shared step eagerly from then on."""
    torch._dynamo.reset()
    sizes = dict(overhead.SHAPES["smollm2"].sizes, layers=1, hidden=64, heads=4, num_key_value_heads=2)
    shape = replace(overhead.SHAPES["smollm2"], sizes=sizes | dict(intermediate_size=64, vocab=100), variants=("sdpa",))
    entry = overhead.run_config(shape, "llama", 32, 1, reps=2, compiled=True, memory=False)
    assert set(entry["recompiles"]) == set(overhead.COMPILED)
    assert entry["recompiles"] == dict.fromkeys(overhead.COMPILED, 0)
    assert {name: found["graphs"] for name, found in entry["graph_breaks"].items()} == dict.fromkeys(
        overhead.COMPILED, 1
    )
    assert all(not found["added"] for found in entry["graph_breaks"].values())
