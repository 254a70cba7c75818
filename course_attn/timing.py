"""How the benchmarks measure a call: warm-up until settled, the median, peak memory, the device.

The three benchmarks (``bench``: the attention backends, ``linear_bench``, ``decode_bench``) time
and measure with these, and print their comparisons with ``BenchRow`` and ``format_table``:

- ``time_call_ms``: one call's wall time; the device is synchronised before the clock is read,
  so on CUDA the time is the kernels', not the launch's.
- ``warm_up`` and ``has_settled``: the first calls at a new shape can be far slower than the rest
  (on a 2-core CPU the first five took 60-96 ms, later ones 1.5 ms), so calls are made in turns,
  and thrown away, until each one's times settle: the last ``SETTLE_WINDOW`` calls lie within
  ``SETTLE_TOLERANCE`` of their median, and that median within the same tolerance of the
  ``SETTLE_WINDOW`` calls before them. A call that has not settled after ``MAX_WARMUP`` calls or
  ``WARMUP_BUDGET_MS`` of calls is timed anyway, with ``settled=False``.
- ``measure``: warm-up, then ``repeats`` timed calls in turns (the order rotating from one repeat
  to the next, so a burst of machine noise hits them all alike), their median, and peak memory.
- ``peak_memory_bytes``: the most memory a call held at once beyond what was allocated before it,
  measured, never computed from a formula:

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
    run. A device whose allocations the profiler does not report gets None.
- ``check_device`` and ``hardware``: where the numbers are measured, refused in one sentence when
  this machine or this build of PyTorch does not have it.
"""

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .arguments import check_positive_ints
from .device import default_device

MIB = 2 ** 20
BASELINE = "sdpa"          # the row every ratio divides by
SETTLE_WINDOW = 3          # calls compared to decide the times have settled
SETTLE_TOLERANCE = 0.25    # how far (a fraction of the median) a settled time may stray
MAX_WARMUP = 30            # warm-up calls at most, per call and length
WARMUP_BUDGET_MS = 2000.0  # warm-up time at most, per call and length
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


def check_positive_list(name: str, values: Sequence[int]) -> None:
    """ValueError unless ``values`` is a non-empty list of positive ints (bools are not)."""
    if not values or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in values):
        raise ValueError(f"{name} must be a non-empty list of positive ints, got {values!r}")



def check_sizes(seq_lens: Sequence[int], *, dtype: torch.dtype, **counts: int) -> None:
    """ValueError unless ``seq_lens`` is a non-empty list of positive ints, ``dtype`` a floating
    dtype and every one of ``counts`` (batch, heads, repeats...) a positive int."""
    check_positive_ints(**counts)
    check_positive_list("seq_lens", seq_lens)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")

# --- the device -------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    """Wait until every kernel queued on ``device`` has finished (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def free_cached(device: torch.device) -> None:
    """Give the memory that PyTorch's CUDA allocator keeps cached back to the device."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def describe_error(error: BaseException) -> str:
    """``"TypeName: first line"`` of an exception, at most 120 characters of it."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line[:120]}"


def _first_sentence(error: BaseException) -> str:
    first_line = (str(error).strip().splitlines() or [""])[0]
    return first_line.split(". ", 1)[0].rstrip(".")


def check_device(device) -> torch.device:
    """``torch.device(device)``, or a ``ValueError`` saying in one sentence why no tensor can be
    made there."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"not a device: {device!r} (try cpu, cuda, cuda:1 or mps)") from None
    if device.type == "cuda" and torch.version.cuda is None and torch.version.hip is None:
        raise ValueError(f"device {str(device)!r} is not available: this PyTorch "
                         f"({torch.__version__}) was built without CUDA")
    mps = getattr(torch.backends, "mps", None)
    if device.type == "mps" and (mps is None or not mps.is_available()):
        raise ValueError(f"device {str(device)!r} is not available: MPS needs a Mac with Apple "
                         f"silicon and a PyTorch built for it (this is {platform.system()}, "
                         f"torch {torch.__version__})")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, NotImplementedError) as error:  # torch raises any
        raise ValueError(f"device {str(device)!r} is not available: "
                         f"{type(error).__name__}: {_first_sentence(error)}") from None
    return device


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


# --- one call: its time and its peak memory -----------------------------------------------------


def time_call_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds that ``fn()`` takes on ``device``, synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def _peak_bytes_cuda(fn: Callable[[], object], device: torch.device) -> int:
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _peak_bytes_profiled(fn: Callable[[], object], device: torch.device) -> int | None:
    from torch.profiler import ProfilerActivity, profile

    # Kineto prints "profiler_start/stop" lines to stderr on every session unless told not to.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
        synchronize(device)
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


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Bytes ``fn()`` holds at its peak beyond what was allocated before; None if unmeasurable."""
    device = torch.device(device)
    if device.type == "cuda":
        return _peak_bytes_cuda(fn, device)
    return _peak_bytes_profiled(fn, device)


