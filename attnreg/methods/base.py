"""The method protocol: one attnreg method with its settings, its state, and what it does at each event of
training, with no training framework inside. A method is a first-class citizen whoever wrote it: the
adapters (`attnreg.callbacks` for Lightning, `attnreg.integrations.hf` for the Hugging Face `Trainer`) and a
loop of your own (`attnreg.methods.Runner`) only translate their events into these, and never name a method.

The events, each optional (the base class does nothing):

1. `bind(model, taken)`: attach the model's hub, check the settings against it, pick a free name
   (`taken`: names other methods hold), create what must exist before the optimizer (gates).
2. `configure_optimizer(model)`: a method that builds the optimizer returns it (and its learning-rate factor per step).
3. `start(estimated_steps)`, then `on_fit_start(loop)`: the training length is fixed; the optimizer exists.
4. every optimizer step: `on_step_begin(loop)`; `term(record, batch, step)` on every micro-batch for a
   method with a loss term (the layers in `layers` are captured, their inputs with `inputs=True`; a term that is
   a mean over items says how many in `items(batch)`, one of several means per part, and is told the step's in
   `weigh`);
   `on_before_optimizer_step(loop)`; `on_step_end(loop)`.
5. `on_epoch_begin(loop)`, `on_epoch_end(loop)`; `on_fit_end(loop)` once training is over;
   `teardown()` in every case (what must not outlive training: dropout rates, `requires_grad`).
6. `state_dict()` / `load_state_dict()` with every checkpoint; `unbind()` when the adapter lets go.

`loop` (a `Loop`) is what the adapter tells about the run: steps and epochs done, the optimizers, logging,
stopping, the output folder, agreement across processes (`broadcast`) and, where the engine allows it, a
rebuilt data-parallel wrapper after a method changed the parameters (`rewrap`).

Example:
    >>> import torch
    >>> from attnreg.methods import EntropyRegularizer
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("bert", head="classification")
    >>> batch = {"input_ids": torch.tensor([[2, 5, 6, 3]]), "labels": torch.tensor([1])}
    >>> method = EntropyRegularizer(mode="max", layers=[0], weight=0.01)
    >>> method.bind(model, taken=set())
    >>> method.start(estimated_steps=1000)
    >>> with method.hub.capture(method.layers, inputs=method.inputs) as record:   # inputs: the blockwise path
    ...     loss = model(**batch).loss
    >>> value, logs = method.term(record, batch, step=0)     # weighted term; figures to log
    >>> round(value.item(), 4), {name: round(figure.item(), 3) for name, figure in logs.items()}
    (-0.01, {'entropy_regularizer/layer0': 1.0})
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnreg.hub import AttentionHub, attach
from attnreg.progress import TrainingLength, changes_over_training


def _no_log(figures: Mapping[str, float]) -> None:
    return None


def _same(value: Any) -> Any:
    return value


def _no_stop() -> None:
    return None


@dataclass
class Loop:
    """What an adapter tells a method at an event: `step` (optimizer steps done), `epoch` (epochs done),
    `optimizers`, `batch` (the last training micro-batch, as the model takes it), `output_dir`, the
    processes (`world_size`, `is_main`, `broadcast`: rank 0's value on every rank), and where figures go:
    `log` (with the step's training log), `report` (logged at once, as an entry of its own), `figure` (a
    matplotlib figure, where the logger takes one; None where none does), `stop` (end training after
    this step).

    Under several processes a method that gives the model new parameters during training (fresh
    `nn.Parameter`s of other shapes, the optimizers moved onto them: a removal of heads) calls `rewrap()`:
    the adapter rebuilds its engine's data-parallel wrapper (DDP) around the model, on every process at
    the same step, since torch forbids changing parameters under a live wrapper. `rewrap` is None where the
    engine offers no safe way (a sharded model, DeepSpeed); `engine` names the engine for the method's error.

    Example:
        >>> loop = Loop(step=3)
        >>> loop.broadcast({0: [1]}), loop.is_main, loop.optimizers, loop.rewrap, loop.engine
        ({0: [1]}, True, [], None, 'a loop of your own')
    """

    step: int = 0
    epoch: int = 0
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    batch: Any = None
    output_dir: Path | None = None
    world_size: int = 1
    is_main: bool = True
    broadcast: Callable[[Any], Any] = _same
    log: Callable[[Mapping[str, float]], None] = _no_log
    report: Callable[[Mapping[str, float]], None] = _no_log
    figure: Callable[[str, Any], None] | None = None
    stop: Callable[[], None] = _no_stop
    rewrap: Callable[[], None] | None = None
    engine: str = "a loop of your own"


class Method:
    """Base of every method object: its name, its training length, its checkpoint state, and the events
    of training, each a no-op here (see the module docstring).

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
    layers: tuple[int, ...] | None = ()  # the layers a loss term reads (captured for it); None: all
    inputs = False  # the term reads what the layers received (`LayerInputs`), not probabilities
    batch_keys: tuple[str, ...] = ()  # batch entries the method reads that the model must not receive
    depends_on_batch = True  # False: a term of the parameters alone (a gate penalty), which no split of a batch changes

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
        self.hub = attach(model)
        self.model = self.hub.model  # the transformers model (inside a PEFT model, say)
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

    # -- events (see the module docstring) ------------------------------------------------------------
    def configure_optimizer(
        self, model: nn.Module
    ) -> tuple[torch.optim.Optimizer, Callable[[int], float] | None] | None:
        """(the optimizer over `model`, its learning-rate factor per optimizer step or None), for a method
        that builds the optimizer; None for the others."""
        return None

    def on_fit_start(self, loop: Loop) -> None:
        """Training starts: the length is fixed and the optimizers exist."""

    def on_step_begin(self, loop: Loop) -> None:
        """Before optimizer step `loop.step`, once (whatever the gradient accumulation)."""

    def term(self, record: Any, batch: Any, step: int) -> tuple[torch.Tensor, dict[str, Any]] | None:
        """(the weighted loss term of a micro-batch, figures to log), or None for a method without one.
        `record` holds what the hub captured of `layers` in the micro-batch's forward."""
        return None

    def items(self, batch: Any) -> int | Mapping[str, int] | None:
        """How many items (query rows, tokens) the term of `batch` is a mean over, for a term that is one; None
        for the others. An adapter that sees an optimizer step's micro-batches ahead (the `Trainer`) weighs
        each micro-batch's term by its share of the step's items, over processes too (`Runner.window`).
        A term that combines several means (one per layer, say) counts each: `{part: items}`, the same parts for
        every batch and process; it is then handed the step's totals in `weigh` and weighs each part itself."""
        return None

    def weigh(self, items: Mapping[str, float] | None, parts: int) -> None:
        """For a term whose `items` are per part: `items`, each part's items over the micro-batches of the optimizer
        step to come (all processes), and `parts`, how many micro-batches times processes share them, so that each
        micro-batch's term is `parts` times its share of the step's mean; None once the step is over (then each
        micro-batch's term is its own mean). Nothing by default."""

    def on_before_optimizer_step(self, loop: Loop) -> None:
        """The gradients of optimizer step `loop.step` are complete; the optimizer has not stepped."""

    def on_step_end(self, loop: Loop) -> None:
        """Optimizer step done; `loop.step` counts it."""

    def on_epoch_begin(self, loop: Loop) -> None:
        """Epoch `loop.epoch` (0-based) begins."""

    def on_epoch_end(self, loop: Loop) -> None:
        """`loop.epoch` epochs are done."""

    def on_fit_end(self, loop: Loop) -> None:
        """Training is over (not called when it failed)."""

    def teardown(self) -> None:
        """After training, whatever happened: undo what must not outlive it (nothing by default)."""

    @property
    def active(self) -> bool:
        """Whether the loss term still acts (a method may end it: gates folded at the last removal)."""
        return True

    @property
    def has_term(self) -> bool:
        """Whether the method adds a loss term (its class defines `term`)."""
        return type(self).term is not Method.term

    def progress(self, step: int) -> float:
        """Training progress at optimizer step `step` (`attnreg.progress`)."""
        return self.length.progress(step)

    # -- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.length.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.length.load_state_dict(state)

    @property
    def state_key(self) -> str:
        """A method is no Lightning callback (Lightning reads `state_key` of each callback first): an error naming the
        callback of the same name, which hands the method to the runner.

        Example:
            >>> from attnreg.methods import EntropyRegularizer
            >>> EntropyRegularizer().state_key
            Traceback (most recent call last):
            ...
            TypeError: EntropyRegularizer is an attnreg method object, not a Lightning callback: in ...
        """
        name = type(self).__name__
        ours = type(self).__module__.startswith("attnreg.methods")
        callback = f"its callback attnreg.{name}(...)" if ours else "attnreg.MethodCallback(method)"
        raise TypeError(
            f"{name} is {'an attnreg' if ours else 'a'} method object, not a Lightning callback: in "
            f"lightning.Trainer(callbacks=[...]) give {callback}; method objects go to the Hugging Face Trainer "
            "(AttnRegTrainer(methods=[...])) and to Runner"
        )

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
