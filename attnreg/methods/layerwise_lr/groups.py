"""Per-layer learning rates: named parameter groups with ELECTRA's layer-wise decay, multipliers and freezing.

Every parameter belongs to exactly one layer group, found through the family table:

- `embeddings`: parameters of the base model registered before its first transformer block (token,
  position and type embeddings, their norm, ELECTRA's `embeddings_project`);
- `layer0` ... `layer{N-1}`: everything inside block i (attnreg's per-head gates included);
- `gates`: attnreg's per-head gates (`HeadGating`, `hub.gate`), in no layer: which heads close must
  follow the heads' use, not their layer's decayed rate. They train at `lr` (times `multipliers["gates"]`,
  usually large) without weight decay;
- `head`: everything else: final norms (GPT-2 `ln_f`, Llama/Qwen2 `norm`), BERT's pooler, the task head,
  and parameters of the LightningModule outside the transformers model. A language-model head tied to the
  input embeddings is one parameter, and it stays in `embeddings`.

Layer-wise decay follows ELECTRA's `_get_layer_lrs` (google-research/electra, `model/optimization.py`)
exactly: depth 0 for the embeddings, i + 1 for layer i, N + 2 for the task head, and
`lr * decay ** (N + 2 - depth)`. So the head trains at `lr`, layer i at `lr * decay ** (N + 1 - i)` and
the embeddings at `lr * decay ** (N + 2)`: the top layer is two factors below the head (depth N + 1 is
unused in ELECTRA too). Sun et al. (2019, "How to Fine-Tune BERT") use decay 0.95.

Groups are named for LearningRateMonitor (`lr-AdamW/layer3`); with `weight_decay > 0`, biases, norm
parameters and gates go to a twin group `layer3/no_decay` with weight decay 0.

Example:
    >>> import torch
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("bert", head="classification")     # 2 layers
    >>> groups = layerwise_param_groups(model, lr=2e-5, decay=0.95, weight_decay=0.01, freeze=["embeddings"])
    >>> optimizer = torch.optim.AdamW(groups)
    >>> [group["name"] for group in groups]
    ['layer0', 'layer0/no_decay', 'layer1', 'layer1/no_decay', 'head', 'head/no_decay']
    >>> [f"{group['lr']:.3g}" for group in groups[::2]]      # lr * 0.95 ** (N + 1 - i), then lr
    ['1.71e-05', '1.8e-05', '2e-05']
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from attnreg.families import detect_family
from attnreg.hub import is_attached
from attnreg.records import GATE
from attnreg.structure import gate_parameters
from attnreg.unwrap import find_transformers_model

EMBEDDINGS = "embeddings"
HEAD = "head"
GATES = "gates"
NO_DECAY = "/no_decay"
_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)

LayerKey = str | int


def layer_group_names(num_layers: int) -> list[str]:
    """`["embeddings", "layer0", ..., "layer{N-1}", "head", "gates"]`, from the input side up.

    Example:
        >>> layer_group_names(2)
        ['embeddings', 'layer0', 'layer1', 'head', 'gates']
    """
    return [EMBEDDINGS, *(f"layer{index}" for index in range(num_layers)), HEAD, GATES]


def parameters_by_layer(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Every parameter of `model` (each once; tied ones under their first name), by layer group.

    `model` is a transformers model of a supported family or a module (a LightningModule) holding
    exactly one; parameters outside it go to `head`. Raises `UnsupportedModelError` for other families.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> layers = parameters_by_layer(tiny_model("bert", head="classification"))
        >>> {name: len(named) for name, named in layers.items()}
        {'embeddings': 5, 'layer0': 16, 'layer1': 16, 'head': 4, 'gates': 0}
        >>> [name for name, _ in layers["head"]]
        ['bert.pooler.dense.weight', 'bert.pooler.dense.bias', 'classifier.weight', 'classifier.bias']
    """
    transformers_model = find_transformers_model(model)
    blocks = detect_family(transformers_model).blocks(transformers_model)
    gates = {id(param) for param in gate_parameters(transformers_model)}
    layer_of = {id(param): index for index, block in enumerate(blocks) for param in block.parameters()}
    before_blocks = set()
    for param in transformers_model.base_model.parameters():
        if id(param) in layer_of:
            break
        before_blocks.add(id(param))
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {name: [] for name in layer_group_names(len(blocks))}
    for name, param in model.named_parameters():
        if id(param) in gates:
            groups[GATES].append((name, param))
        elif id(param) in layer_of:
            groups[f"layer{layer_of[id(param)]}"].append((name, param))
        elif id(param) in before_blocks:
            groups[EMBEDDINGS].append((name, param))
        else:
            groups[HEAD].append((name, param))
    return groups


