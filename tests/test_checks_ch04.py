"""Chapter 4's exercises: each typical mistake fails the case meant for it with its own hint, and a
banned call is reported by name. What every exercise must satisfy is tested once, for all
chapters, in test_exercises_conformance.py.

The wrong solutions below are written as a student would write them; each test names the case
it must fail and a fragment of the hint it must get.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import course_attn
import course_attn.multihead
from course_attn.grading import get, run_exercise
from course_attn.grading.exercise import hidden_cases

from check_support import assert_banned, assert_fails, assert_fails_unnamed, results


# --- solutions as in solutions/04_multi_head.ipynb ---------------------------------------------

def split_heads(x, n_heads):
    b, t, c = x.shape
    return x.view(b, t, n_heads, c // n_heads).transpose(1, 2)


def merge_heads(x):
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def split_qkv(qkv, n_heads):
    b, t, three_c = qkv.shape
    q, k, v = qkv.view(b, t, n_heads, 3, three_c // (3 * n_heads)).unbind(dim=3)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def multi_head_attention(x, w_q, w_k, w_v, w_o, n_heads, causal):
    q, k, v = (split_heads(x @ w.T, n_heads) for w in (w_q, w_k, w_v))
    t, d = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return merge_heads(torch.softmax(scores, dim=-1) @ v) @ w_o.T


def mha_cost(C, H, T):
    D = C // H
    return {"params": 4 * C * C, "projection_macs": 4 * T * C * C,
            "attention_macs_multi": H * 2 * T * T * D, "attention_macs_single": 2 * T * T * C,
            "score_entries_multi": H * T * T, "score_entries_single": T * T}


def leaky_self_attention(x, w_qkv, w_o, n_heads):
    """The notebook's given layer, bug included (its cell ch04-causal_self_attention-given)."""
    B, T, C = x.shape
    D = C // n_heads
    q, k, v = torch.einsum("btc,fc->btf", x, w_qkv).split(C, dim=-1)
    q, k, v = (z.reshape(B, T, n_heads, D) for z in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    out = torch.einsum("bhqk,bkhd->bhqd", weights, v)
    return out.reshape(B, T, C) @ w_o.T


def causal_self_attention(x, w_qkv, w_o, n_heads):
    B, T, C = x.shape
    D = C // n_heads
    q, k, v = torch.einsum("btc,fc->btf", x, w_qkv).split(C, dim=-1)
    q, k, v = (z.reshape(B, T, n_heads, D) for z in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", weights, v)
    return out.reshape(B, T, C) @ w_o.T


def leak_pattern(T, H, D, seed):
    g = torch.Generator().manual_seed(seed)
    C = H * D
    x = torch.randn(1, T, C, generator=g, dtype=torch.float64)
    w_qkv = torch.randn(3 * C, C, generator=g, dtype=torch.float64) / math.sqrt(C)
    w_o = torch.randn(C, C, generator=g, dtype=torch.float64) / math.sqrt(C)
    before = leaky_self_attention(x, w_qkv, w_o, H)
    moved = torch.zeros(T, T, dtype=torch.bool)
    for s in range(T):
        changed = x.clone()
        changed[0, s] = torch.randn(C, generator=g, dtype=torch.float64)
        moved[:, s] = (leaky_self_attention(changed, w_qkv, w_o, H) != before)[0].any(dim=-1)
    return moved


@pytest.mark.parametrize("key, fn", [
    ("ch04.split_heads", split_heads), ("ch04.merge_heads", merge_heads),
    ("ch04.multi_head_attention", multi_head_attention), ("ch04.mha_cost", mha_cost),
    ("ch04.causal_self_attention", causal_self_attention), ("ch04.leak_pattern", leak_pattern),
    ("ch04.split_qkv", split_qkv)])
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
    # only the queries transposed wrongly: no typical mistake, so no hint, only how far off
    def half_transposed(x, w_q, w_k, w_v, w_o, n_heads, causal):
        return multi_head_attention(x, w_q.T, w_k, w_v, w_o, n_heads, causal)
    assert_fails_unnamed(key, half_transposed, first, message="largest error")


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

def counted_by_pytorch(C, H, T):
    """The six counts, measured: the parameters of course_attn's layer, and FlopCounterMode's
    FLOPs (2 per multiply-add) of the products, on meta tensors (shapes only, so that a long
    sequence costs nothing) in the (1, H, T, D) layout of the chapter."""
    with torch.device("meta"):
        layer = course_attn.MultiHeadAttention(C, H)
    counts = {"params": sum(p.numel() for p in layer.parameters())}
    x = torch.empty(1, T, C, device="meta")
    with FlopCounterMode(display=False) as projections:
        q, k, v = layer.project(x)
        layer.out_proj(x)
    counts["projection_macs"] = projections.get_total_flops() // 2
    for heads, which in ((H, "multi"), (1, "single")):
        q, k, v = (torch.empty(1, heads, T, C // heads, device="meta") for _ in range(3))
        with FlopCounterMode(display=False) as attention:
            weights = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
            weights @ v
        counts[f"attention_macs_{which}"] = attention.get_total_flops() // 2
        counts[f"score_entries_{which}"] = weights.numel()
    return counts


def test_the_cost_reference_is_what_pytorch_counts():
    """On the public sizes and the hidden sizes of several seeds, the reference's counts are the
    ones PyTorch measures."""
    exercise = get("ch04.mha_cost")
    cases = exercise.public_cases() + [c for seed in range(5)
                                       for c in hidden_cases("ch04.mha_cost", seed)]
    sizes = {tuple(sorted(c.kwargs.items())) for c in cases}
    assert len(sizes) >= 2 + 3 * 5 - 2   # the public sets and (nearly all) fresh hidden ones
    for size in sizes:
        assert exercise.reference(**dict(size)) == counted_by_pytorch(**dict(size)), size


def test_mha_cost_cases_are_a_function_of_the_sizes():
    exercise = get("ch04.mha_cost")
    public = {tuple(sorted(c.kwargs.items())) for c in exercise.public_cases()}
    assert public == {(("C", 512), ("H", 8), ("T", 1024)), (("C", 768), ("H", 12), ("T", 50))}
    for seed in range(20):
        cases = hidden_cases("ch04.mha_cost", seed)
        assert len(cases) == 3 * 6 and all(c.part for c in cases)
        for case in cases:
            C, H, T = case.kwargs["C"], case.kwargs["H"], case.kwargs["T"]
            assert H >= 2 and C % H == 0 and T not in (C // H, C), case.name


def test_mha_cost_mistakes():
    key = "ch04.mha_cost"

    def counting(**wrong):
        """mha_cost with these counts replaced, each a function of C, H, T and D."""
        return lambda C, H, T: {**mha_cost(C, H, T), **{
            k: rule(C, H, T, C // H) for k, rule in wrong.items()}}

    size = " (C=512, H=8, T=1024)"
    params, multi = "(a) parameters of the H-head layer" + size, \
        "(c) multiply-adds of the scores and the weighted sum, H heads" + size
    assert_fails(key, counting(params=lambda C, H, T, D: 3 * C * C), params,
                 hint="output projection W_O")
    assert_fails(key, counting(params=lambda C, H, T, D: 4 * H * C * C), params,
                 hint="its own (C, C)")
    assert_fails(key, counting(params=lambda C, H, T, D: 4 * C * D), params,
                 hint="one head only, (C, D)")
    assert_fails(key, counting(attention_macs_multi=lambda C, H, T, D: 2 * H * T * T * C), multi,
                 hint="run over all C channels")
    assert_fails(key, counting(attention_macs_multi=lambda C, H, T, D: 2 * T * T * D), multi,
                 hint="you counted one head only")
    assert_fails(key, counting(attention_macs_multi=lambda C, H, T, D: H * T * T * D), multi,
                 hint="only the scores")
    assert_fails(key, counting(score_entries_multi=lambda C, H, T, D: T * T),
                 "(e) entries of the attention weights, H heads" + size,
                 hint="one table of weights for all the heads")
    assert_fails(key, counting(score_entries_single=lambda C, H, T, D: T * C),
                 "(f) entries of the attention weights, one head" + size, hint="does not grow")
    flops = counting(projection_macs=lambda C, H, T, D: 8 * T * C * C,
                     attention_macs_multi=lambda C, H, T, D: 4 * T * T * C,
                     attention_macs_single=lambda C, H, T, D: 4 * T * T * C)
    assert_fails(key, flops, "(b) multiply-adds of the four projections, T tokens" + size,
                 hint="2 FLOPs per multiply-add")
    # the other public set: a short sequence, T < D, where (T, D) tables show too
    assert_fails(key, counting(score_entries_multi=lambda C, H, T, D: H * T * D),
                 "(e) entries of the attention weights, H heads (C=768, H=12, T=50)",
                 hint="does not grow")
    # two wrong counts at once: each one's case says which
    two = results(key, counting(params=lambda C, H, T, D: 1,
                                score_entries_single=lambda C, H, T, D: 2))
    assert sorted(name for name, r in two.items() if not r.passed) == sorted(
        f"{question}{sizes}" for question in ("(a) parameters of the H-head layer",
                                              "(f) entries of the attention weights, one head")
        for sizes in (size, " (C=768, H=12, T=50)"))
    assert_fails(key, lambda C, H, T: [1, 2, 3], params, message="should return a dict")


def test_mha_cost_says_too_large_or_too_small_never_the_count_nor_a_factor():
    key = "ch04.mha_cost"
    for value, direction in ((7, "too small"), (10 ** 30, "too large")):
        for result in run_exercise(get(key), lambda C, H, T: {
                k: value for k in mha_cost(C, H, T)}).results:
            assert not result.passed and result.message.endswith(f"is {direction}")
            assert "times" not in result.message
            right = mha_cost(512, 8, 1024) | mha_cost(768, 12, 50)
            assert not any(str(v) in result.message for v in right.values())


def test_pasting_the_public_counts_fails_the_hidden_cases_of_every_seed():
    """A notebook that worked the public counts out once (in another cell, with the package)
    and pasted them as constants gets nothing on the sizes the grader draws."""
    exercise = get("ch04.mha_cost")
    for public in (dict(C=512, H=8, T=1024), dict(C=768, H=12, T=50)):
        pasted = mha_cost(**public)

        def constant(**sizes):
            return dict(pasted)
        assert run_exercise(exercise, constant, watch_banned=False).results
        for seed in range(20):
            judgement = run_exercise(exercise, constant, hidden_cases("ch04.mha_cost", seed))
            assert not any(r.passed for r in judgement.results), seed


def test_mha_cost_may_not_call_the_package():
    def measured(C, H, T):
        layer = course_attn.MultiHeadAttention(C, H)
        return {**mha_cost(C, H, T), "params": sum(p.numel() for p in layer.parameters())}
    assert_banned("ch04.mha_cost", measured, "course_attn")


def test_mha_cost_names_each_wrong_count_of_a_two_part_mistake_on_its_own():
    """Mistakes are matched part by part: a student who left W_O out of the parameters only
    (not of the multiply-adds) is named by the one declaration of that mistake."""
    key, size = "ch04.mha_cost", " (C=512, H=8, T=1024)"
    only_params = lambda C, H, T: {**mha_cost(C, H, T), "params": 3 * C * C}  # noqa: E731
    assert_fails(key, only_params, "(a) parameters of the H-head layer" + size,
                 hint="output projection W_O")
    assert results(key, only_params)[
        "(b) multiply-adds of the four projections, T tokens" + size].passed
    # two mistakes in two parts: each part's case names its own
    both = lambda C, H, T: {**mha_cost(C, H, T), "params": 4 * H * C * C,  # noqa: E731
                            "score_entries_multi": T * T}
    found = results(key, both)
    assert "its own (C, C)" in found["(a) parameters of the H-head layer" + size].hint
    assert "one table of weights" in found[
        "(e) entries of the attention weights, H heads" + size].hint
    hints = [m.hint for m in get(key).mistakes]
    assert len(hints) == len(set(hints))       # one declaration per mistake


# --- causal_self_attention (debug) ------------------------------------------------------------

def test_the_given_leaky_layer_is_the_declared_bug_and_leaks_the_future():
    key, first = "ch04.causal_self_attention", "B=2, T=6, C=12, H=3"
    assert_fails(key, leaky_self_attention, first, hint="still lets an output read later tokens")
    found = results(key, leaky_self_attention)
    # where the bug cannot show (one head, one token), the given layer is right
    assert found["one head (H=1): the bug cannot show"].passed
    assert found["T=1: one token"].passed
    # the symptom: changing the last token moves earlier outputs
    case = next(c for c in get(key).public_cases() if c.name == first)
    x, w_qkv, w_o, h = case.args
    changed = x.clone()
    changed[:, -1] += 1.0
    moved = (leaky_self_attention(changed, w_qkv, w_o, h)
             != leaky_self_attention(x, w_qkv, w_o, h)).any(-1).any(0)
    assert moved[:-1].any()
    fixed = (causal_self_attention(changed, w_qkv, w_o, h)
             != causal_self_attention(x, w_qkv, w_o, h)).any(-1).any(0)
    assert fixed.tolist() == [False] * (x.shape[1] - 1) + [True]


def test_causal_self_attention_wrong_repairs():
    key, first = "ch04.causal_self_attention", "B=2, T=6, C=12, H=3"

    def strided(x, w_qkv, w_o, n_heads):
        B, T, C = x.shape
        D = C // n_heads
        q, k, v = (z.reshape(B, T, n_heads, D).transpose(1, 2)
                   for z in (x @ w_qkv.T).split(C, dim=-1))
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        w = torch.softmax((q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(~mask, -math.inf),
                          dim=-1)
        return (w @ v).permute(0, 2, 3, 1).reshape(B, T, C) @ w_o.T
    assert_fails(key, strided, first, hint="interleave the heads")

    def diagonal_masked(x, w_qkv, w_o, n_heads):
        B, T, C = x.shape
        D = C // n_heads
        q, k, v = torch.einsum("btc,fc->btf", x, w_qkv).split(C, dim=-1)
        q, k, v = (z.reshape(B, T, n_heads, D) for z in (q, k, v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
        future = torch.ones(T, T, dtype=torch.bool).triu(0)    # "fixed" the mask instead
        weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        return torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(B, T, C) @ w_o.T
    assert_fails(key, diagonal_masked, first, hint="the mask was right")

    # a transpose of the wrong axes: the shape is wrong, the case's hint says what to look at
    def wrong_axes(x, w_qkv, w_o, n_heads):
        out = causal_self_attention(x, w_qkv, w_o, n_heads)
        return out.transpose(0, 1)
    assert_fails(key, wrong_axes, first, message="shape")


def test_causal_self_attention_is_the_packages_layer_with_a_fused_projection():
    exercise = get("ch04.causal_self_attention")
    for case in exercise.public_cases():
        x, w_qkv, w_o, h = case.args
        c = x.shape[-1]
        layer = course_attn.MultiHeadAttention(c, h).to(x.dtype)
        with torch.no_grad():
            for proj, w in zip((layer.q_proj, layer.k_proj, layer.v_proj), w_qkv.chunk(3)):
                proj.weight.copy_(w)
            layer.out_proj.weight.copy_(w_o)
            torch.testing.assert_close(layer(x, is_causal=True), exercise.expected(case))


def test_causal_self_attention_may_not_call_a_library_attention():
    def with_sdpa(x, w_qkv, w_o, n_heads):
        q, k, v = (split_heads(z, n_heads) for z in (x @ w_qkv.T).chunk(3, dim=-1))
        return merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True)) @ w_o.T
    assert_banned("ch04.causal_self_attention", with_sdpa,
                  "torch.nn.functional.scaled_dot_product_attention")


# --- leak_pattern (measure) -------------------------------------------------------------------

def test_the_leak_pattern_reference_is_the_formula_and_the_same_for_every_seed():
    from course_attn.grading.ch04 import leak_pattern_formula, leak_pattern_reference
    exercise = get("ch04.leak_pattern")
    cases = exercise.public_cases() + [c for seed in range(5)
                                       for c in hidden_cases("ch04.leak_pattern", seed)]
    for case in cases:
        T, H, D, seed = case.args
        expected = leak_pattern_formula(T, H)
        for other in (seed, seed + 1, seed + 12345):
            assert torch.equal(leak_pattern_reference(T, H, D, other), expected), case.name
        assert torch.equal(leak_pattern(T, H, D, seed + 7), expected), case.name
    # what the chapter says: row 0 reads later tokens as soon as H > 1, every token when H >= T
    assert leak_pattern_formula(6, 3)[0].tolist() == [True, True, True, False, False, False]
    assert leak_pattern_formula(3, 4).all()


def test_leak_pattern_mistakes():
    key, first = "ch04.leak_pattern", "T=6, H=3, D=2, seed 0"
    assert_fails(key, lambda T, H, D, seed: leak_pattern(T, H, D, seed).T, first,
                 hint="transposed")

    def repaired_layer(T, H, D, seed):      # measured the repaired layer, not the given one
        g = torch.Generator().manual_seed(seed)
        C = H * D
        x = torch.randn(1, T, C, generator=g, dtype=torch.float64)
        w_qkv = torch.randn(3 * C, C, generator=g, dtype=torch.float64)
        w_o = torch.randn(C, C, generator=g, dtype=torch.float64)
        before = causal_self_attention(x, w_qkv, w_o, H)
        moved = torch.zeros(T, T, dtype=torch.bool)
        for s in range(T):
            changed = x.clone()
            changed[0, s] = 0.0
            moved[:, s] = (causal_self_attention(changed, w_qkv, w_o, H) != before)[0].any(-1)
        return moved
    assert_fails(key, repaired_layer, first, hint="pattern of a causal layer")
    # a table of floats, not bools
    assert_fails(key, lambda T, H, D, seed: leak_pattern(T, H, D, seed).double(), first,
                 message="dtype")


def test_leak_pattern_with_weights_scaled_up_loses_points_on_every_seed():
    """Weights multiplied by sqrt(C) instead of divided (a mutant of the reference, issue 42):
    on a wide layer the softmax saturates, a token's weight falls below one bit of the output,
    and some moves are not seen. The wide-layer regime is drawn on every grading."""
    from course_attn.grading.check import grade_here

    def scaled_up(T, H, D, seed):
        g = torch.Generator().manual_seed(seed)
        C = H * D
        x = torch.randn(1, T, C, generator=g, dtype=torch.float64)
        w_qkv = torch.randn(3 * C, C, generator=g, dtype=torch.float64) * math.sqrt(C)
        w_o = torch.randn(C, C, generator=g, dtype=torch.float64) * math.sqrt(C)
        before = leaky_self_attention(x, w_qkv, w_o, H)
        moved = torch.zeros(T, T, dtype=torch.bool)
        for s in range(T):
            changed = x.clone()
            changed[0, s] = torch.randn(C, generator=g, dtype=torch.float64)
            moved[:, s] = (leaky_self_attention(changed, w_qkv, w_o, H) != before)[0].any(-1)
        return moved
    exercise = get("ch04.leak_pattern")
    for seed in range(20):
        judgement = grade_here(exercise, scaled_up, seed, watch_banned=False)
        assert judgement.credit() < 1, seed
        assert not all(r.passed for r in judgement.results if "a wide layer" in
                       " ".join(r.regimes)), seed


def test_leak_pattern_may_not_call_the_package():
    from course_attn.grading.ch04 import leak_pattern_reference
    assert_banned("ch04.leak_pattern", leak_pattern_reference, "course_attn")


# --- split_qkv (implement) ---------------------------------------------------------------------

def test_split_qkv_is_gpt_neox_layout():
    """The reference cuts the fused output as Hugging Face's GPTNeoXAttention does: a view to
    (B, T, H, 3D), then the three D-wide slices of every head."""
    exercise = get("ch04.split_qkv")
    for case in exercise.public_cases():
        qkv, h = case.args
        b, t, three_c = qkv.shape
        d = three_c // (3 * h)
        grouped = qkv.view(b, t, h, 3 * d)
        neox = (grouped[..., :d].permute(0, 2, 1, 3), grouped[..., d:2 * d].permute(0, 2, 1, 3),
                grouped[..., 2 * d:].permute(0, 2, 1, 3))
        for got, want in zip(exercise.expected(case), neox):
            assert torch.equal(got, want), case.name


def test_split_qkv_mistakes():
    key, first = "ch04.split_qkv", "B=2, T=5, H=3, D=4 (3C=36)"
    assert_fails(key, lambda qkv, h: tuple(split_heads(z, h) for z in qkv.chunk(3, dim=-1)),
                 first, hint="GPT-2's layout")

    def every_third(qkv, h):
        b, t, c3 = qkv.shape
        g = qkv.view(b, t, h, c3 // (3 * h), 3)
        return tuple(g[..., j].transpose(1, 2) for j in range(3))
    assert_fails(key, every_third, first, hint="every third channel")
    assert_fails(key, lambda qkv, h: qkv.view(*qkv.shape[:2], h, 3, -1).unbind(3), first,
                 hint="heads must come before time", message="shape")
    # a (3, H) view (three blocks of heads) is GPT-2's layout again
    assert_fails(key, lambda qkv, h: tuple(z.transpose(1, 2) for z in qkv.view(
        *qkv.shape[:2], 3, h, -1).unbind(2)), first, hint="GPT-2's layout")
    assert_fails(key, lambda qkv, h: split_qkv(qkv, h)[0], first,
                 message="should return a tuple")


def test_split_qkv_may_not_call_the_package():
    from course_attn.grading.ch04 import split_qkv_reference
    assert_banned("ch04.split_qkv", split_qkv_reference, "course_attn")
