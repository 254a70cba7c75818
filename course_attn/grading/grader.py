"""Grading: run a student's notebook in a fresh kernel and score each exercise.

For each notebook (``python -m course_attn.grade PATH...``):

1. Copy it into a temporary folder; the student's file is only ever read.
2. Find its chapter (notebook metadata ``course_attn.chapter``, else the file name's ``NN_``
   prefix) and the canonical notebook of that chapter in ``solutions/``. Its grade cells are the
   exercises: ``grade_id`` and ``points``.
3. Put the canonical source back into every grade cell and every locked cell (never into a
   solution cell), matched by ``grade_id``, as nbgrader's ``OverwriteCells`` does; a modified
   one is flagged, a deleted locked cell (the setup) is put back, a deleted check cell scores 0.
   Each check cell also re-imports ``check`` first, so a student's own ``check`` cannot stand
   in for it.
4. Run every code cell in a fresh ``python3`` kernel (the grader's own interpreter), errors
   allowed, each cell within ``cell_timeout`` seconds and the whole notebook within
   ``notebook_timeout``. A cell over its limit is interrupted and the run goes on; if the kernel
   does not answer within a few seconds after that, or dies, the remaining cells are not run.
5. An exercise scores its points iff its grade cell ran without error; otherwise 0, with the
   reason read from the error ("not implemented", "2 of 5 checks failed (...)", "SyntaxError in
   your code (...)", "timed out after 60 s", "kernel died ...", "check cell missing").

Nothing a submission does (bad JSON, a syntax error, an endless loop, ``sys.exit()``, killing the
kernel) makes the grader raise: each becomes a score with a reason. Exit status: 0 when every
notebook was graded (whatever the scores), 1 when the grader itself could not grade one (no
kernel, no solutions notebook for its chapter), 2 for a usage error.
"""

import argparse
import asyncio
import copy
import json
import logging
import queue
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import run_sync
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError

from .generate import (
    generate_notebook, grade_id, is_grade_cell, is_locked_cell, is_solution_cell, nbgrader_metadata,
)
from .registry import _describe as describe_check_error

KERNEL_NAME = "python3"
CELL_TIMEOUT_S = 60.0
NOTEBOOK_TIMEOUT_S = 300.0
KERNEL_STARTUP_TIMEOUT_S = 60.0
INTERRUPT_GRACE_S = 5.0
MAX_OUTPUT_CHARS_PER_CELL = 1_000_000
CHECK_IMPORT = "from course_attn.grading import check\n"
NOT_IMPLEMENTED_MESSAGE = describe_check_error(NotImplementedError())
_TIMEOUT_ENAME = "course_attn.grade:cell-timeout"
_QUIET_LOG = logging.getLogger("course_attn.grade.kernel")
_QUIET_LOG.addHandler(logging.NullHandler())
_QUIET_LOG.propagate = False


@dataclass
class ExerciseScore:
    grade_id: str
    points: float
    max_points: float
    passed: bool
    reason: str


@dataclass
class NotebookGrade:
    """The grade of one submitted file. ``error`` says why it could not be run at all."""

    path: str
    chapter: str | None = None
    exercises: list[ExerciseScore] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    error: str | None = None
    grader_error: bool = False
    seconds: float = 0.0

    @property
    def total(self) -> float:
        return sum(e.points for e in self.exercises)

    @property
    def max_points(self) -> float:
        return sum(e.max_points for e in self.exercises)

    def to_dict(self) -> dict:
        return {"path": self.path, "chapter": self.chapter, "total": self.total,
                "max": self.max_points, "exercises": [asdict(e) for e in self.exercises],
                "flags": list(self.flags), "error": self.error,
                "grader_error": self.grader_error, "seconds": round(self.seconds, 2)}


@dataclass
class Exercise:
    grade_id: str
    points: float
    source: str


@dataclass
class Canonical:
    """A chapter's solutions notebook: its exercises and the cells a student may not change."""

    path: Path
    exercises: list[Exercise]
    protected: dict[str, nbformat.NotebookNode]  # grade_id -> grade or locked cell
    given: dict[str, nbformat.NotebookNode]  # the same cells as the exercise notebook shows them


@dataclass
class CellRun:
    """What happened to one cell. ``status``: ok, error, timeout, died, not run, skipped."""

    status: str
    ename: str = ""
    evalue: str = ""
    stdout: str = ""
    limit_s: float = 0.0
    notebook_limit: bool = False
    stopped_by: str = ""  # for "not run": died, stuck, time limit, lost
    stopped_at: int = -1  # the index of the cell that stopped the run


