"""Attention losses as pure tensor functions (no Lightning, no transformers).

All take attention probabilities `probs` of one layer, shaped `[B, H, T, S]` (as `hub.capture`
records them), and the 2D `attention_mask` `[B, S]` of the batch (1 = real token).

The hot path is written for memory: entropy goes through an autograd function that keeps only `p`
(which softmax keeps anyway) and recomputes `log p` in backward, and the KL to a one-hot prior reads
`log p` only at the prior's support. See DESIGN.md, "Measured cost".

Example:
    >>> import torch, attnreg
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("bert")                                   # 2 layers x 4 heads, random weights
    >>> batch = {"input_ids": torch.tensor([[5, 6, 7, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 0]])}
    >>> with attnreg.attach(model).capture(layers=[1]) as probs:
    ...     _ = model(**batch)
    >>> entropy = attention_entropy(probs[1], batch["attention_mask"], normalize=True)   # [H], in [0, 1]
    >>> entropy.shape, bool(((entropy > 0) & (entropy <= 1)).all())
    (torch.Size([4]), True)
    >>> entropy_penalty(entropy, mode="target", band=(0.3, 0.8)).shape   # one number
    torch.Size([])
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Literal

import torch

from attnreg.compat import assert_in_graph

_TINY = 1e-12


def _full_precision(tensor: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 to fp32 (so logs and sums neither underflow nor overflow); fp32/fp64 unchanged."""
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()


class _RowEntropy(torch.autograd.Function):
    """-(p log p).sum(-1) that saves only `p`; dH/dp = -(log p + 1), with log clamped at p = 0. With `sink`, the
    row's missing mass `m = 1 - sum_j p_j` is one more outcome: `H - m log m`, and dH/dp_j = -(log p_j - log m)."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, sink: bool = False) -> torch.Tensor:
        ctx.save_for_backward(probs)
        ctx.sink = sink
        full = _full_precision(probs)
        entropy = torch.special.entr(full).sum(-1)
        return entropy + torch.special.entr(_missing_mass(full)) if sink else entropy

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (probs,) = ctx.saved_tensors
        full = _full_precision(probs)
        log_p = full.clamp_min(_TINY).log().add_(1.0)
        if ctx.sink:  # d(-m log m)/dp_j = log m + 1 where m > 0 (the clamp at 0 passes no gradient)
            missing = _missing_mass(full)
            log_p.sub_(torch.where(missing > 0, missing.clamp_min(_TINY).log() + 1.0, 0.0).unsqueeze(-1))
        return log_p.mul_(grad.unsqueeze(-1).neg()).to(probs.dtype), None


def _missing_mass(probs: torch.Tensor) -> torch.Tensor:
    """What a row's probabilities lack of 1 (the sink's share, gpt-oss), clamped at 0 against rounding."""
    return (1.0 - probs.sum(-1)).clamp_min(0.0)


def row_entropy(probs: torch.Tensor, sink: bool = False) -> torch.Tensor:
    """Entropy (nats) of every attention row: `[..., S]` to `[...]`, memory-lean under autograd.

    With `sink=True` (gpt-oss, `AttentionRecord.has_sink`) the rows lack the share of the sink, which joins each
    row's softmax as one more outcome no value reads; it counts as one more outcome here, `1 - sum_j p_j`, so this
    is the entropy of the whole softmax, as `attnreg.blockwise.row_entropy(..., sinks=)` computes it.

    Example:
        >>> row_entropy(torch.tensor([[0.5, 0.5], [1.0, 0.0]]))          # log 2, and 0
        tensor([0.6931, 0.0000])
        >>> row_entropy(torch.tensor([[0.5, 0.0]]), sink=True)           # the sink has the other half: log 2
        tensor([0.6931])
    """
    return _RowEntropy.apply(probs, sink)


def admissible_keys(
    attention_mask: torch.Tensor | None,
    shape: torch.Size,
    causal: bool,
    layer_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid query rows `[B, 1, T]`, number of admissible keys per row `[B, 1, T]`, `[B, H, T]` for a
    layer mask per head).

    A query row is valid when it is a real token of the 2D padding mask `attention_mask` `[B, S]` (None: all
    are). A key is admissible when the layer's own mask `layer_mask` admits it (the SDPA mask the layer received,
    `LayerInputs.attention_mask` or `AttentionRecord.attention_mask(layer)`: boolean, True = attend, or additive
    float, so sliding windows count) and, for causal models, it is at or before the query. Without a layer mask
    (SDPA needed none) the admissible keys are the real tokens of `attention_mask`, and causality.

    Example:
        >>> rows, counts = admissible_keys(torch.tensor([[1, 1, 0]]), torch.Size((1, 4, 3, 3)), causal=True)
        >>> rows.tolist(), counts.tolist()
        ([[[True, True, False]]], [[[1.0, 2.0, 2.0]]])
        >>> window = torch.ones(4, 4, dtype=torch.bool).tril().triu(-1)[None, None]   # a window of 2 keys
        >>> admissible_keys(None, torch.Size((1, 4, 4, 4)), causal=True, layer_mask=window)[1].tolist()
        [[[1.0, 2.0, 2.0, 2.0]]]
    """
    batch, _, queries, keys = shape
    if attention_mask is None:
        attention_mask = torch.ones(batch, keys, dtype=torch.long)
    key_mask = attention_mask[:, -keys:].bool()
    query_mask = key_mask[:, -queries:]
    if layer_mask is not None:
        return query_mask[:, None, :], _layer_key_counts(layer_mask, batch, queries, keys, causal)
    if causal:
        offset = keys - queries
        counts = key_mask.long().cumsum(-1)[:, offset:]
    else:
        counts = key_mask.long().sum(-1, keepdim=True).expand(batch, queries)
    return query_mask[:, None, :], counts[:, None, :].to(torch.float32)


