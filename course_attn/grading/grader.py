"""Grading: run a student's notebook in a fresh kernel and score each exercise.

For each notebook (``python -m course_attn.grade PATH...``; a whole class: ``batch.py``):

1. Read it into memory (the student's file is only ever read) and write the copy that runs into
   a temporary folder. A notebook of nbformat 1 to 3 is converted to 4; anything else that is
   not a notebook scores 0 with the reason.
2. Find its chapter (notebook metadata ``course_attn.chapter``, else the file name's ``NN_``
   prefix) and the canonical notebook of that chapter in ``solutions/``, read before any kernel
   starts. Its grade cells are the exercises: ``grade_id`` and ``points``.
3. Put the canonical source back into every grade cell and every locked cell (never into a
   solution cell), matched by ``grade_id``, as nbgrader's ``OverwriteCells`` does; a modified
   one is flagged (nbgrader's checksum idea), a deleted locked cell (the setup) is put back, a
   deleted check cell scores 0, a repeated ``grade_id`` and cells out of their original order
   are flagged. A check cell gets its solutions/ source, **hidden tests included**, wrapped in
   the sealed check of ``sealed.py`` with a fresh nonce.
4. Start a fresh ``python3`` kernel (the grader's own interpreter) with a memory limit
   (``RLIMIT_DATA``, which counts the heap and every private mapping: what NumPy and PyTorch
   allocate), no core dumps, and a secret key for this run; a preamble installs the sealed
   checks before the submission's first cell. Then every code cell runs, errors allowed, each
   within ``cell_timeout`` seconds and the whole notebook within ``notebook_timeout``. A cell
   over its limit is interrupted and the run goes on; if the kernel does not answer within a
   few seconds after that, or dies, the remaining cells are not run.
5. An exercise scores its points iff its check cell's execute reply is "ok" **and** the cell
   published a "done" message signed with this run's key and carrying the nonce the grader put
   in that cell. Otherwise 0, with the reason ("not implemented", "2 of 5 checks failed (...)",
   "calls course_attn.masks.causal_mask, the package's reference, ...", "a hidden test failed
   ...", "ran out of memory ...", "SyntaxError in your code (...)", "timed out after 60 s",
   "kernel died (SIGSEGV) ...", "check cell missing").

Nothing a submission does (bad JSON, a syntax error, an endless loop, ``sys.exit()``, killing
the kernel, a memory bomb, megabytes of output) makes the grader raise: each becomes a score
with a reason. Exit status: 0 when every notebook was graded (whatever the scores), 1 when the
grader itself could not grade one (no kernel, no solutions notebook for its chapter), 2 for a
usage error.

Threat model
------------
Scores come from the grader process: from the kernel's execute replies and the signed messages
of the restored check cells, never from what a notebook prints, saves in its outputs or writes to
disk. Defended against:

- *The notebook file*: edited, deleted, duplicated or reordered locked and check cells, stale
  outputs, changed points: the canonical cells are run instead and the change is flagged.
- *Forged results*: printing "passed", publishing a fake signed message, a pass written to a
  file. The key that signs is made per run, reaches the kernel through a file that the preamble
  reads and deletes before any student code runs, and never appears in a cell; the nonce is
  fresh per check cell, so nothing can be prepared in advance.
- *Skipping the checks*: an IPython input or AST transformer, an event hook or a patched
  ``run_cell`` that turns the check cell into ``pass`` gets an "ok" reply but no signed done
  message: 0, flagged.
- *Name-level monkeypatching* before or during a check: ``course_attn.grading.check = ...``,
  replacing ``run_checks``, ``assert_close``, ``torch.testing.assert_close``, a method of
  ``torch.Tensor``, a builtin, ``sys.setprofile``, the registered checks, or a function's
  ``__code__``: the preamble's snapshot of them no longer matches; the exercise scores 0 and the
  change is named. Returning a ``torch.Tensor`` subclass (which could redefine comparisons)
  fails the check.
- *Calling the reference*: a function that enters the code of the package function the check
  compares with (however imported, aliased or wrapped) fails (``registry.py``).
- *Resources*: endless loops (time limits, then the kernel's process group is killed), memory
  bombs (``--memory-mb``), kernel crashes, huge output (1 MB kept per cell).

Not defended against (run untrusted submissions in a container or VM, as a user who can write
nothing but a scratch folder, without network; and read the flags):

- A submission that deliberately attacks the interpreter it runs in: walking ``gc``, frames or
  closures to read the key or change the checker's state, writing memory with ``ctypes``,
  replacing the code of a C extension. The kernel is the student's process; in-process checks
  raise the bar, they are not a sandbox.
- The operating system: the kernel runs as the grader's user and can read or change any file
  that user can (other submissions, ``solutions/``, the package itself: ``batch.py`` reads every
  submission and solution before the first kernel starts and warns when the package changed on
  disk during a run), read the grader's own memory where ptrace allows it (and with it the
  key), start processes that escape the kernel's process group, fill the disk, or use the
  network.
- Copying: a function that carries a copy of the reference's source is new code, not a call.
"""

