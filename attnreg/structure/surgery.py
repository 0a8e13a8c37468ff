"""Physical removal of attention heads (`prune_heads`) and silencing in place (`silence_heads`).

The code asks the family table where the projections are and never branches on the family.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnreg import compat, weights
from attnreg.families import Family, detect_family
from attnreg.heads import (
    PRUNED_HEADS,
    SILENCED_HEADS,
    HeadSpec,
    PruneReport,
    SlicedTensor,
    _write_record,
    head_numbers,
    pruned_heads,
    silenced_heads,
)
from attnreg.records import GATE, TEMPERATURE
from attnreg.structure.gates import _hub_or_none, _remove_gate
from attnreg.structure.optimizer_state import _as_list, drop_from_optimizer, slice_optimizer_state
from attnreg.unwrap import transformers_model

SILENCE = "attnreg_silence"
"""Name of the non-persistent buffer (1 per head, 0 where silenced) on an output projection with silenced heads."""


@dataclass(frozen=True)
class _LayerPlan:
    layer: int
    query_keep: tuple[int, ...]  # current positions of the query heads that stay
    kv_keep: tuple[int, ...]  # current positions of the key/value heads that stay
    removed: tuple[int, ...]  # original numbers removed now
    kept: dict[int, str]
    silenced: tuple[int, ...]  # original numbers silenced afterwards


def check_removable(model: nn.Module, layers: Iterable[int]) -> None:
    """Raise `TypeError`, naming the module and the tuner, unless heads of `layers` can be removed exactly:
    removal slices `nn.Linear` and GPT-2's `Conv1D` projections, bare or wrapped by PEFT LoRA adapters (whose
    `lora_B` rows on q/k/v and `lora_A` columns on the output projection go with the heads); DoRA, other LoRA
    variants and other tuners are refused (merge them first, or silence the heads).

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert")
        >>> model.encoder.layer[1].attention.output.dense = nn.Sequential(model.encoder.layer[1].attention.output.dense)
        >>> check_removable(model, [1])
        Traceback (most recent call last):
        ...
        TypeError: heads of layer 1 cannot be removed: encoder.layer.1.attention.output.dense: torch...
    """
    family = detect_family(model)
    projections = (family.query, family.key, family.value, family.fused_qkv)
    names = [f"{family.attention}.{name}" for name in projections if name]
    for layer in layers:
        block = family.blocks(model)[layer]
        for name in [*names, family.out_proj]:
            try:
                weights.check_sliceable(block.get_submodule(name), output=name != family.out_proj)
            except TypeError as error:
                raise TypeError(
                    f"heads of layer {layer} cannot be removed: {family.module_path(model, layer, name)}: {error} "
                    f"({type(model).__name__}); merge the adapter first (merge_and_unload), or silence the heads "
                    "(attnreg.methods.pruning.silence_heads), which acts on the adapter's path too. Nothing was "
                    "changed"
                ) from None


def prune_heads(model: nn.Module, heads: HeadSpec, optimizers: Iterable[torch.optim.Optimizer] = ()) -> PruneReport:
    """Physically remove attention heads, given per layer by their original numbers.

    The whole request is checked first (layer and head in range, no head pruned twice or listed
    twice, supported model); on any error nothing changes. Parameters keep their identity (their data
    is sliced), so optimizer parameter groups stay valid; pass `optimizers` to slice their per-parameter
    state (Adam moments) the same way. Gates and temperatures of the hub are sliced along. A layer may
    lose all its heads: its attention then adds only the output projection's bias.

    Grouped-query models: a requested head whose key/value group keeps other heads is silenced in
    place (`silence_heads`, with `optimizers`), listed in `PruneReport.kept`, and a warning says so. A
    group goes once every head of it has been requested, in this call or silenced by an earlier one.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert")
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> report = prune_heads(model, {0: [0, 1]}, optimizers=[optimizer])
        >>> report.removed, report.kept, report.heads
        ({0: (0, 1)}, {}, {0: (2, 2), 1: (4, 4)})
        >>> prune_heads(model, {0: [1]})
        Traceback (most recent call last):
        ...
        ValueError: head 1 of layer 0 was already pruned (removed there so far: [0, 1]); nothing was changed
    """
    model = transformers_model(model)  # inside a PEFT model: its LoRA factors are sliced along
    family = detect_family(model)
    plans = _plan(model, family, heads)
    check_removable(model, [plan.layer for plan in plans.values() if plan.removed])
    optimizers = _as_list(optimizers)
    before = count_parameters(model)
    sliced: list[SlicedTensor] = []
    dropped: list[nn.Parameter] = []
    for plan in plans.values():
        if plan.removed:
            layer_sliced, layer_dropped = _prune_layer(model, family, plan)
            sliced += layer_sliced
            dropped += layer_dropped
    record, silenced = pruned_heads(model), silenced_heads(model)
    for plan in plans.values():
        record[plan.layer] = tuple(sorted((*record.get(plan.layer, ()), *plan.removed)))
        silenced[plan.layer] = plan.silenced
    _write_record(model, PRUNED_HEADS, record)
    _write_record(model, SILENCED_HEADS, silenced)
    for optimizer in optimizers:
        slice_optimizer_state(optimizer, sliced)
        drop_from_optimizer(optimizer, dropped)
    for plan in plans.values():
        _apply_silence(model, family, plan.layer, optimizers)
    kept = {plan.layer: plan.kept for plan in plans.values() if plan.kept}
    if kept:
        warnings.warn(
            f"prune_heads kept requested heads in place, silenced (grouped-query attention): {kept}", stacklevel=2
        )
    layout = {}
    for layer in range(len(family.blocks(model))):
        layout[layer] = family.head_counts(family.attention_module(model, layer))
    return PruneReport(
        removed={plan.layer: plan.removed for plan in plans.values() if plan.removed},
        kept=kept,
        heads=layout,
        parameters_before=before,
        parameters_after=count_parameters(model),
        sliced=tuple(sliced),
    )


def _plan(model: nn.Module, family: Family, heads: HeadSpec) -> dict[int, _LayerPlan]:
    """Check a whole request against the model and work out, per layer, which heads stay."""
    request = _check_request(model, family, heads)
    record, silenced = pruned_heads(model), silenced_heads(model)
    plans = {}
    for layer, seen in request.items():
        num_heads, num_kv = family.head_counts(family.attention_module(model, layer))
        already, quiet = set(record.get(layer, ())), set(silenced.get(layer, ()))
        original = num_heads + len(already)
        group = num_heads // num_kv
        current_groups = [g for g in range(original // group) if not set(_members(g, group)) <= already]
        removed, kept, kv_keep = [], {}, []
        attention = family.attention_module(model, layer)
        whole_norm = family.norm_layout == "whole" and family.query_norm_module(attention) is not None
        for position, g in enumerate(current_groups):
            members = _members(g, group)
            if not whole_norm and set(members) <= quiet | seen and not seen.isdisjoint(members):
                removed.extend(members)
                continue
            kv_keep.append(position)
            stay = [h for h in members if h not in quiet | seen]
            for head in members:
                if head in seen and whole_norm:
                    kept[head] = (
                        f"silenced in place: the q/k norm ({family.query_norm}) spans all heads, so removing a head "
                        "would change the others' normalisation"
                    )
                elif head in seen:
                    kept[head] = (
                        f"silenced in place: its key/value head {g} is shared with query heads {stay} that stay"
                    )
        now_gone = already | set(removed)
        current = [h for h in range(original) if h not in already]
        query_keep = tuple(position for position, h in enumerate(current) if h not in now_gone)
        silenced_after = tuple(sorted((quiet | seen) - set(removed)))
        plans[layer] = _LayerPlan(layer, query_keep, tuple(kv_keep), tuple(sorted(removed)), kept, silenced_after)
    return plans


def _check_request(model: nn.Module, family: Family, heads: HeadSpec) -> dict[int, set[int]]:
    """The heads of a request per layer (layers with none left out), after checking every layer and head."""
    if not isinstance(heads, Mapping):
        raise TypeError(f"heads must map layer -> head numbers, e.g. {{0: [1, 2]}}; got {type(heads).__name__}")
    num_layers = len(family.blocks(model))
    record = pruned_heads(model)
    request = {}
    for layer, requested in heads.items():
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
            raise IndexError(
                f"layer {layer!r} is out of range: {type(model).__name__} has {num_layers} attention layers "
                f"(0 to {num_layers - 1})"
            )
        num_heads, _ = family.head_counts(family.attention_module(model, layer))
        already = set(record.get(layer, ()))
        original = num_heads + len(already)
        seen: set[int] = set()
        for head in requested:
            if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < original:
                raise IndexError(
                    f"head {head!r} of layer {layer} is out of range: "
                    f"the layer had {original} heads (0 to {original - 1})"
                )
            if head in already:
                raise ValueError(
                    f"head {head} of layer {layer} was already pruned (removed there so far: {sorted(already)}); "
                    "nothing was changed"
                )
            if head in seen:
                raise ValueError(f"head {head} of layer {layer} is listed twice; nothing was changed")
            seen.add(head)
        if seen:
            request[layer] = seen
    return request


def _members(group: int, size: int) -> range:
    return range(group * size, (group + 1) * size)


def _prune_layer(model: nn.Module, family: Family, plan: _LayerPlan) -> tuple[list[SlicedTensor], list[nn.Parameter]]:
    attention = family.attention_module(model, plan.layer)
    head_dim = family.head_dim(attention)
    num_heads, num_kv = family.head_counts(attention)
    query_rows = _rows(plan.query_keep, head_dim)
    kv_rows = _rows(plan.kv_keep, head_dim)
    sliced = []
    if family.fused_qkv is not None:
        rows = family.fused_rows(list(plan.query_keep), list(plan.kv_keep), attention)
        sliced += _slice_features(attention.get_submodule(family.fused_qkv), rows, output=True)
    else:
        sliced += _slice_features(attention.get_submodule(family.query), query_rows, output=True)
        sliced += _slice_features(attention.get_submodule(family.key), kv_rows, output=True)
        sliced += _slice_features(attention.get_submodule(family.value), kv_rows, output=True)
    sliced += _slice_features(family.out_projection(model, plan.layer), query_rows, output=False)
    dropped = []
    if family.norm_layout == "per_head":
        for norm, keep in (
            (family.query_norm_module(attention), plan.query_keep),
            (family.key_norm_module(attention), plan.kv_keep),
        ):
            if norm is not None:
                norm_sliced, norm_dropped = _slice_norm_per_head(norm, keep)
                sliced += norm_sliced
                dropped += norm_dropped
    heads_index = torch.tensor(plan.query_keep, dtype=torch.long)
    for owner, name, tensor in _per_head_tensors(attention) + _head_parameters(family, attention):
        sliced.append(_slice_tensor(owner, name, tensor, 0, heads_index))
    kept_heads = len(plan.query_keep)
    for attr in family.head_count_attrs:
        setattr(attention, attr, kept_heads)
    for attr in family.width_attrs:
        setattr(attention, attr, kept_heads * head_dim)
    for attr in family.kv_head_count_attrs:
        setattr(attention, attr, len(plan.kv_keep))
    if family.config_head_count_attrs:
        config = attention.config
        shared = config._attnreg_config if isinstance(config, LayerConfig) else config
        attention.config = LayerConfig(shared, **dict.fromkeys(family.config_head_count_attrs, kept_heads))
    if kept_heads == 0:
        dropped += _make_headless(model, family, plan.layer)
    return sliced, dropped


def _slice_norm_per_head(norm: nn.Module, keep: tuple[int, ...]) -> tuple[list[SlicedTensor], list[nn.Parameter]]:
    """Keep heads `keep` of a per-head norm: modules of its `norms` list (the others' parameters are returned), or
    rows of its weights `[H, head_dim]`."""
    norms = getattr(norm, "norms", None)
    if isinstance(norms, nn.ModuleList):
        dropped = [p for i, module in enumerate(norms) if i not in keep for p in module.parameters()]
        norm.norms = nn.ModuleList([norms[i] for i in keep])
        if isinstance(getattr(norm, "num_heads", None), int):
            norm.num_heads = len(keep)
        return [], dropped
    index = torch.tensor(keep, dtype=torch.long)
    tensors = [(name, p) for name, p in compat.parameters_of(norm).items() if p is not None and p.dim() == 2]
    if not tensors:
        raise TypeError(f"cannot slice heads of {type(norm).__name__}: no `norms` list and no [heads, head_dim] weight")
    return [_slice_tensor(norm, name, p, 0, index) for name, p in tensors], []


class LayerConfig:
    """A view of a model's config for one pruned layer: `overrides` (its own head counts) read from here, every
    other attribute from the shared config, live (so `set_attn_implementation` still reaches the layer).

    Example:
        >>> from transformers import Phi3Config
        >>> shared = Phi3Config(num_attention_heads=4)
        >>> view = LayerConfig(shared, num_attention_heads=2)
        >>> shared._attn_implementation = "eager"
        >>> view.num_attention_heads, view._attn_implementation, shared.num_attention_heads
        (2, 'eager', 4)
    """

    def __init__(self, config: Any, **overrides: Any) -> None:
        self.__dict__["_attnreg_config"] = config
        self.__dict__["_attnreg_overrides"] = overrides

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name.startswith("_attnreg_"):
            raise AttributeError(name)
        overrides = self.__dict__["_attnreg_overrides"]
        return overrides[name] if name in overrides else getattr(self.__dict__["_attnreg_config"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._attnreg_config, name, value)

    def __repr__(self) -> str:
        return f"LayerConfig({type(self._attnreg_config).__name__}, {self._attnreg_overrides})"


def _rows(heads: Iterable[int], head_dim: int) -> torch.Tensor:
    heads = torch.tensor(list(heads), dtype=torch.long)
    return (heads[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)


def _slice_features(projection: nn.Module, index: torch.Tensor, output: bool) -> list[SlicedTensor]:
    """Keep output features (`output=True`) or input features `index` of an nn.Linear or a GPT-2 Conv1D, and of
    the LoRA adapters wrapping it (`attnreg.weights.feature_tensors`)."""
    tensors = weights.feature_tensors(projection, output)
    sliced = [_slice_tensor(owner, name, tensor, dim, index) for owner, name, tensor, dim in tensors]
    weights.set_features(projection, len(index), output)
    return sliced


def _slice_tensor(owner: nn.Module, name: str, tensor: torch.Tensor, dim: int, index: torch.Tensor) -> SlicedTensor:
    old_shape = tensor.shape
    index = index.to(tensor.device)
    with torch.no_grad():
        if isinstance(tensor, nn.Parameter):
            tensor.data = tensor.data.index_select(dim, index).contiguous()
            if tensor.grad is not None:
                tensor.grad = tensor.grad.index_select(dim, index).contiguous()
        else:
            compat.buffers_of(owner)[name] = tensor = tensor.index_select(dim, index).contiguous()
    return SlicedTensor(tensor, dim, index, old_shape)


def _per_head_tensors(attention: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """The hub's per-head tensors on an attention module: its gate (a parameter, or the parameters and
    buffers of a gate module, per head along dim 0) and its temperature."""
    found = []
    gate = getattr(attention, GATE, None)
    if isinstance(gate, nn.Module):
        found += [(gate, name, p) for name, p in compat.parameters_of(gate).items() if p is not None and p.dim() > 0]
        found += [(gate, name, b) for name, b in compat.buffers_of(gate).items() if b is not None and b.dim() > 0]
    elif gate is not None:
        found.append((attention, GATE, gate))
    if compat.buffers_of(attention).get(TEMPERATURE) is not None:
        found.append((attention, TEMPERATURE, compat.buffers_of(attention)[TEMPERATURE]))
    return found


def _head_parameters(family: Family, attention: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """The model's own per-head parameters on an attention module (`Family.head_parameters`: gpt-oss's sink
    logits), one value per query head along dim 0."""
    found = []
    for path in family.head_parameters:
        owner_path, _, name = path.rpartition(".")
        owner = attention.get_submodule(owner_path) if owner_path else attention
        found.append((owner, name, owner.get_parameter(name)))
    return found


def _make_headless(model: nn.Module, family: Family, layer: int) -> list[nn.Parameter]:
    """A layer without heads: drop its gate (its parameters are returned) and temperature, and skip
    its attention computation."""
    attention = family.attention_module(model, layer)
    hub = _hub_or_none(model)
    gate = []
    if hub is not None:
        gate = _remove_gate(hub, layer, fold=False)
        hub.set_temperature(None, layers=[layer])
    inside = family.out_proj.startswith(family.attention + ".")
    attention._attnreg_out_proj = family.out_proj[len(family.attention) + 1 :] if inside else None
    attention._attnreg_head_dim = family.head_dim(attention)
    attention.forward = _HeadlessForward(attention)
    return gate


class _HeadlessForward:
    """Forward of an attention module whose heads were all pruned: its output is the output bias.

    When the output projection lives inside the module (DistilBERT, GPT-2, Llama-style) the bias is
    returned directly (a GPT-2 Conv1D cannot take a zero-width input); otherwise (BERT-like) a
    zero-width context goes to the projection outside. A key/value cache still gets an empty update,
    so its sequence length stays right during generation. A plain object rather than a bound method,
    so that the model still pickles and deep-copies.
    """

    def __init__(self, attention: nn.Module) -> None:
        self.attention = attention

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
        module = self.attention
        shape = hidden_states.shape[:-1]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and getattr(module, "layer_idx", None) is not None:
            empty = hidden_states.new_zeros(shape[0], 0, shape[1], module._attnreg_head_dim)
            cache.update(empty, empty, module.layer_idx)
        if module._attnreg_out_proj is None:
            return hidden_states.new_zeros(*shape, 0), None
        projection = module.get_submodule(module._attnreg_out_proj)
        width = weights.out_features(projection)
        if projection.bias is None:
            return hidden_states.new_zeros(*shape, width), None
        return projection.bias.to(hidden_states.dtype).expand(*shape, width), None


def silence_heads(model: nn.Module, heads: HeadSpec, optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
    """Silence heads in place, given per layer by their original numbers: they keep running but add
    exactly nothing, as if their gate were 0.

    Their output-projection input columns are zeroed, and a forward pre-hook on the projection zeroes
    their context, so those columns get no gradient and further training keeps them at zero; pass
    `optimizers` to zero their state there too (Adam moments taken before would otherwise move them).
    The heads are recorded in `model.config.attnreg_silenced_heads` (`silenced_heads`), so `save_pruned`,
    `load_pruned` and Lightning checkpoints keep them silenced, and a later `prune_heads` that names them
    removes them. `prune_heads` silences the heads the grouped-query rule keeps. The request is checked
    as `prune_heads` checks it; on any error nothing changes.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert").eval()
        >>> inputs = torch.tensor([[2, 5, 6, 3]])
        >>> silence_heads(model, {0: [1]})
        >>> silenced_heads(model), head_numbers(model, 0)       # silenced, not removed
        ({0: (1,)}, (0, 1, 2, 3))
        >>> before = model(inputs).last_hidden_state
        >>> with torch.no_grad():                               # head 1's query and key no longer matter
        ...     model.encoder.layer[0].attention.self.query.weight[8:16] = 0.0
        >>> torch.allclose(model(inputs).last_hidden_state, before)
        True
    """
    model = transformers_model(model)
    family = detect_family(model)
    request = _check_request(model, family, heads)
    record = silenced_heads(model)
    for layer, chosen in request.items():
        record[layer] = tuple(sorted({*record.get(layer, ()), *chosen}))
    _write_record(model, SILENCED_HEADS, record)
    for layer in request:
        _apply_silence(model, family, layer, _as_list(optimizers))


def _apply_silence(model: nn.Module, family: Family, layer: int, optimizers: list[torch.optim.Optimizer]) -> None:
    """Make the output projection of `layer` follow the record: silenced columns (and their optimizer
    state) zeroed, and the hook with its per-head buffer installed, updated or removed."""
    projection = family.out_projection(model, layer)
    hooks = compat.forward_pre_hooks(projection)
    for key in [key for key, hook in hooks.items() if isinstance(hook, _SilenceHook)]:
        del hooks[key]
    compat.buffers_of(projection).pop(SILENCE, None)
    silenced = silenced_heads(model).get(layer, ())
    if not silenced:
        return
    scale = torch.tensor([0.0 if head in silenced else 1.0 for head in head_numbers(model, layer)])
    columns = scale.repeat_interleave(family.head_dim(family.attention_module(model, layer)))
    with torch.no_grad():  # the wrapped projection's columns and any LoRA adapter's lora_A columns
        for _, _, tensor, dim in weights.feature_tensors(projection, output=False):
            along = columns[:, None] if dim == 0 else columns[None, :]
            tensor.mul_(along.to(tensor))
            for optimizer in optimizers:
                for value in optimizer.state.get(tensor, {}).values():
                    if isinstance(value, torch.Tensor) and value.shape == tensor.shape:
                        value.mul_(along.to(value))
    projection.register_buffer(SILENCE, scale.to(projection.weight), persistent=False)
    projection.register_forward_pre_hook(_SilenceHook())


class _SilenceHook:
    """Forward pre-hook on an output projection: zeroes the context of the heads its `SILENCE` buffer marks 0.
    (`attnreg_hook`: the hub moves it, and the buffer, to a module that takes the projection's place.)"""

    attnreg_hook = True

    def __call__(self, projection: nn.Module, args: tuple) -> tuple:
        scale = getattr(projection, SILENCE)
        context = args[0]
        heads = context.view(*context.shape[:-1], scale.shape[0], -1) * scale.to(context.dtype)[:, None]
        return (heads.view(context.shape), *args[1:])


def count_parameters(model: nn.Module) -> int:
    """The number of parameter values of `model`.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert")
        >>> count_parameters(model), prune_heads(model, {0: [0]}).parameters_after
        (25536, 24488)
    """
    return sum(parameter.numel() for parameter in model.parameters())
