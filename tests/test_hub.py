"""The attention hub against references (SDPA, eager attention, hand-made masks) on every family."""

import copy
import io

import pytest
import torch
from conftest import DECODERS, eager_copy, main_output, padded_batch

import attnreg
from attnreg.eager import attention_forward
from attnreg.tiny import tiny_model


def valid_keys(family, batch):
    """[B, 1, T, S] boolean: keys each query may attend to (padding, and causality for decoders)."""
    mask = batch["attention_mask"].bool()[:, None, None, :]
    length = mask.shape[-1]
    if family in DECODERS:
        mask = mask & torch.ones(length, length, dtype=torch.bool).tril()
    return mask


def test_idle_hub_equals_sdpa(model_pair):
    model, reference = model_pair
    batch = padded_batch()
    assert model.config._attn_implementation == "attnreg"
    with torch.no_grad():
        diff = (main_output(model(**batch)) - main_output(reference(**batch))).abs().max()
    assert diff <= 1e-5


def test_capture_equals_eager_weights(family, model_pair):
    model, reference = model_pair
    batch = padded_batch()
    eager = eager_copy(reference)
    hub = attnreg.hub_of(model)
    with torch.no_grad(), hub.capture() as probs:
        out = model(**batch)
        ref = eager(**batch, output_attentions=True)
    assert sorted(probs) == list(range(hub.num_layers))
    assert (main_output(out) - main_output(ref)).abs().max() <= 1e-5
    valid = valid_keys(family, batch)
    for layer, expected in enumerate(ref.attentions):
        assert probs[layer].shape == expected.shape
        assert (probs[layer] - expected).abs().max() <= 1e-6
        rows = (probs[layer] * valid).sum(-1)
        assert torch.allclose(rows, torch.ones_like(rows), atol=1e-6)
        masked_mass = (probs[layer] * ~valid)[batch["attention_mask"].bool()[:, None, :, None].expand_as(probs[layer])]
        assert masked_mass.abs().max() == 0


def test_capture_only_chosen_layers_and_stops_after_block(model_pair):
    model, _ = model_pair
    hub = attnreg.hub_of(model)
    batch = padded_batch()
    with hub.capture(layers=[1]) as probs:
        model(**batch)
    model(**batch)
    assert list(probs) == [1]
    assert len(probs.calls(1)) == 1
    with pytest.raises(KeyError, match="captured layers: \\[1\\]"):
        probs[0]


def test_gates_at_one_change_nothing_and_zero_gate_removes_head(family, model_pair):
    model, reference = model_pair
    hub = attnreg.hub_of(model)
    batch = padded_batch()
    layer, head = 1, 2
    gates = [hub.gate(i) for i in range(hub.num_layers)]
    assert all(torch.equal(g, torch.ones(hub.layers[i].num_heads)) for i, g in enumerate(gates))
    assert any(name.endswith("attnreg_gate") for name in model.state_dict())
    with torch.no_grad():
        ungated = main_output(reference(**batch))
        assert (main_output(model(**batch)) - ungated).abs().max() <= 1e-5
        gates[layer][head] = 0.0
        gated = main_output(model(**batch))
        with hub.capture():  # the gate also applies on the capture path
            gated_captured = main_output(model(**batch))

    head_dim = hub.layers[layer].head_dim
    projection = hub.family.out_projection(reference, layer)

    def zero_head(module, args):
        context = args[0].clone()
        context[..., head * head_dim : (head + 1) * head_dim] = 0
        return (context,)

    projection.register_forward_pre_hook(zero_head)
    with torch.no_grad():
        by_hand = main_output(reference(**batch))
    assert (gated - by_hand).abs().max() <= 1e-5
    assert (gated_captured - by_hand).abs().max() <= 1e-5
    assert (gated - ungated).abs().max() > 1e-4


def test_gate_is_trainable(model_pair):
    model, _ = model_pair
    gate = attnreg.hub_of(model).gate(0)
    main_output(model(**padded_batch())).sum().backward()
    assert gate.grad is not None and gate.grad.abs().sum() > 0


