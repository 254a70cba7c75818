"""Hidden cases of chapter 12: drawn by the grader with a fresh seed for every notebook it grades.
Private to instructors: never published with the course (see book/instructors.md)."""

import torch

from course_attn.grading.cases import randint
from course_attn.grading.ch12 import (MEMORY, PUBLIC_WORKLOADS, _prompts, costs_cases, gather_case,
                                      served, trace)
from course_attn.grading.exercise import Case, hidden


# ch12.gather_kv: every seed draws several blocks out of the pool's order with a partly filled
# last block (reading the pool's order, the pool's first blocks, whole blocks and a slot-by-slot
# layout are each wrong there), a length that fills its last block exactly, a single block,
# block size 1, and Dv != D in float64. The first case is the central regime: several heads,
# several blocks out of the pool's order, the last partly filled; an answer right only where
# the layout is trivial (one head, one block: a gather without the permute) earns nothing.
def _gather(rule):
    """A regime of gather_kv: ``rule`` of (pool_k, pool_v, table, length, bs)."""
    return lambda case: bool(rule(*case.args, case.args[0].shape[2]))


@hidden("ch12.gather_kv", regimes={
    "the length fills its last block exactly (length % bs = 0, bs > 1)":
        _gather(lambda pk, pv, table, n, bs: n % bs == 0 and bs > 1),
    "the last block partly filled (length % bs != 0)":
        _gather(lambda pk, pv, table, n, bs: n % bs != 0),
    "a single block (length <= bs)": _gather(lambda pk, pv, table, n, bs: n <= bs),
    "blocks out of the pool's order in the table":
        _gather(lambda pk, pv, table, n, bs: not torch.equal(table, table.sort().values)),
    "block size 1": _gather(lambda pk, pv, table, n, bs: bs == 1),
    "several key/value heads (Hkv > 1)": _gather(lambda pk, pv, table, n, bs: pk.shape[1] > 1),
    "values of another width than the keys (Dv != D)":
        _gather(lambda pk, pv, table, n, bs: pv.shape[-1] != pk.shape[-1]),
    "several heads, several blocks out of order, the last partly filled (Dv = D)":
        _gather(lambda pk, pv, table, n, bs: pk.shape[1] > 1 and n > bs and n % bs != 0
                and not torch.equal(table, table.sort().values)
                and pv.shape[-1] == pk.shape[-1]),
}, central=("several heads, several blocks out of order, the last partly filled (Dv = D)",))
def _(gen):
    d = randint(2, 8, gen)
    bs, m = randint(2, 6, gen), randint(2, 5, gen)
    n = (m - 1) * bs + randint(1, bs - 1, gen)
    yield gather_case(f"bs={bs}, length={n}", m + randint(1, 6, gen), randint(2, 4, gen), bs, d,
                      d, n, gen)
    bs, m = randint(2, 6, gen), randint(2, 5, gen)
    yield gather_case(f"bs={bs}, length={m * bs}", m + randint(1, 6, gen), randint(1, 3, gen),
                      bs, d, d, m * bs, gen)
    bs = randint(2, 8, gen)
    n = randint(1, bs, gen)
    yield gather_case(f"a single block: bs={bs}, length={n}", randint(2, 8, gen),
                      randint(1, 3, gen), bs, d, d, n, gen)
    n = randint(2, 9, gen)
    yield gather_case(f"bs=1, length={n}", n + randint(1, 6, gen), randint(1, 3, gen), 1, d, d,
                      n, gen)
    bs, m = randint(2, 5, gen), randint(2, 4, gen)
    n = (m - 1) * bs + randint(1, bs, gen)
    dv = randint(1, d - 1, gen) if d > 2 else d + randint(1, 4, gen)
    yield gather_case(f"float64, Dv={dv}: bs={bs}, length={n}", m + randint(1, 4, gen),
                      randint(2, 3, gen), bs, d, dv, n, gen, dtype=torch.float64)
    # the edge, on every seed: one token
    yield gather_case("one token", randint(2, 6, gen), 2, randint(2, 8, gen), d, d, 1, gen)


# ch12.run_requests: one sequence of operations in each scenario, on every seed, with lengths
# drawn at random inside it: no sharing, a freed request's blocks taken again (never returning
# a block to the free list is wrong there); a shared prefix whose first holder is freed while
# the other holds it (the given bug and skipping shared blocks are wrong there); a shared,
# partly filled last block copied on write; both holders of a prefix freed in turn, then the
# blocks taken again.
def _traced(flag, present=True):
    """A regime of run_requests: whether the package's pool shows ``flag`` on the case's ops."""
    return lambda case: (flag in trace(*case.args)) == present


