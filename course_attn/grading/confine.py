"""No new process while graded: a seccomp filter that the kernel puts on itself before its first
graded call, and the grader's check, from outside the sandbox, that it holds.

Why: the guard sees every operation in the kernel's process, and nothing in any other. A child
started in an earlier cell (a ``multiprocessing`` pool, a ``python -c`` fed through pipes) would
compute what the guard refuses. So before the first graded call the grader ends every other
process in the sandbox (``Kernel.confine``), and from then until the kernel ends it can start
none: ``fork``, ``vfork``, ``execve``, ``execveat`` and a ``clone`` without ``CLONE_THREAD``
fail with ``EPERM``, and so do ``unshare`` and ``setns`` (no new namespace, whose first
process would pass for the sandbox's own init, and no joining another). Threads stay allowed
(torch's thread pools, ``threading``): a thread is a ``clone`` with ``CLONE_THREAD``. ``clone3`` passes its flags in memory, where a filter cannot
read them, so it fails with ``ENOSYS`` and the C library falls back to ``clone``.

A seccomp filter cannot be taken off, by the process or by any thread of it: ``TSYNC`` puts it
on every thread at once, and threads started later inherit it. System calls of another
architecture (``int 0x80`` on x86-64) and x32 calls are refused outright, so that no other
numbering reaches ``fork``. The grader reads the filter's count on every thread in
``/proc/<pid>/task/*/status`` (``filters_on``): a kernel whose count did not grow is not graded.
"""

import ctypes
import errno
import os
import platform
import struct
from pathlib import Path

# architecture -> (AUDIT_ARCH_*, seccomp's syscall number, {process-making call: number})
_ARCHES = {
    "x86_64": (0xC000003E, 317, {"clone": 56, "fork": 57, "vfork": 58, "execve": 59,
                                 "execveat": 322, "clone3": 435, "unshare": 272, "setns": 308}),
    "aarch64": (0xC00000B7, 277, {"clone": 220, "execve": 221, "execveat": 281, "clone3": 435,
                                  "unshare": 97, "setns": 268}),
}
_X32_BIT = 0x40000000
CLONE_THREAD = 0x00010000
_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
# classic BPF: load a word of seccomp_data, jump on equal / jump on any bit set / jump if >=
_LOAD, _JEQ, _JSET, _JGE, _RET = 0x20, 0x15, 0x45, 0x35, 0x06
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in seccomp_data (arg 0's low word, little-endian)


def supported() -> bool:
    """Whether this machine's architecture has a filter here (Linux on x86-64 or AArch64)."""
    return os.uname().sysname == "Linux" and platform.machine() in _ARCHES


def program(machine: str | None = None) -> bytes:
    """The filter, as the bytes of its ``sock_filter`` instructions (8 bytes each)."""
    audit_arch, _, calls = _ARCHES[machine or platform.machine()]
    code: list[tuple] = [(_LOAD, 0, 0, _ARCH), (_JEQ, 0, "deny", audit_arch),
                         (_LOAD, 0, 0, _NR)]
    if audit_arch == _ARCHES["x86_64"][0]:
        code.append((_JGE, "deny", 0, _X32_BIT))
    for name in ("fork", "vfork", "execve", "execveat", "unshare", "setns"):
        if name in calls:
            code.append((_JEQ, "deny", 0, calls[name]))
    code += [(_JEQ, "nosys", 0, calls["clone3"]), (_JEQ, 0, "allow", calls["clone"]),
             (_LOAD, 0, 0, _ARG0), (_JSET, "allow", "deny", CLONE_THREAD)]
    labels = {"allow": len(code), "deny": len(code) + 1, "nosys": len(code) + 2}
    code += [(_RET, 0, 0, _ALLOW), (_RET, 0, 0, _ERRNO | errno.EPERM),
             (_RET, 0, 0, _ERRNO | errno.ENOSYS)]

    def offset(here: int, target) -> int:  # a jump counts the instructions it skips
        return labels[target] - here - 1 if isinstance(target, str) else target

    return b"".join(struct.pack("=HBBI", op, offset(i, jt), offset(i, jf), k)
                    for i, (op, jt, jf, k) in enumerate(code))


def forbid_new_processes() -> None:
    """Put the filter on every thread of this process, for good. Raises OSError when the
    system refuses it."""
    if not supported():
        raise OSError(errno.ENOSYS, f"no process filter for {platform.machine()}")
    _, seccomp, _ = _ARCHES[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    code = program()

    class _Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    filter_program = _Program(len(code) // 8, code)
    done = libc.syscall(ctypes.c_long(seccomp), ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
                        ctypes.c_long(_SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(filter_program))
    if done != 0:
        number = ctypes.get_errno()
        raise OSError(number, "seccomp(SECCOMP_SET_MODE_FILTER, TSYNC) failed: " + (
            os.strerror(number) if number else f"thread {done} could not take the filter"))


def filters_on(pid: int) -> list[int]:
    """The number of seccomp filters on each thread of process ``pid`` (``Seccomp_filters`` in
    each thread's status); [] when it cannot be read."""
    counts = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("Seccomp_filters:"):
                    counts.append(int(line.split()[1]))
        except (OSError, ValueError, IndexError):
            continue
    return counts
