"""Hidden cases of chapter 5: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md).

Every generator names its regimes (``@hidden(key, regimes=...)``, predicates on a case) and
draws a case inside each of them on every seed, the sizes drawn at random inside the regime."""

import torch

from course_attn.grading.cases import randint, randn
from course_attn.grading.ch05 import CATCHES, PREDICTIONS, SAME_SCORE_OPTIONS
from course_attn.grading.exercise import Case, hidden


def _consecutive(positions):
    return bool((positions.diff() == 1).all())


def _base(case):
    return case.kwargs.get("base", 10000.0)


# --- rope_angles: positions (T,), head_dim, base -------------------------------------------------
# Frequencies with -i/D or +2i/D show only when D >= 4 and a position is not 0, pairs counted
# from 1 only at a position other than 0; the transposed (D/2, T) table has the right shape
# only when T = D/2. The first case (positions 0..T-1, T >= 2, D >= 4) catches every typical
# mistake on every seed. Positions stay below 4096 and
# the base below 10⁶, where θ computed in float32 is within the tolerance.

@hidden("ch05.rope_angles", regimes={
    "positions 0 .. T-1 (a prompt), T > 1":
        lambda case: len(case.args[0]) > 1 and int(case.args[0][0]) == 0
        and _consecutive(case.args[0]),
    "consecutive positions from an offset > 0 (as a KV cache passes them)":
        lambda case: len(case.args[0]) > 1 and int(case.args[0][0]) > 0
        and _consecutive(case.args[0]),
    "positions not consecutive, in any order": lambda case: not _consecutive(case.args[0]),
    "T = 1 (one position)": lambda case: len(case.args[0]) == 1,
    "D = 2 (one pair, θ₀ = 1)": lambda case: case.args[1] == 2,
    "D >= 4": lambda case: case.args[1] >= 4,
    "the default base 10000": lambda case: "base" not in case.kwargs,
    "another base": lambda case: _base(case) != 10000.0,
})
def _(gen):
    t, d = randint(2, 12, gen), 2 * randint(2, 32, gen)
    yield Case(f"positions 0..{t - 1}, D={d}", (torch.arange(t), d))
    t, d, start = randint(2, 12, gen), 2 * randint(2, 32, gen), randint(1, 500, gen)
    yield Case(f"positions {start}..{start + t - 1}, D={d}", (torch.arange(start, start + t), d))
    n, d = randint(2, 8, gen), 2 * randint(2, 32, gen)
    steps = torch.randint(2, 500, (n,), generator=gen)      # gaps of 2 or more: not consecutive
    positions = steps.cumsum(0) - steps[0] + randint(0, 500, gen)
    positions = positions[torch.randperm(n, generator=gen)]
    base = float(randint(2, 1_000_000, gen))
    yield Case(f"positions {positions.tolist()}, D={d}, base={base:g}", (positions, d),
               {"base": base})
    position, d = randint(0, 4000, gen), 2 * randint(2, 32, gen)
    yield Case(f"one position, {position}, D={d}", (torch.tensor([position]), d))
    t, start = randint(2, 12, gen), randint(0, 100, gen)
    yield Case(f"D=2, positions {start}..{start + t - 1}", (torch.arange(start, start + t), 2))


# --- apply_rope: x (B, H, T, D), base ----------------------------------------------------------
# With T = 1 the one token sits at position 0 and is not turned: turning by -tθ, the
# interleaved pairs and the frequencies with -i/D or +2i/D are right there, and the last three
# are right with D = 2 too. The first case (T >= 2, D >= 4) catches every typical mistake on
# every seed.

def _shape(case):
    return case.args[0].shape


