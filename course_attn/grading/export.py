"""The course's grader, packed for the graders instructors already run: a Gradescope autograder
and an nbgrader course folder.

``python -m course_attn.grade export gradescope OUT.zip [--no-sandbox] [--visibility V]``
    An autograder zip: ``setup.sh`` (bubblewrap and a virtual environment with the course's
    requirements), ``run_autograder`` and ``course/`` (the package, ``solutions/`` and
    ``solutions/hidden/``, the requirements), so that it grades offline. For each submission
    ``run_autograder`` runs ``python -m course_attn.grade`` on the uploaded notebooks, sandbox
    and hidden cases included, and turns its JSON report into Gradescope's ``results.json``:
    one test per exercise, its output the grader's reason and hint.
``python -m course_attn.grade export nbgrader OUT``
    An nbgrader course folder: ``nbgrader_config.py``, ``source/<assignment>/`` (one assignment
    per chapter, its solution notebook) whose check cells end with a hidden test calling
    ``autograde_check``, and ``hidden/`` (the hidden cases). ``nbgrader generate_assignment``
    makes the release, ``nbgrader autograde`` grades; see book/instructors.md.
``python -m course_attn.grade export gradescope-autograde ROOT [--no-sandbox] [--visibility V]``
    What ``run_autograder`` runs: grade ``ROOT/submission/`` and write
    ``ROOT/results/results.json`` (ROOT: Gradescope's ``/autograder``).
"""

import argparse
import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import nbformat

from .check import ExerciseFailed, run_exercise
from .exercise import get, hidden_cases, load_hidden
from .generate import grade_id
from .report import write_json

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # course_attn/
REPOSITORY = PACKAGE_DIR.parent
VISIBILITIES = ("visible", "after_published", "after_due_date", "hidden")
# Where the grader needs them besides the package's own dependencies: chapter 9's Triton exercise
EXTRA_REQUIREMENTS = ("triton",)
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")

SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, as root, while it builds the autograder's image (choose the
# Ubuntu 24.04 base image: its Python 3.12 is one the course is tested with).
set -euo pipefail
apt-get update
apt-get install -y --no-install-recommends python3 python3-venv python3-pip bubblewrap
python3 -m venv /autograder/venv
# PyTorch's CPU build (about 2.3 GB installed; PyPI's default Linux wheel is the CUDA build,
# about 5.5 GB): Gradescope's machines have no GPU.
/autograder/venv/bin/pip install --no-cache-dir --extra-index-url {cpu_index} \\
    -r /autograder/source/course/requirements.txt
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for every submission: grade the notebooks in $ROOT/submission with
# course_attn's grader and write $ROOT/results/results.json. AUTOGRADER_ROOT and
# AUTOGRADER_PYTHON let a test run it outside Gradescope.
set -euo pipefail
ROOT="$(cd "${{AUTOGRADER_ROOT:-/autograder}}" && pwd)"
PYTHON="${{AUTOGRADER_PYTHON:-$ROOT/venv/bin/python}}"
COURSE="$ROOT/source/course"
export PYTHONPATH="$COURSE"
cd "$COURSE"
exec "$PYTHON" -m course_attn.grade export gradescope-autograde "$ROOT" {options}
"""

NBGRADER_CONFIG = """# nbgrader's configuration of this course folder
# (written by python -m course_attn.grade export nbgrader).
c = get_config()  # noqa: F821 (nbgrader defines it)
c.CourseDirectory.root = {root!r}
c.CourseDirectory.course_id = "course_attn"
# Each check cell runs the exercise's public and hidden cases, as python -m course_attn.grade
# does: give a notebook the grader's time (seconds per cell).
c.ExecutePreprocessor.timeout = 300
"""

HIDDEN_TEST = """
### BEGIN HIDDEN TESTS
from course_attn.grading.export import autograde_check
autograde_check({key!r}, {answer})
### END HIDDEN TESTS"""


