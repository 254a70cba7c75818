"""linear.py: the three causal forms and the two non-causal ones give one answer, which is the
formula's (computed here in float64 from its definition); decoding token by token gives it
too; the feature maps are what they claim; nothing divides by zero; bad options are refused."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from course_attn.linear import (
    FEATURE_MAPS, FORMS, LinearAttentionState, PerformerFeatures, elu_features,
    feature_map_fn, linear_attention, linear_attention_state, linear_attention_step,
    relu_features,
)

seeds = st.integers(0, 2 ** 31 - 1)


def randn(*shape, seed=0, device="cpu", dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(device, dtype)


def qkv(b=2, h=3, t=37, d=8, dv=5, *, seed=0, device="cpu", dtype=torch.float32, scale=1.0):
    return tuple(randn(b, h, t, n, seed=seed + i, device=device, dtype=dtype, scale=scale)
                 for i, n in enumerate((d, d, dv)))


def reference(q, k, v, causal, feature_map="elu"):
    """out_i = Σ_j w_ij v_j / Σ_j w_ij with w_ij = φ(q_i)·φ(k_j), j <= i if causal: float64,
    written from the definition, one query at a time."""
    phi = feature_map_fn(feature_map, q.shape[-1])
    fq, fk, v = phi(q.double()), phi(k.double()), v.double()
    outs = []
    for i in range(q.shape[2]):
        keys = slice(0, i + 1) if causal else slice(None)
        w = torch.einsum("bhd,bhjd->bhj", fq[:, :, i], fk[:, :, keys])
        total = w.sum(-1, keepdim=True)
        outs.append(torch.einsum("bhj,bhjd->bhd", w, v[:, :, keys])
                    / torch.where(total > 0, total, torch.ones_like(total)))
    return torch.stack(outs, dim=2)


def assert_close(actual, expected, rtol=1e-5):
    """Equal up to ``rtol`` times the size of the expected values (its largest magnitude)."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    error = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert actual.shape == expected.shape
    assert error <= rtol * max(scale, 1e-30), f"max error {error:.3g} at scale {scale:.3g}"


# ---------------------------------------------------------------- the forms agree

# (T, chunk_size): not a multiple of the chunk, a multiple, one token, a chunk longer than T,
# chunks of one token.
LENGTHS = [(37, 8), (32, 16), (1, 64), (20, 64), (9, 1), (64, 64)]


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
@pytest.mark.parametrize("t, chunk", LENGTHS, ids=[f"T{t}-C{c}" for t, c in LENGTHS])
def test_the_three_causal_forms_agree_with_the_definition(device, feature_map, t, chunk):
    q, k, v = qkv(t=t, device=device, scale=0.5)
    expected = reference(q, k, v, causal=True, feature_map=feature_map)
    outs = {form: linear_attention(q, k, v, causal=True, feature_map=feature_map, form=form,
                                   chunk_size=chunk) for form in FORMS}
    for form, out in outs.items():
        assert out.dtype == torch.float32 and out.device.type == device.type
        assert_close(out, expected)
        assert_close(out, outs["quadratic"])


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
@pytest.mark.parametrize("t, chunk", LENGTHS, ids=[f"T{t}-C{c}" for t, c in LENGTHS])
def test_non_causal_linear_form_equals_its_quadratic_form(device, feature_map, t, chunk):
    q, k, v = qkv(t=t, device=device, scale=0.5)
    expected = reference(q, k, v, causal=False, feature_map=feature_map)
    quadratic = linear_attention(q, k, v, feature_map=feature_map, form="quadratic")
    assert_close(quadratic, expected)
    for form in ("chunked", "recurrent"):
        out = linear_attention(q, k, v, feature_map=feature_map, form=form, chunk_size=chunk)
        assert_close(out, quadratic)


