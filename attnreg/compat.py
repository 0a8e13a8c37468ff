"""Every use attnreg makes of a private name of torch, transformers, accelerate or Lightning, in one place,
and every reliance on how their training loops hold a distributed wrapper (rebuilding one mid-training).

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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

CHECKED = {"torch": "2.13.0", "transformers": "5.25.0", "accelerate": "1.16.0", "lightning": "2.6.6"}
"""The versions every name below was checked against."""


def graph_task_id() -> int:
    """The id of the autograd graph task running now, -1 outside backward (`torch._C._current_graph_task_id`):
    how the hub tells a gradient-checkpointing replay from a first forward.

    Example:
        >>> graph_task_id()
        -1
    """
    return torch._C._current_graph_task_id()


def assert_in_graph(good: torch.Tensor, message: str) -> None:
    """Assert the 0-dim boolean `good` inside the traced graph (`torch._assert_async`): under `torch.compile`
    a data-dependent check that reads the value (`bool`, `.item()`) would break the graph.

    Example:
        >>> assert_in_graph(torch.tensor(True), "never raised")
    """
    torch._assert_async(good, message)


def forward_pre_hooks(module: nn.Module) -> dict:
    """The module's forward pre-hooks by handle id (`nn.Module._forward_pre_hooks`), to remove attnreg's own
    by identity (a handle would point at the original module after a deepcopy)."""
    return module._forward_pre_hooks


def forward_pre_hooks_with_kwargs(module: nn.Module) -> dict:
    """Which forward pre-hooks take keyword arguments (`nn.Module._forward_pre_hooks_with_kwargs`)."""
    return module._forward_pre_hooks_with_kwargs


def forward_hooks(module: nn.Module) -> dict:
    """The module's forward hooks by handle id (`nn.Module._forward_hooks`), to remove attnreg's own by identity."""
    return module._forward_hooks


def forward_hooks_with_kwargs(module: nn.Module) -> dict:
    """Which forward hooks take keyword arguments (`nn.Module._forward_hooks_with_kwargs`)."""
    return module._forward_hooks_with_kwargs


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


def load_pending_loader_states(trainer: Any) -> None:
    """Hand a resumed fit's training loaders the states its checkpoint saved for them (a loader with `state_dict` and
    `load_state_dict`), where Lightning has not yet: its fit loop loads them only when it sets up the training data
    after the restore, and `trainer.estimated_stepping_batches` (read in `configure_optimizers`, before the restore)
    sets the data up first, so they are never loaded (Lightning issue #20550). Calls
    `_FitLoop._load_combined_loader_states`, a no-op unless the fit is restarting with states not loaded yet; for a
    loader that reads its state when its first batch is drawn, so from `on_train_start`."""
    trainer.fit_loop._load_combined_loader_states()


class KeepColumns:
    """A `transformers.Trainer` mixin keeping `kept_columns()` through `remove_unused_columns=True`
    (`Trainer._set_signature_columns_if_needed` and `_signature_columns`)."""

    def kept_columns(self) -> tuple[str, ...]:
        return ()

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        self._signature_columns = list(dict.fromkeys([*self._signature_columns, *self.kept_columns()]))


# -- a data-parallel wrapper rebuilt after the parameters changed (a removal of heads during training) -------------
def lightning_rewrap(strategy: Any) -> Callable[[], None] | None:
    """A function that rebuilds the DDP wrapper of Lightning's `DDPStrategy` around its LightningModule, the
    way Lightning built it (`strategy.model = module; strategy.configure_ddp()`: its DDP arguments and
    communication hooks), for after the module's parameters were replaced; None for any other strategy or
    when nothing is wrapped (one process). It relies on Lightning's fit loop reading `strategy.model` at
    every step (its `training_step`, `no_sync` for gradient accumulation), which nothing documents.

    Example:
        >>> from lightning.pytorch.strategies import SingleDeviceStrategy
        >>> lightning_rewrap(SingleDeviceStrategy("cpu")) is None
        True
    """
    from lightning.pytorch.strategies import DDPStrategy

    if not (isinstance(strategy, DDPStrategy) and isinstance(strategy.model, DistributedDataParallel)):
        return None

    def rewrap() -> None:
        strategy.model = strategy.lightning_module
        strategy.configure_ddp()

    return rewrap


def trainer_rewrap(trainer: Any, replaced: list[nn.Module]) -> Callable[[], None] | None:
    """A function that rebuilds the DDP wrapper accelerate put around a `transformers.Trainer`'s model
    (`accelerator.prepare_model` again, on the model unwrapped with its mixed-precision forward undone, so
    nothing is applied twice), for after the model's parameters were replaced: the new wrapper becomes
    `trainer.model_wrapped`, and the old one is appended to `replaced`. The Trainer's loop keeps passing
    the old wrapper to `training_step` (a local variable of `_inner_training_loop`), so the caller must put
    the new one in its place there (`AttnRegTrainerMixin.training_step`, with `no_sync_as`). Accelerate's
    list of prepared models (`Accelerator._models`) keeps one entry. None unless the model is wrapped in
    DDP (DeepSpeed, FSDP, one process).

    Example:
        >>> from types import SimpleNamespace
        >>> trainer_rewrap(SimpleNamespace(model_wrapped=nn.Linear(2, 2)), []) is None
        True
    """
    if not isinstance(trainer.model_wrapped, DistributedDataParallel):
        return None

    def rewrap() -> None:
        accelerator = trainer.accelerator
        stale = trainer.model_wrapped
        model = accelerator.unwrap_model(stale, keep_fp32_wrapper=False)
        prepared = accelerator._models
        count = len(prepared)
        fresh = accelerator.prepare_model(model)
        del prepared[count:]  # prepare_model lists the model again
        if not any(entry is model for entry in prepared):
            prepared.append(model)
        replaced.append(stale)
        trainer.model_wrapped = fresh

    return rewrap


@contextmanager
def no_sync_as(stale: nn.Module, current: nn.Module) -> Iterator[None]:
    """Inside `current.no_sync()` while `stale` (a DDP wrapper replaced by `current`) is inside its own
    `no_sync` (DDP's `require_backward_grad_sync`, which `no_sync` clears; undocumented): a loop that still
    holds the old wrapper skips the all-reduce of an accumulation step on the new one too.

    Example:
        >>> with no_sync_as(nn.Linear(2, 2), nn.Linear(2, 2)):     # not DDP wrappers: nothing to do
        ...     pass
    """
    if getattr(stale, "require_backward_grad_sync", True) or not isinstance(current, DistributedDataParallel):
        yield
        return
    with current.no_sync():
        yield


PRIVATE_NAMES = {
    "torch": ["torch._C._current_graph_task_id"],
    "torch.nn.Module": [
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
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
    "accelerate": ["Accelerator._models"],
    "lightning": [
        "LightningModule._trainer",
        "Callback._generate_state_key",
        "lightning.pytorch.loops.fit_loop._FitLoop._load_combined_loader_states",
    ],
}
"""The private names above, by library (what `tests/test_compat.py` checks)."""


def clear_quantizer(model: Any) -> Any:
    """Drop the quantizer flags a dequantized GGUF model keeps (`hf_quantizer`, `is_quantized`,
    `config.quantization_config`, `quantization_method`), as transformers' own `remove_quantization_config` does,
    so that the HF `Trainer` trains it and `save_pretrained` saves it as the float model it is. Refuses a model
    whose weights are still packed (a quantized module remains: it must stay quantized, use LoRA).

    Example:
        >>> from transformers import GgufConfig
        >>> from transformers.quantizers.quantizer_gguf import GgufHfQuantizer
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("llama", head="causal_lm")
        >>> model.hf_quantizer = GgufHfQuantizer(GgufConfig(dequantize=True))     # what a GGUF load leaves
        >>> model.is_quantized, model.config.quantization_config = True, model.hf_quantizer.quantization_config
        >>> model = clear_quantizer(model)
        >>> hasattr(model, "hf_quantizer"), model.is_quantized, hasattr(model.config, "quantization_config")
        (False, False, False)
    """
    packed = [name for name, module in model.named_modules() if type(module).__name__.startswith(("Gguf", "GGUF"))]
    if packed:
        raise ValueError(
            f"the model's weights are still quantized ({packed[0]} is a "
            f"{type(model.get_submodule(packed[0])).__name__}): load it with "
            "quantization_config=GgufConfig(dequantize=True) to fine-tune all weights"
        )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    for name in ("hf_quantizer", "quantization_method"):
        if hasattr(model, name):
            delattr(model, name)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    return model
