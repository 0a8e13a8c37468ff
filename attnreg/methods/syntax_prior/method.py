"""The syntax-prior KL as a method: chosen heads pulled toward a distribution built from a dependency parse.

The functional form is `attnreg.losses.prior_kl` (materialized probabilities) or `attnreg.blockwise.prior_kl`
(from queries and keys, in blocks); the prior comes from `attnreg.syntax` (`SyntaxCollator`, `SyntaxPrior`).

Example:
    >>> import torch, attnreg
    >>> from attnreg.schedules import Linear
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("bert")                                      # 2 layers x 4 heads
    >>> kl = SyntaxPriorKL(weight=Linear(1.0, 0.5), heads={0: [3], 1: [2]})
    >>> kl.bind(model); kl.start(1000)                                  # 1,000 optimizer steps in all
    >>> batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attnreg_prior": torch.tensor([[1, -1, 1, 2]])}
    >>> with attnreg.attach(model).capture(kl.layers, inputs=kl.inputs) as record:
    ...     loss = model(input_ids=batch["input_ids"]).last_hidden_state.pow(2).mean()
    >>> value, logs = kl.term(record, batch, step=500)                  # weighted at 0.75
    >>> loss = loss + value; sorted(logs)
    ['syntax_prior_kl/layer0', 'syntax_prior_kl/layer1']

Different heads can take different prior kinds in one term (`kinds`: the verb -> subject row on one head, the
noun -> determiner row on another), each read from its own batch key, which `SyntaxCollator(kinds=
kl.kind_priors)` fills:

    >>> kinds = SyntaxPriorKL(kinds={"nsubj": {1: [0]}, "det": {1: [1]}, "parent": {0: [2]}})
    >>> kinds.layers, sorted(kinds.kind_priors)
    ([0, 1], ['attnreg_prior.dependents:det', 'attnreg_prior.dependents:nsubj', 'attnreg_prior.parent'])
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from attnreg import blockwise
from attnreg.losses import HeadReduction, causal_prior, check_prior, prior_kl, prior_rows, reachable_prior
from attnreg.methods.loss_term import Heads, LossTerm
from attnreg.methods.registry import register_method
from attnreg.records import AttentionRecord
from attnreg.schedules import ScheduleLike
from attnreg.syntax.data import PRIOR_KEY
from attnreg.syntax.priors import SyntaxPrior


@register_method(docs="methods/syntax-prior.md")
class SyntaxPriorKL(LossTerm):
    """KL(prior ‖ attention) for chosen heads, with the prior read from the batch.

    The batch (a dict) carries `batch[prior_key]` (default "attnreg_prior"): key indices `[B, T]`
    (-1 = row left out) or dense rows `[B, T, S]`, aligned with the model's tokens, as
    `attnreg.syntax.SyntaxCollator` builds them. For decoders the prior is restricted to earlier keys.
    `head_reduction`: "mean_heads" (mean of per-head KLs) or "mean_attention" (KL of the head mean).
    `blockwise` as for `EntropyRegularizer`.

    `kinds` gives heads their own prior kinds instead of `heads`: `{spec: heads}`, a spec as
    `attnreg.syntax.SyntaxPrior.from_spec` reads it ("parent", "dependents", a relation such as "nsubj" for
    verb -> subject, "parent:det" for determiner -> noun), `heads` a list (in every layer of `layers`) or
    `{layer: heads}`; `subtypes` ("fold" or "keep") says how relations compare. Each kind is read from
    `batch[f"{prior_key}.{spec}"]` (`kind_priors` maps those keys to the priors, for `SyntaxCollator(kinds=...)`);
    the term is the mean over kinds of each kind's mean over its layers, logged per kind and layer
    (`<name>/<spec>/layer<l>`). A layer or head outside the model is refused at `bind`, naming the kind.

    Each layer's KL (of each kind) is a mean over the prior rows that layer can reach; `items` counts them per layer
    and kind, so that where an adapter counts an optimizer step's micro-batches ahead (`Runner.window`: the Hugging
    Face `Trainer`) each is the mean over the rows of the whole global batch, however it is split over micro-batches
    and processes; the figures logged are then each micro-batch's share of it, times the micro-batches.

    Until a batch brings a row the term can train on (for a decoder, one with a target at or before its word), each
    batch is checked for one (a synchronization on a GPU, none after); `quiet_batches` micro-batches without one
    warn, naming the kind, and so does the end of training if none ever came: the term was 0. (`SyntaxCollator`
    refuses such a kind at its first batch where the sentences come from a file; `attnreg.syntax.check_priors`
    checks sentences of your own before training.)

    Example:
        >>> SyntaxPriorKL(weight=1.0, layers=[0, 1], heads=[0]).layers          # head 0 of layers 0 and 1
        [0, 1]
        >>> SyntaxPriorKL(heads={0: [3], 1: [4], 2: [8]}).layers                # one chosen head per layer
        [0, 1, 2]
        >>> SyntaxPriorKL(kinds={"nsubj": {15: [2]}, "parent": {15: [3], 14: [1]}}).layers
        [14, 15]
    """

    default_name = "syntax_prior_kl"
    needs = frozenset({"prior"})
    quiet_batches = 50  # micro-batches without a row this term can train on before it warns

    def __init__(
        self,
        weight: ScheduleLike = 1.0,
        layers: int | Iterable[int] | None = None,
        heads: Heads = None,
        head_reduction: HeadReduction = "mean_heads",
        prior_key: str = PRIOR_KEY,
        name: str | None = None,
        blockwise: bool = True,
        kinds: Mapping[str, Heads] | None = None,
        subtypes: str = "fold",
    ) -> None:
        if head_reduction not in ("mean_heads", "mean_attention"):
            raise ValueError(f"head_reduction must be 'mean_heads' or 'mean_attention', got {head_reduction!r}")
        self._kinds: dict[str, SyntaxPriorKL] = {}
        self.kind_priors: dict[str, SyntaxPrior] = {}
        if kinds is not None:
            if heads is not None:
                raise ValueError(f"{type(self).__name__}: give heads either through kinds= or heads=, not both")
            if not isinstance(kinds, Mapping) or not kinds:
                raise TypeError(f"{type(self).__name__}: kinds must map prior kinds to heads, got {kinds!r}")
            for spec, chosen in kinds.items():
                prior = SyntaxPrior(spec, subtypes=subtypes)
                key = f"{prior_key}.{prior.spec}"
                if key in self.kind_priors:
                    raise ValueError(f"{type(self).__name__}: kinds names {prior.spec!r} twice")
                self.kind_priors[key] = prior
                self._kinds[prior.spec] = SyntaxPriorKL(weight, layers, chosen, head_reduction, key, None, blockwise)
            maps = [child._layers_from_heads for child in self._kinds.values()]
            if layers is None and all(maps):
                layers = sorted({layer for child in self._kinds.values() for layer in child.layers})
        super().__init__(name, layers, weight, heads)
        self.kinds = None if kinds is None else {spec: child.heads for spec, child in self._kinds.items()}
        self.subtypes = subtypes
        self.head_reduction, self.prior_key = head_reduction, prior_key
        self.batch_keys = tuple(self.kind_priors) if self._kinds else (prior_key,)
        self.inputs = blockwise
        self._quiet = 0  # micro-batches seen without a row to train on; None once one came
        self._windows: dict[int, int | None] = {}  # each layer's sliding window (None: none), from the config
        self._weighed: tuple[Mapping[str, float], int] | None = None  # the step's rows per layer, micro-batches

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "kinds": self.kinds} if self.kinds else super().identity()

    def bind(self, model: torch.nn.Module, taken: Any = ()) -> None:
        for spec, child in self._kinds.items():  # first, so that a layer or head outside the model names its kind
            try:
                child.bind(model)
            except (IndexError, ValueError) as error:
                raise type(error)(f"{type(self).__name__} kinds[{spec!r}]: {error}") from error
        super().bind(model, taken)
        for spec, child in self._kinds.items():
            child.name = f"{self.name}/{spec}"
        config = self.model.config.get_text_config()
        window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
        self._windows = {  # as transformers masks them: layer_types' "sliding_attention" layers, else every layer
            layer: window
            if isinstance(window, int) and (types is None or types[layer] == "sliding_attention")
            else None
            for layer in self.layers
        }

    def heads_of(self, layer: int) -> list[int] | None:
        """The heads of `layer` this term supervises, over every kind (None = all)."""
        if not self._kinds:
            return super().heads_of(layer)
        chosen = [
            child.heads_of(layer) for child in self._kinds.values() if child.layers is None or layer in child.layers
        ]
        return None if any(heads is None for heads in chosen) else sorted({h for heads in chosen for h in heads})

    def unbind(self) -> None:
        for child in self._kinds.values():
            child.unbind()
        super().unbind()

    def items(self, batch: Any) -> dict[str, int] | None:
        """The prior rows each layer's KL is a mean over in `batch` (`layer<l>`; with kinds `<spec>/layer<l>`): rows
        with a target the layer can reach (for a decoder at or before the word, within a sliding window's keys).

        Example:
            >>> import torch
            >>> from attnreg.tiny import tiny_model
            >>> kl = SyntaxPriorKL(kinds={"parent": {0: [1]}, "nsubj": {0: [2], 1: [2]}})
            >>> kl.bind(tiny_model("gpt2"))
            >>> parents, subjects = torch.tensor([[-1, 0, 2]]), torch.tensor([[1, -1, 0]])   # decoder: 0 -> 1 out
            >>> kl.items({"attnreg_prior.parent": parents, "attnreg_prior.dependents:nsubj": subjects})
            {'parent/layer0': 2, 'dependents:nsubj/layer0': 1, 'dependents:nsubj/layer1': 1}
        """
        if self._kinds:
            counts: dict[str, int] = {}
            for spec, child in self._kinds.items():
                found = child.items(batch)
                if found is None:
                    return None
                counts.update({f"{spec}/{part}": count for part, count in found.items()})
            return counts
        if self.model is None or not isinstance(batch, dict) or self.prior_key not in batch:
            return None
        prior, padding = batch[self.prior_key], batch.get("attention_mask")
        self._check_type(prior)
        windows = list(dict.fromkeys(self._windows.values()))
        counts = torch.stack([prior_rows(prior, padding, self.causal, window) for window in windows]).tolist()
        found = dict(zip(windows, counts, strict=True))
        return {f"layer{layer}": found[window] for layer, window in self._windows.items()}

    def weigh(self, items: Mapping[str, float] | None, parts: int) -> None:
        """Each layer's KL of the micro-batches to come is its share of the mean over `items[f"layer{l}"]` rows,
        times `parts` (the step's micro-batches times processes); `None`: the mean over each micro-batch's rows."""
        for spec, child in self._kinds.items():
            prefix = f"{spec}/"
            mine = None if items is None else {k[len(prefix) :]: v for k, v in items.items() if k.startswith(prefix)}
            child.weigh(mine, parts)
        self._weighed = None if items is None else (items, parts)

    def value(self, probs: AttentionRecord, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self._kinds:
            parts = [child.value(probs, batch) for child in self._kinds.values()]
            logs = {name: figure for _, figures in parts for name, figure in figures.items()}
            return torch.stack([value for value, _ in parts]).mean(), logs
        if not isinstance(batch, dict) or self.prior_key not in batch:
            keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise KeyError(
                f"{type(self).__name__} reads the prior from batch[{self.prior_key!r}]; the batch has {keys}. "
                "Build batches with attnreg.syntax.SyntaxCollator (or put your own prior under that key)."
            )
        prior = batch[self.prior_key]
        self._check_type(prior)
        if self._quiet is not None and not torch.compiler.is_compiling():
            self._count_rows(prior)
        active = self.active_heads()
        if not active:
            return torch.zeros((), device=next(self.model.parameters()).device), {}
        values = []
        for i, (layer, heads) in enumerate(active.items()):
            captured = self.captured(probs, layer)  # the prior's values are checked once per batch, with layer one
            options = dict(reduction=self.head_reduction, causal=self.causal, check_values=i == 0)
            if self._weighed is not None:  # a share of the mean over the step's rows
                totals, parts = self._weighed
                total = float(totals.get(f"layer{layer}", 0.0))
                options["rows"] = total / parts if total > 0 else 1.0
            if self.inputs:
                values.append(blockwise.prior_kl(captured, prior, heads, **options))
            else:
                layer_mask = probs.attention_mask(layer) if isinstance(probs, AttentionRecord) else None
                values.append(prior_kl(captured, prior, heads, **options, layer_mask=layer_mask))
        self._report_window(probs, prior, active)
        losses = torch.stack(values)
        return losses.mean(), self.layer_figures(active, losses)

    def _check_type(self, prior: Any) -> None:
        """`check_prior`'s TypeError for a prior that is no tensor of key indices or dense rows, before the batch's
        prior is read (counted, restricted), naming the batch key."""
        try:
            check_prior(prior, None)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{type(self).__name__} batch[{self.prior_key!r}]: {error}") from error

    def on_fit_end(self, loop: Any) -> None:
        for child in self._kinds.values() or [self]:
            if child._quiet:
                message = f"{child._silence()} in the whole run ({child._quiet} micro-batches): it trained nothing"
                warnings.warn(message, stacklevel=2)

    def _count_rows(self, prior: torch.Tensor) -> None:
        """Whether this batch brings a row the term trains on (for a decoder: with a target at or before its word);
        after `quiet_batches` batches without one, say so once."""
        reachable = causal_prior(prior, prior.shape[-1] if prior.dim() == 3 else None) if self.causal else prior
        if bool((reachable >= 0).any() if prior.dim() == 2 else (reachable.sum(-1) > 0).any()):
            self._quiet = None
            return
        self._quiet += 1
        if self._quiet == self.quiet_batches:
            warnings.warn(
                f"{self._silence()} in the first {self._quiet} training micro-batches: its term has been 0. A rare "
                "relation may just not have come yet; one that never occurs in the training data trains nothing "
                "(attnreg.syntax.check_priors(sentences, kl.kind_priors, causal=...) checks the data)",
                stacklevel=4,
            )

    def _silence(self) -> str:
        """The start of the warnings of a term that has had no row to train on."""
        target = "a target at or before its word (what a causal model can attend to)" if self.causal else "a target"
        return f"{type(self).__name__} {self.name!r}: no word of batch[{self.prior_key!r}] had {target}"

    def _report_window(self, probs: AttentionRecord, prior: torch.Tensor, active: dict) -> None:
        """Say once per layer that its mask (a sliding window) leaves prior rows out of the term, with how many of a
        batch's: one synchronization per batch, only for layers that received a mask and have not said it yet; none
        under `torch.compile`, where the rows are left out all the same but not counted (no graph break)."""
        if not isinstance(probs, AttentionRecord) or torch.compiler.is_compiling():
            return
        warned = self.__dict__.setdefault("_window_warned", set())
        masks = {layer: probs.attention_mask(layer) for layer in active if layer not in warned}
        masks = {layer: mask for layer, mask in masks.items() if mask is not None}
        if not masks:
            return
        keys = next(iter(masks.values())).shape[-1]
        rows = (prior >= 0).sum() if prior.dim() == 2 else (prior.sum(-1) > 0).sum()
        causal = causal_prior(prior, keys) if self.causal else prior
        reachable = (causal >= 0).sum() if prior.dim() == 2 else (causal.sum(-1) > 0).sum()
        counts = torch.stack([reachable, rows] + [reachable_prior(causal, mask)[1] for mask in masks.values()]).tolist()
        for layer, dropped in zip(masks, counts[2:], strict=True):
            if dropped:
                warned.add(layer)
                warnings.warn(
                    f"{type(self).__name__} {self.name!r}: layer {layer}'s attention mask (a sliding window, or "
                    f"padding) leaves out {dropped} of the {counts[0]} prior rows of a batch it could otherwise "
                    f"reach ({counts[1]} in all): their prior lies on keys outside the window, so the KL is over the "
                    "rows the layer can reach (said once per layer)",
                    stacklevel=3,
                )
