"""The record of a pruning: which heads were removed or silenced, kept in `model.config` (so it is saved
with config.json), the heads' original numbers, and the report of one `prune_heads` call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from attnreg.families import detect_family

PRUNED_HEADS = "attnreg_pruned_heads"
"""Name of the `model.config` attribute (and of the Lightning checkpoint entry) recording removed heads."""
SILENCED_HEADS = "attnreg_silenced_heads"
"""Name of the `model.config` attribute (and of the Lightning checkpoint entry) recording silenced heads."""

HeadSpec = Mapping[int, Iterable[int]]


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


def to_original_numbers(model: nn.Module, positions: Mapping[int, Iterable[int]]) -> dict[int, list[int]]:
    """Convert current head positions per layer to original head numbers."""
    converted = {}
    for layer, chosen in positions.items():
        numbers = head_numbers(model, layer)
        converted[layer] = [numbers[position] for position in chosen]
    return converted


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
