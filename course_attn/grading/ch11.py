"""Exercises of Chapter 11, local (sliding-window) attention.

    ch11.window_mask            window_mask(tq, tk, window) -> bool (Tq, Tk): the causal sliding
                                window, bottom-right aligned: query i (at position Tk - Tq + i)
                                may see key j when 0 <= (Tk - Tq + i) - j < window
    ch11.rolling_index          rolling_index(position, size, sinks=0) -> int: the slot of a
                                rolling buffer of ``size`` slots where the token at ``position``
                                is written; the first ``sinks`` tokens keep their slots forever,
                                the others take turns in the remaining size - sinks slots
    ch11.local_attention_block  local_attention_block(q, k, v, start, window) -> (B, H, Tb, Dv):
                                one block of queries, at positions start .. start + Tb - 1,
                                against only the keys in its reach
    ch11.window_budget          window_budget(T, W, L, H, H_kv, D, nbytes) -> dict: receptive
                                field, layers needed, scored pairs and rolling-cache bytes of a
                                sliding window of W keys (derive, on sizes drawn at grading time)
    ch11.window_decode          window_decode(q, k, v, window) -> (B, H, T, Dv): the repaired
                                rolling-buffer decode loop (debug: the notebook gives it scoring
                                the slots not written yet)
    ch11.receptive_field        receptive_field(layers, window, length, seed, dilation=1) -> int:
                                the earliest input position whose gradient on the last output
                                is not 0, for a random model of L windowed layers, each with
                                its own window and dilation where lists are given (measure)

Tasks: window_mask and local_attention_block are warm-ups (the chapter states the one's rule
and writes the other as its loop's body); rolling_index implements; window_budget derives;
window_decode debugs; receptive_field measures.

References: ``course_attn.sliding_window_mask``; the rolling-buffer rule below;
``course_attn.scaled_dot_product_attention(..., is_causal=True, window=W)`` on the keys in reach;
the counts computed from L·(W - 1) + 1 and the sum of min(i + 1, W).
"""

import math

import torch

from ..attention import scaled_dot_product_attention
from ..masks import query_key_offsets, sliding_window_mask
from .cases import answers_changed, as_number, count_questions, expect_tensor, randn
from .exercise import Case, Exercise, Mistake, register
from .operations import (ELEMENTARY, NONE, NO_LIBRARY_ATTENTION, NO_LIBRARY_MASKS, SOFTMAX,
                         SOFTMAX_BACKWARD)

# --- ch11.window_mask ----------------------------------------------------------------------------

def window_mask_reference(tq, tk, window):
    """Bool (Tq, Tk): True where 0 <= (Tk - Tq + i) - j < window."""
    return sliding_window_mask(tq, tk, window, causal=True)


def _window_cases():
    yield Case("square, T=7, W=3", (7, 7, 3),
               hint="query i may see keys i - W + 1 .. i: W keys, its own among them")
    yield Case("W=1: each query sees itself only, T=4", (4, 4, 1),
               hint="with W = 1 only the diagonal is True")
    yield Case("a window wider than the sequence, T=4, W=6", (4, 4, 6),
               hint="when W >= T no key is W positions back: the mask is the causal one")
    yield Case("fewer queries than keys, Tq=3, Tk=8, W=3", (3, 8, 3),
               hint="bottom-right: query i sits at position Tk - Tq + i, so the last query "
                    "sees the last W keys")
    yield Case("one query after many keys, Tq=1, Tk=9, W=4", (1, 9, 4),
               hint="a single query is the last position: it sees the last W keys")
    yield Case("more queries than keys, Tq=5, Tk=3, W=2", (5, 3, 2),
               hint="the first Tq - Tk queries sit before every key: their rows are all False")


def _offsets(tq, tk, align="bottom_right"):
    return query_key_offsets(tq, tk, align=align)


