"""bench.py: one row per (backend, T), honest ratios, measured memory that grows as it should,
a warm-up that waits for the times to settle, and a command line that explains itself. (The
statistics of the rounds, on fake clocks: test_timing.py.)"""

import json
import subprocess
import sys

import pytest
import torch

from course_attn.backends import BACKENDS, get_backend
from course_attn.bench import (
    BenchRow, format_table, has_settled, hardware, main, peak_memory_bytes, run_bench, warm_up,
)
from course_attn.timing import NOT_SETTLED, SPREAD_TOLERANCE, check_device

from helpers import one_line_error

TINY = dict(heads=2, head_dim=8, repeats=2)
MIB = 2 ** 20


def test_one_row_per_backend_and_length_with_sdpa_as_the_unit(device):
    rows = run_bench(["math", "sdpa"], (16, 32), device=device, **{**TINY, "repeats": 3})
    assert [(r.backend, r.seq_len) for r in rows] == [
        ("math", 16), ("sdpa", 16), ("math", 32), ("sdpa", 32)]
    by_key = {(r.backend, r.seq_len): r for r in rows}
    for r in rows:
        assert isinstance(r, BenchRow) and r.error is None
        assert r.time_ms > 0 and r.peak_mib > 0
        assert (r.batch, r.heads, r.head_dim, r.dtype, r.repeats) == (1, 2, 8, "float32", 3)
        sdpa = by_key["sdpa", r.seq_len]
        assert r.mem_ratio == pytest.approx(r.peak_mib / sdpa.peak_mib)
        # the ratio is reported exactly when the rounds' ratios agree, and then lies among them
        assert (r.time_ratio is None) == (r.ratio_spread > SPREAD_TOLERANCE)
        assert (r.withheld is None) == (r.time_ratio is not None)
    assert all(by_key["sdpa", t].time_ratio == 1.0 == by_key["sdpa", t].mem_ratio for t in (16, 32))


def test_fewer_rounds_than_a_spread_needs_withhold_every_ratio_but_the_unit(device):
    rows = run_bench(["math", "sdpa"], (16,), device=device, **TINY)
    math_row, sdpa_row = rows
    assert math_row.time_ratio is None and math_row.withheld.startswith(NOT_SETTLED)
    assert sdpa_row.time_ratio == 1.0 and math_row.time_ms > 0
    assert "not settled" in format_table(rows).splitlines()[2]


def test_the_run_measures_on_the_threads_asked_and_gives_the_setting_back(device):
    before = torch.get_num_threads()
    rows = run_bench(["sdpa"], (8,), device=device, threads=1, **TINY)
    assert torch.get_num_threads() == before
    assert rows[0].threads == 1
    if device.type == "cpu":
        assert rows[0].clock == "processor"


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
    (dict(threads=0), "threads must be a positive int"),
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


def test_cli_refuses_an_unknown_backend_in_one_line(capsys):
    assert main(["--seq-lens", "8", "--backends", "nope"]) == 2
    assert "unknown attention backend 'nope'" in one_line_error(capsys)


def test_cuda_on_a_torch_built_without_it_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    assert main(["--device", "cuda", "--seq-lens", "8"]) == 2
    assert "device 'cuda' is not available" in one_line_error(capsys)
    with pytest.raises(ValueError, match="built without CUDA"):
        run_bench(["sdpa"], (8,), device="cuda")


@pytest.mark.parametrize("device, message", [
    ("toaster", "not a device: 'toaster'"),
    ("cuda:99", "device 'cuda:99' is not available"),
])
def test_a_device_that_is_not_there_is_a_one_line_error(device, message, capsys):
    assert main(["--device", device, "--seq-lens", "8"]) == 2
    assert message in one_line_error(capsys)


