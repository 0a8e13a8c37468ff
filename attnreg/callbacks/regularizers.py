"""Lightning callbacks: thin adapters that decide *when* attnreg's functions run.

Example:
    >>> trainer = lightning.Trainer(callbacks=[attnreg.AttentionLoss(my_loss, name="mine", layers=[0])])
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning as L
import torch

from attnreg.hub import AttentionRecord
from attnreg.losses import EntropyMode, HeadReduction, attention_entropy, entropy_penalty, prior_kl
from attnreg.mixin import TermFunction, require_mixin


class AttentionLoss(L.Callback):
    """Adds `weight * fn(probs, batch)` to the training loss, logged as `attnreg/<name>`.

    `fn` receives the captured attention of `layers` (None = all) as an `AttentionRecord` and the
    batch; it returns a scalar tensor. The LightningModule must use `attnreg.AttnRegMixin`.
    """

    def __init__(
        self,
        fn: TermFunction,
        name: str = "attention_loss",
        layers: int | Iterable[int] | None = None,
        weight: float = 1.0,
    ) -> None:
        self.fn = fn
        self.name = name
        self.layers = layers
        self.weight = weight
        self.heads: list[int] | None = None

    def term(self, probs: AttentionRecord, batch: Any) -> torch.Tensor:
        return self.weight * self.fn(probs, batch)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        module = require_mixin(pl_module, self)
        module.remove_attnreg_term(self.name)
        module.add_attnreg_term(self.name, self.term, layers=self.layers)
        self.layers = module.attnreg_terms[self.name].layers
        self.causal = module.attnreg_hub.family.causal
        if self.heads is not None:
            for layer in self.layers:
                count = module.attnreg_hub.layers[layer].num_heads
                if not all(0 <= head < count for head in self.heads):
                    raise IndexError(
                        f"{type(self).__name__}: heads={list(self.heads)} out of range for layer "
                        f"{layer}, which has {count} heads"
                    )

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pl_module.remove_attnreg_term(self.name)


class EntropyRegularizer(AttentionLoss):
    """Entropy regularization of attention heads.

    `mode="min"` sharpens, `"max"` flattens (EAR), `"target"` keeps each head (or each layer's head
    mean, `per="layer"`) inside `band=(lo, hi)`. Entropies are normalized by log(admissible keys)
    unless `normalize=False`; `heads` limits the loss to some heads of every chosen layer.

    Example:
        >>> attnreg.EntropyRegularizer(mode="target", band=(0.3, 0.8), layers=[4, 5], weight=0.1)
    """

    def __init__(
        self,
        mode: EntropyMode = "min",
        weight: float = 0.01,
        layers: int | Iterable[int] | None = None,
        heads: Iterable[int] | None = None,
        band: tuple[float, float] | None = None,
        per: str = "head",
        normalize: bool = True,
        name: str = "entropy",
    ) -> None:
        entropy_penalty(torch.zeros(1), mode, band, per)  # validate the options now, not at step one
        super().__init__(self._penalty, name=name, layers=layers, weight=weight)
        self.mode, self.band, self.per, self.normalize = mode, band, per, normalize
        self.heads = None if heads is None else list(heads)

    def _penalty(self, probs: AttentionRecord, batch: Any) -> torch.Tensor:
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        entropies = []
        for layer in self.layers:
            entropy = attention_entropy(probs[layer], mask, causal=self.causal, normalize=self.normalize)
            entropies.append(entropy if self.heads is None else entropy[self.heads])
        return entropy_penalty(torch.stack(entropies), self.mode, self.band, self.per)


class SyntaxPriorKL(AttentionLoss):
    """KL(prior ‖ attention) for chosen heads, with the prior read from the batch.

    The batch (a dict) carries `batch[prior_key]`: one-hot key indices `[B, T]` (-1 = row left out)
    or dense rows `[B, T, S]`, aligned with the model's tokens (the syntax pipeline builds them).

    Example:
        >>> attnreg.SyntaxPriorKL(weight=1.0, layers=[0, 1], heads=[0])
    """

    def __init__(
        self,
        weight: float = 1.0,
        layers: int | Iterable[int] | None = None,
        heads: Iterable[int] | None = None,
        reduction: HeadReduction = "mean_heads",
        prior_key: str = "attnreg_prior",
        name: str = "prior_kl",
    ) -> None:
        super().__init__(self._kl, name=name, layers=layers, weight=weight)
        if reduction not in ("mean_heads", "mean_attention"):
            raise ValueError(f"reduction must be 'mean_heads' or 'mean_attention', got {reduction!r}")
        self.heads = None if heads is None else list(heads)
        self.reduction, self.prior_key = reduction, prior_key

    def _kl(self, probs: AttentionRecord, batch: Any) -> torch.Tensor:
        if not isinstance(batch, dict) or self.prior_key not in batch:
            keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise KeyError(
                f"{type(self).__name__} reads the prior from batch[{self.prior_key!r}]; the batch has {keys}"
            )
        prior = batch[self.prior_key]
        losses = [prior_kl(probs[layer], prior, self.heads, self.reduction) for layer in self.layers]
        return torch.stack(losses).mean()
