"""Agreement minimal pairs from treebank trees (issue 39): which sentences give a pair, the flipped forms, the
attractor split and the baselines, on hand-made CoNLL-U trees; the LM score against an unbatched reference."""

import math
import os
from pathlib import Path

import pytest
import torch

from attnreg.analysis.agreement import agreement_scores, pair_margins
from attnreg.syntax import read_conllu
from attnreg.syntax.agreement import baselines, counts, flip, minimal_pairs, third_singular
from attnreg.tiny import tiny_model

DATA = Path(os.environ.get("ATTNREG_DATA_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data")
FIN = "Mood=Ind|Tense=Pres|VerbForm=Fin"


def conllu(sent_id: str, rows: list[tuple]) -> str:
    """A sentence from rows (form, lemma, upos, xpos, feats, head, relation), words separated by spaces."""
    text = " ".join(row[0] for row in rows)
    lines = [f"# sent_id = {sent_id}", f"# text = {text}"]
    for i, (form, lemma, upos, xpos, feats, head, relation) in enumerate(rows, start=1):
        lines.append(f"{i}\t{form}\t{lemma}\t{upos}\t{xpos}\t{feats}\t{head}\t{relation}\t_\t_")
    return "\n".join(lines) + "\n\n"


def noun(form, lemma, plural, head, relation):
    return (form, lemma, "NOUN", "NNS" if plural else "NN", f"Number={'Plur' if plural else 'Sing'}", head, relation)


THE = lambda head: ("The", "the", "DET", "DT", "_", head, "det")  # noqa: E731
SENTENCES = {
    # regular plural verb, one attractor: "The keys to the cabinet rattle"
    "attractor": [THE(2), noun("keys", "key", True, 6, "nsubj"), ("to", "to", "ADP", "IN", "_", 5, "case"),
                  ("the", "the", "DET", "DT", "_", 5, "det"), noun("cabinet", "cabinet", False, 2, "nmod"),
                  ("rattle", "rattle", "VERB", "VBP", f"Number=Plur|{FIN}", 0, "root")],
    # copula: the predicate heads the subject, "is" is the finite word
    "copula": [THE(2), noun("door", "door", False, 4, "nsubj"), ("is", "be", "AUX", "VBZ", f"Number=Sing|{FIN}", 4,
               "cop"), ("open", "open", "ADJ", "JJ", "Degree=Pos", 0, "root")],
    # passive with two auxiliaries: the first finite one ("have") agrees
    "passive": [THE(2), noun("keys", "key", True, 5, "nsubj:pass"), ("have", "have", "AUX", "VBP", FIN, 5, "aux"),
                ("been", "be", "AUX", "VBN", "VerbForm=Part", 5, "aux:pass"),
                ("found", "find", "VERB", "VBN", "VerbForm=Part|Voice=Pass", 0, "root")],
    # regular singular verb: "The dog watches"
    "singular": [THE(2), noun("dog", "dog", False, 3, "nsubj"),
                 ("watches", "watch", "VERB", "VBZ", f"Number=Sing|Person=3|{FIN}", 0, "root")],
    # no pair: coordinated subject, pronoun subject, past tense of a regular verb, gold disagreement, subject after
    "coordinated": [THE(2), noun("dog", "dog", False, 6, "nsubj"), ("and", "and", "CCONJ", "CC", "_", 5, "cc"),
                    ("the", "the", "DET", "DT", "_", 5, "det"), noun("cat", "cat", False, 2, "conj"),
                    ("are", "be", "AUX", "VBP", FIN, 7, "cop"), ("here", "here", "ADV", "RB", "_", 0, "root")],
    "pronoun": [("They", "they", "PRON", "PRP", "Number=Plur|Person=3", 2, "nsubj"),
                ("rattle", "rattle", "VERB", "VBP", FIN, 0, "root")],
    "past": [THE(2), noun("keys", "key", True, 3, "nsubj"),
             ("rattled", "rattle", "VERB", "VBD", "Mood=Ind|Tense=Past|VerbForm=Fin", 0, "root")],
    "disagrees": [THE(2), noun("team", "team", False, 3, "nsubj"), ("are", "be", "AUX", "VBP", FIN, 0, "root")],
    "inverted": [("Here", "here", "ADV", "RB", "_", 2, "advmod"), ("is", "be", "AUX", "VBZ", FIN, 0, "root"),
                 ("the", "the", "DET", "DT", "_", 4, "det"), noun("key", "key", False, 2, "nsubj")],
}  # fmt: skip


@pytest.fixture
def pairs(tmp_path):
    path = tmp_path / "hand.conllu"
    path.write_text("".join(conllu(sent_id, rows) for sent_id, rows in SENTENCES.items()))
    return minimal_pairs(path)


def test_pairs_come_from_noun_subjects_before_a_finite_verb_that_agrees(pairs):
    found = {pair.where.rsplit("sent_id ", 1)[1].rstrip(")"): pair for pair in pairs}
    assert sorted(found) == ["attractor", "copula", "passive", "singular"]
    summary = {key: (p.prefix, p.good, p.bad, p.plural, p.attractors) for key, p in found.items()}
    assert summary == {
        "attractor": ("The keys to the cabinet", " rattle", " rattles", True, 1),
        "copula": ("The door", " is", " are", False, 0),
        "passive": ("The keys", " have", " has", True, 0),
        "singular": ("The dog", " watches", " watch", False, 0),
    }


def test_flipping_forms_and_their_case():
    assert [third_singular(v) for v in ("fix", "carry", "stay", "do")] == ["fixes", "carries", "stays", "does"]
    (sentence,) = read_conllu_text(conllu("c", [("Is", "be", "AUX", "VBZ", FIN, 0, "root")]))
    assert flip(sentence, 0) == ("Are", True)


def read_conllu_text(text: str) -> list:
    import tempfile

    path = Path(tempfile.mkdtemp()) / "one.conllu"
    path.write_text(text)
    return read_conllu(path)


def test_baselines_and_counts_by_attractor_split(pairs):
    assert counts(pairs) == {"without_attractors": 3, "with_attractors": 1, "all": 4, "plural": 2}
    scores = baselines(pairs)
    assert scores["closest_noun"] == {"without_attractors": 1.0, "with_attractors": 0.0, "all": 0.75}
    assert scores["always_singular"] == {"without_attractors": 2 / 3, "with_attractors": 0.0, "all": 0.5}


def test_lm_margins_equal_an_unbatched_reference(pairs):
    from attnreg.app.task import build_tokenizer

    words = {w for pair in pairs for text in (pair.prefix, pair.good, pair.bad) for w in text.split()}
    tokenizer = build_tokenizer(sorted(words))
    model = tiny_model("llama", head="causal_lm", vocab=len(tokenizer)).eval()

    def log_probability(prefix: str, form: str) -> float:
        prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
        form_ids = tokenizer(form, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prefix_ids + form_ids])).logits[0].log_softmax(-1)
        return sum(float(logits[len(prefix_ids) + i - 1, token]) for i, token in enumerate(form_ids))

    expected = [log_probability(p.prefix, p.good) - log_probability(p.prefix, p.bad) for p in pairs]
    for batch_size in (1, 3):  # padding in a batch changes nothing
        assert pair_margins(model, tokenizer, pairs, batch_size) == pytest.approx(expected, abs=1e-4)
    scores = agreement_scores(model, tokenizer, pairs)
    right = [m > 0 for m in expected]
    assert scores["accuracy"]["all"] == sum(right) / 4
    assert scores["accuracy"]["with_attractors"] == float(right[0])  # the attractor pair is first
    assert math.isclose(scores["margin"]["all"], sum(expected) / 4, abs_tol=1e-4)


