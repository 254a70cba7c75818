"""The KV caches: the keys and values of the tokens seen so far, kept for the next decode step.

A decoder generates one token at a time, and each new token's query attends to the keys and values
of all the tokens before it. Those keys and values never change once computed (a token's k and v
depend only on the tokens up to it), so they are kept instead of recomputed:

    prefill   k, v of the prompt's T tokens                  written at 0 .. T-1
    decode    k, v of the one new token                      written at T, then T+1, ...
    attend    the new query against every cached key         (B, H, 1, D) x (B, Hkv, len, D)

The buffers are allocated once, at their full length, and written in place: growing them with
``torch.cat`` would copy the whole cache at every step. They hold the key/value heads only (Hkv of
them), not the copies grouped-query attention shares among the query heads: that saving is the
point of GQA.

``KVCache`` (chapter 8) keeps every token. A windowed model needs only the last W keys and values:
``RollingKVCache`` (chapter 11) keeps exactly those, in a buffer of W slots where the token at
position p is written to slot p mod W, overwriting the token W positions before it, so its memory
is fixed however long the generation runs (Mistral's rolling buffer). StreamingLLM's attention
sinks are an option: the first ``sinks`` tokens keep slots of their own and stay visible to every
later query.

``StaticKVCache`` is the ``KVCache`` of a compiled decode step (gpt-fast's recipe): the same
buffers, but where to write is a tensor, not a Python int, and every step attends to the whole
buffer, the slots not written yet hidden by a mask. A step's shapes and Python values are then
the same at every position, so ``torch.compile`` traces it once for all of them.

Both share one protocol, so that an attention layer never asks which one it holds:
``cache.append(k_new, v_new, attn_mask=..., is_causal=..., window=...)`` stores the new keys and
values and returns a ``CacheView``: every key and value the new queries attend to, and the
``attn_mask``, ``is_causal`` and ``window`` that say which of them each query sees.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from .arguments import check_non_negative_ints, check_positive_ints
from .masks import band_mask

__all__ = ["CacheView", "KVCache", "RollingKVCache", "StaticKVCache", "is_kv_cache"]


class CacheView(NamedTuple):
    """What the queries of the tokens just appended attend to: keys k (B, Hkv, S, D), values v
    (B, Hkv, S, Dv), and the ``attn_mask`` (None, or broadcastable to (B, H, T_new, S)),
    ``is_causal`` and ``window`` to give the attention call with them (``backends``' signature)."""

    k: Tensor
    v: Tensor
    attn_mask: Tensor | None
    is_causal: bool
    window: int | None


def is_kv_cache(obj) -> bool:
    """Whether ``obj`` is one of this module's caches (``KVCache``, ``RollingKVCache``,
    ``StaticKVCache``)."""
    return isinstance(obj, _KVBuffers)


class _KVBuffers:
    """A key and a value buffer, (B, Hkv, slots, D) and (B, Hkv, slots, Dv), allocated once and
    written in place, and the check of what is written to them: what ``KVCache`` and
    ``RollingKVCache`` share. The sizes are checked by the cache, which names them.

    Each cache implements ``append`` (``KVCache.append``): store the new keys and values, and
    say which keys the new queries see."""

    def __init__(self, batch_size: int, n_kv_heads: int, slots: int, head_dim: int,
                 value_dim: int, dtype: torch.dtype, device):
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.batch_size, self.n_kv_heads = batch_size, n_kv_heads
        self.head_dim, self.value_dim = head_dim, value_dim
        self.k = torch.zeros(batch_size, n_kv_heads, slots, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch_size, n_kv_heads, slots, value_dim, dtype=dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        """Bytes of the two buffers: B · Hkv · slots · (D + Dv) · bytes per element."""
        return self.k.nbytes + self.v.nbytes

    def append(self, k_new: Tensor, v_new: Tensor, *, attn_mask: Tensor | None = None,
               is_causal: bool = True, window: int | None = None) -> CacheView:
        raise NotImplementedError

    def _check(self, name: str, t, width: int) -> None:
        expected = (self.batch_size, self.n_kv_heads, "T_new", width)
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a tensor {expected}, got {type(t).__name__}")
        if (t.dim() != 4 or t.shape[0] != self.batch_size or t.shape[1] != self.n_kv_heads
                or t.shape[3] != width):
            raise ValueError(f"{name} must have shape (B={self.batch_size}, "
                             f"Hkv={self.n_kv_heads}, T_new, D={width}), got {tuple(t.shape)}")
        if t.dtype != self.dtype or t.device != self.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}, but the cache holds "
                             f"{self.dtype} on {self.device}")