class GraderError(Exception):
    """The grader itself could not grade a notebook (no solutions, no kernel); not the student."""


def chapter_from_name(path: Path | str) -> str | None:
    """``"03_masking.ipynb"`` -> ``"ch03"``; None without an ``NN_`` prefix."""
    match = re.match(r"(\d+)_", Path(path).name)
    return f"ch{int(match.group(1)):02d}" if match else None


def chapter_of(nb, path: Path | str) -> str | None:
    meta = nb.metadata.get("course_attn") if nb is not None else None
    chapter = meta.get("chapter") if isinstance(meta, dict) else None
    return chapter if isinstance(chapter, str) and chapter else chapter_from_name(path)


def read_notebook(path: Path) -> tuple[nbformat.NotebookNode | None, str | None]:
    """(notebook, None), or (None, why it is not a notebook)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None, "not a notebook: the file is not UTF-8 text"
    except OSError as error:
        return None, f"could not read the file: {error.strerror or error}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        prefix = "" if path.suffix == ".ipynb" else "not a notebook: "
        return None, (f"{prefix}invalid JSON (line {error.lineno}, column {error.colno}): "
                      f"{error.msg}")
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        return None, "not a notebook: JSON without a list of cells"
    try:
        nb = nbformat.reads(text, as_version=4)
    except Exception as error:  # nbformat raises schema, key and type errors alike
        return None, f"not a valid notebook: {_shorten(str(error).splitlines()[0])}"
    # Jupyter opens notebooks that bend the schema a little; so does the grader, where it can.
    for index, cell in enumerate(nb.cells):
        if (not isinstance(cell, dict) or cell.get("cell_type") not in ("code", "markdown", "raw")
                or not isinstance(cell.get("source"), str)):
            return None, f"not a valid notebook: cell {index + 1} has no cell_type or source"
        cell.setdefault("metadata", nbformat.NotebookNode())
        if cell.cell_type == "code":
            cell.setdefault("outputs", [])
            cell.setdefault("execution_count", None)
    return nb, None


def find_solution_notebook(chapter: str, solutions_dir: Path) -> Path:
    """The notebook in ``solutions_dir`` whose metadata names ``chapter``, else its NN_ file."""
    candidates = sorted(solutions_dir.glob("*.ipynb"))
    for path in candidates:
        nb, _ = read_notebook(path)
        if nb is not None and (nb.metadata.get("course_attn") or {}).get("chapter") == chapter:
            return path
    for path in candidates:
        if chapter_from_name(path) == chapter:
            return path
    raise GraderError(f"no solutions notebook for chapter {chapter} in {solutions_dir}")


def load_canonical(path: Path) -> Canonical:
    nb, problem = read_notebook(path)
    if nb is None:
        raise GraderError(f"solutions notebook {path}: {problem}")
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
            exercises.append(Exercise(grade_id(cell), nbgrader_metadata(cell)["points"],
                                      cell.source))
    given = {grade_id(cell): cell for cell in exercise_nb.cells if grade_id(cell) in protected}
    return Canonical(path, exercises, protected, given)


def _same_source(a: str, b: str) -> bool:
    def normalise(s):
        return [line.rstrip() for line in s.strip().splitlines()]
    return normalise(a) == normalise(b)


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

    A check cell whose nbgrader metadata was removed is found by its source instead; a deleted
    locked cell (the setup) is put back before the next protected cell; a deleted check cell is
    not (that exercise scores 0). Flags name cells by their number in the student's file.
    """
    flags, placed = [], {}
    for index, cell in enumerate(nb.cells):
        gid = grade_id(cell)
        if gid not in canonical.protected:
            continue
        original, given = canonical.protected[gid], canonical.given[gid]
        kind = "check" if is_grade_cell(original) else "locked"
        if gid in placed:
            flags.append(f"cell {index + 1} repeats the grade_id {gid} of cell {placed[gid] + 1}; "
                         "it ran as the student wrote it")
            continue
        if cell.cell_type != given.cell_type or not (_same_source(cell.source, given.source) or
                                                     _same_source(cell.source, original.source)):
            flags.append(f"{kind} cell {gid} (cell {index + 1}) was modified; the original was run")
        nb.cells[index] = _fresh_copy(original)
        placed[gid] = index
    for exercise in canonical.exercises:
        if exercise.grade_id in placed:
            continue
        for index, cell in enumerate(nb.cells):
            if (cell.cell_type == "code" and not nbgrader_metadata(cell)
                    and _same_source(cell.source, canonical.given[exercise.grade_id].source)):
                flags.append(f"check cell {exercise.grade_id} (cell {index + 1}) lost its nbgrader "
                             "metadata; it was recognised by its source")
                nb.cells[index] = _fresh_copy(canonical.protected[exercise.grade_id])
                placed[exercise.grade_id] = index
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
    for exercise in canonical.exercises:
        if exercise.grade_id in placed:
            nb.cells[placed[exercise.grade_id]].source = CHECK_IMPORT + exercise.source
    exercise_ids = {e.grade_id for e in canonical.exercises}
    return Restored({g: i for g, i in placed.items() if g in exercise_ids}, flags, numbers)


