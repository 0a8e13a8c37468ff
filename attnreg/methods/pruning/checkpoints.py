"""Pruning in training checkpoints: framework-free functions on a checkpoint dict, for Lightning's hooks."""

from __future__ import annotations

from torch import nn

from attnreg.heads import PRUNED_HEADS, SILENCED_HEADS, PruneReport, pruned_heads, silenced_heads
from attnreg.hub import GATE
from attnreg.methods.pruning.gates import _hub_or_none
from attnreg.methods.pruning.surgery import prune_heads, silence_heads

FOLDED_GATES = "attnreg_folded_gates"
"""Lightning checkpoint entry: layers whose gates were folded into the weights (so the checkpoint has none)."""


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
