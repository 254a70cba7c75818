"""Hidden cases of chapter 8: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint
from course_attn.grading.ch08 import (SAVINGS, _agreement, _both, _chunks, _label, _mla_case,
                                      _step_case, first_divergence_reference, smallest_gap,
                                      toy_model)
from course_attn.grading.exercise import Case, hidden


def _shuffled(items, gen):
    return [items[i] for i in torch.randperm(len(items), generator=gen).tolist()]


def _other_than(n, low, high, gen):
    """An int in [low, high] other than ``n`` (high > low)."""
    m = randint(low, high - 1, gen)
    return m + 1 if m >= n else m


# ch08.fill_cache: a first chunk of 2 to 4 tokens (so moving the length on by one per chunk is
# wrong) and at least one chunk after it (so writing every chunk at 0, or returning the new
# chunk only, is wrong); one float32 case with room left over (the whole buffers are wrong)
# and one float64 case (float32 buffers are wrong).
def _sizes(case, first=0):
    """The lengths of a case's chunks, from chunk ``first`` on."""
    return [k.shape[2] for k in case.args[0][first:]]


@hidden("ch08.fill_cache", regimes={
    "float32 chunks": lambda case: case.args[0][0].dtype == torch.float32,
    "float64 chunks": lambda case: case.args[0][0].dtype == torch.float64,
    "room left after the last chunk (cache not full)":
        lambda case: case.args[2] > sum(_sizes(case, 0)),
    "room for exactly the chunks (cache full)":
        lambda case: case.args[2] == sum(_sizes(case, 0)),
    "single-token chunks after the first (decode steps)": lambda case: 1 in _sizes(case, 1),
    "a chunk of several tokens after the first (a chunked prefill)":
        lambda case: max(_sizes(case, 1)) > 1,
    "B > 1": lambda case: case.args[0][0].shape[0] > 1,
    "values of another width than the keys (Dv != D)":
        lambda case: case.args[1][0].shape[-1] != case.args[0][0].shape[-1],
})
def _(gen):
    b, h, d = randint(2, 3, gen), randint(1, 3, gen), randint(2, 6, gen)
    dv = _other_than(d, 1, 6, gen)
    later = _shuffled([1, randint(2, 3, gen)] + [randint(1, 3, gen)
                                                 for _ in range(randint(0, 2, gen))], gen)
    sizes = [randint(2, 4, gen)] + later
    room = sum(sizes) + randint(1, 4, gen)
    ks, vs = _chunks(sizes, b, h, d, dv, seed=gen)
    yield Case(f"chunks {sizes}, B={b}, H={h}, D={d}, Dv={dv}, room for {room}", (ks, vs, room))
    sizes = [randint(2, 4, gen)] + [randint(1, 3, gen) for _ in range(randint(1, 3, gen))]
    ks, vs = _chunks(sizes, 1, h, d, d, seed=gen, dtype=torch.float64)
    yield Case(f"float64 chunks {sizes}, room for exactly {sum(sizes)}", (ks, vs, sum(sizes)))


# ch08.decode_step: the cached length L > 0 in every case but the prefill (rotating at 0,
# rotating the cached keys again or leaving out the cache is wrong only there), chunks of
# T_new > 1 (a top-left or a missing causal mask is wrong only there), tables longer than
# the sequence in the decode step and the float64 chunk (the last rows of the tables are
# wrong only there), Dv = D in those two (rotating the values is wrong only there).
def _step(rule):
    """A regime of decode_step: ``rule`` of the sizes of a case (B, T_new, L, D, Dv, the P
    positions of the tables, the dtype)."""
    def inside(case):
        q, k_past, v_past, cos = case.args[0], case.args[3], case.args[4], case.args[5]
        return rule(B=q.shape[0], T_new=q.shape[2], L=k_past.shape[2], D=q.shape[-1],
                    Dv=v_past.shape[-1], P=cos.shape[0], dtype=q.dtype)
    return inside