def _layer_key_counts(layer_mask: torch.Tensor, batch: int, queries: int, keys: int, causal: bool) -> torch.Tensor:
    """Keys per query row `[B, 1 or H, T]` (float32) that an SDPA mask (broadcastable to `[B, H, T, S]`, longer
    key axes cut at S as SDPA cuts them) admits, and causality on top, as `eager.attention_scores` masks them."""
    mask = layer_mask.reshape((1,) * (4 - layer_mask.dim()) + tuple(layer_mask.shape))[..., :keys]
    admitted = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    if causal and queries > 1:
        later = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).tril(keys - queries)
        admitted = admitted & later
    admitted = admitted.expand(batch, admitted.shape[1], queries, keys)
    return admitted.sum(-1, dtype=torch.float32)


def attention_entropy(
    probs: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    causal: bool = False,
    normalize: bool = False,
    layer_mask: torch.Tensor | None = None,
    sink: bool = False,
) -> torch.Tensor:
    """Mean attention entropy per head `[H]` over the real query rows of a batch.

    With `normalize=True` each row's entropy is divided by log(number of admissible keys), so rows
    and sequences of different lengths compare (1 = uniform, 0 = one key); rows with a single
    admissible key are left out then. The admissible keys are those the layer's own mask admits where
    `layer_mask` is given (`AttentionRecord.attention_mask(layer)`: sliding windows count); without it they are
    read off `probs`: the keys some head of the row gives a probability above 0 (a masked key reads exactly 0 in
    every head, so a sliding window or padding counts), and causality. A key that every head ignores so completely
    that its probability underflows to 0 counts as masked then (its entropy term is 0 either way); pass
    `layer_mask` to count by the mask (see `admissible_keys`). With `sink=True` (gpt-oss:
    `AttentionRecord.has_sink`) the sink is one more outcome (`row_entropy`) and one more key in the normalisation.

    Example:
        >>> probs = torch.tensor([[[[0.5, 0.5], [0.5, 0.5]], [[1.0, 0.0], [0.0, 1.0]]]])  # [1, 2, 2, 2]
        >>> attention_entropy(probs, normalize=True)                     # uniform, then one key
        tensor([1., 0.])
        >>> window = torch.tensor([[[[True, True, False], [False, True, True], [False, True, True]]]])
        >>> uniform = window / window.sum(-1, keepdim=True)              # uniform over the 2 keys each row admits
        >>> attention_entropy(uniform, normalize=True), attention_entropy(uniform, normalize=True, layer_mask=window)
        (tensor([1.]), tensor([1.]))
    """
    if normalize and layer_mask is None:  # the keys the softmax admitted: those some head gives a share
        layer_mask = probs.detach().amax(1, keepdim=True) > 0
    return mean_row_entropy(
        row_entropy(probs, sink), attention_mask, probs.shape[-1], causal, normalize, layer_mask, sink
    )


