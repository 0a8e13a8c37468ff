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
    $ attnreg-train -m attnreg.syntax_kl.weight=0,1 seed=0,1,2
    $ attnreg-train experiment=cola_minilm attnreg=none   # a preset's baseline
    $ attnreg-train model=minilm data=cola attnreg=[syntax_kl,entropy] trainer.max_steps=200
    $ attnreg-train trainer=ddp                           # 2 CPU processes (gloo)

Example (`attnreg-train attnreg=none` on less data for 1 epoch, in-process, into a temporary folder):
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

import dataclasses
import json
import logging
import time
import warnings
from collections.abc import Iterable, Mapping
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
from attnreg.app.evaluation import accuracy, head_report, layer_entropy, pruning_report
from attnreg.app.models import load_tokenizer
from attnreg.families import detect_family
from attnreg.methods.pruning import pruned_heads, save_pruned
from attnreg.syntax.data import SyntaxCollator

log = logging.getLogger(__name__)

MONITOR_GOLD_SENTENCES = 64  # how many held-out gold trees a callback that needs "gold_trees" gets

# What an attnreg callback may declare in its class attribute `needs` (a frozenset of these names) and
# what the app then provides; a callback without `needs` needs nothing from the data.
NEEDS = {
    "prior": "the data module adds the syntax prior to every batch (batch['attnreg_prior'])",
    "gold_trees": f"up to {MONITOR_GOLD_SENTENCES} held-out sentences with gold trees as `callback.gold_sentences`",
    "tokenizer": "the data's tokenizer as `callback.tokenizer`",
}


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
        callbacks: syntax_kl (SyntaxPriorKL)
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


def attnreg_settings(cfg: DictConfig) -> dict[str, DictConfig]:
    """{name: config node} of the attnreg callbacks that `cfg` turns on (a null node is off).

    Example:
        >>> from attnreg.app.configs import CONFIG_DIR
        >>> choices = [[], ["attnreg=[syntax_kl,entropy]"], ["attnreg=none"], ["attnreg.syntax_kl=null"]]
        >>> with hydra.initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        ...     configs = [hydra.compose("train", overrides) for overrides in choices]
        >>> [list(attnreg_settings(cfg)) for cfg in configs]
        [['syntax_kl'], ['syntax_kl', 'entropy'], [], []]
        >>> attnreg_settings(configs[0])["syntax_kl"]._target_
        'attnreg.SyntaxPriorKL'
    """
    return {name: node for name, node in (cfg.get("attnreg") or {}).items() if node is not None}


def needs_of(callback: L.Callback) -> frozenset[str]:
    """What `callback` declares it needs from the data (its `needs`; none without one), see `NEEDS`;
    raises ValueError on a need the app cannot provide.

    Example:
        >>> import attnreg
        >>> sorted(needs_of(attnreg.AttentionMonitor())), sorted(needs_of(attnreg.SyntaxPriorKL(layers=[0])))
        (['gold_trees', 'tokenizer'], ['prior'])
        >>> needs_of(L.Callback())                    # a callback without `needs` needs nothing
        frozenset()
    """
    needs = frozenset(getattr(callback, "needs", frozenset()))
    if needs - NEEDS.keys():
        raise ValueError(
            f"{type(callback).__name__} needs {sorted(needs - NEEDS.keys())}, which attnreg-train cannot provide "
            f"(it provides {', '.join(NEEDS)})"
        )
    return needs


def provide(callbacks: Iterable[L.Callback], data: Any) -> None:
    """Give each callback the gold trees and tokenizer its `needs` asks for, unless it was given its own
    (the prior is in the batches: the data module builds it when a callback needs it).

    Example:
        >>> import attnreg
        >>> from attnreg.app.datamodules import AgreementDataModule
        >>> data = AgreementDataModule(train=8, val=4, test=100, hard=2)   # gold trees: the 100 test sentences
        >>> monitor = attnreg.AttentionMonitor(every_n_steps=10)
        >>> provide([monitor], data)
        >>> len(monitor.gold_sentences), monitor.tokenizer is data.tokenizer
        (64, True)
    """
    for callback in callbacks:
        needs = needs_of(callback)
        if "gold_trees" in needs and callback.gold_sentences is None:
            data.setup("fit")  # idempotent: fit reuses the datasets
            callback.gold_sentences = (data.tree_sentences() or [])[:MONITOR_GOLD_SENTENCES] or None
        if "tokenizer" in needs and callback.tokenizer is None:
            callback.tokenizer = data.tokenizer


