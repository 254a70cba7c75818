"""Exercises of Chapter 5, RoPE.

    ch05.rope_angles        rope_angles(positions (T,), head_dim, base=10000.0) -> float32
                            (T, D/2): the angle m·θᵢ of every position m and pair i,
                            θᵢ = base^(-2i/D)
    ch05.apply_rope         apply_rope(x (B, H, T, D), base=10000.0) -> (B, H, T, D): the token at
                            index t rotated by t·θᵢ, channel i paired with i + D/2 (half-split)
    ch05.pairing_permutation  pairing_permutation(head_dim) -> long (D,): the permutation p with
                            half_split(x[..., p]) == interleaved(x)[..., p]
    ch05.rope_predictions   rope_predictions(head_dim, base, m, n, candidates) -> dict: three
                            things to work out by hand about RoPE, for the sizes and positions
                            given: two numbers, and a choice among SAME_SCORE_OPTIONS (derive:
                            compared with what the package computes)

References: ``course_attn.rope_frequencies`` and ``course_attn.apply_rotary_emb``; the
predictions computed with them.
"""

import math

import torch

from ..rope import apply_rotary_emb
from .cases import Questions, as_number, expect_close_tensor, expect_tensor, randn
from .exercise import Case, Exercise, Mistake, register
from .operations import ELEMENTARY, NONE


def _theta(head_dim, base, *, exponent=lambda i, d: -2.0 * i / d, device=None):
    """θᵢ in float64 (the reference's own, not rounded to float32 first); ``exponent`` lets a
    typical mistake use another."""
    i = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
    return float(base) ** exponent(i, head_dim)


def _angles(positions, head_dim, base=10000.0, **kw):
    """(T,) positions -> float64 (T, D/2) angles m·θᵢ."""
    theta = _theta(head_dim, base, device=positions.device, **kw)
    return positions.to(torch.float64)[:, None] * theta[None, :]


# --- ch05.rope_angles ---------------------------------------------------------------------------

def rope_angles_reference(positions, head_dim, base=10000.0):
    """(T,) integer positions -> float32 (T, D/2): angle[m, i] = positions[m] · base^(-2i/D)."""
    return _angles(positions, head_dim, base).float()


def _angles_with(exponent=lambda i, d: -2.0 * i / d, shift=0):
    def fn(positions, head_dim, base=10000.0):
        return _angles(positions + shift, head_dim, base, exponent=exponent).float()
    return fn


def _angles_cases():
    yield Case("positions 0..5, D=8", (torch.arange(6), 8),
               hint="angle[m, i] = positions[m] · θᵢ with θᵢ = base^(-2i/D), i = 0 .. D/2 - 1")
    yield Case("positions 0..3, D=8 (a square result)", (torch.arange(4), 8),
               hint="rows are positions (T of them), columns are pairs (D/2 of them)")
    yield Case("D=2: one pair, θ₀ = 1", (torch.arange(5), 2),
               hint="the first pair always turns by exactly one radian per position")
    yield Case("positions 100..104 (as a KV cache passes them), D=16",
               (torch.arange(100, 105), 16),
               hint="use the positions you are given, not 0 .. T-1")
    yield Case("base=500000, D=64, positions [0, 7, 31]",
               (torch.tensor([0, 7, 31]), 64), {"base": 500000.0},
               hint="use the base you were given")
    yield Case("one position, 0, D=4", (torch.tensor([0]), 4),
               hint="position 0 has angle 0 in every pair")


register(Exercise(
    key="ch05.rope_angles", function="rope_angles", reference=rope_angles_reference,
    ops=ELEMENTARY,
    cases=_angles_cases, compare=expect_close_tensor(1e-5, 1e-6), banned=("course_attn",),
    mistakes=(
        Mistake("your frequencies fall too slowly: θᵢ = base^(-2i/D) has a 2 in the exponent "
                "(the pairs are i = 0 .. D/2 - 1, and 2i runs over the even channels 0 .. D-2)",
                _angles_with(exponent=lambda i, d: -i / d)),
        Mistake("your frequencies grow with i: θᵢ = base^(-2i/D) has a minus sign, so the "
                "first pair turns fastest and the last slowest",
                _angles_with(exponent=lambda i, d: 2.0 * i / d)),
        Mistake("your pairs are counted from 1: the first pair is i = 0, whose θ₀ = 1",
                _angles_with(exponent=lambda i, d: -2.0 * (i + 1) / d)),
        Mistake("your angles are off by one position: position m turns by m·θᵢ, so position 0 "
                "is not rotated", _angles_with(shift=1)),
        Mistake("your result has the positions as columns: return (T, D/2), one row per position",
                lambda positions, head_dim, base=10000.0:
                rope_angles_reference(positions, head_dim, base).T.contiguous()),
    ),
))


