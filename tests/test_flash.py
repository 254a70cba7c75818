"""flash.py: the tiled forward and recomputing backward return the numbers of "math" (and of
PyTorch's "sdpa"), forward and backward, for every keyword of the shared signature and for any
tile sizes; its pieces (``online_softmax``, ``merge_attention_states``, ``tile_schedule``,
``flash_decode``) do what their docstrings say; and its peak memory grows linearly in T where
"math" grows as T².

The sweep of every registered backend against PyTorch is in test_backends.py; here the cases are
the ones a tiled implementation gets wrong: lengths that the blocks do not divide, blocks of 1 and
blocks longer than T, Tq != Tk (bottom-right), masks cut per tile, rows with no key, GQA rows
stacked in one tile, half precision, and the log-sum-exp that the backward and the merges reuse.

Helpers shared with the sibling tests (``qkv``/``randn``/``growth_exponent``, the ``Case``
strategy) are in helpers.py.
"""

import math
import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from course_attn import attention_mask, padding_mask, repeat_kv, softmax, to_additive
from course_attn.attention import scaled_dot_product_attention as math_attention
from course_attn.backends import BACKENDS, get_backend
from course_attn.bench import peak_memory_bytes
from course_attn.flash import (DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, flash_attention, flash_decode,
                               merge_attention_states, online_softmax, tile_schedule)

from helpers import Case, cases, growth_exponent, qkv, randn

pytestmark = pytest.mark.filterwarnings("ignore:Lower right causal bias:UserWarning")

seeds = st.integers(0, 2 ** 31 - 1)
TIGHT = dict(rtol=1e-5, atol=1e-5)


def sweep(n: int) -> settings:
    """n examples under the default "ci" profile (keeps this file quick); the chosen profile's
    count under another one (HYPOTHESIS_PROFILE=thorough), as the sibling sweeps get."""
    ci = os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci"
    return settings(max_examples=n if ci else settings.default.max_examples, deadline=None)


def assert_close(actual, expected, what="", **tolerance):
    torch.testing.assert_close(actual, expected, **(tolerance or TIGHT),
                               msg=lambda m: f"{what}: {m}" if what else m)


def assert_equals_math_and_sdpa(q, k, v, *, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K,
                                **kwargs):
    """flash with these blocks equals "math" and "sdpa" in fp32 (1e-5); returns flash's out."""
    out = flash_attention(q, k, v, block_q=block_q, block_k=block_k, **kwargs)
    assert out.shape == q.shape[:3] + v.shape[3:] and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    for name in ("math", "sdpa"):
        assert_close(out, get_backend(name)(q, k, v, **kwargs), f"flash vs {name}")
    return out


def gradients(fn, q, k, v, grad_out, **kwargs):
    """(dq, dk, dv) of <fn(q, k, v, **kwargs), grad_out>."""
    inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    return torch.autograd.grad(fn(*inputs, **kwargs), inputs, grad_out)


def assert_gradients_equal_maths(q, k, v, *, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K,
                                 seed=0, rtol=1e-4, atol=1e-5, **kwargs):
    grad_out = randn(*q.shape[:3], v.shape[3], seed=seed + 99, device=q.device, dtype=q.dtype)
    ours = gradients(flash_attention, q, k, v, grad_out, block_q=block_q, block_k=block_k,
                     **kwargs)
    theirs = gradients(math_attention, q, k, v, grad_out, **kwargs)
    for what, a, b in zip(("dq", "dk", "dv"), ours, theirs):
        assert torch.isfinite(a).all(), f"{what} has non-finite entries"
        assert_close(a, b, what, rtol=rtol, atol=atol)
    return ours


