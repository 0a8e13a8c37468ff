"""The Lightning adapter's callbacks: each is a thin shell that builds its method and hands it to the
LightningModule's `attnreg.methods.Runner` (`attnreg.mixin.runner_of`), which does the rest.

`MethodCallback(method)` runs any `attnreg.methods.Method` (one of attnreg's, or your own); a subclass names
its `method_class` and takes that class's arguments (`attnreg.SyntaxPriorKL(...)`); `callback.method` is the
method. In `setup` each callback adds its method to the runner, which binds it to the module's transformers
model under a name no other holds (before `configure_optimizers`, so gates exist for it). The first
attnreg callback of the trainer translates Lightning's hooks into the runner's events, for every method at
once, with a `Loop`: the training length and, for a method that builds the optimizer, its optimizer and
learning-rate factor in place of the module's at `on_fit_start`; `on_step_begin` on the first micro-batch
of each optimizer step, `on_before_optimizer_step`, `on_step_end` once the optimizer stepped, the epoch
events, `on_fit_end`, `teardown`. Each callback keeps its method's state in Lightning checkpoints. Terms go through
`attnreg.AttnRegMixin`. Under `DDPStrategy` a method that gives the module new parameters during training
(a removal of heads) has Lightning's DDP wrapper rebuilt (`Loop.rewrap`); under a sharding strategy or
DeepSpeed the loop has no `rewrap`.

Example:
    >>> from attnreg.methods import EntropyRegularizer
    >>> class Sharpen(MethodCallback):
    ...     method_class = EntropyRegularizer                      # takes EntropyRegularizer's arguments
    >>> callback = Sharpen(mode="min", weight=0.1, layers=[0])
    >>> callback.method.mode, callback.method.weight, callback.method.name
    ('min', 0.1, 'entropy_regularizer')
    >>> "mode" in inspect.signature(Sharpen).parameters
    True
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim.lr_scheduler import LambdaLR

from attnreg.compat import callback_state_key, lightning_rewrap
from attnreg.methods import Loop, Method, Runner
from attnreg.mixin import require_mixin, runner_of
from attnreg.unwrap import find_transformers_model


class MethodCallback(L.Callback):
    """Runs one `attnreg.methods.Method` in a Lightning fit, through the module's runner.

    Example:
        >>> from attnreg.methods import AttentionDropoutSchedule
        >>> class Dropout(MethodCallback):
        ...     method_class = AttentionDropoutSchedule
        >>> callback = Dropout(0.1, layers=[0])
        >>> callback.method.schedule, callback.method.layers_argument
        (Constant(value=0.1), [0])
    """

    method_class: type[Method] | None = None
    all_stages = False  # bound in every stage (validate, test), not only in fit

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("method_class") is not None:
            cls.__signature__ = inspect.signature(cls.method_class)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if self.method_class is None:  # MethodCallback(method): any method object, yours included
            if len(args) != 1 or kwargs or not isinstance(args[0], Method):
                raise TypeError("MethodCallback(method) takes one attnreg.methods.Method object")
            self.method = args[0]
        else:
            self.method = self.method_class(*args, **kwargs)
        self._factor = None
        self._batch: Any = None
        self._stepped = -1
        self._trainer: L.Trainer | None = None

    def __getattr__(self, name: str) -> Any:
        """Deprecated: `callback.<setting>` reads `callback.method.<setting>`, with a warning (for one release)."""
        method = self.__dict__.get("method")
        if method is None or name.startswith("__") or not hasattr(method, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        _warn_moved(self, name)
        return getattr(method, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """Deprecated: setting one of the method's settings on the callback sets it on the method, with a warning."""
        method = self.__dict__.get("method")
        if method is not None and name in vars(method) and name not in vars(self):
            _warn_moved(self, name)
            setattr(method, name, value)
        else:
            super().__setattr__(name, value)

    @property
    def state_key(self) -> str:
        """Lightning's key for this callback's checkpoint state: distinct for differently set instances."""
        return callback_state_key(self, **self.method.identity())

    def bind(self, trainer: L.Trainer | None, pl_module: Any) -> Runner:
        """Hand the method to the module's runner, bound to its transformers model (what `setup` does).

        Example:
            >>> from attnreg.callbacks import AttentionDropoutSchedule
            >>> from attnreg.tiny import tiny_model
            >>> callback = AttentionDropoutSchedule(0.1)
            >>> runner = callback.bind(None, tiny_model("gpt2"))       # here without a trainer
            >>> callback.method.name, callback.method.layers, runner.methods == [callback.method]
            ('attention_dropout_schedule', (0, 1), True)
        """
        if self.method.has_term:
            require_mixin(pl_module, self)
        runner = runner_of(pl_module)
        runner.add(self.method)
        runner.bind(find_transformers_model(pl_module))
        return runner

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" or self.all_stages:
            self._trainer = trainer
            self.bind(trainer, pl_module)

    @property
    def current_weight(self) -> Callable[[], float]:
        """`current_weight()`: the weight of the method's term at the current optimizer step (0 before fit);
        only for a method with a weight.

        Example:
            >>> from attnreg.callbacks import EntropyRegularizer
            >>> from attnreg.schedules import Linear
            >>> EntropyRegularizer(weight=Linear(0.1, 0.0)).current_weight()    # step 0 before fit
            0.1
        """
        if not hasattr(self.method, "current_weight"):
            raise AttributeError(f"{type(self.method).__name__} has no weight")
        return lambda: self.method.current_weight(self._trainer.global_step if self._trainer is not None else 0)

    # -- Lightning's hooks, translated by the first attnreg callback for the whole runner ------------------
    def drives(self, trainer: L.Trainer) -> bool:
        """Whether this callback is the trainer's first attnreg callback (which sends the runner its events)."""
        return next(c for c in trainer.callbacks if isinstance(c, MethodCallback)) is self

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

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" and not self.all_stages:
            return
        runner = runner_of(pl_module)
        if stage == "fit" and self.drives(trainer):
            runner.teardown()  # every method's, before any lets go
        runner.remove(self.method)
        self.method.unbind()

    def state_dict(self) -> dict[str, Any]:
        """The method's state, under the callback's `state_key` (readable after fit too)."""
        return self.method.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.method.load_state_dict(state_dict)


def _warn_moved(callback: MethodCallback, name: str) -> None:
    warnings.warn(
        f"{type(callback).__name__}.{name} is deprecated: use {type(callback).__name__}.method.{name} (the method's "
        "setting or state; the callback only hands the method to the runner)",
        DeprecationWarning,
        stacklevel=3,
    )


TermCallback = MethodCallback
"""The former name of a callback with a loss term: every `MethodCallback` adds its method's term."""
