"""Loss terms on captured attention: a term of your own, entropy regularization, the syntax-prior KL.

Each method names the layers it captures (`layers`) and, given the captured attention of one training
micro-batch, returns its weighted term and the figures to log (`<name>/layer<l>`: mean entropy, or KL).
Heads are given by their original numbers, which stay valid when pruning removes others; a layer or
head pruned away drops out of the term, said once in a warning.

Example:
    >>> import torch, attnreg
    >>> from attnreg.schedules import Linear
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("bert")                                      # 2 layers x 4 heads
    >>> kl = PriorKL(weight=Linear(1.0, 0.5), heads={0: [3], 1: [2]})
    >>> kl.bind(model); kl.start(1000)                                  # 1,000 optimizer steps in all
    >>> batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attnreg_prior": torch.tensor([[1, -1, 1, 2]])}
    >>> with attnreg.attach(model).capture(kl.layers, inputs=kl.inputs) as record:
    ...     loss = model(input_ids=batch["input_ids"]).last_hidden_state.pow(2).mean()
    >>> value, logs = kl.term(record, batch, step=500)                  # weighted at 0.75
    >>> loss = loss + value; sorted(logs)
    ['prior_kl/layer0', 'prior_kl/layer1']
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from attnreg import blockwise
from attnreg.heads import head_numbers, pruned_heads
from attnreg.hub import AttentionRecord, LayerInputs
from attnreg.losses import EntropyMode, HeadReduction, attention_entropy, entropy_penalty, prior_kl
from attnreg.methods.base import Method
from attnreg.schedules import ScheduleLike, as_schedule
from attnreg.syntax.data import PRIOR_KEY

Heads = Iterable[int] | Mapping[int, Iterable[int]] | None
TermFunction = Callable[[AttentionRecord, Any], torch.Tensor]


class LossTerm(Method):
    """A weighted loss term on the captured attention of `layers` (None = all), for subclasses that
    define `value`. `weight` is a number or a schedule of training progress (`attnreg.schedules`);
    `heads`: the same heads in every chosen layer, or a mapping `{layer: heads}` (whose keys are then
    the layers), by original number. `inputs`: whether the term reads each layer's `LayerInputs`
    (`hub.capture(..., inputs=True)`: the layer stays on SDPA) rather than its probabilities.

    Example:
        >>> class MeanAttention(LossTerm):                               # attention paid to the first key
        ...     def value(self, probs, batch):
        ...         return torch.stack([probs[layer][..., 0].mean() for layer in self.layers]).mean(), {}
        >>> MeanAttention(layers=[0, 1], weight=0.5).weight
        0.5
    """

    inputs = False

    def __init__(
        self,
        name: str | None = None,
        layers: int | Iterable[int] | None = None,
        weight: ScheduleLike = 1.0,
        heads: Heads = None,
    ) -> None:
        super().__init__(name)
        self.layers_argument = self.layers = layers
        self.weight = weight
        self.schedule = as_schedule(check_weight(weight, type(self).__name__) if not callable(weight) else weight)
        self.heads: dict[int, list[int]] | list[int] | None = None
        self._layers_from_heads = False  # layers=None with a {layer: heads} map: the map names the layers
        if isinstance(heads, Mapping):
            self.heads = {int(layer): list(chosen) for layer, chosen in heads.items()}
            if self.layers is None:
                self.layers, self._layers_from_heads = list(self.heads), True
        elif heads is not None:
            self.heads = list(heads)
        self.causal = False
        self._reported: set[tuple[int, int | None]] = set()

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "layers": self.layers_argument, "heads": self.heads}

    def schedules(self) -> list[Callable[[float], float]]:
        return [self.schedule]

    def heads_of(self, layer: int) -> list[int] | None:
        """The heads of `layer` (original numbers) this term applies to (None = all)."""
        return self.heads.get(layer) if isinstance(self.heads, dict) else self.heads

    def bind(self, model: nn.Module, taken: Collection[str] = ()) -> None:
        super().bind(model, taken)
        model = self.model  # the transformers model (inside a PEFT model, say)
        count = self.hub.num_layers
        if self._layers_from_heads and any(not 0 <= layer < count for layer in self.layers):
            raise IndexError(
                f"{type(self).__name__}: heads={self.heads} names layers out of range: "
                f"{type(self.hub.model).__name__} has {count} attention layers (0 to {count - 1})"
            )
        self.layers = self.hub.resolve_layers(self.layers, "layers")
        self.causal = self.hub.family.causal
        if isinstance(self.heads, dict) and set(self.heads) != set(self.layers):
            raise ValueError(
                f"{type(self).__name__}: heads is given for layers {sorted(self.heads)} but layers={list(self.layers)}"
            )
        for layer in self.layers:
            heads = self.heads_of(layer)
            count = len(head_numbers(model, layer)) + len(pruned_heads(model).get(layer, ()))
            if heads is not None and not all(isinstance(h, int) and 0 <= h < count for h in heads):
                raise IndexError(
                    f"{type(self).__name__}: heads={heads} out of range for layer "
                    f"{layer}, which has {count} heads (valid: 0..{count - 1})"
                )

    def current_weight(self, step: int) -> float:
        """The weight at optimizer step `step`."""
        return check_weight(self.schedule(self.progress(step)), f"{type(self).__name__} weight at step {step}")

    def term(self, probs: AttentionRecord, batch: Any, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(weighted term, figures to log by name) for one micro-batch at optimizer step `step`."""
        value, logs = self.value(probs, batch)
        return self.current_weight(step) * value, {name: figure.detach() for name, figure in logs.items()}

    def value(self, probs: AttentionRecord, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The unweighted term and the figures to log by name."""
        raise NotImplementedError(f"{type(self).__name__} must define value(probs, batch)")

    def active_heads(self) -> dict[int, list[int] | None]:
        """{layer: current positions of the chosen heads (None = all)} for the layers that still have
        some; what pruning removed is left out, and said once."""
        model = self.require_bound()
        active = {}
        for layer in self.layers:
            numbers = head_numbers(model, layer)
            chosen = self.heads_of(layer)
            gone = [head for head in (chosen or ()) if head not in numbers]
            for head in gone:
                self._report_pruned(layer, head)
            if not numbers or (chosen is not None and len(gone) == len(chosen)):
                self._report_pruned(layer, None)
                continue
            active[layer] = None if chosen is None else [numbers.index(head) for head in chosen if head in numbers]
        return active

    def captured(self, record: AttentionRecord, layer: int) -> torch.Tensor | LayerInputs:
        """What `record` holds for `layer`, checked to be what this term reads (`LayerInputs` if
        `self.inputs`, else probabilities), so a capture of the wrong kind fails naming the fix."""
        captured = record[layer]
        if isinstance(captured, LayerInputs) != self.inputs:
            wanted = "hub.capture(layers, inputs=True)" if self.inputs else "hub.capture(layers) (probabilities)"
            raise TypeError(
                f"{type(self).__name__} {self.name!r} (blockwise={self.inputs}) reads layer {layer} as captured by "
                f"{wanted}, but the record holds {type(captured).__name__}; capture with that, or pass "
                f"blockwise={not self.inputs}"
            )
        return captured

    def layer_figures(self, layers: Iterable[int], values: torch.Tensor) -> dict[str, torch.Tensor]:
        return {f"{self.name}/layer{layer}": value for layer, value in zip(layers, values, strict=True)}

    def _report_pruned(self, layer: int, head: int | None) -> None:
        if (layer, head) in self._reported:
            return
        self._reported.add((layer, head))
        what = (
            f"every chosen head of layer {layer} was pruned, so the term no longer covers the layer"
            if head is None
            else f"head {head} of layer {layer} was pruned, so the term no longer covers it"
        )
        warnings.warn(f"{type(self).__name__} {self.name!r}: {what}", stacklevel=3)


class AttentionPenalty(LossTerm):
    """`weight * fn(probs, batch)`: `fn` receives the captured attention of `layers` (None = all) as an
    `AttentionRecord` and the batch, and returns a scalar tensor.

    Example:
        >>> import torch, attnreg
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert")
        >>> spread = AttentionPenalty(lambda probs, batch: probs[0].var(), name="spread", layers=[0], weight=0.1)
        >>> spread.bind(model); spread.start(100)
        >>> with attnreg.attach(model).capture(spread.layers) as probs:     # probabilities, materialized
        ...     _ = model(input_ids=torch.tensor([[5, 6, 7]]))
        >>> value, _ = spread.term(probs, {}, step=0)
        >>> value.shape, value.requires_grad
        (torch.Size([]), True)
    """

    default_name = "attention_loss"

    def __init__(
        self,
        fn: TermFunction,
        name: str | None = None,
        layers: int | Iterable[int] | None = None,
        weight: ScheduleLike = 1.0,
    ) -> None:
        super().__init__(name, layers, weight)
        self.fn = fn

    def value(self, probs: AttentionRecord, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.fn(probs, batch), {}


class Entropy(LossTerm):
    """Entropy regularization of attention heads.

    `mode="min"` sharpens, `"max"` flattens (EAR), `"target"` keeps each head (or each layer's head
    mean, `per="layer"`) inside `target=(lo, hi)`. Entropies are normalized by log(admissible keys)
    unless `normalize=False`; `heads` limits the loss to some heads of every chosen layer. Logs the
    mean entropy of each layer as `<name>/layer<l>`. With `blockwise` (the default) the layers stay on
    SDPA and the entropies are recomputed in blocks (`attnreg.blockwise`: the same values and gradients,
    nothing of size `[T, S]` kept); `blockwise=False` materializes the attention instead.

    Example:
        >>> import torch, attnreg
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("gpt2")
        >>> entropy = Entropy(mode="target", target=(0.3, 0.8), layers=[1], weight=0.1)
        >>> entropy.bind(model); entropy.start(100)
        >>> batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attention_mask": torch.ones(1, 4)}
        >>> with attnreg.attach(model).capture(entropy.layers, inputs=True) as record:
        ...     _ = model(**batch)
        >>> value, logs = entropy.term(record, batch, step=0)      # random weights: near uniform, above 0.8
        >>> float(value) > 0, list(logs)
        (True, ['entropy/layer1'])
        >>> with attnreg.attach(model).capture(entropy.layers) as probs:   # probabilities: the wrong kind
        ...     _ = model(**batch)
        >>> entropy.term(probs, batch, step=0)
        Traceback (most recent call last):
        TypeError: Entropy 'entropy' (blockwise=True) reads layer 1 as captured by hub.capture(layers, inputs=True), ...
    """

    default_name = "entropy"

    def __init__(
        self,
        weight: ScheduleLike = 0.01,
        mode: EntropyMode = "min",
        target: tuple[float, float] | None = None,
        layers: int | Iterable[int] | None = None,
        heads: Heads = None,
        normalize: bool = True,
        per: str = "head",
        name: str | None = None,
        blockwise: bool = True,
    ) -> None:
        target = None if target is None else tuple(target)
        entropy_penalty(torch.zeros(1), mode, target, per)  # validate the options now, not at step one
        super().__init__(name, layers, weight, heads)
        self.mode, self.target, self.per, self.normalize = mode, target, per, normalize
        self.inputs = blockwise

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "mode": self.mode, "target": self.target}

    def value(self, probs: AttentionRecord, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        active = self.active_heads()
        entropies = []
        for layer, heads in active.items():
            if self.inputs:
                captured = self.captured(probs, layer)
                entropies.append(blockwise.attention_entropy(captured, mask, self.causal, self.normalize, heads))
                continue
            captured = self.captured(probs, layer)  # the layer's own mask counts its keys (sliding windows)
            layer_mask = probs.attention_mask(layer) if isinstance(probs, AttentionRecord) else None
            entropy = attention_entropy(captured, mask, self.causal, self.normalize, layer_mask)
            entropies.append(entropy if heads is None else entropy[heads])
        if not entropies:
            return torch.zeros((), device=next(self.model.parameters()).device), {}
        logs = self.layer_figures(active, torch.stack([entropy.mean() for entropy in entropies]))
        if self.per == "layer" or len({len(entropy) for entropy in entropies}) == 1:
            return entropy_penalty(torch.stack(entropies), self.mode, self.target, self.per), logs
        return torch.stack([entropy_penalty(entropy, self.mode, self.target) for entropy in entropies]).mean(), logs


class PriorKL(LossTerm):
    """KL(prior ‖ attention) for chosen heads, with the prior read from the batch.

    The batch (a dict) carries `batch[prior_key]` (default "attnreg_prior"): key indices `[B, T]`
    (-1 = row left out) or dense rows `[B, T, S]`, aligned with the model's tokens, as
    `attnreg.syntax.SyntaxCollator` builds them. For decoders the prior is restricted to earlier keys.
    `head_reduction`: "mean_heads" (mean of per-head KLs) or "mean_attention" (KL of the head mean).
    `blockwise` as for `Entropy`.

    Example:
        >>> PriorKL(weight=1.0, layers=[0, 1], heads=[0]).layers          # head 0 of layers 0 and 1
        [0, 1]
        >>> PriorKL(heads={0: [3], 1: [4], 2: [8]}).layers                # one chosen head per layer
        [0, 1, 2]
    """

    default_name = "prior_kl"
    needs = frozenset({"prior"})

    def __init__(
        self,
        weight: ScheduleLike = 1.0,
        layers: int | Iterable[int] | None = None,
        heads: Heads = None,
        head_reduction: HeadReduction = "mean_heads",
        prior_key: str = PRIOR_KEY,
        name: str | None = None,
        blockwise: bool = True,
    ) -> None:
        if head_reduction not in ("mean_heads", "mean_attention"):
            raise ValueError(f"head_reduction must be 'mean_heads' or 'mean_attention', got {head_reduction!r}")
        super().__init__(name, layers, weight, heads)
        self.head_reduction, self.prior_key = head_reduction, prior_key
        self.batch_keys = (prior_key,)
        self.inputs = blockwise

    def value(self, probs: AttentionRecord, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if not isinstance(batch, dict) or self.prior_key not in batch:
            keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise KeyError(
                f"{type(self).__name__} reads the prior from batch[{self.prior_key!r}]; the batch has {keys}. "
                "Build batches with attnreg.syntax.SyntaxCollator (or put your own prior under that key)."
            )
        prior = batch[self.prior_key]
        active = self.active_heads()
        if not active:
            return torch.zeros((), device=next(self.model.parameters()).device), {}
        kl = blockwise.prior_kl if self.inputs else prior_kl
        losses = torch.stack(
            [  # the prior's values are checked once per batch, with the first layer (one sync, not one a layer)
                kl(self.captured(probs, layer), prior, heads, self.head_reduction, self.causal, check_values=i == 0)
                for i, (layer, heads) in enumerate(active.items())
            ]
        )
        return losses.mean(), self.layer_figures(active, losses)


def check_weight(weight: Any, what: str) -> float:
    """`weight` as a float, if it is a finite number >= 0; else a ValueError naming `what`.

    Example:
        >>> check_weight(1, "Entropy")
        1.0
        >>> check_weight(float("nan"), "Entropy")
        Traceback (most recent call last):
        ValueError: Entropy: weight must be a finite number >= 0 or a schedule of progress, got nan
    """
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight < 0:
        raise ValueError(f"{what}: weight must be a finite number >= 0 or a schedule of progress, got {weight!r}")
    return float(weight)
