"""Hidden cases of chapter 7: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md).

Every generator names its regimes (``@hidden(key, regimes=...)``, predicates on a case) and
draws a case inside each of them on every seed, the sizes drawn at random inside the regime."""

import torch

from course_attn.grading.cases import randint, randn
from course_attn.grading.ch07 import ANSWERS, COPIES
from course_attn.grading.exercise import Case, hidden


def _dtype(dtype):
    return lambda case: case.args[0].dtype == dtype


# --- repeat_kv: x (B, Hkv, T, D), n_rep ------------------------------------------------------
# Tiled heads are right when Hkv = 1 or n_rep = 1; every other typical mistake has the wrong
# shape when n_rep > 1. The GQA cases (Hkv >= 2, n_rep >= 2) catch all of them on every seed.

def _kv(case):
    return case.args[0].shape


@hidden("ch07.repeat_kv", regimes={
    "GQA: Hkv > 1, n_rep > 1": lambda case: _kv(case)[1] > 1 and case.args[1] > 1,
    "MQA: Hkv = 1, n_rep > 1": lambda case: _kv(case)[1] == 1 and case.args[1] > 1,
    "MHA: n_rep = 1 (x unchanged)": lambda case: case.args[1] == 1,
    "T = 1 (one decode step)": lambda case: _kv(case)[2] == 1,
    "B = 1": lambda case: _kv(case)[0] == 1,
    "B > 1": lambda case: _kv(case)[0] > 1,
    "float32": _dtype(torch.float32),
    "float64": _dtype(torch.float64),
}, central=("GQA: Hkv > 1, n_rep > 1",))
def _(gen):
    b, hkv, t, d = randint(2, 3, gen), randint(2, 4, gen), randint(2, 6, gen), randint(2, 8, gen)
    n_rep = randint(2, 4, gen)
    yield Case(f"x ({b}, {hkv}, {t}, {d}), n_rep={n_rep}", (randn(b, hkv, t, d, seed=gen), n_rep))
    t, d, n_rep = randint(1, 6, gen), randint(2, 8, gen), randint(2, 5, gen)
    yield Case(f"x (1, 1, {t}, {d}) float64, n_rep={n_rep}",
               (randn(1, 1, t, d, seed=gen, dtype=torch.float64), n_rep))
    b, hkv, t, d = randint(1, 3, gen), randint(1, 4, gen), randint(1, 6, gen), randint(2, 8, gen)
    yield Case(f"x ({b}, {hkv}, {t}, {d}), n_rep=1", (randn(b, hkv, t, d, seed=gen), 1))
    b, hkv, d = randint(1, 3, gen), randint(2, 4, gen), randint(2, 8, gen)
    n_rep = randint(2, 4, gen)
    yield Case(f"x ({b}, {hkv}, 1, {d}) float64, n_rep={n_rep}",
               (randn(b, hkv, 1, d, seed=gen, dtype=torch.float64), n_rep))


# --- gqa_attention: q (B, H, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv), is_causal ------------
# The checks use is_causal with Tq = Tk only (the notebook says so). Tiled KV heads (for the
# keys and values, or the values only) are right when Hkv = 1 or H = Hkv, every query head on
# KV head 0 when Hkv = 1, no scale when D = 1. The first case (Hkv >= 2, groups of 2..4,
# D >= 2, T >= 2) catches every typical mistake on every seed.

def _heads(case):
    return case.args[0].shape[1], case.args[1].shape[1]


def _lengths(case):
    return case.args[0].shape[2], case.args[1].shape[2]


def _causal(case):
    return bool(case.kwargs.get("is_causal", False))


