"""The pruning recipe that won on SmolLM2 (issue 36), in the library and the app: key/value groups removed by head
importance when training starts (`ImportanceRemoval`), then LoRA with distillation from the unpruned model
(`Distillation`, `teacher: base` in the app). Each removal is checked against the library's own path,
`prune_heads(model, select_groups(head_importance(model, batches), ...))`, computed independently."""

import copy
import math

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from transformers import TrainingArguments

import attnreg
from attnreg.app.configs import CONFIG_DIR, register_resolvers
from attnreg.app.models import add_lora
from attnreg.app.modules import CausalLM
from attnreg.app.settings import instantiate_callbacks, provide
from attnreg.app.train import train
from attnreg.integrations.hf import AttnRegTrainer
from attnreg.methods import Distillation, Loop
from attnreg.methods.pruning import head_importance, load_pruned, prune_heads, pruned_heads, select_groups
from attnreg.methods.pruning.importance import ImportanceRemoval
from attnreg.tiny import tiny_model


def lm_batches(count: int = 3, rows: int = 4, length: int = 8, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(3, 99, (rows, length), generator=generator)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return batches


def library_choice(model, batches, keep: int, keep_per_layer: int = 0) -> dict[int, list[int]]:
    """The heads (current positions) the library path removes: whole groups by mean importance, all but `keep`,
    the best `keep_per_layer` groups of each layer held back."""
    scores = head_importance(model, batches)
    family = attnreg.families.detect_family(model)
    sizes = {}
    for layer, score in scores.items():
        heads, kv_heads = family.head_counts(family.attention_module(model, layer))
        sizes[layer] = heads // kv_heads
        groups = score.view(-1, sizes[layer]).mean(dim=1)
        for group in sorted(range(len(groups)), key=lambda g: -float(groups[g]))[:keep_per_layer]:
            score[group * sizes[layer] : (group + 1) * sizes[layer]] = math.inf
    return select_groups(scores, sizes, keep=keep)


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


# -- the method against the library path ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("sizes", "setting", "keep", "keep_per_layer"),
    [
        ({}, {"fraction": 0.25}, 3, 0),  # 2 layers x 2 groups: one group goes
        (
            {"layers": 3, "heads": 6, "hidden": 48},
            {"keep": 4},
            4,
            1,
        ),  # 3 layers x 3 groups: 5 go, one left in every layer
        ({"layers": 3, "heads": 6, "hidden": 48}, {"keep": 2}, 2, 0),  # a layer may empty
    ],
)
def test_importance_removal_removes_what_the_library_path_removes(sizes, setting, keep, keep_per_layer):
    model = tiny_model("llama", head="causal_lm", **sizes)
    reference = copy.deepcopy(model)
    batches = lm_batches()
    removal = ImportanceRemoval(batches, keep_per_layer=keep_per_layer, batches=2, **setting)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    removal.bind(model)
    removal.start(10)
    removal.on_fit_start(Loop(optimizers=[optimizer]))

    expected = library_choice(reference, batches[:2], keep, keep_per_layer)  # the first 2 batches only
    prune_heads(reference, expected)
    assert pruned_heads(model) == pruned_heads(reference) and pruned_heads(model)
    assert removal.removed == {layer: list(heads) for layer, heads in pruned_heads(model).items()}
    assert removal.done and removal.state_dict()["done"]
    torch.testing.assert_close(logits(model, batches[0]), logits(reference, batches[0]), rtol=0, atol=1e-5)
    if keep_per_layer:
        heads = [len(attnreg.heads.head_numbers(model, layer)) for layer in range(3)]
        assert min(heads) >= 2 and sum(heads) == 2 * keep


def test_importance_removal_under_lora_equals_the_plain_model_pruned_and_the_adapter_goes_with_the_heads():
    """Through a fresh LoRA adapter (it adds nothing yet) the choice is the plain model's; the adapter is sliced
    with the heads, so the merged model is the plain model pruned."""
    base = tiny_model("llama", head="causal_lm")
    reference = copy.deepcopy(base)
    model = add_lora(base, r=4, seed=0)
    batches = lm_batches()
    removal = ImportanceRemoval(batches, fraction=0.25)
    removal.bind(model)
    removal.start(10)
    removal.on_fit_start(Loop())
    prune_heads(reference, library_choice(reference, batches, keep=3))
    assert pruned_heads(model.base_model.model) == pruned_heads(reference)
    merged = model.merge_and_unload()
    torch.testing.assert_close(logits(merged, batches[0]), logits(reference, batches[0]), rtol=0, atol=1e-5)


