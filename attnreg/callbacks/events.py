"""Lightning's hooks translated into the runner's events: `LightningEvents`, the base of every attnreg callback.

The first attnreg callback of the trainer (`drives`) sends the module's runner (`attnreg.mixin.runner_of`) the
events for every method at once, with a `Loop`: the training length and, for a method that builds the optimizer,
its optimizer and learning-rate factor in place of the module's at `on_fit_start`; `on_step_begin` on the first
micro-batch of each optimizer step, `on_before_optimizer_step`, `on_step_end` once the optimizer stepped, the
epoch events, `on_fit_end` (and `teardown`, in `attnreg.callbacks.base`). Under `DDPStrategy` a method that gives
the module new parameters during training (a removal of heads) has Lightning's DDP wrapper rebuilt
(`Loop.rewrap`); under a sharding strategy or DeepSpeed the loop has no `rewrap`.

Example:
    >>> import lightning
    >>> from attnreg.callbacks import AttentionDropoutSchedule, EntropyRegularizer
    >>> first, second = EntropyRegularizer(), AttentionDropoutSchedule(0.1)
    >>> trainer = lightning.Trainer(callbacks=[lightning.Callback(), first, second], logger=False)
    >>> first.drives(trainer), second.drives(trainer)        # the first attnreg callback sends the events
    (True, False)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim.lr_scheduler import LambdaLR

from attnreg.compat import lightning_rewrap
from attnreg.methods import Loop
from attnreg.mixin import runner_of


class LightningEvents(L.Callback):
    """Translates Lightning's hooks into the runner's events, where this is the trainer's first attnreg callback."""

    def __init__(self) -> None:
        self._factor: Any = None  # a built optimizer's learning-rate factor per step
        self._batch: Any = None  # the last training batch, without the entries only the methods read
        self._stepped = -1  # the last global step whose `on_step_end` was sent

    def drives(self, trainer: L.Trainer) -> bool:
        """Whether this callback is the trainer's first attnreg callback (which sends the runner its events)."""
        return next(c for c in trainer.callbacks if isinstance(c, LightningEvents)) is self

    def loop(self, trainer: L.Trainer, pl_module: L.LightningModule, epoch: int | None = None) -> Loop:
        """Where the run stands, for the methods' events."""
        boards = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]

        def log(figures: Mapping[str, float]) -> None:
            for name, value in figures.items():
                pl_module.log(f"attnreg/{name}", value, on_step=True, on_epoch=False)

        def report(figures: Mapping[str, float]) -> None:
            for logger in trainer.loggers:
                logger.log_metrics(dict(figures), step=trainer.global_step)

        def figure(name: str, image: Any) -> None:
            for logger in boards:
                logger.experiment.add_figure(name, image, global_step=trainer.global_step)

        def stop() -> None:
            trainer.should_stop = True

        return Loop(
            step=trainer.global_step,
            epoch=trainer.current_epoch if epoch is None else epoch,
            optimizers=list(trainer.optimizers),
            batch=self._batch,
            output_dir=Path(trainer.default_root_dir),
            world_size=trainer.world_size,
            is_main=trainer.is_global_zero,
            broadcast=lambda value: trainer.strategy.broadcast(value, src=0),
            rewrap=lightning_rewrap(trainer.strategy),
            engine=f"Lightning's {type(trainer.strategy).__name__}",
            log=log,
            report=report,
            figure=figure if boards else None,
            stop=stop,
        )

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.drives(trainer):
            return
        runner = runner_of(pl_module)
        runner.start(trainer.estimated_stepping_batches)
        built = runner.optimizer(pl_module)
        if built is not None:  # replaces the module's, as StochasticWeightAveraging replaces schedulers
            if len(trainer.optimizers) != 1:
                raise ValueError(
                    f"{[type(m).__name__ for m in runner.methods if m.configure_optimizer(pl_module)]} replaces the "
                    f"module's one optimizer; configure_optimizers returned {len(trainer.optimizers)}"
                )
            optimizer, self._factor = built
            trainer.strategy.optimizers = [optimizer]
            schedulers = []
            if self._factor is not None:
                schedulers = [LRSchedulerConfig(LambdaLR(optimizer, self._factor), interval="step")]
            trainer.strategy.lr_scheduler_configs = schedulers
        runner.fit_start(self.loop(trainer, pl_module))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After a resume (Lightning restores the optimizer after `on_fit_start`), a built optimizer's groups
        take the rate of the factor at the restored step: the checkpoint holds the rates of its own length."""
        if self._factor is None or not self.drives(trainer):
            return
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
                group["lr"] = base * self._factor(scheduler.last_epoch)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, index: int) -> None:
        if self.drives(trainer) and index % trainer.accumulate_grad_batches == 0:  # an optimizer step's first
            runner_of(pl_module).step_begin(self.loop(trainer, pl_module))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.drives(trainer):
            runner_of(pl_module).before_optimizer_step(self.loop(trainer, pl_module))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, index: int
    ) -> None:
        self._batch = runner_of(pl_module).model_inputs(batch)
        if self.drives(trainer) and trainer.global_step != self._stepped:  # the optimizer stepped on this batch
            self._stepped = trainer.global_step
            runner_of(pl_module).step_end(self.loop(trainer, pl_module))

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.drives(trainer):
            runner_of(pl_module).epoch_begin(self.loop(trainer, pl_module))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.drives(trainer):
            runner_of(pl_module).epoch_end(self.loop(trainer, pl_module, epoch=trainer.current_epoch + 1))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.drives(trainer):
            runner_of(pl_module).fit_end(self.loop(trainer, pl_module))
