"""Chapter 9's exercises: each typical mistake fails the case meant for it with its own hint, and a
banned call is reported by name. What every exercise must satisfy (the reference and the
solution pass public and hidden cases, a stub is "not answered yet", every declared mistake
names itself) is tested once, for all chapters, in test_exercises_conformance.py.

The wrong solutions below are written as a student would write them; each test names the case
it must fail and a fragment of the hint it must get.
"""

import importlib.util
import itertools
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import course_attn
from course_attn.flash import tile_schedule
from course_attn.grading import get, run_exercise
from course_attn.grading.ch09 import (COUNT_QUESTIONS, COUNT_SIZES, MORE_COUNT_SIZES,
                                      empty_state, split_states, tile_update_reference)
from course_attn.grading.check import grade_here
from course_attn.grading.exercise import hidden_cases

from check_support import assert_banned, assert_fails, assert_fails_on_every_seed, results
from helpers import SOLUTIONS_DIR

ONLINE, MERGE, TILE, MASK, COUNTS = ("ch09.online_softmax", "ch09.merge_states",
                                     "ch09.tile_update", "ch09.tile_mask", "ch09.flash_counts")
INF = float("-inf")


# --- solutions as in solutions/09_flash_attention.ipynb ------------------------------------------

def _ref(m):
    return torch.where(m == INF, torch.zeros_like(m), m)


