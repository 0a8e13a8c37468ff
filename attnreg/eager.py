"""Attention as attnreg computes it: `attention_forward`, the function the hub registers with transformers (a
layer nobody asked about runs on transformers' SDPA function unchanged; a captured layer, a temperature, Gemma 2's
softcap or gpt-oss's sinks run eager attention), and the eager maths it uses (`attention_probabilities`,
`attention_scores`, `causal_mask`), which the blockwise losses and the analysis take as their reference.

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

from attnreg.keywords import IGNORED_KWARGS, check_kwargs
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
