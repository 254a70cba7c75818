"""The book's figures: attention heatmaps (who attends to whom), the benchmark's scaling plot, and
their interactive versions for the built book.

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

**Interactive figures** (:func:`interactive_attention`, :func:`interactive_curves`) are Vega-Lite
charts for the built book, through one class, :class:`InteractiveFigure`: hover a cell or a point
for its values; a :class:`Slider` steps through frames the notebook precomputed. They keep the
conventions above (the same colour maps, masked cells grey and crossed, lines told apart by dash as
well as colour) and carry a static matplotlib figure, drawn by the same code as the still
figures, for wherever no browser runs Vega (nbval, JupyterLab, Colab, a PDF). The book serves
Vega itself (``_ext/interactive_figures.py``), so the charts work offline.

Figures are drawn with matplotlib's object-oriented API. pyplot only creates each figure and
then lets go of it (``plt.close(fig)``), so no global state is left behind: a notebook shows a
returned figure once, when it is a cell's last expression, and a script saves it with
``fig.savefig(...)``.
"""

import base64
import hashlib
import html
import io
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

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

__all__ = ["InteractiveFigure", "Slider", "interactive_attention", "interactive_curves",
           "overlapping_tick_labels", "plot_attention", "plot_bench"]

# Weights: a light-to-dark single-hue map on [0, 1]. Scores: a diverging map centred at 0.
WEIGHTS_CMAP = "Blues"
SCORES_CMAP = "RdBu_r"
DEFAULT_CMAP = WEIGHTS_CMAP
# Masked cells: left out of the image, over a hatched grey background.
MASKED_COLOUR = "0.88"
MASKED_HATCH_COLOUR = "0.55"
MASKED_HATCH = "///"
# The same, in the interactive figures (which mark a masked cell with a cross, not a hatch).
MASKED_COLOUR_HEX = "#e0e0e0"
MASKED_MARK_HEX = "#595959"
MAY_ATTEND_HEX = "#08306b"                   # Blues at 1: plot_attention's "may attend"
OUTLINE_COLOUR = "#d62728"                   # rings around cells a caller points out (tab:red)
# Lines tell series apart by dash and marker as well as colour.
_LINE_STYLES = ("o-", "s--", "^:", "d-.")
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


def _axis_labels(tokens, query_tokens, tq: int,
                 tk: int) -> tuple[list[str] | None, list[str] | None]:
    """(key labels, query labels) of a (Tq, Tk) map; None for an axis that is only numbered.

    The queries are by default the last Tq of ``tokens`` (the latest tokens, as with a KV cache).
    """
    key_labels = None if tokens is None else _labels(tokens, tk, "tokens", "keys (Tk)")
    if query_tokens is not None:
        return key_labels, _labels(query_tokens, tq, "query_tokens", "queries (Tq)")
    if key_labels is not None and tq > tk:
        raise ValueError(f"{tq} queries but only {tk} key tokens: pass query_tokens")
    return key_labels, None if key_labels is None else key_labels[tk - tq:]


def _colour_scale(shown: torch.Tensor, is_mask_picture: bool,
                  signed: bool | None) -> tuple[float, float, str, str]:
    """(lo, hi, colour map, what a value is called) by the module's convention.

    ``shown``: the values drawn (finite, not masked); ``signed`` None decides from them (scores
    when one lies outside [0, 1]). Scores span -m..m, m the largest |score|; weights and masks
    span [0, 1].
    """
    if is_mask_picture:
        return 0.0, 1.0, WEIGHTS_CMAP, "may attend"
    if signed is None:
        signed = bool(shown.numel()) and bool(((shown < -WEIGHT_TOLERANCE)
                                               | (shown > 1 + WEIGHT_TOLERANCE)).any())
    if not signed:
        return 0.0, 1.0, WEIGHTS_CMAP, "weight"
    m = shown.abs().max().item() if shown.numel() else 1.0
    m = m if m > 0 else 1.0
    return -m, m, SCORES_CMAP, "score"


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
    key_labels, query_labels = _axis_labels(tokens, query_tokens, tq, tk)
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

    lo, hi, convention, name = _colour_scale(shown, is_mask_picture, signed)
    colours = matplotlib.colormaps[cmap or convention]
    label = None                                   # a mask has a legend, not a colour bar
    if not is_mask_picture:
        label = name if colorbar_label is None else colorbar_label
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
    call (ms), the right one peak extra memory (MiB); a time whose rounds did not agree
    (``settled`` False, where the rows have that field: the interquartile range of its times over
    the rounds above ``timing.SPREAD_TOLERANCE`` of their median, or fewer than
    ``timing.MIN_ROUNDS`` rounds) is an open marker, "not settled" in the legend. Ratios are not
    plotted, so a withheld one (``time_ratio`` None) changes nothing here. Returns the Figure.
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


