"""Data for the decoder tasks of the training app: causal LM on plain text and chat SFT on rows of messages.

`LMDataModule` reads sentences from a CoNLL-U file (with their parses: the syntax prior needs no parser), a text
file (one text a line, parsed with spaCy when a prior needs a parse) or a `datasets` dataset (`HubLMDataModule`);
`AgreementLMDataModule` generates sentences of the built-in grammar with their trees (no file, for tiny runs).
Batches are padded to their longest row (variable length), and `labels` are the input ids with -100 on padding:
the next-token loss is over real tokens only.

`ChatDataModule` reads rows of `{"messages": [{"role": ..., "content": ...}, ...]}` (JSON lines, or a `datasets`
dataset with a messages column), rendered with the tokenizer's chat template; `labels` keep only the assistant's
tokens (the end-of-turn marker the template writes after each reply included). With the prior on, the last
assistant reply is parsed (or read from the row's `parse`) and the prior covers its words and no template token
(`attnreg.syntax.SyntaxCollator(messages=...)`).

Every row is checked when the data is set up, before training: an empty or malformed CoNLL-U file, a parse whose
words are not in its text, a chat row without an assistant turn, a tokenizer without a chat template, and a row that
would train on nothing (one token of text, or a chat row whose assistant tokens `data.max_length` cuts away: its loss
would be NaN) are refused naming the file and row, and so is a tokenizer that reads most words of a split as unknown
(`check_tokenizer_reads`: the parent accuracy after training would refuse it, the run wasted).

Example:
    >>> import warnings
    >>> data = AgreementLMDataModule(train=8, val=4, seed=0, batch_size=4, with_prior=True)
    >>> data.setup("fit")
    >>> with warnings.catch_warnings(record=True):                 # words whose parent is to their right
    ...     batch = next(iter(data.val_dataloader()))
    >>> sorted(batch), bool((batch["labels"] == -100).eq(batch["attention_mask"] == 0).all())
    (['attention_mask', 'attnreg_prior', 'input_ids', 'labels'], True)
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from attnreg.app.datamodules import AppDataModule, HubDataset, frequent_words
from attnreg.app.task import build_tokenizer, generate, vocabulary
from attnreg.syntax.align import word_spans
from attnreg.syntax.data import SyntaxCollator
from attnreg.syntax.priors import SyntaxPrior
from attnreg.syntax.trees import Sentence, iter_conllu
from attnreg.syntax.vocabulary import check_tokenizer

DEFAULT_PROMPTS = ("The capital of France is", "My favourite food is", "To make a cup of tea, you")
ROLES = ("system", "user", "assistant", "tool")


class LMCollator:
    """Texts (or `Sentence`s) to causal-LM inputs: padded to the batch's longest row, `labels` -100 on padding.

    Example:
        >>> collate = LMCollator(build_tokenizer(["a", "b"]), max_length=8)
        >>> batch = collate([{"text": "a b a"}, {"text": "b"}])
        >>> batch["input_ids"], batch["labels"]
        (tensor([[2, 5, 6, 5, 3],
                [2, 6, 3, 0, 0]]), tensor([[   2,    5,    6,    5,    3],
                [   2,    6,    3, -100, -100]]))
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_length: int | None = 128) -> None:
        check_lm_max_length(max_length)
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, examples: Sequence[Sentence | Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        texts = [example.text if isinstance(example, Sentence) else example["text"] for example in examples]
        encoding = self.tokenizer(
            texts, padding=True, truncation=self.max_length is not None, max_length=self.max_length, return_tensors="pt"
        )
        batch = {key: encoding[key] for key in ("input_ids", "attention_mask")}
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return batch


def check_lm_max_length(max_length: int | None) -> None:
    """Refuse a `max_length` under 2 tokens: a causal LM predicts each token from the ones before it, so rows cut to
    one token train on nothing (a NaN loss).

    Example:
        >>> check_lm_max_length(1)
        Traceback (most recent call last):
        ...
        ValueError: data.max_length=1 leaves each row at most 1 token: a causal LM predicts each token from the ones ...
    """
    if max_length is not None and max_length < 2:
        raise ValueError(
            f"data.max_length={max_length} leaves each row at most {max(max_length, 0)} token: a causal LM predicts "
            "each token from the ones before it, so it would train on nothing (a NaN loss); set data.max_length to "
            "2 or more (null: no limit)"
        )


def check_lm_rows(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], wheres: Sequence[str], max_length: int | None
) -> None:
    """Refuse rows that would train on nothing: a `max_length` under 2 (`check_lm_max_length`), or a text that
    tokenizes as `LMCollator` tokenizes it (special tokens included) to a single token, which no token precedes (a
    batch of such rows has a NaN loss). Names the first such row by its `wheres` entry (file:line), counts the others.

    Example:
        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> from transformers import PreTrainedTokenizerFast
        >>> backend = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "hello": 2, "there": 3}, unk_token="[UNK]"))
        >>> backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()          # no BOS or EOS token added
        >>> tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]")
        >>> check_lm_rows(tokenizer, ["hello there"], ["t.txt:1"], max_length=8)
        >>> check_lm_rows(tokenizer, ["hello there", "hello"], ["t.txt:1", "t.txt:2"], max_length=8)
        Traceback (most recent call last):
        ...
        ValueError: t.txt:2: 'hello' is 1 token (the tokenizer adds no BOS or EOS token): a causal LM ...
    """
    check_lm_max_length(max_length)
    lengths = [len(ids) for ids in tokenizer(list(texts))["input_ids"]] if texts else []
    short = [index for index, length in enumerate(lengths) if length < 2]
    if short:
        first = short[0]
        more = len(short) - 1
        others = f" ({more} more row{'s are' if more > 1 else ' is'} so)" if more else ""
        raise ValueError(
            f"{wheres[first]}: {texts[first]!r} is {lengths[first]} token (the tokenizer adds no BOS or "
            "EOS token): a causal LM predicts each token from the ones before it, so the row would train on nothing "
            f"(a NaN loss in a batch of such rows){others}. Remove it, or raise data.min_words to drop rows this short"
        )


