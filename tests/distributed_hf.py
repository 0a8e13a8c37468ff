"""Run by `torchrun --nproc_per_node 2` from tests/test_distributed.py: `AttnRegTrainer` under DDP (gloo, CPU).
Writes each rank's final weights, removed heads and logged losses to `<out>/rank<r>.pt`; with `one` as second
argument, trains in one process on the same global batches instead."""

import sys
from pathlib import Path

import torch
from conftest import sgd_arguments  # the tests' folder is on the path: this script runs from it

from attnreg import methods
from attnreg.integrations.hf import AttnRegTrainer
from attnreg.tiny import tiny_model

STEPS = 3


def examples():
    ids = torch.randint(3, 99, (4 * STEPS, 8), generator=torch.Generator().manual_seed(2))
    return [{"input_ids": row, "attention_mask": torch.ones(8, dtype=torch.long), "labels": row} for row in ids]


def main(out: Path, one: bool) -> None:
    args = sgd_arguments(
        out / "run",
        max_steps=STEPS,
        per_device_train_batch_size=4 if one else 2,
        learning_rate=0.1,
        logging_steps=1,
        ddp_backend=None if one else "gloo",
    )
    gating = methods.HeadGating(methods.L1Gates(weight=0.5), methods.Removal(keep=5))
    chosen = [methods.EntropyRegularizer(weight=1.0, mode="max"), gating]
    trainer = AttnRegTrainer(
        model=tiny_model("gpt2", head="causal_lm").train(), args=args, train_dataset=examples(), methods=chosen
    )
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    state = {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}
    rank = trainer.args.process_index
    torch.save(
        {"weights": state, "removed": gating.removed, "losses": losses}, out / f"{'one' if one else 'rank'}{rank}.pt"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), len(sys.argv) > 2 and sys.argv[2] == "one")
