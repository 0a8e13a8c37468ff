"""Folding the hub's temperatures into a model's weights, so that it computes the same without the hub: into the
query projection's rows, or into the query norm where the family has one, and into gpt-oss's sink logits.
`attnreg.detach` folds this way (and `save_pretrained` while attached, on a copy); the gates fold into the output
projection (`AttentionHub.remove_gate`).

Example:
    >>> import copy, torch
    >>> from attnreg.families import detect_family
    >>> from attnreg.hub import attach
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("qwen3").eval(); ids = torch.tensor([[5, 6, 7]])   # a query norm shared by the heads
    >>> reference = copy.deepcopy(model); attach(reference).set_temperature(2.0, layers=[0])
    >>> family = detect_family(model)
    >>> check_foldable(model, family)
    >>> fold_temperature(family, family.attention_module(model, 0), torch.full((4,), 2.0))
    >>> with torch.no_grad():
    ...     torch.allclose(model(input_ids=ids)[0], reference(input_ids=ids)[0], atol=1e-5)
    True
"""

from __future__ import annotations

import torch
from torch import nn

from attnreg.families import Family
from attnreg.records import TEMPERATURE
from attnreg.weights import lora_factors, out_features, scale_output_rows


def check_foldable(model: nn.Module, family: Family) -> None:
    """Raise, before anything changes, where a temperature of the hub on `model` cannot be folded into the weights:
    a family whose query norm is shared by the heads (`Family.query_norm`) takes only one temperature per layer,
    and a LoRA adapter whose weights cannot take a fold (`attnreg.weights.lora_factors`) none.

    Example:
        >>> from attnreg.families import detect_family
        >>> from attnreg.hub import attach
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("qwen3"); attach(model).set_temperature(torch.tensor([1.0, 2.0, 1.0, 1.0]), layers=[1])
        >>> check_foldable(model, detect_family(model))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: cannot fold the temperatures of layer 1 ([1.0, 2.0, 1.0, 1.0]) into the weights of Qwen3Model ...
    """
    layers = range(len(family.blocks(model)))
    for layer in layers:
        attention = family.attention_module(model, layer)
        temperature = getattr(attention, TEMPERATURE, None)
        norm = family.query_norm_module(attention)
        shared = norm is not None and family.norm_layout == "shared"
        if temperature is None or not shared:
            continue
        if temperature.numel() and not torch.all(temperature == temperature[0]):
            raise ValueError(
                f"cannot fold the temperatures of layer {layer} ({temperature.tolist()}) into the weights of "
                f"{type(model).__name__} (model_type={model.config.model_type!r}): its query norm "
                f"({family.query_norm}) renormalises each head's query with one weight shared by all heads, so "
                "only a temperature equal on every head of a layer folds. Nothing was changed; set one value per "
                "layer, or remove them with hub.set_temperature(None)."
            )
    for layer in layers:
        lora_factors(family.out_projection(model, layer))
        attention = family.attention_module(model, layer)
        if getattr(attention, TEMPERATURE, None) is not None:
            lora_factors(attention.get_submodule(family.query or family.fused_qkv))


def fold_temperature(family: Family, attention: nn.Module, temperature: torch.Tensor) -> None:
    """Divide the logits of `attention` by `temperature` (one value per head) in its weights: the query projection's
    rows, or the query norm where there is one (it would undo a scale of the projection), and the sink logits
    where the family has them. The module's own temperature buffer is left to the caller."""
    norm = family.query_norm_module(attention)
    if norm is not None:  # the norm would undo a scale of the projection: fold into it
        _fold_into_norm(norm, family.query_norm_offset, temperature, family.norm_layout)
    else:
        query = attention.get_submodule(family.query or family.fused_qkv)
        scale = torch.ones(out_features(query))
        scale[family.query_rows(attention)] = (1.0 / temperature.cpu()).repeat_interleave(family.head_dim(attention))
        scale_output_rows(query, scale)
    sink = family.sink_parameter(attention)
    if sink is not None:  # the temperature divides the sink logits too
        with torch.no_grad():
            sink.copy_(sink.double().div(temperature.double().to(sink.device)).to(sink.dtype))


def _fold_into_norm(norm: nn.Module, offset: float, temperature: torch.Tensor, layout: str) -> None:
    """Divide what `norm` returns, head by head, by `temperature`: its weight enters as `offset + weight`, its bias
    (if any) adds. A norm shared by the heads (`Family.norm_layout` "shared") takes the first value (all are equal,
    `check_foldable`); a per-head norm (one module per head in `norms`, or weights `[H, head_dim]`) and
    a whole-width one (weights `[H * head_dim]`, normalised before the weight) one value per head."""
    temperature = temperature.detach().double().cpu()
    if layout == "shared":
        pairs = [(norm, None, temperature[0] if temperature.numel() else torch.tensor(1.0))]
    elif isinstance(getattr(norm, "norms", None), nn.ModuleList):
        pairs = [(module, None, value) for module, value in zip(norm.norms, temperature, strict=True)]
    else:
        pairs = [(norm, head, value) for head, value in enumerate(temperature)]
    heads = temperature.numel()
    with torch.no_grad():
        for module, head, value in pairs:
            for name, tensor_offset in (("weight", offset), ("bias", 0.0)):
                tensor = getattr(module, name, None)
                if tensor is None:
                    continue
                part = tensor if head is None else tensor.view(heads, -1)[head]
                part.copy_((part.double() + tensor_offset).div(value.item()).sub(tensor_offset).to(part.dtype))
