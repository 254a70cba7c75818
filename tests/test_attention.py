"""attention.py: softmax, attention weights, gradients of the reference, and input checking."""

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course_attn import attention_weights, repeat_kv, scaled_dot_product_attention, softmax
from course_attn.backends import BACKENDS, get_backend
from course_attn.masks import padding_mask

BACKEND_NAMES = sorted(BACKENDS)


def randn(*shape, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)


# --- softmax -------------------------------------------------------------------------------

shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4)


@given(shape=shapes, seed=st.integers(0, 2 ** 31 - 1), data=st.data())
def test_softmax_equals_torch_softmax(device, shape, seed, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = randn(*shape, seed=seed, device=device) * 5
    torch.testing.assert_close(softmax(x, dim), torch.softmax(x, dim))


def test_softmax_is_stable_for_huge_scores(device):
    x = torch.tensor([[1e4, 1e4 - 1.0, -1e4], [3e4, 3e4, 3e4]], device=device)
    p = softmax(x, -1)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p, torch.softmax(x.double(), -1).float())
    torch.testing.assert_close(p[1], torch.full((3,), 1 / 3, device=device))


def test_softmax_of_an_all_minus_inf_row_is_zeros(device):
    x = torch.tensor([[0.0, 1.0, float("-inf")], [float("-inf")] * 3], device=device)
    p = softmax(x, -1)
    torch.testing.assert_close(p[0], torch.softmax(x[0], -1))
    assert torch.equal(p[1], torch.zeros(3, device=device))
    assert torch.equal(softmax(x.T, 0)[:, 1], torch.zeros(3, device=device))


def test_softmax_keeps_the_dtype(device, require_dtype):
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        require_dtype(device, dtype)
        assert softmax(torch.zeros(2, 3, device=device, dtype=dtype), -1).dtype == dtype


# --- attention weights ---------------------------------------------------------------------


@st.composite
def weight_cases(draw):
    """Shapes q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv), a mask and keywords."""
    b, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    hq = hkv * draw(st.sampled_from([1, 2, 4]))
    tq, tk, d, dv = (draw(st.integers(1, 7)) for _ in range(4))
    return dict(
        shapes=((b, hq, tq, d), (b, hkv, tk, d), (b, hkv, tk, dv)),
        mask_shape=(b, 1, tq, tk),
        keep_prob=draw(st.one_of(st.none(), st.sampled_from([0.2, 0.7]))),
        is_causal=draw(st.booleans()), window=draw(st.one_of(st.none(), st.integers(1, 8))),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
    )


@given(c=weight_cases())
def test_weights_are_probabilities_and_weights_times_v_is_the_output(device, c):
    q, k, v = (randn(*shape, seed=c["seed"] + i, device=device, dtype=torch.float64)
               for i, shape in enumerate(c["shapes"]))
    mask = None
    if c["keep_prob"] is not None:
        g = torch.Generator().manual_seed(c["seed"])
        mask = (torch.rand(c["mask_shape"], generator=g) < c["keep_prob"]).to(device)
    kwargs = dict(attn_mask=mask, is_causal=c["is_causal"], window=c["window"], enable_gqa=True)
    w = attention_weights(q, k, **kwargs)
    assert w.shape == (*q.shape[:3], k.shape[2])
    assert (w >= 0).all()
    row_sums = w.sum(-1)
    alive = row_sums > 0.5
    torch.testing.assert_close(row_sums[alive], torch.ones_like(row_sums[alive]))
    assert torch.equal(row_sums[~alive], torch.zeros_like(row_sums[~alive]))
    v_per_query_head = repeat_kv(v, q.shape[1] // v.shape[1])
    expected = scaled_dot_product_attention(q, k, v, **kwargs)
    torch.testing.assert_close(w @ v_per_query_head, expected)


def test_weights_of_masked_keys_are_zero(device):
    q, k = randn(2, 1, 3, 4, device=device), randn(2, 1, 5, 4, seed=1, device=device)
    w = attention_weights(q, k, attn_mask=padding_mask(torch.tensor([5, 2], device=device), 5))
    assert torch.equal(w[1, :, :, 2:], torch.zeros_like(w[1, :, :, 2:]))
    assert (w[0] > 0).all()


def test_weights_keep_the_input_dtype(device):
    q, k = randn(1, 1, 2, 4, device=device, dtype=torch.bfloat16), randn(1, 1, 3, 4, device=device,
                                                                      dtype=torch.bfloat16)
    assert attention_weights(q, k).dtype == torch.bfloat16


def test_default_scale_is_one_over_sqrt_head_dim(device):
    q, k, v = (randn(1, 2, 3, 16, seed=s, device=device, dtype=torch.float64) for s in range(3))
    out = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, scaled_dot_product_attention(q, k, v, scale=0.25))
    expected = torch.softmax(q @ k.transpose(-2, -1) / 4.0, -1) @ v
    torch.testing.assert_close(out, expected)


