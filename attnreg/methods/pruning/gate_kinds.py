"""The kinds of gate `HeadGating` trains and the removal it ends in: three small configs, each a frozen dataclass
a Hydra config can name, and each its own strategy (`GateKind`: make a layer's gate, its penalty, its scores).

- `L1Gates`: gates start at 1; penalty `weight * sum |g|` (divided by the number of gated heads with
  `normalize`); scores `|g|`.
- `HardConcreteGates`: L0 gates (Louizos et al. 2018, as Voita et al. 2019); penalty `weight * expected
  L0`, or CoFi's Lagrangian toward a head count (see the class).
- `Removal`: which heads go and when (see `attnreg.methods.pruning.method`); `PruningRound`, one removal done.

Example:
    >>> Removal(keep=6, groups=True).during_training, L1Gates().targets_count, HardConcreteGates().targets_count
    (False, False, True)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from attnreg.hub import AttentionHub
from attnreg.methods import pruning
from attnreg.methods.loss_term import check_weight
from attnreg.schedules import ScheduleLike

Milestones = Sequence[tuple[float, int]]


class GateKind:
    """What `HeadGating` asks of a kind of gate (a frozen config dataclass that is also its strategy): make the
    gate of a layer, its per-head penalty values (summed, times the weight), its per-head scores (which heads stay),
    and, for a kind that can aim at a head count (`targets_count`), the expected number of open heads at the start
    and the multipliers' optimizer; `before_step` runs once per optimizer step, before it.

    Example:
        >>> kind = HardConcreteGates()
        >>> kind.targets_count, L1Gates().targets_count
        (True, False)
        >>> round(kind.initial_open(8), 2)                     # expected open heads of 8 fresh gates
        7.78
    """

    targets_count: ClassVar[bool] = False

    def make(self, hub: AttentionHub, layer: int) -> torch.Tensor | nn.Module:
        """Install the gate of `layer` on `hub` (before the optimizer exists) and return it.

        Example:
            >>> class Mine(GateKind): ...
            >>> Mine().make(None, 0)
            Traceback (most recent call last):
            ...
            NotImplementedError: Mine, a GateKind, must implement make(hub, layer): install the gate of `layer` on the
            hub (hub.install_gate, say) and return it
        """
        raise NotImplementedError(
            f"{type(self).__name__}, a GateKind, must implement make(hub, layer): install the gate of `layer` on the "
            "hub (hub.install_gate, say) and return it"
        )

    def penalty(self, gate: Any) -> torch.Tensor:
        """Per-head values whose sum the penalty weighs (differentiable)."""
        raise NotImplementedError(
            f"{type(self).__name__}, a GateKind, must implement penalty(gate): the per-head values whose sum the "
            "penalty weighs, differentiable"
        )

    def score(self, gate: Any) -> torch.Tensor:
        """Per-head scores, detached: the lowest go first."""
        raise NotImplementedError(
            f"{type(self).__name__}, a GateKind, must implement score(gate): per-head scores, detached, the lowest "
            "removed first"
        )

    def before_step(self, gate: Any) -> None:
        """Once per optimizer step, before it (clamping, say); nothing by default."""

    def initial_open(self, heads: int) -> float:
        """The expected number of open heads among `heads` fresh gates (where a count target starts)."""
        return float(heads)

    def dual_optimizer(self, multipliers: torch.Tensor) -> torch.optim.Optimizer | None:
        """The optimizer of the Lagrange multipliers toward a head count, or None."""
        return None


@dataclass(frozen=True)
class L1Gates(GateKind):
    """Gates starting at 1 with an L1 penalty of `weight` (a number or a schedule of progress).

    Example:
        >>> from attnreg.methods import HeadGating
        >>> from attnreg.tiny import tiny_model
        >>> gating = HeadGating(L1Gates(weight=0.1), Removal(keep=6))
        >>> gating.bind(tiny_model("bert"), taken=set()); gating.start(estimated_steps=10)
        >>> gating.term(None, None, step=0)[0]              # 0.1 * sum |g| / 8 gated heads, every gate at 1
        tensor(0.1000, grad_fn=<DivBackward0>)
        >>> L1Gates(weight=-1.0)
        Traceback (most recent call last):
        ...
        ValueError: gates: weight must be a finite number >= 0 or a schedule of progress, got -1.0
    """

    weight: ScheduleLike = 0.01
    normalize: bool = True

    def __post_init__(self) -> None:
        _check_schedule_weight(self.weight)

    def make(self, hub: AttentionHub, layer: int) -> torch.Tensor:
        return hub.gate(layer)

    def penalty(self, gate: torch.Tensor) -> torch.Tensor:
        return whole(gate).abs()

    def score(self, gate: torch.Tensor) -> torch.Tensor:
        return whole(gate).detach().abs()


@dataclass(frozen=True)
class HardConcreteGates(GateKind):
    """Hard-concrete (L0) gates: `temperature`, `stretch`, log-alpha starting at `initial_log_alpha`.

    Without a head count in `Removal`, the penalty is `weight * expected L0` (divided by the number of
    gated heads with `normalize`). With one (`Removal(keep=K)` or milestones) it is CoFi's Lagrangian
    (Xia, Zhong and Chen 2022, "Structured Pruning Learns Compact and Accurate Models"), `weight` unused:

    - `l1 g + l2 g^2` with `g = s - t` in heads: `s` the expected number of open heads (differentiable),
      `t` the target, which falls linearly from where the gates start (`HeadGating.initial_heads`) to K
      over the first `target_warmup` of training and stays at K after (CoFi: `lagrangian_warmup`, in
      epochs there, from sparsity 0);
    - the multipliers `l1, l2` start at 0 and act from the first step. They are trained by gradient
      ascent (they maximize the Lagrangian: `l1` follows the sign of the gap, `l2` only grows) with an
      Adam of their own at `lagrangian_lr` (CoFi: AdamW at minus its `reg_learning_rate`), one step per
      optimizer step with the mean gradient of its micro-batches (`HeadGating.dual_step`), and are saved
      in checkpoints with that optimizer's state;
    - unlike CoFi, whose gap is a fraction (of parameters), `g` counts heads. Adam moves both multipliers
      by about `lagrangian_lr` a step, so with a fractional gap the quadratic term's pull `2 l2 g` stays
      far below `l1` near the target: `l1` winds up while the gates lag, and the count falls far past the
      target before `l1` turns (CoFi's thousands of steps give `l2` time to grow; in 250 steps on SST-2
      plain dual ascent on a fractional gap, this method before, let the count fall to 20.7 for a target
      of 36: `benchmarks/results/sst2_pruning/hc_recovery`). In heads the quadratic term holds the count
      within a head of the target after a few tens of steps;
    - log-alpha trains in the model's optimizer: give the gates a group of their own
      (`attnreg.methods.pruning.gate_parameters`, the `gates` group of
      `attnreg.methods.layerwise_lr.layerwise_param_groups`, or
      `SequenceClassifier(gate_lr=...)`) at a learning rate large enough for a gate to cross its bounds
      several times in training. The count follows the target whatever the rate, but slow gates follow
      it together, all half-open, instead of closing the least useful heads and opening the rest: on
      SST-2 with MiniLM (250 steps, keep=36 of 72, removal at the end) at 0.05 the count ends at 35.9
      with 8 gates above 0.5 and 79.9% dev accuracy, at 0.5 at 36.0 with 32 above 0.5 and 84.9%
      (`benchmarks/results/sst2_pruning/hc_gate_lr0.05_seed0`, `hc_end_seed0`; CoFi: 0.01 over
      thousands of steps);
    - `log_alpha_bounds` clamps log-alpha once per optimizer step, before it (CoFi: log(1e-2), log(1e2),
      after it), so a closed gate can reopen; None leaves it free. A gate closed at -4.6 is still open
      with probability 0.05, which the expected count includes.

    Example:
        >>> gates = HardConcreteGates(target_warmup=0.5, lagrangian_lr=5e-4)
        >>> gates.log_alpha_bounds
        (-4.6, 4.6)
        >>> HardConcreteGates(target_warmup=1.0)
        Traceback (most recent call last):
        ...
        ValueError: target_warmup must be a fraction of training in [0, 1), got 1.0
    """

    weight: ScheduleLike = 0.01
    normalize: bool = True
    temperature: float = 2.0 / 3.0
    stretch: tuple[float, float] = (-0.1, 1.1)
    initial_log_alpha: float = 2.0
    target_warmup: float = 0.0
    lagrangian_lr: float = 5e-4
    log_alpha_bounds: tuple[float, float] | None = (-4.6, 4.6)

    def __post_init__(self) -> None:
        _check_schedule_weight(self.weight)
        object.__setattr__(self, "stretch", tuple(self.stretch))
        pruning.HardConcreteGate(0, temperature=self.temperature, stretch=self.stretch)  # validates both now
        if not 0.0 <= self.target_warmup < 1.0:
            raise ValueError(f"target_warmup must be a fraction of training in [0, 1), got {self.target_warmup}")
        _check_positive(self.lagrangian_lr, "lagrangian_lr")
        if self.log_alpha_bounds is not None:
            bounds = tuple(self.log_alpha_bounds)
            numbers = all(isinstance(b, int | float) and not isinstance(b, bool) and math.isfinite(b) for b in bounds)
            if len(bounds) != 2 or not numbers or not bounds[0] < bounds[1]:
                raise ValueError(f"log_alpha_bounds must be (low, high) with low < high, or None; got {bounds!r}")
            object.__setattr__(self, "log_alpha_bounds", (float(bounds[0]), float(bounds[1])))

    targets_count: ClassVar[bool] = True

    def make(self, hub: AttentionHub, layer: int) -> pruning.HardConcreteGate:
        return pruning.make_hard_concrete(hub, layer, self.initial_log_alpha, self.temperature, self.stretch)

    def penalty(self, gate: pruning.HardConcreteGate) -> torch.Tensor:
        return whole(gate.expected_l0())

    def score(self, gate: pruning.HardConcreteGate) -> torch.Tensor:
        return whole(gate.deterministic()).detach()

    def before_step(self, gate: pruning.HardConcreteGate) -> None:
        if self.log_alpha_bounds is not None:
            with torch.no_grad():
                gate.log_alpha.clamp_(*self.log_alpha_bounds)

    def initial_open(self, heads: int) -> float:
        gate = pruning.HardConcreteGate(heads, self.initial_log_alpha, self.temperature, self.stretch)
        return float(gate.expected_l0().detach().sum())  # summed as `term` sums: the first gap is exactly 0

    def dual_optimizer(self, multipliers: torch.Tensor) -> torch.optim.Optimizer:
        """Adam maximizing the Lagrangian in the multipliers (CoFi's AdamW at a negative learning rate, without
        weight decay)."""
        return torch.optim.Adam([multipliers], lr=self.lagrangian_lr, maximize=True)


@dataclass(frozen=True)
class Removal:
    """Which heads go and when (see the module docstring). `protect` heads always stay and count among
    the `keep` kept (with `groups`, their key/value groups count, checked when the method binds to a model).

    Example:
        >>> Removal(keep=36, protect={4: [9], 2: [1, 1]}).protect        # original head numbers per layer
        {2: (1,), 4: (9,)}
        >>> Removal(keep=1, protect={0: [1], 3: [2]})
        Traceback (most recent call last):
        ...
        ValueError: Removal: protect holds 2 heads, more than keep=1 heads kept
        >>> Removal(keep=2, groups=True).groups                      # keep 2 key/value groups, each whole
        True
    """

    threshold: float = 0.1
    keep: int | None = None
    after_steps: int | None = None
    after_epochs: int | None = None
    milestones: Milestones | None = field(default=None)
    protect: Mapping[int, Sequence[int]] | None = field(default=None, hash=False)
    groups: bool = False

    def __post_init__(self) -> None:
        _check_positive(self.threshold, "threshold")
        for argument in ("after_steps", "after_epochs", "keep"):
            value = getattr(self, argument)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"Removal: {argument} must be an integer >= 0, got {value!r}")
        milestones = _check_milestones(self.milestones, self.keep, self.after_steps, self.after_epochs)
        object.__setattr__(self, "milestones", milestones or None)
        if milestones:
            object.__setattr__(self, "keep", milestones[-1][1])
        protect = _check_protect(self.protect)
        object.__setattr__(self, "protect", protect or None)
        counted = sum(len(heads) for heads in protect.values())
        fewest = min((count for _, count in milestones), default=self.keep)
        if fewest is not None and counted > fewest and not self.groups:
            raise ValueError(f"Removal: protect holds {counted} heads, more than keep={fewest} heads kept")

    @property
    def during_training(self) -> bool:
        """Whether heads go before the end of training (shapes change mid-run)."""
        return bool(self.milestones) or self.after_steps is not None or self.after_epochs is not None


@dataclass(frozen=True)
class PruningRound:
    """One removal: at optimizer step `step`, the heads chosen (original numbers per layer; heads silenced
    in an earlier round under the grouped-query rule are chosen again) and what
    `attnreg.methods.pruning.prune_heads` did (`report.heads`: heads per layer afterwards).

    Example:
        >>> from attnreg.methods import HeadGating
        >>> from attnreg.tiny import tiny_model
        >>> gating = HeadGating(L1Gates(), Removal(keep=6))
        >>> gating.bind(tiny_model("bert"), taken=set()); gating.start(estimated_steps=10)
        >>> _ = gating.hub.gate(1).data.copy_(torch.tensor([1.0, 0.5, 0.0, 0.2]))   # as if trained
        >>> _ = gating.prune([], step=3, keep=6)
        >>> done = gating.rounds[-1]
        >>> done.step, done.chosen, done.final, done.report.heads         # heads: (query, key/value) per layer
        (3, {1: [2, 3]}, True, {0: (4, 4), 1: (2, 2)})
    """

    step: int
    chosen: dict[int, list[int]]
    report: pruning.PruneReport
    final: bool


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A gate sharded by FSDP2 (a `DTensor`) as one full tensor, differentiably (an all-gather whose backward
    reduce-scatters), so that the penalty reads every head; any other tensor as it is.

    Example:
        >>> gate = torch.ones(4)
        >>> whole(gate) is gate
        True
    """
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _check_schedule_weight(weight: ScheduleLike) -> None:
    if not callable(weight):
        check_weight(weight, "gates")


