"""Local (sliding-window) attention at O(T·W) cost, and the rolling-buffer KV cache (chapter 11).

With a window W, a query sees only the keys less than W positions away: the scores that matter
form a band of width W around the diagonal of the T×T matrix. Masking the full matrix still
computes (and stores) all T² scores; ``local_attention`` cuts the queries into blocks and scores
each block against only the keys in its reach:

    queries at positions  p0 .. p1             (one block of ``block`` queries)
    keys in reach         p0 - W + 1 .. p1     (causal; p1 + W - 1 when not causal)
    scores                block × (block + W - 1)   instead of   block × T

so time and memory grow as T·(block + W), linearly in T (Longformer's local attention,
Mistral's sliding window).

At decode time a windowed model needs only the last W keys and values: ``RollingKVCache`` keeps
exactly those, in a buffer of W slots where the token at position p is written to slot p mod W,
overwriting the token W positions before it. Its memory is fixed however long the generation
runs (Mistral's rolling buffer). StreamingLLM's attention sinks are an option: the first
``sinks`` tokens keep slots of their own and stay visible to every later query.
"""

import math

import torch
from torch import Tensor

from .arguments import check_positive_ints
from .attention import check_attention_inputs, scaled_dot_product_attention
from .kv_cache import _KVBuffers
from .masks import band_mask, cut_mask, key_reach, to_additive

__all__ = ["DEFAULT_BLOCK", "RollingKVCache", "local_attention"]

DEFAULT_BLOCK = 128  # queries per block; fastest on a 2-core CPU for W = 128..1024 (chapter 11)


def _block_bias(offset: int, n: int, m: int, window: int, is_causal: bool, mask: Tensor | None,
                rows: tuple[int, int, int], dtype: torch.dtype,
                device) -> tuple[Tensor, Tensor | None]:
    """The additive mask of one block and its dead rows (queries that may see no key).

    Query i of the block and key j of its reach lie ``offset + i - j`` positions apart. The bias
    is 0 or -inf, plus the block's cut of a float ``attn_mask`` (``mask``, see ``masks.cut_mask``); it is
    shaped for the scores' rows ``rows`` = (B, Hkv, G): (G·n, m) without a mask, else
    (B·Hkv, G·n, m). ``dead`` (same leading shape, last dim 1) is None when every row sees a key;
    dead rows get a bias of 0, so that softmax stays finite, and their output is zeroed later.
    """
    b, hkv, g = rows
    allowed = band_mask(offset, n, m, is_causal=is_causal, window=window, device=device)
    if mask is None:
        bias = to_additive(allowed, dtype).repeat(g, 1)                        # (G·n, m)
    else:
        bias = (to_additive(allowed & mask, dtype) if mask.dtype == torch.bool
                else to_additive(allowed, dtype) + mask.to(dtype))            # (B|1, Hq|1, n, m)
        bias = bias.expand(b, hkv * g, n, m).reshape(b * hkv, g * n, m)
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


