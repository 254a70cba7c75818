"""decode_bench.py and ``python -m course_attn.bench --decode``: sane rows with tiny settings
(no timing is asserted), cache bytes that are the formula, and a command line that explains
itself and fails in one line."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

import course_attn.decode_bench as decode_bench
from course_attn.bench import main
from course_attn.decode_bench import (
    CacheUpdateRow, DecodeRow, decode_model, format_decode_table, format_update_table,
    run_cache_update_bench, run_decode_bench,
)
from course_attn.model import GPT, GPTConfig, generate
from course_attn.timing import NOT_SETTLED

from helpers import one_line_error

MIB = 2 ** 20
TINY_DECODE = ["--decode", "--new-tokens", "2", "3", "--prompt-len", "4", "--repeats", "1",
               "--cache-lens", "8", "32", "--heads", "2", "--head-dim", "4", "--device", "cpu"]


def tiny_model(device="cpu", **options) -> GPT:
    config = dict(vocab_size=16, seq_len=32, d_model=16, n_heads=4, n_layers=2, position="rope")
    config.update(options)
    torch.manual_seed(0)
    return GPT(GPTConfig(**config)).to(device).eval()


def cache_bytes(config: GPTConfig, batch: int, length: int, itemsize: int = 4) -> int:
    """2 · layers · B · Hkv · D · length · bytes: keys and values of every layer."""
    n_kv_heads = config.n_kv_heads or config.n_heads
    head_dim = config.d_model // config.n_heads
    return 2 * config.n_layers * batch * n_kv_heads * head_dim * length * itemsize


# ---------------------------------------------------------------- run_decode_bench

@pytest.mark.parametrize("options", [dict(), dict(n_kv_heads=2), dict(n_kv_heads=1,
                                                                       position="learned")],
                         ids=["mha", "gqa", "mqa+learned"])
def test_decode_rows_are_sane(device, options):
    model = tiny_model(device, **options)
    rows = run_decode_bench((2, 5), prompt_len=3, batch=2, model=model, repeats=2)
    assert [(r.new_tokens, r.prompt_len, r.repeats) for r in rows] == [(2, 3, 2), (5, 3, 2)]
    for r in rows:
        assert isinstance(r, DecodeRow) and r.device.startswith(device.type)
        assert r.cached_ms > 0 and r.uncached_ms > 0 and r.speedup > 0
        assert r.speedup_spread is None and r.withheld.startswith(NOT_SETTLED)  # 2 rounds
        assert r.cached_tokens_per_s == pytest.approx(r.new_tokens * 2 / r.cached_ms * 1e3)
        assert r.uncached_tokens_per_s == pytest.approx(r.new_tokens * 2 / r.uncached_ms * 1e3)
        # The caches generate allocates: the prompt and every new token but the last.
        expected = cache_bytes(model.config, 2, r.prompt_len + r.new_tokens - 1)
        assert r.cache_mib * MIB == expected
        for peak in (r.cached_peak_mib, r.uncached_peak_mib):
            assert peak is None or peak >= 0


def fake_clock(monkeypatch, load):
    """Each run's time is 1 ms with the cache and 8 ms without, times ``load(n)`` at the n-th
    timed run; returns the list of which ran (True: with the cache)."""
    ran = []

    def time_call_ms(fn, device):
        ran.append(fn.__defaults__[0])            # runs[cached]: cached is its default
        return (1.0 if ran[-1] else 8.0) * load(len(ran) - 1)

    monkeypatch.setattr(decode_bench, "time_call_ms", time_call_ms)
    return ran


def test_a_load_that_hits_whole_rounds_leaves_the_speed_up(monkeypatch):
    ran = fake_clock(monkeypatch, lambda n: 10.0 if n // 2 in (1, 3) else 1.0)
    (row,) = run_decode_bench((3,), prompt_len=2, model=tiny_model(), repeats=5, memory=False)
    assert ran == [True, False, False, True] * 2 + [True, False]      # turns that alternate
    assert row.speedup == 8.0 and row.speedup_spread == 0.0 and row.withheld is None
    assert "8.0x" in format_decode_table([row]).splitlines()[2]


def test_a_speed_up_whose_rounds_disagree_is_withheld(monkeypatch):
    loads = [1.0, 3.0, 2.0, 1.0, 1.0, 5.0, 4.0, 1.0, 1.0, 1.0]
    fake_clock(monkeypatch, lambda n: loads[n])
    (row,) = run_decode_bench((3,), prompt_len=2, model=tiny_model(), repeats=5, memory=False)
    assert row.withheld.startswith(NOT_SETTLED) and row.speedup_spread > 0.15
    table = format_decode_table([row])
    assert "not settled" in table.splitlines()[2] and NOT_SETTLED in table


def test_cache_bytes_stop_growing_at_seq_len():
    model = tiny_model(seq_len=6)
    (row,) = run_decode_bench((10,), prompt_len=4, batch=1, model=model, repeats=1)
    assert row.cache_mib * MIB == cache_bytes(model.config, 1, 6)


def test_a_gqa_models_cache_is_h_kv_over_h_of_the_mha_ones():
    mha = run_decode_bench((4,), prompt_len=3, model=tiny_model(), repeats=1)[0]
    gqa = run_decode_bench((4,), prompt_len=3, model=tiny_model(n_kv_heads=1), repeats=1)[0]
    assert gqa.cache_mib * 4 == mha.cache_mib


def test_the_bench_refuses_to_time_a_cache_that_changes_the_tokens(monkeypatch):
    """It checks both paths give the same greedy tokens before timing them."""
    def broken(model, idx, n, **kwargs):
        out = generate(model, idx, n, **kwargs)
        return out + 1 if kwargs.get("use_cache") else out

    monkeypatch.setattr(decode_bench, "generate", broken)
    with pytest.raises(AssertionError, match="greedy tokens differ with and without the cache "
                                             "at N=3"):
        run_decode_bench((3,), prompt_len=2, model=tiny_model(), repeats=1)


def test_the_default_model_is_the_seeded_tiny_gpt_with_rope():
    model = decode_model()
    c = model.config
    assert (c.vocab_size, c.seq_len, c.position) == (64, 4096, "rope")
    assert (c.d_model, c.n_heads, c.n_layers) == (GPTConfig.d_model, GPTConfig.n_heads,
                                                   GPTConfig.n_layers)
    assert not model.training
    again = decode_model()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


@pytest.mark.parametrize("kwargs, message", [
    (dict(new_tokens=()), r"new_tokens must be a non-empty list of positive ints, got \[\]"),
    (dict(new_tokens=(4, 0)), r"new_tokens must be a non-empty list of positive ints"),
    (dict(new_tokens=(True,)), r"new_tokens must be a non-empty list of positive ints"),
    (dict(prompt_len=0), "prompt_len must be a positive int, got 0"),
    (dict(batch=-1), "batch must be a positive int, got -1"),
    (dict(repeats=0), "repeats must be a positive int, got 0"),
])
def test_decode_bench_refuses_bad_options(kwargs, message):
    args = dict(new_tokens=(2,), prompt_len=2, batch=1, repeats=1, model=tiny_model())
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        run_decode_bench(args.pop("new_tokens"), **args)


# ---------------------------------------------------------------- run_cache_update_bench

def test_cache_update_rows_are_sane(device):
    rows = run_cache_update_bench((8, 64), heads=2, head_dim=4, calls=3, repeats=2,
                                  device=device)
    assert [r.cached_len for r in rows] == [8, 64]
    for r in rows:
        assert isinstance(r, CacheUpdateRow) and r.device.startswith(device.type)
        assert r.inplace_us > 0 and r.cat_us > 0


def test_appends_are_timed_in_rounds_and_each_ways_ratio_is_taken_per_round(monkeypatch):
    """Fake clock: in place costs 3 us at any length, torch.cat length / 100 us; the second
    round runs 10x slower. Each round's ratio to the first length is exact, so are the medians."""
    ran = []

    def time_call_ms(fn, device):
        length = (fn.__defaults__[1] if fn.__name__ == "inplace"
                  else fn.__defaults__[0].shape[2])
        ran.append((fn.__name__, length))
        cost_us = 3.0 if fn.__name__ == "inplace" else length / 100
        round_load = 10.0 if 4 <= len(ran) - 1 < 8 else 1.0      # calls 4-7: the second round
        return cost_us * round_load * 5 / 1e3                      # 5 appends per call, in ms

    monkeypatch.setattr(decode_bench, "time_call_ms", time_call_ms)
    rows = run_cache_update_bench((100, 3200), heads=1, head_dim=2, calls=5, repeats=5)
    assert ran[:4] == [("inplace", 100), ("concatenate", 100), ("inplace", 3200),
                       ("concatenate", 3200)]
    assert ran[4:8] == [("concatenate", 100), ("inplace", 3200), ("concatenate", 3200),
                        ("inplace", 100)]                          # the order rotates
    assert [(r.inplace_ratio, r.cat_ratio, r.withheld) for r in rows] == [
        (1.0, 1.0, None), (1.0, 32.0, None)]
    assert rows[1].cat_us == pytest.approx(32.0)


