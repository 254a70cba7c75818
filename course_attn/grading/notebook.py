"""Reading a submission: its bytes (and the student's Python files beside it), read once, into
memory; bytes -> nbformat 4 (older versions converted), or the reason it is not one; and which
chapter it belongs to. The student's files are only ever read."""

import errno
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from .cells import grade_id


def shorten(text: str, limit: int = 200) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def chapter_from_name(path: Path | str) -> str | None:
    """``"03_masking.ipynb"`` -> ``"ch03"``; None without an ``NN_`` prefix."""
    match = re.match(r"(\d+)_", Path(path).name)
    return f"ch{int(match.group(1)):02d}" if match else None


def chapter_from_grade_ids(nb) -> str | None:
    """The one chapter that the cells' grade_ids name (``ch02-scores-solution`` -> ``"ch02"``),
    or None when they name none or several: a copy whose notebook metadata was dropped (a
    "Copy of 02_….ipynb") still says, cell by cell, which chapter it is."""
    named = {match.group(1) for cell in nb.cells
             if (match := re.match(r"(ch\d\d)-", grade_id(cell) or "")) is not None}
    return named.pop() if len(named) == 1 else None


def chapter_of(nb, path: Path | str) -> str | None:
    """Which chapter ``nb`` (read from ``path``) is: its ``course_attn.chapter`` metadata, else
    the chapter its grade_ids name, else its file name's ``NN_`` prefix."""
    meta = nb.metadata.get("course_attn") if nb is not None else None
    chapter = meta.get("chapter") if isinstance(meta, dict) else None
    if isinstance(chapter, str) and chapter:
        return chapter
    return (chapter_from_grade_ids(nb) if nb is not None else None) or chapter_from_name(path)


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
        return ReadNotebook(None, f"not a valid notebook: {shorten(str(error).splitlines()[0])}")
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


MAX_SUBMISSION_BYTES = 50 * 1024 * 1024


MAX_HELPER_FILES, MAX_HELPER_BYTES = 50, 1024 * 1024


@dataclass
class Submission:
    """One submitted file, read into memory. ``problem``: why it could not be read.
    ``helpers``: the Python files beside it (name -> bytes), which its kernel finds in its
    working folder, so that ``import my_helpers`` works as it did for the student."""

    path: Path
    student: str | None = None
    data: bytes | None = None
    problem: str | None = None
    sha256: str | None = None
    helpers: dict = field(default_factory=dict)


def read_helpers(folder: Path) -> dict[str, bytes]:
    """The ``*.py`` files of ``folder`` (at most MAX_HELPER_FILES, each at most
    MAX_HELPER_BYTES; links and larger files left out)."""
    found = {}
    for path in sorted(folder.glob("*.py"))[:MAX_HELPER_FILES]:
        try:
            if path.is_file() and not path.is_symlink() and \
                    path.stat().st_size <= MAX_HELPER_BYTES:
                found[path.name] = path.read_bytes()
        except OSError:
            continue
    return found


def read_submission(path: Path, student: str | None = None, *,
                    helpers: bool = True) -> Submission:
    """``path``'s bytes (at most MAX_SUBMISSION_BYTES), their SHA-256, and (with ``helpers``)
    the Python files beside it."""
    submission = Submission(path, student)
    try:
        # O_NOFOLLOW: a link is refused, not followed (to a classmate's file, or the solutions)
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as file:
            info = os.fstat(file.fileno())
            size = info.st_size
            if not stat.S_ISREG(info.st_mode):
                submission.problem = "not graded: not a regular file"
                return submission
            if size > MAX_SUBMISSION_BYTES:
                submission.problem = (f"not graded: the file has {size:,} bytes, more than the "
                                      f"{MAX_SUBMISSION_BYTES:,} a notebook may have")
                return submission
            submission.data = file.read(MAX_SUBMISSION_BYTES + 1)
    except OSError as error:
        if error.errno == errno.ELOOP:
            submission.problem = ("not graded: the file is a symbolic link; submit the notebook "
                                  "itself")
            return submission
        submission.problem = f"could not read the file: {error.strerror or error}"
        return submission
    submission.sha256 = hashlib.sha256(submission.data).hexdigest()
    if helpers:
        submission.helpers = read_helpers(path.parent)
    return submission
