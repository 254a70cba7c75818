"""Grading one notebook: the grade is decided outside the student's process.

``python -m course_attn.grade PATH...`` (``cli.py``; a whole class: ``batch.py``). For
each submitted notebook:

1. *Read* it (``notebook.py``): the student's file is only ever read; nbformat 1-3 converted;
   anything that is not a notebook scores 0 with the reason.
2. *Restore* its protected cells from the chapter's canonical notebook in ``solutions/``
   (``canonical.py``, ``restore.py``): the setup and check cells go back as written, changes
   are flagged.
3. *Run* it (``kernel.py``): a fresh kernel in an operating-system sandbox (``sandbox.py``),
   against a read-only copy of the package, with limits on the memory and processes of its
   whole tree, a time limit per cell and an output limit. The student's cells run in order.
   Where a check cell stands, the grader instead sends that exercise's inputs: the public
   cases and hidden cases drawn with a fresh seed (``solutions/hidden/``). The kernel runs the
   student's function on them under a guard that checks every operation where torch dispatches
   it (``harness.py``, ``operations.py``), and returns the outputs as plain data (tensors as
   raw bytes; nothing is unpickled).
4. *Judge* (``judge.py``): the grader computes every expected output itself and compares. An
   exercise scores its points when every case passes and no refused operation was run. An
   answer in several parts (a dict of counts or predictions, each case judging one key) earns
   the share of its parts whose every case passes, the points split evenly among the parts;
   an answer in one piece, the share of the regimes of its hidden cases whose every case
   passes (``--all-or-nothing``: all cases or nothing). A refused operation costs every point.
   The reason shows a failed case whose answer is a typical mistake's, so that its hint names
   the mistake, the public ones first; else the first failed case.

If the kernel dies or hangs, it is restarted, the cells that ran before are run again, and
grading goes on after the cell that killed it, so later correct work keeps its points; a cell
that was interrupted or killed the kernel is flagged. When grading ends, the sandbox and every
process in it are killed, and only then is the report written.

Threat model
------------
*What the operating system guarantees* (bubblewrap; without it the grader refuses to grade for
credit unless the instructor passes ``--no-sandbox``, which every report records). The kernel
runs as an unprivileged user in its own user, PID, network, IPC and UTS namespaces: it sees only
its own processes, so it cannot read, signal, stop or trace the grader, its worker or another
kernel (``/proc/<ppid>`` is its own sandbox's init); it has no network; it sees the system, the
Python and the virtual environment read-only, a read-only copy of ``course_attn`` without the
chapters' exercise declarations, its own working folder and a private ``/tmp``, and nothing
else: no ``solutions/``, no hidden cases, no repository, no other submission. So a submission
cannot change the grader's code or the package (read-only), forge another kernel's answers or
reports (they travel on that kernel's own signed Jupyter channel and its own pipe), or kill the
grader. Memory and the number of processes are limited for the whole tree (cgroups, where the
grader may make them; else per process, and the report says ``limits: process``), and so is its
share of the CPUs when several notebooks are graded at once; what it writes goes to tmpfs of a
fixed size, never the host's disk; a cell that prints more than ``kernel.MAX_OUTPUT_CHARS``
characters is interrupted. Before its first graded call the kernel can start no process any
more (a seccomp filter, checked from outside in ``/proc``; ``confine.py``), and every other
process in the sandbox is ended, with a note and no point lost: a graded call runs in the
kernel alone. The batch runs each
notebook in a worker process under a watchdog: a worker that dies or stops answering is
replaced, the notebook it held is graded once more and then scores 0 with the reason, and
every other notebook keeps its grade.

*What no code in the kernel can change*: the kernel returns outputs, not verdicts, and those
outputs must be right for inputs it has not seen before (hidden cases, drawn anew for each
notebook). A table of the public answers, a patched comparison, a tampered check cell or a
forged message are worth nothing. Only torch's own tensors and plain Python values are read
from the answer, without running any of the submission's code (``__torch_function__``, torch
modes and subclasses are switched off while encoding).

*What the guard enforces, in the kernel*: while the student's function computes the grader's
outputs, every ATen operation torch dispatches is checked against the exercise's allowlist,
however it was reached (``torch.softmax``, ``Tensor.softmax``, ``torch._softmax``,
``torch.ops.aten._softmax``, ``map(torch.softmax, rows)``, a thread started through
``threading``); shortcuts that torch decomposes before dispatch (``F.rms_norm``,
``repeat_interleave``) are refused by name whatever the route; code of the package is refused
by the file it is in. A refused operation is written to the grader's pipe the moment it
happens, so erasing the guard's record afterwards changes nothing. The grader's expression
looks up no name in the student's namespace, and IPython's input transformers never see it.

The answer travels on that pipe too, not in the Jupyter reply: an answer rewritten in the reply
(an override of IPython's ``user_expressions``) changes nothing, and two answers for one call
fail it. Where an exercise is arithmetic (its allowlist is empty), a profiler in the calling
thread also sees the package's pure-Python code.

*What remains*, deliberately: the guard and the harness live in the student's process, so a
submission that pops torch's modes without being seen, or runs its computation in a thread
started with ``_thread``, escapes the allowlist, though never the correctness of its answers: it must still produce the
right outputs for inputs it has never seen. Such code is visible: the grader flags, for a human
reviewer and without taking points, code that walks the stack, searches the interpreter's
objects (``gc``), calls C (``ctypes``), reads ``/proc``, sends signals, hooks torch's dispatch,
replaces the kernel's own machinery, reaches ``course_attn.grading``, rewrites builtins or code
objects, or starts a ``_thread`` (``review.py``). Copying the reference's published source is
new code, not a call.
"""

