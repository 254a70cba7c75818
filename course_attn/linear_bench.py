"""Linear attention against softmax attention, timed: ``python -m course_attn.bench --linear``.

Two measurements (chapter 10), each in one run on one machine, with ``timing``'s machinery
(warm-up until the times settle, turns that rotate, the median, peak memory measured):

- ``run_linear_bench``: causal linear attention in its chunked form against PyTorch's fused
  causal SDPA on the same q, k, v (B, H, T, D), at each T. The rows are ``timing.BenchRow``s
  (backends ``"linear"`` and ``"sdpa"``), so ``format_table`` prints them and ``time_ratio`` is
  linear's time over SDPA's. ``crossover_length`` reads off where linear starts to win.
- ``run_step_bench``: one decode step after L tokens. Linear attention reads and updates its
  fixed-size state (``linear_attention_step``); softmax attention reads a cache of L keys and
  values (SDPA of one query over them). The first costs the same at every L, the second grows.
  Every (side, L) is timed once per round, in an order that rotates, and linear's time at L is
  divided by its time at the first L in the same round (the median of those ratios, withheld
  unless the rounds agree).
"""

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .arguments import check_positive_ints
from .device import default_device
from .linear import FEATURE_MAPS, linear_attention, linear_attention_state, linear_attention_step
from .timing import (
    BASELINE, DTYPES, MAX_WARMUP, MIB, NOT_SETTLED, BenchRow, check_device, check_sizes,
    format_table, free_cached, measure, ratio_over_rounds, round_median, rows_at, time_call_ms,
    timed_rounds, warm_up,
)

LINEAR = "linear"


@dataclass
class StepRow:
    """One decode step after ``seq_len`` tokens: microseconds, and the bytes each side keeps.

    ``linear_ratio``: linear's step time over its own at the first length measured, the median
    over rounds of that ratio in each round (1.0 at the first length); None when the rounds did
    not agree (``timing.rounds_agree``), and ``withheld`` then says why. ``state_mib``: linear
    attention's state (s and z); ``cache_mib``: the L keys and values that softmax attention
    reads instead.
    """

    seq_len: int
    linear_us: float
    sdpa_us: float
    linear_ratio: float | None
    state_mib: float
    cache_mib: float
    batch: int
    heads: int
    head_dim: int
    dtype: str
    feature_map: str
    device: str
    calls: int
    repeats: int
    withheld: str | None = None


def _randn(*shape, seed: int, device, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _check_feature_map(feature_map: str) -> None:
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"unknown feature_map {feature_map!r}; expected one of "
                         f"{', '.join(FEATURE_MAPS)}")


def run_linear_bench(
    seq_lens: Sequence[int] = (256, 512, 1024, 2048, 4096), *, batch: int = 1, heads: int = 8,
    head_dim: int = 64, chunk_size: int = 64, feature_map: str = "elu",
    dtype: torch.dtype = torch.float32, device=None, repeats: int = 5,
    max_warmup: int = MAX_WARMUP,
) -> list[BenchRow]:
    """Causal chunked linear attention and causal SDPA on q, k, v (B, H, T, D), at each T.

    Two ``BenchRow``s per T (``"linear"``, then ``"sdpa"``), ratios to SDPA's row. Each call is
    warmed up until its times settle (at most ``max_warmup`` calls), then timed ``repeats``
    times in turns. A call that raises gets a row with the error. ``ValueError`` for a bad
    option or a device that is not available.
    """
    seq_lens = list(seq_lens)
    check_sizes(seq_lens, batch=batch, heads=heads, head_dim=head_dim, dtype=dtype,
                repeats=repeats, max_warmup=max_warmup)
    check_positive_ints(chunk_size=chunk_size)
    _check_feature_map(feature_map)
    device = default_device() if device is None else check_device(device)
    common = dict(batch=batch, heads=heads, head_dim=head_dim,
                  dtype=str(dtype).removeprefix("torch."), is_causal=True, window=None,
                  device=str(device), repeats=repeats)

    def calls_at(t: int) -> dict:
        q, k, v = (_randn(batch, heads, t, head_dim, seed=3 * t + i, device=device, dtype=dtype)
                   for i in range(3))
        return {
            LINEAR: lambda: linear_attention(q, k, v, causal=True, feature_map=feature_map,
                                             form="chunked", chunk_size=chunk_size),
            BASELINE: lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        }

    rows = []
    for t in seq_lens:
        rows += rows_at(t, measure(calls_at(t), device, repeats, max_warmup), **common)
        free_cached(device)
    return rows


def crossover_length(rows: Sequence[BenchRow]) -> float | None:
    """The T at which linear attention becomes faster than SDPA, read off ``run_linear_bench``.

    Between the longest measured T where linear is not faster (time ratio >= 1) and the next
    measured T, the log of the ratio is interpolated linearly in log T, and the T where it
    crosses 0 returned. None when linear is not faster at the longest T measured, or faster at
    every T measured (the crossing is outside the sweep).
    """
    ratios = sorted((r.seq_len, r.time_ratio) for r in rows
                    if r.backend == LINEAR and r.time_ratio is not None)
    if not ratios or ratios[-1][1] >= 1:
        return None
    slower = [i for i, (_, ratio) in enumerate(ratios) if ratio >= 1]
    if not slower:
        return None
    (t0, r0), (t1, r1) = ratios[slower[-1]], ratios[slower[-1] + 1]
    if r0 == 1:
        return float(t0)
    share = math.log(r0) / (math.log(r0) - math.log(r1))
    return math.exp(math.log(t0) + share * (math.log(t1) - math.log(t0)))


