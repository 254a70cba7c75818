"""linear.delta_rule and delta_rule_step: the recurrent and chunked (WY/UT) forms equal the
update written out from its definition (float64, explicit matrices I - β k kᵀ), with and without
a gate; decoding token by token gives them too; β = 0 writes nothing and β = 1 replaces what a
unit key stores; α = 1 is no gate; gradients agree; bad input is refused by name. DeltaNet's
ShortConvolution is causal, reaches exactly its K - 1 previous tokens, and equals its sum of taps
written out."""

import pytest
import torch
import torch.nn.functional as F
from helpers import qkv, randn
from hypothesis import given
from hypothesis import strategies as st

from course_attn.linear import DELTA_FORMS, ShortConvolution, delta_rule, delta_rule_step

seeds = st.integers(0, 2 ** 31 - 1)


def operands(b=2, h=3, t=37, d=8, dv=5, *, seed=0, device="cpu", dtype=torch.float32,
             gated=True):
    """q, k, v (B, H, T, ·), β in (0, 1) and, if ``gated``, α in [0.5, 1), all (B, H, T)."""
    q, k, v = qkv(b, h, h, t, t, d, dv, seed=seed, device=device, dtype=dtype)
    beta = torch.sigmoid(randn(b, h, t, seed=seed + 3)).to(device, dtype)
    gate = (0.5 + 0.5 * torch.sigmoid(randn(b, h, t, seed=seed + 4))).to(device, dtype)
    return q, k, v, beta, gate if gated else None


def reference(q, k, v, beta, gate=None):
    """S_t = α_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ and o_t = S_tᵀ q_t, with unit q, k:
    float64, the transition built as a matrix, one head and one token at a time."""
    q, k = F.normalize(q.double(), dim=-1), F.normalize(k.double(), dim=-1)
    v, beta = v.double(), beta.double()
    gate = torch.ones_like(beta) if gate is None else gate.double()
    b, h, t, d = q.shape
    out = torch.zeros(b, h, t, v.shape[-1], dtype=torch.float64, device=q.device)
    eye = torch.eye(d, dtype=torch.float64, device=q.device)
    for i in range(b):
        for j in range(h):
            s = torch.zeros(d, v.shape[-1], dtype=torch.float64, device=q.device)
            for n in range(t):
                kn = k[i, j, n, :, None]                                   # (Dk, 1)
                transition = gate[i, j, n] * (eye - beta[i, j, n] * kn @ kn.T)
                s = transition @ s + beta[i, j, n] * kn @ v[i, j, n, None, :]
                out[i, j, n] = s.T @ q[i, j, n]
    return out


def assert_close(actual, expected, rtol=1e-5):
    """Equal up to ``rtol`` times the largest magnitude of ``expected``."""
    assert actual.shape == expected.shape
    scale = expected.abs().max().item() if expected.numel() else 0.0
    error = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert error <= rtol * max(scale, 1e-30), f"max error {error:.3g} at scale {scale:.3g}"


# ---------------------------------------------------------------- the forms agree

# (T, chunk_size): chunks of one token, T not a multiple of the chunk, a multiple, a chunk longer
# than T, one token.
LENGTHS = [(9, 1), (37, 8), (32, 16), (20, 64), (1, 64), (1, 1)]


@pytest.mark.parametrize("gated", [False, True], ids=["deltanet", "gated"])
@pytest.mark.parametrize("t, chunk", LENGTHS, ids=[f"T{t}-C{c}" for t, c in LENGTHS])
def test_recurrent_and_chunked_forms_equal_the_definition(device, gated, t, chunk):
    q, k, v, beta, gate = operands(t=t, device=device, gated=gated)
    expected = reference(q, k, v, beta, gate)
    for form in DELTA_FORMS:
        out = delta_rule(q, k, v, beta, gate=gate, form=form, chunk_size=chunk)
        assert out.dtype == torch.float32 and out.device.type == device.type
        assert_close(out, expected)


