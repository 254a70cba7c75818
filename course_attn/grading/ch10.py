"""Exercises of Chapter 10, linear attention.

    ch10.elu_feature_map  elu_feature_map(x) -> (..., D): elu(x) + 1, the feature map of
                          Katharopoulos et al. (x + 1 where x > 0, exp(x) elsewhere)
    ch10.recurrent_step   recurrent_step(fq, fk, v, s, z) -> (out, s, z): one token of causal
                          linear attention as an RNN: the token's key and value are added to
                          the state (s += φ(k) vᵀ, z += φ(k)), then its query reads the state,
                          out = φ(q)ᵀ s / φ(q)ᵀ z
    ch10.chunk_step       chunk_step(fq, fk, v, s, z) -> (out, s, z): one chunk of the chunked
                          form: the carry (s, z) of the chunks before, plus the causal
                          (masked) products inside the chunk; then the carry after it
    ch10.linear_costs     linear_costs(T, D, features, L, H, nbytes) -> dict: multiply-adds of
                          the two orders of the product, the length where they cross, and the
                          bytes of a KV cache against the state of linear attention (derive,
                          on sizes drawn at grading time)
    ch10.causal_linear_attention  causal_linear_attention(fq, fk, v) -> (B, H, T, Dv): the
                          repaired prefix-sum form of causal linear attention (debug: the
                          notebook gives it with its normaliser summed along the wrong axis)
    ch10.recall_accuracy  recall_accuracy(n_pairs, features, kind, seed) -> float: the fraction
                          of N pairs a state of D' = features recalls, for random unit keys or
                          elu features (measure, on sizes and seeds drawn at grading time)

Tasks: elu_feature_map and recurrent_step are warm-ups (the chapter shows them); chunk_step
implements what it sets up; linear_costs derives; causal_linear_attention debugs;
recall_accuracy measures.

References: ``course_attn.linear.elu_features``; ``course_attn.linear.LinearAttentionState``
(``add`` then ``read``), token by token, for both steps; the counts from T²(D' + Dv) and
2·T·D'·Dv, and the sizes 2·L·H·T·D·nbytes and L·H·(D'·Dv + D')·nbytes.
"""

import math

import torch

from ..linear import EPS, LinearAttentionState, elu_features
from .cases import (Questions, answers_changed, as_number, count_questions, expect_tensor,
                    expect_tensors, randn)
from .exercise import Case, Exercise, Mistake, register
from .operations import ELEMENTARY, ELU, NONE, NO_LIBRARY_ATTENTION, SOFTMAX

NO_LIBRARY_ELU = ("course_attn", "torch.nn.functional.elu", "torch.nn.functional.elu_",
                  "torch.nn.functional.celu", "torch.nn.ELU.forward", "torch.nn.CELU.forward")


# --- ch10.elu_feature_map ------------------------------------------------------------------------

def elu_feature_map_reference(x):
    """elu(x) + 1, (..., D) -> (..., D)."""
    return elu_features(x)


def _elu_cases():
    yield Case("a vector of 7 values from -3 to 3",
               (torch.linspace(-3.0, 3.0, 7),),
               hint="elu(x) + 1 is x + 1 for x > 0 and exp(x) for x <= 0")
    yield Case("q of shape (2, 3, 5, 4)", (randn(2, 3, 5, 4, seed=1000),),
               hint="apply the map to every coordinate; the shape stays")
    yield Case("large negative values: every feature must stay positive",
               (randn(3, 6, seed=1001, scale=8.0) - 10.0,),
               hint="for x <= 0 the feature is exp(x): small, but above 0")
    yield Case("large positive values", (randn(4, 5, seed=1002, scale=3.0).abs() + 20.0,),
               hint="for x > 0 the feature is x + 1, never exp(x)")
    yield Case("float64", (randn(2, 4, 3, seed=1003, dtype=torch.float64, scale=2.0),),
               hint="do not convert the input; let its dtype flow through")


register(Exercise(
    key="ch10.elu_feature_map", function="elu_feature_map", reference=elu_feature_map_reference,
    task="warm-up",  # the chapter writes it with F.elu; here without, a first step
    ops=ELEMENTARY - ELU,
    cases=_elu_cases, compare=expect_tensor, banned=NO_LIBRARY_ELU,
    mistakes=(
        Mistake("you left out the + 1: elu(x) alone is negative for x < 0, and a feature map "
                "must give non-negative features, or the weights can cancel and the "
                "denominator reach 0",
                lambda x: torch.where(x > 0, x, torch.expm1(x))),
        Mistake("your features are x + 1 everywhere: for x <= 0 they must be exp(x), which stays "
                "positive", lambda x: x + 1),
        Mistake("your features are exp(x) everywhere: for x > 0 they must grow like x + 1, not "
                "exponentially", lambda x: torch.exp(x)),
        Mistake("you used relu: max(x, 0) is another feature map, zero for every x <= 0; this "
                "one is elu(x) + 1", lambda x: torch.relu(x)),
        Mistake("you used relu plus one: for x <= 0 the feature is exp(x), not 1",
                lambda x: torch.relu(x) + 1),
    ),
))


