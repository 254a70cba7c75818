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
                            given: two numbers, and a choice among SAME_SCORE_OPTIONS
                            (predict: compared with what the package computes)
    ch05.hf_to_meta_rows    (implement) hf_to_meta_rows(w (H·D, C), n_heads) -> w with each
                            head's rows in Meta's interleaved layout, from Hugging Face's
    ch05.rotary             (debug) rotary(x (B, H, T, D), positions (T,), base) -> x turned,
                            half-split pairs: the repair of the notebook's given rotate_half
                            RoPE, whose angles are laid out for neighbouring pairs
    ch05.rope_test_catches  (predict) rope_test_catches(head_dim, T, shift) -> dict: for each
                            of five buggy RoPEs, the list of the chapter's four tests (named
                            options, TEST_OPTIONS) that it fails

rope_angles, apply_rope and pairing_permutation are warm-ups (the chapter shows them).

References: ``course_attn.rope_frequencies`` and ``course_attn.apply_rotary_emb``; the
predictions computed with them; ``course_attn.checkpoints.interleave_rows`` (hf_to_meta_rows).
"""

import functools
import math

import torch

from ..checkpoints import interleave_rows
from ..rope import apply_rotary_emb
from .cases import Questions, answers_changed, as_number, expect_close_tensor, expect_tensor, randn
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
    task="warm-up",   # the θ and angle lines of chapter 5's cell 10
    ops=ELEMENTARY,
    cases=_angles_cases, compare=expect_close_tensor(1e-5, 1e-6), banned=("course_attn",),
    mistakes=(
        Mistake("you number the rows 0, 1, 2, ...: use the positions you are given (a KV cache "
                "passes later ones, 100..104 say)",
                lambda positions, d, base=10000.0: rope_angles_reference(
                    torch.arange(len(positions)), d, base)),
        Mistake("you use the default base whatever base is passed: use the base you are given",
                lambda positions, d, base=10000.0: rope_angles_reference(positions, d)),
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
    task="warm-up",   # chapter 5's rope_half_split (cell 10) at positions 0 .. T-1
    ops=ELEMENTARY,
    cases=_rope_cases, compare=expect_close_tensor(1e-5, 1e-5), banned=("course_attn",),
    mistakes=(
        Mistake("you use the default base whatever base is passed: use the base you are given",
                lambda x, base=10000.0: apply_rope_reference(x)),
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
    task="warm-up",   # chapter 5's cell 18 shows p
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


# --- ch05.hf_to_meta_rows: a checkpoint's W_Q back to the interleaved layout (implement) -------

def hf_to_meta_rows_reference(w, n_heads):
    """w (H·D, C), the rows of W_Q or W_K in Hugging Face's half-split layout -> the same rows
    in Meta's interleaved layout: in each head's block of D rows, row i goes to 2i and row
    i + D/2 to 2i + 1 (what the chapter's conversion undoes; llama.cpp's converter does it, and
    so does ``load_pretrained(..., rope_layout="interleaved")``)."""
    return interleave_rows(w, n_heads)


def _meta_to_hf_rows(w, n_heads):
    """The chapter's direction, Meta -> HF (the permutation p within every head)."""
    rows, c = w.shape
    d = rows // n_heads
    return w.reshape(n_heads, d // 2, 2, c).transpose(1, 2).reshape(rows, c)


def _rows_as_one_head(w, n_heads):
    return hf_to_meta_rows_reference(w, 1)


def _rows_swapped(w, n_heads):
    rows, c = w.shape
    d = rows // n_heads
    return w.reshape(n_heads, 2, d // 2, c).flip(1).transpose(1, 2).reshape(rows, c)


def _rows_cases():
    yield Case("H=2, D=8, C=16", (randn(16, 16, seed=570), 2),
               hint="head h's rows h·D + i and h·D + i + D/2 (a half-split pair) become its rows "
                    "h·D + 2i and h·D + 2i + 1 (an interleaved pair)")
    yield Case("H=1, D=12, C=12", (randn(12, 12, seed=571), 1),
               hint="with one head, row i goes to 2i and row i + D/2 to 2i + 1")
    yield Case("H=3, D=6, C=18", (randn(18, 18, seed=572), 3),
               hint="each head's block of D rows is reordered on its own")
    yield Case("H=4, D=2: one pair per head", (randn(8, 8, seed=573), 4),
               hint="with D = 2 the two layouts agree")
    yield Case("float64, H=2, D=16, C=32", (randn(32, 32, seed=574, dtype=torch.float64), 2),
               hint="keep the dtype")


register(Exercise(
    key="ch05.hf_to_meta_rows", function="hf_to_meta_rows", reference=hf_to_meta_rows_reference,
    task="implement",   # the chapter converts Meta -> HF (section 6); this is the way back
    ops=ELEMENTARY,
    cases=_rows_cases, compare=expect_tensor, banned=("course_attn",),
    mistakes=(
        Mistake("that is the chapter's conversion, Meta -> Hugging Face (rows reordered by p): "
                "here the rows go the other way, from half-split to interleaved, which is the "
                "inverse permutation", _meta_to_hf_rows),
        Mistake("you reordered all H·D rows as one block: each head's D rows are paired and "
                "reordered on their own (RoPE pairs channels within a head)", _rows_as_one_head),
        Mistake("your pairs come out swapped (row i + D/2 at 2i, row i at 2i + 1): that turns "
                "every pair by -θ", _rows_swapped),
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
        "with D = 2 there is one pair; find its angle per token, rotate q and k to their "
        "positions, then take the dot product"),
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
    ``head_dim`` channels: the candidate whose scores lie closest to those of (m, n), which
    must be theirs up to rounding; closest, not within a tolerance, so no tolerance decides
    which candidate it is)."""
    theta_last = _theta(head_dim, base)[-1].item()
    one, other = (torch.tensor(v, dtype=torch.float64) for v in ((1.0, 0.0), (0.0, 1.0)))
    score = _rotated_score(one, other, m, n, 2, base)
    gen = torch.Generator().manual_seed(0)
    vectors = [(torch.randn(head_dim, generator=gen, dtype=torch.float64),
                torch.randn(head_dim, generator=gen, dtype=torch.float64)) for _ in range(3)]
    scores = [_rotated_score(q, k, m, n, head_dim, base) for q, k in vectors]
    gap = {letter: max(abs(_rotated_score(q, k, m2, n2, head_dim, base) - target)
                       for (q, k), target in zip(vectors, scores))
           for letter, (m2, n2) in candidates.items()}
    same = min(gap, key=gap.get)
    if gap[same] > 1e-9:
        raise ValueError(f"candidates {candidates} hold no pair with the score of ({m}, {n})")
    return {"slowest_wavelength": 2 * math.pi / theta_last, "score": score,
            "same_score": same}


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
    ``wrong[key](d=head_dim, base=, m=, n=, candidates=)``."""
    return answers_changed(rope_predictions_reference, wrong, sizes=_prediction_sizes)


def _prediction_sizes(head_dim, base, m, n, candidates):
    return dict(d=head_dim, base=base, m=m, n=n, candidates=candidates)


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
                _predicting(slowest_wavelength=lambda d, base, **_: base ** (-(d - 2) / d))),
        Mistake("you took the wavelength of a pair with θ = 1/base: no pair has that angle; "
                "count which index the slowest pair has",
                _predicting(slowest_wavelength=lambda d, base, **_: 2 * math.pi * base)),
        Mistake("you forgot the 2π: a full turn is 2π radians, not 1",
                _predicting(slowest_wavelength=lambda d, base, **_: base ** ((d - 2) / d))),
        Mistake("your score has the opposite sign: you rotated one vector the other way, or "
                "took the difference of the positions the other way round",
                _predicting(score=lambda d, base, m, n, **_: math.sin(n - m))),
        Mistake("you did not rotate: the score of q and k rotated by different angles is not "
                "q · k", _predicting(score=lambda **_: 0.0)),
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


# --- ch05.rotary: repair a rotary embedding whose two layouts disagree (debug) ------------------

def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def mixed_layout_rotary(x, positions, base=10000.0):
    """The function the notebook gives (its cell ``ch05-rotary-given``), bug included: written
    as Hugging Face's Llama writes it (``rotate_half``, cos and sin of the full width D), but
    with the frequencies laid out (θ₀, θ₀, θ₁, θ₁, ...), the interleaved layout, while
    ``rotate_half`` pairs channel i with i + D/2: the two channels of a pair turn by
    different angles, which is no rotation."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64,
                                           device=x.device) / d)            # (D/2,)
    freqs = torch.outer(positions.to(torch.float64), inv_freq)               # (T, D/2)
    emb = freqs.repeat_interleave(2, dim=-1)                                 # (T, D)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def rotary_reference(x, positions, base=10000.0):
    """x (B, H, T, D), positions (T,) -> x with pair (i, i + D/2) of the token at index t
    turned by positions[t]·θᵢ: the package's RoPE."""
    return _rotate(x, _angles(positions, x.shape[-1], base))


def _rotary_with(*, interleaved=False, sign=1.0, own_positions=False):
    def fn(x, positions, base=10000.0):
        if own_positions:
            positions = torch.arange(x.shape[-2], device=x.device)
        return _rotate(x, _angles(positions, x.shape[-1], base), interleaved=interleaved,
                       sign=sign)
    return fn


def _rotary_cases():
    yield Case("B=1, H=2, T=6, D=8, positions 0..5",
               (randn(1, 2, 6, 8, seed=560), torch.arange(6)),
               hint="pair i is (x[..., i], x[..., i + D/2]), and both of its channels turn by "
                    "the same angle m·θᵢ")
    yield Case("positions 100..104 (as a KV cache passes them), D=16",
               (randn(2, 1, 5, 16, seed=561), torch.arange(100, 105)),
               hint="use the positions you are given")
    yield Case("positions [7, 0, 31], D=4, base=500000",
               (randn(1, 1, 3, 4, seed=562), torch.tensor([7, 0, 31])), {"base": 500000.0},
               hint="use the base you were given; the positions need not be in order")
    yield Case("D=2: one pair, the bug cannot show", (randn(1, 2, 5, 2, seed=563),
                                                      torch.arange(5)),
               hint="with one pair, every layout pairs channel 0 with channel 1")
    yield Case("T=1 at position 0: unchanged", (randn(2, 2, 1, 8, seed=564), torch.tensor([0])),
               hint="at position 0 every angle is 0: the token is unchanged")
    yield Case("float64, T=9, D=32, positions 0..8",
               (randn(1, 2, 9, 32, seed=565, dtype=torch.float64), torch.arange(9)),
               hint="keep the dtype: do not convert the input")


register(Exercise(
    key="ch05.rotary", function="rotary",
    task="debug", given=mixed_layout_rotary,
    reference=rotary_reference, cases=_rotary_cases, compare=expect_close_tensor(1e-5, 1e-5),
    ops=ELEMENTARY, banned=("course_attn",),
    mistakes=(
        Mistake("the two channels of a pair still turn by different angles: your cos and sin "
                "repeat each frequency side by side (θ₀, θ₀, θ₁, θ₁, ...), the layout of "
                "neighbouring pairs, while rotate_half pairs channel i with channel i + D/2; "
                "lay the frequencies out the way rotate_half pairs the channels",
                mixed_layout_rotary),
        Mistake("this is a rotation now, but of neighbouring channels (2i, 2i + 1), the "
                "interleaved convention: this function pairs channel i with channel i + D/2 "
                "(half-split), as rotate_half does", _rotary_with(interleaved=True)),
        Mistake("you turn by -m·θᵢ, clockwise: rotate_half must send (x₁, x₂) to (-x₂, x₁) so "
                "that x₁ cos - x₂ sin comes out, a turn by +m·θᵢ", _rotary_with(sign=-1.0)),
        Mistake("you turn the tokens by their index 0 .. T-1: use the positions you are given "
                "(a KV cache passes later ones)", _rotary_with(own_positions=True)),
    ),
))


# --- ch05.rope_test_catches: which of the chapter's tests catches which bug (predict) ---------

# The chapter's four tests of a RoPE implementation (cells 10 and 14), as options:
TEST_OPTIONS = ("matches the reference", "norm preserved", "position 0 is identity",
                "relative property")
# The bugs, as keys of the answer:
ROPE_BUGS = {
    # key: (case name, hint of the case)
    "minus_theta": ("(a) turns by -m·θᵢ (nanochat's sign)",
                    "a turn by -mθ is still a rotation by an angle proportional to m"),
    "interleaved": ("(b) pairs neighbouring channels (2i, 2i + 1)",
                    "a rotation of other pairs, by the right angles"),
    "mixed_layout": ("(c) frequencies laid out (θ₀, θ₀, θ₁, θ₁, ...) with rotate_half",
                     "the two channels of a pair turn by different angles"),
    "off_by_one": ("(d) positions counted from 1", "every position is one more than it should"),
    "slow_frequencies": ("(e) θᵢ = base^(-i/D), without the 2",
                         "each pair turns at a constant rate, just not the right one"),
}


def _mixed(x, angles):
    """The mixed layout with these (T, D/2) float64 angles."""
    emb = angles.repeat_interleave(2, dim=-1)
    return x * emb.cos() + _rotate_half(x) * emb.sin()


def _buggy_ropes(head_dim, base=10000.0):
    """Each bug as a function (x (..., T, D) float64, positions (T,)) -> rotated x."""
    def angles(positions, **kw):
        return _angles(positions, head_dim, base, **kw)
    return {
        "minus_theta": lambda x, p: _rotate(x, angles(p), sign=-1.0),
        "interleaved": lambda x, p: _rotate(x, angles(p), interleaved=True),
        "mixed_layout": lambda x, p: _mixed(x, angles(p)),
        "off_by_one": lambda x, p: _rotate(x, angles(p + 1)),
        "slow_frequencies": lambda x, p: _rotate(x, angles(p, exponent=lambda i, d: -i / d)),
    }


def _failing_tests(rope, head_dim, T, shift, base=10000.0):
    """The chapter's tests that ``rope`` fails, on random float64 q and k of T tokens at
    positions 0 .. T-1 (and shifted by ``shift`` for the relative property)."""
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 1, T, head_dim, generator=gen, dtype=torch.float64)
            for _ in range(2))
    positions = torch.arange(T)

    def close(a, b):
        return torch.allclose(a, b, rtol=1e-9, atol=1e-9)
    rotated = rope(q, positions)
    failing = []
    if not close(rotated, rotary_reference(q, positions, base)):
        failing.append("matches the reference")
    if not close(rotated.norm(dim=-1), q.norm(dim=-1)):
        failing.append("norm preserved")
    if not close(rope(q[..., :1, :], torch.tensor([0])), q[..., :1, :]):
        failing.append("position 0 is identity")
    scores = rope(q, positions) @ rope(k, positions).transpose(-2, -1)
    shifted = rope(q, positions + shift) @ rope(k, positions + shift).transpose(-2, -1)
    if not close(scores, shifted):
        failing.append("relative property")
    return failing


