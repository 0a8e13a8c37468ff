"""`AttentionMonitor`: watch the heads while training, and catch entropy collapse.

Every `every_n_steps` optimizer steps it runs the model once more (eval mode, no grad) on the current
training batch, captures all layers, and writes to every logger of the trainer:

- `attnreg/monitor/entropy/layer<l>`: the layer's mean normalized entropy (and `/head<h>` per head);
- with a small gold set: `attnreg/monitor/parent_accuracy/layer<l>/head<h>` (dependent to head, word
  level, see `attnreg.analysis.parent_accuracy`), the layer's best `/layer<l>` and the overall `/best`;
- with a TensorBoard logger: a heatmap grid of all layers x heads of the batch's first example
  (`attnreg/monitor/attention`), when matplotlib is installed.

Entropy collapse (Zhai et al. 2023: attention entropy falling toward zero, with unstable training) is
flagged when a layer's mean normalized entropy drops below `collapse_threshold`: a warning naming the
layer and step, and with `on_collapse="stop"` the run stops (`trainer.should_stop`). The monitor needs
only the hub, not `attnreg.AttnRegMixin`.

Example:
    >>> monitor = attnreg.AttentionMonitor(every_n_steps=50, gold_sentences=dev[:64], tokenizer=tokenizer)
    >>> lightning.Trainer(callbacks=[monitor], logger=CSVLogger("logs")).fit(module, loader)
    >>> monitor.entropy            # [layers, heads] at the last check
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from transformers import PreTrainedTokenizerBase

from attnreg.analysis.runner import MODEL_INPUTS, parent_accuracy
from attnreg.hub import attach
from attnreg.losses import attention_entropy
from attnreg.mixin import find_transformers_model
from attnreg.pruning import head_numbers, pruned_heads
from attnreg.syntax.trees import Sentence


class EntropyCollapseWarning(UserWarning):
    """A layer's mean normalized attention entropy fell below the monitor's threshold."""


class AttentionMonitor(L.Callback):
    """Logs per-head attention entropy (and parent accuracy on a gold set) every N steps; flags collapse.

    Args:
        every_n_steps: check after every this many optimizer steps (and never twice for one step).
        gold_sentences: a small set of `Sentence`s with gold trees (`read_conllu`); needs `tokenizer`.
        tokenizer: a fast tokenizer matching the model (for the gold set).
        collapse_threshold: a layer whose mean normalized entropy is below this has collapsed.
        on_collapse: "warn" (an `EntropyCollapseWarning`) or "stop" (warn, then stop the run).
        log_heads: also log one value per head (not only per layer).
        heatmaps: write attention heatmaps to TensorBoard loggers.
        max_length: token limit for the gold sentences.

    After each check, `entropy` holds `[layers, heads]`, `metrics` what was logged, and `collapses`
    lists every `(step, layer, entropy)` flagged so far.
    """

    needs = frozenset({"gold_trees", "tokenizer"})  # what the app gives it when it has them

    def __init__(
        self,
        every_n_steps: int = 100,
        gold_sentences: Sequence[Sentence] | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        collapse_threshold: float = 0.05,
        on_collapse: Literal["warn", "stop"] = "warn",
        log_heads: bool = True,
        heatmaps: bool = True,
        max_length: int | None = 128,
        prefix: str = "attnreg/monitor",
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        if on_collapse not in ("warn", "stop"):
            raise ValueError(f"on_collapse must be 'warn' or 'stop', got {on_collapse!r}")
        if not 0.0 <= collapse_threshold < 1.0:
            raise ValueError(f"collapse_threshold is a normalized entropy in [0, 1), got {collapse_threshold!r}")
        if gold_sentences is not None and tokenizer is None:
            raise ValueError("AttentionMonitor: gold_sentences need the model's tokenizer (tokenizer=...)")
        if gold_sentences is not None and not all(isinstance(s, Sentence) for s in gold_sentences):
            raise TypeError("AttentionMonitor: gold_sentences must be attnreg.syntax.Sentence objects (read_conllu)")
        self.every_n_steps = every_n_steps
        self.gold_sentences = list(gold_sentences) if gold_sentences is not None else None
        self.tokenizer = tokenizer
        self.collapse_threshold = collapse_threshold
        self.on_collapse = on_collapse
        self.log_heads = log_heads
        self.heatmaps = heatmaps
        self.max_length = max_length
        self.prefix = prefix
        self.entropy: torch.Tensor | None = None
        self.metrics: dict[str, float] = {}
        self.collapses: list[tuple[int, int, float]] = []
        self._last_step = -1
        self._warned_heatmaps = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        attach(find_transformers_model(pl_module))  # switch the implementation before training starts

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or step == self._last_step:
            return
        self._last_step = step
        self.check(trainer, pl_module, batch)

    def check(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Mapping[str, Any]) -> dict[str, float]:
        """Measure, log and flag now, on `batch` (a dict with `input_ids` and `attention_mask`)."""
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            kind = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise TypeError(f"AttentionMonitor reads the training batch as a dict with 'input_ids'; got {kind}")
        model = find_transformers_model(pl_module)
        hub = attach(model)
        inputs = {key: batch[key] for key in MODEL_INPUTS if key in batch}
        mask = inputs.get("attention_mask")
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), hub.capture() as probs:
                model(**inputs)
            numbers = {layer: list(head_numbers(model, layer)) for layer in range(hub.num_layers)}
            removed = pruned_heads(model)
            width = max(len(numbers[layer]) + len(removed.get(layer, ())) for layer in numbers)
            entropy = torch.full((hub.num_layers, width), torch.nan)  # pruned heads stay NaN
            for layer in probs:
                values = attention_entropy(probs[layer], mask, hub.family.causal, normalize=True)
                entropy[layer, numbers[layer]] = values.float().cpu()
            metrics = self._entropy_metrics(entropy)
            if self.gold_sentences:
                accuracy = parent_accuracy(model, self.tokenizer, self.gold_sentences, max_length=self.max_length)
                metrics.update(self._accuracy_metrics(accuracy.accuracy))
            self._write_heatmaps(trainer, probs, mask)
        finally:
            model.train(was_training)
        self.entropy, self.metrics = entropy, metrics
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        self._flag_collapse(trainer, entropy)
        return metrics

    def _entropy_metrics(self, entropy: torch.Tensor) -> dict[str, float]:
        name = f"{self.prefix}/entropy"
        metrics = {}
        for layer, values in enumerate(entropy):
            if not values.isnan().all():
                metrics[f"{name}/layer{layer}"] = float(values.nanmean())
                metrics.update(self._per_head(f"{name}/layer{layer}", values))
        return metrics

    def _accuracy_metrics(self, accuracy: torch.Tensor) -> dict[str, float]:
        name = f"{self.prefix}/parent_accuracy"
        metrics = {f"{name}/best": float(accuracy.nan_to_num(0.0).max())}
        for layer, values in enumerate(accuracy):
            metrics[f"{name}/layer{layer}"] = float(values.nan_to_num(0.0).max())
            metrics.update(self._per_head(f"{name}/layer{layer}", values))
        return metrics

    def _per_head(self, name: str, values: torch.Tensor) -> dict[str, float]:
        if not self.log_heads:
            return {}
        return {f"{name}/head{head}": float(value) for head, value in enumerate(values) if not value.isnan()}

    def _write_heatmaps(self, trainer: L.Trainer, probs: Mapping[int, torch.Tensor], mask: Any) -> None:
        boards = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
        if not (self.heatmaps and boards):
            return
        from attnreg.plots import attention_grid

        length = int(mask[0].sum()) if mask is not None else None
        try:
            figure = attention_grid(probs, length=length, title=f"attention at step {trainer.global_step}")
        except ImportError as error:
            if not self._warned_heatmaps:
                warnings.warn(f"AttentionMonitor: no heatmaps ({error})", stacklevel=2)
                self._warned_heatmaps = True
            return
        for logger in boards:
            logger.experiment.add_figure(f"{self.prefix}/attention", figure, global_step=trainer.global_step)

    def _flag_collapse(self, trainer: L.Trainer, entropy: torch.Tensor) -> None:
        means = entropy.nanmean(-1)
        collapsed = [(layer, float(value)) for layer, value in enumerate(means) if value < self.collapse_threshold]
        if not collapsed:
            return
        step = trainer.global_step
        self.collapses.extend((step, layer, value) for layer, value in collapsed)
        layers = ", ".join(f"layer {layer} ({value:.3f})" for layer, value in collapsed)
        action = "stopping the run" if self.on_collapse == "stop" else "training continues"
        warnings.warn(
            f"attention entropy collapse at step {step}: mean normalized entropy below "
            f"{self.collapse_threshold} in {layers}; {action}",
            EntropyCollapseWarning,
            stacklevel=2,
        )
        if self.on_collapse == "stop":
            trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        return {"collapses": list(self.collapses), "last_step": self._last_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.collapses = [tuple(item) for item in state_dict.get("collapses", [])]
        self._last_step = state_dict.get("last_step", -1)
