"""Soft head pruning in Lightning: gates with an L1 or hard-concrete L0 penalty, then physical removal.

`HeadGating` trains per-head gates (the hub's), adds their penalty to the loss through the mixin,
and at a chosen point, or progressively at milestones, removes the heads whose gates closed (or all
but the `keep` best), folding the remaining gates into the output projections: the smaller model
carries no gates and computes what the gated model computed with the removed gates at 0.
`HeadImportance` scores heads after training (Michel et al. 2019) and can prune iteratively. The work
is done by `attnreg.pruning`.

Example:
    >>> from attnreg.schedules import Constant, Warmup
    >>> trainer = lightning.Trainer(callbacks=[attnreg.HeadGating(weight=Warmup(0.1, Constant(0.01)))])
    >>> trainer = lightning.Trainer(callbacks=[attnreg.HeadGating(kind="hard_concrete", keep=36)])
    >>> trainer = lightning.Trainer(callbacks=[attnreg.HeadGating(milestones=[(0.3, 60), (0.6, 48), (0.8, 36)])])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import lightning as L
import torch

from attnreg import pruning
from attnreg.hub import AttentionHub, AttentionRecord
from attnreg.methods.base import free_name
from attnreg.methods.regularizers import check_weight
from attnreg.mixin import AttnRegMixin, require_mixin
from attnreg.progress import TrainingLength, changes_over_training
from attnreg.schedules import ScheduleLike, as_schedule

GateKind = Literal["l1", "hard_concrete"]
Milestones = Sequence[tuple[float, int]]


@dataclass(frozen=True)
class PruningRound:
    """One removal done by `HeadGating`: at optimizer step `step`, the heads chosen (original numbers per
    layer; heads silenced in an earlier round under the grouped-query rule are chosen again) and what
    `attnreg.pruning.prune_heads` did (`report.heads`: heads per layer afterwards)."""

    step: int
    chosen: dict[int, list[int]]
    report: pruning.PruneReport
    final: bool


class HeadGating(L.Callback):
    """Trainable per-head gates with a sparsity penalty, then physical removal of the closed heads.

    - `kind="l1"`: gates start at 1; penalty `weight * sum |g|` (divided by the number of gated heads
      with `normalize`). A head goes when |g| < `threshold`.
    - `kind="hard_concrete"`: L0 gates (Louizos et al. 2018, as Voita et al. 2019), stretch
      `stretch`, temperature `temperature`, log-alpha starting at `initial_log_alpha`; penalty
      `weight * expected L0`. With `keep`, the penalty is instead CoFi's Lagrangian
      `l1 * (s - t) + l2 * (s - t)^2` on the expected number of kept heads `s` against a target `t`
      (both divided by the number of gated heads) moving linearly from all heads to `keep` over the
      first `target_warmup` of training, with `l1, l2` raised by gradient ascent (step
      `lagrangian_lr`); `weight` is not used then. A head goes when its deterministic gate is below
      `threshold`.
    - `keep`: keep exactly the `keep` heads with the largest gates (|g|, or deterministic L0 gate)
      instead of thresholding.

    `weight` is a number or a schedule of training progress in [0, 1] (`attnreg.schedules`, e.g.
    `Warmup(0.1, Constant(0.01))`; progress = global step / the trainer's estimated steps, as for
    every attnreg weight). Gates are created in `setup`, before `configure_optimizers`, so the module
    can give them their own learning rate (`attnreg.pruning.gate_parameters`).

    When heads go: at the end of fit by default; after `prune_after_steps` optimizer steps or
    `prune_after_epochs` epochs, whichever comes first; or progressively with `milestones`, a list
    of `(progress, heads to keep)` with progress in (0, 1] rising and the counts falling, e.g.
    `[(0.3, 60), (0.5, 50), (0.7, 43)]`. Each milestone removes the lowest-scoring heads down to its
    count; the gates of the others stay and go on training (their Adam moments sliced, not reset),
    and the last milestone (or the end of fit, if training stops first) folds them. `keep` is then the
    last count. Every removal slices the optimizer's state (Adam moments of the kept heads carry on)
    and drops folded gates from it; LR schedulers are untouched. The choice is broadcast from rank 0
    and the step that triggers it is the same on every rank, so all ranks prune alike; removal
    during training under DDP is refused (its gradient buckets keep the old shapes), so with several
    processes prune at the end of fit. In grouped-query layers a chosen head whose key/value group
    keeps other heads stays, silenced (its output-projection columns zeroed); `report.kept` lists
    those, and later rounds choose them again. Resuming from a checkpoint taken after a removal
    needs `attnreg.pruning.restore_pruning(model, checkpoint)` in the module's `on_load_checkpoint`
    (the mixin does it; Lightning runs a callback's `on_load_checkpoint` only after the weights).

    Example:
        >>> gating = attnreg.HeadGating(weight=Warmup(0.1, Constant(0.02)), prune_after_steps=2000)
        >>> gating = attnreg.HeadGating(kind="hard_concrete", milestones=[(0.3, 60), (0.5, 50), (0.7, 43)])
        >>> trainer = lightning.Trainer(callbacks=[gating]); trainer.fit(module, loader)
        >>> gating.removed   # {layer: original numbers of the heads chosen}; gating.rounds: each removal
    """

    def __init__(
        self,
        kind: GateKind = "l1",
        weight: ScheduleLike = 0.01,
        layers: int | Iterable[int] | None = None,
        normalize: bool = True,
        threshold: float = 0.1,
        keep: int | None = None,
        milestones: Milestones | None = None,
        prune_after_steps: int | None = None,
        prune_after_epochs: int | None = None,
        target_warmup: float = 0.0,
        temperature: float = 2.0 / 3.0,
        stretch: tuple[float, float] = (-0.1, 1.1),
        initial_log_alpha: float = 2.0,
        lagrangian_lr: float = 0.1,
        name: str | None = None,
    ) -> None:
        if kind not in ("l1", "hard_concrete"):
            raise ValueError(f"HeadGating: kind must be 'l1' or 'hard_concrete', got {kind!r}")
        self.schedule = as_schedule(check_weight(weight, "HeadGating") if not callable(weight) else weight, "weight")
        for argument, value in (
            ("prune_after_steps", prune_after_steps),
            ("prune_after_epochs", prune_after_epochs),
            ("keep", keep),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"HeadGating: {argument} must be an integer >= 0, got {value!r}")
        if not 0.0 <= target_warmup < 1.0:
            raise ValueError(f"HeadGating: target_warmup must be a fraction of training in [0, 1), got {target_warmup}")
        pruning.HardConcreteGate(0, temperature=temperature, stretch=stretch)  # validates both now
        for argument, value in (("threshold", threshold), ("lagrangian_lr", lagrangian_lr)):
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not (number and math.isfinite(value) and value > 0):
                raise ValueError(f"HeadGating: {argument} must be a finite number > 0, got {value!r}")
        self.milestones = _check_milestones(milestones, keep, prune_after_steps, prune_after_epochs)
        self.kind = kind
        self.weight = weight
        self.layers_argument = layers
        self.normalize = normalize
        self.threshold = threshold
        self.keep = self.milestones[-1][1] if self.milestones else keep
        self.prune_after_steps = prune_after_steps
        self.prune_after_epochs = prune_after_epochs
        self.target_warmup = target_warmup
        self.temperature, self.stretch, self.initial_log_alpha = temperature, tuple(stretch), initial_log_alpha
        self.lagrangian_lr = lagrangian_lr
        self.name_argument = name
        self.name = name or "head_gating"
        self.lambdas = torch.zeros(2)
        self._gaps: list[torch.Tensor] = []  # constraint gaps of the micro-batches since the last optimizer step
        self.length = TrainingLength("HeadGating")
        self.pruned = False
        self.milestones_done = 0
        self.removed: dict[int, list[int]] = {}
        self.rounds: list[PruningRound] = []
        self.report: pruning.PruneReport | None = None
        self.pruned_at_step: int | None = None
        self.layers: tuple[int, ...] = ()
        self.gated_heads = 0
        self.module: AttnRegMixin | None = None

    @property
    def state_key(self) -> str:
        """Lightning's key for this callback's checkpoint state: distinct for differently set instances."""
        return self._generate_state_key(name=self.name_argument, layers=self.layers_argument)

    # -- setup ----------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        module = require_mixin(pl_module, self)
        self.module = module
        hub = module.attnreg_hub
        layers = hub.resolve_layers(self.layers_argument, "layers")
        self.layers = tuple(layer for layer in layers if hub.layers[layer].num_heads > 0)
        self.gated_heads = sum(hub.layers[layer].num_heads for layer in self.layers)
        most, what = (self.milestones[0][1], "the first milestone keeps ") if self.milestones else (self.keep, "keep=")
        if most is not None and most > self.gated_heads:
            raise ValueError(
                f"HeadGating: {what}{most} heads, but the gated layers {list(self.layers)} have only {self.gated_heads}"
            )
        if self._prunes_during_training() and trainer.world_size > 1:
            raise NotImplementedError(
                "HeadGating: pruning during training changes parameter shapes, which DDP cannot follow; "
                "prune at the end of fit (leave prune_after_steps, prune_after_epochs and milestones unset)"
            )
        if self.pruned:
            return
        for layer in self.layers:
            if self.kind == "l1":
                hub.gate(layer)
            else:
                pruning.make_hard_concrete(hub, layer, self.initial_log_alpha, self.temperature, self.stretch)
        self.name = free_name(self.name_argument, "head_gating", module.attnreg_terms, "HeadGating")
        module.add_attnreg_term(self.name, self._penalty, layers=())

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        needs_length = bool(self.milestones) or changes_over_training(self.schedule)
        needs_length |= self.kind == "hard_concrete" and self.keep is not None and self.target_warmup > 0
        self.length.start(trainer.estimated_stepping_batches, needs_length)
        hub = require_mixin(pl_module, self).attnreg_hub
        self.layers = tuple(layer for layer in self.layers if hub.layers[layer].num_heads > 0)  # after a resume

    def _prunes_during_training(self) -> bool:
        return bool(self.milestones) or self.prune_after_steps is not None or self.prune_after_epochs is not None

    def total_heads(self, hub: AttentionHub) -> int:
        """Heads the gated layers have now."""
        return sum(hub.layers[layer].num_heads for layer in self.layers)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and isinstance(pl_module, AttnRegMixin):
            pl_module.remove_attnreg_term(self.name)

    # -- the penalty ------------------------------------------------------------------------------
    def progress(self) -> float:
        """The fraction of training done (`attnreg.progress`)."""
        module = self.module
        step = module.global_step if module is not None and module._trainer is not None else 0
        return self.length.progress(step)

    def current_weight(self) -> float:
        """The penalty's weight at the module's current global step."""
        return check_weight(self.schedule(self.progress()), f"HeadGating weight at progress {self.progress():.4g}")

    def target(self) -> float:
        """The Lagrangian's target number of heads now (hard-concrete gates with `keep`)."""
        ramp = 1.0 if self.target_warmup == 0 else min(1.0, self.progress() / self.target_warmup)
        return self.gated_heads - (self.gated_heads - self.keep) * ramp

    def _penalty(self, probs: AttentionRecord, batch: Any) -> torch.Tensor:
        hub = self.module.attnreg_hub
        if self.kind == "l1":
            gates = torch.cat([self._gate(hub, layer) for layer in self.layers])
            value = gates.abs().sum() / (gates.numel() if self.normalize else 1)
            return self.current_weight() * value
        expected = torch.cat([gate.expected_l0() for gate in self._hard_concrete(hub)])
        if self.keep is None:
            return self.current_weight() * expected.sum() / (expected.numel() if self.normalize else 1)
        gap = (expected.sum() - self.target()) / self.gated_heads
        lambdas = self.lambdas.to(gap.device)
        self._gaps.append(gap.detach())
        self.module.log(f"attnreg/{self.name}/expected_heads", expected.sum().detach())
        return lambdas[0] * gap + lambdas[1] * gap**2

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        """Dual ascent, once per optimizer step (whatever the gradient accumulation): the multipliers
        grow while the constraint is violated, by the mean gap of the step's micro-batches."""
        if not self._gaps:
            return
        gap = torch.stack(self._gaps).mean()
        self._gaps = []
        self.lambdas = self.lambdas.to(gap.device) + self.lagrangian_lr * torch.stack([gap, gap**2])

    def _hard_concrete(self, hub: AttentionHub) -> list[pruning.HardConcreteGate]:
        return [self._gate(hub, layer) for layer in self.layers]

    def _gate(self, hub: AttentionHub, layer: int) -> torch.Tensor | pruning.HardConcreteGate:
        gate = hub.gates.get(layer)
        if gate is None:  # never create one here: it would not be in the optimizer
            raise RuntimeError(f"HeadGating: the gate of layer {layer} is gone (removed after setup)")
        return gate

    # -- when to prune ----------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.pruned:
            return
        if self.milestones:
            progress = self.length.progress(trainer.global_step)
            due = [i for i, (at, _) in enumerate(self.milestones) if i >= self.milestones_done and progress >= at]
            if due:
                self.milestones_done = due[-1] + 1
                final = self.milestones_done == len(self.milestones)
                self.prune(trainer, pl_module, keep=self.milestones[due[-1]][1], final=final)
        elif self.prune_after_steps is not None and trainer.global_step >= self.prune_after_steps:
            self.prune(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if (
            self.prune_after_epochs is not None
            and not self.pruned
            and trainer.current_epoch + 1 >= self.prune_after_epochs
        ):
            self.prune(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.pruned:
            self.prune(trainer, pl_module)

    def scores(self) -> dict[int, torch.Tensor]:
        """Per gated layer, what decides which heads stay: |g|, or the deterministic hard-concrete gate."""
        hub = self.module.attnreg_hub
        with torch.no_grad():
            if self.kind == "l1":
                return {layer: self._gate(hub, layer).detach().abs().float().cpu() for layer in self.layers}
            return {
                layer: gate.deterministic().detach().float().cpu()
                for layer, gate in zip(self.layers, self._hard_concrete(hub), strict=True)
            }

    def prune(
        self, trainer: L.Trainer, pl_module: L.LightningModule, keep: int | None = None, final: bool = True
    ) -> pruning.PruneReport:
        """Choose heads (all but the `keep` best, default `self.keep`, else below `threshold`), silence
        and physically remove them; with `final`, fold every gate first and stop the penalty."""
        module = require_mixin(pl_module, self)
        model = module.attnreg_model
        keep = self.keep if keep is None else keep
        scores = self.scores()
        for layer, heads in pruning.silenced_heads(model).items():  # chosen before, kept by the grouped-query rule
            if layer in scores:
                numbers = pruning.head_numbers(model, layer)
                scores[layer][[numbers.index(head) for head in heads]] = -math.inf
        threshold = self.threshold if keep is None else None
        positions = pruning.select_heads(scores, threshold=threshold, keep=keep)
        positions = trainer.strategy.broadcast(positions, src=0)
        chosen = {layer: heads for layer, heads in pruning.to_original_numbers(model, positions).items() if heads}
        optimizers = list(trainer.optimizers)
        if final:
            pruning.fold_gates(model, optimizers)
        self.report = pruning.prune_heads(model, chosen, optimizers)  # silences those the grouped-query rule keeps
        for layer, heads in chosen.items():
            self.removed[layer] = sorted({*self.removed.get(layer, ()), *heads})
        hub = module.attnreg_hub
        self.layers = tuple(layer for layer in self.layers if hub.layers[layer].num_heads > 0)
        self.rounds.append(PruningRound(trainer.global_step, chosen, self.report, final))
        if final:
            module.remove_attnreg_term(self.name)
            self.pruned, self.pruned_at_step = True, trainer.global_step
        return self.report

    # -- checkpoints ------------------------------------------------------------------------------
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        pruning.add_pruning_to_checkpoint(require_mixin(pl_module, self).attnreg_model, checkpoint)
        if self.pruned:
            checkpoint[pruning.FOLDED_GATES] = list(self.layers)

    def state_dict(self) -> dict[str, Any]:
        removed = {str(layer): heads for layer, heads in self.removed.items()}
        return {
            **self.length.state_dict(),
            "pruned": self.pruned,
            "removed": removed,
            "lambdas": self.lambdas.tolist(),
            "milestones_done": self.milestones_done,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pruned = bool(state_dict["pruned"])
        self.removed = {int(layer): list(heads) for layer, heads in state_dict["removed"].items()}
        self.lambdas = torch.tensor(state_dict["lambdas"])
        self.milestones_done = int(state_dict.get("milestones_done", 0))
        self.length.load_state_dict(state_dict)
        if self.pruned and self.module is not None:
            self.module.remove_attnreg_term(self.name)


def _check_milestones(
    milestones: Milestones | None, keep: int | None, after_steps: int | None, after_epochs: int | None
) -> tuple[tuple[float, int], ...]:
    if milestones is None:
        return ()
    if after_steps is not None or after_epochs is not None:
        raise ValueError("HeadGating: give milestones or prune_after_steps / prune_after_epochs, not both")
    checked: list[tuple[float, int]] = []
    for item in milestones:
        try:
            at, count = item
        except (TypeError, ValueError):
            raise ValueError(
                f"HeadGating: each milestone is (progress, heads to keep), e.g. (0.5, 36); got {item!r}"
            ) from None
        if isinstance(at, bool) or not isinstance(at, int | float) or not 0.0 < at <= 1.0:
            raise ValueError(f"HeadGating: a milestone's progress must be in (0, 1], got {at!r} in {item!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"HeadGating: a milestone's head count must be an integer >= 0, got {count!r}")
        if checked and (at <= checked[-1][0] or count >= checked[-1][1]):
            raise ValueError(
                f"HeadGating: milestones must rise in progress and fall in heads kept; {item!r} follows {checked[-1]!r}"
            )
        checked.append((float(at), count))
    if not checked:
        raise ValueError("HeadGating: milestones is empty (leave it None to prune once)")
    if keep is not None and keep != checked[-1][1]:
        raise ValueError(f"HeadGating: keep={keep} disagrees with the last milestone's {checked[-1][1]} heads")
    return tuple(checked)


class HeadImportance(L.Callback):
    """Scores heads at the end of training (Michel et al. 2019) and, given `metric_fn`, prunes
    iteratively until the metric falls below `stop_ratio` of its start.

    `dataloader` yields dict batches for `model(**batch)` (with labels, or pass `loss_fn`).
    After fit: `scores` (per layer, current head positions) and `curve` (`attnreg.pruning.PruningStep`s).

    Example:
        >>> importance = attnreg.HeadImportance(dev_loader, metric_fn=lambda m: accuracy(m, dev), fraction=0.1)
    """

    def __init__(
        self,
        dataloader: Iterable[Any],
        loss_fn: pruning.LossFunction | None = None,
        metric_fn: Callable[[torch.nn.Module], float] | None = None,
        fraction: float = 0.1,
        stop_ratio: float = 0.9,
    ) -> None:
        self.dataloader, self.loss_fn, self.metric_fn = dataloader, loss_fn, metric_fn
        self.fraction, self.stop_ratio = fraction, stop_ratio
        self.scores: dict[int, torch.Tensor] = {}
        self.curve: list[pruning.PruningStep] = []

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = require_mixin(pl_module, self).attnreg_model
        self.scores = pruning.head_importance(model, self.dataloader, self.loss_fn)
        if self.metric_fn is not None:
            self.curve = pruning.iterative_pruning(
                model, self.dataloader, self.metric_fn, self.fraction, self.stop_ratio, self.loss_fn
            )
