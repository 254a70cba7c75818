"""paged.py: the block pool counts references, frees and reuses blocks and refuses what it cannot
do (changing nothing); block tables copy a shared block before writing into it; and paged
attention over block tables, for any block size, GQA and ragged lengths in one call, equals each
sequence's contiguous keys attended by the reference ``scaled_dot_product_attention``."""

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course_attn.attention import scaled_dot_product_attention
from course_attn.paged import (PagedKVCache, PoolExhausted, block_tables_tensor, gather_blocks,
                               paged_attention)
from helpers import randn


def pool_of(num_blocks=6, block_size=4, layers=1, hkv=2, d=3, dv=None, device="cpu"):
    return PagedKVCache(layers, num_blocks, block_size, hkv, d, value_dim=dv, device=device)


def fill(pool, table, n, seed):
    """Reserve n tokens in ``table`` and write random keys/values (Hkv, n, D) to every layer;
    -> what was written, per layer: [(k, v)]."""
    slots = table.reserve(n)
    written = []
    for layer in range(len(pool.k)):
        k = randn(pool.n_kv_heads, n, pool.head_dim, seed=seed + layer)
        v = randn(pool.n_kv_heads, n, pool.value_dim, seed=seed + 100 + layer)
        pool.write(layer, slots, k, v)
        written.append((k, v))
    return written


def contents(pool, table, layer=0):
    """A table's keys and values read back through it: (Hkv, len, D), (Hkv, len, Dv)."""
    tables = block_tables_tensor([table])
    k = gather_blocks(pool.k[layer], tables)[0, :, :len(table)]
    v = gather_blocks(pool.v[layer], tables)[0, :, :len(table)]
    return k, v


# ---------------------------------------------------------------- the pool

def test_blocks_are_counted_freed_and_reused():
    pool = pool_of(num_blocks=3)
    a, b = pool.allocate(), pool.allocate()
    assert (pool.num_used, pool.num_free) == (2, 1) and a != b
    pool.share(a)
    pool.release(a)
    assert pool.refcount[a] == 1 and pool.num_used == 2      # still held once
    pool.release(a)
    assert pool.refcount[a] == 0 and pool.num_free == 2
    assert pool.allocate() == a                               # the freed block comes back
    assert pool.allocations == 3                              # shares are not allocations


def test_an_exhausted_pool_raises_a_typed_value_error():
    pool = pool_of(num_blocks=2)
    pool.allocate(), pool.allocate()
    with pytest.raises(PoolExhausted, match="pool's 2 blocks are all in use"):
        pool.allocate()
    assert issubclass(PoolExhausted, ValueError)


def test_releasing_a_free_block_or_one_outside_the_pool_is_refused():
    pool = pool_of(num_blocks=2)
    with pytest.raises(ValueError, match="block 1 is free"):
        pool.release(1)
    with pytest.raises(ValueError, match="block 1 is free"):
        pool.share(1)
    with pytest.raises(ValueError, match="block 5 is not in the pool of 2 blocks"):
        pool.release(5)


def test_write_refuses_keys_of_the_wrong_shape():
    pool = pool_of(hkv=2, d=3)
    slots = pool.new_table().reserve(2)
    with pytest.raises(ValueError, match=r"k and v must be \(Hkv=2, N=2, D=3\)"):
        pool.write(0, slots, torch.zeros(2, 2, 4), torch.zeros(2, 2, 3))


def test_the_pool_is_allocated_once_per_layer():
    pool = pool_of(num_blocks=5, block_size=4, layers=3, hkv=2, d=3, dv=7)
    assert len(pool.k) == len(pool.v) == 3
    assert pool.k[0].shape == (5, 2, 4, 3) and pool.v[2].shape == (5, 2, 4, 7)
    assert pool.nbytes == 3 * 5 * 2 * 4 * (3 + 7) * 4


# ---------------------------------------------------------------- block tables

def test_reserve_gives_each_token_its_block_and_offset():
    pool = pool_of(num_blocks=6, block_size=4)
    other, table = pool.new_table(), pool.new_table()
    other.reserve(3)                                   # takes block 0
    slots = table.reserve(6)                           # blocks 1 and 2
    assert table.blocks == [1, 2] and len(table) == 6
    assert slots.tolist() == [4, 5, 6, 7, 8, 9]
    assert table.reserve(3).tolist() == [10, 11, 12]  # fills block 2, then takes block 3


