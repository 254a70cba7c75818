"""Honest but unusual submissions of the real chapters score full marks, with no flag.

Each submission is a solution notebook (``solutions/NN_*.ipynb``) with some solution cells
replaced by another correct answer and extra cells added, as students write them: imports from
torch and the standard library (the chapter's own ``from torch.nn.attention.bias import
causal_lower_right`` among them), ``torch._dynamo``, ``torch.compile``, threads, helper functions
and classes, plots, progress bars, magics, unicode, very long cells, loops or ``einsum`` instead
of vectorised code, seeds and changed torch defaults; and (issue 18) a variable named
``compile``, a cProfile decorator on a correct function, ``torch.compile`` on a helper, and a
helper module kept beside the notebook. Issue 8 found the earlier grader taking
such notebooks for tampering (0 of 10 for one import); here every one must score every point of
its chapter (whatever exercises the chapter has by now) and carry no flag.

All of them are graded in one call, two at a time, with the grader's default limits.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))

from grading_support import SOLUTIONS, edit, solution_notebook, write  # noqa: E402

from course_attn.grading import grader  # noqa: E402
from course_attn.grading.cells import grade_id  # noqa: E402

CH01, CH02, CH03 = (SOLUTIONS / name for name in (
    "01_intuition.ipynb", "02_scaled_dot_product.ipynb", "03_masking.ipynb"))

# --- other correct answers ------------------------------------------------------------------

CAUSAL_LOOPS = '''def causal_mask(tq, tk):
    """Query i sits at position tk - tq + i and may see keys j <= that position."""
    mask = torch.zeros(tq, tk, dtype=torch.bool)
    for i in range(tq):
        for j in range(tk):
            if j <= tk - tq + i:
                mask[i, j] = True
    return mask
'''

PADDING_LOOPS = '''def padding_mask(lengths, t):
    rows = []
    for length in lengths.tolist():
        rows.append([j < length for j in range(t)])
    return torch.tensor(rows, dtype=torch.bool).reshape(len(rows), 1, 1, t)
'''

MASKED_LOOPS = '''def masked_attention(q, k, v, mask):
    B, H, Tq, D = q.shape
    mask = mask.expand(B, H, Tq, k.shape[-2])
    out = torch.zeros(B, H, Tq, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            scores = (q[b, h] @ k[b, h].T) / D ** 0.5
            scores = scores.masked_fill(~mask[b, h], float("-inf"))
            for i in range(Tq):
                if mask[b, h, i].any():   # else: nothing to attend to, zeros
                    weights = torch.exp(scores[i] - scores[i].max())
                    out[b, h, i] = (weights / weights.sum()) @ v[b, h]
    return out
'''

MASKED_ROW_BY_ROW = '''def masked_attention(q, k, v, mask):
    B, H, Tq, D = q.shape
    mask = mask.expand(B, H, Tq, k.shape[-2])
    out = torch.zeros(B, H, Tq, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            for i in range(Tq):
                allowed = mask[b, h, i]
                if not allowed.any():
                    continue  # nothing to attend to: zeros
                scores = (k[b, h] @ q[b, h, i]) / D ** 0.5   # one query's scores at a time
                scores = scores.masked_fill(~allowed, float("-inf"))
                weights = torch.exp(scores - scores.max())
                out[b, h, i] = (weights / weights.sum()) @ v[b, h]
    return out
'''

CAUSAL_TRIL = '''def causal_mask(tq, tk):
    return torch.ones(tq, tk, dtype=torch.bool).tril(diagonal=tk - tq)
'''

PADDING_BROADCAST = '''def padding_mask(lengths, t):
    return torch.lt(torch.arange(t).view(1, 1, 1, t), lengths.view(-1, 1, 1, 1))
'''

MASKED_EINSUM = '''def masked_attention(q, k, v, mask):
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    weights = weights / torch.where(total == 0, torch.ones_like(total), total)
    return torch.einsum("bhqk,bhkv->bhqv", weights, v)
'''

STABLE_SOFTMAX_WIDE = '''def stable_softmax(x, dim=-1):
    """In float64, back in x's dtype; the max is taken with torch.max, an all -inf slice gives
    zeros. (torch.logsumexp would be the library's own stable normaliser: not this.)"""
    wide = x.to(torch.float64)
    top = torch.max(wide, dim=dim, keepdim=True).values
    dead = torch.isneginf(top)
    e = torch.exp(wide - torch.where(dead, torch.zeros_like(top), top))
    total = e.sum(dim=dim, keepdim=True)
    return torch.where(dead, torch.zeros_like(e), e / torch.where(dead, 1.0, total)).to(x.dtype)
'''

A_VARIABLE_NAMED_COMPILE = '''compile = False   # set True to try torch.compile
exec = print      # and names the grader must never look up: json, globals, getattr
json = globals = getattr = None
'''

PROFILED = '''import cProfile
import functools
import pstats

def profiled(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            profiler.disable()
            pstats.Stats(profiler)
    return wrapper

@profiled
def causal_mask(tq, tk):
    return torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
'''

PROFILER_LEFT_ENABLED = '''import cProfile
_prof = cProfile.Profile()
_prof.enable()   # left on for the whole notebook
'''

COST_WITH_NUMPY = '''import numpy as np

def attention_cost(b, h, tq, tk, d, dv, bytes_per_element):
    """numpy.int64 counts (np.prod): a number is a number."""
    flops = 2 * np.prod([b, h, tq, tk]) * (d + dv)
    score_bytes = np.prod([b, h, tq, tk, bytes_per_element])
    io_bytes = np.prod([b, h, bytes_per_element]) * np.array(tq * d + tk * d + tk * dv + tq * dv)
    return {"flops": flops, "score_bytes": score_bytes, "io_bytes": io_bytes}
'''

COMPILED_HELPER = '''@torch.compile
def _scores(q, k):
    return q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5

def masked_attention(q, k, v, mask):
    scores = _scores(q, k).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v
'''

HELPER_MODULE = '''from my_masks import lower_right   # a file the student keeps beside the notebook

def causal_mask(tq, tk):
    return lower_right(tq, tk)
'''
HELPER_FILE = ("my_masks.py", '''import torch


def lower_right(tq, tk):
    return torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
''')

SCORES_EINSUM = '''def attention_scores(q, k, scale=None):
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return torch.einsum("...qd,...kd->...qk", q, k) * scale
'''

SOFTMAX_LIST_NUMPY = '''import numpy as np

def softmax_list(xs):
    shifted = np.asarray(xs, dtype=np.float64) - max(xs)
    exps = np.exp(shifted)
    return list(exps / math.fsum(exps))   # numpy's float64 is a float
'''

ATTEND_EINSUM = '''def attend(q, k, v):
    scores = torch.einsum("qd,kd->qk", q, k)
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return (weights / weights.sum(dim=-1, keepdim=True)) @ v
'''

# --- extra cells, as students add them --------------------------------------------------------

CHAPTER_IMPORTS = '''import math
import matplotlib.pyplot as plt
import torch.nn.functional as F
from IPython.display import display
from torch.nn.attention.bias import causal_lower_right, causal_upper_left, CausalBias
import course_attn as ca
from course_attn import causal_mask as reference_causal_mask
from course_attn.masks import dead_rows
from course_attn.viz import plot_attention
'''

COMPARE_WITH_THE_PACKAGE = '''# my mask against the package's and PyTorch's, outside my function
assert torch.equal(causal_mask(3, 5), reference_causal_mask(3, 5))
bias = causal_lower_right(3, 5)
print(type(bias).__name__, ca.causal_mask(2, 4).tolist())
'''

STDLIB_IMPORTS = '''import abc, array, bisect, collections, contextlib, copy, csv, dataclasses
import datetime, decimal, enum, fractions, functools, hashlib, heapq, io, itertools, json, logging
import operator, os, pathlib, pprint, random, re, statistics, string, struct, sys, textwrap
import time, typing, uuid, warnings
from collections import OrderedDict, defaultdict, namedtuple
from typing import Optional

logging.getLogger("mine").info("starting")
Shape = namedtuple("Shape", "tq tk")
'''

CAUSAL_WITH_STDLIB = '''def causal_mask(tq: int, tk: int) -> torch.Tensor:
    shape = Shape(tq, tk)
    offsets = collections.deque(range(shape.tk))
    keys = torch.tensor(list(offsets), dtype=torch.long)
    rows = [keys <= (shape.tk - shape.tq + i) for i in itertools.islice(itertools.count(), tq)]
    return torch.stack(rows) if rows else torch.zeros(0, tk, dtype=torch.bool)
'''

DYNAMO_IMPORTS = '''import torch._dynamo
import torch.fx
import torch.utils.checkpoint
import torch.distributions
import torch.nn.attention
torch._dynamo.config.cache_size_limit = 16
torch._dynamo.reset()
'''

COMPILED = '''def _scores(q, k):
    return q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5

scores_fn = torch.compile(_scores, backend="eager", dynamic=True)

def masked_attention(q, k, v, mask):
    scores = scores_fn(q, k).masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    weights = weights.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
    return weights @ v

masked_attention(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 2),
                 torch.ones(2, 3, dtype=torch.bool))
'''

COMPILED_PADDING = '''@torch.compile(backend="eager")
def padding_mask(lengths, t):
    return (torch.arange(t, device=lengths.device)[None, :] < lengths[:, None])[:, None, None, :]
'''

BACKGROUND_THREAD = '''import threading, time

progress = {"ticks": 0}

def heartbeat():
    while True:  # unrelated work that goes on while the notebook runs
        progress["ticks"] += sum(i * i for i in range(200))
        time.sleep(0.01)

threading.Thread(target=heartbeat, daemon=True, name="heartbeat").start()
'''

THREADED_ATTENTION = '''from concurrent.futures import ThreadPoolExecutor

pool = ThreadPoolExecutor(max_workers=2)
pool.submit(lambda: None).result()   # the workers exist from now on

def _one_batch(q, k, v, mask):
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v

def masked_attention(q, k, v, mask):
    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    parts = pool.map(_one_batch, q, k, v, mask)   # one batch element per task
    log = threading.Thread(target=lambda: progress.update(last=time.time()))
    log.start()
    log.join()
    return torch.stack(list(parts))
'''

HELPERS_AND_CLASSES = '''from dataclasses import dataclass


@dataclass(frozen=True)
class Positions:
    tq: int
    tk: int

    def queries(self) -> torch.Tensor:
        return torch.arange(self.tq)[:, None] + (self.tk - self.tq)

    def keys(self) -> torch.Tensor:
        return torch.arange(self.tk)[None, :]


class CausalMaskMaker:
    """A callable object, not a function."""

    def __call__(self, tq, tk):
        positions = Positions(tq, tk)
        return positions.keys() <= positions.queries()

    def __repr__(self):
        return "CausalMaskMaker()"


causal_mask = CausalMaskMaker()


def _arange_row(t, device):
    return torch.arange(t, device=device)[None, :]


def padding_mask(lengths, t):
    return (_arange_row(t, lengths.device) < lengths[:, None])[:, None, None, :]
'''

PLOTS = '''%matplotlib inline
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(6, 3))
axes[0].imshow(causal_mask(5, 8), cmap="gray")
axes[0].set_title("Tq=5, Tk=8")
axes[1].imshow(causal_mask(8, 5), cmap="gray")
plt.show()
plot_attention(torch.softmax(torch.randn(4, 4), dim=-1))
plt.close("all")
'''

PROGRESS_BARS = '''from tqdm.auto import tqdm, trange

