"""The kernel side of grading (``course_attn.grading.harness``) and what the grader makes of its
answers, in this process (no kernel):

- values travel as plain data: every dtype round-trips exactly, and decoding rejects anything
  malformed with a WireError (never another exception, never a crash or a hang of the grader);
- the guard refuses, by the name the student used, every operation outside the exercise's
  allowlist however it was reached (torch, Tensor, F, torch._x, torch.ops, map, a thread started
  during the call), composites by name, the package by file (``allowed`` exceptions and what
  they run excepted); it reports its modes popped; it leaves torch's modes and threading as it
  found them; compiled functions run uncompiled under it;
- ``evaluate`` answers a request as the grader reads it, runs none of a tensor subclass's code,
  and the grader survives any answer a kernel could forge.
"""

import base64
import functools
import json
import math
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import course_attn
from course_attn.grading import get, harness, judge, operations
from course_attn.grading.canonical import GradedExercise
from course_attn.grading.exercise import load_hidden
from course_attn.grading.grader import _answers, _prepare, _verdict
from course_attn.grading.harness import Guard, WireError, decode, encode
from course_attn.grading.kernel import CellRun

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

    assert type(through_json(torch.nn.Parameter(torch.zeros(2)))) is torch.Tensor

    class Sub(torch.Tensor):  # a subclass's code could run while it is read: refused
        pass

    with pytest.raises(WireError, match="a value of type Sub"):
        encode(torch.zeros(2).as_subclass(Sub))


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
PACKAGE = os.path.dirname(course_attn.__file__)
NO_SOFTMAX = sorted(operations.ELEMENTARY)


def guarded(fn, refused=SOFTMAX_BANS, ops=NO_SOFTMAX, package=PACKAGE, allowed=(),
            functions=()):
    """The hits of a guard around ``fn()``: each reported the moment it happened."""
    reported = []
    guard = Guard(ops, refused, package, allowed, reported.append, functions)
    guard.call(fn, (), {})
    assert reported == guard.hits
    return guard.hits


def own_softmax(x):
    e = (x - x.amax(dim=-1, keepdim=True)).exp()
    return e / e.sum(dim=-1, keepdim=True)


def test_the_guard_names_a_refused_function_by_the_route_the_student_took():
    assert guarded(lambda: torch.softmax(X, -1))[0] == "torch.softmax"
    assert guarded(lambda: X.softmax(-1))[0] == "torch.Tensor.softmax"
    assert guarded(lambda: torch.Tensor.softmax(X, -1))[0] == "torch.Tensor.softmax"
    assert guarded(lambda: getattr(X, "softmax")(-1))[0] == "torch.Tensor.softmax"
    assert guarded(lambda: F.softmax(X, -1))[0] == "torch.nn.functional.softmax"
    assert guarded(lambda: torch._softmax(X, -1, False))[0] == "torch._softmax"
    assert guarded(lambda: torch.ops.aten._softmax(X, -1, False))[0] == "torch.ops.aten._softmax"
    assert guarded(lambda: own_softmax(X)) == []


def test_an_operation_outside_the_allowlist_is_refused_however_it_was_reached():
    """The softmax family runs aten._softmax, aten._log_softmax or aten.logsumexp: refused
    where only the elementary operations are allowed, with the function the student called."""
    nothing_refused_by_name = ()
    cases = {
        "torch.special.log_softmax (it runs aten._log_softmax)":
            lambda: torch.special.log_softmax(X, -1).exp(),
        "torch.Tensor.logsumexp (it runs aten.logsumexp)":
            lambda: (X - X.logsumexp(-1, True)).exp(),
        "torch.softmax (it runs aten._softmax)": lambda: list(map(torch.softmax, X, [-1] * 3)),
        "torch.logcumsumexp (it runs aten.logcumsumexp)": lambda: torch.logcumsumexp(X, -1),
        "torch.nn.functional.scaled_dot_product_attention (it runs "
        "aten._scaled_dot_product_flash_attention_for_cpu)":
            lambda: F.scaled_dot_product_attention(*[X[None, None]] * 3),
        "torch._scaled_dot_product_attention_math (it runs aten._safe_softmax)":
            lambda: torch._scaled_dot_product_attention_math(*[X[None, None]] * 3),
    }
    for name, fn in cases.items():
        assert name in guarded(fn, refused=nothing_refused_by_name), name
    assert guarded(lambda: torch.softmax(X, -1), refused=(), ops=NO_SOFTMAX + sorted(
        operations.SOFTMAX)) == []
    assert guarded(lambda: torch.softmax(X, -1), refused=(), ops=None) == []


