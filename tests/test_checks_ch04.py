"""Chapter 4's exercises: each typical mistake fails the case meant for it with its own hint, and a
banned call is reported by name. What every exercise must satisfy is tested once, for all
chapters, in test_exercises_conformance.py.

The wrong solutions below are written as a student would write them; each test names the case
it must fail and a fragment of the hint it must get.
"""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import course_attn
import course_attn.multihead
from course_attn.grading import get, run_exercise
from course_attn.grading.exercise import hidden_cases, load_hidden

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from check_support import assert_banned, assert_fails, results  # noqa: E402

load_hidden(Path(__file__).resolve().parents[1] / "solutions")


# --- solutions as in solutions/04_multi_head.ipynb ---------------------------------------------

def split_heads(x, n_heads):
    b, t, c = x.shape
    return x.view(b, t, n_heads, c // n_heads).transpose(1, 2)


def merge_heads(x):
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def multi_head_attention(x, w_q, w_k, w_v, w_o, n_heads, causal):
    q, k, v = (split_heads(x @ w.T, n_heads) for w in (w_q, w_k, w_v))
    t, d = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return merge_heads(torch.softmax(scores, dim=-1) @ v) @ w_o.T


def mha_cost():
    C, H, T = 512, 8, 1024
    D = C // H
    return {"params": 4 * C * C, "projection_macs": 4 * T * C * C,
            "attention_macs_multi": H * 2 * T * T * D, "attention_macs_single": 2 * T * T * C,
            "score_entries_multi": H * T * T, "score_entries_single": T * T}


@pytest.mark.parametrize("key, fn", [
    ("ch04.split_heads", split_heads), ("ch04.merge_heads", merge_heads),
    ("ch04.multi_head_attention", multi_head_attention), ("ch04.mha_cost", mha_cost)])
def test_the_notebooks_solutions_pass_with_the_watch_on(key, fn):
    for cases in [None] + [hidden_cases(key, seed) or None for seed in range(5)]:
        judgement = run_exercise(get(key), fn, cases)
        assert judgement.passed, (judgement.banned, [(r.name, r.message) for r in
                                                     judgement.results if not r.passed])


# --- split_heads / merge_heads -----------------------------------------------------------------

def test_split_heads_mistakes():
    key, first = "ch04.split_heads", "B=2, T=5, C=12, H=3"
    assert_fails(key, lambda x, h: x.reshape(x.shape[0], h, x.shape[1], -1), first,
                 hint="straight to (B, H, T, D)")
    assert_fails(key, lambda x, h: x.view(*x.shape[:2], h, -1), first,
                 hint="your result is (B, T, H, D)", message="shape")
    assert_fails(key, lambda x, h: x.view(*x.shape[:2], -1, h).permute(0, 3, 1, 2), first,
                 hint="every H-th channel")
    # a reshape to (B, T, H, D) and a transpose of the wrong axes: only the case's hint
    assert_fails(key, lambda x, h: x.view(*x.shape[:2], h, -1).transpose(1, 3), first,
                 message="shape")


def test_merge_heads_mistakes():
    key, first = "ch04.merge_heads", "B=2, H=3, T=5, D=4"
    assert_fails(key, lambda x: x.reshape(x.shape[0], x.shape[2], -1), first,
                 hint="without moving the heads back")
    assert_fails(key, lambda x: x.transpose(1, 2), first, hint="your result is (B, T, H, D)")
    assert_fails(key, lambda x: x.permute(0, 2, 3, 1).flatten(2), first, hint="interleave")
    # .view on the transposed tensor raises: the case's hint says why
    found = results(key, lambda x: x.transpose(1, 2).view(x.shape[0], x.shape[2], -1))
    assert not found[first].passed and "RuntimeError" in found[first].message
    assert "reshape" in found["float64, B=2, H=4, T=7, D=2"].hint


def test_split_and_merge_may_not_call_the_package():
    assert_banned("ch04.split_heads", course_attn.multihead.split_heads, "course_attn")
    assert_banned("ch04.merge_heads", course_attn.multihead.merge_heads, "course_attn")


def test_the_merge_bug_mixes_positions():
    """What the hint says: with the bug, token 0's row reads later positions."""
    x = torch.arange(2 * 3 * 4 * 1.0).reshape(1, 2, 3 * 4, 1)[:, :, :4]   # (1, H=2, T=4, D=1)
    wrong = x.reshape(1, 4, 2)
    assert wrong[0, 0].tolist() == [x[0, 0, 0, 0].item(), x[0, 0, 1, 0].item()]
    assert merge_heads(x)[0, 0].tolist() == [x[0, 0, 0, 0].item(), x[0, 1, 0, 0].item()]


# --- multi_head_attention ----------------------------------------------------------------------

def _mha(split=split_heads, merge=merge_heads, scale=None, out=True, t_weights=True,
         causal_rule=None):
    def fn(x, w_q, w_k, w_v, w_o, n_heads, causal):
        ws = [w.T if t_weights else w for w in (w_q, w_k, w_v, w_o)]
        q, k, v = (split(x @ w, n_heads) for w in ws[:3])
        t, d = q.shape[-2], q.shape[-1]
        scores = q @ k.transpose(-2, -1) * (d ** -0.5 if scale is None else scale(x))
        if causal if causal_rule is None else causal_rule:
            scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(),
                                        float("-inf"))
        merged = merge(torch.softmax(scores, dim=-1) @ v)
        return merged @ ws[3] if out else merged
    return fn