def reference_lse(q, k, *, attn_mask=None, is_causal=False, scale=None, window=None):
    """torch.logsumexp of the masked, scaled scores (B, Hq, Tq), in float64."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k = repeat_kv(k, q.shape[1] // k.shape[1])
    scores = scale * (q.double() @ k.double().transpose(-2, -1))
    mask = attention_mask(q.shape[2], k.shape[2], attn_mask=attn_mask, is_causal=is_causal,
                          window=window, device=q.device)
    if mask is not None:
        scores = scores + to_additive(mask, torch.float64)
    return torch.logsumexp(scores, dim=-1)


def test_registered_as_flash():
    assert get_backend("flash") is flash_attention and BACKENDS["flash"] is flash_attention


# ---------------------------------------------------------------- forward, case by case

# (name, Tq, Tk, D, Dv): lengths around the default block of 64, Tq != Tk, odd head dims
SHAPES = [
    ("T = 1", 1, 1, 16, 16),
    ("T = 97", 97, 97, 16, 16),
    ("T = 1023", 1023, 1023, 8, 8),
    ("T = 1025", 1025, 1025, 8, 8),
    ("Tq < Tk", 13, 150, 16, 16),
    ("Tq = 1 (a decode step)", 1, 77, 16, 16),
    ("Tq > Tk (the first queries see nothing)", 150, 70, 16, 16),
    ("D = 21, Dv = 7", 70, 70, 21, 7),
    ("D = 59", 70, 81, 59, 59),
    ("D = 8, Dv = 33", 65, 66, 8, 33),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "not causal"])
@pytest.mark.parametrize("name, tq, tk, d, dv", SHAPES, ids=[s[0] for s in SHAPES])
def test_equals_math_and_sdpa(device, name, tq, tk, d, dv, causal):
    q, k, v = qkv(1, 2, 2, tq, tk, d, dv, seed=tq + tk, device=device)
    out = assert_equals_math_and_sdpa(q, k, v, is_causal=causal)
    if causal and tq > tk:                 # bottom-right: queries 0 .. Tq-Tk-1 precede every key
        dead = out[:, :, :tq - tk]
        assert torch.equal(dead, torch.zeros_like(dead))
        assert out[:, :, tq - tk:].abs().amin(dim=-1).gt(0).all()


# (block_q, block_k) on T = 45 queries and 37 keys: blocks of 1, blocks that do not divide T,
# blocks longer than T, very unequal blocks
BLOCKS = [(1, 1), (1, 7), (7, 1), (8, 8), (16, 5), (64, 64), (45, 37), (46, 38), (200, 3),
          (3, 1000), (1000, 1000)]


@pytest.mark.parametrize("kwargs", [dict(), dict(is_causal=True), dict(window=6),
                                    dict(is_causal=True, window=6)],
                         ids=["plain", "causal", "window", "causal window"])
@pytest.mark.parametrize("block_q, block_k", BLOCKS, ids=[f"{a}x{b}" for a, b in BLOCKS])
def test_any_blocks_give_the_same_numbers(device, block_q, block_k, kwargs):
    for tq, tk in ((45, 37), (37, 45)):
        q, k, v = qkv(2, 2, 2, tq, tk, device=device)
        assert_equals_math_and_sdpa(q, k, v, block_q=block_q, block_k=block_k, **kwargs)


@pytest.mark.parametrize("hq, hkv", [(4, 2), (6, 1), (8, 4)])
def test_grouped_query_attention(device, hq, hkv):
    q, k, v = qkv(2, hq, hkv, 33, 41, device=device)
    for kwargs in (dict(), dict(is_causal=True), dict(is_causal=True, window=5), dict(window=5)):
        assert_equals_math_and_sdpa(q, k, v, enable_gqa=True, block_q=8, block_k=16, **kwargs)
    with pytest.raises(ValueError, match="enable_gqa"):
        flash_attention(q, k, v)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "not causal"])
@pytest.mark.parametrize("window", [1, 2, 7, 64, 65, 500])
def test_windows(device, window, causal):
    for tq, tk in ((130, 130), (20, 130), (130, 60)):
        q, k, v = qkv(1, 2, 2, tq, tk, seed=window, device=device)
        assert_equals_math_and_sdpa(q, k, v, is_causal=causal, window=window, block_q=16,
                                    block_k=32)


MASK_SHAPES = {   # (B, Hq, Tq, Tk) -> the shape of a mask that broadcasts to the scores
    "(Tk,)": lambda b, h, tq, tk: (tk,),
    "(Tq, 1)": lambda b, h, tq, tk: (tq, 1),
    "(Tq, Tk)": lambda b, h, tq, tk: (tq, tk),
    "(B, 1, Tq, Tk)": lambda b, h, tq, tk: (b, 1, tq, tk),
    "(B, 1, 1, Tk)": lambda b, h, tq, tk: (b, 1, 1, tk),
    "(1, Hq, 1, Tk)": lambda b, h, tq, tk: (1, h, 1, tk),
    "(B, Hq, Tq, Tk)": lambda b, h, tq, tk: (b, h, tq, tk),
}


def random_mask(kind, shape, *, seed, device, dtype=torch.float32, keep=0.7):
    """A bool mask (True = may attend) or a float one (N(0, 4) bias, -inf where not kept)."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(shape, generator=g) < keep
    if kind == "bool":
        return allowed.to(device)
    bias = 2 * torch.randn(shape, generator=g, dtype=torch.float64)
    return bias.masked_fill(~allowed, float("-inf")).to(device, dtype)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", sorted(MASK_SHAPES))
