"""Exercises of Chapter 1 (intuition): softmax and the soft lookup in plain Python, then with
tensors. No 1/√D scaling yet in this chapter.

    ch01.softmax_list   softmax_list(scores: list[float]) -> list[float]
    ch01.soft_lookup    soft_lookup(query: list, keys: list[list], values: list[list]) -> list
    ch01.attend         attend(q (Tq, D), k (Tk, D), v (Tk, Dv)) -> (Tq, Dv)
    ch01.induction_score  induction_score(weights (B, H, T, T), tokens (B, T)) -> (H,)
                        (measure: each head's mean weight on the induction target)

References: ``course_attn.softmax`` and ``course_attn.scaled_dot_product_attention`` with
``scale=1.0``; ``course_attn.data.induction_targets`` for the induction score.
"""

import math

import torch

from ..attention import scaled_dot_product_attention, softmax
from ..data import induction_targets
from .cases import (expect_close_tensor, expect_float_list, expect_tensor, randn,
                    softmax_without_shift)
from .exercise import Case, Exercise, Mistake, register
from .operations import ELEMENTARY, NO_LIBRARY_ATTENTION, NO_LIBRARY_SOFTMAX, SOFTMAX

# Shortcuts that would answer the exercise for the student.


def softmax_list_reference(scores: list) -> list:
    return softmax(torch.tensor(scores, dtype=torch.float64), dim=-1).tolist()


def _naive_softmax_list(scores):
    exps = [math.exp(s) if s < 709 else math.inf for s in scores]
    total = sum(exps)
    return [e / total if total else math.nan for e in exps]


def _exp_softmax_list(scores):
    """The same with math.exp as it is: it raises past 709, and divides by zero where every
    weight underflows (a numpy or torch version gives inf and NaN instead: the one above)."""
    return [math.exp(s) / sum(math.exp(x) for x in scores) for s in scores]


def _softmax_list_cases():
    gen = torch.Generator().manual_seed(101)
    yield Case("five random scores", (randn(5, seed=gen).tolist(),),
               hint="exponentiate every score, then divide each by the sum of all of them")
    yield Case("a single score gets all the weight", ([3.7],), hint="one score: its weight is 1.0")
    yield Case("equal scores give equal weights", ([2.0, 2.0, 2.0, 2.0],),
               hint="the weights must sum to 1")
    yield Case("large scores [1000, 1001] (no overflow)", ([1000.0, 1001.0],),
               hint="math.exp(1000) overflows; subtracting the same number from every score "
                    "does not change the softmax")
    yield Case("very negative scores [-1000, -1001] (no division by zero)", ([-1000.0, -1001.0],),
               hint="math.exp(-1000) is 0.0 in floating point; shift the scores so that the "
                    "largest is 0")
    yield Case("scores spread from -900 to 800, the first one the lowest",
               ([-900.0, 0.0, 798.5, 800.0, -700.0, 799.0],),
               hint="shift by the maximum score, not by the first one or the mean")
    yield Case("scores [700, -900, -900, 690]: the mean is far below the largest",
               ([700.0, -900.0, -900.0, 690.0],),
               hint="shift by the maximum score: the mean can lie more than 709 below it")


register(Exercise(
    key="ch01.softmax_list", function="softmax_list", reference=softmax_list_reference,
    ops=ELEMENTARY,
    cases=_softmax_list_cases, compare=expect_float_list,
    banned=("course_attn",) + NO_LIBRARY_SOFTMAX,
    mistakes=(
        *(Mistake("you shift by the first score, not the largest: exp overflows when a later "
                  "score is much larger", lambda s, f=f: f([x - s[0] for x in s]))
          for f in (_exp_softmax_list, _naive_softmax_list)),
        *(Mistake("you shift by the mean score, not the largest: exp still overflows for "
                  "scores far above the mean", lambda s, f=f: f([x - sum(s) / len(s) for x in s]))
          for f in (_exp_softmax_list, _naive_softmax_list)),
        Mistake("a raw math.exp fails at both ends: math.exp(1000) overflows (past 709 it "
                "raises), and math.exp(-1000) is 0.0 (a sum of zeros, then a division by "
                "zero); subtracting the same number from every score does not change the "
                "softmax", _exp_softmax_list),
        Mistake("you exponentiate the raw scores: exp overflows past 709 (or every weight "
                "underflows to 0 for very negative scores); subtract the largest score first",
                _naive_softmax_list),
    ),
))


