"""timing.py's statistics, on fake clocks: rounds that interleave every call, a ratio taken per
round that a load hitting one round cannot move, a spread that withholds a noisy ratio, and a
clock that does not count the time other programs took. No wall-clock time is asserted."""

import dataclasses
import itertools
import json
import time

import pytest
import torch

import course_attn.timing as timing
from course_attn.bench import main
from course_attn.timing import (
    MIN_ROUNDS, NOT_SETTLED, SPREAD_TOLERANCE, clock_name, format_table, measure, rounds_agree,
    rows_at, spread, time_call_ms, torch_threads, withheld_ratio,
)

COMMON = dict(batch=1, heads=1, head_dim=4, dtype="float32", is_causal=False, window=None,
              device="cpu", repeats=5)


class FakeMachine:
    """Calls whose time is their own cost times the machine's load at that moment.

    ``cost``: name -> ms on a quiet machine; ``load(n)``: the load factor during the n-th timed
    call (n counts every call, warm-up included). ``log`` records the names in call order.
    """

    def __init__(self, cost: dict, load=lambda n: 1.0):
        self.cost, self.load, self.log = cost, load, []

    def calls(self) -> dict:
        return {name: (lambda name=name: name) for name in self.cost}

    def time_call_ms(self, fn, device) -> float:
        name = fn()
        self.log.append(name)
        return self.cost[name] * self.load(len(self.log) - 1)


@pytest.fixture
def machine(monkeypatch):
    """Installs a FakeMachine as timing's clock and turns the memory measurement off."""
    def install(cost, load=lambda n: 1.0):
        fake = FakeMachine(cost, load)
        monkeypatch.setattr(timing, "time_call_ms", fake.time_call_ms)
        monkeypatch.setattr(timing, "peak_memory_bytes", lambda fn, device: None)
        return fake
    return install


QUIET = {"sdpa": 2.0, "flash": 3.0, "math": 16.0}   # ratios to sdpa: 1.5 and 8
WARM = 3 * 6          # warm-up calls on a quiet machine: six each, in turns, then they settle


def run(fake, repeats=5):
    return measure(fake.calls(), torch.device("cpu"), repeats, max_warmup=6)


def test_each_round_calls_every_name_once_in_an_order_that_rotates(machine):
    fake = machine(QUIET)
    run(fake)
    rounds = fake.log[WARM:]
    assert [rounds[i:i + 3] for i in range(0, 15, 3)] == [
        ["sdpa", "flash", "math"], ["flash", "math", "sdpa"], ["math", "sdpa", "flash"],
        ["sdpa", "flash", "math"], ["flash", "math", "sdpa"]]


def test_a_load_that_hits_whole_rounds_moves_the_times_not_the_ratios(machine):
    """Rounds 2 and 4 run while something else takes the machine (10x slower): every call of
    those rounds is slow, the times spread, each round's ratio is unchanged."""
    def load(n):
        return 10.0 if n >= WARM and (n - WARM) // 3 in (1, 3) else 1.0

    results = run(machine(QUIET, load))
    assert results["flash"].round_ratios == [1.5] * 5
    rows = {r.backend: r for r in rows_at(2048, results, **COMMON)}
    assert rows["flash"].time_ratio == 1.5 and rows["math"].time_ratio == 8.0
    assert rows["flash"].withheld is None and rows["flash"].ratio_spread == 0.0
    assert rows["flash"].time_spread > SPREAD_TOLERANCE and rows["flash"].settled is False


def test_a_load_that_hits_one_call_moves_one_rounds_ratio_and_not_their_median(machine):
    hit = WARM + 3 * 2 + 1        # the second call of the third round: sdpa's turn there
    fake = machine(QUIET, lambda n: 10.0 if n == hit else 1.0)
    results = run(fake)
    assert fake.log[hit] == "sdpa"
    assert results["flash"].round_ratios == [1.5, 1.5, 0.15, 1.5, 1.5]
    rows = {r.backend: r for r in rows_at(2048, results, **COMMON)}
    assert rows["flash"].time_ratio == 1.5 and rows["math"].time_ratio == 8.0