def run_step_bench(
    seq_lens: Sequence[int] = (512, 4096), *, batch: int = 1, heads: int = 8,
    head_dim: int = 64, feature_map: str = "elu", dtype: torch.dtype = torch.float32,
    device=None, calls: int = 50, repeats: int = 5, max_warmup: int = MAX_WARMUP,
) -> list[StepRow]:
    """One decode step after L tokens, for each L in ``seq_lens``: linear and softmax attention.

    Linear: the state of L tokens (``linear_attention_state``), then ``calls`` steps of
    ``linear_attention_step`` in a row, each reading the state the one before it left.
    Softmax: ``calls`` times, SDPA of one query over the L cached keys and values. Each timed call
    is such a run of ``calls`` steps, warmed up until settled, the lengths and the two sides
    taking turns; a row gives the median over ``repeats`` rounds of the mean step, in
    microseconds, and linear's ratio to the first length, taken per round (``StepRow``).
    """
    seq_lens = list(seq_lens)
    check_sizes(seq_lens, batch=batch, heads=heads, head_dim=head_dim, dtype=dtype,
                repeats=repeats, max_warmup=max_warmup)
    check_positive_ints(calls=calls)
    _check_feature_map(feature_map)
    device = default_device() if device is None else check_device(device)

    def tokens(t, seed):
        return [_randn(batch, heads, t, head_dim, seed=seed + i, device=device, dtype=dtype)
                for i in range(3)]

    q_t, k_t, v_t = tokens(1, seed=0)
    runs, sizes = {}, {}
    for length in seq_lens:
        _, k, v = tokens(length, seed=3 * length)
        state = linear_attention_state(k, v, feature_map=feature_map)
        sizes[length] = ((state.s.nbytes + state.z.nbytes) / MIB, (k.nbytes + v.nbytes) / MIB)

        def linear(state=state):
            for _ in range(calls):
                _, state = linear_attention_step(q_t, k_t, v_t, state, feature_map=feature_map)

        def softmax(k=k, v=v):
            for _ in range(calls):
                F.scaled_dot_product_attention(q_t, k, v)

        runs[(LINEAR, length)], runs[(BASELINE, length)] = linear, softmax

    def timed(key):
        return time_call_ms(runs[key], device)

    warm_up({key: (lambda key=key: timed(key)) for key in runs}, max_calls=max_warmup)
    rounds = timed_rounds(lambda key: timed(key) * 1e3 / calls, runs, repeats)
    rows = []
    for length in seq_lens:
        ratio, why = ratio_over_rounds(rounds, (LINEAR, length), (LINEAR, seq_lens[0]))
        rows.append(StepRow(length, round_median(rounds, (LINEAR, length)),
                            round_median(rounds, (BASELINE, length)), ratio, *sizes[length],
                            batch, heads, head_dim, str(dtype).removeprefix("torch."),
                            feature_map, str(device), calls, repeats, why))
    return rows


def format_step_table(rows: Sequence[StepRow]) -> str:
    """The decode-step rows as a fixed-width text table, with a line under it that says what
    ``us`` and ``x first`` mean (and one more when a ratio is withheld)."""
    header = ("tokens before", "linear us", "x first", "sdpa us", "state MiB", "KV cache MiB")
    lines = [header] + [(str(r.seq_len), f"{r.linear_us:.1f}",
                         "-" if r.linear_ratio is None else f"{r.linear_ratio:.2f}",
                         f"{r.sdpa_us:.1f}", f"{r.state_mib:.3f}", f"{r.cache_mib:.3f}")
                        for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    out.append("us: microseconds per decode step; x first: the median over rounds of linear's "
               "time over its time in the first row")
    if any(r.withheld for r in rows):
        out.append(f"-: the rounds did not agree, or were too few: {NOT_SETTLED}")
    return "\n".join(out)


def main_linear(args, device: torch.device) -> tuple[str, dict]:
    """What ``python -m course_attn.bench --linear`` prints, and the report for its ``--json``
    (``args`` from bench's parser)."""
    start = time.perf_counter()
    dtype = DTYPES[args.dtype]
    sizes = dict(batch=args.batch, heads=args.heads, head_dim=args.head_dim, dtype=dtype,
                 device=device, repeats=args.repeats, max_warmup=args.max_warmup,
                 feature_map=args.feature_map)
    rows = run_linear_bench(args.seq_lens, chunk_size=args.chunk_size, **sizes)
    steps = run_step_bench(args.step_lens, **sizes)
    crossover = crossover_length(rows)
    if crossover is not None:
        verdict = f"linear attention is faster than sdpa from T = {crossover:.0f} (interpolated)"
    elif any(r.backend == LINEAR and r.time_ratio is not None and r.time_ratio < 1 for r in rows):
        verdict = "linear attention is faster than sdpa at every T measured"
    else:
        verdict = "linear attention is not faster than sdpa at the longest T measured"
    report = {"chunk_size": args.chunk_size, "feature_map": args.feature_map,
              "crossover_length": crossover, "rows": [dataclasses.asdict(r) for r in rows],
              "decode_step": [dataclasses.asdict(r) for r in steps]}
    return "\n".join([
        f"Causal attention, B={args.batch} H={args.heads} D={args.head_dim} {args.dtype}: "
        f"linear (chunked, chunk_size={args.chunk_size}, feature_map={args.feature_map!r}) "
        f"vs sdpa, repeats={args.repeats}:",
        format_table(rows), verdict, "",
        f"One decode step after T tokens (mean of {steps[0].calls} steps, median of "
        f"{args.repeats}): linear attention's state vs sdpa over a KV cache:",
        format_step_table(steps),
        f"({time.perf_counter() - start:.1f} s)"]), report

