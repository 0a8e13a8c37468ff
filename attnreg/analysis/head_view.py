"""A self-contained, interactive view of every attention head, as one HTML file (or inline in Jupyter).

`head_view(model, tokenizer, data)` runs the model over sentences (with gold trees: `read_conllu`,
`parse_texts`) or plain texts and writes what a person needs to *see* heads, reduced per head from queries and
keys in blocks of query rows (`attnreg.analysis.blocks`): no `[T, T]` attention is ever built, so the view of a
decoder on 8,192 tokens costs about what its forward costs. Per head it keeps

- the head statistics and parent accuracy of `attnreg.analysis.analyze` (the figures `head_statistics` gives);
- each query's `top_k` most attended keys, with their weights (one byte each);
- the attention each key receives (summed over queries: the sink shows as one bright token);
- with gold trees, each word's predicted parent (dependent to head, as `ParentAccuracy` scores it).

The page (a few kilobytes of the project's own JavaScript drawing on a canvas; no network request, no third-party
script) shows a grid of every layer x head coloured by a chosen statistic, with key/value groups and removed,
silenced and supervised heads marked; for the chosen head, the text with its strongest arcs (for the query under
the pointer, or for every query in view) and its received-attention strip; the gold dependency arcs with the
head's predicted parent per word; with `compare=`, a second checkpoint's grid, a difference grid and both heads'
arcs on the same text; and a picker over the documents. The data is embedded as base64 typed arrays. When the file
would exceed `budget` bytes, fewer keys per query are kept (then fewer documents' arcs), and the page says so. The
canvases are only as large as what they show (the text box, the parse overlay's visible width), redrawn on scroll:
a document of any length is drawn.

Each model runs once over the data: the arcs are reduced from the layers of `analyze`'s own pass, which also gives
the statistics (`HeadViewRecorder`; `attnreg-analyze --html` takes the view from the report's pass that way).

Example:
    >>> import tempfile
    >>> from attnreg.app.task import build_tokenizer, generate, vocabulary
    >>> from attnreg.tiny import tiny_model
    >>> tokenizer = build_tokenizer(vocabulary())
    >>> model = tiny_model("bert", vocab=len(tokenizer))              # a pretrained model in practice
    >>> sentences = [example.sentence for example in generate(4, seed=0)]   # or read_conllu("en_ewt-ud-dev.conllu")
    >>> view = head_view(model, tokenizer, sentences, supervised={0: [0], 1: [0]})
    >>> view.layers, view.heads, view.top_k, len(view.documents)
    (2, 4, 8, 4)
    >>> path = view.save(Path(tempfile.mkdtemp()) / "heads.html")     # open it in any browser, offline
    >>> path.stat().st_size < 100_000, view.notes                      # nothing had to be dropped
    (True, [])
"""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from attnreg.analysis.blocks import BLOCK_SIZE, attention_blocks, block_word_attention
from attnreg.analysis.dependencies import batch_word_attention, predicted_heads
from attnreg.analysis.heads import STATISTICS
from attnreg.analysis.runner import Analysis, LayerBatch, analyze
from attnreg.heads import head_numbers, pruned_heads, silenced_heads
from attnreg.hub import attach
from attnreg.records import LayerInputs
from attnreg.syntax.align import align_offsets
from attnreg.syntax.trees import Sentence

TOP_K = 8
"""Keys kept per query and head, at most (fewer where the budget says so)."""

BUDGET = 25_000_000
"""Bytes the HTML file may take, by default: MiniLM on a 512-token input takes about 1.3 MB with `TOP_K` keys,
SmolLM2-135M (30 x 9 heads) on 8,192 tokens keeps 2 keys per query to stay under it."""

_ASSETS = Path(__file__).parent
_OVERHEAD = 30_000  # the page's own script and style (about 20 kB), and the JSON around the arrays


