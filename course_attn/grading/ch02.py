"""Exercises of Chapter 2, scaled dot-product attention.

    ch02.attention_scores   q kᵀ · scale                 (…, Tq, D), (…, Tk, D) -> (…, Tq, Tk)
    ch02.stable_softmax     softmax that survives ±1000   any shape, over ``dim``
    ch02.attention          softmax(q kᵀ · scale) v       (B, H, Tq, D), (B, H, Tk, D),
                                                          (B, H, Tk, Dv) -> (B, H, Tq, Dv)
    ch02.softmax_backward   dL/dx from y = softmax(x) and g = dL/dy, any shape, over ``dim``
                            (derive: checked against autograd, which it may not call)
    ch02.attention_cost     the FLOPs and bytes of attention for given sizes -> dict
                            (derive: {"flops", "score_bytes", "io_bytes"})

References: the one-line formula for the scores, ``course_attn.softmax`` and
``course_attn.scaled_dot_product_attention``; the formulas of the softmax's gradient and of the
cost, written out below.
"""

import math

import torch

from ..attention import scaled_dot_product_attention, softmax
from .cases import (answers_changed, expect_close_tensor, expect_tensor, randn,
                    softmax_without_shift)
from .exercise import Case, Exercise, Mistake, register
from .operations import ELEMENTARY, NO_LIBRARY_ATTENTION, NO_LIBRARY_SOFTMAX, SOFTMAX


