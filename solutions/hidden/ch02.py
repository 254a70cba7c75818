"""Hidden cases of chapter 2: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md).

Each generator names its regimes (``@hidden(key, regimes={...})``, predicates on a case) and
draws a case inside every one of them on every seed; ``tests/test_hidden_regimes.py`` checks it.
"""

import math

import torch

from course_attn.grading.cases import randint, randn
from course_attn.grading.exercise import Case, hidden

EXP_MAX = 709.0     # exp overflows past it in float64 (88.7 in float32)


def _uniform(low: float, high: float, gen) -> float:
    return low + (high - low) * float(torch.rand((), generator=gen, dtype=torch.float64))


def _tq(case):
    return case.args[0].shape[-2]


def _tk(case):
    return case.args[1].shape[-2]


def _scale(case):
    """The scale a case asks for: its ``scale``, or 1/sqrt(D)."""
    scale = case.kwargs.get("scale")
    return 1.0 / math.sqrt(case.args[0].shape[-1]) if scale is None else scale


# --- attention_scores --------------------------------------------------------------------------

@hidden("ch02.attention_scores", regimes={
    "Tq = Tk": lambda case: _tq(case) == _tk(case),
    "Tq < Tk": lambda case: _tq(case) < _tk(case),
    "Tq > Tk": lambda case: _tq(case) > _tk(case),
    "Tq = 1 (one query)": lambda case: _tq(case) == 1,
    "(B, H, T, D) inputs": lambda case: case.args[0].dim() == 4,
    "(B, T, D) inputs (no head axis)": lambda case: case.args[0].dim() == 3,
    "the default scale, 1/sqrt(D)": lambda case: case.kwargs.get("scale") is None,
    "a scale given": lambda case: case.kwargs.get("scale") is not None,
    "float32": lambda case: case.args[0].dtype == torch.float32,
    "float64": lambda case: case.args[0].dtype == torch.float64,
})
def _(gen):
    # D >= 2 and D != Tq where the scale is the default: D = 1 hides a missing or wrong power of
    # D, D = Tq a scale of 1/sqrt(Tq). A given scale is not 1 (hides 1/scale) nor 1/sqrt(D).
    def d_not(tq):
        d = randint(2, 16, gen)
        return d + 1 if d == tq else d

    b, h, tk = randint(1, 3, gen), randint(1, 4, gen), randint(3, 9, gen)
    tq = randint(2, tk - 1, gen)
    d = d_not(tq)
    yield Case(f"B={b}, H={h}, Tq={tq} < Tk={tk}, D={d}",
               (randn(b, h, tq, d, seed=gen), randn(b, h, tk, d, seed=gen)))
    b, h, tk = randint(1, 3, gen), randint(1, 4, gen), randint(2, 6, gen)
    tq = tk + randint(1, 4, gen)
    d = d_not(tq)
    yield Case(f"B={b}, H={h}, Tq={tq} > Tk={tk}, D={d}, float64",
               (randn(b, h, tq, d, seed=gen, dtype=torch.float64),
                randn(b, h, tk, d, seed=gen, dtype=torch.float64)))
    b, t, d = randint(1, 3, gen), randint(2, 9, gen), randint(2, 16, gen)
    scale = round(_uniform(1.5, 3.0, gen), 3) if randint(0, 1, gen) else \
        round(_uniform(0.05, 0.2, gen), 3)
    yield Case(f"scale={scale}, no head axis, Tq=Tk={t}",
               (randn(b, t, d, seed=gen), randn(b, t, d, seed=gen)), {"scale": scale})
    b, h, tk, d = randint(1, 3, gen), randint(1, 4, gen), randint(2, 9, gen), randint(2, 16, gen)
    yield Case(f"one query, B={b}, H={h}, Tk={tk}, D={d}",
               (randn(b, h, 1, d, seed=gen), randn(b, h, tk, d, seed=gen)))


# --- stable_softmax ----------------------------------------------------------------------------

def _dim(case):
    return case.kwargs.get("dim", -1) % case.args[0].dim()


