"""Attention-loss callbacks: entropy regularization and the syntax-prior KL.

Each captures only the layers it names (through the hub) and adds its weighted term to the training
loss through `attnreg.AttnRegMixin`, logged as `attnreg/<name>`, with a per-layer figure beside it
(`attnreg/<name>/layer<l>`: mean entropy, or KL).

Example:
    >>> trainer = lightning.Trainer(callbacks=[attnreg.SyntaxPriorKL(weight=1.0, layers=[0, 1], heads=[0])])
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import lightning as L
import torch

from attnreg.hub import AttentionRecord
from attnreg.losses import EntropyMode, HeadReduction, attention_entropy, entropy_penalty, prior_kl
from attnreg.mixin import AttnRegMixin, TermFunction, require_mixin
from attnreg.progress import TrainingLength, changes_over_training
from attnreg.pruning import head_numbers, pruned_heads
from attnreg.schedules import ScheduleLike, as_schedule
from attnreg.syntax.data import PRIOR_KEY

Heads = Iterable[int] | Mapping[int, Iterable[int]] | None


class AttentionLoss(L.Callback):
    """Adds `weight * fn(probs, batch)` to the training loss, logged as `attnreg/<name>`.

    `fn` receives the captured attention of `layers` (None = all) as an `AttentionRecord` and the
    batch; it returns a scalar tensor. `weight` is a number or a schedule of training progress in
    [0, 1] (`attnreg.schedules`, e.g. `Warmup(0.1, Constant(1.0))`), with progress and its resume rule
    from `attnreg.progress`. Subclasses take `heads` (original head numbers, which stay valid after
    pruning): the same heads in every chosen layer, or a mapping `{layer: heads}` (whose keys are
    then the layers). A layer whose heads were all pruned drops out of the term, said once in a warning.

    `name` is the term's name in the loss, the logs and the checkpoint. Left at None, the class's
    default is used, or `<default>_2`, `<default>_3`, ... when another callback already holds it, so two
    instances of one class both act; two callbacks given the same explicit name are an error. The
    LightningModule must use `attnreg.AttnRegMixin`.
    """

    default_name = "attention_loss"

    def __init__(
        self,
        fn: TermFunction,
        name: str | None = None,
        layers: int | Iterable[int] | None = None,
        weight: ScheduleLike = 1.0,
    ) -> None:
        self.fn = fn
        self.name_argument = name
        self.name = name or self.default_name
        self.layers_argument = self.layers = layers
        self.weight = weight
        self.schedule = as_schedule(_check_weight(weight, type(self).__name__) if not callable(weight) else weight)
        self.length = TrainingLength(f"{type(self).__name__} weight")
        self.heads: dict[int, list[int]] | list[int] | None = None
        self.module: AttnRegMixin | None = None
        self._reported: set[tuple[int, int | None]] = set()

    @property
    def state_key(self) -> str:
        """Lightning's key for this callback's checkpoint state: distinct for differently set instances."""
        return self._generate_state_key(**self._identity())

    def _identity(self) -> dict[str, Any]:
        return {"name": self.name_argument, "layers": self.layers_argument, "heads": self.heads}

    def set_heads(self, heads: Heads) -> None:
        """Keep `heads` (see the class docstring); a mapping also sets `layers` when none were given."""
        if isinstance(heads, Mapping):
            self.heads = {int(layer): list(chosen) for layer, chosen in heads.items()}
            if self.layers is None:
                self.layers = list(self.heads)
        else:
            self.heads = None if heads is None else list(heads)

    def heads_of(self, layer: int) -> list[int] | None:
        """The heads of `layer` (original numbers) this loss applies to (None = all)."""
        return self.heads.get(layer) if isinstance(self.heads, dict) else self.heads

    def active_heads(self) -> dict[int, list[int] | None]:
        """{layer: current positions of the chosen heads (None = all)} for the layers that still have
        some; what pruning removed is left out, and said once."""
        model = self.module.attnreg_model
        active = {}
        for layer in self.layers:
            numbers = head_numbers(model, layer)
            chosen = self.heads_of(layer)
            gone = [head for head in (chosen or ()) if head not in numbers]
            for head in gone:
                self._report_pruned(layer, head)
            if not numbers or (chosen is not None and len(gone) == len(chosen)):
                self._report_pruned(layer, None)
                continue
            active[layer] = None if chosen is None else [numbers.index(head) for head in chosen if head in numbers]
        return active

    def _report_pruned(self, layer: int, head: int | None) -> None:
        if (layer, head) in self._reported:
            return
        self._reported.add((layer, head))
        what = f"layer {layer} has none of its chosen heads left" if head is None else f"head {head} of layer {layer}"
        warnings.warn(
            f"{type(self).__name__} {self.name!r}: {what} was pruned, so the term no longer covers it",
            stacklevel=2,
        )

    def current_weight(self) -> float:
        """The weight at the module's current global step."""
        step = self.module.global_step if self.module is not None and self.module._trainer is not None else 0
        return _check_weight(self.schedule(self.length.progress(step)), f"{type(self).__name__} weight at step {step}")

    def term(self, probs: AttentionRecord, batch: Any) -> torch.Tensor:
        return self.current_weight() * self.fn(probs, batch)

    def log_layers(self, layers: Iterable[int], values: torch.Tensor) -> None:
        """Log one figure per layer as `attnreg/<name>/layer<l>`."""
        if self.module is None:
            return
        sync = self.module.trainer.world_size > 1
        for layer, value in zip(layers, values.detach(), strict=True):
            self.module.log(f"attnreg/{self.name}/layer{layer}", value, sync_dist=sync)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        module = require_mixin(pl_module, self)
        if self.module is module:
            module.remove_attnreg_term(self.name)
        self.name = module.free_attnreg_term_name(self.name_argument, self.default_name, type(self).__name__)
        module.add_attnreg_term(self.name, self.term, layers=self.layers)
        self.module = module
        self.layers = module.attnreg_terms[self.name].layers or tuple(range(module.attnreg_hub.num_layers))
        self.causal = module.attnreg_hub.family.causal
        if isinstance(self.heads, dict) and set(self.heads) != set(self.layers):
            raise ValueError(
                f"{type(self).__name__}: heads is given for layers {sorted(self.heads)} but layers={list(self.layers)}"
            )
        model = module.attnreg_model
        for layer in self.layers:
            heads = self.heads_of(layer)
            count = len(head_numbers(model, layer)) + len(pruned_heads(model).get(layer, ()))
            if heads is not None and not all(isinstance(h, int) and 0 <= h < count for h in heads):
                raise IndexError(
                    f"{type(self).__name__}: heads={heads} out of range for layer "
                    f"{layer}, which has {count} heads (valid: 0..{count - 1})"
                )

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.length.start(trainer.estimated_stepping_batches, changes_over_training(self.schedule))

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pl_module.remove_attnreg_term(self.name)
        self.module = None

    def state_dict(self) -> dict[str, Any]:
        return self.length.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.length.load_state_dict(state_dict)


