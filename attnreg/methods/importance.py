"""Head importance after training (Michel et al. 2019) as a method object, with optional iterative pruning.

Example:
    >>> importance = HeadImportance(dev_loader, metric_fn=lambda m: accuracy(m, dev), fraction=0.1)
    >>> importance.bind(model)
    >>> importance.at_end()          # importance.scores, importance.curve
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from attnreg import pruning
from attnreg.methods.base import Method


class HeadImportance(Method):
    """Scores heads at the end of training and, given `metric_fn`, prunes iteratively until the metric
    falls below `stop_ratio` of its start (`attnreg.pruning.iterative_pruning`).

    `dataloader` yields dict batches for `model(**batch)` (with labels, or pass `loss_fn`).
    After training: `scores` (per layer, current head positions) and `curve` (`attnreg.pruning.PruningStep`s).
    """

    default_name = "head_importance"

    def __init__(
        self,
        dataloader: Iterable[Any],
        loss_fn: pruning.LossFunction | None = None,
        metric_fn: Callable[[torch.nn.Module], float] | None = None,
        fraction: float = 0.1,
        stop_ratio: float = 0.9,
    ) -> None:
        super().__init__()
        self.dataloader, self.loss_fn, self.metric_fn = dataloader, loss_fn, metric_fn
        self.fraction, self.stop_ratio = fraction, stop_ratio
        self.scores: dict[int, torch.Tensor] = {}
        self.curve: list[pruning.PruningStep] = []

    def identity(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "stop_ratio": self.stop_ratio}

    def at_end(self) -> None:
        """Score the heads (and prune iteratively, given `metric_fn`); call once training is over."""
        model = self.require_bound()
        self.scores = pruning.head_importance(model, self.dataloader, self.loss_fn)
        if self.metric_fn is not None:
            self.curve = pruning.iterative_pruning(
                model, self.dataloader, self.metric_fn, self.fraction, self.stop_ratio, self.loss_fn
            )