def _slices(case):
    """The input with the softmax's axis last, flattened to (slices, n)."""
    x = case.args[0]
    return x.movedim(_dim(case), -1).reshape(-1, x.shape[_dim(case)])


def _finite_max(case):
    x = case.args[0]
    finite = x[x.isfinite()]
    return float(finite.abs().max()) if finite.numel() else 0.0


def _gap(case):
    """How far below the whole tensor's maximum the lowest slice's maximum lies (finite ones)."""
    top = _slices(case).amax(dim=-1)
    top = top[top.isfinite()]
    return float(top.max() - top.min()) if top.numel() else 0.0


@hidden("ch02.stable_softmax", regimes={
    "dim is the last axis": lambda case: _dim(case) == case.args[0].dim() - 1,
    "dim is not the last axis": lambda case: _dim(case) != case.args[0].dim() - 1,
    "a square input (a max or sum without keepdim broadcasts silently)":
        lambda case: case.args[0].dim() == 2 and case.args[0].shape[0] == case.args[0].shape[1],
    "entries in the hundreds (exp overflows)": lambda case: _finite_max(case) > 100,
    "slices more than 1000 apart (one maximum for all underflows a slice)":
        lambda case: _gap(case) > 1000,
    "a slice that is all -inf (gives zeros)":
        lambda case: bool(_slices(case).isneginf().all(dim=-1).any()),
    "-inf entries in a slice with finite ones": lambda case: bool(
        (_slices(case).isneginf().any(dim=-1) & _slices(case).isfinite().any(dim=-1)).any()),
    "one entry along dim": lambda case: case.args[0].shape[_dim(case)] == 1,
    "float32": lambda case: case.args[0].dtype == torch.float32,
    "float64": lambda case: case.args[0].dtype == torch.float64,
}, central=("dim is the last axis",))
def _(gen):
    rows = randint(2, 6, gen)
    # not square: rows and columns of one-hot weights would otherwise agree for a permutation
    x = randn(randint(1, 5, gen), rows, rows + randint(1, 3, gen), seed=gen, scale=400.0)
    dim = -2 if randint(0, 1, gen) else 1
    yield Case(f"shape {tuple(x.shape)} with entries in the hundreds, dim={dim}", (x,),
               {"dim": dim})
    r, c = randint(2, 5, gen), randint(2, 7, gen)
    y = randn(r, c, seed=gen, dtype=torch.float64)
    dead, partial = torch.randperm(r, generator=gen)[:2].tolist()
    y[dead] = float("-inf")
    y[partial, torch.randperm(c, generator=gen)[:randint(1, c - 1, gen)]] = float("-inf")
    yield Case(f"float64 ({r}, {c}) with an all -inf row and some -inf entries", (y,))
    n = randint(2, 6, gen)
    yield Case(f"a square ({n}, {n}) input", (randn(n, n, seed=gen, scale=3.0),))
    r, c = randint(3, 5, gen), randint(2, 7, gen)
    far = randn(r, c, seed=gen, scale=10.0)
    far += 1000.0 * torch.randperm(r, generator=gen)[:, None].float() - 1000.0 * (r // 2)
    yield Case(f"({r}, {c}): rows ~1000 apart, from -{1000 * (r // 2)} to "
               f"+{1000 * (r - 1 - r // 2)}", (far,))
    shape = (randint(1, 4, gen), 1)
    yield Case(f"one entry per row, shape {shape}, float64",
               (randn(*shape, seed=gen, scale=5.0, dtype=torch.float64),))


# --- attention ---------------------------------------------------------------------------------

@hidden("ch02.attention", regimes={
    "Tq = Tk": lambda case: _tq(case) == _tk(case),
    "Tq < Tk": lambda case: _tq(case) < _tk(case),
    "Tq > Tk": lambda case: _tq(case) > _tk(case),
    "Tq = 1 (one query)": lambda case: _tq(case) == 1,
    "Dv != D": lambda case: case.args[2].shape[-1] != case.args[0].shape[-1],
    "the default scale, 1/sqrt(D)": lambda case: case.kwargs.get("scale") is None,
    "a scale given, not 0": lambda case: case.kwargs.get("scale") not in (None, 0.0),
    "scale = 0.0 (uniform weights; not the default)": lambda case: case.kwargs.get("scale") == 0,
    "float32": lambda case: case.args[0].dtype == torch.float32,
    "float64": lambda case: case.args[0].dtype == torch.float64,
    "large scores (|q kᵀ · scale| past 709, float64)": lambda case: bool(
        (case.args[0] @ case.args[1].transpose(-2, -1) * _scale(case)).abs().max() > EXP_MAX),
})
def _(gen):
    # Tk >= 2 and D >= 2 everywhere: one key or D = 1 hide a wrong scale; Tq >= 2 except in the
    # one-query case (a softmax over the queries needs two); Dv != D where the scale is the
    # default (a scale taken from v shows).
    def qkv(b, h, tq, tk, d, dv, dtype=torch.float32):
        return (randn(b, h, tq, d, seed=gen, dtype=dtype),
                randn(b, h, tk, d, seed=gen, dtype=dtype),
                randn(b, h, tk, dv, seed=gen, dtype=dtype))

    def sizes():
        return randint(1, 3, gen), randint(1, 4, gen), randint(2, 16, gen)

    b, h, d = sizes()
    tk = randint(3, 9, gen)
    tq, dv = randint(2, tk - 1, gen), d + randint(1, 8, gen)
    yield Case(f"B={b}, H={h}, Tq={tq} < Tk={tk}, D={d}, Dv={dv}", qkv(b, h, tq, tk, d, dv))
    b, h, d = sizes()
    tk = randint(2, 6, gen)
    tq, dv = tk + randint(1, 4, gen), randint(1, d - 1, gen)
    yield Case(f"B={b}, H={h}, Tq={tq} > Tk={tk}, D={d}, Dv={dv}, float64",
               qkv(b, h, tq, tk, d, dv, torch.float64))
    b, h, d = sizes()
    t = randint(2, 9, gen)
    yield Case(f"float64, scale=0.0 (uniform weights), Tq=Tk={t}",
               qkv(b, h, t, t, d, d, torch.float64), {"scale": 0.0})
    b, h, d = sizes()
    tk, scale = randint(2, 9, gen), round(_uniform(1.2, 2.5, gen), 3)
    yield Case(f"one query, Tk={tk}, D={d}, scale={scale}",
               qkv(b, h, 1, tk, d, randint(1, 16, gen)), {"scale": scale})
    b, h, d = sizes()
    t = randint(2, 6, gen)
    q, k, v = qkv(b, h, t, t, d, d + randint(1, 4, gen), torch.float64)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)
    q = q * (_uniform(1000.0, 4000.0, gen) / float(scores.abs().max()))
    yield Case(f"large scores (|q kᵀ/√D| in the thousands), T={t}, float64", (q, k, v))