total = 0
for step in tqdm(range(200), desc="warming up"):
    total += step

def masked_attention(q, k, v, mask):
    mask = mask.expand(*q.shape[:-1], k.shape[-2])
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    for b in trange(q.shape[0], leave=False):
        scores = (q[b] @ k[b].transpose(-2, -1)) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~mask[b], float("-inf"))
        out[b] = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v[b]
    return out
'''

UNICODE = '''# Маска: 因果注意力 — la requête i voit les clés j ≤ Tk − Tq + i ✓
def causal_mask(tq, tk):
    """因果掩码 (causal mask) — ユニコード 🎭"""
    δ = tk - tq
    позиции_запросов = torch.arange(tq)[:, None] + δ
    キー = torch.arange(tk)[None, :]
    return キー <= позиции_запросов

print("✓ 完成 🎉 — Ωμέγα", causal_mask(2, 3).tolist())
'''

MANY_LINES = "\n".join(f"CONSTANT_{i} = {i} * 2  # {'padding ' * 8}" for i in range(3000))
VERY_LONG_CELL = (MANY_LINES + "\n# " + "x" * 5000 + "\n\n" + CAUSAL_TRIL +
                  "\nassert CONSTANT_2999 == 5998\n")

SEEDS = '''import random
import numpy as np

torch.manual_seed(1234)
random.seed(1234)
np.random.seed(1234)
noise = torch.randn(3)

