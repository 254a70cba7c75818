"""Chapter 11's exercises: each typical mistake fails the case meant for it with its own hint, and a
banned call is reported by name. What every exercise must satisfy (the reference and the
solution pass public and hidden cases, a stub is "not answered yet", every declared mistake
names itself) is tested once, for all chapters, in test_exercises_conformance.py.

The wrong solutions below are written as a student would write them; each test names the case
it must fail and a fragment of the hint it must get.
"""

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import course_attn
from course_attn.grading import get, run_exercise
from course_attn.grading.ch11 import BUDGET_QUESTIONS, BUDGET_SIZES, MORE_BUDGET_SIZES
from course_attn.grading.check import grade_here
from course_attn.grading.exercise import hidden_cases
from course_attn.local import RollingKVCache
from course_attn.masks import key_reach
from course_attn.model import GPT, GPTConfig

from check_support import assert_banned, assert_fails, assert_fails_on_every_seed, results
from helpers import ROOT

MASK, INDEX, BLOCK, BUDGET = ("ch11.window_mask", "ch11.rolling_index",
                              "ch11.local_attention_block", "ch11.window_budget")


# --- solutions as in solutions/11_local_attention.ipynb ------------------------------------------

def window_mask(tq, tk, window, *, extra=0, align="bottom_right", causal=True):
    """The solution; the keywords make it one typical mistake or another."""
    shift = tk - tq if align == "bottom_right" else 0
    d = (torch.arange(tq).unsqueeze(1) + shift) - torch.arange(tk).unsqueeze(0)
    if not causal:
        return d.abs() < window
    return (d >= 0) & (d < window + extra)


def rolling_index(position, size, sinks=0):
    if position < sinks:
        return position
    return sinks + (position - sinks) % (size - sinks)


