"""Every old name that still works, what replaces it, and the release that removes it: the one list that each
warning is built from (`message`, `warn`), the changelog's and `docs/deprecations.md`'s source.

The policy: a renamed or moved name, module or config keeps working for one minor release after the release that
renames it, with a `FutureWarning` (shown by Python's default filters, unlike a `DeprecationWarning` raised outside
`__main__`) that names the replacement and the release that removes the old name; that release removes it.
`tests/test_deprecations.py` fails once a removal release is the package's version or older.

This module imports nothing from attnreg, so that every layer may read it.

Example:
    >>> print(message("attnreg.methods.PriorKL"))
    attnreg.methods.PriorKL is deprecated: use attnreg.methods.SyntaxPriorKL (the same method); it will be removed
    in 0.3.0
    >>> renamed("name", "attnreg.methods.")["PriorKL"]
    'SyntaxPriorKL'
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

DEPRECATED_IN = "0.2.0"  # the release that renamed every name below
REMOVED_IN = "0.3.0"  # the release that removes them

KINDS = {
    "module": "a module that moved (every import form warns)",
    "name": "a class or function under an old name (attribute and from-import warn)",
    "config": "a config of the app's `attnreg` group under an old name",
    "keyword": "a keyword argument under an old name",
}


@dataclass(frozen=True)
class Deprecation:
    """One old name: `old` as a user writes it (`attnreg.pruning`, `attnreg.methods.PriorKL`, `attnreg=syntax_kl`),
    `new` likewise, `same` what the new one is to the old (shown in brackets), `also` other spellings of the old
    name that warn the same way (the same class exported by another module)."""

    kind: str
    old: str
    new: str
    same: str
    also: tuple[str, ...] = ()
    deprecated_in: str = DEPRECATED_IN
    removed_in: str = REMOVED_IN

    def message(self, old: str | None = None) -> str:
        """The warning for `old` (this entry's `old` or one of `also`)."""
        return f"{old or self.old} is deprecated: use {self.new} ({self.same}); it will be removed in {self.removed_in}"


def _entries() -> list[Deprecation]:
    same_module, same_method = "the same module", "the same method"
    same_config = "the same config under the method's name"
    modules = {
        "attnreg.pruning": "attnreg.methods.pruning",
        "attnreg.optim": "attnreg.methods.layerwise_lr",
        "attnreg.distill": "attnreg.methods.distillation",
        "attnreg.configs": "attnreg.app.configs",
    }
    methods = {
        "AttentionPenalty": "AttentionLoss",
        "DropoutSchedule": "AttentionDropoutSchedule",
        "Entropy": "EntropyRegularizer",
        "Monitor": "AttentionMonitor",
        "PriorKL": "SyntaxPriorKL",
    }
    configs = {
        "syntax_kl": "syntax_prior_kl",
        "syntax_kl_minilm": "syntax_prior_kl_minilm",
        "entropy": "entropy_regularizer",
        "entropy_max": "entropy_regularizer_max",
        "dropout_schedule": "attention_dropout_schedule",
        "monitor": "attention_monitor",
        "hard_concrete": "head_gating_hard_concrete",
    }
    return [
        *(Deprecation("module", old, new, same_module) for old, new in modules.items()),
        *(
            Deprecation("name", f"attnreg.methods.{old}", f"attnreg.methods.{new}", same_method)
            for old, new in methods.items()
        ),
        Deprecation(
            "name",
            "attnreg.AttentionTerm",
            "attnreg.methods.AttentionLoss",
            "the same term of a function; AttentionTerm(name, fn, layers, inputs) is AttentionLoss(fn, name=name, "
            "layers=layers, inputs=inputs)",
            also=("attnreg.mixin.AttentionTerm",),
        ),
        Deprecation(
            "name",
            "attnreg.callbacks.TermCallback",
            "attnreg.callbacks.MethodCallback",
            "the same class",
            also=("attnreg.callbacks.base.TermCallback",),
        ),
        *(Deprecation("config", f"attnreg={old}", f"attnreg={new}", same_config) for old, new in configs.items()),
    ]


DEPRECATIONS: dict[str, Deprecation] = {entry.old: entry for entry in _entries()}
"""{old name: its entry}, in the order the docs list them."""

_BY_SPELLING = {spelling: entry for entry in DEPRECATIONS.values() for spelling in (entry.old, *entry.also)}


def find(old: str) -> Deprecation:
    """The entry of `old` (its name or one of its other spellings); a KeyError for a name that is not deprecated."""
    return _BY_SPELLING[old]


def message(old: str) -> str:
    """The warning's text for `old`: what to use instead and the release that removes it."""
    return find(old).message(old)


def warn(old: str, stacklevel: int = 2) -> None:
    """Warn (FutureWarning) that `old` is deprecated; `stacklevel` as `warnings.warn`'s, counted from the caller."""
    warnings.warn(message(old), FutureWarning, stacklevel=stacklevel + 1)


def renamed(kind: str, prefix: str, whole_new: bool = False) -> dict[str, str]:
    """{old: new} of the entries of `kind` whose old name starts with `prefix`, both without it (`whole_new`: the
    new name as it is).

    Example:
        >>> renamed("config", "attnreg=")["syntax_kl"]
        'syntax_prior_kl'
        >>> renamed("name", "attnreg.methods.")["Entropy"]
        'EntropyRegularizer'
        >>> renamed("module", "attnreg.", whole_new=True)["optim"]
        'attnreg.methods.layerwise_lr'
    """
    return {
        entry.old.removeprefix(prefix): entry.new if whole_new else entry.new.removeprefix(prefix)
        for entry in DEPRECATIONS.values()
        if entry.kind == kind and entry.old.startswith(prefix)
    }


def markdown_table() -> str:
    """The table of `docs/deprecations.md` (which the tests check against this list).

    Example:
        >>> print(markdown_table().splitlines()[2])
        | module | `attnreg.pruning` | `attnreg.methods.pruning` | 0.2.0 | 0.3.0 |
    """
    rows = ["| Kind | Old name | Use instead | Deprecated in | Removed in |", "| --- | --- | --- | --- | --- |"]
    for entry in DEPRECATIONS.values():
        old = ", ".join(f"`{spelling}`" for spelling in (entry.old, *entry.also))
        rows.append(f"| {entry.kind} | {old} | `{entry.new}` | {entry.deprecated_in} | {entry.removed_in} |")
    return "\n".join(rows)
