"""The book's figures: plot_attention's heatmaps and their one colour convention, plot_bench."""

import io
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib import pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from course_attn.data import token_labels  # noqa: E402
from course_attn.viz import overlapping_tick_labels, plot_attention, plot_bench  # noqa: E402

CAUSAL = torch.ones(4, 4, dtype=torch.bool).tril()


def causal_weights(*shape):
    t = shape[-1]
    scores = torch.randn(*shape).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(),
                                             float("-inf"))
    return scores.softmax(-1)


def tick_texts(axis):
    return [label.get_text() for label in axis.get_ticklabels()]

def colorbars(fig):
    """The colour bars: one beside a single map (an inset of it), or one shared by a grid."""
    every = [a for ax in fig.axes for a in (ax, *ax.child_axes)]
    return [ax for ax in every if ax.get_label() == "<colorbar>"]


def test_one_map_has_token_labels_and_a_colorbar():
    tokens = token_labels(torch.tensor([0, 1, 2, 0, 1]))
    open_before = plt.get_fignums()
    fig = plot_attention(causal_weights(5, 5), tokens, title="one head")
    assert isinstance(fig, Figure)
    (heatmap,) = fig.axes
    (colorbar,) = colorbars(fig)                                  # beside the map, as tall
    assert tick_texts(heatmap.xaxis) == tokens == tick_texts(heatmap.yaxis)
    assert heatmap.get_xlabel() == "key" and heatmap.get_ylabel() == "query"
    assert heatmap.get_title() == "one head"
    assert colorbar.get_ylabel() == "weight"
    assert plt.get_fignums() == open_before                       # pyplot keeps no reference
    fig.savefig(io.BytesIO(), format="png")


@pytest.mark.parametrize("heads, cols, grid", [(4, 4, (1, 4)), (6, 4, (2, 4)), (3, 1, (3, 1))])
def test_grid_has_one_axes_per_head(heads, cols, grid):
    fig = plot_attention(causal_weights(heads, 6, 6), list("abcdef"), cols=cols,
                         title="all heads")
    maps = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert len(maps) == heads and len(fig.axes) == heads + 1
    assert [ax.get_title() for ax in maps] == [f"head {h}" for h in range(heads)]
    rows, columns = grid
    assert maps[0].get_subplotspec().get_gridspec().get_geometry() == (rows, columns)
    assert fig.get_suptitle() == "all heads"
    fig.savefig(io.BytesIO(), format="png")


def test_any_float_dtype_device_and_autograd_tensor_or_array():
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        plot_attention(causal_weights(2, 4, 4).to(dtype))
    plot_attention(causal_weights(4, 4).requires_grad_())
    plot_attention(np.eye(3))
    for device in ("cuda", "mps"):
        if device == "cuda" and torch.cuda.is_available() or \
                device == "mps" and torch.backends.mps.is_available():
            plot_attention(causal_weights(2, 4, 4).to(device))


def test_query_labels_default_to_the_last_tokens_and_titles_are_used():
    weights = torch.full((2, 5), 0.2)                             # 2 new queries, 5 keys
    fig = plot_attention(weights, list("vwxyz"))
    assert tick_texts(fig.axes[0].yaxis) == ["y", "z"]
    fig = plot_attention(weights, list("vwxyz"), query_tokens=["q1", "q2"])
    assert tick_texts(fig.axes[0].yaxis) == ["q1", "q2"]
    fig = plot_attention(causal_weights(2, 3, 3), head_titles=["prev", "induction"])
    assert [ax.get_title() for ax in fig.axes[:2]] == ["prev", "induction"]


def test_draws_into_a_given_axes():
    fig = Figure()
    ax = fig.add_subplot()
    assert plot_attention(causal_weights(4, 4), ax=ax) is fig
    assert ax.images and fig.axes == [ax] and len(colorbars(fig)) == 1




def hatched(ax):
    return [p for p in ax.patches if p.get_hatch()]


def test_masked_scores_are_drawn_as_masked_not_as_values():
    scores = torch.linspace(-2.0, 3.0, 16).reshape(4, 4).masked_fill(~CAUSAL, float("-inf"))
    fig = plot_attention(scores)
    image = fig.axes[0].images[0].get_array()
    assert np.array_equal(image.mask, ~CAUSAL.numpy())            # the 6 future keys, exactly
    assert hatched(fig.axes[0]), "masked cells should show a hatched background"
    assert colorbars(fig)[0].get_ylabel() == "score (hatched: masked)"