def test_composites_are_refused_by_name_whatever_the_route():
    """F.rms_norm and repeat_interleave decompose into elementary operations before they are
    dispatched: the name refuses them, from torch, Tensor, F and torch.ops alike."""
    refused = ("torch.nn.functional.rms_norm", "torch.repeat_interleave")
    assert guarded(lambda: F.rms_norm(X, (4,)), refused)[0] == "torch.nn.functional.rms_norm"
    assert guarded(lambda: torch.rms_norm(X, (4,)), refused)[0] == "torch.rms_norm"
    assert guarded(lambda: torch.ops.aten.rms_norm(X, [4]), refused)[0] == \
        "torch.ops.aten.rms_norm"
    assert guarded(lambda: X.repeat_interleave(2, 0), refused)[0] == \
        "torch.Tensor.repeat_interleave"
    assert guarded(lambda: torch.ops.aten.repeat_interleave(X, 2, 0), refused)[0] == \
        "torch.ops.aten.repeat_interleave"
    assert guarded(lambda: X[:, None].expand(3, 2, 4).reshape(6, 4), refused) == []


def test_the_package_is_refused_by_file_not_by_its_path_attribute(monkeypatch):
    assert guarded(lambda: course_attn.causal_mask(3, 4))[0] == "course_attn.masks.causal_mask"
    assert guarded(lambda: course_attn.backends.sdpa_attention(*[X[None, None]] * 3))[0] == \
        "course_attn.sdpa.sdpa_attention"
    monkeypatch.setattr(course_attn, "__path__", [])
    assert guarded(lambda: course_attn.causal_mask(3, 4))[0] == "course_attn.masks.causal_mask"
    # a copy compiled from the package's own file is still the package's code
    namespace = {"__name__": "copied_masks", "__package__": "course_attn"}
    with open(course_attn.masks.__file__) as file:
        exec(compile(file.read(), course_attn.masks.__file__, "exec"), namespace)
    assert guarded(lambda: namespace["causal_mask"](3, 4))


def test_allowed_functions_and_what_they_run_are_not_hits():
    code = course_attn.masks.causal_mask.__code__
    allowed = [("masks.py", code.co_qualname)]
    assert guarded(lambda: course_attn.causal_mask(3, 4), allowed=allowed) == []
    assert guarded(lambda: course_attn.masks.query_key_offsets(3, 4),
                   allowed=allowed)[0] == "course_attn.masks.query_key_offsets"


def test_python_functions_are_refused_by_where_their_code_is():
    """(Under any torch dispatch mode, making a CausalBias fails: the refusal is reported
    first, the moment torch is entered below the refused function.)"""
    from torch.nn.attention.bias import causal_lower_right
    code = causal_lower_right.__code__
    functions = [(code.co_filename, code.co_qualname, "torch.nn.attention.bias.causal_lower_right")]
    guard = Guard(NO_SOFTMAX, (), PACKAGE, (), None, functions)
    with pytest.raises(RuntimeError):
        guard.call(lambda: causal_lower_right(3, 4)._materialize(torch.device("cpu")), (), {})
    assert guard.hits == ["torch.nn.attention.bias.causal_lower_right"]


def in_a_new_thread():
    out = []
    thread = threading.Thread(target=lambda: out.append(torch.softmax(X, -1)))
    thread.start()
    thread.join()


# The pool's thread outlives the call: the guard's end takes its modes off, and the thread's own
# end must not try again ("trying to pop from empty mode stack" in that thread).
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_started_during_the_call_is_guarded():
    assert guarded(in_a_new_thread)[0] == "torch.softmax"
    with ThreadPoolExecutor(max_workers=1) as pool:  # its thread starts during the call
        assert guarded(lambda: pool.submit(torch.softmax, X, -1).result())[0] == "torch.softmax"


