"""The Hugging Face `Trainer` adapter: `AttnRegTrainer` runs attnreg's method objects.

It takes the same method objects as the Lightning callbacks (`attnreg.methods`):

- loss terms (`Entropy`, `PriorKL`, `AttentionPenalty`): the attention of the layers they name is captured
  in `compute_loss` and their weighted terms are added to the loss, logged (as `attnreg/<name>`, averaged
  over the steps between two logs) through the Trainer's own logging;
- `DropoutSchedule`: the rates are set at every optimizer step (`on_step_begin`) and logged;
- `LayerwiseLR`: its named parameter groups make the Trainer's optimizer (its `lr` replaces
  `args.learning_rate`), and its schedule, when it has one, the LR scheduler; without one the
  Trainer's own scheduler (`args.lr_scheduler_type`, warmup) runs over the groups;
- `FreezeLayers`: layer groups frozen for the first epochs, at every epoch start;
- `HeadGating`: gates are created with the trainer (before its optimizer), the penalty is a loss term,
  the Lagrangian's dual step runs once per optimizer step, and heads are removed when its `Removal`
  says (the end of training by default), the optimizer's state sliced along;
- `Monitor`: every `every_n_steps` optimizer steps, on the step's last training batch, its metrics go to
  the Trainer's log, and `on_collapse="stop"` stops training;
- `HeadImportance`: scores (and iterative pruning) at the end of training.

Progress is `state.global_step / state.max_steps` (`attnreg.progress`). Checkpoints carry the methods'
state in `attnreg_state.json`, read back by `train(resume_from_checkpoint=...)`. Batch keys the methods
read (a syntax prior) are kept from the model, and kept through `remove_unused_columns=True`, as are the
`sentence` and `label` fields a `SyntaxCollator` needs. Needs the `hf` extra (`accelerate`).

Example:
    >>> import tempfile
    >>> from transformers import TrainingArguments
    >>> from attnreg import methods
    >>> from attnreg.syntax import SyntaxCollator
    >>> from attnreg.task import build_tokenizer, generate, vocabulary
    >>> from attnreg.tiny import tiny_model
    >>> tokenizer = build_tokenizer(vocabulary())
    >>> dataset = [{"sentence": example.sentence, "label": example.label} for example in generate(8, seed=0)]
    >>> args = TrainingArguments(tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=4, logging_steps=1,
    ...                          save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    >>> trainer = AttnRegTrainer(
    ...     model=tiny_model("bert", head="classification", vocab=len(tokenizer)), args=args, train_dataset=dataset,
    ...     data_collator=SyntaxCollator(tokenizer),
    ...     methods=[methods.PriorKL(heads={1: [0]}, weight=0.1), methods.Entropy(mode="max", weight=0.01)],
    ... )
    >>> output = trainer.train()                # the Trainer prints its logs, with attnreg's figures
    {'loss': ..., 'attnreg/prior_kl': ..., 'attnreg/entropy': ...}
    >>> sorted(name for name in trainer.state.log_history[0] if name.startswith("attnreg"))
    ['attnreg/entropy', 'attnreg/entropy/layer0', 'attnreg/entropy/layer1', 'attnreg/prior_kl',
     'attnreg/prior_kl/layer1']
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from attnreg.hub import attach, is_attached, unfolded_saves
from attnreg.methods import (
    DropoutSchedule,
    FreezeLayers,
    HeadGating,
    HeadImportance,
    LayerwiseLR,
    LossTerm,
    Method,
    Monitor,
    PriorKL,
)
from attnreg.pruning import restore_saved_pruning, write_spec

STATE_FILE = "attnreg_state.json"
RESCUE_FOLDER = "attnreg-unpruned"  # where a model whose head removal failed is saved, gated
_KEPT_COLUMNS = ("sentence", "label", "labels")  # what SyntaxCollator reads from dataset items


class AttnRegTrainer(Trainer):
    """A `transformers.Trainer` that runs attnreg `methods` (see the module docstring).

    Example:
        >>> import tempfile
        >>> from transformers import TrainingArguments
        >>> from attnreg.methods import DropoutSchedule, Entropy
        >>> from attnreg.tiny import tiny_model
        >>> args = TrainingArguments(tempfile.mkdtemp(), max_steps=10, report_to=[], use_cpu=True)
        >>> trainer = AttnRegTrainer(model=tiny_model("gpt2", head="causal_lm"), args=args,
        ...                          methods=[Entropy(), Entropy(layers=[0]), DropoutSchedule(0.1)])
        >>> [method.name for method in trainer.attnreg_methods]      # bound to the model, each its own name
        ['entropy', 'entropy_2', 'attention_dropout']
        >>> trainer.save_method_state(args.output_dir)                # as with every checkpoint
        >>> sorted(json.loads(Path(args.output_dir, STATE_FILE).read_text()))
        ['attention_dropout', 'entropy', 'entropy_2']
    """

    def __init__(self, *args: Any, methods: Sequence[Method] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for method in methods:
            if not isinstance(method, Method):
                raise TypeError(f"methods must be attnreg.methods objects, got {type(method).__name__}")
        learning_rates = [method for method in methods if isinstance(method, LayerwiseLR)]
        if len(learning_rates) > 1:
            raise ValueError("AttnRegTrainer: give at most one LayerwiseLR (it builds the optimizer)")
        self.attnreg_methods = list(methods)
        self._terms = [method for method in methods if isinstance(method, LossTerm | HeadGating)]
        self._learning_rate = learning_rates[0] if learning_rates else None
        self._batch_keys = {method.prior_key for method in methods if isinstance(method, PriorKL)}
        self._figures: dict[str, list[float]] = {}
        self._last_inputs: dict[str, Any] = {}
        self._bind_methods()  # gates must exist before the optimizer is built
        self.add_callback(_MethodSteps(self))

    def _bind_methods(self) -> None:
        """Bind every method not bound yet to the model, each under a name no other holds."""
        attach(self.model)
        taken = {method.name for method in self.attnreg_methods if method.model is not None}
        for method in self.attnreg_methods:
            if method.model is None:
                method.bind(self.model, taken)
                taken.add(method.name)

    # -- the loss ------------------------------------------------------------------------------------------
    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        model_inputs = {key: value for key, value in inputs.items() if key not in self._batch_keys}
        if model.training:
            self._last_inputs = model_inputs  # what a Monitor checks at the end of the step
        terms = [method for method in self._terms if not getattr(method, "pruned", False)]
        if not terms or not model.training:
            return super().compute_loss(model, model_inputs, return_outputs, num_items_in_batch)
        hub = attach(self.accelerator.unwrap_model(model))
        require_grad = torch.is_grad_enabled()
        with (
            hub.capture(_capture_layers(terms, False), require_grad) as probs,
            hub.capture(_capture_layers(terms, True), require_grad, inputs=True) as layer_inputs,
        ):
            loss, outputs = super().compute_loss(model, model_inputs, True, num_items_in_batch)
        share = self._accumulation_share(num_items_in_batch)
        for method in terms:
            record = layer_inputs if getattr(method, "inputs", False) else probs
            value, figures = method.term(record, inputs, self.state.global_step)
            loss = loss + value * share
            self._record({method.name: value.detach(), **figures})
        return (loss, outputs) if return_outputs else loss

    def _accumulation_share(self, num_items_in_batch: torch.Tensor | int | None) -> float:
        """What a micro-batch's terms are multiplied by so that their weight means the same whatever the
        gradient accumulation: 1 where the Trainer divides the loss by the accumulation steps itself, else
        1 / steps (a model that takes `num_items_in_batch` normalizes its own loss over the accumulated batch,
        and the Trainer then leaves the whole loss, terms included, undivided)."""
        scaled = self.loss_is_scaled_for_ga  # as Trainer.training_step decides whether to divide
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
                self.compute_loss_func is not None
            )
        steps = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        return 1.0 / steps if scaled else 1.0

    def _record(self, figures: dict[str, torch.Tensor | float]) -> None:
        for name, value in figures.items():
            self._figures.setdefault(f"attnreg/{name}", []).append(float(value))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log, with the attnreg figures (their mean since the last log) added to training logs."""
        if "loss" in logs and self._figures:
            logs = {**logs, **{name: sum(values) / len(values) for name, values in self._figures.items()}}
            self._figures = {}
        super().log(logs, start_time)

    # -- optimizer and schedule ---------------------------------------------------------------------------------
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self._learning_rate is None:
            return super().create_optimizer(model)
        if self.optimizer is None:
            self.optimizer = self._learning_rate.build_optimizer(self.model)
        return self.optimizer

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.optim.lr_scheduler.LRScheduler:
        for method in self.attnreg_methods:
            method.start(float(num_training_steps))
        if self._learning_rate is None or self._learning_rate.schedule is None:
            return super().create_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is None:
            self.lr_scheduler = LambdaLR(optimizer or self.optimizer, self._learning_rate.factor)
        return self.lr_scheduler

    # -- checkpoints ------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        if resume_from_checkpoint:
            folder = resume_from_checkpoint
            if folder is True:
                folder = get_last_checkpoint(self.args.output_dir)
            if folder is not None:
                self._load_method_state(folder)
                restore_saved_pruning(self.model, folder)  # heads removed before the checkpoint: its shapes
        self._bind_methods()
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        finally:
            for method in self.attnreg_methods:
                if isinstance(method, DropoutSchedule | FreezeLayers):
                    method.unbind()  # the model's own dropout rates and requires_grad come back

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's `save_model`; a checkpoint keeps the weights as training has them (gates and
        temperatures unfolded, so a resume continues exactly) and the pruning spec, so that `train(
        resume_from_checkpoint=...)` and `attnreg.pruning.load_pruned` read it. A model saved by the user
        (`trainer.save_model()`) has its gates folded and loads with `from_pretrained` where no head was removed."""
        model = self.accelerator.unwrap_model(self.model)
        checkpoint = output_dir is not None and Path(output_dir).name.startswith(f"{PREFIX_CHECKPOINT_DIR}-")
        if not (_internal_call and checkpoint and is_attached(model)):
            return super().save_model(output_dir, _internal_call)
        with unfolded_saves(model):
            super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            write_spec(model, output_dir)

    def _load_method_state(self, folder: str | os.PathLike) -> None:
        path = Path(folder, STATE_FILE)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: the checkpoint was not written by AttnRegTrainer, so the attnreg methods' "
                "state (training length, and with it every schedule) cannot be restored"
            )
        saved = json.loads(path.read_text())
        for method in self.attnreg_methods:
            if method.name not in saved:
                raise KeyError(f"{path} has no state for the method {method.name!r} (it has {sorted(saved)})")
            method.load_state_dict(saved[method.name])

    def save_method_state(self, folder: str | os.PathLike) -> None:
        """Write every method's state to `folder/attnreg_state.json` (done with every checkpoint)."""
        state = {method.name: method.state_dict() for method in self.attnreg_methods}
        Path(folder, STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

    def _set_signature_columns_if_needed(self) -> None:
        """Keep the columns the methods and a `SyntaxCollator` need through `remove_unused_columns=True`."""
        super()._set_signature_columns_if_needed()
        self._signature_columns = list(dict.fromkeys([*self._signature_columns, *_KEPT_COLUMNS, *self._batch_keys]))


class _MethodSteps(TrainerCallback):
    """Drives the methods that act at optimizer steps, and saves their state with each checkpoint."""

    def __init__(self, trainer: AttnRegTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = self.trainer.optimizer
        for freeze in self._of_type(FreezeLayers):
            freeze.check_optimizer([getattr(optimizer, "optimizer", optimizer)])

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for freeze in self._of_type(FreezeLayers):
            freeze.before_epoch(round(state.epoch))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for dropout in self._of_type(DropoutSchedule):
            self.trainer._record(dropout.before_step(state.global_step))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for gating in self._of_type(HeadGating):
            gating.dual_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for gating in self._of_type(HeadGating):
            self._prune_if_due(gating, gating.due(state.global_step), state.global_step)
        for monitor in self._of_type(Monitor):
            if monitor.due(state.global_step):
                check = monitor.check(self.trainer._last_inputs, state.global_step)
                self.trainer.log(dict(check.metrics))  # the Trainer adds "epoch" to what it logs
                control.should_training_stop |= check.stop

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for gating in self._of_type(HeadGating):
            self._prune_if_due(gating, gating.due(state.global_step, round(state.epoch)), state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for gating in self._of_type(HeadGating):
            self._prune_if_due(gating, gating.due(state.global_step, end=True), state.global_step)
        for importance in self._of_type(HeadImportance):
            importance.at_end()

    def _of_type(self, kind: type[Method]) -> list[Any]:
        return [method for method in self.trainer.attnreg_methods if isinstance(method, kind)]

    def _prune_if_due(self, gating: HeadGating, due: tuple[int | None, bool] | None, step: int) -> None:
        if due is None:
            return
        if self.trainer.args.world_size > 1 and not due[1]:
            raise NotImplementedError("HeadGating: pruning during training under several processes is not supported")
        optimizer = self.trainer.optimizer
        optimizers = [getattr(optimizer, "optimizer", optimizer)]  # the torch optimizer inside accelerate's wrapper
        rescue = Path(self.trainer.args.output_dir, RESCUE_FOLDER) if self.trainer.args.should_save else None
        gating.prune(optimizers, step, keep=due[0], final=due[1], rescue=rescue)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.trainer.save_method_state(Path(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))


def _capture_layers(terms: Sequence[LossTerm | HeadGating], inputs: bool) -> tuple[int, ...]:
    """The layers the terms read probabilities of (`inputs=False`) or inputs of (`inputs=True`)."""
    layers: set[int] = set()
    for term in terms:
        if getattr(term, "inputs", False) == inputs:
            layers.update(term.layers)
    return tuple(sorted(layers))
