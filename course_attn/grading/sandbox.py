"""The operating-system sandbox every graded kernel runs in, and the limits on its process tree.

Why the operating system: whatever runs inside the student's process can reach whatever else
runs there, so no check written in Python can keep a submission from the grader. The kernel
therefore runs under bubblewrap (``bwrap``, Debian's ``bubblewrap`` package), the sandbox
Flatpak is built on: one small setuid-free program, kept by the same people for years, that
needs no daemon (Docker does) and no root (it uses unprivileged user namespaces where the
system allows them; as root it works anyway). Inside:

- its own user, PID, network, IPC and UTS namespaces: it sees only its own processes (not the
  grader, not the other kernels), cannot signal or trace anything outside, and has no network;
  it cannot make namespaces of its own (``--disable-userns``), so no process in it can become
  the first of a PID namespace and pass for the sandbox's init;
- a filesystem made only of what it needs, read-only: the system's libraries, the Python it
  runs, the virtual environment, and a copy of the package; a working folder and a ``/tmp`` that
  are tmpfs of a fixed size, so that what it writes is memory (counted by the memory cgroup)
  and never the host's disk. No ``solutions/``, no hidden cases, no repository, no other
  student's notebook;
- ``--die-with-parent`` and a new session: when the grader goes, so does the sandbox.

Limits on the whole process tree (``TreeLimits``): a memory cgroup (every process the kernel
forks counts, shared memory and tmpfs files too), a pids cgroup and, when several notebooks
are graded at once, a cpu cgroup that holds the tree to its share of the CPUs (a notebook
that keeps eight processes busy slows only itself), where the cgroup filesystem lets this
process make them; and in each process ``RLIMIT_DATA``, so that one
allocation past the limit fails with a MemoryError instead of killing the kernel. Without the
cgroups only the per-process limit holds. Files written are capped by ``RLIMIT_FSIZE``.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from functools import cache
from pathlib import Path

INSTALL_HINT = "install bubblewrap (Debian and Ubuntu: apt-get install bubblewrap)"
MAX_FILE_BYTES = 256 * 1024 * 1024   # one file the kernel writes (RLIMIT_FSIZE)
MAX_PROCESSES = 512                  # tasks (threads count) in the kernel's tree
TMP_BYTES = 512 * 1024 * 1024        # the private /tmp
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_SECRETS = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-", "/etc/sudoers")
_SANDBOX_UID = 65534  # nobody


def bwrap() -> str | None:
    return shutil.which("bwrap")


def python_folders() -> list[str]:
    """The folders the kernel's Python needs: its installation and the virtual environment,
    with the site-packages this process sees (the editable install's own folder is not one)."""
    folders = {sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))}
    for scheme in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(scheme)
        if path:
            folders.add(path)
    return _outermost(p for p in folders if os.path.isdir(p))


def _outermost(paths) -> list[str]:
    """The paths, each as written and as its links resolve, with every one that lies inside
    another dropped (a symlinked virtual environment needs both: the link's path is the one its
    interpreter is called by)."""
    paths = list(paths)  # read twice below: a generator would give its paths once
    kept: list[str] = []
    for path in sorted({os.path.realpath(p) for p in paths} | {os.path.abspath(p) for p in paths},
                       key=len):
        if not any(path == k or path.startswith(os.path.join(k, "")) for k in kept):
            kept.append(path)
    return kept


def command(*, readonly: list[str], workdir: str,
            private: dict[str, int] | None = None) -> list[str]:
    """The ``bwrap`` arguments that run a command (appended after them) in the sandbox.
    ``private``: folders (path -> bytes) that are a tmpfs of that size in the sandbox, seen by
    nothing outside it."""
    args = [bwrap() or "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--uid", str(_SANDBOX_UID), "--gid", str(_SANDBOX_UID),
            "--hostname", "grading"]
    if disables_user_namespaces():
        args += ["--unshare-user", "--disable-userns"]
    for path in _SYSTEM:
        if os.path.lexists(path):
            args += ["--ro-bind", path, path] if not os.path.islink(path) else \
                ["--symlink", os.readlink(path), path]
    for secret in _SECRETS:
        if os.path.exists(secret):
            args += ["--ro-bind", "/dev/null", secret]
    # /tmp first: the folders bound next may lie in the grader's /tmp
    args += ["--proc", "/proc", "--dev", "/dev", "--size", str(TMP_BYTES), "--tmpfs", "/tmp"]
    for path in _outermost([*python_folders(), *readonly]):
        args += ["--ro-bind", path, path]
    for path, size in (private or {}).items():
        args += ["--size", str(size), "--tmpfs", path]
    for device in sorted(Path("/dev").glob("nvidia*")):  # a GPU, where there is one
        args += ["--dev-bind", str(device), str(device)]
    # the kernel's parent is outside its PID namespace: --die-with-parent watches it instead
    args += ["--unsetenv", "JPY_PARENT_PID", "--setenv", "HOME", "/tmp",
             "--setenv", "TMPDIR", "/tmp",
             "--setenv", "MPLCONFIGDIR", "/tmp/matplotlib", "--setenv", "IPYTHONDIR",
             "/tmp/ipython", "--chdir", workdir, "--"]
    return args