def soft_lookup_reference(query, keys, values) -> list:
    q = torch.tensor(query, dtype=torch.float64)[None, None, None, :]   # (1, 1, 1, D)
    k = torch.tensor(keys, dtype=torch.float64)[None, None]             # (1, 1, T, D)
    v = torch.tensor(values, dtype=torch.float64)[None, None]           # (1, 1, T, Dv)
    return scaled_dot_product_attention(q, k, v, scale=1.0)[0, 0, 0].tolist()


def _scaled_soft_lookup(query, keys, values):
    return soft_lookup_reference([x / math.sqrt(len(query)) for x in query], keys, values)


def _dots(query, keys):
    return [sum(q * k for q, k in zip(query, key)) for key in keys]


def _weighted(weights, rows):
    return [sum(w * row[d] for w, row in zip(weights, rows)) for d in range(len(rows[0]))]


def _hard_lookup(query, keys, values):
    scores = _dots(query, keys)
    return [float(x) for x in values[scores.index(max(scores))]]


def _plain_average(query, keys, values):
    return _weighted([1.0 / len(values)] * len(values), values)


def _weighted_keys(query, keys, values):
    return soft_lookup_reference(query, keys, keys)


def _raw_scores_as_weights(query, keys, values):
    return _weighted(_dots(query, keys), values)


def _rows(gen, rows, cols, spread=1.0):
    return randn(rows, cols, seed=gen, scale=spread, dtype=torch.float64).tolist()


def _soft_lookup_cases():
    gen = torch.Generator().manual_seed(102)
    yield Case("4 keys, D = 3, Dv = 3",
               (randn(3, seed=gen).tolist(), _rows(gen, 4, 3), _rows(gen, 4, 3)),
               hint="score_i = query · key_i; weights = softmax(scores); "
                    "answer = Σ_i weight_i value_i")
    yield Case("values longer than keys (D = 2, Dv = 5)",
               (randn(2, seed=gen).tolist(), _rows(gen, 6, 2), _rows(gen, 6, 5)),
               hint="the answer has as many numbers as one value, not as one key")
    yield Case("a single key returns its value", ([0.3, -2.0], [[1.5, 0.5]], [[4.0, -1.0, 2.5]]),
               hint="with one key the weight is 1")
    yield Case("large scores (no overflow)",
               (randn(4, seed=gen, scale=30.0).tolist(), _rows(gen, 5, 4, 30.0),
                _rows(gen, 5, 2)),
               hint="the dot products reach ±1000 and math.exp overflows past 709: use a "
                    "stable softmax")
    yield Case("orthogonal keys, a query far along one key (≈ a hard lookup)",
               ([0.0, 0.0, 30.0], [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]],
                [[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]]),
               hint="compare the query with every key by a dot product, not by equality")


def _overflowing_soft_lookup(query, keys, values):
    scores = [sum(q * k for q, k in zip(query, key)) for key in keys]
    exps = [math.exp(s) for s in scores]                                   # raises past 709
    return [sum(e * v[d] for e, v in zip(exps, values)) / sum(exps) for d in range(len(values[0]))]