def online_softmax(x, *, rescale=True, guard=True, use_max=True, dead=True):
    """The solution; the keywords make it one typical mistake or another."""
    m = torch.full(x.shape[:-1], INF, dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    ms, ls = [], []
    for j in range(x.shape[-1]):
        m_new = torch.maximum(m, x[..., j])
        if not use_max:
            l = l + torch.exp(x[..., j])
        else:
            ref = _ref(m_new) if guard else m_new
            l = (l * torch.exp(m - ref) if rescale else l) + torch.exp(x[..., j] - ref)
        m = m_new
        ms.append(m)
        ls.append(l)
    if not use_max:
        out = torch.exp(x) / l[..., None]
    else:
        ref = _ref(m) if guard else m
        total = torch.where(l == 0, torch.ones_like(l), l) if dead else l
        out = torch.exp(x - ref[..., None]) / total[..., None]
    return out, torch.stack(ms, dim=-1), torch.stack(ls, dim=-1)


def merge_states(out_a, lse_a, out_b, lse_b, *, lse_rule="log", weights="share", guard=True):
    """The solution; the keywords make it one typical mistake or another."""
    top = torch.maximum(lse_a, lse_b)
    ref = _ref(top) if guard else top
    w_a, w_b = torch.exp(lse_a - ref), torch.exp(lse_b - ref)
    total = w_a + w_b
    if lse_rule == "max":
        lse = top
    elif lse_rule == "naive":
        lse = torch.log(torch.exp(lse_a) + torch.exp(lse_b))
    else:
        lse = torch.where(total == 0, top, ref + torch.log(total))
    safe = torch.where(total == 0, torch.ones_like(total), total) if guard else total
    if weights == "half":
        w_a = w_b = torch.full_like(total, 0.5)
        safe = torch.ones_like(total)
    elif weights == "swapped":
        w_a, w_b = w_b, w_a
    out = (w_a / safe)[..., None] * out_a + (w_b / safe)[..., None] * out_b
    return out.to(out_a.dtype), lse


def tile_update(m, l, acc, scores, v, *, rescale_acc=True, rescale_l=True, guard=True,
                normalise=False, in_place=False):
    """The solution; the keywords make it one typical mistake or another."""
    m_new = torch.maximum(m, scores.amax(dim=-1))
    ref = _ref(m_new) if guard else m_new
    alpha = torch.exp(m - ref)
    p = torch.exp(scores - ref[..., None])
    if in_place:
        acc.mul_(alpha[..., None]).add_(p @ v)
        l.mul_(alpha).add_(p.sum(-1))
        return m_new, l, acc
    l_new = (l * alpha if rescale_l else l) + p.sum(dim=-1)
    acc_new = (acc * alpha[..., None] if rescale_acc else acc) + p @ v
    if normalise:
        acc_new = acc_new / l_new[..., None]
    return m_new, l_new, acc_new


def tile_mask(tq, tk, block_q, block_k, is_causal=False, window=None, *, floor=False,
              top_left=False, diagonal=True, extra=False, by_index=False, windowed=True,
              strict_last=False, corners=False, future=True):
    """The solution; the keywords make it one typical mistake or another (``corners``: a tile
    is kept when one of its four corners is an allowed pair, as the exercise's words invite;
    ``future=False``: a window without causality reaches back only)."""
    n_q = tq // block_q if floor else -(-tq // block_q)
    n_k = tk // block_k if floor else -(-tk // block_k)
    offset = 0 if top_left else tk - tq
    keep = torch.zeros(n_q, n_k, dtype=torch.bool)
    for i in range(n_q):
        p0, p1 = offset + i * block_q, offset + min((i + 1) * block_q, tq) - 1
        for j in range(n_k):
            k0, k1 = j * block_k, min((j + 1) * block_k, tk) - 1
            ok = True
            if is_causal:
                if by_index:
                    ok = j <= i
                elif not diagonal:
                    ok = j < i
                elif extra:
                    ok = k0 <= p1 + 1
                elif strict_last:
                    ok = k0 < p1
                else:
                    ok = k0 <= p1
            if window is not None and windowed:
                ok = ok and k1 > p0 - window and (is_causal or not future or k0 < p1 + window)
            if corners:
                ok = any((not is_causal or k <= p) and (window is None or abs(p - k) < window)
                         for p in (p0, p1) for k in (k0, k1))
            keep[i, j] = ok
    return keep


def flash_counts(T, block, W, D, *, whole_blocks=False, skip="ok", window_rule="ok",
                 dq_read=True, rowsum=True):
    """The solution; the keywords make it one typical mistake or another."""
    n = T // block if whole_blocks else -(-T // block)
    size = [min(block, T - b * block) for b in range(n)]
    back = {"ok": -(-(W - 1) // block), "floor": W // block - 1, "floor_plus": W // block,
            "none": n}[window_rule]

    def computed(i, j, back=None):
        causal = {"ok": j <= i, "none": True, "strict": j < i}[skip]
        return causal and (back is None or i - j <= back)

    def forward(back):
        return 2 * T * D + T + sum(2 * size[j] * D for i in range(n) for j in range(n)
                                   if computed(i, j, back))

    def backward(causal):
        tiles = [(i, j) for i in range(n) for j in range(n) if not causal or computed(i, j)]
        return (2 * T * D + T if rowsum else 0) + 4 * T * D + sum(
            size[i] * (2 * D + 2 + (2 * D if dq_read else D)) for i, j in tiles)
    return {"causal_elements": forward(None), "window_elements": forward(back),
            "backward_elements": backward(False), "causal_backward_elements": backward(True)}


@pytest.mark.parametrize("key, fn", [(ONLINE, online_softmax), (MERGE, merge_states),
                                     (TILE, tile_update), (MASK, tile_mask),
                                     (COUNTS, flash_counts)])
def test_the_notebooks_solutions_pass_with_the_watch_on(key, fn):
    for cases in [None] + [hidden_cases(key, seed) or None for seed in range(5)]:
        judgement = run_exercise(get(key), fn, cases)
        assert judgement.passed, (judgement.banned, [(r.name, r.message) for r in
                                                     judgement.results if not r.passed])


# --- online_softmax ------------------------------------------------------------------------------

GROWING = "scores that grow along each row: the max changes at every column"
LARGE = "large scores, up to about 1000: exp overflows in float32"
LEADING = "masked entries (-inf), at the start of some rows"
DEAD_ROW = "a row that is all -inf (a query with no key): zeros"


def test_online_softmax_mistakes():
    assert_fails(ONLINE, lambda x: online_softmax(x, rescale=False), GROWING,
                 hint="did not rescale the running sum")
    assert_fails(ONLINE, lambda x: online_softmax(x, use_max=False), LARGE,
                 hint="subtracted no max", message="NaN")
    assert_fails(ONLINE, lambda x: online_softmax(x, guard=False), LEADING,
                 hint="starts with -inf")
    assert_fails(ONLINE, lambda x: online_softmax(x, dead=False), DEAD_ROW,
                 hint="all -inf gives NaN")
    # a rescaled sum passes even where the max never moves (a single column)
    found = results(ONLINE, lambda x: online_softmax(x, rescale=False))
    assert found["a single column"].passed and not found[GROWING].passed


def safe_softmax_in_two_passes(x, *, state="final"):
    """The chapter's safe softmax (the row's max first, then the sums) with the state such an
    answer can report: ``"final"`` the row's max and sum at every column; ``"cumsum"`` the
    running max and the sums up to each column against the final max; ``"rescaled"`` those
    sums brought to the running max afterwards, exp(max - m_j) times each."""
    top = x.amax(dim=-1, keepdim=True)
    e = torch.exp(x - _ref(top))
    total = e.sum(dim=-1, keepdim=True)
    out = e / torch.where(total == 0, torch.ones_like(total), total)
    m = x.cummax(dim=-1).values
    if state == "final":
        return out, top.expand_as(x), total.expand_as(x)
    if state == "cumsum":
        return out, m, e.cumsum(dim=-1)
    return out, m, e.cumsum(dim=-1) * torch.exp(_ref(top) - _ref(m))


def test_online_softmax_in_two_passes_earns_nothing_on_every_seed():
    """Issue 42: the safe softmax in two passes (the max first, then the sums) scored 2/2. The
    exercise returns the state after every column, which one pass holds and two passes do not;
    a max that grows along a row is its central regime, drawn on every seed, and every two-pass
    answer fails it: 0 on each of 100 seeds, the right outputs notwithstanding."""
    for state, hint in (("final", "final max and sum at every column"),
                        ("cumsum", "against the row's final max"), ("rescaled", None)):
        def two_passes(x, state=state):
            return safe_softmax_in_two_passes(x, state=state)
        for case in get(ONLINE).public_cases():      # its softmax is right
            x = case.args[0]
            torch.testing.assert_close(two_passes(x)[0], course_attn.softmax(x, dim=-1))
        if hint:
            assert_fails(ONLINE, two_passes, GROWING, hint=hint)
        for seed in range(100):
            judgement = grade_here(get(ONLINE), two_passes, seed, watch_banned=False)
            assert judgement.credit() == 0, (state, seed, judgement.reason())
    for seed in range(100):
        judgement = grade_here(get(ONLINE), online_softmax, seed, watch_banned=False)
        assert judgement.credit() == 1, (seed, judgement.reason())


def test_an_online_softmax_wrong_only_at_a_rows_edge_fails_on_every_seed():
    """NaN only in a row that starts with -inf (the running max of -inf unguarded), or only in
    a row of -inf (0 / 0): the hidden cases hold both rows on every seed."""
    def unguarded_start(x):
        return online_softmax(x, guard=False)

    def unguarded_dead_row(x):
        return online_softmax(x, dead=False)
    for wrong in (unguarded_start, unguarded_dead_row):
        assert_fails_on_every_seed(ONLINE, wrong)


def test_online_softmax_may_not_call_a_library_softmax_or_logsumexp():
    assert_banned(ONLINE, lambda x: torch.softmax(x, dim=-1), "torch.softmax")
    assert_banned(ONLINE, lambda x: F.softmax(x, dim=-1), "torch.nn.functional.softmax")
    assert_banned(ONLINE, lambda x: x.softmax(-1), "torch.Tensor.softmax")
    assert_banned(ONLINE, lambda x: torch.exp(x - torch.logsumexp(x, -1, keepdim=True)),
                  "torch.logsumexp")
    assert_banned(ONLINE, lambda x: course_attn.softmax(x), "course_attn")


# --- merge_states --------------------------------------------------------------------------------

HALVES = "two halves of 8 keys; B=1, H=2, Tq=3, D=Dv=4"
BIG = "large scores: log-sum-exps near 300"
DEAD = "rows with no key on either side stay out = 0, lse = -inf"


def test_merge_states_equals_attention_over_all_keys_in_any_split_order():
    """The reference, folded over random splits of the keys in random orders, equals attention
    over all keys: the merge is associative and commutative."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    expected = course_attn.scaled_dot_product_attention(q, k, v, scale=1.0)
    scores = q @ k.transpose(-2, -1)
    for trial in range(5):
        order = torch.randperm(5, generator=g).tolist()
        parts = [order[:2], order[2:3], order[3:]]
        states = [((torch.softmax(scores[..., p], -1) @ v[:, :, p]),
                   torch.logsumexp(scores[..., p], -1)) for p in parts]
        for perm in itertools.permutations(states):
            out, lse = perm[0]
            for o, s in perm[1:]:
                out, lse = get(MERGE).reference(out, lse, o, s)
            torch.testing.assert_close(out, expected)
            torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


def test_merge_states_mistakes():
    assert_fails(MERGE, lambda *a: merge_states(*a, lse_rule="max"), HALVES,
                 hint="with a max", message="lse")

    def max_everywhere(out_a, lse_a, out_b, lse_b):
        top = torch.maximum(lse_a, lse_b)
        out = torch.exp(lse_a - top)[..., None] * out_a + torch.exp(lse_b - top)[..., None] * out_b
        return out, top
    assert_fails(MERGE, max_everywhere, HALVES, hint="with a max", message="out")
    assert_fails(MERGE, lambda *a: merge_states(*a, weights="half"), HALVES,
                 hint="averaged the two outputs equally", message="out")
    assert_fails(MERGE, lambda *a: merge_states(*a, weights="swapped"), HALVES,
                 hint="the other side's share")
    assert_fails(MERGE, lambda *a: merge_states(*a, lse_rule="naive"), BIG,
                 hint="overflow")
    assert_fails(MERGE, lambda *a: merge_states(*a, guard=False), DEAD,
                 hint="no key on either side gives NaN")

    def raw_weights(out_a, lse_a, out_b, lse_b):
        lse = merge_states(out_a, lse_a, out_b, lse_b)[1]
        return torch.exp(lse_a)[..., None] * out_a + torch.exp(lse_b)[..., None] * out_b, lse
    assert_fails(MERGE, raw_weights, HALVES, hint="do not add up to one")
    assert_fails(MERGE, lambda *a: merge_states(*a)[0], HALVES, message="should return a tuple")


def test_merge_states_may_not_call_logaddexp_or_the_package():
    def with_logaddexp(out_a, lse_a, out_b, lse_b):
        lse = torch.logaddexp(lse_a, lse_b)
        return merge_states(out_a, lse_a, out_b, lse_b)[0], lse
    assert_banned(MERGE, with_logaddexp, "torch.logaddexp")
    assert_banned(MERGE, get(MERGE).reference, "course_attn")


# --- tile_update ---------------------------------------------------------------------------------

FIRST = "the first tile: an empty state (m = -inf, l = 0, acc = 0); B=1, H=2, Tq=3, Bk=4"
GROWS = "a third tile whose scores are larger than every earlier one: the max grows"
STAYS = "a second tile whose scores are all smaller: the max stays"
ABOVE = ("rows that have seen no key yet and see none in this tile (above the causal diagonal) "
         "stay m = -inf, l = 0, acc = 0")


def test_tile_updates_over_every_tile_give_attention():
    """Folding tile_update's reference over the key tiles of a causal attention, then acc / l,
    is the package's attention (and l's log plus m is the log-sum-exp)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 10, 4, generator=g, dtype=torch.float64) for _ in range(3))
    scores = (q @ k.transpose(-2, -1) / 2.0).masked_fill(~course_attn.causal_mask(10), INF)
    state = empty_state(1, 2, 10, 4, torch.float64)
    for start in range(0, 10, 3):
        state = tile_update_reference(*state, scores[..., start:start + 3],
                                      v[:, :, start:start + 3])
    m, l, acc = state
    torch.testing.assert_close(acc / l[..., None],
                               course_attn.scaled_dot_product_attention(q, k, v, is_causal=True))
    torch.testing.assert_close(m + l.log(), torch.logsumexp(scores, -1))


