"""Time and peak memory of every attention backend, side by side: ``python -m course_attn.bench``.

For each sequence length T, every backend runs on the same q, k, v of shape (B, H, T, D), and the
backends take turns within each repeat (the order rotating from one repeat to the next), so a
burst of machine noise hits them all alike. Each row reports, for one (backend, T):

- ``time_ms``: the median of ``repeats`` timed calls (``kept`` says how many it is over), made
  after the warm-up; on CUDA the device is synchronised before the clock is read, so the time is
  the kernels', not the launch's.
- ``warmup_calls`` and ``settled``: the first calls at a new shape can be far slower than the
  rest (on a 2-core CPU the first five took 60-96 ms, later ones 1.5 ms), so the backends are
  first called in turns, and these calls thrown away, until each one's times settle: the last
  ``SETTLE_WINDOW`` calls lie within ``SETTLE_TOLERANCE`` of their median, and that median within
  the same tolerance of the ``SETTLE_WINDOW`` calls before them (see ``has_settled``). A backend
  that has not settled after ``max_warmup`` calls or ``WARMUP_BUDGET_MS`` of calls is timed
  anyway, with ``settled=False``; the table marks its time with ``*``.
- ``peak_mib``: the most memory the call held at once beyond what was allocated before it
  (scores, temporaries and the output), measured, never computed from a formula:

  * CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus
    ``memory_allocated`` before the call.
  * CPU (and any other device): PyTorch has no peak counter for the CPU allocator, so the call
    runs once under ``torch.profiler.profile(profile_memory=True)``, which records every
    allocation and free on the device as a signed byte count with a timestamp; summing them in
    time order gives the bytes held at each moment, and their maximum is the peak. The events are
    read from the raw list ``prof.profiler.kineto_results.events()`` (``prof.events()`` drops the
    allocations made inside operators); the profiler's ``"Total Allocated"`` field is not used, as
    it carries over between profiling sessions. Checked on torch 2.13, B=1, H=8, D=64, float32:
    ``"math"`` peaks at 3.00x the B·H·T² score matrix at T = 512, 1024 and 2048 (scores,
    scores - max and their exp alive at once) and ``"sdpa"`` at its (B, H, T, D) output plus a
    scratch tile per thread (1.2 MiB in all with 2 threads), with the same byte count on every
    run. A device whose allocations the profiler does not report gets ``peak_mib = None``.

``time_ratio`` and ``mem_ratio`` divide by ``"sdpa"``'s row at the same T (None when ``"sdpa"``
is not in the run or failed). A backend that raises at some T (out of memory, unsupported
options) gets a row carrying the error instead of stopping the run. A bad option, or a device
that this machine or this build of PyTorch does not have, is a ``ValueError`` before anything
runs (on the command line: one line on stderr, exit status 2).

Python: ``rows = run_bench(["math", "sdpa"], (256, 512)); print(format_table(rows))``.
"""

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .arguments import check_positive_ints
from .backends import BACKENDS, get_backend
from .device import default_device
from .linear import FEATURE_MAPS
from .masks import check_window

PROG = "python -m course_attn.bench"
MIB = 2 ** 20
BASELINE = "sdpa"
SETTLE_WINDOW = 3          # calls compared to decide the times have settled
SETTLE_TOLERANCE = 0.25    # how far (a fraction of the median) a settled time may stray
MAX_WARMUP = 30            # warm-up calls at most, per backend and length
WARMUP_BUDGET_MS = 2000.0  # warm-up time at most, per backend and length
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


@dataclass
class BenchRow:
    """One backend at one sequence length. Times in milliseconds, memory in MiB (2**20 bytes).

    ``repeats`` is how many timed calls were asked for and ``kept`` how many the median is over;
    ``warmup_calls`` and ``settled`` say how the warm-up before them went (None on a failed row).
    """

    backend: str
    seq_len: int
    time_ms: float | None
    peak_mib: float | None
    time_ratio: float | None
    mem_ratio: float | None
    error: str | None
    batch: int
    heads: int
    head_dim: int
    dtype: str
    is_causal: bool
    window: int | None
    device: str
    repeats: int
    warmup_calls: int | None = None
    settled: bool | None = None
    kept: int | None = None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _time_call_ms(fn: Callable[[], Tensor], device: torch.device) -> float:
    _synchronize(device)
    start = time.perf_counter()
    fn()
    _synchronize(device)
    return (time.perf_counter() - start) * 1e3


