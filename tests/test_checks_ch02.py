"""The chapter 2 checks: the reference solutions pass, typical mistakes fail the case meant for them."""

import math

import pytest
import torch

from course_attn.grading import ExerciseFailed, check, run_checks


def results(name, fn) -> dict[str, bool]:
    """Case name -> passed, for exercise ``name`` run on ``fn``."""
    return {r.name: r.passed for r in run_checks(name, fn).results}


def failed(name, fn) -> set[str]:
    return {case for case, passed in results(name, fn).items() if not passed}


# --- reference solutions (what solutions/02_scaled_dot_product.ipynb holds) -------------------

def attention_scores(q, k, scale=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return q @ k.transpose(-2, -1) * scale


def stable_softmax(x, dim=-1):
    m = x.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x - m)
    total = e.sum(dim=dim, keepdim=True)
    return e / torch.where(total == 0, torch.ones_like(total), total)


def attention(q, k, v, scale=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    return torch.softmax(scores, dim=-1) @ v


def stub(*args, **kwargs):
    raise NotImplementedError()


REFERENCE = {
    "ch02.attention_scores": attention_scores,
    "ch02.stable_softmax": stable_softmax,
    "ch02.attention": attention,
}


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_reference_passes_every_case(name):
    outcome = results(name, REFERENCE[name])
    assert 4 <= len(outcome) <= 8
    assert all(outcome.values()), outcome
    check(name, REFERENCE[name])


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_stub_fails_every_case(name):
    outcome = results(name, stub)
    assert outcome and not any(outcome.values()), outcome
    with pytest.raises(ExerciseFailed):
        check(name, stub)


# --- attention_scores ---------------------------------------------------------------------------

def test_scores_scaled_by_sqrt_of_length_fails_the_head_dim_case():
    def by_length(q, k, scale=None):
        scale = 1.0 / math.sqrt(k.shape[-2]) if scale is None else scale
        return q @ k.transpose(-2, -1) * scale
    assert "default scale is 1/sqrt(D), D=16, T=4" in failed("ch02.attention_scores", by_length)


def test_scores_scaled_by_one_over_d_fails():
    def by_d(q, k, scale=None):
        scale = 1.0 / q.shape[-1] if scale is None else scale
        return q @ k.transpose(-2, -1) * scale
    assert "B=2, H=3, Tq=Tk=5, D=8, float32" in failed("ch02.attention_scores", by_d)


def test_scores_ignoring_scale_fails_the_custom_scale_case():
    def ignores_scale(q, k, scale=None):
        return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    assert failed("ch02.attention_scores", ignores_scale) == {"custom scale=0.5"}


def test_scores_with_k_dot_T_fails_the_rectangular_case():
    def all_axes_transposed(q, k, scale=None):
        # k.mT would be right; permuting every axis is the mistake
        return q @ k.permute(*reversed(range(k.dim()))) / math.sqrt(q.shape[-1])
    assert "Tq=4 != Tk=9: shape (B, H, Tq, Tk)" in failed("ch02.attention_scores",
                                                            all_axes_transposed)


def test_scores_cast_to_float32_fails_the_float64_case():
    def casts(q, k, scale=None):
        return attention_scores(q.float(), k.float(), scale)
    assert failed("ch02.attention_scores", casts) == {"float64 in, float64 out"}


def test_scores_written_for_four_axes_only_fails_the_rank3_case():
    def four_axes(q, k, scale=None):
        scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
        return torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    assert failed("ch02.attention_scores", four_axes) == {"no head axis: (B, Tq, D), (B, Tk, D)"}


# --- stable_softmax -----------------------------------------------------------------------------

def test_naive_softmax_fails_the_large_input_cases():
    def naive(x, dim=-1):
        e = torch.exp(x)
        return e / e.sum(dim=dim, keepdim=True)
    wrong = failed("ch02.stable_softmax", naive)
    assert {"large inputs ~ +1000 (float32)", "large negative inputs ~ -1000 (float64)",
            "a row that is all -inf gives zeros, not NaN"} <= wrong
    assert "random (4, 6), over the last axis" not in wrong


def test_max_subtraction_without_guard_fails_only_the_all_minus_inf_row():
    def unguarded(x, dim=-1):
        e = torch.exp(x - x.amax(dim=dim, keepdim=True))
        return e / e.sum(dim=dim, keepdim=True)
    assert failed("ch02.stable_softmax", unguarded) == {"a row that is all -inf gives zeros, not NaN"}


def test_torch_softmax_fails_only_the_all_minus_inf_row():
    assert failed("ch02.stable_softmax", torch.softmax) == {
        "a row that is all -inf gives zeros, not NaN"}


def test_softmax_over_the_last_axis_always_fails_the_dim_case():
    def last_axis(x, dim=-1):
        return stable_softmax(x, dim=-1)
    assert failed("ch02.stable_softmax", last_axis) == {"(3, 5, 4) over dim=1"}


def test_softmax_max_without_keepdim_fails():
    def no_keepdim(x, dim=-1):
        e = torch.exp(x - x.amax(dim=dim))
        return e / e.sum(dim=dim)
    assert "random (4, 6), over the last axis" in failed("ch02.stable_softmax", no_keepdim)


# --- attention ----------------------------------------------------------------------------------

def test_attention_softmax_over_queries_fails():
    def over_queries(q, k, v, scale=None):
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        return torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-2) @ v
    assert "B=2, H=3, Tq=Tk=6, D=8, float32" in failed("ch02.attention", over_queries)


def test_attention_scaled_by_value_dim_fails_the_dv_case():
    def by_dv(q, k, v, scale=None):
        scale = 1.0 / math.sqrt(v.shape[-1]) if scale is None else scale
        return torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v
    assert failed("ch02.attention", by_dv) == {"D=8 != Dv=3"}


def test_attention_with_naive_softmax_fails_the_large_scores_case():
    def naive(q, k, v, scale=None):
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        e = torch.exp(q @ k.transpose(-2, -1) * scale)
        return e / e.sum(dim=-1, keepdim=True) @ v
    assert failed("ch02.attention", naive) == {"large scores (|q kᵀ| ~ 1000s, float64)"}


def test_attention_without_scaling_fails():
    def unscaled(q, k, v, scale=None):
        return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
    wrong = failed("ch02.attention", unscaled)
    assert "B=2, H=3, Tq=Tk=6, D=8, float32" in wrong
    assert "custom scale=0.3" in wrong


def test_attention_returning_weights_fails_on_shape():
    def weights_only(q, k, v, scale=None):
        return torch.softmax(attention_scores(q, k, scale), dim=-1)
    assert "D=8 != Dv=3" in failed("ch02.attention", weights_only)