def head_arcs(
    inputs: LayerInputs,
    top_k: int = TOP_K,
    attention_mask: torch.Tensor | None = None,
    block_size: int = BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each query's `top_k` most attended keys `[B, H, T, k]` (key positions, then their weights) and the attention
    each key receives `[B, H, S]` (summed over the real query rows of `attention_mask` `[B, T]`; all rows where None),
    from the layer's queries and keys, `block_size` query rows at a time (`attention_blocks`). Slots beyond the
    keys a causal query can see read key 0 with weight 0.

    Example:
        >>> from attnreg.eager import attention_probabilities
        >>> from attnreg.records import LayerInputs
        >>> query, key = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)   # 4 query heads share 2 key heads
        >>> inputs = LayerInputs(query, key, None, scaling=0.35, causal=True)
        >>> keys, weights, received = head_arcs(inputs, top_k=2, block_size=4)
        >>> probs = attention_probabilities(query, key, None, 0.35, causal=True)     # [B, H, T, T]: the reference
        >>> torch.allclose(weights, probs.topk(2, dim=-1).values, atol=1e-6), torch.allclose(received, probs.sum(2))
        (True, True)
        >>> keys[0, 0, 0].tolist(), weights[0, 0, 0].tolist()            # the first query sees one key
        ([0, 0], [1.0, 0.0])
    """
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    batch, heads, queries, _ = inputs.query.shape
    keys = inputs.key.shape[2]
    k = min(top_k, keys)
    device = inputs.query.device
    positions = torch.zeros(batch, heads, queries, k, dtype=torch.long, device=device)
    weights = torch.zeros(batch, heads, queries, k, device=device)
    received = torch.zeros(batch, heads, keys, device=device)
    real = None if attention_mask is None else attention_mask.to(device, torch.float32)
    for block in attention_blocks(inputs, block_size):
        probs, rows = block.probs, block.rows
        seen = probs.shape[-1]
        if real is None:
            received[..., :seen] += probs.sum(2)
        else:
            received[..., :seen] += torch.einsum("bhrs,br->bhs", probs, real[:, rows])
        if k:
            values, where = probs.topk(min(k, seen), dim=-1)
            positions[:, :, rows, : values.shape[-1]] = where.masked_fill(values <= 0, 0)  # keys it cannot see
            weights[:, :, rows, : values.shape[-1]] = values
    return positions, weights, received


@dataclass
class HeadView:
    """The data of a head view and its page: `save(path)` writes one self-contained HTML file, `html()` returns it,
    and a notebook shows it inline (`_repr_html_`, in an iframe).

    `models` hold per model its name, head layout and marks, and statistics (`[layers, heads]` lists, None for
    absent heads); `documents` the tokens (and words with gold trees) of each input and, per model, its arcs as
    base64 arrays; `notes` say what was dropped to stay within the budget.

    Example:
        >>> view = HeadView(models=[], documents=[], top_k=0, notes=["nothing"])
        >>> "<script" in view.html() and "nothing" in view.html(), view.layers
        (True, 0)
    """

    models: list[dict[str, Any]]
    documents: list[dict[str, Any]]
    top_k: int
    notes: list[str] = field(default_factory=list)
    title: str = "attnreg head view"

    @property
    def layers(self) -> int:
        return self.models[0]["layers"] if self.models else 0

    @property
    def heads(self) -> int:
        return self.models[0]["heads"] if self.models else 0

    def payload(self) -> dict[str, Any]:
        """Everything the page reads, as JSON-ready values."""
        return {
            "title": self.title,
            "top_k": self.top_k,
            "statistics": list(STATISTICS),
            "notes": self.notes,
            "models": self.models,
            "documents": self.documents,
        }

    def html(self) -> str:
        """The page: one HTML document with its style, script and data inside."""
        data = json.dumps(self.payload(), separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
        return (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(self.title)}</title>\n<style>{(_ASSETS / 'head_view.css').read_text()}</style>"
            "</head>\n<body>\n"
            f'<script type="application/json" id="attnreg-data">{data}</script>\n'
            f"<script>{(_ASSETS / 'head_view.js').read_text()}</script>\n</body></html>\n"
        )

    def save(self, path: str | Path) -> Path:
        """Write the page to `path` (its folder is created); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.html(), encoding="utf-8")
        return path

    def _repr_html_(self) -> str:
        return (
            f'<iframe srcdoc="{html.escape(self.html(), quote=True)}" style="width:100%;height:900px;border:0" '
            'sandbox="allow-scripts"></iframe>'
        )


