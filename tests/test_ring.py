"""Ring attention (course_attn.ring) against single-process attention.

Starting processes dominates the time (each imports torch), so spawns are few: one group of 4
ranks runs every case in-process on the whole group and on two subgroups (2 and 3 ranks, group
ranks unlike global ranks), and ``run_ring_attention`` itself runs twice on a case that combines
B=2, GQA and Dv != D. The worker functions below are module-level so that the spawned processes
can import them. The error paths (a failing worker, one that dies, one that hangs) each use a
group of 2; input validation needs no process at all.
"""

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

import course_attn as ca
from course_attn import ring
from course_attn.ring import ring_attention, run_ring_attention

TOL = dict(atol=1e-5, rtol=1e-5)

# Per-rank block lengths: Tb queries and Tkb keys on each rank.
CASES = [
    dict(b=2, hq=2, hkv=2, tb=8, tkb=8, d=8, dv=8),                      # plain multi-head, B=2
    dict(b=2, hq=4, hkv=2, tb=8, tkb=8, d=8, dv=8, enable_gqa=True),     # GQA
    dict(b=1, hq=2, hkv=2, tb=8, tkb=8, d=8, dv=12),                     # Dv != D
    dict(b=2, hq=4, hkv=2, tb=6, tkb=6, d=16, dv=4, enable_gqa=True, scale=0.3),
    dict(b=1, hq=2, hkv=1, tb=5, tkb=5, d=8, dv=8, enable_gqa=True, dtype=torch.float64),
    dict(b=2, hq=2, hkv=2, tb=4, tkb=8, d=8, dv=8),                      # Tq != Tk, not causal
]
SUBGROUPS = ([1, 3], [0, 2, 3])    # of a world of 4


def _inputs(case: dict, n: int, seed: int):
    """Whole-sequence q (B, Hq, n·Tb, D), k (B, Hkv, n·Tkb, D), v (B, Hkv, n·Tkb, Dv)."""
    g = torch.Generator().manual_seed(seed)
    dtype = case.get("dtype", torch.float32)
    q = torch.randn(case["b"], case["hq"], n * case["tb"], case["d"], generator=g, dtype=dtype)
    k = torch.randn(case["b"], case["hkv"], n * case["tkb"], case["d"], generator=g, dtype=dtype)
    v = torch.randn(case["b"], case["hkv"], n * case["tkb"], case["dv"], generator=g, dtype=dtype)
    return q, k, v


def _expected_checks(world_size: int) -> list[int]:
    """How many (group, is_causal, case) checks each global rank runs in ``_cases_worker``."""
    per_group = sum(1 + (case["tb"] == case["tkb"]) for case in CASES)
    return [per_group * (1 + sum(r in ranks for ranks in SUBGROUPS)) for r in range(world_size)]


def _cases_worker(checks: torch.Tensor) -> None:
    """Every case, causal and not, on the whole group and on each subgroup; counts into checks."""
    rank = dist.get_rank()
    groups = [(None, list(range(dist.get_world_size())))]
    groups += [(dist.new_group(ranks), ranks) for ranks in SUBGROUPS]   # all ranks must call
    count = 0
    for group, ranks in groups:
        if rank not in ranks:
            continue
        n, r = len(ranks), ranks.index(rank)
        for is_causal in (False, True):
            for i, case in enumerate(CASES):
                if is_causal and case["tb"] != case["tkb"]:
                    continue
                q, k, v = _inputs(case, n, seed=i)
                kw = dict(is_causal=is_causal, scale=case.get("scale"),
                          enable_gqa=case.get("enable_gqa", False))
                out = ring_attention(*(x.tensor_split(n, dim=2)[r] for x in (q, k, v)),
                                     group=group, **kw)
                expected = ca.scaled_dot_product_attention(q, k, v, **kw).tensor_split(n, dim=2)[r]
                torch.testing.assert_close(out, expected, **TOL, msg=lambda m: (
                    f"ranks {ranks}, is_causal={is_causal}, case {i} {case}: {m}"))
                count += 1
    checks[rank] = count


def test_ring_attention_every_case_on_groups_and_subgroups():
    checks = torch.zeros(4, dtype=torch.int64).share_memory_()
    ring._spawn_group(_cases_worker, [(checks,)] * 4, timeout_s=120)
    assert checks.tolist() == _expected_checks(4)


