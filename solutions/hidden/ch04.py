"""Hidden cases of chapter 4: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint, randn
from course_attn.grading.ch04 import COSTS
from course_attn.grading.exercise import Case, hidden


def _sizes(gen):
    """B, T, H, D with H >= 2 and T >= 2, so that the typical mistakes show."""
    return randint(1, 3, gen), randint(2, 9, gen), randint(2, 5, gen), randint(1, 6, gen)


@hidden("ch04.split_heads")
def _(gen):
    b, t, h, d = _sizes(gen)
    yield Case(f"B={b}, T={t}, C={h * d}, H={h}", (randn(b, t, h * d, seed=gen), h))
    yield Case(f"float64, B=1, T={t + 1}, C={2 * (d + 1)}, H=2",
               (randn(1, t + 1, 2 * (d + 1), seed=gen, dtype=torch.float64), 2))


@hidden("ch04.merge_heads")
def _(gen):
    b, t, h, d = _sizes(gen)
    yield Case(f"B={b}, H={h}, T={t}, D={d}", (randn(b, h, t, d, seed=gen),))
    yield Case(f"float64, B=2, H={h}, T={t + 2}, D={d + 1}",
               (randn(2, h, t + 2, d + 1, seed=gen, dtype=torch.float64),))


@hidden("ch04.multi_head_attention")
def _(gen):
    b, t, h, d = _sizes(gen)
    d = max(d, 2)
    c = h * d
    for causal in (True, False):
        x = randn(b, t, c, seed=gen)
        weights = tuple(randn(c, c, seed=gen, scale=c ** -0.5) for _ in range(4))
        yield Case(f"B={b}, T={t}, C={c}, H={h}, causal={causal}", (x, *weights, h, causal))


@hidden("ch04.mha_cost")
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
