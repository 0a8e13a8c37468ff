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
from attnreg.methods.registry import register_method

BASE = "base"
"""The teacher's value that stands for the run's base model (given by an app before binding)."""


@register_method(docs="methods/pruning.md")
class Distillation(Method):
    """Knowledge distillation from `teacher` (a model with the same outputs, e.g. the unpruned model): adds
    `weight * distillation_loss(model output, teacher output)` to every training micro-batch's loss.

    `temperature` softens both distributions (Hinton et al. 2015); `hidden_weight > 0` also matches the
    layers' hidden states (TinyBERT), for which the training forward is asked for `output_hidden_states`.
    The teacher runs in eval mode under `torch.no_grad()`, is never optimized and moves to the model's device
    at fit start; at teardown its mode and device come back, so a model of yours is left as it was (its
    `requires_grad` is never touched). `teacher="base"` stands for the run's base model, which an app gives
    before binding (`needs`: attnreg-train sets `teacher` to a frozen copy of the model taken before LoRA wraps
    it and before any head removal).

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
        if teacher != BASE and not isinstance(teacher, nn.Module):
            raise TypeError(
                f"Distillation: teacher must be a model (an nn.Module) or {BASE!r} (the run's base model, which an "
                f"app gives), got {teacher!r}"
            )
        self.teacher = teacher
        self.temperature, self.hidden_weight = temperature, hidden_weight
        self.weight = check_weight(weight, "Distillation")
        self._hooks: list[Any] = []
        self._forward: tuple[tuple, dict, Any] | None = None
        self._restore: tuple[dict[nn.Module, bool], torch.device] | None = None  # the teacher's modes, device

    @property
    def needs(self) -> frozenset[str]:
        """`base_model` while the teacher is `"base"` (an app gives it as `teacher`), else nothing."""
        return frozenset({"base_model"}) if isinstance(self.teacher, str) else frozenset()

    def identity(self) -> dict[str, Any]:
        return {"name": self.name_argument, "temperature": self.temperature, "hidden_weight": self.hidden_weight}

    def bind(self, model: nn.Module, taken: Collection[str] = ()) -> None:
        if isinstance(self.teacher, str):
            raise ValueError(
                f"Distillation: teacher={self.teacher!r} stands for the run's base model, and nothing gave it: "
                "attnreg-train does (a frozen copy of the model before LoRA and any removal); in a loop of your own "
                "pass the model (a copy of the model before training) as teacher="
            )
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
        device = next(self.require_bound().parameters()).device
        if self._restore is None:
            self._restore = (_modes(self.teacher), next(self.teacher.parameters()).device)
        self.teacher.eval().to(device)

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
        modes = None if self._restore is not None else _modes(self.teacher)  # in eval mode since fit start
        with torch.no_grad():
            target = self.teacher.eval()(*args, **inputs, output_hidden_states=self.hidden_weight > 0)
        if modes is not None:  # called outside a fit: eval mode for this call only
            _set_modes(modes)
        loss = distillation_loss(output, target, inputs.get("attention_mask"), self.temperature, self.hidden_weight)
        return self.weight * loss, {f"{self.name}/kl": loss.detach()}

    def teardown(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._forward = [], None
        if self._restore is not None:  # the teacher's modes and device as they were given
            modes, device = self._restore
            _set_modes(modes)
            self.teacher.to(device)
            self._restore = None


def _modes(model: nn.Module) -> dict[nn.Module, bool]:
    return {module: module.training for module in model.modules()}


def _set_modes(modes: dict[nn.Module, bool]) -> None:
    for module, training in modes.items():
        module.training = training