def _check_positive(value: Any, argument: str) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value > 0):
        raise ValueError(f"{argument} must be a finite number > 0, got {value!r}")


def _check_protect(protect: Mapping[int, Sequence[int]] | None) -> dict[int, tuple[int, ...]]:
    if protect is None:
        return {}
    if not isinstance(protect, Mapping):
        raise TypeError(f"Removal: protect must map layers to original head numbers, e.g. {{4: [9]}}; got {protect!r}")

    def number(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    checked = {}
    for layer, heads in protect.items():
        if not number(layer) or isinstance(heads, str) or not isinstance(heads, Iterable):
            raise TypeError(
                f"Removal: protect must map layer numbers to lists of head numbers; got {layer!r}: {heads!r}"
            )
        heads = list(heads)
        if not heads or not all(number(head) for head in heads):
            raise ValueError(f"Removal: protect[{layer}] must list head numbers >= 0, got {heads!r}")
        checked[layer] = tuple(sorted(set(heads)))
    return dict(sorted(checked.items()))


def _check_milestones(
    milestones: Milestones | None, keep: int | None, after_steps: int | None, after_epochs: int | None
) -> tuple[tuple[float, int], ...]:
    if milestones is None:
        return ()
    if after_steps is not None or after_epochs is not None:
        raise ValueError("Removal: give milestones or after_steps / after_epochs, not both")
    checked: list[tuple[float, int]] = []
    for item in milestones:
        try:
            at, count = item
        except (TypeError, ValueError):
            raise ValueError(
                f"Removal: each milestone is (progress, heads to keep), e.g. (0.5, 36); got {item!r}"
            ) from None
        if isinstance(at, bool) or not isinstance(at, int | float) or not 0.0 < at <= 1.0:
            raise ValueError(f"Removal: a milestone's progress must be in (0, 1], got {at!r} in {item!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"Removal: a milestone's head count must be an integer >= 0, got {count!r}")
        if checked and (at <= checked[-1][0] or count >= checked[-1][1]):
            raise ValueError(
                f"Removal: milestones must rise in progress and fall in heads kept; {item!r} follows {checked[-1]!r}"
            )
        checked.append((float(at), count))
    if not checked:
        raise ValueError("Removal: milestones is empty (leave it None to prune once)")
    if keep is not None and keep != checked[-1][1]:
        raise ValueError(f"Removal: keep={keep} disagrees with the last milestone's {checked[-1][1]} heads")
    return tuple(checked)
