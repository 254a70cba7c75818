"""Every registered backend returns what PyTorch's SDPA returns, forward and backward.

The reference is ``torch.nn.functional.scaled_dot_product_attention`` given one explicit mask
built here, independently of ``course_attn.masks``: PyTorch's own bottom-right causal bias
(``causal_lower_right``) for ``is_causal``, and the window straight from its definition
(``0 <= i - j < W`` causal, ``|i - j| < W`` not, query i at position Tk - Tq + i).
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from torch.nn.attention.bias import causal_lower_right

from course_attn.backends import BACKENDS, get_backend, register

from helpers import Case, cases

BACKEND_NAMES = sorted(BACKENDS)

pytestmark = pytest.mark.filterwarnings("ignore:Lower right causal bias:UserWarning")


def reference_mask(case: Case, mask, device):
    """The one mask PyTorch gets: the user's mask, and the causal and window constraints."""
    tq, tk = case.tq, case.tk
    allowed = None
    if case.is_causal:
        allowed = causal_lower_right(tq, tk)._materialize(device)
    if case.window is not None:
        i = torch.arange(tq, device=device)[:, None] + (tk - tq)
        j = torch.arange(tk, device=device)[None, :]
        distance = i - j
        if case.is_causal:
            in_window = (0 <= distance) & (distance < case.window)
        else:
            in_window = distance.abs() < case.window
        allowed = in_window if allowed is None else allowed & in_window
    if mask is None:
        return allowed
    if allowed is None:
        return mask
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))


def dead_query_rows(full_mask, case: Case):
    """(B or 1, Hq or 1, Tq, 1): True where the mask lets a query attend to no key at all."""
    if full_mask is None:
        return None
    allowed = full_mask if full_mask.dtype == torch.bool else full_mask > float("-inf")
    allowed = allowed.expand(case.b, case.hq, case.tq, case.tk)
    return ~allowed.any(dim=-1, keepdim=True)


def pytorch_reference(case: Case, q, k, v, mask):
    full = reference_mask(case, mask, q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=full, scale=case.scale,
                                         enable_gqa=case.hq != case.hkv)
    dead = dead_query_rows(full, case)
    # PyTorch >= 2.5 already returns zeros there on CPU; not every CUDA kernel promises it.
    return out if dead is None else out.masked_fill(dead, 0.0)


def call(name: str, case: Case, q, k, v, mask):
    return get_backend(name)(q, k, v, attn_mask=mask, **case.kwargs())


# --- forward -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKEND_NAMES)
@given(case=cases())
def test_float64_matches_pytorch_tightly(name, device, require_dtype, case):
    require_dtype(device, torch.float64)
    q, k, v, mask = case.tensors(device, torch.float64)
    out = call(name, case, q, k, v, mask)
    assert out.shape == (case.b, case.hq, case.tq, case.dv)
    assert out.dtype == torch.float64 and out.device.type == device.type
    torch.testing.assert_close(out, pytorch_reference(case, q, k, v, mask), atol=1e-10, rtol=1e-10)
    math_out = call("math", case, q, k, v, mask)
    torch.testing.assert_close(out, math_out, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("name", BACKEND_NAMES)
@given(case=cases())
def test_float32_matches_pytorch(name, device, case):
    q, k, v, mask = case.tensors(device, torch.float32)
    out = call(name, case, q, k, v, mask)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, pytorch_reference(case, q, k, v, mask))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", BACKEND_NAMES)
@given(case=cases())
def test_half_precision_error_is_no_worse_than_pytorchs(name, dtype, device, require_dtype, case):
    """Ours and PyTorch's SDPA in half precision, each measured against float64 on one input."""
    require_dtype(device, torch.float64)
    q, k, v, mask = case.tensors(device, dtype)
    ours = call(name, case, q, k, v, mask)
    assert ours.dtype == dtype
    theirs = pytorch_reference(case, q, k, v, mask)
    wide = [t.to(torch.float64) if t is not None else None for t in (q, k, v, mask)]
    exact = pytorch_reference(case, *wide)
    our_error = (ours.to(torch.float64) - exact).abs().max().item()
    their_error = (theirs.to(torch.float64) - exact).abs().max().item()
    epsilon = torch.finfo(dtype).eps * max(1.0, exact.abs().max().item())
    assert our_error <= 2 * their_error + epsilon, (
        f"{name} {dtype}: max error {our_error:.3g} vs PyTorch's {their_error:.3g} "
        f"(allowed {2 * their_error + epsilon:.3g}) for {case}"
    )


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_square_causal_equals_pytorch_is_causal(name, device):
    g = torch.Generator().manual_seed(0)
    for t in (1, 5, 16):
        q, k, v = (torch.randn(2, 3, t, 8, generator=g).to(device) for _ in range(3))
        out = get_backend(name)(q, k, v, is_causal=True)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_causal_with_more_keys_than_queries_is_bottom_right(name, device):
    """One new query against 6 cached keys sees them all (top-left alignment would see 1)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 1, 4, generator=g).to(device)
    k, v = (torch.randn(1, 2, 6, 4, generator=g).to(device) for _ in range(2))
    torch.testing.assert_close(get_backend(name)(q, k, v, is_causal=True),
                               F.scaled_dot_product_attention(q, k, v))


def dead_row_inputs(device, dtype):
    """q (2, 2, 4, 3), k (2, 2, 5, 3), v (2, 2, 5, 2); masks that leave query row 1 no key."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, 4, 3, generator=g).to(device, dtype)
    k = torch.randn(2, 2, 5, 3, generator=g).to(device, dtype)
    v = torch.randn(2, 2, 5, 2, generator=g).to(device, dtype)
    keep = torch.ones(4, 5, dtype=torch.bool, device=device)
    keep[1] = False
    bias = torch.zeros(4, 5, dtype=dtype, device=device).masked_fill(~keep, float("-inf"))
    return q, k, v, keep, bias


