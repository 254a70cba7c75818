"""Hidden cases of chapter 1: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint, randn
from course_attn.grading.exercise import Case, hidden


@hidden("ch01.softmax_list")
def _(gen):
    n = randint(2, 9, gen)
    yield Case(f"{n} random scores", (randn(n, seed=gen, scale=5.0, dtype=torch.float64).tolist(),))
    big = randn(n, seed=gen, scale=300.0, dtype=torch.float64) + 500
    yield Case(f"{n} scores around 500, spread 300", (big.tolist(),))
    yield Case("two equal large scores", ([750.5, 750.5],))
    spiked = randn(n, seed=gen, scale=5.0, dtype=torch.float64)
    spiked[randint(1, n - 1, gen)] += 2000.0
    yield Case(f"{n} scores, one after the first 2000 above the rest", (spiked.tolist(),))


@hidden("ch01.soft_lookup")
def _(gen):
    d, dv, t = randint(2, 5, gen), randint(1, 5, gen), randint(2, 7, gen)  # T=1, D=1: public
    rows = lambda r, c, s=1.0: randn(r, c, seed=gen, scale=s, dtype=torch.float64).tolist()
    yield Case(f"T={t}, D={d}, Dv={dv}", (randn(d, seed=gen).tolist(), rows(t, d), rows(t, dv)))
    yield Case(f"large scores, T={t}", (randn(d, seed=gen, scale=40.0).tolist(),
                                        rows(t, d, 40.0), rows(t, dv)))


@hidden("ch01.attend")
def _(gen):
    tq, tk, d, dv = randint(1, 9, gen), randint(2, 9, gen), randint(2, 9, gen), randint(1, 9, gen)
    yield Case(f"Tq={tq}, Tk={tk}, D={d}, Dv={dv}",
               (randn(tq, d, seed=gen), randn(tk, d, seed=gen), randn(tk, dv, seed=gen)))
    yield Case("float64 with large scores",
               (randn(tq, d, seed=gen, scale=20.0, dtype=torch.float64),
                randn(tk, d, seed=gen, scale=20.0, dtype=torch.float64),
                randn(tk, dv, seed=gen, dtype=torch.float64)))


@hidden("ch01.induction_score")
def _(gen):
    from course_attn.grading.ch01 import _causal_weights, _induction_head, _uniform_head

    b, h, t = randint(1, 3, gen), randint(1, 4, gen), randint(2, 14, gen)
    tokens = torch.randint(0, randint(2, 6, gen), (b, t), generator=gen)
    yield Case(f"random maps, B={b}, H={h}, T={t}", (_causal_weights(b, h, t, gen), tokens))
    length = randint(2, 6, gen)
    pattern = torch.randperm(20, generator=gen)[:length]
    tokens = pattern.repeat(3)[None, :randint(length + 1, 3 * length, gen)]
    t = tokens.shape[1]
    weights = torch.cat([_uniform_head(1, t, torch.float64), _induction_head(tokens, torch.float64),
                         _causal_weights(1, 1, t, gen, dtype=torch.float64)], dim=1)
    yield Case(f"a pattern of {length} tokens repeated, T={t}, float64", (weights, tokens))
    t = randint(6, 12, gen)
    many = torch.randint(0, 2, (t,), generator=gen)        # two letters: nearly every token repeats
    once = torch.randperm(20, generator=gen)[:t] + 2
    once[-1] = once[randint(0, t - 2, gen)]                # exactly one token repeats
    tokens = torch.stack([many, once] if randint(0, 1, gen) else [once, many])
    yield Case(f"two sequences, one with a single repeat, T={t}",
               (_causal_weights(2, randint(1, 3, gen), t, gen), tokens))
