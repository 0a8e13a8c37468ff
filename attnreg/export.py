"""Export a pruned model to where it is served: a plain transformers checkpoint, a GGUF file for llama.cpp, an ONNX
graph for ONNX Runtime.

`save_pruned` writes a folder only attnreg's `load_pruned` reads: the config keeps the original head counts, and
the pruning record rebuilds the model. An export writes what the serving stack reads by itself. Each export reads
the model's structure (the heads each layer has now, `attnreg.heads`, and where they live, `attnreg.families`) and
works on a copy made ready to serve: an attached hub detached (gates and temperatures folded into the weights), a
`PeftModel` merged, silenced heads folded into zero output-projection columns (they add exactly nothing, as the
silencing hook made them). The model handed over is never changed.

- `export_transformers`, plain transformers: one head count for all layers, `head_dim` in the config. Refuses
  counts that differ by layer, and families that derive the head size from the hidden size (BERT, GPT-2).
- `export_gguf`, GGUF for llama.cpp, f32: Llama decoders, uniform (`llama` architecture) or with per-layer counts
  (`deci`). Refuses other families, rope scaling, biases, and layers left without heads.
- `export_onnx`, ONNX for ONNX Runtime: any pruned model, per-layer counts included (encoders are what it is for).

Every refusal is an `ExportError` raised before anything is written, naming the formats that can carry the model.

Example:
    >>> import tempfile
    >>> from transformers import AutoModelForCausalLM
    >>> from attnreg.methods.pruning import prune_heads
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("llama", head="causal_lm").eval()     # 4 query heads sharing 2 key/value heads
    >>> _ = prune_heads(model, {0: [2, 3], 1: [0, 1]})           # one group in each layer
    >>> folder = export_transformers(model, tempfile.mkdtemp())
    >>> plain = AutoModelForCausalLM.from_pretrained(folder)
    >>> plain.config.num_attention_heads, plain.config.num_key_value_heads, plain.config.head_dim
    (2, 1, 8)
    >>> ids = torch.tensor([[5, 6, 7]])
    >>> torch.allclose(plain(ids).logits, model(ids).logits, atol=1e-5)
    True
"""

from __future__ import annotations

import copy
import importlib.util
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from attnreg import compat, weights
from attnreg.families import Family, detect_family
from attnreg.heads import head_numbers, silenced_heads
from attnreg.hub import detach, is_attached
from attnreg.unwrap import transformers_model

__all__ = ["FORMATS", "ExportError", "check_export", "export_gguf", "export_onnx", "export_transformers", "head_layout"]

CARRIERS = (
    "attnreg.methods.pruning.save_pruned (any family, any layout; read back with load_pruned), "
    "attnreg.export.export_gguf (Llama decoders, per-layer counts included, for llama.cpp) and "
    "attnreg.export.export_onnx (any family, per-layer counts included; what encoders are served with)"
)
"""The formats named by a refusal."""

FORMATS = ("transformers", "gguf", "onnx")
"""The export formats: `export_transformers`, `export_gguf`, `export_onnx`."""

GGUF_FAMILIES = ("llama",)
"""Families `export_gguf` writes (llama.cpp's `llama` architecture, or `deci` for per-layer head counts)."""


class ExportError(ValueError):
    """An export that cannot be exact, refused before anything is written; the message names the reason and the
    formats that can carry the model.

    Example:
        >>> import tempfile
        >>> from attnreg.methods.pruning import prune_heads
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("gpt2", head="causal_lm")
        >>> _ = prune_heads(model, {0: [0, 1], 1: [2, 3]})       # 2 heads in every layer
        >>> export_transformers(model, tempfile.mkdtemp())      # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        attnreg.export.ExportError: cannot write GPT2LMHeadModel as a plain transformers checkpoint: gpt2 ...
    """


def head_layout(model: nn.Module) -> list[tuple[int, int]]:
    """(query heads, key/value heads) each layer has now, read from the structure (a `PeftModel` or an attached
    model gives its transformers model's).

    Example:
        >>> from attnreg.methods.pruning import prune_heads
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("llama")
        >>> _ = prune_heads(model, {1: [0, 1]})
        >>> head_layout(model)
        [(4, 2), (2, 1)]
    """
    inner = transformers_model(model)
    family = detect_family(inner)
    return [family.head_counts(family.attention_module(inner, i)) for i in range(len(family.blocks(inner)))]


