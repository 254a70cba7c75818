"""How the benchmarks measure: warm-up until settled, interleaved rounds, ratios per round, peak
memory, the device.

The three benchmarks (``bench``: the attention backends, ``linear_bench``, ``decode_bench``) time
and measure with these, and print their comparisons with ``BenchRow`` and ``format_table``:

- ``time_call_ms``: one call's time. On a CPU that PyTorch runs on one thread (``torch_threads``)
  it is the processor time the process spent (``time.process_time``): what the call cost, without
  the time the operating system gave to other programs, so a busy machine inflates it far less
  than a wall clock. With more threads, and on a GPU, it is wall time (``time.perf_counter``),
  the device synchronised before the clock is read, so on CUDA the time is the kernels', not the
  launch's. The processor time of several threads would count the time they spend waiting for
  each other, and a busy machine makes them wait: on the 2-core machine the book is built on,
  with other work running, flash at T = 2048 took 1.2 s per call on 2 threads, and 31 s beside
  four busy processes; on one thread it took 0.11 s of processor time in both.
- ``warm_up`` and ``has_settled``: the first calls at a new shape can be far slower than the rest
  (on a 2-core CPU the first five took 60-96 ms, later ones 1.5 ms), so calls are made in turns,
  and thrown away, until each one's times settle: the last ``SETTLE_WINDOW`` calls lie within
  ``SETTLE_TOLERANCE`` of their median, and that median within the same tolerance of the
  ``SETTLE_WINDOW`` calls before them. A call that has not settled after ``MAX_WARMUP`` calls or
  ``WARMUP_BUDGET_MS`` of calls is timed anyway (the rounds then say whether its times agree).
- ``measure``: warm-up, then ``repeats`` rounds; each round calls every name once, in an order
  that rotates from round to round, and divides each name's time by the ``BASELINE``'s time in
  the same round. A load that comes and goes then hits every name of a round alike, and the
  round's ratio keeps its value. The reported ratio is the median of the per-round ratios.
- ``spread`` and ``rounds_agree``: whether a series over rounds (the times, or the ratios) has
  settled: at least ``MIN_ROUNDS`` values, and their interquartile range at most
  ``SPREAD_TOLERANCE`` of their median. ``rows_at`` withholds a ratio whose rounds do not agree
  (``time_ratio`` None, ``withheld`` says why: ``NOT_SETTLED``), and ``format_table`` prints
  "not settled" in its place; a time whose rounds do not agree is marked ``*``.
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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
MIN_ROUNDS = 3             # rounds needed before their spread can say anything
SPREAD_TOLERANCE = 0.15    # the most a settled series may spread: interquartile range / median
NOT_SETTLED = "not settled on this machine: run it again"
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


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` CPU threads for PyTorch's operators (None: as set now),
    and give the setting back afterwards."""
    before = torch.get_num_threads()
    if threads is not None:
        check_positive_ints(threads=threads)
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def clock_name(device: torch.device) -> str:
    """``"processor"`` where ``time_call_ms`` reads the process's processor time (a CPU that
    PyTorch runs on one thread), ``"wall"`` elsewhere."""
    one_thread = torch.device(device).type == "cpu" and torch.get_num_threads() == 1
    return "processor" if one_thread else "wall"


