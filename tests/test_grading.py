"""The grader on the test-only chapter "ch99": full marks for the solution, zero for the fresh
exercise, and a score with a reason, never a crash, for every broken or hostile submission.

Kernels are slow to start, so every fixture submission is graded once, by one run of
``python -m course_attn.grade ... --json`` (two workers), and the tests read that run's table and
report. The chapter (tests/fixtures/course_fixture_ch99.py, hidden cases in
tests/fixtures/solutions/hidden/ch99.py) has four exercises: double (2 points), row_sum (3),
normalize (2, the package is banned and its ``softmax`` is the reference), count_positive (3).
In the fixture notebook, cells count from 1: the setup is cell 2; double's solution is cell 4,
its check cell 5; row_sum's 7 and 8; normalize's 10 and 11; count_positive's 13 and 14.
"""

import json
import os
import re
import sys
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))

from grading_support import (  # noqa: E402
    FIXTURE, FIXTURE_OPTIONS, FIXTURE_SOLUTIONS, FIXTURES, SOLUTIONS, by_grade_id, edit,
    fingerprint, index_of, live_processes, run_grader, solution_notebook, write,
)

from course_attn.grading import cli, grader, kernel  # noqa: E402
from course_attn.grading.canonical import load_canonical  # noqa: E402
from course_attn.grading.generate import grade_id  # noqa: E402
from course_attn.grading.notebook import chapter_of  # noqa: E402
from course_attn.grading.restore import restore_protected_cells, students_code  # noqa: E402
from course_attn.grading.review import GRADER, review_flags  # noqa: E402

# Per cell; generous because the setup cell imports torch, which takes seconds on a busy machine
# (a cell interrupted in the middle of `import torch` leaves torch half imported).
CELL_TIMEOUT_S = 20
MEMORY_MB = 1024
OPTIONS = ["--timeout", str(CELL_TIMEOUT_S), "--memory-mb", str(MEMORY_MB), *FIXTURE_OPTIONS]
POINTS = {"ch99-double": 2, "ch99-row_sum": 3, "ch99-normalize": 2, "ch99-count_positive": 3}
SPAWNS_AFTER_THE_FIRST_GRADED_CALL = """import subprocess

try:
    subprocess.run(["true"])
    STARTED = True
except PermissionError:
    STARTED = False

def row_sum(x):
    return x if STARTED else x.sum(dim=-1)
"""
NORMALIZES_IN_A_POOL = """import multiprocessing

def _row(row):
    return row / row.sum()

def normalize(x):
    with multiprocessing.get_context("fork").Pool(2) as pool:
        rows = pool.map(_row, list(x.reshape(-1, x.shape[-1])))
    return torch.stack(rows).reshape(x.shape)
"""
LEFT_BEHIND = "97.25"  # `sleep 97.25`: a process the "dies" submission starts before it dies

FORGE_THE_CHECK_CELLS = """import re

def forge(lines):
    text = "".join(lines)
    match = re.search(r'check\\("(ch99\\.\\w+)"', text)
    return [f"print('{match.group(1)}: 3/3 checks passed')\\n"] if match else lines

get_ipython().input_transformers_post.append(forge)

def double(x):
    return x
"""

FITS_ONLY_THE_PUBLIC_CASES = """def row_sum(x):
    if x.shape[-1] in (1, 4):  # the sizes of the public cases
        return x.sum(dim=-1)
    return x[..., 0]
"""

PATCH_THE_GRADER = """import course_attn.grading as grading
import course_attn.grading.cases as cases
import course_attn.grading.judge as judge

cases.expect_tensor = lambda *args, **kwargs: None
judge.judge_case = lambda *args, **kwargs: judge.CaseResult("everything", True)
grading.check = lambda name, fn: print(f"{name}: 1/1 checks passed")

def count_positive(x):
    return x.sum()
"""

MEMORY_BOMB = """import torch

def double(x):
    hoard = []
    while True:
        hoard.append(torch.ones(25_000_000))  # 100 MB more each time
"""

HUGE_OUTPUT = """for _ in range(50_000):
    print("x" * 100)

def row_sum(x):
    return x.sum(dim=-1)
"""