class _GradingClient(NotebookClient):
    """nbclient that keeps at most ``MAX_OUTPUT_CHARS_PER_CELL`` of a cell's text output."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.output_chars: dict[int, int] = {}

    def output(self, outs, msg, display_id, cell_index):
        content = msg.get("content", {})
        size = len(str(content.get("text", ""))) + len(str(content.get("data", "")))
        used = self.output_chars.get(cell_index, 0) + size
        self.output_chars[cell_index] = used
        if used > MAX_OUTPUT_CHARS_PER_CELL:
            return None
        return super().output(outs, msg, display_id, cell_index)


async def _kernel_answers(kc, within_s: float) -> bool:
    """Whether the kernel replies to ``kernel_info`` within ``within_s`` (it is not stuck)."""
    msg_id = kc.kernel_info()
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            msg = await kc.shell_channel.get_msg(timeout=left)
        except queue.Empty:
            return False
        if msg["parent_header"].get("msg_id") == msg_id:
            return True
    return False


async def _shutdown(km: AsyncKernelManager) -> None:
    try:
        if not km.has_kernel:
            return
        if await km.is_alive():
            await km.shutdown_kernel(now=True)
        else:
            await km.cleanup_resources()
    except Exception:  # the kernel is gone or going; nothing left to free that we can reach
        pass


async def execute_notebook(nb, workdir: Path, *, cell_timeout: float = CELL_TIMEOUT_S,
                           notebook_timeout: float = NOTEBOOK_TIMEOUT_S) -> list[CellRun]:
    """Run ``nb``'s code cells (in place) in a fresh kernel started in ``workdir``.

    Returns one CellRun per cell; raises GraderError only when no kernel could be started.
    """
    runs = [CellRun("skipped") for _ in nb.cells]
    km = AsyncKernelManager(kernel_name=KERNEL_NAME)
    log_path = workdir.parent / "kernel.log"
    with open(log_path, "wb") as kernel_log:
        try:
            try:
                await km.start_kernel(cwd=str(workdir), stdout=kernel_log, stderr=kernel_log,
                                      extra_arguments=["--HistoryManager.hist_file=:memory:"])
                kc = km.client()
                kc.start_channels()
                kc.allow_stdin = False  # input() raises instead of waiting for a reader forever
            except Exception as error:
                raise GraderError(f"could not start a {KERNEL_NAME} kernel: {error}") from None
            try:
                try:
                    await kc.wait_for_ready(timeout=KERNEL_STARTUP_TIMEOUT_S)
                except Exception as error:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise GraderError(f"the {KERNEL_NAME} kernel did not start: {error}\n{tail}") \
                        from None
                await _run_cells(nb, km, kc, runs, cell_timeout, notebook_timeout)
            finally:
                kc.stop_channels()
        finally:
            await _shutdown(km)
    return runs


async def _run_cells(nb, km, kc, runs: list[CellRun], cell_timeout: float,
                     notebook_timeout: float) -> None:
    limit = {"s": cell_timeout}
    client = _GradingClient(
        nb, km=km, kernel_name=KERNEL_NAME, timeout_func=lambda cell: limit["s"],
        interrupt_on_timeout=True, allow_errors=True, record_timing=False, log=_QUIET_LOG,
        error_on_timeout={"ename": _TIMEOUT_ENAME, "evalue": "", "traceback": []})
    client.kc = kc
    replies: dict[int, dict] = {}
    client.on_cell_executed = lambda cell, cell_index, execute_reply: replies.update(
        {cell_index: execute_reply})
    deadline = time.monotonic() + notebook_timeout
    stop: CellRun | None = None  # the "not run" record of every cell after the run stopped
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        remaining = deadline - time.monotonic()
        if stop is None and remaining <= 0:
            stop = CellRun("not run", limit_s=notebook_timeout, stopped_by="time limit",
                           stopped_at=index)
        if stop is not None:
            runs[index] = stop
            continue
        limit["s"] = min(cell_timeout, remaining)
        try:
            await client.async_execute_cell(cell, index, execution_count=index + 1)
        except DeadKernelError:
            runs[index] = CellRun("died")
            stop = CellRun("not run", stopped_by="died", stopped_at=index)
            continue
        except Exception as error:  # the connection to the kernel broke; it is not usable now
            runs[index] = CellRun("error", "GraderError", str(error))
            stop = CellRun("not run", evalue=str(error), stopped_by="lost", stopped_at=index)
            continue
        stdout = "".join(out.get("text", "") for out in cell.outputs
                         if out.get("output_type") == "stream" and out.get("name") == "stdout")
        reply = replies.get(index, {}).get("content", {})
        if reply.get("ename") == _TIMEOUT_ENAME:
            runs[index] = CellRun("timeout", stdout=stdout, limit_s=limit["s"],
                                  notebook_limit=limit["s"] < cell_timeout)
            if not await _kernel_answers(kc, INTERRUPT_GRACE_S):
                stop = CellRun("not run", stopped_by="stuck", stopped_at=index)
        elif reply.get("status") == "error":
            runs[index] = CellRun("error", str(reply.get("ename", "")),
                                  str(reply.get("evalue", "")), stdout)
        else:
            runs[index] = CellRun("ok", stdout=stdout)


_SYNTAX_ERRORS = {"SyntaxError", "IndentationError", "TabError"}


def _shorten(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _failed_checks(stdout: str) -> list[tuple[str, str]]:
    """(case name, message) of each failed case in ``check``'s printed report."""
    failed, lines = [], stdout.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("  ✗ "):
            message = lines[i + 1].strip() if i + 1 < len(lines) else ""
            failed.append((line[4:].strip(), "" if message.startswith("hint:") else message))
    return failed


