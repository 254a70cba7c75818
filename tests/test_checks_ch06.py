"""Chapter 6's exercises: each typical mistake fails the case meant for it with its own hint, and a
banned call is reported by name. What every exercise must satisfy (the reference and the
solution pass public and hidden cases, a stub is "not answered yet", every declared mistake
names itself) is tested once, for all chapters, in test_exercises_conformance.py.

The wrong solutions below are written as a student would write them; each test names the case
it must fail and a fragment of the hint it must get.
"""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import course_attn
from course_attn.grading import get, run_exercise
from course_attn.grading.exercise import hidden_cases, load_hidden

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from check_support import assert_banned, assert_fails, results  # noqa: E402

load_hidden(Path(__file__).resolve().parents[1] / "solutions")


# --- solutions as in solutions/06_qk_norm.ipynb ---------------------------------------------------

def rms_norm(x, weight=None, eps=1e-6):
    out = x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return out if weight is None else out * weight


def attend(q, k, v, is_causal=False, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if is_causal:
        tq, tk = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq),
                                    float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def qk_norm_attention(q, k, v, q_weight, k_weight, is_causal=False):
    return attend(rms_norm(q, q_weight), rms_norm(k, k_weight), v, is_causal)


def softcap(scores, cap):
    return cap * torch.tanh(scores / cap)


def qk_norm_limits(D, T, q_gain, k_gain, weight):
    def max_weight(b):
        return 1 / (1 + (T - 1) * math.exp(-2 * b))
    largest_product = max(abs(a * b) for a, b in zip(q_gain, k_gain))
    g_squared = math.log((T - 1) * weight / (1 - weight)) / (2 * math.sqrt(D))
    return {"max_score": math.sqrt(D), "max_weight": max_weight(math.sqrt(D)),
            "max_score_gains": largest_product * math.sqrt(D),
            "gain_for_weight": math.sqrt(g_squared)}


@pytest.mark.parametrize("key, fn", [
    ("ch06.rms_norm", rms_norm), ("ch06.qk_norm_attention", qk_norm_attention),
    ("ch06.softcap", softcap), ("ch06.qk_norm_limits", qk_norm_limits)])
def test_the_notebooks_solutions_pass_with_the_watch_on(key, fn):
    for cases in [None] + [hidden_cases(key, seed) or None for seed in range(5)]:
        judgement = run_exercise(get(key), fn, cases)
        assert judgement.passed, (judgement.banned, [(r.name, r.message) for r in
                                                     judgement.results if not r.passed])


