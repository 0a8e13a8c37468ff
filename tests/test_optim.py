"""Layer-wise parameter groups (ELECTRA's decay reproduced exactly), and LayerwiseLR / FreezeLayers in real fits."""

import csv

import conftest
import lightning as L
import pytest
import torch
from conftest import FAMILIES, padded_batch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from transformers import AlbertConfig, AlbertModel

import attnreg
from attnreg.callbacks.optim import FreezeLayers, LayerwiseLR
from attnreg.families import detect_family
from attnreg.methods.layerwise_lr import layerwise_param_groups, parameters_by_layer
from attnreg.schedules import Linear, Warmup
from attnreg.tiny import tiny_model

HEADS = {"gpt2": "causal_lm", "llama": "causal_lm", "mistral": "base"}
EMBEDDINGS = {
    "bert": {"bert.embeddings."},
    "roberta": {"roberta.embeddings."},
    "electra": {"electra.embeddings.", "electra.embeddings_project."},
    "distilbert": {"distilbert.embeddings."},
    "gpt2": {"transformer.wte.", "transformer.wpe."},  # lm_head is tied to wte: one parameter, here
    "llama": {"model.embed_tokens."},
    "qwen2": {"model.embed_tokens."},
    "mistral": {"embed_tokens."},
}
HEAD_PARAMETERS = {
    "bert": ["bert.pooler.dense.weight", "bert.pooler.dense.bias", "classifier.weight", "classifier.bias"],
    "roberta": [f"classifier.{m}.{p}" for m in ("dense", "out_proj") for p in ("weight", "bias")],
    "electra": [f"classifier.{m}.{p}" for m in ("dense", "out_proj") for p in ("weight", "bias")],
    "distilbert": ["pre_classifier.weight", "pre_classifier.bias", "classifier.weight", "classifier.bias"],
    "gpt2": ["transformer.ln_f.weight", "transformer.ln_f.bias"],
    "llama": ["model.norm.weight", "lm_head.weight"],
    "qwen2": ["model.norm.weight", "score.weight"],
    "mistral": ["norm.weight"],
}


def model_of(family, **sizes):
    return tiny_model(family, head=HEADS.get(family, "classification"), **sizes)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gets_embeddings_layers_and_head(family):
    model = model_of(family, layers=3)
    by_layer = parameters_by_layer(model)
    assert list(by_layer) == ["embeddings", "layer0", "layer1", "layer2", "head", "gates"]
    names = {group: [name for name, _ in named] for group, named in by_layer.items()}
    blocks = detect_family(model).blocks_path
    for index in range(3):
        assert names[f"layer{index}"] and all(f".{blocks}.{index}." in f".{name}" for name in names[f"layer{index}"])
    assert names["embeddings"] and all(name.startswith(tuple(EMBEDDINGS[family])) for name in names["embeddings"])
    assert names["head"] == HEAD_PARAMETERS[family]
    every = [param for named in by_layer.values() for _, param in named]
    assert len({id(p) for p in every}) == len(every) == len(list(model.parameters()))

    groups = layerwise_param_groups(model, lr=1e-3, weight_decay=0.01)
    grouped = [p for group in groups for p in group["params"]]
    assert len({id(p) for p in grouped}) == len(grouped) == len(every)


def electra_get_layer_lrs(learning_rate, layer_decay, n_layers):
    """ELECTRA's `_get_layer_lrs` (google-research/electra, model/optimization.py), written out again."""
    key_to_depths = {"/embeddings/": 0, "/embeddings_project/": 0, "task_specific/": n_layers + 2}
    for layer in range(n_layers):
        key_to_depths["encoder/layer_" + str(layer) + "/"] = layer + 1
    return {key: learning_rate * (layer_decay ** (n_layers + 2 - depth)) for key, depth in key_to_depths.items()}


def electra_key(name):
    """The key of `electra_get_layer_lrs` that ELECTRA's TF variable for our parameter `name` matches."""
    if name.startswith("electra.embeddings_project."):
        return "/embeddings_project/"
    if name.startswith("electra.embeddings."):
        return "/embeddings/"
    if name.startswith("electra.encoder.layer."):
        return f"encoder/layer_{name.split('.')[3]}/"
    return "task_specific/"


