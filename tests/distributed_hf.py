"""Run by `torchrun --nproc_per_node 2` from tests/test_distributed.py: `AttnRegTrainer` under DDP (gloo, CPU),
batches of 1 with 2 accumulation steps, heads removed at two milestones (mid-training, then the last step).
Writes each rank's final weights, removed heads, rounds and the number of rebuilt wrappers to
`<out>/rank<r>.pt`; with `one` among the arguments, trains in one process on the same global batches of 4. With
`uneven`: rows of different lengths (padded), the entropy term alone, no removal (issue 38.2)."""

import sys
from pathlib import Path

import torch
from conftest import sgd_arguments  # the tests' folder is on the path: this script runs from it

from attnreg import methods
from attnreg.integrations.hf import AttnRegTrainer
from attnreg.tiny import tiny_model

STEPS = 4


def examples(uneven: bool = False):
    ids = torch.randint(3, 99, (4 * STEPS, 8), generator=torch.Generator().manual_seed(2))
    rows = [{"input_ids": row, "attention_mask": torch.ones(8, dtype=torch.long), "labels": row} for row in ids]
    for index, row in enumerate(rows if uneven else ()):
        real = 2 + 3 * (index % 3)  # 2, 5 or 8 real tokens
        row["attention_mask"] = (torch.arange(8) < real).long()
        row["labels"] = row["labels"].masked_fill(row["attention_mask"] == 0, -100)
    return rows


def main(out: Path, one: bool, uneven: bool = False) -> None:
    args = sgd_arguments(
        out / "run",
        max_steps=STEPS,
        per_device_train_batch_size=4 if one else 1,
        gradient_accumulation_steps=1 if one else 2,
        learning_rate=0.1,
        optim_args="momentum=0.9",  # optimizer state, moved onto the fresh parameters
        logging_steps=1,
        ddp_backend=None if one else "gloo",
    )
    removal = methods.Removal(milestones=[(0.5, 6), (1.0, 5)])  # 8 heads: 6 after step 2, 5 after step 4
    gating = methods.HeadGating(methods.L1Gates(weight=0.5), removal)
    entropy = methods.EntropyRegularizer(weight=50.0 if uneven else 1.0, mode="max")  # uneven: a term that shows
    chosen = [entropy, *([] if uneven else [gating])]
    trainer = AttnRegTrainer(
        model=tiny_model("gpt2", head="causal_lm").train(), args=args, train_dataset=examples(uneven), methods=chosen
    )
    trainer.train()
    state = {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}
    result = {
        "weights": state,
        "removed": gating.removed,
        "rounds": [done.chosen for done in gating.rounds],
        "rewrapped": len(trainer._attnreg_replaced),
    }
    torch.save(result, out / f"{'one' if one else 'rank'}{trainer.args.process_index}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), "one" in sys.argv[2:], "uneven" in sys.argv[2:])
