"""Exercises of Chapter 4, multi-head attention.

    ch04.split_heads           (warm-up) split_heads(x (B, T, C), n_heads) -> (B, H, T, D),
                               D = C / H; head h gets channels h·D .. (h+1)·D - 1
    ch04.merge_heads           (warm-up) merge_heads(x (B, H, T, D)) -> (B, T, H·D); undoes
                               split_heads
    ch04.split_qkv             (implement) split_qkv(qkv (B, T, 3C), n_heads) -> (q, k, v), each
                               (B, H, T, D), from a fused projection whose channels are
                               grouped by head (GPT-NeoX's query_key_value)
    ch04.multi_head_attention  (warm-up) multi_head_attention(x, w_q, w_k, w_v, w_o, n_heads,
                               causal) -> (B, T, C): self-attention with H heads; every weight
                               is (C, C) in nn.Linear's (out, in) convention, q = x @ w_q.T
    ch04.causal_self_attention (debug) causal_self_attention(x, w_qkv (3C, C), w_o, n_heads)
                               -> (B, T, C): the repair of the notebook's given layer (fused
                               qkv, heads last, einsum), whose merge leaks the future
    ch04.leak_pattern          (measure) leak_pattern(T, H, D, seed) -> bool (T, T): which
                               token s moves which output t of that given, leaky layer
    ch04.mha_cost              (derive) mha_cost(C, H, T) -> dict: parameters, multiply-adds
                               and score entries of an H-head layer of width C on T tokens,
                               against one head of full width

References: ``course_attn.split_heads`` and ``course_attn.merge_heads``; the multi-head
forward from them and ``course_attn.scaled_dot_product_attention``; the costs counted by
formulas checked in tests/test_checks_ch04.py against PyTorch's FlopCounterMode.
"""

import math

import torch

from ..attention import scaled_dot_product_attention
from ..multihead import merge_heads, split_heads
from .cases import (answers_changed, count_questions, expect_close_tensor, expect_tensor,
                    expect_tensors, randn)
from .exercise import Case, Exercise, Mistake, register
from .operations import ELEMENTARY, NONE, NO_LIBRARY_ATTENTION, SOFTMAX


# --- ch04.split_heads --------------------------------------------------------------------------