def local_attention_block(q, k, v, start, window, *, lo_shift=0, read_all=False, extra=0):
    """The solution; the keywords make it one typical mistake or another."""
    tb = q.shape[2]
    lo, hi = max(0, start - window + 1 + lo_shift), start + tb
    if read_all:
        lo, hi = 0, k.shape[2]
    k_in, v_in = k[:, :, lo:hi], v[:, :, lo:hi]
    scores = q @ k_in.transpose(-2, -1) / math.sqrt(q.shape[-1])
    d = torch.arange(start, start + tb)[:, None] - torch.arange(lo, hi)[None, :]
    scores = scores.masked_fill(~((d >= 0) & (d < window + extra)), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v_in


def window_budget(T, W, L, H, H_kv, D, nbytes, *, per_layer="W-1", plus_one=True, heads="kv",
                  tensors=2, pairs="window"):
    """The solution; the keywords make it one typical mistake or another."""
    step = {"W-1": W - 1, "W": W}[per_layer]
    start = 1 if plus_one and per_layer == "W-1" else 0

    def reach(layers):
        return layers * step + start
    layers = 1
    while reach(layers) < T:
        layers += 1
    count = {"window": sum(min(i + 1, W) for i in range(T)), "all_W": T * W,
             "causal": T * (T + 1) // 2}[pairs]
    return {"reach": reach(L), "layers_to_cover": layers, "pairs": count,
            "cache_bytes": tensors * L * (H_kv if heads == "kv" else H) * D * W * nbytes}


@pytest.mark.parametrize("key, fn", [(MASK, window_mask), (INDEX, rolling_index),
                                     (BLOCK, local_attention_block), (BUDGET, window_budget)])
def test_the_notebooks_solutions_pass_with_the_watch_on(key, fn):
    for cases in [None] + [hidden_cases(key, seed) or None for seed in range(5)]:
        judgement = run_exercise(get(key), fn, cases)
        assert judgement.passed, (judgement.banned, [(r.name, r.message) for r in
                                                     judgement.results if not r.passed])


# --- window_mask ---------------------------------------------------------------------------------

SQUARE = "square, T=7, W=3"
FEWER = "fewer queries than keys, Tq=3, Tk=8, W=3"


def test_the_window_mask_reference_is_the_package_mask_and_the_band():
    for tq, tk, w in ((7, 7, 3), (3, 8, 3), (5, 3, 2), (4, 4, 6)):
        expected = course_attn.sliding_window_mask(tq, tk, w)
        assert torch.equal(get(MASK).reference(tq, tk, w), expected)
        assert torch.equal(window_mask(tq, tk, w), expected)
    # square: the band between two diagonals, W keys a row once the window is full
    band = torch.ones(7, 7, dtype=torch.bool).tril() & ~torch.ones(7, 7, dtype=torch.bool).tril(-3)
    assert torch.equal(window_mask(7, 7, 3), band)
    assert window_mask(7, 7, 3).sum(-1).tolist() == [1, 2, 3, 3, 3, 3, 3]


def test_window_mask_mistakes():
    assert_fails(MASK, lambda tq, tk, w: window_mask(tq, tk, w, extra=1), SQUARE, hint="W + 1 keys")
    assert_fails(MASK, lambda tq, tk, w: window_mask(tq, tk, w, extra=-1), SQUARE,
                 hint="W - 1 keys")
    assert_fails(MASK, lambda tq, tk, w: window_mask(tq, tk, w, align="top_left"), FEWER,
                 hint="aligned top-left")
    assert_fails(MASK, lambda tq, tk, w: window_mask(tq, tk, w, causal=False), SQUARE,
                 hint="looks both ways")
    assert_fails(MASK, lambda tq, tk, w: torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq),
                 SQUARE, hint="only causal")
    assert_fails(MASK, lambda tq, tk, w: window_mask(tq, tk, w).long(), SQUARE, hint="0/1 numbers")
    assert_fails(MASK, lambda tq, tk, w: ~window_mask(tq, tk, w), SQUARE, hint="may NOT attend")


def test_a_top_left_mask_passes_the_square_cases_only():
    """The bottom-right alignment matters only when Tq != Tk: the case hints say so."""
    found = results(MASK, lambda tq, tk, w: window_mask(tq, tk, w, align="top_left"))
    assert found[SQUARE].passed and not found[FEWER].passed


def test_window_mask_may_not_call_the_package_or_pytorchs_masks():
    assert_banned(MASK, lambda tq, tk, w: course_attn.sliding_window_mask(tq, tk, w),
                  "course_attn")

    # check() refuses the functions of the modules the notebook has imported (the grader
    # imports them all first): a notebook that calls it has imported it, as this test does.
    from torch.nn.attention.bias import causal_lower_right

    def with_pytorch(tq, tk, w):
        causal_lower_right(tk, tk)
        return window_mask(tq, tk, w)
    assert_banned(MASK, with_pytorch, "causal_lower_right")


# --- rolling_index -------------------------------------------------------------------------------

def test_the_rolling_index_reference_keeps_the_sinks_and_the_last_tokens():
    """Writing tokens 0..n-1 at their slots leaves the sinks and the last size - sinks tokens
    in the buffer: what a rolling cache with sinks must hold."""
    reference = get(INDEX).reference
    for size, sinks in ((4, 0), (6, 2), (5, 3), (4, 1)):
        buffer = [None] * size
        for n in range(1, 40):
            buffer[reference(n - 1, size, sinks)] = n - 1
            kept = sorted(t for t in buffer if t is not None)
            expected = sorted(set(range(min(sinks, n))) | set(range(max(0, n - (size - sinks)),
                                                                    n)))
            assert kept == expected, (size, sinks, n, kept)


def test_the_rolling_index_is_the_slot_the_package_cache_writes():
    from course_attn.local import RollingKVCache
    reference = get(INDEX).reference
    for window, sinks in ((4, 0), (4, 2), (2, 3), (5, 1)):
        cache = RollingKVCache(1, 1, window, 2, sinks=sinks)
        assert [cache.slot(p) for p in range(50)] == [reference(p, window + sinks, sinks)
                                                      for p in range(50)]


def test_rolling_index_mistakes():
    wrap = "the first wrap with sinks: position 6, size 6, 2 sinks"
    assert_fails(INDEX, lambda p, n, s=0: p % n, wrap, hint="overwrites a sink")
    assert_fails(INDEX, lambda p, n, s=0: p if p < s else (p - s) % (n - s),
                 "position 11, size 6, 2 sinks",
                 hint="leaves out the sinks' slots")
    assert_fails(INDEX, lambda p, n, s=0: p if p < s else s + p % (n - s),
                 "position 13, size 5, 3 sinks", hint="wrong phase")
    assert_fails(INDEX, lambda p, n, s=0: s + (p - s) % (n - s),
                 "a sink itself: position 1, size 6, 2 sinks", hint="rolled the sinks too")
    assert_fails(INDEX, lambda p, n, s=0: p if p < s else s + (p - s) % n, wrap,
                 hint="run past the buffer")
    assert_fails(INDEX, lambda p, n, s=0: float(rolling_index(p, n, s)) + 0.5,
                 "no sinks: position 2 in a buffer of 4", message="not a whole number")
    assert_fails(INDEX, lambda p, n, s=0: str(rolling_index(p, n, s)),
                 "no sinks: position 2 in a buffer of 4", message="should be an int")


def test_an_integer_tensor_or_float_of_the_right_slot_is_accepted():
    assert run_exercise(get(INDEX), lambda p, n, s=0: torch.tensor(rolling_index(p, n, s))).passed
    assert run_exercise(get(INDEX), lambda p, n, s=0: float(rolling_index(p, n, s))).passed


def test_rolling_index_may_not_call_the_package():
    def with_the_package(p, n, s=0):
        course_attn.causal_mask(1)
        return rolling_index(p, n, s)
    assert_banned(INDEX, with_the_package, "course_attn")


# --- local_attention_block -----------------------------------------------------------------------

MIDDLE = "a middle block: start=6, Tb=3, T=12, W=4"
LONG = "a block longer than the window: start=5, Tb=6, T=16, W=2"
NAN = "keys out of reach hold NaN: start=7, Tb=3, T=16, W=3"


def test_the_block_reference_is_a_slice_of_the_full_windowed_attention():
    """Blocks tiled over the sequence give the package's windowed attention, row for row."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 20, 8, generator=g) for _ in range(3))
    for w in (1, 3, 7, 25):
        full = course_attn.scaled_dot_product_attention(q, k, v, is_causal=True, window=w)
        for block in (1, 4, 6):
            tiled = torch.cat([get(BLOCK).reference(q[:, :, s:s + block], k, v, s, w)
                               for s in range(0, 20, block)], dim=2)
            torch.testing.assert_close(tiled, full)
            mine = torch.cat([local_attention_block(q[:, :, s:s + block], k, v, s, w)
                              for s in range(0, 20, block)], dim=2)
            torch.testing.assert_close(mine, full)


def test_the_nan_case_poisons_exactly_the_keys_out_of_reach():
    case = {c.name: c for c in get(BLOCK).public_cases()}[NAN]
    q, k, v, start, window = case.args
    nan = k[0, 0, :, 0].isnan()
    reach = torch.zeros_like(nan)
    reach[start - window + 1:start + q.shape[2]] = True
    assert torch.equal(~nan, reach) and torch.equal(v[0, 0, :, 0].isnan(), nan)


def test_local_attention_block_mistakes():
    assert_fails(BLOCK, lambda *a: local_attention_block(*a, read_all=True), NAN,
                 hint="outside its reach", message="NaN")
    assert_fails(BLOCK, lambda *a: local_attention_block(*a, lo_shift=-1), NAN,
                 hint="outside its reach")
    assert_fails(BLOCK, lambda *a: local_attention_block(*a, lo_shift=1), MIDDLE,
                 hint="start one too late")
    assert_fails(BLOCK, lambda *a: local_attention_block(*a, extra=1), LONG, hint="W + 1 keys")

    def masked_full(q, k, v, start, window):
        """The whole T x T attention with the window mask, then the block's rows: correct
        numbers on clean inputs, but it reads every key."""
        t, tb = k.shape[2], q.shape[2]
        full_q = torch.zeros(q.shape[0], q.shape[1], t, q.shape[3], dtype=q.dtype)
        full_q[:, :, start:start + tb] = q
        scores = full_q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        d = torch.arange(t)[:, None] - torch.arange(t)[None, :]
        scores = scores.masked_fill(~((d >= 0) & (d < window)), float("-inf"))
        return (torch.softmax(scores, dim=-1) @ v)[:, :, start:start + tb]
    found = results(BLOCK, masked_full)
    assert [name for name, r in found.items() if not r.passed] == [NAN]
    assert_fails(BLOCK, masked_full, NAN, hint="outside its reach")

    def top_left(q, k, v, start, window):
        tb, lo = q.shape[2], max(0, start - window + 1)
        k_in, v_in = k[:, :, lo:start + tb], v[:, :, lo:start + tb]
        scores = q @ k_in.transpose(-2, -1) / math.sqrt(q.shape[-1])
        n = k_in.shape[2]
        d = torch.arange(tb)[:, None] - torch.arange(n)[None, :]
        scores = scores.masked_fill(~((d >= 0) & (d < window)), float("-inf"))
        return torch.softmax(scores, dim=-1) @ v_in
    assert_fails(BLOCK, top_left, MIDDLE, hint="aligned top-left")
    assert_fails(BLOCK, lambda q, k, v, s, w: local_attention_block(q, k, v, 0, w), MIDDLE,
                 hint="at position 0")
    assert_fails(BLOCK, lambda q, k, v, s, w: local_attention_block(q * math.sqrt(q.shape[-1]),
                                                                     k, v, s, w),
                 MIDDLE, hint="1/sqrt(D)")


def test_local_attention_block_may_not_call_a_library_attention():
    def with_sdpa(q, k, v, start, window):
        lo, hi = max(0, start - window + 1), start + q.shape[2]
        mask = course_attn.sliding_window_mask(q.shape[2], hi - lo, window)
        return F.scaled_dot_product_attention(q, k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=mask)
    assert_banned(BLOCK, with_sdpa, "course_attn")

    def with_pytorch(q, k, v, start, window):
        lo, hi = max(0, start - window + 1), start + q.shape[2]
        d = torch.arange(start, hi)[:, None] - torch.arange(lo, hi)[None, :]
        return F.scaled_dot_product_attention(q, k[:, :, lo:hi], v[:, :, lo:hi],
                                              attn_mask=(d >= 0) & (d < window))
    assert_banned(BLOCK, with_pytorch, "torch.nn.functional.scaled_dot_product_attention")


# --- window_budget -------------------------------------------------------------------------------

def test_the_reach_is_what_gradients_show_on_a_windowed_gpt():
    """The receptive field L·(W - 1) + 1 behind question (a), checked on a small windowed GPT:
    the last position's output depends on exactly that many input embeddings."""
    torch.manual_seed(0)
    for n_layers, window in ((1, 3), (2, 3), (3, 4)):
        model = GPT(GPTConfig(vocab_size=11, seq_len=32, d_model=16, n_heads=2,
                              n_layers=n_layers, window=window, position="rope"))
        x = model.token_embedding(torch.randint(11, (1, 24))).detach().requires_grad_(True)
        h = x
        positions = torch.arange(24)
        for block in model.blocks:
            h, _ = block(h, positions=positions)
        h[0, -1].sum().backward()
        touched = (x.grad[0].abs().sum(-1) > 0).nonzero().flatten().tolist()
        reach = n_layers * (window - 1) + 1
        assert touched == list(range(24 - reach, 24)), (n_layers, window, touched)


def budget_sizes(seeds=range(10)):
    """The public sets of sizes and the hidden ones drawn with ``seeds``, each once."""
    sizes = [BUDGET_SIZES, MORE_BUDGET_SIZES]
    for seed in seeds:
        for case in hidden_cases(BUDGET, seed):
            if dict(case.kwargs) not in sizes:
                sizes.append(dict(case.kwargs))
    return sizes


def one_layer_back(seen, window):
    """Positions whose token a layer's output at the positions ``seen`` (a bool array, by
    position) reads: key j for every query i seen with 0 <= i - j < window, i.e. some position
    seen among j .. j + window - 1 (counted with a running sum; numpy, one thread)."""
    counts = np.cumsum(seen, dtype=np.int64)
    last = counts[np.minimum(np.arange(len(seen)) + window - 1, len(seen) - 1)]
    return last > np.concatenate([[0], counts[:-1]])


def test_one_layer_back_is_the_window_mask():
    for t, w in ((12, 3), (9, 9), (7, 1)):
        seen = torch.rand(t) < 0.3
        by_mask = (course_attn.sliding_window_mask(t, t, w) & seen[:, None]).any(0)
        assert (one_layer_back(seen.numpy(), w) == by_mask.numpy()).all()


def test_the_budget_is_a_brute_force_count_on_public_and_hidden_sizes():
    """(a) and (b): positions followed back layer by layer; (c) the keys of each query, from
    the package's rule for the keys a run of queries sees; (d) the package's rolling cache."""
    sizes = budget_sizes(range(5))          # a layer back is a pass over up to L·W positions
    assert len(sizes) == 2 + 4 * 5
    for size in sizes:
        T, W, L, H_kv, D, nbytes = (size[k] for k in ("T", "W", "L", "H_kv", "D", "nbytes"))
        right = get(BUDGET).reference(**size)
        seen = np.zeros(L * W + 1, dtype=bool)
        seen[-1] = True                                  # one position p, far from the start
        for _ in range(L):
            seen = one_layer_back(seen, W)
        assert right["reach"] == int(seen.sum()) and not seen[0]
        seen, layers = np.zeros(T, dtype=bool), 0
        seen[-1] = True                                  # the last position of T
        while not seen[0]:
            seen, layers = one_layer_back(seen, W), layers + 1
        assert right["layers_to_cover"] == max(layers, 1)
        assert right["pairs"] == sum(hi - lo for lo, hi in (
            key_reach(i, i, T, is_causal=True, window=W) for i in range(T)))
        dtype = {2: torch.float16, 4: torch.float32}[nbytes]
        cache = RollingKVCache(1, H_kv, W, D, dtype=dtype, device="meta")
        assert right["cache_bytes"] == L * cache.nbytes
        assert right == window_budget(**size)
    for t, w in ((16, 4), (40, 7), (5, 9)):        # (c) counted on the mask itself
        size = {**MORE_BUDGET_SIZES, "T": t, "W": w}
        assert get(BUDGET).reference(**size)["pairs"] == \
            int(course_attn.sliding_window_mask(t, t, w).sum())
    answers = get(BUDGET).reference(**BUDGET_SIZES)
    assert answers["reach"] == 131041 and answers["layers_to_cover"] == 5
    assert answers["cache_bytes"] == 512 * 2 ** 20     # 512 MiB; 8 times less than 32768 tokens


def test_window_budget_hidden_sizes_cover_their_regimes():
    for seed in range(20):
        divides, exact, overshoot, short = budget_sizes([seed])[2:]
        assert divides["T"] % divides["W"] == 0 and divides["T"] >= 2 * divides["W"]
        assert (exact["T"] - 1) % (exact["W"] - 1) == 0 and exact["T"] % exact["W"]
        assert exact["H_kv"] == 1
        assert (overshoot["T"] - 1) % (overshoot["W"] - 1) and overshoot["T"] > overshoot["W"]
        assert 2 <= short["T"] <= short["W"]
        for size in (divides, exact, overshoot, short):
            assert size["H"] > size["H_kv"] and size["L"] >= 2 and size["W"] >= 16


def test_window_budget_mistakes():
    cases = [case.name for case in get(BUDGET).public_cases()]
    a, b, c, d, a2, b2, c2, d2 = cases

    def with_(**mistake):
        return lambda **size: window_budget(**size, **mistake)
    assert_fails(BUDGET, with_(per_layer="W"), a, hint="W new positions per layer",
                 message="a little too large")
    assert_fails(BUDGET, with_(per_layer="W"), b, hint="W new positions per layer",
                 message="too small")
    assert_fails(BUDGET, with_(plus_one=False), a, hint="left out the position itself")
    assert_fails(BUDGET, with_(plus_one=False), b2, hint="left out the position itself",
                 message="too large")                   # one layer more, where they cover T exactly
    assert results(BUDGET, with_(plus_one=False))[b].passed
    assert_fails(BUDGET, lambda **size: {**window_budget(**size), "reach": size["W"]}, a,
                 hint="one layer only")
    assert_fails(BUDGET, with_(pairs="all_W"), c, hint="W keys for every query")
    assert_fails(BUDGET, with_(pairs="causal"), c2, hint="full causal attention")
    assert_fails(BUDGET, with_(heads="query"), d, hint="query heads")
    assert_fails(BUDGET, with_(heads="query"), d2, hint="query heads")
    assert_fails(BUDGET, with_(tensors=1), d, hint="keys only")
    assert_fails(BUDGET, lambda **size: [1, 2, 3, 4], a, message="should return a dict")


def test_window_budget_never_shows_the_right_answer():
    for result in run_exercise(get(BUDGET), lambda **size: dict.fromkeys(BUDGET_QUESTIONS,
                                                                          12345)).results:
        assert not result.passed
        assert result.message.endswith("too large") or result.message.endswith("too small")
        assert "times" not in result.message
        for size in (BUDGET_SIZES, MORE_BUDGET_SIZES):
            for value in window_budget(**size).values():
                assert not re.search(rf"\b{value}\b", result.message + result.hint)
                assert value < 1000 or f"{value:,}" not in result.message


def test_window_budget_pasted_as_constants_fails_the_hidden_cases_of_every_seed():
    pasted = {str(size): window_budget(**size) for size in (BUDGET_SIZES, MORE_BUDGET_SIZES)}

    def window_budget_pasted(**size):            # the public answers, typed in
        return pasted.get(str(size), pasted[str(BUDGET_SIZES)])
    assert run_exercise(get(BUDGET), window_budget_pasted).passed
    for seed in range(20):
        judgement = run_exercise(get(BUDGET), window_budget_pasted, hidden_cases(BUDGET, seed))
        assert not judgement.passed, seed
        assert sum(not r.passed for r in judgement.results) >= 12, seed


def test_window_budget_may_not_call_the_package():
    def with_the_package(**size):
        course_attn.causal_mask(2)
        return window_budget(**size)
    assert_banned(BUDGET, with_the_package, "course_attn")


# --- window_decode (debug) -------------------------------------------------------------------------

DECODE = "ch11.window_decode"
SLIDES, ONES, WIDE = ("T=10, W=4: the window slides; B=1, H=2, D=Dv=8",
                      "constant values (every value 1): every output must be 1; T=9, W=4",
                      "a window wider than the sequence: T=5, W=8")


def window_decode(q, k, v, window, *, held="written", no_window=False):
    """The repaired loop of the notebook; ``held="all_slots"`` is the given bug, ``"before"``
    the half-repair that slices the buffer to the first i slots, ``no_window`` one that drops
    the buffer and reads every token so far."""
    b, h, t, d = q.shape
    keys = q.new_zeros(b, h, window, d)
    values = q.new_zeros(b, h, window, v.shape[-1])
    outs = []
    for i in range(t):
        keys[:, :, i % window] = k[:, :, i]
        values[:, :, i % window] = v[:, :, i]
        if no_window:
            ks, vs = k[:, :, :i + 1], v[:, :, :i + 1]
        elif held == "all_slots":
            ks, vs = keys, values
        elif held == "before":
            n = i if i < window else window
            ks, vs = keys[:, :, :n], values[:, :, :n]
        else:
            n = min(i + 1, window)
            ks, vs = keys[:, :, :n], values[:, :, :n]
        scores = q[:, :, i:i + 1] @ ks.transpose(-2, -1) / math.sqrt(d)
        outs.append(torch.softmax(scores, dim=-1) @ vs)
    return torch.cat(outs, dim=2)


def test_window_decode_solution_passes_with_the_watch_on():
    for cases in [None] + [hidden_cases(DECODE, seed) for seed in range(5)]:
        judgement = run_exercise(get(DECODE), window_decode, cases)
        assert judgement.passed, (judgement.banned, [(r.name, r.message) for r in
                                                     judgement.results if not r.passed])


def test_the_given_decode_loop_fails_with_the_bugs_hint():
    import nbformat
    from course_attn.grading.ch11 import given_window_decode
    assert_fails(DECODE, given_window_decode, ONES, hint="no token has been written")
    assert_fails(DECODE, given_window_decode, SLIDES, hint="no token has been written")
    for folder in ("solutions", "exercises"):                 # the notebooks give this one
        nb = nbformat.read(ROOT / folder / "11_local_attention.ipynb", as_version=4)
        given = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id")
                 == "ch11-window_decode-given"]
        assert len(given) == 1 and given[0].metadata["nbgrader"]["locked"]
        namespace = {"torch": torch, "math": math}
        exec(given[0].source, namespace)
        assert_fails(DECODE, namespace["given_window_decode"], WIDE,
                     hint="no token has been written")


