"""Attention priors from dependency trees, first over words, then spread over model tokens.

Kinds (each row a distribution over the key words a query word should attend to):
- `parent`: one-hot on the head word; the root row is left out (`root="exclude"`) or attends to
  itself (`root="self"`);
- `dependents`: uniform over the word's dependents (children); a word without any is left out;
- `neighbors`: uniform over the parent and the children;
- `tree_distance`: softmax of -distance/temperature over all other words of the tree.

`parent` and `dependents` can keep only the arcs of chosen relations (`relations`): `dependents` with
`nsubj` is the verb -> subject row, `parent` with `det` the determiner -> noun row; a word without such an
arc is left out. `subtypes="fold"` compares relations without their subtype (`nsubj:pass` counts as
`nsubj`); `"keep"` compares them whole. A kind may be written as one string (`SyntaxPrior.from_spec`):
`"nsubj"` (dependents by that relation), `"parent:det"`, `"dependents:det,amod"`.
For a decoder the loss keeps only the targets at or before each query (`causal=True`), so `dependents`
becomes the left dependents; rows left with none are left out, and `check_priors` counts them.

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from attnreg.syntax.align import Alignment
from attnreg.syntax.trees import Sentence

PriorKind = Literal["parent", "dependents", "neighbors", "tree_distance"]
_CHOICES = {
    "kind": ("parent", "dependents", "neighbors", "tree_distance"),
    "root": ("exclude", "self"),
    "key_pieces": ("first", "spread"),
    "query_pieces": ("all", "first"),
    "subtypes": ("fold", "keep"),
}
_BY_RELATION = ("parent", "dependents")  # the kinds that can keep only the arcs of chosen relations
# The universal dependency relations of UD v2: a bare spec ("nsubj", "obl:tmod") must name one (subtypes aside).
UD_RELATIONS = frozenset(
    "acl advcl advmod amod appos aux case cc ccomp clf compound conj cop csubj dep det discourse dislocated expl "
    "fixed flat goeswith iobj list mark nmod nsubj nummod obj obl orphan parataxis punct reparandum root vocative "
    "xcomp".split()
)


def word_prior(
    heads: Sequence[int],
    kind: PriorKind = "parent",
    root: str = "exclude",
    temperature: float = 1.0,
    arcs: Sequence[bool] | None = None,
) -> np.ndarray:
    """The prior over words `[n, n]` (row = query word) from 1-based `heads` (0 = root); `arcs` (per word:
    whether its arc to its head is kept; None = all) for `parent` and `dependents`.

    Example:
        >>> word_prior([2, 0, 2])                       # the root's row is left out
        array([[0., 1., 0.],
               [0., 0., 0.],
               [0., 1., 0.]], dtype=float32)
        >>> word_prior([2, 0, 2], kind="neighbors")[1]  # the root attends to its children
        array([0.5, 0. , 0.5], dtype=float32)
        >>> word_prior([2, 0, 2], kind="dependents", arcs=[True, False, False])[1]   # only word 0's arc
        array([1., 0., 0.], dtype=float32)
    """
    padded = None if arcs is None else np.asarray([arcs], dtype=bool)
    return word_priors(pad_heads([heads]), kind, root, temperature, padded)[0]


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
    heads: np.ndarray,
    kind: PriorKind = "parent",
    root: str = "exclude",
    temperature: float = 1.0,
    arcs: np.ndarray | None = None,
) -> np.ndarray:
    """`word_prior` for a batch: `heads` `[B, N]` from `pad_heads`, `arcs` `[B, N]` bool or None; returns
    `[B, N, N]` (padding words get none).

    Example:
        >>> priors = word_priors(pad_heads([[2, 0], [0, 1, 1]]), kind="tree_distance")
        >>> priors.shape, float(priors[0, 2].sum())     # a padding word's row is empty
        ((2, 3, 3), 0.0)
        >>> word_priors(pad_heads([[0, 1, 1]]), kind="dependents")[0, 0]     # spread over both dependents
        array([0. , 0.5, 0.5], dtype=float32)
    """
    batch, count = heads.shape
    prior = np.zeros((batch, count, count), dtype=np.float32)
    if arcs is not None and kind not in _BY_RELATION:
        raise ValueError(f"only the kinds {_BY_RELATION} keep the arcs of chosen relations, not {kind!r}")
    kept = heads > 0 if arcs is None else (heads > 0) & arcs[:, :count]
    sentence, dependent = np.nonzero(kept)
    head = heads[sentence, dependent] - 1
    if kind == "parent":
        prior[sentence, dependent, head] = 1.0
        if root == "self":
            roots = np.nonzero((heads == 0) if arcs is None else (heads == 0) & arcs[:, :count])
            prior[roots[0], roots[1], roots[1]] = 1.0
        return prior
    if kind == "dependents":
        prior[sentence, head, dependent] = 1.0
        return _normalize_rows(prior)
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

    `kind` may also be a spec string (`from_spec`): `SyntaxPrior("nsubj")` is
    `SyntaxPrior("dependents", relations=("nsubj",))`; a bare name must be a kind or a UD relation.

    Example:
        >>> from attnreg.syntax.align import align_word_ids
        >>> alignment = align_word_ids([None, 0, 0, 1, 2, None], num_words=3)   # [CLS] Ke ys rattle . [SEP]
        >>> SyntaxPrior("parent", key_pieces="spread").one_hot
        False
        >>> SyntaxPrior("tree_distance", temperature=0.5, key_pieces="spread")([2, 0, 2], alignment).shape  # [T, T]
        (6, 6)
        >>> SyntaxPrior("parent", query_pieces="first")([2, 0, 2], alignment)    # only "Ke" speaks for "Keys"
        array([-1,  3, -1, -1,  3, -1])
        >>> SyntaxPrior("nsubj")([2, 0, 2], alignment, ["nsubj", "root", "punct"])[3]   # "rattle" -> "Keys"
        array([0., 1., 0., 0., 0., 0.], dtype=float32)
    """

    kind: PriorKind | str = "parent"
    root: str = "exclude"
    temperature: float = 1.0
    key_pieces: str = "first"
    query_pieces: str = "all"
    relations: tuple[str, ...] | None = None
    subtypes: str = "fold"

    def __post_init__(self) -> None:
        if isinstance(self.kind, str) and self.kind not in _CHOICES["kind"]:
            if self.relations is not None:
                raise ValueError(f"SyntaxPrior: kind {self.kind!r} is a spec; give relations in it or in relations=")
            kind, relations = _parse_spec(self.kind)
            object.__setattr__(self, "kind", kind)
            object.__setattr__(self, "relations", relations)
        if self.relations is not None:
            if isinstance(self.relations, str) or not all(isinstance(r, str) and r for r in self.relations):
                raise TypeError(f"SyntaxPrior: relations must be a list of relation names, got {self.relations!r}")
            object.__setattr__(self, "relations", tuple(self.relations))
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"SyntaxPrior: {name} must be one of {choices}, got {getattr(self, name)!r}")
        if not self.temperature > 0:
            raise ValueError(f"SyntaxPrior: temperature must be > 0, got {self.temperature}")
        if self.relations is not None:
            if self.kind not in _BY_RELATION:
                raise ValueError(f"SyntaxPrior: only the kinds {_BY_RELATION} take relations, not {self.kind!r}")
            if not self.relations:
                raise ValueError("SyntaxPrior: relations is empty; name at least one (or None for every arc)")
            subtyped = [r for r in self.relations if ":" in r]
            if subtyped and self.subtypes == "fold":
                raise ValueError(
                    f"SyntaxPrior: relations {subtyped} name subtypes, which subtypes='fold' folds away; pass "
                    "subtypes='keep' to match them whole, or name the universal relation"
                )

    @classmethod
    def from_spec(cls, spec: str, **options: Any) -> SyntaxPrior:
        """The prior a spec string names: a kind (`"parent"`, `"dependents"`, ...), a relation (`"nsubj"`: the
        word's dependents by it, verb -> subject), or `"<kind>:<relations>"` (`"parent:det"`: determiner -> noun;
        `"dependents:det,amod"`). `options`: the other fields.

        Example:
            >>> prior = SyntaxPrior.from_spec("nsubj:pass", subtypes="keep")
            >>> prior.kind, prior.relations
            ('dependents', ('nsubj:pass',))
        """
        return cls(spec, **options)

    @property
    def spec(self) -> str:
        """The spec string of this kind (`from_spec` reads it back).

        Example:
            >>> SyntaxPrior("dependents", relations=["nsubj"]).spec, SyntaxPrior("parent:det").spec
            ('dependents:nsubj', 'parent:det')
        """
        return self.kind if self.relations is None else f"{self.kind}:{','.join(self.relations)}"

    @property
    def one_hot(self) -> bool:
        """True when the prior is built as key indices `[T]` rather than dense rows `[T, T]`."""
        return self.kind == "parent" and self.key_pieces == "first"

    def relation(self, name: str) -> str:
        """A relation as this prior compares it: without its subtype under `subtypes="fold"`.

        Example:
            >>> folded, kept = SyntaxPrior("nsubj"), SyntaxPrior("nsubj", subtypes="keep")
            >>> folded.relation("nsubj:pass"), kept.relation("nsubj:pass")
            ('nsubj', 'nsubj:pass')
        """
        return name.split(":", 1)[0] if self.subtypes == "fold" else name

    def arcs(self, relations: Sequence[Sequence[str]], count: int) -> np.ndarray | None:
        """Which arcs the prior keeps `[B, count]` (word i's arc to its head), from each sentence's relations; None
        for every arc (no `relations` chosen).

        Example:
            >>> SyntaxPrior("nsubj").arcs([["det", "nsubj:pass", "root"]], count=4)     # subtypes folded
            array([[False,  True, False, False]])
        """
        if self.relations is None:
            return None
        chosen = set(self.relations)
        kept = np.zeros((len(relations), count), dtype=bool)
        for row, sentence in enumerate(relations):
            kept[row, : len(sentence)] = [self.relation(name) in chosen for name in sentence]
        return kept

    def __call__(
        self, heads: Sequence[int], alignment: Alignment, relations: Sequence[str] | None = None
    ) -> np.ndarray:
        return self.batch([heads], [alignment], None if relations is None else [relations])[0]

    def batch(
        self,
        heads: Sequence[Sequence[int]],
        alignments: Sequence[Alignment],
        relations: Sequence[Sequence[str]] | None = None,
    ) -> np.ndarray:
        """Priors of several sentences at once, their alignments over the same `T` tokens (a padded
        batch): `[B, T]` key indices (`one_hot`) or `[B, T, T]` rows. One vectorized pass for the batch.
        `relations` (each sentence's) are needed when the prior keeps chosen relations only.

        Example:
            >>> from attnreg.syntax.align import align_word_ids
            >>> alignments = [align_word_ids([None, 0, 1, 2, None], 3), align_word_ids([None, 0, 1, None, None], 2)]
            >>> SyntaxPrior("tree_distance").batch([[2, 0, 2], [0, 1]], alignments).shape   # [B, T, T]
            (2, 5, 5)
        """
        for sentence_heads, alignment in zip(heads, alignments, strict=True):
            if len(sentence_heads) != alignment.num_words:
                raise ValueError(f"{len(sentence_heads)} heads for an alignment of {alignment.num_words} words")
        if self.relations is not None and relations is None:
            raise ValueError(f"SyntaxPrior {self.spec!r} keeps chosen relations: pass each sentence's relations")
        if relations is not None:
            for sentence_heads, sentence_relations in zip(heads, relations, strict=True):
                if len(sentence_relations) != len(sentence_heads):
                    raise ValueError(f"{len(sentence_relations)} relations for {len(sentence_heads)} heads")
        padded = pad_heads(heads)
        arcs = None if relations is None else self.arcs(relations, padded.shape[1])
        tokens = _Tokens.of(alignments, padded.shape[1])
        if self.one_hot:
            return self._parent_indices(padded, tokens, arcs)
        return self._dense(word_priors(padded, self.kind, self.root, self.temperature, arcs), tokens)

    def _query_words(self, tokens: _Tokens) -> np.ndarray:
        """Word of each query token that gets a prior row `[B, T]` (-1 elsewhere)."""
        if self.query_pieces == "all":
            return tokens.word
        first = np.full_like(tokens.word, -1)
        sentence, word = np.nonzero(tokens.first_piece >= 0)
        first[sentence, tokens.first_piece[sentence, word]] = word
        return first

    def _parent_indices(self, heads: np.ndarray, tokens: _Tokens, arcs: np.ndarray | None = None) -> np.ndarray:
        sentence = np.arange(len(heads))[:, None]
        own = np.broadcast_to(np.arange(heads.shape[1]), heads.shape)
        target_word = np.where(heads > 0, heads - 1, own if self.root == "self" else -1)
        target_word = np.where((heads >= 0) if arcs is None else (heads >= 0) & arcs, target_word, -1)
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


def _parse_spec(spec: str) -> tuple[str, tuple[str, ...] | None]:
    """(kind, relations) of a spec string (see `SyntaxPrior.from_spec`)."""
    kind, _, names = spec.partition(":")
    if kind in _CHOICES["kind"]:
        relations = tuple(name.strip() for name in names.split(",")) if names else None
        if relations is not None and not all(relations):
            raise ValueError(f"SyntaxPrior: the spec {spec!r} has an empty relation name")
        return kind, relations
    if spec.split(":", 1)[0] not in UD_RELATIONS:
        raise ValueError(
            f"SyntaxPrior: kind must be one of {_CHOICES['kind']}, a UD relation ('nsubj', 'obl:tmod') or "
            f"'<kind>:<relations>' ('parent:det', 'dependents:dobj' for other labels); got {spec!r}"
        )
    return "dependents", (spec,)


@dataclass(frozen=True)
class KindCounts:
    """What a prior kind covers in some sentences, over words: `words` in all, `rows` that have a target (the
    others lack the kind's relation, or are roots or leaves), `reachable` rows with a target at or before the word
    (what a causal model can attend to), and the `relations` the data has, as the prior compares them.

    Example:
        >>> counts = KindCounts(words=100, rows=20, reachable=15, relations=frozenset({"nsubj"}))
        >>> counts.unreachable, counts.without
        (5, 80)
    """

    words: int
    rows: int
    reachable: int
    relations: frozenset[str]

    def __add__(self, other: KindCounts) -> KindCounts:
        """The counts of both sets of sentences together."""
        return KindCounts(
            self.words + other.words,
            self.rows + other.rows,
            self.reachable + other.reachable,
            self.relations | other.relations,
        )

    @property
    def unreachable(self) -> int:
        """Rows a causal model cannot use: every target lies to the right of the word."""
        return self.rows - self.reachable

    @property
    def without(self) -> int:
        """Words without a row: no target of this kind."""
        return self.words - self.rows


