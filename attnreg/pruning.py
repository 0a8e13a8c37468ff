"""Head pruning: physical removal of attention heads, saving and loading pruned models, head importance.

Every family in `attnreg.families` is supported; the code asks the family table where the query, key,
value and output projections are and never branches on the family. Heads keep their *original*
numbers across successive prunings (the convention of transformers v4's `prune_heads`), and the
record of removed heads is kept in `model.config.attnreg_pruned_heads`, so it is saved with config.json.

Grouped-query models (Llama, Qwen2, Mistral): a key/value head is shared by a group of query heads,
and can go only when its whole group goes. Requested heads of a group that keeps other heads are
silenced in place instead (`silence_heads`): they add exactly nothing, as if their gate were 0, stay so
through training, saving and loading, and are recorded in `model.config.attnreg_silenced_heads`;
`PruneReport.kept` says which and why. A later request that takes the rest of their group removes them.

Example:
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("bert", head="classification")   # 2 layers x 4 heads
    >>> report = prune_heads(model, {0: [1, 3], 1: [0]})
    >>> report.heads, pruned_heads(model)
    ({0: (2, 2), 1: (3, 3)}, {0: (1, 3), 1: (0,)})
    >>> prune_heads(model, {0: [2]}).heads[0]                # original numbers: head 2 is still head 2
    (1, 1)
    >>> save_pruned(model, "pruned", tokenizer=tokenizer); same = load_pruned("pruned")
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file
from torch import nn
from transformers.pytorch_utils import Conv1D

from attnreg.families import Family, detect_family
from attnreg.hub import GATE, TEMPERATURE, AttentionHub, attach, detach, hub_of

PRUNED_HEADS = "attnreg_pruned_heads"
"""Name of the `model.config` attribute (and of the Lightning checkpoint entry) recording removed heads."""
SILENCED_HEADS = "attnreg_silenced_heads"
"""Name of the `model.config` attribute (and of the Lightning checkpoint entry) recording silenced heads."""
SILENCE = "attnreg_silence"
"""Name of the non-persistent buffer (1 per head, 0 where silenced) on an output projection with silenced heads."""
FOLDED_GATES = "attnreg_folded_gates"
"""Lightning checkpoint entry: layers whose gates were folded into the weights (so the checkpoint has none)."""
SPEC_FILE = "attnreg_pruning.json"
_SPEC_FORMAT = 1

HeadSpec = Mapping[int, Iterable[int]]


# ---------------------------------------------------------------------------------------------
# The record of what was removed
# ---------------------------------------------------------------------------------------------
def pruned_heads(model: nn.Module) -> dict[int, tuple[int, ...]]:
    """Original numbers of the heads removed so far, per layer (layers that lost none are left out)."""
    return _read_record(model, PRUNED_HEADS)


def silenced_heads(model: nn.Module) -> dict[int, tuple[int, ...]]:
    """Original numbers of the heads silenced in place (`silence_heads`), per layer.

    Example:
        >>> prune_heads(llama, {0: [1]}).kept   # its key/value group keeps head 0
        >>> silenced_heads(llama)
        {0: (1,)}
    """
    return _read_record(model, SILENCED_HEADS)


def _read_record(model: nn.Module, name: str) -> dict[int, tuple[int, ...]]:
    raw = getattr(getattr(model, "config", None), name, None) or {}
    return {int(layer): tuple(heads) for layer, heads in sorted(raw.items(), key=lambda item: int(item[0])) if heads}


def _write_record(model: nn.Module, name: str, record: Mapping[int, Iterable[int]]) -> None:
    setattr(model.config, name, {str(layer): sorted(heads) for layer, heads in sorted(record.items()) if heads})


def head_numbers(model: nn.Module, layer: int) -> tuple[int, ...]:
    """Original numbers of the heads `layer` has now, in the order of its weights."""
    family = detect_family(model)
    num_heads, _ = family.head_counts(family.attention_module(model, layer))
    removed = set(pruned_heads(model).get(layer, ()))
    return tuple(head for head in range(num_heads + len(removed)) if head not in removed)


# ---------------------------------------------------------------------------------------------
# Physical removal
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SlicedTensor:
    """A parameter or buffer cut to `index` along `dim` (was `old_shape`); used to slice optimizer state."""

    tensor: torch.Tensor
    dim: int
    index: torch.Tensor
    old_shape: torch.Size


@dataclass(frozen=True)
class PruneReport:
    """What `prune_heads` did.

    `removed`: original numbers of the heads removed by this call, per layer (with heads silenced
    earlier whose group went now). `kept`: requested heads left in place but silenced (they add exactly
    nothing; see `silence_heads`), with the reason (grouped-query rule). `heads`: (query heads, key/value
    heads) per layer afterwards. `sliced`: every tensor that was cut, for `slice_optimizer_state`.
    """

    removed: dict[int, tuple[int, ...]]
    kept: dict[int, dict[int, str]]
    heads: dict[int, tuple[int, int]]
    parameters_before: int
    parameters_after: int
    sliced: tuple[SlicedTensor, ...] = field(default=(), repr=False)

    @property
    def num_removed(self) -> int:
        return sum(len(heads) for heads in self.removed.values())


@dataclass(frozen=True)
class _LayerPlan:
    layer: int
    query_keep: tuple[int, ...]  # current positions of the query heads that stay
    kv_keep: tuple[int, ...]  # current positions of the key/value heads that stay
    removed: tuple[int, ...]  # original numbers removed now
    kept: dict[int, str]
    silenced: tuple[int, ...]  # original numbers silenced afterwards


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
        >>> report = prune_heads(model, {0: [0, 1]}, optimizers=[optimizer])
        >>> report.removed, report.kept
        ({0: (0, 1)}, {})
    """
    family = detect_family(model)
    plans = _plan(model, family, heads)
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
        for position, g in enumerate(current_groups):
            members = _members(g, group)
            if set(members) <= quiet | seen and not seen.isdisjoint(members):
                removed.extend(members)
                continue
            kv_keep.append(position)
            stay = [h for h in members if h not in quiet | seen]
            for head in members:
                if head in seen:
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
        width, kv_width = num_heads * head_dim, num_kv * head_dim
        rows = torch.cat([query_rows, width + kv_rows, width + kv_width + kv_rows])
        sliced += _slice_features(attention.get_submodule(family.fused_qkv), rows, output=True)
    else:
        sliced += _slice_features(attention.get_submodule(family.query), query_rows, output=True)
        sliced += _slice_features(attention.get_submodule(family.key), kv_rows, output=True)
        sliced += _slice_features(attention.get_submodule(family.value), kv_rows, output=True)
    sliced += _slice_features(family.out_projection(model, plan.layer), query_rows, output=False)
    heads_index = torch.tensor(plan.query_keep, dtype=torch.long)
    for owner, name, tensor in _per_head_tensors(attention):
        sliced.append(_slice_tensor(owner, name, tensor, 0, heads_index))
    kept_heads = len(plan.query_keep)
    for attr in family.head_count_attrs:
        setattr(attention, attr, kept_heads)
    for attr in family.width_attrs:
        setattr(attention, attr, kept_heads * head_dim)
    dropped = _make_headless(model, family, plan.layer) if kept_heads == 0 else []
    return sliced, dropped


