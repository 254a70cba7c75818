"""Chapter 2's exercises: each typical mistake fails the case meant for it with its own hint, and a
banned call is reported by name. What every exercise must satisfy (the reference and the
solution pass public and hidden cases, a stub is "not answered yet", every declared mistake
names itself) is tested once, for all chapters, in test_exercises_conformance.py.

The wrong solutions below are written as a student would write them; each test names the case
it must fail and a fragment of the hint it must get.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import course_attn
from course_attn.grading import get, run_exercise
from course_attn.grading.exercise import hidden_cases

from check_support import assert_banned, assert_fails


# --- solutions as in solutions/02_scaled_dot_product.ipynb ----------------------------------------

def attention_scores(q, k, scale=None):
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return q @ k.transpose(-2, -1) * scale


def stable_softmax(x, dim=-1):
    m = x.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x - m)
    total = e.sum(dim=dim, keepdim=True)
    return e / torch.where(total == 0, torch.ones_like(total), total)


def attention(q, k, v, scale=None):
    return stable_softmax(attention_scores(q, k, scale), dim=-1) @ v


def softmax_backward(y, g, dim=-1):
    return y * (g - (g * y).sum(dim=dim, keepdim=True))


def attention_cost(b, h, tq, tk, d, dv, bytes_per_element):
    flops = 2 * b * h * tq * tk * d + 2 * b * h * tq * tk * dv
    score_bytes = b * h * tq * tk * bytes_per_element
    io_bytes = b * h * (tq * d + tk * d + tk * dv + tq * dv) * bytes_per_element
    return {"flops": flops, "score_bytes": score_bytes, "io_bytes": io_bytes}


@pytest.mark.parametrize("key, fn", [
    ("ch02.attention_scores", attention_scores), ("ch02.stable_softmax", stable_softmax),
    ("ch02.attention", attention), ("ch02.softmax_backward", softmax_backward),
    ("ch02.attention_cost", attention_cost)])
def test_the_notebooks_solutions_pass_with_the_watch_on(key, fn):
    for cases in [None] + [hidden_cases(key, seed) for seed in range(5)]:
        judgement = run_exercise(get(key), fn, cases)
        assert judgement.passed, (judgement.banned, [(r.name, r.message) for r in
                                                     judgement.results if not r.passed])


# --- attention_scores --------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:The use of `x.T`")
def test_attention_scores_mistakes():
    key, first = "ch02.attention_scores", "B=2, H=3, Tq=Tk=5, D=8, float32"
    assert_fails(key, lambda q, k, scale=None: q @ k.transpose(-2, -1), first,
                 hint="you did not scale")
    assert_fails(key, lambda q, k, scale=None: q @ k.transpose(-2, -1) / q.shape[-1], first,
                 hint="divide by D instead")
    assert_fails(key, lambda q, k, scale=None: q @ k.transpose(-2, -1) / math.sqrt(q.shape[-2]),
                 "default scale is 1/sqrt(D), D=16, T=4", hint="1/sqrt(T)")
    assert_fails(key, lambda q, k, scale=None: q @ k.transpose(-2, -1) * math.sqrt(q.shape[-1]),
                 first, hint="multiply by sqrt(D)")
    assert_fails(key, lambda q, k, scale=None: attention_scores(q, k), "custom scale=0.5",
                 hint="ignore the scale argument")
    assert_fails(key, lambda q, k, scale=None: attention_scores(q, k) if scale is None else
                 q @ k.transpose(-2, -1) / scale, "custom scale=0.5", hint="divide by the scale")
    # k.T reverses every axis of a 4-d tensor: an error, and the case's hint says which axes
    assert_fails(key, lambda q, k, scale=None: q @ k.T / math.sqrt(q.shape[-1]),
                 "Tq=4 != Tk=9: shape (B, H, Tq, Tk)", hint="transpose only the last two axes",
                 message="RuntimeError")


def test_attention_scores_may_not_call_a_library_attention():
    def through_the_package(q, k, scale=None):
        return course_attn.attention_weights(q, k, scale=scale).log()
    assert_banned("ch02.attention_scores", through_the_package, "course_attn")


# --- stable_softmax ----------------------------------------------------------------------------

def test_stable_softmax_mistakes():
    key = "ch02.stable_softmax"

    def naive(x, dim=-1):
        e = x.exp()
        return e / e.sum(dim=dim, keepdim=True)

    def unguarded(x, dim=-1):
        e = (x - x.amax(dim=dim, keepdim=True)).exp()
        return e / e.sum(dim=dim, keepdim=True)

    def global_max(x, dim=-1):
        e = (x - x.max()).exp()
        return e / e.sum(dim=dim, keepdim=True)

    def no_keepdim(x, dim=-1):
        e = (x - x.amax(dim=dim)).exp()
        return e / e.sum(dim=dim)

    def last_axis(x, dim=-1):
        return stable_softmax(x)

    assert_fails(key, naive, "large inputs ~ +1000 (float32)", hint="without subtracting",
                 message="NaN")
    assert_fails(key, unguarded, "a row that is all -inf gives zeros, not NaN",
                 hint="all -inf gives NaN")
    assert_fails(key, global_max, "rows of very different sizes (~ +1000, ~ 0, ~ -1000)",
                 hint="the whole tensor")
    assert_fails(key, no_keepdim, "a square (5, 5) input", hint="no keepdim=True")
    # on a (4, 6) input the same mistake raises: the grader names it by its error
    assert_fails(key, no_keepdim, "random (4, 6), over the last axis",
                 hint="your max and sum have no keepdim=True", message="RuntimeError")
    assert_fails(key, last_axis, "(3, 5, 4) over dim=1", hint="the dim you were given")


def test_stable_softmax_may_not_call_a_library_softmax():
    # the one-line shortcut of the issue: right answers, but a forbidden call
    shortcut = lambda x, dim=-1: torch.softmax(x, dim=dim).nan_to_num(0.0)  # noqa: E731
    assert run_exercise(get("ch02.stable_softmax"), shortcut, watch_banned=False).passed
    assert_banned("ch02.stable_softmax", shortcut, "torch.softmax")
    assert_banned("ch02.stable_softmax", lambda x, dim=-1: x.softmax(dim).nan_to_num(0.0),
                  "torch.Tensor.softmax")
    assert_banned("ch02.stable_softmax", lambda x, dim=-1: course_attn.softmax(x, dim),
                  "course_attn")
    assert_banned("ch02.stable_softmax",
                  lambda x, dim=-1: F.log_softmax(x, dim=dim).exp().nan_to_num(0.0),
                  "log_softmax")


# --- attention ---------------------------------------------------------------------------------

def test_attention_mistakes():
    key, first = "ch02.attention", "B=2, H=3, Tq=Tk=6, D=8, float32"

    def unscaled(q, k, v, scale=None):
        return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v

    def over_queries(q, k, v, scale=None):
        return torch.softmax(attention_scores(q, k, scale), dim=-2) @ v

    def scale_from_v(q, k, v, scale=None):
        scale = 1 / math.sqrt(v.shape[-1]) if scale is None else scale
        return torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v

    def naive(q, k, v, scale=None):
        e = attention_scores(q, k, scale).exp()
        return e / e.sum(dim=-1, keepdim=True) @ v

    assert_fails(key, unscaled, first, hint="did not scale")
    assert_fails(key, over_queries, first, hint="over the queries")
    assert_fails(key, scale_from_v, "D=8 != Dv=3", hint="1/sqrt(Dv)")
    assert_fails(key, lambda q, k, v, scale=None: attention(q, k, v), "custom scale=0.3",
                 hint="ignore the scale argument")
    assert_fails(key, lambda q, k, v, scale=None: attention(q, k, v, math.sqrt(q.shape[-1])
                                                            if scale is None else scale),
                 first, hint="multiply the scores by sqrt(D)")
    assert_fails(key, naive, "large scores (|q kᵀ| ~ 1000s, float64)", hint="subtract the row "
                 "maximum", message="NaN")


def test_a_zero_scale_taken_for_the_default_passes_every_public_case_but_no_hidden_draw():
    def scale_or_default(q, k, v, scale=None):
        return attention(q, k, v, scale or 1.0 / math.sqrt(q.shape[-1]))  # 0.0 is falsy
    exercise = get("ch02.attention")
    assert run_exercise(exercise, scale_or_default).passed
    for seed in range(20):
        judgement = run_exercise(exercise, scale_or_default, hidden_cases(exercise.key, seed))
        assert not judgement.passed, f"seed {seed}: no hidden case tries scale=0.0 on two keys"


def test_attention_may_not_call_a_library_attention():
    one_line = lambda q, k, v, scale=None: F.scaled_dot_product_attention(  # noqa: E731
        q, k, v, scale=scale)
    assert run_exercise(get("ch02.attention"), one_line, watch_banned=False).passed
    assert_banned("ch02.attention", one_line, "torch.nn.functional.scaled_dot_product_attention")
    assert_banned("ch02.attention", lambda q, k, v, scale=None:
                  course_attn.scaled_dot_product_attention(q, k, v, scale=scale), "course_attn")


# --- softmax_backward --------------------------------------------------------------------------

@pytest.mark.parametrize("shape, dim", [((4, 6), -1), ((3, 5, 4), 1), ((6, 3), 0),
                                        ((2, 3, 4, 5), -2)])
def test_the_softmax_backward_reference_is_what_autograd_computes(shape, dim):
    generator = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(*shape, generator=generator, dtype=torch.float64)).requires_grad_()
    g = torch.randn(*shape, generator=generator, dtype=torch.float64)
    y = torch.softmax(x, dim=dim)
    y.backward(g)
    reference = get("ch02.softmax_backward").reference
    torch.testing.assert_close(reference(y.detach(), g, dim), x.grad)


def test_every_softmax_backward_case_agrees_with_autograd():
    """Each case's y is a softmax of some x (x = log y up to a constant, -inf where y = 0): the
    expected answer is autograd's gradient at that x."""
    exercise = get("ch02.softmax_backward")
    for case in exercise.public_cases() + hidden_cases(exercise.key, 0):
        y, g = case.args
        dim = case.kwargs.get("dim", -1)
        x = y.double().log().requires_grad_()
        torch.softmax(x, dim=dim).backward(g.double())
        torch.testing.assert_close(exercise.expected(case).double(), x.grad.nan_to_num(0.0),
                                   rtol=1e-5, atol=1e-6)


