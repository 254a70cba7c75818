"""Hidden cases of chapter 10: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint, randn
from course_attn.grading.ch10 import chunk_case, step_case
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
