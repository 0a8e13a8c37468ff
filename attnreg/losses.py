"""Attention losses as pure tensor functions (no Lightning, no transformers).

All take attention probabilities `probs` of one layer, shaped `[B, H, T, S]` (as `hub.capture`
records them), and the 2D `attention_mask` `[B, S]` of the batch (1 = real token).

The hot path is written for memory: entropy goes through an autograd function that keeps only `p`
(which softmax keeps anyway) and recomputes `log p` in backward, and the KL to a one-hot prior reads
`log p` only at the prior's support. See DESIGN.md, "Measured cost".

Example:
    >>> with hub.capture(layers=[2]) as probs:
    ...     model(**batch)
    >>> entropy = attention_entropy(probs[2], batch["attention_mask"], normalize=True)   # [H]
    >>> loss = entropy_penalty(entropy, mode="target", band=(0.3, 0.8))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

_TINY = 1e-12


def _full_precision(tensor: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 to fp32 (so logs and sums neither underflow nor overflow); fp32/fp64 unchanged."""
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()


class _RowEntropy(torch.autograd.Function):
    """-(p log p).sum(-1) that saves only `p`; dH/dp = -(log p + 1), with log clamped at p = 0."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(probs)
        return torch.special.entr(_full_precision(probs)).sum(-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (probs,) = ctx.saved_tensors
        log_p = _full_precision(probs).clamp_min(_TINY).log_().add_(1.0)
        return log_p.mul_(grad.unsqueeze(-1).neg()).to(probs.dtype)


def row_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of every attention row: `[..., S]` to `[...]`, memory-lean under autograd."""
    return _RowEntropy.apply(probs)