def test_importance_removal_in_the_hugging_face_trainer(tmp_path):
    model = tiny_model("llama", head="causal_lm")
    reference = copy.deepcopy(model)
    batches = lm_batches()
    rows = [{key: value[i] for key, value in batch.items()} for batch in batches for i in range(4)]
    removal = ImportanceRemoval(batches, keep=2)
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, seed=0, learning_rate=1e-3,
    )  # fmt: skip
    AttnRegTrainer(model=model, args=args, train_dataset=rows, methods=[removal]).train()
    prune_heads(reference, library_choice(reference, batches, keep=2))
    assert pruned_heads(model) == pruned_heads(reference) and sum(map(len, pruned_heads(model).values())) == 4


def test_importance_removal_settings_are_checked_naming_the_setting():
    with pytest.raises(ValueError, match="give keep= .* or fraction="):
        ImportanceRemoval([])
    assert ImportanceRemoval([], keep=2, fraction=0.5).keep == 2  # keep wins, as a command line sets it
    with pytest.raises(ValueError, match="fraction .* must be in"):
        ImportanceRemoval([], fraction=1.0)
    with pytest.raises(ValueError, match=r"keep=9 key/value groups, more than the model has: LlamaForCausalLM has 4"):
        ImportanceRemoval([], keep=9).bind(tiny_model("llama", head="causal_lm"))
    with pytest.raises(ValueError, match="keep_per_layer=3"):
        ImportanceRemoval([], keep=3, keep_per_layer=3).bind(tiny_model("llama", head="causal_lm"))
    removal = ImportanceRemoval(keep=3)
    removal.bind(tiny_model("llama", head="causal_lm"))
    with pytest.raises(ValueError, match="no dataloader"):
        removal.on_fit_start(Loop())


# -- distillation leaves the teacher as it was ---------------------------------------------------------------------
class TeacherModes(L.Callback):
    """Records the teacher's mode at every training batch."""

    def __init__(self, teacher):
        self.teacher, self.modes = teacher, []

    def on_train_batch_start(self, *args):
        self.modes.append(self.teacher.training)


