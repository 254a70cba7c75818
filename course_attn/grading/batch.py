"""Grading many notebooks at once, and the command ``python -m course_attn.grade``.

A class: ``python -m course_attn.grade SUBMISSIONS_DIR --gradebook OUT`` grades every
submission in worker processes (``--workers``, default one per CPU) and writes ``OUT.csv`` and
``OUT.json``. In SUBMISSIONS_DIR,

- a file is one student's submission, and its stem is the student's id (``alice.ipynb`` ->
  ``alice``);
- a folder is one student's (its name is the id) and may hold several chapters' notebooks,
  ``*.ipynb`` at any depth (other files are ignored);
- names that start with a dot are skipped, and so are the gradebook's own files.

Every submission and every solution notebook is read into memory before the first kernel
starts, so a submission cannot change what is graded after it; the package's files and the
solutions are fingerprinted before and after, and a change is reported (``integrity`` in the
JSON, a warning on stderr). When a student has several notebooks of one chapter, the best one
counts and a note says so.

``OUT.csv``: one row per student: ``student``, one column per exercise (``grade_id``, in chapter
then notebook order, for every chapter that anyone submitted), ``total``, ``max``, ``notes``
(missing chapters, files that are not notebooks, the grader's flags). A chapter a student did
not submit scores 0. ``OUT.json``: everything, per student and per notebook (see
``build_gradebook``).

Without ``--gradebook``: ``python -m course_attn.grade PATH...`` grades notebooks (or the
``*.ipynb`` of a folder) and prints a table; ``--json`` writes the report.
"""

import csv
import dataclasses
import hashlib
import io
import json
import multiprocessing
import multiprocessing.connection
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from jupyter_core.utils import run_sync
from tqdm import tqdm

from . import grader, processes, sandbox
from .canonical import Canonical
from .grader import GradingOptions
from .notebook import MAX_SUBMISSION_BYTES, Submission, chapter_of, parse_notebook, \
    read_submission  # noqa: F401 (API)
from .report import ExerciseScore, NotebookGrade, write_atomically

@dataclass
class ClassSubmissions:
    """What ``collect_class`` found: every student, their files, and notes about them."""

    students: list[str]
    submissions: list[Submission]
    notes: dict[str, list[str]] = field(default_factory=dict)


def collect_class(root: Path, skip: set[Path] = frozenset()) -> ClassSubmissions:
    """Every student's submissions in ``root`` (see the module's docstring); ``skip``: resolved
    paths that are not submissions (the gradebook's own files)."""
    found = ClassSubmissions([], [])
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(".") or entry.resolve() in skip:
            continue
        if entry.is_dir() and not entry.is_symlink():  # a link is read as a file: refused
            student = entry.name
            notebooks = sorted(p for p in entry.rglob("*.ipynb") if p.is_file() and not any(
                part.startswith(".") for part in p.relative_to(entry).parts))
            if not notebooks:
                found.notes.setdefault(student, []).append("no notebook (.ipynb) in the folder")
            found.submissions.extend(read_submission(p, student) for p in notebooks)
        else:  # beside it: the other students' files, not this student's helpers
            student = entry.stem
            found.submissions.append(read_submission(entry, student, helpers=False))
        if student not in found.students:
            found.students.append(student)
    found.students.sort()
    return found


WORKER_ATTEMPTS = 2  # a notebook whose worker died or stopped is graded this often, then scores 0
_WORKER: dict = {}
WATCHDOG_MARGIN_S = 120.0  # beyond the notebook's own time limit: kernel starts, restarts


def watchdog_limit(notebook_timeout: float) -> float:
    """How long a worker may take over one notebook before the watchdog stops it: the
    notebook's own limit, and a margin for starting and restarting kernels (half the limit, at
    least 30 s, at most WATCHDOG_MARGIN_S)."""
    return notebook_timeout + min(WATCHDOG_MARGIN_S, max(30.0, notebook_timeout / 2))


def _start_worker(canonicals: dict, options: GradingOptions, solutions_dir: str) -> None:
    """Set up a grading process: the exercises that the check modules and the hidden cases
    register, and the adoption of orphans, killed after each notebook."""
    grader.prepare(solutions_dir, options.check_modules, read_notebooks=False)
    processes.become_subreaper()
    _WORKER.update(lookup=grader.lookup_in(canonicals, solutions_dir), options=options,
                   children=processes.children())