@hidden("ch07.gqa_attention", regimes={
    "GQA: 1 < Hkv < H": lambda case: 1 < _heads(case)[1] < _heads(case)[0],
    "MQA: Hkv = 1 < H": lambda case: _heads(case)[1] == 1 < _heads(case)[0],
    "MHA: Hkv = H > 1": lambda case: 1 < _heads(case)[1] == _heads(case)[0],
    "causal, Tq = Tk": _causal,
    "Tq < Tk (not causal)":
        lambda case: not _causal(case) and _lengths(case)[0] < _lengths(case)[1],
    "Tq > Tk (not causal)":
        lambda case: not _causal(case) and _lengths(case)[0] > _lengths(case)[1],
    "Tq = 1 (one query)": lambda case: _lengths(case)[0] == 1,
    "Dv != D": lambda case: case.args[0].shape[3] != case.args[2].shape[3],
    "float32": _dtype(torch.float32),
    "float64": _dtype(torch.float64),
})
def _(gen):
    def attention(b, h, hkv, tq, tk, d, dv, dtype):
        q = randn(b, h, tq, d, seed=gen, dtype=dtype, scale=2.0)
        k = randn(b, hkv, tk, d, seed=gen, dtype=dtype, scale=2.0)
        return q, k, randn(b, hkv, tk, dv, seed=gen, dtype=dtype)

    b, hkv, n_rep = randint(1, 2, gen), randint(2, 3, gen), randint(2, 4, gen)
    t, d = randint(2, 7, gen), randint(2, 10, gen)
    yield Case(f"float64, causal, B={b}, H={hkv * n_rep}, Hkv={hkv}, T={t}, D={d}",
               attention(b, hkv * n_rep, hkv, t, t, d, d, torch.float64), {"is_causal": True})
    hkv, n_rep = randint(2, 3, gen), randint(2, 3, gen)
    tk, d = randint(3, 9, gen), randint(2, 8, gen)
    tq, dv = randint(2, tk - 1, gen), randint(1, 5, gen)
    dv += dv >= d                                                  # 1..6, never D
    yield Case(f"H={hkv * n_rep}, Hkv={hkv}, Tq={tq} < Tk={tk}, D={d}, Dv={dv}, float32",
               attention(1, hkv * n_rep, hkv, tq, tk, d, dv, torch.float32))
    h, tq, d = randint(2, 6, gen), randint(3, 8, gen), randint(2, 8, gen)
    tk = randint(1, tq - 1, gen)
    yield Case(f"MQA: H={h}, Tq={tq} > Tk={tk}, D={d}, float32",
               attention(2, h, 1, tq, tk, d, d, torch.float32))
    h, t, d = randint(2, 4, gen), randint(2, 6, gen), randint(2, 8, gen)
    yield Case(f"MHA: H=Hkv={h}, T={t}, D={d}, float64",
               attention(1, h, h, t, t, d, d, torch.float64))
    hkv, n_rep = randint(1, 3, gen), randint(2, 4, gen)
    tk, d = randint(1, 9, gen), randint(2, 8, gen)
    yield Case(f"one query: H={hkv * n_rep}, Hkv={hkv}, Tk={tk}, D={d}, float32",
               attention(randint(1, 2, gen), hkv * n_rep, hkv, 1, tk, d, d, torch.float32))


# --- kv_cache_bytes: config, seq_len, batch_size, bytes_per_element -------------------------------
# The query heads counted are right when KV heads = heads; one layer never (12..80 layers); the
# batch forgotten only with batch_size > 1; 2 bytes fixed only with another size; the config's
# head_dim ignored only where it is not hidden_size / heads. Each is kept by its case.

def _config(case):
    return case.args[0]


def _kv_heads(config):
    return config.get("num_key_value_heads", config["num_attention_heads"])


