"""Calling a container CLI (docker, podman, singularity) for housekeeping: inspect, pull, create, file I/O.

Unlike a terminal command, these need stdout and stderr apart — stdout is data (a file's bytes, an
ID), stderr is the engine's explanation that becomes the error message.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
from dataclasses import dataclass

from batchrun.environments.command_output import kill_group_of, wait_for_exit
from batchrun.time_limit import within

# An engine's messages can be long (a pull's whole progress log); the end says what went wrong.
_MESSAGE_CHARS = 1000
# Words the engines put around every explanation; without them the reason comes first.
_BOILERPLATE = re.compile(r"(?:docker: )?Error response from daemon: |^Error: "
                          r"|\s*Run '[^']*--help' for more information\.?")


@dataclass
class CliResult:
    """One CLI call's outcome; ``returncode`` is None when it was killed for taking too long."""

    returncode: int | None
    stdout: bytes
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def message(self) -> str:
        """What the CLI said about a failure, in one short piece of text."""
        if self.returncode is None:
            return "the command took too long and was stopped"
        text = _BOILERPLATE.sub("", " ".join(self.stderr.split())).strip() or f"exit status {self.returncode}"
        return text if len(text) <= _MESSAGE_CHARS else "…" + text[-_MESSAGE_CHARS:]


async def call_cli(argv: list[str], *, timeout: float, stdin: bytes | None = None) -> CliResult:
    """Run ``argv`` to completion (killed after ``timeout`` seconds or on cancellation).

    It gets its own process group, so killing it on our side also ends the helpers a CLI starts.
    Raises OSError when the program cannot be started.
    """
    process = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = await within(timeout, process.communicate(stdin))
    except TimeoutError:
        kill_group_of(process)
        await wait_for_exit(process, timeout=5.0)
        return CliResult(returncode=None, stdout=b"", stderr="")
    except BaseException:       # cancelled: the CLI must not outlive the prompt it works for
        kill_group_of(process)
        raise
    return CliResult(returncode=process.returncode, stdout=stdout, stderr=stderr.decode("utf-8", "replace"))


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