import asyncio
import os
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_core.utils import run_sync

from ..colab import a_clone_of_the_course
from .canonical import Canonical, GradedExercise, GraderError, UnknownChapter, \
    load_canonicals, lookup_in
from .exercise import hidden_cases, load_hidden
from .harness import SWITCHES_OFF, WireError, decode, encode
from .operations import guard_options
from .review import review_flags
from .judge import NO_PROCESS, Answer, Judgement, judge_case
from .kernel import MAX_OUTPUT_CHARS, OUT_OF_MEMORY, SCRATCH_PREFIX, CellRun, Kernel, \
    scratch_root, shadowing
from .notebook import ReadNotebook, chapter_of, parse_notebook, read_submission, shorten
from .report import ExerciseScore, NotebookGrade, format_table, report  # noqa: F401 (API)
from .restore import Restored, restore_protected_cells, students_code

CELL_TIMEOUT_S = 60.0
NOTEBOOK_TIMEOUT_S = 300.0
MEMORY_MB = 2048
MAX_RESTARTS = 3
MAX_OUTPUT_CHARS_PER_CELL = 1_000_000
_SYNTAX_ERRORS = {"SyntaxError", "IndentationError", "TabError"}
_OUT_OF_MEMORY = ("MemoryError", "can't allocate memory", "Cannot allocate memory",
                  "out of memory", "std::bad_alloc")


@dataclass(frozen=True)
class GradingOptions:
    """Limits for one notebook. ``memory_mb`` 0: no memory limit. ``check_modules``: modules
    that register exercises outside ``course_attn.grading`` (imported here, by the grader).
    ``extra_path``: folders the kernel needs on its PYTHONPATH for them. ``hidden_seed``: the
    seed of the hidden cases (None: a fresh one per notebook). ``sandbox``: run each kernel in
    the operating-system sandbox (``sandbox.py``); False only at the instructor's explicit
    ``--no-sandbox``, which every report records. ``all_or_nothing``: an exercise answered in
    one piece earns its points only when every case passes (``--all-or-nothing``); else each
    regime of its hidden cases that it passes earns its share (``judge.Judgement.parts``).
    ``cpus``: the CPUs' worth of time one notebook's sandbox may use (0: no limit); the batch
    gives each of its workers' notebooks an equal share."""

    cell_timeout: float = CELL_TIMEOUT_S
    notebook_timeout: float = NOTEBOOK_TIMEOUT_S
    memory_mb: int = MEMORY_MB
    check_modules: tuple[str, ...] = ()
    extra_path: tuple[str, ...] = ()
    hidden_seed: int | None = None
    sandbox: bool = True
    all_or_nothing: bool = False
    cpus: float = 0.0

    @property
    def credit_rule(self) -> str:
        return "all or nothing" if self.all_or_nothing else "by regime"


