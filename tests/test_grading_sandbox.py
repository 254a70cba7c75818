"""The grading sandbox's guarantees (issue 18), observed from inside a graded kernel.

Each test runs code in a ``course_attn.grading.kernel.Kernel`` (bubblewrap, as the grader runs
every submission) that raises AssertionError where a guarantee fails, so that a run whose
status is "ok" proves it: the grader's process is out of sight and out of reach, ``solutions/``
and the repository are not there, the package and the system are read-only, there is no
network, secrets read as nothing, the kernel is user 65534 among a handful of processes, and
the memory limit holds for the whole process tree.

Skipped, with the reason, where ``sandbox.unavailable()`` says the sandbox cannot run here;
failed instead when the environment variable CI is set (CI must test the sandbox).
"""

import asyncio
import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))

from grading_support import (  # noqa: E402
    FIXTURE, FIXTURE_OPTIONS, FIXTURE_SOLUTIONS, ROOT, SOLUTIONS, grader_env, require_sandbox,
)

from course_attn.grading import sandbox  # noqa: E402
from course_attn.grading.kernel import Kernel  # noqa: E402

SANDBOX_UID = 65534
LIMIT_S = 60


@pytest.fixture(scope="module", autouse=True)
def _sandbox_here():
    require_sandbox()


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def kernel(loop, tmp_path_factory):
    """One sandboxed kernel, as the grader starts it (2048 MB), for the tests that only look."""
    kernel = Kernel(tmp_path_factory.mktemp("kernel"), 2048)
    loop.run_until_complete(kernel.start())
    yield kernel
    loop.run_until_complete(kernel.stop())


def observe(loop, kernel, code: str, **values):
    """Run ``code`` (its names ``values`` given as literals) in the kernel; returns the run."""
    prelude = "".join(f"{name} = {value!r}\n" for name, value in values.items())
    return loop.run_until_complete(kernel.run(prelude + textwrap.dedent(code), LIMIT_S))


def assert_holds(run) -> None:
    assert run.status == "ok", f"{run.status}: {run.ename}: {run.evalue}"


def test_the_graders_process_is_out_of_sight(loop, kernel):
    """Issue 18: the kernel's parent is the sandbox's own init (pid 1, bwrap), not the grader;
    ``/proc/<grader pid>`` does not exist inside."""
    assert_holds(observe(loop, kernel, '''
        import os
        assert os.getppid() != GRADER and os.getpid() != GRADER, (os.getppid(), os.getpid())
        assert os.getppid() == 1, os.getppid()
        init = open("/proc/1/cmdline", "rb").read().split(b"\\0")[0]
        assert os.path.basename(init) == b"bwrap", init
        assert not os.path.exists(f"/proc/{GRADER}"), f"/proc/{GRADER} is visible"
        ''', GRADER=os.getpid()))


def test_the_graders_process_cannot_be_signalled(loop, kernel):
    """Issue 18: ``os.kill(<grader pid>, 0)`` fails: no such process in the kernel's PID
    namespace (the signal 0 only checks)."""
    assert_holds(observe(loop, kernel, '''
        import os
        try:
            os.kill(GRADER, 0)
        except ProcessLookupError:
            pass
        else:
            raise AssertionError(f"the grader ({GRADER}) can be signalled")
        ''', GRADER=os.getpid()))


def test_the_solutions_and_the_repository_are_absent(loop, kernel):
    """Issue 18: ``solutions/`` (and its hidden cases), the repository's files and the chapters'
    exercise declarations are not in the sandbox; where the repository's folder exists at all,
    it holds only the folders of the Python the kernel runs (a virtual environment inside it)."""
    python_inside = sorted({Path(p).relative_to(ROOT).parts[0] for p in sandbox.python_folders()
                            if Path(p).is_relative_to(ROOT)})
    assert_holds(observe(loop, kernel, '''
        import os
        import course_attn.grading
        for path in (SOLUTIONS, os.path.join(SOLUTIONS, "hidden"),
                     os.path.join(SOLUTIONS, "03_masking.ipynb"), os.path.join(ROOT, ".git"),
                     os.path.join(ROOT, "course_attn", "grading", "judge.py"),
                     os.path.join(ROOT, "tests")):
            assert not os.path.exists(path), f"{path} is in the sandbox"
        if os.path.exists(ROOT):
            assert set(os.listdir(ROOT)) <= set(PYTHON), os.listdir(ROOT)
        grading = os.path.dirname(course_attn.grading.__file__)
        assert not os.path.commonpath([grading, ROOT]) == ROOT, grading
        chapters = [f for f in os.listdir(grading) if f.startswith("ch") and f[2:4].isdigit()]
        assert chapters == [], chapters
        ''', SOLUTIONS=str(SOLUTIONS.resolve()), ROOT=str(ROOT.resolve()),
        PYTHON=python_inside))


