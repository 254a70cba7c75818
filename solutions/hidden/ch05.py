"""Hidden cases of chapter 5: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint, randn
from course_attn.grading.ch05 import PREDICTIONS, SAME_SCORE_OPTIONS
from course_attn.grading.exercise import Case, hidden


@hidden("ch05.rope_angles")
def _(gen):
    t, d, start = randint(2, 12, gen), 2 * randint(2, 32, gen), randint(0, 500, gen)
    yield Case(f"positions {start}..{start + t - 1}, D={d}", (torch.arange(start, start + t), d))
    positions = torch.randint(0, 4096, (randint(1, 8, gen),), generator=gen)
    base = float(randint(2, 1_000_000, gen))
    yield Case(f"random positions, D={d}, base={base:g}", (positions, d), {"base": base})


@hidden("ch05.apply_rope")
def _(gen):
    b, h, t, d = randint(1, 2, gen), randint(1, 3, gen), randint(2, 16, gen), 2 * randint(2, 16, gen)
    yield Case(f"B={b}, H={h}, T={t}, D={d}", (randn(b, h, t, d, seed=gen),))
    base = float(randint(10, 100_000, gen))
    yield Case(f"float64, T={t}, D={d}, base={base:g}",
               (randn(1, h, t, d, seed=gen, dtype=torch.float64),), {"base": base})


@hidden("ch05.pairing_permutation")
def _(gen):
    d = 2 * randint(3, 64, gen)
    yield Case(f"D={d}", (d,))
    yield Case(f"D={d + 2}", (d + 2,))


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


@hidden("ch05.rope_predictions")
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
