"""Attention losses from queries and keys, in blocks of queries, without keeping the attention.

The losses need row statistics of the scores `s_ij`, never the whole matrix at once (LSE = logsumexp over
the admissible keys of row i):

- `-log p_i,parent = LSE_i - s_i,parent` (KL to a one-hot parent);
- `-sum_j r_j log p_ij = LSE_i - sum_j r_j s_ij` (cross-entropy to a dense prior row `r`);
- `H_i = LSE_i - sum_j p_ij s_ij` (entropy).

gpt-oss's sinks (a learned logit `c_h` per head, `sinks`) join each row's softmax as one more outcome that no value
reads: `LSE_i` then includes `exp(c_h)`, so `p_ij` sum to `1 - p_i,sink` (eager gpt-oss's `output_attentions`,
`eager.attention_probabilities(..., sinks=)`), the parent NLL is `LSE_i - s_i,parent` as before, and the entropy is
that of the whole softmax, the sink one outcome among the keys: `H_i = LSE_i - sum_j p_ij s_ij - p_i,sink c_h`
(normalized by the log of the admitted keys plus one, so a head uniform over keys and sink reads 1; the materialized
`attnreg.losses.attention_entropy(..., sink=True)` counts the missing mass `1 - sum_j p_ij` the same way). The sink
logits get their gradient (`dH/dc = -p_sink (c - E)`, `dNLL/dc = p_sink`), summed over batch and rows.

`query` and `key` are what transformers hands an attention function (`[B, H, T, d]`, `[B, H_kv, S, d]`,
after RoPE; grouped-query keys not yet repeated), and `attention_mask` its SDPA mask (boolean, additive
float, or None); `causal` masks the keys after each query on top of it. Values and gradients equal the
materialized path (`attnreg.eager.attention_probabilities` then `attnreg.losses`, 1e-5 in float32, bf16 tolerance
under autocast); `tests/test_blockwise.py` compares them on every family.

Design (what the measurements kept):

- The layer's own output stays on SDPA (flash kernels where there are some); the loss recomputes the
  scores of only the regularized heads, `block_size` queries at a time, reduces each block to numbers per
  row and lets it go. A causal block computes only the keys its rows may see (half the work on average),
  and masks only the keys its causal edge crosses (those after its first row's own), not the whole block.
- Entropy and the one-hot parent NLL (the LISA case) run in custom autograd functions (`_BlockEntropy`,
  `_BlockParentNLL`) that save the block's inputs (views that SDPA keeps anyway) and one or two numbers
  per row: `E_i = sum_j p_ij s_ij` for entropy, the parent index for the NLL. Backward recomputes the
  block's scores and softmax and writes the gradient out (`-p (s - E)` for entropy, `p - onehot` for the
  NLL): one matmul and one softmax again, two matmuls for the query and key gradients, no replay of
  autograd through the softmax. Saved bytes stay those of SDPA and grow linearly in T.
- Dense prior rows and `mean_attention` (rarer) recompute each block under `torch.utils.checkpoint`:
  same memory, an autograd replay slower than the two functions above.
- Everything elementwise goes through the fused softmax kernel: on CPU a separate `exp` costs several
  times more (fresh memory for its output, and masked scores at the float32 minimum take its slow
  path); the log-sum-exp is read off the softmax as `max_j s_ij - log max_j p_ij`.
- What remains on top of SDPA is memory traffic: per regularized head and block, the scores and the
  softmax are written and read a few times, where SDPA's fused kernel keeps them in cache. One head per
  layer (the KL) costs little; all heads of all layers (entropy) roughly doubles the attention's own
  time. `benchmarks/overhead.py` measures it and splits it by aten op; the README's Performance section
  and `docs/performance.md` give the figures.

Example:
    >>> import torch
    >>> query, key = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)     # 4 query heads, 2 key heads
    >>> mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)                  # SDPA's boolean mask
    >>> row_entropy(query, key, mask, scaling=8**-0.5, heads=[0, 3]).shape  # [B, 2, T] nats
    torch.Size([2, 2, 6])
    >>> parents = torch.tensor([[1, 0, 1, 1, 3, 3], [-1, 0, 0, 2, 2, 4]])
    >>> prior_cross_entropy(query, key, mask, parents, scaling=8**-0.5, heads=[2]).shape
    torch.Size([2, 1, 6])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from attnreg.losses import (
    HeadReduction,
    check_prior,
    kl_from_cross_entropy,
    mean_row_entropy,
    reachable_prior,
)
from attnreg.records import LayerInputs

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
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Entropy (nats) of every attention row of `heads` (None = all): `[B, len(heads), T]`, in float32;
    `softcap` caps the logits first, as Gemma 2 does; `sinks` `[H]` (gpt-oss) join the softmax as one more
    outcome, whose share counts in the entropy (divided by `temperature` too).

    Each block runs in `_BlockEntropy`, whose backward recomputes the block's scores and writes the
    gradient out, `dH/ds_ij = -p_ij (log p_ij + H_i)`, from the row statistics kept by forward.

    Example:
        >>> query, key = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
        >>> row_entropy(query, key, None, scaling=0.5, causal=True)[0, 0, 0].item()   # one key: 0 nats
        0.0
        >>> zero = torch.zeros(1, 1, 3, 4)                   # the first row: one key and a sink of equal logit
        >>> round(row_entropy(zero, zero, None, 0.5, causal=True, sinks=torch.zeros(1))[0, 0, 0].item(), 4)
        0.6931
    """
    blocks, order = _blocks(query, key, attention_mask, scaling, heads, temperature, causal, block_size, softcap, sinks)
    entropy = torch.cat([torch.cat([_BlockEntropy.apply(*part[:8]) for part in row], 1) for row in blocks], -1)
    return _in_order(entropy, order)


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
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`-sum_j r_ij log p_ij` for every row: `[B, len(heads), T]` (`[B, 1, T]` with `mean_attention`, where
    `p` is the heads' mean attention), float32. `prior`: key indices `[B, T]` (-1: row left out, reads 0)
    or dense rows `[B, T, S]`. `log p` is clamped at 1e-12, as `attnreg.losses.prior_kl` clamps. `sinks` `[H]`
    (gpt-oss) join the softmax denominator: `p` is what eager gpt-oss attends with, rows summing to less than 1.

    Key indices with `mean_heads` (the LISA case) run in `_BlockParentNLL`, which keeps only row
    statistics for backward; dense rows and `mean_attention` recompute each block under
    `torch.utils.checkpoint`.

    Example:
        >>> query, key = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
        >>> parents = torch.tensor([[0, 0, 1, -1, 2]])                  # -1: row left out
        >>> prior_cross_entropy(query, key, None, parents, 0.5, heads=[1], causal=True)[0, 0, [0, 3]]
        tensor([0., 0.])
    """
    check_prior(prior, None)
    blocks, order = _blocks(query, key, attention_mask, scaling, heads, temperature, causal, block_size, softcap, sinks)
    if prior.dim() == 2 and not mean_attention:
        nll = [torch.cat([_BlockParentNLL.apply(*part[:8], prior[:, part.rows]) for part in row], 1) for row in blocks]
        return _in_order(torch.cat(nll, dim=-1), order)

    def cross_entropy(row: list[_Block]) -> torch.Tensor:
        scores = [_scores(b.query, b.key, b.sink, b.mask, b.causal_rows, b.scaling, b.softcap) for b in row]
        rows, seen = row[0].rows, row[0].key.shape[2]
        if mean_attention:  # the mean over every chosen head, whichever key/value head each shares
            total = sum(torch.softmax(part, dim=-1)[..., :seen].sum(1, keepdim=True) for part in scores)
            log_p = (total / sum(part.shape[1] for part in scores)).clamp_min(_TINY).log()
        else:  # the sink's column dropped
            log_p = torch.cat([torch.log_softmax(part, dim=-1)[..., :seen] for part in scores], 1).clamp_min(_LOG_TINY)
        if prior.dim() == 3:  # keys after a causal block read the clamp, as masked keys do
            unseen = prior[:, None, rows, seen:].float().sum(-1) * -_LOG_TINY
            return unseen - (prior[:, None, rows, :seen].float() * log_p).sum(-1)
        parents = prior[:, None, rows]
        chosen = log_p.gather(-1, parents.clamp(0, seen - 1)[..., None].expand(-1, log_p.shape[1], -1, 1))
        return torch.where(parents >= seen, _LOG_TINY, chosen.squeeze(-1)).neg() * (parents >= 0)

    recompute = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad)
    parts = [checkpoint(cross_entropy, row, use_reentrant=False) if recompute else cross_entropy(row) for row in blocks]
    return torch.cat(parts, dim=-1) if mean_attention else _in_order(torch.cat(parts, dim=-1), order)


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
    padding mask `[B, S]`, which picks the real query rows. `normalize` divides by the log of the keys the
    layer's own mask (`inputs.attention_mask`) admits, sliding windows included.

    Example:
        >>> import attnreg
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("gpt2")                                    # 2 layers x 4 heads, causal
        >>> batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attention_mask": torch.ones(1, 4)}
        >>> with attnreg.attach(model).capture(layers=[1], inputs=True) as record:
        ...     _ = model(**batch)
        >>> entropy = attention_entropy(record[1], batch["attention_mask"], causal=True, normalize=True)
        >>> from attnreg import eager, losses                              # the materialized path agrees
        >>> inputs = record[1]
        >>> probs = eager.attention_probabilities(inputs.query, inputs.key, None, inputs.scaling, causal=True)
        >>> torch.allclose(entropy, losses.attention_entropy(probs, causal=True, normalize=True), atol=1e-6)
        True
    """
    entropy = row_entropy(
        inputs.query,
        inputs.key,
        inputs.attention_mask,
        inputs.scaling,
        heads,
        causal=inputs.causal,
        block_size=block_size,
        softcap=inputs.softcap,
        sinks=inputs.sinks,
    )
    layer_mask = inputs.attention_mask
    if layer_mask is not None and layer_mask.dim() == 4 and layer_mask.shape[1] > 1 and heads is not None:
        layer_mask = layer_mask[:, list(heads)]  # a mask per head: the chosen heads'
    sink = inputs.sinks is not None
    return mean_row_entropy(entropy, attention_mask, inputs.key.shape[2], causal, normalize, layer_mask, sink)


def prior_kl(
    inputs: LayerInputs,
    prior: torch.Tensor,
    heads: Sequence[int] | None = None,
    reduction: HeadReduction = "mean_heads",
    causal: bool = False,
    block_size: int = BLOCK_SIZE,
    check_values: bool = True,
    rows: float | None = None,
) -> torch.Tensor:
    """`attnreg.losses.prior_kl` (same arguments and checks) of the layer `inputs` describe; prior rows outside the
    keys the layer's own mask admits (a sliding window) are left out, as `prior_kl(..., layer_mask=)` leaves them.

    Example:
        >>> import attnreg
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert")
        >>> with attnreg.attach(model).capture(layers=[0], inputs=True) as record:
        ...     _ = model(input_ids=torch.tensor([[5, 6, 7, 8]]))
        >>> parents = torch.tensor([[1, -1, 1, 2]])                       # -1: the root, left out
        >>> float(prior_kl(record[0], parents, heads=[2])) > 0
        True
    """
    if reduction not in ("mean_heads", "mean_attention"):
        raise ValueError(f"reduction must be 'mean_heads' or 'mean_attention', got {reduction!r}")
    query, key = inputs.query, inputs.key
    check_prior(prior, (query.shape[0], query.shape[1], query.shape[2], key.shape[2]), heads, values=check_values)
    prior = reachable_prior(prior, inputs.attention_mask, causal, key.shape[2])[0]  # a window's keys only
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
        softcap=inputs.softcap,
        sinks=inputs.sinks,
    )
    return kl_from_cross_entropy(cross_entropy, prior, rows)


