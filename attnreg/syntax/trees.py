r"""Dependency trees: reading CoNLL-U (the `conllu` library does the parsing) and validating trees.

Example:
    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp(), "tiny.conllu")          # or en_ewt-ud-dev.conllu
    >>> _ = path.write_text(
    ...     "# sent_id = s1\n# text = Keys rattle.\n"
    ...     "1\tKeys\t_\tNOUN\t_\t_\t2\tnsubj\t_\t_\n"
    ...     "2\trattle\t_\tVERB\t_\t_\t0\troot\t_\tSpaceAfter=No\n"
    ...     "3\t.\t_\tPUNCT\t_\t_\t2\tpunct\t_\t_\n"
    ... )
    >>> first = read_conllu(path)[0]
    >>> first.words, first.heads           # heads are 1-based word indices, 0 = root
    (('Keys', 'rattle', '.'), (2, 0, 2))
    >>> first.relations, first.spans
    (('nsubj', 'root', 'punct'), ((0, 4), (5, 11), (11, 12)))
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import conllu


class ConlluError(ValueError):
    """A malformed sentence, reported by file, line and sentence id.

    Example:
        >>> Sentence("s1", words=("a", "b"), heads=(0, 0), relations=("root", "dep"), text="a b")
        Traceback (most recent call last):
        ...
        attnreg.syntax.trees.ConlluError: sent_id s1: a tree needs exactly one root (head 0), found 2: words [1, 2]
    """


@dataclass(frozen=True)
class Sentence:
    """One dependency tree over syntactic words (multiword tokens split, empty nodes dropped).

    `heads[i]` is the 1-based index of word i's head (0 for the root); `text` is the surface text;
    `spans[i]` the character span of word i in `text` (None: found by searching the words in order,
    see `word_spans`). `source` and `line` say where the sentence came from, for error messages.
    From a CoNLL-U file each word also keeps its `lemmas`, `upos`, `xpos` and `feats` (the FEATS column as
    written, "_" for none; `feature` reads one); None where the sentence was built otherwise.

    Example:
        >>> sentence = Sentence("s1", ("The", "keys", "rattle"), (2, 3, 0), ("det", "nsubj", "root"), "The keys rattle")
        >>> sentence.words[sentence.heads[1] - 1]         # the head of "keys"
        'rattle'
        >>> sentence.where
        'sent_id s1'
        >>> Sentence("s2", ("Keys",), (0,), ("root",), "Keys", feats=("Number=Plur",)).feature(0, "Number")
        'Plur'
    """

    sent_id: str
    words: tuple[str, ...]
    heads: tuple[int, ...]
    relations: tuple[str, ...]
    text: str
    source: str = ""
    line: int = 0
    spans: tuple[tuple[int, int], ...] | None = None
    lemmas: tuple[str, ...] | None = None
    upos: tuple[str, ...] | None = None
    xpos: tuple[str, ...] | None = None
    feats: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not len(self.words) == len(self.heads) == len(self.relations):
            raise ConlluError(
                f"{self.where}: {len(self.words)} words, {len(self.heads)} heads and {len(self.relations)} relations"
            )
        for name in ("lemmas", "upos", "xpos", "feats"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.words):
                raise ConlluError(f"{self.where}: {len(values)} {name} for {len(self.words)} words")
        check_tree(self.heads, self.where)

    def feature(self, word: int, name: str) -> str | None:
        """The value of feature `name` (as "Number") of word `word` (0-based), None where it has none."""
        if self.feats is None:
            return None
        for pair in self.feats[word].split("|"):
            key, _, value = pair.partition("=")
            if key == name:
                return value
        return None

    @property
    def where(self) -> str:
        """'file:line (sent_id ...)' for error messages."""
        return f"{self.source}:{self.line} (sent_id {self.sent_id})" if self.source else f"sent_id {self.sent_id}"


def read_conllu(path: str | Path) -> list[Sentence]:
    r"""All sentences of a CoNLL-U file (`.gz` too), each validated (see `check_tree`).

    A malformed file raises `ConlluError` naming the file and line: bytes that are not UTF-8, a row
    without exactly 10 tab-separated columns, a column the `conllu` parser cannot read, word ids
    that do not run 1..n, a misplaced multiword-token range, a head that is not a number, or heads
    that do not form one tree. A sentence without a `# text` line gets its text rebuilt from its tokens
    (`surface_text`: multiword tokens whole, `SpaceAfter=No` honoured), as the UD tools do.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp(), "bad.conllu")
        >>> _ = path.write_text("1\tKeys\t_\tNOUN\t_\t_\t0\troot\t_\n")       # 9 columns
        >>> read_conllu(path)
        Traceback (most recent call last):
        ...
        attnreg.syntax.trees.ConlluError: /.../bad.conllu:1: malformed CoNLL-U line, 9 tab-separated fields ...
        >>> _ = path.write_text("\n")                                           # empty
        >>> read_conllu(path)
        Traceback (most recent call last):
        ...
        attnreg.syntax.trees.ConlluError: /.../bad.conllu holds no sentence: an empty CoNLL-U file ...
    """
    sentences = list(iter_conllu(path))
    if not sentences:
        raise ConlluError(f"{path} holds no sentence: an empty CoNLL-U file cannot be used")
    return sentences


def iter_conllu(path: str | Path) -> Iterator[Sentence]:
    r"""The sentences of a CoNLL-U file one at a time (see `read_conllu`).

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp(), "tiny.conllu.gz")
        >>> with gzip.open(path, "wt") as handle:
        ...     _ = handle.write("1\tHello\t_\tINTJ\t_\t_\t0\troot\t_\t_\n\n1\tBye\t_\tINTJ\t_\t_\t0\troot\t_\t_\n")
        >>> [sentence.words for sentence in iter_conllu(path)]
        [('Hello',), ('Bye',)]
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    block: list[str] = []
    start, number = 1, 0
    with opener(path, "rb") as handle:
        try:
            for number, raw in enumerate(handle, start=1):
                line = _decode(raw, path, number)
                if line.strip():
                    if not block:
                        start = number
                    block.append(line)
                elif block:
                    yield _sentence(block, path, start)
                    block = []
        except (EOFError, zlib.error, gzip.BadGzipFile) as error:
            raise ConlluError(f"{path}:{number + 1}: the compressed file is damaged or cut short: {error}") from error
    if block:
        yield _sentence(block, path, start)


