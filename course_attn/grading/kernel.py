"""Running a submission: a fresh Jupyter kernel in a sandbox, against a copy of the package,
with limits on memory, processes, time and output; it can be restarted.

The kernel runs under bubblewrap (``sandbox.py``): its own user, PID and network namespaces, a
read-only view of the system, the Python and the virtual environment, a read-only copy of
``course_attn`` (without the chapters' exercise declarations, whose references the grader
alone needs), and nothing writable but memory: its working folder and ``/tmp`` are tmpfs of a
fixed size, and it writes nothing to the host's disk. Its Jupyter sockets lie in its own
``/tmp``, where the grader reaches them through ``/proc/<kernel>/root``. Nothing in it leads to
``solutions/``, the hidden cases, the repository or the other kernels. The grader's side of an
evaluation is installed in the kernel before any cell of the submission runs
(``harness.install``); the kernel answers in the Jupyter reply, signed with its own session
key, and reports banned operations the moment they happen on a pipe that only the grader reads.
The answer travels on that pipe too, not in the reply: an override of IPython's machinery can
rewrite the reply, not what the harness wrote, and a call must give exactly one answer.
Before the first graded call the kernel is confined (``confine``): every other process in the
sandbox is ended, and from then on it can start none.

Without the sandbox (``sandboxed=False``: the instructor's explicit ``--no-sandbox``) the kernel
runs as the grader's user, with per-process limits; every process it starts carries
``processes.MARKER`` in its environment, so that none outlives it.
"""

import ast
import asyncio
import json
import os
import queue
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from jupyter_client.manager import AsyncKernelManager

from . import confine as process_filter
from . import harness, processes, sandbox
from .canonical import GraderError

KERNEL_NAME = "python3"
KERNEL_STARTUP_TIMEOUT_S = 60.0
INTERRUPT_GRACE_S = 5.0
OUT_OF_MEMORY = "out of memory"  # how a kernel that the memory cgroup killed ended
MAX_OUTPUT_CHARS = 20_000_000  # past this, a cell is interrupted: its output is not read
PACKAGE_DIR = Path(__file__).resolve().parents[1]
_HARNESS_SOURCE = Path(harness.__file__).read_text(encoding="utf-8")
_CONFINE_SOURCE = Path(process_filter.__file__).read_text(encoding="utf-8")
WORK_BYTES = 256 * 1024 * 1024  # the sandboxed kernel's working folder, a tmpfs
_MEMORY_HINT = " (is the memory limit of {} MB too small? the kernel needs about 350 MB to " \
               "import torch)"
# A Unix socket's address holds at most 107 bytes of path (sun_path, less its final NUL, on
# Linux); the kernel's ipc sockets are "<connection file, less .json>-ipc-<N>".
UNIX_SOCKET_PATH_MAX = 107
SCRATCH_PREFIX = "course_attn_grade_"
_SOCKET_TAIL = "/box/run/kernel-00000000-ipc-9"  # what a socket adds to its scratch folder
_ENVIRONMENT = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM", "VIRTUAL_ENV", "SYSTEMROOT")
_ENVIRONMENT_PREFIXES = ("LC_", "OPENBLAS_", "OMP_", "MKL_", "CUDA_", "NVIDIA_", "TORCH_",
                         "PYTORCH_", "TRITON_", "PYTHONHASHSEED", "PYTHONIOENCODING")


@dataclass
class CellRun:
    """What happened to one execution. ``status``: ok, error, timeout (interrupted), stuck (did
    not answer after the interrupt), died, output (interrupted for printing too much).
    ``value``: the text of the grader's expression, when it was evaluated."""

    status: str
    ename: str = ""
    evalue: str = ""
    seconds: float = 0.0
    output_chars: int = 0
    value: str = ""


def scratch_root() -> str:
    """Where each kernel's scratch folder goes: the temporary folder (``TMPDIR``), unless its
    path is so long that the kernel's sockets under it would not fit in a Unix socket's address;
    then ``/tmp``."""
    base = tempfile.gettempdir()
    longest = len(os.fsencode(base)) + len(f"/{SCRATCH_PREFIX}xxxxxxxx{_SOCKET_TAIL}")
    if longest > UNIX_SOCKET_PATH_MAX and os.access("/tmp", os.W_OK | os.X_OK):
        return "/tmp"
    return base


