"""Prior kinds by direction and relation (issue 39): rows equal hand-built ones on a small tree, over words and
tokens, for an encoder and for causal models, through the blockwise and the materialized KL; several kinds on
different heads in one term; bad input refused before training; the app takes the kinds from a config."""

import copy
import math

import numpy as np
import pytest
import torch

import attnreg
from attnreg.app.datamodules import AgreementDataModule
from attnreg.app.settings import provide_kinds
from attnreg.methods import SyntaxPriorKL
from attnreg.syntax import (
    Sentence,
    SyntaxCollator,
    SyntaxPrior,
    align_word_ids,
    check_priors,
    kind_counts,
    read_conllu,
    word_prior,
)
from attnreg.tiny import tiny_model

# "The old keys of the cabinet rattle loudly ." (1-based heads; "cabinet" is two tokens below)
WORDS = ("The", "old", "keys", "of", "the", "cabinet", "rattle", "loudly", ".")
HEADS = (3, 3, 7, 6, 6, 3, 0, 7, 7)
RELATIONS = ("det", "amod", "nsubj", "case", "det", "nmod", "root", "advmod", "punct")
SENTENCE = Sentence("s1", WORDS, HEADS, RELATIONS, " ".join(WORDS))
# [CLS] The old keys of the cabi net rattle loudly .  -> token t holds word TOKEN_WORD[t]
TOKEN_WORD = [None, 0, 1, 2, 3, 4, 5, 5, 6, 7, 8]
ALIGNMENT = align_word_ids(TOKEN_WORD, num_words=len(WORDS))
T = len(TOKEN_WORD)


def rows(targets: dict[int, list[int]]) -> np.ndarray:
    """Dense token rows `[T, T]`: query token -> uniform over the target tokens."""
    out = np.zeros((T, T), dtype=np.float32)
    for query, keys in targets.items():
        out[query, keys] = 1.0 / len(keys)
    return out


# Hand-built token rows (keys on first pieces, every piece of a query word gets the word's row).
HAND = {
    "nsubj": rows({8: [3]}),  # rattle -> keys
    "dependents:det,amod": rows({3: [1, 2], 6: [5], 7: [5]}),  # keys -> The, old; cabinet -> the
    "dependents": rows({3: [1, 2, 6], 6: [4, 5], 7: [4, 5], 8: [3, 9, 10]}),
    "parent:det": rows({1: [3], 5: [6]}),  # The -> keys, the -> cabinet
}
HAND_CAUSAL = {  # only the targets at or before the query, renormalized; rows left with none dropped
    "nsubj": rows({8: [3]}),
    "dependents:det,amod": rows({3: [1, 2], 6: [5], 7: [5]}),
    "dependents": rows({3: [1, 2], 6: [4, 5], 7: [4, 5], 8: [3]}),  # the left dependents
}
PARENT = np.array([-1, 3, 3, 8, 6, 6, 3, 3, -1, 8, 8])  # key index per token, -1: the root's row, [CLS]
PARENT_CAUSAL = np.where(PARENT <= np.arange(T), PARENT, -1)


# -- words and tokens ------------------------------------------------------------------------------------
def test_word_rows_by_relation_equal_hand_built_rows():
    def word_rows(targets):
        out = np.zeros((len(WORDS), len(WORDS)), dtype=np.float32)
        for query, keys in targets.items():
            out[query, keys] = 1.0 / len(keys)
        return out

    arcs = lambda *names: [r in names for r in RELATIONS]  # noqa: E731
    assert np.array_equal(word_prior(HEADS, "dependents", arcs=arcs("nsubj")), word_rows({6: [2]}))
    assert np.array_equal(word_prior(HEADS, "dependents"), word_rows({2: [0, 1, 5], 5: [3, 4], 6: [2, 7, 8]}))
    assert np.array_equal(word_prior(HEADS, "parent", arcs=arcs("det")), word_rows({0: [2], 4: [5]}))


