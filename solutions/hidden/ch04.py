"""Hidden cases of chapter 4: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md).

Every generator names its regimes (``@hidden(key, regimes=...)``, predicates on a case) and
draws a case inside each of them on every seed, the sizes drawn at random inside the regime."""

import torch

from course_attn.grading.cases import randint, randn
from course_attn.grading.ch04 import COSTS
from course_attn.grading.exercise import Case, hidden


def _x(case):
    return case.args[0]


def _dtype(dtype):
    return lambda case: _x(case).dtype == dtype


# --- split_heads: x (B, T, C), n_heads -------------------------------------------------------
# A reshape straight to (B, H, T, D) is right when T = 1 or H = 1; interleaved heads (every H-th
# channel) when D = 1 or H = 1; (B, T, H, D) has the right shape when T = H. So the first two
# cases, which catch every typical mistake on every seed, have B, T, H and D all >= 2.

@hidden("ch04.split_heads", regimes={
    "H > 1 and D > 1 (the heads are blocks of channels)":
        lambda case: 1 < case.args[1] < _x(case).shape[2],
    "H = 1 (one head: a new axis of size 1)": lambda case: case.args[1] == 1,
    "D = 1 (H = C: head h gets channel h)":
        lambda case: 1 < case.args[1] == _x(case).shape[2],
    "T = 1 (one token)": lambda case: _x(case).shape[1] == 1,
    "B = 1": lambda case: _x(case).shape[0] == 1,
    "B > 1": lambda case: _x(case).shape[0] > 1,
    "float32": _dtype(torch.float32),
    "float64": _dtype(torch.float64),
})
def _(gen):
    b, t, h, d = randint(2, 3, gen), randint(2, 9, gen), randint(2, 5, gen), randint(2, 6, gen)
    yield Case(f"B={b}, T={t}, C={h * d}, H={h}", (randn(b, t, h * d, seed=gen), h))
    t, h, d = randint(2, 9, gen), randint(2, 5, gen), randint(2, 6, gen)
    yield Case(f"float64, B=1, T={t}, C={h * d}, H={h}",
               (randn(1, t, h * d, seed=gen, dtype=torch.float64), h))
    b, t, c = randint(1, 3, gen), randint(2, 6, gen), randint(2, 12, gen)
    yield Case(f"one head: B={b}, T={t}, C={c}, H=1", (randn(b, t, c, seed=gen), 1))
    b, t, h = randint(1, 3, gen), randint(2, 6, gen), randint(2, 8, gen)
    yield Case(f"heads of width 1: B={b}, T={t}, C=H={h}", (randn(b, t, h, seed=gen), h))
    b, h, d = randint(1, 3, gen), randint(2, 4, gen), randint(2, 4, gen)
    yield Case(f"T=1: B={b}, C={h * d}, H={h}", (randn(b, 1, h * d, seed=gen), h))


# --- merge_heads: x (B, H, T, D) ---------------------------------------------------------------
# A reshape straight to (B, T, C) is right when T = 1 or H = 1; interleaved heads when D = 1 or
# H = 1. The first two cases have H, T and D all >= 2.

@hidden("ch04.merge_heads", regimes={
    "H > 1 and D > 1": lambda case: _x(case).shape[1] > 1 and _x(case).shape[3] > 1,
    "H = 1 (one head: the axis of size 1 goes)": lambda case: _x(case).shape[1] == 1,
    "D = 1 (channel h of token t is head h)":
        lambda case: _x(case).shape[1] > 1 and _x(case).shape[3] == 1,
    "T = 1 (one token)": lambda case: _x(case).shape[2] == 1,
    "B = 1": lambda case: _x(case).shape[0] == 1,
    "B > 1": lambda case: _x(case).shape[0] > 1,
    "float32": _dtype(torch.float32),
    "float64": _dtype(torch.float64),
})
def _(gen):
    b, h, t, d = randint(2, 3, gen), randint(2, 5, gen), randint(2, 9, gen), randint(2, 6, gen)
    yield Case(f"B={b}, H={h}, T={t}, D={d}", (randn(b, h, t, d, seed=gen),))
    h, t, d = randint(2, 5, gen), randint(2, 9, gen), randint(2, 6, gen)
    yield Case(f"float64, B=1, H={h}, T={t}, D={d}",
               (randn(1, h, t, d, seed=gen, dtype=torch.float64),))
    b, t, d = randint(1, 3, gen), randint(2, 6, gen), randint(2, 8, gen)
    yield Case(f"one head: B={b}, T={t}, D={d}", (randn(b, 1, t, d, seed=gen),))
    b, h, t = randint(1, 3, gen), randint(2, 8, gen), randint(2, 6, gen)
    yield Case(f"heads of width 1: B={b}, H={h}, T={t}", (randn(b, h, t, 1, seed=gen),))
    b, h, d = randint(1, 3, gen), randint(2, 4, gen), randint(2, 4, gen)
    yield Case(f"T=1: B={b}, H={h}, D={d}", (randn(b, h, 1, d, seed=gen),))


