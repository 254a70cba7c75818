"""Hidden cases of chapter 6: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint, randn
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


# ch06.qk_norm_limits has no hidden cases: it asks for fixed answers (no inputs), and its one
# public case per answer already says only whether the answer is right, never what it is.
