"""The built-in agreement task: generator determinism, grammar facts, splits, tokenizer alignment, data modules."""

import numpy as np
import pytest
import torch

from attnreg.app.datamodules import AgreementDataModule, LocalGlueDataModule, frequent_words
from attnreg.app.task import (
    MASK,
    Grammar,
    build_tokenizer,
    generate,
    generate_example,
    make_splits,
    vocabulary,
)
from attnreg.syntax import PRIOR_KEY, SyntaxCollator, align_offsets, check_tree

GRAMMAR = Grammar()
SINGULAR_NOUNS, PLURAL_NOUNS = set(GRAMMAR.nouns), set(GRAMMAR.nouns.values())
SINGULAR_VERBS, PLURAL_VERBS = set(GRAMMAR.verbs), set(GRAMMAR.verbs.values())


def number_of(word: str, label: int) -> int:
    """0 singular, 1 plural for a noun or verb form; the mask stands for the subject, numbered `label`."""
    if word == MASK:
        return label
    if word in SINGULAR_NOUNS | SINGULAR_VERBS:
        return 0
    assert word in PLURAL_NOUNS | PLURAL_VERBS, word
    return 1


def dependents(heads, word, relation, relations):
    return [i for i, (h, r) in enumerate(zip(heads, relations, strict=True), start=1) if h == word and r == relation]


@pytest.fixture(scope="module")
def examples():
    return generate(400, seed=7)


def test_generation_is_deterministic_per_seed():
    first, again, other = generate(30, seed=3), generate(30, seed=3), generate(30, seed=4)
    assert first == again
    assert [e.sentence.text for e in first] != [e.sentence.text for e in other]


def test_trees_are_valid_with_spans_and_one_masked_subject_under_the_root(examples):
    for example in examples:
        s = example.sentence
        check_tree(s.heads)
        assert [s.text[a:b] for a, b in s.spans] == list(s.words)
        assert s.words.count(MASK) == 1
        root = s.heads.index(0) + 1
        subject = s.words.index(MASK) + 1
        assert s.relations[root - 1] == "root" and s.heads[subject - 1] == root
        assert s.relations[subject - 1] == "nsubj"
        assert s.words[root - 1] in SINGULAR_VERBS | PLURAL_VERBS


def test_every_verb_agrees_with_its_subject_and_distractors_are_counted(examples):
    for example in examples:
        s = example.sentence
        words, heads, relations = s.words, s.heads, s.relations
        distractors = 0
        for index, (word, relation) in enumerate(zip(words, relations, strict=True), start=1):
            if relation == "root":
                assert number_of(word, example.label) == example.label, s.text
            if relation != "acl:relcl":
                continue
            relative_subject = dependents(heads, index, "nsubj", relations)
            (subject,) = relative_subject
            if words[subject - 1] == "that":  # subject gap: the verb agrees with the noun the clause modifies
                subject = heads[index - 1]
            verb_number = number_of(word, example.label)
            assert verb_number == number_of(words[subject - 1], example.label), s.text
            distractors += verb_number != example.label
        assert distractors == example.distractors, s.text


def test_grammar_has_every_construction_and_both_labels(examples):
    texts = [e.sentence.text for e in examples]
    assert any(" , " in t for t in texts)  # a fronted PP
    relations = {r for e in examples for r in e.sentence.relations}
    assert {"obl", "nmod", "acl:relcl", "obj", "case", "det", "punct"} <= relations
    object_gaps = [e for e in examples if any(w == "that" and r == "obj" for w, r in zip(*_wr(e), strict=True))]
    assert object_gaps, "no object relative clause generated"
    assert 0.4 < np.mean([e.label for e in examples]) < 0.6
    assert {e.distractors for e in examples} >= {0, 1, 2}


def _wr(example):
    return example.sentence.words, example.sentence.relations


def test_splits_have_their_distractor_counts_and_share_no_sentence():
    splits = make_splits(train=120, val=30, test=40, hard=50, seed=1)
    assert {name: len(split) for name, split in splits.items()} == {"train": 120, "val": 30, "test": 40, "hard": 50}
    for name in ("train", "val", "test"):
        assert {e.distractors for e in splits[name]} == {0, 1}
    assert {e.distractors for e in splits["hard"]} == {2}
    texts = [e.sentence.text for split in splits.values() for e in split]
    assert len(texts) == len(set(texts))


