"""Checks for Chapter 1 (intuition): softmax and soft lookup in plain Python, then with tensors.

Every reference is the package's own code: ``course_attn.softmax`` and
``course_attn.scaled_dot_product_attention`` with ``scale=1.0`` (this chapter does not scale).
"""

import torch

from ..attention import scaled_dot_product_attention, softmax
from .registry import Case, assert_close, exercise


def _as_float_list(result, *, length: int, what: str) -> torch.Tensor:
    """A plain-Python answer as a float64 tensor, once it is checked to be a list of floats."""
    if not isinstance(result, list):
        raise AssertionError(f"{what} should be a list, got {type(result).__name__}")
    if len(result) != length:
        raise AssertionError(f"{what} has {len(result)} entries, expected {length}")
    for i, x in enumerate(result):
        if isinstance(x, bool) or not isinstance(x, (float, int)):
            raise AssertionError(
                f"{what}[{i}] should be a Python float, got {type(x).__name__}")
    return torch.tensor([float(x) for x in result], dtype=torch.float64)


def _random_list(generator: torch.Generator, n: int, *, spread: float = 1.0) -> list[float]:
    return (torch.randn(n, generator=generator, dtype=torch.float64) * spread).tolist()


def _softmax_reference(xs: list[float]) -> torch.Tensor:
    return softmax(torch.tensor(xs, dtype=torch.float64), dim=-1)


def _check_softmax_list(fn, xs: list[float], *, what: str) -> None:
    original = list(xs)
    result = fn(xs)
    if xs != original:
        raise AssertionError(f"{what} changed its input list; return a new list instead")
    assert_close(_as_float_list(result, length=len(xs), what=what), _softmax_reference(xs),
                 what=what)


@exercise("ch01.softmax_list")
def _(fn):
    gen = torch.Generator().manual_seed(101)
    typical = _random_list(gen, 5)
    yield Case("five random scores",
               lambda: _check_softmax_list(fn, typical, what=f"softmax_list({typical})"),
               hint="exponentiate every score, then divide each by the sum of all of them")
    yield Case("returns a list of floats, same length",
               lambda: _as_float_list(fn([0.5, -1.0, 2.0]), length=3,
                                      what="softmax_list([0.5, -1.0, 2.0])"),
               hint="build the answer with a list comprehension, not a tensor or numpy array")
    yield Case("a single score gets all the weight",
               lambda: _check_softmax_list(fn, [3.7], what="softmax_list([3.7])"),
               hint="one score: its weight must be 1.0")
    yield Case("equal scores give equal weights",
               lambda: _check_softmax_list(fn, [2.0, 2.0, 2.0, 2.0],
                                           what="softmax_list([2.0, 2.0, 2.0, 2.0])"),
               hint="the weights must sum to 1")
    yield Case("large scores [1000, 1001] (no overflow)",
               lambda: _check_softmax_list(fn, [1000.0, 1001.0],
                                           what="softmax_list([1000.0, 1001.0])"),
               hint="math.exp(1000) overflows; subtracting the same number from every score "
                    "does not change the softmax")
    yield Case("very negative scores [-1000, -1001] (no division by zero)",
               lambda: _check_softmax_list(fn, [-1000.0, -1001.0],
                                           what="softmax_list([-1000.0, -1001.0])"),
               hint="math.exp(-1000) is 0.0 in floating point; shift the scores so that the "
                    "largest is 0")
    wide = [-900.0, -850.0, 798.5, 800.0, -700.0, 799.0]
    yield Case("scores spread from -900 to 800",
               lambda: _check_softmax_list(fn, wide, what=f"softmax_list({wide})"),
               hint="shift by the maximum score, not by the first one or the mean")


def _soft_lookup_reference(query, keys, values) -> torch.Tensor:
    q = torch.tensor(query, dtype=torch.float64)[None, None, None, :]   # (1, 1, 1, D)
    k = torch.tensor(keys, dtype=torch.float64)[None, None]             # (1, 1, T, D)
    v = torch.tensor(values, dtype=torch.float64)[None, None]           # (1, 1, T, Dv)
    return scaled_dot_product_attention(q, k, v, scale=1.0)[0, 0, 0]


def _check_soft_lookup(fn, query, keys, values, *, what: str) -> None:
    result = fn(query, keys, values)
    expected = _soft_lookup_reference(query, keys, values)
    assert_close(_as_float_list(result, length=len(expected), what=what), expected, what=what)


def _random_rows(generator: torch.Generator, rows: int, cols: int, *, spread: float = 1.0):
    return (torch.randn(rows, cols, generator=generator, dtype=torch.float64) * spread).tolist()


