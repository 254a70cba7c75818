"""Exercise notebooks, generated from solution notebooks.

``python -m course_attn.grading.generate [--solutions DIR] [--exercises DIR] [--check]`` writes,
for every ``solutions/NN_topic.ipynb``, ``exercises/NN_topic.ipynb`` in which

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
"""

import argparse
import copy
import sys
from pathlib import Path
from typing import Callable

import nbformat

BEGIN_SOLUTION = "### BEGIN SOLUTION"
END_SOLUTION = "### END SOLUTION"
BEGIN_HIDDEN_TESTS = "### BEGIN HIDDEN TESTS"
END_HIDDEN_TESTS = "### END HIDDEN TESTS"
CODE_STUB = ("# YOUR CODE HERE", "raise NotImplementedError()")
TEXT_STUB = ("YOUR ANSWER HERE",)
RAISES_EXCEPTION_TAG = "raises-exception"


def nbgrader_metadata(cell) -> dict:
    """The cell's ``nbgrader`` metadata (an empty dict for an ordinary cell)."""
    metadata = cell.get("metadata")
    meta = metadata.get("nbgrader") if isinstance(metadata, dict) else None
    return meta if isinstance(meta, dict) else {}


def is_solution_cell(cell) -> bool:
    return bool(nbgrader_metadata(cell).get("solution", False))


def is_grade_cell(cell) -> bool:
    return bool(nbgrader_metadata(cell).get("grade", False))


def is_locked_cell(cell) -> bool:
    return bool(nbgrader_metadata(cell).get("locked", False))


def grade_id(cell) -> str | None:
    gid = nbgrader_metadata(cell).get("grade_id")
    return gid if isinstance(gid, str) else None


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


def generate_all(solutions_dir: Path | str, exercises_dir: Path | str) -> list[Path]:
    """Write ``exercises_dir/<name>`` for every ``solutions_dir/*.ipynb``; returns their paths.

    A file whose bytes are already right is not rewritten (its mtime stays). A stale
    ``exercises_dir/*.ipynb`` with no solution notebook left is removed: exercises are generated,
    never edited by hand. Every solution notebook is checked before anything is written.
    """
    written, _ = _generate(Path(solutions_dir), Path(exercises_dir))
    return written


def _generate(solutions_dir: Path, exercises_dir: Path) -> tuple[list[Path], list[Path]]:
    """(exercise paths, stale exercise paths removed)."""
    expected = expected_exercises(solutions_dir, exercises_dir)
    exercises_dir.mkdir(parents=True, exist_ok=True)
    for path, text in expected.items():
        data = text.encode("utf-8")
        if not path.is_file() or path.read_bytes() != data:
            path.write_bytes(data)
    stale = _stale_exercises(expected, exercises_dir)
    for path in stale:
        path.unlink()
    return list(expected), stale


def _stale_exercises(expected: dict[Path, str], exercises_dir: Path) -> list[Path]:
    if not exercises_dir.is_dir():
        return []
    return [path for path in sorted(exercises_dir.glob("*.ipynb")) if path not in expected]


def check_exercises(solutions_dir: Path | str, exercises_dir: Path | str) -> list[str]:
    """One line per exercise file that is missing, differs from a fresh generation, or is stale."""
    exercises_dir = Path(exercises_dir)
    expected = expected_exercises(solutions_dir, exercises_dir)
    problems = []
    for path, text in expected.items():
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.read_bytes() != text.encode("utf-8"):
            problems.append(f"{path}: differs from a fresh generation")
    for path in _stale_exercises(expected, exercises_dir):
        problems.append(f"{path}: stale (no solution notebook of that name)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_attn.grading.generate",
        description="Generate exercises/ from solutions/ (solution regions become stubs).")
    parser.add_argument("--solutions", type=Path, default=Path("solutions"),
                        help="folder of solution notebooks (default: ./solutions)")
    parser.add_argument("--exercises", type=Path, default=Path("exercises"),
                        help="folder to write exercise notebooks to (default: ./exercises)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if exercises differ from a fresh generation")
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = check_exercises(args.solutions, args.exercises)
            for line in problems:
                print(line)
            if problems:
                print(f"{len(problems)} exercise notebook(s) out of date; run "
                      "`python -m course_attn.grading.generate`", file=sys.stderr)
                return 1
            print(f"exercises in {args.exercises} are up to date")
            return 0
        written, stale = _generate(args.solutions, args.exercises)
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
