"""Chapter 12's exercises: each typical mistake fails the case meant for it with its own hint, on
the public cases and on the hidden cases of every seed, a wrong answer that no mistake explains
gets no hint, and a banned call is reported by name. What every exercise must satisfy is tested
once, for all chapters, in test_exercises_conformance.py.

The wrong solutions below are written as a student would write them; each test names the case
it must fail and a fragment of the hint it must get.
"""

import math

import nbformat
import pytest
import torch

from course_attn.grading import get, run_exercise
from course_attn.grading.exercise import hidden_cases, load_hidden
from course_attn.paged import PagedKVCache

from check_support import (assert_banned, assert_fails, assert_fails_on_every_seed,
                           assert_fails_unnamed)
from helpers import ROOT

GATHER, REQUESTS, MEMORY = "ch12.gather_kv", "ch12.run_requests", "ch12.paged_memory"
COSTS = "ch12.serving_costs"
load_hidden(ROOT / "solutions")


# --- solutions as in solutions/12_serving.ipynb ---------------------------------------------------

def gather_kv(pool_k, pool_v, block_table, length, *, order="table", whole=False,
              layout="blocks"):
    """The solution; the keywords make it one typical mistake or another, as a student writes
    it: token by token through the table, or block by block."""
    if order == "table" and not whole and layout == "blocks":
        bs = pool_k.shape[2]
        positions = torch.arange(length)
        blocks, offsets = block_table[positions // bs], positions % bs
        return (pool_k[blocks, :, offsets].transpose(0, 1),
                pool_v[blocks, :, offsets].transpose(0, 1))
    table = {"table": block_table, "pool": torch.sort(block_table).values,
             "first": torch.arange(len(block_table))}[order]
    out = []
    for pool in (pool_k, pool_v):
        per_block = [pool[b] for b in table.tolist()]                   # each (Hkv, bs, D)
        if layout == "slots":
            tokens = [blk[:, s] for s in range(pool.shape[2]) for blk in per_block]
        else:
            tokens = [blk[:, s] for blk in per_block for s in range(pool.shape[2])]
        flat = torch.stack(tokens, dim=1)                               # (Hkv, M · bs, D)
        out.append(flat if whole else flat[:, :length])
    return tuple(out)


def notebook_function(folder, grade_id, name):
    """``name`` as a cell of ``folder``/12_serving.ipynb defines it (the setup cell imports
    math)."""
    nb = nbformat.read(ROOT / folder / "12_serving.ipynb", as_version=4)
    (cell,) = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id]
    namespace = {"math": math}
    exec(cell.source, namespace)
    return namespace[name]


run_requests = notebook_function("solutions", "ch12-run_requests-solution", "run_requests")


# The repairs a student may write instead, each the free loop's body for one block: the given
# bug (the count zeroed, the block freed), a count that drops but a block never given back,
# shared blocks skipped.
def _zeroed(block, refcount, free):
    refcount[block] = 0
    free.append(block)


def _leaked(block, refcount, free):
    refcount[block] -= 1


def _skipped(block, refcount, free):
    if refcount[block] == 1:
        refcount[block] = 0
        free.append(block)


WRONG_REPAIRS = {"zero": _zeroed, "leak": _leaked, "skip": _skipped}


def wrong_repair(on_free):
    from course_attn.grading.ch12 import bookkeeping
    run = bookkeeping(WRONG_REPAIRS[on_free])
    run.__name__ = f"run_requests_{on_free}"
    return run


