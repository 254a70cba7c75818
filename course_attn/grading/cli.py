"""The command line: ``python -m course_attn.grade``.

``python -m course_attn.grade PATH... [--json REPORT.json]`` grades notebooks (or the ``*.ipynb``
of a folder) and prints a table; ``python -m course_attn.grade SUBMISSIONS --gradebook OUT``
grades a class (``batch.py``); ``python -m course_attn.grade export gradescope|nbgrader OUT``
builds a Gradescope autograder or an nbgrader course (``export.py``). Reports are written only
after every process the submissions started is gone, and atomically. Exit status: 0 when every
notebook was graded (whatever the scores), 1 when the grader itself could not grade one, 2 for
a usage error, 130 on Ctrl-C.
"""

import argparse
import os
import sys
from pathlib import Path

from . import grader, processes, sandbox
from .batch import format_class_table, grade_class, grade_files, gradebook_paths, read_submission
from .grader import GradingOptions
from .report import format_table, report, write_json


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


def module_folders(modules) -> tuple[str, ...]:
    """The folders the kernels need on their PYTHONPATH to import ``modules`` as this process
    does (a check module that the solution notebooks' setup cells import), and nothing else:
    not this process's working folder, which may hold ``solutions/``."""
    import importlib.util
    folders: list[str] = []
    for name in modules:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.origin or not Path(spec.origin).is_file():
            continue
        root = Path(spec.origin).resolve().parent
        for _ in range(name.count(".") + (spec.submodule_search_locations is not None)):
            root = root.parent
        if str(root) not in folders and root != PACKAGE_ROOT and root not in _default_path():
            folders.append(str(root))
    return tuple(folders)


def _default_path() -> set[Path]:
    """The standard library's and site-packages' folders, which every kernel has anyway."""
    import sysconfig
    return {Path(p).resolve() for p in sysconfig.get_paths().values()}


PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # where course_attn itself lives


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m course_attn.grade",
        description="Grade exercise notebooks: each runs in a fresh kernel, on a copy, with "
                    "time and memory limits. With --gradebook, grade a whole class.",
        epilog="python -m course_attn.grade export gradescope|nbgrader OUT packs this grader "
               "for Gradescope or nbgrader (export --help).")
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="a notebook, or a folder of notebooks (*.ipynb); with --gradebook, "
                             "the one folder of submissions (a file or a folder per student)")
    parser.add_argument("--gradebook", type=Path, metavar="OUT",
                        help="grade the class in PATH and write OUT.csv and OUT.json")
    parser.add_argument("--json", type=Path, metavar="REPORT.json",
                        help="without --gradebook: also write a machine-readable report here")
    parser.add_argument("--timeout", type=float, default=grader.CELL_TIMEOUT_S,
                        metavar="SECONDS",
                        help=f"time limit per cell (default {grader.CELL_TIMEOUT_S:g})")
    parser.add_argument("--notebook-timeout", type=float, default=grader.NOTEBOOK_TIMEOUT_S,
                        metavar="SECONDS",
                        help=f"time limit per notebook (default {grader.NOTEBOOK_TIMEOUT_S:g})")
    parser.add_argument("--memory-mb", type=int, default=grader.MEMORY_MB, metavar="MB",
                        help="memory limit of each notebook's kernel, in MiB (RLIMIT_DATA; "
                             f"default {grader.MEMORY_MB}; 0: none)")
    parser.add_argument("--workers", "--jobs", type=int, default=os.cpu_count() or 1,
                        metavar="N", help="grade N notebooks at a time, in worker processes "
                                          "(default: one per CPU)")
    parser.add_argument("--solutions", type=Path, metavar="DIR",
                        help="folder of solution notebooks (default: ./solutions, else the "
                             "repository's)")
    parser.add_argument("--no-sandbox", action="store_true",
                        help="run the kernels without the operating-system sandbox (bubblewrap): "
                             "a submission can then reach the grader, the solutions and the "
                             "other kernels; every report records it")
    parser.add_argument("--all-or-nothing", action="store_true",
                        help="an exercise earns its points only when every case passes (default: "
                             "each regime of its hidden cases that it passes earns its share); "
                             "every report says which rule was used")
    parser.add_argument("--checks-module", action="append", default=[], metavar="MODULE",
                        help="a module that registers exercises outside course_attn.grading, "
                             "imported by the grader (repeatable)")
    return parser


def _validate(args) -> None:
    if args.timeout <= 0 or args.notebook_timeout <= 0:
        raise ValueError("--timeout and --notebook-timeout must be positive")
    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    if args.memory_mb != 0 and args.memory_mb < 256:
        raise ValueError(f"--memory-mb must be 0 (no limit) or at least 256, got "
                         f"{args.memory_mb}: the kernel alone needs about 350 MB")
    if not args.solutions.is_dir():
        raise ValueError(grader.missing_solutions(args.solutions))
    if not args.no_sandbox and sandbox.unavailable():
        raise ValueError(f"{sandbox.unavailable()}; or grade without it: --no-sandbox (only "
                         "for work you trust)")
    if args.gradebook is not None:
        if args.json is not None:
            raise ValueError("--json is for single notebooks; --gradebook writes OUT.json")
        if len(args.paths) != 1 or not Path(args.paths[0]).is_dir():
            raise ValueError("--gradebook grades one folder of submissions: give exactly one "
                             "folder")
        if not args.gradebook.resolve().parent.is_dir():
            raise ValueError(f"folder of --gradebook {args.gradebook} does not exist")
    elif args.json is not None and not args.json.resolve().parent.is_dir():
        raise ValueError(f"folder of --json {args.json} does not exist")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:  # python -m course_attn.grade export gradescope|nbgrader OUT
        from .export import main as export_main
        return export_main(argv[1:])
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("\ninterrupted: nothing was written", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    processes.become_subreaper()  # orphans of the kernels come back to us, to be killed
    children = processes.children()
    args.solutions = args.solutions or grader.default_solutions_dir()
    try:
        _validate(args)
        paths = None if args.gradebook is not None else _collect(args.paths)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    options = GradingOptions(args.timeout, args.notebook_timeout, args.memory_mb,
                             tuple(args.checks_module),
                             extra_path=module_folders(args.checks_module),
                             sandbox=not args.no_sandbox, all_or_nothing=args.all_or_nothing)
    if args.gradebook is not None:
        book = grade_class(Path(args.paths[0]), args.gradebook, solutions_dir=args.solutions,
                           options=options, workers=args.workers)
        print(format_class_table(book))
        csv_path, json_path = gradebook_paths(args.gradebook)
        print(f"{len(book['students'])} students graded in {book['seconds']:g} s; wrote "
              f"{csv_path} and {json_path}")
        for path in book["integrity"]["changed_during_grading"]:
            print(f"warning: {path} changed on disk while grading; a submission may have "
                  "written it: do not trust these grades", file=sys.stderr)
        return 1 if book["grader_errors"] else 0
    canonicals = grader.prepare(args.solutions, options.check_modules)
    submissions = [read_submission(path) for path in paths]
    grades = grade_files(submissions, canonicals, options, workers=args.workers,
                         solutions_dir=str(args.solutions))
    killed = processes.kill_new_children(children)
    if killed:
        print(f"killed {killed} process(es) that submissions left running", file=sys.stderr)
    print(format_table(grades))
    if args.json is not None:
        write_json(args.json, report(grades))
    return 1 if any(g.grader_error for g in grades) else 0
