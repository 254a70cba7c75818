"""local.py: ``local_attention`` (the "local" backend) returns the numbers of "math" with the same
window, forward and backward, while reading only the keys in reach, and its peak memory grows
linearly in T where masking the full matrix grows as T².

Its agreement with PyTorch over random shapes is also in test_backends.py, which sweeps every
registered backend; here the cases are the ones a banded implementation gets wrong: T below, at
and far above the window, blocks that do not divide T, Tq != Tk, masks cut per block."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course_attn.attention import scaled_dot_product_attention as math_attention
from course_attn.backends import BACKENDS, get_backend
from course_attn.bench import peak_memory_bytes
from course_attn.local import DEFAULT_BLOCK, local_attention

from helpers import growth_exponent, qkv, randn

seeds = st.integers(0, 2 ** 31 - 1)


def both(q, k, v, **kwargs):
    """("local", "math") on the same inputs and keywords."""
    gqa = q.shape[1] != k.shape[1]
    block = kwargs.pop("block", DEFAULT_BLOCK)
    return (local_attention(q, k, v, enable_gqa=gqa, block=block, **kwargs),
            math_attention(q, k, v, enable_gqa=gqa, **kwargs))


def assert_equal_fp32(ours, reference):
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_registered_as_local():
    assert get_backend("local") is local_attention and BACKENDS["local"] is local_attention


# ---------------------------------------------------------------- forward, case by case

# (name, Tq, Tk, W, block): the lengths that a band gets wrong
LENGTHS = [
    ("T < W", 5, 5, 8, 4),
    ("T = W", 8, 8, 8, 4),
    ("T = W + 1", 9, 9, 8, 4),
    ("T >> W", 200, 200, 7, 16),
    ("T >> W, block = 1", 40, 40, 5, 1),
    ("block does not divide T", 45, 45, 6, 8),
    ("block > T", 10, 10, 3, 64),
    ("W = 1", 20, 20, 1, 8),
    ("Tq < Tk (a chunk after a cache)", 13, 50, 6, 4),
    ("Tq = 1 (a decode step)", 1, 37, 5, 4),
    ("Tq > Tk (the first queries see nothing)", 30, 12, 4, 8),
    ("the default block", 300, 300, 50, DEFAULT_BLOCK),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "not causal"])
@pytest.mark.parametrize("name, tq, tk, window, block", LENGTHS, ids=[c[0] for c in LENGTHS])
def test_equals_math_with_the_window(device, name, tq, tk, window, block, causal):
    q, k, v = qkv(2, 3, 3, tq, tk, device=device)
    assert_equal_fp32(*both(q, k, v, is_causal=causal, window=window, block=block))


@pytest.mark.parametrize("hq, hkv", [(4, 2), (6, 1), (8, 4)])
def test_grouped_query_attention(device, hq, hkv):
    q, k, v = qkv(2, hq, hkv, 33, 41, device=device)
    for causal in (True, False):
        assert_equal_fp32(*both(q, k, v, is_causal=causal, window=5, block=8))
    with pytest.raises(ValueError, match="enable_gqa"):
        local_attention(q, k, v, window=5)


MASKS = {   # (Tq, Tk) -> a mask broadcastable to (B=2, Hq=4, Tq, Tk)
    "bool (Tq, Tk)": lambda tq, tk, g: torch.rand(tq, tk, generator=g) < 0.7,
    "bool (B, 1, 1, Tk) padding": lambda tq, tk, g: torch.rand(2, 1, 1, tk, generator=g) < 0.8,
    "bool (B, Hq, Tq, Tk)": lambda tq, tk, g: torch.rand(2, 4, tq, tk, generator=g) < 0.6,
    "bool (Tq, 1)": lambda tq, tk, g: torch.rand(tq, 1, generator=g) < 0.7,
    "bool (Tk,)": lambda tq, tk, g: torch.rand(tk, generator=g) < 0.7,
    "float (Hq, Tq, Tk)": lambda tq, tk, g: torch.randn(4, tq, tk, generator=g,
                                                        dtype=torch.float64),
    "float with -inf (1, Hq, 1, Tk)": lambda tq, tk, g: torch.randn(
        1, 4, 1, tk, generator=g, dtype=torch.float64).masked_fill(
        torch.rand(1, 4, 1, tk, generator=g) < 0.3, float("-inf")),
}


@pytest.mark.parametrize("kind", sorted(MASKS))
def test_masks_are_cut_per_block(device, kind):
    for tq, tk, causal in ((40, 40, True), (17, 30, True), (25, 25, False)):
        q, k, v = qkv(2, 4, 2, tq, tk, device=device)
        mask = MASKS[kind](tq, tk, torch.Generator().manual_seed(tq))
        mask = mask.to(device) if mask.dtype == torch.bool else mask.to(device, torch.float32)
        assert_equal_fp32(*both(q, k, v, attn_mask=mask, is_causal=causal, window=6, block=7))


def test_fully_masked_rows_are_zeros_forward_and_backward(device):
    q, k, v = qkv(1, 2, 2, 20, 20, device=device)
    keep = torch.ones(20, 20, dtype=torch.bool, device=device)
    keep[3] = False                                   # query 3 may see nothing
    keep[10, 6:11] = False                            # query 10: only keys outside its window
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = local_attention(*inputs, attn_mask=keep, is_causal=True, window=5, block=8)
    assert torch.equal(out[:, :, [3, 10]], torch.zeros_like(out[:, :, [3, 10]]))
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in inputs)
    assert torch.equal(inputs[0].grad[:, :, [3, 10]], torch.zeros_like(q[:, :, [3, 10]]))
    assert_equal_fp32(out, math_attention(q, k, v, attn_mask=keep, is_causal=True, window=5))


def test_reads_only_the_keys_in_reach(device):
    """Eight queries at the end of 100 keys, W = 4: keys before 100 - 8 - 3 are out of every
    query's reach. Poisoned with NaN, they must not reach the output."""
    q, k, v = qkv(1, 2, 2, 8, 100, device=device)
    first = 100 - 8 - 3
    k_poisoned, v_poisoned = k.clone(), v.clone()
    k_poisoned[:, :, :first], v_poisoned[:, :, :first] = float("nan"), float("nan")
    out = local_attention(q, k_poisoned, v_poisoned, is_causal=True, window=4, block=3)
    assert torch.isfinite(out).all()
    assert_equal_fp32(out, math_attention(q, k[:, :, first:], v[:, :, first:], is_causal=True,
                                          window=4))


