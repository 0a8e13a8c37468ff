"""Physical head pruning against gated references, on every family; save/load; importance; errors."""

import copy
import io
import json
import warnings

import pytest
import torch
from conftest import DECODERS, FAMILIES, main_output, padded_batch

import attnreg
from attnreg.methods import pruning
from attnreg.methods.pruning import head_importance, load_pruned, prune_heads, pruned_heads, save_pruned
from attnreg.tiny import tiny_model

HEAD_MODEL = {family: "causal_lm" if family in DECODERS else "classification" for family in FAMILIES}
# Non-uniform: layer 0 loses a key/value group's worth, layer 1 everything, layer 2 one more group.
SPEC = {0: [2, 3], 1: [0, 1, 2, 3], 2: [1, 0]}


def gated_reference(model, removed):
    """A copy of `model` whose hub gates are 0 on the `removed` heads (original numbers, unpruned model)."""
    reference = copy.deepcopy(model)
    hub = attnreg.attach(reference)
    for layer, heads in removed.items():
        gate = hub.gate(layer)
        with torch.no_grad():
            gate[list(heads)] = 0.0
    return reference


def outputs(model, batch):
    with torch.no_grad():
        return main_output(model(**batch))


def state(model):
    return {key: value.clone() for key, value in model.state_dict().items()}


def same_state(model, saved):
    current = model.state_dict()
    return current.keys() == saved.keys() and all(torch.equal(current[k], saved[k]) for k in saved)


@pytest.mark.parametrize("head", ["base", "task"])
def test_pruned_equals_gated_to_zero(family, head):
    model = tiny_model(
        family, head=HEAD_MODEL[family] if head == "task" else "base", layers=3, initializer_range=0.2
    ).eval()
    reference = gated_reference(model, SPEC)
    batch = padded_batch()
    unpruned = outputs(model, batch)
    report = prune_heads(model, SPEC)
    pruned = outputs(model, batch)
    assert (pruned - outputs(reference, batch)).abs().max() <= 1e-5
    assert (pruned - unpruned).abs().max() > 1e-3  # the removed heads did matter
    grouped = family in {"llama", "qwen2", "mistral"}
    assert report.heads == {0: (2, 1 if grouped else 2), 1: (0, 0), 2: (2, 1 if grouped else 2)}
    assert report.removed == {0: (2, 3), 1: (0, 1, 2, 3), 2: (0, 1)} and report.kept == {}
    assert pruned_heads(model) == {0: (2, 3), 1: (0, 1, 2, 3), 2: (0, 1)}
    assert report.parameters_after < report.parameters_before == sum(p.numel() for p in reference.parameters()) - 12


