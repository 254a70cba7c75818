"""Serve Vega from the built book, on the pages that hold an interactive figure and no other.

Why: ``course_attn.viz.InteractiveFigure`` writes, in a notebook's output, its static image and a
script that asks ``vegaEmbed`` to draw the chart in its place. The book must draw it offline, so
Vega, Vega-Lite and vega-embed are vendored in ``_ext/static/vega/`` (its README says which
versions) and copied to ``_static/vega/``; a page without an interactive figure does not load
them (they are about 840 kB).

What: the folder joins ``html_static_path``; on ``html-page-context``, a page whose body holds the
figure's class gets the three scripts, deferred (in this order, after the page is parsed and
before ``DOMContentLoaded``, which is when each figure's script draws).
"""

from pathlib import Path

from sphinx.application import Sphinx

STATIC = Path(__file__).parent / "static"
SCRIPTS = ("vega/vega.min.js", "vega/vega-lite.min.js", "vega/vega-embed.min.js")
MARKER = 'class="course-interactive"'          # course_attn.viz.INTERACTIVE_CLASS


def add_static_path(app: Sphinx, config) -> None:
    if str(STATIC) not in config.html_static_path:
        config.html_static_path.append(str(STATIC))


def add_vega(app: Sphinx, pagename, templatename, context, doctree) -> None:
    if MARKER in (context.get("body") or ""):
        for script in SCRIPTS:
            app.add_js_file(script, defer="defer")


def setup(app: Sphinx) -> dict:
    app.connect("config-inited", add_static_path)
    app.connect("html-page-context", add_vega)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
