"""Entropy and prior-KL callbacks in real Lightning fits: they move the attention they target."""

import conftest
import lightning as L
import pytest
import torch
from conftest import padded_batch

import attnreg
from attnreg.losses import attention_entropy
from attnreg.schedules import Linear
from attnreg.tiny import tiny_model

PRIOR = "attnreg_prior"


class Classifier(attnreg.AttnRegMixin, L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        inputs = {key: value for key, value in batch.items() if key != PRIOR}
        return self.model(**inputs).loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def previous_token_prior(attention_mask):
    """Each real token should attend to the one before it (the first token is left out)."""
    positions = torch.arange(attention_mask.shape[1]).expand_as(attention_mask) - 1
    return positions.masked_fill(~attention_mask.bool(), -1)


def batches(count, seed=0):
    items = []
    for index in range(count):
        batch = padded_batch(batch=8, length=10, seed=seed + index)
        batch["labels"] = (batch["input_ids"][:, 0] % 2).long()
        batch[PRIOR] = previous_token_prior(batch["attention_mask"])
        items.append(batch)
    return items


def fit(model, callback, steps):
    return conftest.fit(Classifier(model), batches(steps), [callback])


def measure(model, layer):
    """(normalized entropy per head, fraction of rows whose argmax is the previous token, per head)."""
    batch = batches(1, seed=100)[0]
    hub = attnreg.attach(model)
    with torch.no_grad(), hub.capture(layers=[layer]) as probs:
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    entropy = attention_entropy(probs[layer], batch["attention_mask"], causal=True, normalize=True)
    rows = batch[PRIOR] >= 0
    hits = (probs[layer].argmax(-1) == batch[PRIOR][:, None]) & rows[:, None]
    return entropy, hits.sum((0, 2)) / rows.sum()


@pytest.mark.parametrize("mode", ["min", "max"])
def test_entropy_callback_moves_entropy_the_asked_way(mode):
    model = tiny_model("gpt2", head="classification", initializer_range=0.2)
    before, _ = measure(model, 1)
    trainer = fit(model, attnreg.EntropyRegularizer(mode=mode, weight=1.0, layers=[1]), steps=12)
    after, _ = measure(model, 1)
    assert "attnreg/entropy_regularizer" in trainer.callback_metrics
    change = (after - before).mean()
    assert change < -0.05 if mode == "min" else change > 0.05


def test_entropy_target_band_pulls_heads_into_it():
    model = tiny_model("bert", head="classification", initializer_range=0.2)
    before, _ = measure(model, 0)
    band = (0.3, 0.5)
    assert before.min() > band[1]
    fit(model, attnreg.EntropyRegularizer(mode="target", target=band, weight=10.0, layers=[0]), steps=20)
    after, _ = measure(model, 0)
    assert (after - band[1]).clamp_min(0).mean() < 0.5 * (before - band[1]).clamp_min(0).mean()


def test_prior_kl_callback_teaches_the_supervised_head():
    model = tiny_model("gpt2", head="classification")
    _, before = measure(model, 0)
    trainer = fit(model, attnreg.SyntaxPriorKL(weight=1.0, layers=[0], heads=[0]), steps=20)
    _, after = measure(model, 0)
    assert "attnreg/syntax_prior_kl" in trainer.callback_metrics
    assert after[0] > 0.9 and before[0] < 0.5


def test_callbacks_check_heads_and_prior_key():
    model = tiny_model("bert", head="classification")
    with pytest.raises(IndexError, match=r"heads=\[7\] out of range for layer 0, which has 4 heads"):
        fit(model, attnreg.SyntaxPriorKL(layers=[0], heads=[7]), steps=1)
    module = Classifier(tiny_model("bert", head="classification"))
    callback = attnreg.SyntaxPriorKL(layers=[0], prior_key="parents")
    callback.setup(None, module, "fit")
    with pytest.raises(KeyError, match=r"batch\['parents'\]; the batch has \['attention_mask', 'attnreg_prior'"):
        module.training_step(batches(1)[0], 0)
    with pytest.raises(ValueError, match="band"):
        attnreg.EntropyRegularizer(mode="target")


def test_prior_kl_with_one_head_per_layer_teaches_each_chosen_head():
    model = tiny_model("gpt2", head="classification")
    trainer = fit(model, attnreg.SyntaxPriorKL(weight=1.0, heads={0: [1], 1: [2]}), steps=20)
    assert {"attnreg/syntax_prior_kl/layer0", "attnreg/syntax_prior_kl/layer1"} <= set(trainer.callback_metrics)
    _, layer0 = measure(model, 0)
    _, layer1 = measure(model, 1)
    assert layer0[1] > 0.9 and layer1[2] > 0.9


def test_weights_and_head_maps_are_validated():
    with pytest.raises(ValueError, match="weight must be a finite number >= 0.*got -1"):
        attnreg.SyntaxPriorKL(weight=-1)
    with pytest.raises(ValueError, match="weight must be a finite number >= 0.*got nan"):
        attnreg.EntropyRegularizer(weight=float("nan"))
    callback = attnreg.SyntaxPriorKL(layers=[0], heads={1: [0]})
    with pytest.raises(ValueError, match=r"heads is given for layers \[1\] but layers=\[0\]"):
        callback.setup(None, Classifier(tiny_model("bert", head="classification")), "fit")


def test_weight_schedule_follows_training_progress():
    model = tiny_model("bert", head="classification")
    callback = attnreg.EntropyRegularizer(weight=Linear(0.0, 1.0), mode="max", layers=[0])
    weights = []
    module = Classifier(model)
    original = callback.method.term

    def recording(probs, batch, step):
        weights.append(callback.current_weight())
        return original(probs, batch, step)

    callback.method.term = recording
    conftest.fit(module, batches(4), [callback])
    assert weights == [0.0, 0.25, 0.5, 0.75]


def test_a_setting_read_or_set_on_the_callback_is_refused_naming_the_methods():
    """The callback only hands its method to the runner: the method holds the settings and state. Reading or setting
    one of them on the callback is an AttributeError that names the method's (not a silent None, nor a value that
    the method never reads)."""
    monitor = attnreg.AttentionMonitor(every_n_steps=5)
    with pytest.raises(AttributeError, match=r"'AttentionMonitor' object has no attribute 'every_n_steps': read "):
        monitor.every_n_steps  # noqa: B018
    with pytest.raises(AttributeError, match=r"`\.method\.every_n_steps`"):
        getattr(monitor, "every_n_steps")  # noqa: B009
    assert getattr(monitor, "needs", None) is None and monitor.method.needs == {"gold_trees", "tokenizer"}
    with pytest.raises(AttributeError, match=r"'AttentionMonitor' object has no setting 'tokenizer': set `\.method"):
        monitor.tokenizer = "a tokenizer"
    assert monitor.method.tokenizer is None and "tokenizer" not in vars(monitor)
    with pytest.raises(AttributeError) as missing:  # an attribute the method lacks too: Python's own message
        monitor.no_such_setting  # noqa: B018
    assert str(missing.value) == "'AttentionMonitor' object has no attribute 'no_such_setting'"

    class Mine(attnreg.callbacks.MethodCallback):  # a subclass's own attributes are its own
        method_class = attnreg.methods.EntropyRegularizer

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seen = []

    mine = Mine(weight=0.5)
    mine.seen.append(1)
    mine.label = "mine"
    assert (mine.seen, mine.label, mine.method.weight) == ([1], "mine", 0.5)


TERM_CALLBACK_FORMS = {
    "from attnreg.callbacks import TermCallback": "from attnreg.callbacks import TermCallback as found",
    "from attnreg.callbacks.base import TermCallback": "from attnreg.callbacks.base import TermCallback as found",
    "attnreg.callbacks.TermCallback": "import attnreg.callbacks; found = attnreg.callbacks.TermCallback",
}


@pytest.mark.parametrize("form", sorted(TERM_CALLBACK_FORMS))
def test_the_former_term_callback_is_method_callback_with_a_warning_a_user_sees(form):
    import warnings

    from attnreg.callbacks import MethodCallback

    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()  # Python's default filters: a DeprecationWarning would not be shown
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.filterwarnings("ignore", category=category)
        exec(TERM_CALLBACK_FORMS[form], namespace := {"__name__": "users_module"})
    assert namespace["found"] is MethodCallback
    assert [w.category for w in caught] == [FutureWarning]
    assert "TermCallback is deprecated: use attnreg.callbacks.MethodCallback" in str(caught[0].message)
    with pytest.raises(AttributeError, match="has no attribute 'TermCallbacks'"):
        attnreg.callbacks.TermCallbacks  # noqa: B018