def test_masks_alone_and_with_causal_and_window(device, shape, kind):
    b, hq, hkv = 2, 4, 2
    for tq, tk, block_q, block_k in ((40, 40, 16, 8), (17, 50, 16, 8), (50, 17, 16, 8),
                                     (2, 9, 1, 2)):
        q, k, v = qkv(b, hq, hkv, tq, tk, seed=tq, device=device)
        mask = random_mask(kind, MASK_SHAPES[shape](b, hq, tq, tk), seed=tq * tk, device=device)
        for kwargs in (dict(), dict(is_causal=True), dict(is_causal=True, window=6),
                       dict(window=9)):
            assert_equals_math_and_sdpa(q, k, v, attn_mask=mask, enable_gqa=True,
                                        block_q=block_q, block_k=block_k, **kwargs)


def dead_row_case(device, dtype=torch.float32):
    """q (2, 4, 20, 8), GQA k, v (2, 2, 20, .); a mask that leaves queries 3 and 10 no key (10
    only through the causal window) and a float mask whose row 5 is all -inf."""
    q, k, v = qkv(2, 4, 2, 20, 20, device=device, dtype=dtype)
    keep = torch.ones(20, 20, dtype=torch.bool, device=device)
    keep[3] = False
    keep[10, 6:11] = False
    bias = random_mask("float", (20, 20), seed=5, device=device, dtype=dtype, keep=1.0)
    bias[5] = float("-inf")
    return q, k, v, keep, bias


@pytest.mark.parametrize("which", ["bool", "float"])
def test_fully_masked_rows_are_zeros_forward_and_backward(device, which):
    q, k, v, keep, bias = dead_row_case(device)
    mask, dead = (keep, [3, 10]) if which == "bool" else (bias, [5])
    kwargs = dict(attn_mask=mask, is_causal=True, window=5, enable_gqa=True)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*inputs, block_q=8, block_k=4, return_lse=True, **kwargs)
    assert not out.isnan().any()
    assert torch.equal(out[:, :, dead], torch.zeros_like(out[:, :, dead]))
    assert (lse[:, :, dead] == float("-inf")).all() and torch.isfinite(
        lse[:, :, [i for i in range(20) if i not in dead]]).all()
    assert_close(out, math_attention(q, k, v, **kwargs), "out")
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in inputs)
    assert torch.equal(inputs[0].grad[:, :, dead], torch.zeros_like(q[:, :, dead]))
    assert_gradients_equal_maths(q, k, v, block_q=8, block_k=4, **kwargs)


# ---------------------------------------------------------------- forward, a sweep


@sweep(30)
@given(case=cases(max_t=40), block_q=st.integers(1, 48), block_k=st.integers(1, 48))
def test_sweep_equals_math_and_sdpa(device, case: Case, block_q, block_k):
    """Any lengths, blocks, windows, causal or not, masks of any broadcast shape, GQA, scale."""
    q, k, v, mask = case.tensors(device, torch.float32)
    assert_equals_math_and_sdpa(q, k, v, attn_mask=mask, block_q=block_q, block_k=block_k,
                                **case.kwargs())


# ---------------------------------------------------------------- half precision


def max_error(x, exact):
    return (x.double() - exact).abs().max().item()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "not causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_error_is_no_worse_than_maths(device, require_dtype, dtype, causal):
    """Both measured against float64 on the same inputs: flash's output error is at most 2x, and
    its gradients' at most 3x, that of "math" computed in the same dtype."""
    require_dtype(device, torch.float64)
    q, k, v = qkv(1, 2, 2, 200, 200, 64, 64, seed=11, device=device, dtype=dtype)
    grad_out = randn(1, 2, 200, 64, seed=12, device=device, dtype=dtype)
    kwargs = dict(is_causal=causal)
    ours = flash_attention(q, k, v, **kwargs)
    assert ours.dtype == dtype
    theirs = math_attention(q, k, v, **kwargs)
    exact = math_attention(q.double(), k.double(), v.double(), **kwargs)

    def floor(reference):            # so that an exactly right "math" does not make the bound 0
        return 1e-3 * torch.finfo(dtype).eps * max(1.0, reference.abs().max().item())

    ours_err, theirs_err = max_error(ours, exact), max_error(theirs, exact)
    assert ours_err <= 2 * theirs_err + floor(exact), (dtype, ours_err, theirs_err)

    ours_g = gradients(flash_attention, q, k, v, grad_out, **kwargs)
    theirs_g = gradients(math_attention, q, k, v, grad_out, **kwargs)
    exact_g = gradients(math_attention, q.double(), k.double(), v.double(), grad_out.double(),
                        **kwargs)
    for what, a, b, e in zip(("dq", "dk", "dv"), ours_g, theirs_g, exact_g):
        assert a.dtype == dtype
        a_err, b_err = max_error(a, e), max_error(b, e)
        assert a_err <= 3 * b_err + floor(e), (what, dtype, a_err, b_err)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_with_mask_window_and_gqa(device, require_dtype, dtype):
    require_dtype(device, torch.float64)
    q, k, v = qkv(2, 4, 2, 90, 120, 32, 16, seed=21, device=device, dtype=dtype)
    mask = random_mask("float", (2, 1, 90, 120), seed=22, device=device, dtype=dtype, keep=0.9)
    kwargs = dict(attn_mask=mask, is_causal=True, window=40, enable_gqa=True)
    ours = flash_attention(q, k, v, block_q=32, block_k=16, **kwargs)
    theirs = math_attention(q, k, v, **kwargs)
    exact = math_attention(q.double(), k.double(), v.double(),
                           **{**kwargs, "attn_mask": mask.double()})
    eps = 1e-3 * torch.finfo(dtype).eps * max(1.0, exact.abs().max().item())
    assert ours.dtype == dtype and not ours.isnan().any()
    assert max_error(ours, exact) <= 2 * max_error(theirs, exact) + eps