@hidden("ch08.decode_step", regimes={
    "one new token (T_new = 1, a decode step)": _step(lambda T_new, **_: T_new == 1),
    "a chunk after a cache (T_new > 1, L > 0)": _step(lambda T_new, L, **_: T_new > 1 and L > 0),
    "an empty cache (L = 0, a prefill)": _step(lambda L, **_: L == 0),
    "tables longer than the sequence (P > L + T_new)":
        _step(lambda P, L, T_new, **_: P > L + T_new),
    "tables exactly as long as the sequence (P = L + T_new)":
        _step(lambda P, L, T_new, **_: P == L + T_new),
    "float32": _step(lambda dtype, **_: dtype == torch.float32),
    "float64": _step(lambda dtype, **_: dtype == torch.float64),
    "B > 1": _step(lambda B, **_: B > 1),
    "values of another width than the keys (Dv != D)": _step(lambda D, Dv, **_: Dv != D),
})
def _(gen):
    b, h, d = randint(2, 3, gen), randint(1, 3, gen), 2 * randint(2, 5, gen)
    length = randint(2, 9, gen)
    yield _step_case(f"decode step after L={length}, B={b}, H={h}, D={d}", b, h, length, 1, d, d,
                     randint(1, 6, gen), gen, "")
    t_new, dv = randint(2, 5, gen), _other_than(d, 1, 10, gen)
    yield _step_case(f"a chunk of {t_new} after L={length}, Dv={dv}, tables for "
                     f"{length + t_new} positions", randint(1, 2, gen), h, length, t_new, d, dv,
                     0, gen, "")
    t_new = randint(2, 5, gen)
    yield _step_case(f"float64, a chunk of {t_new} after L={length + 1}", 1, h, length + 1, t_new,
                     d, d, randint(1, 6, gen), gen, "", dtype=torch.float64)
    t_new = randint(2, 5, gen)
    yield _step_case(f"a prefill of {t_new} into an empty cache", randint(1, 2, gen), h, 0, t_new,
                     d, d, randint(0, 4, gen), gen, "")


# ch08.decode_savings: three sets of sizes on every seed, each inside its regimes. Grouped
# heads (1 < G < H) with a batch of prompts of different lengths and several new tokens: the
# central case, where neither the chapter's count of one sequence nor a count with C-wide keys
# and values is right. One key-value head (G = 1) and one prompt, several new tokens. As many
# key-value heads as query heads (G = H) with prompts of different lengths and one new token,
# where the generation is the padded prefill alone. Every count is a sum of at most N terms.

def _heads(gen, grouped):
    """(H, G): H a power of two from 4 to 32; G between 1 and H, or 1, or H."""
    power = randint(2, 5, gen)
    g = {"grouped": 2 ** randint(1, power - 1, gen), "one": 1, "all": 2 ** power}[grouped]
    return 2 ** power, g


def _prompts(gen, b):
    """``b`` prompt lengths from 1 to 1024, not all equal when b > 1."""
    while True:
        lengths = [randint(1, 1024, gen) for _ in range(b)]
        if b == 1 or len(set(lengths)) > 1:
            return lengths


def _model(gen, grouped):
    h, g = _heads(gen, grouped)
    return dict(L=randint(1, 48, gen), C=h * 2 ** randint(3, 7, gen), V=randint(16, 200_000, gen),
                H=h, G=g)