def check_export(model: nn.Module, formats: Sequence[str]) -> None:
    """Refuse, before training, the `formats` (of `FORMATS`) that no pruning of `model` could make exact: those the
    family alone rules out. Whether the heads kept allow it (one count for all layers, say) is checked by the export
    itself, when the pruned model is there.

    - `transformers`: the family must read the head size from `config.head_dim`. Probed by building the model class
      on the meta device from a config with twice the heads and `head_dim` unchanged: each size of its attention
      weights must stay or double, some doubling (Llama's do; BERT, GPT-2 and Phi's per-head norms divide
      `hidden_size` among the heads instead).
    - `gguf`: the family and the config must be what `export_gguf` writes (`_check_gguf`).
    - `onnx`: any model.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> check_export(tiny_model("llama", head="causal_lm"), ["transformers", "gguf"])
        >>> check_export(tiny_model("bert"), ["onnx", "gguf"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        attnreg.export.ExportError: cannot write BertModel as GGUF: family 'bert' is not one attnreg writes as GGUF ...
    """
    unknown = [name for name in formats if name not in FORMATS]
    if unknown:
        raise ExportError(f"unknown export formats {unknown}: attnreg writes {list(FORMATS)}")
    inner = transformers_model(model)
    family = detect_family(inner)
    if "gguf" in formats:
        _check_gguf(inner, family, head_layout(inner))
    if "transformers" in formats and not _reads_head_dim(inner, family):
        raise ExportError(
            f"cannot write {type(inner).__name__} as a plain transformers checkpoint once heads are removed: "
            f"{family.name} derives the head size from hidden_size / num_attention_heads instead of reading "
            f"config.head_dim, so no plain config gives it fewer heads. Formats that carry it: {CARRIERS}."
        )


def _reads_head_dim(model: PreTrainedModel, family: Family) -> bool:
    config = copy.deepcopy(model.config)
    _strip_record(config)
    attention = family.attention_module(model, 0)
    heads, kv_heads = family.head_counts(attention)
    config.head_dim = family.head_dim(attention)
    config.num_attention_heads = 2 * heads
    if hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = 2 * kv_heads
    try:
        with torch.device("meta"):
            rebuilt = type(model)(config)
    except Exception:  # a config that cannot even build (hidden_size not a multiple of the heads)
        return False
    path = next(name for name, module in model.named_modules() if module is attention)
    before = {name: tuple(p.shape) for name, p in attention.named_parameters()}
    after = {name: tuple(p.shape) for name, p in rebuilt.get_submodule(path).named_parameters()}
    if before.keys() != after.keys() or any(len(before[name]) != len(after[name]) for name in before):
        return False
    sizes = [(old, new) for name in before for old, new in zip(before[name], after[name], strict=True)]
    # every size kept or doubled with the heads (a per-head norm of head_dim keeps its size), and some doubled
    return all(new in (old, 2 * old) for old, new in sizes) and any(new == 2 * old for old, new in sizes)


# --- the copy that is served -----------------------------------------------------------------------------------


def _serving_copy(model: nn.Module, target: str) -> PreTrainedModel:
    """A copy of `model` as a plain transformers model computing what `model` computes: hub detached (gates and
    temperatures folded), a `PeftModel` merged, silenced heads folded into zero output-projection columns, eval mode.
    """
    inner = transformers_model(model)
    if inner is model and weights.adapter_layers(inner):
        layers = sorted(weights.adapter_layers(inner))[:3]
        raise ExportError(
            f"cannot write {type(inner).__name__} as {target}: it holds adapter layers ({', '.join(layers)}, ...) "
            "without the PeftModel that can merge them; export the PeftModel (the export merges a copy), or merge "
            "the adapter first (merge_and_unload). Nothing was written."
        )
    served = copy.deepcopy(model)
    if is_attached(served):
        detach(served)  # gates and temperatures folded into the base weights and the adapters
    if not isinstance(served, PreTrainedModel) and callable(getattr(served, "merge_and_unload", None)):
        served = served.merge_and_unload()
    if weights.adapter_layers(served):
        raise ExportError(f"cannot write {target}: the adapter did not merge. Nothing was written.")
    if getattr(served, "hf_quantizer", None) is not None:  # loaded from a GGUF file, dequantized: a float model
        try:
            compat.clear_quantizer(served)
        except ValueError as error:
            raise ExportError(f"cannot write {target}: {error}. Nothing was written.") from None
    _fold_silenced(served)
    return served.eval()