@pytest.mark.parametrize("gated", [False, True], ids=["deltanet", "gated"])
def test_the_chunk_size_changes_nothing_float64(device, gated, require_dtype):
    require_dtype(device, torch.float64)
    q, k, v, beta, gate = operands(t=50, device=device, dtype=torch.float64, gated=gated)
    expected = delta_rule(q, k, v, beta, gate=gate, form="recurrent")
    for chunk in (1, 2, 3, 7, 16, 49, 50, 51, 1000):
        assert_close(delta_rule(q, k, v, beta, gate=gate, chunk_size=chunk), expected, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True], ids=["deltanet", "gated"])
def test_half_precision_forms_agree_to_the_dtypes_rounding(device, dtype, gated):
    """Both forms compute in float32 and round once: they differ by at most one rounding of
    the output dtype, and each is that close to the float64 definition."""
    q, k, v, beta, gate = operands(t=40, device=device, dtype=dtype, gated=gated)
    expected = reference(q, k, v, beta, gate)
    ulp = torch.finfo(dtype).eps * expected.abs().max().item()
    outs = [delta_rule(q, k, v, beta, gate=gate, form=form, chunk_size=16) for form in DELTA_FORMS]
    for out in outs:
        assert out.dtype == dtype
        assert (out.double() - expected).abs().max().item() <= ulp
    assert (outs[0].double() - outs[1].double()).abs().max().item() <= ulp


def test_empty_sequence_gives_an_empty_result(device):
    q, k, v, beta, gate = operands(t=0, device=device)
    for form in DELTA_FORMS:
        assert delta_rule(q, k, v, beta, gate=gate, form=form).shape == (2, 3, 0, 5)


@given(b=st.integers(1, 2), h=st.integers(1, 3), t=st.integers(1, 30), d=st.integers(1, 8),
       dv=st.integers(1, 6), chunk=st.integers(1, 40), gated=st.booleans(),
       normalize=st.booleans(), seed=seeds)
def test_every_form_equals_the_definition_over_small_shapes(device, b, h, t, d, dv, chunk,
                                                             gated, normalize, seed):
    q, k, v, beta, gate = operands(b, h, t, d, dv, seed=seed, device=device, gated=gated)
    if not normalize:       # keys of norm up to 1: the update is the definition's with these keys
        q, k = (F.normalize(x, dim=-1) * torch.rand(b, h, t, 1, generator=torch.Generator()
                .manual_seed(seed)).to(device) for x in (q, k))
    expected = reference(q, k, v, beta, gate) if normalize else _unnormalised(q, k, v, beta, gate)
    for form in DELTA_FORMS:
        out = delta_rule(q, k, v, beta, gate=gate, form=form, chunk_size=chunk,
                         normalize=normalize)
        assert out.shape == (b, h, t, dv)
        assert_close(out, expected, 1e-4)


def _unnormalised(q, k, v, beta, gate):
    """The definition with q and k as given: the reference, its outputs rescaled by |q| (o is
    linear in q), its keys kept at their norms by writing β|k|² and v/|k| under the unit key."""
    q, k, v, beta = (x.double() for x in (q, k, v, beta))
    qn, kn = q.norm(dim=-1, keepdim=True), k.norm(dim=-1, keepdim=True)
    safe = torch.where(kn > 0, kn, torch.ones_like(kn))
    out = reference(q, k, v / safe, beta * kn[..., 0] ** 2, gate)
    return out * qn


# ---------------------------------------------------------------- decoding

@pytest.mark.parametrize("gated", [False, True], ids=["deltanet", "gated"])
def test_decoding_token_by_token_equals_the_recurrent_form(device, gated):
    q, k, v, beta, gate = operands(t=23, device=device, gated=gated)
    recurrent = delta_rule(q, k, v, beta, gate=gate, form="recurrent")
    state = None
    for t in range(q.shape[2]):
        step = slice(t, t + 1)
        out, new_state = delta_rule_step(q[:, :, step], k[:, :, step], v[:, :, step],
                                         beta[:, :, step], state,
                                         gate_t=None if gate is None else gate[:, :, step])
        assert out.shape == (2, 3, 1, 5) and new_state.shape == (2, 3, 8, 5)
        assert torch.equal(out[:, :, 0], recurrent[:, :, t])     # the same operations
        if state is not None:
            assert not torch.equal(state, new_state)             # the old state is kept
        state = new_state


