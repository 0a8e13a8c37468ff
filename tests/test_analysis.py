"""Attention analysis: statistics and roles on hand-built maps, word-level syntax in both directions,
the batched pass against a per-sentence reference, plots, and `attnreg-analyze` end to end."""

import json
import struct
import sys

import huggingface_hub
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, BertTokenizer

import attnreg
from attnreg.analysis import (
    ATTENTION_STATISTICS,
    HeadStatistics,
    ParentAccuracy,
    RoleThresholds,
    SyntaxTargets,
    TokenKinds,
    TokenSimilarity,
    analyze,
    attention_statistics,
    block_statistics,
    check_tokenizer,
    first_token_attention,
    head_roles,
    parent_accuracy,
    predicted_heads,
    token_importance,
    word_attention,
)
from attnreg.app.analyze import load_model, main
from attnreg.methods.pruning import prune_heads, save_pruned
from attnreg.syntax import Alignment, Sentence, align_offsets
from attnreg.tiny import tiny_model

WORDS = ["the", "a", "dog", "cat", "keys", "table", "sees", "likes", "on", "big", "old", ",", "."]


def word_tokenizer() -> BertTokenizer:
    """A WordPiece tokenizer over WORDS (plus '##s' so plurals split in two pieces), built offline."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s"]
    return BertTokenizer(vocab={token: index for index, token in enumerate(vocab)})


def sentence(words, heads, relations, sent_id="s") -> Sentence:
    return Sentence(sent_id, tuple(words), tuple(heads), tuple(relations), " ".join(words))


def noun_phrase(tree: dict[str, list], rng: np.random.Generator, attach_to: int, relation: str) -> int:
    """Append Det (Adj) N, the modifiers headed by the noun and the noun by `attach_to`; the noun's 1-based index."""
    words, heads, relations = tree["words"], tree["heads"], tree["relations"]
    start = len(words)
    adjective = rng.random() < 0.5
    words.extend([str(rng.choice(["the", "a"]))] + ([str(rng.choice(["big", "old"]))] if adjective else []))
    words.append(str(rng.choice(["dog", "cat", "table"])) + ("s" if rng.random() < 0.3 else ""))
    noun = len(words)
    heads.extend([noun] * (noun - 1 - start) + [attach_to])
    relations.extend(["det"] + (["amod"] if adjective else []) + [relation])
    return noun


def random_sentences(count: int, seed: int = 0) -> list[Sentence]:
    """Det (Adj) N V Det (Adj) N . with UD-style heads; nouns sometimes plural (two word pieces)."""
    rng = np.random.default_rng(seed)
    sentences = []
    for index in range(count):
        tree: dict[str, list] = {"words": [], "heads": [], "relations": []}
        subject = noun_phrase(tree, rng, attach_to=0, relation="nsubj")
        tree["words"].append(str(rng.choice(["sees", "likes"])))
        verb = len(tree["words"])
        tree["heads"].append(0)
        tree["relations"].append("root")
        tree["heads"][subject - 1] = verb
        noun_phrase(tree, rng, attach_to=verb, relation="obj")
        tree["words"].append(".")
        tree["heads"].append(verb)
        tree["relations"].append("punct")
        sentences.append(sentence(tree["words"], tree["heads"], tree["relations"], f"r{index}"))
    return sentences


