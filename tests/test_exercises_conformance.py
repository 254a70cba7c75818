"""Every registered exercise, tested the same way (the architecture review's "checks tested once,
not per chapter"); a new chapter's exercises are covered by registering them.

For each exercise ``chNN.name``:

- the solution notebook's answer (its setup cell and solution cells, run in this process) passes
  every public case and the hidden cases drawn with several seeds, without a banned call;
- a stub that raises NotImplementedError, and the exercise notebook's own stub, fail every case
  and read "not answered yet";
- the package's reference passes every public case and the hidden cases of several seeds;
- ``check()`` prints "not answered yet" for a stub, and does not raise;
- every typical mistake it declares fails at least one public case, and is named there by its
  own hint; where another mistake's hint shows instead, the two give the same answer on that
  case; and the hidden cases catch it whatever their seed (the grader draws a fresh one per
  notebook, so a draw that cannot tell the mistake from the answer lets it through);
- a function of inputs has hidden cases, which change with the seed; a function without
  inputs (a prediction) has none.

For each chapter: the solution notebook grades each registered exercise once, its grade cells'
points are the ones its headings announce, and they add up to the total its introduction states.
"""

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import nbformat
import pytest

from course_attn.grading import all_exercises, check, run_exercise
from course_attn.grading.canonical import load_canonical, solution_chapters
from course_attn.grading.exercise import hidden_cases, load_hidden
from course_attn.grading.generate import grade_id, is_grade_cell, is_solution_cell, \
    nbgrader_metadata
from course_attn.grading.judge import NOT_IMPLEMENTED, same_answer

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS, EXERCISES = ROOT / "solutions", ROOT / "exercises"
HIDDEN_SEEDS = range(10)

EXERCISES_BY_KEY = all_exercises()
KEYS = sorted(EXERCISES_BY_KEY)
CHAPTER_NOTEBOOKS = solution_chapters(SOLUTIONS)
CHAPTERS = sorted({key.split(".")[0] for key in KEYS})
load_hidden(SOLUTIONS)


@cache
def notebook_namespace(path: Path) -> dict:
    """What running a notebook's setup (locked code) cells and solution cells leaves behind,
    in order, in a fresh namespace; a cell that raises (an exercise notebook's stub) stops
    only itself."""
    namespace: dict = {"__name__": "__notebook__"}
    for cell in nbformat.read(path, as_version=4).cells:
        meta = nbgrader_metadata(cell)
        if cell.cell_type != "code" or not (is_solution_cell(cell) or meta.get("locked")) or \
                is_grade_cell(cell):
            continue
        try:
            exec(compile(cell.source, f"{path.name}:{grade_id(cell)}", "exec"), namespace)
        except NotImplementedError:
            pass
    return namespace


def answer_in(folder: Path, key: str):
    exercise = EXERCISES_BY_KEY[key]
    path = folder / CHAPTER_NOTEBOOKS[exercise.chapter].name
    return notebook_namespace(path).get(exercise.function, _MISSING)


_MISSING = object()


def stub(*args, **kwargs):
    raise NotImplementedError()


def summary(judgement) -> dict[str, str]:
    return {r.name: r.message for r in judgement.results if not r.passed}


def test_there_are_exercises_and_every_one_has_a_solution_notebook():
    assert len(KEYS) >= 9
    assert set(CHAPTERS) <= set(CHAPTER_NOTEBOOKS), sorted(set(CHAPTERS) - set(CHAPTER_NOTEBOOKS))


@pytest.mark.parametrize("key", KEYS)
def test_the_solution_passes_every_public_case(key):
    exercise, answer = EXERCISES_BY_KEY[key], answer_in(SOLUTIONS, key)
    assert answer is not _MISSING, f"the solution notebook does not define {exercise.function}"
    judgement = run_exercise(exercise, answer)
    assert judgement.results, f"{key} has no public case"
    assert judgement.passed, (summary(judgement), judgement.banned)


@pytest.mark.parametrize("key", KEYS)
def test_the_solution_passes_the_hidden_cases_of_several_seeds(key):
    exercise, answer = EXERCISES_BY_KEY[key], answer_in(SOLUTIONS, key)
    for seed in HIDDEN_SEEDS:
        cases = hidden_cases(key, seed)
        if not cases:
            continue
        judgement = run_exercise(exercise, answer, cases)
        assert judgement.passed, (seed, summary(judgement), judgement.banned)


def as_answer(exercise, fn):
    """What a student would hand in, given a function that computes it."""
    return fn() if exercise.kind == "value" else fn


def takes_inputs(key: str) -> bool:
    """A function of inputs, which a table of the public answers could fake (not a prediction
    or a value, which has one answer)."""
    exercise = EXERCISES_BY_KEY[key]
    return exercise.kind == "function" and any(
        case.args or case.kwargs for case in exercise.public_cases())


@pytest.mark.parametrize("key", KEYS)
def test_the_reference_passes_public_and_hidden_cases(key):
    exercise = EXERCISES_BY_KEY[key]
    reference = as_answer(exercise, exercise.reference)
    assert run_exercise(exercise, reference, watch_banned=False).passed
    for seed in HIDDEN_SEEDS:
        cases = hidden_cases(key, seed)
        assert bool(cases) == takes_inputs(key), (key, seed)
        if cases:
            judgement = run_exercise(exercise, reference, cases, watch_banned=False)
            assert judgement.passed, (seed, summary(judgement))


