"""attnreg on PEFT LoRA models, against an independent reference: the same LoRA weights merged into plain
projections by PEFT itself, with the gates (or silencing, temperature) applied by hand to the merged weights."""

import copy

import pytest
import torch

import attnreg
from attnreg.tiny import tiny_model

peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[peft]')")

IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
GATES = {0: [1.0, 0.5, 0.0, 2.0], 1: [0.25, 1.0, 1.5, 0.0]}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def lora(model, targets=TARGETS):
    torch.manual_seed(7)  # init_lora_weights=False: random A and B, so the adapter path is not zero
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def reference(targets=TARGETS, gates=GATES, silenced=None, temperature=None):
    """The same model and adapters, merged by PEFT without attnreg; gates, silencing and temperature applied
    to the merged weights by hand."""
    merged = lora(tiny_model("llama", head="causal_lm"), targets).merge_and_unload().eval()
    with torch.no_grad():
        for layer, values in (gates or {}).items():
            o_proj = merged.model.layers[layer].self_attn.o_proj
            o_proj.weight.mul_(torch.tensor(values).repeat_interleave(8)[None, :])
        for layer, heads in (silenced or {}).items():
            for head in heads:
                merged.model.layers[layer].self_attn.o_proj.weight[:, head * 8 : (head + 1) * 8] = 0
        for layer, value in (temperature or {}).items():
            merged.model.layers[layer].self_attn.q_proj.weight.div_(value)
    return merged


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def set_gates(hub, gates=GATES):
    with torch.no_grad():
        for layer, values in gates.items():
            hub.gate(layer).copy_(torch.tensor(values))


@pytest.mark.parametrize("order", ["attach, then get_peft_model", "get_peft_model, then attach"])
def test_gates_act_on_the_adapters_path(order):
    expected = logits(reference())
    if order.startswith("attach"):
        model = tiny_model("llama", head="causal_lm")
        hub = attnreg.attach(model)
        model = lora(model)
    else:
        model = lora(tiny_model("llama", head="causal_lm"))
        hub = attnreg.attach(model)  # the PeftModel itself
    assert attnreg.hub_of(model) is hub and hub.model is model.get_base_model()
    set_gates(hub)
    torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)


def test_detach_folds_gates_and_temperature_into_base_and_adapter():
    model = lora(tiny_model("llama", head="causal_lm"))
    hub = attnreg.attach(model)
    set_gates(hub)
    hub.set_temperature(2.0, layers=[1])
    expected = logits(reference(temperature={1: 2.0}))
    torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)
    attnreg.detach(model)
    torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits(model.merge_and_unload()), expected, rtol=1e-5, atol=1e-5)


def test_merge_and_unload_keeps_gates_and_silencing():
    model = lora(tiny_model("llama", head="causal_lm"))
    hub = attnreg.attach(model)
    set_gates(hub)
    attnreg.methods.pruning.silence_heads(model.get_base_model(), {0: [0]})
    expected = logits(reference(silenced={0: [0]}))
    torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)
    merged = model.merge_and_unload()
    assert type(merged.model.layers[0].self_attn.o_proj) is torch.nn.Linear
    torch.testing.assert_close(logits(merged), expected, rtol=1e-5, atol=1e-5)
    assert sorted(attnreg.hub_of(merged).gates) == [0, 1]


def test_gates_train_beside_frozen_base_weights():
    model = lora(tiny_model("llama", head="causal_lm"))
    hub = attnreg.attach(model)
    gates = [hub.gate(layer) for layer in range(hub.num_layers)]
    model(input_ids=IDS, labels=IDS).loss.backward()
    assert all(gate.requires_grad and gate.grad is not None and gate.grad.abs().sum() > 0 for gate in gates)
    base = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert not base.requires_grad and base.grad is None


def test_dora_is_refused_where_its_weights_would_be_scaled():
    torch.manual_seed(7)
    config = peft.LoraConfig(r=4, target_modules=["o_proj"], use_dora=True, init_lora_weights=False)
    model = peft.get_peft_model(tiny_model("llama", head="causal_lm"), config)
    hub = attnreg.attach(model)
    set_gates(hub, {0: [1.0, 0.5, 1.0, 1.0]})
    with pytest.raises(NotImplementedError, match="uses DoRA"):
        attnreg.detach(copy.deepcopy(model))


def test_another_tuner_is_refused_where_its_weights_would_be_scaled():
    config = peft.IA3Config(target_modules=["o_proj"], feedforward_modules=[])
    model = peft.get_peft_model(tiny_model("llama", head="causal_lm"), config)
    hub = attnreg.attach(model)
    set_gates(hub, {0: [1.0, 0.5, 1.0, 1.0], 1: [1.0, 1.0, 0.0, 1.0]})
    model.get_base_model().model.layers[0].self_attn.o_proj = (
        model.get_base_model().model.layers[0].self_attn.o_proj.base_layer
    )
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(NotImplementedError, match=r"peft\.tuners\.ia3\.layer\.Linear wraps a projection"):
        attnreg.detach(model)
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