def test_multi_head_attention_mistakes():
    key, first = "ch04.multi_head_attention", "B=2, T=6, C=12, H=3, causal"
    not_causal = "B=2, T=6, C=12, H=3, not causal"
    assert results(key, _mha())[first].passed
    assert_fails(key, _mha(merge=lambda o: o.reshape(o.shape[0], o.shape[2], -1)), first,
                 hint="merged the heads with a reshape")
    assert_fails(key, _mha(split=lambda y, h: y.reshape(y.shape[0], h, y.shape[1], -1)),
                 first, hint="split the heads with a reshape")
    assert_fails(key, _mha(scale=lambda x: x.shape[-1] ** -0.5), first, hint="1/sqrt(C)")
    assert_fails(key, _mha(scale=lambda x: 1.0), first, hint="did not scale")
    assert_fails(key, _mha(out=False), first, hint="left out the output projection")
    assert_fails(key, _mha(t_weights=False), first, hint="as given (x @ w)")
    assert_fails(key, _mha(causal_rule=False), first, hint="ignored causal=True")
    assert_fails(key, _mha(causal_rule=True), not_causal, hint="with causal=False")
    # only the queries transposed wrongly: no typical mistake, the case's hint
    def half_transposed(x, w_q, w_k, w_v, w_o, n_heads, causal):
        return multi_head_attention(x, w_q.T, w_k, w_v, w_o, n_heads, causal)
    assert_fails(key, half_transposed, first, hint="weights are (out, in)")


def test_multi_head_attention_equals_the_modules_it_stands_for():
    """The reference is what MultiHeadAttention and nn.MultiheadAttention compute."""
    exercise = get("ch04.multi_head_attention")
    for case in exercise.public_cases():
        x, w_q, w_k, w_v, w_o, h, causal = case.args
        c = x.shape[-1]
        ours = course_attn.MultiHeadAttention(c, h).to(x.dtype)
        theirs = torch.nn.MultiheadAttention(c, h, bias=False, batch_first=True).to(x.dtype)
        with torch.no_grad():
            for proj, w in zip((ours.q_proj, ours.k_proj, ours.v_proj, ours.out_proj),
                               (w_q, w_k, w_v, w_o)):
                proj.weight.copy_(w)
            theirs.in_proj_weight.copy_(torch.cat([w_q, w_k, w_v]))
            theirs.out_proj.weight.copy_(w_o)
            expected = exercise.expected(case)
            torch.testing.assert_close(ours(x, is_causal=causal), expected)
            t = x.shape[1]
            mask = ~torch.ones(t, t, dtype=torch.bool).tril() if causal else None
            torch.testing.assert_close(theirs(x, x, x, attn_mask=mask, need_weights=False)[0],
                                       expected)


