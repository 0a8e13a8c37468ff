"""The run's summary: the line `attnreg-train` logs before fitting (what is on) and the summary after it
(accuracy, parent accuracy of the supervised and best heads, entropy per layer, the prior's coverage, pruning),
as a dict for `summary.json` and as the text the app prints. A decoder task's summary (`summarize_decoder`) has
validation perplexity, parent accuracy over the words whose parent is to their left beside the best left-offset
baseline, greedy continuations, and for a pruned model its size and generation speed against the unpruned one.

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

from attnreg.app.decoder_evaluation import decoder_head_report, generation_speed, greedy_continuations, perplexity
from attnreg.app.evaluation import accuracy, head_report, layer_entropy, pruning_report
from attnreg.app.settings import attnreg_settings, supervised_heads
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
    cfg: DictConfig,
    model: PreTrainedModel,
    data: Any,
    callbacks: Mapping[str, L.Callback],
    trainer: L.Trainer,
    seconds: float,
    choices: Mapping[str, Any],
) -> dict[str, Any]:
    """The run summary: settings, accuracy per held-out set, parent accuracy, entropy per layer.

    The example summarizes a model not trained yet.

    Example:
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
    if data.task != "classification":
        return summarize_decoder(cfg, model, data, callbacks, trainer, seconds, choices)
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
        "entropy": [None if value is None else round(value, 4) for value in layer_entropy(model, eval_sets["val"])],
        "parent_accuracy": None,
        "pruning": pruning_report(model),
        "prior_arcs": prior_arcs(data),
    }
    sentences = data.tree_sentences()
    if sentences:
        supervised = supervised_heads(callbacks.values())
        summary["parent_accuracy"] = head_report(model, data.tokenizer, sentences, supervised, data.max_length)
    return summary


