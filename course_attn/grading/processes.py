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
import time
from dataclasses import dataclass
from pathlib import Path

MARKER = "COURSE_ATTN_GRADING_RUN"
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (Linux only); whether it worked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def is_subreaper() -> bool:
    """Whether this process adopts its orphaned descendants (see ``become_subreaper``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        flag = ctypes.c_int(0)
        return libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and \
            bool(flag.value)
    except (OSError, AttributeError):
        return False


def _processes():
    """(pid, parent pid) of every process visible in /proc."""
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        ppid = parent(int(entry.name))
        if ppid is not None:
            yield int(entry.name), ppid


def parent(pid: int) -> int | None:
    """The parent of process ``pid``; None when it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class ThreadState:
    """A thread as ``/proc/<pid>/task/<tid>/`` shows it: its name, its state letter (R:
    running or ready to run), the processor time it has used, in clock ticks, and its id in its
    own PID namespace (the one the process itself sees: ``threading.get_native_id()``)."""

    name: str
    state: str
    ticks: int
    inner: int


def threads(pid: int) -> dict[int, ThreadState]:
    """Thread id -> state of every thread of process ``pid``; {} when it is gone."""
    found = {}
    for task in Path(f"/proc/{pid}/task").glob("*") if pid else ():
        try:
            stat = (task / "stat").read_text()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            inner = next((int(line.split()[-1]) for line in
                          (task / "status").read_text().splitlines()
                          if line.startswith("NSpid:")), int(task.name))
            found[int(task.name)] = ThreadState(name, fields[0], int(fields[11]) + int(fields[12]),
                                                inner)
        except (OSError, ValueError, IndexError):
            continue
    return found


def children(pid: int | None = None) -> set[int]:
    pid = os.getpid() if pid is None else pid
    return {child for child, parent in _processes() if parent == pid}


def _carries(pid: int, token: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{MARKER}={token}".encode() in environ.split(b"\0")


def _signal(pids, signum) -> set[int]:
    """Send ``signum`` to each of ``pids`` (never this process); the ones it reached."""
    reached = set()
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, signum)
            reached.add(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return reached


def _reap(killed: set[int]) -> None:
    """Collect those of ``killed`` that are this process's children, so that no zombie stays
    (only those: another task of this process may be waiting for its own child's status)."""
    for pid in children() & killed:
        try:
            os.waitpid(pid, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass


def _descendants(roots: set[int], parents: dict[int, int]) -> set[int]:
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found and child not in roots:
                found.add(child)
                todo.append(child)
    return found


def _kill_all(select, rounds: int = 50) -> int:
    """Kill the processes that ``select(parents)`` names, with all their descendants: each
    round stops them first (a stopped process cannot fork), takes in the children they made
    meanwhile, then kills them all; rounds go on until a look finds none. How many were
    killed."""
    killed: set[int] = set()
    for _ in range(rounds):
        parents = dict(_processes())
        found = set(select(parents))
        found |= _descendants(found, parents)
        found -= killed | {os.getpid()}
        found = {pid for pid in found if _state(pid) not in ("Z", "X", None)}
        if not found:
            break
        stopped = _signal(found, signal.SIGSTOP)
        while True:  # children made before the stop landed
            parents = dict(_processes())
            more = _descendants(stopped, parents) - stopped - killed - {os.getpid()}
            if not more:
                break
            stopped |= _signal(more, signal.SIGSTOP)
        killed |= _signal(stopped, signal.SIGKILL)
        _reap(killed)
    _reap(killed)
    return len(killed)


def reap_adopted(pids, wait_s: float = 2.0) -> None:
    """Collect ``pids``, processes this one adopted as a subreaper (bubblewrap's init, orphaned
    when the sandbox's outer process ends), once they have ended: else each stays a zombie
    for as long as this process lives. Waits up to ``wait_s`` for them to end."""
    deadline = time.monotonic() + wait_s
    left = {pid for pid in pids if pid}
    while left:
        for pid in list(left):
            if parent(pid) != os.getpid():  # gone, or not (yet, or any longer) ours
                if _state(pid) is None or time.monotonic() > deadline:
                    left.discard(pid)
                continue
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    left.discard(pid)
            except ChildProcessError:
                left.discard(pid)
        if left and time.monotonic() > deadline:
            break
        if left:
            time.sleep(0.02)


def _state(pid: int) -> str | None:
    """The state letter of ``pid`` in /proc (R, S, Z, ...), or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def kill_marked(token: str) -> int:
    """Kill every process whose environment carries this grading run's token, and all their
    descendants (whatever environment they gave themselves); how many were killed."""
    return _kill_all(lambda parents: [pid for pid in parents if _carries(pid, token)])


def _own_helpers() -> set[int]:
    """Children that this process's own libraries keep (multiprocessing's resource tracker)."""
    try:
        from multiprocessing import resource_tracker
        pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    except Exception:
        pid = None
    return {pid} if pid else set()


def kill_new_children(before: set[int]) -> int:
    """Kill this process's children that were not among ``before`` (adopted orphans), and all
    their descendants."""
    me, helpers = os.getpid(), _own_helpers()
    return _kill_all(lambda parents: [pid for pid, parent in parents.items()
                                      if parent == me and pid not in before and
                                      pid not in helpers])


def namespace_pid(pid: int) -> int | None:
    """The pid of process ``pid`` in its own PID namespace (the last field of ``NSpid``)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` in the process tree."""
    return _descendants({pid}, dict(_processes()))


def end_all_but(root: int, keep: set[int], token: str | None = None) -> int:
    """Kill every descendant of ``root`` that is not in ``keep`` and, with ``token``, every
    process that carries it (``keep`` and ``root`` excepted), with all their descendants; how
    many were killed."""
    def select(parents):
        found = _descendants({root}, parents) - keep
        if token is not None:
            found |= {pid for pid in parents if pid not in keep and pid != root and
                      _carries(pid, token)}
        return found
    return _kill_all(select)
