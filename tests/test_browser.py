"""The built book in a real browser (Debian's chromium, driven by playwright).

Every page: no console errors, no request leaving 127.0.0.1, every formula rendered by MathJax,
every image loaded, every internal link resolving. The search page finds "rotary". A screenshot
of one chapter is saved to ``artifacts/``.

Needs ``make book`` and /usr/bin/chromium (``.ci/run`` installs it). Without them these tests
skip, unless ``REQUIRE_BOOK=1`` (set by CI) turns a missing piece into a failure.
"""

import functools
import http.server
import os
import shutil
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
# sphinx-thebe logs this when its (unused) launch button has no kernel configured.
HARMLESS = ("thebe",)


def _missing() -> str | None:
    if not (HTML / "index.html").exists():
        return "the book is not built: run `make book`"
    if not Path(CHROMIUM).exists():
        return "chromium is not installed (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed"
    return None


if (why := _missing()) is not None:
    if os.environ.get("REQUIRE_BOOK"):
        raise RuntimeError(f"REQUIRE_BOOK is set but {why}")
    pytest.skip(why, allow_module_level=True)

from playwright.sync_api import Error as PlaywrightError  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402


def book_pages() -> list[str]:
    """Every content page of the build, relative to its root (Sphinx's own pages aside)."""
    skip = {"genindex.html", "search.html", "py-modindex.html"}
    return sorted(str(p.relative_to(HTML)) for p in HTML.rglob("*.html")
                  if p.name not in skip and "_static" not in p.parts and "_sources" not in p.parts
                  and 'http-equiv="refresh"' not in p.read_text(encoding="utf-8"))


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site():
    handler = functools.partial(_Quiet, directory=str(HTML))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


class Visit:
    """A page loaded in a fresh context, with every console error and outside request recorded."""

    def __init__(self, browser, url: str):
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.errors: list[str] = []
        self.outside: list[str] = []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url, wait_until="load")
        self.wait_for_mathjax()

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
            route.continue_()
        else:
            self.outside.append(route.request.url)
            route.abort()

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


@pytest.mark.parametrize("page", book_pages())
def test_page_in_browser(browser, site, page):
    visit = Visit(browser, site + page)
    try:
        p = visit.page
        assert not visit.outside, f"{page} asked another host for: {visit.outside}"
        errors = [e for e in visit.errors if not any(h in e.lower() for h in HARMLESS)]
        assert not errors, f"{page} logged console errors: {errors}"

        math = p.eval_on_selector_all(
            ".math", "els => els.map(e => e.querySelector('mjx-container') !== null)")
        assert all(math), f"{page}: {math.count(False)} of {len(math)} formulas not rendered"
        assert p.locator("mjx-merror").count() == 0, f"{page}: MathJax reports a TeX error"

        broken = p.eval_on_selector_all(
            "img", "els => els.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)")
        assert not broken, f"{page}: images that did not load: {broken}"

        hrefs = p.eval_on_selector_all("a[href]", "els => els.map(a => a.href)")
        for href in hrefs:
            url, fragment = urldefrag(href)
            if urlparse(url).hostname != "127.0.0.1":
                continue
            target = HTML / urlparse(url).path.lstrip("/")
            if target.is_dir():
                target = target / "index.html"
            assert target.is_file(), f"{page}: link {href} leads nowhere"
            if fragment and target.suffix == ".html":
                assert fragment in ids_of(target), f"{page}: link {href} names a missing anchor"
    finally:
        visit.close()


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
