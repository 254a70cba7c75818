"""Every attention implementation by name, all with one signature.

    attn(q, k, v, *, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, window=None)
    q: (B, Hq, Tq, D)   k: (B, Hkv, Tk, D)   v: (B, Hkv, Tk, Dv)   ->  (B, Hq, Tq, Dv)

``BACKENDS["math"]`` is the reference; every other entry returns the same numbers (up to float
rounding). ``import course_attn`` registers them all:

    "math"    the explicit T×T computation (attention.py, chapter 2)
    "sdpa"    PyTorch's fused kernel, given the bottom-right/window mask our semantics need
    "local"   sliding-window attention at O(T·W) (local.py, chapter 11)
    "flash"   the tiled online-softmax forward and recomputing backward (flash.py, chapter 9)
    "triton"  the Triton flash kernel (triton_flash.py), only where CUDA is present; no attn_mask
              or window there: those raise ValueError

Linear attention approximates softmax with another signature (linear.py), so it is not here.
"""

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import check_attention_inputs, scaled_dot_product_attention
from .masks import attention_mask, dead_rows

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
        raise ValueError(f"unknown attention backend {name!r}; registered: {sorted(BACKENDS)}") from None


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False, window: int | None = None,
) -> Tensor:
    """PyTorch's fused ``scaled_dot_product_attention``, given the mask our semantics need.

    PyTorch's own ``is_causal`` is top-left aligned and it has no window, so both become an
    explicit bottom-right mask, except for plain square causal attention, which takes PyTorch's
    fast path, and a single causal query (a decode step), which sees every key and needs no mask. Shapes as ``attention.scaled_dot_product_attention``.
    """
    check_attention_inputs(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa,
                           window=window)
    tq, tk = q.shape[-2], k.shape[-2]
    kwargs = dict(scale=scale, enable_gqa=enable_gqa and q.shape[1] != k.shape[1])
    if is_causal and attn_mask is None and window is None:
        if tq == tk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
        if tq == 1 and tk >= 1:    # one decode step: the last query sees every key
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    mask = attention_mask(tq, tk, attn_mask=attn_mask, is_causal=is_causal, window=window,
                          device=q.device)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    if mask is not None and mask.dim() < 2:   # PyTorch 2.13 rejects a 1-D mask (Tk,): IndexError
        mask = mask.reshape(1, -1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
    dead = dead_rows(mask)
    # Our contract is zeros for a query with no key; make it hold for every kernel and mask kind.
    return out if dead is None else out.masked_fill(dead, 0.0)


register("math", scaled_dot_product_attention)
register("sdpa", sdpa_attention)

from .local import local_attention  # noqa: E402  (local.py imports attention/masks, not this)
register("local", local_attention)

from .flash import flash_attention  # noqa: E402  (flash.py imports attention/masks, not this)
register("flash", flash_attention)

# The Triton kernel runs on CUDA only; a CPU-only install has no Triton and never imports it.
if torch.cuda.is_available():
    try:
        from .triton_flash import triton_attention
    except ImportError:
        pass
    else:
        register("triton", triton_attention)
