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


def own_causal_mask(tq, tk):
    return torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)


def wrapper(tq, tk):
    return course_attn.causal_mask(tq, tk)


def loaded_again():
    """``causal_mask`` from a second copy of course_attn/masks.py, as ``importlib.reload``
    would make: another function object, the same file."""
    namespace = {}
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