def causal_mask(tq, tk):
    torch.manual_seed(0)   # harmless, and in the middle of grading
    random.seed(0)
    return torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
'''

TORCH_DEFAULTS = '''import warnings
import numpy as np

torch.set_printoptions(precision=2, sci_mode=False, linewidth=200)
np.set_printoptions(precision=3)
torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
torch.set_grad_enabled(False)
torch.use_deterministic_algorithms(True)
warnings.filterwarnings("ignore")
print(torch.randn(2, 2))
'''

MAGICS = '''%load_ext autoreload
%autoreload 2
%env COURSE_MOOD=curious
%time _ = torch.randn(100, 100) @ torch.randn(100, 100)
!echo "hello from the shell"
files = !ls
%who_ls
'''

TIMEIT = '''%%timeit -n 1 -r 1
causal_mask(64, 64)
'''

NUMPY_INTEROP = '''import numpy as np

def causal_mask(tq, tk):
    return torch.from_numpy(np.tril(np.ones((tq, tk), dtype=bool), k=tk - tq))

def padding_mask(lengths, t):
    keep = np.arange(t)[None, :] < lengths.numpy()[:, None]
    return torch.from_numpy(keep)[:, None, None, :]
'''

DECORATORS = '''import functools
import time

def timed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timings.append(time.perf_counter() - started)
    return wrapper

