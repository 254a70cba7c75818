"""Everything that needs a CUDA GPU, in one command: ``python -m course_attn.gpu_check``
(``make gpu-check``), one report.

GPU time is short when a machine is lent, so the check is prepared here and runs without a
question asked. Each part is a process of its own, with a time budget it cannot overrun (it is
killed, and the report says so), so that no part can cost the whole report:

    tests    the package's tests on CUDA: the device-parametrised suite, ``-k cuda``
    triton   the Triton kernel's tests and chapter 9's Triton exercise, compiled (no interpreter)
    grader   the grader's sandbox grading chapter 9's solutions, with the GPU bound in it
    nbval    chapters 8-11 under nbval; their experiments use ``default_device()``, so CUDA
    bench    TFLOP/s of SDPA's backends (flash, efficient, cuDNN), the course's ``flash`` and
             the Triton kernel, bf16, D = 64 and 128, T from 1K to 16K, causal and not
    decode   ``python -m course_attn.bench --decode``: generation with and without the KV cache

It uses the Python that runs it (``sys.executable``) and so that machine's own torch; the working
tree only needs to be importable (``PYTHONPATH=.``, which ``make gpu-check`` sets). A part whose
modules or programs are missing there is skipped with the reason, never failed.

The report is written to ``--out`` (default: ``$OUT`` when set, else ``gpu-report/``) as
``gpu-report.md`` and ``gpu-report.json``, with each part's command, status, time, a summary of
its figures and the tail of its output; every part's full output is kept beside them.

On a machine without CUDA it prints one line saying so and exits 0 (``--cpu`` runs the parts
anyway with the GPU ones skipped, which is how its report is tested).
"""

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOTAL_BUDGET_S = 480          # the whole check: 8 minutes
TAIL_CHARS = 2000             # of each part's output, in the report

# The test modules whose tests take the ``device`` fixture (tests/conftest.py): with -k cuda,
# their CUDA cases.
DEVICE_TEST_MODULES = (
    "test_attention", "test_backends", "test_bench", "test_decode", "test_decode_bench",
    "test_delta_rule", "test_flash", "test_kv_cache", "test_linear", "test_linear_bench",
    "test_local", "test_masks", "test_mla", "test_model", "test_multihead", "test_norm",
    "test_paged", "test_rolling_cache", "test_rope", "test_serve",
)
NBVAL_CHAPTERS = ("08_kv_cache", "09_flash_attention", "10_linear_attention",
                  "11_local_attention")

