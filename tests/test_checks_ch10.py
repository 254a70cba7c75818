"""Chapter 10's exercises: each typical mistake fails the case meant for it with its own hint, and a
banned call is reported by name; the references are what the package's linear attention computes.
What every exercise must satisfy (the reference and the solution pass public and hidden cases, a
stub is "not answered yet", every declared mistake names itself) is tested once, for all
chapters, in test_exercises_conformance.py.

The wrong solutions below are written as a student would write them; each test names the case
it must fail and a fragment of the hint it must get.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import course_attn
from course_attn.grading import get, run_exercise
from course_attn.grading.ch10 import (COST_QUESTIONS, COST_SIZES, MORE_COST_SIZES,
                                      chunk_case, random_state)
from course_attn.grading.exercise import hidden_cases
from course_attn.kv_cache import KVCache
from course_attn.linear import (elu_features, linear_attention, linear_attention_state,
                                linear_attention_step)

from check_support import assert_banned, assert_fails, results
from helpers import ROOT

ELU, STEP, CHUNK, COSTS = ("ch10.elu_feature_map", "ch10.recurrent_step", "ch10.chunk_step",
                           "ch10.linear_costs")


# --- solutions as in solutions/10_linear_attention.ipynb -----------------------------------------

def elu_feature_map(x, *, plus_one=True):
    """The solution; ``plus_one=False`` is elu alone, the typical mistake."""
    out = torch.where(x > 0, x, torch.exp(torch.clamp(x, max=0)) - 1)
    return out + 1 if plus_one else out


def recurrent_step(fq, fk, v, s, z, *, update_first=True, normalise=True, in_place=False):
    """The solution; the keywords make it one typical mistake or another."""
    s_new = s + fk.unsqueeze(-1) * v.unsqueeze(-2)
    z_new = z + fk
    s_read, z_read = (s_new, z_new) if update_first else (s, z)
    out = (fq.unsqueeze(-2) @ s_read).squeeze(-2)
    if normalise:
        out = out / (fq * z_read).sum(-1, keepdim=True)
    if in_place:
        s.copy_(s_new)
        z.copy_(z_new)
        return out, s, z
    return out, s_new, z_new


def chunk_step(fq, fk, v, s, z, *, causal=True, carry_before=True, normalise=True):
    """The solution; the keywords make it one typical mistake or another."""
    s_new = s + fk.transpose(-2, -1) @ v
    z_new = z + fk.sum(-2)
    s_read, z_read = (s, z) if carry_before else (s_new, z_new)
    weights = fq @ fk.transpose(-2, -1)
    if causal:
        weights = weights.tril()
    num = fq @ s_read + weights @ v
    den = (fq * z_read.unsqueeze(-2)).sum(-1) + weights.sum(-1)
    return (num / den.unsqueeze(-1) if normalise else num), s_new, z_new


def linear_costs(T, D, features, L, H, nbytes, *, crossing="past", tensors=2, per=None,
                 z=True):
    """The solution; the keywords make it one typical mistake or another."""
    x = 2 * features * D // (features + D)
    return {"quadratic_macs": T * T * 2 * D, "linear_macs": 2 * T * D * D,
            "crossover_length": {"past": x + 1, "at": x, "same_widths": D + 1}[crossing],
            "kv_cache_bytes": tensors * L * H * T * D * (per or nbytes),
            "state_bytes": L * H * (D * D + (D if z else 0)) * (per or nbytes)}


@pytest.mark.parametrize("key, fn", [(ELU, elu_feature_map), (STEP, recurrent_step),
                                     (CHUNK, chunk_step), (COSTS, linear_costs)])
def test_the_notebooks_solutions_pass_with_the_watch_on(key, fn):
    for cases in [None] + [hidden_cases(key, seed) or None for seed in range(5)]:
        judgement = run_exercise(get(key), fn, cases)
        assert judgement.passed, (judgement.banned, [(r.name, r.message) for r in
                                                     judgement.results if not r.passed])


# --- elu_feature_map -----------------------------------------------------------------------------

RANGE = "a vector of 7 values from -3 to 3"


def test_the_feature_map_reference_is_elu_plus_one_and_positive():
    x = torch.linspace(-30, 30, 61, dtype=torch.float64)
    out = get(ELU).reference(x)
    torch.testing.assert_close(out, F.elu(x) + 1)
    torch.testing.assert_close(out, elu_feature_map(x))
    assert (out > 0).all()
    assert course_attn.linear.feature_map_fn("elu", 4) is course_attn.linear.elu_features


def test_elu_feature_map_mistakes():
    assert_fails(ELU, lambda x: elu_feature_map(x, plus_one=False), RANGE,
                 hint="left out the + 1")
    assert_fails(ELU, lambda x: x + 1, RANGE, hint="x + 1 everywhere")
    assert_fails(ELU, torch.exp, RANGE, hint="exp(x) everywhere")
    assert_fails(ELU, lambda x: torch.where(x > 0, x, torch.zeros_like(x)), RANGE,
                 hint="you used relu:")
    assert_fails(ELU, lambda x: torch.where(x > 0, x + 1, torch.ones_like(x)), RANGE,
                 hint="relu plus one")
    assert_fails(ELU, lambda x: elu_feature_map(x.float()),
                 "float64", message="has dtype torch.float32")


def test_elu_feature_map_may_not_call_pytorchs_elu_or_the_package():
    assert_banned(ELU, lambda x: F.elu(x) + 1, "torch.nn.functional.elu")
    assert_banned(ELU, lambda x: torch.nn.ELU()(x) + 1, "torch.nn")
    assert_banned(ELU, course_attn.linear.elu_features, "course_attn")


# --- recurrent_step ------------------------------------------------------------------------------

FIRST = "the first token: an empty state (s = 0, z = 0); B=1, H=2, D'=Dv=4"
AFTER = "a token after 5 others; B=1, H=2, D'=Dv=4"


def test_the_step_reference_decodes_like_the_package():
    """Steps from an empty state, token by token, give causal linear attention, and the state
    ``linear_attention_step`` keeps."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, n, generator=g, dtype=torch.float64) for n in (4, 4, 5))
    expected = linear_attention(q, k, v, causal=True, form="quadratic")
    fq, fk = elu_features(q), elu_features(k)
    s, z = torch.zeros(2, 3, 4, 5, dtype=torch.float64), torch.zeros(2, 3, 4, dtype=torch.float64)
    state, outs = None, []
    for t in range(9):
        token = (fq[:, :, t], fk[:, :, t], v[:, :, t])
        mine = recurrent_step(*token, s, z)
        out, s, z = get(STEP).reference(*token, s, z)
        torch.testing.assert_close(mine, (out, s, z))
        step_out, state = linear_attention_step(q[:, :, t:t + 1], k[:, :, t:t + 1],
                                                v[:, :, t:t + 1], state)
        torch.testing.assert_close(out, step_out[:, :, 0])
        outs.append(out)
    torch.testing.assert_close(torch.stack(outs, 2), expected)
    torch.testing.assert_close((s, z), (state.s, state.z))