# ---------------------------------------------------------------------------------------------
# Interactive figures: Vega-Lite in the built book, the matplotlib figure everywhere else.
# ---------------------------------------------------------------------------------------------

# The class the book's extension (_ext/interactive_figures.py) looks for to load Vega on a page.
INTERACTIVE_CLASS = "course-interactive"
# Vega's names for the two colour conventions above: "blues" is Blues; "redblue" reversed, RdBu_r.
_VEGA_SCHEMES = {WEIGHTS_CMAP: ("blues", False), SCORES_CMAP: ("redblue", True)}
_DIGITS = 4                                  # decimals kept of each value in a figure's data
# The browser draws what these carry; the figure's own fallback image is the first thing shown.
_EMBED_SCRIPT = """<script>(() => {
  const figure = document.getElementById(%(id)s);
  const draw = () => {
    if (typeof vegaEmbed === "undefined") return;        /* no Vega here: the image stays */
    vegaEmbed(figure.querySelector(".course-chart"), %(spec)s,
              {mode: "vega-lite", renderer: "svg", actions: false})
      .then(result => {
        figure.querySelector(".course-fallback").remove();
        (window.courseFigures = window.courseFigures || {})[%(id)s] = result.view;
      })
      .catch(error => console.error("interactive figure " + %(id)s + ": " + error));
  };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", draw);
  else draw();
})();</script>"""


@dataclass(frozen=True)
class Slider:
    """A knob under an interactive figure: ``name`` (the label shown) over evenly spaced ``values``.

    The figure holds one precomputed frame per value; moving the slider shows that frame.
    ``start``: the value shown first, and drawn in the static fallback (default: the first).
    """

    name: str
    values: tuple[float, ...]
    start: float | None = None

    def __post_init__(self):
        values = tuple(float(v) for v in self.values)
        object.__setattr__(self, "values", values)
        if len(values) < 2:
            raise ValueError(f"slider {self.name!r} needs at least 2 values, got {len(values)}")
        steps = np.diff(values)
        if not (steps > 0).all() or not np.allclose(steps, steps[0], rtol=1e-6, atol=0):
            raise ValueError(f"slider {self.name!r}: values must increase in equal steps "
                             f"(a range input), got {values}; slide over log2 of the "
                             "parameter when it doubles")
        start = values[0] if self.start is None else float(self.start)
        if start not in values:
            raise ValueError(f"slider {self.name!r}: start={self.start} is not one of its values")
        object.__setattr__(self, "start", start)

    @property
    def step(self) -> float:
        return self.values[1] - self.values[0]

    @property
    def start_index(self) -> int:
        return self.values.index(self.start)

    def param(self) -> dict:
        """The Vega-Lite parameter, bound to a range input, that this slider sets."""
        return {"name": "knob", "value": self.start,
                "bind": {"input": "range", "min": self.values[0], "max": self.values[-1],
                         "step": self.step, "name": f"{self.name} "}}

    def keeps(self) -> dict:
        """The filter that keeps the frame of the slider's value (equal within half a step)."""
        return {"filter": f"abs(datum.frame - knob) < {self.step / 2!r}"}


