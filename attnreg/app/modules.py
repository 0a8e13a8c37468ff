"""Ready LightningModules for fine-tuning any supported transformers model: sentence classification
(`SequenceClassifier`), causal LM and chat SFT (`CausalLM`). With `labels=False` they train on attnreg's terms
alone: distillation from a teacher without labels is `SequenceClassifier(student, labels=False)` with the callback
`attnreg.Distillation(teacher)`.

They use `attnreg.AttnRegMixin`, so every attnreg callback works with them; batch keys that
the model's forward does not take (the syntax prior, say) are kept away from the model.

Example:
    >>> from torch.utils.data import DataLoader
    >>> from attnreg import SyntaxPriorKL
    >>> from attnreg.syntax import SyntaxCollator
    >>> from attnreg.app.task import build_tokenizer, generate, vocabulary
    >>> from attnreg.tiny import tiny_model
    >>> tokenizer = build_tokenizer(vocabulary())
    >>> data = [{"sentence": example.sentence, "label": example.label} for example in generate(8, seed=0)]
    >>> loader = DataLoader(data, batch_size=4, collate_fn=SyntaxCollator(tokenizer))
    >>> module = SequenceClassifier(tiny_model("bert", head="classification", vocab=len(tokenizer)), lr=1e-3)
    >>> trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
    ...                     enable_model_summary=False, callbacks=[SyntaxPriorKL(layers=[1], heads=[0])])
    >>> trainer.fit(module, loader)
    >>> sorted(trainer.callback_metrics)
    ['attnreg/syntax_prior_kl', 'attnreg/syntax_prior_kl/layer1', 'train/loss']
"""

from __future__ import annotations

import inspect
import random
from typing import Any

import lightning as L
import numpy as np
import torch
import torchmetrics
from transformers import PreTrainedModel, get_constant_schedule_with_warmup, get_linear_schedule_with_warmup

import attnreg
from attnreg.compat import load_pending_loader_states
from attnreg.hub import is_attached
from attnreg.methods.pruning import gate_parameters
from attnreg.mixin import AttnRegMixin

SCHEDULES = {"linear": get_linear_schedule_with_warmup, "constant": get_constant_schedule_with_warmup}
RNG_STATES = "attnreg_rng_states"
"""Checkpoint entry of `FineTuner`: the random generators' states at the save (`rng_states`)."""


