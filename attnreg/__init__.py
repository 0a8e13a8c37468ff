"""attnreg: steer what attention heads do while fine-tuning transformers with Lightning.

Example:
    >>> import attnreg
    >>> hub = attnreg.attach(model)          # any supported BERT- or GPT-style model
    >>> with hub.capture(layers=[0]) as probs:
    ...     model(**batch)
    >>> probs[0]                             # [batch, heads, queries, keys], with autograd graph
"""

from attnreg import analysis, pruning, schedules, syntax
from attnreg.callbacks import (
    AttentionDropoutSchedule,
    AttentionLoss,
    AttentionMonitor,
    EntropyRegularizer,
    FreezeLayers,
    HeadGating,
    HeadImportance,
    LayerwiseLR,
    SyntaxPriorKL,
)
from attnreg.families import FAMILIES, Family, UnsupportedModelError, detect_family
from attnreg.hub import AttentionHub, AttentionRecord, LayerInfo, attach, detach, hub_of
from attnreg.mixin import AttentionTerm, AttnRegMixin
from attnreg.optim import layerwise_param_groups

__all__ = [
    "AttentionDropoutSchedule",
    "AttentionHub",
    "AttentionLoss",
    "AttentionMonitor",
    "AttentionRecord",
    "AttentionTerm",
    "AttnRegMixin",
    "EntropyRegularizer",
    "FAMILIES",
    "Family",
    "FreezeLayers",
    "HeadGating",
    "HeadImportance",
    "LayerInfo",
    "LayerwiseLR",
    "SyntaxPriorKL",
    "UnsupportedModelError",
    "analysis",
    "attach",
    "detach",
    "detect_family",
    "hub_of",
    "pruning",
    "layerwise_param_groups",
    "schedules",
    "syntax",
]
