"""multihead.py: MultiHeadAttention against torch.nn.MultiheadAttention, against the same
computation written out, across backends, and with each of its options (RoPE, QK-norm, window,
dropout, cross-attention)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from course_attn import attention
from course_attn.attention import attention_weights
from course_attn.backends import BACKENDS
from course_attn.masks import sliding_window_mask
from course_attn.multihead import MultiHeadAttention, merge_heads, repeat_kv, split_heads
from course_attn.rope import apply_rotary_emb

BACKEND_NAMES = sorted(BACKENDS)
HALF = [torch.float16, torch.bfloat16]
# (rtol, atol) of a module's output in this dtype against float64 (outputs are O(1) or less).
TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 2e-6),
       torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
seeds = st.integers(0, 2 ** 31 - 1)


def randn(*shape, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)


def make(d_model, n_heads, *, seed=0, device="cpu", dtype=torch.float32, **options):
    torch.manual_seed(seed)
    return MultiHeadAttention(d_model, n_heads, **options).to(device, dtype)


def twin(mha, **options):
    """Another module with mha's weights and some options changed."""
    keys = ("n_kv_heads", "bias", "backend", "rope_interleaved", "window", "dropout", "scale",
            "context_dim", "qk_norm_order")
    kwargs = {k: getattr(mha, k) for k in keys if k not in ("bias",)}
    kwargs["bias"] = mha.q_proj.bias is not None
    kwargs["rope"] = mha.rotary is not None
    kwargs["qk_norm"] = mha.q_norm is not None
    if mha.rotary is not None:
        kwargs["rope_base"], kwargs["max_seq_len"] = mha.rotary.base, mha.rotary.max_seq_len
    kwargs.update(options)
    other = MultiHeadAttention(mha.d_model, mha.n_heads, **kwargs)
    other.load_state_dict(mha.state_dict())
    p = next(mha.parameters())
    return other.to(p.device, p.dtype).train(mha.training)


def close(actual, expected, dtype=torch.float32):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=rtol, atol=atol)


def explicit_attention(mha: MultiHeadAttention, x, *, mask=None):
    """MultiHeadAttention (no RoPE, no QK-norm) written out with plain tensor ops, head by head."""
    d = mha.head_dim
    q, k, v = mha.q_proj(x), mha.k_proj(x), mha.v_proj(x)
    group = mha.n_heads // mha.n_kv_heads
    outputs, all_weights = [], []
    for h in range(mha.n_heads):
        kv = h // group
        qh = q[..., h * d:(h + 1) * d]                          # (B, T, D)
        kh, vh = k[..., kv * d:(kv + 1) * d], v[..., kv * d:(kv + 1) * d]
        scores = qh @ kh.transpose(1, 2) / math.sqrt(d)         # (B, T, T)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        all_weights.append(weights)
        outputs.append(weights @ vh)
    return mha.out_proj(torch.cat(outputs, dim=-1)), torch.stack(all_weights, dim=1)


# ---------------------------------------------------------------- heads

def test_split_and_merge_heads_are_inverse():
    x = torch.randn(2, 5, 12)
    heads = split_heads(x, 3)
    assert heads.shape == (2, 3, 5, 4)
    assert torch.equal(heads[:, 1], x[..., 4:8])                # head 1 owns channels 4..7
    assert torch.equal(merge_heads(heads), x)


def test_split_merge_heads_reject_bad_shapes():
    with pytest.raises(ValueError, match="into 5 heads"):
        split_heads(torch.randn(2, 5, 12), 5)
    with pytest.raises(ValueError, match=r"\(B, T, H·D\)"):
        split_heads(torch.randn(5, 12), 3)
    with pytest.raises(ValueError, match=r"\(B, H, T, D\)"):
        merge_heads(torch.randn(2, 5, 12))


def test_repeat_kv_is_re_exported_not_copied():
    assert repeat_kv is attention.repeat_kv


# ---------------------------------------------------------------- the plain module, written out