import asyncio
import copy
import functools
import json
import logging
import os
import queue
import re
import secrets
import signal
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

from . import sealed
from .generate import (
    generate_notebook, grade_id, is_grade_cell, is_locked_cell, is_solution_cell, nbgrader_metadata,
)
from .registry import _describe as describe_check_error

KERNEL_NAME = "python3"
CELL_TIMEOUT_S = 60.0
NOTEBOOK_TIMEOUT_S = 300.0
MEMORY_MB = 2048
KERNEL_STARTUP_TIMEOUT_S = 60.0
INTERRUPT_GRACE_S = 5.0
MAX_OUTPUT_CHARS_PER_CELL = 1_000_000
NOT_IMPLEMENTED_MESSAGE = describe_check_error(NotImplementedError())
_TIMEOUT_ENAME = "course_attn.grade:cell-timeout"
_CHECKED_NAME = re.compile(r"""\bcheck\(\s*["']([^"']+)["']""")
_OUT_OF_MEMORY = re.compile(r"MemoryError|can't allocate memory|Cannot allocate memory|"
                            r"out of memory|std::bad_alloc")
_QUIET_LOG = logging.getLogger("course_attn.grade.kernel")
_QUIET_LOG.addHandler(logging.NullHandler())
_QUIET_LOG.propagate = False


@dataclass(frozen=True)
class GradingOptions:
    """Limits for one notebook's run. ``memory_mb`` 0: no memory limit. ``check_modules``:
    modules holding exercise checks outside ``course_attn.grading``, imported (and guarded)
    before the submission's code runs."""

    cell_timeout: float = CELL_TIMEOUT_S
    notebook_timeout: float = NOTEBOOK_TIMEOUT_S
    memory_mb: int = MEMORY_MB
    check_modules: tuple[str, ...] = ()


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
    source: str  # the check cell's source in solutions/, hidden tests included

    @property
    def checked_names(self) -> list[str]:
        """The exercise names the check cell passes to ``check``."""
        return _CHECKED_NAME.findall(self.source)


@dataclass
class Canonical:
    """A chapter's solutions notebook: its exercises and the cells a student may not change."""

    path: Path
    exercises: list[Exercise]
    protected: dict[str, nbformat.NotebookNode]  # grade_id -> grade or locked cell
    given: dict[str, nbformat.NotebookNode]  # the same cells as the exercise notebook shows them
    order: list[str]  # every grade_id of the notebook, in order


@dataclass
class CellRun:
    """What happened to one cell. ``status``: ok, error, timeout, died, not run, skipped."""

    status: str
    ename: str = ""
    evalue: str = ""
    limit_s: float = 0.0
    notebook_limit: bool = False
    stopped_by: str = ""  # for "not run": died, stuck, time limit, lost
    stopped_at: int = -1  # the index of the cell that stopped the run
    sealed: list = field(default_factory=list)  # the grading messages it published (unverified)
    dropped_chars: int = 0  # output beyond MAX_OUTPUT_CHARS_PER_CELL


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


@dataclass
class ReadNotebook:
    """``read_notebook``'s answer: the notebook, or why it is not one; and what was done to it."""

    nb: nbformat.NotebookNode | None
    problem: str | None = None
    notes: list[str] = field(default_factory=list)