@exercise("ch01.soft_lookup")
def _(fn):
    gen = torch.Generator().manual_seed(102)
    query, keys, values = _random_list(gen, 3), _random_rows(gen, 4, 3), _random_rows(gen, 4, 3)
    yield Case("4 keys, D = 3, Dv = 3",
               lambda: _check_soft_lookup(fn, query, keys, values,
                                          what="soft_lookup(query, 4 keys, 4 values)"),
               hint="score_i = query · key_i; weights = softmax(scores); "
                    "answer = Σ_i weight_i value_i")
    q2, k2, v2 = _random_list(gen, 2), _random_rows(gen, 6, 2), _random_rows(gen, 6, 5)
    yield Case("values longer than keys (D = 2, Dv = 5)",
               lambda: _check_soft_lookup(fn, q2, k2, v2,
                                          what="soft_lookup(query, 6 keys of 2, 6 values of 5)"),
               hint="the answer has as many numbers as one value, not as one key")
    yield Case("returns a list of floats",
               lambda: _as_float_list(fn([1.0, 0.0], [[1.0, 0.0], [0.0, 1.0]], [[1.0], [2.0]]),
                                      length=1, what="soft_lookup([1, 0], 2 keys, 2 values)"),
               hint="return a plain Python list, one float per entry of a value")
    yield Case("a single key returns its value",
               lambda: _check_soft_lookup(fn, [0.3, -2.0], [[1.5, 0.5]], [[4.0, -1.0, 2.5]],
                                          what="soft_lookup(query, 1 key, 1 value)"),
               hint="with one key the weight is 1")
    q3, k3 = _random_list(gen, 4, spread=30.0), _random_rows(gen, 5, 4, spread=30.0)
    v3 = _random_rows(gen, 5, 2)
    yield Case("large scores (no overflow)",
               lambda: _check_soft_lookup(fn, q3, k3, v3,
                                          what="soft_lookup(query, keys with entries ~30)"),
               hint="the dot products reach ±1000 and math.exp overflows past 709: use a "
                    "stable softmax")
    yield Case("orthogonal keys, a query far along one key (≈ a hard lookup)",
               lambda: _check_soft_lookup(fn, [0.0, 0.0, 30.0],
                                          [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]],
                                          [[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]],
                                          what="soft_lookup([0, 0, 30], 3 orthogonal keys)"),
               hint="compare the query with every key by a dot product, not by equality")


def _attend_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return scaled_dot_product_attention(q[None, None], k[None, None], v[None, None],
                                        scale=1.0)[0, 0]


def _check_attend(fn, q, k, v, *, what: str) -> None:
    result = fn(q.clone(), k.clone(), v.clone())
    expected = _attend_reference(q, k, v)
    if isinstance(result, torch.Tensor) and result.dtype != expected.dtype:
        raise AssertionError(f"{what} has dtype {result.dtype}, expected {expected.dtype} "
                             "(the inputs' dtype)")
    assert_close(result, expected, what=what)


def _randn(generator: torch.Generator, *shape: int, dtype=torch.float32, spread: float = 1.0):
    return torch.randn(*shape, generator=generator, dtype=torch.float64).mul(spread).to(dtype)


@exercise("ch01.attend")
def _(fn):
    gen = torch.Generator().manual_seed(103)
    q, k, v = _randn(gen, 5, 4), _randn(gen, 5, 4), _randn(gen, 5, 3)
    yield Case("q, k (5, 4), v (5, 3)",
               lambda: _check_attend(fn, q, k, v, what="attend(q (5,4), k (5,4), v (5,3))"),
               hint="scores = q @ k.T, shape (Tq, Tk); no 1/sqrt(D) scaling in this chapter")
    q2, k2, v2 = _randn(gen, 2, 4), _randn(gen, 7, 4), _randn(gen, 7, 6)
    yield Case("fewer queries than keys (Tq = 2, Tk = 7)",
               lambda: _check_attend(fn, q2, k2, v2, what="attend(q (2,4), k (7,4), v (7,6))"),
               hint="each query's weights run over the keys: softmax along the last axis")
    q3, k3, v3 = _randn(gen, 3, 4), _randn(gen, 1, 4), _randn(gen, 1, 2)
    yield Case("a single key (Tk = 1)",
               lambda: _check_attend(fn, q3, k3, v3, what="attend(q (3,4), k (1,4), v (1,2))"),
               hint="with one key every query returns that key's value")
    q4, k4, v4 = (_randn(gen, 4, 8, spread=10.0), _randn(gen, 6, 8, spread=10.0),
                  _randn(gen, 6, 3))
    yield Case("large scores (no overflow, no NaN)",
               lambda: _check_attend(fn, q4, k4, v4, what="attend(q, k with entries ~10)"),
               hint="scores reach the hundreds; use a stable softmax (torch.softmax is one)")
    q5, k5, v5 = (_randn(gen, 4, 4, dtype=torch.float64), _randn(gen, 5, 4, dtype=torch.float64),
                  _randn(gen, 5, 2, dtype=torch.float64))
    yield Case("float64 in, float64 out",
               lambda: _check_attend(fn, q5, k5, v5, what="attend(float64 q, k, v)"),
               hint="let the inputs' dtype flow through; do not convert to float32")
    q6 = torch.tensor([[0.0, 40.0], [40.0, 0.0]])
    k6 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    v6 = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    yield Case("queries that match one key each (≈ a hard lookup)",
               lambda: _check_attend(fn, q6, k6, v6, what="attend(2 sharp queries, 3 keys)"),
               hint="the output is weights @ v with weights of shape (Tq, Tk)")