# ---------------------------------------------------------------- backward

GRADIENT_CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "causal, Tq < Tk": dict(is_causal=True, tq=9, tk=31),
    "causal, Tq > Tk": dict(is_causal=True, tq=31, tk=9),
    "causal window": dict(is_causal=True, window=4),
    "window, not causal": dict(window=4),
    "GQA": dict(hq=6, hkv=2, is_causal=True),
    "GQA, window": dict(hq=4, hkv=1, window=7),
    "bool mask": dict(mask="bool"),
    "float mask": dict(mask="float"),
    "bool mask + causal": dict(mask="bool", is_causal=True),
    "float mask + causal window, GQA": dict(mask="float", is_causal=True, window=6, hq=4),
    "scale": dict(scale=0.3, is_causal=True),
    "blocks of 1": dict(is_causal=True, block_q=1, block_k=1),
    "blocks longer than T": dict(window=5, block_q=100, block_k=100),
}


@pytest.mark.parametrize("how", sorted(GRADIENT_CASES))
def test_float32_gradients_equal_maths(device, how):
    c = {**dict(tq=24, tk=24, hq=2, hkv=2, block_q=8, block_k=5, mask=None),
         **GRADIENT_CASES[how]}
    tq, tk, hq, hkv = c.pop("tq"), c.pop("tk"), c.pop("hq"), c.pop("hkv")
    q, k, v = qkv(2, hq, hkv, tq, tk, seed=len(how), device=device)
    kind = c.pop("mask")
    if kind is not None:
        c["attn_mask"] = random_mask(kind, (2, 1, tq, tk), seed=tq, device=device, keep=0.8)
    assert_gradients_equal_maths(q, k, v, enable_gqa=hq != hkv, **c)


@sweep(20)
@given(case=cases(max_t=20), block_q=st.integers(1, 24), block_k=st.integers(1, 24))
def test_sweep_gradients_equal_maths(device, case: Case, block_q, block_k):
    q, k, v, mask = case.tensors(device, torch.float32)
    assert_gradients_equal_maths(q, k, v, attn_mask=mask, block_q=block_q, block_k=block_k,
                                 seed=case.seed, **case.kwargs())


@pytest.mark.parametrize("outputs", ["out", "out and lse", "lse"])
def test_gradcheck_float64(device, require_dtype, outputs):
    """A tiny GQA case with a float mask, causal and a window, blocks that cut it unevenly; the
    lse output (FlashAttention's backward differentiates it too) alone or with out."""
    require_dtype(device, torch.float64)
    q, k, v = qkv(1, 4, 2, 5, 7, 3, 2, seed=3, device=device, dtype=torch.float64)
    mask = random_mask("float", (5, 7), seed=4, device=device, dtype=torch.float64, keep=1.0)
    kwargs = dict(attn_mask=mask, is_causal=True, window=4, enable_gqa=True, block_q=2,
                  block_k=3)

    def fn(q, k, v):
        out, lse = flash_attention(q, k, v, return_lse=True, **kwargs)
        return {"out": out, "out and lse": (out, lse), "lse": lse}[outputs]

    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("offset", [torch.finfo(torch.float32).min, -1e9, -1e4],
                         ids=["finfo.min", "-1e9", "-1e4"])
def test_gradients_of_rows_whose_every_key_carries_a_large_mask(device, offset):
    """A Hugging Face style float mask (finfo.min, or -1e4, where a key is masked) that covers a
    whole row: the row's scores are S + offset, its output the softmax of S (or the uniform
    average where S + offset rounds to one number), and so must its gradients be. A backward
    that recomputes P = exp(S - lse) from lse = m + log l rounded loses log l next to a large
    |m|: P then sums to ~Tk, not 1 (the bug this guards against)."""
    q, k, v = qkv(2, 2, 2, 12, 12, seed=13, device=device)
    mask = torch.zeros(12, 12, device=device)
    mask[3] = offset                          # every key of row 3
    mask[7, :5] = offset                      # some keys of row 7
    for kwargs in (dict(), dict(window=4)):
        assert_equals_math_and_sdpa(q, k, v, attn_mask=mask, block_q=4, block_k=5, **kwargs)
        assert_gradients_equal_maths(q, k, v, attn_mask=mask, block_q=4, block_k=5, **kwargs)


