"""Knowledge distillation from the unpruned model: how a pruned model wins back what its heads did.

`attnreg.methods.pruning.prune_heads` keeps every layer, so layer l of the pruned model is matched to layer l
of the original, with no learned map (TinyBERT's and CoFi's layer distillation). The loss is
`T^2 KL(teacher || student)` on the class (or next-token) distributions softened by the temperature T
(Hinton et al. 2015), plus `hidden_weight` x the mean squared difference of the layers' hidden states
over the real tokens. It needs no labels, so unlabeled in-domain text will do.

Example:
    >>> import copy
    >>> from attnreg.methods.pruning import prune_heads
    >>> from attnreg.tiny import tiny_model
    >>> teacher = tiny_model("bert", head="classification").eval()
    >>> student = copy.deepcopy(teacher)
    >>> report = prune_heads(student, {0: [0, 1], 1: [2]})
    >>> inputs = {"input_ids": torch.tensor([[2, 5, 6, 7, 3]]), "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    >>> with torch.no_grad():
    ...     target = teacher(**inputs, output_hidden_states=True)
    >>> output = student(**inputs, output_hidden_states=True)
    >>> loss = distillation_loss(output, target, inputs["attention_mask"], hidden_weight=1.0)
    >>> loss.requires_grad, loss.item() > 0
    (True, True)
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F


def distillation_loss(
    student: Any,
    teacher: Any,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 2.0,
    hidden_weight: float = 0.0,
) -> torch.Tensor:
    """`T^2 KL(teacher || student)` on the softened logits, plus `hidden_weight` x the hidden-state MSE.

    `student` and `teacher` are model outputs with `logits` (batch x classes, or batch x tokens x
    vocabulary for a causal LM, where padded tokens are left out) and, when `hidden_weight > 0`,
    `hidden_states` from `output_hidden_states=True` (the embeddings, entry 0, are left out: pruning
    heads does not change them). The teacher's outputs should come from `torch.no_grad()`.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("gpt2", head="causal_lm").eval()
        >>> inputs = {"input_ids": torch.tensor([[5, 6, 7, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 0]])}
        >>> with torch.no_grad():
        ...     output = model(**inputs)
        >>> distillation_loss(output, output, inputs["attention_mask"], temperature=4.0)   # a perfect student
        tensor(0.)
    """
    check_distillation(temperature, hidden_weight)
    if student.logits.shape != teacher.logits.shape:
        raise ValueError(
            f"student logits {tuple(student.logits.shape)} and teacher logits {tuple(teacher.logits.shape)} differ"
        )
    real = None if attention_mask is None else attention_mask.bool()
    soft = _soft_kl(student.logits.float(), teacher.logits.float(), real, temperature)
    if hidden_weight == 0:
        return soft
    return soft + hidden_weight * _hidden_mse(student, teacher, real)


def check_distillation(temperature: float, hidden_weight: float) -> None:
    """Raises ValueError unless `temperature > 0` and `hidden_weight >= 0`.

    Example:
        >>> check_distillation(temperature=0.0, hidden_weight=1.0)
        Traceback (most recent call last):
        ...
        ValueError: temperature must be positive, got 0.0
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if not hidden_weight >= 0:
        raise ValueError(f"hidden_weight must be at least 0, got {hidden_weight}")


def _over_real_tokens(values: torch.Tensor, real: torch.Tensor | None, what: str) -> torch.Tensor:
    """The mean of `values` (batch x tokens) over the tokens `real` marks (all of them if None)."""
    if real is None:
        return values.mean()
    if real.shape != values.shape:
        raise ValueError(f"attention_mask {tuple(real.shape)} does not match the {what} {tuple(values.shape)}")
    return values[real].mean()


def _soft_kl(student: torch.Tensor, teacher: torch.Tensor, real: torch.Tensor | None, t: float) -> torch.Tensor:
    log_p = F.log_softmax(teacher / t, dim=-1)
    log_q = F.log_softmax(student / t, dim=-1)
    per_row = (log_p.exp() * (log_p - log_q)).sum(-1)  # one per sentence, or per token of a causal LM
    if per_row.dim() == 1:
        return t * t * per_row.mean()
    return t * t * _over_real_tokens(per_row, real, "logits' batch x tokens")


def _hidden_mse(student: Any, teacher: Any, real: torch.Tensor | None) -> torch.Tensor:
    ours, theirs = student.hidden_states, teacher.hidden_states
    if ours is None or theirs is None:
        raise ValueError("hidden_weight > 0 needs hidden_states: call both models with output_hidden_states=True")
    if len(ours) != len(theirs):
        raise ValueError(f"the student has {len(ours) - 1} layers and the teacher {len(theirs) - 1}")
    squared = [
        (mine.float() - target.float()).pow(2).mean(-1) for mine, target in zip(ours[1:], theirs[1:], strict=True)
    ]
    total = sum(_over_real_tokens(values, real, "hidden states' batch x tokens") for values in squared)
    return cast(torch.Tensor, total) / len(squared)
