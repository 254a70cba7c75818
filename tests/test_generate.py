"""Generating exercises/ from solutions/: stubs, cleared outputs, tags, hidden tests, --check,
clear errors, a student's work never overwritten, and the committed exercises/ equal to a fresh
generation."""

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from course_attn.grading.generate import (
    StudentWorkError, check_exercises, generate_all, generate_notebook, main, notebook_text,
    student_edits,
)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
FIXTURE = "99_fixture.ipynb"


def _load_make_fixtures():
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_fixtures = _load_make_fixtures()
nbgrader = make_fixtures.nbgrader  # the nbgrader cell metadata the fixtures are built with


def solution_cell(source, gid="ex-solution", **metadata):
    return new_code_cell(source, metadata={**nbgrader(gid, solution=True), **metadata})


def grade_cell(source, gid="ex", points=1):
    return new_code_cell(source, metadata=nbgrader(gid, grade=True, locked=True, points=points))


def generated(*cells):
    return generate_notebook(new_notebook(cells=list(cells))).cells


def test_fixture_solution_becomes_the_expected_exercise(tmp_path):
    written = generate_all(FIXTURES / "solutions", tmp_path)
    assert written == [tmp_path / FIXTURE]
    assert (tmp_path / FIXTURE).read_bytes() == (FIXTURES / "exercises" / FIXTURE).read_bytes()


def test_committed_fixtures_are_what_their_script_builds():
    for folder, exercise in (("solutions", False), ("exercises", True)):
        committed = (FIXTURES / folder / FIXTURE).read_text(encoding="utf-8")
        assert notebook_text(make_fixtures.build(exercise)) == committed, folder


def test_solution_region_becomes_a_stub_at_its_indentation():
    source = ("def f(x):\n"
              "    total = 0\n"
              "    for row in x:\n"
              "        ### BEGIN SOLUTION\n"
              "        total += row\n"
              "        ### END SOLUTION\n"
              "    return total\n")
    [cell] = generated(solution_cell(source))
    assert cell.source == ("def f(x):\n"
                           "    total = 0\n"
                           "    for row in x:\n"
                           "        # YOUR CODE HERE\n"
                           "        raise NotImplementedError()\n"
                           "    return total\n")


def test_every_region_of_a_cell_is_replaced():
    source = ("def f(x):\n    ### BEGIN SOLUTION\n    y = x\n    ### END SOLUTION\n"
              "    return y\n\n"
              "def g(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION")
    [cell] = generated(solution_cell(source))
    stub = "    # YOUR CODE HERE\n    raise NotImplementedError()"
    assert cell.source == f"def f(x):\n{stub}\n    return y\n\ndef g(x):\n{stub}"


def test_a_solution_cell_without_a_region_is_replaced_whole_as_nbgrader_does():
    code, text = generated(solution_cell("x = 1"),
                           new_markdown_cell("An answer.", metadata=nbgrader("q", solution=True)))
    assert code.source == "# YOUR CODE HERE\nraise NotImplementedError()"
    assert text.source == "YOUR ANSWER HERE"


def test_markdown_answer_becomes_your_answer_here():
    cell = new_markdown_cell("Why?\n\n### BEGIN SOLUTION\nBecause.\n### END SOLUTION\n",
                             metadata=nbgrader("why", solution=True))
    [out] = generated(cell)
    assert out.source == "Why?\n\nYOUR ANSWER HERE\n"
    assert "tags" not in out.metadata  # a markdown cell cannot raise


def test_hidden_tests_are_removed_from_grade_cells():
    source = ("check('ch99.x', x)\n### BEGIN HIDDEN TESTS\nassert x(1) == 2\n"
              "### END HIDDEN TESTS\nprint('done')")
    [cell] = generated(grade_cell(source))
    assert cell.source == "check('ch99.x', x)\nprint('done')"