class EntropyRegularizer(AttentionLoss):
    """Entropy regularization of attention heads.

    `mode="min"` sharpens, `"max"` flattens (EAR), `"target"` keeps each head (or each layer's head
    mean, `per="layer"`) inside `target=(lo, hi)`. Entropies are normalized by log(admissible keys)
    unless `normalize=False`; `heads` limits the loss to some heads of every chosen layer. Logs the
    mean entropy of each layer as `attnreg/entropy/layer<l>`.

    Example:
        >>> attnreg.EntropyRegularizer(mode="target", target=(0.3, 0.8), layers=[4, 5], weight=0.1)
    """

    default_name = "entropy"

    def __init__(
        self,
        weight: ScheduleLike = 0.01,
        mode: EntropyMode = "min",
        target: tuple[float, float] | None = None,
        layers: int | Iterable[int] | None = None,
        heads: Heads = None,
        normalize: bool = True,
        per: str = "head",
        name: str | None = None,
    ) -> None:
        target = None if target is None else tuple(target)
        entropy_penalty(torch.zeros(1), mode, target, per)  # validate the options now, not at step one
        super().__init__(self._penalty, name=name, layers=layers, weight=weight)
        self.mode, self.target, self.per, self.normalize = mode, target, per, normalize
        self.set_heads(heads)

    def _identity(self) -> dict[str, Any]:
        return {**super()._identity(), "mode": self.mode, "target": self.target}

    def _penalty(self, probs: AttentionRecord, batch: Any) -> torch.Tensor:
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        active = self.active_heads()
        entropies = []
        for layer, heads in active.items():
            entropy = attention_entropy(probs[layer], mask, causal=self.causal, normalize=self.normalize)
            entropies.append(entropy if heads is None else entropy[heads])
        if not entropies:
            return torch.zeros((), device=self.module.device)
        self.log_layers(active, torch.stack([entropy.mean() for entropy in entropies]))
        if self.per == "layer" or len({len(entropy) for entropy in entropies}) == 1:
            return entropy_penalty(torch.stack(entropies), self.mode, self.target, self.per)
        return torch.stack([entropy_penalty(entropy, self.mode, self.target) for entropy in entropies]).mean()


