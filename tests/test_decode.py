"""Decoding through a KV cache: MultiHeadAttention(cache=...), GPT(caches=...) and
generate(use_cache=..., prefill_chunk=...) give what the full causal forward gives.

Also grouped-query attention against multi-head attention on repeated K/V and against PyTorch's
SDPA with enable_gqa, the size of a GQA cache, and the sdpa backend's one-query decode path."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import course_attn.sdpa as sdpa
from course_attn.attention import repeat_kv
from course_attn.backends import BACKENDS, get_backend
from course_attn.kv_cache import KVCache
from course_attn.model import generate
from course_attn.multihead import MultiHeadAttention

from helpers import gpt, randn

BACKEND_NAMES = sorted(BACKENDS)
# (rtol, atol) of one computation against the same in another order, in this dtype.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3),
       torch.bfloat16: (3e-2, 3e-2)}
seeds = st.integers(0, 2 ** 31 - 1)


def make(d_model=32, n_heads=4, *, seed=0, device="cpu", dtype=torch.float32, **options):
    torch.manual_seed(seed)
    mha = MultiHeadAttention(d_model, n_heads, **options)
    with torch.no_grad():                  # QK-norm gains that are not all ones, so they show
        for norm in (mha.q_norm, mha.k_norm):
            if norm is not None:
                norm.weight.uniform_(0.5, 2.0)
    return mha.to(device, dtype).eval()


def decode(mha, x, chunks, *, cache=None, **kwargs):
    """Feed x (B, T, C) through a cache, ``chunks`` tokens per call -> (B, T, C) and the cache."""
    cache = mha.new_cache(x.shape[0], x.shape[1]) if cache is None else cache
    outs, start = [], 0
    for n in chunks:
        outs.append(mha(x[:, start:start + n], cache=cache, **kwargs))
        start += n
    assert start == x.shape[1] and len(cache) == x.shape[1]
    return torch.cat(outs, dim=1), cache


OPTIONS = {
    "mha": dict(),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "rope": dict(rope=True, max_seq_len=16),                      # decoding runs past the table
    "rope+gqa+qk_norm": dict(rope=True, n_kv_heads=2, qk_norm=True),
    "rope+qk_norm_after+interleaved": dict(rope=True, qk_norm=True, qk_norm_order="after_rope",
                                           rope_interleaved=True),
    "window": dict(window=5),
    "rope+mqa+window+bias": dict(rope=True, n_kv_heads=1, window=3, bias=True),
}


# ---------------------------------------------------------------- MultiHeadAttention

@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
@pytest.mark.parametrize("prompt", [1, 7, 33])
def test_prefill_then_decode_equals_the_full_forward(device, prompt, options, backend):
    mha = make(32, 4, backend=backend, device=device, **options)
    x = randn(2, prompt + 5, 32, seed=prompt, device=device)
    with torch.no_grad():
        full = mha(x)
        out, cache = decode(mha, x, [prompt] + [1] * 5)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    assert cache.k.shape == (2, mha.n_kv_heads, prompt + 5, 8)


@given(chunks=st.lists(st.integers(1, 7), min_size=1, max_size=6), h=st.sampled_from([1, 2, 4]),
       group=st.sampled_from([1, 2, 4]), rope=st.booleans(), qk_norm=st.booleans(),
       window=st.none() | st.integers(1, 6), backend=st.sampled_from(BACKEND_NAMES), seed=seeds)
def test_any_chunking_equals_the_full_forward_and_one_shot_prefill(
        device, chunks, h, group, rope, qk_norm, window, backend, seed):
    """Chunks that do not divide the prompt, T = 1, any GQA ratio: prefix + bottom-right mask."""
    mha = make(8 * h * group, h * group, n_kv_heads=h, rope=rope, qk_norm=qk_norm, window=window,
               backend=backend, seed=seed, device=device)
    t = sum(chunks)
    x = randn(2, t, mha.d_model, seed=seed, device=device)
    with torch.no_grad():
        full = mha(x)
        out, cache = decode(mha, x, chunks)
        one_shot, one_cache = decode(mha, x, [t])
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, one_shot, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.k, one_cache.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v, one_cache.v, rtol=1e-5, atol=1e-5)


def test_the_cache_holds_the_projected_rotated_keys_and_values(device):
    """What MultiHeadAttention.project gives for the whole sequence: k after QK-norm and RoPE."""
    mha = make(32, 4, n_kv_heads=2, rope=True, qk_norm=True, device=device)
    x = randn(2, 9, 32, device=device)
    with torch.no_grad():
        _, cache = decode(mha, x, [4, 3, 1, 1])
        _, k, v = mha.project(x)
    torch.testing.assert_close(cache.k, k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v, v, rtol=1e-5, atol=1e-5)


def test_positions_default_to_the_cache_length(device):
    mha = make(32, 4, rope=True, device=device)
    x = randn(1, 6, 32, device=device)
    with torch.no_grad():
        implicit, _ = decode(mha, x, [4, 2])
        cache = mha.new_cache(1, 6)
        explicit = torch.cat([mha(x[:, :4], cache=cache, positions=torch.arange(4, device=device)),
                              mha(x[:, 4:], cache=cache,
                                  positions=torch.arange(4, 6, device=device))], dim=1)
        cache.reset()                                       # positions from 0 again: wrong
        mha(x[:, :4], cache=cache)
        unshifted = mha(x[:, 4:], cache=cache, positions=torch.arange(2, device=device))
    torch.testing.assert_close(implicit, explicit, rtol=0, atol=0)
    assert not torch.allclose(unshifted, implicit[:, 4:], atol=1e-4)


def test_decode_step_weights_are_the_last_rows_of_the_full_weights(device):
    mha = make(32, 4, n_kv_heads=2, rope=True, device=device)
    x = randn(2, 8, 32, device=device)
    with torch.no_grad():
        _, full = mha(x, return_weights=True)
        cache = mha.new_cache(2, 8)
        _, prefill = mha(x[:, :5], cache=cache, return_weights=True)
        _, chunk = mha(x[:, 5:], cache=cache, return_weights=True)
    assert prefill.shape == (2, 4, 5, 5) and chunk.shape == (2, 4, 3, 8)
    torch.testing.assert_close(prefill, full[:, :, :5, :5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunk, full[:, :, 5:], rtol=1e-5, atol=1e-5)
    assert torch.equal(chunk[:, :, 0, 6:], torch.zeros_like(chunk[:, :, 0, 6:]))   # bottom-right


def test_a_reset_cache_starts_a_new_sequence(device):
    mha = make(32, 4, rope=True, device=device)
    x, y = randn(1, 5, 32, device=device), randn(1, 5, 32, seed=1, device=device)
    with torch.no_grad():
        _, cache = decode(mha, x, [3, 1, 1])
        cache.reset()
        again, _ = decode(mha, y, [2, 2, 1], cache=cache)
        torch.testing.assert_close(again, mha(y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_half_precision_decode_equals_the_full_forward(device, require_dtype, backend, dtype):
    require_dtype(device, dtype)
    mha = make(32, 4, n_kv_heads=2, rope=True, qk_norm=True, backend=backend, device=device,
               dtype=dtype)
    x = randn(2, 12, 32, device=device, dtype=dtype)
    with torch.no_grad():
        out, cache = decode(mha, x, [5, 1, 3, 1, 1, 1])
        full = mha(x)
    assert cache.dtype == out.dtype == dtype
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, full, rtol=rtol, atol=atol)


def test_overflow_through_the_module_changes_nothing(device):
    mha = make(32, 4, n_kv_heads=2, device=device)
    cache = mha.new_cache(1, 6)
    x = randn(1, 4, 32, device=device)
    with torch.no_grad():
        mha(x, cache=cache)
        k, v = cache.k.clone(), cache.v.clone()
        with pytest.raises(ValueError, match="holds 4 of max_seq_len=6 positions; 3 more would "
                                             "need 7"):
            mha(x[:, :3], cache=cache)
    assert len(cache) == 4 and torch.equal(cache.k, k) and torch.equal(cache.v, v)


def test_new_cache_follows_the_module(device, require_dtype):
    require_dtype(device, torch.float64)
    mha = make(32, 4, n_kv_heads=2, device=device, dtype=torch.float64)
    cache = mha.new_cache(3, 10)
    assert isinstance(cache, KVCache) and len(cache) == 0
    assert cache.k.shape == cache.v.shape == (3, 2, 10, 8)
    assert cache.dtype == torch.float64 and cache.device.type == device.type
    assert mha.new_cache(1, 2, dtype=torch.float16, device="cpu").dtype == torch.float16


def test_invalid_cache_calls(device):
    mha = make(32, 4, n_kv_heads=2, device=device)
    x = randn(2, 3, 32, device=device)
    with pytest.raises(ValueError, match="cache must be a KVCache, got dict"):
        mha(x, cache={})
    with pytest.raises(ValueError, match="cache is for self-attention"):
        mha(x, cache=mha.new_cache(2, 8), context=x)
    wrong = r"the cache holds n_kv_heads=4 heads of head_dim=8, this module makes 2 of 8"
    with pytest.raises(ValueError, match=wrong):
        mha(x, cache=make(32, 4, device=device).new_cache(2, 8))
    with pytest.raises(ValueError, match="head_dim=4, this module makes 2 of 8"):
        mha(x, cache=KVCache(2, 2, 8, 4, device=device))
    with pytest.raises(ValueError, match=r"k_new must have shape \(B=1, Hkv=2"):
        mha(x, cache=mha.new_cache(1, 8))
    with pytest.raises(ValueError, match="the cache holds torch.float16"):
        mha(x, cache=mha.new_cache(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"x must be \(B, T, C=32\)"):
        mha(x[0], cache=mha.new_cache(2, 8))


def test_a_cache_on_another_device_is_refused(device, other_device):
    mha = make(32, 4, device=device)
    cache = mha.new_cache(1, 4, device=other_device)
    with pytest.raises(ValueError, match="but the cache holds torch.float32 on"):
        mha(randn(1, 2, 32, device=device), cache=cache)
    assert len(cache) == 0


# ---------------------------------------------------------------- GQA

def mha_twin_of_gqa(gqa: MultiHeadAttention) -> MultiHeadAttention:
    """A plain MHA module whose K and V heads are gqa's, each repeated for its query heads."""
    group = gqa.n_heads // gqa.n_kv_heads
    options = dict(rope=gqa.rotary is not None, qk_norm=gqa.q_norm is not None,
                   backend=gqa.backend, window=gqa.window)
    mha = MultiHeadAttention(gqa.d_model, gqa.n_heads, **options).to(gqa.q_proj.weight)
    state = gqa.state_dict()
    for name in ("k_proj.weight", "v_proj.weight"):
        w = state[name].view(gqa.n_kv_heads, gqa.head_dim, gqa.d_model)
        state[name] = w.repeat_interleave(group, dim=0).reshape(-1, gqa.d_model)
    mha.load_state_dict(state)
    return mha.eval()


