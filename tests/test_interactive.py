"""The interactive figures' builders: the data each chart holds, its slider, its static fallback.

What the browser does with them (hover, slide, offline) is tested in
tests/test_interactive_browser.py (a page of its own) and tests/test_browser.py (the book).
"""

import base64
import json
import re

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from course_attn.viz import (  # noqa: E402
    InteractiveFigure, Slider, interactive_attention, interactive_curves, plot_attention)

CAUSAL = torch.ones(4, 4, dtype=torch.bool).tril()


def causal_weights(*shape, seed=0):
    torch.manual_seed(seed)
    t = shape[-1]
    return torch.randn(*shape).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(),
                                           float("-inf")).softmax(-1)


def rows_of(figure: InteractiveFigure) -> list[dict]:
    return figure.spec["data"]["values"]


def row(figure, **where) -> dict:
    found = [r for r in rows_of(figure) if all(r[k] == v for k, v in where.items())]
    assert len(found) == 1, f"{len(found)} rows match {where}"
    return found[0]


def shown_image(fig) -> np.ndarray:
    """The values of the (first) map a matplotlib figure shows, masked cells as NaN."""
    return np.ma.filled(fig.axes[0].images[0].get_array().astype(float), np.nan)


def test_a_map_holds_every_cell_with_its_query_key_and_weight():
    w = causal_weights(4, 4)
    fig = interactive_attention(w, list("abcd"), alt="a causal map of four tokens", mask=CAUSAL)
    assert len(rows_of(fig)) == 16
    cell = row(fig, qi=2, ki=1)
    assert cell["query"] == "2: c" and cell["key"] == "1: b" and not cell["masked"]
    assert cell["value"] == pytest.approx(w[2, 1].item(), abs=1e-4)
    assert cell["shown"] == f"{w[2, 1].item():.3f}"
    assert cell["who"] == "query 2: c, key 1: b"
    assert fig.spec["transform"] == [{"calculate": "datum.who + (datum.masked ? ', masked' : "
                                                   "', ' + \"weight\" + ' ' + datum.shown)",
                                      "as": "aria"}]
    above = row(fig, qi=1, ki=3)
    assert above["masked"] and above["shown"] == "masked"
    tooltip = [t["field"] for t in fig.spec["layer"][0]["encoding"]["tooltip"]]
    assert tooltip == ["query", "key", "shown"]
    assert fig.spec["layer"][0]["encoding"]["color"]["scale"] == {
        "scheme": "blues", "reverse": False, "domain": [0.0, 1.0]}


def test_masked_cells_are_crossed_not_only_greyed():
    fig = interactive_attention(causal_weights(4, 4), alt="a causal map, masked cells crossed",
                                mask=CAUSAL)
    cross = fig.spec["layer"][1]
    assert cross["transform"] == [{"filter": "datum.masked"}]
    assert cross["mark"]["type"] == "text" and cross["mark"]["text"] == "×"


def test_repeated_tokens_stay_separate_cells():
    fig = interactive_attention(torch.full((3, 3), 1 / 3), ["a", "b", "a"],
                                alt="three tokens, two of them the same letter")
    assert len(rows_of(fig)) == 9
    assert {r["key"] for r in rows_of(fig)} == {"0: a", "1: b", "2: a"}


def test_heads_are_panels_sharing_one_colour_scale_and_named_in_the_tooltip():
    fig = interactive_attention(causal_weights(2, 4, 4), alt="two heads of a causal map",
                                mask=CAUSAL, head_titles=["previous", "induction"], cols=2)
    assert fig.spec["facet"]["field"] == "head" and fig.spec["columns"] == 2
    assert fig.spec["resolve"] == {"scale": {"color": "shared"}}
    assert row(fig, head="induction", qi=3, ki=0)["who"] == "induction, query 3, key 0"
    assert fig.spec["spec"]["layer"][0]["encoding"]["tooltip"][0] == {"field": "head",
                                                                       "title": "map"}


def test_signed_scores_use_the_diverging_map_centred_at_zero():
    scores = torch.tensor([[-2.0, 0.5], [1.0, 3.0]])
    fig = interactive_attention(scores, alt="signed scores of two queries and two keys")
    assert fig.spec["layer"][0]["encoding"]["color"]["scale"] == {
        "scheme": "redblue", "reverse": True, "domain": [-3.0, 3.0]}
    assert row(fig, qi=0, ki=0)["shown"] == "-2.000"
    assert '"score"' in fig.spec["transform"][0]["calculate"]