def test_popping_the_guards_modes_is_reported_and_what_is_left_of_them_comes_off():
    """Issue 35: the function mode that the student left on its stack stayed there after the
    call, so every later torch call of the process went through Python (a later test module
    ran 2.5 to 7 times slower)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode
    before = (len(torch.overrides._get_current_function_mode_stack()),
              len(_get_current_dispatch_mode_stack()))
    assert guarded(lambda: _pop_mode())[-1] == harness.SWITCHED_OFF
    assert (len(torch.overrides._get_current_function_mode_stack()),
            len(_get_current_dispatch_mode_stack())) == before


def test_a_recursion_error_the_student_catches_is_nothing():
    def deep(n):
        return deep(n + 1)

    def recurse():
        try:
            deep(0)
        except RecursionError:
            pass
    assert guarded(recurse) == []


def test_a_tensor_made_where_the_guard_saw_nothing_is_a_hit_and_a_cached_one_is_not():
    """Issue 30: a tensor answer made with torch's dispatch hidden from the guard is a hit; one
    that a cache or a table made before the call, returned again with no operation, is not (an
    honest lru_cache scored 0 whenever two hidden cases asked for the same sizes)."""
    from torch._C import DispatchKey, DispatchKeySet, _ExcludeDispatchKeyGuard

    def hidden(*shape):
        with _ExcludeDispatchKeyGuard(DispatchKeySet(DispatchKey.Python)):
            return torch.ones(*shape).tril()

    assert guarded(lambda: hidden(3, 3)) == [harness.UNSEEN]
    assert guarded(lambda: (hidden(3, 3), 1)) == [harness.UNSEEN]
    cached = functools.lru_cache(maxsize=None)(lambda n: torch.ones(n, n).tril())
    table = {3: torch.ones(3, 3).tril()}
    cached(3)
    for answer in (lambda: cached(3), lambda: table[3], lambda: (table[3], 1),
                   lambda: {"mask": table[3]}):
        assert guarded(answer) == [], answer


def test_the_refused_function_itself_as_the_answer_is_a_hit():
    for target in (torch.softmax, functools.partial(torch.softmax, dim=-1),
                   torch.Tensor.softmax, functools.lru_cache(torch.softmax)):
        guard = Guard(NO_SOFTMAX, SOFTMAX_BANS)
        args = (X, -1) if not isinstance(target, functools.partial) else (X,)
        guard.call(target, args, {})
        assert guard.hits, target
    guard = Guard(NO_SOFTMAX, SOFTMAX_BANS)
    guard.call(functools.lru_cache(own_softmax), (X,), {})
    assert guard.hits == []


def test_the_guard_leaves_torchs_modes_and_other_threads_as_it_found_them():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    functions, dispatch = len(torch.overrides._get_current_function_mode_stack()), \
        len(_get_current_dispatch_mode_stack())
    start = threading.Thread.start
    guarded(lambda: torch.softmax(X, -1))
    guarded(lambda: 1 / 0 if False else None)
    assert threading.Thread.start is start
    assert len(torch.overrides._get_current_function_mode_stack()) == functions
    assert len(_get_current_dispatch_mode_stack()) == dispatch


def test_a_compiled_function_runs_uncompiled_under_the_guard():
    import torch._dynamo  # noqa: F401  (a student who compiles has imported it)

    @torch.compile
    def halve(x):
        return x / 2
    started = time.monotonic()
    assert guarded(lambda: halve(X)) == []
    assert time.monotonic() - started < 10  # no compile happened



GUARD_AFTER_DYNAMO_DISABLE_IS_REPLACED = """
import sys, torch
from course_attn.grading.harness import Guard
from course_attn.grading.operations import ELEMENTARY
if sys.argv[1] == "replace":  # what torch would wrap a mode's __torch_dispatch__ in
    import torch._dynamo
    torch._dynamo.disable = lambda fn, *a, **k: (
        lambda mode, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})))
hits = []
with Guard(sorted(ELEMENTARY), [], None, [], hits.append, []):
    torch.nn.functional.cross_entropy(torch.randn(4, 5), torch.zeros(4, dtype=torch.long))
print(hits[:1], "torch._dynamo" in sys.modules)
"""


@pytest.mark.parametrize("before", ["replace", "nothing"])
def test_the_guard_needs_nothing_of_the_compiler(before):
    """A fresh process: the guard sees the operations whatever ``torch._dynamo.disable`` was
    made to be before its first use, and does not import the compiler (a second per kernel)."""
    import subprocess
    done = subprocess.run([sys.executable, "-c", GUARD_AFTER_DYNAMO_DISABLE_IS_REPLACED, before],
                          capture_output=True, text=True, check=True,
                          cwd=Path(course_attn.__file__).parents[1])
    assert done.stdout.split("] ")[0] == \
        "['torch.nn.functional.cross_entropy (it runs aten._log_softmax)'"
    assert done.stdout.strip().endswith(str(before == "replace"))

# --- evaluate(): a request in, an answer out ---------------------------------------------------

def evaluate(namespace, name, cases, refused=(), kind="function", ops=None, **options):
    """``options``: more of the guard's (``no_copy``, ``feeds``...), as the grader sends them."""
    reported = []
    request = {"name": name, "kind": kind, "refused": list(refused), "ops": ops,
               "package": PACKAGE, "allowed": [], "functions": [], **options,
               "cases": [{"args": encode(list(args)), "kwargs": encode(kwargs)}
                         for args, kwargs in cases]}
    answer = json.loads(json.dumps(harness.evaluate(json.loads(json.dumps(request)), namespace,
                                                    reported.append)))
    return answer, reported


