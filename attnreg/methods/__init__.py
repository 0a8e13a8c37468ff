"""Method objects: each attnreg method's settings, state and per-step decisions, with no training
framework inside, all answering one protocol of training events (`Method`, `Loop`); `Runner` does for any
set of them what every adapter needs. `attnreg.callbacks` (Lightning) and `attnreg.integrations.hf` (the
Hugging Face `Trainer`) are thin adapters over them.

Every module and folder here is imported, and each built-in method it declares (`registry.register_method`) is
exported under its class's name: a method added in a module or folder of its own needs no line here.

Example:
    >>> from attnreg import methods
    >>> entropy = methods.EntropyRegularizer(mode="max", weight=0.01)
    >>> kl = methods.SyntaxPriorKL(heads={0: [3], 1: [4]})
    >>> methods.entry_of(methods.HeadGating).name, methods.BUILT_IN["HeadGating"] is methods.HeadGating
    ('head_gating', True)
"""

import importlib
import pkgutil

from attnreg import deprecations
from attnreg.methods.base import Loop, Method, free_name
from attnreg.methods.dropout import hidden_dropout_modules
from attnreg.methods.loss_term import LossTerm
from attnreg.methods.monitor import EntropyCollapseWarning, MonitorCheck
from attnreg.methods.pruning.gate_kinds import GateKind, HardConcreteGates, L1Gates, PruningRound, Removal
from attnreg.methods.registry import MethodEntry, entry_of, method_entries, register_method
from attnreg.methods.runner import Captured, Runner

for _folder in pkgutil.iter_modules(__path__):  # each method registers itself on import
    importlib.import_module(f"{__name__}.{_folder.name}")
BUILT_IN = {entry.callback: entry.method_class for entry in method_entries()}
"""{class name: class} of the built-in methods (`registry`), each exported here under its name."""
globals().update(BUILT_IN)

RENAMED = deprecations.renamed("name", "attnreg.methods.")
"""Old method names (`attnreg.deprecations`), still importable until the release that removes them, with a
`FutureWarning` (shown by Python's default filters, unlike a `DeprecationWarning` raised outside `__main__`) naming the
new one and that release."""


def __getattr__(name: str):
    """The renamed methods' old names (`attnreg.methods.PriorKL` is `SyntaxPriorKL`), with a warning.

    Example:
        >>> import warnings
        >>> from attnreg import methods
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     kl = methods.PriorKL
        >>> kl is methods.SyntaxPriorKL
        True
        >>> print(caught[0].message)
        attnreg.methods.PriorKL is deprecated: use attnreg.methods.SyntaxPriorKL (the same method); it will be removed
        in 0.3.0
    """
    if name in RENAMED:
        deprecations.warn(f"attnreg.methods.{name}", stacklevel=2)
        return globals()[RENAMED[name]]
    raise AttributeError(f"module 'attnreg.methods' has no attribute {name!r}")


__all__ = [
    *BUILT_IN,
    "Captured",
    "EntropyCollapseWarning",
    "GateKind",
    "HardConcreteGates",
    "L1Gates",
    "Loop",
    "LossTerm",
    "Method",
    "MethodEntry",
    "MonitorCheck",
    "PruningRound",
    "Removal",
    "Runner",
    "entry_of",
    "free_name",
    "hidden_dropout_modules",
    "method_entries",
    "register_method",
]
