"""Head removal on layers a PEFT LoRA adapter wraps: the adapter's factors go with the heads (`lora_B` rows on
q/k/v, `lora_A` columns on the output projection). References: the same adapter merged by PEFT itself with the
removed heads' output-projection inputs zeroed by hand, and the gated model with those heads at zero."""

import copy

import pytest
import torch
from transformers.pytorch_utils import Conv1D

import attnreg
from attnreg.families import detect_family
from attnreg.methods import pruning
from attnreg.tiny import tiny_model
from attnreg.weights import adapter_layers, out_features

peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[peft]')")

IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj"], "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj"]}
TARGETS["gpt2"] = ["c_attn", "c_proj"]
# whole key/value groups (Llama-style: 4 query heads share 2 key/value heads), and a layer emptied
HEADS = {"llama": {0: [0, 1], 1: [2, 3]}, "qwen3": {0: [2, 3], 1: [0, 1, 2, 3]}, "gpt2": {0: [1, 3], 1: [0, 1, 2, 3]}}


def lora_model(family, targets=None, seed=7, **options):
    model = tiny_model(family, head="causal_lm")
    torch.manual_seed(seed)  # init_lora_weights=False: random A and B, so the adapter path is not zero
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=targets or TARGETS[family],
        init_lora_weights=False,
        lora_dropout=0.0,
        fan_in_fan_out=family == "gpt2",
        **options,
    )
    return peft.get_peft_model(model, config)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def zeroed_reference(model, heads):
    """PEFT merges a copy of the adapter; the removed heads' columns of each output projection zeroed by hand."""
    merged = copy.deepcopy(model).merge_and_unload().eval()
    family = detect_family(merged)
    with torch.no_grad():
        for layer, numbers in heads.items():
            projection = family.out_projection(merged, layer)
            head_dim = family.head_dim(family.attention_module(merged, layer))
            for head in numbers:
                columns = slice(head * head_dim, (head + 1) * head_dim)
                if isinstance(projection, Conv1D):
                    projection.weight[columns, :] = 0
                else:
                    projection.weight[:, columns] = 0
    return merged


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_removal_with_lora_equals_gating_before_and_after_merge(family):
    model = lora_model(family)
    heads = HEADS[family]
    expected = logits(zeroed_reference(model, heads))
    hub = attnreg.attach(model)
    with torch.no_grad():
        for layer, numbers in heads.items():
            hub.gate(layer)[numbers] = 0.0
    torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)  # the gated model
    base = model.get_base_model()
    report = pruning.prune_heads(base, heads)
    assert report.removed == {layer: tuple(numbers) for layer, numbers in heads.items()} and not report.kept
    torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)
    layer = detect_family(base).attention_module(base, 0)
    projections = [layer.c_attn] if family == "gpt2" else [layer.q_proj, layer.k_proj, layer.v_proj]
    for projection in projections:  # rows of lora_B with the heads' outputs
        assert projection.lora_B["default"].weight.shape[0] == projection.out_features == out_features(projection)
    out = layer.c_proj if family == "gpt2" else layer.o_proj  # columns of lora_A with their context
    assert out.lora_A["default"].weight.shape[1] == out.in_features == 16
    merged = model.merge_and_unload()
    assert not adapter_layers(merged)
    torch.testing.assert_close(logits(merged), expected, rtol=1e-5, atol=1e-5)


def test_grouped_query_heads_kept_are_silenced_on_the_adapters_path():
    model = lora_model("llama")
    expected = logits(zeroed_reference(model, {0: [0, 1, 2]}))
    report = pruning.prune_heads(model.get_base_model(), {0: [0, 1, 2]})
    assert report.removed == {0: (0, 1)} and list(report.kept[0]) == [2]
    torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits(model.merge_and_unload()), expected, rtol=1e-5, atol=1e-5)


def test_adam_moments_of_the_adapter_are_sliced_with_the_heads():
    model = lora_model("llama")
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()(input_ids=IDS, labels=IDS).loss.backward()
    optimizer.step()
    attention = model.get_base_model().model.layers[0].self_attn
    q_b, o_a = attention.q_proj.lora_B["default"].weight, attention.o_proj.lora_A["default"].weight
    before = {name: optimizer.state[p]["exp_avg_sq"].clone() for name, p in (("q", q_b), ("o", o_a))}
    pruning.prune_heads(model.get_base_model(), {0: [0, 1]}, optimizers=[optimizer])
    torch.testing.assert_close(optimizer.state[q_b]["exp_avg_sq"], before["q"][16:])  # heads 2, 3: rows 16-31
    torch.testing.assert_close(optimizer.state[o_a]["exp_avg_sq"], before["o"][:, 16:])
    model(input_ids=IDS, labels=IDS).loss.backward()
    optimizer.step()  # training goes on with the sliced state


@pytest.mark.parametrize(
    "options, refused",
    [
        ({"use_dora": True}, r"q_proj: peft\.tuners\.lora\.layer\.Linear uses DoRA"),
        ({"lora_bias": True}, "o_proj: .*lora_bias"),
    ],
)
def test_adapters_that_cannot_be_sliced_exactly_are_refused_before_anything_changes(options, refused):
    model = lora_model("llama", targets=["q_proj", "o_proj"], **options)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(TypeError, match=rf"layers\.1\.self_attn\.{refused}.*Nothing was changed"):
        pruning.prune_heads(model.get_base_model(), {1: [0, 1], 0: [0, 1]})
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[name], after[name]) for name in before)
    assert pruning.pruned_heads(model.get_base_model()) == {}


def test_another_tuner_is_refused_naming_the_module_and_the_tuner():
    config = peft.IA3Config(target_modules=["k_proj"], feedforward_modules=[])
    model = peft.get_peft_model(tiny_model("llama", head="causal_lm"), config)
    with pytest.raises(TypeError, match=r"layers\.0\.self_attn\.k_proj: peft\.tuners\.ia3\.layer\.Linear wraps"):
        pruning.prune_heads(model.get_base_model(), {0: [0, 1]})
    gating = attnreg.methods.HeadGating(attnreg.methods.L1Gates(), attnreg.methods.Removal(keep=6))
    with pytest.raises(TypeError, match="HeadGating: heads of layer 0 cannot be removed"):
        gating.bind(model, taken=set())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_pruned_base_and_its_adapter_save_and_load_to_the_same_logits(family, tmp_path):
    model = lora_model(family)
    attnreg.attach(model)
    pruning.prune_heads(model.get_base_model(), HEADS[family])
    expected = logits(model)
    folder = pruning.save_pruned(model, tmp_path / "pruned")
    assert {"adapter_config.json", "adapter_model.safetensors", "attnreg_pruning.json"} <= {
        path.name for path in folder.iterdir()
    }
    loaded = peft.PeftModel.from_pretrained(pruning.load_pruned(folder), folder)
    torch.testing.assert_close(logits(loaded), expected, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path / "adapter")  # PEFT's own files, alone, onto the pruned base
    alone = peft.PeftModel.from_pretrained(pruning.load_pruned(folder), tmp_path / "adapter")
    torch.testing.assert_close(logits(alone), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits(alone.merge_and_unload()), expected, rtol=1e-5, atol=1e-5)
