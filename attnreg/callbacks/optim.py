"""Per-layer learning rates and temporary freezing as Lightning callbacks, for modules you do not want to edit.

`LayerwiseLR` builds the optimizer and its learning-rate schedule with `attnreg.optim.layerwise_param_groups`.
It has to exist before any scheduler does (adding groups to a live optimizer breaks every torch 2.13
scheduler step), so the callback does not touch a built optimizer: in `setup` (which Lightning runs after
its configuration checks and before it calls `configure_optimizers`) it puts its own `configure_optimizers`
on the module instance, which Lightning then calls instead of the class's; `teardown` removes it. Lightning
checks that the module defines `configure_optimizers` before any callback runs, so the module still needs
one (any; it is not called while the callback is there). On resume Lightning builds the optimizer through
the same method, with the same groups in the same order, and then loads its state and the scheduler's.

`FreezeLayers` freezes layer groups for the first epochs without changing the optimizer's groups: it
only toggles `requires_grad` (a parameter without a gradient is skipped by torch's optimizers, weight
decay included), chosen from `trainer.current_epoch` at every epoch start, so a resumed run matches.

Example:
    >>> from attnreg.schedules import Linear, Warmup
    >>> lightning.Trainer(callbacks=[LayerwiseLR(lr=2e-5, decay=0.95, weight_decay=0.01,
    ...                                          schedule=Warmup(0.06, Linear(1.0, 0.0)))])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import lightning as L
import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from attnreg.optim import (
    LayerKey,
    electra_layer_factors,
    layerwise_param_groups,
    parameters_by_layer,
    resolve_layer_groups,
)
from attnreg.progress import TrainingLength, changes_over_training
from attnreg.schedules import ScheduleLike, as_schedule

_CONFIGURE = "configure_optimizers"


class LayerwiseLR(L.Callback):
    """Trains with `layerwise_param_groups(module, lr, decay, multipliers, freeze, weight_decay, no_decay)`.

    - `optimizer`: a `torch.optim` class name or any callable `(param_groups, **optimizer_kwargs)` returning
      an optimizer (a Hydra `_partial_`, say); AdamW by default.
    - `schedule`: optional learning-rate factor as a function of progress (an `attnreg.schedules` schedule),
      stepped every optimizer step; `Warmup(0.06, Linear(1.0, 0.0))` is linear warmup and decay.
    - `total_steps`: the steps the schedule spans; by default the trainer's `estimated_stepping_batches`
      (`attnreg.progress`: a run resumed with more steps re-stretches the schedule over them, with a warning).

    The module's own `configure_optimizers` is ignored while the callback is attached.

    Example:
        >>> LayerwiseLR(lr=1e-4, decay=0.8, multipliers={"head": 10.0}, freeze=["embeddings"])
    """

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
        self.length = TrainingLength("LayerwiseLR schedule", total_steps)
        self.group_options = dict(
            lr=lr, decay=decay, multipliers=multipliers, freeze=freeze, weight_decay=weight_decay, no_decay=no_decay
        )
        self.optimizer = _optimizer_factory(optimizer)
        self.optimizer_kwargs = dict(optimizer_kwargs or {})
        self.schedule = None if schedule is None else as_schedule(schedule, "schedule")
        self.total_steps = total_steps
        self._trainer: L.Trainer | None = None
        self._module: L.LightningModule | None = None
        self._scheduler: LambdaLR | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer, self._module, self._scheduler = trainer, pl_module, None
        # An instance attribute wins over the class's method when Lightning looks the hook up.
        pl_module.__dict__[_CONFIGURE] = self.configure_optimizers

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if pl_module.__dict__.get(_CONFIGURE) == self.configure_optimizers:
            del pl_module.__dict__[_CONFIGURE]
        self._trainer = self._module = None

    def configure_optimizers(self) -> Optimizer | dict[str, Any]:
        """What the module's `configure_optimizers` returns while the callback is attached."""
        if self._module is None:
            raise RuntimeError("LayerwiseLR.configure_optimizers is called by Lightning during fit")
        optimizer = self.optimizer(layerwise_param_groups(self._module, **self.group_options), **self.optimizer_kwargs)
        if self.schedule is None:
            return optimizer
        self.length.start(self._trainer.estimated_stepping_batches, changes_over_training(self.schedule))
        schedule, length = self.schedule, self.length

        def factor(step: int) -> float:
            return float(schedule(length.progress(step)))

        # A plain function: LambdaLR saves no state for it, so checkpoints hold no pickled schedule.
        self._scheduler = LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self._scheduler, "interval": "step"}}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After a resume (Lightning restores the optimizer after `on_fit_start`), set each group's rate
        from the schedule at the restored step: the checkpoint holds the rates of its own length."""
        scheduler = self._scheduler
        if scheduler is None:
            return
        for group, base, factor in zip(
            scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
        ):
            group["lr"] = base * factor(scheduler.last_epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.length.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.length.load_state_dict(state_dict)


class FreezeLayers(L.Callback):
    """Freezes layer groups (`"embeddings"`, `"layer0"`, ... or layer indices) for the first `epochs` epochs.

    Unlike Lightning's `BackboneFinetuning` it never adds parameter groups: the frozen parameters stay in
    the optimizer (they must be in it: checked at fit start) and only lose their gradients, so the
    optimizer and any scheduler keep their shape and resuming at any epoch restores the same state. Under
    DDP use a strategy that finds unused parameters. `requires_grad` is restored after `fit`.

    Example:
        >>> FreezeLayers(["embeddings", 0, 1], epochs=1)    # train the upper layers and head first
    """

    def __init__(self, groups: Iterable[LayerKey] | LayerKey, epochs: int) -> None:
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be an integer >= 1, got {epochs!r}")
        self.groups = groups
        self.epochs = epochs
        self._params: list[torch.nn.Parameter] = []
        self._original: list[bool] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        layers = parameters_by_layer(pl_module)
        names = resolve_layer_groups(self.groups, list(layers), "groups")
        self._params = [param for name in dict.fromkeys(names) for _, param in layers[name]]
        self._original = [param.requires_grad for param in self._params]

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        in_optimizer = {id(p) for optimizer in trainer.optimizers for g in optimizer.param_groups for p in g["params"]}
        missing = sum(id(param) not in in_optimizer for param in self._params)
        if missing:
            raise ValueError(
                f"FreezeLayers: {missing} parameters of groups {self.groups!r} are not in any optimizer, so they would "
                "never train after unfreezing; keep them in configure_optimizers (LayerwiseLR does unless frozen= "
                "names them)"
            )

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        frozen = trainer.current_epoch < self.epochs
        for param, original in zip(self._params, self._original, strict=True):
            param.requires_grad_(original and not frozen)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for param, original in zip(self._params, self._original, strict=True):
            param.requires_grad_(original)
        self._params, self._original = [], []


def _optimizer_factory(optimizer: str | Callable[..., Optimizer]) -> Callable[..., Optimizer]:
    if isinstance(optimizer, str):
        found = getattr(torch.optim, optimizer, None)
        if not (isinstance(found, type) and issubclass(found, Optimizer)):
            raise ValueError(f"optimizer={optimizer!r} is not a torch.optim optimizer (AdamW, Adam, SGD, ...)")
        return found
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a torch.optim class name or a callable, got {optimizer!r}")
    return optimizer
