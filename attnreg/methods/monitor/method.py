"""Watch the heads while training, and catch entropy collapse: the monitor as a method object.

Every `every_n_steps` optimizer steps `check` runs the model once more (eval mode, no grad) on the
current training batch, captures all layers and measures:

- `<prefix>/entropy/layer<l>`: the layer's mean normalized entropy (and `/head<h>` per head);
- `<prefix>/first_token/layer<l>`: the layer's mean share of attention on each sequence's first real token,
  the attention sink (Xiao et al. 2024; and `/head<h>` per head);
- with a small gold set: `<prefix>/parent_accuracy/layer<l>/head<h>` (dependent to head, word level,
  see `attnreg.analysis.parent_accuracy`), the layer's best `/layer<l>` and the overall `/best`.

Entropy collapse (Zhai et al. 2023: attention entropy falling toward zero, with unstable training) is
flagged when a layer's mean normalized entropy drops below `collapse_threshold`: a warning naming the
layer and step, and with `on_collapse="stop"` the check asks the run to stop. Adapters log the metrics
and, where they can, draw the captured attention (`MonitorCheck.probs`).

Example:
    >>> from attnreg.app.task import build_tokenizer, generate, vocabulary
    >>> from attnreg.tiny import tiny_model
    >>> tokenizer, sentences = build_tokenizer(vocabulary()), [example.sentence for example in generate(4, seed=0)]
    >>> monitor = AttentionMonitor(every_n_steps=50, gold_sentences=sentences, tokenizer=tokenizer)
    >>> monitor.bind(tiny_model("bert", head="classification", vocab=len(tokenizer)))
    >>> batch = tokenizer([sentence.text for sentence in sentences], padding=True, return_tensors="pt")
    >>> if monitor.due(step=0):
    ...     check = monitor.check(batch, step=0)     # check.metrics, check.stop
    >>> check.stop, check.entropy.shape, round(check.metrics["attnreg/attention_monitor/parent_accuracy/best"], 3)
    (False, torch.Size([2, 4]), 0.167)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerBase

from attnreg.analysis.heads import first_token_attention
from attnreg.analysis.runner import MODEL_INPUTS, parent_accuracy
from attnreg.heads import head_numbers, pruned_heads
from attnreg.losses import attention_entropy
from attnreg.methods.base import Loop, Method
from attnreg.methods.registry import register_method
from attnreg.syntax.trees import Sentence


class EntropyCollapseWarning(UserWarning):
    """A layer's mean normalized attention entropy fell below the monitor's threshold.

    Example:
        >>> import warnings
        >>> from attnreg.tiny import tiny_model
        >>> monitor = AttentionMonitor(collapse_threshold=0.2)
        >>> monitor.bind(tiny_model("bert"))
        >>> monitor.hub.set_temperature(1e-4)                  # near one-hot attention: collapsed
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("error", EntropyCollapseWarning)
        ...     monitor.check({"input_ids": torch.tensor([[2, 5, 6, 7, 8, 3]])}, step=7)
        Traceback (most recent call last):
        ...
        attnreg.methods.monitor.method.EntropyCollapseWarning: attention entropy collapse at step 7: mean normalized ...
    """


@dataclass(frozen=True)
class MonitorCheck:
    """What one check measured: the metrics to log, entropy `[layers, heads]` (NaN for pruned heads),
    the captured attention and mask of the batch (for heatmaps), and whether the run should stop.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> monitor = AttentionMonitor(every_n_steps=10, log_heads=False)
        >>> monitor.bind(tiny_model("gpt2"))
        >>> check = monitor.check({"input_ids": torch.tensor([[5, 6, 7, 8]])}, step=10)
        >>> sorted(check.metrics)[:3], list(check.probs), check.stop, check.first_token.shape
        (['attnreg/attention_monitor/entropy/layer0', 'attnreg/attention_monitor/entropy/layer1',
          'attnreg/attention_monitor/first_token/layer0'], [0, 1], False, torch.Size([2, 4]))
    """

    metrics: dict[str, float]
    entropy: torch.Tensor
    probs: Mapping[int, torch.Tensor]
    mask: torch.Tensor | None
    stop: bool
    first_token: torch.Tensor | None = None


@register_method(docs="methods/monitor.md")
class AttentionMonitor(Method):
    """Per-head attention entropy, attention on the first token (and parent accuracy on a gold set) every N
    steps; flags collapse.

    Args:
        every_n_steps: check after every this many optimizer steps (and never twice for one step).
        gold_sentences: a small set of `Sentence`s with gold trees (`read_conllu`); needs `tokenizer`.
        tokenizer: a fast tokenizer matching the model (for the gold set).
        collapse_threshold: a layer whose mean normalized entropy is below this has collapsed.
        on_collapse: "warn" (an `EntropyCollapseWarning`) or "stop" (warn, then stop the run).
        log_heads: also log one value per head (not only per layer).
        heatmaps: draw attention heatmaps where the adapter can (TensorBoard in Lightning).
        max_length: token limit for the gold sentences.

    After each check, `entropy` and `first_token` (the share of attention on the first token) hold
    `[layers, heads]`, `metrics` what was logged, and `collapses` lists every `(step, layer, entropy)`
    flagged so far.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> monitor = AttentionMonitor(every_n_steps=50, collapse_threshold=0.1, on_collapse="stop")
        >>> monitor.bind(tiny_model("bert"))
        >>> [step for step in (0, 49, 50, 100) if monitor.due(step)]
        [0, 50, 100]
        >>> check = monitor.check({"input_ids": torch.tensor([[2, 5, 6, 3]])}, step=50)
        >>> monitor.entropy.shape, monitor.collapses, monitor.due(50)    # checked once per step
        (torch.Size([2, 4]), [], False)
    """

    default_name = "attention_monitor"
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
        prefix: str = "attnreg/attention_monitor",
    ) -> None:
        super().__init__()
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        if on_collapse not in ("warn", "stop"):
            raise ValueError(f"on_collapse must be 'warn' or 'stop', got {on_collapse!r}")
        if not 0.0 <= collapse_threshold < 1.0:
            raise ValueError(f"collapse_threshold is a normalized entropy in [0, 1), got {collapse_threshold!r}")
        if gold_sentences is not None and tokenizer is None:
            raise ValueError("Monitor: gold_sentences need the model's tokenizer (tokenizer=...)")
        if gold_sentences is not None and not all(isinstance(s, Sentence) for s in gold_sentences):
            raise TypeError("Monitor: gold_sentences must be attnreg.syntax.Sentence objects (read_conllu)")
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
        self.first_token: torch.Tensor | None = None
        self.metrics: dict[str, float] = {}
        self.collapses: list[tuple[int, int, float]] = []
        self._last_step = -1

    def identity(self) -> dict[str, Any]:
        return {"prefix": self.prefix}

    def due(self, step: int) -> bool:
        """Whether to check after optimizer step `step`."""
        return step % self.every_n_steps == 0 and step != self._last_step

    def on_step_end(self, loop: Loop) -> None:
        """Every `every_n_steps` optimizer steps, on the step's last training batch: the metrics go to the
        log at once, a heatmap grid where the logger takes figures, and `on_collapse="stop"` stops."""
        if loop.batch is not None and self.due(loop.step):
            self.measure(loop)

    def measure(self, loop: Loop) -> MonitorCheck:
        """Check now, on `loop.batch`: the metrics go to `loop.report`, the heatmaps to `loop.figure`, and a
        collapse with `on_collapse="stop"` to `loop.stop`."""
        result = self.check(loop.batch, loop.step)
        loop.report(result.metrics)
        if self.heatmaps and loop.figure is not None:
            self._heatmaps(loop, result)
        if result.stop:
            loop.stop()
        return result

    def _heatmaps(self, loop: Loop, result: MonitorCheck) -> None:
        try:
            from attnreg.analysis.plots import attention_grid

            length = int(result.mask[0].sum()) if result.mask is not None else None
            figure = attention_grid(result.probs, length=length, title=f"attention at step {loop.step}")
        except ImportError as error:
            if not self.__dict__.get("_warned_heatmaps"):
                warnings.warn(f"{type(self).__name__}: no heatmaps ({error})", stacklevel=2)
                self._warned_heatmaps = True
            return
        loop.figure(f"{self.prefix}/attention", figure)

    def check(self, batch: Mapping[str, Any], step: int) -> MonitorCheck:
        """Measure and flag now, on `batch` (a dict with `input_ids` and `attention_mask`)."""
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            kind = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise TypeError(f"AttentionMonitor reads the training batch as a dict with 'input_ids'; got {kind}")
        model, hub = self.require_bound(), self.hub
        self._last_step = step
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
            first_token = torch.full((hub.num_layers, width), torch.nan)
            for layer in probs:
                values = attention_entropy(
                    probs[layer], mask, hub.family.causal, True, probs.attention_mask(layer), probs.has_sink(layer)
                )
                entropy[layer, numbers[layer]] = values.float().cpu()
                first_token[layer, numbers[layer]] = first_token_attention(probs[layer], mask).cpu()
            metrics = self._entropy_metrics(entropy)
            metrics.update(self._layer_metrics("first_token", first_token))
            if self.gold_sentences:
                accuracy = parent_accuracy(model, self.tokenizer, self.gold_sentences, max_length=self.max_length)
                metrics.update(self._accuracy_metrics(accuracy.accuracy))
        finally:
            model.train(was_training)
        self.entropy, self.first_token, self.metrics = entropy, first_token, metrics
        stop = self._flag_collapse(entropy, step)
        return MonitorCheck(metrics, entropy, dict(probs.items()), mask, stop, first_token)

    def _entropy_metrics(self, entropy: torch.Tensor) -> dict[str, float]:
        return self._layer_metrics("entropy", entropy)

    def _layer_metrics(self, kind: str, values_per_layer: torch.Tensor) -> dict[str, float]:
        """`<prefix>/<kind>/layer<l>`: the mean over the layer's heads (and each head with `log_heads`)."""
        name = f"{self.prefix}/{kind}"
        metrics = {}
        for layer, values in enumerate(values_per_layer):
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

    def _flag_collapse(self, entropy: torch.Tensor, step: int) -> bool:
        """Warn about collapsed layers; True when the run should stop."""
        means = entropy.nanmean(-1)
        collapsed = [(layer, float(value)) for layer, value in enumerate(means) if value < self.collapse_threshold]
        if not collapsed:
            return False
        self.collapses.extend((step, layer, value) for layer, value in collapsed)
        layers = ", ".join(f"layer {layer} ({value:.3f})" for layer, value in collapsed)
        action = "stopping the run" if self.on_collapse == "stop" else "training continues"
        warnings.warn(
            f"attention entropy collapse at step {step}: mean normalized entropy below "
            f"{self.collapse_threshold} in {layers}; {action}",
            EntropyCollapseWarning,
            stacklevel=3,
        )
        return self.on_collapse == "stop"

    def state_dict(self) -> dict[str, Any]:
        return {"collapses": list(self.collapses), "last_step": self._last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.collapses = [tuple(item) for item in state.get("collapses", [])]
        self._last_step = state.get("last_step", -1)