def mean_row_entropy(
    entropy: torch.Tensor,
    attention_mask: torch.Tensor | None,
    keys: int,
    causal: bool = False,
    normalize: bool = False,
    layer_mask: torch.Tensor | None = None,
    sink: bool = False,
) -> torch.Tensor:
    """`attention_entropy` from row entropies `[B, H, T]` (of `keys` keys each), as `attnreg.blockwise`
    computes them: the mean per head `[H]` over the real query rows. A `layer_mask` per head must hold the
    heads of `entropy` only; `sink`: the rows had a sink, one more outcome to normalise by.

    Example:
        >>> mean_row_entropy(torch.tensor([[[0.5, 0.7, 9.0]]]), torch.tensor([[1, 1, 0]]), keys=3)  # row 2: pad
        tensor([0.6000])
    """
    batch, heads, queries = entropy.shape
    layer_mask = layer_mask if normalize else None  # only normalisation reads the counts
    rows, counts = admissible_keys(attention_mask, torch.Size((batch, heads, queries, keys)), causal, layer_mask)
    rows, counts = rows.to(entropy.device), counts.to(entropy.device)
    if sink:
        counts = counts + 1
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

    Example:
        >>> entropy = torch.tensor([0.2, 0.5, 0.9])
        >>> entropy_penalty(entropy, "max"), entropy_penalty(entropy, "target", band=(0.3, 0.8))
        (tensor(-0.5333), tensor(0.0067))
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


def check_prior(
    prior: torch.Tensor, probs_shape: Sequence[int] | None, heads: Sequence[int] | None = None, values: bool = True
) -> None:
    """Raise a clear error unless `prior` (and `heads`) can supervise attention of shape `[B, H, T, S]`.

    Key indices `[B, T]` must be an integer tensor of keys 0..S-1, or -1 for a row left out. Dense rows
    `[B, T, S]` must be floating point, finite, non-negative, and each sum to 1 (within 1e-3, more for
    bf16) or be all zeros (row left out). `heads` must be head positions 0..H-1. The values cost a few
    reductions over the prior (and, on a GPU, one synchronization), nothing of the attention's size;
    `values=False` checks only the type, shape and heads (for a prior already checked this batch).
    Under `torch.compile` the values are checked inside the graph (`torch._assert_async`: no graph break, no
    synchronization), which raises a RuntimeError saying what is wrong but not in which row (a CUDA device-side
    assert on a GPU); run the check eagerly (this function on the batch) to be told the row.

    Example:
        >>> check_prior(torch.tensor([[2, -1, 0]]), (1, 4, 3, 3))       # fine: returns None
        >>> check_prior(torch.tensor([[2, -5, 0]]), (1, 4, 3, 3))
        Traceback (most recent call last):
        IndexError: prior: row (batch 0, query 1) has key index -5, outside 0..2 (only -1 leaves a row out)

    `probs_shape=None` checks only what the prior says of itself (a tensor of key indices or dense rows), before
    the attention's shape is known (counting a batch's rows ahead):

        >>> check_prior([[2, -1, 0]], None)
        Traceback (most recent call last):
        TypeError: prior must be a torch.Tensor (key indices [B, T] or dense rows [B, T, S]), got list
    """
    if probs_shape is not None and heads is not None:
        _check_heads(heads, probs_shape[1])
    if not isinstance(prior, torch.Tensor):
        raise TypeError(
            f"prior must be a torch.Tensor (key indices [B, T] or dense rows [B, T, S]), got {type(prior).__name__}"
        )
    if probs_shape is None:
        if prior.dim() not in (2, 3):
            raise ValueError(
                f"prior of shape {tuple(prior.shape)}: expected key indices [B, T] or dense rows [B, T, S]"
            )
        probs_shape = (prior.shape[0], 1, prior.shape[1], prior.shape[-1] if prior.dim() == 3 else prior.shape[1])
        values = False
    batch, count, queries, keys = probs_shape
    expected = (batch, queries) if prior.dim() == 2 else (batch, queries, keys)
    if tuple(prior.shape) != expected:
        raise ValueError(
            f"prior of shape {tuple(prior.shape)} does not match attention of shape {tuple(probs_shape)} "
            f"[B, H, T, S]: expected key indices {(batch, queries)} or dense rows {(batch, queries, keys)}"
        )
    if prior.dim() == 2 and (prior.dtype.is_floating_point or prior.dtype.is_complex or prior.dtype == torch.bool):
        raise TypeError(f"prior: key indices [B, T] must be an integer tensor, got {prior.dtype}")
    if prior.dim() == 3 and not prior.dtype.is_floating_point:
        raise TypeError(f"prior: dense rows [B, T, S] must be a floating-point tensor, got {prior.dtype}")
    if prior.numel() == 0 or not values:
        return
    if prior.dim() == 2:
        low, high = torch.aminmax(prior)
        good = (low >= -1) & (high < keys)
        if _values_hold(good, "a key index is outside 0..S-1, S the key count"):
            return
        b, q = _first_row((prior < -1) | (prior >= keys))
        raise IndexError(
            f"prior: row (batch {b}, query {q}) has key index {prior[b, q].item()}, outside 0..{keys - 1} "
            "(only -1 leaves a row out)"
        )
    sums = prior.sum(-1, dtype=torch.float64 if prior.dtype == torch.float64 else torch.float32)
    tolerance = max(1e-3, 2 * torch.finfo(prior.dtype).eps)
    bad = ~(prior.amin(-1) >= 0) | ~sums.isfinite() | (((sums - 1).abs() > tolerance) & (sums != 0))
    if _values_hold(~bad.any(), "a row has a negative or non-finite entry, or sums to neither 1 nor 0"):
        return
    b, q = _first_row(bad)
    values = prior[b, q]
    if not values.isfinite().all():
        key = int((~values.isfinite()).nonzero()[0])
        problem = f"has a non-finite entry {values[key].item()} at key {key}"
    elif (values < 0).any():
        key = int((values < 0).nonzero()[0])
        problem = f"has a negative entry {values[key].item():.4g} at key {key}"
    else:
        problem = f"sums to {sums[b, q].item():.6g}; rows must sum to 1 (within {tolerance:.2g}) or be all zeros"
    raise ValueError(f"prior: row (batch {b}, query {q}) {problem}")


