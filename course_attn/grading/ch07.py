"""Exercises of Chapter 7, MQA and GQA.

    ch07.repeat_kv         repeat_kv(x, n_rep) -> (B, Hkv·n_rep, T, D): each key/value head
                           repeated for the n_rep query heads that read it (query head h reads
                           KV head h // n_rep), with expand and reshape (warm-up)
    ch07.gqa_attention     gqa_attention(q, k, v, is_causal=False) -> (B, H, Tq, Dv): attention
                           whose H query heads share Hkv key/value heads (warm-up)
    ch07.grouped_attention grouped_attention(q, k, v) -> (B, H, Tq, Dv): debug a given GQA that
                           groups the query heads instead of copying K and V, and groups them
                           in the wrong order (query head h reads KV head h % Hkv)
    ch07.kv_cache_bytes    kv_cache_bytes(config, seq_len, batch_size=1, bytes_per_element=2)
                           -> int: the KV cache's size for a model's config.json
    ch07.cache_questions   cache_questions(layers, heads, kv_heads, head_dim, bytes_per_element,
                           query_head, cache_gib, latent_dim, rope_dim) -> dict: which KV head a
                           query head reads, how many tokens fit in a cache, how much MLA saves
                           (derive: compared with the formulas, on public and hidden sizes)
    ch07.copy_predictions  copy_predictions(batch, kv_heads, n_rep, seq_len, head_dim) -> dict:
                           predict whether expand, repeat_kv's reshape and repeat make a view or
                           a copy for these sizes, and the bytes repeat_kv allocates

References: ``course_attn.repeat_kv`` and ``course_attn.scaled_dot_product_attention(...,
enable_gqa=True)``; the cache size 2 · layers · B · Hkv · D · T · bytes.
"""

import math

import torch

from ..attention import repeat_kv, scaled_dot_product_attention
from ..masks import causal_mask
from .cases import Questions, answers_changed, as_number, expect_tensor, randn
from .exercise import Case, Exercise, Mistake, register
from .operations import ELEMENTARY, NONE, NO_LIBRARY_ATTENTION, SOFTMAX

NO_REPEAT_INTERLEAVE = ("course_attn", "torch.repeat_interleave",
                        "torch.Tensor.repeat_interleave")


# --- ch07.repeat_kv -------------------------------------------------------------------------------

def repeat_kv_reference(x, n_rep):
    """(B, Hkv, T, D) -> (B, Hkv·n_rep, T, D): head j of the result is head j // n_rep of x."""
    return repeat_kv(x, n_rep)


def _tiled(x, n_rep):
    """The heads tiled, 0 1 2 0 1 2 ...: query head h would read KV head h % Hkv."""
    return x.repeat(1, n_rep, 1, 1)


def _repeat_kv_cases():
    yield Case("x (2, 2, 5, 4), n_rep=3 (6 query heads, 2 KV heads)",
               (randn(2, 2, 5, 4, seed=700), 3),
               hint="heads 0, 1, 2 of the result are KV head 0, heads 3, 4, 5 are KV head 1: "
                    "insert a new axis after the heads, expand it to n_rep, then merge the two")
    yield Case("x (1, 3, 4, 2), n_rep=2", (randn(1, 3, 4, 2, seed=701), 2),
               hint="the result has Hkv·n_rep heads, and every other axis as it was")
    yield Case("n_rep=1 (MHA): x unchanged", (randn(2, 4, 3, 5, seed=702), 1),
               hint="with n_rep=1 every query head has its own KV head: return x's values")
    yield Case("one KV head (MQA), n_rep=4", (randn(2, 1, 6, 4, seed=703), 4),
               hint="with one KV head, every query head reads it")
    yield Case("T=1 (one decode step), float64, n_rep=2",
               (randn(3, 4, 1, 8, seed=704, dtype=torch.float64), 2),
               hint="do not convert the input; let its dtype flow through")


# Two ways of repeating along the time axis (each position n_rep times, or the whole sequence
# n_rep times): the same mistake, named by the same hint.
ALONG_TIME = "you repeated along the time axis: the result needs more heads, not more positions"

