"""Which attnreg callbacks a composed config turns on, what each needs from the data, and the config names
that were renamed.

Example:
    >>> import attnreg
    >>> sorted(needs_of(attnreg.SyntaxPriorKL(layers=[0])))
    ['prior']
"""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from attnreg import deprecations
from attnreg.callbacks import MethodCallback
from attnreg.families import detect_family
from attnreg.heads import head_numbers
from attnreg.methods import Method, entry_of
from attnreg.syntax import SyntaxCollator, check_priors, describe_counts
from attnreg.unwrap import transformers_model

MONITOR_GOLD_SENTENCES = 64  # how many held-out gold trees a callback that needs "gold_trees" gets

# What an attnreg callback's method (or another callback) may declare in its class attribute `needs` (a frozenset of
# these names) and what the app then provides; one without `needs` needs nothing from the data.
NEEDS = {
    "prior": "the data module adds the syntax prior to every batch (batch['attnreg_prior'])",
    "gold_trees": f"up to {MONITOR_GOLD_SENTENCES} held-out sentences with gold trees as `method.gold_sentences`",
    "tokenizer": "the data's tokenizer as `method.tokenizer`",
    "train_batches": "the training batches, in training's order and as the model takes them, as `method.dataloader`",
    "base_model": "a frozen copy of the model as built, before LoRA wraps it and before any removal, as "
    "`method.teacher` (a setting `teacher: base`)",
}

RENAMED_CONFIGS = deprecations.renamed("config", "attnreg=")
"""Old names of the `attnreg` config group (`attnreg.deprecations`), still usable until the release that removes them:
the method's name is the new one."""


def warn_renamed(choices: Mapping[str, Any]) -> list[str]:
    """Warn (a `FutureWarning`: Python's default filters hide a `DeprecationWarning` raised outside `__main__`)
    for each renamed config chosen in the `attnreg` group; returns the old names.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_renamed({"attnreg": "[syntax_kl, head_gating]"})
        ['syntax_kl']
        >>> print(caught[0].message)
        attnreg=syntax_kl is deprecated: use attnreg=syntax_prior_kl (the same config under the method's name); it
        will be removed in 0.3.0
    """
    chosen = re.findall(r"\w+", str(choices.get("attnreg") or ""))
    old = [name for name in chosen if name in RENAMED_CONFIGS]
    for name in old:
        deprecations.warn(f"attnreg={name}", stacklevel=2)
    return old


def attnreg_settings(cfg: DictConfig) -> dict[str, DictConfig]:
    """{name: config node} of the attnreg callbacks that `cfg` turns on (a null node is off).

    Example:
        >>> import hydra
        >>> from attnreg.app.configs import CONFIG_DIR
        >>> both, off = "attnreg=[syntax_prior_kl,entropy_regularizer]", "attnreg.syntax_prior_kl=null"
        >>> choices = [[], [both], ["attnreg=none"], [off]]
        >>> with hydra.initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        ...     configs = [hydra.compose("train", overrides) for overrides in choices]
        >>> [list(attnreg_settings(cfg)) for cfg in configs]
        [['syntax_prior_kl'], ['syntax_prior_kl', 'entropy_regularizer'], [], []]
        >>> attnreg_settings(configs[0])["syntax_prior_kl"]._target_
        'attnreg.SyntaxPriorKL'
    """
    return {name: node for name, node in (cfg.get("attnreg") or {}).items() if node is not None}


def instantiate_callbacks(cfg: DictConfig) -> dict[str, L.Callback]:
    """{name: callback} of the attnreg settings `cfg` turns on: a node may name a callback (`attnreg.HeadGating`)
    or a method (`attnreg.methods.ImportanceRemoval`, a method of one's own), which runs through
    `attnreg.callbacks.MethodCallback`.

    Example:
        >>> import hydra
        >>> from attnreg.app.configs import CONFIG_DIR
        >>> with hydra.initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        ...     method = "attnreg.importance_removal._target_=attnreg.methods.ImportanceRemoval"  # not the callback
        ...     cfg = hydra.compose("train", ["attnreg=[importance_removal,distillation]", method])
        >>> callbacks = instantiate_callbacks(cfg)
        >>> [(name, type(callback).__name__) for name, callback in callbacks.items()]
        [('importance_removal', 'MethodCallback'), ('distillation', 'Distillation')]
        >>> sorted(needs_of(callbacks["importance_removal"])), sorted(needs_of(callbacks["distillation"]))
        (['train_batches'], ['base_model'])
    """
    callbacks = {}
    for name, node in attnreg_settings(cfg).items():
        made = instantiate(node, _convert_="all")
        callbacks[name] = MethodCallback(made) if isinstance(made, Method) else made
    return callbacks


def removes_heads(callbacks: Iterable[L.Callback]) -> bool:
    """Whether a callback's method removes heads (its entry's `removes_heads`: head gating, importance removal): the
    run then keeps a copy of the model before training, for generation speed against it, and saves the pruned model.

    Example:
        >>> import attnreg
        >>> removes_heads([attnreg.HeadGating()]), removes_heads([attnreg.EntropyRegularizer()])
        (True, False)
    """
    return any(flag(callback, "removes_heads") for callback in callbacks)