# ---------------------------------------------------------------- what the delta rule does

def _state_after(k, v, beta, gate=None, state=None):
    for t in range(k.shape[2]):
        step = slice(t, t + 1)
        _, state = delta_rule_step(k[:, :, step], k[:, :, step], v[:, :, step], beta[:, :, step],
                                   state, gate_t=None if gate is None else gate[:, :, step])
    return state


def test_beta_zero_leaves_the_state_unchanged(device):
    _, k, v, beta, _ = operands(t=12, device=device, gated=False)
    state = _state_after(k, v, beta)
    unchanged = _state_after(k.flip(2), 3 * v, torch.zeros_like(beta), state=state)
    assert torch.equal(unchanged, state)
    out = delta_rule(k, k, v, torch.zeros_like(beta))               # from the empty state
    assert torch.equal(out, torch.zeros_like(out))


def test_beta_one_with_a_unit_key_replaces_the_value_stored_under_it(device, require_dtype):
    """Write a value under a key, then another under the same key with β = 1: reading with the
    key returns the second value exactly, not their sum (what linear attention would return),
    and reading with any orthogonal key returns what it returned before."""
    require_dtype(device, torch.float64)
    _, k, v, beta, _ = operands(b=1, h=2, t=10, d=6, dv=4, device=device, dtype=torch.float64,
                                gated=False)
    state = _state_after(k, v, beta)                              # a memory holding 10 pairs
    key = F.normalize(randn(1, 2, 1, 6, seed=11, device=device, dtype=torch.float64), dim=-1)
    new_value = randn(1, 2, 1, 4, seed=12, device=device, dtype=torch.float64)
    before = state.clone()
    after = _state_after(key, new_value, torch.ones(1, 2, 1, device=device, dtype=torch.float64),
                         state=state)
    read = (key[:, :, 0].unsqueeze(-2) @ after).squeeze(-2)
    torch.testing.assert_close(read, new_value[:, :, 0], rtol=0, atol=1e-12)
    basis = torch.linalg.qr(torch.cat([key[0, :, 0, :, None], randn(
        2, 6, 5, seed=13, device=device, dtype=torch.float64)], -1)).Q[..., 1:]   # ⊥ key
    torch.testing.assert_close(basis.transpose(-2, -1) @ after[0],
                               basis.transpose(-2, -1) @ before[0], rtol=0, atol=1e-12)
    assert not torch.allclose(after, before)


def test_a_gate_of_one_is_no_gate_and_a_gate_decays_the_memory(device):
    q, k, v, beta, _ = operands(t=21, device=device, gated=False)
    for form in DELTA_FORMS:
        ungated = delta_rule(q, k, v, beta, form=form, chunk_size=8)
        ones = delta_rule(q, k, v, beta, gate=torch.ones_like(beta), form=form, chunk_size=8)
        assert_close(ones, ungated, 1e-6)
    # with β = 0 after the first token, the gate alone scales what the first token wrote
    beta0 = torch.zeros_like(beta)
    beta0[:, :, 0] = 1.0
    gate = torch.full_like(beta, 0.5)
    out = delta_rule(k, k, v, beta0, gate=gate, chunk_size=8)
    first = delta_rule(k, k, v, beta0, chunk_size=8)
    powers = 0.5 ** torch.arange(21, device=device, dtype=torch.float32)
    assert_close(out, first * powers[:, None], 1e-5)


# ---------------------------------------------------------------- gradients

