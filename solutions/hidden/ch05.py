"""Hidden cases of chapter 5: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint, randn
from course_attn.grading.exercise import Case, hidden


@hidden("ch05.rope_angles")
def _(gen):
    t, d, start = randint(2, 12, gen), 2 * randint(2, 32, gen), randint(0, 500, gen)
    yield Case(f"positions {start}..{start + t - 1}, D={d}", (torch.arange(start, start + t), d))
    positions = torch.randint(0, 4096, (randint(1, 8, gen),), generator=gen)
    base = float(randint(2, 1_000_000, gen))
    yield Case(f"random positions, D={d}, base={base:g}", (positions, d), {"base": base})


@hidden("ch05.apply_rope")
def _(gen):
    b, h, t, d = randint(1, 2, gen), randint(1, 3, gen), randint(2, 16, gen), 2 * randint(2, 16, gen)
    yield Case(f"B={b}, H={h}, T={t}, D={d}", (randn(b, h, t, d, seed=gen),))
    base = float(randint(10, 100_000, gen))
    yield Case(f"float64, T={t}, D={d}, base={base:g}",
               (randn(1, h, t, d, seed=gen, dtype=torch.float64),), {"base": base})


@hidden("ch05.pairing_permutation")
def _(gen):
    d = 2 * randint(3, 64, gen)
    yield Case(f"D={d}", (d,))
    yield Case(f"D={d + 2}", (d + 2,))


# ch05.rope_predictions has no hidden cases: it asks for fixed answers (no inputs), and its one
# public case per question already says only whether the answer is right, never what it is.