@pytest.mark.parametrize("key", [k for k in KEYS if takes_inputs(k)])
def test_a_function_of_inputs_has_hidden_cases_that_change_with_the_seed(key):
    drawn = [hidden_cases(key, seed) for seed in HIDDEN_SEEDS]
    assert all(drawn), f"{key} has no hidden cases in solutions/hidden/{key[:4]}.py"
    assert len({repr([c.args for c in cases]) for cases in drawn}) > 1 or len(drawn[0]) > 1


@pytest.mark.parametrize("key", KEYS)
def test_a_stub_fails_every_case_as_not_answered(key):
    exercise = EXERCISES_BY_KEY[key]
    for answer in (stub if exercise.kind == "function" else None, answer_in(EXERCISES, key)):
        if answer is _MISSING:  # the exercise notebook's stub is at the cell's top level
            continue
        judgement = run_exercise(exercise, answer)
        assert judgement.results and not any(r.passed for r in judgement.results)
        if exercise.kind == "function":
            assert judgement.not_implemented, summary(judgement)
            assert {r.message for r in judgement.results} == {NOT_IMPLEMENTED}


@pytest.mark.parametrize("key", [k for k in KEYS if EXERCISES_BY_KEY[k].kind == "function"])
def test_check_says_not_answered_yet_for_a_stub_and_does_not_raise(key, capsys):
    check(key, stub)
    assert "not answered yet" in capsys.readouterr().out


@dataclass(frozen=True)
class Raised:
    """What a mistake that raises gives: the grader names it by this error."""
    type: str
    message: str


def outcome(fn, case):
    try:
        return fn(*case.args, **dict(case.kwargs))
    except Exception as error:
        return Raised(type(error).__name__, str(error).strip())


MISTAKES = [(key, number) for key in KEYS
            for number in range(len(EXERCISES_BY_KEY[key].mistakes))]


@pytest.mark.parametrize("key, number", MISTAKES, ids=[f"{k}-{n}" for k, n in MISTAKES])
def test_a_typical_mistake_fails_a_public_case_with_its_own_hint(key, number):
    exercise = EXERCISES_BY_KEY[key]
    mistake = exercise.mistakes[number]
    answer = as_answer(exercise, mistake.fn)
    judgement = run_exercise(exercise, answer, watch_banned=False)
    failed = [r for r in judgement.results if not r.passed]
    assert failed, f"no public case of {key} catches the mistake {mistake.hint!r}"
    hints = {r.name: r.hint for r in failed}
    assert mistake.hint in hints.values(), (
        f"{key}: the mistake {mistake.hint!r} fails {sorted(hints)} but is never named by its "
        f"own hint; the cases name it {set(hints.values())}")
    others: dict[str, list] = {}  # one hint may name a mistake that raises and one that does not
    for other in exercise.mistakes:
        others.setdefault(other.hint, []).append(other)
    cases = {c.name: c for c in exercise.public_cases()}

    def alike(ours, theirs, case) -> bool:
        return ours == theirs if isinstance(ours, Raised) or isinstance(theirs, Raised) \
            else same_answer(exercise, ours, theirs, case)
    for name, hint in hints.items():
        if hint != mistake.hint and hint in others:  # the other mistake's answer must be ours
            case = cases[name]
            ours = outcome(mistake.fn, case)
            same = any(alike(ours, outcome(other.fn, case), case) for other in others[hint])
            assert same, \
                f"{key}, {name!r}: named {hint!r}, whose answer differs from {mistake.hint!r}"
    if takes_inputs(key):
        missed = [seed for seed in HIDDEN_SEEDS
                  if run_exercise(exercise, answer, hidden_cases(key, seed),
                                  watch_banned=False).passed]
        assert not missed, f"{key}: with seeds {missed}, no hidden case catches {mistake.hint!r}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_solution_notebook_grades_each_exercise_once_and_its_points_add_up(chapter):
    path = CHAPTER_NOTEBOOKS[chapter]
    canonical = load_canonical(path)
    registered = [k for k in KEYS if k.startswith(chapter + ".")]
    graded = [e.key for e in canonical.exercises]
    assert sorted(graded) == registered and len(set(graded)) == len(graded)
    points = [e.points for e in canonical.exercises]
    assert all(p > 0 for p in points)
    text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells
                     if c.cell_type == "markdown")
    headings = [int(p) for p in re.findall(r"^## Exercise \d+: .*\((\d+) points?\)\s*$", text,
                                           re.MULTILINE)]
    assert headings == points, (headings, points)
    totals = {int(t) for t in re.findall(r"(\d+) points in all", text)}
    assert totals == {sum(points)}, (totals, points)
    breakdown = re.search(r"out of (\d+) points \(([\d +]+)\)", text)
    if breakdown:
        assert int(breakdown.group(1)) == sum(points)
        assert [int(p) for p in breakdown.group(2).split("+")] == points


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_exercise_notebook_has_the_same_grade_cells_and_points(chapter):
    solution = nbformat.read(CHAPTER_NOTEBOOKS[chapter], as_version=4)
    exercise = nbformat.read(EXERCISES / CHAPTER_NOTEBOOKS[chapter].name, as_version=4)

    def grade_cells(nb):
        return [(grade_id(c), nbgrader_metadata(c).get("points")) for c in nb.cells
                if is_grade_cell(c)]
    assert grade_cells(exercise) == grade_cells(solution)