def _values_hold(good: torch.Tensor, problem: str) -> bool:
    """Whether the 0-dim `good` is True, read eagerly; under `torch.compile` asserted inside the graph instead (a
    data-dependent branch would break it) and taken as True, the assertion raising where it is not."""
    if torch.compiler.is_compiling():
        where = "checked under torch.compile; run attnreg.losses.check_prior on the batch eagerly to find the row"
        assert_in_graph(good, f"prior: {problem} ({where})")
        return True
    return bool(good)


def _check_heads(heads: Sequence[int], count: int) -> None:
    if not isinstance(heads, Sequence) or isinstance(heads, str):
        raise TypeError(f"heads must be a list of head positions 0..{count - 1} (or None for all), got {heads!r}")
    if not heads:
        raise ValueError("heads is empty: name at least one head position (or None for all)")
    for head in heads:
        if isinstance(head, bool) or not isinstance(head, Integral):
            raise TypeError(f"heads must hold integer head positions, got {head!r} in {list(heads)!r}")
        if not 0 <= head < count:
            raise IndexError(f"heads: head {head} is outside 0..{count - 1} (the attention has {count} heads)")


def _first_row(bad: torch.Tensor) -> tuple[int, int]:
    """(batch, query) of the first True entry of `bad` `[B, T]`."""
    batch, query = bad.nonzero()[0].tolist()
    return batch, query


