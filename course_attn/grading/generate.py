"""Exercise notebooks, generated from solution notebooks.

``python -m course_attn.grading.generate [--solutions DIR] [--exercises DIR] [--check] [--force]``
writes, for every ``solutions/NN_topic.ipynb``, ``exercises/NN_topic.ipynb`` in which

- each region from a line ``### BEGIN SOLUTION`` to a line ``### END SOLUTION`` in a cell whose
  nbgrader metadata says ``solution: true`` becomes ``# YOUR CODE HERE`` and
  ``raise NotImplementedError()`` at the indentation of the BEGIN line (``YOUR ANSWER HERE`` in a
  markdown cell); a solution cell without any region is replaced whole, as nbgrader's
  ``ClearSolutions`` does;
- each region from ``### BEGIN HIDDEN TESTS`` to ``### END HIDDEN TESTS`` (grade cells only) is
  removed, as nbgrader's ``ClearHiddenTests`` does;
- outputs and execution counts are cleared;
- every solution and grade code cell gets the tag ``raises-exception``: in the unsolved notebook
  they raise, and nbval and Jupyter Book accept that only from tagged cells.

Everything else (cell ids, other metadata, notebook metadata) is kept, and the output is the same
bytes on every run. ``--check`` writes nothing and exits 1 when ``exercises/`` differs from a
fresh generation. A malformed solution notebook is a ``ValueError`` (exit status 2).

An exercise notebook that a student has worked in (a cell run, an answer written: see
``student_edits``) is never overwritten or removed: nothing is written, the command names the
notebook and says how to keep the work in ``work/`` (exit status 1); ``--force`` overrides.
"""

import argparse
import copy
import subprocess
import sys
from pathlib import Path
from typing import Callable

import nbformat

from .cells import grade_id, is_grade_cell, is_solution_cell, nbgrader_metadata
from .cells import is_locked_cell  # noqa: F401 (canonical.py and tests import it from here)

BEGIN_SOLUTION = "### BEGIN SOLUTION"
END_SOLUTION = "### END SOLUTION"
BEGIN_HIDDEN_TESTS = "### BEGIN HIDDEN TESTS"
END_HIDDEN_TESTS = "### END HIDDEN TESTS"
CODE_STUB = ("# YOUR CODE HERE", "raise NotImplementedError()")
TEXT_STUB = ("YOUR ANSWER HERE",)
RAISES_EXCEPTION_TAG = "raises-exception"


def _describe_cell(where: str, index: int, cell) -> str:
    gid = grade_id(cell)
    return f"{where}, cell {index}" + (f" ({gid})" if gid else "")


def validate_notebook(nb, where: str = "notebook") -> None:
    """``ValueError`` unless every nbgrader cell has a unique ``grade_id`` and grade cells points.

    ``where`` names the notebook in the message. Cells are numbered from 0, as in the JSON.
    """
    seen: dict[str, int] = {}
    for index, cell in enumerate(nb.cells):
        meta = nbgrader_metadata(cell)
        if not (meta.get("grade") or meta.get("solution") or meta.get("locked")):
            continue
        gid = meta.get("grade_id")
        if not isinstance(gid, str) or not gid:
            raise ValueError(f"{where}, cell {index}: nbgrader cell without a grade_id "
                             f"(metadata {meta})")
        if gid in seen:
            raise ValueError(f"{where}: grade_id {gid!r} is used by cells {seen[gid]} and {index}; "
                             "each grade_id must be unique")
        seen[gid] = index
        if meta.get("grade") and cell.cell_type == "code":
            points = meta.get("points")
            if isinstance(points, bool) or not isinstance(points, (int, float)) or points < 0:
                raise ValueError(f"{where}, cell {index} ({gid}): a grade cell needs "
                                 f"'points' >= 0 in its nbgrader metadata, got {points!r}")


def _replace_regions(source: str, begin: str, end: str,
                     stub: Callable[[str], list[str]], where: str) -> tuple[str, int]:
    """Replace each ``begin`` ... ``end`` line region by ``stub(indent)``; returns (source, count).

    Marker lines match after stripping surrounding whitespace. ``ValueError`` for an unclosed,
    nested or unopened region.
    """
    out: list[str] = []
    opened_at: int | None = None
    count = 0
    indent = ""
    for number, line in enumerate(source.split("\n"), start=1):
        marker = line.strip()
        if marker == begin:
            if opened_at is not None:
                raise ValueError(f"{where}: line {number}: {begin!r} inside the region opened at "
                                 f"line {opened_at}; close that one with {end!r} first")
            opened_at = number
            indent = line[: len(line) - len(line.lstrip())]
        elif marker == end:
            if opened_at is None:
                raise ValueError(f"{where}: line {number}: {end!r} without a {begin!r} before it")
            out.extend(stub(indent))
            opened_at = None
            count += 1
        elif opened_at is None:
            out.append(line)
    if opened_at is not None:
        raise ValueError(f"{where}: line {opened_at}: {begin!r} has no matching {end!r}")
    return "\n".join(out), count


