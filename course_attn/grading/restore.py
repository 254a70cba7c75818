"""Restoring a submission's protected cells: the canonical setup (locked) and check (grade)
cells go back in, matched by ``grade_id``, as nbgrader's ``OverwriteCells`` does; what a student
changed, deleted or repeated is flagged (a repeated protected cell is not run). Solution cells
are never touched."""

import ast
import copy
from dataclasses import dataclass

import nbformat

from .canonical import Canonical
from .cells import grade_id, is_grade_cell, nbgrader_metadata


def _same_source(a: str, b: str) -> bool:
    """The same lines, or the same code formatted otherwise: a student's copy of an exercise
    notebook made before the course re-formatted a cell holds the cell as it was written then."""
    def normalise(s):
        return [line.rstrip() for line in s.strip().splitlines()]
    if normalise(a) == normalise(b):
        return True
    code = _code(a)
    return code is not None and code == _code(b)


def _code(source: str) -> str | None:
    """``source``'s syntax tree, docstrings compared word by word; None where it does not parse
    (an IPython magic, a cell left half written)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            body[0].value.value = " ".join(body[0].value.value.split())
    return ast.dump(tree)


def _grading_fields(cell) -> dict:
    """The nbgrader fields that nbgrader's checksum covers besides the source: whether the cell
    is graded, a solution or locked, and its points (for a grade cell)."""
    meta = nbgrader_metadata(cell)
    fields = {key: bool(meta.get(key, False)) for key in ("grade", "solution", "locked")}
    if fields["grade"]:
        fields["points"] = meta.get("points")
    return fields


def _fresh_copy(cell):
    cell = copy.deepcopy(cell)
    if cell.cell_type == "code":
        cell.outputs, cell.execution_count = [], None
    return cell


@dataclass
class Restored:
    """What ``restore_protected_cells`` did to a notebook."""

    placed: dict[str, int]  # exercise grade_id -> index of its check cell
    flags: list[str]
    numbers: list[int | None]  # index -> number (from 1) in the student's file; None: put back

    def label(self, index: int) -> str:
        number = self.numbers[index]
        return f"cell {number}" if number is not None else "a locked cell the grader put back"


def restore_protected_cells(nb, canonical: Canonical) -> Restored:
    """Put the canonical grade and locked cells back into ``nb`` (in place), by grade_id.

    A check or locked cell whose nbgrader metadata was removed is found by its source instead,
    without a flag (and so is not read as the student's code); a deleted
    locked cell (the setup) is put back before the next protected cell; a deleted check cell is
    not (that exercise scores 0). Flags name cells by their number in the student's file.
    """
    flags = _order_and_duplicate_flags(nb, canonical)
    placed: dict[str, int] = {}
    for index, cell in enumerate(nb.cells):
        gid = grade_id(cell)
        if gid not in canonical.protected:
            continue
        original, given = canonical.protected[gid], canonical.given[gid]
        kind = "check" if is_grade_cell(original) else "locked"
        if gid in placed:  # its code, whatever it is, is not run (the review reads it)
            flags.append(f"cell {index + 1} repeats the grade_id {gid} of cell {placed[gid] + 1}; "
                         "it was not run")
            nb.cells[index] = nbformat.v4.new_markdown_cell("")
            continue
        if cell.cell_type != given.cell_type or not (_same_source(cell.source, given.source) or
                                                     _same_source(cell.source, original.source)):
            flags.append(f"{kind} cell {gid} (cell {index + 1}) was modified; the original was run")
        elif _grading_fields(cell) != _grading_fields(given):
            flags.append(f"{kind} cell {gid} (cell {index + 1}) had its nbgrader metadata changed "
                         f"({_grading_fields(cell)}); the original was run")
        nb.cells[index] = _fresh_copy(original)
        placed[gid] = index
    for gid, original in canonical.protected.items():  # the course's cells, by what they hold
        if gid in placed:
            continue
        for index, cell in enumerate(nb.cells):
            if (cell.cell_type == "code" and grade_id(cell) not in canonical.protected
                    and index not in placed.values()
                    and (_same_source(cell.source, canonical.given[gid].source)
                         or _same_source(cell.source, original.source))):
                # no flag: an editor that drops cell metadata (a "Copy of" in Colab) is not
                # the student's doing, and the cell runs as the course wrote it
                nb.cells[index] = _fresh_copy(original)
                placed[gid] = index
                break
    numbers: list[int | None] = list(range(1, len(nb.cells) + 1))
    order = list(canonical.protected)
    for position_in_canonical, gid in enumerate(order):
        if gid in placed or is_grade_cell(canonical.protected[gid]):
            continue
        later = [placed[g] for g in order[position_in_canonical + 1:] if g in placed]
        at = min(later, default=len(nb.cells))
        nb.cells.insert(at, _fresh_copy(canonical.protected[gid]))
        numbers.insert(at, None)
        placed = {g: i + (i >= at) for g, i in placed.items()}
        placed[gid] = at
        flags.append(f"locked cell {gid} was missing; the grader put it back")
    exercise_ids = {e.grade_id for e in canonical.exercises}
    return Restored({g: i for g, i in placed.items() if g in exercise_ids}, flags, numbers)


def students_code(nb, canonical: Canonical) -> list[tuple[int, str]]:
    """(index, source) of every code cell of ``nb`` as submitted that is not the course's own
    cell as the course wrote it: the student's cells, and a protected cell that was changed or
    repeated, which the review reads even where it is not run."""
    course = [c.source for gid in canonical.protected
              for c in (canonical.protected[gid], canonical.given[gid])]
    return [(index, cell.source) for index, cell in enumerate(nb.cells)
            if cell.cell_type == "code" and not any(_same_source(cell.source, s) for s in course)]


def _order_and_duplicate_flags(nb, canonical: Canonical) -> list[str]:
    """Flags for solution cells that repeat a grade_id. (Cells moved out of their order are
    what people do in notebooks: each check runs where it stands, and no flag is raised.)"""
    flags, first_seen = [], {}
    rank = {gid: position for position, gid in enumerate(canonical.order)}
    for index, cell in enumerate(nb.cells):
        gid = grade_id(cell)
        if gid not in rank:
            continue
        if gid in first_seen:
            if gid not in canonical.protected:  # protected repeats are flagged when restored
                flags.append(f"cell {index + 1} repeats the grade_id {gid} of cell "
                             f"{first_seen[gid] + 1}; both ran, in order")
            continue
        first_seen[gid] = index
    return flags
