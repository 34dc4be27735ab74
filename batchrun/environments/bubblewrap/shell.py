"""The long-lived shell in one sandbox (shell.sh), and the runner's side of speaking to it.

Each command has its own random marker, so late output of an earlier command's background child, read
before the marker, is dropped, and no output can pass for the end of a command. Everything the runner
reads from a shell that is not command output is bounded: a command can take its shell over (it runs as
the same user), and such a shell may say anything, forever.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import weakref
from collections.abc import Callable
from importlib import resources

from batchrun import kernel_files
from batchrun.environments.command_output import drain_and_reap, kill_group_of
from batchrun.time_limit import within

#: The program of the shell, as bash -c runs it.
SHELL = resources.files(__package__).joinpath("shell.sh").read_text(encoding="utf-8")
# At a command's time limit the shell kills the command's process group and reports at once; a shell
# that stays silent this much longer is stuck, and its sandbox is replaced.
SHELL_GRACE_SECONDS = 2.0
_KILL_WAIT_SECONDS = 5.0
_READ_CHUNK_BYTES = 65536
_DELIVERY_BYTES_PER_SECOND = 256 * 1024     # the least a shell reading its commands takes in (see run)
# What a sandbox's shell may say that is not command output: its ready line, a status. A shell that
# says more is not ours any more (a command took it over), and is replaced.
MAX_SHELL_WORDS = 64 * 1024


def _exit_status(said: bytes | bytearray) -> bool:
    """Whether ``said`` is an exit status as bash gives one (0 to 255). A command that found its marker in
    its shell's memory can write an end line of its own: one with a status of 5,000 digits raised
    ValueError in the runner."""
    return said.isdigit() and len(said) <= 3 and int(said) <= 255


class Shell:
    """The shell in one sandbox, and a buffer over its output so markers may straddle reads."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdin is not None and process.stdout is not None   # started with pipes
        self.process = process
        self._stdin = process.stdin
        self._stdout = process.stdout
        self._buffer = bytearray()
        self.sandbox_pids: list[int] = []       # bwrap, the sandbox's init, the shell
        self._pidfd: int | None = None          # the shell process itself, to signal it

    def watch(self) -> bool:
        """Find the shell among bwrap's processes (bwrap, the sandbox's init, the shell: one chain while
        nothing else runs) and hold a pidfd on it, which can never signal another process."""
        pids = [self.process.pid]
        try:
            for _ in range(2):
                children = kernel_files.read(f"/proc/{pids[-1]}/task/{pids[-1]}/children").split()
                if len(children) != 1:
                    return False
                pids.append(int(children[0]))
            pidfd = os.pidfd_open(pids[-1])
        except (OSError, ValueError):
            return False
        self.sandbox_pids, self._pidfd = pids, pidfd
        weakref.finalize(self, os.close, pidfd)
        return True

    def signal(self, signum: int) -> bool:
        """Send the shell ``signum`` (SIGUSR1: kill the running command; SIGUSR2: kill everything but the
        shell); False if it cannot be reached."""
        if self._pidfd is None:
            return False
        try:
            signal.pidfd_send_signal(self._pidfd, signum)
        except OSError:
            return False
        return True

    async def kill(self) -> None:
        """Kill the sandbox: its bwrap dies, and with it (--die-with-parent) everything inside; then read
        its output to the end it now has, so that the pipes close while the loop runs."""
        kill_group_of(self.process)
        self._stdin.close()
        self._buffer.clear()
        await drain_and_reap(self.process, _KILL_WAIT_SECONDS)

    destroy = kill

    async def run(self, command: str, workdir: str, limit: float,
                  sink: Callable[[bytes], None]) -> tuple[int | None, bool]:
        """Run one command, passing its output to ``sink``: its exit status (None if the shell died or
        answered what no shell of ours says) and whether its time limit expired. TimeoutError if the shell
        does not answer the time-out.

        Each command has its own random marker, so late output of an earlier command's background
        child, read before the marker, is dropped, and no output can pass for the end of a command.
        """
        marker = f"batchrun-{secrets.token_hex(16)}"
        line = f"run {marker} {bash_quoted(workdir)} {bash_quoted(command)}\n"
        try:
            self._stdin.write(line.encode("ascii"))
            # A line longer than the pipe holds waits for the shell to read it, a byte at a time (about 0.25 s
            # a MiB here); a shell that a command stopped never does. So the delivery has a time limit of its
            # own, a second per 256 KiB and the grace a shell has to answer (TimeoutError: the shell is stuck).
            await within(SHELL_GRACE_SECONDS + len(line) / _DELIVERY_BYTES_PER_SECOND, self._stdin.drain())
        except (BrokenPipeError, ConnectionResetError):
            return None, False
        status = bytearray()
        # read_until can be cut short and called again, so the reading goes on after the time-out.
        parts: list[tuple[bytes, Callable[[bytes], None] | None, int | None]] = [
            (f"{marker}\n".encode(), None, None), (f"\n{marker} ".encode(), sink, None),
            (b"\n", status.extend, MAX_SHELL_WORDS)]

        async def answer_part() -> bool:
            if not await self.read_until(*parts[0]):
                return False
            parts.pop(0)
            return True

        async def answer() -> bool:
            while parts:
                if not await answer_part():
                    return False
            return True

        expired = False
        try:
            answered = await within(limit, answer())
        except TimeoutError:
            expired = True
            async with asyncio.timeout(SHELL_GRACE_SECONDS):
                # Not before the shell has read the whole line and started on it (its first answer): a
                # signal while it reads could cut the line.
                if len(parts) == 3 and not await answer_part():
                    return None, expired        # the shell died
                if not self.signal(signal.SIGUSR1):
                    raise TimeoutError from None
                answered = await answer()
        if not answered or not _exit_status(status):
            return None, expired
        return int(status), expired

    async def reap(self) -> bool:
        """Kill every process in the sandbox but the shell; False if the shell did not answer."""
        marker = f"batchrun-{secrets.token_hex(16)}"
        try:
            self._stdin.write(f"reap {marker}\n".encode("ascii"))
            await self._stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            return False
        return await self.read_until(f"{marker}\n".encode(), None)

    async def read_until(self, token: bytes, sink: Callable[[bytes], None] | None, limit: int | None = None) -> bool:
        """Pass what comes before ``token`` to ``sink`` (or drop it) and consume the token.

        False at end of output (the shell is gone), or once more than ``limit`` bytes came before the
        token, which only a shell that is not ours any more would send.
        """
        passed = 0
        while (found := self._buffer.find(token)) < 0:
            # Everything but a possible start of the token can go on at once, so a chatty command
            # is streamed into the output cap instead of piling up here.
            ready = max(len(self._buffer) - len(token) + 1, 0)
            if sink is not None and ready:
                sink(bytes(self._buffer[:ready]))
            del self._buffer[:ready]
            passed += ready
            if limit is not None and passed > limit:
                return False
            chunk = await self._stdout.read(_READ_CHUNK_BYTES)
            if not chunk:
                if sink is not None:    # the shell's last words, whole (the sandbox's error, say)
                    sink(bytes(self._buffer[:limit]))
                self._buffer.clear()
                return False
            self._buffer += chunk
        if limit is not None and passed + found > limit:
            return False
        if sink is not None:
            sink(bytes(self._buffer[:found]))
        del self._buffer[:found + len(token)]
        return True


def bash_quoted(text: str) -> str:
    """``text`` as one bash $'...' word on one line: commands may span lines, protocol lines not."""
    data = text.encode("utf-8", "surrogateescape")
    return "$'" + "".join(chr(byte) if 0x20 <= byte < 0x7f and byte not in b"'\\" else f"\\x{byte:02x}"
                          for byte in data) + "'"
