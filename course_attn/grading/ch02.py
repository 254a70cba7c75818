"""Checks for the exercises of chapter 2, scaled dot-product attention.

    ch02.attention_scores   q kᵀ · scale                 (…, Tq, D), (…, Tk, D) -> (…, Tq, Tk)
    ch02.stable_softmax     softmax that survives ±1000   any shape, over ``dim``
    ch02.attention          softmax(q kᵀ · scale) v       (B, H, Tq, D), (B, H, Tk, D), (B, H, Tk, Dv)
                                                          -> (B, H, Tq, Dv)

Every expected value comes from the package (``course_attn.softmax``,
``course_attn.scaled_dot_product_attention``) or, for the scores, from the one-line formula
written below; inputs are seeded, so a student sees the same cases on every run.
"""

import math

import torch

from ..attention import scaled_dot_product_attention, softmax
from .registry import Case, assert_close, exercise


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal numbers of ``shape``, the same for a given seed on every machine."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)


def _assert_dtype(actual, dtype: torch.dtype, what: str) -> None:
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{what} should be a torch.Tensor, got {type(actual).__name__}")
    if actual.dtype != dtype:
        raise AssertionError(f"{what} has dtype {actual.dtype}, expected {dtype} (the input's)")


def _reference_scores(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    """(…, Tq, D), (…, Tk, D) -> (…, Tq, Tk): q kᵀ times scale (1/sqrt(D) when None)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return q @ k.transpose(-2, -1) * scale


@exercise("ch02.attention_scores")
def _(fn):
    def same_scores(q, k, expected_scale, what, **call):
        return lambda: assert_close(fn(q, k, **call), _reference_scores(q, k, expected_scale),
                                    what=what)

    q, k = _randn(2, 3, 5, 8, seed=0), _randn(2, 3, 5, 8, seed=1)
    yield Case("B=2, H=3, Tq=Tk=5, D=8, float32", same_scores(q, k, None, "attention_scores(q, k)"),
               hint="multiply q by k transposed over its last two axes, then scale by 1/sqrt(D)")

    q, k = _randn(2, 2, 4, 8, seed=2), _randn(2, 2, 9, 8, seed=3)
    yield Case("Tq=4 != Tk=9: shape (B, H, Tq, Tk)",
               same_scores(q, k, None, "attention_scores(q, k) with Tq=4, Tk=9"),
               hint="transpose only the last two axes of k: k.transpose(-2, -1), not k.T")

    q, k = _randn(1, 2, 4, 16, seed=4), _randn(1, 2, 4, 16, seed=5)
    yield Case("default scale is 1/sqrt(D), D=16, T=4",
               same_scores(q, k, None, "attention_scores(q, k) with D=16"),
               hint="D is the size of the last axis of q (the head dimension), not the length T")

    q, k = _randn(2, 2, 3, 6, seed=6), _randn(2, 2, 7, 6, seed=7)
    yield Case("custom scale=0.5", same_scores(q, k, 0.5, "attention_scores(q, k, scale=0.5)",
                                               scale=0.5),
               hint="when scale is given, multiply by it instead of 1/sqrt(D)")

    q, k = _randn(1, 1, 1, 4, seed=8), _randn(1, 1, 1, 4, seed=9)
    yield Case("Tq=Tk=1", same_scores(q, k, None, "attention_scores(q, k) with Tq=Tk=1"),
               hint="a single query and a single key still give a (B, H, 1, 1) tensor")

    q, k = _randn(3, 6, 4, seed=10), _randn(3, 5, 4, seed=11)
    yield Case("no head axis: (B, Tq, D), (B, Tk, D)",
               same_scores(q, k, None, "attention_scores(q, k) on rank-3 inputs"),
               hint="use operations on the last two axes only, so any leading axes work")

    q, k = _randn(2, 2, 5, 8, seed=12, dtype=torch.float64), _randn(2, 2, 6, 8, seed=13,
                                                                     dtype=torch.float64)
    def float64():
        out = fn(q, k)
        _assert_dtype(out, torch.float64, "attention_scores(q, k) for float64 inputs")
        assert_close(out, _reference_scores(q, k, None), what="attention_scores(q, k) in float64")
    yield Case("float64 in, float64 out", float64,
               hint="do not convert the inputs; let their dtype flow through")


@exercise("ch02.stable_softmax")
def _(fn):
    def same_softmax(x, what, dim=-1, dtype=None):
        def run():
            expected = softmax(x.clone(), dim=dim)
            out = fn(x.clone(), dim=dim)
            if dtype is not None:
                _assert_dtype(out, dtype, what)
            assert_close(out, expected, what=what)
        return run

    x = _randn(4, 6, seed=20) * 3
    yield Case("random (4, 6), over the last axis", same_softmax(x, "stable_softmax(x)"),
               hint="exponentiate, then divide by the sum over dim (keepdim=True)")

    x = _randn(3, 5, 4, seed=21)
    yield Case("(3, 5, 4) over dim=1", same_softmax(x, "stable_softmax(x, dim=1)", dim=1),
               hint="take the max and the sum over the dim you were given, with keepdim=True")

    x = 1000 + _randn(4, 8, seed=22) * 10
    yield Case("large inputs ~ +1000 (float32)", same_softmax(x, "stable_softmax(1000 + x)"),
               hint="exp(1000) overflows to inf: subtract each row's maximum before exp")

    x = -1000 + _randn(4, 8, seed=23, dtype=torch.float64) * 10
    yield Case("large negative inputs ~ -1000 (float64)",
               same_softmax(x, "stable_softmax(-1000 + x)", dtype=torch.float64),
               hint="exp(-1000) underflows to 0 and 0/0 is NaN: subtract each row's maximum")

    x = _randn(3, 6, seed=24)
    x[0, 1] = x[1, 4] = x[1, 5] = x[2, 0] = float("-inf")
    yield Case("some entries are -inf", same_softmax(x, "stable_softmax(x) with -inf entries"),
               hint="exp(-inf) = 0, so a -inf entry gets weight 0 and the rest still sum to 1")

    x = _randn(3, 5, seed=25)
    x[1] = float("-inf")
    yield Case("a row that is all -inf gives zeros, not NaN",
               same_softmax(x, "stable_softmax(x) with an all -inf row"),
               hint="that row's max is -inf and -inf - (-inf) is NaN: subtract 0 instead of a "
                    "max that is not finite, and divide by 1 where the sum is 0")

    x = _randn(2, 3, 1, seed=26, dtype=torch.float64)
    yield Case("one entry per row (T=1), float64", same_softmax(
        x, "stable_softmax(x) on shape (2, 3, 1)", dtype=torch.float64),
               hint="a single finite entry gets all the weight: the result is 1.0")


@exercise("ch02.attention")
def _(fn):
    def same_attention(q, k, v, what, scale=None, dtype=None):
        def run():
            call = {} if scale is None else {"scale": scale}
            out = fn(q, k, v, **call)
            if dtype is not None:
                _assert_dtype(out, dtype, what)
            assert_close(out, scaled_dot_product_attention(q, k, v, scale=scale), what=what)
        return run

    q, k, v = (_randn(2, 3, 6, 8, seed=s) for s in (30, 31, 32))
    yield Case("B=2, H=3, Tq=Tk=6, D=8, float32", same_attention(q, k, v, "attention(q, k, v)"),
               hint="scores (…, Tq, Tk) -> softmax over the keys (dim=-1) -> weights @ v")

    q, k, v = _randn(1, 2, 3, 8, seed=33), _randn(1, 2, 7, 8, seed=34), _randn(1, 2, 7, 8, seed=35)
    yield Case("Tq=3 != Tk=7", same_attention(q, k, v, "attention(q, k, v) with Tq=3, Tk=7"),
               hint="the output has one row per query: (B, H, Tq, Dv)")

    q, k, v = _randn(2, 2, 5, 8, seed=36), _randn(2, 2, 5, 8, seed=37), _randn(2, 2, 5, 3, seed=38)
    yield Case("D=8 != Dv=3", same_attention(q, k, v, "attention(q, k, v) with D=8, Dv=3"),
               hint="the default scale is 1/sqrt(D) with D from q and k, not from v")

    q, k, v = (_randn(1, 1, 1, 4, seed=s) for s in (39, 40, 41))
    yield Case("Tq=Tk=1: the output is v", same_attention(q, k, v, "attention(q, k, v), T=1"),
               hint="with a single key its weight is 1, so the output equals v")

    q, k, v = (_randn(2, 2, 4, 6, seed=s) for s in (42, 43, 44))
    yield Case("custom scale=0.3", same_attention(q, k, v, "attention(q, k, v, scale=0.3)",
                                                  scale=0.3),
               hint="when scale is given, multiply the scores by it instead of 1/sqrt(D)")

    q, k, v = (_randn(2, 2, 5, 4, seed=s, dtype=torch.float64) for s in (45, 46, 47))
    yield Case("float64 in, float64 out", same_attention(
        q, k, v, "attention(q, k, v) in float64", dtype=torch.float64),
               hint="do not convert the inputs; let their dtype flow through")

    q, k, v = (_randn(1, 2, 5, 8, seed=s, dtype=torch.float64) for s in (48, 49, 50))
    yield Case("large scores (|q kᵀ| ~ 1000s, float64)", same_attention(
        q * 40, k * 40, v, "attention(40 q, 40 k, v)"),
               hint="a softmax that exponentiates raw scores overflows: subtract the row maximum")