# --- softmax_backward --------------------------------------------------------------------------

def _backward_dim(case):
    return case.kwargs.get("dim", -1) % case.args[0].dim()


def _weights(case):
    """y with the softmax's axis last, flattened to (slices, n)."""
    y = case.args[0]
    return y.movedim(_backward_dim(case), -1).reshape(-1, y.shape[_backward_dim(case)])


@hidden("ch02.softmax_backward", regimes={
    "dim is the last axis": lambda case: _backward_dim(case) == case.args[0].dim() - 1,
    "dim is not the last axis": lambda case: _backward_dim(case) != case.args[0].dim() - 1,
    "a square input (a sum without keepdim broadcasts silently)":
        lambda case: case.args[0].dim() == 2 and case.args[0].shape[0] == case.args[0].shape[1],
    "masked keys (weights exactly 0)": lambda case: bool((case.args[0] == 0).any()),
    "saturated slices (one weight above 0.999)":
        lambda case: bool((_weights(case).amax(dim=-1) > 0.999).any()),
    "float32": lambda case: case.args[0].dtype == torch.float32,
    "float64": lambda case: case.args[0].dtype == torch.float64,
})
def _(gen):
    from course_attn import softmax

    shape = (randint(1, 4, gen), randint(2, 6, gen), randint(2, 7, gen))
    dim = randint(0, 1, gen)  # not the last axis: the other cases take that one
    y = softmax(randn(*shape, seed=gen, scale=3.0, dtype=torch.float64), dim=dim)
    yield Case(f"shape {shape}, dim={dim}, float64", (y, randn(*shape, seed=gen,
                                                               dtype=torch.float64)),
               {"dim": dim})
    n = randint(2, 8, gen)
    x = randn(n, n, seed=gen)
    x[randint(0, n - 1, gen), randint(0, n - 1, gen)] = float("-inf")
    yield Case(f"a square ({n}, {n}) input with a masked key", (softmax(x, dim=-1),
                                                              randn(n, n, seed=gen)))
    r, c = randint(2, 5, gen), randint(3, 8, gen)
    x = randn(r, c, seed=gen, scale=3.0, dtype=torch.float64)
    top = torch.randint(0, c, (r,), generator=gen)
    x[torch.arange(r), top] = x.amax(dim=-1) + 10.0 + randn(r, seed=gen, dtype=torch.float64).abs()
    dim = -1 if randint(0, 1, gen) else 1
    yield Case(f"saturated rows (one weight ≈ 1), ({r}, {c}), dim={dim}, float64",
               (softmax(x, dim=-1), randn(r, c, seed=gen, dtype=torch.float64)), {"dim": dim})


