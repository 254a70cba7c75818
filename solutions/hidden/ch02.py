"""Hidden cases of chapter 2: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint, randn
from course_attn.grading.exercise import Case, hidden


def _shapes(gen):
    """B, H, Tq, Tk, D; Tk and D at least 2, as one key or D = 1 hide a wrong scale."""
    return randint(1, 3, gen), randint(1, 4, gen), randint(1, 9, gen), randint(2, 9, gen), \
        randint(2, 16, gen)


@hidden("ch02.attention_scores")
def _(gen):
    b, h, tq, tk, d = _shapes(gen)
    if d == tq:  # D = Tq would hide a scale of 1/sqrt(Tq)
        d += 1
    yield Case(f"B={b}, H={h}, Tq={tq}, Tk={tk}, D={d}",
               (randn(b, h, tq, d, seed=gen), randn(b, h, tk, d, seed=gen)))
    yield Case("scale=2.0, no head axis", (randn(b, tq, d, seed=gen), randn(b, tk, d, seed=gen)),
               {"scale": 2.0})


@hidden("ch02.stable_softmax")
def _(gen):
    rows = randint(2, 6, gen)
    # not square: rows and columns of one-hot weights would otherwise agree for a permutation
    x = randn(randint(1, 5, gen), rows, rows + randint(1, 3, gen), seed=gen, scale=400.0)
    yield Case(f"shape {tuple(x.shape)} with entries in the hundreds, dim=-2", (x,), {"dim": -2})
    y = randn(4, 6, seed=gen, dtype=torch.float64)
    y[randint(0, 3, gen)] = float("-inf")
    yield Case("float64 with an all -inf row", (y,))


@hidden("ch02.attention")
def _(gen):
    b, h, tq, tk, d = _shapes(gen)
    dv = d + randint(1, 8, gen)  # Dv != D: a scale taken from v shows
    yield Case(f"B={b}, H={h}, Tq={tq}, Tk={tk}, D={d}, Dv={dv}",
               (randn(b, h, tq, d, seed=gen), randn(b, h, tk, d, seed=gen),
                randn(b, h, tk, dv, seed=gen)))
    yield Case("float64, scale=0.0 (uniform weights)",
               tuple(randn(b, h, t, d, seed=gen, dtype=torch.float64) for t in (tq, tk, tk)),
               {"scale": 0.0})


@hidden("ch02.softmax_backward")
def _(gen):
    from course_attn import softmax

    shape = (randint(1, 4, gen), randint(2, 6, gen), randint(2, 7, gen))
    dim = randint(0, 1, gen)  # not the last axis: the second case takes that one
    y = softmax(randn(*shape, seed=gen, scale=3.0, dtype=torch.float64), dim=dim)
    yield Case(f"shape {shape}, dim={dim}, float64", (y, randn(*shape, seed=gen,
                                                               dtype=torch.float64)),
               {"dim": dim})
    n = randint(2, 8, gen)
    x = randn(n, n, seed=gen)
    x[randint(0, n - 1, gen), randint(0, n - 1, gen)] = float("-inf")
    yield Case(f"a square ({n}, {n}) input with a masked key", (softmax(x, dim=-1),
                                                              randn(n, n, seed=gen)))


@hidden("ch02.attention_cost")
def _(gen):
    b, h, tq, tk = randint(2, 8, gen), randint(1, 64, gen), randint(1, 4096, gen), \
        randint(1, 4096, gen)
    d = 16 * randint(1, 8, gen)
    dv = d + 16 * randint(1, 8, gen)  # B > 1 and Dv != D: leaving either out shows
    size = (1, 2, 4, 8)[randint(0, 3, gen)]
    yield Case(f"B={b}, H={h}, Tq={tq}, Tk={tk}, D={d}, Dv={dv}, {size} bytes",
               (b, h, tq, tk, d, dv, size))
    t = 1024 * randint(1, 128, gen)
    yield Case(f"B=1, H=32, T={t}, D=Dv=128, 2 bytes", (1, 32, t, t, 128, 128, 2))
