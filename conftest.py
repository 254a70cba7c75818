# Root pytest config: what is not a test even though pytest could collect it, and how the tests
# are shared between pytest-xdist's workers (`make test` runs two, with --dist loadgroup).
from pathlib import Path

import pytest

collect_ignore_glob = ["_build/*", ".venv/*", "tests/fixtures/*"]


def pytest_collection_modifyitems(config, items):
    """Keep together, on one worker, what must run in one process: the cells of a notebook
    (nbval runs them in order in one kernel), and the tests of a module that share a
    module-scoped fixture (a class graded once, a kernel started once, a browser launched once),
    so that it is made once, not once per worker. Every other test is dealt out one by one.
    (xdist reads the marks after this hook: its own runs last.)"""
    for item in items:
        path = Path(str(item.fspath))
        if path.suffix == ".ipynb" or _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(str(path.relative_to(config.rootpath))))


def _shares_a_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(definition.scope in ("module", "class", "package")
               for definitions in info.name2fixturedefs.values() for definition in definitions)