def dense(prior: np.ndarray) -> np.ndarray:
    """Key indices `[T]` (a parent prior's compact form) as rows `[T, T]`; rows as they are."""
    if prior.ndim == 2:
        return prior
    return rows({query: [int(key)] for query, key in enumerate(prior) if key >= 0})


@pytest.mark.parametrize("spec", sorted(HAND))
def test_token_rows_of_each_kind_equal_hand_built_rows(spec):
    assert np.allclose(dense(SyntaxPrior(spec)(HEADS, ALIGNMENT, RELATIONS)), HAND[spec])


def test_parent_by_relation_stays_compact_and_spread_keys_split_over_pieces():
    compact = SyntaxPrior("parent:nmod")(HEADS, ALIGNMENT, RELATIONS)  # cabinet -> keys, from both its pieces
    assert compact.tolist() == [-1, -1, -1, -1, -1, -1, 3, 3, -1, -1, -1]
    spread = SyntaxPrior("nmod", key_pieces="spread")(HEADS, ALIGNMENT, RELATIONS)  # keys -> cabinet's 2 pieces
    assert np.allclose(spread, rows({3: [6, 7]}))


def test_subtypes_fold_or_keep():
    relations = ("det", "amod", "nsubj:pass", "case", "det", "nmod", "root", "advmod", "punct")
    folded = SyntaxPrior("nsubj")(HEADS, ALIGNMENT, relations)
    assert np.allclose(folded, HAND["nsubj"])
    assert not SyntaxPrior("nsubj", subtypes="keep")(HEADS, ALIGNMENT, relations).any()
    assert np.allclose(SyntaxPrior("nsubj:pass", subtypes="keep")(HEADS, ALIGNMENT, relations), HAND["nsubj"])
    with pytest.raises(ValueError, match="subtypes='keep'"):
        SyntaxPrior("nsubj:pass")


def test_spec_strings_and_their_errors():
    assert SyntaxPrior("nsubj") == SyntaxPrior("dependents", relations=["nsubj"])
    assert SyntaxPrior("dependents:det, amod").relations == ("det", "amod")
    assert SyntaxPrior.from_spec("parent:det").spec == "parent:det"
    with pytest.raises(ValueError, match="only the kinds"):
        SyntaxPrior("neighbors:nsubj")
    with pytest.raises(ValueError, match="kind must be one of .* a UD relation"):
        SyntaxPrior("grandparent")  # a typo of a kind is not taken for a relation
    assert SyntaxPrior("dependents:dobj").relations == ("dobj",)  # other labels: named explicitly
    with pytest.raises(ValueError, match="pass each sentence's relations"):
        SyntaxPrior("nsubj")(HEADS, ALIGNMENT)


def test_collator_builds_each_kind_under_its_key_and_counts_causal_rows(recwarn):
    from attnreg.app.task import build_tokenizer

    kl = SyntaxPriorKL(kinds={"nsubj": {1: [0]}, "parent:det": {1: [1]}})
    tokenizer = build_tokenizer(list(WORDS))
    collate = SyntaxCollator(tokenizer, prior=None, kinds=kl.kind_priors, causal=True)
    batch = collate([SENTENCE])
    assert set(kl.batch_keys) <= set(batch) and "attnreg_prior" not in batch
    nsubj = batch["attnreg_prior.dependents:nsubj"][0]
    assert nsubj[7, 3] == 1 and nsubj.sum() == 1  # [CLS] The old keys ...: rattle (7) -> keys (3)
    # dense rows with mass: nsubj 1, parent:det 2 (both point right: left out for a decoder)
    assert (collate.stats.causal_rows, collate.stats.causal_rows_dropped) == (3, 2)


def test_a_kind_under_the_main_priors_key_is_refused_not_overwriting_it():
    from attnreg.app.task import build_tokenizer

    with pytest.raises(ValueError, match="kinds has a prior under 'attnreg_prior', the main prior's key"):
        SyntaxCollator(build_tokenizer(list(WORDS)), prior="parent", kinds={"attnreg_prior": "nsubj"})


