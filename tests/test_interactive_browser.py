"""The interactive figures in a real browser, on a page of their own (no book build needed).

The page is served like the book serves it: the figures' HTML as a notebook's outputs carry it,
and the vendored Vega scripts (``_ext/static/vega/``) from the same server, deferred, as
``_ext/interactive_figures.py`` adds them. Each figure must draw (its fallback image then goes),
log nothing (a Vega warning is a spec that does not say what it means), show the precomputed
value of a known cell on hover, and show another frame's value once its slider moves, by mouse
or keyboard. Without Vega the fallback image stays. The book's own figures are probed the same
way in tests/test_browser.py.
"""

import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import chromium, figures_drawn, hover_tooltip, probe_interactive_figure  # noqa: E402
from helpers import require_browser, served  # noqa: E402

from course_attn.viz import Slider, interactive_attention, interactive_curves  # noqa: E402

require_browser()

VEGA = Path(__file__).resolve().parents[1] / "_ext" / "static" / "vega"
SCRIPTS = ("vega.min.js", "vega-lite.min.js", "vega-embed.min.js")
T = 5
CAUSAL = torch.ones(T, T, dtype=torch.bool).tril()
RING = torch.zeros(T, T, dtype=torch.bool)
RING[4, 0] = True                                  # the cell a test hovers, ringed
NO_ICON = '<link rel="icon" href="data:,">'       # or the browser asks for /favicon.ico


def frames_of_weights(n: int) -> torch.Tensor:
    torch.manual_seed(0)
    scores = torch.randn(n, T, T).masked_fill(~CAUSAL, float("-inf"))
    return scores.softmax(-1)


WEIGHTS = frames_of_weights(3)
X = torch.arange(1.0, 9.0)
GAINS = [0.1, 0.2, 0.3, 0.4]
FIGURES = {
    "map": interactive_attention(WEIGHTS, list("abcde"), mask=CAUSAL,
                                 slider=Slider("window W", [1, 2, 3]),
                                 alt="a causal map for three windows, interactive"),
    "heads": interactive_attention(WEIGHTS[:2], list("abcde"), mask=CAUSAL, cols=2,
                                   outline=torch.eye(T, dtype=torch.bool).roll(-1, 1) | RING,
                                   head_titles=["previous", "induction"],
                                   alt="two heads of a causal map, interactive"),
    "curves": interactive_curves(X, torch.stack([torch.stack([g * X, g * X.sqrt()])
                                                 for g in GAINS]),
                                 x_label="T", y_label="cost", series=["linear", "softmax"],
                                 slider=Slider("gain", GAINS), y_domain=(0.0, 3.5),
                                 alt="cost against T for four gains, interactive"),
    "windows": interactive_attention(
        torch.stack([CAUSAL & ~CAUSAL.tril(-w) for w in (1, 2, 3)]), list("abcde"),
        slider=Slider("window W", [1, 2, 3]), alt="the sliding-window mask for three windows"),
    "log": interactive_curves(X, torch.stack([X ** 2, X]), x_label="sequence length T",
                              y_label="FLOPs", series=["quadratic", "linear"], log_x=True,
                              log_y=True, alt="two costs against T on log-log axes"),
}
# A figure whose tooltip rounds the weight to one decimal: the probe must catch it.
WRONG = interactive_attention(WEIGHTS, list("abcde"), mask=CAUSAL, alt="a wrong figure here",
                              slider=Slider("window W", [1, 2, 3]))
for _layer in WRONG.spec["layer"]:
    _layer["encoding"]["tooltip"][-1] = {"field": "value", "format": ".1f", "title": "weight"}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    folder = tmp_path_factory.mktemp("interactive")
    (folder / "vega").mkdir()
    for name in SCRIPTS:
        shutil.copy(VEGA / name, folder / "vega" / name)
    scripts = "".join(f'<script defer src="vega/{name}"></script>' for name in SCRIPTS)
    pages = {"with_vega": (scripts, FIGURES.values()), "without_vega": ("", FIGURES.values()),
             "wrong": (scripts, [WRONG])}
    for name, (head, figures) in pages.items():
        body = "".join(f.to_html() for f in figures)
        (folder / f"{name}.html").write_text(
            f"<!doctype html><html><head>{NO_ICON}{head}</head><body>{body}</body></html>")
    with served(folder) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser, site):
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    page = context.new_page()
    page.logged = []
    page.on("console", lambda m: m.type in ("error", "warning") and page.logged.append(m.text))
    page.on("pageerror", lambda e: page.logged.append(str(e)))
    page.goto(site + "with_vega.html")
    page.ids = dict(zip(FIGURES, figures_drawn(page)))
    yield page
    context.close()