def test_successive_prunings_keep_original_numbers(family):
    model = tiny_model(family, layers=2).eval()
    batch = padded_batch()
    grouped = family in {"llama", "qwen2", "mistral"}
    first, second = ({0: [0, 1]}, {0: [2, 3], 1: [2, 3]}) if grouped else ({0: [1]}, {0: [3, 0], 1: [2]})
    reference = gated_reference(model, {0: first[0] + second[0], 1: second[1]})
    prune_heads(model, first)
    report = prune_heads(model, second)
    assert pruned_heads(model) == {0: tuple(sorted(first[0] + second[0])), 1: tuple(sorted(second[1]))}
    assert report.removed == {layer: tuple(sorted(heads)) for layer, heads in second.items()}
    assert (outputs(model, batch) - outputs(reference, batch)).abs().max() <= 1e-5
    assert pruning.head_numbers(model, 0) == (() if grouped else (2,))


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_headless_layer_generates_like_the_gated_model(family):
    model = tiny_model(family, head="causal_lm", layers=2).eval()
    reference = gated_reference(model, {0: [0, 1, 2, 3]})
    prune_heads(model, {0: [0, 1, 2, 3]})
    prompt = padded_batch(batch=1, length=5)["input_ids"]
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        tokens = model.generate(prompt, **settings, output_scores=True, return_dict_in_generate=True)
        expected = reference.generate(prompt, **settings, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(tokens.sequences, expected.sequences)
    for ours, theirs in zip(tokens.scores, expected.scores, strict=True):
        assert (ours - theirs).abs().max() <= 1e-5
    buffer = io.BytesIO()
    torch.save(model, buffer)  # a headless layer still pickles (and deep-copies)
    buffer.seek(0)
    for twin in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert torch.equal(outputs(twin, {"input_ids": prompt}), outputs(model, {"input_ids": prompt}))


def test_grouped_query_rule():
    model = tiny_model("llama", layers=2).eval()  # 4 query heads share 2 key/value heads: groups {0, 1}, {2, 3}
    batch = padded_batch()
    saved = state(model)
    with pytest.warns(UserWarning, match="kept requested heads in place, silenced"):
        report = prune_heads(model, {0: [0]})
    assert report.removed == {} and list(report.kept[0]) == [0]
    assert "key/value head 0 is shared with query heads [1] that stay" in report.kept[0][0]
    assert pruned_heads(model) == {} and pruning.silenced_heads(model) == {0: (0,)}
    changed = {key for key in saved if not torch.equal(model.state_dict()[key], saved[key])}
    assert changed == {"layers.0.self_attn.o_proj.weight"}  # only head 0's columns, zeroed
    with pytest.warns(UserWarning):
        report = prune_heads(model, {0: [0, 1, 2]})
    assert report.removed == {0: (0, 1)} and list(report.kept[0]) == [2]
    assert report.heads[0] == (2, 1) and pruning.silenced_heads(model) == {0: (2,)}
    reference = gated_reference(tiny_model("llama", layers=2).eval(), {0: [0, 1, 2]})
    assert (outputs(model, batch) - outputs(reference, batch)).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "request_, error, message",
    [
        ({0: [1], 2: [0]}, IndexError, r"layer 2 is out of range: BertModel has 2 attention layers \(0 to 1\)"),
        ({0: [1], 1: [4]}, IndexError, r"head 4 of layer 1 is out of range: the layer had 4 heads \(0 to 3\)"),
        ({0: [1], 1: [-1]}, IndexError, r"head -1 of layer 1 is out of range"),
        ({1: [2, 0], 0: [3]}, ValueError, r"head 3 of layer 0 was already pruned \(removed there so far: \[3\]\)"),
        ({1: [2, 2]}, ValueError, r"head 2 of layer 1 is listed twice"),
        ([0, 1], TypeError, r"heads must map layer -> head numbers"),
    ],
)
def test_bad_requests_change_nothing(request_, error, message):
    model = tiny_model("bert").eval()
    prune_heads(model, {0: [3]})
    saved, record = state(model), pruned_heads(model)
    with pytest.raises(error, match=message):
        prune_heads(model, request_)
    assert same_state(model, saved) and pruned_heads(model) == record


def test_unsupported_model_is_refused():
    from transformers import OPTConfig, OPTModel

    model = OPTModel(OPTConfig(hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2, vocab_size=50))
    with pytest.raises(attnreg.UnsupportedModelError, match="OPTModel"):
        prune_heads(model, {0: [0]})


def test_gates_and_optimizer_state_are_sliced():
    model = tiny_model("gpt2", head="causal_lm")
    hub = attnreg.attach(model)
    gate = hub.gate(0)
    with torch.no_grad():
        gate.copy_(torch.tensor([1.0, 0.5, 2.0, 3.0]))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = padded_batch()
    model(**batch, labels=batch["input_ids"]).loss.backward()
    optimizer.step()
    c_attn = model.transformer.h[0].attn.c_attn.weight
    before = {name: optimizer.state[c_attn][name].clone() for name in ("exp_avg", "exp_avg_sq")}
    gate_value, gate_moment = gate.detach().clone(), optimizer.state[gate]["exp_avg"].clone()
    identity = c_attn
    prune_heads(model, {0: [1]}, optimizers=[optimizer])
    assert model.transformer.h[0].attn.c_attn.weight is identity and c_attn.shape == (32, 72)
    kept = torch.cat([torch.arange(0, 8), torch.arange(16, 32)])
    columns = torch.cat([kept, 32 + kept, 64 + kept])
    for name, value in before.items():
        assert torch.equal(optimizer.state[c_attn][name], value[:, columns])
    assert torch.equal(gate, gate_value[[0, 2, 3]]) and torch.equal(
        optimizer.state[gate]["exp_avg"], gate_moment[[0, 2, 3]]
    )
    assert c_attn.grad.shape == c_attn.shape
    optimizer.zero_grad()
    model(**batch, labels=batch["input_ids"]).loss.backward()
    optimizer.step()  # training goes on with the cut state