def test_window_decode_half_repairs_are_named():
    assert_fails(DECODE, lambda *a: window_decode(*a, held="all_slots"), WIDE,
                 hint="no token has been written")
    assert_fails(DECODE, lambda *a: window_decode(*a, held="before"), SLIDES,
                 hint="misses its own key")
    assert_fails(DECODE, lambda *a: window_decode(*a, no_window=True), SLIDES,
                 hint="has no window")


def test_a_buffer_indexed_by_position_raises_and_is_named():
    """A mistake that raises: written at slot i, token W has no slot; the student's IndexError
    is named by the mistake that raises the same one."""
    def by_position(q, k, v, window):
        b, h, t, d = q.shape
        keys, values = q.new_zeros(b, h, window, d), q.new_zeros(b, h, window, v.shape[-1])
        outs = []
        for i in range(t):
            keys[:, :, i] = k[:, :, i]                 # not i % window
            values[:, :, i] = v[:, :, i]
            n = min(i + 1, window)
            scores = q[:, :, i:i + 1] @ keys[:, :, :n].transpose(-2, -1) / math.sqrt(d)
            outs.append(torch.softmax(scores, dim=-1) @ values[:, :, :n])
        return torch.cat(outs, dim=2)
    assert_fails(DECODE, by_position, SLIDES, hint="slot i:", message="IndexError")
    assert results(DECODE, by_position)[WIDE].passed       # the buffer never wraps there