register(Exercise(
    key="ch11.window_mask", function="window_mask", reference=window_mask_reference,
    task="warm-up",  # the chapter states the rule and checks it on a square mask
    ops=ELEMENTARY,
    cases=_window_cases, compare=expect_tensor, banned=NO_LIBRARY_MASKS,
    mistakes=(
        Mistake("your window holds W + 1 keys: a query sees W keys, its own position included, "
                "so a key W positions back is already out",
                lambda tq, tk, w: (_offsets(tq, tk) >= 0) & (_offsets(tq, tk) <= w)),
        Mistake("your window holds W - 1 keys: the query's own key counts as one of the W",
                lambda tq, tk, w: (_offsets(tq, tk) >= 0) & (_offsets(tq, tk) < w - 1)),
        Mistake("your window is aligned top-left (query i at position i, as PyTorch's "
                "is_causal); here query i sits at position Tk - Tq + i",
                lambda tq, tk, w: (_offsets(tq, tk, "top_left") >= 0)
                & (_offsets(tq, tk, "top_left") < w)),
        Mistake("your window looks both ways: here it is causal, a query never sees a key "
                "after it", lambda tq, tk, w: _offsets(tq, tk).abs() < w),
        Mistake("you kept the keys after the query: the window only reaches back, and the "
                "future stays masked", lambda tq, tk, w: _offsets(tq, tk) < w),
        Mistake("your mask is only causal: keys W or more positions back must be masked too",
                lambda tq, tk, w: _offsets(tq, tk) >= 0),
        Mistake("your mask is True where the query may NOT attend; here True means may attend",
                lambda tq, tk, w: ~window_mask_reference(tq, tk, w)),
        Mistake("your mask holds 0/1 numbers: compare positions to get a bool tensor",
                lambda tq, tk, w: window_mask_reference(tq, tk, w).long()),
        Mistake("your mask holds 0/1 numbers: compare positions to get a bool tensor",
                lambda tq, tk, w: window_mask_reference(tq, tk, w).float()),
    ),
))


# --- ch11.rolling_index --------------------------------------------------------------------------

def rolling_index_reference(position, size, sinks=0):
    """The slot of token ``position`` in a rolling buffer of ``size`` slots, ``sinks`` kept."""
    if position < sinks:
        return position
    return sinks + (position - sinks) % (size - sinks)


def expect_int(actual, expected, case=None) -> None:
    """``actual`` is an int (or a one-element integer tensor) equal to ``expected``."""
    got = as_number(actual)
    if got is None:
        raise AssertionError(f"your answer should be an int, got {type(actual).__name__}")
    if isinstance(got, float) and not got.is_integer():
        raise AssertionError(f"your answer {got!r} is not a whole number: a slot is an int")
    if got != expected:
        raise AssertionError(f"your slot {int(got)} is not the one the token is written to")


def _rolling_cases():
    yield Case("no sinks: position 2 in a buffer of 4", (2, 4, 0),
               hint="until the buffer is full, token p goes to slot p")
    yield Case("no sinks: position 4 in a buffer of 4 (the first wrap)", (4, 4, 0),
               hint="once the buffer is full, the newest token overwrites the oldest one")
    yield Case("no sinks: position 10 in a buffer of 4", (10, 4, 0),
               hint="without sinks, the slots repeat every `size` tokens")
    yield Case("a sink itself: position 1, size 6, 2 sinks", (1, 6, 2),
               hint="the first `sinks` tokens each keep their own slot forever")
    yield Case("the first token after the sinks: position 2, size 6, 2 sinks", (2, 6, 2),
               hint="the first token after the sinks goes to the first slot after theirs")
    yield Case("the first wrap with sinks: position 6, size 6, 2 sinks", (6, 6, 2),
               hint="when the rolling slots are full, the oldest rolling token is overwritten, "
                    "never a sink")
    yield Case("position 11, size 6, 2 sinks", (11, 6, 2),
               hint="only size - sinks slots take turns")
    yield Case("position 13, size 5, 3 sinks", (13, 5, 3),
               hint="count the rolling tokens from the first one after the sinks")
    yield Case("position 100, size 4, 1 sink", (100, 4, 1),
               hint="only size - sinks slots take turns, after the sinks' slots")


