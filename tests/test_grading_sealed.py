"""The checks a submission cannot talk its way past, tested in this process (no kernel):

- ``check`` fails a function that calls the package's reference, however it got hold of it;
- the sealed check of ``sealed.py`` signs its verdicts, refuses to be driven from inside a
  check, and notices grading code that was replaced after it was installed.
"""

import functools
import math
import secrets
import sys
from types import SimpleNamespace

import IPython
import pytest
import torch

import course_attn
from course_attn import masks
from course_attn.grading import ExerciseFailed, check, registry, run_checks, sealed
from course_attn.grading.registry import assert_close


def own_causal_mask(tq, tk):
    return torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)


def wrapper(tq, tk):
    return course_attn.causal_mask(tq, tk)


def loaded_again():
    """``causal_mask`` from a second copy of course_attn/masks.py, as ``importlib.reload``
    would make: another function object, the same file and line."""
    namespace = {}
    with open(masks.__file__) as file:
        exec(compile(file.read(), masks.__file__, "exec"), namespace)
    return namespace["causal_mask"]


def switches_the_profiler_off(tq, tk):
    saved = sys.getprofile()
    sys.setprofile(None)
    try:
        return course_attn.causal_mask(tq, tk)
    finally:
        sys.setprofile(saved)


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
    with pytest.raises(ExerciseFailed):
        check("ch03.causal_mask", fn)
    out = capsys.readouterr().out
    assert "your function calls course_attn.masks.causal_mask, the package's reference" in out
    report = run_checks("ch03.causal_mask", fn, forbid_reference=True)
    assert {r.reference_called for r in report.results} == {"course_attn.masks.causal_mask"}
    assert run_checks("ch03.causal_mask", fn).passed  # the checks themselves agree with it


def test_switching_the_profiler_off_is_caught():
    report = run_checks("ch03.causal_mask", switches_the_profiler_off, forbid_reference=True)
    assert not any(r.passed for r in report.results)
    assert all("sys.setprofile" in r.message for r in report.results)


def test_an_own_implementation_passes_and_the_profiler_is_put_back():
    def previous(frame, event, arg):
        return None
    sys.setprofile(previous)
    try:
        check("ch03.causal_mask", own_causal_mask)
        assert sys.getprofile() is previous
    finally:
        sys.setprofile(None)


def test_package_functions_that_are_not_the_reference_are_allowed():
    """ch02.attention is compared with scaled_dot_product_attention; the softmax that it calls
    inside is not what the check calls, so a student may use the package's softmax."""
    def attention(q, k, v, scale=None):
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        return course_attn.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v
    check("ch02.attention", attention)
    with pytest.raises(ExerciseFailed):
        check("ch02.stable_softmax", lambda x, dim=-1: course_attn.softmax(x, dim))


def test_a_tensor_subclass_cannot_pass_by_redefining_comparisons():
    class AlwaysEqual(torch.Tensor):
        def __ne__(self, other):
            return torch.zeros(self.shape, dtype=torch.bool)

    lie = torch.zeros(2, 2, dtype=torch.bool).as_subclass(AlwaysEqual)
    with pytest.raises(AssertionError, match="plain torch.Tensor, got the subclass AlwaysEqual"):
        assert_close(lie, torch.ones(2, 2, dtype=torch.bool))


# --- the sealed check ------------------------------------------------------------------------

@pytest.fixture
def kernel(monkeypatch, tmp_path):
    """``sealed.install`` in this process, with a stand-in for the IPython shell."""
    published = []
    shell = SimpleNamespace(user_ns={}, display_pub=SimpleNamespace(
        publish=lambda data, metadata=None: published.append(data[sealed.MIME_TYPE])))
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    key = secrets.token_bytes(32)
    key_file = tmp_path / "key"
    key_file.write_bytes(key)
    sealed.install(str(key_file), "_grading", [])
    return SimpleNamespace(grading=shell.user_ns["_grading"], published=published, key=key,
                           key_file=key_file)


def run_check_cell(kernel, fn, nonce="n1", exercise="ch03.causal_mask"):
    check_ = kernel.grading.begin(nonce)
    check_(exercise, fn)
    kernel.grading.end(nonce)


def test_a_pass_is_signed_and_a_changed_verdict_is_not_authentic(kernel):
    assert not kernel.key_file.exists()  # read once, then deleted
    run_check_cell(kernel, own_causal_mask)
    report, done = kernel.published
    assert (report["kind"], report["passed"], done["kind"], done["exercises"]) == (
        "report", True, "done", ["ch03.causal_mask"])
    assert all(sealed.is_authentic(kernel.key, m) for m in kernel.published)
    assert not sealed.is_authentic(secrets.token_bytes(32), done)
    for field, value in (("passed", False), ("nonce", "n2"), ("exercises", ["ch03.padding_mask"]),
                         ("kind", "report")):
        assert not sealed.is_authentic(kernel.key, {**done, field: value})
    assert not sealed.is_authentic(kernel.key, "done")


def test_a_failure_publishes_a_failed_report_and_no_done(kernel):
    with pytest.raises(ExerciseFailed):
        run_check_cell(kernel, lambda tq, tk: torch.ones(tq, tk, dtype=torch.bool))
    [report] = kernel.published
    assert report["passed"] is False and sealed.is_authentic(kernel.key, report)
    with pytest.raises(ExerciseFailed, match="did not run its checks to a pass"):
        kernel.grading.end("n1")


def test_end_needs_its_own_nonce_and_a_check_that_ran(kernel):
    kernel.grading.begin("n1")
    with pytest.raises(ExerciseFailed):
        kernel.grading.end("n1")  # no check ran
    check_ = kernel.grading.begin("n2")
    check_("ch03.causal_mask", own_causal_mask)
    with pytest.raises(ExerciseFailed):
        kernel.grading.end("a nonce the student guessed")
    assert [m["kind"] for m in kernel.published] == ["report"]


def test_the_sealed_check_cannot_be_driven_from_inside_the_students_function(kernel):
    def sneaky(tq, tk):
        kernel.grading.end("n1")  # claim the pass before the checks are done
        return own_causal_mask(tq, tk)

    with pytest.raises(ExerciseFailed):
        run_check_cell(kernel, sneaky)
    [report] = kernel.published
    assert not report["passed"]
    assert "ended from inside a check" in report["results"][0]["message"]


def test_grading_code_replaced_after_install_fails_the_check(kernel, monkeypatch):
    monkeypatch.setattr(registry, "assert_close", lambda *args, **kwargs: None)
    monkeypatch.setattr(masks.causal_mask, "__code__", own_causal_mask.__code__)
    with pytest.raises(ExerciseFailed):
        run_check_cell(kernel, own_causal_mask)
    [report] = kernel.published
    assert report["tampered"] == [  # every name bound to the swapped function is named
        "course_attn.causal_mask", "course_attn.grading.ch03.causal_mask",
        "course_attn.grading.registry.assert_close", "course_attn.masks.causal_mask"]


def test_a_snapshot_sees_replaced_deleted_and_shadowing_entries_only():
    class Base:
        def method(self):
            return 1

    class Child(Base):
        pass

    module = SimpleNamespace(function=lambda: 1, data=[1], gone=len)
    snapshot = sealed.Snapshot([("module", module, False), ("Child", Child, True)])
    module.data = [2]  # data is not kept when "everything" is False
    assert snapshot.changes() == []
    module.function = lambda: 2
    del module.gone
    Child.method = lambda self: 2  # shadows Base.method
    assert sorted(snapshot.changes()) == ["Child.method", "module.function", "module.gone"]
