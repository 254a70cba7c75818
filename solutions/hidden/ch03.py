"""Hidden cases of chapter 3: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint, randn, random_mask
from course_attn.grading.exercise import Case, hidden


@hidden("ch03.causal_mask")
def _(gen):
    tq, tk = randint(1, 12, gen), randint(1, 12, gen)
    yield Case(f"Tq={tq}, Tk={tk}", (tq, tk))
    yield Case(f"Tq={tk + 3}, Tk={tk}", (tk + 3, tk))
    yield Case(f"Tq=2, Tk={tk + 7}", (2, tk + 7))


@hidden("ch03.padding_mask")
def _(gen):
    t, b = randint(2, 12, gen), randint(1, 6, gen)  # T=1 would hide a (B, 1, T, 1) mask
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    yield Case(f"{b} random lengths, T={t}", (lengths, t))
    yield Case("int32 lengths with 0 and T", (torch.tensor([t, 0, t // 2], dtype=torch.int32), t))


@hidden("ch03.masked_attention")
def _(gen):
    b, h, tq, tk = randint(1, 2, gen), randint(1, 3, gen), randint(1, 8, gen), randint(1, 8, gen)
    d, dv = randint(1, 8, gen), randint(1, 8, gen)
    q, k = randn(b, h, tq, d, seed=gen, dtype=torch.float64), \
        randn(b, h, tk, d, seed=gen, dtype=torch.float64)
    v = randn(b, h, tk, dv, seed=gen, dtype=torch.float64)
    mask = random_mask(b, h, tq, tk, seed=gen, p_keep=0.5)
    yield Case(f"a (B, H, Tq, Tk) random mask, Tq={tq}, Tk={tk}", (q, k, v, mask))
    yield Case("a mask that allows no key", (q, k, v, torch.zeros(tq, tk, dtype=torch.bool)))
    t, d = randint(3, 8, gen), randint(2, 8, gen)
    q, k, v = (randn(b, h, t, d, seed=gen, dtype=torch.float64) for _ in range(3))
    yield Case(f"a causal mask, T={t}, D={d}",
               (q, k, v, torch.ones(t, t, dtype=torch.bool).tril()))


@hidden("ch03.document_mask")
def _(gen):
    b, t = randint(1, 3, gen), randint(2, 16, gen)
    rows = []
    for _ in range(b):
        ids, n = [], randint(0, 50, gen)
        while len(ids) < t:
            ids += [n] * randint(1, 5, gen)
            n += randint(1, 7, gen)
        ids = ids[:t]
        pad = randint(1, t // 2, gen)  # no padding at all: the public cases have it
        rows.append(ids[:t - pad] + [-1] * pad)
    yield Case(f"B={b}, T={t}, random documents and padding", (torch.tensor(rows),))
    lengths = [randint(1, 4, gen) for _ in range(randint(1, 4, gen))]
    lengths.insert(randint(0, len(lengths), gen), randint(2, 4, gen))  # one has a token after another
    ids = [n for n, length in enumerate(lengths) for _ in range(length)]
    yield Case(f"documents of lengths {lengths}, int32", (torch.tensor([ids], dtype=torch.int32),))


# ch03.fp16_fill has no hidden cases: it asks for fixed predictions (no inputs), and its one
# public case per prediction already says only whether the prediction is right, never what it is.
