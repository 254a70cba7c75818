"""``check()``, the feedback in the notebook, in this process (no kernel): it runs the public
cases with the grader's comparisons, hints and banned calls, prints a table and decides nothing.

(It replaces the tests of the sealed check, an in-kernel verdict that is gone: the grade is
decided by the grader, outside the student's process; tests/test_grading_attacks.py.)
"""

import functools
import re
import sys

import pytest
import torch

import course_attn
from course_attn import masks
from course_attn.grading import ExerciseFailed, check, get, run_exercise
from course_attn.grading.harness import WireError, decode, encode
from course_attn.grading.judge import Answer, judge_case
from course_attn.grading.report import ExerciseScore, NotebookGrade, format_table, report


def own_causal_mask(tq, tk):
    return torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)


def wrapper(tq, tk):
    return course_attn.causal_mask(tq, tk)


def loaded_again():
    """``causal_mask`` from a second copy of course_attn/masks.py, as ``importlib.reload``
    would make: another function object, the same file."""
    namespace = {"__name__": "course_attn.masks", "__package__": "course_attn"}  # its imports
    with open(masks.__file__) as file:
        exec(compile(file.read(), masks.__file__, "exec"), namespace)
    return namespace["causal_mask"]


REFERENCE_CALLS = {
    "the reference itself": course_attn.causal_mask,
    "a wrapper": wrapper,
    "functools.partial": functools.partial(masks.causal_mask, align="bottom_right"),
    "a lambda over the module attribute": lambda tq, tk: masks.causal_mask(tq, tk),
    "a reloaded copy": loaded_again(),
}


@pytest.mark.parametrize("name", REFERENCE_CALLS)
def test_check_fails_a_function_that_calls_the_reference(name, capsys):
    fn = REFERENCE_CALLS[name]
    called = r"calls course_attn\.(masks\.)?causal_mask, which this exercise does not allow"
    with pytest.raises(ExerciseFailed, match=called):
        check("ch03.causal_mask", fn)
    out = capsys.readouterr().out
    assert re.match(r"ch03\.causal_mask: failed: it " + called, out), out  # said first
    assert "(apart from that, 5/5 checks passed)" in out
    # the answers themselves are right: only the ban fails them
    assert all(r.passed for r in run_exercise(get("ch03.causal_mask"), fn).results)


def test_an_own_implementation_passes_and_the_profiler_is_put_back(capsys):
    def previous(frame, event, arg):
        return None
    sys.setprofile(previous)
    try:
        check("ch03.causal_mask", own_causal_mask)
        assert sys.getprofile() is previous
    finally:
        sys.setprofile(None)
    out = capsys.readouterr().out
    assert re.match(r"ch03\.causal_mask: \d+/\d+ checks passed", out) and "✗" not in out


def test_a_stub_is_not_answered_yet_and_does_not_stop_the_notebook(capsys):
    def causal_mask(tq, tk):
        raise NotImplementedError()
    check("ch03.causal_mask", causal_mask)
    out = capsys.readouterr().out.strip()
    assert out == "ch03.causal_mask: not answered yet (5 checks waiting)"


def test_a_wrong_answer_prints_each_failed_case_with_the_hint_that_names_the_mistake(capsys):
    def top_left(tq, tk):
        return torch.ones(tq, tk, dtype=torch.bool).tril()
    with pytest.raises(ExerciseFailed, match=r"ch03.causal_mask: \d of 5 checks failed"):
        check("ch03.causal_mask", top_left)
    out = capsys.readouterr().out
    assert "✓ square, Tq=Tk=4" in out and "✗ fewer queries than keys, Tq=3, Tk=6" in out
    assert "hint: your mask is aligned top-left" in out


def test_switching_the_guard_off_fails_the_check():
    from torch.utils._python_dispatch import _pop_mode

    def switches_off(tq, tk):
        _pop_mode()  # the guard's mode for operations
        return torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
    judgement = run_exercise(get("ch03.causal_mask"), switches_off)
    assert not judgement.passed
    assert judgement.reason().startswith("switches off the check of the operations it runs "
                                         "(torch's modes popped off their stacks")


def test_a_profiler_of_the_students_own_is_no_interference():
    import cProfile

    def profiled(tq, tk):
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            return torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
        finally:
            profiler.disable()
    assert run_exercise(get("ch03.causal_mask"), profiled).passed


def test_an_argument_changed_in_place_fails_its_case():
    def padding_mask(lengths, t):
        mask = (torch.arange(t)[None, :] < lengths[:, None])[:, None, None, :]
        lengths.zero_()  # right answer, but the caller's tensor is gone
        return mask
    judgement = run_exercise(get("ch03.padding_mask"), padding_mask)
    assert any("changed its argument 1 in place" in r.message for r in judgement.results)