def _fold_silenced(model: PreTrainedModel) -> None:
    """Zero the output-projection columns of silenced heads and take off their hook: exact, since a silenced head's
    context is zeroed before the projection (merging an adapter may have given those columns values again)."""
    family = detect_family(model)
    for layer, heads in silenced_heads(model).items():
        attention = family.attention_module(model, layer)
        projection = family.out_projection(model, layer)
        size = family.head_dim(attention)
        numbers = head_numbers(model, layer)
        scale = torch.ones(len(numbers) * size)
        for head in heads:
            position = numbers.index(head)
            scale[position * size : (position + 1) * size] = 0.0
        with torch.no_grad():
            weights.scale_input_columns(projection, scale)
        hooks = compat.forward_pre_hooks(projection)
        for key in [key for key, hook in hooks.items() if getattr(hook, "attnreg_hook", False)]:
            del hooks[key]
        for name in [name for name, _ in projection.named_buffers(recurse=False) if name.startswith("attnreg_")]:
            delattr(projection, name)


def _strip_record(config: Any) -> None:
    for key in [key for key in vars(config) if key.startswith("attnreg_")]:
        delattr(config, key)


# --- plain transformers ----------------------------------------------------------------------------------------


def export_transformers(model: nn.Module, directory: str | Path, tokenizer: Any = None, **save_options: Any) -> Path:
    """Write a pruned model as an ordinary transformers checkpoint that plain `from_pretrained` loads.

    Possible when every layer keeps the same number of query heads and of key/value heads and the family reads
    `head_dim` from its config (Llama, Qwen2/3, Mistral, Gemma and their kin): the config carries the new
    `num_attention_heads`, `num_key_value_heads` and an explicit `head_dim`, and no attnreg record; the folder holds
    no attnreg file. Silenced heads stay as heads whose output columns are zero (exact; a later fine-tune may revive
    them). A `PeftModel` is merged (in a copy); an attached model's gates and temperatures are folded.

    Refused with an `ExportError` before anything is written where the counts differ by layer, or where the config
    cannot say the new sizes (BERT, GPT-2 and other families that derive the head size from `hidden_size /
    num_attention_heads`): the message names the formats that can carry the model. Before writing, the model class
    is rebuilt from the new config on the meta device and every weight shape compared, so what is written loads.

    Returns `directory`. `save_options` go to `save_pretrained` (`safe_serialization`, `max_shard_size`, ...).
    """
    inner = transformers_model(model)
    family = detect_family(inner)
    layout = head_layout(inner)
    name = type(inner).__name__
    if len(set(layout)) > 1:
        counts = ", ".join(f"layer {i}: {q}/{kv}" for i, (q, kv) in enumerate(layout))
        raise ExportError(
            f"cannot write {name} as a plain transformers checkpoint: its layers keep different numbers of heads "
            f"(query/key-value heads, {counts}), and a transformers config holds one count for all layers. "
            f"Formats that carry per-layer counts: {CARRIERS}. Nothing was written."
        )
    served = _serving_copy(model, "a plain transformers checkpoint")
    config = _plain_config(served, family, layout)
    _check_rebuilds(served, family, config)
    served.config = config
    served.config.architectures = [type(served).__name__]
    directory = Path(directory)
    served.save_pretrained(directory, **save_options)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def _plain_config(model: PreTrainedModel, family: Family, layout: list[tuple[int, int]]) -> Any:
    config = copy.deepcopy(model.config)
    _strip_record(config)
    num_heads, num_kv = layout[0]
    config.num_attention_heads = num_heads
    if hasattr(config, "num_key_value_heads") or num_kv != num_heads:
        config.num_key_value_heads = num_kv
    config.head_dim = family.head_dim(family.attention_module(model, 0))
    return config


