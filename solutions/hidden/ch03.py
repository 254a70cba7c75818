"""Hidden cases of chapter 3: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint, randn, random_mask
from course_attn.grading.ch03 import FP16
from course_attn.grading.exercise import Case, hidden


@hidden("ch03.causal_mask", regimes={
    "Tq = Tk": lambda case: case.args[0] == case.args[1],
    "Tq < Tk (queries at the end of the keys)": lambda case: case.args[0] < case.args[1],
    "Tq > Tk by more than one (rows with no key)": lambda case: case.args[0] > case.args[1] + 1,
    "Tq = 1 (one decoding step)": lambda case: case.args[0] == 1,
})
def _(gen):
    t = randint(2, 12, gen)
    yield Case(f"Tq=Tk={t}", (t, t))
    tk = randint(3, 12, gen)
    tq = randint(2, tk - 1, gen)
    yield Case(f"Tq={tq}, Tk={tk}", (tq, tk))
    tk = randint(1, 10, gen)
    tq = tk + randint(2, 8, gen)
    yield Case(f"Tq={tq}, Tk={tk}", (tq, tk))
    tk = randint(2, 12, gen)
    yield Case(f"Tq=1, Tk={tk}", (1, tk))


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


def _half_integer(low, high, gen):
    """A score k + 0.5 in [low, high]: exact in float16 and float32, and never a tie when a
    fill + score is rounded to a grid of 8, 16, 32 or 64."""
    return randint(int(low - 0.5), int(high - 0.5), gen) + 0.5


def _scores(gen, *forced):
    """A tuple of 3 to 6 scores in [-47.5, 47.5]: the ``forced`` ones (each drawn by its
    ``(low, high)``) and random ones, in a random order."""
    n = randint(3, 6, gen)
    values = [_half_integer(low, high, gen) for low, high in forced]
    values += [_half_integer(-47.5, 47.5, gen) for _ in range(n - len(values))]
    return tuple(values[i] for i in torch.randperm(n, generator=gen).tolist())


def _pick(options, gen):
    return options[randint(0, len(options) - 1, gen)]


@hidden("ch03.fp16_fill")
def _(gen):
    """One (dtype, fill, scores) in each regime, every seed. Scores are half-integers in
    [-47.5, 47.5] (exact in both dtypes, never a tie on the grids below), 3 to 6 of them:
    - float16, a fill past its range (-1e9, -1e5, -7e4, -1e20, float32's min): the cast
      overflows, masked_fill refuses it, the row is NaN;
    - float16, its own min (-65504, grid of 32): one score <= -16 (it overflows to -inf), one
      in (-16, 16) (it rounds back to min), so the row is finite and not uniform;
    - float16, a fill that fits and is not its min (-1e4: grid of 8; -2e4, -3e4: grid of 16):
      one score within half a spacing of 0, one beyond, so the row is not uniform;
    - float32, -1e9 (grid of 64) or -1e8 (grid of 8): the same, one score within half a
      spacing, one beyond;
    - float32, a fill so large every score rounds back to it (float32's min, -1e30, -1e20):
      a uniform row, two scores of different signs so that it is not softmax(scores);
    - float32, a fill small enough that the scores survive (-1e4, -3e4, -1e5, -1e6: grids of
      2^-10 to 2^-4): softmax(scores), two scores of different signs so it is not uniform;
    - -inf in either dtype: the cast is -inf, masked_fill fills, the row is NaN.
    Every typical mistake differs from the right answer in at least one of them."""
    sizes = [dict(dtype="float16", fill=_pick((-1e9, -1e5, -7e4, -1e20,
                                               torch.finfo(torch.float32).min), gen),
                  scores=_scores(gen))]
    sizes.append(dict(dtype="float16", fill=torch.finfo(torch.float16).min,
                      scores=_scores(gen, (-47.5, -16.5), (-15.5, 15.5))))
    fill, half = _pick(((-1e4, 4), (-2e4, 8), (-3e4, 8)), gen)
    beyond = _pick(((-47.5, -half - 0.5), (half + 0.5, 47.5)), gen)
    sizes.append(dict(dtype="float16", fill=fill,
                      scores=_scores(gen, (-half + 0.5, half - 0.5), beyond)))
    fill, half = _pick(((-1e9, 32), (-1e8, 4)), gen)
    beyond = _pick(((-47.5, -half - 0.5), (half + 0.5, 47.5)), gen)
    sizes.append(dict(dtype="float32", fill=fill,
                      scores=_scores(gen, (-half + 0.5, half - 0.5), beyond)))
    sizes.append(dict(dtype="float32", fill=_pick((torch.finfo(torch.float32).min, -1e30,
                                                   -1e20), gen),
                      scores=_scores(gen, (-47.5, -0.5), (0.5, 47.5))))
    sizes.append(dict(dtype="float32", fill=_pick((-1e4, -3e4, -1e5, -1e6), gen),
                      scores=_scores(gen, (-47.5, -0.5), (0.5, 47.5))))
    sizes.append(dict(dtype=_pick(("float16", "float32"), gen), fill=float("-inf"),
                      scores=_scores(gen)))
    yield from FP16.cases(*sizes)