def test_mask_argument_marks_zero_weights_as_masked():
    weights = torch.randn(4, 4).masked_fill(~CAUSAL, float("-inf")).softmax(-1)
    plain = plot_attention(weights).axes[0].images[0].get_array()
    assert not np.ma.is_masked(plain) and not hatched(plot_attention(weights).axes[0])
    fig = plot_attention(weights, mask=CAUSAL)
    image = fig.axes[0].images[0].get_array()
    assert np.array_equal(image.mask, ~CAUSAL.numpy())
    assert np.allclose(image.compressed(), weights[CAUSAL].numpy())  # the allowed cells unchanged
    assert colorbars(fig)[0].get_ylabel() == "weight (hatched: masked)"


def test_a_mask_broadcasts_over_heads_and_nan_is_masked_too():
    weights = causal_weights(3, 4, 4)
    weights[1, 0, 0] = float("nan")
    fig = plot_attention(weights, mask=CAUSAL)
    maps = [ax for ax in fig.axes if ax not in colorbars(fig)]
    masks = [ax.images[0].get_array().mask for ax in maps]
    assert [int(m.sum()) for m in masks] == [6, 7, 6]
    assert len(colorbars(fig)) == 1                               # one shared scale


def test_weights_use_the_sequential_map_on_zero_to_one():
    fig = plot_attention(torch.full((3, 3), 0.2))                 # pale: a weight of 0.2 is small
    image = fig.axes[0].images[0]
    assert image.get_cmap().name == "Blues" and image.get_clim() == (0.0, 1.0)
    assert colorbars(fig)[0].get_ylabel() == "weight"


def test_signed_scores_use_a_diverging_map_centred_at_zero():
    scores = torch.tensor([[-1.0, 3.0], [0.5, 2.0]])
    image = plot_attention(scores).axes[0].images[0]
    assert image.get_cmap().name == "RdBu_r" and image.get_clim() == (-3.0, 3.0)
    forced = plot_attention(torch.tensor([[0.1, 0.9]]), signed=True)
    assert forced.axes[0].images[0].get_cmap().name == "RdBu_r"
    assert colorbars(forced)[0].get_ylabel() == "score"
    kept = plot_attention(scores, signed=False, colorbar_label="logit").axes[0].images[0]
    assert kept.get_cmap().name == "Blues" and kept.get_clim() == (0.0, 1.0)


def test_a_bool_mask_is_drawn_with_a_legend():
    fig = plot_attention(CAUSAL, title="causal")
    image = fig.axes[0].images[0].get_array()
    assert np.array_equal(image.mask, ~CAUSAL.numpy())
    assert not colorbars(fig)
    legend = fig.axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["may attend", "masked"]
    fig.savefig(io.BytesIO(), format="png")


@pytest.mark.parametrize("weights", [causal_weights(4, 4), causal_weights(3, 4, 4)])
def test_every_numeric_map_has_a_colour_bar_unless_asked_not_to(weights):
    assert len(colorbars(plot_attention(weights))) == 1
    assert not colorbars(plot_attention(weights, colorbar=False))


def test_two_maps_drawn_into_given_axes_each_get_a_colour_bar():
    fig = Figure(layout="constrained")
    left, right = fig.subplots(1, 2)
    scores = torch.linspace(-2.0, 3.0, 16).reshape(4, 4).masked_fill(~CAUSAL, float("-inf"))
    assert plot_attention(scores.softmax(-1), ax=left, mask=CAUSAL, title="weights") is fig
    assert plot_attention(scores, ax=right, title="scores") is fig
    assert len(colorbars(fig)) == 2
    assert left.images[0].get_cmap().name == "Blues"
    assert right.images[0].get_cmap().name == "RdBu_r"
    assert hatched(left) and hatched(right)
    fig.draw_without_rendering()
    for ax, bar in zip((left, right), colorbars(fig)):            # each as tall as its map
        assert bar.get_position().height == pytest.approx(ax.get_position().height, rel=0.01)
    fig.savefig(io.BytesIO(), format="png")