def test_the_package_and_the_system_are_read_only(loop, kernel):
    """Issue 18: writing into the kernel's copy of the package, the virtual environment's
    site-packages or the system fails with EROFS; its working folder and /tmp are writable."""
    assert_holds(observe(loop, kernel, '''
        import errno
        import os
        import sysconfig
        import course_attn
        package = os.path.dirname(course_attn.__file__)
        for path, mode in ((os.path.join(package, "new.py"), "w"),
                           (os.path.join(package, "grading", "judge.py"), "a"),
                           (os.path.join(sysconfig.get_paths()["purelib"], "x.pth"), "w"),
                           ("/usr/lib/x", "w"), ("/etc/x", "w")):
            try:
                open(path, mode).close()
            except OSError as error:
                assert error.errno == EROFS, (path, error)
            else:
                raise AssertionError(f"{path} could be written")
        for folder in (os.getcwd(), "/tmp"):
            with open(os.path.join(folder, "mine.txt"), "w") as file:
                file.write("the kernel's own")
        ''', EROFS=errno.EROFS))


def test_there_is_no_network(loop, kernel):
    """Issue 18: a server listening on 127.0.0.1 here (the test connects to it) cannot be reached
    from the kernel, which has a network namespace of its own; nor can any other address."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    try:
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # it does listen
        assert_holds(observe(loop, kernel, '''
            import socket
            for address in (("127.0.0.1", PORT), ("1.1.1.1", 53), ("10.0.0.1", 80)):
                try:
                    socket.create_connection(address, timeout=5).close()
                except OSError:
                    pass
                else:
                    raise AssertionError(f"connected to {address}")
            ''', PORT=port))
    finally:
        server.close()


def test_secrets_read_as_nothing(loop, kernel):
    """Issue 18: ``/etc/shadow`` (bound to ``/dev/null`` in the sandbox) gives nothing: it reads
    empty or, as on a system where the bound device node may not be opened, is refused."""
    assert_holds(observe(loop, kernel, '''
        for secret in ("/etc/shadow", "/etc/gshadow"):
            try:
                with open(secret) as file:
                    assert file.read() == "", f"{secret} has content"
            except (PermissionError, FileNotFoundError):
                pass
        '''))


def test_the_kernel_is_nobody_among_a_handful_of_processes(loop, kernel):
    """Issue 18: the kernel runs as uid and gid 65534, and sees only its sandbox's processes (its
    init and itself, and whatever it starts)."""
    assert_holds(observe(loop, kernel, '''
        import os
        assert (os.getuid(), os.geteuid(), os.getgid(), os.getegid()) == (UID,) * 4, os.getuid()
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        assert 1 in pids and os.getpid() in pids and len(pids) <= 4, pids
        ''', UID=SANDBOX_UID))


MEMORY_MB = 1024
FORK_600_MB_THREE_TIMES = '''
import os
import time

children = []
for _ in range(3):   # 1800 MB in all, each child within the per-process limit
    pid = os.fork()
    if pid == 0:
        try:
            block = bytearray(600 << 20)
            for i in range(0, len(block), 4096):
                block[i] = 1
            time.sleep(1)
        finally:
            os._exit(0)
    children.append(pid)
statuses = [os.waitpid(pid, 0)[1] for pid in children]
assert any(os.WIFSIGNALED(s) for s in statuses), f"every child kept 600 MB: {statuses}"
'''


def test_the_memory_limit_holds_for_the_whole_process_tree(loop, tmp_path):
    """Issue 18: under a 1024 MB limit, a kernel that forks three children of 600 MB each: the
    tree's memory cgroup kills children (or the kernel itself, which the grader then reports as
    out of memory); this process, the grader, is untouched."""
    kernel = Kernel(tmp_path, MEMORY_MB)
    loop.run_until_complete(kernel.start())
    try:
        if kernel.limits.kind != "cgroup":
            pytest.skip("no memory cgroup for the kernel here (cgroup v1 controllers or a "
                        "delegated v2 subtree are needed): only per-process limits hold")
        run = loop.run_until_complete(kernel.run(FORK_600_MB_THREE_TIMES, LIMIT_S))
        assert run.status == "ok" or (run.status, run.evalue) == ("died", "out of memory"), \
            f"{run.status}: {run.ename}: {run.evalue}"
        assert kernel.limits.out_of_memory()
    finally:
        loop.run_until_complete(kernel.stop())
    assert os.getpid() and Path(f"/proc/{os.getpid()}").exists()


def test_a_symlinked_environment_is_mounted_by_its_link_and_its_target(tmp_path):
    """Issue 30: ``python_folders`` gave ``_outermost`` a generator, read twice, so a link's own
    path was never mounted and bwrap could not exec ``.venv/bin/python`` through it."""
    target = tmp_path / "real-env"
    target.mkdir()
    link = tmp_path / "env"
    link.symlink_to(target)
    kept = sandbox._outermost(str(p) for p in [link])
    assert str(link) in kept and str(target) in kept


def test_a_symlinked_venv_and_a_long_tmpdir_grade_as_usual(tmp_path):
    """Issue 30: the grader run through a symlinked virtual environment, with a TMPDIR of 100
    characters (the kernel's sockets would pass a Unix socket's 107 bytes under it), grades the
    fixture's solutions with full marks and no error."""
    venv = tmp_path / "venv-link"
    venv.symlink_to(Path(sys.prefix))
    python = venv / "bin" / Path(sys.executable).name
    tmpdir = tmp_path / ("t" * (100 - len(str(tmp_path)) - 1))
    tmpdir.mkdir()
    assert len(str(tmpdir)) == 100
    report = tmp_path / "report.json"
    done = subprocess.run(
        [str(python), "-m", "course_attn.grade", str(FIXTURE_SOLUTIONS / FIXTURE), "--json",
         str(report), *FIXTURE_OPTIONS], env={**grader_env(), "TMPDIR": str(tmpdir)},
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (entry,) = json.loads(report.read_text())["notebooks"]
    assert entry["error"] is None and entry["total"] == entry["max"] > 0, entry


FILL_THE_DISK = '''
import errno
import os

written = 0
try:
    for number in range(8):      # 8 x 100 MB: past the working folder's 256 MB
        with open(f"fill-{number}", "wb") as file:
            for _ in range(100):
                file.write(b"x" * (1 << 20))
                written += 1
except OSError as error:
    assert error.errno == errno.ENOSPC, error
else:
    raise AssertionError("800 MB were written into the working folder")
assert 200 <= written <= 260, written
'''


def test_what_the_kernel_writes_is_its_own_memory_not_the_hosts_disk(loop, tmp_path):
    """Issue 30: the working folder is a tmpfs of 256 MB: writing 800 MB into it stops with
    ENOSPC near 256 MB, and nothing of it reaches the host's disk (the scratch folder stays
    small)."""
    kernel = Kernel(tmp_path, 2048)
    loop.run_until_complete(kernel.start())
    try:
        assert_holds(loop.run_until_complete(kernel.run(FILL_THE_DISK, LIMIT_S)))
        on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*")
                      if p.is_file() and not p.is_symlink())
        assert on_disk < 64 << 20, on_disk  # the package's copy and the kernel's log
    finally:
        loop.run_until_complete(kernel.stop())


