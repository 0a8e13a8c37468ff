"""The attention hub: the one place that touches transformers' attention dispatch.

`attach(model)` registers an "attnreg" attention implementation (and its mask function) with
transformers, switches the model to it and returns an `AttentionHub`. Layers nobody asked about run
through transformers' own SDPA function unchanged; only captured layers materialize probabilities.

Example:
    >>> import torch, attnreg
    >>> from transformers import BertConfig, BertModel
    >>> model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                              intermediate_size=64))
    >>> hub = attnreg.attach(model)
    >>> with hub.capture(layers=[1]) as probs:
    ...     _ = model(input_ids=torch.tensor([[1, 2, 3]]))
    >>> probs[1].shape
    torch.Size([1, 4, 3, 3])
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from attnreg import compat
from attnreg.families import Family, UnsupportedModelError, detect_family
from attnreg.weights import lora_factors, out_features, scale_input_columns, scale_output_rows

IMPLEMENTATION = "attnreg"
GATE = "attnreg_gate"
TEMPERATURE = "attnreg_temperature"
_HUB_ATTR = "_attnreg_hub"
_STATE_ATTR = "_attnreg_state"
_SAVE_ATTR = "save_pretrained"


@dataclass(frozen=True)
class LayerInfo:
    """Head layout of one attention layer, read from the current weight shapes.

    Example:
        >>> import attnreg
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("llama"); hub = attach(model)       # 4 query heads sharing 2 key/value heads
        >>> hub.layers[1]
        LayerInfo(index=1, num_heads=4, num_kv_heads=2, head_dim=8)
        >>> _ = attnreg.methods.pruning.prune_heads(model, {1: [0, 1]})     # one whole key/value group
        >>> hub.layers[1]
        LayerInfo(index=1, num_heads=2, num_kv_heads=1, head_dim=8)
    """

    index: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class _LayerState:
    """Per-layer settings, kept on the attention module so they follow `copy.deepcopy`.

    `pending_recomputes` counts captured forwards of a gradient-checkpointed block whose backward has
    not yet replayed them: the replay must take the same (materialized) path, or torch's checkpoint
    finds different saved tensors.
    """

    index: int
    block: nn.Module
    dropout: float | None = None
    records: list[AttentionRecord] = field(default_factory=list)
    pending_recomputes: int = 0
    projection: nn.Module | None = None  # the output projection that carries the hub's hooks

    def replaying_capture(self) -> bool:
        return self.pending_recomputes > 0 and compat.graph_task_id() != -1

    def will_be_replayed(self) -> bool:
        return bool(getattr(self.block, "gradient_checkpointing", False)) and self.block.training


@dataclass(frozen=True)
class LayerInputs:
    """What one layer's attention function received, for losses that recompute what they need in blocks
    (`attnreg.blockwise`): `query` `[B, H, T, d]` (divided by the hub's temperature), `key` `[B, H_kv, S, d]`
    (after RoPE, grouped-query heads not repeated), the SDPA `attention_mask`, `scaling`, `causal`, Gemma 2's logit
    `softcap`, and gpt-oss's per-head sink logits `sinks` `[H]` (divided by the hub's temperature, as the query is),
    which join each row's softmax denominator as one more outcome.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> hub = attach(tiny_model("llama"))                     # 4 query heads, 2 key/value heads of 8
        >>> with hub.capture(layers=[0], inputs=True) as record:
        ...     _ = hub.model(input_ids=torch.tensor([[5, 6, 7]]))
        >>> inputs = record[0]
        >>> inputs.query.shape, inputs.key.shape, inputs.scaling, inputs.causal, inputs.requires_grad
        (torch.Size([1, 4, 3, 8]), torch.Size([1, 2, 3, 8]), 0.35355, True, True)
    """

    query: torch.Tensor
    key: torch.Tensor
    attention_mask: torch.Tensor | None
    scaling: float
    causal: bool
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def requires_grad(self) -> bool:
        return self.query.requires_grad or self.key.requires_grad


class AttentionRecord(Mapping[int, torch.Tensor]):
    """Attention probabilities `[B, H, T, S]` recorded by `AttentionHub.capture`, keyed by layer (or,
    with `inputs=True`, each layer's `LayerInputs`, while the layer itself runs on SDPA).

    `record[layer]` is the latest forward pass; `record.calls(layer)` lists every pass in the block
    (generation makes one per token).

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("gpt2"); hub = attach(model)
        >>> with hub.capture(layers=[1]) as record:
        ...     _ = model(input_ids=torch.tensor([[5, 6, 7]]))
        ...     _ = model(input_ids=torch.tensor([[8, 9]]))
        >>> list(record), record[1].shape, [tuple(probs.shape) for probs in record.calls(1)]   # the latest; every pass
        ([1], torch.Size([1, 4, 2, 2]), [(1, 4, 3, 3), (1, 4, 2, 2)])
        >>> record[0]
        Traceback (most recent call last):
        ...
        KeyError: 'no attention recorded for layer 0; captured layers: [1], with a forward pass so far: [1]'
    """

    def __init__(
        self, layers: tuple[int, ...], require_grad: bool = False, inputs: bool = False, skip_no_grad: bool = False
    ) -> None:
        self.layers = layers
        self.require_grad = require_grad
        self.inputs = inputs
        self.skip_no_grad = skip_no_grad
        self.skipped = 0  # forwards under torch.no_grad() left out (skip_no_grad)
        self._calls: dict[int, list[torch.Tensor | LayerInputs]] = {}
        self._masks: dict[int, list[torch.Tensor | None]] = {}
        self._sinks: dict[int, list[bool]] = {}

    def __getitem__(self, layer: int) -> torch.Tensor:
        if layer not in self._calls:
            raise KeyError(
                f"no attention recorded for layer {layer}; captured layers: {list(self.layers)}, "
                f"with a forward pass so far: {sorted(self._calls)}"
                + (f"; {self.skipped} forwards under torch.no_grad() were left out" if self.skipped else "")
            )
        return self._calls[layer][-1]

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._calls))

    def __len__(self) -> int:
        return len(self._calls)

    def calls(self, layer: int) -> list[torch.Tensor]:
        return list(self._calls.get(layer, []))

    def attention_mask(self, layer: int, call: int = -1) -> torch.Tensor | None:
        """The SDPA mask `layer` received on its latest pass (`call`: the one of `calls(layer)`), None where SDPA
        needed none: the keys each query row may see, sliding windows included, for
        `attnreg.losses.attention_entropy(..., layer_mask=)`.

        Example:
            >>> from attnreg.tiny import tiny_model
            >>> hub = attach(tiny_model("gpt2"))
            >>> with hub.capture(layers=[0]) as record:
            ...     _ = hub.model(input_ids=torch.tensor([[5, 6, 7]]), attention_mask=torch.tensor([[1, 1, 0]]))
            >>> record.attention_mask(0).shape
            torch.Size([1, 1, 3, 3])
        """
        captured = self[layer] if call == -1 else self._calls[layer][call]
        return captured.attention_mask if isinstance(captured, LayerInputs) else self._masks[layer][call]

    def has_sink(self, layer: int, call: int = -1) -> bool:
        """Whether `layer`'s softmax had a sink logit per head on its latest pass (`call`: the one of `calls(layer)`):
        gpt-oss's, where the recorded rows sum to less than 1, the sink taking the rest. Pass it on as
        `attnreg.losses.attention_entropy(..., sink=)`, which then counts the sink as one more outcome.

        Example:
            >>> from attnreg.tiny import tiny_model
            >>> hub = attach(tiny_model("gpt_oss"))
            >>> with hub.capture(layers=[0]) as record:
            ...     _ = hub.model(input_ids=torch.tensor([[5, 6, 7]]))
            >>> record.has_sink(0), bool((record[0].sum(-1) < 1).all())
            (True, True)
        """
        captured = self[layer] if call == -1 else self._calls[layer][call]
        return captured.sinks is not None if isinstance(captured, LayerInputs) else self._sinks[layer][call]

    def _add(
        self,
        state: _LayerState,
        probs: torch.Tensor | LayerInputs,
        attention_mask: torch.Tensor | None = None,
        sink: bool = False,
    ) -> None:
        if not probs.requires_grad:
            reentrant = state.will_be_replayed() and not torch.is_grad_enabled()
            if self.skip_no_grad and not reentrant and not torch.is_grad_enabled():
                self.skipped += 1  # a forward no loss is meant for (a trainer's extra no-grad metrics pass)
                return
            if reentrant or self.require_grad:
                raise RuntimeError(
                    f"attention of layer {state.index} was computed without autograd, so a loss on it would do "
                    "nothing. "
                    + (
                        "The model uses gradient checkpointing with use_reentrant=True, whose first forward runs "
                        "under no_grad: enable it with gradient_checkpointing_kwargs={'use_reentrant': False}."
                        if reentrant
                        else "The forward pass ran under torch.no_grad() (or the model's weights are frozen)."
                    )
                )
        self._calls.setdefault(state.index, []).append(probs)
        self._masks.setdefault(state.index, []).append(attention_mask)
        self._sinks.setdefault(state.index, []).append(sink)


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
        _check_kwargs(module, kwargs)
    if softcap is not None and sinks is not None:  # no model has both: whether the cap applies to the sink is unknown
        raise NotImplementedError(
            f"attnreg's attention function received both softcap and s_aux from {type(module).__name__} "
            f"(model_type={getattr(getattr(module, 'config', None), 'model_type', None)!r}): it implements each alone"
        )
    state: _LayerState | None = getattr(module, _STATE_ATTR, None)
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


OWN_BATCH_KEYS = "attnreg_"  # attnreg's own batch entries (a syntax prior) that a model's **kwargs pass along
IGNORED_KWARGS = frozenset(
    {
        # Read by the layer or the model, or meaningless for the attention function itself:
        "position_ids",  # positions are already in q and k (RoPE); packed sequences are in the mask
        "use_cache",
        "cache_position",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "num_items_in_batch",  # the Trainer's loss normaliser, forwarded by every **kwargs
        "token_type_ids",
        "encoder_hidden_states",  # BERT-like self-attention: keys and values are already projected
        "encoder_attention_mask",
        "seq_idx",
        # The 4-D mask the layer receives already admits only the window (SDPA ignores the keyword too).
        "sliding_window",
        # Flash-attention varlen metadata: SDPA ignores it, the mask carries packed sequences.
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "deterministic",  # ModernBERT's flash-attention determinism flag
    }
)
"""Keyword arguments an attention function may receive and ignore: every path of the hub (SDPA hand-off,
capture, blockwise inputs) computes what eager attention computes without them. Two more are implemented on every
path: `softcap` (Gemma 2) and `s_aux` (gpt-oss's sinks). Any other keyword with a value (`position_bias`, `alibi`,
a typo) is refused by `attention_forward`, naming it."""


def _check_kwargs(module: nn.Module, kwargs: dict) -> None:
    """Raise for a keyword argument the hub does not implement (a `None` value is accepted: nothing to do)."""
    if kwargs.get("head_mask") is not None:
        raise ValueError(_HEAD_MASK_MESSAGE)
    unknown = sorted(
        key
        for key in kwargs.keys() - IGNORED_KWARGS
        if kwargs[key] is not None and key != "head_mask" and not key.startswith(OWN_BATCH_KEYS)
    )
    if unknown:
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        raise NotImplementedError(
            f"attnreg's attention function received keyword argument(s) {unknown} from {type(module).__name__} "
            f"(model_type={model_type!r}), which it does not implement: capture, temperature, gates and the "
            "blockwise losses would compute something else than the model. Known keywords it may ignore: "
            f"{sorted(IGNORED_KWARGS)}."
        )


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


class AttentionHub:
    """Per-model access to what each attention head does; created by `attnreg.attach`.

    Example:
        >>> import attnreg
        >>> from attnreg.tiny import tiny_model
        >>> hub = attnreg.attach(tiny_model("llama"))     # grouped-query attention, 2 layers x 4 heads
        >>> hub.num_layers, hub.gate(0).tolist()          # a trainable per-head gate, initialised to 1
        (2, [1.0, 1.0, 1.0, 1.0])
        >>> hub.set_temperature(2.0, layers=[0])
        >>> hub.set_attention_dropout(0.1)
        >>> hub.temperature(0).tolist(), hub.attention_dropout(1)
        ([2.0, 2.0, 2.0, 2.0], 0.1)
    """

    def __init__(self, model: nn.Module, family: Family, previous_implementation: str) -> None:
        self.model = model
        self.family = family
        self.previous_implementation = previous_implementation

    # -- layout -------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.family.blocks(self.model))

    @property
    def layers(self) -> list[LayerInfo]:
        """Head layout per layer, from the current shapes (so it stays right after pruning)."""
        infos = []
        for index in range(self.num_layers):
            attention = self.attention(index)
            num_heads, num_kv_heads = self.family.head_counts(attention)
            infos.append(LayerInfo(index, num_heads, num_kv_heads, self.family.head_dim(attention)))
        return infos

    def attention(self, layer: int) -> nn.Module:
        """The attention module of `layer` (the one transformers passes to attention functions)."""
        return self.family.attention_module(self.model, self.check_layer(layer))

    def check_layer(self, layer: int, argument: str = "layer") -> int:
        """Return `layer` if it indexes an attention layer, else raise an error naming `argument`."""
        count = self.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < count:
            raise IndexError(
                f"{argument}={layer!r} is out of range: {type(self.model).__name__} has {count} attention "
                f"layers (0 to {count - 1})"
            )
        return layer

    def resolve_layers(self, layers: int | Iterable[int] | None, argument: str = "layers") -> tuple[int, ...]:
        """All layers for None, else the given layers, each checked."""
        if layers is None:
            return tuple(range(self.num_layers))
        if isinstance(layers, int):
            layers = [layers]
        return tuple(sorted({self.check_layer(layer, argument) for layer in layers}))

    # -- capture ------------------------------------------------------------------------------
    @contextmanager
    def capture(
        self,
        layers: int | Iterable[int] | None = None,
        require_grad: bool = False,
        inputs: bool = False,
        skip_no_grad: bool = False,
    ) -> Iterator[AttentionRecord]:
        """Record attention probabilities of `layers` (all for None) during the block's forward passes.

        The probabilities keep their autograd graph, so a loss can be built on them. With
        `require_grad=True` a forward without autograd raises; by default only the silent case does
        (reentrant gradient checkpointing, whose first forward runs under no_grad); with `skip_no_grad=True`
        forwards under `torch.no_grad()` are left out instead (a trainer's extra metrics pass). With `inputs=True`
        the layers stay on SDPA and the record holds what they received (`LayerInputs`), for the
        blockwise losses of `attnreg.blockwise`, which keep nothing of size `[T, S]`.
        """
        self._check_active()
        chosen = self.resolve_layers(layers)
        record = AttentionRecord(chosen, require_grad, inputs, skip_no_grad)
        states = [self._state(layer) for layer in chosen]
        for state in states:
            state.records.append(record)
        try:
            yield record
        finally:
            for state in states:
                state.records.remove(record)

    # -- gates --------------------------------------------------------------------------------
    def gate(self, layer: int) -> nn.Parameter:
        """The trainable per-head gate `[num_heads]` of `layer`, created at 1 on first use.

        It scales each head's context before the output projection (a forward pre-hook there, so it
        works with or without capture) and is saved in the model's state_dict.
        """
        attention = self.attention(layer)
        existing = getattr(attention, GATE, None)
        if existing is not None:
            return existing
        num_heads, _ = self.family.head_counts(attention)
        weight = self.family.out_projection(self.model, layer).weight
        gate = nn.Parameter(torch.ones(num_heads, dtype=weight.dtype, device=weight.device))
        self._install_gate(layer, gate)
        return gate

    @property
    def gates(self) -> dict[int, nn.Parameter]:
        """The gates created so far, by layer."""
        found = {}
        for layer in range(self.num_layers):
            gate = getattr(self.attention(layer), GATE, None)
            if gate is not None:
                found[layer] = gate
        return found

    def install_gate(self, layer: int, gate: nn.Parameter | nn.Module) -> None:
        """Install a gate of your own on `layer`: a parameter `[num_heads]`, or a module whose call
        returns one (a hard-concrete gate that samples in training, say). Its eval-mode value is what
        `remove_gate` and `detach` fold."""
        if getattr(self.attention(layer), GATE, None) is not None:
            raise ValueError(f"layer {layer} already has a gate; remove it first with hub.remove_gate({layer})")
        self._install_gate(layer, gate)

    def remove_gate(self, layer: int, fold: bool = True) -> None:
        """Remove the gate of `layer`. With `fold`, its value is first folded into the output projection's
        input columns, so the model computes the same function. No-op without a gate."""
        attention = self.attention(layer)
        gate = getattr(attention, GATE, None)
        if gate is None:
            return
        projection = self.family.out_projection(self.model, layer)
        if fold:
            with torch.no_grad():
                values = gate_values(gate, deterministic=True)
            scale_input_columns(projection, values.repeat_interleave(self.family.head_dim(attention)))
        delattr(attention, GATE)

    def _install_gate(self, layer: int, gate: nn.Parameter | nn.Module) -> None:
        attention = self.attention(layer)
        if isinstance(gate, nn.Module):
            attention.add_module(GATE, gate)
        else:
            attention.register_parameter(GATE, gate)

    # -- temperature and dropout ------------------------------------------------------------------
    def set_temperature(self, value: float | torch.Tensor | None, layers: int | Iterable[int] | None = None) -> None:
        """Divide attention logits by `value` (a scalar, or one per head) before the softmax (gpt-oss's sink
        logits too: the temperature of the whole softmax).

        Applies in training, inference and generation; `None` removes it. Saved in the state_dict.
        """
        for layer in self.resolve_layers(layers):
            attention = self.attention(layer)
            if value is None:
                if hasattr(attention, TEMPERATURE):
                    delattr(attention, TEMPERATURE)
                continue
            num_heads, _ = self.family.head_counts(attention)
            temperature = torch.as_tensor(value, dtype=torch.float32).detach().clone()
            if temperature.numel() not in (1, num_heads) or temperature.dim() > 1:
                raise ValueError(
                    f"temperature must be a scalar or have one value per head ({num_heads} in layer {layer}), "
                    f"got shape {tuple(temperature.shape)}"
                )
            if not torch.all(temperature > 0):
                raise ValueError(f"temperature must be > 0, got {temperature.tolist()}")
            weight = self.family.out_projection(self.model, layer).weight
            temperature = temperature.reshape(-1).expand(num_heads).clone().to(weight.device)
            if hasattr(attention, TEMPERATURE):
                delattr(attention, TEMPERATURE)
            attention.register_buffer(TEMPERATURE, temperature)

    def temperature(self, layer: int) -> torch.Tensor | None:
        return getattr(self.attention(layer), TEMPERATURE, None)

    def set_attention_dropout(self, p: float | None, layers: int | Iterable[int] | None = None) -> None:
        """Use attention dropout `p` in training (read at every forward); `None` restores the model's own."""
        if p is not None and not 0.0 <= p < 1.0:
            raise ValueError(f"attention dropout p must be in [0, 1), got {p}")
        for layer in self.resolve_layers(layers):
            self._state(layer).dropout = None if p is None else float(p)

    def attention_dropout(self, layer: int) -> float:
        """The attention dropout `layer` uses in training."""
        state = self._state(layer)
        if state.dropout is not None:
            return state.dropout
        return self.family.attention_dropout(self.attention(layer))

    # -- internals ------------------------------------------------------------------------------
    def _state(self, layer: int) -> _LayerState:
        return getattr(self.attention(layer), _STATE_ATTR)

    def _check_active(self) -> None:
        _check_implementation(self.model)


class _GateHook:
    """Forward pre-hook on an output projection: scales each head's slice of its input by the gate.
    (`attnreg_hook`: the hub moves it to a module that takes the projection's place, a PEFT adapter layer.)

    Installed on every layer at `attach`, whether it has a gate or not: `torch.compile` guards on what
    the hook reads, so a gate created after the first compiled call recompiles instead of being ignored
    (a hook added after compiling would be).
    """

    attnreg_hook = True

    def __init__(self, attention: nn.Module) -> None:
        self.attention = attention

    def __call__(self, projection: nn.Module, args: tuple) -> tuple | None:
        gate = getattr(self.attention, GATE, None)
        if gate is None:
            return None
        gate = gate_values(gate)
        if gate.numel() == 0:  # a layer whose heads were all pruned
            return None
        context = args[0]
        heads = context.view(*context.shape[:-1], gate.shape[0], -1) * gate.to(context.dtype)[:, None]
        return (heads.view(context.shape), *args[1:])


def gate_values(gate: nn.Parameter | nn.Module, deterministic: bool = False) -> torch.Tensor:
    """The per-head values of a gate: the parameter itself, or what a gate module returns (in eval
    mode when `deterministic`).

    Example:
        >>> gate_values(nn.Parameter(torch.tensor([1.0, 0.0]))).tolist()
        [1.0, 0.0]
    """
    if not isinstance(gate, nn.Module):
        return gate
    if not deterministic:
        return gate()
    training = gate.training
    gate.eval()
    try:
        return gate()
    finally:
        gate.train(training)


_HEAD_MASK_MESSAGE = (
    "head_mask= was passed to a model under attnreg. transformers v5 no longer supports head masks and "
    "silently ignores them; use hub.gate(layer) (set a head's gate to 0 to mask it) or attnreg.methods.pruning."
)


def _check_implementation(model: nn.Module) -> None:
    current = compat.attention_implementation(model.config)
    if current != IMPLEMENTATION:
        raise RuntimeError(
            f"attnreg is attached to {type(model).__name__}, but its attention implementation was changed to "
            f"{current!r} after attnreg.attach, so capture, temperature and dropout settings would be ignored. "
            f"Call model.set_attn_implementation({IMPLEMENTATION!r}) again, or attnreg.detach(model) first."
        )


def _model_forward_guard(model: nn.Module, args: tuple, kwargs: dict) -> None:
    if kwargs.get("head_mask") is not None:
        raise ValueError(_HEAD_MASK_MESSAGE)
    _check_implementation(model)
    _follow_projections(getattr(model, _HUB_ATTR))


def _follow_projections(hub: AttentionHub) -> None:
    """Keep attnreg's hooks (gate, silencing) and buffers on whatever module holds each output projection's
    place now: a PEFT adapter layer wrapped around it after `attach` (so the gate scales the input of the
    adapter's path too), or the plain projection put back by `merge_and_unload()`."""
    family, model = hub.family, hub.model
    for layer in range(hub.num_layers):
        state: _LayerState = getattr(family.attention_module(model, layer), _STATE_ATTR)
        current = family.out_projection(model, layer)
        if current is state.projection:
            continue
        old, state.projection = state.projection, current
        if old is None:
            continue
        hooks = compat.forward_pre_hooks(old)
        for key in [key for key, hook in hooks.items() if getattr(hook, "attnreg_hook", False)]:
            current.register_forward_pre_hook(hooks.pop(key))
        buffers = compat.buffers_of(old)
        for name in [name for name in buffers if name.startswith("attnreg_")]:
            current.register_buffer(name, buffers.pop(name), persistent=False)


def _load_state_dict_pre_hook(model: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Create gates and temperatures present in a state_dict being loaded, so it loads strictly."""
    hub: AttentionHub | None = getattr(model, _HUB_ATTR, None)
    if hub is None:
        return
    for layer in range(hub.num_layers):
        path = prefix + hub.family.module_path(model, layer, hub.family.attention)
        gate = state_dict.get(f"{path}.{GATE}")
        if gate is not None and hub.gates.get(layer) is None:
            weight = hub.family.out_projection(model, layer).weight
            hub._install_gate(layer, nn.Parameter(torch.ones(gate.shape, dtype=weight.dtype, device=weight.device)))
        temperature = state_dict.get(f"{path}.{TEMPERATURE}")
        if temperature is not None:
            hub.set_temperature(torch.ones(temperature.shape), layers=[layer])


def _register_implementation() -> None:
    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def attach(model: nn.Module) -> AttentionHub:
    """Switch a transformers model to the "attnreg" attention implementation and return its hub.

    Calling it again on the same model returns the same hub. Raises `UnsupportedModelError` for a
    model outside the family table. A PEFT model (`get_peft_model`) attaches the transformers model it
    wraps, before or after the adapters are added: the gates act on the adapters' path too.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("distilbert")
        >>> hub = attach(model)
        >>> attach(model) is hub, is_attached(model), hub_of(model) is hub, model.config._attn_implementation
        (True, True, True, 'attnreg')
    """
    model = transformers_model(model)
    existing: AttentionHub | None = getattr(model, _HUB_ATTR, None)
    if existing is not None:
        if compat.attention_implementation(model.config) != IMPLEMENTATION:
            model.set_attn_implementation(IMPLEMENTATION)
        return existing
    family = detect_family(model)
    if not compat.interface_capable(model):
        raise UnsupportedModelError(
            f"attnreg cannot attach to {type(model).__name__} (model_type={model.config.model_type!r}): its "
            "attention modules never call transformers' attention interface, so the hub would see nothing"
        )
    _register_implementation()
    previous = compat.attention_implementation(model.config)
    hub = AttentionHub(model, family, previous)
    for layer in range(hub.num_layers):
        block = family.blocks(model)[layer]
        attention = family.attention_module(model, layer)
        projection = family.out_projection(model, layer)
        setattr(attention, _STATE_ATTR, _LayerState(index=layer, block=block, projection=projection))
        projection.register_forward_pre_hook(_GateHook(attention))
    model.set_attn_implementation(IMPLEMENTATION)
    # A plain attribute, not a submodule: it is not in the state_dict and follows copy.deepcopy.
    object.__setattr__(model, _HUB_ATTR, hub)
    model.register_forward_pre_hook(_model_forward_guard, with_kwargs=True)
    model.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
    object.__setattr__(model, _SAVE_ATTR, functools.partial(_save_pretrained_folded, model))
    return hub


def is_attached(model: nn.Module) -> bool:
    """Whether `attnreg.attach(model)` was called (and not undone).

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("gpt2"); before = is_attached(model)
        >>> _ = attach(model); attached = is_attached(model)
        >>> detach(model); before, attached, is_attached(model)
        (False, True, False)
    """
    return getattr(transformers_model(model), _HUB_ATTR, None) is not None


def hub_of(model: nn.Module) -> AttentionHub:
    """The hub of a model already attached; raises if `attnreg.attach(model)` was never called.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert")
        >>> hub_of(model)
        Traceback (most recent call last):
        ...
        RuntimeError: BertModel is not attached: call attnreg.attach(model) first
        >>> hub = attach(model); hub_of(model) is hub
        True
    """
    hub = getattr(transformers_model(model), _HUB_ATTR, None)
    if hub is None:
        raise RuntimeError(f"{type(model).__name__} is not attached: call attnreg.attach(model) first")
    return hub


def transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT model (`PeftModel.get_base_model()`), or `model` itself.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert")
        >>> transformers_model(model) is model
        True
    """
    if not isinstance(model, PreTrainedModel) and callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model


def detach(model: nn.Module) -> None:
    """Undo `attach`: fold gates into the output projections and temperatures into the query
    projections (or the query norms, and the sink logits where a family has them; so outputs do not change),
    remove every hook, and restore the previous implementation.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert").eval()
        >>> ids = torch.tensor([[5, 6, 7]])
        >>> with torch.no_grad():
        ...     attach(model).gate(1)[2] = 0.5                          # half of head 2 of layer 1
        ...     gated = model(input_ids=ids).last_hidden_state
        ...     detach(model)
        ...     torch.allclose(model(input_ids=ids).last_hidden_state, gated, atol=1e-6), is_attached(model)
        (True, False)
    """
    hub = hub_of(model)
    model, family = hub.model, hub.family
    _follow_projections(hub)
    _check_temperatures_fold(hub)
    for layer in range(hub.num_layers):  # an adapter whose weights cannot take a fold: refused before any change
        lora_factors(family.out_projection(model, layer))
        if getattr(hub.attention(layer), TEMPERATURE, None) is not None:
            attention = hub.attention(layer)
            lora_factors(attention.get_submodule(family.query or family.fused_qkv))
    for layer in range(hub.num_layers):
        hub.remove_gate(layer)
        projection = family.out_projection(model, layer)
        _remove_hooks(compat.forward_pre_hooks(projection), lambda hook: isinstance(hook, _GateHook))
        attention = hub.attention(layer)
        head_dim = family.head_dim(attention)
        temperature = getattr(attention, TEMPERATURE, None)
        if temperature is not None:
            norm = family.query_norm_module(attention)
            if norm is not None:  # the norm would undo a scale of the projection: fold into it
                _fold_into_norm(norm, family.query_norm_offset, temperature, family.norm_layout)
            else:
                query = attention.get_submodule(family.query or family.fused_qkv)
                scale = torch.ones(out_features(query))
                scale[family.query_rows(attention)] = (1.0 / temperature.cpu()).repeat_interleave(head_dim)
                scale_output_rows(query, scale)
            sink = family.sink_parameter(attention)
            if sink is not None:  # the temperature divides the sink logits too
                with torch.no_grad():
                    sink.copy_(sink.double().div(temperature.double().to(sink.device)).to(sink.dtype))
            delattr(attention, TEMPERATURE)
        delattr(attention, _STATE_ATTR)
    _remove_hooks(
        compat.forward_pre_hooks(model),
        lambda hook: hook is _model_forward_guard,
        compat.forward_pre_hooks_with_kwargs(model),
    )
    _remove_hooks(compat.load_state_dict_pre_hooks(model), lambda hook: hook.hook is _load_state_dict_pre_hook)
    object.__delattr__(model, _HUB_ATTR)
    model.__dict__.pop(_SAVE_ATTR, None)
    model.set_attn_implementation(hub.previous_implementation)


def _fold_into_norm(norm: nn.Module, offset: float, temperature: torch.Tensor, layout: str) -> None:
    """Divide what `norm` returns, head by head, by `temperature`: its weight enters as `offset + weight`, its bias
    (if any) adds. A norm shared by the heads (`Family.norm_layout` "shared") takes the first value (all are equal,
    `_check_temperatures_fold`); a per-head norm (one module per head in `norms`, or weights `[H, head_dim]`) and
    a whole-width one (weights `[H * head_dim]`, normalised before the weight) one value per head."""
    temperature = temperature.detach().double().cpu()
    if layout == "shared":
        pairs = [(norm, None, temperature[0] if temperature.numel() else torch.tensor(1.0))]
    elif isinstance(getattr(norm, "norms", None), nn.ModuleList):
        pairs = [(module, None, value) for module, value in zip(norm.norms, temperature, strict=True)]
    else:
        pairs = [(norm, head, value) for head, value in enumerate(temperature)]
    heads = temperature.numel()
    with torch.no_grad():
        for module, head, value in pairs:
            for name, tensor_offset in (("weight", offset), ("bias", 0.0)):
                tensor = getattr(module, name, None)
                if tensor is None:
                    continue
                part = tensor if head is None else tensor.view(heads, -1)[head]
                part.copy_((part.double() + tensor_offset).div(value.item()).sub(tensor_offset).to(part.dtype))


def _check_temperatures_fold(hub: AttentionHub) -> None:
    """Raise, before anything changes, where a temperature cannot be folded into the weights: a family whose
    query norm is shared by the heads (`Family.query_norm`) takes only one temperature per layer."""
    for layer in range(hub.num_layers):
        temperature = hub.temperature(layer)
        norm = hub.family.query_norm_module(hub.attention(layer))
        shared = norm is not None and hub.family.norm_layout == "shared"
        if temperature is None or not shared:
            continue
        if temperature.numel() and not torch.all(temperature == temperature[0]):
            raise ValueError(
                f"cannot fold the temperatures of layer {layer} ({temperature.tolist()}) into the weights of "
                f"{type(hub.model).__name__} (model_type={hub.model.config.model_type!r}): its query norm "
                f"({hub.family.query_norm}) renormalises each head's query with one weight shared by all heads, so "
                "only a temperature equal on every head of a layer folds. Nothing was changed; set one value per "
                "layer, or remove them with hub.set_temperature(None)."
            )


def _save_pretrained_folded(model: nn.Module, *args, **kwargs):
    """`model.save_pretrained` while attached. `from_pretrained` drops the hub's gates and temperatures,
    so a model saved with them would load computing something else: they are folded into the weights of
    a copy (`detach`), and the copy is saved. An explicit `state_dict=` is saved as given."""
    hub = hub_of(model)
    touched = hub.gates or any(hub.temperature(layer) is not None for layer in range(hub.num_layers))
    if kwargs.get("state_dict") is None and touched:
        folded = copy.deepcopy(model)
        detach(folded)
        return folded.save_pretrained(*args, **kwargs)
    return type(model).save_pretrained(model, *args, **kwargs)


@contextmanager
def unfolded_saves(model: nn.Module) -> Iterator[None]:
    """Within the block `model.save_pretrained` saves the weights as they are, with the hub's gates and
    temperatures unfolded (a training checkpoint, to resume from exactly; `attnreg.methods.pruning.load_pruned`
    reads it back), instead of folding them into a copy. A no-op for a model that is not attached.

    Example:
        >>> import tempfile
        >>> from safetensors.torch import load_file
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert"); _ = attach(model).gate(1)
        >>> folder = tempfile.mkdtemp()
        >>> with unfolded_saves(model):
        ...     model.save_pretrained(folder)
        >>> [key for key in load_file(f"{folder}/model.safetensors") if GATE in key]
        ['encoder.layer.1.attention.self.attnreg_gate']
    """
    folding = model.__dict__.pop(_SAVE_ATTR, None)
    try:
        yield
    finally:
        if folding is not None:
            object.__setattr__(model, _SAVE_ATTR, folding)


def _remove_hooks(hooks: dict, is_ours, flags: dict | None = None) -> None:
    """Remove hooks by identity (handles would point at the original model after a deepcopy)."""
    for key in [key for key, hook in hooks.items() if is_ours(hook)]:
        del hooks[key]
        if flags is not None:
            flags.pop(key, None)


def find_transformers_model(module: nn.Module) -> PreTrainedModel:
    """The one transformers model inside `module` (or `module` itself), for any LightningModule.

    `module.attnreg_model_attr`, where set, names the attribute to use when there is more than one.

    Example:
        >>> from attnreg.app.modules import SequenceClassifier
        >>> from attnreg.tiny import tiny_model
        >>> classifier = SequenceClassifier(tiny_model("bert", head="classification"))
        >>> find_transformers_model(classifier) is classifier.model
        True
    """
    attr = getattr(module, "attnreg_model_attr", None)
    if attr is not None:
        return getattr(module, attr)
    found = [m for m in module.modules() if isinstance(m, PreTrainedModel)]
    outermost = [m for m in found if not any(m is not o and _contains(o, m) for o in found)]
    if len(outermost) != 1:
        names = [type(m).__name__ for m in outermost] or "none"
        raise RuntimeError(
            f"{type(module).__name__} must hold exactly one transformers model for attnreg, found {names}; "
            "set `attnreg_model_attr` to the attribute that holds the one to use"
        )
    return outermost[0]


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())