def _grade_submission(submission: Submission) -> NotebookGrade:
    grade = run_sync(grader.grade_data)(submission.path.name, submission.data, _WORKER["lookup"],
                                        _WORKER["options"], read_problem=submission.problem,
                                        path=str(submission.path), helpers=submission.helpers)
    killed = processes.kill_new_children(_WORKER["children"])
    if killed and not _WORKER["options"].sandbox:
        # A sandbox's processes die with its PID namespace: what is left here is a sandbox
        # still on its way out (under load it takes a while), which no submission started.
        grade.flags.append(f"{killed} process(es) that the submission left running were killed")
    return grade


def _worker_main(connection, canonicals, options, solutions_dir) -> None:
    """A worker process: grade each submission the parent sends, one at a time, and send its
    grade back; ``None`` ends it."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    _start_worker(canonicals, options, solutions_dir)
    while True:
        item = connection.recv()
        if item is None:
            return
        number, submission = item
        try:
            grade = _grade_submission(submission)
        except Exception as error:  # a bug of the grader's: report it, go on
            grade = NotebookGrade(str(submission.path), error=f"the grader failed: {error}",
                                  grader_error=True)
        connection.send((number, grade))


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    connection: object
    number: int | None = None  # the submission it is grading
    deadline: float = 0.0
    attempt: int = 0


def grade_files(submissions: list[Submission], canonicals: dict[str, Canonical | str],
                options: GradingOptions, *, workers: int, solutions_dir: str = "solutions",
                progress: bool = True) -> list[NotebookGrade]:
    """Grade each submission in worker processes, ``workers`` at a time, with a progress bar on
    stderr; in the order given. A watchdog outside the workers gives each notebook its time
    limit and a margin: a worker that dies, or stops answering, is replaced; the notebook it
    held is graded once more on a fresh worker, and then scores 0 with the reason; every other
    notebook keeps its grade."""
    grades: list[NotebookGrade | None] = [None] * len(submissions)
    attempts = [0] * len(submissions)
    if workers > 1 and not options.cpus:  # a busy notebook slows its own worker, no other
        options = dataclasses.replace(options, cpus=max(1.0, (os.cpu_count() or 1) / workers))
    todo = list(range(len(submissions)))
    context = multiprocessing.get_context("spawn")  # no fork of a process holding zmq sockets
    limit = watchdog_limit(options.notebook_timeout)
    bar = tqdm(total=len(submissions), unit="notebook", desc="grading", file=sys.stderr,
               disable=not progress, mininterval=0.5)
    pool: list[_Worker] = []

    def spawn() -> _Worker:
        parent, child = context.Pipe()
        process = context.Process(target=_worker_main, daemon=True,
                                  args=(child, canonicals, options, solutions_dir))
        process.start()
        child.close()
        return _Worker(process, parent)

    def finish(worker: _Worker, grade: NotebookGrade) -> None:
        grades[worker.number] = grade
        bar.set_postfix_str(submissions[worker.number].student or
                            submissions[worker.number].path.name, refresh=False)
        bar.update(1)
        worker.number = None

    def lost(worker: _Worker, why: str) -> None:
        """The worker died or stopped answering: its notebook goes back, or scores 0."""
        number = worker.number
        attempts[number] += 1
        _end(worker)
        pool.remove(worker)
        if attempts[number] < WORKER_ATTEMPTS:
            todo.insert(0, number)
            return
        worker.number = number
        finish(worker, _not_graded(submissions[number], canonicals, why))

    try:
        while todo or any(w.number is not None for w in pool):
            while todo and len(pool) < min(workers, len(submissions)):
                pool.append(spawn())
            for worker in pool:
                if worker.number is None and todo:
                    worker.number = todo.pop(0)
                    worker.deadline = time.monotonic() + limit
                    worker.connection.send((worker.number, submissions[worker.number]))
            busy = [w for w in pool if w.number is not None]
            ready = multiprocessing.connection.wait(
                [w.connection for w in busy] + [w.process.sentinel for w in busy], timeout=1.0)
            for worker in busy:
                if worker.connection in ready:
                    try:
                        number, grade = worker.connection.recv()
                    except (EOFError, OSError):
                        lost(worker, _died(worker))
                        continue
                    if number == worker.number:
                        finish(worker, grade)
                elif worker.process.sentinel in ready:
                    lost(worker, _died(worker))
                elif time.monotonic() > worker.deadline:
                    lost(worker, f"its grading did not end within {limit:g} s (the notebook's "
                                 f"limit of {options.notebook_timeout:g} s and a margin), so "
                                 "it was stopped")
    finally:
        for worker in pool:
            _end(worker, politely=worker.number is None)
        bar.close()
    return grades


def _died(worker: _Worker) -> str:
    worker.process.join(5)
    code = worker.process.exitcode
    if code is not None and code < 0:
        import signal
        how = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ \
            else f"signal {-code}"
    else:
        how = f"exit status {code}"
    return f"the grader's worker process died while grading it ({how})"


def _not_graded(submission: Submission, canonicals: dict, why: str) -> NotebookGrade:
    """The grade of a notebook the grader could not finish: 0 for each of its chapter's
    exercises, with the reason."""
    read = parse_notebook(submission.data, submission.path.suffix) \
        if submission.data is not None else None
    chapter = chapter_of(read.nb if read else None, submission.path.name)
    canonical = canonicals.get(chapter)
    grade = NotebookGrade(str(submission.path), chapter=chapter, error=why)
    if isinstance(canonical, Canonical):
        grade.exercises = [ExerciseScore(e.grade_id, 0, e.points, False, f"not graded: {why}")
                           for e in canonical.exercises]
    return grade


def _end(worker: _Worker, politely: bool = False) -> None:
    """Stop a worker: ask it to end, or kill it (its sandboxes die with it) and the kernels'
    cgroups it leaves."""
    if politely:
        try:
            worker.connection.send(None)
            worker.process.join(5)
        except (OSError, ValueError):
            pass
    if worker.process.is_alive():
        worker.process.kill()
        worker.process.join(5)
    worker.connection.close()
    sandbox.remove_cgroups_of(worker.process.pid)  # a killed worker's kernels leave theirs


def fingerprint(paths: list[Path]) -> dict[str, str]:
    """Path -> SHA-256 of its bytes ("missing" when it cannot be read)."""
    prints = {}
    for path in paths:
        try:
            prints[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            prints[str(path)] = "missing"
    return prints


def trusted_files(solutions_dir: Path, check_modules: tuple[str, ...] = ()) -> list[Path]:
    """The files a grade depends on: the package's Python files, the solutions, and the files
    of ``check_modules`` (where they can be found without importing them)."""
    import importlib.util
    package = Path(__file__).resolve().parents[1]
    files = sorted(package.rglob("*.py")) + sorted(solutions_dir.glob("*.ipynb"))
    for name in check_modules:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and Path(spec.origin).is_file():
            files.append(Path(spec.origin))
    return files


def _best_per_chapter(grades: list[NotebookGrade]) -> tuple[dict[str, NotebookGrade], list[str]]:
    """Chapter -> the notebook that counts (the best total; the first of equals), and notes."""
    by_chapter: dict[str, list[NotebookGrade]] = {}
    for grade in grades:
        if grade.chapter is not None and grade.exercises:
            by_chapter.setdefault(grade.chapter, []).append(grade)
    counted, notes = {}, []
    for chapter, candidates in by_chapter.items():
        best = max(candidates, key=lambda g: g.total)  # max keeps the first of equals
        counted[chapter] = best
        if len(candidates) > 1:
            others = ", ".join(f"{Path(g.path).name} ({g.total:g})" for g in candidates
                               if g is not best)
            notes.append(f"{len(candidates)} notebooks for {chapter}: "
                         f"{Path(best.path).name} ({best.total:g}) counts, not {others}")
    return counted, notes


def build_gradebook(found: ClassSubmissions, grades: list[NotebookGrade],
                    canonicals: dict[str, Canonical | str], options: GradingOptions,
                    seconds: float, integrity: list[str]) -> dict:
    """The JSON gradebook: ``exercises`` (the columns), ``students`` (each with ``total``,
    ``max``, ``scores`` by grade_id, ``notes``, and every ``notebooks`` entry with its
    ``sha256``, ``counted``, exercises, points, reasons and flags), the options, and
    ``integrity`` (trusted files that changed on disk while grading)."""
    by_student: dict[str, list[tuple[Submission, NotebookGrade]]] = {s: [] for s in found.students}
    for submission, grade in zip(found.submissions, grades):
        by_student[submission.student].append((submission, grade))
    chapters = sorted({g.chapter for g in grades
                       if g.chapter is not None and isinstance(canonicals.get(g.chapter),
                                                               Canonical)})
    columns = [(chapter, e) for chapter in chapters for e in canonicals[chapter].exercises]
    most = sum(e.points for _, e in columns)
    students = []
    for student in found.students:
        entries = by_student[student]
        counted, notes = _best_per_chapter([g for _, g in entries])
        notes = list(found.notes.get(student, [])) + notes
        scores = {}
        for chapter, exercise in columns:
            grade = counted.get(chapter)
            score = next((e for e in grade.exercises if e.grade_id == exercise.grade_id), None) \
                if grade else None
            scores[exercise.grade_id] = score.points if score else 0
        notes += [f"no notebook for {chapter}" for chapter in chapters if chapter not in counted]
        notebooks = []
        for submission, grade in entries:
            name = submission.path.name
            if grade.error:
                notes.append(f"{name}: {grade.error}")
            notes += [f"{name}: {flag}" for flag in grade.flags]
            notes += [f"{name}: {note}" for note in grade.notes]
            notebooks.append({**grade.to_dict(), "sha256": submission.sha256,
                              "counted": counted.get(grade.chapter) is grade})
        students.append({"student": student, "total": sum(scores.values()), "max": most,
                         "scores": scores, "notes": notes, "notebooks": notebooks})
    return {
        "graded_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "options": {"cell_timeout_s": options.cell_timeout,
                    "notebook_timeout_s": options.notebook_timeout,
                    "memory_mb": options.memory_mb, "check_modules": list(options.check_modules),
                    "sandbox": "bubblewrap" if options.sandbox else "none (--no-sandbox)",
                    "credit": options.credit_rule},
        "exercises": [{"grade_id": e.grade_id, "chapter": chapter, "max_points": e.points}
                      for chapter, e in columns],
        "max": most,
        "students": students,
        "integrity": {"changed_during_grading": integrity},
    }


def gradebook_csv(book: dict) -> str:
    """The CSV gradebook: one row per student (see the module's docstring)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    grade_ids = [e["grade_id"] for e in book["exercises"]]
    writer.writerow(["student", *grade_ids, "total", "max", "notes"])
    for student in book["students"]:
        writer.writerow([student["student"], *(f"{student['scores'][g]:g}" for g in grade_ids),
                         f"{student['total']:g}", f"{student['max']:g}",
                         "; ".join(student["notes"])])
    return out.getvalue()


def gradebook_paths(out: Path) -> tuple[Path, Path]:
    """``OUT`` -> (OUT.csv, OUT.json); a ``.csv`` or ``.json`` suffix on OUT is dropped."""
    stem = out.with_suffix("") if out.suffix in (".csv", ".json") else out
    return stem.with_name(stem.name + ".csv"), stem.with_name(stem.name + ".json")


def grade_class(root: Path, out: Path, *, solutions_dir: Path, options: GradingOptions,
                workers: int, progress: bool = True) -> dict:
    """Grade every submission in ``root`` and write the CSV and JSON gradebooks of ``out``;
    returns the JSON gradebook."""
    started, children = time.monotonic(), processes.children()
    csv_path, json_path = gradebook_paths(out)
    found = collect_class(root, skip={csv_path.resolve(), json_path.resolve()})
    trusted = trusted_files(solutions_dir, options.check_modules)
    before = fingerprint(trusted)
    canonicals = grader.prepare(solutions_dir, options.check_modules)
    grades = grade_files(found.submissions, canonicals, options, workers=workers,
                         solutions_dir=str(solutions_dir), progress=progress)
    after = fingerprint(trusted)
    changed = sorted(path for path in before.keys() | after.keys()
                     if before.get(path) != after.get(path))
    book = build_gradebook(found, grades, canonicals, options, time.monotonic() - started,
                           changed)
    processes.kill_new_children(children)  # orphans adopted from the workers' kernels
    write_atomically(csv_path, gradebook_csv(book))
    write_atomically(json_path, json.dumps(book, indent=2, ensure_ascii=False) + "\n")
    book["grader_errors"] = sum(g.grader_error for g in grades)
    return book


def format_class_table(book: dict) -> str:
    rows = [("student", "points", "notes")]
    rows += [(s["student"], f"{s['total']:g} / {s['max']:g}", str(len(s["notes"])) if s["notes"]
              else "") for s in book["students"]]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{row[0].ljust(widths[0])}  {row[1].ljust(widths[1])}  {row[2]}".rstrip()
                     for row in rows)
