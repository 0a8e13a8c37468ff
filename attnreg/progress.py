"""How far training is: one rule for every schedule attnreg drives (loss weights, dropout, learning
rates, pruning milestones), whatever the trainer.

Progress is `step / total_steps`, clamped to [0, 1]. The total is the length of *this* run: the
trainer's estimate (`max_steps`, or epochs times batches), or a length the user fixed. The rule on
resume: a checkpoint records the total it ran with; when the resumed run is set up for a different
length, every schedule is re-stretched over the new length (step k is then at progress k / new total)
and a warning says so. A schedule never silently stays at its end value for the added steps (a
learning rate of 0, say). When the length cannot be known (an IterableDataset without `max_steps`),
a schedule that changes over training stops with an error naming `max_steps`; constants need no length.

Example:
    >>> length = TrainingLength("EntropyRegularizer weight")
    >>> length.start(estimate=100.0, needs_length=True)
    >>> length.progress(25)
    0.25
    >>> length.load_state_dict(length.state_dict())      # a resume with more steps re-stretches:
    >>> length.start(estimate=200.0, needs_length=True)  # warns "re-stretched from 100 to 200 steps"
    >>> length.progress(25)
    0.125
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

from attnreg.schedules import Constant


class TrainingLengthWarning(UserWarning):
    """A schedule spans a different number of steps than the run it is resumed or used in.

    Example:
        >>> length = TrainingLength("LayerwiseLR", fixed_total=50)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     length.start(estimate=80.0, needs_length=True)
        >>> caught[0].category.__name__, str(caught[0].message)
        ('TrainingLengthWarning', "LayerwiseLR: total_steps=50 but this run has 80 optimizer steps; ...")
    """


def changes_over_training(schedule: Callable[[float], float] | None) -> bool:
    """False for None and `Constant` schedules (they need no training length), True otherwise.

    Example:
        >>> from attnreg.schedules import Linear
        >>> changes_over_training(Constant(0.1)), changes_over_training(Linear(0.1, 0.0))
        (False, True)
    """
    return schedule is not None and not isinstance(schedule, Constant)


class TrainingLength:
    """The number of optimizer steps a schedule spans, and the progress at a step (see the module doc).

    `owner` names the schedule in messages; `fixed_total` is a length the user set (`total_steps=`),
    which then wins over the trainer's estimate.

    Example:
        >>> length = TrainingLength("DropoutSchedule")
        >>> length.start(estimate=float("inf"), needs_length=False)   # a constant needs no length
        >>> length.total, length.progress(10)
        (None, 0.0)
        >>> length.start(estimate=float("inf"), needs_length=True)
        Traceback (most recent call last):
        ...
        ValueError: DropoutSchedule changes over training, which needs the number of optimizer steps, ...
    """

    def __init__(self, owner: str, fixed_total: int | None = None) -> None:
        if fixed_total is not None and (isinstance(fixed_total, bool) or not isinstance(fixed_total, int)):
            raise TypeError(f"{owner}: total_steps must be an integer or None, got {fixed_total!r}")
        if fixed_total is not None and fixed_total < 1:
            raise ValueError(f"{owner}: total_steps must be >= 1, got {fixed_total}")
        self.owner = owner
        self.fixed_total = fixed_total
        self.total: int | None = None
        self._recorded: int | None = None  # the total of the checkpoint being resumed

    def start(self, estimate: float, needs_length: bool) -> None:
        """Fix the total at the start of a run from the trainer's `estimate` of its optimizer steps
        (inf or NaN when unknown). `needs_length`: whether the schedule changes over training.

        Example:
            >>> length = TrainingLength("Entropy weight", fixed_total=10)   # the fixed total wins
            >>> length.start(estimate=4.0, needs_length=True); length.total
            10
        """
        known = math.isfinite(estimate) and estimate >= 1
        if self.fixed_total is not None:
            if known and self.fixed_total < int(estimate):
                warnings.warn(
                    f"{self.owner}: total_steps={self.fixed_total} but this run has {int(estimate)} optimizer steps; "
                    "the steps after it keep the schedule's final value",
                    TrainingLengthWarning,
                    stacklevel=2,
                )
            self.total = self.fixed_total
        elif known:
            self.total = int(estimate)
        elif needs_length:
            raise ValueError(
                f"{self.owner} changes over training, which needs the number of optimizer steps, and this run's is "
                "unknown (an IterableDataset without a length, say): set max_steps on the trainer, or total_steps= "
                "where the schedule takes one"
            )
        else:
            self.total = None
        recorded, self._recorded = self._recorded, None
        if needs_length and recorded is not None and self.total is not None and recorded != self.total:
            warnings.warn(
                f"{self.owner}: the checkpoint's schedule spans {recorded} steps and this run {self.total}; "
                f"the schedule is re-stretched from {recorded} to {self.total} steps",
                TrainingLengthWarning,
                stacklevel=2,
            )

    def progress(self, step: int) -> float:
        """`step / total`, clamped to [0, 1]; 0 while the length is unknown (constant schedules only).

        Example:
            >>> length = TrainingLength("schedule")
            >>> length.start(estimate=8.0, needs_length=True)
            >>> length.progress(2), length.progress(20)
            (0.25, 1.0)
        """
        if self.total is None:
            return 0.0
        return min(max(step, 0), self.total) / self.total

    def state_dict(self) -> dict[str, Any]:
        return {"total_steps": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._recorded = state.get("total_steps")