def check_tokenizer_reads(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], source: str) -> None:
    """Refuse, before training, a tokenizer that reads most words of `texts` (from `source`, a data file) as unknown
    (`attnreg.analysis.check_tokenizer`, the check the parent accuracy runs after training): naming the data, the
    tokenizer (its `name_or_path`) and the share of unknown words.

    Example:
        >>> check_tokenizer_reads(build_tokenizer(["the", "dog"]), ["the dog sees"], "data.train=a.txt")
        >>> check_tokenizer_reads(build_tokenizer(["x"]), ["the dog sees"], "data.train=a.txt")
        Traceback (most recent call last):
        ...
        ValueError: data.train=a.txt: the tokenizer (built from the training data's words) cannot tokenize the text: ...
    """
    try:
        check_tokenizer(tokenizer, texts)
    except ValueError as error:
        name = getattr(tokenizer, "name_or_path", "") or "built from the training data's words"
        detail = str(error).removeprefix("the tokenizer cannot tokenize the text: ")
        raise ValueError(
            f"{source}: the tokenizer ({name}) cannot tokenize the text: {detail}. Refused before training: the "
            "model would learn little but the unknown token, and its parent accuracy could not be measured"
        ) from error


class DecoderDataModule(AppDataModule):
    """What the decoder data modules share beyond `AppDataModule` (whose `options` they take): a word-level tokenizer
    built from the training texts' `vocab_size` most frequent words when the model brings none (`chat_template`, when
    set, replaces the tokenizer's), held-out sentences with trees for parent accuracy, and prompts for greedy
    continuations."""

    task = "causal_lm"
    num_labels = None

    def __init__(
        self,
        batch_size: int = 8,
        eval_batch_size: int = 32,
        vocab_size: int = 8000,
        prompts: Sequence[str] = DEFAULT_PROMPTS,
        chat_template: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(batch_size=batch_size, eval_batch_size=eval_batch_size, **options)
        self.vocab_size, self.prompts, self.chat_template = vocab_size, list(prompts), chat_template

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        tokenizer = super().tokenizer
        if self.chat_template is not None and tokenizer.chat_template != self.chat_template:
            tokenizer.chat_template = self.chat_template
        return tokenizer

    def build_tokenizer(self) -> PreTrainedTokenizerBase:
        return build_tokenizer(frequent_words(self.vocabulary_texts(), self.vocab_size))

    def vocabulary_texts(self) -> list[str]:
        """The texts a word-level tokenizer is built from (the training split's)."""
        self.setup("fit")
        return [_text(example) for example in self.datasets["train"]]

    def build_collator(self) -> Callable:
        if self.with_prior:
            return SyntaxCollator(
                self.tokenizer, prior=self.prior, max_length=self.max_length, causal=True, lm_labels=True
            )
        return LMCollator(self.tokenizer, max_length=self.max_length)

    def tree_sentences(self) -> list[Sentence] | None:
        sentences = [example for example in self.datasets.get("val", []) if isinstance(example, Sentence)]
        return sentences or None

    def source(self, split: str) -> str:
        """Where `split`'s rows come from, for errors."""
        return f"data.{split}"

    def check_vocabulary(self, datasets: Mapping[str, Sequence[Any]]) -> None:
        """`check_tokenizer_reads` on each split's texts, naming its `source`."""
        for split, rows in datasets.items():
            if rows:
                check_tokenizer_reads(self.tokenizer, [_text(row) for row in rows], self.source(split))


class LMDataModule(DecoderDataModule):
    r"""Causal LM on the sentences of files: CoNLL-U (`.conllu`, `.conllu.gz`: gold trees) or text (one text a line;
    parsed with spaCy, the `parse` extra, when `with_prior`). `limit_train`/`limit_val` keep the first n rows,
    `min_words` drops shorter sentences.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> _ = (folder / "train.txt").write_text("the dog sees a cat\n\nthe cats run\n")
        >>> data = LMDataModule(str(folder / "train.txt"), str(folder / "train.txt"), batch_size=2)
        >>> data.setup("fit"); data.datasets["train"]                          # empty lines are skipped
        [{'text': 'the dog sees a cat'}, {'text': 'the cats run'}]
        >>> _ = (folder / "empty.txt").write_text("\n")
        >>> LMDataModule(str(folder / "empty.txt"), str(folder / "train.txt")).setup("fit")
        Traceback (most recent call last):
        ...
        ValueError: /.../empty.txt: no sentence (with at least 1 word) in the file
    """

    def __init__(
        self,
        train: str,
        val: str,
        limit_train: int | None = None,
        limit_val: int | None = None,
        min_words: int = 1,
        min_words_val: int = 1,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.files = {"train": train, "val": val}
        self.limits = {"train": limit_train, "val": limit_val}
        self.min_words = {"train": min_words, "val": min_words_val}
        self.wheres: dict[str, list[str]] = {}  # where each row `read` kept comes from (file:line), for errors

    def read(self, split: str) -> list[Sentence | dict[str, str]]:
        path = Path(self.files[split]).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"data.{split}: {path} does not exist (resolved: {path.resolve()})")
        if path.name.endswith((".conllu", ".conllu.gz")):
            long_enough = (s for s in iter_conllu(path) if len(s.words) >= self.min_words[split])
            rows: list = list(itertools.islice(long_enough, self.limits[split]))  # the first n: no need to read on
            for sentence in rows:
                word_spans(sentence)  # raises naming file:line when the words are not in the text
            self.wheres[split] = [sentence.where for sentence in rows]
        else:
            least = max(self.min_words[split], 1)
            lines = enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
            numbered = [(number, line.strip()) for number, line in lines if len(line.split()) >= least]
            rows = [{"text": text} for _, text in numbered]
            self.wheres[split] = [f"{path}:{number}" for number, _ in numbered]
        if not rows:
            raise ValueError(f"{path}: no sentence (with at least {self.min_words[split]} word) in the file")
        return rows

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        for split in ("train", "val"):
            self.datasets[split] = self.read(split)[: self.limits[split]]
        try:  # with the rows in place: a tokenizer built from them reads them through `setup`
            for split in ("train", "val"):
                rows = self.datasets[split]
                wheres = self.wheres.get(split, [])[: len(rows)]
                wheres += [f"data.{split} row {number}" for number in range(len(wheres) + 1, len(rows) + 1)]
                check_lm_rows(self.tokenizer, [_text(row) for row in rows], wheres, self.max_length)
            self.check_vocabulary(self.datasets)
        except ValueError:
            self.datasets = {}
            raise
        for split, rows in self.datasets.items():
            if self.with_prior and rows and not isinstance(rows[0], Sentence):
                from attnreg.syntax.parse import parse_texts

                self.datasets[split] = parse_texts([row["text"] for row in rows])

    def source(self, split: str) -> str:
        return f"data.{split}={self.files[split]}"


class HubLMDataModule(HubDataset, LMDataModule):
    """Causal LM on a `datasets` dataset's `text_field` (a hub name, or a builder such as "text" or "json" with
    `data_files`); parsed with spaCy when `with_prior`.

    Example:
        >>> data = HubLMDataModule("text", data_files={"train": "a.txt", "validation": "b.txt"})   # loads when set up
        >>> data.splits, data.text_field
        ({'train': 'train', 'val': 'validation'}, 'text')
    """

    def __init__(
        self,
        path: str,
        name: str | None = None,
        data_files: Any = None,
        text_field: str = "text",
        train_split: str = "train",
        val_split: str = "validation",
        **options: Any,
    ) -> None:
        super().__init__(path, name, data_files, train_split, val_split, train="", val="", **options)
        self.text_field = text_field

    def read(self, split: str) -> list[dict[str, str]]:
        dataset = self.load_split(split, {"data.text_field": self.text_field})
        least = max(self.min_words[split], 1)
        numbered = [(number, text.strip()) for number, text in enumerate(dataset[self.text_field], start=1)]
        numbered = [(number, text) for number, text in numbered if len(text.split()) >= least]
        rows = [{"text": text} for _, text in numbered]
        self.wheres[split] = [f"{self.source(split)} row {number}" for number, _ in numbered]
        if not rows:
            raise ValueError(f"dataset {self.path!r} split {self.splits[split]!r}: no text")
        return rows


class AgreementLMDataModule(DecoderDataModule):
    """Sentences of the built-in grammar (`attnreg.app.task`) with their gold trees, the masked subject written out
    in its number: causal LM with no file and no parser (tiny runs, tests).

    Example:
        >>> data = AgreementLMDataModule(train=4, val=2, seed=0); data.setup()
        >>> data.datasets["val"][0].text
        'your dog behind your box that finds your key sees their tables that push my cats that like our table .'
    """

    def __init__(self, train: int = 500, val: int = 100, seed: int = 0, **options: Any) -> None:
        options.setdefault("prompts", ("the dog", "the cats that see"))
        super().__init__(seed=seed, **options)
        self.sizes = {"train": train, "val": val}

    def vocabulary_texts(self) -> list[str]:
        return [" ".join(vocabulary())]

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        datasets = {
            split: grammar_sentences(self.sizes[split], self.seed + 1000 * offset)
            for offset, split in enumerate(("train", "val"))
        }
        self.check_vocabulary(datasets)
        self.datasets.update(datasets)

    def source(self, split: str) -> str:
        return f"data.{split} (sentences of the built-in grammar)"


def grammar_sentences(count: int, seed: int) -> list[Sentence]:
    """`count` sentences of the built-in grammar with gold trees, the masked subject written out in its number.

    Example:
        >>> [sentence.text for sentence in grammar_sentences(2, seed=1)]
        ['your dog watches my keys that know the cat .', 'our dogs know my cats that your teacher that sees ...']
    """
    import dataclasses

    from attnreg.app.task import MASK

    out = []
    for example in generate(count, seed=seed):
        noun = "dogs" if example.label else "dog"
        words = tuple(noun if word == MASK else word for word in example.sentence.words)
        out.append(dataclasses.replace(example.sentence, words=words, text=" ".join(words), spans=None))
    return out


# -- chat SFT ----------------------------------------------------------------------------------------------------


class ChatCollator:
    """Rows of messages to chat-SFT inputs: each row rendered with the tokenizer's chat template (no special tokens
    added on top), `labels` the input ids on the assistant's tokens and -100 elsewhere. With a `prior`, the last
    assistant reply's words carry it (`SyntaxCollator(messages=...)`: no template token gets a prior row).

    Example:
        >>> tokenizer = build_tokenizer(["hi", "hello", "there", "user", "assistant", "<", ">", "|"])
        >>> tokenizer.chat_template = TINY_CHAT_TEMPLATE
        >>> row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
        >>> batch = ChatCollator(tokenizer)([row])
        >>> tokenizer.decode(batch["input_ids"][0]), tokenizer.decode(batch["labels"][0][batch["labels"][0] >= 0])
        ('< | user | > hi < | assistant | > hello there', 'hello there')
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prior: SyntaxPrior | None = None, max_length: int | None = 256
    ) -> None:
        check_chat_template(tokenizer)
        self.tokenizer, self.max_length = tokenizer, max_length
        self.causal = True
        self.syntax = (
            SyntaxCollator(tokenizer, prior=prior, max_length=max_length, causal=True, messages=self._conversation)
            if prior is not None
            else None
        )
        self._pending: list[list[dict[str, str]]] = []

    @property
    def stats(self) -> Any:
        """The prior's counts (`SyntaxCollator.stats`); None without a prior."""
        return None if self.syntax is None else self.syntax.stats

    def _conversation(self, text: str) -> list[dict[str, str]]:
        messages = self._pending.pop(0)
        assert messages[last_assistant(messages)]["content"] == text
        return messages

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        rendered = [render_chat(self.tokenizer, row["messages"], row.get("where", "row")) for row in rows]
        texts = [text for text, _ in rendered]
        options = {"padding": True, "truncation": self.max_length is not None, "max_length": self.max_length}
        encoding = self.tokenizer(
            texts, add_special_tokens=False, return_offsets_mapping=True, return_tensors="pt", **options
        )
        if self.syntax is not None:
            self._pending = [list(row["messages"]) for row in rows]
            batch = self.syntax([row["sentence"] for row in rows])
            assert torch.equal(batch["input_ids"], encoding["input_ids"])
        else:
            batch = {key: encoding[key] for key in ("input_ids", "attention_mask")}
        starts, ends = encoding["offset_mapping"][..., 0], encoding["offset_mapping"][..., 1]
        assistant = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
        for row, (_, spans) in enumerate(rendered):
            for begin, end in spans:
                assistant[row] |= (starts[row] >= begin) & (starts[row] < end) & (ends[row] > starts[row])
        keep = assistant & batch["attention_mask"].bool()
        batch["labels"] = batch["input_ids"].masked_fill(~keep, -100)
        trained = (batch["labels"][:, 1:] != -100).any(dim=1)  # the loss predicts tokens 1 and on
        if not bool(trained.all()):
            row = int((~trained).nonzero()[0])
            raise ValueError(
                f"{rows[row].get('where', f'row {row}')}: no assistant token is left after truncation to max_length="
                f"{self.max_length}: the row would train on nothing (a NaN loss). Raise data.max_length "
                "(ChatDataModule checks every row when set up, saying how many tokens it needs)"
            )
        return batch


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %} <|assistant|> {% endif %}"
)
"""A minimal chat template (tests, tiny word-level tokenizers): `<|role|> content` turns separated by spaces."""