def test_recurrent_step_mistakes():
    # the state updated after the output: the query misses its own token
    assert_fails(STEP, lambda *a: recurrent_step(*a, update_first=False), AFTER,
                 hint="read the state before the token was added")
    assert_fails(STEP, lambda *a: recurrent_step(*a, update_first=False), FIRST,
                 hint="read the state before the token was added")
    assert_fails(STEP, lambda *a: recurrent_step(*a, normalise=False), AFTER,
                 hint="left out the normaliser")

    def z_forgotten(fq, fk, v, s, z):
        out, s_new, _ = recurrent_step(fq, fk, v, s, z - fk)   # reads z, returns it unchanged
        return out, s_new, z
    assert_fails(STEP, z_forgotten, AFTER, hint="did not add φ(k) to z")
    assert_fails(STEP, lambda fq, fk, v, s, z: (recurrent_step(fq, fk, v, s, z)[0], s, z), AFTER,
                 hint="returned the state you were given")

    def outer_product_transposed(fq, fk, v, s, z):
        s_new = s + v.unsqueeze(-1) * fk.unsqueeze(-2)           # v φ(k)ᵀ: (Dv, D')
        out = (fq.unsqueeze(-2) @ s_new).squeeze(-2) / (fq * (z + fk)).sum(-1, keepdim=True)
        return out, s_new, z + fk
    assert_fails(STEP, outer_product_transposed, AFTER, message="differs from the expected one")


