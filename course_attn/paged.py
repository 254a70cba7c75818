"""A paged KV cache: a pool of fixed-size blocks shared by every sequence, and block tables.

Chapter 8's ``KVCache`` reserves, for every sequence, a buffer as long as the longest sequence
might grow: what a short request leaves empty is reserved all the same. vLLM's PagedAttention
(Kwon et al., 2023, §4) cuts the cache into blocks of ``block_size`` token slots, taken from one
pool as a sequence grows, so at most one partly filled block per sequence is wasted:

    pool (one per layer)   K (num_blocks, Hkv, block_size, D)    V (num_blocks, Hkv, block_size, Dv)
    block table            sequence a: [5, 2, 7]  -> its token p sits in block table[p // bs],
                                                     slot p % bs of that block
    paged attention        a query against the keys and values gathered through its table

Blocks are reference counted, so sequences with a common prefix share the blocks that hold it;
the first write into a shared block copies it (copy-on-write, vLLM's, Kwon et al., 2023, §4.4),
so no sequence ever sees another's tokens. A prefix cache keeps full blocks after their sequence
ends (nano-vllm's and vLLM's automatic prefix caching): each full block is registered under a
chained hash of its tokens and of every block before it, a freed registered block stays
findable until its space is needed, and the least recently freed is evicted first (LRU).
``PoolExhausted`` (a ``ValueError``)
says the pool has no free block: a serving engine catches it and preempts a request
(``serve.py``).
"""

import math
from collections import OrderedDict

import torch
from torch import Tensor

from .arguments import check_non_negative_ints, check_positive_ints
from .backends import get_backend

__all__ = ["BlockTable", "PagedKVCache", "PoolExhausted", "block_tables_tensor", "gather_blocks",
           "paged_attention", "ragged_causal_mask"]


class PoolExhausted(ValueError):
    """Not enough free blocks in the pool for what was asked: nothing was changed."""