def describe_run(cfg: DictConfig, model: PreTrainedModel, trainer: L.Trainer, choices: Mapping[str, Any]) -> str:
    """One line saying what a run is about to do: model, data, seed, length, each attnreg callback's settings.

    Example:
        >>> from attnreg.app.configs import CONFIG_DIR
        >>> from attnreg.app.task import build_tokenizer, vocabulary
        >>> with hydra.initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        ...     cfg = hydra.compose("train")                                   # the default run
        >>> model = instantiate(cfg.model, tokenizer=build_tokenizer(vocabulary()), num_labels=2)
        >>> trainer = instantiate(cfg.trainer, logger=False)
        >>> print(describe_run(cfg, model, trainer, {"model": "tiny_bert", "data": "agreement"}))
        attnreg-train: model tiny_bert (BertForSequenceClassification), data agreement, seed 0, 40 epochs;
        attnreg: syntax_kl = SyntaxPriorKL(weight=1.0, heads=[0], head_reduction=mean_heads)
    """
    model_name = choices.get("model") or _short_name(cfg.model._target_)
    source = f" from {cfg.model.name_or_path}" if "name_or_path" in cfg.model else ""
    data_name = choices.get("data") or _short_name(cfg.data._target_)
    settings = attnreg_settings(cfg)
    attnreg = "; ".join(
        f"{name} = {describe_settings(OmegaConf.to_container(node, resolve=True))}" for name, node in settings.items()
    )
    return (
        f"attnreg-train: model {model_name} ({type(model).__name__}{source}), data {data_name}, seed {cfg.seed}, "
        f"{training_length(trainer)}; attnreg: {attnreg or 'none'}"
    )


def describe_settings(value: Any) -> str:
    """A config value on one line: `Name(key=value, ...)` for an instantiable node, its null settings left out.

    Example:
        >>> describe_settings({"_target_": "attnreg.callbacks.EntropyRegularizer", "weight": 0.1, "layers": None})
        'EntropyRegularizer(weight=0.1)'
    """
    if isinstance(value, Mapping) and "_target_" in value:
        settings = ", ".join(
            f"{key}={describe_settings(item)}"
            for key, item in value.items()
            if not key.startswith("_") and item is not None
        )
        return f"{_short_name(value['_target_'])}({settings})"
    return str(value)


def training_length(trainer: L.Trainer) -> str:
    """How long `trainer` will fit: "40 epochs", "100 steps", or "100 steps (at most 40 epochs)".

    Example:
        >>> lengths = [{"max_epochs": 40}, {"max_steps": 100}, {"max_steps": 1, "max_epochs": 3}]
        >>> [training_length(L.Trainer(logger=False, **length)) for length in lengths]
        ['40 epochs', '100 steps', '1 step (at most 3 epochs)']
    """
    steps = _count(trainer.max_steps, "step") if trainer.max_steps >= 0 else None
    epochs = _count(trainer.max_epochs, "epoch") if trainer.max_epochs is not None and trainer.max_epochs >= 0 else None
    if steps and epochs:
        return f"{steps} (at most {epochs})"
    return steps or epochs or "no max_steps or max_epochs"


def _count(number: int, unit: str) -> str:
    return f"{number} {unit}" if number == 1 else f"{number} {unit}s"


def _short_name(target: str) -> str:
    return target.rsplit(".", 1)[-1]


