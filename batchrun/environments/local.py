"""The local backend: every prompt gets a fresh directory on this machine, and commands run there.

It controls where a command starts and what it inherits (a scrubbed environment, a private HOME, its
own process group so a time-out kills everything it started), not what it can reach: a command may
still touch anything the user can. The file tools, the model's structured way to touch files, are
confined to the prompt's directory here.
"""

from __future__ import annotations

import asyncio
import os
import stat
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
from batchrun.environments.command_output import ChildProcess, kill_group, run_merged
from batchrun.environments.tree_removal import remove_tree

# close() waits this long for killed commands, so they are reaped while the loop still runs.
_REAP_SECONDS = 2.0


class LocalEnvironment(Environment):
    """One prompt's private directory under ``settings.work_root``; commands run there via bash."""

    kind = "local"

    def __init__(self, settings: EnvironmentSettings, *, prompt_index: int,
                 image: str | None = None, cwd: str | None = None) -> None:
        super().__init__(settings, prompt_index=prompt_index, image=image, cwd=cwd)
        self.prompt_dir: Path | None = None      # the per-prompt directory; HOME of its commands
        self.workdir: Path | None = None         # where commands start: prompt_dir or the row's cwd in it
        self._processes: list[ChildProcess] = []
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
            remove_tree(self.prompt_dir)
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
        """Run ``bash -c command`` in its own process group; kill the whole group on time-out."""
        prompt_dir, workdir = self._require_started()
        limit = self.settings.command_timeout if timeout is None else timeout
        try:
            result = await run_merged(["bash", "-c", command], timeout=limit,
                                      max_output_chars=self.settings.max_output_chars, cwd=workdir,
                                      env=scrubbed_environment(home=str(prompt_dir)),
                                      on_start=self._processes.append)
        except OSError as exc:
            return CommandResult(output="", exit_code=None, error=f"could not start bash: {exc}")
        self._forget_finished_groups()
        return result

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
            kill_group(process.pid)
        await _reap(self._processes)
        self._processes.clear()
        if self.prompt_dir is not None and not self.settings.keep_workdirs:
            try:
                os.rmdir(self.prompt_dir)       # many prompts leave nothing behind: no thread needed
            except OSError:
                await asyncio.to_thread(remove_tree, self.prompt_dir)

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


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except OSError:     # gone, or (PermissionError) reused by someone else's process
        return False
    return True


async def _reap(processes: list[ChildProcess]) -> None:
    """Wait briefly for killed commands, so they are reaped rather than left as zombies."""
    if not processes:
        return
    waiters = [asyncio.ensure_future(process.wait()) for process in processes]
    _, pending = await asyncio.wait(waiters, timeout=_REAP_SECONDS)
    for waiter in pending:
        waiter.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def _is_within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents
