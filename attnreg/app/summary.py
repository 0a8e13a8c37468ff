"""The run's summary: the line `attnreg-train` logs before fitting (what is on) and the summary after it
(accuracy, parent accuracy of the supervised and best heads, entropy per layer, the prior's coverage, pruning),
as a dict for `summary.json` and as the text the app prints. What is shared is here; what differs by task comes from
the run's task (`attnreg.app.tasks`): a decoder task's summary has validation perplexity, parent accuracy over the
words whose parent is to their left beside the best left-offset baseline, greedy continuations, and for a pruned
model its size and generation speed against the unpruned one.

Example:
    >>> summary = {"accuracy": {"val": 0.75}, "metrics": {"val/loss": 0.5}}
    >>> metric(summary, "accuracy.val")
    0.75
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import lightning as L
from omegaconf import DictConfig, OmegaConf
from transformers import PreTrainedModel

from attnreg.app.decoder_evaluation import generation_speed
from attnreg.app.evaluation import layer_entropy, pruning_report
from attnreg.app.settings import attnreg_settings, supervised_heads
from attnreg.app.tasks import Task, task_of_summary
from attnreg.hub import detach, is_attached
from attnreg.methods.pruning import count_parameters
from attnreg.unwrap import transformers_model


def describe_run(cfg: DictConfig, model: PreTrainedModel, trainer: L.Trainer, choices: Mapping[str, Any]) -> str:
    """One line saying what a run is about to do: model, data, seed, length, each attnreg callback's settings.

    Example:
        >>> import hydra
        >>> from hydra.utils import instantiate
        >>> from attnreg.app.configs import CONFIG_DIR
        >>> from attnreg.app.task import build_tokenizer, vocabulary
        >>> with hydra.initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        ...     cfg = hydra.compose("train")                                   # the default run
        >>> model = instantiate(cfg.model, tokenizer=build_tokenizer(vocabulary()), num_labels=2)
        >>> trainer = instantiate(cfg.trainer, logger=False)
        >>> print(describe_run(cfg, model, trainer, {"model": "tiny_bert", "data": "agreement"}))
        attnreg-train: model tiny_bert (BertForSequenceClassification), data agreement, seed 0, 40 epochs;
        attnreg: syntax_prior_kl = SyntaxPriorKL(weight=1.0, heads=[0], head_reduction=mean_heads)
    """
    model_name = choices.get("model") or _short_name(cfg.model._target_)
    source = f" from {cfg.model.name_or_path}" if "name_or_path" in cfg.model else ""
    data_name = choices.get("data") or _short_name(cfg.data._target_)
    settings = attnreg_settings(cfg)
    attnreg = "; ".join(
        f"{name} = {describe_settings(OmegaConf.to_container(node, resolve=True))}" for name, node in settings.items()
    )
    adapter = f" with LoRA r={cfg.peft.r} on {list(cfg.peft.target_modules)}" if cfg.get("peft") else ""
    return (
        f"attnreg-train: model {model_name} ({type(model).__name__}{source}{adapter}), data {data_name}, "
        f"seed {cfg.seed}, {training_length(trainer)}; attnreg: {attnreg or 'none'}"
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
    task: Task,
    cfg: DictConfig,
    model: Any,
    data: Any,
    callbacks: Mapping[str, L.Callback],
    trainer: L.Trainer,
    seconds: float,
    choices: Mapping[str, Any],
    unpruned: PreTrainedModel | None = None,
) -> dict[str, Any]:
    """The run summary: settings, the `task`'s numbers (`Task.scores`: accuracy per held-out set, or validation
    perplexity), entropy per layer, the parent accuracy of the supervised heads and the best one, what the model
    writes (`Task.generations`), the prior's coverage, and the heads removed, with the parameter count and generation
    tokens/s against `unpruned` (the model before training) when there is one: both of the model as it would be served,
    a LoRA adapter merged into a copy (`served`). `model` may be a PEFT model: its base is evaluated, adapters in place.

    The example summarizes a model not trained yet.

    Example:
        >>> import attnreg
        >>> from attnreg.app.datamodules import AgreementDataModule
        >>> from attnreg.app.models import tiny_classifier
        >>> from attnreg.app.tasks import CLASSIFICATION
        >>> data = AgreementDataModule(train=8, val=4, test=4, hard=2); data.setup("fit")
        >>> model = tiny_classifier(data.tokenizer, num_labels=2)
        >>> callbacks = {"kl": attnreg.SyntaxPriorKL(layers=[0], heads=[1])}           # supervises head 1 of layer 0
        >>> cfg, choices = OmegaConf.create({"seed": 0}), {"model": "tiny_bert", "hydra/launcher": "basic"}
        >>> summary = summarize(CLASSIFICATION, cfg, model, data, callbacks, L.Trainer(logger=False), 1.23, choices)
        >>> summary["choices"], summary["attnreg"], summary["steps"], summary["train_seconds"], summary["pruning"]
        ({'model': 'tiny_bert'}, {'kl': 'SyntaxPriorKL'}, 0, 1.2, None)
        >>> sorted(summary["accuracy"]), len(summary["entropy"]), list(summary["parent_accuracy"]["supervised"])
        (['hard', 'test', 'val'], 2, ['L0H1'])

    A causal LM's:

        >>> from attnreg.app.lm import AgreementLMDataModule
        >>> from attnreg.app.models import tiny_causal_lm
        >>> from attnreg.app.tasks import LANGUAGE_MODEL
        >>> data = AgreementLMDataModule(train=8, val=8); data.setup("fit")
        >>> callbacks = {"kl": attnreg.SyntaxPriorKL(layers=[1], heads=[0])}
        >>> cfg = OmegaConf.create({"seed": 0, "generate_tokens": 4})
        >>> summary = summarize(LANGUAGE_MODEL, cfg, tiny_causal_lm(data.tokenizer), data, callbacks,
        ...                     L.Trainer(logger=False), 1.0, {"model": "tiny_llama_lm"})
        >>> summary["task"], sorted(summary["perplexity"]), list(summary["parent_accuracy"]["supervised"])
        ('causal_lm', ['val'], ['L1H0'])
        >>> list(summary["continuations"]) == data.prompts, summary["pruning"]
        (True, None)
    """
    given, model = model, transformers_model(model)  # a PEFT model's base, its adapters in place
    summary: dict[str, Any] = {
        "choices": {key: value for key, value in choices.items() if not key.startswith("hydra")},
        "seed": cfg.seed,
        **({"task": task.name} if task.named_in_summary else {}),
        "attnreg": {name: type(callback).__name__ for name, callback in callbacks.items()},
        "steps": trainer.global_step,
        "epochs": trainer.current_epoch,
        "train_seconds": round(seconds, 1),
        **task.scores(model, data),
        "metrics": {key: round(float(value), 4) for key, value in trainer.callback_metrics.items()},
        "entropy": [None if value is None else round(value, 4) for value in layer_entropy(model, data.loader("val"))],
        "parent_accuracy": None,
        **task.generations(model, data, cfg),
        "pruning": pruning_report(model),
        "prior_arcs": prior_arcs(data),
    }
    sentences = data.tree_sentences()
    if sentences:
        summary["parent_accuracy"] = task.parent_accuracy(model, data, sentences, supervised_heads(callbacks.values()))
    if summary["pruning"] and unpruned is not None:
        pruned = served(given)
        summary["pruning"]["parameters"] = count_parameters(pruned)
        speed = generation_speed(
            {"pruned": pruned, "unpruned": unpruned}, data.tokenizer, data.prompts, cfg.get("generate_tokens", 16)
        )
        summary["pruning"]["generation"] = speed
        summary["pruning"]["speedup"] = round(
            speed["pruned"]["tokens_per_second"] / speed["unpruned"]["tokens_per_second"], 3
        )
    return summary


def served(model: Any) -> Any:
    """The model as it would be served: a copy with its LoRA adapter merged in (attnreg's gates folded first), or
    the model itself where it holds no adapter.

    Example:
        >>> from attnreg.app.models import add_lora
        >>> from attnreg.tiny import tiny_model
        >>> model = add_lora(tiny_model("llama", head="causal_lm"), r=2)
        >>> type(served(model)).__name__, type(model).__name__
        ('LlamaForCausalLM', 'PeftModel')
    """
    if not hasattr(model, "merge_and_unload"):
        return model
    merged = copy.deepcopy(model)
    if is_attached(merged):
        detach(merged)  # folds gates into the base weights and the adapter first
    return merged.merge_and_unload().eval()


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
    """The summary as a few lines of text (what `attnreg-train` prints at the end): the run, its callbacks, the lines
    of its task (`attnreg.app.tasks.Task.summary_lines`), the models saved and the output folder.

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

    A causal LM's:

        >>> summary = {"seed": 0, "steps": 40, "train_seconds": 3.2, "attnreg": {}, "task": "causal_lm",
        ...            "perplexity": {"val": 12.5}, "continuations": {"the dog": "sees a cat"}, "output_dir": "run",
        ...            "parent_accuracy": {"sentences": 8, "supervised": {"L1H0": 0.5}, "best_head": "L0H2",
        ...                                "best": 0.6, "best_offset": -1, "best_offset_accuracy": 0.4,
        ...                                "left_parent_share": 0.45},
        ...            "pruning": {"removed": {"1": [0, 1]}, "heads_left": [4, 2], "parameters": 900}}
        >>> print(format_summary(summary))
        attnreg-train: causal_lm run, seed 0, 40 steps in 3.2 s
        callbacks: none
        validation perplexity: 12.50
        parent accuracy over the 45.0% of words whose parent is to their left (8 held-out sentences): supervised ...
        heads pruned: 2 (layer 1: [0, 1]); 900 parameters
        greedy: 'the dog' -> 'sees a cat'
        outputs: run
    """
    choices = summary.get("choices", {})
    setting = f"{choices.get('model', 'model')} on {choices.get('data', 'data')}" if choices else "run"
    task_name = f"{summary['task']} " if "task" in summary else ""
    return "\n".join(
        [
            f"attnreg-train: {task_name}{setting}, seed {summary['seed']}, {summary['steps']} steps in "
            f"{summary['train_seconds']} s",
            "callbacks: " + (", ".join(f"{n} ({t})" for n, t in summary["attnreg"].items()) or "none"),
            *task_of_summary(summary).summary_lines(summary),
            *_saved_models(summary),
            f"outputs: {summary.get('output_dir')}",
        ]
    )


def _saved_models(summary: Mapping[str, Any]) -> list[str]:
    """A line per model folder the run wrote (`adapter`, `merged_model`, `model`) and per export (`export=`)."""
    return [
        f"{name.replace('_', ' ')}: {summary[name]}"
        for name in ("adapter", "merged_model", "model")
        if summary.get(name)
    ] + [f"export {name}: {path}" for name, path in (summary.get("exports") or {}).items()]


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