def kind_counts(sentences: Sequence[Sentence], prior: SyntaxPrior) -> KindCounts:
    """Count, over words, the rows `prior` gives `sentences` and those a causal model can reach.

    Example:
        >>> keys = Sentence("s1", ("The", "keys", "rattle"), (2, 3, 0), ("det", "nsubj", "root"), "The keys rattle")
        >>> counts = kind_counts([keys], SyntaxPrior("parent:det"))        # "The" -> "keys": to the right
        >>> counts.words, counts.rows, counts.reachable, sorted(counts.relations)
        (3, 1, 0, ['det', 'nsubj', 'root'])
    """
    return arc_counts([(sentence.heads, sentence.relations) for sentence in sentences], prior)


def arc_counts(arcs: Sequence[tuple[Sequence[int], Sequence[str]]], prior: SyntaxPrior) -> KindCounts:
    """`kind_counts` from each sentence's (heads, relations), as `attnreg.syntax.trees.read_arcs` reads a file.

    Example:
        >>> arc_counts([((2, 3, 0), ("det", "nsubj", "root"))], SyntaxPrior("nsubj")).reachable
        1
    """
    words = rows = reachable = 0
    present: set[str] = set()
    for start in range(0, len(arcs), 256):
        chunk = arcs[start : start + 256]
        padded = pad_heads([heads for heads, _ in chunk])
        relations = [names for _, names in chunk]
        present.update(prior.relation(name) for sentence in relations for name in sentence)
        kept = prior.arcs(relations, padded.shape[1])
        table = word_priors(padded, prior.kind, prior.root, prior.temperature, kept) > 0
        words += int((padded >= 0).sum())
        rows += int(table.any(-1).sum())
        reachable += int(np.tril(table).any(-1).sum())
    return KindCounts(words, rows, reachable, frozenset(present))


