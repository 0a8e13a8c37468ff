"""CoLA and SST-2 readers on the real files, clear errors on malformed ones; SequenceClassifier in a real fit."""

from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import padded_batch
from torch.utils.data import DataLoader

from attnreg.app.datasets import read_cola, read_sst2
from attnreg.app.modules import SequenceClassifier
from attnreg.syntax import PRIOR_KEY
from attnreg.tiny import tiny_model

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_data = pytest.mark.skipif(not (DATA / "cola").is_dir(), reason=f"CoLA and SST-2 not found under {DATA}")


@needs_data
def test_reads_cola_and_sst2():
    texts, labels = read_cola(DATA / "cola", "train")
    assert len(texts) == len(labels) == 8551 and set(labels) == {0, 1}
    assert texts[0].startswith("Our friends won't buy this analysis")
    assert len(read_cola(DATA / "cola" / "raw", "dev")[0]) == 527
    texts, labels = read_sst2(DATA / "sst2", "dev")
    assert len(texts) == 872 and sum(labels) == 444


def test_malformed_and_missing_files_are_named(tmp_path):
    (tmp_path / "in_domain_train.tsv").write_text("gj04\t1\t\tFine.\ngj04\tyes\t\tBad label.\n")
    with pytest.raises(ValueError, match=r"in_domain_train.tsv:2: expected 4 tab-separated fields with label 0 or 1"):
        read_cola(tmp_path, "train")
    with pytest.raises(FileNotFoundError, match="in_domain_dev.tsv does not exist"):
        read_cola(tmp_path, "dev")
    with pytest.raises(ValueError, match="split must be one of"):
        read_sst2(tmp_path, "test")
    (tmp_path / "train.tsv").write_text("text\tlabel\nfine\t1\n")
    with pytest.raises(ValueError, match=r"train.tsv:1: expected the header"):
        read_sst2(tmp_path, "train")


def test_sequence_classifier_learns_and_keeps_extra_keys_from_the_model():
    torch.manual_seed(0)
    model = tiny_model("bert", head="classification").eval()  # as from_pretrained returns it
    batches = []
    for seed in range(4):
        batch = padded_batch(batch=16, length=8, seed=seed)
        batch["labels"] = (batch["input_ids"][:, 0] > 50).long()
        batch[PRIOR_KEY] = torch.full(batch["input_ids"].shape, -1)  # not a model input
        batches.append(batch)
    module = SequenceClassifier(model, lr=3e-3, warmup=0.0)
    assert model.training
    first = float(module(batches[0]).loss)
    trainer = L.Trainer(
        max_epochs=15, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(module, DataLoader(batches, batch_size=None), DataLoader(batches, batch_size=None))
    assert float(trainer.callback_metrics["val/loss"]) < 0.5 * first
    assert float(trainer.callback_metrics["val/acc"]) > 0.9 and "val/mcc" in trainer.callback_metrics
