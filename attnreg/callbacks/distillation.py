"""Distillation as a drop-in Lightning callback of `attnreg.methods.Distillation`, with its arguments (the teacher
first): it adds `weight * distillation_loss(model output, teacher output)` to the training loss. The LightningModule
needs `attnreg.AttnRegMixin`.

Example:
    >>> from attnreg.tiny import tiny_model
    >>> callback = Distillation(tiny_model("bert", head="classification"), temperature=2.0)
    >>> callback.method.name, callback.method.temperature
    ('distillation', 2.0)
"""

from __future__ import annotations

from attnreg import methods
from attnreg.callbacks.base import drop_in_callback

Distillation = drop_in_callback(methods.Distillation)
