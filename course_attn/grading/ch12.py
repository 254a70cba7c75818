"""Exercises of Chapter 12, serving: a paged KV cache, block tables, reference counts.

    ch12.gather_kv      gather_kv(pool_k, pool_v, block_table, length) -> (k, v): the keys
                        (Hkv, length, D) and values (Hkv, length, Dv) of one sequence, read
                        from pools (num_blocks, Hkv, bs, D) through its block table (M,)
    ch12.run_requests   run_requests(num_blocks, block_size, ops) -> (refcounts, tables): the
                        repaired bookkeeping of a block pool shared by requests (debug: the
                        notebook gives it freeing a shared block without looking at its count)
    ch12.paged_memory   paged_memory(lengths, block_size, max_len) -> dict: the blocks a paged
                        cache holds for sequences of these lengths, and the slots that hold no
                        token, paged and contiguous (derive, on sizes drawn at grading time)
    ch12.serving_costs  serving_costs(settings, prompts, max_new_tokens) -> dict: the steps, the
                        most blocks in use, the preemptions and the tokens fed when the given
                        engine serves a workload (measure, on workloads drawn at grading time)

Tasks: gather_kv implements; run_requests debugs; paged_memory derives; serving_costs measures.

References: ``course_attn.paged.gather_blocks`` cut at the length; the package's
``PagedKVCache`` and ``BlockTable`` run on the same operations; the counts computed from
ceil(L / bs) per sequence; the records (``engine.steps``) of the same engine on the same
workload (serving_costs).
"""

import functools
import math

import torch

from ..model import GPT, GPTConfig
from ..paged import PagedKVCache, gather_blocks
from ..serve import Engine
from .cases import count_questions, expect_tensors, randn
from .exercise import Case, Exercise, Mistake, register
from .operations import NONE

# --- ch12.gather_kv ------------------------------------------------------------------------------


def gather_kv_reference(pool_k, pool_v, block_table, length):
    """pool_k (N, Hkv, bs, D), pool_v (N, Hkv, bs, Dv), block_table (M,) long, length ->
    k (Hkv, length, D), v (Hkv, length, Dv): the package's gather, cut at the length."""
    table = block_table[None]
    return (gather_blocks(pool_k, table)[0, :, :length],
            gather_blocks(pool_v, table)[0, :, :length])


