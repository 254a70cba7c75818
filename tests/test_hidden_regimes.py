"""Hidden cases reach every regime of an exercise's inputs, on every seed (issue 24).

A hidden set is a sample of the input space: drawn by range, a mistake that shows only in one
corner (a causal mask that is wrong only when Tq - Tk > 3) passes whenever the draw misses that
corner. So each exercise's hidden generator (``solutions/hidden/chNN.py``) names its regimes,
as predicates on a case (``@hidden(key, regimes={...})``), and draws a case inside each of them
on every seed. For every registered exercise and every seed 0-99 this proves:

- every declared regime holds at least one hidden case of that seed;
- an answer that is the reference's everywhere except in one regime (there, changed so that
  the exercise's comparison must reject it) fails a hidden case of that seed.
"""

import math
import os

import pytest
import torch
from helpers import each_allocation_trace_once

from course_attn.grading import all_exercises
from course_attn.grading.exercise import hidden_cases, hidden_regimes, load_hidden
from course_attn.grading.judge import Answer, judge_case

SOLUTIONS = os.path.join(os.path.dirname(__file__), "..", "solutions")
SEEDS = range(100)
EXERCISES = all_exercises()
load_hidden(SOLUTIONS)
KEYS = sorted(EXERCISES)


def changed(value, part: str = ""):
    """``value`` made wrong everywhere it can be: every entry of a tensor, every number, every
    string, item by item through tuples, lists and dicts (only ``part`` of a dict, if given)."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool:
            return ~value
        if not (value.is_floating_point() or value.is_complex()):
            return value + 1
        return value + value.abs() + 1
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + abs(value) + 1 if math.isfinite(value) else 0.0
    if isinstance(value, str):
        return value + " (changed)"
    if isinstance(value, (tuple, list)):
        return type(value)(changed(item) for item in value)
    if isinstance(value, dict):
        return {key: changed(item) if not part or key == part else item
                for key, item in value.items()}
    return 0 if value is None else value


@pytest.mark.parametrize("key", KEYS)
def test_every_exercise_names_the_regimes_its_hidden_cases_cover(key):
    regimes = hidden_regimes(key)
    assert len(regimes) >= 2, f"{key}: its hidden cases name {len(regimes)} regime(s)"


@pytest.fixture(scope="module", autouse=True)
def _allocations_traced_once():
    with each_allocation_trace_once():
        yield


@pytest.mark.parametrize("key", KEYS)
def test_every_seed_draws_every_regime_and_an_answer_wrong_in_one_regime_fails(key):
    exercise, regimes = EXERCISES[key], hidden_regimes(key)
    for seed in SEEDS:
        cases = hidden_cases(key, seed)
        caught = {}  # case's index -> whether the changed answer fails it (a case may lie in
        # several regimes: judged once)
        for name, inside in regimes.items():
            chosen = [i for i, case in enumerate(cases) if inside(case)]
            assert chosen, f"{key}: seed {seed} draws no hidden case in the regime {name!r}"
            for i in chosen:
                if i not in caught:
                    expected = exercise.expected(cases[i])
                    wrong = Answer(value=changed(expected, getattr(cases[i], "part", "")))
                    caught[i] = not judge_case(exercise, cases[i], expected, wrong,
                                               hidden=True).passed
            assert any(caught[i] for i in chosen), \
                f"{key}: an answer wrong in the regime {name!r} passes seed {seed}"


# --- no credit for a non-answer (issue 42) -------------------------------------------------------

NON_ANSWER_SEEDS = range(3)


def _not_implemented(*args, **kwargs):
    raise NotImplementedError()


@pytest.mark.parametrize("key", KEYS)
def test_the_given_code_unchanged_and_a_constant_answer_score_0(key):
    """A debug exercise's given function handed in unchanged (any other exercise's given stub)
    earns nothing, and so does an answer that ignores its input: the reference's answer to the
    first public case, returned whatever the input (for a value exercise there is no input)."""
    from course_attn.grading.check import grade_here
    exercise = EXERCISES[key]
    if exercise.kind == "value":
        pytest.skip("a value exercise answers one question: no input to ignore")
    first = exercise.expected(exercise.public_cases()[0])

    def constant(*args, **kwargs):
        return first
    for seed in NON_ANSWER_SEEDS:
        for answer in (exercise.given or _not_implemented, constant):
            judgement = grade_here(exercise, answer, seed, watch_banned=False)
            assert judgement.credit() == 0, (key, seed, answer.__name__, judgement.reason())
