"""The one table of supported model families: where attention lives in each, and how heads are laid out.

Methods never branch on the family; they ask this table. Adding a family is one `Family` entry.

Example:
    >>> from transformers import BertConfig, BertModel
    >>> model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4))
    >>> family = detect_family(model)
    >>> family.name, len(family.blocks(model))
    ('bert', 2)
    >>> [family.name for family in FAMILIES]  # doctest: +NORMALIZE_WHITESPACE
    ['bert', 'roberta', 'xlm-roberta', 'electra', 'distilbert', 'modernbert', 'gpt2', 'llama', 'qwen2', 'mistral',
     'mixtral', 'granite', 'phi3', 'qwen3', 'qwen3_moe', 'smollm3', 'cohere2', 'cohere', 'stablelm', 'olmo2', 'olmo3',
     'phi', 'gptj', 'gpt_neox', 'gemma2', 'gpt_oss', 'gemma3_text', 'gemma3']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnreg.weights import out_features


@dataclass(frozen=True)
class Family:
    """Where one model family keeps its attention, with paths relative to `model.base_model`.

    `attention` and `out_proj` are relative to one block of `blocks`; `query`, `key`, `value` are
    relative to the attention module (the module transformers hands to the attention function).
    A fused projection (GPT-2's `c_attn`) is named in `fused_qkv` instead. `head_count_attrs` and
    `width_attrs` name the attention module's attributes holding its query-head count and its
    heads x head_dim width, which physical head pruning keeps in step with the weights.

    `query_norm` names a norm applied to each head's query after the projection, with one weight of size
    `head_dim` shared by all heads (Qwen3, Gemma 3): it undoes any scale of the query projection, so a
    temperature is folded into its weight instead (`weight -> (offset + weight) / T - offset`, with
    `query_norm_offset` 1 for Gemma's `1 + weight` norms), which only a temperature equal on all heads
    of a layer can be (`norm_layout="shared"`). Shared by the heads, it needs no slicing when heads are
    removed. With `norm_layout="per_head"` the query norm (and `key_norm`, the key norm) has its own weights
    for each head: a weight `[H, head_dim]` (Cohere) or one norm module per head in `norms` (StableLM); head
    removal slices them along, and any temperature folds head by head. With `"whole"` it normalises all
    heads together (OLMo-2: a weight `[H * head_dim]`): a temperature folds into each head's slice of the
    weight, but removing a head would change the others' normalisation, so `prune_heads` silences
    requested heads in place instead (and says so).

    A fused projection holds all query rows, then all key rows, then all value rows (`fused_layout="blocks"`),
    or the query, key and value rows of head 0, then those of head 1, ... (`"per_head"`, GPT-NeoX). With grouped-query
    attention (Phi-3) `group_size_attr` names the module's query heads per key/value head, which tells the
    counts apart; `kv_head_count_attrs` name its key/value head counts, and `config_head_count_attrs` the
    attributes of the module's `config` its forward reads as head counts: a pruned layer gets a view of the
    model's config with its own counts there.

    `head_parameters` name parameters of the attention module holding one value per query head along their first
    dim; head removal slices them with their heads. `sink` names the one that is a learned logit per head joining
    each row's softmax denominator as one more outcome that no value reads (gpt-oss's `sinks`, which transformers
    passes the attention function as `s_aux`): the hub's temperature divides it as it divides the query's logits,
    so `detach` folds the temperature into it as well as into the query projection.

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
    query_norm: str | None = None
    query_norm_offset: float = 0.0
    key_norm: str | None = None
    norm_layout: str = "shared"
    fused_layout: str = "blocks"
    group_size_attr: str | None = None
    kv_head_count_attrs: tuple[str, ...] = ()
    config_head_count_attrs: tuple[str, ...] = ()
    head_parameters: tuple[str, ...] = ()
    sink: str | None = None

    def __post_init__(self) -> None:
        if self.fused_layout not in ("blocks", "per_head"):
            raise ValueError(
                f"Family {self.name!r}: fused_layout must be 'blocks' or 'per_head', got {self.fused_layout!r}"
            )
        if self.norm_layout not in ("shared", "per_head", "whole"):
            raise ValueError(
                f"Family {self.name!r}: norm_layout must be 'shared', 'per_head' or 'whole', got {self.norm_layout!r}"
            )
        if self.fused_layout == "per_head" and self.group_size_attr is not None:
            raise ValueError(f"Family {self.name!r}: a 'per_head' fused layout has one key/value head per query head")
        if self.sink is not None and self.sink not in self.head_parameters:
            raise ValueError(
                f"Family {self.name!r}: sink {self.sink!r} must be one of head_parameters, a value per head"
            )

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
            width = out_features(_get(attention, self.fused_qkv))
            group = 1 if self.group_size_attr is None else int(getattr(attention, self.group_size_attr))
            kv_heads = width // ((group + 2) * head_dim)
            return group * kv_heads, kv_heads
        query = out_features(_get(attention, self.query))
        key = out_features(_get(attention, self.key))
        return query // head_dim, key // head_dim

    def fused_rows(self, query_heads: list[int], kv_heads: list[int], attention: nn.Module) -> torch.Tensor:
        """Rows of the fused projection that hold query heads `query_heads` and key/value heads `kv_heads`
        (current positions), in the layout's order.

        Example:
            >>> from attnreg.tiny import tiny_model
            >>> model = tiny_model("gpt2", hidden=8, heads=4)     # heads of 2: q rows 0-7, k rows 8-15, v rows 16-23
            >>> family = detect_family(model)
            >>> family.fused_rows([1], [1], family.attention_module(model, 0)).tolist()
            [2, 3, 10, 11, 18, 19]
        """
        head_dim = self.head_dim(attention)
        if self.fused_layout == "per_head":
            return _rows(query_heads, 3 * head_dim)
        num_heads, num_kv = self.head_counts(attention)
        kv_rows = _rows(kv_heads, head_dim)
        return torch.cat(
            [_rows(query_heads, head_dim), num_heads * head_dim + kv_rows, (num_heads + num_kv) * head_dim + kv_rows]
        )

    def query_rows(self, attention: nn.Module) -> torch.Tensor:
        """Output rows of the query projection (or the fused one) holding the queries, head by head.

        Example:
            >>> from attnreg.tiny import tiny_model
            >>> model = tiny_model("gpt_neox", hidden=8, heads=4)  # q, k, v rows of head 0, then of head 1, ...
            >>> family = detect_family(model)
            >>> family.query_rows(family.attention_module(model, 0)).tolist()[:6]
            [0, 1, 6, 7, 12, 13]
        """
        num_heads, _ = self.head_counts(attention)
        head_dim = self.head_dim(attention)
        if self.fused_qkv is not None and self.fused_layout == "per_head":
            return (torch.arange(num_heads)[:, None] * 3 * head_dim + torch.arange(head_dim)).reshape(-1)
        return torch.arange(num_heads * head_dim)

    def query_norm_module(self, attention: nn.Module) -> nn.Module | None:
        """The query norm of `attention` (`query_norm`), or None where the family or this model has none."""
        return None if self.query_norm is None else getattr(attention, self.query_norm, None)

    def key_norm_module(self, attention: nn.Module) -> nn.Module | None:
        """The key norm of `attention` (`key_norm`), or None where the family or this model has none."""
        return None if self.key_norm is None else getattr(attention, self.key_norm, None)

    def sink_parameter(self, attention: nn.Module) -> nn.Parameter | None:
        """The per-head sink logits of `attention` (`sink`), or None where the family has none.

        Example:
            >>> from attnreg.tiny import tiny_model
            >>> model = tiny_model("gpt_oss")                # one learned sink logit per query head
            >>> family = detect_family(model)
            >>> family.sink_parameter(family.attention_module(model, 0)).shape
            torch.Size([4])
        """
        return None if self.sink is None else attention.get_parameter(self.sink)

    def attention_dropout(self, attention: nn.Module) -> float:
        """The dropout rate the model itself passes to the attention function in training."""
        value = getattr(attention, self.dropout_attr)
        return float(value.p if isinstance(value, nn.Dropout) else value)


_BERT_LIKE: dict[str, Any] = dict(
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
_LLAMA_LIKE: dict[str, Any] = dict(
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
    Family(name="xlm-roberta", model_types=("xlm-roberta",), **_BERT_LIKE),
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
        name="modernbert",
        model_types=("modernbert",),
        blocks_path="layers",
        attention="attn",
        out_proj="attn.Wo",
        fused_qkv="Wqkv",
        head_dim_attr="head_dim",
        dropout_attr="attention_dropout",
        causal=False,
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
    Family(name="mixtral", model_types=("mixtral",), **_LLAMA_LIKE),
    Family(name="granite", model_types=("granite",), **_LLAMA_LIKE),
    Family(
        name="phi3",
        model_types=("phi3",),
        **{**_LLAMA_LIKE, "query": None, "key": None, "value": None},
        fused_qkv="qkv_proj",
        group_size_attr="num_key_value_groups",
        kv_head_count_attrs=("num_key_value_heads",),
        config_head_count_attrs=("num_attention_heads",),
    ),
    Family(name="qwen3", model_types=("qwen3",), query_norm="q_norm", **_LLAMA_LIKE),
    Family(name="qwen3_moe", model_types=("qwen3_moe",), query_norm="q_norm", **_LLAMA_LIKE),
    Family(name="smollm3", model_types=("smollm3",), **_LLAMA_LIKE),
    Family(name="cohere2", model_types=("cohere2",), **_LLAMA_LIKE),
    Family(
        name="cohere",
        model_types=("cohere",),
        query_norm="q_norm",  # only with config.use_qk_norm
        key_norm="k_norm",
        norm_layout="per_head",
        **_LLAMA_LIKE,
    ),
    Family(
        name="stablelm",
        model_types=("stablelm",),
        query_norm="q_layernorm",  # only with config.qk_layernorm
        key_norm="k_layernorm",
        norm_layout="per_head",
        head_count_attrs=("num_heads",),
        kv_head_count_attrs=("num_key_value_heads",),
        **_LLAMA_LIKE,
    ),
    Family(name="olmo2", model_types=("olmo2",), query_norm="q_norm", norm_layout="whole", **_LLAMA_LIKE),
    Family(name="olmo3", model_types=("olmo3",), query_norm="q_norm", norm_layout="whole", **_LLAMA_LIKE),
    Family(
        name="phi",
        model_types=("phi",),
        **{**_LLAMA_LIKE, "out_proj": "self_attn.dense"},
        query_norm="q_layernorm",  # only with config.qk_layernorm
    ),
    Family(
        name="gptj",
        model_types=("gptj",),
        blocks_path="h",
        attention="attn",
        out_proj="attn.out_proj",
        query="q_proj",
        key="k_proj",
        value="v_proj",
        head_dim_attr="head_dim",
        dropout_attr="attention_dropout",
        causal=True,
        head_count_attrs=("num_attention_heads",),
    ),
    Family(
        name="gpt_neox",
        model_types=("gpt_neox",),
        blocks_path="layers",
        attention="attention",
        out_proj="attention.dense",
        fused_qkv="query_key_value",
        fused_layout="per_head",
        head_dim_attr="head_size",
        dropout_attr="attention_dropout",
        causal=True,
    ),
    Family(name="gemma2", model_types=("gemma2",), **_LLAMA_LIKE),  # tanh-capped logits: the hub's softcap
    Family(name="gpt_oss", model_types=("gpt_oss",), head_parameters=("sinks",), sink="sinks", **_LLAMA_LIKE),
    Family(name="gemma3_text", model_types=("gemma3_text",), query_norm="q_norm", query_norm_offset=1.0, **_LLAMA_LIKE),
    Family(  # the text stack of the image-text model; its vision tower's attention runs on SDPA untouched
        name="gemma3",
        model_types=("gemma3",),
        query_norm="q_norm",
        query_norm_offset=1.0,
        **{**_LLAMA_LIKE, "blocks_path": "language_model.layers"},
    ),
)

_NO_INTERFACE = "its attention never calls transformers' attention interface (it computes attention itself)"
REFUSED: dict[str, str] = {
    "deberta-v2": _NO_INTERFACE + ": DeBERTa's disentangled attention adds position terms of its own",
    "falcon": "its fused query_key_value has three layouts (interleaved per head, multi-query, and grouped per "
    "key/value head in the new decoder architecture), which the family table cannot express yet",
    "qwen3_5_text": "attention runs on some layers only (the others are linear attention), which the family table "
    "cannot express",
    "gemma3n_text": "its last layers share key/value states with earlier layers (num_kv_shared_layers), so a removed "
    "key/value head would leave another layer; the family table cannot express it",
    "gemma4_text": "its layers have their own head dims and share key/value states across layers, which the family "
    "table cannot express",
}
"""Model types attnreg refuses, with the reason `detect_family` gives."""


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
    if model_type in REFUSED:
        raise UnsupportedModelError(
            f"attnreg does not support {type(model).__name__} (model_type={model_type!r}): {REFUSED[model_type]}."
        )
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = ", ".join(f.name for f in FAMILIES)
    raise UnsupportedModelError(
        f"attnreg does not support {type(model).__name__} (model_type={model_type!r}); "
        f"supported families: {supported}. A new family is one Family entry in attnreg/families.py."
    )


def families_markdown() -> str:
    """The README's and `docs/hub.md`'s tables of the supported families and the refused model types, rendered
    from `FAMILIES` and `REFUSED` (`tests/test_families_table.py` checks that both files hold it verbatim).

    Every supported family captures probabilities and runs the blockwise losses (`tests/test_families.py` checks
    each); head removal is exact unless a q/k norm spans all heads (then the heads are silenced in place), and a
    temperature folds per head unless one query norm weight is shared by the heads (then one value per layer).

    Example:
        >>> print(families_markdown().splitlines()[2])  # doctest: +NORMALIZE_WHITESPACE
        | bert | `bert` | `encoder.layer.i.attention.self` | `query` / `key` / `value` | `attention.output.dense` | no
         | yes | yes | exact | per head |
    """
    lines = [
        "| family | model types | attention module | q / k / v | output | causal | capture | blockwise "
        "| head removal | temperature fold |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for family in FAMILIES:
        if family.fused_qkv is None:
            projections = f"`{family.query}` / `{family.key}` / `{family.value}`"
        else:
            layout = "q, k, v blocks" if family.fused_layout == "blocks" else "interleaved per head"
            projections = f"fused `{family.fused_qkv}` ({layout})"
        norms = ", ".join(f"`{name}`" for name in (family.query_norm, family.key_norm) if name is not None)
        if family.query_norm is None:
            removal, fold = "exact", "per head"
        elif family.norm_layout == "whole":
            removal, fold = f"silenced ({norms} spans all heads)", f"per head (into {norms})"
        elif family.norm_layout == "per_head":
            removal, fold = f"exact (slices {norms})", f"per head (into {norms})"
        else:
            removal, fold = "exact", f"one value per layer ({norms} shared by the heads)"
        if family.head_parameters:  # sliced with the heads wherever removal is exact
            sliced = ", ".join(f"`{name}`" for name in family.head_parameters)
            if removal == "exact":
                removal = f"exact (slices {sliced})"
            elif removal.startswith("exact (slices "):
                removal = removal.replace("exact (slices ", f"exact (slices {sliced}, ")
        if family.sink is not None:
            fold += f", and into the sink logits `{family.sink}`"
        types = ", ".join(f"`{model_type}`" for model_type in family.model_types)
        lines.append(
            f"| {family.name} | {types} | `{family.blocks_path}.i.{family.attention}` | {projections} "
            f"| `{family.out_proj}` | {'yes' if family.causal else 'no'} | yes | yes | {removal} | {fold} |"
        )
    lines += ["", "| refused model type | why |", "|---|---|"]
    lines += [f"| `{model_type}` | {reason} |" for model_type, reason in REFUSED.items()]
    return "\n".join(lines) + "\n"


def _rows(heads: list[int], size: int) -> torch.Tensor:
    heads = torch.as_tensor(list(heads), dtype=torch.long)
    return (heads[:, None] * size + torch.arange(size)).reshape(-1)


def _base_model(model: nn.Module) -> nn.Module:
    return getattr(model, "base_model", model)


def _get(module: nn.Module, path: str) -> nn.Module:
    return module.get_submodule(path)