def prior_kl(
    probs: torch.Tensor,
    prior: torch.Tensor,
    heads: Sequence[int] | None = None,
    reduction: HeadReduction = "mean_heads",
    causal: bool = False,
    check_values: bool = True,
    layer_mask: torch.Tensor | None = None,
    rows: float | None = None,
) -> torch.Tensor:
    """KL(prior ‖ attention) per query row, averaged over rows that have prior mass.

    `prior` is either dense `[B, T, S]` (each row a distribution, or all zeros for rows left out) or
    one-hot as indices `[B, T]` (the key each query should attend to, -1 for rows left out); a prior
    that is neither raises, naming the first bad row (see `check_prior`).
    `heads` picks the supervised heads (None = all). `reduction`: "mean_heads" averages the per-head
    KLs; "mean_attention" takes the KL of the head-averaged attention. With `causal=True` the prior
    is first restricted to keys at or before each query (see `causal_prior`); with `layer_mask` (the layer's own SDPA
    mask, `AttentionRecord.attention_mask(layer)`) to the keys it admits, a sliding window's: rows whose prior lies
    outside are left out, as rows a causal model cannot reach are (`reachable_prior`). `check_values=False` skips
    the prior's value checks (`check_prior(..., values=False)`), for a prior already checked. `rows` divides the sum
    over rows by that many rows instead of the rows here (`prior_rows` counts them): a share of the mean over a larger
    batch. Zero prior entries contribute 0, and `log p` is clamped, so the loss stays finite under fp16/bf16 autocast.

    Example:
        >>> probs = torch.full((1, 4, 4, 4), 0.25)                        # uniform attention, 4 heads
        >>> prior_kl(probs, torch.tensor([[-1, 0, 0, 2]]), heads=[3])    # KL(one-hot || uniform) = log 4
        tensor(1.3863)
    """
    if probs.dim() != 4:
        raise ValueError(f"probs must be attention of one layer [B, H, T, S], got shape {tuple(probs.shape)}")
    if reduction not in ("mean_heads", "mean_attention"):
        raise ValueError(f"reduction must be 'mean_heads' or 'mean_attention', got {reduction!r}")
    check_prior(prior, probs.shape, heads, values=check_values)
    if layer_mask is not None:
        prior = reachable_prior(prior, layer_mask, causal, probs.shape[-1])[0]
    elif causal:
        prior = causal_prior(prior, probs.shape[-1])
    if heads is not None:
        probs = probs[:, list(heads)]
    if reduction == "mean_attention":
        probs = probs.mean(1, keepdim=True)
    if prior.dim() == 2:
        index = prior.long().clamp_min(0)[:, None, :, None].expand(-1, probs.shape[1], -1, 1)
        attended = _full_precision(probs.gather(-1, index).squeeze(-1))  # [B, H, T]
        cross_entropy = -attended.clamp_min(_TINY).log()
    else:
        log_p = _full_precision(probs).clamp_min(_TINY).log()
        cross_entropy = -(_full_precision(prior)[:, None] * log_p).sum(-1)
    return kl_from_cross_entropy(cross_entropy, prior, rows)


def kl_from_cross_entropy(cross_entropy: torch.Tensor, prior: torch.Tensor, rows: float | None = None) -> torch.Tensor:
    """`prior_kl` from the rows' cross-entropies `-sum_j r_ij log p_ij` `[B, H, T]` (as `attnreg.blockwise`
    computes them) and the checked, causally restricted `prior`: the mean KL over rows with prior mass (over `rows`
    rows, where given: the sum's share of a larger batch's mean).

    Example:
        >>> kl_from_cross_entropy(torch.tensor([[[2.0, 9.0, 1.0]]]), torch.tensor([[0, -1, 1]]))  # row 1 out
        tensor(1.5000)
        >>> kl_from_cross_entropy(torch.tensor([[[2.0, 9.0, 1.0]]]), torch.tensor([[0, -1, 1]]), rows=6)
        tensor(0.5000)
    """
    if prior.dim() == 2:
        counted, per_row = prior >= 0, cross_entropy
    else:
        prior = _full_precision(prior)
        counted = prior.sum(-1) > 0
        per_row = cross_entropy - torch.special.entr(prior).sum(-1)[:, None]  # 0 log 0 = 0
    weights = counted[:, None, :].to(per_row.dtype).expand_as(per_row)
    if rows is not None:  # the mean over heads of each row's KL, summed, over `rows` rows
        return (per_row * weights).sum() / (per_row.shape[1] * rows)
    return (per_row * weights).sum() / weights.sum().clamp_min(1)


def prior_rows(
    prior: torch.Tensor, padding: torch.Tensor | None = None, causal: bool = False, window: int | None = None
) -> torch.Tensor:
    """The rows of `prior` (key indices `[B, T]` or dense rows `[B, T, S]`) that `prior_kl` averages over, from the
    batch alone: rows with prior mass on keys the layer admits, those of `padding` (`[B, S]`, 1 = a real token; None:
    every key), at or before the query if `causal`, and within a sliding `window` of the query (the keys less than
    `window` back for a causal layer, at most `window` either side otherwise: transformers' `sliding_window`). A count
    `[]` (int64, on the prior's device, no synchronization).

    Example:
        >>> parents = torch.tensor([[-1, 0, 0, 2]])
        >>> prior_rows(parents), prior_rows(parents, causal=True, window=2)     # query 2's parent is 2 back
        (tensor(3), tensor(2))
    """
    check_prior(prior, None)
    queries = prior.shape[1]
    keys = prior.shape[2] if prior.dim() == 3 else queries
    back = (torch.arange(queries, device=prior.device) + (keys - queries))[:, None] - torch.arange(
        keys, device=prior.device
    )  # [T, S]: how far each key lies before each query
    admitted = back >= 0 if causal else torch.ones_like(back, dtype=torch.bool)
    if window is not None:
        admitted = admitted & (back < window if causal else back.abs() <= window)
    admitted = admitted[None]
    if padding is not None and padding.shape[-1] == keys:
        admitted = admitted & padding.to(prior.device).bool()[:, None, :]
    admitted = admitted.expand(prior.shape[0], queries, keys)
    if prior.dim() == 2:
        valid = (prior >= 0) & (prior < keys)
        inside = admitted.gather(-1, prior.clamp(0, keys - 1)[..., None]).squeeze(-1)
        return (valid & inside).sum()
    return ((prior * admitted).sum(-1) > 0).sum()


