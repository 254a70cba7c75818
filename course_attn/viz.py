"""Attention heatmaps: who attends to whom.

Figures are drawn with matplotlib's object-oriented API. pyplot only creates each figure and
then lets go of it (``plt.close(fig)``), so no global state is left behind: a notebook shows a
returned figure once, when it is a cell's last expression, and a script saves it with
``fig.savefig(...)``.
"""

import math
from collections.abc import Sequence

import matplotlib
import numpy as np
import torch
from matplotlib import pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

__all__ = ["plot_attention"]

# A light-to-dark single-hue map: higher weight is darker, which survives greyscale printing.
DEFAULT_CMAP = "Blues"
# Entries that are -inf or NaN (e.g. masked scores) are drawn in this grey, not as 0.
MASKED_COLOUR = "0.8"
MAX_LABELLED_TICKS = 64


def _labels(labels, n: int, name: str, counted: str) -> list[str]:
    """``labels`` as n strings; ValueError naming ``name`` unless there are exactly n."""
    if isinstance(labels, torch.Tensor):
        labels = labels.tolist()
    if isinstance(labels, str) or not isinstance(labels, Sequence):
        raise ValueError(f"{name} must be a sequence of labels, got {type(labels).__name__}")
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} labels but the weights have {n} {counted}")
    return [str(label) for label in labels]


def _label_axis(axis, labels: list[str] | None, n: int) -> None:
    if labels is None:
        axis.get_major_locator().set_params(integer=True)
        return
    step = math.ceil(n / MAX_LABELLED_TICKS)
    axis.set_ticks(range(0, n, step), labels[::step])


def _new_figure(width: float, height: float) -> Figure:
    # Created through pyplot so that Jupyter's inline backend can render it, then released so
    # that pyplot neither shows it a second time nor keeps it alive.
    fig = plt.figure(figsize=(width, height), layout="constrained")
    plt.close(fig)
    return fig


def plot_attention(weights, tokens=None, *, query_tokens=None, title: str | None = None,
                   head_titles: Sequence[str] | None = None, cols: int = 4, ax: Axes | None = None,
                   cmap: str = DEFAULT_CMAP, colorbar_label: str = "weight") -> Figure:
    """Heatmap(s) of attention weights: queries on rows, keys on columns, with a colour bar.

    ``weights``: (Tq, Tk) for one map, or (H, Tq, Tk) for a grid of H heads, ``cols`` per row
    (a tensor on any device and of any float dtype, or an array). ``tokens``: Tk key labels
    (e.g. ``token_labels(ids)``); ``query_tokens``: Tq row labels, by default the last Tq of
    ``tokens`` (queries are the latest tokens, as with a KV cache). ``ax``: draw a (Tq, Tk) map
    into this Axes instead of a new figure. The colour scale starts at 0 (lower only for negative
    scores) and is shared by all heads; -inf and NaN entries (masked scores) are drawn grey. Returns the Figure.
    """
    w = torch.as_tensor(weights).detach().to("cpu").float()
    if w.dim() not in (2, 3):
        raise ValueError(f"weights must be (Tq, Tk) or (H, Tq, Tk), got shape {tuple(w.shape)}")
    if ax is not None and w.dim() != 2:
        raise ValueError(f"ax draws one (Tq, Tk) map; got weights of shape {tuple(w.shape)}")
    if isinstance(cols, bool) or not isinstance(cols, int) or cols < 1:
        raise ValueError(f"cols must be a positive int, got {cols!r}")
    maps = w if w.dim() == 3 else w.unsqueeze(0)                       # (H, Tq, Tk)
    n_heads, tq, tk = maps.shape
    if tq == 0 or tk == 0 or n_heads == 0:
        raise ValueError(f"weights must not be empty, got shape {tuple(w.shape)}")
    key_labels = None if tokens is None else _labels(tokens, tk, "tokens", "keys (Tk)")
    if query_tokens is not None:
        query_labels = _labels(query_tokens, tq, "query_tokens", "queries (Tq)")
    elif key_labels is not None and tq <= tk:
        query_labels = key_labels[tk - tq:]
    elif key_labels is not None:
        raise ValueError(f"{tq} queries but only {tk} key tokens: pass query_tokens")
    else:
        query_labels = None
    if head_titles is not None:
        head_titles = _labels(head_titles, n_heads, "head_titles", "heads")
    elif w.dim() == 3:
        head_titles = [f"head {h}" for h in range(n_heads)]

    finite = maps[torch.isfinite(maps)]
    vmin = min(0.0, finite.min().item()) if finite.numel() else 0.0
    vmax = finite.max().item() if finite.numel() else 1.0
    vmax = vmax if vmax > vmin else vmin + 1.0
    colours = matplotlib.colormaps[cmap].with_extremes(bad=MASKED_COLOUR)
    data = np.ma.masked_invalid(maps.numpy())

    n_cols = min(cols, n_heads)
    if ax is not None:
        fig, axes = ax.figure, [ax]
    elif w.dim() == 2:
        side = min(9.0, max(3.0, 0.22 * max(tq, tk) + 1.5))
        fig = _new_figure(side + 1.0, side)
        axes = [fig.add_subplot()]
    else:
        n_rows = math.ceil(n_heads / n_cols)
        panel = min(4.0, max(2.2, 0.14 * max(tq, tk)))
        fig = _new_figure(panel * n_cols + 1.0, panel * n_rows + (0.4 if title else 0.0))
        grid = fig.subplots(n_rows, n_cols, squeeze=False).ravel()
        for extra in grid[n_heads:]:
            fig.delaxes(extra)
        axes = list(grid[:n_heads])
        if title is not None:
            fig.suptitle(title)

    for h, panel_ax in enumerate(axes):
        image = panel_ax.imshow(data[h], cmap=colours, vmin=vmin, vmax=vmax,
                                interpolation="nearest", aspect="equal")
        _label_axis(panel_ax.xaxis, key_labels, tk)
        _label_axis(panel_ax.yaxis, query_labels, tq)
        if key_labels is not None and max(map(len, key_labels)) > 2:
            panel_ax.tick_params(axis="x", labelrotation=90)
        panel_ax.tick_params(labelsize=8 if max(tq, tk) <= 32 else 6)
        first_column, bottom_of_column = h % n_cols == 0, h + n_cols >= len(axes)
        panel_ax.tick_params(labelleft=first_column, labelbottom=bottom_of_column)
        if first_column:
            panel_ax.set_ylabel("query")
        if bottom_of_column:
            panel_ax.set_xlabel("key")
        if head_titles is not None:
            panel_ax.set_title(head_titles[h], fontsize=10)
    if w.dim() == 2 and title is not None:
        axes[0].set_title(title)
    fig.colorbar(image, ax=axes, shrink=0.8 if len(axes) > 1 else 1.0, label=colorbar_label)
    return fig
