"""Head importance (Michel et al. 2019), choosing heads by score, iterative pruning, `HeadImportance`, the
method that runs them at the end of training, and `ImportanceRemoval`, which removes the least important heads
(or key/value groups) when training starts."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from attnreg.families import detect_family
from attnreg.heads import HeadSpec, PruneReport, head_numbers, to_original_numbers
from attnreg.hub import attach, detach
from attnreg.methods.base import Loop, Method
from attnreg.methods.pruning.method import renew_parameters, sharded
from attnreg.methods.registry import register_method
from attnreg.structure.gates import _hub_or_none
from attnreg.structure.surgery import check_removable, prune_heads

LossFunction = Callable[[Any, Any], torch.Tensor]


def head_importance(
    model: nn.Module,
    dataloader: Iterable[Any],
    loss_fn: LossFunction | None = None,
    masked: HeadSpec | None = None,
) -> dict[int, torch.Tensor]:
    """Michel et al. 2019: the expected |dL/dg_h| at gates g = 1, L2-normalized per layer.

    Batches are dicts passed as `model(**batch)`; the loss is `loss_fn(output, batch)` or the
    model's own `output.loss`. Heads in `masked` (original numbers) are held at g = 0 meanwhile. Runs
    in eval mode (no dropout); the model's weights, gates, grads and modes are left as they were. A progress bar
    shows on a terminal.
    Returns one tensor per layer, indexed by the heads' current positions (see `head_numbers`).

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert", head="classification")
        >>> loader = [{"input_ids": torch.tensor([[2, 5, 6, 3], [2, 7, 8, 3]]), "labels": torch.tensor([1, 0])}]
        >>> scores = head_importance(model, loader)
        >>> scores[0].shape, round(float(scores[0].norm()), 4)     # unit L2 norm per layer
        (torch.Size([4]), 1.0)
    """
    totals: dict[int, torch.Tensor] = {}
    batches = 0
    with _evaluation_gates(model, masked or {}) as gates:
        device = next(model.parameters()).device
        total = len(dataloader) if hasattr(dataloader, "__len__") else None
        for batch in tqdm(dataloader, total=total, desc="head importance", unit="batch", disable=None, leave=False):
            batch = {
                key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()
            }
            output = model(**batch)
            loss = loss_fn(output, batch) if loss_fn is not None else getattr(output, "loss", None)
            if loss is None:
                raise ValueError("head_importance: the model output has no loss; pass loss_fn(output, batch)")
            layers = list(gates)
            grads = torch.autograd.grad(loss, [gates[layer] for layer in layers], allow_unused=True)
            for layer, grad in zip(layers, grads, strict=True):
                value = torch.zeros_like(gates[layer]) if grad is None else grad.detach().abs()
                totals[layer] = totals.get(layer, 0) + value.float()
            batches += 1
    if batches == 0:
        raise ValueError("head_importance: the dataloader yielded no batches")
    return {layer: _unit(total / batches) for layer, total in totals.items()}


def _unit(scores: torch.Tensor) -> torch.Tensor:
    norm = scores.norm()
    return scores / norm if norm > 0 else scores


@contextmanager
def _evaluation_gates(model: nn.Module, masked: HeadSpec) -> Iterator[dict[int, nn.Parameter]]:
    """Gates at 1 (0 for `masked` heads) on every layer, with only the gates requiring grad; restores all."""
    was_attached = _hub_or_none(model) is not None
    hub = attach(model)
    for layer, gate in hub.gates.items():
        if isinstance(gate, nn.Module):
            raise ValueError(f"layer {layer} has a {type(gate).__name__} gate; fold it first with fold_gates(model)")
    existing = {layer: gate.detach().clone() for layer, gate in hub.gates.items()}
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    training = model.training
    gates = {layer: hub.gate(layer) for layer in range(hub.num_layers)}
    try:
        model.eval()
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        with torch.no_grad():
            for layer, gate in gates.items():
                gate.fill_(1.0)
                numbers = head_numbers(model, layer)
                for head in masked.get(layer, ()):
                    if head in numbers:
                        gate[numbers.index(head)] = 0.0
                gate.requires_grad_(True)
        yield gates
    finally:
        for layer, gate in gates.items():
            if layer in existing:
                with torch.no_grad():
                    gate.copy_(existing[layer])
            else:
                hub.remove_gate(layer, fold=False)
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(flags.get(name, True))
        model.train(training)
        if not was_attached:
            detach(model)


def select_heads(
    scores: Mapping[int, torch.Tensor], threshold: float | None = None, keep: int | None = None, uniform: bool = False
) -> dict[int, list[int]]:
    """Heads to remove, as current positions per layer: those scoring below `threshold`, or all but
    the `keep` best overall (ties broken by layer then head order). Exactly one of the two is given.
    `uniform` keeps the same number in every layer, each layer's best: `keep` is split evenly across the layers,
    so that every layer ends with the same head count (what a plain transformers checkpoint needs,
    `attnreg.export.export_transformers`).

    Example:
        >>> scores = {0: torch.tensor([0.9, 0.1, 0.5]), 1: torch.tensor([0.2, 0.8, 0.05])}
        >>> select_heads(scores, keep=3), select_heads(scores, threshold=0.3)
        ({0: [1], 1: [0, 2]}, {0: [1], 1: [0, 2]})
        >>> select_heads(scores, keep=4, uniform=True)              # 2 in each layer, whatever the others score
        {0: [1], 1: [2]}
    """
    if (threshold is None) == (keep is None):
        raise ValueError("give exactly one of threshold= and keep=")
    if threshold is not None:
        if uniform:
            raise ValueError("uniform=True needs keep= (the heads kept, split evenly across layers), not threshold=")
        return {layer: [i for i, s in enumerate(score.tolist()) if s < threshold] for layer, score in scores.items()}
    flat = [(-float(s), layer, i) for layer, score in scores.items() for i, s in enumerate(score.tolist())]
    if not 0 <= keep <= len(flat):
        raise ValueError(f"keep={keep} heads is more than the {len(flat)} heads there are (or negative)")
    if uniform:
        fewest = min((score.numel() for score in scores.values()), default=0)
        if scores and (keep % len(scores) or keep // len(scores) > fewest):
            raise ValueError(
                f"uniform=True: keep={keep} is not the same number in each of the {len(scores)} layers (a multiple "
                f"of {len(scores)}, at most {fewest} per layer)"
            )
        per_layer = keep // len(scores) if scores else 0
        ranked = {layer: score.argsort(descending=True, stable=True).tolist() for layer, score in scores.items()}
        return {layer: sorted(order[per_layer:]) for layer, order in ranked.items()}
    chosen: dict[int, list[int]] = {layer: [] for layer in scores}
    for _, layer, head in sorted(flat)[keep:]:
        chosen[layer].append(head)
    return {layer: sorted(heads) for layer, heads in chosen.items()}


@dataclass(frozen=True)
class PruningStep:
    """One point of the curve: heads removed so far (original numbers per layer) and the metric.

    Example:
        >>> PruningStep(heads_removed=2, metric=0.91, removed={0: (1,), 3: (0,)})
        PruningStep(heads_removed=2, metric=0.91, removed={0: (1,), 3: (0,)})
    """

    heads_removed: int
    metric: float
    removed: dict[int, tuple[int, ...]]


def iterative_pruning(
    model: nn.Module,
    dataloader: Iterable[Any],
    metric_fn: Callable[[nn.Module], float],
    fraction: float = 0.1,
    stop_ratio: float = 0.9,
    loss_fn: LossFunction | None = None,
    apply: bool = True,
) -> list[PruningStep]:
    """Michel et al. 2019's iterative pruning: per round, mask the heads with the lowest importance
    (recomputed with the masks on), round k bringing the heads masked to `round(k * fraction * total)`
    (at least one more per round), until `metric_fn(model)` (higher is better) falls below
    `stop_ratio` times its starting value. Returns the metric-versus-heads-removed curve;
    with `apply`, the last step that stayed above the bar is then removed physically (heads the
    grouped-query rule keeps are silenced).

    Example:
        >>> from attnreg.methods.pruning import pruned_heads
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert", head="classification", layers=1)
        >>> loader = [{"input_ids": torch.tensor([[2, 5, 6, 3], [2, 7, 8, 3]]), "labels": torch.tensor([1, 0])}]
        >>> def accuracy(model):
        ...     return float((model(**loader[0]).logits.argmax(-1) == loader[0]["labels"]).float().mean())
        >>> curve = iterative_pruning(model, loader, accuracy, fraction=0.5, apply=False)
        >>> [(step.heads_removed, step.metric) for step in curve]      # an untrained model needs no head
        [(0, 0.5), (2, 0.5), (4, 0.5)]
        >>> pruned_heads(model)                                        # apply=False: only the curve
        {}
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    family = detect_family(model)
    total = sum(family.head_counts(family.attention_module(model, i))[0] for i in range(len(family.blocks(model))))
    start = float(_metric_with_masks(model, metric_fn, {}))
    curve = [PruningStep(0, start, {})]
    masked: dict[int, list[int]] = {}
    best = curve[0]
    while (done := sum(len(heads) for heads in masked.values())) < total:
        goal = min(total, max(done + 1, round(len(curve) * fraction * total)))
        scores = head_importance(model, dataloader, loss_fn, masked=masked)
        candidates = []
        for layer, score in scores.items():
            numbers = head_numbers(model, layer)
            candidates += [(float(s), layer, numbers[i]) for i, s in enumerate(score.tolist())]
        candidates = [c for c in sorted(candidates) if c[2] not in masked.get(c[1], [])]
        for _, layer, head in candidates[: goal - done]:
            masked.setdefault(layer, []).append(head)
        metric = float(_metric_with_masks(model, metric_fn, masked))
        step = PruningStep(
            sum(len(h) for h in masked.values()), metric, {layer: tuple(sorted(h)) for layer, h in masked.items()}
        )
        curve.append(step)
        if metric < stop_ratio * start:
            break
        best = step
    if apply and best.removed:
        prune_heads(model, best.removed)
    return curve


