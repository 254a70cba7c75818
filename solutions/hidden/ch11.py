"""Hidden cases of chapter 11: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint
from course_attn.grading.ch11 import BUDGET, _block_case, decode_case
from course_attn.grading.exercise import Case, hidden


# ch11.window_mask: a square case with W < T (one key too many or too few, a window both ways
# and a causal mask only are wrong there), Tq < Tk and Tq > Tk + 1 (top-left is wrong there).
def _window(rule):
    """A regime of window_mask: ``rule`` of (tq, tk, w)."""
    return lambda case: rule(*case.args)


@hidden("ch11.window_mask", regimes={
    "Tq = Tk, W < T": _window(lambda tq, tk, w: tq == tk and w < tk),
    "Tq < Tk (queries at the end of the keys)": _window(lambda tq, tk, w: 1 < tq < tk),
    "Tq > Tk by more than one (rows with no key)": _window(lambda tq, tk, w: tq > tk + 1),
    "Tq = 1 (one decoding step)": _window(lambda tq, tk, w: tq == 1),
    "W = Tk (the window just covers the keys)": _window(lambda tq, tk, w: w == tk),
    "W > Tk (a causal mask)": _window(lambda tq, tk, w: w > tk),
    "W = 1 (each query sees itself only)": _window(lambda tq, tk, w: w == 1),
})
def _(gen):
    t, w = randint(3, 12, gen), randint(2, 5, gen)
    w = min(w, t - 1)
    yield Case(f"square, T={t}, W={w}", (t, t, w))
    tk = randint(w + 2, 14, gen)
    tq = randint(2, tk - 1, gen)
    yield Case(f"Tq={tq}, Tk={tk}, W={w}", (tq, tk, w))
    tk = randint(2, 10, gen)
    tq = tk + randint(2, 6, gen)
    yield Case(f"Tq={tq}, Tk={tk}, W={w}", (tq, tk, w))
    wide = t + randint(1, 4, gen)
    yield Case(f"W wider than T: T={t}, W={wide}", (t, t, wide))
    tk = randint(2, 12, gen)
    yield Case(f"Tq=1, Tk={tk}, W={tk}", (1, tk, tk))
    tq = randint(2, 10, gen)
    tk = tq + randint(0, 3, gen)
    yield Case(f"W=1, Tq={tq}, Tk={tk}", (tq, tk, 1))
    # the edges, on every seed: the largest gap on a single key; one query short of square at
    # the longest length; a window one key short of the keys, and just covering them
    yield Case("Tq=9, Tk=1, W=3", (9, 1, 3))
    yield Case("Tq=13, Tk=14, W=4", (13, 14, 4))
    yield Case("square, T=14, W=13", (14, 14, 13))
    yield Case("Tq=12, Tk=14, W=14", (12, 14, 14))


# ch11.rolling_index: sinks not a multiple of the rolling slots (there, a turn counted from 0
# or from ``sinks`` would agree); a sink itself (rolling the sinks is wrong there); positions
# at and past the first wrap (a sink overwritten, the sinks' slots left out, the wrong phase
# or slots past the buffer are each wrong on one of them).
def _slot(rule):
    """A regime of rolling_index: ``rule`` of (position, size, sinks)."""
    return lambda case: rule(*case.args)


@hidden("ch11.rolling_index", regimes={
    "a sink itself (position < sinks)": _slot(lambda p, n, s: p < s),
    "before the first wrap (sinks <= position < size)": _slot(lambda p, n, s: s <= p < n),
    "the first wrap (position = size)": _slot(lambda p, n, s: p == n),
    "a whole number of turns past the first wrap": _slot(
        lambda p, n, s: p > n and (p - s) % (n - s) == 0),
    "more than a turn past the first wrap, in the middle of a turn": _slot(
        lambda p, n, s: p > n + (n - s) and (p - s) % (n - s) != 0),
    "sinks, not a multiple of the rolling slots": _slot(lambda p, n, s: s % (n - s) != 0),
    "no sinks": _slot(lambda p, n, s: s == 0),
})
def _(gen):
    rolling = randint(2, 7, gen)
    sinks = rolling * randint(0, 1, gen) + randint(1, rolling - 1, gen)
    size = sinks + rolling
    for position in (randint(0, sinks - 1, gen), randint(sinks, size - 1, gen), size,
                     sinks + rolling * randint(2, 5, gen),
                     sinks + randint(1, rolling - 1, gen) + rolling * randint(2, 9, gen),
                     randint(size, 200, gen),
                     # the edges, on every seed: the last sink, the first and the last slot
                     # before the wrap, the first position after it
                     sinks - 1, sinks, size - 1, size + 1):
        yield Case(f"position {position}, size {size}, {sinks} sinks", (position, size, sinks))
    size = randint(2, 8, gen)
    position = randint(size, 60, gen)
    yield Case(f"position {position}, size {size}, no sinks", (position, size, 0))
    yield Case(f"position {size - 1}, size {size}, no sinks", (size - 1, size, 0))


# ch11.local_attention_block: a block longer than the window whose reach starts inside the
# sequence (one key too late, W + 1 keys, only the future masked, top-left, the block at 0
# are each wrong there); the keys out of reach NaN, with keys after the block too (reading
# them is wrong there); a window reaching past position 0.
def _block(rule):
    """A regime of local_attention_block: ``rule`` of (q, k, v, start, window)."""
    return lambda case: bool(rule(*case.args))


@hidden("ch11.local_attention_block", regimes={
    "the reach starts inside the sequence (start >= W - 1)":
        _block(lambda q, k, v, start, w: start >= w - 1),
    "the reach is cut at position 0 (start < W - 1)":
        _block(lambda q, k, v, start, w: start < w - 1),
    "a block longer than the window (Tb > W)": _block(lambda q, k, v, start, w: q.shape[2] > w),
    "a block no longer than the window (Tb <= W)":
        _block(lambda q, k, v, start, w: q.shape[2] <= w),
    "keys out of reach hold NaN": _block(lambda q, k, v, start, w: k.isnan().any()),
    "values of another width than the keys (Dv != D)":
        _block(lambda q, k, v, start, w: v.shape[-1] != k.shape[-1]),
    "float32": _block(lambda q, k, v, start, w: q.dtype == torch.float32),
    "float64": _block(lambda q, k, v, start, w: q.dtype == torch.float64),
})
def _(gen):
    b, h, d = randint(1, 2, gen), randint(1, 3, gen), randint(2, 8, gen)
    w = randint(2, 4, gen)
    tb = w + randint(1, 3, gen)
    start = randint(w, 3 * w, gen)
    t = start + tb + randint(0, 6, gen)
    yield _block_case(f"start={start}, Tb={tb}, T={t}, W={w}", b, h, t, tb, start, w, d, d, gen,
                      "")
    w = randint(2, 6, gen)
    tb, start = randint(2, w, gen), randint(w, 3 * w, gen)
    t = start + tb + randint(1, 6, gen)
    dv = randint(1, d - 1, gen) if d > 2 else d + randint(1, 4, gen)
    yield _block_case(f"keys out of reach are NaN: start={start}, Tb={tb}, T={t}, W={w}, "
                      f"Dv={dv}", 1, h, t, tb, start, w, d, dv, gen, "", poison=True)
    w = randint(3, 8, gen)
    tb, start = randint(2, 6, gen), randint(1, w - 2, gen)
    t = start + tb + randint(0, 4, gen)
    yield _block_case(f"float64, start={start}, Tb={tb}, T={t}, W={w}", 1, 1, t, tb, start, w,
                      d, d, gen, "", dtype=torch.float64)


# ch11.window_budget: one set of sizes in each regime, on every seed, the rest drawn at random
# inside it (W from 16 to 4096, L from 2 to 64, so that one layer or W per layer is wrong):
# 1. W divides T, T = k·W with k >= 2: the layers overshoot position 0; grouped-query
#    attention (H = g·H_kv, g >= 2).
# 2. The layers reach position 0 exactly, T - 1 = k·(W - 1) (W does not divide T), where
#    leaving out the position itself needs one layer more; multi-query (H_kv = 1).
# 3. T past a multiple of W - 1 and short of the next one: the layers overshoot, T at
#    random in between (W divides it only by chance); grouped-query attention.
# 4. A sequence no longer than the window: one layer covers it, and every query sees
#    every key before it (the full causal count); grouped-query attention.
# H != H_kv everywhere, so sizing the cache for the query heads is wrong.
def _sized(rule):
    """A regime of window_budget: ``rule`` of the sizes T, W, L, H, H_kv, D, nbytes."""
    return lambda case: rule(**case.kwargs)


@hidden("ch11.window_budget", regimes={
    "W divides T (T = k·W, k >= 2), grouped-query":
        _sized(lambda T, W, H_kv, **_: T % W == 0 and T >= 2 * W and H_kv > 1),
    "the layers reach position 0 exactly ((T - 1) % (W - 1) = 0, T > W), multi-query":
        _sized(lambda T, W, H_kv, **_: (T - 1) % (W - 1) == 0 and T > W and H_kv == 1),
    "T between multiples of W - 1, T > W, grouped-query":
        _sized(lambda T, W, H_kv, **_: (T - 1) % (W - 1) != 0 and T > W and H_kv > 1),
    "a sequence no longer than the window (T <= W)": _sized(lambda T, W, **_: T <= W),
})
def _(gen):
    def model(h_kv):
        return dict(L=randint(2, 64, gen), H=h_kv * randint(2, 8, gen), H_kv=h_kv,
                    D=16 * randint(2, 16, gen), nbytes=2 * randint(1, 2, gen))

    w = randint(16, 4096, gen)
    sizes = [dict(T=w * randint(2, 8, gen), W=w, **model(randint(2, 8, gen)))]
    w = randint(16, 4096, gen)
    sizes.append(dict(T=(w - 1) * randint(2, 8, gen) + 1, W=w, **model(1)))
    w = randint(16, 4096, gen)
    sizes.append(dict(T=(w - 1) * randint(1, 7, gen) + 1 + randint(1, w - 2, gen), W=w,
                      **model(randint(2, 8, gen))))
    w = randint(16, 4096, gen)
    sizes.append(dict(T=randint(2, w, gen), W=w, **model(randint(2, 8, gen))))
    yield from BUDGET.cases(*sizes)


# ch11.window_decode: every seed draws a sequence longer than the window (W >= 2, so the
# buffer fills and then slides: scoring the unwritten slots, missing the token itself while it
# fills and dropping the window are each wrong there), one no longer than the window (the
# buffer never full), values of another width than the keys, and both dtypes.
def _decode(rule):
    """A regime of window_decode: ``rule`` of (q, v, window, t)."""
    return lambda case: bool(rule(case.args[0], case.args[2], case.args[3],
                                  case.args[0].shape[2]))


@hidden("ch11.window_decode", regimes={
    "the window slides (T > W >= 2)": _decode(lambda q, v, w, t: t > w >= 2),
    "the buffer never fills (T <= W)": _decode(lambda q, v, w, t: t <= w),
    "values of another width than the keys (Dv != D)":
        _decode(lambda q, v, w, t: v.shape[-1] != q.shape[-1]),
    "float32": _decode(lambda q, v, w, t: q.dtype == torch.float32),
    "float64": _decode(lambda q, v, w, t: q.dtype == torch.float64),
})
def _(gen):
    b, h, d = randint(1, 2, gen), randint(1, 3, gen), randint(2, 8, gen)
    w = randint(2, 6, gen)
    t = w + randint(2, 10, gen)
    yield decode_case(f"T={t}, W={w}, B={b}, H={h}, D={d}", b, h, t, w, d, d, gen)
    w = randint(3, 9, gen)
    t = randint(2, w, gen)
    dv = randint(1, d - 1, gen) if d > 2 else d + randint(1, 4, gen)
    yield decode_case(f"float64, T={t}, W={w}, Dv={dv}", 1, h, t, w, d, dv, gen,
                      dtype=torch.float64)


# ch11.receptive_field: one model in each regime, on every seed (the model's seed drawn too),
# L from 1 to 5 layers and W from 2 to 8: the reach ends inside the sequence, T - 1 =
# L·(W - 1) + e with e in 1 .. L·(W - 1) (a window one key too wide or too narrow, a mask
# only causal and the number of positions instead of the earliest are each wrong there:
# e = L·(W - 1) + 1 would make the count equal the position, so e stays below it); it ends
# exactly at position 0; it would end before 0, and is cut there.
def _reach(rule):
    """A regime of receptive_field: ``rule`` of (layers, window, length)."""
    return lambda case: bool(rule(*case.args[:3]))


# And two models the chapter has no formula for: a window of its own for every layer, dilated
# (layer l's keys spaced d_l apart), reaching inside the sequence; and even dilations whose reach
# would pass position 0 on a sequence of even length: every position reachable from T - 1 is odd,
# so position 0 is skipped, and where the reach stops depends on which sums of the steps fit.
def _plain(case):
    return isinstance(case.args[1], int) and len(case.args) == 4


@hidden("ch11.receptive_field", regimes={
    "the reach ends inside the sequence (T - 1 > L·(W - 1))":
        lambda case: _plain(case) and _reach(lambda L, W, T: T - 1 > L * (W - 1))(case),
    "the reach ends exactly at position 0 (T - 1 = L·(W - 1))":
        lambda case: _plain(case) and _reach(lambda L, W, T: T - 1 == L * (W - 1))(case),
    "the reach is cut at position 0 (T - 1 < L·(W - 1))":
        lambda case: _plain(case) and _reach(lambda L, W, T: T - 1 < L * (W - 1))(case),
    "a window and a dilation of its own for every layer": lambda case: not _plain(case) and
        1 in case.args[4],
    "even dilations whose reach skips position 0": lambda case: not _plain(case) and
        all(d % 2 == 0 for d in case.args[4]),
}, central=("a window and a dilation of its own for every layer",
            "even dilations whose reach skips position 0"))
def _(gen):
    def model():
        return randint(1, 5, gen), randint(2, 8, gen), randint(0, 10_000, gen)

    layers, w, seed = model()
    t = layers * (w - 1) + 1 + randint(1, layers * (w - 1), gen)
    yield Case(f"L={layers}, W={w}, T={t}", (layers, w, t, seed))
    layers, w, seed = model()
    t = layers * (w - 1) + 1
    yield Case(f"L={layers}, W={w}, T={t}", (layers, w, t, seed))
    layers, w, seed = model()
    layers = max(layers, 2)
    t = randint(2, layers * (w - 1), gen)
    yield Case(f"L={layers}, W={w}, T={t}", (layers, w, t, seed))
    layers, _, seed = model()
    windows = [randint(2, 6, gen) for _ in range(layers)]
    dilations = [1] + [randint(1, 3, gen) for _ in range(layers - 1)]
    reach = sum(d * (w - 1) for w, d in zip(windows, dilations))
    t = reach + 1 + randint(1, 8, gen)                              # ends inside
    yield Case(f"L={layers}, windows {windows}, dilations {dilations}, T={t}",
               (layers, windows, t, seed, dilations))
    layers, _, seed = model()
    windows = [randint(2, 5, gen) for _ in range(layers)]
    dilations = [2 * randint(1, 2, gen) for _ in range(layers)]
    reach = sum(d * (w - 1) for w, d in zip(windows, dilations))
    t = 2 * randint((reach + 2) // 4, reach // 2, gen)              # even, T - 1 < reach
    yield Case(f"L={layers}, windows {windows}, dilations {dilations}, T={t}",
               (layers, windows, t, seed, dilations))