# --- ch10.recurrent_step -------------------------------------------------------------------------

def recurrent_step_reference(fq, fk, v, s, z):
    """Features fq, fk (B, H, D'), value v (B, H, Dv), state s (B, H, D', Dv) and z (B, H, D')
    -> (out (B, H, Dv), s after, z after): the token is added, then its query reads."""
    state = LinearAttentionState(s, z).add(fk, v)
    return state.read(fq, EPS), state.s, state.z


def random_state(b, h, d, dv, tokens, seed, dtype=torch.float32):
    """The state (s, z) after ``tokens`` random tokens with elu features."""
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    fk = elu_features(randn(b, h, tokens, d, seed=g, dtype=dtype))
    v = randn(b, h, tokens, dv, seed=g, dtype=dtype)
    return fk.transpose(-2, -1) @ v, fk.sum(-2)


def step_case(name, b, h, d, dv, tokens, seed, hint="", dtype=torch.float32):
    """A token (features of q and k, a value) after a state of ``tokens`` earlier tokens."""
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    s, z = random_state(b, h, d, dv, tokens, g, dtype)
    fq, fk = (elu_features(randn(b, h, d, seed=g, dtype=dtype)) for _ in range(2))
    v = randn(b, h, dv, seed=g, dtype=dtype)
    return Case(name, (fq, fk, v, s, z), hint=hint)


def _step_cases():
    yield step_case("the first token: an empty state (s = 0, z = 0); B=1, H=2, D'=Dv=4",
                    1, 2, 4, 4, 0, 1010, "the first token's query sees its own key: the state it "
                                         "reads already holds that token")
    yield step_case("a token after 5 others; B=1, H=2, D'=Dv=4", 1, 2, 4, 4, 5, 1011,
                    "add the token's key and value to the state, then read it with the query")
    yield step_case("D'=6, Dv=3, after 9 tokens; B=2, H=3", 2, 3, 6, 3, 9, 1012,
                    "s is (D', Dv): the outer product of φ(k) (D') with v (Dv)")
    yield step_case("a long history: after 200 tokens", 1, 1, 5, 5, 200, 1013,
                    "the output is a weighted mean of the values: divide by φ(q)ᵀ z")
    yield step_case("float64, after 3 tokens", 1, 2, 4, 2, 3, 1014,
                    "do not convert the inputs; let their dtype flow through",
                    dtype=torch.float64)


def _step_wrong(*, read_first=False, normalise=True, update_z=True, new_state=True):
    """recurrent_step with one mistake, as a student writes it: ``read_first`` reads the state
    before adding the token; ``normalise=False`` leaves out the division by φ(q)ᵀz;
    ``update_z=False`` never adds φ(k) to z; ``new_state=False`` returns the state it got."""
    def step(fq, fk, v, s, z):
        s_new = s + fk.unsqueeze(-1) * v.unsqueeze(-2)
        z_new = z + fk if update_z else z
        s_read, z_read = (s, z) if read_first else (s_new, z_new)
        out = (fq.unsqueeze(-2) @ s_read).squeeze(-2)
        if normalise:
            out = out / (fq * z_read).sum(-1, keepdim=True)
        return (out, s_new, z_new) if new_state else (out, s, z)
    return step


register(Exercise(
    key="ch10.recurrent_step", function="recurrent_step", reference=recurrent_step_reference,
    task="warm-up",  # the body of the chapter's causal_recurrent loop, as one step
    ops=ELEMENTARY | SOFTMAX,
    cases=_step_cases, compare=expect_tensors(("out", "s", "z")), banned=NO_LIBRARY_ATTENTION,
    mistakes=(
        Mistake("your query read the state before the token was added: in causal attention a "
                "token attends to itself (j <= i), so update s and z first, then read",
                _step_wrong(read_first=True)),
        Mistake("you left out the normaliser: divide φ(q)ᵀ s by φ(q)ᵀ z, the sum of the "
                "weights, or the output is a sum that grows with the length",
                _step_wrong(normalise=False)),
        Mistake("you did not add φ(k) to z: the normaliser must sum the weights of every token "
                "in s, this one's included", _step_wrong(update_z=False)),
        Mistake("you returned the state you were given: return s and z after adding the token, "
                "for the next step to read", _step_wrong(new_state=False)),
    ),
))


