"""The first cell of every notebook: install ``course_attn`` when running in Google Colab.

The repository comes from ``_config.yml`` (``repository.url`` and ``repository.branch``), the same
place the book's "open in Colab" links come from. ``python -m course_attn.colab`` writes the cell
into every notebook of book/, solutions/ and exercises/ (an exercise that was a fresh generation
of its solution is generated again, so ``generate --check`` keeps passing; one that holds a
student's work gets only its first cell); a test fails when a notebook's first cell differs from
what the config says.

Where the package was installed without the repository (Colab, ``pip install``), the repository
is the one pip recorded: ``a_clone_of_the_course`` says where the grader runs (it needs the
solutions, which the package does not carry).
"""

import argparse
import json
import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "# Running in Google Colab?"
FOLDERS = ("book", "solutions", "exercises")


def repository(config: Path = ROOT / "_config.yml") -> tuple[str, str]:
    """(url, branch) of the course repository, read from the book's ``_config.yml``."""
    text = config.read_text(encoding="utf-8")
    block = re.search(r"^repository:\n((?:[ \t]+.*\n?)+)", text, re.M)
    if not block:
        raise ValueError(f"{config} has no 'repository:' section")
    fields = dict(re.findall(r"^\s+(\w+):\s*(\S+)", block.group(1), re.M))
    if "url" not in fields:
        raise ValueError(f"{config}: 'repository:' has no url")
    return fields["url"], fields.get("branch", "main")


def installed_from() -> tuple[str, str] | None:
    """(url, revision) of the git repository pip installed ``course_attn`` from, as pip recorded
    it (PEP 610's ``direct_url.json``); None for any other install."""
    try:
        text = metadata.distribution("course_attn").read_text("direct_url.json")
        record = json.loads(text) if text else {}
    except (metadata.PackageNotFoundError, ValueError):
        return None
    vcs = record.get("vcs_info")
    if not vcs or vcs.get("vcs") != "git" or not record.get("url"):
        return None
    return record["url"], vcs.get("requested_revision") or vcs.get("commit_id") or "main"


def course_repository(root: Path = ROOT) -> tuple[str, str] | None:
    """(url, branch) of the course: this checkout's ``_config.yml``, else the git repository pip
    installed the package from, else None (unknown)."""
    config = root / "_config.yml"
    return repository(config) if config.is_file() else installed_from()


def a_clone_of_the_course(root: Path = ROOT) -> str:
    """Where the grader runs, in words: "a clone of URL" (and its branch, unless main)."""
    where = course_repository(root)
    if where is None:
        return "a clone of the course repository"
    url, branch = where
    return f"a clone of {url}" + ("" if branch == "main" else f" (branch {branch})")


def in_colab() -> bool:
    return "google.colab" in sys.modules


def grading_note() -> str:
    """One line for ``check()`` in Colab: it gives feedback; the grade comes from the grader,
    which runs in a clone of the repository (it needs the solutions, which Colab lacks)."""
    return ("check() gives feedback only; the grade comes from `python -m course_attn.grade "
            f"NOTEBOOK` in {a_clone_of_the_course()}")


_told = []  # the notes already printed in this process


def tell_where_the_grader_runs() -> None:
    """Print ``grading_note()`` the first time ``check()`` runs in Colab; elsewhere nothing."""
    if in_colab() and not _told:
        _told.append(grading_note())
        print(_told[0])


def colab_cell_source(url: str, branch: str) -> str:
    return (
        f"{MARK} Install the course's package first; anywhere else this cell does nothing.\n"
        "import sys\n"
        "\n"
        'if "google.colab" in sys.modules:\n'
        f'    %pip install --quiet "course_attn @ git+{url}@{branch}"'
    )


def has_colab_cell(nb) -> bool:
    first = nb.cells[0] if nb.cells else None
    return first is not None and first.cell_type == "code" and first.source.startswith(MARK)


def stamp(path: Path, source: str) -> bool:
    """Make ``source`` the first cell of the notebook at ``path``; True if the file changed."""
    # imported here: a graded kernel imports this module (check() tells where the grader runs),
    # and nbformat's schema validators cost it a second per notebook graded
    import nbformat

    nb = nbformat.read(path, as_version=4)
    if has_colab_cell(nb):
        if nb.cells[0].source == source:
            return False
        nb.cells[0].source = source
    else:
        cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["remove-cell"]})
        cell.id = "colab-install"
        nb.cells.insert(0, cell)
    nbformat.write(nb, path)
    return True


def stamp_exercises(solutions: Path, exercises: Path, source: str) -> list[Path]:
    """Stamp the solutions in ``solutions`` and the exercises in ``exercises`` with ``source``:
    an exercise that was a fresh generation of its solution is generated again (so it stays
    one), any other one (a student's work, a stale file) gets only its first cell rewritten.
    Returns the files changed."""
    # imported here: the grading package's check() imports this module
    from .grading.generate import expected_exercises

    fresh = {path for path, text in expected_exercises(solutions, exercises).items()
             if path.is_file() and path.read_bytes() == text.encode("utf-8")}
    changed = [path for path in sorted(solutions.glob("*.ipynb")) if stamp(path, source)]
    regenerated = expected_exercises(solutions, exercises)
    for path in sorted(exercises.glob("*.ipynb")):
        if path in fresh:
            text = regenerated[path].encode("utf-8")
            if path.read_bytes() != text:
                path.write_bytes(text)
                changed.append(path)
        elif stamp(path, source):
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, metavar="DIR",
                        help="the course repository, whose _config.yml and "
                             f"{', '.join(FOLDERS)} are read and rewritten (default: {ROOT})")
    args = parser.parse_args(argv)
    try:
        for folder in FOLDERS:
            if not (args.root / folder).is_dir():
                raise ValueError(f"--root {args.root} has no {folder}/ folder")
        source = colab_cell_source(*repository(args.root / "_config.yml"))
        changed = stamp_exercises(args.root / "solutions", args.root / "exercises", source)
        changed += [path for path in sorted((args.root / "book").glob("*.ipynb"))
                    if stamp(path, source)]
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for path in changed:
        print(f"rewrote {path.relative_to(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
