"""Chapter 8's exercises: each typical mistake fails the case meant for it with its own hint, and a
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
from torch.utils.flop_counter import FlopCounterMode

import course_attn
from course_attn.decode_bench import decode_model
from course_attn.grading import get, run_exercise
from course_attn.grading.ch08 import (DECODE_MODEL_SIZES, GPT2_SMALL_SIZES, ONE_PROMPT_SIZES,
                                      rope_tables)
from course_attn.grading.check import grade_here
from course_attn.grading.exercise import hidden_cases
from course_attn.model import GPT, GPTConfig

from check_support import (assert_banned, assert_fails, assert_fails_on_every_seed,
                           assert_fails_unnamed, results)
from helpers import SOLUTIONS_DIR

FILL, STEP, SAVINGS = "ch08.fill_cache", "ch08.decode_step", "ch08.decode_savings"


# --- solutions as in solutions/08_kv_cache.ipynb ------------------------------------------------

def rotate(x, cos, sin):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def fill_cache(k_chunks, v_chunks, max_seq_len, *, at=None, step=None, whole=False,
               grow=False):
    """The solution; the keywords make it one typical mistake or another."""
    b, h, _, d = k_chunks[0].shape
    k_cache = k_chunks[0].new_zeros(b, h, max_seq_len, d)
    v_cache = v_chunks[0].new_zeros(b, h, max_seq_len, v_chunks[0].shape[-1])
    length, prefixes = 0, []
    for k_new, v_new in zip(k_chunks, v_chunks):
        if grow:
            k_cache = k_new if length == 0 else torch.cat([k_cache[:, :, :length], k_new], 2)
            v_cache = v_new if length == 0 else torch.cat([v_cache[:, :, :length], v_new], 2)
            length += k_new.shape[2]
            prefixes.append((k_cache, v_cache))
            continue
        start = length if at is None else at
        k_cache[:, :, start:start + k_new.shape[2]] = k_new
        v_cache[:, :, start:start + k_new.shape[2]] = v_new
        length += k_new.shape[2] if step is None else step
        prefixes.append((k_cache, v_cache) if whole else
                        (k_cache[:, :, :length], v_cache[:, :, :length]))
    return prefixes


def decode_step(q_new, k_new, v_new, k_past, v_past, cos, sin, *, offset=True,
                is_causal="bottom_right", use_cache=True):
    """The solution; the keywords make it one typical mistake or another."""
    start, t_new = k_past.shape[2], q_new.shape[2]
    at = start if offset else 0
    c, s = cos[at:at + t_new], sin[at:at + t_new]
    q, k, v = rotate(q_new, c, s), rotate(k_new, c, s), v_new
    if use_cache:
        k, v = torch.cat([k_past, k], dim=2), torch.cat([v_past, v], dim=2)
    t_k = k.shape[2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:
        diagonal = t_k - t_new if is_causal == "bottom_right" else 0
        allowed = torch.ones(t_new, t_k, dtype=torch.bool).tril(diagonal)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def decode_savings(L, C, V, H, G, prompts, N, *, kv_width=None, attention_heads=None,
                   padded=True, batch=None, own_key=True, steps=None):
    """The solution; the keywords make it one typical mistake or another."""
    d = C // H
    per_token = L * (2 * C * C + 2 * C * (kv_width or G * d) + 8 * C * C) + C * V

    def forward(tq, tk):
        return tq * per_token + L * 2 * tq * tk * d * (attention_heads or H)
    b, longest = len(prompts), max(prompts)
    rows = [longest] * b if padded else prompts
    first = [longest + own_key] * (batch or b) if padded else [p + own_key for p in prompts]
    n_steps = N - 1 if steps is None else steps
    return {"prefill_padded": sum(forward(p, p) for p in rows),
            "prefill_ragged": sum(forward(p, p) for p in prompts),
            "step": sum(forward(1, t) for t in first),
            "generate": sum(forward(p, p) + sum(forward(1, t) for t in range(p + 1, p + 1 + n_steps))
                            for p in rows)}


@pytest.mark.parametrize("key, fn", [(FILL, fill_cache), (STEP, decode_step),
                                     (SAVINGS, decode_savings)])
def test_the_notebooks_solutions_pass_with_the_watch_on(key, fn):
    for cases in [None] + [hidden_cases(key, seed) or None for seed in range(5)]:
        judgement = run_exercise(get(key), fn, cases)
        assert judgement.passed, (judgement.banned, [(r.name, r.message) for r in
                                                     judgement.results if not r.passed])


# --- fill_cache ----------------------------------------------------------------------------------

def test_the_fill_cache_reference_is_what_kv_cache_holds():
    ks = [torch.randn(2, 3, t, 4) for t in (3, 1, 2)]
    vs = [torch.randn(2, 3, t, 5) for t in (3, 1, 2)]
    prefixes = get(FILL).reference(ks, vs, 8)
    assert [k.shape[2] for k, _ in prefixes] == [3, 4, 6]
    assert torch.equal(prefixes[-1][0], torch.cat(ks, dim=2))
    assert torch.equal(prefixes[-1][1], torch.cat(vs, dim=2))
    assert torch.equal(prefixes[1][0], torch.cat(ks[:2], dim=2))


def test_fill_cache_mistakes():
    first = "a prompt of 3, then two single tokens; B=1, H=2, D=4, room for 8"
    assert_fails(FILL, lambda k, v, n: fill_cache(k, v, n, at=0), first, hint="at position 0")
    assert_fails(FILL, lambda k, v, n: fill_cache(k, v, n, whole=True), first,
                 hint="the whole buffers", message="has shape")
    assert_fails(FILL, lambda k, v, n: fill_cache(k, v, n, step=1), first,
                 hint="by one per chunk")
    assert_fails(FILL, lambda k, v, n: [(k_new, v_new) for k_new, v_new in zip(k, v)], first,
                 hint="only the new chunk")

    def float32_buffers(k_chunks, v_chunks, max_seq_len):
        return fill_cache([k.float() for k in k_chunks], [v.float() for v in v_chunks],
                          max_seq_len)
    assert_fails(FILL, float32_buffers, "float64 chunks", hint="float32 whatever")
    # the returned value must be a list of pairs
    assert_fails(FILL, lambda k, v, n: fill_cache(k, v, n)[-1], first,
                 message="entries, one per chunk")


def test_fill_cache_may_not_grow_a_tensor_or_call_the_package():
    assert_banned(FILL, lambda k, v, n: fill_cache(k, v, n, grow=True), "torch.cat")

    def stacked(k_chunks, v_chunks, max_seq_len):
        out = fill_cache(k_chunks, v_chunks, max_seq_len)
        return [(torch.stack([k])[0], v) for k, v in out]
    assert_banned(FILL, stacked, "torch.stack")

    def padded(k_chunks, v_chunks, max_seq_len):
        out = fill_cache(k_chunks, v_chunks, max_seq_len)
        return [(F.pad(k, (0, 0)), v) for k, v in out]
    assert_banned(FILL, padded, "torch.nn.functional.pad")

    def with_the_package(k_chunks, v_chunks, max_seq_len):
        b, h, _, d = k_chunks[0].shape
        cache = course_attn.KVCache(b, h, max_seq_len, d, value_dim=v_chunks[0].shape[-1],
                                    dtype=k_chunks[0].dtype)
        return [cache.update(k, v) for k, v in zip(k_chunks, v_chunks)]
    assert_banned(FILL, with_the_package, "course_attn")


# --- decode_step ---------------------------------------------------------------------------------

DECODE = "one decode step: T_new=1 after L=6 cached; B=1, H=2, D=8"
CHUNK = "a chunk: T_new=3 after L=5, tables for 12 positions"


def test_the_decode_step_reference_is_the_last_rows_of_the_full_forward():
    """Rotating every position and attending causally over the whole sequence, then keeping the
    last T_new rows, is what one cached step must give."""
    g = torch.Generator().manual_seed(0)
    length, t_new, d = 5, 3, 8
    q, k, v = (torch.randn(1, 2, length + t_new, d, generator=g) for _ in range(3))
    cos, sin = rope_tables(12, d)
    c, s = cos[:length + t_new], sin[:length + t_new]
    full = course_attn.scaled_dot_product_attention(
        course_attn.apply_rotary_emb(q, c, s), course_attn.apply_rotary_emb(k, c, s), v,
        is_causal=True)
    k_past = course_attn.apply_rotary_emb(k[:, :, :length], cos[:length], sin[:length])
    out = get(STEP).reference(q[:, :, length:], k[:, :, length:], v[:, :, length:], k_past,
                              v[:, :, :length], cos, sin)
    torch.testing.assert_close(out, full[:, :, length:])
    torch.testing.assert_close(decode_step(q[:, :, length:], k[:, :, length:], v[:, :, length:],
                                           k_past, v[:, :, :length], cos, sin),
                               full[:, :, length:])


def test_the_decode_step_reference_is_what_multi_head_attention_does_with_a_cache():
    torch.manual_seed(1)
    mha = course_attn.MultiHeadAttention(16, 2, rope=True).eval()
    x = torch.randn(1, 9, 16)
    cache = mha.new_cache(1, 9)
    with torch.no_grad():
        mha(x[:, :6], cache=cache)
        k_past, v_past = cache.k[:, :, :6].clone(), cache.v[:, :, :6].clone()
        # the new tokens' heads, not rotated (decode_step rotates them)
        q, k, v = (p(x[:, 6:]).view(1, 3, 2, 8).transpose(1, 2)
                   for p in (mha.q_proj, mha.k_proj, mha.v_proj))
        cos, sin = mha.rotary(torch.arange(9))
        out = get(STEP).reference(q, k, v, k_past, v_past, cos, sin)       # (1, 2, 3, 8)
        expected = mha(x[:, 6:], cache=cache)
    torch.testing.assert_close(mha.out_proj(out.transpose(1, 2).reshape(1, 3, 16)), expected)


def test_decode_step_mistakes():
    assert_fails(STEP, lambda *a: decode_step(*a, is_causal="top_left"), CHUNK,
                 hint="aligned top-left")
    assert_fails(STEP, lambda *a: decode_step(*a, is_causal="top_left"), DECODE,
                 hint="aligned top-left")
    assert_fails(STEP, lambda *a: decode_step(*a, offset=False), DECODE,
                 hint="at positions 0 .. T_new-1")
    assert_fails(STEP, lambda *a: decode_step(*a, use_cache=False), DECODE,
                 hint="new keys only")
    assert_fails(STEP, lambda *a: decode_step(*a, is_causal=False), CHUNK,
                 hint="left out the causal mask")
    assert_fails(STEP, lambda *a: decode_step(*a, is_causal=False),
                 "a prefill: an empty cache, L=0, T_new=4", hint="left out the causal mask")

    def rotated_again(q, k, v, k_past, v_past, cos, sin):
        length = k_past.shape[2]
        return decode_step(q, k, v, rotate(k_past, cos[:length], sin[:length]), v_past, cos, sin)
    assert_fails(STEP, rotated_again, DECODE, hint="cached keys again")

    def last_rows(q, k, v, k_past, v_past, cos, sin):
        t = q.shape[2]
        return decode_step(q, k, v, k_past, v_past, cos[-t - k_past.shape[2]:],
                           sin[-t - k_past.shape[2]:])
    assert_fails(STEP, last_rows, CHUNK, hint="last rows of cos and sin")

    def no_key_rotation(q, k, v, k_past, v_past, cos, sin):
        start, t = k_past.shape[2], q.shape[2]
        q = rotate(q, cos[start:start + t], sin[start:start + t])
        k, v = torch.cat([k_past, k], dim=2), torch.cat([v_past, v], dim=2)
        allowed = torch.ones(t, k.shape[2], dtype=torch.bool).tril(k.shape[2] - t)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(
            ~allowed, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v
    assert_fails(STEP, no_key_rotation, CHUNK, hint="did not rotate the new keys")


def test_a_single_decode_step_needs_no_mask():
    """For T_new = 1 the bottom-right mask allows every key: leaving it out is no mistake."""
    found = results(STEP, lambda *a: decode_step(*a, is_causal=False))
    assert found[DECODE].passed and not found[CHUNK].passed


def test_decode_step_may_not_call_a_library_attention():
    def with_sdpa(q, k, v, k_past, v_past, cos, sin):
        start, t = k_past.shape[2], q.shape[2]
        c, s = cos[start:start + t], sin[start:start + t]
        k = torch.cat([k_past, rotate(k, c, s)], dim=2)
        mask = torch.ones(t, k.shape[2], dtype=torch.bool).tril(k.shape[2] - t)
        return F.scaled_dot_product_attention(rotate(q, c, s), k, torch.cat([v_past, v], 2),
                                              attn_mask=mask)
    assert_banned(STEP, with_sdpa, "torch.nn.functional.scaled_dot_product_attention")
    assert_banned(STEP, get(STEP).reference, "course_attn")


# --- decode_savings ------------------------------------------------------------------------------

def _measured(model, prompts, n_new):
    """Multiply-adds of the package's GPT (FlopCounterMode, 2 FLOPs each) for the four answers:
    the padded batch's prefill, each prompt's own, the first step of the padded batch, the
    whole generation of the padded batch (prefill, then n_new - 1 steps); None for the
    generation if ``n_new`` is None. On the meta device nothing is computed."""
    def macs(*calls):
        with FlopCounterMode(display=False) as flops:
            for call in calls:
                call()
        return flops.get_total_flops() // 2
    b, longest = len(prompts), max(prompts)
    batch = torch.zeros(b, longest, dtype=torch.long)
    with torch.no_grad():
        counts = {"prefill_padded": macs(lambda: model(batch)),
                  "prefill_ragged": macs(*(lambda p=p: model(batch[:1, :p]) for p in prompts))}
        caches = model.new_caches(b, longest + (n_new or 1))
        model(batch, caches=caches)
        counts["step"] = macs(lambda: model(batch[:, :1], caches=caches))
        if n_new is not None:
            caches = model.new_caches(b, longest + n_new)
            counts["generate"] = macs(lambda: model(batch, caches=caches), *(
                lambda: model(batch[:, :1], caches=caches) for _ in range(n_new - 1)))
    return counts


def test_the_counts_are_what_flop_counter_mode_counts():
    """The reference, checked on a small GPT with grouped heads (4 query heads, 2 key-value
    heads) and a batch of three prompts: every answer is what FlopCounterMode counts."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=37, seq_len=64, d_model=32, n_heads=4, n_kv_heads=2,
                       n_layers=3, position="rope")
    model = GPT(config).eval()
    sizes = dict(L=3, C=32, V=37, H=4, G=2, prompts=[7, 12, 3], N=5)
    assert get(SAVINGS).reference(**sizes) == _measured(model, sizes["prompts"], sizes["N"])


