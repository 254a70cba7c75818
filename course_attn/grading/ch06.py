"""Exercises of Chapter 6, QK-norm.

    ch06.rms_norm           rms_norm(x, weight=None, eps=1e-6) -> (..., D): each vector over the
                            last axis divided by its root-mean-square, times the gains (warm-up:
                            the chapter's cell)
    ch06.gemma_rms_norm     gemma_rms_norm(x, weight, eps=1e-6) -> (..., D): RMSNorm whose stored
                            gain is zero-centred, as Gemma's checkpoints hold it: times (1 + w)
    ch06.qk_norm_attention  qk_norm_attention(q, k, v, q_weight, k_weight, is_causal=False)
                            -> (B, H, Tq, Dv): RMS-norm q and k over the head dimension (with
                            their gains), then softmax(q kᵀ/√D) v (warm-up)
    ch06.qk_norm_heads      qk_norm_heads(q, k, v, q_gain, k_gain) -> (B, T, H, Dv): debug a given
                            causal QK-norm attention on (B, T, H, D) heads that folds the
                            softmax scale into q before the norm, which undoes it
    ch06.softcap            softcap(scores, cap) -> cap · tanh(scores / cap), Gemma 2's logit
                            soft-capping (warm-up)
    ch06.qk_norm_limits     qk_norm_limits(D, T, q_gain, k_gain, weight) -> dict: the largest
                            score and the largest weight QK-norm allows, and the gain a weight
                            needs, for the sizes and gains given (derive: compared with the
                            formulas, computed)
    ch06.qk_rope_predictions qk_rope_predictions(D, q_gain, k_gain, candidates) -> dict: predict
                            which candidate is the largest |score| with the norm after RoPE and
                            with it before, and which order allows the sharper softmax

References: ``course_attn.rms_norm`` and ``course_attn.scaled_dot_product_attention``; the
soft-cap formula; the limits computed from the bound |q̂·k̂| ≤ max_i |g^Q_i g^K_i| · D.
"""

import math

import torch

from ..attention import scaled_dot_product_attention
from ..masks import causal_mask
from ..norm import rms_norm
from .cases import Questions, answers_changed, as_number, expect_tensor, randn
from .exercise import Case, Exercise, Mistake, register
from .operations import ELEMENTARY, NONE, NO_LIBRARY_ATTENTION, SOFTMAX

NO_LIBRARY_RMS_NORM = ("course_attn", "torch.nn.functional.rms_norm", "torch.rms_norm",
                       "torch.nn.RMSNorm.forward")


# --- ch06.rms_norm -------------------------------------------------------------------------------

def _rms(x, dim=-1):
    return x.pow(2).mean(dim=dim, keepdim=True)


def _with_weight(out, weight):
    return out if weight is None else out * weight


def _rms_cases():
    yield Case("x (2, 3, 8), no weight, float32", (randn(2, 3, 8, seed=60, scale=3.0),),
               hint="divide each vector (the last axis) by sqrt(mean(x²) + eps)")
    yield Case("x (4, 6) with a weight (6,)", (randn(4, 6, seed=61), 1.0 + randn(6, seed=62)),
               hint="after normalising, multiply channel i by weight[i]")
    yield Case("a square (5, 5) input", (randn(5, 5, seed=63, scale=2.0),),
               hint="the mean runs over the last axis only, with keepdim=True, so that it "
                    "broadcasts back over that axis")
    yield Case("x with a mean far from 0 (RMSNorm does not subtract it)",
               (3.0 + randn(3, 8, seed=64, scale=0.5), 0.5 + randn(8, seed=65).abs()),
               hint="RMSNorm does not centre x: no mean is subtracted, and it divides by the "
                    "root of the mean of the squares")
    yield Case("small x, eps=0.1", (randn(3, 4, seed=66, scale=0.1),), {"eps": 0.1},
               hint="eps is added to the mean of the squares, inside the square root")
    yield Case("(B, H, T, D) = (2, 3, 5, 16), float64, with a weight",
               (randn(2, 3, 5, 16, seed=67, dtype=torch.float64),
                randn(16, seed=68, dtype=torch.float64)),
               hint="do not convert the inputs; let their dtype flow through")


def _rms_mean_abs(x, weight=None, eps=1e-6):
    return _with_weight(x / (x.abs().mean(dim=-1, keepdim=True) + eps), weight)


def _rms_eps_outside(x, weight=None, eps=1e-6):
    return _with_weight(x / (_rms(x).sqrt() + eps), weight)


def _rms_no_eps(x, weight=None, eps=1e-6):
    """What ``F.normalize(x, dim=-1) * sqrt(D)`` computes: x / RMS(x) with no eps at all."""
    return _with_weight(x * torch.rsqrt(_rms(x)), weight)