timings = []

@functools.lru_cache(maxsize=None)
def causal_mask(tq, tk):
    return torch.ones(tq, tk, dtype=torch.bool).tril(diagonal=tk - tq)

@timed
@torch.no_grad()
def masked_attention(q, k, v, mask):
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v
'''

INFERENCE_MODE = '''@torch.inference_mode()
def padding_mask(lengths, t):
    return (torch.arange(t)[None, :] < lengths[:, None])[:, None, None, :]

@torch.inference_mode()
def masked_attention(q, k, v, mask):
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return weights.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0) @ v
'''

LAMBDAS = '''import functools

causal_mask = lambda tq, tk: torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)

def _keep(lengths, t, *, axis_shape):
    return (torch.arange(t)[None, :] < lengths[:, None]).reshape(*axis_shape(lengths), t)

padding_mask = functools.partial(_keep, axis_shape=lambda lengths: (len(lengths), 1, 1))
'''

OWN_CHECKS_AND_OUTPUT = '''from IPython.display import HTML, Markdown, display

check("ch03.causal_mask", causal_mask)       # running the feedback again, by hand
for i in range(2000):
    print(f"line {i}: {causal_mask(2, 3).sum().item()}")
display(HTML("<b>all good</b>"), Markdown("**done**"))
'''

ERRORS_LEFT_IN = '''try:
    causal_mask("three", 4)
except TypeError as error:
    print("as expected:", error)
'''

UNCAUGHT_ERROR = '''# a scratch cell the student left failing
1 / 0
'''

FILES = '''import os
import tempfile

with open("notes.txt", "w", encoding="utf-8") as file:
    file.write("causal: bottom-right aligned\\n")
print(open("notes.txt", encoding="utf-8").read(), os.getcwd())
with tempfile.TemporaryDirectory() as folder:
    torch.save(causal_mask(3, 4), os.path.join(folder, "mask.pt"))
'''

ASYNC_CODE = '''import asyncio

async def later(value):
    await asyncio.sleep(0.01)
    return value

await asyncio.gather(later(1), later(2))
'''

CH02_HELPERS = '''import functools
import operator

def matmul_t(a, b):
    return torch.matmul(a, b.transpose(-2, -1))

def attention(q, k, v, scale=None):
    weights = stable_softmax(attention_scores(q, k, scale), dim=-1)
    return functools.reduce(operator.matmul, [weights, v])
'''

CH01_EXTRA = '''import statistics
from fractions import Fraction

print(statistics.mean([1, 2, 3]), Fraction(1, 3))

def soft_lookup(query, keys, values):
    scores = [math.fsum(q * k for q, k in zip(query, key)) for key in keys]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = math.fsum(weights)
    return [math.fsum(w / total * value[d] for w, value in zip(weights, values))
            for d in range(len(values[0]))]
'''


EVERYDAY_IDIOMS = '''import multiprocessing
import sys
from dataclasses import dataclass

IN_COLAB = "google.colab" in sys.modules or sys.modules.get("google.colab") is not None
WORKERS = multiprocessing.cpu_count()


@dataclass
class Config:
    dtype_name: str = "float32"
    seed: int = 0