@pytest.fixture
def nothing_timed(monkeypatch):
    """Every benchmark and every timed call fails the test if it runs."""
    import course_attn.bench as bench
    import course_attn.decode_bench as decode_bench
    import course_attn.linear_bench as linear_bench
    import course_attn.timing as timing

    def timed(*args, **kwargs):
        raise AssertionError("something was timed before every option was checked")

    for module, name in [(bench, "run_bench"), (bench, "main_decode"), (bench, "main_linear"),
                         (timing, "time_call_ms"), (timing, "peak_memory_bytes"),
                         (decode_bench, "time_call_ms"), (decode_bench, "peak_memory_bytes"),
                         (decode_bench, "generate"), (linear_bench, "time_call_ms")]:
        monkeypatch.setattr(module, name, timed)


@pytest.mark.parametrize("argv, message", [
    # --decode: its own options, by the name they were typed with, before generation is timed
    (["--decode", "--cache-lens", "0"],
     "--cache-lens must be a non-empty list of positive ints, got [0]"),
    (["--decode", "--new-tokens", "8", "-1"],
     "--new-tokens must be a non-empty list of positive ints, got [8, -1]"),
    (["--decode", "--prompt-len", "0"], "--prompt-len must be a positive int, got 0"),
    (["--decode", "--repeats", "0"], "--repeats must be a positive int, got 0"),
    # ... and the options it does not use
    (["--decode", "--window", "4"], "--decode does not use --window"),
    (["--decode", "--backends", "math"], "--decode does not use --backends"),
    (["--decode", "--seq-lens", "8"], "--decode does not use --seq-lens"),
    (["--decode", "--max-warmup", "3"], "--decode does not use --max-warmup"),
    (["--decode", "--dtype", "float64"], "--decode does not use --dtype"),
    (["--decode", "--step-lens", "8"], "--decode does not use --step-lens"),
    (["--decode", "--causal"], "--decode does not use --causal"),
    # --linear
    (["--linear", "--step-lens", "-1"],
     "--step-lens must be a non-empty list of positive ints, got [-1]"),
    (["--linear", "--seq-lens", "0"],
     "--seq-lens must be a non-empty list of positive ints, got [0]"),
    (["--linear", "--chunk-size", "0"], "--chunk-size must be a positive int, got 0"),
    (["--linear", "--max-warmup", "0"], "--max-warmup must be a positive int, got 0"),
    (["--linear", "--backends", "math"], "--linear does not use --backends"),
    (["--linear", "--window", "4"], "--linear does not use --window"),
    (["--linear", "--no-causal"], "--linear does not use --no-causal"),
    (["--linear", "--cache-lens", "8"], "--linear does not use --cache-lens"),
    (["--linear", "--decode"], "--linear and --decode are two benchmarks: give one of them"),
    # the backends
    (["--seq-lens", "8", "0"], "--seq-lens must be a non-empty list of positive ints"),
    (["--window", "0"], "--window must be a positive int, got 0"),
    (["--head-dim", "0"], "--head-dim must be a positive int, got 0"),
    (["--backends", "nope"], "unknown attention backend 'nope'"),
    (["--new-tokens", "4"], "the backends benchmark (no --decode or --linear) does not use "
                            "--new-tokens"),
    (["--feature-map", "relu", "--step-lens", "8"], "does not use --feature-map, --step-lens"),
    # any mode: the device
    (["--device", "toaster"], "not a device: 'toaster'"),
    (["--decode", "--device", "toaster"], "not a device: 'toaster'"),
])
def test_every_bad_option_is_refused_by_its_name_before_anything_is_timed(
        argv, message, nothing_timed, capsys):
    assert main(argv) == 2
    err = one_line_error(capsys)
    assert message in err
    assert "_" not in err.split("error: ", 1)[1].split(",")[0], "a Python name, not the option"


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_mps_where_there_is_none_is_one_whole_sentence(nothing_timed, capsys):
    assert main(["--device", "mps"]) == 2
    err = one_line_error(capsys)
    assert "device 'mps' is not available: MPS needs a Mac with Apple silicon" in err
    assert err.endswith(")\n") and "This could be" not in err