def _rms_by_norm(x, weight=None, eps=1e-6):
    return _with_weight(x / (x.pow(2).sum(dim=-1, keepdim=True) + eps).sqrt(), weight)


def _rms_wrong_axis(x, weight=None, eps=1e-6):
    return _with_weight(x * torch.rsqrt(_rms(x, dim=0) + eps), weight)


def _rms_layer_norm(x, weight=None, eps=1e-6):
    centred = x - x.mean(dim=-1, keepdim=True)
    return _with_weight(centred * torch.rsqrt(_rms(centred) + eps), weight)


register(Exercise(
    key="ch06.rms_norm", function="rms_norm",
    task="warm-up",
    ops=ELEMENTARY,
    reference=lambda x, weight=None, eps=1e-6: rms_norm(x, weight, eps),
    cases=_rms_cases, compare=expect_tensor, banned=NO_LIBRARY_RMS_NORM,
    mistakes=(
        Mistake("you forgot the weight: multiply the normalised vector by the gains, channel "
                "by channel", lambda x, weight=None, eps=1e-6: rms_norm(x, None, eps)),
        Mistake("you divided by the mean of |x|, not by the root of the mean of the squares",
                _rms_mean_abs),
        Mistake("you left eps out (as x / RMS(x), or F.normalize(x) · sqrt(D), computes): "
                "RMSNorm adds eps to the mean of the squares, under the square root",
                _rms_no_eps),
        Mistake("you added eps after the square root: it goes inside, sqrt(mean(x²) + eps)",
                _rms_eps_outside),
        Mistake("you divided by the norm of x (the root of the SUM of squares): the RMS is "
                "the root of the MEAN, so the result has RMS 1, not norm 1", _rms_by_norm),
        Mistake("you took the mean over the wrong axis: RMSNorm normalises each vector, the "
                "last axis", _rms_wrong_axis),
        Mistake("you subtracted the mean (that is LayerNorm): RMSNorm only divides by the "
                "root-mean-square", _rms_layer_norm),
    ),
))


# --- ch06.gemma_rms_norm: the gain stored zero-centred -------------------------------------------
# Gemma's checkpoints store an RMSNorm's gain as w with the gain 1 + w (zero-initialised: a fresh
# norm is the plain normalisation); loading one into a Llama-style RMSNorm, which multiplies by
# w, is a known way to get a model that outputs nonsense.

def gemma_rms_norm_reference(x, weight, eps=1e-6):
    """(..., D), (D,) -> (..., D): x / sqrt(mean(x²) + eps) · (1 + weight)."""
    return rms_norm(x, 1.0 + weight, eps)


def _gemma_cases():
    yield Case("x (2, 3, 8), a stored weight near 0 (as a checkpoint holds it)",
               (randn(2, 3, 8, seed=90, scale=3.0), 0.1 * randn(8, seed=91)),
               hint="the gain of channel i is 1 + weight[i]; normalise over the last axis first")
    yield Case("x (4, 6), a weight of zeros: the plain normalisation",
               (randn(4, 6, seed=92), torch.zeros(6)),
               hint="a zero weight means a gain of 1: the result has RMS 1")
    yield Case("x (2, 2, 5, 16), float64, a weight of size about 1",
               (randn(2, 2, 5, 16, seed=93, dtype=torch.float64, scale=2.0),
                randn(16, seed=94, dtype=torch.float64)),
               hint="do not convert the inputs; let their dtype flow through")
    yield Case("small x (3, 4), eps=0.1",
               (randn(3, 4, seed=95, scale=0.1), 0.5 * randn(4, seed=96)), {"eps": 0.1},
               hint="eps is added to the mean of the squares, inside the square root")


def _gemma_with(fn):
    return lambda x, weight, eps=1e-6: fn(x, weight, eps)


register(Exercise(
    key="ch06.gemma_rms_norm", function="gemma_rms_norm", reference=gemma_rms_norm_reference,
    task="warm-up",   # the exercise's own formula is the answer
    ops=ELEMENTARY,
    cases=_gemma_cases, compare=expect_tensor, banned=NO_LIBRARY_RMS_NORM,
    mistakes=(
        Mistake("you multiplied by the stored weight itself, as a Llama-style RMSNorm does: "
                "Gemma stores the gain zero-centred, so a weight of 0 keeps a channel as it is",
                _gemma_with(lambda x, w, eps: rms_norm(x, w, eps))),
        Mistake("you added the weight to the normalised vector: the gain 1 + weight multiplies "
                "it, channel by channel",
                _gemma_with(lambda x, w, eps: rms_norm(x, None, eps) + w)),
        Mistake("you applied the gain before normalising: the RMS is then that of the scaled "
                "vector, and the norm divides part of the gain away; normalise, then multiply",
                _gemma_with(lambda x, w, eps: rms_norm(x * (1 + w), None, eps))),
        Mistake("you left eps out (as x / RMS(x), or F.normalize(x) · sqrt(D), computes): "
                "RMSNorm adds eps to the mean of the squares, under the square root",
                _gemma_with(lambda x, w, eps: _rms_no_eps(x, 1 + w))),
        Mistake("you added eps after the square root: it goes inside, sqrt(mean(x²) + eps)",
                _gemma_with(lambda x, w, eps: _rms_eps_outside(x, 1 + w, eps))),
    ),
))


