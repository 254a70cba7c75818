"""PyTorch's fused attention kernel under the package's semantics (registered as ``"sdpa"``).

``torch.nn.functional.scaled_dot_product_attention`` aligns ``is_causal`` top-left and has no
window; ``sdpa_attention`` gives it the bottom-right causal and window mask the shared signature
asks for (see ``backends``), and zeros for a query that may see no key.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import check_attention_inputs
from .masks import attention_mask, dead_rows

__all__ = ["sdpa_attention"]


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False, window: int | None = None,
) -> Tensor:
    """PyTorch's fused ``scaled_dot_product_attention``, given the mask our semantics need.

    PyTorch's own ``is_causal`` is top-left aligned and it has no window, so both become an
    explicit bottom-right mask, except for plain square causal attention, which takes PyTorch's
    fast path, and a single causal query (a decode step), which sees every key and needs no mask.
    Shapes as ``attention.scaled_dot_product_attention``.
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
