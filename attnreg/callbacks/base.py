"""The Lightning adapter of a method object: Lightning's hooks, translated into the method's events.

`MethodCallback` runs any `attnreg.methods.Method` (one of attnreg's, or your own: `MethodCallback(method)`)
and never names a method class. It binds the method to the LightningModule's transformers model in `setup`
(before `configure_optimizers`, so gates exist for it), fixes the training length and, for a method that
builds the optimizer, puts its optimizer and learning-rate factor in place of the module's in
`on_fit_start`, then sends the method its events with a `Loop` (`on_step_begin` on the first micro-batch of
each optimizer step, `on_before_optimizer_step`, `on_step_end` once the optimizer stepped, the epoch
events, `on_fit_end`, `teardown`). Its state goes in Lightning checkpoints under a key that tells two
instances of one class apart. The method's attributes read and write through the callback
(`callback.name`, `callback.layers`). `TermCallback` adds a loss term through `attnreg.AttnRegMixin`.
Under `DDPStrategy` a method that gives the module new parameters during training (a removal of heads) has
Lightning's DDP wrapper rebuilt (`Loop.rewrap`); under a sharding strategy (`ModelParallelStrategy`,
`FSDPStrategy`) or DeepSpeed the loop has no `rewrap`. A term or figure a method computes on sharded
parameters (a `DTensor`) is logged whole.

Example:
    >>> from attnreg.methods import EntropyRegularizer
    >>> class Sharpen(TermCallback):
    ...     method_class = EntropyRegularizer                      # takes EntropyRegularizer's arguments
    >>> callback = Sharpen(mode="min", weight=0.1, layers=[0])
    >>> callback.mode, callback.weight, callback.name   # the method's attributes
    ('min', 0.1, 'entropy_regularizer')
    >>> "mode" in inspect.signature(Sharpen).parameters
    True
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim.lr_scheduler import LambdaLR

from attnreg.compat import callback_state_key, lightning_rewrap, lightning_trainer
from attnreg.hub import AttentionRecord, find_transformers_model
from attnreg.methods import Loop, Method
from attnreg.methods.runner import full_value
from attnreg.mixin import AttnRegMixin, require_mixin


class MethodCallback(L.Callback):
    """Runs one `attnreg.methods.Method` in a Lightning fit. A subclass names its `method_class` and
    takes that class's arguments (its signature shows them).

    Example:
        >>> from attnreg.methods import AttentionDropoutSchedule
        >>> class Dropout(MethodCallback):
        ...     method_class = AttentionDropoutSchedule
        >>> callback = Dropout(0.1, layers=[0])
        >>> callback.schedule, callback.method.layers_argument
        (Constant(value=0.1), [0])
    """

    method_class: type[Method] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("method_class") is not None:
            cls.__signature__ = inspect.signature(cls.method_class)

    def __new__(cls, *args: Any, **kwargs: Any) -> MethodCallback:
        """`MethodCallback(method)` for a method with a loss term is a `TermCallback`."""
        if cls is MethodCallback and len(args) == 1 and isinstance(args[0], Method) and args[0].has_term:
            cls = TermCallback
        return super().__new__(cls)

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

    def __getattr__(self, name: str) -> Any:
        method = self.__dict__.get("method")
        if method is None:
            raise AttributeError(name)
        return getattr(method, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """A setting the method has is set on the method (`monitor.tokenizer = ...`), the rest here."""
        method = self.__dict__.get("method")
        if method is not None and name in vars(method) and name not in vars(self):
            setattr(method, name, value)
        else:
            super().__setattr__(name, value)

    @property
    def state_key(self) -> str:
        """Lightning's key for this callback's checkpoint state: distinct for differently set instances.

        Example:
            >>> from attnreg.callbacks import EntropyRegularizer
            >>> EntropyRegularizer(layers=[0]).state_key == EntropyRegularizer(layers=[1]).state_key
            False
        """
        return callback_state_key(self, **self.method.identity())

    def bind(self, trainer: L.Trainer | None, pl_module: L.LightningModule) -> None:
        """Bind the method to the module's transformers model, with a name no other attnreg method or
        term of this fit holds.

        Example:
            >>> from attnreg.callbacks import AttentionDropoutSchedule
            >>> from attnreg.tiny import tiny_model
            >>> callback = AttentionDropoutSchedule(0.1)
            >>> callback.bind(None, tiny_model("gpt2"))       # what `setup` does at the start of fit
            >>> callback.name, callback.layers
            ('attention_dropout_schedule', (0, 1))
        """
        taken = set(pl_module.attnreg_terms) if isinstance(pl_module, AttnRegMixin) else set()
        others = trainer.callbacks if trainer is not None else []
        taken |= {c.method.name for c in others if isinstance(c, MethodCallback) and c is not self and c.method.hub}
        self.method.bind(find_transformers_model(pl_module), taken)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.bind(trainer, pl_module)

    # -- Lightning's hooks, translated ------------------------------------------------------------------
    def loop(self, trainer: L.Trainer, pl_module: L.LightningModule, epoch: int | None = None) -> Loop:
        """Where the run stands, for the method's events."""
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
        self.method.start(trainer.estimated_stepping_batches)
        built = self.method.configure_optimizer(pl_module)
        if built is not None:  # replaces the module's, as StochasticWeightAveraging replaces schedulers
            if len(trainer.optimizers) != 1:
                count = len(trainer.optimizers)
                raise ValueError(
                    f"{type(self.method).__name__} replaces the module's one optimizer; configure_optimizers "
                    f"returned {count}"
                )
            optimizer, self._factor = built
            trainer.strategy.optimizers = [optimizer]
            schedulers = []
            if self._factor is not None:
                schedulers = [LRSchedulerConfig(LambdaLR(optimizer, self._factor), interval="step")]
            trainer.strategy.lr_scheduler_configs = schedulers
        self.method.on_fit_start(self.loop(trainer, pl_module))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After a resume (Lightning restores the optimizer after `on_fit_start`), a built optimizer's groups
        take the rate of the factor at the restored step: the checkpoint holds the rates of its own length."""
        if self._factor is None:
            return
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
                group["lr"] = base * self._factor(scheduler.last_epoch)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:  # the first micro-batch of an optimizer step
            self.method.on_step_begin(self.loop(trainer, pl_module))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.method.on_before_optimizer_step(self.loop(trainer, pl_module))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batch = batch
        if trainer.global_step != self._stepped:  # the optimizer stepped on this batch
            self._stepped = trainer.global_step
            self.method.on_step_end(self.loop(trainer, pl_module))

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.method.on_epoch_begin(self.loop(trainer, pl_module))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.method.on_epoch_end(self.loop(trainer, pl_module, epoch=trainer.current_epoch + 1))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.method.on_fit_end(self.loop(trainer, pl_module))

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.method.teardown()
            self.method.unbind()

    def state_dict(self) -> dict[str, Any]:
        return self.method.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.method.load_state_dict(state_dict)


class TermCallback(MethodCallback):
    """Adds a `LossTerm`'s weighted term to every training loss through `attnreg.AttnRegMixin`, logged
    as `attnreg/<name>`, with the method's figures as `attnreg/<figure>`.

    Example:
        >>> from attnreg.callbacks import EntropyRegularizer
        >>> from attnreg.app.modules import SequenceClassifier
        >>> from attnreg.tiny import tiny_model
        >>> module = SequenceClassifier(tiny_model("bert", head="classification"))
        >>> callback = EntropyRegularizer(layers=[1])
        >>> callback.setup(None, module, stage="fit")              # what fit does first
        >>> module.attnreg_terms["entropy_regularizer"].layers
        (1,)
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        module = require_mixin(pl_module, self)
        if self.__dict__.get("_module") is module:  # set up again: a second fit, or validate after fit
            module.remove_attnreg_term(self.method.name)
        self.bind(trainer, module)
        module.add_attnreg_term(self.method.name, self.term, self.method.layers, getattr(self.method, "inputs", False))
        self._module = module

    def current_weight(self) -> float:
        """The weight at the module's current global step.

        Example:
            >>> from attnreg.callbacks import EntropyRegularizer
            >>> from attnreg.schedules import Linear
            >>> EntropyRegularizer(weight=Linear(0.1, 0.0)).current_weight()    # step 0 before fit
            0.1
        """
        module = self.__dict__.get("_module")
        step = module.global_step if module is not None and lightning_trainer(module) is not None else 0
        return self.method.current_weight(step)

    def term(self, probs: AttentionRecord, batch: Any) -> torch.Tensor:
        module = self._module
        value, figures = self.method.term(probs, batch, module.global_step)
        sync = lightning_trainer(module) is not None and module.trainer.world_size > 1
        for name, figure in figures.items():  # sync_dist all-reduces: a DTensor has no rule for it
            module.log(f"attnreg/{name}", full_value(figure), sync_dist=sync)
        return full_value(value)

    def _drop_if_inactive(self) -> None:
        """A method whose term has stopped (gates folded at the last removal) leaves the loss."""
        module = self.__dict__.get("_module")
        if module is not None and not self.method.active:
            module.remove_attnreg_term(self.method.name)

    def on_train_batch_end(self, *args: Any) -> None:
        super().on_train_batch_end(*args)
        self._drop_if_inactive()

    def on_train_epoch_end(self, *args: Any) -> None:
        super().on_train_epoch_end(*args)
        self._drop_if_inactive()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._drop_if_inactive()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if isinstance(pl_module, AttnRegMixin):
            pl_module.remove_attnreg_term(self.method.name)
        self.__dict__.pop("_module", None)
        super().teardown(trainer, pl_module, stage)
