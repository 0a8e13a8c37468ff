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
