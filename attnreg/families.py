"""The one table of supported model families: where attention lives in each, and how heads are laid out.

Methods never branch on the family; they ask this table. Adding a family is one `Family` entry.

Example:
    >>> from transformers import BertConfig, BertModel
    >>> model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4))
    >>> family = detect_family(model)
    >>> family.name, len(family.blocks(model))
    ('bert', 2)
    >>> [family.name for family in FAMILIES]
    ['bert', 'roberta', 'electra', 'distilbert', 'gpt2', 'llama', 'qwen2', 'mistral']
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D


@dataclass(frozen=True)
class Family:
    """Where one model family keeps its attention, with paths relative to `model.base_model`.

    `attention` and `out_proj` are relative to one block of `blocks`; `query`, `key`, `value` are
    relative to the attention module (the module transformers hands to the attention function).
    A fused projection (GPT-2's `c_attn`) is named in `fused_qkv` instead. `head_count_attrs` and
    `width_attrs` name the attention module's attributes holding its query-head count and its
    heads x head_dim width, which physical head pruning keeps in step with the weights.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("llama")                 # 4 query heads sharing 2 key/value heads
        >>> family = detect_family(model)
        >>> attention = family.attention_module(model, 0)
        >>> family.causal, family.head_counts(attention), family.head_dim(attention)
        (True, (4, 2), 8)
        >>> family.module_path(model, 1, family.out_proj)
        'layers.1.self_attn.o_proj'
    """

    name: str
    model_types: tuple[str, ...]
    blocks_path: str
    attention: str
    out_proj: str
    head_dim_attr: str
    dropout_attr: str
    causal: bool
    query: str | None = None
    key: str | None = None
    value: str | None = None
    fused_qkv: str | None = None
    head_count_attrs: tuple[str, ...] = ()
    width_attrs: tuple[str, ...] = ()

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        """The list of transformer blocks of `model` (a base or a head model).

        Example:
            >>> from attnreg.tiny import tiny_model
            >>> model = tiny_model("gpt2", head="causal_lm", layers=3)
            >>> len(detect_family(model).blocks(model))
            3
        """
        return _get(_base_model(model), self.blocks_path)

    def attention_module(self, model: nn.Module, layer: int) -> nn.Module:
        return _get(self.blocks(model)[layer], self.attention)

    def out_projection(self, model: nn.Module, layer: int) -> nn.Module:
        return _get(self.blocks(model)[layer], self.out_proj)

    def module_path(self, model: nn.Module, layer: int, attr: str) -> str:
        """Dotted name of `attr` (a path inside block `layer`) as it appears in `model.state_dict()`."""
        base = _base_model(model)
        prefix = "" if base is model else f"{model.base_model_prefix}."
        return f"{prefix}{self.blocks_path}.{layer}.{attr}"

    def head_dim(self, attention: nn.Module) -> int:
        return int(getattr(attention, self.head_dim_attr))

    def head_counts(self, attention: nn.Module) -> tuple[int, int]:
        """(query heads, key/value heads), read from the current projection shapes."""
        head_dim = self.head_dim(attention)
        if self.fused_qkv is not None:
            heads = out_features(_get(attention, self.fused_qkv)) // (3 * head_dim)
            return heads, heads
        query = out_features(_get(attention, self.query))
        key = out_features(_get(attention, self.key))
        return query // head_dim, key // head_dim

    def attention_dropout(self, attention: nn.Module) -> float:
        """The dropout rate the model itself passes to the attention function in training."""
        value = getattr(attention, self.dropout_attr)
        return float(value.p if isinstance(value, nn.Dropout) else value)


_BERT_LIKE = dict(
    blocks_path="encoder.layer",
    attention="attention.self",
    out_proj="attention.output.dense",
    query="query",
    key="key",
    value="value",
    head_dim_attr="attention_head_size",
    dropout_attr="dropout",
    causal=False,
    head_count_attrs=("num_attention_heads",),
    width_attrs=("all_head_size",),
)
_LLAMA_LIKE = dict(
    blocks_path="layers",
    attention="self_attn",
    out_proj="self_attn.o_proj",
    query="q_proj",
    key="k_proj",
    value="v_proj",
    head_dim_attr="head_dim",
    dropout_attr="attention_dropout",
    causal=True,
)

FAMILIES: tuple[Family, ...] = (
    Family(name="bert", model_types=("bert",), **_BERT_LIKE),
    Family(name="roberta", model_types=("roberta",), **_BERT_LIKE),
    Family(name="electra", model_types=("electra",), **_BERT_LIKE),
    Family(
        name="distilbert",
        model_types=("distilbert",),
        blocks_path="transformer.layer",
        attention="attention",
        out_proj="attention.out_lin",
        query="q_lin",
        key="k_lin",
        value="v_lin",
        head_dim_attr="attention_head_size",
        dropout_attr="dropout",
        causal=False,
        head_count_attrs=("n_heads",),
        width_attrs=("dim",),
    ),
    Family(
        name="gpt2",
        model_types=("gpt2",),
        blocks_path="h",
        attention="attn",
        out_proj="attn.c_proj",
        fused_qkv="c_attn",
        head_dim_attr="head_dim",
        dropout_attr="attn_dropout",
        causal=True,
        head_count_attrs=("num_heads",),
        width_attrs=("split_size",),
    ),
    Family(name="llama", model_types=("llama",), **_LLAMA_LIKE),
    Family(name="qwen2", model_types=("qwen2",), **_LLAMA_LIKE),
    Family(name="mistral", model_types=("mistral",), **_LLAMA_LIKE),
)


class UnsupportedModelError(TypeError):
    """The model belongs to no family in `FAMILIES`.

    Example:
        >>> detect_family(torch.nn.Linear(2, 2))
        Traceback (most recent call last):
        ...
        attnreg.families.UnsupportedModelError: attnreg does not support Linear (model_type=None); ...
    """


def detect_family(model: nn.Module) -> Family:
    """The `Family` of a transformers model, from its `config.model_type`.

    Raises `UnsupportedModelError` naming the model class and the supported families.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> detect_family(tiny_model("distilbert", head="classification")).name
        'distilbert'
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = ", ".join(f.name for f in FAMILIES)
    raise UnsupportedModelError(
        f"attnreg does not support {type(model).__name__} (model_type={model_type!r}); "
        f"supported families: {supported}. A new family is one Family entry in attnreg/families.py."
    )


def out_features(projection: nn.Module) -> int:
    """Output width of an nn.Linear or a GPT-2 Conv1D (whose weight is stored transposed).

    Example:
        >>> out_features(nn.Linear(3, 5)), out_features(Conv1D(5, 3))
        (5, 5)
    """
    if isinstance(projection, Conv1D):
        return projection.weight.shape[1]
    return projection.weight.shape[0]


def scale_input_columns(projection: nn.Module, scale: torch.Tensor) -> None:
    """Multiply the projection's input features by `scale` (one value per input feature), in place.

    Example:
        >>> projection = nn.Linear(2, 1, bias=False)
        >>> projection.weight.data = torch.tensor([[1.0, 1.0]])
        >>> scale_input_columns(projection, torch.tensor([0.0, 3.0]))
        >>> projection.weight
        Parameter containing:
        tensor([[0., 3.]], requires_grad=True)
    """
    weight = projection.weight
    with torch.no_grad():
        if isinstance(projection, Conv1D):
            weight.mul_(scale.to(weight)[:, None])
        else:
            weight.mul_(scale.to(weight)[None, :])


def scale_output_rows(projection: nn.Module, scale: torch.Tensor, start: int = 0) -> None:
    """Multiply output features `start : start + len(scale)` (weight and bias) by `scale`, in place.

    Example:
        >>> projection = nn.Linear(1, 3)
        >>> projection.bias.data = torch.ones(3)
        >>> scale_output_rows(projection, torch.tensor([0.0, 2.0]), start=1)
        >>> projection.bias
        Parameter containing:
        tensor([1., 0., 2.], requires_grad=True)
    """
    stop = start + scale.numel()
    with torch.no_grad():
        if isinstance(projection, Conv1D):
            projection.weight[:, start:stop].mul_(scale.to(projection.weight)[None, :])
        else:
            projection.weight[start:stop].mul_(scale.to(projection.weight)[:, None])
        if projection.bias is not None:
            projection.bias[start:stop].mul_(scale.to(projection.bias))


def _base_model(model: nn.Module) -> nn.Module:
    return getattr(model, "base_model", model)


def _get(module: nn.Module, path: str) -> nn.Module:
    return module.get_submodule(path)