# The bench part's grid (bf16): batch and heads as in TOOLING.md's H100 figures.
BENCH_BATCH, BENCH_HEADS = 4, 16
BENCH_HEAD_DIMS = (64, 128)
BENCH_SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of the check: a command run in ``ROOT`` with a time budget.

    ``needs_modules`` / ``needs_programs``: what must be importable / on PATH, else skipped.
    ``junit``: the JUnit XML file (in the output folder) that a pytest part writes, for counts.
    ``figures``: the JSON file (in the output folder) that the part writes with its figures.
    """

    name: str
    title: str
    command: tuple[str, ...]
    budget_s: float
    needs_cuda: bool = True
    needs_modules: tuple[str, ...] = ()
    needs_programs: tuple[str, ...] = ()
    junit: str | None = None
    figures: str | None = None


def default_parts(out: Path, python: str = sys.executable) -> list[Part]:
    """The six parts, in the order they run; their budgets add up to ``TOTAL_BUDGET_S``."""
    pytest = (python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=")
    tests = tuple(f"tests/{name}.py" for name in DEVICE_TEST_MODULES)
    return [
        Part("tests", "the package's tests on CUDA",
             (*pytest, *tests, "-k", "cuda", f"--junitxml={out / 'tests.xml'}"), 120,
             needs_modules=("pytest", "hypothesis"), junit="tests.xml"),
        Part("triton", "the Triton kernel and chapter 9's Triton exercise, compiled",
             (*pytest, "tests/test_triton_flash.py", "tests/test_checks_ch09.py", "-k", "triton",
              f"--junitxml={out / 'triton.xml'}"), 60,
             needs_modules=("pytest", "hypothesis", "triton"), junit="triton.xml"),
        Part("grader", "the grader's sandbox grading chapter 9's solutions, GPU bound",
             (python, "-m", "course_attn.grade", "solutions/09_flash_attention.ipynb",
              "--workers", "1", "--json", str(out / "grader.json")), 60,
             needs_modules=("nbclient", "ipykernel"), needs_programs=("bwrap",),
             figures="grader.json"),
        Part("nbval", "chapters 8-11 under nbval on CUDA",
             (*pytest, "--nbval-lax", "--nbval-current-env",
              *(f"book/{chapter}.ipynb" for chapter in NBVAL_CHAPTERS),
              f"--junitxml={out / 'nbval.xml'}"), 120,
             needs_modules=("pytest", "nbval", "ipykernel", "matplotlib"), junit="nbval.xml"),
        Part("bench", "TFLOP/s: SDPA's backends, 'flash' and the Triton kernel, bf16",
             (python, "-m", "course_attn.gpu_check", "--bench-only", str(out / "bench.json")),
             90, figures="bench.json"),
        Part("decode", "decode with and without the KV cache",
             (python, "-m", "course_attn.bench", "--decode", "--device", "cuda",
              "--json", str(out / "decode.json")), 30, figures="decode.json"),
    ]


def missing(part: Part, cuda: bool) -> str | None:
    """Why ``part`` cannot run here, or None."""
    if part.needs_cuda and not cuda:
        return "no CUDA device here"
    absent = [m for m in part.needs_modules if importlib.util.find_spec(m) is None]
    absent += [p for p in part.needs_programs if shutil.which(p) is None]
    return f"not installed here: {', '.join(absent)}" if absent else None


def run_part(part: Part, out: Path, budget_s: float, cuda: bool) -> dict:
    """Run ``part`` for at most ``budget_s`` seconds; its result as a dict for the report."""
    result = {"name": part.name, "title": part.title, "command": " ".join(part.command),
              "budget_s": round(budget_s), "seconds": 0.0, "returncode": None, "summary": "",
              "tail": ""}
    reason = missing(part, cuda) or (None if budget_s >= 1 else "no time left in the budget")
    if reason:
        return {**result, "status": "skipped", "summary": reason}
    log = out / f"{part.name}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    env.pop("TRITON_INTERPRET", None)  # compiled kernels: the point of a GPU run
    start = time.monotonic()
    with open(log, "wb") as sink:
        process = subprocess.Popen(part.command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            returncode = process.wait(timeout=budget_s)
            status = "passed" if returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)  # the part's children too (a kernel, a pytest worker)
            returncode = process.wait()
            status = "timed out"
    output = log.read_text(errors="replace")
    summary = summarise(part, out)
    if status == "timed out":
        summary = f"stopped at its budget of {budget_s:.0f} s" + (f"; {summary}" if summary else "")
    return {**result, "status": status, "returncode": returncode,
            "seconds": round(time.monotonic() - start, 1), "summary": summary,
            "tail": output[-TAIL_CHARS:], "log": log.name}


def summarise(part: Part, out: Path) -> str:
    """One line of what the part found: test counts from its JUnit XML, or its figures."""
    if part.junit and (out / part.junit).exists():
        return junit_counts(out / part.junit)
    if part.figures and (out / part.figures).exists():
        data = _read_figures(part, out)
        if data is None:
            return f"{part.figures} is not JSON"
        if part.name == "grader":
            return "; ".join(
                f"{Path(str(entry.get('path'))).name}: {entry.get('total')} / {entry.get('max')}"
                + (f", flagged: {'; '.join(entry['flags'])}" if entry.get("flags") else "")
                + (f", error: {entry['error']}" if entry.get("error") else "")
                for entry in data.get("notebooks", [])) or "no notebook graded"
        return f"{len(data.get('rows', []))} rows in {part.figures}"
    return ""


def junit_counts(path: Path) -> str:
    """'N passed, N failed, N skipped' (and errors) from a pytest JUnit XML file."""
    try:
        root = ElementTree.parse(path).getroot()
    except ElementTree.ParseError:
        return f"{path.name} is not readable XML"
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {key: sum(int(s.get(key, 0)) for s in suites)
             for key in ("tests", "failures", "errors", "skipped")}
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    line = f"{passed} passed, {total['failures']} failed, {total['skipped']} skipped"
    return line + (f", {total['errors']} errors" if total["errors"] else "")


def run_check(parts: list[Part], out: Path, *, cuda: bool,
              total_budget_s: float = TOTAL_BUDGET_S) -> dict:
    """Run ``parts`` in order, each within its own budget and what is left of the total; write
    ``gpu-report.md`` and ``gpu-report.json`` to ``out`` and return the report."""
    from .timing import hardware

    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    results = []
    for part in parts:
        left = total_budget_s - (time.monotonic() - start)
        results.append(run_part(part, out, min(part.budget_s, left), cuda))
    report = {"hardware": hardware("cuda" if cuda else "cpu"),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "seconds": round(time.monotonic() - start, 1), "parts": results,
              "figures": {part.name: figures for part in parts
                          if (figures := _read_figures(part, out)) is not None}}
    (out / "gpu-report.json").write_text(json.dumps(report, indent=2))
    (out / "gpu-report.md").write_text(markdown(report))
    return report


def _read_figures(part: Part, out: Path) -> dict | None:
    """The JSON file of figures that ``part`` wrote, or None (it has none, wrote none, or wrote
    something that is not JSON)."""
    if not part.figures or not (out / part.figures).exists():
        return None
    try:
        return json.loads((out / part.figures).read_text())
    except ValueError:
        return None


def markdown(report: dict) -> str:
    """The report as Markdown: the machine, one row per part, the bench's table, each command."""
    hw = report["hardware"]
    lines = ["# GPU check", "",
             f"{hw['device_name']} · torch {hw['torch']} (CUDA {hw['cuda']}) · Python "
             f"{hw['python']} · {report['date']} · {report['seconds']:.0f} s in all", "",
             "| part | status | time | summary |", "|---|---|---|---|"]
    for r in report["parts"]:
        lines.append(f"| {r['name']}: {r['title']} | {r['status']} | {r['seconds']:.0f} s "
                     f"of {r['budget_s']} | {r['summary']} |")
    bench = report["figures"].get("bench", {}).get("rows", [])
    if bench:
        names = bench_names(bench)
        lines += ["", "## TFLOP/s, bf16 "
                  f"(B = {BENCH_BATCH}, H = {BENCH_HEADS}; forward; median of interleaved calls)",
                  "", "| D | causal | T | " + " | ".join(names) + " |",
                  "|---|---|---|" + "---|" * len(names)]
        for key, row in group_bench(bench).items():
            cells = [_tflops(row.get(name)) for name in names]
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    lines += ["", "## Commands", ""]
    for r in report["parts"]:
        lines += [f"- **{r['name']}** ({r['status']}): `{r['command']}`"]
    failed = [r for r in report["parts"] if r["status"] in ("failed", "timed out")]
    for r in failed:
        lines += ["", f"## {r['name']}: the end of its output", "", "```", r["tail"].rstrip(),
                  "```"]
    return "\n".join(lines) + "\n"


