"""The method object: one attnreg method with its settings, its state, and what it does at each point
of training, with no training framework inside. Adapters (`attnreg.callbacks` for Lightning,
`attnreg.integrations.hf` for the Hugging Face `Trainer`) decide *when* to call it.

The life of a method, as an adapter drives it:

1. `bind(model, taken)`: attach the model's hub, check the settings against it, pick a free name
   (`taken`: names other methods hold), create what must exist before the optimizer (gates).
2. `start(estimated_steps)`: fix the training length (`attnreg.progress`).
3. every optimizer step: `before_step(step)` (change the model: a dropout rate), and for loss terms
   `term(probs, batch, step)` on every micro-batch.
4. `state_dict()` / `load_state_dict()` with the checkpoint; `unbind()` after training.

Example:
    >>> import torch
    >>> from attnreg.methods import Entropy
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("bert", head="classification")
    >>> batch = {"input_ids": torch.tensor([[2, 5, 6, 3]]), "labels": torch.tensor([1])}
    >>> method = Entropy(mode="max", layers=[0], weight=0.01)
    >>> method.bind(model, taken=set())
    >>> method.start(estimated_steps=1000)
    >>> with method.hub.capture(method.layers, inputs=method.inputs) as record:   # inputs: the blockwise path
    ...     loss = model(**batch).loss
    >>> value, logs = method.term(record, batch, step=0)     # weighted term; figures to log
    >>> round(value.item(), 4), {name: round(figure.item(), 3) for name, figure in logs.items()}
    (-0.01, {'entropy/layer0': 1.0})
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from torch import nn

from attnreg.hub import AttentionHub, attach
from attnreg.progress import TrainingLength, changes_over_training


class Method:
    """Base of every method object: its name, its training length and its checkpoint state.

    `name` is the method's name in losses, logs and checkpoints; left at None it is `default_name`,
    or `<default_name>_2`, `_3`, ... when another method holds it, so two methods of one class both act.
    Two methods given the same explicit name are an error. `needs` says what the batches (or the app)
    must provide: "prior" (a syntax prior per batch), "gold_trees", "tokenizer".

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> method = Method(total_steps=10)
        >>> method.bind(tiny_model("bert"), taken={"method"})
        >>> method.name, method.hub.num_layers
        ('method_2', 2)
        >>> method.start(estimated_steps=8.0); method.progress(5)     # total_steps wins over the estimate
        0.5
        >>> method.state_dict()
        {'total_steps': 10}
    """

    default_name = "method"
    needs: frozenset[str] = frozenset()

    def __init__(self, name: str | None = None, total_steps: int | None = None) -> None:
        self.name_argument = name
        self.name = name or self.default_name
        self.length = TrainingLength(type(self).__name__, total_steps)
        self.model: nn.Module | None = None
        self.hub: AttentionHub | None = None

    def identity(self) -> dict[str, Any]:
        """The settings that tell two methods of one class apart (for checkpoint keys)."""
        return {"name": self.name_argument}

    def schedules(self) -> list[Callable[[float], float] | None]:
        """The schedules of training progress this method follows (the length is needed if any changes)."""
        return []

    # -- life cycle --------------------------------------------------------------------------------------
    def bind(self, model: nn.Module, taken: Collection[str] = ()) -> None:
        """Attach to `model` (a transformers model) and take a name not in `taken`."""
        self.model, self.hub = model, attach(model)
        self.name = free_name(self.name_argument, self.default_name, taken, type(self).__name__)

    def start(self, estimated_steps: float) -> None:
        """Fix the training length from the trainer's estimate of its optimizer steps (inf when unknown)."""
        self.length.start(estimated_steps, any(changes_over_training(s) for s in self.schedules()))

    def unbind(self) -> None:
        """Undo what `bind` changed on the model that should not outlive training (nothing by default).

        Example:
            >>> from attnreg.tiny import tiny_model
            >>> method = Method()
            >>> method.bind(tiny_model("gpt2")); method.unbind()
            >>> method.require_bound()
            Traceback (most recent call last):
            ...
            RuntimeError: Method 'method' is used before bind(model)
        """
        self.model = self.hub = None

    def progress(self, step: int) -> float:
        """Training progress at optimizer step `step` (`attnreg.progress`)."""
        return self.length.progress(step)

    # -- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.length.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.length.load_state_dict(state)

    def require_bound(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__} {self.name!r} is used before bind(model)")
        return self.model


def free_name(name: str | None, default: str, taken: Collection[str], owner: str) -> str:
    """`name` if not taken (an error if it is); for `name=None`, `default`, or `default_2`, `default_3`, ...

    Example:
        >>> free_name(None, "entropy", {"entropy"}, "EntropyRegularizer")
        'entropy_2'
    """
    if name is not None:
        if name in taken:
            raise ValueError(
                f"{owner}: the name {name!r} is already held by another attnreg method or term; give each its own name="
            )
        return name
    candidate, number = default, 1
    while candidate in taken:
        number += 1
        candidate = f"{default}_{number}"
    return candidate
