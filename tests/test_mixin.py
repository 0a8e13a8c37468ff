"""AttnRegMixin and AttentionLoss inside real Lightning training."""

import copy

import conftest
import lightning as L
import pytest
import torch
from conftest import padded_batch

import attnreg
from attnreg.tiny import tiny_model


class Classifier(attnreg.AttnRegMixin, L.LightningModule):
    def __init__(self, model, output="tensor"):
        super().__init__()
        self.model = model
        self.output = output

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        return {"loss": loss, "plain": loss.detach()} if self.output == "dict" else loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class ByHand(Classifier):
    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss + self.attnreg_loss()


class PlainModule(L.LightningModule):
    """A user's existing module, written without attnreg."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def batches(count=4, size=8):
    items = []
    for seed in range(count):
        batch = padded_batch(batch=size, length=10, seed=seed)
        batch["labels"] = (batch["input_ids"][:, 0] % 2).long()
        items.append(batch)
    return items


def mean_entropy(probs: torch.Tensor) -> torch.Tensor:
    return -(probs * probs.clamp_min(1e-12).log()).sum(-1).mean()


def fit(module, callbacks=(), steps=4):
    return conftest.fit(module, batches(steps), callbacks)


def test_fit_with_a_term_changes_training_and_logs_it():
    model = tiny_model("bert", head="classification")
    with_term = Classifier(copy.deepcopy(model))
    without = Classifier(copy.deepcopy(model))
    sharpen = attnreg.AttentionLoss(lambda probs, batch: mean_entropy(probs[0]), name="sharpen", layers=[0])
    trainer = fit(with_term, [sharpen])
    fit(without)
    assert "attnreg/sharpen" in trainer.callback_metrics
    changed = [
        name
        for (name, a), (_, b) in zip(with_term.named_parameters(), without.named_parameters(), strict=True)
        if not torch.equal(a, b)
    ]
    assert any("layer.0.attention.self.query" in name for name in changed)
    assert with_term.attnreg_terms == {}  # removed at teardown


def test_entropy_term_lowers_entropy_during_fit():
    model = tiny_model("gpt2", head="classification", initializer_range=0.2)  # away from uniform attention
    module = Classifier(model)
    hub = attnreg.attach(model)
    probe = padded_batch(batch=8, length=10, seed=99)

    def entropy_now():
        with torch.no_grad(), hub.capture(layers=[1]) as probs:
            model(**probe)
        return mean_entropy(probs[1]).item()

    before = entropy_now()
    fit(module, [attnreg.AttentionLoss(lambda p, b: mean_entropy(p[1]), name="sharpen", layers=[1], weight=5.0)], 12)
    assert entropy_now() < before - 0.05


def test_dict_output_gets_the_term_added():
    module = Classifier(tiny_model("bert", head="classification"), output="dict")
    module.add_attnreg_term("constant", lambda probs, batch: torch.tensor(3.0))
    batch = batches(1)[0]
    output = module.training_step(batch, 0)
    assert torch.allclose(output["loss"], output["plain"] + 3.0)


def test_attnreg_loss_by_hand_is_not_added_twice():
    module = ByHand(tiny_model("bert", head="classification"))
    module.add_attnreg_term("constant", lambda probs, batch: torch.tensor(3.0))
    batch = batches(1)[0]
    plain = module.model(**batch).loss
    assert torch.allclose(module.training_step(batch, 0), plain + 3.0)
    with pytest.raises(RuntimeError, match="inside training_step"):
        module.attnreg_loss()


def test_term_sees_captured_layers_with_graph():
    module = Classifier(tiny_model("llama", head="classification"))
    seen = {}

    def term(probs, batch):
        seen["layers"] = list(probs)
        return probs[1].sum() * 0

    module.add_attnreg_term("look", term, layers=[1])
    module.train()
    module.training_step(batches(1)[0], 0)
    assert seen["layers"] == [1]


def test_callback_without_mixin_says_to_add_it():
    callback = attnreg.AttentionLoss(lambda p, b: p[0].sum(), name="x")
    with pytest.raises(TypeError, match=r"AttentionLoss needs .*AttnRegMixin.*class PlainModule\(attnreg.AttnRegMixin"):
        fit(PlainModule(tiny_model("bert", head="classification")), [callback], steps=1)


def test_term_must_return_a_scalar_and_names_are_unique():
    module = Classifier(tiny_model("bert", head="classification"))
    module.add_attnreg_term("vector", lambda probs, batch: torch.ones(2))
    with pytest.raises(TypeError, match="'vector' must return a scalar"):
        module.training_step(batches(1)[0], 0)
    with pytest.raises(ValueError, match="already registered"):
        module.add_attnreg_term("vector", lambda probs, batch: torch.ones(()))


class MixedIn(attnreg.AttnRegMixin, PlainModule):
    """The mixin added to an existing module without touching its training_step."""


def test_mixin_wraps_an_inherited_training_step():
    module = MixedIn(tiny_model("bert", head="classification"))
    module.add_attnreg_term("constant", lambda probs, batch: torch.tensor(3.0))
    batch = batches(1)[0]
    assert torch.allclose(module.training_step(batch, 0), module.model(**batch).loss + 3.0)
    plain = PlainModule(module.model)
    assert torch.allclose(plain.training_step(batch, 0), module.model(**batch).loss)  # the base is untouched