class SyntaxPriorKL(AttentionLoss):
    """KL(prior ‖ attention) for chosen heads, with the prior read from the batch.

    The batch (a dict) carries `batch[prior_key]` (default "attnreg_prior"): key indices `[B, T]`
    (-1 = row left out) or dense rows `[B, T, S]`, aligned with the model's tokens, as
    `attnreg.syntax.SyntaxCollator` builds them. For decoders the prior is restricted to earlier keys.
    `head_reduction`: "mean_heads" (mean of per-head KLs) or "mean_attention" (KL of the head mean).

    Example:
        >>> attnreg.SyntaxPriorKL(weight=1.0, layers=[0, 1], heads=[0])
        >>> attnreg.SyntaxPriorKL(heads={0: [3], 1: [4], 2: [8]})   # one chosen head per layer
    """

    default_name = "prior_kl"

    def __init__(
        self,
        weight: ScheduleLike = 1.0,
        layers: int | Iterable[int] | None = None,
        heads: Heads = None,
        head_reduction: HeadReduction = "mean_heads",
        prior_key: str = PRIOR_KEY,
        name: str | None = None,
    ) -> None:
        super().__init__(self._kl, name=name, layers=layers, weight=weight)
        if head_reduction not in ("mean_heads", "mean_attention"):
            raise ValueError(f"head_reduction must be 'mean_heads' or 'mean_attention', got {head_reduction!r}")
        self.set_heads(heads)
        self.head_reduction, self.prior_key = head_reduction, prior_key

    def _kl(self, probs: AttentionRecord, batch: Any) -> torch.Tensor:
        if not isinstance(batch, dict) or self.prior_key not in batch:
            keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise KeyError(
                f"{type(self).__name__} reads the prior from batch[{self.prior_key!r}]; the batch has {keys}. "
                "Build batches with attnreg.syntax.SyntaxCollator (or put your own prior under that key)."
            )
        prior = batch[self.prior_key]
        active = self.active_heads()
        if not active:
            return torch.zeros((), device=self.module.device)
        losses = torch.stack(
            [prior_kl(probs[layer], prior, heads, self.head_reduction, self.causal) for layer, heads in active.items()]
        )
        self.log_layers(active, losses)
        return losses.mean()


def _check_weight(weight: Any, what: str) -> float:
    if not isinstance(weight, int | float) or not math.isfinite(weight) or weight < 0:
        raise ValueError(f"{what}: weight must be a finite number >= 0, got {weight!r}")
    return float(weight)