class _Block(NamedTuple):
    """One block of query rows (divided by the temperature, if any), the keys those rows may see (a causal
    layer's block stops at its last row's key), the sink logits of its heads (gpt-oss, divided by the temperature;
    else None), their mask rows, for a causal layer `(first row, key offset)` to mask later keys with, the layer's
    key count S, the scaling and the logit softcap (Gemma 2)."""

    query: torch.Tensor
    key: torch.Tensor
    sink: torch.Tensor | None
    mask: torch.Tensor | None
    causal_rows: tuple[int, int] | None
    keys: int
    scaling: float
    softcap: float | None
    rows: slice


def _blocks(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    heads: Sequence[int] | None,
    temperature: torch.Tensor | None,
    causal: bool,
    block_size: int,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[list[list[_Block]], list[int] | None]:
    """The chosen heads of a layer in blocks of `block_size` queries: per block of rows, one `_Block` per set of
    query heads that share their key/value heads evenly (one set, unless the chosen heads cover the key/value heads
    unevenly), the heads sorted; and the order that puts the sorted heads back as `heads` lists them (None: as is).

    Grouped-query keys are never repeated: a block's `c` query heads per key/value head are computed against their
    one key (`_scores` folds them into its rows), and a set's heads and keys are views of the layer's where they
    are contiguous (all heads; one head), so nothing more is kept for backward than SDPA keeps."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if softcap is not None and sinks is not None:
        raise ValueError("softcap and sinks together are not implemented (no model has both)")
    if sinks is not None and sinks.shape != (query.shape[1],):
        raise ValueError(
            f"sinks must hold one logit per query head, shape ({query.shape[1]},), got {tuple(sinks.shape)}"
        )
    kv_heads = key.shape[1]
    if kv_heads == 0 or query.shape[1] % kv_heads:
        raise ValueError(f"{query.shape[1]} query heads cannot share {kv_heads} key/value heads evenly")
    group = query.shape[1] // kv_heads
    chosen = list(range(query.shape[1])) if heads is None else list(heads)
    outside = [head for head in chosen if not 0 <= head < query.shape[1]]
    if outside or not chosen:
        raise IndexError(f"heads {chosen} must name head positions 0..{query.shape[1] - 1} (the layer's query heads)")
    ranked = [i for head in range(query.shape[1]) for i, other in enumerate(chosen) if other == head]  # traceable
    order = None
    if ranked != list(range(len(chosen))):
        order = [0] * len(chosen)
        for rank, position in enumerate(ranked):
            order[position] = rank
    shared: dict[int, list[int]] = {}
    ordered = [chosen[i] for i in ranked]
    for head in ordered:
        shared.setdefault(head // group, []).append(head)
    even = len({len(members) for members in shared.values()}) == 1
    sets = [ordered] if even else list(shared.values())
    per_head_mask = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] > 1
    parts = []
    for members in sets:
        part_query, part_key = (
            _heads(query, members),
            _heads(key, list(dict.fromkeys(head // group for head in members))),
        )
        part_sinks = None if sinks is None else sinks[members]
        if temperature is not None:
            divide = temperature[members].to(query.dtype).reshape(1, -1, 1, 1)
            part_query = part_query / divide
            part_sinks = None if part_sinks is None else part_sinks / temperature[members].to(part_sinks.dtype)
        part_mask = _heads(attention_mask, members) if per_head_mask else attention_mask
        parts.append((part_query, part_key, part_sinks, part_mask))
    queries, keys = query.shape[2], key.shape[2]
    blocks = []
    for start in range(0, queries, block_size):
        rows = slice(start, min(start + block_size, queries))
        seen = min(keys, rows.stop + keys - queries) if causal else keys  # later keys are masked anyway
        causal_rows = (start, keys - queries) if causal and queries > 1 else None
        row = []
        for part_query, part_key, part_sinks, part_mask in parts:
            mask = None
            if part_mask is not None:
                mask = part_mask[..., rows, :seen] if part_mask.shape[-2] > 1 else part_mask[..., :seen]
            block_query, block_key = part_query[:, :, rows], part_key[:, :, :seen]
            row.append(_Block(block_query, block_key, part_sinks, mask, causal_rows, keys, scaling, softcap, rows))
        blocks.append(row)
    return blocks, order


def _heads(tensor: torch.Tensor, heads: list[int]) -> torch.Tensor:
    """`tensor[:, heads]`: a view where `heads` are contiguous, else a copy of those heads (never a repeat)."""
    if heads == list(range(heads[0], heads[0] + len(heads))):
        return tensor[:, heads[0] : heads[0] + len(heads)]
    return tensor[:, heads]


def _in_order(values: torch.Tensor, order: list[int] | None) -> torch.Tensor:
    """Per-head values `[B, h, T]` of the sorted heads, in the order the caller listed them."""
    return values if order is None else values[:, order]


def _scores(
    query: torch.Tensor,
    key: torch.Tensor,
    sink: torch.Tensor | None,
    mask: torch.Tensor | None,
    causal_rows: tuple[int, int] | None,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """A block's masked scores `[B, h, rows, S']` in float32, masked keys at float32's minimum: those
    `mask` masks and, for a causal block, those after each row's own position; with `softcap`, capped first
    (`softcap * tanh(s / softcap)`, as Gemma 2 does before its mask); with `sink` `[h]`, one more column holding
    each head's sink logit (`[B, h, rows, S' + 1]`), never masked.

    A causal block masks only the keys its causal edge crosses: every row sees the keys up to its first row's
    own (`first + offset`), so only the last `rows - 1` keys of the block (the causal block stops at its last row's
    key) get a causal mask, not the whole `[rows, S']`."""
    scores = torch.matmul(_folded(query, key) * scaling, key.transpose(-1, -2))  # scaling the small operand
    scores = scores.reshape(query.shape[:3] + (key.shape[2],)).float()  # [B, h, rows, S']: a view of the above
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap  # not in place: tanh keeps its output for backward
    if mask is not None and mask.dtype == torch.bool:
        scores.masked_fill_(mask.logical_not(), _MIN)
    elif mask is not None:
        scores.add_(mask).clamp_min_(_MIN)  # an additive -inf reads as the minimum: finite sums
    if causal_rows is not None:
        first, offset = causal_rows
        edge = min(max(first + offset + 1, 0), key.shape[2])  # keys before it: seen by every row of the block
        if edge < key.shape[2]:
            last_key = torch.arange(first, first + query.shape[2], device=query.device)[:, None] + offset
            later = torch.arange(edge, key.shape[2], device=query.device)[None, :] > last_key
            scores[..., edge:].masked_fill_(later, _MIN)
    if sink is not None:
        column = sink.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], dim=-1)
    return scores


def _folded(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """A block's query heads `[B, h, r, d]` as rows of their key/value heads `[B, h_kv, (h / h_kv) r, d]` (the heads
    of a key/value head are consecutive, as `repeat_kv` orders them): one matmul against the shared keys gives every
    head's scores, and no key is repeated. A view when `h = h_kv`."""
    batch, heads, rows, dim = query.shape
    return query if heads == key.shape[1] else query.reshape(batch, key.shape[1], heads // key.shape[1] * rows, dim)


def _probabilities(ctx, query, key, sink, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's scores and softmax, recomputed in backward from its inputs."""
    causal_rows, _, scaling, softcap = ctx.block
    scores = _scores(query, key, sink, mask, causal_rows, scaling, softcap)
    return scores, torch.softmax(scores, dim=-1)


def _cap_gradient(ctx, scores: torch.Tensor) -> torch.Tensor | None:
    """d capped / d raw score, `1 - (s / softcap)^2`, where a softcap is set (0 on masked keys); else None."""
    softcap = ctx.block[3]
    if softcap is None:
        return None
    return torch.where(scores > _MIN, 1 - (scores / softcap).square(), 0.0)


def _key_gradients(
    ctx, dscores: torch.Tensor, query: torch.Tensor, key: torch.Tensor, sink: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of `query`, `key` and `sink` from those of the block's scores (the scaling applied to the
    small products; the sink's column summed over batch and rows), and None for the other arguments."""
    dsink = None
    if sink is not None:
        dsink = dscores[..., -1].sum((0, 2)).to(sink.dtype)
        dscores = dscores[..., :-1]
    dscores, scaling = dscores.to(query.dtype), ctx.block[2]
    folded = _folded(query, key)  # a key/value head's gradient sums over the query heads that share it
    dscores = dscores.reshape(folded.shape[:3] + (key.shape[2],))
    dquery = (dscores @ key).mul_(scaling).reshape(query.shape)
    dkey = (dscores.transpose(-1, -2) @ folded).mul_(scaling)
    return dquery, dkey, dsink, *[None] * (ctx.arguments - 3)


class _BlockEntropy(torch.autograd.Function):
    """Row entropies of one block, keeping for backward only its inputs (views) and, per row, the mean
    score under attention `E_i = sum_j p_ij s_ij` and whether any key is unmasked.

    `H_i = log sum_j exp(s_ij) - E_i`, with the log-sum-exp read off the softmax as `top_i - log max_j p_ij`;
    backward: `dH/ds_ij = -p_ij (s_ij - E_i)`. Both go through the fused softmax kernel: an `exp` of its
    own is several times slower on CPU, where masked scores take its slow path. A row whose keys are
    all masked reads `log S` (uniform over the layer's S keys) and gets no gradient (with a sink: 0, all its mass on
    the sink); a NaN or inf among a row's scores gives NaN, as on the materialized path. A sink is one more column
    of the scores (`_scores`), so every formula above holds with it as one more key."""

    @staticmethod
    def forward(ctx, query, key, sink, mask, causal_rows, keys, scaling, softcap):
        scores = _scores(query, key, sink, mask, causal_rows, scaling, softcap)
        top = scores.amax(-1, keepdim=True)
        p = torch.softmax(scores, dim=-1)
        with torch.autocast(scores.device.type, enabled=False):  # in float32: bf16 reads the minimum as -inf
            mean_score = torch.linalg.vecdot(p, scores).unsqueeze(-1)  # masked keys: 0 * minimum = 0
        entropy = top - p.amax(-1, keepdim=True).log_() - mean_score
        alive = top != _MIN  # all keys masked; a NaN or inf score keeps its row alive, so the loss reads NaN
        entropy = torch.where(alive, entropy, math.log(keys))
        mean_score = torch.where(alive, mean_score, 0.0)  # all keys masked: s - 0 stays finite (no inf - inf)
        ctx.save_for_backward(query, key, sink, mask, mean_score, alive)
        ctx.block, ctx.arguments = (causal_rows, keys, scaling, softcap), 8
        return entropy.squeeze(-1)

    @staticmethod
    def backward(ctx, grad):
        query, key, sink, mask, mean_score, alive = ctx.saved_tensors
        scores, p = _probabilities(ctx, query, key, sink, mask)
        cap = _cap_gradient(ctx, scores)
        dscores = scores.sub_(mean_score).mul_(p).mul_(grad.unsqueeze(-1).neg() * alive)
        return _key_gradients(ctx, dscores if cap is None else dscores.mul_(cap), query, key, sink)


class _BlockParentNLL(torch.autograd.Function):
    """`-log p_i,parent` (p clamped at 1e-12, as `attnreg.losses.prior_kl` clamps) of one block; `parents`
    `[B, rows]`, -1 for rows left out (they read 0). Keeps only the inputs and, per row, the parent and
    whether the row gets a gradient; backward: `ds_ij = p_ij - [j = parent]` on rows counted and not
    clamped, from the recomputed softmax."""

    @staticmethod
    def forward(ctx, query, key, sink, mask, causal_rows, keys, scaling, softcap, parents):
        scores = _scores(query, key, sink, mask, causal_rows, scaling, softcap)
        alive = scores.amax(-1, keepdim=True) != _MIN  # as in _BlockEntropy: NaN is not hidden
        p = torch.softmax(scores, dim=-1)
        seen = key.shape[2]  # a sink's column is after the keys
        index = parents.clamp(0, seen - 1)[:, None, :, None].expand(-1, p.shape[1], -1, 1)
        chosen = p.gather(-1, index).masked_fill_((parents >= seen)[:, None, :, None], 0.0)  # after the block
        counted = (parents >= 0)[:, None, :, None]
        live = counted & alive & (chosen >= _TINY)
        nll = torch.where(alive, chosen.clamp_min(_TINY).log().neg(), math.log(keys)) * counted
        ctx.save_for_backward(query, key, sink, mask, index, live)
        ctx.block, ctx.arguments = (causal_rows, keys, scaling, softcap), 9
        return nll.squeeze(-1)

    @staticmethod
    def backward(ctx, grad):
        query, key, sink, mask, index, live = ctx.saved_tensors
        grad = grad.unsqueeze(-1) * live
        scores, p = _probabilities(ctx, query, key, sink, mask)
        cap = _cap_gradient(ctx, scores)
        dscores = p.mul_(grad).scatter_add_(-1, index, -grad)
        return _key_gradients(ctx, dscores if cap is None else dscores.mul_(cap), query, key, sink)


_MIN = torch.finfo(torch.float32).min
_TINY = 1e-12
_LOG_TINY = math.log(_TINY)
