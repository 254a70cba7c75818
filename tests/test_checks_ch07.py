"""Chapter 7's exercises: each typical mistake fails the case meant for it with its own hint, and a
banned call is reported by name. What every exercise must satisfy (the reference and the
solution pass public and hidden cases, a stub is "not answered yet", every declared mistake
names itself) is tested once, for all chapters, in test_exercises_conformance.py.

The wrong solutions below are written as a student would write them; each test names the case
it must fail and a fragment of the hint it must get.
"""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import course_attn
from course_attn.grading import get, run_exercise
from course_attn.grading.exercise import hidden_cases, load_hidden

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from check_support import assert_banned, assert_fails  # noqa: E402

load_hidden(Path(__file__).resolve().parents[1] / "solutions")


# --- solutions as in solutions/07_mqa_gqa.ipynb ---------------------------------------------------

def repeat_kv(x, n_rep):
    b, hkv, t, d = x.shape
    return x[:, :, None].expand(b, hkv, n_rep, t, d).reshape(b, hkv * n_rep, t, d)


def attend(q, k, v, is_causal=False, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if is_causal:
        tq, tk = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq),
                                    float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def gqa_attention(q, k, v, is_causal=False):
    n_rep = q.shape[1] // k.shape[1]
    return attend(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal)


def kv_cache_bytes(config, seq_len, batch_size=1, bytes_per_element=2):
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim", config["hidden_size"] // heads)
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * bytes_per_element * seq_len \
        * batch_size


def cache_questions():
    return {"kv_head_of_query_13": 3, "tokens_in_16_gib": 131072,
            "mla_saving_deepseek_v2": 2 * 128 * 128 / 576}


SOLUTIONS = [("ch07.repeat_kv", repeat_kv), ("ch07.gqa_attention", gqa_attention),
             ("ch07.kv_cache_bytes", kv_cache_bytes), ("ch07.cache_questions", cache_questions)]


@pytest.mark.parametrize("key, fn", SOLUTIONS)
def test_the_notebooks_solutions_pass_with_the_watch_on(key, fn):
    for cases in [None] + [hidden_cases(key, seed) or None for seed in range(5)]:
        judgement = run_exercise(get(key), fn, cases)
        assert judgement.passed, (judgement.banned, [(r.name, r.message) for r in
                                                     judgement.results if not r.passed])


def test_the_references_agree_with_pytorch_and_the_cache():
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    torch.testing.assert_close(get("ch07.repeat_kv").reference(x, 2),
                               x.repeat_interleave(2, dim=1))
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    torch.testing.assert_close(get("ch07.gqa_attention").reference(q, k, v, is_causal=True),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                              enable_gqa=True))
    config = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
              "num_hidden_layers": 3}
    cache = course_attn.KVCache(4, 2, 10, 32, dtype=torch.float16)
    assert get("ch07.kv_cache_bytes").reference(config, 10, 4, 2) == 3 * cache.nbytes


# --- repeat_kv ---------------------------------------------------------------------------------

def test_repeat_kv_mistakes():
    key, first = "ch07.repeat_kv", "x (2, 2, 5, 4), n_rep=3 (6 query heads, 2 KV heads)"
    assert_fails(key, lambda x, n_rep: x.repeat(1, n_rep, 1, 1), first, hint="tiled the heads")
    # tiling written with expand: the new axis before the heads
    assert_fails(key, lambda x, n_rep: x[:, None].expand(
        x.shape[0], n_rep, *x.shape[1:]).reshape(x.shape[0], -1, *x.shape[2:]), first,
        hint="tiled the heads")
    assert_fails(key, lambda x, n_rep: torch.cat([x] * n_rep, dim=2), first, hint="time axis")
    assert_fails(key, lambda x, n_rep: torch.cat([x] * n_rep, dim=0), first, hint="batch axis")
    assert_fails(key, lambda x, n_rep: x[:, :, None].expand(-1, -1, n_rep, -1, -1), first,
                 hint="never merged")
    assert_fails(key, lambda x, n_rep: repeat_kv(x, n_rep).float(),
                 "T=1 (one decode step), float64, n_rep=2", hint="dtype flow")


def test_repeat_kv_may_not_call_repeat_interleave_or_the_package():
    assert_banned("ch07.repeat_kv", lambda x, n_rep: x.repeat_interleave(n_rep, dim=1),
                  "torch.Tensor.repeat_interleave")
    assert_banned("ch07.repeat_kv", lambda x, n_rep: torch.repeat_interleave(x, n_rep, dim=1),
                  "torch.repeat_interleave")
    assert_banned("ch07.repeat_kv", course_attn.repeat_kv, "course_attn")


