"""Attention losses from queries and keys, in blocks of queries, without keeping the attention.

The losses need row statistics of the scores `s_ij`, never the whole matrix at once (LSE = logsumexp over
the admissible keys of row i):

- `-log p_i,parent = LSE_i - s_i,parent` (KL to a one-hot parent);
- `-sum_j r_j log p_ij = LSE_i - sum_j r_j s_ij` (cross-entropy to a dense prior row `r`);
- `H_i = LSE_i - sum_j p_ij s_ij` (entropy).

Each function computes the scores of one block of `block_size` queries at a time, for the heads given,
reduces them to one number per row, and lets the block go: under autograd every block runs in
`torch.utils.checkpoint`, so backward recomputes it and nothing of size `[T, S]` is saved (only the
block's inputs: its queries, the keys, the mask rows). Values and gradients equal the materialized path
(`hub.attention_probabilities` then `attnreg.losses`); `tests/test_blockwise.py` compares them.
`query` and `key` are what transformers hands an attention function (`[B, H, T, d]`, `[B, H_kv, S, d]`,
after RoPE; grouped-query keys not yet repeated), and `attention_mask` its SDPA mask (boolean, additive
float, or None with `causal`).

Example:
    >>> entropy = row_entropy(query, key, mask, scaling=d ** -0.5, heads=[0, 3])       # [B, 2, T] nats
    >>> nll = prior_cross_entropy(query, key, mask, parents, scaling=d ** -0.5, heads=[5])   # [B, 1, T]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from attnreg.hub import LayerInputs, attention_scores
from attnreg.losses import HeadReduction, causal_prior, check_prior, kl_from_cross_entropy, mean_row_entropy

BLOCK_SIZE = 128


def row_entropy(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    heads: Sequence[int] | None = None,
    temperature: torch.Tensor | None = None,
    causal: bool = False,
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """Entropy (nats) of every attention row of `heads` (None = all): `[B, len(heads), T]`, in float32.

    Under autograd each block runs in `_BlockEntropy`, whose backward recomputes the block's scores and
    writes the gradient out, `dH/ds_ij = -p_ij (s_ij - sum_k p_ik s_ik)`, instead of replaying autograd
    through the softmax."""
    return _blockwise(_entropy, query, key, attention_mask, scaling, heads, temperature, causal, block_size, True)


def _entropy(scores: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
    log_p = torch.log_softmax(scores.float(), dim=-1).clamp_min(_LOG_FLOOR)  # finite where p = 0
    return -(log_p.exp() * log_p).sum(-1)


class _BlockEntropy(torch.autograd.Function):
    """Row entropies of one block of queries that save only the block's inputs (views) for backward."""

    @staticmethod
    def forward(ctx, query, key, mask, scaling, causal_rows):
        ctx.save_for_backward(query, key, mask)
        ctx.scaling, ctx.causal_rows = scaling, causal_rows
        return _entropy(attention_scores(query, key, _block_mask(mask, causal_rows, query, key), scaling))

    @staticmethod
    def backward(ctx, grad):
        query, key, mask = ctx.saved_tensors
        scores = attention_scores(query, key, _block_mask(mask, ctx.causal_rows, query, key), ctx.scaling).float()
        scores = scores - scores.amax(-1, keepdim=True)  # finite sums even in rows whose keys are all masked
        p = torch.softmax(scores, dim=-1)
        mean = (p * scores).sum(-1, keepdim=True)
        dscores = (p * (scores - mean)).mul_(grad.unsqueeze(-1).neg()).mul_(ctx.scaling).to(query.dtype)
        return dscores @ key, dscores.transpose(-1, -2) @ query, None, None, None


def _block_mask(
    mask: torch.Tensor | None, causal_rows: tuple[int, int] | None, query: torch.Tensor, key: torch.Tensor
) -> torch.Tensor | None:
    """The block's mask: its rows of the layer's mask, or, for `causal_rows=(first row, key offset)`, a
    causal mask built for the block's rows only (so no `[T, S]` mask is kept)."""
    if causal_rows is None:
        return mask
    first, offset = causal_rows
    positions = torch.arange(first, first + query.shape[2], device=query.device)[:, None] + offset
    return torch.arange(key.shape[2], device=query.device)[None, :] <= positions


def prior_cross_entropy(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    prior: torch.Tensor,
    scaling: float,
    heads: Sequence[int] | None = None,
    temperature: torch.Tensor | None = None,
    causal: bool = False,
    block_size: int = BLOCK_SIZE,
    mean_attention: bool = False,
) -> torch.Tensor:
    """`-sum_j r_ij log p_ij` for every row: `[B, len(heads), T]` (`[B, 1, T]` with `mean_attention`, where
    `p` is the heads' mean attention), float32. `prior`: key indices `[B, T]` (-1: row left out, reads 0)
    or dense rows `[B, T, S]`. `log p` is clamped at 1e-12, as `attnreg.losses.prior_kl` clamps."""
    dense = prior.dim() == 3
    index = None if dense else prior.long().clamp_min(0)

    def cross_entropy(scores: torch.Tensor, rows: slice) -> torch.Tensor:
        if mean_attention:
            log_p = torch.softmax(scores.float(), dim=-1).mean(1, keepdim=True).clamp_min(_TINY).log()
        else:
            log_p = torch.log_softmax(scores.float(), dim=-1).clamp_min(_LOG_TINY)
        if dense:
            return -(prior[:, None, rows].float() * log_p).sum(-1)
        chosen = index[:, None, rows, None].expand(-1, log_p.shape[1], -1, 1)
        return -log_p.gather(-1, chosen).squeeze(-1) * (prior[:, None, rows] >= 0)

    return _blockwise(cross_entropy, query, key, attention_mask, scaling, heads, temperature, causal, block_size)


