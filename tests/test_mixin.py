"""AttnRegMixin and AttentionLoss (the one term of a function, also what `add_attnreg_term` makes) inside real
Lightning training."""

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


def test_a_term_of_a_function_reads_layer_inputs_blockwise_as_it_reads_probabilities():
    """`add_attnreg_term(..., inputs=True)` builds an `AttentionLoss` that reads `LayerInputs` (the layer stays on SDPA:
    the step's loss is the plain model's plus the term); its blockwise entropy equals the entropy of the probabilities
    the materialized term reads."""
    from attnreg import blockwise, losses

    model = tiny_model("gpt2", head="classification", initializer_range=0.2)
    batch = batches(1)[0]
    mask = batch["attention_mask"]
    values = {}

    def from_inputs(record, batch):
        values["blockwise"] = blockwise.attention_entropy(record[1], mask, causal=True)
        return values["blockwise"].mean()

    def from_probs(record, batch):
        values["materialized"] = losses.attention_entropy(record[1], attention_mask=mask, causal=True)
        assert isinstance(record[1], torch.Tensor)
        return values["materialized"].mean()

    for name, fn, inputs in (("blockwise", from_inputs, True), ("materialized", from_probs, False)):
        module = Classifier(copy.deepcopy(model)).train()
        module.add_attnreg_term(name, fn, layers=[1], inputs=inputs)
        term = module.attnreg_terms[name]
        assert isinstance(term, attnreg.methods.AttentionLoss) and term.inputs is inputs and term.layers == (1,)
        loss = module.training_step(batch, 0)
        if inputs:
            torch.testing.assert_close(loss, module.model(**batch).loss + values[name].mean())
    torch.testing.assert_close(values["blockwise"], values["materialized"], rtol=1e-5, atol=1e-6)
    assert values["blockwise"].min().item() > 0.1


OLD_NAME_FORMS = {
    "from attnreg.mixin import AttentionTerm": "from attnreg.mixin import AttentionTerm as found",
    "from attnreg import AttentionTerm": "from attnreg import AttentionTerm as found",
    "attnreg.AttentionTerm": "import attnreg; found = attnreg.AttentionTerm",
    "attnreg.mixin.AttentionTerm": "import attnreg.mixin; found = attnreg.mixin.AttentionTerm",
}


@pytest.mark.parametrize("form", sorted(OLD_NAME_FORMS))
def test_the_former_attention_term_is_attention_loss_with_a_warning_a_user_sees(form):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()  # Python's default filters: a DeprecationWarning would not be shown
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.filterwarnings("ignore", category=category)
        exec(OLD_NAME_FORMS[form], namespace := {"__name__": "users_module"})
    assert namespace["found"] is attnreg.methods.AttentionLoss
    assert [w.category for w in caught] == [FutureWarning]
    assert "AttentionTerm is deprecated: use attnreg.methods.AttentionLoss" in str(caught[0].message)
    module = Classifier(tiny_model("bert", head="classification"))
    module.add_attnreg_term("spread", lambda probs, batch: probs[0].var(), layers=0)
    assert isinstance(module.attnreg_terms["spread"], namespace["found"])  # what the mixin makes is one


def test_the_former_argument_order_is_refused_saying_the_new_one():
    with pytest.raises(TypeError, match=r"got 'spread' \(AttentionTerm\(name, fn, \.\.\.\) is now AttentionLoss\(fn"):
        attnreg.methods.AttentionLoss("spread", lambda probs, batch: probs[0].var())
    assert "AttentionTerm" not in attnreg.__all__ and "AttentionTerm" not in vars(attnreg.mixin)


def test_a_method_object_given_to_lightning_as_a_callback_is_refused_naming_the_callback_of_its_name():
    """`attnreg.EntropyRegularizer` is the Lightning callback that runs the method `attnreg.methods.EntropyRegularizer`:
    the method given to Lightning as a callback is refused when the trainer is built, naming the callback to give."""
    with pytest.raises(TypeError, match=r"EntropyRegularizer is an attnreg method.*attnreg.EntropyRegularizer\("):
        L.Trainer(callbacks=[attnreg.methods.EntropyRegularizer()], logger=False)

    class Mine(attnreg.methods.Method):
        pass

    with pytest.raises(TypeError, match=r"Mine is a method object.*attnreg.MethodCallback\(method\)"):
        L.Trainer(callbacks=[Mine()], logger=False)
    trainer = L.Trainer(callbacks=[attnreg.EntropyRegularizer(), attnreg.MethodCallback(Mine())], logger=False)
    assert isinstance(trainer.callbacks[0].method, attnreg.methods.EntropyRegularizer)