def time_call_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds that ``fn()`` takes on ``device``, synchronised before and after: processor
    time on a CPU running one thread, wall time elsewhere (``clock_name``)."""
    clock = time.process_time if clock_name(device) == "processor" else time.perf_counter
    synchronize(device)
    start = clock()
    fn()
    synchronize(device)
    return (clock() - start) * 1e3


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


def spread(values: Sequence[float]) -> float | None:
    """The interquartile range of ``values`` over their median (0.1: the middle half lies within
    10% of the median); None with fewer than ``MIN_ROUNDS`` values, or a median of 0."""
    if len(values) < MIN_ROUNDS:
        return None
    middle = statistics.median(values)
    if middle == 0:
        return None
    first, _, third = statistics.quantiles(values, n=4, method="inclusive")
    return (third - first) / middle


def rounds_agree(values: Sequence[float], tolerance: float = SPREAD_TOLERANCE) -> bool:
    """Whether a series over rounds has settled: ``spread`` is known and at most ``tolerance``."""
    width = spread(values)
    return width is not None and width <= tolerance


@dataclass
class Measured:
    """One call's measurements at one size (a successful one).

    ``times_ms``: its time in each round it ran (``kept`` of them), ``time_ms`` their median;
    ``round_ratios``: its time over the baseline's in each round where both ran (None when the
    baseline was not measured); ``clock``: ``"processor"`` or ``"wall"`` (``clock_name``);
    ``peak_mib``: its peak memory; ``warmup``: how its warm-up went.
    """

    time_ms: float
    peak_mib: float | None
    warmup: Warmup
    kept: int
    times_ms: list[float] | None = None
    round_ratios: list[float] | None = None
    clock: str | None = None


def measure(calls: dict[str, Callable[[], Tensor]], device: torch.device, repeats: int,
            max_warmup: int = MAX_WARMUP, *, baseline: str = BASELINE,
            threads: int | None = None) -> dict:
    """Warm each call up until its times settle, time them in ``repeats`` interleaved rounds,
    then measure memory; all of it with ``threads`` CPU threads (None: as set now).

    Each round calls every name once, in an order that rotates from round to round, and each
    name's time in a round is divided by ``baseline``'s time in the same round. Returns name ->
    ``Measured``, or name -> the error string when it raised.
    """
    with torch_threads(threads):
        return _measure(calls, torch.device(device), repeats, max_warmup, baseline)


def _measure(calls, device, repeats, max_warmup, baseline) -> dict:
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
    ratios: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(repeats):
        this_round = {}
        for name in rotated([n for n in calls if n not in errors], r):
            elapsed = timed(name)
            if elapsed is not None:
                this_round[name] = elapsed
                times[name].append(elapsed)
        if this_round.get(baseline):
            for name, elapsed in this_round.items():
                ratios[name].append(elapsed / this_round[baseline])
    peaks = {name: attempt(name, lambda call: peak_memory_bytes(call, device))
             for name in calls if name not in errors}
    has_baseline = baseline in calls and baseline not in errors
    clock = clock_name(device)
    return {name: errors[name] if name in errors else
            Measured(statistics.median(times[name]),
                     None if peaks[name] is None else peaks[name] / MIB,
                     warmups[name], len(times[name]), times[name],
                     ratios[name] if has_baseline else None, clock)
            for name in calls}


# --- the rows of a comparison, and their table --------------------------------------------------


@dataclass
class BenchRow:
    """One backend at one sequence length. Times in milliseconds, memory in MiB (2**20 bytes).

    ``time_ms``: the median of its time over the rounds (``kept`` of the ``repeats`` asked for),
    on the ``clock`` that ``timing.clock_name`` names; ``time_spread``: their interquartile range
    over that median, and ``settled`` whether it is within ``SPREAD_TOLERANCE`` (``rounds_agree``).
    ``time_ratio``: the median over rounds of its time over the baseline's in the same round, or
    None when it is withheld: ``withheld`` then says why (the rounds' ratios did not agree, their
    ``ratio_spread``, or no baseline). ``warmup_calls`` and ``warmup_settled``: how the warm-up
    before the rounds went. ``threads``: CPU threads PyTorch ran on. Fields after ``repeats`` are
    None on a failed row.
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
    time_spread: float | None = None
    ratio_spread: float | None = None
    withheld: str | None = None
    warmup_settled: bool | None = None
    clock: str | None = None
    threads: int | None = None


def withheld_ratio(ratios: Sequence[float] | None) -> tuple[float | None, str | None]:
    """The ratio to report from per-round ``ratios`` (their median) and None, or None and why it
    is withheld: no baseline in the rounds, or rounds that do not agree (``NOT_SETTLED``)."""
    if not ratios:
        return None, f"no {BASELINE} in the same rounds"
    if not rounds_agree(ratios):
        width = spread(ratios)
        why = (f"{len(ratios)} rounds, fewer than {MIN_ROUNDS}" if width is None
               else f"spread {width:.2f} over {len(ratios)} rounds, above {SPREAD_TOLERANCE}")
        return None, f"{NOT_SETTLED} ({why})"
    return statistics.median(ratios), None


def timed_rounds(time_of: Callable[[object], float], keys: Sequence, repeats: int) -> list[dict]:
    """``repeats`` rounds, each timing every key once (``time_of(key)``), in an order that rotates
    from round to round -> one {key: time} per round."""
    return [{key: time_of(key) for key in rotated(list(keys), r)} for r in range(repeats)]


