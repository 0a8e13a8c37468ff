"""Attention as attnreg computes it: `attention_forward`, the function the hub registers with transformers (a
layer nobody asked about runs on transformers' SDPA function unchanged; a captured layer, a temperature, Gemma 2's
softcap or gpt-oss's sinks run eager attention), and the eager maths it uses (`attention_probabilities`,
`attention_scores`, `causal_mask`), which the blockwise losses and the analysis take as their reference; and
`Packing`/`find_packing`, which keep documents packed in one row (padding-free batches) apart on every layer.

Example:
    >>> import torch
    >>> query = key = torch.zeros(1, 1, 2, 4)                          # equal scores: the causal rows share evenly
    >>> attention_probabilities(query, key, None, scaling=0.5, causal=True)[0, 0].tolist()
    [[1.0, 0.0], [0.5, 0.5]]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from attnreg.keywords import IGNORED_KWARGS, PACKING_KWARG, check_kwargs
from attnreg.records import STATE_ATTR, TEMPERATURE, LayerInputs, LayerState


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The registered "attnreg" attention function (see transformers' AttentionInterface).

    Example:
        >>> from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        >>> from attnreg.hub import attach
        >>> from attnreg.tiny import tiny_model
        >>> hub = attach(tiny_model("bert")); ALL_ATTENTION_FUNCTIONS["attnreg"] is attention_forward
        True
        >>> query = key = value = torch.randn(1, 4, 3, 8)                    # [batch, heads, tokens, head_dim]
        >>> with hub.capture(layers=[0]) as probs:                          # layer 0 captured, layer 1 on SDPA
        ...     captured, weights = attention_forward(hub.attention(0), query, key, value, None)
        >>> plain, none = attention_forward(hub.attention(1), query, key, value, None)
        >>> captured.shape, weights is probs[0], none, torch.allclose(captured, plain, atol=1e-6)
        (torch.Size([1, 3, 4, 8]), True, None, True)
        >>> attention_forward(hub.attention(1), query, key, value, None, alibi=torch.zeros(4))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        NotImplementedError: attnreg's attention function received keyword argument(s) ['alibi'] from \
BertSelfAttention (model_type='bert'), which it does not implement: ...
    """
    packing: Packing | None = kwargs.pop(PACKING_KWARG, None)  # several documents per row: kept apart below
    softcap = kwargs.pop("softcap", None)  # Gemma 2's tanh cap of the logits: implemented on every path
    sinks = kwargs.pop("s_aux", None)  # gpt-oss's learned sink logit per head: implemented on every path
    if kwargs.keys() - IGNORED_KWARGS:
        check_kwargs(module, kwargs)
    if softcap is not None and sinks is not None:  # no model has both: whether the cap applies to the sink is unknown
        raise NotImplementedError(
            f"attnreg's attention function received both softcap and s_aux from {type(module).__name__} "
            f"(model_type={getattr(getattr(module, 'config', None), 'model_type', None)!r}): it implements each alone"
        )
    state: LayerState | None = getattr(module, STATE_ATTR, None)
    if state is None and sinks is not None:  # an untracked module with sinks: SDPA would drop them, run eager
        causal = getattr(module, "is_causal", False) if is_causal is None else is_causal
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        probs = attention_probabilities(query, key, attention_mask, scaling, causal=causal, sinks=sinks)
        return _attend(probs, value, dropout), probs
    if state is None:  # an attention module the hub does not track (cross-attention, say)
        capped = {} if softcap is None else {"softcap": softcap}  # SDPA refuses it, as without attnreg
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **capped,
            **kwargs,
        )
    if packing is not None:  # every path below (SDPA, capture, blockwise inputs) reads the block-diagonal mask
        causal = getattr(module, "is_causal", False) if is_causal is None else is_causal
        attention_mask = packing.mask(attention_mask, query.shape[2], key.shape[2], causal, query.device)
        packing.seen.add(state.index)
    if module.training and state.dropout is not None:
        dropout = state.dropout
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    temperature = getattr(module, TEMPERATURE, None)
    replay = state.replaying_capture()
    probs_records = [record for record in state.records if not record.inputs]
    if state.records and len(probs_records) < len(state.records):
        causal = getattr(module, "is_causal", False) if is_causal is None else is_causal
        scaled = query if temperature is None else query / temperature.to(query.dtype).reshape(1, -1, 1, 1)
        scaled_sinks = sinks if sinks is None or temperature is None else sinks / temperature.to(sinks.dtype)
        inputs = LayerInputs(scaled, key, attention_mask, scaling, causal, softcap, scaled_sinks)
        for record in state.records:
            if record.inputs:
                record._add(state, inputs)
    if not probs_records and not replay and softcap is None and sinks is None:  # else eager: SDPA has neither
        if temperature is not None:
            query = query / temperature.to(query.dtype).reshape(1, -1, 1, 1)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    causal = getattr(module, "is_causal", False) if is_causal is None else is_causal
    probs = attention_probabilities(query, key, attention_mask, scaling, temperature, causal, softcap, sinks)
    if replay:
        state.pending_recomputes -= 1
    else:
        for record in probs_records:
            record._add(state, probs, attention_mask, sink=sinks is not None)
        if torch.is_grad_enabled() and state.will_be_replayed():
            state.pending_recomputes += 1
    return _attend(probs, value, dropout), probs