def test_double_backward(device, require_dtype):
    """The backward is made of differentiable operations on q, k, v and the saved outputs, so a
    second derivative (a gradient penalty, a Hessian-vector product) is right too."""
    require_dtype(device, torch.float64)
    q, k, v = qkv(1, 2, 1, 4, 5, 3, 2, seed=14, device=device, dtype=torch.float64)
    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
    for kwargs in (dict(is_causal=True), dict(window=2)):
        assert torch.autograd.gradgradcheck(
            lambda *a: flash_attention(*a, enable_gqa=True, block_q=2, block_k=2, **kwargs),
            inputs, atol=1e-5, rtol=1e-4)


def test_lse_gradient_equals_logsumexps(device):
    """d(Σ w·lse)/dq, dk through flash equals autograd through torch.logsumexp; dv is zero."""
    q, k, v = qkv(1, 4, 2, 19, 23, seed=8, device=device)
    w = randn(1, 4, 19, seed=9, device=device)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    _, lse = flash_attention(*inputs, is_causal=True, window=9, enable_gqa=True, block_q=4,
                             block_k=6, return_lse=True)
    ours = torch.autograd.grad((lse * w).sum(), inputs)
    wide = [t.double().requires_grad_() for t in (q, k)]
    exact = reference_lse(*wide, is_causal=True, window=9)
    theirs = torch.autograd.grad((exact * w.double()).sum(), wide)
    assert_close(ours[0], theirs[0].float(), "dq", rtol=1e-4, atol=1e-5)
    assert_close(ours[1], theirs[1].float(), "dk", rtol=1e-4, atol=1e-5)
    assert torch.equal(ours[2], torch.zeros_like(v))


# ---------------------------------------------------------------- the log-sum-exp


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_return_lse_is_the_logsumexp_of_the_masked_scores(device, require_dtype, dtype):
    require_dtype(device, dtype)
    b, hq, hkv, tq, tk = 2, 4, 2, 30, 20
    q, k, v = qkv(b, hq, hkv, tq, tk, seed=1, device=device, dtype=dtype)
    mask = random_mask("float", (b, 1, tq, tk), seed=2, device=device, dtype=dtype, keep=0.8)
    for kwargs in (dict(), dict(is_causal=True), dict(is_causal=True, window=3, attn_mask=mask),
                   dict(window=5, scale=0.4), dict(attn_mask=mask)):
        out, lse = flash_attention(q, k, v, enable_gqa=True, block_q=7, block_k=6,
                                   return_lse=True, **kwargs)
        assert lse.shape == (b, hq, tq)
        assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert torch.equal(out, flash_attention(q, k, v, enable_gqa=True, block_q=7, block_k=6,
                                                **kwargs))
        expected = reference_lse(q, k, **kwargs)
        assert_close(lse.double(), expected, str(kwargs), rtol=1e-5, atol=1e-5)
        if kwargs.get("is_causal"):          # Tq > Tk: queries 0 .. 9 have no key at all
            assert (lse[:, :, :tq - tk] == float("-inf")).all()


# ---------------------------------------------------------------- determinism


def test_repeated_runs_are_bitwise_equal(device):
    q, k, v = qkv(2, 4, 2, 70, 90, 16, 12, seed=6, device=device)
    mask = random_mask("float", (2, 1, 70, 90), seed=7, device=device, keep=0.9)
    grad_out = randn(2, 4, 70, 12, seed=8, device=device)
    kwargs = dict(attn_mask=mask, is_causal=True, window=30, enable_gqa=True, block_q=16,
                  block_k=32)
    runs = []
    for _ in range(3):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = flash_attention(*inputs, return_lse=True, **kwargs)
        runs.append((out, lse, *torch.autograd.grad(out, inputs, grad_out)))
    for later in runs[1:]:
        for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), runs[0], later):
            assert torch.equal(a, b), f"{what} differs between runs"


# ---------------------------------------------------------------- merging partial attentions


def random_parts(tk: int, n: int, contiguous: bool, rng: random.Random) -> list[list[int]]:
    """The keys 0 .. Tk-1 cut into n parts (some may be empty): runs, or a random assignment."""
    if contiguous:
        cuts = sorted(rng.randint(0, tk) for _ in range(n - 1))
        return [list(range(a, b)) for a, b in zip([0] + cuts, cuts + [tk])]
    parts = [[] for _ in range(n)]
    for j in range(tk):
        parts[rng.randrange(n)].append(j)
    return parts