@pytest.mark.parametrize("family", FAMILIES)
def test_save_load_round_trip(family, tmp_path):
    model = tiny_model(family, head=HEAD_MODEL[family], layers=3).eval()
    prune_heads(model, SPEC)
    attnreg.attach(model).gate(2)  # a gate travels along
    with torch.no_grad():
        attnreg.hub_of(model).gate(2)[1] = 0.25
    save_pruned(model, tmp_path)
    loaded = load_pruned(tmp_path)
    batch = padded_batch()
    assert type(loaded) is type(model) and not loaded.training
    assert pruned_heads(loaded) == pruned_heads(model)
    assert torch.equal(outputs(loaded, batch), outputs(model, batch))
    assert set(loaded.state_dict()) == set(model.state_dict())


def test_load_refuses_a_spec_that_disagrees_with_the_weights(tmp_path):
    model = tiny_model("bert", head="classification")
    prune_heads(model, {0: [1]})
    save_pruned(model, tmp_path)
    spec = json.loads((tmp_path / pruning.SPEC_FILE).read_text())
    config = json.loads((tmp_path / "config.json").read_text())
    spec["pruned_heads"] = config[pruning.PRUNED_HEADS] = {"0": [1, 2]}
    spec["heads"][0] = [2, 2]
    (tmp_path / pruning.SPEC_FILE).write_text(json.dumps(spec))
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"disagrees with the weights: .*query.weight: weights \(24, 32\), pruning spec \(16, 32\) \(layer 0\)",
    ):
        load_pruned(tmp_path)
    config[pruning.PRUNED_HEADS] = {"0": [1]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json records pruned heads"):
        load_pruned(tmp_path)


def finite_difference_importance(model, batches, eps=1e-4):
    """|dL/dg| per batch by central differences on the hub gates, averaged, L2-normalized per layer."""
    hub = attnreg.attach(model)
    result = {}
    for layer in range(hub.num_layers):
        gate = hub.gate(layer)
        totals = torch.zeros_like(gate)
        for batch in batches:
            for head in range(gate.numel()):
                losses = []
                for step in (eps, -eps):
                    with torch.no_grad():
                        gate.fill_(1.0)
                        gate[head] += step
                        losses.append(model(**batch).loss)
                totals[head] += ((losses[0] - losses[1]) / (2 * eps)).abs()
        with torch.no_grad():
            gate.fill_(1.0)
        result[layer] = totals / totals.norm()
    return result


def test_importance_matches_finite_differences():
    model = tiny_model("bert", head="classification", initializer_range=0.3).double().eval()
    batches = []
    for seed in range(2):
        batch = padded_batch(batch=4, seed=seed)
        batch["labels"] = torch.tensor([0, 1, 1, 0])
        batches.append(batch)
    before = state(model)
    scores = head_importance(model, batches)
    assert same_state(model, before) and model.config._attn_implementation == "sdpa"
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
    expected = finite_difference_importance(copy.deepcopy(model), batches)
    for layer in (0, 1):
        assert torch.allclose(scores[layer].double(), expected[layer], atol=1e-6)
        assert abs(scores[layer].norm() - 1) < 1e-6
    assert scores[0].std() > 0.05  # heads differ, so the comparison is not trivially uniform


def test_iterative_pruning_curve_and_result():
    model = tiny_model("bert", head="classification", initializer_range=0.3, layers=2).eval()
    batch = padded_batch(batch=6)
    batch["labels"] = torch.tensor([0, 1, 1, 0, 1, 0])
    first = head_importance(model, [batch])
    lowest = sorted((float(s), layer, head) for layer, score in first.items() for head, s in enumerate(score))[:2]

    def metric(m):  # higher is better
        with torch.no_grad():
            return float(torch.exp(-m(**batch).loss))

    start = metric(model)
    curve = pruning.iterative_pruning(model, [batch], metric, fraction=0.25, stop_ratio=0.0)
    assert [step.heads_removed for step in curve] == [0, 2, 4, 6, 8]
    assert curve[0].metric == pytest.approx(start)
    assert {(layer, head) for _, layer, head in lowest} == {(i, h) for i, hs in curve[1].removed.items() for h in hs}
    # stop_ratio 0 never stops early, so the last step (every head) is applied
    assert pruned_heads(model) == {0: (0, 1, 2, 3), 1: (0, 1, 2, 3)}
    assert metric(model) == pytest.approx(curve[-1].metric, abs=1e-6)


def test_iterative_pruning_rounds_follow_the_fraction_of_all_heads_without_applying():
    model = tiny_model("bert", head="classification", initializer_range=0.3).eval()
    batch = padded_batch(batch=6)
    batch["labels"] = torch.tensor([0, 1, 1, 0, 1, 0])
    before = state(model)

    def metric(m):
        with torch.no_grad():
            return float(torch.exp(-m(**batch).loss))

    curve = pruning.iterative_pruning(model, [batch], metric, fraction=0.3, stop_ratio=0.0, apply=False)
    assert [step.heads_removed for step in curve] == [0, 2, 5, 7, 8]  # round(k * 0.3 * 8), then all
    for earlier, later in zip(curve[:-1], curve[1:], strict=True):  # each round adds to the last
        assert all(set(earlier.removed.get(i, ())) <= set(later.removed.get(i, ())) for i in (0, 1))
    assert same_state(model, before) and pruned_heads(model) == {}


def test_iterative_pruning_stops_below_the_bar_and_applies_the_last_good_step():
    model = tiny_model("bert", head="classification", initializer_range=0.3).eval()
    batch = padded_batch(batch=6)
    batch["labels"] = torch.tensor([0, 1, 1, 0, 1, 0])
    reference = copy.deepcopy(model)

    def metric(m):
        with torch.no_grad():
            return float(torch.exp(-m(**batch).loss))

    curve = pruning.iterative_pruning(model, [batch], metric, fraction=0.125, stop_ratio=0.999)
    assert curve[-1].metric < 0.999 * curve[0].metric
    assert all(step.metric >= 0.999 * curve[0].metric for step in curve[1:-1])
    kept_step = curve[-2]
    assert pruned_heads(model) == kept_step.removed
    expected = gated_reference(reference, kept_step.removed)
    assert (outputs(model, batch) - outputs(expected, batch)).abs().max() <= 1e-5


def test_fold_gates_and_hard_concrete_gates():
    model = tiny_model("bert").eval()
    hub = attnreg.attach(model)
    gate = pruning.make_hard_concrete(hub, 0)
    with torch.no_grad():
        gate.log_alpha.copy_(torch.tensor([3.0, -3.0, 0.0, 0.5]))
    expected_gate = (torch.sigmoid(gate.log_alpha.detach()) * 1.2 - 0.1).clamp(0, 1)
    assert torch.equal(gate(), expected_gate) and expected_gate[1] == 0 and 0 < expected_gate[3] < 1
    hub.gate(1)  # a plain gate too
    batch = padded_batch()
    gated = outputs(model, batch)
    copied = copy.deepcopy(model)
    assert [id(p) for p in pruning.gate_parameters(model)] == [id(gate.log_alpha), id(hub.gate(1))]
    optimizer = torch.optim.Adam(model.parameters())
    dropped = pruning.fold_gates(model, optimizers=[optimizer])
    assert dropped[0] is gate.log_alpha and len(dropped) == 2
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in model.parameters()}
    assert hub.gates == {} and (outputs(model, batch) - gated).abs().max() <= 1e-6
    assert torch.equal(outputs(copied, batch), gated)  # folding one model leaves its copies alone