@dataclass
class Evaluation:
    """One exercise's inputs, the expected outputs, and what the kernel made of them."""

    graded: GradedExercise
    cases: list
    expected: list
    hidden: list[bool]
    run: CellRun | None = None
    answer: dict | None = None
    hits: list[str] = field(default_factory=list)
    block: list[int] = field(default_factory=list)  # the student's cells before its check cell


def _describe_run(run: CellRun, where: str, memory_mb: int) -> str:
    """Why a cell or an evaluation failed, in a sentence for the student."""
    if run.status in ("timeout", "stuck"):
        return f"timed out after {run.evalue} ({where})"
    if run.status == "output":
        return f"printed more than {MAX_OUTPUT_CHARS:,} characters, and was stopped ({where})"
    if run.status == "died" and run.evalue == OUT_OF_MEMORY:
        return f"ran out of memory (the limit is {memory_mb} MB for the kernel and every " \
               f"process it started) ({where})"
    if run.status == "died":
        how = f" ({run.evalue})" if run.evalue else ""
        return f"the kernel died{how} ({where})"
    text = f"{run.ename}: {run.evalue}"
    if any(sign in text for sign in _OUT_OF_MEMORY):
        limit = f" (the limit is {memory_mb} MB)" if memory_mb else ""
        return f"ran out of memory{limit} ({where})"
    if run.ename in _SYNTAX_ERRORS:
        return f"{run.ename} in your code ({where}): {shorten(run.evalue, 120)}"
    if run.ename == "SystemExit":
        return f"your code called sys.exit() ({where})"
    if run.ename == "PermissionError" and "Operation not permitted" in run.evalue:
        return f"{run.ename} in your code ({where}): {shorten(run.evalue, 120)} ({NO_PROCESS})"
    return f"{run.ename} in your code ({where}): {shorten(run.evalue, 160)}"


def _prepare(graded: GradedExercise, seed: int) -> Evaluation:
    exercise = graded.exercise
    public = exercise.public_cases()
    secret = hidden_cases(exercise.key, seed)
    cases = public + secret
    return Evaluation(graded, cases, [exercise.expected(case) for case in cases],
                      [False] * len(public) + [True] * len(secret))


def _request(evaluation: Evaluation, package: str) -> dict:
    """What the kernel runs for one exercise: its cases, and what the guard checks
    (``package``: the folder of the kernel's copy of course_attn)."""
    exercise = evaluation.graded.exercise
    cases = evaluation.cases[:1] if exercise.kind == "value" else evaluation.cases
    return {"name": exercise.function, "kind": exercise.kind,
            "cases": [{"args": encode(list(c.args)), "kwargs": encode(dict(c.kwargs))}
                      for c in cases], **guard_options(exercise, package)}


def _answers(evaluation: Evaluation) -> list[Answer]:
    """The kernel's answer as one Answer per case (an answer it could not give is an error)."""
    raw = evaluation.answer.get("results") if evaluation.answer else None
    raw = raw if isinstance(raw, list) else []
    if evaluation.graded.exercise.kind == "value" and raw:
        raw = raw[:1] * len(evaluation.cases)
    mutated = {}  # the answer is whatever the kernel wrote: nothing in it is trusted
    items = (evaluation.answer or {}).get("mutated")
    for item in items if isinstance(items, list) else []:
        if isinstance(item, list) and len(item) == 2 and \
                all(isinstance(i, int) and not isinstance(i, bool) for i in item):
            mutated[item[0]] = item[1]
    answers = []
    for number in range(len(evaluation.cases)):
        item = raw[number] if number < len(raw) and isinstance(raw[number], dict) else {}
        if "value" in item:
            try:
                answers.append(Answer(value=decode(item["value"]),
                                      mutated_argument=mutated.get(number)))
            except WireError as error:
                answers.append(Answer(unsendable=str(error)))
        elif isinstance(item.get("error"), dict):
            error, line = item["error"], item["error"].get("line")
            answers.append(Answer(error={
                "type": str(error.get("type") or "Exception")[:100],
                "message": str(error.get("message") or "")[:2000],
                "line": line if isinstance(line, int) and not isinstance(line, bool) else None}))
        elif "unencodable" in item:
            answers.append(Answer(unsendable=str(item["unencodable"])[:200]))
        else:
            answers.append(Answer(error={"type": "GraderError",
                                         "message": "the kernel sent no answer for this case"}))
    return answers