@torch.no_grad()
def head_view(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data: Sequence[Sentence] | Sequence[str],
    compare: PreTrainedModel | None = None,
    names: Sequence[str] | None = None,
    supervised: Mapping[int, Sequence[int] | None] | None = None,
    importance: Mapping[int, torch.Tensor] | torch.Tensor | None = None,
    compare_importance: Mapping[int, torch.Tensor] | torch.Tensor | None = None,
    compare_supervised: Mapping[int, Sequence[int] | None] | None = None,
    top_k: int = TOP_K,
    max_length: int | None = 512,
    budget: int = BUDGET,
    batch_size: int = 8,
    block_size: int = BLOCK_SIZE,
    title: str | None = None,
    blockwise: bool | None = None,
) -> HeadView:
    """The head view of `model` (and of `compare`, a second checkpoint of the same architecture and tokenizer) on
    `data`: `Sentence`s with gold trees or plain texts, each truncated to `max_length` tokens.

    `names` label the models (default "model", "compare"); `supervised` ({layer: heads, None for all}, as
    `attnreg.app.summary.supervised_heads` reads a run's callbacks) marks heads a prior supervised in `model`
    (`compare_supervised` in `compare`); `importance` (`compare_importance`) colours
    the grid by head importance (`attnreg.methods.pruning.head_importance`'s {layer: scores by current position},
    or `[layers, heads]` by original number). Removed and silenced heads are read from the model
    (`attnreg.heads.pruned_heads`, `silenced_heads`). `budget`: bytes the file may take; above it fewer keys per
    query are kept, then the arcs of the last documents are left out (each said on the page). Each model runs once
    over `data` (`analyze`, in batches of `batch_size`; `blockwise` as there), which gives both the statistics and
    the arcs (`HeadViewRecorder`). Runs in eval mode; modes are restored.

    Example:
        >>> from attnreg.app.task import build_tokenizer
        >>> from attnreg.tiny import tiny_model
        >>> tokenizer = build_tokenizer(["the", "keys", "rattle", "."])
        >>> before = tiny_model("llama", vocab=len(tokenizer), seed=0)   # 4 query heads share 2 key/value heads
        >>> view = head_view(before, tokenizer, ["the keys rattle .", "keys rattle"],
        ...                  compare=tiny_model("llama", vocab=len(tokenizer), seed=1), names=["seed 0", "seed 1"])
        >>> view.models[0]["groups"][0], [model["name"] for model in view.models]
        ([0, 0, 1, 1], ['seed 0', 'seed 1'])
        >>> view.documents[1]["tokens"]                              # this tokenizer adds [CLS] and [SEP]
        ['[CLS]', 'keys', 'rattle', '[SEP]']
    """
    models = [model] if compare is None else [model, compare]
    recorder = HeadViewRecorder(tokenizer, data, models, names, top_k, max_length, budget, block_size)
    analyses = [
        analyze(
            each,
            tokenizer,
            recorder.data,
            batch_size,
            max_length,
            statistics=True,
            syntax=recorder.trees,
            similarity=False,
            blockwise=blockwise,
            block_size=block_size,
            observe=recorder.observer(number),
        )
        for number, each in enumerate(models)
    ]
    return recorder.view(analyses, supervised, importance, compare_supervised, compare_importance, title)


