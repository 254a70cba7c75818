"""Hidden cases of chapter 8: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint
from course_attn.grading.ch08 import SAVINGS, _chunks, _step_case
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


# ch08.decode_savings: one set of sizes in each regime on every seed, drawn inside it. The
# crossover is the length T* = 6C + V / (2L) where a token's attention in an uncached step,
# 2·L·T·C, equals the rest of its work, L·12·C² + C·V.
#   prefill-heavy: T below the crossover (the products and the LM head dominate), a prompt
#                  longer than the answer (N < P);
#   decode-heavy:  T above the crossover (the attention dominates), a short prompt and a long
#                  answer (N > P);
#   one new token: N = 1, where the cached generation is the prefill alone.
# Every count is a sum of at most N terms, so the student's arithmetic stays fast.

@hidden("ch08.decode_savings")
def _(gen):
    c = 64 * randint(2, 24, gen)
    p = randint(64, 1024, gen)
    short = dict(L=randint(2, 48, gen), C=c, V=randint(100, 200_000, gen),
                 T=randint(2, 6 * c, gen), P=p, N=randint(2, p - 1, gen))
    layers, c, v = randint(2, 48, gen), 64 * randint(1, 8, gen), randint(16, 4096, gen)
    p = randint(1, 200, gen)
    long = dict(L=layers, C=c, V=v, T=6 * c + v // (2 * layers) + randint(1, 4096, gen), P=p,
                N=randint(p + 1, 2000, gen))
    single = dict(L=randint(1, 48, gen), C=64 * randint(1, 24, gen), V=randint(16, 200_000, gen),
                  T=randint(1, 4096, gen), P=randint(1, 2048, gen), N=1)
    yield from SAVINGS.cases(short, long, single)
