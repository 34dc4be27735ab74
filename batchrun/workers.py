"""Worker processes: each runs many agent sessions concurrently on one asyncio loop.

Sessions mostly wait on the network, so a process holds many of them; processes never exceed the
cores. The parent hands out one task per free slot (per-prompt scheduling: a slow prompt holds one
slot, never a batch) and receives finished rows already encoded, so its own work per row is a write.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import datetime
from multiprocessing.connection import Connection, wait

from batchrun import rows
from batchrun.config import RunConfig
from batchrun.endpoint import RateGate, RunFatalError, make_client
from batchrun.environments.base import EnvironmentSettings
from batchrun.security import Redactor
from batchrun.session import Session, SessionServices, Task

_FORK = multiprocessing.get_context("fork")
STOP_GRACE_SECONDS = 15.0
SESSIONS_PER_CLIENT = 16


@dataclass
class Finished:
    """One prompt's outcome as the parent sees it: the encoded row plus what the console shows."""

    prompt_index: int
    batch_num: int
    status: str
    row: bytes
    api_calls: int
    usage: dict
    wall_time: float
    end_reason: str
    error: str | None
    error_type: str | None
    prompt_preview: str


@dataclass
class Fatal:
    message: str


def _finished(result: rows.SessionResult, config: RunConfig) -> Finished:
    batch_num = result.prompt_index // config.batch_size
    row = rows.row_for(result, batch_num=batch_num, model=config.model,
                       timestamp=datetime.now().isoformat(timespec="seconds"),
                       discard_no_reasoning=config.discard_no_reasoning)
    return Finished(prompt_index=result.prompt_index, batch_num=batch_num, status=rows.row_status(row),
                    row=rows.encode_row(row), api_calls=result.api_calls, usage=result.usage.as_dict(),
                    wall_time=result.wall_time, end_reason=result.end_reason, error=result.error,
                    error_type=result.error_type, prompt_preview=result.prompt[:config.log_prefix_chars])


def _crashed(task: Task, services: SessionServices) -> rows.SessionResult:
    """A bug in the runner fails the prompt visibly (retried on resume) instead of vanishing."""
    return rows.SessionResult(
        prompt_index=task.prompt_index, content_key=task.content_key, prompt=task.prompt,
        toolsets=list(task.toolsets), offered_tools=[], turns=[], api_calls=0, usage=rows.Usage(),
        wall_time=0.0, end_reason="error", error=services.redact(traceback.format_exc(limit=5)),
        error_type="internal_error")


def _use_pidfd_child_watcher(loop: asyncio.AbstractEventLoop) -> None:
    """Python 3.11 watches each tool subprocess with a new thread; a pidfd costs a file descriptor.
    (3.12+ chooses pidfds by itself and deprecates watchers.)"""
    if sys.version_info < (3, 12) and hasattr(asyncio, "PidfdChildWatcher"):
        watcher = asyncio.PidfdChildWatcher()
        watcher.attach_loop(loop)
        asyncio.set_child_watcher(watcher)


async def _serve(conn: Connection, services: SessionServices) -> None:
    loop = asyncio.get_running_loop()
    _use_pidfd_child_watcher(loop)
    inbox: asyncio.Queue = asyncio.Queue()

    def read_parent() -> None:
        try:
            while (message := conn.recv()) is not None:
                loop.call_soon_threadsafe(inbox.put_nowait, message)
        except (EOFError, OSError):
            pass   # the parent is gone (even kill -9): shut down and clean up environments
        loop.call_soon_threadsafe(inbox.put_nowait, None)

    threading.Thread(target=read_parent, daemon=True).start()
    fatal = asyncio.Event()

    async def run_one(task: Task) -> None:
        try:
            result = await Session(task, services).run()
        except RunFatalError as exc:
            if not fatal.is_set():
                fatal.set()
                conn.send(Fatal(services.redact(str(exc))))
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            result = _crashed(task, services)
        if not fatal.is_set():
            conn.send(_finished(result, services.config))

    running: set[asyncio.Task] = set()
    while (message := await inbox.get()) is not None:
        session = asyncio.create_task(run_one(Task(**message)))
        running.add(session)
        session.add_done_callback(running.discard)
    for session in running:
        session.cancel()
    await asyncio.gather(*running, return_exceptions=True)


def _worker_main(conn: Connection, siblings: list[Connection], slots: int, config: RunConfig, gate: RateGate,
                 env_settings: EnvironmentSettings, available_tools: frozenset[str]) -> None:
    # Fork copied the parent's ends of this worker's pipe and of earlier workers' pipes; they must
    # close here, or a killed parent would never produce the end-of-file by which workers notice.
    for inherited in siblings:
        inherited.close()
    # Ctrl-C reaches the whole process group; the parent decides how to stop, workers follow it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    client_count = max(1, math.ceil(slots / SESSIONS_PER_CLIENT))
    services = SessionServices(config=config, clients=[make_client(config.base_url, config.api_key)
                                                       for _ in range(client_count)], gate=gate,
                               env_settings=env_settings, available_tools=available_tools,
                               redact=Redactor.from_environment(config.api_key))
    asyncio.run(_serve(conn, services))


def process_count(num_workers: int) -> int:
    return max(1, min(num_workers, os.cpu_count() or 1))


class WorkerPool:
    """A fixed set of worker processes with a known number of free session slots each."""

    def __init__(self, config: RunConfig, env_settings: EnvironmentSettings, available_tools: frozenset[str]) -> None:
        self.gate = RateGate()
        count = process_count(config.num_workers)
        self._capacity = [config.num_workers // count + (1 if i < config.num_workers % count else 0)
                          for i in range(count)]
        self._free = list(self._capacity)
        self._conns: list[Connection] = []
        self._processes: list[multiprocessing.Process] = []
        for capacity in self._capacity:
            parent_end, child_end = _FORK.Pipe(duplex=True)
            process = _FORK.Process(target=_worker_main, daemon=True,
                                    args=(child_end, [*self._conns, parent_end], capacity, config, self.gate, env_settings,
                                          available_tools))
            process.start()
            child_end.close()
            self._conns.append(parent_end)
            self._processes.append(process)

    @property
    def free_slots(self) -> int:
        return sum(self._free)

    @property
    def in_flight(self) -> int:
        return sum(self._capacity) - sum(self._free)

    def submit(self, task: Task) -> None:
        worker = max(range(len(self._free)), key=self._free.__getitem__)   # the least loaded process
        self._free[worker] -= 1
        self._conns[worker].send(asdict(task))

    def receive(self, timeout: float) -> list[Finished | Fatal]:
        """Everything the workers have sent, waiting at most ``timeout`` for the first message."""
        messages: list[Finished | Fatal] = []
        ready = wait(self._conns, timeout)
        while ready:
            for conn in ready:
                worker = self._conns.index(conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    raise RuntimeError(f"worker process {self._processes[worker].pid} died "
                                       f"(exit code {self._processes[worker].exitcode})") from None
                if isinstance(message, Finished):
                    self._free[worker] += 1
                messages.append(message)
            ready = wait(self._conns, 0)
        return messages

    def stop(self) -> None:
        """Cancel in-flight sessions (their environments are cleaned up) and end the processes."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self._conns:
            conn.close()