def merge_in_random_tree(states, rng: random.Random):
    """Merge any two of the states (in either order) until one is left: every tree shape and
    order is reachable, which is associativity and commutativity at once."""
    states = list(states)
    while len(states) > 1:
        a, b = rng.sample(range(len(states)), 2)
        merged = merge_attention_states(*states[a], *states[b])
        states = [s for i, s in enumerate(states) if i not in (a, b)] + [merged]
    return states[0]


@sweep(25)
@given(seed=seeds, n=st.integers(2, 5), contiguous=st.booleans(), by_mask=st.booleans(),
       tk=st.integers(1, 30))
def test_merging_the_parts_equals_attention_over_all_keys(device, seed, n, contiguous, by_mask,
                                                          tk):
    rng = random.Random(seed)
    q, k, v = qkv(2, 4, 2, 6, tk, seed=seed % 1000, device=device)
    padding = padding_mask(torch.tensor([tk, rng.randint(0, tk)]), tk).to(device)
    full_out, full_lse = flash_attention(q, k, v, attn_mask=padding, enable_gqa=True,
                                         return_lse=True)
    states = []
    for part in random_parts(tk, n, contiguous, rng):
        if by_mask:        # the part as a key mask (B, 1, 1, Tk) over all the keys
            in_part = torch.zeros(tk, dtype=torch.bool, device=device)
            in_part[part] = True
            states.append(flash_attention(q, k, v, attn_mask=padding & in_part,
                                          enable_gqa=True, return_lse=True, block_k=4))
        else:              # the part's keys selected by index
            idx = torch.tensor(part, dtype=torch.long, device=device)
            states.append(flash_attention(q, k[:, :, idx], v[:, :, idx],
                                          attn_mask=padding[..., idx], enable_gqa=True,
                                          return_lse=True, block_k=4))
    out, lse = merge_in_random_tree(states, rng)
    assert_close(out, full_out, "out")
    assert_close(lse, full_lse, "lse")
    assert_close(out, math_attention(q, k, v, attn_mask=padding, enable_gqa=True), "out vs math")


def test_a_side_without_keys_is_the_identity(device):
    q, k, v = qkv(1, 2, 2, 5, 9, seed=4, device=device)
    out, lse = flash_attention(q, k, v, return_lse=True)
    none_out, none_lse = flash_attention(q, k[:, :, :0], v[:, :, :0], return_lse=True)
    assert torch.equal(none_out, torch.zeros_like(out))
    assert (none_lse == float("-inf")).all()
    for merged in (merge_attention_states(out, lse, none_out, none_lse),
                   merge_attention_states(none_out, none_lse, out, lse)):
        assert torch.equal(merged[0], out) and torch.equal(merged[1], lse)
    both_out, both_lse = merge_attention_states(none_out, none_lse, none_out, none_lse)
    assert torch.equal(both_out, none_out) and (both_lse == float("-inf")).all()


