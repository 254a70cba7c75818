"""Hidden cases of chapter 6: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md).

Every generator names its regimes (``@hidden(key, regimes=...)``, predicates on a case) and
draws a case inside each of them on every seed, the sizes drawn at random inside the regime."""

import torch

from course_attn.grading.cases import randint, randn
from course_attn.grading.ch06 import LIMITS, ROPE_ORDER, qk_rope_predictions_reference, \
    rope_order_candidates
from course_attn.grading.exercise import Case, hidden


def _dtype(dtype):
    return lambda case: case.args[0].dtype == dtype


def _uniform(*shape, low, high, gen, dtype=torch.float32):
    """Numbers drawn uniformly in [low, high]."""
    return (low + (high - low) * torch.rand(*shape, generator=gen, dtype=torch.float64)).to(dtype)


# --- rms_norm: x (..., D), weight (D,) or None, eps -------------------------------------------
# A weight forgotten shows only with a weight; eps outside the root only where eps is not
# small beside mean(x²); LayerNorm only where the vectors' means are far from 0; the mean over
# the first axis only where that axis is longer than 1. Each regime's case keeps its own: the
# cases together catch every typical mistake on every seed.

@hidden("ch06.rms_norm", regimes={
    "no weight": lambda case: len(case.args) == 1 and case.kwargs.get("weight") is None,
    "a weight (D,)": lambda case: len(case.args) > 1 and case.args[1] is not None,
    "eps given, larger than mean(x²)": lambda case: "eps" in case.kwargs
        and case.kwargs["eps"] > case.args[0].pow(2).mean().item(),
    "every vector's mean far from 0 (not LayerNorm)":
        lambda case: case.args[0].mean(-1).abs().min().item() > 1,
    "x (B, H, T, D): four axes": lambda case: case.args[0].dim() == 4,
    "float32": _dtype(torch.float32),
    "float64": _dtype(torch.float64),
})
def _(gen):
    b, t, d = randint(2, 4, gen), randint(2, 6, gen), randint(2, 16, gen)
    x = randn(b, t, d, seed=gen, scale=1.0 + 3.0 * torch.rand((), generator=gen).item())
    yield Case(f"x ({b}, {t}, {d}), no weight", (x,))
    b, h, t, d = randint(1, 2, gen), randint(1, 3, gen), randint(2, 5, gen), randint(2, 16, gen)
    offset = (1 if randint(0, 1, gen) else -1) * (2.0 + 3.0 * torch.rand((), generator=gen).item())
    x = _uniform(b, h, t, d, low=offset - 0.5, high=offset + 0.5, gen=gen, dtype=torch.float64)
    yield Case(f"x ({b}, {h}, {t}, {d}) float64 near {offset:.2f}, with a weight",
               (x, randn(d, seed=gen, dtype=torch.float64)))
    t, d, eps = randint(2, 6, gen), randint(2, 16, gen), randint(2, 10, gen) / 100
    yield Case(f"small x ({t}, {d}) with eps={eps:g} and a weight",
               (_uniform(t, d, low=-0.1, high=0.1, gen=gen), randn(d, seed=gen)), {"eps": eps})


# --- qk_norm_attention: q, k, v, q_weight, k_weight, is_causal ------------------------------------
# The checks use is_causal with Tq = Tk only (the notebook says so). No scale is right when
# D = 1, the gains forgotten when they are all 1; the first case (H >= 2, T >= 2, D >= 2,
# gains drawn at random) catches every typical mistake on every seed.

def _sizes(case):
    q, k, v = case.args[:3]
    return q.shape[2], k.shape[2], q.shape[3], v.shape[3]


def _causal(case):
    return bool(case.kwargs.get("is_causal", False))


