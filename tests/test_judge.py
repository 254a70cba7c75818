"""judge.py: how an answer's failures are explained and scored. A multi-part answer is judged
part by part (each part's typical mistakes named on their own, partial credit by parts); a
mistake that raises is named by its error; the one-line reason shows the case whose hint names
a mistake, not merely the first that failed."""

import pytest
import torch

from course_attn.grading import get, run_exercise
from course_attn.grading.cases import count_questions, expect_tensor, randn
from course_attn.grading.exercise import Case, Exercise, Mistake
from course_attn.grading.judge import Answer, CaseResult, Judgement, judge_case

COSTS = count_questions({"a": ("(a) the first count", "a = x·y"),
                         "b": ("(b) the second count", "b = x + y"),
                         "c": ("(c) the third count", "c = x")})


def costs(x, y):
    return {"a": x * y, "b": x + y, "c": x}


def wrong(**parts):
    return lambda x, y: {**costs(x, y), **{k: rule(x, y) for k, rule in parts.items()}}


PARTS = Exercise(
    key="ch99.costs", function="costs", reference=costs,
    cases=lambda: COSTS.cases(dict(x=3, y=5), dict(x=7, y=2)), compare=COSTS.compare,
    mistakes=(Mistake("you added where a is a product", wrong(a=lambda x, y: x + y)),
              Mistake("you multiplied where b is a sum", wrong(b=lambda x, y: x * y))))


def test_two_wrong_parts_each_get_the_hint_that_names_their_own_mistake():
    student = wrong(a=lambda x, y: x + y, b=lambda x, y: x * y)
    judgement = run_exercise(PARTS, student, watch_banned=False)
    hints = {r.part: r.hint for r in judgement.results if not r.passed}
    assert hints == {"a": PARTS.mistakes[0].hint, "b": PARTS.mistakes[1].hint}


@pytest.mark.parametrize("wrong_parts, credit", [({}, 1.0), ({"c": lambda x, y: 0}, 2 / 3),
                                                  ({"a": lambda x, y: 0, "c": lambda x, y: 0},
                                                   1 / 3)])
def test_a_multi_part_answer_earns_the_share_of_its_parts_that_are_right(wrong_parts, credit):
    judgement = run_exercise(PARTS, wrong(**wrong_parts), watch_banned=False)
    assert judgement.credit() == pytest.approx(credit)
    if wrong_parts:
        right = 3 - len(wrong_parts)
        assert judgement.reason().startswith(f"{right} of 3 parts right; ")


def test_a_part_is_right_only_when_every_case_that_judges_it_passes():
    # right on the first sizes only: the part fails
    def student(x, y):
        return {**costs(x, y), "c": 3}
    judgement = run_exercise(PARTS, student, watch_banned=False)
    assert judgement.parts() == {"a": True, "b": True, "c": False}


def test_a_refused_call_or_a_missing_answer_earns_nothing_whatever_the_parts():
    judgement = run_exercise(PARTS, wrong(c=lambda x, y: 0), watch_banned=False)
    judgement.banned = ["torch.softmax"]
    assert judgement.credit() == 0.0
    assert Judgement("ch99.costs", missing=True).credit() == 0.0