@pytest.mark.parametrize("mask, message", [
    (torch.ones(4, 4), "bool"),
    (torch.ones(3, 4, dtype=torch.bool), "does not broadcast"),
])
def test_bad_mask_raises(mask, message):
    with pytest.raises(ValueError, match=message):
        plot_attention(causal_weights(4, 4), mask=mask)


class Row:
    """Stands in for course_attn.bench.BenchRow: only the fields plot_bench reads."""

    def __init__(self, backend, seq_len, time_ms, peak_mib, error=None, settled=True):
        self.backend, self.seq_len, self.time_ms = backend, seq_len, time_ms
        self.peak_mib, self.error, self.settled = peak_mib, error, settled


SEQ_LENS = [256, 512, 1024, 2048]
ROWS = [Row(name, t, factor * (t / 256) ** 2, factor * t / 64)
        for name, factor in (("math", 3.0), ("sdpa", 0.4)) for t in SEQ_LENS] + [
    Row("broken", 256, None, None, error="RuntimeError: out of memory")]


def test_bench_plot_ticks_are_the_measured_lengths_and_none_overlap():
    fig = plot_bench(ROWS, title="causal")
    time_ax, mem_ax = fig.axes
    for ax in (time_ax, mem_ax):
        assert list(ax.get_xticks()) == SEQ_LENS
        assert tick_texts(ax.xaxis) == [str(t) for t in SEQ_LENS]
        assert not [t for t in ax.xaxis.get_ticklabels(minor=True) if t.get_text()]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert legend == ["math", "sdpa"]
    assert overlapping_tick_labels(fig) == []
    fig.savefig(io.BytesIO(), format="png")


def test_overlapping_tick_labels_finds_the_old_appendix_bug():
    # What the appendix used to draw: explicit ticks on a log axis, matplotlib's minor labels on.
    fig = Figure(figsize=(5, 4))
    ax = fig.add_subplot()
    ax.plot(SEQ_LENS, [150, 110, 400, 1800])
    ax.set(xscale="log", yscale="log")
    ax.set_xticks(SEQ_LENS, [str(t) for t in SEQ_LENS])
    clashes = overlapping_tick_labels(fig)
    assert ("256", "$\\mathdefault{3\\times10^{2}}$") in clashes


def test_bench_plot_marks_times_that_did_not_settle():
    rows = [Row("math", t, 2.0 * t, t / 64, settled=t != 256) for t in SEQ_LENS]
    time_ax = plot_bench(rows).axes[0]
    assert [t.get_text() for t in time_ax.get_legend().get_texts()] == ["math", "not settled"]
    hollow = [line for line in time_ax.get_lines() if line.get_markerfacecolor() == "white"]
    assert len(hollow) == 1 and list(hollow[0].get_xdata()) == [256]


def test_bench_plot_needs_a_successful_row():
    with pytest.raises(ValueError, match="no successful row"):
        plot_bench(ROWS[-1:])


@pytest.mark.parametrize("weights, kwargs, message", [
    (torch.rand(5), {}, "shape \\(5,\\)"),
    (torch.rand(1, 2, 3, 3), {}, "shape \\(1, 2, 3, 3\\)"),
    (torch.rand(3, 3), {"tokens": list("ab")}, "tokens has 2 labels .* 3 keys"),
    (torch.rand(2, 3), {"tokens": list("abc"), "query_tokens": ["x"]}, "query_tokens has 1"),
    (torch.rand(4, 3), {"tokens": list("abc")}, "pass query_tokens"),
    (torch.rand(2, 3, 3), {"head_titles": ["only one"]}, "head_titles has 1 .* 2 heads"),
    (torch.rand(2, 3, 3), {"cols": 0}, "cols"),
    (torch.rand(3, 3), {"tokens": "abc"}, "sequence of labels"),
])
def test_bad_input_raises(weights, kwargs, message):
    with pytest.raises(ValueError, match=message):
        plot_attention(weights, **kwargs)


def test_grid_into_one_axes_raises():
    ax = Figure().add_subplot()
    with pytest.raises(ValueError, match="ax draws one"):
        plot_attention(torch.rand(2, 3, 3), ax=ax)


BOOK = Path(__file__).resolve().parents[1] / "book"
RAW_HEATMAP = re.compile(r"\.(imshow|matshow|pcolormesh|pcolor)\(|\bheatmap\(")


