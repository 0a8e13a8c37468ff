"""The syntax-prior KL as a method: chosen heads pulled toward a distribution built from a dependency parse.

The functional form is `attnreg.losses.prior_kl` (materialized probabilities) or `attnreg.blockwise.prior_kl`
(from queries and keys, in blocks); the prior comes from `attnreg.syntax` (`SyntaxCollator`, `SyntaxPrior`).

Example:
    >>> import torch, attnreg
    >>> from attnreg.schedules import Linear
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("bert")                                      # 2 layers x 4 heads
    >>> kl = SyntaxPriorKL(weight=Linear(1.0, 0.5), heads={0: [3], 1: [2]})
    >>> kl.bind(model); kl.start(1000)                                  # 1,000 optimizer steps in all
    >>> batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attnreg_prior": torch.tensor([[1, -1, 1, 2]])}
    >>> with attnreg.attach(model).capture(kl.layers, inputs=kl.inputs) as record:
    ...     loss = model(input_ids=batch["input_ids"]).last_hidden_state.pow(2).mean()
    >>> value, logs = kl.term(record, batch, step=500)                  # weighted at 0.75
    >>> loss = loss + value; sorted(logs)
    ['syntax_prior_kl/layer0', 'syntax_prior_kl/layer1']
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from attnreg import blockwise
from attnreg.hub import AttentionRecord
from attnreg.losses import HeadReduction, prior_kl
from attnreg.methods.loss_term import Heads, LossTerm
from attnreg.schedules import ScheduleLike
from attnreg.syntax.data import PRIOR_KEY


class SyntaxPriorKL(LossTerm):
    """KL(prior ‖ attention) for chosen heads, with the prior read from the batch.

    The batch (a dict) carries `batch[prior_key]` (default "attnreg_prior"): key indices `[B, T]`
    (-1 = row left out) or dense rows `[B, T, S]`, aligned with the model's tokens, as
    `attnreg.syntax.SyntaxCollator` builds them. For decoders the prior is restricted to earlier keys.
    `head_reduction`: "mean_heads" (mean of per-head KLs) or "mean_attention" (KL of the head mean).
    `blockwise` as for `EntropyRegularizer`.

    Example:
        >>> SyntaxPriorKL(weight=1.0, layers=[0, 1], heads=[0]).layers          # head 0 of layers 0 and 1
        [0, 1]
        >>> SyntaxPriorKL(heads={0: [3], 1: [4], 2: [8]}).layers                # one chosen head per layer
        [0, 1, 2]
    """

    default_name = "syntax_prior_kl"
    needs = frozenset({"prior"})

    def __init__(
        self,
        weight: ScheduleLike = 1.0,
        layers: int | Iterable[int] | None = None,
        heads: Heads = None,
        head_reduction: HeadReduction = "mean_heads",
        prior_key: str = PRIOR_KEY,
        name: str | None = None,
        blockwise: bool = True,
    ) -> None:
        if head_reduction not in ("mean_heads", "mean_attention"):
            raise ValueError(f"head_reduction must be 'mean_heads' or 'mean_attention', got {head_reduction!r}")
        super().__init__(name, layers, weight, heads)
        self.head_reduction, self.prior_key = head_reduction, prior_key
        self.batch_keys = (prior_key,)
        self.inputs = blockwise

    def value(self, probs: AttentionRecord, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if not isinstance(batch, dict) or self.prior_key not in batch:
            keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise KeyError(
                f"{type(self).__name__} reads the prior from batch[{self.prior_key!r}]; the batch has {keys}. "
                "Build batches with attnreg.syntax.SyntaxCollator (or put your own prior under that key)."
            )
        prior = batch[self.prior_key]
        active = self.active_heads()
        if not active:
            return torch.zeros((), device=next(self.model.parameters()).device), {}
        kl = blockwise.prior_kl if self.inputs else prior_kl
        losses = torch.stack(
            [  # the prior's values are checked once per batch, with the first layer (one sync, not one a layer)
                kl(self.captured(probs, layer), prior, heads, self.head_reduction, self.causal, check_values=i == 0)
                for i, (layer, heads) in enumerate(active.items())
            ]
        )
        return losses.mean(), self.layer_figures(active, losses)
