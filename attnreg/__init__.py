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

from attnreg import analysis, schedules, syntax
from attnreg.callbacks import (
    AttentionDropoutSchedule,
    AttentionLoss,
    AttentionMonitor,
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
    "schedules",
    "syntax",
]
