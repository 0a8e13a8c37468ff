"""Loss terms on captured attention: `LossTerm`, the base of every method that adds a term to the loss
(entropy regularization, the syntax-prior KL, head gates) and of a term class of your own, and `AttentionLoss`,
the one way to make a term of a function.

Each term names the layers it captures (`layers`) and, given the captured attention of one training
micro-batch, returns its weighted term and the figures to log (`<name>/layer<l>`). Heads are given by
their original numbers, which stay valid when pruning removes others; a layer or head pruned away drops
out of the term, said once in a warning.

Example:
    >>> import torch, attnreg
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("bert")
    >>> first = AttentionLoss(lambda probs, batch: probs[0][..., 0].mean(), name="first_key", layers=[0])
    >>> first.bind(model); first.start(100)
    >>> with attnreg.attach(model).capture(first.layers) as probs:
    ...     _ = model(input_ids=torch.tensor([[5, 6, 7]]))
    >>> value, logs = first.term(probs, {}, step=0)
    >>> value.requires_grad, first.name
    (True, 'first_key')
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from attnreg import deprecations
from attnreg.heads import head_numbers, pruned_heads
from attnreg.methods.base import Method
from attnreg.methods.registry import register_method
from attnreg.records import AttentionRecord, LayerInputs
from attnreg.schedules import ScheduleLike, as_schedule

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


@register_method(docs="methods/your-own.md", config=False)
class AttentionLoss(LossTerm):
    """A term of your own from a function: `weight * fn(record, batch)`, where `fn` receives what was captured of
    `layers` (None = all, () = none) as an `AttentionRecord` (their probabilities, or with `inputs=True` what they
    received, `LayerInputs`: the layers stay on SDPA, see `attnreg.blockwise`) and the batch, and returns a scalar
    tensor. A class of your own subclasses `LossTerm` instead (or `Method` for more than a loss term).

    Example:
        >>> import torch, attnreg
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert")
        >>> spread = AttentionLoss(lambda probs, batch: probs[0].var(), name="spread", layers=[0], weight=0.1)
        >>> spread.bind(model); spread.start(100)
        >>> with attnreg.attach(model).capture(spread.layers) as probs:     # probabilities, materialized
        ...     _ = model(input_ids=torch.tensor([[5, 6, 7]]))
        >>> value, _ = spread.term(probs, {}, step=0)
        >>> value.shape, value.requires_grad, spread
        (torch.Size([]), True, AttentionLoss(name='spread', layers=(0,), weight=0.1, inputs=False))
    """

    default_name = "attention_loss"

    def __init__(
        self,
        fn: TermFunction,
        name: str | None = None,
        layers: int | Iterable[int] | None = None,
        weight: ScheduleLike = 1.0,
        inputs: bool = False,
    ) -> None:
        if not callable(fn):
            hint = " (AttentionTerm(name, fn, ...) is now AttentionLoss(fn, name=name, ...))" if callable(name) else ""
            raise TypeError(f"AttentionLoss: fn must be a function fn(record, batch) -> scalar, got {fn!r}{hint}")
        super().__init__(name, layers, weight)
        self.fn, self.inputs = fn, bool(inputs)

    def value(self, probs: AttentionRecord, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.fn(probs, batch), {}

    def __repr__(self) -> str:
        settings = f"name={self.name!r}, layers={self.layers!r}, weight={self.weight!r}, inputs={self.inputs!r}"
        return f"AttentionLoss({settings})"


def renamed_term(old: str) -> type[AttentionLoss]:
    """`AttentionLoss`, with a FutureWarning (shown by Python's default filters) that its former name `old` (the
    mixin's `AttentionTerm`) is deprecated; called by the modules that exported the old name.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     term = renamed_term("attnreg.AttentionTerm")
        >>> term is AttentionLoss, caught[0].category.__name__
        (True, 'FutureWarning')
    """
    deprecations.warn(old, stacklevel=3)
    return AttentionLoss


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
