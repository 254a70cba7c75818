"""Chapter 1's exercises: each typical mistake fails the case meant for it with its own hint, and a
banned call is reported by name. What every exercise must satisfy (the reference and the
solution pass public and hidden cases, a stub is "not answered yet", every declared mistake
names itself) is tested once, for all chapters, in test_exercises_conformance.py.

The wrong solutions below are written as a student would write them; each test names the case
it must fail and a fragment of the hint it must get.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import course_attn
from course_attn.data import induction_targets
from course_attn.grading import get, run_exercise
from course_attn.grading.exercise import hidden_cases

from check_support import assert_banned, assert_fails, results


# --- solutions as in solutions/01_intuition.ipynb -------------------------------------------------

def softmax_list(xs):
    largest = max(xs)
    exps = [math.exp(x - largest) for x in xs]
    total = sum(exps)
    return [e / total for e in exps]


def soft_lookup(query, keys, values):
    scores = [sum(q * k for q, k in zip(query, key)) for key in keys]
    weights = softmax_list(scores)
    return [sum(w * value[d] for w, value in zip(weights, values)) for d in range(len(values[0]))]


def attend(q, k, v):
    return torch.softmax(q @ k.T, dim=-1) @ v


def induction_score(weights, tokens):
    batch, heads, length, _ = weights.shape
    total = torch.zeros(heads, dtype=weights.dtype)
    counted = 0
    for b in range(batch):
        last_seen = {}
        for t in range(length):
            token = int(tokens[b, t])
            if token in last_seen:
                total += weights[b, :, t, last_seen[token] + 1]
                counted += 1
            last_seen[token] = t
    return total / max(counted, 1)


@pytest.mark.parametrize("key, fn", [
    ("ch01.softmax_list", softmax_list), ("ch01.soft_lookup", soft_lookup),
    ("ch01.attend", attend), ("ch01.induction_score", induction_score)])
def test_the_notebooks_solutions_pass_with_the_watch_on(key, fn):
    for cases in [None] + [hidden_cases(key, seed) for seed in range(5)]:
        judgement = run_exercise(get(key), fn, cases)
        assert judgement.passed, (judgement.banned, [(r.name, r.message) for r in
                                                     judgement.results if not r.passed])


# --- softmax_list ------------------------------------------------------------------------------

def test_softmax_list_mistakes():
    def naive(xs):
        exps = [math.exp(x) for x in xs]
        return [e / sum(exps) for e in exps]

    def shift_by_first(xs):
        exps = [math.exp(x - xs[0]) for x in xs]
        return [e / sum(exps) for e in exps]

    def shift_by_mean(xs):
        mean = sum(xs) / len(xs)
        exps = [math.exp(x - mean) for x in xs]
        return [e / sum(exps) for e in exps]

    def naive_numpy(xs):  # overflows to inf and NaN instead of raising
        with np.errstate(all="ignore"):
            e = np.exp(np.array(xs))
            return [float(w) for w in e / e.sum()]

    # math.exp raises: the case's own hint names the overflow
    assert_fails("ch01.softmax_list", naive, "large scores [1000, 1001] (no overflow)",
                 hint="math.exp(1000) overflows", message="OverflowError")
    assert_fails("ch01.softmax_list", naive,
                 "very negative scores [-1000, -1001] (no division by zero)",
                 hint="math.exp(-1000) is 0.0", message="ZeroDivisionError")
    assert_fails("ch01.softmax_list", shift_by_first,
                 "scores spread from -900 to 800, the first one the lowest",
                 hint="you shift by the first score", message="OverflowError")
    assert_fails("ch01.softmax_list", shift_by_mean,
                 "scores [700, -900, -900, 690]: the mean is far below the largest",
                 hint="you shift by the mean score", message="OverflowError")
    # NaN answers are recognised as the typical mistake
    assert_fails("ch01.softmax_list", naive_numpy, "large scores [1000, 1001] (no overflow)",
                 hint="you exponentiate the raw scores")
    assert results("ch01.softmax_list", naive)["five random scores"].passed


def test_softmax_list_wrong_types_and_changed_inputs():
    assert_fails("ch01.softmax_list", lambda xs: torch.tensor(softmax_list(xs)),
                 "five random scores", message="should be a list")

    def emptying(xs):
        weights = softmax_list(xs)
        xs.clear()
        return weights
    assert_fails("ch01.softmax_list", emptying, "five random scores", message="in place")


def test_softmax_list_may_not_call_a_library_softmax():
    assert_banned("ch01.softmax_list",
                  lambda xs: torch.softmax(torch.tensor(xs, dtype=torch.float64), 0).tolist(),
                  "torch.softmax")
    assert_banned("ch01.softmax_list",
                  lambda xs: course_attn.softmax(torch.tensor(xs, dtype=torch.float64)).tolist(),
                  "course_attn")


# --- soft_lookup -------------------------------------------------------------------------------

def test_soft_lookup_mistakes():
    def hard(query, keys, values):
        scores = [sum(q * k for q, k in zip(query, key)) for key in keys]
        return list(values[scores.index(max(scores))])

    def plain_average(query, keys, values):
        return [sum(value[d] for value in values) / len(values) for d in range(len(values[0]))]

    def scaled(query, keys, values):
        return soft_lookup([q / math.sqrt(len(query)) for q in query], keys, values)

    def averaging_keys(query, keys, values):
        return soft_lookup(query, keys, keys)

    def naive_softmax(query, keys, values):
        scores = [sum(q * k for q, k in zip(query, key)) for key in keys]
        exps = [math.exp(s) for s in scores]
        weights = [e / sum(exps) for e in exps]
        return [sum(w * v[d] for w, v in zip(weights, values)) for d in range(len(values[0]))]

    first = "4 keys, D = 3, Dv = 3"
    assert_fails("ch01.soft_lookup", hard, first, hint="a hard lookup")
    assert_fails("ch01.soft_lookup", plain_average, first, hint="equal weights")
    assert_fails("ch01.soft_lookup", scaled, first, hint="divide the scores by √D")
    assert_fails("ch01.soft_lookup", averaging_keys, "values longer than keys (D = 2, Dv = 5)",
                 hint="you average the keys")
    assert_fails("ch01.soft_lookup", naive_softmax, "large scores (no overflow)",
                 hint="math.exp overflows", message="OverflowError")
    assert results("ch01.soft_lookup", naive_softmax)[first].passed


def test_soft_lookup_may_not_call_a_library_attention():
    def sdpa(query, keys, values):
        q = torch.tensor([[query]], dtype=torch.float64)
        return F.scaled_dot_product_attention(q, torch.tensor([keys], dtype=torch.float64),
                                              torch.tensor([values], dtype=torch.float64),
                                              scale=1.0)[0, 0].tolist()
    assert_banned("ch01.soft_lookup", sdpa, "scaled_dot_product_attention")


# --- attend ------------------------------------------------------------------------------------

def test_attend_mistakes():
    first = "q, k (5, 4), v (5, 3)"
    assert_fails("ch01.attend", lambda q, k, v: torch.softmax(q @ k.T / math.sqrt(q.shape[-1]),
                                                              dim=-1) @ v,
                 first, hint="divide the scores by √D")
    assert_fails("ch01.attend", lambda q, k, v: torch.softmax(q @ k.T, dim=0) @ v,
                 "fewer queries than keys (Tq = 2, Tk = 7)", hint="over the queries (dim=0)")
    assert_fails("ch01.attend", lambda q, k, v: (q @ k.T) @ v, first, hint="raw scores")
    assert_fails("ch01.attend", lambda q, k, v: attend(q.float(), k.float(), v.float()),
                 "float64 in, float64 out", hint="you compute in float32", message="dtype")

    def naive_exp(q, k, v):
        e = torch.exp(q @ k.T)
        return e / e.sum(dim=-1, keepdim=True) @ v
    assert_fails("ch01.attend", naive_exp, "large scores (no overflow, no NaN; float64)",
                 hint="use a stable softmax", message="NaN")
    assert_fails("ch01.attend", lambda q, k, v: torch.softmax(q @ k, dim=-1) @ v, first,
                 hint="scores = q @ k.T", message="RuntimeError")


def test_attend_may_not_call_a_library_attention():
    def one_line(q, k, v):
        return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=1.0)[0]
    assert run_exercise(get("ch01.attend"), one_line, watch_banned=False).passed
    assert_banned("ch01.attend", one_line,
                  "torch.nn.functional.scaled_dot_product_attention")
    assert_banned("ch01.attend", lambda q, k, v: course_attn.scaled_dot_product_attention(
        q[None, None], k[None, None], v[None, None], scale=1.0)[0, 0], "course_attn")


# --- induction_score ---------------------------------------------------------------------------

def _loop_score(weights, tokens, look, count_every=False, mean_of_means=False):
    """A student's loop: ``look(t, j)`` is the key read at query t whose token was last seen at j
    (and ``first`` the first time it was seen)."""
    batch, heads, length, _ = weights.shape
    per_sequence, total, counted = [], torch.zeros(heads, dtype=weights.dtype), 0
    for b in range(batch):
        first, last, mine, n = {}, {}, torch.zeros(heads, dtype=weights.dtype), 0
        for t in range(length):
            token = int(tokens[b, t])
            if token in last:
                row, column = look(t, last[token], first[token])
                mine += weights[b, :, row, column]
                n += 1
            first.setdefault(token, t)
            last[token] = t
        total, counted = total + mine, counted + n
        if n:
            per_sequence.append(mine / n)
    if mean_of_means:
        return torch.stack(per_sequence).mean(0) if per_sequence else total
    return total / (tokens.numel() if count_every else counted)


def test_induction_score_mistakes():
    key = "ch01.induction_score"
    many = "random maps, B=2, H=3, T=12, three letters (tokens occur many times)"
    first_case = "an induction head and a uniform head, tokens A B C D A B C D"
    assert_fails(key, lambda w, x: _loop_score(w, x, lambda t, j, f: (t, j)), first_case,
                 hint="the earlier occurrence itself")
    assert_fails(key, lambda w, x: _loop_score(w, x, lambda t, j, f: (t, f + 1)), many,
                 hint="the first earlier occurrence")
    assert_fails(key, lambda w, x: _loop_score(w, x, lambda t, j, f: (t, j + 1),
                                               count_every=True), first_case,
                 hint="averaged over every position")
    assert_fails(key, lambda w, x: _loop_score(w, x, lambda t, j, f: (t, j + 1),
                                               mean_of_means=True),
                 "three sequences with 1, 6 and 3 repeated tokens", hint="a mean of means")
    assert_fails(key, lambda w, x: _loop_score(w, x, lambda t, j, f: (t, t - 1)), first_case,
                 hint="the previous position")
    assert_fails(key, lambda w, x: _loop_score(w, x, lambda t, j, f: (j + 1, t)), first_case,
                 hint="rows are queries")
    # 0 / 0 where no token repeats: the case's own hint says so
    assert_fails(key, lambda w, x: _loop_score(w, x, lambda t, j, f: (t, j + 1)),
                 "no token occurs twice: every head scores 0", hint="0 / 0 is NaN",
                 message="NaN")


def test_induction_score_may_not_use_the_package():
    def with_targets(weights, tokens):
        target = induction_targets(tokens)
        counted = target >= 0
        on = weights.gather(-1, target.clamp(min=0)[:, None, :, None].expand(
            *weights.shape[:-1], 1))[..., 0]
        return (on * counted[:, None]).sum((0, 2)) / counted.sum().clamp(min=1)
    assert_banned("ch01.induction_score", with_targets, "course_attn.data.induction_targets")


def test_the_induction_head_case_scores_what_the_chapter_says():
    """A head with 0.8 on the induction target scores 0.8; a uniform head 1/(t+1) averaged."""
    case = get("ch01.induction_score").public_cases()[0]
    scores = get("ch01.induction_score").expected(case)
    uniform = sum(1 / (t + 1) for t in range(4, 8)) / 4
    torch.testing.assert_close(scores, torch.tensor([0.8, uniform]))