def _verdict(evaluation: Evaluation, runs: dict[int, CellRun], label, memory_mb: int,
             by_regime: bool = True) -> tuple[float, str, list[str]]:
    """The share of the points earned (``Judgement.credit``: by parts for a multi-part answer,
    by regime unless the instructor asked for all or nothing), the reason, and flags, for one
    exercise."""
    exercise, run, flags = evaluation.graded.exercise, evaluation.run, []
    where = f"computing your {exercise.function} for the grader's inputs"
    reported = (evaluation.answer or {}).get("banned")
    reported = [h for h in reported if isinstance(h, str)] if isinstance(reported, list) else []
    hits = list(dict.fromkeys(str(h)[:200] for h in evaluation.hits + reported))
    switches = [h for h in hits if h.endswith(SWITCHES_OFF)]
    if switches:
        flags.append(f"{evaluation.graded.grade_id}: the submission switched off the check of "
                     f"the operations it runs ({switches[0].removesuffix(SWITCHES_OFF).strip()})")
    if run is None:
        return 0.0, "not graded: the notebook did not get that far", flags
    refused = [h for h in hits if not h.endswith(SWITCHES_OFF)]
    if refused and run.status not in ("ok", "error"):
        # timed out or killed after a refused call: the call is the reason, not the time
        return 0.0, Judgement(exercise.key, banned=hits).reason(), flags
    if run.status != "ok" or evaluation.answer is None:
        if run.status == "ok" or run.status == "error":
            detail = f"{run.ename}: {shorten(run.evalue, 120)}" if run.ename else "no answer"
            flags.append(f"{evaluation.graded.grade_id}: the grader's evaluation failed in the "
                         f"kernel ({detail}); the submission may have interfered with it")
            return 0.0, f"the grader could not run your function ({detail})", flags
        return 0.0, _describe_run(run, where, memory_mb), flags
    judgement = Judgement(exercise.key, banned=hits, by_regime=by_regime)
    if not evaluation.answer.get("found"):
        judgement.missing = True
        for index in evaluation.block:
            earlier = runs.get(index)
            if earlier is not None and earlier.status != "ok":
                return 0.0, _describe_run(earlier, label(index), memory_mb), flags
        return 0.0, f"not answered: the notebook does not define {exercise.function}", flags
    for case, expected, hidden, answer in zip(evaluation.cases, evaluation.expected,
                                               evaluation.hidden, _answers(evaluation)):
        judgement.results.append(judge_case(exercise, case, expected, answer, hidden))
    return judgement.credit(), judgement.reason(), flags