def test_a_device_error_is_cut_at_a_sentence_not_mid_word(monkeypatch):
    def missing(*args, **kwargs):
        raise NotImplementedError(
            "Could not run 'aten::empty.memory_format' with arguments from the 'XLA' backend. "
            "This could be because the operator doesn't exist for this backend, or was omitted "
            "during the selective/custom build process.\nXLA: registered at ...")

    monkeypatch.setattr(torch, "empty", missing)
    with pytest.raises(ValueError) as raised:
        check_device("cpu")
    assert str(raised.value) == (
        "device 'cpu' is not available: NotImplementedError: Could not run "
        "'aten::empty.memory_format' with arguments from the 'XLA' backend")


def test_cli_device_error_has_no_traceback():
    """As a student types it: ``--device cuda`` where this torch has no CUDA (or no such GPU)."""
    device = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    done = subprocess.run([sys.executable, "-m", "course_attn.bench", "--device", device],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"device '{device}' is not available" in done.stderr


def test_an_unwritable_json_path_is_a_one_line_error(tmp_path, capsys):
    code = main(["--seq-lens", "8", "--heads", "1", "--head-dim", "4", "--repeats", "1",
                 "--max-warmup", "1", "--backends", "sdpa", "--device", "cpu",
                 "--json", str(tmp_path / "no" / "such" / "folder.json")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write" in err


def test_help_says_what_each_option_means_and_its_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    options = text.split("options:", 1)[1]
    # Each option's entry starts on a line indented by two spaces, then a dash.
    entries = [e for e in ("\n" + options).split("\n  -")[1:] if not e.startswith("h, --help")]
    names = [e.split()[0].rstrip(",") for e in entries]
    assert names == ["-seq-lens", "-batch", "-heads", "-head-dim", "-dtype", "-causal",
                     "-window", "-backends", "-device", "-repeats", "-max-warmup", "-threads",
                     "-json",
                     "-decode", "-new-tokens", "-prompt-len", "-cache-lens", "-model-backend",
                     "-linear", "-chunk-size", "-feature-map", "-step-lens"]
    for entry in entries:
        words = " ".join(entry.split())
        assert "(default: " in words, f"no default in: {words}"
        described = words.split("(default: ")[0]
        assert len(described.split()) >= 5, f"no explanation in: {words}"
    assert "median" in options and "settle" in options and "round" in options


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


COLD_THEN_FAST = [90.0, 80.0, 60.0, 1.6, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5]


def test_times_settle_only_once_the_slow_first_calls_are_behind():
    first_settled = next(n for n in range(len(COLD_THEN_FAST) + 1)
                         if has_settled(COLD_THEN_FAST[:n]))
    # The last three calls are fast, and so is the median of the three before (60, 1.6, 1.5).
    assert first_settled == 8
    assert not has_settled([1.5] * 5)  # too few calls to say


def test_equally_slow_first_calls_are_not_taken_for_settled():
    assert not has_settled([95.0, 96.0, 94.0, 1.6, 1.5, 1.5])
    assert has_settled([95.0, 96.0, 94.0, 95.0, 95.0, 96.0])  # a steady time, however slow


def test_noisy_times_do_not_settle():
    assert not has_settled([1.5, 9.4, 1.6, 1.4, 9.7, 1.5, 1.4, 9.6, 1.5])


def fake_calls(**series):
    """name -> a call returning the next time of its series (then its last one), and a log of
    the names in the order they were called."""
    log = []

    def call(name, times):
        def next_time():
            log.append(name)
            return times.pop(0) if len(times) > 1 else times[0]
        return next_time

    return {name: call(name, list(times)) for name, times in series.items()}, log


def test_warm_up_calls_each_backend_in_turns_until_it_settles():
    calls, log = fake_calls(slow_start=COLD_THEN_FAST, steady=[2.0] * 20)
    result = warm_up(calls)
    assert result["steady"].calls == 6 and result["steady"].settled
    assert result["slow_start"].calls == 8 and result["slow_start"].settled
    assert result["slow_start"].times_ms == COLD_THEN_FAST[:8]
    assert log[:12] == ["slow_start", "steady"] * 6  # turns while both are warming up
    assert log[12:] == ["slow_start"] * 2


def test_warm_up_stops_at_its_limits_and_says_it_did_not_settle():
    calls, _ = fake_calls(noisy=[1.5, 9.5] * 50, slow=[600.0] * 50)
    result = warm_up(calls, max_calls=7, budget_ms=2000.0)
    assert result["noisy"].calls == 7 and not result["noisy"].settled
    assert result["slow"].calls == 4 and not result["slow"].settled  # 4 x 600 ms >= 2 s


def test_warm_up_drops_a_failing_call_at_once():
    calls = {"fails": lambda: None}
    result = warm_up(calls)
    assert result["fails"].calls == 0 and not result["fails"].settled


def test_rows_say_how_many_calls_were_kept_and_how_the_warm_up_went(device):
    rows = run_bench(["math", "sdpa"], (16,), device=device, heads=2, head_dim=8, repeats=3)
    for row in rows:
        assert row.kept == 3 == row.repeats
        assert 1 <= row.warmup_calls <= 30 and isinstance(row.warmup_settled, bool)
        assert row.settled == (row.time_spread <= SPREAD_TOLERANCE)
    once = run_bench(["sdpa"], (16,), device=device, heads=2, head_dim=8, repeats=2, max_warmup=1)
    assert (once[0].warmup_calls, once[0].warmup_settled, once[0].kept) == (1, False, 2)
    assert once[0].settled is False and once[0].time_spread is None      # 2 rounds: unknown


def row(**fields) -> BenchRow:
    base = dict(backend="sdpa", seq_len=8, time_ms=1.0, peak_mib=1.0, time_ratio=1.0,
                mem_ratio=1.0, error=None, batch=1, heads=1, head_dim=4, dtype="float32",
                is_causal=False, window=None, device="cpu", repeats=5)
    return BenchRow(**{**base, **fields})


def test_table_shows_kept_and_warm_up_counts_and_marks_unsettled_times():
    table = format_table([row(kept=5, warmup_calls=6, settled=True, clock="processor"),
                          row(backend="math", time_ms=3.25, kept=5, warmup_calls=30,
                              settled=False, time_ratio=None, ratio_spread=0.4,
                              withheld=f"{NOT_SETTLED} (spread 0.40)", clock="processor")])
    header, _, settled, unsettled, _, clock, ratio, withheld, rough = table.splitlines()
    assert header.split()[-2:] == ["kept", "warm-up"]
    assert settled.split()[-2:] == ["5", "6"] and "*" not in settled
    assert "3.25*" in unsettled.split() and unsettled.split()[-2:] == ["5", "30"]
    assert "not settled" in unsettled and "0.40" in unsettled.split()
    assert clock.startswith("time: processor time on one CPU thread")
    assert ratio.startswith("x sdpa: the median of each round's ratio")
    assert withheld.endswith(NOT_SETTLED)
    assert rough.startswith("* the rounds' times spread above")
    assert "*" not in format_table([row(kept=5, warmup_calls=6, settled=True)])


def test_rows_made_the_old_way_still_work():
    """BenchRow's new fields have defaults: code that builds rows without them keeps working."""
    old = BenchRow("sdpa", 8, 1.0, 1.0, 1.0, 1.0, None, 1, 1, 4, "float32", False, None, "cpu", 5)
    assert (old.kept, old.warmup_calls, old.settled) == (None, None, None)
    assert format_table([old]).splitlines()[2].split()[-2:] == ["-", "-"]
