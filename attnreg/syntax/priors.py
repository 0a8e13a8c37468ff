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

A padded batch is built in one vectorized pass (`SyntaxPrior.batch`, what `SyntaxCollator` calls):
the per-sentence Python work is the alignment alone.

Example:
    >>> from attnreg.syntax.align import align_word_ids
    >>> heads = [2, 0, 2]                                           # "Keys rattle ."
    >>> alignment = align_word_ids([None, 0, 0, 1, 2, None], num_words=3)   # [CLS] Ke ys rattle . [SEP]
    >>> prior = SyntaxPrior("parent")
    >>> prior(heads, alignment)      # [T] key index per query token, -1 where left out
    array([-1,  3,  3, -1,  3, -1])
    >>> prior.batch([heads, heads], [alignment, alignment]).shape   # [B, T]
    (2, 6)
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
    """The prior over words `[n, n]` (row = query word) from 1-based `heads` (0 = root).

    Example:
        >>> word_prior([2, 0, 2])                       # the root's row is left out
        array([[0., 1., 0.],
               [0., 0., 0.],
               [0., 1., 0.]], dtype=float32)
        >>> word_prior([2, 0, 2], kind="neighbors")[1]  # the root attends to its children
        array([0.5, 0. , 0.5], dtype=float32)
    """
    return word_priors(pad_heads([heads]), kind, root, temperature)[0]


def pad_heads(heads: Sequence[Sequence[int]]) -> np.ndarray:
    """1-based heads of several sentences as one array `[B, N]`, -1 after each sentence's last word.

    Example:
        >>> pad_heads([[2, 0], [0, 1, 1]])
        array([[ 2,  0, -1],
               [ 0,  1,  1]])
    """
    padded = np.full((len(heads), max((len(h) for h in heads), default=0)), -1, dtype=np.int64)
    for row, sentence_heads in enumerate(heads):
        padded[row, : len(sentence_heads)] = sentence_heads
    return padded


def word_priors(
    heads: np.ndarray, kind: PriorKind = "parent", root: str = "exclude", temperature: float = 1.0
) -> np.ndarray:
    """`word_prior` for a batch: `heads` `[B, N]` from `pad_heads`; returns `[B, N, N]` (padding words get none).

    Example:
        >>> priors = word_priors(pad_heads([[2, 0], [0, 1, 1]]), kind="tree_distance")
        >>> priors.shape, float(priors[0, 2].sum())     # a padding word's row is empty
        ((2, 3, 3), 0.0)
    """
    batch, count = heads.shape
    prior = np.zeros((batch, count, count), dtype=np.float32)
    sentence, dependent = np.nonzero(heads > 0)
    head = heads[sentence, dependent] - 1
    if kind == "parent":
        prior[sentence, dependent, head] = 1.0
        if root == "self":
            roots = np.nonzero(heads == 0)
            prior[roots[0], roots[1], roots[1]] = 1.0
        return prior
    if kind == "neighbors":
        prior[sentence, dependent, head] = 1.0
        prior[sentence, head, dependent] = 1.0
        return _normalize_rows(prior)
    if kind == "tree_distance":
        words = heads >= 0
        allowed = words[:, :, None] & words[:, None, :] & ~np.eye(count, dtype=bool)
        logits = np.where(allowed, -tree_distances_batch(heads).astype(np.float32) / temperature, -np.inf)
        top = logits.max(-1, keepdims=True, initial=-np.inf)
        prior = np.exp(logits - np.where(np.isfinite(top), top, 0.0), where=allowed, out=prior)
        return _normalize_rows(prior)
    raise ValueError(f"kind must be one of {_CHOICES['kind']}, got {kind!r}")


def tree_distances(heads: Sequence[int]) -> np.ndarray:
    """Number of arcs between every pair of words `[n, n]` of the tree given by 1-based `heads`.

    Example:
        >>> tree_distances([2, 0, 2])
        array([[0, 1, 2],
               [1, 0, 1],
               [2, 1, 0]])
    """
    return tree_distances_batch(pad_heads([heads]))[0]


def tree_distances_batch(heads: np.ndarray) -> np.ndarray:
    """`tree_distances` for `heads` `[B, N]` from `pad_heads`: `[B, N, N]` (meaningless for padding words).

    Example:
        >>> tree_distances_batch(pad_heads([[2, 0, 2], [0, 1]]))[1, :2, :2]
        array([[0, 1],
               [1, 0]])
    """
    batch, count = heads.shape
    sentence = np.arange(batch)[:, None]
    # ancestors[b, i, k]: k is i or an ancestor of i; filled by following heads up, one level per pass.
    ancestors = np.broadcast_to(np.eye(count, dtype=np.float32), (batch, count, count)).copy()
    frontier = np.where(heads > 0, np.arange(count)[None, :], -1)
    while (frontier >= 0).any():
        frontier = np.where(frontier >= 0, heads[sentence, np.maximum(frontier, 0)] - 1, -1)
        rows, words = np.nonzero(frontier >= 0)
        ancestors[rows, words, frontier[rows, words]] = 1.0
    depth = ancestors.sum(-1) - 1
    common = ancestors @ ancestors.transpose(0, 2, 1)  # depth of the lowest common ancestor + 1 (exact in float32)
    return (depth[:, :, None] + depth[:, None, :] - 2 * (common - 1)).astype(np.int64)


