"""Chapter 3 checks: the reference solutions pass; typical mistakes fail the case meant for them."""

from pathlib import Path

import nbformat
import pytest
import torch

import course_attn as ca
from course_attn.grading import ExerciseFailed, check, run_checks

SOLUTIONS = Path(__file__).resolve().parents[1] / "solutions" / "03_masking.ipynb"
NAMES = ["ch03.causal_mask", "ch03.padding_mask", "ch03.masked_attention"]


def results(name, fn) -> dict[str, bool]:
    """Case name -> passed, for exercise ``name`` run on ``fn``."""
    return {r.name: r.passed for r in run_checks(name, fn).results}


def failed(name, fn) -> set[str]:
    return {case for case, passed in results(name, fn).items() if not passed}


def solution_functions() -> dict[str, object]:
    """The functions that solutions/03_masking.ipynb defines, by exercise name."""
    notebook = nbformat.read(SOLUTIONS, as_version=4)
    namespace: dict = {}
    for cell in notebook.cells:
        meta = cell.metadata.get("nbgrader", {})
        is_setup = meta.get("grade_id") == "ch03-setup"
        if cell.cell_type == "code" and (meta.get("solution") or is_setup):
            exec(compile(cell.source, str(SOLUTIONS), "exec"), namespace)
    return {name: namespace[name.split(".", 1)[1]] for name in NAMES}


PACKAGE = {
    "ch03.causal_mask": ca.causal_mask,
    "ch03.padding_mask": ca.padding_mask,
    "ch03.masked_attention": lambda q, k, v, mask: ca.scaled_dot_product_attention(
        q, k, v, attn_mask=mask),
}


def stub(*args, **kwargs):
    raise NotImplementedError()


@pytest.mark.parametrize("name", NAMES)
def test_package_reference_passes_every_case(name):
    outcome = results(name, PACKAGE[name])
    assert 4 <= len(outcome) <= 8
    assert all(outcome.values()), outcome


@pytest.mark.parametrize("name", NAMES)
def test_notebook_solution_passes_every_case(name):
    solution = solution_functions()[name]
    outcome = results(name, solution)
    assert all(outcome.values()), outcome
    check(name, solution)


@pytest.mark.parametrize("name", NAMES)
def test_stub_fails_every_case(name):
    outcome = results(name, stub)
    assert outcome and not any(outcome.values()), outcome
    with pytest.raises(ExerciseFailed):
        check(name, stub)


def test_solution_notebook_points_add_up_to_ten():
    notebook = nbformat.read(SOLUTIONS, as_version=4)
    graded = [c.metadata["nbgrader"] for c in notebook.cells
              if c.metadata.get("nbgrader", {}).get("grade")]
    assert [g["grade_id"] for g in graded] == [n.replace(".", "-") for n in NAMES]
    assert sum(g["points"] for g in graded) == 10


# --- causal_mask --------------------------------------------------------------------------------

def test_top_left_causal_mask_fails_the_unequal_lengths_cases():
    def top_left(tq, tk):
        return torch.ones(tq, tk, dtype=torch.bool).tril()
    wrong = failed("ch03.causal_mask", top_left)
    assert "fewer queries than keys, Tq=3, Tk=6" in wrong
    assert "one new query, many cached keys, Tq=1, Tk=5" in wrong
    assert "more queries than keys, Tq=5, Tk=3" in wrong
    assert "square, Tq=Tk=4" not in wrong


def test_mask_without_the_diagonal_fails_the_square_case():
    def strict(tq, tk):
        return torch.ones(tq, tk, dtype=torch.bool).tril(diagonal=tk - tq - 1)
    assert {"square, Tq=Tk=4", "Tq=Tk=1"} <= failed("ch03.causal_mask", strict)


def test_float_mask_fails_the_dtype_case():
    def as_float(tq, tk):
        return torch.ones(tq, tk).tril(diagonal=tk - tq)
    assert "returns a bool tensor of shape (Tq, Tk)" in failed("ch03.causal_mask", as_float)


# --- padding_mask -------------------------------------------------------------------------------

def test_off_by_one_padding_mask_fails():
    def inclusive(lengths, t):
        return (torch.arange(t)[None, :] <= lengths[:, None])[:, None, None, :]
    wrong = failed("ch03.padding_mask", inclusive)
    assert {"lengths [3, 1, 4], T=5", "a length of 0 and a length of T"} <= wrong


def test_padding_mask_without_broadcast_axes_fails_the_shape_case():
    def flat(lengths, t):
        return torch.arange(t)[None, :] < lengths[:, None]
    assert "returns bool of shape (B, 1, 1, T)" in failed("ch03.padding_mask", flat)


def test_padding_mask_that_marks_the_padding_fails():
    def inverted(lengths, t):
        return (torch.arange(t)[None, :] >= lengths[:, None])[:, None, None, :]
    assert "lengths [3, 1, 4], T=5" in failed("ch03.padding_mask", inverted)


# --- masked_attention ---------------------------------------------------------------------------

def _scores(q, k):
    return q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5


def test_plain_softmax_fails_only_the_fully_masked_cases():
    def nan_on_dead_rows(q, k, v, mask):
        return torch.softmax(_scores(q, k).masked_fill(~mask, float("-inf")), dim=-1) @ v
    wrong = failed("ch03.masked_attention", nan_on_dead_rows)
    assert wrong == {"a sequence of length 0: fully masked rows give zeros, not NaN",
                     "Tq=6 != Tk=4, Dv=3, random mask with dead rows"}


def test_softmax_without_max_subtraction_fails_the_large_scores_case():
    def overflowing(q, k, v, mask):
        e = torch.exp(_scores(q, k)) * mask
        total = e.sum(-1, keepdim=True)
        return e / torch.where(total == 0, torch.ones_like(total), total) @ v
    wrong = failed("ch03.masked_attention", overflowing)
    assert "large scores (|q kᵀ/√D| in the hundreds)" in wrong
    assert "causal (T, T) mask, B=2, H=3, T=5, D=8" not in wrong


def test_inverted_mask_fails():
    def inverted(q, k, v, mask):
        weights = torch.softmax(_scores(q, k).masked_fill(mask, float("-inf")), dim=-1)
        return weights.nan_to_num(0.0) @ v
    assert "causal (T, T) mask, B=2, H=3, T=5, D=8" in failed("ch03.masked_attention", inverted)


def test_unscaled_scores_fail():
    def unscaled(q, k, v, mask):
        return ca.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    assert "causal (T, T) mask, B=2, H=3, T=5, D=8" in failed("ch03.masked_attention", unscaled)


def test_computing_in_float32_fails_the_float64_case():
    def float32_only(q, k, v, mask):
        return ca.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    wrong = failed("ch03.masked_attention", float32_only)
    assert wrong == {"float64 in, float64 out, causal & padding"}


def test_finfo_min_fill_fails_the_fully_masked_cases():
    def finite_fill(q, k, v, mask):
        low = torch.finfo(q.dtype).min
        return torch.softmax(_scores(q, k).masked_fill(~mask, low), dim=-1) @ v
    wrong = failed("ch03.masked_attention", finite_fill)
    assert "a sequence of length 0: fully masked rows give zeros, not NaN" in wrong
    assert "causal (T, T) mask, B=2, H=3, T=5, D=8" not in wrong