def _has_marker(source: str, *markers: str) -> bool:
    return any(line.strip() in markers for line in source.split("\n"))


def _code_stub(indent: str) -> list[str]:
    return [indent + line for line in CODE_STUB]


def _text_stub(indent: str) -> list[str]:
    return [indent + line for line in TEXT_STUB]


def generate_notebook(nb, where: str = "notebook"):
    """The exercise notebook for solution notebook ``nb`` (a new object; ``nb`` is untouched).

    ``where`` names the notebook in error messages.
    """
    validate_notebook(nb, where)
    exercise = copy.deepcopy(nb)
    for index, cell in enumerate(exercise.cells):
        here = _describe_cell(where, index, cell)
        if _has_marker(cell.source, BEGIN_HIDDEN_TESTS, END_HIDDEN_TESTS):
            if not is_grade_cell(cell):
                raise ValueError(f"{here}: hidden tests outside a grade cell (nbgrader metadata "
                                 "'grade': true)")
            cell.source, _ = _replace_regions(cell.source, BEGIN_HIDDEN_TESTS, END_HIDDEN_TESTS,
                                              lambda indent: [], here)
        if is_solution_cell(cell):
            stub = _code_stub if cell.cell_type == "code" else _text_stub
            cell.source, count = _replace_regions(cell.source, BEGIN_SOLUTION, END_SOLUTION,
                                                  stub, here)
            if count == 0:
                cell.source = "\n".join(stub(""))
        elif _has_marker(cell.source, BEGIN_SOLUTION, END_SOLUTION):
            raise ValueError(f"{here}: a solution region in a cell that is not a solution cell "
                             "(its nbgrader metadata needs 'solution': true)")
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
            if is_solution_cell(cell) or is_grade_cell(cell):
                tags = cell.metadata.setdefault("tags", [])
                if RAISES_EXCEPTION_TAG not in tags:
                    tags.append(RAISES_EXCEPTION_TAG)
    return exercise


def notebook_text(nb) -> str:
    """The bytes ``nbformat.write`` would write, as text (it ends with a newline)."""
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def _solution_paths(solutions_dir: Path) -> list[Path]:
    if not solutions_dir.is_dir():
        raise ValueError(f"solutions folder {str(solutions_dir)!r} does not exist")
    return sorted(solutions_dir.glob("*.ipynb"))


def expected_exercises(solutions_dir: Path | str, exercises_dir: Path | str) -> dict[Path, str]:
    """Exercise path -> text of its fresh generation, for every ``solutions_dir/*.ipynb``."""
    solutions_dir, exercises_dir = Path(solutions_dir), Path(exercises_dir)
    expected = {}
    for path in _solution_paths(solutions_dir):
        try:
            nb = nbformat.read(path, as_version=4)
        except Exception as error:  # nbformat raises JSON, schema and key errors alike
            raise ValueError(f"{path}: not a readable notebook: {error}") from error
        expected[exercises_dir / path.name] = notebook_text(generate_notebook(nb, str(path)))
    return expected


class StudentWorkError(Exception):
    """Generating would overwrite or remove exercise notebooks that hold a student's work.

    ``edited`` maps each such notebook to the reasons it looks edited (see ``student_edits``).
    """

    def __init__(self, edited: dict[Path, list[str]]):
        self.edited = edited
        super().__init__("; ".join(f"{path}: {'; '.join(why)}" for path, why in edited.items()))


def _holds_stub(cell) -> bool:
    """Whether a solution cell still holds the stub that generation put there."""
    stub = list(CODE_STUB if cell.cell_type == "code" else TEXT_STUB)
    lines = [line.strip() for line in cell.source.split("\n")]
    return any(lines[i:i + len(stub)] == stub for i in range(len(lines)))


def _cells(indices: list[int]) -> str:
    return ("cell " if len(indices) == 1 else "cells ") + ", ".join(map(str, indices))


