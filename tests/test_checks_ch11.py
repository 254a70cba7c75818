"""Chapter 11's exercises: each typical mistake fails the case meant for it with its own hint, and a
banned call is reported by name. What every exercise must satisfy (the reference and the
solution pass public and hidden cases, a stub is "not answered yet", every declared mistake
names itself) is tested once, for all chapters, in test_exercises_conformance.py.

The wrong solutions below are written as a student would write them; each test names the case
it must fail and a fragment of the hint it must get.
"""

import math
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import course_attn
from course_attn.grading import get, run_exercise
from course_attn.grading.ch11 import BUDGET_SIZES, MISTRAL_7B
from course_attn.grading.exercise import hidden_cases, load_hidden
from course_attn.model import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from check_support import assert_banned, assert_fails, results  # noqa: E402

load_hidden(Path(__file__).resolve().parents[1] / "solutions")

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


def window_budget():
    L, H_kv, D, W, T = 32, 8, 128, 4096, 16384

    def reach(layers):
        return layers * (W - 1) + 1
    layers = 1
    while reach(layers) < T:
        layers += 1
    return {"reach": reach(L), "layers_to_cover": layers,
            "pairs": sum(min(i + 1, W) for i in range(T)),
            "cache_bytes": 2 * L * H_kv * D * W * 2}


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

    def with_pytorch(tq, tk, w):
        from torch.nn.attention.bias import causal_lower_right
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


def test_the_budget_numbers_follow_from_the_configuration():
    answers = window_budget()
    assert answers == get(BUDGET).reference()
    W, L, T = MISTRAL_7B["window"], MISTRAL_7B["n_layers"], BUDGET_SIZES["T"]
    assert answers["reach"] == 131041 and answers["layers_to_cover"] == 5
    assert answers["pairs"] == W * (W + 1) // 2 + (T - W) * W
    for t, w in ((16, 4), (40, 7), (5, 9)):        # the same sum, counted on the mask itself
        assert int(course_attn.sliding_window_mask(t, t, w).sum()) == \
            sum(min(i + 1, w) for i in range(t))
    assert answers["cache_bytes"] == 512 * 2 ** 20     # 512 MiB; 8 times less than 32768 tokens
    assert L * (W - 1) + 1 < L * W


def test_window_budget_mistakes():
    a, b, c, d = (case.name for case in get(BUDGET).public_cases())
    right = window_budget()

    def answering(**wrong):
        return lambda: {**right, **wrong}
    assert_fails(BUDGET, answering(reach=32 * 4096, layers_to_cover=4), a,
                 hint="W new positions per layer", message="a little too large")
    assert_fails(BUDGET, answering(reach=32 * 4096, layers_to_cover=4), b,
                 hint="W new positions per layer", message="too small")
    assert_fails(BUDGET, answering(reach=32 * 4095), a, hint="left out the position itself")
    assert_fails(BUDGET, answering(reach=4096), a, hint="one layer only")
    assert_fails(BUDGET, answering(pairs=16384 * 4096), c, hint="W keys for every query")
    assert_fails(BUDGET, answering(pairs=16384 * 16385 // 2), c, hint="full causal attention")
    assert_fails(BUDGET, answering(cache_bytes=4 * right["cache_bytes"]), d,
                 hint="query heads", message="4 times")
    assert_fails(BUDGET, answering(cache_bytes=right["cache_bytes"] // 2), d,
                 hint="keys only")
    assert_fails(BUDGET, lambda: [1, 2, 3, 4], a, message="should return a dict")


def test_window_budget_never_shows_the_right_answer():
    right = window_budget()
    for result in run_exercise(get(BUDGET), lambda: {k: 12345 for k in right}).results:
        assert not result.passed
        for value in right.values():
            assert not re.search(rf"\b{value}\b", result.message)
            assert value < 1000 or f"{value:,}" not in result.message


def test_window_budget_may_not_call_the_package():
    def with_the_package():
        course_attn.causal_mask(2)
        return window_budget()
    assert_banned(BUDGET, with_the_package, "course_attn")
