"""Pruning in training checkpoints: framework-free functions on a checkpoint dict. `model_structure` and
`restore_structure` are what the runner's structure event (`attnreg.methods.Runner.structure`) carries."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from attnreg.heads import PRUNED_HEADS, SILENCED_HEADS, PruneReport, pruned_heads, silenced_heads
from attnreg.records import GATE
from attnreg.structure.gates import _hub_or_none, folded_gates, refold_gates
from attnreg.structure.surgery import prune_heads, silence_heads

FOLDED_GATES = "attnreg_folded_gates"
"""Lightning checkpoint entry: layers whose gates were folded into the weights (so the checkpoint has none)."""
GATES = "attnreg_gates"
"""Structure entry: the hub's gates at the save, by layer, with their values (a PEFT checkpoint has none)."""
FOLDED_VALUES = "attnreg_folded_gate_values"
"""Structure entry: the gate values folded into each layer's output projection at a removal (`folded_gates`)."""


def model_structure(model: nn.Module) -> dict[str, Any]:
    """The model's structure as a JSON-able record: heads removed and silenced, and its gates with their
    values, what must be rebuilt before a checkpoint's weights load (`restore_structure`).

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> from attnreg.hub import attach
        >>> model = tiny_model("bert")
        >>> _ = attach(model).gate(1)
        >>> _ = prune_heads(model, {0: [1, 2]})
        >>> model_structure(model)
        {'attnreg_pruned_heads': {'0': [1, 2]}, 'attnreg_silenced_heads': {},
         'attnreg_gates': {'1': [1.0, 1.0, 1.0, 1.0]}, 'attnreg_folded_gate_values': {}}
    """
    record: dict[str, Any] = {}
    add_pruning_to_checkpoint(model, record)
    hub = _hub_or_none(model)
    gates = {} if hub is None else hub.gates
    record[GATES] = {str(layer): _values(gate) for layer, gate in sorted(gates.items())}
    record[FOLDED_VALUES] = {str(layer): values for layer, values in sorted(folded_gates(model).items())}
    return record


def restore_structure(model: nn.Module, record: dict[str, Any]) -> PruneReport | None:
    """Rebuild on `model` (built as the run began, its methods bound) the structure `model_structure` recorded:
    heads removed and silenced, gates the record lacks (folded at a removal) taken off, the recorded gates'
    values set (the weights, where they hold the gates, load over them). A record without gates (an older
    checkpoint) goes to `restore_pruning`.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> from attnreg.hub import attach
        >>> fresh = tiny_model("bert")
        >>> hub = attach(fresh); _ = hub.gate(0), hub.gate(1)      # the method made gates at bind
        >>> record = {"attnreg_pruned_heads": {"0": [1, 2]}, "attnreg_gates": {"1": [0.5, 1.0, 1.0, 0.0]}}
        >>> restore_structure(fresh, record).heads, sorted(hub.gates), hub.gate(1).tolist()
        ({0: (2, 2), 1: (4, 4)}, [1], [0.5, 1.0, 1.0, 0.0])
    """
    if GATES not in record:
        return restore_pruning(model, record)
    recorded = {int(layer): values for layer, values in record[GATES].items()}
    hub = _hub_or_none(model)
    folded = [layer for layer in ({} if hub is None else hub.gates) if layer not in recorded]
    report = restore_pruning(model, {**record, FOLDED_GATES: folded, "state_dict": {}})
    refold_gates(model, record.get(FOLDED_VALUES, {}))  # the base's weights, where the checkpoint lacks them
    with torch.no_grad():
        for layer, values in recorded.items():
            gate = None if hub is None else hub.gates.get(layer)
            if gate is None:
                raise ValueError(
                    f"the checkpoint has a gate on layer {layer} but the model has none: bind the method that made "
                    "it (HeadGating, say) before resuming"
                )
            if isinstance(gate, nn.Module):
                for name, tensor in gate.state_dict(keep_vars=True).items():
                    if not isinstance(tensor, DTensor):  # sharded: the checkpoint's weights hold it
                        tensor.copy_(torch.tensor(values[name], dtype=tensor.dtype))
            elif not isinstance(gate, DTensor):
                gate.copy_(torch.tensor(values, dtype=gate.dtype))
    return report


def _values(gate: Any) -> Any:
    if isinstance(gate, nn.Module):
        return {name: _values(tensor) for name, tensor in gate.state_dict().items()}
    gate = gate.full_tensor() if isinstance(gate, DTensor) else gate
    return gate.detach().float().cpu().tolist()


def add_pruning_to_checkpoint(model: nn.Module, checkpoint: dict) -> None:
    """Record the model's pruned and silenced heads in a Lightning checkpoint dict (from `on_save_checkpoint`).

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert")
        >>> report = prune_heads(model, {0: [1, 2]})
        >>> checkpoint = {}
        >>> add_pruning_to_checkpoint(model, checkpoint); checkpoint
        {'attnreg_pruned_heads': {'0': [1, 2]}, 'attnreg_silenced_heads': {}}
    """
    checkpoint[PRUNED_HEADS] = {str(layer): list(heads) for layer, heads in pruned_heads(model).items()}
    checkpoint[SILENCED_HEADS] = {str(layer): list(heads) for layer, heads in silenced_heads(model).items()}


def restore_pruning(model: nn.Module, checkpoint: dict) -> PruneReport | None:
    """Re-apply the pruning (removed and silenced heads) a Lightning checkpoint records, before its weights load.

    Call it from `LightningModule.on_load_checkpoint` (which Lightning runs before loading the state
    dict). Gates of the layers the checkpoint lists under `FOLDED_GATES` (folded into the weights at
    pruning, so absent from its state dict) are removed, so the weights load strictly. A no-op for
    checkpoints without a record.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> fresh = tiny_model("bert")                    # as the module is built before a resume
        >>> checkpoint = {"attnreg_pruned_heads": {"0": [1, 2]}, "attnreg_silenced_heads": {}}
        >>> restore_pruning(fresh, checkpoint).heads      # now the checkpoint's weights fit
        {0: (2, 2), 1: (4, 4)}
        >>> restore_pruning(fresh, {}) is None            # a checkpoint without pruning
        True
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