@dataclass(frozen=True)
class SyntaxPrior:
    """How to turn a tree and an alignment into a token-level prior (see the module docstring).

    Example:
        >>> from attnreg.syntax.align import align_word_ids
        >>> alignment = align_word_ids([None, 0, 0, 1, 2, None], num_words=3)   # [CLS] Ke ys rattle . [SEP]
        >>> SyntaxPrior("parent", key_pieces="spread").one_hot
        False
        >>> SyntaxPrior("tree_distance", temperature=0.5, key_pieces="spread")([2, 0, 2], alignment).shape  # [T, T]
        (6, 6)
        >>> SyntaxPrior("parent", query_pieces="first")([2, 0, 2], alignment)    # only "Ke" speaks for "Keys"
        array([-1,  3, -1, -1,  3, -1])
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
        return self.batch([heads], [alignment])[0]

    def batch(self, heads: Sequence[Sequence[int]], alignments: Sequence[Alignment]) -> np.ndarray:
        """Priors of several sentences at once, their alignments over the same `T` tokens (a padded
        batch): `[B, T]` key indices (`one_hot`) or `[B, T, T]` rows. One vectorized pass for the batch.

        Example:
            >>> from attnreg.syntax.align import align_word_ids
            >>> alignments = [align_word_ids([None, 0, 1, 2, None], 3), align_word_ids([None, 0, 1, None, None], 2)]
            >>> SyntaxPrior("tree_distance").batch([[2, 0, 2], [0, 1]], alignments).shape   # [B, T, T]
            (2, 5, 5)
        """
        for sentence_heads, alignment in zip(heads, alignments, strict=True):
            if len(sentence_heads) != alignment.num_words:
                raise ValueError(f"{len(sentence_heads)} heads for an alignment of {alignment.num_words} words")
        padded = pad_heads(heads)
        tokens = _Tokens.of(alignments, padded.shape[1])
        if self.one_hot:
            return self._parent_indices(padded, tokens)
        return self._dense(word_priors(padded, self.kind, self.root, self.temperature), tokens)

    def _query_words(self, tokens: _Tokens) -> np.ndarray:
        """Word of each query token that gets a prior row `[B, T]` (-1 elsewhere)."""
        if self.query_pieces == "all":
            return tokens.word
        first = np.full_like(tokens.word, -1)
        sentence, word = np.nonzero(tokens.first_piece >= 0)
        first[sentence, tokens.first_piece[sentence, word]] = word
        return first

    def _parent_indices(self, heads: np.ndarray, tokens: _Tokens) -> np.ndarray:
        sentence = np.arange(len(heads))[:, None]
        own = np.broadcast_to(np.arange(heads.shape[1]), heads.shape)
        target_word = np.where(heads > 0, heads - 1, own if self.root == "self" else -1)
        target_word = np.where(heads >= 0, target_word, -1)
        target = np.where(target_word >= 0, tokens.first_piece[sentence, np.maximum(target_word, 0)], -1)
        query_word = self._query_words(tokens)
        return np.where(query_word >= 0, target[sentence, np.maximum(query_word, 0)], -1)

    def _dense(self, prior: np.ndarray, tokens: _Tokens) -> np.ndarray:
        sentence = np.arange(len(prior))[:, None]
        word = np.maximum(tokens.word, 0)
        if self.key_pieces == "spread":
            key_weight = np.where(tokens.word >= 0, 1.0 / np.maximum(tokens.pieces[sentence, word], 1), 0.0)
        else:
            key_weight = np.zeros(tokens.word.shape)
            first_sentence, first_word = np.nonzero(tokens.first_piece >= 0)
            key_weight[first_sentence, tokens.first_piece[first_sentence, first_word]] = 1.0
        query_word = self._query_words(tokens)
        # Keys of special tokens, padding and dropped words have weight 0, so they get no mass.
        rows = prior[sentence[:, :, None], np.maximum(query_word, 0)[:, :, None], word[:, None, :]]
        rows *= key_weight[:, None, :].astype(np.float32)
        rows[query_word < 0] = 0.0
        return _normalize_rows(rows)


@dataclass(frozen=True)
class _Tokens:
    """The alignments of a batch as arrays: `word` `[B, T]` (`token_word`), `pieces` and
    `first_piece` `[B, N]` (0 and -1 for dropped and padding words)."""

    word: np.ndarray
    pieces: np.ndarray
    first_piece: np.ndarray

    @classmethod
    def of(cls, alignments: Sequence[Alignment], num_words: int) -> _Tokens:
        lengths = {len(alignment.token_word) for alignment in alignments}
        if len(lengths) > 1:
            raise ValueError(f"alignments of one batch must cover the same number of tokens, got {sorted(lengths)}")
        word = np.stack([alignment.token_word for alignment in alignments]).reshape(len(alignments), -1)
        sentence, token = np.nonzero(word >= 0)
        flat = sentence * num_words + word[sentence, token]
        pieces = np.bincount(flat, minlength=len(alignments) * num_words).reshape(-1, num_words)
        first_piece = np.full(len(alignments) * num_words, -1, dtype=np.int64)
        first_piece[flat[::-1]] = token[::-1]  # reversed: each word keeps its smallest token index
        return cls(word, pieces, first_piece.reshape(-1, num_words))


def _normalize_rows(rows: np.ndarray) -> np.ndarray:
    totals = rows.sum(-1, keepdims=True)
    return np.divide(rows, totals, out=np.zeros_like(rows), where=totals > 0)
