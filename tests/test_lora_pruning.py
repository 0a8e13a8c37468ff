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

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is several times faster
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


@pytest.mark.parametrize("given", ["base", "peft_model"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_removal_with_lora_equals_gating_before_and_after_merge(family, given):
    model = lora_model(family)
    heads = HEADS[family]
    expected = logits(zeroed_reference(model, heads))
    hub = attnreg.attach(model)
    with torch.no_grad():
        for layer, numbers in heads.items():
            hub.gate(layer)[numbers] = 0.0
    torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)  # the gated model
    base = model.get_base_model()
    report = pruning.prune_heads(base if given == "base" else model, heads)  # the PeftModel itself, as users pass it
    assert pruning.pruned_heads(model) == pruning.pruned_heads(base) == report.removed
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


@pytest.mark.parametrize("given", ["base", "peft_model"])
def test_grouped_query_heads_kept_are_silenced_on_the_adapters_path(given):
    model = lora_model("llama")
    expected = logits(zeroed_reference(model, {0: [0, 1, 2]}))
    report = pruning.prune_heads(model.get_base_model() if given == "base" else model, {0: [0, 1, 2]})
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


# -- gates trained beside LoRA, heads removed mid-run with the adapter, training going on ----------------------
class Stream(torch.utils.data.IterableDataset):
    """Fixed causal-LM examples in a fixed order, so a resumed run sees what the uninterrupted one saw."""

    def __init__(self, count: int, length: int = 8):
        ids = torch.randint(3, 99, (count, length), generator=torch.Generator().manual_seed(1))
        self.items = [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in ids]

    def __iter__(self):
        return iter(self.items)


GATES = {
    "l1": lambda: attnreg.methods.L1Gates(weight=0.5),
    "hard_concrete": lambda: attnreg.methods.HardConcreteGates(target_warmup=0.5, lagrangian_lr=0.05),
}


def lora_trainer(folder, gates, removal, max_steps=6, **options):
    from conftest import sgd_arguments

    from attnreg.integrations.hf import AttnRegTrainer

    model = lora_model("llama").train()
    arguments = sgd_arguments(folder, max_steps=max_steps, learning_rate=0.05, optim="adamw_torch", **options)
    gating = attnreg.methods.HeadGating(GATES[gates](), removal)
    return AttnRegTrainer(model=model, args=arguments, train_dataset=Stream(4 * max_steps), methods=[gating]), gating


def adapters_fit_their_base(model):
    for name, layer in adapter_layers(model).items():
        for adapter in layer.lora_A:
            a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
            assert a.shape[1] == layer.in_features and b.shape[0] == layer.out_features == out_features(layer), name


@pytest.mark.parametrize("gates", ["l1", pytest.param("hard_concrete", marks=pytest.mark.slow)])  # HC: next test
def test_gates_train_beside_lora_in_the_trainer_and_heads_go_mid_run_with_the_adapter(tmp_path, gates):
    trainer, gating = lora_trainer(tmp_path, gates, attnreg.methods.Removal(keep=4, after_steps=3))
    trainer.train()
    assert trainer.state.global_step == 6 and gating.pruned and gating.pruned_at_step == 3
    base = trainer.model.get_base_model()
    silenced = sum(len(heads) for heads in pruning.silenced_heads(base).values())  # the grouped-query rule's
    assert sum(query for query, _ in gating.report.heads.values()) - silenced == 4
    adapters_fit_their_base(trainer.model)
    optimizer = trainer.optimizer
    for parameter in (p for p in trainer.model.parameters() if p.requires_grad):  # Adam's moments fit, and moved on
        assert optimizer.state[parameter]["exp_avg"].shape == parameter.shape
        assert int(optimizer.state[parameter]["step"]) == 6


@pytest.mark.parametrize("gates", ["l1", "hard_concrete"])
def test_gates_beside_lora_aiming_at_a_count_of_key_value_groups_remove_whole_groups(tmp_path, gates):
    trainer, gating = lora_trainer(tmp_path, gates, attnreg.methods.Removal(keep=3, groups=True, after_steps=4))
    trainer.train()
    base = trainer.model.get_base_model()
    removed = gating.rounds[0].report.removed  # one group of 4 goes, whole: its 2 query heads and their k/v head
    assert not pruning.silenced_heads(base) and sum(map(len, removed.values())) == 2
    assert all(
        len(heads) == 2 and heads[0] % 2 == 0 and heads[1] == heads[0] + 1 for heads in removed.values() if heads
    )
    adapters_fit_their_base(trainer.model)
    assert trainer.state.global_step == 6 and gating.pruned_at_step == 4
    if gates == "hard_concrete":  # the Lagrangian's target, in heads: 3 groups of 2 query heads
        assert gating.target(5) == 6 and gating.target(0) > 7


def test_a_removal_failing_at_the_end_keeps_the_trained_model_and_adapter_gated(tmp_path, monkeypatch):
    trainer, gating = lora_trainer(tmp_path, "l1", attnreg.methods.Removal(keep=4), max_steps=3)

    def fails(*args, **kwargs):
        raise RuntimeError("slicing went wrong")

    monkeypatch.setattr(attnreg.methods.pruning, "prune_heads", fails)
    with pytest.raises(RuntimeError, match=r"slicing went wrong\); nothing was folded or removed; the trained model"):
        trainer.train()
    rescue = tmp_path / "attnreg-unpruned"
    hub = attnreg.hub_of(trainer.model)
    assert sorted(hub.gates) == [0, 1] and not torch.equal(hub.gate(0).detach(), torch.ones(4))  # trained, not folded
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {path.name for path in rescue.iterdir()}
    loaded = peft.PeftModel.from_pretrained(pruning.load_pruned(rescue), rescue)
    torch.testing.assert_close(logits(loaded), logits(trainer.model), rtol=0, atol=0)


def test_lightning_gates_beside_lora_keep_the_adapters_adam_moments_across_a_removal():
    import lightning as L
    from conftest import Classifier, fit

    removal = attnreg.methods.Removal(keep=2, groups=True, after_steps=2)  # whole groups: something is removed
    gating = attnreg.HeadGating(attnreg.methods.L1Gates(weight=0.5), removal)
    module = Classifier(lora_model("llama").train(), lr=0.05)
    lora = {}  # optimizer state of every LoRA factor: just before the removal, and at the first step after

    class Take(L.Callback):
        def __init__(self, when):
            self.when = when

        def on_train_batch_end(self, trainer, pl_module, *args):
            if self.when(trainer) and self.when not in lora:
                optimizer = trainer.optimizers[0]
                named = pl_module.model.named_parameters()
                lora[self.when] = {n: copy.deepcopy(optimizer.state[p]) for n, p in named if "lora_" in n}

    before, after = (lambda t: t.global_step == 2 and not gating.method.pruned), (lambda t: gating.method.pruned)
    items = Stream(16).items
    batches = [torch.utils.data.default_collate(items[i : i + 4]) for i in range(0, 16, 4)]
    fit(module, batches, [Take(before), gating, Take(after)])  # `after`: right after the removal, same batch end
    assert gating.method.pruned and gating.method.report.removed
    silenced = pruning.silenced_heads(module.model.get_base_model())  # heads the grouped-query rule kept
    for layer, heads in gating.method.report.removed.items():
        kept = [head for head in range(4) if head not in heads]
        rows = (torch.tensor(kept, dtype=torch.long)[:, None] * 8 + torch.arange(8)).reshape(-1)
        groups = sorted({head // 2 for head in kept})
        kv_rows = (torch.tensor(groups, dtype=torch.long)[:, None] * 8 + torch.arange(8)).reshape(-1)
        prefix = f"base_model.model.model.layers.{layer}.self_attn"
        for name, index, dim in [
            (f"{prefix}.q_proj.lora_B.default.weight", rows, 0),
            (f"{prefix}.k_proj.lora_B.default.weight", kv_rows, 0),
            (f"{prefix}.v_proj.lora_B.default.weight", kv_rows, 0),
            (f"{prefix}.o_proj.lora_A.default.weight", rows, 1),
        ]:
            for key in ("exp_avg", "exp_avg_sq"):
                expected = lora[before][name][key].index_select(dim, index)
                if name.endswith("lora_A.default.weight"):  # a silenced head's columns: zero, as its weights
                    for head in silenced.get(layer, ()):
                        expected[:, kept.index(head) * 8 : (kept.index(head) + 1) * 8] = 0
                assert torch.equal(lora[after][name][key], expected), name
        untouched = f"{prefix}.q_proj.lora_A.default.weight"  # r x hidden: no head in it
        assert torch.equal(lora[after][untouched]["exp_avg"], lora[before][untouched]["exp_avg"])


def every_weight(model) -> dict[str, torch.Tensor]:
    """The base's weights too: the gates fold into them at the removal."""
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def assert_same(resumed: dict, whole: dict) -> None:
    assert resumed.keys() == whole.keys() and any("lora_" in name for name in whole)
    for name, value in whole.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "gates, removal",
    [
        ("l1", attnreg.methods.Removal(keep=4, after_steps=3)),
        ("hard_concrete", attnreg.methods.Removal(keep=3, groups=True, after_steps=3)),
    ],
)
def test_trainer_resumes_after_a_mid_run_removal_with_lora_to_the_uninterrupted_weights(tmp_path, gates, removal):
    whole, _ = lora_trainer(tmp_path / "whole", gates, removal, save_strategy="steps", save_steps=2)
    whole.train()
    checkpoint = tmp_path / "whole" / "checkpoint-4"  # after the removal at step 3
    resumed, gating = lora_trainer(tmp_path / "resumed", gates, removal, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    base = resumed.model.get_base_model()
    assert gating.pruned and {**pruning.pruned_heads(base), **pruning.silenced_heads(base)}
    assert_same(every_weight(resumed.model), every_weight(whole.model))


def test_lightning_resumes_after_a_mid_run_removal_with_lora_to_the_uninterrupted_weights(tmp_path):
    import lightning as L
    from conftest import Classifier

    items = Stream(8).items  # two steps an epoch: the checkpoint at step 4 ends an epoch, so the data resumes

    def run(resume=None):
        module = Classifier(lora_model("llama").train(), lr=0.05)
        trainer = L.Trainer(
            max_steps=6, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=tmp_path,
            callbacks=[attnreg.HeadGating(GATES["l1"](), attnreg.methods.Removal(keep=4, after_steps=3)),
                       L.pytorch.callbacks.ModelCheckpoint(tmp_path, "step{step}", every_n_train_steps=2,
                                                           save_top_k=-1, auto_insert_metric_name=False)],
        )  # fmt: skip
        trainer.fit(module, torch.utils.data.DataLoader(items, batch_size=4), ckpt_path=resume)
        return every_weight(module)

    whole = run()
    assert_same(run(resume=str(tmp_path / "step4.ckpt")), whole)


def test_a_count_of_key_value_groups_is_checked_against_the_model():
    gating = attnreg.methods.HeadGating(attnreg.methods.L1Gates(), attnreg.methods.Removal(keep=5, groups=True))
    with pytest.raises(ValueError, match=r"keep=5 key/value groups, but the gated layers \[0, 1\] have only 4"):
        gating.bind(tiny_model("llama"), taken=set())


def test_protected_heads_count_their_key_value_groups_against_keep():
    """Two protected heads in two groups cannot both stay when one group is kept: refused at bind, not a protected
    head removed."""
    removal = attnreg.methods.Removal(keep=1, groups=True, protect={0: [0], 1: [0]})
    gating = attnreg.methods.HeadGating(attnreg.methods.L1Gates(), removal)
    with pytest.raises(ValueError, match="protect holds heads of 2 key/value groups, more than keep=1 groups kept"):
        gating.bind(tiny_model("llama"), taken=set())
    fits = attnreg.methods.Removal(keep=1, groups=True, protect={0: [0, 1]})  # one group: it stays, the others go
    gating = attnreg.methods.HeadGating(attnreg.methods.L1Gates(), fits)
    gating.bind(tiny_model("llama"), taken=set())
    assert gating.choose(1) == {0: [2, 3], 1: [0, 1, 2, 3]}


# -- modules_to_save on an attention projection; a removal inside TRL's SFTTrainer with a LoRA peft_config --------
@pytest.mark.parametrize("saved", ["k_proj", "o_proj"])
def test_modules_to_save_on_a_projection_removal_slices_is_refused_before_anything_changes(saved):
    """A full trainable copy of a projection (PEFT's `ModulesToSaveWrapper`) is not sliced: refused by name, the
    model untouched; a copy of a module the removal does not touch (`lm_head`) is fine, equal to the gated model."""
    model = lora_model("llama", targets=["q_proj", "v_proj"], modules_to_save=[saved])
    before = {name: value.clone() for name, value in model.state_dict().items()}
    refused = rf"layers\.0\.self_attn\.{saved}: peft\.utils\.other\.ModulesToSaveWrapper .*modules_to_save.*Nothing was"
    with pytest.raises(TypeError, match=refused):
        pruning.prune_heads(model.get_base_model(), {0: [0, 1]})
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[name], after[name]) for name in before)
    assert pruning.pruned_heads(model.get_base_model()) == {}
    gating = attnreg.methods.HeadGating(attnreg.methods.L1Gates(), attnreg.methods.Removal(keep=6))
    with pytest.raises(TypeError, match=rf"HeadGating: heads of layer 0 cannot be removed.*{saved}.*modules_to_save"):
        gating.bind(model, taken=set())

    model = lora_model("llama", modules_to_save=["lm_head"])
    with torch.no_grad():  # the saved copy differs from the original: its path is the one that must run
        model.get_base_model().lm_head.modules_to_save["default"].weight.mul_(1.5)
    expected = logits(zeroed_reference(model, {0: [0, 1]}))
    pruning.prune_heads(model.get_base_model(), {0: [0, 1]})
    torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)


