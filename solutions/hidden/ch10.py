"""Hidden cases of chapter 10: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint, randn
from course_attn.grading.ch10 import COSTS, chunk_case, step_case
from course_attn.grading.exercise import Case, hidden


@hidden("ch10.elu_feature_map")
def _(gen):
    shape = (randint(1, 3, gen), randint(1, 4, gen), randint(2, 9, gen))
    yield Case(f"x of shape {shape}", (randn(*shape, seed=gen, scale=float(randint(1, 4, gen))),))
    x = randn(randint(2, 6, gen), seed=gen, scale=5.0)
    x[0] = -float(randint(5, 30, gen))
    yield Case("a large negative value among others", (x,))
    yield Case("float64", (randn(2, randint(2, 5, gen), seed=gen, dtype=torch.float64,
                                 scale=3.0),))


@hidden("ch10.recurrent_step")
def _(gen):
    b, h, d, dv = randint(1, 2, gen), randint(1, 3, gen), randint(2, 7, gen), randint(1, 6, gen)
    yield step_case(f"after {d} tokens, B={b}, H={h}, D'={d}, Dv={dv}", b, h, d, dv, d, gen)
    yield step_case("the first token", b, h, d, dv, 0, gen)
    yield step_case("float64, after many tokens", 1, h, d, dv, randint(20, 90, gen), gen,
                    dtype=torch.float64)


@hidden("ch10.chunk_step")
def _(gen):
    b, h, d, dv = randint(1, 2, gen), randint(1, 3, gen), randint(2, 7, gen), randint(1, 6, gen)
    c = randint(2, 6, gen)
    yield chunk_case(f"a chunk of {c} after {2 * c}, B={b}, H={h}, D'={d}, Dv={dv}", b, h, c, d,
                     dv, 2 * c, gen)
    yield chunk_case(f"the first chunk of {c}", b, h, c, d, dv, 0, gen)
    yield chunk_case("float64, a chunk of 3 after many tokens", 1, h, 3, d, dv,
                     randint(10, 40, gen), gen, dtype=torch.float64)


@hidden("ch10.linear_costs")
def _(gen):
    # One set of sizes in each regime, on every seed, the rest drawn at random inside it:
    # 1. Performer's features wider than the head, F >= D + 3 (at F = D .. D + 2 solving with
    #    D' = Dv = D would give the right crossing), a context longer than D (past the
    #    crossover, the linear order cheaper), bf16.
    # 2. The crossing on a whole number, F = 3D with D even: the two orders tie at T = 3D / 2,
    #    so the answer is the next T; a context no longer than D (the quadratic order
    #    cheaper), float32.
    # 3. Features narrower than the head (F < D), any context, 2 or 4 bytes per number.
    # Bytes per number are never 1, where counting numbers would be counting bytes; T >= 2,
    # so a state that grows with the length is wrong.
    def model():
        return dict(L=randint(2, 96, gen), H=randint(1, 64, gen))

    d = 16 * randint(2, 16, gen)
    sizes = [dict(T=randint(d + 1, 32768, gen), D=d, features=randint(d + 3, 4 * d, gen),
                  **model(), nbytes=2)]
    d = 2 * randint(8, 128, gen)
    sizes.append(dict(T=randint(2, d, gen), D=d, features=3 * d, **model(), nbytes=4))
    d = 16 * randint(2, 16, gen)
    sizes.append(dict(T=randint(2, 32768, gen), D=d, features=randint(2, d - 1, gen), **model(),
                      nbytes=2 * randint(1, 2, gen)))
    yield from COSTS.cases(*sizes)