def summarize(
    cfg: DictConfig,
    model: PreTrainedModel,
    data: Any,
    callbacks: Mapping[str, L.Callback],
    trainer: L.Trainer,
    seconds: float,
    choices: Mapping[str, Any],
) -> dict[str, Any]:
    """The run summary: settings, accuracy per held-out set, parent accuracy, entropy per layer.

    Example (of a model not trained yet):
        >>> import attnreg
        >>> from attnreg.app.datamodules import AgreementDataModule
        >>> from attnreg.app.models import tiny_classifier
        >>> data = AgreementDataModule(train=8, val=4, test=4, hard=2); data.setup("fit")
        >>> model = tiny_classifier(data.tokenizer, num_labels=2)
        >>> callbacks = {"kl": attnreg.SyntaxPriorKL(layers=[0], heads=[1])}           # supervises head 1 of layer 0
        >>> cfg, choices = OmegaConf.create({"seed": 0}), {"model": "tiny_bert", "hydra/launcher": "basic"}
        >>> summary = summarize(cfg, model, data, callbacks, L.Trainer(logger=False), 1.23, choices)
        >>> summary["choices"], summary["attnreg"], summary["steps"], summary["train_seconds"], summary["pruning"]
        ({'model': 'tiny_bert'}, {'kl': 'SyntaxPriorKL'}, 0, 1.2, None)
        >>> sorted(summary["accuracy"]), len(summary["entropy"]), list(summary["parent_accuracy"]["supervised"])
        (['hard', 'test', 'val'], 2, ['L0H1'])
    """
    eval_sets = data.eval_sets()
    summary: dict[str, Any] = {
        "choices": {key: value for key, value in choices.items() if not key.startswith("hydra")},
        "seed": cfg.seed,
        "attnreg": {name: type(callback).__name__ for name, callback in callbacks.items()},
        "steps": trainer.global_step,
        "epochs": trainer.current_epoch,
        "train_seconds": round(seconds, 1),
        "accuracy": {name: round(accuracy(model, loader), 4) for name, loader in eval_sets.items()},
        "metrics": {key: round(float(value), 4) for key, value in trainer.callback_metrics.items()},
        "entropy": [round(value, 4) for value in layer_entropy(model, eval_sets["val"])],
        "parent_accuracy": None,
        "pruning": pruning_report(model),
        "prior_arcs": prior_arcs(data),
    }
    sentences = data.tree_sentences()
    if sentences:
        supervised = supervised_heads(callbacks.values())
        summary["parent_accuracy"] = head_report(model, data.tokenizer, sentences, supervised, data.max_length)
    return summary


def supervised_heads(callbacks: Iterable[L.Callback]) -> dict[int, list[int] | None]:
    """{layer: heads (None = all)} that the callbacks needing the syntax prior (`SyntaxPriorKL`) supervised
    with it, read from their `layers` and `heads_of` (one without `layers` supervises none).

    Example:
        >>> import attnreg
        >>> supervised_heads([attnreg.SyntaxPriorKL(layers=[0, 1], heads=[0]), attnreg.EntropyRegularizer()])
        {0: [0], 1: [0]}
    """
    heads: dict[int, list[int] | None] = {}
    for callback in callbacks:
        if "prior" in needs_of(callback):
            for layer in getattr(callback, "layers", None) or ():
                heads[layer] = callback.heads_of(layer)
    return heads


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


def prior_arcs(data: Any) -> dict[str, int] | None:
    """What the syntax prior covered over the run (sentences, arcs, arcs dropped by truncation or shared
    tokens, and for a decoder the prior rows the causal restriction drops), or None when the data built no prior.

    Example:
        >>> from attnreg.app.datamodules import AgreementDataModule
        >>> data = AgreementDataModule(train=8, val=4, test=4, hard=2); data.setup("fit")
        >>> _ = next(iter(data.loader("val")))                  # the collator counts what it built
        >>> prior_arcs(data), prior_arcs(AgreementDataModule(with_prior=False))
        ({'sentences': 4, 'arcs': 39, 'arcs_dropped': 0, 'causal_rows': 0, 'causal_rows_dropped': 0}, None)
    """
    stats = getattr(data.collator(), "stats", None)
    return None if stats is None else dataclasses.asdict(stats)