register(Exercise(
    key="ch11.rolling_index", function="rolling_index", reference=rolling_index_reference,
    task="implement",  # the chapter's t mod W, with attention sinks it does not show
    ops=ELEMENTARY,
    cases=_rolling_cases, compare=expect_int, banned=("course_attn",),
    mistakes=(
        Mistake("your index overwrites a sink: once the buffer is full, a new token may only "
                "go to one of the size - sinks rolling slots",
                lambda p, n, s=0: p % n),
        Mistake("your index leaves out the sinks' slots: the rolling tokens go to slots "
                "sinks .. size - 1, not from slot 0",
                lambda p, n, s=0: p if p < s else (p - s) % (n - s)),
        Mistake("your rolling slots start from the wrong phase: count a rolling token's turn "
                "from the first token after the sinks, not from position 0",
                lambda p, n, s=0: p if p < s else s + p % (n - s)),
        Mistake("you rolled the sinks too: the first `sinks` tokens each keep their own slot",
                lambda p, n, s=0: s + (p - s) % (n - s)),
        Mistake("your rolling slots run past the buffer: only size - sinks slots take turns",
                lambda p, n, s=0: p if p < s else s + (p - s) % n),
    ),
))


# --- ch11.local_attention_block ------------------------------------------------------------------

def local_attention_block_reference(q, k, v, start, window):
    """Queries (B, H, Tb, D) at positions start .. start + Tb - 1, all keys (B, H, T, D) and
    values (B, H, T, Dv) -> (B, H, Tb, Dv), reading only the keys in reach."""
    end = start + q.shape[2]
    lo = max(0, start - window + 1)
    return scaled_dot_product_attention(q, k[:, :, lo:end], v[:, :, lo:end], is_causal=True,
                                        window=window)


def _block_case(name, b, h, t, tb, start, window, d, dv, seed, hint, *, poison=False,
                dtype=torch.float32):
    g = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    q = randn(b, h, tb, d, seed=g, dtype=dtype, scale=1.5)
    k = randn(b, h, t, d, seed=g, dtype=dtype, scale=1.5)
    v = randn(b, h, t, dv, seed=g, dtype=dtype)
    if poison:           # what lies outside the block's reach must never be read
        outside = torch.ones(t, dtype=torch.bool)
        outside[max(0, start - window + 1):start + tb] = False
        k[:, :, outside], v[:, :, outside] = float("nan"), float("nan")
    return Case(name, (q, k, v, start, window), hint=hint)


def _block_cases():
    yield _block_case("the first block: start=0, Tb=4, T=12, W=3", 1, 2, 12, 4, 0, 3, 8, 8, 1100,
                      "the block's queries sit at positions start .. start + Tb - 1; each sees "
                      "itself and the W - 1 keys before it")
    yield _block_case("a middle block: start=6, Tb=3, T=12, W=4", 1, 2, 12, 3, 6, 4, 8, 8, 1101,
                      "query i of the block is token start + i: its keys are start + i - W + 1 "
                      ".. start + i")
    yield _block_case("a block longer than the window: start=5, Tb=6, T=16, W=2", 1, 1, 16, 6, 5,
                      2, 4, 4, 1102, "inside the block, later queries must not see keys W or "
                                     "more positions back, though they are in the block's keys")
    yield _block_case("a window reaching past position 0: start=2, Tb=3, T=10, W=8", 2, 1, 10, 3,
                      2, 8, 4, 4, 1103, "the reach starts at start - W + 1, but never before 0")
    yield _block_case("W=1: each query sees itself only; start=3, Tb=2, T=8", 1, 2, 8, 2, 3, 1,
                      4, 4, 1104, "with W = 1 each query's output is its own value")
    yield _block_case("keys out of reach hold NaN: start=7, Tb=3, T=16, W=3", 1, 2, 16, 3, 7, 3,
                      8, 8, 1105, "read only the keys and values in reach, start - W + 1 .. "
                                  "start + Tb - 1: slice them before any product", poison=True)
    yield _block_case("Dv=3, D=6, B=2, H=3, float64: start=4, Tb=4, T=12, W=3", 2, 3, 12, 4, 4,
                      3, 6, 3, 1106, "do not convert the inputs; let their dtype flow through",
                      dtype=torch.float64)


