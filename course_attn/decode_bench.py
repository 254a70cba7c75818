"""Generation with and without a KV cache, timed: ``python -m course_attn.bench --decode``.

Two measurements, each taken in one run on one machine:

- ``run_decode_bench``: the tiny GPT (``GPTConfig`` defaults, RoPE positions) generates N tokens
  greedily from a random prompt, with ``use_cache=True`` and ``use_cache=False`` once each per
  round, the first of the two alternating (so a load that comes and goes hits both alike). Per N:
  the median time of each (``timing.time_call_ms``: processor time on one CPU thread, else wall
  time), tokens per second, the speed-up (the median over rounds of each round's uncached time
  over its cached one, and their ``timing.spread``; withheld by the table and the JSON, as "not
  settled", unless the rounds agree: ``timing.rounds_agree``), the bytes of the caches
  (``KVCache.nbytes``: allocated, not computed) and the peak memory of each run
  (``timing.peak_memory_bytes``).
- ``run_cache_update_bench``: the time of appending one token's keys and values to a cache that
  already holds L tokens, in place (``KVCache.update``) and by ``torch.cat`` (which copies all L):
  in place, the cost does not depend on L. Every (way, L) is timed once per round, in an order
  that rotates, and each way's time at L is divided by its time at the first L in the same round
  (the median of those ratios, withheld unless the rounds agree).
"""

import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .arguments import check_positive_ints
from .kv_cache import KVCache
from .model import GPT, GPTConfig, generate
from .timing import (
    MIB, NOT_SETTLED, check_positive_list, peak_memory_bytes, ratio_over_rounds, round_median,
    spread, synchronize, time_call_ms, timed_rounds, withheld_ratio,
)


@dataclass
class DecodeRow:
    """N new tokens after a prompt of ``prompt_len``: times in ms, memory in MiB.

    ``speedup``: the median over rounds of the uncached time over the cached one in the same
    round; ``speedup_spread``: their interquartile range over that median (None with fewer than
    ``timing.MIN_ROUNDS`` rounds); ``withheld``: why the speed-up is not to be read (its rounds
    did not agree), None when it is. The table and the JSON then print "not settled" and null.
    """

    new_tokens: int
    prompt_len: int
    cached_ms: float
    uncached_ms: float
    speedup: float
    cached_tokens_per_s: float
    uncached_tokens_per_s: float
    cache_mib: float
    cached_peak_mib: float | None
    uncached_peak_mib: float | None
    repeats: int
    device: str
    speedup_spread: float | None = None
    withheld: str | None = None


@dataclass
class CacheUpdateRow:
    """Appending one token to a cache holding ``cached_len``: microseconds per append.

    ``inplace_ratio`` and ``cat_ratio``: each way's time over its own at the first length
    measured, the median over rounds of the ratio in each round (1.0 at the first length); None
    when the rounds did not agree (``timing.rounds_agree``), and ``withheld`` then says why.
    """

    cached_len: int
    inplace_us: float
    cat_us: float
    device: str
    inplace_ratio: float | None = None
    cat_ratio: float | None = None
    withheld: str | None = None


def decode_model(config: GPTConfig | None = None, *, device=None, seed: int = 0) -> GPT:
    """The model the decode benchmark generates from: ``GPTConfig`` defaults with RoPE
    positions and a vocabulary of 64 unless ``config`` is given; eval mode, seeded."""
    torch.manual_seed(seed)
    config = config or GPTConfig(vocab_size=64, seq_len=4096, position="rope")
    return GPT(config).to(device).eval()