# The sequence with no sharing is drawn on every seed but is no regime of its own: the given
# function is right there, and a regime it passes would earn points for the bug unrepaired.
@hidden("ch12.run_requests", regimes={
    "a request freed while another still holds some of its blocks": _traced("freed shared"),
    "a shared, partly filled block copied on write": _traced("cow"),
    "a freed block taken again": _traced("reused"),
})
def _(gen):
    def room(ops):
        return sum(op[2] for op in ops if op[0] in ("new", "append")) + 4

    bs = randint(1, 4, gen)
    ops = [("new", "a", randint(bs + 1, 4 * bs, gen)), ("new", "b", randint(1, 3 * bs, gen)),
           ("free", "a"), ("new", "c", randint(1, 4 * bs, gen)),
           ("append", "b", randint(1, 5, gen))]
    yield Case(f"no sharing, bs={bs}", (room(ops), bs, ops))
    bs = randint(1, 4, gen)
    n = randint(2 * bs, 5 * bs, gen)
    prefix = randint(bs, n, gen)
    ops = [("new", "a", n), ("fork", "b", "a", prefix), ("free", "a"),
           ("new", "c", randint(1, 4 * bs, gen)), ("append", "b", randint(1, 5, gen))]
    yield Case(f"a shared prefix of {prefix} tokens, its first holder freed, bs={bs}",
               (room(ops), bs, ops))
    bs = randint(2, 5, gen)
    n = bs * randint(1, 3, gen) + randint(1, bs - 1, gen)
    ops = [("new", "a", n), ("fork", "b", "a", n), ("append", "b", randint(1, 4, gen)),
           ("free", "b"), ("new", "c", randint(1, 3 * bs, gen)), ("append", "a", 1)]
    yield Case(f"a shared, partly filled block copied on write, bs={bs}", (room(ops), bs, ops))
    bs = randint(1, 4, gen)
    n = randint(bs + 1, 5 * bs, gen)
    ops = [("new", "a", n), ("fork", "b", "a", randint(1, n, gen)), ("free", "b"),
           ("new", "c", randint(1, 2 * bs, gen)), ("free", "a"),
           ("new", "d", randint(bs, 6 * bs, gen))]
    yield Case(f"both holders of a prefix freed in turn, bs={bs}", (room(ops), bs, ops))


# ch12.paged_memory: one set of sizes in each regime, on every seed, the rest drawn at random
# inside it: every length a multiple of the block size (a block too many is wrong there); two
# or more lengths one past a multiple (only the full blocks, and packing the sequences
# together, are wrong there); a sequence of a single token; block size 1; a sequence as long
# as max_len. max_len is longer than every length except in the last regime, so that sizing
# the contiguous buffers by the longest sequence present is wrong.
def _sized(rule):
    """A regime of paged_memory: ``rule`` of (lengths, block_size, max_len)."""
    return lambda case: bool(rule(**case.kwargs))


@hidden("ch12.paged_memory", regimes={
    "every length a multiple of the block size (bs > 1)":
        _sized(lambda lengths, block_size, max_len: block_size > 1 and
               all(n % block_size == 0 for n in lengths)),
    "two or more lengths one past a multiple of the block size (bs > 1)":
        _sized(lambda lengths, block_size, max_len: block_size > 1 and
               sum(n % block_size == 1 for n in lengths) >= 2),
    "a sequence of a single token": _sized(lambda lengths, block_size, max_len: 1 in lengths),
    "block size 1": _sized(lambda lengths, block_size, max_len: block_size == 1),
    "a sequence as long as max_len":
        _sized(lambda lengths, block_size, max_len: max(lengths) == max_len),
})
def _(gen):
    def sizes(lengths, bs, longest=False):
        top = max(lengths)
        return dict(lengths=lengths, block_size=bs,
                    max_len=top if longest else top + randint(1, 64, gen))

    count = randint(2, 6, gen)
    bs = 2 ** randint(1, 5, gen)
    every = [sizes([bs * randint(1, 8, gen) for _ in range(count)], bs)]
    bs = 2 ** randint(1, 5, gen)
    every.append(sizes([bs * randint(0, 8, gen) + 1 for _ in range(count)]
                       + [randint(2, 8 * bs, gen)], bs))
    bs = 2 ** randint(1, 5, gen)
    every.append(sizes([1] + [randint(2, 8 * bs, gen) for _ in range(count)], bs))
    every.append(sizes([randint(1, 300, gen) for _ in range(count)], 1))
    bs = 2 ** randint(1, 5, gen)
    every.append(sizes([randint(1, 8 * bs, gen) for _ in range(count)], bs, longest=True))
    yield from MEMORY.cases(*every)