def test_a_step_that_updates_the_state_in_place_is_told_so():
    """The task says to return new tensors: the grader's inputs must stay as they were sent."""
    found = results(STEP, lambda *a: recurrent_step(*a, in_place=True))
    assert not found[AFTER].passed and "in place" in found[AFTER].message


def test_recurrent_step_may_not_call_the_package():
    def with_the_package(fq, fk, v, s, z):
        state = course_attn.linear.LinearAttentionState(s, z).add(fk, v)
        return state.read(fq), state.s, state.z
    assert_banned(STEP, with_the_package, "course_attn")


# --- chunk_step ----------------------------------------------------------------------------------

CHUNK_FIRST = "the first chunk: an empty carry; C=4, B=1, H=2, D'=Dv=4"
CHUNK_AFTER = "a chunk of 4 after 8 tokens; B=1, H=2, D'=Dv=4"
ONE = "a chunk of one token after 6"


def test_chunk_steps_in_a_row_are_the_packages_chunked_form():
    """Chunks of 4 over 13 tokens, each from the carry the one before left, give
    ``linear_attention(..., form="chunked")``; the reference does too."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 13, n, generator=g, dtype=torch.float64) for n in (3, 3, 2))
    expected = linear_attention(q, k, v, causal=True, form="chunked", chunk_size=4)
    fq, fk = elu_features(q), elu_features(k)
    for fn in (chunk_step, get(CHUNK).reference):
        s, z = torch.zeros(1, 2, 3, 2, dtype=torch.float64), torch.zeros(1, 2, 3,
                                                                          dtype=torch.float64)
        outs = []
        for start in range(0, 13, 4):
            chunk = slice(start, start + 4)
            out, s, z = fn(fq[:, :, chunk], fk[:, :, chunk], v[:, :, chunk], s, z)
            outs.append(out)
        torch.testing.assert_close(torch.cat(outs, dim=2), expected)
        torch.testing.assert_close(s, fk.transpose(-2, -1) @ v)


def test_the_case_states_are_those_of_random_tokens():
    s, z = random_state(1, 2, 4, 3, 0, seed=0)
    assert not s.any() and not z.any() and s.shape == (1, 2, 4, 3) and z.shape == (1, 2, 4)
    case = chunk_case("x", 1, 1, 2, 3, 3, 5, seed=0)
    assert all((t > 0).all() for t in (case.args[0], case.args[1], case.args[4]))


def test_chunk_step_mistakes():
    # a chunk that leaks its own future: no causal mask inside the chunk
    assert_fails(CHUNK, lambda *a: chunk_step(*a, causal=False), CHUNK_FIRST,
                 hint="leaks its own future")
    assert_fails(CHUNK, lambda *a: chunk_step(*a, causal=False), CHUNK_AFTER,
                 hint="leaks its own future")
    # the carry including the current chunk
    assert_fails(CHUNK, lambda *a: chunk_step(*a, carry_before=False), CHUNK_AFTER,
                 hint="carry already holds the current chunk")
    assert_fails(CHUNK, lambda *a: chunk_step(*a, normalise=False), CHUNK_AFTER,
                 hint="left out the normaliser")

    def strict_mask(fq, fk, v, s, z):
        weights = (fq @ fk.transpose(-2, -1)).tril(-1)
        num = fq @ s + weights @ v
        den = (fq * z.unsqueeze(-2)).sum(-1) + weights.sum(-1)
        return num / den.unsqueeze(-1), s + fk.transpose(-2, -1) @ v, z + fk.sum(-2)
    assert_fails(CHUNK, strict_mask, CHUNK_AFTER, hint="drops the diagonal")

    def carry_not_in_denominator(fq, fk, v, s, z):
        weights = (fq @ fk.transpose(-2, -1)).tril()
        num = fq @ s + weights @ v
        return num / weights.sum(-1, keepdim=True), s + fk.transpose(-2, -1) @ v, z + fk.sum(-2)
    assert_fails(CHUNK, carry_not_in_denominator, CHUNK_AFTER, hint="leaves out the carry")
    assert_fails(CHUNK, lambda fq, fk, v, s, z: (chunk_step(fq, fk, v, s, z)[0], s, z),
                 CHUNK_AFTER, hint="returned the carry you were given")


def test_a_chunk_of_one_token_has_no_future_to_leak():
    found = results(CHUNK, lambda *a: chunk_step(*a, causal=False))
    assert found[ONE].passed and not found[CHUNK_AFTER].passed


def test_chunk_step_may_not_call_the_package_or_sdpa():
    def with_the_package(fq, fk, v, s, z):
        state, outs = course_attn.linear.LinearAttentionState(s, z), []
        for i in range(fq.shape[2]):
            state = state.add(fk[:, :, i], v[:, :, i])
            outs.append(state.read(fq[:, :, i]))
        return torch.stack(outs, 2), state.s, state.z
    assert_banned(CHUNK, with_the_package, "course_attn")

    def with_sdpa(fq, fk, v, s, z):
        out, s_new, z_new = chunk_step(fq, fk, v, s, z)
        F.scaled_dot_product_attention(fq, fk, v)
        return out, s_new, z_new
    assert_banned(CHUNK, with_sdpa, "torch.nn.functional.scaled_dot_product_attention")


# --- linear_costs --------------------------------------------------------------------------------

def costs_sizes(seeds=range(10)):
    """The public sets of sizes and the hidden ones drawn with ``seeds``, each once."""
    sizes = [COST_SIZES, MORE_COST_SIZES]
    for seed in seeds:
        for case in hidden_cases(COSTS, seed):
            if dict(case.kwargs) not in sizes:
                sizes.append(dict(case.kwargs))
    return sizes


def macs(order, t, d_feat, dv):
    """Multiply-adds of one order of the product, counted by FlopCounterMode (2 FLOPs each) on
    meta tensors: nothing is computed, whatever the sizes."""
    fq, fk = torch.empty(t, d_feat, device="meta"), torch.empty(t, d_feat, device="meta")
    v = torch.empty(t, dv, device="meta")
    with FlopCounterMode(display=False) as flops:
        (fq @ fk.T) @ v if order == "quadratic" else fq @ (fk.T @ v)
    return flops.get_total_flops() // 2


def test_the_costs_are_what_flop_counter_mode_and_the_package_count_on_public_and_hidden_sizes():
    """(a) and (b) counted by FlopCounterMode; (c) the first T where FlopCounterMode counts
    fewer for the linear order; (d) the bytes of the package's KVCache and (e) the numbers of
    its linear attention state times nbytes, for one layer, times L."""
    sizes = costs_sizes()
    assert len(sizes) == 2 + 3 * 10
    for size in sizes:
        T, D, F, L, H, nbytes = (size[k] for k in ("T", "D", "features", "L", "H", "nbytes"))
        right = get(COSTS).reference(**size)
        assert right["quadratic_macs"] == macs("quadratic", T, D, D)
        assert right["linear_macs"] == macs("linear", T, D, D)
        c = right["crossover_length"]
        assert macs("linear", c, F, D) < macs("quadratic", c, F, D)
        assert c == 1 or macs("linear", c - 1, F, D) >= macs("quadratic", c - 1, F, D)
        dtype = {2: torch.bfloat16, 4: torch.float32}[nbytes]
        cache = KVCache(1, H, T, D, dtype=dtype, device="meta")
        assert right["kv_cache_bytes"] == L * cache.nbytes
        k = torch.empty(1, H, 3, D, device="meta")
        state = linear_attention_state(k, k)             # kept in float32: count its numbers
        assert right["state_bytes"] == L * (state.s.numel() + state.z.numel()) * nbytes
        assert right == linear_costs(**size)
    answers = get(COSTS).reference(**COST_SIZES)
    assert answers["crossover_length"] == 171
    assert answers["kv_cache_bytes"] == 2 * 2 ** 30                 # 2 GiB at 4096 tokens


def test_linear_costs_hidden_sizes_cover_their_regimes():
    for seed in range(20):
        wide, tie, narrow = costs_sizes([seed])[2:]
        assert wide["features"] >= wide["D"] + 3 and wide["T"] > wide["D"]
        assert tie["features"] == 3 * tie["D"] and tie["D"] % 2 == 0 and tie["T"] <= tie["D"]
        assert narrow["features"] < narrow["D"]
        assert all(s["nbytes"] in (2, 4) and s["T"] >= 2 for s in (wide, tie, narrow))


def test_linear_costs_mistakes():
    cases = [case.name for case in get(COSTS).public_cases()]
    a, b, c, d, e, a2, b2, c2, d2, e2 = cases
    T, D = COST_SIZES["T"], COST_SIZES["D"]

    def answering(**wrong):
        return lambda **size: {**linear_costs(**size), **wrong} if size == COST_SIZES \
            else linear_costs(**size)

    def with_(**mistake):
        return lambda **size: linear_costs(**size, **mistake)
    assert_fails(COSTS, answering(quadratic_macs=T * T * D), a, hint="only the scores")
    assert_fails(COSTS, answering(linear_macs=T * D * D), b, hint="only φ(K)ᵀ V")
    assert_fails(COSTS, with_(crossing="same_widths"), c, hint="D' = Dv")
    assert_fails(COSTS, with_(crossing="same_widths"), c2, hint="D' = Dv")
    assert_fails(COSTS, with_(crossing="at"), c, hint="crossing itself")
    assert_fails(COSTS, with_(crossing="at"), c2, hint="crossing itself")      # a tie at 96
    assert_fails(COSTS, with_(tensors=1), d, hint="keys only")
    assert_fails(COSTS, with_(per=1), d2, hint="numbers, not bytes", message="too small")
    assert_fails(COSTS, with_(per=1), e, hint="numbers, not bytes")
    assert_fails(COSTS, with_(z=False), e, hint="left out z")
    assert_fails(COSTS, answering(state_bytes=linear_costs(**COST_SIZES)["state_bytes"] * T), e,
                 hint="grows with the length", message="too large")
    assert_fails(COSTS, lambda **size: [1, 2, 3, 4, 5], a, message="should return a dict")


def test_linear_costs_never_shows_the_right_answer():
    for result in run_exercise(get(COSTS), lambda **size: dict.fromkeys(COST_QUESTIONS,
                                                                         12345)).results:
        assert not result.passed
        assert result.message.endswith("too large") or result.message.endswith("too small")
        assert "times" not in result.message
        for size in (COST_SIZES, MORE_COST_SIZES):
            for value in linear_costs(**size).values():
                if value > 1000:
                    assert str(value) not in result.message + result.hint
                    assert f"{value:,}" not in result.message


def test_linear_costs_pasted_as_constants_fails_the_hidden_cases_of_every_seed():
    pasted = {str(size): linear_costs(**size) for size in (COST_SIZES, MORE_COST_SIZES)}

    def linear_costs_pasted(**size):             # the public answers, typed in
        return pasted.get(str(size), pasted[str(COST_SIZES)])
    assert run_exercise(get(COSTS), linear_costs_pasted).passed
    for seed in range(20):
        judgement = run_exercise(get(COSTS), linear_costs_pasted, hidden_cases(COSTS, seed))
        assert not judgement.passed, seed
        assert sum(not r.passed for r in judgement.results) >= 12, seed


def test_linear_costs_may_not_call_the_package():
    def with_the_package(**size):
        course_attn.causal_mask(2)
        return linear_costs(**size)
    assert_banned(COSTS, with_the_package, "course_attn")


# --- linear_costs, judged part by part -------------------------------------------------------------

def test_linear_costs_with_three_parts_right_is_judged_part_by_part():
    """Two wrong parts, each by its own mistake: the three right parts pass, and each wrong part
    is told its own mistake's hint (mistakes are matched on the part a case judges)."""
    # (with nbytes = 2, "keys only" and "numbers, not bytes" give the same (d): the state's
    # mistake must differ from both, or the whole answer would be the second one's)
    no_z = next(m.fn for m in get(COSTS).mistakes if "left out z" in m.hint)

    def two_wrong(**size):
        right = linear_costs(**size)
        return {**right, "kv_cache_bytes": right["kv_cache_bytes"] // 2,         # keys only
                "state_bytes": no_z(**size)["state_bytes"]}                     # no z
    found = results(COSTS, two_wrong)
    cases = [case for case in get(COSTS).public_cases()]
    for case in cases:
        result = found[case.name]
        if case.part in ("kv_cache_bytes", "state_bytes"):
            assert not result.passed, case.name
            wanted = "keys only" if case.part == "kv_cache_bytes" else "left out z"
            assert wanted in result.hint, (case.name, result.hint)
        else:
            assert result.passed, case.name


