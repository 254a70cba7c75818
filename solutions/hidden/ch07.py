"""Hidden cases of chapter 7: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint, randn
from course_attn.grading.ch07 import ANSWERS
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


@hidden("ch07.cache_questions")
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