def test_bad_grammar_and_split_arguments_raise():
    with pytest.raises(ValueError, match="object_gap"):
        Grammar(object_gap=1.5)
    with pytest.raises(ValueError, match="subject_modifier"):
        Grammar(subject_modifier=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="share \\[1\\]"):
        make_splits(train_distractors=(0, 1), hard_distractors=(1, 2))
    with pytest.raises(ValueError, match="rarely or never"):
        generate(1, distractors=[9], grammar=Grammar(object_relative=0.0, subject_modifier=(1.0, 0.0, 0.0)))


def test_tokenizer_gives_one_token_per_word_with_offsets_the_collator_aligns(examples):
    tokenizer = build_tokenizer(vocabulary())
    sentences = [e.sentence for e in examples[:64]]
    encoding = tokenizer([s.text for s in sentences], return_offsets_mapping=True, padding=True, return_tensors="np")
    for row, sentence in enumerate(sentences):
        n = len(sentence.words)
        alignment = align_offsets(sentence, encoding["offset_mapping"][row])
        np.testing.assert_array_equal(alignment.token_word[: n + 2], [-1, *range(n), -1])  # [CLS] words [SEP]
        ids = encoding["input_ids"][row][1 : n + 1]
        assert tokenizer.unk_token_id not in ids
        assert ids[sentence.words.index(MASK)] == tokenizer.mask_token_id
        assert tokenizer.convert_ids_to_tokens(ids.tolist()) == list(sentence.words)
    batch = SyntaxCollator(tokenizer, max_length=64)(sentences)
    for row, sentence in enumerate(sentences):
        expected = np.full(batch[PRIOR_KEY].shape[1], -1)
        for word, head in enumerate(sentence.heads):
            if head > 0:
                expected[1 + word] = head  # token of word w is 1 + w ([CLS] first); head h (1-based) is token h
        np.testing.assert_array_equal(batch[PRIOR_KEY][row].numpy(), expected)
        mask_token = 1 + sentence.words.index(MASK)
        assert batch[PRIOR_KEY][row, mask_token] == 1 + sentence.heads.index(0)  # the mask's prior: the main verb


def test_tokenizer_marks_unknown_words_and_refuses_words_with_spaces(tmp_path):
    tokenizer = build_tokenizer(["the", "dog"])
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("the cat, dog")["input_ids"])
    assert tokens == ["[CLS]", "the", "[UNK]", "[UNK]", "dog", "[SEP]"]
    assert tokenizer.convert_ids_to_tokens(list(range(5))) == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded("the [MASK] dog", return_offsets_mapping=True)["offset_mapping"] == [
        (0, 0),
        (0, 3),
        (4, 10),
        (11, 14),
        (0, 0),
    ]
    with pytest.raises(ValueError, match="whitespace"):
        build_tokenizer(["two words"])


def test_mask_string_follows_the_tokenizer():
    example = generate_example(np.random.default_rng(0), mask="<mask>")
    assert "<mask>" in example.sentence.words and MASK not in example.sentence.text


def test_agreement_data_module_batches_with_and_without_the_prior():
    data = AgreementDataModule(train=64, val=16, test=16, hard=16, seed=0, batch_size=8)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert set(batch) >= {"input_ids", "attention_mask", "labels", PRIOR_KEY}
    assert batch["input_ids"].shape[0] == 8 and batch["labels"].dtype == torch.long
    assert set(data.eval_sets()) == {"val", "test", "hard"}
    assert len(data.tree_sentences()) == 16
    plain = AgreementDataModule(train=64, val=16, test=16, hard=16, seed=0, with_prior=False)
    plain.setup("fit")
    plain_batch = next(iter(plain.val_dataloader()))
    assert PRIOR_KEY not in plain_batch
    reference = next(iter(data.val_dataloader()))
    torch.testing.assert_close(plain_batch["input_ids"], reference["input_ids"])


def test_local_data_module_names_a_missing_directory(tmp_path):
    missing = tmp_path / "nowhere" / "cola"
    with pytest.raises(FileNotFoundError, match="nowhere/cola.*data.data_dir"):
        LocalGlueDataModule("cola", missing)


def test_frequent_words_split_like_the_tokenizer():
    assert frequent_words(["a b, a", "b a."], 3) == ["a", "b", ","]
