"""Attention analysis: word-level attention and syntactic (parent) accuracy of every head.

Word-level attention follows Clark et al. 2019: attention *to* a word is the sum over its pieces,
attention *from* a word the mean over its pieces; special tokens are left out. A head's parent
accuracy is the share of non-root words whose word-level attention row peaks on their gold head.
Everything streams over batches: no attention map outlives its batch.

Example:
    >>> result = parent_accuracy(model, tokenizer, read_conllu("en_ewt-ud-dev.conllu"))
    >>> result.accuracy            # [layers, heads]
    >>> result.best_head()         # (layer, head, accuracy)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from attnreg.hub import attach
from attnreg.syntax.align import Alignment, align_offsets
from attnreg.syntax.trees import Sentence


def word_attention(probs: torch.Tensor, alignment: Alignment) -> torch.Tensor:
    """Token attention `[..., T, S]` (one sentence, S >= the aligned tokens) to word attention `[..., n, n]`."""
    token_word = torch.as_tensor(alignment.token_word, device=probs.device)
    tokens = token_word.shape[0]
    membership = torch.zeros(tokens, alignment.num_words, dtype=probs.dtype, device=probs.device)
    kept = token_word >= 0
    membership[kept.nonzero().squeeze(-1), token_word[kept]] = 1.0
    pieces = membership.sum(0).clamp_min(1)
    to_words = probs[..., :tokens, :tokens] @ membership  # sum over the key pieces of each word
    return (membership / pieces).T @ to_words  # mean over the query pieces of each word


@dataclass
class ParentAccuracy:
    """Parent-accuracy counts per head, plus the positional baselines on the same words.

    `hits[l, h]` counts words whose head attends most to their gold head; `words` is the number of
    scored words; `offset_hits[k]` the words whose head is k positions away (k = +1: right-branching).
    `by_relation[rel]` holds `(hits [L, H], words)` per dependency relation.
    """

    hits: torch.Tensor
    words: int = 0
    offset_hits: dict[int, int] = field(default_factory=dict)
    by_relation: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)

    @property
    def accuracy(self) -> torch.Tensor:
        """Parent accuracy `[layers, heads]` in [0, 1]."""
        return self.hits / max(self.words, 1)

    def best_head(self) -> tuple[int, int, float]:
        """(layer, head, accuracy) of the head with the highest parent accuracy."""
        accuracy = self.accuracy
        layer, head = divmod(int(accuracy.argmax()), accuracy.shape[1])
        return layer, head, float(accuracy[layer, head])

    def baseline(self, offset: int = 1) -> float:
        """Accuracy of always choosing the word `offset` positions away (+1 = right-branching)."""
        return self.offset_hits.get(offset, 0) / max(self.words, 1)


@torch.no_grad()
def parent_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[Sentence],
    batch_size: int = 32,
    max_length: int | None = 128,
    max_offset: int = 5,
) -> ParentAccuracy:
    """Parent accuracy of every head of `model` over `sentences` with gold trees.

    Words cut by truncation, or without a token of their own, and words whose head is such a word,
    are not scored. The model is attached to the hub and run in eval mode (its mode is restored).
    """
    hub = attach(model)
    heads_per_layer = {info.num_heads for info in hub.layers}
    if len(heads_per_layer) != 1:
        raise ValueError(f"parent_accuracy needs the same head count in every layer, found {sorted(heads_per_layer)}")
    result = ParentAccuracy(hits=torch.zeros(hub.num_layers, heads_per_layer.pop()))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(sentences), batch_size):
            chunk = sentences[start : start + batch_size]
            encoding = tokenizer(
                [s.text for s in chunk],
                padding=True,
                truncation=max_length is not None,
                max_length=max_length,
                return_offsets_mapping=True,
                return_tensors="pt",
            )
            offsets = encoding.pop("offset_mapping").numpy()
            with hub.capture() as probs:
                model(**{key: value.to(device) for key, value in encoding.items()})
            stacked = torch.stack([probs[layer] for layer in range(hub.num_layers)], 1).float().cpu()  # [B, L, H, T, T]
            for row, sentence in enumerate(chunk):
                _score(result, stacked[row], sentence, align_offsets(sentence, offsets[row]), max_offset)
    finally:
        model.train(was_training)
    return result


def _score(result: ParentAccuracy, probs: torch.Tensor, sentence: Sentence, alignment: Alignment, offsets: int) -> None:
    heads = np.asarray(sentence.heads)
    kept = alignment.pieces > 0
    scored = (heads > 0) & kept & kept[np.maximum(heads - 1, 0)]
    if not scored.any():
        return
    words = np.flatnonzero(scored)
    gold = torch.as_tensor(heads[words] - 1)
    predicted = word_attention(probs, alignment)[..., words, :].argmax(-1)  # [L, H, scored words]
    correct = predicted == gold
    result.hits += correct.sum(-1)
    result.words += len(words)
    for offset in range(-offsets, offsets + 1):
        if offset:
            result.offset_hits[offset] = result.offset_hits.get(offset, 0) + int((gold == words + offset).sum())
    relations = np.asarray(sentence.relations)[words]
    for relation in np.unique(relations):
        chosen = torch.as_tensor(relations == relation)
        hits, count = result.by_relation.get(relation, (torch.zeros_like(result.hits), 0))
        result.by_relation[relation] = (hits + correct[..., chosen].sum(-1), count + int(chosen.sum()))