@cache
def taken_module_names() -> frozenset[str]:
    """The top-level module names a file beside a notebook may not take: the standard
    library's, those of every distribution installed where the kernel runs (torch, numpy,
    IPython, ipykernel, ...) and the course's own. A ``torch.py`` in the kernel's working folder
    would be found before the real one by whatever imports torch next."""
    from importlib.metadata import packages_distributions
    return frozenset({*sys.stdlib_module_names, *packages_distributions(), PACKAGE_DIR.name,
                      "__main__", "sitecustomize", "usercustomize"})


def shadowing(file_name: str) -> str | None:
    """Why the Python file ``file_name`` cannot be put beside a notebook (it has the name of a
    module the kernel or the package can import), in one line; None when it can."""
    module = file_name.removesuffix(".py")
    if module in taken_module_names():
        return (f"{file_name} was not put beside the notebook: it has the name of the module "
                f"{module!r}, which the kernel or the course imports (rename it, and its imports)")
    return None


def copy_package(destination: Path) -> Path:
    """A copy of ``course_attn`` (sources only, without the chapters' exercise declarations)
    under ``destination``; returns the folder to put on ``PYTHONPATH``."""
    root = destination / "site"
    shutil.copytree(PACKAGE_DIR, root / "course_attn",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "ch[0-9][0-9].py"))
    return root


class _SandboxedKernelManager(AsyncKernelManager):
    """Jupyter's kernel manager, launching the kernel behind ``prefix`` (the sandbox's command)
    and interrupting it by a message on its control channel: a signal to the sandbox's
    process would not reach the kernel inside it."""

    prefix: list = []

    def format_kernel_cmd(self, extra_arguments=None):
        return [*self.prefix, *super().format_kernel_cmd(extra_arguments)]