def test_evaluate_answers_each_case_with_a_value_or_an_error():
    def double(x, *, times=2):
        if x.numel() == 0:
            raise ValueError("empty")
        return x * times

    def grows(x):
        x.add_(1)
        return object()

    answer, hits = evaluate({"double": double, "grows": grows}, "double",
                            [((torch.ones(2),), {}), ((torch.ones(2),), {"times": 3}),
                             ((torch.ones(0),), {})])
    assert answer["found"] and answer["banned"] == [] and hits == []
    first, second, third = answer["results"]
    assert torch.equal(decode(first["value"]), torch.full((2,), 2.0))
    assert torch.equal(decode(second["value"]), torch.full((2,), 3.0))
    assert third["error"]["type"] == "ValueError" and third["error"]["message"] == "empty"
    answer, _ = evaluate({"grows": grows}, "grows", [((torch.ones(2),), {})])
    assert answer["mutated"] == [[0, 0]] and "unencodable" in answer["results"][0]


def test_evaluate_reports_a_missing_function_a_value_and_banned_calls():
    answer, _ = evaluate({}, "double", [((1,), {})])
    threads = {"visited": answer.pop("visited"), "python_threads": answer.pop("python_threads")}
    assert answer == {"found": False, "results": [], "mutated": [], "banned": []}
    assert threading.get_native_id() in threads["python_threads"], threads
    answer, _ = evaluate({"guess": [0.5, 0.5]}, "guess", [((), {})], kind="value")
    assert answer["results"] == [{"value": [0.5, 0.5]}]
    answer, hits = evaluate({"soft": lambda x: torch.softmax(x, -1)}, "soft",
                            [((X,), {})], refused=SOFTMAX_BANS)
    assert answer["banned"] == hits and hits[0] == "torch.softmax"