def test_window_decode_is_the_rolling_cache_of_the_package():
    """The repaired loop gives what decoding with the package's RollingKVCache gives."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 11, 4, generator=g) for _ in range(3))
    cache, outs = RollingKVCache(1, 2, 3, 4), []
    for i in range(11):
        k_held, v_held = cache.update(k[:, :, i:i + 1], v[:, :, i:i + 1])
        outs.append(course_attn.scaled_dot_product_attention(q[:, :, i:i + 1], k_held, v_held))
    torch.testing.assert_close(window_decode(q, k, v, 3), torch.cat(outs, dim=2))


def test_window_decode_may_not_call_the_package_or_sdpa():
    def with_sdpa(q, k, v, window):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_banned(DECODE, with_sdpa, "scaled_dot_product_attention")

    def with_the_package(q, k, v, window):
        return course_attn.scaled_dot_product_attention(q, k, v, is_causal=True, window=window)
    assert_banned(DECODE, with_the_package, "course_attn")


# --- receptive_field (measure) ---------------------------------------------------------------------

FIELD = "ch11.receptive_field"
ONE_LAYER, THREE_LAYERS, CUT = "L=1, W=4, T=24", "L=3, W=4, T=24", \
    "the reach is cut at position 0: L=5, W=4, T=10"


def receptive_field(layers, window, length, seed, dilation=1, *, extra=0, causal_only=False,
                    every_output=False, count=False, backward=False):
    """The notebook's solution; the keywords make it a typical mistake (a window of W + extra
    keys, a mask only causal, the gradient of every output, the number of positions) or another
    honest route (``.backward()``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, length, 8, generator=g, requires_grad=True)
    pos = torch.arange(length)
    back = pos[:, None] - pos[None, :]
    windows = window if isinstance(window, list) else [window] * layers
    dilations = dilation if isinstance(dilation, list) else [dilation] * layers
    h = x
    for w, d in zip(windows, dilations):
        allowed = (back >= 0) if causal_only else \
            (back >= 0) & (back % d == 0) & (back // d < w + extra)
        wq, wk, wv = (torch.randn(8, 8, generator=g) / math.sqrt(8) for _ in range(3))
        scores = ((h @ wq) @ (h @ wk).transpose(-2, -1) / math.sqrt(8)).masked_fill(
            ~allowed, float("-inf"))
        h = h + torch.softmax(scores, dim=-1) @ (h @ wv)
    out = h.sum() if every_output else h[0, -1].sum()
    if backward:
        out.backward()
        grad = x.grad
    else:
        (grad,) = torch.autograd.grad(out, x)
    touched = (grad[0] != 0).any(dim=-1)
    return int(touched.sum()) if count else int(touched.nonzero()[0])


def test_receptive_field_solution_passes_with_the_watch_on():
    for fn in (receptive_field, lambda *a: receptive_field(*a, backward=True)):
        for cases in [None] + [hidden_cases(FIELD, seed) for seed in range(5)]:
            judgement = run_exercise(get(FIELD), fn, cases)
            assert judgement.passed, (judgement.banned, [(r.name, r.message) for r in
                                                         judgement.results if not r.passed])


def test_receptive_field_by_its_formula_earns_nothing():
    """Issue 42: the closed-form reach, max(0, T - 1 - L·(W - 1)) (with each layer's window and
    dilation where lists are given), takes no gradient and scored 2.4/4. The models the chapter
    has no formula for are the exercise's central regimes: even dilations skip position 0, the
    formula does not, and an answer wrong there earns nothing, on every seed."""
    def by_formula(layers, window, length, seed, dilation=1):
        windows = window if isinstance(window, list) else [window] * layers
        dilations = dilation if isinstance(dilation, list) else [dilation] * layers
        return max(0, length - 1 - sum(d * (w - 1) for w, d in zip(windows, dilations)))
    for seed in range(5):
        judgement = grade_here(get(FIELD), by_formula, seed, watch_banned=False)
        assert judgement.credit() == 0, (seed, judgement.reason())
        assert "earns nothing: it fails the regime the exercise is about" in judgement.reason()


def test_receptive_field_mistakes_as_a_student_makes_them():
    assert_fails(FIELD, lambda *a: receptive_field(*a, extra=1), ONE_LAYER, hint="W + 1 keys",
                 message="too early")
    assert_fails(FIELD, lambda *a: receptive_field(*a, extra=-1), THREE_LAYERS,
                 hint="W - 1 keys", message="too late")
    assert_fails(FIELD, lambda *a: receptive_field(*a, causal_only=True), ONE_LAYER,
                 hint="only causal")
    assert_fails(FIELD, lambda *a: receptive_field(*a, every_output=True), THREE_LAYERS,
                 hint="only causal")
    assert_fails(FIELD, lambda *a: receptive_field(*a, count=True), ONE_LAYER,
                 hint="how many positions")
    assert_fails(FIELD, lambda *a: 7.5, ONE_LAYER, message="not a whole number")


def reach_by_search(layers, window, length, seed=0, dilation=1):
    """The earliest position the last one reaches, from the masks alone: the positions seen
    through the layers, top to bottom, each keeping its own input (the residual)."""
    windows = window if isinstance(window, list) else [window] * layers
    dilations = dilation if isinstance(dilation, list) else [dilation] * layers
    seen = {length - 1}
    for w, d in reversed(list(zip(windows, dilations))):
        seen = {p - m * d for p in seen for m in range(w) if p - m * d >= 0}
    return min(seen)


def test_the_measured_receptive_field_is_the_reach_of_the_masks_on_every_seed():
    """The reference measures, for every model the hidden cases draw, the reach a search over
    the masks finds: L·(W - 1) + 1 positions cut at position 0 for one window; for dilated
    layers, no formula; each measurement runs in well under a second."""
    import time
    reference = get(FIELD).reference
    for seed in range(30):
        for case in hidden_cases(FIELD, seed):
            start = time.perf_counter()
            assert reference(*case.args) == reach_by_search(*case.args), case
            assert time.perf_counter() - start < 1.0
            if len(case.args) == 4:
                layers, window, length, _ = case.args
                assert reach_by_search(*case.args) == max(0, length - 1 - layers * (window - 1))


def test_receptive_field_cannot_be_answered_with_a_formula():
    """Issue 31: the chapter's formula scored full marks. Its natural extension to dilated
    layers, T - 1 minus every layer's reach, cut at 0, fails on every seed: even dilations skip
    position 0."""
    def formula(layers, window, length, seed, dilation=1):
        windows = window if isinstance(window, list) else [window] * layers
        dilations = dilation if isinstance(dilation, list) else [dilation] * layers
        return max(0, length - 1 - sum(d * (w - 1) for w, d in zip(windows, dilations)))
    for seed in range(30):
        assert not run_exercise(get(FIELD), formula, hidden_cases(FIELD, seed)).passed, seed


def test_receptive_field_may_not_call_the_package_or_sdpa():
    def with_sdpa(layers, window, length, seed):
        x = torch.randn(1, 1, length, 8, requires_grad=True)
        F.scaled_dot_product_attention(x, x, x, is_causal=True)
        return receptive_field(layers, window, length, seed)
    assert_banned(FIELD, with_sdpa, "scaled_dot_product_attention")

    def with_the_mask(layers, window, length, seed):
        course_attn.sliding_window_mask(length, length, window)
        return receptive_field(layers, window, length, seed)
    assert_banned(FIELD, with_the_mask, "course_attn")


def test_a_window_mask_wrong_only_at_a_regimes_edge_fails_on_every_seed():
    """Issue 31: one random draw inside a regime does not reach its edge. A window mask aligned
    top-left only past a gap of five (the regime Tq > Tk + 1 drew gaps of 2 to 6), and one
    whose window is one key short only when it nearly covers a square's keys (W = T - 1), each
    passed the hidden cases of some seeds; the hidden cases now hold each regime's edge, and
    both fail on every seed."""
    from course_attn.grading.ch11 import window_mask_reference

    def past_five(tq, tk, w):
        return window_mask_reference(tq, tq, w)[:, :tk] if tq - tk > 5 else \
            window_mask_reference(tq, tk, w)

    def nearly_covering(tq, tk, w):
        short = tq == tk and w == tk - 1 and w > 1
        return window_mask_reference(tq, tk, w - 1 if short else w)

    for wrong in (past_five, nearly_covering):
        assert_fails_on_every_seed("ch11.window_mask", wrong)


def test_a_rolling_index_wrong_only_at_a_regimes_edge_fails_on_every_seed():
    """Issue 31: a rolling buffer that wraps one slot early (at position size - 1) and one that
    rolls the last sink, each wrong at one edge of a regime, passed the hidden cases of some
    seeds when positions were drawn at random inside the regimes; the edges are drawn on every
    seed now."""
    from course_attn.grading.ch11 import rolling_index_reference

    def wraps_early(position, size, sinks=0):
        return sinks if position == size - 1 else rolling_index_reference(position, size, sinks)

    def rolls_the_last_sink(position, size, sinks=0):   # "position < sinks - 1" for a sink
        if position == sinks - 1:
            return sinks + (position - sinks) % (size - sinks)
        return rolling_index_reference(position, size, sinks)

    for wrong in (wraps_early, rolls_the_last_sink):
        assert_fails_on_every_seed("ch11.rolling_index", wrong)
