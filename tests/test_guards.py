"""Bad input and misuse get clear errors, never a silent no-op."""

import pytest
import torch
from conftest import padded_batch
from transformers import T5Config, T5Model

import attnreg
from attnreg.tiny import tiny_model


def test_unsupported_model_names_class_and_families():
    model = T5Model(T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=50))
    with pytest.raises(attnreg.UnsupportedModelError, match=r"T5Model \(model_type='t5'\).*bert, roberta.*mistral"):
        attnreg.attach(model)


def test_head_mask_is_refused():
    model = tiny_model("bert")
    attnreg.attach(model)
    with pytest.raises(ValueError, match="head_mask"):
        model(**padded_batch(), head_mask=torch.ones(2, 4))


def test_implementation_changed_after_attach_is_detected():
    model = tiny_model("gpt2")
    hub = attnreg.attach(model)
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="changed to 'sdpa' after attnreg.attach"):
        model(**padded_batch())
    with pytest.raises(RuntimeError, match="changed to 'sdpa'"):
        with hub.capture():
            pass
    assert attnreg.attach(model) is hub  # re-attaching switches back
    model(**padded_batch())


@pytest.mark.parametrize("layer", [2, -1, "0"])
def test_layer_out_of_range(layer):
    hub = attnreg.attach(tiny_model("bert"))
    with pytest.raises(IndexError, match=r"layer.*out of range: BertModel has 2 attention layers \(0 to 1\)"):
        hub.gate(layer)
    with pytest.raises(IndexError, match="layers="):
        with hub.capture(layers=[0, layer]):
            pass


def test_reentrant_gradient_checkpointing_is_refused():
    model = tiny_model("llama", head="causal_lm")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    hub = attnreg.attach(model)
    with pytest.raises(RuntimeError, match="use_reentrant=True"):
        with hub.capture(layers=[0]):
            model(**padded_batch())


def attention_loss_gradient(checkpointing: bool) -> torch.Tensor:
    model = tiny_model("llama", head="causal_lm")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    hub = attnreg.attach(model)
    for _ in range(2):  # the backward replays the captured path each time
        with hub.capture(layers=[0]) as probs:
            output = model(**padded_batch(), labels=padded_batch()["input_ids"])
        (output.loss + probs[0].pow(2).sum()).backward()
    return model.model.layers[0].self_attn.q_proj.weight.grad


def test_non_reentrant_gradient_checkpointing_keeps_the_graph():
    checkpointed = attention_loss_gradient(checkpointing=True)
    assert checkpointed.abs().sum() > 0
    assert torch.allclose(checkpointed, attention_loss_gradient(checkpointing=False), atol=1e-6)
