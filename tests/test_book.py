"""The built book (``make book``): every page there, offline, with math and figures.

These tests read ``_build/html``; CI builds the book first. Locally they skip until you have run
``make book``, unless ``REQUIRE_BOOK=1`` (set by CI) makes a missing build a failure.
"""

import os
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
CHAPTERS = sorted(p.stem for p in (ROOT / "book").glob("[0-9][0-9]_*.ipynb"))

if not (HTML / "index.html").exists():
    if os.environ.get("REQUIRE_BOOK"):
        raise RuntimeError(f"REQUIRE_BOOK is set but {HTML} has no build: run `make book` first")
    pytest.skip("the book is not built: run `make book`", allow_module_level=True)


class Assets(HTMLParser):
    """Collects what a page loads: scripts, stylesheets, images, and its math."""

    def __init__(self):
        super().__init__()
        self.loads: list[str] = []
        self.images: list[str] = []
        self.icons: list[str] = []
        self.inline_scripts: list[str] = []
        self._in_script = False

    def handle_data(self, data):
        if self._in_script and data.strip():
            self.inline_scripts.append(data.strip())

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "script":
            self._in_script = not a.get("src")
        if tag == "script" and a.get("src"):
            self.loads.append(a["src"])
        elif tag == "link" and a.get("rel") in ("stylesheet", "preload") and a.get("href"):
            self.loads.append(a["href"])
        elif tag == "img" and a.get("src"):
            self.images.append(a["src"])
        elif tag == "link" and a.get("rel") == "icon" and a.get("href"):
            self.icons.append(a["href"])


def parse(page: Path) -> Assets:
    assets = Assets()
    assets.feed(page.read_text(encoding="utf-8"))
    return assets


def pages() -> list[Path]:
    names = ["book/intro"] + [f"book/{c}" for c in CHAPTERS] + [f"exercises/{c}" for c in CHAPTERS]
    return [HTML / f"{n}.html" for n in names]


def test_every_chapter_and_its_exercises_are_pages():
    assert CHAPTERS, "no chapter notebooks in book/"
    missing = [str(p.relative_to(HTML)) for p in pages() if not p.exists()]
    assert not missing, f"pages missing from the build: {missing}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(HTML)))
def test_page_loads_nothing_from_another_host(page):
    external = [u for u in parse(page).loads + parse(page).images if re.match(r"^(https?:)?//", u)]
    assert not external, f"{page.name} loads from another host: {external}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(HTML)))
def test_mathjax_is_served_from_the_site(page):
    mathjax = [u for u in parse(page).loads if "mathjax" in u.lower()]
    if 'class="math' in page.read_text(encoding="utf-8"):
        assert mathjax, f"{page.name} shows math but does not load MathJax"
    for url in mathjax:
        local = (page.parent / url.split("?")[0]).resolve()
        assert local.is_file(), f"{page.name} loads {url}, which is not in the build"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(HTML)))
def test_each_inline_script_is_written_once(page):
    # Sphinx 7 wrote sphinx-thebe's `const THEBE_JS_URL = ...` twice into every page, and the
    # browser logged "Identifier 'THEBE_JS_URL' has already been declared" (_ext/inline_js_once.py).
    scripts = parse(page).inline_scripts
    twice = sorted({s[:80] for s in scripts if scripts.count(s) > 1})
    assert not twice, f"{page.name} repeats inline scripts: {twice}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(HTML)))
def test_page_names_an_icon_that_is_in_the_build(page):
    # Without one, a browser asks for /favicon.ico and logs the 404 as a console error.
    icons = parse(page).icons
    assert icons, f"{page.name} names no icon"
    for href in icons:
        assert (page.parent / href).resolve().is_file(), f"{page.name}: icon {href} is not built"


def test_mathjax_fonts_are_in_the_build():
    fonts = HTML / "_static" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2"
    assert any(fonts.glob("*.woff")), "MathJax's fonts are not in the build"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_has_math_and_loaded_figures(chapter):
    page = HTML / "book" / f"{chapter}.html"
    text = page.read_text(encoding="utf-8")
    assert re.search(r'class="math|\\\(|\\\[', text), f"{chapter} shows no math"
    images = parse(page).images
    assert images, f"{chapter} shows no figure"
    for src in images:
        if src.startswith("data:"):
            continue
        assert (page.parent / src).resolve().is_file(), f"{chapter}: image {src} is not in the build"
