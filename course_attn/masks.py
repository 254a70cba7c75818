"""Masks: which keys each query may attend to.

Convention (the same as PyTorch's SDPA): a **bool** mask is True where a query *may* attend;
a **float** mask is *added* to the scores (0 keeps a key, -inf removes it). Masks broadcast
to the scores' shape (B, H, Tq, Tk).

Positions are **bottom-right aligned**: with Tq queries and Tk keys, query i sits at absolute
position Tk - Tq + i, so the last query always lines up with the last key. That is what decoding
with a KV cache needs (one new query, many cached keys). PyTorch's ``is_causal`` aligns
top-left instead (query i at position i); for Tq == Tk the two agree.
"""

import torch
from torch import Tensor

from .arguments import check_non_negative_ints


def check_window(window) -> None:
    """Raise ValueError unless ``window`` is None or an int >= 1."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")


def query_key_offsets(tq: int, tk: int, *, align: str = "bottom_right", device=None) -> Tensor:
    """``i_abs - j`` for every query i and key j, shape (Tq, Tk).

    ``align="bottom_right"`` puts query i at absolute position Tk - Tq + i;
    ``align="top_left"`` puts it at position i (PyTorch's ``is_causal``).
    """
    check_non_negative_ints(tq=tq, tk=tk)
    if align not in ("bottom_right", "top_left"):
        raise ValueError(f"align must be 'bottom_right' or 'top_left', got {align!r}")
    shift = tk - tq if align == "bottom_right" else 0
    i = torch.arange(tq, device=device).unsqueeze(1) + shift
    j = torch.arange(tk, device=device).unsqueeze(0)
    return i - j


def causal_mask(tq: int, tk: int | None = None, *, align: str = "bottom_right", device=None) -> Tensor:
    """Bool mask (Tq, Tk): True where key j is not in query i's future.

    >>> causal_mask(2, 3).int()
    tensor([[1, 1, 0],
            [1, 1, 1]], dtype=torch.int32)
    """
    tk = tq if tk is None else tk
    return query_key_offsets(tq, tk, align=align, device=device) >= 0


def sliding_window_mask(
    tq: int, tk: int | None = None, window: int = 1, *, causal: bool = True, device=None
) -> Tensor:
    """Bool mask (Tq, Tk) keeping keys less than ``window`` positions away.

    Causal: ``0 <= i - j < window`` (the query and the window-1 keys before it, as Mistral).
    Not causal: ``|i - j| < window``. Positions are bottom-right aligned.
    """
    tk = tq if tk is None else tk
    check_window(window)
    if window is None:
        raise ValueError("sliding_window_mask needs an int window >= 1, got None")
    check_non_negative_ints(tq=tq, tk=tk)
    return band_mask(tk - tq, tq, tk, is_causal=causal, window=window, device=device)


def band_mask(shift: int, n: int, m: int, *, is_causal: bool, window: int | None,
              device=None) -> Tensor:
    """Bool (n, m): which of m consecutive keys each of n consecutive queries may see, the first
    query sitting ``shift`` positions after the first key, so that query i and key j lie
    d = shift + i - j apart. Causal: 0 <= d; a window: d < window (causal) or |d| < window.
    The rule of ``sliding_window_mask`` for any block of a (Tq, Tk) mask (shift Tk - Tq for all).
    """
    d = shift + torch.arange(n, device=device)[:, None] - torch.arange(m, device=device)
    allowed = d >= 0 if is_causal else torch.ones_like(d, dtype=torch.bool)
    if window is not None:
        allowed &= d < window if is_causal else d.abs() < window
    return allowed


def padding_mask(lengths: Tensor, t: int) -> Tensor:
    """Bool key mask (B, 1, 1, T) from the true length of each sequence: True on real tokens.

    ``lengths``: (B,) ints, each in [0, T]. Broadcasts against scores (B, H, Tq, T).
    """
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise ValueError(
            f"lengths must be a 1-D integer tensor (B,), got shape {tuple(lengths.shape)} "
            f"dtype {lengths.dtype}"
        )
    if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > t):
        raise ValueError(f"every length must be in [0, {t}], got {lengths.tolist()}")
    keep = torch.arange(t, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)
    return keep[:, None, None, :]


def to_additive(mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """A bool mask as an additive float mask: 0 where allowed, -inf where not."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return zeros.masked_fill(~mask, float("-inf"))


def combine_masks(*masks: Tensor | None) -> Tensor | None:
    """One mask that a key must pass in every one of ``masks`` (None entries are skipped).

    All bool: their logical AND. Any float: the sum of the additive forms (bools become 0/-inf),
    in the dtype of the first float mask. Shapes broadcast.
    """
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    floats = [m for m in masks if m.dtype != torch.bool]
    out = masks[0] if masks[0].dtype == torch.bool else None
    if not floats:
        for m in masks[1:]:
            out = out & m
        return out
    dtype = floats[0].dtype
    out = to_additive(masks[0], dtype)
    for m in masks[1:]:
        out = out + to_additive(m, dtype)
    return out


def key_reach(first: int, last: int, tk: int, *, is_causal: bool = False,
              window: int | None = None) -> tuple[int, int]:
    """The keys [lo, hi) that queries at positions first .. last may see, clipped to [0, Tk):
    what the causal mask and the window leave of keys 0 .. Tk - 1 (the rule of
    ``structural_mask``, for a run of consecutive queries). lo == hi when they see none."""
    lo = 0 if window is None else first - window + 1
    hi = last + 1 if is_causal else (tk if window is None else last + window)
    lo, hi = min(max(lo, 0), tk), min(max(hi, 0), tk)
    return lo, max(lo, hi)


def cut_mask(mask: Tensor, qs: int, qe: int, ks: int, ke: int) -> Tensor:
    """Queries qs:qe and keys ks:ke of a mask broadcastable to (B, H, Tq, Tk), as a 4-D view
    (a dim of size 1 stays 1): the part of the mask that one tile or block of queries needs."""
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    rows = slice(None) if mask.shape[2] == 1 else slice(qs, qe)
    cols = slice(None) if mask.shape[3] == 1 else slice(ks, ke)
    return mask[:, :, rows, cols]


def grouped_query_bias(structural: Tensor | None, mask: Tensor | None,
                       shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> Tensor | None:
    """The additive mask of one tile of scores whose rows stack the G query heads of each key
    head (GQA): ``shape`` = (B, Hkv, G, n, m) for n queries and m keys, scores (B·Hkv, G·n, m).

    ``structural``: the tile's causal/window part, additive (n, m) (0 or -inf), or None;
    ``mask``: the tile's cut of ``attn_mask`` (bool or float, broadcastable to (B, Hq, n, m),
    see ``cut_mask``), or None. Returns (G·n, m) when there is no ``mask`` (every batch and head
    shares it), (B·Hkv, G·n, m) with one; None when both are None. A key must pass both.
    """
    b, hkv, g, n, m = shape
    if mask is None:
        return None if structural is None else structural.repeat(g, 1)          # (G·n, m)
    bias = to_additive(mask, dtype)                                      # (B|1, Hq|1, n|1, m|1)
    if structural is not None:
        bias = bias + structural
    return bias.expand(b, hkv * g, n, m).reshape(b * hkv, g * n, m)


def structural_mask(
    tq: int, tk: int, *, is_causal: bool = False, window: int | None = None, device=None
) -> Tensor | None:
    """The bool (Tq, Tk) mask that ``is_causal`` and ``window`` ask for, or None for neither."""
    check_window(window)
    if not is_causal and window is None:
        return None
    if window is None and tq == 1:      # one query at the end (a decode step) sees every key
        return None
    if window is None:
        return causal_mask(tq, tk, device=device)
    return sliding_window_mask(tq, tk, window, causal=is_causal, device=device)


def attention_mask(
    tq: int, tk: int, *, attn_mask: Tensor | None = None, is_causal: bool = False,
    window: int | None = None, device=None,
) -> Tensor | None:
    """The single mask the shared attention signature describes, or None when nothing is masked.

    ``attn_mask`` (bool or float, broadcastable to (B, H, Tq, Tk)) combined with the causal and
    window constraints: a key must pass all of them.
    """
    return combine_masks(attn_mask, structural_mask(tq, tk, is_causal=is_causal, window=window,
                                                    device=device))


def dead_rows(mask: Tensor | None) -> Tensor | None:
    """True for query rows of ``mask`` that allow no key at all, shape (..., Tq, 1); None if none."""
    if mask is None:
        return None
    blocked = ~mask if mask.dtype == torch.bool else mask == float("-inf")
    dead = blocked.all(dim=-1, keepdim=True)
    if torch.compiler.is_compiling():        # a traced graph cannot branch on values: filling
        return dead                          # rows with an all-False mask changes nothing
    return dead if bool(dead.any()) else None
