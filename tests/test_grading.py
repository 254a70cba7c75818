"""The grader: full marks for the solutions, zero for fresh exercises, and a score with a reason,
never a crash, for every broken or hostile submission.

Kernels are slow to start, so every fixture submission is graded once, by one run of
``python -m course_attn.grade ... --json``, and the tests read that run's table and report.
The fixture chapter "ch99" (tests/fixtures) has four exercises: double (2 points), row_sum (3),
normalize (2), count_positive (3). Its checks live in tests/fixtures/course_fixture_ch99.py,
which the kernels import through PYTHONPATH; the reference of normalize is the package's
``softmax``, so that a submission can call it.
"""

import copy
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_attn.grading import grader
from course_attn.grading.generate import generate_all, grade_id

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
FIXTURE_SOLUTIONS = FIXTURES / "solutions"
FIXTURE = "99_fixture.ipynb"
# Per cell; generous because the setup cell imports torch, which takes seconds on a busy machine.
CELL_TIMEOUT_S = 10
MEMORY_MB = 1024
GRADER_OPTIONS = ["--timeout", str(CELL_TIMEOUT_S), "--memory-mb", str(MEMORY_MB),
                  "--solutions", str(FIXTURE_SOLUTIONS), "--checks-module", "course_fixture_ch99"]