def check_priors(
    sentences: Sequence[Sentence], priors: Mapping[str, SyntaxPrior], causal: bool = False
) -> dict[str, KindCounts]:
    """Check prior kinds against the training sentences before training, and count their rows (`kind_counts`).

    Raises ValueError naming the kind, the relation and the file(s) when a chosen relation never occurs in
    `sentences`, and, for a causal model (`causal=True`), when a kind has no row with a target to the left of
    its word: nothing a decoder could learn from. `priors` maps names (batch keys, say) to priors.

    Example:
        >>> keys = Sentence("s1", ("The", "keys", "rattle"), (2, 3, 0), ("det", "nsubj", "root"), "The keys rattle")
        >>> check_priors([keys], {"subject": SyntaxPrior("nsubj")}, causal=True)["subject"].reachable
        1
        >>> check_priors([keys], {"obj": SyntaxPrior("obj")})
        Traceback (most recent call last):
        ...
        ValueError: prior 'obj' (dependents:obj): relation 'obj' never occurs in the 1 sentences of ... root
    """
    sources = sorted({sentence.source for sentence in sentences if sentence.source})
    where = ", ".join(sources[:3]) + (f" and {len(sources) - 3} more" if len(sources) > 3 else "")
    where = where or "(sentences built in memory)"
    out = {}
    for name, prior in priors.items():
        counts = kind_counts(sentences, prior)
        problem = refusal(name, prior, counts, f"the {len(sentences)} sentences of {where}", causal)
        if problem:
            raise ValueError(problem)
        out[name] = counts
    return out