def test_non_causal_is_the_default_and_every_query_sees_every_key(device):
    q, k, v = qkv(t=12, device=device)
    out = linear_attention(q, k, v)
    assert_close(out, linear_attention(q, k, v, causal=False, feature_map="elu", form="chunked"))
    # The last query sees every key either way; the first one only itself when causal.
    causal = linear_attention(q, k, v, causal=True)
    assert_close(causal[:, :, -1], out[:, :, -1])
    assert_close(causal[:, :, 0], v[:, :, 0])


def test_the_chunk_size_changes_nothing(device):
    q, k, v = qkv(t=50, device=device)
    expected = linear_attention(q, k, v, causal=True, form="quadratic")
    for chunk in (1, 2, 3, 7, 49, 50, 51, 1000):
        assert_close(linear_attention(q, k, v, causal=True, chunk_size=chunk), expected)


def test_empty_sequence_gives_an_empty_result(device):
    q, k, v = qkv(t=0, device=device)
    for causal in (False, True):
        for form in FORMS:
            out = linear_attention(q, k, v, causal=causal, form=form)
            assert out.shape == (2, 3, 0, 5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_as_accurate_as_the_quadratic_form(device, dtype):
    """Computed in float32 and rounded once: the chunked form's error against float64 is no
    worse than the quadratic form's in the same dtype, and about the dtype's rounding."""
    q, k, v = qkv(t=40, device=device, dtype=dtype, scale=0.5)
    expected = reference(q, k, v, causal=True)
    quadratic = linear_attention(q, k, v, causal=True, form="quadratic")
    chunked = linear_attention(q, k, v, causal=True, chunk_size=16)
    assert chunked.dtype == dtype
    err = (chunked.double() - expected).abs().max().item()
    err_quadratic = (quadratic.double() - expected).abs().max().item()
    ulp = torch.finfo(dtype).eps * expected.abs().max().item()
    assert err <= 2 * err_quadratic + ulp and err <= 2 * ulp


# ---------------------------------------------------------------- decoding

@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_decoding_token_by_token_equals_the_parallel_causal_form(device, feature_map):
    q, k, v = qkv(t=23, device=device, scale=0.5)
    parallel = linear_attention(q, k, v, causal=True, feature_map=feature_map, chunk_size=8)
    state = None
    for t in range(q.shape[2]):
        step = slice(t, t + 1)
        out, state = linear_attention_step(q[:, :, step], k[:, :, step], v[:, :, step], state,
                                           feature_map=feature_map)
        assert out.shape == (2, 3, 1, 5)
        assert_close(out[:, :, 0], parallel[:, :, t])


def test_a_prefilled_state_then_steps_equal_the_parallel_form(device):
    q, k, v = qkv(t=30, device=device)
    parallel = linear_attention(q, k, v, causal=True)
    state = linear_attention_state(k[:, :, :20], v[:, :, :20])
    for t in range(20, 30):
        step = slice(t, t + 1)
        out, state = linear_attention_step(q[:, :, step], k[:, :, step], v[:, :, step], state)
        assert_close(out[:, :, 0], parallel[:, :, t])


def test_the_state_has_one_size_whatever_it_has_read_and_a_step_keeps_the_old_one(device):
    _, k, v = qkv(t=100, device=device)
    short, long = linear_attention_state(k[:, :, :1], v[:, :, :1]), linear_attention_state(k, v)
    assert short.s.shape == long.s.shape == (2, 3, 8, 5)
    assert short.z.shape == long.z.shape == (2, 3, 8)
    empty = linear_attention_state(k[:, :, :0], v[:, :, :0])
    assert not empty.s.any() and not empty.z.any()
    before = long.s.clone(), long.z.clone()
    _, after = linear_attention_step(k[:, :, :1], k[:, :, :1], v[:, :, :1], long)
    assert torch.equal(long.s, before[0]) and torch.equal(long.z, before[1])
    assert isinstance(after, LinearAttentionState) and not torch.equal(after.s, long.s)


def test_the_performer_state_has_num_features_rows(device):
    _, k, v = qkv(t=10, device=device)
    phi = PerformerFeatures(8, num_features=32, seed=3)
    state = linear_attention_state(k, v, feature_map=phi)
    assert state.s.shape == (2, 3, 32, 5) and state.z.shape == (2, 3, 32)


# ---------------------------------------------------------------- the feature maps

def test_elu_features_are_elu_plus_one_and_positive(device):
    x = torch.linspace(-15, 15, 301, device=device)
    features = elu_features(x)
    assert torch.equal(features, F.elu(x) + 1)
    assert (features > 0).all()
    assert (elu_features(torch.tensor([-1e4, float("-inf")], device=device)) >= 0).all()
    assert_close(elu_features(torch.tensor([2.0, -2.0], device=device)),
                 torch.tensor([3.0, math.exp(-2.0)], device=device))


def test_relu_features_are_relu(device):
    x = torch.linspace(-3, 3, 61, device=device)
    assert torch.equal(relu_features(x), x.clamp_min(0))


def test_names_resolve_to_their_maps():
    assert feature_map_fn("elu", 4) is elu_features
    assert feature_map_fn("relu", 4) is relu_features
    performer = feature_map_fn("performer", 4)
    assert isinstance(performer, PerformerFeatures)
    assert (performer.head_dim, performer.num_features, performer.seed) == (4, 256, 0)
    assert feature_map_fn("performer", 4) is performer          # made once per head_dim

    def custom(x):
        return x.exp()

    assert feature_map_fn(custom, 4) is custom


def test_performer_features_are_positive_seeded_and_the_same_for_q_and_k(device):
    x = randn(2, 3, 10, 16, device=device)
    phi = PerformerFeatures(16, num_features=40, seed=7)
    features = phi(x)
    assert features.shape == (2, 3, 10, 40) and (features > 0).all()
    again = PerformerFeatures(16, num_features=40, seed=7)
    assert torch.equal(phi.projection, again.projection)
    assert torch.allclose(again(x), features, rtol=1e-6, atol=0)
    assert not torch.equal(PerformerFeatures(16, num_features=40, seed=8).projection,
                           phi.projection)
    # "performer" by name is PerformerFeatures(D) with seed 0.
    q, k, v = qkv(t=9, d=16, device=device, scale=0.5)
    assert torch.equal(linear_attention(q, k, v, feature_map="performer"),
                       linear_attention(q, k, v, feature_map=PerformerFeatures(16)))


@pytest.mark.parametrize("orthogonal", [True, False])
def test_performer_projection_rows_are_gaussian_and_orthogonal_in_blocks(orthogonal):
    phi = PerformerFeatures(8, num_features=20, seed=1, orthogonal=orthogonal)
    w = phi.projection
    assert w.shape == (20, 8) and w.dtype == torch.float64
    if orthogonal:
        for block in (w[:8], w[8:16], w[16:]):
            gram = block @ block.T
            assert torch.allclose(gram, torch.diag(torch.diagonal(gram)), atol=1e-10)


def test_performer_kernel_is_an_unbiased_estimate_of_the_softmax_kernel():
    """Averaged over many features, φ(q)·φ(k) is exp(q·k / √D)."""
    q, k = randn(30, 8, seed=1, scale=0.4), randn(30, 8, seed=2, scale=0.4)
    phi = PerformerFeatures(8, num_features=2 ** 16, seed=0)
    estimate = phi(q) @ phi(k).T
    exact = torch.exp(q @ k.T / math.sqrt(8))
    assert ((estimate - exact).abs() / exact).max() < 0.03


def test_performer_attention_gets_closer_to_softmax_attention_with_more_features(device):
    """The RMS error against softmax attention, averaged over 8 fixed seeds, falls each time
    the number of features grows 16x (measured: 0.16, 0.060, 0.029, 0.015; slower than 1/√m at
    these sizes, as the features are exponentials and their estimates heavy-tailed)."""
    q, k, v = qkv(b=1, h=2, t=32, d=16, dv=8, device=device, scale=0.6)
    softmax_out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    errors = []
    for m in (4, 64, 1024, 16384):
        rms = [(linear_attention(q, k, v, causal=True,
                                 feature_map=PerformerFeatures(16, num_features=m, seed=s))
                - softmax_out).pow(2).mean().sqrt().item() for s in range(8)]
        errors.append(sum(rms) / len(rms))
    assert all(later < 0.67 * earlier for earlier, later in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.025, errors


def test_orthogonal_features_approximate_better_than_independent_ones():
    q, k, v = qkv(b=1, h=2, t=32, d=16, dv=8, scale=0.6)
    softmax_out = F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def mean_error(orthogonal):
        return sum((linear_attention(q, k, v, causal=True, feature_map=PerformerFeatures(
            16, num_features=256, seed=s, orthogonal=orthogonal)) - softmax_out).pow(2).mean()
            .sqrt().item() for s in range(8)) / 8

    assert mean_error(True) < 0.8 * mean_error(False)


# ---------------------------------------------------------------- the denominator

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_all_zero_relu_features_give_zeros_not_nan_forward_and_backward(device, causal, form):
    q, k, v = qkv(t=10, device=device)
    q = (-q.abs() - 0.1).requires_grad_()             # every query's features are zero
    k = k.clone().requires_grad_()
    v = v.clone().requires_grad_()
    out = linear_attention(q, k, v, causal=causal, feature_map="relu", form=form, chunk_size=4)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_keys_with_all_zero_features_add_nothing_and_break_nothing(device):
    q, k, v = qkv(t=12, device=device)
    q = q.abs() + 0.1
    k = torch.cat([-k[:, :, :5].abs() - 0.1, k[:, :, 5:]], dim=2)   # the first 5 keys are "dead"
    out = linear_attention(q, k, v, causal=True, feature_map="relu", chunk_size=4)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, :, :5], torch.zeros_like(out[:, :, :5]))
    assert_close(out, reference(q, k, v, causal=True, feature_map="relu"))
    out, _ = linear_attention_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], feature_map="relu")
    assert torch.equal(out, torch.zeros_like(out))


