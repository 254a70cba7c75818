"""Chapter 5's exercises: each typical mistake fails the case meant for it with its own hint, and a
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

import course_attn
import course_attn.rope
from course_attn.grading import get, run_exercise
from course_attn.grading.exercise import hidden_cases, load_hidden

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from check_support import assert_banned, assert_fails, results  # noqa: E402

load_hidden(Path(__file__).resolve().parents[1] / "solutions")


# --- solutions as in solutions/05_rope.ipynb ------------------------------------------------------

def rope_angles(positions, head_dim, base=10000.0):
    i = torch.arange(head_dim // 2, dtype=torch.float64, device=positions.device)
    theta = base ** (-2 * i / head_dim)
    return (positions.to(torch.float64)[:, None] * theta[None, :]).float()


def apply_rope(x, base=10000.0):
    t, d = x.shape[-2], x.shape[-1]
    angles = rope_angles(torch.arange(t, device=x.device), d, base)
    acc = torch.promote_types(x.dtype, torch.float32)
    cos, sin = angles.cos().to(acc), angles.sin().to(acc)
    x1, x2 = x[..., : d // 2].to(acc), x[..., d // 2:].to(acc)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def pairing_permutation(head_dim):
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def rope_predictions():
    return {"slowest_wavelength": 2 * math.pi * 10000 ** (62 / 64), "score": math.sin(2),
            "same_score_as_5_2": [[3, 0], [10, 7], [100, 97]]}


@pytest.mark.parametrize("key, fn", [
    ("ch05.rope_angles", rope_angles), ("ch05.apply_rope", apply_rope),
    ("ch05.pairing_permutation", pairing_permutation),
    ("ch05.rope_predictions", rope_predictions)])
def test_the_notebooks_solutions_pass_with_the_watch_on(key, fn):
    for cases in [None] + [hidden_cases(key, seed) or None for seed in range(5)]:
        judgement = run_exercise(get(key), fn, cases)
        assert judgement.passed, (judgement.banned, [(r.name, r.message) for r in
                                                     judgement.results if not r.passed])


def test_a_float32_computation_of_the_angles_passes_too():
    """theta computed in float32, as most code does: within the checks' tolerance."""
    def float32_angles(positions, head_dim, base=10000.0):
        theta = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
        return positions.float()[:, None] * theta[None, :]
    assert run_exercise(get("ch05.rope_angles"), float32_angles).passed
    for seed in range(5):
        assert run_exercise(get("ch05.rope_angles"), float32_angles,
                            hidden_cases("ch05.rope_angles", seed)).passed


# --- rope_angles -------------------------------------------------------------------------------