def test_multi_head_attention_may_not_call_a_library_attention():
    def with_sdpa(x, w_q, w_k, w_v, w_o, n_heads, causal):
        q, k, v = (split_heads(x @ w.T, n_heads) for w in (w_q, w_k, w_v))
        return merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=causal)) @ w_o.T
    assert_banned("ch04.multi_head_attention", with_sdpa,
                  "torch.nn.functional.scaled_dot_product_attention")

    def with_torch_module(x, w_q, w_k, w_v, w_o, n_heads, causal):
        c, t = x.shape[-1], x.shape[1]
        m = torch.nn.MultiheadAttention(c, n_heads, bias=False, batch_first=True).to(x.dtype)
        with torch.no_grad():
            m.in_proj_weight.copy_(torch.cat([w_q, w_k, w_v]))
            m.out_proj.weight.copy_(w_o)
        mask = ~torch.ones(t, t, dtype=torch.bool).tril() if causal else None
        return m(x, x, x, attn_mask=mask, need_weights=False)[0]
    assert_banned("ch04.multi_head_attention", with_torch_module,
                  "torch.nn.MultiheadAttention.forward")

    def with_the_package(x, w_q, w_k, w_v, w_o, n_heads, causal):
        q, k, v = (course_attn.multihead.split_heads(x @ w.T, n_heads) for w in (w_q, w_k, w_v))
        out = course_attn.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return merge_heads(out) @ w_o.T
    assert_banned("ch04.multi_head_attention", with_the_package, "course_attn")


# --- mha_cost ----------------------------------------------------------------------------------

def test_the_cost_reference_is_what_pytorch_counts():
    """The reference's multiply-adds are half of FlopCounterMode's FLOPs (2 per multiply-add)."""
    expected = get("ch04.mha_cost").reference()
    C, H, T = 512, 8, 1024
    for heads, key in ((H, "attention_macs_multi"), (1, "attention_macs_single")):
        layer = course_attn.MultiHeadAttention(C, heads)
        assert sum(p.numel() for p in layer.parameters()) == expected["params"]
        x = torch.randn(1, T, C)
        q, k, v = layer.project(x)
        with FlopCounterMode(display=False) as projections:
            layer.project(x)
            layer.out_proj(x)
        with FlopCounterMode(display=False) as attention:
            weights = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
            weights @ v
        assert projections.get_total_flops() == 2 * expected["projection_macs"]
        assert attention.get_total_flops() == 2 * expected[key]
        assert weights.numel() == expected["score_entries_multi" if heads == H else
                                           "score_entries_single"]


def test_mha_cost_mistakes():
    key = "ch04.mha_cost"

    def counting(**wrong):
        return lambda: {**mha_cost(), **wrong}

    C, H, T, D = 512, 8, 1024, 64
    params, multi = "(a) parameters of the 8-head layer", \
        "(c) multiply-adds of the scores and the weighted sum, 8 heads"
    assert_fails(key, counting(params=3 * C * C), params, hint="output projection W_O")
    assert_fails(key, counting(params=4 * H * C * C), params, hint="its own (C, C)")
    assert_fails(key, counting(params=4 * C * D), params, hint="one head only, (C, D)")
    assert_fails(key, counting(attention_macs_multi=2 * H * T * T * C), multi,
                 hint="run over all C channels")
    assert_fails(key, counting(attention_macs_multi=2 * T * T * D), multi,
                 hint="you counted one head only")
    assert_fails(key, counting(attention_macs_multi=H * T * T * D), multi,
                 hint="only the scores")
    assert_fails(key, counting(score_entries_multi=T * T),
                 "(e) entries of the attention weights, 8 heads", hint="own (T, T) table, H")
    assert_fails(key, counting(score_entries_single=T * C),
                 "(f) entries of the attention weights, one head", hint="does not grow")
    flops = counting(projection_macs=8 * T * C * C, attention_macs_multi=4 * T * T * C,
                     attention_macs_single=4 * T * T * C)
    assert_fails(key, flops, "(b) multiply-adds of the four projections, T tokens",
                 hint="2 FLOPs per multiply-add")
    # two wrong counts at once: each one's case says which
    two = results(key, counting(params=1, score_entries_single=2))
    assert [name for name, r in two.items() if not r.passed] == [
        params, "(f) entries of the attention weights, one head"]
    assert_fails(key, lambda: [1, 2, 3], params, message="should return a dict")


def test_mha_cost_never_shows_the_right_count():
    key = "ch04.mha_cost"
    right = get(key).reference()
    for result in run_exercise(get(key), lambda: {k: 7.0 for k in right}).results:
        assert not result.passed and "times the right count" in result.message
        assert not any(str(v) in result.message for v in right.values())


def test_mha_cost_may_not_call_the_package():
    def measured():
        layer = course_attn.MultiHeadAttention(512, 8)
        return {**mha_cost(), "params": sum(p.numel() for p in layer.parameters())}
    assert_banned("ch04.mha_cost", measured, "course_attn")
