"""bench.py: one row per (backend, T), honest ratios, measured memory that grows as it should."""

import json
import subprocess
import sys

import pytest
import torch

from course_attn.backends import BACKENDS, get_backend
from course_attn.bench import (
    BenchRow, format_table, hardware, main, peak_memory_bytes, run_bench,
)

TINY = dict(heads=2, head_dim=8, repeats=2)
MIB = 2 ** 20


def test_one_row_per_backend_and_length_with_sdpa_as_the_unit(device):
    rows = run_bench(["math", "sdpa"], (16, 32), device=device, **TINY)
    assert [(r.backend, r.seq_len) for r in rows] == [
        ("math", 16), ("sdpa", 16), ("math", 32), ("sdpa", 32)]
    by_key = {(r.backend, r.seq_len): r for r in rows}
    for r in rows:
        assert isinstance(r, BenchRow) and r.error is None
        assert r.time_ms > 0 and r.peak_mib > 0
        assert (r.batch, r.heads, r.head_dim, r.dtype, r.repeats) == (1, 2, 8, "float32", 2)
        sdpa = by_key["sdpa", r.seq_len]
        assert r.time_ratio == pytest.approx(r.time_ms / sdpa.time_ms)
        assert r.mem_ratio == pytest.approx(r.peak_mib / sdpa.peak_mib)
    assert all(by_key["sdpa", t].time_ratio == 1.0 == by_key["sdpa", t].mem_ratio for t in (16, 32))


def test_every_registered_backend_is_benchmarked_even_one_registered_later(monkeypatch, device):
    def doubled(q, k, v, **kwargs):
        return 2 * get_backend("math")(q, k, v, **kwargs)

    monkeypatch.setitem(BACKENDS, "doubled", doubled)
    rows = run_bench(seq_lens=(8,), device=device, is_causal=True, window=3, **TINY)
    assert [r.backend for r in rows] == list(BACKENDS)
    assert all(r.error is None and r.is_causal and r.window == 3 for r in rows)


def test_a_failing_backend_gets_a_row_and_the_run_goes_on(monkeypatch, device):
    def fails_when_long(q, k, v, **kwargs):
        if q.shape[-2] > 16:
            raise torch.OutOfMemoryError("pretend: tried to allocate 4 GiB")
        return get_backend("sdpa")(q, k, v, **kwargs)

    monkeypatch.setitem(BACKENDS, "fragile", fails_when_long)
    rows = run_bench(["fragile", "sdpa"], (16, 32), device=device, **TINY)
    fragile = {r.seq_len: r for r in rows if r.backend == "fragile"}
    assert fragile[16].error is None and fragile[16].time_ms > 0
    assert fragile[32].error.startswith("OutOfMemoryError: pretend")
    assert fragile[32].time_ms is None and fragile[32].peak_mib is None
    assert fragile[32].time_ratio is None
    sdpa_32 = next(r for r in rows if r.backend == "sdpa" and r.seq_len == 32)
    assert sdpa_32.error is None and sdpa_32.time_ms > 0
    table = format_table(rows)
    assert "failed: OutOfMemoryError: pretend" in table


def test_a_backend_named_twice_is_measured_once(device):
    rows = run_bench(["sdpa", "math", "sdpa"], (8,), device=device, **TINY)
    assert [r.backend for r in rows] == ["sdpa", "math"]


def test_without_sdpa_the_ratios_are_left_empty(device):
    rows = run_bench(["math"], (8,), device=device, **TINY)
    assert rows[0].time_ms > 0 and rows[0].time_ratio is None and rows[0].mem_ratio is None
    assert " - " in format_table(rows)


@pytest.mark.parametrize("kwargs, message", [
    (dict(backends=["nope"]), "unknown attention backend 'nope'"),
    (dict(seq_lens=()), "seq_lens"),
    (dict(seq_lens=(0,)), "seq_lens"),
    (dict(repeats=0), "repeats must be a positive int"),
    (dict(dtype=torch.int32), "floating"),
    (dict(backends=[]), "no backend"),
    (dict(window=0), "window must be None or an int >= 1"),
])
def test_bad_options_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_bench(**{"seq_lens": (8,), **kwargs})


def test_peak_memory_is_measured_not_computed(device):
    """A temporary of 4 MiB that is freed before the 1 MiB result: the peak sees both at once."""
    def work():
        temporary = torch.ones(MIB, device=device)          # 4 MiB of float32
        return temporary[: MIB // 4] * 2                    # 1 MiB, made while both live

    peaks = [peak_memory_bytes(work, device) for _ in range(3)]
    assert peaks[0] is not None
    assert 5 * MIB <= peaks[0] < 5 * MIB + 64 * 1024
    assert len(set(peaks)) == 1, f"not the same on every run: {peaks}"


@pytest.fixture
def one_cpu_thread():
    """PyTorch's fused CPU kernel keeps a scratch tile per thread (0.5 MiB each at T=1024): with
    one thread, the memory measured is the same on a 2-core laptop and a 64-core server."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_math_memory_grows_quadratically_and_sdpa_stays_far_below(device, one_cpu_thread):
    rows = run_bench(["math", "sdpa"], (256, 512), device=device, heads=2, head_dim=16, repeats=1)
    peak = {(r.backend, r.seq_len): r.peak_mib for r in rows}
    assert peak["math", 512] / peak["math", 256] > 3
    # B·H·T² float32 scores alone: 2 MiB at T=512.
    assert peak["math", 512] >= 2 * 512 * 512 * 4 / MIB
    assert peak["sdpa", 512] < peak["math", 512] / 4


def test_hardware_names_the_device_cpus_and_torch():
    info = hardware("cpu")
    assert info["device"] == "cpu" and info["device_name"]
    assert info["cpu_count"] >= 1 and info["torch"] == torch.__version__


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = main(["--seq-lens", "8", "16", "--heads", "2", "--head-dim", "8", "--repeats", "1",
                 "--backends", "math", "sdpa", "--causal", "--window", "4", "--dtype", "float64",
                 "--device", "cpu", "--json", str(path)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "x sdpa" in printed and "math" in printed and "float64" in printed
    report = json.loads(path.read_text())
    assert {"device_name", "cpu_count", "torch"} <= set(report["hardware"])
    rows = report["rows"]
    assert [(r["backend"], r["seq_len"]) for r in rows] == [
        ("math", 8), ("sdpa", 8), ("math", 16), ("sdpa", 16)]
    assert all(r["dtype"] == "float64" and r["is_causal"] and r["window"] == 4 for r in rows)
    assert all(r["time_ms"] > 0 and r["peak_mib"] > 0 for r in rows)


def test_cli_refuses_an_unknown_backend(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--seq-lens", "8", "--backends", "nope"])
    assert exit_info.value.code == 2
    assert "unknown attention backend 'nope'" in capsys.readouterr().err


def test_runs_as_a_module(tmp_path):
    path = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "course_attn.bench", "--seq-lens", "8", "--heads", "1",
         "--head-dim", "4", "--repeats", "1", "--json", str(path)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "sdpa" in done.stdout
    assert done.stderr == ""
    assert {r["backend"] for r in json.loads(path.read_text())["rows"]} >= {"math", "sdpa"}