register(Exercise(
    key="ch01.soft_lookup", function="soft_lookup", reference=soft_lookup_reference,
    ops=ELEMENTARY,
    cases=_soft_lookup_cases, compare=expect_float_list,
    banned=("course_attn",) + NO_LIBRARY_SOFTMAX + NO_LIBRARY_ATTENTION[1:],
    mistakes=(
        Mistake("math.exp overflows past 709, and these dot products reach about ±1000: "
                "a softmax may subtract the same number from every score first",
                _overflowing_soft_lookup),
        Mistake("you divide the scores by √D: this chapter's lookup does not scale them "
                "(scaling comes in chapter 2)", _scaled_soft_lookup),
        Mistake("you return the value of the best-matching key (a hard lookup): a soft lookup "
                "returns the average of all the values, weighted by the softmax of the scores",
                _hard_lookup),
        Mistake("you average the values with equal weights, ignoring the query: the weights "
                "are the softmax of the scores query · key", _plain_average),
        Mistake("you average the keys: the answer is a weighted average of the values",
                _weighted_keys),
        Mistake("you weight the values by the raw scores: turn the scores into weights with a "
                "softmax first (positive, summing to 1)", _raw_scores_as_weights),
    ),
))


def attend_reference(q, k, v) -> torch.Tensor:
    """(Tq, D), (Tk, D), (Tk, Dv) -> (Tq, Dv), without scaling."""
    return scaled_dot_product_attention(q[None, None], k[None, None], v[None, None],
                                        scale=1.0)[0, 0]


def _attend_cases():
    gen = torch.Generator().manual_seed(103)
    yield Case("q, k (5, 4), v (5, 3)",
               (randn(5, 4, seed=gen), randn(5, 4, seed=gen), randn(5, 3, seed=gen)),
               hint="scores = q @ k.T, shape (Tq, Tk); no 1/sqrt(D) scaling in this chapter")
    yield Case("fewer queries than keys (Tq = 2, Tk = 7)",
               (randn(2, 4, seed=gen), randn(7, 4, seed=gen), randn(7, 6, seed=gen)),
               hint="each query's weights run over the keys: softmax along the last axis")
    yield Case("a single key (Tk = 1)",
               (randn(3, 4, seed=gen), randn(1, 4, seed=gen), randn(1, 2, seed=gen)),
               hint="with one key every query returns that key's value")
    # float64: this case is about overflow; float32 rounding of scores in the hundreds would
    # make a correct answer computed in another order miss float32's default tolerance.
    yield Case("large scores (no overflow, no NaN; float64)",
               (randn(4, 8, seed=gen, scale=30.0, dtype=torch.float64),
                randn(6, 8, seed=gen, scale=30.0, dtype=torch.float64),
                randn(6, 3, seed=gen, dtype=torch.float64)),
               hint="scores reach the thousands; use a stable softmax (torch.softmax is one)")
    yield Case("float64 in, float64 out",
               tuple(randn(*s, seed=gen, dtype=torch.float64) for s in ((4, 4), (5, 4), (5, 2))),
               hint="let the inputs' dtype flow through; do not convert to float32")
    yield Case("queries that match one key each (≈ a hard lookup)",
               (torch.tensor([[0.0, 40.0], [40.0, 0.0]]),
                torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]),
                torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])),
               hint="the output is weights @ v with weights of shape (Tq, Tk)")


register(Exercise(
    key="ch01.attend", function="attend", reference=attend_reference,
    ops=ELEMENTARY | SOFTMAX,
    cases=_attend_cases, compare=expect_tensor, banned=NO_LIBRARY_ATTENTION,
    mistakes=(
        Mistake("q @ k multiplies (Tq, D) by (Tk, D): a score pairs a query row with a key row, "
                "so the keys must be transposed first (scores = q @ k.T, shape (Tq, Tk))",
                lambda q, k, v: torch.softmax(q @ k, dim=-1) @ v),
        Mistake("exp of scores in the thousands is inf, and inf / inf is NaN: use a stable "
                "softmax (torch.softmax is one)",
                lambda q, k, v: softmax_without_shift(q @ k.T) @ v),
        Mistake("you divide the scores by √D: this chapter's attention does not scale them",
                lambda q, k, v: attend_reference(q / math.sqrt(q.shape[-1]), k, v)),
        Mistake("your softmax runs over the queries (dim=0); each query's weights must run over "
                "the keys (dim=-1)",
                lambda q, k, v: torch.softmax(q @ k.T, dim=0) @ v),
        Mistake("you multiply the values by the raw scores q kᵀ: turn them into weights with a "
                "softmax over the keys first", lambda q, k, v: (q @ k.T) @ v),
        Mistake("you compute in float32: let the inputs' dtype flow through (float64 in, "
                "float64 out)",
                lambda q, k, v: attend_reference(q.float(), k.float(), v.float())),
    ),
))