def test_a_bool_mask_is_drawn_as_may_attend_with_its_masked_cells_crossed():
    fig = interactive_attention(CAUSAL, alt="the causal mask of four tokens")
    assert row(fig, qi=3, ki=0)["shown"] == "yes"
    assert '"may attend"' in fig.spec["transform"][0]["calculate"]
    assert row(fig, qi=0, ki=3)["masked"] and row(fig, qi=0, ki=3)["shown"] == "masked"
    colour = fig.spec["layer"][0]["encoding"]["color"]
    assert "field" not in colour and colour["value"] == "#08306b"     # no colour bar
    assert fig.spec["layer"][1]["mark"]["text"] == "×"


def test_queries_are_numbered_from_zero_without_tokens_and_are_the_latest_with_them():
    w = torch.full((2, 5), 0.2)
    fig = interactive_attention(w, alt="two queries over five keys, numbered")
    assert {r["query"] for r in rows_of(fig)} == {"0", "1"}
    fig = interactive_attention(w, list("abcde"), alt="two queries over five keys, tokens")
    assert {r["query"] for r in rows_of(fig)} == {"0: d", "1: e"}


def test_a_slider_holds_one_frame_per_value_and_the_fallback_draws_the_start():
    frames = causal_weights(3, 4, 4)
    slider = Slider("W", [1, 2, 3], start=2)
    fig = interactive_attention(frames, alt="maps for three windows", mask=CAUSAL, slider=slider)
    assert len(rows_of(fig)) == 3 * 16
    assert {r["frame"] for r in rows_of(fig)} == {1.0, 2.0, 3.0}
    assert row(fig, frame=3.0, qi=3, ki=2)["value"] == pytest.approx(frames[2, 3, 2].item(),
                                                                     abs=1e-4)
    assert fig.spec["params"] == [{"name": "knob", "value": 2.0, "bind": {
        "input": "range", "min": 1.0, "max": 3.0, "step": 1.0, "name": "W "}}]
    assert fig.spec["transform"][0] == {"filter": "abs(datum.frame - knob) < 0.5"}
    expected = shown_image(plot_attention(frames[1], mask=CAUSAL))
    np.testing.assert_array_equal(shown_image(fig.fallback), expected)


def test_a_fractional_slider_keeps_its_frames_apart_despite_rounding():
    slider = Slider("gain", np.arange(0.1, 0.55, 0.1))
    assert slider.step == pytest.approx(0.1)
    # 0.1 + 0.1 + 0.1 is not 0.3 in floating point: the filter allows half a step.
    assert slider.keeps() == {"filter": f"abs(datum.frame - knob) < {slider.step / 2!r}"}


@pytest.mark.parametrize("values, start, message", [
    ([1, 2, 4, 8], None, "equal steps"),
    ([3, 2, 1], None, "equal steps"),
    ([1], None, "at least 2 values"),
    ([1, 2, 3], 5, "not one of its values"),
])
def test_a_bad_slider_says_why(values, start, message):
    with pytest.raises(ValueError, match=message):
        Slider("W", values, start=start)


@pytest.mark.parametrize("weights, kwargs, message", [
    (torch.rand(2, 3, 3), {"slider": Slider("W", [1, 2, 3])}, r"slider of 3 values"),
    (torch.rand(3, 3), {"slider": Slider("W", [1, 2, 3])}, r"3 dims or 4 dims; got shape \(3, 3\)"),
    (torch.rand(3), {}, r"\(Tq, Tk\) or \(H, Tq, Tk\) per frame.*without a slider"),
    (torch.rand(3, 3), {"alt": " "}, "alt text"),
    (torch.rand(3, 3), {"tokens": ["a"]}, "tokens"),
])
def test_bad_attention_input_says_why(weights, kwargs, message):
    kwargs = {"alt": "a figure of some weights", **kwargs}
    tokens = kwargs.pop("tokens", None)
    with pytest.raises(ValueError, match=message):
        interactive_attention(weights, tokens, **kwargs)


def test_curves_hold_every_point_tell_lines_apart_by_dash_and_leave_out_non_finite():
    x = torch.arange(1.0, 6.0)
    curves = torch.stack([torch.stack([x, x ** 2]), torch.stack([2 * x, x.log()])])
    curves[0, 1, 0] = float("nan")
    fig = interactive_curves(x, curves, alt="two lines for two values of a knob",
                             x_label="T", y_label="cost", series=["linear", "softmax"],
                             slider=Slider("k", [1, 2]), y_domain=(0.0, 25.0))
    assert len(rows_of(fig)) == 2 * 2 * 5 - 1
    point = row(fig, frame=1.0, series="softmax", x=4.0)
    assert point["y"] == 16.0 and point["shown"] == "16"
    assert point["who"] == "softmax, T 4"
    assert fig.spec["transform"][-1] == {
        "calculate": "datum.who + ', ' + \"cost\" + ' ' + datum.shown", "as": "aria"}
    encoding = fig.spec["encoding"]
    assert encoding["color"]["field"] == encoding["strokeDash"]["field"] == "series"
    assert encoding["y"]["scale"]["domain"] == [0.0, 25.0]
    json.dumps(fig.spec, allow_nan=False)
    lines = fig.fallback.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["linear", "softmax"]
    assert len({line.get_linestyle() for line in lines}) == 2
    np.testing.assert_array_equal(lines[1].get_ydata(), [4.0, 9.0, 16.0, 25.0])


