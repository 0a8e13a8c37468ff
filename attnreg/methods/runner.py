"""The runner: what every adapter would otherwise repeat, for any set of methods, in no framework.

It binds the methods to one model under names no two share, builds the optimizer where a method does,
captures the union of the layers the loss terms read, sums the terms of a micro-batch and keeps their
figures for the log, sends each training event to every method, and gathers and restores their
checkpoint state. An adapter (Lightning, the Hugging Face `Trainer`, a loop of your own) creates one and
calls it at its framework's events, with a `Loop` saying where the run stands.

A loop of your own (the methods, unchanged, in plain PyTorch):

Example:
    >>> import torch
    >>> from attnreg import methods
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("gpt2", head="causal_lm")
    >>> batches = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 99, (4, 2, 8))]
    >>> runner = Runner([methods.EntropyRegularizer(mode="max", weight=0.1), methods.AttentionDropoutSchedule(0.1)])
    >>> runner.bind(model)
    >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> loop = methods.Loop(optimizers=[optimizer])
    >>> runner.start(len(batches)); runner.fit_start(loop)
    >>> for batch in batches:
    ...     runner.step_begin(loop)
    ...     with runner.capture(model) as captured:
    ...         loss = model(**runner.model_inputs(batch)).loss
    ...     loss = loss + runner.loss(captured, batch, loop.step)
    ...     loss.backward()
    ...     runner.before_optimizer_step(loop)
    ...     optimizer.step(); optimizer.zero_grad()
    ...     loop.step += 1
    ...     runner.step_end(loop)
    >>> runner.fit_end(loop); runner.teardown()
    >>> sorted(runner.figures())                    # means since the last call, for a log
    ['attnreg/entropy_regularizer', 'attnreg/entropy_regularizer/layer0', 'attnreg/entropy_regularizer/layer1']
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from attnreg.hub import attach, detach, is_attached
from attnreg.methods.base import Loop, Method
from attnreg.records import AttentionRecord
from attnreg.structure import StructureRecord, record_of, restore_record, write_record

STATE_FILE = "attnreg_state.json"
"""The methods' state in a checkpoint folder (`Runner.save_state`)."""


@dataclass(frozen=True)
class Captured:
    """What the hub recorded in one micro-batch's forward: probabilities, and the layers' inputs (for
    the blockwise losses); None outside training (nothing captured, no term)."""

    probs: AttentionRecord | None
    inputs: AttentionRecord | None


