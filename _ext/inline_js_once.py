"""Write each inline ``<script>`` once per page (a workaround for a Sphinx 7 bug).

Why: sphinx-thebe (loaded by Jupyter Book 1 on every book) registers an inline script,
``const THEBE_JS_URL = ...``, with ``app.add_js_file(None, body=...)`` from its
``env-before-read-docs`` handler, i.e. after the HTML builder was initialised. Sphinx 7.4 then
stores that asset twice: ``Sphinx.add_js_file`` passes it to the builder with filename ``None``,
and ``StandaloneHTMLBuilder.prepare_writing`` adds the registry's copy again with filename ``''``;
the two compare unequal (``None != ''``), so every page declares the ``const`` twice and the
browser logs "Identifier 'THEBE_JS_URL' has already been declared". Fixed upstream in
sphinx-doc/sphinx#13402 (Sphinx 8.2), which Jupyter Book 1 (pinned to Sphinx 7.4) cannot use.

What: on ``html-page-context`` the page's script list keeps the first of any entries that differ
only in a ``None`` versus ``''`` filename. Nothing else changes; the extension does nothing on a
Sphinx that no longer duplicates.
"""

from sphinx.application import Sphinx


def _key(script) -> tuple:
    filename = getattr(script, "filename", script) or ""
    attributes = getattr(script, "attributes", {}) or {}
    return (str(filename), getattr(script, "priority", None), tuple(sorted(attributes.items())))


def dedupe_scripts(app: Sphinx, pagename, templatename, context, doctree) -> None:
    scripts = context.get("script_files")
    if not isinstance(scripts, list):
        return
    seen: set[tuple] = set()
    unique = []
    for script in scripts:
        key = _key(script)
        if key not in seen:
            seen.add(key)
            unique.append(script)
    scripts[:] = unique  # the builder's own list: later pages start from it again


def setup(app: Sphinx) -> dict:
    app.connect("html-page-context", dedupe_scripts, priority=900)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
