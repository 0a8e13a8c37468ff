"""Refusals leave the user's model as it was, and a checkpoint of another model says so (issue 38,
"misleading"): against the model's own state before the refusal, in both adapters."""

import lightning as L
import pytest
import torch
from conftest import Classifier, sgd_arguments
from torch.utils.data import DataLoader

import attnreg
from attnreg import methods
from attnreg.hub import is_attached
from attnreg.integrations.hf import AttnRegTrainer
from attnreg.tiny import tiny_model


def examples(count: int = 8, vocab: int = 99) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(3, vocab, (count, 8), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "attention_mask": torch.ones(8, dtype=torch.long), "labels": row} for row in ids]


@pytest.mark.parametrize(
    "chosen, data, error",
    [
        ([methods.SyntaxPriorKL(heads={5: [0]})], examples(), r"heads=\{5: \[0\]\} names layers out of range"),
        ([methods.EntropyRegularizer(), methods.HeadGating(removal=methods.Removal(keep=100))], examples(), "keep"),
        ([methods.EntropyRegularizer()], [], "train_dataset is empty"),
    ],
    ids=["bad heads", "keep too large", "empty data"],
)
def test_a_refused_trainer_leaves_the_model_as_it_was(tmp_path, chosen, data, error):
    model = tiny_model("llama", head="causal_lm")
    implementation = model.config._attn_implementation
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises((ValueError, IndexError), match=error):
        AttnRegTrainer(model=model, args=sgd_arguments(tmp_path, max_steps=1), train_dataset=data, methods=chosen)
    assert not is_attached(model) and model.config._attn_implementation == implementation
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[name], before[name]) for name in before)
    assert all(method.model is None for method in chosen)


def test_resuming_a_trainer_from_another_models_checkpoint_says_so(tmp_path):
    def trainer(model, folder):
        args = sgd_arguments(folder, max_steps=2, save_strategy="steps", save_steps=2)
        return AttnRegTrainer(model=model, args=args, train_dataset=examples(), methods=[methods.EntropyRegularizer()])

    trainer(tiny_model("llama", head="causal_lm").train(), tmp_path / "a").train()
    other = trainer(tiny_model("llama", head="causal_lm", layers=3).train(), tmp_path / "b")
    with pytest.raises(ValueError, match=r"this checkpoint belongs to another model: .*num_hidden_layers 2 vs 3"):
        other.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))


def test_resuming_lightning_from_another_models_checkpoint_says_so(tmp_path):
    def fit(model, path=None):
        module = Classifier(model)
        trainer = L.Trainer(
            max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[attnreg.EntropyRegularizer()],
        )  # fmt: skip
        trainer.fit(module, DataLoader(examples(), batch_size=4), ckpt_path=path)
        return trainer

    fit(tiny_model("llama", head="causal_lm")).save_checkpoint(tmp_path / "a.ckpt")
    with pytest.raises(ValueError, match=r"this checkpoint belongs to another model: .*num_hidden_layers 2 vs 3"):
        fit(tiny_model("llama", head="causal_lm", layers=3), tmp_path / "a.ckpt")
