"""Lightning data modules for the training app: the built-in agreement task, CoLA and SST-2 from a
local directory, and any `datasets` hub dataset (`HubDataset`: what the hub's data modules share).

Each module takes an optional `tokenizer` (a pretrained model's); without one it builds a word-level
tokenizer (`attnreg.app.task.build_tokenizer`) from its own vocabulary, for randomly initialised models.
With `with_prior=True` batches carry the syntax prior (`batch["attnreg_prior"]`, see
`attnreg.syntax.SyntaxCollator`); sentences without gold trees are parsed with spaCy then.
Besides the loaders, each module names its `eval_sets()` (accuracy in the run summary) and its
`tree_sentences()` (held-out sentences with trees, for parent accuracy).

Example:
    >>> data = AgreementDataModule(train=8, val=4, test=4, hard=2, seed=0, batch_size=4)
    >>> data.setup("fit")
    >>> batch = next(iter(data.train_dataloader()))   # input_ids, attention_mask, labels, attnreg_prior
    >>> sorted(batch), batch["input_ids"].shape
    (['attention_mask', 'attnreg_prior', 'input_ids', 'labels'], torch.Size([4, 20]))
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from tokenizers import pre_tokenizers
from torch.utils.data import DataLoader, Dataset
from transformers import PreTrainedTokenizerBase

from attnreg.app.datasets import read_cola, read_sst2
from attnreg.app.task import MASK, Grammar, build_tokenizer, make_splits, vocabulary
from attnreg.syntax.data import SyntaxCollator, SyntaxDataset, warn_unknown_words
from attnreg.syntax.priors import SyntaxPrior
from attnreg.syntax.trees import Sentence


class TextDataset(Dataset):
    """Texts with labels; items are `{"text": str, "label": int}`.

    Example:
        >>> TextDataset(["a fine film", "dull"], [1, 0])[0]
        {'text': 'a fine film', 'label': 1}
    """

    def __init__(self, texts: Sequence[str], labels: Sequence[int]) -> None:
        if len(texts) != len(labels):
            raise ValueError(f"{len(labels)} labels for {len(texts)} texts")
        self.texts, self.labels = list(texts), list(labels)

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"text": self.texts[index], "label": self.labels[index]}


class TextCollator:
    """Tokenizes a batch of `TextDataset` items (padding, truncation to `max_length`) and adds `labels`.

    Example:
        >>> collate = TextCollator(build_tokenizer(["a", "b", "c"]), max_length=16)
        >>> batch = collate(TextDataset(["a b", "c"], [1, 0]))
        >>> batch["input_ids"], batch["labels"]
        (tensor([[2, 5, 6, 3],
                [2, 7, 3, 0]]), tensor([1, 0]))
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_length: int | None = 128) -> None:
        self.tokenizer, self.max_length = tokenizer, max_length
        self._tokenizer_checked = False

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        texts = [example["text"] for example in examples]
        if not self._tokenizer_checked:  # the first batch: warn when the tokenizer knows few of the words
            self._tokenizer_checked = warn_unknown_words(self.tokenizer, texts, "TextCollator")
        batch = self.tokenizer(
            texts,
            padding=True,
            truncation=self.max_length is not None,
            max_length=self.max_length,
            return_tensors="pt",
        )
        batch = dict(batch)
        batch["labels"] = torch.as_tensor([example["label"] for example in examples])
        return batch


class EpochSampler(torch.utils.data.Sampler[int]):
    """A random order of `size` items drawn from (`seed`, epoch) alone; Lightning calls `set_epoch` at each epoch, so
    the order does not depend on what else drew random numbers, and a run resumed from a checkpoint sees the
    batches the uninterrupted one saw.

    Example:
        >>> sampler = EpochSampler(5, seed=0)
        >>> first = list(sampler); sampler.set_epoch(1); second = list(sampler)
        >>> sorted(first) == list(range(5)), first != second, list(EpochSampler(5, seed=0)) == first
        (True, True, True)
    """

    start = 0
    """Items of the order the next iteration leaves out (once): `ResumableLoader` sets it to resume mid-epoch."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Any:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.epoch_seed)).tolist()
        start, self.start = self.start, 0
        return iter(order[start:])

    @property
    def epoch_seed(self) -> int:
        """The seed of this epoch's order, from (`seed`, epoch) alone."""
        return self.seed * 100_003 + self.epoch