@hidden("ch06.qk_norm_attention", regimes={
    "causal, Tq = Tk": lambda case: _causal(case),
    "not causal, Tq = Tk > 1":
        lambda case: not _causal(case) and _sizes(case)[0] == _sizes(case)[1] > 1,
    "Tq < Tk (not causal)": lambda case: not _causal(case) and _sizes(case)[0] < _sizes(case)[1],
    "Tq > Tk (not causal)": lambda case: not _causal(case) and _sizes(case)[0] > _sizes(case)[1],
    "Tq = 1 (one query)": lambda case: _sizes(case)[0] == 1,
    "Dv != D": lambda case: _sizes(case)[2] != _sizes(case)[3],
    "float32": _dtype(torch.float32),
    "float64": _dtype(torch.float64),
})
def _(gen):
    def attention(b, h, tq, tk, d, dv, dtype, scale_k=3.0):
        q = randn(b, h, tq, d, seed=gen, dtype=dtype, scale=3.0)
        k = randn(b, h, tk, d, seed=gen, dtype=dtype, scale=scale_k)
        v = randn(b, h, tk, dv, seed=gen, dtype=dtype)
        gains = randn(d, seed=gen, dtype=dtype), randn(d, seed=gen, dtype=dtype)
        return (q, k, v, *gains)

    b, h, t, d = randint(1, 2, gen), randint(2, 4, gen), randint(2, 8, gen), randint(2, 12, gen)
    yield Case(f"float64, causal, B={b}, H={h}, T={t}, D={d}",
               attention(b, h, t, t, d, d, torch.float64), {"is_causal": True})
    b, h, t, d = randint(1, 2, gen), randint(1, 4, gen), randint(2, 8, gen), randint(2, 12, gen)
    yield Case(f"float64, B={b}, H={h}, T={t}, D={d}", attention(b, h, t, t, d, d, torch.float64))
    tk, d, dv = randint(3, 9, gen), randint(2, 12, gen), randint(1, 5, gen)
    dv += dv >= d                                                  # 1..6, never D
    tq, h = randint(2, tk - 1, gen), randint(1, 3, gen)
    yield Case(f"Tq={tq} < Tk={tk}, D={d}, Dv={dv}, keys of size 10, float32",
               attention(1, h, tq, tk, d, dv, torch.float32, scale_k=10.0))
    tq, d, h = randint(3, 9, gen), randint(2, 12, gen), randint(1, 3, gen)
    tk = randint(1, tq - 1, gen)
    yield Case(f"Tq={tq} > Tk={tk}, D={d}, float32", attention(2, h, tq, tk, d, d, torch.float32))
    tk, d, h = randint(1, 8, gen), randint(2, 8, gen), randint(2, 4, gen)
    yield Case(f"one query, Tk={tk}, H={h}, D={d}, float32",
               attention(randint(1, 2, gen), h, 1, tk, d, d, torch.float32))


# --- softcap: scores, cap ------------------------------------------------------------------------
# With cap >= 2, cap·tanh(s), tanh(s/cap) and tanh(s/cap)/cap differ from the answer on any
# score but 0; the clip differs most beyond ±cap (the first case), and inside by about
# (s/cap)²/3 of s, which float64 shows (the second).

def _scores(case):
    return case.args[0]


