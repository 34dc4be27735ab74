"""The local backend: every prompt gets a fresh directory on this machine, and commands run there.

It controls where a command starts and what it inherits (a scrubbed environment, a private HOME, its
own process group so a time-out kills everything it started), not what it can reach: a command may
still touch anything the user can. The file tools, the model's structured way to touch files, are
confined to the prompt's directory here.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
import shutil
import signal
import stat
import sys
import tempfile
from pathlib import Path

from batchrun.environments.base import (
    CommandResult,
    Environment,
    EnvironmentSettings,
    EnvironmentSetupError,
    ToolError,
    scrubbed_environment,
)

_READ_CHUNK_BYTES = 65536
# After bash exits, a background child that inherited stdout can keep the pipe open for ever; its
# output is read for this long more, then the pipe is closed and the result returned without it.
_EXIT_GRACE_SECONDS = 0.2
# SIGKILL takes effect at once; this only bounds the wait should the kernel be slow to deliver it.
_KILL_WAIT_SECONDS = 5.0
# close() waits this long for killed commands, so asyncio reaps them while the loop still runs.
_REAP_SECONDS = 2.0
# Each rmtree pass can unlock one more level of directories a command made unreadable.
_REMOVE_PASSES = 8


class LocalEnvironment(Environment):
    """One prompt's private directory under ``settings.work_root``; commands run there via bash."""

    kind = "local"

    def __init__(self, settings: EnvironmentSettings, *, prompt_index: int,
                 image: str | None = None, cwd: str | None = None) -> None:
        super().__init__(settings, prompt_index=prompt_index, image=image, cwd=cwd)
        self.prompt_dir: Path | None = None      # the per-prompt directory; HOME of its commands
        self.workdir: Path | None = None         # where commands start: prompt_dir or the row's cwd in it
        self._processes: list[asyncio.subprocess.Process] = []
        self._closed = False

    async def start(self) -> None:
        """Create a fresh directory for this prompt (never the user's cwd)."""
        work_root = self.settings.work_root
        try:
            work_root.mkdir(parents=True, exist_ok=True)
            created = tempfile.mkdtemp(prefix=f"prompt-{self.prompt_index}-", dir=work_root)
        except OSError as exc:
            raise EnvironmentSetupError(f"cannot create a working directory under {work_root}: {exc}") from exc
        # Resolved once, so the confinement checks compare real paths with real paths.
        self.prompt_dir = Path(os.path.realpath(created))
        try:
            self.workdir = self._make_workdir(self.prompt_dir)
        except EnvironmentSetupError:
            # A failed start is not followed by close() (``async with`` skips __aexit__), so tidy up here.
            _remove_tree(self.prompt_dir)
            raise

    def _make_workdir(self, prompt_dir: Path) -> Path:
        """The row's cwd, taken relative to the prompt directory and required to stay inside it."""
        if not self.cwd:
            return prompt_dir
        workdir = Path(os.path.realpath(prompt_dir / self.cwd.lstrip("/")))
        if not _is_within(workdir, prompt_dir):
            raise EnvironmentSetupError(f"the row's cwd {self.cwd!r} leads outside the prompt's directory")
        try:
            workdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EnvironmentSetupError(f"cannot create the row's cwd {self.cwd!r}: {exc}") from exc
        return workdir

    async def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Run ``bash -c command`` in its own process group; kill the whole group on time-out.

        The output pipe is our own rather than ``stdout=PIPE``: on Python 3.11, Process.wait() waits
        for asyncio's pipes to close too, which a background child holding stdout can postpone for
        ever. Owning the read end also lets us close it once the command is done.
        """
        prompt_dir, workdir = self._require_started()
        limit = self.settings.command_timeout if timeout is None else timeout
        read_fd, write_fd = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                "bash", "-c", command, cwd=workdir, env=scrubbed_environment(home=str(prompt_dir)),
                stdin=asyncio.subprocess.DEVNULL, stdout=write_fd, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True)
        except OSError as exc:
            os.close(read_fd)
            return CommandResult(output="", exit_code=None, error=f"could not start bash: {exc}")
        finally:
            os.close(write_fd)
        self._processes.append(process)
        collector = _OutputCollector(self.settings.max_output_chars)
        stream, transport = await _open_pipe_reader(read_fd)
        reader = asyncio.create_task(_drain(stream, collector))
        try:
            exited = await _wait_for_exit(process, limit)
            if not exited:
                _kill_group(process.pid)
                await _wait_for_exit(process, _KILL_WAIT_SECONDS)
            await asyncio.wait({reader}, timeout=_EXIT_GRACE_SECONDS)
        except asyncio.CancelledError:
            _kill_group(process.pid)
            raise
        finally:
            transport.close()   # ends the reader; a background child still writing gets EPIPE
        await reader
        self._forget_finished_groups()
        output, truncated = collector.finish()
        if not exited:
            return CommandResult(output=output, exit_code=None, timed_out=True, truncated=truncated)
        return CommandResult(output=output, exit_code=process.returncode, truncated=truncated)

    async def read_file(self, path: str) -> bytes:
        """The file's bytes; refuses escapes, directories, special files and files over the size limit."""
        real = self._resolve(path)
        limit = self.settings.max_file_bytes
        try:
            mode = real.stat().st_mode
            if stat.S_ISDIR(mode):
                raise ToolError(f"{path!r} is a directory, not a file")
            if not stat.S_ISREG(mode):
                raise ToolError(f"{path!r} is not a regular file")
            with open(real, "rb") as handle:
                data = handle.read(limit + 1)   # bounded even if the file grows while it is read
        except FileNotFoundError:
            raise ToolError(f"{path!r} does not exist") from None
        except OSError as exc:
            raise ToolError(f"cannot read {path!r}: {exc.strerror or exc}") from None
        if len(data) > limit:
            raise ToolError(f"{path!r} is larger than the file tools' limit of {limit} bytes")
        return data

    async def write_file(self, path: str, data: bytes) -> str:
        """Write the file, creating parent directories; returns its path relative to the working dir."""
        limit = self.settings.max_file_bytes
        if len(data) > limit:
            raise ToolError(f"{len(data)} bytes is more than the file tools' limit of {limit} bytes")
        _, workdir = self._require_started()
        real = self._resolve(path)
        if real.is_dir():
            raise ToolError(f"{path!r} is a directory, not a file")
        try:
            real.parent.mkdir(parents=True, exist_ok=True)
            real.write_bytes(data)
        except OSError as exc:
            raise ToolError(f"cannot write {path!r}: {exc.strerror or exc}") from None
        return os.path.relpath(real, workdir)

    async def close(self) -> None:
        """Kill every process group this prompt started, then remove its directory (unless kept)."""
        if self._closed:
            return
        self._closed = True
        for process in self._processes:
            _kill_group(process.pid)
        await _reap(self._processes)
        self._processes.clear()
        if self.prompt_dir is not None and not self.settings.keep_workdirs:
            await asyncio.to_thread(_remove_tree, self.prompt_dir)

    def _require_started(self) -> tuple[Path, Path]:
        """(prompt_dir, workdir); using an environment before start() or after close() is a bug."""
        if self.prompt_dir is None or self.workdir is None or self._closed:
            raise RuntimeError("the local environment is not running (start() not called, or closed)")
        return self.prompt_dir, self.workdir

    def _resolve(self, path: str) -> Path:
        """The real path (symlinks followed) of ``path``, refused unless inside the prompt directory."""
        prompt_dir, workdir = self._require_started()
        try:
            # An absolute ``path`` replaces workdir here and is then judged like any other.
            real = Path(os.path.realpath(workdir / path))
        except ValueError as exc:                   # e.g. an embedded NUL byte
            raise ToolError(f"invalid path {path!r}: {exc}") from None
        if not _is_within(real, prompt_dir):
            raise ToolError(f"{path!r} is outside the working directory; "
                            "the file tools only reach files inside it")
        return real

    def _forget_finished_groups(self) -> None:
        """Stop tracking groups with no process left, so close() never signals a reused group id."""
        self._processes = [process for process in self._processes if _group_exists(process.pid)]