def _check_rebuilds(model: PreTrainedModel, family: Family, config: Any) -> None:
    """Build the model class from `config` on the meta device: every weight must have the pruned model's shape."""
    name = type(model).__name__
    try:
        with torch.device("meta"):
            rebuilt = type(model)(copy.deepcopy(config))
        expected = {key: tuple(value.shape) for key, value in rebuilt.state_dict().items()}
    except Exception as error:  # a config that cannot even build: e.g. hidden_size not a multiple of the heads
        expected, failure = {}, f"{type(error).__name__}: {error}"
    else:
        failure = None
    actual = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    mismatched = [
        f"{key} {expected.get(key)} instead of {shape}" for key, shape in actual.items() if expected.get(key) != shape
    ]
    if failure is None and not mismatched:
        return
    why = failure or "; ".join(mismatched[:3])
    raise ExportError(
        f"cannot write {name} as a plain transformers checkpoint: {family.name} derives the head size from "
        f"hidden_size / num_attention_heads instead of reading config.head_dim, so no plain config gives it fewer "
        f"heads (built from such a config: {why}). Formats that carry it: {CARRIERS}. Nothing was written."
    )


# --- GGUF for llama.cpp ----------------------------------------------------------------------------------------


def export_gguf(
    model: nn.Module,
    path: str | Path,
    tokenizer: Any = None,
    *,
    tokenizer_gguf: str | Path | None = None,
    name: str | None = None,
) -> Path:
    """Write a pruned Llama decoder as an f32 GGUF file that llama.cpp runs.

    Uniform head counts give llama.cpp's `llama` architecture (which transformers also reads, `from_pretrained(...,
    gguf_file=...)`); counts that differ by layer give its `deci` architecture, whose `head_count` and
    `head_count_kv` are arrays with one entry per layer (llama.cpp reads them into `n_head_arr`/`n_head_kv_arr`).
    Query and key rows are permuted per head as llama.cpp's converter does (its rotary layout). `head_dim` is written
    as `key_length`/`value_length`, since after pruning it no longer equals `hidden_size / head_count`.

    The vocabulary: `tokenizer_gguf`, a GGUF file whose `tokenizer.*` entries are copied as they are (the model's
    original GGUF, SmolLM2's say); else `tokenizer`, a fast BPE tokenizer written as llama.cpp's `gpt2` vocabulary;
    else none (`tokenizer.ggml.model = "none"`: llama.cpp then takes token ids only).

    Refused with an `ExportError` before anything is written for a family other than `GGUF_FAMILIES`, a model
    without its language-model head, rope scaling, projection biases, or a layer left without heads.
    """
    import gguf

    inner = transformers_model(model)
    family = detect_family(inner)
    layout = head_layout(inner)
    config = inner.config
    _check_gguf(inner, family, layout)
    if tokenizer is not None and tokenizer_gguf is None:
        vocabulary = _bpe_vocabulary(tokenizer, config.vocab_size)  # refuses a tokenizer it cannot write
    served = _serving_copy(model, "GGUF")
    uniform = len(set(layout)) == 1
    arch = "llama" if uniform else "deci"
    head_dim = family.head_dim(family.attention_module(served, 0))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name or f"{getattr(config, '_name_or_path', '') or 'model'} (heads pruned with attnreg)")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(len(layout))
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(layout[0][0] if uniform else [q for q, _ in layout])
    writer.add_head_count_kv(layout[0][1] if uniform else [kv for _, kv in layout])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(_rope_theta(config)))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    if tokenizer_gguf is not None:
        _copy_vocabulary(writer, tokenizer_gguf)
    elif tokenizer is not None:
        _write_vocabulary(writer, vocabulary)
    else:
        writer.add_tokenizer_model("none")
    for tensor_name, tensor in _gguf_tensors(served, family, layout):
        writer.add_tensor(tensor_name, tensor.detach().to(torch.float32).contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _check_gguf(model: PreTrainedModel, family: Family, layout: list[tuple[int, int]]) -> None:
    name, config = type(model).__name__, model.config
    reasons = []
    if family.name not in GGUF_FAMILIES:
        reasons.append(f"family {family.name!r} is not one attnreg writes as GGUF (it writes {list(GGUF_FAMILIES)})")
    else:
        if getattr(model, "lm_head", None) is None:
            reasons.append("it has no language-model head (load it with AutoModelForCausalLM)")
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            reasons.append(f"rope scaling {rope.get('rope_type')!r} is not written")
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            reasons.append("projection biases are not written")
        if getattr(config, "hidden_act", "silu") != "silu":
            reasons.append(f"activation {config.hidden_act!r} is not llama.cpp's silu")
        empty = [i for i, (q, _) in enumerate(layout) if q == 0]
        if empty:
            reasons.append(f"layers {empty} have no heads left, which llama.cpp's deci runs differently")
    if reasons:
        raise ExportError(
            f"cannot write {name} as GGUF: {'; '.join(reasons)}. Formats that carry it: {CARRIERS}, and "
            "attnreg.export.export_transformers where every layer keeps the same counts. Nothing was written."
        )


def _rope_theta(config: Any) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's layout of query/key rows: per head, the two rotary halves interleaved (its converter's permute)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _gguf_tensors(
    model: PreTrainedModel, family: Family, layout: list[tuple[int, int]]
) -> list[tuple[str, torch.Tensor]]:
    import gguf

    def tensor_name(kind: Any, layer: int | None = None) -> str:
        base = gguf.TENSOR_NAMES[kind]
        return (base.format(bid=layer) if layer is not None else base) + ".weight"

    T = gguf.MODEL_TENSOR
    base = model.base_model
    tensors = [(tensor_name(T.TOKEN_EMBD), base.embed_tokens.weight), (tensor_name(T.OUTPUT_NORM), base.norm.weight)]
    if not model.config.tie_word_embeddings:
        tensors.append((tensor_name(T.OUTPUT), model.lm_head.weight))
    for i, (num_heads, num_kv) in enumerate(layout):
        block, attention = family.blocks(model)[i], family.attention_module(model, i)
        tensors += [
            (tensor_name(T.ATTN_NORM, i), block.input_layernorm.weight),
            (tensor_name(T.ATTN_Q, i), _permute(attention.get_submodule(family.query).weight, num_heads)),
            (tensor_name(T.ATTN_K, i), _permute(attention.get_submodule(family.key).weight, num_kv)),
            (tensor_name(T.ATTN_V, i), attention.get_submodule(family.value).weight),
            (tensor_name(T.ATTN_OUT, i), family.out_projection(model, i).weight),
            (tensor_name(T.FFN_NORM, i), block.post_attention_layernorm.weight),
            (tensor_name(T.FFN_GATE, i), block.mlp.gate_proj.weight),
            (tensor_name(T.FFN_UP, i), block.mlp.up_proj.weight),
            (tensor_name(T.FFN_DOWN, i), block.mlp.down_proj.weight),
        ]
    return tensors