@pytest.mark.parametrize("world_size, is_causal, t, tk", [(2, True, 24, 24), (4, False, 16, 32)])
def test_run_ring_attention_equals_attention(world_size, is_causal, t, tk):
    g = torch.Generator().manual_seed(world_size)
    q = torch.randn(2, 4, t, 8, generator=g)
    k = torch.randn(2, 2, tk, 8, generator=g)
    v = torch.randn(2, 2, tk, 12, generator=g)
    before = [x.clone() for x in (q, k, v)]
    out = run_ring_attention(q, k, v, world_size=world_size, is_causal=is_causal,
                             enable_gqa=True)
    expected = ca.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    assert out.shape == (2, 4, t, 12)
    torch.testing.assert_close(out, expected, **TOL)
    for x, x0 in zip((q, k, v), before):
        torch.testing.assert_close(x, x0, atol=0, rtol=0)
    assert multiprocessing.active_children() == []


# --- errors in the workers ---------------------------------------------------------------------


def _failing_worker() -> None:
    """Rank 1 raises; rank 0 waits for a message from rank 1 that never comes."""
    if dist.get_rank() == 1:
        raise ValueError("boom from the test")
    dist.recv(torch.empty(1), src=1)


def _dying_worker() -> None:
    if dist.get_rank() == 0:
        os._exit(3)
    time.sleep(60)


def _hanging_worker() -> None:
    time.sleep(60)


def test_worker_exception_is_a_runtime_error_naming_the_rank():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 failed: ValueError: boom from the test"):
        ring._spawn_group(_failing_worker, [(), ()], timeout_s=60)
    assert time.monotonic() - start < 50       # reported at once, not after the timeout
    assert multiprocessing.active_children() == []


def test_worker_that_dies_is_a_runtime_error_naming_the_rank():
    with pytest.raises(RuntimeError, match=r"rank 0 failed: .*exit code 3"):
        ring._spawn_group(_dying_worker, [(), ()], timeout_s=60)
    assert multiprocessing.active_children() == []


def test_timeout_stops_the_workers():
    with pytest.raises(TimeoutError, match="timeout_s=3"):
        ring._spawn_group(_hanging_worker, [(), ()], timeout_s=3)
    assert multiprocessing.active_children() == []


# --- validation, no processes needed -----------------------------------------------------------


def _qkv(t=8, tk=None, hq=2, hkv=2, d=4, dv=4, **kw):
    tk = t if tk is None else tk
    return (torch.randn(1, hq, t, d, **kw), torch.randn(1, hkv, tk, d, **kw),
            torch.randn(1, hkv, tk, dv, **kw))


def test_run_ring_attention_t_not_divisible():
    with pytest.raises(ValueError, match=r"world_size=3.*T=8"):
        run_ring_attention(*_qkv(8), world_size=3)
    with pytest.raises(ValueError, match=r"Tk=10"):
        run_ring_attention(*_qkv(8, tk=10), world_size=4)


@pytest.mark.parametrize("bad, match", [
    (dict(world_size=0), "world_size must be a positive int"),
    (dict(world_size=2.0), "world_size must be a positive int"),
    (dict(world_size=2, timeout_s=0), "timeout_s must be a number > 0"),
    (dict(world_size=2, is_causal=True, tk=16), "T == Tk"),
    (dict(world_size=2, hq=4), "enable_gqa=True"),
    (dict(world_size=2, device="meta"), "on the CPU"),
])
def test_run_ring_attention_rejects_bad_input_before_spawning(bad, match):
    bad = dict(bad)
    tensor_kw = {key: bad.pop(key) for key in ("tk", "hq", "device") if key in bad}
    with pytest.raises(ValueError, match=match):
        run_ring_attention(*_qkv(**tensor_kw), **bad)
    assert multiprocessing.active_children() == []


def test_run_ring_attention_is_forward_only():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="forward-only"):
        run_ring_attention(q.requires_grad_(), k, v, world_size=2)


def test_ring_attention_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"init_process_group.*run_ring_attention"):
        ring_attention(*_qkv())


@pytest.fixture
def group_of_one():
    """A gloo group of this process alone (world size 1), torn down afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("is_causal", [False, True])
def test_ring_of_one_rank_is_attention(group_of_one, is_causal):
    q, k, v = _qkv(hq=4, dv=6)
    out = ring_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    expected = ca.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    torch.testing.assert_close(out, expected, **TOL)


def test_ring_attention_rejects_bad_input(group_of_one):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="forward-only"):
        ring_attention(q, k.requires_grad_(), v)
    with torch.no_grad():                            # no graph is built, so it may run
        ring_attention(q, k, v)
    with pytest.raises(ValueError, match=r"head dim mismatch"):
        ring_attention(q, k.detach()[..., :2], v)
    with pytest.raises(ValueError, match=r"one length.*\(1, 2, 8, 4\).*\(1, 2, 16, 4\)"):
        ring_attention(*_qkv(8, tk=16), is_causal=True)