def test_hard_concrete_samples_follow_the_expected_l0():
    gate = pruning.HardConcreteGate(4000, initial_log_alpha=0.0)
    with torch.no_grad():
        samples = gate()
    assert samples.min() == 0 and samples.max() == 1  # stretched and clamped: exact zeros and ones
    closed = 1 - float(gate.expected_l0()[0])
    assert (samples == 0).float().mean() == pytest.approx(closed, abs=0.03)
    gate.eval()
    assert torch.equal(gate(), torch.full((4000,), 0.5))


def test_restore_pruning_from_a_checkpoint_dict():
    model = tiny_model("bert", head="classification")
    prune_heads(model, {1: [0, 2]})
    checkpoint = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}
    pruning.add_pruning_to_checkpoint(model, checkpoint)
    checkpoint[pruning.FOLDED_GATES] = [0]
    fresh = tiny_model("bert", head="classification", seed=1)
    hub = attnreg.attach(fresh)
    hub.gate(0)  # folded before the checkpoint was taken: removed
    hub.gate(1)  # not listed as folded: kept (strict loading would then report it missing)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pruning.restore_pruning(fresh, checkpoint)
    assert list(hub.gates) == [1]
    hub.remove_gate(1)
    fresh.load_state_dict(model.state_dict())
    assert pruned_heads(fresh) == {1: (0, 2)}
    batch = padded_batch()
    assert torch.equal(outputs(fresh.eval(), batch), outputs(model.eval(), batch))
    assert pruning.restore_pruning(fresh, checkpoint) is None  # already applied: nothing to do
    with pytest.raises(ValueError, match="does not record"):
        pruning.restore_pruning(fresh, {pruning.PRUNED_HEADS: {}})
