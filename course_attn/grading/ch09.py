"""Exercises of Chapter 9, online softmax and flash attention.

    ch09.online_softmax   online_softmax(x) -> (out, m, l): the softmax of x over its last dim
                          (x: (..., N); a row of -inf gives zeros), and the running max and
                          running sum after each column, (..., N) each: the state of one pass
    ch09.merge_states     merge_states(out_a, lse_a, out_b, lse_b) -> (out, lse): attention over
                          two disjoint key sets, from attention over each (out (B, H, Tq, Dv),
                          lse (B, H, Tq), the log-sum-exp of each row's scores)
    ch09.tile_update      tile_update(m, l, acc, scores, v) -> (m, l, acc): one key tile's update
                          of the running max, running sum and unnormalised output
    ch09.tile_mask        tile_mask(tq, tk, block_q, block_k, is_causal=False, window=None)
                          -> bool (ceil(tq/block_q), ceil(tk/block_k)): the tiles that hold at
                          least one allowed (query, key) pair, bottom-right aligned
    ch09.flash_counts     flash_counts(T, block, W, D) -> dict: the memory traffic of the tiled
                          causal forward, with a window of W keys too, and of the tiled
                          backward, causal or not (T x T in square tiles of block, heads of D)
                          (derive, on sizes drawn at grading)

    ch09.chunked_attention  chunked_attention(q, k, v, bias, chunk) -> (Tq, Dv): the given
                          forward over key chunks, whose running max starts at 0, repaired
                          (debug: a padded query's row gives NaN)
    ch09.memory_exponent  memory_exponent(name, lengths, dim) -> float: the peak memory of a
                          given naive or tiled attention at three lengths, and the exponent of
                          the power law that fits it (measure)
    ch09.triton_forward   triton_forward(q, k, v) -> (Tq, D): the flash forward as a Triton
                          kernel, one program per block of 16 queries (on the CPU through
                          Triton's interpreter)
    ch09.flash_backward   flash_backward(q, k, v, out, lse, dout, dlse, is_causal, block) ->
                          (dq, dk, dv): the tiled backward when the loss reads the log-sum-exps
                          too, checked against autograd, never making the whole (Tq, Tk) table

The first four are warm-ups (the chapter writes them out). References: ``course_attn.softmax``
and the running state of every prefix, summed at once; ``course_attn.flash.merge_attention_states``;
the update written out below; ``course_attn.masks`` reduced over blocks; the counts tile by
tile; the softmax in float64 (chunked_attention, triton_forward); the same measurement, made by
the grader (memory_exponent).
"""

import functools
import math

import torch

from ..attention import softmax
from ..flash import merge_attention_states
from ..masks import causal_mask, sliding_window_mask
from .cases import (answers_changed, as_number, count_questions, expect_close_tensor, expect_tensor,
                    expect_tensors, randn, random_mask)
from .exercise import Case, Exercise, Mistake, register
from .operations import (ELEMENTARY, NO_LIBRARY_ATTENTION, NO_LIBRARY_MASKS, NO_LIBRARY_SOFTMAX,
                         NONE, SOFTMAX)

INF = float("-inf")

NO_SOFTMAX_OR_LSE = ("course_attn",) + NO_LIBRARY_SOFTMAX + (
    "torch.logsumexp", "torch.Tensor.logsumexp", "torch.special.logsumexp",
    "torch.log_softmax", "torch.Tensor.log_softmax", "torch.nn.functional.log_softmax",
    "torch.special.log_softmax")


def _finite_max(m):
    """The running max with -inf (nothing seen yet) replaced by 0, so that exp(x - m) is 0."""
    return torch.where(m == INF, torch.zeros_like(m), m)


# --- ch09.online_softmax -------------------------------------------------------------------------

def online_softmax_reference(x):
    """(out, m, l) for x (..., N): out the softmax over the last dim; m[..., j] the max of
    x[..., :j + 1], the running max after column j (-inf until a finite score); l[..., j] the
    sum of exp(x_i - m[..., j]) over i <= j, the running sum against that max (0 while it is
    -inf). The sums of every prefix at once, in float64: (..., N, N), row j, column i."""
    m = x.cummax(dim=-1).values
    terms = torch.exp(x.double()[..., None, :] - _finite_max(m).double()[..., :, None])
    return softmax(x, dim=-1), m, terms.tril().sum(dim=-1).to(x.dtype)


def _scores(*shape, seed, scale=1.0, dtype=torch.float32):
    return randn(*shape, seed=seed, scale=scale, dtype=dtype)


def _online_cases():
    yield Case("a (2, 5) tensor of small scores", (_scores(2, 5, seed=900),),
               hint="each row of the result sums to 1 and keeps the order of the scores")
    x = torch.arange(7, dtype=torch.float32).repeat(3, 1) * torch.tensor([[1.0], [2.0], [0.5]])
    yield Case("scores that grow along each row: the max changes at every column", (x,),
               hint="when a later column has a larger score, what was summed before it was "
                    "summed against a smaller max")
    yield Case("large scores, up to about 1000: exp overflows in float32",
               (_scores(3, 6, seed=901, scale=400.0),),
               hint="exp(89) is already inf in float32")
    x = _scores(4, 6, seed=902, scale=2.0)
    x[0, :3] = INF
    x[1, :1] = INF
    x[2, 2:] = INF
    yield Case("masked entries (-inf), at the start of some rows", (x,),
               hint="while only -inf entries have been seen, the running max is -inf")
    x = _scores(3, 5, seed=903)
    x[1] = INF
    yield Case("a row that is all -inf (a query with no key): zeros", (x,),
               hint="course_attn.softmax returns zeros for such a row, not NaN")
    yield Case("batch dims (2, 3, 4, 6)", (_scores(2, 3, 4, 6, seed=904, scale=3.0),),
               hint="the last dim is the one that sums to 1; keep every other dim")
    yield Case("a single column", (_scores(3, 1, seed=905),),
               hint="a row of one entry has weight 1")
    yield Case("float64", (_scores(2, 7, seed=906, dtype=torch.float64, scale=5.0),),
               hint="keep the input's dtype")


def _online_wrong(*, rescale=True, use_max=True, guard_start=True, guard_dead=True):
    """A student's online softmax with one mistake: ``rescale=False`` keeps the sum of the
    earlier columns as it was when the max grows, ``use_max=False`` subtracts no max,
    ``guard_start=False`` does not handle a running max of -inf, ``guard_dead=False`` divides
    0 by 0 on a row of -inf."""
    def online_softmax(x):
        m = torch.full(x.shape[:-1], INF, dtype=x.dtype)
        l = torch.zeros(x.shape[:-1], dtype=x.dtype)
        ms, ls = [], []
        for j in range(x.shape[-1]):
            xj = x[..., j]
            m_new = torch.maximum(m, xj)
            if not use_max:
                l = l + torch.exp(xj)
            else:
                ref = _finite_max(m_new) if guard_start else m_new
                alpha = torch.exp(m - ref) if rescale else torch.ones_like(l)
                l = l * alpha + torch.exp(xj - ref)
            m = m_new
            ms.append(m)
            ls.append(l)
        if not use_max:
            out = torch.exp(x) / l[..., None]
        else:
            ref = _finite_max(m) if guard_start else m
            total = torch.where(l == 0, torch.ones_like(l), l) if guard_dead else l
            out = torch.exp(x - ref[..., None]) / total[..., None]
        return out, torch.stack(ms, dim=-1), torch.stack(ls, dim=-1)
    return online_softmax


def _two_passes(*, running_max):
    """The safe softmax in two passes, the row's max first and its sums after, with the state
    such an answer can report: ``running_max=False`` the row's final max and sum at every
    column; True the running max, and the sums up to each column against the final max."""
    def online_softmax(x):
        top = x.amax(dim=-1, keepdim=True)
        e = torch.exp(x - _finite_max(top))
        total = e.sum(dim=-1, keepdim=True)
        out = e / torch.where(total == 0, torch.ones_like(total), total)
        if running_max:
            return out, x.cummax(dim=-1).values, e.cumsum(dim=-1)
        return out, top.expand_as(x), total.expand_as(x)
    return online_softmax