# --- ch06.qk_norm_attention ----------------------------------------------------------------------

def qk_norm_attention_reference(q, k, v, q_weight, k_weight, is_causal=False):
    """(B, H, Tq, D), (B, H, Tk, D), (B, H, Tk, Dv), gains (D,), (D,) -> (B, H, Tq, Dv)."""
    return scaled_dot_product_attention(rms_norm(q, q_weight), rms_norm(k, k_weight), v,
                                        is_causal=is_causal)


def _softmax_times_v(scores, v, is_causal):
    """As a student writes it (torch.softmax: a dead row gives NaN), bottom-right causal."""
    if is_causal:
        scores = scores.masked_fill(~causal_mask(*scores.shape[-2:], device=scores.device),
                                    float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _attend(q, k, v, is_causal, scale=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _softmax_times_v(q @ k.transpose(-2, -1) * scale, v, is_causal)


def _norm_over(x, weight, dim):
    """RMS-normalise x over ``dim`` (not the head dimension), then the gains over D."""
    return x * torch.rsqrt(_rms(x, dim=dim) + 1e-6) * weight


def _qk_over(dim):
    return lambda q, k, v, qw, kw, is_causal=False: _attend(
        _norm_over(q, qw, dim), _norm_over(k, kw, dim), v, is_causal)


def _unit(x):
    """x over its norm (as F.normalize(x, dim=-1)): norm 1, not RMS 1."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _qk_norm_scores(q, k, v, qw, kw, is_causal=False):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return _softmax_times_v(rms_norm(scores), v, is_causal)


def _qk_cases():
    g = torch.Generator().manual_seed(70)
    q, k, v = (randn(2, 3, 5, 8, seed=g, scale=4.0) for _ in range(3))
    qw, kw = 1.0 + 0.5 * randn(8, seed=g), 1.0 + 0.5 * randn(8, seed=g)
    yield Case("B=2, H=3, T=5, D=8, gains near 1", (q, k, v, qw, kw),
               hint="normalise q and k over their last axis (D), multiply by their gains, then "
                    "softmax(q kᵀ / sqrt(D)) v")
    yield Case("causal, T=5", (q, k, v, qw, kw), {"is_causal": True},
               hint="with is_causal, query i may attend to keys 0..i: -inf above the diagonal")
    ones = torch.ones(8)
    yield Case("gains all 1: scores are cosines times sqrt(D)", (q, k, v, ones, ones),
               hint="with unit gains, each normalised q and k has norm sqrt(D)")
    q, k = randn(1, 2, 4, 16, seed=g, scale=0.1), randn(1, 2, 6, 16, seed=g, scale=50.0)
    v = randn(1, 2, 6, 3, seed=g)
    yield Case("Tq=4 != Tk=6, Dv=3, tiny q and huge k", (q, k, v, 2.0 * torch.ones(16),
                                                         randn(16, seed=g)),
               hint="only q and k are normalised, each vector on its own; v is used as it is")
    q, k, v = (randn(2, 4, 1, 4, seed=g) for _ in range(3))
    yield Case("T=1 (one query, one key), H=4", (q, k, v, randn(4, seed=g), randn(4, seed=g)),
               hint="normalise over D, not over the heads or the positions")
    q, k, v = (randn(1, 2, 6, 8, seed=g, dtype=torch.float64, scale=3.0) for _ in range(3))
    w = randn(8, seed=g, dtype=torch.float64)
    yield Case("float64, causal", (q, k, v, w, w.flip(0)), {"is_causal": True},
               hint="do not convert the inputs; let their dtype flow through")


register(Exercise(
    key="ch06.qk_norm_attention", function="qk_norm_attention",
    task="warm-up",
    ops=ELEMENTARY | SOFTMAX,
    reference=qk_norm_attention_reference, cases=_qk_cases, compare=expect_tensor,
    banned=NO_LIBRARY_ATTENTION,
    mistakes=(
        Mistake("you ignored is_causal=True: each query must see only the keys up to its own "
                "position (-inf above the diagonal, before the softmax)",
                lambda q, k, v, q_weight, k_weight, is_causal=False: qk_norm_attention_reference(
                    q, k, v, q_weight, k_weight)),
        Mistake("you forgot the 1/sqrt(D) scale of the scores: QK-norm changes q and k, not "
                "the attention after them",
                lambda q, k, v, qw, kw, is_causal=False: _attend(
                    rms_norm(q, qw), rms_norm(k, kw), v, is_causal, scale=1.0)),
        Mistake("you normalised over the heads (axis 1): QK-norm normalises each head's vector, "
                "over the head dimension D (the last axis)", _qk_over(1)),
        Mistake("you normalised over the positions (axis -2): QK-norm normalises each query and "
                "each key on its own, over D (the last axis)", _qk_over(-2)),
        Mistake("you L2-normalised q and k (norm 1, as F.normalize does): RMSNorm makes their "
                "RMS 1, so their norm is sqrt(D), and your scores are too small",
                lambda q, k, v, qw, kw, is_causal=False: _attend(
                    _unit(q) * qw, _unit(k) * kw, v, is_causal)),
        Mistake("you normalised v too: QK-norm touches only the queries and the keys",
                lambda q, k, v, qw, kw, is_causal=False: _attend(
                    rms_norm(q, qw), rms_norm(k, kw), rms_norm(v), is_causal)),
        Mistake("you normalised the scores, not q and k: RMS-normalise the vectors before their "
                "dot product", _qk_norm_scores),
        Mistake("you forgot the gains: multiply the normalised q by q_weight and k by k_weight",
                lambda q, k, v, qw, kw, is_causal=False: _attend(
                    rms_norm(q), rms_norm(k), v, is_causal)),
        Mistake("you normalised only q: k needs its own RMSNorm too",
                lambda q, k, v, qw, kw, is_causal=False: _attend(
                    rms_norm(q, qw), k, v, is_causal)),
    ),
))


# --- ch06.qk_norm_heads: debug a QK-norm attention that folds the scale in too early -------------
# The given function (the notebook's locked cell, the same code as _qk_norm_heads_given) works on
# heads as the projections give them, (B, T, H, D), and folds the softmax's 1/sqrt(D) into q to
# save a multiplication on the (T, T) scores, as many implementations do; but it folds it in
# before q's RMSNorm, which divides any positive factor away: its scores are never scaled.

QK_NORM_HEADS_GIVEN = '''\
def qk_norm_heads(q, k, v, q_gain, k_gain):
    """Causal attention with QK-norm, on heads laid out as the projections give
    them.

    q, k: (B, T, H, D); v: (B, T, H, Dv); q_gain, k_gain: (D,) -> (B, T, H, Dv).
    """
    head_dim = q.shape[-1]
    q = q * head_dim**-0.5  # fold the softmax's 1/sqrt(D) into the queries
    q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * q_gain
    k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * k_gain
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k)  # (B, H, T, T)
    t = scores.shape[-1]
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", weights, v)
'''

_given: dict = {"torch": torch}
exec(QK_NORM_HEADS_GIVEN, _given)
_qk_norm_heads_given = _given["qk_norm_heads"]


def _heads_attention(q, k, v, q_gain, k_gain, scale):
    """(B, T, H, D) heads, causal, with the scores times ``scale``; (B, T, H, Dv)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))                    # (B, H, T, ·)
    out = scaled_dot_product_attention(rms_norm(q, q_gain), rms_norm(k, k_gain), v,
                                       is_causal=True, scale=scale)
    return out.transpose(1, 2)


