"""No credit for a non-answer (issue 42). For every registered exercise answered by a function,
each of these scores 0 on every seed drawn here, judged in this process as the grader judges
(``check.grade_here``: public cases, then the hidden ones of the seed, credit by regime or part):

- the code the student starts from, unchanged: a debug exercise's given function
  (``Exercise.given``), any other's stub as the exercise notebook shows it;
- a constant: the reference's answer to the first public case, whatever the input;
- answers that read nothing of the input but its shape: ones or zeros shaped as the right
  answer (numbers 1 or 0, strings empty), and the first tensor argument handed back (the
  identity, where the answer is a tensor).

Each is right somewhere (a constant on its own case, ones on a causal mask of one query, the
identity on a rotation by position 0, zeros where nothing repeats): a regime in which it is
right earns nothing while it fails the regime the exercise is about (its central regime), or
every hidden case, or gives one answer whatever the input (``judge.Judgement.non_answer``).
"""

import ast
import copy
import json
import math
from pathlib import Path

import pytest
import torch

from course_attn.grading import all_exercises
from course_attn.grading.check import grade_here

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = all_exercises()
FUNCTIONS = sorted(key for key, exercise in EXERCISES.items() if exercise.kind == "function")
SEEDS = range(3)


def starting_code(exercise):
    """The function the student starts from: the given one of a debug exercise, else the
    definition of ``exercise.function`` in the exercise notebook's code (its stub)."""
    if exercise.given is not None:
        return exercise.given
    number = exercise.chapter.removeprefix("ch")
    notebook, = ROOT.glob(f"exercises/{number}_*.ipynb")
    for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] != "code":
            continue
        try:
            tree = ast.parse("".join(cell["source"]))
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == exercise.function:
                namespace = {"torch": torch, "math": math}
                exec(compile(ast.Module([node], []), str(notebook), "exec"), namespace)
                return namespace[exercise.function]
    raise AssertionError(f"{exercise.key}: {notebook.name} defines no {exercise.function}")


def shaped(value, fill: int):
    """``value`` with every number ``fill`` (tensors of its shape and dtype, bools, ints,
    floats) and every string empty, item by item through tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, fill)
    if isinstance(value, (bool, int, float)):
        return type(value)(fill)
    if isinstance(value, str):
        return ""
    if isinstance(value, (tuple, list)):
        return type(value)(shaped(item, fill) for item in value)
    if isinstance(value, dict):
        return {key: shaped(item, fill) for key, item in value.items()}
    return value


def non_answers(exercise):
    """(name, function) for each non-answer above."""
    first = exercise.expected(exercise.public_cases()[0])

    def constant(*args, **kwargs):
        return first

    def filled(fill):
        def fn(*args, **kwargs):
            return shaped(exercise.reference(*copy.deepcopy(args), **copy.deepcopy(kwargs)),
                          fill)
        return fn

    def identity(*args, **kwargs):
        return next(a for a in args if isinstance(a, torch.Tensor)).clone()

    found = [("the starting code", starting_code(exercise)), ("a constant", constant),
             ("ones", filled(1)), ("zeros", filled(0))]
    case = exercise.public_cases()[0]
    if isinstance(first, torch.Tensor) and any(isinstance(a, torch.Tensor) for a in case.args):
        found.append(("the identity", identity))
    return found


@pytest.mark.parametrize("key", FUNCTIONS)
def test_a_non_answer_scores_0(key):
    exercise = EXERCISES[key]
    for name, answer in non_answers(exercise):
        for seed in SEEDS:
            judgement = grade_here(exercise, answer, seed, watch_banned=False)
            assert judgement.credit() == 0, (name, seed, judgement.reason())


def test_the_starting_code_is_the_exercise_notebooks():
    """A stub is read from the notebook (it raises NotImplementedError); a debug exercise's is
    its given function, which answers something."""
    exercise = EXERCISES["ch03.causal_mask"]
    with pytest.raises(NotImplementedError):
        starting_code(exercise)(3, 3)
    debug = next(e for e in EXERCISES.values() if e.task == "debug")
    assert starting_code(debug) is debug.given