def flag(callback: L.Callback, name: str) -> bool:
    """A flag of the built-in method a callback runs (`attnreg.methods.MethodEntry`); False for any other callback.

    Example:
        >>> import attnreg
        >>> gating, yours = attnreg.HeadGating(), attnreg.MethodCallback(attnreg.methods.Method())
        >>> flag(gating, "gates_heads"), flag(yours, "gates_heads"), flag(L.Callback(), "removes_heads")
        (True, False, False)
    """
    entry = entry_of(settings_of(callback))
    return entry is not None and getattr(entry, name)


def protect_supervised(callbacks: Iterable[L.Callback], model: nn.Module) -> dict[int, list[int]]:
    """Add the heads a syntax prior supervises (`supervised_heads`; all layers or heads where it names none) to the
    `removal.protect` of every method that gates heads (its entry's `gates_heads`: `HeadGating`), so that gating never
    removes or silences them; returns {layer: heads} added.
    The app calls it unless the config sets `protect_supervised: false`.

    Example:
        >>> import attnreg
        >>> from attnreg.tiny import tiny_model
        >>> gating = attnreg.HeadGating()
        >>> protect_supervised([attnreg.SyntaxPriorKL(heads=[0]), gating], tiny_model("bert"))
        {0: [0], 1: [0]}
        >>> gating.method.removal.protect
        {0: (0,), 1: (0,)}
    """
    callbacks = list(callbacks)
    model = transformers_model(model)
    layers = range(len(detect_family(model).blocks(model)))
    supervised = {
        layer: sorted(heads if heads is not None else head_numbers(model, layer))
        for layer, heads in supervised_heads(callbacks, layers).items()
    }
    for callback in callbacks:
        if not flag(callback, "gates_heads") or not supervised:
            continue
        method = settings_of(callback)
        gated = set(layers if method.layers_argument is None else _as_list(method.layers_argument))
        protect = {layer: list(heads) for layer, heads in (method.removal.protect or {}).items()}
        for layer, heads in supervised.items():
            if layer in gated:
                protect[layer] = sorted({*protect.get(layer, ()), *heads})
        try:
            method.removal = dataclasses.replace(method.removal, protect=protect)
        except ValueError as error:
            raise ValueError(
                f"{error}: the heads the syntax prior supervises {supervised} are protected from gating "
                "(protect_supervised: true); raise keep, or set protect_supervised=false to let gating remove them"
            ) from error
    return supervised


def supervised_heads(callbacks: Iterable[L.Callback], all_layers: Iterable[int] = ()) -> dict[int, list[int] | None]:
    """{layer: heads (None = all)} that the callbacks needing the syntax prior (`SyntaxPriorKL`) supervise, read from
    their methods' `layers` (`all_layers` for one that names none) and `heads_of`.

    Example:
        >>> import attnreg
        >>> supervised_heads([attnreg.SyntaxPriorKL(layers=[0, 1], heads=[0]), attnreg.EntropyRegularizer()])
        {0: [0], 1: [0]}
        >>> supervised_heads([attnreg.SyntaxPriorKL(heads=[2])], all_layers=range(2))
        {0: [2], 1: [2]}
    """
    heads: dict[int, list[int] | None] = {}
    for callback in callbacks:
        if "prior" in needs_of(callback):
            method = settings_of(callback)
            layers = getattr(method, "layers", None)
            for layer in all_layers if layers is None else layers:
                heads[layer] = method.heads_of(layer)
    return heads


def _as_list(layers: int | Iterable[int]) -> list[int]:
    return [layers] if isinstance(layers, int) else list(layers)


def settings_of(callback: L.Callback) -> Any:
    """What holds a callback's settings: an attnreg callback's method, another callback itself.

    Example:
        >>> import attnreg
        >>> settings_of(attnreg.SyntaxPriorKL(layers=[0])).layers, isinstance(settings_of(L.Callback()), L.Callback)
        ([0], True)
    """
    return callback.method if isinstance(callback, MethodCallback) else callback


def needs_of(callback: L.Callback) -> frozenset[str]:
    """What `callback` declares it needs from the data (its method's `needs`, or its own for another callback; none
    without one), see `NEEDS`; raises ValueError on a need the app cannot provide.

    Example:
        >>> import attnreg
        >>> sorted(needs_of(attnreg.AttentionMonitor())), sorted(needs_of(attnreg.SyntaxPriorKL(layers=[0])))
        (['gold_trees', 'tokenizer'], ['prior'])
        >>> needs_of(L.Callback())                    # a callback without `needs` needs nothing
        frozenset()
    """
    needs = frozenset(getattr(settings_of(callback), "needs", frozenset()))
    if needs - NEEDS.keys():
        raise ValueError(
            f"{type(callback).__name__} needs {sorted(needs - NEEDS.keys())}, which attnreg-train cannot provide "
            f"(it provides {', '.join(NEEDS)})"
        )
    return needs