def summarize_decoder(
    cfg: DictConfig,
    model: PreTrainedModel,
    data: Any,
    callbacks: Mapping[str, L.Callback],
    trainer: L.Trainer,
    seconds: float,
    choices: Mapping[str, Any],
    unpruned: PreTrainedModel | None = None,
) -> dict[str, Any]:
    """The summary of a causal-LM or chat run: validation perplexity, entropy per layer, parent accuracy of the
    supervised heads over left parents (with the best left offset and the share of such words), greedy
    continuations of the data's prompts, the prior's coverage, and the heads removed with the parameter count and
    generation tokens/s against `unpruned` (the model before training) when there is one: both of the model as it
    would be served, a LoRA adapter merged into a copy (`served`).

    The example summarizes a tiny decoder not trained yet.

    Example:
        >>> import attnreg
        >>> from attnreg.app.lm import AgreementLMDataModule
        >>> from attnreg.app.models import tiny_causal_lm
        >>> data = AgreementLMDataModule(train=8, val=8); data.setup("fit")
        >>> callbacks = {"kl": attnreg.SyntaxPriorKL(layers=[1], heads=[0])}
        >>> cfg = OmegaConf.create({"seed": 0, "generate_tokens": 4})
        >>> summary = summarize_decoder(cfg, tiny_causal_lm(data.tokenizer), data, callbacks, L.Trainer(logger=False),
        ...                             1.0, {"model": "tiny_llama_lm"})
        >>> summary["task"], sorted(summary["perplexity"]), list(summary["parent_accuracy"]["supervised"])
        ('causal_lm', ['val'], ['L1H0'])
        >>> list(summary["continuations"]) == data.prompts, summary["pruning"]
        (True, None)
    """
    given, model = model, transformers_model(model)  # a PEFT model's base, its adapters in place
    val = data.loader("val")
    scores = perplexity(model, val)
    summary: dict[str, Any] = {
        "choices": {key: value for key, value in choices.items() if not key.startswith("hydra")},
        "seed": cfg.seed,
        "task": data.task,
        "attnreg": {name: type(callback).__name__ for name, callback in callbacks.items()},
        "steps": trainer.global_step,
        "epochs": trainer.current_epoch,
        "train_seconds": round(seconds, 1),
        "perplexity": {"val": scores["perplexity"]},
        "loss": {"val": scores["loss"]},
        "predicted_tokens": {"val": scores["tokens"]},
        "metrics": {key: round(float(value), 4) for key, value in trainer.callback_metrics.items()},
        "entropy": [None if value is None else round(value, 4) for value in layer_entropy(model, val)],
        "parent_accuracy": None,
        "continuations": greedy_continuations(
            model, data.tokenizer, data.prompts, cfg.get("generate_tokens", 16), chat=data.task == "chat"
        ),
        "pruning": pruning_report(model),
        "prior_arcs": prior_arcs(data),
    }
    sentences = data.tree_sentences()
    if sentences:
        supervised = supervised_heads(callbacks.values())
        summary["parent_accuracy"] = decoder_head_report(model, data.tokenizer, sentences, supervised, data.max_length)
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
    if summary.get("task") in ("causal_lm", "chat"):
        return format_decoder_summary(summary)
    choices = summary.get("choices", {})
    setting = f"{choices.get('model', 'model')} on {choices.get('data', 'data')}" if choices else "run"
    lines = [
        f"attnreg-train: {setting}, seed {summary['seed']}, {summary['steps']} steps in {summary['train_seconds']} s",
        "callbacks: " + (", ".join(f"{n} ({t})" for n, t in summary["attnreg"].items()) or "none"),
        "accuracy: " + ", ".join(f"{name} {value:.3f}" for name, value in summary["accuracy"].items()),
        "attention entropy per layer (normalized): " + ", ".join(_fraction(value) for value in summary["entropy"]),
    ]
    if "hard" in summary["accuracy"]:
        lines[2] += "  (test: 0-1 distractor verbs as in training; hard: 2)"
    heads = summary.get("parent_accuracy")
    if heads:
        supervised = _supervised(heads, summary.get("pruning"))
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
        removed = "; ".join(f"layer {layer}: {heads}" for layer, heads in pruning["removed"].items()) or "none removed"
        lines.append(
            f"heads pruned: {removed}{_silenced(pruning)} (heads left per layer {pruning['heads_left']}, saved to "
            f"{pruning.get('saved')})"
        )
    else:
        lines.append("heads pruned: none")
    lines += _saved_models(summary)
    lines.append(f"outputs: {summary.get('output_dir')}")
    return "\n".join(lines)


