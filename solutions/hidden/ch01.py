"""Hidden cases of chapter 1: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md).

Each generator names its regimes (``@hidden(key, regimes={...})``, predicates on a case) and
draws a case inside every one of them on every seed; ``tests/test_hidden_regimes.py`` checks it.
"""

import torch

from course_attn.data import induction_targets
from course_attn.grading.cases import randint, randn
from course_attn.grading.exercise import Case, hidden

EXP_MAX = 709.0     # math.exp overflows past it (float64)
EXP_MIN = -745.0    # and underflows to 0.0 below it


def _scaled_to(x: torch.Tensor, scores: torch.Tensor, low: float, high: float, gen):
    """``x`` times the factor that puts the largest |score| (``scores``, linear in ``x``) at a
    number drawn in [low, high], and that score positive: the edge of the regime, where exp
    overflows (a large negative score only underflows, which a raw exp survives)."""
    target = low + (high - low) * float(torch.rand((), generator=gen, dtype=torch.float64))
    sign = 1.0 if float(scores.max()) >= -float(scores.min()) else -1.0
    return x * (sign * target / float(scores.abs().max()))


# --- softmax_list ------------------------------------------------------------------------------

def _scores(case):
    return case.args[0]


@hidden("ch01.softmax_list", regimes={
    "moderate scores (every exp in range)": lambda case: max(map(abs, _scores(case))) < 100,
    "the largest score past 709 (a raw exp overflows)":
        lambda case: max(_scores(case)) > EXP_MAX,
    "every score below -745 (every raw exp underflows to 0)":
        lambda case: max(_scores(case)) < EXP_MIN,
    "the largest score after the first, over 709 above the first and the mean": lambda case: (
        (s := _scores(case)).index(max(s)) > 0 and max(s) - s[0] > EXP_MAX
        and max(s) - sum(s) / len(s) > EXP_MAX),
    "a tie for the largest score": lambda case: _scores(case).count(max(_scores(case))) > 1,
    "a single score": lambda case: len(_scores(case)) == 1,
}, central=("moderate scores (every exp in range)",))
def _(gen):
    n = randint(2, 9, gen)
    yield Case(f"{n} random scores", (randn(n, seed=gen, scale=5.0, dtype=torch.float64).tolist(),))
    big = randn(n, seed=gen, scale=300.0, dtype=torch.float64).abs() + 720  # all past exp's range
    yield Case(f"{n} scores from 720 up, spread 300", (big.tolist(),))
    low = -randn(n, seed=gen, scale=200.0, dtype=torch.float64).abs() - 760
    yield Case(f"{n} scores below -760", (low.tolist(),))
    top = 700.0 + randint(0, 200, gen) + 0.5
    tied = randn(n, seed=gen, scale=5.0, dtype=torch.float64).tolist()
    first, second = sorted(torch.randperm(n, generator=gen)[:2].tolist())
    tied[first] = tied[second] = top
    yield Case(f"{n} scores, two equal large ones ({top})", (tied,))
    spiked = randn(n, seed=gen, scale=5.0, dtype=torch.float64)
    spiked[randint(1, n - 1, gen)] += 2000.0
    yield Case(f"{n} scores, one after the first 2000 above the rest", (spiked.tolist(),))
    yield Case("a single score", ([float(randn(1, seed=gen, scale=50.0, dtype=torch.float64))],))


# --- soft_lookup -------------------------------------------------------------------------------

def _lookup_scores(case):
    query, keys, _ = case.args
    return [sum(q * k for q, k in zip(query, key)) for key in keys]


@hidden("ch01.soft_lookup", regimes={
    "moderate scores (|query · key| < 50)":
        lambda case: max(map(abs, _lookup_scores(case))) < 50,
    "large scores (|query · key| past 709, exp overflows)":
        lambda case: max(map(abs, _lookup_scores(case))) > EXP_MAX,
    "Dv != D (the answer is as long as a value)":
        lambda case: len(case.args[2][0]) != len(case.args[0]),
    "Dv = D": lambda case: len(case.args[2][0]) == len(case.args[0]),
    "a single key (T = 1: its value)": lambda case: len(case.args[1]) == 1,
    "several keys (T > 1)": lambda case: len(case.args[1]) > 1,
})
def _(gen):
    # Every case with T > 1 has D >= 2: one key or D = 1 hides a √D scaling or a hard lookup.
    rows = lambda r, c, s=1.0: randn(r, c, seed=gen, scale=s, dtype=torch.float64)  # noqa: E731
    d, t = randint(2, 5, gen), randint(2, 7, gen)
    dv = d + randint(1, 3, gen) * (1 if randint(0, 1, gen) else -1)
    dv = dv if dv >= 1 else d + 1
    query = randn(d, seed=gen, dtype=torch.float64)
    yield Case(f"T={t}, D={d}, Dv={dv}", (query.tolist(), rows(t, d).tolist(),
                                           rows(t, dv).tolist()))
    d, t = randint(2, 5, gen), randint(2, 7, gen)
    query, keys = randn(d, seed=gen, dtype=torch.float64), rows(t, d)
    keys = _scaled_to(keys, keys @ query, 1000.0, 3000.0, gen)
    yield Case(f"large scores, T={t}, D=Dv={d}", (query.tolist(), keys.tolist(),
                                                  rows(t, d).tolist()))
    d, dv = randint(2, 5, gen), randint(1, 5, gen)
    yield Case(f"a single key, D={d}, Dv={dv}", (randn(d, seed=gen).tolist(), rows(1, d).tolist(),
                                                 rows(1, dv).tolist()))


# --- attend ------------------------------------------------------------------------------------

def _tq(case):
    return case.args[0].shape[0]