# --- causal_linear_attention (debug) ---------------------------------------------------------------

CLA = "ch10.causal_linear_attention"


def causal_linear_attention(fq, fk, v, *, z_axis=-2, z_rule="inclusive", s_rule="inclusive"):
    """The repaired function of the notebook; the keywords make it the given bug or a
    half-repair."""
    outer = fk.unsqueeze(-1) * v.unsqueeze(-2)
    memory = outer.cumsum(dim=-3)
    if s_rule == "exclusive":
        memory = memory - outer
    norm = fk.cumsum(dim=z_axis)
    if z_rule == "exclusive":
        norm = norm - fk
    elif z_rule == "total":
        norm = fk.sum(dim=-2, keepdim=True)
    elif z_rule == "own":
        norm = fk
    num = (fq.unsqueeze(-2) @ memory).squeeze(-2)
    if z_rule == "none":
        return num
    return num / (fq * norm).sum(dim=-1, keepdim=True)


SHORT, ONES = "B=1, H=2, T=6, D'=Dv=4", \
    "constant values (every value 1): every output must be 1; T=8, D'=5, Dv=3"


def test_the_given_function_fails_with_the_bugs_hint():
    from course_attn.grading.ch10 import given_causal_linear_attention
    assert_fails(CLA, given_causal_linear_attention, ONES, hint="wrong axis")
    assert_fails(CLA, given_causal_linear_attention, SHORT, hint="wrong axis")


