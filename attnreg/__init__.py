"""attnreg: steer what attention heads do while fine-tuning transformers with Lightning.

Example:
    >>> import torch
    >>> import attnreg
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("bert")                        # any supported BERT- or GPT-style model
    >>> hub = attnreg.attach(model)
    >>> hub.family.name, hub.num_layers
    ('bert', 2)
    >>> batch = {"input_ids": torch.randint(3, 99, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    >>> with hub.capture(layers=[0]) as probs:
    ...     _ = model(**batch)
    >>> probs[0].shape, probs[0].requires_grad           # [batch, heads, queries, keys], with autograd graph
    (torch.Size([2, 4, 7, 7]), True)
    >>> torch.allclose(probs[0].sum(-1), torch.ones(2, 4, 7))
    True
"""

import importlib
import warnings

from attnreg import analysis, methods, schedules, syntax
from attnreg.callbacks import (
    AttentionDropoutSchedule,
    AttentionLoss,
    AttentionMonitor,
    Distillation,
    EntropyRegularizer,
    FreezeLayers,
    HeadGating,
    HeadImportance,
    LayerwiseLR,
    MethodCallback,
    SyntaxPriorKL,
)
from attnreg.families import FAMILIES, Family, UnsupportedModelError, detect_family
from attnreg.hub import AttentionHub, AttentionRecord, LayerInfo, attach, detach, hub_of
from attnreg.methods.layerwise_lr import layerwise_param_groups
from attnreg.mixin import AttentionTerm, AttnRegMixin

__all__ = [
    "AttentionDropoutSchedule",
    "AttentionHub",
    "AttentionLoss",
    "AttentionMonitor",
    "AttentionRecord",
    "AttentionTerm",
    "AttnRegMixin",
    "Distillation",
    "EntropyRegularizer",
    "FAMILIES",
    "Family",
    "FreezeLayers",
    "HeadGating",
    "HeadImportance",
    "LayerInfo",
    "LayerwiseLR",
    "MethodCallback",
    "SyntaxPriorKL",
    "UnsupportedModelError",
    "analysis",
    "attach",
    "detach",
    "detect_family",
    "hub_of",
    "layerwise_param_groups",
    "methods",
    "schedules",
    "syntax",
]

MOVED = {
    "pruning": "attnreg.methods.pruning",
    "optim": "attnreg.methods.layerwise_lr",
    "distill": "attnreg.methods.distillation",
}
"""Modules that moved into their method's folder; the old attribute still works for one release, with a warning."""


def __getattr__(name: str):
    """`attnreg.pruning` and the other moved modules, with a `DeprecationWarning` naming the new place.

    Example:
        >>> import warnings, attnreg
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     pruning = attnreg.pruning
        >>> pruning is attnreg.methods.pruning, str(caught[0].message)
        (True, 'attnreg.pruning is deprecated: use attnreg.methods.pruning (the same module)')
    """
    if name in MOVED:
        warnings.warn(
            f"attnreg.{name} is deprecated: use {MOVED[name]} (the same module)", DeprecationWarning, stacklevel=2
        )
        return importlib.import_module(MOVED[name])
    raise AttributeError(f"module 'attnreg' has no attribute {name!r}")