def test_a_tensor_subclass_as_the_result_runs_none_of_its_code():
    """Its __torch_function__ would call the reference while the result is read: the result
    is refused, and nothing of it ran."""
    ran = []

    class Sneaky(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            ran.append(func)
            return super().__torch_function__(func, types, args, kwargs)

    answer, _ = evaluate({"f": lambda: torch.zeros(2).as_subclass(Sneaky)}, "f", [((), {})])
    assert "unencodable" in answer["results"][0] and ran == []


# --- feeds: a cached generation runs each token once through the weights its cache stands for

MODEL = {"embed": torch.randn(10, 6, dtype=torch.float64),
         "w": torch.randn(6, 4, dtype=torch.float64)}
PROMPT = torch.tensor([3, 1, 4])
FEEDS = [0, ["w"], 1, 2]  # the weights: args[0]["w"]; the prompt: args[1]; n new: args[2]


def generation(weights=lambda w: w, extra=0, rows=lambda x, w: x @ w):
    """A generation's work on ``w``: the prompt's rows, then one row per step but the last
    (and ``extra`` rows more), each through ``weights(w)``, made anew at every step, by
    ``rows(x, w)``."""
    def generate(params, prompt, n_new):
        x = params["embed"][prompt]
        out = [rows(x, weights(params["w"]))]
        for _ in range(n_new - 1 + extra):
            out.append(rows(x[-1:], weights(params["w"])))
        return torch.cat(out).sum()
    return generate


def feeds_hits(fn, n_new=4):
    answer, hits = evaluate({"generate": fn}, "generate", [((MODEL, PROMPT, n_new), {})],
                            feeds=FEEDS)
    assert answer["banned"] == hits
    return hits


WEIGHT_COPIES = {"itself": lambda w: w, "a clone": torch.clone, "plus 0": lambda w: w + 0,
                 "transposed and made contiguous": lambda w: w.t().contiguous().t(),
                 "stacked": lambda w: torch.stack([w])[0], "through float32": lambda w: w.float().double(),
                 "written into a buffer": lambda w: torch.empty_like(w).copy_(w),
                 "doubled then halved": lambda w: w * 2 / 2}


@pytest.mark.parametrize("name", WEIGHT_COPIES)
def test_a_generation_may_run_prompt_plus_n_minus_1_tokens_through_the_weights(name):
    """P + n - 1 rows through the weights, however copied, pass; one row more is a hit that
    says how many a cached generation runs."""
    copy = WEIGHT_COPIES[name]
    assert feeds_hits(generation(copy)) == []
    hits = feeds_hits(generation(copy, extra=1))
    assert hits == [f"{harness.READ_AGAIN}the earlier tokens (more than the 6 a cached "
                    "generation runs through w, 3 of the prompt and 3 new): torch.Tensor.matmul "
                    "(it runs aten.mm)"], hits


def test_a_product_of_any_kind_with_the_weights_counts_its_rows():
    """Elementwise, a matrix-vector product, a head-by-head loop: a row's worth each."""
    def elementwise(x, w):
        return (x[:, :, None] * w).sum(1)

    def by_columns(x, w):
        return torch.stack([torch.mv(x, column) for column in w.t()], dim=1)
    for rows in (elementwise, by_columns, lambda x, w: torch.einsum("tc,cd->td", x, w)):
        assert feeds_hits(generation(rows=rows)) == []
        assert len(feeds_hits(generation(rows=rows, extra=1))) == 1


def test_a_copy_of_the_weights_keeps_its_memory_until_the_call_ends():
    """A copy of the weights that is dropped at once frees memory that the next tensor of its
    size may take: if it did, that tensor would count as the weights. Each step copies the
    weights, drops the copy and multiplies by a fresh tensor of the same size (ones_like
    reads the weights' shape only: no copy)."""
    def generate(params, prompt, n_new):
        x, total = params["embed"][prompt], 0
        for _ in range(4 * n_new):
            (params["w"] * 1.0).sum()
            total = total + (x @ torch.ones_like(params["w"].t().contiguous().t())).sum()
        return total + (x @ params["w"]).sum()
    assert feeds_hits(generate) == []


def test_feeds_needs_its_arguments_as_declared():
    """Arguments that are not a dict of tensors, a tensor of tokens and an int: no rule."""
    answer, hits = evaluate({"f": lambda *a: torch.zeros(1)}, "f",
                            [(([1], PROMPT, 4), {}), ((MODEL, [3, 1], 4), {}),
                             (({"w": 2.0}, PROMPT, 4), {}), ((MODEL, PROMPT, 4.0), {})],
                            feeds=FEEDS)
    assert hits == [] and all("value" in r for r in answer["results"])


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
    credit, reason, flags = verdict(wrong)
    assert credit < 1 and re.search(r"\(first, a hidden case(?: \(.+?\))?: your result has shape "
                                    r"\(1,\)", reason), reason


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
    passed, reason, flags = verdict(correct_answer(), hits=[harness.SWITCHED_OFF])
    assert reason == ("switches off the check of the operations it runs (torch's modes popped "
                      "off their stacks, or the guard disarmed, during the call), which no "
                      "exercise allows")
    assert flags == ["ch03-causal_mask: the submission switched off the check of the operations "
                     "it runs (torch's modes popped off their stacks, or the guard disarmed, "
                     "during the call)"]


def test_errors_read_as_what_went_wrong():
    assert judge.describe_error({"type": "NotImplementedError"}) == judge.NOT_IMPLEMENTED
    assert judge.describe_error({"type": "ValueError", "message": "no", "line": 3}) == \
        "ValueError: no (line 3 of its cell)"
    assert judge.describe_error({"type": "RuntimeError", "line": 6, "message":
                                 "DefaultCPUAllocator: can't allocate memory"}) == \
        "ran out of memory (RuntimeError, line 6 of its cell)"
    assert judge.describe_error({"type": "MemoryError"}) == "ran out of memory (MemoryError)"


def test_the_exercises_banned_names_all_resolve():
    """A ban that names nothing bans nothing: every dotted name of every exercise resolves."""
    from course_attn.grading import all_exercises
    for key, exercise in all_exercises().items():
        for name in exercise.banned + exercise.allowed:
            if name.startswith("torch.Tensor."):
                assert hasattr(torch.Tensor, name.rsplit(".", 1)[1]), (key, name)
            elif not name.startswith("scipy.") and name != "course_attn":  # scipy: optional
                assert operations._code_of(name) is not None or \
                    callable(eval(name, {"torch": torch})), (key, name)


def test_check_gives_the_same_verdict_in_the_notebook(capsys):
    from course_attn.grading import ExerciseFailed, check
    with pytest.raises(ExerciseFailed, match="calls course_attn.masks.causal_mask"):
        check("ch03.causal_mask", lambda tq, tk: course_attn.causal_mask(tq, tk))
    check("ch03.causal_mask",
          lambda tq, tk: torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq))
    assert "checks passed" in capsys.readouterr().out
    assert get("ch03.causal_mask").banned