def test_rope_angles_mistakes():
    key, first = "ch05.rope_angles", "positions 0..5, D=8"

    def with_theta(theta_of):
        def fn(positions, head_dim, base=10000.0):
            i = torch.arange(head_dim // 2, dtype=torch.float64)
            return (positions.double()[:, None] * theta_of(i, head_dim, base)[None, :]).float()
        return fn

    assert_fails(key, with_theta(lambda i, d, base: base ** (-i / d)), first,
                 hint="a 2 in the exponent")
    assert_fails(key, with_theta(lambda i, d, base: base ** (2 * i / d)), first,
                 hint="grow with i")
    assert_fails(key, with_theta(lambda i, d, base: base ** (-2 * (i + 1) / d)),
                 "D=2: one pair, θ₀ = 1", hint="counted from 1")
    assert_fails(key, lambda positions, d, base=10000.0: rope_angles(positions + 1, d, base),
                 "one position, 0, D=4", hint="off by one position")
    assert_fails(key, lambda positions, d, base=10000.0: rope_angles(positions, d, base).T,
                 first, hint="positions as columns", message="shape")
    assert_fails(key, lambda positions, d, base=10000.0: rope_angles(positions, d, base).T,
                 "positions 0..3, D=8 (a square result)", hint="positions as columns")
    assert_fails(key, lambda positions, d, base=10000.0: rope_angles(torch.arange(len(positions)),
                                                                      d, base),
                 "positions 100..104 (as a KV cache passes them), D=16",
                 hint="use the positions you are given")
    assert_fails(key, lambda positions, d, base=10000.0: rope_angles(positions, d),
                 "base=500000, D=64, positions [0, 7, 31]", hint="use the base")
    assert_fails(key, lambda positions, d, base=10000.0: rope_angles(positions, d, base).double(),
                 first, message="dtype")


def test_rope_angles_may_not_call_the_package():
    def with_the_package(positions, head_dim, base=10000.0):
        theta = course_attn.rope.rope_frequencies(head_dim, base)
        return positions.float()[:, None] * theta[None, :]
    assert_banned("ch05.rope_angles", with_the_package, "course_attn")


# --- apply_rope: the three mistakes the issue names, each with its own hint ---------------------

def _halves(x):
    d = x.shape[-1]
    return x[..., : d // 2], x[..., d // 2:]


def test_apply_rope_rotating_by_minus_theta():
    def minus_theta(x, base=10000.0):               # nanochat's y1 = x1 cos + x2 sin
        angles = rope_angles(torch.arange(x.shape[-2]), x.shape[-1], base)
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = _halves(x)
        return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1).to(x.dtype)
    assert_fails("ch05.apply_rope", minus_theta, "B=1, H=1, T=5, D=8", hint="-t·θᵢ")
    assert results("ch05.apply_rope", minus_theta)["T=1: one token at position 0"].passed


def test_apply_rope_pairing_the_wrong_channels():
    def interleaved(x, base=10000.0):                # pairs (2i, 2i + 1)
        angles = rope_angles(torch.arange(x.shape[-2]), x.shape[-1], base)
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2) \
            .to(x.dtype)
    assert_fails("ch05.apply_rope", interleaved, "B=1, H=1, T=5, D=8", hint="neighbouring")
    assert results("ch05.apply_rope", interleaved)["D=2: one pair"].passed  # one pair: the same


def test_apply_rope_positions_off_by_one():
    def from_one(x, base=10000.0):                   # positions 1 .. T
        t, d = x.shape[-2], x.shape[-1]
        angles = rope_angles(torch.arange(1, t + 1), d, base)
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = _halves(x)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)
    assert_fails("ch05.apply_rope", from_one, "T=1: one token at position 0", hint="off by one")
    assert_fails("ch05.apply_rope", from_one, "B=1, H=1, T=5, D=8", hint="off by one")


