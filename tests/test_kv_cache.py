"""kv_cache.py: KVCache holds exactly what was written, in buffers allocated once; it returns
views of the valid prefix, refuses what does not fit (and then changes nothing), and resets.

Its use by MultiHeadAttention and the GPT is tested in test_decode.py, by MLA in test_mla.py."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import course_attn
from course_attn.kv_cache import KVCache

seeds = st.integers(0, 2 ** 31 - 1)


def randn(*shape, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)


def snapshot(cache: KVCache):
    return len(cache), cache.k.clone(), cache.v.clone()


def assert_unchanged(cache: KVCache, before) -> None:
    length, k, v = before
    assert len(cache) == length
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)


# ---------------------------------------------------------------- what it holds

def test_exported_from_the_package():
    assert course_attn.KVCache is KVCache and "KVCache" in course_attn.__all__


def test_a_new_cache_is_empty_and_allocated_at_full_length(device):
    cache = KVCache(2, 3, 10, 4, device=device)
    assert len(cache) == 0
    assert cache.k.shape == cache.v.shape == (2, 3, 10, 4)
    assert cache.k.dtype == cache.dtype == torch.float32
    assert cache.k.device.type == cache.device.type == device.type
    assert cache.nbytes == 2 * 2 * 3 * 10 * 4 * 4
    k, v = cache.update(randn(2, 3, 0, 4, device=device), randn(2, 3, 0, 4, device=device))
    assert k.shape == v.shape == (2, 3, 0, 4) and len(cache) == 0


@given(b=st.integers(1, 3), h=st.integers(1, 4), d=st.integers(1, 8), dv=st.integers(1, 8),
       chunks=st.lists(st.integers(0, 5), min_size=1, max_size=6), seed=seeds)
def test_holds_exactly_what_was_written_in_order(device, b, h, d, dv, chunks, seed):
    """Any sequence of appends (T_new = 0 and 1 included): the returned prefix is the
    concatenation of everything written, the rest of each buffer is untouched zeros."""
    s = sum(chunks) + 2
    cache = KVCache(b, h, s, d, value_dim=dv, device=device)
    written_k, written_v = [], []
    for i, t in enumerate(chunks):
        k_new = randn(b, h, t, d, seed=seed + 2 * i, device=device)
        v_new = randn(b, h, t, dv, seed=seed + 2 * i + 1, device=device)
        k, v = cache.update(k_new, v_new)
        written_k.append(k_new)
        written_v.append(v_new)
        n = sum(chunks[:i + 1])
        assert len(cache) == n and k.shape == (b, h, n, d) and v.shape == (b, h, n, dv)
        assert torch.equal(k, torch.cat(written_k, dim=2))
        assert torch.equal(v, torch.cat(written_v, dim=2))
    assert not cache.k[:, :, len(cache):].any() and not cache.v[:, :, len(cache):].any()


def test_update_returns_views_of_the_buffers_and_copies_the_input(device):
    cache = KVCache(1, 2, 8, 4, device=device)
    data_k, data_v = cache.k.data_ptr(), cache.v.data_ptr()
    k_new, v_new = randn(1, 2, 3, 4, device=device), randn(1, 2, 3, 4, seed=1, device=device)
    kept_k = k_new.clone()
    k, v = cache.update(k_new, v_new)
    assert k.data_ptr() == data_k and v.data_ptr() == data_v          # views, not copies
    assert k._base is cache.k and v._base is cache.v
    k_new.zero_()                                                     # the cache copied k_new
    assert torch.equal(cache.k[:, :, :3], kept_k)
    for i in range(5):                                                # written in place,
        cache.update(randn(1, 2, 1, 4, seed=i, device=device),        # never reallocated
                     randn(1, 2, 1, 4, seed=i + 9, device=device))
        assert cache.k.data_ptr() == data_k and cache.v.data_ptr() == data_v
    assert len(cache) == 8


def test_update_accepts_non_contiguous_heads(device):
    """What split_heads gives: a transposed view of (B, T, H·D)."""
    cache = KVCache(2, 3, 6, 4, device=device)
    x = randn(2, 5, 12, device=device)
    heads = x.view(2, 5, 3, 4).transpose(1, 2)
    assert not heads.is_contiguous()
    k, v = cache.update(heads, heads)
    assert torch.equal(k, heads) and torch.equal(v, heads)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_other_dtypes_are_stored_bit_for_bit(device, require_dtype, dtype):
    require_dtype(device, dtype)
    cache = KVCache(1, 2, 5, 4, dtype=dtype, device=device)
    k_new, v_new = randn(1, 2, 5, 4, dtype=dtype, device=device), randn(
        1, 2, 5, 4, seed=1, dtype=dtype, device=device)
    k, v = cache.update(k_new, v_new)
    assert k.dtype == v.dtype == dtype and torch.equal(k, k_new) and torch.equal(v, v_new)
    assert cache.nbytes == 2 * 1 * 2 * 5 * 4 * dtype.itemsize


@given(b=st.integers(1, 4), h=st.integers(1, 8), s=st.integers(1, 64), d=st.integers(1, 32),
       dv=st.none() | st.integers(1, 32),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
def test_nbytes_is_the_formula(b, h, s, d, dv, dtype):
    """2 · B · Hkv · max_seq_len · D · bytes when values are as wide as keys; else D + Dv."""
    cache = KVCache(b, h, s, d, value_dim=dv, dtype=dtype)
    width = 2 * d if dv is None else d + dv
    assert cache.nbytes == b * h * s * width * dtype.itemsize
    assert cache.nbytes == cache.k.nbytes + cache.v.nbytes


def test_reset_forgets_every_position_and_keeps_the_buffers(device):
    cache = KVCache(1, 1, 4, 2, device=device)
    data = cache.k.data_ptr()
    cache.update(randn(1, 1, 3, 2, device=device), randn(1, 1, 3, 2, device=device))
    cache.reset()
    assert len(cache) == 0 and cache.k.data_ptr() == data
    new = randn(1, 1, 4, 2, seed=5, device=device)                    # the whole length again
    k, v = cache.update(new, new)
    assert torch.equal(k, new) and torch.equal(v, new) and len(cache) == 4


def test_repr_says_length_and_sizes():
    cache = KVCache(2, 3, 10, 4, value_dim=6)
    cache.update(torch.zeros(2, 3, 7, 4), torch.zeros(2, 3, 7, 6))
    text = repr(cache)
    for part in ("batch_size=2", "n_kv_heads=3", "length=7/10", "head_dim=4", "value_dim=6",
                 "float32"):
        assert part in text, text


# ---------------------------------------------------------------- what it refuses

@pytest.mark.parametrize("held, new, capacity", [(0, 9, 8), (5, 4, 8), (8, 1, 8), (3, 6, 7)])
def test_overflow_names_the_numbers_and_changes_nothing(device, held, new, capacity):
    cache = KVCache(2, 2, capacity, 3, device=device)
    if held:
        cache.update(randn(2, 2, held, 3, device=device), randn(2, 2, held, 3, seed=1,
                                                                 device=device))
    before = snapshot(cache)
    message = (rf"holds {held} of max_seq_len={capacity} positions; {new} more would need "
               rf"{held + new}")
    with pytest.raises(ValueError, match=message):
        cache.update(randn(2, 2, new, 3, seed=2, device=device),
                     randn(2, 2, new, 3, seed=3, device=device))
    assert_unchanged(cache, before)
    if held < capacity:                                 # what still fits is still accepted
        cache.update(randn(2, 2, capacity - held, 3, device=device),
                     randn(2, 2, capacity - held, 3, device=device))
        assert len(cache) == capacity


def bad_inputs(device):
    """(k_new, v_new, message) for a cache (B=2, Hkv=3, S=8, D=4, Dv=5), float32 on device."""
    k, v = randn(2, 3, 2, 4, device=device), randn(2, 3, 2, 5, device=device)
    shape = r"must have shape \(B=2, Hkv=3, T_new, D=%d\), got "
    return [
        (k[0], v, "k_new " + shape % 4 + r"\(3, 2, 4\)"),
        (randn(1, 3, 2, 4, device=device), v, "k_new " + shape % 4 + r"\(1, 3, 2, 4\)"),
        (randn(2, 6, 2, 4, device=device), v, "k_new " + shape % 4 + r"\(2, 6, 2, 4\)"),
        (randn(2, 3, 2, 5, device=device), v, "k_new " + shape % 4 + r"\(2, 3, 2, 5\)"),
        (k, randn(2, 3, 2, 4, device=device), "v_new " + shape % 5 + r"\(2, 3, 2, 4\)"),
        (k, v[:, :, :1], "k_new has T_new=2 positions but v_new has 1"),
        (k.double(), v, "k_new is torch.float64 on .*, but the cache holds torch.float32"),
        (k, v.half(), "v_new is torch.float16 on .*, but the cache holds torch.float32"),
        ([[0.0]], v, r"k_new must be a tensor .*got list"),
        (k, None, r"v_new must be a tensor .*got NoneType"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_bad_input_is_refused_with_a_clear_error_and_changes_nothing(device, case):
    """A good k_new with a bad v_new must not write k_new either."""
    cache = KVCache(2, 3, 8, 4, value_dim=5, device=device)
    cache.update(randn(2, 3, 3, 4, seed=7, device=device), randn(2, 3, 3, 5, seed=8,
                                                                 device=device))
    before = snapshot(cache)
    k_new, v_new, message = bad_inputs(device)[case]
    with pytest.raises(ValueError, match=message):
        cache.update(k_new, v_new)
    assert_unchanged(cache, before)


def test_tensors_on_another_device_are_refused(device, other_device):
    cache = KVCache(1, 2, 4, 3, device=device)
    k = randn(1, 2, 1, 3, device=other_device)
    with pytest.raises(ValueError, match=f"k_new is torch.float32 on {other_device.type}"):
        cache.update(k, k)
    assert len(cache) == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_size=0), "batch_size must be a positive int, got 0"),
    (dict(n_kv_heads=-1), "n_kv_heads must be a positive int, got -1"),
    (dict(max_seq_len=0), "max_seq_len must be a positive int, got 0"),
    (dict(max_seq_len=4.0), "max_seq_len must be a positive int, got 4.0"),
    (dict(head_dim=True), "head_dim must be a positive int, got True"),
    (dict(value_dim=0), "value_dim must be a positive int, got 0"),
    (dict(dtype=torch.int64), "dtype must be a floating torch.dtype, got torch.int64"),
    (dict(dtype="float32"), "dtype must be a floating torch.dtype, got 'float32'"),
])
def test_bad_sizes_are_refused(kwargs, message):
    args = dict(batch_size=1, n_kv_heads=2, max_seq_len=4, head_dim=3)
    args.update(kwargs)
    positional = [args.pop(name) for name in ("batch_size", "n_kv_heads", "max_seq_len",
                                              "head_dim")]
    with pytest.raises(ValueError, match=message):
        KVCache(*positional, **args)


# ---------------------------------------------------------------- the static cache

def attend(view, q):
    """What a layer computes from a cache's view: q (B, H, T_new, D) -> (B, H, T_new, Dv)."""
    from course_attn.backends import get_backend
    return get_backend("sdpa")(q, view.k, view.v, attn_mask=view.attn_mask,
                               is_causal=view.is_causal, window=view.window,
                               enable_gqa=q.shape[1] != view.k.shape[1])


