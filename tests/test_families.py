"""Conformance of every family in the table, on tiny random models (2 layers, 4 query / 2 key-value heads where
the family has grouped-query attention, a sliding window of 4 where it has one, sequences of 9 tokens): the
hub against eager attention, gates, head removal against gating, save/load, temperature folding, generation,
and the blockwise losses against the materialized ones. Adding a family to `FAMILIES` adds a row here; the
models attnreg refuses are refused at `attach`, before anything changes."""

import copy
import warnings

import pytest
import torch
from conftest import main_output, padded_batch
from transformers import AutoConfig, AutoModel, BertModel

import attnreg
from attnreg.blockwise import prior_cross_entropy, row_entropy
from attnreg.eager import attention_forward
from attnreg.families import FAMILIES, REFUSED, UnsupportedModelError, detect_family
from attnreg.losses import row_entropy as materialized_entropy
from attnreg.methods.pruning import load_pruned, prune_heads, save_pruned
from attnreg.tiny import model_from_config, tiny_config

NAMES = [family.name for family in FAMILIES]
WINDOW = 4


def build(name: str, seed: int = 0):
    """A tiny model of `name` in eval mode, with its task head (causal LM for decoders), a window of 4 where the
    family has one, and large weights so that every head matters."""
    config = tiny_config(name, initializer_range=0.2)
    causal = detect_family_name_is_causal(name)
    text = config.get_text_config()
    if getattr(text, "sliding_window", None) is not None:  # an encoder's window reaches this far on either side
        text.sliding_window = WINDOW if causal else WINDOW // 2
    text.initializer_range = 0.2
    model = model_from_config(config, "causal_lm" if causal else "classification", seed).eval()
    family = detect_family(model)
    if family.sink is not None:  # sink logits that take a real share of each row (gpt-oss draws them at 0.2 here)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in range(len(family.blocks(model))):
                family.sink_parameter(family.attention_module(model, layer)).normal_(0.0, 2.0, generator=generator)
    return model


def detect_family_name_is_causal(name: str) -> bool:
    return next(family for family in FAMILIES if family.name == name).causal


def eager_of(model):
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    return reference


def gated(model, heads):
    """An attached copy of `model` whose gates are 0 on `heads` (layer -> original head numbers)."""
    reference = copy.deepcopy(model)
    hub = attnreg.attach(reference)
    with torch.no_grad():
        for layer, chosen in heads.items():
            hub.gate(layer)[list(chosen)] = 0.0
    return reference


def real(output, batch):
    """The output at real tokens: a padded query row of a sliding layer sees no key at all, and SDPA and eager
    then disagree on what it reads (eager: uniform over every key); no real token depends on those rows."""
    output = main_output(output)
    return output[batch["attention_mask"].bool()] if output.dim() == 3 else output


def run(model, batch):
    with torch.no_grad():
        return real(model(**batch), batch)


def greedy(model, batch, tokens=4, **options):
    with torch.no_grad():
        return model.generate(
            input_ids=batch["input_ids"][:1, :7],
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            **options,
        )


