"""Distillation as a drop-in Lightning callback (a thin adapter of `attnreg.methods.Distillation`).

Example:
    >>> from attnreg.tiny import tiny_model
    >>> callback = Distillation(tiny_model("bert", head="classification"), temperature=2.0)
    >>> callback.method.name, callback.method.temperature
    ('distillation', 2.0)
"""

from __future__ import annotations

from attnreg import methods
from attnreg.callbacks.base import MethodCallback


class Distillation(MethodCallback):
    """Adds `weight * distillation_loss(model output, teacher output)` to the training loss; takes the arguments
    of `attnreg.methods.Distillation` (the teacher first). The LightningModule needs `attnreg.AttnRegMixin`."""

    method_class = methods.Distillation