@hidden("ch06.softcap", regimes={
    "scores far beyond ±cap (the tanh saturates)":
        lambda case: _scores(case).abs().max().item() > 2 * case.args[1],
    "every score inside (-cap, cap)": lambda case: _scores(case).abs().max().item() < case.args[1],
    "a cap that is not a whole number": lambda case: case.args[1] != int(case.args[1]),
    "scores (B, H, Tq, Tk)": lambda case: _scores(case).dim() == 4,
    "float32": _dtype(torch.float32),
    "float64": _dtype(torch.float64),
})
def _(gen):
    cap = float(randint(2, 60, gen))
    shape = (randint(1, 4, gen), randint(1, 8, gen))
    scores = randn(*shape, seed=gen, scale=3 * cap)
    far = (1 if randint(0, 1, gen) else -1) * cap * (2.5 + 2.5 * torch.rand((), generator=gen))
    scores.view(-1)[randint(0, scores.numel() - 1, gen)] = far      # at least one beyond 2·cap
    yield Case(f"cap={cap:g}, scores ~ ±{3 * cap:g}", (scores, cap))
    cap = float(randint(2, 60, gen))
    shape = (randint(1, 4, gen), randint(1, 8, gen))
    yield Case(f"cap={cap:g}, scores inside ±{0.9 * cap:g}, float64",
               (_uniform(*shape, low=-0.9 * cap, high=0.9 * cap, gen=gen, dtype=torch.float64),
                cap))
    cap = randint(2, 60, gen) + randint(1, 9, gen) / 10
    shape = (randint(1, 2, gen), randint(1, 3, gen), randint(1, 5, gen), randint(1, 5, gen))
    yield Case(f"cap={cap:g}, scores {shape} ~ ±{2 * cap:g}",
               (randn(*shape, seed=gen, scale=2 * cap), cap))


# ch06.qk_norm_limits: one set of sizes, gains and a target weight in each of three regimes, on
# every seed:
#   1. small heads, a few hundred keys: D 4..8, T 16..250, weight 0.60..0.95 (here a key
#      counted too many changes the largest weight by more than 0.1%);
#   2. heads of real models, few keys: D 32..128, T 8..64, weight 0.50..0.90 (here the gain
#      the weight needs is at most 0.75, far from its square);
#   3. middling heads, a long context: D 10..30, T 1000..100000, weight 0.50..0.95.
# The gains, in hundredths: every channel 0.20..1.00 in size with a random sign, except three
# channels drawn at random: one with q's largest gain (1.60..2.00, its k gain 0.20..0.50), one
# with k's largest (the same, the other way round), and one whose product is the largest in
# size and negative (1.10..1.40 each, opposite signs). So the largest |g^Q_i g^K_i| (1.21..1.96)
# is never the largest q gain times the largest k gain (2.56 or more), nor the largest signed
# product (1.00 or less).
_LIMIT_REGIMES = (
    # (name, D range, T range, weight range in hundredths)
    ("small heads, a few hundred keys", (4, 8), (16, 250), (60, 95)),
    ("heads of real models, few keys", (32, 128), (8, 64), (50, 90)),
    ("middling heads, a long context", (10, 30), (1000, 100_000), (50, 95)),
)


def _hundredths(low, high, gen):
    return randint(low, high, gen) / 100


def _sign(gen):
    return 1 if randint(0, 1, gen) else -1


def _gains(d, gen):
    """q_gain and k_gain: the three planted channels, then d - 3 ordinary ones, in an order drawn
    at random."""
    sign = _sign(gen)
    pairs = [(_sign(gen) * _hundredths(160, 200, gen), _sign(gen) * _hundredths(20, 50, gen)),
             (_sign(gen) * _hundredths(20, 50, gen), _sign(gen) * _hundredths(160, 200, gen)),
             (sign * _hundredths(110, 140, gen), -sign * _hundredths(110, 140, gen))]
    pairs += [(_sign(gen) * _hundredths(20, 100, gen), _sign(gen) * _hundredths(20, 100, gen))
              for _ in range(d - 3)]
    order = torch.randperm(d, generator=gen).tolist()
    return [pairs[i][0] for i in order], [pairs[i][1] for i in order]


def _inside(dims, keys, weights):
    """Whether a case's D, T and weight lie in a regime's ranges."""
    def inside(case):
        size = case.kwargs
        return (dims[0] <= size["D"] <= dims[1] and keys[0] <= size["T"] <= keys[1]
                and weights[0] <= round(size["weight"] * 100) <= weights[1])
    return inside


@hidden("ch06.qk_norm_limits",
        regimes={name: _inside(*ranges) for name, *ranges in _LIMIT_REGIMES})
