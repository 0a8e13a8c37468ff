"""Saving and loading pruned models: `save_pretrained` plus a pruning spec re-applied before the weights load."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from torch import nn

from attnreg.families import Family, detect_family
from attnreg.hub import GATE, TEMPERATURE, attach
from attnreg.pruning.gates import _hub_or_none
from attnreg.pruning.record import PRUNED_HEADS, SILENCED_HEADS, pruned_heads, silenced_heads
from attnreg.pruning.surgery import prune_heads, silence_heads

SPEC_FILE = "attnreg_pruning.json"
_SPEC_FORMAT = 1


def save_pruned(
    model: transformers.PreTrainedModel,
    directory: str | Path,
    tokenizer: transformers.PreTrainedTokenizerBase | None = None,
) -> Path:
    """Save a (pruned) model: safetensors weights and config via `save_pretrained`, plus `attnreg_pruning.json`,
    and `tokenizer` beside them when given (tools such as `attnreg-analyze` need it).

    Hub gates and temperatures are saved too; hard-concrete gates must be folded first (`fold_gates`).

    Example:
        >>> import tempfile
        >>> from attnreg.pruning import prune_heads
        >>> from attnreg.task import build_tokenizer
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert", head="classification")
        >>> report = prune_heads(model, {0: [1, 3]})
        >>> folder = save_pruned(model, tempfile.mkdtemp(), tokenizer=build_tokenizer(["a", "b"]))
        >>> sorted(path.name for path in folder.iterdir())
        ['attnreg_pruning.json', 'config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json']
    """
    family = detect_family(model)
    hub = _hub_or_none(model)
    if hub is not None and any(isinstance(gate, nn.Module) for gate in hub.gates.values()):
        raise ValueError(
            "save_pruned: the model has gate modules (hard-concrete); fold them first with fold_gates(model)"
        )
    directory = Path(directory)
    type(model).save_pretrained(model, directory)  # not an attached model's own, which folds gates: these load back
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    spec = {
        "format": _SPEC_FORMAT,
        "class": type(model).__name__,
        "family": family.name,
        "pruned_heads": {str(layer): list(heads) for layer, heads in pruned_heads(model).items()},
        "silenced_heads": {str(layer): list(heads) for layer, heads in silenced_heads(model).items()},
        "heads": [
            list(family.head_counts(family.attention_module(model, i))) for i in range(len(family.blocks(model)))
        ],
    }
    (directory / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")
    return directory


def load_pruned(directory: str | Path) -> transformers.PreTrainedModel:
    """Load what `save_pruned` wrote: rebuild the model from its config, re-apply the pruning spec, then
    load the weights strictly. Returns the same class, in eval mode (as `from_pretrained` does).

    Raises `ValueError` naming the tensor and layer when the spec disagrees with the weights.

    Example:
        >>> import tempfile
        >>> from attnreg.pruning import prune_heads, pruned_heads
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("gpt2", head="causal_lm")
        >>> report = prune_heads(model, {1: [0, 1, 2]})
        >>> same = load_pruned(save_pruned(model, tempfile.mkdtemp()))
        >>> type(same).__name__, pruned_heads(same), same.training
        ('GPT2LMHeadModel', {1: (0, 1, 2)}, False)
        >>> inputs = torch.tensor([[5, 6, 7]])
        >>> torch.equal(model.eval()(inputs).logits, same(inputs).logits)
        True
    """
    directory = Path(directory)
    spec_path = directory / SPEC_FILE
    if not spec_path.is_file():
        raise FileNotFoundError(f"{spec_path} is missing: was {directory} written by attnreg.pruning.save_pruned?")
    spec = json.loads(spec_path.read_text())
    if spec.get("format") != _SPEC_FORMAT:
        raise ValueError(f"{spec_path}: unknown format {spec.get('format')!r} (this attnreg reads {_SPEC_FORMAT})")
    model_class = getattr(transformers, spec["class"], None)
    if model_class is None:
        raise ValueError(f"{spec_path}: class {spec['class']!r} is not a transformers class")
    config = transformers.AutoConfig.from_pretrained(directory)
    for name, key in ((PRUNED_HEADS, "pruned_heads"), (SILENCED_HEADS, "silenced_heads")):
        recorded = getattr(config, name, None) or {}
        if {k: list(v) for k, v in recorded.items()} != spec.get(key, {}):
            raise ValueError(
                f"{directory}: config.json records {key.replace('_', ' ')} {recorded} but {SPEC_FILE} says "
                f"{spec.get(key, {})}"
            )
        setattr(config, name, {})
    model = model_class(config)
    family = detect_family(model)
    prune_heads(model, {int(layer): heads for layer, heads in spec["pruned_heads"].items()})
    silence_heads(model, {int(layer): heads for layer, heads in spec.get("silenced_heads", {}).items()})
    layout = [list(family.head_counts(family.attention_module(model, i))) for i in range(len(family.blocks(model)))]
    if layout != spec["heads"]:
        raise ValueError(
            f"{spec_path}: re-applying the spec gives heads {layout} per layer, the spec says {spec['heads']}"
        )
    weights = _read_weights(directory)
    if any(key.endswith((f".{GATE}", f".{TEMPERATURE}")) for key in weights):
        attach(model)
    _load_checked(model, family, weights, directory)
    return model.eval()


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing (save_pruned writes safetensors weights)")
        weights.update(load_file(path))
    return weights


def _load_checked(model: nn.Module, family: Family, weights: dict[str, torch.Tensor], directory: Path) -> None:
    expected = model.state_dict()
    mismatches = [
        f"{key}: weights {tuple(tensor.shape)}, pruning spec {tuple(expected[key].shape)}{_layer_of(family, key)}"
        for key, tensor in weights.items()
        if key in expected and expected[key].shape != tensor.shape
    ]
    if mismatches:
        raise ValueError(f"{directory}: the pruning spec disagrees with the weights: " + "; ".join(mismatches[:5]))
    floating = [t.dtype for t in weights.values() if t.is_floating_point()]
    if floating and floating[0] != next(model.parameters()).dtype:
        model.to(floating[0])
    result = model.load_state_dict(weights, strict=False)
    tied = {id(t) for key, t in model.state_dict(keep_vars=True).items() if key in weights}
    state = model.state_dict(keep_vars=True)
    missing = [key for key in result.missing_keys if id(state[key]) not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{directory}: weights do not match the model: missing {missing}, unexpected {result.unexpected_keys}"
        )


def _layer_of(family: Family, key: str) -> str:
    marker = f"{family.blocks_path}."
    if marker not in key:
        return ""
    return f" (layer {key.split(marker, 1)[1].split('.', 1)[0]})"
