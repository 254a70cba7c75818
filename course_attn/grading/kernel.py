"""Running a submission: a fresh Jupyter kernel in a scratch folder, against a copy of the
package, with a memory limit and a time limit per cell; it can be restarted.

The kernel sees ``course_attn`` through a copy made in the scratch folder (first on its
``PYTHONPATH``): nothing next to that copy leads to ``solutions/`` or the hidden cases. Every
process it starts carries ``processes.MARKER`` in its environment, so that none outlives it.
"""

import asyncio
import functools
import json
import os
import queue
import secrets
import shutil
import signal
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from jupyter_client.manager import AsyncKernelManager

from . import harness, processes
from .canonical import GraderError

KERNEL_NAME = "python3"
KERNEL_STARTUP_TIMEOUT_S = 60.0
INTERRUPT_GRACE_S = 5.0
PACKAGE_DIR = Path(__file__).resolve().parents[1]
_HARNESS_SOURCE = Path(harness.__file__).read_text(encoding="utf-8")
_MEMORY_HINT = " (is the memory limit of {} MB too small? the kernel needs about 350 MB to " \
               "import torch)"


@dataclass
class CellRun:
    """What happened to one execution. ``status``: ok, error, timeout (interrupted), stuck (did
    not answer after the interrupt), died."""

    status: str
    ename: str = ""
    evalue: str = ""
    seconds: float = 0.0
    output_chars: int = 0


def copy_package(destination: Path) -> Path:
    """A copy of ``course_attn`` (sources only) under ``destination``; returns the folder to put
    on ``PYTHONPATH``."""
    root = destination / "site"
    shutil.copytree(PACKAGE_DIR, root / "course_attn",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return root


def _read_regular_file(path: Path, limit: int, *, whole: bool = True) -> str:
    """The text of ``path``, a file the kernel wrote: a regular file (not a link, a pipe or a
    device, which could block or never end), read up to ``limit`` bytes; ValueError if it is
    larger and ``whole``."""
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) |
                         getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise ValueError(f"{path.name} is not a regular file")
        with os.fdopen(descriptor, "rb") as file:
            descriptor = None
            data = file.read(limit + 1)
    finally:
        if descriptor is not None:
            os.close(descriptor)
    if len(data) > limit and whole:
        raise ValueError(f"{path.name} is larger than {limit} bytes")
    return data[:limit].decode("utf-8", errors="replace")


def _limit_resources(memory_mb: int) -> None:
    """In the kernel's process, before it starts: no core dumps, at most ``memory_mb`` MiB of
    data (heap and private mappings); Linux counts every private anonymous mapping here."""
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if memory_mb:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