def test_merge_dtypes(device):
    """out comes back in out_a's dtype, lse in float32 (half) or float64 (float64 inputs)."""
    for dtype, lse_dtype in ((torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                             (torch.float32, torch.float32), (torch.float64, torch.float64)):
        out = torch.zeros(1, 2, 3, 4, dtype=dtype, device=device)
        lse = torch.zeros(1, 2, 3, dtype=torch.float32, device=device)
        merged_out, merged_lse = merge_attention_states(out, lse, out, lse)
        assert merged_out.dtype == dtype and merged_lse.dtype == lse_dtype
        assert torch.equal(merged_lse, torch.full_like(merged_lse, math.log(2)))


def test_merge_refuses_states_of_other_shapes(device):
    out, lse = torch.zeros(1, 2, 3, 4, device=device), torch.zeros(1, 2, 3, device=device)
    with pytest.raises(ValueError, match="one shape"):
        merge_attention_states(out, lse, out[:, :, :2], lse[:, :, :2])
    with pytest.raises(ValueError, match="one shape"):
        merge_attention_states(out, lse, out, lse[:, :1])
    with pytest.raises(ValueError, match="without its last dim"):
        merge_attention_states(out, lse[..., :2], out, lse[..., :2])


# ---------------------------------------------------------------- online softmax


@pytest.mark.parametrize("block", [1, 3, 8, 128, 1000])
@pytest.mark.parametrize("shape, dim", [((5,), 0), ((3, 7), -1), ((3, 7), 0), ((2, 3, 130), -1),
                                        ((2, 130, 3), 1), ((4, 1, 9), 1), ((4, 9, 2), -3)])
def test_online_softmax_equals_softmax(device, shape, dim, block):
    x = randn(*shape, seed=sum(shape), device=device) * 4
    x = x.masked_fill(randn(*shape, seed=1, device=device) > 1.0, float("-inf"))   # some -inf
    assert_close(online_softmax(x, dim, block=block), softmax(x, dim), rtol=1e-6, atol=1e-7)


def test_online_softmax_gives_zeros_for_an_all_minus_inf_slice(device):
    x = randn(4, 10, seed=2, device=device)
    x[1] = float("-inf")
    x[2, ::2] = float("-inf")
    p = online_softmax(x, block=3)
    assert not p.isnan().any()
    assert torch.equal(p[1], torch.zeros_like(p[1]))
    assert_close(p, softmax(x), rtol=1e-6, atol=1e-7)
    assert_close(p[[0, 2, 3]].sum(-1), torch.ones(3, device=device))
    assert online_softmax(torch.empty(3, 0, device=device)).shape == (3, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_online_softmax_keeps_the_dtype(device, require_dtype, dtype):
    require_dtype(device, dtype)
    x = (randn(3, 50, seed=3, device=device) * 5).to(dtype)
    x[0] = float("-inf")
    p = online_softmax(x, block=7)
    assert p.dtype == dtype and torch.equal(p[0], torch.zeros_like(p[0]))
    # computed in float32 (at least), rounded once: what softmax in float32 rounds to
    work = torch.promote_types(dtype, torch.float32)
    torch.testing.assert_close(p, softmax(x.to(work)).to(dtype))


def test_online_softmax_refuses_bad_blocks():
    for block in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="block must be a positive int"):
            online_softmax(torch.zeros(3), block=block)


# ---------------------------------------------------------------- which tiles are computed


def brute_force_tiles(tq, tk, block_q, block_k, is_causal, window):
    """Every (query block, key block) that holds at least one allowed (query, key) pair, from the
    element mask of ``course_attn.attention_mask``."""
    allowed = attention_mask(tq, tk, is_causal=is_causal, window=window)
    if allowed is None:
        allowed = torch.ones(tq, tk, dtype=torch.bool)
    return [(i, j) for i in range(math.ceil(tq / block_q)) for j in range(math.ceil(tk / block_k))
            if allowed[i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k].any()]


@pytest.mark.parametrize("tq, tk, block_q, block_k", [(1, 1, 64, 64), (100, 100, 64, 64),
                                                      (10, 33, 3, 4), (33, 10, 1, 1),
                                                      (0, 5, 2, 2), (5, 0, 2, 2)])
def test_without_causal_or_window_every_tile_is_listed(tq, tk, block_q, block_k):
    tiles = tile_schedule(tq, tk, block_q, block_k)
    n_q, n_k = math.ceil(tq / block_q), math.ceil(tk / block_k)
    assert len(tiles) == n_q * n_k
    assert tiles == [(i, j) for i in range(n_q) for j in range(n_k)]


@sweep(60)
@given(tq=st.integers(0, 40), tk=st.integers(0, 40), block_q=st.integers(1, 20),
       block_k=st.integers(1, 20), is_causal=st.booleans(),
       window=st.one_of(st.none(), st.integers(1, 50)))
def test_the_schedule_is_exactly_the_tiles_with_an_allowed_pair(tq, tk, block_q, block_k,
                                                                 is_causal, window):
    assert tile_schedule(tq, tk, block_q, block_k, is_causal, window) == brute_force_tiles(
        tq, tk, block_q, block_k, is_causal, window)


def test_causal_square_schedule_is_the_lower_triangle_of_tiles():
    assert len(tile_schedule(1024, 1024, 64, 64, is_causal=True)) == 16 * 17 // 2
    assert len(tile_schedule(1024, 1024, 64, 64)) == 16 * 16


def test_the_schedule_refuses_bad_arguments():
    for kwargs, message in ((dict(tq=-1), "tq must be a non-negative int"),
                            (dict(tq=2.0), "tq must be a non-negative int"),
                            (dict(tk=True), "tk must be a non-negative int"),
                            (dict(block_q=0), "block_q must be a positive int"),
                            (dict(block_k=-2), "block_k must be a positive int"),
                            (dict(block_k=1.5), "block_k must be a positive int"),
                            (dict(window=0), "window must be None or an int >= 1")):
        with pytest.raises(ValueError, match=message):
            tile_schedule(**{"tq": 8, "tk": 8, **kwargs})


# ---------------------------------------------------------------- split-KV decoding


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 10, 15])
def test_flash_decode_equals_attention_over_all_keys(device, num_splits):
    """One new query (and a chunk of 3) against 10 cached keys, GQA, with a padding mask whose
    second sequence has 6 real keys; more splits than keys leaves chunks empty."""
    for tq in (1, 3):
        q, k, v = qkv(2, 4, 2, tq, 10, seed=num_splits + tq, device=device)
        for mask in (None, padding_mask(torch.tensor([10, 6]), 10).to(device)):
            out, lse = flash_decode(q, k, v, num_splits=num_splits, attn_mask=mask,
                                    enable_gqa=True, return_lse=True)
            assert_close(out, math_attention(q, k, v, attn_mask=mask, enable_gqa=True), "out")
            assert_close(lse.double(), reference_lse(q, k, attn_mask=mask), "lse")
            assert torch.equal(out, flash_decode(q, k, v, num_splits=num_splits,
                                                 attn_mask=mask, enable_gqa=True))


