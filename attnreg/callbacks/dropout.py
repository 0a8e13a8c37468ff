"""`AttentionDropoutSchedule`: attention (and optionally hidden) dropout that follows a schedule.

transformers reads dropout rates from the config only when it builds a model; this callback sets the
rate through the attention hub before every training step, so it works on every supported family (the
hub's registered attention function passes it on; Llama and Qwen2 have no dropout module to change).
Eval needs nothing: every family passes `dropout=0.0` to the attention function when the attention
module is not training, and the hub only overrides the rate in training.

Example:
    >>> from attnreg.schedules import EarlyDropout
    >>> trainer = lightning.Trainer(callbacks=[AttentionDropoutSchedule(EarlyDropout(0.1, cutoff=0.25))])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import lightning as L
from torch import nn

from attnreg.families import Family
from attnreg.hub import AttentionHub, attach
from attnreg.mixin import find_transformers_model
from attnreg.progress import TrainingLength, changes_over_training
from attnreg.schedules import Constant, ScheduleLike, as_schedule, schedule_values


def hidden_dropout_modules(model: nn.Module, family: Family, layers: Iterable[int] | None = None) -> list[nn.Dropout]:
    """The `nn.Dropout` modules of `model` other than attention-probability dropout.

    All of the model's (embeddings, blocks, task head) for `layers=None`, else those inside the given
    blocks. GPT-2's `resid_dropout` is one (it sits in the attention module but drops its output).

    Example:
        >>> for module in hidden_dropout_modules(model, detect_family(model), layers=[4, 5]):
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


class AttentionDropoutSchedule(L.Callback):
    """Sets attention dropout to `schedule(progress)` before every training step, logged as `attnreg/<name>`.

    - `schedule`: an `attnreg.schedules` schedule, any callable of progress in [0, 1], or a number.
    - `layers`: attention layers to drive (None = all); use one callback per schedule for different layers.
    - `hidden`: optionally a schedule for the model's other `nn.Dropout` modules (inside `layers` only,
      when given), logged as `attnreg/<hidden_name>`; families without any (Llama, Qwen2) raise.
    - `total_steps`: the steps the schedule spans; by default the trainer's `estimated_stepping_batches`.

    Progress is `trainer.global_step / total_steps` (`attnreg.progress`: a run resumed at step k uses
    the uninterrupted run's value; one resumed with a different length re-stretches the schedule). The
    LightningModule needs to hold exactly one transformers model (no mixin needed). After `fit` the model's
    own rates are restored.

    Example:
        >>> AttentionDropoutSchedule(CurriculumDropout(final=0.1, gamma=10.0), layers=[4, 5], hidden=0.1)
    """

    def __init__(
        self,
        schedule: ScheduleLike,
        layers: int | Iterable[int] | None = None,
        hidden: ScheduleLike | None = None,
        total_steps: int | None = None,
        name: str = "attention_dropout",
        hidden_name: str = "hidden_dropout",
    ) -> None:
        self.schedule = as_schedule(schedule, "schedule")
        self.hidden = None if hidden is None else as_schedule(hidden, "hidden")
        for label, rates in ((name, self.schedule), (hidden_name, self.hidden)):
            if isinstance(rates, Constant):
                _check_rates(rates, 1, label)  # a constant can be checked now; a schedule once its length is known
        self.layers = layers
        self.length = TrainingLength(type(self).__name__, total_steps)
        self.total_steps = total_steps
        self.name = name
        self.hidden_name = hidden_name
        self._hub: AttentionHub | None = None
        self._chosen: tuple[int, ...] = ()
        self._hidden_modules: list[nn.Dropout] = []
        self._hidden_original: list[float] = []

    @property
    def state_key(self) -> str:
        """Lightning's key for this callback's checkpoint state: distinct for differently set instances."""
        return self._generate_state_key(name=self.name, layers=self.layers)

    # -- hooks --------------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        model = find_transformers_model(pl_module)
        hub = attach(model)
        chosen = hub.resolve_layers(self.layers, "layers")
        modules: list[nn.Dropout] = []
        if self.hidden is not None:
            modules = hidden_dropout_modules(model, hub.family, None if self.layers is None else chosen)
            if not modules:
                raise ValueError(
                    f"{type(self).__name__}: hidden= was given, but {type(model).__name__} has no nn.Dropout "
                    f"outside attention{'' if self.layers is None else f' in layers {list(chosen)}'}; "
                    "leave hidden=None for this model"
                )
        self._hub, self._chosen = hub, chosen
        self._hidden_modules, self._hidden_original = modules, [module.p for module in modules]

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        schedules = [(self.name, self.schedule), (self.hidden_name, self.hidden)]
        self.length.start(trainer.estimated_stepping_batches, any(changes_over_training(s) for _, s in schedules))
        for label, schedule in schedules:
            if schedule is not None and self.length.total is not None:
                _check_rates(schedule, self.length.total, label)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._check_training_mode()
        progress = self.length.progress(trainer.global_step)
        rate = float(self.schedule(progress))
        self._hub.set_attention_dropout(rate, self._chosen)
        pl_module.log(f"attnreg/{self.name}", rate, on_step=True, on_epoch=False)
        if self.hidden is not None:
            hidden = float(self.hidden(progress))
            for module in self._hidden_modules:
                module.p = hidden
            pl_module.log(f"attnreg/{self.hidden_name}", hidden, on_step=True, on_epoch=False)

    def _check_training_mode(self) -> None:
        """Dropout only acts in train mode; Lightning 2.6 keeps modules in the mode they had before `fit`."""
        in_eval = [layer for layer in self._chosen if not self._hub.attention(layer).training]
        hidden_in_eval = sum(not module.training for module in self._hidden_modules)
        if in_eval or hidden_in_eval:
            where = [f"attention layers {in_eval}"] if in_eval else []
            where += [f"{hidden_in_eval} hidden dropout modules"] if hidden_in_eval else []
            raise RuntimeError(
                f"{type(self).__name__}: {' and '.join(where)} are in eval mode during training, so no dropout "
                "would be applied. transformers' from_pretrained returns a model in eval mode and Lightning does "
                "not switch it: call model.train() before trainer.fit"
            )

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self._hub is None:
            return
        self._hub.set_attention_dropout(None, self._chosen)
        for module, original in zip(self._hidden_modules, self._hidden_original, strict=True):
            module.p = original
        self._hub, self._hidden_modules, self._hidden_original = None, [], []

    # -- checkpointing ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.length.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.length.load_state_dict(state_dict)


def _check_rates(schedule: Callable[[float], float], total_steps: int, label: str) -> None:
    for step, rate in enumerate(schedule_values(schedule, total_steps)):
        if not 0.0 <= rate < 1.0:
            raise ValueError(
                f"{label}: the schedule gives {rate} at step {step} of {total_steps} (progress "
                f"{step / total_steps:.3g}); a dropout rate must be in [0, 1)"
            )