class ResumableLoader(DataLoader):
    """A `DataLoader` that a run resumed mid-epoch continues where its checkpoint left it, as the uninterrupted run did.

    Lightning saves a training loader's `state_dict()` in its checkpoints and hands it back to `load_state_dict` on
    resume (a loader with both methods is "stateful" to Lightning); without it a run resumed mid-epoch would restart
    the epoch's order and train again on batches it had trained on. The state is the epoch and the batches of it the
    loader yielded (Lightning prefetches none from a loader of known length): the resumed epoch leaves those out, from
    the sampler's order when it is an `EpochSampler` (nothing is read or collated for them), else by drawing and
    dropping them. The first batch of an iteration is drawn after Lightning's `set_epoch`, so a state whose epoch is
    not the one being iterated (the checkpoint ended it) leaves nothing out. Its `generator`, where it has one, is
    seeded anew from the `EpochSampler`'s (seed, epoch) at each iteration: workers' seeds come from it, not from
    torch's global generator, which a resumed run finds as the checkpoint left it (`attnreg.app.modules.FineTuner`).

    Example:
        >>> loader = ResumableLoader(range(10), batch_size=2, sampler=EpochSampler(10, seed=0))
        >>> batches = iter(loader); first, second = next(batches), next(batches)
        >>> state = loader.state_dict(); state                     # two batches of epoch 0 yielded
        {'epoch': 0, 'batches': 2}
        >>> resumed = ResumableLoader(range(10), batch_size=2, sampler=EpochSampler(10, seed=0))
        >>> resumed.load_state_dict(state)
        >>> [batch.tolist() for batch in resumed] == [batch.tolist() for batch in loader][2:]
        True
        >>> loader.state_dict()                                     # the epoch ended: the next one from its start
        {'epoch': 1, 'batches': 0}
    """

    _position = (0, 0)  # (epoch, batches of it yielded) of the latest iteration
    _resume: tuple[int, int] | None = None  # the position a checkpoint recorded, for the next iteration

    def __iter__(self) -> Any:
        return self._batches()

    def _batches(self) -> Any:
        # runs at the first next(): after Lightning's set_epoch
        sampler = self.sampler
        epoch = getattr(sampler, "epoch", 0)
        resume, self._resume = self._resume, None
        done = resume[1] if resume is not None and resume[0] == epoch else 0
        by_index = isinstance(sampler, EpochSampler) and self.batch_size is not None
        if isinstance(sampler, EpochSampler):
            sampler.start = done * self.batch_size if by_index else 0
            if self.generator is not None:
                self.generator.manual_seed(sampler.epoch_seed)
        batches = super().__iter__()
        for _ in range(0 if by_index else done):
            next(batches, None)
        self._position = (epoch, done)
        for batch in batches:
            self._position = (epoch, self._position[1] + 1)
            yield batch

    def state_dict(self) -> dict[str, int]:
        """Where the training order stands: the epoch and the batches of it yielded (a loaded state until the next
        iteration starts); after the epoch's last batch, the next epoch, none yielded."""
        epoch, batches = self._position if self._resume is None else self._resume
        return {"epoch": epoch + 1, "batches": 0} if batches >= len(self) else {"epoch": epoch, "batches": batches}

    def load_state_dict(self, state_dict: Mapping[str, int]) -> None:
        """Continue from a checkpoint's `state_dict()`: the next iteration leaves out the batches it yielded (when it
        iterates the same epoch)."""
        self._resume = (int(state_dict["epoch"]), int(state_dict["batches"]))


