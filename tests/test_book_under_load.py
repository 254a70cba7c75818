"""`.ci/book_under_load.py` (`make book-under-load`): it fails when a cell raises, and when a cell
takes over a third of the per-cell timeout; it passes a quick notebook."""

import importlib.util
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("book_under_load", ROOT / ".ci" / "book_under_load.py")
book_under_load = importlib.util.module_from_spec(spec)
spec.loader.exec_module(book_under_load)


def notebook(tmp_path, source):
    path = tmp_path / "n.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)]), path)
    return str(path)


@pytest.mark.parametrize("source, ok", [
    ("x = 1", True),
    ("import time; time.sleep(1.5)", False),     # over a third of a 3 s timeout
    ("raise ValueError('broken')", False),
])
def test_fails_on_a_slow_or_raising_cell(tmp_path, capsys, source, ok):
    code = book_under_load.main(["--busy", "0", "--timeout", "3", notebook(tmp_path, source)])
    assert code == (0 if ok else 1), capsys.readouterr()
    if not ok:
        assert "FAILED" in capsys.readouterr().err


def test_the_book_is_every_notebook_of_the_table_of_contents():
    names = {p.relative_to(ROOT).as_posix() for p in book_under_load.book_notebooks()}
    assert "book/appendix_performance.ipynb" in names and "exercises/05_rope.ipynb" in names
    chapters = sorted(p.name for p in (ROOT / "book").glob("[0-9][0-9]_*.ipynb"))
    assert chapters and [n for n in sorted(names) if n[5:7].isdigit()] == [
        f"book/{name}" for name in chapters]
