"""Plots of attention heads (matplotlib, the optional extra: `pip install 'attnreg[plots]'`).

matplotlib is imported when a plot is drawn, so `import attnreg.analysis.plots` works without it. Figures are
built with the object-oriented API (no pyplot, no global state) and saved as PNG when a path is given;
the PNG is exactly `figure.get_size_inches() * dpi` pixels.

- `attention_grid`: every layer x head of one input as one mosaic image (one `imshow`, no per-cell
  text), downsampled by block averaging to at most `max_pixels` per map side: fast and readable at 512
  tokens and 144 heads. With one layer and one head and `tokens`, the map gets token labels.
- `head_grid`: a layer x head grid of any per-head value (entropy, importance, parent accuracy), or of
  categories (head roles) with a legend.
- `pruning_curve`: a metric against the number of heads removed (`attnreg.methods.pruning.iterative_pruning`).

Example:
    >>> import tempfile
    >>> import attnreg
    >>> from attnreg.analysis import analyze
    >>> from attnreg.app.task import build_tokenizer, generate, vocabulary
    >>> from attnreg.tiny import tiny_model
    >>> tokenizer = build_tokenizer(vocabulary())
    >>> model = tiny_model("bert", vocab=len(tokenizer)).eval()           # 2 layers x 4 heads
    >>> folder = Path(tempfile.mkdtemp())
    >>> with attnreg.attach(model).capture() as probs:
    ...     _ = model(**tokenizer("the keys near the table push the cars .", return_tensors="pt"))
    >>> figure = attention_grid(probs, path=folder / "attention.png")   # all layers x heads, one mosaic
    >>> analysis = analyze(model, tokenizer, [example.sentence for example in generate(8, seed=0)])
    >>> _ = head_grid(analysis.statistics["entropy"], title="normalized entropy", path=folder / "entropy.png")
    >>> _ = head_grid(analysis.roles().grid(), title="head roles", path=folder / "roles.png")
    >>> sorted(path.name for path in folder.iterdir())   # pruning_curve(iterative_pruning(...)): see below
    ['attention.png', 'entropy.png', 'roles.png']
    >>> from matplotlib.image import imread
    >>> figure.get_size_inches() * figure.dpi, imread(folder / "attention.png").shape   # (height, width, RGBA)
    (array([480., 280.]), (280, 480, 4))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ROLE_COLORS = {
    "dormant": "#4d4d4d",
    "positional": "#1f77b4",
    "syntactic": "#d62728",
    "no-op": "#bcbd22",
    "broad": "#2ca02c",
    "other": "#e0e0e0",
    "pruned": "#ffffff",
}
"""Colors of the head roles (`attnreg.analysis.ROLES`) in `head_grid`; other categories get tab10 colors."""


def _figure_class() -> type:
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("attnreg.analysis.plots needs matplotlib: pip install 'attnreg[plots]'") from error
    return Figure


def attention_grid(
    probs: torch.Tensor | Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
    tokens: Sequence[str] | None = None,
    path: str | Path | None = None,
    example: int = 0,
    length: int | None = None,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    max_pixels: int = 96,
    cell_inches: float = 1.0,
    dpi: int = 100,
    title: str | None = None,
    gamma: float = 0.5,
) -> Figure:
    """All layers x heads of one input: rows are layers, columns heads, each cell a query x key map.

    `probs`: `[L, H, T, S]`, or per layer `[H, T, S]` / `[B, H, T, S]` (a `hub.capture` record, a dict or
    a list; `example` picks the batch row). `length` keeps the first tokens only (drop padding). Each
    map is block-averaged down to `max_pixels` when longer, scaled to its own maximum and drawn as
    (value / max) ** gamma (dark = most attention; gamma < 1 lifts faint structure next to a sink
    column). With a single layer and head, `tokens` label the axes.

    Example:
        >>> import attnreg
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert", layers=3)                          # 3 layers x 4 heads
        >>> mask = torch.tensor([[1] * 9 + [0] * 3])                      # 9 tokens, 3 of padding
        >>> with attnreg.attach(model).capture() as probs:
        ...     _ = model(input_ids=torch.randint(3, 99, (1, 12)), attention_mask=mask)
        >>> figure = attention_grid(probs, length=int(mask[0].sum()))   # path="attention.png" saves it
        >>> axes = figure.axes[0]
        >>> axes.get_title(), [label.get_text() for label in axes.get_yticklabels()]
        ('attention, 9 tokens', ['L0', 'L1', 'L2'])
        >>> tokens = [f"t{index}" for index in range(9)]
        >>> figure = attention_grid(probs, tokens, length=9, layers=[2], heads=[3], cell_inches=6)  # one head
        >>> figure.axes[0].get_xlabel(), figure.axes[0].get_xticklabels()[1].get_text()
        ('layer 2, head 3: keys', 't1')
    """
    maps = _layer_maps(probs, example)
    chosen_layers = list(range(len(maps))) if layers is None else list(layers)
    for layer in chosen_layers:
        if not 0 <= layer < len(maps):
            raise IndexError(f"layers: {layer} is out of range, the attention has {len(maps)} layers")
    stacked = [maps[layer] for layer in chosen_layers]
    width = max(m.shape[0] for m in stacked)
    chosen_heads = list(range(width)) if heads is None else list(heads)
    for head in chosen_heads:
        if not 0 <= head < width:
            raise IndexError(f"heads: {head} is out of range, the layers have {width} heads")
    tokens_count = stacked[0].shape[-1] if length is None else length
    labelled = tokens is not None and len(stacked) == 1 and len(chosen_heads) == 1
    side = tokens_count if labelled else min(tokens_count, max_pixels)
    gap = max(1, side // 16)
    mosaic = np.full((len(stacked) * (side + gap) - gap, len(chosen_heads) * (side + gap) - gap), np.nan)
    for row, layer_maps in enumerate(stacked):
        cropped = layer_maps[:, :tokens_count, :tokens_count].float()
        if tokens_count > side:
            cropped = F.adaptive_avg_pool2d(cropped[None], (side, side))[0]
        for column, head in enumerate(chosen_heads):
            if head >= cropped.shape[0]:
                continue  # a pruned head: left blank
            cell = cropped[head]
            top, left = row * (side + gap), column * (side + gap)
            mosaic[top : top + side, left : left + side] = (cell / cell.max().clamp_min(1e-12)).pow(gamma).numpy()
    Figure = _figure_class()
    figure = Figure(
        figsize=(len(chosen_heads) * cell_inches + (1.6 if labelled else 0.8), len(stacked) * cell_inches + 0.8)
    )
    axes = figure.add_axes((0.0, 0.0, 1.0, 1.0))
    axes.set_position(_inner(figure, left=1.2 if labelled else 0.6, bottom=1.2 if labelled else 0.2, top=0.6))
    cmap = _colormap("Blues")
    axes.imshow(np.ma.masked_invalid(mosaic), cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto")
    if labelled:
        names = list(tokens)[:tokens_count]
        axes.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
        axes.set_yticks(range(len(names)), names, fontsize=7)
        axes.set_xlabel(f"layer {chosen_layers[0]}, head {chosen_heads[0]}: keys")
    else:
        step, middle = side + gap, (side - 1) / 2
        axes.set_xticks(np.arange(len(chosen_heads)) * step + middle, [f"H{h}" for h in chosen_heads], fontsize=7)
        axes.set_yticks(np.arange(len(stacked)) * step + middle, [f"L{n}" for n in chosen_layers], fontsize=7)
        axes.xaxis.tick_top()
        axes.tick_params(length=0)
    axes.set_title(title or f"attention, {tokens_count} tokens", fontsize=9, pad=14 if not labelled else 6)
    for spine in axes.spines.values():
        spine.set_visible(False)
    _save(figure, path, dpi)
    return figure


def head_grid(
    values: torch.Tensor | np.ndarray | Sequence[Sequence[Any]],
    title: str = "",
    path: str | Path | None = None,
    cmap: str = "viridis",
    vmin: float | None = None,
    vmax: float | None = None,
    annotate: bool | None = None,
    fmt: str = "{:.2f}",
    cell_inches: float = 0.45,
    dpi: int = 100,
) -> Figure:
    """A layers x heads grid of one value per head; NaN (a pruned head) is left blank.

    Numbers get a colorbar (and the values written in the cells when `annotate`, by default up to 400
    cells); strings (head roles, `HeadRoles.grid()`) are drawn as categories with a legend.

    Example:
        >>> accuracy = torch.tensor([[0.1, 0.5, float("nan")], [0.9, 0.2, 0.3]])   # NaN: a pruned head
        >>> figure = head_grid(accuracy, title="parent accuracy", vmin=0, vmax=1)  # path="parent.png" saves it
        >>> [text.get_text() for text in figure.axes[0].texts]          # the values in the cells
        ['0.10', '0.50', '0.90', '0.20', '0.30']
        >>> figure = head_grid([["positional", "broad"], ["syntactic", "pruned"]], title="head roles")
        >>> [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
        ['positional', 'syntactic', 'broad', 'pruned']
    """
    array = np.asarray(values.detach().cpu() if isinstance(values, torch.Tensor) else values, dtype=object)
    if array.ndim != 2:
        raise ValueError(f"values must be [layers, heads], got shape {array.shape}")
    layers, heads = array.shape
    categorical = any(isinstance(value, str) for value in array.flat)
    Figure = _figure_class()
    figure = Figure(figsize=(heads * cell_inches + (2.6 if categorical else 2.0), layers * cell_inches + 1.3))
    axes = figure.add_axes((0.0, 0.0, 1.0, 1.0))
    axes.set_position(_inner(figure, left=0.5, bottom=0.5, top=0.4, right=2.2 if categorical else 1.6))
    if categorical:
        names = [name for name in ROLE_COLORS if name in set(array.flat)]
        names += sorted({str(value) for value in array.flat} - set(names))
        palette = _colormap("tab10")
        colors = [ROLE_COLORS.get(name, palette(index % 10)) for index, name in enumerate(names)]
        codes = np.vectorize(lambda value: names.index(str(value)))(array).astype(float)
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch

        axes.imshow(codes, cmap=ListedColormap(colors), vmin=-0.5, vmax=len(names) - 0.5, aspect="auto")
        pairs = zip(names, colors, strict=True)
        handles = [Patch(facecolor=color, edgecolor="#999999", label=name) for name, color in pairs]
        axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7, frameon=False)
    else:
        numbers = array.astype(float)
        colormap = _colormap(cmap)
        image = axes.imshow(np.ma.masked_invalid(numbers), cmap=colormap, vmin=vmin, vmax=vmax, aspect="auto")
        figure.colorbar(image, ax=axes, fraction=0.04, pad=0.02).ax.tick_params(labelsize=7)
        if annotate if annotate is not None else layers * heads <= 400:
            low, high = image.get_clim()
            for layer in range(layers):
                for head in range(heads):
                    value = numbers[layer, head]
                    if math.isnan(value):
                        continue
                    shade = (value - low) / (high - low) if high > low else 0.0
                    axes.text(
                        head, layer, fmt.format(value), ha="center", va="center", fontsize=6,
                        color="black" if shade > 0.6 else "white",
                    )  # fmt: skip
    axes.set_xticks(range(heads), [str(h) for h in range(heads)], fontsize=7)
    axes.set_yticks(range(layers), [str(layer) for layer in range(layers)], fontsize=7)
    axes.set_xlabel("head", fontsize=8)
    axes.set_ylabel("layer", fontsize=8)
    axes.set_title(title, fontsize=9)
    _save(figure, path, dpi)
    return figure


def pruning_curve(
    curves: Sequence[Any] | Mapping[str, Sequence[Any]],  # PruningSteps (attnreg.methods.pruning)
    metric: str = "metric",
    path: str | Path | None = None,
    total_heads: int | None = None,
    figsize: tuple[float, float] = (5.0, 3.5),
    dpi: int = 100,
) -> Figure:
    """The metric against heads removed, one line per curve (`{"name": steps}` for several).

    With `total_heads`, a second axis on top gives the share of heads removed.

    Example:
        >>> from attnreg.methods.pruning import PruningStep
        >>> curve = [PruningStep(0, 0.90, {}), PruningStep(2, 0.89, {0: (1,), 1: (3,)})]   # iterative_pruning's
        >>> random_curve = [PruningStep(0, 0.90, {}), PruningStep(2, 0.71, {0: (0, 2)})]
        >>> figure = pruning_curve({"importance": curve, "random": random_curve}, metric="accuracy", total_heads=8)
        >>> axes = figure.axes[0]
        >>> [line.get_label() for line in axes.get_lines()], axes.get_ylabel()
        (['importance', 'random'], 'accuracy')
        >>> axes.get_lines()[1].get_ydata().tolist()
        [0.9, 0.71]
    """
    named = dict(curves) if isinstance(curves, Mapping) else {"": list(curves)}
    if not named or any(len(steps) == 0 for steps in named.values()):
        raise ValueError("pruning_curve needs at least one step in every curve")
    Figure = _figure_class()
    figure = Figure(figsize=figsize)
    axes = figure.add_axes((0.0, 0.0, 1.0, 1.0))
    axes.set_position(_inner(figure, left=0.8, bottom=0.6, top=0.7 if total_heads else 0.4, right=0.2))
    for name, steps in named.items():
        axes.plot([s.heads_removed for s in steps], [s.metric for s in steps], marker="o", markersize=3, label=name)
    axes.set_xlabel("heads removed", fontsize=8)
    axes.set_ylabel(metric, fontsize=8)
    axes.tick_params(labelsize=7)
    axes.grid(alpha=0.3)
    if len(named) > 1:
        axes.legend(fontsize=7, frameon=False)
    if total_heads:
        top = axes.secondary_xaxis("top", functions=(lambda x: 100 * x / total_heads, lambda p: p * total_heads / 100))
        top.set_xlabel("% of heads removed", fontsize=8)
        top.tick_params(labelsize=7)
    _save(figure, path, dpi)
    return figure


def _layer_maps(probs: Any, example: int) -> list[torch.Tensor]:
    """Per-layer `[H, T, S]` maps from the accepted inputs."""
    if isinstance(probs, torch.Tensor):
        if probs.dim() != 4:
            raise ValueError(f"probs as one tensor must be [layers, heads, T, S], got shape {tuple(probs.shape)}")
        layers = list(probs)
    else:
        layers = [probs[k] for k in sorted(probs)] if isinstance(probs, Mapping) else list(probs)
        layers = [layer[example] if layer.dim() == 4 else layer for layer in layers]
    if not layers:
        raise ValueError("attention_grid needs the attention of at least one layer")
    for index, layer in enumerate(layers):
        if layer.dim() != 3:
            raise ValueError(f"layer {index}: expected [heads, T, S], got shape {tuple(layer.shape)}")
    return [layer.detach().cpu() for layer in layers]


def _colormap(name: str) -> Any:
    from matplotlib import colormaps

    return colormaps[name].with_extremes(bad="white")


def _inner(figure: Figure, left: float, bottom: float, top: float, right: float = 0.2) -> tuple[float, ...]:
    """Axes position (figure fractions) leaving margins given in inches."""
    width, height = figure.get_size_inches()
    return (left / width, bottom / height, 1 - (left + right) / width, 1 - (bottom + top) / height)


def _save(figure: Figure, path: str | Path | None, dpi: int) -> None:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=dpi)