def _bpe_vocabulary(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """Tokens, token types and merges of a fast BPE tokenizer, padded to the model's vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise ExportError(
            f"cannot write the vocabulary of {type(tokenizer).__name__} into GGUF: llama.cpp's gpt2 vocabulary is a "
            f"byte-level BPE, and this tokenizer's model is {model.get('type')!r}. Pass tokenizer_gguf= a GGUF file "
            "to copy the vocabulary from, or no tokenizer (llama.cpp then takes token ids). Nothing was written."
        )
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    special = {added["id"] for added in spec.get("added_tokens", []) if added.get("special")}
    if by_id and max(by_id) >= vocab_size:
        raise ExportError(f"the tokenizer has ids up to {max(by_id)}, the model only {vocab_size} embeddings")
    tokens, types = [], []
    for index in range(vocab_size):
        if index in by_id:
            tokens.append(by_id[index])
            types.append(3 if index in special else 1)  # gguf.TokenType.CONTROL / NORMAL
        else:
            tokens.append(f"[PAD{index}]")
            types.append(5)  # gguf.TokenType.UNUSED
    merges = [" ".join(merge) if isinstance(merge, list) else merge for merge in model.get("merges", [])]
    ids = {key: getattr(tokenizer, f"{key}_token_id", None) for key in ("bos", "eos", "unk", "pad")}
    return {"tokens": tokens, "types": types, "merges": merges, "ids": ids}


def _write_vocabulary(writer: Any, vocabulary: Mapping[str, Any]) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocabulary["tokens"])
    writer.add_token_types(vocabulary["types"])
    if vocabulary["merges"]:
        writer.add_token_merges(vocabulary["merges"])
    for key, index in vocabulary["ids"].items():
        if index is not None:
            getattr(writer, {"unk": "add_unk_token_id", "pad": "add_pad_token_id"}.get(key, f"add_{key}_token_id"))(
                int(index)
            )


def _copy_vocabulary(writer: Any, source: str | Path) -> None:
    import gguf

    reader = gguf.GGUFReader(source)
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub_type)


# --- ONNX for ONNX Runtime -------------------------------------------------------------------------------------


ONNX_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
"""The model inputs `export_onnx` can name in the graph."""


class _FirstOutput(nn.Module):
    """The model's forward with named inputs (the exporters trace named parameters, not `**kwargs`), returning one
    output tensor (`logits`, `last_hidden_state`)."""

    def __init__(self, model: PreTrainedModel, output: str) -> None:
        super().__init__()
        self.model, self.output = model, output

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        given = dict(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids
        )
        outputs = self.model(**{key: value for key, value in given.items() if value is not None}, return_dict=True)
        return getattr(outputs, self.output)


def export_onnx(
    model: nn.Module,
    path: str | Path,
    *,
    inputs: Sequence[str] = ("input_ids", "attention_mask"),
    sample: Mapping[str, torch.Tensor] | None = None,
    output: str | None = None,
    dynamo: bool | None = None,
    opset: int | None = None,
) -> Path:
    """Write a pruned model (an encoder classifier, typically) as an ONNX graph that ONNX Runtime runs, with batch and
    sequence length free (dynamic axes), per-layer head counts included: each projection keeps its pruned size.

    `inputs` name the model's inputs in the graph, in this order; `sample` gives tensors for them (default: batch 2 of
    8 tokens, the second row padded, so the padding mask is traced). `output` is the model output written (default:
    `logits`, else `last_hidden_state`). `dynamo=None` uses torch's `torch.export`-based exporter where `onnxscript` is
    installed and the TorchScript one otherwise (both checked on torch 2.13). The graph and its weights are one file
    below 1.8 GB of weights; above, the weights go to `<path>.data` beside it. The copy exported has its hub detached,
    any `PeftModel` merged and silenced heads folded, as for the other formats.
    """
    served = _serving_copy(model, "ONNX")
    if getattr(served.config, "use_cache", None):
        served.config.use_cache = False
    if sample is None:
        ids = torch.randint(1, max(2, served.config.vocab_size), (2, 8))
        mask = torch.ones_like(ids)
        mask[1, 5:] = 0
        pool = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
        pool["position_ids"] = torch.arange(ids.shape[1]).expand_as(ids)
        sample = {key: pool[key] for key in inputs}
    unknown = [key for key in inputs if key not in ONNX_INPUTS]
    if unknown:
        raise ExportError(f"export_onnx: inputs {unknown} are not among {list(ONNX_INPUTS)}. Nothing was written.")
    missing = [key for key in inputs if key not in sample]
    if missing:
        raise ExportError(f"export_onnx: sample= has no tensor for inputs {missing}. Nothing was written.")
    with torch.no_grad():
        produced = served(**{key: sample[key] for key in inputs}, return_dict=True)
    if output is None:
        output = "logits" if "logits" in produced else "last_hidden_state"
    if output not in produced:
        raise ExportError(f"export_onnx: the model gives {list(produced.keys())}, not {output!r}. Nothing was written.")
    if dynamo is None:
        dynamo = importlib.util.find_spec("onnxscript") is not None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    wrapper = _FirstOutput(served, output).eval()
    kwargs = {key: sample[key] for key in inputs}
    options: dict[str, Any] = {"input_names": list(inputs), "output_names": [output], "dynamo": dynamo}
    if opset is not None:
        options["opset_version"] = opset
    if dynamo:  # one file where protobuf's 2 GB limit allows it, else the weights in `<path>.data` beside it
        options["external_data"] = sum(p.numel() * p.element_size() for p in served.parameters()) > 1_800_000_000
        batch, length = torch.export.Dim("batch"), torch.export.Dim("sequence")
        options["dynamic_shapes"] = {key: {0: batch, 1: length} for key in inputs}
    else:
        axes = {key: {0: "batch", 1: "sequence"} for key in inputs}
        axes[output] = {0: "batch"} if produced[output].dim() == 2 else {0: "batch", 1: "sequence"}
        options["dynamic_axes"] = axes
    with torch.no_grad():
        torch.onnx.export(wrapper, (), str(path), kwargs=kwargs, **options)
    return path
