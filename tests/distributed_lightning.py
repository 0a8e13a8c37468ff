"""Run by `torchrun --nproc_per_node 2` from tests/test_distributed.py: attnreg's Lightning callbacks in two gloo
processes on CPU, batches of 2 per process; with `one` as second argument, the same in one process on the global
batches of 4. Writes `<out>/rank<r>.pt` (or `one0.pt`):

1. `DDPStrategy`, heads removed at two milestones, the first mid-training (fresh parameters, Lightning's DDP
   wrapper rebuilt): the weights, the rounds, how many times the wrapper was rebuilt.
2. `ModelParallelStrategy`, FSDP2 (`fully_shard`) in `configure_model`, the penalty logged with sync_dist, heads
   removed at the end (gathered; rank 0 prunes an unsharded copy), a distributed checkpoint at step 2; then a
   second fit resumed from it: the full weights of both, the removed heads, rank 0's pruned copies.
"""

import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from attnreg import callbacks, methods
from attnreg.hub import hub_of
from attnreg.mixin import AttnRegMixin
from attnreg.tiny import tiny_model

STEPS = 4


class Classifier(AttnRegMixin, L.LightningModule):
    def __init__(self, shard: bool = False):
        super().__init__()
        self.model = tiny_model("bert", head="classification").train()  # 2 layers x 4 heads
        self.shard = shard

    def configure_model(self):
        """After the callbacks' setup (gates made): gates set apart, so that float noise cannot swap two heads'
        ranks (they would tie within 1e-6 after a few steps); then FSDP2 on each block and the model."""
        with torch.no_grad():
            for layer, gate in hub_of(self.model).gates.items():
                gate.copy_(torch.tensor([[1.0, 0.7, 0.9, 0.6], [0.8, 1.0, 0.65, 0.95]][layer]))
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            for layer in self.model.bert.encoder.layer:
                fully_shard(layer)
            fully_shard(self.model)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Wrappers(L.Callback):
    """Counts the distinct wrappers the strategy trained through."""

    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, *args):
        if not any(model is trainer.strategy.model for model in self.seen):
            self.seen.append(trainer.strategy.model)

    def on_train_end(self, trainer, *args):
        self.on_train_batch_start(trainer)


def data(one: bool) -> DataLoader:
    """One batch an epoch: 4 rows in one process; 2 in each of two, rank r taking rows r and r + 2 (Lightning's
    own distributed sampler would shuffle them). One batch, so that a resumed run sees what the uninterrupted
    one saw (Lightning restarts from its first batch an epoch it takes as unfinished)."""
    ids = torch.randint(3, 99, (4, 8), generator=torch.Generator().manual_seed(3))
    labels = torch.arange(4) % 2
    rows = [{"input_ids": row, "labels": label} for row, label in zip(ids, labels, strict=True)]
    if one:
        return DataLoader(rows, batch_size=4)
    sampler = DistributedSampler(rows, num_replicas=2, rank=int(os.environ["RANK"]), shuffle=False)
    return DataLoader(rows, batch_size=2, sampler=sampler)


def trainer(one: bool, strategy, extra=(), **options) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1 if one else 2,
        strategy="auto" if one else strategy,
        max_steps=STEPS,
        callbacks=list(extra),
        logger=False,
        enable_checkpointing=bool(extra) and any(isinstance(c, ModelCheckpoint) for c in extra),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        **options,
    )


def full(module: Classifier) -> dict[str, torch.Tensor]:
    def whole(value):
        return value.full_tensor() if hasattr(value, "full_tensor") else value

    return {name: whole(value).detach().clone() for name, value in module.model.state_dict().items()}


def gating(removal: methods.Removal) -> callbacks.HeadGating:
    return callbacks.HeadGating(methods.L1Gates(weight=0.5), removal)


def main(out: Path, one: bool) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    result = {}

    gates, wrappers = gating(methods.Removal(milestones=[(0.5, 6), (1.0, 5)])), Wrappers()
    ddp = trainer(one, "ddp", [callbacks.EntropyRegularizer(weight=1.0, mode="max"), gates, wrappers])
    module = Classifier()
    ddp.fit(module, data(one))
    result |= {
        "ddp_weights": full(module),
        "ddp_rounds": [done.chosen for done in gates.method.rounds],
        "ddp_rewrapped": len(wrappers.seen) - 1,
    }

    def sharded(extra, resume=None):
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        gates = gating(methods.Removal(keep=5))
        fit = trainer(one, strategy, [callbacks.EntropyRegularizer(weight=1.0, mode="max"), gates, *extra])
        module = Classifier(shard=not one)
        fit.fit(module, data(one), ckpt_path=resume)
        return fit, module, gates.method

    saving = ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=2, save_top_k=-1)
    fit, module, method = sharded([saving])
    pruned = module.model if one else method.gathered  # one process: pruned in place
    result |= {
        "sharded_weights": full(module),
        "sharded_removed": method.removed,
        "sharded_pruned": None if pruned is None else pruned.state_dict(),
        "logged": sorted(fit.callback_metrics),
    }
    if not one:
        fit, module, method = sharded([], resume=str(out / "checkpoints" / "epoch=1-step=2.ckpt"))
        result |= {
            "resumed_weights": full(module),
            "resumed_removed": method.removed,
            "resumed_pruned": None if method.gathered is None else method.gathered.state_dict(),
        }
    torch.save(result, out / f"{'one' if one else 'rank'}{fit.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), len(sys.argv) > 2 and sys.argv[2] == "one")
