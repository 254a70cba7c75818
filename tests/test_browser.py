"""The built book in a real browser (Debian's chromium, driven by playwright).

Every page: no console error at all (none is ignored), no request leaving 127.0.0.1, every
formula rendered by MathJax, no stray ``$`` left in the prose (math that the parser did not
recognise), every image loaded, every internal link resolving, no absolute path of the build
machine in the visible text. Exercise pages show no traceback. Accessibility: axe-core finds no
serious or critical violation on any page, in light and in dark mode, and every figure has alt
text that says what it shows (not its file name). The search page finds "rotary".
Full-page screenshots of the chapters, their exercises and the appendices are saved to
``artifacts/pages/`` (and one chapter's first screen to ``artifacts/chapter.png``) for a person
to look at.

Needs ``make book`` and /usr/bin/chromium (``.ci/run`` installs it). Without them these tests
skip, unless ``REQUIRE_BOOK=1`` (set by CI) turns a missing piece into a failure. ``BOOK_HTML``
points them at another build (e.g. one made with ``jupyter-book build . --path-output DIR``:
``BOOK_HTML=DIR/_build/html``).

axe-core is vendored, one file, as npm publishes it (``tests/vendor/axe.min.js``, MPL-2.0, its
header kept; ``tests/vendor/README.md`` says which version and how to update it), so that the
test needs neither npm nor the network.
"""

import functools
import json
import os
import re
import sys
import sysconfig
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin, urlparse

import pytest
from helpers import chromium, figures_drawn, probe_interactive_figure, require_browser, served

from course_attn.viz import INTERACTIVE_CLASS

