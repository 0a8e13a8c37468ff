"""The Hugging Face `Trainer`'s events, translated into the runner's (`attnreg.methods.Runner`), with a `Loop`
saying where the run stands: the step, the optimizer, the last batch, the output folder, rank 0's choice for every
process, the DDP wrapper rebuilt where a method gives the model new parameters (`Loop.rewrap`). Each method's state
is saved with every checkpoint. `AttnRegTrainerMixin` (`attnreg.integrations.hf`) adds one to its trainer.

Example:
    >>> import tempfile
    >>> from transformers import TrainingArguments
    >>> from attnreg.integrations.hf import AttnRegTrainer
    >>> from attnreg.methods import EntropyRegularizer
    >>> from attnreg.tiny import tiny_model
    >>> args = TrainingArguments(tempfile.mkdtemp(), max_steps=10, report_to=[], use_cpu=True)
    >>> trainer = AttnRegTrainer(model=tiny_model("gpt2", head="causal_lm"), args=args, methods=[EntropyRegularizer()])
    >>> events = next(c for c in trainer.callback_handler.callbacks if isinstance(c, TrainerEvents))
    >>> loop = events.loop(trainer.state, trainer.control)
    >>> loop.step, loop.world_size, loop.is_main, loop.rewrap is None
    (0, 1, True, True)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from attnreg.compat import trainer_rewrap
from attnreg.methods import Loop
from attnreg.methods.runner import broadcast_object

if TYPE_CHECKING:
    from attnreg.integrations.hf import AttnRegTrainerMixin


class TrainerEvents(TrainerCallback):
    """The Trainer's events, translated into the methods' (`attnreg.methods.Runner`); each method's state is
    saved with every checkpoint."""

    def __init__(self, trainer: AttnRegTrainerMixin) -> None:
        self.trainer = trainer
        self.control: Any = None

    def loop(self, state: Any, control: Any) -> Loop:
        trainer, args = self.trainer, self.trainer.args
        optimizer = trainer.optimizer
        self.control = control

        def stop() -> None:
            self.control.should_training_stop = True

        return Loop(
            step=state.global_step,
            epoch=round(state.epoch or 0),
            optimizers=[] if optimizer is None else [getattr(optimizer, "optimizer", optimizer)],  # inside accelerate's
            batch=trainer._last_inputs,
            output_dir=Path(args.output_dir),
            world_size=args.world_size,
            is_main=args.should_save,
            broadcast=broadcast_object,
            rewrap=trainer_rewrap(trainer, trainer._attnreg_replaced) if args.world_size > 1 else None,
            engine=f"the Trainer ({trainer.accelerator.distributed_type})",
            log=trainer.attnreg.record,
            report=lambda figures: trainer.log(dict(figures)),  # the Trainer adds "epoch" to what it logs
            stop=stop,
        )

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.attnreg.fit_start(self.loop(state, control))

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.attnreg.epoch_begin(self.loop(state, control))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.attnreg.step_begin(self.loop(state, control))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.attnreg.before_optimizer_step(self.loop(state, control))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.attnreg.step_end(self.loop(state, control))

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.attnreg.epoch_end(self.loop(state, control))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.attnreg.fit_end(self.loop(state, control))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.trainer.save_method_state(Path(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))
