"""Head statistics and word attention from a layer's queries and keys, a block of query rows at a time.

The materialized analysis (`hub.capture()`) keeps every layer's attention `[B, H, T, T]` until the forward
ends: `layers x B x H x T^2` floats, 67.5 GiB for SmolLM2-135M (30 layers x 9 heads) on one 8,192-token input.
Here every layer stays on SDPA; as soon as one has run, what its attention function received (queries and
keys, `hub.capture(layers=[l], inputs=True)`, the inputs of `attnreg.blockwise`'s losses) is reduced
`block_size` query rows at a time to the sums `HeadStatistics` and `ParentAccuracy` keep, and dropped. On top
of the forward this holds one block's scores and probabilities (a few `B x H x block_size x T` floats) and,
with gold trees, one layer's word attention `[B, H, W, W]` (W: the words of a sentence).

The probabilities are `attnreg.eager.attention_probabilities`'s: scores `q k^T * scaling` (grouped-query keys shared
by their query heads, the hub's temperature already in `q`), Gemma 2's logit softcap, the layer's own mask
(boolean or additive: padding and sliding windows as the layer received them) and, for a causal layer, the
keys after each query on top (masked only where a block's diagonal edge reaches); softmax in float32. A causal
block computes only the keys up to its last row.

Example:
    >>> import attnreg
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("llama").eval()                      # 4 query heads share 2 key/value heads
    >>> hub = attnreg.attach(model)
    >>> batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "attention_mask": torch.ones(1, 5)}
    >>> with torch.no_grad(), hub.capture(layers=[0], inputs=True) as record:
    ...     _ = model(**batch)
    >>> blocks = list(attention_blocks(record[0], block_size=2))
    >>> [(block.rows, tuple(block.probs.shape)) for block in blocks]   # a causal block stops at its last row
    [(slice(0, 2, None), (1, 4, 2, 2)), (slice(2, 4, None), (1, 4, 2, 4)), (slice(4, 5, None), (1, 4, 1, 5))]
    >>> kinds = torch.zeros(1, 5, 3, dtype=torch.bool)                  # `TokenKinds.masks`: no specials here
    >>> sums, rows = block_statistics(record[0], kinds, batch["attention_mask"], block_size=2)
    >>> from attnreg.analysis import attention_statistics              # the materialized path agrees
    >>> from attnreg.eager import attention_probabilities
    >>> probs = attention_probabilities(record[0].query, record[0].key, None, record[0].scaling, causal=True)
    >>> expected, counted = attention_statistics(probs, kinds, batch["attention_mask"], causal=True)
    >>> torch.allclose(sums, expected), torch.equal(rows, counted)
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from attnreg.analysis.heads import ATTENTION_STATISTICS
from attnreg.hub import AttentionHub
from attnreg.records import LayerInputs

BLOCK_SIZE = 128
"""Query rows per block (as `attnreg.blockwise`): memory on top of the forward is a few B x H x 128 x T floats."""

_MIN = torch.finfo(torch.float32).min


class AttentionBlock(NamedTuple):
    """One block of a layer's attention: its query `rows`, their probabilities `probs` `[B, H, r, S']` (float32)
    over the first S' keys (a causal block's later keys are all masked: they read 0), and `admissible` `[B, r]`,
    how many keys the layer's own mask and causality let each row see (None where the layer received no mask:
    then every key up to causality), each row's `entropy` `[B, H, r]` in nats and its most attended key `argmax`
    `[B, H, r]` (the first of equal ones), which the entropy reads anyway.

    Example:
        >>> from attnreg.records import LayerInputs
        >>> inputs = LayerInputs(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), None, 0.5, causal=True)
        >>> block = next(attention_blocks(inputs, block_size=2))          # equal scores: uniform over the prefix
        >>> block.rows, block.probs[0, 0], block.entropy[0, 0], block.admissible
        (slice(0, 2, None), tensor([[1.0000, 0.0000],
                [0.5000, 0.5000]]), tensor([0.0000, 0.6931]), None)
    """

    rows: slice
    probs: torch.Tensor
    admissible: torch.Tensor | None
    entropy: torch.Tensor
    argmax: torch.Tensor


def attention_blocks(inputs: LayerInputs, block_size: int = BLOCK_SIZE) -> Iterator[AttentionBlock]:
    """The attention of the layer `inputs` describe, `block_size` query rows at a time (see the module docstring).

    A row whose keys are all masked reads uniform over S', where the materialized softmax reads it uniform over S
    (such rows are padding, never counted). Causality masks only the keys a block's diagonal edge touches: those
    before the block's first row are visible to all its rows.

    Example:
        >>> query, key = torch.randn(1, 2, 5, 4), torch.randn(1, 1, 5, 4)   # 2 query heads share 1 key head
        >>> from attnreg.eager import attention_probabilities
        >>> from attnreg.records import LayerInputs
        >>> inputs = LayerInputs(query, key, None, scaling=0.5, causal=True)
        >>> rows = torch.cat([torch.nn.functional.pad(block.probs, (0, 5 - block.probs.shape[-1]))
        ...                   for block in attention_blocks(inputs, block_size=2)], dim=2)
        >>> torch.allclose(rows, attention_probabilities(query, key, None, 0.5, causal=True), atol=1e-6)
        True
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if getattr(inputs, "sinks", None) is not None:
        raise NotImplementedError(
            "the layer's softmax has a sink logit per head (gpt-oss); the blockwise head statistics do not model it: "
            "use analyze(..., blockwise=False)"
        )
    query, key, mask = inputs.query, inputs.key, inputs.attention_mask
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads evenly")
    groups = heads // kv_heads
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))[..., :keys]  # SDPA cuts longer key axes
        if mask.shape[1] > 1:
            raise NotImplementedError(
                f"the layer's attention mask has one mask per head (shape {tuple(mask.shape)}); the head statistics "
                "take one mask for all heads: use analyze(..., blockwise=False)"
            )
    offset = keys - queries
    causal = inputs.causal and queries > 1
    triangles: dict[tuple[int, int, int], torch.Tensor] = {}  # the causal edge of a block, the same for most
    for start in range(0, queries, block_size):
        stop = min(start + block_size, queries)
        rows = stop - start
        seen = min(keys, stop + offset) if causal else keys
        grouped = query[:, :, start:stop].reshape(batch, kv_heads, groups * rows, dim)  # head h uses key h // groups
        scores = torch.matmul(grouped * inputs.scaling, key[:, :, :seen].transpose(-1, -2))  # scaling the small side
        scores = scores.reshape(batch, heads, rows, seen).float()
        if inputs.softcap is not None:
            scores = torch.tanh(scores / inputs.softcap) * inputs.softcap
        admissible = None
        if mask is not None:
            block_mask = mask[..., start:stop, :seen] if mask.shape[-2] > 1 else mask[..., :seen]
            block_mask = block_mask.expand(-1, 1, rows, seen)
            if block_mask.dtype == torch.bool:  # added as a bias: masked_fill_ with a broadcast mask is slow on CPU
                admitted = block_mask
                scores.add_(torch.zeros((), device=scores.device).masked_fill(block_mask.logical_not(), _MIN))
            else:  # additive: its minimum (or -inf) masks, as `attnreg.losses.admissible_keys` reads it
                admitted = block_mask > torch.finfo(block_mask.dtype).min
                scores.add_(block_mask).clamp_min_(_MIN)
        edge = max(0, min(seen, start + offset))  # keys from here on may come after some of the block's rows
        if causal and edge < seen:
            shape = (rows, seen - edge, start + offset - edge + 1)
            if shape not in triangles:
                triangles[shape] = torch.ones(shape[:2], dtype=torch.bool, device=scores.device).triu_(shape[2])
            later = triangles[shape]
            edge_scores = scores[..., edge:].add_(torch.zeros((), device=scores.device).masked_fill(later, _MIN))
            if mask is not None:
                edge_scores.clamp_min_(_MIN)  # a key the layer's mask masks too read twice the minimum: -inf
            if mask is not None:
                admitted = torch.cat([admitted[..., :edge], admitted[..., edge:] & later.logical_not()], dim=-1)
        if mask is not None:
            admissible = admitted.sum(-1, dtype=torch.float32)[:, 0].expand(batch, rows)
        probs = torch.softmax(scores, dim=-1)
        # Entropy from the scores: log-sum-exp minus the mean score, the log-sum-exp read off the softmax as
        # max_j s_ij - log max_j p_ij (no log of every probability; the largest probability sits at the largest
        # score); masked keys add 0 * minimum = 0. One fused dot product per row, no product kept.
        largest, at = probs.max(-1)
        top = scores.gather(-1, at[..., None]).squeeze(-1)
        entropy = top - largest.log() - torch.linalg.vecdot(probs, scores)
        del scores
        yield AttentionBlock(slice(start, stop), probs, admissible, entropy, at)


def block_statistics(
    inputs: LayerInputs,
    kinds: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    block_size: int = BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_statistics` of the layer `inputs` describe, from its queries and keys in blocks: per-head sums
    `[H, K]` and row counts `[K]` of every statistic in `ATTENTION_STATISTICS`.

    `kinds` is `[B, T, 3]` (`TokenKinds.masks`), `attention_mask` the batch's 2D padding mask `[B, T]`, which
    picks the real query rows (and, where the layer received no mask, the real keys entropy is normalized by).
    Entropy is normalized by the log of the keys the layer's own mask admits (sliding windows included), as
    `attention_statistics` normalizes it given that mask.

    Example:
        >>> from attnreg.analysis import ATTENTION_STATISTICS
        >>> from attnreg.records import LayerInputs
        >>> inputs = LayerInputs(torch.zeros(1, 2, 4, 8), torch.zeros(1, 1, 4, 8), None, 0.35, causal=True)
        >>> sums, rows = block_statistics(inputs, torch.zeros(1, 4, 3, dtype=torch.bool), block_size=3)
        >>> means = sums / rows                                            # [H, K]: uniform causal heads
        >>> means[:, ATTENTION_STATISTICS.index("entropy")], means[:, ATTENTION_STATISTICS.index("to_first")]
        (tensor([1., 1.], dtype=torch.float64), tensor([0.5208, 0.5208], dtype=torch.float64))
    """
    sums, counts, _ = reduce_layer(inputs, kinds, attention_mask, None, block_size)
    return sums, counts


def block_word_attention(inputs: LayerInputs, membership: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """`batch_word_attention` of the layer `inputs` describe, `[B, H, W, W]`, from its queries and keys in
    blocks: to a word, the sum over its pieces; from a word, the mean. `membership` `[B, T, W]`.

    Example:
        >>> from attnreg.analysis import batch_word_attention
        >>> from attnreg.eager import attention_probabilities
        >>> from attnreg.records import LayerInputs
        >>> query, key = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
        >>> membership = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]])  # 2 words, 1 special
        >>> blocks = block_word_attention(LayerInputs(query, key, None, 0.35, False), membership, block_size=3)
        >>> probs = attention_probabilities(query, key, None, 0.35)
        >>> torch.allclose(blocks, batch_word_attention(probs, membership), atol=1e-6)
        True
    """
    return reduce_layer(inputs, None, None, membership, block_size)[2]


def reduce_layer(
    inputs: LayerInputs,
    kinds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    membership: torch.Tensor | None,
    block_size: int = BLOCK_SIZE,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """One pass over the layer's blocks: `block_statistics`'s sums and counts (None without `kinds`) and
    `block_word_attention` (None without `membership`).

    Example:
        >>> from attnreg.records import LayerInputs
        >>> inputs = LayerInputs(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), None, 0.35, causal=False)
        >>> membership = torch.eye(4)[None, :, :3]                          # tokens 0-2 are words 0-2
        >>> sums, rows, words = reduce_layer(inputs, torch.zeros(1, 4, 3, dtype=torch.bool), None, membership)
        >>> sums.shape, rows.shape, words.shape
        (torch.Size([2, 11]), torch.Size([11]), torch.Size([1, 2, 3, 3]))
    """
    query, key = inputs.query, inputs.key
    batch, heads, queries, _ = query.shape
    if queries != key.shape[2]:
        raise ValueError(
            f"head statistics need as many queries as keys (no key/value cache): got {queries} queries and "
            f"{key.shape[2]} keys; run the model with use_cache=False and without past_key_values"
        )
    device = query.device
    statistics = kinds is not None
    if statistics:
        real = torch.ones(batch, queries, dtype=torch.bool, device=device)
        if attention_mask is not None:
            real = attention_mask.to(device).bool()
        index = torch.arange(queries, device=device)
        first = torch.zeros(batch, queries, device=device)
        first[torch.arange(batch, device=device), real.long().argmax(-1)] = 1.0  # the first real token: the sink
        # One matmul per block reads every mass at once: start, end, punctuation, first token, the row's sum, and
        # its first moment (the mean key position, for the distance).
        features = torch.cat(
            [kinds.to(device, torch.float32), first[..., None], torch.ones_like(first)[..., None]]
            + [index.float().expand(batch, -1)[..., None]],
            dim=-1,
        )[:, None]
        unmasked = real.long().cumsum(-1) if inputs.causal else real.long().sum(-1, keepdim=True).expand_as(real)
        previous_rows = torch.zeros_like(real)
        previous_rows[:, 1:] = real[:, 1:] & real[:, :-1]
        next_rows = torch.zeros_like(real)
        next_rows[:, :-1] = real[:, :-1] & real[:, 1:]
        sums = torch.zeros(heads, len(ATTENTION_STATISTICS), dtype=torch.float64, device=device)
        counts = torch.zeros(len(ATTENTION_STATISTICS), dtype=torch.float64, device=device)
    if membership is not None:
        membership = membership.to(device, torch.float32)
        mean_pieces = membership / membership.sum(1, keepdim=True).clamp_min(1)
        words = torch.zeros(batch, heads, membership.shape[-1], membership.shape[-1], device=device)
    for block in attention_blocks(inputs, block_size):
        probs, rows = block.probs, block.rows
        seen = probs.shape[-1]
        if membership is not None:
            to_words = probs @ membership[:, None, :seen]  # [B, H, r, W]: the sum over key pieces
            words += torch.einsum("brw,bhrv->bhwv", mean_pieces[:, rows], to_words)
        if not statistics:
            continue
        position = index[rows]
        masses = probs @ features[..., :seen, :]  # [B, H, r, 6]
        if inputs.causal:  # no key after the row: |i - j| = i - j
            distance = position * masses[..., 4] - masses[..., 5]
        else:
            distance = torch.linalg.vecdot(probs, (position[:, None] - index[None, :seen]).abs().float())
        argmax = block.argmax
        to_self, to_previous, to_next = (_at(probs, position + shift) for shift in (0, -1, 1))
        admissible = block.admissible if block.admissible is not None else unmasked[:, rows].float()
        entropy = block.entropy / admissible.clamp_min(2).log()[:, None]
        real_rows, previous, following = real[:, rows], previous_rows[:, rows], next_rows[:, rows]
        values = {
            "entropy": (entropy, real_rows & (admissible > 1)),
            "to_start": (masses[..., 0], real_rows),
            "to_first": (masses[..., 3], real_rows),
            "to_end": (masses[..., 1], real_rows),
            "to_punctuation": (masses[..., 2], real_rows),
            "to_self": (to_self, real_rows),
            "to_previous": (to_previous, previous),
            "to_next": (to_next, following),
            "distance": (distance, real_rows),
            "argmax_previous": ((argmax == position - 1).float(), previous),
            "argmax_next": ((argmax == position + 1).float(), following),
        }
        ordered = [values[name] for name in ATTENTION_STATISTICS]
        weights = torch.stack([weight for _, weight in ordered]).float()  # [K, B, r]
        sums += torch.einsum("kbhr,kbr->hk", torch.stack([value.float() for value, _ in ordered]), weights).double()
        counts += weights.sum((1, 2)).double()
    if not statistics:
        return None, None, words if membership is not None else None
    return sums.cpu(), counts.cpu(), words if membership is not None else None


def _at(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`probs[b, h, i, keys[i]]` `[B, H, r]`, 0 where the key is outside the block's keys."""
    seen = probs.shape[-1]
    inside = (keys >= 0) & (keys < seen)
    index = keys.clamp(0, seen - 1)[None, None, :, None].expand(probs.shape[0], probs.shape[1], -1, 1)
    return probs.gather(-1, index).squeeze(-1) * inside


