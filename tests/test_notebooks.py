"""House rules every notebook keeps: what a reader, a Colab user and the grader rely on."""

from pathlib import Path

import nbformat
import pytest

from course_attn.colab import colab_cell_source, repository

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for folder in ("book", "solutions", "exercises")
                   for p in (ROOT / folder).glob("*.ipynb"))
CHAPTERS = sorted(p.stem for p in (ROOT / "book").glob("[0-9][0-9]_*.ipynb"))


def ids(p: Path) -> str:
    return str(p.relative_to(ROOT))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_first_cell_installs_the_package_in_colab_only(path):
    nb = nbformat.read(path, as_version=4)
    expected = colab_cell_source(*repository())
    first = nb.cells[0]
    assert first.cell_type == "code" and first.source == expected, (
        f"{ids(path)}: the first cell is not the Colab install cell for {repository()}; "
        "run `python -m course_attn.colab` (it rewrites book/, solutions/ and exercises/)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_saved_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    with_output = [i for i, c in enumerate(nb.cells)
                   if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not with_output, f"{ids(path)}: cells {with_output} were saved with outputs"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_chapter_has_solutions_exercises_and_links_to_them(chapter):
    assert (ROOT / "solutions" / f"{chapter}.ipynb").exists()
    assert (ROOT / "exercises" / f"{chapter}.ipynb").exists()
    text = "\n".join(c.source for c in nbformat.read(ROOT / "book" / f"{chapter}.ipynb", 4).cells)
    assert f"../exercises/{chapter}.ipynb" in text, f"book/{chapter} does not link its exercises"


def test_every_chapter_and_page_is_in_the_table_of_contents():
    toc = (ROOT / "_toc.yml").read_text()
    for chapter in CHAPTERS:
        assert f"book/{chapter}" in toc and f"exercises/{chapter}" in toc
    for page in (ROOT / "book").glob("*.md"):
        assert f"book/{page.stem}" in toc, f"book/{page.name} is not in _toc.yml"