def _committed(path: Path):
    """The notebook at ``path`` as git's HEAD holds it (what `make exercises` last wrote there
    and was committed), or None outside a git checkout or for an untracked file."""
    try:
        shown = subprocess.run(["git", "-C", str(path.parent), "show", f"HEAD:./{path.name}"],
                               capture_output=True, text=True, timeout=30)
        return nbformat.reads(shown.stdout, as_version=4) if shown.returncode == 0 else None
    except Exception:  # no git, or not a notebook there
        return None


def student_edits(path: Path, *, generated: bool = True, expected: str | None = None) -> list[str]:
    """Why the exercise notebook at ``path`` looks like it holds a student's work ([] if not).

    A generated exercise has no outputs and no execution counts: a code cell that was run is a
    student's. A cell is someone's writing when it differs from what generation writes there now
    (``expected``, the text of a fresh generation) and from the committed file (git's HEAD, what
    generation wrote last), or when neither has a cell of its id: so an answer typed around a
    stub that is still there counts, and a notebook that is only out of date does not. Outside a
    git checkout only solution cells are compared (a maintainer's change to the text around
    them would look like a student's). Without ``expected`` or a solution cell to compare with,
    a solution cell that no longer holds its stub (``raise NotImplementedError()``,
    ``YOUR ANSWER HERE``) is a student's. With ``generated=False`` (a notebook that no solution
    notebook generates), one with no exercise cell at all is someone's own too. A file that is
    not a readable notebook holds nothing Jupyter could have saved: []. Cells are numbered from
    0, as in the JSON.
    """
    try:
        nb = nbformat.reads(path.read_text(encoding="utf-8"), as_version=4)
    except Exception:  # nbformat raises JSON, schema and key errors alike
        return []
    reasons = []
    ran = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
           and (cell.get("outputs") or cell.get("execution_count") is not None)]
    if ran:
        reasons.append(f"{_cells(ran)} ran (outputs or execution counts)")
    baselines = [] if expected is None else [nbformat.reads(expected, as_version=4)]
    committed = _committed(path)
    baselines += [committed] if committed is not None else []
    known = [{cell.get("id"): cell.source for cell in baseline.cells} for baseline in baselines]

    def written(cell) -> bool:
        if not known:
            return is_solution_cell(cell) and not _holds_stub(cell)
        if committed is None and not is_solution_cell(cell):
            return False
        return all(sources.get(cell.get("id")) != cell.source for sources in known)

    answered = [i for i, cell in enumerate(nb.cells) if i not in ran and written(cell)]
    solutions = [i for i in answered if is_solution_cell(nb.cells[i])]
    others = [i for i in answered if i not in solutions]
    if solutions:
        names = ", ".join(grade_id(nb.cells[i]) or str(i) for i in solutions)
        reasons.append(f"answers written in {_cells(solutions)} ({names})")
    if others:
        reasons.append(f"{_cells(others)} written or added")
    if not generated and not any(nbgrader_metadata(cell) for cell in nb.cells):
        reasons.append("no exercise cell: a notebook of someone's own")
    return reasons


def generate_all(solutions_dir: Path | str, exercises_dir: Path | str, *,
                 force: bool = False) -> list[Path]:
    """Write ``exercises_dir/<name>`` for every ``solutions_dir/*.ipynb``; returns their paths.

    A file whose bytes are already right is not rewritten (its mtime stays). A stale
    ``exercises_dir/*.ipynb`` with no solution notebook left is removed: exercises are generated,
    never edited by hand. Every solution notebook is checked before anything is written.

    A notebook to be overwritten or removed that holds a student's work (``student_edits``) is a
    ``StudentWorkError``, and nothing is written, unless ``force``.
    """
    written, _ = _generate(Path(solutions_dir), Path(exercises_dir), force=force)
    return written


def _generate(solutions_dir: Path, exercises_dir: Path,
              force: bool = False) -> tuple[list[Path], list[Path]]:
    """(exercise paths, stale exercise paths removed); see ``generate_all``."""
    expected = expected_exercises(solutions_dir, exercises_dir)
    changed = {path: text.encode("utf-8") for path, text in expected.items()
               if not path.is_file() or path.read_bytes() != text.encode("utf-8")}
    stale = _stale_exercises(expected, exercises_dir)
    if not force:
        edited = {path: why for path in [*changed, *stale] if path.is_file()
                  and (why := student_edits(path, generated=path in expected,
                                            expected=expected.get(path)))}
        if edited:
            raise StudentWorkError(edited)
    exercises_dir.mkdir(parents=True, exist_ok=True)
    for path, data in changed.items():
        path.write_bytes(data)
    for path in stale:
        path.unlink()
    return list(expected), stale