@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_mha_equals_explicit_computation(device, n_kv_heads):
    mha = make(32, 4, n_kv_heads=n_kv_heads, device=device)
    x = randn(2, 7, 32, device=device)
    out, weights = mha(x, return_weights=True)
    causal = torch.ones(7, 7, dtype=torch.bool, device=device).tril()
    expected_out, expected_weights = explicit_attention(mha, x, mask=causal)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(weights, expected_weights)
    assert weights.shape == (2, 4, 7, 7)


def test_mha_bidirectional_and_with_a_mask(device):
    mha = make(16, 2, device=device)
    x = randn(3, 6, 16, device=device)
    torch.testing.assert_close(mha(x, is_causal=False), explicit_attention(mha, x)[0])
    keep = torch.rand(3, 1, 6, 6, generator=torch.Generator().manual_seed(0)).to(device) > 0.3
    keep[..., 0] = True                                          # no query row left empty
    torch.testing.assert_close(mha(x, attn_mask=keep, is_causal=False),
                               explicit_attention(mha, x, mask=keep[:, 0])[0])


def test_mha_gqa_shapes(device):
    mha = make(64, 8, n_kv_heads=2, bias=True, device=device)
    assert mha.head_dim == 8
    assert mha.q_proj.weight.shape == (64, 64)
    assert mha.k_proj.weight.shape == mha.v_proj.weight.shape == (16, 64)   # 2 heads × 8
    out, weights = mha(randn(3, 5, 64, device=device), return_weights=True)
    assert out.shape == (3, 5, 64) and weights.shape == (3, 8, 5, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 8, 5, device=device))
    assert (weights.triu(1) == 0).all()                          # causal: no future key


def test_mha_dtype_flows_through(device, require_dtype):
    require_dtype(device, torch.float64)
    mha = make(16, 2, device=device, dtype=torch.float64, rope=True, qk_norm=True)
    out, weights = mha(randn(1, 4, 16, device=device, dtype=torch.float64), return_weights=True)
    assert out.dtype == weights.dtype == torch.float64


def test_is_causal_defaults_to_true_for_self_and_false_for_cross_attention(device):
    mha = make(16, 2, device=device)
    x, context = randn(2, 5, 16, device=device), randn(2, 5, 16, seed=1, device=device)
    torch.testing.assert_close(mha(x), mha(x, is_causal=True))
    assert not torch.allclose(mha(x), mha(x, is_causal=False))
    torch.testing.assert_close(mha(x, context=context), mha(x, context=context, is_causal=False))
    assert not torch.allclose(mha(x, context=context), mha(x, context=context, is_causal=True))


# ------------------------------------------------------- against torch.nn.MultiheadAttention

def torch_twin(mha: MultiHeadAttention) -> nn.MultiheadAttention:
    """``nn.MultiheadAttention`` (batch_first) holding mha's weights."""
    bias = mha.q_proj.bias is not None
    ref = nn.MultiheadAttention(mha.d_model, mha.n_heads, bias=bias, batch_first=True,
                                kdim=mha.context_dim, vdim=mha.context_dim)
    p = next(mha.parameters())
    ref = ref.to(p.device, p.dtype)
    with torch.no_grad():
        if mha.context_dim == mha.d_model:
            assert ref._qkv_same_embed_dim and ref.q_proj_weight is None
            ref.in_proj_weight.copy_(torch.cat([mha.q_proj.weight, mha.k_proj.weight,
                                                mha.v_proj.weight]))
        else:   # kdim/vdim other than embed_dim: three separate input projections
            assert not ref._qkv_same_embed_dim and ref.in_proj_weight is None
            ref.q_proj_weight.copy_(mha.q_proj.weight)
            ref.k_proj_weight.copy_(mha.k_proj.weight)
            ref.v_proj_weight.copy_(mha.v_proj.weight)
        ref.out_proj.weight.copy_(mha.out_proj.weight)
        if bias:    # in_proj_bias stays one (3C,) vector either way
            ref.in_proj_bias.copy_(torch.cat([mha.q_proj.bias, mha.k_proj.bias, mha.v_proj.bias]))
            ref.out_proj.bias.copy_(mha.out_proj.bias)
        else:
            assert ref.in_proj_bias is None and ref.out_proj.bias is None
    return ref.eval()