BUSY_FOR_TWO_SECONDS = '''
import os
import resource
import time

children = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            pass
        os._exit(0)
    children.append(pid)
started = time.monotonic()
for pid in children:
    os.waitpid(pid, 0)
wall = time.monotonic() - started
cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
used = (cpu.ru_utime + cpu.ru_stime) / 2.0
assert used <= SHARE * 1.25, f"three busy children used {used:.2f} CPUs of a {SHARE} share"
'''


def test_a_sandbox_uses_no_more_than_its_share_of_the_cpus(loop, tmp_path):
    """Issue 30: with a share of half a CPU (the batch gives each worker's sandbox its share),
    three children busy for 2 s use at most that share of CPU time, whatever the machine: a
    CPU hog slows only itself. CPU time is what is measured, not a wall clock."""
    kernel = Kernel(tmp_path, 2048, cpus=0.5)
    loop.run_until_complete(kernel.start())
    try:
        if not kernel.limits.cpu_limited:
            pytest.skip("no cpu cgroup for the kernel here (cgroup v1's cpu controller or a "
                        "delegated v2 subtree with cpu are needed)")
        assert kernel.env["OMP_NUM_THREADS"] == "1"
        assert_holds(observe(loop, kernel, BUSY_FOR_TWO_SECONDS, SHARE=0.5))
    finally:
        loop.run_until_complete(kernel.stop())