register(Exercise(
    key="ch09.online_softmax", function="online_softmax", reference=online_softmax_reference,
    task="warm-up",
    ops=ELEMENTARY,
    cases=_online_cases, compare=expect_tensors(("out", "m", "l")), banned=NO_SOFTMAX_OR_LSE,
    mistakes=(
        Mistake("your m and l are the row's final max and sum at every column: the state after "
                "column j is what one pass holds there, having seen the columns up to j only",
                _two_passes(running_max=False)),
        Mistake("your running sums are taken against the row's final max: after column j, one "
                "pass knows only the max of the columns so far, and rescales its sum when the "
                "max grows", _two_passes(running_max=True)),
        Mistake("a row that is all -inf gives NaN: its sum is 0, and 0 / 0 is NaN; such a row "
                "has no key to attend to and must give zeros", _online_wrong(guard_dead=False)),
        Mistake("you did not rescale the running sum when the running max grew: the terms "
                "summed before were exponentials against the old max",
                _online_wrong(rescale=False)),
        Mistake("you subtracted no max: exp of a large score overflows to inf, and inf / inf "
                "is NaN", _online_wrong(use_max=False)),
        Mistake("a row that starts with -inf gives NaN: while the running max is still -inf, "
                "-inf minus -inf is NaN, so that case needs its own handling",
                _online_wrong(guard_start=False)),
    ),
))


# --- ch09.merge_states ---------------------------------------------------------------------------

def merge_states_reference(out_a, lse_a, out_b, lse_b):
    return merge_attention_states(out_a, lse_a, out_b, lse_b)


def partial_state(q, k, v, allowed, scale=1.0):
    """out (B, H, Tq, Dv) and lse (B, H, Tq) of attention of q over the keys where ``allowed``
    (bool, broadcast to (..., Tq, Tk)) is True, computed in float64, returned in q's dtype (lse
    in float32 at least, as merge_attention_states returns it). No allowed key: out 0, lse -inf."""
    s = (q.double() @ k.double().transpose(-2, -1)) * scale
    s = s.masked_fill(~allowed, INF)
    lse = torch.logsumexp(s, dim=-1)
    out = softmax(s, dim=-1) @ v.double()
    return out.to(q.dtype), lse.to(torch.promote_types(q.dtype, torch.float32))


def split_states(b, h, tq, tk, d, dv, split, seed, *, scale=1.0, dtype=torch.float32,
                 dead_rows=(), empty_side=None):
    """The two partial states of one attention whose keys are split at ``split`` (a bool (Tk,)
    mask for side A, or an int: the first ``split`` keys). ``dead_rows`` have no key on either
    side, ``empty_side`` ("a" or "b") has no key for any row."""
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    q = randn(b, h, tq, d, seed=g, dtype=dtype)
    k = randn(b, h, tk, d, seed=g, dtype=dtype)
    v = randn(b, h, tk, dv, seed=g, dtype=dtype)
    side_a = torch.arange(tk) < split if isinstance(split, int) else split
    row = torch.ones(tq, 1, dtype=torch.bool)
    row[list(dead_rows)] = False
    a = side_a[None, :] & row & (empty_side != "a")
    b_ = ~side_a[None, :] & row & (empty_side != "b")
    out_a, lse_a = partial_state(q, k, v, a, scale)
    out_b, lse_b = partial_state(q, k, v, b_, scale)
    return out_a, lse_a, out_b, lse_b


def _merge_cases():
    yield Case("two halves of 8 keys; B=1, H=2, Tq=3, D=Dv=4",
               split_states(1, 2, 3, 8, 4, 4, 4, 910),
               hint="the merged output is the attention over all 8 keys")
    yield Case("an uneven split, 1 key and 9; Dv=3 != D=5, B=2",
               split_states(2, 1, 4, 10, 5, 3, 1, 911),
               hint="a side with fewer keys can still hold most of a row's weight")
    keys = torch.tensor([True, False, True, True, False, False, True, False, False])
    yield Case("keys interleaved between the two sides",
               split_states(1, 3, 2, 9, 4, 4, keys, 912),
               hint="which keys sit on which side does not matter, only each side's total")
    yield Case("large scores: log-sum-exps near 300", split_states(1, 2, 3, 6, 4, 4, 2, 913,
                                                                   scale=60.0),
               hint="exp(300) is inf in float32 and in float64 alike")
    yield Case("side A has no key at all (lse = -inf, out = 0): the identity",
               split_states(1, 2, 3, 6, 4, 4, 3, 914, empty_side="a"),
               hint="merging with an empty state gives the other state back")
    yield Case("rows with no key on either side stay out = 0, lse = -inf",
               split_states(2, 1, 4, 6, 4, 4, 3, 915, dead_rows=(1, 3)),
               hint="a row whose merged lse is -inf has no weight to share out")
    yield Case("float64", split_states(1, 2, 3, 7, 4, 2, 3, 916, dtype=torch.float64),
               hint="keep the inputs' dtype")


def _merge_wrong(*, lse_rule="log", weights="share", guard=True):
    """merge_states with one mistake, as a student writes it (the larger lse factored out):
    ``lse_rule`` "max" or "naive" (the log of a sum of exps); ``weights`` "half" (equal), "raw"
    (exp(lse) not divided by the total), "swapped", "unnormalised" (exp(lse - the larger lse),
    not divided by their sum), "from_lse" (exp of each lse minus the merged lse, whatever that
    is); ``guard=False``: no care for rows with no key on either side (-inf - -inf = NaN)."""
    def merge(out_a, lse_a, out_b, lse_b):
        top = torch.maximum(lse_a, lse_b)
        ref = _finite_max(top) if guard else top
        w_a, w_b = torch.exp(lse_a - ref), torch.exp(lse_b - ref)
        total = w_a + w_b
        if lse_rule == "max":
            lse = top
        elif lse_rule == "naive":
            lse = torch.log(torch.exp(lse_a) + torch.exp(lse_b))
        else:
            lse = torch.where(total == 0, top, ref + torch.log(total))
        safe = torch.where(total == 0, torch.ones_like(total), total) if guard else total
        w_a, w_b = w_a / safe, w_b / safe
        if weights == "half":
            w_a = w_b = torch.full_like(total, 0.5)
        elif weights == "raw":
            w_a, w_b = torch.exp(lse_a), torch.exp(lse_b)
        elif weights == "swapped":
            w_a, w_b = w_b, w_a
        elif weights == "unnormalised":
            w_a, w_b = torch.exp(lse_a - ref), torch.exp(lse_b - ref)
        elif weights == "from_lse":
            w_a, w_b = torch.exp(lse_a - lse), torch.exp(lse_b - lse)
        out = w_a[..., None] * out_a + w_b[..., None] * out_b
        return out.to(out_a.dtype), lse
    return merge


register(Exercise(
    key="ch09.merge_states", function="merge_states", reference=merge_states_reference,
    task="warm-up",
    ops=ELEMENTARY,
    cases=_merge_cases, compare=expect_tensors(("out", "lse")), banned=NO_SOFTMAX_OR_LSE + (
        "torch.logaddexp", "torch.Tensor.logaddexp"),
    mistakes=(
        *(Mistake("you merged the log-sum-exps with a max: the row's total weight is the SUM "
                  "of the two sides' totals, and lse is its log",
                  _merge_wrong(lse_rule="max", weights=weights))
          for weights in ("share", "unnormalised")),
        Mistake("you averaged the two outputs equally: each side counts in proportion to its "
                "share of the row's total weight", _merge_wrong(weights="half")),
        Mistake("your two weights do not add up to one: each side's weight is its total "
                "relative to the merged total", _merge_wrong(weights="raw")),
        Mistake("you weighted each side's output with the other side's share",
                _merge_wrong(weights="swapped")),
        *(Mistake("you took exp of the log-sum-exps themselves: they overflow for large "
                  "scores; factor out the larger one first",
                  _merge_wrong(lse_rule="naive", weights=weights))
          for weights in ("share", "from_lse")),
        Mistake("a row with no key on either side gives NaN (-inf minus -inf): it must stay "
                "out = 0, lse = -inf", _merge_wrong(guard=False)),
    ),
))