def read_arcs(path: str | Path) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    r"""(heads, relations) of every sentence of a CoNLL-U file (`.gz` too), read fast from the HEAD and DEPREL
    columns of the word rows (multiword-token ranges and empty nodes skipped, as `read_conllu` does), without
    validating anything: for counting what a whole file holds (`SyntaxCollator` checks its prior kinds so), not
    for reading trees.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp(), "tiny.conllu")
        >>> _ = path.write_text("1-2\tdon't\t_\t_\t_\t_\t_\t_\t_\t_\n1\tdo\t_\tAUX\t_\t_\t0\troot\t_\t_\n"
        ...                     "2\tn't\t_\tPART\t_\t_\t1\tadvmod\t_\t_\n")
        >>> read_arcs(path)
        [((0, 1), ('root', 'advmod'))]
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    out: list[tuple[tuple[int, ...], tuple[str, ...]]] = []
    heads: list[int] = []
    relations: list[str] = []
    with opener(path, "rt", encoding="utf-8-sig") as handle:
        for line in handle:
            if not line.strip():
                if heads:
                    out.append((tuple(heads), tuple(relations)))
                    heads, relations = [], []
                continue
            if line.startswith("#"):
                continue
            columns = line.split("\t", 8)
            if len(columns) < 8 or not columns[0].isdigit():  # a multiword-token range or an empty node
                continue
            heads.append(int(columns[6]) if columns[6].isdigit() else -1)
            relations.append(columns[7])
    if heads:
        out.append((tuple(heads), tuple(relations)))
    return out


def _decode(raw: bytes, path: Path, number: int) -> str:
    """Line `number` (1-based) as text; a byte-order mark at the start of the file is dropped."""
    try:
        return raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as error:
        raise ConlluError(f"{path}:{number}: not UTF-8 ({error.reason} at byte {error.start} of the line)") from error


def _sentence(lines: list[str], path: Path, start: int) -> Sentence:
    rows = [start + offset for offset, line in enumerate(lines) if not line.startswith("#")]  # each token's line
    for row in rows:
        _check_columns(lines[row - start], f"{path}:{row}")
    try:
        (tokens,) = conllu.parse("".join(lines))
    except conllu.exceptions.ParseException as error:
        row = next((row for row in rows if not _parses(lines[row - start])), start)
        raise ConlluError(f"{path}:{row}: malformed CoNLL-U line: {error}") from error
    sent_id = tokens.metadata.get("sent_id", f"line {start}")
    where = f"{path}:{start} (sent_id {sent_id})"
    words = [token for token in tokens if isinstance(token["id"], int)]  # ranges and empty nodes are tuples
    if not words:
        raise ConlluError(f"{where}: the sentence has no words")
    _check_tokens(tokens, [f"{path}:{row} (sent_id {sent_id})" for row in rows], len(words))
    text = tokens.metadata.get("text") or surface_text(tokens)
    return Sentence(
        sent_id=sent_id,
        words=tuple(token["form"] for token in words),
        heads=tuple(token["head"] for token in words),
        relations=tuple(token["deprel"] for token in words),
        text=text,
        source=str(path),
        line=start,
        spans=_surface_spans(tokens, text, where),
        lemmas=tuple(token["lemma"] or "_" for token in words),
        upos=tuple(token["upos"] or "_" for token in words),
        xpos=tuple(token["xpos"] or "_" for token in words),
        feats=tuple(_feats(token["feats"]) for token in words),
    )


def _feats(feats: dict[str, str] | None) -> str:
    """The FEATS column as written ("_" for none), from the `conllu` parser's dict."""
    return "|".join(f"{key}={value}" for key, value in feats.items()) if feats else "_"