def test_the_given_function_is_the_notebooks():
    import nbformat
    for folder in ("solutions", "exercises"):
        nb = nbformat.read(ROOT / folder / "10_linear_attention.ipynb", as_version=4)
        given = [c for c in nb.cells
                 if c.metadata.get("nbgrader", {}).get("grade_id") == f"ch10-{CLA[5:]}-given"]
        assert len(given) == 1 and given[0].metadata["nbgrader"]["locked"]
        namespace = {"torch": torch, "math": __import__("math")}
        exec(given[0].source, namespace)
        assert_fails(CLA, namespace["given_causal_linear_attention"], ONES, hint="wrong axis")


def test_causal_linear_attention_half_repairs_are_named():
    assert run_exercise(get(CLA), causal_linear_attention).passed
    assert_fails(CLA, lambda *a: causal_linear_attention(*a, z_rule="exclusive"), SHORT,
                 hint="leaves out the token itself")
    assert_fails(CLA, lambda *a: causal_linear_attention(*a, z_rule="exclusive",
                                                         s_rule="exclusive"),
                 SHORT, hint="does not see its own key")
    assert_fails(CLA, lambda *a: causal_linear_attention(*a, z_rule="total"), SHORT,
                 hint="keys of the future")
    assert_fails(CLA, lambda *a: causal_linear_attention(*a, z_rule="own"), SHORT,
                 hint="own key only")
    assert_fails(CLA, lambda *a: causal_linear_attention(*a, z_rule="none"), ONES,
                 hint="left out the normaliser")


