"""attnreg: steer what attention heads do while fine-tuning transformers with Lightning.

Example:
    >>> import attnreg
    >>> hub = attnreg.attach(model)          # any supported BERT- or GPT-style model
    >>> with hub.capture(layers=[0]) as probs:
    ...     model(**batch)
    >>> probs[0]                             # [batch, heads, queries, keys], with autograd graph
"""

from attnreg import analysis, syntax
from attnreg.callbacks import AttentionLoss, EntropyRegularizer, SyntaxPriorKL
from attnreg.families import FAMILIES, Family, UnsupportedModelError, detect_family
from attnreg.hub import AttentionHub, AttentionRecord, LayerInfo, attach, detach, hub_of
from attnreg.mixin import AttentionTerm, AttnRegMixin

__all__ = [
    "FAMILIES",
    "AttentionHub",
    "EntropyRegularizer",
    "AttentionLoss",
    "SyntaxPriorKL",
    "AttentionRecord",
    "AttentionTerm",
    "AttnRegMixin",
    "Family",
    "LayerInfo",
    "UnsupportedModelError",
    "analysis",
    "attach",
    "detach",
    "detect_family",
    "hub_of",
    "syntax",
]