class InteractiveFigure:
    """A figure that a reader can hover and slide in the book, and a static image elsewhere.

    ``spec``: a Vega-Lite specification (a dict; its data inline). ``fallback``: the matplotlib
    Figure shown where no browser runs Vega (nbval, a PDF, a notebook in JupyterLab or Colab)
    and in the book until Vega has drawn. ``alt``: what the figure shows, in words (the image's
    alt text and the chart's accessible description).

    In a notebook, the last expression of a cell shows it (``_repr_mimebundle_``): text/html
    (the fallback image, then a script that replaces it with the Vega chart when the page has
    Vega, which the book's ``_ext/interactive_figures.py`` serves from the site) and image/png
    (the fallback alone, for what does not render HTML). ``to_html()`` is the HTML alone.
    """

    def __init__(self, spec: dict, fallback: Figure, alt: str):
        if not alt or not alt.strip():
            raise ValueError("an interactive figure needs alt text that says what it shows")
        self.spec = {**spec, "description": alt}
        self.fallback = fallback
        self.alt = alt

    def png(self) -> bytes:
        buffer = io.BytesIO()
        self.fallback.savefig(buffer, format="png", bbox_inches="tight")
        return buffer.getvalue()

    def to_html(self) -> str:
        return self._html(base64.b64encode(self.png()).decode())

    def _html(self, image: str) -> str:
        """The HTML around ``image``, the fallback PNG in base64."""
        spec = json.dumps(self.spec, separators=(",", ":"), allow_nan=False)
        figure_id = "figure-" + hashlib.sha1(spec.encode()).hexdigest()[:12]
        # JSON inside <script>: "</" would end the script early.
        script = _EMBED_SCRIPT % {"id": json.dumps(figure_id),
                                  "spec": spec.replace("</", "<\\/")}
        alt = html.escape(self.alt, quote=True)
        return (f'<div class="{INTERACTIVE_CLASS}" id="{figure_id}" role="figure" '
                f'aria-label="{alt}" style="background:#fff;color:#1a1a1a;padding:4px">'
                f'<img class="course-fallback" src="data:image/png;base64,{image}" alt="{alt}" '
                f'style="max-width:100%"><div class="course-chart"></div></div>{script}')

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        image = base64.b64encode(self.png()).decode()          # drawn once, shown in both
        return {"text/html": self._html(image), "image/png": image,
                "text/plain": f"<InteractiveFigure: {self.alt}>"}

    def __repr__(self) -> str:
        return f"<InteractiveFigure: {self.alt}>"


def _frames(values: torch.Tensor, slider: Slider | None, dims: tuple[int, ...],
            what: str) -> torch.Tensor:
    """``values`` with a leading frame axis: (S, ...) with a slider, (1, ...) without one.

    ``dims``: how many dims one frame may have; ValueError naming ``what`` otherwise."""
    frame_dims = values.dim() - (slider is not None)
    if slider is not None and (values.dim() == 0 or values.shape[0] != len(slider.values)):
        frame_dims = -1
    if frame_dims not in dims:
        shapes = " or ".join(f"{d + (slider is not None)} dims" for d in dims)
        lead = f"with a slider of {len(slider.values)} values, a leading axis of that size and "\
            if slider is not None else "without a slider, "
        raise ValueError(f"{what} needs {lead}{shapes}; got shape {tuple(values.shape)}")
    return values if slider is not None else values.unsqueeze(0)


def _rounded(x: float) -> float:
    return round(float(x), _DIGITS)


def _position(i: int, label: str) -> str:
    """How a tooltip names position i: "3: a" with a token, "3" when the label is the number."""
    return str(i) if label == str(i) else f"{i}: {label}"


def _token_axis(labels: list[str], title: str, across: bool = False) -> dict:
    """A Vega-Lite axis over positions 0..n-1 that writes each position's token; a horizontal
    axis turns labels longer than two characters on end, as plot_attention does."""
    turn = across and max(map(len, labels)) > 2
    return {"title": title, "labelExpr": f"{json.dumps(labels)}[datum.value]",
            "labelAngle": -90 if turn else 0}


