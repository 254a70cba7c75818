"""Local (sliding-window) attention at O(T·W) cost (chapter 11).

With a window W, a query sees only the keys less than W positions away: the scores that matter
form a band of width W around the diagonal of the T×T matrix. Masking the full matrix still
computes (and stores) all T² scores; ``local_attention`` cuts the queries into blocks and scores
each block against only the keys in its reach:

    queries at positions  p0 .. p1             (one block of ``block`` queries)
    keys in reach         p0 - W + 1 .. p1     (causal; p1 + W - 1 when not causal)
    scores                block × (block + W - 1)   instead of   block × T

so time and memory grow as T·(block + W), linearly in T (Longformer's local attention,
Mistral's sliding window).

At decode time a windowed model needs only the last W keys and values: ``RollingKVCache``, which
lives beside ``KVCache`` in ``kv_cache.py`` (and is importable from here too), keeps exactly those.
"""

import math

import torch
from torch import Tensor

from .arguments import check_positive_ints
from .attention import check_attention_inputs, scaled_dot_product_attention
from .kv_cache import RollingKVCache
from .masks import band_mask, cut_mask, grouped_query_bias, key_reach, to_additive

__all__ = ["DEFAULT_BLOCK", "RollingKVCache", "local_attention"]

DEFAULT_BLOCK = 128  # queries per block; fastest on a 2-core CPU for W = 128..1024 (chapter 11)


def _block_bias(offset: int, n: int, m: int, window: int, is_causal: bool, mask: Tensor | None,
                rows: tuple[int, int, int], dtype: torch.dtype,
                device) -> tuple[Tensor, Tensor | None]:
    """The additive mask of one block and its dead rows (queries that may see no key).

    Query i of the block and key j of its reach lie ``offset + i - j`` positions apart. The bias
    is 0 or -inf, plus the block's cut of ``attn_mask`` (``mask``, see ``masks.cut_mask``); it is
    shaped for the scores' rows ``rows`` = (B, Hkv, G): (G·n, m) without a mask, else
    (B·Hkv, G·n, m) (``masks.grouped_query_bias``). ``dead`` (same leading shape, last dim 1) is
    None when every row sees a key; dead rows get a bias of 0, so that softmax stays finite, and
    their output is zeroed later.
    """
    b, hkv, g = rows
    allowed = band_mask(offset, n, m, is_causal=is_causal, window=window, device=device)
    bias = grouped_query_bias(to_additive(allowed, dtype), mask, (b, hkv, g, n, m), dtype)
    dead = (bias == float("-inf")).all(dim=-1, keepdim=True)
    if not bool(dead.any()):
        return bias, None
    return bias.masked_fill(dead, 0.0), dead


def local_attention(
    q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False, window: int | None = None,
    block: int = DEFAULT_BLOCK,
) -> Tensor:
    """Sliding-window attention, ``block`` queries at a time against the keys in their reach.

    q: (B, Hq, Tq, D), k: (B, Hkv, Tk, D), v: (B, Hkv, Tk, Dv) -> (B, Hq, Tq, Dv); the keywords
    as ``attention.scaled_dot_product_attention``, whose numbers it returns. Query i sits at
    position p = Tk - Tq + i (bottom-right) and sees key j when 0 <= p - j < W (causal) or
    |p - j| < W (not causal). ``attn_mask`` is cut per block, never expanded to (Tq, Tk).

    Time and memory are O(Tq · (block + W)). Without a window nothing is local, and the call
    falls back to the full computation of ``"math"`` (as it does for an empty q or k).
    Each block is three batched ops over every (B, H) at once: scores = mask + q kᵀ, their
    softmax, weights @ v; the query heads that share a key/value head (GQA) are stacked as
    extra rows of one matrix, so keys are never copied per head. Plain autograd differentiates
    it. A query with no key in reach, or none that its mask allows, gets zeros.
    """
    check_attention_inputs(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa,
                           window=window)
    check_positive_ints(block=block)
    (b, hq, tq, d), (hkv, tk) = q.shape, k.shape[1:3]
    if window is None or tq == 0 or tk == 0:
        return scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                            scale=scale, enable_gqa=enable_gqa)
    acc = torch.promote_types(q.dtype, torch.float32)   # half precision is computed in float32
    g = hq // hkv                                        # query heads per key/value head
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    queries = (q.to(acc) * scale).unflatten(1, (hkv, g))                 # (B, Hkv, G, Tq, D)
    keys, values = k.to(acc).flatten(0, 1), v.to(acc).flatten(0, 1)     # (B·Hkv, Tk, D|Dv)
    shared = {}     # without attn_mask, a bias depends on (n, m, offset) only: blocks share it
    outs = []
    for qs in range(0, tq, block):
        qe = min(qs + block, tq)
        first = tk - tq + qs                                      # the first query's position
        n = qe - qs
        lo, hi = key_reach(first, first + n - 1, tk, is_causal=is_causal, window=window)
        band = (first - lo, n, hi - lo, window, is_causal)
        if attn_mask is not None:
            bias, dead = _block_bias(*band, cut_mask(attn_mask, qs, qe, lo, hi), (b, hkv, g), acc,
                                     q.device)
        else:
            if band not in shared:
                shared[band] = _block_bias(*band, None, (b, hkv, g), acc, q.device)
            bias, dead = shared[band]
        rows = queries[:, :, :, qs:qe].reshape(b * hkv, g * n, d)         # (B·Hkv, G·n, D)
        scores = torch.baddbmm(bias, rows, keys[:, lo:hi].transpose(1, 2))  # (B·Hkv, G·n, m)
        out = torch.softmax(scores, dim=-1) @ values[:, lo:hi]           # (B·Hkv, G·n, Dv)
        if dead is not None:
            out = out.masked_fill(dead, 0.0)
        outs.append(out.unflatten(1, (g, n)))                             # (B·Hkv, G, n, Dv)
    out = torch.cat(outs, dim=2)                                          # (B·Hkv, G, Tq, Dv)
    return out.reshape(b, hq, tq, -1).to(q.dtype)
