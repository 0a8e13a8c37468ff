"""Soft head pruning as a method object: trainable per-head gates with a sparsity penalty, then
physical removal of the heads whose gates closed, with the optimizer's state sliced along.

The gate kinds (`L1Gates`, `HardConcreteGates`, each a `GateKind`) and the `Removal` config are in
`attnreg.methods.pruning.gate_kinds`. `Removal` says which heads go (all but the `keep` best, else those scoring
below `threshold`; never those in `protect`, `{layer: [original head numbers]}`, such as the heads a syntax prior
supervises) and when (the end of training by default; `after_steps` optimizer steps or `after_epochs` epochs; or
progressively at `milestones`, `(progress, heads kept)` pairs). With `groups`, whole key/value groups go and `keep`
(and the milestones, and the Lagrangian's target) count groups: a grouped-query model loses a key/value head only
with all its query heads, so nothing is left silenced in place.

Grouped-query layers follow `attnreg.methods.pruning.prune_heads`: a chosen query head whose key/value group
stays is silenced exactly, and chosen again in a later round.

Example (what an adapter does; `attnreg.HeadGating` is the Lightning one):
    >>> from attnreg.methods.pruning.gate_kinds import HardConcreteGates
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("bert", head="classification").train()      # 2 layers x 4 heads
    >>> gating = HeadGating(HardConcreteGates(target_warmup=0.5), Removal(keep=5))
    >>> gating.bind(model, taken=set()); gating.start(estimated_steps=4)
    >>> optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    >>> batch = {"input_ids": torch.randint(3, 99, (2, 6)), "labels": torch.tensor([0, 1])}
    >>> for step in range(4):
    ...     value, figures = gating.term(None, batch, step)    # the penalty, every micro-batch
    ...     (model(**batch).loss + value).backward()
    ...     gating.dual_step()                                  # once per optimizer step, before it
    ...     optimizer.step(); optimizer.zero_grad()
    >>> keep, final = gating.due(step=4, end=True); keep, final  # heads to keep, the final round
    (5, True)
    >>> report = gating.prune([optimizer], step=4, keep=keep, final=final)  # gates folded, 3 heads removed
    >>> report.num_removed, sum(query for query, _ in report.heads.values())
    (3, 5)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from attnreg.hub import attach
from attnreg.methods import pruning
from attnreg.methods.base import Loop, Method
from attnreg.methods.loss_term import check_weight
from attnreg.methods.pruning.gate_kinds import (
    GateKind,
    L1Gates,
    PruningRound,
    Removal,
    whole,
)
from attnreg.methods.registry import register_method
from attnreg.records import AttentionRecord
from attnreg.schedules import as_schedule

RESCUE_FOLDER = "attnreg-unpruned"  # in the run's output folder: a model whose head removal failed, gated
GATHERED_FOLDER = "attnreg-pruned"  # in the run's output folder: a sharded model gathered whole, its heads removed


@register_method(docs="methods/pruning.md", removes_heads=True, gates_heads=True)
class HeadGating(Method):
    """Trainable per-head gates on `layers` (None = all) with a sparsity penalty, then removal.

    Gates are created in `bind`, so that they exist before the optimizer is built. After training:
    `removed` ({layer: original numbers}), `rounds` (each removal), `report` (the last one). With the
    Lagrangian (`HardConcreteGates` and a head count), `multipliers` (`lambdas`, a copy) and their
    `dual_optimizer` live here, outside the model and its optimizer, and in `state_dict`.

    Several processes: every process removes rank 0's choice (`Loop.broadcast`). A removal during
    training gives the model fresh parameters (`renew_parameters`) and asks the adapter to rebuild its
    data-parallel wrapper (`Loop.rewrap`, DDP); where the engine cannot (`rewrap` None), or where the
    model is sharded (FSDP2: its parameters are `DTensor`s), it is refused in `on_fit_start`. A sharded
    model's heads go at the end of training: every process gathers the weights whole, rank 0 removes the
    heads from an unsharded copy (`gathered`, None on the other processes) and saves it with
    `attnreg.methods.pruning.save_pruned` to `<output_dir>/attnreg-pruned`; the sharded model keeps them.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> gating = HeadGating(L1Gates(weight=0.1), Removal(keep=6))
        >>> gating.bind(tiny_model("bert"), taken=set())
        >>> sorted(gating.hub.gates), gating.gated_heads        # a gate per layer, before the optimizer exists
        ([0, 1], 8)
    """

    default_name = "head_gating"
    depends_on_batch = False  # the penalty reads the gates alone, whatever the batch

    def __init__(
        self,
        gates: GateKind | None = None,
        removal: Removal | None = None,
        layers: int | Iterable[int] | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        self.gates = L1Gates() if gates is None else gates
        self.removal = Removal() if removal is None else removal
        if not isinstance(self.gates, GateKind):
            raise TypeError(
                f"HeadGating: gates must be L1Gates or HardConcreteGates (a GateKind), got {type(self.gates).__name__}"
            )
        if not isinstance(self.removal, Removal):
            raise TypeError(f"HeadGating: removal must be a Removal, got {type(self.removal).__name__}")
        self.schedule = as_schedule(self.gates.weight, "weight")
        self.layers_argument = layers
        self.layers: tuple[int, ...] = ()  # captured for the term: none
        self.gated_layers: tuple[int, ...] = ()
        self.gated_heads = 0
        self.group_sizes: dict[int, int] = {}  # query heads per key/value head, by gated layer
        self.multipliers = torch.zeros(2, requires_grad=True)  # CoFi's lambda_1, lambda_2 (a leaf on the CPU)
        self.dual_optimizer = self._new_dual_optimizer()
        self._gaps: list[torch.Tensor] = []  # constraint gaps of the micro-batches since the last optimizer step
        self.pruned = False
        self.milestones_done = 0
        self.removed: dict[int, list[int]] = {}
        self.rounds: list[PruningRound] = []
        self.report: pruning.PruneReport | None = None
        self.pruned_at_step: int | None = None
        self.gathered: nn.Module | None = None  # a sharded model, gathered whole on rank 0, its heads removed

    @property
    def lagrangian(self) -> bool:
        """Whether the penalty is CoFi's Lagrangian toward a head count."""
        return self.gates.targets_count and self.removal.keep is not None

    @property
    def lambdas(self) -> torch.Tensor:
        """The Lagrange multipliers `[l1, l2]` (a detached copy; `dual_step` trains them)."""
        return self.multipliers.detach().clone()

    def _new_dual_optimizer(self) -> torch.optim.Optimizer | None:
        """The multipliers' optimizer (`GateKind.dual_optimizer`), or None for a kind that aims at no head count."""
        return self.gates.dual_optimizer(self.multipliers)

    def identity(self) -> dict[str, Any]:
        return {"name": self.name_argument, "layers": self.layers_argument}

    def schedules(self) -> list[Callable[[float], float] | None]:
        warmup = self.lagrangian and self.gates.target_warmup > 0
        return [self.schedule, *([_changing] if self.removal.milestones or warmup else [])]

    # -- life cycle --------------------------------------------------------------------------------------
    def bind(self, model: nn.Module, taken: Collection[str] = ()) -> None:
        super().bind(model, taken)
        model = self.model  # the transformers model (inside a PEFT model, say)
        hub = self.hub
        layers = hub.resolve_layers(self.layers_argument, "layers")
        self.gated_layers = tuple(layer for layer in layers if hub.layers[layer].num_heads > 0)
        self.gated_heads = sum(hub.layers[layer].num_heads for layer in self.gated_layers)
        removal = self.removal
        family = hub.family
        self.group_sizes = {}
        for layer in self.gated_layers:
            num_heads, num_kv = family.head_counts(family.attention_module(model, layer))
            self.group_sizes[layer] = num_heads // num_kv
        sizes = set(self.group_sizes.values())
        if removal.groups and self.lagrangian and len(sizes) > 1:
            raise ValueError(
                f"HeadGating: a target in key/value groups needs one group size in the gated layers, got "
                f"{self.group_sizes} query heads per group"
            )
        units = "key/value groups" if removal.groups else "heads"
        available = (
            sum(heads // self.group_sizes[layer] for layer, heads in self._heads_per_layer().items())
            if removal.groups
            else self.gated_heads
        )
        most, what = (
            (removal.milestones[0][1], "the first milestone keeps ") if removal.milestones else (removal.keep, "keep=")
        )
        if most is not None and most > available and not self.pruned:
            raise ValueError(
                f"HeadGating: {what}{most} {units}, but the gated layers {list(self.gated_layers)} have only "
                f"{available}"
            )
        for layer, heads in (removal.protect or {}).items():
            if layer not in self.gated_layers:
                raise ValueError(
                    f"HeadGating: protect names layer {layer}, not a gated layer {list(self.gated_layers)}"
                )
            missing = sorted(set(heads) - set(pruning.head_numbers(model, layer)))
            if missing and not self.pruned:
                raise ValueError(
                    f"HeadGating: protect names heads {missing} of layer {layer}, which has heads "
                    f"{list(pruning.head_numbers(model, layer))} ({type(model).__name__})"
                )
        if removal.groups and removal.protect:  # a protected head keeps its whole key/value group
            protected = {
                (layer, head // self.group_sizes[layer]) for layer, heads in removal.protect.items() for head in heads
            }
            fewest = min((count for _, count in removal.milestones or ()), default=removal.keep)
            if fewest is not None and len(protected) > fewest:
                raise ValueError(
                    f"HeadGating: protect holds heads of {len(protected)} key/value groups, more than keep={fewest} "
                    "groups kept"
                )
        if self.pruned:
            return
        try:  # what the removal will need, now rather than after training
            pruning.check_removable(model, self.gated_layers)
        except TypeError as error:
            raise TypeError(f"HeadGating: {error}") from None
        for layer in self.gated_layers:
            self.gates.make(hub, layer)

    def _heads_per_layer(self) -> dict[int, int]:
        return {layer: self.hub.layers[layer].num_heads for layer in self.gated_layers}

    def _in_heads(self, count: int) -> int:
        """A count of `Removal` (heads, or key/value groups with `groups`) in heads."""
        return count * next(iter(self.group_sizes.values()), 1) if self.removal.groups else count

    def start(self, estimated_steps: float) -> None:
        super().start(estimated_steps)
        self.gated_layers = tuple(layer for layer in self.gated_layers if self.hub.layers[layer].num_heads > 0)

    # -- the penalty ---------------------------------------------------------------------------------------
    def current_weight(self, step: int) -> float:
        """The penalty's weight at optimizer step `step`."""
        return check_weight(self.schedule(self.progress(step)), f"HeadGating weight at step {step}")

    def initial_heads(self) -> float:
        """Where the target starts: the expected number of open heads of freshly initialized gates
        (`gated_heads * P(z != 0)` at `initial_log_alpha`), so that the first gaps do not push gates open."""
        return self.gates.initial_open(self.gated_heads)

    def target(self, step: int) -> float:
        """The Lagrangian's target number of heads at `step`: from `initial_heads()` down to `keep`, linearly
        over the first `target_warmup` of training, then `keep`.

        Example:
            >>> from attnreg.tiny import tiny_model
            >>> from attnreg.methods.pruning.gate_kinds import HardConcreteGates
            >>> gating = HeadGating(HardConcreteGates(target_warmup=0.5), Removal(keep=2))
            >>> gating.bind(tiny_model("bert"), taken=set()); gating.start(estimated_steps=10)
            >>> round(gating.initial_heads(), 2), [round(gating.target(step), 2) for step in (0, 1, 5, 9)]
            (7.78, [7.78, 6.62, 2.0, 2.0])
        """
        warmup = self.gates.target_warmup
        ramp = 1.0 if warmup == 0 else min(1.0, self.progress(step) / warmup)
        keep = self._in_heads(self.removal.keep)
        start = max(self.initial_heads(), keep)
        return start - (start - keep) * ramp

    def term(self, probs: AttentionRecord, batch: Any, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the penalty, figures to log) for one micro-batch at optimizer step `step`; 0 once pruned."""
        if self.pruned:
            return torch.zeros(()), {}
        expected = torch.cat([self.gates.penalty(self._gate(layer)) for layer in self.gated_layers])
        if not self.lagrangian:
            scale = expected.numel() if self.gates.normalize else 1
            return self.current_weight(step) * expected.sum() / scale, {}
        gap = expected.sum() - self.target(step)  # in heads
        lambdas = self.multipliers.detach().to(device=gap.device, dtype=gap.dtype)
        self._gaps.append(gap.detach())
        figures = {f"{self.name}/expected_heads": expected.sum().detach(), f"{self.name}/lambda_1": lambdas[0]}
        return lambdas[0] * gap + lambdas[1] * gap**2, figures

    def dual_step(self) -> None:
        """Once per optimizer step, before it (whatever the gradient accumulation): one step of gradient
        ascent on the multipliers with their own Adam, the gradient of the Lagrangian in them averaged over
        the step's micro-batches (`[mean g, mean g^2]`, what autograd would give CoFi); then log-alpha is
        clamped to `log_alpha_bounds`, so what the optimizer step starts from is in bounds.

        Example:
            >>> from attnreg.tiny import tiny_model
            >>> from attnreg.methods.pruning.gate_kinds import HardConcreteGates
            >>> gating = HeadGating(HardConcreteGates(lagrangian_lr=0.1), Removal(keep=2))
            >>> gating.bind(tiny_model("bert"), taken=set()); gating.start(estimated_steps=10)
            >>> value, figures = gating.term(None, None, step=0)    # about 7.8 heads open for a target of 2
            >>> gating.dual_step(); gating.lambdas       # ascent: Adam's first step is lr times the gradient's sign
            tensor([0.1000, 0.1000])
        """
        if self._gaps and self.dual_optimizer is not None:
            gaps = torch.stack(self._gaps).float().cpu()
            self.multipliers.grad = torch.stack([gaps.mean(), (gaps**2).mean()])
            self.dual_optimizer.step()
            self.multipliers.grad = None
        self._gaps = []
        self._before_step()

    def _before_step(self) -> None:
        if self.hub is None or self.pruned:
            return
        for layer in self.gated_layers:
            gate = self.hub.gates.get(layer)
            if gate is not None:
                self.gates.before_step(gate)

    def _gate(self, layer: int) -> torch.Tensor | pruning.HardConcreteGate:
        gate = self.hub.gates.get(layer)
        if gate is None:  # never create one here: it would not be in the optimizer
            raise RuntimeError(f"HeadGating: the gate of layer {layer} is gone (removed after setup)")
        return gate

    # -- removal ------------------------------------------------------------------------------------------
    def due(self, step: int, epochs_done: int | None = None, end: bool = False) -> tuple[int | None, bool] | None:
        """Whether heads go now: None, or (heads to keep, or None to threshold; whether this is the final
        round). Call after each optimizer step with `step`, at each epoch end with `epochs_done`, and
        once at the end of training with `end=True`."""
        if self.pruned:
            return None
        removal = self.removal
        if removal.milestones and not end and epochs_done is None:
            progress = self.progress(step)
            due = [i for i, (at, _) in enumerate(removal.milestones) if i >= self.milestones_done and progress >= at]
            if due:
                self.milestones_done = due[-1] + 1
                return removal.milestones[due[-1]][1], self.milestones_done == len(removal.milestones)
            return None
        if end:
            return removal.keep, True
        if epochs_done is not None:
            return (
                (removal.keep, True)
                if removal.after_epochs is not None and epochs_done >= removal.after_epochs
                else None
            )
        if removal.after_steps is not None and step >= removal.after_steps:
            return removal.keep, True
        return None

    def scores(self) -> dict[int, torch.Tensor]:
        """Per gated layer, what decides which heads stay: |g|, or the deterministic hard-concrete gate."""
        with torch.no_grad():
            return {layer: self.gates.score(self._gate(layer)).float().cpu() for layer in self.gated_layers}

    def choose(self, keep: int | None) -> dict[int, list[int]]:
        """Current positions of the heads to remove: all but the `keep` best (heads, or key/value groups with
        `Removal.groups`), else those below the threshold; never a protected head."""
        model = self.require_bound()
        scores = self.scores()
        for layer, heads in pruning.silenced_heads(model).items():  # chosen before, kept by the grouped-query rule
            if layer in scores:
                numbers = pruning.head_numbers(model, layer)
                scores[layer][[numbers.index(head) for head in heads]] = -math.inf
        for layer, heads in (self.removal.protect or {}).items():
            if layer in scores:
                numbers = pruning.head_numbers(model, layer)
                scores[layer][[numbers.index(head) for head in heads if head in numbers]] = math.inf
        threshold = self.removal.threshold if keep is None else None
        if self.removal.groups:
            return pruning.select_groups(scores, self.group_sizes, threshold=threshold, keep=keep)
        return pruning.select_heads(scores, threshold=threshold, keep=keep)

    def prune(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        step: int,
        keep: int | None = None,
        final: bool = True,
        positions: dict[int, list[int]] | None = None,
        rescue: str | Path | None = None,
    ) -> pruning.PruneReport:
        """Remove the chosen heads (`positions`, else `choose(keep)`) with the optimizers' state sliced;
        with `final`, fold every gate after and stop the penalty.

        The removal is checked whole before anything changes (`attnreg.methods.pruning.prune_heads`); if it fails
        all the same, the model is left as training left it (gated, nothing folded) and, given `rescue` (a
        folder), saved there with `attnreg.methods.pruning.save_pruned` before the error is raised, naming it.
        """
        model = self.require_bound()
        positions = self.choose(keep) if positions is None else positions
        chosen = {layer: heads for layer, heads in pruning.to_original_numbers(model, positions).items() if heads}
        try:
            self.report = pruning.prune_heads(model, chosen, optimizers)  # silences what the grouped-query rule keeps
        except Exception as error:
            saved = (
                ""
                if rescue is None
                else f"; the trained model, gated, was saved to {pruning.save_pruned(model, rescue)}"
            )
            raise RuntimeError(
                f"HeadGating: removing heads {chosen} at step {step} failed ({type(error).__name__}: {error}); "
                f"nothing was folded or removed{saved}"
            ) from error
        if final:
            pruning.fold_gates(model, optimizers)
        for layer, heads in chosen.items():
            self.removed[layer] = sorted({*self.removed.get(layer, ()), *heads})
        self.gated_layers = tuple(layer for layer in self.gated_layers if self.hub.layers[layer].num_heads > 0)
        self.rounds.append(PruningRound(step, chosen, self.report, final))
        if final:
            self.pruned, self.pruned_at_step = True, step
        return self.report

    # -- events ---------------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return not self.pruned

    def on_fit_start(self, loop: Loop) -> None:
        if self.removal.during_training and not self.pruned:
            self._check_removal_in_training(loop)

    def _check_removal_in_training(self, loop: Loop) -> None:
        """Refuse a removal during training that the processes could not continue from."""
        at_end = "remove at the end of training (Removal without after_steps, after_epochs and milestones)"
        if sharded(self.require_bound()):
            raise NotImplementedError(
                "HeadGating: removing heads during training of a sharded model (FSDP2: its parameters are DTensors) "
                "is not supported: a removal slices each projection whole, and the shards, their optimizer state "
                f"and the engine's sharding would all have to be rebuilt; {at_end}: every process then gathers the "
                f"weights, and rank 0 removes the heads from an unsharded copy and saves it to <output_dir>/"
                f"{GATHERED_FOLDER}"
            )
        if loop.world_size > 1 and loop.rewrap is None:
            raise NotImplementedError(
                "HeadGating: removing heads during training under several processes gives the model new "
                "parameters, so the data-parallel wrapper must be rebuilt around them (torch forbids changing "
                f"parameters under a live DDP wrapper), and {loop.engine} offers attnreg no way to (Loop.rewrap is "
                "None). It works under DDP: Lightning's DDPStrategy, the Trainer under torchrun or accelerate, a "
                f"loop of your own that passes Loop(rewrap=...); or {at_end}"
            )

    def on_before_optimizer_step(self, loop: Loop) -> None:
        self.dual_step()

    def on_step_end(self, loop: Loop) -> None:
        self.remove_if_due(loop, self.due(loop.step))

    def on_epoch_end(self, loop: Loop) -> None:
        self.remove_if_due(loop, self.due(loop.step, loop.epoch))

    def on_fit_end(self, loop: Loop) -> None:
        self.remove_if_due(loop, self.due(loop.step, end=True), training=False)

    def remove_if_due(
        self, loop: Loop, due: tuple[int | None, bool] | None, training: bool = True
    ) -> pruning.PruneReport | None:
        """Remove heads when `due` (from `due`) says so: every process removes rank 0's choice, the
        optimizers' state sliced along; a failed removal leaves the model gated in
        `<output_dir>/attnreg-unpruned` (see `prune`). While `training` continues under several processes,
        the model gets fresh parameters and the adapter rebuilds its wrapper (`Loop.rewrap`); a sharded
        model is gathered whole instead, once training is over (`gather_and_prune`)."""
        if due is None:
            return None
        if training and (loop.world_size > 1 or sharded(self.require_bound())):
            self._check_removal_in_training(loop)
        keep, final = due
        positions = loop.broadcast(self.choose(keep))
        if sharded(self.require_bound()):
            return self.gather_and_prune(loop, positions)
        rescue = Path(loop.output_dir, RESCUE_FOLDER) if loop.is_main and loop.output_dir is not None else None
        report = self.prune(loop.optimizers, loop.step, keep, final, positions, rescue)
        if training and loop.world_size > 1:
            renew_parameters(self.model, [item.tensor for item in report.sliced], loop.optimizers)
            loop.rewrap()
        return report

    def gather_and_prune(self, loop: Loop, positions: dict[int, list[int]]) -> pruning.PruneReport | None:
        """The final removal of a sharded model (FSDP2), once training is over: every process gathers the
        weights whole (a collective), rank 0 copies them into an unsharded model of the same class and
        config (`gathered`), removes the heads at `positions` (rank 0's choice) there, folds the gates and
        saves it to `<output_dir>/attnreg-pruned` (`attnreg.methods.pruning.load_pruned` reads it). The
        sharded model keeps its heads and gates. Returns the report on rank 0, None elsewhere."""
        model = self.require_bound()
        weights = {name: whole(value).detach().cpu() for name, value in model.state_dict().items()}
        chosen = {layer: heads for layer, heads in pruning.to_original_numbers(model, positions).items() if heads}
        for layer, heads in chosen.items():
            self.removed[layer] = sorted({*self.removed.get(layer, ()), *heads})
        self.pruned, self.pruned_at_step = True, loop.step
        if not loop.is_main:
            return None
        unsharded = self._unsharded_copy(weights)
        self.report = pruning.prune_heads(unsharded, chosen)
        pruning.fold_gates(unsharded)
        self.rounds.append(PruningRound(loop.step, chosen, self.report, True))
        self.gathered = unsharded
        if loop.output_dir is not None:
            pruning.save_pruned(unsharded, Path(loop.output_dir, GATHERED_FOLDER))
        return self.report

    def _unsharded_copy(self, weights: Mapping[str, torch.Tensor]) -> nn.Module:
        """A model of the bound model's class and config on the CPU, with its pruning, its gates (as `bind`
        makes them) and `weights` (full tensors, loaded strictly)."""
        model = self.require_bound()
        config = copy.deepcopy(model.config)
        removed, silenced = pruning.pruned_heads(model), pruning.silenced_heads(model)
        for record in (pruning.PRUNED_HEADS, pruning.SILENCED_HEADS):
            setattr(config, record, {})
        unsharded = type(model)(config).train(model.training)
        floating = [value.dtype for value in weights.values() if value.is_floating_point()]
        if floating:
            unsharded.to(dtype=floating[0])
        hub = attach(unsharded)
        if removed:
            pruning.prune_heads(unsharded, removed)
        if silenced:
            pruning.silence_heads(unsharded, silenced)
        for layer in self.gated_layers:
            self.gates.make(hub, layer)
        unsharded.load_state_dict(weights)
        return unsharded

    # -- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "pruned": self.pruned,
            "removed": {str(layer): heads for layer, heads in self.removed.items()},
            "lambdas": self.multipliers.tolist(),
            "dual_optimizer": _adam_state(self.dual_optimizer),
            "milestones_done": self.milestones_done,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.pruned = bool(state["pruned"])
        self.removed = {int(layer): list(heads) for layer, heads in state["removed"].items()}
        with torch.no_grad():
            self.multipliers.copy_(torch.tensor(state["lambdas"], dtype=self.multipliers.dtype))
        self.dual_optimizer = self._new_dual_optimizer()
        if self.dual_optimizer is not None and state.get("dual_optimizer"):
            _load_adam_state(self.dual_optimizer, state["dual_optimizer"])
        self._gaps = []
        self.milestones_done = int(state.get("milestones_done", 0))


def _adam_state(optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
    """The state of the multipliers' Adam as JSON-friendly numbers (the HF adapter writes method state as
    JSON); float32 values round-trip exactly through Python floats."""
    if optimizer is None:
        return None
    (parameter,) = optimizer.param_groups[0]["params"]
    state = optimizer.state.get(parameter)
    if not state:
        return {}
    return {key: value.tolist() if value.ndim else float(value) for key, value in state.items()}


def _load_adam_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    (parameter,) = optimizer.param_groups[0]["params"]
    optimizer.state[parameter] = {
        key: torch.tensor(value, dtype=torch.float32 if key == "step" else parameter.dtype)
        for key, value in state.items()
    }


def sharded(model: nn.Module) -> bool:
    """Whether `model` has parameters sharded by FSDP2 (`DTensor`s).

    Example:
        >>> sharded(nn.Linear(2, 2))
        False
    """
    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def renew_parameters(
    model: nn.Module, tensors: Iterable[torch.Tensor], optimizers: Iterable[torch.optim.Optimizer] = ()
) -> dict[torch.Tensor, nn.Parameter]:
    """Put a fresh `nn.Parameter` in `model` in place of each parameter among `tensors` (those a removal
    sliced in place), with its data, gradient and `requires_grad`, and move the optimizers' groups and state
    onto it. A data-parallel wrapper rebuilt after a removal needs it: torch's DDP keeps each parameter's
    gradient accumulator, with the shape it had, so re-wrapping parameters whose data was sliced fails in
    backward. Returns {old parameter: new parameter}.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert")
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> report = pruning.prune_heads(model, {0: [1]}, [optimizer])
        >>> old = model.encoder.layer[0].attention.self.query.weight
        >>> renewed = renew_parameters(model, [item.tensor for item in report.sliced], [optimizer])
        >>> new = model.encoder.layer[0].attention.self.query.weight
        >>> new is renewed[old] and new is not old, torch.equal(new, old), tuple(new.shape)
        (True, True, (24, 32))
        >>> any(p is new for p in optimizer.param_groups[0]["params"]), any(p is old for p in model.parameters())
        (True, False)
    """
    wanted = {id(tensor): tensor for tensor in tensors if isinstance(tensor, nn.Parameter)}
    fresh: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            if id(parameter) not in wanted:
                continue
            if id(parameter) not in fresh:
                new = nn.Parameter(parameter.detach(), requires_grad=parameter.requires_grad)
                new.grad = parameter.grad
                fresh[id(parameter)] = new
            setattr(module, name, fresh[id(parameter)])
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"][:] = [fresh.get(id(parameter), parameter) for parameter in group["params"]]
        for key, new in fresh.items():
            if wanted[key] in optimizer.state:
                optimizer.state[new] = optimizer.state.pop(wanted[key])
    return {wanted[key]: new for key, new in fresh.items()}


def _changing(progress: float) -> float:
    """Stands for a schedule of progress (milestones, a target warmup): the training length is needed."""
    return progress
