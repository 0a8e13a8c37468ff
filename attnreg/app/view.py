"""`python -m attnreg.app.view RUN_DIR`: the head view of an `attnreg-train` run, the model it ended with (the one its
summary evaluated: the model it saved, else its last checkpoint) beside the model it started from, on the run's
held-out sentences with gold trees, its supervised heads marked.

A run that trained a LoRA adapter (`peft=lora`) is viewed with the adapter merged into the base model
(`merge_and_unload`), as its `merged_model/` holds it.

`make demo` trains the default run (the built-in agreement task, the syntax prior on head 0 of every layer) into
`outputs/demo` and writes `outputs/demo/head_view.html` this way. The run folder is Hydra's: `.hydra/config.yaml`
rebuilds the data and the model as the run began, `summary.json` names the saved model and the heads the syntax
prior supervised.

Example:
    >>> import sys, tempfile
    >>> from unittest import mock
    >>> from attnreg.app.train import main as train_main
    >>> run_dir = Path(tempfile.mkdtemp())
    >>> run = ["data.train=64", "data.val=32", "data.test=16", "data.hard=16", "trainer.max_epochs=1"]
    >>> quiet = ["trainer.enable_progress_bar=false", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    >>> with mock.patch.object(sys, "argv", ["attnreg-train", *run, *quiet, f"hydra.run.dir={run_dir}"]):
    ...     train_main()
    attnreg-train: ...
    >>> main([str(run_dir), "--sentences", "4"])
    head view of the supervised heads L0H0, L1H0 (4 sentences): .../head_view.html
    0
"""

from __future__ import annotations

import argparse
import copy
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnreg.app.cli import checked

with checked("python -m attnreg.app.view", exit=__name__ == "__main__"):  # without Lightning: the pip line
    from omegaconf import OmegaConf

    from attnreg.analysis import HeadView, head_view
    from attnreg.app.analyze import _load_checkpoint, load_folder
    from attnreg.app.configs import register_resolvers
    from attnreg.app.models import load_tokenizer
    from attnreg.app.tasks import Task, task_of
    from attnreg.hub import attach, detach
    from attnreg.structure import restore_record
    from attnreg.unwrap import transformers_model


def view_run(run_dir: str | Path, sentences: int = 32, trust_checkpoint: bool = False) -> tuple[HeadView, str]:
    """The head view of the run in `run_dir` (see the module docstring) on its first `sentences` held-out sentences,
    and the supervised heads as text (`L0H0, L1H0`)."""
    run_dir = Path(run_dir)
    config, summary_file = run_dir / ".hydra" / "config.yaml", run_dir / "summary.json"
    for needed in (config, summary_file):
        if not needed.is_file():
            raise FileNotFoundError(f"{needed} not found: give the folder of a finished attnreg-train run")
    register_resolvers()
    cfg = OmegaConf.load(config)
    summary = json.loads(summary_file.read_text())
    supervised: dict[int, list[int]] = {}  # the heads the summary reports as supervised: "L0H0", ...
    for name in (summary.get("parent_accuracy") or {}).get("supervised") or {}:
        layer, head = map(int, re.fullmatch(r"L(\d+)H(\d+)", name).groups())
        supervised.setdefault(layer, []).append(head)
    tokenizer = (
        load_tokenizer(cfg.model.name_or_path, cfg.model.get("gguf_file")) if "name_or_path" in cfg.model else None
    )
    task = task_of(cfg)
    data = task.data(cfg, tokenizer, with_prior=False)
    data.setup("fit")
    held_out = data.tree_sentences()
    if not held_out:
        raise ValueError(f"the data of {run_dir} ({cfg.data._target_}) has no held-out sentences with gold trees")
    start = task.model(cfg, data).eval()  # as the run began
    trained = trained_model(run_dir, summary, cfg, start, task, trust_checkpoint)
    view = head_view(
        trained.eval(),
        data.tokenizer,
        held_out[:sentences],
        compare=start,
        names=["trained", "at the start"],
        supervised=supervised,
        max_length=data.max_length,
        title=f"attnreg head view: {run_dir}",
    )
    heads = [f"L{layer}H{head}" for layer, chosen in supervised.items() for head in chosen]
    return view, ", ".join(heads) or "none"


SAVED_MODELS = ("pruning", "merged_model", "model")
"""Where a run's summary names the model it ended with, in order: `pruning.saved` (`pruned_model/`, with its adapter),
`merged_model/` (LoRA merged in), `model/` (`save_model`)."""


def trained_model(
    run_dir: Path, summary: dict, cfg: Any, start: Any, task: Task, trust_checkpoint: bool = False
) -> Any:
    """The model the run ended with, the one its summary evaluated: the folder it saved (`SAVED_MODELS`), else its
    `last.ckpt` (written at every validation), else its best checkpoint, on a copy of `start` (in the `task`'s LoRA
    adapter where the run trained one)."""
    for key in SAVED_MODELS:
        saved = (summary.get(key) or {}).get("saved") if key == "pruning" else summary.get(key)
        if saved and Path(saved).is_dir():
            return load_folder(Path(saved))
    last = run_dir / "checkpoints" / "last.ckpt"
    path = last if last.is_file() else Path(summary["checkpoint"]) if summary.get("checkpoint") else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"{run_dir} holds no model to view: no saved model ({', '.join(SAVED_MODELS)} in summary.json) and no "
            f"checkpoint ({last} or the best); run attnreg-train with save_model=true"
        )
    trained = copy.deepcopy(start)
    if cfg.get("peft"):  # the LoRA adapter the run trained, on the base model, as `attnreg-train` wrapped it
        trained = task.add_lora(trained, cfg)
    checkpoint = _load_checkpoint(path, trust_checkpoint)
    state = {key[len("model.") :]: value for key, value in checkpoint["state_dict"].items() if key.startswith("model.")}
    attach(trained)  # gates and temperatures in the state dict are created on load
    restore_record(transformers_model(trained), checkpoint)  # the transformers model, inside an adapter too
    trained.load_state_dict(state, strict=True)
    if cfg.get("peft"):  # viewed merged, as the run's merged_model/: gates folded into base and adapter, then merged
        detach(trained)
        trained = trained.merge_and_unload()
    return trained


def main(argv: Sequence[str] | None = None) -> int:
    """Write `RUN_DIR/head_view.html` (or `--out FILE`) and print its path."""
    parser = argparse.ArgumentParser(prog="python -m attnreg.app.view", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the Hydra run folder of an attnreg-train run")
    parser.add_argument("--out", help="the HTML file (default RUN_DIR/head_view.html)")
    parser.add_argument("--sentences", type=int, default=32, help="held-out sentences in the view")
    parser.add_argument("--trust-checkpoint", action="store_true", help="load a checkpoint that holds more than data")
    args = parser.parse_args(argv)
    view, heads = view_run(args.run_dir, args.sentences, args.trust_checkpoint)
    path = view.save(args.out or Path(args.run_dir) / "head_view.html")
    print(f"head view of the supervised heads {heads} ({len(view.documents)} sentences): {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