# --- multi_head_attention: x, w_q, w_k, w_v, w_o, n_heads, causal -----------------------------
# 1/sqrt(C) for 1/sqrt(D) is right when H = 1, no scale when D = 1, a causal rule ignored or
# imposed when T = 1, a split or merge by a bare reshape when H = 1 or T = 1. The first two
# cases (causal and not) have T >= 2, H >= 2 and D >= 2, and catch every typical mistake.

def _mha_case(name, b, t, h, d, causal, gen, dtype=torch.float32):
    c = h * d
    x = randn(b, t, c, seed=gen, dtype=dtype)
    weights = tuple(randn(c, c, seed=gen, dtype=dtype, scale=c ** -0.5) for _ in range(4))
    return Case(f"{name}B={b}, T={t}, C={c}, H={h}, causal={causal}", (x, *weights, h, causal))


def _heads(case):
    return case.args[5]


@hidden("ch04.multi_head_attention", regimes={
    "causal": lambda case: case.args[6] is True,
    "not causal": lambda case: case.args[6] is False,
    "H > 1 and D > 1, T > 1": lambda case: 1 < _heads(case) < _x(case).shape[2]
        and _x(case).shape[1] > 1,
    "H = 1 (one head of width C)": lambda case: _heads(case) == 1,
    "D = 1 (heads of width 1)": lambda case: 1 < _heads(case) == _x(case).shape[2],
    "T = 1 (one token)": lambda case: _x(case).shape[1] == 1,
    "B = 1": lambda case: _x(case).shape[0] == 1,
    "B > 1": lambda case: _x(case).shape[0] > 1,
    "float32": _dtype(torch.float32),
    "float64": _dtype(torch.float64),
})
def _(gen):
    b, t, h, d = randint(2, 3, gen), randint(2, 9, gen), randint(2, 5, gen), randint(2, 6, gen)
    yield _mha_case("", b, t, h, d, True, gen)
    b, t, h, d = randint(1, 3, gen), randint(2, 9, gen), randint(2, 5, gen), randint(2, 6, gen)
    yield _mha_case("", b, t, h, d, False, gen)
    t, h, d = randint(2, 8, gen), randint(2, 4, gen), randint(2, 4, gen)
    yield _mha_case("float64, ", 1, t, h, d, bool(randint(0, 1, gen)), gen, torch.float64)
    b, t, c = randint(1, 2, gen), randint(2, 6, gen), randint(2, 8, gen)
    yield _mha_case("one head, ", b, t, 1, c, bool(randint(0, 1, gen)), gen)
    b, t, h = randint(1, 2, gen), randint(2, 6, gen), randint(2, 6, gen)
    yield _mha_case("heads of width 1, ", b, t, h, 1, bool(randint(0, 1, gen)), gen)
    b, h, d = randint(1, 3, gen), randint(2, 4, gen), randint(2, 4, gen)
    yield _mha_case("T=1, ", b, 1, h, d, bool(randint(0, 1, gen)), gen)


# --- mha_cost: C, H, T -------------------------------------------------------------------------

def _head_dim(case):
    return case.kwargs["C"] // case.kwargs["H"]


