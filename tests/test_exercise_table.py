"""The instructors' table of every exercise (book/instructors.md, "Every exercise") says what the
course holds: each registered exercise once, with its task and points as declared, what the
grader checks beyond its outputs as declared, and every chapter from 4 on asks for at least one
debug and one predict-or-measure exercise."""

import re
from collections import Counter
from pathlib import Path

import pytest

from course_attn.grading import all_exercises
from course_attn.grading.canonical import load_canonical, solution_chapters
from course_attn.grading.exercise import TASKS, credit_parts, load_hidden
from course_attn.grading.operations import (ELEMENTARY, ELU, GROWING, LOGCUMSUMEXP, SOFTMAX,
                                            SOFTMAX_BACKWARD)

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = all_exercises()
load_hidden(ROOT / "solutions")
CHAPTERS = solution_chapters(ROOT / "solutions")
ROW = re.compile(r"^\|\s*`(ch\d\d\.\w+)`\s*\|\s*([\w-]+)\s*\|\s*([\d.]+)\s*\|\s*(\d+ (?:parts|regimes))"
                 r"\s*\|\s*(.+?)\s*\|\s*(.+?)\s*\|$")
# The families of operations that an exercise's allowlist adds to the elementary ones or takes
# away from them, by the name the table gives them
FAMILIES = (("softmax", SOFTMAX), ("softmax's backward", SOFTMAX_BACKWARD), ("elu", ELU),
            ("cat, stack and pad", GROWING), ("logcumsumexp", LOGCUMSUMEXP))


def refused(exercise) -> str:
    """The functions ``exercise`` refuses by name, each once: the package (but what it allows),
    then each function by its own name (a method by its class: ``MultiheadAttention``)."""
    names = []
    for dotted in exercise.banned:
        if dotted == "course_attn":
            kept = dict.fromkeys(name.split(".")[-2] for name in exercise.allowed)
            names.append(f"the package but {', '.join(kept)}" if kept else "the package")
            continue
        parts = dotted.split(".")
        name = parts[-2] if parts[-1] in ("forward", "__init__") else parts[-1]
        names.append(f"`{name}`")
    return ", ".join(dict.fromkeys(names))


def operations_rule(exercise) -> str:
    """The operations ``exercise`` may run, as the elementary ones and the families added or
    taken away; "no tensor operation" for an answer of arithmetic alone."""
    ops = exercise.operations()
    if not ops:
        return "no tensor operation"
    if len(ops) < len(ELEMENTARY) // 2:
        return f"only {len(ops)} tensor operations"
    text, added, removed = "elementary operations", ops - ELEMENTARY, ELEMENTARY - ops
    for name, family in FAMILIES:
        if family <= added:
            text, added = f"{text} + {name}", added - family
        if family <= removed:
            text, removed = f"{text} − {name}", removed - family
    more = (f" + {len(added)} more" if added else "") + (f" − {len(removed)} more" if removed
                                                         else "")
    return text + more


def beyond_the_outputs(exercise) -> str:
    """What the grader checks of ``exercise`` beyond its outputs, from its declaration: a pass
    read once, arguments never copied, no whole (Tq, Tk) table, one token a step through the
    model, the functions refused by name, the operations allowed."""
    rules = []
    if exercise.read_once:
        rules.append(f"one pass over {', '.join(name for _, name in exercise.read_once)}")
    if exercise.no_copy:
        rules.append(f"no copy of {', '.join(name for _, name in exercise.no_copy)}")
    if exercise.no_table:
        rules.append("no whole (Tq, Tk) table")
    if getattr(exercise, "feeds", None):
        rules.append("a token a step through the model")
    if exercise.banned:
        rules.append(f"refuses {refused(exercise)}")
    rules.append(operations_rule(exercise))
    return "; ".join(rules)


def table() -> dict[str, tuple[str, float, str, str, str]]:
    text = (ROOT / "book" / "instructors.md").read_text(encoding="utf-8")
    section = text.split("## Every exercise", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = ROW.match(line.strip())
        if match:
            key, task, points, parts, what, beyond = match.groups()
            assert key not in rows, f"{key} has two rows"
            rows[key] = (task, float(points), parts, what, beyond)
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
    for key, (task, worth, parts, what, _) in rows.items():
        assert task == EXERCISES[key].task, f"{key}: the table says {task}, the declaration " \
                                            f"{EXERCISES[key].task}"
        assert worth == points[key], f"{key}: the table says {worth:g} points, the notebook " \
                                     f"{points[key]:g}"
        assert len(what) > 20, f"{key}: say what it tests"
        assert parts == credit_parts(key), f"{key}: the table says credit in {parts}, the " \
                                           f"declarations {credit_parts(key)}"


def test_the_table_says_what_each_exercise_checks_beyond_its_outputs():
    """The column "checked beyond the outputs" is what the declaration makes the grader check
    (``beyond_the_outputs``): a rule declared and not in the table, or in the table and not
    declared, fails."""
    for key, row in table().items():
        assert row[4] == beyond_the_outputs(EXERCISES[key]), \
            f"{key}: the table says {row[4]!r}, the declaration {beyond_the_outputs(EXERCISES[key])!r}"


@pytest.mark.parametrize("chapter", [f"ch{n:02d}" for n in range(4, 13)])
def test_every_chapter_from_4_has_a_debug_and_a_predict_or_measure_exercise(chapter):
    tasks = Counter(e.task for e in EXERCISES.values() if e.chapter == chapter)
    assert tasks["debug"] >= 1, f"{chapter}: {dict(tasks)}"
    assert tasks["predict"] + tasks["measure"] >= 1, f"{chapter}: {dict(tasks)}"


def test_the_tasks_are_the_ones_the_page_explains():
    text = (ROOT / "book" / "instructors.md").read_text(encoding="utf-8")
    for task in TASKS:
        assert f"**{task}**" in text, f"the instructors' page does not explain {task!r}"