def attention_scores_reference(q, k, scale=None):
    """(…, Tq, D), (…, Tk, D) -> (…, Tq, Tk): q kᵀ times scale (1/sqrt(D) when None)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return q @ k.transpose(-2, -1) * scale


def _scores_cases():
    yield Case("B=2, H=3, Tq=Tk=5, D=8, float32", (randn(2, 3, 5, 8, seed=0),
                                                    randn(2, 3, 5, 8, seed=1)),
               hint="multiply q by k transposed over its last two axes, then scale by 1/sqrt(D)")
    yield Case("Tq=4 != Tk=9: shape (B, H, Tq, Tk)", (randn(2, 2, 4, 8, seed=2),
                                                      randn(2, 2, 9, 8, seed=3)),
               hint="transpose only the last two axes of k: k.transpose(-2, -1), not k.T")
    yield Case("default scale is 1/sqrt(D), D=16, T=4", (randn(1, 2, 4, 16, seed=4),
                                                         randn(1, 2, 4, 16, seed=5)),
               hint="D is the size of the last axis of q (the head dimension), not the length T")
    yield Case("custom scale=0.5", (randn(2, 2, 3, 6, seed=6), randn(2, 2, 7, 6, seed=7)),
               {"scale": 0.5}, hint="when scale is given, multiply by it instead of 1/sqrt(D)")
    yield Case("Tq=Tk=1", (randn(1, 1, 1, 4, seed=8), randn(1, 1, 1, 4, seed=9)),
               hint="a single query and a single key still give a (B, H, 1, 1) tensor")
    yield Case("no head axis: (B, Tq, D), (B, Tk, D)", (randn(3, 6, 4, seed=10),
                                                        randn(3, 5, 4, seed=11)),
               hint="use operations on the last two axes only, so any leading axes work")
    yield Case("float64 in, float64 out", (randn(2, 2, 5, 8, seed=12, dtype=torch.float64),
                                           randn(2, 2, 6, 8, seed=13, dtype=torch.float64)),
               hint="do not convert the inputs; let their dtype flow through")


register(Exercise(
    key="ch02.attention_scores", function="attention_scores",
    ops=ELEMENTARY | SOFTMAX,
    reference=attention_scores_reference, cases=_scores_cases, compare=expect_tensor,
    banned=NO_LIBRARY_ATTENTION,
    mistakes=(
        Mistake("k.T reverses every axis of a 4-d tensor, not only the last two: transpose only "
                "the last two axes (the time and the head dimension)",
                lambda q, k, scale=None: q @ k.T / math.sqrt(q.shape[-1])),
        Mistake("you did not scale the scores: multiply q kᵀ by 1/sqrt(D) (or by scale)",
                lambda q, k, scale=None: attention_scores_reference(q, k, 1.0)),
        Mistake("you divide by D instead of sqrt(D)",
                lambda q, k, scale=None: attention_scores_reference(
                    q, k, 1.0 / q.shape[-1] if scale is None else scale)),
        Mistake("you scale by 1/sqrt(T) (the sequence length) instead of 1/sqrt(D) (the head "
                "dimension, q.shape[-1])",
                lambda q, k, scale=None: attention_scores_reference(
                    q, k, 1.0 / math.sqrt(q.shape[-2]) if scale is None else scale)),
        Mistake("you ignore the scale argument: when it is given, use it instead of 1/sqrt(D)",
                lambda q, k, scale=None: attention_scores_reference(q, k, None)),
        Mistake("you multiply by sqrt(D): the scores are divided by sqrt(D) (times 1/sqrt(D))",
                lambda q, k, scale=None: attention_scores_reference(
                    q, k, math.sqrt(q.shape[-1]) if scale is None else scale)),
        Mistake("you divide by the scale argument: when it is given, multiply by it",
                lambda q, k, scale=None: attention_scores_reference(
                    q, k, None if scale is None else 1.0 / scale)),
    ),
))


def _softmax_nan_rows(x, dim=-1):
    shifted = x - x.amax(dim=dim, keepdim=True)
    e = shifted.exp()
    return e / e.sum(dim=dim, keepdim=True)


def _softmax_global_max(x, dim=-1):
    e = (x - x.max()).exp()
    return e / e.sum(dim=dim, keepdim=True)


def _softmax_no_keepdim(x, dim=-1):
    """The max and the sum without keepdim=True: on a square input they broadcast along the
    other axis."""
    e = (x - x.amax(dim=dim)).exp()
    return e / e.sum(dim=dim)


def _softmax_sum_no_keepdim(x, dim=-1):
    e = (x - x.amax(dim=dim, keepdim=True)).exp()
    return e / e.sum(dim=dim)


def _softmax_cases():
    yield Case("random (4, 6), over the last axis", (randn(4, 6, seed=20, scale=3.0),),
               hint="exponentiate, then divide by the sum over dim (keepdim=True)")
    yield Case("a square (5, 5) input", (randn(5, 5, seed=27, scale=2.0),),
               hint="a max or a sum without keepdim=True broadcasts along the wrong axis when "
                    "the shape is square")
    yield Case("(3, 5, 4) over dim=1", (randn(3, 5, 4, seed=21),), {"dim": 1},
               hint="take the max and the sum over the dim you were given, with keepdim=True")
    yield Case("large inputs ~ +1000 (float32)", (1000 + randn(4, 8, seed=22, scale=10.0),),
               hint="exp(1000) overflows to inf: subtract each row's maximum before exp")
    yield Case("large negative inputs ~ -1000 (float64)",
               (-1000 + randn(4, 8, seed=23, dtype=torch.float64, scale=10.0),),
               hint="exp(-1000) underflows to 0 and 0/0 is NaN: subtract each row's maximum")
    x = randn(3, 6, seed=28, scale=3.0)
    x[0] += 1000.0
    x[2] -= 1000.0
    yield Case("rows of very different sizes (~ +1000, ~ 0, ~ -1000)", (x,),
               hint="each row needs its own maximum: one number for the whole tensor leaves "
                    "the other rows to underflow")
    x = randn(3, 6, seed=24)
    x[0, 1] = x[1, 4] = x[1, 5] = x[2, 0] = float("-inf")
    yield Case("some entries are -inf", (x,),
               hint="exp(-inf) = 0, so a -inf entry gets weight 0 and the rest still sum to 1")
    x = randn(3, 5, seed=25)
    x[1] = float("-inf")
    yield Case("a row that is all -inf gives zeros, not NaN", (x,),
               hint="that row's max is -inf and -inf - (-inf) is NaN: subtract 0 instead of a "
                    "max that is not finite, and divide by 1 where the sum is 0")
    yield Case("one entry per row (T=1), float64", (randn(2, 3, 1, seed=26, dtype=torch.float64),),
               hint="a single finite entry gets all the weight: the result is 1.0")


register(Exercise(
    key="ch02.stable_softmax", function="stable_softmax",
    ops=ELEMENTARY,
    reference=lambda x, dim=-1: softmax(x, dim=dim), cases=_softmax_cases,
    compare=expect_tensor,
    banned=("course_attn",) + NO_LIBRARY_SOFTMAX + ("torch.nn.functional.log_softmax",
                                                   "torch.log_softmax", "torch.Tensor.log_softmax"),
    mistakes=(
        # First: on a row of -inf every softmax without the two guards gives the same NaN.
        Mistake("a row whose entries are all -inf gives NaN (0/0, or -inf - (-inf) once you "
                "subtract its max): such a row must give zeros", _softmax_nan_rows),
        Mistake("you exponentiate without subtracting each row's maximum first: exp overflows "
                "to inf (and inf/inf is NaN)", softmax_without_shift),
        Mistake("you always take the softmax over the last axis: use the dim you were given",
                lambda x, dim=-1: softmax(x, dim=-1)),
        Mistake("you subtract the maximum of the whole tensor, not of each row: a row far below "
                "it underflows to 0/0", _softmax_global_max),
        Mistake("your max and sum have no keepdim=True, so they broadcast along the wrong axis",
                _softmax_no_keepdim),
        Mistake("your sum has no keepdim=True, so it broadcasts along the wrong axis",
                _softmax_sum_no_keepdim),
    ),
))


def attention_reference(q, k, v, scale=None):
    return scaled_dot_product_attention(q, k, v, scale=scale)


def _attention_cases():
    yield Case("B=2, H=3, Tq=Tk=6, D=8, float32",
               tuple(randn(2, 3, 6, 8, seed=s) for s in (30, 31, 32)),
               hint="scores (…, Tq, Tk) -> softmax over the keys (dim=-1) -> weights @ v")
    yield Case("Tq=3 != Tk=7", (randn(1, 2, 3, 8, seed=33), randn(1, 2, 7, 8, seed=34),
                                randn(1, 2, 7, 8, seed=35)),
               hint="the output has one row per query: (B, H, Tq, Dv)")
    yield Case("D=8 != Dv=3", (randn(2, 2, 5, 8, seed=36), randn(2, 2, 5, 8, seed=37),
                               randn(2, 2, 5, 3, seed=38)),
               hint="the default scale is 1/sqrt(D) with D from q and k, not from v")
    yield Case("Tq=Tk=1: the output is v", tuple(randn(1, 1, 1, 4, seed=s) for s in (39, 40, 41)),
               hint="with a single key its weight is 1, so the output equals v")
    yield Case("custom scale=0.3", tuple(randn(2, 2, 4, 6, seed=s) for s in (42, 43, 44)),
               {"scale": 0.3},
               hint="when scale is given, multiply the scores by it instead of 1/sqrt(D)")
    yield Case("float64 in, float64 out",
               tuple(randn(2, 2, 5, 4, seed=s, dtype=torch.float64) for s in (45, 46, 47)),
               hint="do not convert the inputs; let their dtype flow through")
    q, k, v = (randn(1, 2, 5, 8, seed=s, dtype=torch.float64) for s in (48, 49, 50))
    yield Case("large scores (|q kᵀ| ~ 1000s, float64)", (q * 40, k * 40, v),
               hint="a softmax that exponentiates raw scores overflows: subtract the row maximum")


register(Exercise(
    key="ch02.attention", function="attention", reference=attention_reference,
    ops=ELEMENTARY | SOFTMAX,
    cases=_attention_cases, compare=expect_tensor, banned=NO_LIBRARY_ATTENTION,
    mistakes=(
        Mistake("your softmax exponentiates the raw scores: past 709 exp is inf, and inf / inf "
                "is NaN; subtract the row maximum first",
                lambda q, k, v, scale=None: softmax_without_shift(
                    attention_scores_reference(q, k, scale)) @ v),
        Mistake("you did not scale the scores by 1/sqrt(D)",
                lambda q, k, v, scale=None: attention_reference(q, k, v, scale=1.0)),
        Mistake("you scale by 1/sqrt(Dv), from v; D comes from q and k",
                lambda q, k, v, scale=None: attention_reference(
                    q, k, v, scale=scale if scale is not None else 1 / math.sqrt(v.shape[-1]))),
        Mistake("your softmax runs over the queries (dim=-2); it must run over the keys "
                "(dim=-1)",
                lambda q, k, v, scale=None: torch.softmax(
                    attention_scores_reference(q, k, scale), dim=-2) @ v),
        Mistake("you ignore the scale argument: when it is given, use it instead of 1/sqrt(D)",
                lambda q, k, v, scale=None: attention_reference(q, k, v)),
        Mistake("you multiply the scores by sqrt(D): they are divided by it",
                lambda q, k, v, scale=None: attention_reference(
                    q, k, v, scale=math.sqrt(q.shape[-1]) if scale is None else scale)),
        Mistake("you multiply the values by the raw scores: turn the scores into weights with a "
                "softmax over the keys first",
                lambda q, k, v, scale=None: attention_scores_reference(q, k, scale) @ v),
    ),
))


# --- ch02.softmax_backward: derive the gradient of the softmax ---------------------------------

def softmax_backward_reference(y, g, dim=-1):
    """dL/dx from y = softmax(x, dim) and g = dL/dy: y ⊙ (g − Σ_j g_j y_j) along ``dim``. It is
    what autograd computes (``tests/test_checks_ch02.py`` checks it against torch.autograd)."""
    return y * (g - (g * y).sum(dim=dim, keepdim=True))


def _backward_cases():
    gen = torch.Generator().manual_seed(60)

    def pair(*shape, dim=-1, scale=1.0, dtype=torch.float32):
        y = softmax(randn(*shape, seed=gen, scale=scale, dtype=torch.float64), dim=dim)
        return y.to(dtype), randn(*shape, seed=gen, dtype=dtype)

    yield Case("y, g of shape (4, 6), over the last axis", pair(4, 6),
               hint="the Jacobian of the softmax is dy_i/dx_j = y_i (δ_ij − y_j): "
                    "dL/dx_j = Σ_i g_i dy_i/dx_j")
    yield Case("(3, 5, 4), dim=1", pair(3, 5, 4, dim=1), {"dim": 1},
               hint="the sum runs along the axis the softmax ran along, dim, with keepdim=True")
    y, _ = pair(5, 5)
    yield Case("a square (5, 5) input", (y, randn(5, 5, seed=gen)),
               hint="a sum without keepdim=True broadcasts along the wrong axis when the shape is "
                    "square")
    y, _ = pair(3, 7)
    yield Case("the same upstream gradient for every key: dL/dx = 0",
               (y, torch.full((3, 7), 0.7)),
               hint="adding a constant to every x leaves the softmax unchanged, so a gradient "
                    "that pushes every y_i equally must give dL/dx = 0")
    x = randn(3, 6, seed=gen)
    x[0, 2] = x[1, 0] = x[1, 5] = x[2, 3] = float("-inf")
    yield Case("masked keys (weight exactly 0) get gradient 0",
               (softmax(x, dim=-1), randn(3, 6, seed=gen)),
               hint="every term of dL/dx_j has the factor y_j, so a key with weight 0 gets "
                    "gradient 0")
    yield Case("saturated rows (one weight ≈ 1), float64", pair(4, 8, scale=30.0,
                                                              dtype=torch.float64),
               hint="a softmax that is almost one-hot passes almost no gradient back: "
                    "y_j (g_j − Σ g y) is small for every j")
    yield Case("(6, 3) over dim=0, float64", pair(6, 3, dim=0, dtype=torch.float64), {"dim": 0},
               hint="use the dim you were given, not the last axis")


def _backward_no_keepdim(y, g, dim=-1):
    return y * (g - (g * y).sum(dim=dim))


register(Exercise(
    key="ch02.softmax_backward", function="softmax_backward",
    ops=ELEMENTARY | SOFTMAX,
    reference=softmax_backward_reference, cases=_backward_cases,
    compare=expect_close_tensor(1e-5, 1e-6),
    banned=("course_attn", "torch.autograd.grad", "torch.autograd.backward",
            "torch.Tensor.backward", "torch.autograd.functional.jacobian",
            "torch.autograd.functional.vjp", "torch.func.grad", "torch.func.grad_and_value",
            "torch.func.vjp", "torch.func.jacrev", "torch.func.jacfwd",
            "torch._softmax_backward_data"),
    mistakes=(
        Mistake("you used only the diagonal of the Jacobian, y_j (1 − y_j) g_j: every y_i depends "
                "on every x_j, so the off-diagonal terms −y_i y_j add up to −y_j Σ_i g_i y_i",
                lambda y, g, dim=-1: y * (1 - y) * g),
        Mistake("you multiplied g by y (y ⊙ g): the Jacobian y_i (δ_ij − y_j) also has the term "
                "−y_j Σ_i g_i y_i", lambda y, g, dim=-1: y * g),
        Mistake("you subtract Σ g (the plain sum of g); the term is Σ_i g_i y_i, g weighted by y",
                lambda y, g, dim=-1: y * (g - g.sum(dim=dim, keepdim=True))),
        Mistake("you forgot the factor y_j in front: dL/dx_j = y_j (g_j − Σ_i g_i y_i)",
                lambda y, g, dim=-1: g - (g * y).sum(dim=dim, keepdim=True)),
        Mistake("the sign is flipped: dL/dx_j = y_j (g_j − Σ_i g_i y_i), not y_j (Σ_i g_i y_i − "
                "g_j)", lambda y, g, dim=-1: -softmax_backward_reference(y, g, dim)),
        Mistake("your sum has no keepdim=True, so it broadcasts along the wrong axis",
                _backward_no_keepdim),
        Mistake("you always sum over the last axis: use the dim you were given",
                lambda y, g, dim=-1: softmax_backward_reference(y, g, -1)),
    ),
))


# --- ch02.attention_cost: the FLOPs and bytes of attention -------------------------------------

COST_KEYS = ("flops", "score_bytes", "io_bytes")


def attention_cost_reference(b, h, tq, tk, d, dv, bytes_per_element):
    """What one call of (unmasked, unfused) attention costs: the FLOPs of its two matrix products
    (a multiply-add is 2 FLOPs), the bytes of the (B, H, Tq, Tk) scores, and the bytes of q, k,
    v and the output."""
    return {
        "flops": 2 * b * h * tq * tk * d + 2 * b * h * tq * tk * dv,
        "score_bytes": b * h * tq * tk * bytes_per_element,
        "io_bytes": b * h * (tq * d + tk * d + tk * dv + tq * dv) * bytes_per_element,
    }


def expect_cost(actual, expected, case=None):
    """A dict with the keys of ``expected``, each a number equal to it (within 1e-9); a wrong one
    is told too large or too small, never by what factor (a factor would let a student fix the
    number by multiplying)."""
    if not isinstance(actual, dict):
        raise AssertionError(f"your result should be a dict with the keys {list(COST_KEYS)}, "
                             f"got {type(actual).__name__}")
    for key, want in expected.items():
        if key not in actual:
            raise AssertionError(f"your dict has no key {key!r} (it has {sorted(actual)})")
        got = actual[key]
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise AssertionError(f"{key!r} should be a number, got {type(got).__name__}")
        if not math.isclose(got, want, rel_tol=1e-9):
            raise AssertionError(f"your {key!r} is {'too large' if got > want else 'too small'}")


def _cost(**wrong):
    """A typical mistake: the reference with some of its entries computed another way, each
    rule a function of b, h, tq, tk, d, dv and e (bytes per element)."""
    return answers_changed(attention_cost_reference, wrong, sizes=_cost_sizes)


def _cost_sizes(b, h, tq, tk, d, dv, bytes_per_element):
    return dict(b=b, h=h, tq=tq, tk=tk, d=d, dv=dv, e=bytes_per_element)


def _only_if_d_is_dv(fn):
    """``fn`` where D == Dv; elsewhere no answer (a typical mistake that does not apply)."""
    def only(b, h, tq, tk, d, dv, bytes_per_element):
        if d != dv:
            raise ValueError("this mistake is told apart from the others only when D == Dv")
        return fn(b, h, tq, tk, d, dv, bytes_per_element)
    return only


def _cost_cases():
    yield Case("B=1, H=32, T=8192, D=128, float16 (one layer of a 7B model, 8k context)",
               (1, 32, 8192, 8192, 128, 128, 2),
               hint="scores: a (Tq, D) @ (D, Tk) product per head, then weights: (Tq, Tk) @ "
                    "(Tk, Dv); count each multiply-add as 2 FLOPs")
    yield Case("B=4, H=8, Tq=Tk=1024, D=64, float32", (4, 8, 1024, 1024, 64, 64, 4),
               hint="every number grows with the batch B and the heads H")
    yield Case("Tq=16 != Tk=4096, D=128, Dv=64, bfloat16 (a chunk of queries against a cache)",
               (2, 16, 16, 4096, 128, 64, 2),
               hint="q and the output have Tq rows, k and v have Tk rows; q and k have D "
                    "columns, v and the output Dv")
    yield Case("one query, one key, B=H=D=Dv=1, float64", (1, 1, 1, 1, 1, 1, 8),
               hint="one multiply-add per matrix product: 4 FLOPs; one score of 8 bytes; q, k, "
                    "v and the output: 4 numbers of 8 bytes")


register(Exercise(
    key="ch02.attention_cost", function="attention_cost", reference=attention_cost_reference,
    task="derive",
    ops=ELEMENTARY,
    cases=_cost_cases, compare=expect_cost, banned=("course_attn",),
    mistakes=(
        # With D == Dv the three ways to get half the FLOPs give the same number: one hint names
        # them all; with D != Dv each has its own.
        Mistake("your FLOPs are half the count: a multiply-add is 2 FLOPs (a multiplication and "
                "an addition), and there are two matrix products, q kᵀ and the weights times v",
                _only_if_d_is_dv(_cost(flops=lambda b, h, tq, tk, d, dv, e:
                                       2 * b * h * tq * tk * d))),
        Mistake("you count a multiply-add as 1 FLOP: it is 2 (a multiplication and an addition)",
                _cost(flops=lambda b, h, tq, tk, d, dv, e: b * h * tq * tk * (d + dv))),
        Mistake("your FLOPs count only the scores q kᵀ: the weights times v is a second matrix "
                "product of the same size",
                _cost(flops=lambda b, h, tq, tk, d, dv, e: 2 * b * h * tq * tk * d)),
        Mistake("your FLOPs count only the weights times v: computing the scores q kᵀ is a "
                "matrix product too",
                _cost(flops=lambda b, h, tq, tk, d, dv, e: 2 * b * h * tq * tk * dv)),
        Mistake("you left out the heads H: every head has its own scores and its own products",
                lambda b, h, tq, tk, d, dv, e: attention_cost_reference(b, 1, tq, tk, d, dv, e)),
        Mistake("you left out the batch B: every sequence of the batch costs the same again",
                lambda b, h, tq, tk, d, dv, e: attention_cost_reference(1, h, tq, tk, d, dv, e)),
        Mistake("you counted numbers, not bytes: multiply by bytes_per_element",
                lambda b, h, tq, tk, d, dv, e: attention_cost_reference(b, h, tq, tk, d, dv, 1)),
        Mistake("your bytes assume 4 bytes a number (float32): use bytes_per_element",
                lambda b, h, tq, tk, d, dv, e: attention_cost_reference(b, h, tq, tk, d, dv, 4)),
        Mistake("your io_bytes leave out the output: it is a tensor of (B, H, Tq, Dv) too",
                _cost(io_bytes=lambda b, h, tq, tk, d, dv, e: b * h * (tq * d + tk * d + tk * dv)
                      * e)),
        Mistake("your io_bytes give every tensor the size of q: k and v have Tk rows, v and the "
                "output Dv columns",
                _cost(io_bytes=lambda b, h, tq, tk, d, dv, e: 4 * b * h * tq * d * e)),
        Mistake("your FLOPs use D for both products: the second one, weights times v, runs over "
                "Dv", _cost(flops=lambda b, h, tq, tk, d, dv, e: 4 * b * h * tq * tk * d)),
    ),
))