# --- gqa_attention -----------------------------------------------------------------------------

def test_gqa_attention_mistakes():
    key, first = "ch07.gqa_attention", "B=2, H=4 query heads, Hkv=2, T=5, D=8"

    def tiled(q, k, v, is_causal=False):
        n = q.shape[1] // k.shape[1]
        return attend(q, k.repeat(1, n, 1, 1), v.repeat(1, n, 1, 1), is_causal)

    def no_scale(q, k, v, is_causal=False):
        n = q.shape[1] // k.shape[1]
        return attend(q, repeat_kv(k, n), repeat_kv(v, n), is_causal, scale=1.0)

    def wrong_axis(q, k, v, is_causal=False):
        k, v = (repeat_kv(t, q.shape[1] // k.shape[1]) for t in (k, v))
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-2) @ v

    def tiled_values(q, k, v, is_causal=False):
        n = q.shape[1] // k.shape[1]
        return attend(q, repeat_kv(k, n), v.repeat(1, n, 1, 1), is_causal)

    assert_fails(key, tiled, first, hint="tiled the KV heads")
    assert_fails(key, no_scale, first, hint="1/sqrt(D)")
    assert_fails(key, lambda q, k, v, is_causal=False: attend(q, k[:, :1], v[:, :1], is_causal),
                 first, hint="reads KV head 0")
    assert_fails(key, wrong_axis, first, hint="over the queries")
    assert_fails(key, tiled_values, first, hint="tiled the values")
    # the causal mask forgotten: no typical mistake, the case's own hint
    assert_fails(key, lambda q, k, v, is_causal=False: gqa_attention(q, k, v), "causal, H=4, "
                 "Hkv=2, T=5", hint="-inf above the diagonal")


def test_gqa_attention_on_mqa_and_mha_does_not_tell_tiling_apart():
    """With one KV head, or with one query head per KV head, tiling and grouping agree: the
    cases that catch tiling are those with 2 or more KV heads shared by 2 or more query heads."""
    def tiled(q, k, v, is_causal=False):
        n = q.shape[1] // k.shape[1]
        return attend(q, k.repeat(1, n, 1, 1), v.repeat(1, n, 1, 1), is_causal)
    judged = {r.name: r.passed for r in run_exercise(get("ch07.gqa_attention"), tiled).results}
    assert judged["MQA: H=4, one KV head"] and judged["MHA: H = Hkv = 3"]
    assert not judged["H=6, Hkv=2 (groups of 3), Tq=3 != Tk=7, Dv=3"]


def test_gqa_attention_may_not_call_a_library_attention():
    assert_banned("ch07.gqa_attention", lambda q, k, v, is_causal=False:
                  F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True),
                  "torch.nn.functional.scaled_dot_product_attention")
    assert_banned("ch07.gqa_attention", lambda q, k, v, is_causal=False:
                  course_attn.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                           enable_gqa=True), "course_attn")


# --- kv_cache_bytes ----------------------------------------------------------------------------

def test_kv_cache_bytes_mistakes():
    key = "ch07.kv_cache_bytes"
    llama = "Llama-3-8B's config (GQA, 8 KV heads), 1000 tokens, bf16"
    batch = "the same, 4 sequences of 512 tokens in an 8-bit cache (1 byte a number)"

    def with_(factor=2, query_heads=False, layers=True, batch_=True, element=None,
              own_head_dim=True):
        def fn(config, seq_len, batch_size=1, bytes_per_element=2):
            heads = config["num_attention_heads"]
            kv = heads if query_heads else config.get("num_key_value_heads", heads)
            d = config.get("head_dim", config["hidden_size"] // heads) if own_head_dim else \
                config["hidden_size"] // heads
            return (factor * (config["num_hidden_layers"] if layers else 1) * kv * d * seq_len
                    * (batch_size if batch_ else 1)
                    * (bytes_per_element if element is None else element))
        return fn

    assert_fails(key, with_(factor=1), llama, hint="forgot the factor 2")
    assert_fails(key, with_(query_heads=True), llama, hint="counted the query heads")
    assert_fails(key, with_(layers=False), llama, hint="one layer")
    assert_fails(key, with_(batch_=False), batch, hint="forgot the batch")
    assert_fails(key, with_(element=2), batch, hint="fixed the size")
    assert_fails(key, with_(own_head_dim=False),
                 "a config with head_dim given (not hidden_size / heads), MQA",
                 hint="ignored the config's head_dim")
    # a config read with [] where the key may be missing: the case's own hint
    assert_fails(key, lambda config, seq_len, batch_size=1, bytes_per_element=2:
                 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * 128 * seq_len
                 * batch_size * bytes_per_element,
                 "an MHA config without num_key_value_heads (it then equals "
                 "num_attention_heads)", hint="leave num_key_value_heads out",
                 message="KeyError")
    # the message says how far off, never the answer
    assert_fails(key, with_(factor=1), llama, message="0.5 times the expected")


def test_kv_cache_bytes_equals_what_a_cache_of_that_shape_allocates():
    config = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
              "num_hidden_layers": 4, "head_dim": 48}
    caches = [course_attn.KVCache(3, 2, 20, 48, dtype=torch.float32) for _ in range(4)]
    assert kv_cache_bytes(config, 20, 3, 4) == sum(c.nbytes for c in caches)
    assert run_exercise(get("ch07.kv_cache_bytes"), kv_cache_bytes).passed