def read_notebook(path: Path) -> ReadNotebook:
    """The notebook in ``path``; see ``parse_notebook``."""
    try:
        data = path.read_bytes()
    except OSError as error:
        return ReadNotebook(None, f"could not read the file: {error.strerror or error}")
    return parse_notebook(data, path.suffix)


def parse_notebook(data: bytes, suffix: str = ".ipynb") -> ReadNotebook:
    """The notebook in ``data`` (nbformat 4; 1 to 3 converted), or why it is not one."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return ReadNotebook(None, "not a notebook: the file is not UTF-8 text")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        prefix = "" if suffix == ".ipynb" else "not a notebook: "
        return ReadNotebook(None, f"{prefix}invalid JSON (line {error.lineno}, column "
                                  f"{error.colno}): {error.msg}")
    except RecursionError:
        return ReadNotebook(None, "not a notebook: JSON nested too deeply")
    version = raw.get("nbformat") if isinstance(raw, dict) else None
    notes = []
    if isinstance(version, int) and not isinstance(version, bool) and version != 4:
        if not 1 <= version <= 3:
            return ReadNotebook(None, f"not a notebook this grader can read: nbformat {version} "
                                      "(it reads 4 and converts 1 to 3)")
        notes.append(f"the notebook was converted from nbformat {version} to 4 before grading")
    elif not isinstance(raw, dict) or not isinstance(raw.get("cells"), list):
        return ReadNotebook(None, "not a notebook: JSON without a list of cells")
    try:
        nb = nbformat.reads(text, as_version=4)
    except Exception as error:  # nbformat raises schema, key and type errors alike
        return ReadNotebook(None, f"not a valid notebook: {_shorten(str(error).splitlines()[0])}")
    # Jupyter opens notebooks that bend the schema a little; so does the grader, where it can.
    if not isinstance(nb.get("cells"), list) or not isinstance(nb.get("metadata"), dict):
        return ReadNotebook(None, "not a valid notebook: no list of cells after conversion")
    for index, cell in enumerate(nb.cells):
        if (not isinstance(cell, dict) or cell.get("cell_type") not in ("code", "markdown", "raw")
                or not isinstance(cell.get("source"), str)):
            return ReadNotebook(None, f"not a valid notebook: cell {index + 1} has no cell_type "
                                      "or source")
        if not isinstance(cell.get("metadata"), dict):
            cell["metadata"] = nbformat.NotebookNode()
        if cell.cell_type == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return ReadNotebook(nb, None, notes)


def solution_chapters(solutions_dir: Path) -> dict[str, Path]:
    """Chapter -> its notebook in ``solutions_dir`` (metadata first, else the NN_ prefix)."""
    found: dict[str, Path] = {}
    for path in sorted(solutions_dir.glob("*.ipynb")):
        nb = read_notebook(path).nb
        chapter = chapter_of(nb, path)
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
            exercises.append(Exercise(grade_id(cell), nbgrader_metadata(cell)["points"],
                                      cell.source))
    given = {grade_id(cell): cell for cell in exercise_nb.cells if grade_id(cell) in protected}
    order = [grade_id(cell) for cell in nb.cells if grade_id(cell) is not None]
    return Canonical(path, exercises, protected, given, order)


def load_canonicals(solutions_dir: Path | str) -> dict[str, Canonical | str]:
    """Chapter -> its Canonical, or why it could not be loaded, for every notebook in
    ``solutions_dir``; read once, before any kernel starts."""
    loaded: dict[str, Canonical | str] = {}
    for chapter, path in solution_chapters(Path(solutions_dir)).items():
        try:
            loaded[chapter] = load_canonical(path)
        except GraderError as error:
            loaded[chapter] = str(error)
    return loaded


def _same_source(a: str, b: str) -> bool:
    def normalise(s):
        return [line.rstrip() for line in s.strip().splitlines()]
    return normalise(a) == normalise(b)


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

    A check cell whose nbgrader metadata was removed is found by its source instead; a deleted
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
        if gid in placed:
            flags.append(f"cell {index + 1} repeats the grade_id {gid} of cell {placed[gid] + 1}; "
                         "it ran as the student wrote it")
            continue
        if cell.cell_type != given.cell_type or not (_same_source(cell.source, given.source) or
                                                     _same_source(cell.source, original.source)):
            flags.append(f"{kind} cell {gid} (cell {index + 1}) was modified; the original was run")
        elif _grading_fields(cell) != _grading_fields(given):
            flags.append(f"{kind} cell {gid} (cell {index + 1}) had its nbgrader metadata changed "
                         f"({_grading_fields(cell)}); the original was run")
        nb.cells[index] = _fresh_copy(original)
        placed[gid] = index
    for exercise in canonical.exercises:
        if exercise.grade_id in placed:
            continue
        for index, cell in enumerate(nb.cells):
            if (cell.cell_type == "code" and grade_id(cell) not in canonical.protected
                    and index not in placed.values()
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
    exercise_ids = {e.grade_id for e in canonical.exercises}
    return Restored({g: i for g, i in placed.items() if g in exercise_ids}, flags, numbers)


def _order_and_duplicate_flags(nb, canonical: Canonical) -> list[str]:
    """Flags for solution cells that repeat a grade_id, and for known cells out of order."""
    flags, first_seen, sequence = [], {}, []
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
        sequence.append((rank[gid], gid, index))
    for (rank_a, gid_a, index_a), (rank_b, gid_b, index_b) in zip(sequence, sequence[1:]):
        if rank_b < rank_a:
            flags.append(f"cells are out of their original order: {gid_b} (cell {index_b + 1}) "
                         f"comes after {gid_a} (cell {index_a + 1})")
            break
    return flags


@dataclass
class Seal:
    """This run's secret for the sealed checks, and the nonce of each check cell."""

    key: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    name: str = field(default_factory=lambda: f"_course_attn_grading_{secrets.token_hex(8)}")
    nonces: dict[int, str] = field(default_factory=dict)  # check cell index -> nonce

    def preamble(self, key_file: Path, check_modules: tuple[str, ...]) -> str:
        return (f"from course_attn.grading.sealed import install\n"
                f"install({str(key_file)!r}, {self.name!r}, {list(check_modules)!r})\n"
                f"del install\n")