def test_causal_linear_attention_equals_the_packages_causal_form():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 17, n, generator=g, dtype=torch.float64) for n in (5, 5, 4))
    torch.testing.assert_close(get(CLA).reference(elu_features(q), elu_features(k), v),
                               linear_attention(q, k, v, causal=True))


def test_causal_linear_attention_may_not_call_the_package():
    def with_the_package(fq, fk, v):
        course_attn.causal_mask(2)
        return causal_linear_attention(fq, fk, v)
    assert_banned(CLA, with_the_package, "course_attn")


# --- recall_accuracy (measure) ---------------------------------------------------------------------

RECALL = "ch10.recall_accuracy"
CROWDED, ROOMY, ELU_KEYS = ("unit keys, crowded: N=32 pairs in D'=8 features, seed 0",
                            "unit keys, room to spare: N=8 pairs in D'=64 features, seed 1",
                            "elu features: N=32 pairs in D'=64 features, seed 2")


def recall_accuracy(n_pairs, features, kind, seed, *, normalise=True, feature_map=True,
                    memories=256, loop=False):
    """The notebook's solution; the keywords make it a typical mistake, or another honest
    run (``memories``, a loop over them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(memories, n_pairs, features, generator=g, dtype=torch.float64)
    if kind == "unit":
        keys = F.normalize(x, dim=-1) if normalise else x
    else:
        keys = F.elu(x) + 1 if feature_map else x
    values = torch.randint(64, (memories, n_pairs), generator=g)
    onehot = F.one_hot(values, 64).to(keys.dtype)
    if loop:
        hits = sum(int(((k @ (k.T @ o)).argmax(-1) == val).sum())
                   for k, o, val in zip(keys, onehot, values))
        return hits / (memories * n_pairs)
    read = keys @ (keys.transpose(-2, -1) @ onehot)
    return (read.argmax(-1) == values).double().mean().item()


def test_recall_accuracy_solution_and_its_mistakes():
    assert run_exercise(get(RECALL), recall_accuracy).passed
    assert_fails(RECALL, lambda *a: recall_accuracy(*a, normalise=False), CROWDED,
                 hint="not unit vectors", message="too small")
    assert_fails(RECALL, lambda *a: recall_accuracy(*a, feature_map=False), ELU_KEYS,
                 hint="normal vectors themselves", message="too large")
    assert_fails(RECALL, lambda *a: 1 - recall_accuracy(*a), ROOMY, hint="NOT recalled")
    assert_fails(RECALL, lambda *a: 100 * recall_accuracy(*a), CROWDED, hint="percentage")


def test_recall_accuracy_accepts_another_honest_run_of_the_experiment():
    """Other draws (another seed, and a loop over the memories instead of batched products) land
    within the grader's tolerance, on public cases and hidden ones."""
    def other_draws(n_pairs, features, kind, seed):
        return recall_accuracy(n_pairs, features, kind, seed + 1_000_003, loop=True)
    assert run_exercise(get(RECALL), other_draws).passed
    for seed in range(5):
        assert run_exercise(get(RECALL), other_draws, hidden_cases(RECALL, seed)).passed


