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

Decoders: a causal-LM data config (`data=agreement_lm`, `data=ewt_lm`, `data=text_lm`, `data=hf_lm`) or chat SFT
(`data=chat`) with a causal-LM model config (`model=tiny_llama_lm`, `model=decoder` for a local directory,
`model=smollm2`) trains the next-token loss (`attnreg.app.modules.CausalLM`, data in `attnreg.app.lm`), optionally
through a LoRA adapter (`peft=lora`); the summary then has perplexity, parent accuracy over left parents, greedy
continuations and, for a pruned model, its generation speed (`attnreg.app.decoder_evaluation`). A run resumes from a
checkpoint with `ckpt_path=<run dir>/checkpoints/last.ckpt`.

The model configs name the factories of `attnreg.app.models`. The data config chooses the run's task
(`attnreg.app.tasks`: classification, causal LM or chat), which builds the data, the model and the LightningModule and
gives the summary's numbers (from `attnreg.app.evaluation` or `attnreg.app.decoder_evaluation`). A callback says
what it needs from the data with a class attribute `needs` (see `NEEDS`): the syntax prior in the batches, held-out
gold trees, the tokenizer. For instance:

    $ attnreg-train                                       # the default run (about 30 s on 2 cores)
    $ attnreg-train attnreg=none                          # the same without the prior
    $ attnreg-train -m attnreg.syntax_prior_kl.weight=0,1 seed=0,1,2
    $ attnreg-train experiment=cola_minilm attnreg=none   # a preset's baseline
    $ attnreg-train model=minilm data=cola attnreg=[syntax_prior_kl,entropy_regularizer] trainer.max_steps=200
    $ attnreg-train trainer=ddp                           # 2 CPU processes (gloo)
    $ attnreg-train data=agreement_lm peft=lora           # a tiny random Llama as a causal LM, LoRA, the prior
    $ attnreg-train experiment=smollm2_syntax_prior       # SmolLM2-135M on EWT, the causal prior on L15H2

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
    model: ...
    outputs: ...
    >>> sorted(path.name for path in run_dir.iterdir())   # Hydra's run folder (train.log with job_logging)
    ['.hydra', 'checkpoints', 'csv', 'model', 'summary.json']