def test_softmax_backward_mistakes():
    key, first = "ch02.softmax_backward", "y, g of shape (4, 6), over the last axis"
    assert_fails(key, lambda y, g, dim=-1: y * (1 - y) * g, first, hint="only the diagonal")
    assert_fails(key, lambda y, g, dim=-1: y * g, first, hint="(y ⊙ g)")
    assert_fails(key, lambda y, g, dim=-1: y * (g - g.sum(dim=dim, keepdim=True)), first,
                 hint="the plain sum of g")
    assert_fails(key, lambda y, g, dim=-1: g - (g * y).sum(dim=dim, keepdim=True), first,
                 hint="the factor y_j")
    assert_fails(key, lambda y, g, dim=-1: y * ((g * y).sum(dim=dim, keepdim=True) - g), first,
                 hint="the sign is flipped")
    assert_fails(key, lambda y, g, dim=-1: y * (g - (g * y).sum(dim=dim)), "a square (5, 5) input",
                 hint="no keepdim=True")
    assert_fails(key, lambda y, g, dim=-1: softmax_backward(y, g), "(3, 5, 4), dim=1",
                 hint="always sum over the last axis")
    # y ⊙ g is not zero when g is the same everywhere: the case for it names the mistake
    assert_fails(key, lambda y, g, dim=-1: y * g,
                 "the same upstream gradient for every key: dL/dx = 0", hint="(y ⊙ g)")


