"""Execute every notebook of the book on a busy machine, and say how close each came to a timeout.

A reader's laptop, a shared CI runner or Colab is a busy machine. This runs ``--busy`` processes
that spin beside the notebooks (two by default, like `stress --cpu 2`), executes each notebook
of the book with nbclient exactly as `make book` does (in its own folder, the per-cell timeout of
``_config.yml``), and times every cell. It fails when a notebook raises, or when a cell took more
than a third of the timeout: then a machine three times slower than this busy one would time out.

    .venv/bin/python .ci/book_under_load.py                 # every notebook of _toc.yml
    .venv/bin/python .ci/book_under_load.py --busy 0 book/05_rope.ipynb
    make book-under-load
"""

import argparse
import multiprocessing
import sys
import time
from datetime import datetime
from pathlib import Path

import nbformat
import yaml
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def spin() -> None:
    while True:
        pass


def book_notebooks() -> list[Path]:
    """The notebooks of _toc.yml, in the book's order."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = []

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                files.append(node["file"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(toc)
    return [ROOT / f"{f}.ipynb" for f in files if (ROOT / f"{f}.ipynb").exists()]


def cell_seconds(cell) -> float:
    timing = cell.get("metadata", {}).get("execution", {})
    begin, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
    if not (begin and end):
        return 0.0
    parse = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
    return (parse(end) - parse(begin)).total_seconds()


def run(path: Path, timeout: int) -> tuple[float, int, float]:
    """Executes one notebook; returns (seconds, index of its slowest cell, that cell's seconds)."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=True,
                            resources={"metadata": {"path": str(path.parent)}})
    begin = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - begin
    per_cell = [(cell_seconds(c), i) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    slowest, index = max(per_cell, default=(0.0, -1))
    return seconds, index, slowest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebook of _toc.yml")
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside (default 2)")
    parser.add_argument("--timeout", type=int, help="per-cell timeout (default: _config.yml's)")
    args = parser.parse_args(argv)
    if args.busy < 0:
        parser.error(f"--busy must be >= 0, got {args.busy}")
    if args.timeout is not None and args.timeout < 1:
        parser.error(f"--timeout must be >= 1 second, got {args.timeout}")
    timeout = args.timeout or yaml.safe_load((ROOT / "_config.yml").read_text())["execute"]["timeout"]
    notebooks = [p.resolve() for p in args.notebooks] or book_notebooks()

    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for process in busy:
        process.start()
    failures, start = [], time.perf_counter()
    print(f"{len(notebooks)} notebooks, {args.busy} busy processes beside them, "
          f"per-cell timeout {timeout} s; a cell over {timeout / 3:.0f} s fails")
    print(f"{'notebook':<38} {'seconds':>8} {'slowest cell':>13} {'its seconds':>12}")
    try:
        for path in notebooks:
            name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
            try:
                seconds, index, slowest = run(path, timeout)
            except Exception as error:  # a cell raised or timed out: report it, go on
                failures.append(f"{name}: {type(error).__name__}: {str(error)[-300:]}")
                print(f"{name:<38} {'failed':>8}")
                continue
            mark = "  <- over a third of the timeout" if slowest > timeout / 3 else ""
            print(f"{name:<38} {seconds:>8.1f} {index:>13} {slowest:>12.1f}{mark}", flush=True)
            if mark:
                failures.append(f"{name}: cell {index} took {slowest:.0f} s of the {timeout} s "
                                f"timeout; a machine three times slower would time out")
    finally:
        for process in busy:
            process.terminate()
    print(f"all notebooks in {time.perf_counter() - start:.0f} s")
    for failure in failures:
        print("FAILED", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
