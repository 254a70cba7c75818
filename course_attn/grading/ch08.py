"""Exercises of Chapter 8, the KV cache.

    ch08.fill_cache       fill_cache(k_chunks, v_chunks, max_seq_len) -> [(k, v), ...]: write
                          each chunk (B, H, T_i, D) in place into buffers preallocated once at
                          max_seq_len, at the current length; after each write, the valid prefix
                          (B, H, length, D) of each buffer
    ch08.decode_step      decode_step(q_new, k_new, v_new, k_past, v_past, cos, sin)
                          -> (B, H, T_new, Dv): rotate the new queries and keys at positions
                          L .. L + T_new - 1 (L = the cached length), append the new keys and
                          values to the cached ones, attend with the bottom-right causal mask
    ch08.decode_savings   decode_savings(L, C, V, H, G, prompts, N) -> dict: multiply-adds of a
                          batch of prompts of different lengths, padded and not, prefilled,
                          one decode step and a whole generation with the cache, for a GPT of
                          L layers, width C, vocabulary V, H query and G key-value heads
                          (derive: compared with the formulas, on public and hidden sizes)
    ch08.greedy_decode    greedy_decode(params, prompt, n_new) -> (n_new, V) logits: repair a
                          given greedy loop with a cache whose decode steps rotate their token at
                          position 0 (debug: graded on the logits, on hidden models and prompts)
    ch08.first_divergence first_divergence(params, prompt, n_new, chunk) -> int: how many new
                          tokens the buggy loop, its prompt prefilled in chunks of ``chunk``
                          tokens, and the model run without a cache agree on before the first
                          that differs (measure: compared exactly, on hidden models, prompts and
                          chunks; it needs nothing of the student's greedy_decode)

References: ``course_attn.KVCache``; ``course_attn.apply_rotary_emb`` and
``course_attn.scaled_dot_product_attention``; the counts from M(Tq, Tk) = Tq·a + L·2·Tq·Tk·C,
with k and v of width G·C/H in a.
"""

import math

import torch

from ..attention import scaled_dot_product_attention
from ..kv_cache import KVCache
from ..masks import causal_mask
from ..rope import apply_rotary_emb
from .cases import count_questions, expect_tensor, randn
from .exercise import Case, Exercise, Mistake, register
from .operations import ELEMENTARY, GROWING, NONE, NO_LIBRARY_ATTENTION, SOFTMAX

NO_GROWING = ("course_attn", "torch.cat", "torch.concat", "torch.concatenate", "torch.stack",
              "torch.hstack", "torch.vstack", "torch.dstack", "torch.column_stack",
              "torch.Tensor.resize_", "torch.nn.functional.pad")


# --- ch08.fill_cache -----------------------------------------------------------------------------

def fill_cache_reference(k_chunks, v_chunks, max_seq_len):
    """Every chunk written into one ``KVCache`` -> the valid prefixes after each write."""
    b, h, _, d = k_chunks[0].shape
    cache = KVCache(b, h, max_seq_len, d, value_dim=v_chunks[0].shape[-1],
                    dtype=k_chunks[0].dtype, device=k_chunks[0].device)
    return [tuple(t.clone() for t in cache.update(k, v)) for k, v in zip(k_chunks, v_chunks)]


def _prefix_pair(i, pair):
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise AssertionError(f"entry {i} of your list should be a pair (k, v) of tensors, got "
                             f"{type(pair).__name__}")
    return pair


def expect_prefixes(actual, expected, case=None) -> None:
    """A list with one pair (k, v) per chunk, each as ``expect_tensor`` wants it."""
    if not isinstance(actual, (list, tuple)):
        raise AssertionError(f"your function should return a list of (k, v) pairs, got "
                             f"{type(actual).__name__}")
    if len(actual) != len(expected):
        raise AssertionError(f"your list has {len(actual)} entries, one per chunk is "
                             f"{len(expected)}")
    for i, (pair, (k, v)) in enumerate(zip(actual, expected)):
        for name, got, want in zip(("k", "v"), _prefix_pair(i, pair), (k, v)):
            try:
                expect_tensor(got, want, case)
            except AssertionError as error:
                raise AssertionError(f"after chunk {i} ({name}): {error}") from None


def _chunks(sizes, b, h, d, dv, seed, dtype=torch.float32):
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    ks = [randn(b, h, t, d, seed=g, dtype=dtype) for t in sizes]
    vs = [randn(b, h, t, dv, seed=g, dtype=dtype) for t in sizes]
    return ks, vs


def _fill_cases():
    ks, vs = _chunks((3, 1, 1), 1, 2, 4, 4, seed=800)
    yield Case("a prompt of 3, then two single tokens; B=1, H=2, D=4, room for 8",
               (ks, vs, 8), hint="write each chunk at the current length, then return the first "
                                 "`length` positions of each buffer")
    ks, vs = _chunks((2, 3, 1), 2, 1, 3, 3, seed=801)
    yield Case("chunks of 2, 3 and 1 (a chunked prefill); room for exactly 6", (ks, vs, 6),
               hint="a chunk of T_new tokens moves the length on by T_new")
    ks, vs = _chunks((4,), 1, 3, 2, 2, seed=802)
    yield Case("a single chunk of 4 in room for 6", (ks, vs, 6),
               hint="return the filled prefix only: the unwritten positions are not part of "
                    "the sequence")
    ks, vs = _chunks((2, 2, 1), 2, 2, 5, 3, seed=803)
    yield Case("values narrower than keys: D=5, Dv=3; B=2", (ks, vs, 7),
               hint="the value buffer has the values' width Dv, the key buffer the keys' D")
    ks, vs = _chunks((1, 1, 1, 1), 1, 2, 4, 4, seed=804)
    yield Case("four single tokens, room for exactly 4", (ks, vs, 4),
               hint="write token t at position t")
    ks, vs = _chunks((2, 1), 1, 2, 4, 4, seed=805, dtype=torch.float64)
    yield Case("float64 chunks", (ks, vs, 5),
               hint="allocate the buffers in the chunks' dtype (and on their device)")