def test_a_removal_inside_trl_sft_with_a_lora_peft_config_equals_the_gated_model_and_training_goes_on(
    tmp_path, monkeypatch
):
    """`with_attnreg(trl.SFTTrainer)` with `peft_config` (LoRA on q/k/v/o, TRL's gradient checkpointing): at the
    removal (step 2) the smaller model's logits equal the gated model's with the chosen heads' gates at zero
    (1e-5), after the removal and after the gates fold; the two steps after train the smaller model's adapter."""
    pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[trl]')")
    datasets = pytest.importorskip("datasets", reason="datasets is not installed")
    import trl
    from test_trl import chat, rows, tokenizer

    from attnreg.integrations.hf import with_attnreg
    from attnreg.syntax import SyntaxCollator

    tokens = tokenizer()
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    seen = {}
    prune_heads, fold_gates = pruning.prune_heads, pruning.fold_gates

    def gated_then_pruned(model, heads, *args, **kwargs):
        hub, training = attnreg.hub_of(model), model.training
        model.eval()
        with torch.no_grad():
            saved = {layer: hub.gate(layer).detach().clone() for layer in heads}
            for layer, numbers in heads.items():
                hub.gate(layer)[numbers] = 0.0
            seen["gated"] = model(input_ids=prompt).logits
            seen["gates"] = {layer: gate[heads[layer]].clone() for layer, gate in saved.items()}
            for layer, gate in saved.items():
                hub.gate(layer).copy_(gate)
        report = prune_heads(model, heads, *args, **kwargs)
        with torch.no_grad():
            seen["pruned"] = model(input_ids=prompt).logits
        model.train(training)
        return report

    def folded(model, *args, **kwargs):
        fold_gates(model, *args, **kwargs)
        training = model.training
        with torch.no_grad():
            if "folded" not in seen:  # the removal's fold
                seen["folded"] = model.eval()(input_ids=prompt).logits
                seen["lora"] = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
        model.train(training)

    monkeypatch.setattr(pruning, "prune_heads", gated_then_pruned)
    monkeypatch.setattr(pruning, "fold_gates", folded)
    gating = attnreg.methods.HeadGating(
        attnreg.methods.L1Gates(weight=0.5), attnreg.methods.Removal(keep=3, groups=True, after_steps=2)
    )
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS["llama"])
    arguments = trl.SFTConfig(
        str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, use_cpu=True, bf16=False,
        save_strategy="no", report_to=[], disable_tqdm=True, seed=0, dataset_kwargs={"skip_prepare_dataset": True},
    )  # fmt: skip
    trainer = with_attnreg(trl.SFTTrainer)(
        model=tiny_model("llama", head="causal_lm", vocab=len(tokens)).train(),
        args=arguments,
        train_dataset=datasets.Dataset.from_list(rows(16)),
        data_collator=SyntaxCollator(tokens, messages=chat, lm_labels=True, causal=True),
        processing_class=tokens,
        peft_config=config,
        methods=[gating],
    )
    assert trainer.args.gradient_checkpointing  # TRL's default, on through the removal
    trainer.train()
    assert gating.pruned_at_step == 2 and trainer.state.global_step == 4
    assert any(float(gate.abs().max()) > 0.01 for gate in seen["gates"].values())  # the gates zeroed were not shut
    torch.testing.assert_close(seen["pruned"], seen["gated"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(seen["folded"], seen["gated"], rtol=1e-5, atol=1e-5)
    base = trainer.model.get_base_model()
    removed = gating.rounds[0].report.removed
    assert sum(map(len, removed.values())) == 2 and not pruning.silenced_heads(base)  # one whole group of 2 heads
    layer = next(layer for layer, heads in removed.items() if heads)
    assert base.model.layers[layer].self_attn.q_proj.out_features == 16  # 2 heads of 8 left
    adapters_fit_their_base(trainer.model)
    now = {n: p.detach() for n, p in base.named_parameters() if "lora_" in n}  # the base the removal was given
    assert now.keys() == seen["lora"].keys()
    assert all(now[n].shape == seen["lora"][n].shape for n in now)  # the smaller model's adapter...
    assert any(not torch.equal(now[n], seen["lora"][n]) for n in now)  # ...trained on after the removal
    for parameter in (p for p in trainer.model.parameters() if p.requires_grad):
        assert trainer.optimizer.state[parameter]["exp_avg"].shape == parameter.shape