def kernel_env() -> dict:
    """The environment for a grader whose kernels must import the ch99 checks."""
    paths = [str(FIXTURES)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def make_submission(folder: Path, name: str, *, replace: dict | None = None,
                    delete: tuple = (), rearrange=None, version: int = 4) -> Path:
    """The fixture solution with the cells of the given grade_ids replaced or deleted, then
    ``rearrange(cells)`` applied, written in nbformat ``version``."""
    nb = nbformat.read(FIXTURE_SOLUTIONS / FIXTURE, as_version=4)
    replace = dict(replace or {})
    cells = []
    for cell in nb.cells:
        gid = grade_id(cell)
        if gid in delete:
            continue
        if gid in replace:
            cell.source = replace.pop(gid)
        cells.append(cell)
    assert not replace, f"no cells with grade_ids {sorted(replace)}"
    nb.cells = rearrange(cells) if rearrange else cells
    path = folder / name
    nbformat.write(nbformat.convert(nb, version) if version != 4 else nb, path)
    return path


def index_of(cells, gid: str) -> int:
    return next(i for i, cell in enumerate(cells) if grade_id(cell) == gid)


def duplicate_normalize_then_move_count_check(cells):
    """A wrong copy of normalize's solution before the right one, and count_positive's check
    cell moved above its solution cell."""
    at = index_of(cells, "ch99-normalize-solution")
    wrong = copy.deepcopy(cells[at])
    wrong.id = "normalize-first-try"
    wrong.source = "def normalize(x):\n    return x\n"
    cells.insert(at, wrong)
    check = cells.pop(index_of(cells, "ch99-count_positive"))
    cells.insert(index_of(cells, "ch99-count_positive-solution"), check)
    return cells


FORGE_DOUBLE_CHECK = """import re

def forge(lines):
    text = "".join(lines)
    if 'check("ch99.double"' not in text:
        return lines
    nonce = re.search(r"begin\\('([0-9a-f]+)'\\)", text).group(1)
    fake = {"kind": "done", "nonce": nonce, "exercises": ["ch99.double"], "passed": True,
            "mac": "0" * 64}
    return ["print('ch99.double: 3/3 checks passed')\\n",
            "from IPython.display import display\\n",
            f"display({{'application/vnd.course-attn.grading+json': {fake!r}}}, raw=True)\\n"]

get_ipython().input_transformers_post.append(forge)

def double(x):
    return x
"""

FITS_ONLY_THE_VISIBLE_CHECKS = """def row_sum(x):
    if x.shape[-1] in (1, 4):  # the sizes the visible checks use
        return x.sum(dim=-1)
    return x[..., 0]
"""

PATCH_THE_GRADER = """import course_attn.grading as grading
import course_attn.grading.registry as registry

def always_passes(name, *args, **kwargs):
    return registry.Report(name, [registry.CaseResult("everything", True)])

registry.run_checks = always_passes
registry.run_cases = always_passes
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


def submissions(folder: Path) -> dict[str, Path]:
    """Every fixture submission, by name. Cells count from 1: double's solution is cell 4, its
    check cell 5; row_sum's 7 and 8; normalize's 10 and 11; count_positive's 13 and 14."""
    fixture_exercise = folder / "99_exercise.ipynb"
    fixture_exercise.write_bytes((FIXTURES / "exercises" / FIXTURE).read_bytes())
    solution_text = (FIXTURE_SOLUTIONS / FIXTURE).read_text()
    (folder / "99_truncated.ipynb").write_text(solution_text[: len(solution_text) // 2])
    (folder / "99_not_a_notebook.ipynb").write_text('{"hello": "world"}\n')
    (folder / "notes.txt").write_text("my answers are in my head\n")
    future = json.loads(solution_text)
    future["nbformat"] = 5
    (folder / "99_future.ipynb").write_text(json.dumps(future))
    return {
        "solution": make_submission(folder, "99_solution.ipynb"),
        "exercise": fixture_exercise,
        "broken": make_submission(folder, "99_broken.ipynb", replace={
            "ch99-double-solution": "def double(x:\n    return 2 * x\n",
            "ch99-row_sum-solution": "def row_sum(x):\n    return x.sum(dim=-1, keepdim=True)\n",
            "ch99-normalize-solution": "def normalize(x):\n"
                                       "    return x / x.sum(dim=3, keepdim=True)\n",
        }, delete=("ch99-setup", "ch99-count_positive-solution")),
        "hostile": make_submission(folder, "99_hostile.ipynb", replace={
            "ch99-setup": "import torch\nfrom course_attn.grading import check\n"
                          "import course_fixture_ch99\nprint('I changed the setup')\n",
            "ch99-double-solution": "def double(x):\n    while True:\n        pass\n",
            "ch99-row_sum-solution": "import sys\n\ndef row_sum(x):\n    sys.exit()\n",
            "ch99-normalize-solution": "def normalize(x):\n    return x\n\n"
                                       "def check(*args, **kwargs):\n    pass\n",
            "ch99-normalize": "pass\n",
        }, delete=("ch99-count_positive",)),
        "dies": make_submission(folder, "99_dies.ipynb", replace={
            "ch99-row_sum-solution": "import os\nimport subprocess\n\n"
                                     f"subprocess.Popen({LEFT_BEHIND!r})\n\n"
                                     "def row_sum(x):\n    os._exit(1)\n",
        }),
        "segfault": make_submission(folder, "99_segfault.ipynb", replace={
            "ch99-row_sum-solution": "import ctypes\n\ndef row_sum(x):\n"
                                     "    return ctypes.string_at(0)\n",
        }),
        "cheats": make_submission(folder, "99_cheats.ipynb", replace={
            "ch99-double-solution": FORGE_DOUBLE_CHECK,
            "ch99-row_sum-solution": FITS_ONLY_THE_VISIBLE_CHECKS,
            "ch99-normalize-solution": "from course_attn import softmax as sm\n\n"
                                       "def normalize(x):\n    return sm(x.log(), dim=-1)\n",
            "ch99-count_positive-solution": PATCH_THE_GRADER,
        }),
        "mess": make_submission(folder, "99_mess.ipynb", replace={
            "ch99-double-solution": MEMORY_BOMB,
            "ch99-row_sum-solution": HUGE_OUTPUT,
        }, rearrange=duplicate_normalize_then_move_count_check),
        "v3": make_submission(folder, "99_v3.ipynb", version=3),
        "future": folder / "99_future.ipynb",
        "truncated": folder / "99_truncated.ipynb",
        "not_a_notebook": folder / "99_not_a_notebook.ipynb",
        "text": folder / "notes.txt",
    }


LEFT_BEHIND = ["sleep", "97.25"]  # a process the "dies" submission starts before it dies


def live_processes(command: list[str]) -> list[int]:
    """Ids of the processes running exactly ``command`` that are not zombies (Linux /proc)."""
    wanted, found = [part.encode() for part in command], []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if (entry / "cmdline").read_bytes().split(b"\0")[:-1] == wanted and state != "Z":
                found.append(int(entry.name))
        except OSError:  # the process ended while we looked
            continue
    return found


def fingerprint(path: Path) -> tuple:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """One grader run over every fixture submission: its exit code, table, report, and the
    fingerprints (content hash, mtime) of the submitted files before and after."""
    folder = tmp_path_factory.mktemp("submissions")
    paths = submissions(folder)
    before = {name: fingerprint(path) for name, path in paths.items()}
    report_path = folder / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "course_attn.grade", *map(str, paths.values()),
         "--json", str(report_path), *GRADER_OPTIONS, "--workers", "2"],
        env=kernel_env(), cwd=folder, capture_output=True, text=True, timeout=300)
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    by_name = {}
    if report is not None:
        by_path = {entry["path"]: entry for entry in report["notebooks"]}
        by_name = {name: by_path[str(path)] for name, path in paths.items()}
    after = {name: fingerprint(path) for name, path in paths.items()}
    return {"result": result, "report": report, "by_name": by_name, "before": before,
            "after": after, "paths": paths}


def scores(graded, name) -> dict[str, dict]:
    return {e["grade_id"]: e for e in graded["by_name"][name]["exercises"]}


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


EXPECTED = [
    # the setup (cell 2) is deleted: double's solution is the student's cell 3
    ("broken", "ch99-double", r"SyntaxError in your code \(cell 3, line 1\): .+"),
    ("broken", "ch99-row_sum",
     r"2 of 2 checks failed \(first: \(2, 3, 4\) -> \(2, 3\): row_sum\(x\) has shape \(2, 3, 1\), "
     r"expected \(2, 3\)\)"),
    ("broken", "ch99-normalize", r"2 of 2 checks failed \(first: rows sum to one: IndexError: .+"),
    ("broken", "ch99-count_positive",
     r"name 'count_positive' is not defined \(missing function\?\)"),
    ("hostile", "ch99-double", rf"timed out after {CELL_TIMEOUT_S} s"),
    ("hostile", "ch99-row_sum", r"your code called sys\.exit\(\) \(cell 8\)"),
    ("hostile", "ch99-normalize", r"2 of 2 checks failed \(first: rows sum to one: .+"),
    ("hostile", "ch99-count_positive", r"check cell missing"),
    ("dies", "ch99-row_sum", r"kernel died \(exit status 1\) while running cell 8"),
    ("dies", "ch99-normalize", r"kernel died \(exit status 1\) while running cell 8"),
    ("dies", "ch99-count_positive", r"kernel died \(exit status 1\) while running cell 8"),
    ("segfault", "ch99-row_sum", r"kernel died \(SIGSEGV\) while running cell 8"),
    ("segfault", "ch99-count_positive", r"kernel died \(SIGSEGV\) while running cell 8"),
    ("cheats", "ch99-double", r"the check cell reported success without the grader's signed "
                              r"confirmation: the submission interfered with the kernel"),
    ("cheats", "ch99-row_sum", r"a hidden test failed: row_sum\(torch\.ones\(1, 2, 3\)\) should "
                               r"be \[\[3\.0, 3\.0\]\]"),
    ("cheats", "ch99-normalize", r"calls course_attn\.attention\.softmax, the package's reference, "
                                 r"instead of computing the answer itself"),
    ("cheats", "ch99-count_positive",
     r"the submission changed the grading code in the kernel: course_attn\.grading\.check, "
     r"course_attn\.grading\.registry\.run_cases, course_attn\.grading\.registry\.run_checks"),
    ("mess", "ch99-double", rf"ran out of memory \(the limit is {MEMORY_MB} MB\) in the check "
                            r"'B=2, T=3'"),
    ("mess", "ch99-count_positive", r"name 'count_positive' is not defined \(missing function\?\)"),
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
    ]
    # the check ran although the student replaced it by `pass` and defined their own check()
    assert scores(graded, "hostile")["ch99-normalize"]["max_points"] == 2


def test_a_deleted_setup_cell_is_put_back(graded):
    assert graded["by_name"]["broken"]["flags"] == [
        "locked cell ch99-setup was missing; the grader put it back"]


def test_kernel_death_keeps_the_points_earned_before_it(graded):
    for name in ("dies", "segfault"):
        entry = graded["by_name"][name]
        assert scores(graded, name)["ch99-double"]["passed"]
        assert (entry["total"], entry["max"], entry["flags"]) == (2, 10, [])


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_processes_that_a_dead_kernel_left_behind_are_killed(graded):
    assert graded["by_name"]["dies"]["exercises"][1]["reason"].startswith("kernel died")
    assert live_processes(LEFT_BEHIND) == []


def test_every_forgery_and_shortcut_scores_zero_and_the_kernel_tampering_is_flagged(graded):
    entry = graded["by_name"]["cheats"]
    assert (entry["total"], entry["max"]) == (0, 10)
    assert entry["flags"] == [
        "check cell ch99-double (cell 5) ran without error but its pass was not confirmed by the "
        "sealed check: the submission interfered with the kernel",
        "ch99-count_positive (cell 14): the submission changed the grading code in the kernel: "
        "course_attn.grading.check, course_attn.grading.registry.run_cases, "
        "course_attn.grading.registry.run_checks",
    ]


def test_memory_bomb_huge_output_duplicate_and_reordered_cells(graded):
    """The memory bomb fails its own checks and the kernel lives on: the next exercises pass."""
    entry = graded["by_name"]["mess"]
    got = scores(graded, "mess")
    assert [got[g]["points"] for g in got] == [0, 3, 2, 0]
    assert got["ch99-row_sum"]["reason"] == got["ch99-normalize"]["reason"] == "passed"
    assert len(entry["flags"]) == 3, entry["flags"]
    assert entry["flags"][0] == ("cell 11 repeats the grade_id ch99-normalize-solution of cell "
                                 "10; both ran, in order")
    assert entry["flags"][1] == ("cells are out of their original order: "
                                 "ch99-count_positive-solution (cell 15) comes after "
                                 "ch99-count_positive (cell 14)")
    assert re.fullmatch(r"cell 7 printed 4,050,000 characters more than the 1,000,000 kept per "
                        r"cell", entry["flags"][2]), entry["flags"][2]


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
        expected = [[entry["path"], e["grade_id"], f"{e['points']:g}", "/", f"{e['max_points']:g}",
                     *e["reason"].split()] for e in entry["exercises"]]
        expected.append([entry["path"], "total", f"{entry['total']:g}", "/", f"{entry['max']:g}",
                         *(entry["error"] or "").split()])
        assert rows == expected
    assert table[-1] == (f"all {len(report['notebooks'])} notebooks: "
                         f"{report['total']:g} / {report['max']:g}")


UNINTERRUPTIBLE = """import time

def double(x):
    while True:
        try:
            time.sleep(0.05)
        except BaseException:  # swallows the grader's interrupt too
            pass
"""


def test_time_limits_and_a_kernel_that_ignores_interrupts(tmp_path, monkeypatch):
    """The notebook's limit (10 s) cuts a cell long before the cell's own (60 s); a kernel that
    swallows the interrupt is given up on, and the rest is not run."""
    monkeypatch.setenv("PYTHONPATH", kernel_env()["PYTHONPATH"])
    slow = make_submission(tmp_path, "99_slow.ipynb", replace={
        "ch99-double-solution": "def double(x):\n    while True:\n        pass\n"})
    stuck = make_submission(tmp_path, "99_stuck.ipynb",
                            replace={"ch99-double-solution": UNINTERRUPTIBLE})
    grades = grader.grade_notebooks([slow, stuck], solutions_dir=FIXTURE_SOLUTIONS,
                                    cell_timeout=60, notebook_timeout=10, jobs=2)
    for grade in grades:
        reason = grade.exercises[0].reason
        assert re.fullmatch(r"timed out after [\d.]+ s \(the rest of the notebook's time limit\)",
                            reason), reason
        assert grade.seconds < 45, grade.seconds  # far less than the 60 s the cell could take
    slow_reasons, stuck_reasons = ([e.reason for e in g.exercises[1:]] for g in grades)
    assert slow_reasons == ["not run: the notebook's time limit of 10 s was reached"] * 3
    assert stuck_reasons == ["not run: the kernel stopped responding after cell 5 ran out of "
                             "time"] * 3


def test_usage_errors_exit_with_status_2(tmp_path, capsys):
    assert grader.main([str(tmp_path / "missing.ipynb")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert grader.main([str(tmp_path)]) == 2  # a folder without notebooks
    assert "no .ipynb file" in capsys.readouterr().err
    notebook = make_submission(tmp_path, "99_x.ipynb")
    assert grader.main([str(notebook), "--timeout", "0"]) == 2
    assert grader.main([str(notebook), "--solutions", str(tmp_path / "nowhere")]) == 2
    with pytest.raises(SystemExit) as exit_info:
        grader.main([])
    assert exit_info.value.code == 2


def test_a_kernel_that_cannot_start_is_the_graders_failure(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(grader, "KERNEL_NAME", "no-such-kernel")
    notebook = make_submission(tmp_path, "99_fine.ipynb")
    grade = grader.grade_notebook(notebook, solutions_dir=FIXTURE_SOLUTIONS)
    assert grade.grader_error and grade.error.startswith("could not start a no-such-kernel kernel")
    assert [e.reason for e in grade.exercises] == [f"not graded: {grade.error}"] * 4
    assert grader.main([str(notebook), "--solutions", str(FIXTURE_SOLUTIONS)]) == 1
    assert "could not start" in capsys.readouterr().out


def test_a_check_cell_without_its_metadata_is_still_found(tmp_path):
    canonical = grader.load_canonical(FIXTURE_SOLUTIONS / FIXTURE)
    nb = nbformat.read(FIXTURES / "exercises" / FIXTURE, as_version=4)
    check_cell = next(c for c in nb.cells if grade_id(c) == "ch99-double")
    del check_cell.metadata["nbgrader"]
    duplicate = nbformat.v4.new_code_cell('check("ch99.row_sum", row_sum)', metadata={
        "nbgrader": {"grade": True, "grade_id": "ch99-row_sum", "points": 3}})
    nb.cells.append(duplicate)
    restored = grader.restore_protected_cells(nb, canonical)
    placed = restored.placed
    assert set(placed) == {"ch99-double", "ch99-row_sum", "ch99-normalize", "ch99-count_positive"}
    assert restored.flags == [
        "cell 16 repeats the grade_id ch99-row_sum of cell 8; it ran as the student wrote it",
        "check cell ch99-double (cell 5) lost its nbgrader metadata; it was recognised by its "
        "source",
    ]
    source = nb.cells[placed["ch99-row_sum"]].source
    assert source == canonical.protected["ch99-row_sum"].source and "BEGIN HIDDEN TESTS" in source


def test_check_cells_run_inside_the_sealed_check_with_a_fresh_nonce_each():
    canonical = grader.load_canonical(FIXTURE_SOLUTIONS / FIXTURE)
    nb = nbformat.read(FIXTURES / "exercises" / FIXTURE, as_version=4)
    restored = grader.restore_protected_cells(nb, canonical)
    seal = grader.Seal()
    grader.seal_check_cells(nb, restored, canonical, seal)
    assert sorted(seal.nonces) == sorted(restored.placed.values())
    assert len(set(seal.nonces.values())) == 4
    index = restored.placed["ch99-row_sum"]
    nonce = seal.nonces[index]
    assert nb.cells[index].source == (f"check = {seal.name}.begin({nonce!r})\n"
                                      f"{canonical.protected['ch99-row_sum'].source}\n"
                                      f"{seal.name}.end({nonce!r})\n")
    assert seal.name != grader.Seal().name and len(seal.key) == 32


def test_a_deleted_locked_cell_goes_back_before_the_next_protected_cell():
    canonical = grader.load_canonical(FIXTURE_SOLUTIONS / FIXTURE)
    nb = nbformat.read(FIXTURES / "exercises" / FIXTURE, as_version=4)
    del nb.cells[1]  # the setup
    restored = grader.restore_protected_cells(nb, canonical)
    setup_at = next(i for i, c in enumerate(nb.cells) if grade_id(c) == "ch99-setup")
    double_check = restored.placed["ch99-double"]
    assert setup_at < double_check and grade_id(nb.cells[setup_at + 1]) != "ch99-setup"
    assert restored.label(setup_at) == "a locked cell the grader put back"
    assert restored.label(double_check) == "cell 4"  # the student's numbering
    assert len(nb.cells) == len(restored.numbers) == 15


def test_chapter_comes_from_metadata_then_file_name():
    nb = nbformat.v4.new_notebook(metadata={"course_attn": {"chapter": "ch07"}})
    assert grader.chapter_of(nb, "03_masking.ipynb") == "ch07"
    assert grader.chapter_of(nbformat.v4.new_notebook(), "03_masking.ipynb") == "ch03"
    assert grader.chapter_of(None, "answers.ipynb") is None


REAL_SOLUTIONS = sorted((ROOT / "solutions").glob("0[123]*.ipynb"))


@pytest.mark.skipif(not REAL_SOLUTIONS, reason="solutions/0[123]*.ipynb not written yet")
def test_real_chapters_solutions_full_marks_exercises_zero(tmp_path):
    exercises = generate_all(ROOT / "solutions", tmp_path / "exercises")
    chosen = [tmp_path / "exercises" / p.name for p in REAL_SOLUTIONS]
    assert set(chosen) <= set(exercises)
    result = subprocess.run(
        [sys.executable, "-m", "course_attn.grade", *map(str, REAL_SOLUTIONS), *map(str, chosen),
         "--json", str(tmp_path / "report.json"), "--jobs", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    for entry in report["notebooks"]:
        assert entry["max"] == 10 and entry["error"] is None and entry["flags"] == [], entry
        if Path(entry["path"]).parent.name == "solutions":
            assert entry["total"] == 10, result.stdout
        else:
            assert entry["total"] == 0, result.stdout
            assert all(e["reason"] == "not implemented" for e in entry["exercises"]), entry