# -- the KL against eager attention, both paths ------------------------------------------------------------
def kl_reference(probs: torch.Tensor, prior: np.ndarray, head: int) -> float:
    """Mean over rows with prior mass of KL(prior row || attention row), one head, from eager probabilities."""
    p = probs[0, head].double()
    prior = torch.as_tensor(prior).double()
    if prior.dim() == 1:
        chosen = [(q, int(k)) for q, k in enumerate(prior.tolist()) if k >= 0]
        return sum(-math.log(p[q, k]) for q, k in chosen) / len(chosen)
    kept = prior.sum(-1) > 0
    r = prior[kept]
    logs = torch.where(r > 0, r.clamp_min(1e-30).log() - p[kept].log(), torch.zeros_like(r))
    return float((r * logs).sum(-1).mean())


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
@pytest.mark.parametrize("blockwise", [True, False])
def test_kinds_on_different_heads_equal_the_kl_to_hand_built_rows(family, blockwise):
    model = tiny_model(family, vocab=64).eval()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    causal = family != "bert"
    kinds = {"nsubj": {1: [0]}, "dependents:det,amod": {1: [1]}, "dependents": {0: [1]}, "parent": {0: [2]}}
    kl = SyntaxPriorKL(kinds=kinds, blockwise=blockwise)
    kl.bind(model)
    kl.start(10)
    batch = {
        key: torch.from_numpy(prior.batch([HEADS], [ALIGNMENT], [RELATIONS])) for key, prior in kl.kind_priors.items()
    }
    input_ids = torch.randint(5, 64, (1, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), attnreg.attach(model).capture(kl.layers, inputs=kl.inputs) as record:
        model(input_ids=input_ids)
        value, logs = kl.term(record, batch, step=0)
    with torch.no_grad():
        attentions = reference(input_ids=input_ids, output_attentions=True).attentions
    hand = HAND_CAUSAL if causal else HAND
    expected = {
        "nsubj": kl_reference(attentions[1], hand["nsubj"], 0),
        "dependents:det,amod": kl_reference(attentions[1], hand["dependents:det,amod"], 1),
        "dependents": kl_reference(attentions[0], hand["dependents"], 1),
        "parent": kl_reference(attentions[0], PARENT_CAUSAL if causal else PARENT, 2),
    }
    assert float(value) == pytest.approx(np.mean(list(expected.values())), rel=1e-4)
    layer = {"nsubj": 1, "dependents:det,amod": 1, "dependents": 0, "parent": 0}
    for spec, figure in expected.items():
        name = f"syntax_prior_kl/{SyntaxPrior(spec).spec}/layer{layer[spec]}"
        assert float(logs[name]) == pytest.approx(figure, rel=1e-4), name


def test_a_kind_trains_its_chosen_head_only_in_its_layer():
    model = tiny_model("gpt2", vocab=64)
    kl = SyntaxPriorKL(kinds={"nsubj": {1: [0]}})
    kl.bind(model)
    kl.start(10)
    batch = {key: torch.from_numpy(p.batch([HEADS], [ALIGNMENT], [RELATIONS])) for key, p in kl.kind_priors.items()}
    with attnreg.attach(model).capture(kl.layers, inputs=kl.inputs) as record:
        model(input_ids=torch.arange(5, 5 + T)[None])
        value, _ = kl.term(record, batch, step=0)
    value.backward()
    width = model.config.n_embd // model.config.n_head
    query = model.h[1].attn.c_attn.weight.grad[:, : model.config.n_embd].abs()  # layer 1's query columns, by head
    assert query[:, :width].sum() > 0 and query[:, width:].sum() == 0


# -- counts and bad input ---------------------------------------------------------------------------------
def test_kind_counts_say_rows_without_the_relation_and_those_a_decoder_cannot_reach():
    counts = kind_counts([SENTENCE], SyntaxPrior("dependents"))
    assert (counts.words, counts.rows, counts.reachable) == (9, 3, 3)
    counts = kind_counts([SENTENCE], SyntaxPrior("parent"))
    assert (counts.rows, counts.reachable, counts.without) == (8, 3, 1)  # cabinet, loudly and . point left


def write_conllu(path, sentence: Sentence) -> None:
    lines = [f"# sent_id = {sentence.sent_id}", f"# text = {sentence.text}"]
    for i, (word, head, relation) in enumerate(zip(sentence.words, sentence.heads, sentence.relations, strict=True)):
        lines.append(f"{i + 1}\t{word}\t_\tX\t_\t_\t{head}\t{relation}\t_\t_")
    path.write_text("\n".join(lines) + "\n\n")


def test_a_relation_that_never_occurs_is_refused_naming_it_and_the_file(tmp_path):
    path = tmp_path / "train.conllu"
    write_conllu(path, SENTENCE)
    sentences = read_conllu(path)
    with pytest.raises(ValueError, match=rf"relation 'obj' never occurs in the 1 sentences of {path}"):
        check_priors(sentences, {"objects": SyntaxPrior("obj")})
    with pytest.raises(ValueError, match="relation 'iobj' never occurs.*neither a kind nor a relation"):
        check_priors(sentences, {"indirect objects": SyntaxPrior("iobj")})


def test_a_kind_a_decoder_cannot_reach_is_refused_for_causal_models_only(tmp_path):
    priors = {"determiner to noun": SyntaxPrior("parent:det")}
    assert check_priors([SENTENCE], priors)["determiner to noun"].rows == 2
    with pytest.raises(ValueError, match="none of its 2 rows .* has a target at or before its word"):
        check_priors([SENTENCE], priors, causal=True)


@pytest.mark.parametrize(
    ("kinds", "message"),
    [
        ({"nsubj": {5: [0]}}, r"kinds\['dependents:nsubj'\]: .*names layers out of range"),
        ({"det": {1: [9]}}, r"kinds\['dependents:det'\]: .*out of range for layer 1, which has 4 heads"),
    ],
)
def test_a_head_outside_the_model_is_refused_naming_the_kind(kinds, message):
    with pytest.raises(IndexError, match=message):
        SyntaxPriorKL(kinds=kinds).bind(tiny_model("bert"))


def test_kinds_and_heads_together_are_refused():
    with pytest.raises(ValueError, match="either through kinds= or heads="):
        SyntaxPriorKL(heads=[0], kinds={"nsubj": [0]})


# -- the app --------------------------------------------------------------------------------------------------
def test_app_refuses_an_unreachable_kind_for_a_decoder_before_training():
    from attnreg.app.models import tiny_classifier
    from attnreg.app.train import count_causal_rows

    data = AgreementDataModule(train=16, val=4, test=4, hard=2)
    count_causal_rows(data, tiny_classifier(data.tokenizer, num_labels=2, family="gpt2"))
    with pytest.raises(ValueError, match="parent:det.*a causal model"):
        provide_kinds([attnreg.SyntaxPriorKL(kinds={"parent:det": {1: [0]}})], data)


@pytest.mark.parametrize("model", ["tiny_bert", "tiny_gpt2"])
def test_attnreg_train_runs_the_kinds_config(model, tmp_path):
    import hydra

    from attnreg.app.configs import CONFIG_DIR, register_resolvers
    from attnreg.app.train import train

    register_resolvers()
    small = [
        "data.train=32",
        "data.val=16",
        "data.test=16",
        "data.hard=16",
        "trainer.max_steps=2",
        "trainer.log_every_n_steps=1",
    ]
    with hydra.initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = hydra.compose("train", ["attnreg=syntax_prior_kl_kinds", f"model={model}", "logger=csv", *small])
    summary = train(cfg, tmp_path)
    assert summary["steps"] == 2
    assert set(summary["parent_accuracy"]["supervised"]) == {"L0H0", "L1H0", "L1H1"}
    logged = (tmp_path / "csv").rglob("metrics.csv")
    header = next(iter(logged)).read_text().splitlines()[0]
    assert "attnreg/syntax_prior_kl/dependents:nsubj/layer1" in header