class RollingKVCache(_KVBuffers):
    """The keys and values of the last ``window`` tokens (and of the first ``sinks``), in a
    buffer of ``sinks + window`` slots, (B, Hkv, sinks + window, D) each, allocated once.

    The token at position p goes to slot p when p < sinks, else to slot
    ``sinks + (p - sinks) % window``, overwriting the token ``window`` positions before it; the
    sinks are never overwritten. ``k, v = cache.update(k_new, v_new)`` adds T_new tokens
    (B, Hkv, T_new, D) and returns what the queries of those tokens may need:

    - T_new == 1 (a decode step): every held token, the new one included, as views of the
      buffer in slot order (not time order: attention does not depend on the order of keys);
      that is the sinks and the last min(window, seen) tokens.
    - otherwise (a prefill): the tokens held before the update in time order, followed by the
      new ones (a fresh tensor, S = held before + T_new); the buffer then keeps the sinks and the
      last ``window`` tokens. Without sinks the keys are consecutive positions ending at the
      newest token, so the usual bottom-right causal window mask applies to them as it is.

    ``key_positions()`` gives the position of every key the last update returned, in its order,
    and ``visible(window)`` the mask of the last update's queries over those keys (the window
    or a sink), for every case that the plain bottom-right window mask does not cover.
    ``len(cache)`` is the number of tokens seen, the position of the next one (RoPE's offset);
    ``held`` is how many the buffer holds; ``reset()`` starts a new sequence; ``nbytes`` is the
    memory of the buffers, the same however many tokens go through. For inference only, like
    ``KVCache``, whose validation it shares: bad sizes, shapes, dtypes or devices raise
    ``ValueError`` and leave the cache as it was; no number of tokens overflows it.
    """

    def __init__(self, batch_size: int, n_kv_heads: int, window: int, head_dim: int, *,
                 sinks: int = 0, value_dim: int | None = None,
                 dtype: torch.dtype = torch.float32, device=None):
        value_dim = head_dim if value_dim is None else value_dim
        check_positive_ints(batch_size=batch_size, n_kv_heads=n_kv_heads, window=window,
                            head_dim=head_dim, value_dim=value_dim)
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"sinks must be an int >= 0, got {sinks!r}")
        super().__init__(batch_size, n_kv_heads, sinks + window, head_dim, value_dim, dtype,
                         device)
        self.window, self.sinks = window, sinks
        self.seen = 0
        self._returned = (0, 0)       # (tokens seen before the last update, its T_new)

    @property
    def capacity(self) -> int:
        """Slots in the buffer: sinks + window."""
        return self.sinks + self.window

    @property
    def held(self) -> int:
        """Tokens the buffer holds now: min(seen, sinks + window)."""
        return min(self.seen, self.capacity)

    def __len__(self) -> int:
        return self.seen

    def slot(self, position: int) -> int:
        """The slot the token at ``position`` is written to."""
        if position < self.sinks:
            return position
        return self.sinks + (position - self.sinks) % self.window

    def _time_order(self, buffer: Tensor) -> Tensor:
        """The held slots of ``buffer`` in time order (a copy once the window has wrapped)."""
        s, n = self.sinks, self.held
        if self.seen <= self.capacity:
            return buffer[:, :, :n]
        oldest = self.slot(self.seen)          # the next slot to write holds the oldest token
        return torch.cat([buffer[:, :, :s], buffer[:, :, oldest:], buffer[:, :, s:oldest]], dim=2)

    def _write(self, k_new: Tensor, v_new: Tensor) -> None:
        """Write the new tokens that the buffer keeps: the sinks among them and the last window."""
        start, end = self.seen, self.seen + k_new.shape[2]
        for p0, p1 in ((start, min(end, self.sinks)),                        # sinks
                       (max(start, self.sinks, end - self.window), end)):   # the rolling part
            while p0 < p1:                      # at most twice: the rolling slots wrap once
                s0 = self.slot(p0)
                n = min(p1 - p0, self.capacity - s0) if p0 >= self.sinks else p1 - p0
                self.k[:, :, s0:s0 + n] = k_new[:, :, p0 - start:p0 - start + n]
                self.v[:, :, s0:s0 + n] = v_new[:, :, p0 - start:p0 - start + n]
                p0 += n

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Add k_new, v_new (B, Hkv, T_new, D) -> the keys and values their queries may need.

        T_new == 1: every held token, (B, Hkv, held, D), views in slot order. Otherwise: the
        tokens held before, in time order, then the new ones, (B, Hkv, held before + T_new, D).
        ``ValueError`` (and the cache left as it was) for a shape, dtype or device that does not
        match. It never overflows: the oldest tokens past the window are overwritten.
        """
        self._check("k_new", k_new, self.head_dim)
        self._check("v_new", v_new, self.value_dim)
        t_new = k_new.shape[2]
        if v_new.shape[2] != t_new:
            raise ValueError(f"k_new has T_new={t_new} positions but v_new has {v_new.shape[2]}")
        self._returned = (self.seen, t_new)
        if t_new == 1:
            self._write(k_new, v_new)
            self.seen += 1
            return self.k[:, :, :self.held], self.v[:, :, :self.held]
        k = torch.cat([self._time_order(self.k), k_new], dim=2)
        v = torch.cat([self._time_order(self.v), v_new], dim=2)
        self._write(k_new, v_new)
        self.seen += t_new
        return k, v

    def key_positions(self, device=None) -> Tensor:
        """(S,) long: the position of each key the last ``update`` returned, in its order."""
        before, t_new = self._returned
        if t_new == 1:           # slot order: slot s holds the latest position written to it
            seen = before + 1
            slots = torch.arange(min(seen, self.capacity))
            r = (slots - self.sinks).clamp(min=0)
            rolling = self.sinks + r + self.window * torch.div(seen - 1 - self.sinks - r,
                                                               self.window, rounding_mode="floor")
            positions = torch.where(slots < self.sinks, slots, rolling)
        else:                    # time order: the sinks, the rolling tokens, the new ones
            sinks = min(before, self.sinks)
            positions = torch.cat([torch.arange(sinks),
                                   torch.arange(max(sinks, before - self.window), before + t_new)])
        return positions.to(self.device if device is None else device)

    def visible(self, window: int | None = None) -> Tensor | None:
        """bool (T_new, S): which keys of the last ``update`` each of its queries may see.

        Query i sits at position len(cache) - T_new + i; the key in column j, at position p_j
        (``key_positions``), is visible when 0 <= i's position - p_j < ``window`` (default: the
        cache's), or when p_j is a sink not after the query. None when every query sees every key,
        as in a decode step whose window is the cache's. A window larger than the cache's would
        need keys the cache has dropped: ``ValueError``.
        """
        window = self.window if window is None else window
        check_positive_ints(window=window)
        if window > self.window:
            raise ValueError(f"window={window} needs the last {window} tokens, but the cache "
                             f"keeps only the last {self.window}")
        before, t_new = self._returned
        if t_new == 1 and window == self.window:
            return None
        keys = self.key_positions()
        queries = torch.arange(before, before + t_new, device=keys.device)
        offsets = queries[:, None] - keys[None, :]                                # (T_new, S)
        return (offsets >= 0) & ((offsets < window) | (keys < self.sinks)[None, :])

    def reset(self) -> None:
        """Forget every token (the buffers stay allocated): the next update is position 0."""
        self.seen = 0
        self._returned = (0, 0)

    def __repr__(self) -> str:
        dims = (f"head_dim={self.head_dim}" if self.value_dim == self.head_dim
                else f"head_dim={self.head_dim}, value_dim={self.value_dim}")
        sinks = f", sinks={self.sinks}" if self.sinks else ""
        return (f"RollingKVCache(batch_size={self.batch_size}, n_kv_heads={self.n_kv_heads}, "
                f"window={self.window}{sinks}, seen={self.seen}, held={self.held}, {dims}, "
                f"dtype={self.dtype}, device={self.device})")