def test_softmax_backward_may_not_call_autograd():
    key = "ch02.softmax_backward"

    def with_backward(y, g, dim=-1):
        x = y.log().detach().requires_grad_()
        torch.softmax(x, dim=dim).backward(g)
        return x.grad.nan_to_num(0.0)

    def with_grad(y, g, dim=-1):
        x = y.log().detach().requires_grad_()
        return torch.autograd.grad(torch.softmax(x, dim=dim), x, g)[0].nan_to_num(0.0)

    def with_vjp(y, g, dim=-1):
        _, vjp = torch.func.vjp(lambda x: torch.softmax(x, dim=dim), y.log())
        return vjp(g)[0].nan_to_num(0.0)

    def with_the_internal_op(y, g, dim=-1):
        return torch._softmax_backward_data(g, y, dim, y.dtype)

    assert run_exercise(get(key), with_backward, watch_banned=False).passed
    assert_banned(key, with_backward, "torch.Tensor.backward")
    assert_banned(key, with_grad, "torch.autograd.grad")
    assert_banned(key, with_vjp, "torch.func.vjp")
    assert_banned(key, with_the_internal_op, "torch._softmax_backward_data")


# --- attention_cost ----------------------------------------------------------------------------

def test_attention_cost_at_8k_context_is_the_round_numbers():
    """B=1, H=32, T=8192, D=128, float16: 2**40 FLOPs (≈ 1.1 TFLOP), scores of 2**32 bytes
    (4 GiB), q, k, v and the output 2**28 bytes (256 MiB), 16 times less."""
    exercise = get("ch02.attention_cost")
    case = exercise.public_cases()[0]
    assert case.args == (1, 32, 8192, 8192, 128, 128, 2)
    assert exercise.expected(case) == {"flops": 2**40, "score_bytes": 2**32, "io_bytes": 2**28}


