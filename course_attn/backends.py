"""Every attention implementation by name, all with one signature.

    attn(q, k, v, *, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, window=None)
    q: (B, Hq, Tq, D)   k: (B, Hkv, Tk, D)   v: (B, Hkv, Tk, Dv)   ->  (B, Hq, Tq, Dv)

``BACKENDS["math"]`` is the reference; every other entry returns the same numbers (up to float
rounding). This module holds the registry only; each implementation lives in its own module,
and importing this one registers them all:

    "math"    the explicit T×T computation (attention.py, chapter 2)
    "sdpa"    PyTorch's fused kernel, given the bottom-right/window mask our semantics need
              (sdpa.py)
    "local"   sliding-window attention at O(T·W) (local.py, chapter 11)
    "flash"   the tiled online-softmax forward and recomputing backward (flash.py, chapter 9)
    "triton"  the Triton flash kernel (triton_flash.py), only where CUDA is present; no attn_mask
              or window there: those raise ValueError

Linear attention approximates softmax with another signature (linear.py), so it is not here.
"""

from typing import Callable

import torch
from torch import Tensor

from .attention import scaled_dot_product_attention
from .flash import flash_attention
from .local import local_attention
from .sdpa import sdpa_attention

AttentionFn = Callable[..., Tensor]

BACKENDS: dict[str, AttentionFn] = {}


def register(name: str, fn: AttentionFn) -> AttentionFn:
    """Add ``fn`` to ``BACKENDS`` under ``name`` (replacing an earlier one of that name)."""
    BACKENDS[name] = fn
    return fn


def get_backend(name: str) -> AttentionFn:
    """The attention function registered as ``name``; ValueError listing the names otherwise."""
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown attention backend {name!r}; "
                         f"registered: {sorted(BACKENDS)}") from None


register("math", scaled_dot_product_attention)
register("sdpa", sdpa_attention)
register("local", local_attention)
register("flash", flash_attention)

# The Triton kernel runs on CUDA only; a CPU-only install has no Triton and never imports it.
if torch.cuda.is_available():
    try:
        from .triton_flash import triton_attention
    except ImportError:
        pass
    else:
        register("triton", triton_attention)