# ---------------------------------------------------------------- gradients

@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_gradients_through_chunked_and_recurrent_equal_the_quadratic_forms(device, feature_map):
    q0, k0, v0 = qkv(t=19, device=device, dtype=torch.float64, scale=0.5)
    upstream = randn(2, 3, 19, 5, seed=9, device=device, dtype=torch.float64)
    grads = {}
    for form in FORMS:
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        out = linear_attention(q, k, v, causal=True, feature_map=feature_map, form=form,
                               chunk_size=6)
        (out * upstream).sum().backward()
        grads[form] = (q.grad, k.grad, v.grad)
    for form in ("chunked", "recurrent"):
        for got, expected in zip(grads[form], grads["quadratic"]):
            assert_close(got, expected, rtol=1e-10)


def test_gradcheck_of_the_chunked_form(device):
    q, k, v = (x.requires_grad_() for x in qkv(b=1, h=1, t=7, d=3, dv=2, device=device,
                                                dtype=torch.float64))
    assert torch.autograd.gradcheck(
        lambda q, k, v: linear_attention(q, k, v, causal=True, chunk_size=3), (q, k, v))


# ---------------------------------------------------------------- a sweep of shapes

@given(b=st.integers(1, 2), h=st.integers(1, 3), t=st.integers(1, 40), d=st.integers(1, 8),
       dv=st.integers(1, 8), chunk=st.integers(1, 48), causal=st.booleans(),
       feature_map=st.sampled_from(FEATURE_MAPS), seed=seeds)
