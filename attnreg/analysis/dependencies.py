"""Syntactic accuracy of attention heads on gold dependency trees (Clark et al. 2019, section 4).

Word-level attention: attention *to* a word is the sum over its pieces, attention *from* a word the
mean over its pieces; special tokens are left out. As in Clark et al.'s code, a word's attention to
itself is ignored. A head predicts each word's parent in two directions:

- `dependent_to_head`: the word the dependent attends to most;
- `head_to_dependent`: the word that attends most to the dependent (Clark et al.'s transposed maps).

A prediction is right when it is the gold head. Root words are not scored (Clark et al. count them as
misses), nor words cut by truncation or sharing a token, nor words whose head is such a word. The
fixed-offset baselines predict the word k positions away (k = +1: right-branching) for the same words.
Everything is vectorized per batch: no attention map outlives its batch.

A causal model (a decoder: `causal=True`, which `analyze` sets from the model) attends only to words at
or before the query, so a dependent can find its head only when the head is to its left, and a head its
dependent only when the dependent is to its left. Accuracy in each direction is then over the words
whose parent it can reach (`reachable_words`, `reachable_share` says what share), no prediction falls on
a word the query cannot see, and the baselines are the left offsets over the same words (a right
offset reaches no parent a causal head can attend to).

Example:
    >>> from attnreg.analysis import parent_accuracy
    >>> from attnreg.app.task import build_tokenizer, generate, vocabulary
    >>> from attnreg.tiny import tiny_model
    >>> tokenizer = build_tokenizer(vocabulary())
    >>> model = tiny_model("bert", vocab=len(tokenizer))              # a pretrained model in practice
    >>> sentences = [example.sentence for example in generate(8, seed=0)]   # or read_conllu("en_ewt-ud-dev.conllu")
    >>> result = parent_accuracy(model, tokenizer, sentences)
    >>> layer, head, accuracy = result.best_head()          # dependent to head
    >>> layer, head, round(accuracy, 3)
    (1, 0, 0.132)
    >>> result.best_head("det", "head_to_dependent")[:2]
    (0, 3)
    >>> round(result.baseline(1), 3)                        # right-branching
    0.451
    >>> len(result.relation_table(min_words=10))            # Clark et al.'s Table 1: "all" and 4 relations
    5
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from attnreg.syntax.align import Alignment
from attnreg.syntax.trees import Sentence

Direction = Literal["dependent_to_head", "head_to_dependent"]
DIRECTIONS: tuple[Direction, ...] = ("dependent_to_head", "head_to_dependent")


def word_attention(probs: torch.Tensor, alignment: Alignment) -> torch.Tensor:
    """Token attention `[..., T, S]` (one sentence, S >= the aligned tokens) to word attention `[..., n, n]`.

    Example:
        >>> from attnreg.syntax import align_word_ids
        >>> probs = torch.full((1, 5, 5), 0.2)                            # [H, T, T]: one uniform head
        >>> word_attention(probs, align_word_ids([None, 0, 0, 1, None], num_words=2))   # [CLS] w0 w0 w1 [SEP]
        tensor([[[0.4000, 0.2000],
                 [0.4000, 0.2000]]])
    """
    token_word = torch.as_tensor(alignment.token_word, device=probs.device)
    membership = _membership(token_word, alignment.num_words, probs.dtype)
    tokens = token_word.shape[0]
    maps = probs[..., :tokens, :tokens]
    words = batch_word_attention(maps.reshape(1, -1, tokens, tokens), membership[None])
    return words.reshape(*maps.shape[:-2], alignment.num_words, alignment.num_words)


def batch_word_attention(probs: torch.Tensor, membership: torch.Tensor) -> torch.Tensor:
    """Word attention `[B, H, W, W]` from token attention `[B, H, T, T]` and `membership` `[B, T, W]`
    (1 where token t is a piece of word w): to a word, the sum over its pieces; from a word, the mean.

    Example:
        >>> membership = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])     # tokens 0 and 1 are word 0
        >>> batch_word_attention(torch.full((1, 1, 3, 3), 1 / 3), membership)
        tensor([[[[0.6667, 0.3333],
                  [0.6667, 0.3333]]]])
    """
    batch, heads, tokens, _ = probs.shape
    width = membership.shape[-1]
    to_words = torch.bmm(probs.reshape(batch, heads * tokens, tokens), membership)  # sum over key pieces
    mean_pieces = membership / membership.sum(1, keepdim=True).clamp_min(1)
    by_key = to_words.reshape(batch, heads, tokens, width).transpose(-1, -2).reshape(batch, heads * width, tokens)
    return torch.bmm(by_key, mean_pieces).reshape(batch, heads, width, width).transpose(-1, -2)


def _membership(token_word: torch.Tensor, words: int, dtype: torch.dtype) -> torch.Tensor:
    kept = token_word >= 0
    membership = torch.zeros(token_word.shape[0], words, dtype=dtype, device=token_word.device)
    membership[kept.nonzero().squeeze(-1), token_word[kept]] = 1.0
    return membership


def predicted_heads(
    words: torch.Tensor, valid: torch.Tensor, direction: Direction, causal: bool = False
) -> torch.Tensor:
    """Each word's predicted head `[B, H, W]` from word attention `[B, H, W, W]` (-1: none it can see).

    `valid` `[B, W]` marks words with tokens; other words and the word itself are never predicted, nor,
    with `causal`, a word attending to a later one.

    Example:
        >>> words = torch.tensor([[[[0.0, 0.7, 0.3], [0.6, 0.0, 0.4], [0.1, 0.9, 0.0]]]])   # [B, H, W, W]
        >>> valid = torch.ones(1, 3, dtype=torch.bool)
        >>> predicted_heads(words, valid, "dependent_to_head"), predicted_heads(words, valid, "head_to_dependent")
        (tensor([[[1, 0, 1]]]), tensor([[[1, 2, 1]]]))
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    masked = _block_for_argmax(words.clone(), valid, causal)
    return _argmax(masked, -1 if direction == "dependent_to_head" else -2)