def test_kv_cache_bytes_may_not_call_the_package():
    def with_the_package(config, seq_len, batch_size=1, bytes_per_element=2):
        heads = config["num_attention_heads"]
        cache = course_attn.KVCache(batch_size, config.get("num_key_value_heads", heads), seq_len,
                                    config.get("head_dim", config["hidden_size"] // heads),
                                    dtype=torch.float32 if bytes_per_element == 4
                                    else torch.float16)
        return cache.nbytes * config["num_hidden_layers"]
    assert_banned("ch07.kv_cache_bytes", with_the_package, "course_attn")


# --- cache_questions ---------------------------------------------------------------------------

def test_cache_questions_mistakes():
    key = "ch07.cache_questions"
    a, b, c = (case.name for case in get(key).public_cases())

    def answering(**wrong):
        return lambda: {**cache_questions(), **wrong}

    assert_fails(key, answering(kv_head_of_query_13=5), a, hint="tiled the heads")
    assert_fails(key, answering(kv_head_of_query_13=1), a, hint="the wrong way round")
    assert_fails(key, answering(tokens_in_16_gib=32768), b, hint="counted the query heads")
    assert_fails(key, answering(tokens_in_16_gib=262144), b, hint="forgot the factor 2")
    assert_fails(key, answering(tokens_in_16_gib=65536), b, hint="not 4")
    assert_fails(key, answering(tokens_in_16_gib=16 * 10 ** 9 // 131072), b, hint="not 10⁹")
    assert_fails(key, answering(mla_saving_deepseek_v2=64), c, hint="decoupled RoPE key")
    assert_fails(key, answering(mla_saving_deepseek_v2=128 * 128 / 576), c,
                 hint="factor 2 of MHA")
    assert_fails(key, lambda: [3, 131072, 56.9], a, message="should return a dict")


def test_cache_questions_agree_with_the_caches_they_describe():
    expected = get("ch07.cache_questions").reference()
    one_layer = course_attn.KVCache(1, 8, 1, 128, dtype=torch.bfloat16).nbytes
    assert expected["tokens_in_16_gib"] == 16 * 2 ** 30 // (32 * one_layer)
    mla = course_attn.KVCache(1, 1, 1, 512, value_dim=64, dtype=torch.bfloat16).nbytes
    mha = course_attn.KVCache(1, 128, 1, 128, dtype=torch.bfloat16).nbytes
    assert expected["mla_saving_deepseek_v2"] == pytest.approx(mha / mla)
    assert [h // 4 for h in range(32)][13] == expected["kv_head_of_query_13"]


def test_cache_questions_never_show_the_right_answer():
    key = "ch07.cache_questions"
    for result in run_exercise(get(key), lambda: {k: 12345.0 for k in
                                                  get(key).reference()}).results:
        assert not result.passed and "is not the one the formula gives" in result.message
        for answer in ("131072", "56.8", "56.9"):
            assert answer not in result.message


def test_cache_questions_may_not_call_the_package():
    def with_the_package():
        per_token = 32 * course_attn.KVCache(1, 8, 1, 128, dtype=torch.bfloat16).nbytes
        return {**cache_questions(), "tokens_in_16_gib": 16 * 2 ** 30 // per_token}
    assert_banned("ch07.cache_questions", with_the_package, "course_attn")
