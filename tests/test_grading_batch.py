"""Grading a class end to end: ``python -m course_attn.grade DIR --gradebook OUT --workers 2``.

- 50 submissions of the fixture chapter ch99, made from its solution with faults drawn at random
  (seeded): each exercise correct, stubbed, wrong, a syntax error, an exception, or (normalize,
  whose reference is the package's ``softmax``) a call to the reference; and one endless loop
  and one memory bomb, which must not hold up the others. The expected scores come from the
  faults, not from running the grader.
- A few students over the real chapters 2 and 3: folders with several chapters, a file per
  student, two attempts at one chapter, an empty folder, a file that is not a notebook, a
  function that fits the visible checks but not the hidden tests, and a call to the reference.
"""

import csv
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_attn.grading import batch
from course_attn.grading.batch import collect_class, gradebook_paths
from course_attn.grading.generate import generate_notebook, grade_id

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
FIXTURE_SOLUTION = FIXTURES / "solutions" / "99_fixture.ipynb"
CELL_TIMEOUT_S = 5
MEMORY_MB = 1024

POINTS = {"ch99-double": 2, "ch99-row_sum": 3, "ch99-normalize": 2, "ch99-count_positive": 3}
WRONG = {
    "ch99-double": "def double(x):\n    return x + 2\n",
    "ch99-row_sum": "def row_sum(x):\n    return x.sum(dim=-1, keepdim=True)\n",
    "ch99-normalize": "def normalize(x):\n    return x / x.sum()\n",
    "ch99-count_positive": "def count_positive(x):\n    return (x >= 0).sum(dim=-1)\n",
}
REFERENCE_CALLS = [
    "from course_attn import softmax as sm\n\ndef normalize(x):\n    return sm(x.log(), dim=-1)\n",
    "import course_attn\n\nnormalize = lambda x: course_attn.softmax(x.log(), -1)\n",
]
FAULTS = ["correct", "stub", "wrong", "syntax", "exception", "reference"]
RUNAWAYS = {"s03": ("ch99-double", "endless loop"), "s04": ("ch99-row_sum", "memory bomb")}
# How each fault's reason reads (a prefix is enough: the rest names cells and cases).
REASONS = {
    "correct": "passed",
    "stub": "not implemented",
    "wrong": "",  # "N of M checks failed (first: ...)"
    "syntax": "SyntaxError in your code",
    "exception": "",
    "reference": "calls course_attn.attention.softmax, the package's reference",
    "endless loop": f"timed out after {CELL_TIMEOUT_S} s",
    "memory bomb": f"ran out of memory (the limit is {MEMORY_MB} MB) in the check",
}


