"""A chapter's canonical notebook, ``solutions/NN_topic.ipynb``, read before any kernel starts:
its graded exercises (grade cell -> exercise key and points) and the cells a student may not
change. Each grade cell names a registered exercise (``grade_id`` ``chNN-name`` for the exercise
``chNN.name``); a notebook whose grade cells do not is the author's error, reported as such."""

from dataclasses import dataclass
from pathlib import Path

import nbformat

from .exercise import Exercise, get, key_of
from .cells import grade_id, is_grade_cell, is_locked_cell, is_solution_cell, nbgrader_metadata
from .generate import generate_notebook
from .notebook import chapter_of, read_notebook


class GraderError(Exception):
    """The grader itself could not grade a notebook (no solutions, no kernel); not the student."""


@dataclass
class GradedExercise:
    """One grade cell of the canonical notebook and the exercise it grades."""

    grade_id: str
    points: float
    key: str  # a key, not the Exercise, so that a Canonical can be sent to worker processes

    @property
    def exercise(self) -> Exercise:
        return get(self.key)


@dataclass
class Canonical:
    """A chapter's solutions notebook: its exercises and the cells a student may not change."""

    path: Path
    exercises: list[GradedExercise]
    protected: dict[str, nbformat.NotebookNode]  # grade_id -> grade or locked cell
    given: dict[str, nbformat.NotebookNode]  # the same cells as the exercise notebook shows them
    order: list[str]  # every grade_id of the notebook, in order


def solution_chapters(solutions_dir: Path) -> dict[str, Path]:
    """Chapter -> its notebook in ``solutions_dir`` (metadata first, else the NN_ prefix)."""
    found: dict[str, Path] = {}
    for path in sorted(solutions_dir.glob("*.ipynb")):
        chapter = chapter_of(read_notebook(path).nb, path)
        if chapter is not None:
            found.setdefault(chapter, path)
    return found


def load_canonical(path: Path) -> Canonical:
    read = read_notebook(path)
    if read.nb is None:
        raise GraderError(f"solutions notebook {path}: {read.problem}")
    nb = read.nb
    try:
        exercise_nb = generate_notebook(nb, str(path))
    except ValueError as error:
        raise GraderError(str(error)) from None
    exercises, protected = [], {}
    for cell in nb.cells:
        if is_solution_cell(cell):  # the student's answer, even when graded by hand
            continue
        if is_grade_cell(cell) or is_locked_cell(cell):
            protected[grade_id(cell)] = cell
        if is_grade_cell(cell) and cell.cell_type == "code":
            key = key_of(grade_id(cell))
            if key is None:
                raise GraderError(f"{path}: the grade cell {grade_id(cell)!r} does not name an "
                                  "exercise (grade_id 'chNN-name' for the exercise 'chNN.name')")
            try:
                get(key)
            except ValueError as error:
                raise GraderError(f"{path}: {error}") from None
            exercises.append(GradedExercise(grade_id(cell), nbgrader_metadata(cell)["points"],
                                            key))
    given = {grade_id(cell): cell for cell in exercise_nb.cells if grade_id(cell) in protected}
    order = [grade_id(cell) for cell in nb.cells if grade_id(cell) is not None]
    return Canonical(path, exercises, protected, given, order)


def load_canonicals(solutions_dir: Path | str) -> dict[str, "Canonical | str"]:
    """Chapter -> its Canonical, or why it could not be loaded, for every notebook in
    ``solutions_dir``."""
    loaded: dict[str, Canonical | str] = {}
    for chapter, path in solution_chapters(Path(solutions_dir)).items():
        try:
            loaded[chapter] = load_canonical(path)
        except GraderError as error:
            loaded[chapter] = str(error)
    return loaded


class UnknownChapter(GraderError):
    """A submission names a chapter that the solutions do not have: its problem, not the
    grader's."""


def lookup_in(canonicals: dict[str, "Canonical | str"], solutions_dir: Path | str = "solutions"):
    """A chapter -> Canonical lookup over ``load_canonicals``' answer (GraderError if none)."""
    def lookup(chapter: str) -> Canonical:
        found = canonicals.get(chapter)
        if found is None:
            known = ", ".join(sorted(canonicals)) or "none"
            raise UnknownChapter(f"{chapter} is not a chapter of this course (its chapters: "
                                 f"{known}; no solutions notebook for it in {solutions_dir})")
        if isinstance(found, str):
            raise GraderError(found)
        return found
    return lookup