def gather_case(name, num_blocks, hkv, bs, d, dv, length, seed, *, shuffled=True, hint="",
                dtype=torch.float32):
    """A case of gather_kv: pools of ``num_blocks`` random blocks, and a table of the
    ceil(length / bs) blocks of one sequence, drawn from the pool (out of order if
    ``shuffled`` and there are two or more)."""
    g = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    pool_k = randn(num_blocks, hkv, bs, d, seed=g, dtype=dtype)
    pool_v = randn(num_blocks, hkv, bs, dv, seed=g, dtype=dtype)
    m = -(-length // bs)
    table = torch.randperm(num_blocks, generator=g)[:m]
    sorted_table = table.sort().values
    if not shuffled:
        table = sorted_table
    elif m > 1 and torch.equal(table, sorted_table):
        table = table.flip(0)                              # out of the pool's order, surely
    return Case(name, (pool_k, pool_v, table, length), hint=hint)


def _gather_wrong(*, order="table", whole=False, layout="blocks"):
    """gather_kv with one mistake, as a student writes it: ``order`` "pool" reads the blocks
    sorted by their index in the pool, "first" the pool's first blocks, ignoring the table;
    ``whole`` returns every slot of the blocks; ``layout`` "slots" lays the tokens out slot by
    slot across the blocks."""
    def gather(pool_k, pool_v, block_table, length):
        m = block_table.shape[0]
        table = {"table": block_table, "pool": block_table.sort().values,
                 "first": torch.arange(m)}[order]
        out = []
        for pool in (pool_k, pool_v):
            blocks = pool[table]                                     # (M, Hkv, bs, D)
            h, bs, d = blocks.shape[1:]
            if layout == "slots":
                flat = blocks.permute(1, 2, 0, 3).reshape(h, bs * m, d)
            else:
                flat = blocks.transpose(0, 1).reshape(h, m * bs, d)
            out.append(flat if whole else flat[:, :length])
        return tuple(out)
    return gather


def _gather_cases():
    yield gather_case("three blocks out of order, the last partly filled: bs=4, length=10, "
                      "Hkv=2, D=Dv=8", 9, 2, 4, 8, 8, 10, 1200,
                      hint="token p of the sequence sits in the block the table names for it, "
                           "in the slot its position gives")
    yield gather_case("the length fills its last block exactly: bs=4, length=8", 6, 1, 4, 4, 4,
                      8, 1201, hint="no slot is left over in the last block")
    yield gather_case("a single block, partly filled: bs=8, length=5", 4, 2, 8, 4, 4, 5, 1202,
                      hint="only the slots the sequence filled hold its tokens")
    yield gather_case("block size 1: every token a block of its own, length=6", 10, 1, 1, 4,
                      4, 6, 1203, hint="with one slot a block, the table lists the tokens")
    yield gather_case("blocks in the pool's order, but not its first ones: bs=2, length=5",
                      8, 1, 2, 4, 4, 5, 1204, shuffled=False,
                      hint="the blocks are the ones the table names")
    yield gather_case("Dv=3, D=6, Hkv=3, float64: bs=3, length=7", 7, 3, 3, 6, 3, 7, 1205,
                      hint="the keys and the values may differ in width; let their dtype flow "
                           "through", dtype=torch.float64)
    yield gather_case("one token: bs=4, length=1", 5, 2, 4, 4, 4, 1, 1206,
                      hint="one token: the first slot of the table's first block")


register(Exercise(
    key="ch12.gather_kv", function="gather_kv", reference=gather_kv_reference,
    task="implement",
    cases=_gather_cases, compare=expect_tensors(("k", "v")), banned=("course_attn",),
    mistakes=(
        Mistake("you read the sequence's blocks in the order they sit in the pool: its tokens "
                "run in the order of its block table", _gather_wrong(order="pool")),
        Mistake("you read the pool's first blocks: a sequence's blocks are the ones its block "
                "table names", _gather_wrong(order="first")),
        Mistake("you returned every slot of the blocks: the slots of the last block past the "
                "sequence's length hold no token of it", _gather_wrong(whole=True)),
        Mistake("you laid the tokens out slot by slot across the blocks: a block holds "
                "consecutive tokens of the sequence", _gather_wrong(layout="slots")),
    ),
))


# --- ch12.run_requests: debug the bookkeeping of a shared block pool ----------------------------

# The notebook gives this function, in a locked cell, as ``given_run_requests``: the block
# bookkeeping of a serving engine (no keys or values, only which block each request holds and
# how many requests hold each block), run on a list of operations. Blocks are taken from a
# stack (block 0 first; a freed block is the next one taken), as the package's pool does. Its
# bug: freeing a request returns each of its blocks to the free list and zeroes its count,
# without looking at the count, so a block that another request still shares is handed out
# again (a real bug of hand-written prefix caches).


def bookkeeping(release):
    """The function of the notebook with the free loop ``release(block, refcount, free)``, run
    on each block of a request that is done; the rest is the given function's, line by line."""
    def run_requests(num_blocks, block_size, ops):
        refcount = [0] * num_blocks
        free = list(range(num_blocks - 1, -1, -1))     # a stack: block 0 is taken first
        tables, lengths = {}, {}

        def allocate():
            block = free.pop()
            refcount[block] = 1
            return block

        def grow(rid, n):
            blocks = tables[rid]
            if n and lengths[rid] % block_size and refcount[blocks[-1]] > 1:   # copy-on-write
                copy = allocate()
                refcount[blocks[-1]] -= 1
                blocks[-1] = copy
            while len(blocks) * block_size < lengths[rid] + n:
                blocks.append(allocate())
            lengths[rid] += n

        for op in ops:
            kind, rid = op[0], op[1]
            if kind == "new":                  # ("new", rid, n): a request with n tokens
                tables[rid], lengths[rid] = [], 0
                grow(rid, op[2])
            elif kind == "fork":               # ("fork", rid, src, n): the first n tokens of src
                tables[rid] = tables[op[2]][:math.ceil(op[3] / block_size)]
                for block in tables[rid]:
                    refcount[block] += 1
                lengths[rid] = op[3]
            elif kind == "append":             # ("append", rid, n): n more tokens
                grow(rid, op[2])
            elif kind == "free":               # ("free", rid): the request is done
                for block in tables.pop(rid):
                    release(block, refcount, free)
                del lengths[rid]
        return refcount, tables
    return run_requests


def _zero_and_free(block, refcount, free):
    refcount[block] = 0                    # the given bug: whoever else holds the block
    free.append(block)


given_run_requests = bookkeeping(_zero_and_free)   # the buggy function, as the notebook gives it


def run_requests_reference(num_blocks, block_size, ops):
    """The reference counts of every block and each live request's blocks, in order, after
    ``ops`` run on the package's ``PagedKVCache`` and ``BlockTable`` (one layer, no data to
    speak of: only the bookkeeping is read)."""
    pool = PagedKVCache(1, num_blocks, block_size, 1, 1)
    tables = {}
    for op in ops:
        kind, rid = op[0], op[1]
        if kind == "new":
            tables[rid] = pool.new_table()
            tables[rid].reserve(op[2])
        elif kind == "fork":
            tables[rid] = pool.new_table()
            tables[rid].share_prefix(tables[op[2]], op[3])
        elif kind == "append":
            tables[rid].reserve(op[2])
        elif kind == "free":
            tables.pop(rid).free()
    return list(pool.refcount), {rid: list(table.blocks) for rid, table in tables.items()}


def trace(num_blocks, block_size, ops) -> set[str]:
    """What ``ops`` do to the package's pool: "fork" (a request shares another's blocks),
    "freed shared" (a free leaves some of its blocks held by another request), "cow" (a shared,
    partly filled block is copied on write), "reused" (a freed block is taken again)."""
    pool = PagedKVCache(1, num_blocks, block_size, 1, 1)
    tables, seen, freed = {}, set(), set()
    for op in ops:
        kind, rid = op[0], op[1]
        held = {b for t in tables.values() for b in t.blocks}
        if kind == "free":
            blocks = tables.pop(rid).blocks
            for block in blocks:
                pool.release(block)
            if any(pool.refcount[b] > 0 for b in blocks):
                seen.add("freed shared")
            freed |= {b for b in blocks if pool.refcount[b] == 0}
            continue
        if kind in ("new", "fork"):
            tables[rid] = pool.new_table()
        if kind == "fork":
            tables[rid].share_prefix(tables[op[2]], op[3])
            seen.add("fork")
        else:
            tables[rid].reserve(op[2])
        if ({b for t in tables.values() for b in t.blocks} - held) & freed:
            seen.add("reused")
    if pool.copies:
        seen.add("cow")
    return seen


def expect_pool_state(actual, expected, case=None) -> None:
    """A tuple (refcounts: list of ints, tables: dict of request -> list of blocks) equal to
    ``expected``; a wrong one is told which part differs, not what it should be."""
    if not isinstance(actual, (tuple, list)) or len(actual) != 2:
        raise AssertionError("your function should return a tuple (refcounts, tables)")
    refcounts, tables = actual
    want_counts, want_tables = expected
    if not isinstance(refcounts, list) or len(refcounts) != len(want_counts):
        raise AssertionError(f"refcounts should be a list of {len(want_counts)} ints, one a "
                             f"block")
    wrong = [b for b, (x, y) in enumerate(zip(refcounts, want_counts)) if x != y]
    if wrong:
        raise AssertionError(f"refcounts: the counts of {len(wrong)} block(s) differ, the "
                             f"first at block {wrong[0]}")
    if not isinstance(tables, dict) or sorted(tables) != sorted(want_tables):
        raise AssertionError(f"tables should hold the live requests "
                             f"{sorted(want_tables)}, got "
                             f"{sorted(tables) if isinstance(tables, dict) else tables!r}")
    for rid in sorted(want_tables):
        if list(tables[rid]) != want_tables[rid]:
            raise AssertionError(f"tables[{rid!r}]: request {rid!r} holds other blocks than "
                                 f"expected")


def _leak(block, refcount, free):
    refcount[block] -= 1                   # the count drops, the block is never given back


def _skip_shared(block, refcount, free):
    if refcount[block] > 1:                # a shared block is left as it is
        return
    refcount[block] = 0
    free.append(block)


def _ops_case(name, num_blocks, block_size, ops, hint=""):
    return Case(name, (num_blocks, block_size, ops), hint=hint)


def _requests_cases():
    yield _ops_case("no sharing: two requests, the first freed, a third takes its blocks; "
                    "bs=4", 8, 4,
                    [("new", "a", 6), ("new", "b", 3), ("free", "a"), ("new", "c", 5),
                     ("append", "b", 2)],
                    hint="a freed block is the next one taken")
    yield _ops_case("a shared prefix, its first holder freed: bs=2", 10, 2,
                    [("new", "a", 6), ("fork", "b", "a", 4), ("free", "a"), ("new", "c", 3),
                     ("append", "b", 1)],
                    hint="a block that another request holds is not free")
    yield _ops_case("a shared, partly filled block copied on write: bs=4", 10, 4,
                    [("new", "a", 6), ("fork", "b", "a", 6), ("append", "b", 1),
                     ("free", "b"), ("new", "c", 2)],
                    hint="after the copy, each request holds its own last block")
    yield _ops_case("both holders of a shared prefix freed, one after the other: bs=3", 10, 3,
                    [("new", "a", 7), ("fork", "b", "a", 6), ("free", "b"), ("new", "c", 2),
                     ("free", "a"), ("new", "d", 8)],
                    hint="a block is free once the last request holding it is freed")


register(Exercise(
    key="ch12.run_requests", function="run_requests", reference=run_requests_reference,
    task="debug", given=given_run_requests,
    ops=NONE,
    cases=_requests_cases, compare=expect_pool_state, banned=("course_attn",),
    mistakes=(
        Mistake("you free a shared block without looking at its reference count: another "
                "request still holds it, and the next allocation hands it out again",
                given_run_requests),
        Mistake("you drop the reference, but a block whose count reaches zero never goes back "
                "to the free list: the pool leaks it", bookkeeping(_leak)),
        Mistake("you skip a shared block without dropping this request's reference: its count "
                "stays too high, and the block is never freed", bookkeeping(_skip_shared)),
    ),
))


# --- ch12.paged_memory: derive what a paged and a contiguous cache reserve ------------------------

MEMORY_QUESTIONS = {
    "blocks": ("(a) the blocks the paged cache holds",
               "each sequence holds blocks of its own, as many as its tokens need"),
    "paged_empty": ("(b) the slots of those blocks that hold no token",
                    "only a sequence's last block may be partly filled"),
    "contiguous_empty": ("(c) the slots a contiguous cache reserves that hold no token",
                         "a contiguous cache reserves the same slots for every sequence"),
}

MEMORY_SIZES = dict(lengths=[10, 3, 16], block_size=8, max_len=24)
MORE_MEMORY_SIZES = (dict(lengths=[1, 17, 16, 5], block_size=8, max_len=32),
                     dict(lengths=[4, 1, 7], block_size=1, max_len=7))


def _memory(lengths, block_size, max_len, *, blocks_of=None, contiguous_len=None):
    blocks_of = blocks_of or (lambda n: -(-n // block_size))
    tokens = sum(lengths)
    blocks = sum(blocks_of(n) for n in lengths)
    reserved = contiguous_len if contiguous_len is not None else max_len
    return {"blocks": blocks, "paged_empty": blocks * block_size - tokens,
            "contiguous_empty": len(lengths) * reserved - tokens}


def paged_memory_reference(lengths, block_size, max_len):
    """For sequences holding ``lengths`` tokens each, blocks of ``block_size`` slots, and a
    contiguous cache of ``max_len`` slots per sequence: the blocks, the sum of ceil(L / bs);
    the empty slots of those blocks; and the empty slots of the contiguous cache."""
    return _memory(lengths, block_size, max_len)


MEMORY = count_questions(MEMORY_QUESTIONS, rel_tol=0, near_miss=True)


def _memory_with(**rule):
    """A typical wrong answer: ``_memory`` with ``rule``, made of the sizes."""
    def wrong(lengths, block_size, max_len):
        chosen = {name: make(lengths, block_size) for name, make in rule.items()}
        return _memory(lengths, block_size, max_len, **chosen)
    return wrong


def _pooled(lengths, block_size, max_len):
    """A typical wrong answer: the blocks counted as if the sequences' tokens were packed
    together."""
    blocks = -(-sum(lengths) // block_size)
    return {**paged_memory_reference(lengths, block_size, max_len), "blocks": blocks,
            "paged_empty": blocks * block_size - sum(lengths)}


register(Exercise(
    key="ch12.paged_memory", function="paged_memory", reference=paged_memory_reference,
    task="derive",
    ops=NONE,
    cases=lambda: MEMORY.cases(MEMORY_SIZES, *MORE_MEMORY_SIZES), compare=MEMORY.compare,
    banned=("course_attn",),
    mistakes=(
        Mistake("you counted only the blocks a sequence fills: a partly filled last block is "
                "taken all the same",
                _memory_with(blocks_of=lambda lengths, bs: lambda n: n // bs)),
        Mistake("you took one block more than the tokens need for a sequence whose length is a "
                "multiple of the block size",
                _memory_with(blocks_of=lambda lengths, bs: lambda n: n // bs + 1)),
        Mistake("you packed the tokens of different sequences into the same blocks: each "
                "sequence has blocks of its own", _pooled),
        Mistake("you sized the contiguous buffers by the longest sequence present: they are "
                "reserved before anyone knows how long a sequence grows",
                _memory_with(contiguous_len=lambda lengths, bs: max(lengths))),
    ),
))


# --- ch12.serving_costs: measure what an engine spends on a workload ------------------------------

# The notebook gives ``serving_engine`` in a locked cell, as here: an Engine on a tiny GPT. What
# the exercise asks for (steps, blocks, preemptions, tokens fed) depends on the lengths of the
# prompts and answers, the pool and the settings, never on the weights; the prompts of a case
# that shares prefixes part within the prompts, so what is shared does not depend on the
# generated tokens either.


def serving_engine(block_size, num_blocks, max_batch=None, share_prefixes=True):
    """An ``Engine`` on a tiny GPT (one layer, 32 tokens, 64 positions), weights seeded."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=64, d_model=16, n_heads=2, n_layers=1)).eval()
    return Engine(model, block_size=block_size, num_blocks=num_blocks, max_batch=max_batch,
                  share_prefixes=share_prefixes)


def _key(settings, prompts, max_new_tokens):
    return (tuple(sorted(settings.items())), tuple(map(tuple, prompts)),
            tuple(max_new_tokens) if isinstance(max_new_tokens, list) else max_new_tokens)


@functools.lru_cache(maxsize=512)
def _served(key):
    """The records of serving a workload (``_key``'s), read from ``engine.steps``."""
    settings, prompts, limits = key
    engine = serving_engine(**dict(settings))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # a tiny model: one thread is many times faster than two
    try:
        engine.generate([list(p) for p in prompts], list(limits) if isinstance(limits, tuple)
                        else limits)
    finally:
        torch.set_num_threads(threads)
    return tuple((step.blocks_used, step.fed_tokens, step.shared_tokens, len(step.running),
                  tuple(step.preempted)) for step in engine.steps)


def served(settings, prompts, max_new_tokens) -> dict:
    """What serving ``prompts`` on ``serving_engine(**settings)`` did, with more than the
    exercise asks (the regimes and the mistakes read the rest)."""
    steps = _served(_key(settings, prompts, max_new_tokens))
    # Summed with torch, here, on every call, cached or not: the engine's own functions are
    # allowed to the student, so a submission that calls this would run no operation of the
    # package's outside them; these operations are the guard's sign of it.
    blocks, fed, shared, running = torch.tensor([step[:4] for step in steps]).unbind(1)
    preempted = [i for step in steps for i in step[4]]
    return {"steps": len(steps), "peak_blocks": int(blocks.max()),
            "preemptions": len(preempted), "fed_tokens": int(fed.sum()),
            "requests_preempted": len(set(preempted)), "shared_tokens": int(shared.sum()),
            "request_steps": int(running.sum()),
            "steps_preempting": sum(1 for step in steps if step[4])}


COSTS_QUESTIONS = {
    "steps": ("(a) the engine's steps", "count the forwards the engine ran"),
    "peak_blocks": ("(b) the most blocks in use at once",
                    "what the pool holds changes from step to step"),
    "preemptions": ("(c) the preemptions", "a preempted request waits and may be preempted "
                                            "again"),
    "fed_tokens": ("(d) the tokens fed to the model",
                   "a step feeds a prefill's whole prompt, and one token of each request "
                   "decoding"),
}
COSTS_KEYS = ("steps", "peak_blocks", "preemptions", "fed_tokens")
COSTS = count_questions(COSTS_QUESTIONS, rel_tol=0)


def serving_costs_reference(settings, prompts, max_new_tokens):
    """The steps ``serving_engine(**settings)`` runs to serve ``prompts`` (``max_new_tokens``
    each, or one limit per request), the most blocks in use after any step, the preemptions
    (a request preempted twice counts twice) and the tokens fed (prefills, recomputations and
    decodes), read from the engine's records of each step."""
    record = served(settings, prompts, max_new_tokens)
    return {key: record[key] for key in COSTS_KEYS}


def costs_cases(label, settings, prompts, max_new_tokens, hint=""):
    """One case per question for one workload, named by ``label`` (the questions' hints, or
    ``hint`` after them)."""
    kwargs = dict(settings=dict(settings), prompts=[list(p) for p in prompts],
                  max_new_tokens=max_new_tokens)
    for key, (name, question_hint) in COSTS_QUESTIONS.items():
        yield Case(f"{name} ({label})", kwargs=kwargs, part=key,
                   hint=question_hint + (f"; {hint}" if hint else ""))


def _prompts(seed, lengths, prefix=0):
    """Prompts of these lengths of tokens drawn with ``seed``; the first ``prefix`` tokens
    common to all, the next one different in each."""
    g = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    common = torch.randint(32, (prefix,), generator=g).tolist()
    starts = torch.randperm(32, generator=g).tolist()
    return [common + [starts[i]] + torch.randint(32, (n - prefix - 1,), generator=g).tolist()
            for i, n in enumerate(lengths)]


PUBLIC_WORKLOADS = (
    ("at most 2 running, nothing preempted: bs=4, 32 blocks, 5 requests",
     dict(block_size=4, num_blocks=32, max_batch=2, share_prefixes=False),
     _prompts(1220, [5, 9, 3, 12, 7]), [6, 3, 10, 4, 8]),
    ("a pool of 8 blocks for 5 requests, one preempted twice, two in one step: bs=2",
     dict(block_size=2, num_blocks=8, share_prefixes=False),
     _prompts(1221, [4, 5, 2, 2, 2]), [11, 4, 12, 9, 6]),
    ("a common prefix of 9 tokens, sharing on: bs=4, 40 blocks, at most 3 running",
     dict(block_size=4, num_blocks=40, max_batch=3, share_prefixes=True),
     _prompts(1222, [12, 14, 11, 13], prefix=9), 5),
)


def _costs_cases():
    for workload in PUBLIC_WORKLOADS:
        yield from costs_cases(*workload)


def _costs_with(**rule):
    """A typical wrong measurement: the reference's answers with ``rule[key](record, settings,
    prompts, limits)`` for each key it names (limits: one per request)."""
    def wrong(settings, prompts, max_new_tokens):
        record = served(settings, prompts, max_new_tokens)
        limits = (list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple))
                  else [max_new_tokens] * len(prompts))
        return {**{key: record[key] for key in COSTS_KEYS},
                **{key: make(record, settings, prompts, limits) for key, make in rule.items()}}
    return wrong


def _needs(settings, prompts, limits):
    bs = settings["block_size"]
    return sum(-(-(len(p) + n - 1) // bs) for p, n in zip(prompts, limits))


register(Exercise(
    key="ch12.serving_costs", function="serving_costs", reference=serving_costs_reference,
    task="measure",
    cases=_costs_cases, compare=COSTS.compare,
    banned=("course_attn",),
    # the given cell's engine runs the package: its model, its engine, its generate
    allowed=("course_attn.model.GPTConfig.__post_init__", "course_attn.model.GPT.__init__",
             "course_attn.serve.Engine.__init__", "course_attn.serve.Engine.generate"),
    mistakes=(
        Mistake("you counted the steps of the request that asks for the most tokens: requests "
                "that wait for a place or for blocks start later",
                _costs_with(steps=lambda r, s, p, limits: max(limits))),
        Mistake("you read the blocks in use after the last step: by then every request has "
                "finished and given its blocks back", _costs_with(peak_blocks=lambda *a: 0)),
        Mistake("you reported the pool's size: the blocks in use are what the requests hold",
                _costs_with(peak_blocks=lambda r, s, p, limits: s["num_blocks"])),
        Mistake("you added up the blocks every request needs at its longest: the requests do not "
                "all hold their blocks at once",
                _costs_with(peak_blocks=lambda r, s, p, limits: _needs(s, p, limits))),
        Mistake("you counted the requests that were preempted, each once: a request can be "
                "preempted more than once",
                _costs_with(preemptions=lambda r, *a: r["requests_preempted"])),
        Mistake("you counted the steps in which a request was preempted: one step can preempt "
                "two requests", _costs_with(preemptions=lambda r, *a: r["steps_preempting"])),
        Mistake("you counted one token for each request running in a step: a request admitted "
                "in a step feeds its whole prompt",
                _costs_with(fed_tokens=lambda r, *a: r["request_steps"])),
        Mistake("you counted every prompt once and every new token but the last once, as if "
                "nothing were preempted or shared: count what the engine's steps fed",
                _costs_with(fed_tokens=lambda r, s, p, limits:
                            sum(len(q) + n - 1 for q, n in zip(p, limits)))),
    ),
))