# --- the command line -----------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m course_attn.grade export",
        description="Pack the course's grader for Gradescope or nbgrader.")
    commands = parser.add_subparsers(dest="target", required=True, metavar="TARGET")
    gradescope = commands.add_parser(
        "gradescope", help="write a Gradescope autograder zip to OUT")
    gradescope.add_argument("out", type=Path, metavar="OUT", help="the zip to write")
    autograde = commands.add_parser(
        "gradescope-autograde", help="grade ROOT/submission and write ROOT/results/results.json "
                                     "(what the autograder's run_autograder runs)")
    autograde.add_argument("root", type=Path, metavar="ROOT", help="Gradescope's /autograder")
    for sub in (gradescope, autograde):
        sub.add_argument("--visibility", choices=VISIBILITIES, default="visible",
                         help="when students see each exercise's score and reason (default: "
                              "visible, at once)")
        sub.add_argument("--no-sandbox", action="store_true",
                         help="grade without bubblewrap, where Gradescope's container cannot "
                              "run it: the submission can then read the hidden cases")
    nbgrader = commands.add_parser("nbgrader", help="write an nbgrader course folder to OUT")
    nbgrader.add_argument("out", type=Path, metavar="OUT", help="the course folder to write")
    for sub in (gradescope, nbgrader):
        sub.add_argument("--solutions", type=Path, default=None, metavar="DIR",
                         help="the course's solution notebooks, with hidden/ (default: "
                              "./solutions, else the repository's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.target == "gradescope-autograde":
        return gradescope_autograde(args.root, visibility=args.visibility,
                                    sandbox=not args.no_sandbox)
    from .grader import default_solutions_dir
    solutions = args.solutions or default_solutions_dir()
    try:
        if not (solutions / "hidden").is_dir():
            raise ValueError(f"--solutions {solutions} has no hidden/ folder: the export needs "
                             "the course's solutions/ with its hidden cases")
        if not args.out.resolve().parent.is_dir():
            raise ValueError(f"folder of OUT {args.out} does not exist")
        if args.target == "gradescope":
            if args.out.suffix != ".zip":
                raise ValueError(f"OUT must end in .zip, got {args.out}")
            write_gradescope_autograder(args.out, solutions, visibility=args.visibility,
                                        sandbox=not args.no_sandbox)
        else:
            if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
                raise ValueError(f"OUT {args.out} exists and is not an empty folder")
            write_nbgrader_course(args.out, solutions)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


# --- Gradescope -----------------------------------------------------------------------------

def grading_requirements(repository: Path = REPOSITORY) -> str:
    """The lines of the course's requirements.txt that grading needs: the package's own
    dependencies (pyproject.toml) and Triton, with the course's pins; not the book's, the lab's
    or the tests' (about 1 GB less to install)."""
    def name(requirement: str) -> str:
        for stop in "=<>!~[;@ ":
            requirement = requirement.split(stop)[0]
        return requirement.strip().lower().replace("_", "-")

    import tomllib  # Python 3.11+: only the export needs it, not a kernel's autograde_check
    project = tomllib.loads((repository / "pyproject.toml").read_text())["project"]
    needed = {name(r) for r in project["dependencies"]} | set(EXTRA_REQUIREMENTS)
    lines = [line.strip() for line in (repository / "requirements.txt").read_text().splitlines()]
    kept = [line for line in lines if line and not line.startswith(("#", "-"))
            and name(line) in needed]
    missing = needed - {name(line) for line in kept}
    return "\n".join(kept + sorted(missing)) + "\n"


def write_gradescope_autograder(out: Path, solutions: Path, *, visibility: str = "visible",
                                sandbox: bool = True) -> None:
    """Write the autograder zip ``out``: ``setup.sh``, ``run_autograder`` and ``course/``
    (package, ``solutions/`` with ``hidden/``, ``requirements.txt``) at its root, as Gradescope
    unpacks it into ``/autograder/source``."""
    options = f"--visibility {visibility}" + ("" if sandbox else " --no-sandbox")
    with tempfile.TemporaryDirectory() as staging:
        course = Path(staging) / "course"
        shutil.copytree(PACKAGE_DIR, course / "course_attn", ignore=_IGNORED)
        shutil.copytree(solutions, course / "solutions", ignore=_IGNORED)
        (course / "requirements.txt").write_text(grading_requirements())
        temporary = out.with_name(f".{out.name}.part")
        with zipfile.ZipFile(temporary, "w", zipfile.ZIP_DEFLATED) as archive:
            for name, text in (("setup.sh", SETUP_SH.format(cpu_index=CPU_TORCH_INDEX)),
                               ("run_autograder", RUN_AUTOGRADER.format(options=options))):
                entry = zipfile.ZipInfo(name, date_time=time.localtime()[:6])
                entry.external_attr = (stat.S_IFREG | 0o755) << 16
                entry.compress_type = zipfile.ZIP_DEFLATED
                archive.writestr(entry, text)
            for path in sorted(course.rglob("*")):
                if path.is_file():
                    archive.write(path, path.relative_to(staging))
        os.replace(temporary, out)


def submitted_notebooks(submission: Path) -> list[Path]:
    """The notebooks a student uploaded (in folders too), checkpoints left out."""
    return sorted(p for p in submission.rglob("*.ipynb")
                  if ".ipynb_checkpoints" not in p.relative_to(submission).parts)


def gradescope_results(report: dict, submission: Path, *, visibility: str = "visible") -> dict:
    """Gradescope's results.json made of the grader's JSON report (``report.report``): one
    test per exercise (name: its key as the check cells show it, ``ch03.causal_mask``,
    prefixed by the notebook when several were uploaded; output: the grader's reason, hint
    included), a test of 0 points for a notebook that could not be graded, and the flags and
    sandbox in the top-level output."""
    notebooks = report["notebooks"]
    tests, notes = [], []
    for notebook in notebooks:
        path = Path(notebook["path"])
        shown = str(path.relative_to(submission)) if path.is_relative_to(submission) else \
            path.name
        prefix = f"{shown}: " if len(notebooks) > 1 else ""
        if notebook["error"]:
            tests.append({"name": f"{prefix}the notebook", "score": 0.0, "max_score": 0.0,
                          "output": notebook["error"], "visibility": visibility,
                          "status": "failed"})
        for exercise in notebook["exercises"]:
            name = exercise.get("exercise", exercise["grade_id"])  # older reports: grade_id
            tests.append({"name": prefix + name,
                          "score": float(exercise["points"]),
                          "max_score": float(exercise["max_points"]),
                          "output": exercise["reason"], "visibility": visibility,
                          "status": "passed" if exercise["passed"] else "failed"})
        notes += [f"{shown}: {flag}" for flag in notebook["flags"]]
        notes += [f"{shown}: {note}" for note in notebook.get("notes", [])]  # older: none
        if notebook["grader_error"]:
            notes.append(f"{shown}: the grader could not grade it; ask your instructor to regrade")
        notes.append(f"{shown}: {notebook['total']:g} / {notebook['max']:g} "
                     f"(sandbox: {notebook['sandbox'] or 'none'})")
    return {"score": float(report["total"]), "output": "\n".join(notes), "tests": tests,
            "visibility": visibility, "stdout_visibility": "hidden"}


def gradescope_autograde(root: Path, *, visibility: str = "visible", sandbox: bool = True) -> int:
    """Grade the notebooks in ``root/submission`` with ``python -m course_attn.grade`` and write
    ``root/results/results.json``. Returns 0 when it was written; 1, with the grader's error
    printed and no results.json, when the grader itself failed (Gradescope then shows the
    autograder as failed, and the instructor can rerun it)."""
    root = root.resolve()
    submission, results = root / "submission", root / "results" / "results.json"
    notebooks = submitted_notebooks(submission)
    if not notebooks:
        write_json(results, {"score": 0.0, "tests": [], "output": (
            "no notebook (.ipynb) in the submission: upload your exercise notebook, such as "
            "03_masking.ipynb")})
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        report_path = Path(scratch) / "report.json"
        solutions = root / "source" / "course" / "solutions"
        command = [sys.executable, "-m", "course_attn.grade", *map(str, notebooks),
                   "--json", str(report_path), "--solutions", str(solutions)]
        done = subprocess.run(command + ([] if sandbox else ["--no-sandbox"]),
                              capture_output=True, text=True)
        print(done.stdout, end="")
        print(done.stderr, end="", file=sys.stderr)
        if not report_path.exists():
            print(f"error: the grader wrote no report (exit status {done.returncode})",
                  file=sys.stderr)
            return 1
        report = json.loads(report_path.read_text())
    write_json(results, gradescope_results(report, submission, visibility=visibility))
    return 0


# --- nbgrader -------------------------------------------------------------------------------

def write_nbgrader_course(out: Path, solutions: Path) -> None:
    """Write an nbgrader course folder at ``out``: ``source/<stem>/<stem>.ipynb`` for each
    solution notebook, each check cell followed by a hidden test (``autograde_check``),
    ``hidden/`` (the hidden cases) and ``nbgrader_config.py``."""
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(solutions.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if not cell.get("metadata", {}).get("nbgrader", {}).get("grade"):
                continue
            key = _checked_key(cell)
            if key is None:  # check() passes an unanswered exercise: nbgrader would too
                raise ValueError(f"graded cell {grade_id(cell)} of {path} is not one "
                                 "check(\"key\", answer) call: no hidden test can follow it")
            answer = cell.source.split(",", 1)[1].rsplit(")", 1)[0].strip()
            cell.source = cell.source.rstrip() + HIDDEN_TEST.format(key=key, answer=answer)
        folder = out / "source" / path.stem
        folder.mkdir(parents=True)
        nbformat.write(nb, folder / path.name)
    shutil.copytree(solutions / "hidden", out / "hidden", ignore=_IGNORED)
    (out / "nbgrader_config.py").write_text(NBGRADER_CONFIG.format(root=str(out.resolve())))


def _checked_key(cell) -> str | None:
    """The exercise key of a graded cell that is one ``check("key", answer)`` call, else None."""
    info = cell.get("metadata", {}).get("nbgrader", {})
    source = cell.get("source", "").strip()
    if not (info.get("grade") and grade_id(cell) and source.startswith("check(")
            and source.endswith(")") and "\n" not in source and "," in source):
        return None
    return source[len("check("):].split(",", 1)[0].strip().strip("\"'")


def course_folder(start: Path) -> Path:
    """The nbgrader course folder (the one with nbgrader_config.py and hidden/) at or above
    ``start``, where nbgrader runs a notebook (autograded/<student>/<assignment>/)."""
    for folder in (start, *start.parents):
        if (folder / "nbgrader_config.py").is_file() and (folder / "hidden").is_dir():
            return folder
    raise FileNotFoundError(f"no nbgrader course folder (nbgrader_config.py and hidden/) at or "
                            f"above {start}")


def autograde_check(key: str, answer) -> None:
    """nbgrader's hidden test of exercise ``key``: the public cases and hidden ones drawn with a
    fresh seed, judged as the grader judges them; raises ExerciseFailed (0 points) unless every
    case passes, an unanswered exercise included."""
    load_hidden(course_folder(Path.cwd()))
    exercise = get(key)
    cases = exercise.public_cases() + hidden_cases(key, secrets.randbits(48))
    judgement = run_exercise(exercise, answer, cases)
    if not judgement.passed:
        raise ExerciseFailed(f"{key}: {judgement.reason()}")