def reachable_prior(
    prior: torch.Tensor, layer_mask: torch.Tensor | None, causal: bool = False, keys: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`prior` restricted to the keys the layer can attend to, the number of prior rows its mask left out).

    `causal` first restricts to earlier keys (`causal_prior`; `keys`: S, as there); then `layer_mask`, the SDPA
    mask the layer received (`LayerInputs.attention_mask`, `AttentionRecord.attention_mask(layer)`: boolean, True =
    attend, or additive float; broadcastable to `[B, H, T, S]`, a longer key axis cut at S; one per head: the keys
    every head admits), restricts it to the keys that mask admits, a sliding window's: key indices outside become
    -1, dense rows lose those keys and are renormalized, as `causal_prior` does. The count `[]` (int64, on the
    prior's device, no synchronization) is of rows with prior mass that only the mask left out, beyond causality: a
    row outside the window would otherwise read the clamp, -log(1e-12) = 27.6, with no gradient.

    Example:
        >>> window = torch.ones(4, 4, dtype=torch.bool).tril().triu(-1)[None, None]   # itself and the one before
        >>> reachable_prior(torch.tensor([[-1, 0, 0, 2]]), window, causal=True)      # query 2's parent is 2 back
        (tensor([[-1,  0, -1,  2]]), tensor(1))
    """
    check_prior(prior, None)
    batch, queries = prior.shape[:2]
    keys = prior.shape[2] if prior.dim() == 3 else keys if keys is not None else queries
    if causal:
        prior = causal_prior(prior, keys)
    if layer_mask is None:
        return prior, torch.zeros((), dtype=torch.long, device=prior.device)
    mask = layer_mask.reshape((1,) * (4 - layer_mask.dim()) + tuple(layer_mask.shape))[..., :keys]
    admitted = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    admitted = admitted.all(1).to(prior.device).expand(batch, queries, admitted.shape[-1])  # [B, T, S]
    if prior.dim() == 2:
        inside = admitted.gather(-1, prior.clamp_min(0)[..., None]).squeeze(-1)
        left_out = (prior >= 0) & ~inside
        return prior.masked_fill(left_out, -1), left_out.sum()
    rows = prior.sum(-1) > 0
    prior = prior * admitted
    totals = prior.sum(-1, keepdim=True)
    restricted = torch.where(totals > 0, prior / totals.clamp_min(_TINY), torch.zeros_like(prior))
    return restricted, (rows & (totals.squeeze(-1) <= 0)).sum()


def causal_prior(prior: torch.Tensor, keys: int | None = None) -> torch.Tensor:
    """Restrict a prior to keys at or before each query, as a decoder sees them.

    Key indices `[B, T]` after the query become -1 (row left out); dense rows `[B, T, S]` lose the
    later keys and are renormalized, and rows with no mass left become all zeros (left out). `keys`
    (S) defaults to T; queries are the last T of the S positions.

    Example:
        >>> causal_prior(torch.tensor([[1, 0, 2]]))                      # query 0 cannot see key 1
        tensor([[-1,  0,  2]])
    """
    check_prior(prior, None)
    queries = prior.shape[1]
    keys = queries if keys is None else keys
    position = torch.arange(queries, device=prior.device) + (keys - queries)
    if prior.dim() == 2:
        return prior.masked_fill(prior > position, -1)
    allowed = torch.arange(keys, device=prior.device)[None, :] <= position[:, None]
    prior = prior * allowed
    totals = prior.sum(-1, keepdim=True)
    return torch.where(totals > 0, prior / totals.clamp_min(_TINY), torch.zeros_like(prior))