def admissible_keys(
    attention_mask: torch.Tensor | None, shape: torch.Size, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid query rows `[B, 1, T]`, number of admissible keys per row `[B, 1, T]`).

    A key is admissible when it is a real token and, for causal models, at or before the query.
    """
    batch, _, queries, keys = shape
    if attention_mask is None:
        attention_mask = torch.ones(batch, keys, dtype=torch.long)
    key_mask = attention_mask[:, -keys:].bool()
    query_mask = key_mask[:, -queries:]
    if causal:
        offset = keys - queries
        counts = key_mask.long().cumsum(-1)[:, offset:]
    else:
        counts = key_mask.long().sum(-1, keepdim=True).expand(batch, queries)
    return query_mask[:, None, :], counts[:, None, :].to(torch.float32)


def attention_entropy(
    probs: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    causal: bool = False,
    normalize: bool = False,
) -> torch.Tensor:
    """Mean attention entropy per head `[H]` over the real query rows of a batch.

    With `normalize=True` each row's entropy is divided by log(number of admissible keys), so rows
    and sequences of different lengths compare (1 = uniform, 0 = one key); rows with a single
    admissible key are left out then.
    """
    entropy = row_entropy(probs)  # [B, H, T]
    rows, counts = admissible_keys(attention_mask, probs.shape, causal)
    rows, counts = rows.to(probs.device), counts.to(probs.device)
    if normalize:
        rows = rows & (counts > 1)
        entropy = entropy / counts.clamp_min(2).log()
    weights = rows.to(entropy.dtype).expand_as(entropy)
    return (entropy * weights).sum((0, 2)) / weights.sum((0, 2)).clamp_min(1)


EntropyMode = Literal["min", "max", "target"]


def entropy_penalty(
    entropy: torch.Tensor,
    mode: EntropyMode,
    band: tuple[float, float] | None = None,
    per: Literal["head", "layer"] = "head",
) -> torch.Tensor:
    """A scalar loss on per-head entropies `[H]` (or `[L, H]`).

    - `min`: the mean entropy (sharpen heads);
    - `max`: minus the mean entropy (flatten heads, as EAR does);
    - `target`: the mean squared distance to the band `[lo, hi]`, zero inside it, applied to every
      head (`per="head"`) or to each layer's head mean (`per="layer"`).
    """
    if mode == "min":
        return entropy.mean()
    if mode == "max":
        return -entropy.mean()
    if mode != "target":
        raise ValueError(f"mode must be 'min', 'max' or 'target', got {mode!r}")
    if band is None or len(band) != 2 or not band[0] <= band[1]:
        raise ValueError(f"mode='target' needs band=(lo, hi) with lo <= hi, got {band!r}")
    if per not in ("head", "layer"):
        raise ValueError(f"per must be 'head' or 'layer', got {per!r}")
    values = entropy.mean(-1) if per == "layer" else entropy
    low, high = band
    return ((low - values).clamp_min(0) ** 2 + (values - high).clamp_min(0) ** 2).mean()


HeadReduction = Literal["mean_heads", "mean_attention"]


def prior_kl(
    probs: torch.Tensor,
    prior: torch.Tensor,
    heads: Sequence[int] | None = None,
    reduction: HeadReduction = "mean_heads",
    causal: bool = False,
) -> torch.Tensor:
    """KL(prior ‖ attention) per query row, averaged over rows that have prior mass.

    `prior` is either dense `[B, T, S]` (each row a distribution, or all zeros for rows left out) or
    one-hot as indices `[B, T]` (the key each query should attend to, -1 for rows left out).
    `heads` picks the supervised heads (None = all). `reduction`: "mean_heads" averages the per-head
    KLs; "mean_attention" takes the KL of the head-averaged attention. With `causal=True` the prior
    is first restricted to keys at or before each query (see `causal_prior`). Zero prior entries
    contribute 0, and `log p` is clamped, so the loss stays finite under fp16/bf16 autocast.
    """
    batch, _, queries, keys = probs.shape
    expected = (batch, queries) if prior.dim() == 2 else (batch, queries, keys)
    if tuple(prior.shape) != expected:
        raise ValueError(
            f"prior of shape {tuple(prior.shape)} does not match attention of shape {tuple(probs.shape)} "
            f"[B, H, T, S]: expected key indices {(batch, queries)} or dense rows {(batch, queries, keys)}"
        )
    if causal:
        prior = causal_prior(prior, keys)
    if heads is not None:
        probs = probs[:, list(heads)]
    if reduction == "mean_attention":
        probs = probs.mean(1, keepdim=True)
    elif reduction != "mean_heads":
        raise ValueError(f"reduction must be 'mean_heads' or 'mean_attention', got {reduction!r}")
    if prior.dim() == 2:
        rows = prior >= 0
        index = prior.clamp_min(0)[:, None, :, None].expand(-1, probs.shape[1], -1, 1)
        attended = _full_precision(probs.gather(-1, index).squeeze(-1))  # [B, H, T]
        per_row = -attended.clamp_min(_TINY).log()
    else:
        prior = _full_precision(prior)
        rows = prior.sum(-1) > 0
        log_p = _full_precision(probs).clamp_min(_TINY).log()
        prior_entropy = torch.special.entr(prior).sum(-1)  # 0 log 0 = 0
        per_row = -(prior[:, None] * log_p).sum(-1) - prior_entropy[:, None]
    weights = rows[:, None, :].to(per_row.dtype).expand_as(per_row)
    return (per_row * weights).sum() / weights.sum().clamp_min(1)


def causal_prior(prior: torch.Tensor, keys: int | None = None) -> torch.Tensor:
    """Restrict a prior to keys at or before each query, as a decoder sees them.

    Key indices `[B, T]` after the query become -1 (row left out); dense rows `[B, T, S]` lose the
    later keys and are renormalized, and rows with no mass left become all zeros (left out). `keys`
    (S) defaults to T; queries are the last T of the S positions.
    """
    queries = prior.shape[1]
    keys = queries if keys is None else keys
    position = torch.arange(queries, device=prior.device) + (keys - queries)
    if prior.dim() == 2:
        return prior.masked_fill(prior > position, -1)
    allowed = torch.arange(keys, device=prior.device)[None, :] <= position[:, None]
    prior = prior * allowed
    totals = prior.sum(-1, keepdim=True)
    return torch.where(totals > 0, prior / totals.clamp_min(_TINY), torch.zeros_like(prior))