def kernel_env() -> dict:
    paths = [str(FIXTURES)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def faulty_source(gid: str, fault: str, solution: str, stub: str, rng: random.Random) -> str:
    if fault == "correct":
        return solution
    if fault == "stub":
        return stub
    if fault == "wrong":
        return WRONG[gid]
    if fault == "syntax":
        return solution.replace("):", ")", 1)  # def f(x)  <- no colon
    name = gid.split("-", 1)[1]
    if fault == "exception":
        return f"def {name}(*args, **kwargs):\n    raise ValueError('not today')\n"
    if fault == "endless loop":
        return f"def {name}(*args, **kwargs):\n    while True:\n        pass\n"
    if fault == "memory bomb":
        return (f"import torch\n\ndef {name}(*args, **kwargs):\n    hoard = []\n"
                "    while True:\n        hoard.append(torch.ones(25_000_000))  # 100 MB a time\n")
    return rng.choice(REFERENCE_CALLS)


def draw_faults(rng: random.Random, n: int) -> list[dict[str, str]]:
    """For each of ``n`` students, a fault per exercise: half correct, the rest spread out; and
    the RUNAWAYS."""
    plans = []
    for number in range(n):
        plan = {}
        for gid in POINTS:
            kinds = FAULTS if gid == "ch99-normalize" else FAULTS[:-1]
            plan[gid] = "correct" if rng.random() < 0.5 else rng.choice(kinds[1:])
        if f"s{number:02d}" in RUNAWAYS:
            gid, fault = RUNAWAYS[f"s{number:02d}"]
            plan[gid] = fault
        plans.append(plan)
    return plans


def write_class(root: Path, plans: list[dict[str, str]], rng: random.Random) -> dict[str, dict]:
    """One submission per plan: even students as a file ``sNN.ipynb``, odd ones as a folder
    ``sNN/99_fixture.ipynb``. Returns student -> plan."""
    solution = nbformat.read(FIXTURE_SOLUTION, as_version=4)
    exercise = generate_notebook(solution)
    stubs = {grade_id(c): c.source for c in exercise.cells}
    by_student = {}
    for number, plan in enumerate(plans):
        nb = nbformat.read(FIXTURE_SOLUTION, as_version=4)
        for cell in nb.cells:
            gid = grade_id(cell) or ""
            exercise_id = gid.removesuffix("-solution")
            if gid.endswith("-solution") and exercise_id in plan:
                cell.source = faulty_source(exercise_id, plan[exercise_id], cell.source,
                                            stubs[gid], rng)
        student = f"s{number:02d}"
        if number % 2:
            (root / student).mkdir()
            nbformat.write(nb, root / student / "99_fixture.ipynb")
        else:
            nbformat.write(nb, root / f"{student}.ipynb")
        by_student[student] = plan
    return by_student


def grade_class(root: Path, out: Path, *extra: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "course_attn.grade", str(root), "--gradebook", str(out),
         "--workers", "2", "--timeout", str(CELL_TIMEOUT_S), *extra],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def fixture_class(tmp_path_factory):
    rng = random.Random(20260422)
    plans = draw_faults(rng, 50)
    root = tmp_path_factory.mktemp("class99")
    expected = write_class(root, plans, rng)
    before = digest(root)
    out = tmp_path_factory.mktemp("gradebook99") / "grades"
    result = grade_class(root, out, "--memory-mb", str(MEMORY_MB), "--solutions",
                         str(FIXTURES / "solutions"), "--checks-module", "course_fixture_ch99",
                         env=kernel_env())
    csv_path, json_path = gradebook_paths(out)
    book = json.loads(json_path.read_text()) if json_path.exists() else None
    return {"plans": expected, "result": result, "book": book, "csv": csv_path,
            "unchanged": digest(root) == before}


def test_the_faults_cover_every_kind(fixture_class):
    drawn = {fault for plan in fixture_class["plans"].values() for fault in plan.values()}
    assert drawn == set(FAULTS) | {fault for _, fault in RUNAWAYS.values()}


def test_fifty_submissions_get_the_scores_their_faults_deserve(fixture_class):
    result, book = fixture_class["result"], fixture_class["book"]
    assert result.returncode == 0, result.stdout + result.stderr
    assert [e["grade_id"] for e in book["exercises"]] == list(POINTS)
    assert book["max"] == 10 and len(book["students"]) == 50
    print(f"\n50 ch99 submissions graded with 2 workers in {book['seconds']} s")
    for student in book["students"]:
        plan = fixture_class["plans"][student["student"]]
        expected = {gid: POINTS[gid] if plan[gid] == "correct" else 0 for gid in POINTS}
        assert student["scores"] == expected, (student["student"], plan, student)
        assert student["total"] == sum(expected.values())
        [notebook] = student["notebooks"]
        assert notebook["counted"] and notebook["error"] is None and notebook["flags"] == []
        for exercise in notebook["exercises"]:
            prefix = REASONS[plan[exercise["grade_id"]]]
            assert exercise["reason"].startswith(prefix), (student["student"], exercise)
            if plan[exercise["grade_id"]] in ("wrong", "exception"):
                assert " checks failed (first: " in exercise["reason"], exercise


def test_the_csv_gradebook_has_a_row_per_student_and_a_column_per_exercise(fixture_class):
    book = fixture_class["book"]
    with open(fixture_class["csv"], newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0] == ["student", *POINTS, "total", "max", "notes"]
    assert [row[0] for row in rows[1:]] == [f"s{n:02d}" for n in range(50)]
    for row, student in zip(rows[1:], book["students"]):
        assert [float(x) for x in row[1:6]] == [*student["scores"].values(), student["total"]]
        assert (row[6], row[7]) == ("10", "")


def test_the_submissions_are_read_once_and_never_changed(fixture_class):
    book = fixture_class["book"]
    assert fixture_class["unchanged"]
    assert book["integrity"] == {"changed_during_grading": []}
    for student in book["students"]:
        [notebook] = student["notebooks"]
        path = Path(notebook["path"])
        assert notebook["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


# --- the real chapters -----------------------------------------------------------------------

SOLUTIONS = ROOT / "solutions"
CHAPTERS = {"ch02": SOLUTIONS / "02_scaled_dot_product.ipynb",
            "ch03": SOLUTIONS / "03_masking.ipynb"}

SCALE_OR_DEFAULT = '''import math

def attention(q, k, v, scale=None):
    """softmax(q kᵀ · scale) v over the keys; no mask."""
    scale = scale or 1.0 / math.sqrt(q.shape[-1])   # 0.0 is falsy: the hidden test catches it
    return stable_softmax(q @ k.transpose(-2, -1) * scale) @ v
'''


def real_notebook(chapter: str, *, exercise: bool = False, replace: dict | None = None):
    nb = nbformat.read(CHAPTERS[chapter], as_version=4)
    if exercise:
        nb = generate_notebook(nb)
    for cell in nb.cells:
        if grade_id(cell) in (replace or {}):
            cell.source = replace[grade_id(cell)]
    return nb


@pytest.fixture(scope="module")
def real_class(tmp_path_factory):
    root = tmp_path_factory.mktemp("class")
    for student in ("ada", "cy", "dee", "eve"):
        (root / student).mkdir()
    (root / "ada" / "week3").mkdir()
    nbformat.write(real_notebook("ch02"), root / "ada" / "02_scaled_dot_product.ipynb")
    nbformat.write(real_notebook("ch03"), root / "ada" / "week3" / "03_masking.ipynb")
    nbformat.write(real_notebook("ch03", exercise=True), root / "ben.ipynb")
    nbformat.write(real_notebook("ch02", replace={"ch02-attention-solution": SCALE_OR_DEFAULT}),
                   root / "cy" / "02_scaled_dot_product.ipynb")
    nbformat.write(real_notebook("ch03", replace={
        "ch03-causal_mask-solution": "from course_attn import causal_mask\n"}),
        root / "cy" / "03_masking.ipynb")
    nbformat.write(real_notebook("ch03", exercise=True), root / "dee" / "03_first_try.ipynb")
    nbformat.write(real_notebook("ch03"), root / "dee" / "03_masking.ipynb")
    (root / "fay.txt").write_text("I will hand it in next week\n")
    (root / ".DS_Store").write_bytes(b"\0")
    out = root / "grades"  # inside the class folder: the gradebook is not taken for a student
    result = grade_class(root, out)
    _, json_path = gradebook_paths(out)
    book = json.loads(json_path.read_text()) if json_path.exists() else None
    return {"root": root, "result": result, "book": book}


def test_a_class_over_the_real_chapters(real_class):
    result, book = real_class["result"], real_class["book"]
    assert result.returncode == 0, result.stdout + result.stderr
    students = {s["student"]: s for s in book["students"]}
    assert list(students) == ["ada", "ben", "cy", "dee", "eve", "fay"]
    assert [e["grade_id"] for e in book["exercises"]] == [
        "ch02-attention_scores", "ch02-stable_softmax", "ch02-attention",
        "ch03-causal_mask", "ch03-padding_mask", "ch03-masked_attention"]
    totals = {name: (s["total"], s["max"]) for name, s in students.items()}
    assert totals == {"ada": (20, 20), "ben": (0, 20), "cy": (13, 20), "dee": (10, 20),
                      "eve": (0, 20), "fay": (0, 20)}
    assert students["ben"]["notes"] == ["no notebook for ch02"]
    assert students["eve"]["notes"] == ["no notebook (.ipynb) in the folder",
                                        "no notebook for ch02", "no notebook for ch03"]
    assert students["fay"]["notes"][-1].startswith("fay.txt: not a notebook: invalid JSON")
    assert students["dee"]["notes"][0] == ("2 notebooks for ch03: 03_masking.ipynb (10) counts, "
                                           "not 03_first_try.ipynb (0)")
    assert [n["counted"] for n in students["dee"]["notebooks"]] == [False, True]
    assert all(not any(n["flags"]) for s in book["students"] for n in s["notebooks"])


def test_hidden_tests_and_reference_calls_in_the_real_chapters(real_class):
    cy = next(s for s in real_class["book"]["students"] if s["student"] == "cy")
    reasons = {e["grade_id"]: e["reason"] for n in cy["notebooks"] for e in n["exercises"]}
    assert reasons["ch02-attention"] == (
        "a hidden test failed: hidden test: attention(q, k, v, scale=0.0) is the mean of the "
        "values differs from the reference: largest error 0.897")
    assert reasons["ch03-causal_mask"] == (
        "calls course_attn.masks.causal_mask, the package's reference, instead of computing the "
        "answer itself")
    assert [reasons[g] for g in ("ch02-attention_scores", "ch02-stable_softmax",
                                 "ch03-padding_mask", "ch03-masked_attention")] == ["passed"] * 4


def test_collect_class_finds_a_file_or_a_folder_per_student(tmp_path):
    (tmp_path / "ann.ipynb").write_text("{}")
    (tmp_path / "bo").mkdir()
    (tmp_path / "bo" / "notes.pdf").write_bytes(b"%PDF")
    (tmp_path / "bo" / "part2").mkdir()
    (tmp_path / "bo" / "part2" / "03_masking.ipynb").write_text("{}")
    (tmp_path / "bo" / "01_intuition.ipynb").write_text("{}")
    (tmp_path / "bo" / ".ipynb_checkpoints").mkdir()
    (tmp_path / "bo" / ".ipynb_checkpoints" / "01_intuition-checkpoint.ipynb").write_text("{}")
    (tmp_path / "cid").mkdir()
    (tmp_path / "dot.txt").write_text("late")
    (tmp_path / ".hidden.ipynb").write_text("{}")
    (tmp_path / "grades.csv").write_text("")
    found = collect_class(tmp_path, skip={(tmp_path / "grades.csv").resolve()})
    assert found.students == ["ann", "bo", "cid", "dot"]
    assert [(s.student, s.path.relative_to(tmp_path).as_posix()) for s in found.submissions] == [
        ("ann", "ann.ipynb"), ("bo", "bo/01_intuition.ipynb"), ("bo", "bo/part2/03_masking.ipynb"),
        ("dot", "dot.txt")]
    assert found.notes == {"cid": ["no notebook (.ipynb) in the folder"]}
    assert found.submissions[0].data == b"{}" and found.submissions[0].sha256 == \
        hashlib.sha256(b"{}").hexdigest()


def test_a_file_too_large_is_not_read(tmp_path, monkeypatch):
    big = tmp_path / "03_masking.ipynb"
    big.write_bytes(b" " * 101)
    monkeypatch.setattr(batch, "MAX_SUBMISSION_BYTES", 100)
    submission = batch.read_submission(big, "zed")
    assert submission.data is None and submission.sha256 is None
    assert submission.problem == ("not graded: the file has 101 bytes, more than the 100 a "
                                  "notebook may have")


def test_gradebook_usage_errors_exit_with_status_2(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    out = str(tmp_path / "grades")
    assert batch.main([str(tmp_path / "a"), str(tmp_path / "b"), "--gradebook", out]) == 2
    assert "give exactly one folder" in capsys.readouterr().err
    assert batch.main([str(tmp_path / "a"), "--gradebook", out, "--json", out + ".json"]) == 2
    assert batch.main([str(tmp_path / "a"), "--gradebook", str(tmp_path / "no" / "g")]) == 2
    assert batch.main([str(tmp_path / "a"), "--gradebook", out, "--memory-mb", "100"]) == 2
    assert "at least 256" in capsys.readouterr().err
    assert batch.main([str(tmp_path / "a"), "--gradebook", out, "--workers", "0"]) == 2
    assert gradebook_paths(tmp_path / "g.csv") == (tmp_path / "g.csv", tmp_path / "g.json")
