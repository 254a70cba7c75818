"""The instructors' table of every exercise (book/instructors.md, "Every exercise") says what the
course holds: each registered exercise once, with its task and points as declared, and every
chapter from 4 on asks for at least one debug and one predict-or-measure exercise."""

import re
from collections import Counter
from pathlib import Path

import pytest

from course_attn.grading import all_exercises
from course_attn.grading.canonical import load_canonical, solution_chapters
from course_attn.grading.exercise import TASKS, credit_parts, load_hidden

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = all_exercises()
load_hidden(ROOT / "solutions")
CHAPTERS = solution_chapters(ROOT / "solutions")
ROW = re.compile(r"^\|\s*`(ch\d\d\.\w+)`\s*\|\s*([\w-]+)\s*\|\s*([\d.]+)\s*\|\s*(\d+ (?:parts|regimes))"
                 r"\s*\|\s*(.+?)\s*\|$")


def table() -> dict[str, tuple[str, float, str, str]]:
    text = (ROOT / "book" / "instructors.md").read_text(encoding="utf-8")
    section = text.split("## Every exercise", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = ROW.match(line.strip())
        if match:
            key, task, points, parts, what = match.groups()
            assert key not in rows, f"{key} has two rows"
            rows[key] = (task, float(points), parts, what)
    return rows


def declared_points() -> dict[str, float]:
    points = {}
    for path in CHAPTERS.values():
        for graded in load_canonical(path).exercises:
            points[graded.key] = graded.points
    return points


def test_the_table_lists_every_exercise_with_its_task_and_points():
    rows, points = table(), declared_points()
    assert sorted(rows) == sorted(EXERCISES), \
        f"missing: {sorted(set(EXERCISES) - set(rows))}; unknown: {sorted(set(rows) - set(EXERCISES))}"
    for key, (task, worth, parts, what) in rows.items():
        assert task == EXERCISES[key].task, f"{key}: the table says {task}, the declaration " \
                                            f"{EXERCISES[key].task}"
        assert worth == points[key], f"{key}: the table says {worth:g} points, the notebook " \
                                     f"{points[key]:g}"
        assert len(what) > 20, f"{key}: say what it tests"
        assert parts == credit_parts(key), f"{key}: the table says credit in {parts}, the " \
                                           f"declarations {credit_parts(key)}"


@pytest.mark.parametrize("chapter", [f"ch{n:02d}" for n in range(4, 13)])
def test_every_chapter_from_4_has_a_debug_and_a_predict_or_measure_exercise(chapter):
    tasks = Counter(e.task for e in EXERCISES.values() if e.chapter == chapter)
    assert tasks["debug"] >= 1, f"{chapter}: {dict(tasks)}"
    assert tasks["predict"] + tasks["measure"] >= 1, f"{chapter}: {dict(tasks)}"


def test_the_tasks_are_the_ones_the_page_explains():
    text = (ROOT / "book" / "instructors.md").read_text(encoding="utf-8")
    for task in TASKS:
        assert f"**{task}**" in text, f"the instructors' page does not explain {task!r}"
