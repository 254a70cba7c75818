"""No process that a submission started outlives its grading.

A kernel can leave processes behind in its own process group (killed with the group), in a new
session or group of their own (``setsid``), or as orphans of a double fork. Two nets catch them
on Linux:

- every kernel runs with ``COURSE_ATTN_GRADING_RUN=<token>`` in its environment, inherited by
  whatever it starts; ``kill_marked(token)`` kills every process that carries it;
- the grading process becomes a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``), so an
  orphan is re-parented to it rather than to init, and ``kill_new_children(before)`` kills the
  children it did not have before grading began.

A process that both clears its environment and escapes the subreaper (it cannot: re-parenting is
done by the kernel of the OS) would need a container to stop; see the threat model in
``grader.py``.
"""

import ctypes
import os
import signal
from pathlib import Path

MARKER = "COURSE_ATTN_GRADING_RUN"
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (Linux only); whether it worked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _processes():
    """(pid, parent pid) of every process visible in /proc."""
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        yield int(entry.name), parent


def children(pid: int | None = None) -> set[int]:
    pid = os.getpid() if pid is None else pid
    return {child for child, parent in _processes() if parent == pid}


def _carries(pid: int, token: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{MARKER}={token}".encode() in environ.split(b"\0")


def _kill(pids) -> int:
    killed = 0
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:  # reap the ones that are our children, so no zombie stays
        try:
            os.waitpid(pid, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass
    return killed


def kill_marked(token: str) -> int:
    """Kill every process whose environment carries this grading run's token (repeated until
    none is left, since a process can fork while we look); how many were killed."""
    total = 0
    for _ in range(10):
        found = [pid for pid, _ in _processes() if _carries(pid, token)]
        if not found:
            break
        total += _kill(found)
    return total


def _own_helpers() -> set[int]:
    """Children that this process's own libraries keep (multiprocessing's resource tracker)."""
    try:
        from multiprocessing import resource_tracker
        pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    except Exception:
        pid = None
    return {pid} if pid else set()


def kill_new_children(before: set[int]) -> int:
    """Kill this process's children that were not among ``before`` (adopted orphans)."""
    total = 0
    for _ in range(10):
        found = children() - before - _own_helpers()
        if not found:
            break
        total += _kill(found)
    return total