def format_decoder_summary(summary: Mapping[str, Any]) -> str:
    """A decoder run's summary as text (see `summarize_decoder`).

    Example:
        >>> summary = {"seed": 0, "steps": 40, "train_seconds": 3.2, "attnreg": {}, "task": "causal_lm",
        ...            "perplexity": {"val": 12.5}, "continuations": {"the dog": "sees a cat"}, "output_dir": "run",
        ...            "parent_accuracy": {"sentences": 8, "supervised": {"L1H0": 0.5}, "best_head": "L0H2",
        ...                                "best": 0.6, "best_offset": -1, "best_offset_accuracy": 0.4,
        ...                                "left_parent_share": 0.45},
        ...            "pruning": {"removed": {"1": [0, 1]}, "heads_left": [4, 2], "parameters": 900,
        ...                        "generation": {"pruned": {"tokens_per_second": 120.0, "parameters": 900},
        ...                                       "unpruned": {"tokens_per_second": 100.0, "parameters": 1000}},
        ...                        "speedup": 1.2}}
        >>> print(format_decoder_summary(summary))
        attnreg-train: causal_lm run, seed 0, 40 steps in 3.2 s
        callbacks: none
        validation perplexity: 12.50
        parent accuracy over the 45.0% of words whose parent is to their left (8 held-out sentences): supervised ...
        heads pruned: 2 (layer 1: [0, 1]); 900 parameters against 1000; generation 120.0 tokens/s against 100.0 ...
        greedy: 'the dog' -> 'sees a cat'
        outputs: run
    """
    choices = summary.get("choices", {})
    setting = f"{choices.get('model', 'model')} on {choices.get('data', 'data')}" if choices else "run"
    lines = [
        f"attnreg-train: {summary['task']} {setting}, seed {summary['seed']}, {summary['steps']} steps in "
        f"{summary['train_seconds']} s",
        "callbacks: " + (", ".join(f"{n} ({t})" for n, t in summary["attnreg"].items()) or "none"),
        f"validation perplexity: {summary['perplexity']['val']:.2f}",
    ]
    heads = summary.get("parent_accuracy")
    if heads:
        supervised = _supervised(heads, summary.get("pruning"))
        lines.append(
            f"parent accuracy over the {heads['left_parent_share']:.1%} of words whose parent is to their left "
            f"({heads['sentences']} held-out sentences): supervised {supervised}; best head {heads['best_head']} "
            f"{_fraction(heads['best'])}; best left offset ({heads['best_offset']}) {heads['best_offset_accuracy']:.3f}"
        )
    arcs = summary.get("prior_arcs")
    if arcs and arcs.get("causal_rows"):
        dropped, rows = arcs["causal_rows_dropped"], arcs["causal_rows"]
        lines.append(f"syntax prior: {rows - dropped} of {rows} prior rows used (the others' parent is to the right)")
    pruning = summary.get("pruning")
    if pruning:
        count = sum(len(heads) for heads in pruning["removed"].values())
        removed = "; ".join(f"layer {layer}: {heads}" for layer, heads in pruning["removed"].items())
        line = f"heads pruned: {count} ({removed}){_silenced(pruning)}; {pruning['parameters']} parameters"
        speed = pruning.get("generation")
        if speed:
            line += (
                f" against {speed['unpruned']['parameters']}; generation {speed['pruned']['tokens_per_second']} "
                f"tokens/s against {speed['unpruned']['tokens_per_second']} unpruned ({pruning['speedup']:.2f}x)"
            )
        lines.append(line)
        control = pruning.get("control")
        if control:
            lines.append(
                f"unpruned control, recovered the same way ({control['steps']} steps): validation perplexity "
                f"{control['perplexity']:.2f}; the pruned model's is {control['ratio']:.3f}x it"
            )
    else:
        lines.append("heads pruned: none")
    for prompt, continuation in (summary.get("continuations") or {}).items():
        lines.append(f"greedy: {prompt!r} -> {continuation!r}")
    lines += _saved_models(summary)
    lines.append(f"outputs: {summary.get('output_dir')}")
    return "\n".join(lines)


def _silenced(pruning: Mapping[str, Any]) -> str:
    """The silenced heads (grouped-query attention keeps them in place, adding nothing), for the pruning line."""
    silenced = "; ".join(f"layer {layer}: {heads}" for layer, heads in (pruning.get("silenced") or {}).items())
    return f"; silenced (in place, adding nothing): {silenced}" if silenced else ""


def _supervised(heads: Mapping[str, Any], pruning: Mapping[str, Any] | None) -> str:
    """The supervised heads' parent accuracy, a head that was removed or silenced named so."""
    silenced = {
        f"L{layer}H{head}" for layer, numbers in ((pruning or {}).get("silenced") or {}).items() for head in numbers
    }
    values = [
        f"{name} {'silenced' if value is None and name in silenced else _fraction(value)}"
        for name, value in heads["supervised"].items()
    ]
    return ", ".join(values) or "none"


def _saved_models(summary: Mapping[str, Any]) -> list[str]:
    """A line per model folder the run wrote (`adapter`, `merged_model`, `model`)."""
    return [
        f"{name.replace('_', ' ')}: {summary[name]}"
        for name in ("adapter", "merged_model", "model")
        if summary.get(name)
    ]


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