# --- ch05.apply_rope ----------------------------------------------------------------------------

def _rotate(x, angles, *, interleaved=False, sign=1.0):
    """x (..., T, D) rotated by the float64 (T, D/2) angles; in x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    cos, sin = angles.cos().to(acc), (sign * angles.sin()).to(acc)
    return apply_rotary_emb(x, cos, sin, interleaved=interleaved)


def apply_rope_reference(x, base=10000.0):
    """x (B, H, T, D) -> (B, H, T, D): the token at index t rotated by t·θᵢ, half-split pairs."""
    positions = torch.arange(x.shape[-2], device=x.device)
    return _rotate(x, _angles(positions, x.shape[-1], base))


def _rope_with(*, shift=0, exponent=lambda i, d: -2.0 * i / d, **kw):
    def fn(x, base=10000.0):
        positions = torch.arange(x.shape[-2], device=x.device) + shift
        return _rotate(x, _angles(positions, x.shape[-1], base, exponent=exponent), **kw)
    return fn


def _rope_no_position(x, base=10000.0):
    angles = _theta(x.shape[-1], base, device=x.device)[None, :].expand(x.shape[-2], -1)
    return _rotate(x, angles)


def _rope_cases():
    yield Case("B=1, H=1, T=5, D=8", (randn(1, 1, 5, 8, seed=50),),
               hint="pair i is (x[..., i], x[..., i + D/2]); the token at index t turns it by "
                    "the angle t·θᵢ: (x₁ cos - x₂ sin, x₁ sin + x₂ cos)")
    yield Case("T=1: one token at position 0", (randn(2, 2, 1, 8, seed=51),),
               hint="the first token sits at position 0: a rotation by 0 leaves it unchanged")
    yield Case("B=2, H=3, T=7, D=16", (randn(2, 3, 7, 16, seed=52),),
               hint="cos and sin of shape (T, D/2) broadcast against x's halves (B, H, T, D/2)")
    yield Case("D=2: one pair", (randn(1, 2, 6, 2, seed=53),),
               hint="with one pair, channel 0 and channel 1 turn by t radians")
    yield Case("base=100", (randn(1, 2, 6, 8, seed=54),), {"base": 100.0},
               hint="use the base you were given")
    yield Case("float64 in, float64 out, T=12, D=32",
               (randn(1, 2, 12, 32, seed=55, dtype=torch.float64),),
               hint="do not convert the input; let its dtype flow through")


register(Exercise(
    key="ch05.apply_rope", function="apply_rope", reference=apply_rope_reference,
    ops=ELEMENTARY,
    cases=_rope_cases, compare=expect_close_tensor(1e-5, 1e-5), banned=("course_attn",),
    mistakes=(
        Mistake("you rotate by -t·θᵢ, clockwise (nanochat's convention): here every pair "
                "turns by +t·θᵢ, counter-clockwise, as in RoFormer and Llama",
                _rope_with(sign=-1.0)),
        Mistake("you pair neighbouring channels (2i, 2i + 1), the interleaved convention: here "
                "channel i is paired with channel i + D/2 (half-split)",
                _rope_with(interleaved=True)),
        Mistake("your positions are off by one: the token at index t sits at position t, so the "
                "first token (position 0) is not rotated", _rope_with(shift=1)),
        Mistake("your frequencies fall too slowly: θᵢ = base^(-2i/D) has a 2 in the exponent",
                _rope_with(exponent=lambda i, d: -i / d)),
        Mistake("your frequencies grow with i: θᵢ = base^(-2i/D) has a minus sign",
                _rope_with(exponent=lambda i, d: 2.0 * i / d)),
        Mistake("every token turns by the same angles θᵢ: the angle of the token at index t is "
                "t·θᵢ", _rope_no_position),
    ),
))


# --- ch05.pairing_permutation --------------------------------------------------------------------

def pairing_permutation_reference(head_dim):
    """long (D,): slot i of the half-split layout holds channel 2i, slot i + D/2 channel 2i + 1."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def _inverse(perm):
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(len(perm)))


