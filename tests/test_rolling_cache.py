"""RollingKVCache (kv_cache.py): it holds exactly the last ``window`` tokens (and the first ``sinks``)
in a buffer allocated once, never overflows, and refuses bad input; decoding through it
(MultiHeadAttention, GPT, generate) equals decoding through a full KVCache with the window mask,
and with sinks equals full attention under the mask "in the window OR one of the first sinks"."""

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import course_attn.backends as backends
from course_attn.kv_cache import KVCache
from course_attn.local import RollingKVCache
from course_attn.model import generate
from course_attn.multihead import MultiHeadAttention

from helpers import gpt as decode_gpt

seeds = st.integers(0, 2 ** 31 - 1)


def randn(*shape, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)


def numbered(b, h, start, t, d, device="cpu"):
    """(B, H, T, D) keys whose every entry is its token's position: start .. start + T - 1."""
    pos = torch.arange(start, start + t, dtype=torch.float32, device=device)
    return pos[None, None, :, None].expand(b, h, t, d).clone()


def window_or_sinks(t: int, window: int, sinks: int = 0, device="cpu") -> torch.Tensor:
    """bool (T, T): query i sees key j when 0 <= i - j < window, or j < sinks and j <= i."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    return (i >= j) & ((i - j < window) | (j < sinks))


# ---------------------------------------------------------------- what it holds

def test_a_new_cache_is_empty_and_allocated_once(device):
    cache = RollingKVCache(2, 3, 5, 4, sinks=2, value_dim=6, device=device)
    assert len(cache) == cache.held == 0 and cache.capacity == 7
    assert cache.k.shape == (2, 3, 7, 4) and cache.v.shape == (2, 3, 7, 6)
    assert cache.dtype == torch.float32 and cache.k.device.type == device.type
    assert cache.nbytes == 2 * 3 * 7 * (4 + 6) * 4
    assert "window=5, sinks=2" in repr(cache)


def test_the_slot_rule():
    """Token p goes to slot p mod window; with sinks, the first ones keep theirs."""
    assert [RollingKVCache(1, 1, 4, 1).slot(p) for p in range(10)] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert ([RollingKVCache(1, 1, 3, 1, sinks=2).slot(p) for p in range(10)]
            == [0, 1, 2, 3, 4, 2, 3, 4, 2, 3])


@given(window=st.integers(1, 6), sinks=st.integers(0, 3), b=st.integers(1, 2),
       h=st.integers(1, 3), chunks=st.lists(st.sampled_from([0, 1, 1, 1, 2, 3, 9]),
                                            min_size=1, max_size=10))
def test_holds_exactly_the_last_window_and_the_sinks(device, window, sinks, b, h, chunks):
    cache = RollingKVCache(b, h, window, 2, sinks=sinks, device=device)
    seen = 0
    for t in chunks:
        before = seen
        kept_before = (list(range(min(before, sinks)))
                       + list(range(max(min(before, sinks), before - window), before)))
        k_new = numbered(b, h, seen, t, 2, device)
        k, v = cache.update(k_new, -k_new)
        seen += t
        assert len(cache) == seen and cache.held == min(seen, sinks + window)
        positions = k[0, 0, :, 0].long().tolist()
        assert torch.equal(v, -k)
        assert positions == cache.key_positions().tolist()
        kept = set(range(min(seen, sinks))) | set(range(max(sinks, seen - window), seen))
        assert sorted(cache.k[0, 0, :cache.held, 0].long().tolist()) == sorted(kept)
        if t == 1:     # a decode step: every held token, in slot order
            assert sorted(positions) == sorted(kept)
        else:          # a prefill: what was kept, in time order, then the new tokens
            assert positions == kept_before + list(range(before, seen))


def test_overflow_never_raises_and_memory_stays_fixed(device):
    cache = RollingKVCache(1, 2, 4, 3, sinks=1, device=device)
    nbytes, pointers = cache.nbytes, (cache.k.data_ptr(), cache.v.data_ptr())
    for p in range(1000):
        k, _ = cache.update(numbered(1, 2, p, 1, 3, device), numbered(1, 2, p, 1, 3, device))
        assert k.shape[2] == min(p + 1, 5)
    assert len(cache) == 1000 and cache.held == 5
    assert sorted(k[0, 0, :, 0].long().tolist()) == [0, 996, 997, 998, 999]
    assert cache.nbytes == nbytes and (cache.k.data_ptr(), cache.v.data_ptr()) == pointers
    cache.update(numbered(1, 2, 1000, 50, 3, device), numbered(1, 2, 1000, 50, 3, device))
    assert cache.nbytes == nbytes and cache.held == 5


def test_reset_starts_a_new_sequence(device):
    cache = RollingKVCache(1, 1, 3, 2, device=device)
    cache.update(numbered(1, 1, 0, 7, 2, device), numbered(1, 1, 0, 7, 2, device))
    cache.reset()
    assert len(cache) == cache.held == 0
    k, _ = cache.update(numbered(1, 1, 0, 1, 2, device), numbered(1, 1, 0, 1, 2, device))
    assert k.shape[2] == 1 and cache.key_positions().tolist() == [0]


def test_visible_is_the_window_or_the_sinks():
    cache = RollingKVCache(1, 1, 3, 1, sinks=1)
    cache.update(numbered(1, 1, 0, 6, 1), numbered(1, 1, 0, 6, 1))
    assert torch.equal(cache.visible(), window_or_sinks(6, 3, 1))
    k, _ = cache.update(numbered(1, 1, 6, 1, 1), numbered(1, 1, 6, 1, 1))
    assert cache.visible() is None                      # a step sees all it holds
    assert cache.visible(2).tolist() == [[p in (0, 5, 6) for p in k[0, 0, :, 0].long().tolist()]]
    with pytest.raises(ValueError, match="window=4 needs the last 4 tokens"):
        cache.visible(4)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("args, kwargs, match", [
    ((0, 1, 4, 2), {}, "batch_size must be a positive int, got 0"),
    ((1, 1, 0, 2), {}, "window must be a positive int, got 0"),
    ((1, 1, True, 2), {}, "window must be a positive int, got True"),
    ((1, 1, 4, 2.0), {}, "head_dim must be a positive int"),
    ((1, 1, 4, 2), {"sinks": -1}, "sinks must be a non-negative int, got -1"),
    ((1, 1, 4, 2), {"sinks": 1.5}, "sinks must be a non-negative int"),
    ((1, 1, 4, 2), {"value_dim": 0}, "value_dim must be a positive int"),
    ((1, 1, 4, 2), {"dtype": torch.int64}, "dtype must be a floating torch.dtype"),
])
def test_bad_sizes_are_refused(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        RollingKVCache(*args, **kwargs)


def test_bad_updates_are_refused_and_change_nothing(device):
    cache = RollingKVCache(2, 3, 4, 5, sinks=1, device=device)
    cache.update(randn(2, 3, 6, 5, device=device), randn(2, 3, 6, 5, device=device))
    before = (len(cache), cache.k.clone(), cache.v.clone())
    good = randn(2, 3, 1, 5, device=device)
    bad = {
        r"k_new must have shape \(B=2, Hkv=3, T_new, D=5\), got \(2, 2, 1, 5\)":
            (randn(2, 2, 1, 5, device=device), good),
        r"v_new must have shape": (good, randn(2, 3, 1, 4, device=device)),
        "k_new must be a tensor": ("keys", good),
        "k_new has T_new=1 positions but v_new has 2": (good, randn(2, 3, 2, 5, device=device)),
        "k_new is torch.float64": (good.double(), good),
    }
    for match, (k_new, v_new) in bad.items():
        with pytest.raises(ValueError, match=match):
            cache.update(k_new, v_new)
        assert len(cache) == before[0]
        assert torch.equal(cache.k, before[1]) and torch.equal(cache.v, before[2])


# ---------------------------------------------------------------- MultiHeadAttention

def make(seed=0, device="cpu", dtype=torch.float32, **options):
    torch.manual_seed(seed)
    return MultiHeadAttention(32, 4, **options).to(device, dtype).eval()


def decode(mha, x, chunks, cache):
    """x (B, T, C) through ``cache``, ``chunks`` tokens per call -> (B, T, C)."""
    outs, start = [], 0
    for n in chunks:
        outs.append(mha(x[:, start:start + n], cache=cache))
        start += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("backend", sorted(backends.BACKENDS))
@given(chunks=st.lists(st.sampled_from([1, 1, 1, 2, 5, 11]), min_size=1, max_size=12),
       window=st.integers(1, 6), extra=st.sampled_from([0, 0, 2]),
       options=st.sampled_from([{}, {"n_kv_heads": 2, "rope": True}, {"n_kv_heads": 1}]),
       seed=seeds)
def test_module_decoding_equals_the_full_forward_with_the_window(device, backend, chunks, window,
                                                                 extra, options, seed):
    """Any chunking (decode steps and prefills), a cache as large as the window or larger."""
    mha = make(seed % 3, device, window=window, backend=backend, **options)
    x = randn(2, sum(chunks), 32, seed=seed, device=device)
    with torch.no_grad():
        full = mha(x)                                       # causal, with the window
        cache = RollingKVCache(2, mha.n_kv_heads, window + extra, mha.head_dim, device=device)
        torch.testing.assert_close(decode(mha, x, chunks, cache), full, rtol=1e-5, atol=1e-5)


@given(chunks=st.lists(st.sampled_from([1, 1, 1, 3, 9]), min_size=1, max_size=12),
       window=st.integers(1, 5), sinks=st.integers(1, 3), seed=seeds)
def test_module_decoding_with_sinks_equals_the_window_or_sinks_mask(device, chunks, window,
                                                                    sinks, seed):
    mha = make(seed % 3, device, window=window, n_kv_heads=2, rope=True)
    x = randn(1, sum(chunks), 32, seed=seed, device=device)
    reference = copy.deepcopy(mha)
    reference.window = None                  # the whole mask is the one built here
    with torch.no_grad():
        full = reference(x, attn_mask=window_or_sinks(x.shape[1], window, sinks, device))
        cache = mha.new_rolling_cache(1, sinks=sinks)
        torch.testing.assert_close(decode(mha, x, chunks, cache), full, rtol=1e-5, atol=1e-5)
    assert cache.held == min(x.shape[1], window + sinks)


def test_module_refuses_a_rolling_cache_it_cannot_use(device):
    x = randn(1, 3, 32, device=device)
    no_window = make(device=device)
    with pytest.raises(ValueError, match="window=None"):
        no_window(x, cache=RollingKVCache(1, 4, 8, 8, device=device))
    with pytest.raises(ValueError, match="window=None"):
        no_window.new_rolling_cache(1)
    mha = make(device=device, window=4)
    small = RollingKVCache(1, 4, 3, 8, device=device)
    with pytest.raises(ValueError, match="window=3 keeps too few tokens for this module's "
                                         "window=4"):
        mha(x, cache=small)
    cache = mha.new_rolling_cache(1)
    with pytest.raises(ValueError, match="causal self-attention without attn_mask"):
        mha(x, cache=cache, attn_mask=torch.ones(3, 3, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="causal self-attention"):
        mha(x, cache=cache, is_causal=False)
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        mha(x, cache=RollingKVCache(1, 2, 4, 8, device=device))
    assert len(small) == len(cache) == 0                    # nothing was written


def test_new_rolling_cache_follows_the_module(device):
    mha = make(device=device, window=6, n_kv_heads=2, dtype=torch.float64)
    cache = mha.new_rolling_cache(3, sinks=2)
    assert isinstance(cache, RollingKVCache) and (cache.window, cache.sinks) == (6, 2)
    assert cache.k.shape == (3, 2, 8, 8) and cache.dtype == torch.float64


# ---------------------------------------------------------------- GPT and generate

def gpt(device="cpu", seed=0, **options):
    """test_decode's tiny GPT with clear greedy winners, here in float64 with window 8, RoPE
    and GQA."""
    config = dict(seq_len=16, window=8, position="rope", n_kv_heads=2)
    config.update(options)
    return decode_gpt(seed=seed, device=device, **config).double()


def tokens(b, t, seed=0, device="cpu"):
    return torch.randint(13, (b, t), generator=torch.Generator().manual_seed(seed)).to(device)


def full_cache_greedy(model, idx, new):
    """Greedy decoding through one full KVCache per layer (as long as the whole sequence) and the
    window mask: the reference the rolling cache must reproduce."""
    caches = model.new_caches(idx.shape[0], idx.shape[1] + new)
    logits = model(idx, caches=caches)[:, -1]
    for _ in range(new):
        idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
        logits = model(idx[:, -1:], caches=caches)[:, -1]
    return idx


@pytest.mark.parametrize("prompt", [1, 5, 20])
def test_greedy_generation_equals_the_full_cache_past_three_windows(device, prompt):
    """Window 8, seq_len 16: 30 new tokens run past 3 windows and past seq_len."""
    model = gpt(device)
    idx = tokens(2, prompt, device=device)
    with torch.no_grad():
        expected = full_cache_greedy(model, idx, 30)
    rolling = generate(model, idx, 30, temperature=0, rolling=True)
    assert torch.equal(rolling, expected)
    assert len(set(rolling[0, prompt:].tolist())) > 1              # not a constant stream
    short = generate(model, idx[:, :min(prompt, 6)], 10, temperature=0, rolling=True,
                     prefill_chunk=3)
    assert torch.equal(short, generate(model, idx[:, :min(prompt, 6)], 10, temperature=0))


def test_gpt_decoding_memory_is_fixed(device):
    model = gpt(device)
    caches = model.new_rolling_caches(1)
    nbytes = sum(c.nbytes for c in caches)
    assert nbytes == 2 * 2 * (2 * 8 * 4) * 8                    # layers · k,v · Hkv·W·D · 8 bytes
    with torch.no_grad():
        model(tokens(1, 5, device=device), caches=caches)
        for p in range(200):
            model(tokens(1, 1, seed=p, device=device), caches=caches)
    assert [len(c) for c in caches] == [205, 205] and [c.held for c in caches] == [8, 8]
    assert sum(c.nbytes for c in caches) == nbytes


@pytest.mark.parametrize("prompt", [1, 5, 20])
def test_sinks_equal_full_attention_under_the_window_or_sinks_mask(device, prompt):
    """Rolling decoding with 2 sinks, against the whole sequence run at once with every layer's
    mask built explicitly: key j is visible from query i when 0 <= i - j < 8, or j < 2."""
    model, sinks, new = gpt(device), 2, 30
    idx = tokens(1, prompt + new, seed=prompt, device=device)
    reference = copy.deepcopy(model)
    mask = window_or_sinks(idx.shape[1], 8, sinks, device)
    for block in reference.blocks:
        block.attn.window = None
        forward = block.attn.forward
        # (the block hands its padding mask on too: None here, where no row is padded)
        block.attn.forward = lambda x, _forward=forward, attn_mask=None, **kw: _forward(
            x, attn_mask=mask[:x.shape[1], :x.shape[1]], **kw)
    with torch.no_grad():
        full = reference(idx)                                     # (1, T, V)
        caches = model.new_rolling_caches(1, sinks=sinks)
        logits = [model(idx[:, :prompt], caches=caches)]
        logits += [model(idx[:, p:p + 1], caches=caches) for p in range(prompt, idx.shape[1])]
    torch.testing.assert_close(torch.cat(logits, dim=1), full, rtol=1e-9, atol=1e-9)
    # and generate(rolling=True, sinks=2) decodes greedily from those same logits
    out = generate(model, idx[:, :prompt], new, temperature=0, rolling=True, sinks=sinks)
    with torch.no_grad():
        greedy = reference(out[:, :-1]).argmax(-1)
    assert torch.equal(out[:, prompt:], greedy[:, prompt - 1:])


def test_generate_and_new_rolling_caches_refuse_what_they_cannot_do():
    idx = tokens(1, 4)
    with pytest.raises(ValueError, match="sinks=2 are kept by a rolling cache"):
        generate(gpt(), idx, 3, sinks=2)
    with pytest.raises(ValueError, match="use_cache=False"):
        generate(gpt(), idx, 3, rolling=True, use_cache=False)
    with pytest.raises(ValueError, match="sinks must be a non-negative int"):
        generate(gpt(), idx, 3, rolling=True, sinks=-1)
    with pytest.raises(ValueError, match="needs a model with a window"):
        generate(gpt(window=None), idx, 3, rolling=True)
    with pytest.raises(ValueError, match="window=None"):
        gpt(window=None).new_rolling_caches(1)
    with pytest.raises(ValueError, match="learned positions stop at seq_len=16"):
        generate(gpt(position="learned"), idx, 20, rolling=True)
    assert generate(gpt(position="learned"), idx, 13, rolling=True).shape == (1, 17)
    with pytest.raises(ValueError, match="KVCache or RollingKVCache"):
        gpt()(idx, caches=[KVCache(1, 2, 8, 4), "cache"])
