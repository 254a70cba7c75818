"""What several test modules share: seeded inputs, the attention cases that every backend is
swept over, a tiny GPT, what a command line printed, and the browser tests' Chromium, local web
server and interactive-figure probe. Test modules import it as ``helpers``
(conftest.py puts this folder on ``sys.path``, whatever pytest's import mode), never from one
another."""

import contextlib
import functools
import http.server
import math
import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st
from torch import nn

from course_attn.model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS_DIR = ROOT / "solutions"


def randn(*shape, seed=0, device="cpu", dtype=torch.float32):
    """Standard normal numbers of ``shape``, the same for a seed on every device (drawn in
    float64 on the CPU, then cast)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)


def qkv(b, hq, hkv, tq, tk, d=8, dv=6, *, seed=0, device="cpu", dtype=torch.float32):
    """q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv)."""
    return (randn(b, hq, tq, d, seed=seed, device=device, dtype=dtype),
            randn(b, hkv, tk, d, seed=seed + 1, device=device, dtype=dtype),
            randn(b, hkv, tk, dv, seed=seed + 2, device=device, dtype=dtype))


def growth_exponent(lengths, peaks) -> float:
    """The slope of log(peak) against log(T), a least-squares fit: 1 linear, 2 quadratic."""
    x = torch.tensor([math.log(t) for t in lengths], dtype=torch.float64)
    y = torch.tensor([math.log(p) for p in peaks], dtype=torch.float64)
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / (x * x).sum())


# ---------------------------------------------------------------- attention cases

MASK_SHAPES = {
    "(Tq, Tk)": lambda c: (c.tq, c.tk),
    "(B, 1, 1, Tk)": lambda c: (c.b, 1, 1, c.tk),
    "(B, Hq, Tq, Tk)": lambda c: (c.b, c.hq, c.tq, c.tk),
    "(Hq, Tq, Tk)": lambda c: (c.hq, c.tq, c.tk),
    "(1, 1, Tq, 1)": lambda c: (1, 1, c.tq, 1),
}


@dataclass(frozen=True)
class Case:
    """One attention call: shapes, mask kind and shape, keywords, and the seed of its numbers."""

    b: int
    hkv: int
    group: int  # Hq / Hkv
    tq: int
    tk: int
    d: int
    dv: int
    mask_kind: str | None  # None, "bool" or "float"
    mask_shape: str
    keep_prob: float  # chance that a mask entry lets the key through
    is_causal: bool
    window: int | None
    scale: float | None
    enable_gqa: bool
    seed: int

    @property
    def hq(self) -> int:
        return self.hkv * self.group

    def tensors(self, device, dtype):
        """q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv), and the mask or None."""
        g = torch.Generator().manual_seed(self.seed)

        def randn(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)

        q = randn(self.b, self.hq, self.tq, self.d)
        k = randn(self.b, self.hkv, self.tk, self.d)
        v = randn(self.b, self.hkv, self.tk, self.dv)
        mask = None
        if self.mask_kind is not None:
            shape = MASK_SHAPES[self.mask_shape](self)
            keep = torch.rand(shape, generator=g) < self.keep_prob
            if self.mask_kind == "bool":
                mask = keep.to(device)
            else:
                bias = (2 * torch.randn(shape, generator=g, dtype=torch.float64))
                mask = bias.masked_fill(~keep, float("-inf")).to(device, dtype)
        return q, k, v, mask

    def kwargs(self) -> dict:
        return dict(is_causal=self.is_causal, window=self.window, scale=self.scale,
                    enable_gqa=self.enable_gqa)


@st.composite
def cases(draw, *, max_t: int = 9) -> Case:
    group = draw(st.sampled_from([1, 2, 4]))
    tq, tk = draw(st.integers(1, max_t)), draw(st.integers(1, max_t))
    mask_kind = draw(st.sampled_from([None, "bool", "float"]))
    return Case(
        b=draw(st.integers(1, 3)), hkv=draw(st.integers(1, 3)), group=group, tq=tq, tk=tk,
        d=draw(st.integers(1, 8)), dv=draw(st.integers(1, 8)), mask_kind=mask_kind,
        mask_shape=draw(st.sampled_from(sorted(MASK_SHAPES))),
        keep_prob=draw(st.sampled_from([0.3, 0.8, 1.0])),
        is_causal=draw(st.booleans()),
        window=draw(st.one_of(st.none(), st.integers(1, tq + tk))),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 3.0))),
        enable_gqa=group > 1 or draw(st.booleans()),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
    )


# ---------------------------------------------------------------- models and commands

def gpt(seed=0, device="cpu", **options):
    """A tiny GPT with weights large enough that attention is far from uniform and greedy
    decoding has clear winners (the GPT-2 initialisation makes every score almost 0)."""
    config = dict(vocab_size=13, seq_len=12, d_model=16, n_heads=4, n_layers=2)
    config.update(options)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**config))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=1.5 / math.sqrt(module.in_features))
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=1.0)
    return model.to(device).eval()


def one_line_error(capsys) -> str:
    """What the command printed on stderr, checked to be a single line and nothing on stdout."""
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith("python -m course_attn.bench: error: "), err
    return err


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# What the browser tests start Debian's chromium with: no sandbox (root in a container), no GPU,
# and nothing that reaches out to the network on its own.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-quic", "--disable-component-update", "--disable-sync",
                  "--no-first-run"]


def require_browser(missing: str | None = None) -> None:
    """Skip the calling test module (at import) unless chromium and playwright are here, or
    ``missing`` (what else it lacks) is None; with REQUIRE_BOOK set (CI), fail instead."""
    if missing is None and not Path(CHROMIUM).exists():
        missing = "chromium is not installed (apt-get install chromium)"
    if missing is None:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            missing = "playwright is not installed"
    if missing is not None:
        if os.environ.get("REQUIRE_BOOK"):
            raise RuntimeError(f"REQUIRE_BOOK is set but {missing}")
        pytest.skip(missing, allow_module_level=True)


@contextlib.contextmanager
def chromium() -> Iterator:
    """Debian's chromium, headless, launched by playwright with CHROMIUM_FLAGS, for the block."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            yield browser
        finally:
            browser.close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def served(folder: Path) -> Iterator[str]:
    """``folder`` served over HTTP on 127.0.0.1 for the block, which gets its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()


# An interactive figure (course_attn.viz.InteractiveFigure) once Vega has drawn it: its data rows
# (each with "frame", "who" -- which cell or point --, "shown" -- the value as the tooltip writes
# it -- and "masked" on maps) and its slider's value.
_FIGURE_STATE = """id => {
    const view = window.courseFigures[id];
    let knob = null;
    try { knob = view.signal("knob"); } catch (e) {}
    return {rows: view.data("source_0"), knob: knob};
}"""


def figures_drawn(page, timeout_ms: int = 20_000) -> list[str]:
    """Wait until every interactive figure on ``page`` is drawn; their ids, in page order."""
    page.wait_for_function(
        "() => [...document.querySelectorAll('.course-interactive')].every(f => "
        "window.courseFigures && f.id in window.courseFigures)", timeout=timeout_ms)
    return page.eval_on_selector_all(".course-interactive", "els => els.map(e => e.id)")


def hover_tooltip(page, figure_id: str, aria_prefix: str) -> str:
    """Hover the first cell or point of the figure whose accessible name starts with
    ``aria_prefix``; the text of the tooltip it shows."""
    page.mouse.move(0, 0)
    mark = page.locator(f'#{figure_id} :is(g.mark-rect, g.mark-symbol) > path'
                        f'[aria-label^="{aria_prefix}"]').first
    mark.scroll_into_view_if_needed()
    mark.hover(force=True)
    tooltip = page.locator("#vg-tooltip-element")
    tooltip.wait_for(state="visible", timeout=5_000)
    return tooltip.inner_text()


def probe_interactive_figure(page, figure_id: str) -> list[str]:
    """Hover one drawn figure, then slide it: what went wrong (an empty list: it works).

    The hovered mark is one whose value the slider changes (when there is a slider), else the
    largest value. Its tooltip must show the value of the frame on display, from the figure's
    precomputed data; after the slider is moved to its last value, the same mark's tooltip must
    show the value of the last frame, which differs.
    """
    state = page.evaluate(_FIGURE_STATE, figure_id)
    rows = state["rows"]
    if all(r.get("masked") for r in rows):
        return [f"{figure_id}: no value to hover"]
    frames = sorted({r["frame"] for r in rows})
    at = {(r["frame"], r["who"]): r["shown"] for r in rows}
    start, last = (frames[0], frames[-1]) if state["knob"] is None else (state["knob"],
                                                                         frames[-1])
    if state["knob"] is None:
        who = max((r for r in rows if not r.get("masked")),
                  key=lambda r: float(r.get("value", r.get("y", 0))))["who"]
    else:
        if start == last:
            return [f"{figure_id}: its slider starts at its last value; start it lower"]
        moving = [w for (f, w) in at if f == start and at.get((last, w)) not in (None, at[f, w])]
        shown_in_both = [w for w in moving if "masked" not in (at[start, w], at[last, w])]
        moving = shown_in_both or moving          # a cell the mask hides in one frame will do
        if not moving:
            return [f"{figure_id}: the slider changes no value between {start} and {last}"]
        who = moving[len(moving) // 2]
    problems = []
    text = hover_tooltip(page, figure_id, f"{who}, ")
    if at[start, who] not in text:
        problems.append(f"{figure_id}: hovering {who!r} shows {text!r}, not {at[start, who]}")
    if state["knob"] is not None:
        slider = page.locator(f"#{figure_id} input[type=range]")
        slider.fill(f"{last:g}")
        knob = page.evaluate(_FIGURE_STATE, figure_id)["knob"]
        if abs(knob - last) > 1e-9:
            problems.append(f"{figure_id}: the slider moved the knob to {knob}, not {last}")
        text = hover_tooltip(page, figure_id, f"{who}, ")
        if at[last, who] not in text:
            problems.append(f"{figure_id}: after sliding to {last:g}, hovering {who!r} shows "
                            f"{text!r}, not {at[last, who]}")
    return problems


# ---------------------------------------------------------------- the grader's measurements

@contextlib.contextmanager
def each_allocation_trace_once() -> Iterator[None]:
    """While open, chapter 9's measurement of an attention's allocations
    (``ch09._allocations(fn, t, dim)``, one run under torch's profiler) is taken once per
    (attention, length, width) and then read back. It is the same on every run (the
    allocator's requests depend on the shapes alone; test_checks_ch09 proves it), and judging
    one hidden case of ch09.memory_exponent takes it 27 times for 3 distinct ones: the
    reference, the tolerance's two fits and the six typical mistakes, three lengths each."""
    from course_attn.grading import ch09
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ch09, "_allocations", functools.cache(ch09._allocations))
        yield
