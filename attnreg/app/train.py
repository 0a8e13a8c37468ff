"""The Hydra training app: `attnreg-train` fine-tunes a model with attnreg callbacks from `configs/`.

With no arguments it fine-tunes a tiny random BERT on the built-in agreement task (`attnreg.app.task`)
with the syntax prior on head 0 of every layer for 40 epochs. The pretrained models (`model=minilm`,
`model=hub`) default to plain fine-tuning for 3 epochs instead: add a regularizer with `attnreg=...`.
Experiment presets choose theirs through the `attnreg` group too, so `attnreg=none` on the command
line always gives the baseline. A run first logs one line saying what is on (model, data, seed, length,
each attnreg callback with its settings), then prints a summary at the end: accuracy on held-out
sentences and on the hard split (2 distractor verbs), the supervised heads' parent accuracy,
attention entropy per layer, and the heads pruned when pruning ran. Everything goes to Hydra's run
folder: `train.log`, `metrics.csv` (or TensorBoard events), `checkpoints/best.ckpt`, `summary.json`,
and `pruned_model/` when heads were removed.

The model configs name the factories of `attnreg.app.models`; the summary's numbers come from
`attnreg.app.evaluation`. A callback says what it needs from the data with a class attribute `needs`
(see `NEEDS`): the syntax prior in the batches, held-out gold trees, the tokenizer. For instance:

    $ attnreg-train                                       # the default run (about 30 s on 2 cores)
    $ attnreg-train attnreg=none                          # the same without the prior
    $ attnreg-train -m attnreg.syntax_prior_kl.weight=0,1 seed=0,1,2
    $ attnreg-train experiment=cola_minilm attnreg=none   # a preset's baseline
    $ attnreg-train model=minilm data=cola attnreg=[syntax_prior_kl,entropy_regularizer] trainer.max_steps=200
    $ attnreg-train trainer=ddp                           # 2 CPU processes (gloo)

The example runs `attnreg-train attnreg=none` on less data for 1 epoch, in-process, into a temporary folder.

Example:
    >>> import sys
    >>> import tempfile
    >>> from unittest import mock
    >>> run_dir = Path(tempfile.mkdtemp())
    >>> run = ["attnreg=none", "data.train=64", "data.val=32", "data.test=32", "data.hard=32", "trainer.max_epochs=1"]
    >>> quiet = ["trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1"]
    >>> hydra_options = [f"hydra.run.dir={run_dir}", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    >>> with mock.patch.object(sys, "argv", ["attnreg-train", *run, *quiet, *hydra_options]):
    ...     main()
    attnreg-train: tiny_bert on agreement, seed 0, 2 steps in ... s
    callbacks: none
    accuracy: val ..., test ..., hard ...  (test: 0-1 distractor verbs as in training; hard: 2)
    attention entropy per layer (normalized): ..., ...
    parent accuracy on 32 held-out sentences: supervised none; best head ...; right-branching ...
    heads pruned: none
    outputs: ...
    >>> sorted(path.name for path in run_dir.iterdir())   # Hydra's run folder (train.log with job_logging)
    ['.hydra', 'checkpoints', 'csv', 'summary.json']
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig
from transformers import PreTrainedModel

from attnreg.app.configs import register_resolvers
from attnreg.app.models import load_tokenizer
from attnreg.app.settings import attnreg_settings, needs_of, provide, warn_renamed
from attnreg.app.summary import describe_run, format_summary, metric, summarize
from attnreg.families import detect_family
from attnreg.methods.pruning import pruned_heads, save_pruned
from attnreg.syntax.data import SyntaxCollator

log = logging.getLogger(__name__)


# -- the run -----------------------------------------------------------------------------------------
def train(cfg: DictConfig, output_dir: str | Path, choices: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """Fit as `cfg` says and return the summary (also written to `output_dir/summary.json`); None on
    ranks other than 0. `choices` (Hydra's config-group choices) go into the summary.

    Example:
        >>> import tempfile
        >>> from attnreg.app.configs import CONFIG_DIR
        >>> small = ["data.train=64", "data.val=32", "data.test=32", "data.hard=32", "trainer.max_epochs=1"]
        >>> quiet = ["trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1"]
        >>> with hydra.initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):   # the default run, shortened
        ...     cfg = hydra.compose("train", small + quiet)
        >>> output_dir = Path(tempfile.mkdtemp())
        >>> summary = train(cfg, output_dir)                         # prints format_summary(summary)
        attnreg-train: run, seed 0, 2 steps in ... s
        callbacks: syntax_prior_kl (SyntaxPriorKL)
        accuracy: val ..., test ..., hard ...  (test: 0-1 distractor verbs as in training; hard: 2)
        attention entropy per layer (normalized): ..., ...
        parent accuracy on 32 held-out sentences: supervised L0H0 ..., L1H0 ...; best head ...; right-branching ...
        syntax prior: ... arcs in ... sentences, 0 without a prior (0.0%: truncated, or sharing a token)
        heads pruned: none
        outputs: ...
        >>> summary["steps"], sorted(summary["accuracy"]), summary["parent_accuracy"]["supervised"].keys()
        (2, ['hard', 'test', 'val'], dict_keys(['L0H0', 'L1H0']))
        >>> sorted(path.name for path in output_dir.iterdir()), Path(summary["checkpoint"]).name
        (['checkpoints', 'csv', 'summary.json'], 'best.ckpt')
    """
    register_resolvers()  # for callers that composed `cfg` themselves
    output_dir = Path(output_dir)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    if cfg.get("threads"):
        torch.set_num_threads(cfg.threads)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    callbacks = {name: instantiate(node, _convert_="all") for name, node in attnreg_settings(cfg).items()}
    needs = frozenset().union(*(needs_of(callback) for callback in callbacks.values()))
    tokenizer = load_tokenizer(cfg.model.name_or_path) if "name_or_path" in cfg.model else None
    data = instantiate(cfg.data, tokenizer=tokenizer, with_prior="prior" in needs)
    model = instantiate(cfg.model, tokenizer=data.tokenizer, num_labels=data.num_labels)
    count_causal_rows(data, model)
    provide(callbacks.values(), data)
    module = instantiate(cfg.module, model=model)
    checkpoint = instantiate(cfg.checkpoint, dirpath=str(output_dir / "checkpoints"))
    logger = instantiate(cfg.logger, save_dir=str(output_dir)) if cfg.get("logger") else False
    trainer = instantiate(cfg.trainer, logger=logger, callbacks=[*callbacks.values(), checkpoint])
    log.info(describe_run(cfg, model, trainer, choices or {}))

    started = time.perf_counter()
    trainer.fit(module, datamodule=data)
    seconds = time.perf_counter() - started
    if trainer.world_size > 1:  # each process logs its pruning to its own Hydra job log, to compare across ranks
        log.info("rank %d: heads pruned %s", trainer.global_rank, pruned_heads(module.model))
    if not trainer.is_global_zero:
        return None
    summary = summarize(cfg, module.model, data, callbacks, trainer, seconds, choices or {})
    summary["checkpoint"] = checkpoint.best_model_path or None
    summary["output_dir"] = str(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if summary["pruning"]:
        summary["pruning"]["saved"] = str(save_pruned(module.model, output_dir / "pruned_model"))
        data.tokenizer.save_pretrained(output_dir / "pruned_model")
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(format_summary(summary), flush=True)
    return summary


def count_causal_rows(data: Any, model: PreTrainedModel) -> None:
    """For a decoder, have the data's `SyntaxCollator` count (and warn once about) the prior rows that the
    loss's causal restriction leaves out: words whose parent is to their right.

    Example:
        >>> from attnreg.app.datamodules import AgreementDataModule
        >>> from attnreg.app.models import tiny_classifier
        >>> data = AgreementDataModule(train=8, val=4, test=4, hard=2); data.setup("fit")
        >>> count_causal_rows(data, tiny_classifier(data.tokenizer, num_labels=2, family="gpt2"))
        >>> data.collator().causal
        True
    """
    collator = data.collator() if hasattr(data, "collator") else None
    if isinstance(collator, SyntaxCollator):
        collator.causal = detect_family(model).causal


def main() -> None:
    """`attnreg-train`: see the module docstring. Registers the configs' resolvers, then lets Hydra run
    `job` once or as a multirun, as the command line says.

    The example runs `attnreg-train attnreg=entropy_regularizer attnreg.entropy_regularizer.weight=0.1 --cfg job
    --package attnreg`: Hydra prints that part of the composed config and runs nothing; the module docstring shows a
    run.

    Example:
        >>> import sys
        >>> from unittest import mock
        >>> argv = ["attnreg-train", "attnreg=entropy_regularizer", "attnreg.entropy_regularizer.weight=0.1"]
        >>> argv += ["--cfg", "job", "--package", "attnreg"]
        >>> with mock.patch.object(sys, "argv", argv):
        ...     main()
        # @package attnreg
        entropy_regularizer:
          _target_: attnreg.EntropyRegularizer
          weight: 0.1
          mode: min
        ...
    """
    register_resolvers()  # before Hydra composes: `--cfg job --resolve` needs them too
    job()


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def job(cfg: DictConfig) -> float | None:
    """One Hydra job: `train` into Hydra's output folder. Returns `optimized_metric` of the summary (for sweepers).

    The example runs one job as Hydra does, with `train` stubbed out; the module docstring trains for real.

    Example:
        >>> import sys, tempfile
        >>> from unittest import mock
        >>> from attnreg.app.configs import CONFIG_DIR
        >>> with hydra.initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        ...     cfg = hydra.compose("train", ["optimized_metric=accuracy.test"], return_hydra_config=True)
        >>> cfg.hydra.runtime.output_dir = tempfile.mkdtemp(); HydraConfig.instance().set_config(cfg)
        >>> summary = {"accuracy": {"val": 0.5, "test": 0.75}}
        >>> with mock.patch.object(sys.modules[__name__], "train", return_value=summary) as fake_train:
        ...     job(cfg)                                    # given a config, hydra.main calls the function itself
        0.75
        >>> fake_train.call_args.args[1] == cfg.hydra.runtime.output_dir, fake_train.call_args.args[2]["model"]
        (True, 'tiny_bert')
        >>> HydraConfig.instance().cfg = None                 # no job left behind, as after Hydra's own
    """
    hydra_cfg = HydraConfig.get()
    warn_renamed(hydra_cfg.runtime.choices)
    summary = train(cfg, hydra_cfg.runtime.output_dir, dict(hydra_cfg.runtime.choices))
    if summary is None or not cfg.get("optimized_metric"):
        return None
    return metric(summary, cfg.optimized_metric)


if __name__ == "__main__":
    main()