def test_without_a_window_it_is_the_full_computation(device):
    q, k, v = qkv(2, 4, 2, 9, 14, device=device)
    mask = torch.rand(9, 14, generator=torch.Generator().manual_seed(0)).to(device) < 0.7
    for kwargs in (dict(), dict(is_causal=True), dict(attn_mask=mask), dict(scale=0.3)):
        assert_equal_fp32(*both(q, k, v, **kwargs))


@st.composite
def local_cases(draw, max_t=70):
    tq = draw(st.integers(1, max_t))
    return dict(
        b=draw(st.integers(1, 2)), hkv=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2, 3])),
        tq=tq, tk=draw(st.one_of(st.just(tq), st.integers(1, max_t))),
        d=draw(st.integers(1, 9)), dv=draw(st.integers(1, 9)),
        window=draw(st.integers(1, 80)), block=draw(st.integers(1, 40)),
        causal=draw(st.booleans()), mask=draw(st.sampled_from([None, "bool", "float"])),
        scale=draw(st.one_of(st.none(), st.floats(0.1, 2.0))), seed=draw(seeds))


def case_inputs(c, device, dtype=torch.float32):
    hq = c["hkv"] * c["group"]
    q, k, v = qkv(c["b"], hq, c["hkv"], c["tq"], c["tk"], c["d"], c["dv"], seed=c["seed"],
                  device=device, dtype=dtype)
    mask = None
    if c["mask"] is not None:
        g = torch.Generator().manual_seed(c["seed"])
        keep = torch.rand(c["b"], 1, c["tq"], c["tk"], generator=g) < 0.8
        mask = keep if c["mask"] == "bool" else torch.randn(
            keep.shape, generator=g, dtype=torch.float64).masked_fill(~keep, float("-inf"))
        mask = mask.to(device) if mask.dtype == torch.bool else mask.to(device, dtype)
    kwargs = dict(attn_mask=mask, is_causal=c["causal"], window=c["window"], scale=c["scale"],
                  enable_gqa=c["group"] > 1)
    return q, k, v, kwargs


