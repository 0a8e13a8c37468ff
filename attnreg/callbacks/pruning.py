"""Soft head pruning in Lightning: gates with an L1 or hard-concrete L0 penalty, then physical removal.

`HeadGating` trains per-head gates (the hub's), adds their penalty to the loss through the mixin,
and at a chosen point removes the heads whose gates closed (or all but the `keep` best), folding
the remaining gates into the output projections: the smaller model carries no gates and computes
what the gated model computed with the removed gates at 0. `HeadImportance` scores heads after
training (Michel et al. 2019) and can prune iteratively. The work is done by `attnreg.pruning`.

Example:
    >>> trainer = lightning.Trainer(callbacks=[attnreg.HeadGating(weight=0.01, warmup_steps=100)])
    >>> trainer = lightning.Trainer(callbacks=[attnreg.HeadGating(kind="hard_concrete", keep=36)])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Literal

import lightning as L
import torch

from attnreg import pruning
from attnreg.hub import AttentionHub, AttentionRecord
from attnreg.mixin import AttnRegMixin, require_mixin

GateKind = Literal["l1", "hard_concrete"]
Weight = float | Callable[[int], float]


class HeadGating(L.Callback):
    """Trainable per-head gates with a sparsity penalty, then physical removal of the closed heads.

    - `kind="l1"`: gates start at 1; penalty `weight * sum |g|` (divided by the number of gated heads
      with `normalize`). A head goes when |g| < `threshold`.
    - `kind="hard_concrete"`: L0 gates (Louizos et al. 2018, as Voita et al. 2019), stretch
      `stretch`, temperature `temperature`, log-alpha starting at `initial_log_alpha`; penalty
      `weight * expected L0`. With `keep`, the penalty is instead CoFi's Lagrangian
      `l1 * (s - t) + l2 * (s - t)^2` on the expected number of kept heads `s` against a target `t`
      moving from all heads to `keep` over the warmup, with `l1, l2` raised by gradient ascent
      (step `lagrangian_lr`). A head goes when its deterministic gate is below `threshold`.
    - `keep`: keep exactly the `keep` heads with the largest gates (|g|, or deterministic L0 gate)
      instead of thresholding.

    `weight` is a number or a function of the global step; it is ramped linearly from 0 over
    `warmup_steps`. Heads are removed after `prune_after_steps` optimizer steps or
    `prune_after_epochs` epochs, or at the end of fit, whichever comes first. Pruning during
    training slices the optimizer's state (Adam moments of the kept heads carry on) and drops the
    folded gates from it; LR schedulers are untouched. The decision is broadcast from rank 0. In
    grouped-query layers a chosen head whose key/value group keeps other heads stays, silenced (its
    output-projection columns zeroed); `report.kept` lists those.
    Gates are created in `setup`, before `configure_optimizers`. Resuming from a checkpoint taken
    after pruning needs `attnreg.pruning.restore_pruning(model, checkpoint)` in the module's
    `on_load_checkpoint` (Lightning runs a callback's `on_load_checkpoint` only after the weights).

    Example:
        >>> gating = attnreg.HeadGating(weight=0.02, warmup_steps=200, prune_after_steps=2000)
        >>> trainer = lightning.Trainer(callbacks=[gating]); trainer.fit(module, loader)
        >>> gating.removed   # {layer: original numbers of the heads chosen}; gating.report: what was cut
    """

    def __init__(
        self,
        kind: GateKind = "l1",
        weight: Weight = 0.01,
        layers: int | Iterable[int] | None = None,
        normalize: bool = True,
        warmup_steps: int = 0,
        threshold: float = 0.1,
        keep: int | None = None,
        prune_after_steps: int | None = None,
        prune_after_epochs: int | None = None,
        temperature: float = 2.0 / 3.0,
        stretch: tuple[float, float] = (-0.1, 1.1),
        initial_log_alpha: float = 2.0,
        lagrangian_lr: float = 0.1,
        name: str = "head_gating",
    ) -> None:
        if kind not in ("l1", "hard_concrete"):
            raise ValueError(f"HeadGating: kind must be 'l1' or 'hard_concrete', got {kind!r}")
        if not callable(weight) and (not math.isfinite(weight) or weight < 0):
            raise ValueError(f"HeadGating: weight must be a finite number >= 0 or a function of the step, got {weight}")
        for argument, value in (
            ("warmup_steps", warmup_steps),
            ("prune_after_steps", prune_after_steps),
            ("prune_after_epochs", prune_after_epochs),
            ("keep", keep),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"HeadGating: {argument} must be an integer >= 0, got {value!r}")
        pruning.HardConcreteGate(0, temperature=temperature, stretch=stretch)  # validates both now
        self.kind = kind
        self.weight = weight
        self.layers_argument = layers
        self.normalize = normalize
        self.warmup_steps = warmup_steps
        self.threshold = threshold
        self.keep = keep
        self.prune_after_steps = prune_after_steps
        self.prune_after_epochs = prune_after_epochs
        self.temperature, self.stretch, self.initial_log_alpha = temperature, tuple(stretch), initial_log_alpha
        self.lagrangian_lr = lagrangian_lr
        self.name = name
        self.lambdas = torch.zeros(2)
        self.pruned = False
        self.removed: dict[int, list[int]] = {}
        self.report: pruning.PruneReport | None = None
        self.pruned_at_step: int | None = None
        self.layers: tuple[int, ...] = ()
        self.module: AttnRegMixin | None = None

    # -- setup ----------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        module = require_mixin(pl_module, self)
        self.module = module
        hub = module.attnreg_hub
        layers = hub.resolve_layers(self.layers_argument, "layers")
        self.layers = tuple(layer for layer in layers if hub.layers[layer].num_heads > 0)
        total = self.total_heads(hub)
        if self.keep is not None and self.keep > total:
            raise ValueError(
                f"HeadGating: keep={self.keep} heads, but the gated layers {list(self.layers)} have only {total}"
            )
        if (self.prune_after_steps is not None or self.prune_after_epochs is not None) and trainer.world_size > 1:
            raise NotImplementedError(
                "HeadGating: pruning during training changes parameter shapes, which DDP cannot follow; "
                "prune at the end of fit (leave prune_after_steps and prune_after_epochs unset)"
            )
        if self.pruned:
            return
        for layer in self.layers:
            if self.kind == "l1":
                hub.gate(layer)
            else:
                pruning.make_hard_concrete(hub, layer, self.initial_log_alpha, self.temperature, self.stretch)
        module.remove_attnreg_term(self.name)
        module.add_attnreg_term(self.name, self._penalty, layers=())

    def total_heads(self, hub: AttentionHub) -> int:
        return sum(hub.layers[layer].num_heads for layer in self.layers)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and isinstance(pl_module, AttnRegMixin):
            pl_module.remove_attnreg_term(self.name)

    # -- the penalty ------------------------------------------------------------------------------
    def current_weight(self) -> float:
        step = self._step()
        weight = self.weight(step) if callable(self.weight) else self.weight
        return weight * self._warmup(step)

    def _step(self) -> int:
        module = self.module
        return module.global_step if module is not None and module._trainer is not None else 0

    def _warmup(self, step: int) -> float:
        return 1.0 if self.warmup_steps == 0 else min(1.0, step / self.warmup_steps)

    def _penalty(self, probs: AttentionRecord, batch: Any) -> torch.Tensor:
        hub = self.module.attnreg_hub
        if self.kind == "l1":
            gates = torch.cat([self._gate(hub, layer) for layer in self.layers])
            value = gates.abs().sum() / (gates.numel() if self.normalize else 1)
            return self.current_weight() * value
        expected = torch.cat([gate.expected_l0() for gate in self._hard_concrete(hub)])
        if self.keep is None:
            return self.current_weight() * expected.sum() / (expected.numel() if self.normalize else 1)
        total = expected.numel()
        target = total - (total - self.keep) * self._warmup(self._step())
        gap = (expected.sum() - target) / total
        lambdas = self.lambdas.to(gap.device)
        term = lambdas[0] * gap + lambdas[1] * gap**2
        # dual ascent: the multipliers grow while the constraint is violated
        self.lambdas = lambdas + self.lagrangian_lr * torch.stack([gap, gap**2]).detach()
        self.module.log(f"attnreg/{self.name}/expected_heads", expected.sum().detach())
        return term

    def _hard_concrete(self, hub: AttentionHub) -> list[pruning.HardConcreteGate]:
        return [self._gate(hub, layer) for layer in self.layers]

    def _gate(self, hub: AttentionHub, layer: int) -> torch.Tensor | pruning.HardConcreteGate:
        gate = hub.gates.get(layer)
        if gate is None:  # never create one here: it would not be in the optimizer
            raise RuntimeError(f"HeadGating: the gate of layer {layer} is gone (removed after setup)")
        return gate

    # -- when to prune ----------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.prune_after_steps is not None and not self.pruned and trainer.global_step >= self.prune_after_steps:
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
                return {layer: self._gate(hub, layer).detach().abs().cpu() for layer in self.layers}
            return {
                layer: gate.deterministic().detach().cpu()
                for layer, gate in zip(self.layers, self._hard_concrete(hub), strict=True)
            }

    def prune(self, trainer: L.Trainer, pl_module: L.LightningModule) -> pruning.PruneReport:
        """Select heads, fold every gate, silence and physically remove the selected heads."""
        module = require_mixin(pl_module, self)
        model = module.attnreg_model
        keep, threshold = self.keep, None if self.keep is not None else self.threshold
        positions = pruning.select_heads(self.scores(), threshold=threshold, keep=keep)
        positions = trainer.strategy.broadcast(positions, src=0)
        removed = {layer: heads for layer, heads in pruning.to_original_numbers(model, positions).items() if heads}
        optimizers = list(trainer.optimizers)
        pruning.fold_gates(model, optimizers)
        pruning.silence_heads(model, removed)  # also those the grouped-query rule keeps
        self.report = pruning.prune_heads(model, removed, optimizers)
        module.remove_attnreg_term(self.name)
        self.removed, self.pruned, self.pruned_at_step = removed, True, trainer.global_step
        return self.report

    # -- checkpoints ------------------------------------------------------------------------------
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        pruning.add_pruning_to_checkpoint(require_mixin(pl_module, self).attnreg_model, checkpoint)
        if self.pruned:
            checkpoint[pruning.FOLDED_GATES] = list(self.layers)

    def state_dict(self) -> dict[str, Any]:
        removed = {str(layer): heads for layer, heads in self.removed.items()}
        return {"pruned": self.pruned, "removed": removed, "lambdas": self.lambdas.tolist()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pruned = bool(state_dict["pruned"])
        self.removed = {int(layer): list(heads) for layer, heads in state_dict["removed"].items()}
        self.lambdas = torch.tensor(state_dict["lambdas"])
        if self.pruned and self.module is not None:
            self.module.remove_attnreg_term(self.name)


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