def test_tile_update_mistakes():
    assert_fails(TILE, lambda *a: tile_update(*a, rescale_acc=False), GROWS,
                 hint="did not rescale the accumulator", message="acc")
    assert_fails(TILE, lambda *a: tile_update(*a, rescale_l=False), GROWS,
                 hint="did not rescale the running sum l", message="l:")
    assert_fails(TILE, lambda *a: tile_update(*a, rescale_acc=False, rescale_l=False), GROWS,
                 hint="rescaled neither")
    assert_fails(TILE, lambda *a: tile_update(*a, normalise=True), STAYS,
                 hint="normalised the accumulator")
    assert_fails(TILE, lambda *a: tile_update(*a, guard=False), ABOVE, hint="give NaN")
    # without the guard, a first tile with no masked score still works: exp(-inf - m) = 0
    found = results(TILE, lambda *a: tile_update(*a, guard=False))
    assert found[FIRST].passed and not found[ABOVE].passed

    def old_max(*a):
        return (a[0],) + tile_update(*a)[1:]
    assert_fails(TILE, old_max, GROWS, hint="returned the old max", message="m:")

    def tile_max(m, l, acc, scores, v):
        new = scores.amax(-1)
        alpha = torch.exp(m - new)
        p = torch.exp(scores - new[..., None])
        return new, l * alpha + p.sum(-1), acc * alpha[..., None] + p @ v
    assert_fails(TILE, tile_max, STAYS, hint="this tile's max")
    # writing into the state given is a mistake of its own
    assert_fails(TILE, lambda *a: tile_update(*a, in_place=True), GROWS,
                 message="changed its argument")


def test_tile_update_may_not_call_a_softmax():
    def with_softmax(m, l, acc, scores, v):
        torch.softmax(scores, -1)
        return tile_update(m, l, acc, scores, v)
    assert_banned(TILE, with_softmax, "torch.softmax")


# --- tile_mask -----------------------------------------------------------------------------------

SQUARE = "causal, 8 x 8 in blocks of 2"
PARTIAL = "causal, 10 x 10 in blocks of 4: a partial last block"
FEWER_Q = "causal, Tq=4 after Tk=12 (bottom-right), blocks of 4"
UNEQUAL = "causal, block_q=4 and block_k=2, 12 x 12"
WINDOW = "causal with a window of 5, 16 x 16 in blocks of 4"
TWO_SIDED = "a window of 3 without causality, 12 x 12 in blocks of 2"
AT_LAST = ("causal, 9 x 9, block_q=3 and block_k=2: key blocks that start at a query block's "
           "last position")