def test_a_multi_part_answer_with_one_part_wrong_earns_the_other_parts_share():
    evaluation = _prepare(GradedExercise("ch04-mha_cost", 3, "ch04.mha_cost"), seed=0)
    evaluation.run, evaluation.hits = CellRun("ok"), []
    results = []
    for case, expected in zip(evaluation.cases, evaluation.expected):
        value = dict(expected)
        value["params"] = 3 * value["params"] // 4   # W_O left out, in every case
        results.append({"value": encode(value)})
    evaluation.answer = {"found": True, "results": results, "mutated": [], "banned": []}
    credit, reason, flags = _verdict(evaluation, {}, lambda i: f"cell {i + 1}", 0)
    assert credit == pytest.approx(5 / 6) and reason.startswith("5 of 6 parts right; ")
    assert "you left out the output projection W_O" in reason and flags == []


def test_a_triton_kernel_of_the_package_launched_directly_is_refused_by_name(tmp_path):
    """A kernel launch runs no torch operation the modes see (under the interpreter, NumPy does
    the arithmetic): the launch itself is the hit, named after the kernel."""
    triton = pytest.importorskip("triton")
    import importlib.util
    package = tmp_path / "course_attn"
    package.mkdir()
    (package / "kernels.py").write_text(
        "import triton\n\n\n@triton.jit\ndef copy_kernel(x, y):\n    pass\n")
    spec = importlib.util.spec_from_file_location("fake_course_attn_kernels",
                                                  package / "kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    hits = []
    guard = Guard(ops=None, package=str(package), report=hits.append)

    def launch():
        try:
            module.copy_kernel[(1,)](torch.zeros(1), torch.zeros(1))
        except Exception:  # no GPU and no interpreter: the launch was seen before it failed
            pass
    guard.call(launch, (), {})
    assert hits == ["course_attn.kernels.copy_kernel"], hits
    assert type(module.copy_kernel).run.__name__ == "run"   # put back after the call
    del triton


def test_once_a_call_of_the_package_is_seen_the_guard_stops_walking_the_stack():
    """An arithmetic exercise handed a tensor-heavy package function fails at once; the
    thousands of operations after it must not each pay a stack walk (it took 130 s)."""
    from course_attn.grading.exercise import get
    from course_attn.grading.operations import guard_options
    exercise = get("ch04.mha_cost")
    guard = Guard(**{k: v for k, v in guard_options(exercise, PACKAGE).items()})
    walks = []
    place = guard._place
    guard._place = lambda *a: walks.append(1) or place(*a)

    x = torch.randn(1, 1, 4, 2)

    def heavy():
        for _ in range(200):
            course_attn.scaled_dot_product_attention(x, x, x)
    guard.call(heavy, (), {})
    assert guard.hits == ["course_attn.attention.scaled_dot_product_attention"]
    assert len(walks) < 20, len(walks)


def test_a_run_that_times_out_after_a_refused_call_is_failed_for_the_call():
    """The refused call is sent on the pipe the moment it happens; a run that then hits the
    time limit is failed for the call, by name, not for the time."""
    credit, reason, flags = verdict(None, hits=["course_attn.model.GPTConfig.__post_init__"],
                                    status="timeout")
    assert credit == 0 and reason.startswith("calls course_attn.model.GPTConfig.__post_init__")


def test_an_interrupt_that_drops_the_profiler_is_not_tampering():
    """The time limit's KeyboardInterrupt, landing inside the arithmetic exercises' profiler,
    makes CPython remove it; the guard must not report the profiler as replaced."""
    guard = Guard(ops=(), package=PACKAGE)

    def slow_honest_answer():
        sys.setprofile(None)            # what CPython does when the interrupt hits the profiler
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        guard.call(slow_honest_answer, (), {})
    assert guard.hits == []
