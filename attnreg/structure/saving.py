"""Saving and loading pruned models: `save_pretrained` plus a pruning spec re-applied before the weights load."""

from __future__ import annotations

import copy
import inspect
import json
import sys
import types
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from attnreg import weights
from attnreg.families import Family, detect_family
from attnreg.heads import PRUNED_HEADS, SILENCED_HEADS, PruneReport, pruned_heads, silenced_heads
from attnreg.hub import attach, detach, is_attached
from attnreg.records import GATE, TEMPERATURE
from attnreg.structure.checkpoints import FOLDED_GATES, restore_pruning
from attnreg.structure.gates import _hub_or_none, _transformers_model, folded_gates, make_hard_concrete
from attnreg.structure.surgery import prune_heads, silence_heads

SPEC_FILE = "attnreg_pruning.json"
_SAVE_PARAMETERS = inspect.signature(transformers.PreTrainedModel.save_pretrained).parameters
_SPEC_FORMAT = 1
LOAD_WITH = "attnreg_pruned_heads__load_this_folder_with__attnreg_methods_pruning_load_pruned"
"""A one-number tensor `save_pruned` adds to the weights of a model with removed heads: transformers'
`from_pretrained` cannot load them (the config keeps the original head counts) and lists this key at the top of
its load report, so the name says what does; `load_pruned` leaves it out."""