class _OutputCollector:
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


async def _drain(stream: asyncio.StreamReader, collector: _OutputCollector) -> None:
    while chunk := await stream.read(_READ_CHUNK_BYTES):
        collector.feed(chunk)


async def _open_pipe_reader(read_fd: int) -> tuple[asyncio.StreamReader, asyncio.ReadTransport]:
    """An asyncio stream over the read end of a pipe; closing the transport closes the descriptor."""
    stream = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(stream), os.fdopen(read_fd, "rb", buffering=0))
    return stream, transport


async def _wait_for_exit(process: asyncio.subprocess.Process, timeout: float) -> bool:
    """True once bash has exited, False if it is still running after ``timeout`` seconds."""
    try:
        await asyncio.wait_for(process.wait(), timeout)
    except asyncio.TimeoutError:    # not yet the built-in TimeoutError on Python 3.10
        return False
    return True


def _kill_group(pgid: int) -> None:
    """SIGKILL a process group; a group that is already gone is fine."""
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except OSError:     # gone, or (PermissionError) reused by someone else's process
        return False
    return True


async def _reap(processes: list[asyncio.subprocess.Process]) -> None:
    """Wait briefly for killed commands, so asyncio reaps them and closes their transports."""
    if not processes:
        return
    waiters = [asyncio.ensure_future(process.wait()) for process in processes]
    _, pending = await asyncio.wait(waiters, timeout=_REAP_SECONDS)
    for waiter in pending:
        waiter.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def _is_within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _remove_tree(root: Path) -> None:
    """Delete a prompt directory even where a command made parts of it read-only; never raises.

    Read-only directories are common (Go's module cache under HOME, for one): each failure makes the
    directories involved writable again, and the next pass removes what the previous could not.
    """
    top = os.fspath(root)

    def loosen(_function: object, failed: str, _error: object) -> None:
        for target in (os.path.dirname(failed), failed):
            inside = target == top or target.startswith(top + os.sep)
            if inside and not os.path.islink(target):
                with contextlib.suppress(OSError):
                    os.chmod(target, stat.S_IRWXU)

    for _ in range(_REMOVE_PASSES):
        if not os.path.lexists(top):
            return
        if sys.version_info >= (3, 12):
            shutil.rmtree(top, onexc=loosen)
        else:
            shutil.rmtree(top, onerror=loosen)      # onexc does not exist before 3.12