def test_attention_cost_mistakes():
    key = "ch02.attention_cost"
    first = "B=1, H=32, T=8192, D=128, float16 (one layer of a 7B model, 8k context)"
    batch = "B=4, H=8, Tq=Tk=1024, D=64, float32"
    cache = "Tq=16 != Tk=4096, D=128, Dv=64, bfloat16 (a chunk of queries against a cache)"

    def cost(flops=None, score=None, io=None):
        def fn(b, h, tq, tk, d, dv, e):
            right = attention_cost(b, h, tq, tk, d, dv, e)
            sizes = (b, h, tq, tk, d, dv, e)
            return {"flops": flops(*sizes) if flops else right["flops"],
                    "score_bytes": score(*sizes) if score else right["score_bytes"],
                    "io_bytes": io(*sizes) if io else right["io_bytes"]}
        return fn

    multiply_add_as_one = cost(flops=lambda b, h, tq, tk, d, dv, e: b * h * tq * tk * (d + dv))
    only_scores = cost(flops=lambda b, h, tq, tk, d, dv, e: 2 * b * h * tq * tk * d)
    # with D == Dv the ways to get half the FLOPs give one number: one hint names them all
    assert_fails(key, multiply_add_as_one, first, hint="your FLOPs are half the count")
    assert_fails(key, only_scores, first, hint="your FLOPs are half the count")
    assert_fails(key, multiply_add_as_one, cache, hint="a multiply-add as 1 FLOP",
                 message="too small")
    assert_fails(key, only_scores, cache, hint="only the scores q kᵀ")
    assert_fails(key, cost(flops=lambda b, h, tq, tk, d, dv, e: 4 * b * h * tq * tk * d), cache,
                 hint="use D for both products")
    assert_fails(key, lambda b, h, tq, tk, d, dv, e: attention_cost(b, 1, tq, tk, d, dv, e), first,
                 hint="left out the heads")
    assert_fails(key, lambda b, h, tq, tk, d, dv, e: attention_cost(1, h, tq, tk, d, dv, e), batch,
                 hint="left out the batch")
    assert_fails(key, lambda b, h, tq, tk, d, dv, e: attention_cost(b, h, tq, tk, d, dv, 1), first,
                 hint="counted numbers, not bytes")
    assert_fails(key, lambda b, h, tq, tk, d, dv, e: attention_cost(b, h, tq, tk, d, dv, 4), first,
                 hint="4 bytes a number")
    assert_fails(key, cost(io=lambda b, h, tq, tk, d, dv, e: 3 * b * h * tq * d * e), first,
                 hint="leave out the output")
    assert_fails(key, cost(io=lambda b, h, tq, tk, d, dv, e: 4 * b * h * tq * d * e), cache,
                 hint="the size of q")
    assert_fails(key, lambda *sizes: list(attention_cost(*sizes).values()), first,
                 message="should be a dict")


def test_a_wrong_cost_is_told_too_small_never_the_answer_nor_a_factor():
    exercise = get("ch02.attention_cost")
    wrong = lambda *sizes: {**attention_cost(*sizes), "flops": 1}  # noqa: E731
    result = run_exercise(exercise, wrong).results[0]
    assert "too small" in result.message and str(2**40) not in result.message
    assert "times" not in result.message


def test_attention_cost_may_not_use_the_package():
    def with_the_package(b, h, tq, tk, d, dv, e):
        course_attn.causal_mask(1)
        return attention_cost(b, h, tq, tk, d, dv, e)
    assert_banned("ch02.attention_cost", with_the_package, "course_attn")