# ---------------------------------------------------------------------------------------------
# Statistics and roles on hand-built maps
# ---------------------------------------------------------------------------------------------
def hand_built_maps() -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [CLS] w w , w [SEP]; heads: previous token, all on [SEP], uniform, self."""
    tokens = 6
    previous = torch.zeros(tokens, tokens)
    previous[0, 0] = 1.0
    previous[torch.arange(1, tokens), torch.arange(tokens - 1)] = 1.0
    on_sep = torch.zeros(tokens, tokens)
    on_sep[:, -1] = 1.0
    uniform = torch.full((tokens, tokens), 1 / tokens)
    probs = torch.stack([previous, on_sep, uniform, torch.eye(tokens)])[None]  # [1, 4, 6, 6]
    kinds = torch.zeros(1, tokens, 3, dtype=torch.bool)
    kinds[0, 0, 0] = kinds[0, -1, 1] = kinds[0, 3, 2] = True
    return probs, kinds


def test_statistics_of_hand_built_heads():
    probs, kinds = hand_built_maps()
    sums, rows = attention_statistics(probs, kinds)
    mean = {name: sums[:, k] / rows[k] for k, name in enumerate(ATTENTION_STATISTICS)}
    expected = {
        "entropy": [0.0, 0.0, 1.0, 0.0],
        "to_start": [2 / 6, 0.0, 1 / 6, 1 / 6],
        "to_first": [2 / 6, 0.0, 1 / 6, 1 / 6],  # [CLS] is the first token
        "to_end": [0.0, 1.0, 1 / 6, 1 / 6],
        "to_punctuation": [1 / 6, 0.0, 1 / 6, 1 / 6],
        "to_self": [1 / 6, 1 / 6, 1 / 6, 1.0],
        "to_previous": [1.0, 0.0, 1 / 6, 0.0],
        "to_next": [0.0, 0.2, 1 / 6, 0.0],
        "argmax_previous": [1.0, 0.0, 0.2, 0.0],  # a uniform row's argmax is its first key
    }
    for name, values in expected.items():
        torch.testing.assert_close(mean[name], torch.tensor(values, dtype=torch.float64), msg=name)
    uniform_distance = sum(abs(q - k) for q in range(6) for k in range(6)) / 36
    torch.testing.assert_close(
        mean["distance"], torch.tensor([5 / 6, (5 + 4 + 3 + 2 + 1) / 6, uniform_distance, 0.0], dtype=torch.float64)
    )
    assert rows[ATTENTION_STATISTICS.index("to_previous")] == 5  # the first token has no previous token


def test_roles_of_hand_built_heads():
    probs, kinds = hand_built_maps()
    stats = HeadStatistics.empty(layers=1, heads=4)
    stats.update({0: probs}, kinds, None, causal=False)
    roles = head_roles(stats)
    assert [role.primary for role in roles.heads] == ["positional", "no-op", "broad", "other"]
    assert roles.of(0, 0).labels == ("positional:previous",)
    assert "100% of attention on start/end specials" in roles.of(0, 1).evidence
    assert roles.counts()["positional"] == 1
    # Thresholds are honoured: demand 101% and the previous-token head is no longer positional.
    assert head_roles(stats, thresholds=RoleThresholds(positional=1.01)).of(0, 0).primary == "other"


def test_padding_rows_and_causal_normalization():
    """A causal head attending uniformly to its prefix has normalized entropy 1; padding rows do not count."""
    tokens = 5
    causal = torch.tril(torch.ones(tokens, tokens))
    causal = (causal / causal.sum(-1, keepdim=True))[None, None].repeat(2, 1, 1, 1)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    causal[1, :, :, 3:] = 0.0
    causal[1, :, :3, :3] = torch.tril(torch.ones(3, 3)) / torch.tril(torch.ones(3, 3)).sum(-1, keepdim=True)
    causal[1, :, 3:] = 0.0
    sums, rows = attention_statistics(causal, torch.zeros(2, tokens, 3, dtype=torch.bool), mask, causal=True)
    entropy = ATTENTION_STATISTICS.index("entropy")
    assert rows[entropy] == 4 + 2  # rows with at least two admissible keys
    torch.testing.assert_close(sums[0, entropy] / rows[entropy], torch.tensor(1.0, dtype=torch.float64))
    assert rows[ATTENTION_STATISTICS.index("to_self")] == 5 + 3


def test_syntactic_role_needs_the_margin_over_the_best_offset():
    syntax = ParentAccuracy.empty(layers=1, heads=3)
    syntax.words = 200
    syntax.offset_hits = {1: 60, -1: 20}
    syntax.hits[0] = torch.tensor([100.0, 70.0, 10.0])  # 50%, 35%, 5% against the 30% right-branching
    syntax.present[:] = True
    probs, kinds = hand_built_maps()
    stats = HeadStatistics.empty(layers=1, heads=3)
    stats.update({0: probs[:, [2, 2, 2]]}, kinds, None, causal=False)  # three broad heads
    roles = head_roles(stats, syntax)
    assert [role.primary for role in roles.heads] == ["syntactic", "broad", "broad"]
    assert roles.of(0, 0).relations == ("all",)
    assert "all 50.0 vs 30.0 at +1" in roles.of(0, 0).evidence


def test_token_kinds_from_a_tokenizer():
    tokenizer = word_tokenizer()
    batch = tokenizer(["the dog , a cat .", "the dogs"], padding=True, return_tensors="pt")
    masks = TokenKinds.from_tokenizer(tokenizer).masks(batch["input_ids"], batch["attention_mask"])
    tokens = [tokenizer.convert_ids_to_tokens(row) for row in batch["input_ids"]]
    assert [tokens[0][t] for t in masks[0, :, 0].nonzero().flatten()] == ["[CLS]"]
    assert [tokens[0][t] for t in masks[0, :, 1].nonzero().flatten()] == ["[SEP]"]
    assert [tokens[0][t] for t in masks[0, :, 2].nonzero().flatten()] == [",", "."]
    assert not masks[1, 5:].any()  # padding


def test_decoder_tokenizer_without_bos_uses_the_first_token():
    kinds = TokenKinds(frozenset(), frozenset({9}), torch.zeros(10, dtype=torch.bool), first_is_start=True)
    masks = kinds.masks(torch.tensor([[0, 5, 6, 9], [4, 5, 7, 7]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]]))
    assert masks[..., 0].tolist() == [[False, True, False, False], [True, False, False, False]]  # left padding too
    assert masks[..., 1].tolist() == [[False, False, False, True], [False, False, False, False]]


# ---------------------------------------------------------------------------------------------
# Word-level syntax, both directions
# ---------------------------------------------------------------------------------------------
def three_word_case():
    """'a b c' with heads a->b (det), c->b (obj); tokens [CLS] a b c [SEP]."""
    tree = sentence(["a", "b", "c"], [2, 0, 2], ["det", "root", "obj"])
    alignment = Alignment(token_word=np.array([-1, 0, 1, 2, -1]), num_words=3)
    probs = torch.tensor(
        [
            [0.2, 0.2, 0.2, 0.2, 0.2],
            [0.0, 0.1, 0.2, 0.7, 0.0],  # a attends most to c (its head is b)
            [0.1, 0.6, 0.1, 0.1, 0.1],  # b attends most to a
            [0.0, 0.1, 0.8, 0.1, 0.0],  # c attends most to b
            [0.2, 0.2, 0.2, 0.2, 0.2],
        ]
    )[None, None]
    return tree, alignment, probs


def test_both_directions_by_hand():
    tree, alignment, probs = three_word_case()
    words = word_attention(probs, alignment)
    valid = torch.ones(1, 3, dtype=torch.bool)
    # dependent -> head: each word's most attended other word.
    assert predicted_heads(words, valid, "dependent_to_head")[0, 0].tolist() == [2, 0, 1]
    # head -> dependent: for each word, the other word attending most to it (a: b 0.6; b: c 0.8; c: a 0.7).
    assert predicted_heads(words, valid, "head_to_dependent")[0, 0].tolist() == [1, 2, 0]
    result = ParentAccuracy.empty(layers=1, heads=1)
    result.update({0: probs}, SyntaxTargets.build([tree], [alignment], tokens=5))
    assert result.words == 2 and float(result.accuracy) == 0.5 and float(result.reverse_accuracy) == 0.5
    assert float(result.relation_accuracy("det")) == 0.0 and float(result.relation_accuracy("obj")) == 1.0
    assert float(result.relation_accuracy("det", "head_to_dependent")) == 1.0
    assert float(result.relation_accuracy("obj", "head_to_dependent")) == 0.0
    assert result.offset_hits[1] == 1 and result.offset_hits[-1] == 1
    assert result.relation_table()[0]["relation"] == "all"


def test_self_attention_is_never_a_prediction():
    words = torch.tensor([[[[0.9, 0.1], [0.2, 0.8]]]])
    predicted = predicted_heads(words, torch.ones(1, 2, dtype=torch.bool), "dependent_to_head")
    assert predicted[0, 0].tolist() == [1, 0]


def reference_accuracy(model, tokenizer, sentences):
    """Per-sentence loop (no padding, no batching): the definition the batched pass must reproduce."""
    hub = attnreg.attach(model)
    hits = reverse = words = 0
    for tree in sentences:
        encoding = tokenizer(tree.text, return_offsets_mapping=True, return_tensors="pt")
        alignment = align_offsets(tree, encoding.pop("offset_mapping")[0].numpy())
        with torch.no_grad(), hub.capture() as probs:
            model(**encoding)
        stacked = torch.stack([probs[layer][0] for layer in range(hub.num_layers)])  # [L, H, T, T]
        matrix = word_attention(stacked, alignment)
        matrix = matrix.masked_fill(torch.eye(matrix.shape[-1], dtype=torch.bool), -1.0)
        gold = torch.tensor(tree.heads) - 1
        scored = gold >= 0
        hits = hits + (matrix.argmax(-1) == gold)[..., scored].sum(-1)
        reverse = reverse + (matrix.argmax(-2) == gold)[..., scored].sum(-1)
        words += int(scored.sum())
    return hits / words, reverse / words


def test_batched_pass_matches_the_per_sentence_reference():
    tokenizer = word_tokenizer()
    model = tiny_model("bert", vocab=len(tokenizer), layers=2, heads=4, hidden=32).eval()
    sentences = random_sentences(16)
    result = parent_accuracy(model, tokenizer, sentences, batch_size=6)
    forward, backward = reference_accuracy(model, tokenizer, sentences)
    torch.testing.assert_close(result.accuracy, forward.float())
    torch.testing.assert_close(result.reverse_accuracy, backward.float())
    assert result.words == sum(sum(h > 0 for h in s.heads) for s in sentences)
    assert result.relation_words()["det"] == sum(s.relations.count("det") for s in sentences)


# ---------------------------------------------------------------------------------------------
# The streaming pass on real models
# ---------------------------------------------------------------------------------------------
def test_gated_head_is_dormant_and_pruned_head_reads_nan():
    tokenizer = word_tokenizer()
    model = tiny_model("bert", vocab=len(tokenizer), layers=2, heads=4, hidden=32)
    hub = attnreg.attach(model)
    with torch.no_grad():
        hub.gate(1)[2] = 0.0
    prune_heads(model, {0: [3]})
    sentences = random_sentences(8)
    analysis = analyze(model, tokenizer, sentences, batch_size=4)
    roles = analysis.roles()
    assert roles.of(1, 2).primary == "dormant"
    assert sum(role.primary == "dormant" for role in roles.heads) == 1
    assert roles.grid()[0][3] == "pruned"
    assert torch.isnan(analysis.statistics["entropy"][0, 3]) and torch.isnan(analysis.syntax.accuracy[0, 3])
    assert not torch.isnan(analysis.statistics["entropy"][0, :3]).any()
    assert analysis.syntax.best_head()[:2] != (0, 3)
    assert model.training  # the mode is restored


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_decoders_from_a_dataloader(family):
    model = tiny_model(family, layers=2, heads=4, hidden=32).eval()
    tokenizer = word_tokenizer()  # only tells special and punctuation ids here
    generator = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(5, 99, (3, 7), generator=generator)} for _ in range(2)]
    analysis = analyze(model, tokenizer, batches, similarity=True)
    assert analysis.syntax is None and analysis.sequences == 6 and analysis.tokens == 42
    assert torch.all(analysis.statistics["to_next"] == 0)  # a decoder never sees the next token
    entropy = analysis.statistics["entropy"]
    assert entropy.shape == (2, 4) and torch.all((entropy > 0) & (entropy <= 1))
    assert analysis.similarity.mean.shape == (3,)


def test_token_importance_and_similarity_by_hand():
    probs = torch.zeros(1, 2, 3, 3)
    probs[0, 0, 0] = torch.tensor([0.5, 0.5, 0.0])
    probs[0, 1, 0] = torch.tensor([0.0, 0.5, 0.5])
    probs[0, :, 1] = torch.tensor([0.0, 0.0, 1.0])
    torch.testing.assert_close(token_importance({0: probs}), torch.tensor([[0.25, 0.5, 0.25]]))
    # Causal: the last real token's row (here row 1: the third token is padding).
    torch.testing.assert_close(
        token_importance([probs], torch.tensor([[1, 1, 0]]), causal=True), torch.tensor([[0.0, 0.0, 1.0]])
    )
    similarity = TokenSimilarity.empty(layers=1)
    same = torch.tensor([[[1.0, 0.0], [2.0, 0.0], [0.0, 5.0]]])
    orthogonal = torch.tensor([[[1.0, 0.0], [0.0, 3.0], [7.0, 7.0]]])
    similarity.update([same, orthogonal], torch.tensor([[1, 1, 0]]))  # the third token is padding
    torch.testing.assert_close(similarity.mean, torch.tensor([1.0, 0.0]))
    assert similarity.collapsed(0.9) == [0]


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------
def png_size(path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_plots_render_pngs_of_the_expected_size(tmp_path):
    pytest.importorskip("matplotlib")
    from attnreg.analysis.plots import attention_grid, head_grid, pruning_curve
    from attnreg.methods.pruning import PruningStep

    probs = torch.softmax(torch.randn(12, 12, 512, 512), -1)  # 144 heads at 512 tokens
    figure = attention_grid(probs, path=tmp_path / "grid.png", cell_inches=0.5, dpi=40)
    assert png_size(tmp_path / "grid.png") == (round((12 * 0.5 + 0.8) * 40), round((12 * 0.5 + 0.8) * 40))
    assert tuple(figure.get_size_inches()) == (6.8, 6.8)
    labelled = attention_grid(probs[:1, :1, :8, :8], tokens=list("abcdefgh"), path=tmp_path / "one.png", dpi=50)
    assert [t.get_text() for t in labelled.axes[0].get_xticklabels()] == list("abcdefgh")
    head_grid(torch.rand(6, 12), "entropy", tmp_path / "entropy.png", dpi=50)
    assert png_size(tmp_path / "entropy.png") == (round((12 * 0.45 + 2.0) * 50), round((6 * 0.45 + 1.3) * 50))
    roles = [["positional", "no-op"], ["syntactic", "pruned"]]
    legend = head_grid(roles, "roles", tmp_path / "roles.png", dpi=50).axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["positional", "syntactic", "no-op", "pruned"]
    curve = [PruningStep(0, 0.9, {}), PruningStep(4, 0.85, {0: (1,)})]
    pruning_curve(curve, "accuracy", tmp_path / "pruning.png", total_heads=16, dpi=50)
    assert png_size(tmp_path / "pruning.png") == (250, 175)


def test_plots_without_matplotlib_say_what_to_install(monkeypatch):
    from attnreg.analysis.plots import head_grid

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"attnreg\[plots\]"):
        head_grid(torch.rand(2, 2))


# ---------------------------------------------------------------------------------------------
# attnreg-analyze
# ---------------------------------------------------------------------------------------------
def write_conllu(path, sentences) -> None:
    blocks = []
    for tree in sentences:
        lines = [f"# sent_id = {tree.sent_id}", f"# text = {tree.text}"]
        for index, (word, head, relation) in enumerate(zip(tree.words, tree.heads, tree.relations, strict=True), 1):
            lines.append(f"{index}\t{word}\t{word}\tX\tX\t_\t{head}\t{relation}\t_\t_")
        blocks.append("\n".join(lines) + "\n")
    path.write_text("\n".join(blocks) + "\n")


@pytest.fixture
def saved_model(tmp_path):
    tokenizer = word_tokenizer()
    model = tiny_model("bert", vocab=len(tokenizer), layers=2, heads=4, hidden=32)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    write_conllu(tmp_path / "dev.conllu", random_sentences(12))
    return tmp_path


def test_analyze_command_end_to_end(saved_model, capsys):
    pytest.importorskip("matplotlib")
    out = saved_model / "report"
    arguments = [str(saved_model / "model"), str(saved_model / "dev.conllu"), "--out", str(out), "--batch-size", "5"]
    code = main([*arguments, "--table-min-words", "1"])
    assert code == 0 and "analyzed 12 sentences" in capsys.readouterr().out
    expected = {"statistics.csv", "statistics.json", "roles.csv", "relations.csv", "summary.md"}
    expected |= {"entropy.png", "roles.png", "parent_accuracy.png", "attention_example.png"}
    assert expected <= {path.name for path in out.iterdir()}
    report = json.loads((out / "statistics.json").read_text())
    assert report["sequences"] == 12 and len(report["roles"]["heads"]) == 8
    assert {row["relation"] for row in report["syntax"]["relations"]} >= {"all", "det", "nsubj", "obj"}
    assert len((out / "statistics.csv").read_text().splitlines()) == 1 + 8
    summary = (out / "summary.md").read_text()
    assert "Best single head, dependent to head" in summary and "| det |" in summary


def test_analyze_command_refuses_bad_models_clearly(saved_model, monkeypatch, capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail at once, with or without network
    data = str(saved_model / "dev.conllu")
    with pytest.raises(SystemExit) as exit_info:
        main(["no-such-org/no-such-model", data, "--out", str(saved_model / "r")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "'no-such-org/no-such-model'" in error and "download" in error
    (saved_model / "run.ckpt").write_bytes(b"")
    with pytest.raises(SystemExit):
        main([str(saved_model / "run.ckpt"), data])
    assert "--base" in capsys.readouterr().err


def pruned_without_tokenizer(saved_model):
    """A pruned model saved with `save_pruned` and no tokenizer (the folder then has none)."""
    model = tiny_model("bert", vocab=len(word_tokenizer()), layers=2, heads=4, hidden=32)
    prune_heads(model, {0: [1]})
    return model, save_pruned(model, saved_model / "pruned")


def test_analyze_command_refuses_a_tokenizer_that_cannot_tokenize_the_text(saved_model, capsys):
    _, pruned = pruned_without_tokenizer(saved_model)
    data = str(saved_model / "dev.conllu")
    options = ["--out", str(saved_model / "report"), "--no-plots"]
    with pytest.raises(SystemExit) as exit_info:  # transformers would build a 5-entry tokenizer: all [UNK]
        main([str(pruned), data, *options])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "no tokenizer files" in error and "--tokenizer" in error
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    BertTokenizer(vocab={token: index for index, token in enumerate(specials)}).save_pretrained(saved_model / "empty")
    with pytest.raises(SystemExit) as exit_info:  # tokenizer files that know none of the words
        main([str(pruned), data, "--tokenizer", str(saved_model / "empty"), *options])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "100% of the" in error and "--tokenizer" in error
    assert main([str(pruned), data, "--tokenizer", str(saved_model / "model"), *options]) == 0


def test_save_pruned_saves_the_tokenizer_beside_the_model(saved_model):
    model, _ = pruned_without_tokenizer(saved_model)
    save_pruned(model, saved_model / "with_tokenizer", tokenizer=word_tokenizer())
    loaded, tokenizer = load_model(str(saved_model / "with_tokenizer"))
    assert tokenizer.get_vocab() == word_tokenizer().get_vocab() and type(loaded) is type(model)
    options = ["--out", str(saved_model / "report"), "--no-plots"]
    assert main([str(saved_model / "with_tokenizer"), str(saved_model / "dev.conllu"), *options]) == 0


def test_check_tokenizer_counts_words_it_cannot_represent(tmp_path):
    texts = ["the dogs see a cat .", "zebra quokka"]  # "see" and the last two words are not in WORDS
    assert check_tokenizer(word_tokenizer(), [s.text for s in random_sentences(5)]) == 0.0
    assert check_tokenizer(word_tokenizer(), texts) == pytest.approx(3 / 8)
    with pytest.raises(ValueError, match=r"38% of the 8 words .*'see', 'zebra', 'quokka'"):
        check_tokenizer(word_tokenizer(), texts, max_unknown=0.25)
    tiny_model("gpt2").save_pretrained(tmp_path)  # a byte-level tokenizer built from nothing gives no tokens at all
    with pytest.raises(ValueError, match="100% of the 8 words"):
        check_tokenizer(AutoTokenizer.from_pretrained(tmp_path), texts)


def test_lightning_checkpoint_loads_with_its_base(saved_model):
    from conftest import fit, padded_batch

    from attnreg.app.modules import SequenceClassifier

    tokenizer = word_tokenizer()
    classifier = tiny_model("bert", "classification", vocab=len(tokenizer), layers=2, heads=4, hidden=32, num_labels=3)
    batch = {**padded_batch(vocab=len(tokenizer)), "labels": torch.tensor([0, 1, 2])}
    trainer = fit(SequenceClassifier(classifier, lr=1e-2), [batch, batch])
    trainer.save_checkpoint(saved_model / "run.ckpt")
    model, loaded_tokenizer = load_model(str(saved_model / "run.ckpt"), base=str(saved_model / "model"))
    assert model.config.num_labels == 3 and loaded_tokenizer.is_fast
    for key, value in classifier.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value)


# ---------------------------------------------------------------------------------------------
# Blockwise: statistics and parent accuracy from queries and keys, never [T, T]
# ---------------------------------------------------------------------------------------------
BLOCK_FAMILIES = {
    "bert": {},
    "gpt2": {},
    "llama": {},  # grouped-query attention
    "mistral": {"sliding_window": 3},  # the window lives in the layer's 4-D mask
    "gemma2": {"sliding_window": 3},  # logit softcap, sliding and full layers alternating
}


def mixed_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Two batches of 11 tokens over word_tokenizer's ids ([CLS] first, punctuation and [SEP] among them): one
    right-padded, one left-padded."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for side in ("right", "left"):
        input_ids = torch.randint(3, len(word_tokenizer()), (3, 11), generator=generator)
        input_ids[:, 0] = 2
        attention_mask = torch.ones(3, 11, dtype=torch.long)
        for row, pad in ((1, 3), (2, 6)):
            attention_mask[row, -pad:] = 0 if side == "right" else 1
            if side == "left":
                attention_mask[row, :pad] = 0
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask})
    return batches


@pytest.mark.parametrize("family", sorted(BLOCK_FAMILIES))
def test_blockwise_statistics_equal_the_materialized_path(family):
    model = tiny_model(family, layers=2, heads=4, hidden=32, **BLOCK_FAMILIES[family]).eval()
    tokenizer, batches = word_tokenizer(), mixed_batches()
    blocks = attnreg.analysis.head_statistics(model, tokenizer, batches, blockwise=True, block_size=3)
    full = attnreg.analysis.head_statistics(model, tokenizer, batches, blockwise=False)
    torch.testing.assert_close(blocks.rows, full.rows)  # the same rows counted for every statistic
    for name in blocks:
        torch.testing.assert_close(blocks[name], full[name], atol=1e-5, rtol=1e-5, msg=name)
    assert not blocks["to_first"].isnan().any() and blocks["to_first"].min() > 0


def test_sliding_window_uniform_heads_read_entropy_one_and_their_sink_share():
    """Queries of zero give every admitted key the same score: attention is uniform over the window the layer's
    mask admits, so normalized entropy is 1 on both paths and the first token gets 1/(i+1) until it leaves it."""
    window, tokens = 3, 9
    model = tiny_model("mistral", layers=1, heads=4, hidden=32, sliding_window=window).eval()
    with torch.no_grad():
        model.layers[0].self_attn.q_proj.weight.zero_()
    batch = [{"input_ids": torch.arange(5, 5 + tokens)[None]}]
    expected_first = sum(1 / (i + 1) for i in range(window)) / tokens  # row i sees keys max(0, i - 2)..i
    for blockwise in (True, False):
        stats = attnreg.analysis.head_statistics(model, word_tokenizer(), batch, blockwise=blockwise, block_size=2)
        torch.testing.assert_close(stats["entropy"], torch.ones(1, 4))
        torch.testing.assert_close(stats["to_first"], torch.full((1, 4), expected_first))


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_attention_to_the_first_token_against_a_direct_computation(family):
    model = tiny_model(family, layers=2, heads=4, hidden=32).eval()
    hub = attnreg.attach(model)
    batch = mixed_batches()[1]  # left-padded: the first real token is not at position 0
    with torch.no_grad(), hub.capture() as probs:
        model(**batch)
    mask = batch["attention_mask"]
    expected = torch.zeros(2, 4)
    for layer in range(2):
        for head in range(4):
            shares = [
                float(probs[layer][b, head, i, int(mask[b].nonzero()[0])])
                for b in range(mask.shape[0])
                for i in range(mask.shape[1])
                if mask[b, i]
            ]
            expected[layer, head] = sum(shares) / len(shares)
        torch.testing.assert_close(first_token_attention(probs[layer], mask), expected[layer])
    for blockwise in (True, False):
        stats = attnreg.analysis.head_statistics(model, word_tokenizer(), [batch], blockwise=blockwise, block_size=4)
        torch.testing.assert_close(stats["to_first"], expected)


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_blockwise_parent_accuracy_equals_the_materialized_path(family):
    tokenizer = word_tokenizer()
    model = tiny_model(family, vocab=len(tokenizer), layers=2, heads=4, hidden=32).eval()
    sentences = random_sentences(16)
    blocks = parent_accuracy(model, tokenizer, sentences, batch_size=6, blockwise=True, block_size=3)
    full = parent_accuracy(model, tokenizer, sentences, batch_size=6, blockwise=False)
    assert blocks.causal == (family == "llama") and blocks.words == full.words > 0
    torch.testing.assert_close(blocks.hits, full.hits)
    torch.testing.assert_close(blocks.reverse_hits, full.reverse_hits)
    assert blocks.relation_words() == full.relation_words()
    for relation in full.by_relation:
        torch.testing.assert_close(blocks.by_relation[relation][0], full.by_relation[relation][0], msg=relation)
        torch.testing.assert_close(blocks.reverse_by_relation[relation], full.reverse_by_relation[relation])
    if family == "bert":  # and both equal the per-sentence loop
        forward, backward = reference_accuracy(model, tokenizer, sentences)
        torch.testing.assert_close(blocks.accuracy, forward.float())
        torch.testing.assert_close(blocks.reverse_accuracy, backward.float())


def test_blockwise_path_never_builds_attention_maps(monkeypatch):
    """The blockwise path never calls the hub's materializing softmax; by default it is taken above
    BLOCKWISE_LENGTH tokens only."""
    model = tiny_model("gpt2", layers=2, heads=4, hidden=32).eval()
    tokenizer, batches = word_tokenizer(), mixed_batches()

    def refuse(*args, **kwargs):
        raise AssertionError("attention was materialized")

    monkeypatch.setattr(attnreg.eager, "attention_probabilities", refuse)
    tokens = analyze(model, tokenizer, batches, blockwise=True, block_size=4).tokens
    assert tokens == 2 * (33 - 9)
    with pytest.raises(AssertionError, match="materialized"):
        analyze(model, tokenizer, batches, blockwise=False)
    monkeypatch.setattr(attnreg.analysis.runner, "BLOCKWISE_LENGTH", 10)  # the batches have 11 tokens
    analyze(model, tokenizer, batches)
    with pytest.raises(AssertionError, match="materialized"):
        analyze(model, tokenizer, [{key: value[:, :10] for key, value in batch.items()} for batch in batches])


def test_blockwise_on_a_pruned_model():
    tokenizer = word_tokenizer()
    model = tiny_model("bert", vocab=len(tokenizer), layers=3, heads=4, hidden=32).eval()
    prune_heads(model, {0: [3], 2: [0, 1, 2, 3]})  # one head, and a whole layer
    sentences = random_sentences(8)
    blocks = analyze(model, tokenizer, sentences, blockwise=True, block_size=5)
    full = analyze(model, tokenizer, sentences, blockwise=False)
    for name in blocks.statistics:
        torch.testing.assert_close(blocks.statistics[name], full.statistics[name], atol=1e-5, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(blocks.syntax.hits, full.syntax.hits)
    assert blocks.statistics["entropy"][0, 3].isnan() and blocks.statistics["entropy"][2].isnan().all()
    assert not blocks.statistics["entropy"][:2, :3].isnan().any()


def test_blockwise_arguments_are_checked():
    model, tokenizer = tiny_model("gpt2").eval(), word_tokenizer()
    batch = mixed_batches()[:1]
    with pytest.raises(TypeError, match="blockwise must be True, False or None"):
        analyze(model, tokenizer, batch, blockwise="yes")
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        analyze(model, tokenizer, batch, block_size=0)
    hub = attnreg.attach(model)
    with torch.no_grad(), hub.capture(layers=[0], inputs=True) as record:
        cache = model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True).past_key_values
        model(input_ids=torch.tensor([[8]]), cache=cache)  # one query, four keys
    with pytest.raises(ValueError, match="as many queries as keys"):
        block_statistics(record[0], torch.zeros(1, 1, 3, dtype=torch.bool))


def test_analyze_command_blockwise_writes_the_same_figures(saved_model):
    options = [str(saved_model / "model"), str(saved_model / "dev.conllu"), "--no-plots", "--batch-size", "5"]
    for mode in ("on", "off"):
        assert main([*options, "--out", str(saved_model / mode), "--blockwise", mode, "--block-size", "4"]) == 0
    blocks, full = (json.loads((saved_model / mode / "statistics.json").read_text()) for mode in ("on", "off"))
    assert blocks["syntax"] == full["syntax"] and blocks["roles"] == full["roles"]
    for name, values in full["statistics"].items():
        np.testing.assert_allclose(np.array(blocks["statistics"][name], float), np.array(values, float), atol=1e-5)
    with pytest.raises(SystemExit):
        main([*options, "--block-size", "0"])