def _block_wrong(*, lo_shift=0, hi_all=False, keep=None, align="bottom_right", offset=True,
                 scale=True):
    """local_attention_block with one mistake, as a student writes it: ``lo_shift`` moves the
    first key read (negative: earlier); ``hi_all`` reads every key to the end; ``keep(d, w)``
    is the mask on d = query position - key position (default 0 <= d < w); ``align`` the
    query positions (top-left: the block's queries taken as the first positions of the slice);
    ``offset=False`` forgets the block's start; ``scale=False`` forgets 1/sqrt(D)."""
    def block(q, k, v, start, window):
        tb = q.shape[2]
        s = start if offset else 0
        lo = max(0, s - window + 1 + lo_shift)
        hi = k.shape[2] if hi_all else s + tb
        ks, vs = k[:, :, lo:hi], v[:, :, lo:hi]
        qpos = (torch.arange(tb) + s)[:, None] if align == "bottom_right" else \
            (torch.arange(tb) + lo)[:, None]
        d = qpos - torch.arange(lo, hi)[None, :]
        allowed = (d >= 0) & (d < window) if keep is None else keep(d, window)
        scores = q @ ks.transpose(-2, -1)
        if scale:
            scores = scores / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.softmax(scores, dim=-1) @ vs
    return block


register(Exercise(
    key="ch11.local_attention_block", function="local_attention_block",
    # The chapter's loop body for one block, with the keys out of reach poisoned with NaN: it
    # tests the idea that makes local attention O(T·W), reading only the keys in reach.
    task="warm-up",  # the body of chapter 11's local_attention_scratch (section 3)
    ops=ELEMENTARY | SOFTMAX,
    reference=local_attention_block_reference, cases=_block_cases, compare=expect_tensor,
    banned=NO_LIBRARY_ATTENTION,
    mistakes=(
        Mistake("your block read keys or values outside its reach (here they are NaN): slice "
                "k and v to the keys its queries can see before any product, masking them "
                "afterwards is too late", _block_wrong(lo_shift=-1, hi_all=True)),
        Mistake("your block's keys start one too late: a query at position p also sees the "
                "key at p - W + 1", _block_wrong(lo_shift=1)),
        Mistake("your window holds W + 1 keys: a query sees W keys, its own included",
                _block_wrong(keep=lambda d, w: (d >= 0) & (d <= w))),
        Mistake("you masked only the future: a later query in the block must not see keys W "
                "or more positions back, though they are among the block's keys",
                _block_wrong(keep=lambda d, w: d >= 0)),
        Mistake("you left out the causal mask: a query in the block must not see the block's "
                "keys after it", _block_wrong(keep=lambda d, w: d < w)),
        Mistake("your mask is aligned top-left: the block's queries are its LAST Tb "
                "positions (start .. start + Tb - 1), not the first of the keys you took",
                _block_wrong(align="top_left")),
        Mistake("you placed the block at position 0: its queries sit at start .. start + Tb "
                "- 1", _block_wrong(offset=False)),
        Mistake("you did not scale the scores by 1/sqrt(D)", _block_wrong(scale=False)),
    ),
))


# --- ch11.window_budget: reach, layers, pairs and memory of a sliding window --------------------

# The chapter's sizes: Mistral 7B (Jiang et al. 2023, Table 1, and the released params.json of
# v0.1): 32 layers, 32 query heads and 8 key/value heads of dimension 128, a sliding window of
# 4096 tokens; a sequence of 16384 tokens, 2 bytes per number. Inputs, not measurements. Then
# a smaller model whose layers reach position 0 exactly (2998 - 1 = 3 · (1000 - 1)), with
# multi-query attention, in float32.
BUDGET_SIZES = dict(T=16384, W=4096, L=32, H=32, H_kv=8, D=128, nbytes=2)
MORE_BUDGET_SIZES = dict(T=2998, W=1000, L=24, H=16, H_kv=1, D=64, nbytes=4)