# --- ch10.chunk_step -----------------------------------------------------------------------------

def chunk_step_reference(fq, fk, v, s, z):
    """Features fq, fk (B, H, C, D'), values v (B, H, C, Dv), carry s (B, H, D', Dv) and z
    (B, H, D') -> (out (B, H, C, Dv), s after the chunk, z after it). Computed token by token
    with ``LinearAttentionState``: an independent route to the chunked form's answer."""
    state, outs = LinearAttentionState(s, z), []
    for i in range(fq.shape[2]):
        state = state.add(fk[:, :, i], v[:, :, i])
        outs.append(state.read(fq[:, :, i], EPS))
    return torch.stack(outs, dim=2), state.s, state.z


def chunk_case(name, b, h, c, d, dv, tokens, seed, hint="", dtype=torch.float32):
    """A chunk of ``c`` tokens after a carry of ``tokens`` earlier tokens."""
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    s, z = random_state(b, h, d, dv, tokens, g, dtype)
    fq, fk = (elu_features(randn(b, h, c, d, seed=g, dtype=dtype)) for _ in range(2))
    v = randn(b, h, c, dv, seed=g, dtype=dtype)
    return Case(name, (fq, fk, v, s, z), hint=hint)


def _chunk_cases():
    yield chunk_case("the first chunk: an empty carry; C=4, B=1, H=2, D'=Dv=4", 1, 2, 4, 4, 4,
                     0, 1020, "with nothing before it, a chunk is causal linear attention over "
                              "its own C tokens")
    yield chunk_case("a chunk of 4 after 8 tokens; B=1, H=2, D'=Dv=4", 1, 2, 4, 4, 4, 8, 1021,
                     "query i of the chunk reads the carry and the chunk's keys 0 .. i")
    yield chunk_case("a chunk of one token after 6", 2, 1, 1, 3, 3, 6, 1022,
                     "a chunk of one token is one step of the recurrent form")
    yield chunk_case("C=5, D'=6, Dv=3, after 10 tokens; B=2, H=3", 2, 3, 5, 6, 3, 10, 1023,
                     "the carry s is (D', Dv); the chunk adds φ(K)ᵀ V, a (D', Dv) product")
    yield chunk_case("float64, a chunk of 3 after 4", 1, 2, 3, 4, 4, 4, 1024,
                     "do not convert the inputs; let their dtype flow through",
                     dtype=torch.float64)


def _chunk_wrong(*, diagonal=0, masked=True, carry="before", normalise=True, carry_den=True,
                 new_carry=True):
    """chunk_step with one mistake, as a student writes it: the causal mask inside the chunk
    keeps ``tril(diagonal)`` (-1 drops the query's own key), or none (``masked=False``);
    ``carry="after"`` reads a carry that already holds this chunk; ``normalise=False`` leaves
    out the division; ``carry_den=False`` forgets the carry in the denominator;
    ``new_carry=False`` returns the carry it got."""
    def step(fq, fk, v, s, z):
        s_new = s + fk.transpose(-2, -1) @ v
        z_new = z + fk.sum(-2)
        s_read, z_read = (s, z) if carry == "before" else (s_new, z_new)
        weights = fq @ fk.transpose(-2, -1)                       # (B, H, C, C)
        if masked:
            weights = weights.tril(diagonal)
        num = fq @ s_read + weights @ v
        den = weights.sum(-1)
        if carry_den:
            den = den + (fq * z_read.unsqueeze(-2)).sum(-1)
        out = num / den.unsqueeze(-1) if normalise else num
        return (out, s_new, z_new) if new_carry else (out, s, z)
    return step


register(Exercise(
    key="ch10.chunk_step", function="chunk_step", reference=chunk_step_reference,
    task="implement",  # one chunk from a carry: the chapter computes every chunk at once
    ops=ELEMENTARY | SOFTMAX,
    cases=_chunk_cases, compare=expect_tensors(("out", "s", "z")), banned=NO_LIBRARY_ATTENTION,
    mistakes=(
        Mistake("your chunk leaks its own future: inside the chunk, query i may only see keys "
                "0 .. i; mask the chunk's C×C weights to the lower triangle",
                _chunk_wrong(masked=False)),
        Mistake("your carry already holds the current chunk: the queries must read the state of "
                "the chunks BEFORE this one, and the chunk's own keys only through the masked "
                "product", _chunk_wrong(carry="after")),
        Mistake("your mask inside the chunk drops the diagonal: a query sees its own key "
                "(j <= i, not j < i)", _chunk_wrong(diagonal=-1)),
        Mistake("you left out the normaliser: divide by φ(q)ᵀ z plus the sum of the chunk's "
                "weights, or the output grows with the length", _chunk_wrong(normalise=False)),
        Mistake("your denominator leaves out the carry: it must sum the weights of every key the "
                "numerator used, φ(q)ᵀ z for the chunks before included",
                _chunk_wrong(carry_den=False)),
        Mistake("you returned the carry you were given: return it after adding this chunk, "
                "φ(K)ᵀ V to s and the sum of φ(K) to z", _chunk_wrong(new_carry=False)),
    ),
))


