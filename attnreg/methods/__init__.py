"""Method objects: each attnreg method's settings, state and per-step decisions, with no training
framework inside, all answering one protocol of training events (`Method`, `Loop`); `Runner` does for any
set of them what every adapter needs. `attnreg.callbacks` (Lightning) and `attnreg.integrations.hf` (the
Hugging Face `Trainer`) are thin adapters over them.

Example:
    >>> from attnreg import methods
    >>> entropy = methods.EntropyRegularizer(mode="max", weight=0.01)
    >>> kl = methods.SyntaxPriorKL(heads={0: [3], 1: [4]})
"""

from attnreg import deprecations
from attnreg.methods.base import Loop, Method, free_name
from attnreg.methods.distillation import Distillation
from attnreg.methods.dropout import AttentionDropoutSchedule, hidden_dropout_modules
from attnreg.methods.entropy import EntropyRegularizer
from attnreg.methods.layerwise_lr import FreezeLayers, LayerwiseLR
from attnreg.methods.loss_term import AttentionLoss, LossTerm
from attnreg.methods.monitor import AttentionMonitor, EntropyCollapseWarning, MonitorCheck
from attnreg.methods.pruning.gate_kinds import GateKind, HardConcreteGates, L1Gates, PruningRound, Removal
from attnreg.methods.pruning.importance import HeadImportance, ImportanceRemoval
from attnreg.methods.pruning.method import HeadGating
from attnreg.methods.runner import Captured, Runner
from attnreg.methods.syntax_prior import SyntaxPriorKL

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
    "AttentionDropoutSchedule",
    "AttentionLoss",
    "AttentionMonitor",
    "Captured",
    "Distillation",
    "EntropyCollapseWarning",
    "EntropyRegularizer",
    "FreezeLayers",
    "HardConcreteGates",
    "HeadGating",
    "HeadImportance",
    "ImportanceRemoval",
    "GateKind",
    "L1Gates",
    "LayerwiseLR",
    "Loop",
    "LossTerm",
    "Method",
    "MonitorCheck",
    "PruningRound",
    "Removal",
    "Runner",
    "SyntaxPriorKL",
    "free_name",
    "hidden_dropout_modules",
]