def scale_attention(model, hub, factors):
    """Reference temperature by hand: multiply each attention module's softmax scaling by `factors`."""
    for layer in range(hub.num_layers):
        hub.family.attention_module(model, layer).scaling *= factors


def test_temperature(family, model_pair):
    model, reference = model_pair
    hub = attnreg.hub_of(model)
    batch = padded_batch()
    with torch.no_grad():
        base = main_output(reference(**batch))
        hub.set_temperature(1.0)
        assert (main_output(model(**batch)) - base).abs().max() <= 1e-5
        hub.set_temperature(0.1)
        scaled = main_output(model(**batch))
        with hub.capture() as probs:
            scaled_captured = main_output(model(**batch))
        eager = eager_copy(reference)
        scale_attention(reference, hub, 1 / 0.1)
        scale_attention(eager, hub, 1 / 0.1)
        expected = main_output(reference(**batch))
        expected_probs = eager(**batch, output_attentions=True).attentions
    assert (scaled - expected).abs().max() <= 1e-5
    assert (scaled_captured - expected).abs().max() <= 1e-5
    assert (probs[0] - expected_probs[0]).abs().max() <= 1e-6
    assert (scaled - base).abs().max() > 1e-3


def test_per_head_temperature_matches_scaled_queries(family):
    model = tiny_model(family, layers=1).eval()
    reference = copy.deepcopy(model)
    hub = attnreg.attach(model)
    temperatures = torch.tensor([0.5, 1.0, 2.0, 4.0])
    hub.set_temperature(temperatures, layers=[0])
    # By hand: dividing a head's logits by t equals dividing its query projection by t.
    head_dim = hub.layers[0].head_dim
    attention = hub.family.attention_module(reference, 0)
    scale = (1 / temperatures).repeat_interleave(head_dim)
    with torch.no_grad():
        if hub.family.fused_qkv:
            projection = getattr(attention, hub.family.fused_qkv)
            projection.weight[:, : scale.numel()] *= scale
            projection.bias[: scale.numel()] *= scale
        else:
            projection = getattr(attention, hub.family.query)
            projection.weight *= scale[:, None]
            if projection.bias is not None:
                projection.bias *= scale
        batch = padded_batch()
        assert (main_output(model(**batch)) - main_output(reference(**batch))).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="one value per head"):
        hub.set_temperature(torch.ones(3))
    with pytest.raises(ValueError, match="> 0"):
        hub.set_temperature(0.0)


def test_loss_on_captured_probs_reaches_query_and_key(family, model_pair):
    model, _ = model_pair
    hub = attnreg.hub_of(model)
    model.train()
    with hub.capture(layers=[0]) as probs:
        model(**padded_batch())
    (probs[0] ** 2).sum().backward()
    attention = hub.family.attention_module(model, 0)
    if hub.family.fused_qkv:
        grad = getattr(attention, hub.family.fused_qkv).weight.grad
        width = hub.layers[0].num_heads * hub.layers[0].head_dim
        query_grad, key_grad = grad[:, :width], grad[:, width : 2 * width]
    else:
        query_grad = getattr(attention, hub.family.query).weight.grad
        key_grad = getattr(attention, hub.family.key).weight.grad
    assert query_grad.abs().sum() > 0 and key_grad.abs().sum() > 0


def test_attention_dropout_only_in_training(family, model_pair):
    model, reference = model_pair
    hub = attnreg.hub_of(model)
    batch = padded_batch()
    hub.set_attention_dropout(0.5)
    assert hub.attention_dropout(0) == 0.5
    with torch.no_grad():
        evaluated = main_output(model(**batch))
        assert (evaluated - main_output(reference(**batch))).abs().max() <= 1e-5
        model.train()
        reference.train()
        torch.manual_seed(0)
        dropped = main_output(model(**batch))
        assert (dropped - main_output(reference(**batch))).abs().max() > 1e-3
        hub.set_attention_dropout(None)
        assert (main_output(model(**batch)) - main_output(reference(**batch))).abs().max() <= 1e-5
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        hub.set_attention_dropout(1.0)


