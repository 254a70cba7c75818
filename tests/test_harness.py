"""The kernel side of grading (``course_attn.grading.harness``) and what the grader makes of its
answers, in this process (no kernel):

- values travel as plain data: every dtype round-trips exactly, and decoding rejects anything
  malformed with a WireError (never another exception, never a crash or a hang of the grader);
- the watch for banned calls sees Python functions, C builtins, tensor methods and whole
  packages (with ``allowed`` exceptions), in the calling thread, in threads started during the
  call and in threads that were already running; it reports a thread it cannot follow and a
  profiler switched off; it leaves every thread's profiler as it found it;
- ``evaluate`` answers a request as the grader reads it, and the grader survives any answer a
  kernel could forge.
"""

import _thread
import base64
import ctypes
import functools
import json
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import course_attn
from course_attn.grading import get, harness, judge
from course_attn.grading.canonical import GradedExercise
from course_attn.grading.exercise import load_hidden
from course_attn.grading.grader import _answers, _prepare, _verdict
from course_attn.grading.harness import SWITCHES_OFF, Watch, WireError, decode, encode
from course_attn.grading.kernel import CellRun, _read_regular_file

load_hidden(os.path.join(os.path.dirname(__file__), "..", "solutions"))

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128]


def through_json(value):
    """``value`` encoded, sent as JSON text, and decoded, as between the kernel and grader."""
    return decode(json.loads(json.dumps(encode(value))))