def format_summary(summary: Mapping[str, Any]) -> str:
    """The summary as a few lines of text (what `attnreg-train` prints at the end).

    Example:
        >>> summary = {"seed": 0, "steps": 40, "train_seconds": 3.2, "attnreg": {"kl": "SyntaxPriorKL"},
        ...            "accuracy": {"val": 0.9, "test": 0.875}, "entropy": [0.61, 0.42], "output_dir": "outputs/run",
        ...            "pruning": {"removed": {"1": [0, 3]}, "heads_left": [4, 2], "saved": "outputs/run/pruned_model"}}
        >>> print(format_summary(summary))
        attnreg-train: run, seed 0, 40 steps in 3.2 s
        callbacks: kl (SyntaxPriorKL)
        accuracy: val 0.900, test 0.875
        attention entropy per layer (normalized): 0.610, 0.420
        heads pruned: layer 1: [0, 3] (heads left per layer [4, 2], saved to outputs/run/pruned_model)
        outputs: outputs/run
    """
    choices = summary.get("choices", {})
    setting = f"{choices.get('model', 'model')} on {choices.get('data', 'data')}" if choices else "run"
    lines = [
        f"attnreg-train: {setting}, seed {summary['seed']}, {summary['steps']} steps in {summary['train_seconds']} s",
        "callbacks: " + (", ".join(f"{n} ({t})" for n, t in summary["attnreg"].items()) or "none"),
        "accuracy: " + ", ".join(f"{name} {value:.3f}" for name, value in summary["accuracy"].items()),
        "attention entropy per layer (normalized): " + ", ".join(f"{value:.3f}" for value in summary["entropy"]),
    ]
    if "hard" in summary["accuracy"]:
        lines[2] += "  (test: 0-1 distractor verbs as in training; hard: 2)"
    heads = summary.get("parent_accuracy")
    if heads:
        supervised = ", ".join(f"{name} {_fraction(value)}" for name, value in heads["supervised"].items()) or "none"
        if "right_branching" in heads:
            baseline = f"right-branching {heads['right_branching']:.3f}"
        else:  # a decoder: accuracy over the parents to the left, the only ones a causal head can attend to
            baseline = (
                f"left-branching {heads['left_branching']:.3f} (a decoder: over the {heads['reachable_share']:.1%} "
                "of words whose parent is to their left)"
            )
        lines.append(
            f"parent accuracy on {heads['sentences']} held-out sentences: supervised {supervised}; "
            f"best head {heads['best_head']} {_fraction(heads['best'])}; {baseline}"
        )
    arcs = summary.get("prior_arcs")
    if arcs and arcs["arcs"]:
        lines.append(
            f"syntax prior: {arcs['arcs']} arcs in {arcs['sentences']} sentences, {arcs['arcs_dropped']} without a "
            f"prior ({arcs['arcs_dropped'] / arcs['arcs']:.1%}: truncated, or sharing a token)"
        )
    if arcs and arcs.get("causal_rows"):
        dropped, rows = arcs["causal_rows_dropped"], arcs["causal_rows"]
        lines.append(
            f"causal restriction: {dropped} of {rows} prior rows left out ({dropped / rows:.1%}: the parent is to "
            "the right, which a decoder cannot attend to)"
        )
    pruning = summary.get("pruning")
    if pruning:
        removed = "; ".join(f"layer {layer}: {heads}" for layer, heads in pruning["removed"].items())
        lines.append(
            f"heads pruned: {removed} (heads left per layer {pruning['heads_left']}, saved to {pruning.get('saved')})"
        )
    else:
        lines.append("heads pruned: none")
    lines.append(f"outputs: {summary.get('output_dir')}")
    return "\n".join(lines)


def _fraction(value: float | None) -> str:
    return "removed" if value is None else f"{value:.3f}"


def metric(summary: Mapping[str, Any], path: str) -> float:
    """A number of the summary by dotted path ("accuracy.val", "metrics.val/loss").

    Example:
        >>> summary = {"accuracy": {"val": 0.75}, "metrics": {"val/loss": 0.5}}
        >>> metric(summary, "accuracy.val"), metric(summary, "metrics.val/loss")
        (0.75, 0.5)
        >>> metric(summary, "accuracy.test")
        Traceback (most recent call last):
        ...
        KeyError: "optimized_metric 'accuracy.test': the summary has no 'test' (has ['val'])"
    """
    value: Any = summary
    for part in path.split(".") if not path.startswith("metrics.") else ["metrics", path[len("metrics.") :]]:
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(f"optimized_metric {path!r}: the summary has no {part!r} (has {sorted(value)})")
        value = value[part]
    return float(value)


def main() -> None:
    """`attnreg-train`: see the module docstring. Registers the configs' resolvers, then lets Hydra run
    `job` once or as a multirun, as the command line says.

    Example (`attnreg-train attnreg=entropy attnreg.entropy.weight=0.1 --cfg job --package attnreg`: Hydra
    prints that part of the composed config and runs nothing; the module docstring shows a run):
        >>> import sys
        >>> from unittest import mock
        >>> argv = "attnreg-train attnreg=entropy attnreg.entropy.weight=0.1 --cfg job --package attnreg".split()
        >>> with mock.patch.object(sys, "argv", argv):
        ...     main()
        # @package attnreg
        entropy:
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

    Example (as Hydra runs one job, with `train` stubbed out; the module docstring trains for real):
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
    summary = train(cfg, hydra_cfg.runtime.output_dir, dict(hydra_cfg.runtime.choices))
    if summary is None or not cfg.get("optimized_metric"):
        return None
    return metric(summary, cfg.optimized_metric)


if __name__ == "__main__":
    main()
