"""Hidden cases of chapter 3: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md).

Each generator names its regimes (``@hidden(key, regimes={...})``, predicates on a case) and
draws a case inside every one of them on every seed; ``tests/test_hidden_regimes.py`` checks it.
"""

import math

import torch

from course_attn.grading.cases import randint, randn, random_mask
from course_attn.grading.ch03 import FP16
from course_attn.grading.exercise import Case, hidden


@hidden("ch03.causal_mask", regimes={
    "Tq = Tk": lambda case: case.args[0] == case.args[1],
    "Tq < Tk (queries at the end of the keys)": lambda case: case.args[0] < case.args[1],
    "Tq > Tk by more than one (rows with no key)": lambda case: case.args[0] > case.args[1] + 1,
    "Tq = 1 (one decoding step)": lambda case: case.args[0] == 1,
}, central=("Tq = Tk",))
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
    # the edges, on every seed: the largest gap on a single key, the smallest on the most keys
    # (a mask wrong only past some gap, or only one query short of square, fails here)
    yield Case("Tq=9, Tk=1", (9, 1))
    yield Case("Tq=11, Tk=12", (11, 12))


# --- padding_mask ------------------------------------------------------------------------------

def _lengths(case):
    return case.args[0].tolist()


@hidden("ch03.padding_mask", regimes={
    "B = 1": lambda case: len(_lengths(case)) == 1,
    "B > 1": lambda case: len(_lengths(case)) > 1,
    "a length of 0 (a sequence with no real token)": lambda case: 0 in _lengths(case),
    "a length of T (no padding)": lambda case: case.args[1] in _lengths(case),
    "a length strictly between 0 and T": lambda case: any(0 < n < case.args[1]
                                                          for n in _lengths(case)),
    "T = 1": lambda case: case.args[1] == 1,
    "int64 lengths": lambda case: case.args[0].dtype == torch.int64,
    "int32 lengths": lambda case: case.args[0].dtype == torch.int32,
})
def _(gen):
    # T >= 2 except in the T = 1 case (T = 1 hides a (B, 1, T, 1) mask), and a length in
    # [1, T - 1] in the B = 1 case (a length of 0 or T hides an off-by-one).
    t, b = randint(2, 12, gen), randint(3, 6, gen)
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    ends = torch.randperm(b, generator=gen)[:2]
    lengths[ends[0]], lengths[ends[1]] = 0, t
    yield Case(f"{b} random lengths with 0 and T, T={t}", (lengths, t))
    t = randint(2, 12, gen)
    n = randint(1, t - 1, gen)
    yield Case(f"B=1, int32 length {n}, T={t}", (torch.tensor([n], dtype=torch.int32), t))
    b = randint(2, 4, gen)
    yield Case(f"T=1, B={b}", (torch.randint(0, 2, (b,), generator=gen), 1))


# --- masked_attention --------------------------------------------------------------------------

def _tq(case):
    return case.args[0].shape[-2]


def _tk(case):
    return case.args[1].shape[-2]


def _mask(case):
    """The case's mask, broadcast to (B, H, Tq, Tk)."""
    q, k, _, mask = case.args
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


