"""A hint says what the student did wrong, never what is right (issue 31): no declared hint of
any exercise, a typical mistake's or a case's own, holds the answer of that exercise's public
cases, or the formula the exercise asks for."""

import math
import re

import pytest

from course_attn.grading import all_exercises

EXERCISES = all_exercises()

# The formulas that hints gave away before (issue 31), as the exercises ask for them.
GIVEAWAYS = {
    "ch05.rope_predictions": ["base^(-(D-2)/D)", "R((n - m)θ)"],
    "ch08.decode_step": ["start at position L", "instead of L"],
    "ch08.mla_decode_step": ["start at position L"],
    "ch04.causal_self_attention": ["time must come before the heads"],
}


def numbers_in(value) -> list[str]:
    """The ways a number of the answer would be written in a hint: the whole numbers of two
    digits or more and every other finite number (a 0, 1 or 2 says nothing of an answer)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or (float(value).is_integer() and abs(value) < 10):
            return []
        written = {f"{value:g}", f"{value:.3g}", f"{value:.2f}"}
        if float(value).is_integer():
            written.add(str(int(value)))
        return sorted(w for w in written if not re.fullmatch(r"-?\d", w))
    if isinstance(value, dict):
        return [n for item in value.values() for n in numbers_in(item)]
    if isinstance(value, (list, tuple)) and len(value) <= 8:
        return [n for item in value for n in numbers_in(item)]
    return []


def hints(exercise):
    return [case.hint for case in exercise.public_cases() if case.hint] + \
        [mistake.hint for mistake in exercise.mistakes]


@pytest.mark.parametrize("key", sorted(EXERCISES))
def test_no_hint_holds_the_answer_of_a_public_case(key):
    exercise = EXERCISES[key]
    every_hint = hints(exercise)
    for case in exercise.public_cases():
        for number in numbers_in(exercise.expected(case)):
            pattern = r"(?<![\w.])" + re.escape(number) + r"(?![\w])"
            leaking = [hint for hint in every_hint if re.search(pattern, hint)]
            assert not leaking, f"{key}, {case.name!r}: the answer {number} is in {leaking}"


@pytest.mark.parametrize("key", sorted(GIVEAWAYS))
def test_no_hint_states_the_formula_the_exercise_asks_for(key):
    for hint in hints(EXERCISES[key]):
        for formula in GIVEAWAYS[key]:
            assert formula not in hint, f"{key}: {hint!r}"


def test_the_rule_catches_a_hint_that_gives_the_number():
    assert numbers_in({"a": 12, "b": 0.5, "c": 3}) == ["12", "12.00", "0.5", "0.50"]
    assert re.search(r"(?<![\w.])" + re.escape("12") + r"(?![\w])", "the answer is 12 tokens")


def one_entry_off(value, part=""):
    """``value`` with one entry changed (the first of its first tensor), which no typical
    mistake gives; what holds no tensor is changed everywhere (test_hidden_regimes)."""
    import torch
    from test_hidden_regimes import changed
    if isinstance(value, torch.Tensor) and value.numel():
        value = value.clone()
        flat = value.view(-1) if value.is_contiguous() else value.reshape(-1)
        flat[0] = ~flat[0] if value.dtype == torch.bool else flat[0] + 0.37 if \
            value.is_floating_point() else flat[0] + 1
        return flat.view(value.shape)
    if isinstance(value, (tuple, list)) and value:
        return type(value)([one_entry_off(value[0]), *value[1:]])
    if isinstance(value, dict) and value:
        key = part or next(iter(value))
        return {**value, key: one_entry_off(value[key])}
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value * 1.37 + 1000)  # past any count a mistake reaches (x * 1.37 + 3 turned
        # first_divergence's 0 into 3, the count of every agreeing token: a declared mistake's answer)
    if isinstance(value, float) and math.isfinite(value):
        return value * 1.37 + 3       # off by a factor no mistake makes
    return changed(value, part)


@pytest.mark.parametrize("key", sorted(EXERCISES))
def test_a_wrong_answer_that_is_no_declared_mistake_gets_no_named_hint(key):
    """An answer with one entry off, which no typical mistake gives, is told what differs,
    and no mistake is named."""
    from course_attn.grading.judge import Answer, judge_case
    import torch
    exercise = EXERCISES[key]
    for case in exercise.public_cases()[:3]:
        expected = exercise.expected(case)
        if isinstance(expected, torch.Tensor) and expected.numel() < 2:
            continue   # its one entry changed may well be a typical mistake
        wrong = one_entry_off(expected, case.part)
        result = judge_case(exercise, case, expected, Answer(value=wrong))
        assert not result.passed and not result.named, (case.name, result.hint)


MISTAKES = [(key, number) for key in sorted(EXERCISES) if EXERCISES[key].kind == "function"
            for number in range(len(EXERCISES[key].mistakes))]


@pytest.mark.parametrize("key, number", MISTAKES, ids=[f"{k}-{n}" for k, n in MISTAKES])
def test_a_mistake_is_named_only_where_the_answer_is_that_mistake_everywhere(key, number):
    """Issue 42: a hint named a mistake whenever one failed case's answer was that mistake's
    (three other bugs of ch12.run_requests were all told the leak's hint). An answer that is
    the mistake's on the inputs of the first public case it fails, and the reference's on
    every other input, is named by that hint only where the mistake is wrong on no other input
    (of the parts that fail); else it is not that mistake, and no case names it."""
    from course_attn.grading import run_exercise
    from course_attn.grading.judge import fingerprint, same_answer
    exercise = EXERCISES[key]
    mistake, cases = exercise.mistakes[number], exercise.public_cases()

    def inputs(args, kwargs):
        return fingerprint([list(args), dict(kwargs)])

    def is_wrong(case, fn=mistake.fn, raising=True):
        try:
            value = fn(*case.args, **dict(case.kwargs))
        except Exception:   # a mistake that raises there is not defined there: no evidence
            return raising
        return not same_answer(exercise, value, exercise.expected(case), case)
    wrong = [case for case in cases if is_wrong(case)]
    # where another mistake with the same hint is right, the hint may still be this answer's
    alike = [m.fn for m in exercise.mistakes if m.hint == mistake.hint]
    if not wrong:
        pytest.skip("the mistake fails no public case")
    first = inputs(wrong[0].args, wrong[0].kwargs)

    def partly(*args, **kwargs):
        answer = mistake.fn if inputs(args, kwargs) == first else exercise.reference
        return answer(*args, **kwargs)
    judgement = run_exercise(exercise, partly, watch_banned=False)
    judgement.settle_hints()        # as check() prints it and the grader's reason gives it
    failed_parts = {r.part for r in judgement.results if not r.passed}
    elsewhere = [c for c in wrong if inputs(c.args, c.kwargs) != first and
                 c.part in failed_parts and all(is_wrong(c, fn, False) for fn in alike)]
    named = {r.hint for r in judgement.results if r.named}
    if elsewhere:
        assert mistake.hint not in named, (key, mistake.hint, elsewhere[0].name)