def test_rms_norm_equals_pytorchs():
    x, w = torch.randn(3, 5, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(rms_norm(x, w), F.rms_norm(x, (8,), w, eps=1e-6))
    torch.testing.assert_close(get("ch06.rms_norm").reference(x, w), rms_norm(x, w))


# --- rms_norm ----------------------------------------------------------------------------------

def test_rms_norm_mistakes():
    key, first = "ch06.rms_norm", "x (2, 3, 8), no weight, float32"
    weighted = "x (4, 6) with a weight (6,)"
    assert_fails(key, lambda x, weight=None, eps=1e-6: rms_norm(x, None, eps), weighted,
                 hint="forgot the weight")
    assert_fails(key, lambda x, weight=None, eps=1e-6: x / (x.abs().mean(-1, keepdim=True) + eps),
                 first, hint="mean of |x|")
    assert_fails(key, lambda x, weight=None, eps=1e-6: x / (x.pow(2).mean(-1, keepdim=True)
                                                           .sqrt() + eps),
                 "small x, eps=0.1", hint="after the square root")
    assert_fails(key, lambda x, weight=None, eps=1e-6: x / x.norm(dim=-1, keepdim=True), first,
                 hint="the norm of x")
    assert_fails(key, lambda x, weight=None, eps=1e-6: x / torch.sqrt(x.pow(2).mean(0) + eps),
                 "a square (5, 5) input", hint="wrong axis")
    centred = lambda x, weight=None, eps=1e-6: rms_norm(  # noqa: E731
        x - x.mean(-1, keepdim=True), weight, eps)
    assert_fails(key, centred, "x with a mean far from 0 (RMSNorm does not subtract it)",
                 hint="that is LayerNorm")


def test_rms_norm_may_not_call_a_ready_made_one():
    assert_banned("ch06.rms_norm", course_attn.rms_norm, "course_attn")
    assert_banned("ch06.rms_norm", lambda x, weight=None, eps=1e-6: F.rms_norm(
        x, x.shape[-1:], weight, eps), "torch.nn.functional.rms_norm")
    assert_banned("ch06.rms_norm", lambda x, weight=None, eps=1e-6: torch.rms_norm(
        x, x.shape[-1:], weight, eps), "torch.rms_norm")

    def module(x, weight=None, eps=1e-6):
        norm = torch.nn.RMSNorm(x.shape[-1], eps=eps, elementwise_affine=weight is not None,
                                dtype=x.dtype)
        if weight is not None:
            norm.weight.data = weight
        return norm(x)
    assert_banned("ch06.rms_norm", module, "torch.nn.RMSNorm.forward")


# --- qk_norm_attention -------------------------------------------------------------------------

def test_qk_norm_attention_mistakes():
    key, first = "ch06.qk_norm_attention", "B=2, H=3, T=5, D=8, gains near 1"

    def over(dim):
        def norm(x, w):
            return x / torch.sqrt(x.pow(2).mean(dim, keepdim=True) + 1e-6) * w
        return lambda q, k, v, qw, kw, is_causal=False: attend(norm(q, qw), norm(k, kw), v,
                                                               is_causal)

    assert_fails(key, lambda q, k, v, qw, kw, is_causal=False: attend(
        rms_norm(q, qw), rms_norm(k, kw), v, is_causal, scale=1.0), first, hint="1/sqrt(D)")
    assert_fails(key, over(1), first, hint="over the heads")
    assert_fails(key, over(2), first, hint="over the positions")
    assert_fails(key, lambda q, k, v, qw, kw, is_causal=False: attend(
        rms_norm(q, qw), rms_norm(k, kw), rms_norm(v), is_causal), first, hint="normalised v")
    assert_fails(key, lambda q, k, v, qw, kw, is_causal=False: torch.softmax(
        rms_norm(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])), -1) @ v, first,
        hint="normalised the scores")
    assert_fails(key, lambda q, k, v, qw, kw, is_causal=False: attend(
        rms_norm(q), rms_norm(k), v, is_causal), first, hint="forgot the gains")
    assert_fails(key, lambda q, k, v, qw, kw, is_causal=False: attend(
        rms_norm(q, qw), k, v, is_causal), first, hint="only q")
    # a causal mask forgotten: no typical mistake, the case's own hint
    assert_fails(key, lambda q, k, v, qw, kw, is_causal=False: qk_norm_attention(q, k, v, qw, kw),
                 "causal, T=5", hint="-inf above the diagonal")


def test_swapping_the_gains_is_no_mistake():
    """Only the product of the two gains reaches the scores: q̂·k̂ = Σ_i g_q,i g_k,i q̃_i k̃_i."""
    swapped = lambda q, k, v, qw, kw, is_causal=False: qk_norm_attention(  # noqa: E731
        q, k, v, kw, qw, is_causal)
    assert run_exercise(get("ch06.qk_norm_attention"), swapped).passed


def test_qk_norm_attention_may_not_call_a_library_attention():
    assert_banned("ch06.qk_norm_attention", lambda q, k, v, qw, kw, is_causal=False:
                  F.scaled_dot_product_attention(rms_norm(q, qw), rms_norm(k, kw), v,
                                                 is_causal=is_causal),
                  "torch.nn.functional.scaled_dot_product_attention")
    assert_banned("ch06.qk_norm_attention", lambda q, k, v, qw, kw, is_causal=False:
                  course_attn.scaled_dot_product_attention(rms_norm(q, qw), rms_norm(k, kw), v,
                                                           is_causal=is_causal), "course_attn")


# --- softcap -----------------------------------------------------------------------------------

