"""`AttnRegMixin`: the LightningModule side of the Lightning adapter, on `attnreg.methods.Runner`.

A Lightning callback cannot change the loss (Lightning ignores what `on_before_backward` returns), so the
terms are added here: the mixin wraps the subclass's `training_step` and asks the module's runner
(`attnreg_runner`, which the callbacks of `attnreg.callbacks` hand their methods to) for the capture
and the loss. The user's step receives the batch without the entries only the methods read (a syntax
prior); every term is added to what it returns (a tensor, or a dict with "loss") and logged as
`attnreg/<name>`. In a checkpoint the module saves the model's structure (heads removed or silenced,
gates) and rebuilds it before the weights load (the runner's structure event).

Example:
    >>> import lightning
    >>> from torch.utils.data import DataLoader
    >>> from attnreg.tiny import tiny_model
    >>> class Classifier(AttnRegMixin, lightning.LightningModule):
    ...     def __init__(self, model):
    ...         super().__init__()
    ...         self.model = model
    ...     def training_step(self, batch, batch_idx):
    ...         return self.model(**batch).loss          # no attnreg code needed here
    ...     def configure_optimizers(self):
    ...         return torch.optim.SGD(self.parameters(), lr=0.1)
    >>> module = Classifier(tiny_model("bert", head="classification"))
    >>> module.add_attnreg_term("sharpen", lambda probs, batch: -probs[0].var(), layers=[0])
    >>> module.attnreg_terms["sharpen"]                 # attnreg.methods.AttentionLoss, on the module's runner
    AttentionLoss(name='sharpen', layers=(0,), weight=1.0, inputs=False)
    >>> batch = {"input_ids": torch.tensor([[2, 5, 6, 3]]), "labels": torch.tensor([1])}
    >>> trainer = lightning.Trainer(
    ...     max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    ... )
    >>> trainer.fit(module, DataLoader([batch], batch_size=None))
    >>> list(trainer.callback_metrics)                  # the term was added to the loss, and logged
    ['attnreg/sharpen']
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from attnreg.compat import lightning_trainer
from attnreg.hub import AttentionHub, attach, detach, is_attached
from attnreg.methods import AttentionLoss, Method, Runner
from attnreg.methods.loss_term import TermFunction, renamed_term
from attnreg.unwrap import find_transformers_model


def __getattr__(name: str) -> Any:
    """`AttentionTerm`, the former name of a term of a function: `attnreg.methods.AttentionLoss`, with a warning."""
    if name == "AttentionTerm":
        return renamed_term(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def runner_of(module: nn.Module) -> Runner:
    """The runner of a LightningModule (made on first use): the methods of its callbacks and terms."""
    runner = module.__dict__.get("_attnreg_runner")
    if runner is None:
        runner = module.__dict__["_attnreg_runner"] = Runner()
    return runner


class AttnRegMixin:
    """Mixin for a `lightning.LightningModule` that wraps a transformers model.

    The model is found among the module's submodules (set `attnreg_model_attr` to the attribute
    name where there is more than one) and attached on first use of `attnreg_hub`.

    Example:
        >>> import lightning
        >>> from attnreg.tiny import tiny_model
        >>> class Module(AttnRegMixin, lightning.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.model = tiny_model("gpt2")
        >>> module = Module()
        >>> type(module.attnreg_model).__name__, module.attnreg_hub.num_layers, module.attnreg_runner.methods
        ('GPT2Model', 2, [])
    """

    attnreg_model_attr: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Wrap the step the class resolves to, also when it is inherited from a module that predates the mixin.
        step = getattr(cls, "training_step", None)
        if step is not None and not getattr(step, "_attnreg_wrapped", False):
            cls.training_step = _add_terms_to(step)

    @property
    def attnreg_model(self) -> PreTrainedModel:
        return find_transformers_model(self)

    @property
    def attnreg_hub(self) -> AttentionHub:
        """The model's attention hub (attaching the model on first use)."""
        return attach(self.attnreg_model)

    @property
    def attnreg_runner(self) -> Runner:
        """The runner of the module's attnreg methods (`attnreg.methods.Runner`)."""
        return runner_of(self)

    @property
    def attnreg_terms(self) -> dict[str, Method]:
        """The methods with an active loss term, by name."""
        return {method.name: method for method in self.attnreg_runner.terms}

    def add_attnreg_term(
        self, name: str, fn: TermFunction, layers: int | Iterable[int] | None = (), inputs: bool = False
    ) -> None:
        """Add `fn(probs, batch)` to every training loss, logged as `attnreg/<name>`: an
        `attnreg.methods.AttentionLoss` on the module's runner (the callback `attnreg.AttentionLoss` is the same).

        `layers` are the attention layers `fn` reads from `probs` (None = all, () = none); with `inputs`,
        `fn` reads their `LayerInputs` instead (the layers stay on SDPA; see `attnreg.blockwise`).
        """
        runner = self.attnreg_runner
        if any(method.name == name for method in runner.methods):
            raise ValueError(f"an attnreg term named {name!r} is already registered on {type(self).__name__}")
        runner.add(AttentionLoss(fn, name=name, layers=layers, inputs=inputs))
        runner.bind(self.attnreg_model)

    def remove_attnreg_term(self, name: str) -> None:
        self.attnreg_runner.remove(name)

    def attnreg_loss(self) -> torch.Tensor:
        """The sum of all terms for the current training step, each logged.

        For users who compose the loss by hand inside `training_step`: once called, the terms are
        not added again to what the step returns.

        Example:
            >>> import lightning
            >>> from attnreg.tiny import tiny_model
            >>> class Module(AttnRegMixin, lightning.LightningModule):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.model = tiny_model("bert", head="classification")
            ...     def training_step(self, batch, batch_idx):
            ...         return self.model(**batch).loss + 0.5 * self.attnreg_loss()   # weighted by hand
            >>> Module().attnreg_loss()                  # outside a training step
            Traceback (most recent call last):
            ...
            RuntimeError: attnreg_loss() can only be called inside training_step (after the forward pass)
        """
        step = self.__dict__.get("_attnreg_step")
        if step is None:
            raise RuntimeError("attnreg_loss() can only be called inside training_step (after the forward pass)")
        captured, batch = step
        runner = self.attnreg_runner
        total = runner.loss(captured, batch, self.global_step)
        sync = _world_size(self) > 1
        for name, value in runner.figures().items():
            self.log(name, value, sync_dist=sync)
        self.__dict__["_attnreg_step"] = None
        self.__dict__["_attnreg_consumed"] = True
        return total if isinstance(total, torch.Tensor) else torch.zeros((), device=self.device)

    # -- checkpoints: the model's structure, rebuilt before the weights load ------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        with self._attnreg_structure_event() as runner:
            checkpoint.update(runner.structure())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        with self._attnreg_structure_event() as runner:
            runner.restore_structure(checkpoint)
        super().on_load_checkpoint(checkpoint)

    @contextmanager
    def _attnreg_structure_event(self) -> Iterator[Runner]:
        """The runner, bound to the model, for the structure event of a checkpoint. A model that nothing had attached
        and no method runs on (plain fine-tuning, `attnreg=none`) is detached again after it: a save leaves the model
        it saves as it was (its attention implementation), and a resumed run configures its optimizer for the model
        the checkpoint's run configured it for (a plain one: no "gates" group, `attnreg.app.modules.FineTuner`)."""
        model = self.attnreg_model
        plain = not is_attached(model)
        runner = self._attnreg_bound()
        try:
            yield runner
        finally:
            if plain and not runner.methods and is_attached(model) and not attach(model).gates:
                detach(model)

    def _attnreg_bound(self) -> Runner:
        runner = self.attnreg_runner
        runner.bind(self.attnreg_model)
        return runner


def _add_terms_to(training_step: Callable) -> Callable:
    @functools.wraps(training_step)
    def wrapped(self: AttnRegMixin, batch: Any, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_attnreg_step") is not None:
            return training_step(self, batch, *args, **kwargs)  # a super() call inside the step
        _warn_if_eval_mode(self)
        runner = self.attnreg_runner
        if not runner.terms:
            return training_step(self, runner.model_inputs(batch), *args, **kwargs)
        self.__dict__["_attnreg_consumed"] = False
        with runner.capture(self.attnreg_model, self.training and torch.is_grad_enabled()) as captured:
            self.__dict__["_attnreg_step"] = (captured, batch)
            try:
                output = training_step(self, runner.model_inputs(batch), *args, **kwargs)
                if self.__dict__["_attnreg_consumed"]:
                    return output
                if output is None:
                    raise RuntimeError(
                        f"{type(self).__name__}.training_step returned None, so attnreg's terms "
                        f"{sorted(self.attnreg_terms)} would be lost (Lightning skips the batch). Return the loss "
                        "(a model output without labels has loss=None), or a dict with 'loss'."
                    )
                return _add_loss(output, self.attnreg_loss())
            finally:
                self.__dict__["_attnreg_step"] = None

    wrapped._attnreg_wrapped = True
    return wrapped


class EvalModeWarning(UserWarning):
    """The transformers model is in eval mode while Lightning trains: dropout is off.

    Warned once per fit by the mixin; call `model.train()` after `from_pretrained`, before `trainer.fit`.

    Example:
        >>> issubclass(EvalModeWarning, UserWarning)
        True
    """


def _warn_if_eval_mode(module: AttnRegMixin) -> None:
    """Once per fit: transformers' `from_pretrained` returns eval mode, and Lightning 2.6 keeps it."""
    trainer = lightning_trainer(module)
    if trainer is None or module.__dict__.get("_attnreg_mode_checked") is trainer:
        return
    module.__dict__["_attnreg_mode_checked"] = trainer
    model = module.attnreg_model
    if module.training and not model.training:
        warnings.warn(
            f"{type(model).__name__} is in eval mode while {type(module).__name__} trains, so its dropout is off "
            "(attention and hidden) and every loss is computed without it. transformers' from_pretrained returns a "
            "model in eval mode and Lightning keeps it: call model.train() before trainer.fit.",
            EvalModeWarning,
            stacklevel=3,
        )


def _add_loss(output: Any, extra: torch.Tensor) -> Any:
    if isinstance(output, torch.Tensor):
        return output + extra
    if isinstance(output, dict) and "loss" in output:
        return {**output, "loss": output["loss"] + extra}
    raise TypeError(
        f"training_step returned {type(output).__name__}; attnreg can add its terms to a tensor or a dict with "
        "'loss'. Return one of those, or call self.attnreg_loss() and add it yourself."
    )


def require_mixin(pl_module: Any, user: object) -> AttnRegMixin:
    """Return `pl_module` if it uses `AttnRegMixin`, else raise an error telling how to add it.

    Example:
        >>> import lightning
        >>> class Plain(lightning.LightningModule):
        ...     pass
        >>> require_mixin(Plain(), user=object())
        Traceback (most recent call last):
        ...
        TypeError: object needs the LightningModule to use attnreg.AttnRegMixin; declare it as ...
    """
    if not isinstance(pl_module, AttnRegMixin):
        name = type(pl_module).__name__
        raise TypeError(
            f"{type(user).__name__} needs the LightningModule to use attnreg.AttnRegMixin; declare it as "
            f"`class {name}(attnreg.AttnRegMixin, lightning.LightningModule)`"
        )
    return pl_module


def _world_size(module: Any) -> int:
    trainer = lightning_trainer(module)
    return trainer.world_size if trainer is not None else 1
