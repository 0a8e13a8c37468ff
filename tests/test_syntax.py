"""CoNLL-U reading on the real EWT treebank, and clear errors on malformed trees."""

import gzip
from pathlib import Path

import pytest

from attnreg.syntax import ConlluError, check_tree, read_conllu

EWT = Path(__file__).resolve().parents[2] / "shared" / "data" / "ud_english_ewt"
needs_ewt = pytest.mark.skipif(not EWT.is_dir(), reason=f"UD English EWT not found at {EWT}")

GOOD = """# sent_id = s1
# text = I don't know.
1\tI\tI\tPRON\tPRP\t_\t4\tnsubj\t_\t_
2-3\tdon't\t_\t_\t_\t_\t_\t_\t_\t_
2\tdo\tdo\tAUX\tVBP\t_\t4\taux\t_\t_
3\tn't\tnot\tPART\tRB\t_\t4\tadvmod\t_\t_
4\tknow\tknow\tVERB\tVB\t_\t0\troot\t_\t_
4.1\tknew\tknow\tVERB\tVBD\t_\t_\t_\t4:conj\t_
5\t.\t.\tPUNCT\t.\t_\t4\tpunct\t_\t_

"""


@needs_ewt
def test_reads_ewt_dev_with_multiword_tokens_and_empty_nodes():
    sentences = read_conllu(EWT / "en_ewt-ud-dev.conllu")
    assert len(sentences) == 2001
    assert all(len(s.words) == len(s.heads) == len(s.relations) for s in sentences)
    # Every sentence has exactly its integer-id rows as words: no empty node (5.1), no range (3-4).
    integer_rows, rows = [], 0
    for line in (EWT / "en_ewt-ud-dev.conllu").read_text(encoding="utf-8").splitlines():
        if not line.strip():
            integer_rows.append(rows)
            rows = 0
        elif not line.startswith("#") and line.split("\t", 1)[0].isdigit():
            rows += 1
    assert [len(s.words) for s in sentences] == integer_rows
    assert any("." in line.split("\t", 1)[0] for line in (EWT / "en_ewt-ud-dev.conllu").open() if "\t" in line)
    assert not any(word in ("don't", "can't", "won't") for s in sentences for word in s.words)
    assert sum(word == "n't" for s in sentences for word in s.words) > 20


@needs_ewt
def test_reads_gzipped_train():
    sentences = read_conllu(EWT / "en_ewt-ud-train.conllu.gz")
    assert len(sentences) > 12000
    assert sentences[0].line == 1 and sentences[1].line > sentences[0].line


def test_multiword_ranges_are_split_and_empty_nodes_dropped(tmp_path):
    path = tmp_path / "good.conllu.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write(GOOD)
    (sentence,) = read_conllu(path)
    assert sentence.words == ("I", "do", "n't", "know", ".")
    assert sentence.heads == (4, 4, 4, 0, 4)
    assert sentence.relations == ("nsubj", "aux", "advmod", "root", "punct")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("1\tI\tI\tPRON\tPRP\t_\t4", "1\tI\tI\tPRON\tPRP\t_\t9"), "word 1 has head 9, outside 0..5"),
        (("5\t.\t.\tPUNCT\t.\t_\t4", "5\t.\t.\tPUNCT\t.\t_\t0"), "exactly one root .* found 2"),
        (("4\tknow\tknow\tVERB\tVB\t_\t0", "4\tknow\tknow\tVERB\tVB\t_\t1"), "exactly one root"),
        (("1\tI\tI\tPRON\tPRP\t_\t4\tnsubj", "1\tI\tI\tPRON\tPRP\t_\t3"), "malformed CoNLL-U"),
    ],
)
def test_malformed_sentence_names_file_line_and_id(tmp_path, change, message):
    path = tmp_path / "bad.conllu"
    path.write_text(GOOD + GOOD.replace("s1", "s2").replace(*change), encoding="utf-8")
    line = 13 if "malformed" in message else 11  # a bad row is named by its own line
    with pytest.raises(ConlluError, match=rf"bad.conllu:{line}\b.*{message}") as error:
        read_conllu(path)
    if "malformed" not in message:
        assert "sent_id s2" in str(error.value)


def test_cycles_are_found():
    with pytest.raises(ConlluError, match=r"cycle through words \[2, 3\]"):
        check_tree([0, 3, 2])
    check_tree([2, 0, 2])


@pytest.mark.parametrize(
    ("change", "line", "message"),
    [
        (("3\tn't\tnot\tPART\tRB\t_\t4", "3\tn't\tnot\tPART\tRB\t_\t1.1"), 16, "Failed parsing field 'head'"),
        (("2-3\tdon't", "_\tdon't"), 14, "the ID None is not a word"),
        (("2-3\tdon't", "2-9\tdon't"), 14, "multiword token 2-9 must cover two or more of words 1..5"),
        (("2-3\tdon't", "4-5\tdon't"), 14, "multiword token 4-5 .* come right before its first word"),
        (("2\tdo\tdo", "2\tdo  it\tdo"), 15, "column FORM is 'do  it'"),
        (("5\t.\t.\tPUNCT\t.\t", "5\t.\t.\tPUNCT\t\t"), 19, "column XPOS is ''"),
        (
            ("4\tknow\tknow\tVERB\tVB\t_\t0", "4\tknow\tknow\tVERB\tVB\t_\t_"),
            17,
            r"word 4 has no numeric head \(None\)",
        ),
    ],
)
def test_malformed_row_is_named_by_its_own_line(tmp_path, change, line, message):
    path = tmp_path / "bad.conllu"
    path.write_text(GOOD + GOOD.replace("s1", "s2").replace(*change), encoding="utf-8")
    with pytest.raises(ConlluError, match=rf"bad.conllu:{line}\b.*{message}"):
        read_conllu(path)


def test_byte_order_mark_and_windows_line_ends_read_as_plain_text(tmp_path):
    path = tmp_path / "windows.conllu"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.replace("\n", "\r\n").encode("utf-8"))
    (sentence,) = read_conllu(path)
    assert sentence.sent_id == "s1" and sentence.text == "I don't know."
    assert sentence.words == ("I", "do", "n't", "know", ".") and sentence.heads == (4, 4, 4, 0, 4)


def test_bytes_that_are_not_utf8_are_named_by_line(tmp_path):
    path = tmp_path / "latin1.conllu"
    path.write_bytes((GOOD + GOOD.replace("know", "knów")).encode("latin-1"))
    with pytest.raises(ConlluError, match=r"latin1.conllu:12: not UTF-8"):
        read_conllu(path)


def test_a_cut_gzip_file_is_named(tmp_path):
    path = tmp_path / "cut.conllu.gz"
    path.write_bytes(gzip.compress((GOOD * 50).encode("utf-8"))[:-40])
    with pytest.raises(ConlluError, match=r"cut.conllu.gz:\d+: the compressed file is damaged or cut short"):
        read_conllu(path)