# --- ch01.induction_score: measure a head, as Section 9 of the chapter does --------------------

def induction_score_reference(weights, tokens) -> torch.Tensor:
    """(B, H, T, T) weights, (B, T) token ids -> (H,): each head's mean weight on the position
    right after the most recent earlier occurrence of the query's token, over every (b, t) whose
    token occurred before; 0 for every head when no token occurs twice."""
    target = induction_targets(tokens)                                  # (B, T), -1 where none
    return _mean_weight_on(weights, target)


def _mean_weight_on(weights, target):
    """Mean over every (b, t) with target[b, t] >= 0 of weights[b, :, t, target[b, t]]."""
    counted = target >= 0
    index = target.clamp(min=0)[:, None, :, None].expand(*weights.shape[:-1], 1)
    on_target = weights.gather(-1, index).squeeze(-1)                   # (B, H, T)
    total = (on_target * counted[:, None, :]).sum(dim=(0, 2))
    return total / counted.sum().clamp(min=1)


def _earlier_occurrence(tokens, first: bool):
    """(B, T): the first or the most recent j < t with tokens[b, j] == tokens[b, t], or -1."""
    t = tokens.shape[1]
    same = (tokens[:, :, None] == tokens[:, None, :]) & \
        torch.ones(t, t, dtype=torch.bool).tril(-1)
    key = torch.arange(t)
    if first:
        found = torch.where(same, key, t).amin(dim=-1)
        return torch.where(found < t, found, -1)
    return torch.where(same, key, -1).amax(dim=-1)


def _induction_at_occurrence(weights, tokens):
    return _mean_weight_on(weights, _earlier_occurrence(tokens, first=False))


def _induction_first_occurrence(weights, tokens):
    j = _earlier_occurrence(tokens, first=True)
    return _mean_weight_on(weights, torch.where(j >= 0, j + 1, -1))


def _induction_every_position(weights, tokens):
    counted = (induction_targets(tokens) >= 0).sum().clamp(min=1)
    return induction_score_reference(weights, tokens) * counted / tokens.numel()


def _induction_mean_of_means(weights, tokens):
    scores = [induction_score_reference(weights[b:b + 1], tokens[b:b + 1])
              for b in range(tokens.shape[0]) if (induction_targets(tokens[b:b + 1]) >= 0).any()]
    return torch.stack(scores).mean(dim=0) if scores else weights.new_zeros(weights.shape[1])


def _induction_previous_position(weights, tokens):
    target = induction_targets(tokens)
    positions = torch.arange(tokens.shape[1]).expand_as(target)
    return _mean_weight_on(weights, torch.where(target >= 0, positions - 1, -1))


def _induction_transposed(weights, tokens):
    return induction_score_reference(weights.transpose(-2, -1), tokens)


def _causal_weights(b, h, t, seed, dtype=torch.float32, sharpness=2.0):
    """Random attention maps (B, H, T, T): a softmax over the keys up to the query."""
    scores = randn(b, h, t, t, seed=seed, scale=sharpness, dtype=torch.float64)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1).to(dtype)


def _induction_head(tokens, dtype=torch.float32, on_target=0.8):
    """(B, 1, T, T): an induction head: ``on_target`` of its weight on the induction target, the
    rest spread over the other keys it may see in proportion to their position + 1 (so that
    reading the wrong key gives a number of its own)."""
    b, t = tokens.shape
    spread = torch.arange(1, t + 1, dtype=torch.float64).expand(t, t).tril()
    spread = (spread / spread.sum(dim=-1, keepdim=True)).expand(b, t, t).clone()
    target = induction_targets(tokens)
    for i, row in zip(*torch.nonzero(target >= 0, as_tuple=True)):
        rest = spread[i, row].clone()
        rest[target[i, row]] = 0.0
        spread[i, row] = (1 - on_target) * rest / rest.sum() if rest.sum() > 0 else rest
        spread[i, row, target[i, row]] += on_target if rest.sum() > 0 else 1.0
    return spread[:, None].to(dtype)


