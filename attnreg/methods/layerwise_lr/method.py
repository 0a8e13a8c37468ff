"""Per-layer learning rates and temporary freezing as method objects: the optimizer's groups and the rate
factor per step (`LayerwiseLR`); layer groups frozen for the first epochs (`FreezeLayers`).

The groups come from `attnreg.methods.layerwise_lr.layerwise_param_groups` (ELECTRA's layer-wise decay, multipliers,
freezing, a `gates` group); the factor from an optional schedule of training progress. Adapters build
the optimizer before any LR scheduler exists (adding groups to a live optimizer breaks every torch
scheduler step) and step the factor every optimizer step.

Example:
    >>> from attnreg.schedules import Linear, Warmup
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("bert", head="classification")
    >>> llrd = LayerwiseLR(lr=2e-5, decay=0.95, weight_decay=0.01, schedule=Warmup(0.06, Linear(1.0, 0.0)))
    >>> llrd.bind(model, taken=set()); llrd.start(estimated_steps=100)
    >>> optimizer = llrd.build_optimizer(model)          # AdamW over the named layer groups
    >>> scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, llrd.factor)
    >>> [round(llrd.factor(step), 3) for step in (0, 3, 6, 53, 99)]     # warmup over 6 steps, then decay
    [0.0, 0.5, 1.0, 0.5, 0.011]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from attnreg.methods.base import Loop, Method
from attnreg.methods.layerwise_lr.groups import (
    LayerKey,
    check_multipliers,
    electra_layer_factors,
    layerwise_param_groups,
    parameters_by_layer,
    resolve_layer_groups,
)
from attnreg.methods.registry import register_method
from attnreg.schedules import ScheduleLike, as_schedule


@register_method(docs="methods/layerwise-lr.md")
class LayerwiseLR(Method):
    """Trains with `layerwise_param_groups(model, lr, decay, multipliers, freeze, weight_decay, no_decay)`.

    - `optimizer`: a `torch.optim` class name or any callable `(param_groups, **optimizer_kwargs)` returning
      an optimizer (a Hydra `_partial_`, say); AdamW by default.
    - `schedule`: optional learning-rate factor as a function of progress (an `attnreg.schedules` schedule),
      stepped every optimizer step; `Warmup(0.06, Linear(1.0, 0.0))` is linear warmup and decay.
    - `total_steps`: the steps the schedule spans; by default the trainer's estimate (`attnreg.progress`:
      a run resumed with more steps re-stretches the schedule over them, with a warning).

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> llrd = LayerwiseLR(lr=0.1, optimizer="SGD", optimizer_kwargs={"momentum": 0.9}, freeze=["embeddings"])
        >>> optimizer = llrd.build_optimizer(tiny_model("gpt2", head="causal_lm"))
        >>> type(optimizer).__name__, [group["name"] for group in optimizer.param_groups]
        ('SGD', ['layer0', 'layer1', 'head'])
        >>> llrd.factor(10)                                   # no schedule: a constant factor
        1.0
    """

    default_name = "layerwise_lr"

    def __init__(
        self,
        lr: float,
        decay: float | None = None,
        multipliers: Mapping[LayerKey, float] | Sequence[float] | None = None,
        freeze: Iterable[LayerKey] | LayerKey | None = None,
        weight_decay: float = 0.0,
        no_decay: Iterable[str] | None = None,
        optimizer: str | Callable[..., Optimizer] = "AdamW",
        optimizer_kwargs: Mapping[str, Any] | None = None,
        schedule: ScheduleLike | None = None,
        total_steps: int | None = None,
    ) -> None:
        if isinstance(lr, bool) or not isinstance(lr, int | float) or not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
        if decay is not None:
            electra_layer_factors(0, decay)  # checks decay now rather than at fit time
        check_multipliers(multipliers)  # and the multipliers' form and values (the layers exist: at bind)
        if isinstance(weight_decay, bool) or not isinstance(weight_decay, int | float) or not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        super().__init__(None, total_steps)
        self.group_options = dict(
            lr=lr, decay=decay, multipliers=multipliers, freeze=freeze, weight_decay=weight_decay, no_decay=no_decay
        )
        self.optimizer = optimizer_factory(optimizer)
        self.optimizer_kwargs = dict(optimizer_kwargs or {})
        self.schedule = None if schedule is None else as_schedule(schedule, "schedule")

    def schedules(self) -> list[Callable[[float], float] | None]:
        return [self.schedule]

    def build_optimizer(self, model: nn.Module) -> Optimizer:
        """The optimizer over `model`'s layer groups (`model`: the transformers model or a module holding it)."""
        return self.optimizer(layerwise_param_groups(model, **self.group_options), **self.optimizer_kwargs)

    def factor(self, step: int) -> float:
        """The learning-rate factor at optimizer step `step` (1 without a schedule)."""
        return 1.0 if self.schedule is None else float(self.schedule(self.progress(step)))

    def configure_optimizer(self, model: nn.Module) -> tuple[Optimizer, Callable[[int], float] | None]:
        """The event: this method builds the optimizer (and, with a schedule, its learning-rate factor)."""
        return self.build_optimizer(model), None if self.schedule is None else self.factor


