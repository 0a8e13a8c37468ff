"""Finding the transformers model in what a user hands over: the model inside a PEFT model, or the one transformers
model that a module of any framework holds (a LightningModule, a plain `nn.Module` around a model).

Example:
    >>> from torch import nn
    >>> from attnreg.tiny import tiny_model
    >>> wrapper = nn.ModuleDict({"model": tiny_model("bert"), "head": nn.Linear(32, 2)})
    >>> find_transformers_model(wrapper) is wrapper["model"] is transformers_model(wrapper["model"])
    True
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel


def transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT model (`PeftModel.get_base_model()`), or `model` itself.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert")
        >>> transformers_model(model) is model
        True
    """
    get_base_model = getattr(model, "get_base_model", None)
    if not isinstance(model, PreTrainedModel) and callable(get_base_model):
        return get_base_model()
    return model


def find_transformers_model(module: nn.Module) -> PreTrainedModel:
    """The one transformers model inside `module` (or `module` itself), for any module around one (a
    LightningModule, say).

    `module.attnreg_model_attr`, where set, names the attribute to use when there is more than one.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> teacher_and_student = nn.ModuleList([tiny_model("bert"), tiny_model("bert")])
        >>> find_transformers_model(teacher_and_student)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: ModuleList must hold exactly one transformers model ..., found ['BertModel', 'BertModel']; ...
        >>> teacher_and_student.attnreg_model_attr = "1"
        >>> find_transformers_model(teacher_and_student) is teacher_and_student[1]
        True
    """
    attr = getattr(module, "attnreg_model_attr", None)
    if attr is not None:
        return getattr(module, attr)
    found = [m for m in module.modules() if isinstance(m, PreTrainedModel)]
    outermost = [m for m in found if not any(m is not o and _contains(o, m) for o in found)]
    if len(outermost) != 1:
        names = [type(m).__name__ for m in outermost] or "none"
        raise RuntimeError(
            f"{type(module).__name__} must hold exactly one transformers model for attnreg, found {names}; "
            "set `attnreg_model_attr` to the attribute that holds the one to use"
        )
    return outermost[0]


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())