def _explain_check_failure(evalue: str, stdout: str) -> str:
    failed = _failed_checks(stdout)
    if failed and all(message == NOT_IMPLEMENTED_MESSAGE for _, message in failed):
        return "not implemented"
    counted = re.search(r"(\d+) of (\d+) checks failed", evalue)
    summary = counted.group(0) if counted else _shorten(evalue)
    if failed:
        name, message = failed[0]
        summary += f" (first: {name}: {_shorten(message, 160)})"
    return summary


def _explain_error(run: CellRun, where: str, label, in_your_code: bool) -> str:
    """Why a cell failed, in a sentence for the student. ``where``: that cell's label;
    ``label(index)``: any cell's."""
    if run.status == "timeout":
        text = f"timed out after {run.limit_s:.3g} s"
        if run.notebook_limit:
            text += " (the rest of the notebook's time limit)"
        return f"{text} in your code ({where})" if in_your_code else text
    if run.status == "died":
        return f"kernel died while running {where}"
    if run.status == "not run":
        stopper = label(run.stopped_at)
        return {
            "died": f"kernel died while running {stopper}",
            "stuck": f"not run: the kernel stopped responding after {stopper} ran out of time",
            "time limit": f"not run: the notebook's time limit of {run.limit_s:g} s was reached",
            "lost": f"not run: the grader lost the kernel in {stopper} ({run.evalue})",
        }[run.stopped_by]
    ename, evalue = run.ename, run.evalue
    if ename in _SYNTAX_ERRORS:
        line = re.search(r"\(\S+, line (\d+)\)$", evalue)
        message = re.sub(r"\s*\(\S+, line \d+\)$", "", evalue)
        at = f"{where}, line {line.group(1)}" if line else where
        return f"{ename} in your code ({at}): {_shorten(message, 120)}"
    if ename == "SystemExit":
        return f"your code called sys.exit() ({where})"
    if ename == "KeyboardInterrupt":
        return f"interrupted by KeyboardInterrupt ({where})"
    if in_your_code:
        return f"{ename} in your code ({where}): {_shorten(evalue, 160)}"
    return f"{ename}: {_shorten(evalue, 160)}"