def check_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """Refuse a tokenizer without a chat template, saying how to give one.

    Example:
        >>> check_chat_template(build_tokenizer(["a"]))
        Traceback (most recent call last):
        ...
        ValueError: chat data needs a tokenizer with a chat template; ... has none: use an instruct model's ...
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"chat data needs a tokenizer with a chat template; {type(tokenizer).__name__} (name_or_path "
            f"{tokenizer.name_or_path!r}) has none: use an instruct model's tokenizer or set data.chat_template"
        )


def last_assistant(messages: Sequence[Mapping[str, str]]) -> int:
    """Index of the last assistant turn; -1 when there is none."""
    roles = [message.get("role") for message in messages]
    return len(roles) - 1 - roles[::-1].index("assistant") if "assistant" in roles else -1


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]], where: str = "row"
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered by the chat template and the character spans of the assistant's replies: each from
    the end of the conversation before it (with the generation prompt) to the end of the conversation with it.
    Raises naming `where` when the template does not render a conversation as an extension of its beginning.

    Example:
        >>> tokenizer = build_tokenizer(["a"]); tokenizer.chat_template = TINY_CHAT_TEMPLATE
        >>> render_chat(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
        ('<|user|> hi <|assistant|> yo', [(26, 28)])
    """
    text = tokenizer.apply_chat_template(list(messages), tokenize=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(list(messages[:index]), tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(list(messages[: index + 1]), tokenize=False)
        if not (text.startswith(upto) and upto.startswith(before)):
            raise ValueError(
                f"{where}: the chat template does not render the conversation up to assistant turn {index} as the "
                "beginning of the whole one, so the assistant's tokens cannot be found"
            )
        spans.append((len(before), len(upto)))
    return text, spans


def check_assistant_tokens(
    tokenizer: PreTrainedTokenizerBase,
    rendered: Sequence[tuple[str, Sequence[tuple[int, int]]]],
    wheres: Sequence[str],
    max_length: int | None,
) -> None:
    """Refuse rows (`render_chat`'s text and assistant spans) that would train on nothing, as `ChatCollator`
    tokenizes them: no assistant token the loss predicts (tokens 1 and on), or none left once `max_length` cuts the
    row (on the tokenizer's `truncation_side`). Names the first such row by its `wheres` entry (file:line), the
    setting `data.max_length` and how many tokens the row needs; counts the others.

    Example:
        >>> tokenizer = build_tokenizer(["a"]); tokenizer.chat_template = TINY_CHAT_TEMPLATE
        >>> messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "yo"}]
        >>> rendered = [render_chat(tokenizer, messages)]
        >>> check_assistant_tokens(tokenizer, rendered, ["chat.jsonl:1"], max_length=13)
        >>> check_assistant_tokens(tokenizer, rendered, ["chat.jsonl:1"], max_length=12)
        Traceback (most recent call last):
        ...
        ValueError: chat.jsonl:1: data.max_length=12 cuts away every assistant token (the row renders to 13 tokens and
        its first assistant token is token 13), so the row would train on nothing (a NaN loss). Set data.max_length to
        13 or more to keep one (13 keeps the whole row), or shorten the conversation.
    """
    encoding = tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    left = getattr(tokenizer, "truncation_side", "right") == "left"
    refused: list[tuple[str, str, str]] = []  # (where, what is wrong, the fix)
    longest = 0
    for (_, spans), offsets, where in zip(rendered, encoding["offset_mapping"], wheres, strict=True):
        tokens = len(offsets)
        assistant = [
            index
            for index, (start, end) in enumerate(offsets)
            if index >= 1 and end > start and any(begin <= start < stop for begin, stop in spans)
        ]
        if not assistant:
            refused.append(
                (where, "the assistant's replies render to no token the loss predicts", "Give the reply text.")
            )
            continue
        if max_length is None:
            continue
        if left:  # the last `max_length` tokens are kept; the first of them is not predicted
            needed, which = tokens - assistant[-1] + 1, f"last assistant token is token {assistant[-1] + 1}"
        else:
            needed, which = assistant[0] + 1, f"first assistant token is token {assistant[0] + 1}"
        if max_length < needed:
            longest = max(longest, needed)
            what = (
                f"data.max_length={max_length} cuts away every assistant token (the row renders to {tokens} tokens "
                f"and its {which})"
            )
            fix = (
                f"Set data.max_length to {needed} or more to keep one ({tokens} keeps the whole row), or shorten "
                "the conversation."
            )
            refused.append((where, what, fix))
    if refused:
        where, what, fix = refused[0]
        more = len(refused) - 1
        others = f" {more} more row{'s are' if more > 1 else ' is'} refused too" if more else ""
        if others and longest:
            others += f"; the longest needs data.max_length={longest}"
        raise ValueError(f"{where}: {what}, so the row would train on nothing (a NaN loss). {fix}{others}")


def check_messages(row: Any, where: str) -> list[dict[str, str]]:
    """The row's messages, checked: a list of {"role", "content"} with known roles and at least one assistant turn.

    Example:
        >>> check_messages({"messages": [{"role": "user", "content": "hi"}]}, "chat.jsonl:3")
        Traceback (most recent call last):
        ...
        ValueError: chat.jsonl:3: no assistant turn (roles ['user']): nothing to train on
    """
    messages = row.get("messages") if isinstance(row, Mapping) else None
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: expected a non-empty 'messages' list, got {type(messages).__name__}")
    for turn in messages:
        if not isinstance(turn, Mapping) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
            raise ValueError(f"{where}: each message needs a role in {list(ROLES)} and a string content, got {turn!r}")
    if last_assistant(messages) < 0:
        raise ValueError(f"{where}: no assistant turn (roles {[t['role'] for t in messages]}): nothing to train on")
    return [dict(turn) for turn in messages]


class ChatDataModule(DecoderDataModule):
    """Chat SFT on JSON lines files (`train`, `val`), one `{"messages": [...]}` row a line; a row may carry the parse
    of its last assistant reply as `"parse": {"words", "heads", "relations"}` (else, with the prior on, spaCy parses
    it). Rows are checked when set up (see `check_messages`, and `check_assistant_tokens`: a row whose assistant
    tokens `max_length` cuts away is refused), the chat template too.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp(), "chat.jsonl")
        >>> _ = path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\\n')
        >>> ChatDataModule(str(path), str(path), chat_template=TINY_CHAT_TEMPLATE).setup("fit")
        Traceback (most recent call last):
        ...
        ValueError: /.../chat.jsonl:1: no assistant turn (roles ['user']): nothing to train on
    """

    task = "chat"

    def __init__(self, train: str, val: str, limit_train: int | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.files = {"train": train, "val": val}
        self.limit_train = limit_train
        self.messages_field = "messages"

    def read_rows(self, split: str) -> list[tuple[str, Any]]:
        """(where, row) of `split`'s JSON lines."""
        path = Path(self.files[split]).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"data.{split}: {path} does not exist (resolved: {path.resolve()})")
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    rows.append((f"{path}:{number}", json.loads(line)))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from error
        if not rows:
            raise ValueError(f"{path}: no row in the file")
        return rows

    def vocabulary_texts(self) -> list[str]:
        markers = " ".join([*ROLES, "<", "|", ">"])  # what the pieces of a `<|role|>` template split into
        return [markers, *(turn["content"] for _, row in self.read_rows("train") for turn in row.get("messages") or [])]

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        check_chat_template(self.tokenizer)
        datasets = {}  # kept only once both splits pass: a second `setup` after an error checks again
        for split in ("train", "val"):
            rows = self.read_rows(split)[: self.limit_train if split == "train" else None]
            items, rendered = [], []
            for where, row in rows:
                if self.messages_field != "messages" and isinstance(row, Mapping):
                    row = {**row, "messages": row.get(self.messages_field)}
                messages = check_messages(row, where)
                rendered.append(render_chat(self.tokenizer, messages, where))
                items.append({"messages": messages, "where": where, "sentence": self.reply(row, messages, where)})
            check_assistant_tokens(self.tokenizer, rendered, [item["where"] for item in items], self.max_length)
            self.check_vocabulary({split: items})
            if self.with_prior:
                self._parse_missing(items)
            datasets[split] = items
        self.datasets.update(datasets)

    def source(self, split: str) -> str:
        return f"data.{split}={self.files[split]}"

    def reply(self, row: Mapping[str, Any], messages: list[dict[str, str]], where: str) -> Sentence | None:
        """The last assistant reply as a `Sentence` when the row gives its parse (else None: parsed if needed)."""
        parse = row.get("parse")
        if parse is None:
            return None
        text = messages[last_assistant(messages)]["content"]
        sentence = Sentence(where, tuple(parse["words"]), tuple(parse["heads"]), tuple(parse["relations"]), text)
        word_spans(sentence)
        return sentence

    def _parse_missing(self, items: list[dict[str, Any]]) -> None:
        missing = [item for item in items if item["sentence"] is None]
        if missing:
            from attnreg.syntax.parse import parse_texts

            texts = [item["messages"][last_assistant(item["messages"])]["content"] for item in missing]
            for item, sentence in zip(missing, parse_texts(texts), strict=True):
                item["sentence"] = sentence

    def build_collator(self) -> Callable:
        return ChatCollator(self.tokenizer, self.prior if self.with_prior else None, self.max_length)

    def tree_sentences(self) -> list[Sentence] | None:
        sentences = [item["sentence"] for item in self.datasets.get("val", []) if item["sentence"] is not None]
        return sentences or None


class HubChatDataModule(HubDataset, ChatDataModule):
    """Chat SFT on a `datasets` dataset whose `messages_field` holds each row's messages (a hub name, or the "json"
    builder with `data_files`); rows are checked as `ChatDataModule`'s, named by split and row number.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp(), "chat.jsonl")
        >>> row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
        >>> _ = path.write_text(json.dumps(row) + "\\n")
        >>> data = HubChatDataModule("json", data_files={"train": str(path), "validation": str(path)},
        ...                          chat_template=TINY_CHAT_TEMPLATE)
        >>> data.setup(); data.datasets["val"][0]["where"], len(data.datasets["train"])
        ('dataset json split validation row 1', 1)
    """

    def __init__(
        self,
        path: str,
        name: str | None = None,
        data_files: Any = None,
        messages_field: str = "messages",
        train_split: str = "train",
        val_split: str = "validation",
        **options: Any,
    ) -> None:
        super().__init__(path, name, data_files, train_split, val_split, train="", val="", **options)
        self.messages_field = messages_field

    def read_rows(self, split: str) -> list[tuple[str, Any]]:
        dataset = self.load_split(split, {"data.messages_field": self.messages_field})
        return [(f"{self.source(split)} row {number}", row) for number, row in enumerate(dataset, start=1)]


def _text(example: Any) -> str:
    if isinstance(example, Sentence):
        return example.text
    if "messages" in example:
        return " ".join(turn["content"] for turn in example["messages"])
    return example["text"]