def test_softcap_mistakes():
    key, first = "ch06.softcap", "scores ~ ±10, cap=50 (Gemma 2's attention cap)"
    large = "large scores ~ ±200, cap=30"
    assert_fails(key, lambda scores, cap: torch.tanh(scores) * cap, first, hint="in units of cap")
    assert_fails(key, lambda scores, cap: torch.clamp(scores, min=-cap, max=cap), large,
                 hint="clipped")
    assert_fails(key, lambda scores, cap: torch.tanh(scores / cap), first,
                 hint="forgot to multiply")
    assert_fails(key, lambda scores, cap: torch.tanh(scores / cap) / cap, first,
                 hint="divided by cap after")
    assert results(key, lambda scores, cap: scores.clamp(-cap, cap))[first].passed is False


def test_softcap_may_not_call_the_package():
    import course_attn.grading.ch06 as ch06
    assert_banned("ch06.softcap", ch06.softcap_reference, "course_attn")


# --- qk_norm_limits ----------------------------------------------------------------------------

LIMITS_KEY = "ch06.qk_norm_limits"


def _limit_sizes(seeds=range(5)):
    """The dicts of arguments of the public cases and of the hidden cases of ``seeds``."""
    cases = get(LIMITS_KEY).public_cases() + [
        case for seed in seeds for case in hidden_cases(LIMITS_KEY, seed)]
    sizes = []
    for case in cases:
        if dict(case.kwargs) not in sizes:
            sizes.append(dict(case.kwargs))
    return sizes


def _qk_norm_scores(q, keys, q_gain, k_gain):
    """The scores of a query against keys, through the package's RMSNorm with these gains."""
    q_hat = course_attn.rms_norm(q, q_gain, eps=0.0)
    k_hat = course_attn.rms_norm(keys, k_gain, eps=0.0)
    return q_hat @ k_hat.transpose(-2, -1) / math.sqrt(q.shape[-1])


def test_the_limits_are_what_softmax_gives_at_the_bound():
    """On the public sizes and on hidden ones of several seeds, the reference's answers checked
    against vectors that reach the bound, through the package's RMSNorm and a softmax; and no
    random q and k beats the bound."""
    sizes = _limit_sizes()
    assert len(sizes) == 2 + 3 * 5
    gen = torch.Generator().manual_seed(2)
    for size in sizes:
        expected = get(LIMITS_KEY).reference(**size)
        d, t, w = size["D"], size["T"], size["weight"]
        q_gain, k_gain = (torch.tensor(size[g], dtype=torch.float64) for g in ("q_gain", "k_gain"))
        ones = torch.ones(d, dtype=torch.float64)
        q = torch.randn(d, generator=gen, dtype=torch.float64)
        keys = torch.stack([q] + [-q] * (t - 1))       # one key with q, T - 1 against it
        scores = _qk_norm_scores(q, keys, ones, ones)
        assert scores.max().item() == pytest.approx(expected["max_score"])
        assert torch.softmax(scores, -1)[0].item() == pytest.approx(expected["max_weight"])
        channel = int((q_gain * k_gain).abs().argmax())   # q and k on one channel
        q1 = torch.zeros(d, dtype=torch.float64).index_fill(0, torch.tensor([channel]), 3.0)
        k1 = q1 * torch.sign(q_gain * k_gain)
        assert _qk_norm_scores(q1, k1[None], q_gain, k_gain).item() == pytest.approx(
            expected["max_score_gains"])
        random_scores = _qk_norm_scores(torch.randn(200, d, generator=gen, dtype=torch.float64),
                                        torch.randn(300, d, generator=gen, dtype=torch.float64),
                                        q_gain, k_gain)
        assert random_scores.abs().max().item() <= expected["max_score_gains"] * (1 + 1e-12)
        g = expected["gain_for_weight"]
        scores = _qk_norm_scores(q, keys, g * ones, g * ones)
        assert torch.softmax(scores, -1)[0].item() == pytest.approx(w)
    assert get(LIMITS_KEY).reference(**sizes[0])["max_score"] == 4.0


def _first_set_names():
    return {case.part: case.name for case in get(LIMITS_KEY).public_cases()[:4]}


def _second_set_names():
    return {case.part: case.name for case in get(LIMITS_KEY).public_cases()[4:8]}