def test_layers_report_current_shapes(family):
    model = tiny_model(family, layers=3, heads=4, hidden=32)
    hub = attnreg.attach(model)
    layers = hub.layers
    assert [info.index for info in layers] == [0, 1, 2]
    expected_kv = 2 if family in {"llama", "qwen2", "mistral"} else 4
    assert all((i.num_heads, i.num_kv_heads, i.head_dim) == (4, expected_kv, 8) for i in layers)


def test_deepcopy_keeps_settings_and_is_independent(model_pair):
    model, _ = model_pair
    hub = attnreg.hub_of(model)
    with torch.no_grad():
        hub.gate(0)[1] = 0.3
    hub.set_temperature(1.7, layers=[1])
    clone = copy.deepcopy(model)
    clone_hub = attnreg.hub_of(clone)
    assert clone_hub is not hub and clone_hub.model is clone
    batch = padded_batch()
    with torch.no_grad(), hub.capture() as original_probs, clone_hub.capture() as clone_probs:
        assert (main_output(model(**batch)) - main_output(clone(**batch))).abs().max() <= 1e-6
    assert len(original_probs.calls(0)) == 1 and len(clone_probs.calls(0)) == 1
    with torch.no_grad():
        clone_hub.gate(0)[1] = 1.0
    assert hub.gate(0)[1].item() == pytest.approx(0.3)


def test_state_dict_round_trip_recreates_gates_and_temperature(family, model_pair):
    model, reference = model_pair
    hub = attnreg.hub_of(model)
    with torch.no_grad():
        hub.gate(1).copy_(torch.tensor([0.0, 0.5, 1.5, 1.0]))
    hub.set_temperature(torch.tensor([1.0, 2.0, 0.5, 3.0]), layers=[0])
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = copy.deepcopy(reference)
    fresh_hub = attnreg.attach(fresh)
    fresh.load_state_dict(torch.load(buffer), strict=True)
    assert torch.equal(fresh_hub.gate(1), hub.gate(1))
    assert torch.equal(fresh_hub.temperature(0), hub.temperature(0))
    batch = padded_batch()
    with torch.no_grad():
        assert (main_output(model(**batch)) - main_output(fresh(**batch))).abs().max() <= 1e-6


def test_detach_restores_implementation_and_outputs(family, model_pair):
    model, _ = model_pair
    hub = attnreg.hub_of(model)
    with torch.no_grad():
        hub.gate(0).copy_(torch.tensor([0.0, 0.5, 1.5, 1.0]))
    hub.set_temperature(torch.tensor([1.0, 2.0, 0.5, 3.0]), layers=[1])
    batch = padded_batch()
    with torch.no_grad():
        attached = main_output(model(**batch))
        attnreg.detach(model)
        detached = main_output(model(**batch))
    assert model.config._attn_implementation == "sdpa"
    assert not any("attnreg" in name for name in model.state_dict())
    assert not model._forward_pre_hooks
    assert (attached - detached).abs().max() <= 1e-5
    with pytest.raises(RuntimeError, match="not attached"):
        attnreg.hub_of(model)


def test_train_eval_switches_keep_the_hub(model_pair):
    model, _ = model_pair
    hub = attnreg.hub_of(model)
    model.train()
    model.eval()
    with torch.no_grad(), hub.capture(layers=[0]) as probs:
        model(**padded_batch())
    assert 0 in probs


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral"])
def test_generate_matches_without_attnreg(family):
    model = tiny_model(family, head="causal_lm").eval()
    reference = copy.deepcopy(model)
    prompt = padded_batch(batch=2, length=6)
    prompt["attention_mask"][:] = 1
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = reference.generate(**prompt, **options)
    hub = attnreg.attach(model)
    assert torch.equal(model.generate(**prompt, **options), expected)
    with hub.capture(layers=[0]) as probs:
        assert torch.equal(model.generate(**prompt, **options), expected)
    steps = probs.calls(0)
    assert len(steps) == 8 and steps[0].shape[-2:] == (6, 6) and steps[-1].shape[-2:] == (1, 13)
    hub.set_temperature(0.3)
    scale_attention(reference, hub, 1 / 0.3)
    assert torch.equal(model.generate(**prompt, **options), reference.generate(**prompt, **options))


