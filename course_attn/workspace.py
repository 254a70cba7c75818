"""A student's own copies of the exercises, in ``work/``: ``python -m course_attn.workspace 03``.

``exercises/`` belongs to the course: ``make exercises`` regenerates it from ``solutions/``, and a
``git pull`` may change it. ``work/`` belongs to the student: git ignores it, and no command of
the project writes there except this one, which only ever adds a notebook that is not there yet.

``python -m course_attn.workspace 03`` copies ``exercises/03_*.ipynb`` to ``work/``;
``python -m course_attn.workspace exercises/03_masking.ipynb`` copies that file (for example an
exercise notebook filled in before ``work/`` existed). An existing copy is never overwritten.
Paths are relative to the current folder, the course's root (``make work CH=03`` runs it there).
"""

import argparse
import sys
from pathlib import Path

EXERCISES = Path("exercises")
WORK = Path("work")


def find_exercise(chapter: str, exercises_dir: Path = EXERCISES) -> Path:
    """The exercise notebook of ``chapter`` ("3", "03", "03_masking" or "masking").

    ``ValueError`` naming the chapters there when none, or more than one, matches.
    """
    if not exercises_dir.is_dir():
        raise ValueError(f"no folder {exercises_dir}/ here: run this from the course's folder")
    available = sorted(exercises_dir.glob("[0-9][0-9]_*.ipynb"))
    key = chapter.strip().removesuffix(".ipynb")
    if key.isdigit():
        key = f"{int(key):02d}_"
    matches = [path for path in available
               if path.stem.startswith(key) or path.stem.partition("_")[2] == key]
    if len(matches) == 1:
        return matches[0]
    problem = "matches more than one" if matches else "matches no"
    names = ", ".join(path.stem for path in available) or "none"
    raise ValueError(f"{chapter!r} {problem} exercise notebook in {exercises_dir}/ "
                     f"(there: {names})")


def copy_to_work(source: Path, work_dir: Path = WORK) -> Path:
    """Copy notebook ``source`` into ``work_dir`` under its own name; returns the copy's path.

    ``FileExistsError`` when ``work_dir`` already holds a file of that name: it is the student's
    work, and it is left as it is.
    """
    data = source.read_bytes()
    target = work_dir / source.name
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        with target.open("xb") as f:  # "x": create, or fail if it exists, in one step
            f.write(data)
    except FileExistsError:
        raise FileExistsError(
            f"{target} already exists: it is your work, so nothing was copied. Open it with "
            "`make lab`; to start over from a blank exercise, rename or delete it first."
        ) from None
    return target


def notebook_to_copy(argument: str, exercises_dir: Path = EXERCISES) -> Path:
    """The notebook that ``argument`` names: the path of a notebook, or a chapter."""
    path = Path(argument)
    if path.is_file():
        return path
    if len(path.parts) > 1:
        raise ValueError(f"no such notebook: {argument}")
    return find_exercise(argument, exercises_dir)


def main(argv: list[str] | None = None) -> int:
    """The command line; exit status 0 (copied), 1 (a copy already exists) or 2 (bad input)."""
    parser = argparse.ArgumentParser(
        prog="python -m course_attn.workspace",
        description="Copy an exercise notebook into work/, your own folder, which no command of "
                    "the course overwrites. Refuses to replace a copy that is already there.")
    parser.add_argument("exercise", metavar="CHAPTER|NOTEBOOK",
                        help="a chapter number such as 03 (copies exercises/03_*.ipynb), or the "
                             "path of a notebook to copy")
    parser.add_argument("--exercises", type=Path, default=EXERCISES, metavar="DIR",
                        help="where the chapters' exercise notebooks are (default: exercises)")
    parser.add_argument("--work", type=Path, default=WORK, metavar="DIR",
                        help="your folder, where the copy goes (default: work)")
    args = parser.parse_args(argv)
    try:
        source = notebook_to_copy(args.exercise, args.exercises)
        copy = copy_to_work(source, args.work)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except FileExistsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"copied {source} to {copy}: it is yours, and no command of the course overwrites "
          f"it.\nOpen it with `make lab`; grade it with `make grade NB={copy}`.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
