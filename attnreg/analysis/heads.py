"""Per-head attention statistics, and head roles read from them.

Statistics are means over the real query rows of every sequence seen (Clark et al. 2019, Voita et al.
2019): normalized entropy, attention mass on the start special token ([CLS]/BOS), on the sequence's first
token whatever it is (the attention sink, Xiao et al. 2024), on the end special token ([SEP]/EOS), on
punctuation, on the query itself, on the previous and the next token, the mean attention distance in
tokens, how often the row's argmax is the previous or the next token, and the mean norm of the head's
output (its context vector through its slice of the output projection).

Roles (`head_roles`) are read from those statistics and, given gold trees, from parent accuracy; a head
may have several labels and gets one primary role. Thresholds live in `RoleThresholds`.

Example:
    >>> from attnreg.app.task import build_tokenizer
    >>> kinds = TokenKinds.from_tokenizer(build_tokenizer(["a", "b"]))
    >>> input_ids = torch.tensor([[2, 5, 6, 3]])                    # [CLS] a b [SEP]
    >>> previous = torch.diag(torch.ones(3), -1); previous[0, 0] = 1.0   # attends to the previous token
    >>> probs = torch.stack([previous, torch.full((4, 4), 0.25)])[None]   # [B, H, T, T]: 2 heads
    >>> stats = HeadStatistics.empty(layers=1, heads=2)
    >>> stats.update({0: probs}, kinds.masks(input_ids), None, causal=False)
    >>> stats["to_previous"]            # [layers, heads]
    tensor([[1.0000, 0.2500]])
    >>> head_roles(stats).grid()        # the uniform head puts half its attention on [CLS] and [SEP]
    [['positional', 'no-op']]
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from attnreg.losses import admissible_keys

if TYPE_CHECKING:
    from attnreg.analysis.dependencies import ParentAccuracy

ATTENTION_STATISTICS = (
    "entropy",
    "to_start",
    "to_first",
    "to_end",
    "to_punctuation",
    "to_self",
    "to_previous",
    "to_next",
    "distance",
    "argmax_previous",
    "argmax_next",
)
"""Statistics computed from attention maps (`attention_statistics`), in their order along the last axis."""

STATISTICS = (*ATTENTION_STATISTICS, "output_norm")
"""Every statistic `HeadStatistics` holds."""

KINDS = ("start", "end", "punctuation")
"""Token kinds, in the order of the last axis of `TokenKinds.masks`."""

ROLES = ("dormant", "positional", "syntactic", "no-op", "broad", "other", "pruned")
"""Primary roles, in priority order: a head with several labels gets the first that applies."""


# ---------------------------------------------------------------------------------------------
# Token kinds
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenKinds:
    """Which token ids are start specials, end specials and punctuation, for one tokenizer.

    `start`: ids the tokenizer puts before a text ([CLS], <s>, BOS) and the CLS id; `end`: ids it puts
    after one ([SEP], </s>) and the SEP and EOS ids. A tokenizer that adds nothing in front (GPT-2) has
    `first_is_start`: the first real token of each sequence stands in for BOS (the attention sink).
    `punctuation[id]` is True for tokens made only of Unicode punctuation once the subword markers
    ("##", "Ġ", "▁") are stripped.

    Example:
        >>> from attnreg.app.task import build_tokenizer
        >>> tokenizer = build_tokenizer(["the", "keys", "."])
        >>> kinds = TokenKinds.from_tokenizer(tokenizer)
        >>> kinds.start, kinds.end, kinds.first_is_start
        (frozenset({2}), frozenset({3}), False)
        >>> batch = tokenizer(["the keys ."], return_tensors="pt")       # [CLS] the keys . [SEP]
        >>> kinds.masks(batch["input_ids"], batch["attention_mask"]).int()   # [B, T, 3]: start, end, punctuation
        tensor([[[1, 0, 0],
                 [0, 0, 0],
                 [0, 0, 0],
                 [0, 0, 1],
                 [0, 1, 0]]], dtype=torch.int32)
    """

    start: frozenset[int]
    end: frozenset[int]
    punctuation: torch.Tensor
    first_is_start: bool = False

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> TokenKinds:
        plain = tokenizer("a", add_special_tokens=False)["input_ids"]
        full = tokenizer("a")["input_ids"]
        prefix, suffix = _around(full, plain)
        start = set(prefix) | _ids(tokenizer.cls_token_id)
        end = (set(suffix) | _ids(tokenizer.sep_token_id, tokenizer.eos_token_id)) - start
        special = set(tokenizer.all_special_ids)
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        punctuation = torch.tensor(
            [index not in special and _is_punctuation(token) for index, token in enumerate(tokens)], dtype=torch.bool
        )
        return cls(frozenset(start), frozenset(end), punctuation, first_is_start=not prefix)

    def masks(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`[B, T, 3]` booleans: (start, end, punctuation) for every real token of a batch."""
        real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        start = torch.isin(input_ids, _tensor(self.start, input_ids))
        if self.first_is_start:
            start |= real & (real.long().cumsum(-1) == 1)
        end = torch.isin(input_ids, _tensor(self.end, input_ids)) & ~start
        table = self.punctuation.to(input_ids.device)
        inside = input_ids < len(table)
        punctuation = inside & table[input_ids.clamp(0, len(table) - 1)]
        return torch.stack([start, end, punctuation], -1) & real[..., None]