@pytest.mark.parametrize("notebook", sorted(BOOK.glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.name)
def test_every_heatmap_in_the_book_goes_through_plot_attention(notebook):
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    raw = [i for i, cell in enumerate(cells)
           if cell["cell_type"] == "code" and RAW_HEATMAP.search("".join(cell["source"]))]
    assert not raw, (f"{notebook.name}: cells {raw} draw a heatmap themselves; use "
                     "course_attn.viz.plot_attention (one colour convention, a colour bar, "
                     "masked cells shown as masked)")


# What a reader with each colour-vision deficiency sees: Machado, Oliveira & Fernandes (2009),
# severity 1, applied to linear RGB.
COLOUR_VISION = {
    "normal": np.eye(3),
    "protanopia": np.array([[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216],
                            [-0.003882, -0.048116, 1.051998]]),
    "deuteranopia": np.array([[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413],
                              [-0.011820, 0.042940, 0.968881]]),
    "tritanopia": np.array([[1.255528, -0.076749, -0.178779], [-0.078411, 0.930809, 0.147602],
                            [0.004733, 0.691367, 0.303900]]),
}
SRGB_TO_XYZ = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722],
                        [0.0193, 0.1192, 0.9505]])
D65_WHITE = np.array([0.95047, 1.0, 1.08883])


def cielab_as_seen(cmap: str, vision: str, n: int = 65) -> np.ndarray:
    """(n, 3) CIELAB colours of ``cmap`` at n evenly spaced values, as seen with ``vision``."""
    rgb = matplotlib.colormaps[cmap](np.linspace(0.0, 1.0, n))[:, :3]
    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    linear = np.clip(linear @ COLOUR_VISION[vision].T, 0.0, 1.0)
    xyz = linear @ SRGB_TO_XYZ.T / D65_WHITE
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.stack([116 * f[:, 1] - 16, 500 * (f[:, 0] - f[:, 1]), 200 * (f[:, 1] - f[:, 2])],
                    axis=-1)


def ordered_by_lightness(cmap: str, vision: str) -> bool:
    """A sequential map anyone can read: lightness alone orders it, over a wide range."""
    lightness = cielab_as_seen(cmap, vision)[:, 0]
    steps = np.diff(lightness)
    return bool((steps < 0).all() or (steps > 0).all()) and np.ptp(lightness) > 60


def diverges_readably(cmap: str, vision: str) -> bool:
    """A diverging map anyone can read: lightest at the centre, darker towards both ends, and
    the two ends (most negative, most positive) still told apart by colour."""
    lab = cielab_as_seen(cmap, vision)
    centre = len(lab) // 2
    rises, falls = np.diff(lab[:centre + 1, 0]), np.diff(lab[centre:, 0])
    ends_apart = np.linalg.norm(lab[0] - lab[-1])
    return bool((rises > 0).all() and (falls < 0).all()) and ends_apart > 30


@pytest.mark.parametrize("vision", COLOUR_VISION)
def test_the_colour_maps_are_readable_with_colour_blindness(vision):
    weights = plot_attention(torch.full((2, 2), 0.5)).axes[0].images[0].get_cmap().name
    scores = plot_attention(torch.tensor([[-1.0, 2.0]])).axes[0].images[0].get_cmap().name
    assert ordered_by_lightness(weights, vision), f"{weights} as seen with {vision}"
    assert diverges_readably(scores, vision), f"{scores} as seen with {vision}"
    # The checks can fail: a rainbow is not ordered by lightness, and diverges from nothing.
    assert not ordered_by_lightness("jet", vision) and not diverges_readably("jet", vision)


def test_masked_cells_are_marked_by_a_pattern_not_by_colour_alone():
    scores = torch.tensor([[0.5, float("-inf")], [0.2, 0.8]])
    for fig in (plot_attention(scores), plot_attention(scores.softmax(-1), mask=scores.isfinite())):
        ax = fig.axes[0]
        assert ax.images[0].get_array().mask.tolist() == [[False, True], [False, False]]
        assert hatched(ax), "a masked cell, left out of the image, should show the hatching"
    legend = plot_attention(CAUSAL).axes[0].get_legend()
    masked = legend.legend_handles[[t.get_text() for t in legend.get_texts()].index("masked")]
    assert masked.get_hatch(), "the legend's masked cell should show the hatching too"