class AppDataModule(L.LightningDataModule):
    """What the app's data modules share (classification here, the decoder tasks' in `attnreg.app.lm`): the
    tokenizer (the one given, else `build_tokenizer()` from the data's own words, for random models), one collator
    for every loader (`build_collator()`, built once, so that a `SyntaxCollator`'s counts and its dropped-arcs
    warning cover the whole run), and loaders whose training order comes from (`seed`, epoch) alone
    (`EpochSampler`: a run resumed from a checkpoint sees the batches the uninterrupted one would, mid-epoch too with
    `ResumableLoader`). Subclasses fill `self.datasets` in `setup`.

    Example:
        >>> class Numbers(AppDataModule):
        ...     def build_collator(self):
        ...         return torch.tensor
        ...     def setup(self, stage=None):
        ...         self.datasets = {"train": list(range(6)), "val": [6, 7]}
        >>> def order(seed):
        ...     data = Numbers(batch_size=3, seed=seed); data.setup()
        ...     return [batch.tolist() for batch in data.train_dataloader()]
        >>> first = order(seed=1); _ = torch.rand(5)                       # torch's own generator moves on
        >>> order(seed=1) == first, sorted(sum(first, [])), order(seed=2) != first
        (True, [0, 1, 2, 3, 4, 5], True)
    """

    task = "classification"
    """The name of this data's task (`classification`, `causal_lm`, `chat`): the app's task object is the one of
    this name (`attnreg.app.tasks.task_of`), which builds, trains and summarizes the run."""
    num_labels: int | None = 2

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None = None,
        with_prior: bool = False,
        prior: str | Mapping[str, Any] = "parent",
        batch_size: int = 32,
        eval_batch_size: int = 128,
        max_length: int | None = 128,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self._tokenizer = tokenizer
        self.with_prior = with_prior
        self.prior = SyntaxPrior(prior) if isinstance(prior, str) else SyntaxPrior(**prior)
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.max_length, self.num_workers, self.seed = max_length, num_workers, seed
        self.datasets: dict[str, Any] = {}
        self._collate: Callable | None = None

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer given, else one built from this data's vocabulary (on first use)."""
        if self._tokenizer is None:
            self._tokenizer = self.build_tokenizer()
        return self._tokenizer

    def build_tokenizer(self) -> PreTrainedTokenizerBase:
        """A tokenizer from this data's own vocabulary; each data module defines it (abstract here)."""
        raise NotImplementedError(f"{type(self).__name__} must define build_tokenizer() or be given a tokenizer")

    def collator(self) -> Callable:
        """The collate function of every loader, built once (`build_collator`)."""
        if self._collate is None:
            self._collate = self.build_collator()
        return self._collate

    def build_collator(self) -> Callable:
        """The collate function of this data's batches; each data module defines it (abstract here)."""
        raise NotImplementedError(f"{type(self).__name__} must define build_collator()")

    def loader(self, split: str, shuffle: bool = False) -> DataLoader:
        """`split`'s loader; shuffled by `EpochSampler` (an order per seed and epoch) in a `ResumableLoader` (a run
        resumed mid-epoch goes on with the batches the uninterrupted one trained on)."""
        if split not in self.datasets:
            raise KeyError(
                f"{type(self).__name__} has no split {split!r} (has {sorted(self.datasets)}); run setup() first"
            )
        if not shuffle:
            return DataLoader(
                self.datasets[split],
                batch_size=self.eval_batch_size,
                collate_fn=self.collator(),
                num_workers=self.num_workers,
            )
        return ResumableLoader(
            self.datasets[split],
            batch_size=self.batch_size,
            sampler=EpochSampler(len(self.datasets[split]), self.seed),
            collate_fn=self.collator(),
            num_workers=self.num_workers,
            generator=torch.Generator(),
        )

    def train_dataloader(self) -> DataLoader:
        return self.loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self.loader("val")

    def eval_sets(self) -> dict[str, DataLoader]:
        """Held-out loaders whose accuracy (or perplexity) the run summary reports, by name."""
        return {"val": self.loader("val")}

    def tree_sentences(self) -> list[Sentence] | None:
        """Held-out sentences with trees for parent accuracy (None when this data has none)."""
        return None


