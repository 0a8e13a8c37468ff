"""What the training app measures on a fitted model: accuracy, attention entropy per layer, parent
accuracy of chosen heads against gold trees, and the heads pruning removed.

Each helper takes a transformers model and held-out data, leaves the model's train/eval mode as it
found it, and returns plain numbers (JSON-ready: a removed head reads None).

Example:
    >>> from attnreg.app.datamodules import AgreementDataModule
    >>> from attnreg.tiny import tiny_model
    >>> data = AgreementDataModule(train=8, val=4, test=4, hard=2, seed=0); data.setup("fit")
    >>> model = tiny_model("bert", head="classification", vocab=len(data.tokenizer))
    >>> accuracy(model, data.loader("val"))
    0.25
    >>> [round(value, 3) for value in layer_entropy(model, data.loader("val"))]   # an untrained model: uniform
    [1.0, 1.0]
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from attnreg.analysis import parent_accuracy
from attnreg.heads import head_numbers, pruned_heads, silenced_heads
from attnreg.hub import attach
from attnreg.losses import attention_entropy
from attnreg.methods.pruning import count_parameters
from attnreg.unwrap import transformers_model


@torch.no_grad()
def accuracy(model: PreTrainedModel, loader: DataLoader) -> float:
    """Share of examples whose argmax logit is the label (model in eval mode meanwhile).

    Example:
        >>> from attnreg.app.datamodules import AgreementDataModule
        >>> from attnreg.tiny import tiny_model
        >>> data = AgreementDataModule(train=8, val=4, test=4, hard=2, seed=0); data.setup("fit")
        >>> model = tiny_model("bert", head="classification", vocab=len(data.tokenizer))
        >>> accuracy(model, data.loader("hard")), model.training     # its mode is restored
        (0.0, True)
    """
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
def layer_entropy(model: PreTrainedModel, loader: DataLoader, max_batches: int = 4) -> list[float | None]:
    """Normalized attention entropy per layer (mean over heads and rows; 1 = uniform) on `loader`; None for a
    layer that pruning emptied (it has no attention left).

    Example:
        >>> from attnreg.app.datamodules import AgreementDataModule
        >>> from attnreg.methods.pruning import prune_heads
        >>> from attnreg.tiny import tiny_model
        >>> data = AgreementDataModule(train=8, val=4, test=4, hard=2, seed=0); data.setup("fit")
        >>> model = tiny_model("bert", head="classification", vocab=len(data.tokenizer))
        >>> [round(value, 3) for value in layer_entropy(model, data.loader("val"), max_batches=1)]
        [1.0, 1.0]
        >>> report = prune_heads(model, {1: [0, 1, 2, 3]})                   # layer 1 loses all its heads
        >>> [value if value is None else round(value, 3) for value in layer_entropy(model, data.loader("val"))]
        [1.0, None]
    """
    hub = attach(model)
    inputs = _input_names(model)
    layers = [layer for layer in range(hub.num_layers) if head_numbers(model, layer)]  # emptied layers: None
    totals = torch.zeros(hub.num_layers)
    batches = 0
    was_training = model.training
    model.eval()
    try:
        with hub.capture(layers=layers) as probs:
            for batch in loader:
                model(**{k: v.to(model.device) for k, v in batch.items() if k in inputs and k != "labels"})
                mask = batch["attention_mask"].to(model.device)
                for layer in layers:
                    layer_mask, sink = probs.attention_mask(layer), probs.has_sink(layer)  # gpt-oss: one more outcome
                    entropy = attention_entropy(probs[layer], mask, hub.family.causal, True, layer_mask, sink)
                    totals[layer] += float(entropy.mean())
                batches += 1
                if batches == max_batches:
                    break
    finally:
        model.train(was_training)
    means = (totals / max(batches, 1)).tolist()
    return [means[layer] if layer in layers else None for layer in range(hub.num_layers)]


def pruning_report(model: PreTrainedModel) -> dict[str, Any] | None:
    """What was done to the model's heads, read from its record: the heads removed and those silenced (original
    numbers per layer), the heads left (silenced ones included: they still run) and the parameter count; None when
    no head was removed or silenced.

    Example:
        >>> from attnreg.methods.pruning import prune_heads, silence_heads
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert", head="classification")
        >>> pruning_report(model) is None
        True
        >>> report = prune_heads(model, {0: [1, 3]})
        >>> pruning_report(model)
        {'removed': {'0': [1, 3]}, 'silenced': {}, 'heads_left': [2, 4], 'parameters': 23506}
        >>> silence_heads(model, {1: [2]}); pruning_report(model)["silenced"]
        {'1': [2]}
    """
    model = transformers_model(model)
    removed, silenced = pruned_heads(model), silenced_heads(model)
    if not removed and not silenced:
        return None
    layers = attach(model).num_layers
    return {
        "removed": {str(layer): list(heads) for layer, heads in removed.items()},
        "silenced": {str(layer): list(heads) for layer, heads in silenced.items() if heads},
        "heads_left": [len(head_numbers(model, layer)) for layer in range(layers)],
        "parameters": count_parameters(model),
    }


def without_silenced(result: Any, model: torch.nn.Module) -> Any:
    """`result` (`attnreg.analysis.parent_accuracy`'s) with the model's silenced heads read as absent (NaN), as
    removed heads are: they add nothing to the model's output, whatever their attention looks like.

    Example:
        >>> from attnreg.analysis import ParentAccuracy
        >>> from attnreg.methods.pruning import silence_heads
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert"); silence_heads(model, {0: [1]})
        >>> result = ParentAccuracy(hits=torch.zeros(2, 4)); result.present[:] = True
        >>> without_silenced(result, model).present[0].tolist()
        [True, False, True, True]
    """
    for layer, heads in silenced_heads(transformers_model(model)).items():
        result.present[layer, list(heads)] = False
    return result


def head_report(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: list[Any],
    supervised: Mapping[int, list[int] | None],
    max_length: int | None,
) -> dict[str, Any]:
    """Word-level parent accuracy of the `supervised` heads ({layer: heads}, None = all) and of the best
    head, with the right-branching baseline (for a decoder: the left-branching one and the share of words
    whose parent is to their left, over which its accuracy is), on `sentences` (gold trees).

    Example:
        >>> from attnreg.app.datamodules import AgreementDataModule
        >>> from attnreg.tiny import tiny_model
        >>> data = AgreementDataModule(train=8, val=4, test=4, hard=2, seed=0); data.setup("fit")
        >>> model = tiny_model("bert", head="classification", vocab=len(data.tokenizer))
        >>> report = head_report(model, data.tokenizer, data.tree_sentences(), {0: [0], 1: [0]}, max_length=64)
        >>> sorted(report["supervised"]), report["sentences"], len(report["per_head"])
        (['L0H0', 'L1H0'], 4, 2)
    """
    result = without_silenced(parent_accuracy(model, tokenizer, sentences, max_length=max_length), model)
    table = result.accuracy
    chosen = {
        f"L{layer}H{head}": _number(table[layer, head])
        for layer, heads in sorted(supervised.items())
        for head in (range(table.shape[1]) if heads is None else heads)
    }
    present = [value for value in chosen.values() if value is not None]  # removed heads read None
    layer, head, best = result.best_head()
    report = {
        "sentences": len(sentences),
        "supervised": chosen,
        "supervised_mean": round(sum(present) / len(present), 4) if present else None,
        "best_head": f"L{layer}H{head}",
        "best": _number(best),
        "per_head": [[_number(value) for value in row] for row in table],
    }
    if result.causal:  # a decoder: accuracy is over parents to the left, the baseline a left offset
        report["reachable_share"] = round(result.reachable_share(), 4)
        report["left_branching"] = round(result.baseline(-1), 4)
    else:
        report["right_branching"] = round(result.baseline(1), 4)
    return report


def _number(value: Any) -> float | None:
    """A rounded float, or None for NaN (a removed head), so that summary.json stays valid JSON."""
    value = float(value)
    return None if math.isnan(value) else round(value, 4)


def _input_names(model: PreTrainedModel) -> set[str]:
    return set(inspect.signature(model.forward).parameters)