@pytest.mark.parametrize("gated", [False, True], ids=["deltanet", "gated"])
def test_gradients_through_the_chunked_form_equal_the_recurrent_forms(device, gated,
                                                                       require_dtype):
    require_dtype(device, torch.float64)
    tensors = operands(t=19, device=device, dtype=torch.float64, gated=gated)
    upstream = randn(2, 3, 19, 5, seed=9, device=device, dtype=torch.float64)
    grads = {}
    for form in DELTA_FORMS:
        leaves = [None if x is None else x.clone().requires_grad_() for x in tensors]
        q, k, v, beta, gate = leaves
        out = delta_rule(q, k, v, beta, gate=gate, form=form, chunk_size=6)
        (out * upstream).sum().backward()
        grads[form] = [x.grad for x in leaves if x is not None]
    for got, expected in zip(grads["chunked"], grads["recurrent"]):
        assert got is not None and got.abs().max() > 0
        assert_close(got, expected, 1e-10)


def test_gradcheck_of_the_gated_chunked_form(require_dtype):
    q, k, v, beta, gate = operands(b=1, h=1, t=7, d=3, dv=2, dtype=torch.float64)
    inputs = tuple(x.requires_grad_() for x in (q, k, v, beta, gate))
    assert torch.autograd.gradcheck(
        lambda q, k, v, b, g: delta_rule(q, k, v, b, gate=g, chunk_size=3), inputs)


# ---------------------------------------------------------------- bad input

def test_beta_and_gate_outside_their_ranges_are_refused_naming_the_values():
    q, k, v, beta, gate = operands(t=4)
    cases = [(dict(beta=beta + 1), r"beta must lie in \[0, 1\]; got values from 1\.\d+ to"),
             (dict(beta=beta - 1), r"beta must lie in \[0, 1\]; got values from -0\.\d+"),
             (dict(beta=beta.masked_fill(beta > 0.5, float("nan"))), r"beta must lie in \[0, 1\]"),
             (dict(gate=gate * 0), r"gate must lie in \(0, 1\]; got values from 0 to 0"),
             (dict(gate=gate + 1), r"gate must lie in \(0, 1\]; got values from 1\.\d+")]
    for change, message in cases:
        kwargs = dict(beta=beta, gate=gate) | change
        with pytest.raises(ValueError, match=message):
            delta_rule(q, k, v, kwargs["beta"], gate=kwargs["gate"])
        with pytest.raises(ValueError, match=message):
            delta_rule_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], kwargs["beta"][:, :, :1],
                            gate_t=kwargs["gate"][:, :, :1])


@pytest.mark.parametrize("kwargs, message", [
    (dict(form="quadratic"), "unknown form 'quadratic'; expected one of chunked, recurrent"),
    (dict(chunk_size=0), "chunk_size must be a positive int, got 0"),
    (dict(chunk_size=True), "chunk_size must be a positive int, got True"),
    (dict(beta=torch.rand(2, 3, 5)), r"beta must be a tensor of shape \(B, H, T\) = "
                                     r"\(2, 3, 4\), got \(2, 3, 5\)"),
    (dict(beta=0.5), r"beta must be a tensor of shape \(B, H, T\) = \(2, 3, 4\), got float"),
    (dict(gate=torch.rand(2, 3, 4, 1)), r"gate must be a tensor of shape \(B, H, T\) = "
                                        r"\(2, 3, 4\), got \(2, 3, 4, 1\)"),
    (dict(k=torch.randn(2, 3, 5, 8), v=torch.randn(2, 3, 5, 5)),
     r"the delta rule is self-attention: q \(2, 3, 4, 8\) and k \(2, 3, 5, 8\)"),
    (dict(v=torch.randn(2, 3, 5, 5)), r"must agree on \(B, Hkv, Tk\)"),
    (dict(k=torch.randn(2, 3, 4, 8, dtype=torch.float64)), "one floating dtype"),
])
def test_bad_shapes_and_options_raise_value_error(kwargs, message):
    q, k, v, beta, _ = operands(t=4)
    args = dict(q=q, k=k, v=v, beta=beta)
    args |= {n: x for n, x in kwargs.items() if n in args}
    options = {n: x for n, x in kwargs.items() if n not in args}
    with pytest.raises(ValueError, match=message):
        delta_rule(args["q"], args["k"], args["v"], args["beta"], **options)


