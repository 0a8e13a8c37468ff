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
import sys

from attnreg import analysis, deprecations, methods, schedules, syntax
from attnreg.families import FAMILIES, Family, UnsupportedModelError, detect_family
from attnreg.hub import AttentionHub, attach, detach, hub_of
from attnreg.methods.layerwise_lr import layerwise_param_groups
from attnreg.records import AttentionRecord, LayerInfo

__version__ = "0.2.0"  # pyproject.toml's version (tests/test_deprecations.py checks that they agree)

_CALLBACKS = ["MethodCallback", *(entry.callback for entry in methods.method_entries())]  # each method's drop-in
LIGHTNING = dict.fromkeys(_CALLBACKS, "attnreg.callbacks") | {"AttnRegMixin": "attnreg.mixin"}
"""The Lightning adapter's names, loaded on first use: Lightning is an extra (`pip install 'attnreg[lightning]'`),
and `import attnreg`, the Hugging Face `Trainer` and TRL need none."""


def lightning_name(name: str):
    """`attnreg.<name>` of the Lightning adapter (`LIGHTNING`), imported now; without Lightning, an error saying so.

    Example:
        >>> import attnreg
        >>> lightning_name("MethodCallback") is attnreg.callbacks.MethodCallback
        True
    """
    try:
        module = importlib.import_module(LIGHTNING[name])
    except ImportError as error:
        raise ImportError(
            f"attnreg.{name} belongs to the Lightning adapter, which needs Lightning: pip install 'attnreg[lightning]' "
            f"({error}); the Hugging Face Trainer's adapter (attnreg.integrations.hf) needs none"
        ) from error
    globals()[name] = value = getattr(module, name)
    return value


__all__ = [
    *LIGHTNING,
    "AttentionHub",
    "AttentionRecord",
    "FAMILIES",
    "Family",
    "LayerInfo",
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

MOVED = deprecations.renamed("module", "attnreg.", whole_new=True)
"""Modules that moved (`attnreg.deprecations`): `attnreg.<old>` still works until the release that removes it, in
every form (`import attnreg.pruning`, `from attnreg.pruning import save_pruned`, the attribute, Hydra's
`pkg://attnreg.configs`), with a FutureWarning (shown by Python's default filters) naming the new place and that
release: each old name is a module of two lines calling `moved`."""


def moved(old: str) -> None:
    """Warn (FutureWarning) that module `old` (`attnreg.<name>`) moved; make it the new module (`sys.modules[old]`).

    Example:
        >>> import sys, warnings, attnreg
        >>> _ = sys.modules.pop("attnreg.optim", None)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     from attnreg.optim import layerwise_param_groups     # runs attnreg/optim.py: moved(__name__)
        >>> print(caught[0].category.__name__, caught[0].message)
        FutureWarning attnreg.optim is deprecated: use attnreg.methods.layerwise_lr (the same module); it will be
        removed in 0.3.0
        >>> sys.modules["attnreg.optim"] is attnreg.methods.layerwise_lr
        True
    """
    new = MOVED[old.removeprefix("attnreg.")]
    deprecations.warn(old, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)


REMOVED = {
    "AttentionEntropy": "attnreg.EntropyRegularizer (the same callback, renamed in 0.1)",
    "AttentionPriorKL": "attnreg.SyntaxPriorKL (the same callback, renamed in 0.1)",
    "Distiller": "attnreg.Distillation(teacher) beside the model module (labels=False trains on the terms alone)",
}
"""Names that are gone, and what to write instead: `attnreg.<name>` and `from attnreg import <name>` say so."""


class RemovedNameError(ImportError):
    """A name attnreg no longer has (`REMOVED`); the message says what replaces it. An ImportError, so that
    `from attnreg import <name>` shows the message (Python replaces an AttributeError's with its own)."""


def removed_name(module: str, name: str) -> RemovedNameError:
    """The error for `module.name`, a name in `REMOVED`.

    Example:
        >>> print(removed_name("attnreg", "AttentionEntropy"))
        attnreg.AttentionEntropy was removed: use attnreg.EntropyRegularizer (the same callback, renamed in 0.1)
    """
    return RemovedNameError(f"{module}.{name} was removed: use {REMOVED[name]}", name=name)


def __getattr__(name: str):
    """`attnreg.pruning` and the other moved modules (`MOVED`), with a FutureWarning naming the new place.

    Example:
        >>> import sys, warnings, attnreg
        >>> _ = sys.modules.pop("attnreg.pruning", None); vars(attnreg).pop("pruning", None) and None
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     pruning = attnreg.pruning
        >>> pruning is attnreg.methods.pruning
        True
        >>> print(caught[0].message)
        attnreg.pruning is deprecated: use attnreg.methods.pruning (the same module); it will be removed in 0.3.0
    """
    if name in LIGHTNING:
        return lightning_name(name)
    if name == "AttentionTerm":  # the mixin's term of a function, now the method AttentionLoss
        return methods.loss_term.renamed_term(f"attnreg.{name}")
    if name in MOVED:
        return importlib.import_module(f"attnreg.{name}")  # the module `attnreg/<name>.py` warns and redirects
    if name in REMOVED:
        raise removed_name("attnreg", name)
    raise AttributeError(f"module 'attnreg' has no attribute {name!r}")
