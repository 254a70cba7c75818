"""A cell's printed output wraps at its column's edge instead of scrolling sideways.

Why: the book's content column is 786 px wide in Chromium at 1440 and at 1920 px (about 80
characters of code), and the theme gives every ``<pre>`` a horizontal scroll bar for a longer
line: a printed table or message made the reader scroll sideways to read it (issue 45). The
code is formatted to the column; what a cell prints is not known before it runs.

What: ``static/fitted_outputs.css`` joins every page; it wraps only the output blocks, keeping
their spaces and line breaks (code blocks keep the theme's scroll bar, which
``tests/test_browser.py`` requires never to show).
"""

from pathlib import Path

from sphinx.application import Sphinx

STATIC = Path(__file__).parent / "static"


def add_static_path(app: Sphinx, config) -> None:
    if str(STATIC) not in config.html_static_path:
        config.html_static_path.append(str(STATIC))


def setup(app: Sphinx) -> dict:
    app.connect("config-inited", add_static_path)
    app.add_css_file("fitted_outputs.css")
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