def qk_norm_heads_reference(q, k, v, q_gain, k_gain):
    """(B, T, H, D), (B, T, H, D), (B, T, H, Dv), (D,), (D,) -> (B, T, H, Dv): causal
    softmax(q̂ k̂ᵀ / sqrt(D)) v per head, q̂ and k̂ RMS-normalised over D with their gains."""
    return _heads_attention(q, k, v, q_gain, k_gain, 1 / math.sqrt(q.shape[-1]))


def _heads_cases():
    g = torch.Generator().manual_seed(100)
    q, k, v = (randn(2, 5, 3, 8, seed=g, scale=3.0) for _ in range(3))
    gains = 1.0 + 0.5 * randn(8, seed=g), 1.0 + 0.5 * randn(8, seed=g)
    yield Case("B=2, T=5, H=3, D=8, gains near 1", (q, k, v, *gains),
               hint="normalise q and k over D (the last axis) with their gains, then "
                    "softmax(q̂ k̂ᵀ / sqrt(D)) v with a causal mask, per head")
    q, k, v = (randn(1, 6, 2, 16, seed=g) for _ in range(3))
    ones = torch.ones(16)
    yield Case("T=6, H=2, D=16, unit gains", (q, k, v, ones, ones),
               hint="with unit gains every score is at most sqrt(D) in size")
    q, k, v = randn(1, 4, 4, 4, seed=g, scale=5.0), randn(1, 4, 4, 4, seed=g), randn(1, 4, 4, 3,
                                                                                     seed=g)
    yield Case("H=4, D=4, Dv=3", (q, k, v, randn(4, seed=g), randn(4, seed=g)),
               hint="the values keep their own width Dv; only q and k are normalised")
    q, k, v = (randn(2, 7, 2, 8, seed=g, dtype=torch.float64, scale=2.0) for _ in range(3))
    w = 1.0 + randn(8, seed=g, dtype=torch.float64)
    yield Case("float64, T=7, H=2, D=8", (q, k, v, w, w.flip(0)),
               hint="do not convert the inputs; let their dtype flow through")


