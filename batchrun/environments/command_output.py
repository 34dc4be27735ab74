"""Running one terminal command as a local process: merged, capped output under a time limit.

Every backend's terminal command is a local process in the end — bash itself (local), or a container
CLI (``docker exec``, ``singularity exec``) standing in for the process inside the container — so the
start, the pipe handling, the output cap and the kill on time-out live here once.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import cast

from batchrun.environments.base import CommandResult
from batchrun.time_limit import within

_READ_CHUNK_BYTES = 65536
# After the process exits, a background child that inherited stdout can keep the pipe open for ever;
# its output is read for this long more, then the pipe is closed and the result returned without it.
_EXIT_GRACE_SECONDS = 0.2
# SIGKILL takes effect at once; this only bounds the wait should the kernel be slow to deliver it.
_KILL_WAIT_SECONDS = 5.0
# Where pidfds are missing (not Linux), a command's exit is noticed by polling this often.
_EXIT_POLL_SECONDS = 0.01
# Ends an output that was cut, before the count of what was dropped.
TRUNCATION_NOTE = "\n[output truncated: "


class OutputCollector:
    """Keeps the first ``limit`` characters of a command's output and counts the rest.

    Everything is still read and decoded, so the child never blocks on a full pipe, but only the
    kept part is stored.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._parts: list[str] = []
        self._kept = 0
        self._dropped = 0

    def feed(self, data: bytes, final: bool = False) -> None:
        text = self._decoder.decode(data, final)
        kept = text[:max(self._limit - self._kept, 0)]
        if kept:
            self._parts.append(kept)
            self._kept += len(kept)
        self._dropped += len(text) - len(kept)

    def finish(self) -> tuple[str, bool]:
        """(output, truncated); the output ends with a note when characters were dropped."""
        self.feed(b"", final=True)
        output = "".join(self._parts)
        if self._dropped:
            output += f"{TRUNCATION_NOTE}{self._dropped} more characters not shown]"
        return output, bool(self._dropped)


async def run_merged(argv: list[str], *, timeout: float, max_output_chars: int, cwd: str | os.PathLike | None = None,
                     env: dict[str, str] | None = None,
                     on_start: Callable[[ChildProcess], None] | None = None) -> CommandResult:
    """Run ``argv`` in its own process group with stdout and stderr merged; kill the group on time-out
    or cancellation. Raises OSError when the program cannot be started.

    The output pipe is our own, read from the loop's callbacks, and closed once the command is done:
    a background child holding it open can never keep the command from ending. ``on_start`` sees the
    process as soon as it exists, for backends that track what they started.
    """
    read_fd, write_fd = os.pipe()
    try:
        process = await start_process(argv, cwd=cwd, env=env, output_fd=write_fd)
    except BaseException:
        os.close(read_fd)
        raise
    if on_start is not None:
        on_start(process)
    collector = OutputCollector(max_output_chars)
    output = _PipeReader(read_fd, collector)
    try:
        exited = await wait_for_exit(process, timeout)
        if not exited:
            kill_group_of(process)
            await wait_for_exit(process, _KILL_WAIT_SECONDS)
        if not output.finished.done():
            await asyncio.wait({output.finished}, timeout=_EXIT_GRACE_SECONDS)
    except asyncio.CancelledError:
        kill_group_of(process)
        raise
    finally:
        output.close()   # a background child still writing gets EPIPE
    text, truncated = collector.finish()
    if not exited:
        return CommandResult(output=text, exit_code=None, timed_out=True, truncated=truncated)
    return CommandResult(output=text, exit_code=process.returncode, truncated=truncated)


async def start_process(argv: list[str], *, cwd: str | os.PathLike | None, env: dict[str, str] | None,
                        output_fd: int) -> ChildProcess:
    """Start ``argv`` as the leader of a new session, stdin from /dev/null, stdout and stderr to
    ``output_fd`` (which this closes). Raises OSError when the program cannot be started.

    The start happens in a thread of its own: the kernel holds the starting thread until the child
    has exec'd, a millisecond or more on a busy machine, and in the event loop's thread every other
    session of the process would wait too (docs/performance.md has the stall measured both ways). A
    session cancelled meanwhile leaves no command behind: it is killed as soon as it exists.
    """
    started = _starter().start(argv, cwd, env, output_fd)
    try:
        return ChildProcess(await started)
    except asyncio.CancelledError:
        if started.done() and not started.cancelled() and started.exception() is None:
            kill_group_of(started.result())     # it started just before the cancellation arrived
        raise