def test_recall_accuracy_reference_is_stable_and_shows_the_prediction():
    """The measurement is the same on every call (seeded), fast, and says what the notebook asks
    to predict: unit keys rise toward 1 as D' grows, elu features stay far below 1."""
    import time
    reference = get(RECALL).reference
    start = time.perf_counter()
    unit = [reference(32, d, "unit", 0) for d in (8, 32, 128, 256)]
    elu = [reference(32, d, "elu", 0) for d in (8, 32, 128, 256)]
    assert time.perf_counter() - start < 8           # 8 experiments, each well under a second
    assert unit == [reference(32, d, "unit", 0) for d in (8, 32, 128, 256)]
    assert unit == sorted(unit) and unit[0] < 0.9 and unit[-1] > 0.99
    assert max(elu) < 0.4
    # the tolerance separates two honest runs from a mistake: it is tighter than the gap
    from course_attn.grading.ch10 import recall_stats
    for seed in range(10):
        for case in hidden_cases(RECALL, seed):
            acc, tol = recall_stats(*case.args)
            assert 0 < tol < 0.2, (case.name, tol)


def test_recall_accuracy_is_a_fraction_not_a_string():
    assert_fails(RECALL, lambda *a: "0.8", CROWDED, message="should be a number")


def test_recall_accuracy_may_not_call_the_package():
    def with_the_package(*args):
        course_attn.causal_mask(2)
        return recall_accuracy(*args)
    assert_banned(RECALL, with_the_package, "course_attn")


