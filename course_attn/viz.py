"""The book's figures: attention heatmaps (who attends to whom) and the benchmark's scaling plot.

Every attention map in the book is drawn by :func:`plot_attention`, so that one convention holds
on every page:

- **weights** (softmax outputs, in [0, 1]): the sequential map ``"Blues"`` on the fixed range
  [0, 1], so that the same shade is the same weight in every figure (a spread-out row is pale
  because its weights are small, not because of the figure's scale); darker is more weight,
  which survives greyscale printing and every colour-vision deficiency (lightness alone orders
  the map; tests/test_viz.py checks it under simulated protan-, deuteran- and tritanopia).
- **scores** (signed, any size): the diverging map ``"RdBu_r"``, centred at 0 and symmetric
  (-m to m, m the largest finite |score|): red positive, blue negative, white zero; lightest at
  zero, its two ends still told apart with any colour-vision deficiency.
- **masks** (a bool tensor, True where a query may attend, as in PyTorch's SDPA): allowed cells
  in the darkest weight colour, with a legend instead of a colour bar.
- **masked cells** (``mask=`` False, or a score that is -inf or NaN) are not drawn as a value at
  all: they are left out of the image (a masked array) and show a hatched grey background, so a
  masked cell never looks like a cell of weight 0. The colour bar's label says so. The
  pattern, not a colour, marks them.
- every numeric map has a colour bar; a grid of heads shares one colour bar and one scale.

Figures are drawn with matplotlib's object-oriented API. pyplot only creates each figure and
then lets go of it (``plt.close(fig)``), so no global state is left behind: a notebook shows a
returned figure once, when it is a cell's last expression, and a script saves it with
``fig.savefig(...)``.
"""

import itertools
import math
from collections.abc import Sequence

import matplotlib
import numpy as np
import torch
from matplotlib import pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator

from .arguments import check_positive_ints

__all__ = ["overlapping_tick_labels", "plot_attention", "plot_bench"]

# Weights: a light-to-dark single-hue map on [0, 1]. Scores: a diverging map centred at 0.
WEIGHTS_CMAP = "Blues"
SCORES_CMAP = "RdBu_r"
DEFAULT_CMAP = WEIGHTS_CMAP
# Masked cells: left out of the image, over a hatched grey background.
MASKED_COLOUR = "0.88"
MASKED_HATCH_COLOUR = "0.55"
MASKED_HATCH = "///"
MAX_LABELLED_TICKS = 64
# How far outside [0, 1] a value may be (rounding in low precision) and still count as a weight.
WEIGHT_TOLERANCE = 1e-3


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


def _as_cpu_tensor(x) -> torch.Tensor:
    t = torch.as_tensor(x.detach() if isinstance(x, torch.Tensor) else np.asarray(x))
    return t.to("cpu")


def _allowed(mask, shape: tuple[int, ...]) -> torch.Tensor:
    """``mask`` (True = may attend) broadcast to ``shape``; ValueError when it cannot be."""
    m = _as_cpu_tensor(mask)
    if m.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor (True where a query may attend), "
                         f"got dtype {m.dtype}")
    try:
        return torch.broadcast_to(m, shape)
    except RuntimeError:
        raise ValueError(f"mask of shape {tuple(m.shape)} does not broadcast to the weights' "
                         f"shape {shape}") from None


def _hatch_under(ax: Axes, tq: int, tk: int) -> None:
    """A hatched grey rectangle under the image: what masked (left-out) cells show."""
    ax.add_patch(Rectangle((-0.5, -0.5), tk, tq, facecolor=MASKED_COLOUR,
                           edgecolor=MASKED_HATCH_COLOUR, hatch=MASKED_HATCH, linewidth=0,
                           zorder=0))


def _masked_patch(label: str = "masked") -> Patch:
    return Patch(facecolor=MASKED_COLOUR, edgecolor=MASKED_HATCH_COLOUR, hatch=MASKED_HATCH,
                 label=label)


