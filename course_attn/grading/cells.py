"""What an nbgrader cell is, read from its metadata: the questions that the exercise generator
and the grader both ask of a notebook's cells (``cell``: a notebook cell, a dict-like
``nbformat`` node)."""


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
