"""AttentionDropoutSchedule in real fits: the scheduled rate acts exactly like a config rate, eval is
untouched, and a run resumed from a checkpoint repeats the uninterrupted run (with LayerwiseLR too)."""

import copy

import conftest
import lightning as L
import pytest
import torch
from conftest import main_output, padded_batch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import attnreg
from attnreg.callbacks.dropout import AttentionDropoutSchedule
from attnreg.callbacks.optim import FreezeLayers, LayerwiseLR
from attnreg.methods.dropout import hidden_dropout_modules
from attnreg.schedules import CurriculumDropout, EarlyDropout, Linear, Step, Warmup
from attnreg.tiny import tiny_model

# Config keys a model reads its dropout rates from when it is built: (attention, hidden).
NATIVE_DROPOUT = {
    "bert": ("attention_probs_dropout_prob", ("hidden_dropout_prob",)),
    "distilbert": ("attention_dropout", ("dropout",)),
    "gpt2": ("attn_pdrop", ("resid_pdrop", "embd_pdrop")),
    "llama": ("attention_dropout", ()),
    "qwen2": ("attention_dropout", ()),
}


class Recorder(L.LightningModule):
    """Seeds every step by its number (so dropout masks repeat across runs) and records what it saw."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.records = []

    def training_step(self, batch, batch_idx):
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        torch.manual_seed(1000 + self.global_step)
        output = main_output(self.model(**inputs))
        self.model.eval()
        with torch.no_grad():
            evaluated = main_output(self.model(**inputs))
        self.model.train()
        hub = attnreg.hub_of(self.model)
        dropouts = {name: m.p for name, m in self.model.named_modules() if isinstance(m, torch.nn.Dropout)}
        self.records.append(
            dict(
                step=self.global_step,
                output=output.detach().clone(),
                evaluated=evaluated,
                attention=[hub.attention_dropout(layer) for layer in range(hub.num_layers)],
                dropouts=dropouts,
                lrs={group.get("name"): group["lr"] for group in self.trainer.optimizers[0].param_groups},
                loss=output.float().pow(2).mean().item(),
            )
        )
        return output.float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # weights stay as built: outputs can be rebuilt


@pytest.mark.parametrize("family", list(NATIVE_DROPOUT))
def test_scheduled_rates_act_like_config_rates_in_training_only(family):
    steps = 4
    attention_schedule, hidden_schedule = Linear(0.0, 0.6), Step([0.3, 0.1], [0.5])
    has_hidden = bool(NATIVE_DROPOUT[family][1])
    model = tiny_model(family)
    initial = copy.deepcopy(model.state_dict())
    module = Recorder(model)
    callback = AttentionDropoutSchedule(attention_schedule, hidden=hidden_schedule if has_hidden else None)
    trainer = conftest.fit(module, [padded_batch(seed=s) for s in range(steps)], [callback])

    attention_key, hidden_keys = NATIVE_DROPOUT[family]
    plain = tiny_model(family).eval()
    for record, seed in zip(module.records, range(steps), strict=True):
        progress = record["step"] / steps
        rate, hidden = attention_schedule(progress), hidden_schedule(progress)
        assert record["attention"] == [rate, rate]
        native = tiny_model(family, **{attention_key: rate, **dict.fromkeys(hidden_keys, hidden)})
        native.load_state_dict(initial)
        torch.manual_seed(1000 + record["step"])
        with torch.no_grad():
            expected = main_output(native.train()(**padded_batch(seed=seed)))
            reference = main_output(plain(**padded_batch(seed=seed)))
        assert torch.equal(record["output"], expected)
        assert torch.allclose(record["evaluated"], reference, atol=1e-6, rtol=0)
        if rate > 0:
            assert (record["output"] - reference).abs().max() > 1e-3
    assert trainer.callback_metrics["attnreg/attention_dropout_schedule"] == pytest.approx(attention_schedule(3 / 4))
    hub = attnreg.hub_of(model)
    assert [hub.attention_dropout(layer) for layer in range(2)] == [0.0, 0.0]  # the model's own, after fit
    if has_hidden:
        assert trainer.callback_metrics["attnreg/hidden_dropout"] == pytest.approx(0.1)
        hidden_names = names_of(model, hidden_dropout_modules(model, hub.family))
        for record in module.records:
            expected = hidden_schedule(record["step"] / steps)
            assert {name: p for name, p in record["dropouts"].items() if name in hidden_names} == dict.fromkeys(
                hidden_names, expected
            )
            assert {p for name, p in record["dropouts"].items() if name not in hidden_names} == {0.0}  # attention's
        assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))  # restored after fit


def names_of(model, modules):
    return {name for name, module in model.named_modules() if any(module is chosen for chosen in modules)}


PARTS = ("attention.output", "output")


def test_only_the_chosen_layers_follow_the_schedule():
    model = tiny_model("bert", layers=3, attention_probs_dropout_prob=0.05, hidden_dropout_prob=0.01)
    module = Recorder(model)
    callback = AttentionDropoutSchedule(0.2, layers=[0, 2], hidden=0.3)
    conftest.fit(module, [padded_batch(seed=s) for s in range(2)], [callback])
    assert [record["attention"] for record in module.records] == [[0.2, 0.05, 0.2]] * 2
    hidden = {name: p for name, p in module.records[0]["dropouts"].items() if not name.endswith("self.dropout")}
    inside = {f"encoder.layer.{i}.{part}.dropout": 0.3 if i != 1 else 0.01 for i in range(3) for part in PARTS}
    assert hidden == {"embeddings.dropout": 0.01, **inside}  # with layers=, only the chosen blocks' hidden dropout


def test_bad_settings_fail_before_training():
    batches = [padded_batch()]
    with pytest.raises(ValueError, match="LlamaModel has no nn.Dropout outside attention; leave hidden=None"):
        conftest.fit(Recorder(tiny_model("llama")), batches, [AttentionDropoutSchedule(0.1, hidden=0.1)])
    module = Recorder(tiny_model("gpt2"))
    message = r"gives 1.0 at step 2 of 4 \(progress 0.5\); a dropout rate must be in \[0, 1\)"
    with pytest.raises(ValueError, match=message):
        conftest.fit(module, batches * 4, [AttentionDropoutSchedule(Linear(0.0, 2.0))])
    assert module.records == []
    with pytest.raises(IndexError, match=r"layers=5 is out of range: GPT2Model has 2 attention layers"):
        conftest.fit(Recorder(tiny_model("gpt2")), batches, [AttentionDropoutSchedule(0.1, layers=[5])])
    evaluating = Recorder(tiny_model("distilbert").eval())  # as from_pretrained returns it; Lightning keeps it so
    with pytest.raises(RuntimeError, match=r"attention layers \[0, 1\] are in eval mode during training"):
        conftest.fit(evaluating, batches, [AttentionDropoutSchedule(0.1)])
    with pytest.raises(ValueError, match="total_steps must be >= 1"):
        AttentionDropoutSchedule(0.1, total_steps=0)


def resumable_trainer(tmp_path, callbacks, checkpoint=None):
    extra = [] if checkpoint is None else [checkpoint]
    return L.Trainer(
        max_steps=10,
        accelerator="cpu",
        logger=False,
        default_root_dir=tmp_path,
        enable_checkpointing=checkpoint is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        callbacks=[*callbacks(), *extra],
    )


def test_resumed_run_repeats_the_uninterrupted_run(tmp_path):
    """10 steps in 2 epochs of 5, checkpoint after step 5; resume it and compare steps 5-9."""
    batches = []
    for seed in range(5):
        batch = padded_batch(batch=4, length=8, seed=seed)
        batch["labels"] = (batch["input_ids"][:, 0] % 2).long()
        batches.append(batch)

    def callbacks():
        return [
            AttentionDropoutSchedule(EarlyDropout(0.3, cutoff=0.7, shape="linear"), hidden=CurriculumDropout(0.2, 5.0)),
            LayerwiseLR(lr=1e-2, decay=0.8, weight_decay=0.01, schedule=Warmup(0.2, Linear(1.0, 0.1))),
            FreezeLayers(["embeddings"], epochs=1),
        ]

    # Saved at the end of step 5 (every_n_epochs=1 would save in on_train_epoch_end, and Lightning 2.6 resumes
    # such a checkpoint with one extra pass over batch 0 before the next epoch: the data order would differ).
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=5, save_top_k=-1)
    uninterrupted = Recorder(tiny_model("bert", head="classification"))
    resumable_trainer(tmp_path, callbacks, checkpoint).fit(uninterrupted, DataLoader(batches, batch_size=None))
    resumed = Recorder(tiny_model("bert", head="classification"))
    resumable_trainer(tmp_path, callbacks).fit(
        resumed, DataLoader(batches, batch_size=None), ckpt_path=tmp_path / "step=5.ckpt"
    )

    assert [record["step"] for record in resumed.records] == list(range(5, 10))
    for first, again in zip(uninterrupted.records[5:], resumed.records, strict=True):
        assert again["attention"] == first["attention"] and again["dropouts"] == first["dropouts"]
        assert again["lrs"] == first["lrs"]
        assert again["loss"] == first["loss"]
    rates = [record["attention"][0] for record in uninterrupted.records]
    assert rates[0] == 0.3 and rates[7:] == [0.0] * 3 and len(set(rates)) == 8
    assert len({tuple(record["lrs"].values()) for record in uninterrupted.records}) == 10
    for name, param in resumed.named_parameters():
        assert torch.equal(param, dict(uninterrupted.named_parameters())[name]), name