def _split_no_transpose(x, n_heads):
    b, t, c = x.shape
    return x.reshape(b, n_heads, t, c // n_heads)


def _split_only_view(x, n_heads):
    b, t, c = x.shape
    return x.reshape(b, t, n_heads, c // n_heads)


def _split_strided(x, n_heads):
    b, t, c = x.shape
    return x.reshape(b, t, c // n_heads, n_heads).permute(0, 3, 1, 2)


def _split_cases():
    yield Case("B=2, T=5, C=12, H=3", (randn(2, 5, 12, seed=400), 3),
               hint="view the channels as (H, D): (B, T, H, D), then swap the T and H axes")
    yield Case("B=1, T=4, C=8, H=2", (randn(1, 4, 8, seed=401), 2),
               hint="head h gets the channels h·D .. (h+1)·D - 1 of every token")
    yield Case("one head (H=1): (B, 1, T, C)", (randn(2, 3, 6, seed=402), 1),
               hint="with one head the result is x with an axis of size 1 inserted at 1")
    yield Case("heads of width 1 (H=C=4)", (randn(1, 3, 4, seed=403), 4),
               hint="D = C / H = 1: head h gets channel h")
    yield Case("T=1", (randn(3, 1, 6, seed=404), 2),
               hint="one token: each head holds D of its channels")
    yield Case("float64, B=2, T=7, C=16, H=4", (randn(2, 7, 16, seed=405, dtype=torch.float64), 4),
               hint="keep the dtype: do not convert the input")


register(Exercise(
    key="ch04.split_heads", function="split_heads", reference=split_heads,
    task="warm-up",   # chapter 4's cell 10 and its summary show it
    ops=ELEMENTARY,
    cases=_split_cases, compare=expect_tensor, banned=("course_attn",),
    mistakes=(
        Mistake("you reshaped (B, T, C) straight to (B, H, T, D): that cuts the memory into H "
                "blocks of T·D numbers, so a 'head' holds whole tokens, not D channels of every "
                "token; view the channels as (H, D) first, then move the head axis",
                _split_no_transpose),
        Mistake("your result is (B, T, H, D): the heads must come before time, (B, H, T, D), so "
                "that each head is a (T, D) matrix for the attention", _split_only_view),
        Mistake("your heads take every H-th channel (head h gets channels h, h+H, h+2H, ...): "
                "head h must get the contiguous block h·D .. (h+1)·D - 1", _split_strided),
    ),
))


# --- ch04.merge_heads --------------------------------------------------------------------------

def _merge_no_transpose(x):
    b, h, t, d = x.shape
    return x.reshape(b, t, h * d)


def _merge_only_transpose(x):
    return x.transpose(1, 2)


def _merge_strided(x):
    b, h, t, d = x.shape
    return x.permute(0, 2, 3, 1).reshape(b, t, h * d)


def _merge_cases():
    yield Case("B=2, H=3, T=5, D=4", (randn(2, 3, 5, 4, seed=410),),
               hint="swap the H and T axes back, (B, T, H, D), then flatten the last two")
    yield Case("B=1, H=2, T=4, D=3", (randn(1, 2, 4, 3, seed=411),),
               hint="output row t must hold only position t: head 0's D numbers, then head 1's")
    yield Case("one head (H=1)", (randn(2, 1, 3, 6, seed=412),),
               hint="with one head the result is x without its axis of size 1")
    yield Case("heads of width 1 (D=1), H=4", (randn(1, 4, 3, 1, seed=413),),
               hint="with D = 1, channel h of token t is head h at position t")
    yield Case("T=1", (randn(3, 2, 1, 4, seed=414),),
               hint="one token: the heads side by side")
    yield Case("float64, B=2, H=4, T=7, D=2", (randn(2, 4, 7, 2, seed=415, dtype=torch.float64),),
               hint="a transposed tensor cannot be .view()ed: use .reshape (or .contiguous() "
                    "first); keep the dtype")


register(Exercise(
    key="ch04.merge_heads", function="merge_heads", reference=merge_heads,
    task="warm-up",   # chapter 4's cell 10 and its summary show it
    ops=ELEMENTARY,
    cases=_merge_cases, compare=expect_tensor, banned=("course_attn",),
    mistakes=(
        Mistake("you reshaped (B, H, T, D) straight to (B, T, C) without moving the heads back "
                "next to the channels: output row t then holds several positions of one head "
                "(token 0's row reads positions after it), not every head at position t",
                _merge_no_transpose),
        Mistake("your result is (B, T, H, D): after moving the heads back, flatten the last two "
                "axes into H·D channels", _merge_only_transpose),
        Mistake("your channels interleave the heads (channel j comes from head j mod H): head h "
                "must fill the contiguous block h·D .. (h+1)·D - 1", _merge_strided),
    ),
))


# --- ch04.split_qkv: the fused projection's output, grouped by head (GPT-NeoX's layout) --------

def split_qkv_reference(qkv, n_heads):
    """qkv (B, T, 3C), channels grouped by head: head h's query, key and value are the blocks
    h·3D + [0, D), h·3D + [D, 2D), h·3D + [2D, 3D) (GPT-NeoX's and BLOOM's query_key_value)
    -> (q, k, v), each (B, H, T, D)."""
    b, t, three_c = qkv.shape
    d = three_c // (3 * n_heads)
    grouped = qkv.view(b, t, n_heads, 3, d).permute(3, 0, 2, 1, 4)     # (3, B, H, T, D)
    return tuple(grouped[j] for j in range(3))


def _qkv_gpt2_layout(qkv, n_heads):
    return tuple(split_heads(z, n_heads) for z in qkv.chunk(3, dim=-1))


def _qkv_channelwise(qkv, n_heads):
    b, t, three_c = qkv.shape
    d = three_c // (3 * n_heads)
    grouped = qkv.view(b, t, n_heads, d, 3).permute(4, 0, 2, 1, 3)
    return tuple(grouped[j] for j in range(3))


def _qkv_no_transpose(qkv, n_heads):
    b, t, three_c = qkv.shape
    grouped = qkv.view(b, t, n_heads, 3, three_c // (3 * n_heads))
    return tuple(grouped[:, :, :, j] for j in range(3))


def _qkv_cases():
    yield Case("B=2, T=5, H=3, D=4 (3C=36)", (randn(2, 5, 36, seed=450), 3),
               hint="head h owns the 3D channels h·3D .. (h+1)·3D - 1: its query, then its key, "
                    "then its value, D each")
    yield Case("B=1, T=4, H=2, D=3 (3C=18)", (randn(1, 4, 18, seed=451), 2),
               hint="view the channels as (H, 3, D), then move the head axis before time")
    yield Case("one head (H=1)", (randn(2, 3, 12, seed=452), 1),
               hint="with one head, q, k and v are the three thirds of the channels")
    yield Case("heads of width 1 (D=1), H=4", (randn(1, 3, 12, seed=453), 4),
               hint="D = 1: head h's query, key and value are channels 3h, 3h + 1, 3h + 2")
    yield Case("T=1", (randn(3, 1, 24, seed=454), 2),
               hint="one token: each head holds D numbers of q, of k and of v")
    yield Case("float64, B=2, T=6, H=4, D=2", (randn(2, 6, 24, seed=455, dtype=torch.float64), 4),
               hint="keep the dtype: do not convert the input")


register(Exercise(
    key="ch04.split_qkv", function="split_qkv", reference=split_qkv_reference,
    task="implement",   # a layout the chapter does not use (its section 5 fuses GPT-2's way)
    ops=ELEMENTARY,
    cases=_qkv_cases, compare=expect_tensors(("q", "k", "v")), banned=("course_attn",),
    mistakes=(
        Mistake("you read GPT-2's layout (all the queries, then all the keys, then all the "
                "values, as the chapter's fused nn.Linear(C, 3C)): here the channels are "
                "grouped by head, the query, key and value of head 0, then those of head 1, ...",
                _qkv_gpt2_layout),
        Mistake("your heads' q, k and v take every third channel: each is a block of D "
                "consecutive channels of its head's 3D", _qkv_channelwise),
        Mistake("your q, k and v are (B, T, H, D): the heads must come before time, "
                "(B, H, T, D), as split_heads gives them", _qkv_no_transpose),
    ),
))


# --- ch04.multi_head_attention -----------------------------------------------------------------

def multi_head_attention_reference(x, w_q, w_k, w_v, w_o, n_heads, causal):
    """x (B, T, C), four (C, C) weights in nn.Linear's (out, in) convention -> (B, T, C)."""
    q, k, v = (split_heads(x @ w.T, n_heads) for w in (w_q, w_k, w_v))   # (B, H, T, D)
    out = scaled_dot_product_attention(q, k, v, is_causal=causal)          # (B, H, T, D)
    return merge_heads(out) @ w_o.T


def _mha(*, split=split_heads, merge=merge_heads, scale=None, project_out=True,
         transpose_weights=True, causal_rule=None):
    """A typical mistake: the reference with one step done another way."""
    def fn(x, w_q, w_k, w_v, w_o, n_heads, causal):
        if not transpose_weights:
            w_q, w_k, w_v, w_o = (w.T for w in (w_q, w_k, w_v, w_o))
        q, k, v = (split(x @ w.T, n_heads) for w in (w_q, w_k, w_v))
        is_causal = causal if causal_rule is None else causal_rule
        out = scaled_dot_product_attention(
            q, k, v, is_causal=is_causal,
            scale=None if scale is None else scale(x.shape[-1], n_heads))
        merged = merge(out)
        return merged @ w_o.T if project_out else merged
    return fn


def _weights(c, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return tuple(randn(c, c, seed=gen, dtype=dtype, scale=1 / math.sqrt(c)) for _ in range(4))


def mha_case(name, b, t, c, h, causal, seed, dtype=torch.float32, hint=""):
    x = randn(b, t, c, seed=seed, dtype=dtype)
    return Case(name, (x, *_weights(c, seed + 1, dtype), h, causal), hint=hint)


def _mha_cases():
    yield mha_case("B=2, T=6, C=12, H=3, causal", 2, 6, 12, 3, True, 420,
                   hint="q = x @ w_q.T (weights are (out, in), as nn.Linear's), split into heads, "
                        "attend in each head, merge, then the output projection")
    yield mha_case("B=2, T=6, C=12, H=3, not causal", 2, 6, 12, 3, False, 422,
                   hint="causal=False: every query may attend to every key")
    yield mha_case("B=1, T=5, C=16, H=4, causal", 1, 5, 16, 4, True, 424,
                   hint="scale the scores by 1/sqrt(D), D = C / H, the width of a head")
    yield mha_case("one head (H=1), T=4, C=8, causal", 1, 4, 8, 1, True, 426,
                   hint="with H = 1 this is chapter 3's causal attention between projections")
    yield mha_case("heads of width 1 (H=C=6), not causal", 2, 4, 6, 6, False, 428,
                   hint="D = 1: each head's scores are products of single numbers")
    yield mha_case("T=1, causal", 3, 1, 8, 2, True, 430,
                   hint="one token attends to itself only: the output is its value, projected")
    yield mha_case("float64, B=2, T=7, C=16, H=2, causal", 2, 7, 16, 2, True, 432,
                   dtype=torch.float64, hint="keep the dtype: do not convert the inputs")


register(Exercise(
    key="ch04.multi_head_attention", function="multi_head_attention",
    task="warm-up",   # chapter 4's cell 10 with chapter 2's attention
    ops=ELEMENTARY | SOFTMAX,
    reference=multi_head_attention_reference, cases=_mha_cases,
    compare=expect_close_tensor(1e-5, 1e-5), banned=NO_LIBRARY_ATTENTION,
    mistakes=(
        Mistake("you merged the heads with a reshape of (B, H, T, D) straight to (B, T, C): "
                "move the head axis back next to the channels first, or each output row mixes "
                "several positions", _mha(merge=_merge_no_transpose)),
        Mistake("you split the heads with a reshape of (B, T, C) straight to (B, H, T, D): view "
                "the channels as (H, D) first, then move the head axis",
                _mha(split=_split_no_transpose)),
        Mistake("you scaled the scores by 1/sqrt(C): each head's dot products run over its own "
                "D = C / H channels, so the scale is 1/sqrt(D)",
                _mha(scale=lambda c, h: 1 / math.sqrt(c))),
        Mistake("you did not scale the scores: divide them by sqrt(D), D = C / H",
                _mha(scale=lambda c, h: 1.0)),
        Mistake("you left out the output projection: after merging the heads, multiply by "
                "w_o.T", _mha(project_out=False)),
        Mistake("you multiplied by the weights as given (x @ w): they are in nn.Linear's "
                "(out, in) convention, so a projection is x @ w.T",
                _mha(transpose_weights=False)),
        Mistake("you ignored causal=True: each query must not see the keys after it",
                _mha(causal_rule=False)),
        Mistake("you applied a causal mask with causal=False: then every query may see every key",
                _mha(causal_rule=True)),
    ),
))


# --- ch04.mha_cost: derive what H heads cost against one head ---------------------------------

# The chapter's sizes, and a short sequence (T < D) through GPT-2 small's width: on both,
# every typical mistake below differs from the right count (H > 1, D != T, C != T).
COST_SIZES = (dict(C=512, H=8, T=1024), dict(C=768, H=12, T=50))
COST_QUESTIONS = {
    # key: (case name, hint of the case)
    "params": ("(a) parameters of the H-head layer",
               "four (C, C) projections, no biases: W_Q, W_K, W_V and W_O"),
    "projection_macs": ("(b) multiply-adds of the four projections, T tokens",
                        "a (T, C) @ (C, C) product is T·C·C multiply-adds; there are four"),
    "attention_macs_multi": ("(c) multiply-adds of the scores and the weighted sum, H heads",
                             "per head: (T, D) @ (D, T) for the scores, (T, T) @ (T, D) for "
                             "the weighted sum; D = C / H; then H heads"),
    "attention_macs_single": ("(d) the same for one head of width C",
                              "one head: (T, C) @ (C, T), then (T, T) @ (T, C)"),
    "score_entries_multi": ("(e) entries of the attention weights, H heads",
                            "every head has its own (T, T) table of weights"),
    "score_entries_single": ("(f) entries of the attention weights, one head",
                             "one head: one (T, T) table"),
}


def mha_cost_reference(C, H, T):
    """One sequence of T tokens through a self-attention layer of width C with H heads (H
    divides C), no biases."""
    D = C // H
    return {
        "params": 4 * C * C,
        "projection_macs": 4 * T * C * C,
        "attention_macs_multi": H * (T * D * T + T * T * D),
        "attention_macs_single": T * C * T + T * T * C,
        "score_entries_multi": H * T * T,
        "score_entries_single": T * T,
    }


COSTS = count_questions(COST_QUESTIONS)


def _costing(**wrong):
    """A typical mistake: the right counts with these ones computed another way, each rule a
    function of C, H, T and D = C / H."""
    return answers_changed(mha_cost_reference, wrong,
                           sizes=lambda C, H, T: dict(C=C, H=H, T=T, D=C // H))


register(Exercise(
    key="ch04.mha_cost", function="mha_cost", reference=mha_cost_reference,
    task="derive",
    ops=NONE,
    cases=lambda: COSTS.cases(*COST_SIZES), compare=COSTS.compare, banned=("course_attn",),
    # A mistake is matched on the one part a case judges, so each declares every count it gets
    # wrong, and a student who got only one of them wrong is named all the same.
    mistakes=(
        Mistake("you left out the output projection W_O: it is a (C, C) matrix too",
                _costing(params=lambda C, H, T, D: 3 * C * C,
                         projection_macs=lambda C, H, T, D: 3 * T * C * C)),
        Mistake("you gave each head its own (C, C) projections: the H heads share one (C, C) "
                "matrix per projection, each head reading D = C / H of its output columns",
                _costing(params=lambda C, H, T, D: 4 * H * C * C,
                         projection_macs=lambda C, H, T, D: 4 * H * T * C * C)),
        Mistake("you counted the projections of one head only, (C, D) each: the layer has all "
                "H heads, (C, C) in all",
                _costing(params=lambda C, H, T, D: 4 * C * D,
                         projection_macs=lambda C, H, T, D: 4 * T * C * D)),
        Mistake("your heads' dot products run over all C channels: each head's q and k have "
                "D = C / H channels",
                _costing(attention_macs_multi=lambda C, H, T, D: H * 2 * T * T * C)),
        Mistake("you counted one head only: the layer has H heads, each with its own scores "
                "and weighted sum", _costing(attention_macs_multi=lambda C, H, T, D:
                                             2 * T * T * D)),
        Mistake("you counted only the scores q kᵀ: the weighted sum (weights times v) is a "
                "second product of the same size",
                _costing(attention_macs_multi=lambda C, H, T, D: H * T * T * D,
                         attention_macs_single=lambda C, H, T, D: T * T * C)),
        Mistake("you counted 2 FLOPs per multiply-add: the question asks for multiply-adds",
                _costing(projection_macs=lambda C, H, T, D: 8 * T * C * C,
                         attention_macs_multi=lambda C, H, T, D: 4 * T * T * C,
                         attention_macs_single=lambda C, H, T, D: 4 * T * T * C)),
        Mistake("you counted one table of weights for all the heads: the heads split the "
                "channels, not the table; each head weighs the T keys for each of the T "
                "queries itself",
                _costing(score_entries_multi=lambda C, H, T, D: T * T)),
        Mistake("the table of weights is (T, T) per head, whatever its width: it does not "
                "grow with D or C",
                _costing(score_entries_multi=lambda C, H, T, D: H * T * D,
                         score_entries_single=lambda C, H, T, D: T * C)),
    ),
))


# --- ch04.causal_self_attention: repair a layer that leaks the future (debug) -----------------

def leaky_self_attention(x, w_qkv, w_o, n_heads):
    """The layer the notebook gives (its cell ``ch04-causal_self_attention-given``), bug
    included: heads last, einsum, one fused (3C, C) projection; the heads' outputs, (B, H, T,
    D), are flattened to (B, T, C) without putting time before the heads, so output row t
    holds several positions of one head, some of them after t."""
    B, T, C = x.shape
    D = C // n_heads
    q, k, v = torch.einsum("btc,fc->btf", x, w_qkv).split(C, dim=-1)     # (B, T, C) each
    q, k, v = (z.reshape(B, T, n_heads, D) for z in (q, k, v))             # (B, T, H, D)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)           # (B, H, T, T)
    future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    out = torch.einsum("bhqk,bkhd->bhqd", weights, v)                       # (B, H, T, D)
    return out.reshape(B, T, C) @ w_o.T


def _fused(w_qkv):
    return w_qkv.chunk(3, dim=0)


def causal_self_attention_reference(x, w_qkv, w_o, n_heads):
    """x (B, T, C), w_qkv (3C, C) = [W_Q; W_K; W_V] in (out, in), w_o (C, C) -> (B, T, C):
    causal H-head self-attention, the package's layer."""
    return multi_head_attention_reference(x, *_fused(w_qkv), w_o, n_heads, True)


def _causal_with(*, merge=merge_heads, diagonal=False):
    """A typical wrong repair: the reference with another merge, or the diagonal masked too."""
    def fn(x, w_qkv, w_o, n_heads):
        q, k, v = (split_heads(x @ w.T, n_heads) for w in _fused(w_qkv))
        t, d = x.shape[1], q.shape[-1]
        allowed = torch.ones(t, t, dtype=torch.bool, device=x.device).tril(-1 if diagonal else 0)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v       # a row with no key: NaN, as a student's
        return merge(out) @ w_o.T
    return fn


def causal_case(name, b, t, c, h, seed, dtype=torch.float32, hint=""):
    gen = torch.Generator().manual_seed(seed)
    x = randn(b, t, c, seed=gen, dtype=dtype)
    w_qkv = randn(3 * c, c, seed=gen, dtype=dtype, scale=1 / math.sqrt(c))
    w_o = randn(c, c, seed=gen, dtype=dtype, scale=1 / math.sqrt(c))
    return Case(name, (x, w_qkv, w_o, h), hint=hint)


def _causal_cases():
    yield causal_case("B=2, T=6, C=12, H=3", 2, 6, 12, 3, 440,
                      hint="output position t may depend on tokens 0 .. t only: change a later "
                           "token and it must not move")
    yield causal_case("B=1, T=5, C=8, H=2", 1, 5, 8, 2, 441,
                      hint="compare each step's layout with what the next step reads: which "
                           "axis is time, which is the head?")
    yield causal_case("more heads than tokens: T=3, C=8, H=4", 2, 3, 8, 4, 442,
                      hint="with H >= T the leak reaches every output: each reads every token")
    yield causal_case("one head (H=1): the bug cannot show", 2, 4, 6, 1, 443,
                      hint="with one head the layer is chapter 3's causal attention")
    yield causal_case("heads of width 1 (H=C=4)", 1, 5, 4, 4, 444,
                      hint="D = 1: channel h of output t is head h at position t")
    yield causal_case("T=1: one token", 3, 1, 8, 2, 445,
                      hint="one token attends to itself: its output is its value, projected")
    yield causal_case("float64, B=2, T=7, C=16, H=4", 2, 7, 16, 4, 446, dtype=torch.float64,
                      hint="keep the dtype: do not convert the inputs")


register(Exercise(
    key="ch04.causal_self_attention", function="causal_self_attention",
    task="debug", given=leaky_self_attention,
    reference=causal_self_attention_reference, cases=_causal_cases,
    ops=ELEMENTARY | SOFTMAX,
    compare=expect_close_tensor(1e-5, 1e-5), banned=NO_LIBRARY_ATTENTION,
    mistakes=(
        Mistake("your layer still lets an output read later tokens, with the mask right: "
                "look at which positions of which head end up in output row t",
                leaky_self_attention),
        Mistake("your output channels interleave the heads (channel j comes from head j mod "
                "H): head h must fill the contiguous block h·D .. (h+1)·D - 1, as the fused "
                "projection's output was split", _causal_with(merge=_merge_strided)),
        Mistake("the mask was right: a query may attend to itself, and masking the diagonal "
                "too leaves the first query no key at all (a row of NaN)",
                _causal_with(diagonal=True)),
    ),
))


# --- ch04.leak_pattern: measure which tokens each output of the leaky layer reads -------------

def leak_pattern_reference(T, H, D, seed):
    """The experiment, as the notebook asks it: the leaky layer of width C = H·D with weights
    and one sequence of T tokens drawn from ``seed``; token s replaced by another random
    vector, for each s; returns bool (T, T), [t, s] = output t moved.

    Compared exactly, and rightly so: an output that does not depend on token s is computed by
    the same operations on the same numbers (a masked weight is exactly 0, and a row of a
    product never reads another row of its input), so it does not move by a single bit; one
    that depends on it moves by about the size of the outputs, since the new token is a fresh
    draw. Any seed gives the same pattern (the structure of the layer, not its numbers)."""
    gen = torch.Generator().manual_seed(seed)
    C = H * D
    x = torch.randn(1, T, C, generator=gen, dtype=torch.float64)
    w_qkv = torch.randn(3 * C, C, generator=gen, dtype=torch.float64) / math.sqrt(C)
    w_o = torch.randn(C, C, generator=gen, dtype=torch.float64) / math.sqrt(C)
    before = leaky_self_attention(x, w_qkv, w_o, H)
    moved = torch.zeros(T, T, dtype=torch.bool)
    for s in range(T):
        changed = x.clone()
        changed[0, s] = torch.randn(C, generator=gen, dtype=torch.float64)
        moved[:, s] = (leaky_self_attention(changed, w_qkv, w_o, H) != before)[0].any(dim=-1)
    return moved


def leak_pattern_formula(T, H, D=1, seed=0):
    """The same pattern worked out (tests/test_checks_ch04.py checks that the two agree):
    output row t holds the flat (head, position) slots h·T + t' in [t·H, (t+1)·H), and slot
    (h, t') reads the tokens 0 .. t' (a causal head)."""
    slots = torch.arange(T * H).reshape(T, H)            # row t: slots t·H .. t·H + H - 1
    latest = (slots % T).amax(dim=1)                      # the latest position a row reads
    return torch.arange(T)[None, :] <= latest[:, None]


def _causal_pattern(T, H, D, seed):
    return torch.ones(T, T, dtype=torch.bool).tril()


def _leak_cases():
    yield Case("T=6, H=3, D=2, seed 0", (6, 3, 2, 0),
               hint="row t: output position t; column s: the token you changed; True where "
                    "output t moved")
    yield Case("T=5, H=2, D=3, seed 1 (T not a multiple of H)", (5, 2, 3, 1),
               hint="change one token at a time, run the given layer, and compare every output "
                    "position with the unchanged run")
    yield Case("T=3, H=4, D=2, seed 2 (more heads than tokens)", (3, 4, 2, 2),
               hint="with H >= T, every output row reads every token")
    yield Case("T=4, H=1, D=4, seed 3 (one head: no leak)", (4, 1, 4, 3),
               hint="with one head the layer is causal: output t reads tokens 0 .. t")


register(Exercise(
    key="ch04.leak_pattern", function="leak_pattern",
    task="measure",
    reference=leak_pattern_reference, cases=_leak_cases, compare=expect_tensor,
    # It runs the notebook's leaky layer (einsum, softmax); the package's layers are refused.
    ops=ELEMENTARY | SOFTMAX, banned=("course_attn",),
    mistakes=(
        Mistake("your table is transposed: row t must be output position t and column s the "
                "token you changed", lambda T, H, D, seed:
                leak_pattern_reference(T, H, D, seed).T.contiguous()),
        Mistake("that is the pattern of a causal layer (output t reads tokens 0 .. t): measure "
                "the given leaky layer, whose merge mixes positions", _causal_pattern),
    ),
))
