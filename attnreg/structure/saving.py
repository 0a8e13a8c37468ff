"""Saving and loading pruned models: `save_pretrained` plus the structure record (`attnreg.structure.record`),
restored before the weights load."""

from __future__ import annotations

import copy
import inspect
import json
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file
from torch import nn

from attnreg import weights
from attnreg.families import Family, detect_family
from attnreg.heads import PRUNED_HEADS, SILENCED_HEADS, pruned_heads, silenced_heads
from attnreg.hub import attach, detach, is_attached
from attnreg.records import GATE, TEMPERATURE
from attnreg.structure.gates import _hub_or_none, _transformers_model, folded_gates
from attnreg.structure.record import RECORD_FILE, _heads, read_record, restore_record, write_record

SPEC_FILE = RECORD_FILE
"""Its name in 0.1.0 and 0.2.0 (the pruning spec, now the structure record)."""
write_spec = write_record
"""Its name in 0.1.0 and 0.2.0."""
restore_saved_pruning = restore_record
"""Its name in 0.2.0 (a folder's record, restored on a model)."""
_SAVE_PARAMETERS = inspect.signature(transformers.PreTrainedModel.save_pretrained).parameters
LOAD_WITH = "attnreg_pruned_heads__load_this_folder_with__attnreg_methods_pruning_load_pruned"
"""A one-number tensor `save_pruned` adds to the weights of a model with removed heads: transformers'
`from_pretrained` cannot load them (the config keeps the original head counts) and lists this key at the top of
its load report, so the name says what does; `load_pruned` leaves it out."""


def save_pruned(
    model: transformers.PreTrainedModel,
    directory: str | Path,
    tokenizer: transformers.PreTrainedTokenizerBase | None = None,
) -> Path:
    """Save a (pruned) model: safetensors weights and config via `save_pretrained`, plus its structure record
    (`write_record`: `attnreg_pruning.json`), and `tokenizer` beside them when given (tools such as `attnreg-analyze`
    need it).

    Hub gates and temperatures are saved unfolded, as training has them (a training checkpoint resumes from
    them exactly); the record keeps each gate (a hard-concrete one with its settings), and `load_pruned` rebuilds it.

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
    write_record(model, directory)
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


class AdapterLeftOutWarning(UserWarning):
    """`load_pruned` read a folder that also holds a LoRA adapter (`adapter_config.json`), and returned the model
    without it: not the model the run trained. `PeftModel.from_pretrained(load_pruned(folder), folder)` (merged:
    `.merge_and_unload()`, as `attnreg.app.analyze.load_folder` does) gives that one."""


def load_pruned(directory: str | Path) -> transformers.PreTrainedModel:
    """Load what `save_pruned` wrote (or a plain `save_pretrained` of a pruned model, or a folder an older attnreg
    wrote): rebuild the model from its config, restore its structure record (`restore_record`, which refuses a
    record the weights contradict, naming the layer and tensor), then load the weights strictly. Returns the same
    class, in eval mode (as `from_pretrained` does).

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
    if (directory / "adapter_config.json").is_file():
        warnings.warn(
            f"{directory} holds a LoRA adapter beside the pruned model, and load_pruned returns the model without it; "
            f"the trained model is PeftModel.from_pretrained(load_pruned({str(directory)!r}), {str(directory)!r}) "
            "(attnreg.app.analyze.load_folder merges it)",
            AdapterLeftOutWarning,
            stacklevel=2,
        )
    record = read_record(directory)
    if record is None or record.model_class is None:
        raise FileNotFoundError(
            f"{directory / RECORD_FILE} is missing, and {directory / 'config.json'} records no heads removed or "
            f"silenced: was {directory} written by attnreg.methods.pruning.save_pruned (or save_pretrained of a "
            "pruned model)?"
        )
    model_class = getattr(transformers, record.model_class, None)
    if model_class is None:
        raise ValueError(f"{directory / RECORD_FILE}: class {record.model_class!r} is not a transformers class")
    config = transformers.AutoConfig.from_pretrained(directory)
    for name, key, recorded in (
        (PRUNED_HEADS, "pruned heads", record.pruned),
        (SILENCED_HEADS, "silenced heads", record.silenced),
    ):
        if _heads(getattr(config, name, None)) != recorded:
            raise ValueError(
                f"{directory}: config.json records {key} {getattr(config, name, None) or {}} but {RECORD_FILE} says "
                f"{ {str(layer): list(heads) for layer, heads in recorded.items()} }"
            )
        setattr(config, name, {})
    model = model_class(config)
    family = detect_family(model)
    _weight_files(directory)
    restore_record(model, directory)
    weights = _read_weights(directory)
    if any(key.endswith((f".{GATE}", f".{TEMPERATURE}")) for key in weights):
        attach(model)  # the hub makes the gates and temperatures the weights hold as they load
    _load_checked(model, family, weights, directory)
    return model.eval()


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