@hidden("ch07.kv_cache_bytes", regimes={
    "GQA: 1 < KV heads < heads":
        lambda case: 1 < _kv_heads(_config(case)) < _config(case)["num_attention_heads"],
    "MQA: one KV head": lambda case: _kv_heads(_config(case)) == 1,
    "MHA: no num_key_value_heads in the config":
        lambda case: "num_key_value_heads" not in _config(case),
    "head_dim given, not hidden_size / heads": lambda case: "head_dim" in _config(case)
        and _config(case)["head_dim"] != _config(case)["hidden_size"]
        // _config(case)["num_attention_heads"],
    "batch_size > 1": lambda case: case.kwargs.get("batch_size", 1) > 1,
    "1 byte a number (an 8-bit cache)": lambda case: case.kwargs.get("bytes_per_element") == 1,
    "4 bytes a number (float32)": lambda case: case.kwargs.get("bytes_per_element") == 4,
    "the defaults: one sequence, 2 bytes a number": lambda case: not case.kwargs,
    "seq_len = 1 (one token)": lambda case: case.args[1] == 1,
})
def _(gen):
    heads = 8 * randint(2, 8, gen)
    kv_heads = heads // 2 ** randint(1, 3, gen)
    layers, tokens = randint(12, 80, gen), randint(2, 5000, gen)
    config = {"hidden_size": 128 * heads, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "num_hidden_layers": layers}
    batch = randint(2, 8, gen)
    yield Case(f"GQA, {heads} heads, {kv_heads} KV heads, {layers} layers, {tokens} tokens, "
               f"batch {batch}, 1 byte", (config, tokens),
               {"batch_size": batch, "bytes_per_element": 1})
    yield Case("the same config with its head_dim given, 4 bytes",
               ({**config, "head_dim": 64 * randint(1, 3, gen) + 32}, tokens),
               {"bytes_per_element": 4})
    mha = {k: v for k, v in config.items() if k != "num_key_value_heads"}
    yield Case(f"MHA (no num_key_value_heads), {heads} heads, {layers} layers", (mha, tokens))
    heads, layers = randint(4, 96, gen), randint(12, 80, gen)
    mqa = {"hidden_size": 64 * heads, "num_attention_heads": heads, "num_key_value_heads": 1,
           "num_hidden_layers": layers}
    batch, element = randint(1, 8, gen), (1, 2, 4)[randint(0, 2, gen)]
    yield Case(f"MQA, {heads} heads, {layers} layers, 1 token, batch {batch}, {element} bytes",
               (mqa, 1), {"batch_size": batch, "bytes_per_element": element})


# ch07.cache_questions: one model of each regime on every seed, its sizes drawn inside it.
#   GQA: 2 <= kv_heads <= 8 KV heads, groups of g = heads / kv_heads >= 2 query heads with
#        g != kv_heads (else dividing the wrong way round would be right), query_head drawn
#        among the heads where neither tiling nor the wrong way round gives its KV head, and a
#        cache of 1 or 2 bytes a number (fp8, bf16/fp16: float32's 4 bytes would be wrong);
#   MQA: one KV head for 4..96 query heads, 1, 2 or 4 bytes a number;
#   MHA: as many KV heads as query heads (4..64), 1, 2 or 4 bytes a number.
# In MQA and MHA query_head >= 1 (query head 0 reads KV head 0 whichever way one divides). The
# memory is large enough that at least a few thousand tokens fit, so the 7% between 2³⁰ and
# 10⁹ bytes a GiB always shows; MLA's latent and RoPE key are drawn in every regime.

def _mla(gen):
    return dict(latent_dim=64 * randint(2, 10, gen), rope_dim=16 * randint(1, 6, gen))