def seal_check_cells(nb, restored: Restored, canonical: Canonical, seal: Seal) -> None:
    """Wrap each placed check cell (in place) in the sealed check, with a fresh nonce."""
    for exercise in canonical.exercises:
        index = restored.placed.get(exercise.grade_id)
        if index is None:
            continue
        nonce = secrets.token_hex(16)
        seal.nonces[index] = nonce
        body = exercise.source if exercise.source.endswith("\n") else exercise.source + "\n"
        nb.cells[index].source = (f"check = {seal.name}.begin({nonce!r})\n{body}"
                                  f"{seal.name}.end({nonce!r})\n")


class _GradingClient(NotebookClient):
    """nbclient that sets the grading messages aside and keeps at most
    ``MAX_OUTPUT_CHARS_PER_CELL`` of a cell's other output."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.output_chars: dict[int, int] = {}
        self.sealed: dict[int, list] = {}

    def output(self, outs, msg, display_id, cell_index):
        content = msg.get("content", {})
        data = content.get("data")
        if isinstance(data, dict) and sealed.MIME_TYPE in data:
            if msg.get("msg_type") == "display_data":
                self.sealed.setdefault(cell_index, []).append(data[sealed.MIME_TYPE])
            return None
        size = len(str(content.get("text", ""))) + len(str(data or ""))
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
    """Kill the kernel and every process left in its process group (a dead kernel's too)."""
    group = getattr(km.provisioner, "pgid", None) if km.has_kernel else None
    try:
        if not km.has_kernel:
            return
        if await km.is_alive():
            await km.shutdown_kernel(now=True)
        else:
            await km.cleanup_resources()
    except Exception:  # the kernel is gone or going; nothing left to free that we can reach
        pass
    finally:
        if group and hasattr(os, "killpg") and group != os.getpgrp():
            try:
                os.killpg(group, signal.SIGKILL)
            except OSError:  # nobody left
                pass


def _limit_kernel_resources(memory_mb: int) -> None:
    """In the kernel's process, before it starts: no core dumps, at most ``memory_mb`` MiB of
    data (heap and private mappings); Linux counts every private anonymous mapping here."""
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if memory_mb:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


async def _run_preamble(km, kc, code: str, memory_mb: int) -> None:
    """Run the grader's preamble silently (no history, no execution count); GraderError if it
    fails or the kernel dies first."""
    msg_id = kc.execute(code, silent=True, store_history=False, allow_stdin=False)
    deadline = time.monotonic() + KERNEL_STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            msg = await kc.shell_channel.get_msg(timeout=1.0)
        except queue.Empty:
            if not await km.is_alive():
                break
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        content = msg["content"]
        if content.get("status") == "ok":
            return
        problem = f"{content.get('ename')}: {_shorten(str(content.get('evalue')), 300)}"
        if memory_mb and _OUT_OF_MEMORY.search(problem):
            problem += _MEMORY_HINT.format(memory_mb)
        raise GraderError(f"could not prepare the kernel for grading: {problem}")
    raise GraderError("could not prepare the kernel for grading: it died or did not answer"
                      + (_MEMORY_HINT.format(memory_mb) if memory_mb else ""))


_MEMORY_HINT = " (is the memory limit of {} MB too small? the kernel needs about 350 MB to " \
               "import torch)"


async def _exit_description(km: AsyncKernelManager) -> str:
    """How the kernel's process ended: ``SIGSEGV`` or ``exit status 1``; "" if unknown."""
    try:
        code = await km.provisioner.poll() if km.provisioner is not None else None
    except Exception:
        code = None
    if code is None:
        return ""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


async def execute_notebook(nb, workdir: Path, options: GradingOptions = GradingOptions(),
                           seal: Seal | None = None) -> list[CellRun]:
    """Run ``nb``'s code cells (in place) in a fresh kernel started in ``workdir``.

    With ``seal``, the kernel first runs the preamble that installs the sealed checks, its key
    passed in a file next to ``workdir``. Returns one CellRun per cell; raises GraderError only
    when no kernel could be started or prepared.
    """
    runs = [CellRun("skipped") for _ in nb.cells]
    # Unix sockets next to workdir where possible: no TCP port that another grader process
    # could take between choosing it and binding it.
    transport = {"transport": "ipc", "connection_file": str(workdir.parent / "kernel.json")} \
        if os.name == "posix" else {}
    km = AsyncKernelManager(kernel_name=KERNEL_NAME, **transport)
    log_path = workdir.parent / "kernel.log"
    with open(log_path, "wb") as kernel_log:
        try:
            try:
                launch = {}
                if hasattr(os, "fork"):  # POSIX: limits are set in the kernel's process
                    launch["preexec_fn"] = functools.partial(_limit_kernel_resources,
                                                             options.memory_mb)
                await km.start_kernel(cwd=str(workdir), stdout=kernel_log, stderr=kernel_log,
                                      extra_arguments=["--HistoryManager.hist_file=:memory:"],
                                      **launch)
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
                if seal is not None:
                    key_file = workdir.parent / f"key-{secrets.token_hex(8)}"
                    descriptor = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    with os.fdopen(descriptor, "wb") as file:
                        file.write(seal.key)
                    try:
                        await _run_preamble(km, kc, seal.preamble(key_file, options.check_modules),
                                            options.memory_mb)
                    finally:
                        key_file.unlink(missing_ok=True)
                await _run_cells(nb, km, kc, runs, options)
            finally:
                kc.stop_channels()
        finally:
            await _shutdown(km)
    return runs


async def _run_cells(nb, km, kc, runs: list[CellRun], options: GradingOptions) -> None:
    cell_timeout, notebook_timeout = options.cell_timeout, options.notebook_timeout
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
            how = await _exit_description(km)
            runs[index] = CellRun("died", evalue=how)
            stop = CellRun("not run", evalue=how, stopped_by="died", stopped_at=index)
            continue
        except Exception as error:  # the connection to the kernel broke; it is not usable now
            runs[index] = CellRun("error", "GraderError", str(error))
            stop = CellRun("not run", evalue=str(error), stopped_by="lost", stopped_at=index)
            continue
        reply = replies.get(index, {}).get("content", {})
        if reply.get("ename") == _TIMEOUT_ENAME:
            run = CellRun("timeout", limit_s=limit["s"], notebook_limit=limit["s"] < cell_timeout)
            if not await _kernel_answers(kc, INTERRUPT_GRACE_S):
                stop = CellRun("not run", stopped_by="stuck", stopped_at=index)
        elif reply.get("status") == "error":
            run = CellRun("error", str(reply.get("ename", "")), str(reply.get("evalue", "")))
        elif reply.get("status") == "ok":
            run = CellRun("ok")
        else:  # "aborted", or a reply a tampered kernel made up
            run = CellRun("error", "Aborted", f"the kernel replied {reply.get('status')!r}")
        run.sealed = client.sealed.get(index, [])
        run.dropped_chars = max(0, client.output_chars.get(index, 0) - MAX_OUTPUT_CHARS_PER_CELL)
        runs[index] = run


_SYNTAX_ERRORS = {"SyntaxError", "IndentationError", "TabError"}


def _shorten(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _out_of_memory(text: str, memory_mb: int) -> str | None:
    """"ran out of memory (...)" if ``text`` (an error) says so, else None."""
    if not _OUT_OF_MEMORY.search(text):
        return None
    return f"ran out of memory (the limit is {memory_mb} MB)" if memory_mb else \
        "ran out of memory"


def _explain_error(run: CellRun, where: str, label, in_your_code: bool, memory_mb: int) -> str:
    """Why a cell failed, in a sentence for the student. ``where``: that cell's label;
    ``label(index)``: any cell's."""
    if run.status == "timeout":
        text = f"timed out after {run.limit_s:.3g} s"
        if run.notebook_limit:
            text += " (the rest of the notebook's time limit)"
        return f"{text} in your code ({where})" if in_your_code else text
    if run.status == "died":
        how = f" ({run.evalue})" if run.evalue else ""
        return f"kernel died{how} while running {where}"
    if run.status == "not run":
        stopper = label(run.stopped_at)
        how = f" ({run.evalue})" if run.stopped_by == "died" and run.evalue else ""
        return {
            "died": f"kernel died{how} while running {stopper}",
            "stuck": f"not run: the kernel stopped responding after {stopper} ran out of time",
            "time limit": f"not run: the notebook's time limit of {run.limit_s:g} s was reached",
            "lost": f"not run: the grader lost the kernel in {stopper} ({run.evalue})",
        }[run.stopped_by]
    ename, evalue = run.ename, run.evalue
    memory = _out_of_memory(f"{ename}: {evalue}", memory_mb)
    if memory:
        return f"{memory} in your code ({where})" if in_your_code else memory
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


def _explain_report(report: dict, memory_mb: int) -> str:
    """Why a (signed) failed report failed; its case results are for the reason only."""
    results = report.get("results") if isinstance(report.get("results"), list) else []
    failed = [r for r in results if isinstance(r, dict) and not r.get("passed")]
    tampered = report.get("tampered") or []
    if tampered:
        return "the submission changed the grading code in the kernel: " + \
            _shorten(", ".join(map(str, tampered)), 160)
    called = next((r.get("reference_called") for r in failed if r.get("reference_called")), "")
    if called:
        return (f"calls {called}, the package's reference, instead of computing the answer "
                "itself")
    if failed and all(r.get("message") == NOT_IMPLEMENTED_MESSAGE for r in failed):
        return "not implemented"
    for r in failed:
        memory = _out_of_memory(str(r.get("message", "")), memory_mb)
        if memory:
            return f"{memory} in the check {str(r.get('name'))!r}"
    summary = f"{len(failed)} of {len(results)} checks failed"
    if failed:
        message = str(failed[0].get("message", ""))
        summary += f" (first: {failed[0].get('name')}: {_shorten(message, 160)})"
    return summary


@dataclass
class _Verdict:
    passed: bool
    reason: str
    flag: str = ""


def _judge(exercise: Exercise, index: int, run: CellRun, block: list[tuple[int, CellRun]],
           restored: Restored, seal: Seal, memory_mb: int) -> _Verdict:
    """Pass or fail, and why, for the check cell ``index`` of ``exercise``; ``block``: the
    student's cells since the previous check cell."""
    nonce = seal.nonces.get(index)
    authentic = [m for m in run.sealed
                 if sealed.is_authentic(seal.key, m) and m.get("nonce") == nonce]
    reports = [m for m in authentic if m.get("kind") == "report"]
    done = any(m.get("kind") == "done" and set(exercise.checked_names) <= set(m["exercises"])
               for m in authentic)
    where = f"{exercise.grade_id} ({restored.label(index)})"
    if run.status == "ok":
        if done:
            return _Verdict(True, "passed")
        return _Verdict(False, "the check cell reported success without the grader's signed "
                               "confirmation: the submission interfered with the kernel",
                        f"check cell {where} ran without error but its pass was not confirmed "
                        "by the sealed check: the submission interfered with the kernel")
    failed = [m for m in reports if m.get("passed") is not True]
    if run.status == "error" and failed:
        reason = _explain_report(failed[0], memory_mb)
        flag = f"{where}: {reason}" if failed[0].get("tampered") else ""
        return _Verdict(False, reason, flag)
    if run.status == "error" and reports and run.ename == "ExerciseFailed":  # from end()
        return _Verdict(False, _shorten(run.evalue, 200), f"{where}: {_shorten(run.evalue)}")
    if run.status == "error" and reports:
        detail = run.evalue if run.ename == "AssertionError" else f"{run.ename}: {run.evalue}"
        return _Verdict(False, f"a hidden test failed: {_shorten(detail, 160)}")
    if run.status == "error":
        if run.ename == "NotImplementedError":
            return _Verdict(False, "not implemented")
        if run.ename == "NameError":
            for i, earlier in block:
                if earlier.status in ("error", "timeout"):
                    return _Verdict(False, _explain_error(earlier, restored.label(i),
                                                          restored.label, True, memory_mb))
            return _Verdict(False, f"{_shorten(run.evalue, 120)} (missing function?)")
    return _Verdict(False, _explain_error(run, restored.label(index), restored.label, False,
                                          memory_mb))


def score_exercises(canonical: Canonical, restored: Restored, runs: list[CellRun], seal: Seal,
                    memory_mb: int = 0) -> tuple[list[ExerciseScore], list[str]]:
    """One ExerciseScore per canonical exercise, from the runs of the restored notebook, and the
    flags that the runs raise."""
    check_cells = sorted(restored.placed.values())
    scores, flags = [], []
    for exercise in canonical.exercises:
        index = restored.placed.get(exercise.grade_id)
        if index is None:
            scores.append(ExerciseScore(exercise.grade_id, 0, exercise.points, False,
                                        "check cell missing"))
            continue
        start = max([i for i in check_cells if i < index], default=-1) + 1
        block = [(i, runs[i]) for i in range(start, index)]
        verdict = _judge(exercise, index, runs[index], block, restored, seal, memory_mb)
        if verdict.flag:
            flags.append(verdict.flag)
        scores.append(ExerciseScore(exercise.grade_id, exercise.points if verdict.passed else 0,
                                    exercise.points, verdict.passed, verdict.reason))
    for index, run in enumerate(runs):
        if run.dropped_chars:
            flags.append(f"{restored.label(index)} printed {run.dropped_chars:,} characters more "
                         f"than the {MAX_OUTPUT_CHARS_PER_CELL:,} kept per cell")
    return scores, flags


def lookup_in(canonicals: dict[str, "Canonical | str"], solutions_dir: Path | str = "solutions"):
    """A chapter -> Canonical lookup over ``load_canonicals``' answer."""
    def lookup(chapter: str) -> Canonical:
        found = canonicals.get(chapter)
        if found is None:
            raise GraderError(f"no solutions notebook for chapter {chapter} in {solutions_dir}")
        if isinstance(found, str):
            raise GraderError(found)
        return found
    return lookup


async def grade_data(name: str, data: bytes | None, canonical_for, options: GradingOptions,
                     *, read_problem: str | None = None, path: str | None = None) -> NotebookGrade:
    """Grade the submitted bytes ``data`` of a file named ``name`` (reported as ``path``).

    ``canonical_for(chapter)`` returns that chapter's Canonical or raises GraderError;
    ``read_problem``: why the file could not be read (``data`` is then None).
    """
    started = time.monotonic()
    grade = NotebookGrade(path or name)
    read = ReadNotebook(None, read_problem) if data is None else \
        parse_notebook(data, Path(name).suffix)
    nb = read.nb
    grade.chapter = chapter_of(nb, name)
    grade.flags.extend(read.notes)
    canonical, missing = None, ""
    if grade.chapter is not None:
        try:
            canonical = canonical_for(grade.chapter)
        except GraderError as error:
            missing = str(error)
    if nb is None or canonical is None:
        if nb is not None and grade.chapter is None:
            read.problem = ("cannot tell which chapter this is: no course_attn.chapter in its "
                            "metadata and no NN_ prefix in its file name")
        grade.error = read.problem or missing
        grade.grader_error = read.problem is None
    else:
        restored = restore_protected_cells(nb, canonical)
        grade.flags.extend(restored.flags)
        seal = Seal()
        seal_check_cells(nb, restored, canonical, seal)
        with tempfile.TemporaryDirectory(prefix="course_attn_grade_",
                                         ignore_cleanup_errors=True) as tmp:
            workdir = Path(tmp) / "work"  # the kernel's working folder; the notebook stays
            workdir.mkdir()                 # in memory, so its nonces are not on disk
            try:
                runs = await execute_notebook(nb, workdir, options, seal)
                grade.exercises, run_flags = score_exercises(canonical, restored, runs, seal,
                                                             options.memory_mb)
                grade.flags.extend(run_flags)
            except GraderError as error:
                grade.error, grade.grader_error = str(error), True
    if canonical is not None and not grade.exercises:
        grade.exercises = [ExerciseScore(e.grade_id, 0, e.points, False,
                                         f"not graded: {grade.error}")
                           for e in canonical.exercises]
    grade.seconds = time.monotonic() - started
    return grade


async def _grade_file(path: Path, canonical_for, options: GradingOptions) -> NotebookGrade:
    try:
        data, problem = path.read_bytes(), None
    except OSError as error:
        data, problem = None, f"could not read the file: {error.strerror or error}"
    return await grade_data(path.name, data, canonical_for, options, read_problem=problem,
                            path=str(path))


async def _grade_all(paths, canonical_for, options, jobs, progress):
    slots = asyncio.Semaphore(max(1, jobs))

    async def one(path):
        async with slots:
            grade = await _grade_file(Path(path), canonical_for, options)
        if progress:
            print(f"graded {grade.path}: {grade.total:g} / {grade.max_points:g} "
                  f"({grade.seconds:.1f} s)", file=sys.stderr, flush=True)
        return grade

    return list(await asyncio.gather(*(one(p) for p in paths)))


def grade_notebooks(paths, *, solutions_dir: Path | str, cell_timeout: float = CELL_TIMEOUT_S,
                    notebook_timeout: float = NOTEBOOK_TIMEOUT_S, memory_mb: int = MEMORY_MB,
                    check_modules: tuple[str, ...] = (), jobs: int = 1,
                    progress: bool = False) -> list[NotebookGrade]:
    """Grade each file in ``paths`` (``jobs`` at a time, in this process); never raises for a
    bad submission. ``batch.grade_files`` does the same in worker processes."""
    options = GradingOptions(cell_timeout, notebook_timeout, memory_mb, tuple(check_modules))
    canonical_for = lookup_in(load_canonicals(solutions_dir), solutions_dir)
    return run_sync(_grade_all)(list(paths), canonical_for, options, jobs, progress)


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


def default_solutions_dir() -> Path:
    here = Path("solutions")
    return here if here.is_dir() else Path(__file__).resolve().parents[2] / "solutions"


def main(argv: list[str] | None = None) -> int:
    """``python -m course_attn.grade``; see ``batch.main``."""
    from .batch import main as batch_main
    return batch_main(argv)