def _peak_bytes_cuda(fn: Callable[[], Tensor], device: torch.device) -> int:
    _synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _peak_bytes_profiled(fn: Callable[[], Tensor], device: torch.device) -> int | None:
    from torch.profiler import ProfilerActivity, profile

    # Kineto prints "profiler_start/stop" lines to stderr on every session unless told not to.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    _synchronize(device)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
        _synchronize(device)
    # The raw event list keeps allocations made inside operators; prof.events() drops them.
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:
        return None
    events = [e for e in results.events() if e.name() == "[memory]"
              and str(e.device_type()).rsplit(".", 1)[-1].lower() == device.type]
    if not events:
        return None
    held = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak


def peak_memory_bytes(fn: Callable[[], Tensor], device: torch.device) -> int | None:
    """Bytes ``fn()`` holds at its peak beyond what was allocated before; None if unmeasurable."""
    device = torch.device(device)
    if device.type == "cuda":
        return _peak_bytes_cuda(fn, device)
    return _peak_bytes_profiled(fn, device)


def _describe(error: BaseException) -> str:
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line[:120]}"


def _free_cached(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _rotated(names: list[str], r: int) -> list[str]:
    """``names`` starting at index r (mod len): who goes first changes from repeat to repeat."""
    r = r % len(names) if names else 0
    return names[r:] + names[:r]


def has_settled(times_ms: Sequence[float], window: int = SETTLE_WINDOW,
                tolerance: float = SETTLE_TOLERANCE) -> bool:
    """Whether a run of call times has stopped changing.

    True when the last ``window`` times each lie within ``tolerance`` (a fraction) of their
    median, and the ``window`` times before them have a median within ``tolerance`` of it too: a
    few equally slow first calls are not taken for settled, as they would be by the spread alone.
    """
    if len(times_ms) < 2 * window:
        return False
    last, before = times_ms[-window:], times_ms[-2 * window:-window]
    middle = statistics.median(last)
    return (all(abs(t - middle) <= tolerance * middle for t in last)
            and abs(statistics.median(before) - middle) <= tolerance * middle)


@dataclass
class Warmup:
    """How one backend's warm-up went: the times of its untimed calls, and whether they settled."""

    times_ms: list[float]
    settled: bool

    @property
    def calls(self) -> int:
        return len(self.times_ms)


def warm_up(timed_calls: dict[str, Callable[[], float | None]], *, max_calls: int = MAX_WARMUP,
            budget_ms: float = WARMUP_BUDGET_MS) -> dict[str, Warmup]:
    """Call each ``timed_calls[name]()`` (which returns its time in ms) in turns until it settles.

    A name stops when ``has_settled`` says its times have settled, after ``max_calls`` calls, once
    its calls add up to ``budget_ms``, or when its call returns None (it failed). Every name is
    called at least once. Returns name -> ``Warmup``.
    """
    times: dict[str, list[float]] = {name: [] for name in timed_calls}
    done: dict[str, Warmup] = {}
    while len(done) < len(timed_calls):
        for name, call in timed_calls.items():
            if name in done:
                continue
            elapsed = call()
            if elapsed is None:
                done[name] = Warmup(times[name], settled=False)
                continue
            times[name].append(elapsed)
            if has_settled(times[name]):
                done[name] = Warmup(times[name], settled=True)
            elif len(times[name]) >= max_calls or sum(times[name]) >= budget_ms:
                done[name] = Warmup(times[name], settled=False)
    return done


def _check_positive(name: str, values: Sequence[int]) -> None:
    """ValueError unless ``values`` is a non-empty list of positive ints."""
    if not values or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in values):
        raise ValueError(f"{name} must be a non-empty list of positive ints, got {values!r}")


def _check_options(seq_lens, batch, heads, head_dim, dtype, repeats, names, max_warmup) -> None:
    check_positive_ints(batch=batch, heads=heads, head_dim=head_dim, repeats=repeats,
                        max_warmup=max_warmup)
    _check_positive("seq_lens", seq_lens)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if not names:
        raise ValueError("no backend to benchmark")
    for name in names:
        get_backend(name)