@hidden("ch07.cache_questions", regimes={
    "GQA: 1 < kv_heads < heads": lambda case: 1 < case.kwargs["kv_heads"] < case.kwargs["heads"],
    "MQA: one KV head": lambda case: case.kwargs["kv_heads"] == 1,
    "MHA: kv_heads = heads": lambda case: case.kwargs["kv_heads"] == case.kwargs["heads"],
})
def _(gen):
    kv_heads = randint(2, 8, gen)
    group = randint(2, 7, gen)
    group += group >= kv_heads                                  # 2..8, never kv_heads
    heads = kv_heads * group
    telling = [h for h in range(heads)
               if h % kv_heads != h // group and h // kv_heads != h // group]
    gqa = dict(layers=randint(8, 96, gen), heads=heads, kv_heads=kv_heads,
               head_dim=32 * randint(2, 8, gen), bytes_per_element=randint(1, 2, gen),
               query_head=telling[randint(0, len(telling) - 1, gen)],
               cache_gib=randint(4, 192, gen), **_mla(gen))
    heads = randint(4, 96, gen)
    mqa = dict(layers=randint(8, 96, gen), heads=heads, kv_heads=1,
               head_dim=32 * randint(2, 8, gen), bytes_per_element=(1, 2, 4)[randint(0, 2, gen)],
               query_head=randint(1, heads - 1, gen), cache_gib=randint(4, 192, gen),
               **_mla(gen))
    heads = randint(4, 64, gen)
    mha = dict(layers=randint(8, 64, gen), heads=heads, kv_heads=heads,
               head_dim=32 * randint(2, 4, gen), bytes_per_element=(1, 2, 4)[randint(0, 2, gen)],
               query_head=randint(1, heads - 1, gen), cache_gib=randint(32, 192, gen),
               **_mla(gen))
    yield from ANSWERS.cases(gqa, mqa, mha)


# --- grouped_attention: q (B, H, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv) --------------------
# Tiled groups are right for MQA and MHA only; both GQA regimes catch them on every seed: groups
# as many as the KV heads (H / Hkv = Hkv, where a repair that fixes the queries' split but not
# the broadcast of K and V runs and gives the tiled answer) and groups of another size (where
# that half-repair raises).

def _group_sizes(case):
    h, hkv = case.args[0].shape[1], case.args[1].shape[1]
    return h, hkv, h // hkv


@hidden("ch07.grouped_attention", regimes={
    "GQA, groups of Hkv heads (H = Hkv²)":
        lambda case: 1 < _group_sizes(case)[1] == _group_sizes(case)[2],
    "GQA, groups of another size":
        lambda case: 1 < _group_sizes(case)[1] != _group_sizes(case)[2] > 1,
    "MQA: Hkv = 1 < H": lambda case: _group_sizes(case)[1] == 1 < _group_sizes(case)[0],
    "MHA: Hkv = H > 1": lambda case: 1 < _group_sizes(case)[1] == _group_sizes(case)[0],
    "Dv != D": lambda case: case.args[0].shape[3] != case.args[2].shape[3],
    "float32": _dtype(torch.float32),
    "float64": _dtype(torch.float64),
})
def _(gen):
    def attention(b, h, hkv, tq, tk, d, dv, dtype):
        q = randn(b, h, tq, d, seed=gen, dtype=dtype, scale=2.0)
        k = randn(b, hkv, tk, d, seed=gen, dtype=dtype, scale=2.0)
        return q, k, randn(b, hkv, tk, dv, seed=gen, dtype=dtype)

    hkv = randint(2, 3, gen)
    tq, tk, d = randint(2, 6, gen), randint(2, 6, gen), randint(2, 8, gen)
    yield Case(f"H={hkv * hkv}, Hkv={hkv}, Tq={tq}, Tk={tk}, D={d}, float32",
               attention(randint(1, 2, gen), hkv * hkv, hkv, tq, tk, d, d, torch.float32))
    hkv, group = randint(2, 4, gen), randint(2, 3, gen)
    group += group >= hkv                                          # 2..4, never hkv
    t, d, dv = randint(2, 6, gen), randint(2, 8, gen), randint(1, 5, gen)
    dv += dv >= d                                                  # never D
    yield Case(f"H={hkv * group}, Hkv={hkv}, T={t}, D={d}, Dv={dv}, float64",
               attention(1, hkv * group, hkv, t, t, d, dv, torch.float64))
    h, t, d = randint(2, 6, gen), randint(2, 6, gen), randint(2, 8, gen)
    yield Case(f"MQA: H={h}, T={t}, D={d}", attention(2, h, 1, t, t, d, d, torch.float32))
    h, t, d = randint(2, 4, gen), randint(2, 6, gen), randint(2, 8, gen)
    yield Case(f"MHA: H=Hkv={h}, T={t}, D={d}, float64",
               attention(1, h, h, t, t, d, d, torch.float64))


# --- copy_predictions: batch, kv_heads, n_rep, seq_len, head_dim ----------------------------------
# One set of sizes in each regime on every seed: GQA (the reshape copies), MQA (it makes a view
# of the one KV head) and MHA (n_rep = 1, a view). Small sizes: the reference makes the tensors.

@hidden("ch07.copy_predictions", regimes={
    "GQA: Hkv > 1, n_rep > 1":
        lambda case: case.kwargs["kv_heads"] > 1 and case.kwargs["n_rep"] > 1,
    "MQA: one KV head, n_rep > 1":
        lambda case: case.kwargs["kv_heads"] == 1 and case.kwargs["n_rep"] > 1,
    "MHA: n_rep = 1": lambda case: case.kwargs["n_rep"] == 1,
})
def _(gen):
    def sizes(kv_heads, n_rep):
        return dict(batch=randint(1, 4, gen), kv_heads=kv_heads, n_rep=n_rep,
                    seq_len=randint(1, 64, gen), head_dim=8 * randint(1, 16, gen))
    yield from COPIES.cases(sizes(randint(2, 8, gen), randint(2, 8, gen)),
                            sizes(1, randint(2, 16, gen)), sizes(randint(2, 16, gen), 1))