@given(h_kv=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 4]), t=st.integers(1, 10),
       rope=st.booleans(), qk_norm=st.booleans(), backend=st.sampled_from(BACKEND_NAMES),
       seed=seeds)
def test_gqa_equals_mha_on_repeated_kv_with_and_without_a_cache(
        device, h_kv, group, t, rope, qk_norm, backend, seed):
    gqa = make(4 * h_kv * group, h_kv * group, n_kv_heads=h_kv, rope=rope, qk_norm=qk_norm,
               backend=backend, seed=seed, device=device)
    mha = mha_twin_of_gqa(gqa)
    x = randn(2, t, gqa.d_model, seed=seed, device=device)
    chunks = [t - t // 2] + [1] * (t // 2)
    with torch.no_grad():
        expected = mha(x)
        torch.testing.assert_close(gqa(x), expected, rtol=1e-5, atol=1e-5)
        out, gqa_cache = decode(gqa, x, chunks)
        mha_out, mha_cache = decode(mha, x, chunks)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mha_out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(repeat_kv(gqa_cache.k, group), mha_cache.k)     # the same keys,
    torch.testing.assert_close(repeat_kv(gqa_cache.v, group), mha_cache.v)     # each stored once
    assert gqa_cache.nbytes * group == mha_cache.nbytes


@given(b=st.integers(1, 8), h=st.sampled_from([1, 2, 4, 8, 32]), s=st.integers(1, 128),
       d=st.sampled_from([4, 8, 16]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       data=st.data())
def test_a_cache_with_h_kv_heads_takes_h_kv_over_h_of_the_mha_bytes(b, h, s, d, dtype, data):
    h_kv = data.draw(st.sampled_from([n for n in range(1, h + 1) if h % n == 0]))
    gqa = MultiHeadAttention(h * d, h, n_kv_heads=h_kv)
    mha = MultiHeadAttention(h * d, h)
    gqa_bytes = gqa.new_cache(b, s, dtype=dtype).nbytes
    mha_bytes = mha.new_cache(b, s, dtype=dtype).nbytes
    assert gqa_bytes * h == mha_bytes * h_kv
    assert gqa_bytes == 2 * b * h_kv * s * d * dtype.itemsize


@given(t=st.integers(1, 9), cached=st.integers(0, 9), h_kv=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 3]), seed=seeds)
def test_gqa_decode_step_equals_pytorch_sdpa_with_enable_gqa(device, t, cached, h_kv, group,
                                                            seed):
    """The cached keys, the new queries: PyTorch's SDPA with enable_gqa and a bottom-right
    causal mask (its own is_causal is top-left) computes the module's attention."""
    gqa = make(8 * h_kv * group, h_kv * group, n_kv_heads=h_kv, rope=True, seed=seed,
               device=device)
    x = randn(2, cached + t, gqa.d_model, seed=seed, device=device)
    with torch.no_grad():
        cache = gqa.new_cache(2, cached + t)
        if cached:
            gqa(x[:, :cached], cache=cache)
        out = gqa(x[:, cached:], cache=cache)
        positions = torch.arange(cached, cached + t, device=device)
        q, _, _ = gqa.project(x[:, cached:], positions=positions)
        keep = torch.ones(t, cached + t, dtype=torch.bool, device=device).tril(cached)
        attended = F.scaled_dot_product_attention(q, cache.k, cache.v, attn_mask=keep,
                                                  enable_gqa=True)
        expected = gqa.out_proj(attended.transpose(1, 2).reshape(2, t, -1))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the sdpa decode path

