"""Chapter 7's exercises: each typical mistake fails the case meant for it with its own hint, and a
banned call is reported by name. What every exercise must satisfy (the reference and the
solution pass public and hidden cases, a stub is "not answered yet", every declared mistake
names itself) is tested once, for all chapters, in test_exercises_conformance.py.

The wrong solutions below are written as a student would write them; each test names the case
it must fail and a fragment of the hint it must get.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import nbformat

import course_attn
from course_attn.grading import get, run_exercise
from course_attn.grading.judge import Answer, judge_case
from course_attn.grading.exercise import hidden_cases

from check_support import assert_banned, assert_fails, assert_fails_unnamed, results
from helpers import SOLUTIONS_DIR


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


def cache_questions(layers, heads, kv_heads, head_dim, bytes_per_element, query_head, cache_gib,
                    latent_dim, rope_dim):
    kv_head = query_head // (heads // kv_heads)
    per_token = 2 * layers * kv_heads * head_dim * bytes_per_element
    return {"kv_head": kv_head, "tokens_that_fit": cache_gib * 2 ** 30 // per_token,
            "mla_saving": 2 * heads * head_dim / (latent_dim + rope_dim)}


def grouped_attention(q, k, v):
    b, h, tq, d = q.shape
    scores = q.reshape(b, k.shape[1], -1, d) @ k.transpose(-2, -1) / math.sqrt(d)
    return (scores.softmax(dim=-1) @ v).reshape(b, h, tq, -1)


def copy_predictions(batch, kv_heads, n_rep, seq_len, head_dim):
    view = kv_heads == 1 or n_rep == 1
    numbers = batch * kv_heads * n_rep * seq_len * head_dim
    return {"expand": "view", "repeat_kv": "view" if view else "copy", "repeat": "copy",
            "new_bytes": 0 if view else 4 * numbers}


SOLUTIONS = [("ch07.repeat_kv", repeat_kv), ("ch07.gqa_attention", gqa_attention),
             ("ch07.kv_cache_bytes", kv_cache_bytes), ("ch07.cache_questions", cache_questions),
             ("ch07.grouped_attention", grouped_attention),
             ("ch07.copy_predictions", copy_predictions)]


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
                 "T=1 (one decode step), float64, n_rep=2", hint="return torch.float64, not "
                 "torch.float32", message="dtype")


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
    # the causal mask forgotten: a declared mistake
    assert_fails(key, lambda q, k, v, is_causal=False: gqa_attention(q, k, v), "causal, H=4, "
                 "Hkv=2, T=5", hint="-inf above the diagonal")


def test_gqa_attention_with_the_values_unrepeated_is_named_by_its_error():
    """q @ kᵀ works, the weights' H heads then meet v's Hkv: a RuntimeError, named."""
    def values_unrepeated(q, k, v, is_causal=False):
        return attend(q, repeat_kv(k, q.shape[1] // k.shape[1]), v, is_causal)

    def keys_unrepeated(q, k, v, is_causal=False):
        return attend(q, k, repeat_kv(v, q.shape[1] // k.shape[1]), is_causal)
    first = "B=2, H=4 query heads, Hkv=2, T=5, D=8"
    for fn in (values_unrepeated, keys_unrepeated):
        assert_fails("ch07.gqa_attention", fn, first, hint="did not repeat the values",
                     message="RuntimeError")
    # with one KV head the unrepeated values broadcast, and the answer is right
    assert results("ch07.gqa_attention", values_unrepeated)["MQA: H=4, one KV head"].passed


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
    # a config read with [] where the key may be missing: the KeyError says it, no hint
    assert_fails_unnamed(key, lambda config, seq_len, batch_size=1, bytes_per_element=2:
                         2 * config["num_hidden_layers"] * config["num_key_value_heads"] * 128
                         * seq_len * batch_size * bytes_per_element,
                         "an MHA config without num_key_value_heads (it then equals "
                         "num_attention_heads)", message="KeyError")
    # the message says too large or too small, never the answer nor by what factor
    assert_fails(key, with_(factor=1), llama, message="too small")
    assert_fails(key, with_(query_heads=True), llama, message="too large")
    assert "times" not in results(key, with_(factor=1))[llama].message


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

LLAMA = dict(layers=32, heads=32, kv_heads=8, head_dim=128, bytes_per_element=2, query_head=13,
             cache_gib=16, latent_dim=512, rope_dim=64)
QUESTIONS = "ch07.cache_questions"
DTYPE_OF = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}


def test_cache_questions_public_sizes_are_the_chapters():
    cases = get(QUESTIONS).public_cases()
    assert dict(cases[0].kwargs) == LLAMA and len(cases) == 9
    assert {c.kwargs["kv_heads"] == c.kwargs["heads"] for c in cases} == {True, False}
    assert any(c.kwargs["kv_heads"] == 1 for c in cases)
    deepseek = cases[5]                                      # DeepSeek-V2's own question (c)
    assert deepseek.part == "mla_saving" and deepseek.kwargs["heads"] == 128
    assert get(QUESTIONS).expected(deepseek)["mla_saving"] == pytest.approx(2 * 128 * 128 / 576)


def test_cache_questions_mistakes():
    a, b, c = (case.name for case in get(QUESTIONS).public_cases()[:3])

    def answering(**wrong):
        return lambda **sizes: {**cache_questions(**sizes), **wrong}

    assert_fails(QUESTIONS, answering(kv_head=5), a, hint="tiled the heads")
    assert_fails(QUESTIONS, answering(kv_head=1), a, hint="the wrong way round")
    assert_fails(QUESTIONS, answering(tokens_that_fit=32768), b, hint="counted the query heads")
    assert_fails(QUESTIONS, answering(tokens_that_fit=262144), b, hint="forgot the factor 2")
    assert_fails(QUESTIONS, answering(tokens_that_fit=65536), b, hint="float32's size")
    assert_fails(QUESTIONS, answering(tokens_that_fit=16 * 10 ** 9 // 131072), b,
                 hint="not 10⁹")
    assert_fails(QUESTIONS, answering(mla_saving=2 * 32 * 128 / 512), c,
                 hint="decoupled RoPE key")
    assert_fails(QUESTIONS, answering(mla_saving=32 * 128 / 576), c, hint="factor 2 of MHA")
    assert_fails(QUESTIONS, lambda **sizes: [3, 131072, 14.2], a,
                 message="should return a dict")


def test_cache_questions_agree_with_the_caches_they_describe_on_hidden_sizes():
    """The reference, on the hidden sizes of several seeds (every regime), against the bytes
    that the package's modules allocate and the head that repeat_kv gives a query head."""
    exercise = get(QUESTIONS)
    for seed in range(5):
        sizes = {repr(dict(c.kwargs)): dict(c.kwargs) for c in hidden_cases(QUESTIONS, seed)}
        assert len(sizes) == 3
        assert sorted(s["kv_heads"] == 1 or s["kv_heads"] == s["heads"] for s in
                      sizes.values()) == [False, True, True]     # GQA, and MQA and MHA
        for s in sizes.values():
            answers = exercise.reference(**s)
            heads = torch.arange(s["kv_heads"]).view(1, -1, 1, 1)
            assert answers["kv_head"] == \
                course_attn.repeat_kv(heads, s["heads"] // s["kv_heads"])[0, s["query_head"], 0, 0]
            dtype = DTYPE_OF[s["bytes_per_element"]]
            with torch.device("meta"):
                gqa = course_attn.MultiHeadAttention(s["heads"] * s["head_dim"], s["heads"],
                                                     n_kv_heads=s["kv_heads"])
            per_token = s["layers"] * gqa.new_cache(1, 1, dtype=dtype, device="cpu").nbytes
            assert answers["tokens_that_fit"] == s["cache_gib"] * 2 ** 30 // per_token
            mla = course_attn.MultiHeadLatentAttention(8, 1, latent_dim=s["latent_dim"],
                                                       rope_dim=s["rope_dim"], max_seq_len=1)
            mha = course_attn.KVCache(1, s["heads"], 1, s["head_dim"], dtype=dtype)
            assert answers["mla_saving"] == pytest.approx(
                mha.nbytes / mla.new_cache(1, 1, dtype=dtype).nbytes, rel=1e-12)


def test_cache_questions_pasted_public_answers_fail_the_hidden_cases_of_every_seed():
    """A notebook that computed the public answers elsewhere and pasted them in: right on the
    check's cases, wrong on the grader's for every seed."""
    exercise = get(QUESTIONS)
    table = {repr(dict(c.kwargs)): exercise.reference(**c.kwargs)
             for c in exercise.public_cases()}

    def pasted(**sizes):
        return table.get(repr(sizes), table[repr(LLAMA)])
    assert run_exercise(exercise, pasted).passed
    for seed in range(20):
        judgement = run_exercise(exercise, pasted, hidden_cases(QUESTIONS, seed))
        passed = [r.name for r in judgement.results if r.passed]
        assert not judgement.passed, seed
        # the token counts fail in every regime; a small KV head number, or a ratio of small
        # sizes, may coincide with a pasted one now and then, never most of them
        assert not [name for name in passed if name.startswith("(b)")], (seed, passed)
        assert len(passed) <= len(judgement.results) // 3, (seed, passed)


def test_cache_questions_never_show_the_right_answer():
    exercise = get(QUESTIONS)
    for result in run_exercise(exercise, lambda **sizes: {k: 12345.0 for k in
                                                          exercise.reference(**LLAMA)}).results:
        assert not result.passed and "is not the one the formula gives" in result.message
        for answer in ("131072", "14.2", "56.8", "56.9", "21845", "1572864"):
            assert answer not in result.message


def test_cache_questions_may_not_call_the_package():
    def with_the_package(**sizes):
        per_token = sizes["layers"] * course_attn.KVCache(
            1, sizes["kv_heads"], 1, sizes["head_dim"], dtype=torch.bfloat16).nbytes
        return {**cache_questions(**sizes),
                "tokens_that_fit": sizes["cache_gib"] * 2 ** 30 // per_token}
    assert_banned(QUESTIONS, with_the_package, "course_attn")


# --- two parts wrong at once: each named (mistakes are matched part by part) ----------------------

def test_cache_questions_gb_for_gib_and_no_rope_key_get_both_hints():
    a, b, c = (case.name for case in get(QUESTIONS).public_cases()[:3])

    def gb_and_no_rope(**sizes):
        per_token = 2 * sizes["layers"] * sizes["kv_heads"] * sizes["head_dim"] \
            * sizes["bytes_per_element"]
        return {**cache_questions(**sizes),
                "tokens_that_fit": sizes["cache_gib"] * 10 ** 9 // per_token,
                "mla_saving": 2 * sizes["heads"] * sizes["head_dim"] / sizes["latent_dim"]}
    assert_fails(QUESTIONS, gb_and_no_rope, b, hint="not 10⁹")
    assert_fails(QUESTIONS, gb_and_no_rope, c, hint="decoupled RoPE key")
    assert results(QUESTIONS, gb_and_no_rope)[a].passed
    exercise = get(QUESTIONS)
    for seed in range(5):
        hints = {judge_case(exercise, case, exercise.expected(case),
                            Answer(value=gb_and_no_rope(**case.kwargs)), hidden=True).hint
                 for case in hidden_cases(QUESTIONS, seed) if case.part != "kv_head"}
        assert any("10⁹" in h for h in hints) and any("RoPE key" in h for h in hints), hints


# --- grouped_attention (debug) ------------------------------------------------------------------

GROUPED = "ch07.grouped_attention"
NOTEBOOK = SOLUTIONS_DIR / "07_mqa_gqa.ipynb"


def _given_namespace(capsys=None):
    for cell in nbformat.read(NOTEBOOK, as_version=4).cells:
        if cell.metadata.get("nbgrader", {}).get("grade_id") == "ch07-grouped_attention-given":
            namespace = {"torch": torch, "math": math}
            exec(cell.source, namespace)
            return cell.source, namespace
    raise KeyError("ch07-grouped_attention-given")


def test_the_given_function_is_the_graders_and_its_demonstration_shows_the_tiling(capsys):
    from course_attn.grading.ch07 import GROUPED_GIVEN
    source, namespace = _given_namespace()
    assert source.startswith(GROUPED_GIVEN)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3
    assert "[0.0, 0.0, 0.0, 0.0]" in printed[0] and "[0.0, 0.0, 0.0, 0.0]" in printed[1]
    # with H = 4 on Hkv = 2, heads 0 and 3 read the right KV head by chance, 1 and 2 do not
    gaps = printed[2].split("[")[1].rstrip("]").split(", ")
    assert [float(g) > 0 for g in gaps] == [False, True, True, False]
    # the given function reads KV head h % Hkv: a probe whose values name their KV head
    q = torch.randn(1, 6, 2, 4)
    k = torch.zeros(1, 3, 2, 4)
    v = torch.arange(3.0).view(1, 3, 1, 1).expand(1, 3, 2, 1)
    read = namespace["grouped_attention"](q, k, v)[0, :, 0, 0].tolist()
    assert read == [h % 3 for h in range(6)]
    assert grouped_attention(q, k, v)[0, :, 0, 0].tolist() == [h // 2 for h in range(6)]


def test_the_given_buggy_function_is_told_what_it_still_does_wrong():
    _, namespace = _given_namespace()
    for case in ("B=2, H=4, Hkv=2, T=5, D=8", "H=6, Hkv=2 (groups of 3), T=4, D=4"):
        assert_fails(GROUPED, namespace["grouped_attention"], case, hint="as if the KV heads")
    found = results(GROUPED, namespace["grouped_attention"])
    assert found["MQA: H=4, one KV head"].passed and found["MHA: H = Hkv = 3"].passed


def test_grouped_attention_half_repairs_are_named_by_what_they_still_tile():
    def stacked(q, k, v, tiled_queries, tiled_output):
        b, h, tq, d = q.shape
        hkv = k.shape[1]
        if tiled_queries:
            q = q.reshape(b, h // hkv, hkv, tq, d).transpose(1, 2)
        out = (q.reshape(b, hkv, -1, d) @ k.transpose(-2, -1) / math.sqrt(d)).softmax(-1) @ v
        if tiled_output:
            out = out.reshape(b, hkv, h // hkv, tq, -1).transpose(1, 2)
        return out.reshape(b, h, tq, -1)
    for case in ("B=2, H=4, Hkv=2, T=5, D=8", "H=6, Hkv=2 (groups of 3), T=4, D=4"):
        assert_fails(GROUPED, lambda q, k, v: stacked(q, k, v, False, True), case,
                     hint="put back in the tiled order")
        assert_fails(GROUPED, lambda q, k, v: stacked(q, k, v, True, False), case,
                     hint="were stacked tiled")
    assert run_exercise(get(GROUPED), lambda q, k, v: stacked(q, k, v, False, False)).passed


def test_grouped_attention_that_copies_k_and_v_scores_0_naming_the_copy():
    """Right outputs, but K and V copied: by repeat_kv's expand and reshape, by a matmul that
    broadcasts them over a group axis (the repair a student writes after chapter 4's
    broadcasting), by indexing the heads, or head by head."""
    def expand_reshape(q, k, v):
        n = q.shape[1] // k.shape[1]

        def repeat(x):
            return x[:, :, None].expand(-1, -1, n, -1, -1).flatten(1, 2)
        return attend(q, repeat(k), repeat(v))

    def broadcast(q, k, v):
        b, h, tq, d = q.shape
        q = q.reshape(b, k.shape[1], -1, tq, d)
        k, v = k[:, :, None], v[:, :, None]
        return ((q @ k.transpose(-2, -1) / math.sqrt(d)).softmax(-1) @ v).reshape(b, h, tq, -1)

    def indexed(q, k, v):
        heads = torch.arange(q.shape[1]) * k.shape[1] // q.shape[1]
        return attend(q, k[:, heads], v[:, heads])

    def per_head(q, k, v):
        n = q.shape[1] // k.shape[1]
        return torch.stack([attend(q[:, h], k[:, h // n].clone(), v[:, h // n])
                            for h in range(q.shape[1])], dim=1)

    for fn, how in ((expand_reshape, "torch.Tensor.flatten (it runs aten.clone)"),
                    (broadcast, "torch.Tensor.matmul (it runs aten.clone)"),
                    (indexed, "torch.Tensor.__getitem__ (it runs aten.index)"),
                    (per_head, "torch.Tensor.clone (it runs aten.clone)")):
        judgement = run_exercise(get(GROUPED), fn)
        assert all(r.passed for r in judgement.results), fn.__name__  # the outputs are right
        assert judgement.credit() == 0 and f"a copy of k: {how}" in judgement.reason(), \
            (fn.__name__, judgement.reason())
        assert "views are free" in judgement.reason()


def test_grouped_attention_may_not_call_a_library_attention_nor_copy_by_repeat():
    assert_banned(GROUPED, lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                         enable_gqa=True),
                  "torch.nn.functional.scaled_dot_product_attention")
    assert_banned(GROUPED, lambda q, k, v: course_attn.scaled_dot_product_attention(
        q, k, v, enable_gqa=True), "course_attn")

    def copying(repeat):
        def fn(q, k, v):
            n = q.shape[1] // k.shape[1]
            return attend(q, repeat(k, n), repeat(v, n))
        return fn
    assert_banned(GROUPED, copying(lambda x, n: x.repeat(1, n, 1, 1)), "torch.Tensor.repeat")
    assert_banned(GROUPED, copying(lambda x, n: x.repeat_interleave(n, dim=1)),
                  "torch.Tensor.repeat_interleave")


# --- copy_predictions -----------------------------------------------------------------------------

COPIES = "ch07.copy_predictions"


def test_copy_predictions_agree_with_the_packages_repeat_kv():
    """On the public sizes and hidden ones of several seeds: the package's repeat_kv shares x's
    memory exactly where the reference says the reshape makes a view (n_rep = 1 returns x)."""
    exercise = get(COPIES)
    cases = exercise.public_cases() + [c for seed in range(5) for c in hidden_cases(COPIES, seed)]
    for case in cases:
        s = case.kwargs
        x = torch.randn(s["batch"], s["kv_heads"], s["seq_len"], s["head_dim"])
        repeated = course_attn.repeat_kv(x, s["n_rep"])
        shares = repeated.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        answers = exercise.expected(case)
        assert (answers["repeat_kv"] == "view") == shares, s
        assert answers["new_bytes"] == (0 if shares else repeated.nbytes)
        assert answers == copy_predictions(**s)


def test_copy_predictions_mistakes():
    gqa, mqa, mha = ({c.part: c.name for c in get(COPIES).public_cases()[i:i + 4]}
                     for i in (0, 4, 8))

    def predicting(**wrong):
        return lambda **s: {**copy_predictions(**s), **{k: f(s) for k, f in wrong.items()}}
    assert_fails(COPIES, predicting(repeat_kv=lambda s: "copy"), mqa["repeat_kv"],
                 hint="to copy whatever the sizes")
    assert_fails(COPIES, predicting(repeat_kv=lambda s: "copy"), mha["repeat_kv"],
                 hint="to copy whatever the sizes")
    assert_fails(COPIES, predicting(repeat_kv=lambda s: "view"), gqa["repeat_kv"],
                 hint="to return a view whatever the sizes")
    assert_fails(COPIES, predicting(expand=lambda s: "copy"), gqa["expand"],
                 hint="expand never copies")
    assert_fails(COPIES, predicting(repeat=lambda s: "view"), mha["repeat"],
                 hint="always allocates")
    every_copy = predicting(new_bytes=lambda s: 4 * s["batch"] * s["kv_heads"] * s["n_rep"]
                            * s["seq_len"] * s["head_dim"])
    assert_fails(COPIES, every_copy, mqa["new_bytes"], hint="a view allocates nothing")
    assert_fails(COPIES, predicting(new_bytes=lambda s: 2 * s["batch"] * s["kv_heads"] * s["n_rep"]
                                    * s["seq_len"] * s["head_dim"]), gqa["new_bytes"],
                 hint="2 bytes a number")
    assert_fails(COPIES, predicting(repeat_kv=lambda s: "no copy"), gqa["repeat_kv"],
                 message="should be one of")
    # two parts wrong at once: each named
    both = predicting(repeat_kv=lambda s: "copy",
                      new_bytes=lambda s: 4 * s["batch"] * s["kv_heads"] * s["n_rep"]
                      * s["seq_len"] * s["head_dim"])
    assert_fails(COPIES, both, mqa["repeat_kv"], hint="to copy whatever the sizes")
    assert_fails(COPIES, both, mqa["new_bytes"], hint="a view allocates nothing")


def test_copy_predictions_may_not_make_tensors():
    def by_looking(batch, kv_heads, n_rep, seq_len, head_dim):
        x = torch.zeros(batch, kv_heads, seq_len, head_dim)
        y = x[:, :, None].expand(batch, kv_heads, n_rep, seq_len, head_dim).reshape(
            batch, kv_heads * n_rep, seq_len, head_dim)
        view = y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        return {**copy_predictions(batch, kv_heads, n_rep, seq_len, head_dim),
                "repeat_kv": "view" if view else "copy"}
    assert_banned(COPIES, by_looking, "torch.zeros")