BUDGET_QUESTIONS = {
    "reach": (
        "(a) how many input positions can change the last layer's output at one position",
        "count how far back one layer reaches from a position (a query sees W keys, its own "
        "among them), then chain the layers: the second starts from the first one's oldest"),
    "layers_to_cover": (
        "(b) the fewest layers that let the last of T positions depend on the first",
        "find the smallest number of layers whose reach covers all T positions: the reach of "
        "L layers is not L·W"),
    "pairs": (
        "(c) (query, key) pairs scored by one head of one layer",
        "sum over the queries the number of keys each sees: the first W - 1 queries see fewer "
        "than W"),
    "cache_bytes": (
        "(d) bytes of the rolling KV cache of one sequence, all layers",
        "keys and values, in every layer, for the key/value heads only, W positions each, "
        "nbytes bytes per number"),
}


def _pairs(T, W):
    """The sum over queries i < T of min(i + 1, W): the first W queries see 1, 2, .., W keys,
    every later one W."""
    first = min(T, W)
    return first * (first + 1) // 2 + (T - first) * W


def _budget(T, W, L, H, H_kv, D, nbytes, **rule):
    """The four answers, or a typical mistake's: ``rule`` "reach_fn" (layers -> their reach),
    "query_heads" (the cache sized for H), "keys_only"."""
    if W < 2:
        raise ValueError(f"a window of W={W} key never reaches back; W must be >= 2")
    reach = rule.get("reach_fn", lambda layers: layers * (W - 1) + 1)
    layers = 1
    while reach(layers) < T:
        layers += 1
    heads = H if rule.get("query_heads") else H_kv
    tensors = 1 if rule.get("keys_only") else 2
    return {"reach": reach(L), "layers_to_cover": layers,
            "pairs": _pairs(T, W),
            "cache_bytes": tensors * L * heads * D * W * nbytes}


def window_budget_reference(T, W, L, H, H_kv, D, nbytes):
    """The four answers for T tokens, a window of W keys, L layers of H query heads and H_kv
    key/value heads of dimension D, nbytes bytes per number: the reach L·(W - 1) + 1, the
    first number of layers whose reach is at least T (counted up), the sum of min(i + 1, W)
    over the queries (in closed form), and 2·L·H_kv·D·W·nbytes."""
    return _budget(T, W, L, H, H_kv, D, nbytes)


BUDGET = count_questions(BUDGET_QUESTIONS, rel_tol=1e-12, near_miss=True)


def _budget_with(**rule):
    """A typical wrong answer: ``_budget`` with ``rule``."""
    return lambda T, W, L, H, H_kv, D, nbytes: _budget(T, W, L, H, H_kv, D, nbytes, **rule)


def _chained(reach_of_w, keys):
    """A typical wrong answer: the right ones, with ``keys`` (of "reach" and "layers_to_cover")
    computed from a wrong reach of L layers, ``reach_of_w(W)(L)``."""
    def chained(key):
        return lambda **sizes: _budget(**sizes, reach_fn=reach_of_w(sizes["W"]))[key]
    return answers_changed(window_budget_reference, {key: chained(key) for key in keys})


def _answering(**wrong):
    """A typical wrong answer: the right ones, with these keys computed by these rules (of T, W
    and L)."""
    return answers_changed(window_budget_reference, wrong,
                           sizes=lambda T, W, L, **_: dict(T=T, W=W, L=L))