def electra_layer_factors(num_layers: int, decay: float) -> dict[str, float]:
    """ELECTRA's learning-rate factor per layer group: `decay ** (N + 2 - depth)`, depth 0 for the
    embeddings, i + 1 for layer i, N + 2 for the head.

    Example:
        >>> electra_layer_factors(2, 0.5)
        {'embeddings': 0.0625, 'layer0': 0.125, 'layer1': 0.25, 'head': 1.0, 'gates': 1.0}
    """
    _check_decay(decay)
    depths = {EMBEDDINGS: 0, **{f"layer{index}": index + 1 for index in range(num_layers)}, HEAD: num_layers + 2}
    return {name: decay ** (num_layers + 2 - depth) for name, depth in depths.items()} | {GATES: 1.0}


def layerwise_param_groups(
    model: nn.Module,
    lr: float,
    decay: float | None = None,
    multipliers: Mapping[LayerKey, float] | Sequence[float] | None = None,
    freeze: Iterable[LayerKey] | LayerKey | None = None,
    weight_decay: float = 0.0,
    no_decay: Iterable[str] | None = None,
) -> list[dict[str, Any]]:
    """Named optimizer parameter groups, one per layer group (and a `/no_decay` twin with weight decay).

    - `decay`: ELECTRA's layer-wise decay in (0, 1] (see the module docstring); None = flat.
    - `multipliers`: extra learning-rate factors, a dict keyed by group name (`"embeddings"`, `"layer3"`,
      `"head"`, `"gates"`) or layer index, or a list with one factor per transformer layer; they multiply the decay.
    - `freeze`: group names or layer indices whose parameters get `requires_grad=False` and are left out.
      Parameters already frozen elsewhere stay in their group (so they train if unfrozen later).
    - `weight_decay`: for every parameter except those `no_decay` selects: regular expressions searched in
      the parameter names, or by default biases, normalization layers (LayerNorm, RMSNorm) and gates.

    Empty groups are left out, except `gates` on an attached model (see the code). Bad input raises before
    the model is changed.

    Example:
        >>> import torch
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert", head="classification")
        >>> groups = layerwise_param_groups(model, lr=1e-4, decay=0.5, multipliers={"head": 10})
        >>> optimizer = torch.optim.AdamW(groups)
        >>> {group["name"]: group["lr"] for group in groups}
        {'embeddings': 6.25e-06, 'layer0': 1.25e-05, 'layer1': 2.5e-05, 'head': 0.001}
    """
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, int | float) or not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    layers = parameters_by_layer(model)
    num_layers = len(layers) - 3
    factors = electra_layer_factors(num_layers, decay) if decay is not None else dict.fromkeys(layers, 1.0)
    for name, factor in _multiplier_table(multipliers, list(layers), num_layers).items():
        factors[name] *= factor
    frozen = set() if freeze is None else set(resolve_layer_groups(freeze, list(layers), "freeze"))
    if all(name in frozen or not named for name, named in layers.items()):
        raise ValueError(f"freeze={sorted(frozen)} freezes every layer group: nothing would train")
    skip_decay = _no_decay_rule(model, no_decay)
    # An attached model always has a gates group, empty or not: gates come and go (HeadGating folds them at
    # the end), and a resumed optimizer must have the groups of its checkpoint.
    attached = is_attached(find_transformers_model(model))

    groups = []
    for name, named in layers.items():
        if name in frozen:
            continue
        if weight_decay > 0 and name != GATES:
            parts = [
                (name, [p for n, p in named if not skip_decay(n, p)], float(weight_decay)),
                (name + NO_DECAY, [p for n, p in named if skip_decay(n, p)], 0.0),
            ]
        else:
            parts = [(name, [p for _, p in named], 0.0)]
        for group_name, params, group_decay in parts:
            if params or (group_name == GATES and attached):
                groups.append(
                    {"name": group_name, "params": params, "lr": lr * factors[name], "weight_decay": group_decay}
                )
    for name in frozen:
        for _, param in layers[name]:
            param.requires_grad_(False)
    return groups