def _metric_with_masks(model: nn.Module, metric_fn: Callable[[nn.Module], float], masked: HeadSpec) -> float:
    with _evaluation_gates(model, masked), torch.no_grad():
        return metric_fn(model)


@register_method(docs="methods/pruning.md", config=False)
class HeadImportance(Method):
    """Scores heads at the end of training and, given `metric_fn`, prunes iteratively until the metric
    falls below `stop_ratio` of its start (`attnreg.iterative_pruning`).

    `dataloader` yields dict batches for `model(**batch)` (with labels, or pass `loss_fn`).
    After training: `scores` (per layer, current head positions) and `curve` (`attnreg.PruningStep`s).

    Example:
        >>> from attnreg.methods.pruning import pruned_heads
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
        loss_fn: LossFunction | None = None,
        metric_fn: Callable[[torch.nn.Module], float] | None = None,
        fraction: float = 0.1,
        stop_ratio: float = 0.9,
    ) -> None:
        super().__init__()
        self.dataloader, self.loss_fn, self.metric_fn = dataloader, loss_fn, metric_fn
        self.fraction, self.stop_ratio = fraction, stop_ratio
        self.scores: dict[int, torch.Tensor] = {}
        self.curve: list[PruningStep] = []

    def identity(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "stop_ratio": self.stop_ratio}

    def on_fit_end(self, loop: Loop) -> None:
        self.at_end()

    def at_end(self) -> None:
        """Score the heads (and prune iteratively, given `metric_fn`); call once training is over."""
        model = self.require_bound()
        self.scores = head_importance(model, self.dataloader, self.loss_fn)
        if self.metric_fn is not None:
            self.curve = iterative_pruning(
                model, self.dataloader, self.metric_fn, self.fraction, self.stop_ratio, self.loss_fn
            )


def select_groups(
    scores: Mapping[int, torch.Tensor],
    group_size: Mapping[int, int],
    threshold: float | None = None,
    keep: int | None = None,
    uniform: bool = False,
) -> dict[int, list[int]]:
    """Heads to remove by whole key/value groups, as current positions per layer: a group (`group_size[layer]`
    consecutive query heads sharing a key/value head) scores the mean of its heads (+inf if any head is +inf, a
    protected head); then the groups below `threshold` go, or all but the `keep` best groups overall, or with
    `uniform` the same number of groups in every layer, each layer's best (`select_heads`).

    Example:
        >>> scores = {0: torch.tensor([0.9, 0.7, 0.1, 0.2]), 1: torch.tensor([0.3, 0.1, 0.8, float("inf")])}
        >>> select_groups(scores, {0: 2, 1: 2}, keep=2), select_groups(scores, {0: 2, 1: 2}, threshold=0.5)
        ({0: [2, 3], 1: [0, 1]}, {0: [2, 3], 1: [0, 1]})
        >>> select_groups({0: torch.tensor([0.9, 0.7, 0.6, 0.5]), 1: torch.tensor([0.3, 0.1, 0.2, 0.4])},
        ...               {0: 2, 1: 2}, keep=2, uniform=True)        # a group from each layer, not both from layer 1
        {0: [2, 3], 1: [0, 1]}
    """
    grouped = {}
    for layer, score in scores.items():
        size = group_size[layer]
        if score.numel() % size:
            raise ValueError(f"layer {layer} has {score.numel()} heads, not whole groups of {size}")
        members = score.view(-1, size)
        mean = members.mean(dim=1)
        grouped[layer] = torch.where(members.isposinf().any(dim=1), torch.inf, mean)
    try:
        chosen = select_heads(grouped, threshold=threshold, keep=keep, uniform=uniform)
    except ValueError as error:
        raise ValueError(str(error).replace("heads", "key/value groups")) from None
    return {
        layer: [group * group_size[layer] + i for group in groups for i in range(group_size[layer])]
        for layer, groups in chosen.items()
    }


@register_method(docs="methods/pruning.md", removes_heads=True)
class ImportanceRemoval(Method):
    """Removes the heads that matter least, by head importance (Michel et al. 2019) on the first `batches`
    batches of `dataloader`, once, when training starts: whole key/value groups with `groups` (a group scores
    its heads' mean, `select_groups`), else single heads (`select_heads`; a grouped-query head whose group stays
    is silenced). `keep` (groups, or heads, kept) says how many go or, without it, `fraction` (of them removed,
    rounded); `keep_per_layer` groups (heads) stay in every layer whatever their scores. `uniform` keeps the same
    number in every layer, each layer's least important going (`select_groups`): every layer ends with the same
    counts, which a plain transformers checkpoint needs (`attnreg.export.export_transformers`).

    The choice is made on the model as training starts (a LoRA adapter not trained yet adds nothing), the
    optimizers' state is sliced along (`prune_heads`), and LoRA factors go with the heads. What the model
    computes afterwards is what `prune_heads(model, select_groups(head_importance(model, batches), ...))`
    gives. A resumed run does not choose again: the checkpoint holds the smaller model. `dataloader` yields
    batches as the model takes them (with labels, or pass `loss_fn`); attnreg-train gives its training loader
    (`needs`). After training: `scores` (per layer), `removed` ({layer: original head numbers}), `report`.

    Example:
        >>> from attnreg.methods import Loop
        >>> from attnreg.methods.pruning import pruned_heads
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("llama", head="causal_lm")      # 2 layers x 4 query heads, 2 key/value groups
        >>> ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
        >>> removal = ImportanceRemoval([{"input_ids": ids, "labels": ids}], fraction=0.25)
        >>> removal.bind(model); removal.start(10); removal.on_fit_start(Loop())
        >>> sum(len(heads) for heads in pruned_heads(model).values())   # one of the 4 groups: its 2 query heads
        2
    """

    default_name = "importance_removal"
    needs = frozenset({"train_batches"})

    def __init__(
        self,
        dataloader: Iterable[Any] | None = None,
        keep: int | None = None,
        fraction: float | None = None,
        batches: int | None = 8,
        groups: bool = True,
        keep_per_layer: int = 0,
        uniform: bool = False,
        loss_fn: LossFunction | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        if keep is None and fraction is None:
            raise ValueError("ImportanceRemoval: give keep= (groups, or heads, kept) or fraction= (of them removed)")
        for argument, value, low in (("keep", keep, 0), ("batches", batches, 1), ("keep_per_layer", keep_per_layer, 0)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"ImportanceRemoval: {argument} must be an integer >= {low}, got {value!r}")
        if fraction is not None and not (isinstance(fraction, int | float) and 0 <= fraction < 1):
            raise ValueError(f"ImportanceRemoval: fraction (of the groups removed) must be in [0, 1), got {fraction!r}")
        self.dataloader, self.loss_fn = dataloader, loss_fn
        self.keep, self.fraction, self.batches = keep, fraction, batches
        self.groups, self.keep_per_layer, self.uniform = groups, keep_per_layer, uniform
        self.group_sizes: dict[int, int] = {}
        self.scores: dict[int, torch.Tensor] = {}
        self.removed: dict[int, list[int]] = {}
        self.report: PruneReport | None = None
        self.done = False

    def identity(self) -> dict[str, Any]:
        return {"name": self.name_argument}

    @property
    def units(self) -> str:
        return "key/value groups" if self.groups else "heads"

    def bind(self, model: nn.Module, taken: Collection[str] = ()) -> None:
        super().bind(model, taken)
        model, family = self.model, self.hub.family
        layers = [layer for layer in range(self.hub.num_layers) if self.hub.layers[layer].num_heads > 0]
        self.group_sizes = {}
        for layer in layers:
            heads, kv_heads = family.head_counts(family.attention_module(model, layer))
            self.group_sizes[layer] = heads // kv_heads if self.groups else 1
        if self.done:
            return
        counts = {layer: self.hub.layers[layer].num_heads // size for layer, size in self.group_sizes.items()}
        total = sum(counts.values())
        where = f"{type(model).__name__} has {total} ({len(counts)} layers x {max(counts.values(), default=0)})"
        if self.keep is not None and self.keep > total:
            raise ValueError(f"ImportanceRemoval: keep={self.keep} {self.units}, more than the model has: {where}")
        if self.keep_per_layer > min(counts.values(), default=0) or self.keep_per_layer * len(counts) > self.kept():
            raise ValueError(
                f"ImportanceRemoval: keep_per_layer={self.keep_per_layer} {self.units} in each of {len(counts)} "
                f"layers, more than a layer has or than the {self.kept()} kept in all: {where}"
            )
        if self.uniform and self.kept() % len(counts):
            raise ValueError(
                f"ImportanceRemoval: uniform=True keeps the same number of {self.units} in every layer, but "
                f"{self.kept()} kept is not a multiple of the {len(counts)} layers: {where}; give keep= a multiple, "
                f"e.g. keep={len(counts) * max(1, self.kept() // len(counts))}"
            )
        try:  # what the removal will need, now rather than when training starts
            check_removable(model, layers)
        except TypeError as error:
            raise TypeError(f"ImportanceRemoval: {error}") from None

    def kept(self) -> int:
        """How many groups (heads) stay: `keep`, or all but `fraction` of them."""
        total = sum(self.hub.layers[layer].num_heads // size for layer, size in self.group_sizes.items())
        return self.keep if self.keep is not None else total - round(self.fraction * total)

    def choose(self) -> dict[int, list[int]]:
        """Current positions of the heads to remove (scores the heads on the first `batches` batches first)."""
        if self.dataloader is None:
            raise ValueError(
                "ImportanceRemoval: no dataloader to score heads on: pass dataloader= (attnreg-train gives its "
                "training loader)"
            )
        with torch.random.fork_rng(devices=[]):  # a shuffled loader's draw leaves training's random stream alone
            batches = list(itertools.islice(self.dataloader, self.batches))
        self.scores = head_importance(self.require_bound(), batches, self.loss_fn)
        scores = {layer: score.clone() for layer, score in self.scores.items() if layer in self.group_sizes}
        for layer, score in scores.items():  # the best groups of each layer stay whatever the others score
            size = self.group_sizes[layer]
            best = score.view(-1, size).mean(dim=1).argsort(descending=True, stable=True)[: self.keep_per_layer]
            for group in best.tolist():
                score[group * size : (group + 1) * size] = math.inf
        return select_groups(scores, self.group_sizes, keep=self.kept(), uniform=self.uniform)

    def on_fit_start(self, loop: Loop) -> None:
        if self.done:  # resumed: the checkpoint's model is the smaller one
            return
        model = self.require_bound()
        several = loop.world_size > 1
        if (several and loop.rewrap is None) or sharded(model):
            raise NotImplementedError(
                f"ImportanceRemoval: removing heads when training starts needs a model that is not sharded and, under "
                f"several processes, a data-parallel wrapper the engine can rebuild; {loop.engine} offers none. "
                "Remove the heads before training: prune_heads(model, select_groups(head_importance(...), ...))"
            )
        positions = loop.broadcast(self.choose())
        chosen = {layer: heads for layer, heads in to_original_numbers(model, positions).items() if heads}
        self.report = prune_heads(model, chosen, loop.optimizers)
        if several:
            renew_parameters(model, [item.tensor for item in self.report.sliced], loop.optimizers)
            loop.rewrap()
        self.removed = {layer: sorted(heads) for layer, heads in chosen.items()}
        self.done = True

    def state_dict(self) -> dict[str, Any]:
        removed = {str(layer): heads for layer, heads in self.removed.items()}
        return {**super().state_dict(), "done": self.done, "removed": removed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.done = bool(state["done"])
        self.removed = {int(layer): list(heads) for layer, heads in state["removed"].items()}
