"""The KV cache: the keys and values of every token seen so far, kept for the next decode step.

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
"""

import torch
from torch import Tensor

from .arguments import check_positive_ints

__all__ = ["KVCache"]


class _KVBuffers:
    """A key and a value buffer, (B, Hkv, slots, D) and (B, Hkv, slots, Dv), allocated once and
    written in place, and the check of what is written to them: what ``KVCache`` and
    ``local.RollingKVCache`` share. The sizes are checked by the cache, which names them."""

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

    def reset(self) -> None:
        """Forget every position (the buffers stay allocated): the next update writes at 0."""
        self.length = 0

    def __repr__(self) -> str:
        dims = (f"head_dim={self.head_dim}" if self.value_dim == self.head_dim
                else f"head_dim={self.head_dim}, value_dim={self.value_dim}")
        return (f"KVCache(batch_size={self.batch_size}, n_kv_heads={self.n_kv_heads}, "
                f"length={self.length}/{self.max_seq_len}, {dims}, dtype={self.dtype}, "
                f"device={self.device})")