# ch12.serving_costs: one workload in each regime, on every seed, its sizes drawn at random and
# drawn again until the engine's records show the regime (the public workload of the regime if
# no draw of 40 does; the tests prove a draw does for seeds 0-99). Nothing preempted with
# requests waiting for a place in the batch and a pool larger than its peak (the longest
# request's steps, the pool's size and the sum of every request's blocks are wrong there); a
# request preempted twice (counting the requests preempted, and feeding each token once, are
# wrong there); a common prefix shared (feeding each token once is wrong there).
def _served(rule):
    """A regime of serving_costs: ``rule`` of what the engine's records show for the case."""
    return lambda case: bool(rule(served(**case.kwargs), case.kwargs))


def _limits(kwargs):
    limits = kwargs["max_new_tokens"]
    return limits if isinstance(limits, list) else [limits] * len(kwargs["prompts"])


def _waited(record, kwargs):
    needs = sum(-(-(len(p) + n - 1) // kwargs["settings"]["block_size"])
                for p, n in zip(kwargs["prompts"], _limits(kwargs)))
    return (record["preemptions"] == 0 and record["steps"] > max(_limits(kwargs))
            and record["peak_blocks"] < min(kwargs["settings"]["num_blocks"], needs))


COSTS_REGIMES = {
    "nothing preempted, requests waiting for a place, the pool larger than its peak": _waited,
    "a request preempted more than once":
        lambda record, kwargs: record["preemptions"] > record["requests_preempted"],
    "a common prefix shared": lambda record, kwargs: record["shared_tokens"] > 0,
    "a step that preempts two requests":
        lambda record, kwargs: record["preemptions"] > record["steps_preempting"],
}


@hidden("ch12.serving_costs", regimes={name: _served(rule) for name, rule in
                                       COSTS_REGIMES.items()})
def _(gen):
    def waiting():
        bs, n = 2 ** randint(1, 3, gen), randint(4, 6, gen)
        lengths = [randint(2, 12, gen) for _ in range(n)]
        limits = [randint(2, 12, gen) for _ in range(n)]
        needs = sum(-(-(p + m - 1) // bs) for p, m in zip(lengths, limits))
        settings = dict(block_size=bs, num_blocks=needs + randint(1, 8, gen),
                        max_batch=randint(1, 3, gen), share_prefixes=bool(randint(0, 1, gen)))
        return (f"at most {settings['max_batch']} running: bs={bs}, "
                f"{settings['num_blocks']} blocks, {n} requests",
                settings, _prompts(gen, lengths), limits)

    def preempted():
        bs, n = randint(1, 3, gen), randint(4, 5, gen)
        lengths = [randint(2, 7, gen) for _ in range(n)]
        limits = [randint(3, 12, gen) for _ in range(n)]
        most = max(-(-(p + m - 1) // bs) for p, m in zip(lengths, limits))
        settings = dict(block_size=bs, num_blocks=most + randint(0, 3, gen),
                        share_prefixes=bool(randint(0, 1, gen)))
        return (f"a tight pool: bs={bs}, {settings['num_blocks']} blocks, {n} requests",
                settings, _prompts(gen, lengths), limits)

    def shared():
        bs, n = randint(2, 8, gen), randint(3, 5, gen)
        prefix = randint(bs, 16, gen)
        lengths = [prefix + randint(1, 6, gen) for _ in range(n)]
        limit = randint(2, 8, gen)
        batch = randint(2, 4, gen)
        settings = dict(block_size=bs, num_blocks=n * -(-(prefix + 6 + limit) // bs),
                        max_batch=batch if batch < 4 else None, share_prefixes=True)
        return (f"a common prefix of {prefix} tokens, sharing on: bs={bs}, "
                f"{settings['num_blocks']} blocks, {n} requests",
                settings, _prompts(gen, lengths, prefix=prefix), limit)

    def two_at_once():    # as ``preempted``, with more requests for fewer blocks
        bs, n = randint(1, 2, gen), randint(4, 6, gen)
        lengths = [randint(2, 6, gen) for _ in range(n)]
        limits = [randint(4, 12, gen) for _ in range(n)]
        most = max(-(-(p + m - 1) // bs) for p, m in zip(lengths, limits))
        settings = dict(block_size=bs, num_blocks=most + randint(0, 2, gen),
                        share_prefixes=False)
        return (f"a tight pool: bs={bs}, {settings['num_blocks']} blocks, {n} requests",
                settings, _prompts(gen, lengths), limits)

    for (name, rule), draw, public in zip(COSTS_REGIMES.items(),
                                          (waiting, preempted, shared, two_at_once),
                                          (*PUBLIC_WORKLOADS, PUBLIC_WORKLOADS[1])):
        for _ in range(40):
            label, settings, prompts, limits = draw()
            if rule(served(settings, prompts, limits),
                    dict(settings=settings, prompts=prompts, max_new_tokens=limits)):
                break
        else:
            label, settings, prompts, limits = public
        yield from costs_cases(label, settings, prompts, limits)