def _ids(*ids: int | None) -> set[int]:
    return {int(i) for i in ids if i is not None}


def _tensor(ids: frozenset[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(sorted(ids), dtype=like.dtype, device=like.device)


def _around(full: list[int], plain: list[int]) -> tuple[list[int], list[int]]:
    """The ids a tokenizer adds before and after a text: `full` is `plain` with specials around it."""
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return [], []


def _is_punctuation(token: str) -> bool:
    text = token.removeprefix("##").lstrip("Ġ▁")
    return bool(text) and all(unicodedata.category(char).startswith("P") for char in text)


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------
def attention_statistics(
    probs: torch.Tensor,
    kinds: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    causal: bool = False,
    layer_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head sums of every statistic in `ATTENTION_STATISTICS` over one layer's batch, and row counts.

    `probs` is `[B, H, T, T]` (queries and keys are the same tokens), `kinds` the `[B, T, 3]` masks of
    `TokenKinds.masks`. Returns `(sums [H, K], rows [K])`: the mean of statistic k is sums[:, k] / rows[k].
    Rows are real query tokens; entropy rows need two admissible keys (it is divided by log of their
    number: those the layer's own mask `layer_mask` admits, sliding windows included, where given, else the
    real tokens of `attention_mask`, see `attnreg.losses.admissible_keys`); previous/next rows need a real
    neighbour there. The distance is in tokens; `to_first` is the mass on each sequence's first real token.

    Example:
        >>> previous = torch.diag(torch.ones(3), -1); previous[0, 0] = 1.0   # attends to the previous token
        >>> probs = torch.stack([previous, torch.full((4, 4), 0.25)])[None]   # [B, H, T, T]: 2 heads
        >>> kinds = torch.zeros(1, 4, 3, dtype=torch.bool)                    # no special tokens
        >>> sums, rows = attention_statistics(probs, kinds)
        >>> (sums / rows)[:, ATTENTION_STATISTICS.index("to_previous")]   # [H]
        tensor([1.0000, 0.2500], dtype=torch.float64)
        >>> (sums / rows)[:, ATTENTION_STATISTICS.index("entropy")]
        tensor([0., 1.], dtype=torch.float64)
        >>> (sums / rows)[:, ATTENTION_STATISTICS.index("to_first")]      # the sink: row 0, and a quarter of each
        tensor([0.5000, 0.2500], dtype=torch.float64)
    """
    batch, heads, queries, keys = probs.shape
    if queries != keys:
        raise ValueError(f"attention_statistics needs as many queries as keys, got probs of shape {tuple(probs.shape)}")
    probs = probs.float()
    real = torch.ones(batch, keys, dtype=torch.bool, device=probs.device)
    if attention_mask is not None:
        real = attention_mask.to(probs.device).bool()
    if layer_mask is not None and layer_mask.dim() == 4 and layer_mask.shape[1] > 1:
        raise NotImplementedError(
            f"layer_mask has one mask per head (shape {tuple(layer_mask.shape)}); the head statistics take one "
            "mask for all heads"
        )
    _, admissible = admissible_keys(real, probs.shape, causal, layer_mask)
    admissible = admissible[:, 0].to(probs.device)  # [B, T]
    entropy_rows = real & (admissible > 1)
    entropy = torch.special.entr(probs).sum(-1) / admissible.clamp_min(2).log()[:, None]
    mass = probs @ kinds.to(probs.device, probs.dtype)[:, None]  # [B, H, T, 3]
    position = torch.arange(queries, device=probs.device)
    distance = torch.einsum("bhqk,qk->bhq", probs, (position[:, None] - position[None, :]).abs().float())
    argmax = probs.argmax(-1)
    previous_rows = torch.zeros_like(real)
    previous_rows[:, 1:] = real[:, 1:] & real[:, :-1]
    next_rows = torch.zeros_like(real)
    next_rows[:, :-1] = real[:, :-1] & real[:, 1:]
    to_previous = torch.zeros_like(entropy)
    to_previous[..., 1:] = probs.diagonal(-1, -2, -1)
    to_next = torch.zeros_like(entropy)
    to_next[..., :-1] = probs.diagonal(1, -2, -1)
    values = {
        "entropy": (entropy, entropy_rows),
        "to_start": (mass[..., 0], real),
        "to_first": (_first_token_mass(probs, real), real),
        "to_end": (mass[..., 1], real),
        "to_punctuation": (mass[..., 2], real),
        "to_self": (probs.diagonal(0, -2, -1), real),
        "to_previous": (to_previous, previous_rows),
        "to_next": (to_next, next_rows),
        "distance": (distance, real),
        "argmax_previous": ((argmax == position - 1).float(), previous_rows),
        "argmax_next": ((argmax == position + 1).float(), next_rows),
    }
    ordered = [values[name] for name in ATTENTION_STATISTICS]
    rows = torch.stack([rows for _, rows in ordered]).float()  # [K, B, T]
    sums = torch.einsum("kbht,kbt->hk", torch.stack([value.float() for value, _ in ordered]), rows)
    return sums.double().cpu(), rows.sum((1, 2)).double().cpu()


def first_token_attention(probs: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mean share of attention each head puts on its sequence's first real token (the attention sink,
    Xiao et al. 2024), over the real query rows: `[H]` from `probs` `[B, H, T, S]` and the 2D padding mask
    `attention_mask` `[B, S]` (None: every token is real). It is the `to_first` head statistic of one batch.

    Example:
        >>> probs = torch.tensor([[[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]]])   # one causal head
        >>> first_token_attention(probs)                                        # (1 + 0.5 + 0.2) / 3
        tensor([0.5667])
        >>> left_padded = torch.tensor([[0, 1, 1]])                             # the first real token is 1
        >>> first_token_attention(probs, left_padded)                           # (0.5 + 0.3) / 2
        tensor([0.4000])
    """
    batch, _, queries, keys = probs.shape
    real = torch.ones(batch, keys, dtype=torch.bool, device=probs.device)
    if attention_mask is not None:
        real = attention_mask.to(probs.device).bool()
    rows = real[:, -queries:].float()
    mass = _first_token_mass(probs.float(), real)
    return (mass * rows[:, None]).sum((0, 2)) / rows.sum().clamp_min(1)


def _first_token_mass(probs: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """`[B, H, T]`: each row's probability on its sequence's first real key (`real` `[B, S]`)."""
    first = real.long().argmax(-1)  # the first True; 0 for a sequence without real tokens (no rows either)
    index = first[:, None, None, None].expand(-1, probs.shape[1], probs.shape[2], 1)
    return probs.gather(-1, index).squeeze(-1)


def head_output_norms(context: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """Norm of each head's contribution to the attention output, `[B, T, H]`.

    `context` is the input of the output projection `[B, T, H * d]` (the heads' context vectors side by
    side); `gram[h] = W_h^T W_h` `[H, d, d]` for the projection's columns `W_h` of head h, so the result
    is |W_h c_h| without building the `[B, T, H, out]` products.

    Example:
        >>> context = torch.ones(1, 1, 4)                        # [B, T, 2 heads x 2 dims]
        >>> gram = torch.stack([torch.eye(2), 4 * torch.eye(2)])  # head 1's columns are twice as long
        >>> head_output_norms(context, gram)
        tensor([[[1.4142, 2.8284]]])
    """
    heads, dim, _ = gram.shape
    per_head = context.float().reshape(*context.shape[:-1], heads, dim)
    squared = torch.einsum("bthd,hde,bthe->bth", per_head, gram.float(), per_head)
    return squared.clamp_min(0).sqrt()


@dataclass(eq=False)
class HeadStatistics(Mapping[str, torch.Tensor]):
    """Running per-head statistics over a stream of batches; `stats[name]` is a `[layers, heads]` mean.

    A read-only mapping from each statistic's name (`STATISTICS`) to its means: iterate it, `len`,
    `in`, `.items()`. Heads are indexed by their original numbers: a pruned head has no rows and reads NaN.

    Example:
        >>> stats = HeadStatistics.empty(layers=2, heads=4)
        >>> probs = torch.full((1, 4, 3, 3), 1 / 3)                          # [B, H, T, T]: uniform heads
        >>> kinds = torch.zeros(1, 3, 3, dtype=torch.bool)
        >>> stats.update({0: probs}, kinds, None, causal=False)              # per batch; layer 1 not seen
        >>> stats["entropy"].mean(1)                                          # mean entropy per layer
        tensor([1., nan])
        >>> stats.to_dict()["to_self"]
        [[0.333333, 0.333333, 0.333333, 0.333333], [None, None, None, None]]
        >>> list(stats)[:3], len(stats), "entropy" in stats
        (['entropy', 'to_start', 'to_first'], 12, True)
    """

    sums: torch.Tensor
    rows: torch.Tensor

    @classmethod
    def empty(cls, layers: int, heads: int) -> HeadStatistics:
        shape = (layers, heads, len(STATISTICS))
        return cls(torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64))

    @property
    def names(self) -> tuple[str, ...]:
        return STATISTICS

    def __getitem__(self, name: str) -> torch.Tensor:
        """The mean of statistic `name` per head `[layers, heads]` (NaN for heads without rows)."""
        if name not in STATISTICS:
            raise KeyError(f"unknown statistic {name!r}; choose one of {list(STATISTICS)}")
        k = STATISTICS.index(name)
        rows = self.rows[..., k]
        return torch.where(rows > 0, self.sums[..., k] / rows.clamp_min(1), torch.nan).float()

    def __iter__(self) -> Iterator[str]:
        return iter(STATISTICS)

    def __len__(self) -> int:
        return len(STATISTICS)

    def update(
        self,
        probs: Mapping[int, torch.Tensor],
        kinds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        causal: bool,
        heads: Mapping[int, Sequence[int]] | None = None,
        layer_masks: Mapping[int, torch.Tensor | None] | None = None,
    ) -> None:
        """Add one batch: `probs[layer]` `[B, H, T, T]`, `kinds` `[B, T, 3]` (see `attention_statistics`).
        `heads[layer]` gives the original numbers of the layer's current heads (default 0..H-1);
        `layer_masks[layer]` the mask the layer received (`AttentionRecord.attention_mask`), which tells the
        keys entropy is normalized by (sliding windows)."""
        for layer, layer_probs in probs.items():
            layer_mask = None if layer_masks is None else layer_masks.get(layer)
            self.add(layer, *attention_statistics(layer_probs, kinds, attention_mask, causal, layer_mask), heads)

    def add(
        self, layer: int, sums: torch.Tensor, rows: torch.Tensor, heads: Mapping[int, Sequence[int]] | None = None
    ) -> None:
        """Add one layer's sums `[H, K]` and row counts `[K]` of `ATTENTION_STATISTICS` (`attention_statistics`,
        `attnreg.analysis.blocks.block_statistics`); `heads` as in `update`.

        Example:
            >>> stats = HeadStatistics.empty(layers=1, heads=2)
            >>> probs = torch.full((1, 2, 3, 3), 1 / 3)                       # two uniform heads
            >>> stats.add(0, *attention_statistics(probs, torch.zeros(1, 3, 3, dtype=torch.bool)))
            >>> stats["to_first"]
            tensor([[0.3333, 0.3333]])
        """
        columns = _columns(heads, layer, sums.shape[0])
        self.sums[layer, columns, : len(ATTENTION_STATISTICS)] += sums
        self.rows[layer, columns, : len(ATTENTION_STATISTICS)] += rows

    def update_output_norm(
        self, layer: int, norms: torch.Tensor, attention_mask: torch.Tensor | None, heads: Sequence[int] | None = None
    ) -> None:
        """Add the head output norms `[B, T, H]` of one batch (see `head_output_norms`) over its real tokens."""
        real = torch.ones(norms.shape[:2], device=norms.device) if attention_mask is None else attention_mask
        real = real.to(norms.device, norms.dtype)
        columns = list(range(norms.shape[-1])) if heads is None else list(heads)
        k = STATISTICS.index("output_norm")
        self.sums[layer, columns, k] += (norms * real[..., None]).sum((0, 1)).double().cpu()
        self.rows[layer, columns, k] += float(real.sum())

    def to_dict(self) -> dict[str, list[list[float | None]]]:
        """Every statistic as nested lists `[layer][head]` (None for NaN), for JSON."""
        return {name: _nested(self[name]) for name in STATISTICS}


def _columns(heads: Mapping[int, Sequence[int]] | None, layer: int, count: int) -> list[int]:
    columns = list(range(count)) if heads is None else list(heads[layer])
    if len(columns) != count:
        raise ValueError(f"layer {layer}: {count} heads in the attention but {len(columns)} head numbers given")
    return columns


def _nested(values: torch.Tensor) -> list[list[float | None]]:
    return [[None if math.isnan(v) else round(float(v), 6) for v in row] for row in values.tolist()]


# ---------------------------------------------------------------------------------------------
# Roles
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoleThresholds:
    """Where each head role begins (after Clark et al. 2019 and Voita et al. 2019).

    - `positional`: the row's argmax is the previous (or next) token in at least this share of rows;
    - `no_op`: at least this mean attention mass on the start and end specials ([CLS], [SEP], BOS, EOS),
      Clark et al.'s "no-op" heads;
    - `broad`: mean normalized entropy at least this (1 = uniform over the admissible keys);
    - `syntactic_margin`: parent accuracy (either direction) at least this far above the best
      fixed-offset baseline, overall or for one relation with at least `min_relation_words` scored words;
    - `dormant`: the head's mean output norm below this share of the median head's in its layer
      (it attends but writes next to nothing into the residual stream).

    Example:
        >>> RoleThresholds(broad=0.9)
        RoleThresholds(positional=0.9, no_op=0.5, broad=0.9, syntactic_margin=0.1, min_relation_words=100, dormant=0.1)
    """

    positional: float = 0.9
    no_op: float = 0.5
    broad: float = 0.8
    syntactic_margin: float = 0.10
    min_relation_words: int = 100
    dormant: float = 0.1


@dataclass(frozen=True)
class HeadRole:
    """The role of one head: its primary role, every label that applies, and the figures behind them.

    Example:
        >>> HeadRole(0, 3, "no-op", ("no-op",), "62% of attention on start/end specials").primary
        'no-op'
    """

    layer: int
    head: int
    primary: str
    labels: tuple[str, ...]
    evidence: str
    relations: tuple[str, ...] = ()


@dataclass
class HeadRoles:
    """Roles of every head; `grid()` gives the primary roles `[layers][heads]`, `counts()` how many of each.

    Example:
        >>> roles = HeadRoles([HeadRole(0, 0, "broad", ("broad",), ""), HeadRole(0, 1, "other", (), "")])
        >>> roles.grid(), roles.counts()["broad"], roles.of(0, 1).primary
        ([['broad', 'other']], 1, 'other')
        >>> roles.table()[0]
        {'layer': 0, 'head': 0, 'role': 'broad', 'labels': 'broad', 'relations': '', 'evidence': ''}
    """

    heads: list[HeadRole]
    thresholds: RoleThresholds = field(default_factory=RoleThresholds)

    def grid(self) -> list[list[str]]:
        layers = max(role.layer for role in self.heads) + 1
        width = max(role.head for role in self.heads) + 1
        grid = [["pruned"] * width for _ in range(layers)]
        for role in self.heads:
            grid[role.layer][role.head] = role.primary
        return grid

    def counts(self) -> dict[str, int]:
        return {name: sum(role.primary == name for role in self.heads) for name in ROLES}

    def of(self, layer: int, head: int) -> HeadRole:
        for role in self.heads:
            if (role.layer, role.head) == (layer, head):
                return role
        raise KeyError(f"no head {head} in layer {layer}")

    def table(self) -> list[dict[str, Any]]:
        """One row per head (layer, head, role, labels, relations, evidence), for CSV or markdown."""
        return [
            {
                "layer": role.layer,
                "head": role.head,
                "role": role.primary,
                "labels": " ".join(role.labels),
                "relations": " ".join(role.relations),
                "evidence": role.evidence,
            }
            for role in self.heads
        ]


def head_roles(
    statistics: HeadStatistics, syntax: ParentAccuracy | None = None, thresholds: RoleThresholds | None = None
) -> HeadRoles:
    """Label every head from its statistics (and parent accuracy on gold trees, when given).

    Labels: "positional:previous" / "positional:next", "no-op", "broad", "syntactic", "dormant". The
    primary role is the first label in `ROLES` order (dormant, positional, syntactic, no-op, broad),
    "other" without a label, "pruned" for a head with no rows.

    Example:
        >>> previous = torch.diag(torch.ones(3), -1); previous[0, 0] = 1.0   # attends to the previous token
        >>> probs = torch.stack([previous, torch.full((4, 4), 0.25)])[None]   # [B, H, T, T]: 2 heads
        >>> stats = HeadStatistics.empty(layers=1, heads=2)
        >>> stats.update({0: probs}, torch.zeros(1, 4, 3, dtype=torch.bool), None, causal=False)
        >>> roles = head_roles(stats, thresholds=RoleThresholds(broad=0.9))    # syntax=analysis.syntax: gold trees
        >>> roles.of(0, 0).primary, roles.of(0, 0).evidence
        ('positional', 'argmax on the previous token in 100% of rows')
        >>> roles.of(0, 1).labels
        ('broad',)
    """
    thresholds = thresholds or RoleThresholds()
    entropy, previous, following = statistics["entropy"], statistics["argmax_previous"], statistics["argmax_next"]
    special = statistics["to_start"] + statistics["to_end"]
    norms = statistics["output_norm"]
    relative_norm = norms / norms.nanmedian(1, keepdim=True).values.clamp_min(1e-12)
    syntactic = _syntactic_heads(syntax, thresholds) if syntax is not None else {}
    roles = []
    layers, width = entropy.shape
    for layer in range(layers):
        for head in range(width):
            if math.isnan(float(entropy[layer, head])):
                continue
            labels, evidence = [], []
            if relative_norm[layer, head] < thresholds.dormant:
                labels.append("dormant")
                evidence.append(f"output norm {float(relative_norm[layer, head]):.2f} of the layer's median head")
            for name, share in (("previous", previous[layer, head]), ("next", following[layer, head])):
                if share >= thresholds.positional:
                    labels.append(f"positional:{name}")
                    evidence.append(f"argmax on the {name} token in {100 * float(share):.0f}% of rows")
            relations = syntactic.get((layer, head), [])
            if relations:
                labels.append("syntactic")
                evidence.append("parent accuracy " + ", ".join(text for _, text in relations))
            if special[layer, head] >= thresholds.no_op:
                labels.append("no-op")
                evidence.append(f"{100 * float(special[layer, head]):.0f}% of attention on start/end specials")
            if entropy[layer, head] >= thresholds.broad:
                labels.append("broad")
                evidence.append(f"normalized entropy {float(entropy[layer, head]):.2f}")
            primary = next((role for role in ROLES if any(label.split(":")[0] == role for label in labels)), "other")
            roles.append(
                HeadRole(layer, head, primary, tuple(labels), "; ".join(evidence), tuple(r for r, _ in relations))
            )
    return HeadRoles(roles, thresholds)


def _syntactic_heads(
    syntax: ParentAccuracy, thresholds: RoleThresholds
) -> dict[tuple[int, int], list[tuple[str, str]]]:
    """(layer, head) -> [(relation, "det 92.1 vs 51.7 at +1"), ...] for every relation (or "all") where a
    direction of the head beats the relation's best fixed-offset baseline by the margin."""
    found: dict[tuple[int, int], list[tuple[str, str]]] = {}
    candidates = [None] + [r for r, count in syntax.relation_words().items() if count >= thresholds.min_relation_words]
    for relation in candidates:
        offset, baseline = syntax.best_baseline(relation)
        best = torch.stack([syntax.relation_accuracy(relation, d) for d in ("dependent_to_head", "head_to_dependent")])
        best = best.nan_to_num(-1.0).max(0).values
        for layer, head in (best >= baseline + thresholds.syntactic_margin).nonzero().tolist():
            text = f"{relation or 'all'} {100 * float(best[layer, head]):.1f} vs {100 * baseline:.1f} at {offset:+d}"
            found.setdefault((layer, head), []).append((relation or "all", text))
    return found
