"""Lightning callbacks: thin adapters that decide *when* attnreg's functions run.

Example:
    >>> import lightning, torch
    >>> from torch.utils.data import DataLoader
    >>> from attnreg.app.modules import SequenceClassifier
    >>> from attnreg.schedules import EarlyDropout
    >>> from attnreg.tiny import tiny_model
    >>> module = SequenceClassifier(tiny_model("bert", head="classification"), lr=1e-3)
    >>> batch = {"input_ids": torch.tensor([[2, 5, 6, 3]]), "labels": torch.tensor([1])}
    >>> callbacks = [EntropyRegularizer(mode="max", weight=0.01), AttentionDropoutSchedule(EarlyDropout(0.1, 0.5))]
    >>> trainer = lightning.Trainer(max_steps=2, callbacks=callbacks, logger=False, enable_checkpointing=False,
    ...                             enable_progress_bar=False, enable_model_summary=False)
    >>> trainer.fit(module, DataLoader([batch, batch], batch_size=None))
    >>> sorted(trainer.callback_metrics)
    ['attnreg/attention_dropout_schedule', 'attnreg/entropy_regularizer', 'attnreg/entropy_regularizer/layer0',
     'attnreg/entropy_regularizer/layer1', 'train/loss']
"""

# The modules by topic, first: a callback written out there is its method's drop-in (`HeadGating` with `prune`,
# `AttentionMonitor` with `check`); they keep the import paths of earlier releases (`attnreg.callbacks.optim`).
from attnreg.callbacks import distillation, dropout, monitor, optim, pruning, regularizers  # noqa: F401
from attnreg.callbacks.base import MethodCallback, drop_in_callback, renamed_callback
from attnreg.callbacks.monitor import EntropyCollapseWarning
from attnreg.methods import method_entries

DROP_IN = {entry.callback: drop_in_callback(entry.method_class) for entry in method_entries()}
"""{name: class}: the drop-in callback of each built-in method (`drop_in_callback`), exported here under its name."""
globals().update(DROP_IN)

__all__ = [*DROP_IN, "EntropyCollapseWarning", "MethodCallback"]


def __getattr__(name: str):
    if name == "TermCallback":  # the former name of MethodCallback
        return renamed_callback(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