@pytest.mark.parametrize("decay", [0.95, 0.8, 0.5])
def test_layer_decay_reproduces_electra_exactly(decay):
    model = tiny_model("electra", head="classification", layers=4)
    lr = 3e-4
    expected = electra_get_layer_lrs(lr, decay, n_layers=4)
    groups = layerwise_param_groups(model, lr=lr, decay=decay, weight_decay=0.01)
    lr_of = {id(p): group["lr"] for group in groups for p in group["params"]}
    for name, param in model.named_parameters():
        assert lr_of[id(param)] == expected[electra_key(name)], name
    assert lr_of[id(model.classifier.out_proj.weight)] == lr
    assert lr_of[id(model.electra.encoder.layer[3].output.dense.weight)] == lr * decay**2
    assert lr_of[id(model.electra.embeddings.word_embeddings.weight)] == lr * decay**6


def test_multipliers_freeze_and_weight_decay_groups():
    model = tiny_model("qwen2", head="classification", layers=3)
    gate = attnreg.attach(model).gate(1)
    groups = layerwise_param_groups(
        model,
        lr=1.0,
        decay=0.5,
        multipliers={"head": 10, 0: 3.0, "gates": 100},
        freeze=["embeddings"],
        weight_decay=0.1,
    )
    by_name = {group["name"]: group for group in groups}
    assert list(by_name) == [
        *(f"layer{i}{suffix}" for i in range(3) for suffix in ("", "/no_decay")),
        "head",
        "head/no_decay",
        "gates",
    ]
    assert by_name["gates"]["params"] == [gate]  # not in layer 1's group, at its decayed rate
    assert (by_name["gates"]["lr"], by_name["gates"]["weight_decay"]) == (100.0, 0.0)
    assert [by_name[f"layer{i}"]["lr"] for i in range(3)] == [0.5**4 * 3.0, 0.5**3, 0.5**2]
    assert by_name["head"]["lr"] == by_name["head/no_decay"]["lr"] == 10.0
    assert {g["weight_decay"] for n, g in by_name.items() if n.endswith("/no_decay")} == {0.0}
    assert {g["weight_decay"] for n, g in by_name.items() if not n.endswith("/no_decay") and n != "gates"} == {0.1}
    block = model.model.layers[1]
    no_decay = {id(p) for p in by_name["layer1/no_decay"]["params"]}
    expected = [block.input_layernorm.weight, block.post_attention_layernorm.weight]
    expected += [getattr(block.self_attn, f"{x}_proj").bias for x in "qkv"]  # Qwen2 has q/k/v biases
    assert {id(p) for p in expected} == no_decay
    assert not model.model.embed_tokens.weight.requires_grad
    assert all(id(p) not in {id(q) for g in groups for q in g["params"]} for p in model.model.embed_tokens.parameters())

    listed = layerwise_param_groups(tiny_model("bert", layers=3), lr=1.0, multipliers=[1.0, 2.0, 4.0])
    assert [g["lr"] for g in listed] == [1.0, 1.0, 2.0, 4.0, 1.0]
    patterns = layerwise_param_groups(tiny_model("bert", layers=1), lr=1.0, weight_decay=0.1, no_decay=["embeddings"])
    assert {g["name"] for g in patterns} == {"embeddings/no_decay", "layer0", "head"}