@hidden("ch03.masked_attention", regimes={
    "Tq = Tk": lambda case: _tq(case) == _tk(case),
    "Tq < Tk": lambda case: _tq(case) < _tk(case),
    "Tq > Tk": lambda case: _tq(case) > _tk(case),
    "Tq = 1 (one query)": lambda case: _tq(case) == 1,
    "a (B, H, Tq, Tk) mask": lambda case: case.args[3].dim() == 4 and
        case.args[3].shape[1] == case.args[0].shape[1] > 1,
    "a (Tq, Tk) mask, broadcast over B and H": lambda case: case.args[3].dim() == 2,
    "a (B, 1, 1, Tk) padding mask": lambda case: case.args[3].dim() == 4 and
        case.args[3].shape[1:3] == (1, 1),
    "a query with no allowed key (its row gives zeros)":
        lambda case: bool((~_mask(case)).all(dim=-1).any()),
    "a query with some keys allowed and some forbidden":
        lambda case: bool((_mask(case).any(dim=-1) & (~_mask(case)).any(dim=-1)).any()),
    "Dv != D": lambda case: case.args[2].shape[-1] != case.args[0].shape[-1],
    "float32": lambda case: case.args[0].dtype == torch.float32,
    "float64": lambda case: case.args[0].dtype == torch.float64,
})
def _(gen):
    # D >= 2 everywhere (D = 1 hides a missing 1/sqrt(D)); Tk >= 2 everywhere, and in every case
    # a row with both allowed and forbidden keys (adding the mask as 0/1, or masking after the
    # softmax, shows there), and a dead row in two (-1e9 and NaN show there).
    def qkv(b, h, tq, tk, dtype=torch.float32, dv_differs=False):
        d = randint(2, 8, gen)
        dv = d + randint(1, 4, gen) if dv_differs else randint(1, 8, gen)
        return (randn(b, h, tq, d, seed=gen, dtype=dtype),
                randn(b, h, tk, d, seed=gen, dtype=dtype),
                randn(b, h, tk, dv, seed=gen, dtype=dtype))

    b, h, tk = randint(1, 2, gen), randint(2, 3, gen), randint(3, 8, gen)
    tq = randint(2, tk - 1, gen)
    q, k, v = qkv(b, h, tq, tk, dv_differs=True)
    mask = random_mask(b, h, tq, tk, seed=gen, p_keep=0.5)
    where = [randint(0, n - 1, gen) for n in (b, h, tq)]
    mask[where[0], where[1], where[2]] = False                       # a dead row
    row = (where[2] + 1) % tq
    mask[where[0], where[1], row] = torch.randperm(tk, generator=gen) < randint(1, tk - 1, gen)
    yield Case(f"a (B, H, Tq, Tk) random mask with a dead row, Tq={tq} < Tk={tk}",
               (q, k, v, mask))
    t = randint(3, 8, gen)
    q, k, v = qkv(randint(1, 2, gen), randint(1, 3, gen), t, t, torch.float64)
    yield Case(f"a (T, T) causal mask, T={t}, float64",
               (q, k, v, torch.ones(t, t, dtype=torch.bool).tril()))
    tk = randint(2, 6, gen)
    tq = tk + randint(2, 4, gen)
    q, k, v = qkv(2, randint(1, 3, gen), tq, tk, torch.float64)
    lengths = torch.tensor([0, randint(1, tk - 1, gen)])[torch.randperm(2, generator=gen)]
    mask = (torch.arange(tk)[None, :] < lengths[:, None])[:, None, None]
    yield Case(f"a padding mask, lengths {lengths.tolist()}, Tq={tq} > Tk={tk}, float64",
               (q, k, v, mask))
    b, tk = randint(1, 2, gen), randint(2, 8, gen)
    q, k, v = qkv(b, randint(1, 3, gen), 1, tk)
    mask = torch.randperm(tk, generator=gen) < randint(1, tk - 1, gen)
    yield Case(f"one query, Tk={tk}, a (1, Tk) mask", (q, k, v, mask[None]))


# --- document_mask -----------------------------------------------------------------------------

def _ids(case):
    return case.args[0]


def _runs(row):
    """The lengths of the documents of a row of ids (padding left out), in order."""
    runs = []
    for i, n in enumerate(row.tolist()):
        if n < 0:
            continue
        if i and runs and row[i - 1].item() == n:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


