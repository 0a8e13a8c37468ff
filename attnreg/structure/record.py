"""The one record of what was done to a model's structure, and the pair that carries it: `write_record` writes it
beside any weights, `restore_record` rebuilds it on a model before they load.

`record_of(model)` reads the record from the model, where every change keeps it: heads removed and silenced in
`model.config` (`attnreg.heads`), the hub's gates with their values (hard-concrete ones with their settings), and
the gate values folded into the weights at a removal. Beside weights it is `attnreg_pruning.json` (`to_dict`, with
its `format`); in a training checkpoint dict it is the same fields named `attnreg_<field>` (`to_checkpoint`).
Every older form reads back (`StructureRecord.from_dict`, `read_record`): 0.1.0's and 0.2.0's pruning spec, 0.2.0's
`attnreg_structure.json`, the entries of a Lightning checkpoint, a config.json that records heads.

Example:
    >>> import tempfile
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("bert"); _ = prune_heads(model, {0: [1, 2]})
    >>> folder = tempfile.mkdtemp(); _ = write_record(model, folder); model.save_pretrained(folder)
    >>> fresh = tiny_model("bert", seed=1)
    >>> restore_record(fresh, folder).heads                     # the weights beside it fit now
    {0: (2, 2), 1: (4, 4)}
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from attnreg import weights
from attnreg.families import Family, detect_family
from attnreg.heads import PRUNED_HEADS, SILENCED_HEADS, PruneReport, pruned_heads, silenced_heads
from attnreg.hub import attach
from attnreg.records import GATE
from attnreg.structure.gates import HardConcreteGate, _hub_or_none, folded_gates, make_hard_concrete, refold_gates
from attnreg.structure.surgery import prune_heads, silence_heads
from attnreg.unwrap import transformers_model

RECORD_FILE = "attnreg_pruning.json"
"""The record beside the weights of a folder (`write_record`)."""
FORMAT = 2
"""The record's format: 1 was the pruning spec of 0.1.0 and 0.2.0 (read still)."""
PREFIX = "attnreg_"
"""A training checkpoint dict holds field `f` of the record as `attnreg_f` (`attnreg_pruned_heads`, ...)."""
FOLDED_GATES = "attnreg_folded_gates"
"""0.1.0's Lightning checkpoint entry: layers whose gates were folded into the weights (read still)."""
OLD_STRUCTURE_FILE = "attnreg_structure.json"
"""0.2.0's runner wrote the gates here beside the pruning spec (read still)."""
_IDENTITY = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "n_embd", "n_layer", "n_head", "dim", "n_layers", "n_heads",
)  # fmt: skip


