"""``python -m course_attn.grade export gradescope|nbgrader OUT``: the course's grader packed for
Gradescope and nbgrader, tested end to end.

- Gradescope: the zip is unpacked into a folder laid out as Gradescope lays out ``/autograder``
  (``source/``, ``submission/``, ``results/``); ``run_autograder`` runs with this environment's
  Python (``AUTOGRADER_PYTHON``; setup.sh's installs are skipped) but the package and solutions
  of the zip (its ``PYTHONPATH``), on chapter 1 (the smallest): a solution, a blank exercise
  notebook and a typical mistake, uploaded together (one grading run, to keep the test short).
  ``results.json`` is checked against Gradescope's published format.
- nbgrader: ``generate_assignment`` then ``autograde`` of a solution and a blank notebook, where
  nbgrader is installed (an optional extra; see tests/test_grading_nbgrader.py for a venv).
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))

from grading_support import (  # noqa: E402
    ROOT, SOLUTIONS, edit, require_sandbox, solution_notebook, write,
)

from course_attn.grading import cli, export  # noqa: E402

CHAPTER = "01_intuition.ipynb"
MAX_POINTS = 14.0  # chapter 1: 3 + 3 + 4 + 4
NAIVE_SOFTMAX = '''def softmax_list(xs):
    exps = [math.exp(x) for x in xs]
    return [e / sum(exps) for e in exps]
'''

# Gradescope's results.json ("Output format", gradescope-autograders.readthedocs.io/en/latest/
# specs/): the keys it reads, at the top level and in each test.
VISIBILITIES = {"hidden", "after_due_date", "after_published", "visible"}
TOP_LEVEL_KEYS = {"score", "execution_time", "output", "output_format", "test_output_format",
                  "test_name_format", "visibility", "stdout_visibility", "extra_data", "tests",
                  "leaderboard"}
TEST_KEYS = {"score", "max_score", "status", "name", "name_format", "number", "output",
             "output_format", "tags", "visibility", "extra_data"}


def assert_gradescope_format(results: dict) -> None:
    """Fails unless ``results`` is a results.json Gradescope accepts: known keys with the types
    its specification gives, a score at the top or in every test."""
    assert isinstance(results, dict) and set(results) <= TOP_LEVEL_KEYS, set(results)
    assert "score" in results or "tests" in results
    if "score" in results:
        assert isinstance(results["score"], (int, float))
    for key in ("visibility", "stdout_visibility"):
        assert results.get(key, "visible") in VISIBILITIES
    assert isinstance(results.get("output", ""), str)
    assert isinstance(results.get("tests", []), list)
    for test in results.get("tests", []):
        assert isinstance(test, dict) and set(test) <= TEST_KEYS, test
        assert isinstance(test["name"], str) and test["name"]
        assert isinstance(test["output"], str)
        assert test.get("visibility", "visible") in VISIBILITIES
        assert test.get("status", "passed") in {"passed", "failed"}
        for key in ("score", "max_score"):
            assert isinstance(test[key], (int, float)), (key, test)
        assert 0 <= test["score"] <= test["max_score"]
        if "score" not in results:
            assert "score" in test


# --- Gradescope, end to end -----------------------------------------------------------------

@pytest.fixture(scope="module")
def autograder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "autograder.zip"
    assert cli.main(["export", "gradescope", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def graded(autograder, tmp_path_factory) -> tuple[dict, Path]:
    """results.json of one run_autograder over three uploaded notebooks, and the root."""
    require_sandbox()
    root = tmp_path_factory.mktemp("autograder")
    with zipfile.ZipFile(autograder) as archive:
        archive.extractall(root / "source")
    (root / "results").mkdir()
    solution = solution_notebook(SOLUTIONS / CHAPTER)
    write(solution, root / "submission" / "full" / CHAPTER)
    (root / "submission" / "blank").mkdir()
    shutil.copy(ROOT / "exercises" / CHAPTER, root / "submission" / "blank" / CHAPTER)
    write(edit(solution, replace={"ch01-softmax_list-solution": NAIVE_SOFTMAX}),
          root / "submission" / "mistake" / CHAPTER)
    env = {**os.environ, "AUTOGRADER_ROOT": str(root), "AUTOGRADER_PYTHON": sys.executable,
           "PYTHONPATH": ""}
    done = subprocess.run(["bash", str(root / "source" / "run_autograder")], env=env,
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((root / "results" / "results.json").read_text()), root


def exercise_tests(results: dict, folder: str) -> dict[str, dict]:
    prefix = f"{folder}/{CHAPTER}: "
    return {t["name"].removeprefix(prefix): t for t in results["tests"]
            if t["name"].startswith(prefix)}


def test_the_zip_holds_the_scripts_and_the_course(autograder):
    with zipfile.ZipFile(autograder) as archive:
        names = set(archive.namelist())
        modes = {i.filename: i.external_attr >> 16 for i in archive.infolist()}
        setup = archive.read("setup.sh").decode()
        requirements = archive.read("course/requirements.txt").decode()
    for needed in ("setup.sh", "run_autograder", "course/course_attn/grading/grader.py",
                   "course/course_attn/grading/ch01.py", f"course/solutions/{CHAPTER}",
                   "course/solutions/hidden/ch01.py", "course/requirements.txt"):
        assert needed in names
    assert not any("__pycache__" in name for name in names)
    assert modes["setup.sh"] & 0o111 and modes["run_autograder"] & 0o111
    assert "bubblewrap" in setup and "course/requirements.txt" in setup
    assert "torch==" in requirements and "nbclient" in requirements
    assert "jupyter-book" not in requirements and "pytest" not in requirements


def test_results_json_has_gradescopes_format(graded):
    results, _ = graded
    assert_gradescope_format(results)
    assert len(results["tests"]) == 3 * 4  # an exercise per test, three notebooks
    assert all(t["visibility"] == "visible" for t in results["tests"])


def test_a_solution_gets_full_marks(graded):
    tests = exercise_tests(graded[0], "full")
    assert set(tests) == {"ch01.softmax_list", "ch01.soft_lookup", "ch01.attend",
                          "ch01.induction_score"}
    assert all(t["score"] == t["max_score"] and t["status"] == "passed" for t in tests.values())
    assert sum(t["max_score"] for t in tests.values()) == MAX_POINTS
    assert "full/01_intuition.ipynb: 14 / 14 (sandbox: bubblewrap" in \
        graded[0]["output"]


def test_a_blank_notebook_gets_zero(graded):
    tests = exercise_tests(graded[0], "blank")
    assert len(tests) == 4
    assert all(t["score"] == 0 and t["output"] == "not implemented" for t in tests.values())


def test_a_typical_mistake_gets_its_hint(graded):
    results, _ = graded
    tests = exercise_tests(results, "mistake")
    wrong = tests["ch01.softmax_list"]
    assert wrong["score"] < wrong["max_score"] and wrong["status"] == "failed"
    assert "; hint: a raw math.exp fails at both ends: math.exp(1000) overflows" in \
        wrong["output"], wrong["output"]
    assert all(t["score"] == t["max_score"] for name, t in tests.items()
               if name != "ch01.softmax_list")
    assert results["score"] == pytest.approx(
        MAX_POINTS + wrong["score"] + (MAX_POINTS - wrong["max_score"]))


# --- Gradescope, its parts ------------------------------------------------------------------

def test_one_notebook_gives_tests_named_by_exercise_and_an_error_a_test_of_its_own(tmp_path):
    submission = tmp_path / "submission"
    report = {"total": 3.0, "max": 7, "notebooks": [
        {"path": str(submission / "03_masking.ipynb"), "total": 3.0, "max": 7, "error": None,
         "grader_error": False, "sandbox": "bubblewrap", "flags": ["locked cell ch03-x was "
                                                                   "modified"],
         "exercises": [{"exercise": "ch03.a", "grade_id": "ch03-a", "points": 3.0,
                        "max_points": 3, "passed": True, "reason": "passed"},
                       {"grade_id": "ch03-b", "points": 0.0, "max_points": 4, "passed": False,
                        "reason": "1 of 5 cases failed (first, a hidden case: wrong; hint: h)"}]}]}
    results = export.gradescope_results(report, submission, visibility="after_published")
    assert_gradescope_format(results)
    assert [(t["name"], t["score"], t["max_score"]) for t in results["tests"]] == [
        ("ch03.a", 3.0, 3.0), ("ch03-b", 0.0, 4.0)]  # a report without "exercise": its grade_id
    assert results["tests"][1]["output"].endswith("hint: h)")
    assert {t["visibility"] for t in results["tests"]} == {"after_published"}
    assert "locked cell ch03-x was modified" in results["output"]

    report["notebooks"][0].update(error="not a notebook", exercises=[], total=0.0, max=0)
    results = export.gradescope_results(report, submission)
    assert_gradescope_format(results)
    assert results["tests"] == [{"name": "the notebook", "score": 0.0, "max_score": 0.0,
                                 "output": "not a notebook", "visibility": "visible",
                                 "status": "failed"}]


def test_a_submission_without_a_notebook_gets_zero_and_says_why(tmp_path):
    (tmp_path / "submission").mkdir()
    (tmp_path / "submission" / "answers.py").write_text("x = 1\n")
    assert export.gradescope_autograde(tmp_path) == 0
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    assert_gradescope_format(results)
    assert results["score"] == 0 and "no notebook (.ipynb)" in results["output"]


def test_the_requirements_are_the_packages_and_their_pins():
    lines = export.grading_requirements().splitlines()
    assert "torch==2.13.0" in lines and any(line.startswith("triton==") for line in lines)
    assert {"numpy", "matplotlib", "tqdm", "ipykernel", "nbformat", "nbclient"} <= set(lines)
    assert not [line for line in lines if "jupyter" in line or line.startswith("-")]


@pytest.mark.parametrize("argv, message", [
    (["gradescope", "{tmp}/autograder.tar"], "OUT must end in .zip, got {tmp}/autograder.tar"),
    (["gradescope", "{tmp}/no/such/a.zip"], "folder of OUT {tmp}/no/such/a.zip does not exist"),
    (["nbgrader", "{tmp}", "--solutions", "{tmp}"], "--solutions {tmp} has no hidden/ folder"),
])
def test_bad_arguments_are_refused_by_name(tmp_path, capsys, argv, message):
    (tmp_path / "something").write_text("")
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert cli.main(["export", *argv]) == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


def test_an_nbgrader_course_goes_into_an_empty_folder_only(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("")
    assert cli.main(["export", "nbgrader", str(tmp_path)]) == 2
    assert f"OUT {tmp_path} exists and is not an empty folder" in capsys.readouterr().err
    assert cli.main(["export", "nbgrader", str(tmp_path / "notes.txt")]) == 2
    assert f"OUT {tmp_path / 'notes.txt'} exists and is not an empty folder" in \
        capsys.readouterr().err


# --- nbgrader -------------------------------------------------------------------------------

def test_the_nbgrader_source_adds_a_hidden_test_to_every_check_cell(tmp_path):
    assert cli.main(["export", "nbgrader", str(tmp_path / "course")]) == 0
    course = tmp_path / "course"
    assert (course / "nbgrader_config.py").is_file() and (course / "hidden" / "ch01.py").is_file()
    import nbformat
    for solution in sorted(SOLUTIONS.glob("*.ipynb")):
        source = nbformat.read(course / "source" / solution.stem / solution.name, as_version=4)
        original = nbformat.read(solution, as_version=4)
        checks = [c for c in original.cells if c.source.startswith("check(")]
        assert checks, solution.name
        changed = [c for c in source.cells if "### BEGIN HIDDEN TESTS" in c.source]
        assert len(changed) == len(checks)
        for before, after in zip(checks, changed):
            key = before.source.split('"')[1]
            assert after.source.startswith(before.source + "\n### BEGIN HIDDEN TESTS\n")
            assert f"autograde_check({key!r}, " in after.source


def test_a_graded_cell_that_is_not_one_check_call_is_refused(tmp_path, capsys):
    solutions = tmp_path / "solutions"
    (solutions / "hidden").mkdir(parents=True)
    nb = edit(solution_notebook(SOLUTIONS / CHAPTER),
              replace={"ch01-attend": 'check("ch01.attend", attend)\nprint("done")'})
    write(nb, solutions / CHAPTER)
    out = tmp_path / "course"
    assert cli.main(["export", "nbgrader", str(out), "--solutions", str(solutions)]) == 2
    assert (f"graded cell ch01-attend of {solutions / CHAPTER} is not one check(\"key\", "
            "answer) call") in capsys.readouterr().err


def test_autograde_check_fails_an_unanswered_exercise_and_passes_the_solution(tmp_path,
                                                                              monkeypatch):
    export.write_nbgrader_course(tmp_path / "course", SOLUTIONS)
    where = tmp_path / "course" / "autograded" / "student" / "01_intuition"
    where.mkdir(parents=True)
    monkeypatch.chdir(where)
    import math

    def softmax_list(xs):
        largest = max(xs)
        exps = [math.exp(x - largest) for x in xs]
        return [e / sum(exps) for e in exps]

    def unanswered(xs):
        raise NotImplementedError()

    export.autograde_check("ch01.softmax_list", softmax_list)
    with pytest.raises(AssertionError, match="ch01.softmax_list: not implemented"):
        export.autograde_check("ch01.softmax_list", unanswered)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no nbgrader course folder"):
        export.autograde_check("ch01.softmax_list", softmax_list)


def nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    # nbgrader runs the tools of its environment (alembic) by name
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course,
                          env={**os.environ, "PATH": path}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_nbgrader_autogrades_a_solution_full_and_a_blank_notebook_zero(tmp_path):
    pytest.importorskip("nbgrader", reason="nbgrader is not installed (an optional extra: see "
                                           "tests/test_grading_nbgrader.py)")
    from nbgrader.api import Gradebook
    course, assignment = tmp_path / "course", Path(CHAPTER).stem
    assert cli.main(["export", "nbgrader", str(course)]) == 0
    nbgrader(course, "generate_assignment", assignment, "--create")
    released = course / "release" / assignment / CHAPTER
    assert "BEGIN HIDDEN TESTS" not in released.read_text()
    assert "raise NotImplementedError" in released.read_text()
    for student, notebook in (("solution", SOLUTIONS / CHAPTER), ("blank", released)):
        folder = course / "submitted" / student / assignment
        folder.mkdir(parents=True)
        shutil.copy(notebook, folder / CHAPTER)
    nbgrader(course, "autograde", assignment, "--create")
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        full = gradebook.find_submission(assignment, "solution")
        blank = gradebook.find_submission(assignment, "blank")
        assert (full.score, full.max_score) == (MAX_POINTS, MAX_POINTS)
        assert (blank.score, blank.max_score) == (0, MAX_POINTS)
