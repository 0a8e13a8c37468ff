"""The blockwise losses equal the materialized path (probabilities, then attnreg.losses) in value and
gradient, for every kind of mask, grouped-query keys, chosen heads and temperature, and keep nothing of
size [T, S] for backward."""

import pytest
import torch

from attnreg.blockwise import parent_nll, row_entropy
from attnreg.hub import attention_probabilities
from attnreg.losses import row_entropy as materialized_entropy

B, H, KV, T, D = 2, 4, 2, 37, 8


def inputs(seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(B, H, T, D, generator=generator, dtype=dtype).requires_grad_()
    key = torch.randn(B, KV, T, D, generator=generator, dtype=dtype).requires_grad_()
    return query, key


def padding_mask(kind):
    lengths = torch.tensor([T, T - 9])
    keep = torch.arange(T)[None, :] < lengths[:, None]  # [B, S]
    if kind == "none":
        return None
    if kind == "bool":
        return keep[:, None, None, :].expand(B, 1, T, T)
    return torch.zeros(B, 1, T, T).masked_fill(~keep[:, None, None, :], torch.finfo(torch.float32).min)


def materialized(query, key, mask, causal, heads, temperature):
    probs = attention_probabilities(query, key, mask, D**-0.5, temperature, causal)
    return probs if heads is None else probs[:, heads]


CASES = [
    ("bool", False, None, None),
    ("float", False, [0, 3], None),
    ("none", True, [1], None),
    ("bool", True, [2, 3], torch.tensor([1.0, 2.0, 0.5, 3.0])),
]


@pytest.mark.parametrize(("mask_kind", "causal", "heads", "temperature"), CASES)
@pytest.mark.parametrize("block_size", [5, 128])
def test_entropy_and_parent_nll_equal_the_materialized_path(mask_kind, causal, heads, temperature, block_size):
    mask = padding_mask(mask_kind)
    parents = torch.randint(-1, T, (B, T), generator=torch.Generator().manual_seed(1))
    if causal:
        parents = torch.minimum(parents, torch.arange(T))  # a decoder's parent is an earlier token
    weights = torch.randn(B, H if heads is None else len(heads), T, generator=torch.Generator().manual_seed(2))

    def both(fast: bool):
        query, key = inputs()
        if fast:
            entropy = row_entropy(query, key, mask, D**-0.5, heads, temperature, causal, block_size)
            nll = parent_nll(query, key, mask, parents, D**-0.5, heads, temperature, causal, block_size)
        else:
            probs = materialized(query, key, mask, causal, heads, temperature)
            entropy = materialized_entropy(probs)
            index = parents.clamp_min(0)[:, None, :, None].expand(-1, probs.shape[1], -1, 1)
            nll = -probs.gather(-1, index).squeeze(-1).clamp_min(1e-12).log() * (parents[:, None] >= 0)
        ((entropy + nll) * weights).sum().backward()
        return entropy.detach(), nll.detach(), query.grad, key.grad

    for fast, slow in zip(both(True), both(False), strict=True):
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


def test_bf16_stays_within_bf16_tolerance():
    query, key = inputs(dtype=torch.bfloat16)
    fast = row_entropy(query, key, padding_mask("bool"), D**-0.5)
    slow = materialized_entropy(attention_probabilities(query.float(), key.float(), padding_mask("bool"), D**-0.5))
    torch.testing.assert_close(fast, slow, rtol=2e-2, atol=2e-2)


def saved_bytes(function) -> int:
    """Bytes autograd keeps for backward while `function()` builds its graph (storages counted once)."""
    seen = {}

    def pack(tensor):
        seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return sum(seen.values())


@pytest.mark.parametrize("length", [64, 128, 256])
def test_nothing_of_size_t_by_s_is_saved(length):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, length, 16, generator=generator).requires_grad_()
    key = torch.randn(1, 4, length, 16, generator=generator).requires_grad_()
    fast = saved_bytes(lambda: row_entropy(query, key, None, 0.25, causal=True, block_size=32))
    eager = saved_bytes(lambda: materialized_entropy(attention_probabilities(query, key, None, 0.25, causal=True)))
    inputs_size = (query.numel() + key.numel()) * 4
    assert fast <= inputs_size  # the inputs (the blocks of queries are views of them), no probabilities or mask
    assert eager >= 4 * length * length * 4  # the probabilities [1, 4, T, T] in float32
