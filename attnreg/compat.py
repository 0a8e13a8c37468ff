"""Every use attnreg makes of a private name of torch, transformers or Lightning, in one place.

Each function says what it reads and was checked against the versions in `CHECKED`; `tests/test_compat.py`
fails, naming the name, when a new version moves one, and `tests/test_layers.py` checks that no other
module of attnreg uses a private name of those libraries.

Example:
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("bert")
    >>> attention_implementation(model.config), lightning_trainer(model) is None
    ('sdpa', True)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

CHECKED = {"torch": "2.13.0", "transformers": "5.25.0", "lightning": "2.6.6"}
"""The versions every name below was checked against."""


def graph_task_id() -> int:
    """The id of the autograd graph task running now, -1 outside backward (`torch._C._current_graph_task_id`):
    how the hub tells a gradient-checkpointing replay from a first forward.

    Example:
        >>> graph_task_id()
        -1
    """
    return torch._C._current_graph_task_id()


def forward_pre_hooks(module: nn.Module) -> dict:
    """The module's forward pre-hooks by handle id (`nn.Module._forward_pre_hooks`), to remove attnreg's own
    by identity (a handle would point at the original module after a deepcopy)."""
    return module._forward_pre_hooks


def forward_pre_hooks_with_kwargs(module: nn.Module) -> dict:
    """Which forward pre-hooks take keyword arguments (`nn.Module._forward_pre_hooks_with_kwargs`)."""
    return module._forward_pre_hooks_with_kwargs


def load_state_dict_pre_hooks(module: nn.Module) -> dict:
    """The module's state-dict load pre-hooks (`nn.Module._load_state_dict_pre_hooks`)."""
    return module._load_state_dict_pre_hooks


def parameters_of(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The parameters a module registers itself (`nn.Module._parameters`), to swap one in place."""
    return module._parameters


def buffers_of(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The buffers a module registers itself (`nn.Module._buffers`)."""
    return module._buffers


def attention_implementation(config: Any) -> str | None:
    """The attention implementation a transformers model runs (`PreTrainedConfig._attn_implementation`)."""
    return config._attn_implementation


def interface_capable(model: nn.Module) -> bool:
    """Whether a transformers model class can switch its attention implementation, that is, calls the
    attention interface (`PreTrainedModel._can_set_attn_implementation`)."""
    check = getattr(type(model), "_can_set_attn_implementation", None)
    return bool(check()) if callable(check) else True


def lightning_trainer(module: Any) -> Any:
    """The Lightning `Trainer` a LightningModule is attached to, or None (`LightningModule._trainer`; the
    public `trainer` property raises when there is none)."""
    return getattr(module, "_trainer", None)


def callback_state_key(callback: Any, **identity: Any) -> str:
    """A Lightning callback's checkpoint key from the settings that tell two instances apart
    (`Callback._generate_state_key`, which Lightning's docs point to for `state_key`)."""
    return callback._generate_state_key(**identity)


class KeepColumns:
    """A `transformers.Trainer` mixin keeping `kept_columns()` through `remove_unused_columns=True`
    (`Trainer._set_signature_columns_if_needed` and `_signature_columns`)."""

    def kept_columns(self) -> tuple[str, ...]:
        return ()

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        self._signature_columns = list(dict.fromkeys([*self._signature_columns, *self.kept_columns()]))


PRIVATE_NAMES = {
    "torch": ["torch._C._current_graph_task_id"],
    "torch.nn.Module": [
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_load_state_dict_pre_hooks",
        "_parameters",
        "_buffers",
    ],
    "transformers": [
        "PreTrainedConfig._attn_implementation",
        "PreTrainedModel._can_set_attn_implementation",
        "Trainer._set_signature_columns_if_needed",
        "Trainer._signature_columns",
    ],
    "lightning": ["LightningModule._trainer", "Callback._generate_state_key"],
}
"""The private names above, by library (what `tests/test_compat.py` checks)."""