@contextmanager
def layer_by_layer(hub: AttentionHub, reduce: Callable[[int, LayerInputs], None]) -> Iterator[None]:
    """Within the block, each forward calls `reduce(layer, inputs)` as soon as a layer's attention has run, with
    what its attention function received (`hub.capture(layers=[layer], inputs=True)`), and keeps nothing of
    it: one layer's queries and keys at a time. Layers whose heads were all removed are skipped.

    Example:
        >>> import attnreg
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("gpt2"); hub = attnreg.attach(model)
        >>> seen = []
        >>> with torch.no_grad(), layer_by_layer(hub, lambda layer, inputs: seen.append((layer, inputs.causal))):
        ...     _ = model(input_ids=torch.tensor([[5, 6, 7]]))
        >>> seen
        [(0, True), (1, True)]
    """
    pending: dict[int, tuple] = {}
    handles = []

    def before(layer: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            context = hub.capture(layers=[layer], inputs=True)
            pending[layer] = (context, context.__enter__())

        return hook

    def after(layer: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, output: object) -> None:
            context, record = pending.pop(layer)
            context.__exit__(None, None, None)
            if layer not in record:
                if hub.layers[layer].num_heads == 0:
                    return  # every head removed: no attention ran
                raise RuntimeError(f"layer {layer}'s attention module ran without calling its attention function")
            reduce(layer, record[layer])

        return hook

    for layer in range(hub.num_layers):
        attention = hub.attention(layer)
        handles.append(attention.register_forward_pre_hook(before(layer)))
        handles.append(attention.register_forward_hook(after(layer)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for context, _ in pending.values():  # a forward that raised inside a layer
            context.__exit__(None, None, None)
