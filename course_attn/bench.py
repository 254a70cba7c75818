"""Time and peak memory of every attention backend, side by side: ``python -m course_attn.bench``.

The one command line of the benchmarks: by default this module's ``run_bench``; with ``--decode``
``decode_bench``'s generation with and without a KV cache; with ``--linear`` ``linear_bench``'s
linear attention against SDPA. All three measure with ``timing`` (warm-up until the times settle,
interleaved rounds, ratios taken per round, peak memory measured; see there how), with
``--threads`` CPU threads (default 1: then a time is the processor time of that thread, which a
busy machine inflates far less than wall time).

For each sequence length T, every backend runs on the same q, k, v of shape (B, H, T, D), once in
each of ``repeats`` rounds, in an order that rotates from round to round. Each row reports, for
one (backend, T):

- ``time_ms``: the median of its time over the rounds (``kept`` says how many), made after the
  warm-up, the device synchronised before the clock is read; ``settled`` False and a ``*`` when
  the rounds' times spread more than ``timing.SPREAD_TOLERANCE``.
- ``time_ratio``: the median over rounds of its time over ``"sdpa"``'s in the same round, None
  (``withheld`` says why; the table says "not settled") when those ratios spread more than
  ``timing.SPREAD_TOLERANCE`` or were fewer than ``timing.MIN_ROUNDS``, or ``"sdpa"`` is not in
  the run or failed.
- ``warmup_calls`` and ``warmup_settled``: the untimed calls made first, until each backend's
  times settled (``timing.has_settled``), at most ``max_warmup`` or ``timing.WARMUP_BUDGET_MS``.
- ``peak_mib`` and ``mem_ratio``: the most memory the call held at once beyond what was allocated
  before it, measured (``timing.peak_memory_bytes``), and that over ``"sdpa"``'s.

A backend that raises at some T (out of memory, unsupported options) gets a row carrying the
error instead of stopping the run. A bad option, or a device that this machine or this build of
PyTorch does not have, is a ``ValueError`` before anything runs; on the command line every option
is checked, by the name it was typed with, before any timing: one line on stderr, exit status 2.

Python: ``rows = run_bench(["math", "sdpa"], (256, 512)); print(format_table(rows))``.
"""

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence

import torch

from .arguments import check_positive_ints
from .backends import BACKENDS, get_backend
from .decode_bench import main_decode
from .device import default_device
from .linear import FEATURE_MAPS
from .linear_bench import main_linear
from .masks import check_window
from .timing import (
    BASELINE, DTYPES, MAX_WARMUP, MIB, MIN_ROUNDS, SPREAD_TOLERANCE, WARMUP_BUDGET_MS, BenchRow,
    check_device, check_positive_list, check_sizes, format_table, free_cached, hardware,
    has_settled, measure, peak_memory_bytes, rows_at, torch_threads, warm_up,
)

# Names that notebooks and tests import from here; they live in ``timing``.
__all__ = ["BASELINE", "DTYPES", "MAX_WARMUP", "MIB", "BenchRow", "check_device", "format_table",
           "hardware", "has_settled", "main", "peak_memory_bytes", "run_bench", "warm_up"]

PROG = "python -m course_attn.bench"