@dataclass
class _Measured:
    """One backend's measurements at one T (a successful one)."""

    time_ms: float
    peak_mib: float | None
    warmup: Warmup
    kept: int


def _measure(calls: dict[str, Callable[[], Tensor]], device: torch.device, repeats: int,
             max_warmup: int) -> dict:
    """Warm each call up until its times settle, time them all in turns, then measure memory.

    Returns name -> ``_Measured``, or name -> the error string when it raised.
    """
    errors: dict[str, str] = {}

    def attempt(name, measure):
        try:
            return measure(calls[name])
        except Exception as error:  # noqa: BLE001 -- any failure becomes that backend's row
            errors[name] = _describe(error)
            _free_cached(device)
            return None

    def timed(name: str) -> float | None:
        return attempt(name, lambda call: _time_call_ms(call, device))

    warmups = warm_up({name: functools.partial(timed, name) for name in calls},
                      max_calls=max_warmup)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(repeats):
        for name in _rotated([n for n in calls if n not in errors], r):
            elapsed = timed(name)
            if elapsed is not None:
                times[name].append(elapsed)
    peaks = {name: attempt(name, lambda call: peak_memory_bytes(call, device))
             for name in calls if name not in errors}
    return {name: errors[name] if name in errors else
            _Measured(statistics.median(times[name]),
                      None if peaks[name] is None else peaks[name] / MIB,
                      warmups[name], len(times[name]))
            for name in calls}