def _(gen):
    for _name, dims, keys, weights in _LIMIT_REGIMES:
        d, t, weight = randint(*dims, gen), randint(*keys, gen), _hundredths(*weights, gen)
        q_gain, k_gain = _gains(d, gen)
        yield from LIMITS.cases(dict(D=d, T=t, q_gain=q_gain, k_gain=k_gain, weight=weight))


# --- gemma_rms_norm: x (..., D), weight (D,), eps ----------------------------------------------
# The weight multiplied as it is, added, or applied before the norm: wrong whenever the weight
# is not all 0 and not uniform (every case: drawn at random); eps left out or outside the root:
# wrong only where eps is not small beside mean(x²) (the third case).

@hidden("ch06.gemma_rms_norm", regimes={
    "a stored weight near 0 (|w| < 0.3)": lambda case: case.args[1].abs().max().item() < 0.3,
    "a weight of size about 1": lambda case: case.args[1].abs().max().item() > 0.5,
    "eps given, larger than mean(x²)": lambda case: "eps" in case.kwargs
        and case.kwargs["eps"] > case.args[0].pow(2).mean().item(),
    "float32": _dtype(torch.float32),
    "float64": _dtype(torch.float64),
})
def _(gen):
    b, t, d = randint(1, 3, gen), randint(2, 6, gen), randint(2, 16, gen)
    x = randn(b, t, d, seed=gen, scale=1.0 + 3.0 * torch.rand((), generator=gen).item())
    yield Case(f"x ({b}, {t}, {d}), a weight near 0", (x, _uniform(d, low=-0.25, high=0.25,
                                                                    gen=gen)))
    b, h, t, d = randint(1, 2, gen), randint(1, 3, gen), randint(2, 5, gen), randint(2, 16, gen)
    w = _uniform(d, low=-1.5, high=1.5, gen=gen, dtype=torch.float64)
    w[randint(0, d - 1, gen)] = 0.6 + torch.rand((), generator=gen, dtype=torch.float64)
    yield Case(f"x ({b}, {h}, {t}, {d}) float64, a weight of size about 1",
               (randn(b, h, t, d, seed=gen, dtype=torch.float64, scale=2.0), w))
    t, d, eps = randint(2, 6, gen), randint(2, 16, gen), randint(2, 10, gen) / 100
    yield Case(f"small x ({t}, {d}) with eps={eps:g}",
               (_uniform(t, d, low=-0.1, high=0.1, gen=gen), _uniform(d, low=-0.25, high=0.25,
                                                                      gen=gen)), {"eps": eps})


# --- qk_norm_heads: q, k (B, T, H, D), v (B, T, H, Dv), gains (D,) -----------------------------
# The scale lost, or taken twice, shows wherever T >= 2 and the scores are not all equal: every
# case but the one with a single position. Each case draws its sizes inside its regime.

def _heads_sizes(case):
    q, v = case.args[0], case.args[2]
    return q.shape[1], q.shape[3], v.shape[3]


@hidden("ch06.qk_norm_heads", regimes={
    "T > 1, float32": lambda case: _heads_sizes(case)[0] > 1 and _dtype(torch.float32)(case),
    "float64": _dtype(torch.float64),
    "Dv != D": lambda case: _heads_sizes(case)[1] != _heads_sizes(case)[2],
    "one position (T = 1)": lambda case: _heads_sizes(case)[0] == 1,
})
def _(gen):
    def heads(b, t, h, d, dv, dtype):
        q, k = (randn(b, t, h, d, seed=gen, dtype=dtype, scale=3.0) for _ in range(2))
        v = randn(b, t, h, dv, seed=gen, dtype=dtype)
        return (q, k, v, 1.0 + randn(d, seed=gen, dtype=dtype), 1.0 + randn(d, seed=gen,
                                                                              dtype=dtype))

    b, t, h, d = randint(1, 2, gen), randint(3, 8, gen), randint(1, 4, gen), randint(4, 16, gen)
    yield Case(f"B={b}, T={t}, H={h}, D={d}", heads(b, t, h, d, d, torch.float32))
    t, h, d, dv = randint(2, 8, gen), randint(1, 3, gen), randint(2, 12, gen), randint(1, 5, gen)
    dv += dv >= d                                                  # never D
    yield Case(f"float64, T={t}, H={h}, D={d}, Dv={dv}", heads(1, t, h, d, dv, torch.float64))
    h, d = randint(1, 4, gen), randint(2, 8, gen)
    yield Case(f"one position, H={h}, D={d}", heads(randint(1, 2, gen), 1, h, d, d, torch.float32))