def run_bench(
    backends: Sequence[str] | None = None, seq_lens: Sequence[int] = (256, 512, 1024), *,
    batch: int = 1, heads: int = 8, head_dim: int = 64, dtype: torch.dtype = torch.float32,
    is_causal: bool = False, window: int | None = None, device=None, repeats: int = 5,
    max_warmup: int = MAX_WARMUP, threads: int | None = 1,
) -> list[BenchRow]:
    """Time and peak memory of each backend at each T, on q, k, v of shape (B, H, T, D).

    ``backends``: names in ``BACKENDS`` (default: every one registered when this is called).
    ``is_causal`` and ``window`` are passed to every backend. Each backend is warmed up (at most
    ``max_warmup`` calls) until its times settle, then timed once in each of ``repeats`` rounds,
    with ``threads`` CPU threads (None: as set now). Returns one ``BenchRow`` per (T, backend),
    T-major, ratios taken per round to ``"sdpa"`` at the same T.
    ``ValueError`` for a bad option or a device that is not available.
    """
    names = list(BACKENDS) if backends is None else list(dict.fromkeys(backends))
    seq_lens = list(seq_lens)
    check_sizes(seq_lens, batch=batch, heads=heads, head_dim=head_dim, dtype=dtype,
                repeats=repeats, max_warmup=max_warmup)
    if threads is not None:
        check_positive_ints(threads=threads)
    if not names:
        raise ValueError("no backend to benchmark")
    for name in names:
        get_backend(name)
    check_window(window)
    device = default_device() if device is None else check_device(device)
    common = dict(batch=batch, heads=heads, head_dim=head_dim,
                  dtype=str(dtype).removeprefix("torch."), is_causal=bool(is_causal),
                  window=window, device=str(device), repeats=repeats,
                  threads=torch.get_num_threads() if threads is None else threads)
    rows: list[BenchRow] = []
    for t in seq_lens:
        generator = torch.Generator().manual_seed(t)
        q, k, v = (torch.randn(batch, heads, t, head_dim, generator=generator)
                   .to(device=device, dtype=dtype) for _ in range(3))
        calls = {name: (lambda fn=get_backend(name):
                        fn(q, k, v, is_causal=is_causal, window=window))
                 for name in names}
        results = measure(calls, device, repeats, max_warmup, threads=threads)
        del q, k, v, calls
        free_cached(device)
        rows += rows_at(t, results, **common)
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Time and peak memory of every attention backend on random q, k, v of shape "
                    "(B, H, T, D), with ratios to PyTorch's SDPA ('sdpa'). Each backend is "
                    "warmed up until its times settle, then timed once per round, the backends "
                    "taking turns; the table gives the median over the rounds, and a ratio only "
                    "where the rounds agree.",
        epilog="With --hf FOLDER instead: the course's generate against transformers' on a "
               "Hugging Face checkpoint (config.json + model.safetensors), tokens per second as "
               "a ratio; its options: python -m course_attn.bench --hf FOLDER --help.")
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
                   help="rounds after the warm-up, each timing every backend once; the time "
                        "shown is the median over rounds, a ratio the median of each round's "
                        f"ratio, withheld unless there are {MIN_ROUNDS} rounds or more and they "
                        f"agree within {SPREAD_TOLERANCE:g} (default: 5; with --decode, 3)")
    p.add_argument("--max-warmup", type=int, default=MAX_WARMUP, metavar="N",
                   help="untimed calls at most before timing, stopping sooner once the times "
                        f"settle or after {WARMUP_BUDGET_MS / 1000:g} s (default: %(default)s)")
    decode = p.add_argument_group(
        "decode", "With --decode: generation from the tiny GPT timed with and without a KV "
                  "cache, and one cache append at several cached lengths, instead of the "
                  "backends. Columns 'in place us' and 'torch.cat us': microseconds per append.")
    decode.add_argument("--decode", action="store_true",
                        help="run the decode benchmark (besides its own options below it uses "
                             "only --batch, --heads, --head-dim, --repeats, --device and --json, "
                             "and refuses the others) (default: off)")
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
                  "--seq-lens, and one decode step after several lengths, instead of the "
                  "backends. Columns 'linear us' and 'sdpa us': microseconds per decode step; "
                  "'x first': linear's step time over its own after the first --step-lens "
                  "(1.00 there; near 1 everywhere means a step costs the same however long the "
                  "text).")
    linear.add_argument("--linear", action="store_true",
                        help="run the linear-attention benchmark (besides its own options below "
                             "it uses only --seq-lens, --batch, --heads, --head-dim, --dtype, "
                             "--repeats, --max-warmup, --device and --json, and refuses the "
                             "others; it is always causal) (default: off)")
    linear.add_argument("--chunk-size", type=int, default=64, metavar="C",
                        help="tokens per chunk of the chunked form (default: %(default)s)")
    linear.add_argument("--feature-map", choices=FEATURE_MAPS, default="elu",
                        help="the feature map that linear attention applies to queries and "
                             "keys (default: %(default)s)")
    linear.add_argument("--step-lens", type=int, nargs="+", default=[512, 4096], metavar="L",
                        help="lengths after which one decode step is timed (default: 512 4096)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="CPU threads PyTorch may use while measuring; with 1 a CPU time is the "
                        "processor time of that thread, which other busy programs inflate far "
                        "less than wall time, used with more (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the rows and the hardware to this JSON file "
                        "(default: none)")
    return p