def attention_entropy(
    inputs: LayerInputs,
    attention_mask: torch.Tensor | None = None,
    causal: bool = False,
    normalize: bool = False,
    heads: Sequence[int] | None = None,
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """`attnreg.losses.attention_entropy` of the layer `inputs` describe (`hub.capture(..., inputs=True)`),
    for `heads` (None = all): the mean entropy per head `[len(heads)]`; `attention_mask` is the batch's 2D
    padding mask `[B, S]`.

    Example:
        >>> with hub.capture(layers=[2], inputs=True) as record:
        ...     model(**batch)
        >>> attention_entropy(record[2], batch["attention_mask"], normalize=True)     # [H]
    """
    entropy = row_entropy(
        inputs.query,
        inputs.key,
        inputs.attention_mask,
        inputs.scaling,
        heads,
        causal=inputs.causal,
        block_size=block_size,
    )
    return mean_row_entropy(entropy, attention_mask, inputs.key.shape[2], causal, normalize)


def prior_kl(
    inputs: LayerInputs,
    prior: torch.Tensor,
    heads: Sequence[int] | None = None,
    reduction: HeadReduction = "mean_heads",
    causal: bool = False,
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """`attnreg.losses.prior_kl` (same arguments and checks) of the layer `inputs` describe.

    Example:
        >>> prior_kl(record[4], batch["attnreg_prior"], heads=[9])
    """
    if reduction not in ("mean_heads", "mean_attention"):
        raise ValueError(f"reduction must be 'mean_heads' or 'mean_attention', got {reduction!r}")
    query, key = inputs.query, inputs.key
    check_prior(prior, (query.shape[0], query.shape[1], query.shape[2], key.shape[2]), heads)
    if causal:
        prior = causal_prior(prior, key.shape[2])
    cross_entropy = prior_cross_entropy(
        query,
        key,
        inputs.attention_mask,
        prior,
        inputs.scaling,
        heads,
        causal=inputs.causal,
        block_size=block_size,
        mean_attention=reduction == "mean_attention",
    )
    return kl_from_cross_entropy(cross_entropy, prior)


def _blockwise(
    reduce: Callable[[torch.Tensor, slice], torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    heads: Sequence[int] | None,
    temperature: torch.Tensor | None,
    causal: bool,
    block_size: int,
    entropy: bool = False,
) -> torch.Tensor:
    """`reduce(scores of a block, its rows)` over blocks of queries, concatenated along the rows (for
    `entropy`, through `_BlockEntropy` under autograd)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if heads is not None:
        heads = list(heads)
        groups = query.shape[1] // key.shape[1]
        key = key[:, [head // groups for head in heads]]  # each chosen query head's key/value head
        query = query[:, heads]
        temperature = None if temperature is None else temperature[heads]
    elif query.shape[1] != key.shape[1]:
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)  # as repeat_kv: one per query head
    if temperature is not None:
        query = query / temperature.to(query.dtype).reshape(1, -1, 1, 1)
    queries, keys = query.shape[2], key.shape[2]
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] > 1 and heads is not None:
        attention_mask = attention_mask[:, heads]

    def inputs_of(start: int) -> tuple[slice, torch.Tensor | None, tuple[int, int] | None]:
        rows = slice(start, min(start + block_size, queries))
        if attention_mask is not None:
            return rows, (attention_mask[..., rows, :] if attention_mask.shape[-2] > 1 else attention_mask), None
        return rows, None, ((start, keys - queries) if causal and queries > 1 else None)

    def block(start: int) -> torch.Tensor:
        rows, mask, causal_rows = inputs_of(start)
        block_query = query[:, :, rows]
        mask = _block_mask(mask, causal_rows, block_query, key)
        return reduce(attention_scores(block_query, key, mask, scaling), rows)

    recompute = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad)
    parts = []
    for start in range(0, queries, block_size):
        if not recompute:
            parts.append(block(start))
        elif entropy:
            rows, mask, causal_rows = inputs_of(start)
            parts.append(_BlockEntropy.apply(query[:, :, rows], key, mask, scaling, causal_rows))
        else:
            parts.append(checkpoint(block, start, use_reentrant=False))
    return torch.cat(parts, dim=-1)


_TINY = 1e-12
_LOG_TINY = float(torch.tensor(_TINY).log())
_LOG_FLOOR = -1.0e4  # exp() of it is 0 in float32: masked keys add 0, with finite gradients
