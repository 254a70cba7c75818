"""Scaled dot-product attention, written out step by step.

    scores  = q @ kᵀ · scale                   (B, Hq, Tq, Tk)
    scores += mask                             (-inf where a key is not allowed)
    weights = softmax(scores, over keys)       (B, Hq, Tq, Tk), each row sums to 1
    out     = weights @ v                      (B, Hq, Tq, Dv)

Every attention function in the package shares this signature (see ``backends.py``):

    attn(q, k, v, *, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, window=None)
    q: (B, Hq, Tq, D)   k: (B, Hkv, Tk, D)   v: (B, Hkv, Tk, Dv)   ->  (B, Hq, Tq, Dv)
"""

import math

import torch
from torch import Tensor

from .masks import attention_mask, check_window


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Numerically stable softmax; a slice that is all -inf gives zeros, not NaN.

    Subtracting the row maximum changes nothing mathematically (it cancels in the ratio) but
    keeps ``exp`` from overflowing. Any shape; ``dim`` is the axis that sums to 1.
    An empty ``dim`` (no keys at all) gives an empty result, as there is nothing to normalise.
    """
    if x.shape[dim] == 0:
        return x.clone()
    m = x.amax(dim=dim, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x - m)
    total = e.sum(dim=dim, keepdim=True)
    return e / torch.where(total == 0, torch.ones_like(total), total)


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, Tensor) else type(t).__name__


def check_attention_inputs(
    q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None, scale=None,
    enable_gqa: bool = False, window: int | None = None,
) -> None:
    """Raise ValueError, naming shapes, dtypes or devices, unless the inputs fit the signature."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "q, k, v must have rank 4 (B, H, T, D); got "
            f"q {_shape(q)}, k {_shape(k)}, v {_shape(v)}"
        )
    if not q.dtype.is_floating_point or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k, v must share one floating dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device; got q {q.device}, k {k.device}, v {v.device}"
        )
    (b, hq, tq, d), (bk, hkv, tk, dk) = q.shape, k.shape
    if dk != d:
        raise ValueError(f"head dim mismatch: q {_shape(q)} has D={d}, k {_shape(k)} has D={dk}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k {_shape(k)} and v {_shape(v)} must agree on (B, Hkv, Tk)")
    if bk != b:
        raise ValueError(f"batch mismatch: q {_shape(q)} has B={b}, k {_shape(k)} has B={bk}")
    if hq != hkv:
        if not enable_gqa:
            raise ValueError(
                f"q has Hq={hq} heads but k, v have Hkv={hkv}; pass enable_gqa=True for "
                "grouped-query attention"
            )
        if hkv == 0 or hq % hkv != 0:
            raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv} (q {_shape(q)}, k {_shape(k)})")
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise ValueError(f"attn_mask must be a Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask is on {attn_mask.device} but q is on {q.device}")
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            raise ValueError(f"attn_mask must be bool or floating, got {attn_mask.dtype}")
        target = (b, hq, tq, tk)
        try:
            fits = torch.broadcast_shapes(attn_mask.shape, target) == torch.Size(target)
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"attn_mask {_shape(attn_mask)} does not broadcast to scores (B, Hq, Tq, Tk) = {target}"
            )
    check_window(window)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"scale must be a number or None, got {scale!r}")


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, Hkv, T, D) -> (B, Hkv·n_rep, T, D): each key/value head serves n_rep query heads.

    Query head h uses key/value head h // n_rep, as PyTorch's ``enable_gqa``. A new axis of
    size n_rep is made by ``expand`` (a view, no copy), and the reshape folds it into the heads:
    the one copy is the reshape's.
    """
    if n_rep == 1:
        return x
    b, h_kv, t, d = x.shape
    return x[:, :, None].expand(b, h_kv, n_rep, t, d).reshape(b, h_kv * n_rep, t, d)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision inputs are computed in float32, as fused kernels accumulate.
    return torch.promote_types(dtype, torch.float32)


def attention_weights(
    q: Tensor, k: Tensor, *, attn_mask: Tensor | None = None, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False, window: int | None = None,
) -> Tensor:
    """The attention probabilities softmax(q kᵀ · scale + mask), shape (B, Hq, Tq, Tk).

    q: (B, Hq, Tq, D), k: (B, Hkv, Tk, D). Rows that may attend to nothing are all zeros.
    Same keyword semantics as ``scaled_dot_product_attention``; returned in q's dtype.
    """
    check_attention_inputs(q, k, k, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa,
                           window=window)
    return _weights(q, k, attn_mask, is_causal, scale, window).to(q.dtype)


def _weights(q, k, attn_mask, is_causal, scale, window) -> Tensor:
    acc = _accumulation_dtype(q.dtype)
    tq, tk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k = repeat_kv(k, q.shape[1] // k.shape[1])
    scores = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale
    mask = attention_mask(tq, tk, attn_mask=attn_mask, is_causal=is_causal, window=window,
                          device=q.device)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.to(acc)
    return softmax(scores, dim=-1)


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False, window: int | None = None,
) -> Tensor:
    """softmax(q kᵀ · scale + mask) v, materialising every score: the reference.

    q: (B, Hq, Tq, D), k: (B, Hkv, Tk, D), v: (B, Hkv, Tk, Dv) -> (B, Hq, Tq, Dv).
    ``attn_mask``: bool (True = may attend) or float (added), broadcast to (B, Hq, Tq, Tk).
    ``is_causal``: bottom-right aligned (query i sits at position Tk - Tq + i).
    ``scale``: defaults to 1/sqrt(D). ``enable_gqa``: Hq may be a multiple of Hkv.
    ``window``: keep keys with 0 <= i - j < window (causal) or |i - j| < window (not causal).
    A query with nothing to attend to returns zeros.
    """
    check_attention_inputs(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa,
                           window=window)
    weights = _weights(q, k, attn_mask, is_causal, scale, window)
    v = repeat_kv(v, q.shape[1] // v.shape[1])
    return (weights @ v.to(weights.dtype)).to(q.dtype)