def sample(dtype: torch.dtype, shape=(2, 3)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) < 0.5
    if not (dtype.is_floating_point or dtype.is_complex):
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -1000), min(info.max, 1000), shape,
                             generator=generator).to(dtype)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) * 3


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN equals NaN)."""
    def raw(t):
        return t.contiguous().reshape(-1).view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and raw(a).equal(raw(b))


# --- plain data ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_tensor_of_every_dtype_round_trips_exactly(dtype):
    for tensor in (sample(dtype), sample(dtype, ()), sample(dtype, (0, 4)), sample(dtype, (3, 0)),
                   sample(dtype, (4, 5)).T, sample(dtype, (1, 3)).expand(4, 3)):
        back = through_json(tensor)
        assert type(back) is torch.Tensor and identical(back, tensor), (tensor, back)
        assert back.grading_device == "cpu"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                   torch.complex64], ids=str)
def test_infinities_and_nan_round_trip_in_tensors(dtype):
    tensor = torch.tensor([math.inf, -math.inf, math.nan, -0.0, 1.5], dtype=dtype)
    assert identical(through_json(tensor), tensor)


def test_nested_values_round_trip():
    value = {"a": [1, 2.5, None, True, "text ✓"], "b": (torch.ones(2), ({"c": ()},)),
             "inf": [math.inf, -math.inf], "empty": [[], (), {}], "big": 2 ** 80}
    back = through_json(value)
    assert back["a"] == value["a"] and back["big"] == 2 ** 80
    assert isinstance(back["b"], tuple) and back["b"][1] == ({"c": ()},)
    assert torch.equal(back["b"][0], torch.ones(2))
    assert back["inf"] == [math.inf, -math.inf] and back["empty"] == [[], (), {}]
    assert math.isnan(through_json(math.nan))
    assert through_json(np.float64(math.inf)) == math.inf  # a float subclass (numpy's)
    assert through_json([np.float64(0.25)]) == [0.25]


def test_what_encodes_is_detached_plain_and_on_the_cpu():
    grad = torch.ones(3, requires_grad=True) * 2
    assert not through_json(grad).requires_grad
    with torch.inference_mode():
        made_in_inference_mode = torch.arange(4.0)
    assert torch.equal(through_json(made_in_inference_mode), torch.arange(4.0))

    class Sub(torch.Tensor):
        pass

    assert type(through_json(torch.zeros(2).as_subclass(Sub))) is torch.Tensor


@pytest.mark.parametrize("value", [object(), np.zeros(2), {1: "a"}, {1, 2}, b"bytes",
                                   torch.zeros(2, dtype=torch.uint16), lambda: 1, 3j],
                         ids=["object", "ndarray", "int keys", "set", "bytes", "uint16",
                              "function", "complex number"])
def test_what_is_not_plain_data_does_not_encode(value):
    with pytest.raises(WireError):
        encode(value)


def nested(depth: int):
    value = []
    for _ in range(depth):
        value = [value]
    return value


def test_nesting_is_limited_both_ways():
    assert decode(encode(nested(harness.MAX_DEPTH - 1))) == nested(harness.MAX_DEPTH - 1)
    with pytest.raises(WireError, match="nested too deeply"):
        encode(nested(harness.MAX_DEPTH + 5))
    with pytest.raises(WireError, match="nested too deeply"):
        decode(nested(harness.MAX_DEPTH + 5))
    with pytest.raises(WireError, match="nested too deeply"):
        decode(json.loads("[" * 500 + "]" * 500))


def tensor_data(**body):
    good = {"dtype": "float32", "shape": [2], "device": "cpu",
            "data": base64.b64encode(bytes(8)).decode()}
    return {"__tensor__": {**good, **body}}


MALFORMED = {
    "wrong length": tensor_data(shape=[3]),
    "too short for its dtype": tensor_data(dtype="float64"),
    "unknown dtype": tensor_data(dtype="float128"),
    "a dtype that is no string": tensor_data(dtype=["float32"]),
    "bad base64": tensor_data(data="not base64!"),
    "base64 with spaces": tensor_data(data="AAAA AAAAAAA="),
    "data that is no string": tensor_data(data=[0, 0]),
    "a negative size": tensor_data(shape=[-2]),
    "a size that is no int": tensor_data(shape=[2.0]),
    "a bool size": tensor_data(shape=[True, True]),
    "a shape that is no list": tensor_data(shape="2"),
    "too many dimensions": tensor_data(shape=[1] * 65, data=base64.b64encode(bytes(4)).decode()),
    "sizes too large to multiply": tensor_data(shape=[2 ** 63, 2 ** 63, 0], data=""),
    "an unknown tag": {"__pickle__": "gASVAAAAAAAAAAB9lC4="},
    "two tags": {"__tuple__": [], "__dict__": {}},
    "a tuple that is no list": {"__tuple__": {"a": 1}},
    "a dict that is no dict": {"__dict__": [1, 2]},
    "a float that is no float": {"__float__": "1e400"},
    "a bare dict": {"a": 1},
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_data_is_a_wire_error(name):
    with pytest.raises(WireError):
        decode(json.loads(json.dumps(MALFORMED[name])))


def test_a_tensor_larger_than_the_limit_is_refused(monkeypatch):
    monkeypatch.setattr(harness, "MAX_BYTES", 16)
    with pytest.raises(WireError, match="larger than the limit"):
        decode(encode(torch.zeros(64)))


def test_a_forged_device_name_is_cut_short():
    assert len(decode(tensor_data(device="x" * 10_000)).grading_device) <= 64


# --- the watch for banned calls -----------------------------------------------------------------

SOFTMAX_BANS = ("torch.softmax", "torch.Tensor.softmax", "torch.nn.functional.softmax")
X = torch.randn(3, 4)


def watched(fn, banned=SOFTMAX_BANS + ("course_attn",), allowed=()):
    reported = []
    watch = Watch(banned, allowed, reported.append)
    with watch:
        fn()
    assert reported == watch.hits  # each hit reported the moment it happened
    return watch.hits


def own_softmax(x):
    e = (x - x.amax(dim=-1, keepdim=True)).exp()
    return e / e.sum(dim=-1, keepdim=True)


def test_the_watch_sees_builtins_methods_python_functions_and_packages():
    assert watched(lambda: torch.softmax(X, -1)) == ["torch.softmax"]
    assert watched(lambda: X.softmax(-1)) == ["torch.Tensor.softmax"]
    assert watched(lambda: torch.Tensor.softmax(X, -1)) == ["torch.Tensor.softmax"]
    assert watched(lambda: getattr(X, "softmax")(-1)) == ["torch.Tensor.softmax"]
    assert watched(lambda: F.softmax(X, -1))[0] == "torch.nn.functional.softmax"
    assert watched(lambda: course_attn.causal_mask(3, 4))[0] == "course_attn.masks.causal_mask"
    assert watched(lambda: course_attn.backends.sdpa_attention(*[X[None, None]] * 3))[0] == \
        "course_attn.backends.sdpa_attention"
    assert watched(lambda: own_softmax(X)) == []
    assert watched(lambda: torch.softmax(X, -1), banned=()) == []


def test_allowed_functions_and_what_they_call_are_not_hits():
    allowed = ("course_attn.masks.causal_mask",)
    assert watched(lambda: course_attn.causal_mask(3, 4), ("course_attn",), allowed) == []
    assert watched(lambda: course_attn.masks.query_key_offsets(3, 4), ("course_attn",),
                   allowed)[0] == "course_attn.masks.query_key_offsets"


def test_a_reloaded_copy_of_a_banned_function_is_still_seen_by_its_package():
    namespace = {}
    with open(course_attn.masks.__file__) as file:
        exec(compile(file.read(), course_attn.masks.__file__, "exec"), namespace)
    assert watched(lambda: namespace["causal_mask"](3, 4), ("course_attn",))


def in_a_new_thread():
    out = []
    thread = threading.Thread(target=lambda: out.append(torch.softmax(X, -1)))
    thread.start()
    thread.join()


def test_a_thread_started_during_the_call_is_watched():
    assert watched(in_a_new_thread) == ["torch.softmax"]


def test_a_thread_that_was_running_before_the_call_is_watched():
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(lambda: None).result()  # its worker thread runs from now on
        assert watched(lambda: pool.submit(torch.softmax, X, -1).result()) == ["torch.softmax"]
        assert watched(lambda: pool.submit(course_attn.causal_mask, 2, 2).result())[0] == \
            "course_attn.masks.causal_mask"
        assert pool.submit(sys.getprofile).result() is None  # and put back as it was


def test_a_thread_started_with_thread_itself_is_a_hit():
    def raw():
        done = []
        _thread.start_new_thread(lambda: done.append(1), ())
        while not done:
            time.sleep(0.001)
    assert watched(raw) == [Watch.UNFOLLOWED_THREAD]


def test_switching_the_profiler_off_is_reported():
    assert watched(lambda: sys.setprofile(None)) == [f"sys.setprofile {SWITCHES_OFF}",
                                                     Watch.SWITCHED_OFF]
    assert watched(lambda: threading.setprofile(None)) == [f"threading.setprofile {SWITCHES_OFF}"]
    assert watched(lambda: (threading.setprofile(None), in_a_new_thread()))[1:] == [
        Watch.UNFOLLOWED_THREAD]  # and the thread it then starts is no longer watched


def test_a_profiler_switched_off_from_c_or_a_watch_disarmed_is_reported():
    def from_c():
        ctypes.pythonapi.PyEval_SetProfile(None, None)
        course_attn.causal_mask(2, 2)

    def disarm():
        sys.getprofile().__self__.armed = False
        course_attn.causal_mask(2, 2)

    assert watched(from_c) == [Watch.SWITCHED_OFF]
    assert watched(disarm) == [Watch.SWITCHED_OFF]


def test_a_recursion_error_the_student_catches_is_no_switching_off():
    def deep(n):
        return deep(n + 1)

    def recurse():
        try:
            deep(0)
        except RecursionError:
            pass
    assert watched(recurse) == []


def test_the_banned_function_itself_as_the_answer_is_a_hit():
    for target in (torch.softmax, functools.partial(torch.softmax, dim=-1),
                   torch.Tensor.softmax, X.softmax, course_attn.causal_mask):
        watch = Watch(SOFTMAX_BANS + ("course_attn.masks.causal_mask",))
        watch.check_target(target)
        assert len(watch.hits) == 1, target

    class Honest:  # keeps a banned function it never calls, and answers oddly
        func = torch.softmax
        __name__ = 5

        def __call__(self, x):
            return own_softmax(x)

    for target in (own_softmax, Honest(), functools.partial(own_softmax),
                   functools.lru_cache(own_softmax)):
        watch = Watch(SOFTMAX_BANS)
        watch.check_target(target)
        assert watch.hits == [], target
    watch = Watch(SOFTMAX_BANS)
    watch.check_target(functools.lru_cache(torch.softmax))
    assert watch.hits == ["torch.softmax"]


def test_the_watch_puts_every_profiler_back():
    def mine(frame, event, arg):
        return None

    seen = {}
    ready, finish = threading.Event(), threading.Event()

    def other_thread():
        sys.setprofile(mine)
        ready.set()
        finish.wait()
        seen["after"] = sys.getprofile()
        sys.setprofile(None)

    thread = threading.Thread(target=other_thread)
    thread.start()
    ready.wait()
    sys.setprofile(mine)
    try:
        watched(lambda: torch.softmax(X, -1))
        assert sys.getprofile() is mine
        assert threading.getprofile() is None
    finally:
        sys.setprofile(None)
        finish.set()
        thread.join()
    assert seen["after"] is mine


def test_a_disarmed_watch_sees_nothing():
    watch = Watch(SOFTMAX_BANS)
    torch.softmax(X, -1)
    watch.hook(sys._getframe(), "c_call", torch.softmax)
    assert watch.hits == []


# --- evaluate(): a request in, an answer out ---------------------------------------------------

def evaluate(tmp_path, namespace, name, cases, banned=(), kind="function"):
    request = {"name": name, "kind": kind, "banned": list(banned), "allowed": [],
               "cases": [{"args": encode(list(args)), "kwargs": encode(kwargs)}
                         for args, kwargs in cases],
               "answer": str(tmp_path / "answer.json"), "hits": str(tmp_path / "hits")}
    (tmp_path / "request.json").write_text(json.dumps(request))
    harness.evaluate(str(tmp_path / "request.json"), namespace)
    hits = (tmp_path / "hits").read_text().splitlines() if (tmp_path / "hits").exists() else []
    return json.loads((tmp_path / "answer.json").read_text()), [json.loads(h) for h in hits]


def test_evaluate_answers_each_case_with_a_value_or_an_error(tmp_path):
    def double(x, *, times=2):
        if x.numel() == 0:
            raise ValueError("empty")
        return x * times

    def grows(x):
        x.add_(1)
        return object()

    answer, hits = evaluate(tmp_path, {"double": double, "grows": grows}, "double",
                            [((torch.ones(2),), {}), ((torch.ones(2),), {"times": 3}),
                             ((torch.ones(0),), {})])
    assert answer["found"] and answer["banned"] == [] and hits == []
    first, second, third = answer["results"]
    assert torch.equal(decode(first["value"]), torch.full((2,), 2.0))
    assert torch.equal(decode(second["value"]), torch.full((2,), 3.0))
    assert third["error"]["type"] == "ValueError" and third["error"]["message"] == "empty"
    answer, _ = evaluate(tmp_path, {"grows": grows}, "grows", [((torch.ones(2),), {})])
    assert answer["mutated"] == [[0, 0]] and "unencodable" in answer["results"][0]


def test_evaluate_reports_a_missing_function_a_value_and_banned_calls(tmp_path):
    answer, _ = evaluate(tmp_path, {}, "double", [((1,), {})])
    assert answer == {"found": False, "results": [], "mutated": [], "banned": []}
    answer, _ = evaluate(tmp_path, {"guess": [0.5, 0.5]}, "guess", [((), {})], kind="value")
    assert answer["results"] == [{"value": [0.5, 0.5]}]
    answer, hits = evaluate(tmp_path, {"soft": lambda x: torch.softmax(x, -1)}, "soft",
                            [((X,), {})], banned=SOFTMAX_BANS)
    assert answer["banned"] == hits == ["torch.softmax"]


# --- what the grader makes of an answer, whatever the kernel wrote -------------------------------

def an_evaluation(answer, hits=(), status="ok"):
    evaluation = _prepare(GradedExercise("ch03-causal_mask", 3, "ch03.causal_mask"), seed=0)
    evaluation.run, evaluation.answer, evaluation.hits = CellRun(status), answer, list(hits)
    return evaluation


def verdict(answer, hits=(), status="ok"):
    return _verdict(an_evaluation(answer, hits, status), {}, lambda i: f"cell {i + 1}", 0)


def correct_answer() -> dict:
    evaluation = an_evaluation(None)
    return {"found": True, "results": [{"value": encode(e)} for e in evaluation.expected],
            "mutated": [], "banned": []}


def test_a_correct_answer_passes_and_a_wrong_one_names_its_case():
    assert verdict(correct_answer()) == (True, "passed", [])
    wrong = correct_answer()
    wrong["results"][-1] = {"value": encode(torch.zeros(1, dtype=torch.bool))}
    passed, reason, flags = verdict(wrong)
    assert not passed and "(first, a hidden case: your result has shape (1,)" in reason


FORGED = {
    "results that are no list": {"found": True, "results": "all passed"},
    "too few results": {"found": True, "results": [{"value": True}]},
    "mutated that is no list": {**correct_answer(), "mutated": 5,
                                "results": [{"value": 1}]},
    "mutated with odd items": {**correct_answer(), "mutated": [[True, 1], "x", [1, 2, 3]],
                               "results": []},
    "banned that is no list of strings": {**correct_answer(), "banned": [[1], {"a": 2}, 3],
                                          "results": [{"error": {}}]},
    "errors of any shape": {"found": True, "results": [
        {"error": {"type": ["x"], "message": {"a": 1}, "line": "7"}},
        {"error": {"message": "m" * 100_000}}, {"error": 5}, {"unencodable": ["x"]}, 7]},
    "malformed tensors": {"found": True, "results": [
        {"value": tensor_data(shape=[2 ** 63, 2 ** 63, 0], data="")},
        {"value": tensor_data(dtype="float128")}, {"value": {"__pickle__": "x"}}]},
    "found that is no bool": {"found": "yes", "results": []},
}


@pytest.mark.parametrize("name", FORGED)
def test_no_answer_a_kernel_can_forge_breaks_the_grader_or_passes(name):
    passed, reason, flags = verdict(FORGED[name], hits=["torch.softmax", 5][:1])
    assert not passed and len(reason) < 3000
    passed, reason, flags = verdict(FORGED[name])
    assert not passed and len(reason) < 3000
    assert all(len(a.error["message"]) <= 2000 for a in _answers(an_evaluation(FORGED[name]))
               if a.error)


def test_odd_extras_in_a_correct_answer_are_ignored():
    for extra in ({"mutated": 5}, {"mutated": [[True, 1], "x", [1, 2, 3]]},
                  {"banned": [[1], {"a": 2}, 3]}, {"unknown": "field"}):
        assert verdict({**correct_answer(), **extra}) == (True, "passed", [])


def test_a_hit_reported_by_file_counts_even_if_the_answer_says_none():
    passed, reason, flags = verdict(correct_answer(), hits=["course_attn.masks.causal_mask"])
    assert not passed and reason == ("calls course_attn.masks.causal_mask, which this exercise "
                                     "does not allow: write the computation yourself")
    passed, reason, flags = verdict(correct_answer(), hits=[Watch.SWITCHED_OFF])
    assert reason == ("switches off the watch for banned calls (the profiler or the watch's own "
                      "state, changed during the call), which no exercise allows")
    assert flags == ["ch03-causal_mask: the submission switched off the watch for banned calls "
                     "(the profiler or the watch's own state, changed during the call)"]


def test_errors_read_as_what_went_wrong():
    assert judge.describe_error({"type": "NotImplementedError"}) == judge.NOT_IMPLEMENTED
    assert judge.describe_error({"type": "ValueError", "message": "no", "line": 3}) == \
        "ValueError: no (line 3 of its cell)"
    assert judge.describe_error({"type": "RuntimeError", "line": 6, "message":
                                 "DefaultCPUAllocator: can't allocate memory"}) == \
        "ran out of memory (RuntimeError, line 6 of its cell)"
    assert judge.describe_error({"type": "MemoryError"}) == "ran out of memory (MemoryError)"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_the_grader_reads_only_regular_files_that_the_kernel_wrote(tmp_path):
    fifo = tmp_path / "answer.json"
    os.mkfifo(fifo)  # would block a plain read forever
    with pytest.raises(ValueError, match="not a regular file"):
        _read_regular_file(fifo, 100)
    target = tmp_path / "elsewhere"
    target.write_text("{}")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError):
        _read_regular_file(tmp_path / "link", 100)
    (tmp_path / "big").write_text("x" * 101)
    with pytest.raises(ValueError, match="larger than"):
        _read_regular_file(tmp_path / "big", 100)
    assert _read_regular_file(tmp_path / "big", 100, whole=False) == "x" * 100


def test_the_exercises_banned_names_all_resolve():
    """A ban that names nothing bans nothing: every dotted name of every exercise resolves."""
    from course_attn.grading import all_exercises
    for key, exercise in all_exercises().items():
        for name in exercise.banned + exercise.allowed:
            if name.startswith("torch.Tensor."):
                assert hasattr(torch.Tensor, name.rsplit(".", 1)[1]), (key, name)
            elif not name.startswith("scipy."):  # scipy is optional
                assert harness._resolve(name) is not None, (key, name)


def test_check_gives_the_same_verdict_in_the_notebook(capsys):
    from course_attn.grading import ExerciseFailed, check
    with pytest.raises(ExerciseFailed, match="calls course_attn.masks.causal_mask"):
        check("ch03.causal_mask", lambda tq, tk: course_attn.causal_mask(tq, tk))
    check("ch03.causal_mask",
          lambda tq, tk: torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq))
    assert "checks passed" in capsys.readouterr().out
    assert get("ch03.causal_mask").banned
