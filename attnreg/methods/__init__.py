"""Method objects: each attnreg method's settings, state and per-step decisions, with no training
framework inside, all answering one protocol of training events (`Method`, `Loop`); `Runner` does for any
set of them what every adapter needs. `attnreg.callbacks` (Lightning) and `attnreg.integrations.hf` (the
Hugging Face `Trainer`) are thin adapters over them.

Example:
    >>> from attnreg import methods
    >>> entropy = methods.Entropy(mode="max", weight=0.01)
    >>> kl = methods.PriorKL(heads={0: [3], 1: [4]})
"""

from attnreg.methods.base import Loop, Method, free_name
from attnreg.methods.dropout import DropoutSchedule, hidden_dropout_modules
from attnreg.methods.layerwise_lr import FreezeLayers, LayerwiseLR
from attnreg.methods.monitor import EntropyCollapseWarning, Monitor, MonitorCheck
from attnreg.methods.pruning.importance import HeadImportance
from attnreg.methods.pruning.method import HardConcreteGates, HeadGating, L1Gates, PruningRound, Removal
from attnreg.methods.regularizers import AttentionPenalty, Entropy, LossTerm, PriorKL
from attnreg.methods.runner import Captured, Runner

__all__ = [
    "AttentionPenalty",
    "Captured",
    "DropoutSchedule",
    "Entropy",
    "EntropyCollapseWarning",
    "FreezeLayers",
    "HardConcreteGates",
    "HeadGating",
    "HeadImportance",
    "L1Gates",
    "LayerwiseLR",
    "Loop",
    "LossTerm",
    "Method",
    "Monitor",
    "MonitorCheck",
    "PriorKL",
    "PruningRound",
    "Removal",
    "Runner",
    "free_name",
    "hidden_dropout_modules",
]
