"""Running one terminal command as a local process: merged, capped output under a time limit.

Every backend's terminal command is a local process in the end — bash itself (local), or a container
CLI (``docker exec``, ``singularity exec``) standing in for the process inside the container — so the
pipe handling, the output cap and the kill on time-out live here once.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
import signal
from typing import Callable

from batchrun.environments.base import CommandResult
from batchrun.time_limit import within

_READ_CHUNK_BYTES = 65536
# After the process exits, a background child that inherited stdout can keep the pipe open for ever;
# its output is read for this long more, then the pipe is closed and the result returned without it.
_EXIT_GRACE_SECONDS = 0.2
# SIGKILL takes effect at once; this only bounds the wait should the kernel be slow to deliver it.
_KILL_WAIT_SECONDS = 5.0


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
            output += f"\n[output truncated: {self._dropped} more characters not shown]"
        return output, bool(self._dropped)


async def run_merged(argv: list[str], *, timeout: float, max_output_chars: int, cwd: str | os.PathLike | None = None,
                     env: dict[str, str] | None = None,
                     on_start: Callable[[asyncio.subprocess.Process], None] | None = None) -> CommandResult:
    """Run ``argv`` in its own process group with stdout and stderr merged; kill the group on time-out
    or cancellation. Raises OSError when the program cannot be started.

    The output pipe is our own rather than ``stdout=PIPE``: on Python 3.11, Process.wait() waits for
    asyncio's pipes to close too, which a background child holding stdout can postpone for ever.
    Owning the read end also lets us close it once the command is done. ``on_start`` sees the process
    as soon as it exists, for backends that track what they started.
    """
    read_fd, write_fd = os.pipe()
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=write_fd,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True)
    except OSError:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    if on_start is not None:
        on_start(process)
    collector = OutputCollector(max_output_chars)
    output = _PipeReader(read_fd, collector)
    try:
        exited = await wait_for_exit(process, timeout)
        if not exited:
            kill_group(process.pid)
            await wait_for_exit(process, _KILL_WAIT_SECONDS)
        if not output.finished.done():
            await asyncio.wait({output.finished}, timeout=_EXIT_GRACE_SECONDS)
    except asyncio.CancelledError:
        kill_group(process.pid)
        raise
    finally:
        output.close()   # a background child still writing gets EPIPE
    text, truncated = collector.finish()
    if not exited:
        return CommandResult(output=text, exit_code=None, timed_out=True, truncated=truncated)
    return CommandResult(output=text, exit_code=process.returncode, truncated=truncated)


async def wait_for_exit(process: asyncio.subprocess.Process, timeout: float) -> bool:
    """True once the process has exited, False if it is still running after ``timeout`` seconds."""
    try:
        await within(timeout, process.wait())
    except asyncio.TimeoutError:    # not yet the built-in TimeoutError on Python 3.10
        return False
    return True


def kill_group(pgid: int) -> None:
    """SIGKILL a process group; a group that is already gone is fine."""
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


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
        self._loop.add_reader(fd, self._read)

    def _read(self) -> None:
        try:
            data = os.read(self._fd, _READ_CHUNK_BYTES)
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
