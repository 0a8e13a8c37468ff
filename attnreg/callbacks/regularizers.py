"""Attention-loss callbacks: entropy regularization and the syntax-prior KL.

Each captures only the layers it names (through the hub) and adds its weighted term to the training
loss through `attnreg.AttnRegMixin`, logged as `attnreg/<name>`, with a per-layer figure beside it
(`attnreg/<name>/layer<l>`: mean entropy, or KL).

Example:
    >>> trainer = lightning.Trainer(callbacks=[attnreg.SyntaxPriorKL(weight=1.0, layers=[0, 1], heads=[0])])
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import lightning as L
import torch

from attnreg.hub import AttentionRecord
from attnreg.losses import EntropyMode, HeadReduction, attention_entropy, entropy_penalty, prior_kl
from attnreg.mixin import AttnRegMixin, TermFunction, require_mixin
from attnreg.schedules import ScheduleLike, as_schedule, step_progress
from attnreg.syntax.data import PRIOR_KEY

Heads = Iterable[int] | Mapping[int, Iterable[int]] | None


class AttentionLoss(L.Callback):
    """Adds `weight * fn(probs, batch)` to the training loss, logged as `attnreg/<name>`.

    `fn` receives the captured attention of `layers` (None = all) as an `AttentionRecord` and the
    batch; it returns a scalar tensor. `weight` is a number or a schedule of training progress in
    [0, 1] (`attnreg.schedules`, e.g. `Warmup(0.1, Constant(1.0))`; progress = global step / the
    trainer's estimated steps, so a resumed run continues the schedule). Subclasses take `heads`: the
    same heads in every chosen layer, or a mapping `{layer: heads}` (whose keys are then the layers).
    The LightningModule must use `attnreg.AttnRegMixin`.
    """

    def __init__(
        self,
        fn: TermFunction,
        name: str = "attention_loss",
        layers: int | Iterable[int] | None = None,
        weight: ScheduleLike = 1.0,
    ) -> None:
        self.fn = fn
        self.name = name
        self.layers = layers
        self.weight = weight
        self.schedule = as_schedule(_check_weight(weight, type(self).__name__) if not callable(weight) else weight)
        self.total_steps = 1
        self.heads: dict[int, list[int]] | list[int] | None = None
        self.module: AttnRegMixin | None = None

    def set_heads(self, heads: Heads) -> None:
        """Keep `heads` (see the class docstring); a mapping also sets `layers` when none were given."""
        if isinstance(heads, Mapping):
            self.heads = {int(layer): list(chosen) for layer, chosen in heads.items()}
            if self.layers is None:
                self.layers = list(self.heads)
        else:
            self.heads = None if heads is None else list(heads)

    def heads_of(self, layer: int) -> list[int] | None:
        """The heads of `layer` this loss applies to (None = all)."""
        return self.heads.get(layer) if isinstance(self.heads, dict) else self.heads

    def current_weight(self) -> float:
        """The weight at the module's current global step."""
        step = self.module.global_step if self.module is not None and self.module._trainer is not None else 0
        progress = step_progress(min(step, self.total_steps), self.total_steps)
        return _check_weight(self.schedule(progress), f"{type(self).__name__} weight at step {step}")

    def term(self, probs: AttentionRecord, batch: Any) -> torch.Tensor:
        return self.current_weight() * self.fn(probs, batch)

    def log_layers(self, values: torch.Tensor) -> None:
        """Log one figure per captured layer as `attnreg/<name>/layer<l>`."""
        if self.module is None:
            return
        sync = self.module.trainer.world_size > 1
        for layer, value in zip(self.layers, values.detach(), strict=True):
            self.module.log(f"attnreg/{self.name}/layer{layer}", value, sync_dist=sync)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        module = require_mixin(pl_module, self)
        module.remove_attnreg_term(self.name)
        module.add_attnreg_term(self.name, self.term, layers=self.layers)
        self.module = module
        self.layers = module.attnreg_terms[self.name].layers or tuple(range(module.attnreg_hub.num_layers))
        self.causal = module.attnreg_hub.family.causal
        if isinstance(self.heads, dict) and set(self.heads) != set(self.layers):
            raise ValueError(
                f"{type(self).__name__}: heads is given for layers {sorted(self.heads)} but layers={list(self.layers)}"
            )
        for layer in self.layers:
            heads, count = self.heads_of(layer), module.attnreg_hub.layers[layer].num_heads
            if heads is not None and not all(0 <= head < count for head in heads):
                raise IndexError(
                    f"{type(self).__name__}: heads={heads} out of range for layer "
                    f"{layer}, which has {count} heads (valid: 0..{count - 1})"
                )

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        estimate = trainer.estimated_stepping_batches
        self.total_steps = int(estimate) if math.isfinite(estimate) and estimate >= 1 else 1

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pl_module.remove_attnreg_term(self.name)
        self.module = None


class EntropyRegularizer(AttentionLoss):
    """Entropy regularization of attention heads.

    `mode="min"` sharpens, `"max"` flattens (EAR), `"target"` keeps each head (or each layer's head
    mean, `per="layer"`) inside `target=(lo, hi)`. Entropies are normalized by log(admissible keys)
    unless `normalize=False`; `heads` limits the loss to some heads of every chosen layer. Logs the
    mean entropy of each layer as `attnreg/entropy/layer<l>`.

    Example:
        >>> attnreg.EntropyRegularizer(mode="target", target=(0.3, 0.8), layers=[4, 5], weight=0.1)
    """

    def __init__(
        self,
        weight: ScheduleLike = 0.01,
        mode: EntropyMode = "min",
        target: tuple[float, float] | None = None,
        layers: int | Iterable[int] | None = None,
        heads: Heads = None,
        normalize: bool = True,
        per: str = "head",
        name: str = "entropy",
    ) -> None:
        target = None if target is None else tuple(target)
        entropy_penalty(torch.zeros(1), mode, target, per)  # validate the options now, not at step one
        super().__init__(self._penalty, name=name, layers=layers, weight=weight)
        self.mode, self.target, self.per, self.normalize = mode, target, per, normalize
        self.set_heads(heads)

    def _penalty(self, probs: AttentionRecord, batch: Any) -> torch.Tensor:
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        entropies = []
        for layer in self.layers:
            entropy = attention_entropy(probs[layer], mask, causal=self.causal, normalize=self.normalize)
            heads = self.heads_of(layer)
            entropies.append(entropy if heads is None else entropy[heads])
        self.log_layers(torch.stack([entropy.mean() for entropy in entropies]))
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

    def __init__(
        self,
        weight: ScheduleLike = 1.0,
        layers: int | Iterable[int] | None = None,
        heads: Heads = None,
        head_reduction: HeadReduction = "mean_heads",
        prior_key: str = PRIOR_KEY,
        name: str = "prior_kl",
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
        losses = torch.stack(
            [
                prior_kl(probs[layer], prior, self.heads_of(layer), self.head_reduction, self.causal)
                for layer in self.layers
            ]
        )
        self.log_layers(losses)
        return losses.mean()


def _check_weight(weight: Any, what: str) -> float:
    if not isinstance(weight, int | float) or not math.isfinite(weight) or weight < 0:
        raise ValueError(f"{what}: weight must be a finite number >= 0, got {weight!r}")
    return float(weight)
