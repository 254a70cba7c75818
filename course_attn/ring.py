"""Ring attention: one sequence split over n processes, K/V blocks passed around a ring (ch. 9).

Ring attention (Liu et al., 2023) attends over a sequence too long for one device. With n ranks,
rank r holds the r-th contiguous block of the sequence: its queries q (B, Hq, Tb, D), keys
k (B, Hkv, Tb, D) and values v (B, Hkv, Tb, Dv), T = n·Tb in all. The ranks form a ring. At each
of n steps every rank

1. starts sending the key/value block it holds to rank (r + 1) % n and receiving the next one
   from rank (r - 1) % n (non-blocking, so that the transfer overlaps the arithmetic);
2. attends with its queries to the block it holds, which gives a partial state: the output
   ``out`` (B, Hq, Tb, Dv) and the log-sum-exp ``lse`` (B, Hq, Tb) over those keys alone;
3. merges that state into its running one with ``flash.merge_attention_states``;
4. waits for the transfer, and holds the block that came from its left.

After step s rank r holds the block of rank (r - s) % n, so after n steps it has met every block
and holds rows r·Tb .. (r+1)·Tb - 1 of attention over the whole sequence. The result is exact,
not an approximation: the merge of (out, lse) states over disjoint key sets is associative and
commutative and equals attention over their union, whatever the order the blocks arrive in
(chapter 9 proves it), and a state over no keys (lse = -inf) is its identity. No rank ever holds
more than two key/value blocks, so memory per rank is O(T/n) however long the sequence.

With ``is_causal``, the block that came from rank src is seen through the causal (square,
diagonal) mask when src == r, in full when src < r (earlier positions), and not at all when
src > r (later positions): that step computes nothing, and the block is still passed on. This is
the tiled forward's skipping of tiles above the diagonal, one level up.

- ``ring_attention``: the algorithm, called on every rank of an initialised
  ``torch.distributed`` process group; tensors stay on their device. It only sends and receives
  point to point, which gloo offers on CPUs and NCCL on GPUs, but it is run and tested over gloo
  on CPUs only (tests/test_ring.py), never over NCCL. Forward only.
- ``run_ring_attention``: for notebooks and tests: takes the whole sequence on the CPU, starts
  ``world_size`` processes (``spawn``) that form a gloo group on 127.0.0.1, runs
  ``ring_attention`` in each and returns the concatenated output.
"""

import math
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing.connection import wait as _wait_any
from torch import Tensor

from .arguments import check_positive_ints
from .attention import _accumulation_dtype, check_attention_inputs
from .flash import flash_attention, merge_attention_states

__all__ = ["ring_attention", "run_ring_attention"]


# --- the algorithm, on every rank --------------------------------------------------------------