def _stale_exercises(expected: dict[Path, str], exercises_dir: Path) -> list[Path]:
    """Notebooks in ``exercises_dir`` that no solution notebook generates."""
    if not exercises_dir.is_dir():
        return []
    return [path for path in sorted(exercises_dir.glob("*.ipynb")) if path not in expected]


def _student_work(path: Path, why: list[str]) -> str:
    """The part of a ``check_exercises`` line that says a file holds a student's work."""
    return (f"holds a student's work ({'; '.join(why)}); keep it in work/ with "
            f"`{_keep_command(path)}`")


def check_exercises(solutions_dir: Path | str, exercises_dir: Path | str) -> list[str]:
    """One line per exercise file that is missing, differs from a fresh generation, or is stale.

    A file that holds a student's work says so, and how to keep it, instead of differing.
    """
    exercises_dir = Path(exercises_dir)
    expected = expected_exercises(solutions_dir, exercises_dir)
    problems = []
    for path, text in expected.items():
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.read_bytes() != text.encode("utf-8"):
            why = student_edits(path, expected=text)
            problems.append(f"{path}: " + (_student_work(path, why) if why
                                           else "differs from a fresh generation"))
    for path in _stale_exercises(expected, exercises_dir):
        why = student_edits(path, generated=False)
        problems.append(f"{path}: stale (no solution notebook of that name)"
                        + (f" and {_student_work(path, why)}" if why else ""))
    return problems


OUT_OF_DATE = ("{count} exercise notebook(s) differ from a fresh generation of {solutions}/. "
               "`make exercises` regenerates them, and refuses to touch one that holds a "
               "student's work: copy such a notebook to work/ first (`make work NB=PATH`).")


def _keep_command(path: Path, work_dir: Path = Path("work")) -> str:
    """The command that copies ``path`` into ``work_dir``: `make work` while its name is free
    there, else a copy under the first free name (`make work` never overwrites)."""
    if not (work_dir / path.name).exists():
        return f"make work NB={path}"
    n = 2
    while (work_dir / f"{path.stem}-{n}{path.suffix}").exists():
        n += 1
    return f"cp {path} {work_dir / f'{path.stem}-{n}{path.suffix}'}"


def refusal_message(error: StudentWorkError) -> str:
    """What ``main`` prints when it refuses to overwrite a student's work: which files, why,
    and the commands that keep the work and then regenerate."""
    lines = ["error: not generated, as these exercise notebooks hold a student's work:"]
    lines += [f"  {path}: {'; '.join(why)}" for path, why in error.edited.items()]
    lines += ["Nothing was written. To keep that work, copy it to work/, which no command of the "
              "course overwrites:"]
    lines += [f"  {_keep_command(path)}" for path in error.edited]
    lines += ["Then regenerate, discarding the edits left in exercises/:",
              "  make exercises FORCE=1    (or: python -m course_attn.grading.generate --force)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command line; exit status 0, 1 (out of date, or a student's work in the way), 2."""
    parser = argparse.ArgumentParser(
        prog="python -m course_attn.grading.generate",
        description="Generate exercises/ from solutions/ (solution regions become stubs). "
                    "Refuses to overwrite an exercise notebook that holds a student's work.")
    parser.add_argument("--solutions", type=Path, default=Path("solutions"),
                        help="folder of solution notebooks (default: ./solutions)")
    parser.add_argument("--exercises", type=Path, default=Path("exercises"),
                        help="folder to write exercise notebooks to (default: ./exercises)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if exercises differ from a fresh generation")
    parser.add_argument("--force", action="store_true",
                        help="overwrite (or remove) exercise notebooks even where a student has "
                             "written answers or run cells in them (default: refuse)")
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = check_exercises(args.solutions, args.exercises)
            for line in problems:
                print(line)
            if problems:
                print(OUT_OF_DATE.format(count=len(problems), solutions=args.solutions),
                      file=sys.stderr)
                return 1
            print(f"exercises in {args.exercises} are up to date")
            return 0
        written, stale = _generate(args.solutions, args.exercises, force=args.force)
    except StudentWorkError as error:
        print(refusal_message(error), file=sys.stderr)
        return 1
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(f"generated {path}")
    for path in stale:
        print(f"removed {path} (no solution notebook of that name)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