# --- qk_rope_predictions: D, q_gain, k_gain, candidates -----------------------------------------
# Two regimes, one gain pattern each on every seed, the candidates under letters in an order
# drawn at random:
#   1. the order matters: in one pair (i, i + D/2), q's larger gain on one channel and k's on
#      the other (1.40..1.90 each, the crossing gains 0.10..0.40); the largest gain of q and the
#      largest of k (2.00..2.50) in two other pairs, whose other gains are 0.10..0.40; every
#      other gain 0.10..0.90. So after < before < largest · largest.
#   2. the orders agree: gains equal within each pair, 0.10..2.50, the largest of q and of k in
#      two different pairs, so after = before < largest · largest.
# Signs at random. D 6..32 in the first (three planted pairs), 4..32 in the second. A draw
# whose five bounds are not 0.1% apart is drawn again.

def _signed(low, high, gen):
    return (1 if randint(0, 1, gen) else -1) * randint(low, high, gen) / 100


def _order_matters(gen):
    half = randint(3, 16, gen)
    q, k = [[_signed(10, 90, gen) for _ in range(2 * half)] for _ in range(2)]
    crossing, top_q, top_k = torch.randperm(half, generator=gen)[:3].tolist()
    a, b = (crossing, crossing + half) if randint(0, 1, gen) else (crossing + half, crossing)
    q[a], k[b] = _signed(140, 190, gen), _signed(140, 190, gen)
    q[b], k[a] = _signed(10, 40, gen), _signed(10, 40, gen)
    for pair, big, small in ((top_q, q, k), (top_k, k, q)):
        for channel in (pair, pair + half):
            small[channel] = _signed(10, 40, gen)
        big[pair + half * randint(0, 1, gen)] = _signed(200, 250, gen)
    return q, k


def _orders_agree(gen):
    half = randint(2, 16, gen)
    q, k = [[_signed(10, 150, gen) for _ in range(half)] for _ in range(2)]
    top_q, top_k = torch.randperm(half, generator=gen)[:2].tolist()
    q[top_q], k[top_k] = _signed(200, 250, gen), _signed(200, 250, gen)
    k[top_q], q[top_k] = _signed(10, 90, gen), _signed(10, 90, gen)
    return q + q, k + k


def _rope_case(draw, gen):
    while True:
        q, k = draw(gen)
        d = len(q)
        letters = "".join("ABCDE"[i] for i in torch.randperm(5, generator=gen).tolist())
        candidates = rope_order_candidates(d, q, k, letters)
        if len(candidates) == (5 if draw is _order_matters else 4):
            return dict(D=d, q_gain=q, k_gain=k, candidates=candidates)


def _sharper(case):
    return qk_rope_predictions_reference(**case.kwargs)["sharper"]


@hidden("ch06.qk_rope_predictions", regimes={
    "the order matters (a pair's gains cross)": lambda case: _sharper(case) == "before",
    "the orders agree (gains equal within each pair)": lambda case: _sharper(case) == "same",
})
def _(gen):
    yield from ROPE_ORDER.cases(_rope_case(_order_matters, gen), _rope_case(_orders_agree, gen))