def test_a_short_pool_changes_nothing():
    pool = pool_of(num_blocks=2, block_size=4)
    table = pool.new_table()
    table.reserve(5)
    with pytest.raises(PoolExhausted, match="4 more tokens need 1 free blocks, the pool has 0"):
        table.reserve(4)
    assert len(table) == 5 and table.blocks == [0, 1] and pool.num_free == 0


def test_a_shared_full_block_is_read_by_both_and_never_copied():
    pool = pool_of(num_blocks=6, block_size=4)
    first = pool.new_table()
    written = fill(pool, first, 4, seed=1)
    second = first.fork()
    assert second.blocks == first.blocks and pool.refcount[first.blocks[0]] == 2
    fill(pool, second, 2, seed=2)                       # starts a block of its own
    assert second.blocks[0] == first.blocks[0] and pool.copies == 0
    k, v = contents(pool, second)
    assert torch.equal(k[:, :4], written[0][0]) and torch.equal(v[:, :4], written[0][1])


def test_the_first_write_into_a_shared_partly_filled_block_copies_it():
    pool = pool_of(num_blocks=6, block_size=4, layers=2)
    first = pool.new_table()
    written = fill(pool, first, 6, seed=1)
    second = first.fork()
    shared = first.blocks[1]
    fill(pool, second, 1, seed=7)                       # copy-on-write of the last block
    assert pool.copies == 1 and second.blocks[1] != shared and pool.refcount[shared] == 1
    for layer, (k, v) in enumerate(written):
        assert torch.equal(contents(pool, first, layer)[0], k)        # the original, untouched
        assert torch.equal(contents(pool, second, layer)[0][:, :6], k)  # the copy
    fill(pool, first, 1, seed=9)                        # now alone in its block: no copy
    assert pool.copies == 1 and first.blocks[1] == shared


def test_share_prefix_refuses_a_prefix_longer_than_the_table():
    pool = pool_of()
    donor = pool.new_table()
    donor.reserve(3)
    with pytest.raises(ValueError, match="can share 0 to 3 tokens"):
        pool.new_table().share_prefix(donor, 4)


@given(seed=st.integers(0, 2 ** 31 - 1), block_size=st.sampled_from([1, 2, 4]),
       steps=st.integers(1, 40))
def test_random_operations_keep_counts_and_contents(seed, block_size, steps):
    """Tables reserve, fork, share prefixes and free at random: every block's count is the
    number of tables that hold it, used + free = num_blocks, nothing is lost or duplicated, and
    every table reads back exactly what was written for it; at the end every count is 0."""
    rng = random.Random(seed)
    pool = pool_of(num_blocks=10, block_size=block_size)
    tables, expected = [], []                          # expected: (Hkv, len, D) keys per table
    for step in range(steps):
        op = rng.choice(["new", "grow", "grow", "fork", "prefix", "free"])
        try:
            if op == "new" or not tables:
                table = pool.new_table()
                k = fill(pool, table, rng.randint(1, 5), seed=seed + step)[0][0]
                tables.append(table), expected.append(k)
            elif op == "grow":
                i = rng.randrange(len(tables))
                k = fill(pool, tables[i], rng.randint(1, 3), seed=seed + step)[0][0]
                expected[i] = torch.cat([expected[i], k], dim=1)
            elif op in ("fork", "prefix"):
                i = rng.randrange(len(tables))
                n = len(tables[i]) if op == "fork" else rng.randint(0, len(tables[i]))
                table = pool.new_table()
                table.share_prefix(tables[i], n)
                tables.append(table), expected.append(expected[i][:, :n])
            else:
                i = rng.randrange(len(tables))
                tables.pop(i).free()
                expected.pop(i)
        except PoolExhausted:
            pass
        held = [0] * pool.num_blocks
        for table in tables:
            for block in table.blocks:
                held[block] += 1
        assert held == pool.refcount
        assert pool.num_used + pool.num_free == pool.num_blocks
        assert pool.num_used == sum(count > 0 for count in held) <= pool.num_blocks
        for table, k in zip(tables, expected):
            assert torch.equal(contents(pool, table)[0], k)
    for table in tables:
        table.free()
    assert pool.refcount == [0] * pool.num_blocks and pool.num_free == pool.num_blocks


# ---------------------------------------------------------------- paged attention