def test_distillation_leaves_a_users_teacher_as_it_was():
    teacher = tiny_model("llama", head="causal_lm").train()  # a model of the user's, in train mode
    teacher.model.layers[0].mlp.eval()  # with a submodule in another mode
    before = {name: value.clone() for name, value in teacher.state_dict().items()}
    student = tiny_model("llama", head="causal_lm", seed=1)
    modes = TeacherModes(teacher)
    trainer = L.Trainer(
        max_steps=2, callbacks=[attnreg.Distillation(teacher), modes], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(CausalLM(student, lr=1e-2), torch.utils.data.DataLoader(lm_batches(2), batch_size=None))
    assert modes.modes == [False, False]  # eval mode while it teaches
    assert teacher.training and not teacher.model.layers[0].mlp.training  # every module's mode back
    assert all(parameter.requires_grad for parameter in teacher.parameters())  # never changed
    assert all(torch.equal(value, before[name]) for name, value in teacher.state_dict().items())


def test_a_base_teacher_that_nothing_gave_is_refused_naming_the_setting():
    model = tiny_model("llama", head="causal_lm")
    with pytest.raises(ValueError, match="teacher='base' stands for the run's base model, and nothing gave it"):
        Distillation("base").bind(model)
    with pytest.raises(TypeError, match="teacher must be a model .* or 'base'"):
        Distillation("bsae")
    distillation = attnreg.Distillation("base")
    with pytest.raises(ValueError, match="teacher: base names the run's base model, and this run has none"):
        provide([distillation], data=None)
    provide([distillation], data=None, base_model=model)
    assert distillation.method.teacher is model and distillation.method.needs == frozenset()


# -- the app -------------------------------------------------------------------------------------------------------
def composed(*overrides: str):
    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("train", list(overrides))


class Spy(L.Callback):
    """Keeps what the test checks after the run: the run's distillation teacher and the trained model's logits."""

    found: dict = {}

    def on_train_end(self, trainer, pl_module):
        (distillation,) = [c.method for c in trainer.callbacks if isinstance(getattr(c, "method", None), Distillation)]
        Spy.found["teacher"] = distillation.teacher
        Spy.found["batch"] = next(iter(trainer.datamodule.loader("val")))
        Spy.found["logits"] = logits(copy.deepcopy(pl_module.model), Spy.found["batch"])


def test_the_app_runs_the_recipe_removing_what_the_library_removes(tmp_path):
    import peft

    cfg = composed("experiment=tiny_llama_pruning", "~logger", "trainer.enable_progress_bar=false", "control=false")
    OmegaConf.update(cfg, "attnreg.spy", {"_target_": f"{__name__}.Spy"}, force_add=True)
    summary = train(cfg, tmp_path)

    data = instantiate(cfg.data, tokenizer=None, with_prior=False)  # the run's data and model, built again
    data.setup("fit")
    fresh = instantiate(cfg.model, tokenizer=data.tokenizer, num_labels=data.num_labels)
    batches = [dict(batch) for batch, _ in zip(data.train_dataloader(), range(8), strict=False)]
    expected = copy.deepcopy(fresh)
    report = prune_heads(expected, library_choice(expected, batches, keep=3, keep_per_layer=1))
    assert summary["pruning"]["removed"] == {str(layer): list(heads) for layer, heads in report.removed.items()}
    assert summary["pruning"]["heads_left"] == [report.heads[layer][0] for layer in (0, 1)]

    teacher = Spy.found["teacher"]  # the base copy: untrained, unpruned, unchanged
    assert pruned_heads(teacher) == {} and all(p.requires_grad for p in teacher.parameters())
    assert all(torch.equal(value, fresh.state_dict()[name]) for name, value in teacher.state_dict().items())
    assert summary["metrics"]["attnreg/distillation"] > 0  # the term was in the loss

    reloaded = peft.PeftModel.from_pretrained(load_pruned(tmp_path / "pruned_model"), tmp_path / "pruned_model")
    torch.testing.assert_close(logits(reloaded, Spy.found["batch"]), Spy.found["logits"], rtol=0, atol=1e-5)
    assert summary["pruning"]["parameters"] < summary["pruning"]["generation"]["unpruned"]["parameters"]

    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert {key.removeprefix("model.") for key in checkpoint["state_dict"]} == set(reloaded.state_dict())
    ours = {
        key: state for key, state in checkpoint["callbacks"].items() if key.startswith(("ImportanceRemoval", "Distil"))
    }
    assert len(ours) == 2 and "tensor" not in str(ours).lower() and "'done': True" in str(ours)  # no teacher

    last = tmp_path / "checkpoints" / "last.ckpt"  # a resume rebuilds the smaller model and does not choose again
    resumed = composed("experiment=tiny_llama_pruning", "~logger", f"ckpt_path={last}", "trainer.max_epochs=2")
    again = train(resumed, tmp_path / "resumed")
    assert again["steps"] == 2 * summary["steps"] and again["pruning"]["removed"] == summary["pruning"]["removed"]


def test_the_app_refuses_bad_recipe_settings_naming_the_key(tmp_path):
    too_many = composed("experiment=tiny_llama_pruning", "attnreg.importance_removal.keep=9", "~logger")
    with pytest.raises(ValueError, match="keep=9 key/value groups, more than the model has"):
        train(too_many, tmp_path / "keep")
    typo = composed("experiment=tiny_llama_pruning", "attnreg.distillation.teacher=bsae", "~logger")
    with pytest.raises(InstantiationException, match=r"(?s)teacher must be a model.*full_key: attnreg.distillation"):
        train(typo, tmp_path / "teacher")


def test_the_smollm2_pruning_preset_is_the_recipe_that_won():
    """Composed only (the model is not loaded): importance removal of a quarter of the groups, LoRA r=16 on
    attention and MLP, distillation from the base."""
    cfg = composed("experiment=smollm2_pruning")
    settings = OmegaConf.to_container(cfg.attnreg)
    assert list(settings) == ["importance_removal", "distillation"]
    assert settings["importance_removal"]["fraction"] == 0.25 and settings["importance_removal"]["keep_per_layer"] == 1
    assert settings["distillation"]["teacher"] == "base" and cfg.peft.r == 16 and "down_proj" in cfg.peft.target_modules
    assert 90 - round(0.25 * 90) == 68  # 22 of SmolLM2's 90 groups go, as in the pilot
    callbacks = instantiate_callbacks(cfg)
    assert callbacks["importance_removal"].method.fraction == 0.25
    gates = composed("experiment=smollm2_pruning_gates")  # the gates preset stays reachable
    assert list(gates.attnreg) == ["head_gating"] and gates.attnreg.head_gating.removal.keep == 180