@pytest.mark.parametrize("window", [None, 3])
@given(chunks=st.lists(st.integers(1, 4), min_size=1, max_size=5), seed=seeds)
def test_static_cache_attends_as_the_kv_cache(window, chunks, seed):
    """Any appends: the queries see, through the whole buffer and its mask, what they see
    through a KVCache's prefix (the window, and a left-padding mask, included); the slots not
    written yet are hidden, not read as zeros."""
    from course_attn.kv_cache import StaticKVCache
    b, h, d, s = 2, 2, 4, sum(chunks) + 3
    static, full = StaticKVCache(b, h, s, d), KVCache(b, h, s, d)
    padding = torch.ones(b, s, dtype=torch.bool)
    padding[0, :1] = False                                    # row 0: its first token pads
    for i, t in enumerate(chunks):
        k, v, q = (randn(b, h, t, d, seed=seed + 3 * i + j) for j in range(3))
        assert torch.equal(static.positions(t), torch.arange(len(full), len(full) + t))
        keys = padding[:, None, None, :len(full) + t]
        got = attend(static.append(k, v, attn_mask=keys, window=window), q)
        want = attend(full.append(k, v, attn_mask=keys, window=window), q)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert len(static) == len(full)
    assert not static.k[:, :, len(static):].any()
    assert torch.equal(static.k[:, :, :len(static)], full.k[:, :, :len(full)])