# --- ch09.tile_update ----------------------------------------------------------------------------

def tile_update_reference(m, l, acc, scores, v):
    """Running max m (B, H, Tq), running sum l (B, H, Tq), unnormalised output acc (B, H, Tq, Dv);
    one tile of scaled, masked scores (B, H, Tq, Bk) and its values (B, H, Bk, Dv) -> the new
    (m, l, acc) over every key seen so far."""
    m_new = torch.maximum(m, scores.amax(dim=-1))
    ref = _finite_max(m_new)
    alpha = torch.exp(m - ref)                       # 0 where m = -inf, 1 where the max stayed
    p = torch.exp(scores - ref[..., None])           # 0 for masked scores
    return m_new, l * alpha + p.sum(dim=-1), acc * alpha[..., None] + p @ v


def empty_state(b, h, tq, dv, dtype=torch.float32):
    return (torch.full((b, h, tq), INF, dtype=dtype), torch.zeros(b, h, tq, dtype=dtype),
            torch.zeros(b, h, tq, dv, dtype=dtype))


def tile_case(name, b, h, tq, bk, dv, tiles_before, seed, hint="", *, scale=2.0, shift=0.0,
              dtype=torch.float32, p_keep=None, dead_rows=()):
    """A state after ``tiles_before`` earlier tiles (scores * scale), and the next tile, whose
    scores are moved by ``shift`` (above the running max when positive), masked at random with
    ``p_keep``, and fully masked in ``dead_rows``; those rows are masked in the earlier tiles
    too."""
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    state = empty_state(b, h, tq, dv, dtype)
    for _ in range(tiles_before):
        s = randn(b, h, tq, bk, seed=g, dtype=dtype, scale=scale)
        s[:, :, list(dead_rows)] = INF
        state = tile_update_reference(*state, s, randn(b, h, bk, dv, seed=g, dtype=dtype))
    s = randn(b, h, tq, bk, seed=g, dtype=dtype, scale=scale) + shift
    if p_keep is not None:
        s = s.masked_fill(~random_mask(b, h, tq, bk, seed=g, p_keep=p_keep), INF)
    s[:, :, list(dead_rows)] = INF
    return Case(name, (*state, s, randn(b, h, bk, dv, seed=g, dtype=dtype)), hint=hint)


def _tile_cases():
    yield tile_case("the first tile: an empty state (m = -inf, l = 0, acc = 0); B=1, H=2, "
                    "Tq=3, Bk=4", 1, 2, 3, 4, 4, 0, 920,
                    "with nothing seen before, the state is this tile's own max, sum and "
                    "weighted values")
    yield tile_case("a third tile whose scores are larger than every earlier one: the max grows",
                    1, 2, 3, 4, 4, 2, 921, "what the state holds was computed against the old "
                                           "max", shift=6.0)
    yield tile_case("a second tile whose scores are all smaller: the max stays", 2, 1, 4, 3, 5,
                    1, 922, "l and acc keep what they had and add this tile's terms",
                    shift=-6.0)
    yield tile_case("a tile with masked scores (-inf) after two tiles; Dv=3 != Bk=5", 1, 2, 4,
                    5, 3, 2, 923, "a masked score adds nothing to l or acc", p_keep=0.5)
    yield tile_case("rows that have seen no key yet and see none in this tile (above the causal "
                    "diagonal) stay m = -inf, l = 0, acc = 0", 1, 1, 4, 4, 4, 1, 924,
                    "a row that has seen only -inf scores has nothing to rescale",
                    dead_rows=(0, 2))
    yield tile_case("float64, after three tiles", 1, 2, 2, 4, 4, 3, 925,
                    "keep the inputs' dtype", dtype=torch.float64)


def _tile_wrong(*, rescale_acc=True, rescale_l=True, normalise=False, guard=True,
                running=True, new_max=True):
    """tile_update with one mistake: no rescale of acc or l, ``normalise`` divides acc by l,
    ``guard=False`` NaN while the max is -inf, ``running=False`` takes the tile's max as m,
    ``new_max=False`` returns the old m."""
    def update(m, l, acc, scores, v):
        tile_max = scores.amax(dim=-1)
        m_new = torch.maximum(m, tile_max) if running else tile_max
        ref = _finite_max(m_new) if guard else m_new
        alpha = torch.exp(m - ref)
        p = torch.exp(scores - ref[..., None])
        l_new = (l * alpha if rescale_l else l) + p.sum(dim=-1)
        acc_new = (acc * alpha[..., None] if rescale_acc else acc) + p @ v
        if normalise:
            acc_new = acc_new / l_new[..., None]
        return (m_new if new_max else m), l_new, acc_new
    return update


register(Exercise(
    key="ch09.tile_update", function="tile_update", reference=tile_update_reference,
    task="warm-up",
    ops=ELEMENTARY,
    cases=_tile_cases, compare=expect_tensors(("m", "l", "acc")), banned=NO_SOFTMAX_OR_LSE,
    mistakes=(
        Mistake("you did not rescale the accumulator when the max grew: acc holds values "
                "weighted by exponentials against the old max", _tile_wrong(rescale_acc=False)),
        Mistake("you did not rescale the running sum l when the max grew: its terms are "
                "exponentials against the old max", _tile_wrong(rescale_l=False)),
        Mistake("you rescaled neither l nor acc when the max grew: both were computed against "
                "the old max", _tile_wrong(rescale_acc=False, rescale_l=False)),
        Mistake("you normalised the accumulator: acc stays an unnormalised sum while tiles "
                "keep coming; dividing by l is the very last step", _tile_wrong(normalise=True)),
        Mistake("you returned the old max: m must be the max over every score seen so far, "
                "this tile's included", _tile_wrong(new_max=False)),
        Mistake("your m is this tile's max, not the running max over every tile so far",
                _tile_wrong(running=False)),
        Mistake("rows that have seen only -inf scores give NaN (-inf minus -inf): while the "
                "max is -inf, the state must stay empty", _tile_wrong(guard=False)),
    ),
))


# --- ch09.tile_mask ------------------------------------------------------------------------------