UNSCALED = ("the softmax's 1/sqrt(D) never reaches your scores: a factor applied to q before "
            "its RMSNorm is divided away by the norm (rms_norm(c·q) = rms_norm(q) for c > 0)")

register(Exercise(
    key="ch06.qk_norm_heads", function="qk_norm_heads", reference=qk_norm_heads_reference,
    task="debug", given=_qk_norm_heads_given,
    ops=ELEMENTARY | SOFTMAX,
    cases=_heads_cases, compare=expect_tensor, banned=NO_LIBRARY_ATTENTION,
    mistakes=(
        Mistake(UNSCALED, _qk_norm_heads_given),
        Mistake(UNSCALED, lambda q, k, v, qg, kg: _heads_attention(q, k, v, qg, kg, 1.0)),
        Mistake("you divided the scores by sqrt(D) twice (once on q̂ and once on k̂, or on q̂ "
                "and on the scores): the attention is too flat",
                lambda q, k, v, qg, kg: _heads_attention(q, k, v, qg, kg, 1 / q.shape[-1])),
    ),
))


# --- ch06.softcap --------------------------------------------------------------------------------

def softcap_reference(scores, cap):
    """cap · tanh(scores / cap): close to the identity for |scores| << cap, never beyond ±cap."""
    return cap * torch.tanh(scores / cap)


def _softcap_cases():
    yield Case("scores ~ ±10, cap=50 (Gemma 2's attention cap)",
               (randn(3, 7, seed=80, scale=10.0), 50.0),
               hint="divide the scores by cap, take tanh, multiply by cap")
    yield Case("large scores ~ ±200, cap=30", (randn(2, 2, 4, 5, seed=81, scale=200.0), 30.0),
               hint="the result never reaches ±cap, and a larger score still gives a larger "
                    "result: tanh, not a hard clip")
    yield Case("small scores, cap=5", (randn(4, 4, seed=82, scale=0.5), 5.0),
               hint="for |scores| much smaller than cap, the result is close to the scores "
                    "themselves")
    yield Case("float64, cap=1", (randn(2, 6, seed=83, dtype=torch.float64, scale=2.0), 1.0),
               hint="do not convert the inputs; let their dtype flow through")


register(Exercise(
    key="ch06.softcap", function="softcap", reference=softcap_reference,
    task="warm-up",
    ops=ELEMENTARY,
    cases=_softcap_cases, compare=expect_tensor, banned=("course_attn",),
    mistakes=(
        Mistake("you took tanh of the scores themselves: every score beyond about ±2 comes "
                "out flattened near ±cap; the tanh must see the scores measured in units of cap",
                lambda scores, cap: cap * torch.tanh(scores)),
        Mistake("you clipped the scores at ±cap: soft-capping bends them smoothly with tanh, so "
                "a larger score still gives a larger result (and a gradient)",
                lambda scores, cap: scores.clamp(-cap, cap)),
        Mistake("you forgot to multiply by cap after the tanh: the result must lie in "
                "(-cap, cap), not (-1, 1)",
                lambda scores, cap: torch.tanh(scores / cap)),
        Mistake("you divided by cap after the tanh: your results lie in (-1/cap, 1/cap), "
                "and they must fill (-cap, cap)",
                lambda scores, cap: torch.tanh(scores / cap) / cap),
    ),
))


# --- ch06.qk_norm_limits: derive what QK-norm allows ---------------------------------------------

LIMIT_QUESTIONS = {
    # key: (case name, hint of the case)
    "max_score": (
        "(a) the largest score, unit gains",
        "after RMSNorm with unit gains a vector has RMS 1, so its norm is sqrt(D); bound the dot "
        "product by the product of the norms, then divide by sqrt(D)"),
    "max_weight": (
        "(b) the largest weight on one key among T, unit gains",
        "the weight on key j is 1 / (1 + sum over the other keys of exp(s_l - s_j)); make s_j "
        "as large and every other s_l as small as the bound allows"),
    "max_score_gains": (
        "(c) the largest score with the gains q_gain and k_gain",
        "the gains multiply q and k channel by channel, so the score is a sum over the channels "
        "of g^Q_i g^K_i q̃_i k̃_i; ask on which channel q̃ and k̃ should put their length"),
    "gain_for_weight": (
        "(d) the gain g with which one key among T gets the weight `weight`",
        "a gain g on every channel of q and of k multiplies every score by g twice; solve the "
        "formula of (b) for g"),
}