class PagedKVCache:
    """The block pool of every layer: K (num_blocks, Hkv, block_size, D) and V (num_blocks, Hkv,
    block_size, Dv) per layer, each allocated once, and each block's reference count.

    ``allocate()`` takes a free block (reference count 1), ``share(b)`` adds a reference,
    ``release(b)`` drops one and frees the block at zero; freed blocks are reused, the most
    recently freed first. ``register(block, key, tokens)`` files a full block in the prefix
    cache; ``cached(key, tokens)`` finds it; a registered block freed by every sequence stays
    cached (not overwritten) until ``allocate`` finds no never-registered free block and evicts
    the least recently freed one. ``write(layer, slots, k, v)`` stores keys and values at flat slots
    ``block * block_size + offset``. ``new_table()`` is an empty ``BlockTable`` on this pool;
    ``copies`` counts the blocks copied on write, ``allocations`` the blocks taken from the free
    list.
    """

    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int,
                 head_dim: int, *, value_dim: int | None = None,
                 dtype: torch.dtype = torch.float32, device=None):
        value_dim = head_dim if value_dim is None else value_dim
        check_positive_ints(n_layers=n_layers, num_blocks=num_blocks, block_size=block_size,
                            n_kv_heads=n_kv_heads, head_dim=head_dim, value_dim=value_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.n_kv_heads, self.head_dim, self.value_dim = n_kv_heads, head_dim, value_dim
        self.k = [torch.zeros(num_blocks, n_kv_heads, block_size, head_dim, dtype=dtype,
                              device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(num_blocks, n_kv_heads, block_size, value_dim, dtype=dtype,
                              device=device) for _ in range(n_layers)]
        self.refcount = [0] * num_blocks
        self.copies = 0                                       # copy-on-write copies made
        self.allocations = 0                                  # blocks taken from the free list
        self._free = list(range(num_blocks - 1, -1, -1))     # a stack: block 0 is taken first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # freed, cached: oldest first
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (key, its tokens)
        self._block_of: dict[int, int] = {}                  # key -> block
        self.evictions = 0                                    # cached blocks given away

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can give: never-registered free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached_free(self) -> int:
        """Free blocks still in the prefix cache."""
        return len(self._evictable)

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's pool: L · num_blocks · Hkv · block_size · (D + Dv) · itemsize"""
        return sum(t.nbytes for t in self.k + self.v)

    def allocate(self) -> int:
        """A free block, now with one reference; ``PoolExhausted`` when none is left."""
        if not self._free and not self._evictable:
            raise PoolExhausted(f"the pool's {self.num_blocks} blocks are all in use")
        if self._free:
            block = self._free.pop()
        else:                                   # the least recently freed cached block
            block, _ = self._evictable.popitem(last=False)
            key, _ = self._key_of.pop(block)
            del self._block_of[key]
            self.evictions += 1
        self.refcount[block] = 1
        self.allocations += 1
        return block

    def register(self, block: int, key: int, tokens: tuple[int, ...]) -> None:
        """File a full block in use under ``key`` (a chained hash) and the tokens it holds; a
        key already filed, or a block already registered, is left as it is."""
        self._check_block(block)
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = (key, tuple(tokens))

    def cached(self, key: int, tokens) -> int | None:
        """The block filed under ``key`` if it holds exactly ``tokens`` (a hash may collide),
        else None."""
        block = self._block_of.get(key)
        if block is None or self._key_of[block][1] != tuple(tokens):
            return None
        return block

    def take(self, block: int) -> None:
        """One more reference to a block from the prefix cache, in use or freed (then it is
        taken back from the evictable ones)."""
        if block in self._evictable:
            del self._evictable[block]
            self.refcount[block] = 1
        else:
            self.share(block)

    def _check_block(self, block) -> None:
        if (isinstance(block, bool) or not isinstance(block, int)
                or not 0 <= block < self.num_blocks):
            raise ValueError(f"block {block!r} is not in the pool of {self.num_blocks} blocks")
        if self.refcount[block] == 0:
            raise ValueError(f"block {block} is free: it has no reference to share or release")

    def share(self, block: int) -> None:
        """One more reference to a block in use."""
        self._check_block(block)
        self.refcount[block] += 1

    def release(self, block: int) -> None:
        """One reference less; at zero the block is free again. A free block: ``ValueError``."""
        self._check_block(block)
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free.append(block)
        if self.refcount[block] == 0 and block in self._key_of:   # kept in the prefix cache,
            self._free.remove(block)                               # evicted last
            self._evictable[block] = None

    def copy_block(self, src: int, dst: int) -> None:
        """Copy every layer's keys and values of block ``src`` into block ``dst``."""
        for k, v in zip(self.k, self.v):
            k[dst] = k[src]
            v[dst] = v[src]
        self.copies += 1

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k (Hkv, N, D) and v (Hkv, N, Dv) at flat slots (N,) of ``layer``'s pool."""
        n = slots.shape[0]
        if k.shape != (self.n_kv_heads, n, self.head_dim) or v.shape != (
                self.n_kv_heads, n, self.value_dim):
            raise ValueError(f"k and v must be (Hkv={self.n_kv_heads}, N={n}, D={self.head_dim}) "
                             f"and (Hkv, N, Dv={self.value_dim}) for {n} slots, got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        blocks, offsets = slots // self.block_size, slots % self.block_size
        self.k[layer][blocks, :, offsets] = k.transpose(0, 1)            # (N, Hkv, D)
        self.v[layer][blocks, :, offsets] = v.transpose(0, 1)

    def new_table(self) -> "BlockTable":
        return BlockTable(self)

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={len(self.k)}, num_blocks={self.num_blocks}, "
                f"block_size={self.block_size}, used={self.num_used}, "
                f"n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim})")


class BlockTable:
    """One sequence's blocks in its pool, in order, and how many of its tokens they hold.

    ``reserve(n)`` makes room for the next n tokens and returns their flat slots (n,): it takes
    new blocks as needed and first copies a shared, partly filled last block (copy-on-write). It
    changes nothing when the pool is short (``PoolExhausted``). ``share_prefix(other, n)`` starts
    an empty table on the first n tokens of another: the blocks that hold them are shared, not
    copied. ``fork()`` shares every block. ``free()`` releases them all.
    """

    def __init__(self, pool: PagedKVCache):
        self.pool = pool
        self.blocks: list[int] = []
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def blocks_needed(self, n: int) -> int:
        """Free blocks that ``reserve(n)`` would take (a copy-on-write copy included)."""
        bs = self.pool.block_size
        new = math.ceil((self.length + n) / bs) - len(self.blocks)
        copy = n > 0 and self.length % bs != 0 and self.pool.refcount[self.blocks[-1]] > 1
        return max(new, 0) + int(copy)

    def reserve(self, n: int) -> Tensor:
        """Room for the next n tokens -> their flat slots (n,) long, ``block * bs + offset``."""
        check_non_negative_ints(n=n)
        pool, bs = self.pool, self.pool.block_size
        needed = self.blocks_needed(n)
        if needed > pool.num_free:
            raise PoolExhausted(f"{n} more tokens need {needed} free blocks, the pool has "
                                f"{pool.num_free} of {pool.num_blocks}")
        if n and self.length % bs and pool.refcount[self.blocks[-1]] > 1:   # copy-on-write
            copy = pool.allocate()
            pool.copy_block(self.blocks[-1], copy)
            pool.release(self.blocks[-1])
            self.blocks[-1] = copy
        while len(self.blocks) * bs < self.length + n:
            self.blocks.append(pool.allocate())
        positions = torch.arange(self.length, self.length + n)
        self.length += n
        table = torch.tensor(self.blocks, dtype=torch.long)
        return table[positions // bs] * bs + positions % bs

    def share_prefix(self, other: "BlockTable", n: int) -> None:
        """Make this empty table hold the first n tokens of ``other`` by sharing its blocks."""
        if self.blocks:
            raise ValueError(f"share_prefix starts an empty table; this one holds {self.length}")
        if other.pool is not self.pool or not 0 <= n <= other.length:
            raise ValueError(f"can share 0 to {other.length} tokens of a table on the same pool, "
                             f"got n={n}")
        self.blocks = other.blocks[:math.ceil(n / self.pool.block_size)]
        for block in self.blocks:
            self.pool.share(block)
        self.length = n

    def start_on(self, blocks: list[int]) -> None:
        """Make this empty table hold the full blocks ``blocks`` (from the prefix cache), each
        taken with one more reference."""
        if self.blocks:
            raise ValueError(f"start_on starts an empty table; this one holds {self.length}")
        for block in blocks:
            self.pool.take(block)
        self.blocks, self.length = list(blocks), len(blocks) * self.pool.block_size

    def fork(self) -> "BlockTable":
        """A new table holding the same tokens, every block shared."""
        table = BlockTable(self.pool)
        table.share_prefix(self, self.length)
        return table

    def free(self) -> None:
        """Release every block; the table is empty again. Of the blocks that stay in the prefix
        cache, the last is evicted first and the first last (nano-vllm frees a table's blocks in
        reverse), so that a shorter prefix stays whole."""
        for block in self.blocks:
            self.pool.release(block)
        evictable = self.pool._evictable
        for block in reversed(self.blocks):
            if block in evictable:
                evictable.move_to_end(block)
        self.blocks, self.length = [], 0

    def __repr__(self) -> str:
        return f"BlockTable(length={self.length}, blocks={self.blocks})"


def block_tables_tensor(tables: list[BlockTable], device=None) -> Tensor:
    """(B, max blocks) long: each table's blocks, padded with -1."""
    width = max(1, max(len(t.blocks) for t in tables))
    return torch.tensor([t.blocks + [-1] * (width - len(t.blocks)) for t in tables],
                        dtype=torch.long, device=device)


INDEX_DTYPES = (torch.long, torch.int32)       # of block tables and lengths


def _described(t) -> str:
    return (f"shape {tuple(t.shape)} dtype {t.dtype}" if isinstance(t, Tensor)
            else f"a {type(t).__name__}")


def _check_tables(pool: Tensor, block_tables: Tensor, context_lens: Tensor) -> None:
    """Shapes, and every block a sequence needs inside the pool (entries past them are unread)."""
    num_blocks, bs = pool.shape[0], pool.shape[2]
    if (not isinstance(block_tables, Tensor) or block_tables.dim() != 2
            or block_tables.dtype not in INDEX_DTYPES):
        raise ValueError(f"block_tables must be a (B, max_blocks) long tensor (or int32, as "
                         f"vLLM's), got {_described(block_tables)}")
    b = block_tables.shape[0]
    if (not isinstance(context_lens, Tensor) or context_lens.shape != (b,)
            or context_lens.dtype not in INDEX_DTYPES):
        raise ValueError(f"context_lens must be a ({b},) long tensor (or int32), one length per "
                         f"block table, got {_described(context_lens)}")
    needed = (context_lens + bs - 1) // bs                                   # (B,)
    if b and int(needed.max()) > block_tables.shape[1]:
        raise ValueError(f"context_lens {context_lens.tolist()} need up to {int(needed.max())} "
                         f"blocks of {bs}, but block_tables has {block_tables.shape[1]} columns")
    read = torch.arange(block_tables.shape[1], device=block_tables.device) < needed[:, None]
    bad = read & ((block_tables < 0) | (block_tables >= num_blocks))
    if bad.any():
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"block_tables[{row}, {col}] = {int(block_tables[row, col])} points "
                         f"outside the pool of {num_blocks} blocks")


def gather_blocks(pool: Tensor, block_tables: Tensor) -> Tensor:
    """The tokens of each sequence, gathered through its table, in order.

    pool (num_blocks, Hkv, bs, D), block_tables (B, M) -> (B, Hkv, M · bs, D): sequence b's
    token p is at [b, :, p], read from block ``block_tables[b, p // bs]``, slot ``p % bs``.
    Entries of -1 (padding) read block 0: mask what lies past a sequence's length.
    """
    b, m = block_tables.shape
    _, h, bs, d = pool.shape
    blocks = pool[block_tables.clamp(min=0)]                                  # (B, M, Hkv, bs, D)
    return blocks.transpose(1, 2).reshape(b, h, m * bs, d)


def ragged_causal_mask(context_lens: Tensor, query_lens: Tensor, tq: int, s: int, *,
                       window: int | None = None) -> Tensor:
    """Bool (B, 1, Tq, S): True where query i of sequence b may see key j.

    Sequence b has context_lens[b] keys; its query_lens[b] queries are the last of them (bottom-
    right causal): query i sits at position context_lens[b] - query_lens[b] + i and sees the
    keys j <= that position (and, with a ``window``, those less than ``window`` before it).
    Rows i >= query_lens[b] (padding) and keys j >= context_lens[b] see nothing.
    """
    device = context_lens.device
    i = torch.arange(tq, device=device)[None, :, None]                        # (1, Tq, 1)
    j = torch.arange(s, device=device)[None, None, :]                         # (1, 1, S)
    position = (context_lens - query_lens)[:, None, None] + i                 # (B, Tq, 1)
    keep = (j <= position) & (i < query_lens[:, None, None])
    if window is not None:
        keep &= position - j < window
    return keep[:, None]


def paged_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor,
                    context_lens: Tensor, query_lens: Tensor | None = None, *,
                    scale: float | None = None, window: int | None = None,
                    backend: str = "math") -> Tensor:
    """Queries of sequences of different lengths against their keys and values in the pool.

    q (B, Hq, Tq, D); k_pool (num_blocks, Hkv, bs, D), v_pool (num_blocks, Hkv, bs, Dv);
    block_tables (B, max_blocks) (-1 where unused); context_lens (B,): keys of each sequence;
    query_lens (B,), default Tq: sequence b's queries are q[b, :, :query_lens[b]], its last
    positions (bottom-right causal) -> (B, Hq, Tq, Dv), zeros in the padding rows. Tables and
    lengths are long or int32 (vLLM's).

    One call for the whole ragged batch: the keys are gathered through the tables, the padding
    and the future are masked, and ``backend`` (a name in ``BACKENDS``) attends. Equal to each
    sequence's contiguous keys attended with ``is_causal=True``.
    """
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor, got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    if k_pool.shape[:3] != v_pool.shape[:3] or k_pool.shape[3] != q.shape[3]:
        raise ValueError(f"k_pool (num_blocks, Hkv, bs, D={q.shape[3]}) and v_pool (num_blocks, "
                         f"Hkv, bs, Dv) do not match q {tuple(q.shape)}: got "
                         f"{tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    b, _, tq, _ = q.shape
    if block_tables.shape[:1] != (b,):
        raise ValueError(f"block_tables must have one row per sequence of q (B={b}), got shape "
                         f"{tuple(block_tables.shape)}")
    query_lens = (torch.full((b,), tq, dtype=torch.long, device=q.device) if query_lens is None
                  else query_lens)
    _check_tables(k_pool, block_tables, context_lens)
    if not isinstance(query_lens, Tensor) or query_lens.dtype not in INDEX_DTYPES:
        raise ValueError(f"query_lens must be a ({b},) long tensor (or int32), got "
                         f"{_described(query_lens)}")
    if query_lens.shape != (b,) or bool(((query_lens < 0) | (query_lens > tq)
                                         | (query_lens > context_lens)).any()):
        raise ValueError(f"query_lens must be ({b},), each in [0, min(Tq={tq}, its context_len)]"
                         f", got {query_lens.tolist()} for context_lens {context_lens.tolist()}")
    k = gather_blocks(k_pool, block_tables)                                   # (B, Hkv, S, D)
    v = gather_blocks(v_pool, block_tables)                                   # (B, Hkv, S, Dv)
    mask = ragged_causal_mask(context_lens, query_lens, tq, k.shape[2], window=window)
    return get_backend(backend)(q, k, v, attn_mask=mask, scale=scale,
                                enable_gqa=q.shape[1] != k.shape[1])