@dataclass(frozen=True)
class StructureRecord:
    """What was done to a model's structure. `heads`: (query, key/value) heads per layer afterwards; `gates`: the
    hub's gates by layer with their values (None in older records: the weights hold them); `hard_concrete`: those
    gates' settings; `folded`: gate values folded into each layer's output projection; `identity`: the model's
    class and sizes (`model_identity`). `folded_layers` is read from 0.1.0 checkpoints only.

    Example:
        >>> record = StructureRecord.from_dict({"attnreg_pruned_heads": {"0": [1, 2]}})   # a 0.1.0 checkpoint
        >>> record.pruned, record.gates, record.to_dict()["format"]
        ({0: (1, 2)}, None, 2)
    """

    model_class: str | None = None
    family: str | None = None
    identity: dict[str, Any] | None = None
    heads: tuple[tuple[int, int], ...] | None = None
    pruned: dict[int, tuple[int, ...]] = field(default_factory=dict)
    silenced: dict[int, tuple[int, ...]] = field(default_factory=dict)
    gates: dict[int, Any] | None = None
    hard_concrete: dict[int, dict[str, Any]] = field(default_factory=dict)
    folded: dict[int, list[float]] = field(default_factory=dict)
    folded_layers: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-able fields, with its `format` (what `write_record` writes)."""
        return {
            "format": FORMAT,
            "class": self.model_class,
            "family": self.family,
            "model": self.identity,
            "heads": None if self.heads is None else [list(pair) for pair in self.heads],
            "pruned_heads": _by_layer(self.pruned, list),
            "silenced_heads": _by_layer(self.silenced, list),
            "gates": None if self.gates is None else _by_layer(self.gates),
            "hard_concrete": _by_layer(self.hard_concrete),
            "folded_gate_values": _by_layer(self.folded),
        }

    def to_checkpoint(self) -> dict[str, Any]:
        """The record as entries of a training checkpoint dict: `attnreg_<field>`.

        Example:
            >>> sorted(StructureRecord().to_checkpoint())[:3]
            ['attnreg_class', 'attnreg_family', 'attnreg_folded_gate_values']
        """
        return {PREFIX + key: value for key, value in self.to_dict().items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StructureRecord | None:
        """The record in `data`: `to_dict`'s fields, a checkpoint's entries (`to_checkpoint`) or an older form;
        None where `data` holds none (a checkpoint of a model nothing changed, from before the record)."""
        if "format" not in data:
            data = {key[len(PREFIX) :]: value for key, value in data.items() if key.startswith(PREFIX)}
            if "format" not in data and not data.keys() & {"pruned_heads", "silenced_heads", "gates", "model"}:
                return None
        version = data.get("format", FORMAT)
        if version not in (1, FORMAT):
            raise ValueError(f"unknown structure record format {version!r} (this attnreg reads 1 and {FORMAT})")
        return cls(
            model_class=data.get("class"),
            family=data.get("family"),
            identity=data.get("model"),
            heads=None if data.get("heads") is None else tuple(tuple(pair) for pair in data["heads"]),
            pruned=_heads(data.get("pruned_heads")),
            silenced=_heads(data.get("silenced_heads")),
            gates=None if data.get("gates") is None else {int(k): v for k, v in data["gates"].items()},
            hard_concrete={int(k): v for k, v in (data.get("hard_concrete") or {}).items()},
            folded={int(k): v for k, v in (data.get("folded_gate_values") or {}).items()},
            folded_layers=None if "folded_gates" not in data else tuple(int(k) for k in data["folded_gates"]),
        )


def record_of(model: nn.Module) -> StructureRecord:
    """The record of `model` (a transformers model, or a PEFT model around one) as it is now.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("llama"); _ = attach(model).gate(1)
        >>> _ = prune_heads(model, {0: [0, 1]}); silence_heads(model, {0: [2]})
        >>> record = record_of(model)
        >>> record.heads, record.pruned, record.silenced, record.gates
        (((2, 1), (4, 2)), {0: (0, 1)}, {0: (2,)}, {1: [1.0, 1.0, 1.0, 1.0]})
    """
    model = transformers_model(model)
    family = detect_family(model)
    hub = _hub_or_none(model)
    gates: dict[int, Any] = {} if hub is None else dict(sorted(hub.gates.items()))
    return StructureRecord(
        model_class=type(model).__name__,
        family=family.name,
        identity=model_identity(model),
        heads=tuple(family.head_counts(family.attention_module(model, i)) for i in range(len(family.blocks(model)))),
        pruned=pruned_heads(model),
        silenced=silenced_heads(model),
        gates={layer: _values(gate) for layer, gate in gates.items()},
        hard_concrete={layer: _settings(gate) for layer, gate in gates.items() if isinstance(gate, HardConcreteGate)},
        folded=dict(sorted(folded_gates(model).items())),
    )


def model_identity(model: nn.Module) -> dict[str, Any]:
    """What tells a transformers model apart from another of a checkpoint: its class and the sizes of its config
    (as built, whatever heads were removed since).

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model_identity(tiny_model("gpt2"))
        {'class': 'GPT2Model', 'hidden_size': 32, 'model_type': 'gpt2', 'n_embd': 32, 'n_head': 4, 'n_layer': 2,
         'num_attention_heads': 4, 'num_hidden_layers': 2, 'vocab_size': 99}
    """
    config = model.config
    sizes = {key: getattr(config, key) for key in _IDENTITY if isinstance(getattr(config, key, None), int | str)}
    return {"class": type(model).__name__, **dict(sorted(sizes.items()))}


def write_record(model: nn.Module, folder: str | Path, record: StructureRecord | None = None) -> Path:
    """Write the record (`record_of(model)` unless given) beside the weights in `folder`: `attnreg_pruning.json`.

    Example:
        >>> import tempfile
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert")
        >>> _ = make_hard_concrete(attach(model), 1, temperature=0.5)
        >>> saved = json.loads(write_record(model, tempfile.mkdtemp()).read_text())
        >>> saved["format"], saved["heads"], saved["hard_concrete"]
        (2, [[4, 4], [4, 4]], {'1': {'temperature': 0.5, 'stretch': [-0.1, 1.1]}})
    """
    record = record_of(model) if record is None else record
    path = Path(folder) / RECORD_FILE
    path.write_text(json.dumps(record.to_dict(), indent=2) + "\n")
    return path


def read_record(folder: str | Path) -> StructureRecord | None:
    """The record of a folder: `attnreg_pruning.json` (with 0.2.0's `attnreg_structure.json` beside it, its gates),
    else the one a config.json keeps (a plain `save_pretrained` of a pruned model); None where there is none.

    Example:
        >>> import tempfile
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("gpt2"); _ = prune_heads(model, {1: [0]})
        >>> folder = tempfile.mkdtemp(); model.save_pretrained(folder)       # no record file: config.json's
        >>> read_record(folder).pruned, read_record(folder).model_class, read_record(tempfile.mkdtemp())
        ({1: (0,)}, 'GPT2Model', None)
    """
    folder = Path(folder)
    path, old = folder / RECORD_FILE, folder / OLD_STRUCTURE_FILE
    try:
        if path.is_file():
            record = StructureRecord.from_dict(json.loads(path.read_text()))
            gates = StructureRecord.from_dict(json.loads(old.read_text())) if old.is_file() else None
            if record is not None and record.gates is None and gates is not None:  # 0.2.0: gates in the runner's file
                record = replace(record, identity=gates.identity, gates=gates.gates, folded=gates.folded)
            return record
        if old.is_file():
            return StructureRecord.from_dict(json.loads(old.read_text()))
    except ValueError as error:
        raise ValueError(f"{folder}: {error}") from error
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    if not (config.get(PRUNED_HEADS) or config.get(SILENCED_HEADS)):
        return None
    return StructureRecord(
        model_class=(config.get("architectures") or [None])[0],
        pruned=_heads(config.get(PRUNED_HEADS)),
        silenced=_heads(config.get(SILENCED_HEADS)),
    )


def restore_record(model: nn.Module, source: StructureRecord | Mapping[str, Any] | str | Path) -> PruneReport | None:
    """Rebuild on `model` (built as the run began, or from its config) the structure `source` records, before the
    weights beside it load: heads removed and silenced, gates folded at a removal taken off, the recorded gates made
    (a hard-concrete one with its settings) and set, folded gate values folded again (the weights, where they hold
    them, load over these). `source` is a folder (`read_record`), a record, or a dict holding one (a training
    checkpoint, its `state_dict` the weights).

    Everything is checked first, and on any error nothing changes: the model must be the record's (its sizes), hold
    no change the record lacks, and each layer's projections in the weights must have the record's heads. Returns
    the report of the heads removed now (None if none, and for a source with no record).

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> trained = tiny_model("bert"); _ = prune_heads(trained, {0: [1, 2]})
        >>> checkpoint = {"state_dict": trained.state_dict(), **record_of(trained).to_checkpoint()}
        >>> fresh = tiny_model("bert")
        >>> edited = {**checkpoint, "attnreg_pruned_heads": {"0": [1]}, "attnreg_heads": [[3, 3], [4, 4]]}
        >>> restore_record(fresh, edited)
        Traceback (most recent call last):
        ...
        ValueError: the structure record disagrees with the weights: layer 0: attention.self.query.weight has 16 rows in
        the checkpoint's state_dict, the record gives 3 heads x 8 = 24 (...)
        >>> pruned_heads(fresh), restore_record(fresh, checkpoint).heads          # nothing changed, then restored
        ({}, {0: (2, 2), 1: (4, 4)})
    """
    model = transformers_model(model)
    record, shapes, where = _resolve(source)
    if record is None:
        return None
    family = detect_family(model)
    _check(model, family, record, shapes, where)
    return _apply(model, record, shapes)


def _resolve(
    source: StructureRecord | Mapping[str, Any] | str | Path,
) -> tuple[StructureRecord | None, dict[str, tuple[tuple[int, ...], str]] | None, str]:
    """The record, the shapes of the weights beside it (with the file each is in), and where they are."""
    where = ""
    shapes = None
    if isinstance(source, str | Path):
        record = read_record(source)
        shapes = weight_shapes(source)
        where = str(source)
    elif isinstance(source, StructureRecord):
        record = source
    else:
        record = StructureRecord.from_dict(source)
        if isinstance(source.get("state_dict"), Mapping):
            shapes = {
                key: (tuple(value.shape), "the checkpoint's state_dict") for key, value in source["state_dict"].items()
            }
    return record, shapes, where


def weight_shapes(folder: str | Path) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """The shape of each tensor in a folder's safetensors weights, with the file it is in, read from their headers
    (nothing loads); None for a folder without `model.safetensors` (an adapter's, say).

    Example:
        >>> import tempfile
        >>> from attnreg.tiny import tiny_model
        >>> folder = tempfile.mkdtemp(); tiny_model("bert").save_pretrained(folder)
        >>> weight_shapes(folder)["encoder.layer.0.attention.self.query.weight"]
        ((32, 32), 'model.safetensors')
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []
    files = files or (["model.safetensors"] if (folder / "model.safetensors").is_file() else [])
    shapes = {}
    for name in files:
        with safe_open(folder / name, framework="pt") as opened:
            shapes.update({key: (tuple(opened.get_slice(key).get_shape()), name) for key in opened.keys()})
    return shapes or None


def _check(
    model: nn.Module,
    family: Family,
    record: StructureRecord,
    shapes: Mapping[str, tuple[tuple[int, ...], str]] | None,
    where: str,
) -> None:
    """Refuse a record that is not this model's, that lacks a change the model has, or that its weights contradict."""
    here = model_identity(model)
    if record.identity is not None and record.identity != here:
        saved = record.identity
        differ = {key: (saved.get(key), here.get(key)) for key in {*saved, *here} if saved.get(key) != here.get(key)}
        raise ValueError(
            "this checkpoint belongs to another model: (checkpoint, model here) differ in "
            + ", ".join(f"{key} {pair[0]!r} vs {pair[1]!r}" for key, pair in sorted(differ.items()))
        )
    current, silenced = pruned_heads(model), silenced_heads(model)
    extra = {
        layer: sorted(
            {*current.get(layer, ()), *silenced.get(layer, ())}
            - set(record.pruned.get(layer, ()))
            - set(record.silenced.get(layer, ()))
        )
        for layer in {*current, *silenced}
    }
    extra = {layer: heads for layer, heads in sorted(extra.items()) if heads}
    if extra:
        raise ValueError(f"the model has heads pruned or silenced that the checkpoint does not record: {extra}")
    layout = []
    for layer in range(len(family.blocks(model))):
        query, kv = family.head_counts(family.attention_module(model, layer))
        new = len(set(record.pruned.get(layer, ())) - set(current.get(layer, ())))
        layout.append((query - new, kv - new // (query // kv if kv else 1)))
    if record.heads is not None and tuple(layout) != record.heads:
        raise ValueError(
            f"{where + ': ' if where else ''}re-applying the structure record gives heads {[list(p) for p in layout]} "
            f"per layer, the record says {[list(p) for p in record.heads]}"
        )
    problems = _disagreements(model, family, layout, shapes or {})
    if problems:
        place = f"{where}: " if where else ""
        raise ValueError(f"{place}the structure record disagrees with the weights: " + "; ".join(problems[:5]))


def _disagreements(
    model: nn.Module, family: Family, layout: list[tuple[int, int]], shapes: Mapping[str, tuple[tuple[int, ...], str]]
) -> list[str]:
    """Each projection whose heads in the weights are not the record's, named by layer and tensor."""
    names = {key.replace(".base_layer.", "."): key for key in shapes}
    prefix = None
    problems = []
    for layer, (query, kv) in enumerate(layout):
        head_dim = family.head_dim(family.attention_module(model, layer))
        for attr, output, heads, count in _projections(family, query, kv):
            path = family.module_path(model, layer, attr)
            _, _, _, dim = weights.feature_tensors(model.get_submodule(path), output)[0]  # the wrapped weight
            key = f"{path}.weight"
            if prefix is None:
                found = {name[: -len(key)] for name in names if name == key or name.endswith("." + key)}
                if len(found) != 1:
                    return []  # not this model's weights, or more than one model's: nothing to compare
                prefix = found.pop()
            name = names.get(prefix + key)
            if name is None:
                continue
            shape, file = shapes[name]
            if shape[dim] != count * head_dim:
                wanted = tuple(count * head_dim if i == dim else size for i, size in enumerate(shape))
                problems.append(
                    f"layer {layer}: {attr}.weight has {shape[dim]} {('rows', 'columns')[dim]} in {file}, the record "
                    f"gives {heads} x {head_dim} = {count * head_dim} ({name}: weights {shape}, pruning spec {wanted} "
                    f"(layer {layer}))"
                )
    return problems


def _projections(family: Family, query: int, kv: int) -> list[tuple[str, bool, str, int]]:
    """(path inside the block, output features?, the heads in words, their number) for each projection."""
    inside = f"{family.attention}."
    if family.fused_qkv is not None:
        found = [(inside + family.fused_qkv, True, f"{query} query + 2 x {kv} key/value heads", query + 2 * kv)]
    else:
        found = [
            (f"{inside}{family.query}", True, f"{query} heads", query),
            (f"{inside}{family.key}", True, f"{kv} key/value heads", kv),
            (f"{inside}{family.value}", True, f"{kv} key/value heads", kv),
        ]
    return [*found, (family.out_proj, False, f"{query} heads", query)]


def _apply(
    model: nn.Module, record: StructureRecord, shapes: Mapping[str, tuple[tuple[int, ...], str]] | None
) -> PruneReport | None:
    current = pruned_heads(model)
    missing = {layer: sorted(set(heads) - set(current.get(layer, ()))) for layer, heads in record.pruned.items()}
    missing = {layer: heads for layer, heads in missing.items() if heads}
    report = prune_heads(model, missing) if missing else None
    silenced = silenced_heads(model)
    quiet = {layer: sorted(set(heads) - set(silenced.get(layer, ()))) for layer, heads in record.silenced.items()}
    silence_heads(model, {layer: heads for layer, heads in quiet.items() if heads})
    hub = _hub_or_none(model)
    if record.gates is None:  # an older record: the weights hold the gates, those folded at a removal are absent
        names = list(shapes or ())
        layers = record.folded_layers if record.folded_layers is not None else list({} if hub is None else hub.gates)
        for layer in layers:
            if hub is not None and layer in hub.gates and not _held(hub, model, layer, names):
                hub.remove_gate(layer, fold=False)
        for layer, settings in record.hard_concrete.items():
            make_hard_concrete(attach(model), layer, temperature=settings["temperature"], stretch=settings["stretch"])
        return report
    if hub is not None:
        for layer in [layer for layer in hub.gates if layer not in record.gates]:
            hub.remove_gate(layer, fold=False)  # folded into the weights at a removal
    folded = folded_gates(model)
    refold_gates(model, {layer: values for layer, values in record.folded.items() if folded.get(layer) != values})
    if not record.gates:
        return report
    hub = attach(model)
    with torch.no_grad():
        for layer, values in record.gates.items():
            kind = record.hard_concrete.get(layer)
            gate: Any = hub.gates.get(layer)
            if gate is None and kind is not None:
                gate = make_hard_concrete(hub, layer, temperature=kind["temperature"], stretch=kind["stretch"])
            elif gate is None:
                gate = hub.gate(layer)
            if isinstance(gate, nn.Module):
                for name, tensor in gate.state_dict(keep_vars=True).items():
                    if not isinstance(tensor, DTensor):  # sharded: the checkpoint's weights hold it
                        tensor.copy_(torch.tensor(values[name], dtype=tensor.dtype))
            elif not isinstance(gate, DTensor):
                gate.copy_(torch.tensor(values, dtype=gate.dtype))
    return report


def _held(hub: Any, model: nn.Module, layer: int, names: list[str]) -> bool:
    """Whether the weights `names` hold the gate of `layer`."""
    gate = hub.gates[layer]
    path = f"{hub.family.module_path(model, layer, hub.family.attention)}.{GATE}"
    wanted = [f"{path}.{name}" for name in gate.state_dict()] if isinstance(gate, nn.Module) else [path]
    return any(key == name or key.endswith("." + name) for key in names for name in wanted)


def _values(gate: Any) -> Any:
    if isinstance(gate, nn.Module):
        return {name: _values(tensor) for name, tensor in gate.state_dict().items()}
    gate = gate.full_tensor() if isinstance(gate, DTensor) else gate
    return gate.detach().float().cpu().tolist()


def _heads(raw: Mapping[str, Any] | None) -> dict[int, tuple[int, ...]]:
    return {int(layer): tuple(heads) for layer, heads in sorted((raw or {}).items(), key=lambda i: int(i[0])) if heads}


def _by_layer(values: Mapping[int, Any], convert: Any = None) -> dict[str, Any]:
    return {str(layer): convert(value) if convert else value for layer, value in sorted(values.items())}


def _settings(gate: HardConcreteGate) -> dict[str, Any]:
    return {"temperature": gate.temperature, "stretch": list(gate.stretch)}
