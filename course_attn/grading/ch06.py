"""Exercises of Chapter 6, QK-norm.

    ch06.rms_norm           rms_norm(x, weight=None, eps=1e-6) -> (..., D): each vector over the
                            last axis divided by its root-mean-square, times the gains
    ch06.qk_norm_attention  qk_norm_attention(q, k, v, q_weight, k_weight, is_causal=False)
                            -> (B, H, Tq, Dv): RMS-norm q and k over the head dimension (with
                            their gains), then softmax(q kᵀ/√D) v
    ch06.softcap            softcap(scores, cap) -> cap · tanh(scores / cap), Gemma 2's logit
                            soft-capping
    ch06.qk_norm_limits     qk_norm_limits(D, T, q_gain, k_gain, weight) -> dict: the largest
                            score and the largest weight QK-norm allows, and the gain a weight
                            needs, for the sizes and gains given (derive: compared with the
                            formulas, computed)

References: ``course_attn.rms_norm`` and ``course_attn.scaled_dot_product_attention``; the
soft-cap formula; the limits computed from the bound |q̂·k̂| ≤ max_i |g^Q_i g^K_i| · D.
"""

import math

import torch

from ..attention import scaled_dot_product_attention
from ..masks import causal_mask
from ..norm import rms_norm
from .cases import Questions, as_number, expect_tensor, randn
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


def _rms_by_norm(x, weight=None, eps=1e-6):
    return _with_weight(x / (x.pow(2).sum(dim=-1, keepdim=True) + eps).sqrt(), weight)


def _rms_wrong_axis(x, weight=None, eps=1e-6):
    return _with_weight(x * torch.rsqrt(_rms(x, dim=0) + eps), weight)


def _rms_layer_norm(x, weight=None, eps=1e-6):
    centred = x - x.mean(dim=-1, keepdim=True)
    return _with_weight(centred * torch.rsqrt(_rms(centred) + eps), weight)


register(Exercise(
    key="ch06.rms_norm", function="rms_norm",
    ops=ELEMENTARY,
    reference=lambda x, weight=None, eps=1e-6: rms_norm(x, weight, eps),
    cases=_rms_cases, compare=expect_tensor, banned=NO_LIBRARY_RMS_NORM,
    mistakes=(
        Mistake("you forgot the weight: multiply the normalised vector by the gains, channel "
                "by channel", lambda x, weight=None, eps=1e-6: rms_norm(x, None, eps)),
        Mistake("you divided by the mean of |x|, not by the root of the mean of the squares",
                _rms_mean_abs),
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
    ops=ELEMENTARY | SOFTMAX,
    reference=qk_norm_attention_reference, cases=_qk_cases, compare=expect_tensor,
    banned=NO_LIBRARY_ATTENTION,
    mistakes=(
        Mistake("you forgot the 1/sqrt(D) scale of the scores: QK-norm changes q and k, not "
                "the attention after them",
                lambda q, k, v, qw, kw, is_causal=False: _attend(
                    rms_norm(q, qw), rms_norm(k, kw), v, is_causal, scale=1.0)),
        Mistake("you normalised over the heads (axis 1): QK-norm normalises each head's vector, "
                "over the head dimension D (the last axis)", _qk_over(1)),
        Mistake("you normalised over the positions (axis -2): QK-norm normalises each query and "
                "each key on its own, over D (the last axis)", _qk_over(-2)),
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
    ``wrong[key](D, T, q_gain, k_gain, weight)``."""
    def fn(D, T, q_gain, k_gain, weight):
        right = qk_norm_limits_reference(D, T, q_gain, k_gain, weight)
        return {**right, **{key: answer(D, T, q_gain, k_gain, weight)
                            for key, answer in wrong.items()}}
    return fn


register(Exercise(
    key="ch06.qk_norm_limits", function="qk_norm_limits", reference=qk_norm_limits_reference,
    task="derive",
    ops=NONE,
    cases=lambda: LIMITS.cases(*PUBLIC_LIMITS), compare=LIMITS.compare, banned=("course_attn",),
    mistakes=(
        Mistake("you forgot the 1/sqrt(D) of the scores: the dot product of two normalised "
                "vectors is at most D, and the score is that over sqrt(D)",
                _answering(max_score=lambda D, *_: float(D))),
        Mistake("you took a normalised vector to have norm 1 (a cosine): RMSNorm makes the RMS "
                "1, so the norm is sqrt(D)", _answering(max_score=lambda D, *_: 1 / math.sqrt(D))),
        Mistake("you took a normalised vector to have norm 1 (a cosine): RMSNorm makes the RMS "
                "1, so the norm is sqrt(D)", _answering(max_score=lambda *_: 1.0)),
        Mistake("you left the other keys at score 0: the bound lets each of them go down to "
                "-sqrt(D), which makes the winning key's weight larger",
                _answering(max_weight=lambda D, T, *_: _max_weight(D, T, others=0.0),
                           gain_for_weight=lambda D, T, qg, kg, w: _gain_for(w, D, T,
                                                                             spread=1.0))),
        Mistake("you counted T other keys: the winning key is one of the T, so T - 1 others "
                "compete with it",
                _answering(max_weight=lambda D, T, *_: _max_weight(D, T, competitors=T),
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
