"""The record in a training checkpoint dict (Lightning's): its `attnreg_<field>` entries beside the `state_dict`,
restored by `restore_record` before the weights load. The runner's structure event writes and reads them; the names
here are those of 0.1.0 and 0.2.0."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from attnreg.structure.record import record_of, restore_record


def model_structure(model: nn.Module) -> dict[str, Any]:
    """The model's record as the entries of a checkpoint dict (`StructureRecord.to_checkpoint`).

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> from attnreg.hub import attach
        >>> from attnreg.structure.surgery import prune_heads
        >>> model = tiny_model("bert")
        >>> _ = attach(model).gate(1)
        >>> _ = prune_heads(model, {0: [1, 2]})
        >>> entries = model_structure(model)
        >>> entries["attnreg_pruned_heads"], entries["attnreg_gates"], entries["attnreg_heads"]
        ({'0': [1, 2]}, {'1': [1.0, 1.0, 1.0, 1.0]}, [[2, 2], [4, 4]])
    """
    return record_of(model).to_checkpoint()


def add_pruning_to_checkpoint(model: nn.Module, checkpoint: dict) -> None:
    """Put the model's record in a checkpoint dict (from `on_save_checkpoint`), for `restore_pruning`: its heads
    removed and silenced, its layout and sizes; the gates are left to the checkpoint's weights (as in 0.1.0).

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> from attnreg.structure.surgery import prune_heads
        >>> model = tiny_model("bert")
        >>> report = prune_heads(model, {0: [1, 2]})
        >>> checkpoint = {}
        >>> add_pruning_to_checkpoint(model, checkpoint); checkpoint["attnreg_pruned_heads"]
        {'0': [1, 2]}
        >>> fresh = tiny_model("bert")                    # as the module is built before a resume
        >>> restore_pruning(fresh, checkpoint).heads      # now the checkpoint's weights fit
        {0: (2, 2), 1: (4, 4)}
        >>> restore_pruning(fresh, {}) is None            # a checkpoint without a record
        True
    """
    checkpoint.update(replace(record_of(model), gates=None, hard_concrete={}, folded={}).to_checkpoint())


restore_pruning = restore_structure = restore_record
"""Their names for `restore_record` (a checkpoint dict holds the record and its weights)."""