# The chapter's sizes (D = 16, T = 64) and those of its smallest head (D = 4); the largest
# product of one channel's gains is a negative one, and neither gain vector has its largest
# entry on that channel.
PUBLIC_LIMITS = (
    dict(D=16, T=64,
         q_gain=[0.9, 1.1, 2.0, 0.8, 1.2, 0.7, 1.0, 0.6, 1.3, 0.9, 0.5, 1.1, 0.8, 1.4, 0.7, 1.0],
         k_gain=[1.0, 0.8, 0.3, 1.1, -1.5, 0.9, 0.7, 1.9, 0.6, 1.2, 0.8, 0.9, 1.0, 0.5, 1.1, 0.6],
         weight=0.99),
    dict(D=4, T=64, q_gain=[1.5, 0.3, -1.2, 0.6], k_gain=[0.4, 2.0, 1.3, 0.5], weight=0.9),
)


def _max_weight(d, t, gain=1.0, others=None, competitors=None):
    """The largest weight one key can get among t keys: its score at +gain²·sqrt(d), the
    ``competitors`` others (default t - 1) at ``others`` (default: -gain²·sqrt(d), as far down
    as the bound allows)."""
    top = gain ** 2 * math.sqrt(d)
    low = -top if others is None else others
    return 1.0 / (1.0 + (t - 1 if competitors is None else competitors) * math.exp(low - top))


def _gain_for(weight, d, t, *, spread=2.0, competitors=None):
    # 1 / (1 + (t - 1) exp(-2 g² sqrt(d))) = weight  <=>  2 g² sqrt(d) = ln((t - 1) w / (1 - w));
    # ``spread`` 1 puts the other keys at score 0, ``competitors`` counts them another way
    others = t - 1 if competitors is None else competitors
    return math.sqrt(math.log(others * weight / (1 - weight)) / (spread * math.sqrt(d)))


def _largest_gain_product(q_gain, k_gain):
    return max(abs(a * b) for a, b in zip(q_gain, k_gain))


def qk_norm_limits_reference(D, T, q_gain, k_gain, weight):
    """The four answers, computed from the bound |q̂ · k̂| <= max_i |g^Q_i g^K_i| ||q̃|| ||k̃||,
    ||q̃|| = ||k̃|| = sqrt(D), which a q̃ and a k̃ on the channel of that largest product reach."""
    return {"max_score": math.sqrt(D), "max_weight": _max_weight(D, T),
            "max_score_gains": _largest_gain_product(q_gain, k_gain) * math.sqrt(D),
            "gain_for_weight": _gain_for(weight, D, T)}


def _same_number(actual, expected) -> bool:
    actual = as_number(actual)
    return actual is not None and math.isclose(actual, expected, rel_tol=1e-3, abs_tol=1e-4)


LIMITS = Questions(LIMIT_QUESTIONS,
                   same=lambda key, actual, expected: _same_number(actual, expected),
                   wrong=lambda key, actual, expected: f"your answer {key!r} is not the one "
                                                       "the bound gives")


def _answering(**wrong):
    """A typical wrong answer: the right answers, with each key of ``wrong`` replaced by
    ``wrong[key](D=, T=, qg=q_gain, kg=k_gain, w=weight)``."""
    return answers_changed(qk_norm_limits_reference, wrong,
                           sizes=lambda D, T, q_gain, k_gain, weight: dict(
                               D=D, T=T, qg=q_gain, kg=k_gain, w=weight))


