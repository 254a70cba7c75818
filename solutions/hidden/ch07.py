"""Hidden cases of chapter 7: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint, randn
from course_attn.grading.exercise import Case, hidden


@hidden("ch07.repeat_kv")
def _(gen):
    b, hkv, t, d = randint(1, 3, gen), randint(2, 4, gen), randint(1, 6, gen), randint(2, 8, gen)
    n_rep = randint(2, 4, gen)
    yield Case(f"x ({b}, {hkv}, {t}, {d}), n_rep={n_rep}", (randn(b, hkv, t, d, seed=gen), n_rep))
    yield Case(f"x ({b}, 1, {t}, {d}) float64, n_rep={n_rep + 1}",
               (randn(b, 1, t, d, seed=gen, dtype=torch.float64), n_rep + 1))


@hidden("ch07.gqa_attention")
def _(gen):
    b, hkv, n_rep = randint(1, 2, gen), randint(2, 3, gen), randint(2, 4, gen)
    t, d = randint(2, 7, gen), randint(2, 10, gen)
    h = hkv * n_rep
    q = randn(b, h, t, d, seed=gen, dtype=torch.float64, scale=2.0)
    k, v = (randn(b, hkv, t, d, seed=gen, dtype=torch.float64, scale=2.0) for _ in range(2))
    causal = bool(randint(0, 1, gen))
    yield Case(f"B={b}, H={h}, Hkv={hkv}, T={t}, D={d}, is_causal={causal}", (q, k, v),
               {"is_causal": causal})
    tk, dv = randint(2, 9, gen), randint(1, 6, gen)
    k2, v2 = randn(b, hkv, tk, d, seed=gen), randn(b, hkv, tk, dv, seed=gen)
    yield Case(f"H={h}, Hkv={hkv}, Tq={t}, Tk={tk}, Dv={dv}, float32", (q.float(), k2, v2))


@hidden("ch07.kv_cache_bytes")
def _(gen):
    heads = 8 * randint(2, 8, gen)
    kv_heads = heads // 2 ** randint(1, 3, gen)
    layers, tokens = randint(12, 80, gen), randint(1, 5000, gen)
    config = {"hidden_size": 128 * heads, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "num_hidden_layers": layers}
    batch, element = randint(2, 8, gen), (1, 2, 4)[randint(0, 2, gen)]
    yield Case(f"GQA, {heads} heads, {kv_heads} KV heads, {layers} layers, {tokens} tokens, "
               f"batch {batch}, {element} bytes",
               (config, tokens), {"batch_size": batch, "bytes_per_element": element})
    yield Case("the same config with its head_dim given, 4 bytes",
               ({**config, "head_dim": 64 * randint(1, 3, gen) + 32}, tokens),
               {"bytes_per_element": 4})
    mha = {k: v for k, v in config.items() if k != "num_key_value_heads"}
    yield Case(f"MHA (no num_key_value_heads), {heads} heads, {layers} layers", (mha, tokens))


# ch07.cache_questions has no hidden cases: it asks for fixed answers (no inputs), and its one
# public case per answer already says only whether the answer is right, never what it is.