def paged_memory(lengths, block_size, max_len, *, blocks_of="ceil", contiguous="max_len"):
    """The solution; the keywords make it one typical mistake or another."""
    if blocks_of == "pooled":                    # the tokens of every sequence together
        blocks = -(-sum(lengths) // block_size)
    else:
        per = {"ceil": lambda n: -(-n // block_size), "floor": lambda n: n // block_size,
               "plus_one": lambda n: n // block_size + 1}[blocks_of]
        blocks = sum(per(n) for n in lengths)
    reserved = max_len if contiguous == "max_len" else max(lengths)
    return {"blocks": blocks, "paged_empty": blocks * block_size - sum(lengths),
            "contiguous_empty": len(lengths) * reserved - sum(lengths)}


def notebook_serving_costs():
    """The notebook's serving_costs, with the given cell's serving_engine beside it."""
    nb = nbformat.read(ROOT / "solutions" / "12_serving.ipynb", as_version=4)
    namespace = {"math": math, "torch": torch}
    for grade_id in ("ch12-serving_costs-given", "ch12-serving_costs-solution"):
        (cell,) = [c for c in nb.cells
                   if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id]
        exec(cell.source, namespace)
    return namespace["serving_costs"], namespace["serving_engine"]


serving_costs, serving_engine = notebook_serving_costs()


@pytest.mark.parametrize("key, fn", [(GATHER, gather_kv), (REQUESTS, run_requests),
                                     (MEMORY, paged_memory), (COSTS, serving_costs)])
def test_the_notebooks_solutions_pass_with_the_watch_on(key, fn):
    for cases in [None] + [hidden_cases(key, seed) for seed in range(5)]:
        judgement = run_exercise(get(key), fn, cases)
        assert judgement.passed, (judgement.banned, [(r.name, r.message) for r in
                                                     judgement.results if not r.passed])


# --- gather_kv -----------------------------------------------------------------------------------

OUT_OF_ORDER = "three blocks out of order, the last partly filled: bs=4, length=10, Hkv=2, D=Dv=8"
IN_ORDER = "blocks in the pool's order, but not its first ones: bs=2, length=5"


def test_the_gather_reference_reads_back_what_the_package_pool_wrote():
    """Tokens written through a BlockTable, with other sequences' blocks in between and a freed
    block reused, are read back by the reference, in order, up to the length."""
    pool = PagedKVCache(1, 12, 3, 2, 4, value_dim=5, dtype=torch.float64)
    other, table = pool.new_table(), pool.new_table()
    k, v = torch.randn(2, 11, 4, dtype=torch.float64), torch.randn(2, 11, 5, dtype=torch.float64)
    pool.write(0, other.reserve(4), torch.zeros(2, 4, 4, dtype=torch.float64),
               torch.zeros(2, 4, 5, dtype=torch.float64))
    pool.write(0, table.reserve(5), k[:, :5], v[:, :5])
    other.free()
    pool.write(0, table.reserve(6), k[:, 5:], v[:, 5:])
    blocks = torch.tensor(table.blocks)
    assert not torch.equal(blocks, blocks.sort().values)        # the freed blocks came back
    got_k, got_v = get(GATHER).reference(pool.k[0], pool.v[0], blocks, 11)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert torch.equal(gather_kv(pool.k[0], pool.v[0], blocks, 11)[0], k)


def test_gather_kv_mistakes():
    assert_fails(GATHER, lambda *a: gather_kv(*a, order="pool"), OUT_OF_ORDER,
                 hint="in the order they sit in the pool")
    assert_fails(GATHER, lambda *a: gather_kv(*a, order="first"), IN_ORDER,
                 hint="the pool's first blocks")
    assert_fails(GATHER, lambda *a: gather_kv(*a, whole=True), OUT_OF_ORDER,
                 hint="every slot of the blocks")
    assert_fails(GATHER, lambda *a: gather_kv(*a, layout="slots"), OUT_OF_ORDER,
                 hint="slot by slot across the blocks")


def test_a_gather_wrong_in_no_declared_way_gets_no_hint():
    def reversed_heads(*args):
        k, v = gather_kv(*args)
        return k.flip(0), v.flip(0)
    assert_fails_unnamed(GATHER, reversed_heads, OUT_OF_ORDER, message="k:")


@pytest.mark.parametrize("wrong", ["pool", "first", "whole", "slots"])
def test_each_gather_mistake_fails_the_hidden_cases_of_every_seed(wrong):
    options = {"pool": dict(order="pool"), "first": dict(order="first"),
               "whole": dict(whole=True), "slots": dict(layout="slots")}[wrong]

    def mistaken(*args):
        return gather_kv(*args, **options)
    mistaken.__name__ = f"gather_kv_{wrong}"
    assert_fails_on_every_seed(GATHER, mistaken)


def test_a_gather_without_the_permute_earns_nothing():
    """The blocks reshaped to (Hkv, M · bs, D) without first putting the heads before the
    blocks: right only where that layout is trivial (one head, or one block), which is none of
    the point of the exercise (issue 42: it earned 0.86/3)."""
    from course_attn.grading.check import grade_here

    def no_permute(pool_k, pool_v, block_table, length):
        out = []
        for pool in (pool_k, pool_v):
            blocks = pool[block_table]                              # (M, Hkv, bs, D)
            m, h, bs, d = blocks.shape
            out.append(blocks.reshape(h, m * bs, d)[:, :length])
        return tuple(out)
    for seed in range(10):
        judgement = grade_here(get(GATHER), no_permute, seed, watch_banned=False)
        assert any(r.passed for r in judgement.results if r.hidden), seed  # right somewhere
        assert judgement.credit() == 0, (seed, judgement.reason())


def test_gather_kv_may_not_call_the_package():
    from course_attn.paged import gather_blocks

    def borrowed(pool_k, pool_v, block_table, length):
        return (gather_blocks(pool_k, block_table[None])[0, :, :length],
                gather_blocks(pool_v, block_table[None])[0, :, :length])
    assert_banned(GATHER, borrowed, "course_attn")


# --- run_requests --------------------------------------------------------------------------------

SHARED = "a shared prefix, its first holder freed: bs=2"
NO_SHARING = "no sharing: two requests, the first freed, a third takes its blocks; bs=4"


def test_the_given_function_fails_with_the_bugs_hint_and_is_the_declared_one():
    from course_attn.grading.ch12 import given_run_requests
    given = notebook_function("exercises", "ch12-run_requests-given", "given_run_requests")
    for case in get(REQUESTS).public_cases() + hidden_cases(REQUESTS, 0):
        assert given(*case.args) == given_run_requests(*case.args), case.name
    assert_fails(REQUESTS, given, SHARED, hint="without looking at its reference count")
    # the symptom the cell prints: a block in two live tables
    counts, tables = given(8, 2, [("new", "a", 5), ("fork", "b", "a", 4), ("free", "a"),
                                  ("new", "c", 3)])
    assert set(tables["b"]) & set(tables["c"])


def test_run_requests_half_repairs_are_named():
    assert_fails(REQUESTS, wrong_repair("leak"), NO_SHARING,
                 hint="never goes back to the free list")
    assert_fails(REQUESTS, wrong_repair("skip"), SHARED,
                 hint="skip a shared block")


def test_a_repair_wrong_in_no_declared_way_gets_no_hint():
    def lifo_reversed(num_blocks, block_size, ops):
        counts, tables = run_requests(num_blocks, block_size, ops)
        return counts, {rid: blocks[::-1] for rid, blocks in tables.items()}
    assert_fails_unnamed(REQUESTS, lifo_reversed, SHARED, message="holds other blocks")


# Other mistakes, outside the free loop (issue 42: each was told the leak's hint, "a block
# whose count reaches zero never goes back to the free list", which it does not make): the
# solution's source with one line changed.
OTHER_BUGS = {
    "a fork with its own copied blocks": (
        """            tables[rid] = tables[op[2]][:math.ceil(op[3] / block_size)]
            for block in tables[rid]:
                refcount[block] += 1""",
        """            tables[rid] = [allocate() for _ in range(math.ceil(op[3] / block_size))]"""),
    "a first-in-first-out free list": ("        block = free.pop()\n",
                                        "        block = free.pop(0)\n"),
    "a floor in the fork": ("tables[op[2]][:math.ceil(op[3] / block_size)]",
                            "tables[op[2]][:op[3] // block_size]"),
}


def other_bug(name):
    nb = nbformat.read(ROOT / "solutions" / "12_serving.ipynb", as_version=4)
    (cell,) = [c for c in nb.cells
               if c.metadata.get("nbgrader", {}).get("grade_id") == "ch12-run_requests-solution"]
    old, new = OTHER_BUGS[name]
    assert old in cell.source, name
    namespace = {"math": math}
    exec(cell.source.replace(old, new), namespace)
    return namespace["run_requests"]


@pytest.mark.parametrize("name", sorted(OTHER_BUGS))
def test_a_bug_outside_the_free_loop_is_not_told_the_free_loops_hint(name):
    """A hint names a mistake only where the answer is that mistake's on every failed case;
    these three bugs are none of the declared ones, so their cases say what differs."""
    for cases in (None, hidden_cases(REQUESTS, 0) + hidden_cases(REQUESTS, 1)):
        judgement = run_exercise(get(REQUESTS), other_bug(name), cases, watch_banned=False)
        judgement.settle_hints()    # as check() prints it and the grader's reason gives it
        failed = [r for r in judgement.results if not r.passed]
        assert failed, name
        assert all(not r.named and r.message for r in failed), \
            [(r.name, r.hint) for r in failed if r.named]


@pytest.mark.parametrize("on_free", sorted(WRONG_REPAIRS))
def test_each_wrong_repair_fails_the_hidden_cases_of_every_seed(on_free):
    assert_fails_on_every_seed(REQUESTS, wrong_repair(on_free))


def test_the_reference_counts_are_the_tables_holding_each_block_on_every_seed():
    """An independent property of the package's bookkeeping: each block's count is the number
    of live tables that hold it, and no table holds a free block."""
    for seed in range(100):
        for case in hidden_cases(REQUESTS, seed):
            counts, tables = get(REQUESTS).reference(*case.args)
            held = [sum(blocks.count(b) for blocks in tables.values())
                    for b in range(len(counts))]
            assert counts == held, (seed, case.name)


def test_run_requests_may_not_call_the_package():
    def borrowed(num_blocks, block_size, ops):
        from course_attn.grading.ch12 import run_requests_reference
        return run_requests_reference(num_blocks, block_size, ops)
    assert_banned(REQUESTS, borrowed, "course_attn")


# --- paged_memory --------------------------------------------------------------------------------

FIRST = "(lengths=[10, 3, 16], block_size=8, max_len=24)"


def test_the_memory_counts_are_the_package_pools_on_public_and_hidden_sizes():
    """Each sequence reserved on the package's pool: the blocks in use and their empty slots
    are the reference's; the contiguous cache's empty slots are counted slot by slot."""
    sizes = [c.kwargs for c in get(MEMORY).public_cases()]
    sizes += [c.kwargs for seed in range(20) for c in hidden_cases(MEMORY, seed)]
    for size in sizes:
        lengths, bs, max_len = size["lengths"], size["block_size"], size["max_len"]
        pool = PagedKVCache(1, sum(lengths), bs, 1, 1)
        for n in lengths:
            pool.new_table().reserve(n)
        reserved = torch.zeros(len(lengths), max_len, dtype=torch.bool)
        for i, n in enumerate(lengths):
            reserved[i, :n] = True
        expected = get(MEMORY).reference(**size)
        assert expected == {"blocks": pool.num_used,
                            "paged_empty": pool.num_used * bs - sum(lengths),
                            "contiguous_empty": int((~reserved).sum())}, size


def test_paged_memory_mistakes():
    assert_fails(MEMORY, lambda *a, **k: paged_memory(*a, **k, blocks_of="floor"),
                 "(a) the blocks the paged cache holds " + FIRST, hint="only the blocks")
    assert_fails(MEMORY, lambda *a, **k: paged_memory(*a, **k, blocks_of="plus_one"),
                 "(a) the blocks the paged cache holds " + FIRST, hint="one block more")
    assert_fails(MEMORY, lambda *a, **k: paged_memory(*a, **k, blocks_of="pooled"),
                 "(b) the slots of those blocks that hold no token " + FIRST,
                 hint="packed the tokens")
    assert_fails(MEMORY, lambda *a, **k: paged_memory(*a, **k, contiguous="longest"),
                 "(c) the slots a contiguous cache reserves that hold no token " + FIRST,
                 hint="longest sequence present")


@pytest.mark.parametrize("wrong", [dict(blocks_of="floor"), dict(blocks_of="plus_one"),
                                   dict(blocks_of="pooled"), dict(contiguous="longest")])
def test_each_memory_mistake_fails_the_hidden_cases_of_every_seed(wrong):
    def mistaken(*args, **kwargs):
        return paged_memory(*args, **kwargs, **wrong)
    mistaken.__name__ = f"paged_memory_{wrong}"
    assert_fails_on_every_seed(MEMORY, mistaken)


def test_a_memory_answer_is_told_too_large_never_the_number():
    def one_more(*args, **kwargs):
        answer = paged_memory(*args, **kwargs)
        return {**answer, "contiguous_empty": answer["contiguous_empty"] + 1}
    assert_fails_unnamed(MEMORY, one_more,
                         "(c) the slots a contiguous cache reserves that hold no token " + FIRST,
                         message="too large")


# --- serving_costs -------------------------------------------------------------------------------

WAITING = "at most 2 running, nothing preempted: bs=4, 32 blocks, 5 requests"
TIGHT = "a pool of 8 blocks for 5 requests, one preempted twice, two in one step: bs=2"
COMMON = "a common prefix of 9 tokens, sharing on: bs=4, 40 blocks, at most 3 running"


def wrong_costs(mistake):
    """serving_costs with one typical mistake, as a student writes it: it runs the given
    engine and reads its records, but one count the wrong way."""
    def costs(settings, prompts, max_new_tokens):
        engine = serving_engine(**settings)
        engine.generate(prompts, max_new_tokens)
        steps = engine.steps
        limits = (max_new_tokens if isinstance(max_new_tokens, list)
                  else [max_new_tokens] * len(prompts))
        preempted = [r for step in steps for r in step.preempted]
        answer = {"steps": len(steps), "peak_blocks": max(s.blocks_used for s in steps),
                  "preemptions": len(preempted), "fed_tokens": sum(s.fed_tokens for s in steps)}
        bs = settings["block_size"]
        answer.update({
            "longest": {"steps": max(limits)},
            "after": {"peak_blocks": steps[-1].blocks_used},
            "pool": {"peak_blocks": engine.pool.num_blocks},
            "needs": {"peak_blocks": sum(math.ceil((len(p) + n - 1) / bs)
                                         for p, n in zip(prompts, limits))},
            "distinct": {"preemptions": len(set(preempted))},
            "steps": {"preemptions": sum(1 for s in steps if s.preempted)},
            "per_request": {"fed_tokens": sum(len(s.running) for s in steps)},
            "once": {"fed_tokens": sum(len(p) + n - 1 for p, n in zip(prompts, limits))},
        }[mistake])
        return answer
    costs.__name__ = f"serving_costs_{mistake}"
    return costs


COSTS_MISTAKES = {"longest": ("(a) the engine's steps", WAITING, "the request that asks"),
                  "after": ("(b) the most blocks in use at once", WAITING, "after the last"),
                  "pool": ("(b) the most blocks in use at once", WAITING, "the pool's size"),
                  "needs": ("(b) the most blocks in use at once", WAITING, "added up"),
                  "distinct": ("(c) the preemptions", TIGHT, "each once"),
                  "steps": ("(c) the preemptions", TIGHT, "two requests"),
                  "per_request": ("(d) the tokens fed to the model", WAITING, "one token"),
                  "once": ("(d) the tokens fed to the model", TIGHT, "as if nothing")}


def test_the_costs_are_the_engines_own_counts_on_public_and_hidden_workloads():
    """Independent of the records: the steps are the forwards the engine ran, the tokens fed
    those its forwards took; the peak is a count of the pool's blocks; and every request's
    tokens are those of generate alone, so the workload ran as the chapter says."""
    from course_attn.grading.ch12 import serving_costs_reference
    from course_attn.model import generate
    workloads = {repr(c.kwargs): c.kwargs for c in get(COSTS).public_cases()}
    workloads |= {repr(c.kwargs): c.kwargs for seed in range(3)
                  for c in hidden_cases(COSTS, seed)}
    for kwargs in workloads.values():
        engine = serving_engine(**kwargs["settings"])
        forwards, embedded = 0, 0
        forward = engine._forward

        def watched(running):
            nonlocal forwards, embedded
            forwards += 1
            embedded += sum(r.new for r in running)
            return forward(running)
        engine._forward = watched
        served_tokens = engine.generate(kwargs["prompts"], kwargs["max_new_tokens"])
        expected = serving_costs_reference(**kwargs)
        assert expected["steps"] == forwards and expected["fed_tokens"] == embedded, kwargs
        assert 0 < expected["peak_blocks"] <= kwargs["settings"]["num_blocks"], kwargs
        limits = kwargs["max_new_tokens"]
        limits = limits if isinstance(limits, list) else [limits] * len(kwargs["prompts"])
        model = engine.model
        for prompt, n, tokens in zip(kwargs["prompts"], limits, served_tokens):
            alone = generate(model, torch.tensor([prompt]), n, temperature=0)[0, len(prompt):]
            assert tokens == alone.tolist()


@pytest.mark.parametrize("mistake", sorted(COSTS_MISTAKES))
def test_serving_costs_mistakes(mistake):
    question, workload, hint = COSTS_MISTAKES[mistake]
    assert_fails(COSTS, wrong_costs(mistake), f"{question} ({workload})", hint=hint)


def test_a_count_wrong_in_no_declared_way_gets_no_hint():
    def one_step_more(*args, **kwargs):
        answer = serving_costs(*args, **kwargs)
        return {**answer, "steps": answer["steps"] + 1}
    assert_fails_unnamed(COSTS, one_step_more, f"(a) the engine's steps ({WAITING})",
                         message="too large")


@pytest.mark.parametrize("index", range(len(COSTS_MISTAKES)))
def test_each_costs_mistake_fails_the_hidden_cases_of_every_seed(index):
    # the declared mistakes (the student's versions above give their answers on the public
    # workloads), which read the records the reference keeps: a hundred seeds in seconds
    assert_fails_on_every_seed(COSTS, get(COSTS).mistakes[index].fn)


def test_serving_costs_may_not_call_the_reference():
    from course_attn.grading.ch12 import serving_costs_reference

    def borrowed(settings, prompts, max_new_tokens):
        return serving_costs_reference(settings, prompts, max_new_tokens)
    assert_banned(COSTS, borrowed, "course_attn")
