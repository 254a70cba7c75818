"""Repair what the theme writes that axe-core calls a serious or critical accessibility failure.

Why: pydata-sphinx-theme 0.17 (under sphinx-book-theme) and docutils write, on every page, HTML
that a screen reader cannot name or that contradicts itself; ``tests/test_browser.py`` runs
axe-core on every page and fails on these. None is configurable, so the written pages are
repaired once the build has finished (each repair finds nothing to change a second time):

- ``summary-name``: the side bar's ``<summary>`` that opens a chapter's sections holds only an
  icon. It is named "Sections of <the chapter's title>".
- ``label-content-name-mismatch``: the search field's button says "Search Ctrl+K" but is named
  "Search" by its ``aria-label``; the label goes, so its name is what it shows. The colour-mode
  button's icons carry ``title``s, which Font Awesome's script turns into the visible text
  "Light", "Dark", "System Settings" of a button named "Color mode"; the titles go (the
  button's tooltip still says "Color mode"), so the icons are decoration. A collapsed cell's
  toggle (``hide-input``, sphinx-togglebutton) says "Show code cell source" but is named "Toggle
  hidden content"; the label goes, so its name is what it shows.
- ``aria-required-children`` (critical, the references page): docutils marks each citation
  ``role="doc-biblioentry"``, a role DPUB-ARIA 1.1 deprecates, inside ``role="list"``; a list
  must hold list items, which is what the deprecation says to use instead.
"""

import html
import re
from pathlib import Path

from sphinx.application import Sphinx

_CHAPTER_TOGGLE = re.compile(
    r'(<a class="[^"]*\breference internal\b[^"]*" href="[^"]*">)((?:(?!</a>).)*)'
    r"(</a>\s*<details[^>]*>\s*)<summary>", re.DOTALL)
_SEARCH_FIELD_LABEL = re.compile(
    r'(<button class="[^"]*\bsearch-button-field\b[^"]*"[^>]*?) aria-label="[^"]*"')
_THEME_SWITCH_TITLES = re.compile(
    r'(<i class="theme-switch [^"]*" data-mode="[a-z]+")\s+title="[^"]*"')
_BIBLIOENTRY = ' role="doc-biblioentry"'
_TOGGLE_LABEL = '<summary aria-label="Toggle hidden content">'


def _name_chapter_toggle(match: re.Match) -> str:
    title = html.unescape(re.sub(r"<[^>]+>", "", match[2])).strip()
    label = html.escape(f"Sections of {title}", quote=True)
    return f'{match[1]}{match[2]}{match[3]}<summary aria-label="{label}">'


def repair(page: str) -> str:
    """The page's HTML with the repairs above; unchanged when there is nothing to repair."""
    page = _CHAPTER_TOGGLE.sub(_name_chapter_toggle, page)
    page = _SEARCH_FIELD_LABEL.sub(r"\1", page)
    page = _THEME_SWITCH_TITLES.sub(r"\1", page)
    page = page.replace(_TOGGLE_LABEL, "<summary>")
    return page.replace(_BIBLIOENTRY, ' role="listitem"')


def repair_pages(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    for path in Path(app.outdir).rglob("*.html"):
        before = path.read_text(encoding="utf-8")
        after = repair(before)
        if after != before:
            path.write_text(after, encoding="utf-8")


def setup(app: Sphinx) -> dict:
    app.connect("build-finished", repair_pages)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