"""

from __future__ import annotations

import copy
import json
import logging
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from transformers import PreTrainedModel

from attnreg.app.configs import register_resolvers
from attnreg.app.decoder_evaluation import perplexity
from attnreg.app.exports import check_exports, export_formats, write_exports
from attnreg.app.failed_jobs import failed_jobs_reported
from attnreg.app.models import load_tokenizer
from attnreg.app.modules import CausalLM
from attnreg.app.settings import (
    instantiate_callbacks,
    needs_of,
    protect_supervised,
    provide,
    removes_heads,
    warn_renamed,
)
from attnreg.app.summary import describe_run, format_summary, metric, summarize
from attnreg.app.tasks import Task, task_of
from attnreg.export import ExportError
from attnreg.families import detect_family
from attnreg.hub import detach, is_attached
from attnreg.methods.pruning import gate_parameters, pruned_heads, save_pruned, silenced_heads
from attnreg.syntax.data import SyntaxCollator
from attnreg.unwrap import transformers_model

log = logging.getLogger(__name__)

CHECKPOINTS = ("checkpoint", "last_checkpoint")
"""The config's checkpoint callbacks: the best by `val/loss` (`checkpoints/best.ckpt`) and the latest
(`checkpoints/last.ckpt`, rewritten at every validation, to resume from)."""


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
        model: ...
        outputs: ...
        >>> summary["steps"], sorted(summary["accuracy"]), summary["parent_accuracy"]["supervised"].keys()
        (2, ['hard', 'test', 'val'], dict_keys(['L0H0', 'L1H0']))
        >>> sorted(path.name for path in output_dir.iterdir()), Path(summary["checkpoint"]).name
        (['checkpoints', 'csv', 'model', 'summary.json'], 'best.ckpt')
    """
    register_resolvers()  # for callers that composed `cfg` themselves
    output_dir = Path(output_dir)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    if cfg.get("threads"):
        torch.set_num_threads(cfg.threads)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    formats = export_formats(cfg)
    callbacks = instantiate_callbacks(cfg)
    needs = frozenset().union(*(needs_of(callback) for callback in callbacks.values()))
    tokenizer = (
        load_tokenizer(cfg.model.name_or_path, cfg.model.get("gguf_file")) if "name_or_path" in cfg.model else None
    )
    task = task_of(cfg)
    data = task.data(cfg, tokenizer, with_prior="prior" in needs)
    data.setup("fit")  # every row checked before the model loads (decoder data; idempotent for all)
    model = task.model(cfg, data)
    check_exports(formats, model)
    pruning = removes_heads(callbacks.values())
    if pruning and cfg.get("protect_supervised", True):
        protect_supervised(callbacks.values(), model)
    # the model as built: generation speed against it, and the teacher of a `teacher: base` setting
    base = copy.deepcopy(model).eval() if (task.generates and pruning) or "base_model" in needs else None
    unpruned = base if task.generates and pruning else None
    if cfg.get("peft"):
        model = task.add_lora(model, cfg)
    count_causal_rows(data, model)
    provide(callbacks.values(), data, base)
    module = task.module(cfg, model)
    checkpoints = [
        instantiate(cfg[key], dirpath=str(output_dir / "checkpoints")) for key in CHECKPOINTS if cfg.get(key)
    ]
    logger = instantiate(cfg.logger, save_dir=str(output_dir)) if cfg.get("logger") else False
    if logger:  # the whole run's settings: seed, data, model, each method's, the config groups chosen
        logger.log_hyperparams(run_settings(cfg, choices or {}))
    trainer = instantiate(  # default_root_dir: nothing Lightning writes by default lands outside the run folder
        cfg.trainer, logger=logger, callbacks=[*callbacks.values(), *checkpoints], default_root_dir=str(output_dir)
    )
    log.info(describe_run(cfg, model, trainer, choices or {}))

    started = time.perf_counter()
    trainer.fit(module, datamodule=data, ckpt_path=cfg.get("ckpt_path"))
    seconds = time.perf_counter() - started
    control = recover_unpruned(cfg, task, unpruned, data) if unpruned is not None and cfg.get("control") else None
    if trainer.world_size > 1:  # each process logs its pruning to its own Hydra job log, to compare across ranks
        log.info("rank %d: heads pruned %s", trainer.global_rank, pruned_heads(module.model))
    if not trainer.is_global_zero:
        return None
    summary = summarize(task, cfg, module.model, data, callbacks, trainer, seconds, choices or {}, unpruned)
    if control is not None and summary.get("pruning"):
        summary["pruning"]["control"] = control_report(control, data, summary["perplexity"]["val"])
    summary["checkpoint"] = (checkpoints[0].best_model_path or None) if cfg.get("checkpoint") else None
    summary["output_dir"] = str(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if summary["pruning"]:
        summary["pruning"]["saved"] = str(save_pruned(module.model, output_dir / "pruned_model"))
        data.tokenizer.save_pretrained(output_dir / "pruned_model")
    summary.update(save_outputs(cfg, module.model, data.tokenizer, output_dir, bool(summary["pruning"]), pruning))
    refused = None
    if formats:  # after every save: a refusal leaves the trained model and the summary, then fails the run
        gguf_file = Path(cfg.model.name_or_path, cfg.model.gguf_file) if cfg.model.get("gguf_file") else None
        try:
            summary["exports"] = write_exports(formats, module.model, output_dir, data.tokenizer, gguf_file)
        except ExportError as error:
            summary["exports"], refused = {"refused": str(error)}, error
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(format_summary(summary), flush=True)
    if refused is not None:
        raise refused
    return summary


def recover_unpruned(cfg: DictConfig, task: Task, base: PreTrainedModel, data: Any) -> tuple[L.Trainer, Any]:
    """The unpruned model (`base`, as built) recovered as the run recovered the pruned one: the same seed, batches,
    LoRA adapter, steps and methods, less those that remove heads (a `teacher: base` distils from `base` itself).
    The pruning presets turn it on (`control: true`), so that the summary gives the pruned model's perplexity
    against an equally recovered unpruned model, its own cost. Returns the control's trainer and model."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    callbacks = [callback for callback in instantiate_callbacks(cfg).values() if not removes_heads([callback])]
    model = copy.deepcopy(base).train()
    if cfg.get("peft"):
        model = task.add_lora(model, cfg)
    provide(callbacks, data, base)
    module = task.module(cfg, model)
    trainer = instantiate(cfg.trainer, logger=False, callbacks=callbacks, enable_checkpointing=False)
    trainer.fit(module, datamodule=data)
    return trainer, module.model


def control_report(control: tuple[L.Trainer, Any], data: Any, pruned_perplexity: float) -> dict[str, Any]:
    """The recovered unpruned model's validation perplexity, its steps, and the pruned model's over it.

    Example:
        >>> from attnreg.app.lm import AgreementLMDataModule
        >>> from attnreg.app.models import tiny_causal_lm
        >>> data = AgreementLMDataModule(train=8, val=8); data.setup("fit")
        >>> report = control_report((L.Trainer(logger=False), tiny_causal_lm(data.tokenizer)), data, 50.0)
        >>> sorted(report), report["steps"]
        (['perplexity', 'ratio', 'steps'], 0)
    """
    trainer, model = control
    scores = perplexity(transformers_model(model), data.loader("val"))
    ratio = pruned_perplexity / scores["perplexity"]
    return {"perplexity": scores["perplexity"], "ratio": round(ratio, 4), "steps": trainer.global_step}


def run_settings(cfg: DictConfig, choices: Mapping[str, Any]) -> dict[str, Any]:
    """The composed config, resolved, with the config-group choices (`choices/<group>`): what a logger records as
    the run's hyperparameters (MLflow's params, TensorBoard's and CSV's `hparams.yaml`), nested keys joined by "/".

    Example:
        >>> from omegaconf import OmegaConf
        >>> cfg = OmegaConf.create({"seed": 1, "attnreg": {"kl": {"weight": 0.5}}})
        >>> run_settings(cfg, {"model": "tiny_bert", "hydra/launcher": "basic"})
        {'seed': 1, 'attnreg': {'kl': {'weight': 0.5}}, 'choices': {'model': 'tiny_bert'}}
    """
    settings = OmegaConf.to_container(cfg, resolve=True)
    chosen = {key: value for key, value in choices.items() if not key.startswith("hydra")}
    return {**settings, **({"choices": chosen} if chosen else {})}


class StepLog(L.Callback):
    """Records, after every optimizer step, the logged training numbers (`train/loss`, each `attnreg/<term>`).

    Example:
        >>> StepLog().values
        {}
    """

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        for key, value in trainer.callback_metrics.items():
            if key.startswith(("train/", "attnreg/")) and key.count("/") == 1:
                self.values.setdefault(key, []).append(round(float(value), 4))


def fit_causal_lm(
    model: PreTrainedModel,
    loader: Any,
    callbacks: Sequence[L.Callback] = (),
    steps: int = 60,
    lr: float = 1e-4,
    clip: float | None = 1.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Fine-tune `model` in place on the batches of `loader`, in their order, for `steps` optimizer steps, as
    `attnreg-train` fine-tunes a decoder: `attnreg.app.modules.CausalLM` (AdamW at a constant `lr`, no weight decay)
    under a Lightning `Trainer` with the attnreg `callbacks`, gradient norm clipped at `clip`. For scripts that hold
    their own data (the decoder benchmarks): one training loop for the app and the evidence. Returns the
    per-step log (`train/loss`, `attnreg/<term>`) and the seconds it took.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> import attnreg
        >>> from attnreg.app.lm import AgreementLMDataModule
        >>> from attnreg.app.models import tiny_causal_lm
        >>> data = AgreementLMDataModule(train=16, val=4, with_prior=True, batch_size=8); data.setup()
        >>> loader = DataLoader(data.datasets["train"], batch_size=8, collate_fn=data.collator())
        >>> model = tiny_causal_lm(data.tokenizer)
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     log = fit_causal_lm(model, loader, [attnreg.SyntaxPriorKL(layers=[1], heads=[0], weight=0.3)], steps=2)
        >>> len(log["train/loss"]), len(log["attnreg/syntax_prior_kl"]), model.training
        (2, 2, False)
    """
    L.seed_everything(seed, workers=True, verbose=False)
    module = CausalLM(model, lr=lr, weight_decay=0.0, warmup=0.0, schedule="constant")
    record = StepLog()
    trainer = L.Trainer(
        max_steps=steps,
        gradient_clip_val=clip,
        callbacks=[*callbacks, record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        accelerator="gpu" if next(model.parameters()).is_cuda else "cpu",  # where the model is: it stays there
        devices=1,
    )
    started = time.perf_counter()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    trainer.fit(module, train_dataloaders=loader)
    model.eval()
    return {**record.values, "seconds": round(time.perf_counter() - started, 1)}


def save_outputs(
    cfg: DictConfig, model: Any, tokenizer: Any, output_dir: Path, pruned: bool = False, gated: bool = False
) -> dict[str, str]:
    """Write what the run's config asks for besides checkpoints: a LoRA adapter (always, under `adapter/`) and, with
    `peft.merge`, the model with the adapter merged in (`merged_model/`, attnreg's gates folded into it). A `gated`
    run (head gating) always gets one: its gates were folded into the base weights as well as the adapter, so the
    adapter alone on the original base model is not the trained model. With `save_model`, the fine-tuned model
    (`model/`; a pruned one is in `pruned_model/` already). Returns their paths.

    Example:
        >>> import tempfile
        >>> from omegaconf import OmegaConf
        >>> from attnreg.app.models import add_lora
        >>> from attnreg.app.task import build_tokenizer
        >>> from attnreg.tiny import tiny_model
        >>> cfg = OmegaConf.create({"peft": {"merge": True}})
        >>> model = add_lora(tiny_model("llama", head="causal_lm"), r=2)
        >>> outputs = save_outputs(cfg, model, build_tokenizer(["a"]), Path(tempfile.mkdtemp()))
        >>> sorted(outputs), sorted(path.name for path in Path(outputs["adapter"]).iterdir())[:2]
        (['adapter', 'merged_model'], ['README.md', 'adapter_config.json'])
    """
    outputs = {}
    if cfg.get("peft"):
        model.save_pretrained(output_dir / "adapter")
        tokenizer.save_pretrained(output_dir / "adapter")
        outputs["adapter"] = str(output_dir / "adapter")
        if cfg.peft.get("merge") or gated or gate_parameters(model):
            merged = copy.deepcopy(model)
            if is_attached(merged):
                detach(merged)  # folds gates into the base weights and the adapter first
            merged = merged.merge_and_unload()
            if pruned_heads(merged) or silenced_heads(merged):  # the record goes along: load_pruned rebuilds it
                save_pruned(merged, output_dir / "merged_model", tokenizer=tokenizer)
            else:
                merged.save_pretrained(output_dir / "merged_model")
                tokenizer.save_pretrained(output_dir / "merged_model")
            outputs["merged_model"] = str(output_dir / "merged_model")
    elif cfg.get("save_model") and not pruned:
        saved = copy.deepcopy(model)
        if is_attached(saved):
            detach(saved)
        saved.save_pretrained(output_dir / "model")
        tokenizer.save_pretrained(output_dir / "model")
        outputs["model"] = str(output_dir / "model")
    return outputs


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
    `job` once or as a multirun, as the command line says; a multirun with failed jobs ends naming each
    (`attnreg.app.failed_jobs`).

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
    with failed_jobs_reported():  # Hydra reports a multirun's first failed job; this names them all
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