class Kernel:
    """One submission's kernel: ``await start()``, ``await run(code, limit)``,
    ``await evaluate(request, limit)``, ``await restart()``, ``await stop()``."""

    def __init__(self, scratch: Path, memory_mb: int, extra_path: tuple[str, ...] = ()):
        self.scratch = scratch
        self.workdir = scratch / "work"
        self.exchange = scratch / "exchange"
        self.memory_mb = memory_mb
        self.token = secrets.token_hex(16)
        self.km = None
        self.kc = None
        self.output_chars = 0
        self._drain = None
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.exchange.mkdir(parents=True, exist_ok=True)
        site = copy_package(scratch)
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        inherited_env = {k: v for k, v in os.environ.items() if k not in ("PWD", "OLDPWD")}
        self.env = {**inherited_env, processes.MARKER: self.token,
                    "PYTHONPATH": os.pathsep.join([str(site), *extra_path, *inherited]),
                    "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "agg"}

    async def start(self) -> None:
        transport = {"transport": "ipc", "connection_file": str(
            self.scratch / f"kernel-{secrets.token_hex(4)}.json")} if os.name == "posix" else {}
        self.km = AsyncKernelManager(kernel_name=KERNEL_NAME, **transport)
        launch = {"preexec_fn": functools.partial(_limit_resources, self.memory_mb)} \
            if hasattr(os, "fork") else {}
        log = open(self.scratch / "kernel.log", "ab")
        try:
            await self.km.start_kernel(cwd=str(self.workdir), env=self.env, stdout=log,
                                       stderr=log,
                                       extra_arguments=["--HistoryManager.hist_file=:memory:"],
                                       **launch)
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
        self._drain = asyncio.ensure_future(self._drain_iopub())

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

    async def run(self, code: str, limit_s: float, *, history: bool = True,
                  expression: str | None = None) -> CellRun:
        """Execute ``code``; interrupt it after ``limit_s`` seconds. ``expression``: evaluate
        this instead, as a user expression of an empty cell (IPython's input and AST
        transformers, which a submission can install, never see it)."""
        started, chars = time.monotonic(), self.output_chars
        expressions = {} if expression is None else {"grader": expression}
        msg_id = self.kc.execute("" if expression is not None else code,
                                 store_history=history and expression is None,
                                 user_expressions=expressions, allow_stdin=False,
                                 stop_on_error=False)
        try:
            content = await asyncio.wait_for(self._reply(msg_id), timeout=max(limit_s, 0.01))
        except asyncio.TimeoutError:
            run = CellRun("timeout", evalue=f"{limit_s:.3g} s")
            await self._interrupt()
            try:
                content = await asyncio.wait_for(self._reply(msg_id), INTERRUPT_GRACE_S)
                if content is None:
                    run = CellRun("died", evalue=await self.exit_description())
            except asyncio.TimeoutError:
                run = CellRun("stuck", evalue=f"{limit_s:.3g} s")
        else:
            if content is None:
                run = CellRun("died", evalue=await self.exit_description())
            elif content.get("status") != "ok":
                run = CellRun("error", str(content.get("ename", "")),
                              str(content.get("evalue", "")))
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
                    run = CellRun("ok")
            else:
                run = CellRun("ok")
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
        """Send ``request`` (see ``harness.evaluate``) and run the harness on it; returns the
        run, the answer (None if none was written) and the banned calls reported as they
        happened."""
        name = secrets.token_hex(8)
        request_path = self.exchange / f"{name}.request.json"
        answer_path, hits_path = self.exchange / f"{name}.answer.json", \
            self.exchange / f"{name}.hits"
        request = {**request, "answer": str(answer_path), "hits": str(hits_path)}
        request_path.write_text(json.dumps(request), encoding="utf-8")
        expression = ("(lambda _ns: (exec(compile(" + repr(_HARNESS_SOURCE) +
                      ", '<course_attn-harness>', 'exec'), _ns), _ns['evaluate'](" +
                      repr(str(request_path)) + ", globals()))[-1])"
                      "({'__name__': 'course_attn_harness'})")
        run = await self.run("", limit_s, history=False, expression=expression)
        answer = None
        try:  # the kernel wrote this file: any bytes at all
            answer = json.loads(_read_regular_file(answer_path, harness.MAX_BYTES * 2))
        except (OSError, ValueError, RecursionError):
            answer = None
        hits = []
        try:
            text = _read_regular_file(hits_path, 64 * 1024, whole=False)
        except (OSError, ValueError):
            text = ""
        for line in text.splitlines()[:100]:
            try:
                hit = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(hit, str) and hit[:200] not in hits:
                hits.append(hit[:200])
        for path in (request_path, answer_path, hits_path):
            path.unlink(missing_ok=True)
        return run, answer if isinstance(answer, dict) else None, hits

    async def exit_description(self) -> str:
        """How the kernel's process ended: ``SIGSEGV`` or ``exit status 1``; "" if unknown."""
        try:
            code = await self.km.provisioner.poll() if self.km.provisioner is not None else None
        except Exception:
            code = None
        if code is None:
            return ""
        if code < 0:
            try:
                return signal.Signals(-code).name
            except ValueError:
                return f"signal {-code}"
        return f"exit status {code}"

    async def stop(self) -> None:
        """Kill the kernel and every process that carries this kernel's token."""
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
            try:
                if self.km.has_kernel:
                    await self.km.shutdown_kernel(now=True)
            except Exception:  # the kernel is gone or going; nothing left to free we can reach
                pass
            self.km = None
        await asyncio.to_thread(processes.kill_marked, self.token)

    async def restart(self) -> None:
        await self.stop()
        await self.start()
