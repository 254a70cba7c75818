"""_ext/accessible_html.py: the theme's HTML that axe-core fails, repaired, and nothing else.

The pages as a whole are checked by axe-core in tests/test_browser.py; these tests need no build
and no browser. The fragments are the ones pydata-sphinx-theme 0.17 and docutils write.
"""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("accessible_html",
                                               ROOT / "_ext" / "accessible_html.py")
accessible_html = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(accessible_html)
repair = accessible_html.repair

CHAPTER_TOGGLE = (
    '<li class="toctree-l1 current active has-children"><a class="current reference internal" '
    'href="#">Chapter 3: Masking &amp; <em>padding</em></a><details open="open"><summary>'
    '<span class="toctree-toggle" role="presentation"><i class="fa-solid fa-chevron-down"></i>'
    "</span></summary><ul>")
SEARCH_FIELD = (
    '<button class="btn search-button-field search-button__button pst-js-only" title="Search" '
    'aria-label="Search" data-bs-placement="bottom" data-bs-toggle="tooltip">\n'
    ' <i class="fa-solid fa-magnifying-glass"></i>\n'
    ' <span class="search-button__default-text">Search</span>\n')
SEARCH_ICON = (
    '<button class="btn btn-sm pst-navbar-icon search-button search-button__button pst-js-only" '
    'title="Search" aria-label="Search" data-bs-placement="bottom" data-bs-toggle="tooltip">')
THEME_SWITCH = (
    '<button class="btn btn-sm nav-link pst-navbar-icon theme-switch-button pst-js-only" '
    'aria-label="Color mode" data-bs-title="Color mode">\n'
    '  <i class="theme-switch fa-solid fa-sun                fa-lg" data-mode="light" '
    'title="Light"></i>\n'
    '  <i class="theme-switch fa-solid fa-moon               fa-lg" data-mode="dark"  '
    'title="Dark"></i>\n')
CITATIONS = ('<div role="list" class="citation-list">\n'
             '<div class="citation" id="id36" role="doc-biblioentry">')


def test_a_chapter_toggle_is_named_after_its_chapter():
    repaired = repair(CHAPTER_TOGGLE)
    assert '<summary aria-label="Sections of Chapter 3: Masking &amp; padding">' in repaired
    assert repaired.replace(' aria-label="Sections of Chapter 3: Masking &amp; padding"',
                            "") == CHAPTER_TOGGLE


def test_the_search_field_is_named_by_what_it_shows_and_the_icon_button_keeps_its_label():
    assert "aria-label" not in repair(SEARCH_FIELD)
    assert 'title="Search"' in repair(SEARCH_FIELD)
    assert repair(SEARCH_ICON) == SEARCH_ICON


def test_the_colour_mode_icons_lose_their_titles_and_the_button_keeps_its_name():
    repaired = repair(THEME_SWITCH)
    assert 'title="Light"' not in repaired and 'title="Dark"' not in repaired
    assert 'aria-label="Color mode"' in repaired and 'data-mode="dark"' in repaired

CELL_TOGGLE = ('<details class="admonition hide above-input">\n'
               '<summary aria-label="Toggle hidden content">\n'
               '<p class="collapsed admonition-title">Show code cell source</p>\n')


def test_a_collapsed_cells_toggle_is_named_by_what_it_shows():
    assert repair(CELL_TOGGLE) == CELL_TOGGLE.replace(' aria-label="Toggle hidden content"', "")


def test_citations_are_list_items():
    assert repair(CITATIONS) == CITATIONS.replace("doc-biblioentry", "listitem")


@pytest.mark.parametrize("page", [CHAPTER_TOGGLE, SEARCH_FIELD, THEME_SWITCH, CITATIONS,
                                  CELL_TOGGLE])
def test_a_repaired_page_is_left_as_it_is(page):
    assert repair(repair(page)) == repair(page)


def test_other_html_is_untouched():
    page = ('<p><a class="reference internal" href="x.html">x</a> <summary>Details</summary> '
            '<i title="Light"></i> <div role="list"><div role="listitem">a</div></div></p>')
    assert repair(page) == page