def surface_text(tokens: conllu.TokenList) -> str:
    r"""The sentence text rebuilt from its tokens, for a sentence without `# text`, as the UD tools do: each
    surface token (a multiword token's own form, as `3-4 don't`, not its words) followed by a space unless
    its MISC column has `SpaceAfter=No`; empty nodes have no surface form.

    Example:
        >>> rows = ["1-2\tdon't\t_\t_\t_\t_\t_\t_\t_\t_", "1\tdo\t_\tAUX\t_\t_\t3\taux\t_\t_",
        ...         "2\tn't\t_\tPART\t_\t_\t3\tadvmod\t_\t_", "3\tgo\t_\tVERB\t_\t_\t0\troot\t_\tSpaceAfter=No",
        ...         "4\t!\t_\tPUNCT\t_\t_\t3\tpunct\t_\t_"]
        >>> surface_text(conllu.parse("\n".join(rows) + "\n\n")[0])
        "don't go!"
    """
    parts, inside = [], 0
    for token in tokens:
        ident = token["id"]
        if isinstance(ident, tuple) and ident[1] == ".":
            continue  # an empty node
        if isinstance(ident, int) and ident <= inside:
            continue  # a word of the multiword token already written
        if isinstance(ident, tuple):
            inside = ident[2]
        misc = token["misc"] or {}
        parts.append(token["form"] + ("" if misc.get("SpaceAfter") == "No" else " "))
    return "".join(parts).rstrip(" ")


def _check_columns(line: str, where: str) -> None:
    """10 tab-separated columns, none empty nor with spaces the `conllu` parser would take for a column break."""
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != 10:
        raise ConlluError(f"{where}: malformed CoNLL-U line, {len(fields)} tab-separated fields instead of 10")
    for name, field in zip(conllu.parser.DEFAULT_FIELDS, fields, strict=True):
        if not field or field != field.strip() or "  " in field:
            raise ConlluError(
                f"{where}: column {name.upper()} is {field!r}; columns are non-empty ('_' for no value), "
                "without leading, trailing or double spaces"
            )


def _parses(line: str) -> bool:
    try:
        conllu.parse(line)
    except conllu.exceptions.ParseException:
        return False
    return True


def _check_tokens(tokens: conllu.TokenList, places: list[str], count: int) -> None:
    """Words numbered 1..count with numeric heads; each range `a-b` right before word a, within the words
    and overlapping no other range. Empty nodes (`k.m`) are dropped, so not checked. `places`: each token's
    'file:line (sent_id ...)'."""
    words = covered = 0
    for index, (token, where) in enumerate(zip(tokens, places, strict=True)):
        ident = token["id"]
        if isinstance(ident, int):
            words += 1
            if ident != words:
                raise ConlluError(f"{where}: word ids must run 1..n, found {ident} at position {words}")
            if not isinstance(token["head"], int):
                raise ConlluError(f"{where}: word {ident} has no numeric head ({token['head']!r})")
        elif not isinstance(ident, tuple):
            raise ConlluError(f"{where}: the ID {ident!r} is not a word (3), a range (3-4) or an empty node (3.1)")
        elif ident[1] == "-":
            following = tokens[index + 1]["id"] if index + 1 < len(tokens) else None
            if not covered < ident[0] < ident[2] <= count or following != ident[0]:
                raise ConlluError(
                    f"{where}: the multiword token {ident[0]}-{ident[2]} must cover two or more of words 1..{count}, "
                    "come right before its first word, and overlap no other"
                )
            covered = ident[2]


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
    root, no cycles.

    Example:
        >>> check_tree([2, 0, 2])
        >>> check_tree([2, 1, 0])
        Traceback (most recent call last):
        ...
        attnreg.syntax.trees.ConlluError: sentence: the heads form a cycle through words [1, 2]
    """
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
        seen: set[int] = set()
        while word != 0:
            if word in seen:
                raise ConlluError(f"{where}: the heads form a cycle through words {sorted(seen)}")
            seen.add(word)
            word = heads[word - 1]