# --- warm-up until settled, then the median -----------------------------------------------------


def rotated(names: list, r: int) -> list:
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
    """How one call's warm-up went: the times of its untimed calls, and whether they settled."""

    times_ms: list[float]
    settled: bool

    @property
    def calls(self) -> int:
        return len(self.times_ms)


def warm_up(timed_calls: dict, *, max_calls: int = MAX_WARMUP,
            budget_ms: float = WARMUP_BUDGET_MS) -> dict:
    """Call each ``timed_calls[name]()`` (which returns its time in ms) in turns until it settles.

    A name stops when ``has_settled`` says its times have settled, after ``max_calls`` calls, once
    its calls add up to ``budget_ms``, or when its call returns None (it failed). Every name is
    called at least once. Returns name -> ``Warmup``.
    """
    times: dict = {name: [] for name in timed_calls}
    done: dict = {}
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


@dataclass
class Measured:
    """One call's measurements at one size (a successful one): its median time over ``kept``
    timed calls, its peak memory in MiB, and how its warm-up went."""

    time_ms: float
    peak_mib: float | None
    warmup: Warmup
    kept: int


def measure(calls: dict[str, Callable[[], Tensor]], device: torch.device, repeats: int,
            max_warmup: int = MAX_WARMUP) -> dict:
    """Warm each call up until its times settle, time them all in turns, then measure memory.

    Returns name -> ``Measured``, or name -> the error string when it raised.
    """
    errors: dict[str, str] = {}

    def attempt(name, how):
        try:
            return how(calls[name])
        except Exception as error:  # noqa: BLE001 -- any failure becomes that call's row
            errors[name] = describe_error(error)
            free_cached(device)
            return None

    def timed(name: str) -> float | None:
        return attempt(name, lambda call: time_call_ms(call, device))

    warmups = warm_up({name: (lambda name=name: timed(name)) for name in calls},
                      max_calls=max_warmup)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(repeats):
        for name in rotated([n for n in calls if n not in errors], r):
            elapsed = timed(name)
            if elapsed is not None:
                times[name].append(elapsed)
    peaks = {name: attempt(name, lambda call: peak_memory_bytes(call, device))
             for name in calls if name not in errors}
    return {name: errors[name] if name in errors else
            Measured(statistics.median(times[name]),
                     None if peaks[name] is None else peaks[name] / MIB,
                     warmups[name], len(times[name]))
            for name in calls}


# --- the rows of a comparison, and their table --------------------------------------------------


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


def rows_at(seq_len: int, results: dict, **common) -> list[BenchRow]:
    """``measure``'s results at one T as ``BenchRow``s, in their order, with ratios to the
    ``BASELINE`` row (None when it is missing or failed); ``common``: the fields they share."""
    base = results.get(BASELINE)
    base_time, base_mem = ((base.time_ms, base.peak_mib) if isinstance(base, Measured)
                           else (None, None))
    rows = []
    for name, result in results.items():
        if isinstance(result, str):
            rows.append(BenchRow(name, seq_len, None, None, None, None, result, **common))
            continue
        time_ratio = result.time_ms / base_time if base_time else None
        mem_ratio = (result.peak_mib / base_mem if result.peak_mib is not None and base_mem
                     else None)
        rows.append(BenchRow(name, seq_len, result.time_ms, result.peak_mib, time_ratio,
                             mem_ratio, None, **common, warmup_calls=result.warmup.calls,
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