async def _run_notebook(nb, restored: Restored, evaluations: dict[int, Evaluation],
                        options: GradingOptions, scratch: Path, helpers: dict,
                        grade: NotebookGrade) -> tuple[dict[int, CellRun], list[str]]:
    """Run the restored notebook, evaluating each exercise where its check cell stands;
    ``helpers`` (file name -> bytes) go into the kernel's working folder first. Returns the
    cells' runs and the flags; what the student should know but costs nothing goes to the
    grade's notes, and the limits its sandbox had to ``grade.sandbox``."""
    runs: dict[int, CellRun] = {}
    flags: list[str] = []
    kernel = Kernel(scratch, options.memory_mb, options.extra_path, sandboxed=options.sandbox,
                    cpus=options.cpus)
    for name, data in helpers.items():
        if Path(name).name == name and name.endswith(".py"):
            refused = shadowing(name)
            if refused:
                flags.append(refused)
            else:
                (kernel.given / name).write_bytes(data)
    package = str(kernel.site / "course_attn")
    deadline = time.monotonic() + options.notebook_timeout
    replay: list[int] = []
    restarts = 0
    busy: dict[int, tuple[str, str]] = {}  # the notebook's threads that ran during graded calls
    visited: set[int] = set()  # the threads that ran Python when a guard asked them to
    python: set[int] = set()  # the threads started from Python (torch's own start from C)
    try:
        await kernel.start()
        if options.sandbox:
            grade.sandbox = f"bubblewrap, {kernel.limits.kind} limits" + (
                f", {options.cpus:g} CPUs" if kernel.limits.cpu_limited else "")
        steps = [i for i, cell in enumerate(nb.cells)
                 if i in evaluations or (cell.cell_type == "code" and cell.source.strip())]
        for index in steps:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                flags.append(f"the notebook's time limit of {options.notebook_timeout:g} s was "
                             f"reached before {restored.label(index)}; the rest was not run")
                break
            limit = min(options.cell_timeout, remaining)
            if index in evaluations and not kernel.confined:
                problem, ended = await kernel.confine(limit)
                if ended:
                    grade.notes.append(f"{ended} process(es) that the notebook's cells started were "
                                 f"ended before {evaluations[index].graded.grade_id} was "
                                 "graded (no points lost: a graded call runs in the kernel "
                                 "alone, and from then on the kernel can start no process)")
                if problem:  # graded anyway only where the instructor gave up the sandbox
                    flags.append(f"the kernel could not be kept from starting processes "
                                 f"({problem})" + ("; the rest of the notebook was not graded"
                                                   if options.sandbox else ""))
                    if options.sandbox:
                        break
            if index in evaluations:
                evaluation = evaluations[index]
                evaluation.run, evaluation.answer, evaluation.hits = await kernel.evaluate(
                    _request(evaluation, package), limit)
                run = evaluation.run
                for tid, thread in kernel.busy_threads.items():  # as the kernel sees them
                    busy.setdefault(tid, (thread, evaluation.graded.grade_id))
                if isinstance(evaluation.answer, dict):
                    visited.update(t for t in evaluation.answer.get("visited", ())
                                   if isinstance(t, int))
                    python.update(t for t in evaluation.answer.get("python_threads", ())
                                  if isinstance(t, int))
            else:
                run = runs[index] = await kernel.run(nb.cells[index].source, limit)
            what = restored.label(index) if index not in evaluations else \
                f"the evaluation of {evaluations[index].graded.grade_id}"
            if run.status == "output":
                flags.append(f"{what} printed more than {MAX_OUTPUT_CHARS:,} characters of "
                             "output and was interrupted; grading went on")
            elif run.output_chars > MAX_OUTPUT_CHARS_PER_CELL:
                flags.append(f"{what} printed {run.output_chars:,} characters of output")
            if run.status == "timeout":
                flags.append(f"{what} was interrupted after {run.evalue} (time limit); "
                             "grading went on")
            if run.status in ("died", "stuck"):
                how = f"died ({run.evalue})" if run.status == "died" and run.evalue else \
                    "died" if run.status == "died" else f"stopped answering after {run.evalue}"
                if restarts >= MAX_RESTARTS:
                    flags.append(f"the kernel {how} in {what}; after {MAX_RESTARTS} restarts "
                                  "the rest of the notebook was not run")
                    break
                restarts += 1
                flags.append(f"the kernel {how} in {what}; it was restarted, the cells before "
                             "it were run again, and grading went on after it")
                await kernel.restart()
                for earlier in replay:
                    again = await kernel.run(nb.cells[earlier].source,
                                             min(options.cell_timeout, deadline - time.monotonic()))
                    if again.status in ("died", "stuck"):
                        flags.append(f"{restored.label(earlier)} stopped the kernel when it "
                                     "was run again; the rest of the notebook was not run")
                        return runs, flags
            elif index not in evaluations:
                replay.append(index)
    finally:
        await kernel.stop()
    # a thread started from Python that ran during graded calls and never ran Python again
    unseen = {tid: seen for tid, seen in busy.items() if tid in python and tid not in visited}
    if unseen:
        thread, gid = next(iter(unseen.values()))
        flags.append(f"for review (no points lost): {len(unseen)} thread(s) that the notebook "
                     f"started (the first named {thread!r}) ran during the graded calls ({gid} "
                     "first) without running Python, where the guard cannot see what they "
                     "compute (a loop in TorchScript or C)")
    return runs, flags