def rng_states() -> dict[str, Any]:
    """The states of torch's generators (CPU, and each CUDA device's once CUDA is initialized), Python's and NumPy's,
    in types a `weights_only` load accepts; `set_rng_states` sets them back.

    Example:
        >>> states = rng_states(); first = torch.rand(2)
        >>> set_rng_states(states); torch.equal(torch.rand(2), first)
        True
    """
    python = random.getstate()
    numpy = np.random.get_state(legacy=False)
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [python[0], list(python[1]), python[2]],
        "numpy": {**numpy, "state": {"key": numpy["state"]["key"].tolist(), "pos": numpy["state"]["pos"]}},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Set the generators' states that `rng_states` returned (CUDA's where this process has as many devices)."""
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = states["numpy"]
    key = np.asarray(numpy["state"]["key"], dtype=np.uint32)
    np.random.set_state({**numpy, "state": {"key": key, "pos": numpy["state"]["pos"]}})
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)


class FineTuner(AttnRegMixin, L.LightningModule):
    """Fine-tunes `model` on its own loss with AdamW, warmup over the `warmup` share of the steps, then linear decay
    to 0 (`schedule="linear"`) or a constant rate (`schedule="constant"`); logs `train/loss`.

    Only parameters that require grad are optimized (a LoRA adapter's, on a PEFT model). attnreg's head gates
    (`HeadGating`) get a group of their own, named "gates", at `gate_lr` (default `lr`; gates usually need a far
    larger one) without weight decay. Subclasses add their validation.

    `labels=False` trains on attnreg's terms alone, the model's own loss left out: the training batches' labels are
    not read (they need none), and a fit without a term is refused. With `attnreg.Distillation(teacher)` that is
    distillation from unlabeled text; validation still scores against the labels.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> module = FineTuner(tiny_model("llama", head="causal_lm"), lr=1e-3)
        >>> module({"input_ids": torch.tensor([[2, 5, 6, 3]]), "labels": torch.tensor([[2, 5, 6, 3]])}).loss.ndim
        0
        >>> module = FineTuner(tiny_model("llama", head="causal_lm"), labels=False)
        >>> module.training_step({"input_ids": torch.tensor([[2, 5, 6, 3]])}, 0)    # no label, no loss of its own
        tensor(0.)
    """

    def __init__(
        self,
        model: PreTrainedModel,
        lr: float = 5e-5,
        weight_decay: float = 0.01,
        warmup: float = 0.1,
        gate_lr: float | None = None,
        schedule: str = "linear",
        labels: bool = True,
    ):
        super().__init__()
        if schedule not in SCHEDULES:
            raise ValueError(f"module.schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        self.schedule, self.labels = schedule, labels
        self.model = model.train()  # from_pretrained returns eval mode, and Lightning keeps submodules' modes
        self.lr, self.weight_decay, self.warmup = lr, weight_decay, warmup
        self.gate_lr = lr if gate_lr is None else gate_lr
        self.save_hyperparameters(ignore=["model"])  # a module, not a hyperparameter
        self._inputs = set(inspect.signature(model.forward).parameters)
        self._resumed_rng: dict[str, Any] | None = None  # a checkpoint's random states, set when training starts
        if "kwargs" in self._inputs:  # a PEFT model's forward passes **kwargs on to the base model's
            base = getattr(model, "get_base_model", lambda: model)()
            self._inputs |= set(inspect.signature(base.forward).parameters)

    def model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The entries of `batch` the model's forward accepts."""
        return {key: value for key, value in batch.items() if key in self._inputs and key != "kwargs"}

    def forward(self, batch: dict[str, Any]) -> Any:
        return self.model(**self.model_inputs(batch))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if not self.labels:  # the terms are the loss (added by AttnRegMixin); the forward is what they read
            output = self.model(**{key: value for key, value in self.model_inputs(batch).items() if key != "labels"})
            return output.logits.new_zeros(())
        loss = self(batch).loss
        self.log("train/loss", loss, prog_bar=True, sync_dist=self.trainer.world_size > 1)
        return loss

    # -- a resumed run draws the random numbers (dropout) the uninterrupted one drew --------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint[RNG_STATES] = rng_states()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self._resumed_rng = checkpoint.get(RNG_STATES)

    def on_train_start(self) -> None:
        """On resume, the training loader's position and the random generators as the checkpoint left them: set here,
        with the training data's iterator made and nothing left to draw before the next training batch, as after the
        save in the uninterrupted run."""
        super().on_train_start()
        load_pending_loader_states(self.trainer)  # where the training order stands (`ResumableLoader`)
        states, self._resumed_rng = self._resumed_rng, None
        if states is not None:
            set_rng_states(states)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if not self.labels and not self.attnreg_runner.terms:
            raise ValueError(
                f"{type(self).__name__}(labels=False) trains on attnreg's terms alone, and no callback adds one: add "
                "attnreg.Distillation(teacher) (distillation without labels), or leave labels=True"
            )

    def configure_optimizers(self) -> Any:
        gates = gate_parameters(self.model)
        ids = {id(p) for p in gates}
        trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in ids]
        no_decay = [p for n, p in trainable if p.ndim < 2 or "norm" in n.lower()]
        ids |= {id(p) for p in no_decay}
        decay = [p for p in self.parameters() if p.requires_grad and id(p) not in ids]
        groups = [
            {"params": decay, "weight_decay": self.weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
            {"params": gates, "weight_decay": 0.0, "lr": self.gate_lr, "name": "gates"},
        ]
        # An attached model keeps its gates group even when empty, as in attnreg.methods.layerwise_lr: a resumed
        # optimizer must have the groups of its checkpoint, taken before or after gates were folded.
        kept = [group for group in groups if group["params"] or (group["name"] == "gates" and is_attached(self.model))]
        optimizer = torch.optim.AdamW(kept, lr=self.lr)
        total = int(self.trainer.estimated_stepping_batches)
        warmup = int(self.warmup * total)
        scheduler = SCHEDULES[self.schedule](
            optimizer, warmup, **({"num_training_steps": total} if self.schedule == "linear" else {})
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SequenceClassifier(FineTuner):
    """Fine-tunes `model` (a `...ForSequenceClassification`) as `FineTuner` does (`options` are its); logs
    `train/loss`, and `val/loss`, `val/acc`, `val/mcc` (Matthews correlation) each epoch.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> module = SequenceClassifier(tiny_model("bert", head="classification"), lr=1e-3, gate_lr=0.1)
        >>> batch = {"input_ids": torch.tensor([[2, 5, 6, 3]]), "labels": torch.tensor([1]),
        ...          "attnreg_prior": torch.tensor([[-1, 2, 1, -1]])}
        >>> sorted(module.model_inputs(batch))           # the prior is kept away from the model
        ['input_ids', 'labels']
        >>> module(batch).logits.shape
        torch.Size([1, 2])
    """

    def __init__(self, model: PreTrainedModel, **options: Any):
        super().__init__(model, **options)
        classes = model.config.num_labels
        task = "binary" if classes == 2 else "multiclass"
        self.val_acc = torchmetrics.Accuracy(task=task, num_classes=classes)
        self.val_mcc = torchmetrics.MatthewsCorrCoef(task=task, num_classes=classes)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        output = self(batch)
        predictions = output.logits.argmax(-1)
        self.val_acc.update(predictions, batch["labels"])
        self.val_mcc.update(predictions, batch["labels"])
        self.log("val/loss", output.loss, prog_bar=True, sync_dist=self.trainer.world_size > 1)
        self.log("val/acc", self.val_acc, prog_bar=True)
        self.log("val/mcc", self.val_mcc)


class CausalLM(FineTuner):
    """Fine-tunes a causal LM (`...ForCausalLM`, or a PEFT model of one) on its next-token loss over the tokens
    whose `labels` are not -100 (every real token for plain text, the assistant's for chat SFT), as `FineTuner` does
    but without weight decay or warmup by default (`options` are `FineTuner`'s); logs `train/loss`,
    and `val/loss` and `val/perplexity` over every held-out token each epoch (token-weighted, not a mean of batch
    means).

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> module = CausalLM(tiny_model("llama", head="causal_lm"), lr=1e-3)
        >>> batch = {"input_ids": torch.tensor([[2, 5, 6, 3, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 1, 0]]),
        ...          "labels": torch.tensor([[2, 5, 6, 3, -100]]), "attnreg_prior": torch.tensor([[-1, 1, 2, 2, -1]])}
        >>> sorted(module.model_inputs(batch))
        ['attention_mask', 'input_ids', 'labels']
        >>> module.validation_step(batch, 0); module.val_nll.compute() / module.val_tokens.compute()  # 3 predicted
        tensor(...)
        >>> int(module.val_tokens.compute())
        3
    """

    def __init__(self, model: PreTrainedModel, weight_decay: float = 0.0, warmup: float = 0.0, **options: Any):
        super().__init__(model, weight_decay=weight_decay, warmup=warmup, **options)
        self.val_nll = torchmetrics.SumMetric()
        self.val_tokens = torchmetrics.SumMetric()

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        output = self(batch)
        tokens = (batch["labels"][:, 1:] != -100).sum()
        self.val_nll.update(output.loss.detach() * tokens)
        self.val_tokens.update(tokens)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_nll.compute() / self.val_tokens.compute().clamp(min=1)
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/perplexity", loss.exp())
        self.val_nll.reset()
        self.val_tokens.reset()


def __getattr__(name: str):
    """`Distiller`, gone: an error naming what replaces it (`attnreg.REMOVED`)."""
    if name == "Distiller":
        raise attnreg.removed_name(__name__, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
