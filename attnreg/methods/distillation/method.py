"""Distillation as a method: a loss term that pulls the model's outputs toward a frozen teacher's.

The term is `weight * distillation_loss(student, teacher)` (`attnreg.methods.distillation.distillation_loss`:
softened logits, and hidden states with `hidden_weight > 0`). The method reads the outputs of the training
forward the loop runs anyway (a hook on the model) and runs the teacher on the same inputs, so it adds one
teacher forward per micro-batch and nothing else; the loop's own loss (labels, or none) stays as it is.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from attnreg.methods.base import Loop, Method
from attnreg.methods.distillation.losses import check_distillation, distillation_loss
from attnreg.methods.loss_term import check_weight


class Distillation(Method):
    """Knowledge distillation from `teacher` (a model with the same outputs, e.g. the unpruned model): adds
    `weight * distillation_loss(model output, teacher output)` to every training micro-batch's loss.

    `temperature` softens both distributions (Hinton et al. 2015); `hidden_weight > 0` also matches the
    layers' hidden states (TinyBERT), for which the training forward is asked for `output_hidden_states`.
    The teacher is kept in eval mode, is never optimized, and moves to the model's device at fit start.

    Example:
        >>> import copy, torch
        >>> from attnreg.methods.pruning import prune_heads
        >>> from attnreg.tiny import tiny_model
        >>> teacher = tiny_model("bert", head="classification")
        >>> student = copy.deepcopy(teacher); _ = prune_heads(student, {0: [0, 1]})
        >>> distillation = Distillation(teacher, temperature=2.0)
        >>> distillation.bind(student); distillation.start(10)
        >>> output = student.train()(input_ids=torch.tensor([[2, 5, 6, 3]]), labels=torch.tensor([1]))
        >>> value, logs = distillation.term(None, {}, step=0)       # from the forward above
        >>> value.requires_grad, sorted(logs)
        (True, ['distillation/kl'])
    """

    default_name = "distillation"

    def __init__(
        self,
        teacher: nn.Module,
        temperature: float = 2.0,
        hidden_weight: float = 0.0,
        weight: float = 1.0,
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        check_distillation(temperature, hidden_weight)
        if not isinstance(teacher, nn.Module):
            raise TypeError(f"teacher must be a model (an nn.Module), got {type(teacher).__name__}")
        self.teacher = teacher.eval().requires_grad_(False)
        self.temperature, self.hidden_weight = temperature, hidden_weight
        self.weight = check_weight(weight, "Distillation")
        self._hooks: list[Any] = []
        self._forward: tuple[tuple, dict, Any] | None = None

    def identity(self) -> dict[str, Any]:
        return {"name": self.name_argument, "temperature": self.temperature, "hidden_weight": self.hidden_weight}

    def bind(self, model: nn.Module, taken: Collection[str] = ()) -> None:
        super().bind(model, taken)
        if self.teacher is self.model or self.teacher is model:
            raise ValueError("Distillation: teacher is the model being trained; pass a copy (e.g. the unpruned model)")
        self._hooks = [
            self.model.register_forward_pre_hook(self._ask_hidden_states, with_kwargs=True),
            self.model.register_forward_hook(self._keep_output, with_kwargs=True),
        ]

    def _ask_hidden_states(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.hidden_weight > 0 and module.training and torch.is_grad_enabled():
            return args, {**kwargs, "output_hidden_states": True}
        return None

    def _keep_output(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if module.training and torch.is_grad_enabled():  # the training forward, not an eval or metrics pass
            self._forward = (args, kwargs, output)

    def on_fit_start(self, loop: Loop) -> None:
        self.teacher.to(next(self.require_bound().parameters()).device)

    def items(self, batch: Any) -> int | None:
        """The tokens (a language model's logits, the real ones) or rows (a classifier's) the loss is a mean
        over in `batch`; None where the hidden-state part would average over other items than the logits."""
        if not isinstance(batch, dict) or "input_ids" not in batch:
            return None
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        per_token = self.require_bound().get_output_embeddings() is not None  # a language-model head
        if not per_token:
            return None if self.hidden_weight > 0 else int(ids.shape[0])
        return int(ids.numel() if mask is None else mask.bool().sum())

    def term(self, record: Any, batch: Any, step: int) -> tuple[torch.Tensor, dict[str, Any]]:
        if self._forward is None:
            raise RuntimeError(
                "Distillation: no training forward of the model since the last term (the loop must run the model "
                "in train mode with gradients before asking for the loss)"
            )
        args, kwargs, output = self._forward
        self._forward = None
        inputs = {key: value for key, value in kwargs.items() if key not in ("labels", "output_hidden_states")}
        with torch.no_grad():
            target = self.teacher(*args, **inputs, output_hidden_states=self.hidden_weight > 0)
        loss = distillation_loss(output, target, inputs.get("attention_mask"), self.temperature, self.hidden_weight)
        return self.weight * loss, {f"{self.name}/kl": loss.detach()}

    def teardown(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._forward = [], None