def _perm_cases():
    yield Case("D=8", (8,), hint="half-split pairs channels (i, i + D/2), interleaved pairs "
                                 "(2i, 2i + 1); both give pair i the angle t·θᵢ")
    yield Case("D=16", (16,), hint="slot i of the half-split layout must hold the first channel "
                                   "of interleaved pair i")
    yield Case("D=2", (2,), hint="with one pair the two layouts agree")
    yield Case("D=6", (6,), hint="D/2 may be odd")


register(Exercise(
    key="ch05.pairing_permutation", function="pairing_permutation",
    ops=ELEMENTARY,
    reference=pairing_permutation_reference, cases=_perm_cases, compare=expect_tensor,
    banned=("course_attn",),
    mistakes=(
        Mistake("yours is the inverse permutation: p[j] says which channel of x moves to slot j, "
                "so x[..., p] must put the interleaved pair (2i, 2i + 1) at slots (i, i + D/2)",
                lambda head_dim: _inverse(pairing_permutation_reference(head_dim))),
        Mistake("you swapped the two channels of each pair: the second channel of a pair "
                "turning into the first is a rotation by -θ",
                lambda head_dim: torch.cat([torch.arange(1, head_dim, 2),
                                            torch.arange(0, head_dim, 2)])),
        Mistake("the identity does not reorder anything: the two conventions pair different "
                "channels", lambda head_dim: torch.arange(head_dim)),
        Mistake("return a tensor of integer indices (torch.long)",
                lambda head_dim: pairing_permutation_reference(head_dim).float()),
    ),
))


# --- ch05.rope_predictions: work out by hand --------------------------------------------------

# (c) is a choice: the letter of one of the candidate pairs (m', n') the function is given.
SAME_SCORE_OPTIONS = ("A", "B", "C", "D")

ROPE_QUESTIONS = {
    # key: (case name, hint of the case)
    "slowest_wavelength": (
        "(a) the wavelength in tokens of the slowest pair",
        "a pair turning by θ per token comes back to where it started after 2π/θ tokens; the "
        "slowest pair is the last one, i = D/2 - 1"),
    "score": (
        "(b) the score of q = (1, 0) at position m and k = (0, 1) at position n, D = 2",
        "with D = 2 the one pair has θ₀ = 1; rotate q by m radians and k by n radians, then take "
        "the dot product (or use q_m · k_n = q · R((n - m)θ) k)"),
    "same_score": (
        "(c) the candidate (m', n') with the score of (m, n) for any q and k",
        "the score depends on the positions through m - n only, with its sign: a difference "
        "of -3 is not one of 3"),
}

# The chapter's sizes (D = 64, base 10000; (b) at m = 3, n = 1), and Llama 3's base with the
# query before the key, deep in a context.
PUBLIC_PREDICTIONS = (
    dict(head_dim=64, base=10000.0, m=3, n=1,
         candidates={"A": (1, 3), "B": (12, 10), "C": (3, 0), "D": (6, 1)}),
    dict(head_dim=128, base=500000.0, m=1000, n=1003,
         candidates={"A": (20, 23), "B": (1000, 1010), "C": (1006, 1003), "D": (990, 1003)}),
)


def _rotated_score(q, k, m, n, head_dim, base):
    """q · k after RoPE turns q (..., D) to position m and k to position n; float64."""
    def rotated(v, position):
        return _rotate(v[None, None, None, :], _angles(torch.tensor([position]), head_dim, base))
    return (rotated(q, m) * rotated(k, n)).sum().item()


def rope_predictions_reference(head_dim, base, m, n, candidates):
    """Computed with the package: the wavelength from θ in float64, the score by rotating the
    two vectors, the candidate by comparing the scores of random vectors (several q and k of
    ``head_dim`` channels: the one candidate whose score equals that of (m, n) for all)."""
    theta_last = _theta(head_dim, base)[-1].item()
    one, other = (torch.tensor(v, dtype=torch.float64) for v in ((1.0, 0.0), (0.0, 1.0)))
    score = _rotated_score(one, other, m, n, 2, base)
    gen = torch.Generator().manual_seed(0)
    vectors = [(torch.randn(head_dim, generator=gen, dtype=torch.float64),
                torch.randn(head_dim, generator=gen, dtype=torch.float64)) for _ in range(3)]
    scores = [_rotated_score(q, k, m, n, head_dim, base) for q, k in vectors]
    same = [letter for letter, (m2, n2) in candidates.items()
            if all(math.isclose(_rotated_score(q, k, m2, n2, head_dim, base), target,
                                rel_tol=1e-9, abs_tol=1e-9)
                   for (q, k), target in zip(vectors, scores))]
    if len(same) != 1:
        raise ValueError(f"candidates {candidates} hold {len(same)} pairs with the score of "
                         f"({m}, {n}), not one")
    return {"slowest_wavelength": 2 * math.pi / theta_last, "score": score,
            "same_score": same[0]}