@pytest.mark.parametrize("name", NAMES)
def test_family_conformance(name, tmp_path):
    model = build(name)
    family = detect_family(model)
    assert family.name == name
    batch = padded_batch()
    plain = copy.deepcopy(model)
    eager = eager_of(model)
    hub = attnreg.attach(model)
    assert hub.num_layers == 2
    num_heads, num_kv = hub.layers[0].num_heads, hub.layers[0].num_kv_heads
    grouped = num_kv < num_heads

    # Idle: every layer handed to SDPA, as the model computes it.
    with torch.no_grad():
        expected = eager(**batch, output_attentions=True)
        idle = real(model(**batch), batch)
    assert (idle - real(expected, batch)).abs().max() <= 1e-5

    # Captured probabilities are eager's, windows included; the output stays the same.
    with torch.no_grad(), hub.capture() as probs:
        captured = real(model(**batch), batch)
    assert (captured - idle).abs().max() <= 1e-5
    for layer, reference in enumerate(expected.attentions):
        assert probs[layer].shape == reference.shape
        assert (probs[layer] - reference).abs().max() <= 1e-6, f"layer {layer}"

    # Gates at 1 change nothing.
    for layer in range(hub.num_layers):
        hub.gate(layer)
    assert (run(model, batch) - idle).abs().max() <= 1e-6

    # Removal of one key/value group of layer 0 and one query head of layer 1 equals gating them to zero.
    spec = {0: list(range(num_heads // num_kv)), 1: [num_heads - 1]}
    pruned = copy.deepcopy(plain)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = prune_heads(pruned, spec)
    if family.norm_layout == "whole":  # a q/k norm over all heads: every requested head is silenced, and said so
        assert report.removed == {} and report.heads == {0: (num_heads, num_kv), 1: (num_heads, num_kv)}
        assert {layer: sorted(kept) for layer, kept in report.kept.items()} == spec
        assert all("spans all heads" in reason for kept in report.kept.values() for reason in kept.values())
        assert any("silenced" in str(warning.message) for warning in caught)
    else:
        assert report.removed[0] == tuple(spec[0])
        assert report.heads[0] == (num_heads - len(spec[0]), num_kv - 1 if grouped else num_heads - 1)
        if grouped:  # the query head of layer 1 shares its key/value head: silenced in place, and said so
            assert report.kept == {1: {num_heads - 1: report.kept[1][num_heads - 1]}}
            assert any("silenced" in str(warning.message) for warning in caught)
        else:
            assert report.removed[1] == (num_heads - 1,)
    zeroed = gated(plain, spec)
    removed = run(pruned, batch)
    assert (removed - run(zeroed, batch)).abs().max() <= 1e-5
    assert (removed - idle).abs().max() > 1e-3  # the removed heads did matter

    # A pruned model attaches, captures and round-trips through save_pruned / load_pruned exactly.
    pruned_hub = attnreg.attach(pruned)
    with torch.no_grad(), pruned_hub.capture() as pruned_probs:
        assert (real(pruned(**batch), batch) - removed).abs().max() <= 1e-5
    assert pruned_probs[0].shape[1] == report.heads[0][0]
    save_pruned(pruned, tmp_path)
    loaded = load_pruned(tmp_path)
    assert type(loaded) is type(pruned)
    assert torch.equal(run(loaded, batch), run(pruned, batch))

    if family.causal:  # greedy generation, with a KV cache: attached idle and gates at 1, and removal vs gating
        tokens = greedy(model, batch)
        assert torch.equal(tokens, greedy(plain, batch))
        assert torch.equal(tokens, greedy(model, batch, use_cache=False))
        assert torch.equal(greedy(pruned, batch), greedy(zeroed, batch))


@pytest.mark.parametrize("name", NAMES)
def test_temperature_survives_detach(name):
    model = build(name)
    batch = padded_batch()
    hub = attnreg.attach(model)
    base = run(model, batch)
    hub.set_temperature(0.5, layers=[0])
    hub.set_temperature(torch.linspace(0.5, 2.0, hub.layers[1].num_heads), layers=[1])
    tempered = run(model, batch)
    assert (tempered - base).abs().max() > 1e-3
    shared_norm = hub.family.query_norm_module(hub.attention(1)) is not None and hub.family.norm_layout == "shared"
    if shared_norm:  # one norm weight shared by the heads: only one value per layer folds
        with pytest.raises(ValueError, match=f"layer 1 .*model_type='{model.config.model_type}'.*Nothing was changed"):
            attnreg.detach(model)
        assert attnreg.hub.is_attached(model) and hub.temperature(0) is not None
        hub.set_temperature(1.5, layers=[1])
        tempered = run(model, batch)
    attnreg.detach(model)
    assert not attnreg.hub.is_attached(model)
    assert (run(model, batch) - tempered).abs().max() <= 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_blockwise_entropy_and_parent_nll_equal_the_materialized_ones(name):
    model = build(name)
    batch = padded_batch()
    hub = attnreg.attach(model)
    hub.set_temperature(torch.linspace(0.5, 2.0, hub.layers[1].num_heads), layers=[1])
    length = batch["input_ids"].shape[1]
    parents = (torch.arange(length) - 1).expand(3, length).masked_fill(batch["attention_mask"] == 0, -1)

    # Only real query rows count: a padded row of a sliding layer sees no key, and SDPA (the blockwise run) and the
    # materialized path then fill it differently, which the next layer's padded rows see.
    rows = batch["attention_mask"][:, None, :]

    def terms(blockwise: bool):
        model.zero_grad()
        with hub.capture(inputs=blockwise) as record:
            output = real(model(**batch), batch)
        values = []
        for layer in range(hub.num_layers):
            if blockwise:
                inputs = record[layer]
                args = (inputs.query, inputs.key, inputs.attention_mask)
                # Gemma 2 caps its logits; gpt-oss has a sink logit per head
                options = dict(causal=inputs.causal, softcap=inputs.softcap, sinks=inputs.sinks)
                entropy = row_entropy(*args, inputs.scaling, **options)
                nll = prior_cross_entropy(*args, parents, inputs.scaling, **options)
            else:
                probs = record[layer]
                entropy = materialized_entropy(probs, sink=record.has_sink(layer))
                index = parents.clamp_min(0)[:, None, :, None].expand(-1, probs.shape[1], -1, 1)
                nll = -probs.gather(-1, index).squeeze(-1).clamp_min(1e-12).log() * (parents[:, None] >= 0)
            values += [(entropy * rows).sum(), (nll * rows).sum()]
        values = torch.stack(values)
        (values.sum() + output.float().pow(2).mean()).backward()
        grads = {key: p.grad.clone() for key, p in model.named_parameters() if p.grad is not None}
        return values.detach(), grads

    fast_values, fast_grads = terms(blockwise=True)
    slow_values, slow_grads = terms(blockwise=False)
    torch.testing.assert_close(fast_values, slow_values, rtol=1e-5, atol=1e-5)
    assert fast_grads.keys() == slow_grads.keys()
    for key, grad in fast_grads.items():
        # float32 sums of terms up to the gradient's own scale: the absolute error grows with it (phi3's fused
        # qkv_proj reaches 15, and one entry of 2,048 then differs by 1.6e-5)
        scale = max(1.0, float(slow_grads[key].abs().max()))
        torch.testing.assert_close(grad, slow_grads[key], rtol=1e-4, atol=1e-5 * scale, msg=key)


# -- keywords the hub does not implement ------------------------------------------------------------------------
def test_an_unknown_keyword_reaches_attnreg_error_not_sdpa():
    model = build("llama")
    hub = attnreg.attach(model)
    batch = padded_batch()
    with pytest.raises(NotImplementedError, match=r"\['attention_typo'\] from LlamaAttention \(model_type='llama'\)"):
        model(**batch, attention_typo=1.0)
    query = key = value = torch.randn(1, 4, 3, 8)
    for keyword, value_ in (("alibi", torch.zeros(4)), ("position_bias", torch.zeros(1, 4, 3, 3))):
        with pytest.raises(NotImplementedError, match=f"'{keyword}'"):
            attention_forward(hub.attention(0), query, key, value, None, **{keyword: value_})
    with pytest.raises(NotImplementedError, match="both softcap and s_aux from LlamaAttention"):
        attention_forward(hub.attention(0), query, key, value, None, softcap=1.0, s_aux=torch.zeros(4))
    # Keywords every path may ignore pass, None values too.
    out, _ = attention_forward(
        hub.attention(0), query, key, value, None, position_ids=None, use_cache=True, sliding_window=4, softcap=None
    )
    assert out.shape == (1, 3, 4, 8)


# -- models attnreg refuses at attach ---------------------------------------------------------------------------
REFUSED_CONFIGS = {
    "deberta-v2": dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
    "falcon": dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
    "qwen3_5_text": dict(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        head_dim=8,
        layer_types=["linear_attention", "full_attention"],
    ),
    "gemma3n_text": None,
    "gemma4_text": None,
}


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_model_types_are_refused_at_attach_naming_the_type(model_type):
    sizes = REFUSED_CONFIGS.get(model_type)
    config = AutoConfig.for_model(model_type, **(sizes or {}))
    if sizes is None:  # too large to build here: a stand-in carrying the real config is refused the same way
        model = torch.nn.Linear(2, 2)
        model.config = config
    else:
        torch.manual_seed(0)
        model = AutoModel.from_config(config)
    before = getattr(model.config, "_attn_implementation", None)
    with pytest.raises(UnsupportedModelError, match=f"model_type='{model_type}'\\): .+"):
        attnreg.attach(model)
    assert not attnreg.hub.is_attached(model)
    assert getattr(model.config, "_attn_implementation", None) == before


def test_deberta_never_calls_the_interface_as_transformers_says():
    model = AutoModel.from_config(AutoConfig.for_model("deberta-v2", **REFUSED_CONFIGS["deberta-v2"]))
    assert type(model)._can_set_attn_implementation() is False
    assert "never calls transformers' attention interface" in REFUSED["deberta-v2"]


def test_a_model_without_the_attention_interface_is_refused_before_anything_changes():
    class NoInterface(BertModel):
        _can_set_attn_implementation_cached_value = False

    model = NoInterface(tiny_config("bert"))
    implementation = model.config._attn_implementation
    with pytest.raises(UnsupportedModelError, match="NoInterface \\(model_type='bert'\\).*attention interface"):
        attnreg.attach(model)
    assert not attnreg.hub.is_attached(model) and model.config._attn_implementation == implementation
    assert not any(module._forward_pre_hooks for module in model.modules())