def optimizer_factory(optimizer: str | Callable[..., Optimizer]) -> Callable[..., Optimizer]:
    """A `torch.optim` class by name, or the callable given.

    Example:
        >>> optimizer_factory("SGD")
        <class 'torch.optim.sgd.SGD'>
        >>> optimizer_factory("Adamm")
        Traceback (most recent call last):
        ...
        ValueError: optimizer='Adamm' is not a torch.optim optimizer (AdamW, Adam, SGD, ...)
    """
    if isinstance(optimizer, str):
        found = getattr(torch.optim, optimizer, None)
        if not (isinstance(found, type) and issubclass(found, Optimizer)):
            raise ValueError(f"optimizer={optimizer!r} is not a torch.optim optimizer (AdamW, Adam, SGD, ...)")
        return found
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a torch.optim class name or a callable, got {optimizer!r}")
    return optimizer


@register_method(docs="methods/layerwise-lr.md", config=False)
class FreezeLayers(Method):
    """Freezes layer groups (`"embeddings"`, `"layer0"`, ... or layer indices) for the first `epochs` epochs.

    Unlike Lightning's `BackboneFinetuning` it never adds parameter groups: the frozen parameters stay in
    the optimizer (`check_optimizer` says so when they are not) and only lose their gradients, so the
    optimizer and any scheduler keep their shape and resuming at any epoch restores the same state.
    `unbind` restores `requires_grad`.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert")
        >>> freeze = FreezeLayers(["embeddings", 0, 1], epochs=1)    # train the pooler first
        >>> freeze.bind(model); freeze.before_epoch(0)               # frozen; before_epoch(1) unfreezes
        >>> [name for name, param in model.named_parameters() if param.requires_grad]
        ['pooler.dense.weight', 'pooler.dense.bias']
        >>> freeze.check_optimizer([torch.optim.SGD(model.pooler.parameters(), lr=0.1)])
        Traceback (most recent call last):
        ...
        ValueError: FreezeLayers: 37 parameters of groups ['embeddings', 0, 1] are not in any optimizer, ...
        >>> freeze.unbind(); all(param.requires_grad for param in model.parameters())
        True
    """

    default_name = "freeze_layers"

    def __init__(self, groups: Iterable[LayerKey] | LayerKey, epochs: int) -> None:
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be an integer >= 1, got {epochs!r}")
        super().__init__()
        self.groups = groups
        self.epochs = epochs
        self._params: list[nn.Parameter] = []
        self._original: list[bool] = []

    def identity(self) -> dict[str, Any]:
        return {"groups": self.groups, "epochs": self.epochs}

    def bind(self, model: nn.Module, taken: Collection[str] = ()) -> None:
        super().bind(model, taken)
        model = self.model  # the transformers model (inside a PEFT model, say)
        layers = parameters_by_layer(model)
        names = resolve_layer_groups(self.groups, list(layers), "groups")
        self._params = [param for name in dict.fromkeys(names) for _, param in layers[name]]
        self._original = [param.requires_grad for param in self._params]

    def check_optimizer(self, optimizers: Iterable[Optimizer]) -> None:
        """Raise unless every parameter this method freezes is in one of `optimizers`."""
        in_optimizer = {id(p) for optimizer in optimizers for g in optimizer.param_groups for p in g["params"]}
        missing = sum(id(param) not in in_optimizer for param in self._params)
        if missing:
            raise ValueError(
                f"FreezeLayers: {missing} parameters of groups {self.groups!r} are not in any optimizer, so they would "
                "never train after unfreezing; keep them in the optimizer (LayerwiseLR does unless freeze= names them)"
            )

    def before_epoch(self, epoch: int) -> None:
        """Freeze or unfreeze for `epoch` (0-based)."""
        frozen = epoch < self.epochs
        for param, original in zip(self._params, self._original, strict=True):
            param.requires_grad_(original and not frozen)

    def on_fit_start(self, loop: Loop) -> None:
        self.check_optimizer(loop.optimizers)

    def on_epoch_begin(self, loop: Loop) -> None:
        self.before_epoch(loop.epoch)

    def teardown(self) -> None:
        """Every parameter's `requires_grad` comes back."""
        for param, original in zip(self._params, self._original, strict=True):
            param.requires_grad_(original)

    def unbind(self) -> None:
        self.teardown()
        self._params, self._original = [], []
        super().unbind()
