"""Soft head pruning in Lightning: gates with an L1 or hard-concrete L0 penalty, then physical removal.

`HeadGating` is the Lightning adapter of `attnreg.methods.HeadGating` (its configs `L1Gates`,
`HardConcreteGates` and `Removal` say what the penalty is and which heads go when): it adds the penalty
to the loss through the mixin and removes heads when the method says, with the optimizers' state
sliced, folding the remaining gates into the output projections at the last removal: the smaller model
carries no gates and computes what the gated model computed with the removed gates at 0.
`HeadImportance` scores heads after training (Michel et al. 2019) and can prune iteratively; after fit:
`.method.scores` and `.method.curve`. `ImportanceRemoval` removes the least important key/value groups (or heads)
when training starts. The work is done by `attnreg.methods.pruning`.

Example:
    >>> from attnreg.methods import HardConcreteGates, L1Gates, Removal
    >>> from attnreg.schedules import Constant, Warmup
    >>> HeadGating(L1Gates(weight=Warmup(0.1, Constant(0.01)))).method.removal.during_training  # at the end of fit
    False
    >>> HeadGating(HardConcreteGates(target_warmup=0.5), Removal(keep=36)).method.lagrangian  # CoFi Lagrangian
    True
    >>> HeadGating(removal=Removal(milestones=[(0.3, 60), (0.6, 48), (0.8, 36)])).method.removal.during_training
    True
"""

from __future__ import annotations

import lightning as L

from attnreg import methods
from attnreg.callbacks.base import MethodCallback, drop_in_callback

__all__ = ["HeadGating", "HeadImportance", "ImportanceRemoval"]


class HeadGating(MethodCallback, drop_in=True):
    """Trainable per-head gates with a sparsity penalty, then physical removal of the closed heads
    (`attnreg.methods.HeadGating(gates, removal, layers, name)`).

    Every removal slices the optimizer's state (Adam moments of the kept heads carry on) and drops
    folded gates from it; LR schedulers are untouched. The choice is broadcast from rank 0 and the step
    that triggers it is the same on every rank; removal during training under DDP is refused (its
    gradient buckets keep the old shapes), so with several processes prune at the end of fit. Resuming
    from a checkpoint taken after a removal rebuilds the removed heads before the weights load (the mixin's
    structure event).

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader
        >>> from attnreg.methods import L1Gates, Removal
        >>> from attnreg.app.modules import SequenceClassifier
        >>> from attnreg.tiny import tiny_model
        >>> module = SequenceClassifier(tiny_model("bert", head="classification"), lr=1e-3, gate_lr=0.1)
        >>> gating = HeadGating(L1Gates(weight=0.01), Removal(keep=6))        # keep 6 of the 8 heads
        >>> batch = {"input_ids": torch.tensor([[2, 5, 6, 3]]), "labels": torch.tensor([1])}
        >>> L.Trainer(max_steps=2, callbacks=[gating], logger=False, enable_checkpointing=False,
        ...           enable_progress_bar=False, enable_model_summary=False).fit(module, DataLoader([batch], None))
        >>> gating.method.report.num_removed, gating.method.report.heads   # .removed: original numbers per layer
        (2, {0: (3, 3), 1: (3, 3)})
    """

    method_class = methods.HeadGating

    def prune(self, trainer: L.Trainer, pl_module: L.LightningModule, keep: int | None = None, final: bool = True):
        """Remove heads now (all but the `keep` best, default the removal's, else below its threshold).

        The method removes heads when `Removal` says; call this yourself (from a hook of yours, with the
        trainer) to prune at another moment. Returns what `attnreg.methods.pruning.prune_heads` did.
        """
        keep = self.method.removal.keep if keep is None else keep
        return self.method.remove_if_due(self.loop(trainer, pl_module), (keep, final))


HeadImportance = drop_in_callback(methods.HeadImportance)
ImportanceRemoval = drop_in_callback(methods.ImportanceRemoval)