def test_every_form_equals_the_definition_over_small_shapes(device, b, h, t, d, dv, chunk,
                                                             causal, feature_map, seed):
    q, k, v = qkv(b, h, t, d, dv, seed=seed, device=device, scale=0.7)
    expected = reference(q, k, v, causal=causal, feature_map=feature_map)
    for form in FORMS:
        out = linear_attention(q, k, v, causal=causal, feature_map=feature_map, form=form,
                               chunk_size=chunk)
        assert out.shape == (b, h, t, dv)
        assert_close(out, expected)


# ---------------------------------------------------------------- bad options

@pytest.mark.parametrize("kwargs, message", [
    (dict(form="parallel"), "unknown form 'parallel'; expected one of quadratic, chunked, "
                            "recurrent"),
    (dict(feature_map="gelu"), "unknown feature_map 'gelu'; expected one of elu, relu, "
                               "performer or a callable"),
    (dict(feature_map=3), "feature_map must be one of elu, relu, performer or a callable, "
                          "got 3"),
    (dict(chunk_size=0), "chunk_size must be a positive int, got 0"),
    (dict(chunk_size=-4), "chunk_size must be a positive int, got -4"),
    (dict(chunk_size=2.0), "chunk_size must be a positive int, got 2.0"),
    (dict(chunk_size=True), "chunk_size must be a positive int, got True"),
    (dict(eps=0), "eps must be a positive number, got 0"),
    (dict(eps=-1e-6), "eps must be a positive number, got -1e-06"),
    (dict(feature_map=lambda x: x.sum(-1)), r"must map \(\.\.\., D\) to \(\.\.\., D'\)"),
])
def test_bad_options_raise_value_error_naming_the_value(kwargs, message):
    q, k, v = qkv(t=4)
    with pytest.raises(ValueError, match=message):
        linear_attention(q, k, v, causal=True, **kwargs)