def _argmax(words: torch.Tensor, dim: int) -> torch.Tensor:
    """Argmax along `dim`, -1 where everything is blocked (the first word of a causal row, say)."""
    values, index = words.max(dim)
    return index.masked_fill(values == -torch.inf, -1)


def _block_for_argmax(words: torch.Tensor, valid: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Set, in place, the diagonal, the rows and columns of words without tokens and, with `causal`, the
    attention of a word to a later one (above the diagonal) to -inf.

    One mask serves both directions: a blocked row only holds the prediction of a word that is never
    scored (dependent to head), a blocked column only that of such a word as dependent (head to dependent).
    """
    width = words.shape[-1]
    invalid = ~valid[:, None, :]
    blocked = torch.eye(width, dtype=torch.bool, device=words.device) | invalid | invalid.transpose(-1, -2)
    if causal:
        blocked = blocked | torch.ones(width, width, dtype=torch.bool, device=words.device).triu(1)
    return words.masked_fill_(blocked[:, None], -torch.inf)


@dataclass(frozen=True)
class SyntaxTargets:
    """The gold trees of one batch, aligned to its tokens.

    `membership` `[B, T, W]`: 1 where token t is a piece of word w; `gold` `[B, W]`: each scored word's
    head (0-based word index), -1 for words not scored (root, dropped, padding); `relation_ids` `[B, W]`:
    index into `relations`, -1 where not scored.

    Example:
        >>> from attnreg.syntax import Sentence, align_word_ids
        >>> sentence = Sentence("s1", ("a", "b", "c"), (2, 0, 2), ("det", "root", "amod"), "a b c")
        >>> targets = SyntaxTargets.build([sentence], [align_word_ids([None, 0, 1, 2, None], 3)], tokens=5)
        >>> targets.gold, targets.relations              # the root is not scored
        (tensor([[ 1, -1,  1]]), ('det', 'root', 'amod'))
    """

    membership: torch.Tensor
    gold: torch.Tensor
    relation_ids: torch.Tensor
    relations: tuple[str, ...]

    @classmethod
    def build(cls, sentences: Sequence[Sentence], alignments: Sequence[Alignment], tokens: int) -> SyntaxTargets:
        """Targets for `sentences` whose tokens (padded to `tokens`) are aligned by `alignments`."""
        width = max((len(sentence.words) for sentence in sentences), default=0)
        membership = np.zeros((len(sentences), tokens, width), dtype=np.float32)
        gold = np.full((len(sentences), width), -1, dtype=np.int64)
        relation_ids = np.full((len(sentences), width), -1, dtype=np.int64)
        vocabulary: dict[str, int] = {}
        for row, (sentence, alignment) in enumerate(zip(sentences, alignments, strict=True)):
            token_word = alignment.token_word
            pieces = np.flatnonzero(token_word >= 0)
            membership[row, pieces, token_word[pieces]] = 1.0
            heads = np.asarray(sentence.heads)
            kept = alignment.pieces > 0
            scored = (heads > 0) & kept & kept[np.maximum(heads - 1, 0)]
            gold[row, : len(heads)] = np.where(scored, heads - 1, -1)
            codes = [vocabulary.setdefault(relation, len(vocabulary)) for relation in sentence.relations]
            relation_ids[row, : len(heads)] = np.where(scored, codes, -1)
        return cls(
            torch.from_numpy(membership), torch.from_numpy(gold), torch.from_numpy(relation_ids), tuple(vocabulary)
        )

    @property
    def scored(self) -> torch.Tensor:
        return self.gold >= 0


@dataclass
class ParentAccuracy:
    """Parent-accuracy counts per head in both directions, with the fixed-offset baselines on the same words.

    `hits[l, h]` counts words whose head (dependent to head) attends most to their gold head, and
    `reverse_hits` the same head to dependent; `words` is the number of scored words; `offset_hits[k]`
    the words whose head is k positions away (k = +1: right-branching). Per relation: `by_relation[rel]`
    holds `(hits [L, H], words)` (dependent to head), `reverse_by_relation[rel]` the head-to-dependent
    hits, `relation_offset_hits[rel][k]` the baselines. Pruned heads (`present` False) read NaN. With
    `causal` (a decoder) accuracies and baselines are over the words whose parent the direction can reach
    (`left_words` have their parent to their left, see the module docstring).

    Example:
        >>> from attnreg.syntax import Sentence, align_word_ids
        >>> sentence = Sentence("s1", ("a", "b", "c"), (2, 0, 2), ("det", "root", "amod"), "a b c")
        >>> targets = SyntaxTargets.build([sentence], [align_word_ids([None, 0, 1, 2, None], 3)], tokens=5)
        >>> probs = torch.zeros(1, 1, 5, 5); probs[..., 2] = 1.0      # one head, every token attends to "b"
        >>> result = ParentAccuracy.empty(layers=1, heads=1)
        >>> result.update({0: probs}, targets)
        >>> result.accuracy, result.words, result.best_head(), result.baseline(1), result.best_baseline()
        (tensor([[1.]]), 2, (0, 0, 1.0), 0.5, (1, 0.5))
        >>> result.relation_words()                      # scored words per relation: the root is not scored
        {'amod': 1, 'det': 1}
        >>> decoder = ParentAccuracy.empty(layers=1, heads=1, causal=True)   # "a" cannot attend to "b"
        >>> decoder.update({0: probs.tril()}, targets)
        >>> decoder.accuracy, decoder.reachable_words(), decoder.reachable_share(), decoder.best_baseline()
        (tensor([[1.]]), 1, 0.5, (-1, 1.0))
    """

    hits: torch.Tensor
    words: int = 0
    offset_hits: dict[int, int] = field(default_factory=dict)
    by_relation: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)
    reverse_hits: torch.Tensor | None = None
    reverse_by_relation: dict[str, torch.Tensor] = field(default_factory=dict)
    relation_offset_hits: dict[str, dict[int, int]] = field(default_factory=dict)
    max_offset: int = 5
    present: torch.Tensor | None = None
    causal: bool = False
    left_words: int = 0
    relation_left_words: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.reverse_hits is None:
            self.reverse_hits = torch.zeros_like(self.hits)
        if self.present is None:
            self.present = torch.zeros(self.hits.shape, dtype=torch.bool)

    @classmethod
    def empty(cls, layers: int, heads: int, max_offset: int = 5, causal: bool = False) -> ParentAccuracy:
        return cls(hits=torch.zeros(layers, heads, dtype=torch.float64), max_offset=max_offset, causal=causal)

    # -- reading -----------------------------------------------------------------------------------
    @property
    def accuracy(self) -> torch.Tensor:
        """Parent accuracy, dependent to head, `[layers, heads]` in [0, 1]."""
        return self.relation_accuracy(None, "dependent_to_head")

    @property
    def reverse_accuracy(self) -> torch.Tensor:
        """Parent accuracy, head to dependent, `[layers, heads]` in [0, 1]."""
        return self.relation_accuracy(None, "head_to_dependent")

    def reachable_words(self, relation: str | None = None, direction: Direction = "dependent_to_head") -> int:
        """Scored words (of `relation`; None: all) whose parent `direction` can reach: all of them, or for a
        causal model those whose parent is to their left (dependent to head) or right (head to dependent)."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if relation is None:
            words, left = self.words, self.left_words
        elif relation in self.by_relation:
            words, left = self.by_relation[relation][1], self.relation_left_words.get(relation, 0)
        else:
            raise KeyError(f"no word with relation {relation!r}; relations seen: {sorted(self.by_relation)}")
        if not self.causal:
            return words
        return left if direction == "dependent_to_head" else words - left

    def reachable_share(self, direction: Direction = "dependent_to_head") -> float:
        """The share of scored words whose parent `direction` can reach (1 unless causal)."""
        return self.reachable_words(None, direction) / max(self.words, 1)

    def relation_words(self) -> dict[str, int]:
        """Scored words per relation, most frequent first."""
        counts = {relation: count for relation, (_, count) in self.by_relation.items()}
        return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))

    def relation_accuracy(
        self, relation: str | None = None, direction: Direction = "dependent_to_head"
    ) -> torch.Tensor:
        """Accuracy `[layers, heads]` on the words of `relation` (None: all words) in `direction`."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if relation is None:
            hits = self.hits if direction == "dependent_to_head" else self.reverse_hits
        elif relation in self.by_relation:
            hits = self.by_relation[relation][0]
            hits = hits if direction == "dependent_to_head" else self.reverse_by_relation[relation]
        else:
            raise KeyError(f"no word with relation {relation!r}; relations seen: {sorted(self.by_relation)}")
        accuracy = (hits / max(self.reachable_words(relation, direction), 1)).float()
        return torch.where(self.present, accuracy, torch.nan)

    def best_head(
        self, relation: str | None = None, direction: Direction = "dependent_to_head"
    ) -> tuple[int, int, float]:
        """(layer, head, accuracy) of the best head for `relation` (None: all words) in `direction`."""
        accuracy = self.relation_accuracy(relation, direction)
        layer, head = divmod(int(accuracy.nan_to_num(-1.0).argmax()), accuracy.shape[1])
        return layer, head, float(accuracy[layer, head])

    def baseline(self, offset: int = 1, relation: str | None = None) -> float:
        """Accuracy of always choosing the word `offset` positions away (+1 = right-branching). For a causal
        model: over the words whose parent is to their left, so a right offset (> 0) scores 0."""
        if (relation is not None and relation not in self.by_relation) or (self.causal and offset > 0):
            return 0.0
        table = self.offset_hits if relation is None else self.relation_offset_hits.get(relation, {})
        return table.get(offset, 0) / max(self.reachable_words(relation, "dependent_to_head"), 1)

    def best_baseline(self, relation: str | None = None) -> tuple[int, float]:
        """(offset, accuracy) of the best fixed offset in [-max_offset, max_offset] for `relation` (a causal
        model: the left offsets only)."""
        offsets = [k for k in range(-self.max_offset, 0 if self.causal else self.max_offset + 1) if k]
        scores = [(self.baseline(k, relation), -abs(k), k) for k in offsets]
        accuracy, _, offset = max(scores)
        return offset, accuracy

    def relation_table(self, min_words: int = 1, relations: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Clark et al.'s Table 1: per relation (and "all" first), the best head in each direction and the
        best fixed-offset baseline. Heads are "layer-head"; accuracies in percent. For a causal model each
        direction also gives its reachable words (`<direction>_words`), the accuracy's denominator."""
        chosen = relations if relations is not None else [r for r, n in self.relation_words().items() if n >= min_words]
        rows = []
        for relation in [None, *chosen]:
            if relation is not None and relation not in self.by_relation:
                continue
            row: dict[str, Any] = {
                "relation": relation or "all",
                "words": self.words if relation is None else self.by_relation[relation][1],
            }
            for direction in DIRECTIONS:
                layer, head, accuracy = self.best_head(relation, direction)
                row[f"{direction}_head"] = f"{layer}-{head}"
                row[f"{direction}_accuracy"] = round(100 * accuracy, 1)
                if self.causal:
                    row[f"{direction}_words"] = self.reachable_words(relation, direction)
            offset, accuracy = self.best_baseline(relation)
            row["baseline_offset"] = offset
            row["baseline_accuracy"] = round(100 * accuracy, 1)
            rows.append(row)
        return rows

    # -- accumulating -------------------------------------------------------------------------------
    def update(
        self,
        probs: Mapping[int, torch.Tensor],
        targets: SyntaxTargets,
        heads: Mapping[int, Sequence[int]] | None = None,
    ) -> None:
        """Add one batch: `probs[layer]` `[B, H, T, T]` for the tokens `targets` is aligned to.
        `heads[layer]` gives the original numbers of the layer's current heads (default 0..H-1)."""
        if not self.count(targets):
            return
        for layer, layer_probs in probs.items():
            membership = targets.membership.to(layer_probs.device)
            self.add_layer(layer, batch_word_attention(layer_probs.float(), membership), targets, heads)

    def count(self, targets: SyntaxTargets) -> bool:
        """Count the scored words of one batch, once, before its layers' `add_layer`; False if it has none
        (then there is nothing to add).

        Example:
            >>> from attnreg.syntax import Sentence, align_word_ids
            >>> sentence = Sentence("s1", ("a", "b"), (2, 0), ("det", "root"), "a b")
            >>> targets = SyntaxTargets.build([sentence], [align_word_ids([None, 0, 1, None], 2)], tokens=4)
            >>> result = ParentAccuracy.empty(layers=1, heads=1)
            >>> result.count(targets), result.words                        # the root is not scored
            (True, 1)
            >>> words = torch.tensor([[[[0.0, 0.9], [0.1, 0.0]]]])           # [B, H, W, W]: "a" attends to "b"
            >>> result.add_layer(0, words, targets)
            >>> result.accuracy
            tensor([[1.]])
        """
        if int(targets.scored.sum()) == 0:
            return False
        self._count_words(targets)
        return True

    def add_layer(
        self,
        layer: int,
        words: torch.Tensor,
        targets: SyntaxTargets,
        heads: Mapping[int, Sequence[int]] | None = None,
    ) -> None:
        """Add the predictions of one layer from its word attention `[B, H, W, W]` on the batch `count` took
        (`batch_word_attention`, or `attnreg.analysis.blocks.block_word_attention` without the token maps)."""
        device = words.device
        gold, scored = targets.gold.to(device), targets.scored.to(device)
        codes = targets.relation_ids[targets.scored].to(device)
        valid = targets.membership.to(device).sum(1) > 0  # words with tokens [B, W]
        blocked = _block_for_argmax(words.float().clone(), valid, self.causal)
        predicted = torch.stack([_argmax(blocked, -1), _argmax(blocked, -2)])  # [2 directions, B, H, W]
        correct = (predicted == gold[None, :, None]).transpose(-1, -2)[:, scored].float()  # [2, words, H]
        relations = len(targets.relations)
        per_relation = torch.zeros(2, relations, correct.shape[-1], device=device).index_add_(1, codes, correct)
        per_relation = per_relation.double().cpu()
        columns = list(range(correct.shape[-1])) if heads is None else list(heads[layer])
        self.present[layer, columns] = True
        totals = correct.sum(1).double().cpu()
        self.hits[layer, columns] += totals[0]
        self.reverse_hits[layer, columns] += totals[1]
        for code in torch.unique(codes).tolist():
            relation = targets.relations[code]
            self.by_relation[relation][0][layer, columns] += per_relation[0, code]
            self.reverse_by_relation[relation][layer, columns] += per_relation[1, code]

    def _count_words(self, targets: SyntaxTargets) -> None:
        scored = targets.scored
        position = torch.arange(targets.gold.shape[1]).expand_as(targets.gold)
        offsets = (targets.gold - position)[scored]
        codes = targets.relation_ids[scored]
        relations = len(targets.relations)
        words = torch.bincount(codes, minlength=relations)
        self.words += int(scored.sum())
        left = offsets < 0  # the parent is to the left: what a causal dependent can attend to
        self.left_words += int(left.sum())
        left_per_relation = torch.bincount(codes[left], minlength=relations)
        for code in left_per_relation.nonzero().flatten().tolist():
            name = targets.relations[code]
            self.relation_left_words[name] = self.relation_left_words.get(name, 0) + int(left_per_relation[code])
        for code, relation in enumerate(targets.relations):
            if not words[code]:
                continue  # e.g. the root: named in the batch, never scored
            if relation not in self.by_relation:
                self.by_relation[relation] = (torch.zeros_like(self.hits), 0)
                self.reverse_by_relation[relation] = torch.zeros_like(self.hits)
            hits, count = self.by_relation[relation]
            self.by_relation[relation] = (hits, count + int(words[code]))
        for offset in range(-self.max_offset, self.max_offset + 1):
            if not offset:
                continue
            matched = offsets == offset
            self.offset_hits[offset] = self.offset_hits.get(offset, 0) + int(matched.sum())
            per_relation = torch.bincount(codes[matched], minlength=relations)
            for code in per_relation.nonzero().flatten().tolist():
                table = self.relation_offset_hits.setdefault(targets.relations[code], {})
                table[offset] = table.get(offset, 0) + int(per_relation[code])

    def summary(self) -> dict[str, Any]:
        """Best heads overall in both directions and the offset baselines, for JSON (percent). A causal
        model's gives each direction's reachable `words` and their `share` of all, and no right-branching
        baseline (no parent it would find is one a causal head can attend to)."""
        summary: dict[str, Any] = {"words": self.words, "causal": self.causal}
        for direction in DIRECTIONS:
            layer, head, accuracy = self.best_head(None, direction)
            summary[direction] = {"head": f"{layer}-{head}", "accuracy": round(100 * accuracy, 1)}
            if self.causal:
                summary[direction]["words"] = self.reachable_words(None, direction)
                summary[direction]["share"] = round(100 * self.reachable_share(direction), 1)
        if not self.causal:
            summary["right_branching"] = round(100 * self.baseline(1), 1)
        summary["left_branching"] = round(100 * self.baseline(-1), 1)
        offset, accuracy = self.best_baseline()
        summary["best_offset"] = {"offset": offset, "accuracy": round(100 * accuracy, 1)}
        return summary
