"""Head importance after training (Michel et al. 2019) as a method object, with optional iterative pruning.

Example:
    >>> from attnreg.tiny import tiny_model
    >>> dev = [{"input_ids": torch.tensor([[2, 5, 6, 3], [2, 7, 8, 3]]), "labels": torch.tensor([1, 0])}]
    >>> importance = HeadImportance(dev)        # add metric_fn=... to prune iteratively
    >>> importance.bind(tiny_model("bert", head="classification"))
    >>> importance.at_end()                     # importance.scores, importance.curve
    >>> {layer: [round(float(score.norm()), 4), len(score)] for layer, score in importance.scores.items()}
    {0: [1.0, 4], 1: [1.0, 4]}
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from attnreg import pruning
from attnreg.methods.base import Loop, Method


class HeadImportance(Method):
    """Scores heads at the end of training and, given `metric_fn`, prunes iteratively until the metric
    falls below `stop_ratio` of its start (`attnreg.pruning.iterative_pruning`).

    `dataloader` yields dict batches for `model(**batch)` (with labels, or pass `loss_fn`).
    After training: `scores` (per layer, current head positions) and `curve` (`attnreg.pruning.PruningStep`s).

    Example:
        >>> from attnreg.pruning import pruned_heads
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert", head="classification", layers=1)
        >>> dev = [{"input_ids": torch.tensor([[2, 5, 6, 3], [2, 7, 8, 3]]), "labels": torch.tensor([1, 0])}]
        >>> def accuracy(model):
        ...     return float((model(**dev[0]).logits.argmax(-1) == dev[0]["labels"]).float().mean())
        >>> importance = HeadImportance(dev, metric_fn=accuracy, fraction=0.5, stop_ratio=0.9)
        >>> importance.bind(model); importance.at_end()
        >>> [(step.heads_removed, step.metric) for step in importance.curve]   # an untrained model needs no head
        [(0, 0.5), (2, 0.5), (4, 0.5)]
        >>> pruned_heads(model)
        {0: (0, 1, 2, 3)}
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

    def on_fit_end(self, loop: Loop) -> None:
        self.at_end()

    def at_end(self) -> None:
        """Score the heads (and prune iteratively, given `metric_fn`); call once training is over."""
        model = self.require_bound()
        self.scores = pruning.head_importance(model, self.dataloader, self.loss_fn)
        if self.metric_fn is not None:
            self.curve = pruning.iterative_pruning(
                model, self.dataloader, self.metric_fn, self.fraction, self.stop_ratio, self.loss_fn
            )
