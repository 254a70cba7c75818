"""Hidden cases of chapter 6: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint, randn
from course_attn.grading.ch06 import LIMITS
from course_attn.grading.exercise import Case, hidden


@hidden("ch06.rms_norm")
def _(gen):
    b, t, d = randint(2, 4, gen), randint(2, 6, gen), randint(2, 16, gen)
    x = randn(b, t, d, seed=gen, scale=1.0 + 3.0 * torch.rand((), generator=gen).item())
    yield Case(f"x ({b}, {t}, {d}), no weight", (x,))
    w = randn(d, seed=gen, dtype=torch.float64)
    yield Case(f"x ({b}, {t}, {d}) float64 + 2, with a weight",
               (2.0 + x.double(), w))
    yield Case(f"small x ({t}, {d}) with eps=0.05 and a weight",
               (randn(t, d, seed=gen, scale=0.1), w.float()), {"eps": 0.05})


@hidden("ch06.qk_norm_attention")
def _(gen):
    b, h, t, d = randint(1, 2, gen), randint(2, 4, gen), randint(2, 8, gen), randint(2, 12, gen)
    q, k, v = (randn(b, h, t, d, seed=gen, dtype=torch.float64, scale=3.0) for _ in range(3))
    qw, kw = randn(d, seed=gen, dtype=torch.float64), randn(d, seed=gen, dtype=torch.float64)
    causal = bool(randint(0, 1, gen))
    yield Case(f"B={b}, H={h}, T={t}, D={d}, is_causal={causal}", (q, k, v, qw, kw),
               {"is_causal": causal})
    tk, dv = randint(2, 9, gen), randint(1, 6, gen)
    k2, v2 = randn(b, h, tk, d, seed=gen, scale=10.0), randn(b, h, tk, dv, seed=gen)
    yield Case(f"Tq={t}, Tk={tk}, Dv={dv}, float32", (q.float(), k2, v2, qw.float(), kw.float()))


@hidden("ch06.softcap")
def _(gen):
    cap = float(randint(2, 60, gen))
    shape = (randint(1, 4, gen), randint(1, 8, gen))
    yield Case(f"cap={cap:g}, scores ~ ±{3 * cap:g}", (randn(*shape, seed=gen, scale=3 * cap),
                                                       cap))
    yield Case(f"cap={cap:g}, small scores, float64",
               (randn(*shape, seed=gen, scale=cap / 4, dtype=torch.float64), cap))


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


@hidden("ch06.qk_norm_limits")
def _(gen):
    for _name, dims, keys, weights in _LIMIT_REGIMES:
        d, t, weight = randint(*dims, gen), randint(*keys, gen), _hundredths(*weights, gen)
        q_gain, k_gain = _gains(d, gen)
        yield from LIMITS.cases(dict(D=d, T=t, q_gain=q_gain, k_gain=k_gain, weight=weight))
