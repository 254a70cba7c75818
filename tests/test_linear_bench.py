"""linear_bench.py and ``python -m course_attn.bench --linear``: sane rows with tiny settings (no
timing is asserted), a crossover read off correctly, and a command line that explains itself
and fails in one line."""

import dataclasses
import json
import subprocess
import sys

import pytest

import course_attn.linear_bench as linear_bench
from course_attn.bench import BenchRow, main
from course_attn.linear_bench import (
    StepRow, crossover_length, format_step_table, run_linear_bench, run_step_bench,
)
from course_attn.timing import NOT_SETTLED

from helpers import one_line_error

MIB = 2 ** 20
TINY = dict(heads=2, head_dim=4, repeats=1, max_warmup=2)
TINY_CLI = ["--linear", "--seq-lens", "8", "16", "--step-lens", "4", "32", "--heads", "2",
            "--head-dim", "4", "--repeats", "1", "--max-warmup", "2", "--chunk-size", "4",
            "--device", "cpu"]


# ---------------------------------------------------------------- run_linear_bench

def test_linear_rows_are_sane(device):
    rows = run_linear_bench((8, 12), chunk_size=4, device=device, **dict(TINY, repeats=3))
    assert [(r.backend, r.seq_len) for r in rows] == [
        ("linear", 8), ("sdpa", 8), ("linear", 12), ("sdpa", 12)]
    by_key = {(r.backend, r.seq_len): r for r in rows}
    for r in rows:
        assert isinstance(r, BenchRow) and r.error is None
        assert r.time_ms > 0 and r.kept == 3 and 1 <= r.warmup_calls <= 2
        assert (r.batch, r.heads, r.head_dim, r.dtype, r.is_causal, r.window) == (
            1, 2, 4, "float32", True, None)
        assert r.device.startswith(device.type)
        # a ratio is the median of three per-round ratios, or withheld with the reason why
        assert (r.time_ratio is None) == (r.withheld is not None)
        assert r.withheld is None or r.withheld.startswith(NOT_SETTLED)
        assert r.time_ratio is None or r.time_ratio > 0
        assert r.peak_mib is None or r.peak_mib > 0
    assert all(by_key["sdpa", t].time_ratio == 1.0 for t in (8, 12))


def test_one_round_withholds_linears_ratio():
    rows = run_linear_bench((8,), chunk_size=4, device="cpu", **TINY)
    linear, sdpa = rows
    assert linear.time_ratio is None and linear.withheld.startswith(NOT_SETTLED)
    assert sdpa.time_ratio == 1.0 and sdpa.withheld is None


@pytest.mark.parametrize("feature_map", ["relu", "performer"])
def test_every_feature_map_can_be_benchmarked(feature_map):
    rows = run_linear_bench((8,), feature_map=feature_map, chunk_size=3, device="cpu", **TINY)
    assert all(r.error is None and r.time_ms > 0 for r in rows)