def test_a_one_piece_answer_is_all_or_nothing():
    judgement = run_exercise(get("ch04.split_heads"), lambda x, h: x.unsqueeze(1).expand(
        -1, h, -1, -1)[..., : x.shape[-1] // h].contiguous(), watch_banned=False)
    assert not judgement.passed and judgement.parts() == {} and judgement.credit() == 0.0


def _merge_with_view(x):
    b, h, t, d = x.shape
    return x.transpose(1, 2).view(b, t, h * d)


VIEWS = Exercise(
    key="ch99.merge", function="merge",
    reference=lambda x: x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1),
    cases=lambda: [Case("B=2, H=3, T=4, D=5", (randn(2, 3, 4, 5, seed=0),), hint="merge")],
    compare=expect_tensor,
    mistakes=(Mistake("a transposed tensor cannot be .view()ed: use .reshape", _merge_with_view),))


def test_a_mistake_that_raises_is_named_when_the_student_raises_the_same_error():
    judgement = run_exercise(VIEWS, _merge_with_view, watch_banned=False)
    (result,) = judgement.results
    assert not result.passed and result.named and "RuntimeError" in result.message
    assert result.hint == VIEWS.mistakes[0].hint


def test_an_error_no_mistake_raises_gets_no_hint():
    """Issue 31: the case's own hint ("merge") was shown for any error; it guessed at a mistake
    the student may not have made. Now the error's message is the whole reason."""
    def other(x):
        raise ValueError("something else")
    (result,) = run_exercise(VIEWS, other, watch_banned=False).results
    assert not result.named and result.hint == ""
    assert result.message.startswith("ValueError: something else")


def test_a_wrong_value_no_mistake_gives_gets_no_hint_and_says_what_differs():
    """Issue 31: tile_mask tested at a tile's first corner only was told "bottom-right: query i
    sits at Tk - Tq + i", which it already did. A wrong answer whose output matches no declared
    mistake names none: the message says how it differs."""
    from course_attn.grading.ch09 import tile_mask_reference
    exercise = get("ch09.tile_mask")
    for case in exercise.public_cases():
        if not tile_mask_reference(*case.args, **dict(case.kwargs)).any():
            continue
        expected = exercise.expected(case)
        wrong = expected.clone()
        wrong.view(-1)[int(expected.view(-1).float().argmax())] ^= True   # one entry flipped
        result = judge_case(exercise, case, expected, Answer(value=wrong))
        assert not result.passed and (result.hint, result.named) == ("", False), result.hint
        assert "1 of" in result.message and "differ" in result.message, result.message


def test_the_reason_shows_a_case_whose_hint_names_the_mistake_public_first():
    # every failed case is both mistakes' answer, so either may be named (settle_hints)
    both = ("you did the typical thing", "you did the other thing")
    judgement = Judgement("ch99.x", results=[
        CaseResult("a", False, "ValueError: no", "own hint a", matched=both),
        CaseResult("b", False, "your answer is too large", "you did the typical thing",
                   hidden=True, named=True, matched=both),
        CaseResult("c", False, "your answer is too small", "you did the other thing",
                   named=True, matched=both)])
    reason = judgement.reason()
    assert "(one that names the mistake, 'c': your answer is too small; hint: you did the " \
           "other thing)" in reason
    judgement.results[2].named = False
    assert "(one that names the mistake, a hidden case:" in judgement.reason()
    judgement.results[1].named = False
    assert "(first, 'a': ValueError: no; hint: own hint a)" in judgement.reason()


def test_check_prints_which_parts_are_right(capsys):
    from course_attn.grading.judge import format_judgement
    text = format_judgement(run_exercise(PARTS, wrong(c=lambda x, y: 0), watch_banned=False))
    assert "parts right: a, b (2 of 3, each part graded on its own)" in text.splitlines()[0]


def test_a_tensor_answer_is_matched_to_a_mistake_as_before():
    x = torch.zeros(1)
    assert judge_case(VIEWS, VIEWS.public_cases()[0], x, Answer(value=x)).passed


def test_a_hint_about_the_dtype_is_shown_only_when_the_dtype_is_wrong():
    """Issue 31: "keep the dtype: do not convert the inputs" reached answers that kept it."""
    exercise = get("ch07.repeat_kv")
    [case] = [c for c in exercise.public_cases() if "dtype" in c.hint]
    expected = exercise.expected(case)
    kept = judge_case(exercise, case, expected, Answer(value=expected + 1))
    assert not kept.passed and kept.hint == "" and "largest error" in kept.message
    converted = judge_case(exercise, case, expected, Answer(value=expected.float()))
    assert not converted.passed and converted.hint.startswith("return torch.float64, not "
                                                              "torch.float32")


def test_a_failed_hidden_case_names_its_regimes():
    from helpers import SOLUTIONS_DIR

    from course_attn.grading.exercise import hidden_cases, load_hidden
    load_hidden(SOLUTIONS_DIR)
    exercise = get("ch03.causal_mask")
    judgement = Judgement(exercise.key)
    for case in hidden_cases(exercise.key, 0):   # wrong only where Tq > Tk + 1
        value = torch.ones(case.args, dtype=torch.bool).tril(case.args[1] - case.args[0])
        if case.args[0] > case.args[1] + 1:
            value[-1, 0] = ~value[-1, 0]
        judgement.results.append(judge_case(exercise, case, exercise.expected(case),
                                            Answer(value=value), hidden=True))
    regime = "Tq > Tk by more than one (rows with no key)"
    assert f"a hidden case ({regime}): your result: 1 of" in judgement.reason()
    assert {r.regimes for r in judgement.results if not r.passed} == {(regime,)}


def _past_three_by_regime() -> Judgement:
    """ch03.causal_mask answered with a mask wrong only where Tq > Tk + 3, judged by regime on
    the public cases and the hidden cases of seed 0."""
    from helpers import SOLUTIONS_DIR

    from course_attn.grading.exercise import hidden_cases, load_hidden
    load_hidden(SOLUTIONS_DIR)
    exercise = get("ch03.causal_mask")

    def past_three(tq, tk):   # wrong only where Tq > Tk + 3
        return torch.ones(tq, tk, dtype=torch.bool).tril(0 if tq - tk > 3 else tk - tq)
    cases = exercise.public_cases() + hidden_cases(exercise.key, 0)
    results = [judge_case(exercise, case, exercise.expected(case), Answer(value=past_three(
        *case.args)), hidden=i >= len(exercise.public_cases())) for i, case in enumerate(cases)]
    return Judgement(exercise.key, results=results, by_regime=True)


def test_an_answer_in_one_piece_earns_each_regime_it_passes_when_the_grader_says_so():
    """Issue 31: 10 of 16 cases right scored 0. By regime (the grader's default), each regime of
    the hidden cases whose every case passes earns its share; a refused call still earns
    nothing; all or nothing (--all-or-nothing, and check() in a notebook) is as before."""
    by_regime = _past_three_by_regime()
    exercise, results = get("ch03.causal_mask"), by_regime.results
    assert by_regime.parts() == {"Tq = Tk": True, "Tq < Tk (queries at the end of the keys)": True,
                                 "Tq > Tk by more than one (rows with no key)": False,
                                 "Tq = 1 (one decoding step)": True}
    assert by_regime.credit() == pytest.approx(3 / 4)
    assert by_regime.reason().startswith(
        "3 of 4 regimes right (failed: Tq > Tk by more than one (rows with no key)); ")
    assert Judgement(exercise.key, results=results).credit() == 0       # all or nothing
    assert Judgement(exercise.key, results=results, by_regime=True,
                     banned=["torch.tril"]).credit() == 0


def test_the_report_says_which_credit_rule_was_used():
    from course_attn.grading.cli import _parser
    from course_attn.grading.report import NotebookGrade, format_table
    assert _parser().parse_args(["x", "--all-or-nothing"]).all_or_nothing
    assert not _parser().parse_args(["x"]).all_or_nothing
    table = format_table([NotebookGrade("a.ipynb", credit="by regime")])
    assert table.splitlines()[-1].startswith("credit: by regime (an answer in one piece earns")
    assert NotebookGrade("a.ipynb", credit="all or nothing").to_dict()["credit"] == \
        "all or nothing"


def test_an_error_that_says_what_the_student_did_gets_its_own_hint_not_the_cases():
    """Issue 31: a .view after a transpose in chapter 4 was given a case's hint about
    causality."""
    exercise = get("ch04.causal_self_attention")

    def viewed(x, w_qkv, w_o, n_heads):
        b, t, c = x.shape
        q = (x @ w_qkv.T)[..., :c].view(b, t, n_heads, c // n_heads).transpose(1, 2)
        return q.view(b, t, c) @ w_o.T            # the heads' axis in the way: not a view
    raised = [r for r in run_exercise(exercise, viewed, watch_banned=False).results
              if "RuntimeError: view size is not compatible" in r.message]
    assert len(raised) >= 3    # every case with more than one head
    for result in raised:
        assert result.hint.startswith("your .view met a tensor whose memory is not laid out"), \
            (result.name, result.hint)


def test_a_table_of_the_public_answers_earns_nothing():
    """Issue 41: a table of the public answers earned 0.43/3 on ch01.softmax_list ("1 of 7
    regimes right") while failing every hidden case. A regime counts only where hidden cases
    test it, and an answer that fails every hidden case earns nothing."""
    from helpers import SOLUTIONS_DIR

    from course_attn.grading.check import grade_here
    from course_attn.grading.exercise import load_hidden
    from course_attn.grading.judge import fingerprint
    load_hidden(SOLUTIONS_DIR)
    exercise = get("ch01.softmax_list")
    table = {fingerprint(list(case.args)): exercise.expected(case)
             for case in exercise.public_cases()}

    def softmax_list(*args):
        return table.get(fingerprint(list(args)), [2.0] * len(args[0]))  # never a softmax
    for seed in range(5):
        judgement = grade_here(exercise, softmax_list, seed, watch_banned=False)
        assert all(r.passed for r in judgement.results if not r.hidden)
        assert judgement.credit() == 0, seed
        assert judgement.reason().startswith("earns nothing: it fails every hidden case; ")


def test_an_answer_that_fails_a_central_regime_earns_nothing():
    """A regime declared central (the point of the exercise) failed: 0, however many other
    regimes the answer gets right; the same answer earns its share where nothing is central."""
    from course_attn.grading import exercise as registry
    judgement = _past_three_by_regime()
    exercise = get("ch03.causal_mask")
    assert judgement.credit() == pytest.approx(3 / 4)
    saved = registry._CENTRAL.get(exercise.key, frozenset())
    registry._CENTRAL[exercise.key] = frozenset({"Tq > Tk by more than one (rows with no key)"})
    try:
        assert judgement.credit() == 0
        assert judgement.reason().startswith("earns nothing: it fails the regime the exercise "
                                             "is about (Tq > Tk by more than one")
    finally:
        registry._CENTRAL[exercise.key] = saved