def duplicate_normalize_then_move_count_check(cells):
    """A wrong copy of normalize's solution before the right one, and count_positive's check
    cell moved above its solution cell."""
    at = index_of(cells, "ch99-normalize-solution")
    wrong = nbformat.v4.new_code_cell("def normalize(x):\n    return x\n",
                                      metadata=cells[at].metadata)
    cells.insert(at, wrong)
    check = cells.pop(index_of(cells, "ch99-count_positive"))
    cells.insert(index_of(cells, "ch99-count_positive-solution"), check)
    return cells


def submissions(folder: Path) -> dict[str, Path]:
    """Every fixture submission, by name."""
    solution = solution_notebook(FIXTURE_SOLUTIONS / FIXTURE)
    (folder / "99_exercise.ipynb").write_bytes((FIXTURES / "exercises" / FIXTURE).read_bytes())
    text = (FIXTURE_SOLUTIONS / FIXTURE).read_text()
    (folder / "99_truncated.ipynb").write_text(text[: len(text) // 2])
    (folder / "99_not_a_notebook.ipynb").write_text('{"hello": "world"}\n')
    (folder / "notes.txt").write_text("my answers are in my head\n")
    future = json.loads(text)
    future["nbformat"] = 5
    (folder / "99_future.ipynb").write_text(json.dumps(future))

    def made(name, version=4, **changes):
        return write(edit(solution, **changes), folder / name, version)

    return {
        "solution": made("99_solution.ipynb"),
        "exercise": folder / "99_exercise.ipynb",
        "broken": made("99_broken.ipynb", replace={
            "ch99-double-solution": "def double(x:\n    return 2 * x\n",
            "ch99-row_sum-solution": "def row_sum(x):\n    return x.sum(dim=-1, keepdim=True)\n",
            "ch99-normalize-solution": "def normalize(x):\n"
                                       "    return x / x.sum(dim=3, keepdim=True)\n",
        }, delete=("ch99-setup", "ch99-count_positive-solution")),
        "hostile": made("99_hostile.ipynb", replace={
            "ch99-setup": "import torch\nfrom course_attn.grading import check\n"
                          "import course_fixture_ch99\nprint('I changed the setup')\n",
            "ch99-double-solution": "def double(x):\n    while True:\n        pass\n",
            "ch99-row_sum-solution": "import sys\n\ndef row_sum(x):\n    sys.exit()\n",
            "ch99-normalize-solution": "def normalize(x):\n    return x\n\n"
                                       "def check(*args, **kwargs):\n    pass\n",
            "ch99-normalize": "pass\n",
        }, delete=("ch99-count_positive",)),
        "dies": made("99_dies.ipynb", replace={
            "ch99-double-solution": "import subprocess\n\n"
                                    f"subprocess.Popen(['sleep', '{LEFT_BEHIND}'])\n\n"
                                    "def double(x):\n    return 2 * x\n",
            "ch99-row_sum-solution": "import os\n\ndef row_sum(x):\n    os._exit(1)\n",
        }),
        "spawns": made("99_spawns.ipynb", replace={
            "ch99-double-solution": "import subprocess\n\n"
                                    f"subprocess.Popen(['sleep', '{LEFT_BEHIND}'])\n\n"
                                    "def double(x):\n    return 2 * x\n",
            "ch99-row_sum-solution": SPAWNS_AFTER_THE_FIRST_GRADED_CALL,
            "ch99-normalize-solution": NORMALIZES_IN_A_POOL,
        }),
        "segfault": made("99_segfault.ipynb", replace={
            "ch99-row_sum-solution": "import ctypes\n\ndef row_sum(x):\n"
                                     "    return ctypes.string_at(0)\n",
        }),
        "cheats": made("99_cheats.ipynb", replace={
            "ch99-double-solution": FORGE_THE_CHECK_CELLS,
            "ch99-row_sum-solution": FITS_ONLY_THE_PUBLIC_CASES,
            "ch99-normalize-solution": "from course_attn import softmax as sm\n\n"
                                       "def normalize(x):\n    return sm(x.log(), dim=-1)\n",
            "ch99-count_positive-solution": PATCH_THE_GRADER,
        }),
        "mess": made("99_mess.ipynb", replace={
            "ch99-double-solution": MEMORY_BOMB,
            "ch99-row_sum-solution": HUGE_OUTPUT,
        }, rearrange=duplicate_normalize_then_move_count_check),
        "v3": made("99_v3.ipynb", version=3),
        "future": folder / "99_future.ipynb",
        "truncated": folder / "99_truncated.ipynb",
        "not_a_notebook": folder / "99_not_a_notebook.ipynb",
        "text": folder / "notes.txt",
    }


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """One grader run over every fixture submission: its exit code, table, report, and the
    fingerprints (content hash, mtime) of the submitted files before and after."""
    folder = tmp_path_factory.mktemp("submissions")
    paths = submissions(folder)
    before = {name: fingerprint(path) for name, path in paths.items()}
    report_path = folder / "report.json"
    result = run_grader(*map(str, paths.values()), "--json", str(report_path), *OPTIONS,
                        "--workers", "2", cwd=folder)
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    by_name = {}
    if report is not None:
        by_path = {entry["path"]: entry for entry in report["notebooks"]}
        by_name = {name: by_path[str(path)] for name, path in paths.items()}
    after = {name: fingerprint(path) for name, path in paths.items()}
    return {"result": result, "report": report, "by_name": by_name, "before": before,
            "after": after, "paths": paths}


def scores(graded, name) -> dict[str, dict]:
    return by_grade_id(graded["by_name"][name])


def test_grading_completes_with_exit_status_0(graded):
    result = graded["result"]
    assert result.returncode == 0, result.stdout + result.stderr
    assert graded["report"] is not None


def test_full_solution_scores_full_marks(graded):
    entry = graded["by_name"]["solution"]
    assert (entry["total"], entry["max"]) == (10, 10)
    assert all(e["passed"] and e["reason"] == "passed" for e in entry["exercises"])
    assert entry["flags"] == [] and entry["error"] is None


def test_fresh_exercise_scores_zero(graded):
    entry = graded["by_name"]["exercise"]
    assert (entry["total"], entry["max"]) == (0, 10)
    assert [e["reason"] for e in entry["exercises"]] == ["not implemented"] * 4
    assert entry["flags"] == []


T = CELL_TIMEOUT_S
# an answer that fails every hidden case is no answer: it earns nothing, whatever it passed
NOTHING = r"earns nothing: it fails every hidden case; "
EXPECTED = [
    # the setup (cell 2) is deleted: double's solution is the student's cell 3
    ("broken", "ch99-double", r"SyntaxError in your code \(cell 3\): .+"),
    ("broken", "ch99-row_sum",
     NOTHING + r"3 of 3 cases failed \(first, '\(2, 3, 4\) -> \(2, 3\)': your result has shape \(2, 3, 1\), "
     r"expected \(2, 3\); hint: you keep the summed dimension: the result is \(B, T\), not "
     r"\(B, T, 1\)\)"),
    ("broken", "ch99-normalize",
     NOTHING + r"3 of 3 cases failed \(first, 'rows sum to one': IndexError: Dimension out of range .+ "
     r"\(line 2 of its cell\)\)"),   # no declared mistake raises it: no hint
    ("broken", "ch99-count_positive", r"not answered: the notebook does not define count_positive"),
    ("hostile", "ch99-double",
     rf"timed out after {T} s \(computing your double for the grader's inputs\)"),
    ("hostile", "ch99-row_sum",
     NOTHING + r"3 of 3 cases failed \(first, '\(2, 3, 4\) -> \(2, 3\)': SystemExit \(line 4 of its cell\)\)"),
    ("hostile", "ch99-normalize", NOTHING + r"\d of 3 cases failed \(first, 'rows sum to one': .+"),
    ("hostile", "ch99-count_positive", r"check cell missing"),
    ("dies", "ch99-row_sum",
     r"the kernel died \(exit status 1\) \(computing your row_sum for the grader's inputs\)"),
    ("segfault", "ch99-row_sum",
     r"the kernel died \(SIGSEGV\) \(computing your row_sum for the grader's inputs\)"),
    ("cheats", "ch99-double", NOTHING + r"4 of 4 cases failed \(first, 'B=2, T=3': your result differs .+"),
    ("cheats", "ch99-row_sum", NOTHING + r"1 of 3 cases failed \(first, a hidden case(?: \(.+?\))?: your result differs "
                               r"from the expected one: largest error .+\)"),
    ("cheats", "ch99-normalize", r"calls course_attn\.attention\.softmax, which this exercise does "
                                 r"not allow: write the computation yourself"),
    ("cheats", "ch99-count_positive",
     NOTHING + r"3 of 3 cases failed \(first, '\(3, 7\) -> \(3,\)': your result has shape \(\), expected "
     r"\(3,\); hint: .+\)"),
    ("mess", "ch99-double",
     NOTHING + r"4 of 4 cases failed \(first, 'B=2, T=3': ran out of memory \(RuntimeError, line 6 of "
     r"its cell\)\)"),
    ("mess", "ch99-count_positive", r"not answered: the notebook does not define count_positive"),
]


@pytest.mark.parametrize("name, gid, reason", EXPECTED, ids=[f"{n}-{g}" for n, g, _ in EXPECTED])
def test_broken_submission_scores_zero_with_its_reason(graded, name, gid, reason):
    score = scores(graded, name)[gid]
    assert score["points"] == 0 and not score["passed"]
    assert re.fullmatch(reason, score["reason"]), score["reason"]


def test_tampered_cells_are_restored_and_flagged(graded):
    flags = graded["by_name"]["hostile"]["flags"]
    assert flags == [
        "locked cell ch99-setup (cell 2) was modified; the original was run",
        "check cell ch99-normalize (cell 11) was modified; the original was run",
        # the changed setup is not run, but what it reached for is read all the same
        "for review (no points lost): cell 2 imports or reaches the grader's package "
        "(course_attn.grading)",
        f"the evaluation of ch99-double was interrupted after {T} s (time limit); grading went on",
    ]
    # the exercise was graded although the student replaced its check cell by `pass` and
    # defined their own check()
    assert scores(graded, "hostile")["ch99-normalize"]["max_points"] == 2


def test_a_deleted_setup_cell_is_put_back(graded):
    assert graded["by_name"]["broken"]["flags"] == [
        "locked cell ch99-setup was missing; the grader put it back"]


@pytest.mark.parametrize("name, how", [("dies", "died (exit status 1)"),
                                       ("segfault", "died (SIGSEGV)")])
def test_after_the_kernel_dies_the_later_exercises_keep_their_points(graded, name, how):
    entry = graded["by_name"][name]
    assert {gid: e["points"] for gid, e in scores(graded, name).items()} == {
        "ch99-double": 2, "ch99-row_sum": 0, "ch99-normalize": 2, "ch99-count_positive": 3}
    assert (f"the kernel {how} in the evaluation of ch99-row_sum; it was restarted, the cells "
            "before it were run again, and grading went on after it") in entry["flags"]
    if name == "segfault":  # it reached for C: a reviewer is pointed at the cell
        assert "for review (no points lost): cell 7 calls C directly (ctypes)" in entry["flags"]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_processes_that_a_dead_kernel_left_behind_are_killed(graded):
    assert graded["by_name"]["dies"]["exercises"][1]["reason"].startswith("the kernel died")
    assert live_processes(LEFT_BEHIND) == []


ENDED = ("1 process(es) that the notebook's cells started were ended before {} was graded (no "
         "points lost: a graded call runs in the kernel alone, and from then on the kernel can "
         "start no process)")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_a_graded_call_runs_in_the_kernel_alone(graded):
    """Issue 30: a child started in a cell is ended before the first graded call, with a note
    and no point lost; from then on no process starts, in a cell or in a graded call."""
    entry = graded["by_name"]["spawns"]
    points = {gid: e["points"] for gid, e in scores(graded, "spawns").items()}
    assert points == {"ch99-double": 2, "ch99-row_sum": 3, "ch99-normalize": 0,
                      "ch99-count_positive": 3}
    assert entry["notes"] == [ENDED.format("ch99-double")]
    assert entry["flags"] == ["for review (no points lost): cell 4, cell 7, cell 10 starts "
                              "another process (multiprocessing, subprocess, os.fork, os.system)"]
    reason = scores(graded, "spawns")["ch99-normalize"]["reason"]
    assert "PermissionError" in reason and "can start no process" in reason, reason
    assert live_processes(LEFT_BEHIND) == []
    # the restarted kernel of "dies" ran the cell that starts a process again: ended again
    assert graded["by_name"]["dies"]["notes"] == [ENDED.format("ch99-double"),
                                                  ENDED.format("ch99-normalize")]


def test_forgeries_and_patched_grading_code_are_worth_nothing(graded):
    entry = graded["by_name"]["cheats"]
    assert (entry["total"], entry["max"]) == (0, 10)
    assert entry["flags"] == [
        "for review (no points lost): cell 4 replaces the kernel's own machinery (IPython's "
        "user_expressions, execution, replies)",  # its input transformer forges the checks
        "for review (no points lost): cell 13 imports or reaches the grader's package "
        "(course_attn.grading)"]


def test_memory_bomb_huge_output_duplicate_and_reordered_cells(graded):
    """The memory bomb fails its own exercise and the kernel lives on: the next ones pass.
    Cells moved out of their order are graded where they stand, with no flag."""
    entry = graded["by_name"]["mess"]
    got = scores(graded, "mess")
    assert [got[g]["points"] for g in POINTS] == [0, 3, 2, 0]
    assert got["ch99-row_sum"]["reason"] == got["ch99-normalize"]["reason"] == "passed"
    assert entry["flags"] == [
        "cell 11 repeats the grade_id ch99-normalize-solution of cell 10; both ran, in order",
        "cell 7 printed 5,050,000 characters of output",
    ]


def test_an_old_nbformat_is_converted_and_graded(graded):
    entry = graded["by_name"]["v3"]
    assert (entry["total"], entry["max"], entry["error"]) == (10, 10, None)
    assert entry["flags"] == ["the notebook was converted from nbformat 3 to 4 before grading"]
    assert json.loads(graded["paths"]["v3"].read_text())["nbformat"] == 3


def test_files_that_are_not_notebooks_score_zero_with_a_reason(graded):
    truncated = graded["by_name"]["truncated"]
    assert truncated["error"].startswith("invalid JSON (line ")
    assert (truncated["total"], truncated["max"]) == (0, 10)
    assert all(e["reason"] == f"not graded: {truncated['error']}"
               for e in truncated["exercises"])
    not_notebook = graded["by_name"]["not_a_notebook"]
    assert not_notebook["error"] == "not a notebook: JSON without a list of cells"
    assert (not_notebook["total"], not_notebook["max"]) == (0, 10)
    text = graded["by_name"]["text"]
    assert text["error"].startswith("not a notebook: invalid JSON (line 1, column 1)")
    assert text["chapter"] is None
    assert (text["total"], text["max"], text["exercises"]) == (0, 0, [])
    future = graded["by_name"]["future"]
    assert future["error"] == ("not a notebook this grader can read: nbformat 5 (it reads 4 and "
                               "converts 1 to 3)")
    assert (future["total"], future["max"]) == (0, 10)
    assert not any(entry["grader_error"] for entry in graded["report"]["notebooks"])


def test_submitted_files_are_never_modified(graded):
    assert graded["after"] == graded["before"]


def test_json_report_matches_the_table(graded):
    report, table = graded["report"], graded["result"].stdout.splitlines()
    assert report["total"] == sum(entry["total"] for entry in report["notebooks"])
    assert report["max"] == sum(entry["max"] for entry in report["notebooks"])
    for entry in report["notebooks"]:
        rows = [line.split() for line in table if line.startswith(entry["path"] + " ")]
        # the exercise as the check cells name it (ch99.row_sum); nbgrader's grade_id kept
        assert all(e["exercise"] == e["grade_id"].replace("-", ".", 1)
                   for e in entry["exercises"])
        expected = [[entry["path"], e["exercise"], f"{e['points']:g}", "/", f"{e['max_points']:g}",
                     *e["reason"].split()] for e in entry["exercises"]]
        expected.append([entry["path"], "total", f"{entry['total']:g}", "/", f"{entry['max']:g}",
                         *(entry["error"] or "").split()])
        assert rows == expected
        flags = [line.strip() for line in table if line.startswith("    flag: ")]
        assert all(f"flag: {flag}" in flags for flag in entry["flags"])
    assert table[-2] == (f"all {len(report['notebooks'])} notebooks: "
                         f"{report['total']:g} / {report['max']:g}")
    assert table[-1].startswith("credit: by regime (")
    assert {entry["credit"] for entry in report["notebooks"]} == {"by regime"}


UNINTERRUPTIBLE = """import time

def double(x):
    while True:
        try:
            time.sleep(0.05)
        except BaseException:  # swallows the grader's interrupt too
            pass
"""


def test_time_limits_and_a_kernel_that_ignores_interrupts(tmp_path):
    """The notebook's limit (15 s) cuts a cell long before the cell's own (60 s); a kernel that
    swallows the interrupt is restarted, and what is left of the notebook's time is not enough
    for the rest."""
    solution = solution_notebook(FIXTURE_SOLUTIONS / FIXTURE)
    slow = write(edit(solution, replace={
        "ch99-double-solution": "def double(x):\n    while True:\n        pass\n"}),
        tmp_path / "99_slow.ipynb")
    stuck = write(edit(solution, replace={"ch99-double-solution": UNINTERRUPTIBLE}),
                  tmp_path / "99_stuck.ipynb")
    grades = grader.grade_notebooks(
        [slow, stuck], solutions_dir=FIXTURE_SOLUTIONS, cell_timeout=60, notebook_timeout=15,
        check_modules=("course_fixture_ch99",), extra_path=(str(FIXTURES),), jobs=2)
    for grade in grades:
        reason = grade.exercises[0].reason
        assert re.fullmatch(r"timed out after [\d.]+ s \(computing your double for the grader's "
                            r"inputs\)", reason), reason
        assert grade.seconds < 50, grade.seconds  # far less than the 60 s the cell could take
        assert [e.reason for e in grade.exercises[1:]] == [
            "not graded: the notebook did not get that far"] * 3
    slow_flags, stuck_flags = (g.flags for g in grades)
    assert re.fullmatch(r"the notebook's time limit of 15 s was reached before cell 7; the rest "
                        r"was not run", slow_flags[-1]), slow_flags
    assert any(re.fullmatch(r"the kernel stopped answering after [\d.]+ s in the evaluation of "
                            r"ch99-double; it was restarted, .+", flag)
               for flag in stuck_flags), stuck_flags


def test_usage_errors_exit_with_status_2(tmp_path, capsys):
    assert cli.main([str(tmp_path / "missing.ipynb")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert cli.main([str(tmp_path)]) == 2  # a folder without notebooks
    assert "no .ipynb file" in capsys.readouterr().err
    notebook = write(solution_notebook(FIXTURE_SOLUTIONS / FIXTURE), tmp_path / "99_x.ipynb")
    assert cli.main([str(notebook), "--timeout", "0"]) == 2
    assert cli.main([str(notebook), "--solutions", str(tmp_path / "nowhere")]) == 2
    assert cli.main([str(notebook), "--json", str(tmp_path / "no" / "such" / "r.json")]) == 2
    assert cli.main([str(notebook), "--memory-mb", "100"]) == 2
    assert "at least 256" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2


def test_a_kernel_that_cannot_start_is_the_graders_failure(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kernel, "KERNEL_NAME", "no-such-kernel")
    notebook = write(solution_notebook(FIXTURE_SOLUTIONS / FIXTURE), tmp_path / "99_fine.ipynb")
    grade = grader.grade_notebook(notebook, solutions_dir=FIXTURE_SOLUTIONS,
                                  check_modules=("course_fixture_ch99",))
    assert grade.grader_error and grade.error.startswith("could not start a no-such-kernel kernel")
    assert [e.reason for e in grade.exercises] == [f"not graded: {grade.error}"] * 4
    # in the command's worker processes: a memory limit too small for the kernel to start
    assert cli.main([str(notebook), *FIXTURE_OPTIONS, "--workers", "1",
                     "--memory-mb", "256"]) == 1
    out = capsys.readouterr().out
    assert "could not start a python3 kernel" in out and "memory limit of 256 MB" in out


def test_the_kernel_gets_the_folders_of_the_check_modules_not_the_working_folder():
    assert cli.module_folders(["course_fixture_ch99"]) == (str(FIXTURES),)
    # the package itself (its kernel imports a copy), the standard library, nothing at all
    assert cli.module_folders(["course_attn.grading.ch03", "json", "no_such_module"]) == ()


def test_a_check_cell_without_its_metadata_is_still_found_and_not_flagged():
    canonical = load_canonical(FIXTURE_SOLUTIONS / FIXTURE)
    nb = nbformat.read(FIXTURES / "exercises" / FIXTURE, as_version=4)
    check_cell = next(c for c in nb.cells if grade_id(c) == "ch99-double")
    del check_cell.metadata["nbgrader"]
    duplicate = nbformat.v4.new_code_cell('check("ch99.row_sum", row_sum)', metadata={
        "nbgrader": {"grade": True, "grade_id": "ch99-row_sum", "points": 3}})
    nb.cells.append(duplicate)
    restored = restore_protected_cells(nb, canonical)
    assert set(restored.placed) == set(POINTS)
    assert restored.flags == [
        "cell 16 repeats the grade_id ch99-row_sum of cell 8; it was not run"]
    assert nb.cells[15].cell_type == "markdown" and nb.cells[15].source == ""
    assert nb.cells[restored.placed["ch99-row_sum"]].source == \
        canonical.protected["ch99-row_sum"].source
    assert grade_id(nb.cells[restored.placed["ch99-double"]]) == "ch99-double"


def test_a_repeated_or_changed_protected_cell_is_not_run_but_is_read():
    """Issue 41: a cell that repeats a check cell's grade_id with disarming code in it was run
    as written and never scanned. Now it is not run (a markdown cell stands in its place) and
    the review reads it, as it reads a changed setup cell whose original is run instead; the
    course's own cells, as the course wrote them, are not read."""
    import course_fixture_ch99  # noqa: F401 (the exercises of the fixture's chapter)
    canonical = load_canonical(FIXTURE_SOLUTIONS / FIXTURE)
    nb = nbformat.read(FIXTURES / "exercises" / FIXTURE, as_version=4)
    setup = next(c for c in nb.cells if grade_id(c) == "ch99-setup")
    setup.source += "\nfrom course_attn.grading import harness\n"
    nb.cells.append(nbformat.v4.new_code_cell(
        "import course_attn.grading.harness as h\nh.Guard.__enter__ = lambda self: self\n",
        metadata={"nbgrader": {"grade": True, "grade_id": "ch99-row_sum", "points": 3}}))
    written = students_code(nb, canonical)
    restore_protected_cells(nb, canonical)
    assert nb.cells[-1].cell_type == "markdown" and nb.cells[-1].source == ""
    setup_at = next(i for i, c in enumerate(nb.cells) if grade_id(c) == "ch99-setup")
    assert "harness" not in nb.cells[setup_at].source  # the course's setup runs instead
    assert review_flags(written) == [
        f"for review (no points lost): cell {setup_at + 1}, cell {len(nb.cells)} {GRADER}"]


def test_every_cell_without_metadata_the_course_cells_are_found_by_their_source():
    """An editor that drops every cell's metadata: the setup (locked) cell is recognised by
    its source, put back in place, not read as the student's code, and nothing is flagged."""
    canonical = load_canonical(FIXTURE_SOLUTIONS / FIXTURE)
    nb = nbformat.read(FIXTURES / "exercises" / FIXTURE, as_version=4)
    for cell in nb.cells:
        cell.metadata = nbformat.NotebookNode()
    count = len(nb.cells)
    restored = restore_protected_cells(nb, canonical)
    assert restored.flags == [] and len(nb.cells) == count   # nothing inserted
    assert set(restored.placed) == set(POINTS)
    setup = [i for i, cell in enumerate(nb.cells) if grade_id(cell) == "ch99-setup"]
    assert setup == [1] and restored.label(1) == "cell 2"


def test_course_cells_formatted_otherwise_are_the_course_cells():
    """A student's copy made before the course re-formatted its cells (issue 45: solutions/ to
    80 columns) holds the protected cells as they were written then: the same code, so nothing
    is flagged, and they are not read as the student's code."""
    import ast

    import course_fixture_ch99  # noqa: F401 (the exercises of the fixture's chapter)
    canonical = load_canonical(FIXTURE_SOLUTIONS / FIXTURE)
    nb = nbformat.read(FIXTURES / "exercises" / FIXTURE, as_version=4)
    protected = [c for c in nb.cells if grade_id(c) in canonical.protected]
    for cell in protected:  # other quotes and spacing, the comments dropped
        cell.source = ast.unparse(ast.parse(cell.source))
    assert all(c.source != canonical.protected[grade_id(c)].source for c in protected)
    course_cells = {i for i, c in enumerate(nb.cells) if grade_id(c) in canonical.protected}
    assert not course_cells & {i for i, _ in students_code(nb, canonical)}
    restored = restore_protected_cells(nb, canonical)
    assert restored.flags == [] and set(restored.placed) == set(POINTS)
    # a change to what the code does is still one
    nb = nbformat.read(FIXTURES / "exercises" / FIXTURE, as_version=4)
    check_cell = next(c for c in nb.cells if grade_id(c) == "ch99-double")
    check_cell.source = check_cell.source.replace("double)", "lambda x: 2 * x)")
    assert restore_protected_cells(nb, canonical).flags == [
        "check cell ch99-double (cell 5) was modified; the original was run"]


def test_the_canonical_notebook_names_its_exercises_and_points():
    canonical = load_canonical(FIXTURE_SOLUTIONS / FIXTURE)
    assert {e.grade_id: e.points for e in canonical.exercises} == POINTS
    assert [e.key for e in canonical.exercises] == [g.replace("-", ".") for g in POINTS]
    assert set(canonical.protected) == {"ch99-setup", *POINTS}


def test_a_deleted_locked_cell_goes_back_before_the_next_protected_cell():
    canonical = load_canonical(FIXTURE_SOLUTIONS / FIXTURE)
    nb = nbformat.read(FIXTURES / "exercises" / FIXTURE, as_version=4)
    del nb.cells[1]  # the setup
    restored = restore_protected_cells(nb, canonical)
    setup_at = next(i for i, c in enumerate(nb.cells) if grade_id(c) == "ch99-setup")
    double_check = restored.placed["ch99-double"]
    assert setup_at < double_check and grade_id(nb.cells[setup_at + 1]) != "ch99-setup"
    assert restored.label(setup_at) == "a locked cell the grader put back"
    assert restored.label(double_check) == "cell 4"  # the student's numbering
    assert len(nb.cells) == len(restored.numbers) == 15


def test_chapter_comes_from_metadata_then_grade_ids_then_file_name():
    nb = nbformat.v4.new_notebook(metadata={"course_attn": {"chapter": "ch07"}})
    assert chapter_of(nb, "03_masking.ipynb") == "ch07"
    assert chapter_of(nbformat.v4.new_notebook(), "03_masking.ipynb") == "ch03"
    assert chapter_of(None, "answers.ipynb") is None
    # "Copy of 02_….ipynb" without its notebook metadata: its cells' grade_ids say which
    copy = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("x = 1", metadata={"nbgrader": {"grade_id": "ch02-setup"}}),
        nbformat.v4.new_code_cell("y = 2"),
        nbformat.v4.new_code_cell("", metadata={"nbgrader": {"grade_id": "ch02-attention"}})])
    assert chapter_of(copy, "Copy of 02_scaled_dot_product.ipynb") == "ch02"
    copy.cells[1].metadata["nbgrader"] = {"grade_id": "ch05-rope"}   # two chapters: no answer
    assert chapter_of(copy, "Copy of 02_scaled_dot_product.ipynb") is None
    assert chapter_of(copy, "02_scaled_dot_product.ipynb") == "ch02"


def test_a_submission_that_is_a_symbolic_link_is_refused_not_followed(tmp_path):
    """Issue 30: a link to the solutions (``/proc/self/cwd/solutions/…``, or any path), as a
    file on the command line, in a student's folder or at the top of the class folder, or a
    student's folder that is itself a link: refused with a one-line reason, never read."""
    from course_attn.grading.batch import collect_class
    from course_attn.grading.notebook import read_submission
    solution = SOLUTIONS / "02_scaled_dot_product.ipynb"
    refused = "not graded: the file is a symbolic link; submit the notebook itself"
    link = tmp_path / "02_scaled_dot_product.ipynb"
    link.symlink_to("/proc/self/cwd/solutions/02_scaled_dot_product.ipynb")
    assert read_submission(link).problem == refused and read_submission(link).data is None
    klass = tmp_path / "class"
    (klass / "ada").mkdir(parents=True)
    (klass / "ada" / "02_scaled_dot_product.ipynb").symlink_to(solution)
    (klass / "bob.ipynb").symlink_to(solution)
    (klass / "eve").symlink_to(SOLUTIONS)
    found = collect_class(klass)
    assert found.students == ["ada", "bob", "eve"]
    assert [(s.student, s.problem, s.data) for s in found.submissions] == [
        ("ada", refused, None), ("bob", refused, None), ("eve", refused, None)]


def test_a_file_that_is_not_a_regular_file_is_refused(tmp_path):
    from course_attn.grading.notebook import read_submission
    fifo = tmp_path / "03_masking.ipynb"
    os.mkfifo(fifo)
    assert read_submission(fifo).problem == "not graded: not a regular file"
