"""Attention-entropy regularization as a method: sharpen, flatten, or hold heads in a target band.

The functional form is `attnreg.losses.entropy_penalty` on `attnreg.losses.attention_entropy` (materialized
probabilities) or `attnreg.blockwise.attention_entropy` (from queries and keys, in blocks).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from attnreg import blockwise
from attnreg.losses import EntropyMode, admissible_keys, attention_entropy, entropy_penalty
from attnreg.methods.loss_term import Heads, LossTerm
from attnreg.methods.registry import register_method
from attnreg.records import AttentionRecord
from attnreg.schedules import ScheduleLike


@register_method(docs="methods/entropy.md")
class EntropyRegularizer(LossTerm):
    """Entropy regularization of attention heads.

    `mode="min"` sharpens, `"max"` flattens (EAR), `"target"` keeps each head (or each layer's head
    mean, `per="layer"`) inside `target=(lo, hi)`. Entropies are normalized by log(admissible keys)
    unless `normalize=False`; `heads` limits the loss to some heads of every chosen layer. Logs the
    mean entropy of each layer as `<name>/layer<l>`. With `blockwise` (the default) the layers stay on
    SDPA and the entropies are recomputed in blocks (`attnreg.blockwise`: the same values and gradients,
    nothing of size `[T, S]` kept); `blockwise=False` materializes the attention instead.

    Example:
        >>> import torch, attnreg
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("gpt2")
        >>> entropy = EntropyRegularizer(mode="target", target=(0.3, 0.8), layers=[1], weight=0.1)
        >>> entropy.bind(model); entropy.start(100)
        >>> batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attention_mask": torch.ones(1, 4)}
        >>> with attnreg.attach(model).capture(entropy.layers, inputs=True) as record:
        ...     _ = model(**batch)
        >>> value, logs = entropy.term(record, batch, step=0)      # random weights: near uniform, above 0.8
        >>> float(value) > 0, list(logs)
        (True, ['entropy_regularizer/layer1'])
        >>> with attnreg.attach(model).capture(entropy.layers) as probs:   # probabilities: the wrong kind
        ...     _ = model(**batch)
        >>> entropy.term(probs, batch, step=0)
        Traceback (most recent call last):
        TypeError: EntropyRegularizer 'entropy_regularizer' (blockwise=True) reads layer 1 as captured by ...
    """

    default_name = "entropy_regularizer"

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
        blockwise: bool = True,
    ) -> None:
        target = None if target is None else tuple(target)
        entropy_penalty(torch.zeros(1), mode, target, per)  # validate the options now, not at step one
        super().__init__(name, layers, weight, heads)
        self.mode, self.target, self.per, self.normalize = mode, target, per, normalize
        self.inputs = blockwise

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "mode": self.mode, "target": self.target}

    def items(self, batch: Any) -> int | None:
        """The query rows the term is a mean over in `batch` (real tokens; with `normalize`, those with more than
        one key to attend to); None for `mode="target"`, which is no mean over rows."""
        if self.mode == "target" or not isinstance(batch, dict) or "input_ids" not in batch:
            return None
        shape = batch["input_ids"].shape
        rows, counts = admissible_keys(
            batch.get("attention_mask"), torch.Size((*shape[:1], 1, *shape[1:2] * 2)), self.causal
        )
        return int((rows & (counts > 1)).sum() if self.normalize else rows.sum())

    def value(self, probs: AttentionRecord, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        active = self.active_heads()
        entropies = []
        for layer, heads in active.items():
            if self.inputs:
                captured = self.captured(probs, layer)
                entropies.append(blockwise.attention_entropy(captured, mask, self.causal, self.normalize, heads))
                continue
            captured = self.captured(probs, layer)  # the layer's own mask counts its keys (sliding windows)
            layer_mask = probs.attention_mask(layer) if isinstance(probs, AttentionRecord) else None
            sink = isinstance(probs, AttentionRecord) and probs.has_sink(layer)  # gpt-oss: the sink is one more outcome
            entropy = attention_entropy(captured, mask, self.causal, self.normalize, layer_mask, sink)
            entropies.append(entropy if heads is None else entropy[heads])
        if not entropies:
            return torch.zeros((), device=next(self.model.parameters()).device), {}
        logs = self.layer_figures(active, torch.stack([entropy.mean() for entropy in entropies]))
        if self.per == "layer" or len({len(entropy) for entropy in entropies}) == 1:
            return entropy_penalty(torch.stack(entropies), self.mode, self.target, self.per), logs
        return torch.stack([entropy_penalty(entropy, self.mode, self.target) for entropy in entropies]).mean(), logs
