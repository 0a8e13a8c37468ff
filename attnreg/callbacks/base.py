"""The Lightning adapter of a method object: when Lightning calls what.

`MethodCallback` binds its method to the LightningModule's transformers model in `setup` (before
`configure_optimizers`, so gates exist for it), fixes the training length in `on_fit_start`, keeps the
method's state in Lightning checkpoints (under a key that tells two instances of one class apart) and
unbinds it in `teardown`. The method's attributes read and write through the callback (`callback.name`,
`callback.layers`). `TermCallback` adds a loss term through `attnreg.AttnRegMixin`.

Example:
    >>> from attnreg.methods import Entropy
    >>> class Sharpen(TermCallback):
    ...     method_class = Entropy                      # takes Entropy's arguments
    >>> callback = Sharpen(mode="min", weight=0.1, layers=[0])
    >>> callback.mode, callback.weight, callback.name   # the method's attributes
    ('min', 0.1, 'entropy')
    >>> "mode" in inspect.signature(Sharpen).parameters
    True
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning as L
import torch

from attnreg.hub import AttentionRecord, find_transformers_model
from attnreg.methods import Method
from attnreg.methods.regularizers import LossTerm
from attnreg.mixin import AttnRegMixin, require_mixin


class MethodCallback(L.Callback):
    """Runs one `attnreg.methods.Method` in a Lightning fit. A subclass names its `method_class` and
    takes that class's arguments (its signature shows them).

    Example:
        >>> from attnreg.methods import DropoutSchedule
        >>> class Dropout(MethodCallback):
        ...     method_class = DropoutSchedule
        >>> callback = Dropout(0.1, layers=[0])
        >>> callback.schedule, callback.method.layers_argument
        (Constant(value=0.1), [0])
    """

    method_class: type[Method] = Method

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "method_class" in cls.__dict__:
            cls.__signature__ = inspect.signature(cls.method_class)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.method = self.method_class(*args, **kwargs)

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
        return self._generate_state_key(**self.method.identity())

    def bind(self, trainer: L.Trainer | None, pl_module: L.LightningModule) -> None:
        """Bind the method to the module's transformers model, with a name no other attnreg method or
        term of this fit holds.

        Example:
            >>> from attnreg.callbacks import AttentionDropoutSchedule
            >>> from attnreg.tiny import tiny_model
            >>> callback = AttentionDropoutSchedule(0.1)
            >>> callback.bind(None, tiny_model("gpt2"))       # what `setup` does at the start of fit
            >>> callback.name, callback.layers
            ('attention_dropout', (0, 1))
        """
        taken = set(pl_module.attnreg_terms) if isinstance(pl_module, AttnRegMixin) else set()
        others = trainer.callbacks if trainer is not None else []
        taken |= {c.method.name for c in others if isinstance(c, MethodCallback) and c is not self and c.method.hub}
        self.method.bind(find_transformers_model(pl_module), taken)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.bind(trainer, pl_module)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.method.start(trainer.estimated_stepping_batches)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
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
        >>> from attnreg.modules import SequenceClassifier
        >>> from attnreg.tiny import tiny_model
        >>> module = SequenceClassifier(tiny_model("bert", head="classification"))
        >>> callback = EntropyRegularizer(layers=[1])
        >>> callback.setup(None, module, stage="fit")              # what fit does first
        >>> module.attnreg_terms["entropy"].layers
        (1,)
    """

    method: LossTerm

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
        step = module.global_step if module is not None and module._trainer is not None else 0
        return self.method.current_weight(step)

    def term(self, probs: AttentionRecord, batch: Any) -> torch.Tensor:
        module = self._module
        value, figures = self.method.term(probs, batch, module.global_step)
        sync = module._trainer is not None and module.trainer.world_size > 1
        for name, figure in figures.items():
            module.log(f"attnreg/{name}", figure, sync_dist=sync)
        return value

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if isinstance(pl_module, AttnRegMixin):
            pl_module.remove_attnreg_term(self.method.name)
        self.__dict__.pop("_module", None)
        super().teardown(trainer, pl_module, stage)
