"""Pruning gives the model that was asked for: grouped-query heads that cannot be removed are silenced
exactly (and stay so through saving, loading, checkpoints and training), and warnings are not swallowed."""

import copy
import warnings

import lightning as L
import pytest
import torch
from conftest import Classifier, fit, main_output, padded_batch

import attnreg
from attnreg.callbacks.pruning import HeadGating
from attnreg.methods import L1Gates, Removal, pruning
from attnreg.methods.pruning import load_pruned, prune_heads, pruned_heads, save_pruned, silenced_heads
from attnreg.structure import surgery
from attnreg.tiny import tiny_model

HEAD_DIM = 8  # tiny_model: hidden 32, 4 heads


def llama(**options):
    """A tiny Llama decoder: 4 query heads per layer sharing 2 key/value heads, groups {0, 1} and {2, 3}."""
    model = tiny_model("llama", head="causal_lm", initializer_range=0.2, **options).eval()
    assert {(info.num_heads, info.num_kv_heads) for info in attnreg.attach(copy.deepcopy(model)).layers} == {(4, 2)}
    return model


def gated_to_zero(model, heads):
    """A copy of `model` whose hub gates are 0 on `heads` (original numbers of the unpruned model)."""
    reference = copy.deepcopy(model)
    hub = attnreg.attach(reference)
    for layer, chosen in heads.items():
        with torch.no_grad():
            hub.gate(layer)[list(chosen)] = 0.0
    return reference


def outputs(model, batch):
    with torch.no_grad():
        return main_output(model(**batch))


def columns(model, layer, head, grad=False):
    """The output-projection input columns (or their gradient) of the head at current position `head`."""
    weight = model.model.layers[layer].self_attn.o_proj.weight
    return (weight.grad if grad else weight)[:, head * HEAD_DIM : (head + 1) * HEAD_DIM]


def test_a_query_head_whose_group_stays_is_silenced_exactly():
    model = llama()
    batch = padded_batch()
    unpruned = outputs(model, batch)
    reference = gated_to_zero(model, {0: [1]})
    with pytest.warns(UserWarning, match="silenced"):
        report = prune_heads(model, {0: [1]})
    assert (outputs(model, batch) - outputs(reference, batch)).abs().max() <= 1e-5
    assert (outputs(model, batch) - unpruned).abs().max() > 1e-3  # the head did matter
    assert report.removed == {} and list(report.kept) == [0] and list(report.kept[0]) == [1]
    assert report.kept[0][1].startswith("silenced") and report.heads[0] == (4, 2)
    assert silenced_heads(model) == {0: (1,)} and pruned_heads(model) == {}
    assert model.config.attnreg_silenced_heads == {"0": [1]}  # inspectable, and saved with config.json
    assert torch.count_nonzero(columns(model, 0, 1)) == 0