@hidden("ch04.mha_cost", regimes={
    "a short sequence, T < D": lambda case: case.kwargs["T"] < _head_dim(case),
    "D < T < C (below the crossover T = 2C)":
        lambda case: _head_dim(case) < case.kwargs["T"] < case.kwargs["C"],
    "a long sequence, T > 2C": lambda case: case.kwargs["T"] > 2 * case.kwargs["C"],
})
def _(gen):
    """One set of sizes in each regime, H >= 2 and H dividing C. Every typical mistake of the
    exercise differs from the right count when H > 1, D != T and C != T, which each regime
    keeps by its ranges (no size is drawn and then fixed up):
    - a short sequence, T < D (a prompt through wide heads): D in [16, 128], T in [1, D - 1];
    - D < T < C, below the crossover T = 2C (the projections cost more than the attention):
      D in [2, 64], T in [D + 1, C - 1];
    - a long sequence, T > 2C (the attention costs more than the projections): D in [1, 32],
      T in [2C + 1, 16C]."""
    h, d = randint(2, 16, gen), randint(16, 128, gen)
    sizes = [dict(C=h * d, H=h, T=randint(1, d - 1, gen))]
    h, d = randint(2, 16, gen), randint(2, 64, gen)
    sizes.append(dict(C=h * d, H=h, T=randint(d + 1, h * d - 1, gen)))
    h, d = randint(2, 16, gen), randint(1, 32, gen)
    sizes.append(dict(C=h * d, H=h, T=randint(2 * h * d + 1, 16 * h * d, gen)))
    yield from COSTS.cases(*sizes)


# --- causal_self_attention (debug): x, w_qkv, w_o, n_heads ------------------------------------
# The leaky merge is right when H = 1 or T = 1; the interleaved merge when H = 1 or D = 1; the
# masked diagonal fails everywhere (a row of NaN). The first case (H, T, D >= 2) catches every
# typical mistake on every seed; the second puts more heads than tokens.

def _causal_case(name, b, t, h, d, gen, dtype=torch.float32):
    c = h * d
    x = randn(b, t, c, seed=gen, dtype=dtype)
    w_qkv = randn(3 * c, c, seed=gen, dtype=dtype, scale=c ** -0.5)
    w_o = randn(c, c, seed=gen, dtype=dtype, scale=c ** -0.5)
    return Case(f"{name}B={b}, T={t}, C={c}, H={h}", (x, w_qkv, w_o, h))


@hidden("ch04.causal_self_attention", regimes={
    "H > 1 and D > 1, T > H (the leak reaches some outputs)":
        lambda case: 1 < case.args[3] < _x(case).shape[2] and _x(case).shape[1] > case.args[3],
    "2 <= T <= H (every output reads every token)":
        lambda case: 2 <= _x(case).shape[1] <= case.args[3],
    "H = 1 (one head: no leak)": lambda case: case.args[3] == 1,
    "D = 1 (heads of width 1)": lambda case: 1 < case.args[3] == _x(case).shape[2],
    "T = 1 (one token)": lambda case: _x(case).shape[1] == 1,
    "B = 1": lambda case: _x(case).shape[0] == 1,
    "B > 1": lambda case: _x(case).shape[0] > 1,
    "float32": _dtype(torch.float32),
    "float64": _dtype(torch.float64),
})
def _(gen):
    h = randint(2, 4, gen)
    b, t, d = randint(2, 3, gen), randint(h + 1, 10, gen), randint(2, 5, gen)
    yield _causal_case("", b, t, h, d, gen)
    h = randint(3, 6, gen)
    t, d = randint(2, h, gen), randint(2, 4, gen)
    yield _causal_case("float64, ", 1, t, h, d, gen, torch.float64)
    b, t, c = randint(1, 3, gen), randint(2, 7, gen), randint(2, 8, gen)
    yield _causal_case("one head, ", b, t, 1, c, gen)
    b, t, h = randint(1, 2, gen), randint(2, 7, gen), randint(2, 6, gen)
    yield _causal_case("heads of width 1, ", b, t, h, 1, gen)
    b, h, d = randint(1, 3, gen), randint(2, 4, gen), randint(2, 4, gen)
    yield _causal_case("T=1, ", b, 1, h, d, gen)


# --- leak_pattern (measure): T, H, D, seed ---------------------------------------------------
# The transposed table is right only where the pattern is symmetric (H >= T: all True; T = 1),
# the causal pattern where the layer does not leak (H = 1). The first two regimes have
# H >= 2 and T > H, where the pattern is neither; the seed is a fresh one each time. A wide
# layer (C >= 16) over 8 tokens or more is where the weights' 1/sqrt(C) scale matters: unscaled
# (or scaled up), the scores lie so far apart that a token's softmax weight falls below one bit
# of the output, and changing it moves nothing (measured: 0 of 187 draws measured right).