class ClassificationDataModule(AppDataModule):
    """Sentence classification: batches of `TextCollator` (or of `SyntaxCollator` with the prior on); subclasses fill
    `self.datasets` in `setup`.

    Example:
        >>> class Tiny(ClassificationDataModule):
        ...     def setup(self, stage=None):
        ...         self.datasets = {"train": TextDataset(["a b", "b"], [1, 0]), "val": TextDataset(["a"], [1])}
        >>> data = Tiny(tokenizer=build_tokenizer(["a", "b"]), batch_size=2)
        >>> data.setup(); sorted(next(iter(data.train_dataloader())))
        ['attention_mask', 'input_ids', 'labels']
        >>> data.tree_sentences() is None             # no trees: no parent accuracy for it
        True
    """

    def build_collator(self) -> Callable:
        if self.with_prior:
            return SyntaxCollator(self.tokenizer, prior=self.prior, max_length=self.max_length)
        return TextCollator(self.tokenizer, max_length=self.max_length)

    def tree_sentences(self) -> list[Sentence] | None:
        val = self.datasets.get("val")
        return list(val.sentences) if isinstance(val, SyntaxDataset) else None


class AgreementDataModule(ClassificationDataModule):
    """The built-in agreement task (`attnreg.app.task`): train/val/test sentences with 0-1 distractor verbs,
    `hard` with 2. Gold trees come with the sentences, so the prior is always available; `with_prior`
    only decides whether batches carry it (the default: yes).

    Example:
        >>> data = AgreementDataModule(train=8, val=4, test=4, hard=2, seed=0); data.setup("fit")
        >>> sorted(data.eval_sets()), len(data.tree_sentences()), len(data.tokenizer)
        (['hard', 'test', 'val'], 4, 58)
        >>> data = AgreementDataModule(train=8, val=4, test=4, hard=2, with_prior=False); data.setup("fit")
        >>> sorted(next(iter(data.loader("val"))))    # no prior in the batches
        ['attention_mask', 'input_ids', 'labels']
    """

    def __init__(
        self,
        train: int = 500,
        val: int = 200,
        test: int = 500,
        hard: int = 500,
        seed: int = 0,
        grammar: Mapping[str, Any] | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        with_prior: bool = True,
        prior: str | Mapping[str, Any] = "parent",
        batch_size: int = 32,
        eval_batch_size: int = 128,
        max_length: int | None = 64,
        num_workers: int = 0,
    ) -> None:
        super().__init__(tokenizer, with_prior, prior, batch_size, eval_batch_size, max_length, num_workers, seed)
        self.sizes = {"train": train, "val": val, "test": test, "hard": hard}
        self.grammar = Grammar(**(grammar or {}))

    def build_tokenizer(self) -> PreTrainedTokenizerBase:
        return build_tokenizer(vocabulary(self.grammar))

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        mask = self.tokenizer.mask_token or MASK
        splits = make_splits(**self.sizes, seed=self.seed, grammar=self.grammar, mask=mask)
        self.datasets = {
            name: SyntaxDataset([e.sentence for e in split], [e.label for e in split]) for name, split in splits.items()
        }

    def build_collator(self) -> Callable:
        if self.with_prior:
            return super().build_collator()
        return _SentenceTexts(TextCollator(self.tokenizer, max_length=self.max_length))

    def test_dataloader(self) -> list[DataLoader]:
        return [self.loader("test"), self.loader("hard")]

    def eval_sets(self) -> dict[str, DataLoader]:
        return {name: self.loader(name) for name in ("val", "test", "hard")}

    def tree_sentences(self) -> list[Sentence]:
        return list(self.datasets["test"].sentences)


class _SentenceTexts:
    """Feeds `SyntaxDataset` items to a `TextCollator` (the text of each sentence, no prior)."""

    def __init__(self, collate: TextCollator) -> None:
        self.collate = collate

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        return self.collate([{"text": e["sentence"].text, "label": e["label"]} for e in examples])