@given(c=local_cases())
def test_sweep_equals_math(device, c):
    """Any lengths, windows and blocks (T a multiple of the block or not), masks, GQA, scale."""
    q, k, v, kwargs = case_inputs(c, device)
    out = local_attention(q, k, v, block=c["block"], **kwargs)
    assert out.shape == (c["b"], q.shape[1], c["tq"], c["dv"]) and out.dtype == q.dtype
    assert_equal_fp32(out, math_attention(q, k, v, **kwargs))


# ---------------------------------------------------------------- backward

@given(c=local_cases(max_t=40))
def test_gradients_equal_maths(device, c):
    q, k, v, kwargs = case_inputs(c, device)
    grad_out = randn(c["b"], q.shape[1], c["tq"], c["dv"], seed=c["seed"] + 7, device=device)

    def grads(fn):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fn(*inputs, **kwargs), inputs, grad_out)

    ours = grads(lambda *a, **kw: local_attention(*a, block=c["block"], **kw))
    for what, a, b in zip("qkv", ours, grads(math_attention)):
        assert torch.isfinite(a).all(), f"d{what} is not finite"
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"d{what}: {m}")


# ---------------------------------------------------------------- half precision

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_error_is_no_worse_than_maths(device, require_dtype, dtype):
    """Both measured against float64 on the same inputs; "local" may not be much worse."""
    require_dtype(device, torch.float64)
    c = dict(b=2, hkv=2, group=2, tq=70, tk=90, d=16, dv=16, window=9, block=16, causal=True,
             mask="float", scale=None, seed=3)
    q, k, v, kwargs = case_inputs(c, device, dtype)
    ours = local_attention(q, k, v, block=16, **kwargs)
    theirs = math_attention(q, k, v, **kwargs)
    wide = {**kwargs, "attn_mask": kwargs["attn_mask"].double()}
    exact = math_attention(q.double(), k.double(), v.double(), **wide)
    our_error = (ours.double() - exact).abs().max().item()
    their_error = (theirs.double() - exact).abs().max().item()
    eps = torch.finfo(dtype).eps * max(1.0, exact.abs().max().item())
    assert ours.dtype == dtype and our_error <= 2 * their_error + eps, (our_error, their_error)


# ---------------------------------------------------------------- memory

def test_peak_memory_grows_linearly_in_t():
    """Profiler peaks (CPU) over T = 256 .. 2048, W = 64: "local" fits T^e with e < 1.3, the
    masked full matrix of "math" with e near 2; and at the largest T local holds far less."""
    device = torch.device("cpu")
    lengths, window = (256, 512, 1024, 2048), 64
    peaks = {"local": [], "math": []}
    for t in lengths:
        q, k, v = qkv(1, 2, 2, t, t, 16, 16, seed=t)
        for name in peaks:
            fn = get_backend(name)
            peak = peak_memory_bytes(lambda: fn(q, k, v, is_causal=True, window=window), device)
            if peak is None:
                pytest.skip("the profiler reports no CPU allocations in this build of PyTorch")
            peaks[name].append(peak)
    local, full = (growth_exponent(lengths, peaks[name]) for name in ("local", "math"))
    assert local < 1.3, f"local's peak grows as T^{local:.2f}: {peaks['local']}"
    assert full > 1.7, f"math's peak grows as T^{full:.2f}: {peaks['math']}"
    assert peaks["local"][-1] * 10 < peaks["math"][-1]


# ---------------------------------------------------------------- bad input

def test_bad_input_is_refused():
    q, k, v = qkv(1, 2, 2, 6, 6)
    for block in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="block must be a positive int"):
            local_attention(q, k, v, window=3, block=block)
    with pytest.raises(ValueError, match="window must be None or an int >= 1"):
        local_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="head dim mismatch"):
        local_attention(q, k[..., :4], v, window=3)
    with pytest.raises(ValueError, match="does not broadcast"):
        local_attention(q, k, v, window=3, attn_mask=torch.ones(5, 6, dtype=torch.bool))