def test_a_failing_call_gets_a_row_and_the_run_goes_on(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory\nmore detail")

    monkeypatch.setattr(linear_bench, "linear_attention", broken)
    rows = run_linear_bench((8, 16), device="cpu", **TINY)
    failed = [r for r in rows if r.backend == "linear"]
    assert [r.error for r in failed] == ["RuntimeError: out of memory"] * 2
    assert all(r.time_ms is None and r.time_ratio is None for r in failed)
    assert all(r.error is None and r.time_ms > 0 for r in rows if r.backend == "sdpa")


def row(t, ratio, backend="linear"):
    return BenchRow(backend, t, 1.0, None, ratio, None, None, 1, 8, 64, "float32", True, None,
                    "cpu", 5)


@pytest.mark.parametrize("ratios, expected", [
    ({256: 4.0, 1024: 1.0, 4096: 0.25}, 1024.0),                 # exactly 1 at a measured T
    ({256: 2.0, 1024: 0.5}, 512.0),                              # halfway in log-log
    ({256: 4.0, 512: 2.0, 1024: 0.5, 2048: 0.25}, 2 ** (9 + 0.5)),
    ({256: 0.5, 512: 2.0, 1024: 0.5}, 2 ** (9 + 0.5)),           # the last crossing counts
    ({256: 0.9, 512: 0.5}, None),                                # faster everywhere
    ({256: 4.0, 512: 2.0}, None),                                # never faster
    ({256: 0.5, 512: 1.5}, None),                                # slower at the longest
    ({}, None),
])
def test_crossover_is_interpolated_in_log_log(ratios, expected):
    rows = [row(t, r) for t, r in reversed(ratios.items())] + [row(256, 1.0, "sdpa")]
    got = crossover_length(rows)
    assert got == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize("kwargs, message", [
    (dict(seq_lens=()), r"seq_lens must be a non-empty list of positive ints, got \[\]"),
    (dict(seq_lens=(8, 0)), "seq_lens must be a non-empty list of positive ints"),
    (dict(chunk_size=0), "chunk_size must be a positive int, got 0"),
    (dict(chunk_size=2.5), "chunk_size must be a positive int, got 2.5"),
    (dict(feature_map="gelu"), "unknown feature_map 'gelu'; expected one of elu, relu, "
                               "performer"),
    (dict(heads=0), "heads must be a positive int, got 0"),
    (dict(repeats=0), "repeats must be a positive int, got 0"),
    (dict(device="toaster"), "not a device: 'toaster'"),
])
def test_linear_bench_refuses_bad_options(kwargs, message):
    args = dict(seq_lens=(8,), **TINY)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        run_linear_bench(args.pop("seq_lens"), **args)


# ---------------------------------------------------------------- run_step_bench

def test_step_rows_are_sane(device):
    rows = run_step_bench((4, 64), batch=2, heads=2, head_dim=4, calls=3, repeats=3,
                          max_warmup=2, device=device)
    assert [r.seq_len for r in rows] == [4, 64]
    for r in rows:
        assert isinstance(r, StepRow) and r.device.startswith(device.type)
        assert r.linear_us > 0 and r.sdpa_us > 0
        assert (r.calls, r.repeats, r.feature_map, r.dtype) == (3, 3, "elu", "float32")
        # The state is s (B, H, D, D) and z (B, H, D) whatever the length; the cache grows.
        assert r.state_mib * MIB == 2 * 2 * (4 * 4 + 4) * 4
        assert r.cache_mib * MIB == 2 * 2 * 2 * r.seq_len * 4 * 4
        assert (r.linear_ratio is None) == (r.withheld is not None)
        assert r.withheld is None or r.withheld.startswith(NOT_SETTLED)
    assert (rows[0].linear_ratio, rows[0].withheld) == (1.0, None)


STEP_COST_US = {("linear", 8): 2.0, ("sdpa", 8): 2.0, ("linear", 64): 3.0, ("sdpa", 64): 16.0}


def fake_step_clock(monkeypatch, load):
    """Installs a clock on which a step of ``STEP_COST_US[side, L]`` takes that many us times
    ``load(round, key)`` (round -1: the warm-up); returns the list of keys in call order."""
    seen, ran = [], []

    def time_call_ms(fn, device):
        if fn not in seen:
            seen.append(fn)        # the warm-up runs each once, in run_step_bench's order
        key = list(STEP_COST_US)[seen.index(fn)]
        ran.append(key)
        return STEP_COST_US[key] * load((len(ran) - 1) // 4 - 1, key) / 1e3   # one step, in ms

    monkeypatch.setattr(linear_bench, "time_call_ms", time_call_ms)
    return ran


def test_steps_are_timed_in_rounds_and_the_ratio_is_taken_per_round(monkeypatch):
    """Rounds 2 and 3 run 10x slower, and in round 4 only linear after 8 tokens does: every
    round's ratio but the last is 1.5, and so is their median, while the ratio of the median
    times would be 3 / 20."""
    ran = fake_step_clock(monkeypatch, lambda r, key: 10.0 if r in (2, 3) or (
        r == 4 and key == ("linear", 8)) else 1.0)
    rows = run_step_bench((8, 64), heads=1, head_dim=2, calls=1, repeats=5, max_warmup=1)
    keys = list(STEP_COST_US)
    assert ran[:8] == keys + keys                                # the warm-up, round 0
    assert ran[8:12] == keys[1:] + keys[:1]                      # the order rotates
    assert [r.withheld for r in rows] == [None, None]
    assert [r.linear_ratio for r in rows] == [1.0, pytest.approx(1.5)]
    assert (rows[1].linear_us, rows[1].sdpa_us) == (pytest.approx(3.0), pytest.approx(16.0))


@pytest.mark.parametrize("repeats, load, why", [
    (5, lambda r, key: 2.0 if r % 2 and key == ("linear", 64) else 1.0, "spread 1.00 over 5"),
    (2, lambda r, key: 1.0, "2 rounds, fewer than 3"),
])
def test_rounds_that_disagree_or_are_too_few_withhold_the_step_ratio(monkeypatch, repeats, load,
                                                                      why):
    fake_step_clock(monkeypatch, load)
    rows = run_step_bench((8, 64), heads=1, head_dim=2, calls=1, repeats=repeats, max_warmup=1)
    assert (rows[0].linear_ratio, rows[0].withheld) == (1.0, None)
    assert rows[1].linear_ratio is None
    assert rows[1].withheld.startswith(NOT_SETTLED) and why in rows[1].withheld
    assert "-: the rounds did not agree" in format_step_table(rows)


def test_the_performer_state_is_num_features_by_dv():
    (r,) = run_step_bench((8,), heads=1, head_dim=4, feature_map="performer", calls=1,
                          repeats=1, max_warmup=1, device="cpu")
    assert r.state_mib * MIB == (256 * 4 + 256) * 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(seq_lens=()), "seq_lens must be a non-empty list of positive ints"),
    (dict(calls=0), "calls must be a positive int, got 0"),
    (dict(calls=True), "calls must be a positive int, got True"),
    (dict(feature_map="softmax"), "unknown feature_map 'softmax'"),
    (dict(head_dim=-1), "head_dim must be a positive int, got -1"),
])
def test_step_bench_refuses_bad_options(kwargs, message):
    args = dict(seq_lens=(8,), calls=1, repeats=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        run_step_bench(args.pop("seq_lens"), **args)


def test_step_table_shows_every_row():
    rows = [StepRow(512, 40.0, 70.0, 1.0, 0.127, 2.0, 1, 8, 64, "float32", "elu", "cpu", 50, 5),
            StepRow(4096, 42.0, 560.0, 1.05, 0.127, 16.0, 1, 8, 64, "float32", "elu", "cpu", 50,
                    5)]
    lines = format_step_table(rows).splitlines()
    assert len(lines) == 5 and "linear us" in lines[0] and set(lines[1]) <= {"-", " "}
    assert "us: microseconds per decode step" in lines[4] and "x first" in lines[4]
    assert lines[2].split() == ["512", "40.0", "1.00", "70.0", "0.127", "2.000"]
    assert lines[3].split() == ["4096", "42.0", "1.05", "560.0", "0.127", "16.000"]
    rows[1] = dataclasses.replace(rows[1], linear_ratio=None,
                                  withheld=f"{NOT_SETTLED} (spread 0.40 over 5 rounds)")
    lines = format_step_table(rows).splitlines()
    assert len(lines) == 6 and lines[5].endswith(NOT_SETTLED)
    assert lines[3].split() == ["4096", "42.0", "-", "560.0", "0.127", "16.000"]


# ---------------------------------------------------------------- the command line

def test_cli_linear_prints_both_tables_and_writes_json(tmp_path, capsys):
    path = tmp_path / "linear.json"
    assert main(TINY_CLI + ["--batch", "2", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "chunk_size=4" in printed and "B=2" in printed and "linear us" in printed
    assert "linear attention is" in printed
    report = json.loads(path.read_text())
    assert {"hardware", "elapsed_s", "chunk_size", "feature_map", "crossover_length", "rows",
            "decode_step"} <= set(report)
    assert report["chunk_size"] == 4 and report["feature_map"] == "elu"
    assert [(r["backend"], r["seq_len"]) for r in report["rows"]] == [
        ("linear", 8), ("sdpa", 8), ("linear", 16), ("sdpa", 16)]
    assert set(report["rows"][0]) == {f.name for f in dataclasses.fields(BenchRow)}
    assert all(r["batch"] == 2 and r["heads"] == 2 and r["is_causal"] for r in report["rows"])
    assert [r["seq_len"] for r in report["decode_step"]] == [4, 32]
    assert set(report["decode_step"][0]) == {f.name for f in dataclasses.fields(StepRow)}


@pytest.mark.parametrize("extra, message", [
    (["--chunk-size", "0"], "--chunk-size must be a positive int, got 0"),
    (["--heads", "0"], "--heads must be a positive int, got 0"),
    (["--decode"], "--linear and --decode are two benchmarks: give one of them"),
    (["--window", "4"], "--linear does not use --window"),
    (["--backends", "math"], "--linear does not use --backends"),
    (["--device", "toaster"], "not a device: 'toaster'"),
])
def test_cli_linear_bad_options_exit_2_in_one_line(capsys, extra, message):
    assert main(TINY_CLI + extra) == 2
    assert message in one_line_error(capsys)


def test_cli_refuses_an_unknown_feature_map(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(TINY_CLI + ["--feature-map", "gelu"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'gelu'" in capsys.readouterr().err


def test_linear_runs_as_a_module(tmp_path):
    path = tmp_path / "linear.json"
    done = subprocess.run([sys.executable, "-m", "course_attn.bench", *TINY_CLI,
                           "--json", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "x sdpa" in done.stdout and "linear us" in done.stdout
    report = json.loads(path.read_text())
    assert [r["seq_len"] for r in report["decode_step"]] == [4, 32]