@hidden("ch03.document_mask", regimes={
    "B = 1": lambda case: _ids(case).shape[0] == 1,
    "B > 1": lambda case: _ids(case).shape[0] > 1,
    "padding (-1) at the end": lambda case: bool((_ids(case) < 0).any()),
    "no padding": lambda case: bool((_ids(case) >= 0).all()),
    "a one-token document": lambda case: any(1 in _runs(row) for row in _ids(case)),
    "a document of 2+ tokens after another document": lambda case: any(
        max(_runs(row)[1:], default=0) >= 2 for row in _ids(case)),
    "one document fills the row (the causal mask)":
        lambda case: any(bool((row == row[0]).all()) and row[0] >= 0 for row in _ids(case)),
    "int64 ids": lambda case: _ids(case).dtype == torch.int64,
    "int32 ids": lambda case: _ids(case).dtype == torch.int32,
})
def _(gen):
    b, t = randint(2, 3, gen), randint(4, 16, gen)
    rows = []
    for _ in range(b):
        ids, n = [], randint(0, 50, gen)
        while len(ids) < t:
            ids += [n] * randint(1, 5, gen)
            n += randint(1, 7, gen)
        ids = ids[:t]
        pad = randint(1, t // 2, gen)  # padding in every row: the other cases have none
        rows.append(ids[:t - pad] + [-1] * pad)
    yield Case(f"B={b}, T={t}, random documents and padding", (torch.tensor(rows),))
    lengths = [randint(1, 4, gen) for _ in range(randint(1, 3, gen))]
    lengths.insert(randint(0, len(lengths), gen), 1)                  # a one-token document
    # a document of 2 to 4 tokens after another one
    lengths.insert(randint(1, len(lengths), gen), randint(2, 4, gen))
    ids = [n for n, length in enumerate(lengths) for _ in range(length)]
    yield Case(f"documents of lengths {lengths}, int32", (torch.tensor([ids], dtype=torch.int32),))
    t = randint(2, 10, gen)
    yield Case(f"one document of {t} tokens", (torch.full((1, t), randint(0, 50, gen)),))


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


F16_MIN = torch.finfo(torch.float16).min     # -65504; below -65520 a float16 cast is -inf


def _finite_fill(case, dtype, low, high):
    """Whether the case asks about ``dtype`` with a finite fill in [low, high]."""
    fill = case.kwargs["fill"]
    return case.kwargs["dtype"] == dtype and math.isfinite(fill) and low <= fill <= high


@hidden("ch03.fp16_fill", regimes={
    "float16, a fill past its range (the cast is -inf, the row NaN)":
        lambda case: _finite_fill(case, "float16", -math.inf, F16_MIN - 16.5),
    "float16, its own min (-65504), a score >= 16 among them":
        lambda case: _finite_fill(case, "float16", F16_MIN, F16_MIN)
        and max(case.kwargs["scores"]) >= 16,
    "float16, a fill that fits and is not its min (a grid of 8 or 16)":
        lambda case: _finite_fill(case, "float16", F16_MIN + 1, -1.0),
    "float32, a fill near 1e8-1e9 (a grid that keeps some scores apart)":
        lambda case: _finite_fill(case, "float32", -1e10, -1e7),
    "float32, a fill so large every score rounds back to it (a uniform row)":
        lambda case: _finite_fill(case, "float32", -math.inf, -1e19),
    "float32, a fill small enough that the scores survive (softmax of the scores)":
        lambda case: _finite_fill(case, "float32", -1e7 + 1, -1.0),
    "-inf (the row is NaN)": lambda case: case.kwargs["fill"] == -math.inf,
})
def _(gen):
    """One (dtype, fill, scores) in each regime, every seed. Scores are half-integers in
    [-47.5, 47.5] (exact in both dtypes, never a tie on the grids below), 3 to 6 of them:
    - float16, a fill past its range (-1e9, -1e5, -7e4, -1e20, float32's min): the cast
      overflows, masked_fill refuses it, the row is NaN;
    - float16, its own min (-65504, grid of 32): one score <= -16 (it overflows to -inf), one
      in (-16, 16) (it rounds back to min), one >= 16 (it rounds up to -65472, where min
      minus it would overflow to +inf), so the row is finite and not uniform;
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
                      scores=_scores(gen, (-47.5, -16.5), (-15.5, 15.5), (16.5, 47.5))))
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