register(Exercise(
    key="ch07.repeat_kv", function="repeat_kv", reference=repeat_kv_reference,
    task="warm-up",
    ops=ELEMENTARY,
    cases=_repeat_kv_cases, compare=expect_tensor, banned=NO_REPEAT_INTERLEAVE,
    mistakes=(
        Mistake("you tiled the heads (0 1 0 1 ...): query head h must read KV head h // n_rep, "
                "so the copies of one KV head sit next to each other; the new axis goes "
                "after the heads' axis, not before it", _tiled),
        Mistake(ALONG_TIME, lambda x, n_rep: x[:, :, :, None].expand(
                    *x.shape[:3], n_rep, x.shape[3]).reshape(
                    x.shape[0], x.shape[1], x.shape[2] * n_rep, x.shape[3])),
        Mistake(ALONG_TIME, lambda x, n_rep: x.repeat(1, 1, n_rep, 1)),
        Mistake("you repeated along the batch axis: the result needs more heads, not more "
                "sequences", lambda x, n_rep: x[None].expand(n_rep, *x.shape).reshape(
                    x.shape[0] * n_rep, *x.shape[1:])),
        Mistake("you expanded but never merged the new axis into the heads: reshape to "
                "(B, Hkv·n_rep, T, D)", lambda x, n_rep: x[:, :, None].expand(
                    x.shape[0], x.shape[1], n_rep, *x.shape[2:])),
    ),
))


# --- ch07.gqa_attention ---------------------------------------------------------------------------

def gqa_attention_reference(q, k, v, is_causal=False):
    """(B, H, Tq, D), (B, Hkv, Tk, D), (B, Hkv, Tk, Dv) -> (B, H, Tq, Dv)."""
    return scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)


