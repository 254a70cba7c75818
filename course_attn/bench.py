"""Time and peak memory of every attention backend, side by side: ``python -m course_attn.bench``.

For each sequence length T, every backend runs on the same q, k, v of shape (B, H, T, D), and the
backends take turns within each repeat (the order rotating from one repeat to the next), so a
burst of machine noise hits them all alike. Each row reports, for one (backend, T):

- ``time_ms``: the median of ``repeats`` timed calls, after one untimed warm-up call; on CUDA the
  device is synchronised before the clock is read, so the time is the kernels', not the launch's.
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
options) gets a row carrying the error instead of stopping the run.

Python: ``rows = run_bench(["math", "sdpa"], (256, 512)); print(format_table(rows))``.
"""

import argparse
import dataclasses
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

from .backends import BACKENDS, get_backend
from .device import default_device
from .masks import check_window

MIB = 2 ** 20
BASELINE = "sdpa"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


@dataclass
class BenchRow:
    """One backend at one sequence length. Times in milliseconds, memory in MiB (2**20 bytes)."""

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


def _check_options(seq_lens, batch, heads, head_dim, dtype, repeats, names) -> None:
    for name, n in (("batch", batch), ("heads", heads), ("head_dim", head_dim),
                    ("repeats", repeats)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if not seq_lens or any(isinstance(t, bool) or not isinstance(t, int) or t < 1
                           for t in seq_lens):
        raise ValueError(f"seq_lens must be a non-empty list of positive ints, got {seq_lens!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if not names:
        raise ValueError("no backend to benchmark")
    for name in names:
        get_backend(name)


def _measure(calls: dict[str, Callable[[], Tensor]], device: torch.device, repeats: int) -> dict:
    """Warm each call up, time them all in turns, then measure each one's peak memory.

    Returns name -> (median ms, peak MiB or None), or name -> the error string when it raised.
    """
    errors: dict[str, str] = {}

    def attempt(name, measure):
        try:
            return measure(calls[name])
        except Exception as error:  # noqa: BLE001 -- any failure becomes that backend's row
            errors[name] = _describe(error)
            _free_cached(device)
            return None

    for name in calls:
        attempt(name, lambda call: call())
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(repeats):
        for name in _rotated([n for n in calls if n not in errors], r):
            elapsed = attempt(name, lambda call: _time_call_ms(call, device))
            if elapsed is not None:
                times[name].append(elapsed)
    peaks = {name: attempt(name, lambda call: peak_memory_bytes(call, device))
             for name in calls if name not in errors}
    return {name: errors[name] if name in errors else
            (statistics.median(times[name]), None if peaks[name] is None else peaks[name] / MIB)
            for name in calls}


def run_bench(
    backends: Sequence[str] | None = None, seq_lens: Sequence[int] = (256, 512, 1024), *,
    batch: int = 1, heads: int = 8, head_dim: int = 64, dtype: torch.dtype = torch.float32,
    is_causal: bool = False, window: int | None = None, device=None, repeats: int = 5,
) -> list[BenchRow]:
    """Time and peak memory of each backend at each T, on q, k, v of shape (B, H, T, D).

    ``backends``: names in ``BACKENDS`` (default: every one registered when this is called).
    ``is_causal`` and ``window`` are passed to every backend. Returns one ``BenchRow`` per
    (T, backend), T-major, ratios taken to ``"sdpa"`` at the same T.
    """
    names = list(BACKENDS) if backends is None else list(dict.fromkeys(backends))
    seq_lens = list(seq_lens)
    _check_options(seq_lens, batch, heads, head_dim, dtype, repeats, names)
    check_window(window)
    device = default_device() if device is None else torch.device(device)
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
        results = _measure(calls, device, repeats)
        del q, k, v, calls
        _free_cached(device)
        base_time, base_mem = (results[BASELINE] if isinstance(results.get(BASELINE), tuple)
                               else (None, None))
        for name in names:
            if isinstance(results[name], str):
                rows.append(BenchRow(name, t, None, None, None, None, results[name], **common))
                continue
            time_ms, peak_mib = results[name]
            time_ratio = time_ms / base_time if base_time else None
            mem_ratio = peak_mib / base_mem if peak_mib is not None and base_mem else None
            rows.append(BenchRow(name, t, time_ms, peak_mib, time_ratio, mem_ratio, None, **common))
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: Sequence[BenchRow]) -> str:
    """The rows as a fixed-width text table: T, backend, time, peak memory, ratios to sdpa."""
    header = ("T", "backend", "time ms", f"x {BASELINE}", "peak MiB", f"x {BASELINE}")
    lines = []
    for row in rows:
        if row.error is not None:
            lines.append((str(row.seq_len), row.backend, f"failed: {row.error}"))
        else:
            lines.append((str(row.seq_len), row.backend, _fmt(row.time_ms, ".2f"),
                          _fmt(row.time_ratio, ".2f"), _fmt(row.peak_mib, ".2f"),
                          _fmt(row.mem_ratio, ".2f")))
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
        prog="python -m course_attn.bench",
        description="Time and peak memory of every attention backend, with ratios to 'sdpa'.")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024], metavar="T")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--window", type=int, default=None, metavar="W")
    p.add_argument("--backends", nargs="+", default=None, metavar="NAME",
                   help=f"default: every registered backend ({', '.join(BACKENDS)})")
    p.add_argument("--device", default=None, help="default: course_attn.default_device()")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, metavar="PATH", help="also write rows + hardware here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    device = default_device() if args.device is None else torch.device(args.device)
    start = time.perf_counter()
    try:
        rows = run_bench(args.backends, args.seq_lens, batch=args.batch, heads=args.heads,
                         head_dim=args.head_dim, dtype=DTYPES[args.dtype], is_causal=args.causal,
                         window=args.window, device=device, repeats=args.repeats)
    except ValueError as error:
        parser.error(str(error))
    elapsed = time.perf_counter() - start
    info = hardware(device)
    print(f"{info['device_name']} ({info['device']}), {info['cpu_count']} CPUs, "
          f"torch {info['torch']} | B={args.batch} H={args.heads} D={args.head_dim} "
          f"{args.dtype} causal={args.causal} window={args.window} repeats={args.repeats}")
    print(format_table(rows))
    print(f"({elapsed:.1f} s)")
    if args.json is not None:
        report = {"hardware": info, "elapsed_s": elapsed,
                  "rows": [dataclasses.asdict(row) for row in rows]}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
