"""The Lightning adapter's callbacks: each is a thin shell that builds its method and hands it to the
LightningModule's `attnreg.methods.Runner` (`attnreg.mixin.runner_of`), which does the rest.

`MethodCallback(method)` runs any `attnreg.methods.Method` (one of attnreg's, or your own); a subclass names
its `method_class` and takes that class's arguments (`attnreg.SyntaxPriorKL(...)`); `callback.method` is the
method, which holds the settings and state. Each built-in method (`attnreg.methods.method_entries()`) has such a
subclass of its name, its drop-in callback (`drop_in_callback`). In `setup` each callback adds its method to the
runner, which binds it to the module's transformers model under a name no other holds (before
`configure_optimizers`, so gates exist for it); the first attnreg callback of the trainer sends the runner
Lightning's events (`attnreg.callbacks.events`). Each callback keeps its method's state in Lightning
checkpoints. Terms go through `attnreg.AttnRegMixin`.

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
from collections.abc import Callable
from typing import Any

import lightning as L

from attnreg import deprecations
from attnreg.callbacks.events import LightningEvents
from attnreg.compat import callback_state_key
from attnreg.methods import Method, Runner, entry_of
from attnreg.mixin import require_mixin, runner_of
from attnreg.structure import keep_base_in_adapter_saves
from attnreg.unwrap import find_transformers_model


class MethodCallback(LightningEvents):
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

    def __init_subclass__(cls, drop_in: bool = False, **kwargs: Any) -> None:
        """`drop_in=True`: the class is its built-in method's drop-in callback (`drop_in_callback`)."""
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("method_class") is not None:
            cls.__signature__ = inspect.signature(cls.method_class)
        if drop_in:
            DROP_INS[cls.method_class] = cls

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if self.method_class is None:  # MethodCallback(method): any method object, yours included
            if len(args) != 1 or kwargs or not isinstance(args[0], Method):
                raise TypeError("MethodCallback(method) takes one attnreg.methods.Method object")
            self.method = args[0]
        else:
            self.method = self.method_class(*args, **kwargs)
        super().__init__()
        self.fit_trainer: L.Trainer | None = None

    def __getattr__(self, name: str) -> Any:
        """Only for a missing attribute: an AttributeError that names the method's, where it has one.

        Example:
            >>> from attnreg.callbacks import EntropyRegularizer
            >>> EntropyRegularizer(mode="max").mode
            Traceback (most recent call last):
            ...
            AttributeError: 'EntropyRegularizer' object has no attribute 'mode': read `.method.mode` (the method
            holds the settings and state)
        """
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {name!r}{self._method_hint(name, 'read')}"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        """Refuses a setting of the method set on the callback (the method would never read it).

        Example:
            >>> from attnreg.callbacks import AttentionMonitor
            >>> AttentionMonitor().tokenizer = None
            Traceback (most recent call last):
            ...
            AttributeError: 'AttentionMonitor' object has no setting 'tokenizer': set `.method.tokenizer` (the method
            holds the settings and state)
        """
        if not name.startswith("_") and name not in vars(self) and not hasattr(type(self), name):
            hint = self._method_hint(name, "set")
            if hint:
                raise AttributeError(f"{type(self).__name__!r} object has no setting {name!r}{hint}")
        super().__setattr__(name, value)

    def _method_hint(self, name: str, verb: str) -> str:
        method = self.__dict__.get("method")
        if method is None or name.startswith("__") or not hasattr(method, name):
            return ""
        return f": {verb} `.method.{name}` (the method holds the settings and state)"

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
        keep_base_in_adapter_saves(pl_module)  # a LoRA model's save_pretrained, where its base weights changed
        return runner

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" or self.all_stages:
            self.fit_trainer = trainer
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
        return lambda: self.method.current_weight(self.fit_trainer.global_step if self.fit_trainer is not None else 0)

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


DROP_INS: dict[type[Method], type[MethodCallback]] = {}
"""{built-in method class: its drop-in callback}, as `drop_in_callback` made or found them."""


def drop_in_callback(method_class: type[Method]) -> type[MethodCallback]:
    """The drop-in Lightning callback of a built-in method (`attnreg.<its name>`): the subclass written out in
    `attnreg.callbacks` where it adds something of its own (`class HeadGating(MethodCallback, drop_in=True)`, with
    `prune`), else a `MethodCallback` subclass of the method's name, made once, in `attnreg.callbacks`.

    Example:
        >>> from attnreg.methods import EntropyRegularizer
        >>> Entropy = drop_in_callback(EntropyRegularizer)
        >>> Entropy.__module__, Entropy.__qualname__, Entropy(mode="max").method.mode
        ('attnreg.callbacks', 'EntropyRegularizer', 'max')
        >>> Entropy is drop_in_callback(EntropyRegularizer), "mode" in inspect.signature(Entropy).parameters
        (True, True)
    """
    if method_class not in DROP_INS:
        entry = entry_of(method_class)
        if entry is None or entry.method_class is not method_class:
            raise TypeError(f"{method_class.__name__} is not a built-in method: run it with MethodCallback(method)")
        summary = (inspect.getdoc(method_class) or "").split("\n\n")[0]
        mixin = (
            " The LightningModule needs `attnreg.AttnRegMixin` (its term)."
            if method_class.term is not Method.term
            else ""
        )
        doc = (
            f"{summary}\n\nThe drop-in Lightning callback of `attnreg.methods.{entry.callback}`: it takes the method's "
            f"arguments and runs it through the module's runner; `.method` is the method (docs: {entry.docs}).{mixin}"
        )
        namespace = {
            "method_class": method_class,
            "__module__": __package__,
            "__qualname__": entry.callback,
            "__doc__": doc,
        }
        type(entry.callback, (MethodCallback,), namespace, drop_in=True)
    return DROP_INS[method_class]


def renamed_callback(old: str) -> type[MethodCallback]:
    """`MethodCallback`, with a FutureWarning that its former name `old` (`TermCallback`) is deprecated: every
    `MethodCallback` adds its method's term. Called by the modules that exported the old name.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     from attnreg.callbacks.base import TermCallback
        >>> TermCallback is MethodCallback, caught[0].category.__name__
        (True, 'FutureWarning')
    """
    deprecations.warn(old, stacklevel=3)
    return MethodCallback


def __getattr__(name: str) -> type[MethodCallback]:
    if name == "TermCallback":
        return renamed_callback(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
