"""Word-to-subword alignment: which syntactic word each model token belongs to.

Works from a fast tokenizer's character offsets (`return_offsets_mapping=True`) on the sentence's own
text, so the model sees its natural tokenization, for WordPiece, byte-level BPE (where a token's span
may start with the space before the word) and SentencePiece-style tokenizers alike. A token belongs
to the word holding its first non-space character; special tokens (empty spans) and padding belong
to no word. A word is kept only when its tokens cover it to its last character, so a word cut by
truncation loses all its tokens, and the arcs touching it are dropped (counted in `dropped_words`).

Example:
    >>> from attnreg.app.task import build_tokenizer
    >>> sentence = Sentence("s1", ("Keys", "rattle", "."), (2, 0, 2), ("nsubj", "root", "punct"), "Keys rattle.")
    >>> tokenizer = build_tokenizer(["Keys", "rattle", "."])
    >>> encoding = tokenizer(sentence.text, return_offsets_mapping=True)
    >>> alignment = align_offsets(sentence, encoding["offset_mapping"])
    >>> alignment.token_word          # [CLS] w0 w1 w2 [SEP]
    array([-1,  0,  1,  2, -1])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from attnreg.syntax.trees import Sentence


class AlignmentError(ValueError):
    """The words of a parse cannot be matched to its text or to the tokens.

    Example:
        >>> word_spans(Sentence("s1", ("Keys", "rattle"), (2, 0), ("nsubj", "root"), "Keys jangle"))
        Traceback (most recent call last):
        ...
        attnreg.syntax.align.AlignmentError: sent_id s1: word 'rattle' does not occur in the text after character 4; ...
    """


@dataclass(frozen=True)
class Alignment:
    """`token_word[t]`: the 0-based word of token t, or -1 (special token, padding, cut word).

    `num_words` counts the sentence's words; `dropped_words` those with no token (cut by truncation,
    or sharing a single token with a neighbour, as "a.b" might).

    Example:
        >>> alignment = Alignment(token_word=np.array([-1, 0, 1, 1, 2, -1]), num_words=4)   # [CLS] w0 w1 w1 w2 [SEP]
        >>> alignment.pieces, alignment.first_piece, alignment.dropped_words
        (array([1, 2, 1, 0]), array([ 1,  2,  4, -1]), 1)
    """

    token_word: np.ndarray
    num_words: int

    @property
    def pieces(self) -> np.ndarray:
        """Number of tokens of each word `[num_words]` (0 for a dropped word)."""
        kept = self.token_word[self.token_word >= 0]
        return np.bincount(kept, minlength=self.num_words)

    @property
    def dropped_words(self) -> int:
        return int((self.pieces == 0).sum())

    @property
    def first_piece(self) -> np.ndarray:
        """Token index of each word's first piece `[num_words]` (-1 for a dropped word)."""
        first = np.full(self.num_words, -1, dtype=np.int64)
        tokens = np.flatnonzero(self.token_word >= 0)
        words = self.token_word[tokens]
        # Reversed assignment leaves each word's smallest token index in place.
        first[words[::-1]] = tokens[::-1]
        return first


def word_spans(sentence: Sentence) -> tuple[tuple[int, int], ...]:
    """Character span of every word in `sentence.text`: `sentence.spans` if set, else the words
    searched for in order. Raises `AlignmentError` naming the sentence when a word is not found.

    Example:
        >>> word_spans(Sentence("s1", ("Keys", "rattle", "."), (2, 0, 2), ("nsubj", "root", "punct"), "Keys rattle."))
        ((0, 4), (5, 11), (11, 12))
    """
    if sentence.spans is not None:
        if len(sentence.spans) != len(sentence.words):
            raise AlignmentError(f"{sentence.where}: {len(sentence.spans)} spans for {len(sentence.words)} words")
        return sentence.spans
    spans, position = [], 0
    for word in sentence.words:
        start = sentence.text.find(word, position)
        if start < 0:
            raise AlignmentError(
                f"{sentence.where}: word {word!r} does not occur in the text after character {position}; "
                f"the parse's words do not match the text {sentence.text!r}"
            )
        position = start + len(word)
        spans.append((start, position))
    return tuple(spans)