def test_the_public_sizes_are_gpt2_small_and_the_chapters_decode_model():
    assert GPT2_SMALL_SIZES == dict(L=12, C=768, V=50257, H=12, G=12, prompts=[512, 200, 64],
                                    N=256)
    assert max(GPT2_SMALL_SIZES["prompts"]) + GPT2_SMALL_SIZES["N"] <= 1024  # GPT-2's context
    config = decode_model().config
    assert (config.n_layers, config.d_model, config.vocab_size, config.n_heads) == \
        tuple(DECODE_MODEL_SIZES[k] for k in "LCVH")
    cases = get(SAVINGS).public_cases()
    assert [dict(c.kwargs) for c in cases[::4]] == [GPT2_SMALL_SIZES, DECODE_MODEL_SIZES,
                                                    ONE_PROMPT_SIZES]


def _sum_of(first, last, power):
    """1^power + ... summed over first..last, in closed form (power 0, 1 or 2)."""
    def upto(n):
        return (n, n * (n + 1) // 2, n * (n + 1) * (2 * n + 1) // 6)[power]
    return upto(last) - upto(first - 1)


def test_the_reference_on_hidden_sizes_is_what_the_model_counts():
    """On the hidden sizes of several seeds (every regime): the prefills and the step are what
    FlopCounterMode counts on the package's GPT of those sizes (on the meta device); the
    generation is the closed form of its sum, B · (M(P, P) + (N - 1) · a + 2LC · Σt)."""
    exercise = get(SAVINGS)
    for seed in range(2):
        sizes = {repr(dict(c.kwargs)): dict(c.kwargs) for c in hidden_cases(SAVINGS, seed)}
        assert len(sizes) == 3
        for s in sizes.values():
            L, C, V, H, G, prompts, N = (s[k] for k in ("L", "C", "V", "H", "G", "prompts", "N"))
            answers = exercise.reference(**s)
            with torch.device("meta"):
                model = GPT(GPTConfig(vocab_size=V, seq_len=max(prompts) + N, d_model=C,
                                      n_heads=H, n_kv_heads=G, n_layers=L)).eval()
                measured = _measured(model, prompts, None)
            assert {k: answers[k] for k in measured} == measured, s
            a = L * (2 * C * C + 2 * C * G * (C // H) + 8 * C * C) + C * V
            attention, p = 2 * L * C, max(prompts)
            assert answers["generate"] == len(prompts) * (
                p * a + attention * p * p + (N - 1) * a + attention * _sum_of(p + 1, p + N - 1, 1))


SAVINGS_MISTAKES = {  # keywords of the solution that make the mistake, the part that shows it
    "keys and values as wide as the queries": (dict(kv_width=...), "map C to C"),
    "the attention of G heads": (dict(attention_heads=...), "shrank the attention"),
    "no padding": (dict(padded=False), "its own length: a padded batch"),
    "one sequence per step": (dict(batch=1), "counts one sequence"),
    "the step without its own key": (dict(own_key=False), "its own key"),
    "N decode steps": (dict(steps=...), "N decode steps"),
}


@pytest.mark.parametrize("name", SAVINGS_MISTAKES)
def test_decode_savings_mistakes_are_named(name):
    """Each typical mistake, written as a student would, fails a public case with its hint."""
    wrong, hint = SAVINGS_MISTAKES[name]

    def answer(L, C, V, H, G, prompts, N):
        keywords = {k: v if v is not ... else {"kv_width": C, "attention_heads": G,
                                               "steps": N}[k] for k, v in wrong.items()}
        return decode_savings(L, C, V, H, G, prompts, N, **keywords)
    judgement = run_exercise(get(SAVINGS), answer)
    judgement.settle_hints()
    named = [r for r in judgement.results if not r.passed and r.named]
    assert named and all(hint in r.hint for r in named), [(r.name, r.hint) for r in
                                                          judgement.results if not r.passed]


def test_decode_savings_flops_and_the_chapters_count_of_one_sequence_fail():
    a = get(SAVINGS).public_cases()[0].name
    assert_fails(SAVINGS, lambda **s: {k: 2 * v for k, v in decode_savings(**s).items()}, a,
                 hint="2 FLOPs per multiply-add", message="too large")

    def one_sequence(L, C, V, H, G, prompts, N):
        """The chapter's counts for the longest prompt alone, keys and values C wide."""
        answers = decode_savings(L, C, V, H, H, [max(prompts)], N)
        return {**answers, "prefill_ragged": answers["prefill_padded"]}
    judgement = grade_here(get(SAVINGS), one_sequence, 0)
    assert judgement.credit() == 0, judgement.reason()
    assert run_exercise(get(SAVINGS), lambda **s: [1, 2, 3, 4]).results[0].message == \
        "your function should return a dict with the keys ['prefill_padded', " \
        "'prefill_ragged', 'step', 'generate'], got list"


def test_decode_savings_wrong_only_at_an_edge_fails_on_every_seed():
    """Issue 42: answers wrong only at one edge of the sizes lose points on each of 100 seeds:
    N decode steps (wrong only where N > 1), the step without its new key (off by one key),
    no padding (wrong only where the prompts differ), keys and values C wide (wrong only where
    G < H). The solution earns full marks on each."""
    for wrong in (dict(steps=...), dict(own_key=False), dict(padded=False), dict(kv_width=...)):
        def answer(L, C, V, H, G, prompts, N, wrong=wrong):
            keywords = {k: v if v is not ... else {"kv_width": C, "steps": N}[k]
                        for k, v in wrong.items()}
            return decode_savings(L, C, V, H, G, prompts, N, **keywords)
        for seed in range(100):
            assert grade_here(get(SAVINGS), answer, seed).credit() < 1, (wrong, seed)
    for seed in range(100):
        assert grade_here(get(SAVINGS), decode_savings, seed).credit() == 1, seed


def test_decode_savings_never_shows_the_right_answer_or_a_factor():
    for answer in (12345, 10 ** 30):
        for result in run_exercise(get(SAVINGS), lambda **s: {k: answer for k in
                                                              decode_savings(**s)}).results:
            assert not result.passed
            assert result.message.endswith("is too small" if answer == 12345 else
                                           "is too large"), result.message
            right = get(SAVINGS).reference(**dict(get(SAVINGS).public_cases()[0].kwargs))
            for value in right.values():
                assert str(value) not in result.message and f"{value:,}" not in result.message
            assert "times" not in result.message


def test_decode_savings_pasted_public_answers_fail_the_hidden_cases_of_every_seed():
    """A notebook that computed the public counts elsewhere (with the package's model, say)
    and pasted them in: right on the check's cases, wrong on every one of the grader's."""
    exercise = get(SAVINGS)
    table = {repr(dict(c.kwargs)): exercise.reference(**c.kwargs)
             for c in exercise.public_cases()}

    def pasted(**sizes):
        return table.get(repr(sizes), table[repr(GPT2_SMALL_SIZES)])
    assert run_exercise(exercise, pasted).passed
    for seed in range(20):
        judgement = run_exercise(exercise, pasted, hidden_cases(SAVINGS, seed))
        assert judgement.results and not any(r.passed for r in judgement.results), seed


def test_decode_savings_may_not_call_the_package():
    def with_the_package(**sizes):
        course_attn.causal_mask(2)
        return decode_savings(**sizes)
    assert_banned(SAVINGS, with_the_package, "course_attn")


def test_decode_savings_counted_with_the_packages_model_is_refused_by_name():
    """A decode_savings that counts with FlopCounterMode on course_attn's GPT: on sizes that
    run at once, the guard names the package's model as the refused call (the first hit comes
    before any tensor is made; a timeout in the grader is the grader's to explain)."""
    def counted(L, C, V, H, G, prompts, N):
        gpt = GPT(GPTConfig(vocab_size=V, seq_len=max(prompts) + N, d_model=C, n_heads=H,
                            n_kv_heads=G, n_layers=L, position="rope")).eval()
        return _measured(gpt, prompts, N)
    # under the guard every Python call is watched (an arithmetic exercise), which makes the
    # model slow: the smallest sizes do
    from course_attn.grading.ch08 import SAVINGS as questions
    small = list(questions.cases(dict(L=1, C=8, V=8, H=2, G=1, prompts=[2, 1], N=2)))
    judgement = run_exercise(get(SAVINGS), counted, small)
    assert all(r.passed for r in judgement.results)      # the counts are right ...
    assert judgement.banned[0] == "course_attn.model.GPTConfig.__post_init__", judgement.banned
    assert not judgement.passed                          # ... and refused by name
    assert judgement.reason().startswith("calls course_attn.model.")


# --- greedy_decode (debug) and first_divergence (measure) ----------------------------------------

DECODE_LOOP, DIVERGENCE = "ch08.greedy_decode", "ch08.first_divergence"
NOTEBOOK = SOLUTIONS_DIR / "08_kv_cache.ipynb"
BUGGY_ROPE = """    cos, sin = rope_rows(len(tokens), q.shape[-1])
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
"""


def _cell(grade_id):
    import nbformat

    from course_attn.grading.generate import grade_id as id_of
    cells = [c for c in nbformat.read(NOTEBOOK, as_version=4).cells if id_of(c) == grade_id]
    assert len(cells) == 1, grade_id
    return cells[0].source


def given_loop(rope=None, loop=None):
    """The notebook's given cell, run as it stands, or with the two lines that rotate the new
    tokens replaced by ``rope`` (a student's repair), or the loop's decode step by ``loop``:
    its greedy_decode_buggy (and the namespace it lives in)."""
    source = _cell("ch08-greedy_decode-given")
    if rope is not None:
        assert BUGGY_ROPE in source
        source = source.replace(BUGGY_ROPE, rope)
    if loop is not None:
        source = source.replace("def attend_step(params, tokens, cache):",
                                "def attend_step(params, tokens, cache, at=None):")
        source = source.replace("rows.append(attend_step(params, next_token, cache)[-1])", loop)
    namespace = {"__name__": "__notebook__"}
    exec(_cell("ch08-setup"), namespace)
    exec(source, namespace)
    return namespace["greedy_decode_buggy"]


REPAIRED = """    start = cache["k"].shape[1]                       # tokens cached before this step
    cos, sin = rope_rows(start + len(tokens), q.shape[-1])
    q, k = rotate(q, cos[start:], sin[start:]), rotate(k, cos[start:], sin[start:])
"""
PROMPT_OF_5 = "a prompt of 5, 8 new tokens; V=16, C=16, H=2, D=8"


def test_the_given_loop_is_the_bug_and_the_one_line_repair_passes():
    assert_fails(DECODE_LOOP, given_loop(), PROMPT_OF_5, hint="still the given loop's bug")
    for cases in [None] + [hidden_cases(DECODE_LOOP, seed) for seed in range(5)]:
        judgement = run_exercise(get(DECODE_LOOP), given_loop(REPAIRED), cases)
        assert judgement.passed, [(r.name, r.message) for r in judgement.results if not r.passed]


def test_the_given_loops_first_token_is_right_and_the_repair_agrees_with_no_cache():
    """The symptom the notebook shows: the prefill is right, the decode steps are not; the
    repaired loop writes the text of the model run without a cache."""
    from course_attn.grading.ch08 import _public_model, greedy_decode_reference
    params, prompt, n = _public_model(820, 5, 8)
    buggy, right = given_loop()(params, prompt, n), greedy_decode_reference(params, prompt, n)
    torch.testing.assert_close(buggy[0], right[0])
    assert not torch.allclose(buggy[1], right[1], atol=1e-3)
    namespace = {"__name__": "__notebook__"}
    exec(_cell("ch08-setup"), namespace)
    exec(_cell("ch08-greedy_decode-given"), namespace)
    sequence = prompt
    for _ in range(n):
        last = namespace["attend_step"](params, sequence, namespace["empty_cache"](params))[-1]
        sequence = torch.cat([sequence, last.argmax().reshape(1)])
    assert torch.equal(sequence[len(prompt):], right.argmax(dim=-1))


def test_greedy_decode_half_repairs_are_named():
    keys_at_zero = """    start = cache["k"].shape[1]
    cos, sin = rope_rows(start + len(tokens), q.shape[-1])
    q, k = rotate(q, cos[start:], sin[start:]), rotate(k, cos[:len(tokens)], sin[:len(tokens)])
"""
    queries_at_zero = """    start = cache["k"].shape[1]
    cos, sin = rope_rows(start + len(tokens), q.shape[-1])
    q, k = rotate(q, cos[:len(tokens)], sin[:len(tokens)]), rotate(k, cos[start:], sin[start:])
"""
    one_too_far = """    start = cache["k"].shape[1] + len(tokens)     # the length once written
    cos, sin = rope_rows(start + len(tokens), q.shape[-1])
    q, k = rotate(q, cos[start:], sin[start:]), rotate(k, cos[start:], sin[start:])
"""
    assert_fails(DECODE_LOOP, given_loop(keys_at_zero), PROMPT_OF_5, hint="keys you append")
    assert_fails(DECODE_LOOP, given_loop(queries_at_zero), PROMPT_OF_5,
                 hint="new queries are still")
    assert_fails(DECODE_LOOP, given_loop(one_too_far), PROMPT_OF_5, hint="one step too far")
    # with a prompt of one token, one position too far everywhere is a shift of the whole
    # sequence, which RoPE cannot see: that case passes, the others do not
    found = results(DECODE_LOOP, given_loop(one_too_far))
    assert found["a prompt of 1, 6 new tokens; V=16, C=16, H=2, D=8"].passed
    # every decode step at the prompt's length (the position passed by the loop)
    at_prompt_end = given_loop(
        rope="""    start = cache["k"].shape[1] if at is None else at
    cos, sin = rope_rows(start + len(tokens), q.shape[-1])
    q, k = rotate(q, cos[start:], sin[start:]), rotate(k, cos[start:], sin[start:])
""", loop="rows.append(attend_step(params, next_token, cache, at=len(prompt))[-1])")
    assert_fails(DECODE_LOOP, at_prompt_end, PROMPT_OF_5, hint="the same position")


def test_a_loop_that_caches_unrotated_keys_and_rotates_them_all_each_step_passes():
    """Another decomposition, equal in exact arithmetic: the grader's float64 tolerance takes it."""
    namespace = {"__name__": "__notebook__"}
    exec(_cell("ch08-setup"), namespace)
    exec(_cell("ch08-greedy_decode-given"), namespace)
    rotate_, rope_rows = namespace["rotate"], namespace["rope_rows"]

    def greedy_decode(params, prompt, n_new):
        heads, _, d = params["wq"].shape
        raw_k = torch.zeros(heads, 0, d, dtype=torch.float64)
        values = torch.zeros(heads, 0, params["wv"].shape[-1], dtype=torch.float64)
        tokens, rows = prompt, []
        for _ in range(n_new):
            x = params["embed"][tokens]
            q, k, v = (torch.einsum("tc,hcd->htd", x, params[w]) for w in ("wq", "wk", "wv"))
            raw_k, values = torch.cat([raw_k, k], 1), torch.cat([values, v], 1)
            n = raw_k.shape[1]
            cos, sin = rope_rows(n, d)
            keys = rotate_(raw_k, cos, sin)
            query = rotate_(q[:, -1:], cos[-1:], sin[-1:])
            weights = torch.softmax(query @ keys.transpose(1, 2) / math.sqrt(d), dim=-1)
            out = torch.einsum("htl,hld,hdc->tc", weights, values, params["wo"])
            rows.append(((x[-1:] + out) @ params["unembed"])[0])
            tokens = rows[-1].argmax().reshape(1)
        return torch.stack(rows)
    for cases in [None] + [hidden_cases(DECODE_LOOP, seed) for seed in range(3)]:
        judgement = run_exercise(get(DECODE_LOOP), greedy_decode, cases)
        assert judgement.passed, [(r.name, r.message) for r in judgement.results if not r.passed]


def test_greedy_decode_wrong_only_from_the_second_decode_step_fails_on_every_seed():
    """Issue 42: every decode step at the prompt's length is right for the first decode step
    and wrong from the second on: the hidden cases draw at least 4 new tokens on every seed, so
    it fails on each of 100."""
    at_prompt_end = given_loop(
        rope="""    start = cache["k"].shape[1] if at is None else at
    cos, sin = rope_rows(start + len(tokens), q.shape[-1])
    q, k = rotate(q, cos[start:], sin[start:]), rotate(k, cos[start:], sin[start:])
""", loop="rows.append(attend_step(params, next_token, cache, at=len(prompt))[-1])")
    assert_fails_on_every_seed(DECODE_LOOP, at_prompt_end)


def test_greedy_decode_may_not_call_the_package_or_a_library_attention():
    repaired = given_loop(REPAIRED)

    def with_package_rope(params, prompt, n_new):
        course_attn.apply_rotary_emb(torch.zeros(1, 1, 1, 2), torch.ones(1, 1), torch.zeros(1, 1))
        return repaired(params, prompt, n_new)
    assert_banned(DECODE_LOOP, with_package_rope, "course_attn")

    def with_sdpa(params, prompt, n_new):
        F.scaled_dot_product_attention(*(torch.zeros(1, 1, 2, 2) for _ in range(3)))
        return repaired(params, prompt, n_new)
    assert_banned(DECODE_LOOP, with_sdpa, "scaled_dot_product_attention")


def uncached_loop():
    """The notebook's demonstration as a function: the model without a cache (each step feeds
    the whole sequence so far to a fresh cache) -> the (n_new, V) logits that chose its tokens."""
    step, empty = _given_namespace()

    def generate(params, prompt, n_new):
        sequence, rows = prompt, []
        for _ in range(n_new):
            rows.append(step(params, sequence, empty(params))[-1])
            sequence = torch.cat([sequence, rows[-1].argmax().reshape(1)])
        return torch.stack(rows)
    return generate


def test_greedy_decode_without_the_cache_scores_0():
    """Issue 42: rerunning the whole sequence at every step (the notebook's demonstration of
    the model without a cache) gives the right logits and scored 4/4, though the exercise asks
    to keep the cache. It runs the earlier tokens through wk and wv again at every step: the
    guard counts the tokens that go through them (harness._Feeds), and past the P + n - 1 of a
    cached generation the call scores 0, named."""
    judgement = run_exercise(get(DECODE_LOOP), uncached_loop())
    assert all(r.passed for r in judgement.results)       # the values are right
    assert judgement.credit() == 0
    assert judgement.reason().startswith(
        "reads the earlier tokens (more than the 12 a cached generation runs through wk and wv, "
        "5 of the prompt and 7 new) a second time, in torch.functional.einsum (it runs "
        "aten.bmm), which this exercise does not allow"), judgement.reason()
    assert "every token goes through the model once" in judgement.reason()
    for seed in range(3):
        assert grade_here(get(DECODE_LOOP), uncached_loop(), seed).credit() == 0, seed
        assert grade_here(get(DECODE_LOOP), given_loop(REPAIRED), seed).credit() == 1, seed


def _given_namespace():
    namespace = {"__name__": "__notebook__"}
    exec(_cell("ch08-setup"), namespace)
    exec(_cell("ch08-greedy_decode-given"), namespace)
    return namespace["attend_step"], namespace["empty_cache"]


def _fed_again(copy):
    """The model without a cache, fed at every step a sequence that began as ``copy(prompt)``
    (issue 42: a copy of the prompt was not the prompt the guard counted the reads of)."""
    step, empty = _given_namespace()

    def greedy_decode(params, prompt, n_new):
        sequence, rows = copy(prompt), []
        for _ in range(n_new):
            rows.append(step(params, sequence, empty(params))[-1])
            sequence = torch.cat([sequence, rows[-1].argmax().reshape(1)])
        return torch.stack(rows)
    return greedy_decode


def _fed_from_a_list(params, prompt, n_new):
    step, empty = _given_namespace()
    sequence, rows = prompt.tolist(), []
    for _ in range(n_new):
        rows.append(step(params, torch.tensor(sequence), empty(params))[-1])
        sequence.append(int(rows[-1].argmax()))
    return torch.stack(rows)


def _fed_from_a_buffer(params, prompt, n_new):
    step, empty = _given_namespace()
    tokens, p, rows = torch.zeros(len(prompt) + n_new, dtype=torch.long), len(prompt), []
    tokens[:p] = prompt
    for i in range(n_new):
        rows.append(step(params, tokens[:p + i], empty(params))[-1])
        tokens[p + i] = rows[-1].argmax()
    return torch.stack(rows)


def _embeddings_cached(params, prompt, n_new):
    """A cache of the tokens' embeddings, whose keys and values are computed again each step."""
    step, _ = _given_namespace()
    heads, _, d = params["wk"].shape
    embeddings, rows = params["embed"][prompt], []
    for _ in range(n_new):
        q, k, v = (torch.einsum("tc,hcd->htd", embeddings, params[w]) for w in ("wq", "wk", "wv"))
        n = len(embeddings)
        angles = torch.outer(torch.arange(n, dtype=torch.float64),
                             10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d))
        q, k = rotate(q, angles.cos(), angles.sin()), rotate(k, angles.cos(), angles.sin())
        visible = torch.ones(n, n, dtype=torch.bool).tril()
        scores = (q @ k.transpose(1, 2) / math.sqrt(d)).masked_fill(~visible, float("-inf"))
        mixed = torch.einsum("htl,hld,hdc->tc", torch.softmax(scores, -1), v, params["wo"])
        rows.append(((embeddings + mixed) @ params["unembed"])[-1])
        embeddings = torch.cat([embeddings, params["embed"][rows[-1].argmax().reshape(1)]])
    return torch.stack(rows)


RECOMPUTED = {"a clone of the prompt": _fed_again(torch.clone),
              "torch.cat of the prompt alone": _fed_again(lambda p: torch.cat([p])),
              "the prompt plus 0": _fed_again(lambda p: p + 0),
              "the prompt indexed": _fed_again(lambda p: p[torch.arange(len(p))]),
              "the prompt as a list": _fed_from_a_list,
              "a buffer of tokens the prompt was written into": _fed_from_a_buffer,
              "a cache of embeddings": _embeddings_cached}


@pytest.mark.parametrize("name", RECOMPUTED)
def test_a_loop_that_feeds_a_copy_of_the_sequence_again_scores_0(name):
    """Issue 42: a copy of the prompt re-fed at every step, however it was made (or the
    embeddings cached instead of the keys and values), gives the right logits and recomputes
    the earlier keys: 0 points, and the reason says what it ran again."""
    judgement = run_exercise(get(DECODE_LOOP), RECOMPUTED[name])
    assert all(r.passed for r in judgement.results)
    assert judgement.credit() == 0
    assert judgement.reason().startswith("reads the earlier tokens (more than the "), \
        judgement.reason()


def test_a_copy_of_the_prompt_scores_0_on_hidden_cases_too():
    for seed in range(2):
        assert grade_here(get(DECODE_LOOP), RECOMPUTED["a clone of the prompt"],
                          seed).credit() == 0, seed


def _cached(keys_and_values, *, prefill_by_token=False, keep_the_text=False):
    """A repaired loop written otherwise: its cache preallocated for P + n positions and
    written in place, the new keys and values from ``keys_and_values(params, x)`` (unrotated);
    ``prefill_by_token`` feeds the prompt a token at a time, ``keep_the_text`` grows the whole
    sequence by torch.cat beside the cache (bookkeeping, never fed)."""
    namespace = {"__name__": "__notebook__"}
    exec(_cell("ch08-setup"), namespace)
    exec(_cell("ch08-greedy_decode-given"), namespace)
    rope_rows = namespace["rope_rows"]

    def greedy_decode(params, prompt, n_new):
        heads, _, d = params["wq"].shape
        room = len(prompt) + n_new
        k_cache = torch.zeros(heads, room, d, dtype=torch.float64)
        v_cache = torch.zeros(heads, room, params["wv"].shape[-1], dtype=torch.float64)
        cos, sin = rope_rows(room, d)
        length, text = 0, prompt

        def forward(tokens):
            nonlocal length
            x, t = params["embed"][tokens], len(tokens)
            k, v = keys_and_values(params, x)
            c, s = cos[length:length + t], sin[length:length + t]
            q = rotate(torch.einsum("tc,hcd->htd", x, params["wq"]), c, s)
            k_cache[:, length:length + t], v_cache[:, length:length + t] = rotate(k, c, s), v
            length += t
            scores = q @ k_cache[:, :length].transpose(1, 2) / math.sqrt(d)
            visible = torch.ones(t, length, dtype=torch.bool).tril(length - t)
            weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
            mixed = torch.einsum("htl,hld,hdc->tc", weights, v_cache[:, :length], params["wo"])
            return (x + mixed) @ params["unembed"]
        if prefill_by_token:
            rows = [[forward(token.reshape(1)) for token in prompt][-1][-1]]
        else:
            rows = [forward(prompt)[-1]]
        while len(rows) < n_new:
            token = rows[-1].argmax().reshape(1)
            if keep_the_text:
                text = torch.cat([text, token])
            rows.append(forward(token)[-1])
        return torch.stack(rows)
    return greedy_decode


def _by_einsum(params, x):
    return tuple(torch.einsum("tc,hcd->htd", x, params[w]) for w in ("wk", "wv"))


def _head_by_head(params, x):
    return tuple(torch.stack([x @ w for w in params[name]]) for name in ("wk", "wv"))


def _stacked(params, x):
    both = torch.einsum("tc,shcd->shtd", x, torch.stack([params["wk"], params["wv"]]))
    return both[0], both[1]


def _flattened(params, x):
    heads, c, d = params["wk"].shape
    return tuple((x @ params[w].permute(1, 0, 2).reshape(c, heads * d))
                 .reshape(-1, heads, d).transpose(0, 1) for w in ("wk", "wv"))


CACHED = {"keys and values by einsum": _cached(_by_einsum),
          "head by head": _cached(_head_by_head),
          "wk and wv stacked": _cached(_stacked),
          "the weights flattened to (C, H·D)": _cached(_flattened),
          "a prefill a token at a time": _cached(_by_einsum, prefill_by_token=True),
          "the whole text kept beside the cache": _cached(_by_einsum, keep_the_text=True)}


@pytest.mark.parametrize("name", CACHED)
def test_a_cached_loop_written_otherwise_earns_full_marks(name):
    """A cache of another shape (preallocated, written in place, keys unrotated until written),
    the projections written another way (per head, stacked, flattened: the copies einsum and
    reshape make of the weights count as the weights), a prefill a token at a time, a text
    kept by torch.cat beside the cache: each computes each token's key once, and passes."""
    assert grade_here(get(DECODE_LOOP), CACHED[name], 0).credit() == 1


def chunked_buggy_loop(params, prompt, n_new, chunk):
    """The given buggy loop, its prompt prefilled in chunks of ``chunk`` tokens by the given
    attend_step -> the (n_new, V) logits that chose its tokens."""
    step, empty = _given_namespace()
    cache = empty(params)
    for start in range(0, len(prompt), chunk):
        last = step(params, prompt[start:start + chunk], cache)[-1]
    rows = [last]
    while len(rows) < n_new:
        rows.append(step(params, rows[-1].argmax().reshape(1), cache)[-1])
    return torch.stack(rows)


def divergence(compare="tokens", shift=0, against=None, chunked=True):
    """first_divergence as the notebook's solution writes it: the given loop with a chunked
    prefill against the model without a cache (or ``against``, a loop); ``compare="logits"``
    compares the logits, ``"count"`` counts every agreement, ``shift`` adds to the index,
    ``chunked=False`` prefills the prompt at once."""
    right_loop = against or uncached_loop()

    def first_divergence(params, prompt, n_new, chunk):
        buggy = chunked_buggy_loop(params, prompt, n_new, chunk if chunked else len(prompt))
        repaired = right_loop(params, prompt, n_new)
        if compare == "logits":
            differ = ((buggy - repaired).abs().amax(dim=-1) > 1e-9).nonzero()
        else:
            same = buggy.argmax(dim=-1) == repaired.argmax(dim=-1)
            if compare == "count":
                return int(same.sum())
            differ = (~same).nonzero()
        first = int(differ[0, 0]) if len(differ) else n_new
        return first + (len(prompt) if shift == "prompt" else shift)
    return first_divergence


ZERO = "a prompt of 7, 10 new tokens; V=16, C=16, H=2, D=8; prefill chunks of 3"
A_WHILE = "a prompt of 8, 10 new tokens; V=16, C=16, H=2, D=8; prefill chunks of 3"
ONE_CHUNK = "a prompt of 4, 10 new tokens; V=16, C=16, H=2, D=8; prefill chunks of 4"


def test_a_chunk_as_long_as_the_prompt_is_the_given_loop():
    from course_attn.grading.ch08 import _public_model
    params, prompt, n = _public_model(830, 4, 10)
    for chunk in (4, 9):
        assert torch.equal(chunked_buggy_loop(params, prompt, n, chunk),
                           given_loop()(params, prompt, n))


def test_first_divergence_passes_and_its_mistakes_are_named():
    for cases in [None] + [hidden_cases(DIVERGENCE, seed) for seed in range(3)]:
        judgement = run_exercise(get(DIVERGENCE), divergence(), cases)
        assert judgement.passed, [(r.name, r.message) for r in judgement.results if not r.passed]
    assert [get(DIVERGENCE).expected(c) for c in get(DIVERGENCE).public_cases()] == [0, 4, 1, 10]
    # comparing the logits answers 1 whatever the model (issue 42: told "you compared the
    # logits" when 1 was typed in): no mistake is named, and a constant earns nothing
    assert_fails_unnamed(DIVERGENCE, divergence("logits"), A_WHILE, message="too small")
    for answer in (divergence("logits"), lambda params, prompt, n_new, chunk: 1):
        judgement = run_exercise(get(DIVERGENCE), answer)
        judgement.settle_hints()    # as check() prints it and the grader's reason gives it
        assert not any(r.named for r in judgement.results)
        assert judgement.reason().startswith("earns nothing: "), judgement.reason()
        assert grade_here(get(DIVERGENCE), answer, 0).credit() == 0
    assert_fails(DIVERGENCE, divergence(chunked=False), ZERO, hint="prefilled the prompt at once",
                 message="too large")
    assert_fails(DIVERGENCE, divergence(chunked=False), A_WHILE,
                 hint="prefilled the prompt at once", message="too small")
    assert_fails(DIVERGENCE, divergence(shift=1), ONE_CHUNK, hint="counting from 1",
                 message="too large")
    assert_fails(DIVERGENCE, divergence(shift="prompt"), ONE_CHUNK, hint="start of the prompt")
    assert_fails(DIVERGENCE, divergence("count"), ONE_CHUNK, hint="every new token on which")


def test_first_divergence_prefilled_at_once_earns_nothing():
    """The old exercise's answer, the prompt in one pass (the chapter's demonstration plus a
    loop): right where a chunk holds the whole prompt, wrong in the central regime, several
    chunks, drawn on every seed: 0 on each of 100 seeds. So is an answer that takes the first
    new token to be always right (at least 1), which differs only where the answer is 0."""
    at_once = divergence(chunked=False)
    assert results(DIVERGENCE, at_once)[ONE_CHUNK].passed

    def at_least_one(params, prompt, n_new, chunk):
        return max(1, divergence()(params, prompt, n_new, chunk))
    for seed in range(100):
        for wrong in (at_once, at_least_one):
            judgement = grade_here(get(DIVERGENCE), wrong, seed, watch_banned=False)
            assert judgement.credit() == 0, (seed, judgement.reason())


def test_first_divergence_needs_nothing_of_the_students_repair():
    """Issue 31: it compared the buggy loop with the student's greedy_decode, so it passed on
    top of a wrong repair (the new tokens rotated from L + 1) and failed ("too large") without
    one. Now measured against the model without a cache, which the given cell holds: the
    measurement against the one-line repair gives the same counts, against a wrong repair
    other counts."""
    wrong = given_loop(REPAIRED.replace("    cos, sin", "    start += start > 0   # one too far\n"
                                                        "    cos, sin"))
    cases = [c for seed in range(3) for c in hidden_cases(DIVERGENCE, seed)]
    assert [divergence()(*c.args) for c in cases] == \
        [divergence(against=given_loop(REPAIRED))(*c.args) for c in cases]
    judgement = run_exercise(get(DIVERGENCE), divergence(against=wrong), cases)
    assert not judgement.passed


def test_first_divergence_is_a_stable_measurement():
    """The reference is deterministic (no draw inside it, float64), whatever the global seed;
    every hidden draw keeps the largest two logits of every step of both loops more than 1e-6
    apart, so the student's float64 arithmetic, another order of the same sums, picks the same
    tokens: the notebook's solution gives the reference's count on every hidden case, and the
    count is compared exactly."""
    from course_attn.grading.ch08 import first_divergence_reference, smallest_gap
    student = divergence()
    for seed in range(10):
        for case in hidden_cases(DIVERGENCE, seed):
            assert smallest_gap(*case.args) > 1e-6
            answers = set()
            for global_seed in (0, 1):
                torch.manual_seed(global_seed)
                answers.add(first_divergence_reference(*case.args))
            assert answers == {student(*case.args)}


def test_first_divergence_may_not_call_the_package():
    def with_the_reference(params, prompt, n_new, chunk):
        from course_attn.grading.ch08 import first_divergence_reference
        return first_divergence_reference(params, prompt, n_new, chunk)
    assert_banned(DIVERGENCE, with_the_reference, "course_attn")


# --- check() and the grader agree ---------------------------------------------------------------

COPIED_PROMPT = '''def greedy_decode(params, prompt, n_new):
    sequence, rows = prompt.clone(), []
    for _ in range(n_new):
        rows.append(attend_step(params, sequence, empty_cache(params))[-1])
        sequence = torch.cat([sequence, rows[-1].argmax().reshape(1)])
    return torch.stack(rows)
'''


def test_check_and_the_grader_refuse_a_fill_cache_that_grows_by_torch_cat(tmp_path, capsys):
    """The issue: check() printed '6/6 checks passed' for a fill_cache built with torch.cat,
    which the grader then refused. Both use the same guard now: check() says first that the
    call is refused (the passed cases come after, 'apart from that'), and the grader, on a copy
    of the solution notebook with that answer, gives 0 points for the same reason. In the same
    notebook, a greedy_decode that feeds a copy of the prompt to the model without a cache at
    every step (issue 42): the guard in the sandboxed kernel counts what goes through wk and wv,
    and the grader gives 0 for the reason the in-process judge gives."""
    import nbformat

    from course_attn.grading import ExerciseFailed, check, grader
    from course_attn.grading.generate import grade_id as id_of
    from course_attn.grading.sandbox import unavailable

    source = '''def fill_cache(k_chunks, v_chunks, max_seq_len):
    out, k, v = [], None, None
    for k_new, v_new in zip(k_chunks, v_chunks):
        k = k_new if k is None else torch.cat([k, k_new], dim=2)
        v = v_new if v is None else torch.cat([v, v_new], dim=2)
        out.append((k, v))
    return out
'''
    namespace = {"torch": torch}
    exec(source, namespace)
    with pytest.raises(ExerciseFailed, match="calls torch.cat"):
        check(FILL, namespace["fill_cache"])
    printed = capsys.readouterr().out
    assert printed.startswith("ch08.fill_cache: failed: it calls torch.cat"), printed
    assert "apart from that, 6/6 checks passed" in printed
    in_process = run_exercise(get(FILL), namespace["fill_cache"]).reason()
    notebook = {"__name__": "__notebook__"}
    for grade_id in ("ch08-setup", "ch08-greedy_decode-given"):
        exec(_cell(grade_id), notebook)
    exec(COPIED_PROMPT, notebook)
    copied = run_exercise(get(DECODE_LOOP), notebook["greedy_decode"]).reason()
    assert copied.startswith("reads the earlier tokens (more than the 12 "), copied

    if unavailable():
        pytest.skip(f"the grader's sandbox: {unavailable()}")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if id_of(cell) == "ch08-fill_cache-solution":
            cell.source = source
        if id_of(cell) == "ch08-greedy_decode-solution":
            cell.source = COPIED_PROMPT
    path = tmp_path / NOTEBOOK.name
    nbformat.write(nb, path)
    grade = grader.grade_notebook(path, solutions_dir=NOTEBOOK.parent, hidden_seed=0)
    scores = {e.grade_id: e for e in grade.exercises}
    assert scores["ch08-fill_cache"].points == 0
    assert scores["ch08-fill_cache"].reason == in_process
    assert "calls torch.cat, which this exercise does not allow" in in_process
    assert scores["ch08-greedy_decode"].points == 0
    assert scores["ch08-greedy_decode"].reason == copied
    assert all(e.passed for gid, e in scores.items()
               if gid not in ("ch08-fill_cache", "ch08-greedy_decode")), scores


# --- mla_decode_step ------------------------------------------------------------------------------

MLA = "ch08.mla_decode_step"
MLA_DECODE = "one decode step: T_new=1 after L=6; B=1, H=2, D=4, Dr=4, Dc=6"
MLA_CHUNK = "a chunk: T_new=3 after L=4; H=3, D=6, Dr=2, Dc=5"


def mla_decode_step(q_new, c_new, kr_new, c_past, kr_past, w_uk, w_uv, cos, sin, *,
                    offset=True, rerotate=False, scale_by=None, rope_scores=True,
                    bottom_right=True):
    """The notebook's solution; the keywords make it one typical mistake or another."""
    start, t_new, d_rope = c_past.shape[1], q_new.shape[2], kr_new.shape[-1]
    d = q_new.shape[-1] - d_rope
    at = start if offset else 0
    c, s = cos[at:at + t_new], sin[at:at + t_new]
    if rerotate:
        kr_past = rotate(kr_past, cos[:start], sin[:start])
    q = torch.cat([q_new[..., :d], rotate(q_new[..., d:], c, s)], dim=-1)
    latent = torch.cat([c_past, c_new], dim=1)
    k_rope = torch.cat([kr_past, rotate(kr_new, c, s)], dim=1)
    heads, t_k = w_uk.shape[0], latent.shape[1]
    k = torch.cat([torch.einsum("bsc,hcd->bhsd", latent, w_uk),
                   k_rope[:, None].expand(-1, heads, t_k, d_rope)], dim=-1)
    if not rope_scores:
        q, k = q[..., :d], k[..., :d]
    v = torch.einsum("bsc,hcd->bhsd", latent, w_uv)
    scores = q @ k.transpose(-2, -1) / math.sqrt(scale_by or d + d_rope)
    allowed = torch.ones(t_new, t_k, dtype=torch.bool).tril(t_k - t_new if bottom_right else 0)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def test_the_mla_reference_is_the_latent_attention_module_with_a_cache():
    """Prefill 6 tokens into MultiHeadLatentAttention's cache, then a chunk of 3: the module's
    output is out_proj of the reference, fed the module's own latents, RoPE keys, query and
    up-projections (k_up's weight is (H·D, Dc): head h's W_UK is its rows, transposed)."""
    from course_attn.multihead import merge_heads, split_heads
    h, d, dr, dc, width = 3, 4, 4, 6, 12
    torch.manual_seed(0)
    mla = course_attn.MultiHeadLatentAttention(width, h, latent_dim=dc, head_dim=d,
                                               rope_dim=dr).double().eval()
    x = torch.randn(2, 9, width, dtype=torch.float64)
    with torch.no_grad():
        cache = mla.new_cache(2, 9, dtype=torch.float64)
        mla(x[:, :6], cache=cache)
        c_past, kr_past = cache.k[:, 0, :6].clone(), cache.v[:, 0, :6].clone()
        out = mla(x[:, 6:], cache=cache)
        new = x[:, 6:]
        w_uk = mla.k_up.weight.view(h, d, dc).transpose(-2, -1)
        w_uv = mla.v_up.weight.view(h, d, dc).transpose(-2, -1)
        cos, sin = mla.rotary(torch.arange(12))
        args = (split_heads(mla.q_proj(new), h), mla.kv_norm(mla.kv_down(new)),
                mla.k_rope_proj(new), c_past, kr_past, w_uk, w_uv, cos.double(), sin.double())
        reference = get(MLA).reference(*args)
        torch.testing.assert_close(mla.out_proj(merge_heads(reference)), out)
        torch.testing.assert_close(mla_decode_step(*args), reference)


def test_mla_decode_step_passes_and_its_mistakes_are_named():
    for cases in [None] + [hidden_cases(MLA, seed) for seed in range(5)]:
        judgement = run_exercise(get(MLA), mla_decode_step, cases)
        assert judgement.passed, [(r.name, r.message) for r in judgement.results if not r.passed]
    assert_fails(MLA, lambda *a: mla_decode_step(*a, offset=False), MLA_DECODE,
                 hint="at positions 0 .. T_new-1")
    assert_fails(MLA, lambda *a: mla_decode_step(*a, rerotate=True), MLA_DECODE,
                 hint="cached RoPE keys again")
    assert_fails(MLA, lambda *a: mla_decode_step(*a, scale_by=a[0].shape[-1] - a[2].shape[-1]),
                 MLA_DECODE, hint="1/sqrt(D)")
    assert_fails(MLA, lambda *a: mla_decode_step(*a, rope_scores=False), MLA_DECODE,
                 hint="leave out the RoPE channels")
    assert_fails(MLA, lambda *a: mla_decode_step(*a, bottom_right=False), MLA_CHUNK,
                 hint="aligned top-left")
    # a cache of keys and values per head, as exercise 2, is not what this exercise caches: it
    # cannot even be called with the latents
    assert_fails(MLA, lambda q, c, kr, cp, krp, *rest: decode_step(q, c, kr, cp, krp, *rest[2:]),
                 MLA_DECODE)


def test_mla_decode_step_may_not_call_the_package_or_a_library_attention():
    def with_the_module_rope(*args):
        course_attn.apply_rotary_emb(torch.zeros(1, 1, 1, 2), torch.ones(1, 1), torch.zeros(1, 1))
        return mla_decode_step(*args)
    assert_banned(MLA, with_the_module_rope, "course_attn")

    def with_sdpa(*args):
        F.scaled_dot_product_attention(*(torch.zeros(1, 1, 2, 2) for _ in range(3)))
        return mla_decode_step(*args)
    assert_banned(MLA, with_sdpa, "scaled_dot_product_attention")