def plot_attention(weights, tokens=None, *, query_tokens=None, title: str | None = None,
                   head_titles: Sequence[str] | None = None, cols: int = 4,
                   ax: Axes | None = None, mask=None, signed: bool | None = None,
                   colorbar: bool = True, colorbar_label: str | None = None,
                   cmap: str | None = None, vmin: float | None = None,
                   vmax: float | None = None) -> Figure:
    """Heatmap(s) of attention: queries on rows, keys on columns. Returns the Figure.

    ``weights``: (Tq, Tk) for one map, or (H, Tq, Tk) for a grid of H heads, ``cols`` per row;
    a tensor on any device and of any dtype, or an array. What it holds decides the colours
    (the module docstring has the convention):

    - attention weights in [0, 1]: sequential ``"Blues"`` on [0, 1], colour bar "weight";
    - signed scores: diverging ``"RdBu_r"`` centred at 0, colour bar "score";
    - a bool mask (True = may attend): allowed cells dark, masked cells hatched, a legend.

    ``signed``: None (default) decides from the data (scores when a finite, unmasked value lies
    outside [0, 1]); True or False forces scores or weights. ``mask``: bool, broadcastable to
    ``weights``, True where a query may attend (SDPA's convention); False cells are drawn as
    masked. Entries that are -inf, +inf or NaN (masked scores) are drawn as masked too. Pass
    ``mask=`` for weights after a softmax, whose masked cells are plain zeros.

    ``tokens``: Tk key labels (e.g. ``token_labels(ids)``); ``query_tokens``: Tq row labels, by
    default the last Tq of ``tokens`` (queries are the latest tokens, as with a KV cache).
    ``ax``: draw a (Tq, Tk) map into this Axes (its colour bar beside it) instead of a new
    figure. ``colorbar=False`` leaves the colour bar out (e.g. when several panels share one you
    add yourself); ``colorbar_label`` replaces "weight" / "score". ``cmap``, ``vmin``, ``vmax``
    override the convention; use them sparingly, so that figures stay comparable.
    """
    w = _as_cpu_tensor(weights)
    if w.dim() not in (2, 3):
        raise ValueError(f"weights must be (Tq, Tk) or (H, Tq, Tk), got shape {tuple(w.shape)}")
    if ax is not None and w.dim() != 2:
        raise ValueError(f"ax draws one (Tq, Tk) map; got weights of shape {tuple(w.shape)}")
    check_positive_ints(cols=cols)
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

    # Which cells are masked: mask= False, the mask itself when it is what we draw, non-finite.
    is_mask_picture = maps.dtype == torch.bool
    allowed = torch.ones(maps.shape, dtype=torch.bool)
    if mask is not None:
        allowed &= _allowed(mask, tuple(w.shape)).reshape(maps.shape)
    if is_mask_picture:
        allowed &= maps
        values = torch.ones(maps.shape)
    else:
        values = maps.float()
        allowed &= torch.isfinite(values)
    shown = values[allowed]
    any_masked = not bool(allowed.all())

    if is_mask_picture:
        lo, hi, colours = 0.0, 1.0, matplotlib.colormaps[cmap or WEIGHTS_CMAP]
        label = None
    else:
        if signed is None:
            signed = bool(shown.numel()) and bool(((shown < -WEIGHT_TOLERANCE)
                                                   | (shown > 1 + WEIGHT_TOLERANCE)).any())
        if signed:
            m = shown.abs().max().item() if shown.numel() else 1.0
            m = m if m > 0 else 1.0
            lo, hi = -m, m
            colours = matplotlib.colormaps[cmap or SCORES_CMAP]
            label = "score" if colorbar_label is None else colorbar_label
        else:
            lo, hi = 0.0, 1.0
            colours = matplotlib.colormaps[cmap or WEIGHTS_CMAP]
            label = "weight" if colorbar_label is None else colorbar_label
        if any_masked:
            label += " (hatched: masked)"
    lo, hi = lo if vmin is None else vmin, hi if vmax is None else vmax
    if not hi > lo:
        raise ValueError(f"vmax must be larger than vmin, got vmin={lo}, vmax={hi}")
    colours = colours.with_extremes(bad=(0.0, 0.0, 0.0, 0.0))   # masked: see-through to hatch
    data = np.ma.masked_array(values.numpy(), mask=~allowed.numpy())

    n_cols = min(cols, n_heads)
    if ax is not None:
        fig, axes = ax.figure, [ax]
    elif w.dim() == 2:
        side = min(9.0, max(3.0, 0.22 * max(tq, tk) + 1.5))
        fig = _new_figure(side + (1.0 if colorbar or is_mask_picture else 0.0), side)
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
        if any_masked:
            _hatch_under(panel_ax, tq, tk)
        image = panel_ax.imshow(data[h], cmap=colours, vmin=lo, vmax=hi,
                                interpolation="nearest", aspect="equal", zorder=1)
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
    if is_mask_picture:
        allowed_patch = Patch(facecolor=colours(1.0), label="may attend")
        handles = [allowed_patch, _masked_patch()] if any_masked else [allowed_patch]
        legend_ax = axes[min(n_cols, len(axes)) - 1]                # the first row's last map
        legend_ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                         fontsize=8, frameon=False, borderaxespad=0)
    elif colorbar and len(axes) == 1:
        # Beside the map itself, as tall as it is: an inset follows the box that the equal
        # aspect leaves, where a colour bar taken from the layout would span the whole cell.
        bar_ax = axes[0].inset_axes([1.04, 0.0, 0.05, 1.0])
        bar_ax.set_label("<colorbar>")
        fig.colorbar(image, cax=bar_ax, label=label)
    elif colorbar:
        fig.colorbar(image, ax=axes, shrink=0.8, label=label)
    return fig