# -- gpt-oss: a learned sink logit per head in the softmax denominator ---------------------------------------------
def gpt_oss_with_sinks(head="causal_lm"):
    """A tiny gpt-oss whose sink logits take a real share of every row (the tiny config draws them near 0)."""
    model = tiny_model("gpt_oss", head=head).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0, generator=generator)
    return model


def test_an_untracked_module_with_sinks_runs_eager_gpt_oss_math():
    """A module the hub does not track (cross-attention, say) that passes `s_aux` gets eager gpt-oss's output, not
    SDPA's (which would drop the sinks without a word); the reference is transformers' own eager function."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    module = torch.nn.Module()
    module.sinks = torch.nn.Parameter(torch.tensor([2.0, -1.0, 0.5, 3.0]))
    module.num_key_value_groups = 2
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 5, 8, generator=generator)
    key, value = torch.randn(2, 2, 5, 8, generator=generator), torch.randn(2, 2, 5, 8, generator=generator)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    additive = torch.zeros(1, 1, 5, 5).masked_fill(~causal, torch.finfo(torch.float32).min)
    expected, expected_weights = gpt_oss_eager(module, query, key, value, additive, scaling=0.3)
    output, weights = attention_forward(module, query, key, value, causal, scaling=0.3, s_aux=module.sinks)
    torch.testing.assert_close(output, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-6)


def test_gpt_oss_dropout_and_temperature_as_eager_computes_them():
    """Attention dropout set by the hub, in training, equals eager gpt-oss's with the same rate and seed (dropout on
    the probabilities after the sink's column is dropped); a temperature divides the sink logit too."""
    model = gpt_oss_with_sinks().train()
    eager = copy.deepcopy(model)
    for layer in eager.model.layers:
        layer.self_attn.attention_dropout = 0.3
    hub = attnreg.attach(model)
    hub.set_attention_dropout(0.3)
    batch = padded_batch()
    outputs = []
    for candidate in (model, eager):
        torch.manual_seed(7)
        outputs.append(main_output(candidate(**batch)))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    torch.manual_seed(7)
    hub.set_attention_dropout(0.0)
    assert (main_output(model(**batch)) - outputs[0]).abs().max() > 1e-3  # the dropout did something

    # Temperature: the hub's logits divided by T equal eager with the query projection and the sinks divided by T.
    model.eval()
    eager.eval()
    temperature = torch.tensor([0.5, 1.0, 2.0, 1.5])
    hub.set_temperature(temperature, layers=[1])
    with torch.no_grad():
        attention = eager.model.layers[1].self_attn
        attention.q_proj.weight.div_(temperature.repeat_interleave(8)[:, None])
        attention.q_proj.bias.div_(temperature.repeat_interleave(8))
        attention.sinks.div_(temperature)
        torch.testing.assert_close(main_output(model(**batch)), main_output(eager(**batch)), rtol=1e-5, atol=1e-5)


def test_gpt_oss_blockwise_inputs_carry_the_sinks_and_their_gradient():
    """`capture(inputs=True)` records the sink logits divided by the temperature, attached to the module's `sinks`:
    a blockwise loss trains them."""
    model = gpt_oss_with_sinks()
    hub = attnreg.attach(model)
    hub.set_temperature(2.0, layers=[0])
    with hub.capture(layers=[0], inputs=True) as record:
        model(**padded_batch())
    inputs = record[0]
    sinks = model.model.layers[0].self_attn.sinks
    torch.testing.assert_close(inputs.sinks, sinks / 2.0)
    entropy = attnreg.blockwise.row_entropy(
        inputs.query, inputs.key, None, inputs.scaling, causal=True, sinks=inputs.sinks
    )
    entropy.sum().backward()
    assert sinks.grad is not None and sinks.grad.abs().min() > 0
    assert record.has_sink(0)