register(Exercise(
    key="ch06.qk_norm_limits", function="qk_norm_limits", reference=qk_norm_limits_reference,
    task="derive",
    ops=NONE,
    cases=lambda: LIMITS.cases(*PUBLIC_LIMITS), compare=LIMITS.compare, banned=("course_attn",),
    mistakes=(
        Mistake("you forgot the 1/sqrt(D) of the scores: the dot product of two normalised "
                "vectors is at most D, and the score is that over sqrt(D)",
                _answering(max_score=lambda D, **_: float(D))),
        Mistake("you took a normalised vector to have norm 1 (a cosine): RMSNorm makes the RMS "
                "1, so the norm is sqrt(D)", _answering(max_score=lambda D, **_: 1 / math.sqrt(D))),
        Mistake("you took a normalised vector to have norm 1 (a cosine): RMSNorm makes the RMS "
                "1, so the norm is sqrt(D)", _answering(max_score=lambda **_: 1.0)),
        Mistake("you left the other keys at score 0: the bound lets each of them go down to "
                "-sqrt(D), which makes the winning key's weight larger",
                _answering(max_weight=lambda D, T, **_: _max_weight(D, T, others=0.0),
                           gain_for_weight=lambda D, T, qg, kg, w: _gain_for(w, D, T,
                                                                             spread=1.0))),
        Mistake("you counted T other keys: the winning key is one of the T, so T - 1 others "
                "compete with it",
                _answering(max_weight=lambda D, T, **_: _max_weight(D, T, competitors=T),
                           gain_for_weight=lambda D, T, qg, kg, w: _gain_for(w, D, T,
                                                                             competitors=T))),
        Mistake("you multiplied the largest gain of q by the largest gain of k: the gains meet "
                "channel by channel, g^Q_i g^K_i, and the two largest may sit on different "
                "channels",
                _answering(max_score_gains=lambda D, T, qg, kg, w: max(map(abs, qg))
                           * max(map(abs, kg)) * math.sqrt(D))),
        Mistake("you took the largest product g^Q_i g^K_i with its sign: a negative product "
                "reaches the bound too (with k pointing against q), so the bound is on |s|",
                _answering(max_score_gains=lambda D, T, qg, kg, w: max(
                    a * b for a, b in zip(qg, kg)) * math.sqrt(D))),
        Mistake("a gain g on q and a gain g on k multiply each score by g², not g: you gave the "
                "g² that is needed",
                _answering(gain_for_weight=lambda D, T, qg, kg, w: _gain_for(w, D, T) ** 2)),
    ),
))


# --- ch06.qk_rope_predictions: the bound before and after RoPE -----------------------------------
# With the norm AFTER RoPE the gains come last, so q̂·k̂ = sum_i g^Q_i g^K_i q̃_i k̃_i with q̃, k̃
# any vectors of norm sqrt(D): the largest |score| is max_i |g^Q_i g^K_i| · sqrt(D) (the
# chapter's bound). With the norm BEFORE RoPE the rotation comes after the gains and turns each
# pair of channels (i, i + D/2) by its own angle: q's gain on channel i can meet k's gain on
# channel i + D/2 (a quarter turn), never a gain of another pair. The largest |score| over all q,
# k and positions is then max over the pairs p of (the larger |g^Q| of p) · (the larger |g^K| of
# p) · sqrt(D): the bound max|g^Q| · max|g^K| · sqrt(D) holds, but is reached only when the two
# largest gains sit in one pair. (A supremum: positions whose angles come as close as one likes
# to the quarter turn.)

ORDER_OPTIONS = ("before", "after", "same")

ROPE_ORDER_QUESTIONS = {
    "after_rope": (
        "(a) the candidate that is the largest |score| with the norm after RoPE",
        "after RoPE the norm's gains are the last thing q and k meet: the rotation has already "
        "happened"),
    "before_rope": (
        "(b) the candidate that is the largest |score| with the norm before RoPE",
        "with the norm before RoPE, the rotation comes after the gains, and it turns channel i "
        "together with channel i + D/2 only"),
    "sharper": (
        "(c) the order that lets one key get the larger weight (or 'same')",
        "the largest weight grows with the bound on |score|; compare (a) and (b)"),
}


def _pair_products(q_gain, k_gain):
    d = len(q_gain)
    half = d // 2
    return [max(abs(q_gain[i]), abs(q_gain[i + half])) * max(abs(k_gain[i]), abs(k_gain[i + half]))
            for i in range(half)]


def rope_order_bounds(D, q_gain, k_gain):
    """The largest |score| in each order, and the wrong formulas the candidates also hold."""
    root = math.sqrt(D)
    channel = _largest_gain_product(q_gain, k_gain)
    return {"after": channel * root,
            "before": max(_pair_products(q_gain, k_gain)) * root,
            "largest_times_largest": max(map(abs, q_gain)) * max(map(abs, k_gain)) * root,
            "unit_gains": root,
            "no_scale": channel * D}


def _letter_of(candidates, value):
    """The letter of the candidate equal to ``value`` (within 1e-6), or "" if none is."""
    return next((letter for letter, number in candidates.items()
                 if math.isclose(number, value, rel_tol=1e-6)), "")


def qk_rope_predictions_reference(D, q_gain, k_gain, candidates):
    bounds = rope_order_bounds(D, q_gain, k_gain)
    after, before = bounds["after"], bounds["before"]
    sharper = "same" if math.isclose(before, after, rel_tol=1e-9) else \
        ("before" if before > after else "after")
    return {"after_rope": _letter_of(candidates, after),
            "before_rope": _letter_of(candidates, before), "sharper": sharper}


def rope_order_candidates(D, q_gain, k_gain, letters="ABCDE"):
    """The distinct values of ``rope_order_bounds`` rounded to 6 digits, each under a letter of
    ``letters`` (in that order)."""
    values = []
    for value in rope_order_bounds(D, q_gain, k_gain).values():
        if not any(math.isclose(value, v, rel_tol=1e-3) for v in values):
            values.append(round(value, 6))
    return dict(zip(letters, values))