def _fill_wrong(*, at=None, step=None, whole=False, only_new=False, dtype=None, views=True):
    """A student's fill_cache with one mistake: ``at`` fixes where every chunk is written,
    ``step`` the length a chunk adds, ``whole`` returns the whole buffers, ``only_new`` the new
    chunk, ``dtype`` allocates the buffers in that dtype. ``views``: returns slices of the
    buffers (which show every later write), as the solution does, else copies made at once."""
    keep = (lambda t: t) if views else torch.clone
    def fill(k_chunks, v_chunks, max_seq_len):
        b, h, _, d = k_chunks[0].shape
        dt = k_chunks[0].dtype if dtype is None else dtype
        k_buf = torch.zeros(b, h, max_seq_len, d, dtype=dt)
        v_buf = torch.zeros(b, h, max_seq_len, v_chunks[0].shape[-1], dtype=dt)
        length, out = 0, []
        for k, v in zip(k_chunks, v_chunks):
            t = k.shape[2]
            start = length if at is None else at
            k_buf[:, :, start:start + t] = k
            v_buf[:, :, start:start + t] = v
            length += t if step is None else step
            if only_new:
                out.append((k, v))
            elif whole:
                out.append((keep(k_buf), keep(v_buf)))
            else:
                out.append((keep(k_buf[:, :, :length]), keep(v_buf[:, :, :length])))
        return out
    return fill


register(Exercise(
    key="ch08.fill_cache", function="fill_cache", reference=fill_cache_reference,
    task="warm-up",  # KVCache.update of section 2, written out: a first step, fewer points
    ops=ELEMENTARY - GROWING,
    cases=_fill_cases, compare=expect_prefixes, banned=NO_GROWING,
    mistakes=tuple(
        Mistake(hint, _fill_wrong(views=views, **wrong))
        for hint, wrong in (
            ("you wrote every chunk at position 0: a new chunk goes after the ones already "
             "cached, at the current length", dict(at=0)),
            ("you returned the whole buffers: only the first `length` positions hold the "
             "sequence; return that prefix", dict(whole=True)),
            ("you moved the length on by one per chunk: a chunk of T_new tokens fills T_new "
             "positions", dict(step=1)),
            ("your buffers are float32 whatever the chunks are: allocate them in the chunks' "
             "dtype", dict(dtype=torch.float32)))
        for views in (True, False)) + (
        Mistake("you returned only the new chunk: the attention of a step needs every key and "
                "value so far, the cache's valid prefix", _fill_wrong(only_new=True)),
    ),
))


# --- ch08.decode_step ----------------------------------------------------------------------------

