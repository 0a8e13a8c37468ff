"""The attention hub: the one place that touches transformers' attention dispatch.

`attach(model)` registers an "attnreg" attention implementation (and its mask function) with
transformers, switches the model to it and returns an `AttentionHub`. Layers nobody asked about run
through transformers' own SDPA function unchanged; only captured layers materialize probabilities.

Here: the hub, its gate hook, `attach`/`detach` and the guards they install. The attention function it registers
and its maths are `attnreg.eager`'s, the keywords it accepts `attnreg.keywords`'s, what a capture records
`attnreg.records`'s, the temperature folds `attnreg.folding`'s; the names users take from here are re-exported.

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
import inspect
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from attnreg import compat
from attnreg.eager import attention_forward, attention_probabilities, find_packing
from attnreg.families import Family, UnsupportedModelError, detect_family
from attnreg.folding import check_foldable, fold_temperature
from attnreg.keywords import HEAD_MASK_MESSAGE, PACKING_KWARG
from attnreg.records import GATE, STATE_ATTR, TEMPERATURE, AttentionRecord, LayerInfo, LayerInputs, LayerState
from attnreg.unwrap import transformers_model
from attnreg.weights import scale_input_columns

__all__ = [
    "GATE",
    "IMPLEMENTATION",
    "TEMPERATURE",
    "AttentionHub",
    "AttentionRecord",
    "LayerInfo",
    "LayerInputs",
    "attach",
    "attention_probabilities",
    "detach",
    "gate_values",
    "hub_of",
    "is_attached",
    "transformers_model",
    "unfolded_saves",
]

IMPLEMENTATION = "attnreg"
_HUB_ATTR = "_attnreg_hub"
_SAVE_ATTR = "save_pretrained"


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
    def _state(self, layer: int) -> LayerState:
        return getattr(self.attention(layer), STATE_ATTR)

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


def _check_implementation(model: nn.Module) -> None:
    current = compat.attention_implementation(model.config)
    if current != IMPLEMENTATION:
        raise RuntimeError(
            f"attnreg is attached to {type(model).__name__}, but its attention implementation was changed to "
            f"{current!r} after attnreg.attach, so capture, temperature and dropout settings would be ignored. "
            f"Call model.set_attn_implementation({IMPLEMENTATION!r}) again, or attnreg.detach(model) first."
        )


def _model_forward_guard(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    if kwargs.get("head_mask") is not None:
        raise ValueError(HEAD_MASK_MESSAGE)
    _check_implementation(model)
    hub: AttentionHub = getattr(model, _HUB_ATTR)
    _follow_projections(hub)
    position_ids, attention_mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
    if position_ids is None and len(args) > 2:  # passed by position: read them by the forward's signature
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
        position_ids, attention_mask = bound.get("position_ids"), bound.get("attention_mask")
    if position_ids is None or kwargs.get(PACKING_KWARG) is not None:
        return None  # no position_ids: nothing more to do, nothing read back from the device
    packing = find_packing(position_ids, attention_mask, hub.previous_implementation)
    if packing is None:
        return None
    return args, {**kwargs, PACKING_KWARG: packing}


def _model_forward_check(model: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
    """After a forward of packed documents (`eager.Packing`): refuse it where a layer never received the packing,
    so its documents were not kept apart (a family whose forward drops keyword arguments)."""
    packing = kwargs.get(PACKING_KWARG)
    if packing is None:
        return
    missing = sorted(set(range(getattr(model, _HUB_ATTR).num_layers)) - packing.seen)
    if missing:
        raise NotImplementedError(
            packing.message(
                f"the attention function of layers {missing} of {type(model).__name__} never received attnreg's "
                f"{PACKING_KWARG!r} keyword (the model does not pass its forward's keyword arguments to them)."
            )
        )


def _follow_projections(hub: AttentionHub) -> None:
    """Keep attnreg's hooks (gate, silencing) and buffers on whatever module holds each output projection's
    place now: a PEFT adapter layer wrapped around it after `attach` (so the gate scales the input of the
    adapter's path too), or the plain projection put back by `merge_and_unload()`."""
    family, model = hub.family, hub.model
    for layer in range(hub.num_layers):
        state: LayerState = getattr(family.attention_module(model, layer), STATE_ATTR)
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
        setattr(attention, STATE_ATTR, LayerState(index=layer, block=block, projection=projection))
        projection.register_forward_pre_hook(_GateHook(attention))
    model.set_attn_implementation(IMPLEMENTATION)
    # A plain attribute, not a submodule: it is not in the state_dict and follows copy.deepcopy.
    object.__setattr__(model, _HUB_ATTR, hub)
    model.register_forward_pre_hook(_model_forward_guard, with_kwargs=True)
    model.register_forward_hook(_model_forward_check, with_kwargs=True)
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
    if hub.gates or any(hub.temperature(layer) is not None for layer in range(hub.num_layers)):
        check_foldable(model, family)  # a temperature or an adapter that cannot take a fold: refused before any change
    for layer in range(hub.num_layers):
        hub.remove_gate(layer)
        projection = family.out_projection(model, layer)
        _remove_hooks(compat.forward_pre_hooks(projection), lambda hook: isinstance(hook, _GateHook))
        attention = hub.attention(layer)
        temperature = getattr(attention, TEMPERATURE, None)
        if temperature is not None:
            fold_temperature(family, attention, temperature)
            delattr(attention, TEMPERATURE)
        delattr(attention, STATE_ATTR)
    _remove_hooks(
        compat.forward_pre_hooks(model),
        lambda hook: hook is _model_forward_guard,
        compat.forward_pre_hooks_with_kwargs(model),
    )
    _remove_hooks(
        compat.forward_hooks(model),
        lambda hook: hook is _model_forward_check,
        compat.forward_hooks_with_kwargs(model),
    )
    _remove_hooks(compat.load_state_dict_pre_hooks(model), lambda hook: hook.hook is _load_state_dict_pre_hook)
    object.__delattr__(model, _HUB_ATTR)
    model.__dict__.pop(_SAVE_ATTR, None)
    model.set_attn_implementation(hub.previous_implementation)


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
