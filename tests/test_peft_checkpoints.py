"""Checkpoints of PEFT LoRA models (issue 38.1): a run saves at every other step and a resumed run ends on the
uninterrupted run's weights exactly, through `AttnRegTrainer` on a `get_peft_model` model, TRL's `SFTTrainer`
with a `peft_config`, and Lightning with a LoRA model inside the module."""

import lightning as L
import pytest
import torch
from conftest import Classifier, sgd_arguments
from torch.utils.data import DataLoader

import attnreg
from attnreg import methods
from attnreg.integrations.hf import AttnRegTrainer
from attnreg.tiny import tiny_model

peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[peft]')")


def examples(count: int, length: int = 8, vocab: int = 99) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(3, vocab, (count, length), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "attention_mask": torch.ones(length, dtype=torch.long), "labels": row} for row in ids]


class Stream(torch.utils.data.IterableDataset):
    """Fixed examples in a fixed order, so a resumed run sees what the uninterrupted one saw."""

    def __init__(self, count: int):
        self.items = examples(count)

    def __iter__(self):
        return iter(self.items)


TARGETS = ["gate_proj", "up_proj", "down_proj"]  # beside the attention: heads can be gated and removed


def lora_model():
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    return peft.get_peft_model(tiny_model("llama", head="causal_lm").train(), config)


def chosen():
    """A term, and gates (trained beside the adapter, not in PEFT's adapter file) with a removal at the end."""
    return [
        methods.EntropyRegularizer(weight=1.0, mode="max", layers=[1]),  # layer 0 reads no adapter
        methods.HeadGating(methods.L1Gates(weight=0.5), methods.Removal(keep=6)),
    ]


def trained(trainer) -> dict[str, torch.Tensor]:
    """Every weight (the base's too: gates fold into them at the removal)."""
    return {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}


def assert_same(resumed: dict, whole: dict) -> None:
    assert resumed.keys() == whole.keys() and any("lora_" in name for name in whole)
    for name, value in whole.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-6, msg=name)


def test_trainer_on_a_peft_model_saves_and_resumes_exactly(tmp_path):
    def run(folder, resume=None):
        args = sgd_arguments(folder, max_steps=4, learning_rate=0.05, save_strategy="steps", save_steps=2)
        trainer = AttnRegTrainer(model=lora_model(), args=args, train_dataset=Stream(16), methods=chosen())
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = run(tmp_path / "whole")
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    assert (checkpoint / "attnreg_state.json").is_file() and (checkpoint / "optimizer.pt").is_file()
    resumed = run(tmp_path / "resumed", resume=str(checkpoint))
    assert_same(trained(resumed), trained(whole))


def test_sft_trainer_with_a_peft_config_saves_and_resumes_exactly(tmp_path):
    trl = pytest.importorskip("trl", reason="trl is not installed")
    datasets = pytest.importorskip("datasets", reason="datasets is not installed")
    from attnreg.app.task import build_tokenizer, vocabulary
    from attnreg.integrations.hf import with_attnreg

    def run(folder, resume=None):
        torch.manual_seed(0)
        args = trl.SFTConfig(
            str(folder), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, use_cpu=True, bf16=False,
            save_strategy="steps", save_steps=2, report_to=[], disable_tqdm=True, seed=0, optim="sgd",
            lr_scheduler_type="constant", max_grad_norm=0.0, remove_unused_columns=False,
            dataset_kwargs={"skip_prepare_dataset": True},
        )  # fmt: skip
        tokens = build_tokenizer(vocabulary())
        rows = [{key: value.tolist() for key, value in example.items()} for example in examples(16, vocab=len(tokens))]
        trainer = with_attnreg(trl.SFTTrainer)(
            model=tiny_model("llama", head="causal_lm", vocab=len(tokens)).train(),
            processing_class=tokens,
            args=args,
            train_dataset=datasets.Dataset.from_list(rows),
            data_collator=collate,
            peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0),
            methods=chosen(),
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = run(tmp_path / "whole")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-2"))
    assert_same(trained(resumed), trained(whole))


def collate(rows):
    return {key: torch.tensor([row[key] for row in rows]) for key in ("input_ids", "attention_mask", "labels")}


def test_lightning_with_a_lora_model_saves_and_resumes_exactly(tmp_path):
    data = examples(8)

    def run(max_steps, resume=None):
        module = Classifier(lora_model(), lr=0.05)
        module.configure_optimizers = lambda: torch.optim.SGD([p for p in module.parameters() if p.requires_grad], 0.05)
        trainer = L.Trainer(
            max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=tmp_path,
            callbacks=[attnreg.EntropyRegularizer(weight=1.0, mode="max", layers=[1]),
                       attnreg.HeadGating(methods.L1Gates(weight=0.5), methods.Removal(keep=6)),
                       L.pytorch.callbacks.ModelCheckpoint(tmp_path, "step{step}", every_n_train_steps=2,
                                                           save_top_k=-1, auto_insert_metric_name=False)],
        )  # fmt: skip
        trainer.fit(module, DataLoader(data, batch_size=4), ckpt_path=resume)  # the checkpoint ends epoch 0
        return {name: value.detach().clone() for name, value in module.state_dict().items()}

    whole = run(4)
    resumed = run(4, resume=str(tmp_path / "step2.ckpt"))
    assert_same(resumed, whole)
