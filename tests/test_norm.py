"""norm.py: rms_norm and RMSNorm against PyTorch's, and their input checks."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from course_attn.norm import RMSNorm, rms_norm

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5),
       torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def randn(*shape, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)


shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4)


@given(shape=shapes, eps=st.sampled_from([0.0, 1e-6, 1e-5, 0.1, 1]), with_weight=st.booleans(),
       dtype=st.sampled_from(DTYPES), scale=st.sampled_from([1e-3, 1.0, 100.0]),
       seed=st.integers(0, 2 ** 31 - 1))
def test_rms_norm_equals_torch(device, require_dtype, shape, eps, with_weight, dtype, scale, seed):
    require_dtype(device, dtype)
    x = randn(*shape, seed=seed, device=device, dtype=dtype) * scale
    weight = randn(shape[-1], seed=seed + 1, device=device, dtype=dtype) if with_weight else None
    out = rms_norm(x, weight, eps)
    assert out.shape == x.shape and out.dtype == dtype
    # Both against float64 math on the same (rounded) inputs: PyTorch's own half-precision
    # kernel may round in other places, so each is held to the dtype's tolerance.
    w64 = None if weight is None else weight.double()
    expected = F.rms_norm(x.double(), (shape[-1],), w64, eps)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, expected.to(dtype), rtol=rtol, atol=atol)
    torch.testing.assert_close(F.rms_norm(x, (shape[-1],), weight, eps), out,
                               rtol=2 * rtol, atol=2 * atol)


def test_rms_norm_by_hand(device):
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]], device=device)   # RMS of (3, 4) is sqrt(12.5)
    out = rms_norm(x, eps=0.0)
    torch.testing.assert_close(out[0], x[0] / 12.5 ** 0.5)
    assert torch.isnan(out[1]).all()                            # 0 / 0 without eps
    assert torch.equal(rms_norm(x, eps=1e-6)[1], torch.zeros(2, device=device))
    weight = torch.tensor([2.0, -1.0], device=device)
    torch.testing.assert_close(rms_norm(x, weight, eps=0.0)[0], x[0] / 12.5 ** 0.5 * weight)


@given(scale=st.floats(1e-2, 1e3), seed=st.integers(0, 2 ** 31 - 1))
def test_rms_norm_ignores_a_positive_scale(device, scale, seed):
    x = randn(3, 16, seed=seed, device=device)
    torch.testing.assert_close(rms_norm(x * scale, eps=0.0), rms_norm(x, eps=0.0))
    torch.testing.assert_close(rms_norm(x, eps=0.0).square().mean(-1), torch.ones(3, device=device))


@pytest.mark.parametrize("eps", [1e-6, 1e-5, 0.25])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_module_equals_torch_nn_rms_norm(device, require_dtype, dtype, eps):
    require_dtype(device, dtype)
    torch.manual_seed(0)
    ours, theirs = RMSNorm(12, eps=eps), torch.nn.RMSNorm(12, eps=eps)
    assert torch.equal(ours.weight, theirs.weight)              # both start at ones
    with torch.no_grad():
        ours.weight.copy_(torch.randn(12))
    theirs.load_state_dict(ours.state_dict())                  # same name: "weight"
    ours, theirs = ours.to(device, dtype), theirs.to(device, dtype)
    x = randn(2, 5, 12, device=device, dtype=dtype)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(ours(x), theirs(x), rtol=2 * rtol, atol=2 * atol)


def test_rms_norm_module_learns_its_gain(device):
    norm = RMSNorm(4).to(device)
    x = randn(3, 4, device=device)
    norm(x).sum().backward()
    torch.testing.assert_close(norm.weight.grad, rms_norm(x).sum(0))
    assert [name for name, _ in norm.named_parameters()] == ["weight"]
    assert repr(norm) == "RMSNorm(4, eps=1e-06)"


def test_half_precision_is_computed_in_float32(device, require_dtype):
    """x² of a float16 of 300 overflows (65504 max); the float32 accumulation does not."""
    require_dtype(device, torch.float16)
    x = torch.full((2, 8), 300.0, device=device, dtype=torch.float16)
    out = rms_norm(x)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.ones_like(out))


def test_rms_norm_errors():
    with pytest.raises(ValueError, match="floating tensor.*torch.int64 of shape \\(2, 3\\)"):
        rms_norm(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="floating tensor.*shape \\(\\)"):
        rms_norm(torch.tensor(1.0))
    with pytest.raises(ValueError, match="got list"):
        rms_norm([1.0, 2.0])
    with pytest.raises(ValueError,
                       match=r"weight must have shape \(3,\) to match x \(2, 3\), got \(4,\)"):
        rms_norm(torch.ones(2, 3), torch.ones(4))
    with pytest.raises(ValueError, match=r"weight must have shape \(3,\).*got \(1, 3\)"):
        rms_norm(torch.ones(2, 3), torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"weight must have shape \(3,\).*got \[1, 1, 1\]"):
        rms_norm(torch.ones(2, 3), [1, 1, 1])
    for eps in (-1e-6, float("nan"), "1e-6", None, True):
        with pytest.raises(ValueError, match="eps must be a number >= 0"):
            rms_norm(torch.ones(2, 3), eps=eps)
    for dim in (0, -2, 3.0, True, None):
        with pytest.raises(ValueError, match=f"dim must be a positive int, got {dim!r}"):
            RMSNorm(dim)
    with pytest.raises(ValueError, match="eps must be a number >= 0"):
        RMSNorm(4, eps=-1.0)(torch.ones(4))
