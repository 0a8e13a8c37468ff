"""What the hub keeps on each attention module and what a capture records: the attribute names of the hub's
settings (`GATE`, `TEMPERATURE`, the per-layer state), a layer's head layout (`LayerInfo`), what a layer's
attention function received (`LayerInputs`), and the probabilities of a capture (`AttentionRecord`).

Example:
    >>> import torch
    >>> from attnreg.hub import attach
    >>> from attnreg.tiny import tiny_model
    >>> hub = attach(tiny_model("gpt2"))
    >>> with hub.capture(layers=[1]) as record:
    ...     _ = hub.model(input_ids=torch.tensor([[5, 6, 7]]))
    >>> type(record).__name__, record[1].shape
    ('AttentionRecord', torch.Size([1, 4, 3, 3]))
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from attnreg import compat

GATE = "attnreg_gate"
"""The attribute of an attention module that holds its per-head gate (a parameter or a module)."""
TEMPERATURE = "attnreg_temperature"
"""The buffer of an attention module that holds its per-head softmax temperature."""
STATE_ATTR = "_attnreg_state"
"""The attribute of an attention module that holds its `LayerState`."""


@dataclass(frozen=True)
class LayerInfo:
    """Head layout of one attention layer, read from the current weight shapes.

    Example:
        >>> import attnreg
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("llama"); hub = attnreg.attach(model)       # 4 query heads sharing 2 key/value heads
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
class LayerState:
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
        >>> from attnreg.hub import attach
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
        >>> from attnreg.hub import attach
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
            >>> from attnreg.hub import attach
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
            >>> from attnreg.hub import attach
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
        state: LayerState,
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
