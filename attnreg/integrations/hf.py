"""The Hugging Face `Trainer` adapter: `AttnRegTrainer` runs attnreg's method objects.

It runs any method objects (`attnreg.methods`, or a `Method` of your own) through `attnreg.methods.Runner`,
translating the Trainer's events into the methods' own: `compute_loss` captures what the loss terms read
and adds their terms (each term's weight means the same whatever the gradient accumulation), figures go to
the Trainer's training logs (`attnreg/<name>`, averaged over the steps between two logs), a method that
builds the optimizer replaces the Trainer's (its learning-rate factor, where it has one, the scheduler),
and the Trainer's events become the methods' (`attnreg.integrations.hf_events.TrainerEvents`). Under DDP
(torchrun, accelerate), a method that gives the model new parameters during training (a removal of heads) has
accelerate's DDP wrapper rebuilt (`Loop.rewrap`; `training_step` then runs on the new wrapper); under DeepSpeed or
FSDP it cannot.

`AttnRegTrainerMixin` composes with any `Trainer` subclass that computes its loss through `compute_loss`
(`with_attnreg(SFTTrainer)`); `AttnRegTrainer` is it on the plain `Trainer`. Forwards that are not the
training forward (evaluation, generation, a subclass's extra no-grad forward) are never captured.

Progress is `state.global_step / state.max_steps` (`attnreg.progress`). Checkpoints carry the methods'
state in `attnreg_state.json` and the weights as training has them (gates unfolded, the structure record), read
back by `train(resume_from_checkpoint=...)`. Batch keys the methods read (a syntax prior) are kept from the
model, and kept through `remove_unused_columns=True`, as are the `sentence` and `label` fields a
`SyntaxCollator` needs. Needs the `hf` extra (`accelerate`).

Example:
    >>> import tempfile
    >>> from transformers import TrainingArguments
    >>> from attnreg import methods
    >>> from attnreg.syntax import SyntaxCollator
    >>> from attnreg.app.task import build_tokenizer, generate, vocabulary
    >>> from attnreg.tiny import tiny_model
    >>> tokenizer = build_tokenizer(vocabulary())
    >>> dataset = [{"sentence": example.sentence, "label": example.label} for example in generate(8, seed=0)]
    >>> args = TrainingArguments(tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=4, logging_steps=1,
    ...                          save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    >>> trainer = AttnRegTrainer(
    ...     model=tiny_model("bert", head="classification", vocab=len(tokenizer)), args=args, train_dataset=dataset,
    ...     data_collator=SyntaxCollator(tokenizer),
    ...     methods=[methods.SyntaxPriorKL(heads={1: [0]}, weight=0.1), methods.EntropyRegularizer(mode="max")],
    ... )
    >>> output = trainer.train()                # the Trainer prints its logs, with attnreg's figures
    {'loss': ..., 'attnreg/syntax_prior_kl': ..., 'attnreg/entropy_regularizer': ...}
    >>> sorted(name for name in trainer.state.log_history[0] if name.startswith("attnreg"))
    ['attnreg/entropy_regularizer', 'attnreg/entropy_regularizer/layer0', 'attnreg/entropy_regularizer/layer1',
     'attnreg/syntax_prior_kl', 'attnreg/syntax_prior_kl/layer1']
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from attnreg.compat import KeepColumns, no_sync_as
from attnreg.hub import is_attached, unfolded_saves
from attnreg.integrations.hf_events import TrainerEvents
from attnreg.methods import Method, Runner
from attnreg.methods.runner import STATE_FILE, all_reduce_sum
from attnreg.structure import keep_base_in_adapter_saves

__all__ = ["STATE_FILE", "AttnRegTrainer", "AttnRegTrainerMixin", "with_attnreg"]
_KEPT_COLUMNS = ("sentence", "label", "labels", "words", "heads", "relations", "text")  # what SyntaxCollator reads


class AttnRegTrainerMixin(KeepColumns):
    """Runs attnreg `methods` in a `transformers.Trainer` subclass (see the module docstring); put it first:
    `class MyTrainer(AttnRegTrainerMixin, SFTTrainer)`, or `with_attnreg(SFTTrainer)`.

    Example:
        >>> import tempfile
        >>> from transformers import TrainingArguments
        >>> from attnreg.methods import AttentionDropoutSchedule, EntropyRegularizer
        >>> from attnreg.tiny import tiny_model
        >>> args = TrainingArguments(tempfile.mkdtemp(), max_steps=10, report_to=[], use_cpu=True)
        >>> trainer = AttnRegTrainer(model=tiny_model("gpt2", head="causal_lm"), args=args,
        ...                          methods=[EntropyRegularizer(), EntropyRegularizer(layers=[0]),
        ...                                   AttentionDropoutSchedule(0.1)])
        >>> [method.name for method in trainer.attnreg_methods]      # bound to the model, each its own name
        ['entropy_regularizer', 'entropy_regularizer_2', 'attention_dropout_schedule']
        >>> import json
        >>> trainer.save_method_state(args.output_dir)                # as with every checkpoint
        >>> sorted(json.loads(Path(args.output_dir, STATE_FILE).read_text()))
        ['attention_dropout_schedule', 'entropy_regularizer', 'entropy_regularizer_2']
    """

    def __init__(self, *args: Any, methods: Sequence[Method] = (), **kwargs: Any) -> None:
        self.attnreg = Runner(methods)
        super().__init__(*args, **kwargs)
        self._last_inputs: Any = None
        self._attnreg_replaced: list[nn.Module] = []  # DDP wrappers rebuilt since (`Loop.rewrap`)
        reentrant = (self.args.gradient_checkpointing_kwargs or {}).get("use_reentrant")
        terms = [m.name for m in self.attnreg.methods if m.has_term]
        if self.args.gradient_checkpointing and reentrant and terms:
            raise ValueError(
                "gradient_checkpointing_kwargs={'use_reentrant': True}: reentrant checkpointing runs the first forward "
                f"under no_grad, so the terms of {terms} would do nothing; leave use_reentrant unset or False "
                "(transformers' default), or turn gradient_checkpointing off"
            )
        data = self.train_dataset
        if data is not None and hasattr(data, "__len__") and len(data) == 0:
            raise ValueError("train_dataset is empty: AttnRegTrainer has nothing to train on")
        self.attnreg.bind(self._attnreg_model())  # gates before the optimizer; a refusal leaves the model as it was
        self.add_callback(TrainerEvents(self))

    @property
    def attnreg_methods(self) -> list[Method]:
        return self.attnreg.methods

    def _attnreg_model(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model)

    # -- the loss ------------------------------------------------------------------------------------------
    def training_step(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        """The Trainer's step, on the DDP wrapper a method had rebuilt (`Loop.rewrap`) where the Trainer's loop
        still holds the old one (and in the new one's `no_sync` while the loop is in the old one's)."""
        if any(model is stale for stale in self._attnreg_replaced):
            current = self.model_wrapped
            with no_sync_as(model, current):
                return super().training_step(current, inputs, *args, **kwargs)
        return super().training_step(model, inputs, *args, **kwargs)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        model_inputs = self.attnreg.model_inputs(inputs)
        if not (model.training and torch.is_grad_enabled() and self.attnreg.terms):
            if model.training:
                self._last_inputs = model_inputs
            return super().compute_loss(model, model_inputs, return_outputs, num_items_in_batch)
        self._last_inputs = model_inputs  # what a method reads at the end of the step (a Monitor)
        with self.attnreg.capture(self._attnreg_model(), training=True) as captured:
            result = super().compute_loss(model, model_inputs, return_outputs, num_items_in_batch)
        share = self._accumulation_share(num_items_in_batch)
        terms = self.attnreg.loss(captured, inputs, self.state.global_step, share)
        return (result[0] + terms, *result[1:]) if return_outputs else result + terms

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

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        """The Trainer's micro-batches of one optimizer step; the runner counts the items of its terms in them,
        over processes (`Runner.window`), so a term's weight does not depend on how rows are split."""
        batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
        several = self.args.world_size > 1
        self.attnreg.window(batches, self.args.world_size, all_reduce_sum if several else None)
        return batches, items

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, with the attnreg figures (their mean since the last log) added to training logs."""
        if "loss" in logs:
            logs = {**logs, **self.attnreg.figures()}
        super().log(logs, *args, **kwargs)

    # -- optimizer and schedule ---------------------------------------------------------------------------------
    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        if self.optimizer is None:
            built = self.attnreg.optimizer(self.model)
            if built is not None:
                self.optimizer, self._attnreg_lr_factor = built
        return super().create_optimizer(*args, **kwargs)

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.optim.lr_scheduler.LRScheduler:
        self.attnreg.start(float(num_training_steps))
        factor = self.__dict__.get("_attnreg_lr_factor")
        if factor is not None and self.lr_scheduler is None:
            self.lr_scheduler = LambdaLR(optimizer or self.optimizer, factor)
        return super().create_scheduler(num_training_steps, optimizer)

    # -- training and checkpoints ---------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        if resume_from_checkpoint:
            folder = resume_from_checkpoint
            if folder is True:
                folder = get_last_checkpoint(self.args.output_dir)
            if folder is not None:
                self.attnreg.load_state(folder)
                self.attnreg.load_structure(folder)  # heads removed before the checkpoint, gates
        self.attnreg.bind(self._attnreg_model())
        keep_base_in_adapter_saves(self._attnreg_model())  # save_model of a LoRA model whose base weights changed
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        finally:
            self.attnreg.teardown()  # the model's own dropout rates and requires_grad come back

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's `save_model`; a checkpoint keeps the weights as training has them (gates and
        temperatures unfolded, so a resume continues exactly) and the structure record, so that `train(
        resume_from_checkpoint=...)` and `attnreg.methods.pruning.load_pruned` read it. A model saved by the user
        (`trainer.save_model()`) has its gates folded and loads with `from_pretrained` where no head was removed."""
        model = self._attnreg_model()
        checkpoint = output_dir is not None and Path(output_dir).name.startswith(f"{PREFIX_CHECKPOINT_DIR}-")
        if not (_internal_call and checkpoint and is_attached(model)):
            return super().save_model(output_dir, _internal_call)
        structure = self.attnreg.structure()  # on every process: a sharded gate is gathered
        with unfolded_saves(model):
            super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            self.attnreg.save_structure(output_dir, structure)

    def save_method_state(self, folder: str | os.PathLike) -> None:
        """Write every method's state to `folder/attnreg_state.json` (done with every checkpoint)."""
        self.attnreg.save_state(folder)

    def kept_columns(self) -> tuple[str, ...]:
        """The columns the methods and a `SyntaxCollator` need, kept through `remove_unused_columns=True`."""
        return (*_KEPT_COLUMNS, *self.attnreg.batch_keys)


class AttnRegTrainer(AttnRegTrainerMixin, Trainer):
    """A `transformers.Trainer` that runs attnreg `methods` (see the module docstring)."""


@functools.cache
def with_attnreg(trainer_class: type[Trainer]) -> type[Trainer]:
    """`trainer_class` (any `Trainer` subclass, TRL's `SFTTrainer` say) with attnreg's `methods=`.

    Example:
        >>> from transformers import Seq2SeqTrainer
        >>> trainer_class = with_attnreg(Seq2SeqTrainer)
        >>> trainer_class.__name__, issubclass(trainer_class, Seq2SeqTrainer)
        ('AttnRegSeq2SeqTrainer', True)
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"with_attnreg takes a transformers.Trainer subclass, got {trainer_class!r}")
    return type(f"AttnReg{trainer_class.__name__}", (AttnRegTrainerMixin, trainer_class), {})