def run_decode_bench(new_tokens: Sequence[int] = (64, 128, 256), *, prompt_len: int = 16,
                     batch: int = 1, model: GPT | None = None, device=None,
                     repeats: int = 3, memory: bool = True) -> list[DecodeRow]:
    """Greedy generation of each N in ``new_tokens``, with and without the cache, timed in turns.

    Asserts on the way that both give the same tokens. ``model`` defaults to ``decode_model``.
    ``memory=False`` skips the peak-memory runs (on the CPU the profiler that measures them
    makes each such run several times slower); the peaks are then None.
    """
    check_positive_list("new_tokens", list(new_tokens))
    check_positive_ints(prompt_len=prompt_len, batch=batch, repeats=repeats)
    model = decode_model(device=device) if model is None else model
    device = next(model.parameters()).device
    prompt = torch.randint(model.config.vocab_size, (batch, prompt_len),
                           generator=torch.Generator().manual_seed(prompt_len)).to(device)
    rows = []
    for n in new_tokens:
        runs = {cached: (lambda cached=cached: generate(model, prompt, n, temperature=0,
                                                         use_cache=cached))
                for cached in (True, False)}
        if not torch.equal(runs[True](), runs[False]()):        # also the warm-up
            raise AssertionError(f"greedy tokens differ with and without the cache at N={n}")
        times = {True: [], False: []}
        for r in range(repeats):
            for cached in ((True, False) if r % 2 == 0 else (False, True)):
                times[cached].append(time_call_ms(runs[cached], device))
        speedups = [slow / fast for slow, fast in zip(times[False], times[True])]
        peaks = {cached: peak_memory_bytes(runs[cached], device) if memory else None
                 for cached in runs}
        cached_ms, uncached_ms = statistics.median(times[True]), statistics.median(times[False])
        capacity = min(prompt_len + n - 1, model.config.seq_len)
        cache_bytes = sum(c.nbytes for c in model.new_caches(batch, capacity, device=device))
        rows.append(DecodeRow(
            n, prompt_len, cached_ms, uncached_ms, statistics.median(speedups),
            n * batch / cached_ms * 1e3, n * batch / uncached_ms * 1e3, cache_bytes / MIB,
            *(None if peaks[c] is None else peaks[c] / MIB for c in (True, False)),
            repeats, str(device), spread(speedups), withheld_ratio(speedups)[1]))
    return rows


def run_cache_update_bench(cached_lens: Sequence[int] = (512, 16384), *, heads: int = 8,
                           head_dim: int = 64, calls: int = 50, repeats: int = 5,
                           device=None) -> list[CacheUpdateRow]:
    """Microseconds to append one token's k and v (1, heads, 1, head_dim) to L cached tokens.

    The median over ``repeats`` of the mean over ``calls`` appends, in place and by torch.cat.
    """
    cached_lens = list(cached_lens)
    check_positive_list("cached_lens", cached_lens)
    check_positive_ints(heads=heads, head_dim=head_dim, calls=calls, repeats=repeats)
    device = torch.device("cpu") if device is None else torch.device(device)
    k_new = torch.randn(1, heads, 1, head_dim, device=device)
    runs = {}
    for length in cached_lens:
        cache = KVCache(1, heads, length + 1, head_dim, device=device)
        cache.update(torch.randn(1, heads, length, head_dim, device=device),
                     torch.randn(1, heads, length, head_dim, device=device))
        k_old, v_old = cache.k[:, :, :length].clone(), cache.v[:, :, :length].clone()

        def inplace(cache=cache, length=length):
            for _ in range(calls):
                cache.length = length            # rewind: every call appends at position L
                cache.update(k_new, k_new)

        def concatenate(k_old=k_old, v_old=v_old):
            for _ in range(calls):
                torch.cat([k_old, k_new], dim=2), torch.cat([v_old, k_new], dim=2)

        runs["inplace", length], runs["cat", length] = inplace, concatenate
    for run in runs.values():
        run()                                        # warm-up
    rounds = timed_rounds(lambda key: time_call_ms(runs[key], device) * 1e3 / calls, runs,
                          repeats)
    synchronize(device)
    rows = []
    for length in cached_lens:
        (inplace_ratio, inplace_why), (cat_ratio, cat_why) = (
            ratio_over_rounds(rounds, (way, length), (way, cached_lens[0]))
            for way in ("inplace", "cat"))
        rows.append(CacheUpdateRow(
            length, round_median(rounds, ("inplace", length)),
            round_median(rounds, ("cat", length)), str(device), inplace_ratio, cat_ratio,
            inplace_why or cat_why))
    return rows


