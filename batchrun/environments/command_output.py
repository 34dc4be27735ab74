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
    stream, transport = await _open_pipe_reader(read_fd)
    reader = asyncio.create_task(_drain(stream, collector))
    try:
        exited = await wait_for_exit(process, timeout)
        if not exited:
            kill_group(process.pid)
            await wait_for_exit(process, _KILL_WAIT_SECONDS)
        await asyncio.wait({reader}, timeout=_EXIT_GRACE_SECONDS)
    except asyncio.CancelledError:
        kill_group(process.pid)
        raise
    finally:
        transport.close()   # ends the reader; a background child still writing gets EPIPE
    await reader
    output, truncated = collector.finish()
    if not exited:
        return CommandResult(output=output, exit_code=None, timed_out=True, truncated=truncated)
    return CommandResult(output=output, exit_code=process.returncode, truncated=truncated)


async def wait_for_exit(process: asyncio.subprocess.Process, timeout: float) -> bool:
    """True once the process has exited, False if it is still running after ``timeout`` seconds."""
    try:
        await asyncio.wait_for(process.wait(), timeout)
    except asyncio.TimeoutError:    # not yet the built-in TimeoutError on Python 3.10
        return False
    return True


def kill_group(pgid: int) -> None:
    """SIGKILL a process group; a group that is already gone is fine."""
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


async def _drain(stream: asyncio.StreamReader, collector: OutputCollector) -> None:
    while chunk := await stream.read(_READ_CHUNK_BYTES):
        collector.feed(chunk)


async def _open_pipe_reader(read_fd: int) -> tuple[asyncio.StreamReader, asyncio.ReadTransport]:
    """An asyncio stream over the read end of a pipe; closing the transport closes the descriptor."""
    stream = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(stream), os.fdopen(read_fd, "rb", buffering=0))
    return stream, transport
