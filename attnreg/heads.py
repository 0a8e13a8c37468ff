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
    """Original numbers of the heads removed so far, per layer (layers that lost none are left out).

    Example:
        >>> from attnreg.methods.pruning import prune_heads
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert")
        >>> report = prune_heads(model, {1: [0, 3]})
        >>> pruned_heads(model), model.config.attnreg_pruned_heads    # kept in the config
        ({1: (0, 3)}, {'1': [0, 3]})
    """
    return _read_record(model, PRUNED_HEADS)


def silenced_heads(model: nn.Module) -> dict[int, tuple[int, ...]]:
    """Original numbers of the heads silenced in place (`silence_heads`), per layer.

    Example:
        >>> import warnings
        >>> from attnreg.methods.pruning import prune_heads
        >>> from attnreg.tiny import tiny_model
        >>> llama = tiny_model("llama")          # 4 query heads, 2 key/value heads: groups (0, 1) and (2, 3)
        >>> with warnings.catch_warnings(record=True):
        ...     prune_heads(llama, {0: [1]}).kept    # its key/value group keeps head 0
        {0: {1: 'silenced in place: its key/value head 0 is shared with query heads [0] that stay'}}
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
    """Original numbers of the heads `layer` has now, in the order of its weights.

    Example:
        >>> from attnreg.methods.pruning import prune_heads
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("gpt2")
        >>> report = prune_heads(model, {0: [0, 2]})
        >>> head_numbers(model, 0), head_numbers(model, 1)
        ((1, 3), (0, 1, 2, 3))
    """
    family = detect_family(model)
    num_heads, _ = family.head_counts(family.attention_module(model, layer))
    removed = set(pruned_heads(model).get(layer, ()))
    return tuple(head for head in range(num_heads + len(removed)) if head not in removed)


def to_original_numbers(model: nn.Module, positions: Mapping[int, Iterable[int]]) -> dict[int, list[int]]:
    """Convert current head positions per layer to original head numbers.

    Example:
        >>> from attnreg.methods.pruning import prune_heads
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("gpt2")
        >>> report = prune_heads(model, {0: [0, 1]})
        >>> to_original_numbers(model, {0: [0, 1]})     # positions 0 and 1 are now heads 2 and 3
        {0: [2, 3]}
    """
    converted = {}
    for layer, chosen in positions.items():
        numbers = head_numbers(model, layer)
        converted[layer] = [numbers[position] for position in chosen]
    return converted


@dataclass(frozen=True)
class SlicedTensor:
    """A parameter or buffer cut to `index` along `dim` (was `old_shape`); used to slice optimizer state.

    Example:
        >>> from attnreg.methods.pruning import prune_heads
        >>> from attnreg.tiny import tiny_model
        >>> cut = prune_heads(tiny_model("gpt2"), {0: [0]}).sliced[0]       # GPT-2's fused c_attn weight
        >>> cut.dim, cut.old_shape, cut.tensor.shape
        (1, torch.Size([32, 96]), torch.Size([32, 72]))
    """

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

    Example:
        >>> from attnreg.methods.pruning import prune_heads
        >>> from attnreg.tiny import tiny_model
        >>> prune_heads(tiny_model("bert"), {0: [1, 3], 1: [0]})
        PruneReport(removed={0: (1, 3), 1: (0,)}, kept={}, heads={0: (2, 2), 1: (3, 3)},
                    parameters_before=25536, parameters_after=22392)
    """

    removed: dict[int, tuple[int, ...]]
    kept: dict[int, dict[int, str]]
    heads: dict[int, tuple[int, int]]
    parameters_before: int
    parameters_after: int
    sliced: tuple[SlicedTensor, ...] = field(default=(), repr=False)

    @property
    def num_removed(self) -> int:
        """Heads removed by this call, over all layers."""
        return sum(len(heads) for heads in self.removed.values())
