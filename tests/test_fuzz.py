"""Fuzzing the input boundaries: corrupted CoNLL-U sentences through the reader, malformed priors
through `prior_kl`. Each input either reads (a valid tree, a finite loss) or raises attnreg's own
error naming the file:line or the argument; nothing fails inside `conllu` or torch. Seeds are fixed."""

import random
import re
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

import attnreg
from attnreg.losses import prior_kl
from attnreg.syntax import ConlluError, SyntaxDataset, check_tree, read_conllu

EWT_DEV = Path(__file__).resolve().parents[2] / "shared" / "data" / "ud_english_ewt" / "en_ewt-ud-dev.conllu"
CASES = 200


# -- CoNLL-U --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def blocks() -> list[list[str]]:
    """The dev file's sentences as lists of lines (comments included), multiword tokens and empty nodes first."""
    if not EWT_DEV.is_file():
        pytest.skip(f"UD English EWT dev file not found at {EWT_DEV} (the fuzz starts from real sentences)")
    text = EWT_DEV.read_text(encoding="utf-8")
    sentences = [block.split("\n") for block in text.strip().split("\n\n")]
    special = [s for s in sentences if any(re.match(r"\d+[-.]\d+\t", line) for line in s)]
    return special[:60] + sentences[:: len(sentences) // 200]


def word_rows(lines: list[str]) -> list[int]:
    return [i for i, line in enumerate(lines) if re.match(r"\d+\t", line)]


def field(lines: list[str], row: int, column: int) -> str:
    fields = lines[row].split("\t")
    return fields[column] if column < len(fields) else ""


def set_field(lines: list[str], row: int, column: int, value: str) -> None:
    fields = lines[row].split("\t")
    if column < len(fields):
        fields[column] = value
        lines[row] = "\t".join(fields)


def corrupt(lines: list[str], rng: random.Random) -> list[str]:
    """One random corruption of a sentence (a list of lines without newlines)."""
    lines = list(lines)
    rows = word_rows(lines) or [len(lines) - 1]
    row = rng.choice(rows)
    count = len(word_rows(lines))
    kind = rng.randrange(22)
    if kind == 0:  # HEAD out of range
        set_field(lines, row, 6, str(rng.choice([count + 1, count + 7, -2, 10**20])))
    elif kind == 1:  # non-integer or odd ids
        set_field(lines, row, 0, rng.choice(["x", "1.5.2", "", "_", "3a", "01", "-1", "2-", "1.0", "0"]))
    elif kind == 2:  # a missing column
        fields = lines[row].split("\t")
        del fields[rng.randrange(len(fields))]
        lines[row] = "\t".join(fields)
    elif kind == 3:  # an extra column
        lines[row] += "\textra"
    elif kind == 4:  # a cycle: a word headed by one of its dependents, or by itself
        word = field(lines, row, 0)
        dependents = [r for r in rows if field(lines, r, 6) == word]
        set_field(lines, row, 6, field(lines, rng.choice(dependents), 0) if dependents else word)
    elif kind == 5:  # several roots, or none
        set_field(lines, row, 6, "0" if rng.random() < 0.7 else str(1 + (row % count)))
    elif kind == 6:  # an empty line in an odd place
        lines.insert(rng.randrange(1, len(lines) + 1), rng.choice(["", " ", "\t"]))
    elif kind == 7:  # a multiword-token range, well placed or not
        first = rng.randint(0, count + 2)
        last = first + rng.choice([-1, 0, 1, 2, 40])
        lines.insert(rng.randrange(len(lines) + 1), f"{first}-{last}\tdon't\t_\t_\t_\t_\t_\t_\t_\t_")
    elif kind == 8:  # an empty node, with or without a head
        head = rng.choice(["_", "1", "0"])
        lines.insert(rng.randrange(len(lines) + 1), f"{rng.randint(0, count)}.1\tbe\tbe\tAUX\t_\t_\t{head}\t_\t_\t_")
    elif kind == 9:  # HEAD not a number
        set_field(lines, row, 6, rng.choice(["_", "x", "1.1", "", " 3", "3 "]))
    elif kind == 10:  # a word line removed (a gap in the ids) or doubled
        if rng.random() < 0.5:
            del lines[row]
        else:
            lines.insert(row, lines[row])
    elif kind == 11:  # two word lines swapped
        other = rng.choice(rows)
        lines[row], lines[other] = lines[other], lines[row]
    elif kind == 12:  # a truncated line
        lines[row] = lines[row][: rng.randrange(len(lines[row]) + 1)]
    elif kind == 13:  # columns separated by spaces instead of tabs, or a form with two spaces
        lines[row] = lines[row].replace("\t", "  ") if rng.random() < 0.5 else lines[row].replace("\t", "  x\t", 1)
    elif kind == 14:  # an empty or blank form
        set_field(lines, row, 1, rng.choice(["", " "]))
    elif kind == 15:  # the text comment gone, or not matching the words
        lines = [line for line in lines if not line.startswith("# text")]
        if rng.random() < 0.5:
            lines.insert(0, "# text = something else entirely")
    elif kind == 16:  # odd comments and metadata
        lines.insert(rng.randrange(len(lines) + 1), rng.choice(["#", "# sent_id", "# = x", "#\t1\t2", "# text ="]))
    elif kind == 17:  # Windows line ends (valid)
        lines = [line + "\r" for line in lines]
    elif kind == 18:  # control characters in a form
        set_field(lines, row, 1, rng.choice(["a\x00b", "\x0b", "a\x1cb", "\u2028", "\x85"]))
    elif kind == 19:  # only comments, no words
        lines = [line for line in lines if line.startswith("#")]
    elif kind == 20:  # DEPS and MISC and FEATS nonsense
        set_field(lines, row, rng.choice([5, 8, 9]), rng.choice(["=", "|", "a=b=c", "1:", ":x", "2-1:x", "0.0:x"]))
    else:  # a range covering the whole sentence, before its words
        lines.insert(word_rows(lines)[0] if word_rows(lines) else 0, f"1-{count}\tall\t_\t_\t_\t_\t_\t_\t_\t_")
    return lines


def to_bytes(good: list[str], lines: list[str], rng: random.Random) -> bytes:
    """A good sentence, then the corrupted one, with maybe byte-level damage to the second."""
    prefix = ("\n".join(good) + "\n\n").encode("utf-8")
    data = ("\n".join(lines) + "\n\n").encode("utf-8")
    kind = rng.randrange(8)
    if kind == 0:  # not UTF-8
        at = rng.randrange(len(data))
        data = data[:at] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xfe\xff"]) + data[at:]
    elif kind == 1:  # the file cut off anywhere
        data = data[: rng.randrange(1, len(data))]
    elif kind == 2:  # a byte-order mark at the start of the file
        prefix = b"\xef\xbb\xbf" + prefix
    return prefix + data


def check_read(sentences) -> None:
    for sentence in sentences:
        check_tree(sentence.heads)
        assert len(sentence.words) == len(sentence.heads) == len(sentence.relations) == len(sentence.spans) > 0
        assert all(sentence.words)
        assert all(0 <= start < end <= len(sentence.text) for start, end in sentence.spans)
        assert sorted(sentence.spans) == list(sentence.spans)


def test_corrupted_conllu_reads_or_names_the_line(blocks, tmp_path):
    outcomes = {"read": 0, "refused": 0}
    for case in range(CASES):
        rng = random.Random(case)
        good, bad = rng.sample(blocks, 2)
        lines = bad
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            lines = corrupt(lines, rng)
        path = tmp_path / f"case{case}.conllu"
        path.write_bytes(to_bytes(good, lines, rng))
        reader = read_conllu if case % 2 else SyntaxDataset.from_conllu
        try:
            result = reader(path)
        except ConlluError as error:
            outcomes["refused"] += 1
            named = re.search(rf"{re.escape(str(path))}:(\d+)\b", str(error))
            assert named, f"case {case}: the error names no {path.name}:line: {error}"
            assert len(good) < int(named[1]) <= path.read_bytes().count(b"\n") + 1, f"case {case}: {error}"
            assert_raised_by_attnreg(error, case)
        except Exception as error:  # noqa: BLE001 - the point: anything else is a failure
            pytest.fail(f"case {case}: {type(error).__name__} from {origin(error)}: {error}")
        else:
            outcomes["read"] += 1
            sentences = result if isinstance(result, list) else result.sentences
            check_read(sentences)
    assert min(outcomes.values()) > 10, outcomes  # both outcomes are exercised


def origin(error: BaseException) -> str:
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f"{frame.filename}:{frame.lineno}"


def assert_raised_by_attnreg(error: BaseException, case) -> None:
    package = str(Path(attnreg.__file__).parent)
    assert origin(error).startswith(package), f"case {case}: raised from {origin(error)}: {error}"


# -- priors ---------------------------------------------------------------------------------------
def malformed_prior(rng: random.Random, batch: int, heads: int, queries: int, keys: int):
    """(prior, heads) for `prior_kl`: a valid one-hot or dense prior, then one or two corruptions (or
    none: kinds 10-15 leave it valid, as a control)."""
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    indices = torch.randint(-1, keys, (batch, queries), generator=generator)
    dense = torch.randn(batch, queries, keys, generator=generator).mul(3).softmax(-1)
    dense[torch.rand(batch, queries, generator=generator) < 0.2] = 0.0
    prior = indices if rng.random() < 0.5 else dense
    chosen = None
    for _ in range(rng.choice([1, 1, 2])):
        kind = rng.randrange(16)
        b, q = rng.randrange(batch), rng.randrange(queries)
        tensor = isinstance(prior, torch.Tensor)
        if kind == 0 and tensor and prior.dim() == 2:  # an index out of range
            prior = prior.clone()
            prior[b, q] = rng.choice([keys, keys + 5, -2, -5, 2**40])
        elif kind == 1 and tensor:  # another dtype: float or bool indices, integer or low-precision rows
            prior = prior.to(rng.choice([torch.float32, torch.float64, torch.int32, torch.bool, torch.bfloat16]))
        elif kind == 2 and tensor:  # not a tensor
            prior = rng.choice([prior.tolist(), prior.numpy() if prior.dtype != torch.bfloat16 else None, 3.0, "p"])
        elif kind == 3 and tensor:  # another shape
            prior = rng.choice([prior[:, :-1], prior[None], prior.reshape(-1), prior.transpose(0, 1), prior[..., :1]])
        elif kind == 4 and tensor and prior.dim() == 3:  # a negative, NaN or inf entry
            prior = prior.clone().float()
            prior[b, q, rng.randrange(keys)] = rng.choice([-0.5, -1e-6, float("nan"), float("inf"), -float("inf")])
        elif kind == 5 and tensor and prior.dim() == 3:  # rows scaled
            prior = prior * rng.choice([3.0, 0.5, 1.0 + 1e-5, 1.0 - 1e-4, 1.01, -1.0, 0.0])
        elif kind == 6:  # bad heads
            chosen = rng.choice([[heads], [-1], [0.0], ["0"], [True], 0, [], "0", [0, heads + 3], [None]])
        elif kind == 7:  # good heads, in any sequence type
            chosen = rng.choice([[0], (0, heads - 1), range(heads), [np.int64(1)]])
        elif kind == 8 and tensor and prior.dim() == 3:  # empty rows (valid)
            prior = torch.zeros_like(prior)
        elif kind == 9 and tensor and prior.dim() == 2:  # all rows left out (valid)
            prior = torch.full_like(prior, -1)
    return prior, chosen


def test_malformed_priors_give_a_finite_loss_or_name_the_argument():
    outcomes = {"loss": 0, "refused": 0}
    for case in range(CASES):
        rng = random.Random(1000 + case)
        batch, heads, queries = rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 6)
        keys = queries + rng.choice([0, 0, 2])
        dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16])
        scores = torch.randn(batch, heads, queries, keys, generator=torch.Generator().manual_seed(case))
        probs = scores.requires_grad_().softmax(-1).to(dtype)
        prior, chosen = malformed_prior(rng, batch, heads, queries, keys)
        options = {"reduction": rng.choice(["mean_heads", "mean_attention"]), "causal": rng.random() < 0.3}
        try:
            loss = prior_kl(probs, prior, heads=chosen, **options)
        except (ValueError, TypeError, IndexError) as error:
            outcomes["refused"] += 1
            assert re.match(r"(prior|heads)\b", str(error)), f"case {case}: {type(error).__name__}: {error}"
            assert_raised_by_attnreg(error, case)
        except Exception as error:  # noqa: BLE001 - the point: anything else is a failure
            pytest.fail(f"case {case}: {type(error).__name__} from {origin(error)}: {error}")
        else:
            outcomes["loss"] += 1
            loss.backward()
            assert torch.isfinite(loss), f"case {case}: loss {loss} for prior {prior!r}"
            assert torch.isfinite(scores.grad).all(), f"case {case}: gradient not finite"
    assert min(outcomes.values()) > 30, outcomes