def _rows(heads: Iterable[int], head_dim: int) -> torch.Tensor:
    heads = torch.tensor(list(heads), dtype=torch.long)
    return (heads[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)


def _slice_features(projection: nn.Module, index: torch.Tensor, output: bool) -> list[SlicedTensor]:
    """Keep output features (`output=True`) or input features `index` of an nn.Linear or a GPT-2 Conv1D."""
    conv = isinstance(projection, Conv1D)
    if not conv and not isinstance(projection, nn.Linear):
        raise TypeError(f"cannot prune heads of a {type(projection).__name__} projection (nn.Linear or Conv1D)")
    weight_dim = (1 if conv else 0) if output else (0 if conv else 1)
    sliced = [_slice_tensor(projection, "weight", projection.weight, weight_dim, index)]
    if output and projection.bias is not None:
        sliced.append(_slice_tensor(projection, "bias", projection.bias, 0, index))
    size = len(index)
    if conv:
        setattr(projection, "nf" if output else "nx", size)
    else:
        setattr(projection, "out_features" if output else "in_features", size)
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
            owner._buffers[name] = tensor = tensor.index_select(dim, index).contiguous()
    return SlicedTensor(tensor, dim, index, old_shape)


def _per_head_tensors(attention: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """The hub's per-head tensors on an attention module: its gate (a parameter, or the parameters and
    buffers of a gate module, per head along dim 0) and its temperature."""
    found = []
    gate = getattr(attention, GATE, None)
    if isinstance(gate, nn.Module):
        found += [(gate, name, p) for name, p in gate._parameters.items() if p is not None and p.dim() > 0]
        found += [(gate, name, b) for name, b in gate._buffers.items() if b is not None and b.dim() > 0]
    elif gate is not None:
        found.append((attention, GATE, gate))
    if attention._buffers.get(TEMPERATURE) is not None:
        found.append((attention, TEMPERATURE, attention._buffers[TEMPERATURE]))
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
        width = projection.nf if isinstance(projection, Conv1D) else projection.out_features
        if projection.bias is None:
            return hidden_states.new_zeros(*shape, width), None
        return projection.bias.to(hidden_states.dtype).expand(*shape, width), None


def slice_optimizer_state(optimizer: torch.optim.Optimizer, sliced: Iterable[SlicedTensor] | PruneReport) -> None:
    """Cut an optimizer's per-parameter state (Adam's `exp_avg`, `exp_avg_sq`, momentum...) like the
    parameters were cut, so the moments of the kept heads carry on. Parameter groups are untouched."""
    if isinstance(sliced, PruneReport):
        sliced = sliced.sliced
    for item in sliced:
        state = optimizer.state.get(item.tensor)
        if not state:
            continue
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.shape == item.old_shape:
                state[key] = value.index_select(item.dim, item.index.to(value.device)).contiguous()


def drop_from_optimizer(optimizer: torch.optim.Optimizer, parameters: Iterable[torch.Tensor]) -> None:
    """Remove parameters (folded gates) from an optimizer's groups and state; groups themselves stay,
    so LR schedulers keep working."""
    dropped = {id(p) for p in parameters}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in dropped]
    for parameter in [p for p in optimizer.state if id(p) in dropped]:
        del optimizer.state[parameter]


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
        >>> silence_heads(model, {0: [1]}, optimizers=[optimizer])
        >>> silenced_heads(model)
        {0: (1,)}
    """
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
    hooks = projection._forward_pre_hooks
    for key in [key for key, hook in hooks.items() if isinstance(hook, _SilenceHook)]:
        del hooks[key]
    projection._buffers.pop(SILENCE, None)
    silenced = silenced_heads(model).get(layer, ())
    if not silenced:
        return
    weight = projection.weight
    scale = torch.tensor([0.0 if head in silenced else 1.0 for head in head_numbers(model, layer)])
    columns = scale.repeat_interleave(family.head_dim(family.attention_module(model, layer)))
    columns = columns[:, None] if isinstance(projection, Conv1D) else columns[None, :]
    with torch.no_grad():
        weight.mul_(columns.to(weight))
        for optimizer in optimizers:
            for value in optimizer.state.get(weight, {}).values():
                if isinstance(value, torch.Tensor) and value.shape == weight.shape:
                    value.mul_(columns.to(value))
    projection.register_buffer(SILENCE, scale.to(weight), persistent=False)
    projection.register_forward_pre_hook(_SilenceHook())


class _SilenceHook:
    """Forward pre-hook on an output projection: zeroes the context of the heads its `SILENCE` buffer marks 0."""

    def __call__(self, projection: nn.Module, args: tuple) -> tuple:
        scale = getattr(projection, SILENCE)
        context = args[0]
        heads = context.view(*context.shape[:-1], scale.shape[0], -1) * scale.to(context.dtype)[:, None]
        return (heads.view(context.shape), *args[1:])


def _as_list(optimizers: Iterable[torch.optim.Optimizer] | torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    return [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)


def count_parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


# ---------------------------------------------------------------------------------------------
# Gates: folding, hard-concrete gates
# ---------------------------------------------------------------------------------------------
def fold_gates(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> list[nn.Parameter]:
    """Fold every hub gate (gate modules such as `HardConcreteGate` at their eval-mode value) into the
    output projections and remove the gates; the model computes the same function without them.

    The gates' parameters are dropped from `optimizers` and returned.
    """
    hub = _hub_or_none(model)
    if hub is None:
        return []
    removed = []
    for layer in list(hub.gates):
        removed += _remove_gate(hub, layer, fold=True)
    for optimizer in _as_list(optimizers):
        drop_from_optimizer(optimizer, removed)
    return removed


def gate_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of every hub gate of `model` (plain gates, and those of gate modules such as
    `HardConcreteGate`): for an optimizer group of their own, since gates usually need a far larger
    learning rate than the pretrained weights. Empty without a hub.

    Example:
        >>> gates = gate_parameters(model); ids = {id(p) for p in gates}
        >>> rest = [p for p in model.parameters() if id(p) not in ids]
        >>> torch.optim.AdamW([{"params": rest, "lr": 5e-5}, {"params": gates, "lr": 0.05, "weight_decay": 0.0}])
    """
    hub = _hub_or_none(model)
    if hub is None:
        return []
    found = []
    for gate in hub.gates.values():
        found += list(gate.parameters()) if isinstance(gate, nn.Module) else [gate]
    return found


def _remove_gate(hub: AttentionHub, layer: int, fold: bool) -> list[nn.Parameter]:
    gate = getattr(hub.attention(layer), GATE, None)
    if gate is None:
        return []
    parameters = list(gate.parameters()) if isinstance(gate, nn.Module) else [gate]
    hub.remove_gate(layer, fold=fold)
    return parameters


def _hub_or_none(model: nn.Module) -> AttentionHub | None:
    try:
        return hub_of(model)
    except RuntimeError:
        return None


class HardConcreteGate(nn.Module):
    """Hard-concrete (L0) gates for the heads of one layer: Louizos et al. 2018, as Voita et al. 2019.

    Calling it samples `z = clamp(sigmoid((log u - log(1 - u) + log_alpha) / temperature) * (hi - lo) + lo, 0, 1)`
    in training and returns the deterministic `clamp(sigmoid(log_alpha) * (hi - lo) + lo, 0, 1)` in eval.
    Install it with `make_hard_concrete`; the hub applies it like a plain gate.

    Example:
        >>> gate = HardConcreteGate(num_heads=12, initial_log_alpha=2.0)
        >>> gate.expected_l0().sum()       # expected number of open heads, differentiable
    """

    def __init__(
        self,
        num_heads: int,
        initial_log_alpha: float = 2.0,
        temperature: float = 2.0 / 3.0,
        stretch: tuple[float, float] = (-0.1, 1.1),
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        low, high = stretch
        if not low < 0.0 < 1.0 < high:
            raise ValueError(f"stretch must satisfy low < 0 < 1 < high, got {tuple(stretch)}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)
        self.stretch = (float(low), float(high))
        self.log_alpha = nn.Parameter(torch.full((num_heads,), float(initial_log_alpha), dtype=dtype, device=device))

    def forward(self) -> torch.Tensor:
        if not self.training:
            return self.deterministic()
        low, high = self.stretch
        noise = torch.rand_like(self.log_alpha).clamp(1e-6, 1 - 1e-6)
        s = torch.sigmoid((torch.log(noise) - torch.log1p(-noise) + self.log_alpha) / self.temperature)
        return (s * (high - low) + low).clamp(0.0, 1.0)

    def deterministic(self) -> torch.Tensor:
        """The test-time gate: clamp(sigmoid(log_alpha) * (hi - lo) + lo, 0, 1)."""
        low, high = self.stretch
        return (torch.sigmoid(self.log_alpha) * (high - low) + low).clamp(0.0, 1.0)

    def expected_l0(self) -> torch.Tensor:
        """P(gate != 0) per head: sigmoid(log_alpha - temperature * log(-lo / hi))."""
        low, high = self.stretch
        return torch.sigmoid(self.log_alpha - self.temperature * math.log(-low / high))

    def extra_repr(self) -> str:
        return f"heads={self.log_alpha.numel()}, temperature={self.temperature:.4g}, stretch={self.stretch}"


def make_hard_concrete(
    hub: AttentionHub,
    layer: int,
    initial_log_alpha: float = 2.0,
    temperature: float = 2.0 / 3.0,
    stretch: tuple[float, float] = (-0.1, 1.1),
) -> HardConcreteGate:
    """Install a `HardConcreteGate` as the hub gate of `layer` (or return the one already there).

    Its log-alpha is saved in the state_dict as `...attnreg_gate.log_alpha`.
    """
    existing = getattr(hub.attention(layer), GATE, None)
    if isinstance(existing, HardConcreteGate):
        return existing
    if existing is not None:
        raise ValueError(f"layer {layer} already has a {type(existing).__name__} gate; remove it first")
    num_heads = hub.layers[layer].num_heads
    weight = hub.family.out_projection(hub.model, layer).weight
    gate = HardConcreteGate(num_heads, initial_log_alpha, temperature, stretch, weight.dtype, weight.device)
    gate.train(hub.attention(layer).training)  # follow the model's mode
    hub.install_gate(layer, gate)
    return gate


def hard_concrete(hub: AttentionHub, layer: int) -> HardConcreteGate | None:
    """The hard-concrete gate of `layer`, or None."""
    gate = getattr(hub.attention(layer), GATE, None)
    return gate if isinstance(gate, HardConcreteGate) else None


def select_heads(
    scores: Mapping[int, torch.Tensor], threshold: float | None = None, keep: int | None = None
) -> dict[int, list[int]]:
    """Heads to remove, as current positions per layer: those scoring below `threshold`, or all but
    the `keep` best overall (ties broken by layer then head order). Exactly one of the two is given."""
    if (threshold is None) == (keep is None):
        raise ValueError("give exactly one of threshold= and keep=")
    if threshold is not None:
        return {layer: [i for i, s in enumerate(score.tolist()) if s < threshold] for layer, score in scores.items()}
    flat = [(-float(s), layer, i) for layer, score in scores.items() for i, s in enumerate(score.tolist())]
    if not 0 <= keep <= len(flat):
        raise ValueError(f"keep={keep} heads is more than the {len(flat)} heads there are (or negative)")
    chosen: dict[int, list[int]] = {layer: [] for layer in scores}
    for _, layer, head in sorted(flat)[keep:]:
        chosen[layer].append(head)
    return {layer: sorted(heads) for layer, heads in chosen.items()}


def to_original_numbers(model: nn.Module, positions: Mapping[int, Iterable[int]]) -> dict[int, list[int]]:
    """Convert current head positions per layer to original head numbers."""
    converted = {}
    for layer, chosen in positions.items():
        numbers = head_numbers(model, layer)
        converted[layer] = [numbers[position] for position in chosen]
    return converted


# ---------------------------------------------------------------------------------------------
# Saving and loading
# ---------------------------------------------------------------------------------------------
def save_pruned(
    model: transformers.PreTrainedModel,
    directory: str | Path,
    tokenizer: transformers.PreTrainedTokenizerBase | None = None,
) -> Path:
    """Save a (pruned) model: safetensors weights and config via `save_pretrained`, plus `attnreg_pruning.json`,
    and `tokenizer` beside them when given (tools such as `attnreg-analyze` need it).

    Hub gates and temperatures are saved too; hard-concrete gates must be folded first (`fold_gates`).

    Example:
        >>> save_pruned(model, "out/pruned", tokenizer=tokenizer)
        >>> model = load_pruned("out/pruned"); tokenizer = AutoTokenizer.from_pretrained("out/pruned")
    """
    family = detect_family(model)
    hub = _hub_or_none(model)
    if hub is not None and any(isinstance(gate, nn.Module) for gate in hub.gates.values()):
        raise ValueError(
            "save_pruned: the model has gate modules (hard-concrete); fold them first with fold_gates(model)"
        )
    directory = Path(directory)
    type(model).save_pretrained(model, directory)  # not an attached model's own, which folds gates: these load back
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    spec = {
        "format": _SPEC_FORMAT,
        "class": type(model).__name__,
        "family": family.name,
        "pruned_heads": {str(layer): list(heads) for layer, heads in pruned_heads(model).items()},
        "silenced_heads": {str(layer): list(heads) for layer, heads in silenced_heads(model).items()},
        "heads": [
            list(family.head_counts(family.attention_module(model, i))) for i in range(len(family.blocks(model)))
        ],
    }
    (directory / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")
    return directory


def load_pruned(directory: str | Path) -> transformers.PreTrainedModel:
    """Load what `save_pruned` wrote: rebuild the model from its config, re-apply the pruning spec, then
    load the weights strictly. Returns the same class, in eval mode (as `from_pretrained` does).

    Raises `ValueError` naming the tensor and layer when the spec disagrees with the weights.
    """
    directory = Path(directory)
    spec_path = directory / SPEC_FILE
    if not spec_path.is_file():
        raise FileNotFoundError(f"{spec_path} is missing: was {directory} written by attnreg.pruning.save_pruned?")
    spec = json.loads(spec_path.read_text())
    if spec.get("format") != _SPEC_FORMAT:
        raise ValueError(f"{spec_path}: unknown format {spec.get('format')!r} (this attnreg reads {_SPEC_FORMAT})")
    model_class = getattr(transformers, spec["class"], None)
    if model_class is None:
        raise ValueError(f"{spec_path}: class {spec['class']!r} is not a transformers class")
    config = transformers.AutoConfig.from_pretrained(directory)
    for name, key in ((PRUNED_HEADS, "pruned_heads"), (SILENCED_HEADS, "silenced_heads")):
        recorded = getattr(config, name, None) or {}
        if {k: list(v) for k, v in recorded.items()} != spec.get(key, {}):
            raise ValueError(
                f"{directory}: config.json records {key.replace('_', ' ')} {recorded} but {SPEC_FILE} says "
                f"{spec.get(key, {})}"
            )
        setattr(config, name, {})
    model = model_class(config)
    family = detect_family(model)
    prune_heads(model, {int(layer): heads for layer, heads in spec["pruned_heads"].items()})
    silence_heads(model, {int(layer): heads for layer, heads in spec.get("silenced_heads", {}).items()})
    layout = [list(family.head_counts(family.attention_module(model, i))) for i in range(len(family.blocks(model)))]
    if layout != spec["heads"]:
        raise ValueError(
            f"{spec_path}: re-applying the spec gives heads {layout} per layer, the spec says {spec['heads']}"
        )
    weights = _read_weights(directory)
    if any(key.endswith((f".{GATE}", f".{TEMPERATURE}")) for key in weights):
        attach(model)
    _load_checked(model, family, weights, directory)
    return model.eval()


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing (save_pruned writes safetensors weights)")
        weights.update(load_file(path))
    return weights


def _load_checked(model: nn.Module, family: Family, weights: dict[str, torch.Tensor], directory: Path) -> None:
    expected = model.state_dict()
    mismatches = [
        f"{key}: weights {tuple(tensor.shape)}, pruning spec {tuple(expected[key].shape)}{_layer_of(family, key)}"
        for key, tensor in weights.items()
        if key in expected and expected[key].shape != tensor.shape
    ]
    if mismatches:
        raise ValueError(f"{directory}: the pruning spec disagrees with the weights: " + "; ".join(mismatches[:5]))
    floating = [t.dtype for t in weights.values() if t.is_floating_point()]
    if floating and floating[0] != next(model.parameters()).dtype:
        model.to(floating[0])
    result = model.load_state_dict(weights, strict=False)
    tied = {id(t) for key, t in model.state_dict(keep_vars=True).items() if key in weights}
    state = model.state_dict(keep_vars=True)
    missing = [key for key in result.missing_keys if id(state[key]) not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{directory}: weights do not match the model: missing {missing}, unexpected {result.unexpected_keys}"
        )


def _layer_of(family: Family, key: str) -> str:
    marker = f"{family.blocks_path}."
    if marker not in key:
        return ""
    return f" (layer {key.split(marker, 1)[1].split('.', 1)[0]})"


# ---------------------------------------------------------------------------------------------
# Lightning checkpoints
# ---------------------------------------------------------------------------------------------
def add_pruning_to_checkpoint(model: nn.Module, checkpoint: dict) -> None:
    """Record the model's pruned and silenced heads in a Lightning checkpoint dict (from `on_save_checkpoint`)."""
    checkpoint[PRUNED_HEADS] = {str(layer): list(heads) for layer, heads in pruned_heads(model).items()}
    checkpoint[SILENCED_HEADS] = {str(layer): list(heads) for layer, heads in silenced_heads(model).items()}


def restore_pruning(model: nn.Module, checkpoint: dict) -> PruneReport | None:
    """Re-apply the pruning (removed and silenced heads) a Lightning checkpoint records, before its weights load.

    Call it from `LightningModule.on_load_checkpoint` (which Lightning runs before loading the state
    dict). Gates of the layers the checkpoint lists under `FOLDED_GATES` (folded into the weights at
    pruning, so absent from its state dict) are removed, so the weights load strictly. A no-op for
    checkpoints without a record.
    """
    if PRUNED_HEADS not in checkpoint:
        return None
    wanted = {int(layer): set(heads) for layer, heads in checkpoint[PRUNED_HEADS].items()}
    quiet = {int(layer): set(heads) for layer, heads in checkpoint.get(SILENCED_HEADS, {}).items()}
    current, silenced = pruned_heads(model), silenced_heads(model)
    extra = {
        layer: sorted(
            {*current.get(layer, ()), *silenced.get(layer, ())} - wanted.get(layer, set()) - quiet.get(layer, set())
        )
        for layer in {*current, *silenced}
    }
    extra = {layer: heads for layer, heads in sorted(extra.items()) if heads}
    if extra:
        raise ValueError(f"the model has heads pruned or silenced that the checkpoint does not record: {extra}")
    missing = {layer: sorted(heads - set(current.get(layer, ()))) for layer, heads in wanted.items()}
    missing = {layer: heads for layer, heads in missing.items() if heads}
    report = prune_heads(model, missing) if missing else None
    silenced = silenced_heads(model)
    unsilenced = {layer: sorted(heads - set(silenced.get(layer, ()))) for layer, heads in quiet.items()}
    silence_heads(model, {layer: heads for layer, heads in unsilenced.items() if heads})
    hub = _hub_or_none(model)
    if hub is not None:
        keys = checkpoint.get("state_dict", {})
        for layer in checkpoint.get(FOLDED_GATES, ()):
            gate = hub.gates.get(layer)
            if gate is None:
                continue
            path = f"{hub.family.module_path(model, layer, hub.family.attention)}.{GATE}"
            names = [f"{path}.{name}" for name in gate.state_dict()] if isinstance(gate, nn.Module) else [path]
            if not any(key == name or key.endswith("." + name) for key in keys for name in names):
                hub.remove_gate(layer, fold=False)
    return report


# ---------------------------------------------------------------------------------------------
# Head importance (Michel et al. 2019) and iterative pruning
# ---------------------------------------------------------------------------------------------
LossFunction = Callable[[Any, Any], torch.Tensor]


def head_importance(
    model: nn.Module,
    dataloader: Iterable[Any],
    loss_fn: LossFunction | None = None,
    masked: HeadSpec | None = None,
) -> dict[int, torch.Tensor]:
    """Michel et al. 2019: the expected |dL/dg_h| at gates g = 1, L2-normalized per layer.

    Batches are dicts passed as `model(**batch)`; the loss is `loss_fn(output, batch)` or the
    model's own `output.loss`. Heads in `masked` (original numbers) are held at g = 0 meanwhile. Runs
    in eval mode (no dropout); the model's weights, gates, grads and modes are left as they were.
    Returns one tensor per layer, indexed by the heads' current positions (see `head_numbers`).

    Example:
        >>> scores = head_importance(model, loader)
        >>> scores[0]    # tensor([0.41, 0.12, 0.77, 0.47]), unit L2 norm
    """
    totals: dict[int, torch.Tensor] = {}
    batches = 0
    with _evaluation_gates(model, masked or {}) as gates:
        device = next(model.parameters()).device
        for batch in dataloader:
            batch = {
                key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()
            }
            output = model(**batch)
            loss = loss_fn(output, batch) if loss_fn is not None else getattr(output, "loss", None)
            if loss is None:
                raise ValueError("head_importance: the model output has no loss; pass loss_fn(output, batch)")
            layers = list(gates)
            grads = torch.autograd.grad(loss, [gates[layer] for layer in layers], allow_unused=True)
            for layer, grad in zip(layers, grads, strict=True):
                value = torch.zeros_like(gates[layer]) if grad is None else grad.detach().abs()
                totals[layer] = totals.get(layer, 0) + value.float()
            batches += 1
    if batches == 0:
        raise ValueError("head_importance: the dataloader yielded no batches")
    return {layer: _unit(total / batches) for layer, total in totals.items()}


def _unit(scores: torch.Tensor) -> torch.Tensor:
    norm = scores.norm()
    return scores / norm if norm > 0 else scores


@contextmanager
def _evaluation_gates(model: nn.Module, masked: HeadSpec) -> Iterator[dict[int, nn.Parameter]]:
    """Gates at 1 (0 for `masked` heads) on every layer, with only the gates requiring grad; restores all."""
    was_attached = _hub_or_none(model) is not None
    hub = attach(model)
    for layer, gate in hub.gates.items():
        if isinstance(gate, nn.Module):
            raise ValueError(f"layer {layer} has a {type(gate).__name__} gate; fold it first with fold_gates(model)")
    existing = {layer: gate.detach().clone() for layer, gate in hub.gates.items()}
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    training = model.training
    gates = {layer: hub.gate(layer) for layer in range(hub.num_layers)}
    try:
        model.eval()
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        with torch.no_grad():
            for layer, gate in gates.items():
                gate.fill_(1.0)
                numbers = head_numbers(model, layer)
                for head in masked.get(layer, ()):
                    if head in numbers:
                        gate[numbers.index(head)] = 0.0
                gate.requires_grad_(True)
        yield gates
    finally:
        for layer, gate in gates.items():
            if layer in existing:
                with torch.no_grad():
                    gate.copy_(existing[layer])
            else:
                hub.remove_gate(layer, fold=False)
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(flags.get(name, True))
        model.train(training)
        if not was_attached:
            detach(model)


@dataclass(frozen=True)
class PruningStep:
    """One point of the curve: heads removed so far (original numbers per layer) and the metric."""

    heads_removed: int
    metric: float
    removed: dict[int, tuple[int, ...]]


def iterative_pruning(
    model: nn.Module,
    dataloader: Iterable[Any],
    metric_fn: Callable[[nn.Module], float],
    fraction: float = 0.1,
    stop_ratio: float = 0.9,
    loss_fn: LossFunction | None = None,
    apply: bool = True,
) -> list[PruningStep]:
    """Michel et al. 2019's iterative pruning: per round, mask the heads with the lowest importance
    (recomputed with the masks on), round k bringing the heads masked to `round(k * fraction * total)`
    (at least one more per round), until `metric_fn(model)` (higher is better) falls below
    `stop_ratio` times its starting value. Returns the metric-versus-heads-removed curve;
    with `apply`, the last step that stayed above the bar is then removed physically (heads the
    grouped-query rule keeps are silenced).

    Example:
        >>> curve = iterative_pruning(model, loader, lambda m: accuracy(m, dev), fraction=0.1)
        >>> [(step.heads_removed, step.metric) for step in curve]
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    family = detect_family(model)
    total = sum(family.head_counts(family.attention_module(model, i))[0] for i in range(len(family.blocks(model))))
    start = float(_metric_with_masks(model, metric_fn, {}))
    curve = [PruningStep(0, start, {})]
    masked: dict[int, list[int]] = {}
    best = curve[0]
    while (done := sum(len(heads) for heads in masked.values())) < total:
        goal = min(total, max(done + 1, round(len(curve) * fraction * total)))
        scores = head_importance(model, dataloader, loss_fn, masked=masked)
        candidates = []
        for layer, score in scores.items():
            numbers = head_numbers(model, layer)
            candidates += [(float(s), layer, numbers[i]) for i, s in enumerate(score.tolist())]
        candidates = [c for c in sorted(candidates) if c[2] not in masked.get(c[1], [])]
        for _, layer, head in candidates[: goal - done]:
            masked.setdefault(layer, []).append(head)
        metric = float(_metric_with_masks(model, metric_fn, masked))
        step = PruningStep(
            sum(len(h) for h in masked.values()), metric, {layer: tuple(sorted(h)) for layer, h in masked.items()}
        )
        curve.append(step)
        if metric < stop_ratio * start:
            break
        best = step
    if apply and best.removed:
        prune_heads(model, best.removed)
    return curve


def _metric_with_masks(model: nn.Module, metric_fn: Callable[[nn.Module], float], masked: HeadSpec) -> float:
    with _evaluation_gates(model, masked), torch.no_grad():
        return metric_fn(model)