@hidden("ch08.decode_savings", regimes={
    "grouped heads: 1 < G < H": lambda case: 1 < case.kwargs["G"] < case.kwargs["H"],
    "one key-value head: G = 1": lambda case: case.kwargs["G"] == 1,
    "as many key-value heads as query heads: G = H":
        lambda case: case.kwargs["G"] == case.kwargs["H"],
    "prompts of different lengths (B > 1)": lambda case: len(set(case.kwargs["prompts"])) > 1,
    "one prompt (B = 1)": lambda case: len(case.kwargs["prompts"]) == 1,
    "several new tokens: N > 1": lambda case: case.kwargs["N"] > 1,
    "one new token: N = 1": lambda case: case.kwargs["N"] == 1,
}, central=("grouped heads: 1 < G < H", "prompts of different lengths (B > 1)"))
def _(gen):
    grouped = dict(_model(gen, "grouped"), prompts=_prompts(gen, randint(2, 5, gen)),
                   N=randint(2, 600, gen))
    single = dict(_model(gen, "one"), prompts=_prompts(gen, 1), N=randint(2, 600, gen))
    last = dict(_model(gen, "all"), prompts=_prompts(gen, randint(2, 4, gen)), N=1)
    yield from SAVINGS.cases(grouped, single, last)


# ch08.greedy_decode and ch08.first_divergence: toy models of drawn sizes (even D), drawn again
# while the largest two logits of a step of the buggy or the repaired loop come within 1e-6
# (float64 rounding cannot decide an argmax then). At least 4 new tokens in every case, so a
# decode step at the prompt's length is wrong by the second step; a prompt of one token only in
# one case, where rotating every token one position too far is a shift of the whole sequence
# (RoPE sees only differences) and goes unseen; one head and several heads.

def _toy(gen, prompt_len, n_new, heads):
    while True:
        params = toy_model(gen, vocab=randint(10, 32, gen), width=randint(8, 24, gen),
                           heads=heads, head_dim=2 * randint(2, 4, gen))
        prompt = torch.randint(params["embed"].shape[0], (prompt_len,), generator=gen)
        if smallest_gap(params, prompt, n_new) > 1e-6:
            return params, prompt, n_new


def _decode_label(args):
    return _label(*args)


@hidden("ch08.greedy_decode", regimes={
    "a prompt of one token (P = 1)": lambda case: case.args[1].shape[0] == 1,
    "a longer prompt (P > 1)": lambda case: case.args[1].shape[0] > 1,
    "one head (H = 1)": lambda case: case.args[0]["wq"].shape[0] == 1,
    "several heads (H > 1)": lambda case: case.args[0]["wq"].shape[0] > 1,
})
def _(gen):
    for prompt_len, heads in ((1, randint(1, 3, gen)), (randint(2, 8, gen), 1),
                              (randint(2, 8, gen), randint(2, 3, gen))):
        args = _toy(gen, prompt_len, randint(4, 14, gen), heads)
        yield Case(_decode_label(args), args)


def _first(case):
    return first_divergence_reference(*case.args)


def _chunks_of(case):
    return case.args[3]


@hidden("ch08.first_divergence", regimes={
    "the prompt in several chunks (chunk < P)":
        lambda case: _chunks_of(case) < case.args[1].shape[0],
    "the prompt in one chunk (chunk >= P)":
        lambda case: _chunks_of(case) >= case.args[1].shape[0],
    "the first new token already differs (answer 0)": lambda case: _first(case) == 0,
    "the first decode step differs (answer 1)": lambda case: _first(case) == 1,
    "agree for a while, then differ (1 < answer < n_new)":
        lambda case: 1 < _first(case) < case.args[2],
    "never differ in n_new tokens (answer n_new)": lambda case: _first(case) == case.args[2],
}, central=("the prompt in several chunks (chunk < P)",))
def _(gen):
    # what each draw must show, with several chunks (chunk < P) or one, and the most new tokens
    # it draws: the first new token differs and a later one agrees (so counting every
    # agreement is wrong); agree, then differ; the first decode step differs and a later one
    # agrees; agree all the way (short, or the draws would seldom get there)
    wanted = ((True, 12, lambda first, every, n: first == 0 and every > 0),
              (True, 12, lambda first, every, n: 1 < first < n),
              (False, 12, lambda first, every, n: first == 1 and every > 1),
              (False, 6, lambda first, every, n: first == n))
    for several, most, inside in wanted:
        while True:
            prompt_len = randint(3 if several else 1, 8, gen)
            params = toy_model(gen, vocab=randint(10, 32, gen), width=randint(8, 24, gen),
                               heads=randint(1, 3, gen), head_dim=2 * randint(2, 4, gen))
            prompt = torch.randint(params["embed"].shape[0], (prompt_len,), generator=gen)
            chunk = randint(1, prompt_len - 1, gen) if several else \
                randint(prompt_len, prompt_len + 3, gen)
            args = (params, prompt, randint(4, most, gen), chunk)
            logits = _both(*args)
            if smallest_gap(*args, logits=logits) > 1e-6 and \
                    inside(*_agreement(*args, logits=logits), args[2]):
                break
        yield Case(f"{_decode_label(args[:3])}; prefill chunks of {chunk}", args)


