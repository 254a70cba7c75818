"""``python -m course_attn.colab`` on a fork, and what a Colab or pip user is told about the
grader (which needs the course's solutions/, which the package does not carry)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_attn import colab
from course_attn.colab import FOLDERS, colab_cell_source, repository
from course_attn.grading import generate, grader

ROOT = Path(__file__).resolve().parents[1]
FORK = ("https://github.com/a-student/course_attn", "my-branch")


def first_cells(root: Path) -> dict[str, str]:
    """'folder/name.ipynb' -> source of its first cell, for every notebook of the three folders."""
    return {f"{folder}/{path.name}": nbformat.read(path, as_version=4).cells[0].source
            for folder in FOLDERS for path in sorted((root / folder).glob("*.ipynb"))}


@pytest.fixture
def fork(tmp_path) -> Path:
    """A copy of the course's notebooks and _config.yml whose repository is ``FORK``."""
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, tmp_path / folder)
    url, branch = repository()
    config = (ROOT / "_config.yml").read_text(encoding="utf-8")
    assert f"url: {url}" in config and f"branch: {branch}" in config
    config = config.replace(f"url: {url}", f"url: {FORK[0]}")
    (tmp_path / "_config.yml").write_text(config.replace(f"branch: {branch}",
                                                         f"branch: {FORK[1]}"))
    return tmp_path


def exercises_are_fresh(root: Path) -> bool:
    return generate.main(["--solutions", str(root / "solutions"),
                          "--exercises", str(root / "exercises"), "--check"]) == 0


def test_one_command_points_every_notebook_at_the_fork(fork, capsys):
    assert repository(fork / "_config.yml") == FORK
    assert exercises_are_fresh(fork)
    before = first_cells(fork)
    capsys.readouterr()
    assert colab.main(["--root", str(fork)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sorted(line.removeprefix("rewrote ") for line in out) == sorted(before)
    after = first_cells(fork)
    expected = colab_cell_source(*FORK)
    assert after.keys() == before.keys() and set(after.values()) == {expected}
    assert f"git+{FORK[0]}@{FORK[1]}" in expected
    assert exercises_are_fresh(fork)
    capsys.readouterr()
    assert colab.main(["--root", str(fork)]) == 0  # a second run has nothing left to do
    assert capsys.readouterr().out == ""


def test_a_notebook_without_the_cell_gets_one_and_its_exercise_stays_fresh(fork):
    solution = fork / "solutions" / "03_masking.ipynb"
    nb = nbformat.read(solution, as_version=4)
    nb.cells.pop(0)
    nbformat.write(nb, solution)
    exercise = fork / "exercises" / solution.name
    exercise.write_text(generate.expected_exercises(fork / "solutions",
                                                    fork / "exercises")[exercise])
    assert not colab.has_colab_cell(nbformat.read(exercise, as_version=4))
    assert colab.main(["--root", str(fork)]) == 0
    assert set(first_cells(fork).values()) == {colab_cell_source(*FORK)}
    assert exercises_are_fresh(fork)


def test_a_students_work_in_exercises_is_kept(fork):
    exercise = fork / "exercises" / "05_rope.ipynb"
    nb = nbformat.read(exercise, as_version=4)
    nb.cells[-1].source += "\n\nmy notes on RoPE"
    nbformat.write(nb, exercise)
    assert colab.main(["--root", str(fork)]) == 0
    nb = nbformat.read(exercise, as_version=4)
    assert nb.cells[0].source == colab_cell_source(*FORK)
    assert nb.cells[-1].source.endswith("my notes on RoPE")


@pytest.mark.parametrize("missing", ["_config.yml", "exercises"])
def test_a_layout_without_config_or_folder_is_one_line_and_nothing_written(fork, missing,
                                                                         capsys):
    before = first_cells(fork) if missing == "_config.yml" else None
    target = fork / missing
    target.unlink() if target.is_file() else shutil.rmtree(target)
    assert colab.main(["--root", str(fork)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ")
    assert captured.err.count("\n") == 1 and missing.removesuffix(".yml") in captured.err
    if before is not None:
        assert first_cells(fork) == before


class FakeDistribution:
    def __init__(self, record):
        self.record = record

    def read_text(self, name):
        assert name == "direct_url.json"
        return None if self.record is None else json.dumps(self.record)


@pytest.mark.parametrize("record, where", [
    ({"url": FORK[0], "vcs_info": {"vcs": "git", "requested_revision": FORK[1],
                                   "commit_id": "0" * 40}},
     f"a clone of {FORK[0]} (branch {FORK[1]})"),
    ({"url": FORK[0], "vcs_info": {"vcs": "git", "commit_id": "0" * 40}},
     f"a clone of {FORK[0]} (branch {'0' * 40})"),
    ({"url": "file:///home/me/course_attn", "dir_info": {"editable": True}},
     "a clone of the course repository"),
    (None, "a clone of the course repository"),
])
def test_a_pip_install_names_the_repository_pip_installed_from(record, where, tmp_path,
                                                               monkeypatch):
    monkeypatch.setattr(colab.metadata, "distribution", lambda name: FakeDistribution(record))
    assert colab.a_clone_of_the_course(tmp_path) == where  # tmp_path: no _config.yml
    assert colab.a_clone_of_the_course(ROOT) == f"a clone of {repository()[0]}"


def test_check_in_colab_says_once_where_the_grade_comes_from(monkeypatch, capsys):
    monkeypatch.setattr(colab, "_told", [])
    colab.tell_where_the_grader_runs()
    assert capsys.readouterr().out == ""  # not in Colab
    monkeypatch.setitem(sys.modules, "google.colab", object())
    colab.tell_where_the_grader_runs()
    colab.tell_where_the_grader_runs()
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "python -m course_attn.grade" in out
    assert f"a clone of {repository()[0]}" in out


def test_missing_solutions_says_what_the_grader_needs_in_one_line(tmp_path, monkeypatch):
    given = grader.missing_solutions(tmp_path / "nowhere")
    assert given.startswith(f"--solutions {tmp_path / 'nowhere'} does not exist: ")
    monkeypatch.chdir(tmp_path)  # no solutions/ here: the default is the one beside the package
    default = grader.missing_solutions(grader.default_solutions_dir())
    assert default.startswith(f"no solutions/ folder in {tmp_path} or at "
                              f"{grader.default_solutions_dir()}: ")
    for message in (given, default):
        assert "\n" not in message
        assert message.endswith(f"run it in a clone of {repository()[0]}, or give "
                                "--solutions DIR")


def test_the_grader_installed_without_the_repository_says_what_it_needs(tmp_path):
    """As after ``pip install``: the package alone in a folder, run from another one."""
    shutil.copytree(ROOT / "course_attn", tmp_path / "site" / "course_attn",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "elsewhere").mkdir()
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "course_attn.grade", "answer.ipynb"],
                            cwd=tmp_path / "elsewhere", env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert str(tmp_path / "site" / "solutions") in result.stderr
    assert "course repository" in result.stderr and "or give --solutions DIR" in result.stderr
