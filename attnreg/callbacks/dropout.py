"""`AttentionDropoutSchedule`: attention (and optionally hidden) dropout that follows a schedule, in
Lightning (a thin adapter of `attnreg.methods.DropoutSchedule`).

Example:
    >>> from attnreg.schedules import EarlyDropout
    >>> trainer = lightning.Trainer(callbacks=[AttentionDropoutSchedule(EarlyDropout(0.1, cutoff=0.25))])
"""

from __future__ import annotations

from typing import Any

import lightning as L

from attnreg.callbacks.base import MethodCallback
from attnreg.methods.dropout import DropoutSchedule


class AttentionDropoutSchedule(MethodCallback):
    """Sets attention dropout to `schedule(progress)` before every training step, logged as `attnreg/<name>`
    (`attnreg.methods.DropoutSchedule`, which lists the arguments). The LightningModule needs to hold
    exactly one transformers model (no mixin needed). After `fit` the model's own rates are restored.

    Example:
        >>> AttentionDropoutSchedule(CurriculumDropout(final=0.1, gamma=10.0), layers=[4, 5], hidden=0.1)
    """

    method_class = DropoutSchedule

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        for name, rate in self.method.before_step(trainer.global_step).items():
            pl_module.log(f"attnreg/{name}", rate, on_step=True, on_epoch=False)