ROOT = Path(__file__).resolve().parents[1]
HTML = Path(os.environ.get("BOOK_HTML") or ROOT / "_build" / "html").resolve()
ARTIFACTS = ROOT / "artifacts"
# Text that tells where the book was built, never meant for a reader (a traceback's file names,
# a printed path): the checkout and the folder around it, the interpreter's installation.
MACHINE_PATHS = sorted({str(ROOT), f"{ROOT.parent}/", sys.prefix,
                        *(sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib"))},
                       key=len, reverse=True)
INSTALL_DIRS = re.compile(r"(site|dist)-packages")
# Where visible prose ends: code, program output, and what MathJax drew.
NOT_PROSE = "pre, code, kbd, samp, script, style, textarea, mjx-container, math, .highlight"
SCREENSHOTS = ("book/0", "exercises/", "book/appendix_")
AXE = ROOT / "tests" / "vendor" / "axe.min.js"
# axe's impact levels that fail a page (the others, moderate and minor, are reported by axe only).
BLOCKING = ("serious", "critical")
AXE_RUN = """async blocking => {
    const result = await axe.run(document, {resultTypes: ["violations"]});
    return result.violations.filter(v => blocking.includes(v.impact)).map(v =>
        `${v.id} (${v.impact}, ${v.nodes.length}x): ${v.help}; ` +
        `e.g. ${v.nodes[0].target.join(" ")}`);
}"""
# Each page's weight before the interactive figures (bytes it loaded); a page may weigh twice that.
WEIGHTS_BEFORE = json.loads((ROOT / "tests" / "fixtures" / "page_weights.json").read_text())
MAX_WEIGHT_GROWTH = 2.0
INTERACTIVE = f'class="{INTERACTIVE_CLASS}"'
# The chapters whose figures issue 23 asked to be interactive; those with a slider among them.
INTERACTIVE_CHAPTERS = ("01", "02", "03", "04", "05", "06", "10", "11")
SLIDER_CHAPTERS = ("02", "05", "06", "10", "11")
# Interactive figures wider than the column that holds them (a reader would have to scroll).
TOO_WIDE = """ids => ids.map(id => {
    const figure = document.getElementById(id);
    const column = figure.closest(".cell_output") || figure.parentElement;
    const width = Math.ceil(figure.querySelector("svg").getBoundingClientRect().width);
    return [id, width, column.clientWidth];
}).filter(([id, width, room]) => width > room)"""
# The window in which a code block or an output must fit its box: the book's column is 786 px
# wide at 1440 px, as at 1920 px. Toggled cells are opened first, so that hidden code counts too.
READING_WIDTH = 1440
WIDE_BLOCKS = """() => {
    document.querySelectorAll("main details").forEach(d => { d.open = true; });
    return [...document.querySelectorAll("main pre")]
        .filter(pre => pre.scrollWidth > pre.clientWidth)
        .map(pre => {
            const kind = pre.closest(".cell_output") ? "output" : "code";
            const line = pre.textContent.split("\\n").reduce((a, b) => b.length > a.length ? b : a);
            return `${kind} ${pre.scrollWidth} px in ${pre.clientWidth} px: ${line.trim()}`;
        });
}"""
# A figure's alt text that only names its file: what Sphinx writes when no alt is given.
FILE_NAME_ALT = re.compile(r"^\S*\.(png|jpe?g|svg|gif)$", re.IGNORECASE)


require_browser(None if (HTML / "index.html").exists()
                else "the book is not built: run `make book`")

from playwright.sync_api import Error as PlaywrightError  # noqa: E402


def book_pages() -> list[str]:
    """Every content page of the build, relative to its root (Sphinx's own pages aside)."""
    skip = {"genindex.html", "search.html", "py-modindex.html"}
    return sorted(str(p.relative_to(HTML)) for p in HTML.rglob("*.html")
                  if p.name not in skip and "_static" not in p.parts and "_sources" not in p.parts
                  and 'http-equiv="refresh"' not in p.read_text(encoding="utf-8").lower())


@pytest.fixture(scope="module")
def site():
    with served(HTML) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


class Visit:
    """A page loaded in a fresh context, with every console error and outside request recorded."""

    def __init__(self, browser, url: str):
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.errors: list[str] = []
        self.outside: list[str] = []
        self.requested: set[str] = set()
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url, wait_until="load")
        self.wait_for_mathjax()
        self.figures = figures_drawn(self.page)

    def wait_for_mathjax(self):
        for _ in range(3):  # a redirecting page may navigate while we wait
            try:
                self.page.evaluate("async () => { if (window.MathJax && MathJax.startup) "
                                   "await MathJax.startup.promise; }")
                return
            except PlaywrightError as e:
                if "context was destroyed" not in str(e):
                    raise
                self.page.wait_for_load_state("load")

    def _route(self, route):
        host = urlparse(route.request.url).hostname
        if route.request.url.startswith(("data:", "blob:")) or host == "127.0.0.1":
            if host == "127.0.0.1":
                self.requested.add(unquote(urlparse(route.request.url).path))
            route.continue_()
        else:
            self.outside.append(route.request.url)
            route.abort()

    def weight(self) -> int:
        """Bytes of the site's files that the page has loaded so far."""
        files = (HTML / path.lstrip("/") for path in self.requested)
        return sum(f.stat().st_size for f in files if f.is_file())

    def close(self):
        self.context.close()


class _Ids(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k in ("id", "name") and v:
                self.ids.add(v)


@functools.lru_cache(maxsize=None)
def ids_of(path: Path) -> frozenset:
    parser = _Ids()
    parser.feed(path.read_text(encoding="utf-8"))
    return frozenset(parser.ids)


@dataclass
class Reading:
    """What one page showed in the browser, gathered in one visit and asserted by several tests."""

    errors: list[str]
    outside: list[str]
    formulas: list[bool]          # one per math element: did MathJax draw it?
    tex_errors: int
    stray: list[str]              # prose around each $ outside code and math
    text: str                     # the visible text of the page's main column
    traceback_blocks: int
    broken_images: list[str]
    hrefs: list[str]
    images: list[tuple[str, str]]  # (src, alt) of every figure: a cell's output, a figure
    accessibility: dict[str, list[str]]  # colour scheme -> axe's serious and critical violations
    weight: int = 0               # bytes of the site's files the page loaded
    figures: int = 0              # interactive figures drawn
    figure_problems: list[str] | None = None  # what hovering and sliding them found wrong
    wide_blocks: list[str] | None = None  # code and output wider than their box, READING_WIDTH


STRAY_DOLLARS = """skip => {
    const root = document.querySelector("main") || document.body;
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    const found = [];
    while (walker.nextNode()) {
        const node = walker.currentNode;
        if (!node.nodeValue.includes("$") || node.parentElement.closest(skip)) continue;
        const block = node.parentElement.closest("p, li, dd, td, th, h1, h2, h3, h4, div");
        const text = (block || node.parentElement).textContent.replace(/\\s+/g, " ");
        const i = text.indexOf("$");
        const snippet = text.slice(Math.max(0, i - 60), i + 60);
        if (!found.includes(snippet)) found.push(snippet);
    }
    return found;
}"""


def run_axe(page) -> list[str]:
    """axe-core's serious and critical violations on the page as it is now, one line each."""
    if not page.evaluate("() => typeof axe !== 'undefined'"):
        page.add_script_tag(content=AXE.read_text(encoding="utf-8"))
    return page.evaluate(AXE_RUN, list(BLOCKING))


def screenshot_path(page: str) -> Path:
    return ARTIFACTS / "pages" / (page.removesuffix(".html").replace("/", "__") + ".png")


@pytest.fixture(scope="module")
def read(browser, site):
    """``read(page)``: the page's Reading, from one visit per page for the whole module.

    Sphinx turns every parsed ``$...$`` and ``$$...$$`` into a math element that MathJax draws, so
    a ``$`` still in the prose is math the parser did not recognise (e.g. display math inside a
    list item without the indentation MyST needs); code, outputs and MathJax's output are skipped.
    Pages in SCREENSHOTS are also saved whole, as PNG, for a person to look at.
    """
    cache: dict[str, Reading] = {}

    def reading(page: str) -> Reading:
        if page in cache:
            return cache[page]
        visit = Visit(browser, site + page)
        try:
            p = visit.page
            main = "main" if p.locator("main").count() else "body"
            cache[page] = Reading(
                errors=visit.errors,
                outside=visit.outside,
                formulas=p.eval_on_selector_all(
                    ".math", "els => els.map(e => e.querySelector('mjx-container') !== null)"),
                tex_errors=p.locator("mjx-merror").count(),
                stray=p.evaluate(STRAY_DOLLARS, NOT_PROSE),
                text=p.inner_text(main),
                traceback_blocks=p.locator(".output.traceback, .output.error").count(),
                broken_images=p.eval_on_selector_all(
                    "img", "els => els.filter(i => !(i.complete && i.naturalWidth > 0))"
                           ".map(i => i.src)"),
                hrefs=p.eval_on_selector_all("a[href]", "els => els.map(a => a.href)"),
                images=p.eval_on_selector_all(
                    "main .cell_output img, main figure img",
                    "els => els.map(i => [i.src, i.getAttribute('alt') || ''])"),
                accessibility={"light": run_axe(p)},
            )
            if page.startswith(SCREENSHOTS):
                p.evaluate("async () => { await document.fonts.ready; }")
                screenshot_path(page).parent.mkdir(parents=True, exist_ok=True)
                p.screenshot(path=str(screenshot_path(page)), full_page=True)
            p.emulate_media(color_scheme="dark")   # the theme follows it (default_mode: auto)
            p.wait_for_function("document.documentElement.dataset.theme === 'dark'")
            # The theme fades its colours in: judged mid-transition, a text can lack contrast.
            p.wait_for_function("document.getAnimations().every(a => a.playState !== 'running')")
            cache[page].accessibility["dark"] = run_axe(p)
            cache[page].weight = visit.weight()
            cache[page].figures = len(visit.figures)
            cache[page].figure_problems = [
                f"{figure} is {width} px wide, wider than the column's {room} px"
                for figure, width, room in p.evaluate(TOO_WIDE, visit.figures)]
            cache[page].figure_problems += [problem for figure in visit.figures
                                            for problem in probe_interactive_figure(p, figure)]
            p.set_viewport_size({"width": READING_WIDTH, "height": 900})
            cache[page].wide_blocks = p.evaluate(WIDE_BLOCKS)
        finally:
            visit.close()
        return cache[page]

    return reading


PAGES = book_pages()
EXERCISE_PAGES = [p for p in PAGES if p.startswith("exercises/")]


@pytest.mark.parametrize("page", PAGES)
def test_no_console_error_and_nothing_from_another_host(read, page):
    r = read(page)
    assert not r.outside, f"{page} asked another host for: {r.outside}"
    assert not r.errors, f"{page} logged console errors: {r.errors}"


@pytest.mark.parametrize("page", PAGES)
def test_every_formula_is_drawn_and_no_dollar_is_left(read, page):
    r = read(page)
    not_drawn = r.formulas.count(False)
    assert not not_drawn, f"{page}: {not_drawn} of {len(r.formulas)} formulas not rendered"
    assert r.tex_errors == 0, f"{page}: MathJax reports a TeX error"
    assert not r.stray, f"{page}: a $ outside code and math (math not parsed?): {r.stray}"


@pytest.mark.parametrize("page", PAGES)
def test_images_load_and_links_resolve(read, page):
    r = read(page)
    assert not r.broken_images, f"{page}: images that did not load: {r.broken_images}"
    for href in r.hrefs:
        url, fragment = urldefrag(href)
        if urlparse(url).hostname != "127.0.0.1":
            continue
        target = HTML / urlparse(url).path.lstrip("/")
        if target.is_dir():
            target = target / "index.html"
        assert target.is_file(), f"{page}: link {href} leads nowhere"
        if fragment and target.suffix == ".html":
            assert fragment in ids_of(target), f"{page}: link {href} names a missing anchor"


@pytest.mark.parametrize("page", PAGES)
def test_no_path_of_the_machine_that_built_it(read, page):
    r = read(page)
    paths = [m for m in MACHINE_PATHS if m in r.text] + INSTALL_DIRS.findall(r.text)
    assert not paths, f"{page} shows paths of the machine that built it: {sorted(set(paths))}"


@pytest.mark.parametrize("page", PAGES)
def test_no_serious_or_critical_accessibility_violation(read, page):
    r = read(page)
    for scheme, violations in r.accessibility.items():
        assert not violations, f"{page} ({scheme} mode), axe-core: " + "; ".join(violations)


@pytest.mark.parametrize("page", PAGES)
def test_code_and_output_fit_their_box_at_1440_px(read, page):
    """No code block and no printed output needs a horizontal scroll bar in a 1440 px window: the
    code is formatted to the column, the output wraps in it (_ext/fitted_outputs.py)."""
    wide = read(page).wide_blocks
    assert not wide, (f"{page}: {len(wide)} blocks wider than their box at {READING_WIDTH} px, "
                      "the widest line of each: " + "; ".join(wide))


@pytest.mark.parametrize("page", PAGES)
def test_every_figure_has_alt_text_that_says_what_it_shows(read, page):
    r = read(page)
    unsaid = [src.rsplit("/", 1)[-1] for src, alt in r.images
              if len(alt.split()) < 4 or FILE_NAME_ALT.match(alt.strip())]
    assert not unsaid, (f"{page}: figures without alt text that describes them (cell metadata "
                        f"mystnb: image: alt: ...): {unsaid}")


@pytest.mark.parametrize("page", PAGES)
def test_interactive_figures_show_their_values_on_hover_and_follow_their_sliders(read, page):
    r = read(page)
    in_html = (HTML / page).read_text(encoding="utf-8").count(INTERACTIVE)
    assert r.figures == in_html, f"{page}: {r.figures} of {in_html} interactive figures drawn"
    assert not r.figure_problems, f"{page}: " + "; ".join(r.figure_problems)


@pytest.mark.parametrize("chapter", INTERACTIVE_CHAPTERS)
def test_the_chapters_that_sweep_or_map_have_interactive_figures(chapter):
    (page,) = HTML.glob(f"book/{chapter}_*.html")
    text = page.read_text(encoding="utf-8")
    assert INTERACTIVE in text, f"{page.name} has no interactive figure"
    if chapter in SLIDER_CHAPTERS:
        assert '"input":"range"' in text, f"{page.name} has no slider"


@pytest.mark.parametrize("page", PAGES)
def test_vega_loads_only_where_a_figure_needs_it(page):
    text = (HTML / page).read_text(encoding="utf-8")
    assert ("_static/vega/vega.min.js" in text) == (INTERACTIVE in text), (
        f"{page}: Vega's scripts must load exactly on the pages with an interactive figure")


@pytest.mark.parametrize("page", PAGES)
def test_page_weight_stays_within_twice_the_static_book(read, page):
    before = WEIGHTS_BEFORE["pages"].get(page)
    if before is None:
        pytest.skip(f"{page} is newer than the weights in tests/fixtures/page_weights.json")
    r = read(page)
    print(f"{page}: {r.weight / 1e6:.2f} MB, {r.weight / before:.2f}x the static book")
    assert r.weight <= MAX_WEIGHT_GROWTH * before, (
        f"{page} weighs {r.weight} bytes, {r.weight / before:.2f}x its {before} before the "
        "interactive figures (at most 2x)")


@pytest.mark.parametrize("page", EXERCISE_PAGES)
def test_exercise_page_shows_no_traceback(read, page):
    r = read(page)
    shown = [word for word in ("Traceback", "ExerciseFailed") if word in r.text]
    assert r.traceback_blocks == 0 and not shown, (
        f"{page} shows {r.traceback_blocks} traceback block(s) and the words {shown}: an "
        "unanswered exercise should print its check table, not raise")


@pytest.mark.parametrize("page", [p for p in PAGES if p.startswith(SCREENSHOTS)])
def test_full_page_screenshot_is_saved(read, page):
    read(page)
    shot = screenshot_path(page)
    assert shot.is_file() and shot.stat().st_size > 10_000, f"{shot} is missing or blank"


def test_front_page_leads_to_the_introduction(browser, site):
    visit = Visit(browser, site)
    try:
        visit.page.wait_for_url("**/book/intro.html", timeout=10_000)
        assert visit.page.locator("h1").first.inner_text().startswith("Attention")
    finally:
        visit.close()


def test_search_finds_rotary(browser, site):
    visit = Visit(browser, urljoin(site, "search.html?q=rotary"))
    try:
        results = visit.page.locator("#search-results ul.search li")
        results.first.wait_for(timeout=30_000)
        assert results.count() >= 1
    finally:
        visit.close()


@pytest.mark.parametrize("page", [p for p in book_pages() if p.startswith(SCREENSHOTS)])
def test_full_page_screenshot(read, page):
    """A picture of the whole page as a reader sees it, for a person to look at: the one that
    ``read`` took on its visit (a second visit only took it again), as wide as the window and
    as long as the page, not just its first screen."""
    read(page)
    header = screenshot_path(page).read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", "the screenshot is not a PNG"
    width, height = int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")
    assert width == 1280 and height > 900, f"{page}: a {width}x{height} screenshot, not the page"


def test_screenshot_of_a_chapter(browser, site):
    chapter = next(p for p in book_pages() if p.startswith("book/0"))
    visit = Visit(browser, site + chapter)
    try:
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "chapter.png"
        visit.page.screenshot(path=str(shot), full_page=False)
        assert shot.stat().st_size > 10_000, "the screenshot is suspiciously small"
    finally:
        visit.close()