class Wrapped(L.LightningModule):
    """A LightningModule with a transformers model and a parameter of its own."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.scale = torch.nn.Parameter(torch.ones(()))

    def training_step(self, batch, batch_idx):
        return self.scale * self.model(**batch).loss

    def configure_optimizers(self):  # Lightning requires one; LayerwiseLR replaces it
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_parameters_outside_the_transformers_model_go_to_head():
    module = Wrapped(tiny_model("gpt2", head="classification"))
    assert [name for name, _ in parameters_by_layer(module)["head"]] == [
        "scale",  # a module's own parameters come before its submodules'
        "model.transformer.ln_f.weight",
        "model.transformer.ln_f.bias",
        "model.score.weight",
    ]


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(decay=0.0), ValueError, r"decay must be in \(0, 1\] \(1 = no decay\), got 0.0"),
        (dict(decay=1.5), ValueError, r"decay must be in \(0, 1\]"),
        (dict(decay=True), ValueError, "decay must be"),
        (dict(lr=0.0), ValueError, "lr must be a finite number > 0"),
        (dict(weight_decay=-0.1), ValueError, "weight_decay must be >= 0"),
        (dict(multipliers={"layer9": 2.0}), KeyError, r"multipliers: 'layer9' matches no layer group; the groups are"),
        (dict(multipliers={"pooler": 2.0}), KeyError, "'pooler' matches no layer group"),
        (dict(multipliers={7: 2.0}), IndexError, "multipliers: layer 7 is out of range, the model has 2 layers"),
        (dict(multipliers=[1.0]), ValueError, r"one factor per transformer layer \(2\), got 1"),
        (dict(multipliers={"head": 0.0}), ValueError, r"multipliers\['head'\] must be a finite number > 0"),
        (dict(multipliers=2.0), TypeError, "multipliers must be a dict or a list"),
        (dict(freeze=["embeddings", "layer5"]), KeyError, "freeze: 'layer5' matches no layer group"),
        (dict(freeze=["embeddings", 0, 1, "head"]), ValueError, "freezes every layer group"),
    ],
)
def test_bad_input_raises_and_leaves_the_model_unchanged(options, error, message):
    model = tiny_model("bert", head="classification")
    with pytest.raises(error, match=message):
        layerwise_param_groups(model, **{"lr": 1e-3, **options})
    assert all(param.requires_grad for param in model.parameters())


def test_unknown_family_is_refused():
    model = AlbertModel(AlbertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64))
    with pytest.raises(attnreg.UnsupportedModelError, match="AlbertModel"):
        layerwise_param_groups(model, lr=1e-3)
    with pytest.raises(ValueError, match="decay must be"):
        LayerwiseLR(lr=1e-3, decay=2.0)
    with pytest.raises(ValueError, match="not a torch.optim optimizer"):
        LayerwiseLR(lr=1e-3, optimizer="Adamw")


def classification_batches(count, seed=0):
    batches = []
    for index in range(count):
        batch = padded_batch(batch=4, length=8, seed=seed + index)
        batch["labels"] = (batch["input_ids"][:, 0] % 2).long()
        batches.append(batch)
    return batches


def test_layerwise_lr_callback_logs_named_groups_and_follows_its_schedule(tmp_path):
    steps, lr, decay = 6, 1e-3, 0.5
    module = Wrapped(tiny_model("bert", head="classification"))
    schedule = Warmup(0.5, Linear(1.0, 0.0))
    callback = LayerwiseLR(lr=lr, decay=decay, weight_decay=0.01, schedule=schedule)
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, LearningRateMonitor(logging_interval="step")],
    )
    trainer.fit(module, DataLoader(classification_batches(steps), batch_size=None))
    with open(f"{trainer.logger.log_dir}/metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("lr-AdamW/head")]
    assert len(rows) == steps
    factors = {"embeddings": decay**4, "layer0": decay**3, "layer1": decay**2, "head": 1.0}
    for step, row in enumerate(rows):
        for group, factor in factors.items():
            for name in (group, f"{group}/no_decay"):
                assert float(row[f"lr-AdamW/{name}"]) == pytest.approx(lr * factor * schedule(step / steps), rel=1e-6)
    assert "configure_optimizers" not in module.__dict__  # the module is as before after fit


def test_freeze_layers_for_one_epoch_then_train_them():
    module = Wrapped(tiny_model("distilbert", head="classification"))
    watched = {
        "embeddings": module.model.distilbert.embeddings.word_embeddings.weight,
        "layer0": module.model.distilbert.transformer.layer[0].ffn.lin1.weight,
        "layer1": module.model.distilbert.transformer.layer[1].ffn.lin1.weight,
    }
    snapshots = [{name: param.detach().clone() for name, param in watched.items()}]

    class Snapshot(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            snapshots.append({name: param.detach().clone() for name, param in watched.items()})

    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[LayerwiseLR(lr=1e-2), FreezeLayers(["embeddings", 0], epochs=1), Snapshot()],
    )
    trainer.fit(module, DataLoader(classification_batches(2), batch_size=None))
    assert trainer.global_step == 4 and len(snapshots) == 3
    assert torch.equal(snapshots[1]["embeddings"], snapshots[0]["embeddings"])
    assert torch.equal(snapshots[1]["layer0"], snapshots[0]["layer0"])
    assert not torch.equal(snapshots[1]["layer1"], snapshots[0]["layer1"])
    assert not torch.equal(snapshots[2]["embeddings"], snapshots[1]["embeddings"])
    assert not torch.equal(snapshots[2]["layer0"], snapshots[1]["layer0"])
    assert all(param.requires_grad for param in module.parameters())


def test_freeze_layers_refuses_parameters_outside_the_optimizer():
    module = Wrapped(tiny_model("bert", head="classification"))
    with pytest.raises(ValueError, match="are not in any optimizer, so they would never train"):
        conftest.fit(module, classification_batches(1), [LayerwiseLR(lr=1e-3, freeze=[0]), FreezeLayers([0], epochs=1)])