def bench_names(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(row["backend"] for row in rows))


def group_bench(rows: list[dict]) -> dict:
    grouped: dict = {}
    for row in rows:
        grouped.setdefault((row["head_dim"], row["causal"], row["seq_len"]), {})[
            row["backend"]] = row
    return grouped


def _tflops(row: dict | None) -> str:
    if row is None:
        return "–"
    if row.get("error"):
        return "error"
    return f"{row['tflops']:.0f}" + ("" if row.get("settled", True) else "*")


# --- the bench part: TFLOP/s on the GPU -------------------------------------------------------


def bench_calls(q, k, v, is_causal: bool) -> dict:
    """name -> a call of one attention forward on (q, k, v): each SDPA backend pinned, the
    course's ``flash`` and, where registered, ``triton``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    from .backends import BACKENDS

    def pinned(backend):
        def call():
            with sdpa_kernel(backend):
                return scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return call

    calls = {f"sdpa-{name.split('_')[0].lower()}": pinned(getattr(SDPBackend, name))
             for name in SDPA_BACKENDS if hasattr(SDPBackend, name)}
    for name in ("flash", "triton"):
        if name in BACKENDS:
            calls[name] = (lambda fn=BACKENDS[name]: fn(q, k, v, is_causal=is_causal))
    return calls


def run_bench(path: Path, seq_lens=BENCH_SEQ_LENS, head_dims=BENCH_HEAD_DIMS) -> None:
    """Measure every call of ``bench_calls`` over the grid, writing ``path`` after each point, so
    that a part stopped at its budget keeps what it measured."""
    import torch

    from .timing import hardware, measure
    from .triton_flash import attention_flops

    device = torch.device("cuda")
    rows: list[dict] = []
    for head_dim in head_dims:
        for is_causal in (False, True):
            for t in seq_lens:
                g = torch.Generator(device=device).manual_seed(0)
                q, k, v = (torch.randn(BENCH_BATCH, BENCH_HEADS, t, head_dim, device=device,
                                       dtype=torch.bfloat16, generator=g) for _ in range(3))
                flops = attention_flops(BENCH_BATCH, BENCH_HEADS, t, t, head_dim, is_causal)
                with torch.no_grad():
                    measured = measure(bench_calls(q, k, v, is_causal), device, repeats=5,
                                       max_warmup=10)
                for name, m in measured.items():
                    row = {"backend": name, "head_dim": head_dim, "causal": is_causal,
                           "seq_len": t}
                    if isinstance(m, str):
                        row["error"] = m
                    else:
                        row.update(time_ms=m.time_ms, tflops=flops / (m.time_ms * 1e-3) / 1e12,
                                   settled=m.warmup.settled, kept=m.kept)
                    rows.append(row)
                del q, k, v
                path.write_text(json.dumps({"hardware": hardware(device), "rows": rows},
                                           indent=2))


def default_out() -> Path:
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "gpu-report"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_attn.gpu_check",
        description="Everything that needs a CUDA GPU, each part within its time budget "
                    f"({TOTAL_BUDGET_S} s in all), into one report (Markdown and JSON).")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the report (default: $OUT when set, else gpu-report/)")
    parser.add_argument("--parts", nargs="+", metavar="NAME",
                        help="run only these parts (default: all: "
                             f"{' '.join(p.name for p in default_parts(Path('.')))})")
    parser.add_argument("--cpu", action="store_true",
                        help="without CUDA, write the report anyway, every GPU part skipped")
    parser.add_argument("--bench-only", type=Path, metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if args.bench_only:
        run_bench(args.bench_only)
        return 0
    if not cuda and not args.cpu:
        print(f"gpu_check: no CUDA device on this machine (torch {torch.__version__}): "
              "nothing to check here; run it where there is an NVIDIA GPU")
        return 0
    out = args.out or default_out()
    parts = default_parts(out)
    if args.parts:
        unknown = sorted(set(args.parts) - {p.name for p in parts})
        if unknown:
            parser.error(f"no part named {', '.join(unknown)}")
        parts = [p for p in parts if p.name in args.parts]
    report = run_check(parts, out, cuda=cuda)
    for r in report["parts"]:
        print(f"{r['name']:>7}: {r['status']:<9} {r['seconds']:5.0f} s  {r['summary']}")
    print(f"report: {out / 'gpu-report.md'} and {out / 'gpu-report.json'}")
    return 0 if all(r["status"] in ("passed", "skipped") for r in report["parts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