class Kernel:
    """One submission's kernel: ``await start()``, ``await run(code, limit)``,
    ``await evaluate(request, limit)``, ``await restart()``, ``await stop()``.

    Folders: ``scratch/site`` (the package's copy, read-only in the sandbox), ``scratch/given``
    (files put beside the notebook, copied into its working folder when it starts),
    ``scratch/box/run`` (its connection file; without the sandbox its sockets too),
    ``scratch/box/work`` (its working folder: in the sandbox a tmpfs of WORK_BYTES at that path)
    and ``scratch/kernel.log`` (its stdout and stderr, which only the grader sees)."""

    def __init__(self, scratch: Path, memory_mb: int, extra_path: tuple[str, ...] = (), *,
                 sandboxed: bool = True, cpus: float = 0.0):
        self.scratch = scratch
        self.box = scratch / "box"
        self.workdir = self.box / "work"
        self.rundir = self.box / "run"
        self.given = scratch / "given"
        self.memory_mb = memory_mb
        self.sandboxed = sandboxed
        self.cpus = cpus  # the CPUs' worth of time its tree may use (0: no limit)
        self.token = secrets.token_hex(16)
        self.km = None
        self.kc = None
        self.limits = None
        self.output_chars = 0
        self.hits: list[str] = []
        self._hits_fd = None
        self._hits_buffer = b""
        self.answers: list[str] = []  # the answers the harness wrote on the pipe
        self._drain = None
        self._idle = None
        self.pid = None          # the kernel's process, outside the sandbox's PID namespace
        self.init = None         # bubblewrap's init in the sandbox (the kernel's parent)
        self.confined = False    # whether it can no longer start processes
        self.own_threads: set[int] = set()  # its threads once the grader's side was installed
        self.busy_threads: dict[int, str] = {}  # the others that ran during the last call, by
        # their id in the sandbox (the one the kernel itself sees) -> name
        for folder in (self.workdir, self.rundir, self.given):
            folder.mkdir(parents=True, exist_ok=True)
        self.site = copy_package(scratch)
        self.extra_path = tuple(extra_path)
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if sandboxed:
            kept = {k: v for k, v in os.environ.items()
                    if k in _ENVIRONMENT or k.startswith(_ENVIRONMENT_PREFIXES)}
            path = [str(self.site), *self.extra_path]
        else:
            kept = {k: v for k, v in os.environ.items() if k not in ("PWD", "OLDPWD")}
            path = [str(self.site), *self.extra_path, *inherited]
        self.env = {**kept, processes.MARKER: self.token, "PYTHONPATH": os.pathsep.join(path),
                    "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "agg"}
        if cpus and "OMP_NUM_THREADS" not in self.env:  # as many threads as its share
            self.env["OMP_NUM_THREADS"] = str(max(1, int(cpus)))

    def _sandbox_prefix(self) -> list[str]:
        return sandbox.command(readonly=[str(self.site), *self.extra_path, str(self.given),
                                         str(self.rundir)],
                               workdir=str(self.workdir),
                               private={str(self.workdir): WORK_BYTES})

    async def start(self) -> None:
        self.limits = sandbox.TreeLimits(sandbox.cgroup_name(self.token), self.memory_mb,
                                         tree=self.sandboxed, cpus=self.cpus)
        connection_file = self.rundir / f"kernel-{secrets.token_hex(4)}.json"
        socket = f"{connection_file.with_suffix('')}-ipc-9"
        if len(os.fsencode(socket)) > UNIX_SOCKET_PATH_MAX:
            raise GraderError(
                f"could not start a {KERNEL_NAME} kernel: the path of its sockets, {socket}, is "
                f"{len(os.fsencode(socket))} bytes, more than the {UNIX_SOCKET_PATH_MAX} a Unix "
                "socket's address holds: set TMPDIR to a folder with a shorter path")
        read, write = os.pipe()
        os.set_blocking(read, False)
        self._hits_fd, self._hits_buffer = read, b""
        asyncio.get_running_loop().add_reader(read, self._read_hits)  # an answer can be large
        self.km = _SandboxedKernelManager(kernel_name=KERNEL_NAME, transport="ipc",
                                          connection_file=str(connection_file))
        self.pid, self.init, self.confined = None, None, False
        if self.sandboxed:
            self.km.prefix = self._sandbox_prefix()
            self.km.ip = f"/tmp/kernel-{self.token[:8]}-ipc"  # in the sandbox's own /tmp
        log = open(self.scratch / "kernel.log", "ab")
        try:
            self.km.kernel_spec.interrupt_mode = "message"
            await self.km.start_kernel(cwd=str(self.workdir), env=self.env, stdout=log,
                                       stderr=log, pass_fds=(write,),
                                       preexec_fn=self.limits.enter,
                                       extra_arguments=["--HistoryManager.hist_file=:memory:"])
            await self._find_kernel()
            self.kc = self.km.client()
            self.kc.start_channels()
            self.kc.allow_stdin = False  # input() raises instead of waiting forever
            await self.kc.wait_for_ready(timeout=KERNEL_STARTUP_TIMEOUT_S)
        except Exception as error:
            tail = (self.scratch / "kernel.log").read_text(errors="replace")[-1500:]
            hint = _MEMORY_HINT.format(self.memory_mb) if self.memory_mb else ""
            raise GraderError(f"could not start a {KERNEL_NAME} kernel: {error}{hint}\n{tail}") \
                from None
        finally:
            log.close()
            os.close(write)
        self._drain = asyncio.ensure_future(self._drain_iopub())
        # The harness, torch and all they import are loaded before the submission's files are
        # put in the working folder, where ``import`` would look first.
        install = (f"import shutil as _s, types as _t\n"
                   f"_c = _t.ModuleType('course_attn_confine')\n"
                   f"exec(compile({_CONFINE_SOURCE!r}, '<course_attn-confine>', 'exec'), "
                   f"_c.__dict__)\n_m = _t.ModuleType('course_attn_harness')\n"
                   f"exec(compile({_HARNESS_SOURCE!r}, '<course_attn-harness>', 'exec'), "
                   f"_m.__dict__)\n_m.install(globals(), {write}, {self.token!r}, "
                   "_c.forbid_new_processes)\n"
                   f"_s.copytree({str(self.given)!r}, '.', dirs_exist_ok=True)\n"
                   "del _s, _t, _c, _m\n")
        run = await self.run(install, KERNEL_STARTUP_TIMEOUT_S, history=False)
        self.own_threads = set(processes.threads(self.pid))
        if run.status != "ok":
            what = f"{run.ename}: {run.evalue}" if run.ename else f"it {run.status}" + \
                (f" ({run.evalue})" if run.evalue else "")
            hint = _MEMORY_HINT.format(self.memory_mb) if self.memory_mb else ""
            raise GraderError(f"could not start a {KERNEL_NAME} kernel: the grader's side did "
                              f"not install ({what}){hint}")

    async def _find_kernel(self) -> None:
        """Learn the kernel's pid. In the sandbox it is the second process of its PID namespace
        (bubblewrap's init is the first); the client then reaches its sockets, which lie in the
        sandbox's ``/tmp``, through ``/proc/<pid>/root``."""
        launched = self.km.provisioner.process.pid
        if not self.sandboxed:
            self.pid = launched
            return
        deadline = time.monotonic() + KERNEL_STARTUP_TIMEOUT_S
        while self.pid is None:
            self.pid = next((pid for pid in processes.descendants(launched)
                             if processes.namespace_pid(pid) == 2), None)
            if self.pid is None:
                if time.monotonic() > deadline or not await self._alive():
                    raise RuntimeError("the sandbox started no kernel")
                await asyncio.sleep(0.01)
        self.init = processes.parent(self.pid)  # bubblewrap's init, before any cell has run
        self.km.ip = f"/proc/{self.pid}/root{self.km.ip}"
        self.km._close_control_socket()  # it was connected to the path as the kernel sees it
        self.km._connect_control_socket()

    async def confine(self, limit_s: float) -> tuple[str, int]:
        """Before the first graded call: the kernel puts the filter of ``confine.py`` on itself
        (no new process from then on), the grader checks from outside that every thread of it
        carries one filter more than before, and ends every other process in the sandbox.
        Returns why it could not be confined ("" when it was) and how many processes were
        ended."""
        before = process_filter.filters_on(self.pid)
        run = await self.run("", limit_s, history=False,
                             expression=harness.expression(self.token, None))
        try:
            said = ast.literal_eval(run.value) if run.status == "ok" else None
        except (ValueError, SyntaxError, RecursionError, MemoryError, TypeError):
            said = None
        after = process_filter.filters_on(self.pid)
        if run.status != "ok":
            problem = f"{run.ename}: {run.evalue}" if run.ename else f"it {run.status}"
        elif said:
            problem = str(said)[:200]
        elif not after or not before or min(after) <= max(before):
            problem = "the filter is not on every thread of the kernel"
        else:
            problem = ""
        self.confined = not problem
        launched = self.km.provisioner.process.pid
        if self.sandboxed:  # by the pids recorded at start: a process that made a PID
            # namespace of its own would be number 1 in it, as bubblewrap's init is in the sandbox
            keep = {launched, self.init, self.pid}
            ended = await asyncio.to_thread(processes.end_all_but, launched, keep)
        else:
            ended = await asyncio.to_thread(processes.end_all_but, self.pid, {self.pid},
                                            self.token)
        return problem, ended

    async def _drain_iopub(self) -> None:
        """Read and count (never keep) the kernel's output, so it cannot pile up."""
        while True:
            try:
                msg = await self.kc.get_iopub_msg(timeout=1.0)
            except queue.Empty:
                continue
            except (asyncio.CancelledError, Exception):
                return
            content = msg.get("content", {})
            self.output_chars += len(str(content.get("text", ""))) + \
                len(str(content.get("data", "")))
            if msg.get("msg_type") == "status" and content.get("execution_state") == "idle":
                self._idle = msg.get("parent_header", {}).get("msg_id")

    async def _quiet(self, msg_id: str, limit_s: float = 5.0) -> None:
        """Wait until the kernel says it is idle after ``msg_id`` (then every output of that
        request has been counted), at most ``limit_s`` seconds."""
        deadline = time.monotonic() + limit_s
        while self._idle != msg_id and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def _read_hits(self) -> None:
        """Take what the kernel wrote on the pipe so far, one JSON value a line: a string is a
        banned operation, ``{"answer": text}`` an answer. A line longer than any answer can be
        is dropped."""
        longest = harness.MAX_BYTES * 3
        while self._hits_fd is not None:
            try:
                chunk = os.read(self._hits_fd, 1 << 20)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            self._hits_buffer += chunk
            *lines, self._hits_buffer = self._hits_buffer.split(b"\n")
            if len(self._hits_buffer) > longest:
                self._hits_buffer = b""
            for line in lines:
                self._take(line)

    def _take(self, line: bytes) -> None:
        try:
            hit = json.loads(line)
        except (ValueError, RecursionError, MemoryError):
            return
        if isinstance(hit, dict) and isinstance(hit.get("answer"), str):
            if len(self.answers) < 2:
                self.answers.append(hit["answer"])
        elif isinstance(hit, str) and hit[:200] not in self.hits and len(self.hits) < 100:
            self.hits.append(hit[:200])

    async def _alive(self) -> bool:
        try:
            return await self.km.is_alive()
        except Exception:
            return False

    async def _reply(self, msg_id: str) -> dict | None:
        """The execute reply to ``msg_id``; None if the kernel died first."""
        while True:
            try:
                msg = await self.kc.get_shell_msg(timeout=0.5)
            except queue.Empty:
                if not await self._alive():
                    return None
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg["content"]

    async def _reply_or_flood(self, msg_id: str, chars: int) -> dict | str | None:
        """The reply, or "output" as soon as the cell has printed more than MAX_OUTPUT_CHARS."""
        reply = asyncio.ensure_future(self._reply(msg_id))
        try:
            while not reply.done():
                await asyncio.wait([reply], timeout=0.25)
                if not reply.done() and self.output_chars - chars > MAX_OUTPUT_CHARS:
                    return "output"
            return reply.result()
        finally:
            if not reply.done():
                reply.cancel()

    async def run(self, code: str, limit_s: float, *, history: bool = True,
                  expression: str | None = None) -> CellRun:
        """Execute ``code``; interrupt it after ``limit_s`` seconds, or once it has printed
        more than MAX_OUTPUT_CHARS. ``expression``: evaluate this instead, as a user expression
        of an empty cell (IPython's input and AST transformers, which a submission can install,
        never see it); its text is the run's ``value``."""
        started, chars = time.monotonic(), self.output_chars
        expressions = {} if expression is None else {"grader": expression}
        msg_id = self.kc.execute("" if expression is not None else code,
                                 silent=not history and expression is None,
                                 store_history=history and expression is None,
                                 user_expressions=expressions, allow_stdin=False,
                                 stop_on_error=False)
        try:
            content = await asyncio.wait_for(self._reply_or_flood(msg_id, chars),
                                             timeout=max(limit_s, 0.01))
        except asyncio.TimeoutError:
            content = "timeout"
        if content in ("timeout", "output"):
            run = CellRun(content, evalue=f"{limit_s:.3g} s" if content == "timeout" else
                          f"{self.output_chars - chars:,} characters")
            await self._interrupt()
            try:
                content = await asyncio.wait_for(self._reply(msg_id), INTERRUPT_GRACE_S)
                if content is None:
                    run = CellRun("died", evalue=await self.exit_description())
            except asyncio.TimeoutError:
                run = CellRun("stuck", evalue=f"{limit_s:.3g} s")
        elif content is None:
            run = CellRun("died", evalue=await self.exit_description())
        elif content.get("status") != "ok":
            run = CellRun("error", str(content.get("ename", "")), str(content.get("evalue", "")))
        elif expression is not None:
            result = content.get("user_expressions", {})
            result = result.get("grader") if isinstance(result, dict) else None
            if not isinstance(result, dict):
                run = CellRun("error", "GraderError", "the kernel did not evaluate the "
                                                      "grader's expression")
            elif result.get("status") != "ok":
                run = CellRun("error", str(result.get("ename", "")),
                              str(result.get("evalue", "")))
            else:
                data = result.get("data")
                text = data.get("text/plain") if isinstance(data, dict) else None
                run = CellRun("ok", value=text if isinstance(text, str) else "")
        else:
            run = CellRun("ok")
        if run.status not in ("died", "stuck"):
            await self._quiet(msg_id)
        run.seconds = time.monotonic() - started
        run.output_chars = self.output_chars - chars
        return run

    async def _interrupt(self) -> None:
        try:
            await self.km.interrupt_kernel()
        except Exception:
            pass

    async def evaluate(self, request: dict, limit_s: float) -> tuple[CellRun, dict | None,
                                                                      list[str]]:
        """Run the harness on ``request`` (see ``harness.evaluate``); returns the run, the
        answer (None if none came back) and the banned operations reported as they
        happened. The answer is the one the harness wrote on the pipe, whatever the reply
        says; a call that gave two is refused. ``busy_threads`` holds the threads of the
        notebook's own (not the kernel's when the grader's side was installed) that were running
        or used processor time during the call, as ``/proc`` shows them, which the notebook
        cannot change."""
        self._read_hits()
        self.hits, self.answers = [], []
        before = processes.threads(self.pid)
        run = await self.run("", limit_s, history=False,
                             expression=harness.expression(self.token, request))
        after = processes.threads(self.pid)
        self.busy_threads = {
            state.inner: state.name for tid, state in after.items()
            if tid not in self.own_threads and tid in before and
            ("R" in (state.state, before[tid].state) or state.ticks > before[tid].ticks)}
        self._read_hits()
        answer = None
        if run.status == "ok" and len(self.answers) > 1:
            run = CellRun("error", "GraderError", "more than one answer came on the grader's "
                          "pipe for one call", seconds=run.seconds, output_chars=run.output_chars)
        elif run.status == "ok" and self.answers:
            try:
                answer = json.loads(self.answers[0])
            except (ValueError, RecursionError, MemoryError):
                answer = None
        elif run.status == "ok":
            run = CellRun("error", "GraderError", "no answer came on the grader's pipe",
                          seconds=run.seconds, output_chars=run.output_chars)
        return run, answer if isinstance(answer, dict) else None, list(self.hits)

    async def exit_description(self) -> str:
        """How the kernel's process ended: ``SIGSEGV`` or ``exit status 1``, or that the tree ran
        out of memory; "" if unknown."""
        if self.limits is not None and self.limits.out_of_memory():
            return OUT_OF_MEMORY
        try:
            code = await self.km.provisioner.poll() if self.km.provisioner is not None else None
        except Exception:
            code = None
        if code is None:
            return ""
        if self.sandboxed and code > 128:  # bwrap passes on a signal as 128 + its number
            code = 128 - code
        if code < 0:
            try:
                return signal.Signals(-code).name
            except ValueError:
                return f"signal {-code}"
        return f"exit status {code}"

    async def stop(self) -> None:
        """Kill the kernel, its sandbox and every process in it."""
        if self._drain is not None:
            self._drain.cancel()
            self._drain = None
        if self.kc is not None:
            try:
                self.kc.stop_channels()
            except Exception:
                pass
            self.kc = None
        if self.km is not None:
            provisioner = self.km.provisioner
            launched = provisioner.process if provisioner is not None else None
            try:
                if self.km.has_kernel:
                    await self.km.shutdown_kernel(now=True)
            except Exception:  # the kernel is gone or going; nothing left to free we can reach
                pass
            self.km = None
            if launched is not None:  # the sandbox's own process: collected, not left a zombie
                try:
                    await asyncio.to_thread(launched.wait, 5)
                except Exception:
                    pass
            if self.init is not None and processes.is_subreaper():  # and its init, adopted
                await asyncio.to_thread(processes.reap_adopted, {self.init})
        if self.limits is not None:
            await asyncio.to_thread(self.limits.remove)
        if self._hits_fd is not None:
            try:
                asyncio.get_running_loop().remove_reader(self._hits_fd)
            except (RuntimeError, ValueError):
                pass
            os.close(self._hits_fd)
            self._hits_fd = None
        await asyncio.to_thread(processes.kill_marked, self.token)

    async def restart(self) -> None:
        await self.stop()
        await self.start()