@hidden("ch04.leak_pattern", regimes={
    "2 <= H < T, T a multiple of H (no row spans two heads)":
        lambda case: 2 <= case.args[1] < case.args[0] and case.args[0] % case.args[1] == 0,
    "2 <= H < T, T not a multiple of H (some rows span two heads)":
        lambda case: 2 <= case.args[1] < case.args[0] and case.args[0] % case.args[1] != 0,
    "2 <= T <= H (every output reads every token)":
        lambda case: 2 <= case.args[0] <= case.args[1],
    "H = 1 (one head: a causal layer)": lambda case: case.args[1] == 1,
    "a wide layer: H >= 2, C = H·D >= 16, T >= 8 (the weights' scale matters)":
        lambda case: case.args[1] >= 2 and case.args[1] * case.args[2] >= 16
        and case.args[0] >= 8,
}, central=("2 <= H < T, T a multiple of H (no row spans two heads)",
            "2 <= H < T, T not a multiple of H (some rows span two heads)"))
def _(gen):
    h = randint(2, 4, gen)
    t = h * randint(2, 4, gen)
    yield Case(f"T={t}, H={h}", (t, h, randint(1, 4, gen), randint(0, 10_000, gen)))
    h = randint(2, 4, gen)
    t = h * randint(1, 3, gen) + randint(1, h - 1, gen)
    yield Case(f"T={t}, H={h}", (t, h, randint(1, 4, gen), randint(0, 10_000, gen)))
    h = randint(2, 6, gen)
    t = randint(2, h, gen)
    yield Case(f"T={t}, H={h}", (t, h, randint(1, 4, gen), randint(0, 10_000, gen)))
    t = randint(2, 8, gen)
    yield Case(f"T={t}, H=1", (t, 1, randint(1, 4, gen), randint(0, 10_000, gen)))
    h = randint(2, 4, gen)
    d = randint(-(-16 // h), 8, gen)
    t = randint(8, 10, gen)
    yield Case(f"T={t}, H={h}, D={d}", (t, h, d, randint(0, 10_000, gen)))


# --- split_qkv (implement): qkv (B, T, 3C), n_heads ------------------------------------------
# GPT-2's layout (all queries, then keys, then values) is right when H = 1; q, k, v taking every
# third channel when D = 1; (B, T, H, D) has the right shape when T = H. The first two cases
# have H, D >= 2 and T != H, and catch every typical mistake on every seed.

def _qkv_heads(case):
    return case.args[1]


def _qkv_width(case):
    return _x(case).shape[2] // (3 * _qkv_heads(case))


@hidden("ch04.split_qkv", regimes={
    "H > 1 and D > 1": lambda case: _qkv_heads(case) > 1 and _qkv_width(case) > 1,
    "H = 1 (one head: the three thirds)": lambda case: _qkv_heads(case) == 1,
    "D = 1 (heads of width 1)": lambda case: _qkv_heads(case) > 1 and _qkv_width(case) == 1,
    "T = 1 (one token)": lambda case: _x(case).shape[1] == 1,
    "B > 1": lambda case: _x(case).shape[0] > 1,
    "float32": _dtype(torch.float32),
    "float64": _dtype(torch.float64),
})
def _(gen):
    def draw_t(h):
        t = randint(2, 8, gen)
        return t if t != h else t + 1
    b, h, d = randint(2, 3, gen), randint(2, 5, gen), randint(2, 6, gen)
    t = draw_t(h)
    yield Case(f"B={b}, T={t}, H={h}, D={d}", (randn(b, t, 3 * h * d, seed=gen), h))
    h, d = randint(2, 5, gen), randint(2, 6, gen)
    t = draw_t(h)
    yield Case(f"float64, B=1, T={t}, H={h}, D={d}",
               (randn(1, t, 3 * h * d, seed=gen, dtype=torch.float64), h))
    b, t, d = randint(1, 3, gen), randint(2, 6, gen), randint(1, 8, gen)
    yield Case(f"one head: B={b}, T={t}, D={d}", (randn(b, t, 3 * d, seed=gen), 1))
    b, t, h = randint(1, 3, gen), randint(2, 6, gen), randint(2, 8, gen)
    yield Case(f"heads of width 1: B={b}, T={t}, H={h}", (randn(b, t, 3 * h, seed=gen), h))
    b, h, d = randint(1, 3, gen), randint(2, 4, gen), randint(2, 4, gen)
    yield Case(f"T=1: B={b}, H={h}, D={d}", (randn(b, 1, 3 * h * d, seed=gen), h))
