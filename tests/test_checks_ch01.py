"""Chapter 1's checks: reference solutions pass; typical mistakes fail the case meant for them."""

import math

import pytest
import torch

from course_attn.grading import run_checks


def _results(name: str, fn) -> dict[str, bool]:
    return {r.name: r.passed for r in run_checks(name, fn).results}


def _assert_fails(name: str, fn, case: str) -> None:
    results = _results(name, fn)
    assert case in results, f"no case named {case!r}; cases: {sorted(results)}"
    assert not results[case], f"{name}: case {case!r} should fail for this implementation"


# Reference solutions, as in solutions/01_intuition.ipynb.

def softmax_list(xs):
    m = max(xs)
    exps = [math.exp(x - m) for x in xs]
    total = sum(exps)
    return [e / total for e in exps]


def soft_lookup(query, keys, values):
    scores = [sum(qi * ki for qi, ki in zip(query, key)) for key in keys]
    m = max(scores)
    exps = [math.exp(s - m) for s in scores]
    total = sum(exps)
    weights = [e / total for e in exps]
    return [sum(w * value[j] for w, value in zip(weights, values)) for j in range(len(values[0]))]


def attend(q, k, v):
    return torch.softmax(q @ k.T, dim=-1) @ v


def not_implemented(*args):
    raise NotImplementedError()


@pytest.mark.parametrize("name, fn", [
    ("ch01.softmax_list", softmax_list),
    ("ch01.soft_lookup", soft_lookup),
    ("ch01.attend", attend),
])
def test_reference_solution_passes_every_case(name, fn):
    report = run_checks(name, fn)
    assert len(report.results) >= 4
    assert report.passed, [(r.name, r.message) for r in report.results if not r.passed]


@pytest.mark.parametrize("name", ["ch01.softmax_list", "ch01.soft_lookup", "ch01.attend"])
def test_stub_fails_every_case(name):
    results = _results(name, not_implemented)
    assert results and not any(results.values())


# softmax_list: typical mistakes.

def softmax_without_max_shift(xs):
    exps = [math.exp(x) for x in xs]
    total = sum(exps)
    return [e / total for e in exps]


def softmax_shift_by_first(xs):
    exps = [math.exp(x - xs[0]) for x in xs]
    total = sum(exps)
    return [e / total for e in exps]


def softmax_as_tensor(xs):
    return torch.softmax(torch.tensor(xs), dim=-1)


def test_softmax_without_max_shift_fails_large_and_negative_scores():
    _assert_fails("ch01.softmax_list", softmax_without_max_shift,
                  "large scores [1000, 1001] (no overflow)")
    _assert_fails("ch01.softmax_list", softmax_without_max_shift,
                  "very negative scores [-1000, -1001] (no division by zero)")
    assert _results("ch01.softmax_list", softmax_without_max_shift)["five random scores"]


def test_softmax_shifted_by_first_score_fails_wide_scores():
    _assert_fails("ch01.softmax_list", softmax_shift_by_first, "scores spread from -900 to 800")


def test_softmax_returning_a_tensor_fails_the_type_case():
    _assert_fails("ch01.softmax_list", softmax_as_tensor, "returns a list of floats, same length")


def test_softmax_that_sorts_its_input_in_place_fails():
    def sorting(xs):
        xs.sort()
        return softmax_list(xs)
    _assert_fails("ch01.softmax_list", sorting, "five random scores")


# soft_lookup: typical mistakes.

def hard_lookup(query, keys, values):
    scores = [sum(qi * ki for qi, ki in zip(query, key)) for key in keys]
    return list(values[scores.index(max(scores))])


def plain_average(query, keys, values):
    return [sum(value[j] for value in values) / len(values) for j in range(len(values[0]))]


def lookup_with_naive_softmax(query, keys, values):
    scores = [sum(qi * ki for qi, ki in zip(query, key)) for key in keys]
    weights = softmax_without_max_shift(scores)
    return [sum(w * value[j] for w, value in zip(weights, values)) for j in range(len(values[0]))]


def lookup_averaging_keys(query, keys, values):
    return soft_lookup(query, keys, keys)


def test_hard_lookup_fails_the_typical_case():
    _assert_fails("ch01.soft_lookup", hard_lookup, "4 keys, D = 3, Dv = 3")


def test_plain_average_ignores_the_query_and_fails():
    _assert_fails("ch01.soft_lookup", plain_average, "4 keys, D = 3, Dv = 3")
    _assert_fails("ch01.soft_lookup", plain_average,
                  "orthogonal keys, a query far along one key (≈ a hard lookup)")


def test_lookup_with_naive_softmax_fails_large_scores():
    _assert_fails("ch01.soft_lookup", lookup_with_naive_softmax, "large scores (no overflow)")
    assert _results("ch01.soft_lookup", lookup_with_naive_softmax)["4 keys, D = 3, Dv = 3"]


def test_lookup_that_averages_keys_fails_when_values_differ_in_length():
    _assert_fails("ch01.soft_lookup", lookup_averaging_keys,
                  "values longer than keys (D = 2, Dv = 5)")


# attend: typical mistakes.

def attend_scaled(q, k, v):
    return torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), dim=-1) @ v


def attend_softmax_over_queries(q, k, v):
    return torch.softmax(q @ k.T, dim=0) @ v


def attend_in_float32(q, k, v):
    return attend(q.float(), k.float(), v.float())


def attend_naive_exp(q, k, v):
    e = torch.exp(q @ k.T)
    return (e / e.sum(dim=-1, keepdim=True)) @ v


def test_scaled_attention_fails_the_typical_case():
    _assert_fails("ch01.attend", attend_scaled, "q, k (5, 4), v (5, 3)")


def test_softmax_over_queries_fails_when_tq_differs_from_tk():
    _assert_fails("ch01.attend", attend_softmax_over_queries,
                  "fewer queries than keys (Tq = 2, Tk = 7)")


def test_hard_coded_float32_fails_the_float64_case():
    _assert_fails("ch01.attend", attend_in_float32, "float64 in, float64 out")
    assert _results("ch01.attend", attend_in_float32)["q, k (5, 4), v (5, 3)"]


def test_naive_exp_fails_large_scores():
    _assert_fails("ch01.attend", attend_naive_exp, "large scores (no overflow, no NaN)")
    assert _results("ch01.attend", attend_naive_exp)["q, k (5, 4), v (5, 3)"]