@cache
def disables_user_namespaces() -> bool:
    """Whether this ``bwrap`` can keep the sandbox from making user namespaces of its own
    (``--disable-userns``, bubblewrap 0.8.0 and later). A process that made one, with a PID
    namespace in it, would be the first process of that namespace, as bubblewrap's own init is
    of the sandbox's; where this bwrap cannot refuse it, the kernel's process filter refuses
    ``unshare`` from the first graded call on, and the grader ends every process in the sandbox
    but the two it recorded at start (``Kernel.confine``)."""
    try:
        done = subprocess.run([bwrap() or "bwrap", "--help"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--disable-userns" in done.stdout + done.stderr


@cache
def unavailable() -> str | None:
    """Why kernels cannot be sandboxed here, in one line; None when they can."""
    if sys.platform != "linux":
        return f"the grading sandbox needs Linux (this is {sys.platform})"
    if bwrap() is None:
        return f"the grading sandbox needs bubblewrap: {INSTALL_HINT}"
    from . import confine
    source = Path(confine.__file__).read_text(encoding="utf-8")
    probe = command(readonly=[], workdir="/tmp") + [
        sys.executable, "-c", source + _FILTER_PROBE]
    from . import processes
    before = processes.children()
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"bubblewrap could not start a sandbox: {error}"
    finally:  # the probe's init, adopted where this process is a subreaper
        processes.reap_adopted(processes.children() - before, wait_s=0.5)
    if done.returncode != 0 and "filter:" not in done.stdout:
        why = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return (f"bubblewrap could not start a sandbox ({why}); it needs user namespaces "
                "(sysctl kernel.unprivileged_userns_clone=1) or root")
    if done.stdout.strip() != "filter: holds":
        return (f"a graded kernel could not be kept from starting processes "
                f"({done.stdout.strip().removeprefix('filter: ')}); it needs Linux with seccomp "
                "filters (x86-64 or AArch64)")
    return None


_FILTER_PROBE = """
try:
    forbid_new_processes()
    child = os.fork()
except PermissionError:
    print("filter: holds")
except OSError as error:
    print(f"filter: {error}")
else:
    if child == 0:
        os._exit(0)
    print("filter: a process started after the filter was put on")
"""


class TreeLimits:
    """A memory and a pids cgroup for one kernel's process tree, where this process may make
    them (cgroup v1 controllers, or a delegated cgroup v2 subtree); ``kind`` says which limits
    hold: ``"cgroup"`` (the whole tree) or ``"process"`` (each process on its own). ``cpus``:
    the CPUs' worth of time the tree may use (0: no limit); ``cpu_limited`` says whether a cpu
    cgroup holds it to that."""

    def __init__(self, name: str, memory_mb: int, *, tree: bool = True, cpus: float = 0.0):
        self.memory_mb = memory_mb
        self.cpus = cpus
        self.folders: list[Path] = []
        self.kind = "process"
        self.cpu_limited = False
        if memory_mb and tree:
            self._make(name)
        if cpus and tree and self.kind == "cgroup":
            self._limit_cpu(name)

    def _limit_cpu(self, name: str) -> None:
        period = 100_000  # microseconds
        quota = max(1000, int(self.cpus * period))
        folder = None
        try:
            parent = _own_v1("cpu")
            if parent is not None:
                folder = parent / name
                folder.mkdir()
                (folder / "cpu.cfs_period_us").write_text(str(period))
                (folder / "cpu.cfs_quota_us").write_text(str(quota))
            elif len(self.folders) == 1 and _own_v2(("cpu",)) is not None:
                (self.folders[0] / "cpu.max").write_text(f"{quota} {period}")
            else:
                return
        except OSError:
            if folder is not None:
                _remove(folder)
            return
        if folder is not None:
            self.folders.append(folder)
        self.cpu_limited = True

    def _make(self, name: str) -> None:
        made = []
        try:
            v1 = [_own_v1("memory"), _own_v1("pids")]
            if all(v1):
                for parent in v1:
                    folder = parent / name
                    folder.mkdir()
                    made.append(folder)
                (made[0] / "memory.limit_in_bytes").write_text(str(self.memory_mb << 20))
                (made[1] / "pids.max").write_text(str(MAX_PROCESSES))
            else:
                parent = _own_v2()
                if parent is None:
                    return
                folder = parent / name
                folder.mkdir()
                made.append(folder)
                (folder / "memory.max").write_text(str(self.memory_mb << 20))
                (folder / "memory.swap.max").write_text("0")
                (folder / "pids.max").write_text(str(MAX_PROCESSES))
        except OSError:
            for folder in made:
                _remove(folder)
            return
        self.folders, self.kind = made, "cgroup"

    def enter(self) -> None:
        """In the kernel's process, before it runs the sandbox: join the cgroups, or set the
        per-process limits. Every process it starts inherits them."""
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
        for folder in self.folders:
            (folder / "cgroup.procs").write_text(str(os.getpid()))
        if self.memory_mb:  # one allocation past it fails (MemoryError) rather than kills
            limit = self.memory_mb << 20
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    def out_of_memory(self) -> bool:
        """Whether the tree hit its memory limit (and the kernel of the OS killed in it):
        ``oom_kill`` in v1's ``memory.oom_control`` or v2's ``memory.events``."""
        for folder in self.folders:
            for name in ("memory.oom_control", "memory.events"):
                try:
                    for line in (folder / name).read_text().splitlines():
                        if line.startswith("oom_kill ") and int(line.split()[1]) > 0:
                            return True
                except (OSError, ValueError, IndexError):
                    continue
        return False

    def remove(self) -> None:
        """Kill every process left in the tree's cgroups, and remove them."""
        for folder in self.folders:
            _empty_and_remove(folder)
        self.folders = []


def cgroup_name(token: str) -> str:
    """The name of a kernel's cgroups: the grading process's pid, so that the cgroups a killed
    worker leaves can be found (``remove_cgroups_of``), and the kernel's token."""
    return f"course_attn_{os.getpid()}_{token}"


def remove_cgroups_of(pid: int) -> None:
    """Kill what is left in, and remove, the kernels' cgroups that process ``pid`` made."""
    parents = [p for p in (_own_v1("memory"), _own_v1("pids"), _own_v1("cpu"))
               if p is not None] or \
        [p for p in (_own_v2(),) if p is not None]
    for parent in parents:
        for folder in parent.glob(f"course_attn_{pid}_*"):
            _empty_and_remove(folder)


def _empty_and_remove(folder: Path) -> None:
    """SIGKILL every process in the cgroup ``folder`` (those it forks meanwhile too), then
    remove it."""
    import signal
    for _ in range(20):
        try:
            pids = [int(p) for p in (folder / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            break
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    _remove(folder)


def _remove(folder: Path) -> None:
    import time
    for _ in range(50):
        try:
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


def _own_v1(controller: str) -> Path | None:
    """This process's cgroup folder of a v1 controller, if it may make cgroups in it."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            number, controllers, path = line.split(":", 2)
            if controller in controllers.split(","):
                folder = Path("/sys/fs/cgroup") / controller / path.lstrip("/")
                return folder if os.access(folder, os.W_OK) else None
    except (OSError, ValueError):
        return None
    return None


def _own_v2(needed=("memory", "pids")) -> Path | None:
    """This process's cgroup v2 folder, whose children have the ``needed`` controllers, if
    this process may make one there (a delegated subtree)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        path = next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))
        folder = Path("/sys/fs/cgroup") / path.lstrip("/")
        controllers = (folder / "cgroup.subtree_control").read_text().split()
    except (OSError, StopIteration, IndexError):
        return None
    if not set(needed) <= set(controllers) or not os.access(folder, os.W_OK):
        return None
    return folder