class TextDataModule(ClassificationDataModule):
    """Texts with labels read by `read(split)` for "train" and "val"; parsed with spaCy
    (`attnreg.syntax.parse_texts`, the `parse` extra) when `with_prior`. `limit_train` and `limit_val` keep the
    first n training and validation texts (quick runs). Without a tokenizer, a word-level one is built from the training
    texts: their `vocab_size` most frequent words.

    Example:
        >>> class Reviews(TextDataModule):
        ...     def read(self, split):
        ...         return {"train": (["a fine film", "dull"], [1, 0]), "val": (["fine"], [1])}[split]
        >>> data = Reviews(limit_train=1, batch_size=2)
        >>> data.setup(); data.tokenizer.tokenize("a fine film")
        ['a', 'fine', 'film']
        >>> len(data.datasets["train"]), next(iter(data.val_dataloader()))["input_ids"]
        (1, tensor([[2, 6, 3]]))
    """

    def __init__(
        self,
        limit_train: int | None = None,
        vocab_size: int = 8000,
        limit_val: int | None = None,
        **loader_options: Any,
    ) -> None:
        super().__init__(**loader_options)
        self.limit_train, self.limit_val, self.vocab_size = limit_train, limit_val, vocab_size

    def read(self, split: str) -> tuple[list[str], list[int]]:
        """Texts and labels of `split` ("train", "val"); each text data module defines it (abstract here)."""
        raise NotImplementedError(f"{type(self).__name__} must define read(split)")

    def training_texts(self) -> tuple[list[str], list[int]]:
        return _first(self.read("train"), self.limit_train)

    def build_tokenizer(self) -> PreTrainedTokenizerBase:
        return build_tokenizer(frequent_words(self.training_texts()[0], self.vocab_size))

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        for split, (texts, labels) in (
            ("train", self.training_texts()),
            ("val", _first(self.read("val"), self.limit_val)),
        ):
            if self.with_prior:
                from attnreg.syntax.parse import parse_texts

                self.datasets[split] = SyntaxDataset(parse_texts(texts), labels)
            else:
                self.datasets[split] = TextDataset(texts, labels)


def _first(split: tuple[list[str], list[int]], limit: int | None) -> tuple[list[str], list[int]]:
    texts, labels = split
    return (texts, labels) if limit is None else (texts[:limit], labels[:limit])


class LocalGlueDataModule(TextDataModule):
    r"""CoLA or SST-2 from a local directory (`attnreg.app.datasets`); validation is the dev set.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())                             # the SST-2 folder
        >>> _ = (folder / "train.tsv").write_text("sentence\tlabel\na fine film\t1\ndull .\t0\n")
        >>> _ = (folder / "dev.tsv").write_text("sentence\tlabel\nfine\t1\n")
        >>> data = LocalGlueDataModule("sst2", folder, batch_size=2)      # with_prior=True parses with spaCy
        >>> data.setup(); sorted(data.datasets), data.tokenizer.tokenize("a dull film")
        (['train', 'val'], ['a', 'dull', 'film'])
        >>> data.task, data.benchmark                                      # a classification task, from SST-2
        ('classification', 'sst2')
    """

    READERS = {"cola": read_cola, "sst2": read_sst2}

    def __init__(self, task: str, data_dir: str | Path, **options: Any) -> None:
        if task not in self.READERS:
            raise ValueError(f"task must be one of {sorted(self.READERS)}, got {task!r}")
        data_dir = Path(data_dir)
        if not data_dir.is_dir():
            raise FileNotFoundError(
                f"data_dir {str(data_dir)!r} (resolved: {data_dir.resolve()}) does not exist: data={task} reads "
                f"{task.upper()} from a local directory; set data.data_dir=/path/to/{task} "
                "(or the environment variable ATTNREG_DATA_DIR to the folder holding it)"
            )
        super().__init__(**options)
        self.benchmark, self.data_dir = task, data_dir  # `task` is the kind of task (classification), as for all

    def read(self, split: str) -> tuple[list[str], list[int]]:
        return self.READERS[self.benchmark](self.data_dir, {"train": "train", "val": "dev"}[split])