def align_offsets(sentence: Sentence, offsets: Sequence[Sequence[int]] | np.ndarray) -> Alignment:
    """Align the tokens of `sentence.text`, given by their character `offsets` `[T, 2]`, to its words.

    Example:
        >>> words, relations = ("The", "keys", "are", "here", "."), ("det", "nsubj", "cop", "root", "punct")
        >>> sentence = Sentence("s1", words, (2, 4, 4, 0, 4), relations, "The keys are here.")
        >>> offsets = [(0, 0), (0, 3), (4, 6), (6, 8), (9, 12), (13, 17), (17, 18), (0, 0)]   # "keys" = "ke" + "ys"
        >>> align_offsets(sentence, offsets).token_word
        array([-1,  0,  1,  1,  2,  3,  4, -1])
        >>> align_offsets(sentence, offsets[:4] + [(0, 0)]).token_word      # truncated after "keys"
        array([-1,  0,  1,  1, -1])
    """
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    spans = np.asarray(word_spans(sentence), dtype=np.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]
    # The first word ending after each token's start holds the token's first word character (spans are
    # in order); the token owns that word if the character lies inside the token, so a leading space of
    # a byte-level BPE token is skipped and special tokens (empty spans) own nothing.
    word = np.minimum(np.searchsorted(spans[:, 1], starts, side="right"), len(spans) - 1)
    first_char = np.maximum(starts, spans[word, 0])
    owned = (ends > starts) & (first_char < ends) & (first_char < spans[word, 1])
    token_word = np.where(owned, word, -1)
    # A word whose tokens stop before its last character was cut by truncation: drop it whole.
    reach = np.full(len(spans), -1, dtype=np.int64)
    np.maximum.at(reach, token_word[owned], ends[owned])
    cut = reach < spans[:, 1]
    token_word = np.where((token_word >= 0) & cut[np.maximum(token_word, 0)], -1, token_word)
    return Alignment(token_word=token_word, num_words=len(spans))


def align_word_ids(word_ids: Sequence[int | None], num_words: int, truncated: bool = False) -> Alignment:
    """Alignment from a fast tokenizer's `word_ids()` (input tokenized with `is_split_into_words=True`).

    With `truncated=True` the last word present may be cut, so it is dropped too.

    Example:
        >>> align_word_ids([None, 0, 1, 1, 2, None], num_words=3).pieces
        array([1, 2, 1])
        >>> align_word_ids([None, 0, 1, 1, None], num_words=3, truncated=True).token_word
        array([-1,  0, -1, -1, -1])
    """
    token_word = np.array([-1 if word is None else word for word in word_ids], dtype=np.int64)
    if token_word.max(initial=-1) >= num_words:
        raise AlignmentError(f"word_ids refer to word {token_word.max()}, but the sentence has {num_words} words")
    if truncated and (token_word >= 0).any():
        token_word[token_word == token_word.max()] = -1
    return Alignment(token_word=token_word, num_words=num_words)


def dropped_arcs(alignment: Alignment, heads: Sequence[int]) -> int:
    """Arcs (dependent to head, the root excluded) with a dropped end: those a prior cannot represent.

    Example:
        >>> alignment = align_word_ids([None, 0, 1, None], num_words=3)      # word 2 has no token
        >>> dropped_arcs(alignment, heads=[2, 0, 2])                         # only 3 -> 2 is lost
        1
    """
    kept = alignment.pieces > 0
    heads = np.asarray(heads, dtype=np.int64)
    has_head = heads > 0
    return int((has_head & ~(kept & kept[np.maximum(heads - 1, 0)])).sum())