def refusal(name: str, prior: SyntaxPrior, counts: KindCounts, where: str, causal: bool = False) -> str | None:
    """Why `prior` (under `name`) cannot train on sentences with these `counts` (`where` says which sentences), or
    None: a chosen relation that never occurs there, or, for a causal model, no row with a target at or before its
    word (a kind with no row at all, say a leaf-only tree's `dependents`, counts as one too).

    Example:
        >>> refusal("det", SyntaxPrior("parent:det"), KindCounts(3, 1, 0, frozenset({"det"})), "s.conllu", causal=True)
        "prior 'det' (parent:det): none of its 1 rows in s.conllu has a target at or before its word, so a ..."
    """
    missing = [r for r in prior.relations or () if r not in counts.relations]
    if missing:
        hint = " (it is neither a kind nor a relation there)" if prior.spec == f"dependents:{missing[0]}" else ""
        return (
            f"prior {name!r} ({prior.spec}): relation {missing[0]!r} never occurs in {where}{hint}; relations there: "
            f"{', '.join(sorted(counts.relations))}"
        )
    if counts.rows == 0:
        return f"prior {name!r} ({prior.spec}): no word in {where} has a target of this kind"
    if causal and counts.reachable == 0:
        return (
            f"prior {name!r} ({prior.spec}): none of its {counts.rows} rows in {where} has a target at or before its "
            "word, so a causal model (a decoder) cannot attend to any; choose a kind whose targets lie to the left (a "
            "head attending to its left dependents)"
        )
    return None


def describe_counts(counts: Mapping[str, KindCounts], causal: bool = False) -> str:
    """One line per kind: the rows it gives and, for a causal model, those left out (targets only to the right).

    Example:
        >>> for part in describe_counts({"nsubj": KindCounts(100, 20, 15, frozenset())}, causal=True).split("; "):
        ...     print(part)
        nsubj: 20 of 100 words have a target (80 without one, left out)
        15 reachable by a causal model (5 left out: targets only to the right)
    """
    lines = []
    for name, count in counts.items():
        line = f"{name}: {count.rows} of {count.words} words have a target ({count.without} without one, left out)"
        if causal:
            line += f"; {count.reachable} reachable by a causal model ({count.unreachable} left out: "
            line += "targets only to the right)"
        lines.append(line)
    return "\n".join(lines)
