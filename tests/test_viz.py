"""plot_attention: one heatmap, a grid of heads, and the inputs it refuses."""

import io

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib import pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from course_attn.data import token_labels  # noqa: E402
from course_attn.viz import plot_attention  # noqa: E402


def causal_weights(*shape):
    t = shape[-1]
    scores = torch.randn(*shape).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(),
                                             float("-inf"))
    return scores.softmax(-1)


def tick_texts(axis):
    return [label.get_text() for label in axis.get_ticklabels()]


def test_one_map_has_token_labels_and_a_colorbar():
    tokens = token_labels(torch.tensor([0, 1, 2, 0, 1]))
    open_before = plt.get_fignums()
    fig = plot_attention(causal_weights(5, 5), tokens, title="one head")
    assert isinstance(fig, Figure)
    heatmap, colorbar = fig.axes                                  # the map and its colour bar
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
    assert ax.images and len(fig.axes) == 2


def test_masked_scores_are_drawn_not_dropped():
    scores = torch.randn(4, 4).masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(),
                                           float("-inf"))
    fig = plot_attention(scores, colorbar_label="score")
    image = fig.axes[0].images[0].get_array()
    assert image.mask.sum() == 6                                  # the 6 future keys
    assert fig.axes[1].get_ylabel() == "score"


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