class Runner:
    """Runs `methods` through one training (see the module docstring).

    Example:
        >>> from attnreg import methods
        >>> from attnreg.tiny import tiny_model
        >>> entropy = [methods.EntropyRegularizer(layers=[0]), methods.EntropyRegularizer(layers=[1])]
        >>> runner = Runner([*entropy, methods.SyntaxPriorKL(heads={1: [0]})])
        >>> runner.bind(tiny_model("bert"))
        >>> [method.name for method in runner.methods], runner.capture_layers(inputs=True), runner.batch_keys
        (['entropy_regularizer', 'entropy_regularizer_2', 'syntax_prior_kl'], (0, 1), ('attnreg_prior',))
        >>> Runner([methods.LayerwiseLR(lr=1e-3), methods.LayerwiseLR(lr=1e-4)])
        Traceback (most recent call last):
        ...
        ValueError: give at most one method that builds the optimizer; got ['LayerwiseLR', 'LayerwiseLR']
    """

    def __init__(self, methods: Sequence[Method] = ()) -> None:
        self.methods: list[Method] = []
        self.model: nn.Module | None = None
        self._figures: dict[str, list[float]] = {}
        self._seen: list[Any] = []  # the micro-batches with terms since the last optimizer step
        self._window: dict[str, Any] = {}  # items of each term (per part) over the step's micro-batches, all processes
        self._parts = 1  # micro-batches x processes of that step
        self._warned_uneven = False
        self._said_uneven = False
        _check(list(methods))
        for method in methods:
            self.add(method)

    # -- binding, optimizer, length ----------------------------------------------------------------------
    def add(self, method: Method) -> None:
        """Run `method` too (bound at once where the runner is bound); a method already here is left as it is.

        Example:
            >>> from attnreg import methods
            >>> runner = Runner([methods.LayerwiseLR(lr=1e-3)])
            >>> runner.add(methods.LayerwiseLR(lr=1e-4))
            Traceback (most recent call last):
            ...
            ValueError: give at most one method that builds the optimizer; got ['LayerwiseLR', 'LayerwiseLR']
        """
        if any(method is held for held in self.methods):
            return
        _check([*self.methods, method])
        self.methods.append(method)
        if self.model is not None:
            self.bind(self.model)

    def remove(self, method: Method | str) -> None:
        """Stop running `method` (or the method of that name)."""
        self.methods = [m for m in self.methods if not (m is method or m.name == method)]

    def bind(self, model: nn.Module) -> None:
        """Bind every method not bound yet to `model`, each under a name no other holds. A method that refuses
        (a bad setting for this model) leaves the model as it was: the methods bound here let go, and a model
        that was not attached is detached (its attention implementation back).

        Example:
            >>> from attnreg import methods
            >>> from attnreg.hub import is_attached
            >>> from attnreg.tiny import tiny_model
            >>> model = tiny_model("bert")
            >>> Runner([methods.SyntaxPriorKL(heads={5: [0]})]).bind(model)
            Traceback (most recent call last):
            ...
            IndexError: SyntaxPriorKL: heads={5: [0]} names layers out of range: BertModel has 2 attention layers ...
            >>> is_attached(model), model.config._attn_implementation
            (False, 'sdpa')
        """
        attached = is_attached(model)
        bound: list[Method] = []
        try:
            attach(model)
            taken = {method.name for method in self.methods if method.model is not None}
            for method in self.methods:
                if method.model is None:
                    bound.append(method)
                    method.bind(model, taken)
                    taken.add(method.name)
        except BaseException:
            for method in bound:
                method.unbind()
            if not attached and is_attached(model):
                detach(model)
            raise
        self.model = model

    @property
    def batch_keys(self) -> tuple[str, ...]:
        """Batch entries the methods read that the model must not receive."""
        return tuple(dict.fromkeys(key for method in self.methods for key in method.batch_keys))

    def model_inputs(self, batch: Any) -> Any:
        """`batch` without the entries only the methods read."""
        if not isinstance(batch, Mapping):
            return batch
        return {key: value for key, value in batch.items() if key not in self.batch_keys}

    def optimizer(self, model: nn.Module) -> tuple[torch.optim.Optimizer, Any] | None:
        """(optimizer, learning-rate factor per step or None) from the method that builds it, else None."""
        for method in self.methods:
            built = method.configure_optimizer(model)
            if built is not None:
                return built
        return None

    def start(self, estimated_steps: float) -> None:
        """Fix every method's training length (`estimated_steps`: the trainer's estimate, inf if unknown)."""
        for method in self.methods:
            method.start(float(estimated_steps))

    # -- loss terms --------------------------------------------------------------------------------------
    @property
    def terms(self) -> list[Method]:
        return [method for method in self.methods if method.has_term and method.active]

    def capture_layers(self, inputs: bool) -> tuple[int, ...] | None:
        """The layers the terms read probabilities of (`inputs=False`) or inputs of (None: all)."""
        layers: set[int] = set()
        for method in self.terms:
            if bool(method.inputs) != inputs:
                continue
            if method.layers is None:
                return None
            layers.update(method.layers)
        return tuple(sorted(layers))

    @contextmanager
    def capture(self, model: nn.Module, training: bool | None = None) -> Iterator[Captured]:
        """Capture what the terms read during the forward passes in the block; nothing outside training
        (`training`, by default `model.training` and autograd on), so other forwards are never penalised."""
        if training is None:
            training = model.training and torch.is_grad_enabled()
        if not (training and self.terms):
            yield Captured(None, None)
            return
        hub = attach(model)
        with (  # a forward under no_grad inside (a trainer's metrics pass) is not the training forward: left out
            hub.capture(self.capture_layers(False), require_grad=True, skip_no_grad=True) as probs,
            hub.capture(self.capture_layers(True), require_grad=True, inputs=True, skip_no_grad=True) as inputs,
        ):
            yield Captured(probs, inputs)

    def loss(self, captured: Captured, batch: Any, step: int, scale: float = 1.0) -> torch.Tensor | float:
        """The sum of the terms of one micro-batch at optimizer step `step`, each times `scale`; their
        figures (unscaled) are kept for `figures()`. 0 when nothing was captured."""
        if captured.probs is None:
            return 0.0
        self._seen.append(batch)  # counted at the optimizer step, where it matters (`_check_even`)
        total: torch.Tensor | float = 0.0
        for method in self.terms:
            result = method.term(captured.inputs if method.inputs else captured.probs, batch, step)
            if result is None:
                continue
            value, figures = result
            value = full_value(value)
            if not isinstance(value, torch.Tensor) or value.dim() != 0:
                raise TypeError(f"the term of {method.name!r} must return a scalar tensor, got {value!r}")
            share, window = 1.0, self._window.get(method.name)
            if isinstance(window, float) and window:  # this micro-batch's items against the step's mean
                share = method.items(batch) * self._parts / window
            total = total + value * (scale * share)
            self.record({method.name: value.detach(), **{name: full_value(figure) for name, figure in figures.items()}})
        return total

    def window(self, batches: Sequence[Any], world_size: int = 1, all_reduce: Any = None) -> None:
        """Before the micro-batches `batches` of one optimizer step run: count the items each term is a mean over
        (`Method.items`) in all of them, summed over the processes by `all_reduce` (in place, on a float64
        tensor), so that each micro-batch's term weighs by its share of the step's items, as transformers'
        `num_items_in_batch` does for the model's loss: the weight then means the same however the global batch
        is split over micro-batches and processes, rows of any length. `loss` applies it until the optimizer steps; a
        term counted per part (`{part: items}`) is handed its parts' totals (`Method.weigh`) and weighs them itself.

        Example:
            >>> from attnreg import methods
            >>> from attnreg.tiny import tiny_model
            >>> runner = Runner([methods.EntropyRegularizer(mode="max", normalize=False)])
            >>> runner.bind(tiny_model("bert"))
            >>> ids = torch.ones(1, 4, dtype=torch.long)
            >>> short, long = {"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 0, 0]])}, {"input_ids": ids}
            >>> runner.window([short, long]); runner._window, runner._parts       # rows: 2 + 4, two micro-batches
            ({'entropy_regularizer': 6.0}, 2)
        """
        counts: dict[tuple[str, str | None], float] = {}  # (method, part or None): items
        for method in self.terms:
            found = [method.items(batch) for batch in batches]
            if not found or any(count is None for count in found):
                continue
            for count in found:
                for part, items in count.items() if isinstance(count, Mapping) else [(None, count)]:
                    counts[method.name, part] = counts.get((method.name, part), 0.0) + float(items)
        if all_reduce is not None and counts:  # every process holds the same terms and parts, in the same order
            summed = torch.tensor(list(counts.values()), dtype=torch.float64)
            all_reduce(summed)
            counts = dict(zip(counts, summed.tolist(), strict=True))
        window: dict[str, Any] = {}
        for (name, part), items in counts.items():
            if part is None:
                window[name] = items
            else:
                window.setdefault(name, {})[part] = items
        self._window, self._parts = window, len(batches) * world_size
        for method in self.terms:
            parts = window.get(method.name)
            if isinstance(parts, dict):
                method.weigh(parts, self._parts)

    def record(self, figures: Mapping[str, Any]) -> None:
        """Keep figures (`attnreg/<name>`) for the next `figures()`."""
        for name, value in figures.items():
            self._figures.setdefault(f"attnreg/{name}", []).append(float(value))

    def figures(self) -> dict[str, float]:
        """The mean of each figure kept since the last call."""
        means = {name: sum(values) / len(values) for name, values in self._figures.items()}
        self._figures = {}
        return means

    # -- events ------------------------------------------------------------------------------------------
    def fit_start(self, loop: Loop) -> None:
        for method in self.methods:
            method.on_fit_start(loop)

    def step_begin(self, loop: Loop) -> None:
        for method in self.methods:
            method.on_step_begin(loop)

    def before_optimizer_step(self, loop: Loop) -> None:
        self._check_even(loop)
        for method in self.methods:
            method.on_before_optimizer_step(loop)

    def _check_even(self, loop: Loop) -> None:
        """Warn once where a term that reads the batch was not weighed by its share of the step's items (`window`: no
        adapter counted them ahead, or the term is no mean over items) and the micro-batches of the optimizer step,
        over accumulation and processes, differ in what it averages over: its items (per part), or for a term that
        counts none, the real tokens. Its weight then depends on how the global batch was split (docs/guarantees.md).
        Every process learns every one's counts (`torch.distributed`); the main process says it."""
        batches, self._seen = self._seen, []
        counted, self._window = self._window, {}
        for method in self.methods:
            if isinstance(counted.get(method.name), dict):
                method.weigh(None, 1)  # the step is over
        uncounted = [method for method in self.terms if method.name not in counted and method.depends_on_batch]
        if not uncounted or self._warned_uneven or (len(batches) < 2 and loop.world_size < 2):
            return  # the same on every process (the window's counts and the terms are), so no collective is left out
        mine: dict[str, Any] = {"tokens": [_tokens(batch) for batch in batches]}
        for method in uncounted:
            found = [method.items(batch) for batch in batches]
            mine[method.name] = None if any(count is None for count in found) else [_plain(c) for c in found]
        every, complete = _gather(mine, loop)
        tokens = [count for each in every for count in each["tokens"]]
        uneven, shown = [], ""
        for method in uncounted:
            counts = [each.get(method.name) for each in every]
            found = tokens if any(c is None for c in counts) else [count for c in counts for count in c]
            if any(count != found[0] for count in found):
                uneven.append(method.name)
                shown += "" if found is tokens else f"; {method.name!r} averages over {found}"
        if not uneven:
            return
        self._warned_uneven = complete  # where every process knows, none gathers again (else all keep gathering)
        if (loop.is_main or not complete) and not self._said_uneven:
            self._said_uneven = True
            warnings.warn(
                f"the micro-batches of optimizer step {loop.step} (over accumulation and processes) differ in what "
                f"the terms of {uneven} average over (real tokens per micro-batch {tokens}{shown}): each term is a "
                "mean over one micro-batch (then averaged over the accumulation steps and processes), so its weight "
                "depends on how the global batch is split; for weights that do not, let the adapter count the step's "
                "items ahead (`Runner.window`, as the Hugging Face Trainer does), give the micro-batches equal "
                "lengths and rows (pack or pad to a fixed length) or use one micro-batch per step on one process "
                "(docs/guarantees.md)",
                UnevenMicroBatchesWarning,
                stacklevel=2,
            )

    def step_end(self, loop: Loop) -> None:
        for method in self.methods:
            method.on_step_end(loop)

    def epoch_begin(self, loop: Loop) -> None:
        for method in self.methods:
            method.on_epoch_begin(loop)

    def epoch_end(self, loop: Loop) -> None:
        for method in self.methods:
            method.on_epoch_end(loop)

    def fit_end(self, loop: Loop) -> None:
        for method in self.methods:
            method.on_fit_end(loop)

    def teardown(self) -> None:
        for method in self.methods:
            method.teardown()

    # -- the model's structure: the checkpoint event before the weights ---------------------------------------
    def structure(self) -> dict[str, Any]:
        """The model's structure record (`attnreg.structure.record_of`: heads removed or silenced, the gates and their
        values, the model's sizes) as checkpoint entries: what a checkpoint carries so that a resume rebuilds it
        before the weights load (`restore_structure`).

        Example:
            >>> from attnreg import methods
            >>> from attnreg.tiny import tiny_model
            >>> runner = Runner([methods.HeadGating(methods.L1Gates(), layers=[1])])
            >>> runner.bind(tiny_model("bert"))
            >>> runner.structure()["attnreg_gates"]
            {'1': [1.0, 1.0, 1.0, 1.0]}
        """
        return record_of(self._transformers_model()).to_checkpoint()

    def restore_structure(self, record: Mapping[str, Any]) -> None:
        """Rebuild the structure a checkpoint recorded (`structure`) on the bound model, before its weights load
        (`attnreg.structure.restore_record`); a checkpoint of another model, or one its weights contradict, is
        refused, saying so, with the model unchanged."""
        restore_record(self._transformers_model(), record)

    def save_structure(self, folder: str | Path, structure: Mapping[str, Any] | None = None) -> None:
        """Write the structure record (`structure()` unless given) beside the weights of a checkpoint folder
        (`attnreg.structure.write_record`), which `load_structure` and `attnreg.methods.pruning.load_pruned` read."""
        record = None if structure is None else StructureRecord.from_dict(structure)
        write_record(self._transformers_model(), folder, record)

    def load_structure(self, folder: str | Path) -> None:
        """Rebuild the structure a checkpoint folder recorded (`save_structure`, or an older attnreg's files) before
        its weights load (`attnreg.structure.restore_record`)."""
        restore_record(self._transformers_model(), folder)

    def _transformers_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("Runner: bind(model) first")
        return attach(self.model).model  # the transformers model (inside a PEFT model, say)

    # -- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every method's state, by name."""
        return {method.name: method.state_dict() for method in self.methods}

    def save_state(self, folder: str | Path) -> None:
        """Write every method's state into a checkpoint folder (`attnreg_state.json`), for `load_state`.

        Example:
            >>> import tempfile
            >>> from attnreg import methods
            >>> runner, folder = Runner([methods.EntropyRegularizer()]), tempfile.mkdtemp()
            >>> runner.save_state(folder); sorted(json.loads(Path(folder, STATE_FILE).read_text()))
            ['entropy_regularizer']
            >>> Runner([methods.AttentionDropoutSchedule(0.1)]).load_state(folder)
            Traceback (most recent call last):
            ...
            KeyError: ".../attnreg_state.json has no state for the method 'attention_dropout_schedule' (it has ...
        """
        Path(folder, STATE_FILE).write_text(json.dumps(self.state_dict(), indent=2) + "\n")

    def load_state(self, folder: str | Path) -> None:
        """Restore every method's state from a checkpoint folder (`save_state`); a folder without it is refused."""
        path = Path(folder, STATE_FILE)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: the checkpoint was not written with attnreg's runner (AttnRegTrainer writes it "
                "with every checkpoint), so the attnreg methods' state (training length, and with it every "
                "schedule) cannot be restored"
            )
        self.load_state_dict(json.loads(path.read_text()), str(path))

    def load_state_dict(self, state: Mapping[str, Any], source: str = "the checkpoint") -> None:
        """Restore every method's state; a method without state in `state` is an error naming `source`."""
        for method in self.methods:
            if method.name not in state:
                raise KeyError(f"{source} has no state for the method {method.name!r} (it has {sorted(state)})")
            method.load_state_dict(state[method.name])


