"""Per-layer learning rates and temporary freezing as Lightning callbacks, for modules you do not want to edit.

`LayerwiseLR` trains with the optimizer and learning-rate schedule of `attnreg.methods.LayerwiseLR`
(`attnreg.optim.layerwise_param_groups`). The optimizer is built whole before its scheduler (adding groups
to a live optimizer breaks every torch 2.13 scheduler step) and replaces the module's at fit start; on
resume Lightning loads the checkpoint's optimizer and scheduler state into it.

`FreezeLayers` freezes layer groups for the first epochs without changing the optimizer's groups: it
only toggles `requires_grad` (a parameter without a gradient is skipped by torch's optimizers, weight
decay included), chosen from `trainer.current_epoch` at every epoch start, so a resumed run matches.

Example:
    >>> from attnreg.schedules import Linear, Warmup
    >>> lightning.Trainer(callbacks=[LayerwiseLR(lr=2e-5, decay=0.95, weight_decay=0.01,
    ...                                          schedule=Warmup(0.06, Linear(1.0, 0.0)))])
"""

from __future__ import annotations

from collections.abc import Iterable

import lightning as L
import torch
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim.lr_scheduler import LambdaLR

from attnreg import methods
from attnreg.callbacks.base import MethodCallback
from attnreg.optim import LayerKey, parameters_by_layer, resolve_layer_groups


class LayerwiseLR(MethodCallback):
    """Trains with `layerwise_param_groups(module, lr, decay, multipliers, freeze, weight_decay, no_decay)`
    (a thin adapter of `attnreg.methods.LayerwiseLR`, whose docstring lists the arguments).

    At fit start it replaces the optimizer (and the LR scheduler) that the module's `configure_optimizers`
    returned, as Lightning's `StochasticWeightAveraging` replaces scheduler configs: Lightning then
    restores a resumed run's optimizer and scheduler state into these. The module still needs a
    `configure_optimizers` (Lightning checks for one before callbacks run); its optimizer is not used.

    Example:
        >>> LayerwiseLR(lr=1e-4, decay=0.8, multipliers={"head": 10.0, "gates": 100.0}, freeze=["embeddings"])
    """

    method_class = methods.LayerwiseLR

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if len(trainer.optimizers) != 1:
            count = len(trainer.optimizers)
            raise ValueError(f"LayerwiseLR replaces the module's one optimizer; configure_optimizers returned {count}")
        optimizer = self.method.build_optimizer(pl_module)
        trainer.strategy.optimizers = [optimizer]
        schedulers = []
        if self.method.schedule is not None:
            schedulers = [LRSchedulerConfig(LambdaLR(optimizer, self.method.factor), interval="step")]
        trainer.strategy.lr_scheduler_configs = schedulers

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After a resume (Lightning restores the optimizer after `on_fit_start`), set each group's rate
        from the schedule at the restored step: the checkpoint holds the rates of its own length."""
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
                group["lr"] = base * self.method.factor(scheduler.last_epoch)


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