# --- ch10.linear_costs: the two orders of the product, and the memory of decoding ---------------

# The chapter's sizes: Llama 2 7B (Touvron et al. 2023, the released configuration), 32 layers,
# 32 heads of dimension 128 (no grouped-query attention), a context of 4096 tokens, bf16, and
# 256 Performer features. Inputs, not measurements. Then sizes where the two orders cross
# exactly on a whole number (2·192·64 / (192 + 64) = 96), so that every typical mistake below
# gives a wrong answer on some case.
COST_SIZES = dict(T=4096, D=128, features=256, L=32, H=32, nbytes=2)
MORE_COST_SIZES = dict(T=1000, D=64, features=192, L=24, H=16, nbytes=4)

COST_QUESTIONS = {
    "quadratic_macs": (
        "(a) multiply-adds of (φ(Q) φ(K)ᵀ) V, one head, D' = Dv = D",
        "count both products: the (T, D') by (D', T) one gives the T×T weights, then the "
        "(T, T) by (T, Dv) one"),
    "linear_macs": (
        "(b) multiply-adds of φ(Q) (φ(K)ᵀ V), one head, D' = Dv = D",
        "count both products: φ(K)ᵀ V is (D', T) by (T, Dv), then φ(Q) times that (D', Dv) "
        "matrix"),
    "crossover_length": (
        "(c) the smallest T for which φ(Q) (φ(K)ᵀ V) costs fewer multiply-adds, D' = features, "
        "Dv = D",
        "set the two counts equal and solve for T, with D' != Dv; then the first whole T past "
        "it"),
    "kv_cache_bytes": (
        "(d) bytes of the KV cache of one sequence of T tokens, all layers",
        "keys and values, in every layer and every head, one D-vector each per token, nbytes "
        "bytes per number"),
    "state_bytes": (
        "(e) bytes of the state of linear attention (elu features, D' = D) for one sequence, "
        "all layers",
        "per head and layer the state is s (D', Dv) and z (D'), whatever the length"),
}


def _costs(T, D, features, L, H, nbytes, **rule):
    """The five answers, or a typical mistake's: ``rule`` "numbers" (counted as numbers, not
    bytes), "kv_tensors" (1: the keys only), "no_z", "state_per_token"."""
    def quadratic(t, d, dv):
        return t * t * (d + dv)

    def linear(t, d, dv):
        return 2 * t * d * dv
    crossover = 1                            # the first T where the linear order is cheaper
    while linear(crossover, features, D) >= quadratic(crossover, features, D):
        crossover += 1
    nbytes = 1 if rule.get("numbers") else nbytes
    kv = rule.get("kv_tensors", 2) * L * H * T * D * nbytes
    state = L * H * (D * D + (0 if rule.get("no_z") else D)) * nbytes
    return {"quadratic_macs": quadratic(T, D, D), "linear_macs": linear(T, D, D),
            "crossover_length": crossover, "kv_cache_bytes": kv,
            "state_bytes": state * (T if rule.get("state_per_token") else 1)}


def linear_costs_reference(T, D, features, L, H, nbytes):
    """The five answers for T tokens, heads of D (D' = Dv = D with elu features), Performer's
    ``features``, L layers of H heads and ``nbytes`` bytes per number: T²(D' + Dv), 2·T·D'·Dv,
    the first T where the second is smaller (found by counting up), 2·L·H·T·D·nbytes and
    L·H·(D'·Dv + D')·nbytes."""
    return _costs(T, D, features, L, H, nbytes)


COSTS = count_questions(COST_QUESTIONS, rel_tol=1e-12, near_miss=True)


def _answering(**wrong):
    """A typical wrong answer: the right ones, with these keys computed by these rules (from
    the sizes, and F = features)."""
    return answers_changed(linear_costs_reference, wrong,
                           sizes=lambda T, D, features, L, H, nbytes: dict(
                               T=T, D=D, F=features, L=L, H=H, nbytes=nbytes))


def _costs_with(**rule):
    return lambda T, D, features, L, H, nbytes: _costs(T, D, features, L, H, nbytes, **rule)