class UnevenMicroBatchesWarning(UserWarning):
    """The micro-batches of one optimizer step differ in real tokens, so a term's weight depends on the split.

    Example:
        >>> issubclass(UnevenMicroBatchesWarning, UserWarning)
        True
    """


def _check(methods: list[Method]) -> None:
    for method in methods:
        if not isinstance(method, Method):
            inner = getattr(method, "method", None)  # a Lightning callback holds its method
            hint = (
                f"; {type(method).__name__} is a Lightning callback: give attnreg.methods.{type(inner).__name__}(...) "
                "(or the callback's .method)"
                if isinstance(inner, Method)
                else ""
            )
            raise TypeError(f"methods must be attnreg.methods.Method objects, got {type(method).__name__}{hint}")
    builders = [type(m).__name__ for m in methods if type(m).configure_optimizer is not Method.configure_optimizer]
    if len(builders) > 1:
        raise ValueError(f"give at most one method that builds the optimizer; got {builders}")


def broadcast_object(value: Any) -> Any:
    """Rank 0's `value` on every process (`torch.distributed`, as torchrun or accelerate set it up); `value` itself
    on one process. A `Loop.broadcast` for a loop of one's own.

    Example:
        >>> broadcast_object({"heads": [1, 2]})             # one process
        {'heads': [1, 2]}
    """
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()) or distributed.get_world_size() == 1:
        return value
    box = [value]
    distributed.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_sum(tensor: torch.Tensor) -> None:
    """Sum a CPU `tensor` over the processes, in place (on the device the process group runs on): the `all_reduce`
    of `Runner.window`.

    Example:
        >>> import tempfile
        >>> store = f"file://{tempfile.mkdtemp()}/store"
        >>> torch.distributed.init_process_group("gloo", init_method=store, rank=0, world_size=1)
        >>> counts = torch.tensor([6.0, 2.0], dtype=torch.float64)
        >>> all_reduce_sum(counts); counts                  # one process: the sum is its own
        tensor([6., 2.], dtype=torch.float64)
        >>> torch.distributed.destroy_process_group()
    """
    nccl = torch.distributed.get_backend() == "nccl"
    moved = tensor.to(torch.device("cuda", torch.cuda.current_device())) if nccl else tensor
    torch.distributed.all_reduce(moved)
    tensor.copy_(moved.cpu())