def _attend(probs: torch.Tensor, value: torch.Tensor, dropout: float) -> torch.Tensor:
    """Eager attention's output `[B, T, H, d]` from its probabilities (dropout after them, as eager applies it)."""
    weights = F.dropout(probs, p=dropout, training=True) if dropout > 0 else probs
    output = torch.matmul(weights, repeat_kv(value, probs.shape[1] // value.shape[1]))
    return output.transpose(1, 2).contiguous()


def attention_probabilities(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    temperature: torch.Tensor | None = None,
    causal: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention `[B, H, T, S]` as eager attention computes it, before dropout.

    `attention_mask` is transformers' SDPA mask: boolean (True = attend), additive float, or None;
    with `causal` and more than one query, keys after each query's position are masked as well. `sinks`
    (gpt-oss, `[H]`) is a logit per head joining each row's softmax as one more column, divided by `temperature`
    as the others are and dropped after the softmax, as eager gpt-oss does: the rows sum to less than 1.

    Example:
        >>> query = key = torch.zeros(1, 1, 3, 4)                           # equal scores everywhere
        >>> attention_probabilities(query, key, None, scaling=0.5, causal=True)[0, 0]
        tensor([[1.0000, 0.0000, 0.0000],
                [0.5000, 0.5000, 0.0000],
                [0.3333, 0.3333, 0.3333]])
        >>> attention_probabilities(query, key, None, scaling=0.5, causal=True, sinks=torch.zeros(1))[0, 0]
        tensor([[0.5000, 0.0000, 0.0000],
                [0.3333, 0.3333, 0.0000],
                [0.2500, 0.2500, 0.2500]])
    """
    scores = attention_scores(query, key, attention_mask, scaling, temperature, causal, softcap)
    if sinks is None:
        return F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1)
    if temperature is not None:
        sink = sink / temperature.to(scores.dtype).reshape(1, -1, 1, 1)
    scores = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
    return F.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1].to(query.dtype)


def attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    temperature: torch.Tensor | None = None,
    causal: bool = False,
    softcap: float | None = None,
) -> torch.Tensor:
    """Masked attention logits `[B, H, T, S]` (masked keys at the dtype's minimum): what the softmax of
    `attention_probabilities` takes. Arguments as there.

    Example:
        >>> query, key = torch.ones(1, 2, 2, 4), torch.ones(1, 1, 2, 4)     # 2 query heads share 1 key head
        >>> mask = torch.tensor([True, False])                               # the second key is masked
        >>> scores = attention_scores(query, key, mask, scaling=0.5, temperature=torch.tensor([1.0, 2.0]))
        >>> scores.shape, scores[0, :, 0, 0].tolist()                        # q.k = 4, times 0.5, / temperature
        (torch.Size([1, 2, 2, 2]), [2.0, 1.0])
        >>> bool((scores[..., 1] == torch.finfo(torch.float32).min).all())
        True
    """
    key = repeat_kv(key, query.shape[1] // key.shape[1])
    # In-place from here on: none of these ops needs its input for backward, and every attention-sized
    # allocation costs time at long sequence lengths.
    scores = torch.matmul(query, key.transpose(2, 3)).mul_(scaling)
    if temperature is not None:
        scores.div_(temperature.to(scores.dtype).reshape(-1, 1, 1))
    if softcap is not None:  # Gemma 2: logits capped with tanh before the mask
        scores = torch.tanh(scores / softcap) * softcap  # not in place: tanh keeps its output for backward
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores.masked_fill_(attention_mask.logical_not(), torch.finfo(scores.dtype).min)
        else:
            scores.add_(attention_mask)
    if causal and query.shape[2] > 1:  # on top of a mask too: keys after the query stay masked
        later = causal_mask(query.shape[2], key.shape[2], query.device).logical_not()
        scores.masked_fill_(later, torch.finfo(scores.dtype).min)
    return scores


def causal_mask(queries: int, keys: int, device: torch.device | None = None) -> torch.Tensor:
    """`[T, S]` True where query i may attend to key j: j <= i + S - T (the queries are the last T).

    Example:
        >>> causal_mask(2, 3).int()                                    # 2 new queries after 1 cached key
        tensor([[1, 1, 0],
                [1, 1, 1]], dtype=torch.int32)
    """
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)


class Packing:
    """Several documents packed in the rows of one forward (padding-free batches: TRL's `padding_free=True`,
    transformers' `DataCollatorWithFlattening`), as `find_packing` reads them off `position_ids`. `segments` `[B or
    1, T]` numbers each token's document; `mask` keeps every layer's queries to keys of their own document, so the
    attention (and every term on it) equals that of the documents run separately. `seen`: the layers it reached.

    Example:
        >>> packing = Packing(torch.tensor([[0, 0, 1, 1]]))
        >>> packing.mask(None, 4, 4, causal=True, device=None)[0, 0].int()
        tensor([[1, 0, 0, 0],
                [1, 1, 0, 0],
                [0, 0, 1, 0],
                [0, 0, 1, 1]], dtype=torch.int32)
        >>> packing.restart()                                          # (row, position) of the first restart
        (0, 2)
    """

    def __init__(self, segments: torch.Tensor, implementation: str | None = None) -> None:
        self.segments, self.implementation = segments, implementation
        self.seen: set[int] = set()
        self._blocks: dict[tuple[bool, torch.device | None], torch.Tensor] = {}
        self._last: tuple[torch.Tensor | None, bool, torch.Tensor] | None = None

    def mask(
        self,
        attention_mask: torch.Tensor | None,
        queries: int,
        keys: int,
        causal: bool,
        device: torch.device | None,
    ) -> torch.Tensor:
        """The layer's SDPA mask `attention_mask` (boolean, additive float or None) restricted to each query's own
        document (and causal for `causal` layers): boolean `[B, 1, T, T]` for a boolean or absent mask. Built once
        per forward and reused by every layer that receives the same mask."""
        tokens = self.segments.shape[-1]
        if queries != tokens or keys != tokens:
            raise NotImplementedError(
                self.message(
                    f"a layer received {queries} queries and {keys} keys for rows of {tokens} tokens (a cache holding "
                    "earlier tokens?), so attnreg cannot tell which document each key belongs to."
                )
            )
        last = self._last
        if last is not None and last[0] is attention_mask and last[1] == causal and last[2].device == device:
            return last[2]
        block = self._blocks.get((causal, device))
        if block is None:
            segments = self.segments.to(device)
            block = segments[:, None, :, None] == segments[:, None, None, :]
            if causal:
                block = block & causal_mask(tokens, tokens, device)
            self._blocks[causal, device] = block
        if attention_mask is None:
            merged = block
        elif attention_mask.dtype == torch.bool:
            merged = attention_mask[..., :keys] & block
        else:
            merged = attention_mask[..., :keys].masked_fill(~block, torch.finfo(attention_mask.dtype).min)
        self._last = (attention_mask, causal, merged)
        return merged

    def restart(self) -> tuple[int, int]:
        """(row, position) of the first token that starts a document after a row's first (for messages)."""
        row, position = (self.segments.diff(dim=-1) != 0).nonzero()[0].tolist()
        return row, position + 1

    def message(self, problem: str) -> str:
        """A refusal naming where position_ids restart, the attention implementation, `problem` and the fixes."""
        row, position = self.restart()
        return (
            f"position_ids restart at row {row}, position {position} without a 4-D attention mask: several documents "
            "are packed in one row (padding-free batches: TRL padding_free=True, DataCollatorWithFlattening). attnreg "
            "keeps such documents apart with a block-diagonal mask on every layer, but here it cannot: "
            f"{problem} Attention implementation: 'attnreg' (the model's own before attnreg.attach: "
            f"{self.implementation!r}); eager and SDPA would let each document attend to the ones before it, and "
            "attention terms would supervise that. Pad instead (TRL padding_free=False, DataCollatorWithPadding or "
            "DataCollatorForLanguageModeling), or train without attnreg on a flash-attention model on a GPU, whose "
            "varlen kernel reads position_ids."
        )


def find_packing(
    position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None, implementation: str | None = None
) -> Packing | None:
    """A `Packing` where `position_ids` `[B or 1, T]` restart inside a row (a token whose position is not its
    predecessor's plus one starts a new document), else None. Only with a 2-D `attention_mask` `[B, S]` or none (a
    4-D mask says itself what each query sees), and only restarts at real tokens after a row's first: left or right
    padding (positions of pads filled with 1, as `generate` fills them) is no packing. Reads one value back from the
    device (once per forward, where `position_ids` are passed with more than one token).

    Example:
        >>> find_packing(torch.tensor([[0, 1, 2, 0, 1]])).segments               # two documents
        tensor([[0, 0, 0, 1, 1]])
        >>> find_packing(torch.tensor([[1, 1, 0, 1, 2]]), torch.tensor([[0, 0, 1, 1, 1]])) is None  # left padding
        True
    """
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[-1] < 2:
        return None
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        return None
    starts = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if attention_mask is not None:
        kept = attention_mask[:, -position_ids.shape[-1] :].to(device=starts.device, dtype=torch.bool)
        starts = starts & kept[:, 1:] & (kept[:, :-1].cumsum(-1) > 0)
    if not bool(starts.any()):
        return None
    segments = F.pad(starts.long(), (1, 0)).cumsum(-1)
    return Packing(segments, implementation)