def test_silenced_heads_survive_save_and_load(tmp_path):
    model = llama(layers=3)
    with pytest.warns(UserWarning, match="silenced"):
        prune_heads(model, {0: [1], 1: [0, 1, 3], 2: [2, 3]})
    assert pruned_heads(model) == {1: (0, 1), 2: (2, 3)} and silenced_heads(model) == {0: (1,), 1: (3,)}
    save_pruned(model, tmp_path)
    loaded = load_pruned(tmp_path)
    batch = padded_batch()
    assert torch.equal(outputs(loaded, batch), outputs(model, batch))
    assert pruned_heads(loaded) == pruned_heads(model) and silenced_heads(loaded) == silenced_heads(model)
    # the reloaded model keeps them silent under training too
    optimizer = torch.optim.AdamW(loaded.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        loaded.train()(**batch, labels=batch["input_ids"]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert torch.count_nonzero(columns(loaded, 0, 1)) == 0 and torch.count_nonzero(columns(loaded, 1, 1)) == 0


@pytest.mark.parametrize("second", [[0], [0, 1]], ids=["rest-of-group", "names-the-silenced-head"])
def test_a_later_request_removes_a_silenced_head_with_its_group(second):
    model = llama()
    reference = gated_to_zero(model, {0: [0, 1]})
    with pytest.warns(UserWarning, match="silenced"):
        prune_heads(model, {0: [1]})
    report = prune_heads(model, {0: second})
    assert report.removed == {0: (0, 1)} and report.kept == {} and report.heads[0] == (2, 1)
    assert pruned_heads(model) == {0: (0, 1)} and silenced_heads(model) == {}
    batch = padded_batch()
    assert (outputs(model, batch) - outputs(reference, batch)).abs().max() <= 1e-5


def test_training_after_pruning_keeps_silenced_heads_silent():
    model = llama().train()
    batch = {**padded_batch(), "labels": padded_batch()["input_ids"]}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model(**batch).loss.backward()
    optimizer.step()  # Adam moments of every column are nonzero now
    with pytest.warns(UserWarning, match="silenced"):
        prune_heads(model, {0: [2], 1: [0, 1, 3]}, optimizers=[optimizer])
    for _ in range(3):
        optimizer.zero_grad()
        model(**batch).loss.backward()
        assert torch.count_nonzero(columns(model, 0, 2, grad=True)) == 0
        optimizer.step()
    assert torch.count_nonzero(columns(model, 0, 2)) == 0 and torch.count_nonzero(columns(model, 1, 1)) == 0


def test_silence_heads_by_hand_checks_the_request_and_changes_nothing_on_error():
    model = tiny_model("bert").eval()
    prune_heads(model, {0: [3]})
    saved = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(ValueError, match="head 3 of layer 0 was already pruned"):
        pruning.silence_heads(model, {1: [0], 0: [3]})
    assert silenced_heads(model) == {} and all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    reference = gated_to_zero(tiny_model("bert").eval(), {0: [1, 3]})
    pruning.silence_heads(model, {0: [1]})
    batch = padded_batch()
    assert (outputs(model, batch) - outputs(reference, batch)).abs().max() <= 1e-5
    assert prune_heads(model, {0: [2]}).removed == {0: (2,)}  # a head silenced by hand stays until it is named
    assert silenced_heads(model) == {0: (1,)}


def test_silence_heads_on_every_family_matches_a_zero_gate_and_survives_a_training_step(family):
    model = tiny_model(family, initializer_range=0.2).eval()
    reference = gated_to_zero(model, {0: [1]})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pruning.silence_heads(model, {0: [1]}, optimizers=[optimizer])
    batch = padded_batch()
    assert (outputs(model, batch) - outputs(reference, batch)).abs().max() <= 1e-5
    main_output(model.train()(**batch)).square().mean().backward()
    optimizer.step()
    weight = attnreg.detect_family(model).out_projection(model, 0).weight
    silenced = weight[HEAD_DIM : 2 * HEAD_DIM] if family == "gpt2" else weight[:, HEAD_DIM : 2 * HEAD_DIM]  # Conv1D
    assert torch.count_nonzero(silenced) == 0 and torch.count_nonzero(weight) > 0


def test_lightning_checkpoint_restores_silenced_heads():
    model = llama()
    with pytest.warns(UserWarning, match="silenced"):
        prune_heads(model, {0: [1], 1: [2, 3]})
    checkpoint = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}
    pruning.add_pruning_to_checkpoint(model, checkpoint)
    fresh = tiny_model("llama", head="causal_lm", seed=1).eval()
    pruning.restore_pruning(fresh, checkpoint)
    assert pruned_heads(fresh) == {1: (2, 3)} and silenced_heads(fresh) == {0: (1,)}
    fresh.load_state_dict(model.state_dict())
    batch = padded_batch()
    assert torch.equal(outputs(fresh, batch), outputs(model, batch))
    with pytest.raises(ValueError, match="does not record"):
        pruning.restore_pruning(fresh, {pruning.PRUNED_HEADS: {"1": [2, 3]}})


class SilencedColumns(L.Callback):
    """After HeadGating: the output-projection columns of the heads silenced so far, at every batch end."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        model = pl_module.model
        for layer, heads in silenced_heads(model).items():
            numbers = pruning.head_numbers(model, layer)
            self.seen += [columns(model, layer, numbers.index(head)).detach().clone() for head in heads]


def test_heads_silenced_by_a_gating_round_stay_silent_while_training_goes_on():
    model = tiny_model("llama", head="classification", initializer_range=0.2)
    gating = HeadGating(gates=L1Gates(weight=0.1), removal=Removal(milestones=[(0.25, 5), (0.75, 3)]))
    watch = SilencedColumns()
    batch = {**padded_batch(batch=8, length=10), "labels": torch.tensor([0, 1] * 4)}
    with pytest.warns(UserWarning, match="silenced"):
        fit(Classifier(model), [batch] * 4, [gating, watch])
    assert watch.seen and all(torch.count_nonzero(seen) == 0 for seen in watch.seen)
    left = {
        layer: set(heads) - set(pruned_heads(model).get(layer, ())) for layer, heads in gating.method.removed.items()
    }
    assert silenced_heads(model) == {layer: tuple(sorted(heads)) for layer, heads in left.items() if heads}


def warn_then(original):
    """`original`, warning first (as transformers or torch might while heads are cut)."""

    def wrapped(*args, **kwargs):
        warnings.warn("a warning raised while cutting heads", UserWarning, stacklevel=2)
        return original(*args, **kwargs)

    return wrapped


def test_reapplying_a_pruning_hides_no_warnings(tmp_path, monkeypatch):
    model = llama()
    with pytest.warns(UserWarning, match="silenced"):
        prune_heads(model, {0: [1], 1: [2, 3]})
    save_pruned(model, tmp_path)
    checkpoint = {}
    pruning.add_pruning_to_checkpoint(model, checkpoint)
    monkeypatch.setattr(surgery, "_prune_layer", warn_then(surgery._prune_layer))
    for reapply in (lambda: load_pruned(tmp_path), lambda: pruning.restore_pruning(llama(), checkpoint)):
        with pytest.warns(UserWarning) as record:
            reapply()
        assert [str(w.message) for w in record] == ["a warning raised while cutting heads"]  # and no notice of its own