def full_value(value: Any) -> Any:
    """A term or figure computed on parameters sharded by FSDP2 (a `DTensor`) as a plain full tensor,
    differentiably: what a loss adds to the model's loss and a logger all-reduces. Anything else as it is.

    Example:
        >>> value = torch.tensor(0.5)
        >>> full_value(value) is value, full_value(2.0)
        (True, 2.0)
    """
    return value.full_tensor() if isinstance(value, DTensor) else value


def _tokens(batch: Any) -> int | None:
    """The real tokens of a micro-batch (its attention mask's ones, else its ids), None where it tells none."""
    if not isinstance(batch, Mapping):
        return None
    mask, ids = batch.get("attention_mask"), batch.get("input_ids")
    if isinstance(mask, torch.Tensor):
        return int(mask.sum())
    return int(ids.numel()) if isinstance(ids, torch.Tensor) else None


def _plain(count: Any) -> Any:
    """A count of `Method.items` as plain, comparable values (a mapping as a sorted list of pairs)."""
    return sorted((str(part), float(items)) for part, items in count.items()) if isinstance(count, Mapping) else count


def _gather(value: Any, loop: Loop) -> tuple[list[Any], bool]:
    """(`value` of every process in rank order, True), by `torch.distributed`; on one process `([value], True)`.
    Without `torch.distributed` under several processes, `([rank 0's, this one's], False)` through `loop.broadcast`.

    Example:
        >>> _gather({"tokens": [3, 5]}, Loop())
        ([{'tokens': [3, 5]}], True)
    """
    if loop.world_size < 2:
        return [value], True
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1:
        every: list[Any] = [None] * distributed.get_world_size()
        distributed.all_gather_object(every, value)
        return every, True
    return [loop.broadcast(value), value], False