def test_apply_rope_other_mistakes():
    key, first = "ch05.apply_rope", "B=1, H=1, T=5, D=8"

    def with_theta(theta_of):
        def fn(x, base=10000.0):
            t, d = x.shape[-2], x.shape[-1]
            i = torch.arange(d // 2, dtype=torch.float64)
            angles = torch.arange(t).double()[:, None] * theta_of(i, d, base)
            cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
            x1, x2 = _halves(x)
            return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return fn

    assert_fails(key, with_theta(lambda i, d, base: base ** (-i / d)), first,
                 hint="fall too slowly")
    assert_fails(key, with_theta(lambda i, d, base: base ** (2 * i / d)), first,
                 hint="grow with i")
    assert_fails(key, lambda x, base=10000.0: apply_rope(x), "base=100", hint="use the base")
    assert_fails(key, lambda x, base=10000.0: apply_rope(x.float()),
                 "float64 in, float64 out, T=12, D=32", message="dtype")

    def same_angle_everywhere(x, base=10000.0):
        d = x.shape[-1]
        theta = base ** (-2 * torch.arange(d // 2) / d)
        x1, x2 = _halves(x)
        return torch.cat([x1 * theta.cos() - x2 * theta.sin(),
                          x1 * theta.sin() + x2 * theta.cos()], dim=-1).to(x.dtype)
    assert_fails(key, same_angle_everywhere, first, hint="the same angles")


def test_apply_rope_may_not_call_the_package():
    def with_the_package(x, base=10000.0):
        rope = course_attn.RotaryEmbedding(x.shape[-1], base=base)
        return course_attn.apply_rotary_emb(x, *rope(torch.arange(x.shape[-2])))
    assert_banned("ch05.apply_rope", with_the_package, "course_attn")


# --- pairing_permutation -----------------------------------------------------------------------

def test_the_permutation_turns_interleaved_into_half_split():
    x = torch.randn(2, 3, 5, 12, dtype=torch.float64)
    cos, sin = course_attn.RotaryEmbedding(12)(torch.arange(5))
    p = get("ch05.pairing_permutation").reference(12)
    torch.testing.assert_close(course_attn.apply_rotary_emb(x[..., p], cos, sin),
                               course_attn.apply_rotary_emb(x, cos, sin, interleaved=True)[..., p])


def test_pairing_permutation_mistakes():
    key, first = "ch05.pairing_permutation", "D=8"
    assert_fails(key, lambda d: torch.stack([torch.arange(d // 2), torch.arange(d // 2, d)],
                                            dim=1).flatten(), first, hint="inverse permutation")
    assert_fails(key, lambda d: torch.cat([torch.arange(1, d, 2), torch.arange(0, d, 2)]), first,
                 hint="swapped the two channels")
    assert_fails(key, lambda d: torch.arange(d), first, hint="identity")
    assert_fails(key, lambda d: pairing_permutation(d).int(), first, message="dtype")


def test_pairing_permutation_may_not_call_the_package():
    def with_the_package(d):
        course_attn.rope.rope_frequencies(d)
        return pairing_permutation(d)
    assert_banned("ch05.pairing_permutation", with_the_package, "course_attn")


# --- rope_predictions --------------------------------------------------------------------------

def test_the_predictions_are_what_the_package_computes():
    expected = get("ch05.rope_predictions").reference()
    theta = course_attn.rope.rope_frequencies(64).double()
    assert expected["slowest_wavelength"] == pytest.approx(2 * math.pi / theta[-1].item(),
                                                           rel=1e-6)
    assert 47_000 < expected["slowest_wavelength"] < 47_200
    assert expected["score"] == pytest.approx(math.sin(2))
    assert expected["same_score_as_5_2"] == [[3, 0], [10, 7], [100, 97]]


def test_rope_predictions_mistakes():
    key = "ch05.rope_predictions"
    a, b, c = (f"({x})" for x in "abc")
    names = {n[:3]: n for n in results(key, rope_predictions)}

    def predicting(**wrong):
        return lambda: {**rope_predictions(), **wrong}

    assert_fails(key, predicting(slowest_wavelength=2 * math.pi * 10000), names[a],
                 hint="θ = 1/base")
    assert_fails(key, predicting(slowest_wavelength=10000 ** (62 / 64)), names[a],
                 hint="forgot the 2π")
    assert_fails(key, predicting(score=-math.sin(2)), names[b], hint="rotated by -θ")
    assert_fails(key, predicting(score=0.0), names[b], hint="did not rotate")
    assert_fails(key, predicting(same_score_as_5_2=[[3, 0], [2, 5], [10, 7], [100, 97]]),
                 names[c], hint="has a sign")
    assert_fails(key, predicting(same_score_as_5_2=[(3, 0), (10, 7)]), names[c])
    assert results(key, predicting(same_score_as_5_2=[(100, 97), (3, 0), (10, 7)]))[
        names[c]].passed                                     # order and tuples do not matter
    assert_fails(key, lambda: [1.0, 2.0], names[a], message="should return a dict")


def test_rope_predictions_never_show_the_right_answer():
    key = "ch05.rope_predictions"
    for result in run_exercise(get(key), lambda: {k: 12345.0 for k in
                                                  get(key).reference()}).results:
        assert not result.passed and "is not what the package computes" in result.message
        for answer in ("47", "0.909", "[3, 0]"):
            assert answer not in result.message


def test_rope_predictions_are_worked_out_not_computed():
    def computed():
        q = torch.tensor([1.0, 0.0])
        return {**rope_predictions(), "score": float(q[0])}
    assert_banned("ch05.rope_predictions", computed, "torch.tensor")