def _uniform_head(b, t, dtype=torch.float32):
    weights = torch.ones(t, t, dtype=torch.float64).tril()
    return (weights / weights.sum(dim=-1, keepdim=True)).expand(b, 1, t, t).to(dtype)


def _induction_cases():
    gen = torch.Generator().manual_seed(104)
    pattern = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    yield Case("an induction head and a uniform head, tokens A B C D A B C D",
               (torch.cat([_induction_head(pattern), _uniform_head(1, 8)], dim=1), pattern),
               hint="at a repeated token t, find its earlier occurrence j < t and read the "
                    "weight that row t puts on column j + 1")
    tokens = torch.randint(0, 3, (2, 12), generator=gen)
    yield Case("random maps, B=2, H=3, T=12, three letters (tokens occur many times)",
               (_causal_weights(2, 3, 12, gen), tokens),
               hint="a token that occurred several times before: use its most recent earlier "
                    "occurrence")
    tokens = torch.tensor([[4, 4, 2, 2, 4, 1, 1]])
    yield Case("a token repeated right away (A A): its target is its own position",
               (_causal_weights(1, 2, 7, gen), tokens),
               hint="after A A, the earlier A is at j = t - 1, so the position after it is t "
                    "itself")
    tokens = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0], [0, 1, 0, 1, 0, 1, 0, 1],
                           [5, 6, 7, 5, 6, 7, 1, 2]])
    yield Case("three sequences with 1, 6 and 3 repeated tokens",
               (_causal_weights(3, 2, 8, gen), tokens),
               hint="average over every counted position of every sequence together, so that a "
                    "sequence with more repeats counts more")
    yield Case("no token occurs twice: every head scores 0",
               (_causal_weights(2, 2, 5, gen), torch.arange(10).reshape(2, 5)),
               hint="no position is counted: there is nothing to average, and 0 / 0 is NaN; "
                    "return 0.0 for every head")
    tokens = torch.randint(0, 4, (2, 9), generator=gen)
    yield Case("float64 maps in, float64 scores out",
               (_causal_weights(2, 2, 9, gen, dtype=torch.float64), tokens),
               hint="return a tensor of shape (H,) in the dtype of the weights")


def _induction_zero_over_zero(weights, tokens):
    score = induction_score_reference(weights, tokens)
    return score if (induction_targets(tokens) >= 0).any() else torch.full_like(score, math.nan)

register(Exercise(
    key="ch01.induction_score", function="induction_score", reference=induction_score_reference,
    ops=ELEMENTARY | SOFTMAX,
    cases=_induction_cases, compare=expect_close_tensor(1e-5, 1e-7), banned=("course_attn",),
    mistakes=(
        Mistake("no token occurs twice here, so your average divides a sum of nothing by 0 "
                "positions, and 0 / 0 is NaN: the docstring says what a head scores then",
                _induction_zero_over_zero),
        Mistake("you read the weight on the earlier occurrence itself (position j); an induction "
                "head looks one past it, at j + 1, the token that followed it",
                _induction_at_occurrence),
        Mistake("you used the first earlier occurrence of the token; when it occurred several "
                "times, use the most recent one", _induction_first_occurrence),
        Mistake("you averaged over every position, counting 0 where the token is new; average "
                "only over the positions whose token occurred before", _induction_every_position),
        Mistake("you averaged each sequence, then the sequences (a mean of means); average over "
                "all counted positions of all sequences at once", _induction_mean_of_means),
        Mistake("you read the weight on the previous position t - 1: that is a previous-token "
                "score, not an induction score", _induction_previous_position),
        Mistake("you read column t of row j + 1: rows are queries and columns keys, so read "
                "weights[b, h, t, j + 1]", _induction_transposed),
    ),
))
