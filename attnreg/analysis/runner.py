"""One streaming pass of a model over data that fills every analysis at once.

Data is either a sequence of `Sentence`s with gold trees (tokenized here with character offsets, in
batches of similar length so padding stays small; syntactic accuracy needs these) or any iterable of
tokenized batches (dicts with `input_ids` and `attention_mask`, a DataLoader's): statistics and token
similarity only. Two paths give the same figures:

- materialized (short inputs): the attention of all layers is captured for one batch at a time, reduced to
  counts, and dropped: memory is about layers x batch x heads x tokens^2 floats, whatever the data size;
- blockwise (long inputs, `blockwise=True`, and by default above `BLOCKWISE_LENGTH` tokens): every layer
  runs on SDPA and is reduced from its queries and keys, a block of query rows at a time, as soon as it has
  run (`attnreg.analysis.blocks`): nothing of size tokens^2 is kept, and memory stays near the forward's own.

Example:
    >>> from attnreg.app.task import build_tokenizer, generate, vocabulary
    >>> from attnreg.tiny import tiny_model
    >>> tokenizer = build_tokenizer(vocabulary())
    >>> model = tiny_model("bert", vocab=len(tokenizer))              # a pretrained model in practice
    >>> sentences = [example.sentence for example in generate(8, seed=0)]   # or read_conllu("en_ewt-ud-dev.conllu")
    >>> analysis = analyze(model, tokenizer, sentences, batch_size=4)
    >>> analysis.statistics["entropy"].shape      # [layers, heads]
    torch.Size([2, 4])
    >>> analysis.syntax.relation_table(min_words=20)[1]
    {'relation': 'det', 'words': 29, 'dependent_to_head_head': '0-0', 'dependent_to_head_accuracy': 20.7,
     'head_to_dependent_head': '0-3', 'head_to_dependent_accuracy': 13.8, 'baseline_offset': 1,
     'baseline_accuracy': 100.0}
    >>> analysis.roles().counts()["broad"]        # a random model's heads attend everywhere
    8
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.pytorch_utils import Conv1D

from attnreg.analysis.blocks import BLOCK_SIZE, layer_by_layer, reduce_layer
from attnreg.analysis.dependencies import ParentAccuracy, SyntaxTargets
from attnreg.analysis.heads import HeadRoles, HeadStatistics, RoleThresholds, TokenKinds, head_output_norms, head_roles
from attnreg.analysis.representations import TokenSimilarity
from attnreg.heads import head_numbers, pruned_heads
from attnreg.hub import AttentionHub, attach, detach, is_attached
from attnreg.records import LayerInputs
from attnreg.syntax.align import align_offsets
from attnreg.syntax.trees import Sentence
from attnreg.syntax.vocabulary import check_tokenizer

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")

BLOCKWISE_LENGTH = 512
"""`analyze(..., blockwise=None)` reduces batches longer than this many tokens from queries and keys in blocks,
shorter ones from the materialized attention (small there: sentences; at 512 tokens SmolLM2-135M's attention
already takes the process to 1.5x the forward's peak memory, `benchmarks/results/decoder_analysis/`)."""

PROGRESS_SECONDS = 10.0
"""`analyze(..., progress=True)` off a terminal writes a line to stderr after the first batch, then at most one
this many seconds apart, and one at the end."""


@dataclass
class LayerBatch:
    """One layer of one batch, as `analyze(..., observe=...)` hands it on while the pass runs (to reduce it to
    more than the analysis keeps, as the head view's arcs, without a forward of its own).

    `items` gives each row's place in the data (a sentence's index; for tokenized batches, rows counted from the
    first batch's first row); `input_ids` and `attention_mask` `[B, T]` are the batch (padded on the right);
    `heads` the layer's head numbers (original numbering, as in a pruned model). Exactly one of `inputs` (the
    blockwise path: what the layer's attention function received, `LayerInputs`) and `probs` (the materialized
    path: the attention `[B, H, T, S]`) is set.

    Example:
        >>> from attnreg.app.task import build_tokenizer, generate, vocabulary
        >>> from attnreg.tiny import tiny_model
        >>> tokenizer = build_tokenizer(vocabulary())
        >>> sentences = [example.sentence for example in generate(3, seed=0)]
        >>> seen = []
        >>> observe = lambda batch: seen.append((batch.layer, batch.items, batch.probs is not None))
        >>> _ = analyze(tiny_model("bert", vocab=len(tokenizer)), tokenizer, sentences, batch_size=2, observe=observe)
        >>> seen                                     # batches of similar length: sentences 1 and 2, then 0
        [(0, [1, 2], True), (1, [1, 2], True), (0, [0], True), (1, [0], True)]
    """

    layer: int
    items: list[int]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    heads: Sequence[int]
    inputs: LayerInputs | None = None
    probs: torch.Tensor | None = None


def _leaves_as_found(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function(model, ...)` run inside `attached(model)`: the model leaves it attached only if it came attached."""

    @functools.wraps(function)
    def run(model: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
        with attached(model):
            return function(model, *args, **kwargs)

    return run


@dataclass
class Analysis:
    """What `analyze` found: per-head statistics, syntactic accuracy (gold trees only), token similarity.

    `sequences` and `tokens` count what was seen (real tokens); `seconds` is the wall time of the pass.

    Example:
        >>> from attnreg.app.task import build_tokenizer, generate, vocabulary
        >>> from attnreg.tiny import tiny_model
        >>> tokenizer = build_tokenizer(vocabulary())
        >>> model = tiny_model("bert", vocab=len(tokenizer))              # a pretrained model in practice
        >>> sentences = [example.sentence for example in generate(8, seed=0)]   # or read_conllu("en_ewt-ud-dev.conllu")
        >>> analysis = analyze(model, tokenizer, sentences, similarity=False)
        >>> analysis.sequences, analysis.tokens, analysis.similarity
        (8, 115, None)
        >>> sorted(analysis.to_dict())
        ['roles', 'seconds', 'sequences', 'statistics', 'syntax', 'tokens']
    """

    statistics: HeadStatistics | None
    syntax: ParentAccuracy | None
    similarity: TokenSimilarity | None
    sequences: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def roles(self, thresholds: RoleThresholds | None = None) -> HeadRoles:
        """Head roles from the statistics (and the syntax, when there were gold trees).

        Example:
            >>> Analysis(statistics=None, syntax=None, similarity=None).roles()
            Traceback (most recent call last):
            ...
            ValueError: roles need the head statistics: run analyze(..., statistics=True)
        """
        if self.statistics is None:
            raise ValueError("roles need the head statistics: run analyze(..., statistics=True)")
        return head_roles(self.statistics, self.syntax, thresholds)

    def to_dict(self, thresholds: RoleThresholds | None = None, min_relation_words: int = 1) -> dict[str, Any]:
        """Everything as JSON-ready values (percentages rounded to 0.1 in the syntax tables)."""
        result: dict[str, Any] = {"sequences": self.sequences, "tokens": self.tokens, "seconds": round(self.seconds, 2)}
        if self.statistics is not None:
            result["statistics"] = self.statistics.to_dict()
            roles = self.roles(thresholds)
            result["roles"] = {"counts": roles.counts(), "heads": roles.table()}
        if self.syntax is not None:
            result["syntax"] = {
                **self.syntax.summary(),
                "relations": self.syntax.relation_table(min_words=min_relation_words),
            }
        if self.similarity is not None:
            result["token_similarity"] = [round(float(v), 4) for v in self.similarity.mean]
        return result


@torch.no_grad()
@_leaves_as_found
def analyze(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data: Sequence[Sentence] | Iterable[Mapping[str, Any]],
    batch_size: int = 32,
    max_length: int | None = 128,
    max_offset: int = 5,
    statistics: bool = True,
    syntax: bool = True,
    similarity: bool = True,
    blockwise: bool | None = None,
    block_size: int = BLOCK_SIZE,
    observe: Callable[[LayerBatch], None] | None = None,
    progress: bool | None = None,
) -> Analysis:
    """Run `model` once over `data` and collect the analyses asked for.

    `data`: `Sentence`s with gold trees (`read_conllu`, `parse_texts`), batched here by `batch_size`
    and truncated to `max_length` tokens; or tokenized batches (then `syntax` is skipped). `tokenizer`
    must be a fast tokenizer (character offsets) that can tokenize the sentences (`check_tokenizer`, else a
    `ValueError`); it also tells the special and punctuation tokens.
    The model is attached to the hub for the pass and run in eval mode (without a key/value cache); it leaves as it
    came, an error included: its mode, and attached or not (`attached`: its attention implementation too).
    Pruned models work: heads keep their original numbers and removed ones read NaN.

    `blockwise`: True reduces every layer from its queries and keys, `block_size` query rows at a time,
    as soon as it has run (no `[T, T]` map is kept: for long documents on decoders); False captures the
    attention of all layers of a batch (`layers x B x H x T^2` floats, faster on short inputs); None (the
    default) takes the blockwise path for batches longer than `BLOCKWISE_LENGTH` tokens. Both give the same
    figures. `similarity` keeps the hidden states of every layer of a batch on either path: turn it off for
    long documents. `observe` is called with each layer of each batch (`LayerBatch`) as the pass runs.

    `progress`: None (the default) shows a progress bar (sequences and tokens per second) on a terminal and
    nothing elsewhere; True also writes a line to stderr now and then (`PROGRESS_SECONDS`) where stderr is no
    terminal (a log file, a batch job); False shows nothing.

    Example:
        >>> import torch
        >>> from attnreg.app.task import build_tokenizer
        >>> from attnreg.tiny import tiny_model
        >>> tokenizer = build_tokenizer(["the", "keys", "rattle", "."])
        >>> model = tiny_model("gpt2", vocab=len(tokenizer))
        >>> batches = [tokenizer(["the keys rattle .", "the keys"], padding=True, return_tensors="pt")]  # a DataLoader
        >>> analysis = analyze(model, tokenizer, batches)      # tokenized batches: no syntax
        >>> analysis.syntax, analysis.sequences, analysis.statistics["to_start"].shape
        (None, 2, torch.Size([2, 4]))
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if blockwise not in (None, True, False):
        raise TypeError(f"blockwise must be True, False or None (by length), got {blockwise!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    started = time.perf_counter()
    hub = attach(model)
    layers = hub.num_layers
    heads = {layer: head_numbers(model, layer) for layer in range(layers)}
    removed = pruned_heads(model)
    width = max(len(heads[layer]) + len(removed.get(layer, ())) for layer in range(layers))
    sentences = _as_sentences(data)
    if sentences is not None:
        check_tokenizer(tokenizer, [sentence.text for sentence in sentences])  # a wrong one gives a plausible report
    kinds = TokenKinds.from_tokenizer(tokenizer) if statistics else None
    result = Analysis(
        statistics=HeadStatistics.empty(layers, width) if statistics else None,
        syntax=ParentAccuracy.empty(layers, width, max_offset, hub.family.causal)
        if syntax and sentences is not None
        else None,
        similarity=TokenSimilarity.empty(layers) if similarity else None,
    )
    batches = (
        _sentence_batches(tokenizer, sentences, batch_size, max_length)
        if sentences is not None
        else _loader_batches(data)
    )
    device = next(model.parameters()).device
    options = {"output_hidden_states": similarity}
    if getattr(model.config, "use_cache", None) is not None:
        options["use_cache"] = False  # a decoder's cache would keep every layer's keys and values
    was_training = model.training
    model.eval()
    total = len(sentences) if sentences is not None else None
    bar = tqdm(total=total, desc="analyze", unit="seq", disable=None if progress is not False else True, leave=False)
    lines = _ProgressLines(total, started) if progress and bar.disable else None  # quiet unless stderr is a terminal
    try:
        with _output_norms(hub, enabled=statistics) as norms:
            for inputs, targets, items in batches:
                inputs = {key: value.to(device) for key, value in inputs.items()}
                mask = inputs["attention_mask"]
                token_kinds = kinds.masks(inputs["input_ids"], mask) if statistics else None
                in_blocks = blockwise if blockwise is not None else inputs["input_ids"].shape[-1] > BLOCKWISE_LENGTH
                if in_blocks:
                    observer = None if observe is None else _Observer(observe, items, inputs, heads)
                    output = _blockwise_pass(
                        model, hub, inputs, options, result, token_kinds, targets, heads, block_size, observer
                    )
                else:
                    with hub.capture() as record:
                        output = model(**inputs, **options)
                    probs = {layer: record[layer] for layer in record}
                    if result.statistics is not None:
                        if sinks := [layer for layer in record if record.has_sink(layer)]:
                            raise NotImplementedError(
                                f"layers {sinks} have sink logits in their softmax (gpt-oss): the head statistics do "
                                "not count the sink's share yet, so they would be wrong (parent accuracy alone "
                                "works: statistics=False); the training losses and the monitor's entropy count it"
                            )
                        layer_masks = {layer: record.attention_mask(layer) for layer in record}
                        result.statistics.update(probs, token_kinds, mask, hub.family.causal, heads, layer_masks)
                    if result.syntax is not None:
                        result.syntax.update(probs, targets, heads)
                    if observe is not None:
                        ids = inputs["input_ids"]
                        for layer, layer_probs in probs.items():
                            observe(LayerBatch(layer, items, ids, mask, heads[layer], probs=layer_probs))
                    del probs, record
                if result.statistics is not None:
                    for layer, values in norms.items():
                        result.statistics.update_output_norm(layer, values, mask, heads[layer])
                if result.similarity is not None:
                    result.similarity.update(output.hidden_states, mask)
                result.sequences += mask.shape[0]
                result.tokens += int(mask.sum())
                del output
                norms.clear()
                bar.update(mask.shape[0])
                if not bar.disable:
                    rate = result.tokens / max(bar.format_dict["elapsed"], 1e-9)
                    bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
                if lines is not None:
                    lines.batch(result.sequences, result.tokens)
    finally:
        bar.close()
        model.train(was_training)
    result.seconds = time.perf_counter() - started
    if lines is not None:
        lines.done(result.sequences, result.tokens)
    return result


class _Observer:
    """`observe` as the blockwise pass calls it: `(layer, inputs)` made a `LayerBatch` of the batch."""

    def __init__(
        self,
        observe: Callable[[LayerBatch], None],
        items: list[int],
        inputs: Mapping[str, torch.Tensor],
        heads: Mapping[int, Sequence[int]],
    ) -> None:
        self.observe, self.items, self.inputs, self.heads = observe, items, inputs, heads

    def __call__(self, layer: int, layer_inputs: LayerInputs) -> None:
        ids, mask = self.inputs["input_ids"], self.inputs["attention_mask"]
        self.observe(LayerBatch(layer, self.items, ids, mask, self.heads[layer], inputs=layer_inputs))


class _ProgressLines:
    """`analyze(..., progress=True)` off a terminal: a line to stderr after the first batch, then at most one every
    `PROGRESS_SECONDS`, and one at the end."""

    def __init__(self, total: int | None, started: float) -> None:
        self.total, self.started, self.last = total, started, None

    def batch(self, sequences: int, tokens: int) -> None:
        now = time.perf_counter()
        if self.last is None or now - self.last >= PROGRESS_SECONDS:
            self.last = now
            self._line(sequences, tokens, now)

    def done(self, sequences: int, tokens: int) -> None:
        self._line(sequences, tokens, time.perf_counter(), done=True)

    def _line(self, sequences: int, tokens: int, now: float, done: bool = False) -> None:
        seconds = now - self.started
        of = f"/{self.total}" if self.total is not None else ""
        print(
            f"analyze: {'done, ' if done else ''}{sequences}{of} sequences, {tokens} tokens in {seconds:.1f} s "
            f"({tokens / max(seconds, 1e-9):.0f} tok/s)",
            file=sys.stderr,
            flush=True,
        )


@contextmanager
def attached(model: PreTrainedModel) -> Iterator[AttentionHub]:
    """The model's hub for the block: `attach`ed on entry if it was not, and detached again on exit, an error
    included, so the model leaves as it came (its attention implementation too); a model the caller attached stays
    attached, with its hub.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> from attnreg.hub import is_attached
        >>> model = tiny_model("gpt2")
        >>> with attached(model) as hub:
        ...     model.config._attn_implementation
        'attnreg'
        >>> is_attached(model), model.config._attn_implementation
        (False, 'sdpa')
        >>> hub = attach(model)
        >>> with attached(model) as same:
        ...     same is hub
        True
        >>> is_attached(model)
        True
    """
    before = is_attached(model)
    hub = attach(model)
    try:
        yield hub
    finally:
        if not before and is_attached(model):
            detach(model)


def _blockwise_pass(
    model: PreTrainedModel,
    hub: AttentionHub,
    inputs: dict[str, torch.Tensor],
    options: dict[str, Any],
    result: Analysis,
    token_kinds: torch.Tensor | None,
    targets: SyntaxTargets | None,
    heads: Mapping[int, Sequence[int]],
    block_size: int,
    observe: Callable[[int, LayerInputs], None] | None = None,
) -> Any:
    """One forward whose layers are reduced from their queries and keys as soon as each has run (and handed to
    `observe`)."""
    mask = inputs["attention_mask"]
    syntax = result.syntax is not None and result.syntax.count(targets)
    membership = targets.membership if syntax else None

    def reduce(layer: int, layer_inputs: LayerInputs) -> None:
        sums, counts, words = reduce_layer(layer_inputs, token_kinds, mask, membership, block_size)
        if sums is not None:
            result.statistics.add(layer, sums, counts, heads)
        if words is not None:
            result.syntax.add_layer(layer, words, targets, heads)
        if observe is not None:
            observe(layer, layer_inputs)

    with layer_by_layer(hub, reduce):
        return model(**inputs, **options)


def head_statistics(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data: Sequence[Sentence] | Iterable[Mapping[str, Any]],
    batch_size: int = 32,
    max_length: int | None = 128,
    blockwise: bool | None = None,
    block_size: int = BLOCK_SIZE,
) -> HeadStatistics:
    """Per-head statistics of `model` over `data` (see `analyze`, and its `blockwise` for long documents).

    Example:
        >>> from attnreg.app.task import build_tokenizer
        >>> from attnreg.tiny import tiny_model
        >>> tokenizer = build_tokenizer(["the", "keys", "rattle", "."])
        >>> loader = [tokenizer(["the keys rattle .", "the keys"], padding=True, return_tensors="pt")]
        >>> stats = head_statistics(tiny_model("bert", vocab=len(tokenizer)), tokenizer, loader)
        >>> stats["to_end"].shape          # [layers, heads]: attention on [SEP]
        torch.Size([2, 4])
        >>> decoder = tiny_model("llama", vocab=len(tokenizer))
        >>> long = [{"input_ids": torch.randint(4, len(tokenizer), (1, 600))}]   # a long document, say
        >>> in_blocks = head_statistics(decoder, tokenizer, long, blockwise=True)   # never holds [T, T]
        >>> materialized = head_statistics(decoder, tokenizer, long, blockwise=False)
        >>> torch.allclose(in_blocks["to_first"], materialized["to_first"])     # the attention sink's share
        True
    """
    return analyze(
        model,
        tokenizer,
        data,
        batch_size,
        max_length,
        statistics=True,
        syntax=False,
        similarity=False,
        blockwise=blockwise,
        block_size=block_size,
    ).statistics


def parent_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[Sentence],
    batch_size: int = 32,
    max_length: int | None = 128,
    max_offset: int = 5,
    blockwise: bool | None = None,
    block_size: int = BLOCK_SIZE,
) -> ParentAccuracy:
    """Parent accuracy of every head of `model` over `sentences` with gold trees, both directions.

    Words cut by truncation, or without a token of their own, and words whose head is such a word,
    are not scored. The model is attached to the hub and run in eval mode; it leaves as it came (see `analyze`).
    `blockwise`, `block_size`: as in `analyze` (the blockwise path holds one layer's word attention
    `[B, H, W, W]` at a time, never token maps).

    Example:
        >>> from attnreg.app.task import build_tokenizer, generate, vocabulary
        >>> from attnreg.tiny import tiny_model
        >>> tokenizer = build_tokenizer(vocabulary())
        >>> model = tiny_model("bert", vocab=len(tokenizer))              # a pretrained model in practice
        >>> sentences = [example.sentence for example in generate(8, seed=0)]   # or read_conllu("en_ewt-ud-dev.conllu")
        >>> result = parent_accuracy(model, tokenizer, sentences)
        >>> result.accuracy.shape, result.words
        (torch.Size([2, 4]), 91)
        >>> result.baseline(1, "det")                 # determiners precede their noun
        1.0
    """
    if _as_sentences(sentences) is None:
        raise TypeError("parent_accuracy needs Sentence objects with gold trees (read_conllu, parse_texts)")
    return analyze(
        model,
        tokenizer,
        sentences,
        batch_size,
        max_length,
        max_offset,
        statistics=False,
        similarity=False,
        blockwise=blockwise,
        block_size=block_size,
    ).syntax


def _as_sentences(data: Any) -> Sequence[Sentence] | None:
    if isinstance(data, Sequence) and len(data) > 0 and isinstance(data[0], Sentence):
        return data
    return None


def _sentence_batches(
    tokenizer: PreTrainedTokenizerBase, sentences: Sequence[Sentence], batch_size: int, max_length: int | None
) -> Iterator[tuple[dict[str, torch.Tensor], SyntaxTargets, list[int]]]:
    """Batches of sentences of similar token length, padded on the right, with their aligned gold trees and the
    sentences' indices."""
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            f"{type(tokenizer).__name__} is not a fast tokenizer: the analysis needs character offsets "
            "(load it with AutoTokenizer.from_pretrained(..., use_fast=True))"
        )
    encoding = tokenizer(
        [sentence.text for sentence in sentences],
        truncation=max_length is not None,
        max_length=max_length,
        return_offsets_mapping=True,
        return_attention_mask=False,
        return_token_type_ids=False,
    )
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    order = sorted(range(len(sentences)), key=lambda index: len(ids[index]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        tokens = max(len(ids[index]) for index in chunk)
        input_ids = torch.full((len(chunk), tokens), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(chunk), tokens), dtype=torch.long)
        for row, index in enumerate(chunk):
            input_ids[row, : len(ids[index])] = torch.tensor(ids[index])
            attention_mask[row, : len(ids[index])] = 1
        alignments = [align_offsets(sentences[index], offsets[index]) for index in chunk]
        targets = SyntaxTargets.build([sentences[index] for index in chunk], alignments, tokens)
        yield {"input_ids": input_ids, "attention_mask": attention_mask}, targets, chunk


def _loader_batches(data: Iterable[Mapping[str, Any]]) -> Iterator[tuple[dict[str, torch.Tensor], None, list[int]]]:
    rows = 0
    for number, batch in enumerate(data):
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            kind = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise TypeError(
                f"batch {number}: expected a Sentence sequence or dicts with 'input_ids' (and 'attention_mask'), "
                f"got {kind}"
            )
        inputs = {key: batch[key] for key in MODEL_INPUTS if key in batch}
        inputs.setdefault("attention_mask", torch.ones_like(inputs["input_ids"]))
        size = inputs["input_ids"].shape[0]
        yield inputs, None, list(range(rows, rows + size))
        rows += size


@contextmanager
def _output_norms(hub: AttentionHub, enabled: bool) -> Iterator[dict[int, torch.Tensor]]:
    """Forward hooks on every output projection that record each head's output norm `[B, T, H]` per layer.

    A forward hook sees the projection's input after gate pre-hooks, so gated heads read what they write.
    """
    norms: dict[int, torch.Tensor] = {}
    handles = []
    if enabled:
        for info in hub.layers:
            if info.num_heads == 0:
                continue
            projection = hub.family.out_projection(hub.model, info.index)
            weight = projection.weight.detach().float()
            weight = weight.T if isinstance(projection, Conv1D) else weight  # [out, heads * dim]
            per_head = weight.reshape(weight.shape[0], info.num_heads, info.head_dim)
            gram = torch.einsum("ohd,ohe->hde", per_head, per_head)
            handles.append(projection.register_forward_hook(_NormHook(norms, info.index, gram)))
    try:
        yield norms
    finally:
        for handle in handles:
            handle.remove()


class _NormHook:
    def __init__(self, norms: dict[int, torch.Tensor], layer: int, gram: torch.Tensor) -> None:
        self.norms, self.layer, self.gram = norms, layer, gram

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.norms[self.layer] = head_output_norms(args[0], self.gram.to(args[0].device))
