"""Chapter 5's exercises: each typical mistake fails the case meant for it with its own hint, and a
banned call is reported by name. What every exercise must satisfy (the reference and the
solution pass public and hidden cases, a stub is "not answered yet", every declared mistake
names itself) is tested once, for all chapters, in test_exercises_conformance.py.

The wrong solutions below are written as a student would write them; each test names the case
it must fail and a fragment of the hint it must get.
"""

import copy
import math

import pytest
import torch

import course_attn
import course_attn.rope
from course_attn.grading import get, run_exercise
from course_attn.grading.exercise import hidden_cases

from check_support import assert_banned, assert_fails, results


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


def rope_predictions(head_dim, base, m, n, candidates):
    same = [letter for letter, (m2, n2) in candidates.items() if m2 - n2 == m - n]
    return {"slowest_wavelength": 2 * math.pi * base ** ((head_dim - 2) / head_dim),
            "score": math.sin(m - n), "same_score": same[0]}


def hf_to_meta_rows(w, n_heads):
    rows, c = w.shape
    d = rows // n_heads
    return w.reshape(n_heads, 2, d // 2, c).transpose(1, 2).reshape(rows, c)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rotary_given(x, positions, base=10000.0):
    """The notebook's given function, bug included (its cell ch05-rotary-given)."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = torch.outer(positions.to(torch.float64), inv_freq)
    emb = freqs.repeat_interleave(2, dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return x * cos + rotate_half(x) * sin


def rotary(x, positions, base=10000.0):
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = torch.outer(positions.to(torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return x * cos + rotate_half(x) * sin


REF, NORM, ZERO, RELATIVE = ("matches the reference", "norm preserved",
                             "position 0 is identity", "relative property")


def rope_test_catches(head_dim, T, shift):
    moves, pairs = T >= 2, head_dim >= 4
    return {"minus_theta": [REF] if moves else [],
            "interleaved": [REF] if moves and pairs else [],
            "mixed_layout": ([REF, NORM] if moves else []) + [RELATIVE] if pairs else [],
            "off_by_one": [REF, ZERO],
            "slow_frequencies": [REF] if moves and pairs else []}


@pytest.mark.parametrize("key, fn", [
    ("ch05.rope_angles", rope_angles), ("ch05.apply_rope", apply_rope),
    ("ch05.pairing_permutation", pairing_permutation),
    ("ch05.rope_predictions", rope_predictions), ("ch05.rotary", rotary),
    ("ch05.rope_test_catches", rope_test_catches), ("ch05.hf_to_meta_rows", hf_to_meta_rows)])
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

PREDICTIONS_KEY = "ch05.rope_predictions"


def _prediction_sizes(seeds=range(5)):
    """The dicts of arguments of the public cases and of the hidden cases of ``seeds``."""
    cases = get(PREDICTIONS_KEY).public_cases() + [
        case for seed in seeds for case in hidden_cases(PREDICTIONS_KEY, seed)]
    sizes = []
    for case in cases:
        if dict(case.kwargs) not in sizes:
            sizes.append(dict(case.kwargs))
    return sizes


def _rope_score(q, k, m, n, head_dim, base):
    """q_m · k_n worked out another way: each half-split pair (x_i, x_{i + D/2}) as the complex
    number x_i + i x_{i + D/2}, turned by multiplying with e^{i m θ_i} (torch.polar)."""
    theta = base ** (-2 * torch.arange(head_dim // 2, dtype=torch.float64) / head_dim)

    def turned(x, position):
        z = torch.complex(x[: head_dim // 2], x[head_dim // 2:])
        return z * torch.polar(torch.ones_like(theta), position * theta)
    return (turned(q, m) * turned(k, n).conj()).real.sum().item()


def test_the_predictions_are_what_the_package_computes():
    """On the public sizes and on hidden ones of several seeds: the wavelength from the
    package's own frequencies, the score and the candidate from the complex form of RoPE."""
    sizes = _prediction_sizes()
    assert len(sizes) == 2 + 3 * 5
    gen = torch.Generator().manual_seed(1)
    for size in sizes:
        expected = get(PREDICTIONS_KEY).reference(**size)
        d, base, m, n = size["head_dim"], size["base"], size["m"], size["n"]
        theta = course_attn.rope.rope_frequencies(d, base).double()
        assert expected["slowest_wavelength"] == pytest.approx(2 * math.pi / theta[-1].item(),
                                                               rel=1e-6)
        one, other = torch.tensor([1.0, 0.0], dtype=torch.float64), \
            torch.tensor([0.0, 1.0], dtype=torch.float64)
        assert expected["score"] == pytest.approx(_rope_score(one, other, m, n, 2, base),
                                                  abs=1e-9)
        q, k = (torch.randn(d, generator=gen, dtype=torch.float64) for _ in range(2))
        same = [letter for letter, (m2, n2) in size["candidates"].items()
                if _rope_score(q, k, m2, n2, d, base) == pytest.approx(
                    _rope_score(q, k, m, n, d, base), rel=1e-9, abs=1e-9)]
        assert same == [expected["same_score"]], size
    first = get(PREDICTIONS_KEY).reference(**sizes[0])
    assert 47_000 < first["slowest_wavelength"] < 47_200
    assert first["score"] == pytest.approx(math.sin(2))


def _first_set_names():
    return {case.part: case.name for case in get(PREDICTIONS_KEY).public_cases()[:3]}


def test_rope_predictions_mistakes():
    key, names = PREDICTIONS_KEY, _first_set_names()

    def predicting(**wrong):
        def fn(head_dim, base, m, n, candidates):
            return {**rope_predictions(head_dim, base, m, n, candidates),
                    **{k: answer(head_dim, base, m, n, candidates) for k, answer in wrong.items()}}
        return fn

    def first(candidates, wanted):
        return next(letter for letter, pair in candidates.items() if wanted(*pair))

    a, b, c = names["slowest_wavelength"], names["score"], names["same_score"]
    assert_fails(key, predicting(slowest_wavelength=lambda d, base, *_: 2 * math.pi * base), a,
                 hint="θ = 1/base")
    assert_fails(key, predicting(slowest_wavelength=lambda d, base, *_: base ** (1 - 2 / d)), a,
                 hint="forgot the 2π")
    assert_fails(key, predicting(slowest_wavelength=lambda d, base, *_: base ** (2 / d - 1)), a,
                 hint="angle per token")
    assert_fails(key, predicting(score=lambda d, base, m, n, _: -math.sin(m - n)), b,
                 hint="the opposite sign")
    assert_fails(key, predicting(score=lambda *_: 0.0), b, hint="did not rotate")
    assert_fails(key, predicting(same_score=lambda d, base, m, n, cands: first(
        cands, lambda m2, n2: abs(m2 - n2) == abs(m - n))), c, hint="has a sign")
    assert_fails(key, predicting(same_score=lambda d, base, m, n, cands: first(
        cands, lambda m2, n2: n2 == n)), c, hint="key's position n alone")
    assert_fails(key, predicting(same_score=lambda d, base, m, n, cands: first(
        cands, lambda m2, n2: m2 == m)), c, hint="query's position m alone")
    assert_fails(key, lambda **_: [1.0, 2.0], a, message="should return a dict")


def test_a_choice_is_one_of_the_options_exactly():
    key, c = PREDICTIONS_KEY, _first_set_names()["same_score"]
    right = get(key).reference(**get(key).public_cases()[0].kwargs)["same_score"]

    def answering(letter):
        return lambda **size: {**rope_predictions(**size), "same_score": letter}

    assert results(key, answering(f" {right}\n"))[c].passed         # only .strip() is done
    for answer in (right.lower(), f"{right})", f"({right})", f"{right} or A", "(12, 10)", 2,
                   [right], None):
        result = results(key, answering(answer))[c]
        assert not result.passed, answer
        assert "not one of the options 'A', 'B', 'C', 'D'" in result.message, result.message
    wrong = next(letter for letter in "ABCD" if letter != right)
    message = results(key, answering(wrong))[c].message
    assert "is not what the package computes" in message and "options" not in message


def test_pasting_the_public_answers_fails_the_hidden_cases_of_every_seed():
    """A notebook that computes the public answers once (with the package, in another cell) and
    pastes them: right on the check's cases, wrong on the grader's."""
    exercise = get(PREDICTIONS_KEY)
    pasted = {(c.kwargs["m"], c.kwargs["n"]): exercise.reference(**c.kwargs)
              for c in exercise.public_cases()}
    first = next(iter(pasted.values()))

    def constants(head_dim, base, m, n, candidates):
        return dict(pasted.get((m, n), first))

    assert run_exercise(exercise, constants).passed
    for seed in range(20):
        judgement = run_exercise(exercise, constants, hidden_cases(PREDICTIONS_KEY, seed))
        assert not judgement.passed, seed


def test_rope_predictions_never_show_the_right_answer():
    key = PREDICTIONS_KEY
    for result in run_exercise(get(key), lambda **_: {"slowest_wavelength": 12345.0,
                                                       "score": 12345.0,
                                                       "same_score": "D"}).results:
        assert not result.passed and "is not what the package computes" in result.message
        for answer in ("47", "0.909", "'A'", "'B'"):
            assert answer not in result.message


def test_rope_predictions_are_worked_out_not_computed():
    def computed(**size):
        q = torch.tensor([1.0, 0.0])
        return {**rope_predictions(**size), "score": float(q[0])}
    assert_banned(PREDICTIONS_KEY, computed, "torch.tensor")


# --- rotary (debug) ----------------------------------------------------------------------------

def test_the_given_rotary_is_the_declared_bug_and_is_not_a_rotation():
    key, first = "ch05.rotary", "B=1, H=2, T=6, D=8, positions 0..5"
    assert_fails(key, rotary_given, first, hint="still turn by different angles")
    found = results(key, rotary_given)
    assert found["D=2: one pair, the bug cannot show"].passed
    assert found["T=1 at position 0: unchanged"].passed
    x = torch.randn(1, 1, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(rotary_given(x, torch.arange(5)).norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(rotary(x, torch.arange(5)).norm(dim=-1), x.norm(dim=-1))
    cos, sin = course_attn.RotaryEmbedding(8)(torch.arange(5))
    torch.testing.assert_close(rotary(x, torch.arange(5)),
                               course_attn.apply_rotary_emb(x, cos.double(), sin.double()))


def test_rotary_wrong_repairs():
    key, first = "ch05.rotary", "B=1, H=2, T=6, D=8, positions 0..5"

    def interleaved(x, positions, base=10000.0):      # made rotate_half match repeat_interleave
        d = x.shape[-1]
        freqs = torch.outer(positions.double(),
                            base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d))
        emb = freqs.repeat_interleave(2, dim=-1)
        pairs = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
        return x * emb.cos().to(x.dtype) + pairs * emb.sin().to(x.dtype)
    assert_fails(key, interleaved, first, hint="rotation now, but of neighbouring channels")

    def minus_theta(x, positions, base=10000.0):      # rotate_half's signs swapped
        d = x.shape[-1]
        freqs = torch.outer(positions.double(),
                            base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d))
        emb = torch.cat([freqs, freqs], dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * emb.cos().to(x.dtype) + torch.cat([x2, -x1], dim=-1) * emb.sin().to(x.dtype)
    assert_fails(key, minus_theta, first, hint="clockwise")

    def by_index(x, positions, base=10000.0):
        return rotary(x, torch.arange(x.shape[-2]), base)
    assert_fails(key, by_index, "positions 100..104 (as a KV cache passes them), D=16",
                 hint="use the positions you are given (a KV cache")
    assert results(key, by_index)[first].passed


def test_rotary_may_not_call_the_package():
    def packaged(x, positions, base=10000.0):
        cos, sin = course_attn.RotaryEmbedding(x.shape[-1], base=base)(positions)
        return course_attn.apply_rotary_emb(x, cos, sin)
    assert_banned("ch05.rotary", packaged, "course_attn")


# --- rope_test_catches (predict) ---------------------------------------------------------------

def test_the_catches_reference_is_the_reasoning_on_many_sizes():
    """The reference runs the four tests on the five bugs; the reasoning of the solution gives
    the same sets on the public sizes, the hidden ones of several seeds and a grid."""
    exercise = get("ch05.rope_test_catches")
    cases = exercise.public_cases() + [c for seed in range(5)
                                       for c in hidden_cases("ch05.rope_test_catches", seed)]
    sizes = {tuple(sorted(c.kwargs.items())) for c in cases}
    sizes |= {(("T", t), ("head_dim", d), ("shift", s))
              for d in (2, 4, 6, 64) for t in (1, 2, 7) for s in (1, 5)}
    for size in sizes:
        expected = exercise.reference(**dict(size))
        got = rope_test_catches(**dict(size))
        assert {k: set(v) for k, v in expected.items()} == {k: set(v) for k, v in got.items()}, \
            size


def test_rope_test_catches_mistakes():
    key = "ch05.rope_test_catches"
    wide, pair, one = " (head_dim=64, T=10, shift=3)", " (head_dim=2, T=6, shift=5)", \
        " (head_dim=16, T=1, shift=4)"

    def believing(**wrong):
        return lambda head_dim, T, shift: {**rope_test_catches(head_dim, T, shift), **{
            bug: answer(head_dim, T, shift) for bug, answer in wrong.items()}}
    assert_fails(key, believing(minus_theta=lambda d, t, s: [REF, RELATIVE]),
                 "(a) turns by -m·θᵢ (nanochat's sign)" + wide, hint="cannot tell the sign")
    assert_fails(key, believing(off_by_one=lambda d, t, s: [REF, ZERO, RELATIVE]),
                 "(d) positions counted from 1" + wide, hint="shifts every position")
    assert_fails(key, believing(slow_frequencies=lambda d, t, s: [REF, RELATIVE]),
                 "(e) θᵢ = base^(-i/D), without the 2" + wide, hint="any frequencies")
    assert_fails(key, believing(mixed_layout=lambda d, t, s: [REF, RELATIVE]),
                 "(c) frequencies laid out (θ₀, θ₀, θ₁, θ₁, ...) with rotate_half" + wide,
                 hint="changes the norm")
    assert_fails(key, believing(interleaved=lambda d, t, s: [REF, ZERO]),
                 "(b) pairs neighbouring channels (2i, 2i + 1)" + wide,
                 hint="at position 0 every angle is 0")
    # forgetting what D = 2 and T = 1 do
    assert_fails(key, believing(interleaved=lambda d, t, s: [REF] if t > 1 else []),
                 "(b) pairs neighbouring channels (2i, 2i + 1)" + pair, hint="with D = 2")
    assert_fails(key, believing(minus_theta=lambda d, t, s: [REF]),
                 "(a) turns by -m·θᵢ (nanochat's sign)" + one, hint="with T = 1")
    # not an option, not a list
    assert_fails(key, believing(minus_theta=lambda d, t, s: ["reference"]),
                 "(a) turns by -m·θᵢ (nanochat's sign)" + wide, message="not one of the tests")
    assert_fails(key, believing(minus_theta=lambda d, t, s: REF),
                 "(a) turns by -m·θᵢ (nanochat's sign)" + wide, message="list of test names")
    # order and spaces do not matter
    assert results(key, believing(mixed_layout=lambda d, t, s: [
        " relative property", NORM, REF] if d >= 4 and t > 1 else rope_test_catches(d, t, s)[
        "mixed_layout"]))["(c) frequencies laid out (θ₀, θ₀, θ₁, θ₁, ...) with rotate_half"
                          + wide].passed


def test_rope_test_catches_is_thought_not_run():
    def packaged(head_dim, T, shift):     # the package's frequencies, to see which pairs differ
        theta = course_attn.rope.rope_frequencies(head_dim)
        return {**rope_test_catches(head_dim, T, shift), "minus_theta": [REF] * len(theta)}
    assert_banned("ch05.rope_test_catches", packaged, "course_attn")

    def measured(head_dim, T, shift):
        q = torch.randn(1, 1, T, head_dim)
        return {**rope_test_catches(head_dim, T, shift), "minus_theta": [REF] * bool(q.numel())}
    assert_banned("ch05.rope_test_catches", measured, "torch.randn")


# --- hf_to_meta_rows (implement) ---------------------------------------------------------------

def test_hf_to_meta_rows_undoes_the_chapters_conversion_and_keeps_the_model():
    """A half-split layer and an interleaved one with the converted W_Q and W_K compute the
    same thing; converting back with the chapter's rows (p in every head) gives w again."""
    exercise = get("ch05.hf_to_meta_rows")
    for case in exercise.public_cases():
        w, h = case.args
        d = w.shape[0] // h
        p = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
        rows = torch.cat([k * d + p for k in range(h)])
        assert torch.equal(exercise.expected(case)[rows], w), case.name
    c, h = 16, 2
    hf = course_attn.MultiHeadAttention(c, n_heads=h, rope=True)
    meta = copy.deepcopy(hf)
    meta.rope_interleaved = True
    with torch.no_grad():
        meta.q_proj.weight.copy_(hf_to_meta_rows(hf.q_proj.weight, h))
        meta.k_proj.weight.copy_(hf_to_meta_rows(hf.k_proj.weight, h))
        x = torch.randn(2, 7, c, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(meta(x), hf(x))


def test_hf_to_meta_rows_mistakes():
    key, first = "ch05.hf_to_meta_rows", "H=2, D=8, C=16"

    def with_p(w, n_heads):                      # the chapter's permutation, once more
        d = w.shape[0] // n_heads
        p = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
        return w[torch.cat([h * d + p for h in range(n_heads)])]
    assert_fails(key, with_p, first, hint="the chapter's conversion")
    assert_fails(key, lambda w, n_heads: hf_to_meta_rows(w, 1), first, hint="as one block")

    def swapped(w, n_heads):
        rows, c = w.shape
        halves = w.reshape(n_heads, 2, rows // n_heads // 2, c)
        return torch.stack([halves[:, 1], halves[:, 0]], dim=2).reshape(rows, c)
    assert_fails(key, swapped, first, hint="swapped")
    assert_fails(key, lambda w, n_heads: hf_to_meta_rows(w.T, n_heads).T, first)


def test_hf_to_meta_rows_may_not_call_the_package():
    from course_attn.grading.ch05 import hf_to_meta_rows_reference
    assert_banned("ch05.hf_to_meta_rows", hf_to_meta_rows_reference, "course_attn")
