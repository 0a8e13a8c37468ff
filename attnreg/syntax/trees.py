"""Dependency trees: reading CoNLL-U (the `conllu` library does the parsing) and validating trees.

Example:
    >>> sentences = read_conllu("../shared/data/ud_english_ewt/en_ewt-ud-dev.conllu")
    >>> first = sentences[0]
    >>> first.words[:3], first.heads[:3]           # heads are 1-based word indices, 0 = root
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import conllu


class ConlluError(ValueError):
    """A malformed sentence, reported by file, line and sentence id."""


@dataclass(frozen=True)
class Sentence:
    """One dependency tree over syntactic words (multiword tokens split, empty nodes dropped).

    `heads[i]` is the 1-based index of word i's head (0 for the root); `text` is the surface text;
    `spans[i]` the character span of word i in `text` (None: found by searching the words in order,
    see `word_spans`). `source` and `line` say where the sentence came from, for error messages.
    """

    sent_id: str
    words: tuple[str, ...]
    heads: tuple[int, ...]
    relations: tuple[str, ...]
    text: str
    source: str = ""
    line: int = 0
    spans: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if not len(self.words) == len(self.heads) == len(self.relations):
            raise ConlluError(
                f"{self.where}: {len(self.words)} words, {len(self.heads)} heads and {len(self.relations)} relations"
            )
        check_tree(self.heads, self.where)

    @property
    def where(self) -> str:
        """'file:line (sent_id ...)' for error messages."""
        return f"{self.source}:{self.line} (sent_id {self.sent_id})" if self.source else f"sent_id {self.sent_id}"


def read_conllu(path: str | Path) -> list[Sentence]:
    """All sentences of a CoNLL-U file (`.gz` too), each validated (see `check_tree`)."""
    return list(iter_conllu(path))


def iter_conllu(path: str | Path) -> Iterator[Sentence]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        block: list[str] = []
        start = 1
        for number, line in enumerate(handle, start=1):
            if line.strip():
                if not block:
                    start = number
                block.append(line)
            elif block:
                yield _sentence(block, path, start)
                block = []
        if block:
            yield _sentence(block, path, start)


def _sentence(lines: list[str], path: Path, start: int) -> Sentence:
    where = f"{path}:{start}"
    for offset, line in enumerate(lines):
        fields = line.rstrip("\n").split("\t")
        if not line.startswith("#") and len(fields) != 10:
            raise ConlluError(
                f"{path}:{start + offset}: malformed CoNLL-U line, {len(fields)} tab-separated fields instead of 10"
            )
    try:
        (tokens,) = conllu.parse("".join(lines))
    except (conllu.exceptions.ParseException, ValueError) as error:
        raise ConlluError(f"{where}: malformed CoNLL-U sentence: {error}") from error
    sent_id = tokens.metadata.get("sent_id", f"line {start}")
    words = [token for token in tokens if isinstance(token["id"], int)]  # ranges and empty nodes are tuples
    if not words:
        raise ConlluError(f"{where} (sent_id {sent_id}): the sentence has no words")
    heads = []
    for position, token in enumerate(words, start=1):
        if token["id"] != position:
            raise ConlluError(f"{where} (sent_id {sent_id}): word ids must run 1..n, found {token['id']} at {position}")
        if not isinstance(token["head"], int):
            raise ConlluError(f"{where} (sent_id {sent_id}): word {position} has no numeric head ({token['head']!r})")
        heads.append(token["head"])
    text = tokens.metadata.get("text") or " ".join(token["form"] for token in words)
    return Sentence(
        sent_id=sent_id,
        words=tuple(token["form"] for token in words),
        heads=tuple(heads),
        relations=tuple(token["deprel"] for token in words),
        text=text,
        source=str(path),
        line=start,
        spans=_surface_spans(tokens, text, f"{where} (sent_id {sent_id})"),
    )


def _surface_spans(tokens: conllu.TokenList, text: str, where: str) -> tuple[tuple[int, int], ...]:
    """Each word's character span in `text`. The words of a multiword token (`3-4 don't`) get their own
    spans where their forms appear inside it ("do" + "n't"), else all share the surface token's span."""
    spans: dict[int, tuple[int, int]] = {}
    position = 0
    for token in tokens:
        ident = token["id"]
        if isinstance(ident, tuple) and ident[1] == ".":
            continue  # an empty node has no surface form
        if isinstance(ident, int) and ident in spans:
            continue  # already placed inside its multiword token
        start, end = _find(text, token["form"], position, where)
        position = end
        if isinstance(ident, int):
            spans[ident] = (start, end)
            continue
        members = [t for t in tokens if isinstance(t["id"], int) and ident[0] <= t["id"] <= ident[2]]
        inside, cursor = [], start
        for member in members:
            found = text.find(member["form"], cursor, end)
            if found < 0:
                inside = [(start, end)] * len(members)
                break
            cursor = found + len(member["form"])
            inside.append((found, cursor))
        spans.update({member["id"]: span for member, span in zip(members, inside, strict=True)})
    return tuple(spans[index] for index in range(1, len(spans) + 1))


def _find(text: str, form: str, position: int, where: str) -> tuple[int, int]:
    found = text.find(form, position)
    if found < 0:
        raise ConlluError(f"{where}: the form {form!r} does not occur in the sentence text after character {position}")
    return found, found + len(form)


def check_tree(heads: list[int] | tuple[int, ...], where: str = "sentence") -> None:
    """Raise `ConlluError` unless `heads` (1-based, 0 = root) form one tree: heads in range, one
    root, no cycles."""
    count = len(heads)
    for word, head in enumerate(heads, start=1):
        if not 0 <= head <= count:
            raise ConlluError(f"{where}: word {word} has head {head}, outside 0..{count}")
        if head == word:
            raise ConlluError(f"{where}: word {word} is its own head")
    roots = [word for word, head in enumerate(heads, start=1) if head == 0]
    if len(roots) != 1:
        raise ConlluError(f"{where}: a tree needs exactly one root (head 0), found {len(roots)}: words {roots}")
    for word in range(1, count + 1):
        seen = set()
        while word != 0:
            if word in seen:
                raise ConlluError(f"{where}: the heads form a cycle through words {sorted(seen)}")
            seen.add(word)
            word = heads[word - 1]