@pytest.mark.parametrize("x, curves, kwargs, message", [
    (torch.arange(3.0), torch.rand(2, 4), {}, "4 points per line but x has 3"),
    (torch.rand(2, 3), torch.rand(2, 3), {}, r"x must be a non-empty \(N,\)"),
    (torch.arange(3.0), torch.rand(2, 2, 3), {}, "without a slider, 2 dims"),
    (torch.arange(3.0), torch.rand(2, 3), {"series": ["one"]}, "series"),
])
def test_bad_curves_input_says_why(x, curves, kwargs, message):
    with pytest.raises(ValueError, match=message):
        interactive_curves(x, curves, alt="some lines of some values", x_label="x",
                           y_label="y", **kwargs)


def test_the_notebook_gets_html_with_its_fallback_image_and_a_png_for_the_rest():
    fig = interactive_attention(causal_weights(4, 4), list("abcd"), mask=CAUSAL,
                                alt="a causal map of four tokens, interactive")
    bundle = fig._repr_mimebundle_()
    assert set(bundle) == {"text/html", "image/png", "text/plain"}
    assert base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")
    page = bundle["text/html"]
    assert page.startswith('<div class="course-interactive"')
    assert 'role="figure" aria-label="a causal map of four tokens, interactive"' in page
    assert '<img class="course-fallback" src="data:image/png;base64,' in page
    assert 'alt="a causal map of four tokens, interactive"' in page
    assert not re.search(r"https?:|(src|href)=\"//", page), \
        "the figure must not point outside the page"
    assert fig.spec["description"] == fig.alt


def test_tokens_cannot_end_the_script_early():
    fig = interactive_attention(torch.full((2, 2), 0.5), ["</script><b>", "x"],
                                alt="two tokens, one of them markup")
    page = fig.to_html()
    assert page.count("</script>") == 1 and page.endswith("</script>")


def test_the_same_figure_gets_the_same_id_and_another_figure_another():
    make = lambda w: interactive_attention(w, alt="a figure of two weights").to_html()  # noqa: E731
    ids = [re.search(r'id="(figure-[0-9a-f]+)"', make(w))[1]
           for w in (torch.full((2, 2), 0.5), torch.full((2, 2), 0.5), torch.eye(2))]
    assert ids[0] == ids[1] != ids[2]


def test_outlined_cells_are_ringed_in_the_chart_and_in_the_fallback():
    ring = torch.zeros(4, 4, dtype=torch.bool)
    ring[3, 1] = ring[2, 0] = True
    fig = interactive_attention(causal_weights(2, 4, 4), mask=CAUSAL, outline=ring,
                                alt="two heads with two cells ringed")
    assert row(fig, head="head 1", qi=3, ki=1)["ringed"]
    assert sum(r["ringed"] for r in rows_of(fig)) == 2 * 2
    rings = fig.spec["spec"]["layer"][-1]
    assert rings["transform"] == [{"filter": "datum.ringed"}]
    assert rings["mark"]["filled"] is False
    for panel in fig.fallback.axes[:2]:
        (points,) = panel.collections
        np.testing.assert_array_equal(points.get_offsets(), [[0, 2], [1, 3]])


def test_with_a_slider_the_mask_may_change_from_frame_to_frame():
    windows = torch.stack([CAUSAL & ~CAUSAL.tril(-w) for w in (1, 2, 3)])   # (3, 4, 4)
    frames = causal_weights(3, 4, 4)
    fig = interactive_attention(frames, mask=windows, slider=Slider("W", [1, 2, 3], start=2),
                                alt="weights under three sliding windows")
    assert row(fig, frame=1.0, qi=3, ki=2)["masked"]
    assert not row(fig, frame=2.0, qi=3, ki=2)["masked"]
    assert row(fig, frame=2.0, qi=3, ki=1)["masked"]
    assert not row(fig, frame=3.0, qi=3, ki=1)["masked"]
    np.testing.assert_array_equal(np.isnan(shown_image(fig.fallback)), ~windows[1].numpy())


def test_log_axes_keep_to_the_data():
    x = torch.tensor([16.0, 64.0, 256.0])
    fig = interactive_curves(x, torch.stack([x, x ** 2]), x_label="T", y_label="cost",
                             log_x=True, log_y=True, alt="two costs on log-log axes")
    assert fig.spec["encoding"]["x"]["scale"] == {"type": "log", "nice": False,
                                                  "domain": [16.0, 256.0]}
    assert "zero" not in fig.spec["encoding"]["y"]["scale"]