class KVCache(_KVBuffers):
    """Preallocated key and value buffers, (B, Hkv, max_seq_len, D) each, filled from the left.

    ``k, v = cache.update(k_new, v_new)`` writes (B, Hkv, T_new, D) at the current length and
    returns the valid prefix (B, Hkv, len(cache), D) of each buffer (views, not copies).
    ``len(cache)`` is how many positions hold data; ``cache.reset()`` empties it for a new
    sequence. ``value_dim`` (default ``head_dim``) is the width of the values when it differs
    from the keys'. ``nbytes`` is the memory the buffers take.

    It is for inference: the in-place writes are not something autograd can differentiate
    through (a backward through ``update`` fails), so train on whole sequences, without a cache.
    """

    def __init__(self, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int, *,
                 value_dim: int | None = None, dtype: torch.dtype = torch.float32, device=None):
        value_dim = head_dim if value_dim is None else value_dim
        check_positive_ints(batch_size=batch_size, n_kv_heads=n_kv_heads,
                            max_seq_len=max_seq_len, head_dim=head_dim, value_dim=value_dim)
        super().__init__(batch_size, n_kv_heads, max_seq_len, head_dim, value_dim, dtype, device)
        self.max_seq_len = max_seq_len
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Append k_new, v_new (B, Hkv, T_new, D) -> every key and value so far, (B, Hkv, len, D).

        ``ValueError`` (and the cache left as it was) for a shape, dtype or device that does not
        match, or when the new tokens do not fit in ``max_seq_len``.
        """
        self._check("k_new", k_new, self.head_dim)
        self._check("v_new", v_new, self.value_dim)
        t_new = k_new.shape[2]
        if v_new.shape[2] != t_new:
            raise ValueError(f"k_new has T_new={t_new} positions but v_new has {v_new.shape[2]}")
        end = self.length + t_new
        if end > self.max_seq_len:
            raise ValueError(f"the cache holds {self.length} of max_seq_len={self.max_seq_len} "
                             f"positions; {t_new} more would need {end}")
        self.k[:, :, self.length:end] = k_new
        self.v[:, :, self.length:end] = v_new
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def append(self, k_new: Tensor, v_new: Tensor, *, attn_mask: Tensor | None = None,
               is_causal: bool = True, window: int | None = None) -> CacheView:
        """``update``, and what the new queries (B, H, T_new, D) attend to: every key so far,
        S = len(cache), with the ``attn_mask``, ``is_causal`` and ``window`` given (bottom-right
        aligned, the new queries being the last T_new positions, so they apply as they are)."""
        k, v = self.update(k_new, v_new)
        return CacheView(k, v, attn_mask, is_causal, window)

    def reset(self) -> None:
        """Forget every position (the buffers stay allocated): the next update writes at 0."""
        self.length = 0

    def __repr__(self) -> str:
        dims = (f"head_dim={self.head_dim}" if self.value_dim == self.head_dim
                else f"head_dim={self.head_dim}, value_dim={self.value_dim}")
        return (f"KVCache(batch_size={self.batch_size}, n_kv_heads={self.n_kv_heads}, "
                f"length={self.length}/{self.max_seq_len}, {dims}, dtype={self.dtype}, "
                f"device={self.device})")


class StaticKVCache(_KVBuffers):
    """``KVCache``'s buffers, (B, Hkv, max_seq_len, D) each, for a decode step that
    ``torch.compile`` traces once: the position of the next token is a tensor, ``next_position``
    (0-d long), never a Python int, and ``append`` returns the whole buffers with a mask.

    ``append(k_new, v_new)`` writes the T_new new tokens at positions ``next_position + 0 ..
    T_new - 1`` (``index_copy_``, in place), moves ``next_position`` on by T_new (in place too),
    and returns every slot: S = max_seq_len, and the mask (T_new, S), or (B, 1, T_new, S) with an
    ``attn_mask``, in which new token i sees slot j when j <= its position (``is_causal``; else
    every slot written), within ``window`` positions of it when given, and allowed by
    ``attn_mask`` (a bool (B, 1, 1, S') padding mask; S' < S is padded with True). The
    slots past the last position are hidden, never read as zeros. The mask is computed from
    ``slots`` (the position of each slot, made once), O(T_new·S), not sliced from an (S, S)
    table: gpt-fast's table would take S² bytes, 1 GiB at S = 32K.

    ``positions(t)`` (t,): where the next t tokens go, as a tensor (RoPE's positions in a
    compiled step); ``len(cache)`` reads ``next_position`` back as an int (a device sync: for
    eager code, never inside the compiled step). For inference only; bad shapes, dtypes or
    devices raise ``ValueError`` as ``KVCache``'s, and so does writing past ``max_seq_len``
    outside a compiled step (inside one nothing is checked: its caller checks the length).
    """

    def __init__(self, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int, *,
                 value_dim: int | None = None, dtype: torch.dtype = torch.float32, device=None):
        value_dim = head_dim if value_dim is None else value_dim
        check_positive_ints(batch_size=batch_size, n_kv_heads=n_kv_heads,
                            max_seq_len=max_seq_len, head_dim=head_dim, value_dim=value_dim)
        super().__init__(batch_size, n_kv_heads, max_seq_len, head_dim, value_dim, dtype, device)
        self.max_seq_len = max_seq_len
        self.slots = torch.arange(max_seq_len, device=self.device)                  # (S,)
        self.next_position = torch.zeros((), dtype=torch.long, device=self.device)

    def __len__(self) -> int:
        return int(self.next_position)

    def positions(self, t: int) -> Tensor:
        """(t,) long: the positions the next t tokens are written at."""
        return self.next_position + self.slots[:t]

    def append(self, k_new: Tensor, v_new: Tensor, *, attn_mask: Tensor | None = None,
               is_causal: bool = True, window: int | None = None) -> CacheView:
        """Write k_new, v_new (B, Hkv, T_new, D) at ``positions(T_new)`` -> a ``CacheView`` of
        every slot, (B, Hkv, max_seq_len, D), with the mask that says which each new query
        sees (is_causal False and window None: the mask says it all)."""
        self._check("k_new", k_new, self.head_dim)
        self._check("v_new", v_new, self.value_dim)
        t_new = k_new.shape[2]
        if v_new.shape[2] != t_new:
            raise ValueError(f"k_new has T_new={t_new} positions but v_new has {v_new.shape[2]}")
        if t_new > self.max_seq_len:
            raise ValueError(f"{t_new} new tokens do not fit in max_seq_len={self.max_seq_len}")
        if not torch.compiler.is_compiling() and len(self) + t_new > self.max_seq_len:
            raise ValueError(f"the cache holds {len(self)} of max_seq_len={self.max_seq_len} "
                             f"positions; {t_new} more would need {len(self) + t_new}")
        queries = self.positions(t_new)                                          # (T_new,)
        self.k.index_copy_(2, queries, k_new)
        self.v.index_copy_(2, queries, v_new)
        self.next_position.add_(t_new)
        if is_causal:
            seen = self.slots[None, :] <= queries[:, None]                       # (T_new, S)
        else:
            seen = (self.slots < self.next_position).expand(t_new, -1)
        if window is not None:
            seen = seen & (self.slots[None, :] > queries[:, None] - window)
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool:
                raise ValueError(f"a StaticKVCache takes a bool attn_mask, got {attn_mask.dtype}")
            missing = self.max_seq_len - attn_mask.shape[-1]
            if missing:
                attn_mask = torch.cat([attn_mask, attn_mask.new_ones(
                    *attn_mask.shape[:-1], missing)], dim=-1)
            seen = seen & attn_mask
        return CacheView(self.k, self.v, seen, False, None)

    def reset(self) -> None:
        """Forget every position (the buffers stay allocated): the next append writes at 0."""
        self.next_position.zero_()

    def __repr__(self) -> str:
        dims = (f"head_dim={self.head_dim}" if self.value_dim == self.head_dim
                else f"head_dim={self.head_dim}, value_dim={self.value_dim}")
        return (f"StaticKVCache(batch_size={self.batch_size}, n_kv_heads={self.n_kv_heads}, "
                f"length={len(self)}/{self.max_seq_len}, {dims}, dtype={self.dtype}, "
                f"device={self.device})")


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
    or a sink), for every case that the plain bottom-right window mask does not cover;
    ``append`` is the update with the mask, causal flag and window to attend with.
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
        check_non_negative_ints(sinks=sinks)
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
        keys = self.key_positions()                                               # (S,)
        # positions lo .. before + T_new - 1 hold every key that is not a sink, consecutive:
        # the window rule over them is masks.band_mask, gathered at the keys' positions
        lo = max(before - self.window, 0)
        in_window = band_mask(before - lo, t_new, before + t_new - lo, is_causal=True,
                              window=window, device=keys.device)          # (T_new, positions)
        seen = in_window[:, (keys - lo).clamp(min=0)]                             # (T_new, S)
        if self.sinks:                   # a sink is seen by every query not before it
            sinks = keys < self.sinks
            not_after = band_mask(before, t_new, self.sinks, is_causal=True, window=None,
                                  device=keys.device)                     # (T_new, sinks)
            seen[:, sinks] = not_after[:, keys[sinks]]
        return seen

    def append(self, k_new: Tensor, v_new: Tensor, *, attn_mask: Tensor | None = None,
               is_causal: bool = True, window: int | None = None) -> CacheView:
        """``update``, and what the new queries (B, H, T_new, D) attend to, for causal attention
        without ``attn_mask`` whose ``window`` is at most the cache's.

        After a one-token step the keys are in slot order, and sinks lie outside the window:
        then the mask is ``visible(window)`` (is_causal False, window None). Otherwise (a
        prefill without sinks) the keys are consecutive positions ending at the newest token,
        and ``is_causal`` and ``window`` apply as they are. ``ValueError``, and the cache left
        as it was, for any other attention.
        """
        if window is None:
            raise ValueError(f"a RollingKVCache keeps only the last {self.window} tokens, but "
                             "this module has window=None (it attends to every earlier token): "
                             "use a KVCache")
        check_positive_ints(window=window)
        if self.window < window:
            raise ValueError(f"a RollingKVCache of window={self.window} keeps too few tokens for "
                             f"this module's window={window}: use one of window >= {window} "
                             "(new_rolling_cache), or a KVCache")
        if attn_mask is not None or not is_causal:
            raise ValueError("a RollingKVCache serves causal self-attention without attn_mask: "
                             "the keys it returns are not in time order")
        k, v = self.update(k_new, v_new)
        if k_new.shape[2] == 1 or self.sinks:
            return CacheView(k, v, self.visible(window), False, None)
        return CacheView(k, v, None, True, window)

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
