"""Write the folders an older attnreg saved, for `tests/test_structure_record.py`: run with that release's code.

Each folder is a tiny pruned model as that release saved it, with `expected.safetensors` beside it: `input_ids`
and `output` (the model's first output for them, in eval mode), which today's loaders must reproduce.

    git archive 0ee0229 attnreg | tar -x -C /tmp/attnreg_0.1.0      # 0.1.0 (CHANGELOG: 2026-12-01)
    PYTHONPATH=/tmp/attnreg_0.1.0 .venv/bin/python tests/data/make_old_folders.py 0.1.0
    git archive b97bdc4 attnreg | tar -x -C /tmp/attnreg_0.2.0      # 0.2.0 ("Release 0.2.0")
    PYTHONPATH=/tmp/attnreg_0.2.0 .venv/bin/python tests/data/make_old_folders.py 0.2.0

0.1.0: `save_pruned` of a BERT with heads removed and of a Llama whose grouped-query rule silenced a head (0.1.0
zeroed its columns and recorded nothing), and a GPT-2 classifier's Lightning checkpoint (`add_pruning_to_checkpoint`,
the model under `model.`, as `SequenceClassifier` saved it) with the config it started from. 0.2.0:
`save_pruned` of a Llama with a silenced head and a hard-concrete gate, and a Hugging Face `Trainer` checkpoint
folder as `AttnRegTrainer` wrote it (unfolded weights, the runner's `attnreg_structure.json` and the spec).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

import attnreg
from attnreg.tiny import tiny_model

HERE = Path(__file__).resolve().parent / "previous_release"
SIZES = dict(hidden=16, layers=2, heads=4, vocab=32, positions=16)  # the smallest the tiny configs take
IDS = torch.tensor([[3, 7, 1, 30, 12, 5]])


def expect(model: torch.nn.Module, folder: Path) -> None:
    """Write `expected.safetensors`: the input ids and the model's first output for them."""
    with torch.no_grad():
        output = model.eval()(input_ids=IDS)[0]
    save_file({"input_ids": IDS, "output": output.contiguous()}, folder / "expected.safetensors")


def release_0_1_0(out: Path) -> None:
    from attnreg.pruning import add_pruning_to_checkpoint, prune_heads, save_pruned

    bert = tiny_model("bert", **SIZES)
    prune_heads(bert, {0: [1, 3], 1: [0]})
    expect(bert, save_pruned(bert, out / "bert_pruned"))
    llama = tiny_model("llama", head="causal_lm", **SIZES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prune_heads(llama, {0: [0, 1, 2]})  # group (0, 1) goes; head 2 shares its key/value head with 3: silenced
    expect(llama, save_pruned(llama, out / "llama_pruned_silenced"))
    gpt2 = tiny_model("gpt2", head="classification", **SIZES)  # as attnreg.modules.SequenceClassifier holds it
    folder = out / "gpt2_lightning"
    gpt2.config.save_pretrained(folder)  # the config the checkpoint's run started from (`attnreg-analyze --base`)
    prune_heads(gpt2, {1: [0, 2]})
    checkpoint = {"state_dict": {f"model.{key}": value for key, value in gpt2.state_dict().items()}}
    add_pruning_to_checkpoint(gpt2, checkpoint)  # what 0.1.0's modules wrote in on_save_checkpoint
    torch.save(checkpoint, folder / "last.ckpt")
    expect(gpt2.transformer, folder)  # the body: two labels' logits would say little


def release_0_2_0(out: Path) -> None:
    from attnreg import methods
    from attnreg.hub import attach, unfolded_saves
    from attnreg.methods.pruning import make_hard_concrete, prune_heads, save_pruned

    llama = tiny_model("llama", head="causal_lm", **SIZES)
    prune_heads(llama, {0: [0, 1, 2]})
    gate = make_hard_concrete(attach(llama), 1, initial_log_alpha=0.5, temperature=0.5)
    with torch.no_grad():
        gate.log_alpha.copy_(torch.tensor([2.0, -1.0, 0.25, 3.0]))
    expect(llama, save_pruned(llama, out / "llama_hard_concrete"))
    model = tiny_model("llama", head="causal_lm", seed=1, **SIZES)
    runner = methods.Runner([methods.HeadGating(methods.L1Gates(), layers=[1])])
    runner.bind(model)
    prune_heads(model, {0: [2, 3]})
    with torch.no_grad():
        attach(model).gate(1).copy_(torch.tensor([1.0, 0.5, 0.0, 2.0]))
    folder = out / "llama_trainer_checkpoint"
    with unfolded_saves(model):  # as AttnRegTrainer.save_model writes a checkpoint
        model.save_pretrained(folder)
    runner.save_structure(folder)
    expect(model, folder)


def main(release: str) -> None:
    if Path(attnreg.__file__).resolve().is_relative_to(HERE.parents[2]):
        sys.exit(f"attnreg comes from {attnreg.__file__}: put the {release} code first on PYTHONPATH")
    writers = {"0.1.0": release_0_1_0, "0.2.0": release_0_2_0}
    writers[release](HERE / release)


if __name__ == "__main__":
    main(sys.argv[1])