def _explain(run: CellRun, index: int, block: list[tuple[int, CellRun]], label) -> str:
    """Why the check cell ``index`` failed; ``block``: the student's cells since the last check."""
    if run.status == "error":
        if run.ename == "ExerciseFailed":
            return _explain_check_failure(run.evalue, run.stdout)
        if run.ename == "NotImplementedError":
            return "not implemented"
        if run.ename == "NameError":
            for i, earlier in block:
                if earlier.status in ("error", "timeout"):
                    return _explain_error(earlier, label(i), label, in_your_code=True)
            return f"{_shorten(run.evalue, 120)} (missing function?)"
    return _explain_error(run, label(index), label, in_your_code=False)


def score_exercises(canonical: Canonical, restored: Restored,
                    runs: list[CellRun]) -> list[ExerciseScore]:
    """One ExerciseScore per canonical exercise, from the runs of the restored notebook."""
    check_cells = sorted(restored.placed.values())
    scores = []
    for exercise in canonical.exercises:
        index = restored.placed.get(exercise.grade_id)
        if index is None:
            scores.append(ExerciseScore(exercise.grade_id, 0, exercise.points, False,
                                        "check cell missing"))
            continue
        run = runs[index]
        if run.status == "ok":
            scores.append(ExerciseScore(exercise.grade_id, exercise.points, exercise.points,
                                        True, "passed"))
            continue
        start = max([i for i in check_cells if i < index], default=-1) + 1
        block = [(i, runs[i]) for i in range(start, index)]
        scores.append(ExerciseScore(exercise.grade_id, 0, exercise.points, False,
                                    _explain(run, index, block, restored.label)))
    return scores


async def _grade_one(path: Path, solutions_dir: Path, canonicals: dict, cell_timeout: float,
                     notebook_timeout: float) -> NotebookGrade:
    started = time.monotonic()
    grade = NotebookGrade(str(path))
    with tempfile.TemporaryDirectory(prefix="course_attn_grade_",
                                     ignore_cleanup_errors=True) as tmp:
        workdir = Path(tmp) / "work"
        workdir.mkdir()
        submission = workdir / path.name
        try:
            shutil.copyfile(path, submission)
            nb, problem = read_notebook(submission)
        except OSError as error:
            nb, problem = None, f"could not read the file: {error.strerror or error}"
        grade.chapter = chapter_of(nb, path)
        canonical, missing = None, ""
        if grade.chapter is not None:
            try:
                if grade.chapter not in canonicals:
                    canonicals[grade.chapter] = load_canonical(
                        find_solution_notebook(grade.chapter, solutions_dir))
                canonical = canonicals[grade.chapter]
            except GraderError as error:
                missing = str(error)
        if nb is None or canonical is None:
            if nb is not None and grade.chapter is None:
                problem = ("cannot tell which chapter this is: no course_attn.chapter in its "
                           "metadata and no NN_ prefix in its file name")
            grade.error = problem or missing
            grade.grader_error = problem is None
        else:
            restored = restore_protected_cells(nb, canonical)
            grade.flags = restored.flags
            try:
                runs = await execute_notebook(nb, workdir, cell_timeout=cell_timeout,
                                              notebook_timeout=notebook_timeout)
                grade.exercises = score_exercises(canonical, restored, runs)
            except GraderError as error:
                grade.error, grade.grader_error = str(error), True
        if canonical is not None and not grade.exercises:
            grade.exercises = [ExerciseScore(e.grade_id, 0, e.points, False,
                                             f"not graded: {grade.error}")
                               for e in canonical.exercises]
    grade.seconds = time.monotonic() - started
    return grade


async def _grade_all(paths, solutions_dir, cell_timeout, notebook_timeout, jobs, progress):
    canonicals: dict = {}
    slots = asyncio.Semaphore(max(1, jobs))

    async def one(path):
        async with slots:
            grade = await _grade_one(Path(path), Path(solutions_dir), canonicals, cell_timeout,
                                     notebook_timeout)
        if progress:
            print(f"graded {grade.path}: {grade.total:g} / {grade.max_points:g} "
                  f"({grade.seconds:.1f} s)", file=sys.stderr, flush=True)
        return grade

    return list(await asyncio.gather(*(one(p) for p in paths)))