class HeadViewRecorder:
    """A head view filled from the analysis pass itself: `observer(number)` is `analyze`'s `observe` for the
    `number`-th of `models`, and reduces the layers of the documents' rows to their arcs as the pass runs;
    `view(analyses)` builds the page with those passes' statistics. So a report and its view take one forward
    per batch (`attnreg-analyze --html`), not a second pass and a forward per document.

    The documents are the items of `data` (`Sentence`s with gold trees, or texts), tokenized as `analyze` does
    with `max_length`; the data given to `analyze` must begin with them (`recorder.data`, or the sentences they
    are the first of), else a ValueError. Statistics over more sentences than the view shows are said on the page.

    Example:
        >>> from attnreg.analysis import analyze
        >>> from attnreg.app.task import build_tokenizer, generate, vocabulary
        >>> from attnreg.tiny import tiny_model
        >>> tokenizer = build_tokenizer(vocabulary())
        >>> model = tiny_model("bert", vocab=len(tokenizer))
        >>> sentences = [example.sentence for example in generate(6, seed=0)]
        >>> recorder = HeadViewRecorder(tokenizer, sentences[:2], [model])       # the view shows the first two
        >>> analysis = analyze(model, tokenizer, sentences, observe=recorder.observer(0))   # the report's pass
        >>> view = recorder.view([analysis])
        >>> len(view.documents), view.notes
        (2, ['Statistics and parent accuracy are over the 6 sequences analyzed; the view shows the first 2.'])
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        data: Sequence[Sentence] | Sequence[str],
        models: Sequence[PreTrainedModel],
        names: Sequence[str] | None = None,
        top_k: int = TOP_K,
        max_length: int | None = 512,
        budget: int = BUDGET,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        if isinstance(data, (str, Sentence)) or not isinstance(data, Sequence) or len(data) == 0:
            raise TypeError("data must be a non-empty sequence of Sentence objects (with gold trees) or of texts")
        kinds = {type(item) for item in data}
        if kinds not in ({Sentence}, {str}):
            raise TypeError(
                f"data must hold only Sentence objects or only texts, got {sorted(k.__name__ for k in kinds)}"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer: the view needs character offsets")
        if budget < _OVERHEAD:
            raise ValueError(f"budget must be at least {_OVERHEAD} bytes, got {budget}")
        if not 1 <= len(models) <= 2:
            raise ValueError(f"a view shows one model or two (a comparison), got {len(models)}")
        self.models = list(models)
        self.names = list(names) if names is not None else ["model", "compare"][: len(models)]
        if len(self.names) != len(models):
            raise ValueError(f"names must give {len(models)} names, got {self.names!r}")
        self.shapes = [_layout(each) for each in models]
        first, *other = self.shapes
        if other and (first["layers"], first["heads"]) != (other[0]["layers"], other[0]["heads"]):
            raise ValueError(
                f"compare has {other[0]['layers']} layers x {other[0]['heads']} heads, the model "
                f"{first['layers']} x {first['heads']}: a view compares checkpoints of one architecture"
            )
        self.trees = isinstance(data[0], Sentence)
        self.documents = [_tokenize(tokenizer, item, max_length) for item in data]
        self.notes: list[str] = []
        self.plan = _plan(self.documents, first, len(models), top_k, budget, self.notes)
        self.block_size = block_size
        self.data = list(data) if self.trees else [document["batch"] for document in self.documents]
        self._arrays: list[dict[int, dict[str, np.ndarray]]] = [{} for _ in models]

    def observer(self, number: int) -> Callable[[LayerBatch], None]:
        """`analyze`'s `observe` for the `number`-th model: each layer of the documents' rows to arcs."""
        model, shape = self.models[number], self.shapes[number]
        numbers = {layer: list(head_numbers(model, layer)) for layer in range(shape["layers"])}
        arrays = self._arrays[number]
        arrays.clear()
        index_type = np.dtype("<u2") if self.plan["index"] == "u16" else np.dtype("<u4")

        def observe(batch: LayerBatch) -> None:
            rows = [row for row, item in enumerate(batch.items) if item < len(self.documents)]
            if not rows:
                return
            for row in rows:
                if batch.items[row] not in arrays:
                    document = self.documents[batch.items[row]]
                    self._check(document, batch, row, number)
                    arrays[batch.items[row]] = _empty_arrays(document, shape, self._k(batch.items[row]), index_type)
            kept = [arrays[batch.items[row]] for row in rows]
            _reduce_rows(batch, rows, kept, self.documents, numbers[batch.layer], shape["causal"], self.block_size)

        return observe

    def view(
        self,
        analyses: Sequence[Analysis],
        supervised: Mapping[int, Sequence[int] | None] | None = None,
        importance: Mapping[int, torch.Tensor] | torch.Tensor | None = None,
        compare_supervised: Mapping[int, Sequence[int] | None] | None = None,
        compare_importance: Mapping[int, torch.Tensor] | torch.Tensor | None = None,
        title: str | None = None,
    ) -> HeadView:
        """The view, from each model's `analyze` pass with `observer(number)` (in the models' order); the marks and
        importance as `head_view` takes them."""
        if len(analyses) != len(self.models):
            raise ValueError(f"give the analysis of each of the {len(self.models)} models, got {len(analyses)}")
        notes = list(self.notes)
        entries = []
        for number, (model, shape, analysis) in enumerate(zip(self.models, self.shapes, analyses, strict=True)):
            missing = [index for index in range(len(self.documents)) if index not in self._arrays[number]]
            if missing:
                raise ValueError(
                    f"the analysis of {self.names[number]} did not run over documents {missing[:5]} of the view: give "
                    "analyze the view's data (recorder.data), or data that begins with it, and observe=observer(number)"
                )
            if analysis.statistics is None:
                raise ValueError("the view needs the head statistics: analyze(..., statistics=True)")
            entry = {
                "name": self.names[number],
                **shape,
                "supervised": _spec_grid(supervised if number == 0 else compare_supervised, shape),
                "statistics": {name: _nested(analysis.statistics[name]) for name in STATISTICS},
            }
            if analysis.syntax is not None:
                entry["statistics"]["parent_accuracy"] = _nested(analysis.syntax.accuracy)
                entry["statistics"]["reverse_parent_accuracy"] = _nested(analysis.syntax.reverse_accuracy)
            scores = importance if number == 0 else compare_importance
            if scores is not None:
                entry["statistics"]["importance"] = _nested(_importance_grid(model, scores, shape))
            entries.append(entry)
        sequences = max(analysis.sequences for analysis in analyses)
        if sequences > len(self.documents):
            notes.append(
                f"Statistics and parent accuracy are over the {sequences} sequences analyzed; the view shows the "
                f"first {len(self.documents)}."
            )
        documents = []
        for index, document in enumerate(self.documents):
            shown = {key: value for key, value in document.items() if key not in ("batch", "membership", "ids")}
            shown["models"] = [_encode(arrays[index]) for arrays in self._arrays]
            documents.append(shown)
        title = title or f"attnreg head view: {', '.join(self.names)}"
        return HeadView(entries, documents, self.plan["top_k"], notes, title)

    def _k(self, index: int) -> int:
        """Keys kept per query in document `index`: none for the documents the budget leaves without arcs."""
        k = self.plan["top_k"] if index < self.plan["kept"] else 0
        return min(k, len(self.documents[index]["tokens"]))  # a short document has fewer keys than the others

    def _check(self, document: dict[str, Any], batch: LayerBatch, row: int, number: int) -> None:
        tokens = len(document["tokens"])
        ids = batch.input_ids[row].tolist()
        real = int(batch.attention_mask[row].sum())
        if real != tokens or ids[:tokens] != document["ids"]:
            raise ValueError(
                f"the analysis of {self.names[number]} tokenized document {batch.items[row]} of the view otherwise "
                f"({real} tokens, the view {tokens}): give analyze the view's tokenizer and max_length, and data that "
                "begins with the view's documents (padded on the right)"
            )


# -- planning ------------------------------------------------------------------------------------------
def _layout(model: PreTrainedModel) -> dict[str, Any]:
    """Layers, heads (original numbering), each head's key/value group, and removed/silenced heads as grids."""
    hub = attach(model)
    removed = pruned_heads(model)
    silenced = silenced_heads(model)
    width = max(len(head_numbers(model, layer)) + len(removed.get(layer, ())) for layer in range(hub.num_layers))
    groups, present = [], []
    for info in hub.layers:
        numbers = head_numbers(model, info.index)
        per_group = info.num_heads // info.num_kv_heads if info.num_kv_heads else 1
        groups.append([head // max(per_group, 1) for head in range(width)])
        present.append([head in numbers for head in range(width)])
    layers = hub.num_layers
    return {
        "layers": layers,
        "heads": width,
        "causal": bool(hub.family.causal),
        "groups": groups,
        "present": present,
        "removed": [[head in removed.get(layer, ()) for head in range(width)] for layer in range(layers)],
        "silenced": [[head in silenced.get(layer, ()) for head in range(width)] for layer in range(layers)],
    }


def _tokenize(tokenizer: PreTrainedTokenizerBase, item: Sentence | str, max_length: int | None) -> dict[str, Any]:
    text = item.text if isinstance(item, Sentence) else item
    encoding = tokenizer(
        text,
        truncation=max_length is not None,
        max_length=max_length,
        return_offsets_mapping=True,
        return_attention_mask=False,
        return_token_type_ids=False,
    )
    ids = encoding["input_ids"]
    tokens = [
        _token_text(text, tokenizer, token, span) for token, span in zip(ids, encoding["offset_mapping"], strict=True)
    ]
    batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    document: dict[str, Any] = {"title": text[:80], "tokens": tokens, "batch": batch, "membership": None, "ids": ids}
    if isinstance(item, Sentence):
        alignment = align_offsets(item, encoding["offset_mapping"])
        token_word = alignment.token_word
        membership = torch.zeros(1, len(ids), alignment.num_words)
        pieces = np.flatnonzero(token_word >= 0)
        membership[0, pieces, token_word[pieces]] = 1.0
        first = alignment.first_piece
        document.update(
            title=f"{item.sent_id}: {text[:70]}" if item.sent_id else text[:80],
            membership=membership,
            words=list(item.words),
            gold=[head - 1 for head in item.heads],  # 0-based, -1 for the root
            relations=list(item.relations),
            word_token=[int(token) for token in first],  # the first token of each word, -1 where it has none
        )
    return document


def _token_text(text: str, tokenizer: PreTrainedTokenizerBase, token: int, span: Sequence[int]) -> str:
    start, end = span
    return text[start:end] if end > start else tokenizer.convert_ids_to_tokens(token)


def _plan(
    documents: list[dict[str, Any]], shape: dict[str, Any], models: int, top_k: int, budget: int, notes: list[str]
) -> dict[str, Any]:
    """How many keys per query, and which documents keep their arcs, so that the file stays within `budget`."""
    heads = shape["layers"] * shape["heads"] * models
    lengths = [len(document["tokens"]) for document in documents]
    index_bytes = 2 if max(lengths) <= np.iinfo(np.uint16).max else 4
    words = sum(len(document.get("words", ())) for document in documents)
    text = sum(len(json.dumps(document["tokens"])) + 200 for document in documents) + 60 * words
    fixed = _OVERHEAD + text + heads * (len(STATISTICS) + 4) * 12 + 4 * heads * words // 3 * 2 + 8 * heads
    received = 4 * heads * sum(lengths) // 3 + 16 * heads * len(documents)

    def size(k: int, kept: int) -> int:
        return fixed + received + 4 * heads * sum(lengths[:kept]) * k * (index_bytes + 1) // 3

    k, kept = min(top_k, max(lengths)), len(documents)
    while k > 1 and size(k, kept) > budget:
        k -= 1
    if k < min(top_k, max(lengths)):
        notes.append(
            f"Arcs: the {k} strongest key{'s' if k > 1 else ''} per query and head are kept, not {top_k}, to keep the "
            f"file within {budget / 1e6:.0f} MB."
        )
    while kept > 0 and size(k, kept) > budget:
        kept -= 1
    if kept < len(documents):
        notes.append(
            f"Arcs of documents {kept + 1}-{len(documents)} are left out to keep the file within {budget / 1e6:.0f} MB "
            "(their statistics, received attention and predicted parents are shown)."
        )
    if fixed + received > budget:
        raise ValueError(
            f"the view of {len(documents)} documents ({sum(lengths)} tokens) needs about "
            f"{(fixed + received) / 1e6:.1f} MB without any arc, above the budget of {budget / 1e6:.1f} MB: give fewer "
            "or shorter inputs, or a larger budget"
        )
    return {"top_k": k, "kept": kept, "index": "u16" if index_bytes == 2 else "u32"}


# -- the arcs, from the analysis pass ---------------------------------------------------------------------
def _empty_arrays(document: dict[str, Any], shape: dict[str, Any], k: int, index_type: np.dtype) -> dict[str, Any]:
    layers, width, tokens = shape["layers"], shape["heads"], len(document["tokens"])
    words = len(document.get("words", ()))
    return {
        "top_k": k,
        "keys": np.zeros((layers, width, tokens, k), dtype=index_type),
        "weights": np.zeros((layers, width, tokens, k), dtype=np.uint8),
        "received": np.zeros((layers, width, tokens), dtype=np.float32),
        "parents": np.full((layers, width, words), -1, dtype=np.int16),
    }


def _reduce_rows(
    batch: LayerBatch,
    rows: list[int],
    arrays: list[dict[str, Any]],
    documents: list[dict[str, Any]],
    columns: list[int],
    causal: bool,
    block_size: int,
) -> None:
    """One layer of the batch's `rows` (documents of the view) reduced to each query's strongest keys, the attention
    each key receives and each word's predicted parent, written into the documents' `arrays`."""
    mask = batch.attention_mask[rows]
    k = max(each["top_k"] for each in arrays)
    tokens = mask.shape[1]
    membership = None
    if any(documents[batch.items[row]]["membership"] is not None for row in rows):
        words = max(documents[batch.items[row]]["membership"].shape[-1] for row in rows)
        membership = torch.zeros(len(rows), tokens, words)
        for slot, row in enumerate(rows):
            own = documents[batch.items[row]]["membership"][0]
            membership[slot, : own.shape[0], : own.shape[1]] = own
    if batch.inputs is not None:
        inputs = _select(batch.inputs, rows, batch.attention_mask.shape[0])
        positions, values, sums = head_arcs(inputs, k, attention_mask=mask, block_size=block_size)
        attention = None
        if membership is not None:
            attention = block_word_attention(inputs, membership.to(mask.device), block_size)
    else:
        probs = batch.probs[rows].float()
        values, positions = probs.topk(min(k, probs.shape[-1]), dim=-1)
        positions = positions.masked_fill(values <= 0, 0)  # keys it cannot see
        sums = torch.einsum("bhts,bt->bhs", probs, mask.to(probs.device, torch.float32))
        attention = None if membership is None else batch_word_attention(probs, membership.to(probs.device))
    parents = None
    if attention is not None:
        valid = membership.to(attention.device).sum(1) > 0
        parents = predicted_heads(attention, valid, "dependent_to_head", causal).cpu().numpy()
    positions, sums = positions.cpu().numpy(), sums.float().cpu().numpy()
    weights = (values * 255).round().clamp(0, 255).to(torch.uint8).cpu().numpy()
    for slot, each in enumerate(arrays):
        length, kept = each["received"].shape[-1], each["top_k"]
        each["keys"][batch.layer, columns] = positions[slot, :, :length, :kept]
        each["weights"][batch.layer, columns] = weights[slot, :, :length, :kept]
        each["received"][batch.layer, columns] = sums[slot, :, :length]
        if parents is not None and each["parents"].shape[-1]:
            each["parents"][batch.layer, columns] = parents[slot, :, : each["parents"].shape[-1]]


def _select(inputs: LayerInputs, rows: list[int], batch: int) -> LayerInputs:
    """`inputs` of the batch's `rows` only."""
    if len(rows) == batch:
        return inputs
    mask = inputs.attention_mask
    if mask is not None and mask.dim() >= 3 and mask.shape[0] == batch:
        mask = mask[rows]
    return LayerInputs(
        inputs.query[rows], inputs.key[rows], mask, inputs.scaling, inputs.causal, inputs.softcap, inputs.sinks
    )


def _encode(arrays: dict[str, Any]) -> dict[str, Any]:
    """A document's arrays for the page: base64, the received attention in one byte a key (the square root of its
    share of the head's maximum) with that maximum beside it."""
    received = arrays["received"]
    scale = received.max(-1, keepdims=True)
    quantized = np.round(255 * np.sqrt(received / np.maximum(scale, 1e-30))).astype(np.uint8)
    return {
        "top_k": arrays["top_k"],
        "index": "u16" if arrays["keys"].dtype == np.dtype("<u2") else "u32",
        "keys": _base64(arrays["keys"]),
        "weights": _base64(arrays["weights"]),
        "received": _base64(quantized),
        "received_scale": _base64(scale[..., 0].astype("<f4")),
        "parents": _base64(arrays["parents"].astype("<i2")),
    }


# -- small helpers ---------------------------------------------------------------------------------------
def _base64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def _nested(values: torch.Tensor) -> list[list[float | None]]:
    """A `[layers, heads]` tensor as lists, None for NaN (absent heads); float32 values as they are."""
    return [[None if math.isnan(value) else value for value in row] for row in values.float().tolist()]


def _spec_grid(spec: Mapping[int, Sequence[int] | None] | None, shape: dict[str, Any]) -> list[list[bool]]:
    grid = [[False] * shape["heads"] for _ in range(shape["layers"])]
    for layer, heads in (spec or {}).items():
        if not 0 <= int(layer) < shape["layers"]:
            raise ValueError(f"supervised names layer {layer}; the model has layers 0-{shape['layers'] - 1}")
        for head in range(shape["heads"]) if heads is None else heads:
            if not 0 <= int(head) < shape["heads"]:
                raise ValueError(f"supervised names head {head} of layer {layer}; heads are 0-{shape['heads'] - 1}")
            grid[int(layer)][int(head)] = True
    return grid


def _importance_grid(
    model: PreTrainedModel, scores: Mapping[int, torch.Tensor] | torch.Tensor, shape: dict[str, Any]
) -> torch.Tensor:
    """Importance `[layers, heads]` by original head number (NaN where a head has none)."""
    grid = torch.full((shape["layers"], shape["heads"]), torch.nan)
    if isinstance(scores, torch.Tensor):
        if tuple(scores.shape) != tuple(grid.shape):
            raise ValueError(
                f"importance has shape {tuple(scores.shape)}; expected [layers, heads] = {tuple(grid.shape)}"
            )
        return scores.detach().float().cpu()
    for layer, values in scores.items():
        if not 0 <= int(layer) < shape["layers"]:
            raise ValueError(f"importance names layer {layer}; the model has layers 0-{shape['layers'] - 1}")
        numbers = head_numbers(model, int(layer))
        if len(values) != len(numbers):
            raise ValueError(
                f"importance of layer {layer} has {len(values)} scores; the layer has {len(numbers)} heads now "
                "(head_importance gives one per current head)"
            )
        grid[int(layer), list(numbers)] = torch.as_tensor(values).detach().float().cpu()
    return grid