@functools.lru_cache(maxsize=4096)
def _catches(head_dim, T, shift):
    return tuple((bug, tuple(_failing_tests(rope, head_dim, T, shift)))
                 for bug, rope in _buggy_ropes(head_dim).items())


def rope_test_catches_reference(head_dim, T, shift):
    """Computed by running the four tests on each bug: {bug: list of the tests it fails, in
    TEST_OPTIONS' order} (remembered per size: every typical mistake asks for it again)."""
    return {bug: list(tests) for bug, tests in _catches(int(head_dim), int(T), int(shift))}


def _same_tests(key, actual, expected) -> bool:
    return isinstance(actual, (list, tuple, set)) and all(
        isinstance(a, str) for a in actual) and {a.strip() for a in actual} == set(expected)


def _wrong_tests(key, actual, expected) -> str:
    if not isinstance(actual, (list, tuple, set)) or not all(isinstance(a, str) for a in actual):
        return (f"your answer {key!r} should be a list of test names (strings), got "
                f"{type(actual).__name__}")
    unknown = sorted({a.strip() for a in actual} - set(TEST_OPTIONS))
    if unknown:
        shown = repr(unknown[0]) if len(repr(unknown[0])) <= 40 else repr(unknown[0])[:37] + "..."
        return (f"your answer {key!r} names {shown}, which is not one of the tests "
                f"{', '.join(map(repr, TEST_OPTIONS))}")
    return f"your answer {key!r} is not the set of tests that this bug fails"