def test_a_time_is_the_median_of_its_rounds_not_the_fastest_round(machine):
    """Rounds run under loads 2, 1, 3, 5 and 4: flash takes 6, 3, 9, 15 and 12 ms, and its time is
    the middle one, 9 ms; the fastest round (3 ms) is what a quiet machine gave once, not what a
    call costs. The ratio, taken per round, stays 1.5."""
    loads = [2.0, 1.0, 3.0, 5.0, 4.0]

    def load(n):
        return loads[(n - WARM) // 3] if n >= WARM else 1.0

    results = run(machine(QUIET, load))
    assert results["flash"].times_ms == [6.0, 3.0, 9.0, 15.0, 12.0]
    assert results["flash"].time_ms == 9.0 and results["math"].time_ms == 48.0
    rows = {r.backend: r for r in rows_at(2048, results, **COMMON)}
    assert rows["flash"].time_ms == 9.0 and rows["sdpa"].time_ms == 6.0
    assert rows["flash"].time_ratio == 1.5
    table = next(line for line in format_table(list(rows.values())).splitlines()
                 if " flash " in line)
    assert " 9.00" in table, table


def test_a_ratio_that_does_not_settle_is_withheld_in_the_row_the_table_and_the_json(machine):
    noise = itertools.cycle([1.0, 4.0, 1.5, 9.0, 2.0, 1.0, 6.0])
    results = run(machine(QUIET, lambda n: next(noise)))
    rows = rows_at(2048, results, **COMMON)
    flash = next(r for r in rows if r.backend == "flash")
    assert flash.time_ratio is None and flash.ratio_spread > SPREAD_TOLERANCE
    assert flash.withheld.startswith(NOT_SETTLED)
    assert json.loads(json.dumps(dataclasses.asdict(flash)))["time_ratio"] is None
    table = format_table(rows)
    assert "not settled" in next(line for line in table.splitlines() if " flash " in line)
    assert NOT_SETTLED in table
    sdpa = next(r for r in rows if r.backend == "sdpa")
    assert sdpa.time_ratio == 1.0                      # the unit, by definition


def test_too_few_rounds_cannot_settle_a_ratio(machine):
    rows = rows_at(64, run(machine(QUIET), repeats=MIN_ROUNDS - 1), **COMMON)
    flash = next(r for r in rows if r.backend == "flash")
    assert flash.time_ratio is None and "fewer than" in flash.withheld


def test_a_backend_that_fails_midway_leaves_the_others_ratios(machine):
    fake = machine(QUIET)
    calls = fake.calls()
    state = {"n": 0}

    def fails_on_its_fourth_call():
        state["n"] += 1
        if state["n"] > 3:
            raise RuntimeError("out of memory")
        return "math"

    calls["math"] = fails_on_its_fourth_call
    results = measure(calls, torch.device("cpu"), 5, max_warmup=6)
    assert results["math"] == "RuntimeError: out of memory"
    assert results["flash"].round_ratios == [1.5] * 5


def test_the_cli_json_withholds_an_unsettled_ratio(monkeypatch, tmp_path, capsys):
    noise = itertools.cycle([1.0, 4.0, 1.5, 9.0, 2.0, 1.0, 6.0])
    monkeypatch.setattr(timing, "time_call_ms", lambda fn, device: (fn(), next(noise))[1])
    path = tmp_path / "bench.json"
    assert main(["--seq-lens", "8", "--heads", "1", "--head-dim", "4", "--repeats", "5",
                 "--max-warmup", "2", "--backends", "math", "sdpa", "--device", "cpu",
                 "--json", str(path)]) == 0
    assert NOT_SETTLED in capsys.readouterr().out
    math_row = json.loads(path.read_text())["rows"][0]
    assert math_row["backend"] == "math" and math_row["time_ratio"] is None
    assert math_row["withheld"].startswith(NOT_SETTLED)


@pytest.mark.parametrize("values, expected", [
    ([1.0, 2.0, 3.0, 4.0, 5.0], 2.0 / 3.0),    # quartiles 2 and 4, median 3
    ([2.0, 2.0, 2.0], 0.0),
    ([1.0, 3.0, 2.0], 0.5),                     # quartiles 1.5 and 2.5, median 2
    ([1.0, 2.0], None),                         # too few to say
])
def test_spread_is_the_interquartile_range_over_the_median(values, expected):
    assert spread(values) == (expected if expected is None else pytest.approx(expected))


def test_rounds_agree_within_the_tolerance_and_not_beyond():
    assert rounds_agree([1.0, 1.05, 1.1, 0.95, 1.0])
    assert rounds_agree([1.0, 9.0, 1.1, 0.95, 1.0])      # one round hit: the middle half agrees
    assert not rounds_agree([0.7, 1.0, 1.3, 0.8, 1.2])
    assert not rounds_agree([1.0, 1.0])
    assert withheld_ratio([1.5, 1.4, 1.6, 1.5, 1.5]) == (1.5, None)
    assert withheld_ratio(None)[0] is None


def test_one_thread_reads_the_processor_clock_which_does_not_count_waiting():
    """Sleeping is what a call looks like while other programs hold the processor."""
    with torch_threads(1):
        assert clock_name("cpu") == "processor"
        assert time_call_ms(lambda: time.sleep(0.05), torch.device("cpu")) < 25
    with torch_threads(2):
        assert clock_name("cpu") == "wall"
        assert time_call_ms(lambda: time.sleep(0.05), torch.device("cpu")) >= 50


def test_torch_threads_gives_the_setting_back():
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"), torch_threads(0):
        pass
    assert torch.get_num_threads() == before