def test_too_few_rounds_withhold_the_append_ratios():
    rows = run_cache_update_bench((8, 64), heads=2, head_dim=4, calls=3, repeats=2)
    assert (rows[0].inplace_ratio, rows[0].cat_ratio) == (1.0, 1.0)
    assert rows[1].inplace_ratio is None and rows[1].withheld.startswith(NOT_SETTLED)


@pytest.mark.parametrize("kwargs, message", [
    (dict(heads=0), "heads must be a positive int, got 0"),
    (dict(head_dim=2.5), "head_dim must be a positive int, got 2.5"),
    (dict(calls=0), "calls must be a positive int, got 0"),
    (dict(repeats=True), "repeats must be a positive int, got True"),
])
def test_cache_update_bench_refuses_bad_counts(kwargs, message):
    args = dict(calls=1, repeats=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        run_cache_update_bench((8,), **args)


@pytest.mark.parametrize("lens", [(), (0,), (8, -1)])
def test_cache_update_bench_refuses_bad_lengths(lens):
    with pytest.raises(ValueError, match="cached_lens must be a non-empty list of positive ints"):
        run_cache_update_bench(lens, calls=1, repeats=1)


# ---------------------------------------------------------------- tables

def test_tables_show_every_row():
    decode = [DecodeRow(64, 16, 10.0, 80.0, 8.0, 6400.0, 800.0, 0.125, 1.5, None, 3, "cpu"),
              DecodeRow(256, 16, 40.0, 800.0, 20.0, 6400.0, 320.0, 0.5, 2.0, 3.0, 3, "cpu")]
    text = format_decode_table(decode)
    lines = text.splitlines()
    assert len(lines) == 6 and "speed-up" in lines[0] and set(lines[1]) <= {"-", " "}
    assert lines[4].startswith("speed-up: the median over rounds")
    assert "8.0x" in lines[2] and "20.0x" in lines[3] and "0.125" in lines[2]
    assert lines[2].split()[-1] == "-"                        # a peak that was not measured
    updates = format_update_table([
        CacheUpdateRow(512, 3.3, 40.0, "cpu", 1.0, 1.0),
        CacheUpdateRow(16384, 3.5, 900.0, "cpu", None, None, f"{NOT_SETTLED} (spread 0.40)")])
    lines = updates.splitlines()
    assert len(lines) == 6 and "torch.cat" in lines[0]
    assert lines[4].startswith("us: microseconds per append; x first:")
    assert lines[5].endswith(NOT_SETTLED)
    assert lines[2].split() == ["512", "3.3", "1.00", "40.0", "1.00"]
    assert lines[3].split() == ["16384", "3.5", "-", "900.0", "-"]


# ---------------------------------------------------------------- the command line

def test_cli_decode_prints_both_tables_and_writes_json(tmp_path, capsys):
    path = tmp_path / "decode.json"
    assert main(TINY_DECODE + ["--batch", "2", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "speed-up" in printed and "torch.cat" in printed and "B=2" in printed
    report = json.loads(path.read_text())
    assert {"hardware", "elapsed_s", "config", "prompt_len", "decode",
            "cache_update"} <= set(report)
    assert report["prompt_len"] == 4 and report["config"]["position"] == "rope"
    assert [r["new_tokens"] for r in report["decode"]] == [2, 3]
    assert set(report["decode"][0]) == {f.name for f in dataclasses.fields(DecodeRow)}
    config = GPTConfig(**report["config"])
    for r in report["decode"]:
        assert r["speedup"] is None and r["withheld"].startswith(NOT_SETTLED)   # 1 round
        assert r["repeats"] == 1 and r["uncached_ms"] > 0
        assert r["cache_mib"] * MIB == cache_bytes(config, 2, 4 + r["new_tokens"] - 1)
    assert [r["cached_len"] for r in report["cache_update"]] == [8, 32]
    assert all(r["inplace_us"] > 0 and r["cat_us"] > 0 for r in report["cache_update"])


def test_cli_decode_uses_the_model_backend(tmp_path, capsys):
    path = tmp_path / "decode.json"
    assert main(TINY_DECODE + ["--model-backend", "sdpa", "--json", str(path)]) == 0
    assert "backend='sdpa'" in capsys.readouterr().out
    assert json.loads(path.read_text())["config"]["backend"] == "sdpa"


@pytest.mark.parametrize("option, value, message", [
    ("--new-tokens", "0", "--new-tokens must be a non-empty list of positive ints"),
    ("--prompt-len", "0", "--prompt-len must be a positive int, got 0"),
    ("--batch", "0", "--batch must be a positive int, got 0"),
    ("--repeats", "0", "--repeats must be a positive int, got 0"),
    ("--cache-lens", "-4", "--cache-lens must be a non-empty list of positive ints"),
    ("--heads", "0", "--heads must be a positive int, got 0"),
    ("--device", "toaster", "not a device: 'toaster'"),
])
def test_cli_decode_bad_options_exit_2_in_one_line(capsys, option, value, message):
    argv = list(TINY_DECODE)
    if option in argv:
        i = argv.index(option)
        argv[i + 1] = value
        if option in ("--new-tokens", "--cache-lens"):
            del argv[i + 2]
    else:
        argv += [option, value]
    assert main(argv) == 2
    assert message in one_line_error(capsys)


def test_cli_decode_unwritable_json_is_a_one_line_error(tmp_path, capsys):
    code = main(TINY_DECODE + ["--json", str(tmp_path / "no" / "such" / "folder.json")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write" in err


def test_decode_runs_as_a_module(tmp_path):
    path = tmp_path / "decode.json"
    done = subprocess.run([sys.executable, "-m", "course_attn.bench", *TINY_DECODE,
                           "--json", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "speed-up" in done.stdout and "torch.cat" in done.stdout
    report = json.loads(path.read_text())
    assert [r["new_tokens"] for r in report["decode"]] == [2, 3]
    assert [r["cached_len"] for r in report["cache_update"]] == [8, 32]


def test_decode_bad_option_as_a_module_is_one_line_without_traceback():
    done = subprocess.run([sys.executable, "-m", "course_attn.bench", "--decode",
                           "--new-tokens", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "--new-tokens must be a non-empty list of positive ints" in done.stderr