class HubDataset:
    """What the data modules reading a `datasets` dataset share, put ahead of the base that reads files
    (`HubDataModule`, `attnreg.app.lm.HubLMDataModule`, `attnreg.app.lm.HubChatDataModule`): the dataset (`path`,
    `name`, `data_files`, as `datasets.load_dataset` takes them; needs `pip install datasets`), its splits for "train"
    and "val", each loaded with the columns the data reads checked (`load_split`), and where its rows come from
    (`source`). The other `options` go to the base.

    Example:
        >>> class Lines(HubDataset, TextDataModule):
        ...     pass
        >>> data = Lines("text", data_files={"train": "a.txt", "validation": "b.txt"}, limit_train=10)   # loads later
        >>> data.splits, data.source("val"), data.limit_train
        ({'train': 'train', 'val': 'validation'}, 'dataset text split validation', 10)
    """

    def __init__(
        self,
        path: str,
        name: str | None = None,
        data_files: Any = None,
        train_split: str = "train",
        val_split: str = "validation",
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.path, self.name, self.data_files = path, name, data_files
        self.splits = {"train": train_split, "val": val_split}

    def load_split(self, split: str, columns: Mapping[str, str]) -> Any:
        """The dataset's `split` ("train", "val"), refused when it lacks a column of `columns` (the setting that
        names each column, e.g. {"data.text_field": "text"}), naming the setting to change.

        Example:
            >>> import tempfile
            >>> path = Path(tempfile.mkdtemp(), "a.txt"); _ = path.write_text("a fine film\\n")
            >>> data = HubDataModule("text", data_files={"train": str(path)}, text_field="sentence")
            >>> data.load_split("train", {"data.text_field": "sentence"})
            Traceback (most recent call last):
            ...
            KeyError: "dataset 'text' split 'train' has no column 'sentence'; its columns are ['text'] (set data...)"
        """
        try:
            import datasets
        except ImportError as error:
            raise ImportError("data=hf_dataset needs the datasets library: pip install datasets") from error
        path, name, named = self.path, self.name, self.splits[split]
        try:
            dataset = datasets.load_dataset(path, name, data_files=self.data_files, split=named)
        except FileNotFoundError:
            raise  # a local file that is not there: its own message, not a download's
        except (ConnectionError, OSError) as error:
            raise OSError(
                f"could not load dataset {path!r} (name={name!r}, split={named!r}) offline: it needs a download from "
                "the Hugging Face Hub. Download it where there is network, or point data.path at a local builder and "
                "files (data.path=csv data.data_files={train: train.csv, validation: dev.csv})"
            ) from error
        missing = [column for column in columns.values() if column not in dataset.column_names]
        if missing:
            absent = repr(missing[0]) if len(columns) == 1 else str(missing)
            raise KeyError(
                f"dataset {path!r} split {named!r} has no column {absent}; its columns are {dataset.column_names} "
                f"(set {' / '.join(columns)})"
            )
        return dataset

    def source(self, split: str) -> str:
        """Where `split`'s rows come from, for errors (a row: this and "row <number>")."""
        return f"dataset {self.path} split {self.splits[split]}"


class HubDataModule(HubDataset, TextDataModule):
    """Any text-classification dataset that `datasets.load_dataset(path, name)` loads (a hub name, or a
    builder such as "csv" with `data_files` for local files). Needs `pip install datasets`.

    Example:
        >>> data = HubDataModule("glue", name="sst2", text_field="sentence")      # loads when set up
        >>> data.splits, data.fields
        ({'train': 'train', 'val': 'validation'}, ('sentence', 'label'))
        >>> data = HubDataModule("csv", data_files={"train": "train.csv", "validation": "dev.csv"}, text_field="text")
    """

    def __init__(
        self,
        path: str,
        name: str | None = None,
        data_files: Any = None,
        text_field: str = "text",
        label_field: str = "label",
        train_split: str = "train",
        val_split: str = "validation",
        num_labels: int = 2,
        **options: Any,
    ) -> None:
        super().__init__(path, name, data_files, train_split, val_split, **options)
        self.fields = (text_field, label_field)
        self.num_labels = num_labels
        self._loaded: dict[str, tuple[list[str], list[int]]] = {}

    def read(self, split: str) -> tuple[list[str], list[int]]:
        if split not in self._loaded:
            text_field, label_field = self.fields
            dataset = self.load_split(split, {"data.text_field": text_field, "data.label_field": label_field})
            self._loaded[split] = (list(dataset[text_field]), [int(label) for label in dataset[label_field]])
        return self._loaded[split]


_WORDS = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])


def frequent_words(texts: Sequence[str], limit: int) -> list[str]:
    """The `limit` most frequent words of `texts` (split as `build_tokenizer` splits), most frequent first.

    Example:
        >>> frequent_words(["a b a", "b a ."], 2)
        ['a', 'b']
    """
    counts = collections.Counter(word for text in texts for word, _ in _WORDS.pre_tokenize_str(text))
    return [word for word, _ in counts.most_common(limit)]
