"""Hidden cases of chapter 11: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint
from course_attn.grading.ch11 import _block_case
from course_attn.grading.exercise import Case, hidden


@hidden("ch11.window_mask")
def _(gen):
    t, w = randint(3, 12, gen), randint(2, 5, gen)
    yield Case(f"square, T={t}, W={w}", (t, t, w))
    tk = randint(w + 2, 14, gen)
    yield Case(f"Tq=2, Tk={tk}, W={w}", (2, tk, w))
    yield Case(f"Tq={tk}, Tk={tk - 2}, W={w}", (tk, tk - 2, w))
    yield Case(f"W wider than T: T={t}, W={t + 2}", (t, t, t + 2))


@hidden("ch11.rolling_index")
def _(gen):
    rolling = randint(2, 7, gen)
    # sinks not a multiple of rolling: there, a turn counted from 0 or from `sinks` would agree
    sinks = rolling * randint(0, 1, gen) + randint(1, rolling - 1, gen)
    size = sinks + rolling
    for position in (randint(0, sinks - 1, gen), size, sinks + rolling * randint(1, 5, gen),
                     sinks + randint(1, rolling - 1, gen) + rolling * randint(2, 9, gen),
                     randint(size, 200, gen)):
        yield Case(f"position {position}, size {size}, {sinks} sinks", (position, size, sinks))
    yield Case(f"position {size + 3}, size {size}, no sinks", (size + 3, size, 0))


@hidden("ch11.local_attention_block")
def _(gen):
    b, h, d = randint(1, 2, gen), randint(1, 3, gen), randint(2, 8, gen)
    w, tb = randint(2, 5, gen), randint(2, 6, gen)
    start = randint(w, 3 * w, gen)
    t = start + tb + randint(1, 6, gen)
    yield _block_case(f"start={start}, Tb={tb}, T={t}, W={w}", b, h, t, tb, start, w, d, d, gen,
                      "")
    yield _block_case(f"keys out of reach are NaN: start={start}, Tb={tb}, W={w}", 1, h, t, tb,
                      start, w, d, randint(1, 6, gen), gen, "", poison=True)
    yield _block_case(f"float64, start=1, Tb={tb}, W={w + 3}", 1, 1, t, tb, 1, w + 3, d, d, gen,
                      "", dtype=torch.float64)