register(Exercise(
    key="ch10.linear_costs", function="linear_costs", reference=linear_costs_reference,
    task="derive",
    ops=NONE,
    cases=lambda: COSTS.cases(COST_SIZES, MORE_COST_SIZES), compare=COSTS.compare,
    banned=("course_attn",),
    mistakes=(
        Mistake("you counted only the scores φ(Q) φ(K)ᵀ: the weights still multiply V, another "
                "T·T·Dv", _answering(quadratic_macs=lambda T, D, **_: T * T * D)),
        Mistake("you counted only φ(K)ᵀ V: reading it with φ(Q) is a second product of the same "
                "size", _answering(linear_macs=lambda T, D, **_: T * D * D)),
        Mistake("you solved with D' = Dv = D: in (c) the features are `features` wide, D' != "
                "Dv", _answering(crossover_length=lambda D, **_: D + 1)),
        Mistake("you stopped at the crossing itself: the answer is the first whole T past it, "
                "where the linear order is strictly cheaper",
                _answering(crossover_length=lambda D, F, **_: 2 * F * D // (F + D))),
        Mistake("you counted the keys only: the cache holds the values too, as many again",
                _costs_with(kv_tensors=1)),
        # Matched part by part (Case.part): this one names a wrong (d) or (e), or both.
        Mistake("you counted numbers, not bytes: each number takes nbytes bytes",
                _costs_with(numbers=True)),
        Mistake("you left out z: the state is s (D', Dv) and the normaliser's z (D')",
                _costs_with(no_z=True)),
        Mistake("your state grows with the length: s and z have the same size after 1 token or "
                "T", _costs_with(state_per_token=True)),
    ),
))


# --- ch10.causal_linear_attention: debug a prefix-sum form whose normaliser is wrong -------------

# The notebook gives this function, in a locked cell, as ``given_causal_linear_attention``: the
# prefix-sum form (every token's state S_i at once, with cumsum over the tokens), a fourth way
# to compute what the chapter computes three ways. Its bug: the normaliser z_i is summed over
# the feature axis (dim=-1) instead of the token axis, so the weights of a query no longer sum
# to its denominator, and a constant value does not come back as itself. (Exclusive against
# inclusive prefix sums, and the axis of a cumsum, are the two ways such a form goes wrong.)

def given_causal_linear_attention(fq, fk, v):
    """The buggy function of the notebook, as it is given there."""
    outer = fk.unsqueeze(-1) * v.unsqueeze(-2)      # (B, H, T, D', Dv): φ(k_j) v_jᵀ per token
    memory = outer.cumsum(dim=-3)                   # S_i = Σ_{j <= i} φ(k_j) v_jᵀ
    norm = fk.cumsum(dim=-1)                        # z_i = Σ_{j <= i} φ(k_j)
    num = (fq.unsqueeze(-2) @ memory).squeeze(-2)   # φ(q_i)ᵀ S_i, (B, H, T, Dv)
    den = (fq * norm).sum(dim=-1, keepdim=True)     # φ(q_i)ᵀ z_i, (B, H, T, 1)
    return num / den


def causal_linear_attention_reference(fq, fk, v):
    """Features fq, fk (B, H, T, D') and values v (B, H, T, Dv) -> (B, H, T, Dv): causal
    linear attention, token by token with ``LinearAttentionState`` from an empty state."""
    b, h, _, d = fq.shape
    s, z = fq.new_zeros(b, h, d, v.shape[-1]), fq.new_zeros(b, h, d)
    return chunk_step_reference(fq, fk, v, s, z)[0]


def sequence_case(name, b, h, t, d, dv, seed, hint="", dtype=torch.float32):
    """Features of ``t`` queries and keys (elu of normal numbers) and their values."""
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    fq, fk = (elu_features(randn(b, h, t, d, seed=g, dtype=dtype)) for _ in range(2))
    v = randn(b, h, t, dv, seed=g, dtype=dtype)
    return Case(name, (fq, fk, v), hint=hint)


def _sequence_cases():
    yield sequence_case("one token: B=1, H=1, T=1, D'=Dv=4", 1, 1, 1, 4, 4, 1030,
                        "a single token's output is its own value")
    yield sequence_case("B=1, H=2, T=6, D'=Dv=4", 1, 2, 6, 4, 4, 1031,
                        "each output is a weighted mean of the values 0 .. i: its weights must "
                        "sum to its denominator")
    ones = sequence_case("", 1, 2, 8, 5, 3, 1032)
    yield Case("constant values (every value 1): every output must be 1; T=8, D'=5, Dv=3",
               (ones.args[0], ones.args[1], torch.ones_like(ones.args[2])),
               hint="a weighted mean of ones is one, whatever the weights")
    yield sequence_case("D'=6, Dv=3, T=12; B=2, H=3", 2, 3, 12, 6, 3, 1033,
                        "S_i sums over the tokens j <= i, and so must z_i")
    yield sequence_case("float64, T=9", 1, 2, 9, 4, 5, 1034,
                        "do not convert the inputs; let their dtype flow through",
                        dtype=torch.float64)


def _prefix_wrong(*, norm="inclusive", memory="inclusive"):
    """causal linear attention by prefix sums, with the normaliser z_i (``norm``) and the state
    S_i (``memory``) summed in one of these ways: "inclusive" (tokens j <= i, right),
    "exclusive" (tokens j < i), "features" (z over the feature axis: the given bug), "all"
    (every token, the future too), "own" (the token's own only) or "none" (no normaliser)."""
    def prefix(x, rule, token_axis):
        if rule == "inclusive":
            return x.cumsum(token_axis)
        if rule == "exclusive":
            return x.cumsum(token_axis) - x
        if rule == "all":
            return x.sum(token_axis, keepdim=True).expand_as(x)
        if rule == "own":
            return x
        return x.cumsum(-1)                                        # "features"

    def attention(fq, fk, v):
        memory_i = prefix(fk.unsqueeze(-1) * v.unsqueeze(-2), memory, -3)
        num = (fq.unsqueeze(-2) @ memory_i).squeeze(-2)
        if norm == "none":
            return num
        return num / (fq * prefix(fk, norm, -2)).sum(-1, keepdim=True)
    return attention


register(Exercise(
    key="ch10.causal_linear_attention", function="causal_linear_attention",
    reference=causal_linear_attention_reference, task="debug",
    given=given_causal_linear_attention,
    ops=ELEMENTARY,
    cases=_sequence_cases, compare=expect_tensor, banned=NO_LIBRARY_ATTENTION,
    mistakes=(
        Mistake("your normaliser is summed along the wrong axis: z_i must add up the feature "
                "vectors φ(k_j) of the tokens j <= i, as S_i does, not the features of one "
                "token", given_causal_linear_attention),
        Mistake("your normaliser leaves out the token itself: S_i holds the tokens j <= i, "
                "and z_i must hold the same ones", _prefix_wrong(norm="exclusive")),
        Mistake("your query does not see its own key: in causal attention token i attends to "
                "the tokens j <= i, itself included",
                _prefix_wrong(norm="exclusive", memory="exclusive")),
        Mistake("your normaliser sums the keys of the future too: z_i must stop at token i, "
                "as S_i does", _prefix_wrong(norm="all")),
        Mistake("your normaliser holds the token's own key only: z_i sums the keys of every "
                "token j <= i", _prefix_wrong(norm="own")),
        Mistake("you left out the normaliser: divide by φ(q_i)ᵀ z_i, or the output is a sum "
                "that grows with the length", _prefix_wrong(norm="none")),
    ),
))


# --- ch10.recall_accuracy: measure what a fixed-size state recalls ------------------------------

# The experiment (the notebook states it step by step): ``memories`` independent memories, each
# the state S = Σ_j φ(k_j) e_{v_j}ᵀ of linear attention after N pairs (key, value), with
# ``features`` = D' features per key and the values one-hot over RECALL_VALUES ids; each
# memory is read back with every one of its own keys, φ(k_j)ᵀ S, and a pair counts as
# recalled when the largest entry of the read is its value's id. The keys are random: "unit",
# normal vectors scaled to length 1 (the keys of chapter 10's crosstalk cell), or "elu", the
# features elu(x) + 1 of normal vectors x (the chapter's feature map, every feature positive).
RECALL_VALUES, RECALL_MEMORIES = 64, 256
RECALL_KINDS = ("unit", "elu")


def _recall(n_pairs, features, kind, seed, *, unit=True, feature_map=True,
            memories=RECALL_MEMORIES):
    """The accuracy of each memory (float64, (memories,)); ``unit=False`` leaves the unit keys
    as drawn, ``feature_map=False`` the elu keys without their feature map (typical mistakes)."""
    if kind not in RECALL_KINDS:
        raise ValueError(f"kind must be one of {RECALL_KINDS}, got {kind!r}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(memories, n_pairs, features, generator=g, dtype=torch.float64)
    if kind == "unit":
        keys = x / x.norm(dim=-1, keepdim=True) if unit else x
    else:
        keys = elu_features(x) if feature_map else x
    values = torch.randint(RECALL_VALUES, (memories, n_pairs), generator=g)
    onehot = torch.nn.functional.one_hot(values, RECALL_VALUES).to(keys.dtype)
    read = keys @ (keys.transpose(-2, -1) @ onehot)         # (memories, N, values)
    return (read.argmax(-1) == values).to(torch.float64).mean(-1)


_RECALL_STATS: dict = {}


def recall_stats(n_pairs, features, kind, seed):
    """(accuracy, tolerance) of the reference's measurement, cached: the tolerance is how far
    an honest rerun of the experiment with other random draws may land from it (see
    ``expect_recall``)."""
    key = (n_pairs, features, kind, seed)
    if key not in _RECALL_STATS:
        per_memory = _recall(n_pairs, features, kind, seed)
        mean = per_memory.mean().item()
        # An honest measurement with other draws differs from this one by the difference of
        # two independent means of M memories: standard deviation √2·σ/√M, with σ the spread
        # of one memory's accuracy. σ is estimated from these M memories, and floored by the
        # binomial spread of one memory's N reads at a shrunk accuracy (p + 1)/(N·M + 2)
        # (never 0, for an accuracy measured as exactly 1 or 0). Four standard deviations:
        # a student's correct experiment fails with probability below 1e-4; every typical
        # mistake of the cases lands farther (tests/test_checks_ch10.py checks it).
        total = n_pairs * RECALL_MEMORIES
        p = (mean * total + 1) / (total + 2)
        spread = math.sqrt(per_memory.var().item() + p * (1 - p) / n_pairs)
        _RECALL_STATS[key] = (mean, 4 * math.sqrt(2) * spread / math.sqrt(RECALL_MEMORIES))
    return _RECALL_STATS[key]


def recall_accuracy_reference(n_pairs, features, kind, seed):
    """The fraction of pairs recalled, over RECALL_MEMORIES memories of ``n_pairs`` pairs with
    keys of ``features`` numbers of ``kind``, drawn with ``seed``."""
    return recall_stats(n_pairs, features, kind, seed)[0]


def expect_recall(actual, expected, case=None) -> None:
    """A fraction (a Python float or a one-element tensor) within the experiment's tolerance of
    the reference's measurement; a wrong one is told too large or too small."""
    got = as_number(actual)
    if got is None:
        raise AssertionError(f"your measurement should be a number, got {type(actual).__name__}")
    tolerance = recall_stats(*case.args)[1] if case is not None and case.args else 0.05
    if not math.isfinite(got) or abs(got - expected) > tolerance:
        direction = "too large" if got > expected else "too small"
        raise AssertionError(f"your accuracy is {direction}: farther from the reference's "
                             f"measurement than another run of the same experiment lands")


def _recall_cases():
    yield Case("unit keys, crowded: N=32 pairs in D'=8 features, seed 0", (32, 8, "unit", 0),
               hint="32 pairs in 8 dimensions cannot be orthogonal: some reads return another "
                    "pair's value")
    yield Case("unit keys, room to spare: N=8 pairs in D'=64 features, seed 1",
               (8, 64, "unit", 1),
               hint="with many more features than pairs, random unit keys are nearly "
                    "orthogonal")
    yield Case("elu features: N=32 pairs in D'=64 features, seed 2", (32, 64, "elu", 2),
               hint="the keys are φ(x) = elu(x) + 1 of normal x: every feature positive")
    yield Case("unit keys, crowded: N=48 pairs in D'=12 features, seed 3", (48, 12, "unit", 3),
               hint="normalise each key to length 1 over its features")


def _measuring(**change):
    def fn(n_pairs, features, kind, seed):
        return _recall(n_pairs, features, kind, seed, **change).mean().item()
    return fn


register(Exercise(
    key="ch10.recall_accuracy", function="recall_accuracy",
    reference=recall_accuracy_reference, task="measure",
    # An experiment: tensors, elu, argmax and one_hot, no attention and nothing of the package.
    ops=ELEMENTARY | ELU,
    cases=_recall_cases, compare=expect_recall, banned=("course_attn",),
    mistakes=(
        Mistake("your unit keys are not unit vectors: divide each key by its length over its "
                "features, or the longer keys drown the others", _measuring(unit=False)),
        Mistake("your elu keys are the normal vectors themselves: apply φ(x) = elu(x) + 1 "
                "first", _measuring(feature_map=False)),
        Mistake("you measured the fraction of pairs NOT recalled: the accuracy counts the "
                "reads whose largest entry is the stored value's id",
                lambda *args: 1 - recall_accuracy_reference(*args)),
        Mistake("your accuracy is a percentage: return a fraction between 0 and 1",
                lambda *args: 100 * recall_accuracy_reference(*args)),
    ),
))


# --- ch10.recall_predictions: predict the trend before measuring it -----------------------------

# What the accuracy of exercise recall_accuracy does as the features grow from `few` to `many`,
# for N pairs: one of these, for unit keys and for elu features. "falls" is a distractor (more
# features never add crosstalk).
TREND_OPTIONS = ("rises toward 1", "stays near 1", "stays far below 1", "falls")

TREND_QUESTIONS = {
    "unit": ("(a) random unit keys: the accuracy as D' grows from `few` to `many`",
             "random unit keys in D' dimensions have crosstalk about sqrt((N - 1) / D'): "
             "compare D' with N at both ends"),
    "elu": ("(b) elu features: the accuracy as D' grows from `few` to `many`",
            "elu(x) + 1 is positive in every coordinate: can two such feature vectors be "
            "nearly orthogonal, however many features they have?"),
}

PUBLIC_TRENDS = (dict(n_pairs=32, few=8, many=256), dict(n_pairs=16, few=40, many=128))


def _trend(few_acc, many_acc):
    """The option that a measured pair of accuracies shows, or ValueError between the
    regimes (the hidden sizes stay inside them)."""
    if few_acc >= 0.98 and many_acc >= 0.98:
        return "stays near 1"
    if many_acc >= 0.98 and few_acc < 0.9:
        return "rises toward 1"
    if few_acc < 0.5 and many_acc < 0.5:
        return "stays far below 1"
    if many_acc < few_acc - 0.1:
        return "falls"
    raise ValueError(f"no clear trend from {few_acc:.3f} to {many_acc:.3f}")


_TREND_ACCURACY: dict = {}


def _trend_accuracy(n_pairs, features, kind):
    """recall_accuracy's experiment with 64 memories (seed 0), cached: enough to read a trend
    whose ends differ by 0.1 or more (one memory's spread is under 0.1, so 64 memories' mean
    is within about 0.01)."""
    key = (n_pairs, features, kind)
    if key not in _TREND_ACCURACY:
        _TREND_ACCURACY[key] = _recall(n_pairs, features, kind, 0, memories=64).mean().item()
    return _TREND_ACCURACY[key]


def recall_predictions_reference(n_pairs, few, many):
    """Measured, with recall_accuracy's experiment, at D' = few and D' = many, and read off as
    one of TREND_OPTIONS for each kind of key."""
    return {kind: _trend(_trend_accuracy(n_pairs, few, kind), _trend_accuracy(n_pairs, many, kind))
            for kind in RECALL_KINDS}


def _same_trend(key, actual, expected) -> bool:
    return isinstance(actual, str) and actual.strip() == expected


def _wrong_trend(key, actual, expected) -> str:
    if not (isinstance(actual, str) and actual.strip() in TREND_OPTIONS):
        shown = repr(actual) if len(repr(actual)) <= 40 else repr(actual)[:37] + "..."
        return (f"your answer {key!r} is {shown}, which is not one of the options "
                f"{', '.join(map(repr, TREND_OPTIONS))}")
    return f"your answer {key!r} is not what the experiment shows"


TRENDS = Questions(TREND_QUESTIONS, same=_same_trend, wrong=_wrong_trend)


def _predicting(**wrong):
    """A typical wrong prediction: the right answers, with each key of ``wrong`` replaced by
    ``wrong[key](n=n_pairs, few=, many=)``."""
    return answers_changed(recall_predictions_reference, wrong,
                           sizes=lambda n_pairs, few, many: dict(n=n_pairs, few=few, many=many))


register(Exercise(
    key="ch10.recall_predictions", function="recall_predictions",
    reference=recall_predictions_reference, task="predict",
    ops=NONE,
    cases=lambda: TRENDS.cases(*PUBLIC_TRENDS), compare=TRENDS.compare,
    # Worked out by hand, from N and D': no tensor, and no call of the package or of one's own
    # recall_accuracy (which would run tensors).
    banned=("course_attn", "torch.tensor", "torch.randn", "torch.zeros", "torch.ones"),
    mistakes=(
        Mistake("for unit keys, more features always help: with D' much smaller than N the "
                "crosstalk is large, and it falls as D' grows past N",
                _predicting(unit=lambda **_: "stays far below 1")),
        Mistake("with D' already several times N, random unit keys are nearly orthogonal from "
                "the start: there is little left to gain",
                _predicting(unit=lambda **_: "rises toward 1")),
        Mistake("with D' much smaller than N, unit keys cannot be nearly orthogonal: the "
                "accuracy starts well below 1",
                _predicting(unit=lambda **_: "stays near 1")),
        Mistake("elu features are not random unit keys: every coordinate is positive, so "
                "every stored pair adds a positive score to every read, however wide D' is",
                _predicting(elu=lambda n, few, many: "rises toward 1" if few < 2 * n
                            else "stays near 1")),
        Mistake("more features never add crosstalk: the accuracy does not fall as D' grows",
                _predicting(unit=lambda **_: "falls")),
        Mistake("more features never add crosstalk: the accuracy does not fall as D' grows",
                _predicting(elu=lambda **_: "falls")),
    ),
))
