"""`AttentionDropoutSchedule`: attention (and optionally hidden) dropout that follows a schedule, in
Lightning (the drop-in callback of `attnreg.methods.AttentionDropoutSchedule`, which lists the arguments).

It sets attention dropout to `schedule(progress)` before every training step, logged as `attnreg/<name>`. The
LightningModule needs to hold exactly one transformers model (no mixin needed). After `fit` the model's own rates are
restored.

Example:
    >>> import lightning
    >>> from attnreg.schedules import CurriculumDropout, EarlyDropout
    >>> from attnreg.tiny import tiny_model
    >>> trainer = lightning.Trainer(callbacks=[AttentionDropoutSchedule(EarlyDropout(0.1, cutoff=0.25))], logger=False)
    >>> trainer.callbacks[0].method.schedule
    EarlyDropout(rate=0.1, cutoff=0.25, shape='constant')
    >>> model = tiny_model("bert", head="classification")
    >>> dropout = AttentionDropoutSchedule(CurriculumDropout(final=0.1, gamma=10.0), layers=[0], hidden=0.1)
    >>> runner = dropout.bind(None, model); runner.start(100)  # what fit does (here without a trainer)
    >>> dropout.method.before_step(50)                    # before step 50 of 100
    {'attention_dropout_schedule': 0.0993..., 'hidden_dropout': 0.1}
    >>> model.bert.encoder.layer[0].output.dropout.p, model.bert.encoder.layer[1].output.dropout.p
    (0.1, 0.0)
"""

from __future__ import annotations

from attnreg import methods
from attnreg.callbacks.base import drop_in_callback

AttentionDropoutSchedule = drop_in_callback(methods.AttentionDropoutSchedule)