def test_the_tile_mask_reference_is_the_element_mask_reduced_over_tiles():
    """Brute force: a tile is kept when any of its (query, key) pairs passes the package's mask."""
    mask_of = get(MASK).reference
    for tq, tk, bq, bk, causal, window in [(7, 11, 3, 2, True, None), (9, 9, 2, 4, True, 3),
                                           (8, 5, 4, 3, True, None), (10, 10, 3, 3, False, 2)]:
        full = course_attn.attention_mask(tq, tk, is_causal=causal, window=window)
        tiles = mask_of(tq, tk, bq, bk, causal, window)
        for i, j in itertools.product(range(tiles.shape[0]), range(tiles.shape[1])):
            assert bool(tiles[i, j]) == bool(full[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any())
        assert torch.equal(tile_mask(tq, tk, bq, bk, causal, window), tiles)


def test_tile_mask_mistakes():
    assert_fails(MASK, lambda *a, **k: tile_mask(*a, **k, diagonal=False), SQUARE,
                 hint="skips the tiles on the diagonal")
    assert_fails(MASK, lambda *a, **k: tile_mask(*a, **k, extra=True), SQUARE,
                 hint="entirely above the diagonal")
    assert_fails(MASK, lambda *a, **k: tile_mask(*a, **k, strict_last=True), AT_LAST,
                 hint="exactly at the position of the block's last query")
    for seed in range(10):  # the hidden cases catch it on every seed
        found = results(MASK, lambda *a, **k: tile_mask(*a, **k, strict_last=True),
                        hidden_cases(MASK, seed))
        assert not all(r.passed for r in found.values()), seed
    assert_fails(MASK, lambda *a, **k: tile_mask(*a, **k, floor=True), PARTIAL,
                 hint="floor division", message="shape")
    assert_fails(MASK, lambda *a, **k: tile_mask(*a, **k, top_left=True), FEWER_Q,
                 hint="aligned top-left")
    assert_fails(MASK, lambda *a, **k: tile_mask(*a, **k, by_index=True), UNEQUAL,
                 hint="compared block numbers")
    assert_fails(MASK, lambda *a, **k: tile_mask(*a, **k, windowed=False), WINDOW,
                 hint="ignored the window")
    assert_fails(MASK, lambda *a, **k: tile_mask(*a, **k, windowed=False), TWO_SIDED,
                 hint="ignored the window")

    def one_more(tq, tk, bq, bk, is_causal=False, window=None):
        return tile_mask(tq, tk, bq, bk, is_causal, None if window is None else window + 1)
    assert_fails(MASK, one_more, WINDOW, hint="one position too many")


def test_tile_mask_checking_only_the_corners_loses_points_on_every_seed():
    """Issue 42: keeping a tile when one of its four corners is allowed scored 2/2 on about
    97% of gradings; a band crossing a tile between its corners (a window of 2 or 3, key
    blocks 3 wider than query blocks) is a regime drawn on every seed now."""
    def corners_only(*args, **kwargs):
        return tile_mask(*args, **kwargs, corners=True)
    for seed in range(100):
        judgement = grade_here(get(MASK), corners_only, seed, watch_banned=False)
        assert judgement.credit() < 1, seed


def test_tile_mask_ignoring_the_future_half_of_a_two_sided_window_earns_nothing():
    """Issue 42: a window without causality that reaches back only scored 1.6/2 (as one regime
    of eleven, and the block regimes its case fell in). It is wrong on every two-sided case,
    whatever the blocks: that regime is central now, and the answer earns 0 on each of 100
    seeds, while an answer wrong only where a causal window meets a tile between its corners
    keeps its share."""
    def past_only(*args, **kwargs):
        return tile_mask(*args, **kwargs, future=False)
    assert_fails(MASK, past_only, TWO_SIDED)
    assert results(MASK, past_only)[WINDOW].passed
    for seed in range(100):
        judgement = grade_here(get(MASK), past_only, seed, watch_banned=False)
        assert judgement.credit() == 0, (seed, judgement.reason())
    corners = grade_here(get(MASK), lambda *a, **k: tile_mask(*a, **k, corners=True), 0,
                         watch_banned=False)
    assert 0 < corners.credit() < 1, corners.reason()


def test_tile_mask_may_not_call_the_package():
    def with_the_package(tq, tk, bq, bk, is_causal=False, window=None):
        course_attn.attention_mask(tq, tk, is_causal=is_causal, window=window)
        return tile_mask(tq, tk, bq, bk, is_causal, window)
    assert_banned(MASK, with_the_package, "course_attn")


# --- flash_counts --------------------------------------------------------------------------------

def counts_of_sizes(seeds=range(10)):
    """The public sets of sizes and the hidden ones drawn with ``seeds``, each once."""
    sizes = [COUNT_SIZES, MORE_COUNT_SIZES]
    for seed in seeds:
        for case in hidden_cases(COUNTS, seed):
            if dict(case.kwargs) not in sizes:
                sizes.append(dict(case.kwargs))
    return sizes


def traffic_by_schedule(T, block, W, D):
    """(a) to (d) counted from the package's tile schedule (the tiles the flash forward
    computes, each listed once): what each query block and each computed tile loads and
    stores, and, for the backward, D's step, each key block's K, V, dK and dV and each tile's
    reads of its query block."""
    def rows(b):
        return min(block, T - b * block)

    def forward(window):
        tiles = tile_schedule(T, T, block, block, is_causal=True, window=window)
        return sum(2 * rows(i) * D + rows(i) for i in range(-(-T // block))) + sum(
            2 * rows(j) * D for _, j in tiles)

    def backward(causal):
        tiles = tile_schedule(T, T, block, block, is_causal=causal)
        key_blocks = sum(4 * rows(j) * D for j in range(-(-T // block)))
        return (2 * T * D + T) + key_blocks + sum(rows(i) * (4 * D + 2) for i, _ in tiles)
    return {"causal_elements": forward(None), "window_elements": forward(W),
            "backward_elements": backward(False), "causal_backward_elements": backward(True)}


def test_the_counts_are_the_tile_schedules_on_public_and_hidden_sizes():
    sizes = counts_of_sizes()
    assert len(sizes) == 2 + 6 * 10
    for size in sizes:
        right = get(COUNTS).reference(**size)
        assert right == traffic_by_schedule(**size) == flash_counts(**size), size
    # the chapter's sizes: a causal forward loads 136 of the 256 tiles' keys and values, so its
    # traffic lies between the tiled forward's (section 1) without a skip and half of it
    T, block, D = COUNT_SIZES["T"], COUNT_SIZES["block"], COUNT_SIZES["D"]
    no_skip = T * D + (T // block) * 2 * T * D + T * D + T
    causal = get(COUNTS).reference(**COUNT_SIZES)["causal_elements"]
    assert causal == no_skip - (256 - 136) * 2 * block * D


def test_flash_counts_hidden_sizes_cover_their_regimes():
    for seed in range(20):
        multiple, partial, short, long, first_key, second_key = counts_of_sizes([seed])[2:]
        assert multiple["T"] % multiple["block"] == 0 == multiple["W"] % multiple["block"]
        assert partial["T"] % partial["block"] and partial["W"] % partial["block"] >= 2
        assert 2 <= short["W"] < short["block"]
        assert long["W"] >= long["T"] and long["T"] % long["block"]
        for size, past in ((first_key, 1), (second_key, 2)):
            assert size["W"] % size["block"] == past and size["block"] < size["W"] < size["T"]
        for size in (multiple, partial, short, long, first_key, second_key):
            assert size["T"] >= 2 * size["block"]


def test_flash_counts_mistakes():
    cases = [case.name for case in get(COUNTS).public_cases()]
    a, b, c, d, a2, b2, c2, d2 = cases
    for part in (a, d):
        assert_fails(COUNTS, lambda **size: flash_counts(**size, skip="none"), part,
                     hint="counted every tile", message="too large")
        assert_fails(COUNTS, lambda **size: flash_counts(**size, skip="strict"), part,
                     hint="skipped the diagonal", message="too small")
    assert_fails(COUNTS, lambda **size: flash_counts(**size, window_rule="none"), b,
                 hint="ignored the window", message="too large")
    assert_fails(COUNTS, lambda **size: flash_counts(**size, window_rule="floor"), b,
                 hint="W // block key blocks", message="too small")
    assert_fails(COUNTS, lambda **size: flash_counts(**size, window_rule="floor_plus"), b2,
                 hint="W // block + 1 key blocks", message="too small")
    for part in (c, d2):
        assert_fails(COUNTS, lambda **size: flash_counts(**size, dq_read=False), part,
                     hint="without reading it", message="too small")
        assert_fails(COUNTS, lambda **size: flash_counts(**size, rowsum=False), part,
                     hint="rowsum(dO * O)", message="too small")
    for case in (a2, b2, c2, d2):
        assert_fails(COUNTS, lambda **size: flash_counts(**size, whole_blocks=True), case,
                     message="too small")
    for case in cases[:4]:                       # the chapter's sizes: T and W whole blocks
        assert results(COUNTS, lambda **size: flash_counts(**size, whole_blocks=True))[case].passed
    assert_fails(COUNTS, lambda **size: [1, 2, 3, 4], a, message="should return a dict")


def test_flash_counts_the_chapters_formulas_earn_nothing():
    """Issue 42: (c) and (d) were the chapter's standard_traffic and tiled_traffic verbatim.
    Those formulas (the forward's traffic, every tile loaded) answer none of the four now."""
    def chapters(T, block, W, D):
        tiled = T * D + -(-T // block) * 2 * T * D + T * D + T
        return dict.fromkeys(COUNT_QUESTIONS, tiled)
    for seed in range(100):
        judgement = grade_here(get(COUNTS), chapters, seed, watch_banned=False)
        assert judgement.credit() == 0, (seed, judgement.reason())


def test_flash_counts_never_shows_the_right_answer():
    for result in run_exercise(get(COUNTS), lambda **size: dict.fromkeys(COUNT_QUESTIONS,
                                                                          12345)).results:
        assert not result.passed
        assert result.message.endswith("is too large") or result.message.endswith("too small")
        assert "times" not in result.message
        for size in (COUNT_SIZES, MORE_COUNT_SIZES):
            for value in flash_counts(**size).values():
                assert str(value) not in result.message and f"{value:,}" not in result.message
                assert str(value) not in result.hint


def test_flash_counts_pasted_as_constants_fails_the_hidden_cases_of_every_seed():
    pasted = {str(size): flash_counts(**size) for size in (COUNT_SIZES, MORE_COUNT_SIZES)}

    def flash_counts_pasted(T, block, W, D):     # the public answers, typed in
        return pasted.get(str(dict(T=T, block=block, W=W, D=D)), pasted[str(COUNT_SIZES)])
    assert run_exercise(get(COUNTS), flash_counts_pasted).passed
    for seed in range(20):
        judgement = run_exercise(get(COUNTS), flash_counts_pasted, hidden_cases(COUNTS, seed))
        assert not judgement.passed, seed
        assert sum(not r.passed for r in judgement.results) >= 12, seed


def test_flash_counts_may_not_call_the_package():
    def with_the_package(**size):
        course_attn.causal_mask(2)
        return flash_counts(**size)
    assert_banned(COUNTS, with_the_package, "course_attn")


def test_split_states_are_attention_over_each_side():
    out_a, lse_a, out_b, lse_b = split_states(1, 1, 3, 6, 4, 4, 2, 0, dtype=torch.float64)
    assert out_a.shape == (1, 1, 3, 4) and lse_a.shape == (1, 1, 3)
    assert torch.isfinite(lse_a).all() and torch.isfinite(lse_b).all()


# --- the notebook's new exercises, from its own cells --------------------------------------------

NOTEBOOK = SOLUTIONS_DIR / "09_flash_attention.ipynb"
CHUNKED, EXPONENT, TRITON = ("ch09.chunked_attention", "ch09.memory_exponent",
                             "ch09.triton_forward")


def notebook_module(tmp_path_factory, *grade_ids):
    """The notebook's cells ``grade_ids`` (the setup cell first), written to a file and imported
    as a module: a Triton kernel compiled for a GPU needs its source in a file, and none of
    this is the package's code, as a student's is not."""
    import importlib.util

    import nbformat
    cells = {c.metadata.get("nbgrader", {}).get("grade_id"): c.source
             for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"}
    folder = tmp_path_factory.mktemp("notebook")
    name = "ch09_" + "_".join(g.rsplit("-", 1)[-1] for g in grade_ids[:1]) + folder.name
    path = folder / f"{name}.py"
    path.write_text("\n\n".join([cells["ch09-setup"]] + [cells[g] for g in grade_ids]))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    return notebook_module(tmp_path_factory, "ch09-chunked_attention-given",
                           "ch09-chunked_attention-solution")


PADDED = "a padded query: every key of row 2 masked with PAD, as a padding token's row"


def test_the_given_chunked_attention_is_the_graders_and_fails_on_padded_rows_only(chunked):
    from course_attn.grading.ch09 import chunked_attention_given
    for case in get(CHUNKED).public_cases():
        out = chunked.chunked_attention_given(*case.args)
        assert torch.equal(out.nan_to_num(7.0),
                           chunked_attention_given(*case.args).nan_to_num(7.0)), case.name
    found = results(CHUNKED, chunked.chunked_attention_given)
    failed = {name for name, r in found.items() if not r.passed}
    assert failed == {PADDED, "a causal mask and two padded queries, chunks of 2"}
    assert "running max starts above every one of its scores" in found[PADDED].hint
    for seed in range(10):  # a hidden case with a padded row on every seed
        judgement = run_exercise(get(CHUNKED), chunked.chunked_attention_given,
                                 hidden_cases(CHUNKED, seed))
        assert not judgement.passed, seed


def test_chunked_attention_half_repairs_are_named(chunked):
    def hidden_nan(q, k, v, bias, chunk):     # the NaN turned into zeros
        return torch.nan_to_num(chunked.chunked_attention_given(q, k, v, bias, chunk))

    def large_negative(q, k, v, bias, chunk):  # a "large" negative start, above finfo.min
        scale = q.shape[-1] ** -0.5
        top = torch.full((q.shape[0],), -1e9)
        mass, numer = torch.zeros(q.shape[0]), torch.zeros(q.shape[0], v.shape[-1])
        for start in range(0, k.shape[0], chunk):
            s = (q @ k[start:start + chunk].T) * scale + bias[:, start:start + chunk]
            new_top = torch.maximum(top, s.max(dim=-1).values)
            w = torch.exp(s - new_top[:, None])
            shrink = torch.exp(top - new_top)
            mass, numer = mass * shrink + w.sum(-1), numer * shrink[:, None] + w @ v[start:start
                                                                                  + chunk]
            top = new_top
        return numer / mass[:, None]
    assert_fails(CHUNKED, hidden_nan, PADDED, hint="your padded rows give zeros")
    assert_fails(CHUNKED, large_negative, PADDED, hint="running max starts above")


def test_chunked_attention_in_two_passes_scores_0_naming_the_second_read(chunked):
    """Issue 31: a global max first and the sums after scored 3/3, though it is not the online
    softmax the exercise repairs. It reads k twice; so does a copy of k read after."""
    def two_passes(q, k, v, bias, chunk):
        scale = q.shape[-1] ** -0.5
        top = torch.full((q.shape[0],), float("-inf"))
        for start in range(0, k.shape[0], chunk):
            s = (q @ k[start:start + chunk].T) * scale + bias[:, start:start + chunk]
            top = torch.maximum(top, s.max(dim=-1).values)
        mass, numer = torch.zeros(q.shape[0]), torch.zeros(q.shape[0], v.shape[-1])
        for start in range(0, k.shape[0], chunk):
            s = (q @ k[start:start + chunk].T) * scale + bias[:, start:start + chunk]
            w = torch.exp(s - top[:, None])
            mass, numer = mass + w.sum(-1), numer + w @ v[start:start + chunk]
        return numer / mass[:, None]

    def copied_first(q, k, v, bias, chunk):
        return chunked.chunked_attention(q, k.clone(), v, bias, chunk)
    for fn, reason in ((two_passes, "reads k a second time, in torch.Tensor.matmul (it runs "
                                    "aten.mm)"),
                       (copied_first, "makes a copy of k: torch.Tensor.clone (it runs "
                                      "aten.clone)")):
        judgement = run_exercise(get(CHUNKED), fn)
        assert all(r.passed for r in judgement.results), fn.__name__   # right outputs
        assert judgement.credit() == 0 and judgement.reason().startswith(reason), \
            judgement.reason()
    for seed in range(5):   # the one-pass repair reads each chunk once on every hidden case
        assert run_exercise(get(CHUNKED), chunked.chunked_attention,
                            hidden_cases(CHUNKED, seed)).passed


def test_chunked_attention_may_not_call_a_softmax_or_the_package(chunked):
    def with_softmax(q, k, v, bias, chunk):
        return torch.softmax(q @ k.T / q.shape[-1] ** 0.5 + bias, dim=-1) @ v
    assert_banned(CHUNKED, with_softmax, "softmax")

    def with_sdpa(q, k, v, bias, chunk):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert_banned(CHUNKED, with_sdpa, "scaled_dot_product_attention")


# --- memory_exponent -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return notebook_module(tmp_path_factory, "ch09-memory_exponent-given",
                           "ch09-memory_exponent-solution")


def test_the_given_attentions_are_the_graders(measured):
    from course_attn.grading import ch09
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(100, 16, generator=g) for _ in range(3))
    assert list(measured.ATTENTIONS) == list(ch09.ATTENTIONS) == ["naive", "tiled", "growing"]
    for name in ("naive", "tiled", "growing"):
        assert torch.equal(measured.ATTENTIONS[name](q, k, v), ch09.ATTENTIONS[name](q, k, v))
        expected = course_attn.scaled_dot_product_attention(q[None, None], k[None, None],
                                                            v[None, None])[0, 0]
        torch.testing.assert_close(measured.ATTENTIONS[name](q, k, v), expected)


def test_memory_exponent_cannot_be_answered_without_measuring():
    """Issue 31: returning the chapter's {naive: 2, tiled: 1} scored full marks. The growing
    tiles have no formula; at heads of 16 and 64 their exponents differ by more than both
    tolerances, so any number typed in for them fails every seed."""
    from course_attn.grading.judge import Answer, judge_case
    exercise = get(EXPONENT)
    for seed in range(5):
        cases = hidden_cases(EXPONENT, seed)
        expected = [exercise.expected(case) for case in cases]
        for guess in [1.0 + i / 20 for i in range(21)]:
            typed_in = {"naive": 2.0, "tiled": 1.0, "growing": guess}
            judged = [judge_case(exercise, case, want, Answer(value=typed_in[case.args[0]]))
                      for case, want in zip(cases, expected)]
            assert not all(result.passed for result in judged), (guess, seed)


def test_memory_exponent_no_answer_of_the_name_and_width_alone_passes_any_seed():
    """Issue 42: a table keyed by name and head width (nothing measured) scored 3/3 on about 80%
    of gradings. Every seed now asks about the growing tiles at heads of 64 on short and on long
    lengths, whose accepted answers (the exponent, give or take its tolerance) do not overlap:
    whatever a table holds for ("growing", 64), it fails one of them."""
    from course_attn.grading.ch09 import _exponent_tolerance
    exercise = get(EXPONENT)
    for seed in range(5):
        accepted = []
        for case in hidden_cases(EXPONENT, seed):
            name, lengths, dim = case.args
            if name == "growing" and dim == 64:
                centre = exercise.expected(case)
                tolerance = _exponent_tolerance(name, tuple(lengths), dim)
                accepted.append((centre - tolerance, centre + tolerance))
        (low_a, high_a), (low_b, high_b) = sorted(accepted)
        assert high_a < low_b, (seed, accepted)


def test_memory_exponent_typed_in_or_the_largest_allocation_earns_nothing():
    """Issue 42: one typed number earned 1.5/3, a dictionary by name 1/3, the largest single
    allocation instead of the peak 2/3. The growing tiles are the exercise's central regimes:
    each of these fails one of them on every seed, and earns 0."""
    from course_attn.grading.ch09 import _with_rule
    table = {("naive", 16): 1.97, ("tiled", 16): 1.0, ("growing", 16): 1.47,
             ("growing", 64): 1.3}

    def typed(name, lengths, dim):
        return 1.5

    def by_name(name, lengths, dim):
        return {"naive": 2.0, "tiled": 1.0, "growing": 1.3}[name]

    def by_name_and_width(name, lengths, dim):
        return table.get((name, dim), {"naive": 2.0, "tiled": 1.0}.get(name, 1.3))
    largest = _with_rule(largest=True)
    largest.__name__ = "largest"
    for seed in range(2):
        for answer in (typed, by_name, by_name_and_width, largest):
            judgement = grade_here(get(EXPONENT), answer, seed, watch_banned=False)
            assert judgement.credit() == 0, (answer.__name__, seed, judgement.reason())


def test_the_measured_exponent_is_stable_and_separates_naive_from_tiled():
    """The reference measures the same bytes on every run (the peak does not depend on timing or
    on the values), and its tolerance is far below the gap between the two attentions."""
    from course_attn.grading.ch09 import _exponent_tolerance, memory_exponent_reference
    for case in [c for seed in range(3) for c in hidden_cases(EXPONENT, seed)][:4]:
        name, lengths, dim = case.args
        first = memory_exponent_reference(*case.args)
        assert memory_exponent_reference(*case.args) == first
        expected = {"naive": (1.6, 2.05), "tiled": (0.95, 1.05), "growing": (1.05, 1.6)}[name]
        assert expected[0] <= first <= expected[1], (case.name, first)
        assert _exponent_tolerance(name, tuple(lengths), dim) < 0.3


def test_memory_exponent_mistakes(measured):
    attentions = measured.ATTENTIONS

    def total_allocated(name, lengths, dim):
        totals = []
        for t in lengths:
            q, k, v = (torch.randn(t, dim) for _ in range(3))
            with measured.profile(activities=[measured.ProfilerActivity.CPU],
                                  profile_memory=True) as prof:
                attentions[name](q, k, v)
            totals.append(sum(e.nbytes() for e in prof.profiler.kineto_results.events()
                              if e.name() == "[memory]" and e.nbytes() > 0))
        x = [math.log(t) for t in lengths]
        y = [math.log(b) for b in totals]
        return float(np.polyfit(x, y, 1)[0])
    assert_fails(EXPONENT, total_allocated, "tiled, lengths (128, 256, 512), dim 16",
                 hint="added up every allocation", message="too large")

    def against_t(name, lengths, dim):
        with_log = measured.memory_exponent(name, lengths, dim)   # a slope in log-log, undone
        return with_log * math.log(lengths[-1] / lengths[0]) / (lengths[-1] - lengths[0])
    assert_fails(EXPONENT, against_t, "naive, lengths (128, 256, 512), dim 16",
                 message="too small")


def test_memory_exponent_counting_the_inputs_passes(measured):
    def peak_with_inputs(name, t, dim):  # q, k, v made inside the profiled region
        with measured.profile(activities=[measured.ProfilerActivity.CPU],
                              profile_memory=True) as prof:
            q, k, v = (torch.randn(t, dim) for _ in range(3))
            measured.ATTENTIONS[name](q, k, v)
        held = peak = 0
        for e in sorted((e for e in prof.profiler.kineto_results.events()
                         if e.name() == "[memory]"), key=lambda e: e.start_ns()):
            held += e.nbytes()
            peak = max(peak, held)
        return peak

    def with_inputs(name, lengths, dim):
        peaks = [peak_with_inputs(name, t, dim) for t in lengths]
        return float(np.polyfit(np.log(lengths), np.log(peaks), 1)[0])
    judgement = run_exercise(get(EXPONENT), with_inputs)
    assert judgement.passed, [(r.name, r.message) for r in judgement.results]
    assert run_exercise(get(EXPONENT), measured.memory_exponent).passed


def test_memory_exponent_may_not_call_the_benchmark(measured):
    from course_attn.bench import peak_memory_bytes

    def with_bench(name, lengths, dim):
        peaks = [peak_memory_bytes(lambda: measured.ATTENTIONS[name](
            *(torch.randn(t, dim) for _ in range(3))), "cpu") for t in lengths]
        return float(np.polyfit(np.log(lengths), np.log(peaks), 1)[0])
    assert_banned(EXPONENT, with_bench, "peak_memory_bytes")    # named where it is defined


# --- triton_forward ------------------------------------------------------------------------------

NO_TRITON = importlib.util.find_spec("triton") is None


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """The notebook's kernel and launcher; without CUDA, under Triton's interpreter, switched on
    while this module's tests run (the setup cell sets it before importing triton; the kernel
    is an interpreted one from its decoration on)."""
    if NO_TRITON:
        pytest.skip("triton is not installed (pip install triton, on Linux)")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    if not torch.cuda.is_available() and not isinstance(tl.zeros, InterpretedFunction):
        pytest.skip("triton.language was imported in this process before TRITON_INTERPRET=1 "
                    "was set: run this file on its own")
    before = os.environ.get("TRITON_INTERPRET")
    module = notebook_module(tmp_path_factory, "ch09-triton_forward-solution")
    yield module
    if before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = before


def test_the_kernel_passes_public_and_hidden_cases_with_the_watch_on(kernel):
    for cases in (None, hidden_cases(TRITON, 0), hidden_cases(TRITON, 1)):
        judgement = run_exercise(get(TRITON), kernel.triton_forward, cases)
        assert judgement.passed, (judgement.banned, [(r.name, r.message)
                                                     for r in judgement.results if not r.passed])


def wrong_kernel(kernel, tmp_path_factory, old, new):
    """The notebook's kernel with ``old`` replaced by ``new`` in its source, as a student's
    mistake, and its launcher."""
    import nbformat
    source = next(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells
                  if c.metadata.get("nbgrader", {}).get("grade_id") ==
                  "ch09-triton_forward-solution")
    assert old in source, old
    folder = tmp_path_factory.mktemp("wrong")
    path = folder / f"wrong_{folder.name}.py"
    setup = "import math\nimport torch\nimport triton\nimport triton.language as tl\n"
    path.write_text(setup + source.replace(old, new))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.triton_forward


@pytest.mark.parametrize("old, new, case, hint", [
    ("acc = acc * alpha[:, None] + tl.dot(p, v)", "acc = acc + tl.dot(p, v)",
     "Tq = 16, Tk = 64, D = 16: scores that grow from tile to tile", "rescale the accumulator"),
    ("l = l * alpha + tl.sum(p, axis=1)", "l = l + tl.sum(p, axis=1)",
     "Tq = 16, Tk = 64, D = 16: scores that grow from tile to tile", "rescale the running sum"),
    ("        s = tl.where(cols[None, :] < TK, s, float(\"-inf\"))  # padding keys weigh nothing\n",
     "", "Tq = 20, Tk = 40, D = 32: partial last blocks of queries and of keys", "padding"),
    ("m = tl.full((BLOCK,), float(\"-inf\"), tl.float32)", "m = tl.zeros((BLOCK,), tl.float32)",
     "Tq = 16, Tk = 32, D = 16: a query whose scores are all below -100", "starts at 0"),
    ("tl.dot(q, tl.trans(k)) * scale", "tl.dot(q, tl.trans(k))",
     "Tq = Tk = 16, D = 16: one tile", "1/sqrt(D)"),
])
def test_triton_forward_mistakes(kernel, tmp_path_factory, old, new, case, hint):
    assert_fails(TRITON, wrong_kernel(kernel, tmp_path_factory, old, new), case, hint=hint)


def test_triton_forward_may_not_compute_outside_the_kernel(kernel):
    def in_torch(q, k, v):
        s = q @ k.T / math.sqrt(q.shape[1])
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return (e / e.sum(-1, keepdim=True)) @ v
    judgement = run_exercise(get(TRITON), in_torch)
    assert judgement.banned and "aten.mm" in judgement.reason()

    def with_sdpa(q, k, v):
        return F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
    assert_banned(TRITON, with_sdpa, "scaled_dot_product_attention")

    def in_numpy(q, k, v):
        s = q.numpy() @ k.numpy().T / math.sqrt(q.shape[1])
        e = np.exp(s - s.max(-1, keepdims=True))
        return torch.from_numpy((e / e.sum(-1, keepdims=True)) @ v.numpy())
    assert_banned(TRITON, in_numpy, "torch.Tensor.numpy")


def test_triton_forward_may_not_call_the_packages_kernels(kernel):
    from course_attn import triton_flash

    def with_the_package(q, k, v):
        return triton_flash.triton_attention(q[None, None], k[None, None], v[None, None])[0, 0]
    assert_banned(TRITON, with_the_package, "course_attn.triton_flash")


# --- flash_backward (implement): the tiled backward with a gradient on lse too ------------------

FLASH_BACKWARD = "ch09.flash_backward"


def flash_backward(q, k, v, out, lse, out_b, lse_b, dout, is_causal=False, block=16, *,
                   edge=True):
    """Gradients (dq, dk, dv) of this part (q over k, v: out (B, H, Tq, Dv), lse (B, H, Tq)),
    merged with another part (out_b, lse_b, constants), from dout (B, H, Tq, Dv), the gradient
    of the merged output; P recomputed tile by tile. ``edge=False``: the skip drops a tile
    whose first key is its block's last query."""
    tq, tk, scale = q.shape[-2], k.shape[-2], 1 / math.sqrt(q.shape[-1])
    offset = tk - tq                                   # query i sits at position Tk - Tq + i
    top = torch.maximum(lse, lse_b)
    ref = torch.where(top == -math.inf, 0.0, top)
    a, b = torch.exp(lse - ref), torch.exp(lse_b - ref)
    w = a / torch.where(a + b == 0, 1.0, a + b)        # this part's share of the merge
    merged = w[..., None] * out + (1 - w)[..., None] * out_b
    dout_part = w[..., None] * dout
    dlse = w * (dout * (out - merged)).sum(dim=-1)
    row_term = (dout_part * out).sum(dim=-1) - dlse
    lse = torch.where(lse == -math.inf, 0.0, lse)      # rows with no key: P = 0 anyway
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for k0 in range(0, tk, block):                     # each key block owns its dK, dV
        kb, vb = k[..., k0:k0 + block, :], v[..., k0:k0 + block, :]
        cols = torch.arange(k0, k0 + kb.shape[-2])
        for q0 in range(0, tq, block):
            rows = offset + torch.arange(q0, min(q0 + block, tq))
            if is_causal and (k0 > int(rows[-1]) if edge else k0 >= int(rows[-1])):
                continue                               # above the diagonal: nothing to add
            qb, dob = q[..., q0:q0 + block, :], dout_part[..., q0:q0 + block, :]
            s = qb @ kb.transpose(-2, -1) * scale
            if is_causal:
                s = s.masked_fill(cols[None, :] > rows[:, None], -math.inf)
            p = torch.exp(s - lse[..., q0:q0 + block, None])          # recomputed
            dv[..., k0:k0 + block, :] += p.transpose(-2, -1) @ dob
            ds = p * (dob @ vb.transpose(-2, -1) - row_term[..., q0:q0 + block, None])
            dq[..., q0:q0 + block, :] += ds @ kb * scale
            dk[..., k0:k0 + block, :] += ds.transpose(-2, -1) @ qb * scale
    return dq, dk, dv


def test_flash_backward_skipping_the_edge_tile_loses_points_on_every_seed():
    """Issue 42: a skip of ``k0 >= last query`` drops the tile whose first key is the block's
    last query (its one allowed pair) and scored 4/4 on about 75% of gradings; that tile is a
    regime drawn on every seed now, and the answer loses points on each of 100 seeds."""
    def skipping_the_edge(*args, **kwargs):
        return flash_backward(*args, **kwargs, edge=False)
    assert run_exercise(get(FLASH_BACKWARD), skipping_the_edge).passed   # public cases miss it
    for seed in range(100):
        judgement = grade_here(get(FLASH_BACKWARD), skipping_the_edge, seed, watch_banned=False)
        assert judgement.credit() < 1, seed


def test_flash_backward_the_notebooks_solution_passes_on_every_seed():
    for cases in [None] + [hidden_cases(FLASH_BACKWARD, seed) for seed in range(10)]:
        judgement = run_exercise(get(FLASH_BACKWARD), flash_backward, cases)
        assert judgement.passed, judgement.reason()


def test_flash_backward_reference_is_autograds():
    """The reference (the merge's dO and dlse, then the dense formulas) against autograd
    through this part's softmax and logsumexp and the package's merge of the two parts, for
    a loss sum(O_m * dout), on the public and hidden cases."""
    from course_attn.flash import merge_attention_states
    from course_attn.grading.ch09 import _visible
    exercise = get(FLASH_BACKWARD)
    for case in exercise.public_cases() + hidden_cases(FLASH_BACKWARD, 0):
        q, k, v, out, lse, out_b, lse_b, dout, is_causal, block = case.args
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~_visible(q.shape[-2], k.shape[-2], is_causal), -math.inf)
        out_, lse_ = torch.softmax(s, -1).nan_to_num(0.0) @ v, torch.logsumexp(s, -1)
        merged, _ = merge_attention_states(out_, lse_, out_b, lse_b)
        for got, want in zip(torch.autograd.grad((merged * dout).sum(), (q, k, v)),
                             exercise.expected(case)):
            torch.testing.assert_close(got, want)


def test_flash_backward_mistakes_are_named():
    from course_attn.grading.ch09 import _backward_with
    merged = "Tq = Tk = 40 in blocks of 16, merged with another part"
    empty = "Tq = Tk = 40 in blocks of 16, the other part empty (the chapter's backward)"
    for merge, mistake, hint in ((dict(weight=False), {}, "as if this part were the whole"),
                                 (dict(through_lse=False), {}, "right where the other part"),
                                 (dict(against="other"), {}, "treats the merged lse as fixed"),
                                 ({}, {"dlse_sign": -1.0}, "wrong sign"),
                                 ({}, {"rowsum": False}, "row term"),
                                 ({}, {"with_lse": False}, "not normalised"),
                                 ({}, {"times_p": False}, "not weighted by P")):
        assert_fails(FLASH_BACKWARD, _backward_with(merge, **mistake), merged, hint=hint)
    # the chapter's backward (the part taken as the whole) passes where the other part is empty
    for merge in (dict(weight=False), dict(through_lse=False)):
        found = results(FLASH_BACKWARD, _backward_with(merge))
        assert [name for name, r in found.items() if r.passed] == [empty]


def test_flash_backward_the_chapters_backward_earns_nothing_on_every_seed():
    """Issue 42: the exercise was the chapter's tiled_backward plus one term, dlse given. Now
    the part's gradients come from the merged output's, and the student derives what the merge
    sends back; the chapter's backward run on dout, right only where the other part is empty,
    fails the central regime (merged with another part) and earns 0 on each of 100 seeds."""
    from course_attn.grading.ch09 import _flash_grads

    def chapters(q, k, v, out, lse, out_b, lse_b, dout, is_causal=False, block=16):
        return _flash_grads(q, k, v, out, lse, dout, torch.zeros_like(lse), is_causal)
    for seed in range(100):
        judgement = grade_here(get(FLASH_BACKWARD), chapters, seed, watch_banned=False)
        assert judgement.credit() == 0, (seed, judgement.reason())


def test_flash_backward_that_holds_the_whole_table_scores_0():
    """Right gradients from the dense formulas: the (Tq, Tk) table of P is what the tiles
    avoid, and the guard sees it made."""
    def dense(q, k, v, out, lse, out_b, lse_b, dout, is_causal=False, block=16):
        scale = 1 / math.sqrt(q.shape[-1])
        top = torch.maximum(lse, lse_b)
        ref = torch.where(top == -math.inf, 0.0, top)
        a, b = torch.exp(lse - ref), torch.exp(lse_b - ref)
        w = a / torch.where(a + b == 0, 1.0, a + b)
        merged = w[..., None] * out + (1 - w)[..., None] * out_b
        d_out, dlse = w[..., None] * dout, w * (dout * (out - merged)).sum(-1)
        s = q @ k.transpose(-2, -1) * scale
        if is_causal:
            tq, tk = s.shape[-2:]
            s = s.masked_fill(~torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq), -math.inf)
        p = torch.exp(s - torch.where(lse == -math.inf, 0.0, lse)[..., None])
        ds = p * (d_out @ v.transpose(-2, -1) - ((d_out * out).sum(-1) - dlse)[..., None])
        return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ d_out
    judgement = run_exercise(get(FLASH_BACKWARD), dense)
    assert all(r.passed for r in judgement.results)
    assert judgement.credit() == 0
    assert judgement.reason().startswith("makes a whole table of scores (40, 40): "), \
        judgement.reason()
    assert "grows as T, not T²" in judgement.reason()


def test_flash_backward_may_not_use_autograd():
    def with_autograd(q, k, v, out, lse, out_b, lse_b, dout, is_causal=False, block=16):
        q = q.clone().requires_grad_()
        return torch.autograd.grad(q.sum(), q)[0], k, v
    assert_banned(FLASH_BACKWARD, with_autograd, "torch.autograd.grad")


def test_a_tile_mask_wrong_only_at_a_regimes_edge_fails_on_every_seed():
    """Issue 31: a causal tile mask aligned top-left only past a gap of two query blocks
    passed the hidden cases of 38 seeds in 100, one that keeps every tile when a single key
    block holds all the keys passed 70; the hidden cases now hold a single key block (partial
    and whole) under a gap of several query blocks on every seed, and both fail all 100."""
    from course_attn.grading.ch09 import tile_mask_reference

    def far_gap_top_left(tq, tk, bq, bk, is_causal=False, window=None):
        if is_causal and window is None and tq - tk > 2 * bq:
            return tile_mask_reference(tq, tq, bq, bk, is_causal)[:, :(tk + bk - 1) // bk]
        return tile_mask_reference(tq, tk, bq, bk, is_causal, window)

    def one_key_block_kept(tq, tk, bq, bk, is_causal=False, window=None):
        mask = tile_mask_reference(tq, tk, bq, bk, is_causal, window)
        return torch.ones_like(mask) if tk <= bk and is_causal and window is None else mask

    for wrong in (far_gap_top_left, one_key_block_kept):
        assert_fails_on_every_seed("ch09.tile_mask", wrong)


def test_a_chunk_loop_that_stops_one_key_short_fails_on_every_seed():
    """Issue 31: ``for start in range(0, Tk - 1, chunk)`` drops the last key only where the last
    chunk holds a single key; the hidden cases drew that in 65 seeds of 100. A last chunk of
    one key is now drawn on every seed."""
    from course_attn.grading.ch09 import chunked_attention_reference

    def stops_one_short(q, k, v, bias, chunk):
        if (k.shape[0] - 1) % chunk == 0:
            return chunked_attention_reference(q, k[:-1], v[:-1], bias[:, :-1], chunk)
        return chunked_attention_reference(q, k, v, bias, chunk)

    assert_fails_on_every_seed("ch09.chunked_attention", stops_one_short)


def test_a_window_one_key_off_fails_on_every_seed():
    """Issue 31: a window counted one key too wide or too narrow (``c1 >= r0 - W``, or W - 1
    keys) changes the tiles only where a block boundary falls at the window's edge; the
    hidden sizes put W on a block boundary (W = k·block) and one past it on every seed."""
    from course_attn.grading.ch09 import _counts, flash_counts_reference

    def off_by(shift):
        def window_off(T, block, W, D):
            counts = flash_counts_reference(T, block, W, D)
            return {**counts, "window_elements": _counts(T, block, W + shift, D)[
                "window_elements"]}
        window_off.__name__ = f"window_off_by_{shift}"
        return window_off

    for shift in (1, -1):
        assert_fails_on_every_seed(COUNTS, off_by(shift))
