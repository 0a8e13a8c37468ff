"""Editing a projection's weights by feature: `nn.Linear`, GPT-2's `Conv1D` (weight stored `[in, out]`), and
the PEFT LoRA layers that wrap them (`base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`, per adapter).

Folding gates scales features (`scale_input_columns`, `scale_output_rows`); removing heads keeps some of them
(`feature_tensors` lists what to slice, `set_features` records the new width). Both reach the adapters'
`lora_A` columns (input features) and `lora_B` rows (output features), so the adapter's path stays exact.
Anything whose output is not linear in those rows and columns (DoRA, other LoRA variants, other tuners) is
refused by `lora_factors`, naming the module's class and the tuner.

Example:
    >>> from transformers.pytorch_utils import Conv1D
    >>> projection = Conv1D(6, 4)                          # 4 inputs, 6 outputs, weight [4, 6]
    >>> [(name, dim) for _, name, _, dim in feature_tensors(projection, output=True)]
    [('weight', 1), ('bias', 0)]
    >>> keep = torch.tensor([0, 2, 5])                      # keep output features 0, 2 and 5
    >>> for owner, name, tensor, dim in feature_tensors(projection, output=True):
    ...     tensor.data = tensor.data.index_select(dim, keep)
    >>> set_features(projection, 3, output=True); projection.nf, out_features(projection)
    (3, 3)
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D


def out_features(projection: nn.Module) -> int:
    """Output width of an nn.Linear or a GPT-2 Conv1D (whose weight is stored transposed).

    Example:
        >>> out_features(nn.Linear(3, 5)), out_features(Conv1D(5, 3))
        (5, 5)
    """
    projection = base_layer(projection)
    if isinstance(projection, Conv1D):
        return projection.weight.shape[1]
    return projection.weight.shape[0]


def base_layer(projection: nn.Module) -> nn.Module:
    """The projection a PEFT adapter layer wraps (`base_layer`), or the projection itself.

    Example:
        >>> projection = nn.Linear(2, 2)
        >>> base_layer(projection) is projection
        True
    """
    return getattr(projection, "base_layer", projection)


def tuner_name(projection: nn.Module) -> str:
    """The full class name of a module, as error messages name an adapter layer (`peft.tuners.lora.layer.Linear`).

    Example:
        >>> tuner_name(nn.Linear(2, 2))
        'torch.nn.modules.linear.Linear'
    """
    kind = type(projection)
    return f"{kind.__module__}.{kind.__qualname__}"


def lora_factors(projection: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """`(lora_A, lora_B)` of every adapter of a PEFT LoRA layer (its output adds `lora_B(lora_A(x)) * scaling`
    to the wrapped projection's), [] for a plain projection. An adapter that is not linear in its input
    (DoRA's magnitude vector, any other LoRA variant) or another tuner is refused: scaling or slicing the
    projection's features would not carry over.

    Example:
        >>> lora_factors(nn.Linear(2, 2))
        []
    """
    first, second = getattr(projection, "lora_A", None), getattr(projection, "lora_B", None)
    if not isinstance(first, nn.ModuleDict) or not isinstance(second, nn.ModuleDict):
        if base_layer(projection) is not projection:  # another PEFT tuner (IA3, LoHa, ...): its path is not known
            raise NotImplementedError(
                f"{tuner_name(projection)} wraps a projection with an adapter attnreg cannot scale or slice (it "
                "handles LoRA's lora_A and lora_B); merge the adapter first"
            )
        return []
    magnitudes = getattr(projection, "lora_magnitude_vector", None)
    if magnitudes is not None and len(magnitudes) > 0:
        raise NotImplementedError(
            f"{tuner_name(projection)} uses DoRA (adapters {sorted(magnitudes)}), whose output is not linear in its "
            "weight's rows and columns: attnreg cannot fold gates into it or slice heads from it; use plain LoRA"
        )
    variants = getattr(projection, "lora_variant", None) or {}
    if variants:
        named = {name: type(variant).__name__ for name, variant in variants.items()}
        raise NotImplementedError(
            f"{tuner_name(projection)} runs LoRA variants {named}, whose output is not lora_B(lora_A(x)) * scaling: "
            "attnreg cannot fold gates into them or slice heads from them; use plain LoRA"
        )
    return [(first[name], second[name]) for name in first]


def scale_input_columns(projection: nn.Module, scale: torch.Tensor) -> None:
    """Multiply the projection's input features by `scale` (one value per input feature), in place; for a
    PEFT LoRA layer, of the wrapped projection and of every adapter's `lora_A`.

    Example:
        >>> projection = nn.Linear(2, 1, bias=False)
        >>> projection.weight.data = torch.tensor([[1.0, 1.0]])
        >>> scale_input_columns(projection, torch.tensor([0.0, 3.0]))
        >>> projection.weight
        Parameter containing:
        tensor([[0., 3.]], requires_grad=True)
    """
    _scale_features(projection, scale, output=False)


def scale_output_rows(projection: nn.Module, scale: torch.Tensor, start: int = 0) -> None:
    """Multiply output features `start : start + len(scale)` (weight and bias) by `scale`, in place; for a
    PEFT LoRA layer, of the wrapped projection and of every adapter's `lora_B`.

    Example:
        >>> projection = nn.Linear(1, 3)
        >>> projection.bias.data = torch.ones(3)
        >>> scale_output_rows(projection, torch.tensor([0.0, 2.0]), start=1)
        >>> projection.bias
        Parameter containing:
        tensor([1., 0., 2.], requires_grad=True)
    """
    _scale_features(projection, scale, output=True, start=start)


def _scale_features(projection: nn.Module, scale: torch.Tensor, output: bool, start: int = 0) -> None:
    """Multiply features `start : start + len(scale)` of every tensor `feature_tensors` lists, in place."""
    with torch.no_grad():
        for _, _, tensor, dim in feature_tensors(projection, output):
            part = tensor
            if start > 0 or scale.numel() != tensor.shape[dim]:
                part = tensor[(slice(None),) * dim + (slice(start, start + scale.numel()),)]
            part.mul_(scale.to(tensor).reshape([-1 if axis == dim else 1 for axis in range(tensor.dim())]))


def check_sliceable(projection: nn.Module, output: bool) -> None:
    """Raise `TypeError`, naming the module's class and why, unless `feature_tensors` can slice the projection's
    output (`output=True`) or input features exactly: an nn.Linear or a Conv1D, bare or wrapped by plain LoRA
    adapters. A LoRA bias (`lora_bias=True`) on input features is refused: it would outlive every column.

    Example:
        >>> check_sliceable(nn.Linear(2, 2), output=False)
        >>> check_sliceable(nn.Sequential(nn.Linear(2, 2)), output=True)
        Traceback (most recent call last):
        ...
        TypeError: torch.nn.modules.container.Sequential is neither an nn.Linear nor a Conv1D, bare or wrapped by LoRA
    """
    if isinstance(getattr(projection, "original_module", None), nn.Module):
        raise TypeError(
            f"{tuner_name(projection)} holds a trainable copy of the projection (LoRA's modules_to_save), which head "
            "removal does not slice; leave the attention projections out of modules_to_save"
        )
    try:
        factors = lora_factors(projection)
    except NotImplementedError as error:
        raise TypeError(str(error)) from None
    if type(base_layer(projection)) not in (nn.Linear, Conv1D):
        raise TypeError(
            f"{tuner_name(base_layer(projection))} is neither an nn.Linear nor a Conv1D, bare or wrapped by LoRA"
        )
    if not output and any(second.bias is not None for _, second in factors):
        raise TypeError(
            f"{tuner_name(projection)} has a LoRA bias (lora_bias=True) on an output projection: it would stay "
            "when every input column goes, which no head removal can keep exact"
        )


def feature_tensors(projection: nn.Module, output: bool) -> list[tuple[nn.Module, str, torch.Tensor, int]]:
    """`(owner, name, tensor, dim)` for every tensor holding the projection's output features (`output=True`:
    weight and bias, every adapter's `lora_B` rows and bias) or input features (weight, every adapter's
    `lora_A` columns), with the dim along which they lie. Check with `check_sliceable` first.

    Example:
        >>> [(name, dim) for _, name, _, dim in feature_tensors(nn.Linear(3, 2), output=False)]
        [('weight', 1)]
    """
    factors = lora_factors(projection)
    base = base_layer(projection)
    conv = isinstance(base, Conv1D)
    found = [(base, "weight", base.weight, (1 if conv else 0) if output else (0 if conv else 1))]
    if output:
        found += [(base, "bias", base.bias, 0)] if base.bias is not None else []
        for _, second in factors:
            found.append((second, "weight", second.weight, 0))
            found += [(second, "bias", second.bias, 0)] if second.bias is not None else []
    else:
        found += [(first, "weight", first.weight, 1) for first, _ in factors]
    return found


def set_features(projection: nn.Module, size: int, output: bool) -> None:
    """Record a projection's new output (`output=True`) or input width after `feature_tensors` were sliced to
    `size`: `nf`/`nx` of a Conv1D, `out_features`/`in_features` of an nn.Linear, of a LoRA layer and of its factors.

    Example:
        >>> projection = nn.Linear(3, 2)
        >>> projection.weight.data = projection.weight.data[:, :1]
        >>> set_features(projection, 1, output=False); projection
        Linear(in_features=1, out_features=2, bias=True)
    """
    base = base_layer(projection)
    attribute = "out_features" if output else "in_features"
    if isinstance(base, Conv1D):
        setattr(base, "nf" if output else "nx", size)
    else:
        setattr(base, attribute, size)
    if base is not projection:
        setattr(projection, attribute, size)
        for first, second in lora_factors(projection):
            setattr(second if output else first, attribute, size)


def adapter_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The PEFT layers injected into `model` by name: tuner layers around a projection (`base_layer`) and
    `modules_to_save` wrappers around a module (`original_module`).

    Example:
        >>> adapter_layers(nn.Sequential(nn.Linear(2, 2)))
        {}
    """
    return {
        name: module
        for name, module in model.named_modules()
        if name
        and (base_layer(module) is not module or isinstance(getattr(module, "original_module", None), nn.Module))
    }


def without_adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` as the model would hold it without its PEFT layers (`adapter_layers`): the wrapped
    module's tensors under the wrapper's name (`q_proj.base_layer.weight` -> `q_proj.weight`, `score.original_module.
    weight` -> `score.weight`), every adapter's own tensors left out. A pruned base saved this way loads back,
    and the adapter onto it.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> sorted(without_adapters(model))
        ['0.bias', '0.weight']
    """
    wrappers = {f"{name}.": module for name, module in adapter_layers(model).items()}
    state = {}
    for key, tensor in model.state_dict().items():
        prefix = next((p for p in wrappers if key.startswith(p)), None)
        if prefix is None:
            state[key] = tensor
            continue
        for inner in ("base_layer.", "original_module."):
            if key.startswith(prefix + inner):
                state[prefix + key[len(prefix + inner) :]] = tensor
    return state