# Two gain patterns of the chapter's D = 8 heads: (1) q's largest gain in pair (1, 5) sits on
# channel 1, k's on its partner 5, and the largest gains of all sit in other pairs (0 and 2);
# (2) gains equal within each pair (the chapter's `paired`), D = 4.
_Q1 = [2.3, 1.8, 0.4, 0.9, 0.5, -0.3, 0.6, 1.0]
_K1 = [0.3, -0.4, 2.2, 0.8, -0.6, 1.7, 0.4, 0.7]
_Q2 = [1.5, -0.7, 1.5, -0.7]
_K2 = [0.6, 1.9, 0.6, 1.9]
PUBLIC_ROPE_ORDER = (
    dict(D=8, q_gain=_Q1, k_gain=_K1, candidates=rope_order_candidates(8, _Q1, _K1, "CAEBD")),
    dict(D=4, q_gain=_Q2, k_gain=_K2, candidates=rope_order_candidates(4, _Q2, _K2, "BDAC")),
)


def _same_choice(key, actual, expected) -> bool:
    return isinstance(actual, str) and actual.strip() == expected


def _wrong_choice(key, actual, expected) -> str:
    options = ORDER_OPTIONS if key == "sharper" else ("a letter of the candidates",)
    if not isinstance(actual, str):
        return f"your answer {key!r} should be a string: {', '.join(map(repr, options))}"
    if key == "sharper" and actual.strip() not in ORDER_OPTIONS:
        return (f"your answer {key!r} is not one of the options "
                f"{', '.join(map(repr, ORDER_OPTIONS))}")
    return f"your answer {key!r} is not the right choice"


ROPE_ORDER = Questions(ROPE_ORDER_QUESTIONS, same=_same_choice, wrong=_wrong_choice)


def _choosing(key, formula=None, answer=None):
    """A typical wrong prediction: the right answers, with ``key`` answered by the letter of the
    bound ``formula`` (a key of ``rope_order_bounds``) or by ``answer(right)``."""
    def fn(D, q_gain, k_gain, candidates):
        right = qk_rope_predictions_reference(D, q_gain, k_gain, candidates)
        if formula is not None:
            wrong = _letter_of(candidates, rope_order_bounds(D, q_gain, k_gain)[formula])
        else:
            wrong = answer(right)
        return {**right, key: wrong}
    return fn


register(Exercise(
    key="ch06.qk_rope_predictions", function="qk_rope_predictions",
    reference=qk_rope_predictions_reference,
    task="predict",
    ops=NONE,
    cases=lambda: ROPE_ORDER.cases(*PUBLIC_ROPE_ORDER), compare=ROPE_ORDER.compare,
    # Worked out by hand: no tensors, no rotation run to find out.
    banned=("course_attn", "torch.tensor", "torch.as_tensor", "torch.randn", "torch.zeros",
            "torch.ones", "torch.arange", "torch.polar", "torch.complex"),
    mistakes=(
        Mistake("with the norm after RoPE the gains multiply q and k last, channel by channel: "
                "the rotation cannot carry k's gain on one channel of a pair to q's gain on the "
                "other", _choosing("after_rope", "before")),
        Mistake("with the norm before RoPE the rotation comes after the gains: it turns "
                "channel i into channel i + D/2, so q's gain on one channel of a pair can meet "
                "k's gain on the other", _choosing("before_rope", "after")),
        Mistake("with the norm after RoPE the gains meet channel by channel, g^Q_i g^K_i: the "
                "largest gain of q and the largest of k may sit on different channels",
                _choosing("after_rope", "largest_times_largest")),
        Mistake("max|g^Q| · max|g^K| · sqrt(D) holds before RoPE (section 5's bound of the two "
                "norms), but it is not reached when the two largest gains sit in different "
                "pairs: RoPE mixes channel i with channel i + D/2 only",
                _choosing("before_rope", "largest_times_largest")),
        Mistake("the gains multiply the scores: sqrt(D) is the bound for unit gains only",
                _choosing("after_rope", "unit_gains")),
        Mistake("the gains multiply the scores: sqrt(D) is the bound for unit gains only",
                _choosing("before_rope", "unit_gains")),
        Mistake("you forgot the 1/sqrt(D) of the scores: the dot product of the normalised "
                "vectors is divided by sqrt(D)", _choosing("after_rope", "no_scale")),
        Mistake("the two orders agree only where each rotated pair has equal gains (the "
                "chapter's fact 2): compare your (a) and (b)",
                _choosing("sharper", answer=lambda right: "same" if right["sharper"] != "same"
                          else "before")),
        Mistake("the norm before RoPE can only allow more: its bound takes the larger gain of "
                "each pair, which is at least the gain of either channel",
                _choosing("sharper", answer=lambda right: "after")),
    ),
))
