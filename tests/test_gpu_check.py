"""``python -m course_attn.gpu_check`` (``make gpu-check``): one line and exit 0 without CUDA;
its report, Markdown and JSON, with every GPU part skipped; a part that overruns its budget is
stopped with its children, and the parts after it still run."""

import json
import re
import subprocess
import sys
import time

import pytest
import torch

from course_attn import gpu_check
from course_attn.gpu_check import Part, run_check

PY = sys.executable


def gpu_check_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "course_attn.gpu_check", *args], capture_output=True,
                          text=True, timeout=120, cwd=gpu_check.ROOT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path):
    done = gpu_check_command("--out", str(tmp_path / "report"))
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 1 and "no CUDA device" in done.stdout
    assert not (tmp_path / "report").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_the_report_with_every_gpu_part_skipped(tmp_path):
    out = tmp_path / "report"
    done = gpu_check_command("--cpu", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "gpu-report.json").read_text())
    names = [part["name"] for part in report["parts"]]
    assert names == ["tests", "triton", "grader", "nbval", "bench", "decode"]
    assert all(part["status"] == "skipped" and part["summary"] == "no CUDA device here"
               for part in report["parts"])
    assert report["hardware"]["torch"] == torch.__version__
    markdown = (out / "gpu-report.md").read_text()
    for part in report["parts"]:
        assert f"| {part['name']}: {part['title']} | skipped |" in markdown
        assert f"`{part['command']}`" in markdown        # each figure with its command
    assert "course_attn.grade solutions/09_flash_attention.ipynb" in markdown
    assert done.stdout.rstrip().endswith("gpu-report.json")


def test_the_budgets_fit_in_eight_minutes():
    assert sum(part.budget_s for part in gpu_check.default_parts(gpu_check.ROOT)) <= 480
    assert gpu_check.TOTAL_BUDGET_S <= 480


def test_the_device_test_modules_are_the_ones_that_take_the_device_fixture():
    tests = gpu_check.ROOT / "tests"
    takes_device = re.compile(r"^def test_\w+\([^)]*\bdevice\b", re.M)
    taking = {path.stem for path in tests.glob("test_*.py")
              if takes_device.search(path.read_text())}
    assert set(gpu_check.DEVICE_TEST_MODULES) == taking - {"test_gpu_check"}


def test_a_part_over_its_budget_is_stopped_with_its_children_and_the_rest_still_run(tmp_path):
    marker = f"gpu-check-sleeper-{tmp_path.name}"
    sleeper = ("import subprocess, sys, time\n"
               f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', "
               f"'{marker}'])\nprint('started', flush=True)\ntime.sleep(60)\n")
    parts = [
        Part("slow", "sleeps past its budget", (PY, "-c", sleeper), 3, needs_cuda=False),
        Part("broken", "exits 3", (PY, "-c", "print('went wrong'); raise SystemExit(3)"), 30,
             needs_cuda=False),
        Part("fine", "passes", (PY, "-c", "print('ok')"), 30, needs_cuda=False),
        Part("absent", "needs a module", (PY, "-c", "pass"), 30, needs_cuda=False,
             needs_modules=("no_such_module_for_gpu_check",)),
        Part("gpu", "needs CUDA", (PY, "-c", "pass"), 30),
    ]
    start = time.monotonic()
    report = run_check(parts, tmp_path, cuda=False)
    assert time.monotonic() - start < 30
    status = {part["name"]: part for part in report["parts"]}
    assert status["slow"]["status"] == "timed out"
    assert status["slow"]["summary"].startswith("stopped at its budget of 3 s")
    assert "started" in status["slow"]["tail"]
    assert status["broken"]["status"] == "failed" and status["broken"]["returncode"] == 3
    assert status["fine"]["status"] == "passed"
    assert status["absent"]["status"] == "skipped"
    assert "no_such_module_for_gpu_check" in status["absent"]["summary"]
    assert status["gpu"] == {**status["gpu"], "status": "skipped",
                             "summary": "no CUDA device here"}
    time.sleep(0.5)
    from grading_support import live_processes
    assert live_processes(marker) == [], "the part's child outlived its budget"
    markdown = (tmp_path / "gpu-report.md").read_text()
    assert "## broken: the end of its output" in markdown and "went wrong" in markdown
    assert "## fine: the end of its output" not in markdown


def test_the_total_budget_bounds_the_parts_after_it(tmp_path):
    parts = [Part(name, name, (PY, "-c", "import time; time.sleep(60)"), 60, needs_cuda=False)
             for name in ("first", "second")]
    report = run_check(parts, tmp_path, cuda=False, total_budget_s=2)
    first, second = report["parts"]
    assert first["status"] == "timed out" and first["budget_s"] == 2
    assert second["status"] == "skipped" and second["summary"] == "no time left in the budget"


def test_a_pytest_part_reports_its_counts(tmp_path):
    (tmp_path / "test_three.py").write_text(
        "import pytest\n\ndef test_passes():\n    pass\n\ndef test_fails():\n    assert 0\n\n"
        "@pytest.mark.skip\ndef test_skipped():\n    pass\n")
    part = Part("tests", "three tests", (PY, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                         str(tmp_path / "test_three.py"),
                                         f"--junitxml={tmp_path / 'three.xml'}"),
                60, needs_cuda=False, junit="three.xml")
    report = run_check([part], tmp_path, cuda=False)
    assert report["parts"][0]["status"] == "failed"
    assert report["parts"][0]["summary"] == "1 passed, 1 failed, 1 skipped"


def test_the_bench_table_gives_tflops_per_backend():
    rows = [{"backend": b, "head_dim": 64, "causal": False, "seq_len": 1024, "tflops": t,
             "settled": s} for b, t, s in (("sdpa-flash", 301.4, True), ("triton", 250.2, False))]
    rows.append({"backend": "flash", "head_dim": 64, "causal": False, "seq_len": 1024,
                 "error": "CUDA out of memory"})
    report = {"hardware": {"device_name": "NVIDIA H200", "torch": "2.11", "cuda": "12.8",
                           "python": "3.12"},
              "date": "today", "seconds": 1.0, "parts": [], "figures": {"bench": {"rows": rows}}}
    markdown = gpu_check.markdown(report)
    assert "| D | causal | T | sdpa-flash | triton | flash |" in markdown
    assert "| 64 | False | 1024 | 301 | 250* | error |" in markdown
