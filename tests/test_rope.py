"""rope.py: RoPE against its definition, Hugging Face's formula, the complex form, and itself."""

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course_attn import published
from course_attn.rope import (RotaryEmbedding, apply_rotary_emb, rope_frequencies,
                               scaled_rope_frequencies)

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
# (rtol, atol) for a result in this dtype against a float64 reference: a few units of its epsilon.
TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5),
       torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def randn(*shape, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)


def close(actual, expected, dtype=torch.float32):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=rtol, atol=atol)


def rotate(x, positions, *, interleaved=False, base=10000.0):
    """x (..., T, D) rotated by the package, cos/sin from a fresh RotaryEmbedding."""
    rope = RotaryEmbedding(x.shape[-1], max_seq_len=64, base=base).to(x.device)
    cos, sin = rope(positions)
    return apply_rotary_emb(x, cos, sin, interleaved)


half_dims = st.integers(1, 8)           # D = 2 · half_dim
lengths = st.integers(1, 9)
seeds = st.integers(0, 2 ** 31 - 1)


# --- the frequencies and the table of angles -------------------------------------------------

@pytest.mark.parametrize("head_dim, base", [(2, 10000.0), (8, 10000.0), (64, 500000.0), (6, 2)])
def test_frequencies_are_base_to_the_minus_2i_over_d(device, head_dim, base):
    theta = rope_frequencies(head_dim, base, device=device)
    assert theta.shape == (head_dim // 2,) and theta.dtype == torch.float32
    assert theta.device.type == torch.device(device).type
    expected = [base ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    torch.testing.assert_close(theta.cpu(), torch.tensor(expected, dtype=torch.float32))
    assert theta[0] == 1 and (theta.diff() < 0).all()           # fast pairs first


@given(half_dim=half_dims, t=lengths, start=st.integers(0, 3000))
def test_cos_sin_are_those_of_m_theta(device, half_dim, t, start):
    d = 2 * half_dim
    rope = RotaryEmbedding(d, max_seq_len=64).to(device)
    positions = torch.arange(start, start + t, device=device)
    cos, sin = rope(positions)
    assert cos.shape == sin.shape == (t, half_dim) and cos.dtype == sin.dtype == torch.float32
    angles = positions.double()[:, None] * rope_frequencies(d, device=device).double()[None]
    close(cos, angles.cos())
    close(sin, angles.sin())


@given(half_dim=half_dims, t=lengths, offset=st.integers(0, 60))
def test_positions_at_an_offset_equal_slicing_a_longer_sequence(device, half_dim, t, offset):
    """What a KV cache does: the rows for positions offset .. offset+T-1 of the full table."""
    rope = RotaryEmbedding(2 * half_dim, max_seq_len=32).to(device)
    full_cos, full_sin = rope(torch.arange(offset + t, device=device))
    cos, sin = rope(torch.arange(offset, offset + t, device=device))
    torch.testing.assert_close(cos, full_cos[offset:])
    torch.testing.assert_close(sin, full_sin[offset:])


def test_positions_past_the_cache_equal_a_larger_cache(device):
    small = RotaryEmbedding(16, max_seq_len=8).to(device)
    large = RotaryEmbedding(16, max_seq_len=5000).to(device)
    for positions in (torch.arange(20), torch.arange(4990, 5010), torch.tensor([3, 7, 8, 4999, 1])):
        positions = positions.to(device)
        for got, want in zip(small(positions), large(positions)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert small(torch.arange(0, device=device))[0].shape == (0, 8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_casting_the_module_keeps_the_angles_float32(device, require_dtype, dtype):
    """``model.half()`` casts floating buffers: θ in bf16 is off by 1 part in 256, m·θ by radians
    at m in the thousands. The cos/sin table must stay float32 and exact."""
    require_dtype(device, dtype)
    reference = RotaryEmbedding(16, max_seq_len=8).to(device)
    cast = RotaryEmbedding(16, max_seq_len=8).to(device, dtype)
    for positions in (torch.arange(8), torch.arange(3000, 3004)):       # cached, computed
        positions = positions.to(device)
        for got, want in zip(cast(positions), reference(positions)):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


# --- scaled frequencies: stretching the context -------------------------------------------------

@pytest.mark.parametrize("head_dim, base, factor", [(2, 10000.0, 2), (64, 10000.0, 2.0),
                                                    (128, 500000.0, 8.0), (8, 100, 3.7)])
def test_linear_scaling_is_position_interpolation(device, head_dim, base, factor):
    scaled = scaled_rope_frequencies(head_dim, base, kind="linear", factor=factor, device=device)
    assert scaled.shape == (head_dim // 2,) and scaled.dtype == torch.float32
    assert torch.equal(scaled, rope_frequencies(head_dim, base, device=device) / factor)
    # m · (θ / s) = (m / s) · θ: the same as dividing every position by s
    m = torch.arange(0, 5000, 7, dtype=torch.float64, device=device)
    torch.testing.assert_close(m[:, None] * scaled.double(),
                               (m / factor)[:, None] * (rope_frequencies(head_dim, base)
                                                        .double().to(device)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("head_dim, base, factor", [(4, 10000.0, 2), (64, 10000.0, 2.0),
                                                    (128, 500000.0, 8.0), (10, 100, 3.7)])
def test_ntk_scaling_keeps_the_fastest_pair_and_divides_the_slowest(head_dim, base, factor):
    theta = rope_frequencies(head_dim, base).double()
    scaled = scaled_rope_frequencies(head_dim, base, kind="ntk", factor=factor)
    assert scaled.shape == (head_dim // 2,) and scaled.dtype == torch.float32
    assert scaled[0] == 1 == theta[0]
    torch.testing.assert_close(scaled[-1].double(), theta[-1] / factor, rtol=1e-6, atol=0)
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    torch.testing.assert_close(scaled.double(), theta * factor ** (-2 * i / (head_dim - 2)),
                               rtol=1e-6, atol=0)        # divided by s^(2i/(D-2)), 1 .. s


def llama3_reference(theta, factor, low_freq_factor, high_freq_factor, original_max_len):
    # Llama 3.1's rule, written branch by branch as in Meta's and Hugging Face's code
    out = []
    for t in theta.double().tolist():
        wavelength = 2 * math.pi / t
        if wavelength < original_max_len / high_freq_factor:
            out.append(t)
        elif wavelength > original_max_len / low_freq_factor:
            out.append(t / factor)
        else:
            smooth = ((original_max_len / wavelength - low_freq_factor)
                      / (high_freq_factor - low_freq_factor))
            out.append((1 - smooth) * t / factor + smooth * t)
    return torch.tensor(out, dtype=torch.float64)


def test_llama3_scaling_with_llama_31_s_published_settings(device):
    c = published.config("Llama 3.1 8B")
    head_dim = (published.value("Llama 3 8B", "hidden_size")
                // published.value("Llama 3 8B", "num_attention_heads"))
    factor, low, high = (c["rope_scaling.factor"], c["rope_scaling.low_freq_factor"],
                         c["rope_scaling.high_freq_factor"])
    original = c["rope_scaling.original_max_position_embeddings"]
    theta = rope_frequencies(head_dim, c["rope_theta"]).double()
    scaled = scaled_rope_frequencies(head_dim, c["rope_theta"], kind="llama3", factor=factor,
                                     original_max_len=original, low_freq_factor=low,
                                     high_freq_factor=high, device=device)
    assert scaled.shape == (head_dim // 2,) and scaled.dtype == torch.float32
    assert scaled.device.type == torch.device(device).type
    scaled = scaled.cpu().double()
    wavelength = 2 * math.pi / theta
    short, long = wavelength < original / high, wavelength > original / low
    assert short.any() and long.any() and (~short & ~long).any()     # all three kinds of pairs
    torch.testing.assert_close(scaled[short], theta[short], rtol=1e-7, atol=0)       # kept
    torch.testing.assert_close(scaled[long], theta[long] / factor, rtol=1e-7, atol=0)  # / 8
    ratio = theta / scaled                       # 1 for the fast pairs, 8 for the slow ones
    assert (ratio.diff() >= -1e-6).all() and (scaled.diff() < 0).all()  # monotone in between
    torch.testing.assert_close(scaled, llama3_reference(theta, factor, low, high, original),
                               rtol=1e-6, atol=0)


@given(half_dim=st.integers(2, 64), factor=st.floats(1, 64),
       original=st.integers(1, 100_000), low=st.floats(0.1, 4), gap=st.floats(0.1, 8))
def test_llama3_scaling_equals_its_definition_and_is_continuous(half_dim, factor, original,
                                                                low, gap):
    theta = rope_frequencies(2 * half_dim, 10000.0)
    scaled = scaled_rope_frequencies(2 * half_dim, kind="llama3", factor=factor,
                                     original_max_len=original, low_freq_factor=low,
                                     high_freq_factor=low + gap).double()
    torch.testing.assert_close(scaled, llama3_reference(theta, factor, low, low + gap, original),
                               rtol=1e-6, atol=0)
    assert ((scaled <= theta.double() * (1 + 1e-6))
            & (scaled >= theta.double() / factor * (1 - 1e-6))).all()  # between θ/s and θ


@pytest.mark.parametrize("kind", ["linear", "ntk", "llama3"])
def test_factor_one_changes_nothing(kind):
    scaled = scaled_rope_frequencies(64, 10000.0, kind=kind, factor=1, original_max_len=32)
    torch.testing.assert_close(scaled, rope_frequencies(64, 10000.0), rtol=1e-6, atol=0)


def test_bad_scaling_arguments():
    with pytest.raises(ValueError, match="kind must be one of"):
        scaled_rope_frequencies(8, kind="yarn", factor=2)
    for factor in (0.5, 0, -2, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match=f"factor must be a finite number >= 1, got "
                                             f"{re.escape(repr(factor))}"):
            scaled_rope_frequencies(8, kind="linear", factor=factor)
    with pytest.raises(ValueError, match="head_dim >= 4, got 2"):
        scaled_rope_frequencies(2, kind="ntk", factor=2)
    with pytest.raises(ValueError, match="original_max_len must be a positive int, got None"):
        scaled_rope_frequencies(8, kind="llama3", factor=2)
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor, got 4 and 1"):
        scaled_rope_frequencies(8, kind="llama3", factor=2, original_max_len=32,
                                low_freq_factor=4, high_freq_factor=1)
    with pytest.raises(ValueError, match="head_dim must be an even int"):
        scaled_rope_frequencies(7, kind="linear", factor=2)
    with pytest.raises(ValueError, match="base must be a number > 1"):
        scaled_rope_frequencies(8, 1.0, kind="linear", factor=2)


# --- the rotation ----------------------------------------------------------------------------

@given(b=st.integers(1, 2), h=st.integers(1, 3), t=lengths, half_dim=half_dims,
       interleaved=st.booleans(), seed=seeds)
def test_rope_preserves_norms_and_position_zero_is_the_identity(device, b, h, t, half_dim,
                                                               interleaved, seed):
    x = randn(b, h, t, 2 * half_dim, seed=seed, device=device, dtype=torch.float64)
    out = rotate(x, torch.arange(t, device=device), interleaved=interleaved)
    assert out.shape == x.shape and out.dtype == x.dtype
    close(out.norm(dim=-1), x.norm(dim=-1), torch.float32)
    close(out[:, :, 0], x[:, :, 0], torch.float32)              # angle 0: nothing moves


@given(half_dim=half_dims, m=st.integers(0, 200), n=st.integers(0, 200), shift=st.integers(0, 2000),
       interleaved=st.booleans(), seed=seeds)
def test_relative_position_property(device, half_dim, m, n, shift, interleaved, seed):
    """<R(m) q, R(n) k> depends on m - n only: shifting both positions changes nothing."""
    d = 2 * half_dim
    q, k = (randn(1, 1, 1, d, seed=seed + i, device=device) for i in range(2))

    def score(m, n):
        rq = rotate(q, torch.tensor([m], device=device), interleaved=interleaved)
        rk = rotate(k, torch.tensor([n], device=device), interleaved=interleaved)
        return (rq * rk).sum()

    torch.testing.assert_close(score(m + shift, n + shift), score(m, n), rtol=1e-4, atol=1e-4)


def test_relative_property_fails_without_the_shift_being_shared(device):
    q, k = randn(1, 1, 1, 8, device=device), randn(1, 1, 1, 8, seed=1, device=device)
    pos = [torch.tensor([p], device=device) for p in (0, 3, 5)]
    s03 = (rotate(q, pos[0]) * rotate(k, pos[1])).sum()
    s05 = (rotate(q, pos[0]) * rotate(k, pos[2])).sum()
    assert not torch.allclose(s03, s05)


def hf_rotate_half(x):
    """Hugging Face transformers' ``rotate_half`` (models/llama/modeling_llama.py)."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, positions, head_dim, base=10000.0):
    """Hugging Face's ``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb``, written out."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).double() / head_dim))
    freqs = positions.double()[:, None] * inv_freq.to(positions.device)[None, :]   # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)                                         # (T, D)
    cos, sin = emb.cos(), emb.sin()
    return q * cos + hf_rotate_half(q) * sin, k * cos + hf_rotate_half(k) * sin


@given(b=st.integers(1, 2), hq=st.integers(1, 4), t=lengths, half_dim=half_dims,
       start=st.integers(0, 100), seed=seeds)
def test_half_split_equals_hugging_face_apply_rotary_pos_emb(device, b, hq, t, half_dim, start,
                                                             seed):
    d = 2 * half_dim
    q = randn(b, hq, t, d, seed=seed, device=device, dtype=torch.float64)
    k = randn(b, 1, t, d, seed=seed + 1, device=device, dtype=torch.float64)
    positions = torch.arange(start, start + t, device=device)
    hf_q, hf_k = hf_apply_rotary_pos_emb(q, k, positions, d)
    close(rotate(q, positions), hf_q)
    close(rotate(k, positions), hf_k)


@given(t=lengths, half_dim=half_dims, start=st.integers(0, 100), seed=seeds)
def test_interleaved_equals_the_complex_form(device, t, half_dim, start, seed):
    """Meta's Llama: view channel pairs (2i, 2i+1) as complex numbers, multiply by e^{i m θ}."""
    d = 2 * half_dim
    x = randn(2, 3, t, d, seed=seed, device=device, dtype=torch.float64)
    positions = torch.arange(start, start + t, device=device)
    angles = positions.double()[:, None] * rope_frequencies(d, device=device).double()[None]
    freqs_cis = torch.polar(torch.ones_like(angles), angles)                   # (T, D/2)
    expected = torch.view_as_real(torch.view_as_complex(x.reshape(2, 3, t, half_dim, 2))
                                  * freqs_cis).flatten(-2)
    close(rotate(x, positions, interleaved=True), expected)


@given(t=lengths, half_dim=half_dims, seed=seeds)
def test_the_two_pairings_agree_up_to_a_permutation_of_d(device, t, half_dim, seed):
    """Interleaved pairs (2i, 2i+1); half-split pairs (i, i + D/2). Moving the even channels to
    the front and the odd ones to the back turns the first pairing into the second."""
    d = 2 * half_dim
    x = randn(1, 2, t, d, seed=seed, device=device, dtype=torch.float64)
    positions = torch.arange(t, device=device) * 7
    perm = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2))).to(device)
    inverse = torch.argsort(perm)
    interleaved = rotate(x, positions, interleaved=True)
    half_split = rotate(x[..., perm], positions, interleaved=False)[..., inverse]
    close(interleaved, half_split)
    if half_dim > 1 and t > 1:                                  # the permutation matters
        assert not torch.allclose(interleaved, rotate(x, positions, interleaved=False))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_half_precision_returns_its_dtype_and_is_rounded_once(device, require_dtype, dtype,
                                                             interleaved):
    require_dtype(device, dtype)
    x = randn(2, 2, 9, 16, device=device, dtype=dtype)
    positions = torch.arange(100, 109, device=device)
    out = rotate(x, positions, interleaved=interleaved)
    assert out.dtype == dtype
    close(out, rotate(x.double(), positions, interleaved=interleaved), dtype)


def test_rope_is_differentiable(device, require_dtype):
    require_dtype(device, torch.float64)
    rope = RotaryEmbedding(6, max_seq_len=4).to(device)
    cos, sin = rope(torch.arange(5, device=device))             # one past the cache too
    x = randn(1, 2, 5, 6, device=device, dtype=torch.float64).requires_grad_()
    for interleaved in (False, True):
        assert torch.autograd.gradcheck(lambda x: apply_rotary_emb(x, cos, sin, interleaved), (x,))


# --- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", [0, 1, 7, 3.0, True, "8"])
def test_bad_head_dim(head_dim):
    with pytest.raises(ValueError, match=f"head_dim must be an even int >= 2, got {head_dim!r}"):
        rope_frequencies(head_dim)
    with pytest.raises(ValueError, match="head_dim must be an even int"):
        RotaryEmbedding(head_dim)


def test_odd_head_dim_of_x():
    with pytest.raises(ValueError, match="got 7"):
        apply_rotary_emb(torch.randn(1, 1, 2, 7), torch.ones(2, 3), torch.zeros(2, 3))


@pytest.mark.parametrize("base", [1, 1.0, 0.5, 0, -10000.0, float("nan"), True, "10000"])
def test_bad_base(base):
    with pytest.raises(ValueError, match="base must be a number > 1"):
        rope_frequencies(8, base)
    with pytest.raises(ValueError, match="base must be a number > 1"):
        RotaryEmbedding(8, base=base)


@pytest.mark.parametrize("max_seq_len", [0, -1, 2.0, True])
def test_bad_max_seq_len(max_seq_len):
    message = f"max_seq_len must be a positive int, got {max_seq_len!r}"
    with pytest.raises(ValueError, match=message):
        RotaryEmbedding(8, max_seq_len=max_seq_len)


def test_bad_positions(device):
    rope = RotaryEmbedding(8, max_seq_len=16).to(device)
    with pytest.raises(ValueError, match=r"integer tensor, got torch.float32"):
        rope(torch.arange(4.0, device=device))
    with pytest.raises(ValueError, match=r"integer tensor, got torch.bool"):
        rope(torch.ones(4, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match=r"of shape \(1, 4\)"):
        rope(torch.arange(4, device=device)[None])
    with pytest.raises(ValueError, match="integer tensor, got list"):
        rope([0, 1, 2])
    with pytest.raises(ValueError, match="must be >= 0, got min -3"):
        rope(torch.tensor([0, -3, 2], device=device))
    with pytest.raises(ValueError, match="must be >= 0, got min -1"):
        rope(torch.tensor([100, -1], device=device))           # past the cache too


def test_cos_sin_shape_mismatch(device):
    x = torch.randn(1, 2, 3, 8, device=device)
    cos, sin = RotaryEmbedding(8).to(device)(torch.arange(3, device=device))
    with pytest.raises(ValueError, match=r"D/2 = 4 and broadcast to x of shape \(1, 2, 3, 8\)"):
        apply_rotary_emb(x, cos[:, :3], sin[:, :3])             # cos/sin of another head_dim
    with pytest.raises(ValueError, match=r"cos \(3, 4\) and sin \(3, 3\)"):
        apply_rotary_emb(x, cos, sin[:, :3])
    with pytest.raises(ValueError, match="x must be a tensor"):
        apply_rotary_emb(torch.randn(8), cos, sin)
    with pytest.raises(ValueError, match="x must be a tensor"):
        apply_rotary_emb([1.0, 2.0], cos, sin)


def test_repr_names_the_sizes():
    assert (repr(RotaryEmbedding(8, 16, 500.0))
            == "RotaryEmbedding(head_dim=8, max_seq_len=16, base=500)")
    assert math.isclose(RotaryEmbedding(8, 16, 500).base, 500.0)


def test_cos_sin_that_do_not_broadcast_to_x(device):
    x = torch.randn(1, 2, 3, 8, device=device)
    cos, sin = RotaryEmbedding(8).to(device)(torch.arange(4, device=device))
    with pytest.raises(ValueError, match=r"cos \(4, 4\) and sin \(4, 4\).*\(1, 2, 3, 8\)"):
        apply_rotary_emb(x, cos, sin)                           # T = 4 positions for T = 3
    with pytest.raises(ValueError, match=r"cos \(2, 1, 1, 3, 4\)"):
        apply_rotary_emb(x, cos[:3].expand(2, 1, 1, 3, 4), sin[:3].expand(2, 1, 1, 3, 4))
    with pytest.raises(ValueError, match="cos and sin must be tensors, got list"):
        apply_rotary_emb(x, [1.0] * 4, sin[:3])
    # What does broadcast is fine: per-batch positions (B, 1, T, D/2), as a KV cache may pass.
    per_batch = cos[:3].expand(1, 1, 3, 4), sin[:3].expand(1, 1, 3, 4)
    torch.testing.assert_close(apply_rotary_emb(x, *per_batch),
                               apply_rotary_emb(x, cos[:3], sin[:3]))


def test_a_rotary_embedding_builds_on_the_meta_device_for_its_shapes():
    """A model sized without memory (``with torch.device("meta")``, as chapter 8 sizes Llama 3
    8B) builds its RoPE table: shapes, no values, and no copy to the CPU."""
    with torch.device("meta"):
        rope = RotaryEmbedding(64, max_seq_len=8192)
    assert rope.cos_cached.is_meta and rope.sin_cached.is_meta
    assert rope.cos_cached.shape == rope.sin_cached.shape == (8192, 32)