def format_decode_table(rows: Sequence[DecodeRow]) -> str:
    """The decode rows as a fixed-width text table."""
    header = ("new tokens", "cache ms", "no cache ms", "speed-up", "spread", "cache tok/s",
              "no cache tok/s", "cache MiB", "peak MiB cache", "peak MiB no cache")
    lines = [header] + [(str(r.new_tokens), f"{r.cached_ms:.0f}", f"{r.uncached_ms:.0f}",
                         "not settled" if r.withheld else f"{r.speedup:.1f}x",
                         "-" if r.speedup_spread is None else f"{r.speedup_spread:.2f}",
                         f"{r.cached_tokens_per_s:.0f}",
                         f"{r.uncached_tokens_per_s:.0f}", f"{r.cache_mib:.3f}",
                         "-" if r.cached_peak_mib is None else f"{r.cached_peak_mib:.2f}",
                         "-" if r.uncached_peak_mib is None else f"{r.uncached_peak_mib:.2f}")
                        for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    out.append("speed-up: the median over rounds of the time without the cache over the time "
               "with it")
    out.append("spread: the interquartile range of those ratios over their median")
    if any(r.withheld for r in rows):
        out.append(f"not settled: the rounds did not agree, or were too few: {NOT_SETTLED}")
    return "\n".join(out)


def format_update_table(rows: Sequence[CacheUpdateRow]) -> str:
    """The cache-update rows as a fixed-width text table, with a line under it that says what
    ``us`` and ``x first`` mean (and one more when a ratio is withheld)."""
    def ratio(x):
        return "-" if x is None else f"{x:.2f}"

    lines = [("cached tokens", "in place us", "x first", "torch.cat us", "x first")] + [
        (str(r.cached_len), f"{r.inplace_us:.1f}", ratio(r.inplace_ratio), f"{r.cat_us:.1f}",
         ratio(r.cat_ratio)) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(5)]
    out = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    out.append("us: microseconds per append; x first: the median over rounds of the time over "
               "the first row's")
    if any(r.withheld for r in rows):
        out.append(f"-: the rounds did not agree, or were too few: {NOT_SETTLED}")
    return "\n".join(out)


def main_decode(args, device: torch.device) -> tuple[str, dict]:
    """What ``python -m course_attn.bench --decode`` prints, and the rows for its ``--json``
    (``args`` from bench's parser)."""
    start = time.perf_counter()
    config = GPTConfig(vocab_size=64, seq_len=4096, position="rope", backend=args.model_backend)
    model = decode_model(config, device=device)
    decode = run_decode_bench(args.new_tokens, prompt_len=args.prompt_len, batch=args.batch,
                              model=model, device=device, repeats=args.repeats)
    updates = run_cache_update_bench(args.cache_lens, heads=args.heads, head_dim=args.head_dim,
                                     device=device)
    c = model.config
    report = {"config": dataclasses.asdict(c), "prompt_len": args.prompt_len,
              "decode": [{**dataclasses.asdict(r), "speedup": None if r.withheld else r.speedup}
                         for r in decode],
              "cache_update": [dataclasses.asdict(r) for r in updates]}
    return "\n".join([
        f"Greedy generation from the tiny GPT (d_model={c.d_model}, n_heads={c.n_heads}, "
        f"n_layers={c.n_layers}, RoPE, backend={c.backend!r}), prompt of {args.prompt_len} "
        f"tokens, B={args.batch}, median of {args.repeats}:",
        format_decode_table(decode), "",
        f"Appending one token to a cache (B=1, H={args.heads}, D={args.head_dim}, float32), "
        "mean of 50 appends, median of 5:",
        format_update_table(updates),
        f"({time.perf_counter() - start:.1f} s)"]), report