def test_static_cache_writes_in_place_at_a_tensor_position():
    from course_attn.kv_cache import StaticKVCache
    cache = StaticKVCache(1, 2, 6, 3)
    data, position = cache.k.data_ptr(), cache.next_position
    view = cache.append(randn(1, 2, 4, 3), randn(1, 2, 4, 3, seed=1))
    assert view.k is cache.k and view.v is cache.v and view.k.data_ptr() == data
    assert view.attn_mask.shape == (4, 6) and not view.is_causal and view.window is None
    assert cache.next_position is position and int(position) == 4 == len(cache)
    assert torch.equal(cache.positions(2), torch.tensor([4, 5]))
    cache.reset()
    assert len(cache) == 0 and cache.k.data_ptr() == data
    assert "StaticKVCache(batch_size=1, n_kv_heads=2, length=0/6" in repr(cache)


def test_static_cache_refuses_what_does_not_fit_and_changes_nothing():
    from course_attn.kv_cache import StaticKVCache
    cache = StaticKVCache(1, 2, 5, 3)
    cache.append(randn(1, 2, 4, 3), randn(1, 2, 4, 3))
    before = snapshot(cache)
    with pytest.raises(ValueError, match="holds 4 of max_seq_len=5 positions; 2 more would "
                                         "need 6"):
        cache.append(randn(1, 2, 2, 3), randn(1, 2, 2, 3))
    with pytest.raises(ValueError, match="k_new is torch.float64"):
        cache.append(randn(1, 2, 1, 3).double(), randn(1, 2, 1, 3))
    assert_unchanged(cache, before)