def resolve_layer_groups(keys: Iterable[LayerKey] | LayerKey, names: Sequence[str], argument: str) -> list[str]:
    """Group names for `keys` (names or layer indices), each checked against `names`.

    Example:
        >>> resolve_layer_groups([0, "head"], layer_group_names(2), "freeze")
        ['layer0', 'head']
    """
    if isinstance(keys, str | int):
        keys = [keys]
    return [_group_name(key, names, argument) for key in keys]


def _group_name(key: LayerKey, names: Sequence[str], argument: str) -> str:
    num_layers = len(names) - 3
    if isinstance(key, int) and not isinstance(key, bool):
        if not 0 <= key < num_layers:
            raise IndexError(f"{argument}: layer {key} is out of range, the model has {num_layers} layers")
        return f"layer{key}"
    if isinstance(key, str) and key in names:
        return key
    raise KeyError(f"{argument}: {key!r} matches no layer group; the groups are {list(names)} (or layer indices)")


def check_multipliers(multipliers: Mapping[LayerKey, float] | Sequence[float] | None) -> None:
    """Raise unless `multipliers` has the form `layerwise_param_groups` takes, before any model is seen: a dict
    keyed by group name (`"embeddings"`, `"layer3"`, `"head"`, `"gates"`) or layer index >= 0, or a list,
    of finite factors > 0. Whether the layers exist is checked against the model later.

    Example:
        >>> check_multipliers({"gates": 100, 3: 0.5})
        >>> check_multipliers({"gates": -100})
        Traceback (most recent call last):
        ...
        ValueError: multipliers['gates'] must be a finite number > 0 (use freeze= for 0), got -100
    """
    if multipliers is None:
        return
    if isinstance(multipliers, Mapping):
        items = list(multipliers.items())
        for key, _ in items:
            named = isinstance(key, str) and (key in (EMBEDDINGS, HEAD, GATES) or re.fullmatch(r"layer\d+", key))
            if not (named or (isinstance(key, int) and not isinstance(key, bool) and key >= 0)):
                raise KeyError(
                    f"multipliers: {key!r} matches no layer group; the groups are {EMBEDDINGS!r}, 'layer0' ..., "
                    f"{HEAD!r}, {GATES!r} (or layer indices)"
                )
    elif isinstance(multipliers, Sequence) and not isinstance(multipliers, str):
        items = list(enumerate(multipliers))
    else:
        raise TypeError(f"multipliers must be a dict or a list, got {type(multipliers).__name__}")
    for key, value in items:
        _check_factor(key, value)


def _check_factor(name: LayerKey, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"multipliers[{name!r}] must be a finite number > 0 (use freeze= for 0), got {value!r}")


def _multiplier_table(
    multipliers: Mapping[LayerKey, float] | Sequence[float] | None, names: Sequence[str], num_layers: int
) -> dict[str, float]:
    if multipliers is None:
        return {}
    if isinstance(multipliers, Mapping):
        table = {_group_name(key, names, "multipliers"): value for key, value in multipliers.items()}
    elif isinstance(multipliers, Sequence) and not isinstance(multipliers, str):
        if len(multipliers) != num_layers:
            raise ValueError(
                f"multipliers as a list needs one factor per transformer layer ({num_layers}), got {len(multipliers)};"
                " use a dict to set embeddings or head"
            )
        table = {f"layer{index}": value for index, value in enumerate(multipliers)}
    else:
        raise TypeError(f"multipliers must be a dict or a list, got {type(multipliers).__name__}")
    for name, value in table.items():
        _check_factor(name, value)
    return {name: float(value) for name, value in table.items()}


def _no_decay_rule(model: nn.Module, patterns: Iterable[str] | None):
    if patterns is not None:
        if isinstance(patterns, str):
            patterns = [patterns]
        compiled = [re.compile(pattern) for pattern in patterns]
        return lambda name, param: any(pattern.search(name) for pattern in compiled)
    owners = {id(param): module for module in model.modules() for param in module.parameters(recurse=False)}

    def bias_norm_or_gate(name: str, param: nn.Parameter) -> bool:
        leaf = name.rsplit(".", 1)[-1]
        return leaf == "bias" or leaf == GATE or _is_norm(owners[id(param)])

    return bias_norm_or_gate


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or type(module).__name__.lower().endswith("norm")


def _check_decay(decay: float) -> None:
    if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 < decay <= 1:
        raise ValueError(f"decay must be in (0, 1] (1 = no decay), got {decay!r}")