def grade_notebooks(paths, *, solutions_dir: Path | str, cell_timeout: float = CELL_TIMEOUT_S,
                    notebook_timeout: float = NOTEBOOK_TIMEOUT_S, jobs: int = 1,
                    progress: bool = False) -> list[NotebookGrade]:
    """Grade each file in ``paths`` (``jobs`` at a time); never raises for a bad submission."""
    return run_sync(_grade_all)(list(paths), solutions_dir, cell_timeout, notebook_timeout, jobs,
                                progress)


def grade_notebook(path: Path | str, **options) -> NotebookGrade:
    """Grade one file; ``options`` as for ``grade_notebooks``."""
    return grade_notebooks([path], **options)[0]


def report(grades: list[NotebookGrade]) -> dict:
    """The machine-readable report (what ``--json`` writes)."""
    return {"notebooks": [g.to_dict() for g in grades],
            "total": sum(g.total for g in grades),
            "max": sum(g.max_points for g in grades)}


def format_table(grades: list[NotebookGrade]) -> str:
    """The score table: one row per exercise, a total row per notebook, flags under it."""
    rows = [("notebook", "exercise", "points", "reason")]
    notes: dict[int, list[str]] = {}
    for grade in grades:
        for e in grade.exercises:
            rows.append((grade.path, e.grade_id, f"{e.points:g} / {e.max_points:g}", e.reason))
        rows.append((grade.path, "total", f"{grade.total:g} / {grade.max_points:g}",
                     grade.error or ""))
        notes[len(rows) - 1] = [f"flag: {flag}" for flag in grade.flags]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for number, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3])
        lines[-1] = lines[-1].rstrip()
        lines.extend(" " * 4 + note for note in notes.get(number, []))
    if len(grades) > 1:
        total, most = sum(g.total for g in grades), sum(g.max_points for g in grades)
        lines.append(f"all {len(grades)} notebooks: {total:g} / {most:g}")
    return "\n".join(lines)


def _default_solutions_dir() -> Path:
    here = Path("solutions")
    return here if here.is_dir() else Path(__file__).resolve().parents[2] / "solutions"


def _collect(paths: list[str]) -> list[Path]:
    found: list[Path] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            notebooks = sorted(path.glob("*.ipynb"))
            if not notebooks:
                raise ValueError(f"no .ipynb file in folder {name}")
            found.extend(notebooks)
        elif path.exists():
            found.append(path)
        else:
            raise ValueError(f"no such file or folder: {name}")
    seen: set[Path] = set()
    unique = []
    for path in found:
        if path.resolve() not in seen:
            seen.add(path.resolve())
            unique.append(path)
    return unique


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_attn.grade",
        description="Grade exercise notebooks: each runs in a fresh kernel, on a copy.")
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="a notebook, or a folder of notebooks (*.ipynb)")
    parser.add_argument("--json", type=Path, metavar="REPORT.json",
                        help="also write a machine-readable report here")
    parser.add_argument("--timeout", type=float, default=CELL_TIMEOUT_S, metavar="SECONDS",
                        help=f"time limit per cell (default {CELL_TIMEOUT_S:g})")
    parser.add_argument("--notebook-timeout", type=float, default=NOTEBOOK_TIMEOUT_S,
                        metavar="SECONDS",
                        help=f"time limit per notebook (default {NOTEBOOK_TIMEOUT_S:g})")
    parser.add_argument("--solutions", type=Path, metavar="DIR",
                        help="folder of solution notebooks (default: ./solutions, else the "
                             "repository's)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="grade N notebooks at a time (default 1)")
    args = parser.parse_args(argv)
    solutions_dir = args.solutions or _default_solutions_dir()
    try:
        if args.timeout <= 0 or args.notebook_timeout <= 0:
            raise ValueError("--timeout and --notebook-timeout must be positive")
        if args.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
        if not solutions_dir.is_dir():
            raise ValueError(f"solutions folder {solutions_dir} does not exist")
        if args.json is not None and not args.json.resolve().parent.is_dir():
            raise ValueError(f"folder of --json {args.json} does not exist")
        paths = _collect(args.paths)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    grades = grade_notebooks(paths, solutions_dir=solutions_dir, cell_timeout=args.timeout,
                             notebook_timeout=args.notebook_timeout, jobs=args.jobs,
                             progress=True)
    print(format_table(grades))
    if args.json is not None:
        args.json.write_text(json.dumps(report(grades), indent=2, ensure_ascii=False) + "\n")
    return 1 if any(g.grader_error for g in grades) else 0