def _check_forward_only(q: Tensor, k: Tensor, v: Tensor, name: str) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError(f"{name} is forward-only in this course (no gradient flows between "
                         "processes), but an input requires grad; pass detached tensors or call "
                         "it under torch.no_grad()")


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool = False, scale: float | None = None,
    enable_gqa: bool = False, group: "dist.ProcessGroup | None" = None,
) -> Tensor:
    """This rank's output rows of attention over a sequence split into blocks across a group.

    Call it on every rank of ``group`` (None: the default group) of an initialised
    ``torch.distributed`` process group. Rank r passes its own block of the sequence:
    q (B, Hq, Tb, D), k (B, Hkv, Tk_b, D), v (B, Hkv, Tk_b, Dv), every rank blocks of the same
    shapes, and gets back out (B, Hq, Tb, Dv): rows r·Tb .. (r+1)·Tb - 1 of
    ``attention.scaled_dot_product_attention`` over the concatenated q, k, v. ``is_causal``
    needs Tb == Tk_b (query and key blocks cover the same positions). ``scale`` and
    ``enable_gqa`` as in the shared signature; no ``attn_mask`` or ``window``.

    n steps (n = the group's size); at each, the key/value block held (K and V packed into one
    contiguous buffer, so one message per step) is sent to rank (r + 1) % n and the next one
    received from rank (r - 1) % n with ``batch_isend_irecv``, started before the step's
    ``flash_attention(..., return_lse=True)`` and waited for after it, so that the transfer
    overlaps the arithmetic; the partial states are merged with ``merge_attention_states``.
    Half precision is accumulated in float32 and returned in q's dtype.

    Every rank must call it with the same options. Tested over gloo only; over NCCL (untested
    here), each rank would first call ``torch.cuda.set_device``, as for any NCCL point-to-point
    operation.

    Forward only: a ValueError when an input requires grad while gradients are enabled. A
    ValueError, too, when no process group is initialised, and (naming the shapes) for inputs
    that do not fit the signature.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("ring_attention needs an initialised process group: call "
                         "torch.distributed.init_process_group(...) on every rank first, or use "
                         "run_ring_attention(q, k, v, world_size=n), which starts the processes")
    check_attention_inputs(q, k, v, scale=scale, enable_gqa=enable_gqa)
    if is_causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal ring attention needs query and key blocks of one length; got "
                         f"q {tuple(q.shape)} and k {tuple(k.shape)}")
    _check_forward_only(q, k, v, "ring_attention")
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this process is not a member of the group passed to ring_attention")

    d = k.shape[-1]
    held = torch.cat([k, v], dim=-1).contiguous()     # (B, Hkv, Tk_b, D + Dv): one message
    incoming = torch.empty_like(held) if n > 1 else None
    out = lse = None
    for step in range(n):
        src = (rank - step) % n                       # whose block this rank now holds
        pending = []
        if step < n - 1:                              # after the last step nobody needs it
            pending = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, held, group=group, group_peer=(rank + 1) % n),
                dist.P2POp(dist.irecv, incoming, group=group, group_peer=(rank - 1) % n),
            ])
        if not (is_causal and src > rank):            # a later block: nothing to see, skip it
            part_out, part_lse = flash_attention(
                q, held[..., :d], held[..., d:], is_causal=is_causal and src == rank,
                scale=scale, enable_gqa=enable_gqa, return_lse=True)
            if out is None:                           # step 0 (src == rank) always computes
                out, lse = part_out.to(_accumulation_dtype(q.dtype)), part_lse
            else:
                out, lse = merge_attention_states(out, lse, part_out, part_lse)
        for work in pending:
            work.wait()
        if pending:
            held, incoming = incoming, held           # the sent buffer receives next time
    return out.to(q.dtype)


# --- running it in local processes -------------------------------------------------------------


def _bootstrap(rank: int, world_size: int, port: int, timeout_s: float, target, args,
               conn) -> None:
    """A worker process: join the gloo group, run ``target(*args)``, report through ``conn``.

    Sends None on success, or (time, short message, traceback) on an exception; the report is
    sent before the process group is torn down, so the failing rank speaks before its peers
    notice that it has gone.
    """
    torch.set_num_threads(1)
    timeout = timedelta(seconds=timeout_s)
    report = None
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        target(*args)
    except BaseException as error:          # noqa: BLE001 - everything goes back to the parent
        report = (time.time(), f"{type(error).__name__}: {error}", traceback.format_exc())
    try:
        conn.send(report)
        conn.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _ring_worker(q: Tensor, k: Tensor, v: Tensor, out: Tensor, is_causal: bool,
                 scale: float | None, enable_gqa: bool) -> None:
    """One rank of ``run_ring_attention``: its output block written into shared ``out``."""
    out.copy_(ring_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa))


def _failure(rank: int, message: str, details: str = "") -> RuntimeError:
    return RuntimeError(f"ring attention worker rank {rank} failed: {message}"
                        + (f"\n\nworker traceback (rank {rank}):\n{details}" if details else ""))


_DIED = object()      # what _collect records for a worker that exited without a report


def _collect(procs, conns, deadline: float, timeout_s: float) -> None:
    """Wait until every worker has reported success; raise on a failure or at the deadline."""
    pending = set(range(len(procs)))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"ring attention workers (ranks {sorted(pending)}) did not finish "
                               f"within timeout_s={timeout_s} s; they were stopped")
        _wait_any([conns[r] for r in pending] + [procs[r].sentinel for r in pending],
                  timeout=remaining)
        failures = []
        for rank in sorted(pending):
            if conns[rank].poll():                    # a report, or EOF if it died silently
                try:
                    report = conns[rank].recv()
                except EOFError:
                    report = _DIED
            elif not procs[rank].is_alive():
                report = _DIED
            else:
                continue
            if report is None:
                pending.discard(rank)
            elif report is _DIED:
                procs[rank].join(1)
                failures.append((math.inf, rank, _failure(
                    rank, f"the process exited (exit code {procs[rank].exitcode}) without a "
                    "report; see its stderr. A script that calls run_ring_attention must do so "
                    "under `if __name__ == '__main__':`, as the workers are spawned")))
            else:
                when, message, details = report
                failures.append((when, rank, _failure(rank, message, details)))
        if failures:                                  # the earliest is the cause, not an echo
            raise min(failures, key=lambda f: (f[0], f[1]))[2]


def _spawn_group(target, args_by_rank: list[tuple], *, timeout_s: float) -> None:
    """Start one spawned process per entry of ``args_by_rank``, join them in a gloo group on
    127.0.0.1 and run ``target(*args)`` in each, ``target`` a module-level function.

    The parent hosts the group's TCPStore on a free port (bound as port 0, so no other process
    can take it in between). A worker's exception is a RuntimeError here, naming its rank; past
    ``timeout_s`` a TimeoutError. Either way, and on success, no worker outlives the call.
    """
    world_size = len(args_by_rank)
    deadline = time.monotonic() + timeout_s
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout,
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    try:
        for rank, args in enumerate(args_by_rank):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_bootstrap, name=f"ring-rank-{rank}", daemon=True,
                               args=(rank, world_size, store.port, timeout_s, target, args,
                                     writer))
            procs.append(proc)
            conns.append(reader)
            proc.start()
            writer.close()               # the child holds its own end: EOF when it dies
        _collect(procs, conns, deadline, timeout_s)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in conns:
            conn.close()
        del store


def run_ring_attention(
    q: Tensor, k: Tensor, v: Tensor, *, world_size: int, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False, timeout_s: float = 120,
) -> Tensor:
    """Ring attention over ``world_size`` local processes, for notebooks and tests.

    q: (B, Hq, T, D), k: (B, Hkv, Tk, D), v: (B, Hkv, Tk, Dv), the whole sequence, on the CPU
    -> (B, Hq, T, Dv), equal to ``scaled_dot_product_attention(q, k, v, ...)``. T and Tk must be
    multiples of ``world_size`` (and T == Tk with ``is_causal``). Rank r gets rows
    r·T/n .. (r+1)·T/n - 1 of q and of k, v.

    Starts ``world_size`` processes with the ``spawn`` start method (so it works from a Jupyter
    kernel; in a script, call it under ``if __name__ == "__main__":``), each with one thread,
    which form a gloo process group on 127.0.0.1 and run ``ring_attention``; their output blocks
    come back through shared memory and are concatenated in rank order. Startup dominates the
    time: each process spends about 1.2 s of CPU importing torch, so on 2 CPU cores a call takes
    about 2.5 s with 2 processes and 5 s with 4, whatever the (small) sequence.

    Raises ValueError before starting anything for bad inputs (shapes, T not a multiple of
    ``world_size``, a tensor not on the CPU or requiring grad); RuntimeError naming the rank and
    its error when a worker fails; TimeoutError after ``timeout_s`` seconds. The workers never
    outlive the call.
    """
    check_attention_inputs(q, k, v, scale=scale, enable_gqa=enable_gqa)
    check_positive_ints(world_size=world_size)
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
            or not timeout_s > 0):
        raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
    if q.device.type != "cpu":
        raise ValueError(f"run_ring_attention runs gloo processes on the CPU; got q on "
                         f"{q.device} (on GPUs, call ring_attention on every rank of an "
                         "NCCL group)")
    t, tk = q.shape[2], k.shape[2]
    if t % world_size or tk % world_size:
        raise ValueError(f"the sequence must split into world_size={world_size} equal blocks; "
                         f"got T={t} (q {tuple(q.shape)}) and Tk={tk} (k {tuple(k.shape)})")
    if is_causal and t != tk:
        raise ValueError(f"causal ring attention needs T == Tk; got q {tuple(q.shape)} and "
                         f"k {tuple(k.shape)}")
    _check_forward_only(q, k, v, "run_ring_attention")
    b, hq, dv = q.shape[0], q.shape[1], v.shape[-1]
    blocks = [x.detach().tensor_split(world_size, dim=2) for x in (q, k, v)]
    outs = [torch.empty(b, hq, t // world_size, dv, dtype=q.dtype).share_memory_()
            for _ in range(world_size)]
    # Clones: sending a tensor to a spawned process moves its storage to shared memory, and the
    # caller's tensors should come back as they went in.
    args = [(blocks[0][r].clone(), blocks[1][r].clone(), blocks[2][r].clone(), outs[r],
             bool(is_causal), scale, enable_gqa) for r in range(world_size)]
    _spawn_group(_ring_worker, args, timeout_s=timeout_s)
    return torch.cat(outs, dim=2)