async def grade_data(name: str, data: bytes | None, canonical_for, options: GradingOptions,
                     *, read_problem: str | None = None, path: str | None = None,
                     helpers: dict | None = None) -> NotebookGrade:
    """Grade the submitted bytes ``data`` of a file named ``name`` (reported as ``path``).

    ``canonical_for(chapter)`` returns that chapter's Canonical or raises GraderError;
    ``read_problem``: why the file could not be read (``data`` is then None); ``helpers``: the
    student's Python files beside it (name -> bytes), put in the kernel's working folder.
    """
    started = time.monotonic()
    grade = NotebookGrade(path or name)
    read = ReadNotebook(None, read_problem) if data is None else \
        parse_notebook(data, Path(name).suffix)
    nb = read.nb
    grade.chapter = chapter_of(nb, name)
    grade.flags.extend(read.notes)
    canonical: Canonical | None = None
    missing = ""
    grade.sandbox = "bubblewrap" if options.sandbox else "none (--no-sandbox)"
    grade.credit = options.credit_rule
    if grade.chapter is not None:
        try:
            canonical = canonical_for(grade.chapter)
        except UnknownChapter as error:
            read.problem = f"not graded: {error}"
        except GraderError as error:
            missing = str(error)
    linked = canonical is not None and path is not None and \
        _links_to(Path(path), canonical.path)
    if nb is None or canonical is None or linked:
        if linked:
            read.problem = (f"not graded: this file is the course's solution notebook "
                            f"{canonical.path} under another name (a link), not a submission")
        if nb is not None and grade.chapter is None:
            read.problem = ("cannot tell which chapter this is: no course_attn.chapter in its "
                            "metadata, no chNN- grade_ids in its cells and no NN_ prefix in its "
                            "file name")
        grade.error = read.problem or missing
        grade.grader_error = read.problem is None
    else:
        written = students_code(nb, canonical)  # read before the course's cells go back in
        restored = restore_protected_cells(nb, canonical)
        grade.flags.extend(restored.flags)
        grade.flags.extend(review_flags(written, helpers=helpers))
        seed = options.hidden_seed if options.hidden_seed is not None else secrets.randbits(48)
        evaluations = {}
        checks = sorted(restored.placed.values())
        for graded in canonical.exercises:
            index = restored.placed.get(graded.grade_id)
            if index is not None:
                evaluation = _prepare(graded, seed)
                start = max([i for i in checks if i < index], default=-1) + 1
                evaluation.block = list(range(start, index))
                evaluations[index] = evaluation
        with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX, dir=scratch_root(),
                                         ignore_cleanup_errors=True) as tmp:
            try:
                runs, run_flags = await _run_notebook(nb, restored, evaluations, options,
                                                      Path(tmp), helpers or {}, grade)
                grade.flags.extend(run_flags)
            except GraderError as error:
                grade.error, grade.grader_error = str(error), True
                runs = {}
        by_id = {e.graded.grade_id: e for e in evaluations.values()}
        for graded in canonical.exercises if not grade.grader_error else ():
            evaluation = by_id.get(graded.grade_id)
            if evaluation is None:
                credit, reason, flags = 0.0, "check cell missing", []
            else:
                credit, reason, flags = _verdict(evaluation, runs, restored.label,
                                                 options.memory_mb, not options.all_or_nothing)
            grade.flags.extend(flags)
            grade.exercises.append(ExerciseScore(graded.grade_id,
                                                 round(graded.points * credit, 2),
                                                 graded.points, credit == 1.0, reason))
    if canonical is not None and not grade.exercises:
        grade.exercises = [ExerciseScore(e.grade_id, 0, e.points, False,
                                         f"not graded: {grade.error}")
                           for e in canonical.exercises]
    grade.seconds = time.monotonic() - started
    return grade