def provide(callbacks: Iterable[L.Callback], data: Any, base_model: nn.Module | None = None) -> None:
    """Give each callback's method the gold trees, tokenizer, training batches and base model its `needs` asks for,
    unless it was given its own (the prior is in the batches: the data module builds it when a callback needs it).
    The training batches leave out the entries only the methods read (`batch_keys`); `base_model` is what a
    `teacher: base` setting gets (a frozen copy of the model before LoRA and any removal).

    Example:
        >>> import attnreg
        >>> from attnreg.app.datamodules import AgreementDataModule
        >>> data = AgreementDataModule(train=8, val=4, test=100, hard=2)   # gold trees: the 100 test sentences
        >>> monitor = attnreg.AttentionMonitor(every_n_steps=10)
        >>> provide([monitor], data)
        >>> len(monitor.method.gold_sentences), monitor.method.tokenizer is data.tokenizer
        (64, True)
    """
    callbacks = list(callbacks)
    provide_kinds(callbacks, data)
    methods_only = {key for callback in callbacks for key in getattr(settings_of(callback), "batch_keys", ())}
    for callback in callbacks:
        needs, settings = needs_of(callback), settings_of(callback)
        if "gold_trees" in needs and settings.gold_sentences is None:
            data.setup("fit")  # idempotent: fit reuses the datasets
            settings.gold_sentences = (data.tree_sentences() or [])[:MONITOR_GOLD_SENTENCES] or None
        if "tokenizer" in needs and settings.tokenizer is None:
            settings.tokenizer = data.tokenizer
        if "train_batches" in needs and settings.dataloader is None:
            data.setup("fit")
            settings.dataloader = ModelInputs(data.train_dataloader(), methods_only)
        if "base_model" in needs:
            if base_model is None:
                raise ValueError(
                    f"{type(callback).__name__}: teacher: base names the run's base model, and this run has none to "
                    "give (a copy of the model as built); name a teacher model config instead"
                )
            settings.teacher = base_model


class ModelInputs:
    """The batches of `loader` without the entries `keys` (those only the methods read), as the model takes them.

    Example:
        >>> list(ModelInputs([{"input_ids": 1, "attnreg_prior": 2}], ("attnreg_prior",)))
        [{'input_ids': 1}]
    """

    def __init__(self, loader: Iterable[Mapping[str, Any]], keys: Iterable[str]) -> None:
        self.loader, self.keys = loader, tuple(keys)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            yield {key: value for key, value in batch.items() if key not in self.keys}


def provide_kinds(callbacks: Iterable[L.Callback], data: Any) -> dict[str, Any]:
    """Hand the prior kinds of the callbacks that need the prior (`SyntaxPriorKL(kinds=...).kind_priors`) to the
    data's `SyntaxCollator`, check them against the training sentences before training (a relation that never
    occurs there, or a kind a decoder cannot reach at all, is refused, naming the relation and the file) and say
    once what each covers. The main prior is no longer built when no callback reads it. Returns the counts.

    Example:
        >>> import attnreg
        >>> from attnreg.app.datamodules import AgreementDataModule
        >>> data = AgreementDataModule(train=16, val=4, test=4, hard=2)
        >>> counts = provide_kinds([attnreg.SyntaxPriorKL(kinds={"nsubj": {1: [0]}})], data)
        >>> counts["attnreg_prior.dependents:nsubj"].rows > 0, data.collator().prior
        (True, None)
        >>> provide_kinds([attnreg.SyntaxPriorKL(kinds={"nsubj:pass": {1: [0]}}, subtypes="keep")], data)
        Traceback (most recent call last):
        ...
        ValueError: prior 'attnreg_prior.dependents:nsubj:pass' (dependents:nsubj:pass): relation 'nsubj:pass' never ...
    """
    readers = [settings_of(callback) for callback in callbacks if "prior" in needs_of(callback)]
    kinds = {key: prior for reader in readers for key, prior in (getattr(reader, "kind_priors", None) or {}).items()}
    collator = data.collator() if kinds and hasattr(data, "collator") else None
    if not isinstance(collator, SyntaxCollator):
        return {}
    collator.kinds.update(kinds)
    if not any(collator.prior_key in getattr(reader, "batch_keys", ()) for reader in readers):
        collator.prior = None
    data.setup("fit")
    sentences = getattr(getattr(data, "datasets", {}).get("train"), "sentences", None)
    if sentences is None:
        warnings.warn(
            f"the prior kinds {sorted(kinds)} could not be checked before training: {type(data).__name__} has no "
            "parsed training sentences yet (they are parsed batch by batch)",
            stacklevel=2,
        )
        return {}
    counts = check_priors(sentences, kinds, causal=collator.causal)
    logging.getLogger(__name__).info("syntax prior kinds:\n%s", describe_counts(counts, collator.causal))
    return counts