def round_median(rounds: Sequence[dict], key) -> float:
    """The median over ``timed_rounds``' rounds of ``key``'s time."""
    return statistics.median(r[key] for r in rounds)


def ratio_over_rounds(rounds: Sequence[dict], key, reference) -> tuple[float | None, str | None]:
    """``key``'s time over ``reference``'s in the same round, reported as ``withheld_ratio``
    reports it (the median over rounds, or None and why); 1.0 when ``key`` is ``reference``."""
    if key == reference:
        return 1.0, None
    return withheld_ratio([r[key] / r[reference] for r in rounds])


def rows_at(seq_len: int, results: dict, **common) -> list[BenchRow]:
    """``measure``'s results at one T as ``BenchRow``s, in their order, with ratios to the
    ``BASELINE`` row: the median of the per-round ratios, withheld unless the rounds agree (the
    baseline's own ratio is 1 by definition); ``common``: the fields they share."""
    base = results.get(BASELINE)
    base_mem = base.peak_mib if isinstance(base, Measured) else None
    rows = []
    for name, result in results.items():
        if isinstance(result, str):
            rows.append(BenchRow(name, seq_len, None, None, None, None, result, **common))
            continue
        if name == BASELINE:
            time_ratio, withheld = 1.0, None
        else:
            time_ratio, withheld = withheld_ratio(result.round_ratios)
        mem_ratio = (result.peak_mib / base_mem if result.peak_mib is not None and base_mem
                     else None)
        times = result.times_ms or [result.time_ms]
        rows.append(BenchRow(
            name, seq_len, result.time_ms, result.peak_mib, time_ratio, mem_ratio, None,
            **common, warmup_calls=result.warmup.calls, settled=rounds_agree(times),
            kept=result.kept, time_spread=spread(times),
            ratio_spread=spread(result.round_ratios or []), withheld=withheld,
            warmup_settled=result.warmup.settled, clock=result.clock))
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


def _ratio_cell(row: BenchRow) -> str:
    if row.time_ratio is None and row.withheld is not None and row.withheld.startswith(NOT_SETTLED):
        return "not settled"
    return _fmt(row.time_ratio, ".2f")


def format_table(rows: Sequence[BenchRow]) -> str:
    """The rows as a fixed-width text table.

    Columns: T, backend, time (the median over rounds), its ratio to sdpa (the median of the
    per-round ratios) and that ratio's spread over the rounds, peak memory, its ratio to sdpa,
    how many rounds the median was kept over, and how many warm-up calls came before them. A
    withheld ratio reads "not settled", a time whose rounds did not agree is marked ``*``, each
    with a note under the table, and a line says which clock the times are on.
    """
    header = ("T", "backend", "time ms", f"x {BASELINE}", "spread", "peak MiB", f"x {BASELINE}",
              "kept", "warm-up")
    lines = []
    for row in rows:
        if row.error is not None:
            lines.append((str(row.seq_len), row.backend, f"failed: {row.error}"))
        else:
            mark = "*" if row.settled is False else ""
            lines.append((str(row.seq_len), row.backend, _fmt(row.time_ms, ".2f") + mark,
                          _ratio_cell(row), _fmt(row.ratio_spread, ".2f"),
                          _fmt(row.peak_mib, ".2f"), _fmt(row.mem_ratio, ".2f"),
                          _count(row.kept), _count(row.warmup_calls)))
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
    notes = []
    clocks = sorted({row.clock for row in rows if row.error is None and row.clock})
    if clocks:
        notes += ["time: " + " and ".join("processor time on one CPU thread" if c == "processor"
                                          else "wall time" for c in clocks)
                  + ", the median over rounds",
                  f"x {BASELINE}: the median of each round's ratio; spread: their interquartile "
                  "range / median"]
    if any(row.error is None and row.withheld and row.withheld.startswith(NOT_SETTLED)
           for row in rows):
        notes.append(f"not settled: spread above {SPREAD_TOLERANCE}, or fewer than {MIN_ROUNDS} "
                     f"rounds: {NOT_SETTLED}")
    if any(row.error is None and row.settled is False for row in rows):
        notes.append(f"* the rounds' times spread above {SPREAD_TOLERANCE}: a rough time")
    return "\n".join(out + ([""] + notes if notes else []))