def _same_prediction(key, actual, expected) -> bool:
    if key == "same_score":
        return isinstance(actual, str) and actual.strip() == expected
    actual = as_number(actual)
    return actual is not None and math.isclose(actual, expected, rel_tol=1e-3, abs_tol=1e-3)


def _wrong_prediction(key, actual, expected) -> str:
    if key == "same_score" and not (isinstance(actual, str)
                                    and actual.strip() in SAME_SCORE_OPTIONS):
        shown = repr(actual) if len(repr(actual)) <= 40 else repr(actual)[:37] + "..."
        return (f"your answer {key!r} is {shown}, which is not one of the options "
                f"{', '.join(map(repr, SAME_SCORE_OPTIONS))}: answer with the letter of a "
                "candidate, as a string")
    return f"your answer {key!r} is not what the package computes"


PREDICTIONS = Questions(ROPE_QUESTIONS, same=_same_prediction, wrong=_wrong_prediction)


def _letter(candidates, m, n, wanted):
    """The letter of the first candidate (m', n') for which ``wanted(m', n')`` holds; None if
    none does."""
    return next((letter for letter, (m2, n2) in candidates.items() if wanted(m2, n2)), None)


def _predicting(**wrong):
    """A typical wrong prediction: the right answers, with each key of ``wrong`` replaced by
    ``wrong[key](head_dim, base, m, n, candidates)``."""
    def fn(head_dim, base, m, n, candidates):
        right = rope_predictions_reference(head_dim, base, m, n, candidates)
        return {**right, **{key: answer(head_dim, base, m, n, candidates)
                            for key, answer in wrong.items()}}
    return fn


def _other_difference(m, n, m2, n2):
    """(m', n') has neither the difference m - n nor n - m."""
    return m2 - n2 not in (m - n, n - m)


register(Exercise(
    key="ch05.rope_predictions", function="rope_predictions",
    task="predict",
    ops=NONE,
    reference=rope_predictions_reference,
    cases=lambda: PREDICTIONS.cases(*PUBLIC_PREDICTIONS), compare=PREDICTIONS.compare,
    # Worked out by hand: math.pi, math.cos and the like are fine, tensors are not.
    banned=("course_attn", "torch.tensor", "torch.as_tensor", "torch.arange", "torch.randn",
            "torch.zeros", "torch.ones", "torch.polar", "torch.complex"),
    mistakes=(
        Mistake("you took the slowest pair's angle per token for its wavelength: a pair turning "
                "by θ per token needs 2π/θ tokens for a full turn",
                _predicting(slowest_wavelength=lambda d, base, *_: base ** (-(d - 2) / d))),
        Mistake("you took the wavelength of a pair with θ = 1/base: the last pair is "
                "i = D/2 - 1, so θ = base^(-(D-2)/D), a little faster than 1/base",
                _predicting(slowest_wavelength=lambda d, base, *_: 2 * math.pi * base)),
        Mistake("you forgot the 2π: a full turn is 2π radians, not 1",
                _predicting(slowest_wavelength=lambda d, base, *_: base ** ((d - 2) / d))),
        Mistake("you rotated by -θ (or took n - m the other way round): q_m · k_n = "
                "q · R((n - m)θ) k, and here the sign of the angle matters",
                _predicting(score=lambda d, base, m, n, _: math.sin(n - m))),
        Mistake("you did not rotate: the score of q and k rotated by different angles is not "
                "q · k", _predicting(score=lambda *_: 0.0)),
        Mistake("the difference m - n has a sign: for general q and k the score at n - m "
                "differs from the one at m - n",
                _predicting(same_score=lambda d, base, m, n, candidates: _letter(
                    candidates, m, n, lambda m2, n2: m2 - n2 == n - m))),
        Mistake("the score depends on the difference m - n, not on the key's position n alone",
                _predicting(same_score=lambda d, base, m, n, candidates: _letter(
                    candidates, m, n, lambda m2, n2: n2 == n and _other_difference(m, n, m2, n2)))),
        Mistake("the score depends on the difference m - n, not on the query's position m "
                "alone",
                _predicting(same_score=lambda d, base, m, n, candidates: _letter(
                    candidates, m, n, lambda m2, n2: m2 == m and _other_difference(m, n, m2, n2)))),
    ),
))