# --- recall_predictions (predict) ------------------------------------------------------------------

TRENDS_KEY = "ch10.recall_predictions"


def recall_predictions(n_pairs, few, many, *, unit_rule=None, elu="stays far below 1"):
    """The notebook's solution; ``unit_rule`` and ``elu`` make it a typical mistake."""
    unit = "stays near 1" if few >= 2 * n_pairs else "rises toward 1"
    return {"unit": unit_rule or unit, "elu": elu}


def test_recall_predictions_solution_passes_public_and_hidden_cases():
    for cases in [None] + [hidden_cases(TRENDS_KEY, seed) for seed in range(10)]:
        assert run_exercise(get(TRENDS_KEY), recall_predictions, cases).passed


def test_recall_predictions_mistakes_are_named_part_by_part():
    crowded = "(a) random unit keys: the accuracy as D' grows from `few` to `many` " \
              "(n_pairs=32, few=8, many=256)"
    roomy = "(a) random unit keys: the accuracy as D' grows from `few` to `many` " \
            "(n_pairs=16, few=40, many=128)"
    elu = "(b) elu features: the accuracy as D' grows from `few` to `many` " \
          "(n_pairs=32, few=8, many=256)"
    assert_fails(TRENDS_KEY, lambda **a: recall_predictions(**a, unit_rule="stays far below 1"),
                 crowded, hint="more features always help")
    assert_fails(TRENDS_KEY, lambda **a: recall_predictions(**a, unit_rule="rises toward 1"),
                 roomy, hint="nearly orthogonal from the start")
    assert_fails(TRENDS_KEY, lambda **a: recall_predictions(**a, unit_rule="stays near 1"),
                 crowded, hint="cannot be nearly orthogonal")
    assert_fails(TRENDS_KEY, lambda **a: recall_predictions(**a, elu="rises toward 1"), elu,
                 hint="not random unit keys")
    assert_fails(TRENDS_KEY, lambda **a: recall_predictions(**a, elu="falls"), elu,
                 hint="never add crosstalk")
    # a wrong unit part leaves the elu part right, and the other way round
    found = results(TRENDS_KEY, lambda **a: recall_predictions(**a, elu="rises toward 1"))
    assert all(r.passed for name, r in found.items() if name.startswith("(a)"))
    assert_fails(TRENDS_KEY, lambda **a: {"unit": "up", "elu": "stays far below 1"}, crowded,
                 message="not one of the options")


def test_recall_predictions_is_what_the_measurement_shows():
    """The reference reads the trend off recall_accuracy's own measurements: the unit keys'
    accuracy is below 0.9 at few <= N/4 and near 1 from 2N, elu features stay below 0.5."""
    measure = get(RECALL).reference
    for seed in range(3):
        for case in hidden_cases(TRENDS_KEY, seed):
            n, few, many = (case.kwargs[k] for k in ("n_pairs", "few", "many"))
            if case.part == "unit":
                ends = measure(n, few, "unit", 0), measure(n, many, "unit", 0)
                assert ends[1] >= 0.98 and (ends[0] >= 0.98 if few >= 2 * n else ends[0] < 0.9)
            else:
                assert max(measure(n, few, "elu", 0), measure(n, many, "elu", 0)) < 0.5


def test_recall_predictions_may_not_run_tensors():
    def by_experiment(n_pairs, few, many):
        recall_accuracy(n_pairs, few, "unit", 0)
        return recall_predictions(n_pairs, few, many)
    judgement = run_exercise(get(TRENDS_KEY), by_experiment)
    assert judgement.banned and not judgement.passed
