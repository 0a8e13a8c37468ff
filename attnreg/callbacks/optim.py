"""Per-layer learning rates and temporary freezing as Lightning callbacks, for modules you do not want to edit: the
drop-in callbacks of `attnreg.methods.LayerwiseLR` and `attnreg.methods.FreezeLayers`, whose docstrings list the
arguments.

`LayerwiseLR` trains with the optimizer and learning-rate schedule of `attnreg.methods.LayerwiseLR`
(`attnreg.methods.layerwise_lr.layerwise_param_groups`). The optimizer is built whole before its scheduler (adding
groups to a live optimizer breaks every torch 2.13 scheduler step) and replaces, at fit start, the one the module's
`configure_optimizers` returned, as Lightning's `StochasticWeightAveraging` replaces scheduler configs; on resume
Lightning loads the checkpoint's optimizer and scheduler state into it. The module still needs a
`configure_optimizers` (Lightning checks for one before callbacks run); its optimizer is not used.

`FreezeLayers` freezes layer groups for the first epochs without changing the optimizer's groups: it
only toggles `requires_grad` (a parameter without a gradient is skipped by torch's optimizers, weight
decay included), chosen from `trainer.current_epoch` at every epoch start, so a resumed run matches. Under DDP use a
strategy that finds unused parameters. `requires_grad` is restored after `fit`.

Example:
    >>> import lightning as L
    >>> from attnreg.schedules import Linear, Warmup
    >>> from attnreg.tiny import tiny_model
    >>> llrd = LayerwiseLR(lr=2e-5, decay=0.95, weight_decay=0.01, schedule=Warmup(0.06, Linear(1.0, 0.0)))
    >>> trainer = L.Trainer(callbacks=[llrd, FreezeLayers(["embeddings"], epochs=1)], logger=False)
    >>> llrd = LayerwiseLR(lr=1e-4, decay=0.8, multipliers={"head": 10.0, "gates": 100.0}, freeze=["embeddings"])
    >>> optimizer = llrd.method.build_optimizer(tiny_model("bert", head="classification"))   # what fit trains with
    >>> type(optimizer).__name__, [group["name"] for group in optimizer.param_groups]
    ('AdamW', ['layer0', 'layer1', 'head'])
    >>> model = tiny_model("bert")
    >>> freeze = FreezeLayers(["embeddings", 0], epochs=1)      # train layer 1 and the head first
    >>> _ = freeze.bind(None, model); freeze.method.before_epoch(0)   # what fit does, at epoch 0
    >>> embeddings, top = model.embeddings.word_embeddings.weight, model.encoder.layer[1].output.dense.weight
    >>> embeddings.requires_grad, top.requires_grad
    (False, True)
"""

from __future__ import annotations

from attnreg import methods
from attnreg.callbacks.base import drop_in_callback

LayerwiseLR = drop_in_callback(methods.LayerwiseLR)
FreezeLayers = drop_in_callback(methods.FreezeLayers)