cfg = Config()
print(cfg.__dict__, vars(cfg))
DTYPE = getattr(torch, cfg.dtype_name)
setattr(cfg, "seed", 1)
'''


def exercises_moved(cells):
    """The last exercise's answer and check cells moved, as a pair, to right after the setup:
    the order a student who did it first might leave them in."""
    moved = [c for c in cells if (grade_id(c) or "").startswith("ch03-fp16_fill")]
    rest = [c for c in cells if not any(c is m for m in moved)]
    setup = next(i for i, c in enumerate(rest) if grade_id(c) == "ch03-setup")
    return rest[:setup + 1] + moved + rest[setup + 1:]


def corpus() -> dict[str, tuple[Path, dict]]:
    """Name -> (solution notebook, changes for ``grading_support.edit``)."""
    return {
        "chapter_imports": (CH03, {"after": {
            "ch03-setup": CHAPTER_IMPORTS, "ch03-causal_mask-solution": COMPARE_WITH_THE_PACKAGE}}),
        "stdlib_imports": (CH03, {"after": {"ch03-setup": STDLIB_IMPORTS},
                                  "replace": {"ch03-causal_mask-solution": CAUSAL_WITH_STDLIB}}),
        "torch_dynamo": (CH03, {"after": {"ch03-setup": DYNAMO_IMPORTS}}),
        "torch_compile": (CH03, {"replace": {"ch03-masked_attention-solution": COMPILED,
                                             "ch03-padding_mask-solution": COMPILED_PADDING}}),
        "threads": (CH03, {"after": {"ch03-setup": BACKGROUND_THREAD},
                           "replace": {"ch03-masked_attention-solution": THREADED_ATTENTION}}),
        "helpers_and_classes": (CH03, {"replace": {
            "ch03-causal_mask-solution": HELPERS_AND_CLASSES,
            "ch03-padding_mask-solution": "# padding_mask is defined with the helpers above\n"}}),
        "plots": (CH03, {"after": {"ch03-setup": CHAPTER_IMPORTS,
                                   "ch03-causal_mask-solution": PLOTS}}),
        "progress_bars": (CH03, {"replace": {"ch03-masked_attention-solution": PROGRESS_BARS}}),
        "unicode": (CH03, {"replace": {"ch03-causal_mask-solution": UNICODE}}),
        "very_long_cells": (CH03, {"replace": {"ch03-causal_mask-solution": VERY_LONG_CELL},
                                   "before": {"ch03-padding_mask-solution": MANY_LINES}}),
        "loops": (CH03, {"replace": {"ch03-causal_mask-solution": CAUSAL_LOOPS,
                                     "ch03-padding_mask-solution": PADDING_LOOPS,
                                     "ch03-masked_attention-solution": MASKED_LOOPS}}),
        "einsum_and_tril": (CH03, {"replace": {
            "ch03-causal_mask-solution": CAUSAL_TRIL,
            "ch03-padding_mask-solution": PADDING_BROADCAST,
            "ch03-masked_attention-solution": MASKED_EINSUM}}),
        "seeds": (CH03, {"replace": {"ch03-causal_mask-solution": SEEDS}}),
        "torch_defaults": (CH03, {"after": {"ch03-setup": TORCH_DEFAULTS}}),
        "magics": (CH03, {"after": {"ch03-setup": MAGICS, "ch03-causal_mask-solution": TIMEIT}}),
        "numpy_interop": (CH03, {"replace": {"ch03-causal_mask-solution": NUMPY_INTEROP,
                                             "ch03-padding_mask-solution": "pass\n"}}),
        "decorators_and_caches": (CH03, {"replace": {"ch03-causal_mask-solution": DECORATORS,
                                                     "ch03-masked_attention-solution": "pass\n"}}),
        "inference_mode": (CH03, {"replace": {"ch03-padding_mask-solution": INFERENCE_MODE,
                                              "ch03-masked_attention-solution": "pass\n"}}),
        "lambdas_and_partials": (CH03, {"replace": {"ch03-causal_mask-solution": LAMBDAS,
                                                    "ch03-padding_mask-solution": "pass\n"}}),
        "own_checks_and_output": (CH03, {"after": {
            "ch03-causal_mask-solution": OWN_CHECKS_AND_OUTPUT}}),
        "errors_left_in": (CH03, {"after": {"ch03-causal_mask-solution": [ERRORS_LEFT_IN,
                                                                          UNCAUGHT_ERROR]}}),
        "files": (CH03, {"after": {"ch03-causal_mask-solution": FILES}}),
        "a_profiler_left_enabled": (CH03, {"after": {"ch03-setup": PROFILER_LEFT_ENABLED}}),
        "numpy_numbers_in_a_derivation": (CH02, {"replace": {
            "ch02-attention_cost-solution": COST_WITH_NUMPY}}),
        "async_code": (CH03, {"after": {"ch03-setup": ASYNC_CODE}}),
        "ch02_other_methods": (CH02, {"replace": {
            "ch02-stable_softmax-solution": STABLE_SOFTMAX_WIDE,
            "ch02-attention_scores-solution": SCORES_EINSUM,
            "ch02-attention-solution": CH02_HELPERS},
            "after": {"ch02-setup": DYNAMO_IMPORTS + "\n" + STDLIB_IMPORTS}}),
        "a_variable_named_compile": (CH03, {"after": {"ch03-setup": A_VARIABLE_NAMED_COMPILE}}),
        "a_profiler_on_a_correct_function": (CH03, {"replace": {
            "ch03-causal_mask-solution": PROFILED}}),
        "torch_compile_on_a_helper": (CH03, {"replace": {
            "ch03-masked_attention-solution": COMPILED_HELPER}}),
        "a_helper_module_beside_the_notebook": (CH03, {"replace": {
            "ch03-causal_mask-solution": HELPER_MODULE}}),
        "everyday_idioms": (CH03, {"after": {"ch03-setup": EVERYDAY_IDIOMS}}),
        "cells_out_of_their_order": (CH03, {"rearrange": exercises_moved}),
        "ch01_other_methods": (CH01, {"replace": {
            "ch01-softmax_list-solution": SOFTMAX_LIST_NUMPY,
            "ch01-attend-solution": ATTEND_EINSUM,
            "ch01-soft_lookup-solution": CH01_EXTRA},
            "after": {"ch01-setup": TORCH_DEFAULTS.replace(
                "torch.set_default_dtype(torch.float64)\n", "")}}),
    }


CORPUS = corpus()


def copy_without_notebook_metadata():
    """Colab's "Copy of 02_….ipynb" after an editor dropped the notebook's metadata: only its
    cells' grade_ids say which chapter it is."""
    nb = solution_notebook(CH02)
    nb.metadata.pop("course_attn", None)
    return "Copy of 02_scaled_dot_product.ipynb", nb


def every_cell_metadata_stripped():
    """An editor that keeps no cell metadata: no grade_id, no nbgrader field, no tag."""
    nb = solution_notebook(CH03)
    for cell in nb.cells:
        cell.metadata = {}
    return "03_stripped.ipynb", nb


# Built whole, not by ``edit`` (which finds cells by grade_id): name -> (file name, notebook)
WHOLE = {"copy_without_notebook_metadata": copy_without_notebook_metadata,
         "every_cell_metadata_stripped": every_cell_metadata_stripped}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("honest")
    paths = {name: write(edit(solution_notebook(source), **changes),
                         folder / f"{source.name[:3]}{name}.ipynb")
             for name, (source, changes) in CORPUS.items()}
    for name, build in WHOLE.items():
        file_name, nb = build()
        paths[name] = write(nb, folder / file_name)
    (folder / HELPER_FILE[0]).write_text(HELPER_FILE[1])
    grades = grader.grade_notebooks(list(paths.values()), solutions_dir=SOLUTIONS, jobs=2)
    return dict(zip(paths, grades))


def test_the_corpus_is_large_enough():
    assert len(CORPUS) >= 20


@pytest.mark.parametrize("name", [*CORPUS, *WHOLE])
def test_an_honest_submission_scores_full_marks_and_no_flag(graded, name):
    grade = graded[name]
    failed = {e.grade_id: e.reason for e in grade.exercises if not e.passed}
    assert grade.error is None and failed == {}, (failed, grade.error)
    assert grade.total == grade.max_points > 0
    assert grade.flags == []


def test_a_correct_row_by_row_attention_passes_every_case():
    """In this process (no kernel): the answer of a student who computes one query at a time."""
    from course_attn.grading import get, run_exercise
    namespace = {"torch": __import__("torch")}
    exec(MASKED_ROW_BY_ROW, namespace)
    judgement = run_exercise(get("ch03.masked_attention"), namespace["masked_attention"])
    assert judgement.passed, [(r.name, r.message) for r in judgement.results if not r.passed]
