"""`AttentionMonitor`: watch the heads while training, and catch entropy collapse, in Lightning (a thin
adapter of `attnreg.methods.AttentionMonitor`, which lists the arguments and what is measured).

The metrics go to every logger of the trainer; with a TensorBoard logger, a heatmap grid of all layers
x heads of the batch's first example (`attnreg/attention_monitor/attention`), when matplotlib is installed. With
`on_collapse="stop"` a collapse stops the run (`trainer.should_stop`). The monitor needs only the hub,
not `attnreg.AttnRegMixin`.

Example:
    >>> from torch.utils.data import DataLoader
    >>> from attnreg.app.modules import SequenceClassifier
    >>> from attnreg.syntax import SyntaxCollator
    >>> from attnreg.app.task import build_tokenizer, generate, vocabulary
    >>> from attnreg.tiny import tiny_model
    >>> tokenizer, examples = build_tokenizer(vocabulary()), generate(4, seed=0)
    >>> monitor = AttentionMonitor(every_n_steps=1, gold_sentences=[e.sentence for e in examples], tokenizer=tokenizer)
    >>> module = SequenceClassifier(tiny_model("bert", head="classification", vocab=len(tokenizer)))
    >>> loader = DataLoader([{"sentence": e.sentence, "label": e.label} for e in examples], batch_size=2,
    ...                     collate_fn=SyntaxCollator(tokenizer))
    >>> L.Trainer(max_steps=1, callbacks=[monitor], logger=False, enable_checkpointing=False,
    ...           enable_progress_bar=False, enable_model_summary=False).fit(module, loader)
    >>> monitor.method.entropy.shape      # [layers, heads] at the last check
    torch.Size([2, 4])
    >>> [name for name in monitor.method.metrics if "head" not in name]
    ['attnreg/attention_monitor/entropy/layer0', 'attnreg/attention_monitor/entropy/layer1',
     'attnreg/attention_monitor/first_token/layer0', 'attnreg/attention_monitor/first_token/layer1',
     'attnreg/attention_monitor/parent_accuracy/best', 'attnreg/attention_monitor/parent_accuracy/layer0',
     'attnreg/attention_monitor/parent_accuracy/layer1']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L

from attnreg import methods
from attnreg.callbacks.base import MethodCallback
from attnreg.methods.monitor import EntropyCollapseWarning

__all__ = ["AttentionMonitor", "EntropyCollapseWarning"]


class AttentionMonitor(MethodCallback, drop_in=True):
    """Logs per-head attention entropy (and parent accuracy on a gold set) every N steps; flags collapse
    (`attnreg.methods.AttentionMonitor`).

    Example:
        >>> monitor = AttentionMonitor(every_n_steps=50, on_collapse="stop")
        >>> [step for step in (0, 49, 50, 100) if monitor.method.due(step)]     # it checks after these steps
        [0, 50, 100]
    """

    method_class = methods.AttentionMonitor
    all_stages = True  # the hub switches the implementation before it runs

    def check(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Mapping[str, Any]) -> dict[str, float]:
        """Measure, log and flag now, on `batch` (a dict with `input_ids` and `attention_mask`)."""
        self._batch = batch
        return self.method.measure(self.loop(trainer, pl_module)).metrics
