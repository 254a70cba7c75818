"""Chapter 6's exercises: each typical mistake fails the case meant for it with its own hint, and a
banned call is reported by name. What every exercise must satisfy (the reference and the
solution pass public and hidden cases, a stub is "not answered yet", every declared mistake
names itself) is tested once, for all chapters, in test_exercises_conformance.py.

The wrong solutions below are written as a student would write them; each test names the case
it must fail and a fragment of the hint it must get.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import nbformat

import course_attn
from course_attn.grading import get, run_exercise
from course_attn.grading.judge import Answer, judge_case
from course_attn.grading.exercise import hidden_cases

from check_support import assert_banned, assert_fails, assert_fails_unnamed, results
from helpers import SOLUTIONS_DIR


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


def gemma_rms_norm(x, weight, eps=1e-6):
    return rms_norm(x, 1 + weight, eps)


def qk_norm_heads(q, k, v, q_gain, k_gain):
    head_dim = q.shape[-1]
    q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * q_gain
    k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * k_gain
    q = q * head_dim ** -0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k)
    t = scores.shape[-1]
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", weights, v)


def qk_rope_predictions(D, q_gain, k_gain, candidates):
    half = D // 2
    after = max(abs(a * b) for a, b in zip(q_gain, k_gain)) * math.sqrt(D)
    before = max(max(abs(q_gain[i]), abs(q_gain[i + half]))
                 * max(abs(k_gain[i]), abs(k_gain[i + half])) for i in range(half)) * math.sqrt(D)

    def letter(value):
        return next(x for x, number in candidates.items()
                    if math.isclose(number, value, rel_tol=1e-6))
    sharper = "same" if math.isclose(before, after) else ("before" if before > after else "after")
    return {"after_rope": letter(after), "before_rope": letter(before), "sharper": sharper}


@pytest.mark.parametrize("key, fn", [
    ("ch06.rms_norm", rms_norm), ("ch06.qk_norm_attention", qk_norm_attention),
    ("ch06.softcap", softcap), ("ch06.qk_norm_limits", qk_norm_limits),
    ("ch06.gemma_rms_norm", gemma_rms_norm), ("ch06.qk_norm_heads", qk_norm_heads),
    ("ch06.qk_rope_predictions", qk_rope_predictions)])
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


def test_rms_norm_by_f_normalize_is_told_it_left_eps_out():
    """F.normalize(x) · sqrt(D) is x / RMS(x) with no eps: it is told so, not that eps sits
    after the root."""
    def by_normalize(x, weight=None, eps=1e-6):
        out = F.normalize(x, dim=-1) * math.sqrt(x.shape[-1])
        return out if weight is None else out * weight
    assert_fails("ch06.rms_norm", by_normalize, "small x, eps=0.1", hint="left eps out")
    assert_fails("ch06.rms_norm", by_normalize,
                 "(B, H, T, D) = (2, 3, 5, 16), float64, with a weight", hint="left eps out")
    found = results("ch06.rms_norm", by_normalize, watch=False)
    assert not any("after the square root" in r.hint for r in found.values())


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
    # a causal mask forgotten: a declared mistake
    assert_fails(key, lambda q, k, v, qw, kw, is_causal=False: qk_norm_attention(q, k, v, qw, kw),
                 "causal, T=5", hint="-inf above the diagonal")


def test_qk_norm_attention_l2_normalised_is_named():
    def l2(q, k, v, qw, kw, is_causal=False):
        return attend(F.normalize(q, dim=-1) * qw, F.normalize(k, dim=-1) * kw, v, is_causal)
    assert_fails("ch06.qk_norm_attention", l2, "B=2, H=3, T=5, D=8, gains near 1",
                 hint="L2-normalised")
    assert_fails("ch06.qk_norm_attention", l2, "gains all 1: scores are cosines times sqrt(D)",
                 hint="L2-normalised")


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
    # gains ignored in (c): no typical mistake, so no hint
    assert_fails_unnamed(key, answering(max_score_gains=lambda D, *_: math.sqrt(D)),
                         first["max_score_gains"])
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


# --- gemma_rms_norm ------------------------------------------------------------------------------

GEMMA = "ch06.gemma_rms_norm"


def test_gemma_rms_norm_is_what_a_plain_rms_norm_gives_with_the_gain_1_plus_w():
    x, w = torch.randn(3, 5, 8, dtype=torch.float64), 0.1 * torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(get(GEMMA).reference(x, w), F.rms_norm(x, (8,), 1 + w, eps=1e-6))
    torch.testing.assert_close(get(GEMMA).reference(x, torch.zeros(8, dtype=torch.float64)),
                               F.rms_norm(x, (8,), eps=1e-6))


def test_gemma_rms_norm_mistakes():
    first, zeros = ("x (2, 3, 8), a stored weight near 0 (as a checkpoint holds it)",
                    "x (4, 6), a weight of zeros: the plain normalisation")
    assert_fails(GEMMA, lambda x, weight, eps=1e-6: rms_norm(x, weight, eps), first,
                 hint="the stored weight itself")
    assert_fails(GEMMA, lambda x, weight, eps=1e-6: rms_norm(x, weight, eps), zeros,
                 hint="the stored weight itself")
    assert_fails(GEMMA, lambda x, weight, eps=1e-6: rms_norm(x, None, eps) + weight, first,
                 hint="added the weight")
    assert_fails(GEMMA, lambda x, weight, eps=1e-6: rms_norm(x * (1 + weight), None, eps), first,
                 hint="before normalising")
    assert_fails(GEMMA, lambda x, weight, eps=1e-6: F.normalize(x, dim=-1)
                 * math.sqrt(x.shape[-1]) * (1 + weight), "small x (3, 4), eps=0.1",
                 hint="left eps out")
    assert_fails(GEMMA, lambda x, weight, eps=1e-6: x / (x.pow(2).mean(-1, keepdim=True).sqrt()
                                                        + eps) * (1 + weight),
                 "small x (3, 4), eps=0.1", hint="after the square root")


def test_gemma_rms_norm_may_not_call_a_ready_made_one():
    assert_banned(GEMMA, lambda x, weight, eps=1e-6: F.rms_norm(x, x.shape[-1:], 1 + weight, eps),
                  "torch.nn.functional.rms_norm")
    assert_banned(GEMMA, lambda x, weight, eps=1e-6: course_attn.rms_norm(x, 1 + weight, eps),
                  "course_attn")


# --- qk_norm_heads (debug) -----------------------------------------------------------------------

HEADS = "ch06.qk_norm_heads"
NOTEBOOK = SOLUTIONS_DIR / "06_qk_norm.ipynb"


def _given_cell(grade_id):
    for cell in nbformat.read(NOTEBOOK, as_version=4).cells:
        if cell.metadata.get("nbgrader", {}).get("grade_id") == grade_id:
            return cell.source
    raise KeyError(grade_id)


def test_the_given_function_is_the_graders_and_its_demonstration_breaks_the_bound(capsys):
    from course_attn.grading.ch06 import QK_NORM_HEADS_GIVEN
    source = _given_cell("ch06-qk_norm_heads-given")
    assert source.startswith(QK_NORM_HEADS_GIVEN)
    namespace = {"torch": torch, "math": math}
    exec(source, namespace)
    printed = capsys.readouterr().out
    assert namespace["weight_on_key_0"] > 2 * namespace["bound"]
    assert "the bound" in printed
    # the repaired function reaches the bound exactly, as section 4 says it should
    names = ("demo_q", "demo_k", "demo_v", "unit", "unit")
    repaired = qk_norm_heads(*(namespace[n] for n in names))[0, -1, 0, 0].item()
    assert repaired == pytest.approx(namespace["bound"], rel=1e-4)


def test_the_given_buggy_function_is_told_what_it_still_does_wrong():
    namespace = {"torch": torch, "math": math}
    exec(_given_cell("ch06-qk_norm_heads-given"), namespace)
    for case in ("B=2, T=5, H=3, D=8, gains near 1", "float64, T=7, H=2, D=8"):
        assert_fails(HEADS, namespace["qk_norm_heads"], case, hint="never reaches your scores")


def test_qk_norm_heads_half_repairs():
    first = "B=2, T=5, H=3, D=8, gains near 1"

    def without(scale_q=1.0, scale_scores=1.0):
        def fn(q, k, v, q_gain, k_gain):
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * q_gain * scale_q(q)
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * k_gain * scale_q(k)
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale_scores(q)
            t = scores.shape[-1]
            future = torch.ones(t, t, dtype=torch.bool).triu(1)
            return torch.einsum("bhqk,bkhd->bqhd",
                                scores.masked_fill(future, float("-inf")).softmax(-1), v)
        return fn
    one = lambda x: 1.0  # noqa: E731
    root = lambda x: x.shape[-1] ** -0.5  # noqa: E731
    # the line deleted, the scale nowhere
    assert_fails(HEADS, without(one, one), first, hint="never reaches your scores")
    # the scale after the norm on q and on k: twice
    assert_fails(HEADS, without(root, one), first, hint="twice")
    # on the normalised q (the repair) and on k only: the same answer, right
    assert run_exercise(get(HEADS), qk_norm_heads).passed
    # on the scores, after the norms: also right
    def scaled_scores(q, k, v, q_gain, k_gain):
        return without(one, root)(q, k, v, q_gain, k_gain)
    assert run_exercise(get(HEADS), scaled_scores).passed


def test_qk_norm_heads_may_not_call_a_library_attention():
    def library(q, k, v, q_gain, k_gain):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(rms_norm(q, q_gain), rms_norm(k, k_gain), v,
                                              is_causal=True).transpose(1, 2)
    assert_banned(HEADS, library, "torch.nn.functional.scaled_dot_product_attention")


# --- qk_rope_predictions -------------------------------------------------------------------------

ROPE_KEY = "ch06.qk_rope_predictions"


def _rope_sizes(seeds=range(5)):
    cases = get(ROPE_KEY).public_cases() + [case for seed in seeds
                                            for case in hidden_cases(ROPE_KEY, seed)]
    sizes = []
    for case in cases:
        if dict(case.kwargs) not in sizes:
            sizes.append(dict(case.kwargs))
    return sizes


def _scores_in_order(q, k, q_gain, k_gain, angles, before):
    """q, k (N, D) float64; each pair of channels of k turned by ``angles`` (N, D/2) relative to
    q (RoPE's q_m · k_n depends on n - m only), with the norm before or after the rotation."""
    cos, sin = angles.cos(), angles.sin()
    rotate = lambda x: course_attn.apply_rotary_emb(x, cos, sin)  # noqa: E731
    if before:
        q_hat = course_attn.rms_norm(q, q_gain, eps=0.0)
        k_hat = rotate(course_attn.rms_norm(k, k_gain, eps=0.0))
    else:
        q_hat = course_attn.rms_norm(q, q_gain, eps=0.0)
        k_hat = course_attn.rms_norm(rotate(k), k_gain, eps=0.0)
    return (q_hat * k_hat).sum(-1) / math.sqrt(q.shape[-1])


def test_the_rope_bounds_are_reached_and_never_beaten():
    """The reference's two bounds, on the public and hidden gain patterns: random q, k and
    rotations never beat them, and a q and k on the right channels, with the right turn of
    their pair, reach them."""
    from course_attn.grading.ch06 import rope_order_bounds
    gen = torch.Generator().manual_seed(6)
    for size in _rope_sizes():
        d, qg, kg = size["D"], size["q_gain"], size["k_gain"]
        bounds = rope_order_bounds(d, qg, kg)
        q_gain, k_gain = (torch.tensor(g, dtype=torch.float64) for g in (qg, kg))
        q, k = (torch.randn(2000, d, generator=gen, dtype=torch.float64) for _ in range(2))
        angles = 2 * math.pi * torch.rand(2000, d // 2, generator=gen, dtype=torch.float64)
        for before, bound in ((True, bounds["before"]), (False, bounds["after"])):
            assert _scores_in_order(q, k, q_gain, k_gain, angles, before).abs().max() <= \
                bound * (1 + 1e-12)
        # after: q and k on the channel of the largest |g^Q_i g^K_i|, no turn
        channel = int((q_gain * k_gain).abs().argmax())
        e = torch.zeros(1, d, dtype=torch.float64)
        e[0, channel] = 1.0
        none = torch.zeros(1, d // 2, dtype=torch.float64)
        assert _scores_in_order(e, e, q_gain, k_gain, none, False).abs().item() == \
            pytest.approx(bounds["after"])
        # before: q on its larger channel of the best pair, k on its own, turned onto q's
        half = d // 2
        pair = max(range(half), key=lambda i: max(abs(qg[i]), abs(qg[i + half]))
                   * max(abs(kg[i]), abs(kg[i + half])))
        a = pair if abs(qg[pair]) >= abs(qg[pair + half]) else pair + half
        b = pair if abs(kg[pair]) >= abs(kg[pair + half]) else pair + half
        eq, ek = torch.zeros(1, d, dtype=torch.float64), torch.zeros(1, d, dtype=torch.float64)
        eq[0, a], ek[0, b] = 1.0, 1.0
        turn = torch.zeros(1, half, dtype=torch.float64)
        turn[0, pair] = {0: 0.0, 1: math.pi / 2, -1: -math.pi / 2}[(a - b) // half]
        assert _scores_in_order(eq, ek, q_gain, k_gain, turn, True).abs().item() == \
            pytest.approx(bounds["before"])


def _rope_names():
    return {case.part: case.name for case in get(ROPE_KEY).public_cases()[:3]}, \
        {case.part: case.name for case in get(ROPE_KEY).public_cases()[3:6]}


def predicting(**wrong):
    def fn(D, q_gain, k_gain, candidates):
        right = qk_rope_predictions(D, q_gain, k_gain, candidates)
        return {**right, **{key: answer(D, q_gain, k_gain, candidates)
                            for key, answer in wrong.items()}}
    return fn


def _letter(candidates, value):
    return next(x for x, number in candidates.items() if math.isclose(number, value,
                                                                      rel_tol=1e-6))


def test_qk_rope_predictions_mistakes():
    first, second = _rope_names()
    channel = lambda D, qg, kg, c: _letter(c, max(abs(a * b) for a, b in zip(qg, kg))  # noqa
                                           * math.sqrt(D))
    largest = lambda D, qg, kg, c: _letter(c, max(map(abs, qg)) * max(map(abs, kg))  # noqa
                                           * math.sqrt(D))
    unit = lambda D, qg, kg, c: _letter(c, math.sqrt(D))  # noqa: E731
    # before RoPE as the chapter's section 3 bound, channel by channel
    assert_fails(ROPE_KEY, predicting(before_rope=channel), first["before_rope"],
                 hint="the rotation comes after the gains")
    # before RoPE as section 5's bound of the norms: holds, not reached
    assert_fails(ROPE_KEY, predicting(before_rope=largest), first["before_rope"],
                 hint="holds before RoPE")
    assert_fails(ROPE_KEY, predicting(before_rope=largest), second["before_rope"],
                 hint="holds before RoPE")
    assert_fails(ROPE_KEY, predicting(after_rope=largest), first["after_rope"],
                 hint="channel by channel, g^Q_i g^K_i")
    assert_fails(ROPE_KEY, predicting(after_rope=unit), first["after_rope"],
                 hint="unit gains only")
    assert_fails(ROPE_KEY, predicting(sharper=lambda *_: "same"), first["sharper"],
                 hint="fact 2")
    assert_fails(ROPE_KEY, predicting(sharper=lambda *_: "before"), second["sharper"],
                 hint="fact 2")
    assert_fails(ROPE_KEY, predicting(sharper=lambda *_: "after"), first["sharper"],
                 hint="can only allow more")
    assert_fails(ROPE_KEY, predicting(sharper=lambda *_: "later"), first["sharper"],
                 message="not one of the options")
    # two parts wrong at once: each named on its own
    both = predicting(before_rope=channel, sharper=lambda *_: "same")
    assert_fails(ROPE_KEY, both, first["before_rope"], hint="the rotation comes after the gains")
    assert_fails(ROPE_KEY, both, first["sharper"], hint="fact 2")


def test_qk_rope_predictions_pasted_letters_fail_the_hidden_cases():
    exercise = get(ROPE_KEY)
    table = [exercise.reference(**c.kwargs) for c in exercise.public_cases()[::3]]
    for seed in range(20):
        judgement = run_exercise(exercise, lambda **size: table[0], hidden_cases(ROPE_KEY, seed))
        assert not judgement.passed, seed


def test_qk_rope_predictions_may_not_make_tensors():
    def by_tensors(D, q_gain, k_gain, candidates):
        g = torch.tensor(q_gain) * torch.tensor(k_gain)
        return {**qk_rope_predictions(D, q_gain, k_gain, candidates),
                "after_rope": _letter(candidates, g.abs().max().item() * math.sqrt(D))}
    assert_banned(ROPE_KEY, by_tensors, "torch.tensor")


# --- two parts wrong at once: each named (mistakes are matched part by part) ----------------------

def test_qk_norm_limits_two_wrong_parts_get_both_hints():
    first = _first_set_names()
    both = answering(max_score=lambda D, *_: D * 1.0,
                     max_score_gains=lambda D, T, qg, kg, w: max(map(abs, qg))
                     * max(map(abs, kg)) * math.sqrt(D))
    assert_fails(LIMITS_KEY, both, first["max_score"], hint="forgot the 1/sqrt(D)")
    assert_fails(LIMITS_KEY, both, first["max_score_gains"],
                 hint="largest gain of q by the largest gain of k")
    # and the grader's hidden cases name them too
    exercise = get(LIMITS_KEY)
    for case in hidden_cases(LIMITS_KEY, 0):
        if case.part in ("max_score", "max_score_gains"):
            result = judge_case(exercise, case, exercise.expected(case),
                                Answer(value=both(**case.kwargs)), hidden=True)
            assert not result.passed and result.hint in {m.hint for m in exercise.mistakes}
