"""Interop with nbgrader, an optional extra (it brings a whole Jupyter server stack, so it is not
a dependency; this file is skipped without it).

- The exercises we generate are what nbgrader's ``ClearSolutions``, ``ClearHiddenTests`` and
  ``ClearOutput`` preprocessors (used as a library, without nbgrader's database) make of the
  same solution notebooks, but for the ``raises-exception`` tag we add.
- The locked and check cells our grader reports as modified are the ones whose nbgrader
  checksum (``nbgrader.utils.compute_checksum``) no longer matches the released notebook's.

To run it, in a throwaway virtual environment::

    python3 -m venv /tmp/nbg
    /tmp/nbg/bin/pip install nbgrader==0.9.6 torch==2.13.0 pytest hypothesis -e .
    /tmp/nbg/bin/python -m pytest -p no:cacheprovider tests/test_grading_nbgrader.py
"""

import copy
import re
from pathlib import Path

import nbformat
import pytest

from course_attn.grading.canonical import load_canonical
from course_attn.grading.generate import RAISES_EXCEPTION_TAG, generate_notebook, grade_id
from course_attn.grading.restore import restore_protected_cells

pytest.importorskip("nbgrader", reason="nbgrader is not installed (an optional extra: see this "
                                       "file's docstring)")
from nbgrader.preprocessors import ClearHiddenTests, ClearOutput, ClearSolutions  # noqa: E402
from nbgrader.utils import compute_checksum  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "solutions" / "99_fixture.ipynb"
SOLUTIONS = [FIXTURE, *sorted((ROOT / "solutions").glob("*.ipynb"))]


def nbgrader_release(nb):
    """What nbgrader's preprocessors make of solution notebook ``nb`` (a copy)."""
    nb, resources = copy.deepcopy(nb), {}
    for preprocessor in (ClearSolutions(), ClearHiddenTests(), ClearOutput()):
        nb, resources = preprocessor.preprocess(nb, resources)
    return nb


def comparable(cell) -> tuple:
    metadata = copy.deepcopy(dict(cell.metadata))
    tags = [t for t in metadata.pop("tags", []) if t != RAISES_EXCEPTION_TAG]
    if tags:
        metadata["tags"] = tags
    return (cell.cell_type, cell.source, metadata, cell.get("outputs"),
            cell.get("execution_count"))


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_generated_exercises_match_nbgrader(path):
    solution = nbformat.read(path, as_version=4)
    ours, theirs = generate_notebook(solution, str(path)), nbgrader_release(solution)
    assert [comparable(c) for c in ours.cells] == [comparable(c) for c in theirs.cells]
    assert ours.metadata == theirs.metadata


def flagged_as_modified(flags: list[str]) -> set[str]:
    pattern = r"(?:locked|check) cell (\S+) \(cell \d+\) (?:was modified|had its nbgrader metadata)"
    return {m.group(1) for flag in flags if (m := re.match(pattern, flag))}


def test_modified_cells_are_those_whose_nbgrader_checksum_changed(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURE.parents[1]))
    __import__("course_fixture_ch99")  # registers the exercises of ch99
    canonical = load_canonical(FIXTURE)
    released = nbgrader_release(nbformat.read(FIXTURE, as_version=4))
    checksums = {grade_id(c): compute_checksum(c) for c in released.cells
                 if grade_id(c) in canonical.protected}
    student = copy.deepcopy(released)
    for cell in student.cells:
        if grade_id(cell) == "ch99-setup":
            cell.source += "\nprint('my own setup')"
        elif grade_id(cell) == "ch99-double":
            cell.source = "pass"
        elif grade_id(cell) == "ch99-row_sum":
            cell.metadata["nbgrader"]["points"] = 100
    changed = {grade_id(c) for c in student.cells
               if grade_id(c) in checksums and compute_checksum(c) != checksums[grade_id(c)]}
    restored = restore_protected_cells(student, canonical)
    assert flagged_as_modified(restored.flags) == changed == {
        "ch99-setup", "ch99-double", "ch99-row_sum"}
