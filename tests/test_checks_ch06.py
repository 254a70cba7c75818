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


def qk_norm_limits():
    def max_weight(d, t):
        return 1 / (1 + (t - 1) * math.exp(-2 * math.sqrt(d)))
    return {"max_score_d16": 4.0, "max_weight_d16_t64": max_weight(16, 64),
            "max_weight_d4_t64": max_weight(4, 64),
            "gain_for_09_d4_t64": math.sqrt(math.log(63 * 9) / 4)}


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

def test_the_limits_are_what_softmax_gives_at_the_bound():
    """The reference's formulas, checked against vectors that reach the bound."""
    expected = get("ch06.qk_norm_limits").reference()
    for d, key in ((16, "max_weight_d16_t64"), (4, "max_weight_d4_t64")):
        q = course_attn.rms_norm(torch.randn(d, dtype=torch.float64), eps=0.0)
        keys = torch.stack([q] + [-q] * 63)                      # one key with q, 63 against it
        scores = keys @ q / math.sqrt(d)
        assert scores.max().item() == pytest.approx(math.sqrt(d))
        assert torch.softmax(scores, -1)[0].item() == pytest.approx(expected[key])
    assert expected["max_score_d16"] == 4.0
    g = expected["gain_for_09_d4_t64"]
    scores = g * g * torch.tensor([2.0] + [-2.0] * 63, dtype=torch.float64)
    assert torch.softmax(scores, -1)[0].item() == pytest.approx(0.9)


def test_qk_norm_limits_mistakes():
    key = "ch06.qk_norm_limits"

    def answering(**wrong):
        return lambda: {**qk_norm_limits(), **wrong}

    a, b, c, d = (name for name in [case.name for case in get(key).public_cases()])
    assert_fails(key, answering(max_score_d16=16.0), a, hint="forgot the 1/sqrt(D)")
    assert_fails(key, answering(max_score_d16=0.25), a, hint="norm 1 (a cosine)")
    others_at_zero = {"max_weight_d16_t64": 1 / (1 + 63 * math.exp(-4)),
                      "max_weight_d4_t64": 1 / (1 + 63 * math.exp(-2))}
    assert_fails(key, answering(**others_at_zero), b, hint="other keys at score 0")
    assert_fails(key, answering(**others_at_zero), c, hint="other keys at score 0")
    assert_fails(key, answering(max_weight_d4_t64=1 / (1 + 64 * math.exp(-4))), c,
                 hint="T other keys")
    assert_fails(key, answering(gain_for_09_d4_t64=math.log(63 * 9) / 4), d, hint="not g")
    assert_fails(key, lambda: [4.0, 0.98], a, message="should return a dict")


def test_qk_norm_limits_never_shows_the_right_answer():
    key = "ch06.qk_norm_limits"
    for result in run_exercise(get(key), lambda: {k: 12345.0 for k in
                                                  get(key).reference()}).results:
        assert not result.passed and "is not the one the bound gives" in result.message
        for answer in ("4.0", "0.97", "0.46", "1.25"):
            assert answer not in result.message


def test_qk_norm_limits_may_not_call_the_package():
    def with_the_package():
        x = course_attn.rms_norm(torch.ones(16))
        return {**qk_norm_limits(), "max_score_d16": (x @ x).item() / 4}
    assert_banned("ch06.qk_norm_limits", with_the_package, "course_attn")