def rope_tables(p, d, base=10000.0, dtype=torch.float32):
    """cos, sin of the angles m·θ_i for positions m = 0 .. p-1, (p, d/2), computed in float64."""
    i = torch.arange(d // 2, dtype=torch.float64)
    angles = torch.arange(p, dtype=torch.float64)[:, None] * base ** (-2.0 * i / d)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def decode_step_reference(q_new, k_new, v_new, k_past, v_past, cos, sin):
    """(B, H, T_new, D) x3 (not rotated), cache (B, H, L, D) rotated and (B, H, L, Dv), tables
    (P, D/2) -> (B, H, T_new, Dv)."""
    start, t = k_past.shape[2], q_new.shape[2]
    c, s = cos[start:start + t], sin[start:start + t]
    k = torch.cat([k_past, apply_rotary_emb(k_new, c, s)], dim=2)
    v = torch.cat([v_past, v_new], dim=2)
    return scaled_dot_product_attention(apply_rotary_emb(q_new, c, s), k, v, is_causal=True)


def _step_case(name, b, h, length, t_new, d, dv, extra, seed, hint, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    cos, sin = rope_tables(length + t_new + extra, d, dtype=dtype)
    q, k = (randn(b, h, t_new, d, seed=g, dtype=dtype, scale=2.0) for _ in range(2))
    v = randn(b, h, t_new, dv, seed=g, dtype=dtype)
    k_past = apply_rotary_emb(randn(b, h, length, d, seed=g, dtype=dtype, scale=2.0),
                              cos[:length], sin[:length])
    v_past = randn(b, h, length, dv, seed=g, dtype=dtype)
    return Case(name, (q, k, v, k_past, v_past, cos, sin), hint=hint)


def _step_cases():
    yield _step_case("one decode step: T_new=1 after L=6 cached; B=1, H=2, D=8", 1, 2, 6, 1, 8, 8,
                     0, 810, "the new token sits at position L: rotate it there, and let it "
                             "attend to all L + 1 keys")
    yield _step_case("a chunk: T_new=3 after L=5, tables for 12 positions", 1, 2, 5, 3, 8, 8, 4,
                     811, "query i of the chunk sits at position L + i and may see keys "
                          "0 .. L + i")
    yield _step_case("a prefill: an empty cache, L=0, T_new=4", 2, 2, 0, 4, 4, 4, 2, 812,
                     "with nothing cached this is ordinary causal self-attention with RoPE "
                     "from position 0")
    yield _step_case("Dv=3, D=6, B=2, H=3: T_new=2 after L=3", 2, 3, 3, 2, 6, 3, 3, 813,
                     "the output has the values' width Dv")
    yield _step_case("float64: T_new=2 after L=9, tables for 16 positions", 1, 1, 9, 2, 4, 4, 5,
                     814, "do not convert the inputs; let their dtype flow through",
                     dtype=torch.float64)


def _rope(x, cos, sin, start):
    """As a student writes it: half-split RoPE at positions start .. start + T - 1."""
    t, half = x.shape[2], x.shape[-1] // 2
    c, s = cos[start:start + t], sin[start:start + t]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)


def _attend(q, k, v, mask):
    """softmax(q kᵀ / sqrt(D), keys outside ``mask`` removed) v, as a student writes it."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _step_wrong(*, q_at=None, k_at=None, rerotate=False, align="bottom_right", cache=True,
                rotate_v=False, rotate_k=True, last_rows=False):
    """decode_step with one mistake: ``q_at``/``k_at`` the start position of the new tokens'
    rotation (None: L), ``rerotate`` rotates the cached keys again at 0 .. L-1, ``align`` of the
    causal mask (None: no mask), ``cache=False`` ignores the cache, ``rotate_v`` rotates the
    values too, ``rotate_k=False`` leaves the new keys unrotated, ``last_rows`` rotates with
    the last T_new rows of the tables."""
    def step(q_new, k_new, v_new, k_past, v_past, cos, sin):
        length, t = k_past.shape[2], q_new.shape[2]
        start = cos.shape[0] - t if last_rows else length
        q = _rope(q_new, cos, sin, start if q_at is None else q_at)
        k = _rope(k_new, cos, sin, start if k_at is None else k_at) if rotate_k else k_new
        v = _rope(v_new, cos, sin, start) if rotate_v else v_new
        if rerotate:
            k_past = _rope(k_past, cos, sin, 0)
        if cache:
            k, v = torch.cat([k_past, k], dim=2), torch.cat([v_past, v], dim=2)
        mask = None if align is None else causal_mask(t, k.shape[2], align=align)
        return _attend(q, k, v, mask)
    return step


register(Exercise(
    key="ch08.decode_step", function="decode_step", reference=decode_step_reference,
    task="implement", ops=ELEMENTARY | SOFTMAX,
    cases=_step_cases, compare=expect_tensor, banned=NO_LIBRARY_ATTENTION,
    mistakes=(
        Mistake("your causal mask is aligned top-left (PyTorch's is_causal): the new queries are "
                "the LAST T_new positions, so query i sits at L + i, not at i",
                _step_wrong(align="top_left")),
        Mistake("you rotated the new tokens at positions 0 .. T_new-1, as if the cache were "
                "empty: where do they sit in the whole sequence?", _step_wrong(q_at=0, k_at=0)),
        Mistake("you rotated the new queries as if the cache were empty (from position 0), "
                "and the new keys elsewhere: the two disagree", _step_wrong(q_at=0)),
        Mistake("you rotated the new keys as if the cache were empty (from position 0), and "
                "the new queries elsewhere: the two disagree", _step_wrong(k_at=0)),
        Mistake("you rotated the cached keys again: they were rotated when they were written, "
                "at their own positions", _step_wrong(rerotate=True)),
        Mistake("you attended to the new keys only: the queries must see the cached keys and "
                "values too", _step_wrong(cache=False)),
        Mistake("you left out the causal mask: within a chunk, a new token may not see the new "
                "tokens after it", _step_wrong(align=None)),
        Mistake("you rotated the values: RoPE turns only the queries and the keys",
                _step_wrong(rotate_v=True)),
        Mistake("you did not rotate the new keys: RoPE turns the keys as well as the queries",
                _step_wrong(rotate_k=False)),
        Mistake("you took the last rows of cos and sin: the tables cover positions 0 .. P-1, "
                "which can be more than the sequence so far; index them by position",
                _step_wrong(last_rows=True)),
    ),
))


# --- ch08.decode_savings: the work of a batch of prompts with a cache and grouped heads ---------
#
# The chapter counts one sequence of a plain GPT. The exercise asks for what it does not show:
# a batch of B prompts of different lengths, left-padded to the longest (P_max) as a batched
# generation holds them, through a model whose attention has G key-value heads for its H query
# heads (grouped-query attention, chapter 7). What changes: the padded batch computes every row
# at P_max (the pad positions too, masked), the ragged one each prompt at its own length; with
# G < H the key and value projections map C to G·D (D = C / H), while every query head still
# compares its query with every key.

# The public sizes (inputs, not measurements). GPT-2 small (Radford et al. 2019, the released
# configuration: 12 layers, width 768, 12 heads, a vocabulary of 50257) with a batch of three
# prompts; the chapter's decode model (GPTConfig's defaults: 2 layers, width 64, 4 heads, a
# vocabulary of 64) with 2 key-value heads and two prompts; the same with one key-value head
# (multi-query), one prompt and one new token.
GPT2_SMALL_SIZES = dict(L=12, C=768, V=50257, H=12, G=12, prompts=[512, 200, 64], N=256)
DECODE_MODEL_SIZES = dict(L=2, C=64, V=64, H=4, G=2, prompts=[16, 9], N=48)
ONE_PROMPT_SIZES = dict(L=2, C=64, V=64, H=4, G=1, prompts=[12], N=1)
SAVING_SIZES = (GPT2_SMALL_SIZES, DECODE_MODEL_SIZES, ONE_PROMPT_SIZES)

SAVING_QUESTIONS = {
    "prefill_padded": (
        "(a) the prefill of the batch, padded",
        "a padded batch computes every row at the longest prompt's length, pad positions "
        "included"),
    "prefill_ragged": (
        "(b) the same prefill, each prompt on its own",
        "each prompt goes through the model at its own length"),
    "step": (
        "(c) the first decode step of the padded batch",
        "every sequence of the batch feeds one token, whose query meets the keys of the "
        "padded cache and its own"),
    "generate": (
        "(d) the whole generation of the padded batch, with the cache",
        "the padded prefill gives every sequence its first new token; single-token steps of "
        "the batch follow, each against one key more than the one before"),
}


def _macs(tq, tk, L, C, V, H, G, *, mlp=True, head=True, products=2, full_kv=False,
          grouped_attention=False):
    """Multiply-adds of one sequence's pass of tq tokens against tk keys: the projections (q
    and o (C, C), k and v (C, G·C/H), or (C, C) with ``full_kv``), the MLP, the LM head, and
    the attention of the H query heads (of G heads with ``grouped_attention``)."""
    kv = C if full_kv else G * (C // H)
    per_token = L * (2 * C * C + 2 * C * kv + (8 * C * C if mlp else 0)) + (C * V if head else 0)
    heads = G if grouped_attention else H
    return tq * per_token + L * products * tq * tk * (C // H) * heads


def _savings(L, C, V, H, G, prompts, N, *, padded=True, ragged_at=None, batch=None,
             step_keys=1, extra_steps=0, prefill=True, **rule):
    """The four counts, with M(tq, tk) = ``_macs`` under ``rule``. ``padded=False`` counts
    each sequence at its own length everywhere (no padding); ``ragged_at`` the length each
    prompt of (b) is counted at (else its own); ``batch`` the sequences a step counts (else
    B); ``step_keys`` the keys of the first step beyond P_max; ``extra_steps`` the decode
    steps of (d) beyond N - 1; ``prefill=False`` leaves the prefill out of (d). Sums of at most N terms."""
    def m(tq, tk):
        return _macs(tq, tk, L, C, V, H, G, **rule)
    b, longest = len(prompts), max(prompts)
    lengths = list(prompts) if not padded else [longest] * b
    n_steps = N - 1 + extra_steps

    def generation(p):
        return (m(p, p) if prefill else 0) + sum(m(1, t) for t in range(p + 1, p + 1 + n_steps))
    return {"prefill_padded": sum(m(p, p) for p in lengths),
            "prefill_ragged": sum(m(p, p) for p in (prompts if ragged_at is None else
                                                    [ragged_at(prompts)] * b)),
            "step": (b if batch is None else batch) * m(1, longest + step_keys) if padded else
            sum(m(1, p + step_keys) for p in prompts),
            "generate": sum(generation(p) for p in lengths)}


def decode_savings_reference(L, C, V, H, G, prompts, N):
    """The four counts, from M(Tq, Tk) = Tq·(L·(2C² + 2C·G·C/H + 8C²) + C·V) + L·2·Tq·Tk·C."""
    return _savings(L, C, V, H, G, prompts, N)


SAVINGS = count_questions(SAVING_QUESTIONS)


def _counting(**rule):
    """A typical wrong answer, a function of the sizes: every count under ``rule``."""
    def fn(L, C, V, H, G, prompts, N):
        return _savings(L, C, V, H, G, prompts, N, **rule)
    return fn


def _flops(L, C, V, H, G, prompts, N):
    return {k: 2 * v for k, v in decode_savings_reference(L, C, V, H, G, prompts, N).items()}


register(Exercise(
    key="ch08.decode_savings", function="decode_savings", reference=decode_savings_reference,
    task="derive",
    ops=NONE,
    cases=lambda: SAVINGS.cases(*SAVING_SIZES), compare=SAVINGS.compare, banned=("course_attn",),
    mistakes=(
        Mistake("you counted 2 FLOPs per multiply-add: the question asks for multiply-adds",
                _flops),
        Mistake("your key and value projections map C to C: with G key-value heads of width "
                "C / H each, they are narrower than the query's", _counting(full_kv=True)),
        Mistake("you shrank the attention with the key-value heads: each of the H query heads "
                "still compares its query with every key and sums every value",
                _counting(grouped_attention=True)),
        Mistake("you counted every sequence at its own length: a padded batch is one tensor, "
                "every row as long as the longest prompt, and its cache too",
                _counting(padded=False)),
        Mistake("you counted each prompt on its own at the longest prompt's length: without "
                "padding a prompt costs its own length", _counting(ragged_at=max)),
        Mistake("your decode step counts one sequence: each of the B sequences feeds a token",
                _counting(batch=1)),
        Mistake("your decode step's query meets the cached keys only: its own key is written "
                "to the cache before it attends", _counting(step_keys=0)),
        Mistake("you left out the LM head: every token that goes through the model also meets "
                "the (C, V) output matrix", _counting(head=False)),
        Mistake("you left out the MLP: each layer's feed-forward network costs more than its "
                "attention projections", _counting(mlp=False)),
        Mistake("you counted only the scores q kᵀ: the weighted sum of the values is a second "
                "product of the same size", _counting(products=1)),
        Mistake("you left out the prefill: the cached generation first runs the padded "
                "prompts, which gives every sequence its first new token",
                _counting(prefill=False)),
        Mistake("you counted N decode steps after the prefill: the prefill already gives the "
                "first new token, so N - 1 steps follow", _counting(extra_steps=1)),
    ),
))


# --- ch08.greedy_decode (debug): a decode loop whose RoPE positions restart at 0 ---------------
#
# A toy one-layer attention-only model, in float64 so that no argmax is ever decided by
# rounding: the weights are a dict of tensors, one projection per head,
#   embed (V, C), wq / wk / wv (H, C, D), wo (H, D, C), unembed (C, V);
# logits = (x + Σ_h attn_h(x) wo_h) unembed, attn_h with RoPE (half-split pairs) and the causal
# mask. The notebook gives a greedy loop with a cache (a prefill of the prompt, then one token a
# step) whose step rotates its new tokens at positions 0 .. T_new - 1, as if each step began a
# sequence: the prefill is right, every decode step is wrong. The student repairs it.

def toy_model(seed, vocab=16, width=16, heads=2, head_dim=8):
    """The weights of a seeded toy model (float64); ``seed`` an int or a generator. Queries and
    keys are drawn twice the unit scale, so that attention is peaked enough to move the argmax,
    and the heads' output as large as the residual."""
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)

    def draw(*shape, scale):
        return randn(*shape, seed=g, dtype=torch.float64, scale=scale)
    c = float(width)
    return {"embed": draw(vocab, width, scale=1.0),
            "wq": draw(heads, width, head_dim, scale=2 / math.sqrt(c)),
            "wk": draw(heads, width, head_dim, scale=2 / math.sqrt(c)),
            "wv": draw(heads, width, head_dim, scale=1 / math.sqrt(c)),
            "wo": draw(heads, head_dim, width, scale=2 / math.sqrt(heads * head_dim)),
            "unembed": draw(width, vocab, scale=1 / math.sqrt(c))}