def test_repeat_kv_gives_query_head_h_the_kv_head_h_over_n_rep(device):
    x = torch.arange(3, device=device).view(1, 3, 1, 1).float()
    assert repeat_kv(x, 2).flatten().tolist() == [0, 0, 1, 1, 2, 2]
    assert repeat_kv(x, 1) is x


# --- gradients of the reference ------------------------------------------------------------

GRADCHECK_CALLS = {
    "plain": dict(),
    "gqa + scale": dict(enable_gqa=True, scale=0.3),
    "bool mask, one dead row": dict(mask="bool"),
    "float mask, one dead row": dict(mask="float"),
    "causal, Tq > Tk (dead rows)": dict(is_causal=True),
    "window + mask": dict(mask="bool", window=2, is_causal=True),
}


@pytest.mark.parametrize("how", list(GRADCHECK_CALLS))
def test_math_backend_gradcheck_float64(device, require_dtype, how):
    require_dtype(device, torch.float64)
    kwargs = dict(GRADCHECK_CALLS[how])
    tq, tk = (5, 3) if how.startswith("causal") else (3, 4)
    hq = 4 if kwargs.get("enable_gqa") else 2
    q = randn(1, hq, tq, 3, seed=10, device=device, dtype=torch.float64).requires_grad_()
    k = randn(1, 2, tk, 3, seed=11, device=device, dtype=torch.float64).requires_grad_()
    v = randn(1, 2, tk, 2, seed=12, device=device, dtype=torch.float64).requires_grad_()
    mask_kind = kwargs.pop("mask", None)
    if mask_kind is not None:
        keep = torch.ones(tq, tk, dtype=torch.bool, device=device)
        keep[1] = False
        keep[0, 0] = False
        kwargs["attn_mask"] = keep if mask_kind == "bool" else torch.zeros(
            tq, tk, dtype=torch.float64, device=device).masked_fill(~keep, float("-inf"))

    def attend(q, k, v):
        return scaled_dot_product_attention(q, k, v, **kwargs)

    assert torch.autograd.gradcheck(attend, (q, k, v))
    out = attend(q, k, v)
    out.square().sum().backward()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert torch.isfinite(t.grad).all(), f"d{name} is not finite"
    if mask_kind is not None:
        assert torch.equal(q.grad[:, :, 1], torch.zeros_like(q.grad[:, :, 1]))


# --- bad input -----------------------------------------------------------------------------


def qkv(device, dtype=torch.float32):
    """Valid inputs: q (1, 2, 3, 4), k (1, 2, 5, 4), v (1, 2, 5, 6)."""
    return (torch.zeros(1, 2, 3, 4, device=device, dtype=dtype),
            torch.zeros(1, 2, 5, 4, device=device, dtype=dtype),
            torch.zeros(1, 2, 5, 6, device=device, dtype=dtype))


