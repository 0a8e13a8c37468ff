"""Lightning callbacks: thin adapters that decide *when* attnreg's functions run.

Example:
    >>> trainer = lightning.Trainer(callbacks=[attnreg.EntropyRegularizer(mode="max", weight=0.01)])
"""

from attnreg.callbacks.dropout import AttentionDropoutSchedule
from attnreg.callbacks.monitor import AttentionMonitor, EntropyCollapseWarning
from attnreg.callbacks.optim import FreezeLayers, LayerwiseLR
from attnreg.callbacks.pruning import HeadGating, HeadImportance
from attnreg.callbacks.regularizers import AttentionLoss, EntropyRegularizer, SyntaxPriorKL

__all__ = [
    "AttentionDropoutSchedule",
    "AttentionLoss",
    "AttentionMonitor",
    "EntropyCollapseWarning",
    "EntropyRegularizer",
    "FreezeLayers",
    "HeadGating",
    "HeadImportance",
    "LayerwiseLR",
    "SyntaxPriorKL",
]