def _angles(start, count, d, base=10000.0):
    """cos, sin (count, d/2) of positions start .. start + count - 1, in float64."""
    i = torch.arange(d // 2, dtype=torch.float64)
    positions = torch.arange(start, start + count, dtype=torch.float64)
    angles = positions[:, None] * base ** (-2.0 * i / d)
    return angles.cos(), angles.sin()


def _greedy(params, prompt, n_new, q_start, k_start, chunk=None):
    """Greedy generation with a cache; the new tokens' queries are rotated from position
    ``q_start(L, T_new, P)``, their keys from ``k_start(L, T_new, P)`` (L: tokens cached before
    the step, P: the prompt's length); the prompt prefilled in chunks of ``chunk`` tokens (else
    at once) -> the (n_new, V) logits that chose each new token."""
    heads, _, d = params["wq"].shape
    k_cache = torch.zeros(1, heads, 0, d, dtype=params["wk"].dtype)
    v_cache = torch.zeros(1, heads, 0, params["wv"].shape[-1], dtype=params["wv"].dtype)
    p = prompt.shape[0]

    def step(tokens):
        nonlocal k_cache, v_cache
        x = params["embed"][tokens]                                      # (T, C)
        q, k, v = (torch.einsum("tc,hcd->htd", x, params[w])[None] for w in ("wq", "wk", "wv"))
        length, t = k_cache.shape[2], tokens.shape[0]
        k_cache = torch.cat([k_cache, apply_rotary_emb(k, *_angles(k_start(length, t, p), t, d))],
                            dim=2)
        v_cache = torch.cat([v_cache, v], dim=2)
        q = apply_rotary_emb(q, *_angles(q_start(length, t, p), t, d))
        out = scaled_dot_product_attention(q, k_cache, v_cache, is_causal=True)[0]
        return (x + torch.einsum("htd,hdc->tc", out, params["wo"])) @ params["unembed"]

    for start in range(0, p, chunk or p):
        last = step(prompt[start:start + (chunk or p)])
    logits = [last[-1:]]
    for _ in range(n_new - 1):
        logits.append(step(logits[-1].argmax(dim=-1))[-1:])
    return torch.cat(logits)


def _at_length(length, t, p):
    return length


def greedy_decode_reference(params, prompt, n_new):
    """The repaired loop: the new tokens sit at L .. L + T_new - 1 -> (n_new, V) logits."""
    return _greedy(params, prompt, n_new, _at_length, _at_length)


def _decode_wrong(q_start=_at_length, k_start=_at_length):
    def decode(params, prompt, n_new):
        return _greedy(params, prompt, n_new, q_start, k_start)
    return decode


def _at_zero(length, t, p):
    return 0


def _at_prompt_end(length, t, p):       # every decode step at the first new token's position
    return length if length == 0 else p


def _after_the_write(length, t, p):      # the length read after the new keys were appended
    return length + t


def _public_model(seed, prompt_len, n_new, **sizes):
    g = torch.Generator().manual_seed(seed)
    params = toy_model(g, **sizes)
    prompt = torch.randint(params["embed"].shape[0], (prompt_len,), generator=g)
    return params, prompt, n_new


def _label(params, prompt, n_new):
    v, c = params["embed"].shape
    h, _, d = params["wq"].shape
    return (f"a prompt of {prompt.shape[0]}, {n_new} new token{'s' if n_new > 1 else ''}; "
            f"V={v}, C={c}, H={h}, D={d}")


def _decode_cases():
    for seed, p, n, sizes, hint in (
            (820, 5, 8, {}, "the prefill is right (the first new token is); look at where the "
                            "decode steps put their token"),
            (821, 1, 6, {}, "a prompt of one token: the first decode step's token sits at "
                            "position 1"),
            (822, 3, 10, dict(heads=1, head_dim=4, width=8),
             "every step's new token must be rotated at its position in the whole sequence"),
            (823, 4, 1, {}, "one new token: the prefill alone gives it")):
        args = _public_model(seed, p, n, **sizes)
        yield Case(_label(*args), args, hint=hint)


register(Exercise(
    key="ch08.greedy_decode", function="greedy_decode", reference=greedy_decode_reference,
    task="debug", given=_decode_wrong(_at_zero, _at_zero), ops=ELEMENTARY | SOFTMAX,
    cases=_decode_cases, compare=expect_tensor, banned=NO_LIBRARY_ATTENTION,
    # the repair keeps the cache: the keys and values of the P prompt tokens are computed once,
    # in the prefill, and each later step computes those of its one new token; a loop that
    # feeds the whole sequence again (the given demonstration's way), whatever copy of the
    # prompt or of its tokens it feeds, runs more tokens through wk and wv (harness._Feeds)
    feeds=(0, ("wk", "wv"), 1, 2),
    read_once_why="with a cache every token goes through the model once: the prompt in the "
                  "prefill, then each step only its new token (the last new token is never fed "
                  "back), whose query meets the keys and values the cache holds",
    mistakes=(
        Mistake("this is still the given loop's bug: each decode step rotates its new token at "
                "position 0, as if the sequence began again; its position is the number of "
                "tokens already cached", _decode_wrong(_at_zero, _at_zero)),
        Mistake("the queries now sit at their positions, but the keys you append are still "
                "rotated at 0: a cached key must be rotated where its token stands",
                _decode_wrong(k_start=_at_zero)),
        Mistake("the keys you append now sit at their positions, but the new queries are still "
                "rotated at 0", _decode_wrong(q_start=_at_zero)),
        Mistake("your new tokens sit one step too far on: the cache's length was read after the "
                "new keys were appended; with L tokens cached the next one is at L (counting "
                "from 0)", _decode_wrong(_after_the_write, _after_the_write)),
        Mistake("every decode step puts its token at the same position, the prompt's length: "
                "the position moves on by one with each token generated",
                _decode_wrong(_at_prompt_end, _at_prompt_end)),
    ),
))


# --- ch08.first_divergence (measure): where the buggy loop's text first differs ----------------
#
# The bug is silent: no error, and with the prompt prefilled at once the first new token is
# right. A server prefills a long prompt in chunks (chunked prefill), each chunk a step of the
# same loop: with the bug, every chunk is rotated as if it began the sequence, so the prompt's
# own keys are wrong and the first new token may be wrong too. The student prefills the prompt
# with the given buggy attend_step in chunks of ``chunk`` tokens, decodes greedily as the given
# loop does, runs the model without a cache (the notebook's demonstration) on the same model
# and prompt, and reports how many new tokens the two agree on before the first that differs
# (0 if the first does; n_new if none differs). The repaired cached loop (_at_length) computes
# the uncached logits up to float64 rounding whatever the chunks, so it is the reference's
# other side. Both runs are deterministic, in float64, and the hidden draws reject any model
# whose largest two logits come within 1e-6 of each other at a step of either run (float64
# rounding is ~1e-15 there), so no argmax can flip between the student's arithmetic and the
# reference's: the count is compared exactly, with no tolerance.

def _both(params, prompt, n_new, chunk=None):
    """The (n_new, V) logits of the buggy loop, its prompt prefilled in chunks of ``chunk``,
    and of the repaired one."""
    return (_greedy(params, prompt, n_new, _at_zero, _at_zero, chunk),
            _greedy(params, prompt, n_new, _at_length, _at_length))


def _agreement(params, prompt, n_new, chunk=None, logits=None):
    """(leading agreements, all agreements) of the two loops' greedy tokens (``logits``: their
    ``_both``, if computed already)."""
    buggy, repaired = logits or _both(params, prompt, n_new, chunk)
    same = buggy.argmax(dim=-1) == repaired.argmax(dim=-1)
    differ = (~same).nonzero()
    return (int(differ[0, 0]) if differ.numel() else n_new), int(same.sum())


def first_divergence_reference(params, prompt, n_new, chunk):
    """How many new tokens the buggy loop, its prompt prefilled in chunks of ``chunk``, and the
    uncached model agree on before they first differ."""
    return _agreement(params, prompt, n_new, chunk)[0]


def smallest_gap(params, prompt, n_new, chunk=None, logits=None):
    """The smallest gap between the largest two logits at any step of either loop."""
    top = torch.cat(logits or _both(params, prompt, n_new, chunk)).topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def expect_count(actual, expected, case=None) -> None:
    """An int, exactly ``expected``; a wrong one is told too large or too small."""
    if isinstance(actual, torch.Tensor) and actual.numel() == 1 and not actual.is_floating_point():
        actual = actual.item()
    if isinstance(actual, bool) or not isinstance(actual, int):
        raise AssertionError(f"your answer should be an int, got {type(actual).__name__}")
    if actual != expected:
        raise AssertionError(f"your count is {'too large' if actual > expected else 'too small'}")


def _chunk_label(params, prompt, n_new, chunk):
    return f"{_label(params, prompt, n_new)}; prefill chunks of {chunk}"


def _measure_cases():
    for seed, p, n, chunk, hint in MEASURE_CASES:
        args = _public_model(seed, p, n) + (chunk,)
        yield Case(_chunk_label(*args), args, hint=hint)


# (seed, P, n_new, chunk, hint): found by a search over seeds for a model whose answer is 0
# (the first new token already differs) and one whose chunked loop agrees for a while, both
# with another answer if prefilled at once (2, neither 0 nor 1: a constant 1 is no such
# mistake); one prefilled at once that differs at the first decode step and agrees again
# later; and one that never differs within n_new
MEASURE_CASES = (
    (831, 7, 10, 3, "with the prompt in chunks, the bug reaches the prefill: compare from the "
                    "first new token on"),
    (846, 8, 10, 3, "count the new tokens before the first that differs"),
    (830, 4, 10, 4, "a chunk as long as the prompt prefills it at once; count the new tokens "
                    "before the first that differs"),
    (836, 5, 10, 5, "if the two loops never differ, every one of the n_new tokens agrees"))


def _ignoring_the_chunks(params, prompt, n_new, chunk):
    return _agreement(params, prompt, n_new)[0]


register(Exercise(
    key="ch08.first_divergence", function="first_divergence",
    # the experiment runs both loops, so it may run what they run (softmax included); the
    # package is refused, whose reference would answer without running the buggy loop
    reference=first_divergence_reference, task="measure", ops=ELEMENTARY | SOFTMAX,
    cases=_measure_cases, compare=expect_count, banned=NO_LIBRARY_ATTENTION,
    # Comparing the logits instead of the tokens is not among the mistakes: the logits differ
    # from the first decode step on, whatever the model, so it answers 1 everywhere and cannot
    # be told from a 1 typed in (issue 42); the judge says the answer is the same whatever the
    # input, and it earns nothing
    mistakes=(
        Mistake("you prefilled the prompt at once: the loop to measure prefills it chunk by "
                "chunk, each chunk a step of the buggy loop", _ignoring_the_chunks),
        Mistake("you gave the index counting from 1: count the new tokens that agree, before "
                "the first that differs",
                lambda params, prompt, n_new, chunk:
                first_divergence_reference(params, prompt, n_new, chunk) + 1),
        Mistake("you counted from the start of the prompt: count the new tokens only",
                lambda params, prompt, n_new, chunk:
                first_divergence_reference(params, prompt, n_new, chunk) + prompt.shape[0]),
        Mistake("you counted every new token on which the two loops agree: count only those "
                "before the first that differs", lambda params, prompt, n_new, chunk:
                _agreement(params, prompt, n_new, chunk)[1]),
    ),
))


# --- ch08.mla_decode_step: a decode step whose cache holds MLA's latents -----------------------
#
# Chapter 7's multi-head latent attention caches, per token, one latent c (Dc) and one RoPE key
# k_rope (Dr, rotated, shared by the heads); each head's key [c W_uk,h ; k_rope] and value
# c W_uv,h are rebuilt from them. A decode step with that cache: rotate the new tokens' RoPE
# queries and key at positions L .., append the new latents and RoPE keys to the cached ones,
# rebuild keys and values, and attend (bottom-right causal, scale 1/sqrt(D + Dr)).

def mla_decode_step_reference(q_new, c_new, kr_new, c_past, kr_past, w_uk, w_uv, cos, sin):
    """q_new (B, H, T, D + Dr), RoPE channels last, not rotated; c_new (B, T, Dc); kr_new
    (B, T, Dr) not rotated; c_past (B, L, Dc); kr_past (B, L, Dr) rotated; w_uk, w_uv
    (H, Dc, D); tables (P, Dr/2) -> (B, H, T, D)."""
    start, t, dr = c_past.shape[1], q_new.shape[2], kr_new.shape[-1]
    d = q_new.shape[-1] - dr
    c_tab, s_tab = cos[start:start + t], sin[start:start + t]
    q = torch.cat([q_new[..., :d], apply_rotary_emb(q_new[..., d:], c_tab, s_tab)], dim=-1)
    latent = torch.cat([c_past, c_new], dim=1)                                   # (B, S, Dc)
    k_rope = torch.cat([kr_past, apply_rotary_emb(kr_new, c_tab, s_tab)], dim=1)  # (B, S, Dr)
    heads, s = w_uk.shape[0], latent.shape[1]
    k = torch.cat([torch.einsum("bsc,hcd->bhsd", latent, w_uk),
                   k_rope[:, None].expand(-1, heads, s, dr)], dim=-1)
    v = torch.einsum("bsc,hcd->bhsd", latent, w_uv)
    return scaled_dot_product_attention(q, k, v, is_causal=True)


def _mla_case(name, b, h, length, t_new, d, dr, dc, extra, seed, hint, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    cos, sin = rope_tables(length + t_new + extra, dr, dtype=dtype)
    q = randn(b, h, t_new, d + dr, seed=g, dtype=dtype, scale=2.0)
    c_new, c_past = randn(b, t_new, dc, seed=g, dtype=dtype), randn(b, length, dc, seed=g,
                                                                    dtype=dtype)
    kr_new = randn(b, t_new, dr, seed=g, dtype=dtype, scale=2.0)
    kr_past = apply_rotary_emb(randn(b, length, dr, seed=g, dtype=dtype, scale=2.0),
                               cos[:length], sin[:length])
    w_uk = randn(h, dc, d, seed=g, dtype=dtype, scale=1 / math.sqrt(dc))
    w_uv = randn(h, dc, d, seed=g, dtype=dtype, scale=1 / math.sqrt(dc))
    return Case(name, (q, c_new, kr_new, c_past, kr_past, w_uk, w_uv, cos, sin), hint=hint)


def _mla_cases():
    yield _mla_case("one decode step: T_new=1 after L=6; B=1, H=2, D=4, Dr=4, Dc=6", 1, 2, 6, 1,
                    4, 4, 6, 2, 840, "the new token sits at position L: rotate its RoPE query "
                                     "and key there; every head sees all L + 1 latents")
    yield _mla_case("a chunk: T_new=3 after L=4; H=3, D=6, Dr=2, Dc=5", 1, 3, 4, 3, 6, 2, 5, 3,
                    841, "query i of the chunk sits at position L + i and may see keys "
                         "0 .. L + i")
    yield _mla_case("a prefill: an empty cache, L=0, T_new=4; B=2", 2, 2, 0, 4, 4, 4, 3, 1, 842,
                    "with nothing cached this is MLA's causal attention with RoPE from 0")
    yield _mla_case("float64: T_new=2 after L=5, tables for 12 positions", 1, 2, 5, 2, 4, 6, 8, 5,
                    843, "do not convert the inputs; let their dtype flow through",
                    dtype=torch.float64)


def _mla_wrong(*, at=None, rerotate=False, scale_d=False, no_rope=False, align="bottom_right"):
    """mla_decode_step with one mistake: ``at`` the start of the new tokens' rotation (None: L),
    ``rerotate`` the cached RoPE keys rotated again at 0 .. L-1, ``scale_d`` scores scaled by
    1/sqrt(D), ``no_rope`` scores of the content channels only, ``align`` of the mask."""
    def step(q_new, c_new, kr_new, c_past, kr_past, w_uk, w_uv, cos, sin):
        length, t, dr = c_past.shape[1], q_new.shape[2], kr_new.shape[-1]
        d = q_new.shape[-1] - dr
        start = length if at is None else at
        q_rope = _rope(q_new[..., d:], cos, sin, start)
        kr = _rope(kr_new[:, None], cos, sin, start)[:, 0]
        if rerotate:
            kr_past = _rope(kr_past[:, None], cos, sin, 0)[:, 0]
        latent, k_rope = torch.cat([c_past, c_new], 1), torch.cat([kr_past, kr], 1)
        k_nope = torch.einsum("bsc,hcd->bhsd", latent, w_uk)
        v = torch.einsum("bsc,hcd->bhsd", latent, w_uv)
        scores = q_new[..., :d] @ k_nope.transpose(-2, -1)
        if not no_rope:
            scores = scores + q_rope @ k_rope[:, None].transpose(-2, -1)
        scores = scores / math.sqrt(d if scale_d else d + dr)
        mask = causal_mask(t, latent.shape[1], align=align)
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
    return step


register(Exercise(
    key="ch08.mla_decode_step", function="mla_decode_step",
    reference=mla_decode_step_reference, task="implement", ops=ELEMENTARY | SOFTMAX,
    cases=_mla_cases, compare=expect_tensor, banned=NO_LIBRARY_ATTENTION,
    mistakes=(
        Mistake("you rotated the new RoPE query and key at positions 0 .. T_new-1, as if the "
                "cache were empty: where do they sit in the whole sequence?", _mla_wrong(at=0)),
        Mistake("you rotated the cached RoPE keys again: they were rotated when they were "
                "cached, at their own positions", _mla_wrong(rerotate=True)),
        Mistake("you scaled the scores by 1/sqrt(D): a score is the dot product of the whole "
                "query with the whole key, content and RoPE channels, D + Dr of them",
                _mla_wrong(scale_d=True)),
        Mistake("your scores leave out the RoPE channels: each head's key is the latent's key "
                "and the shared RoPE key side by side, and its query meets both",
                _mla_wrong(no_rope=True)),
        Mistake("your causal mask is aligned top-left: the new queries are the LAST T_new "
                "positions, so query i sits at L + i", _mla_wrong(align="top_left")),
    ),
))
