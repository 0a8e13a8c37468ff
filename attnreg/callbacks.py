"""Lightning callbacks: thin adapters that decide *when* attnreg's functions run.

Example:
    >>> trainer = lightning.Trainer(callbacks=[attnreg.AttentionLoss(my_loss, name="mine", layers=[0])])
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning as L
import torch

from attnreg.hub import AttentionRecord
from attnreg.mixin import TermFunction, require_mixin


class AttentionLoss(L.Callback):
    """Adds `weight * fn(probs, batch)` to the training loss, logged as `attnreg/<name>`.

    `fn` receives the captured attention of `layers` (None = all) as an `AttentionRecord` and the
    batch; it returns a scalar tensor. The LightningModule must use `attnreg.AttnRegMixin`.
    """

    def __init__(
        self,
        fn: TermFunction,
        name: str = "attention_loss",
        layers: int | Iterable[int] | None = None,
        weight: float = 1.0,
    ) -> None:
        self.fn = fn
        self.name = name
        self.layers = layers
        self.weight = weight

    def term(self, probs: AttentionRecord, batch: Any) -> torch.Tensor:
        return self.weight * self.fn(probs, batch)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        module = require_mixin(pl_module, self)
        module.remove_attnreg_term(self.name)
        module.add_attnreg_term(self.name, self.term, layers=self.layers)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pl_module.remove_attnreg_term(self.name)
