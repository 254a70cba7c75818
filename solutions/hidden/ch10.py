"""Hidden cases of chapter 10: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint, randn
from course_attn.grading.ch10 import COSTS, TRENDS, chunk_case, sequence_case, step_case
from course_attn.grading.exercise import Case, hidden


def _both_signs(x, gen, low=0.1):
    """``x`` with one entry made positive and another made non-positive (at least ``low`` away
    from 0), at random places: x + 1 everywhere, exp everywhere and relu + 1 are each wrong
    on one of them."""
    flat = x.flatten().clone()
    i = randint(0, flat.numel() - 1, gen)
    j = (i + randint(1, flat.numel() - 1, gen)) % flat.numel()
    flat[i], flat[j] = flat[i].abs() + low, -flat[j].abs() - low
    return flat.view(x.shape)


# ch10.elu_feature_map: every case holds values above and below 0 (x + 1 everywhere is wrong
# below, exp everywhere above); one holds a large negative and a large positive value.
@hidden("ch10.elu_feature_map", regimes={
    "values above 0 and at or below 0 in one tensor": lambda case: bool(
        (case.args[0] > 0).any() and (case.args[0] <= 0).any()),
    "a large negative value (below -5)": lambda case: bool((case.args[0] < -5).any()),
    "a large positive value (above 5)": lambda case: bool((case.args[0] > 5).any()),
    "batch dims (three or more dims)": lambda case: case.args[0].dim() >= 3,
    "float32": lambda case: case.args[0].dtype == torch.float32,
    "float64": lambda case: case.args[0].dtype == torch.float64,
})
def _(gen):
    shape = (randint(1, 3, gen), randint(1, 4, gen), randint(2, 9, gen))
    x = randn(*shape, seed=gen, scale=float(randint(1, 4, gen)))
    yield Case(f"x of shape {shape}", (_both_signs(x, gen),))
    x = randn(randint(2, 6, gen), seed=gen, scale=5.0)
    x[0] = -float(randint(6, 30, gen))
    x[1] = float(randint(6, 30, gen))
    yield Case("a large negative value and a large positive one among others", (x,))
    x = randn(2, randint(2, 5, gen), seed=gen, dtype=torch.float64, scale=3.0)
    yield Case("float64", (_both_signs(x, gen),))


# ch10.recurrent_step and ch10.chunk_step: every mistake of theirs is wrong on any case; the
# regimes are the state's (empty or not), the shapes' (D' != Dv, so that s is not square;
# for a chunk, one token or several) and the dtypes.
def _state(rule):
    """A regime of a step of linear attention: ``rule`` of (fq, v, z) of a case."""
    return lambda case: bool(rule(case.args[0], case.args[2], case.args[4]))


STATE_REGIMES = {
    "an empty state (the first token: s = 0, z = 0)": _state(lambda fq, v, z: (z == 0).all()),
    "a state of earlier tokens (z > 0)": _state(lambda fq, v, z: (z > 0).all()),
    "features and values of different widths (D' != Dv)":
        _state(lambda fq, v, z: fq.shape[-1] != v.shape[-1]),
    "float32": _state(lambda fq, v, z: fq.dtype == torch.float32),
    "float64": _state(lambda fq, v, z: fq.dtype == torch.float64),
}


def _other_than(n, low, high, gen):
    """An int in [low, high] other than ``n`` (high > low)."""
    m = randint(low, high - 1, gen)
    return m + 1 if m >= n else m


@hidden("ch10.recurrent_step", regimes=STATE_REGIMES)
def _(gen):
    b, h, d = randint(1, 2, gen), randint(1, 3, gen), randint(2, 7, gen)
    dv = _other_than(d, 1, 7, gen)
    yield step_case(f"after {d} tokens, B={b}, H={h}, D'={d}, Dv={dv}", b, h, d, dv, d, gen)
    yield step_case("the first token", b, h, d, randint(1, 6, gen), 0, gen)
    yield step_case("float64, after many tokens", 1, h, d, randint(1, 6, gen),
                    randint(20, 90, gen), gen, dtype=torch.float64)


@hidden("ch10.chunk_step", regimes={
    **STATE_REGIMES,
    "a chunk of one token (C = 1)": _state(lambda fq, v, z: fq.shape[2] == 1),
    "a chunk of several tokens (C > 1)": _state(lambda fq, v, z: fq.shape[2] > 1),
})
def _(gen):
    b, h, d = randint(1, 2, gen), randint(1, 3, gen), randint(2, 7, gen)
    dv, c = _other_than(d, 1, 7, gen), randint(2, 6, gen)
    yield chunk_case(f"a chunk of {c} after {2 * c}, B={b}, H={h}, D'={d}, Dv={dv}", b, h, c, d,
                     dv, 2 * c, gen)
    yield chunk_case(f"the first chunk of {c}", b, h, c, d, randint(1, 6, gen), 0, gen)
    yield chunk_case("float64, a chunk of 3 after many tokens", 1, h, 3, d, randint(1, 6, gen),
                     randint(10, 40, gen), gen, dtype=torch.float64)
    tokens = randint(1, 12, gen)
    yield chunk_case(f"a chunk of one token after {tokens}", b, h, 1, d, randint(1, 6, gen),
                     tokens, gen)


# ch10.linear_costs: one set of sizes in each regime, on every seed, the rest drawn at random
# inside it:
# 1. Performer's features wider than the head, F >= D + 3 (at F = D .. D + 2 solving with
#    D' = Dv = D would give the right crossing), a context longer than D (past the
#    crossover, the linear order cheaper), bf16.
# 2. The crossing on a whole number, F = 3D with D even: the two orders tie at T = 3D / 2,
#    so the answer is the next T; a context no longer than D (the quadratic order
#    cheaper), float32.
# 3. Features narrower than the head (F < D), any context, 2 or 4 bytes per number.
# Bytes per number are never 1, where counting numbers would be counting bytes; T >= 2,
# so a state that grows with the length is wrong.
def _sized(rule):
    """A regime of linear_costs: ``rule`` of the sizes T, D, features, L, H, nbytes."""
    return lambda case: rule(**case.kwargs)


@hidden("ch10.linear_costs", regimes={
    "features wider than the head (F >= D + 3), T > D, 2 bytes":
        _sized(lambda T, D, features, nbytes, **_: features >= D + 3 and T > D and nbytes == 2),
    "the orders tie on a whole number (F = 3D, D even), T <= D, 4 bytes":
        _sized(lambda T, D, features, nbytes, **_: features == 3 * D and D % 2 == 0
               and T <= D and nbytes == 4),
    "features narrower than the head (F < D)": _sized(lambda D, features, **_: features < D),
})
def _(gen):
    def model():
        return dict(L=randint(2, 96, gen), H=randint(1, 64, gen))

    d = 16 * randint(2, 16, gen)
    sizes = [dict(T=randint(d + 1, 32768, gen), D=d, features=randint(d + 3, 4 * d, gen),
                  **model(), nbytes=2)]
    d = 2 * randint(8, 128, gen)
    sizes.append(dict(T=randint(2, d, gen), D=d, features=3 * d, **model(), nbytes=4))
    d = 16 * randint(2, 16, gen)
    sizes.append(dict(T=randint(2, 32768, gen), D=d, features=randint(2, d - 1, gen), **model(),
                      nbytes=2 * randint(1, 2, gen)))
    yield from COSTS.cases(*sizes)


# ch10.causal_linear_attention: every case has T >= 2 tokens and D' >= 2 features (with one
# token every prefix is the whole sequence, and the normaliser summed over the features or
# over every token is right), so each declared mistake is wrong on each case; the regimes are
# the widths (D' != Dv, so that a slip between the axes shows in the shapes too), a long
# sequence (T > 16, where a normaliser that sums the future is far off) and the dtypes.
def _sequence(rule):
    """A regime of causal_linear_attention: ``rule`` of (fq, fk, v) of a case."""
    return lambda case: bool(rule(*case.args))


@hidden("ch10.causal_linear_attention", regimes={
    "features and values of different widths (D' != Dv)":
        _sequence(lambda fq, fk, v: fq.shape[-1] != v.shape[-1]),
    "a long sequence (T > 16)": _sequence(lambda fq, fk, v: fq.shape[2] > 16),
    "a short sequence (2 <= T <= 8)": _sequence(lambda fq, fk, v: 2 <= fq.shape[2] <= 8),
    "float32": _sequence(lambda fq, fk, v: fq.dtype == torch.float32),
    "float64": _sequence(lambda fq, fk, v: fq.dtype == torch.float64),
})
def _(gen):
    b, h, d = randint(1, 2, gen), randint(1, 3, gen), randint(2, 7, gen)
    dv, t = _other_than(d, 1, 7, gen), randint(2, 8, gen)
    yield sequence_case(f"T={t}, B={b}, H={h}, D'={d}, Dv={dv}", b, h, t, d, dv, gen)
    t = randint(17, 40, gen)
    yield sequence_case(f"float64, T={t}", 1, h, t, d, randint(1, 6, gen), gen,
                        dtype=torch.float64)


# ch10.recall_accuracy: one experiment in each regime, on every seed (the experiment's seed
# drawn too):
# 1. unit keys, crowded: N from 3·D' to 4·D' pairs in D' = 6 .. 16 features, where keys left
#    unnormalised recall clearly fewer pairs (and the accuracy, about 0.5 to 0.8, is told from
#    the error rate);
# 2. unit keys, room to spare: D' >= 4·N (the accuracy near 1);
# 3. elu features, N = 8 .. 48 in D' = 8 .. 96 (about 0.1 to 0.4: the positive features mix
#    every pair into every read), where normal keys without the feature map recall far more.
def _experiment(rule):
    """A regime of recall_accuracy: ``rule`` of (n_pairs, features, kind)."""
    return lambda case: bool(rule(*case.args[:3]))


@hidden("ch10.recall_accuracy", regimes={
    "unit keys, crowded (3·D' <= N <= 4·D')":
        _experiment(lambda n, d, kind: kind == "unit" and 3 * d <= n <= 4 * d),
    "unit keys, room to spare (D' >= 4·N)":
        _experiment(lambda n, d, kind: kind == "unit" and d >= 4 * n),
    "elu features": _experiment(lambda n, d, kind: kind == "elu"),
})
def _(gen):
    def seed():
        return randint(0, 10_000, gen)

    d = randint(6, 16, gen)
    n = randint(3 * d, 4 * d, gen)                    # at most 64
    yield Case(f"unit keys, N={n} pairs in D'={d} features", (n, d, "unit", seed()))
    n = randint(2, 24, gen)
    d = randint(4 * n, 4 * n + 32, gen)
    yield Case(f"unit keys, N={n} pairs in D'={d} features", (n, d, "unit", seed()))
    n, d = randint(8, 48, gen), randint(8, 96, gen)
    yield Case(f"elu features, N={n} pairs in D'={d} features", (n, d, "elu", seed()))


# ch10.recall_predictions: N from 16 to 48 pairs (elu features recall well under half of them
# at any width), and one set of sizes in each regime of the unit keys, on every seed:
# 1. crowded, then roomy: few <= N/4 (2 at least), many from 2N to 8N: the accuracy rises
#    toward 1 (about 0.8 at N/4, 1 from 2N);
# 2. roomy from the start: few from 2N to 4N, many from few + N to 8N: it stays near 1.
def _trend_sizes(rule):
    """A regime of recall_predictions: ``rule`` of (n_pairs, few, many)."""
    return lambda case: bool(rule(case.kwargs["n_pairs"], case.kwargs["few"],
                                  case.kwargs["many"]))


@hidden("ch10.recall_predictions", regimes={
    "unit keys crowded, then roomy (few <= N/4, many >= 2N)":
        _trend_sizes(lambda n, few, many: few <= n // 4 and many >= 2 * n),
    "unit keys roomy from the start (few >= 2N)":
        _trend_sizes(lambda n, few, many: few >= 2 * n),
})
def _(gen):
    n = randint(16, 48, gen)
    sizes = [dict(n_pairs=n, few=randint(2, n // 4, gen), many=randint(2 * n, 8 * n, gen))]
    n = randint(16, 48, gen)
    few = randint(2 * n, 4 * n, gen)
    sizes.append(dict(n_pairs=n, few=few, many=randint(few + n, 8 * n, gen)))
    yield from TRENDS.cases(*sizes)