@hidden("ch05.apply_rope", regimes={
    "T > 1 and D >= 4": lambda case: _shape(case)[2] > 1 and _shape(case)[3] >= 4,
    "T = 1 (one token, at position 0: unchanged)": lambda case: _shape(case)[2] == 1,
    "D = 2 (one pair)": lambda case: _shape(case)[3] == 2,
    "B·H > 1 (cos and sin broadcast over the batch and the heads)":
        lambda case: _shape(case)[0] * _shape(case)[1] > 1,
    "the default base 10000": lambda case: "base" not in case.kwargs,
    "another base": lambda case: _base(case) != 10000.0,
    "float32": lambda case: case.args[0].dtype == torch.float32,
    "float64": lambda case: case.args[0].dtype == torch.float64,
}, central=("T > 1 and D >= 4",))
def _(gen):
    b, h, t = randint(2, 3, gen), randint(1, 3, gen), randint(2, 16, gen)
    d = 2 * randint(2, 16, gen)
    yield Case(f"B={b}, H={h}, T={t}, D={d}", (randn(b, h, t, d, seed=gen),))
    h, t, d = randint(1, 3, gen), randint(2, 16, gen), 2 * randint(2, 16, gen)
    base = float(randint(10, 100_000, gen))
    yield Case(f"float64, H={h}, T={t}, D={d}, base={base:g}",
               (randn(1, h, t, d, seed=gen, dtype=torch.float64),), {"base": base})
    b, h, d = randint(1, 3, gen), randint(1, 3, gen), 2 * randint(1, 16, gen)
    yield Case(f"T=1, B={b}, H={h}, D={d}", (randn(b, h, 1, d, seed=gen),))
    h, t = randint(1, 3, gen), randint(2, 12, gen)
    yield Case(f"D=2, H={h}, T={t}", (randn(1, h, t, 2, seed=gen),))


# --- pairing_permutation: head_dim ---------------------------------------------------------------
# The inverse permutation is right when D <= 4 (there the permutation is its own inverse), the
# identity when D = 2: the cases with D/2 odd and even both have D >= 6.

@hidden("ch05.pairing_permutation", regimes={
    "D = 2 (one pair: the two layouts agree)": lambda case: case.args[0] == 2,
    "D/2 odd, D >= 6": lambda case: case.args[0] >= 6 and case.args[0] // 2 % 2 == 1,
    "D/2 even, D >= 8": lambda case: case.args[0] >= 8 and case.args[0] // 2 % 2 == 0,
})
def _(gen):
    yield Case("D=2", (2,))
    d = 2 * (2 * randint(1, 31, gen) + 1)
    yield Case(f"D={d}", (d,))
    d = 4 * randint(2, 32, gen)
    yield Case(f"D={d}", (d,))


# ch05.rope_predictions: one set of sizes and positions in each of three regimes, on every seed:
#   1. near the start of a sequence, the query after the key (as in a causal model): D 8..64,
#      base 100..50000, key at 20..300, m - n = 1..40;
#   2. deep in a long context with a large base (as Llama 3): D 64..256, base 100000..1000000,
#      key at 1000..30000, m - n = 1..300;
#   3. the query before the key (no causal mask): D 8..128, base 1000..200000, key at
#      320..3000, m - n = -300..-1.
# The offset r = m - n is never 0 and |r| <= 300, so |sin r| >= 0.0088: the score sin(m - n) is
# told from -sin(m - n) and from 0. The candidates are, in a drawn order: the answer (both
# positions shifted by 1..2000), the reversed difference (n - m, shifted by 0..2000), the key's
# position n with a query 1..20 further from it, and the query's position m with a key 1..20
# further from it; the last two have a difference larger than |r| in size, so exactly one
# candidate has the score of (m, n).
_REGIMES = (
    # (name, D/2 range, base range, key position range, offset range)
    ("near the start, query after key", (4, 32), (100, 50_000), (20, 300), (1, 40)),
    ("long context, large base", (32, 128), (100_000, 1_000_000), (1000, 30_000), (1, 300)),
    ("query before key", (4, 64), (1000, 200_000), (320, 3000), (-300, -1)),
)


def _in(value, bounds):
    return bounds[0] <= value <= bounds[1]