def test_outputs_are_cleared_tags_added_and_other_metadata_kept():
    solution = solution_cell("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION",
                             tags=["mine"], jupyter={"source_hidden": True})
    solution.execution_count = 4
    solution.outputs = [new_output("stream", name="stdout", text="old\n")]
    check = grade_cell("check('ch99.f', f)")
    check.metadata["tags"] = ["raises-exception"]
    plain = new_code_cell("print(1)", metadata={"tags": ["keep"]})
    plain.outputs = [new_output("execute_result", data={"text/plain": "1"}, execution_count=1)]
    nb = new_notebook(cells=[solution, check, plain],
                      metadata={"course_attn": {"chapter": "ch99"},
                                "kernelspec": {"name": "x", "display_name": "X"}})
    original = copy.deepcopy(nb)
    out = generate_notebook(nb)
    assert nb == original  # the solution notebook is not touched
    assert out.metadata == original.metadata
    assert [c.outputs for c in out.cells] == [[], [], []]
    assert [c.execution_count for c in out.cells] == [None, None, None]
    assert [c.metadata.get("tags") for c in out.cells] == [
        ["mine", "raises-exception"], ["raises-exception"], ["keep"]]
    assert out.cells[0].metadata["jupyter"] == {"source_hidden": True}
    assert out.cells[0].metadata["nbgrader"] == original.cells[0].metadata["nbgrader"]
    assert [c.id for c in out.cells] == [c.id for c in original.cells]
    assert out.cells[2].source == "print(1)"


def test_generation_is_deterministic_and_leaves_unchanged_files_alone(tmp_path):
    first = generate_all(FIXTURES / "solutions", tmp_path / "a")
    data, mtime = first[0].read_bytes(), first[0].stat().st_mtime_ns
    generate_all(FIXTURES / "solutions", tmp_path / "a")
    assert (first[0].read_bytes(), first[0].stat().st_mtime_ns) == (data, mtime)
    second = generate_all(FIXTURES / "solutions", tmp_path / "b")
    assert second[0].read_bytes() == data


@pytest.fixture
def generated_dirs(tmp_path):
    solutions, exercises = tmp_path / "solutions", tmp_path / "exercises"
    solutions.mkdir()
    for name in ("01_a.ipynb", "02_b.ipynb"):
        (solutions / name).write_bytes((FIXTURES / "solutions" / FIXTURE).read_bytes())
    generate_all(solutions, exercises)
    return solutions, exercises


def run_main(*args):
    return main([str(a) for a in args])


def test_check_passes_on_a_fresh_generation(generated_dirs, capsys):
    solutions, exercises = generated_dirs
    assert run_main("--solutions", solutions, "--exercises", exercises, "--check") == 0
    assert check_exercises(solutions, exercises) == []


def test_check_lists_every_outdated_file_and_writes_nothing(generated_dirs, capsys):
    solutions, exercises = generated_dirs
    (exercises / "01_a.ipynb").write_text((exercises / "01_a.ipynb").read_text() + " ")
    (exercises / "02_b.ipynb").unlink()
    (exercises / "03_gone.ipynb").write_text("{}")
    before = sorted((p.name, p.read_bytes()) for p in exercises.iterdir())
    assert run_main("--solutions", solutions, "--exercises", exercises, "--check") == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{exercises / '01_a.ipynb'}: differs from a fresh generation",
                   f"{exercises / '02_b.ipynb'}: missing",
                   f"{exercises / '03_gone.ipynb'}: stale (no solution notebook of that name)"]
    assert sorted((p.name, p.read_bytes()) for p in exercises.iterdir()) == before


def test_generation_fixes_what_check_reports(generated_dirs, capsys):
    solutions, exercises = generated_dirs
    (exercises / "01_a.ipynb").write_text("edited by hand")
    (exercises / "03_gone.ipynb").write_text("{}")
    assert run_main("--solutions", solutions, "--exercises", exercises) == 0
    assert f"removed {exercises / '03_gone.ipynb'}" in capsys.readouterr().out
    assert check_exercises(solutions, exercises) == []


def write_solutions(folder: Path, *cells) -> Path:
    folder.mkdir(exist_ok=True)
    nbformat.write(new_notebook(cells=list(cells)), folder / "01_bad.ipynb")
    return folder