def interactive_attention(weights, tokens=None, *, alt: str, query_tokens=None,
                          title: str | None = None, head_titles: Sequence[str] | None = None,
                          cols: int = 4, mask=None, signed: bool | None = None,
                          slider: Slider | None = None, value_label: str | None = None,
                          outline=None) -> InteractiveFigure:
    """Attention map(s) whose cells tell, on hover, the query, the key and the weight.

    ``weights``: (Tq, Tk) or (H, Tq, Tk) as for :func:`plot_attention`, with a leading axis of
    one frame per slider value when ``slider`` is given: (S, Tq, Tk) or (S, H, Tq, Tk). The
    colours, the masked cells (``mask=`` False or a non-finite score; drawn grey and crossed, so
    that a pattern and not a colour marks them) and ``tokens``/``query_tokens``/``head_titles``
    /``signed`` follow :func:`plot_attention`, which draws the static fallback (the slider's
    ``start`` frame); with a slider, ``mask`` may have the frame axis too (one mask per frame).
    A bool tensor draws a mask (allowed cells dark, "may attend: yes" on hover; masked cells grey
    and crossed). ``value_label`` names the value in the tooltip (default "weight", "score" or
    "may attend"). ``outline``: bool, broadcastable to one frame, True at cells to ring (e.g.
    where a rule says a head should look); rings are drawn in both versions. Returns an
    :class:`InteractiveFigure`.
    """
    w = _as_cpu_tensor(weights)
    frames = _frames(w, slider, (2, 3), "weights ((Tq, Tk) or (H, Tq, Tk) per frame)")
    per_frame = frames[0]
    shown = slider.start_index if slider else 0
    frame_masks = None                                    # (S, ...) like frames, or None
    if mask is not None:
        m = _as_cpu_tensor(mask)
        each_frame = slider is not None and m.dim() == frames.dim()   # one mask per frame
        frame_masks = (_allowed(m, tuple(frames.shape)) if each_frame
                       else _allowed(m, tuple(per_frame.shape)).expand(frames.shape))
    fallback = plot_attention(frames[shown], tokens, query_tokens=query_tokens, title=title,
                              head_titles=head_titles, cols=cols, signed=signed,
                              mask=None if frame_masks is None else frame_masks[shown])
    maps = frames if per_frame.dim() == 3 else frames.unsqueeze(1)          # (S, H, Tq, Tk)
    n_frames, n_heads, tq, tk = maps.shape
    ringed = torch.zeros(maps.shape[1:], dtype=torch.bool)                  # (H, Tq, Tk)
    if outline is not None:
        ringed |= _allowed(outline, tuple(per_frame.shape)).reshape(ringed.shape)
        for h, panel_ax in enumerate(fallback.axes[:n_heads]):
            rows_, cols_ = torch.nonzero(ringed[h], as_tuple=True)
            panel_ax.scatter(cols_.numpy(), rows_.numpy(), s=90, facecolors="none",
                             edgecolors=OUTLINE_COLOUR, linewidths=1.5, zorder=3)
    key_labels, query_labels = _axis_labels(tokens, query_tokens, tq, tk)
    if key_labels is None:
        key_labels = [str(j) for j in range(tk)]
    if query_labels is None:
        query_labels = [str(i) for i in range(tq)]
    names = (list(head_titles) if head_titles is not None
             else [f"head {h}" for h in range(n_heads)])

    is_mask_picture = maps.dtype == torch.bool
    allowed = torch.ones(maps.shape, dtype=torch.bool)
    if frame_masks is not None:
        allowed &= frame_masks.reshape(maps.shape)
    values = maps.float()
    allowed &= maps if is_mask_picture else torch.isfinite(values)
    lo, hi, scheme, name = _colour_scale(values[allowed], is_mask_picture, signed)
    label = value_label or name

    rows = []
    for s, h, i, j in itertools.product(range(n_frames), range(n_heads), range(tq), range(tk)):
        ok = bool(allowed[s, h, i, j])
        value = _rounded(values[s, h, i, j]) if ok else 0.0
        shown = ("yes" if is_mask_picture else f"{value:.3f}") if ok else "masked"
        rows.append({"frame": slider.values[s] if slider else 0, "head": names[h], "qi": i,
                     "ki": j, "query": _position(i, query_labels[i]),
                     "key": _position(j, key_labels[j]), "masked": not ok, "value": value,
                     "shown": shown, "ringed": bool(ringed[h, i, j])})
        rows[-1]["who"] = (f"{names[h]}, " * (n_heads > 1)
                           + f"query {rows[-1]['query']}, key {rows[-1]['key']}")
    vega_scheme, reverse = _VEGA_SCHEMES[scheme]
    x = {"field": "ki", "type": "ordinal", "axis": _token_axis(key_labels, "key", across=True)}
    y = {"field": "qi", "type": "ordinal", "axis": _token_axis(query_labels, "query")}
    masked_grey = {"test": "datum.masked", "value": MASKED_COLOUR_HEX}
    if is_mask_picture:          # one colour for "may attend" (the crosses mark the others)
        colour = {"condition": masked_grey, "value": MAY_ATTEND_HEX}
    else:
        colour = {"condition": masked_grey, "field": "value", "type": "quantitative",
                  "title": label, "scale": {"scheme": vega_scheme, "reverse": reverse,
                                            "domain": [lo, hi]}}
    tooltip = [{"field": "head", "title": "map"}] * (n_heads > 1) + [
        {"field": "query", "title": "query"}, {"field": "key", "title": "key"},
        {"field": "shown", "title": label}]
    # 18 px a cell, 120..360 px a map, a row of maps within 520 px (the book's column, about
    # 670 px wide, also holds the axis and the colour bar); labels as tall as a cell allows.
    side = max(120, min(360, 18 * max(tq, tk), 520 // min(cols, n_heads)))
    label_size = max(6, min(10, side // max(tq, tk)))
    cell = {"width": side, "height": side * tq / tk if tq < tk else side,
            "layer": [
                {"mark": {"type": "rect", "stroke": "white", "strokeWidth": 0.5},
                 "encoding": {
                     "x": x, "y": y,
                     "color": colour,
                     "tooltip": tooltip, "description": {"field": "aria"}}},
                {"transform": [{"filter": "datum.masked"}],
                 "mark": {"type": "text", "text": "×", "color": MASKED_MARK_HEX,
                          "fontSize": 11},
                 "encoding": {"x": x, "y": y, "tooltip": tooltip,
                              "description": {"field": "aria"}}}]}
    if outline is not None:
        cell["layer"].append({"transform": [{"filter": "datum.ringed"}],
                              "mark": {"type": "point", "shape": "circle", "filled": False,
                                       "stroke": OUTLINE_COLOUR, "strokeWidth": 1.5,
                                       "size": 90, "aria": False},
                              # a ring lies over its cell: hovering it tells the cell's values
                              "encoding": {"x": x, "y": y, "tooltip": tooltip}})
    spec = {"data": {"values": rows}, "background": "white",
            "config": {"view": {"stroke": None}, "axis": {"labelFontSize": label_size}}}
    if title is not None:
        spec["title"] = title
    # What a screen reader says of a cell, written by Vega (not stored in every row).
    spec["transform"] = [{"calculate": f"datum.who + (datum.masked ? ', masked' : "
                                       f"', ' + {json.dumps(label)} + ' ' + datum.shown)",
                          "as": "aria"}]
    if slider is not None:
        spec["params"] = [slider.param()]
        spec["transform"].insert(0, slider.keeps())
    if n_heads == 1:
        spec.update(cell)
    else:
        spec.update({"facet": {"field": "head", "type": "nominal", "sort": names, "title": None},
                     "columns": min(cols, n_heads), "spec": cell,
                     "resolve": {"scale": {"color": "shared"}}})
    return InteractiveFigure(spec, fallback, alt)


def interactive_curves(x, curves, *, alt: str, x_label: str, y_label: str,
                       series: Sequence[str] | None = None, title: str | None = None,
                       slider: Slider | None = None, log_x: bool = False, log_y: bool = False,
                       y_domain: tuple[float, float] | None = None,
                       x_format: str = ".4~g") -> InteractiveFigure:
    """Lines y(x), one per series, whose points tell their values on hover; a slider picks a frame.

    ``x``: (N,); ``curves``: (C, N) for C series, or (S, C, N) with one frame per value of
    ``slider``; ``series``: C names (the legend; lines differ by dash as well as colour, so that
    colour is never the only cue). Non-finite values are left out. ``y_domain`` fixes the value
    axis (do, with a slider, so that the axis stays put while the lines move); without one it
    spans every frame. ``x_format``: how the tooltip writes x (a d3-format string; the value is
    written with 4 significant digits). The static fallback is a matplotlib plot of the slider's
    ``start`` frame. Returns an :class:`InteractiveFigure`.
    """
    xs = _as_cpu_tensor(x).double()
    ys = _as_cpu_tensor(curves).double()
    if xs.dim() != 1 or xs.numel() == 0:
        raise ValueError(f"x must be a non-empty (N,) tensor, got shape {tuple(xs.shape)}")
    frames = _frames(ys, slider, (2,), "curves ((C, N) per frame)")          # (S, C, N)
    n_frames, n_series, n = frames.shape
    if n != xs.numel():
        raise ValueError(f"curves have {n} points per line but x has {xs.numel()}")
    names = (_labels(series, n_series, "series", "lines (C)") if series is not None
             else [f"line {c}" for c in range(n_series)])
    finite = frames[torch.isfinite(frames)]
    if y_domain is None and finite.numel():
        y_domain = (float(finite.min()), float(finite.max()))

    fig = _new_figure(6.5, 3.8)
    ax = fig.add_subplot()
    shown = frames[slider.start_index if slider else 0]
    for c, (name, style) in enumerate(zip(names, itertools.cycle(_LINE_STYLES))):
        ok = torch.isfinite(shown[c])
        ax.plot(xs[ok].numpy(), shown[c][ok].numpy(), style, label=name, markersize=3)
    ax.set(xlabel=x_label, ylabel=y_label, title=title or "")
    if log_x:
        ax.set_xscale("log")
    if log_y:
        ax.set_yscale("log")
    if y_domain is not None:
        ax.set_ylim(*y_domain)
    if slider is not None:
        ax.text(0.01, 0.98, f"{slider.name} = {slider.start:g}", transform=ax.transAxes,
                va="top", fontsize=9)
    if n_series > 1:
        ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)

    rows = []
    for s, c, i in itertools.product(range(n_frames), range(n_series), range(n)):
        if math.isfinite(frames[s, c, i]):
            rows.append({"frame": slider.values[s] if slider else 0, "series": names[c],
                         "x": _rounded(xs[i]), "y": _rounded(frames[s, c, i]),
                         "shown": f"{frames[s, c, i]:.4g}",
                         "who": f"{names[c]}, {x_label} {xs[i]:g}"})
    legend = {"field": "series", "type": "nominal", "sort": names, "title": None}
    spec = {"data": {"values": rows}, "background": "white", "width": 420, "height": 260,
            "mark": {"type": "line", "point": {"size": 28}},
            "encoding": {
                "x": {"field": "x", "type": "quantitative", "title": x_label,
                      "scale": ({"type": "log", "nice": False,
                                 "domain": [float(xs.min()), float(xs.max())]}
                                if log_x else {"zero": False})},
                "y": {"field": "y", "type": "quantitative", "title": y_label,
                      "scale": {**({"type": "log"} if log_y else {"zero": False}),
                                **({"domain": list(y_domain)} if y_domain else {})}},
                "color": legend, "strokeDash": legend,
                "tooltip": [{"field": "series", "title": "line"},
                            {"field": "x", "title": x_label, "format": x_format},
                            {"field": "shown", "title": y_label}],
                "description": {"field": "aria"}}}
    if title is not None:
        spec["title"] = title
    spec["transform"] = [{"calculate": f"datum.who + ', ' + {json.dumps(y_label)} + ' ' "
                                       "+ datum.shown", "as": "aria"}]
    if slider is not None:
        spec["params"] = [slider.param()]
        spec["transform"].insert(0, slider.keeps())
    return InteractiveFigure(spec, fig, alt)