@st.composite
def torch_cases(draw):
    cross = draw(st.booleans())
    n_heads, head_dim = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 5))
    d_model = n_heads * head_dim
    t = draw(st.integers(1, 7))
    return dict(
        b=draw(st.integers(1, 3)), t=t, s=draw(st.integers(1, 7)) if cross else t,
        n_heads=n_heads, d_model=d_model, bias=draw(st.booleans()), cross=cross,
        context_dim=draw(st.sampled_from([d_model, 3, 8])) if cross else d_model,
        causal=False if cross else draw(st.booleans()), padding=draw(st.booleans()),
        seed=draw(seeds),
    )


@given(c=torch_cases())
def test_equals_torch_multihead_attention(device, c):
    """Same weights, same masks (PyTorch's bool masks are True where a key is NOT allowed)."""
    b, t, s = c["b"], c["t"], c["s"]
    mha = make(c["d_model"], c["n_heads"], bias=c["bias"], context_dim=c["context_dim"],
               seed=c["seed"], device=device)
    if c["bias"]:   # nn.Linear's biases are random already; make them larger than the weights'
        with torch.no_grad():
            for proj in (mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj):
                proj.bias.normal_()
    ref = torch_twin(mha)
    x = randn(b, t, c["d_model"], seed=c["seed"], device=device)
    context = randn(b, s, c["context_dim"], seed=c["seed"] + 1, device=device) if c["cross"] else x

    ours_kwargs, torch_kwargs = dict(is_causal=c["causal"]), {}
    if c["cross"]:
        ours_kwargs["context"] = context
    if c["causal"]:
        torch_kwargs["attn_mask"] = ~torch.ones(t, s, dtype=torch.bool, device=device).tril()
    if c["padding"]:                   # right padding, every sequence keeps its first key
        g = torch.Generator().manual_seed(c["seed"])
        lengths = torch.randint(1, s + 1, (b,), generator=g).to(device)
        valid = torch.arange(s, device=device)[None, :] < lengths[:, None]     # (B, S)
        ours_kwargs["attn_mask"] = valid[:, None, None, :]                     # (B, 1, 1, S)
        torch_kwargs["key_padding_mask"] = ~valid
    out, weights = mha(x, return_weights=True, **ours_kwargs)
    expected, expected_weights = ref(x, context, context, need_weights=True,
                                     average_attn_weights=False, **torch_kwargs)
    assert out.shape == (b, t, c["d_model"]) and weights.shape == (b, c["n_heads"], t, s)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", HALF)
def test_equals_torch_multihead_attention_in_half_precision(device, require_dtype, dtype):
    require_dtype(device, dtype)
    mha = make(32, 4, bias=True, device=device, dtype=dtype)
    x = randn(2, 9, 32, device=device, dtype=dtype)
    out = mha(x, is_causal=False)
    assert out.dtype == dtype
    x64 = x.double()
    reference = torch_twin(twin(mha).double())(x64, x64, x64, need_weights=False)[0]
    close(out, reference, dtype)
    assert torch_twin(mha)(x, x, x)[0].dtype == dtype            # and PyTorch's runs in dtype too


# ---------------------------------------------------------------- backends