def _plain_number(y: float, _position=None) -> str:
    return f"{y:g}"


def plot_bench(rows, *, title: str | None = None) -> Figure:
    """Time and peak memory against sequence length T, one line per backend, log-log.

    ``rows``: ``course_attn.bench.BenchRow``s (anything with ``backend``, ``seq_len``,
    ``time_ms``, ``peak_mib`` and ``error``); failed rows and missing values are left out. The
    T axis is in base 2 with a tick, labelled in plain numbers, at each measured T and no minor
    tick labels (on a log axis matplotlib's own minor labels, such as 3×10², land on the
    measured ones); the value axes are labelled 1, 2, 5, 10, ... The left panel is time per
    call (ms), the right one peak extra memory (MiB); a time whose warm-up did not settle
    (``settled`` False, where the rows have that field) is an open marker, "not settled" in the
    legend. Returns the Figure.
    """
    ok = [r for r in rows if r.error is None]
    if not ok:
        raise ValueError("no successful row to plot")
    seq_lens = sorted({r.seq_len for r in ok})
    fig = _new_figure(10.0, 4.2)
    ax_time, ax_mem = fig.subplots(1, 2)
    unsettled = []
    for name in sorted({r.backend for r in ok}):
        mine = sorted((r for r in ok if r.backend == name), key=lambda r: r.seq_len)
        for ax, field in ((ax_time, "time_ms"), (ax_mem, "peak_mib")):
            points = [(r.seq_len, getattr(r, field)) for r in mine if getattr(r, field)]
            if points:
                (line,) = ax.plot(*zip(*points), "o-", label=name)
            if field == "time_ms":
                rough = [(r.seq_len, r.time_ms) for r in mine
                         if r.time_ms and getattr(r, "settled", None) is False]
                if rough:
                    unsettled += ax.plot(*zip(*rough), "o", color=line.get_color(),
                                         markerfacecolor="white", zorder=3)
    for ax, label in ((ax_time, "time per call (ms)"), (ax_mem, "peak extra memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(seq_lens))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda t, _: f"{t:g}"))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(_plain_number))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set(xlabel="sequence length T", ylabel=label)
        ax.grid(True, which="major", alpha=0.3)
        if ax.get_lines():
            handles, labels = ax.get_legend_handles_labels()
            if ax is ax_time and unsettled:
                handles.append(Line2D([], [], marker="o", linestyle="", color="0.3",
                                      markerfacecolor="white"))
                labels.append("not settled")
            ax.legend(handles, labels)
    if title is not None:
        fig.suptitle(title)
    return fig


def overlapping_tick_labels(fig: Figure) -> list[tuple[str, str]]:
    """Pairs of tick labels, on the same axis of ``fig``, that are drawn on top of each other.

    Draws the figure, then compares the boxes of the labels that are visible and non-empty and
    whose tick lies within the axis' view (major and minor ticks alike). An empty list means
    every label can be read.
    """
    fig.draw_without_rendering()               # lays out and places every label
    clashes = []
    for ax in fig.axes:
        for axis, view in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = sorted(view)
            labels = []
            for locs, ticks in ((axis.get_majorticklocs(), axis.get_major_ticks()),
                                (axis.get_minorticklocs(), axis.get_minor_ticks())):
                for loc, tick in zip(locs, ticks):          # in the same order, as drawn
                    labels += [text for text in (tick.label1, tick.label2)
                               if lo <= loc <= hi and text.get_visible() and text.get_text()]
            boxes = [(t.get_text(), t.get_window_extent()) for t in labels]
            clashes += [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2)
                        if box_a.overlaps(box_b)]
    return clashes