class _Starter:
    """This process's one thread that starts commands, in the order asked (one thread, not a pool:
    a start takes about a millisecond, and each thread costs its own malloc arena)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="command-start", daemon=True).start()

    def start(self, argv: list[str], cwd: str | os.PathLike | None, env: dict[str, str] | None,
              output_fd: int) -> asyncio.Future[subprocess.Popen]:
        loop = asyncio.get_running_loop()
        started = loop.create_future()
        self._requests.put((loop, started, argv, cwd, env, output_fd))
        return started

    def _serve(self) -> None:
        while True:
            loop, started, argv, cwd, env, output_fd = self._requests.get()
            popen, error = None, None
            try:
                popen = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=output_fd,
                                         stderr=subprocess.STDOUT, start_new_session=True)
            except Exception as exc:
                error = exc
            finally:
                os.close(output_fd)
            if started.cancelled():    # its session is gone, and its loop may be too
                _settle(started, popen, error)
                continue
            try:
                loop.call_soon_threadsafe(_settle, started, popen, error)
            except RuntimeError:       # its loop has closed: no one is left to wait for the command
                if popen is not None:
                    kill_group_of(popen)


def _settle(started: asyncio.Future[subprocess.Popen], popen: subprocess.Popen | None,
            error: BaseException | None) -> None:
    if started.cancelled():
        if popen is not None:
            kill_group_of(popen)    # subprocess reaps the dropped Popen on a later start
    elif error is not None:
        started.set_exception(error)
    else:
        started.set_result(cast(subprocess.Popen, popen))     # there is one whenever there is no error


_STARTER: _Starter | None = None


def _starter() -> _Starter:
    """Made per process: a forked child has no copy of its parent's thread."""
    global _STARTER
    if _STARTER is None or _STARTER.pid != os.getpid():
        _STARTER = _Starter()
    return _STARTER


class ChildProcess:
    """A command started by :func:`start_process`: its pid, and its exit awaited from the event loop
    through a pidfd (asyncio's own process objects can only be started from the loop's thread)."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self._popen = popen
        self.pid = popen.pid
        self._exit: asyncio.Future[None] | None = None
        self._exit_poller: asyncio.Task | None = None

    @property
    def returncode(self) -> int | None:
        """The exit code, or minus the signal that ended it; None while it runs (or is not yet reaped)."""
        return self._popen.returncode

    async def wait(self) -> int:
        if self._popen.poll() is None:
            if self._exit is None:
                self._exit = asyncio.get_running_loop().create_future()
                self._watch_exit(self._exit)
            await asyncio.shield(self._exit)      # a cancelled waiter leaves the others waiting
        return self._popen.returncode

    def _watch_exit(self, done: asyncio.Future[None]) -> None:
        loop = asyncio.get_running_loop()
        try:
            pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):       # no pidfds here: poll
            self._exit_poller = loop.create_task(self._poll_exit(done))
            return

        def exited() -> None:
            if self._popen.poll() is not None:
                loop.remove_reader(pidfd)
                os.close(pidfd)
                done.set_result(None)
        loop.add_reader(pidfd, exited)

    async def _poll_exit(self, done: asyncio.Future[None]) -> None:
        while self._popen.poll() is None:
            await asyncio.sleep(_EXIT_POLL_SECONDS)
        done.set_result(None)


async def wait_for_exit(process: asyncio.subprocess.Process | ChildProcess, timeout: float) -> bool:
    """True once the process has exited, False if it is still running after ``timeout`` seconds."""
    try:
        await within(timeout, process.wait())
    except TimeoutError:
        return False
    return True


async def drain_and_reap(process: asyncio.subprocess.Process, timeout: float) -> None:
    """Read a killed process's pipes to their end, dropping what they held, and reap it, for up to
    ``timeout`` seconds. asyncio's wait() waits for the pipes' ends too, and a pipe's reader whose buffer
    is full stops watching the pipe: unread, the end never comes, and the process is left behind."""
    async def drained(stream: asyncio.StreamReader | None) -> None:
        while stream is not None and await stream.read(_READ_CHUNK_BYTES):
            pass

    with contextlib.suppress(TimeoutError):
        await within(timeout, asyncio.gather(drained(process.stdout), drained(process.stderr), process.wait()))


def kill_group(pgid: int) -> None:
    """SIGKILL a process group; a group that is already gone is fine."""
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


def kill_group_of(process: asyncio.subprocess.Process | ChildProcess | subprocess.Popen) -> None:
    """SIGKILL the process group ``process`` leads, while it is still ours: until the leader is reaped
    its id names no other group, after that it may name anyone's (another prompt's sandbox, in a root
    run a host service's)."""
    if process.returncode is None:
        kill_group(process.pid)


class _PipeReader:
    """Feeds a pipe's bytes to a collector from the event loop's own read callbacks.

    No task and no awaited set-up per command: with many sessions in one loop, every extra turn of
    the loop a command needs waits behind all the other sessions' work.
    """

    def __init__(self, fd: int, collector: OutputCollector) -> None:
        self._fd: int | None = fd
        self._collector = collector
        self._loop = asyncio.get_running_loop()
        self.finished: asyncio.Future[None] = self._loop.create_future()    # end of file, or closed
        os.set_blocking(fd, False)
        self._loop.add_reader(fd, self._read, fd)

    def _read(self, fd: int) -> None:
        try:
            data = os.read(fd, _READ_CHUNK_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self._collector.feed(data)
        else:
            self.close()

    def close(self) -> None:
        if self._fd is not None:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None
        if not self.finished.done():
            self.finished.set_result(None)