def test_a_tensor_subclass_that_lies_about_comparisons_is_refused_as_the_grader_refuses_it():
    class AlwaysEqual(torch.Tensor):
        def __ne__(self, other):
            return torch.zeros(self.shape, dtype=torch.bool)

    def lies(tq, tk):
        return torch.zeros(tq, tk, dtype=torch.bool).as_subclass(AlwaysEqual)

    with pytest.raises(WireError, match="AlwaysEqual"):
        encode(lies(2, 2))  # what the kernel would send back: nothing
    judgement = run_exercise(get("ch03.causal_mask"), lies)
    assert not judgement.passed
    assert "not a tensor, number, string or list" in judgement.results[0].message


def test_a_refused_call_is_said_before_the_checks_that_passed(capsys):
    def fill_cache(k_chunks, v_chunks, max_seq_len):  # right prefixes, grown with torch.cat
        k, v = k_chunks[0], v_chunks[0]
        prefixes = [(k.clone(), v.clone())]
        for k_new, v_new in zip(k_chunks[1:], v_chunks[1:]):
            k, v = torch.cat([k, k_new], dim=2), torch.cat([v, v_new], dim=2)
            prefixes.append((k.clone(), v.clone()))
        return prefixes
    with pytest.raises(ExerciseFailed, match="ch08.fill_cache: calls torch.cat"):
        check("ch08.fill_cache", fill_cache)
    first, second, *_ = capsys.readouterr().out.splitlines()
    assert first.startswith("ch08.fill_cache: failed: it calls torch.cat, which this exercise "
                            "does not allow")
    assert re.fullmatch(r"  \(apart from that, (\d+)/\1 checks passed\)", second)


def naive_softmax(x, dim=-1):
    e = x.exp()  # overflows to inf for entries ~ +1000: inf / inf is NaN
    return e / e.sum(dim, keepdim=True)


def test_a_result_that_could_not_be_computed_says_so_not_how_large_its_error_is():
    judgement = run_exercise(get("ch02.stable_softmax"), naive_softmax)
    failed = {r.name: r.message for r in judgement.results if not r.passed}
    assert failed["large inputs ~ +1000 (float32)"] == (
        "your result could not be computed in 32 of its 32 entries: NaN where the expected ones "
        "are finite (0/0, inf - inf and exp of a large number give these)")
    assert not any("largest error" in message for message in failed.values())
    assert "exp overflows" in judgement.reason()  # the typical mistake is still named


def test_the_part_of_a_result_that_could_not_be_computed_is_named():
    exercise = get("ch08.fill_cache")
    case = exercise.public_cases()[0]
    answer = exercise.expected(case)
    answer[1][0][0, 0, -1, 0] = float("nan")  # one entry of the keys after the second chunk
    answer[1][1][0, 0, -1, 0] = float("inf")
    result = judge_case(exercise, case, exercise.expected(case), Answer(value=answer))
    k = answer[1][0]
    assert result.message.startswith(f"your result[1][0] could not be computed in 1 of its "
                                     f"{k.numel()} entries: NaN where")


def angles_in_float64(positions, head_dim, base=10000.0):
    theta = base ** (-2 * torch.arange(head_dim // 2, dtype=torch.float64) / head_dim)
    return positions[:, None].double() * theta  # right values, float64


def test_a_wrong_dtype_is_hinted_as_a_dtype_before_any_hint_about_the_values():
    judgement = run_exercise(get("ch05.rope_angles"), angles_in_float64)
    assert not judgement.passed and all(not r.passed for r in judgement.results)
    for r in judgement.results:
        assert r.message == "your result has dtype torch.float64, expected torch.float32"
        assert r.hint == ("return torch.float32, not torch.float64 (.to(torch.float32) converts "
                          "your result): the values are compared once the dtype is right")
    assert "base" not in judgement.reason()
    assert run_exercise(get("ch05.rope_angles"),
                        lambda *a, **k: angles_in_float64(*a, **k).float()).passed


def test_the_grade_table_and_report_name_an_exercise_as_the_check_cells_do():
    grade = NotebookGrade("work/05_rope.ipynb", "05", [
        ExerciseScore("ch05-rope_angles", 0, 1, False, "not implemented")])
    assert format_table([grade]).splitlines()[1].split()[:2] == ["work/05_rope.ipynb",
                                                                 "ch05.rope_angles"]
    [entry] = report([grade])["notebooks"][0]["exercises"]
    assert (entry["exercise"], entry["grade_id"]) == ("ch05.rope_angles", "ch05-rope_angles")