# name -> (what replaces the valid call, given zeros(*shape, dtype=...) on the device; the message)
BAD_INPUTS = {
    "q of rank 3": (lambda z: dict(q=z(2, 3, 4)), r"rank 4 .*q \(2, 3, 4\)"),
    "k of rank 5": (lambda z: dict(k=z(1, 2, 5, 4, 1)), r"rank 4 .*k \(1, 2, 5, 4, 1\)"),
    "head dim mismatch": (lambda z: dict(k=z(1, 2, 5, 8)),
                          r"head dim.*q \(1, 2, 3, 4\).*k \(1, 2, 5, 8\)"),
    "k and v lengths differ": (lambda z: dict(v=z(1, 2, 4, 6)),
                               r"k \(1, 2, 5, 4\) and v \(1, 2, 4, 6\)"),
    "k and v heads differ": (lambda z: dict(v=z(1, 1, 5, 6)),
                             r"k \(1, 2, 5, 4\) and v \(1, 1, 5, 6\)"),
    "batch mismatch": (lambda z: dict(k=z(3, 2, 5, 4), v=z(3, 2, 5, 6)),
                       r"batch.*q \(1, 2, 3, 4\).*k \(3, 2, 5, 4\)"),
    "Hq != Hkv without enable_gqa": (lambda z: dict(q=z(1, 4, 3, 4)), r"Hq=4.*Hkv=2.*enable_gqa"),
    "Hq not a multiple of Hkv": (lambda z: dict(q=z(1, 3, 3, 4), enable_gqa=True),
                                 r"Hq=3 must be a multiple of Hkv=2.*q \(1, 3, 3, 4\)"),
    "mask that does not broadcast": (
        lambda z: dict(attn_mask=z(3, 4, dtype=torch.bool)),
        re.escape("attn_mask (3, 4) does not broadcast to scores (B, Hq, Tq, Tk) = (1, 2, 3, 5)")),
    "mask with too many batches": (lambda z: dict(attn_mask=z(2, 1, 1, 5, dtype=torch.bool)),
                                   re.escape("attn_mask (2, 1, 1, 5) does not broadcast")),
    "int mask": (lambda z: dict(attn_mask=z(3, 5, dtype=torch.int64)),
                 r"attn_mask must be bool or floating, got torch.int64"),
    "mask that is a list": (lambda z: dict(attn_mask=[[True] * 5] * 3),
                            r"attn_mask must be a Tensor"),
    "window 0": (lambda z: dict(window=0), r"window must be None or an int >= 1, got 0"),
    "window -3": (lambda z: dict(window=-3), r"window .* got -3"),
    "window True": (lambda z: dict(window=True), r"window .* got True"),
    "window 2.5": (lambda z: dict(window=2.5), r"window .* got 2.5"),
    "mixed dtypes": (lambda z: dict(k=z(1, 2, 5, 4, dtype=torch.float64)),
                     r"one floating dtype; got q torch.float32, k torch.float64"),
    "integer q, k, v": (lambda z: dict(q=z(1, 2, 3, 4, dtype=torch.int64),
                                       k=z(1, 2, 5, 4, dtype=torch.int64),
                                       v=z(1, 2, 5, 6, dtype=torch.int64)),
                        r"floating dtype.*q torch.int64"),
    "q is a list": (lambda z: dict(q=[[0.0]]), r"q must be a torch.Tensor, got list"),
    "v is a numpy array": (lambda z: dict(v=z(1, 2, 5, 6).cpu().numpy()),
                           r"v must be a torch.Tensor, got ndarray"),
    "scale is a string": (lambda z: dict(scale="0.5"), r"scale must be a number"),
}


def bad_call(case: str, device):
    """(q, k, v, keyword arguments, expected message) for one entry of BAD_INPUTS."""
    change, message = BAD_INPUTS[case]
    q, k, v = qkv(device)
    call = dict(q=q, k=k, v=v)
    call.update(change(lambda *shape, dtype=torch.float32: torch.zeros(shape, dtype=dtype,
                                                                       device=device)))
    return call.pop("q"), call.pop("k"), call.pop("v"), call, message


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_bad_input_raises_value_error_naming_it(name, case, device):
    q, k, v, kwargs, message = bad_call(case, device)
    with pytest.raises(ValueError, match=message):
        get_backend(name)(q, k, v, **kwargs)


WEIGHTS_BAD_INPUTS = [c for c in BAD_INPUTS if not c.startswith(("k and v", "v is"))]


@pytest.mark.parametrize("case", WEIGHTS_BAD_INPUTS)
def test_attention_weights_rejects_the_same_bad_input(case, device):
    q, k, _, kwargs, message = bad_call(case, device)
    with pytest.raises(ValueError, match=message):
        attention_weights(q, k, **kwargs)


@pytest.mark.parametrize("what", ["k and v", "mask"])
@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_mixed_devices_raise_value_error(name, what, device, other_device):
    q, k, v = qkv(device)
    if what == "k and v":
        k, v = k.to(other_device), v.to(other_device)
        kwargs, message = {}, r"one device"
    else:
        kwargs = {"attn_mask": torch.ones(3, 5, dtype=torch.bool, device=other_device)}
        message = r"attn_mask is on"
    with pytest.raises(ValueError, match=message):
        get_backend(name)(q, k, v, **kwargs)


def test_float_mask_in_another_float_dtype_is_accepted(device):
    """A float32 additive mask on float64 inputs: PyTorch refuses it, our signature takes it."""
    q, k, v = qkv(device, torch.float64)
    bias = torch.zeros(3, 5, device=device).masked_fill(torch.eye(3, 5, dtype=torch.bool,
                                                                  device=device), float("-inf"))
    for name in BACKEND_NAMES:
        out = get_backend(name)(q, k, v, attn_mask=bias)
        assert out.dtype == torch.float64 and torch.isfinite(out).all()