DEAD_ROW_CALLS = {
    "bool mask": lambda keep, bias: dict(attn_mask=keep),
    "float mask": lambda keep, bias: dict(attn_mask=bias),
    "bool mask + causal": lambda keep, bias: dict(attn_mask=keep, is_causal=True),
    "float mask + window": lambda keep, bias: dict(attn_mask=bias, window=2, is_causal=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("how", sorted(DEAD_ROW_CALLS))
@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_fully_masked_rows_are_exactly_zero(name, how, dtype, device):
    q, k, v, keep, bias = dead_row_inputs(device, dtype)
    out = get_backend(name)(q, k, v, **DEAD_ROW_CALLS[how](keep, bias))
    assert not out.isnan().any()
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert out[:, :, [0, 2, 3]].abs().sum() > 0


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_more_queries_than_keys_causal_leaves_the_first_rows_empty(name, device):
    """Tq=5, Tk=3, bottom-right: queries 0 and 1 sit before every key, so they get zeros."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 5, 4, generator=g).to(device)
    k, v = (torch.randn(1, 2, 3, 4, generator=g).to(device) for _ in range(2))
    out = get_backend(name)(q, k, v, is_causal=True)
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    torch.testing.assert_close(out[:, :, 2:], F.scaled_dot_product_attention(
        q[:, :, 2:], k, v, is_causal=True))


EMPTY_CALLS = {"plain": {}, "causal": {"is_causal": True},
               "window": {"window": 2}, "bool mask": {"mask": True}}


@pytest.mark.parametrize("how", sorted(EMPTY_CALLS))
@pytest.mark.parametrize("tq, tk", [(3, 0), (0, 4), (0, 0)])
@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_empty_sequences_behave_like_pytorch(name, tq, tk, how, device):
    """No keys (an empty KV cache): every query gets zeros. No queries: an empty output."""
    kwargs = dict(EMPTY_CALLS[how])
    if kwargs.pop("mask", False):
        kwargs["attn_mask"] = torch.ones(tq, tk, dtype=torch.bool, device=device)
    q = torch.randn(1, 2, tq, 4, device=device, requires_grad=True)
    k = torch.randn(1, 2, tk, 4, device=device, requires_grad=True)
    v = torch.randn(1, 2, tk, 3, device=device, requires_grad=True)
    out = get_backend(name)(q, k, v, **kwargs)
    assert out.shape == (1, 2, tq, 3)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_empty_keys_give_zeros_in_pytorch_too():
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 0, 4)
    assert torch.equal(F.scaled_dot_product_attention(q, k, k), torch.zeros(1, 2, 3, 4))


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_non_contiguous_inputs_are_fine(name, device):
    """q, k, v as multi-head code makes them: (B, T, H, D) storage viewed as (B, H, T, D)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 6, 3, 4, generator=g).to(device).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    out = get_backend(name)(q, k, v, is_causal=True, window=3)
    expected = get_backend(name)(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=True,
                                 window=3)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_scale_is_applied(name, device):
    """scale=s equals the default scale on q rescaled by s·sqrt(D)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64).to(device)
               for _ in range(3))
    fn = get_backend(name)
    torch.testing.assert_close(fn(q, k, v, scale=0.7), fn(q * 0.7 * 2.0, k, v))
    assert not torch.allclose(fn(q, k, v, scale=0.7), fn(q, k, v))


# --- backward ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKEND_NAMES)
@given(case=cases(max_t=7))
def test_float32_gradients_match_pytorch(name, device, case):
    q, k, v, mask = case.tensors(device, torch.float32)
    grad_out = torch.randn(case.b, case.hq, case.tq, case.dv,
                           generator=torch.Generator().manual_seed(case.seed)).to(device)

    def grads(fn):
        inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*inputs)
        return torch.autograd.grad(out, inputs, grad_out)

    ours = grads(lambda q, k, v: call(name, case, q, k, v, mask))
    theirs = grads(lambda q, k, v: pytorch_reference(case, q, k, v, mask))
    for what, a, b in zip("qkv", ours, theirs):
        assert torch.isfinite(a).all(), f"d{what} has non-finite entries"
        torch.testing.assert_close(a, b, msg=lambda m: f"d{what}: {m}")


# --- the registry --------------------------------------------------------------------------


def test_the_reference_and_pytorchs_kernel_are_registered():
    assert {"math", "sdpa"} <= set(BACKENDS)
    assert all(callable(fn) for fn in BACKENDS.values())


def test_unknown_backend_names_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'.*'math'.*'sdpa'"):
        get_backend("nope")
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend(["math"])


def test_register_adds_and_replaces(monkeypatch):
    monkeypatch.setattr("course_attn.backends.BACKENDS", dict(BACKENDS))

    def doubled(q, k, v, **kwargs):
        return 2 * get_backend("math")(q, k, v, **kwargs)

    assert register("doubled", doubled) is doubled
    assert get_backend("doubled") is doubled
    register("doubled", get_backend("math"))
    assert get_backend("doubled") is get_backend("math")