# What each benchmark reads from the command line (beside --device and --json, which all do).
USES = {
    "backends": {"seq_lens", "batch", "heads", "head_dim", "dtype", "causal", "window",
                 "backends", "repeats", "max_warmup"},
    "--decode": {"batch", "heads", "head_dim", "repeats", "new_tokens", "prompt_len",
                 "cache_lens", "model_backend"},
    "--linear": {"seq_lens", "batch", "heads", "head_dim", "dtype", "repeats", "max_warmup",
                 "chunk_size", "feature_map", "step_lens"},
}
_UNSET = object()


def _typed(dest: str, value) -> str:
    """The option for ``dest`` as the user typed it (``seq_lens`` -> ``--seq-lens``)."""
    if dest == "causal" and value is False:
        return "--no-causal"
    return "--" + dest.replace("_", "-")


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, dict]:
    """The options with their defaults filled in, and the ones typed: dest -> value."""
    parser = _parser()
    defaults = vars(parser.parse_args([]))
    args = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(defaults, _UNSET)))
    given = {dest: value for dest, value in vars(args).items() if value is not _UNSET}
    for dest, value in defaults.items():
        if dest not in given:
            setattr(args, dest, value)
    return args, given


def _check_args(args: argparse.Namespace, given: dict) -> str:
    """The benchmark the options ask for, or a ``ValueError`` naming the first bad option as it
    was typed; nothing is timed before this returns. Fills in ``args.repeats``."""
    if args.decode and args.linear:
        raise ValueError("--linear and --decode are two benchmarks: give one of them")
    mode = "--decode" if args.decode else "--linear" if args.linear else "backends"
    unused = [_typed(dest, value) for dest, value in given.items()
              if dest not in USES[mode] | {"decode", "linear", "device", "json", "threads"}]
    if unused:
        what = ("the backends benchmark (no --decode or --linear)" if mode == "backends"
                else mode)
        raise ValueError(f"{what} does not use {', '.join(unused)}")
    if args.repeats is None:
        args.repeats = 3 if mode == "--decode" else 5
    counts = {dest: getattr(args, dest) for dest in ("batch", "heads", "head_dim", "repeats",
                                                      "max_warmup", "prompt_len", "chunk_size")
              if dest in USES[mode]}
    counts["threads"] = args.threads
    check_positive_ints(**{_typed(dest, n): n for dest, n in counts.items()})
    if mode == "backends" and args.window is not None:
        check_positive_ints(**{"--window": args.window})
    for dest in ("seq_lens", "new_tokens", "cache_lens", "step_lens"):
        if dest in USES[mode]:
            check_positive_list(_typed(dest, None), getattr(args, dest))
    if mode == "backends":
        for name in args.backends or ():
            get_backend(name)
    return mode


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: print the table (and write the JSON); 2 and a one-line error if bad."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(arg == "--hf" or arg.startswith("--hf=") for arg in argv):   # a checkpoint's models
        from .hf_bench import main as main_hf
        return main_hf(argv)
    args, given = _parse(argv)
    try:
        mode = _check_args(args, given)
        device = default_device() if args.device is None else check_device(args.device)
    except ValueError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:    # the functions check again, by their Python names: a check missed above still ends
        with torch_threads(args.threads):   # in one line
            if mode == "--linear":
                text, report = main_linear(args, device)
            elif mode == "--decode":
                text, report = main_decode(args, device)
            else:
                rows = run_bench(args.backends, args.seq_lens, batch=args.batch,
                                 heads=args.heads, head_dim=args.head_dim,
                                 dtype=DTYPES[args.dtype], is_causal=args.causal,
                                 window=args.window, device=device, repeats=args.repeats,
                                 max_warmup=args.max_warmup, threads=args.threads)
    except ValueError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    info = {**hardware(device), "torch_threads": args.threads}
    if mode != "backends":
        print(f"{info['device_name']} ({info['device']}), {info['cpu_count']} CPUs, "
              f"torch {info['torch']}")
        print(text)
        report = {"hardware": info, "elapsed_s": elapsed, **report}
        return _write_json(args.json, report)
    print(f"{info['device_name']} ({info['device']}), {info['cpu_count']} CPUs, "
          f"torch {info['torch']} | B={args.batch} H={args.heads} D={args.head_dim} "
          f"{args.dtype} causal={args.causal} window={args.window} repeats={args.repeats} "
          f"threads={args.threads}")
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