def check_device(device) -> torch.device:
    """``torch.device(device)``, or a ``ValueError`` saying why no tensor can be made there."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"not a device: {device!r} (try cpu, cuda, cuda:1 or mps)") from None
    if device.type == "cuda" and torch.version.cuda is None and torch.version.hip is None:
        raise ValueError(f"device {str(device)!r} is not available: this PyTorch "
                         f"({torch.__version__}) was built without CUDA")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:  # torch raises either for a missing device
        raise ValueError(f"device {str(device)!r} is not available: {_describe(error)}") from None
    return device


def run_bench(
    backends: Sequence[str] | None = None, seq_lens: Sequence[int] = (256, 512, 1024), *,
    batch: int = 1, heads: int = 8, head_dim: int = 64, dtype: torch.dtype = torch.float32,
    is_causal: bool = False, window: int | None = None, device=None, repeats: int = 5,
    max_warmup: int = MAX_WARMUP,
) -> list[BenchRow]:
    """Time and peak memory of each backend at each T, on q, k, v of shape (B, H, T, D).

    ``backends``: names in ``BACKENDS`` (default: every one registered when this is called).
    ``is_causal`` and ``window`` are passed to every backend. Each backend is warmed up (at most
    ``max_warmup`` calls) until its times settle, then timed ``repeats`` times. Returns one
    ``BenchRow`` per (T, backend), T-major, ratios taken to ``"sdpa"`` at the same T.
    ``ValueError`` for a bad option or a device that is not available.
    """
    names = list(BACKENDS) if backends is None else list(dict.fromkeys(backends))
    seq_lens = list(seq_lens)
    _check_options(seq_lens, batch, heads, head_dim, dtype, repeats, names, max_warmup)
    check_window(window)
    device = default_device() if device is None else check_device(device)
    common = dict(batch=batch, heads=heads, head_dim=head_dim,
                  dtype=str(dtype).removeprefix("torch."), is_causal=bool(is_causal),
                  window=window, device=str(device), repeats=repeats)
    rows: list[BenchRow] = []
    for t in seq_lens:
        generator = torch.Generator().manual_seed(t)
        q, k, v = (torch.randn(batch, heads, t, head_dim, generator=generator)
                   .to(device=device, dtype=dtype) for _ in range(3))
        calls = {name: (lambda fn=get_backend(name):
                        fn(q, k, v, is_causal=is_causal, window=window))
                 for name in names}
        results = _measure(calls, device, repeats, max_warmup)
        del q, k, v, calls
        _free_cached(device)
        base = results.get(BASELINE)
        base_time, base_mem = ((base.time_ms, base.peak_mib) if isinstance(base, _Measured)
                               else (None, None))
        for name in names:
            result = results[name]
            if isinstance(result, str):
                rows.append(BenchRow(name, t, None, None, None, None, result, **common))
                continue
            time_ratio = result.time_ms / base_time if base_time else None
            mem_ratio = (result.peak_mib / base_mem if result.peak_mib is not None and base_mem
                         else None)
            rows.append(BenchRow(name, t, result.time_ms, result.peak_mib, time_ratio, mem_ratio,
                                 None, **common, warmup_calls=result.warmup.calls,
                                 settled=result.warmup.settled, kept=result.kept))
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


def format_table(rows: Sequence[BenchRow]) -> str:
    """The rows as a fixed-width text table.

    Columns: T, backend, time (the median), its ratio to sdpa, peak memory, its ratio to sdpa,
    how many timed calls the median was kept over, and how many warm-up calls came before them.
    A time whose warm-up never settled is marked ``*``, with a note under the table.
    """
    header = ("T", "backend", "time ms", f"x {BASELINE}", "peak MiB", f"x {BASELINE}", "kept",
              "warm-up")
    lines = []
    for row in rows:
        if row.error is not None:
            lines.append((str(row.seq_len), row.backend, f"failed: {row.error}"))
        else:
            mark = "*" if row.settled is False else ""
            lines.append((str(row.seq_len), row.backend, _fmt(row.time_ms, ".2f") + mark,
                          _fmt(row.time_ratio, ".2f"), _fmt(row.peak_mib, ".2f"),
                          _fmt(row.mem_ratio, ".2f"), _count(row.kept),
                          _count(row.warmup_calls)))
    ok = [line for line in lines if len(line) == len(header)]
    widths = [max(len(line[i]) for line in [header, *ok]) for i in range(len(header))]

    def render(cells) -> str:
        if len(cells) != len(header):
            return "  ".join([cells[0].rjust(widths[0]), cells[1].ljust(widths[1]), cells[2]])
        return "  ".join([cells[0].rjust(widths[0]), cells[1].ljust(widths[1]),
                          *(c.rjust(w) for c, w in zip(cells[2:], widths[2:]))])

    out = [render(header), "  ".join("-" * w for w in widths)]
    previous_t = None
    for row, cells in zip(rows, lines):
        if previous_t is not None and row.seq_len != previous_t:
            out.append("")
        previous_t = row.seq_len
        out.append(render(cells))
    if any(row.error is None and row.settled is False for row in rows):
        out += ["", "* still changing when the warm-up stopped: a rough time"]
    return "\n".join(out)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware(device=None) -> dict:
    """What the numbers were measured on: device name, CPU, core count, torch and Python."""
    device = default_device() if device is None else torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "mps":
        name = "Apple MPS"
    else:
        name = _cpu_model()
    return {
        "device": str(device),
        "device_name": name,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Time and peak memory of every attention backend on random q, k, v of shape "
                    "(B, H, T, D), with ratios to PyTorch's SDPA ('sdpa'). Each backend is "
                    "warmed up until its times settle, then timed; the table gives the median "
                    "and how many timed calls it kept.")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024], metavar="T",
                   help="sequence lengths T to measure, each in its own block of the table "
                        "(default: 256 512 1024)")
    p.add_argument("--batch", type=int, default=1, metavar="B",
                   help="batch size B (default: %(default)s)")
    p.add_argument("--heads", type=int, default=8, metavar="H",
                   help="number of heads H (default: %(default)s)")
    p.add_argument("--head-dim", type=int, default=64, metavar="D",
                   help="size D of each head's queries, keys and values (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="element type of q, k and v (default: %(default)s)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=False,
                   help="causal attention: each query sees only the keys up to its position "
                        "(default: off)")
    p.add_argument("--window", type=int, default=None, metavar="W",
                   help="sliding window: each query sees only keys fewer than W positions away "
                        "(default: none, every key)")
    p.add_argument("--backends", nargs="+", default=None, metavar="NAME",
                   help="backends to measure (default: every registered one, here: "
                        f"{', '.join(BACKENDS)})")
    p.add_argument("--device", default=None,
                   help="where to run: cpu, cuda, cuda:1, mps (default: the first present of "
                        f"cuda, mps and cpu; here {default_device()})")
    p.add_argument("--repeats", type=int, default=None, metavar="N",
                   help="timed calls per backend and length after the warm-up; the time shown "
                        "is their median (default: 5; with --decode, 3)")
    p.add_argument("--max-warmup", type=int, default=MAX_WARMUP, metavar="N",
                   help="untimed calls at most before timing, stopping sooner once the times "
                        f"settle or after {WARMUP_BUDGET_MS / 1000:g} s (default: %(default)s)")
    decode = p.add_argument_group(
        "decode", "With --decode: generation from the tiny GPT timed with and without a KV "
                  "cache, and one cache append at several cached lengths, instead of the backends")
    decode.add_argument("--decode", action="store_true",
                        help="run the decode benchmark (it uses --batch, --heads, --head-dim, "
                             "--device and --repeats) (default: off)")
    decode.add_argument("--new-tokens", type=int, nargs="+", default=[64, 128, 256],
                        metavar="N", help="tokens to generate (default: 64 128 256)")
    decode.add_argument("--prompt-len", type=int, default=16, metavar="T",
                        help="length of the random prompt (default: %(default)s)")
    decode.add_argument("--cache-lens", type=int, nargs="+", default=[512, 16384], metavar="L",
                        help="cached lengths at which one append is timed (default: 512 16384)")
    decode.add_argument("--model-backend", choices=sorted(BACKENDS), default="math",
                        help="the attention backend of the model (default: %(default)s)")
    linear = p.add_argument_group(
        "linear", "With --linear: causal linear attention (chunked) against causal sdpa at each "
                  "--seq-lens, and one decode step after several lengths, instead of the backends")
    linear.add_argument("--linear", action="store_true",
                        help="run the linear-attention benchmark (it uses --seq-lens, --batch, "
                             "--heads, --head-dim, --dtype, --device, --repeats and "
                             "--max-warmup) (default: off)")
    linear.add_argument("--chunk-size", type=int, default=64, metavar="C",
                        help="tokens per chunk of the chunked form (default: %(default)s)")
    linear.add_argument("--feature-map", choices=FEATURE_MAPS, default="elu",
                        help="the feature map that linear attention applies to queries and "
                             "keys (default: %(default)s)")
    linear.add_argument("--step-lens", type=int, nargs="+", default=[512, 4096], metavar="L",
                        help="lengths after which one decode step is timed (default: 512 4096)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the rows and the hardware to this JSON file "
                        "(default: none)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: print the table (and write the JSON); 2 and a one-line error if bad."""
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    try:
        device = default_device() if args.device is None else check_device(args.device)
        if args.linear:
            from .linear_bench import main_linear

            args.repeats = 5 if args.repeats is None else args.repeats
            text, report = main_linear(args, device)
        elif args.decode:
            from .decode_bench import main_decode

            args.repeats = 3 if args.repeats is None else args.repeats
            text, report = main_decode(args, device)
        else:
            args.repeats = 5 if args.repeats is None else args.repeats
            rows = run_bench(args.backends, args.seq_lens, batch=args.batch, heads=args.heads,
                             head_dim=args.head_dim, dtype=DTYPES[args.dtype],
                             is_causal=args.causal, window=args.window, device=device,
                             repeats=args.repeats, max_warmup=args.max_warmup)
    except ValueError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    info = hardware(device)
    if args.decode or args.linear:
        print(f"{info['device_name']} ({info['device']}), {info['cpu_count']} CPUs, "
              f"torch {info['torch']}")
        print(text)
        report = {"hardware": info, "elapsed_s": elapsed, **report}
        return _write_json(args.json, report)
    print(f"{info['device_name']} ({info['device']}), {info['cpu_count']} CPUs, "
          f"torch {info['torch']} | B={args.batch} H={args.heads} D={args.head_dim} "
          f"{args.dtype} causal={args.causal} window={args.window} repeats={args.repeats}")
    print(format_table(rows))
    print(f"({elapsed:.1f} s)")
    return _write_json(args.json, {"hardware": info, "elapsed_s": elapsed,
                                   "rows": [dataclasses.asdict(row) for row in rows]})


def _write_json(path: str | None, report: dict) -> int:
    """Write ``report`` to ``path`` (nothing when None): the exit status, 2 if it cannot."""
    if path is None:
        return 0
    try:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    except OSError as error:
        print(f"{PROG}: error: cannot write {path}: {error.strerror}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