def tooltip_of(page, figure: str, aria_prefix: str) -> str:
    return " ".join(hover_tooltip(page, page.ids[figure], aria_prefix).split())


def test_every_figure_draws_without_a_word_in_the_console_and_drops_its_fallback(page):
    assert len(page.ids) == len(FIGURES)
    assert page.locator(".course-fallback").count() == 0
    assert page.locator(".course-interactive svg").count() >= len(FIGURES)
    assert not page.logged, page.logged


def test_each_cell_and_point_is_named_for_a_screen_reader(page):
    label = page.locator(f'#{page.ids["map"]} g.mark-rect > path[aria-label^="query 3: d, key 1"]')
    assert label.first.get_attribute("aria-label") == \
        f"query 3: d, key 1: b, weight {WEIGHTS[0, 3, 1].item():.3f}"
    assert page.locator(f'#{page.ids["map"]} g.mark-rect > path'
                        '[aria-label="query 1: b, key 4: e, masked"]').count() == 1
    point = page.locator(f'#{page.ids["curves"]} g.mark-symbol > path'
                         '[aria-label^="softmax, T 4,"]')
    assert point.first.get_attribute("aria-label") == "softmax, T 4, cost 0.2"


def test_hovering_a_cell_shows_its_query_key_and_weight(page):
    text = tooltip_of(page, "map", "query 3: d, key 1: b,")
    assert text == f"query 3: d key 1: b weight {WEIGHTS[0, 3, 1].item():.3f}"
    text = tooltip_of(page, "heads", "induction, query 4: e, key 0: a,")
    assert text == f"map induction query 4: e key 0: a weight {WEIGHTS[1, 4, 0].item():.3f}"
    assert tooltip_of(page, "map", "query 1: b, key 4: e,") == \
        "query 1: b key 4: e weight masked"


def test_moving_a_slider_shows_that_frames_precomputed_values(page):
    page.locator(f"#{page.ids['map']} input[type=range]").fill("3")
    text = tooltip_of(page, "map", "query 3: d, key 1: b,")
    assert text.endswith(f"weight {WEIGHTS[2, 3, 1].item():.3f}")
    page.locator(f"#{page.ids['curves']} input[type=range]").fill("0.3")
    text = tooltip_of(page, "curves", "softmax, T 4,")
    assert text == f"line softmax T 4 cost {0.3 * 2:.4g}"


def test_a_slider_moves_with_the_keyboard(page):
    slider = page.locator(f"#{page.ids['curves']} input[type=range]")
    slider.focus()
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    assert page.evaluate(f"window.courseFigures['{page.ids['curves']}'].signal('knob')") == \
        pytest.approx(0.3)
    assert tooltip_of(page, "curves", "linear, T 8,") == f"line linear T 8 cost {0.3 * 8:.4g}"


@pytest.mark.parametrize("figure", list(FIGURES))
def test_the_probe_that_checks_the_book_passes_here(page, figure):
    assert probe_interactive_figure(page, page.ids[figure]) == []


def test_the_probe_catches_a_tooltip_that_shows_the_wrong_value(browser, site):
    context = browser.new_context()
    page = context.new_page()
    page.goto(site + "wrong.html")
    (figure_id,) = figures_drawn(page)
    problems = probe_interactive_figure(page, figure_id)
    context.close()
    assert problems and "shows" in problems[0], problems


def test_without_vega_the_static_image_stays(browser, site):
    context = browser.new_context()
    page = context.new_page()
    logged = []
    page.on("pageerror", lambda e: logged.append(str(e)))
    page.goto(site + "without_vega.html")
    images = page.locator(".course-interactive img.course-fallback")
    assert images.count() == len(FIGURES)
    assert all(images.nth(i).evaluate("i => i.complete && i.naturalWidth > 0")
               for i in range(len(FIGURES)))
    assert images.first.get_attribute("alt") == FIGURES["map"].alt
    assert not logged
    context.close()
