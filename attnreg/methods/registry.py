"""The built-in methods, each declared once, by `@register_method(...)` on its class: its name (the config, log and
checkpoint name, the class's `default_name`), its class, its Lightning callback's name (the class's), whether it has
a Hydra config (`attnreg/app/configs/attnreg/<name>.yaml`), its documentation page and what the app must know of it.
The rest reads this table: `attnreg.methods` exports each class, `attnreg.callbacks` gives each its drop-in
callback, `attnreg` its Lightning name, `attnreg.app.settings` its flags, and a test checks every promise.

Example:
    >>> from attnreg import methods
    >>> entry = entry_of(methods.HeadGating(name="gates"))
    >>> entry.name, entry.callback, entry.config, entry.docs, entry.removes_heads
    ('head_gating', 'HeadGating', True, 'methods/pruning.md', True)
    >>> [entry.name for entry in method_entries() if not entry.config]    # they take objects (a function, batches)
    ['attention_loss', 'freeze_layers', 'head_importance']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from attnreg.methods.base import Method

M = TypeVar("M", bound=type[Method])


@dataclass(frozen=True)
class MethodEntry:
    """One built-in method: `method_class`, its page under `docs/` (`docs`), whether it has a Hydra config (`config`),
    and the flags the app reads: `removes_heads` (the app keeps the model before training to compare with, and saves
    the smaller one), `gates_heads` (its `removal.protect` keeps the heads a syntax prior supervises)."""

    method_class: type[Method]
    docs: str
    config: bool = True
    removes_heads: bool = False
    gates_heads: bool = False

    @property
    def name(self) -> str:
        """Its config, log and checkpoint name: `attnreg=<name>`, `attnreg/<name>`."""
        return self.method_class.default_name

    @property
    def callback(self) -> str:
        """Its Lightning callback's name, the method class's: `attnreg.<callback>`."""
        return self.method_class.__name__

    @property
    def needs(self) -> frozenset[str]:
        """What it needs from the data or the app (the class's `needs`)."""
        return self.method_class.needs


ENTRIES: dict[str, MethodEntry] = {}


def register_method(docs: str, **flags: Any) -> Callable[[M], M]:
    """Declare a built-in method (a class decorator): its documentation page (under `docs/`) and the `MethodEntry`
    flags (`config=False` for one without a Hydra config). A name registered twice is an error.

    Example:
        >>> @register_method(docs="methods/your-own.md", config=False)
        ... class Sharpen(Method):
        ...     default_name = "sharpen"
        >>> ENTRIES.pop("sharpen").callback
        'Sharpen'
    """

    def register(method_class: M) -> M:
        entry = MethodEntry(method_class, docs, **flags)
        held = ENTRIES.get(entry.name)
        if held is not None and held.method_class.__qualname__ != method_class.__qualname__:
            raise ValueError(f"{method_class.__name__}: the method name {entry.name!r} is {held.callback}'s")
        ENTRIES[entry.name] = entry
        return method_class

    return register


def method_entries() -> list[MethodEntry]:
    """Every built-in method's entry, by name."""
    return [ENTRIES[name] for name in sorted(ENTRIES)]


def entry_of(method: Method | type[Method]) -> MethodEntry | None:
    """The entry of a method (or method class) or of the built-in method it subclasses; None for a method of one's own.

    Example:
        >>> from attnreg import methods
        >>> entry_of(methods.SyntaxPriorKL).needs, entry_of(methods.Method)
        (frozenset({'prior'}), None)
    """
    kind = method if isinstance(method, type) else type(method)
    classes = {entry.method_class: entry for entry in ENTRIES.values()}
    return next((classes[base] for base in kind.__mro__ if base in classes), None)