def _links_to(path: Path, solution: Path) -> bool:
    """Whether ``path`` is another name for the file ``solution`` (a hard or symbolic link to
    it), rather than the solution itself or a copy a student edited."""
    try:
        return os.path.samefile(path, solution) and \
            os.path.abspath(path) != os.path.abspath(solution)
    except OSError:
        return False


async def _grade_file(path: Path, canonical_for, options: GradingOptions) -> NotebookGrade:
    submission = read_submission(path)
    return await grade_data(path.name, submission.data, canonical_for, options,
                            read_problem=submission.problem, path=str(path),
                            helpers=submission.helpers)


async def _grade_all(paths, canonical_for, options, jobs, progress):
    slots = asyncio.Semaphore(max(1, jobs))

    async def one(path):
        async with slots:
            grade = await _grade_file(Path(path), canonical_for, options)
        if progress:
            import sys
            print(f"graded {grade.path}: {grade.total:g} / {grade.max_points:g} "
                  f"({grade.seconds:.1f} s)", file=sys.stderr, flush=True)
        return grade

    return list(await asyncio.gather(*(one(p) for p in paths)))


def prepare(solutions_dir: Path | str, check_modules: tuple[str, ...] = (), *,
            read_notebooks: bool = True):
    """Import the check modules and the hidden cases, and read the canonical notebooks: what a
    grading process needs before the first kernel starts. Returns ``load_canonicals``' answer
    (None without ``read_notebooks``)."""
    import importlib
    for module in check_modules:
        importlib.import_module(module)
    load_hidden(solutions_dir)
    return load_canonicals(solutions_dir) if read_notebooks else None


def grade_notebooks(paths, *, solutions_dir: Path | str, cell_timeout: float = CELL_TIMEOUT_S,
                    notebook_timeout: float = NOTEBOOK_TIMEOUT_S, memory_mb: int = MEMORY_MB,
                    check_modules: tuple[str, ...] = (), extra_path: tuple[str, ...] = (),
                    hidden_seed: int | None = None, jobs: int = 1, progress: bool = False,
                    sandbox: bool = True, all_or_nothing: bool = False) -> list[NotebookGrade]:
    """Grade each file in ``paths`` (``jobs`` at a time, in this process); never raises for a
    bad submission. ``batch.grade_files`` does the same in worker processes. Raises
    GraderError when ``sandbox`` is asked for and cannot be had here."""
    from . import sandbox as sandboxes
    if sandbox and sandboxes.unavailable():
        raise GraderError(sandboxes.unavailable())
    options = GradingOptions(cell_timeout, notebook_timeout, memory_mb, tuple(check_modules),
                             tuple(extra_path), hidden_seed, sandbox, all_or_nothing)
    canonical_for = lookup_in(prepare(solutions_dir, options.check_modules), solutions_dir)
    return run_sync(_grade_all)(list(paths), canonical_for, options, jobs, progress)


def grade_notebook(path: Path | str, **options) -> NotebookGrade:
    """Grade one file; ``options`` as for ``grade_notebooks``."""
    return grade_notebooks([path], **options)[0]


def default_solutions_dir() -> Path:
    here = Path("solutions")
    return here if here.is_dir() else Path(__file__).resolve().parents[2] / "solutions"


def missing_solutions(path: Path | str) -> str:
    """One line for a solutions folder ``path`` that does not exist: what the grader needs (a
    pip install carries the package, not the course's solutions/)."""
    missing = (f"no solutions/ folder in {Path.cwd()} or at {default_solutions_dir()}"
               if Path(path) == default_solutions_dir() else f"--solutions {path} does not exist")
    return (f"{missing}: the grader compares against the course's solution notebooks; run it in "
            f"{a_clone_of_the_course()}, or give --solutions DIR")