@pytest.mark.parametrize("shapes, message", [
    (((1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 3)),
     r"linear attention is self-attention: q \(1, 2, 5, 4\) and k \(1, 2, 6, 4\)"),
    (((1, 4, 5, 4), (1, 2, 5, 4), (1, 2, 5, 3)), r"Hq=4 heads but k, v have Hkv=2"),
    (((1, 2, 5, 4), (1, 2, 5, 3), (1, 2, 5, 3)), "head dim mismatch"),
    (((1, 2, 5, 4), (1, 2, 5, 4), (1, 2, 4, 3)), r"must agree on \(B, Hkv, Tk\)"),
    (((2, 5, 4), (2, 5, 4), (2, 5, 3)), "rank 4"),
])
def test_shapes_that_do_not_fit_raise_value_error(shapes, message):
    q, k, v = (torch.randn(*shape) for shape in shapes)
    with pytest.raises(ValueError, match=message):
        linear_attention(q, k, v)


def test_mixed_dtypes_raise_value_error():
    q, k, v = qkv(t=4)
    with pytest.raises(ValueError, match="one floating dtype"):
        linear_attention(q, k.double(), v)


def test_bad_steps_and_feature_maps_raise_value_error():
    q, k, v = qkv(t=3)
    with pytest.raises(ValueError, match=r"a step takes one token: .* got q_t \(2, 3, 3, 8\)"):
        linear_attention_step(q, k, v)
    state = linear_attention_state(k, v)
    with pytest.raises(ValueError, match=r"state s \(2, 3, 8, 5\), z \(2, 3, 8\) does not fit"):
        linear_attention_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], state,
                              feature_map=PerformerFeatures(8, num_features=16))
    with pytest.raises(ValueError, match="eps must be a positive number, got 0"):
        linear_attention_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], eps=0)
    with pytest.raises(ValueError, match=r"PerformerFeatures\(head_dim=4\) got x \(2, 3, 3, 8\)"):
        linear_attention(q, k, v, feature_map=PerformerFeatures(4))
    for kwargs, message in ((dict(head_dim=0), "head_dim must be a positive int, got 0"),
                            (dict(head_dim=4, num_features=0),
                             "num_features must be a positive int, got 0")):
        with pytest.raises(ValueError, match=message):
            PerformerFeatures(**kwargs)