@given(b=st.integers(1, 3), h_kv=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 4]),
       tk=st.integers(1, 40), d=st.sampled_from([1, 4, 8, 16]), dv=st.sampled_from([None, 3]),
       scale=st.none() | st.floats(0.05, 2.0), seed=seeds)
def test_sdpa_one_query_causal_equals_math(device, b, h_kv, group, tk, d, dv, scale, seed):
    """tq == 1 <= tk: the one new query sits last and sees every key, GQA included."""
    q = randn(b, h_kv * group, 1, d, seed=seed, device=device)
    k = randn(b, h_kv, tk, d, seed=seed + 1, device=device)
    v = randn(b, h_kv, tk, dv or d, seed=seed + 2, device=device)
    kwargs = dict(is_causal=True, scale=scale, enable_gqa=group > 1)
    out = get_backend("sdpa")(q, k, v, **kwargs)
    torch.testing.assert_close(out, get_backend("math")(q, k, v, **kwargs),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(
        q, k, v, scale=scale, enable_gqa=group > 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_sdpa_one_query_causal_in_half_precision(device, require_dtype, dtype):
    require_dtype(device, dtype)
    q = randn(2, 8, 1, 16, device=device, dtype=dtype)
    k, v = (randn(2, 2, 37, 16, seed=s, device=device, dtype=dtype) for s in (1, 2))
    out = get_backend("sdpa")(q, k, v, is_causal=True, enable_gqa=True)
    assert out.dtype == dtype
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, get_backend("math")(q, k, v, is_causal=True, enable_gqa=True),
                               rtol=rtol, atol=atol)


def test_sdpa_one_query_causal_builds_no_mask(monkeypatch, device):
    """The decode step needs no mask; with a window or a mask it still takes the masked path."""
    def no_mask(*args, **kwargs):
        raise AssertionError("a mask was built for a one-query causal call")

    q, k = randn(1, 4, 1, 8, device=device), randn(1, 2, 6, 8, seed=1, device=device)
    expected = get_backend("math")(q, k, k, is_causal=True, enable_gqa=True)
    with monkeypatch.context() as patch:
        patch.setattr(sdpa, "attention_mask", no_mask)
        out = get_backend("sdpa")(q, k, k, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected)
    for window in (1, 3):
        torch.testing.assert_close(
            get_backend("sdpa")(q, k, k, is_causal=True, enable_gqa=True, window=window),
            get_backend("math")(q, k, k, is_causal=True, enable_gqa=True, window=window))


# ---------------------------------------------------------------- GPT

def tokens(b, t, vocab=13, seed=0, device="cpu"):
    return torch.randint(vocab, (b, t), generator=torch.Generator().manual_seed(seed)).to(device)


GPT_OPTIONS = {
    "learned": dict(),
    "rope": dict(position="rope"),
    "learned+gqa": dict(n_kv_heads=2),
    "rope+mqa+qk_norm": dict(position="rope", n_kv_heads=1, qk_norm=True),
    "rope+qk_norm_after+window": dict(position="rope", qk_norm=True,
                                      qk_norm_order="after_rope", window=3),
    "learned+window+sdpa": dict(window=4, backend="sdpa"),
    "rope+gqa+sdpa+no_mlp": dict(position="rope", n_kv_heads=2, backend="sdpa", mlp=False),
}


@pytest.mark.parametrize("options", list(GPT_OPTIONS.values()), ids=list(GPT_OPTIONS))
@pytest.mark.parametrize("prompt", [1, 7])
def test_gpt_prefill_then_decode_equals_the_full_forward(device, prompt, options):
    model = gpt(device=device, **options)
    idx = tokens(2, 12, device=device)
    with torch.no_grad():
        full = model(idx)
        caches = model.new_caches(2)
        logits = [model(idx[:, :prompt], caches=caches)]
        logits += [model(idx[:, i:i + 1], caches=caches) for i in range(prompt, 12)]
    assert [len(c) for c in caches] == [12, 12]
    torch.testing.assert_close(torch.cat(logits, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prompt", [1, 7, 33])
def test_gpt_with_rope_decodes_a_long_prompt_past_seq_len(device, prompt):
    model = gpt(device=device, position="rope", n_kv_heads=2, qk_norm=True, seq_len=8)
    idx = tokens(1, prompt + 4, device=device)
    with torch.no_grad():
        full = model(idx)
        caches = model.new_caches(1, prompt + 4)
        logits = [model(idx[:, :prompt], caches=caches)]
        logits += [model(idx[:, i:i + 1], caches=caches) for i in range(prompt, prompt + 4)]
    torch.testing.assert_close(torch.cat(logits, dim=1), full, rtol=1e-5, atol=1e-5)


@given(chunks=st.lists(st.integers(1, 5), min_size=1, max_size=5),
       options=st.sampled_from(list(GPT_OPTIONS.values())), seed=seeds)
def test_gpt_any_chunking_equals_the_full_forward(device, chunks, options, seed):
    model = gpt(seed=seed % 4, device=device, **{**options, "seq_len": 25})
    idx = tokens(2, sum(chunks), seed=seed, device=device)
    with torch.no_grad():
        full = model(idx)
        caches = model.new_caches(2, sum(chunks))
        logits, start = [], 0
        for n in chunks:
            logits.append(model(idx[:, start:start + n], caches=caches))
            start += n
    torch.testing.assert_close(torch.cat(logits, dim=1), full, rtol=1e-5, atol=1e-5)


def test_gpt_attention_maps_with_caches(device):
    model = gpt(device=device, position="rope", n_kv_heads=2)
    idx = tokens(2, 9, device=device)
    with torch.no_grad():
        _, full = model(idx, return_attention=True)
        caches = model.new_caches(2, 9)
        model(idx[:, :6], caches=caches)
        _, maps = model(idx[:, 6:], caches=caches, return_attention=True)
    assert [w.shape for w in maps] == [(2, 4, 3, 9)] * 2
    for w, expected in zip(maps, full):
        torch.testing.assert_close(w, expected[:, :, 6:], rtol=1e-5, atol=1e-5)


def test_new_caches_one_per_layer(device):
    model = gpt(device=device, n_layers=3, n_kv_heads=2)
    caches = model.new_caches(4)
    assert len(caches) == 3 and len({id(c) for c in caches}) == 3
    assert all(c.k.shape == (4, 2, 12, 4) and c.device.type == device.type for c in caches)
    assert model.new_caches(1, 30)[0].max_seq_len == 30
    assert model.new_caches(1, dtype=torch.bfloat16)[0].dtype == torch.bfloat16


def test_gpt_cache_errors_name_the_problem(device):
    model = gpt(device=device)                                     # learned positions, seq_len 12
    idx = tokens(1, 3, device=device)
    caches = model.new_caches(1, 20)
    with pytest.raises(ValueError, match="caches must be a list of 2 KVCache"):
        model(idx, caches=caches[:1])
    with pytest.raises(ValueError, match="caches must be a list of 2 KVCache"):
        model(idx, caches=[caches[0], None])
    with pytest.raises(ValueError, match="caches must be a list of 2 KVCache"):
        model(idx, caches=caches[0])
    with torch.no_grad():
        model(idx, caches=caches)
        model.blocks[0].attn(torch.zeros(1, 1, 16, device=device), cache=caches[0])
        with pytest.raises(ValueError, match=r"different lengths \[4, 3\]"):
            model(idx, caches=caches)
        for c in caches:
            c.reset()
        model(tokens(1, 10, device=device), caches=caches)
        with pytest.raises(ValueError, match=r"T=3 after 10 cached tokens, at positions up to "
                                             r"12, must be in \[1, seq_len=12\]"):
            model(idx, caches=caches)
    assert [len(c) for c in caches] == [10, 10]


def test_gpt_overflow_changes_no_layer(device):
    model = gpt(device=device, position="rope")
    caches = model.new_caches(1, 6)
    with torch.no_grad():
        model(tokens(1, 4, device=device), caches=caches)
        before = [(c.k.clone(), c.v.clone()) for c in caches]
        with pytest.raises(ValueError, match="holds 4 of max_seq_len=6 positions; 3 more"):
            model(tokens(1, 3, device=device), caches=caches)
    assert [len(c) for c in caches] == [4, 4]
    for c, (k, v) in zip(caches, before):
        assert torch.equal(c.k, k) and torch.equal(c.v, v)


# ---------------------------------------------------------------- generate

def calls_of(model):
    """Records the length T of every idx the model is called with."""
    lengths = []
    model.register_forward_pre_hook(lambda _, args: lengths.append(args[0].shape[1]))
    return lengths


@given(prompt=st.integers(1, 15), new=st.integers(0, 14), chunk=st.none() | st.integers(1, 6),
       options=st.sampled_from(list(GPT_OPTIONS.values())), seed=seeds)
def test_greedy_tokens_are_identical_with_and_without_the_cache(device, prompt, new, chunk,
                                                                options, seed):
    """Prompts shorter and longer than seq_len = 8, and generation past it (the re-prefill)."""
    model = gpt(seed=seed % 4, device=device, **{**options, "seq_len": 8})
    idx = tokens(2, prompt, seed=seed, device=device)
    cached = generate(model, idx, new, temperature=0, prefill_chunk=chunk)
    uncached = generate(model, idx, new, temperature=0, use_cache=False)
    assert cached.shape == (2, prompt + new) and torch.equal(cached[:, :prompt], idx)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_greedy_generation_past_seq_len_is_identical(device, position):
    model = gpt(device=device, position=position, n_kv_heads=2, seq_len=10)
    idx = tokens(3, 6, device=device)
    cached = generate(model, idx, 30, temperature=0)
    uncached = generate(model, idx, 30, temperature=0, use_cache=False)
    assert torch.equal(cached, uncached)
    assert len(set(cached[0, 6:].tolist())) > 1              # not a constant stream


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_cached_logits_follow_the_full_forward(device, require_dtype, dtype):
    require_dtype(device, dtype)
    model = gpt(device=device, position="rope", n_kv_heads=2).to(dtype)
    idx = tokens(2, 10, device=device)
    with torch.no_grad():
        full = model(idx)
        caches = model.new_caches(2)
        assert caches[0].dtype == dtype
        logits = [model(idx[:, :4], caches=caches)]
        logits += [model(idx[:, i:i + 1], caches=caches) for i in range(4, 10)]
    rtol, atol = TOL[dtype]
    scale = full.abs().max().item()                      # logits are O(scale), not O(1)
    torch.testing.assert_close(torch.cat(logits, dim=1), full, rtol=rtol, atol=atol * scale)


@pytest.mark.parametrize("prompt, new, chunk, seq_len, expected", [
    (7, 4, None, 12, [7, 1, 1, 1]),                      # prefill once, then one token a step
    (7, 4, 3, 12, [3, 3, 1, 1, 1, 1]),                   # chunks that do not divide the prompt
    (5, 1, None, 12, [5]),
    (4, 5, None, 6, [4, 1, 1, 6, 6]),                    # past seq_len: the last 6 afresh
    (9, 3, 4, 6, [4, 2, 4, 2, 4, 2]),         # longer than seq_len: re-prefilled in chunks
    (3, 0, None, 6, []),
])
def test_generate_runs_the_prompt_once_then_one_token_a_step(prompt, new, chunk, seq_len,
                                                             expected):
    model = gpt(position="learned", seq_len=seq_len)
    lengths = calls_of(model)
    generate(model, tokens(1, prompt), new, temperature=0, prefill_chunk=chunk)
    assert lengths == expected
    lengths.clear()
    generate(model, tokens(1, prompt), new, temperature=0, use_cache=False)
    assert lengths == [min(prompt + i, seq_len) for i in range(new)]      # everything, each step


def test_sampling_with_the_cache_follows_the_generator(device):
    model = gpt(device=device, position="rope")
    idx = tokens(4, 3, device=device)
    def sampled(seed):
        return generate(model, idx, 10, do_sample=True, top_k=5,
                        generator=torch.Generator(device).manual_seed(seed))
    first = sampled(1)
    assert torch.equal(first, sampled(1)) and ((first >= 0) & (first < 13)).all()
    assert not torch.equal(first, sampled(2))                  # the draws follow the seed
    assert not torch.equal(first, generate(model, idx, 10))    # and are not greedy


@pytest.mark.parametrize("chunk", [0, -2, 1.5, True, "4"])
def test_generate_refuses_a_bad_prefill_chunk(chunk):
    with pytest.raises(ValueError, match=f"prefill_chunk must be a positive int, got "
                                         f"{chunk!r}"):
        generate(gpt(), tokens(1, 3), 2, prefill_chunk=chunk)
