"""Attention priors from dependency trees, first over words, then spread over model tokens.

Kinds (each row a distribution over the key words a query word should attend to):
- `parent`: one-hot on the head word; the root row is left out (`root="exclude"`) or attends to
  itself (`root="self"`);
- `neighbors`: uniform over the parent and the children;
- `tree_distance`: softmax of -distance/temperature over all other words of the tree.

Over tokens, every piece of a query word gets the word's row (`query_pieces="all"`) or only its
first piece does (`"first"`); the mass on a key word goes to its first piece (`key_pieces="first"`)
or is spread evenly over its pieces (`"spread"`). Special tokens, padding and dropped words get none.
A parent prior on first pieces is one-hot, returned compactly as key indices `[T]` (-1 = row left
out), the form `attnreg.losses.prior_kl` reads fastest; others are dense `[T, T]`. Rows are never
restricted causally here: `prior_kl(..., causal=True)` does that for decoders.

Example:
    >>> prior = SyntaxPrior("parent")
    >>> prior(sentence.heads, alignment)      # [T] key index per query token, -1 where left out
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from attnreg.syntax.align import Alignment

PriorKind = Literal["parent", "neighbors", "tree_distance"]
_CHOICES = {
    "kind": ("parent", "neighbors", "tree_distance"),
    "root": ("exclude", "self"),
    "key_pieces": ("first", "spread"),
    "query_pieces": ("all", "first"),
}


def word_prior(
    heads: Sequence[int], kind: PriorKind = "parent", root: str = "exclude", temperature: float = 1.0
) -> np.ndarray:
    """The prior over words `[n, n]` (row = query word) from 1-based `heads` (0 = root)."""
    heads = np.asarray(heads, dtype=np.int64)
    count = len(heads)
    words = np.arange(count)
    dependents = words[heads > 0]
    prior = np.zeros((count, count), dtype=np.float32)
    if kind == "parent":
        prior[dependents, heads[dependents] - 1] = 1.0
        if root == "self":
            prior[words[heads == 0], words[heads == 0]] = 1.0
        return prior
    if kind == "neighbors":
        prior[dependents, heads[dependents] - 1] = 1.0
        prior[heads[dependents] - 1, dependents] = 1.0
        return _normalize_rows(prior)
    if kind == "tree_distance":
        logits = -tree_distances(heads).astype(np.float32) / temperature
        np.fill_diagonal(logits, -np.inf)
        if count == 1:
            return prior
        logits -= logits.max(-1, keepdims=True)
        return _normalize_rows(np.exp(logits))
    raise ValueError(f"kind must be one of {_CHOICES['kind']}, got {kind!r}")


def tree_distances(heads: Sequence[int]) -> np.ndarray:
    """Number of arcs between every pair of words `[n, n]` of the tree given by 1-based `heads`."""
    heads = np.asarray(heads, dtype=np.int64)
    count = len(heads)
    # ancestors[i, k]: k is i or an ancestor of i; filled by following heads up, one level per pass.
    ancestors = np.eye(count, dtype=bool)
    frontier = np.arange(count)
    while True:
        alive = frontier >= 0
        if not alive.any():
            break
        frontier = np.where(alive, heads[np.maximum(frontier, 0)] - 1, -1)
        rows = np.flatnonzero(frontier >= 0)
        ancestors[rows, frontier[rows]] = True
    depth = ancestors.sum(1) - 1
    common = ancestors.astype(np.int64) @ ancestors.T.astype(np.int64)  # depth of the lowest common ancestor + 1
    return depth[:, None] + depth[None, :] - 2 * (common - 1)


@dataclass(frozen=True)
class SyntaxPrior:
    """How to turn a tree and an alignment into a token-level prior (see the module docstring).

    Example:
        >>> SyntaxPrior("tree_distance", temperature=0.5, key_pieces="spread")(heads, alignment)  # [T, T]
    """

    kind: PriorKind = "parent"
    root: str = "exclude"
    temperature: float = 1.0
    key_pieces: str = "first"
    query_pieces: str = "all"

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"SyntaxPrior: {name} must be one of {choices}, got {getattr(self, name)!r}")
        if not self.temperature > 0:
            raise ValueError(f"SyntaxPrior: temperature must be > 0, got {self.temperature}")

    @property
    def one_hot(self) -> bool:
        """True when the prior is built as key indices `[T]` rather than dense rows `[T, T]`."""
        return self.kind == "parent" and self.key_pieces == "first"

    def __call__(self, heads: Sequence[int], alignment: Alignment) -> np.ndarray:
        if len(heads) != alignment.num_words:
            raise ValueError(f"{len(heads)} heads for an alignment of {alignment.num_words} words")
        if self.one_hot:
            return self._parent_indices(np.asarray(heads, dtype=np.int64), alignment)
        return self._dense(word_prior(heads, self.kind, self.root, self.temperature), alignment)

    def _query_words(self, alignment: Alignment) -> np.ndarray:
        """Word of each query token that gets a prior row (-1 elsewhere)."""
        token_word = alignment.token_word
        if self.query_pieces == "all":
            return token_word
        first = np.full_like(token_word, -1)
        kept = alignment.first_piece[alignment.first_piece >= 0]
        first[kept] = token_word[kept]
        return first

    def _parent_indices(self, heads: np.ndarray, alignment: Alignment) -> np.ndarray:
        first_piece = alignment.first_piece
        target_word = np.where(heads > 0, heads - 1, np.arange(len(heads)) if self.root == "self" else -1)
        target = np.where(target_word >= 0, first_piece[np.maximum(target_word, 0)], -1)
        query_word = self._query_words(alignment)
        return np.where(query_word >= 0, target[np.maximum(query_word, 0)], -1)

    def _dense(self, prior: np.ndarray, alignment: Alignment) -> np.ndarray:
        token_word = alignment.token_word
        pieces = alignment.pieces
        if self.key_pieces == "spread":
            key_weight = np.where(token_word >= 0, 1.0 / np.maximum(pieces[np.maximum(token_word, 0)], 1), 0.0)
        else:
            key_weight = np.zeros(len(token_word))
            key_weight[alignment.first_piece[alignment.first_piece >= 0]] = 1.0
        prior = prior * (pieces > 0)[None, :]  # no mass on dropped words
        query_word = self._query_words(alignment)
        rows = prior[np.maximum(query_word, 0)][:, np.maximum(token_word, 0)]
        rows *= key_weight[None, :].astype(np.float32)
        rows[query_word < 0] = 0.0
        return _normalize_rows(rows)


def _normalize_rows(rows: np.ndarray) -> np.ndarray:
    totals = rows.sum(-1, keepdims=True)
    return np.divide(rows, totals, out=np.zeros_like(rows), where=totals > 0)
