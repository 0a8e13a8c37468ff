"""The exactness checks on CUDA (`make test-gpu`, marker `gpu`): the hub against eager attention, a method's loss and
gradients (blockwise against materialized), head removal with save and load, float32 and bfloat16 autocast under
the math, memory-efficient and flash SDPA backends, and `benchmarks/overhead.py --device cuda` where it has that
option. Without CUDA every test skips, saying so.

`ATTNREG_GPU_TESTS_DEVICE=cpu` runs them on the CPU instead (the backends a CPU lacks skip): a check of the checks
on a machine without a GPU."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnreg
from attnreg.methods import EntropyRegularizer
from attnreg.methods.pruning import load_pruned, prune_heads, pruned_heads, save_pruned
from attnreg.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]
DEVICE = os.environ.get("ATTNREG_GPU_TESTS_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(),
        reason="no CUDA device (torch.cuda.is_available() is False): make test-gpu runs these on a GPU machine",
    ),
]
FAMILIES = {"bert": "classification", "gpt2": "causal_lm", "llama": "causal_lm"}
BACKENDS = {
    "math": SDPBackend.MATH,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # the largest difference of outputs of size about 1


def batch_of(family: str, length: int = 12, rows: int = 2, padded: bool = True) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 99, (rows, length), generator=generator)
    mask = torch.ones(rows, length, dtype=torch.long)
    if padded:
        mask[1:, length - 3 :] = 0
    batch = {"input_ids": input_ids, "attention_mask": mask}
    batch["labels"] = input_ids.clone() if FAMILIES[family] == "causal_lm" else torch.tensor([0, 1][:rows])
    return {key: value.to(DEVICE) for key, value in batch.items()}


def model_of(family: str, **sizes) -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_model(family, head=FAMILIES[family], **sizes).to(DEVICE)


def output(result) -> torch.Tensor:
    return result.logits


def supported(backend: str, dtype: torch.dtype) -> None:
    """Skip a combination the device cannot run (flash needs a CUDA device and 16-bit inputs)."""
    if backend != "math" and DEVICE != "cuda":
        pytest.skip(f"the {backend} SDPA backend needs CUDA")
    if backend == "flash" and dtype == torch.float32:
        pytest.skip("flash attention takes float16 or bfloat16 inputs only")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_hub_equals_eager_attention(family):
    model = model_of(family).eval()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    hub = attnreg.attach(model)
    batch = batch_of(family)
    with torch.no_grad(), hub.capture() as probs:
        captured = model(**batch)
        expected = eager(**batch, output_attentions=True)
    assert (output(captured) - output(expected)).abs().max() <= 1e-4
    for layer, weights in enumerate(expected.attentions):
        assert (probs[layer] - weights).abs().max() <= 1e-5
    with torch.no_grad():
        idle = model(**batch)  # the idle path: transformers' SDPA on the device
    assert (output(idle) - output(expected)).abs().max() <= 1e-4


def entropy_step(model, batch, blockwise: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Entropy on every head of every layer, through `hub.capture` as the adapters run it: the term and the
    gradients of every parameter."""
    term = EntropyRegularizer(mode="max", weight=1.0, blockwise=blockwise)
    term.bind(model)
    term.start(10)
    hub = attnreg.attach(model)
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    with hub.capture(list(term.layers or ()), True, inputs=term.inputs) as record:
        model(**inputs)
    value = term.term(record, batch, 0)[0]
    model.zero_grad(set_to_none=True)
    value.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    term.teardown()
    return value.detach(), grads


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_a_methods_loss_and_gradients_blockwise_equal_materialized(family):
    model = model_of(family).train()
    model.config.attention_probs_dropout_prob = model.config.attention_dropout = 0.0
    batch = batch_of(family)
    blockwise, grads = entropy_step(copy.deepcopy(model), batch, blockwise=True)
    materialized, expected = entropy_step(copy.deepcopy(model), batch, blockwise=False)
    assert torch.isfinite(blockwise) and (blockwise - materialized).abs() <= 1e-5
    assert set(grads) == set(expected) and grads
    for name, grad in grads.items():
        assert (grad - expected[name]).abs().max() <= 1e-4 * max(1.0, expected[name].abs().max().item()), name


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_removal_saves_and_loads_to_the_same_outputs(family, tmp_path):
    model = model_of(family, layers=3).eval()
    prune_heads(model, {0: [0, 1], 2: [2, 3]})  # whole key/value groups of the Llama: nothing left silenced
    batch = batch_of(family)
    save_pruned(model, tmp_path)
    loaded = load_pruned(tmp_path).to(DEVICE).eval()
    assert pruned_heads(loaded) == pruned_heads(model)
    with torch.no_grad():
        assert (output(loaded(**batch)) - output(model(**batch))).abs().max() <= 1e-6


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_autocast_under_each_sdpa_backend(backend, dtype_name):
    """A causal decoder without padding (flash takes no arbitrary mask): the attached model's idle path and its
    captured probabilities against the plain model under the same backend and autocast; the blockwise entropy's
    value and gradients are finite and close to the materialized path's."""
    dtype = DTYPES[dtype_name]
    supported(backend, dtype)
    family = "llama"
    model = model_of(family, heads=4, hidden=64).train()
    plain = copy.deepcopy(model)
    attnreg.attach(model)
    batch = batch_of(family, length=32, padded=False)
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    with sdpa_kernel(BACKENDS[backend]), torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32):
        with torch.no_grad():
            difference = (output(model(**batch)) - output(plain(**batch))).float().abs().max()
        assert difference <= TOLERANCE[dtype], f"idle hub against plain SDPA: {difference}"
        values = {blockwise: entropy_step(copy.deepcopy(model), batch, blockwise) for blockwise in (True, False)}
    (value, grads), (expected, expected_grads) = values[True], values[False]
    assert torch.isfinite(value) and all(torch.isfinite(g).all() for g in grads.values())
    assert (value.float() - expected.float()).abs() <= TOLERANCE[dtype] * max(1.0, expected.abs().item())
    for name, grad in grads.items():
        scale = max(1e-3, expected_grads[name].float().abs().max().item())
        assert (grad.float() - expected_grads[name].float()).abs().max() <= 10 * TOLERANCE[dtype] * scale, name


def test_overhead_benchmark_on_the_device(tmp_path):
    """`benchmarks/overhead.py --device cuda` at the quick shape (SmolLM2's heads and widths on 2 layers)."""
    script = ROOT / "benchmarks" / "overhead.py"
    helped = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=ROOT)
    if "--device" not in helped.stdout:
        pytest.skip("benchmarks/overhead.py has no --device option yet: its timings and profile are CPU-only")
    command = [sys.executable, str(script), "--quick", "--device", DEVICE, "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