def test_forms_of_several_tokens_and_one_token_batched_by_length_equal_one_pair_at_a_time(pairs):
    """One-token forms are read from the prefix's last logits, longer forms from their own sequences; batches sorted
    by length: the margins equal scoring each pair alone, forms of two tokens included."""
    import dataclasses

    from attnreg.app.task import build_tokenizer

    longer = [
        dataclasses.replace(pairs[0], good=pairs[0].good + " really"),
        dataclasses.replace(pairs[1], bad=" is so"),
    ]
    mixed = [*pairs, *longer]
    words = {w for pair in mixed for text in (pair.prefix, pair.good, pair.bad) for w in text.split()}
    tokenizer = build_tokenizer(sorted(words))
    model = tiny_model("llama", head="causal_lm", vocab=len(tokenizer)).eval()
    alone = [pair_margins(model, tokenizer, [pair])[0] for pair in mixed]
    for batch_size in (2, 32):
        assert pair_margins(model, tokenizer, mixed, batch_size) == pytest.approx(alone, abs=1e-5)
    prefix = tokenizer(longer[1].prefix, add_special_tokens=False)["input_ids"]
    with torch.no_grad():  # the two-token form: both of its tokens summed
        logits = model(input_ids=torch.tensor([prefix + tokenizer(" is so", add_special_tokens=False)["input_ids"]]))
    logp = logits.logits[0].log_softmax(-1)
    good = tokenizer(longer[1].good, add_special_tokens=False)["input_ids"][0]
    so, is_ = tokenizer.convert_tokens_to_ids("so"), tokenizer.convert_tokens_to_ids("is")
    expected = float(logp[len(prefix) - 1, good] - logp[len(prefix) - 1, is_] - logp[len(prefix), so])
    assert alone[-1] == pytest.approx(expected, abs=1e-5)


def test_a_prefix_without_tokens_is_refused_not_scored_from_another_position():
    from attnreg.app.task import build_tokenizer
    from attnreg.syntax.agreement import AgreementPair

    tokenizer = build_tokenizer(["keys", "are", "is"])  # adds [CLS] and [SEP], no start token for a decoder
    model = tiny_model("llama", head="causal_lm", vocab=len(tokenizer))
    empty = AgreementPair("", " are", " is", True, 0, 1, 0, True, "sent_id s9")
    with pytest.raises(ValueError, match="agreement pair of sent_id s9: the prefix '' gives no token"):
        pair_margins(model, tokenizer, [empty])


@pytest.mark.skipif(not (DATA / "ud_english_ewt").is_dir(), reason="UD English EWT not found under ../shared/data")
def test_ewt_dev_gives_hundreds_of_pairs_and_some_with_attractors():
    found = counts(minimal_pairs(DATA / "ud_english_ewt" / "en_ewt-ud-dev.conllu"))
    assert found["without_attractors"] > 300 and found["with_attractors"] > 10
