"""Hidden cases of chapter 8: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint
from course_attn.grading.ch08 import _chunks, _step_case
from course_attn.grading.exercise import Case, hidden


@hidden("ch08.fill_cache")
def _(gen):
    b, h, d, dv = randint(1, 3, gen), randint(1, 3, gen), randint(2, 6, gen), randint(1, 5, gen)
    sizes = [randint(2, 4, gen)] + [randint(1, 3, gen) for _ in range(randint(1, 3, gen))]
    room = sum(sizes) + randint(1, 4, gen)
    ks, vs = _chunks(sizes, b, h, d, dv, seed=gen)
    yield Case(f"chunks {sizes}, B={b}, H={h}, D={d}, Dv={dv}, room for {room}", (ks, vs, room))
    ks, vs = _chunks(sizes[::-1], 1, h, d, d, seed=gen, dtype=torch.float64)
    yield Case(f"float64 chunks {sizes[::-1]}, room for exactly {sum(sizes)}",
               (ks, vs, sum(sizes)))


@hidden("ch08.decode_step")
def _(gen):
    b, h, d = randint(1, 2, gen), randint(1, 3, gen), 2 * randint(2, 5, gen)
    length, extra = randint(2, 9, gen), randint(1, 6, gen)
    yield _step_case(f"decode step after L={length}, B={b}, H={h}, D={d}", b, h, length, 1, d, d,
                     extra, gen, "")
    t_new, dv = randint(2, 5, gen), randint(1, 6, gen)
    yield _step_case(f"a chunk of {t_new} after L={length}, Dv={dv}", b, h, length, t_new, d, dv,
                     extra, gen, "")
    yield _step_case(f"float64, a chunk of {t_new} after L={length + 1}", 1, h, length + 1, t_new,
                     d, d, extra, gen, "", dtype=torch.float64)


# ch08.decode_savings has no hidden cases: it asks for fixed answers (no inputs), and its one
# public case per answer already says only how far off an answer is, never what it is.