register(Exercise(
    key="ch11.window_budget", function="window_budget", reference=window_budget_reference,
    task="derive",
    ops=NONE,
    cases=lambda: BUDGET.cases(BUDGET_SIZES, MORE_BUDGET_SIZES), compare=BUDGET.compare,
    banned=("course_attn",),
    mistakes=(
        *(Mistake("you counted W new positions per layer: a layer reaches W - 1 positions "
                  "back beyond the one it starts from",
                  _chained(lambda W: lambda layers: layers * W, keys))
          for keys in (("reach", "layers_to_cover"), ("reach",), ("layers_to_cover",))),
        *(Mistake("you left out the position itself: L layers reach L·(W - 1) positions back, "
                  "plus the one they start from",
                  _chained(lambda W: lambda layers: layers * (W - 1), keys))
          for keys in (("reach", "layers_to_cover"), ("reach",), ("layers_to_cover",))),
        Mistake("you counted one layer only: each layer reaches back from the positions the "
                "layer below could already see", _answering(reach=lambda T, W, L: W)),
        Mistake("you counted W keys for every query: the first W - 1 queries have fewer keys "
                "before them", _answering(pairs=lambda T, W, L: T * W)),
        Mistake("you counted full causal attention: with the window, a query sees at most W "
                "keys", _answering(pairs=lambda T, W, L: T * (T + 1) // 2)),
        Mistake("you sized the cache for the query heads: with grouped-query attention only "
                "the key/value heads are cached",
                _budget_with(query_heads=True)),
        Mistake("you counted the keys only: the cache holds the values too",
                _budget_with(keys_only=True)),
    ),
))


# --- ch11.window_decode: debug a rolling-buffer decode loop ---------------------------------------

# The notebook gives this function, in a locked cell, as ``given_window_decode``: causal
# sliding-window attention computed the way a decoder runs it, one token at a time, with keys
# and values written into a rolling buffer of W slots (slot t mod W) allocated once, with
# zeros. Its bug: until the buffer is full, the query also scores the slots no token has been
# written to yet; their keys are 0, so each gets the weight of a score of 0, and their values,
# 0, pull the output towards 0 (a real bug of hand-written rolling caches: the chapter's
# RollingKVCache.update returns only the min(W, seen) slots written).

def given_window_decode(q, k, v, window):
    """The buggy function of the notebook, as it is given there."""
    b, h, t, d = q.shape
    keys = q.new_zeros(b, h, window, d)                  # the rolling buffer, allocated once
    values = q.new_zeros(b, h, window, v.shape[-1])
    outs = []
    for i in range(t):                                   # token i arrives
        keys[:, :, i % window] = k[:, :, i]              # overwrite the oldest slot
        values[:, :, i % window] = v[:, :, i]
        scores = q[:, :, i:i + 1] @ keys.transpose(-2, -1) / math.sqrt(d)   # (B, H, 1, W)
        outs.append(torch.softmax(scores, dim=-1) @ values)
    return torch.cat(outs, dim=2)


def window_decode_reference(q, k, v, window):
    """q, k (B, H, T, D), v (B, H, T, Dv) -> (B, H, T, Dv): causal attention with a sliding
    window of ``window`` keys, the package's, with the window applied as a mask."""
    return scaled_dot_product_attention(q, k, v, is_causal=True, window=window)


def decode_case(name, b, h, t, window, d, dv, seed, hint="", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    q, k = (randn(b, h, t, d, seed=g, dtype=dtype, scale=1.5) for _ in range(2))
    v = randn(b, h, t, dv, seed=g, dtype=dtype)
    return Case(name, (q, k, v, window), hint=hint)


def _decode_cases():
    yield decode_case("T=10, W=4: the window slides; B=1, H=2, D=Dv=8", 1, 2, 10, 4, 8, 8, 1110,
                      "token i sees the tokens max(0, i - W + 1) .. i, and no slot else")
    c = decode_case("", 1, 2, 9, 4, 6, 3, 1111)
    yield Case("constant values (every value 1): every output must be 1; T=9, W=4",
               (c.args[0], c.args[1], torch.ones_like(c.args[2]), 4),
               hint="a weighted mean of ones is one: no weight may go to a slot that holds no "
                    "token")
    yield decode_case("a window wider than the sequence: T=5, W=8", 1, 1, 5, 8, 4, 4, 1112,
                      "while the buffer is not full, only the slots written so far hold tokens")
    yield decode_case("W=1: each token sees itself only; T=4", 1, 2, 4, 1, 4, 4, 1113,
                      "with W = 1 each output is the token's own value")
    yield decode_case("Dv=3, D=6, B=2, H=3, float64: T=12, W=5", 2, 3, 12, 5, 6, 3, 1114,
                      "do not convert the inputs; let their dtype flow through",
                      dtype=torch.float64)


def _decode_wrong(*, unwritten=True, held="window"):
    """window_decode with one mistake, as a student writes it: ``unwritten`` scores the slots
    no token has reached yet (the given bug); ``held`` the tokens token i reads besides:
    "window" (the last W, right), "before" (slots 0 .. i - 1 of the buffer while it fills,
    the token itself missed), "all" (every token so far: no window)."""
    def decode(q, k, v, window):
        t, d = q.shape[2], q.shape[-1]
        outs = []
        for i in range(t):
            if held == "all":
                lo, hi = 0, i + 1
            elif held == "before" and i < window:
                lo, hi = 0, i                             # slots 0 .. i - 1: tokens 0 .. i - 1
            else:
                lo, hi = max(0, i - window + 1), i + 1
            ks, vs = k[:, :, lo:hi], v[:, :, lo:hi]
            if unwritten and hi - lo < window:            # the empty slots: key 0, value 0
                pad = window - (hi - lo)
                ks = torch.cat([ks, ks.new_zeros(*ks.shape[:2], pad, ks.shape[-1])], dim=2)
                vs = torch.cat([vs, vs.new_zeros(*vs.shape[:2], pad, vs.shape[-1])], dim=2)
            scores = q[:, :, i:i + 1] @ ks.transpose(-2, -1) / math.sqrt(d)
            outs.append(torch.softmax(scores, dim=-1) @ vs)
        return torch.cat(outs, dim=2)
    return decode


def _decode_by_position(q, k, v, window):
    """window_decode writing token i at slot i, not i mod W, as a student writes it: once i
    reaches W the slot does not exist, and the write raises IndexError (the message the
    student's code raises, so that the grader names this mistake)."""
    b, h, t, d = q.shape
    keys = q.new_zeros(b, h, window, d)
    values = q.new_zeros(b, h, window, v.shape[-1])
    outs = []
    for i in range(t):
        keys[:, :, i] = k[:, :, i]
        values[:, :, i] = v[:, :, i]
        held = min(i + 1, window)
        scores = q[:, :, i:i + 1] @ keys[:, :, :held].transpose(-2, -1) / math.sqrt(d)
        outs.append(torch.softmax(scores, dim=-1) @ values[:, :, :held])
    return torch.cat(outs, dim=2)


register(Exercise(
    key="ch11.window_decode", function="window_decode", reference=window_decode_reference,
    task="debug", given=given_window_decode,
    ops=ELEMENTARY | SOFTMAX,
    cases=_decode_cases, compare=expect_tensor, banned=NO_LIBRARY_ATTENTION,
    mistakes=(
        Mistake("your query scores slots that no token has been written to yet: while the "
                "buffer fills, their keys and values are 0, and a score of 0 still gets a "
                "weight; read only the slots written so far", given_window_decode),
        Mistake("while the buffer fills, your query misses its own key: after token i is "
                "written the buffer holds i + 1 tokens, not i",
                _decode_wrong(unwritten=False, held="before")),
        Mistake("your repaired function has no window: token i sees only the last W tokens, "
                "the buffer's, not every token before it",
                _decode_wrong(unwritten=False, held="all")),
        Mistake("you write token i at slot i: the buffer has W slots, and token i goes to slot "
                "i mod W, over the oldest token", _decode_by_position),
    ),
))


# --- ch11.receptive_field: measure the reach of L windowed layers with gradients -----------------

RF_DIM = 8  # the width of the reference's model: any width gives the same reach


def per_layer(value, layers):
    """An int for every layer, or a list with one per layer (the first layer's first)."""
    return list(value) if isinstance(value, (list, tuple)) else [value] * layers


def dilated_window_mask(length, window, dilation=1):
    """(T, T) bool: the query at position p sees the keys p, p - d, ..., p - (W - 1)·d."""
    back = torch.arange(length)[:, None] - torch.arange(length)[None, :]
    return (back >= 0) & (back % dilation == 0) & (back // dilation < window)


def receptive_field_reference(layers, window, length, seed, dilation=1):
    """The earliest input position whose gradient on the last position's output is non-zero,
    for a random model (drawn with ``seed``) of ``layers`` residual layers of causal
    sliding-window attention, layer l with ``window`` keys spaced ``dilation`` apart (each an
    int, or a list with one per layer), on ``length`` positions. Measured, with autograd:
    masked weights are exactly 0, so is every gradient out of reach."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, length, RF_DIM, generator=g, dtype=torch.float64, requires_grad=True)
    h = x
    for w, d in zip(per_layer(window, layers), per_layer(dilation, layers)):
        wq, wk, wv = (torch.randn(RF_DIM, RF_DIM, generator=g, dtype=torch.float64)
                      / math.sqrt(RF_DIM) for _ in range(3))
        h = h + scaled_dot_product_attention(h @ wq, h @ wk, h @ wv,
                                             attn_mask=dilated_window_mask(length, w, d))
    (grad,) = torch.autograd.grad(h[0, 0, -1].sum(), x)
    return int((grad[0, 0] != 0).any(-1).nonzero()[0])


def expect_position(actual, expected, case=None) -> None:
    """An int (or a one-element integer tensor) equal to ``expected``, a position."""
    got = as_number(actual)
    if got is None:
        raise AssertionError(f"your answer should be an int, got {type(actual).__name__}")
    if isinstance(got, float) and not got.is_integer():
        raise AssertionError(f"your answer {got!r} is not a whole number: a position is an int")
    if got != expected:
        raise AssertionError(f"your position is {'too late' if got > expected else 'too early'}")


def _rf_cases():
    yield Case("L=1, W=4, T=24", (1, 4, 24, 0),
               hint="one layer: the last position reads its own input and the W - 1 before it")
    yield Case("L=3, W=4, T=24", (3, 4, 24, 1),
               hint="each layer reaches W - 1 positions further back than the one below")
    yield Case("L=2, W=6, T=30", (2, 6, 30, 2),
               hint="find the first position whose gradient is not exactly 0")
    yield Case("the reach ends exactly at position 0: L=3, W=5, T=13", (3, 5, 13, 3),
               hint="here the reach just covers the sequence")
    yield Case("the reach is cut at position 0: L=5, W=4, T=10", (5, 4, 10, 4),
               hint="no position before 0: every input can reach the last output")
    yield Case("a window of its own for each layer, the second dilated: windows [3, 4], "
               "dilations [1, 3], T=16", (2, [3, 4], 16, 5, [1, 3]),
               hint="build each layer's mask from its own window and dilation")


def _rf_with(rule):
    """A typical wrong measurement, from the reach it measures: ``rule(L, W, T)`` (of one
    window for every layer, no dilation)."""
    def wrong(layers, window, length, seed, dilation=1):
        if isinstance(window, (list, tuple)) or dilation != 1:
            raise ValueError("one window for every layer only")
        return rule(layers, window, length)
    return wrong


register(Exercise(
    key="ch11.receptive_field", function="receptive_field",
    reference=receptive_field_reference, task="measure",
    # An experiment with autograd: the elementary operations, softmax, and their backward
    # (the views' and the softmax's); no attention of PyTorch's or the package's, no ready mask.
    ops=ELEMENTARY | SOFTMAX | SOFTMAX_BACKWARD | frozenset(
        f"aten.{name}" for name in ("select_backward", "slice_backward", "diagonal_backward",
                                    "index_select_backward", "masked_select_backward",
                                    "unfold_backward", "value_selecting_reduction_backward")),
    cases=_rf_cases, compare=expect_position,
    banned=tuple(dict.fromkeys(NO_LIBRARY_ATTENTION + NO_LIBRARY_MASKS)),
    mistakes=(
        Mistake("your window holds W + 1 keys: a query sees W keys, its own included",
                _rf_with(lambda L, W, T: max(0, T - 1 - L * W))),
        Mistake("your window holds W - 1 keys: the query's own key counts as one of the W",
                _rf_with(lambda L, W, T: max(0, T - 1 - L * (W - 2)))),
        Mistake("your gradient reaches position 0: either your mask is only causal (keys W or "
                "more positions back must be masked too) or you took the gradient of every "
                "output, not of the last position's only", _rf_with(lambda L, W, T: 0)),
        Mistake("you returned how many positions the last output depends on: the answer is "
                "the earliest of them, a position",
                _rf_with(lambda L, W, T: min(T, L * (W - 1) + 1))),
    ),
))