def test_bad_steps_raise_value_error():
    q, k, v, beta, _ = operands(t=3)
    with pytest.raises(ValueError, match=r"a step takes one token: .* got q_t \(2, 3, 3, 8\)"):
        delta_rule_step(q, k, v, beta)
    with pytest.raises(ValueError, match=r"state \(2, 3, 5, 8\) does not fit .* expected "
                                         r"\(2, 3, 8, 5\)"):
        delta_rule_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], beta[:, :, :1],
                        torch.zeros(2, 3, 5, 8))


# ---------------------------------------------------------------- DeltaNet's short convolution

def taps_written_out(conv: ShortConvolution, x):
    """out[b, t, c] = Σ_i w[c, i] x[b, t - K + 1 + i, c] (+ bias), zero before position 0, then
    SiLU: float64, one tap at a time."""
    w = conv.conv.weight.double()[:, 0]                                  # (C, K)
    x = x.double()
    kernel, (b, t, c) = w.shape[-1], x.shape
    out = torch.zeros(b, t, c, dtype=torch.float64, device=x.device)
    for n in range(t):
        for i in range(kernel):
            source = n - kernel + 1 + i
            if source >= 0:
                out[:, n] += w[:, i] * x[:, source]
    if conv.conv.bias is not None:
        out += conv.conv.bias.double()
    return F.silu(out) if conv.activation == "silu" else out


@pytest.mark.parametrize("kernel, bias, activation", [(4, False, "silu"), (1, False, "silu"),
                                                      (3, True, None), (6, False, None)])
def test_short_convolution_equals_its_taps_written_out(device, kernel, bias, activation):
    torch.manual_seed(0)
    conv = ShortConvolution(5, kernel, bias=bias, activation=activation).to(device)
    if bias:
        with torch.no_grad():
            conv.conv.bias.normal_()
    x = randn(2, 9, 5, seed=1, device=device)
    assert_close(conv(x), taps_written_out(conv, x))
    # and PyTorch's own causal form: a conv1d padded by K - 1 on both sides, its last K - 1
    # outputs (those that read past the end) dropped
    padded = F.conv1d(x.transpose(1, 2), conv.conv.weight, conv.conv.bias, padding=kernel - 1,
                      groups=5)[..., :9].transpose(1, 2)
    assert_close(conv(x), F.silu(padded) if activation == "silu" else padded)


@pytest.mark.parametrize("kernel", [1, 2, 4])
def test_short_convolution_is_causal_and_reaches_exactly_k_tokens(kernel):
    """The gradient of output t reaches inputs t - K + 1 .. t of its own channel, and nothing
    else: no later token, no earlier one, no other channel."""
    conv = ShortConvolution(3, kernel).double()
    x = torch.randn(1, 10, 3, dtype=torch.float64, requires_grad=True)
    for t in range(10):
        for c in range(3):
            (grad,) = torch.autograd.grad(conv(x)[0, t, c], x)
            reached = {(int(s), int(ch)) for s, ch in grad[0].nonzero()}
            assert reached == {(s, c) for s in range(max(0, t - kernel + 1), t + 1)}, (t, c)


def test_short_convolution_is_deltanets_depthwise_kernel_of_four_without_bias():
    conv = ShortConvolution(32)
    assert conv.conv.weight.shape == (32, 1, 4) and conv.conv.bias is None
    assert sum(p.numel() for p in conv.parameters()) == 32 * 4


@pytest.mark.parametrize("kwargs, x, message", [
    (dict(channels=4, kernel_size=0), None, "kernel_size must be a positive int, got 0"),
    (dict(channels=4, activation="relu"), None, "activation must be 'silu' or None"),
    (dict(channels=4), torch.randn(2, 5, 3), r"x must be \(B, T, C=4\), got \(2, 5, 3\)"),
    (dict(channels=4), torch.randn(5, 4), r"x must be \(B, T, C=4\), got \(5, 4\)"),
])
def test_short_convolution_refuses_bad_input_by_name(kwargs, x, message):
    with pytest.raises(ValueError, match=message):
        ShortConvolution(**kwargs)(x)