def _attend(q, k, v, is_causal, scale=None, dim=-1):
    """Plain attention as a student writes it (torch.softmax), bottom-right causal."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale                           # (B, H, Tq, Tk)
    if is_causal:
        scores = scores.masked_fill(~causal_mask(*scores.shape[-2:], device=scores.device),
                                    float("-inf"))
    return torch.softmax(scores, dim=dim) @ v


def _grouped(how):
    def fn(q, k, v, is_causal=False, **options):
        n_rep = q.shape[1] // k.shape[1]
        return _attend(q, how(k, n_rep), how(v, n_rep), is_causal, **options)
    return fn


def _gqa_cases():
    g = torch.Generator().manual_seed(710)
    q, k, v = randn(2, 4, 5, 8, seed=g), randn(2, 2, 5, 8, seed=g), randn(2, 2, 5, 8, seed=g)
    yield Case("B=2, H=4 query heads, Hkv=2, T=5, D=8", (q, k, v),
               hint="query head h reads KV head h // (H / Hkv); then softmax(q kᵀ / sqrt(D)) v "
                    "in each head")
    yield Case("causal, H=4, Hkv=2, T=5", (q, k, v), {"is_causal": True},
               hint="with is_causal, query i may attend to keys 0..i: -inf above the diagonal")
    q, k, v = randn(1, 6, 3, 4, seed=g), randn(1, 2, 7, 4, seed=g), randn(1, 2, 7, 3, seed=g)
    yield Case("H=6, Hkv=2 (groups of 3), Tq=3 != Tk=7, Dv=3", (q, k, v),
               hint="the values are shared like the keys: both need the same repeat; the "
                    "output has the query heads' count and the values' width")
    q, k, v = randn(2, 4, 4, 8, seed=g), randn(2, 1, 4, 8, seed=g), randn(2, 1, 4, 8, seed=g)
    yield Case("MQA: H=4, one KV head", (q, k, v),
               hint="with one KV head, every query head attends over the same keys and values")
    q, k, v = (randn(1, 3, 4, 6, seed=g) for _ in range(3))
    yield Case("MHA: H = Hkv = 3", (q, k, v),
               hint="with Hkv = H, this is ordinary multi-head attention")
    q = randn(1, 8, 6, 4, seed=g, dtype=torch.float64, scale=2.0)
    k, v = (randn(1, 2, 6, 4, seed=g, dtype=torch.float64, scale=2.0) for _ in range(2))
    yield Case("float64, causal, H=8, Hkv=2", (q, k, v), {"is_causal": True},
               hint="do not convert the inputs; let their dtype flow through")


def _first_kv_head_only(q, k, v, is_causal=False):
    return _attend(q, k[:, :1], v[:, :1], is_causal)


register(Exercise(
    key="ch07.gqa_attention", function="gqa_attention", reference=gqa_attention_reference,
    task="warm-up",
    ops=ELEMENTARY | SOFTMAX,
    cases=_gqa_cases, compare=expect_tensor, banned=NO_LIBRARY_ATTENTION,
    mistakes=(
        Mistake("you ignored is_causal=True: each query must see only the keys up to its own "
                "position (-inf above the diagonal, before the softmax)",
                lambda q, k, v, is_causal=False: gqa_attention_reference(q, k, v)),
        Mistake("you tiled the KV heads (0 1 0 1 ...): query head h reads KV head h // (H / Hkv), "
                "so the query heads of one group are neighbours", _grouped(_tiled)),
        Mistake("you forgot the 1/sqrt(D) scale of the scores",
                lambda q, k, v, is_causal=False: _grouped(repeat_kv)(q, k, v, is_causal,
                                                                     scale=1.0)),
        Mistake("every query head reads KV head 0: each group of query heads has its own KV head",
                _first_kv_head_only),
        Mistake("you took the softmax over the queries (axis -2): each query's weights over "
                "the keys sum to 1, so it runs over the last axis",
                lambda q, k, v, is_causal=False: _grouped(repeat_kv)(q, k, v, is_causal,
                                                                     dim=-2)),
        Mistake("you repeated the keys but tiled the values: both must follow the same "
                "grouping, query head h reads keys and values of KV head h // (H / Hkv)",
                lambda q, k, v, is_causal=False: _attend(
                    q, repeat_kv(k, q.shape[1] // k.shape[1]),
                    _tiled(v, q.shape[1] // k.shape[1]), is_causal)),
        # Raises (the weights' H heads against v's Hkv) wherever 1 < Hkv < H: named by its error.
        # Keys left unrepeated raise the same error, at the scores: the hint speaks of both.
        Mistake("you did not repeat the values (or the keys): a tensor with Hkv heads met the H "
                "query heads; the values are shared like the keys, and need the same repeat",
                lambda q, k, v, is_causal=False: _attend(
                    q, repeat_kv(k, q.shape[1] // k.shape[1]), v, is_causal)),
    ),
))


# --- ch07.grouped_attention: debug a GQA that groups the query heads in the wrong order -----------
# The given function (the notebook's locked cell, the same code as _grouped_given) avoids
# repeat_kv's copies the way a fused kernel does: it stacks the query heads that share a KV head
# along the query axis, so one matrix product per KV head reads that head's keys once. But it
# splits the H query heads as (H / Hkv, Hkv), so query head h lands in KV head h % Hkv's stack:
# the heads are tiled, not grouped. It is right for MQA (Hkv = 1) and MHA (Hkv = H), wrong for
# every other GQA. A repair that broadcasts K and V over a group axis instead (q @ k[:, :, None])
# copies them: torch.matmul makes a broadcast operand contiguous (aten.clone) before its bmm. The
# guard counts what the call copies of k and v (``no_copy``).

GROUPED_GIVEN = '''\
def grouped_attention(q, k, v):
    """Grouped-query attention that never copies the keys and values.

    q: (B, H, Tq, D); k: (B, Hkv, Tk, D); v: (B, Hkv, Tk, Dv) -> (B, H, Tq, Dv).
    """
    b, h, tq, d = q.shape
    hkv = k.shape[1]
    # each KV head's query heads, stacked along the query axis:
    # (B, Hkv, H / Hkv · Tq, D)
    q = (
        q.reshape(b, h // hkv, hkv, tq, d)
        .transpose(1, 2)
        .reshape(b, hkv, -1, d)
    )
    # each KV head read once, where it is
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)
    out = scores.softmax(dim=-1) @ v  # (B, Hkv, H / Hkv · Tq, Dv)
    out = out.reshape(b, hkv, h // hkv, tq, -1).transpose(1, 2)
    return out.reshape(b, h, tq, -1)
'''

_given: dict = {"math": math, "torch": torch}
exec(GROUPED_GIVEN, _given)
_grouped_given = _given["grouped_attention"]


def _grouped_with(*, tiled_queries, tiled_output):
    """The given function repaired on one side only: the query heads stacked in their groups
    or tiled, the output's heads read back in groups or tiled."""
    def fn(q, k, v):
        b, h, tq, d = q.shape
        hkv = k.shape[1]
        if tiled_queries:
            q = q.reshape(b, h // hkv, hkv, tq, d).transpose(1, 2)
        scores = q.reshape(b, hkv, -1, d) @ k.transpose(-2, -1) / math.sqrt(d)
        out = scores.softmax(dim=-1) @ v                    # (B, Hkv, H / Hkv · Tq, Dv)
        if tiled_output:
            out = out.reshape(b, hkv, h // hkv, tq, -1).transpose(1, 2)
        return out.reshape(b, h, tq, -1)
    return fn


def grouped_attention_reference(q, k, v):
    """(B, H, Tq, D), (B, Hkv, Tk, D), (B, Hkv, Tk, Dv) -> (B, H, Tq, Dv): query head h reads KV
    head h // (H / Hkv); no mask."""
    return scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _grouped_cases():
    g = torch.Generator().manual_seed(720)

    def qkv(b, h, hkv, tq, tk, d, dv, dtype=torch.float32):
        return (randn(b, h, tq, d, seed=g, dtype=dtype, scale=2.0),
                randn(b, hkv, tk, d, seed=g, dtype=dtype, scale=2.0),
                randn(b, hkv, tk, dv, seed=g, dtype=dtype))
    yield Case("B=2, H=4, Hkv=2, T=5, D=8", qkv(2, 4, 2, 5, 5, 8, 8),
               hint="query head h reads KV head h // (H / Hkv): the query heads of one group are "
                    "neighbours")
    yield Case("H=6, Hkv=2 (groups of 3), T=4, D=4", qkv(1, 6, 2, 4, 4, 4, 4),
               hint="with groups of 3, query heads 0, 1, 2 read KV head 0 and 3, 4, 5 KV head 1")
    yield Case("H=6, Hkv=3 (groups of 2), Tq=3, Tk=6, Dv=2", qkv(1, 6, 3, 3, 6, 8, 2),
               hint="the output has the query heads' count and the values' width")
    yield Case("MQA: H=4, one KV head", qkv(2, 4, 1, 4, 4, 8, 8),
               hint="with one KV head every query head reads it")
    yield Case("MHA: H = Hkv = 3", qkv(1, 3, 3, 4, 4, 4, 4),
               hint="with Hkv = H this is ordinary multi-head attention")
    yield Case("float64, H=8, Hkv=4", qkv(1, 8, 4, 5, 5, 4, 4, torch.float64),
               hint="do not convert the inputs; let their dtype flow through")


TILED_GROUPS = ("your query head h reads KV head h % Hkv, as if the KV heads were tiled: the "
                "query heads that share a KV head are neighbours, h // (H / Hkv)")

register(Exercise(
    key="ch07.grouped_attention", function="grouped_attention",
    reference=grouped_attention_reference,
    task="debug", given=_grouped_given,
    ops=ELEMENTARY | SOFTMAX,
    cases=_grouped_cases, compare=expect_tensor,
    # the point of the given function is to read the shared heads where they are, not to copy
    # them: what the call copies of k and v is counted (harness.Guard's no_copy)
    banned=NO_LIBRARY_ATTENTION + NO_REPEAT_INTERLEAVE[1:] + ("torch.Tensor.repeat",),
    no_copy=((1, "k"), (2, "v")),
    mistakes=(
        Mistake(TILED_GROUPS, _grouped_given),
        Mistake("your query heads are stacked in their groups, but the output's heads are put "
                "back in the tiled order: query head h's output lands at another head's place",
                _grouped_with(tiled_queries=False, tiled_output=True)),
        Mistake("your output's heads are read back in groups, but the query heads were stacked "
                "tiled: each group's stack holds the wrong query heads",
                _grouped_with(tiled_queries=True, tiled_output=False)),
    ),
))


# --- ch07.kv_cache_bytes --------------------------------------------------------------------------

def _head_dim(config):
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _kv_heads(config):
    return config.get("num_key_value_heads") or config["num_attention_heads"]


def kv_cache_bytes_reference(config, seq_len, batch_size=1, bytes_per_element=2):
    """2 (K and V) · layers · batch · KV heads · head dim · tokens · bytes per element."""
    return (2 * config["num_hidden_layers"] * batch_size * _kv_heads(config) * _head_dim(config)
            * seq_len * bytes_per_element)


def _bytes_with(*, factor=2, heads=_kv_heads, head_dim=_head_dim, layers=True, batch=True,
                element=None):
    def fn(config, seq_len, batch_size=1, bytes_per_element=2):
        return (factor * (config["num_hidden_layers"] if layers else 1)
                * (batch_size if batch else 1) * heads(config) * head_dim(config) * seq_len
                * (bytes_per_element if element is None else element))
    return fn


def _expect_count(actual, expected, case=None):
    number = as_number(actual)
    if number is None:
        raise AssertionError(f"your answer should be a number (an int of bytes), got "
                             f"{type(actual).__name__}")
    if number != expected:  # too large or too small, never by what factor (see count_questions)
        raise AssertionError(f"your answer is too {'large' if number > expected else 'small'}")


LLAMA3_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
             "num_key_value_heads": 8}


def _bytes_cases():
    yield Case("Llama-3-8B's config (GQA, 8 KV heads), 1000 tokens, bf16", (LLAMA3_8B, 1000),
               hint="per token and per layer the cache holds a key AND a value for each KV head")
    yield Case("the same, 4 sequences of 512 tokens in an 8-bit cache (1 byte a number)",
               (LLAMA3_8B, 512), {"batch_size": 4, "bytes_per_element": 1},
               hint="every sequence of the batch has its own cache, and bytes_per_element says "
                    "how large one number is")
    yield Case("an MHA config without num_key_value_heads (it then equals num_attention_heads)",
               ({"hidden_size": 2048, "num_attention_heads": 16, "num_hidden_layers": 24}, 300),
               hint="Hugging Face configs leave num_key_value_heads out for MHA: then every query "
                    "head has its own KV head")
    yield Case("a config with head_dim given (not hidden_size / heads), MQA",
               ({"hidden_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 1,
                 "head_dim": 256, "num_hidden_layers": 28}, 2048),
               hint="when the config gives head_dim, use it; it need not be hidden_size / heads")
    yield Case("Falcon-7B-like MQA: 71 heads of 64, one KV head, 32 layers, 1 token",
               ({"hidden_size": 4544, "num_attention_heads": 71, "num_key_value_heads": 1,
                 "num_hidden_layers": 32}, 1),
               hint="one KV head for all 71 query heads: count the heads that are cached")


register(Exercise(
    key="ch07.kv_cache_bytes", function="kv_cache_bytes", reference=kv_cache_bytes_reference,
    task="implement",
    ops=ELEMENTARY,
    cases=_bytes_cases, compare=_expect_count, banned=("course_attn",),
    mistakes=(
        Mistake("you forgot the factor 2: the cache holds the keys and the values",
                _bytes_with(factor=1)),
        Mistake("you counted the query heads: the cache holds only the KV heads",
                _bytes_with(heads=lambda c: c["num_attention_heads"])),
        Mistake("you counted one layer: every layer has its own cache",
                _bytes_with(layers=False)),
        Mistake("you forgot the batch: every sequence has its own cache",
                _bytes_with(batch=False)),
        Mistake("you fixed the size of a number at 2 bytes: use bytes_per_element",
                _bytes_with(element=2)),
        Mistake("you ignored the config's head_dim: when it is given, it is the head dimension",
                _bytes_with(head_dim=lambda c: c["hidden_size"] // c["num_attention_heads"])),
    ),
))


# --- ch07.cache_questions: derive, as a function of the model's sizes ---------------------------

QUESTIONS = {
    "kv_head": (
        "(a) the KV head that query head `query_head` reads",
        "the query heads are split into kv_heads groups of consecutive heads; count which group "
        "query_head falls in (heads count from 0)"),
    "tokens_that_fit": (
        "(b) the tokens whose keys and values fit in `cache_gib` GiB",
        "divide the memory by the bytes one token takes in every layer: a key and a value per "
        "KV head"),
    "mla_saving": (
        "(c) how many times smaller MLA's cache is than MHA's with the same heads",
        "MHA caches a key and a value per head per token and layer; MLA caches one latent and "
        "one shared RoPE key"),
}

GIB = 2 ** 30

# Public sizes, none of which lets a typical mistake give the right answer somewhere it must be
# caught: Llama-3-8B (GQA, 8 KV heads, bf16) with DeepSeek-V2's MLA sizes in place of its cache;
# DeepSeek-V2's own 128 heads of 128, cached as MHA would cache them (the chapter's question
# (c)); a Falcon-7B-like MQA model (71 heads of 64, one KV head) with a float32 cache.
LLAMA3_8B_SIZES = dict(layers=32, heads=32, kv_heads=8, head_dim=128, bytes_per_element=2,
                       query_head=13, cache_gib=16, latent_dim=512, rope_dim=64)
DEEPSEEK_V2_AS_MHA_SIZES = dict(layers=60, heads=128, kv_heads=128, head_dim=128,
                                bytes_per_element=2, query_head=100, cache_gib=80, latent_dim=512,
                                rope_dim=64)
FALCON_LIKE_MQA_SIZES = dict(layers=32, heads=71, kv_heads=1, head_dim=64, bytes_per_element=4,
                             query_head=70, cache_gib=24, latent_dim=256, rope_dim=32)
CACHE_SIZES = (LLAMA3_8B_SIZES, DEEPSEEK_V2_AS_MHA_SIZES, FALCON_LIKE_MQA_SIZES)


def _kv_head(query_head, heads, kv_heads, *, tiled=False, wrong_way=False):
    if tiled:
        return query_head % kv_heads
    return query_head // (kv_heads if wrong_way else heads // kv_heads)


def _tokens_in(cache_gib, layers, kv_heads, head_dim, bytes_per_element, *, factor=2,
               gib=GIB):
    return cache_gib * gib // (factor * layers * kv_heads * head_dim * bytes_per_element)


def _mla_saving(heads, head_dim, latent_dim, rope_dim, *, factor=2, with_rope=True):
    return factor * heads * head_dim / (latent_dim + (rope_dim if with_rope else 0))


def cache_questions_reference(layers, heads, kv_heads, head_dim, bytes_per_element, query_head,
                              cache_gib, latent_dim, rope_dim):
    """(a) query_head // (heads / kv_heads); (b) cache_gib · 2³⁰ over the bytes of a token,
    2 · layers · kv_heads · head_dim · bytes_per_element, rounded down; (c) 2 · heads · head_dim
    over latent_dim + rope_dim."""
    return {"kv_head": _kv_head(query_head, heads, kv_heads),
            "tokens_that_fit": _tokens_in(cache_gib, layers, kv_heads, head_dim,
                                          bytes_per_element),
            "mla_saving": _mla_saving(heads, head_dim, latent_dim, rope_dim)}


def _same_number(actual, expected) -> bool:
    actual = as_number(actual)
    return actual is not None and math.isclose(actual, expected, rel_tol=1e-3, abs_tol=1e-6)


ANSWERS = Questions(QUESTIONS, same=lambda key, actual, expected: _same_number(actual, expected),
                    wrong=lambda key, actual, expected: f"your answer {key!r} is not the one "
                                                        "the formula gives")


def _answering(key, wrong):
    """A typical wrong answer: the right answers, with the one of ``key`` computed by
    ``wrong(sizes)`` (``sizes``: the keyword arguments, as a dict)."""
    return answers_changed(cache_questions_reference, {key: lambda **sizes: wrong(sizes)})


register(Exercise(
    key="ch07.cache_questions", function="cache_questions", reference=cache_questions_reference,
    task="derive",
    ops=NONE,
    cases=lambda: ANSWERS.cases(*CACHE_SIZES), compare=ANSWERS.compare, banned=("course_attn",),
    mistakes=(
        Mistake("you tiled the heads (head h reads KV head h % Hkv): the query heads of one "
                "group are consecutive",
                _answering("kv_head", lambda s: _kv_head(s["query_head"], s["heads"],
                                                         s["kv_heads"], tiled=True))),
        Mistake("you divided by the group size the wrong way round: there are Hkv groups of "
                "H / Hkv heads each",
                _answering("kv_head", lambda s: _kv_head(s["query_head"], s["heads"],
                                                         s["kv_heads"], wrong_way=True))),
        Mistake("you counted the query heads: only the KV heads are cached",
                _answering("tokens_that_fit", lambda s: _tokens_in(
                    s["cache_gib"], s["layers"], s["heads"], s["head_dim"],
                    s["bytes_per_element"]))),
        Mistake("you forgot the factor 2: the cache holds the keys and the values",
                _answering("tokens_that_fit", lambda s: _tokens_in(
                    s["cache_gib"], s["layers"], s["kv_heads"], s["head_dim"],
                    s["bytes_per_element"], factor=1))),
        Mistake("you took 4 bytes a number, float32's size: a number of this cache takes "
                "bytes_per_element bytes",
                _answering("tokens_that_fit", lambda s: _tokens_in(
                    s["cache_gib"], s["layers"], s["kv_heads"], s["head_dim"], 4))),
        Mistake("a GiB is 2³⁰ bytes, not 10⁹",
                _answering("tokens_that_fit", lambda s: _tokens_in(
                    s["cache_gib"], s["layers"], s["kv_heads"], s["head_dim"],
                    s["bytes_per_element"], gib=10 ** 9))),
        Mistake("you forgot the decoupled RoPE key: MLA caches it beside the latent",
                _answering("mla_saving", lambda s: _mla_saving(
                    s["heads"], s["head_dim"], s["latent_dim"], s["rope_dim"],
                    with_rope=False))),
        Mistake("you forgot the factor 2 of MHA: it caches a key and a value per head",
                _answering("mla_saving", lambda s: _mla_saving(
                    s["heads"], s["head_dim"], s["latent_dim"], s["rope_dim"], factor=1))),
    ),
))


# --- ch07.copy_predictions: a view or a copy? ----------------------------------------------------
# The chapter says repeat_kv's expand is a view and its reshape copies. The reshape copies only
# when it must: it returns a view whenever one stride can walk each merged axis, and merging the
# KV heads' axis (stride T·D) with the copies' axis (stride 0) needs two, unless one of them has
# size 1. So repeat_kv copies for GQA, and makes no copy for MQA (one KV head) or when n_rep = 1.
# Tensor.repeat always allocates. The reference runs the three on a float32 tensor of the sizes
# and compares storages.

VIEW_OPTIONS = ("view", "copy")

COPY_QUESTIONS = {
    "expand": (
        "(a) x[:, :, None].expand(B, Hkv, n_rep, T, D): a view or a copy?",
        "expand gives the new axis a stride; think of which stride repeats the same numbers"),
    "repeat_kv": (
        "(b) that expanded tensor .reshape(B, Hkv·n_rep, T, D): a view or a copy?",
        "reshape returns a view when the merged axes can be walked with one stride"),
    "repeat": (
        "(c) x.repeat(1, n_rep, 1, 1): a view or a copy?",
        "Tensor.repeat's documentation says what it returns; a view needs no new memory"),
    "new_bytes": (
        "(d) the bytes of new memory (b) allocates, x float32",
        "a view allocates nothing; a copy holds every number of its result"),
}


def _shares(result, x):
    return result.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def copy_predictions_reference(batch, kv_heads, n_rep, seq_len, head_dim):
    """What torch does, run on a float32 x (batch, kv_heads, seq_len, head_dim)."""
    x = torch.zeros(batch, kv_heads, seq_len, head_dim)
    expanded = x[:, :, None].expand(batch, kv_heads, n_rep, seq_len, head_dim)
    repeated = expanded.reshape(batch, kv_heads * n_rep, seq_len, head_dim)
    tiled = x.repeat(1, n_rep, 1, 1)

    def kind(result):
        return "view" if _shares(result, x) else "copy"
    return {"expand": kind(expanded), "repeat_kv": kind(repeated), "repeat": kind(tiled),
            "new_bytes": 0 if _shares(repeated, x) else repeated.numel() * 4}


def _same_copy(key, actual, expected) -> bool:
    if key == "new_bytes":
        number = as_number(actual)
        return number is not None and number == expected
    return isinstance(actual, str) and actual.strip() == expected


def _wrong_copy(key, actual, expected) -> str:
    if key == "new_bytes":
        number = as_number(actual)
        if number is None:
            return f"your answer {key!r} should be a number, got {type(actual).__name__}"
        return f"your {key!r} is too {'large' if number > expected else 'small'}"
    if not (isinstance(actual, str) and actual.strip() in VIEW_OPTIONS):
        return f"your answer {key!r} should be one of {', '.join(map(repr, VIEW_OPTIONS))}"
    return f"your answer {key!r} is not what torch does"


COPIES = Questions(COPY_QUESTIONS, same=_same_copy, wrong=_wrong_copy)

# The chapter's sizes (H = 8 query heads on Hkv = 2, T = 5, D = 4), MQA (Falcon-like, one KV
# head for 8 query heads) and MHA (n_rep = 1).
PUBLIC_COPIES = (
    dict(batch=1, kv_heads=2, n_rep=4, seq_len=5, head_dim=4),
    dict(batch=2, kv_heads=1, n_rep=8, seq_len=6, head_dim=16),
    dict(batch=2, kv_heads=4, n_rep=1, seq_len=3, head_dim=8),
)


def _copying(key, answer):
    """A typical wrong prediction: the right answers, with ``key`` answered by
    ``answer(sizes, right)``."""
    def fn(batch, kv_heads, n_rep, seq_len, head_dim):
        sizes = dict(batch=batch, kv_heads=kv_heads, n_rep=n_rep, seq_len=seq_len,
                     head_dim=head_dim)
        right = copy_predictions_reference(**sizes)
        return {**right, key: answer(sizes, right)}
    return fn


def _result_bytes(s):
    return 4 * s["batch"] * s["kv_heads"] * s["n_rep"] * s["seq_len"] * s["head_dim"]


register(Exercise(
    key="ch07.copy_predictions", function="copy_predictions",
    reference=copy_predictions_reference,
    task="predict",
    ops=NONE,
    cases=lambda: COPIES.cases(*PUBLIC_COPIES), compare=COPIES.compare,
    # Predicted by hand: no tensor made to look at its storage.
    banned=("course_attn", "torch.tensor", "torch.as_tensor", "torch.randn", "torch.rand",
            "torch.zeros", "torch.ones", "torch.empty", "torch.arange", "torch.full"),
    mistakes=(
        Mistake("expand never copies: it gives the new axis stride 0, so every copy is the same "
                "memory", _copying("expand", lambda s, right: "copy")),
        Mistake("you took reshape to copy whatever the sizes: it returns a view whenever one "
                "stride can walk each merged axis, as it can when one of the two merged axes "
                "has size 1", _copying("repeat_kv", lambda s, right: "copy")),
        Mistake("you took reshape to return a view whatever the sizes: merging the KV heads' "
                "axis with the stride-0 axis of the copies needs two strides when both are "
                "longer than 1, so reshape must copy",
                _copying("repeat_kv", lambda s, right: "view")),
        Mistake("Tensor.repeat always allocates new memory and copies into it, even when it "
                "repeats once", _copying("repeat", lambda s, right: "view")),
        Mistake("you counted the bytes of a copy where the reshape returns a view: a view "
                "allocates nothing",
                _copying("new_bytes", lambda s, right: _result_bytes(s))),
        Mistake("you counted the bytes of x, not of the result: the copy holds every one of the "
                "Hkv·n_rep heads",
                _copying("new_bytes", lambda s, right: right["new_bytes"] // s["n_rep"])),
        Mistake("you counted 2 bytes a number: x is float32, 4 bytes a number",
                _copying("new_bytes", lambda s, right: right["new_bytes"] // 2)),
    ),
))
