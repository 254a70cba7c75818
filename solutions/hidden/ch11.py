"""Hidden cases of chapter 11: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint
from course_attn.grading.ch11 import BUDGET, _block_case
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


@hidden("ch11.window_budget")
def _(gen):
    # One set of sizes in each regime, on every seed, the rest drawn at random inside it
    # (W from 16 to 4096, L from 2 to 64, so that one layer or W per layer is wrong):
    # 1. W divides T, T = k·W with k >= 2: the layers overshoot position 0; grouped-query
    #    attention (H = g·H_kv, g >= 2).
    # 2. The layers reach position 0 exactly, T - 1 = k·(W - 1) (W does not divide T), where
    #    leaving out the position itself needs one layer more; multi-query (H_kv = 1).
    # 3. T past a multiple of W - 1 and short of the next one: the layers overshoot, T at
    #    random in between (W divides it only by chance); grouped-query attention.
    # 4. A sequence no longer than the window: one layer covers it, and every query sees
    #    every key before it (the full causal count); grouped-query attention.
    # H != H_kv everywhere, so sizing the cache for the query heads is wrong.
    def model(h_kv):
        return dict(L=randint(2, 64, gen), H=h_kv * randint(2, 8, gen), H_kv=h_kv,
                    D=16 * randint(2, 16, gen), nbytes=2 * randint(1, 2, gen))

    w = randint(16, 4096, gen)
    sizes = [dict(T=w * randint(2, 8, gen), W=w, **model(randint(2, 8, gen)))]
    w = randint(16, 4096, gen)
    sizes.append(dict(T=(w - 1) * randint(2, 8, gen) + 1, W=w, **model(1)))
    w = randint(16, 4096, gen)
    sizes.append(dict(T=(w - 1) * randint(1, 7, gen) + 1 + randint(1, w - 2, gen), W=w,
                      **model(randint(2, 8, gen))))
    w = randint(16, 4096, gen)
    sizes.append(dict(T=randint(2, w, gen), W=w, **model(randint(2, 8, gen))))
    yield from BUDGET.cases(*sizes)