BAD_NOTEBOOKS = {
    "begin without end": ([solution_cell("def f():\n    ### BEGIN SOLUTION\n    return 1")],
                          r"cell 0 \(ex-solution\): line 2: '### BEGIN SOLUTION' has no matching "
                          r"'### END SOLUTION'"),
    "end without begin": ([solution_cell("def f():\n    return 1\n    ### END SOLUTION")],
                          r"line 3: '### END SOLUTION' without a '### BEGIN SOLUTION' before it"),
    "nested begin": ([solution_cell("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION")],
                     r"line 2: '### BEGIN SOLUTION' inside the region opened at line 1"),
    "region outside a solution cell": (
        [new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION")],
        r"cell 0: a solution region in a cell that is not a solution cell"),
    "duplicated grade_id": ([grade_cell("check('a', a)", "ch01-a"),
                             grade_cell("check('b', b)", "ch01-a")],
                            r"grade_id 'ch01-a' is used by cells 0 and 1"),
    "hidden tests outside a grade cell": (
        [new_code_cell("### BEGIN HIDDEN TESTS\nassert True\n### END HIDDEN TESTS")],
        r"cell 0: hidden tests outside a grade cell"),
    "grade cell without points": ([grade_cell("check('a', a)", points=None)],
                                  r"cell 0 \(ex\): a grade cell needs 'points' >= 0"),
}


@pytest.mark.parametrize("name", BAD_NOTEBOOKS)
def test_malformed_solutions_are_a_clear_error(name, tmp_path, capsys):
    cells, message = BAD_NOTEBOOKS[name]
    with pytest.raises(ValueError, match=message):
        generate_notebook(new_notebook(cells=cells))
    solutions = write_solutions(tmp_path / "solutions", *cells)
    assert run_main("--solutions", solutions, "--exercises", tmp_path / "exercises") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {solutions / '01_bad.ipynb'}") and err.endswith("\n")
    assert not (tmp_path / "exercises").exists()  # nothing written when a notebook is bad


def test_missing_solutions_folder_is_exit_status_2(tmp_path, capsys):
    assert run_main("--solutions", tmp_path / "nowhere", "--exercises", tmp_path / "x") == 2
    assert "does not exist" in capsys.readouterr().err


def test_module_runs_as_a_command(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "course_attn.grading.generate", "--solutions",
         str(FIXTURES / "solutions"), "--exercises", str(FIXTURES / "exercises"), "--check"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def edit(path: Path, *, answer: str | None = None, run: bool = False) -> list[str]:
    """What a student does in Jupyter: write an answer in place of the first stub, run the first
    code cell. Returns the reasons ``student_edits`` should give."""
    nb = nbformat.read(path, as_version=4)
    reasons = []
    if run:
        index = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
        nb.cells[index].execution_count = 1
        nb.cells[index].outputs = [new_output("stream", name="stdout", text="ok\n")]
        reasons.append(f"cell {index} ran (outputs or execution counts)")
    if answer is not None:
        index = next(i for i, c in enumerate(nb.cells) if "raise NotImplementedError()" in c.source)
        cell = nb.cells[index]
        cell.source = cell.source.replace("# YOUR CODE HERE\n    raise NotImplementedError()",
                                          answer)
        reasons.append(f"answers written in cell {index} ({cell.metadata.nbgrader.grade_id})")
    nbformat.write(nb, path)
    return reasons


def change_solutions(solutions: Path) -> None:
    """What a maintainer does: reword a solution notebook, so its exercise is out of date."""
    for path in solutions.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        nb.cells[0].source += "\n\nReworded."
        nbformat.write(nb, path)


@pytest.mark.parametrize("answer, run", [("    return 2 * x", False), (None, True),
                                         ("    return 2 * x", True)],
                         ids=["answered", "ran", "answered-and-ran"])
def test_a_students_work_is_refused_and_left_byte_identical(generated_dirs, answer, run,
                                                            capsys):
    solutions, exercises = generated_dirs
    change_solutions(solutions)  # even when the exercise is also out of date
    reasons = edit(exercises / "01_a.ipynb", answer=answer, run=run)
    before = snapshot(exercises)
    assert run_main("--solutions", solutions, "--exercises", exercises) == 1
    assert snapshot(exercises) == before  # nothing written at all, 02_b.ipynb included
    out, err = capsys.readouterr()
    assert out == ""
    path = exercises / "01_a.ipynb"
    assert f"  {path}: {'; '.join(reasons)}\n" in err
    assert str(exercises / "02_b.ipynb") not in err
    assert f"make work NB={path}" in err  # how to keep it
    assert "--force" in err  # how to overwrite it anyway
    with pytest.raises(StudentWorkError) as refused:
        generate_all(solutions, exercises)
    assert list(refused.value.edited) == [path]


def test_a_merely_stale_exercise_is_regenerated(generated_dirs, capsys):
    solutions, exercises = generated_dirs
    change_solutions(solutions)
    assert check_exercises(solutions, exercises) == [
        f"{exercises / name}: differs from a fresh generation" for name in ("01_a.ipynb",
                                                                            "02_b.ipynb")]
    assert run_main("--solutions", solutions, "--exercises", exercises) == 0
    assert check_exercises(solutions, exercises) == []
    assert nbformat.read(exercises / "01_a.ipynb", 4).cells[0].source.endswith("Reworded.")


def test_force_overwrites_a_students_work(generated_dirs, capsys):
    solutions, exercises = generated_dirs
    edit(exercises / "01_a.ipynb", answer="    return 2 * x", run=True)
    assert run_main("--solutions", solutions, "--exercises", exercises, "--force") == 0
    assert check_exercises(solutions, exercises) == []


def test_a_stale_notebook_is_removed_only_when_nobody_worked_in_it(generated_dirs, capsys):
    solutions, exercises = generated_dirs
    fixture = (FIXTURES / "exercises" / FIXTURE).read_bytes()
    (exercises / "04_gone.ipynb").write_bytes(fixture)  # a chapter that was dropped
    (exercises / "05_done.ipynb").write_bytes(fixture)
    edit(exercises / "05_done.ipynb", run=True)
    nbformat.write(new_notebook(cells=[new_code_cell("notes = 1")]), exercises / "Untitled.ipynb")
    assert run_main("--solutions", solutions, "--exercises", exercises) == 1
    err = capsys.readouterr().err
    assert str(exercises / "05_done.ipynb") in err
    assert f"{exercises / 'Untitled.ipynb'}: no exercise cell" in err
    assert str(exercises / "04_gone.ipynb") not in err
    assert (exercises / "04_gone.ipynb").exists()  # nothing is written while any is refused
    (exercises / "05_done.ipynb").unlink()
    (exercises / "Untitled.ipynb").unlink()
    assert run_main("--solutions", solutions, "--exercises", exercises) == 0
    assert not (exercises / "04_gone.ipynb").exists()


def test_student_edits_sees_what_generation_never_leaves(tmp_path):
    path = tmp_path / "nb.ipynb"
    path.write_bytes((FIXTURES / "exercises" / FIXTURE).read_bytes())
    assert student_edits(path) == []
    nb = nbformat.read(path, 4)
    text = next(i for i, c in enumerate(nb.cells)
                if c.cell_type == "markdown" and "YOUR ANSWER HERE" in c.source)
    nb.cells[text].source = "Why?\n\nBecause the sum removes the last axis."
    check = next(i for i, c in enumerate(nb.cells) if c.source.startswith("check("))
    nb.cells[check].execution_count = 3  # run, even without an output
    nbformat.write(nb, path)
    assert student_edits(path) == [
        f"cell {check} ran (outputs or execution counts)",
        f"answers written in cell {text} ({nb.cells[text].metadata.nbgrader.grade_id})"]
    path.write_text("not a notebook")
    assert student_edits(path) == []


def test_check_names_a_students_work_and_how_to_keep_it(generated_dirs, capsys):
    solutions, exercises = generated_dirs
    [reason] = edit(exercises / "01_a.ipynb", answer="    return 2 * x")
    path = exercises / "01_a.ipynb"
    assert check_exercises(solutions, exercises) == [
        f"{path}: holds a student's work ({reason}); keep it in work/ with `make work NB={path}`"]
    assert run_main("--solutions", solutions, "--exercises", exercises, "--check") == 1
    err = capsys.readouterr().err
    assert "refuses to touch one that holds a student's work" in err and "work/" in err


SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


@pytest.mark.skipif(not SOLUTIONS, reason="solutions/ has no notebook yet")
def test_committed_exercises_equal_a_fresh_generation_of_solutions():
    problems = check_exercises(ROOT / "solutions", ROOT / "exercises")
    assert problems == [], (
        "exercises/ differs from a fresh generation of solutions/:\n" + "\n".join(problems)
        + "\nMaintainers: run `make exercises` and commit the result. It refuses to overwrite a "
        "notebook that holds a student's work; students, keep yours in work/ "
        "(`make work NB=exercises/NN_topic.ipynb`), where no command overwrites it.")


def type_below_the_stub(path: Path) -> int:
    """A student who types an answer under the stub, keeps `raise NotImplementedError()` and has
    not run the cell yet (issue 21). Returns the cell's index."""
    nb = nbformat.read(path, as_version=4)
    index = next(i for i, c in enumerate(nb.cells) if "raise NotImplementedError()" in c.source)
    nb.cells[index].source += "\n    half = x.sum(-1)  # my answer, half typed"
    nbformat.write(nb, path)
    return index


def test_an_answer_typed_around_a_stub_still_there_is_refused(generated_dirs, capsys):
    solutions, exercises = generated_dirs
    change_solutions(solutions)
    path = exercises / "01_a.ipynb"
    index = type_below_the_stub(path)
    before = snapshot(exercises)
    assert run_main("--solutions", solutions, "--exercises", exercises) == 1
    assert snapshot(exercises) == before
    grade = nbformat.read(path, 4).cells[index].metadata.nbgrader.grade_id
    assert f"answers written in cell {index} ({grade})" in capsys.readouterr().err


def git(folder: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})


def test_in_a_checkout_any_cell_a_student_wrote_or_added_is_refused(generated_dirs, capsys):
    """In a git checkout the committed exercise is what generation wrote last: a cell that
    differs from it and from a fresh generation is someone's, solution cell or not; a notebook
    that is only out of date (the solutions changed) is regenerated."""
    solutions, exercises = generated_dirs
    root = exercises.parent
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "generated")
    change_solutions(solutions)
    path = exercises / "01_a.ipynb"
    nb = nbformat.read(path, 4)
    nb.cells.append(new_markdown_cell("My notes: the mask goes before the softmax."))
    nbformat.write(nb, path)
    assert run_main("--solutions", solutions, "--exercises", exercises) == 1
    err = capsys.readouterr().err
    assert f"{path}: cell {len(nb.cells) - 1} written or added" in err
    assert str(exercises / "02_b.ipynb") not in err
    path.write_bytes(subprocess.run(["git", "-C", str(exercises), "show", "HEAD:./01_a.ipynb"],
                                    capture_output=True, check=True).stdout)
    assert run_main("--solutions", solutions, "--exercises", exercises) == 0
    assert check_exercises(solutions, exercises) == []


def test_the_refusal_offers_a_free_name_when_work_has_that_notebook(generated_dirs, capsys,
                                                                    monkeypatch):
    """`make work NB=...` refuses when work/ holds a notebook of that name: the refusal then
    offers a copy under the first free name."""
    solutions, exercises = generated_dirs
    monkeypatch.chdir(exercises.parent)
    path = exercises / "01_a.ipynb"
    edit(path, answer="    return 2 * x")
    (exercises.parent / "work").mkdir()
    (exercises.parent / "work" / "01_a.ipynb").write_text("{}")
    (exercises.parent / "work" / "01_a-2.ipynb").write_text("{}")
    assert run_main("--solutions", solutions, "--exercises", exercises) == 1
    err = capsys.readouterr().err
    assert f"  cp {path} work/01_a-3.ipynb\n" in err and "make work NB" not in err
    assert check_exercises(solutions, exercises)[0].endswith("`cp " + str(path)
                                                             + " work/01_a-3.ipynb`")
