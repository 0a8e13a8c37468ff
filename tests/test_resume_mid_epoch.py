"""A run resumed from a mid-epoch `last.ckpt` (`trainer.val_check_interval` < an epoch) ends on the weights of the
uninterrupted run, through the app's own entry (`attnreg.app.train.train`): for a decoder task and the classification
default, without attnreg (`attnreg=none`) and with the default prior, and with dropout on (random draws continue as
the uninterrupted run's did). Float32 on the CPU, deterministic."""

from pathlib import Path
from unittest import mock

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from test_train_app import QUIET, composed
from torch.utils.data.distributed import DistributedSampler

from attnreg.app.datamodules import EpochSampler, ResumableLoader
from attnreg.app.models import tiny_classifier
from attnreg.app.train import train

# 6 training batches an epoch, 2 epochs; a validation (and last.ckpt) every 4 batches and at each epoch's end
RUN = [*QUIET, "~logger", "trainer.max_epochs=2", "+trainer.val_check_interval=4", "data.batch_size=8"]
TASKS = {
    "classification": ["data.train=48", "data.val=8", "data.test=8", "data.hard=8"],
    "decoder": ["data=agreement_lm", "data.train=48", "data.val=8", "generate_tokens=2"],
}
STOP_AT = 11  # global step: epoch 1, batch 5 of 6; the last checkpoint is of step 10, mid-epoch
DROPOUT = ["model._target_=test_resume_mid_epoch.dropout_classifier"]


def dropout_classifier(*args, **kwargs):
    """The app's tiny classifier (`model=tiny_bert`) with dropout 0.2 in every dropout layer."""
    model = tiny_classifier(*args, **kwargs)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.2
    return model


class Record(L.Callback):
    """The input ids each optimizer step trains on, by step, and the weights training ends on; raises after
    `stop_at` optimizer steps (an interrupted run)."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.seen, self.stop_at, self.final = {}, stop_at, None

    def on_train_batch_start(self, trainer, module, batch, index):
        self.seen[trainer.global_step] = batch["input_ids"].clone()

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.stop_at:
            raise RuntimeError("interrupted")

    def on_train_end(self, trainer, module):
        self.final = {name: value.clone() for name, value in module.state_dict().items()}


def run(cfg: DictConfig, folder: Path, record: Record) -> None:
    """`train(cfg, folder)` with `record` among the trainer's callbacks."""

    def with_record(node, *args, **kwargs):
        if "callbacks" in kwargs and node is cfg.trainer:
            kwargs["callbacks"] = [*kwargs["callbacks"], record]
        return instantiate(node, *args, **kwargs)

    with mock.patch("attnreg.app.train.instantiate", side_effect=with_record):
        train(cfg, folder)


@pytest.mark.parametrize(
    "task, method, options",
    [
        ("classification", "none", []),
        ("classification", "syntax_prior_kl", []),
        ("decoder", "none", []),
        ("decoder", "syntax_prior_kl", []),
        ("classification", "syntax_prior_kl", DROPOUT),
    ],
    ids=["classification-none", "classification-prior", "decoder-none", "decoder-prior", "classification-dropout"],
)
def test_a_run_resumed_mid_epoch_ends_on_the_weights_of_the_uninterrupted_one(tmp_path, task, method, options):
    overrides = [*TASKS[task], *RUN, f"attnreg={method}", *options]
    whole, cut, resumed = Record(), Record(stop_at=STOP_AT), Record()
    run(composed(*overrides), tmp_path / "whole", whole)
    with pytest.raises(RuntimeError, match="interrupted"):
        run(composed(*overrides), tmp_path / "cut", cut)
    last = tmp_path / "cut" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 10  # mid-way through the second epoch
    run(composed(*overrides, f"+ckpt_path={last}"), tmp_path / "cut", resumed)
    assert sorted(whole.seen) == list(range(12)) and sorted(resumed.seen) == [10, 11]
    for step, ids in resumed.seen.items():
        assert torch.equal(ids, whole.seen[step]), f"step {step} trained on other batches"
    assert whole.final.keys() == resumed.final.keys()
    for key, value in whole.final.items():
        torch.testing.assert_close(resumed.final[key], value, rtol=0, atol=1e-6, msg=key)


SAMPLERS = {
    "epoch": lambda: EpochSampler(12, seed=3),  # leaves the batches out of its order
    "distributed": lambda: DistributedSampler(range(12), num_replicas=2, rank=1, seed=3),  # drawn and dropped
}


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_the_training_loader_resumes_twice_in_an_epoch_and_from_the_next_after_its_end(sampler, workers):
    def loader(epoch: int = 1) -> ResumableLoader:
        made = ResumableLoader(range(12), batch_size=2, sampler=SAMPLERS[sampler](), num_workers=workers)
        made.sampler.set_epoch(epoch)  # as Lightning does before the first batch
        return made

    def batches(source) -> list[list[int]]:
        return [batch.tolist() for batch in source]

    whole = batches(loader())
    first = loader()
    first_batches = iter(first)
    seen = [next(first_batches).tolist()]
    second = loader()
    second.load_state_dict(first.state_dict())
    second_batches = iter(second)
    seen.append(next(second_batches).tolist())
    third = loader()
    third.load_state_dict(second.state_dict())
    assert third.state_dict() == {"epoch": 1, "batches": 2}  # as loaded, before it iterates
    seen += batches(third)
    assert seen == whole and len(whole) == len(third)
    assert third.state_dict() == {"epoch": 2, "batches": 0}  # the epoch ended: the next one from its start
    fourth = loader(epoch=2)
    fourth.load_state_dict(third.state_dict())
    assert batches(fourth) == batches(loader(epoch=2)) != whole
    stale = loader(epoch=2)  # a state of another epoch than the one iterated leaves nothing out
    stale.load_state_dict({"epoch": 1, "batches": 3})
    assert batches(stale) == batches(loader(epoch=2))
