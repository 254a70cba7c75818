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

References: ``course_attn.linear.elu_features``; ``course_attn.linear.LinearAttentionState``
(``add`` then ``read``), token by token, for both steps; the counts from T²(D' + Dv) and
2·T·D'·Dv, and the sizes 2·L·H·T·D·nbytes and L·H·(D'·Dv + D')·nbytes.
"""

import torch

from ..linear import EPS, LinearAttentionState, elu_features
from .cases import count_questions, expect_tensor, expect_tensors, randn
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
    def fn(T, D, features, L, H, nbytes):
        sizes = dict(T=T, D=D, F=features, L=L, H=H, nbytes=nbytes)
        return {**linear_costs_reference(T, D, features, L, H, nbytes),
                **{key: rule(**sizes) for key, rule in wrong.items()}}
    return fn


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
        *(Mistake("you counted numbers, not bytes: each number takes nbytes bytes", fn)
          for fn in (_costs_with(numbers=True),
                     _answering(kv_cache_bytes=lambda T, D, L, H, **_: 2 * L * H * T * D),
                     _answering(state_bytes=lambda D, L, H, **_: L * H * (D * D + D)))),
        Mistake("you left out z: the state is s (D', Dv) and the normaliser's z (D')",
                _costs_with(no_z=True)),
        Mistake("your state grows with the length: s and z have the same size after 1 token or "
                "T", _costs_with(state_per_token=True)),
    ),
))