def _inside(half, bases, keys, offsets):
    """Whether a case's sizes and positions lie in a regime's ranges."""
    def inside(case):
        size = case.kwargs
        return (size["head_dim"] % 2 == 0 and _in(size["head_dim"] // 2, half)
                and _in(size["base"], bases) and _in(size["n"], keys)
                and _in(size["m"] - size["n"], offsets))
    return inside


@hidden("ch05.rope_predictions",
        regimes={name: _inside(*ranges) for name, *ranges in _REGIMES})
def _(gen):
    for _name, half, bases, keys, offsets in _REGIMES:
        head_dim, base = 2 * randint(*half, gen), float(randint(*bases, gen))
        n, r = randint(*keys, gen), randint(*offsets, gen)
        m, away = n + r, 1 if r > 0 else -1     # away: the direction that makes |m - n| larger
        shift, back = randint(1, 2000, gen), randint(0, 2000, gen)
        pairs = [(m + shift, n + shift), (n + back, m + back),
                 (m + away * randint(1, 20, gen), n), (m, n - away * randint(1, 20, gen))]
        order = torch.randperm(4, generator=gen).tolist()
        candidates = {SAME_SCORE_OPTIONS[order[j]]: pairs[j] for j in range(4)}
        yield from PREDICTIONS.cases(dict(head_dim=head_dim, base=base, m=m, n=n,
                                          candidates=dict(sorted(candidates.items()))))


# --- rotary (debug): x (B, H, T, D), positions (T,), base ---------------------------------------
# The given mixed layout and the interleaved pairing are right when D = 2 or every position is
# 0; the turn by -mθ when every position is 0; turning by the index 0 .. T-1 when the positions
# are 0 .. T-1. The first case (positions from an offset, D >= 4) catches every typical mistake
# on every seed; the others sample prompts, positions in any order, one pair and one token.

def _rx(case):
    return case.args[0]


def _positions(case):
    return case.args[1]


@hidden("ch05.rotary", regimes={
    "consecutive positions from an offset > 0 (as a KV cache passes them), D >= 4":
        lambda case: len(_positions(case)) > 1 and int(_positions(case)[0]) > 0
        and _consecutive(_positions(case)) and _rx(case).shape[-1] >= 4,
    "positions 0 .. T-1 (a prompt), T > 1":
        lambda case: len(_positions(case)) > 1 and int(_positions(case)[0]) == 0
        and _consecutive(_positions(case)),
    "positions not consecutive, in any order": lambda case: not _consecutive(_positions(case)),
    "D = 2 (one pair: every layout agrees)": lambda case: _rx(case).shape[-1] == 2,
    "T = 1 (one position)": lambda case: len(_positions(case)) == 1,
    "the default base 10000": lambda case: "base" not in case.kwargs,
    "another base": lambda case: _base(case) != 10000.0,
    "float32": lambda case: _rx(case).dtype == torch.float32,
    "float64": lambda case: _rx(case).dtype == torch.float64,
})
def _(gen):
    b, h, t = randint(1, 3, gen), randint(1, 3, gen), randint(2, 12, gen)
    d = 2 * randint(2, 16, gen)
    start = randint(1, 2000, gen)
    yield Case(f"B={b}, H={h}, positions {start}..{start + t - 1}, D={d}",
               (randn(b, h, t, d, seed=gen), torch.arange(start, start + t)))
    h, t, d = randint(1, 3, gen), randint(2, 12, gen), 2 * randint(2, 16, gen)
    yield Case(f"float64, H={h}, positions 0..{t - 1}, D={d}",
               (randn(1, h, t, d, seed=gen, dtype=torch.float64), torch.arange(t)))
    n, d = randint(2, 6, gen), 2 * randint(1, 16, gen)
    steps = torch.randint(2, 300, (n,), generator=gen)       # gaps of 2 or more: not consecutive
    positions = steps.cumsum(0) - steps[0] + randint(0, 300, gen)
    positions = positions[torch.randperm(n, generator=gen)]
    base = float(randint(10, 1_000_000, gen))
    yield Case(f"positions {positions.tolist()}, D={d}, base={base:g}",
               (randn(1, 2, n, d, seed=gen), positions), {"base": base})
    t, start = randint(2, 10, gen), randint(0, 500, gen)
    yield Case(f"D=2, positions {start}..{start + t - 1}",
               (randn(2, 1, t, 2, seed=gen), torch.arange(start, start + t)))
    position, d = randint(0, 3000, gen), 2 * randint(1, 16, gen)
    yield Case(f"one position, {position}, D={d}",
               (randn(1, 2, 1, d, seed=gen), torch.tensor([position])))


# --- rope_test_catches (predict): head_dim, T, shift ---------------------------------------------
# Mistaking D = 2 for a wider head shows only with D = 2, mistaking T = 1 for a longer sequence
# only with T = 1: each has a regime of its own, drawn on every seed; every other typical
# mistake shows in the first regime (D >= 4, T >= 2). The shift is never 0 (a relative test
# that compares a score with itself would catch nothing).

@hidden("ch05.rope_test_catches", regimes={
    "D >= 4 and T >= 2": lambda case: case.kwargs["head_dim"] >= 4 and case.kwargs["T"] >= 2,
    "D = 2 (one pair), T >= 2":
        lambda case: case.kwargs["head_dim"] == 2 and case.kwargs["T"] >= 2,
    "T = 1 (position 0 only), D >= 4":
        lambda case: case.kwargs["T"] == 1 and case.kwargs["head_dim"] >= 4,
})
def _(gen):
    sizes = [dict(head_dim=2 * randint(2, 64, gen), T=randint(2, 16, gen),
                  shift=randint(1, 1000, gen)),
             dict(head_dim=2, T=randint(2, 16, gen), shift=randint(1, 1000, gen)),
             dict(head_dim=2 * randint(2, 64, gen), T=1, shift=randint(1, 1000, gen))]
    yield from CATCHES.cases(*sizes)


# --- hf_to_meta_rows (implement): w (H·D, C), n_heads ------------------------------------------
# The chapter's direction (Meta -> HF) is its own inverse when D <= 4; all rows as one head is
# right when H = 1 or D = 2; swapped pairs are right when D = 2 never (they swap the two rows).
# The first case (H >= 2, D >= 6) catches every typical mistake on every seed.

def _rows_heads(case):
    return case.args[1]


def _rows_d(case):
    return case.args[0].shape[0] // case.args[1]


@hidden("ch05.hf_to_meta_rows", regimes={
    "H >= 2 and D >= 6": lambda case: _rows_heads(case) >= 2 and _rows_d(case) >= 6,
    "H = 1 (one head)": lambda case: _rows_heads(case) == 1,
    "D = 4 (within a head, the permutation is its own inverse)": lambda case: _rows_d(case) == 4,
    "D = 2 (one pair per head)": lambda case: _rows_d(case) == 2,
    "C != H·D (as W_K of grouped-query attention)":
        lambda case: case.args[0].shape[1] != case.args[0].shape[0],
    "float32": lambda case: case.args[0].dtype == torch.float32,
    "float64": lambda case: case.args[0].dtype == torch.float64,
}, central=("H >= 2 and D >= 6",))
def _(gen):
    h, d = randint(2, 4, gen), 2 * randint(3, 16, gen)
    yield Case(f"H={h}, D={d}, C={h * d}", (randn(h * d, h * d, seed=gen), h))
    d, c = 2 * randint(2, 16, gen), randint(2, 64, gen)
    c = c if c != d else c + 1
    yield Case(f"float64, H=1, D={d}, C={c}", (randn(d, c, seed=gen, dtype=torch.float64), 1))
    h = randint(1, 4, gen)
    yield Case(f"H={h}, D=4, C={4 * h}", (randn(4 * h, 4 * h, seed=gen), h))
    h, c = randint(1, 6, gen), randint(2, 32, gen)
    yield Case(f"H={h}, D=2, C={c}", (randn(2 * h, c, seed=gen), h))
