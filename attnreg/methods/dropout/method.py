"""Attention (and optionally hidden) dropout that follows a schedule of training progress.

transformers reads dropout rates from the config only when it builds a model; this method sets the
rate through the attention hub before every optimizer step, so it works on every supported family (the
hub's registered attention function passes it on; Llama and Qwen2 have no dropout module to change).
Eval needs nothing: every family passes `dropout=0.0` to the attention function when the attention
module is not training, and the hub only overrides the rate in training.

Example:
    >>> from attnreg.schedules import EarlyDropout
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("bert", head="classification")
    >>> dropout = AttentionDropoutSchedule(EarlyDropout(0.1, cutoff=0.25), hidden=0.1)
    >>> dropout.bind(model, taken=set()); dropout.start(estimated_steps=1000)
    >>> dropout.before_step(step=100)
    {'attention_dropout_schedule': 0.1, 'hidden_dropout': 0.1}
    >>> dropout.before_step(step=500)
    {'attention_dropout_schedule': 0.0, 'hidden_dropout': 0.1}
    >>> dropout.unbind(); model.bert.encoder.layer[0].output.dropout.p    # the model's own rate again
    0.0
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

from torch import nn

from attnreg.families import Family
from attnreg.methods.base import Loop, Method
from attnreg.methods.registry import register_method
from attnreg.schedules import Constant, ScheduleLike, as_schedule, schedule_values


def hidden_dropout_modules(model: nn.Module, family: Family, layers: Iterable[int] | None = None) -> list[nn.Dropout]:
    """The `nn.Dropout` modules of `model` other than attention-probability dropout.

    All of the model's (embeddings, blocks, task head) for `layers=None`, else those inside the given
    blocks. GPT-2's `resid_dropout` is one (it sits in the attention module but drops its output).

    Example:
        >>> from attnreg.families import detect_family
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert", head="classification")
        >>> family = detect_family(model)
        >>> len(hidden_dropout_modules(model, family)), len(hidden_dropout_modules(model, family, layers=[1]))
        (6, 2)
        >>> for module in hidden_dropout_modules(model, family, layers=[1]):
        ...     module.p = 0.2
    """
    blocks = family.blocks(model)
    attention_dropouts = {
        id(getattr(family.attention_module(model, index), family.dropout_attr)) for index in range(len(blocks))
    }
    scopes = [model] if layers is None else [blocks[index] for index in layers]
    return [
        module
        for scope in scopes
        for module in scope.modules()
        if isinstance(module, nn.Dropout) and id(module) not in attention_dropouts
    ]


@register_method(docs="methods/dropout.md")
class AttentionDropoutSchedule(Method):
    """Attention dropout at `schedule(progress)` on `layers` (None = all), set before every step.

    - `schedule`: an `attnreg.schedules` schedule, any callable of progress in [0, 1], or a number.
    - `hidden`: optionally a schedule for the model's other `nn.Dropout` modules (inside `layers` only,
      when given); families without any (Llama, Qwen2) raise.
    - `total_steps`: the steps the schedule spans; by default the trainer's estimate (`attnreg.progress`).

    `name` and `hidden_name` are the names of the logged rates. `unbind` restores the model's own rates.

    Example:
        >>> from attnreg.schedules import Linear
        >>> from attnreg.tiny import tiny_model
        >>> dropout = AttentionDropoutSchedule(Linear(0.2, 0.0), layers=[1])
        >>> dropout.bind(tiny_model("llama"), taken=set()); dropout.start(estimated_steps=10)
        >>> dropout.before_step(5), dropout.hub.attention_dropout(1), dropout.hub.attention_dropout(0)
        ({'attention_dropout_schedule': 0.1}, 0.1, 0.0)
    """

    default_name = "attention_dropout_schedule"

    def __init__(
        self,
        schedule: ScheduleLike,
        layers: int | Iterable[int] | None = None,
        hidden: ScheduleLike | None = None,
        total_steps: int | None = None,
        name: str | None = None,
        hidden_name: str = "hidden_dropout",
    ) -> None:
        super().__init__(name, total_steps)
        self.schedule = as_schedule(schedule, "schedule")
        self.hidden = None if hidden is None else as_schedule(hidden, "hidden")
        for label, rates in ((self.name, self.schedule), (hidden_name, self.hidden)):
            if isinstance(rates, Constant):
                check_rates(rates, 1, label)  # a constant can be checked now; a schedule once its length is known
        self.layers_argument = layers
        self.hidden_name = hidden_name
        self.layers: tuple[int, ...] = ()
        self._hidden_modules: list[nn.Dropout] = []
        self._hidden_original: list[float] = []

    def identity(self) -> dict[str, Any]:
        return {"name": self.name_argument, "layers": self.layers_argument}

    def schedules(self) -> list[Callable[[float], float] | None]:
        return [self.schedule, self.hidden]

    def bind(self, model: nn.Module, taken: Collection[str] = ()) -> None:
        super().bind(model, taken)
        model = self.model  # the transformers model (inside a PEFT model, say)
        self.layers = self.hub.resolve_layers(self.layers_argument, "layers")
        modules: list[nn.Dropout] = []
        if self.hidden is not None:
            scope = None if self.layers_argument is None else self.layers
            modules = hidden_dropout_modules(model, self.hub.family, scope)
            if not modules:
                raise ValueError(
                    f"{type(self).__name__}: hidden= was given, but {type(model).__name__} has no nn.Dropout "
                    f"outside attention{'' if scope is None else f' in layers {list(scope)}'}; "
                    "leave hidden=None for this model"
                )
        self._hidden_modules, self._hidden_original = modules, [module.p for module in modules]

    def start(self, estimated_steps: float) -> None:
        super().start(estimated_steps)
        if self.length.total is not None:
            for label, schedule in ((self.name, self.schedule), (self.hidden_name, self.hidden)):
                if schedule is not None:
                    check_rates(schedule, self.length.total, label)

    def before_step(self, step: int) -> dict[str, float]:
        """Set the rates of optimizer step `step`; returns them by name, for the logs."""
        self._check_training_mode()
        progress = self.progress(step)
        rates = {self.name: float(self.schedule(progress))}
        self.hub.set_attention_dropout(rates[self.name], self.layers)
        if self.hidden is not None:
            rates[self.hidden_name] = float(self.hidden(progress))
            for module in self._hidden_modules:
                module.p = rates[self.hidden_name]
        return rates

    def on_step_begin(self, loop: Loop) -> None:
        loop.log(self.before_step(loop.step))

    def teardown(self) -> None:
        """The model's own attention and hidden dropout rates come back."""
        if self.hub is not None:
            self.hub.set_attention_dropout(None, self.layers)
            for module, original in zip(self._hidden_modules, self._hidden_original, strict=True):
                module.p = original

    def unbind(self) -> None:
        self.teardown()
        self._hidden_modules, self._hidden_original = [], []
        super().unbind()

    def _check_training_mode(self) -> None:
        """Dropout only acts in train mode; transformers' from_pretrained returns eval mode."""
        in_eval = [layer for layer in self.layers if not self.hub.attention(layer).training]
        hidden_in_eval = sum(not module.training for module in self._hidden_modules)
        if in_eval or hidden_in_eval:
            where = [f"attention layers {in_eval}"] if in_eval else []
            where += [f"{hidden_in_eval} hidden dropout modules"] if hidden_in_eval else []
            raise RuntimeError(
                f"{type(self).__name__}: {' and '.join(where)} are in eval mode during training, so no dropout "
                "would be applied. transformers' from_pretrained returns a model in eval mode (and Lightning "
                "keeps it): call model.train() before training"
            )


def check_rates(schedule: Callable[[float], float], total_steps: int, label: str) -> None:
    """Raise unless `schedule` gives a dropout rate in [0, 1) at every one of `total_steps` steps.

    Example:
        >>> from attnreg.schedules import Linear
        >>> check_rates(Linear(0.0, 1.5), total_steps=4, label="attention_dropout")
        Traceback (most recent call last):
        ...
        ValueError: attention_dropout: the schedule gives 1.125 at step 3 of 4 (progress 0.75); ...
    """
    for step, rate in enumerate(schedule_values(schedule, total_steps)):
        if not 0.0 <= rate < 1.0:
            raise ValueError(
                f"{label}: the schedule gives {rate} at step {step} of {total_steps} (progress "
                f"{step / total_steps:.3g}); a dropout rate must be in [0, 1)"
            )