CATCHES = Questions(ROPE_BUGS, same=_same_tests, wrong=_wrong_tests)

# The chapter's head (D = 64) on ten tokens; one pair (D = 2); one token (T = 1), at position 0.
PUBLIC_CATCHES = (dict(head_dim=64, T=10, shift=3), dict(head_dim=2, T=6, shift=5),
                  dict(head_dim=16, T=1, shift=4))


def _predicting_tests(*, bugs=None, add=(), drop=(), as_if=None):
    """A typical wrong prediction: the right sets, with the tests ``add`` added to and ``drop``
    taken from the bugs ``bugs`` (all if None); ``as_if(head_dim, T, shift)`` gives the sizes
    the student answered for instead."""
    def fn(head_dim, T, shift):
        sizes = as_if(head_dim, T, shift) if as_if else (head_dim, T, shift)
        right = rope_test_catches_reference(*sizes)
        return {bug: sorted((set(tests) | set(add)) - set(drop))
                if bugs is None or bug in bugs else tests for bug, tests in right.items()}
    return fn


register(Exercise(
    key="ch05.rope_test_catches", function="rope_test_catches",
    task="predict",
    ops=NONE,
    reference=rope_test_catches_reference,
    cases=lambda: CATCHES.cases(*PUBLIC_CATCHES), compare=CATCHES.compare,
    # Worked out by thinking: no tensor at all.
    banned=("course_attn", "torch.tensor", "torch.as_tensor", "torch.arange", "torch.randn",
            "torch.zeros", "torch.ones"),
    mistakes=(
        Mistake("a turn by -mθ is still a rotation by an angle proportional to the position, so "
                "the score still depends on m - n only: the relative property cannot tell the "
                "sign", _predicting_tests(bugs=("minus_theta",), add=("relative property",))),
        Mistake("counting positions from 1 shifts every position by the same amount, which the "
                "relative property cannot see; position 0 can",
                _predicting_tests(bugs=("off_by_one",), add=("relative property",))),
        Mistake("any frequencies give a relative score: the property needs each pair's angle "
                "to grow in proportion to the position, not a particular θᵢ",
                _predicting_tests(bugs=("slow_frequencies",), add=("relative property",))),
        Mistake("the mixed layout turns the two channels of a pair by different angles: that is "
                "not a rotation, and it changes the norm",
                _predicting_tests(bugs=("mixed_layout",), drop=("norm preserved",))),
        Mistake("at position 0 every angle is 0, so cos = 1 and sin = 0 whatever the sign, "
                "pairing or layout: only a bug that moves the positions turns position 0",
                _predicting_tests(bugs=("minus_theta", "interleaved", "mixed_layout",
                                        "slow_frequencies"), add=("position 0 is identity",))),
        Mistake("with D = 2 there is one pair, channels (0, 1), whatever the pairing or layout, "
                "and θ₀ = 1 whatever the exponent: those bugs cannot show",
                _predicting_tests(as_if=lambda d, t, s: (max(d, 8), t, s))),
        Mistake("with T = 1 the tests see only position 0, where a rotation of any sign, "
                "pairing or frequency is the identity; only a position moved away from 0 (as "
                "the relative property's shift) can show a bug there",
                _predicting_tests(as_if=lambda d, t, s: (d, max(t, 4), s))),
    ),
))