# ch08.mla_decode_step: as decode_step's, with the MLA sizes drawn apart (D, Dr even, Dc, not
# all equal); the cached length L > 0 in all but the prefill (rotating at 0, rotating the cached
# RoPE keys again or a top-left mask are wrong only there).
def _mla(rule):
    """A regime of mla_decode_step: ``rule`` of the sizes of a case."""
    def inside(case):
        q, c_past, w_uk, cos = case.args[0], case.args[3], case.args[5], case.args[7]
        return rule(H=w_uk.shape[0], T_new=q.shape[2], L=c_past.shape[1], P=cos.shape[0],
                    dtype=q.dtype)
    return inside


@hidden("ch08.mla_decode_step", regimes={
    "one new token after a cache (T_new = 1, L > 0)":
        _mla(lambda T_new, L, **_: T_new == 1 and L > 0),
    "a chunk after a cache (T_new > 1, L > 0)": _mla(lambda T_new, L, **_: T_new > 1 and L > 0),
    "an empty cache (L = 0, a prefill)": _mla(lambda L, **_: L == 0),
    "one head (H = 1)": _mla(lambda H, **_: H == 1),
    "several heads (H > 1)": _mla(lambda H, **_: H > 1),
    "tables longer than the sequence (P > L + T_new)":
        _mla(lambda P, L, T_new, **_: P > L + T_new),
    "tables exactly as long as the sequence (P = L + T_new)":
        _mla(lambda P, L, T_new, **_: P == L + T_new),
    "float32": _mla(lambda dtype, **_: dtype == torch.float32),
    "float64": _mla(lambda dtype, **_: dtype == torch.float64),
})
def _(gen):
    def sizes():
        return 2 * randint(1, 4, gen), 2 * randint(1, 3, gen), randint(2, 9, gen)
    length = randint(2, 9, gen)
    d, dr, dc = sizes()
    yield _mla_case(f"decode step after L={length}, H=1, D={d}, Dr={dr}, Dc={dc}",
                    randint(1, 3, gen), 1, length, 1, d, dr, dc, randint(1, 6, gen), gen, "")
    d, dr, dc = sizes()
    t_new, h = randint(2, 5, gen), randint(2, 4, gen)
    yield _mla_case(f"a chunk of {t_new} after L={length}, H={h}, D={d}, Dr={dr}, Dc={dc}, "
                    f"tables for {length + t_new} positions", randint(1, 2, gen), h, length,
                    t_new, d, dr, dc, 0, gen, "")
    d, dr, dc = sizes()
    t_new = randint(2, 5, gen)
    yield _mla_case(f"float64, a chunk of {t_new} after L={length + 1}", 1, randint(1, 3, gen),
                    length + 1, t_new, d, dr, dc, randint(1, 6, gen), gen, "",
                    dtype=torch.float64)
    d, dr, dc = sizes()
    t_new = randint(2, 5, gen)
    yield _mla_case(f"a prefill of {t_new} into an empty cache", randint(1, 2, gen),
                    randint(2, 3, gen), 0, t_new, d, dr, dc, randint(0, 4, gen), gen, "")