@st.composite
def ragged_batches(draw):
    """Sequences of different lengths scattered over a shuffled pool."""
    return dict(
        lengths=draw(st.lists(st.integers(1, 13), min_size=1, max_size=4)),
        block_size=draw(st.sampled_from([1, 2, 3, 4, 16])),
        hkv=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2, 3])),
        d=draw(st.integers(1, 6)), dv=draw(st.integers(1, 6)),
        window=draw(st.one_of(st.none(), st.integers(1, 6))),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
        query_fraction=draw(st.floats(0, 1)),
    )


@given(case=ragged_batches())
def test_paged_attention_equals_each_sequences_contiguous_attention(case, device):
    rng = random.Random(case["seed"])
    bs, hkv, d, dv = case["block_size"], case["hkv"], case["d"], case["dv"]
    hq = hkv * case["group"]
    lengths = case["lengths"]
    query_lens = [max(1, round(n * case["query_fraction"])) for n in lengths]
    need = [-(-n // bs) for n in lengths]
    order = list(range(sum(need) + 3))                  # a few blocks no table uses
    rng.shuffle(order)
    k_pool = randn(len(order), hkv, bs, d, seed=case["seed"], device=device)
    v_pool = randn(len(order), hkv, bs, dv, seed=case["seed"] + 1, device=device)
    rows, start = [], 0
    for n in need:
        rows.append(order[start:start + n])
        start += n
    tables = torch.tensor([r + [-1] * (max(need) - len(r)) for r in rows], device=device)
    tq = max(query_lens)
    q = randn(len(lengths), hq, tq, d, seed=case["seed"] + 2, device=device)
    out = paged_attention(q, k_pool, v_pool, tables, torch.tensor(lengths, device=device),
                          torch.tensor(query_lens, device=device), window=case["window"])
    assert out.shape == (len(lengths), hq, tq, dv)
    for b, (n, m) in enumerate(zip(lengths, query_lens)):
        k = torch.cat([k_pool[i] for i in rows[b]], dim=1)[None, :, :n]       # (1, Hkv, n, D)
        v = torch.cat([v_pool[i] for i in rows[b]], dim=1)[None, :, :n]
        expected = scaled_dot_product_attention(q[b:b + 1, :, :m], k, v, is_causal=True,
                                                window=case["window"], enable_gqa=True)
        torch.testing.assert_close(out[b:b + 1, :, :m], expected, rtol=1e-5, atol=1e-6)
        assert not out[b, :, m:].any()                                        # padding rows


def test_paged_attention_is_the_same_on_every_backend():
    k_pool, v_pool = randn(8, 2, 4, 8, seed=1), randn(8, 2, 4, 8, seed=2)
    q = randn(2, 4, 3, 8, seed=3)
    tables = torch.tensor([[5, 1, 6], [2, -1, -1]])
    args = (q, k_pool, v_pool, tables, torch.tensor([11, 3]), torch.tensor([3, 1]))
    expected = paged_attention(*args)
    for backend in ("sdpa", "flash"):
        torch.testing.assert_close(paged_attention(*args, backend=backend), expected,
                                   rtol=1e-5, atol=1e-5)


def test_a_table_pointing_past_the_pool_is_refused():
    k_pool, v_pool = randn(4, 1, 2, 3), randn(4, 1, 2, 3)
    q = randn(1, 1, 1, 3)
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = 4 points outside the pool of 4"):
        paged_attention(q, k_pool, v_pool, torch.tensor([[0, 4]]), torch.tensor([3]))
    with pytest.raises(ValueError, match=r"block_tables\[0, 0\] = -1 points outside"):
        paged_attention(q, k_pool, v_pool, torch.tensor([[-1, 2]]), torch.tensor([3]))
    with pytest.raises(ValueError, match="need up to 3 blocks of 2, but block_tables has 2"):
        paged_attention(q, k_pool, v_pool, torch.tensor([[0, 1]]), torch.tensor([5]))


def test_mismatched_shapes_are_refused_by_name():
    k_pool, v_pool = randn(4, 1, 2, 3), randn(4, 1, 2, 5)
    tables, lens = torch.tensor([[0, 1]]), torch.tensor([3])
    with pytest.raises(ValueError, match="k_pool .* do not match q"):
        paged_attention(randn(1, 1, 1, 4), k_pool, v_pool, tables, lens)
    with pytest.raises(ValueError, match="one row per sequence of q"):
        paged_attention(randn(2, 1, 1, 3), k_pool, v_pool, tables, lens)
    with pytest.raises(ValueError, match=r"context_lens must be a \(1,\) long tensor"):
        paged_attention(randn(1, 1, 1, 3), k_pool, v_pool, tables, torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="query_lens must be"):
        paged_attention(randn(1, 1, 4, 3), k_pool, v_pool, tables, lens, torch.tensor([4]))
    with pytest.raises(ValueError, match="q must be a 4-D tensor"):
        paged_attention(randn(1, 3), k_pool, v_pool, tables, lens)


def test_int32_block_tables_and_lengths_as_vllms_give_the_same_attention():
    k_pool, v_pool = randn(8, 2, 4, 8, seed=1), randn(8, 2, 4, 8, seed=2)
    q = randn(2, 4, 3, 8, seed=3)
    tables, lens, query_lens = torch.tensor([[5, 1, 6], [2, -1, -1]]), torch.tensor([11, 3]), \
        torch.tensor([3, 1])
    expected = paged_attention(q, k_pool, v_pool, tables, lens, query_lens)
    out = paged_attention(q, k_pool, v_pool, tables.int(), lens.int(), query_lens.int())
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = 8 points outside the pool"):
        paged_attention(q, k_pool, v_pool, torch.tensor([[5, 8, 6], [2, -1, -1]],
                                                        dtype=torch.int32), lens.int())


@pytest.mark.parametrize("tables, lens, query_lens, message", [
    (torch.tensor([[0, 1]], dtype=torch.int16), torch.tensor([3]), None,
     r"block_tables must be a \(B, max_blocks\) long tensor \(or int32, as vLLM's\), got shape "
     r"\(1, 2\) dtype torch.int16"),
    (torch.tensor([[0, 1]]), torch.tensor([3.0]), None,
     r"context_lens must be a \(1,\) long tensor \(or int32\), one length per block table, got "
     r"shape \(1,\) dtype torch.float32"),
    (torch.tensor([[0, 1]]), [3], None, r"context_lens must be .* got a list"),
    (torch.tensor([[0, 1]]), torch.tensor([3]), torch.tensor([True]),
     r"query_lens must be a \(1,\) long tensor \(or int32\), got shape \(1,\) dtype torch.bool"),
])
def test_tables_and_lengths_of_other_types_are_refused_by_name(tables, lens, query_lens,
                                                                message):
    k_pool, v_pool = randn(4, 1, 2, 3), randn(4, 1, 2, 3)
    with pytest.raises(ValueError, match=message):
        paged_attention(randn(1, 1, 1, 3), k_pool, v_pool, tables, lens, query_lens)


# ---------------------------------------------------------------- the prefix cache

def test_a_registered_block_stays_cached_after_it_is_freed_until_its_space_is_needed():
    pool = pool_of(num_blocks=3)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, 11, (1, 2))
    pool.register(b, 22, (3, 4))
    pool.release(a)
    pool.release(b)
    assert pool.num_free == 3 and pool.num_cached_free == 2 and pool.num_used == 0
    assert pool.cached(11, [1, 2]) == a and pool.cached(22, (3, 4)) == b
    assert pool.cached(11, (1, 3)) is None                     # a colliding key is not a hit
    c = pool.allocate()                                        # the never-registered block
    assert c not in (a, b) and pool.evictions == 0
    assert pool.allocate() == a                                # then the least recently freed
    assert pool.cached(11, (1, 2)) is None and pool.evictions == 1
    pool.take(b)                                               # taken back from the cache
    assert pool.refcount[b] == 1 and pool.num_cached_free == 0
    with pytest.raises(PoolExhausted):
        pool.allocate()


def test_a_freed_table_leaves_its_prefix_to_be_evicted_from_the_end():
    pool = pool_of(num_blocks=4)
    table = pool.new_table()
    table.reserve(8)
    first, second = table.blocks
    pool.register(first, 1, (0,) * 4)
    pool.register(second, 2, (1,) * 4)
    table.free()
    pool.allocate(), pool.allocate()                           # the two free blocks
    assert pool.allocate() == second                           # the prefix's tail goes first
    other = pool.new_table()
    other.start_on([first])
    assert other.blocks == [first] and len(other) == 4 and pool.refcount[first] == 1
