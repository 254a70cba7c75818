"""triton_flash.py: the Triton kernels equal the reference, forward and backward, and refuse
what they do not support.

The kernels' tests run where CUDA is present, or on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1 python -m pytest tests/test_triton_flash.py``), where the blocks are 16×16
so that small shapes cross several blocks; they are skipped elsewhere. The throughput table's
tests (which card's published peak it quotes) need no kernel and run wherever Triton imports. Half-precision errors are measured
against float64 and compared with the error of ``"math"`` in the same dtype.
"""

import importlib
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from course_attn import published  # noqa: E402
from course_attn import scaled_dot_product_attention as reference  # noqa: E402
from course_attn import triton_flash  # noqa: E402
from course_attn.triton_flash import triton_attention  # noqa: E402

kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_flash.interpreting()),
    reason="the Triton kernels need CUDA, or TRITON_INTERPRET=1 to run on the CPU")
DEVICE = torch.device("cpu" if triton_flash.interpreting() else "cuda")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE, dtype)


def inputs(b, hq, hkv, tq, tk, d, dv, *, seed=0, dtype=torch.float32):
    """q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv), all requiring grad."""
    q = randn(b, hq, tq, d, seed=seed, dtype=dtype)
    k = randn(b, hkv, tk, d, seed=seed + 1, dtype=dtype)
    v = randn(b, hkv, tk, dv, seed=seed + 2, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def output_and_grads(fn, q, k, v, dout, **kwargs):
    out = fn(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kwargs)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def max_error(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


# (B, Hq, Hkv, Tq, Tk, D, Dv, causal): ragged blocks (T = 33 crosses two 16-blocks and one
# more row), Tq < Tk and Tq > Tk (bottom-right, the first Tq - Tk queries see no key), GQA,
# T = 1, one decode step, head dims that need padding and Dv != D.
CASES = [
    (1, 2, 2, 33, 33, 16, 16, True),
    (1, 2, 2, 33, 33, 64, 64, False),
    (1, 4, 2, 20, 37, 16, 16, True),
    (1, 2, 1, 37, 20, 16, 16, True),
    (2, 1, 1, 1, 1, 16, 16, True),
    (1, 2, 1, 1, 40, 16, 16, True),
    (1, 1, 1, 17, 9, 21, 7, False),
]


@kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_output_and_gradients_are_as_accurate_as_math(case, dtype):
    """Error against float64: at most 2× math's for the output, 3× for dq, dk, dv, where an
    error below one ulp of the result's scale counts as one ulp (math's dq is exactly 0 at T = 1;
    ours rounds D = rowsum(dO ∘ O) and is not)."""
    b, hq, hkv, tq, tk, d, dv, causal = case
    q, k, v = inputs(b, hq, hkv, tq, tk, d, dv, dtype=dtype)
    dout = randn(b, hq, tq, dv, seed=7, dtype=dtype)
    ours = output_and_grads(triton_attention, q, k, v, dout, is_causal=causal)
    maths = output_and_grads(reference, q, k, v, dout, is_causal=causal)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact = output_and_grads(reference, *wide, dout.double(), is_causal=causal)
    for name, factor, o, m, e in zip(("out", "dq", "dk", "dv"), (2, 3, 3, 3), ours, maths, exact):
        assert o.dtype == dtype and o.shape == e.shape and torch.isfinite(o).all(), name
        ulp = torch.finfo(dtype).eps * max(1.0, e.abs().max().item())
        assert max_error(o, e) <= factor * (max_error(m, e) + ulp), (
            f"{name}: error {max_error(o, e):.3g} vs math's {max_error(m, e):.3g} for {case}")


@kernels
@settings(max_examples=8)
@given(tq=st.integers(1, 40), tk=st.integers(1, 40), group=st.sampled_from([1, 2, 3]),
       d=st.integers(1, 32), dv=st.integers(1, 32), causal=st.booleans(),
       scale=st.one_of(st.none(), st.floats(0.1, 2.0)), seed=st.integers(0, 2 ** 31 - 1))
def test_float32_forward_matches_math_over_shapes(tq, tk, group, d, dv, causal, scale, seed):
    q, k, v = inputs(1, 2 * group, 2, tq, tk, d, dv, seed=seed)
    kwargs = dict(is_causal=causal, scale=scale, enable_gqa=group > 1)
    with torch.no_grad():
        ours, expected = triton_attention(q, k, v, **kwargs), reference(q, k, v, **kwargs)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@kernels
@pytest.mark.parametrize("tq, tk, d", [(70, 150, 64), (150, 70, 128)])
def test_the_gpus_block_sizes(monkeypatch, tq, tk, d):
    """The GPU's blocks are not square (e.g. 128×64 forward, 32×128 for dK, dV): the causal
    skip and the masks hold for them too. (Under the interpreter the other tests use 16×16.)"""
    def gpu_blocks(kernel, d, dv, dtype):
        return {key: val for key, val in triton_flash.gpu_config(kernel, d, dv, dtype).items()
                if key.startswith("BLOCK")}
    monkeypatch.setattr(triton_flash, "_config", gpu_blocks)
    q, k, v = inputs(1, 2, 1, tq, tk, d, d, seed=13, dtype=torch.float16)
    dout = randn(1, 2, tq, d, seed=14, dtype=torch.float16)
    ours = output_and_grads(triton_attention, q, k, v, dout, is_causal=True)
    maths = output_and_grads(reference, q, k, v, dout, is_causal=True)
    for a, m in zip(ours, maths):
        torch.testing.assert_close(a, m, atol=4e-3, rtol=4e-3)


@kernels
def test_log_sum_exp_and_queries_that_see_no_key():
    """lse is logsumexp of each row's scaled scores; a query before the first key (Tq > Tk,
    causal) gets out = 0, lse = -inf and zero gradients, never NaN."""
    q, k, v = inputs(1, 2, 2, 24, 10, 16, 16, seed=3)
    out, lse = triton_flash._forward(q, k, v, True, 0.25)
    scores = (q @ k.transpose(-2, -1)).double() * 0.25
    allowed = torch.ones(24, 10, dtype=torch.bool).tril(diagonal=10 - 24)
    expected = scores.masked_fill(~allowed, float("-inf")).logsumexp(-1).float()
    torch.testing.assert_close(lse, expected)
    assert (out[:, :, :14] == 0).all() and (lse[:, :, :14] == float("-inf")).all()
    out = triton_attention(q, k, v, is_causal=True)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert (dq[:, :, :14] == 0).all()
    assert all(torch.isfinite(g).all() for g in (out, dq, dk, dv))


@kernels
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning",
                            "ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("sign", [1, -1])
def test_scores_far_from_zero_neither_overflow_nor_leak_into_padding(sign):
    """Every score near ±150: exp of a raw score overflows float32, so this needs the running
    max; at -150 a padded key column (score 0 against lse ≈ -150) would give p = inf and NaN
    gradients unless it is masked. (The interpreter warns about the infinities that reach
    padded rows of dK and dV, which are never stored.)"""
    q, k, v = inputs(1, 2, 2, 20, 20, 16, 16, seed=11)
    with torch.no_grad():
        q.mul_(0.1).add_(3.0)
        k.mul_(0.1).add_(3.0 * sign)
    dout = randn(1, 2, 20, 16, seed=12)
    ours = output_and_grads(triton_attention, q, k, v, dout, scale=1.0)
    maths = output_and_grads(reference, q, k, v, dout, scale=1.0)
    for a, m in zip(ours, maths):
        torch.testing.assert_close(a, m, atol=1e-4, rtol=1e-4)


@kernels
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's max
def test_causal_never_reads_keys_above_the_diagonal():
    """NaN in every key and value past the first query block's diagonal: that block's rows
    (and their dq) are unharmed, so those key blocks were never loaded."""
    block = triton_flash._config("fwd", 16, 16, torch.float32)["BLOCK_M"]
    q, k, v = inputs(1, 1, 1, 2 * block, 2 * block, 16, 16, seed=5)
    poisoned = [t.detach().clone() for t in (k, v)]
    for t in poisoned:
        t[:, :, block:] = float("nan")
    k_bad, v_bad = (t.requires_grad_() for t in poisoned)
    out = triton_attention(q, k_bad, v_bad, is_causal=True)
    clean = reference(q, k, v, is_causal=True)
    torch.testing.assert_close(out[:, :, :block], clean[:, :, :block])
    assert torch.isnan(out[:, :, block:]).any()
    # the gradient reaches q's first block through its own rows only: dq must stay clean there
    dout = torch.zeros_like(out)
    dout[:, :, :block] = randn(1, 1, block, 16, seed=6)
    dq, = torch.autograd.grad(out, q, dout)
    dq_clean, = torch.autograd.grad(clean, q, dout)
    torch.testing.assert_close(dq[:, :, :block], dq_clean[:, :, :block])


@kernels
def test_accepts_strided_views_and_is_deterministic():
    """q, k, v as (B, T, H, D) memory seen as (B, H, T, D); two runs are bitwise equal."""
    q, k, v = (randn(2, 19, 2, 16, seed=s).transpose(1, 2).requires_grad_() for s in (0, 1, 2))
    dout = randn(2, 2, 19, 16, seed=3)
    first = output_and_grads(triton_attention, q, k, v, dout, is_causal=True)
    again = output_and_grads(triton_attention, q, k, v, dout, is_causal=True)
    maths = output_and_grads(reference, q, k, v, dout, is_causal=True)
    for a, b, m in zip(first, again, maths):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, m, atol=1e-5, rtol=1e-5)


@kernels
@pytest.mark.parametrize("option, kwargs", [
    ("attn_mask", dict(attn_mask=torch.ones(4, 4, dtype=torch.bool))),
    ("window", dict(window=2)),
])
def test_unsupported_options_raise_value_error(option, kwargs):
    q, k, v = inputs(1, 1, 1, 4, 4, 16, 16)
    kwargs = {key: val.to(DEVICE) if isinstance(val, torch.Tensor) else val
              for key, val in kwargs.items()}
    with pytest.raises(ValueError, match=option):
        triton_attention(q, k, v, **kwargs)


@kernels
def test_unsupported_dtype_head_dim_and_device_raise_value_error():
    q, k, v = inputs(1, 1, 1, 4, 4, 16, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64"):
        triton_attention(q, k, v)
    q, k, v = inputs(1, 1, 1, 4, 4, 129, 16)
    with pytest.raises(ValueError, match="D=129"):
        triton_attention(q, k, v)
    q, k, v = (torch.empty(1, 1, 4, 16, device="meta") for _ in range(3))
    with pytest.raises(ValueError, match="meta"):
        triton_attention(q, k, v)
    q, k, v = inputs(1, 2, 1, 4, 4, 16, 16)
    with pytest.raises(ValueError, match="enable_gqa"):           # the common input checks
        triton_attention(q, k, v)


def test_available_and_importing_without_triton(monkeypatch):
    assert triton_flash.available() == torch.cuda.is_available()
    monkeypatch.setitem(sys.modules, "triton", None)              # as if it were not installed
    monkeypatch.delitem(sys.modules, "course_attn.triton_flash")
    with pytest.raises(ImportError, match="needs Triton"):
        importlib.import_module("course_attn.triton_flash")


ROWS = [dict(d=64, is_causal=False, backward=False, triton=400.0, sdpa=500.0),
        dict(d=64, is_causal=True, backward=True, triton=247.0, sdpa=300.0)]


def test_the_peak_is_published_for_an_h100_sxm_and_an_h200_sxm_only():
    """The names torch.cuda.get_device_name() gives an H100 SXM and an H200 SXM find
    course_attn.published's rows; any other card finds none, their siblings with lower peaks
    (H100 PCIe and NVL, H200 NVL) included."""
    assert (triton_flash.published_peak_tflops("NVIDIA H100 80GB HBM3")
            == published.value("H100 SXM", "bf16_dense_tflops"))
    assert (triton_flash.published_peak_tflops("NVIDIA H200")
            == published.value("H200 SXM", "bf16_dense_tflops"))
    assert triton_flash.PUBLISHED_CARDS == {"NVIDIA H100 80GB HBM3": "H100 SXM",
                                           "NVIDIA H200": "H200 SXM"}
    for name in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA H100",
                 "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090"):
        assert triton_flash.published_peak_tflops(name) is None, name


def test_throughput_table_quotes_the_peak_of_the_card_it_ran_on_or_none():
    peak = published.value("H100 SXM", "bf16_dense_tflops")
    known = triton_flash.throughput_table(ROWS, "NVIDIA H100 80GB HBM3", 4, 16, 4096)
    assert "triton/peak" in known and f"published peak {peak}" in known
    assert known.splitlines()[-1].split()[-2:] == ["0.25", "0.30"]      # of 989.4 TFLOP/s
    h200 = triton_flash.throughput_table(ROWS, "NVIDIA H200", 4, 16, 4096)
    assert f"published peak {published.value('H200 SXM', 'bf16_dense_tflops')}" in h200
    assert "(dense bf16, H200 SXM)" in h200
    unknown = triton_flash.throughput_table(ROWS, "NVIDIA L4", 4, 16, 4096)
    assert "no published peak for NVIDIA L4" in unknown
    assert "peak" not in "\n".join(unknown.splitlines()[1:])          # no fraction columns
    assert unknown.splitlines()[-1].split()[-3:] == ["247.0", "300.0", "0.82"]
