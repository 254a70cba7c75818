"""The grade of a notebook, and how it is shown: a score table, a JSON report, written
atomically (a reader never sees half a file)."""

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .exercise import key_of


@dataclass
class ExerciseScore:
    grade_id: str
    points: float
    max_points: float
    passed: bool
    reason: str

    @property
    def exercise(self) -> str:
        """The key the student reads in the check cells (``ch05.rope_angles``); ``grade_id``
        (``ch05-rope_angles``) stays nbgrader's, in the notebook and the gradebook."""
        return key_of(self.grade_id) or self.grade_id


@dataclass
class NotebookGrade:
    """The grade of one submitted file. ``error`` says why it could not be run at all."""

    path: str
    chapter: str | None = None
    exercises: list[ExerciseScore] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)  # for a reviewer: what may not be honest
    notes: list[str] = field(default_factory=list)  # for the student: what costs nothing
    error: str | None = None
    grader_error: bool = False
    seconds: float = 0.0
    sandbox: str = ""  # how its kernel was isolated: "bubblewrap, cgroup limits", or "none"
    credit: str = ""   # the rule for an answer in one piece: "by regime" or "all or nothing"

    @property
    def total(self) -> float:
        return round(sum(e.points for e in self.exercises), 2)

    @property
    def max_points(self) -> float:
        return sum(e.max_points for e in self.exercises)

    def to_dict(self) -> dict:
        return {"path": self.path, "chapter": self.chapter, "total": self.total,
                "max": self.max_points,
                "exercises": [{"exercise": e.exercise, **asdict(e)} for e in self.exercises],
                "flags": list(self.flags), "notes": list(self.notes), "error": self.error,
                "grader_error": self.grader_error, "seconds": round(self.seconds, 2),
                "sandbox": self.sandbox, "credit": self.credit}


def report(grades: list[NotebookGrade]) -> dict:
    """The machine-readable report (what ``--json`` writes)."""
    return {"notebooks": [g.to_dict() for g in grades],
            "total": round(sum(g.total for g in grades), 2),
            "max": sum(g.max_points for g in grades)}


def write_atomically(path: Path | str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_json(path: Path | str, data) -> None:
    write_atomically(path, json.dumps(data, indent=2) + "\n")


CREDIT_RULES = {
    "by regime": "an answer in one piece earns the share of the regimes of its hidden cases "
                 "that it passes; --all-or-nothing for all or nothing",
    "all or nothing": "an exercise earns its points only when every case passes",
}


def format_table(grades: list[NotebookGrade]) -> str:
    """The score table: one row per exercise, a total row per notebook, flags under it."""
    rows = [("notebook", "exercise", "points", "reason")]
    notes: dict[int, list[str]] = {}
    for grade in grades:
        for e in grade.exercises:
            rows.append((grade.path, e.exercise, f"{e.points:g} / {e.max_points:g}", e.reason))
        rows.append((grade.path, "total", f"{grade.total:g} / {grade.max_points:g}",
                     grade.error or ""))
        notes[len(rows) - 1] = [f"flag: {flag}" for flag in grade.flags] + \
            [f"note: {note}" for note in grade.notes]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for number, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3])
        lines[-1] = lines[-1].rstrip()
        lines.extend(" " * 4 + note for note in notes.get(number, []))
    if len(grades) > 1:
        total, most = sum(g.total for g in grades), sum(g.max_points for g in grades)
        lines.append(f"all {len(grades)} notebooks: {total:g} / {most:g}")
    for rule in sorted({g.credit for g in grades if g.credit}):
        lines.append(f"credit: {rule} ({CREDIT_RULES[rule]})")
    return "\n".join(lines)
