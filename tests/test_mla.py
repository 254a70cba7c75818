"""mla.py: multi-head latent attention. Its cache holds only the latent and the shared RoPE
key; its output equals the same computation written out with PyTorch, the absorbed form equals
the uncompressed one, and decoding through the cache equals the full causal forward."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import course_attn
from course_attn.backends import BACKENDS
from course_attn.kv_cache import KVCache
from course_attn.mla import MultiHeadLatentAttention
from course_attn.multihead import MultiHeadAttention
from course_attn.rope import apply_rotary_emb

BACKEND_NAMES = sorted(BACKENDS)
# (rtol, atol) of a module's output in this dtype (outputs are O(1) or less).
TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5),
       torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
seeds = st.integers(0, 2 ** 31 - 1)


def randn(*shape, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)


def make(d_model=32, n_heads=4, *, latent_dim=12, seed=0, device="cpu", dtype=torch.float32,
         **options):
    torch.manual_seed(seed)
    mla = MultiHeadLatentAttention(d_model, n_heads, latent_dim=latent_dim, **options)
    with torch.no_grad():                  # gains that are not all ones, so the norm shows
        mla.kv_norm.weight.uniform_(0.5, 2.0)
    return mla.to(device, dtype)


def close(actual, expected, dtype=torch.float32):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=rtol, atol=atol)


def written_out(mla: MultiHeadLatentAttention, x, positions=None):
    """MLA without the module: rebuild every head's k and v from the latent, then PyTorch's
    causal SDPA on full heads of D + Dr channels."""
    b, t, _ = x.shape
    h, d, dr = mla.n_heads, mla.head_dim, mla.rope_dim
    positions = torch.arange(t, device=x.device) if positions is None else positions
    c = mla.kv_norm(x @ mla.kv_down.weight.T)                                # (B, T, Dc)
    cos, sin = mla.rotary(positions)
    k_rope = apply_rotary_emb((x @ mla.k_rope_proj.weight.T)[:, None], cos, sin)  # (B, 1, T, Dr)
    q = (x @ mla.q_proj.weight.T).view(b, t, h, d + dr).transpose(1, 2)      # (B, H, T, D+Dr)
    q = torch.cat([q[..., :d], apply_rotary_emb(q[..., d:], cos, sin)], dim=-1)
    k_nope = (c @ mla.k_up.weight.T).view(b, t, h, d).transpose(1, 2)       # (B, H, T, D)
    k = torch.cat([k_nope, k_rope.expand(b, h, t, dr)], dim=-1)
    v = (c @ mla.v_up.weight.T).view(b, t, h, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)           # scale 1/sqrt(D+Dr)
    return out.transpose(1, 2).reshape(b, t, h * d) @ mla.out_proj.weight.T


def decode(mla, x, chunks, *, absorb, cache=None):
    """Feed x (B, T, C) through a fresh cache, ``chunks`` tokens per call -> (B, T, C)."""
    cache = mla.new_cache(x.shape[0], x.shape[1]) if cache is None else cache
    outs, start = [], 0
    for n in chunks:
        outs.append(mla(x[:, start:start + n], cache=cache, absorb=absorb))
        start += n
    assert start == x.shape[1] and len(cache) == x.shape[1]
    return torch.cat(outs, dim=1), cache


# ---------------------------------------------------------------- the cache

def test_exported_from_the_package():
    assert course_attn.MultiHeadLatentAttention is MultiHeadLatentAttention


@pytest.mark.parametrize("absorb", [False, True])
def test_the_cache_holds_only_the_latent_and_the_rope_key(device, absorb):
    mla = make(32, 4, latent_dim=12, rope_dim=6, device=device)
    cache = mla.new_cache(2, 9)
    assert isinstance(cache, KVCache) and cache.n_kv_heads == 1
    assert cache.k.shape == (2, 1, 9, 12) and cache.v.shape == (2, 1, 9, 6)
    assert cache.k.device.type == device.type and cache.dtype == torch.float32
    x = randn(2, 7, 32, device=device)
    with torch.no_grad():
        mla(x[:, :4], cache=cache, absorb=absorb)
        mla(x[:, 4:], cache=cache, absorb=absorb)
        latent = mla.kv_norm(mla.kv_down(x))                                      # (B, T, Dc)
        cos, sin = mla.rotary(torch.arange(7, device=device))
        k_rope = apply_rotary_emb(mla.k_rope_proj(x)[:, None], cos, sin)          # (B, 1, T, Dr)
    assert len(cache) == 7
    close(cache.k[:, :, :7], latent[:, None])
    close(cache.v[:, :, :7], k_rope)
    assert not cache.k[:, :, 7:].any() and not cache.v[:, :, 7:].any()
    assert cache.nbytes == 2 * 9 * (12 + 6) * 4          # B · S · (Dc + Dr) · bytes


@given(h=st.integers(1, 8), d=st.integers(1, 16), dc=st.integers(1, 64),
       dr=st.integers(1, 8).map(lambda n: 2 * n), s=st.integers(1, 64))
def test_the_cache_is_dc_plus_dr_numbers_a_token_against_mhas_two_h_d(h, d, dc, dr, s):
    mla = MultiHeadLatentAttention(h * d, h, latent_dim=dc, rope_dim=dr)
    mha = MultiHeadAttention(h * d, h)
    per_token = mla.new_cache(1, s).nbytes / s / 4
    assert per_token == dc + dr
    assert mha.new_cache(1, s).nbytes * (dc + dr) == mla.new_cache(1, s).nbytes * 2 * h * d


def test_new_cache_follows_the_weights_unless_told(device, require_dtype):
    require_dtype(device, torch.float64)
    mla = make(device=device, dtype=torch.float64)
    assert mla.new_cache(1, 4).dtype == torch.float64
    assert mla.new_cache(1, 4).device.type == device.type
    assert mla.new_cache(1, 4, dtype=torch.float32, device="cpu").dtype == torch.float32


# ---------------------------------------------------------------- the output

@given(t=st.integers(1, 12), h=st.integers(1, 4), d=st.sampled_from([2, 4, 8]),
       dc=st.integers(1, 24), dr=st.sampled_from([2, 4, 8]), start=st.integers(0, 50),
       backend=st.sampled_from(BACKEND_NAMES), seed=seeds)
def test_uncompressed_and_absorbed_equal_the_computation_written_out(device, t, h, d, dc, dr,
                                                                     start, backend, seed):
    mla = make(16, h, latent_dim=dc, head_dim=d, rope_dim=dr, backend=backend, seed=seed,
               device=device)
    x = randn(2, t, 16, seed=seed, device=device)
    positions = torch.arange(start, start + t, device=device)
    with torch.no_grad():
        expected = written_out(mla, x, positions)
        close(mla(x, positions=positions), expected)
        close(mla(x, positions=positions, absorb=True), expected)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_absorbed_equals_uncompressed_in_float64(device, require_dtype, backend):
    require_dtype(device, torch.float64)
    mla = make(48, 6, latent_dim=20, rope_dim=8, backend=backend, device=device,
               dtype=torch.float64)
    x = randn(3, 17, 48, device=device, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(mla(x, absorb=True), mla(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("absorb", [False, True])
def test_half_precision_against_float64(device, require_dtype, dtype, absorb):
    require_dtype(device, dtype)
    mla = make(32, 4, latent_dim=16, rope_dim=4, device=device, dtype=dtype)
    x = randn(2, 11, 32, device=device, dtype=dtype)
    reference = make(32, 4, latent_dim=16, rope_dim=4, device="cpu", dtype=torch.float64)
    reference.load_state_dict(mla.state_dict())
    with torch.no_grad():
        out = mla(x, absorb=absorb)
        assert out.dtype == dtype
        close(out, reference(x.cpu().double()), dtype)


@given(t=st.integers(1, 9), shift=st.integers(1, 3000), seed=seeds)
def test_only_relative_positions_matter(device, t, shift, seed):
    mla = make(16, 2, latent_dim=8, rope_dim=4, seed=seed, device=device)
    x = randn(1, t, 16, seed=seed, device=device)
    shifted = torch.arange(shift, shift + t, device=device)
    with torch.no_grad():
        torch.testing.assert_close(mla(x, positions=shifted), mla(x), rtol=1e-4, atol=1e-5)


def test_is_causal_and_the_rope_key_carries_position(device):
    mla = make(16, 2, latent_dim=8, rope_dim=4, device=device)
    x = randn(2, 8, 16, device=device)
    changed = x.clone()
    changed[:, 5] += 1.0
    with torch.no_grad():
        before, after = mla(x), mla(changed)
        torch.testing.assert_close(before[:, :5], after[:, :5], rtol=0, atol=0)
        assert not torch.allclose(before[:, 5:], after[:, 5:])
        # Positions change the output through RoPE (not only their differences: reordered).
        positions = torch.tensor([0, 5, 2, 9, 9, 1, 3, 4], device=device)
        assert not torch.allclose(mla(x, positions=positions), before)


# ---------------------------------------------------------------- decoding through the cache

@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("prompt", [1, 7, 33])
def test_prefill_then_decode_equals_the_full_forward(device, prompt, absorb, backend):
    mla = make(32, 4, latent_dim=12, rope_dim=4, backend=backend, device=device)
    x = randn(2, prompt + 4, 32, seed=prompt, device=device)
    with torch.no_grad():
        full = mla(x)
        out, _ = decode(mla, x, [prompt, 1, 1, 1, 1], absorb=absorb)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)


@given(chunks=st.lists(st.integers(1, 6), min_size=1, max_size=6), absorb=st.booleans(),
       backend=st.sampled_from(BACKEND_NAMES), seed=seeds)
def test_any_chunking_equals_the_full_forward(device, chunks, absorb, backend, seed):
    mla = make(16, 2, latent_dim=6, rope_dim=2, backend=backend, seed=seed, device=device)
    x = randn(2, sum(chunks), 16, seed=seed, device=device)
    with torch.no_grad():
        full = mla(x)
        out, cache = decode(mla, x, chunks, absorb=absorb)
        one_shot, one_cache = decode(mla, x, [sum(chunks)], absorb=absorb)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, one_shot, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.k, one_cache.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v, one_cache.v, rtol=1e-5, atol=1e-5)


def test_absorbed_and_uncompressed_share_one_cache(device):
    """The cache is the same whichever form wrote it: decode with one, then the other."""
    mla = make(32, 4, latent_dim=12, rope_dim=4, device=device)
    x = randn(1, 10, 32, device=device)
    with torch.no_grad():
        full = mla(x)
        cache = mla.new_cache(1, 10)
        parts = [mla(x[:, :6], cache=cache, absorb=True)]
        parts += [mla(x[:, i:i + 1], cache=cache, absorb=i % 2 == 0) for i in range(6, 10)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_overflow_through_the_module_changes_nothing(device):
    mla = make(device=device)
    cache = mla.new_cache(1, 5)
    x = randn(1, 4, 32, device=device)
    with torch.no_grad():
        mla(x, cache=cache)
        k, v = cache.k.clone(), cache.v.clone()
        with pytest.raises(ValueError, match="holds 4 of max_seq_len=5 positions; 2 more would "
                                             "need 6"):
            mla(x[:, :2], cache=cache)
    assert len(cache) == 4 and torch.equal(cache.k, k) and torch.equal(cache.v, v)


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("kwargs, message", [
    (dict(rope_dim=3), "rope_dim rotates pairs of channels and must be even, got 3"),
    (dict(rope_dim=0), "rope_dim must be a positive int, got 0"),
    (dict(latent_dim=0), "latent_dim must be a positive int, got 0"),
    (dict(head_dim=2.0), "head_dim must be a positive int, got 2.0"),
    (dict(n_heads=True), "n_heads must be a positive int, got True"),
    (dict(backend="nope"), "unknown attention backend 'nope'"),
])
def test_invalid_configurations(kwargs, message):
    args = dict(d_model=32, n_heads=4, latent_dim=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        MultiHeadLatentAttention(args.pop("d_model"), args.pop("n_heads"), **args)


def test_invalid_calls(device):
    mla = make(32, 4, latent_dim=12, rope_dim=4, device=device)
    x = randn(2, 3, 32, device=device)
    with pytest.raises(ValueError, match=r"x must be \(B, T, C=32\), got \(2, 3, 16\)"):
        mla(randn(2, 3, 16, device=device))
    with pytest.raises(ValueError, match=r"x must be \(B, T, C=32\), got list"):
        mla([[0.0]])
    wrong = "cache must come from this module's new_cache"
    for cache in (MultiHeadAttention(32, 4).new_cache(2, 8),           # an MHA's cache
                  make(32, 4, latent_dim=10, rope_dim=4).new_cache(2, 8),
                  make(32, 4, latent_dim=12, rope_dim=6).new_cache(2, 8),
                  {"k": None}):
        with pytest.raises(ValueError, match=wrong):
            mla(x, cache=cache)
    with pytest.raises(ValueError, match=r"must have shape \(B=1"):    # batch of another size
        mla(x, cache=mla.new_cache(1, 8))
    with pytest.raises(ValueError, match="the cache holds torch.float64"):
        mla(x, cache=mla.new_cache(2, 8, dtype=torch.float64))


def test_repr_lists_the_sizes():
    text = repr(MultiHeadLatentAttention(32, 4, latent_dim=12, rope_dim=6, backend="sdpa"))
    for part in ("n_heads=4", "head_dim=8", "latent_dim=12", "rope_dim=6", "backend='sdpa'"):
        assert part in text, text