def _blocks(n, size):
    return -(-n // size)


def tile_mask_reference(tq, tk, block_q, block_k, is_causal=False, window=None):
    """The tiles (query block, key block) that hold at least one allowed pair: the element mask
    of ``course_attn.masks`` (bottom-right aligned), reduced with any() over each tile."""
    if window is not None:
        mask = sliding_window_mask(tq, tk, window, causal=is_causal)
    elif is_causal:
        mask = causal_mask(tq, tk)
    else:
        mask = torch.ones(tq, tk, dtype=torch.bool)
    nq, nk = _blocks(tq, block_q), _blocks(tk, block_k)
    padded = torch.zeros(nq * block_q, nk * block_k, dtype=torch.bool)
    padded[:tq, :tk] = mask
    return padded.view(nq, block_q, nk, block_k).any(dim=3).any(dim=1)


def _mask_cases():
    yield Case("causal, 8 x 8 in blocks of 2", (8, 8, 2, 2), dict(is_causal=True),
               hint="a tile on the diagonal holds allowed pairs (a query sees itself)")
    yield Case("no mask: every tile, 6 x 10 in blocks of 3 x 5", (6, 10, 3, 5),
               dict(is_causal=False), hint="without a mask every pair is allowed")
    yield Case("causal, 10 x 10 in blocks of 4: a partial last block", (10, 10, 4, 4),
               dict(is_causal=True), hint="10 rows make 3 blocks of 4, the last one half full")
    yield Case("causal, Tq=4 after Tk=12 (bottom-right), blocks of 4", (4, 12, 4, 4),
               dict(is_causal=True), hint="the 4 queries are the LAST 4 positions: they see "
                                          "every key")
    yield Case("causal, block_q=4 and block_k=2, 12 x 12", (12, 12, 4, 2), dict(is_causal=True),
               hint="compare positions, not block numbers, when the blocks differ in size")
    yield Case("causal, 9 x 9, block_q=3 and block_k=2: key blocks that start at a query "
               "block's last position", (9, 9, 3, 2), dict(is_causal=True),
               hint="a query may attend to the key at its own position")
    yield Case("causal, Tq=12 > Tk=4: the first queries see no key", (12, 4, 4, 2),
               dict(is_causal=True), hint="bottom-right: query i sits at position Tk - Tq + i")
    yield Case("causal with a window of 5, 16 x 16 in blocks of 4", (16, 16, 4, 4),
               dict(is_causal=True, window=5),
               hint="the window keeps the query and the window - 1 keys before it")
    yield Case("a window of 3 without causality, 12 x 12 in blocks of 2", (12, 12, 2, 2),
               dict(is_causal=False, window=3), hint="without causality the window reaches "
                                                       "both ways")


def _mask_wrong(*, count=_blocks, align=True, causal_rule="ok", by_index=False, windowed=True,
                window_rule="ok"):
    """tile_mask with one mistake: ``count`` of blocks (floor division), ``align=False`` top
    left, ``causal_rule`` "strict" (skips the diagonal tiles), "before_last" (first key before
    the last query, strictly) or "one_more" (keeps one tile above it), ``by_index`` compares
    block numbers, ``windowed=False`` ignores the window,
    ``window_rule`` "one_more" keeps a key W positions back."""
    def tile_mask(tq, tk, block_q, block_k, is_causal=False, window=None):
        nq, nk = count(tq, block_q), count(tk, block_k)
        offset = tk - tq if align else 0
        keep = torch.zeros(nq, nk, dtype=torch.bool)
        for i in range(nq):
            r0, r1 = offset + i * block_q, offset + min((i + 1) * block_q, tq) - 1
            for j in range(nk):
                c0, c1 = j * block_k, min((j + 1) * block_k, tk) - 1
                ok = True
                if is_causal:
                    if by_index:
                        ok = j <= i
                    elif causal_rule == "strict":
                        ok = c0 < r0
                    elif causal_rule == "before_last":
                        ok = c0 < r1
                    elif causal_rule == "one_more":
                        ok = c0 <= r1 + 1
                    else:
                        ok = c0 <= r1
                if window is not None and windowed:
                    reach = window - (0 if window_rule == "ok" else -1)
                    ok = ok and c1 > r0 - reach and (is_causal or c0 < r1 + reach)
                keep[i, j] = ok
        return keep
    return tile_mask


register(Exercise(
    key="ch09.tile_mask", function="tile_mask", reference=tile_mask_reference,
    task="warm-up",   # chapter 9's tile_needed (section 4) for every tile
    ops=ELEMENTARY,
    cases=_mask_cases, compare=expect_tensor, banned=NO_LIBRARY_MASKS,
    mistakes=(
        Mistake("your causal skip is one block off: it skips the tiles on the diagonal, which "
                "hold the pairs of a query with itself and the keys just before it",
                _mask_wrong(causal_rule="strict")),
        Mistake("your causal skip drops a tile whose first key sits exactly at the position of "
                "the block's last query: a query sees the key at its own position, so that tile "
                "holds an allowed pair", _mask_wrong(causal_rule="before_last")),
        Mistake("your causal skip is one block off: it keeps a tile that lies entirely above "
                "the diagonal (compare the tile's first key with its last query, both "
                "inclusive)", _mask_wrong(causal_rule="one_more")),
        Mistake("you counted the blocks with floor division: a partial last block still holds "
                "queries (or keys)", _mask_wrong(count=lambda n, s: n // s)),
        Mistake("your causal tiles are aligned top-left: with Tq != Tk, query i sits at "
                "position Tk - Tq + i", _mask_wrong(align=False)),
        Mistake("you compared block numbers: with different block sizes, block i of the "
                "queries and block i of the keys cover different positions",
                _mask_wrong(by_index=True)),
        Mistake("you ignored the window: tiles whose keys all lie W or more positions away "
                "from every query are skipped too", _mask_wrong(windowed=False)),
        Mistake("your window keeps one position too many: a key exactly W positions away is "
                "outside it", _mask_wrong(window_rule="one_more")),
    ),
))


# --- ch09.flash_counts: memory traffic of the causal, windowed and backward passes, derived ------

# The chapter's sizes, and sizes whose last block is partial and whose window is not a whole
# number of blocks (so that every typical mistake below gives a wrong answer on some case).
COUNT_SIZES = dict(T=1024, block=64, W=256, D=64)
MORE_COUNT_SIZES = dict(T=1000, block=64, W=200, D=32)

COUNT_QUESTIONS = {
    "causal_elements": (
        "(a) elements the tiled causal forward reads and writes, one head",
        "a query block loads the keys and values of the tiles it computes only: the key blocks "
        "up to and including the diagonal one, the last one partial"),
    "window_elements": (
        "(b) the same, causal with a window of W keys",
        "a query block's allowed keys run from W - 1 positions before its first query to its "
        "last query; it loads every key block that range touches, whole"),
    "backward_elements": (
        "(c) elements the tiled backward reads and writes, one head, not causal",
        "D = rowsum(dO * O) first; then each key block loads K and V once and writes dK and dV "
        "once, and each of its tiles reads a query block's Q, dO, lse and D and reads and "
        "writes its dQ"),
    "causal_backward_elements": (
        "(d) the same, causal",
        "the tiles above the diagonal are skipped, as in the forward; a key block meets fewer "
        "query blocks the later it is"),
}


def _counts(T, block, W, D, *, skip="ok", window_blocks=None, keys_only=False, whole=False,
            lse=True, rowsum=True, dq_read=True, kv_per_tile=False, stats=True, dkdv=True):
    """The four counts, tile by tile, or one typical mistake's: ``skip`` "none" (every tile) or
    "strict" (no diagonal tile); ``window_blocks(W, block)``: the key blocks a query block
    loads, back from its diagonal one; ``keys_only`` counts the keys the window allows, not the
    key blocks of the tiles; ``whole`` takes every block as ``block`` long; ``lse=False`` leaves
    out the forward's log-sum-exps; the backward without D's step (``rowsum``), with dQ written
    but not read (``dq_read``), K and V loaded by every tile (``kv_per_tile``), without the
    reads of lse and D (``stats``) or the writes of dK and dV (``dkdv``)."""
    n = _blocks(T, block)
    size = [block if whole else min(block, T - b * block) for b in range(n)]

    def kept(i, j, window=None):
        """Whether the causal tile of query block i and key block j is computed."""
        last = i * block + size[i] - 1                 # the query block's last position
        causal = {"none": True, "strict": j < i}.get(skip, j * block <= last)
        if window is None or not causal:
            return causal
        if window_blocks is not None:
            return i - j < window_blocks(window, block)
        return j * block + size[j] - 1 > i * block - window

    def forward(window):
        total = 0
        for i in range(n):
            total += 2 * size[i] * D + (size[i] if lse else 0)     # Q; O and the lse
            if keys_only and window is not None:
                first, last = i * block, i * block + size[i] - 1
                total += 2 * D * (last - max(0, first - window + 1) + 1)
            else:
                total += sum(2 * size[j] * D for j in range(n) if kept(i, j, window))
        return total

    def backward(causal):
        total = 2 * T * D + T if rowsum else 0
        per_row = 2 * D + (2 if stats else 0) + (2 * D if dq_read else D)
        for j in range(n):
            kv = 2 * size[j] * D
            total += (0 if kv_per_tile else kv) + (kv if dkdv else 0)
            for i in range(n):
                if not causal or kept(i, j):
                    total += size[i] * per_row + (kv if kv_per_tile else 0)
        return total

    return {"causal_elements": forward(None), "window_elements": forward(W),
            "backward_elements": backward(False), "causal_backward_elements": backward(True)}


def flash_counts_reference(T, block, W, D):
    """The four counts for a T x T table in square tiles of ``block`` (query blocks of ``block``
    rows), a causal window of W keys and heads of D, counted tile by tile: the elements each
    computed tile loads, from the positions it covers, and what each block reads and writes."""
    return _counts(T, block, W, D)


COUNTS = count_questions(COUNT_QUESTIONS)


def _with(keys, **rule):
    """A typical wrong answer: the right counts, with each of ``keys`` counted by ``rule``."""
    return answers_changed(flash_counts_reference, {
        key: lambda key=key, **sizes: _counts(**sizes, **rule)[key] for key in keys})


CAUSAL_KEYS = ("causal_elements", "causal_backward_elements")
FORWARD_KEYS = ("causal_elements", "window_elements")
BACKWARD_KEYS = ("backward_elements", "causal_backward_elements")

register(Exercise(
    key="ch09.flash_counts", function="flash_counts", reference=flash_counts_reference,
    task="derive",
    ops=NONE,
    cases=lambda: COUNTS.cases(COUNT_SIZES, MORE_COUNT_SIZES), compare=COUNTS.compare,
    banned=("course_attn",),
    mistakes=(
        Mistake("you counted every tile: a causal pass skips the tiles entirely above the "
                "diagonal, and with them the loads of their keys and values",
                _with(CAUSAL_KEYS, skip="none")),
        Mistake("you skipped the diagonal tiles: they hold the pairs of each query with itself "
                "and the keys just before it, and they are computed",
                _with(CAUSAL_KEYS, skip="strict")),
        Mistake("you left out the log-sum-exps that the forward writes for the backward, one "
                "per query", _with(FORWARD_KEYS, lse=False)),
        Mistake("you ignored the window: the tiles whose keys all lie W or more positions "
                "before every query of the block are skipped too",
                _with(("window_elements",), window_blocks=lambda W, block: math.inf)),
        Mistake("you counted W // block key blocks per query block: a window that does not "
                "start on a block boundary straddles one key block more",
                _with(("window_elements",), window_blocks=lambda W, block: W // block)),
        Mistake("you counted W // block + 1 key blocks per query block: when W is not a "
                "multiple of the block, the W - 1 keys before a block's first query may start "
                "inside a key block that this count leaves out",
                _with(("window_elements",), window_blocks=lambda W, block: W // block + 1)),
        Mistake("you counted the keys the window allows: a computed tile loads its whole key "
                "block, the keys outside the window included", _with(("window_elements",),
                                                                     keys_only=True)),
        Mistake("you left out the step before the loop: D = rowsum(dO * O) reads dO and O and "
                "writes D, one number per query", _with(BACKWARD_KEYS, rowsum=False)),
        Mistake("you wrote dQ without reading it: dQ is accumulated over the key blocks, so a "
                "tile reads its block of dQ and writes it back", _with(BACKWARD_KEYS,
                                                                        dq_read=False)),
        Mistake("you loaded K and V for every tile: a key block's K and V are loaded once and "
                "stay while its query blocks pass", _with(BACKWARD_KEYS, kv_per_tile=True)),
        Mistake("you left out the reads of lse and D: a tile reads them for its query block, to "
                "recompute P and to form dS", _with(BACKWARD_KEYS, stats=False)),
        Mistake("you left out the writes of dK and dV, once per key block",
                _with(BACKWARD_KEYS, dkdv=False)),
        Mistake("you counted every block as block long: a partial last block holds T % block "
                "queries and keys, and its loads and writes are that much shorter",
                lambda T, block, W, D: _counts(T, block, W, D, whole=True)),
    ),
))


# --- ch09.triton_forward: the flash forward as a Triton kernel -----------------------------------

def import_triton_for_its_interpreter() -> None:
    """Without CUDA, a student's kernel runs under Triton's interpreter, which works only if
    ``triton`` (and with it ``triton.language``, whose library functions such as ``tl.zeros``
    are then interpreted ones) was first imported with ``TRITON_INTERPRET=1``. The notebook's
    setup cell sets it before importing triton; but in a process that imported torch._dynamo
    first (the first operation under a torch dispatch mode, such as the guard's, does, and
    torch._dynamo imports triton), the interpreter fails with "Cannot call @triton.jit'd outside
    of the scope of a kernel". The tests import this module before anything runs, so it
    imports triton here, with the variable set only meanwhile (a test file that reads it at
    collection sees it as it was). Nothing happens where CUDA is present, where triton is
    missing, or where it is imported already."""
    import importlib.util
    import os
    import sys
    if "triton" in sys.modules or importlib.util.find_spec("triton") is None or \
            torch.cuda.is_available():
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except Exception:  # a broken install: the exercise's own import reports it
        pass
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


import_triton_for_its_interpreter()


# The launcher may allocate, copy and rearrange tensors (and Triton's interpreter copies them to
# the host and back with copy_ and set_), but no arithmetic: every score, exponential and product
# is computed in the kernel. Under the interpreter the kernel's arithmetic runs in NumPy, which no
# torch mode sees; on a GPU it runs in the compiled kernel. A launcher that computes attention
# with torch (q @ k.T, exp, softmax, SDPA) runs an operation outside this list and is refused.
LAUNCH = frozenset(f"aten.{name}" for name in """empty empty_like empty_strided new_empty
new_empty_strided zeros zeros_like fill_ zero_ copy_ _to_copy _copy_from _copy_from_and_resize
clone set_ view _unsafe_view t transpose permute expand alias detach as_strided lift_fresh
slice select unsqueeze squeeze""".split())
# Reading a tensor's numbers into Python or NumPy (to do the arithmetic there) is refused by name:
# Triton's interpreter reaches the data through data_ptr, never through these.
NO_HOST_COPIES = ("torch.Tensor.numpy", "torch.from_numpy", "torch.Tensor.tolist",
                  "torch.Tensor.item", "torch.Tensor.__array__")
TRITON_BLOCK = 16
# A kernel's float32 tl.dot may use TF32 on a GPU (10 bits of mantissa): scores of unit size
# and outputs below 4 in size are then off by about 1e-3 at most; the typical mistakes below are
# off by 0.05 or more on the cases that catch them.
TRITON_TOLERANCE = 5e-3


def triton_forward_reference(q, k, v):
    """q (Tq, D), k (Tk, D), v (Tk, D) float32 -> softmax(q k^T / sqrt(D)) v, (Tq, D) float32,
    computed in float64."""
    s = (q.double() @ k.double().T) / math.sqrt(q.shape[-1])
    return (softmax(s, dim=-1) @ v.double()).float()


def _triton_wrong(*, scale=True, pad=False, rescale_acc=True, rescale_l=True, m_zero=False):
    """The forward with one mistake, tile by tile as a kernel computes it (float32, tiles of 16
    keys): ``scale=False`` forgets 1/sqrt(D); ``pad`` counts the padding keys of the last tile
    (loaded as zeros, score 0) in l; no rescale of acc or l when the max grows; ``m_zero`` starts
    the running max at 0, not -inf (a row whose scores are all far below 0 gives 0 / 0)."""
    def forward(q, k, v):
        tq, d = q.shape
        tk = k.shape[0]
        m = torch.zeros(tq) if m_zero else torch.full((tq,), INF)
        l, acc = torch.zeros(tq), torch.zeros(tq, v.shape[1])
        for k0 in range(0, tk, TRITON_BLOCK):
            kt, vt = k[k0:k0 + TRITON_BLOCK], v[k0:k0 + TRITON_BLOCK]
            missing = TRITON_BLOCK - kt.shape[0]
            s = q @ kt.T * (1 / math.sqrt(d) if scale else 1.0)
            if pad and missing:
                s = torch.cat([s, torch.zeros(tq, missing)], dim=1)
                vt = torch.cat([vt, torch.zeros(missing, v.shape[1])])
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[:, None])
            l = (l * alpha if rescale_l else l) + p.sum(-1)
            acc = (acc * alpha[:, None] if rescale_acc else acc) + p @ vt
            m = m_new
        return acc / l[:, None]
    return forward


def random_qkv(tq, tk, d, seed, *, scale=1.0):
    g = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    return (randn(tq, d, seed=g, scale=scale), randn(tk, d, seed=g, scale=scale),
            randn(tk, d, seed=g))


def rising_keys(tq, tk, d, seed):
    """q, k, v whose keys' scores grow from tile to tile for every query (k is q's mean times a
    growing factor, plus noise): the running max changes at every tile."""
    q, k, v = random_qkv(tq, tk, d, seed, scale=0.3)
    q = q + 1.0
    k = k + torch.linspace(-2.0, 2.0, tk)[:, None]
    return q, k, v


def far_below(tq, tk, d, seed):
    """q, k, v where query 0's scores are all below -100 (for D >= 16): with a running max
    started at 0, every exp(s - 0) underflows to 0 in float32."""
    q, k, v = random_qkv(tq, tk, d, seed)
    q[0] = 4.0
    k = k.abs() * -6.0 - 6.0    # query 0's scores: 4 (-6 |k| - 6) summed over D, / sqrt(D)
    return q, k, v


def _triton_cases():
    yield Case("Tq = Tk = 16, D = 16: one tile", random_qkv(16, 16, 16, 930),
               hint="one query block, one key tile: the softmax of one tile, times V")
    yield Case("Tq = 16, Tk = 64, D = 16: scores that grow from tile to tile",
               rising_keys(16, 64, 16, 931),
               hint="each tile's larger max shrinks what l and acc hold from earlier tiles")
    yield Case("Tq = 20, Tk = 40, D = 32: partial last blocks of queries and of keys",
               random_qkv(20, 40, 32, 932),
               hint="the last tile holds 8 keys and 8 padding positions, which must weigh nothing")
    yield Case("Tq = 16, Tk = 32, D = 16: a query whose scores are all below -100",
               far_below(16, 32, 16, 933),
               hint="exp of a score 100 below the running max underflows to 0 in float32")
    yield Case("Tq = 33, Tk = 17, D = 16: three query blocks, one key past a tile",
               random_qkv(33, 17, 16, 934),
               hint="a key tile of one real key and 15 padding positions")


def _compare_triton(actual, expected, case=None):
    expect_tensor(actual, expected, case, rtol=TRITON_TOLERANCE, atol=TRITON_TOLERANCE)


register(Exercise(
    key="ch09.triton_forward", function="triton_forward", reference=triton_forward_reference,
    task="implement",
    ops=LAUNCH, cases=_triton_cases, compare=_compare_triton,
    banned=NO_LIBRARY_ATTENTION + NO_LIBRARY_SOFTMAX + NO_HOST_COPIES,
    mistakes=(
        Mistake("you did not rescale the accumulator when the running max grew: acc holds values "
                "weighted against an older, smaller max", _triton_wrong(rescale_acc=False)),
        Mistake("you did not rescale the running sum l when the running max grew: its terms are "
                "exponentials against an older max", _triton_wrong(rescale_l=False)),
        Mistake("the padding positions of a partial last key tile count in the sum: they load "
                "as zeros, whose score 0 is not masked out", _triton_wrong(pad=True)),
        Mistake("you forgot to scale the scores by 1/sqrt(D)", _triton_wrong(scale=False)),
        Mistake("a row whose scores are all far below 0 gives NaN: your running max starts at 0, "
                "above every score of that row, so every exponential underflows",
                _triton_wrong(m_zero=True)),
    ),
))


# --- ch09.chunked_attention: debug a forward whose running max starts at 0 -----------------------

def chunked_attention_given(q, k, v, bias, chunk):
    """softmax(q k^T / sqrt(D) + bias) v, taking the keys ``chunk`` at a time.
    q: (Tq, D), k: (Tk, D), v: (Tk, Dv), bias: (Tq, Tk) added to the scores."""
    scale = q.shape[-1] ** -0.5
    top = torch.zeros(q.shape[0])                    # the largest score met so far, per query
    mass = torch.zeros(q.shape[0])                   # sum of exp(score - top)
    numer = torch.zeros(q.shape[0], v.shape[-1])     # sum of exp(score - top) * value
    for start in range(0, k.shape[0], chunk):
        stop = start + chunk
        s = (q @ k[start:stop].T) * scale + bias[:, start:stop]
        new_top = torch.maximum(top, s.max(dim=-1).values)
        shrink = torch.exp(top - new_top)            # what the old terms are worth now
        w = torch.exp(s - new_top[:, None])
        mass = mass * shrink + w.sum(dim=-1)
        numer = numer * shrink[:, None] + w @ v[start:stop]
        top = new_top
    return numer / mass[:, None]


def chunked_attention_reference(q, k, v, bias, chunk):
    s = (q.double() @ k.double().T) / math.sqrt(q.shape[-1]) + bias.double()
    return (softmax(s, dim=-1) @ v.double()).float()


PAD = torch.finfo(torch.float32).min   # an additive mask's "no key here", as many models write it


def padded_inputs(tq, tk, d, dv, seed, *, padded=(), causal=False, alibi=0.0):
    """q, k, v and a bias: ``padded`` queries have every key masked with PAD (a padding token's
    row: all its scores equal, so its weights are uniform); ``causal`` masks the keys after each
    query with PAD; ``alibi`` adds -alibi times the distance."""
    g = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    q, k, v = randn(tq, d, seed=g), randn(tk, d, seed=g), randn(tk, dv, seed=g)
    rows, cols = torch.arange(tq)[:, None] + (tk - tq), torch.arange(tk)[None, :]
    bias = -alibi * (rows - cols).abs().float()
    if causal:
        bias = bias.masked_fill(cols > rows, PAD)
    bias[list(padded)] = PAD
    return q, k, v, bias


def _chunked_cases():
    yield Case("no bias, Tk = 12 in chunks of 4", (*padded_inputs(5, 12, 8, 4, 940), 4),
               hint="the output is the softmax of the scores, times the values")
    yield Case("a causal mask (PAD above the diagonal), 9 x 9 in chunks of 3",
               (*padded_inputs(9, 9, 8, 8, 941, causal=True), 3),
               hint="a masked key weighs nothing")
    yield Case("chunks of 5 that do not divide Tk = 13, with a linear bias",
               (*padded_inputs(4, 13, 8, 6, 942, alibi=0.5), 5),
               hint="the last chunk is shorter")
    yield Case("a padded query: every key of row 2 masked with PAD, as a padding token's row",
               (*padded_inputs(6, 10, 8, 4, 943, padded=(2,)), 4),
               hint="a row whose scores are all equal has equal weights, however low they are")
    yield Case("a causal mask and two padded queries, chunks of 2",
               (*padded_inputs(8, 8, 8, 8, 944, padded=(0, 5), causal=True), 2),
               hint="a row whose scores are all equal has equal weights, however low they are")


def _chunked_zeroed(q, k, v, bias, chunk):
    """The given function with its NaN rows set to 0 afterwards (a half repair)."""
    return torch.nan_to_num(chunked_attention_given(q, k, v, bias, chunk), nan=0.0)


register(Exercise(
    key="ch09.chunked_attention", function="chunked_attention", task="debug",
    given=chunked_attention_given,
    reference=chunked_attention_reference, ops=ELEMENTARY,
    cases=_chunked_cases, compare=expect_close_tensor(1e-5, 1e-5),
    banned=NO_SOFTMAX_OR_LSE + NO_LIBRARY_ATTENTION[1:],
    # the repair is in the running state: one pass, each chunk of keys and values read once
    # (a global max first and the sums after reads them twice), and no copy to read again
    read_once=((1, "k"), (2, "v")), no_copy=((1, "k"), (2, "v")),
    mistakes=(
        Mistake("a row whose scores all lie far below 0 (a padded query) gives NaN: the running "
                "max starts above every one of its scores, so every exponential underflows to 0 "
                "and the row divides 0 by 0", chunked_attention_given),
        Mistake("your padded rows give zeros: their scores are all equal (all PAD), and a softmax "
                "of equal scores is uniform, however low they are; the NaN came from somewhere "
                "to repair, not to hide", _chunked_zeroed),
    ),
))


# --- ch09.memory_exponent: measure how peak memory grows with the length -------------------------

def naive_attention(q, k, v):
    """softmax(q k^T / sqrt(D)) v, with the whole (Tq, Tk) table of scores at once."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(s, dim=-1) @ v


def tiled_attention(q, k, v, block=64):
    """The same, over key tiles of ``block``: a running max, sum and output per query."""
    scale = 1 / math.sqrt(q.shape[-1])
    m = torch.full(q.shape[:-1], -math.inf)
    l = torch.zeros(q.shape[:-1])
    acc = torch.zeros(*q.shape[:-1], v.shape[-1])
    for k0 in range(0, k.shape[-2], block):
        s = q @ k[..., k0:k0 + block, :].transpose(-2, -1) * scale
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p @ v[..., k0:k0 + block, :]
        m = m_new
    return acc / l[..., None]


def growing_tiled_attention(q, k, v):
    """The tiled forward with tiles that grow with the length: 4·ceil(sqrt(Tk)) keys each."""
    return tiled_attention(q, k, v, block=4 * (math.isqrt(k.shape[-2] - 1) + 1))


ATTENTIONS = {"naive": naive_attention, "tiled": tiled_attention,
              "growing": growing_tiled_attention}


def _allocations(fn, t, dim):
    """The bytes of every allocation (positive) and free (negative) that ``fn(q, k, v)`` makes,
    in time order, for q, k, v of shape (t, dim) made before the profiler starts, as
    course_attn.timing reads them (the raw event list keeps the allocations inside operators)."""
    import os

    from torch.profiler import ProfilerActivity, profile
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, dim, generator=g) for _ in range(3))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(q, k, v)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return [e.nbytes() for e in sorted(events, key=lambda e: e.start_ns())]


def _peak(sizes):
    held = peak = 0
    for size in sizes:
        held += size
        peak = max(peak, held)
    return peak


def _slope(xs, ys):
    """The least-squares slope of ys against xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _exponent(name, lengths, dim, *, inputs=False, total=False, largest=False,
              log_t=math.log, log_peak=math.log):
    """The fitted exponent of peak bytes against T; or a variant: ``inputs`` counts q, k, v
    (3 T dim floats) as held, ``total`` sums every allocation instead of the peak, ``largest``
    takes the largest single allocation, ``log_t`` and ``log_peak`` are what the fit takes of T
    and of the bytes."""
    peaks = []
    for t in lengths:
        sizes = _allocations(ATTENTIONS[name], t, dim)
        measured = (sum(s for s in sizes if s > 0) if total else max(sizes) if largest
                    else _peak(sizes))
        peaks.append(measured + (3 * t * dim * 4 if inputs else 0))
    return _slope([log_t(t) for t in lengths], [log_peak(p) for p in peaks])


def memory_exponent_reference(name, lengths, dim):
    return _exponent(name, lengths, dim)


@functools.lru_cache(maxsize=64)
def _exponent_tolerance(name, lengths, dim):
    """How far a right measurement may lie from the reference's: the peak is exact, the same
    bytes on every run (the allocator's requests do not depend on timing), but a student may
    count the inputs q, k, v as held or not, or create them inside the profiled region; both are
    right, and they move the fit by the gap between the two exponents, which the grader
    computes for these lengths. 0.05 more for what else a right answer may hold (a copy of the
    inputs made outside the function, a dtype conversion), far below the gaps between the
    naive (about 2), the tiled (about 1) exponent and the typical mistakes below."""
    gap = abs(_exponent(name, lengths, dim, inputs=True) - _exponent(name, lengths, dim))
    return gap + 0.05


def _compare_exponent(actual, expected, case=None):
    got = as_number(actual)
    if got is None:
        raise AssertionError(f"your answer should be a number, got {type(actual).__name__}")
    tolerance = 0.05 if case is None else _exponent_tolerance(
        case.args[0], tuple(case.args[1]), case.args[2])
    if not abs(got - expected) <= tolerance:
        raise AssertionError(f"your exponent is {'too large' if got > expected else 'too small'}")


def exponent_case(name, lengths, dim, hint=""):
    return Case(f"{name}, lengths {lengths}, dim {dim}", (name, list(lengths), dim), hint=hint)


def _exponent_cases():
    yield exponent_case("naive", (128, 256, 512), 16,
                        hint="the (T, T) table of scores is the largest thing it holds")
    yield exponent_case("tiled", (128, 256, 512), 16,
                        hint="a tile of scores is (T, block): it grows with T once")
    yield exponent_case("tiled", (100, 300, 700), 32,
                        hint="lengths that do not double: fit all three points at once")
    yield exponent_case("growing", (56, 84, 126), 64,
                        hint="no formula gives this one: what is held at once is the inputs' "
                             "and the output's rows beside a tile of scores")


def _with_rule(**rule):
    return lambda name, lengths, dim: _exponent(name, lengths, dim, **rule)


register(Exercise(
    key="ch09.memory_exponent", function="memory_exponent", task="measure",
    reference=memory_exponent_reference, ops=ELEMENTARY | SOFTMAX,
    cases=_exponent_cases, compare=_compare_exponent,
    banned=("course_attn",),
    mistakes=(
        Mistake("you added up every allocation the call makes, freed or not: the tiled forward "
                "allocates a tile of scores per key block, but frees each before the next; the "
                "peak is what it holds at once", _with_rule(total=True)),
        Mistake("you took the largest single allocation: the peak is what the call holds at "
                "once, every tensor alive at that moment together", _with_rule(largest=True)),
        Mistake("you fitted the log of the bytes against T itself: a power law is a straight "
                "line in log T", _with_rule(log_t=float)),
        Mistake("you fitted against T itself and the bytes themselves: a power law is a "
                "straight line only on a log-log scale", _with_rule(log_t=float, log_peak=float)),
        Mistake("your two logarithms have different bases", _with_rule(log_t=math.log2)),
        Mistake("your two logarithms have different bases", _with_rule(log_peak=math.log2)),
    ),
))


# --- ch09.flash_backward: the backward of one part of a merged attention -----------------------
# The chapter's tiled_backward takes dO only. Where a part's output is merged with another part's
# (chapter 9's ring: each rank attends to the keys it holds, then the partial states are merged),
# the loss reaches this part through its output and through its lse, which sets its share of the
# merge. Not shown in the chapter, derived by the student: with w = exp(lse - lse_m) this part's
# share and O_m = w O + (1 - w) O_b, the part receives dO = w dO_m and dlse = w rowsum(dO_m ∘
# (O - O_m)); lse_i depends on every score of row i, d lse_i / d S_ij = P_ij, so
# dS = P ∘ (dP - D + dlse).

NO_AUTOGRAD = ("torch.autograd.grad", "torch.autograd.backward", "torch.Tensor.backward",
               "torch.autograd.functional.jacobian", "torch.autograd.functional.vjp",
               "torch.func.grad", "torch.func.grad_and_value", "torch.func.vjp",
               "torch.func.jacrev", "torch.func.jacfwd", "torch._softmax_backward_data")


def _visible(tq, tk, is_causal, device=None):
    """(Tq, Tk) bool: which keys each query may see (bottom-right aligned when causal)."""
    if not is_causal:
        return torch.ones(tq, tk, dtype=torch.bool, device=device)
    return causal_mask(tq, tk, device=device)


def _masked_scores(q, k, is_causal):
    """(..., Tq, Tk): q kᵀ / sqrt(D), -inf where a query may not see the key."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return s.masked_fill(~_visible(q.shape[-2], k.shape[-2], is_causal, q.device), INF)


def _weights_from_lse(s, lse):
    """P = exp(s - lse), row by row; 0 in a row that sees no key (lse = -inf)."""
    return torch.exp(s - torch.where(lse == INF, 0.0, lse)[..., None])


def flash_forward_reference(q, k, v, is_causal=False):
    """(out, lse) in float64: out (B, H, Tq, Dv), lse (B, H, Tq), -inf (and out 0) for a row
    that sees no key."""
    s = _masked_scores(q.double(), k.double(), is_causal)
    lse = torch.logsumexp(s, dim=-1)
    return (_weights_from_lse(s, lse) @ v.double()).to(q.dtype), lse.to(q.dtype)


def _flash_grads(q, k, v, out, lse, dout, dlse, is_causal, *, rowsum=True, with_lse=True,
                 times_p=True, dlse_sign=1.0):
    """dq, dk, dv of the dense computation, with one of the typical mistakes switched on."""
    scale = 1 / math.sqrt(q.shape[-1])
    s = _masked_scores(q, k, is_causal)
    p = _weights_from_lse(s, lse) if with_lse else torch.exp(s)
    dv = p.transpose(-2, -1) @ dout
    dp = dout @ v.transpose(-2, -1)
    rows = (dout * out).sum(-1, keepdim=True) if rowsum else 0.0
    inner = dp - rows + dlse_sign * dlse[..., None]
    ds = p * inner if times_p else inner.masked_fill(p == 0, 0.0)
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


def _merge_sends(out, lse, out_b, lse_b, dout, *, weight=True, through_lse=True,
                 against="merged"):
    """(dO, dlse): what the merge of this part (out, lse) with the other (out_b, lse_b) sends
    back into this part, from dout (B, H, Tq, Dv), the gradient of the merged output; or a
    typical mistake's: ``weight=False`` passes dout on as it is (and nothing through lse),
    ``through_lse=False`` sends nothing through lse, ``against="other"`` takes the derivative
    of the share w as if the merged lse were fixed (out - out_b in place of out - O_m)."""
    top = torch.maximum(lse, lse_b)
    a, b = torch.exp(lse - _finite_max(top)), torch.exp(lse_b - _finite_max(top))
    w = a / torch.where(a + b == 0, torch.ones_like(a), a + b)    # 0 where this part is empty
    merged = w[..., None] * out + (1 - w)[..., None] * out_b
    if not weight:
        return dout, torch.zeros_like(lse)
    moved = out - (out_b if against == "other" else merged)
    dlse = w * (dout * moved).sum(-1) if through_lse else torch.zeros_like(lse)
    return w[..., None] * dout, dlse


def flash_backward_reference(q, k, v, out, lse, out_b, lse_b, dout, is_causal=False, block=16):
    """(dq, dk, dv) of a loss whose gradient on the merged output of this part (q over k, v:
    out (B, H, Tq, Dv), lse (B, H, Tq)) and another part (out_b, lse_b, held constant) is
    dout (B, H, Tq, Dv): the merge's dO and dlse, then the dense computation."""
    sent = _merge_sends(out, lse, out_b, lse_b, dout)
    return _flash_grads(q, k, v, out, lse, *sent, is_causal)


def _backward_with(merge=None, **mistake):
    """A typical mistake: the merge sends back ``_merge_sends(..., **merge)``, and the part's
    backward is ``_flash_grads(..., **mistake)``."""
    def fn(q, k, v, out, lse, out_b, lse_b, dout, is_causal=False, block=16):
        sent = _merge_sends(out, lse, out_b, lse_b, dout, **(merge or {}))
        return _flash_grads(q, k, v, out, lse, *sent, is_causal, **mistake)
    return fn


def backward_inputs(b, h, tq, tk, d, dv, seed, *, is_causal=False, other=True):
    """q, k, v and their forward's out and lse (float64); the other part's out_b and lse_b,
    attention of q over keys of its own (``other=False``: an empty part, out_b = 0 and lse_b =
    -inf); and a random gradient dout of the merged output."""
    g = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    q, k, v = (randn(b, h, t, width, seed=g, dtype=torch.float64)
               for t, width in ((tq, d), (tk, d), (tk, dv)))
    out, lse = flash_forward_reference(q, k, v, is_causal)
    k_b, v_b = randn(b, h, 5, d, seed=g, dtype=torch.float64), randn(b, h, 5, dv, seed=g,
                                                                       dtype=torch.float64)
    out_b, lse_b = flash_forward_reference(q, k_b, v_b)
    if not other:
        out_b, lse_b = torch.zeros_like(out_b), torch.full_like(lse_b, INF)
    dout = randn(b, h, tq, dv, seed=g, dtype=torch.float64)
    return q, k, v, out, lse, out_b, lse_b, dout, is_causal


def backward_case(name, b, h, tq, tk, d, dv, block, seed, *, is_causal=False, other=True,
                  hint=""):
    return Case(name, (*backward_inputs(b, h, tq, tk, d, dv, seed, is_causal=is_causal,
                                        other=other), block), hint=hint)


def _backward_cases():
    yield backward_case("Tq = Tk = 40 in blocks of 16, the other part empty (the chapter's "
                        "backward)", 1, 2, 40, 40, 8, 8, 16, 950, other=False,
                        hint="with the other part empty, the merge is this part alone")
    yield backward_case("Tq = Tk = 40 in blocks of 16, merged with another part", 1, 2, 40, 40,
                        8, 8, 16, 951, hint="the merged output depends on this part's lse "
                                            "through its share, and lse_i on every score of "
                                            "row i")
    yield backward_case("causal, Tq = 24 < Tk = 56, blocks of 16, merged", 2, 1, 24, 56, 8, 4,
                        16, 952, is_causal=True, hint="query i sits at position Tk - Tq + i")
    yield backward_case("causal, Tq = 40 > Tk = 24: rows that see no key here (lse = -inf), "
                        "merged", 1, 2, 40, 24, 8, 8, 16, 953, is_causal=True,
                        hint="a row that sees no key in this part has no share of the merge")
    yield backward_case("one block: Tq = Tk = 12, block 16, merged", 1, 1, 12, 12, 8, 8, 16,
                        954, hint="a single tile holds every score")


register(Exercise(
    key="ch09.flash_backward", function="flash_backward", reference=flash_backward_reference,
    task="implement", ops=ELEMENTARY, cases=_backward_cases,
    compare=expect_tensors(("dq", "dk", "dv")),
    banned=NO_SOFTMAX_OR_LSE + NO_LIBRARY_ATTENTION[1:] + NO_AUTOGRAD,
    no_table=(0, 1, 9),
    mistakes=(
        Mistake("you ran the backward on dout as if this part were the whole attention: the "
                "merge weighs this part's output by its share of the total weight, and that "
                "share depends on its lse", _backward_with(dict(weight=False))),
        Mistake("your gradients are right where the other part is empty and wrong where it is "
                "not: this part's share of the merge depends on its lse, and lse on every "
                "score of the row", _backward_with(dict(through_lse=False))),
        Mistake("your gradient through lse treats the merged lse as fixed: raising this part's "
                "lse raises the merged one too, which shrinks the other part's share",
                _backward_with(dict(against="other"))),
        Mistake("your gradient through lse has the wrong sign: raising a score raises lse",
                _backward_with(dlse_sign=-1.0)),
        Mistake("your dS leaves out the row term of the softmax's Jacobian (what D = rowsum(dO ∘ "
                "O) stands for): the weights of a row sum to 1, so raising one lowers the others",
                _backward_with(rowsum=False)),
        Mistake("your recomputed P is not normalised: its rows do not sum to 1, as the forward's "
                "weights did", _backward_with(with_lse=False)),
        Mistake("your dS is not weighted by P: a score's gradient is as large as its weight",
                _backward_with(times_p=False)),
    ),
))
