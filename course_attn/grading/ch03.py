"""Checks for the exercises of chapter 3, masking.

    ch03.causal_mask        causal_mask(tq, tk) -> bool (Tq, Tk), bottom-right aligned
    ch03.padding_mask       padding_mask(lengths (B,), t) -> bool (B, 1, 1, T), True on real tokens
    ch03.masked_attention   masked_attention(q, k, v, mask) -> (B, H, Tq, Dv):
                            softmax(q kᵀ/√D, forbidden keys removed) v, with q (B, H, Tq, D),
                            k (B, H, Tk, D), v (B, H, Tk, Dv), a bool mask broadcastable to
                            (B, H, Tq, Tk); a row with no allowed key gives zeros

Every expected value comes from the package (``course_attn.causal_mask``,
``course_attn.padding_mask``, ``course_attn.scaled_dot_product_attention``); inputs are seeded, so
a student sees the same cases on every run.
"""

import torch

from ..attention import scaled_dot_product_attention
from ..masks import causal_mask, padding_mask
from .registry import Case, assert_close, exercise


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal numbers of ``shape``, the same for a given seed on every machine."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)


def _random_mask(*shape: int, seed: int, p_keep: float = 0.6) -> torch.Tensor:
    """A seeded bool mask of ``shape``, True with probability ``p_keep``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=generator) < p_keep


def _assert_tensor(actual, dtype: torch.dtype, shape: tuple, what: str) -> None:
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{what} should be a torch.Tensor, got {type(actual).__name__}")
    if tuple(actual.shape) != tuple(shape):
        raise AssertionError(f"{what} has shape {tuple(actual.shape)}, expected {tuple(shape)}")
    if actual.dtype != dtype:
        raise AssertionError(f"{what} has dtype {actual.dtype}, expected {dtype}")


@exercise("ch03.causal_mask")
def _(fn):
    def same_mask(tq, tk):
        what = f"causal_mask({tq}, {tk})"
        return lambda: assert_close(fn(tq, tk), causal_mask(tq, tk), what=what)

    yield Case("square, Tq=Tk=4", same_mask(4, 4),
               hint="query i may attend to keys 0..i: True on and below the diagonal")

    yield Case("Tq=Tk=1", same_mask(1, 1), hint="a single query may attend to its own key")

    yield Case("fewer queries than keys, Tq=3, Tk=6", same_mask(3, 6),
               hint="bottom-right: query i sits at position Tk - Tq + i, so the last query "
                    "sees every key")

    yield Case("one new query, many cached keys, Tq=1, Tk=5", same_mask(1, 5),
               hint="a single query is the last position: it may attend to all Tk keys")

    yield Case("more queries than keys, Tq=5, Tk=3", same_mask(5, 3),
               hint="the first Tq - Tk queries sit before every key: their rows are all False")

    def dtype_and_shape():
        _assert_tensor(fn(2, 7), torch.bool, (2, 7), "causal_mask(2, 7)")
    yield Case("returns a bool tensor of shape (Tq, Tk)", dtype_and_shape,
               hint="compare positions with >= (or <=) to get bools, not 0/1 numbers")


@exercise("ch03.padding_mask")
def _(fn):
    def same_mask(lengths, t):
        what = f"padding_mask(torch.tensor({lengths}), {t})"
        return lambda: assert_close(fn(torch.tensor(lengths), t),
                                    padding_mask(torch.tensor(lengths), t), what=what)

    yield Case("lengths [3, 1, 4], T=5", same_mask([3, 1, 4], 5),
               hint="key j of sequence b is a real token exactly when j < lengths[b]")

    yield Case("a length of 0 and a length of T", same_mask([0, 6, 2], 6),
               hint="length 0 masks every key of that sequence; length T masks none")

    yield Case("B=1, T=1", same_mask([1], 1), hint="one sequence of one real token: all True")

    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 11, (8,), generator=generator).tolist()
    yield Case("8 random lengths in [0, 10], T=10", same_mask(lengths, 10),
               hint="build one row of positions 0..T-1 and compare it with every length at once")

    def dtype_and_shape():
        _assert_tensor(fn(torch.tensor([2, 4]), 4), torch.bool, (2, 1, 1, 4),
                       "padding_mask(torch.tensor([2, 4]), 4)")
    yield Case("returns bool of shape (B, 1, 1, T)", dtype_and_shape,
               hint="add two axes of size 1 in the middle so the mask broadcasts over heads and "
                    "queries")


@exercise("ch03.masked_attention")
def _(fn):
    def same_output(q, k, v, mask, what):
        def run():
            out = fn(q.clone(), k.clone(), v.clone(), mask.clone())
            shape = (*q.shape[:-1], v.shape[-1])
            _assert_tensor(out, q.dtype, shape, what)
            assert_close(out, scaled_dot_product_attention(q, k, v, attn_mask=mask), what=what)
        return run

    q, k, v = _randn(2, 3, 5, 8, seed=30), _randn(2, 3, 5, 8, seed=31), _randn(2, 3, 5, 8, seed=32)
    yield Case("causal (T, T) mask, B=2, H=3, T=5, D=8",
               same_output(q, k, v, causal_mask(5), "masked_attention(q, k, v, causal mask)"),
               hint="scores = q kᵀ / sqrt(D); put -inf where the mask is False, then softmax")

    mask = padding_mask(torch.tensor([5, 3]), 5)
    yield Case("padding mask (B, 1, 1, T), lengths [5, 3]",
               same_output(q, k, v, mask, "masked_attention(q, k, v, padding mask)"),
               hint="the mask broadcasts against the scores (B, H, Tq, Tk); masked_fill does that")

    mask = padding_mask(torch.tensor([0, 4]), 5)
    yield Case("a sequence of length 0: fully masked rows give zeros, not NaN",
               same_output(q, k, v, mask, "masked_attention(q, k, v, mask with a length-0 row)"),
               hint="a row of all -inf gives 0/0 = NaN in softmax; a query with no allowed key "
                    "must output zeros")

    q, k, v = _randn(2, 2, 6, 8, seed=33), _randn(2, 2, 4, 8, seed=34), _randn(2, 2, 4, 3, seed=35)
    mask = _random_mask(2, 1, 6, 4, seed=36)
    mask[0, 0, 2] = False
    mask[1, 0, 5] = False
    yield Case("Tq=6 != Tk=4, Dv=3, random mask with dead rows",
               same_output(q, k, v, mask, "masked_attention(q, k, v) with Tq=6, Tk=4, Dv=3"),
               hint="some rows allow no key (they must be zeros); transpose only k's last two "
                    "axes; the output's last size is v's, Dv")

    q, k, v = _randn(1, 1, 1, 4, seed=37), _randn(1, 1, 1, 4, seed=38), _randn(1, 1, 1, 4, seed=39)
    yield Case("T=1", same_output(q, k, v, torch.ones(1, 1, dtype=torch.bool),
                                  "masked_attention(q, k, v) with T=1"),
               hint="one query, one allowed key: the output is that key's value")

    q, k, v = (_randn(1, 2, 6, 16, seed=s) * 10 for s in (40, 41, 42))
    yield Case("large scores (|q kᵀ/√D| in the hundreds)",
               same_output(q, k, v, causal_mask(6), "masked_attention(q, k, v) with large scores"),
               hint="exp overflows for large scores: subtract each row's maximum before exp")

    q, k, v = (_randn(2, 2, 5, 8, seed=s, dtype=torch.float64) for s in (43, 44, 45))
    mask = causal_mask(5) & padding_mask(torch.tensor([5, 2]), 5)
    yield Case("float64 in, float64 out, causal & padding",
               same_output(q, k, v, mask, "masked_attention(q, k, v) in float64"),
               hint="do not convert the inputs; let their dtype flow through")
