"""Calling a container CLI (docker, podman, singularity) for housekeeping: inspect, pull, create, file I/O.

Unlike a terminal command, these need stdout and stderr apart — stdout is data (a file's bytes, an
ID), stderr is the engine's explanation that becomes the error message.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from batchrun.environments.command_output import drain_and_reap, kill_group_of
from batchrun.time_limit import within

# An engine's messages can be long (a pull's whole progress log); the end says what went wrong.
_MESSAGE_CHARS = 1000
# What a call may write, unless its caller allows more: an engine's answers and a pull's progress log are
# far shorter. Programs in a container are the prompt's to replace, so what they write is bounded too.
STDOUT_BYTES = 16 * 1024 * 1024
STDERR_BYTES = 64 * 1024
_READ_CHUNK_BYTES = 65536
# Words the engines put around every explanation; without them the reason comes first.
_BOILERPLATE = re.compile(r"(?:docker: )?Error response from daemon: |^Error: "
                          r"|\s*Run '[^']*--help' for more information\.?")


@dataclass
class CliResult:
    """One CLI call's outcome; ``returncode`` is None when it was killed for taking too long."""

    returncode: int | None
    stdout: bytes
    stderr: str
    #: Stopped for writing more than it was allowed (stdout then holds the allowed part and one byte more).
    overflowed: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def message(self) -> str:
        """What the CLI said about a failure, in one short piece of text."""
        if self.overflowed:
            return "the command wrote more than it may and was stopped"
        if self.returncode is None:
            return "the command took too long and was stopped"
        text = _BOILERPLATE.sub("", " ".join(self.stderr.split())).strip() or f"exit status {self.returncode}"
        return text if len(text) <= _MESSAGE_CHARS else "…" + text[-_MESSAGE_CHARS:]


async def call_cli(argv: list[str], *, timeout: float, stdin: bytes | None = None,
                   max_stdout: int = STDOUT_BYTES, cwd: Path | None = None,
                   env: dict[str, str] | None = None) -> CliResult:
    """Run ``argv`` to completion (killed after ``timeout`` seconds, on cancellation, or once it has
    written more than ``max_stdout`` bytes to stdout or 64 KB to stderr), in ``cwd`` and with the
    environment ``env`` where given (else this process's).

    It gets its own process group, so killing it on our side also ends the helpers a CLI starts.
    Raises OSError when the program cannot be started.
    """
    process = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True, cwd=cwd, env=env)
    overflowed = False

    async def collect(stream: asyncio.StreamReader, limit: int) -> bytes:
        """Up to one byte past ``limit``, the rest read and dropped to the pipe's end (see drain_and_reap)."""
        nonlocal overflowed
        data = bytearray()
        while chunk := await stream.read(_READ_CHUNK_BYTES):
            if len(data) <= limit:
                data += chunk
                if len(data) > limit:
                    overflowed = True
                    kill_group_of(process)
        return bytes(data[:limit + 1])

    async def talk() -> tuple[bytes, bytes]:
        assert process.stdout is not None and process.stderr is not None
        stdout, stderr, _ = await asyncio.gather(
            collect(process.stdout, max_stdout), collect(process.stderr, STDERR_BYTES), _feed(process, stdin))
        await process.wait()
        return stdout, stderr

    try:
        stdout, stderr = await within(timeout, talk())
    except TimeoutError:
        kill_group_of(process)
        await drain_and_reap(process, timeout=5.0)
        return CliResult(returncode=None, stdout=b"", stderr="", overflowed=overflowed)
    except BaseException:       # cancelled: the CLI must not outlive the prompt it works for
        kill_group_of(process)
        # Nor its pipes the call: a reader stopped on a full buffer never sees their end, and each call
        # cancelled so would hold two descriptors for the rest of the run.
        await drain_and_reap(process, timeout=5.0)
        raise
    return CliResult(returncode=None if overflowed else process.returncode, stdout=stdout,
                     stderr=stderr.decode("utf-8", "replace"), overflowed=overflowed)


async def _feed(process: asyncio.subprocess.Process, data: bytes | None) -> None:
    """Write ``data`` to the process's stdin and close it; a process that stops reading loses the rest."""
    if data is None or process.stdin is None:
        return
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        process.stdin.write(data)
        await process.stdin.drain()
    process.stdin.close()


def call_cli_blocking(argv: list[str], *, timeout: float) -> CliResult:
    """The same for code outside any event loop (clean-up before a run); never raises."""
    try:
        completed = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return CliResult(returncode=None, stdout=b"", stderr="")
    except OSError as exc:
        return CliResult(returncode=127, stdout=b"", stderr=str(exc))
    return CliResult(returncode=completed.returncode, stdout=completed.stdout,
                     stderr=completed.stderr.decode("utf-8", "replace"))
