"""Token importance from attention, and a representation-collapse check on hidden states.

- `token_importance`: the attention the summary token pays to every token, averaged over heads and
  layers: [CLS] (the first token) for encoders, each sequence's last real token for decoders (the token
  a decoder classifier reads).
- `TokenSimilarity`: the mean cosine similarity between the hidden states of the tokens of one
  sequence, per layer. Near 1 means every token carries the same vector (rank collapse, Dong et al.
  2021); anisotropic models (GPT-2's outlier dimensions) read high too.

Example:
    >>> import attnreg
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("bert")
    >>> mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    >>> batch = {"input_ids": torch.tensor([[2, 5, 6, 3], [2, 7, 3, 0]]), "attention_mask": mask}
    >>> with attnreg.attach(model).capture() as probs:
    ...     output = model(**batch, output_hidden_states=True)
    >>> importance = token_importance(probs, batch["attention_mask"])          # [B, T]
    >>> importance.shape, importance.sum(-1)
    (torch.Size([2, 4]), tensor([1.0000, 1.0000], grad_fn=<SumBackward1>))
    >>> similarity = TokenSimilarity.empty(layers=2)
    >>> similarity.update(output.hidden_states, batch["attention_mask"])
    >>> similarity.mean.shape, similarity.collapsed(threshold=0.9)
    (torch.Size([3]), [])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch


def token_importance(
    probs: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Importance of every token `[B, T]`: the summary token's attention to it, mean over heads and layers.

    `probs` holds `[B, H, T, T]` per layer (a `hub.capture` record, a dict or a list). The summary token
    is the first ([CLS]) unless `causal`, then each sequence's last real token. Rows sum to 1 over the
    real tokens.

    Example:
        >>> probs = {0: torch.tensor([[[[0.2, 0.5, 0.3], [0.3, 0.3, 0.4], [0.1, 0.1, 0.8]]]])}   # 1 layer, 1 head
        >>> token_importance(probs)                           # the first token's row
        tensor([[0.2000, 0.5000, 0.3000]])
        >>> token_importance(probs, torch.tensor([[1, 1, 1]]), causal=True)   # the last real token's row
        tensor([[0.1000, 0.1000, 0.8000]])
    """
    layers = list(probs.values()) if isinstance(probs, Mapping) else list(probs)
    if not layers:
        raise ValueError("token_importance needs the attention of at least one layer")
    batch, _, queries, _ = layers[0].shape
    if causal:
        if attention_mask is None:
            rows = torch.full((batch,), queries - 1, dtype=torch.long)
        else:
            rows = (attention_mask.long() * torch.arange(queries)).argmax(-1)
    else:
        rows = torch.zeros(batch, dtype=torch.long)
    index = torch.arange(batch)
    total = sum(layer.float().mean(1)[index, rows.to(layer.device)].cpu() for layer in layers)
    return cast(torch.Tensor, total) / len(layers)


def mean_token_similarity(hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """(sum over sequences of the mean pairwise cosine between their real tokens' states, sequences counted).

    `hidden` is `[..., B, T, D]` (leading dimensions, layers say, are kept in the sums); sequences with
    fewer than two real tokens are not counted.

    Example:
        >>> mean_token_similarity(torch.ones(2, 3, 4))        # two sequences of identical tokens
        (tensor(2.), 2)
    """
    real = torch.ones(hidden.shape[-3:-1], device=hidden.device) if attention_mask is None else attention_mask
    real = real.to(hidden.device, torch.float32)
    hidden = hidden.float()
    unit = hidden * hidden.pow(2).sum(-1, keepdim=True).clamp_min(1e-24).rsqrt() * real[..., None]
    tokens = real.sum(-1)
    pairs = tokens * (tokens - 1)
    total = unit.sum(-2).pow(2).sum(-1) - tokens  # sum over ordered pairs i != j of cos(h_i, h_j)
    counted = pairs > 0
    return (total[..., counted] / pairs[counted]).sum(-1), int(counted.sum())


@dataclass
class TokenSimilarity:
    """Running mean cosine similarity between token states, per layer `[layers + 1]` (0: the embeddings).

    `collapsed(threshold)` lists the layers whose similarity is above `threshold`.

    Example:
        >>> similarity = TokenSimilarity.empty(layers=1)
        >>> states = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]])    # embeddings: spread out
        >>> similarity.update([states, states[:, :1].expand(1, 3, 2)])       # layer 0: one vector for all
        >>> similarity.mean, similarity.collapsed(threshold=0.9)
        (tensor([-0.3333,  1.0000]), [1])
    """

    sums: torch.Tensor
    sequences: torch.Tensor

    @classmethod
    def empty(cls, layers: int) -> TokenSimilarity:
        return cls(torch.zeros(layers + 1, dtype=torch.float64), torch.zeros(layers + 1, dtype=torch.float64))

    def update(self, hidden_states: Sequence[torch.Tensor], attention_mask: torch.Tensor | None = None) -> None:
        """Add one batch: the model's `hidden_states` (`output_hidden_states=True`, embeddings first)."""
        if len(hidden_states) != len(self.sums):
            raise ValueError(f"expected {len(self.sums)} hidden states (embeddings + layers), got {len(hidden_states)}")
        totals, count = mean_token_similarity(torch.stack(tuple(hidden_states)), attention_mask)
        self.sums += totals.double().cpu()
        self.sequences += count

    @property
    def mean(self) -> torch.Tensor:
        return (self.sums / self.sequences.clamp_min(1)).float()

    def collapsed(self, threshold: float = 0.9) -> list[int]:
        """Indices (0 = embeddings, l = output of layer l - 1) whose mean similarity exceeds `threshold`."""
        return [index for index, value in enumerate(self.mean.tolist()) if value > threshold]