def answering(**wrong):
    def fn(D, T, q_gain, k_gain, weight):
        return {**qk_norm_limits(D, T, q_gain, k_gain, weight),
                **{k: answer(D, T, q_gain, k_gain, weight) for k, answer in wrong.items()}}
    return fn


def test_qk_norm_limits_mistakes():
    key, first, second = LIMITS_KEY, _first_set_names(), _second_set_names()
    assert_fails(key, answering(max_score=lambda D, *_: D * 1.0), first["max_score"],
                 hint="forgot the 1/sqrt(D)")
    assert_fails(key, answering(max_score=lambda D, *_: 1 / math.sqrt(D)), first["max_score"],
                 hint="norm 1 (a cosine)")
    others_at_zero = answering(
        max_weight=lambda D, T, *_: 1 / (1 + (T - 1) * math.exp(-math.sqrt(D))),
        gain_for_weight=lambda D, T, qg, kg, w: math.sqrt(math.log((T - 1) * w / (1 - w))
                                                          / math.sqrt(D)))
    assert_fails(key, others_at_zero, first["max_weight"], hint="other keys at score 0")
    assert_fails(key, others_at_zero, first["gain_for_weight"], hint="other keys at score 0")
    t_others = answering(
        max_weight=lambda D, T, *_: 1 / (1 + T * math.exp(-2 * math.sqrt(D))),
        gain_for_weight=lambda D, T, qg, kg, w: math.sqrt(math.log(T * w / (1 - w))
                                                          / (2 * math.sqrt(D))))
    assert_fails(key, t_others, second["max_weight"], hint="T other keys")
    assert_fails(key, answering(max_score_gains=lambda D, T, qg, kg, w: max(map(abs, qg))
                                * max(map(abs, kg)) * math.sqrt(D)),
                 first["max_score_gains"], hint="largest gain of q by the largest gain of k")
    assert_fails(key, answering(max_score_gains=lambda D, T, qg, kg, w: max(
        a * b for a, b in zip(qg, kg)) * math.sqrt(D)), first["max_score_gains"],
        hint="with its sign")
    assert_fails(key, answering(gain_for_weight=lambda D, T, qg, kg, w: math.log(
        (T - 1) * w / (1 - w)) / (2 * math.sqrt(D))), second["gain_for_weight"], hint="not g")
    # gains ignored in (c): no typical mistake, the case's own hint
    assert_fails(key, answering(max_score_gains=lambda D, *_: math.sqrt(D)),
                 first["max_score_gains"], hint="ask on which channel")
    assert_fails(key, lambda **_: [4.0, 0.98], first["max_score"], message="should return a dict")


def test_pasting_the_public_answers_fails_the_hidden_cases_of_every_seed():
    """A notebook that computes the public answers once (with the package, in another cell) and
    pastes them: right on the check's cases, wrong on the grader's."""
    exercise = get(LIMITS_KEY)
    pasted = {(c.kwargs["D"], c.kwargs["T"]): exercise.reference(**c.kwargs)
              for c in exercise.public_cases()}
    first = next(iter(pasted.values()))

    def constants(D, T, q_gain, k_gain, weight):
        return dict(pasted.get((D, T), first))

    assert run_exercise(exercise, constants).passed
    for seed in range(20):
        judgement = run_exercise(exercise, constants, hidden_cases(LIMITS_KEY, seed))
        assert not judgement.passed, seed


def test_qk_norm_limits_never_shows_the_right_answer():
    key = LIMITS_KEY
    for result in run_exercise(get(key), lambda **size: {k: 12345.0 for k in
                                                         get(key).reference(**size)}).results:
        assert not result.passed and "is not the one the bound gives" in result.message
        for answer in ("4.0", "0.97", "0.46", "7.2", "1.04", "1.25", "3.12"):
            assert answer not in result.message


def test_qk_norm_limits_may_not_call_the_package():
    def with_the_package(D, T, q_gain, k_gain, weight):
        x = course_attn.rms_norm(torch.ones(D))
        return {**qk_norm_limits(D, T, q_gain, k_gain, weight),
                "max_score": (x @ x).item() / math.sqrt(D)}
    assert_banned(LIMITS_KEY, with_the_package, "course_attn")