# --- attention_cost ----------------------------------------------------------------------------

@hidden("ch02.attention_cost", regimes={
    "Tq = Tk (self-attention)": lambda case: case.args[2] == case.args[3],
    "Tq < Tk (queries against a longer cache)": lambda case: 1 < case.args[2] < case.args[3],
    "Tq = 1 (one decoding step)": lambda case: case.args[2] == 1,
    "Tq > Tk (cross-attention to a shorter memory)": lambda case: case.args[2] > case.args[3],
    "D = Dv": lambda case: case.args[4] == case.args[5],
    "D != Dv": lambda case: case.args[4] != case.args[5],
    "B = 1": lambda case: case.args[0] == 1,
    "2 bytes a number (float16, bfloat16)": lambda case: case.args[6] == 2,
    "4 bytes a number (float32)": lambda case: case.args[6] == 4,
    "1 or 8 bytes a number (fp8, float64)": lambda case: case.args[6] in (1, 8),
})
def _(gen):
    # B > 1 and H > 1 in all but the first case and D != Dv in them (leaving B, H or Dv out
    # shows); D = Dv in the first (where the mistake of half the FLOPs is told apart); bytes of
    # 2 in two cases (counting numbers, or 4 bytes for every dtype, shows).
    def heads_and_dims(same):
        d = 16 * randint(1, 8, gen)
        return randint(2, 64, gen), d, d if same else d + 16 * randint(1, 8, gen)

    h, d, dv = heads_and_dims(same=True)
    t = 1024 * randint(1, 128, gen)
    yield Case(f"B=1, H={h}, T={t}, D=Dv={d}, 2 bytes", (1, h, t, t, d, dv, 2))
    b, (h, d, dv) = randint(2, 8, gen), heads_and_dims(same=False)
    tk = randint(3, 4096, gen)
    tq = randint(2, tk - 1, gen)
    yield Case(f"B={b}, H={h}, Tq={tq}, Tk={tk}, D={d}, Dv={dv}, 4 bytes",
               (b, h, tq, tk, d, dv, 4))
    b, (h, d, dv) = randint(2, 8, gen), heads_and_dims(same=False)
    size, tk = (1, 8)[randint(0, 1, gen)], randint(2, 32768, gen)
    yield Case(f"one decoding step, B={b}, H={h}, Tk={tk}, D={d}, Dv={dv}, {size} bytes",
               (b, h, 1, tk, d, dv, size))
    b, (h, d, dv) = randint(2, 8, gen), heads_and_dims(same=False)
    tk = randint(1, 2048, gen)
    tq = tk + randint(1, 4096, gen)
    yield Case(f"cross-attention, B={b}, H={h}, Tq={tq}, Tk={tk}, D={d}, Dv={dv}, 2 bytes",
               (b, h, tq, tk, d, dv, 2))