def test_flash_decode_with_an_empty_sequence_gives_zeros(device):
    q, k, v = qkv(2, 2, 2, 1, 8, seed=2, device=device)
    mask = padding_mask(torch.tensor([0, 5]), 8).to(device)
    out = flash_decode(q, k, v, num_splits=3, attn_mask=mask)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close(out, math_attention(q, k, v, attn_mask=mask))
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        flash_decode(q, k, v, num_splits=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_flash_decode_error_does_not_grow_with_the_splits(device, require_dtype, dtype):
    """Half precision: the chunks merge in float32, so 45 splits err no more than "math"."""
    require_dtype(device, dtype)
    q, k, v = (randn(1, 4, t, 64, seed=s, device=device, dtype=torch.float64)
               for s, t in ((0, 1), (1, 2000), (2, 2000)))
    exact = math_attention(q, k, v)
    math_error = (math_attention(*(x.to(dtype) for x in (q, k, v))).double() - exact).abs().max()
    for num_splits in (4, 45):
        out = flash_decode(*(x.to(dtype) for x in (q, k, v)), num_splits=num_splits)
        assert out.dtype == dtype
        assert (out.double() - exact).abs().max() <= 1.5 * math_error + 1e-6


# ---------------------------------------------------------------- memory


def test_peak_memory_grows_linearly_in_t():
    """Profiler peaks (CPU) over T = 256 .. 2048, causal: "flash" fits T^e with e < 1.3, "math",
    which holds the T×T scores, e > 1.7; at the largest T flash holds far less."""
    device = torch.device("cpu")
    lengths = (256, 512, 1024, 2048)
    peaks = {"flash": [], "math": []}
    for t in lengths:
        q, k, v = qkv(1, 2, 2, t, t, 32, 32, seed=t)
        for name in peaks:
            fn = get_backend(name)
            peak = peak_memory_bytes(lambda: fn(q, k, v, is_causal=True), device)
            if peak is None:
                pytest.skip("the profiler reports no CPU allocations in this build of PyTorch")
            peaks[name].append(peak)
    flash, full = (growth_exponent(lengths, peaks[name]) for name in ("flash", "math"))
    assert flash < 1.3, f"flash's peak grows as T^{flash:.2f}: {peaks['flash']}"
    assert full > 1.7, f"math's peak grows as T^{full:.2f}: {peaks['math']}"
    assert peaks["flash"][-1] * 10 < peaks["math"][-1]


# ---------------------------------------------------------------- bad input


def test_bad_blocks_are_refused(device):
    q, k, v = qkv(1, 2, 2, 6, 6, device=device)
    for name in ("block_q", "block_k"):
        for block in (0, -3, 2.5, True, "8"):
            with pytest.raises(ValueError, match=f"{name} must be a positive int"):
                flash_attention(q, k, v, **{name: block})


def test_a_float_mask_that_requires_grad_is_refused_while_grad_is_enabled(device):
    q, k, v = qkv(1, 2, 2, 6, 6, device=device)
    mask = torch.zeros(6, 6, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="computes no gradient for attn_mask.*detach"):
        flash_attention(q, k, v, attn_mask=mask)
    with torch.no_grad():                                   # nothing to differentiate: fine
        assert_close(flash_attention(q, k, v, attn_mask=mask), math_attention(q, k, v))
    assert_close(flash_attention(q, k, v, attn_mask=mask.detach()), math_attention(q, k, v))


def test_shape_errors_come_from_the_shared_check(device):
    q, k, v = qkv(2, 4, 2, 6, 7, device=device)
    for kwargs, message in (
        (dict(k=k[..., :4]), "head dim mismatch"),
        (dict(), "enable_gqa"),
        (dict(q=q[0]), "rank 4"),
        (dict(attn_mask=torch.ones(5, 7, dtype=torch.bool, device=device), enable_gqa=True),
         "does not broadcast"),
        (dict(window=0, enable_gqa=True), "window must be None or an int >= 1"),
    ):
        call = {"q": q, "k": k, "v": v, **kwargs}
        with pytest.raises(ValueError, match=message):
            flash_attention(call.pop("q"), call.pop("k"), call.pop("v"), **call)