def save_pruned(
    model: transformers.PreTrainedModel,
    directory: str | Path,
    tokenizer: transformers.PreTrainedTokenizerBase | None = None,
) -> Path:
    """Save a (pruned) model: safetensors weights and config via `save_pretrained`, plus `attnreg_pruning.json`,
    and `tokenizer` beside them when given (tools such as `attnreg-analyze` need it).

    Hub gates and temperatures are saved unfolded, as training has them (a training checkpoint resumes from
    them exactly); a hard-concrete gate's settings go in the spec, and `load_pruned` rebuilds it.

    Example:
        >>> import tempfile
        >>> from attnreg.methods.pruning import prune_heads
        >>> from attnreg.app.task import build_tokenizer
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert", head="classification")
        >>> report = prune_heads(model, {0: [1, 3]})
        >>> folder = save_pruned(model, tempfile.mkdtemp(), tokenizer=build_tokenizer(["a", "b"]))
        >>> sorted(path.name for path in folder.iterdir())
        ['attnreg_pruning.json', 'config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json']
    """
    directory = Path(directory)
    model = _transformers_model(model)
    # Not an attached model's own save_pretrained, which folds gates: these load back. The weights are written
    # as the model holds them: the original format of some families (mixture-of-experts) is converted back only
    # by from_pretrained, which a pruned model cannot use.
    options = {"save_original_format": False} if "save_original_format" in _SAVE_PARAMETERS else {}
    adapters = weights.adapter_layers(model)
    if adapters:
        options["state_dict"] = weights.without_adapters(model)
    if pruned_heads(model):  # a pointer to load_pruned in what from_pretrained reports
        options["state_dict"] = {**options.get("state_dict", model.state_dict()), LOAD_WITH: torch.zeros(1)}
    type(model).save_pretrained(model, directory, **options)
    if adapters:
        save_adapters(model, directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    write_spec(model, directory)
    return directory


def save_adapters(model: nn.Module, directory: str | Path) -> list[Path]:
    """Write the PEFT adapters injected into `model` (a `PeftModel` or the transformers model inside one) as
    `PeftModel.save_pretrained` writes them: `adapter_config.json` and `adapter_model.safetensors` in `directory`
    for the `default` adapter, in `directory/<name>` for the others. `save_pruned` calls it, so that
    `PeftModel.from_pretrained(load_pruned(directory), directory)` gives the pruned model with its adapter.

    Example:
        >>> import tempfile
        >>> import peft
        >>> from attnreg.tiny import tiny_model
        >>> config = peft.LoraConfig(r=2, target_modules=["q_proj"])
        >>> model = peft.get_peft_model(tiny_model("llama", head="causal_lm"), config)
        >>> [path.name for path in save_adapters(model, tempfile.mkdtemp())]
        ['adapter_model.safetensors']
    """
    import peft
    from safetensors.torch import save_file

    model = _transformers_model(model)
    configs = getattr(model, "peft_config", None)
    if not configs:
        raise ValueError(
            f"{type(model).__name__} holds PEFT layers {sorted(weights.adapter_layers(model))[:3]} but no "
            "peft_config: save it through its PeftModel (peft.get_peft_model)"
        )
    written = []
    for name, config in configs.items():
        folder = Path(directory) if name == "default" else Path(directory, name)
        folder.mkdir(parents=True, exist_ok=True)
        state = peft.get_peft_model_state_dict(model, adapter_name=name)
        # keys as a PeftModel names them: its base_model (the tuner) holds the transformers model as `model`
        state = {f"base_model.model.{key}": tensor.detach().contiguous() for key, tensor in state.items()}
        config = copy.deepcopy(config)
        config.inference_mode = True
        config.save_pretrained(folder)
        save_file(state, folder / "adapter_model.safetensors", metadata={"format": "pt"})
        written.append(folder / "adapter_model.safetensors")
    return written


def base_changed(model: nn.Module) -> bool:
    """Whether the weights under a PEFT adapter are no longer the base model's: heads removed or silenced, gates
    folded into them, or hub gates and temperatures (which an adapter's files do not hold).

    Example:
        >>> from attnreg.methods.pruning import silence_heads
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("llama"); base_changed(model)
        False
        >>> silence_heads(model, {0: [1]}); base_changed(model)
        True
    """
    inner = _transformers_model(model)
    return bool(pruned_heads(inner) or any(silenced_heads(inner).values()) or folded_gates(inner) or _live(inner))


def _live(model: nn.Module) -> bool:
    """Whether the model's hub holds gates or temperatures (not folded into the weights)."""
    hub = _hub_or_none(model)
    return hub is not None and bool(hub.gates or any(hub.temperature(i) is not None for i in range(hub.num_layers)))


def keep_base_in_adapter_saves(root: nn.Module) -> list[nn.Module]:
    """Make `save_pretrained` of every `PeftModel` in `root` (itself included) write, where its base weights changed
    (`base_changed`), those weights beside the adapter (`save_pruned`'s files) and point `adapter_config.json` at
    the folder: PEFT's save alone writes the adapter, which on the original base is another model. The folder then
    reloads alone: `peft.AutoPeftModelFor...from_pretrained(folder)` where no head was removed, else
    `PeftModel.from_pretrained(load_pruned(folder), folder)` (plain `from_pretrained` of such a base refuses,
    naming `load_pruned`). `Trainer.save_model` and `SFTTrainer.save_model` go through it. Returns the models.

    Example:
        >>> import tempfile
        >>> import peft
        >>> from attnreg.methods.pruning import prune_heads
        >>> from attnreg.tiny import tiny_model
        >>> config = peft.LoraConfig(r=2, target_modules=["q_proj"])
        >>> model = peft.get_peft_model(tiny_model("llama", head="causal_lm"), config)
        >>> _ = keep_base_in_adapter_saves(model); _ = prune_heads(model, {0: [0, 1]})
        >>> folder = tempfile.mkdtemp(); model.save_pretrained(folder)
        >>> ids = torch.tensor([[3, 4, 5]])
        >>> same = peft.PeftModel.from_pretrained(load_pruned(folder), folder)
        >>> torch.allclose(same(ids).logits, model.eval()(ids).logits, atol=1e-6)
        True
    """
    peft = sys.modules.get("peft")  # no PEFT model exists where peft was never imported (it is an extra)
    if peft is None:
        return []
    found = [module for module in root.modules() if isinstance(module, peft.PeftModel)]
    for model in found:
        if "save_pretrained" not in vars(model):
            object.__setattr__(model, "save_pretrained", types.MethodType(_save_adapter_and_base, model))
    return found


def _save_adapter_and_base(model: nn.Module, save_directory: str | Path, *args: Any, **kwargs: Any) -> None:
    inner = _transformers_model(model)
    if is_attached(inner) and "save_pretrained" not in vars(inner):  # a training checkpoint (`unfolded_saves`):
        return type(model).save_pretrained(model, save_directory, *args, **kwargs)  # its structure record goes along
    changed = base_changed(model)
    if _live(inner) and kwargs.get("state_dict") is None:  # folded into a copy, as an attached model's save does
        model = copy.deepcopy(model)
        detach(model)
    type(model).save_pretrained(model, save_directory, *args, **kwargs)
    if not kwargs.get("is_main_process", True) or not changed:
        return
    directory = Path(save_directory)
    save_pruned(model, directory)  # the base as trained (without the adapters), its record, the adapters again
    for config in directory.rglob("adapter_config.json"):
        settings = json.loads(config.read_text())
        settings["base_model_name_or_path"] = str(directory.resolve())
        config.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def write_spec(model: transformers.PreTrainedModel, directory: str | Path) -> Path:
    """Write `attnreg_pruning.json` for the weights saved in `directory` (what `save_pruned` adds to
    `save_pretrained`): the pruned and silenced heads, the heads per layer, and each hard-concrete gate's
    settings. The Hugging Face adapter writes it into every checkpoint.

    Example:
        >>> import tempfile
        >>> from attnreg.methods.pruning import make_hard_concrete
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert")
        >>> _ = make_hard_concrete(attach(model), 1, temperature=0.5)
        >>> spec = json.loads(write_spec(model, tempfile.mkdtemp()).read_text())
        >>> spec["heads"], spec["hard_concrete"]
        ([[4, 4], [4, 4]], {'1': {'temperature': 0.5, 'stretch': [-0.1, 1.1]}})
    """
    family = detect_family(model)
    hub = _hub_or_none(model)
    modules = {} if hub is None else {layer: g for layer, g in hub.gates.items() if isinstance(g, nn.Module)}
    spec = {
        "format": _SPEC_FORMAT,
        "class": type(model).__name__,
        "family": family.name,
        "pruned_heads": {str(layer): list(heads) for layer, heads in pruned_heads(model).items()},
        "silenced_heads": {str(layer): list(heads) for layer, heads in silenced_heads(model).items()},
        "heads": [
            list(family.head_counts(family.attention_module(model, i))) for i in range(len(family.blocks(model)))
        ],
        "hard_concrete": {
            str(layer): {"temperature": gate.temperature, "stretch": list(gate.stretch)}
            for layer, gate in modules.items()
        },
    }
    path = Path(directory) / SPEC_FILE
    path.write_text(json.dumps(spec, indent=2) + "\n")
    return path


def load_pruned(directory: str | Path) -> transformers.PreTrainedModel:
    """Load what `save_pruned` wrote: rebuild the model from its config, re-apply the pruning spec, then
    load the weights strictly. Returns the same class, in eval mode (as `from_pretrained` does).

    Raises `ValueError` naming the tensor and layer when the spec disagrees with the weights.

    Example:
        >>> import tempfile
        >>> from attnreg.methods.pruning import prune_heads, pruned_heads
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
    spec = json.loads(spec_path.read_text()) if spec_path.is_file() else _spec_from_config(directory)
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
    if spec["heads"] is not None and layout != spec["heads"]:
        raise ValueError(
            f"{spec_path}: re-applying the spec gives heads {layout} per layer, the spec says {spec['heads']}"
        )
    weights = _read_weights(directory)
    if any(key.endswith((f".{GATE}", f".{TEMPERATURE}")) for key in weights) or spec.get("hard_concrete"):
        hub = attach(model)
        for layer, settings in spec.get("hard_concrete", {}).items():
            make_hard_concrete(hub, int(layer), temperature=settings["temperature"], stretch=settings["stretch"])
    _load_checked(model, family, weights, directory)
    return model.eval()


def _spec_from_config(directory: Path) -> dict[str, Any]:
    """The spec of a folder that a plain `save_pretrained` wrote from a pruned or silenced model: its config.json
    holds the record (`attnreg_pruned_heads`, `attnreg_silenced_heads`) and the class; no hard-concrete gate."""
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if not (config.get(PRUNED_HEADS) or config.get(SILENCED_HEADS)) or not config.get("architectures"):
        raise FileNotFoundError(
            f"{directory / SPEC_FILE} is missing, and {config_path} records no heads removed or silenced: was "
            f"{directory} written by attnreg.methods.pruning.save_pruned (or save_pretrained of a pruned model)?"
        )
    return {
        "format": _SPEC_FORMAT,
        "class": config["architectures"][0],
        "pruned_heads": config.get(PRUNED_HEADS) or {},
        "silenced_heads": config.get(SILENCED_HEADS) or {},
        "heads": None,  # nothing to check the re-applied record against but the weights themselves
    }


def restore_saved_pruning(model: nn.Module, directory: str | Path) -> PruneReport | None:
    """Re-apply to `model` (built as the run began) the pruning of a folder `save_pruned` or the Hugging Face
    adapter's checkpoints wrote, so that its weights load: removed and silenced heads, and the gates folded
    at the removal taken off. A no-op for a folder without `attnreg_pruning.json`.

    Example:
        >>> import tempfile
        >>> from attnreg.tiny import tiny_model
        >>> pruned = tiny_model("bert"); _ = prune_heads(pruned, {0: [1, 2]})
        >>> folder = save_pruned(pruned, tempfile.mkdtemp())
        >>> restore_saved_pruning(tiny_model("bert"), folder).heads        # the saved weights fit now
        {0: (2, 2), 1: (4, 4)}
    """
    directory = Path(directory)
    if not (directory / SPEC_FILE).is_file():
        return None
    spec = json.loads((directory / SPEC_FILE).read_text())
    hub = _hub_or_none(model)
    record = {
        PRUNED_HEADS: spec["pruned_heads"],
        SILENCED_HEADS: spec.get("silenced_heads", {}),
        FOLDED_GATES: [] if hub is None else list(hub.gates),  # those absent from the weights go
        "state_dict": dict.fromkeys(_weight_names(directory)),
    }
    return restore_pruning(model, record)


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    paths = [directory / name for name in files]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing (save_pruned writes safetensors weights)")
    return paths


def _weight_names(directory: Path) -> list[str]:
    names = []
    for path in _weight_files(directory):
        with safe_open(path, framework="pt") as weights:
            names += [name for name in weights.keys() if name != LOAD_WITH]
    return names


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    weights = {}
    for path in _weight_files(directory):
        weights.update(load_file(path))
    weights.pop(LOAD_WITH, None)
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