@st.composite
def module_cases(draw):
    n_kv = draw(st.sampled_from([1, 2, 4]))
    return dict(
        n_kv_heads=n_kv, b=draw(st.integers(1, 2)), t=draw(st.integers(1, 9)),
        window=draw(st.one_of(st.none(), st.integers(1, 10))), rope=draw(st.booleans()),
        qk_norm=draw(st.booleans()), interleaved=draw(st.booleans()), bias=draw(st.booleans()),
        causal=draw(st.booleans()), padding=draw(st.booleans()), seed=draw(seeds),
    )


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@given(c=module_cases())
def test_every_backend_gives_the_same_module_output(device, backend, c):
    options = dict(n_kv_heads=c["n_kv_heads"], window=c["window"], rope=c["rope"],
                   qk_norm=c["qk_norm"], rope_interleaved=c["interleaved"], bias=c["bias"],
                   max_seq_len=4)                                 # T may run past the cache
    reference = make(32, 4, seed=c["seed"], device=device, backend="math", **options)
    mha = twin(reference, backend=backend)
    x = randn(c["b"], c["t"], 32, seed=c["seed"], device=device, dtype=torch.float32)
    kwargs = dict(is_causal=c["causal"])
    if c["padding"]:
        keep = torch.arange(c["t"], device=device) < max(1, c["t"] - 2)
        kwargs["attn_mask"] = keep
    x.requires_grad_()
    out, expected = mha(x, **kwargs), reference(x, **kwargs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad, = torch.autograd.grad(out.square().sum(), x)
    expected_grad, = torch.autograd.grad(expected.square().sum(), x)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_every_backend_in_cross_attention(device, backend):
    reference = make(24, 4, n_kv_heads=2, context_dim=10, qk_norm=True, window=3, device=device)
    mha = twin(reference, backend=backend)
    x, context = randn(2, 3, 24, device=device), randn(2, 8, 10, seed=1, device=device)
    for causal in (False, True):
        torch.testing.assert_close(mha(x, context=context, is_causal=causal),
                                   reference(x, context=context, is_causal=causal))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_every_backend_in_half_precision(device, require_dtype, backend, dtype):
    require_dtype(device, dtype)
    options = dict(n_kv_heads=2, rope=True, qk_norm=True, window=5, backend=backend)
    mha = make(64, 4, device=device, dtype=dtype, **options)
    x = randn(2, 11, 64, device=device, dtype=dtype)
    out = mha(x)
    assert out.dtype == dtype
    close(out, twin(mha, backend="math").double()(x.double()), dtype)


# ---------------------------------------------------------------- what the heads see

@given(c=module_cases())
def test_output_is_the_weights_times_the_projected_values(device, c):
    mha = make(32, 4, seed=c["seed"], device=device, n_kv_heads=c["n_kv_heads"],
               window=c["window"], rope=c["rope"], qk_norm=c["qk_norm"], bias=c["bias"])
    x = randn(c["b"], c["t"], 32, seed=c["seed"], device=device)
    out, weights = mha(x, is_causal=c["causal"], return_weights=True)
    b, t = c["b"], c["t"]
    assert weights.shape == (b, 4, t, t) and weights.dtype == x.dtype
    q, k, v = mha.project(x)
    assert q.shape == (b, 4, t, 8) and k.shape == v.shape == (b, c["n_kv_heads"], t, 8)
    expected_weights = attention_weights(q, k, is_causal=c["causal"], window=c["window"],
                                         enable_gqa=True)
    torch.testing.assert_close(weights, expected_weights)
    torch.testing.assert_close(weights.sum(-1), torch.ones(b, 4, t, device=device))
    per_head = weights @ repeat_kv(v, 4 // c["n_kv_heads"])                   # (B, H, T, D)
    torch.testing.assert_close(out, mha.out_proj(merge_heads(per_head)), rtol=1e-5, atol=1e-5)


def test_window_is_a_sliding_window_mask(device):
    mha = make(16, 2, device=device)
    windowed = twin(mha, window=3)
    x = randn(2, 8, 16, device=device)
    for causal in (True, False):
        mask = sliding_window_mask(8, 8, 3, causal=causal, device=device)
        torch.testing.assert_close(windowed(x, is_causal=causal),
                                   mha(x, attn_mask=mask, is_causal=False))
    assert torch.equal(twin(mha, window=8)(x), mha(x))           # a window as long as T: no-op


def test_scale_option(device):
    mha = make(16, 2, device=device)
    x = randn(1, 5, 16, device=device)
    torch.testing.assert_close(twin(mha, scale=1 / math.sqrt(8))(x), mha(x))
    _, weights = twin(mha, scale=0.0)(x, return_weights=True)
    torch.testing.assert_close(weights[0, 0, 4], torch.full((5,), 0.2, device=device))


# ---------------------------------------------------------------- cross-attention

def test_cross_attention_shapes_and_lengths(device):
    mha = make(24, 4, n_kv_heads=2, context_dim=10, device=device, bias=True)
    assert mha.k_proj.weight.shape == mha.v_proj.weight.shape == (12, 10)
    x, context = randn(3, 5, 24, device=device), randn(3, 9, 10, seed=1, device=device)
    out, weights = mha(x, context=context, return_weights=True)
    assert out.shape == (3, 5, 24) and weights.shape == (3, 4, 5, 9)
    assert (weights > 0).all()                                   # not causal: every key seen
    q, k, v = mha.project(x, context=context)
    assert q.shape == (3, 4, 5, 6) and k.shape == v.shape == (3, 2, 9, 6)
    # Each query attends on its own: the output for one query does not depend on the others.
    torch.testing.assert_close(mha(x[:, 2:3], context=context), out[:, 2:3])


# ---------------------------------------------------------------- dropout

def test_dropout_only_in_training_and_reproducible_under_a_seed(device):
    plain = make(32, 4, n_kv_heads=2, rope=True, device=device)
    dropping = twin(plain, dropout=0.3)
    x = randn(2, 12, 32, device=device)
    torch.testing.assert_close(dropping.eval()(x), plain.eval()(x))      # eval: no dropout
    dropping.train()
    torch.manual_seed(7)
    first = dropping(x)
    torch.manual_seed(7)
    again = dropping(x)
    torch.manual_seed(8)
    other = dropping(x)
    assert torch.equal(first, again)
    assert not torch.allclose(first, plain(x)) and not torch.allclose(first, other)
    torch.testing.assert_close(twin(plain, dropout=0.0).train()(x), plain(x))   # p = 0: no-op


def test_dropout_drops_weights_and_rescales_the_rest(device):
    """With v = identity the output rows are the dropped weights: zeros or weight / (1 - p)."""
    mha = make(8, 1, device=device, dropout=0.5).train()
    with torch.no_grad():
        for proj in (mha.v_proj, mha.out_proj):
            proj.weight.copy_(torch.eye(8))
    x = torch.zeros(1, 8, 8, device=device)
    x[0, :, :] = torch.eye(8, device=device)                     # token j carries e_j
    torch.manual_seed(0)
    out = mha(x, is_causal=False)                               # (1, 8, 8): row i = weights of i
    weights = mha.eval()(x, is_causal=False, return_weights=True)[1][0, 0]
    kept = out[0] != 0
    assert kept.any() and (~kept).any()
    torch.testing.assert_close(out[0][kept], (weights / 0.5)[kept])


class Spy:
    """An attention function that counts its calls and then runs the one it replaces."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("backend", [name for name in BACKEND_NAMES if name != "math"])
def test_a_backend_without_dropout_is_refused_at_construction(backend):
    """Dropout needs the weights, which only "math" builds: no silent switch to it."""
    message = f"dropout=0.1 drops attention weights.*backend='{backend}' takes no dropout"
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(32, 4, backend=backend, dropout=0.1)
    from course_attn.model import GPT, GPTConfig
    with pytest.raises(ValueError, match=message):
        GPT(GPTConfig(vocab_size=5, seq_len=4, d_model=32, backend=backend, dropout=0.1))
    MultiHeadAttention(32, 4, backend=backend, dropout=0.0)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_training_runs_the_chosen_backend(device, backend, monkeypatch):
    mha = make(32, 4, n_kv_heads=2, device=device, backend=backend, window=3).train()
    spy = Spy(BACKENDS[backend])
    monkeypatch.setitem(BACKENDS, backend, spy)
    mha(randn(2, 5, 32, device=device)).sum().backward()
    assert spy.calls == 1


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("backend", ["math", "flash"])
def test_return_weights_computes_attention_once(device, backend, training, monkeypatch):
    """The output comes from the weights returned (dropped out in training), as the backend
    would give it."""
    dropout = 0.5 if training and backend == "math" else 0.0
    mha = make(32, 4, n_kv_heads=2, device=device, backend=backend, dropout=dropout, window=4)
    mha.train(training)
    x = randn(2, 6, 32, device=device)
    torch.manual_seed(3)
    expected = mha(x)
    weights_spy = Spy(attention_weights)
    backend_spy = Spy(BACKENDS[backend])
    monkeypatch.setattr("course_attn.multihead.attention_weights", weights_spy)
    monkeypatch.setitem(BACKENDS, backend, backend_spy)
    torch.manual_seed(3)
    out, weights = mha(x, return_weights=True)
    assert (weights_spy.calls, backend_spy.calls) == (1, 0)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights[..., 0]))


# ---------------------------------------------------------------- RoPE in the module

@given(t=st.integers(1, 9), shift=st.integers(0, 5000), n_kv_heads=st.sampled_from([1, 2, 4]),
       interleaved=st.booleans(), qk_norm=st.booleans(), seed=seeds)
def test_rope_module_sees_only_relative_positions(device, t, shift, n_kv_heads, interleaved,
                                                 qk_norm, seed):
    """Moving every token by the same number of positions changes no score."""
    mha = make(32, 4, n_kv_heads=n_kv_heads, rope=True, rope_interleaved=interleaved,
               qk_norm=qk_norm, max_seq_len=16, seed=seed, device=device)
    x = randn(2, t, 32, seed=seed, device=device)
    shifted = torch.arange(shift, shift + t, device=device)
    torch.testing.assert_close(mha(x, positions=shifted), mha(x), rtol=1e-4, atol=1e-5)


def test_rope_module_rotates_q_and_k_by_position(device):
    mha = make(16, 2, rope=True, device=device)
    x = randn(2, 6, 16, device=device)
    positions = torch.tensor([0, 5, 2, 9, 9, 1], device=device)
    q, k, v = mha.project(x, positions=positions)
    cos, sin = mha.rotary(positions)
    torch.testing.assert_close(q, apply_rotary_emb(split_heads(mha.q_proj(x), 2), cos, sin))
    torch.testing.assert_close(k, apply_rotary_emb(split_heads(mha.k_proj(x), 2), cos, sin))
    torch.testing.assert_close(v, split_heads(mha.v_proj(x), 2))   # values are not rotated
    assert not torch.allclose(mha(x, positions=positions), mha(x))
    # Without RoPE the module has no notion of position: permuting the keys changes nothing.
    plain = twin(mha, rope=False)
    perm = torch.tensor([3, 0, 5, 1, 4, 2], device=device)
    context = randn(2, 6, 16, seed=1, device=device)
    torch.testing.assert_close(plain(x, context=context[:, perm]), plain(x, context=context))


def test_rope_module_runs_past_its_cache(device):
    short = make(16, 2, n_kv_heads=1, rope=True, max_seq_len=4, device=device)
    long = twin(short, max_seq_len=64)
    x = randn(2, 20, 16, device=device)
    torch.testing.assert_close(short(x), long(x))


def test_interleaved_rope_equals_half_split_with_permuted_projections(device):
    """Meta's and Hugging Face's Llama checkpoints differ by a permutation of each head's rows
    of Wq and Wk: the same model, with the two pairings."""
    interleaved = make(32, 4, n_kv_heads=2, rope=True, rope_interleaved=True, qk_norm=True,
                       device=device)
    with torch.no_grad():
        for norm in (interleaved.q_norm, interleaved.k_norm):
            norm.weight.copy_(torch.rand(8) + 0.5)
    half_split = twin(interleaved, rope_interleaved=False)
    perm = torch.cat((torch.arange(0, 8, 2), torch.arange(1, 8, 2)))
    with torch.no_grad():
        for proj, norm, heads in ((half_split.q_proj, half_split.q_norm, 4),
                                  (half_split.k_proj, half_split.k_norm, 2)):
            rows = torch.cat([h * 8 + perm for h in range(heads)])
            proj.weight.copy_(proj.weight[rows.to(device)])
            norm.weight.copy_(norm.weight[perm.to(device)])
    x = randn(2, 7, 32, device=device)
    torch.testing.assert_close(half_split(x), interleaved(x))
    assert not torch.allclose(twin(interleaved, rope_interleaved=False)(x), interleaved(x))


# ---------------------------------------------------------------- QK-norm

@given(which=st.sampled_from(["q_proj", "k_proj"]), factor=st.floats(0.05, 50.0),
       order=st.sampled_from(["before_rope", "after_rope"]), rope=st.booleans(),
       n_kv_heads=st.sampled_from([1, 4]), seed=seeds)
def test_qk_norm_makes_the_output_blind_to_the_scale_of_q_and_k(device, which, factor, order,
                                                                rope, n_kv_heads, seed):
    mha = make(32, 4, n_kv_heads=n_kv_heads, qk_norm=True, qk_norm_order=order, rope=rope,
               seed=seed, device=device)
    scaled = twin(mha)
    for m in (mha, scaled):        # exactly blind with eps = 0; eps = 1e-6 matters for tiny q
        m.q_norm.eps = m.k_norm.eps = 0.0
    with torch.no_grad():
        getattr(scaled, which).weight.mul_(factor)
    x = randn(2, 6, 32, seed=seed, device=device)
    torch.testing.assert_close(scaled(x), mha(x), rtol=1e-4, atol=1e-5)


def test_without_qk_norm_the_scale_of_q_changes_the_output(device):
    mha = make(32, 4, device=device)
    scaled = twin(mha)
    with torch.no_grad():
        scaled.q_proj.weight.mul_(10.0)
    x = randn(2, 6, 32, device=device)
    assert not torch.allclose(scaled(x), mha(x), atol=1e-3)


def test_qk_norm_divides_each_head_by_its_rms(device):
    mha = make(32, 4, n_kv_heads=2, qk_norm=True, device=device)
    x = randn(2, 5, 32, device=device)
    q, k, _ = mha.project(x)
    torch.testing.assert_close(q.square().mean(-1), torch.ones(2, 4, 5, device=device),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k.square().mean(-1), torch.ones(2, 2, 5, device=device),
                               rtol=1e-4, atol=1e-4)
    assert mha.q_norm.weight.shape == mha.k_norm.weight.shape == (8,)


@pytest.mark.parametrize("interleaved", [False, True])
def test_qk_norm_before_or_after_rope(device, interleaved):
    """RMS is unchanged by a rotation, so with gains that are equal within each rotated pair
    (all ones included), norming before or after RoPE is the same; other gains are not."""
    before = make(32, 4, n_kv_heads=2, rope=True, rope_interleaved=interleaved, qk_norm=True,
                  qk_norm_order="before_rope", device=device)
    x = randn(2, 7, 32, device=device)

    def after(gains=None):
        other = twin(before, qk_norm_order="after_rope")
        if gains is not None:
            with torch.no_grad():
                for m in (before, other):
                    m.q_norm.weight.copy_(gains)
                    m.k_norm.weight.copy_(gains.flip(0))
        return other

    torch.testing.assert_close(after()(x), before(x))                         # unit gains
    pair_gains = torch.tensor([0.5, 2.0, 1.5, 0.7], device=device)          # one per pair
    paired = pair_gains.repeat_interleave(2) if interleaved else pair_gains.repeat(2)
    torch.testing.assert_close(after(paired)(x), before(x))
    uneven = torch.linspace(0.2, 3.0, 8, device=device)
    assert not torch.allclose(after(uneven)(x), before(x), atol=1e-4)


# ---------------------------------------------------------------- half precision

@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("options", [dict(), dict(rope=True, qk_norm=True, n_kv_heads=1),
                                     dict(rope=True, rope_interleaved=True, window=3, bias=True)],
                         ids=["plain", "rope+qk_norm+mqa", "interleaved+window+bias"])
def test_half_precision_module_against_float64(device, require_dtype, dtype, options):
    require_dtype(device, dtype)
    mha = make(32, 4, device=device, dtype=dtype, max_seq_len=8, **options)
    x = randn(2, 13, 32, device=device, dtype=dtype)
    positions = torch.arange(3000, 3013, device=device)         # past the cache, large angles
    out, weights = mha(x, positions=positions, return_weights=True)
    assert out.dtype == weights.dtype == dtype
    assert mha.rotary is None or mha.rotary.cos_cached.dtype == torch.float32
    reference = twin(mha).double()
    close(out, reference(x.double(), positions=positions), dtype)


# ---------------------------------------------------------------- invalid configurations

@pytest.mark.parametrize("args, kwargs, message", [
    ((30, 4), {}, "d_model=30 is not divisible by n_heads=4"),
    ((32, 4), dict(n_kv_heads=3), "n_heads=4 is not a multiple of n_kv_heads=3"),
    ((32, 4), dict(backend="nope"), "unknown attention backend 'nope'"),
    ((32, 0), {}, "n_heads must be a positive int, got 0"),
    ((0, 4), {}, "d_model must be a positive int, got 0"),
    ((32, 4), dict(n_kv_heads=0), "n_kv_heads must be a positive int, got 0"),
    ((32, 4), dict(context_dim=-1), "context_dim must be a positive int, got -1"),
    ((32, 4.0), {}, "n_heads must be a positive int, got 4.0"),
    ((12, 4), dict(rope=True), "head_dim = d_model / n_heads = 12 / 4 = 3 is odd"),
    ((32, 4), dict(rope=True, rope_base=1.0), "base must be a number > 1, got 1.0"),
    ((32, 4), dict(rope=True, max_seq_len=0), "max_seq_len must be a positive int, got 0"),
    ((32, 4), dict(qk_norm=True, qk_norm_order="after"),
     "qk_norm_order must be 'before_rope' or 'after_rope', got 'after'"),
    ((32, 4), dict(window=0), "window must be None or an int >= 1, got 0"),
    ((32, 4), dict(window=2.5), "window must be None or an int >= 1, got 2.5"),
    ((32, 4), dict(dropout=1.0), r"dropout must be a probability in \[0, 1\), got 1.0"),
    ((32, 4), dict(dropout=-0.1), r"dropout must be a probability in \[0, 1\), got -0.1"),
    ((32, 4), dict(scale="0.5"), "scale must be a number or None, got '0.5'"),
])
def test_invalid_configurations(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(*args, **kwargs)


def test_odd_head_dim_is_fine_without_rope():
    assert MultiHeadAttention(12, 4).head_dim == 3


def test_invalid_calls(device):
    mha = make(32, 4, context_dim=10, device=device)
    x = randn(2, 5, 32, device=device)
    with pytest.raises(ValueError, match=r"x must be \(B, T, C=32\), got \(2, 5, 16\)"):
        mha(randn(2, 5, 16, device=device))
    with pytest.raises(ValueError, match=r"x must be \(B, T, C=32\), got \(5, 32\)"):
        mha(randn(5, 32, device=device))
    wrong = r"context must be \(B=2, S, context_dim=10\), got "
    with pytest.raises(ValueError, match=wrong + r"\(2, 7, 32\)"):
        mha(x, context=randn(2, 7, 32, device=device))
    with pytest.raises(ValueError, match=wrong + r"\(3, 7, 10\)"):
        mha(x, context=randn(3, 7, 10, device=device))
    with pytest.raises(ValueError, match=r"got list"):
        mha(x, context=[[0.0] * 10])
    with pytest.raises(ValueError, match="does not broadcast"):
        mha(x, context=randn(2, 7, 10, device=device),
            attn_mask=torch.ones(5, 5, dtype=torch.bool, device=device))
    rope = make(32, 4, rope=True, device=device)
    with pytest.raises(ValueError, match="not defined for cross-attention"):
        rope(x, context=x)
    with pytest.raises(ValueError, match=r"positions must be a \(5,\) tensor .*got \(4,\)"):
        rope(x, positions=torch.arange(4, device=device))
    with pytest.raises(ValueError, match="positions must be >= 0"):
        rope(x, positions=torch.arange(-1, 4, device=device))
    with pytest.raises(ValueError, match="integer tensor"):
        rope(x, positions=torch.arange(5.0, device=device))


def test_repr_lists_the_options():
    text = repr(MultiHeadAttention(32, 4, n_kv_heads=2, rope=True, qk_norm=True, window=4,
                                   dropout=0.1, context_dim=32))
    for part in ("n_kv_heads=2", "qk_norm='before_rope'", "window=4", "dropout=0.1",
                 "RotaryEmbedding(head_dim=8", "q_norm): RMSNorm(8"):
        assert part in text, text
