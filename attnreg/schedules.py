"""Schedules: a value as a plain function of training progress, for dropout rates and learning-rate factors.

Progress is the fraction of training done, in [0, 1]; step `s` of `T` optimizer steps is `s / T` (the
convention of torch's `LambdaLR`, so step 0 is progress 0 and the last step is `(T - 1) / T`). Every
schedule is a small frozen dataclass, validated when built, so Hydra can instantiate one from plain config
values (`_target_: attnreg.schedules.Linear`, `initial: 0.1`, `final: 0.0`) and nest them (`Warmup.then`).
Windows (`start`, `end`, `cutoff`, `boundaries`) are fractions of training, never step counts.

Example:
    >>> from attnreg.schedules import Linear, Warmup, EarlyDropout
    >>> Linear(initial=0.2, final=0.0)(0.5)
    0.1
    >>> Warmup(fraction=0.1, then=Linear(1.0, 0.0)).at_step(5, total_steps=100)   # transformers' linear warmup
    0.5
    >>> EarlyDropout(rate=0.1, cutoff=0.2)(0.5)
    0.0
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal


class Schedule(ABC):
    """A value as a function of training progress in [0, 1]; call it with the progress.

    A subclass is a frozen dataclass that defines `_value(progress)`.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass(frozen=True)
        ... class Square(Schedule):
        ...     def _value(self, progress):
        ...         return progress**2
        >>> Square()(0.5), Square().at_step(1, total_steps=4)
        (0.25, 0.0625)
    """

    def __call__(self, progress: float) -> float:
        if not 0.0 <= progress <= 1.0:  # also rejects NaN
            raise ValueError(f"progress must be a fraction of training in [0, 1], got {progress}")
        return float(self._value(progress))

    @abstractmethod
    def _value(self, progress: float) -> float:
        """The value at `progress`, already checked to lie in [0, 1]."""

    def at_step(self, step: int, total_steps: int) -> float:
        """The value at optimizer step `step` (0-based) of `total_steps`.

        Example:
            >>> Linear(1.0, 0.0).at_step(1, total_steps=4)
            0.75
        """
        return self(step_progress(step, total_steps))


ScheduleLike = Schedule | Callable[[float], float] | float


def step_progress(step: int, total_steps: int) -> float:
    """`step / total_steps`, checked: 0 <= step <= total_steps, total_steps >= 1.

    Example:
        >>> step_progress(5, 20)
        0.25
    """
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be a positive integer, got {total_steps!r}")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= total_steps:
        raise ValueError(f"step must be an integer in [0, total_steps={total_steps}], got {step!r}")
    return step / total_steps


def as_schedule(schedule: ScheduleLike, argument: str = "schedule") -> Callable[[float], float]:
    """A number becomes `Constant(number)`; a schedule or any callable of progress is returned as is.

    Example:
        >>> as_schedule(0.3)
        Constant(value=0.3)
        >>> as_schedule(lambda progress: 1 - progress)(0.25)
        0.75
    """
    if isinstance(schedule, bool):
        raise TypeError(f"{argument} must be a schedule, a callable of progress or a number, got {schedule!r}")
    if isinstance(schedule, int | float):
        return Constant(float(schedule))
    if not callable(schedule):
        raise TypeError(
            f"{argument} must be a schedule, a callable of progress or a number, got {type(schedule).__name__}"
        )
    return schedule


def schedule_values(schedule: Callable[[float], float], total_steps: int) -> list[float]:
    """The value at each optimizer step `0 .. total_steps - 1` (what a callback will use).

    Example:
        >>> schedule_values(Linear(1.0, 0.0), total_steps=4)
        [1.0, 0.75, 0.5, 0.25]
    """
    step_progress(0, total_steps)
    return [float(schedule(step / total_steps)) for step in range(total_steps)]


# -- generic schedules ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Constant(Schedule):
    """The same value throughout.

    Example:
        >>> Constant(0.1)(0.7)
        0.1
    """

    value: float

    def __post_init__(self) -> None:
        _check_values(self, "value")

    def _value(self, progress: float) -> float:
        return self.value


@dataclass(frozen=True)
class Linear(Schedule):
    """`initial` until `start`, then a straight line to `final` at `end`, then `final`.

    Example:
        >>> Linear(0.1, 0.0, start=0.5)(0.25), Linear(0.1, 0.0, start=0.5)(0.75)
        (0.1, 0.05)
    """

    initial: float
    final: float
    start: float = 0.0
    end: float = 1.0

    def __post_init__(self) -> None:
        _check_values(self, "initial", "final")
        _check_window(self.start, self.end)

    def _value(self, progress: float) -> float:
        return self.initial + (self.final - self.initial) * _fraction_of_window(progress, self.start, self.end)


@dataclass(frozen=True)
class Cosine(Schedule):
    """Half a cosine from `initial` (at `start`) to `final` (at `end`), flat outside the window.

    Example:
        >>> [round(Cosine(1.0, 0.0)(progress), 3) for progress in (0.0, 0.25, 0.5, 1.0)]
        [1.0, 0.854, 0.5, 0.0]
    """

    initial: float
    final: float
    start: float = 0.0
    end: float = 1.0

    def __post_init__(self) -> None:
        _check_values(self, "initial", "final")
        _check_window(self.start, self.end)

    def _value(self, progress: float) -> float:
        done = _fraction_of_window(progress, self.start, self.end)
        return self.final + (self.initial - self.final) * 0.5 * (1.0 + math.cos(math.pi * done))


@dataclass(frozen=True)
class Exponential(Schedule):
    """Geometric interpolation `initial * (final / initial) ** done` over the window; both values > 0.

    Example:
        >>> Exponential(1.0, 0.01)(0.5)
        0.1
    """

    initial: float
    final: float
    start: float = 0.0
    end: float = 1.0

    def __post_init__(self) -> None:
        _check_values(self, "initial", "final")
        for name in ("initial", "final"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"Exponential: {name} must be > 0 (an exponential never reaches 0), got {getattr(self, name)}; "
                    "use Linear or Cosine to reach 0"
                )
        _check_window(self.start, self.end)

    def _value(self, progress: float) -> float:
        done = _fraction_of_window(progress, self.start, self.end)
        return self.initial * (self.final / self.initial) ** done


@dataclass(frozen=True)
class Step(Schedule):
    """Piecewise constant: `values[i]` from `boundaries[i - 1]` (inclusive) to `boundaries[i]`.

    Example:
        >>> step = Step(values=[0.1, 0.05, 0.0], boundaries=[0.3, 0.6])
        >>> step(0.29), step(0.3), step(0.9)
        (0.1, 0.05, 0.0)
    """

    values: Sequence[float]
    boundaries: Sequence[float]

    def __post_init__(self) -> None:
        values = tuple(_check_value(v, f"values[{i}]") for i, v in enumerate(self.values))
        boundaries = tuple(float(b) for b in self.boundaries)
        if len(values) != len(boundaries) + 1:
            raise ValueError(
                f"Step needs one value more than boundaries, got {len(values)} values and {len(boundaries)} boundaries"
            )
        for index, boundary in enumerate(boundaries):
            if not 0.0 < boundary < 1.0:
                raise ValueError(f"Step: boundaries[{index}]={boundary} lies outside training (0, 1)")
            if index and boundary <= boundaries[index - 1]:
                raise ValueError(f"Step: boundaries must increase, got {list(boundaries)}")
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "boundaries", boundaries)

    def _value(self, progress: float) -> float:
        return self.values[sum(progress >= boundary for boundary in self.boundaries)]


@dataclass(frozen=True)
class Warmup(Schedule):
    """A linear ramp from `initial` to `then(0)` over the first `fraction` of training, then `then`
    stretched over the rest (its progress 0..1 maps to `fraction`..1).

    `Warmup(0.06, Linear(1.0, 0.0))` is transformers' `get_linear_schedule_with_warmup` as a factor.

    Example:
        >>> Warmup(0.5, Constant(0.2))(0.25)
        0.1
        >>> Warmup(0.2, then=Linear(1.0, 0.0))(0.6)      # halfway through the decay
        0.5
    """

    fraction: float
    then: Schedule
    initial: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction < 1.0:
            raise ValueError(f"Warmup: fraction must be in (0, 1), got {self.fraction}")
        _check_values(self, "initial")
        object.__setattr__(self, "then", as_schedule(self.then, "then"))

    def _value(self, progress: float) -> float:
        if progress < self.fraction:
            return self.initial + (self.then(0.0) - self.initial) * progress / self.fraction
        return self.then((progress - self.fraction) / (1.0 - self.fraction))


# -- dropout schedules from the literature ----------------------------------------------------------------


@dataclass(frozen=True)
class EarlyDropout(Schedule):
    """Early dropout (Liu et al. 2023, "Dropout Reduces Underfitting"): `rate` until `cutoff`, then 0.

    `shape="linear"` decreases from `rate` to 0 at `cutoff` instead, as their `drop_scheduler(...,
    mode="early", schedule="linear")` does (theirs is `np.linspace(rate, 0, n)` over the early steps, so
    it reaches 0 one step sooner; here `rate * (1 - progress / cutoff)`).

    Example:
        >>> EarlyDropout(0.1, cutoff=0.5)(0.25), EarlyDropout(0.1, cutoff=0.5, shape="linear")(0.25)
        (0.1, 0.05)
    """

    rate: float
    cutoff: float
    shape: Literal["constant", "linear"] = "constant"

    def __post_init__(self) -> None:
        _check_rate(self.rate, "EarlyDropout: rate")
        _check_cutoff(self.cutoff, "EarlyDropout")
        if self.shape not in ("constant", "linear"):
            raise ValueError(f"EarlyDropout: shape must be 'constant' or 'linear', got {self.shape!r}")

    def _value(self, progress: float) -> float:
        if progress >= self.cutoff:
            return 0.0
        return self.rate if self.shape == "constant" else self.rate * (1.0 - progress / self.cutoff)


@dataclass(frozen=True)
class LateDropout(Schedule):
    """Late dropout (Liu et al. 2023): no dropout until `cutoff`, then `rate`.

    Example:
        >>> LateDropout(0.1, cutoff=0.5)(0.4), LateDropout(0.1, cutoff=0.5)(0.5)
        (0.0, 0.1)
    """

    rate: float
    cutoff: float

    def __post_init__(self) -> None:
        _check_rate(self.rate, "LateDropout: rate")
        _check_cutoff(self.cutoff, "LateDropout")

    def _value(self, progress: float) -> float:
        return self.rate if progress >= self.cutoff else 0.0


@dataclass(frozen=True)
class CurriculumDropout(Schedule):
    """Curriculum dropout (Morerio et al. 2017): the rate rises from 0 toward `final`.

    Morerio et al. schedule the *keep* probability, theta(t) = (1 - theta_final) exp(-gamma t) + theta_final
    with t the iteration (their code: `(1. - p) * np.exp(-gamma * x) + p`, `p` a keep probability). As a
    dropout rate, with `final = 1 - theta_final`:

        rate(progress) = final * (1 - exp(-gamma * progress))

    `gamma` here is per unit of *progress*: their per-iteration gamma times the total iterations (their
    MNIST setting, gamma 0.001 over about 64,000 iterations, is about 64 here). The rate is 95% of
    `final` at progress 3 / gamma.

    Example:
        >>> CurriculumDropout(final=0.1, gamma=10.0)(0.1)       # 0.1 * (1 - exp(-1))
        0.0632...
    """

    final: float
    gamma: float

    def __post_init__(self) -> None:
        _check_rate(self.final, "CurriculumDropout: final")
        if not (math.isfinite(self.gamma) and self.gamma > 0):
            raise ValueError(f"CurriculumDropout: gamma must be a finite number > 0, got {self.gamma}")

    def _value(self, progress: float) -> float:
        return self.final * -math.expm1(-self.gamma * progress)


# -- checks -------------------------------------------------------------------------------------------------


def _check_value(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_values(schedule: Schedule, *names: str) -> None:
    for name in names:
        object.__setattr__(schedule, name, _check_value(getattr(schedule, name), f"{type(schedule).__name__}: {name}"))


def _check_rate(rate: float, name: str) -> None:
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate < 1.0:
        raise ValueError(f"{name} is a dropout rate and must be in [0, 1), got {rate!r}")


def _check_window(start: float, end: float) -> None:
    if not (0.0 <= start <= 1.0 and 0.0 <= end <= 1.0):
        raise ValueError(f"start={start} and end={end} must be fractions of training in [0, 1]")
    if end <= start:
        raise ValueError(f"end={end} must come after start={start}")


def _check_cutoff(cutoff: float, name: str) -> None:
    if not 0.0 < cutoff < 1.0:
        raise ValueError(
            f"{name}: cutoff={cutoff} lies outside training: it is a fraction of training in (0, 1) "
            "(0 or 1 would make the schedule a constant)"
        )


def _fraction_of_window(progress: float, start: float, end: float) -> float:
    return min(max((progress - start) / (end - start), 0.0), 1.0)