def test_once_confined_the_kernel_starts_no_process_and_keeps_its_threads(loop, tmp_path):
    """Issue 30: ``Kernel.confine`` ends the processes the cells started (a sleeping child, a
    fork pool's workers) and from then on fork, exec and a non-thread clone fail with EPERM in
    every thread, while threads (and torch's thread pool) still run."""
    kernel = Kernel(tmp_path, 2048)
    loop.run_until_complete(kernel.start())
    try:
        assert_holds(observe(loop, kernel, '''
            import multiprocessing, subprocess
            sleeper = subprocess.Popen(["sleep", "300"])
            pool = multiprocessing.get_context("fork").Pool(2)
            assert pool.map(abs, [-1, -2]) == [1, 2]
            '''))
        problem, ended = loop.run_until_complete(kernel.confine(LIMIT_S))
        assert (problem, kernel.confined) == ("", True)
        assert ended >= 3, ended  # the sleeper and the pool's two workers
        assert_holds(observe(loop, kernel, '''
            import os, subprocess, threading, torch
            assert sleeper.poll() is not None
            for start in (os.fork, lambda: subprocess.run(["true"]),
                          lambda: os.execv("/bin/true", ["true"])):
                try:
                    start()
                except PermissionError:
                    pass
                else:
                    raise AssertionError(f"{start} started a process")
            failed = []
            def in_a_thread():
                try:
                    os.fork()
                    failed.append("fork in a thread")
                except PermissionError:
                    pass
            thread = threading.Thread(target=in_a_thread)
            thread.start()
            thread.join()
            assert not failed, failed
            torch.set_num_threads(2)
            x = torch.randn(512, 512)
            assert torch.allclose(x @ x, (x.double() @ x.double()).float(), atol=1e-3)
            def alive(pid):  # the pool's killed workers stay zombies until it reaps them
                return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
            pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and alive(p)]
            assert len(pids) == 2, pids   # bubblewrap's init and the kernel
            '''))
    finally:
        loop.run_until_complete(kernel.stop())


def test_no_namespace_can_be_made_inside_and_the_init_is_known_by_its_pid(loop, tmp_path):
    """Issue 41: a process that makes itself the first process of a user and PID namespace of
    its own would pass for bubblewrap's init, which the grader spares when it confines the
    kernel. The sandbox makes none (``--disable-userns``, where bubblewrap has it), the process
    filter refuses ``unshare`` and ``setns`` from the first graded call on, and the grader
    spares bubblewrap's init by the pid it recorded at start: the kernel's parent, process 1 of
    the sandbox."""
    kernel = Kernel(tmp_path, 2048)
    loop.run_until_complete(kernel.start())
    try:
        from course_attn.grading import processes
        assert processes.parent(kernel.pid) == kernel.init
        assert processes.namespace_pid(kernel.init) == 1
        if sandbox.disables_user_namespaces():
            assert_holds(observe(loop, kernel, '''
                import subprocess
                done = subprocess.run(["unshare", "--user", "--pid", "--fork", "true"],
                                      capture_output=True, text=True)
                assert done.returncode != 0, "a user and PID namespace was made in the sandbox"
                '''))
        problem, _ = loop.run_until_complete(kernel.confine(LIMIT_S))
        assert problem == "", problem
        assert_holds(observe(loop, kernel, '''
            import ctypes, os
            libc = ctypes.CDLL(None, use_errno=True)
            CLONE_NEWUSER, CLONE_NEWPID = 0x10000000, 0x20000000
            for flags in (CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWUSER | CLONE_NEWPID):
                assert libc.unshare(flags) == -1 and ctypes.get_errno() == EPERM, flags
            fd = os.open("/proc/self/ns/user", os.O_RDONLY)
            assert libc.setns(fd, 0) == -1 and ctypes.get_errno() == EPERM
            ''', EPERM=errno.EPERM))
    finally:
        loop.run_until_complete(kernel.stop())