def _tk(case):
    return case.args[1].shape[0]


@hidden("ch01.attend", regimes={
    "Tq = Tk": lambda case: _tq(case) == _tk(case),
    "Tq < Tk": lambda case: _tq(case) < _tk(case),
    "Tq > Tk": lambda case: _tq(case) > _tk(case),
    "Tq = 1 (one query)": lambda case: _tq(case) == 1,
    "Tk = 1 (one key: every query returns its value)": lambda case: _tk(case) == 1,
    "Dv != D": lambda case: case.args[2].shape[-1] != case.args[0].shape[-1],
    "float32": lambda case: case.args[0].dtype == torch.float32,
    "float64": lambda case: case.args[0].dtype == torch.float64,
    "large scores (|q kᵀ| past 709, float64)": lambda case: bool(
        (case.args[0] @ case.args[1].T).abs().max() > EXP_MAX),
})
def _(gen):
    # D >= 2 everywhere (D = 1 hides a √D scaling); Tq >= 2 and Tk >= 2 where the softmax's
    # axis is tried (a softmax over the queries equals the right one when either is 1).
    def qkv(tq, tk, d, dv, dtype=torch.float32):
        return (randn(tq, d, seed=gen, dtype=dtype), randn(tk, d, seed=gen, dtype=dtype),
                randn(tk, dv, seed=gen, dtype=dtype))

    t, d = randint(2, 8, gen), randint(2, 8, gen)
    dv = d + randint(1, 4, gen)
    yield Case(f"Tq=Tk={t}, D={d}, Dv={dv}", qkv(t, t, d, dv))
    tk, d = randint(3, 9, gen), randint(2, 8, gen)
    tq = randint(2, tk - 1, gen)
    yield Case(f"Tq={tq} < Tk={tk}, D={d}", qkv(tq, tk, d, randint(1, 8, gen)))
    tk, d = randint(2, 6, gen), randint(2, 8, gen)
    tq = tk + randint(2, 4, gen)
    yield Case(f"Tq={tq} > Tk={tk}, D={d}, float64", qkv(tq, tk, d, randint(1, 8, gen),
                                                         torch.float64))
    tk, d = randint(2, 9, gen), randint(2, 8, gen)
    yield Case(f"Tq=1, Tk={tk}, D={d}", qkv(1, tk, d, randint(1, 8, gen)))
    tq, d = randint(2, 6, gen), randint(2, 8, gen)
    yield Case(f"Tk=1, Tq={tq}, D={d}", qkv(tq, 1, d, randint(1, 8, gen)))
    tq, tk, d = randint(2, 6, gen), randint(2, 6, gen), randint(2, 8, gen)
    q, k, v = qkv(tq, tk, d, randint(1, 6, gen), torch.float64)
    yield Case(f"float64 with large scores, Tq={tq}, Tk={tk}",
               (_scaled_to(q, q @ k.T, 1000.0, 4000.0, gen), k, v))


# --- induction_score ---------------------------------------------------------------------------

def _counted(case):
    """(B,): how many positions of each sequence have an induction target."""
    return (induction_targets(case.args[1]) >= 0).sum(dim=-1)


def _occurrences(tokens):
    """The largest number of times a token occurs in one sequence."""
    return max(int(row.unique(return_counts=True)[1].max()) for row in tokens)


@hidden("ch01.induction_score", regimes={
    "B = 1": lambda case: case.args[1].shape[0] == 1,
    "B > 1, sequences with different numbers of repeats (a mean of means differs)":
        lambda case: case.args[1].shape[0] > 1 and len(set(_counted(case).tolist())) > 1,
    "H = 1": lambda case: case.args[0].shape[1] == 1,
    "H > 1": lambda case: case.args[0].shape[1] > 1,
    "no token occurs twice (every head scores 0)": lambda case: int(_counted(case).sum()) == 0,
    "a token repeated right away (A A: its target is its own position)":
        lambda case: bool((case.args[1][:, 1:] == case.args[1][:, :-1]).any()),
    "a token occurring three or more times (the most recent occurrence counts)":
        lambda case: _occurrences(case.args[1]) >= 3,
    "float32": lambda case: case.args[0].dtype == torch.float32,
    "float64": lambda case: case.args[0].dtype == torch.float64,
}, central=("B > 1, sequences with different numbers of repeats (a mean of means differs)",))
def _(gen):
    from course_attn.grading.ch01 import _causal_weights, _induction_head, _uniform_head

    # Every seed needs: a token with two earlier occurrences (first vs most recent), positions
    # that are not counted (every position), B > 1 with different counts (mean of means), and
    # maps that are not symmetric in their targets (previous position, transposed).
    b, h, vocab = randint(2, 3, gen), randint(2, 4, gen), randint(2, 4, gen)
    t = randint(2 * vocab + 1, 14, gen)                  # some token occurs three times
    tokens = torch.randint(0, vocab, (b, t), generator=gen)
    row, at = randint(0, b - 1, gen), randint(1, t - 1, gen)
    tokens[row, at] = tokens[row, at - 1]                # A A somewhere
    yield Case(f"random maps, B={b}, H={h}, T={t}, {vocab} letters", (_causal_weights(b, h, t, gen),
                                                                     tokens))
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
    yield Case(f"two sequences, one with a single repeat, T={t}, H=1",
               (_causal_weights(2, 1, t, gen), tokens))
    b, h, t = randint(1, 2, gen), randint(1, 3, gen), randint(2, 8, gen)
    tokens = torch.stack([torch.randperm(30, generator=gen)[:t] for _ in range(b)])
    yield Case(f"no token occurs twice, B={b}, H={h}, T={t}", (_causal_weights(b, h, t, gen),
                                                              tokens))
