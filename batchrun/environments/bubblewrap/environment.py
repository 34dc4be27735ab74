"""The bubblewrap backend: a per-prompt directory on this machine, seen from inside a sandbox.

Commands run under bwrap and see the system read-only (/usr and a root made once per run holding the
few /etc files programs need: ``root``), the prompt's directory at /workspace as the only writable place
that outlives a command, a private size-capped /tmp and /dev/shm, no home directory, none of the user's
environment, no capabilities, the system-call filter of ``environments.seccomp``, and, unless the run
allows it, no network at all (not even the host's 127.0.0.1), and the limits of
``limits.ResourceLimits``. The prompt's commands share one long-lived shell inside the sandbox
(``shell``), so a command costs what starting it costs (benchmarks/environment_overhead.py measures it).
Every prompt gets a sandbox no earlier prompt used (``sandbox``); who the commands are and which bwrap
makes the sandbox: ``program``.

The directory and what goes with it (the row's cwd in it, the control group, the disk watch, the
file tools' confined access from the host, the tear-down) are a ``workspace.HostWorkspace``, as the local
backend's are; here it is bound at MOUNT_POINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Protocol, TypeVar

from batchrun.environments.base import CommandResult, Environment, EnvironmentSettings, EnvironmentSetupError
from batchrun.environments.bubblewrap.program import (
    bubblewrap_problem,
    close_root_descriptors,
    release_sandbox_uid,
    working_bwrap,
)
from batchrun.environments.bubblewrap.root import MOUNT_POINT
from batchrun.environments.bubblewrap.sandbox import new_sandbox, spares, start_shell
from batchrun.environments.bubblewrap.shell import SHELL_GRACE_SECONDS, Shell
from batchrun.environments.command_output import OutputCollector, kill_group_of
from batchrun.environments.limits import ResourceLimits, mechanism, remove_kept_groups
from batchrun.environments.workspace import HostWorkspace
from batchrun.time_limit import within

# How a command killed at its time limit ends.
_KILLED_STATUS = 128 + signal.SIGKILL


class _Destroyable(Protocol):
    async def destroy(self) -> None: ...


_Made = TypeVar("_Made", bound=_Destroyable)


class BubblewrapEnvironment(Environment):
    """One prompt's directory on this machine; its commands run in a bwrap sandbox seeing only it."""

    kind = "bubblewrap"
    start_can_fail_alone = False      # a sandbox like one the start-up check made: if one starts, all can
    runs_images = False
    shares_user_process_limit = True

    def __init__(self, settings: EnvironmentSettings, *, prompt_index: int,
                 image: str | None = None, cwd: str | None = None) -> None:
        # The row's cwd names a place inside the sandbox; the workspace takes it relative to the
        # prompt directory, so /workspace/src must reach it as src.
        inside = _under_mount(cwd) if cwd else None
        super().__init__(settings, prompt_index=prompt_index, image=image,
                         cwd=cwd if inside is None else inside)
        self.workspace: HostWorkspace | None = None      # from start() on
        self._shell: Shell | None = None
        self._uid: int | None = None    # who commands run as outside the sandbox, if not the runner
        self._lock = asyncio.Lock()     # one shell runs one command at a time
        self._creating: asyncio.Future | None = None     # a sandbox or shell whose start was cut short

    @classmethod
    def limits_line(cls, limits: ResourceLimits) -> str:
        return (f"{limits.memory_mb} MB memory, {limits.processes} processes, {limits.tmp_mb} MB /tmp, "
                f"{limits.workspace_mb} MB workspace · {mechanism()}")

    @classmethod
    def startup_check(cls) -> str:
        found = working_bwrap()
        if isinstance(found, str):
            raise EnvironmentSetupError(f"TERMINAL_ENV=bubblewrap: {found}")
        return f"chosen by TERMINAL_ENV, {found.describe()}"

    @classmethod
    def node_problem(cls) -> str | None:
        return bubblewrap_problem()

    @property
    def prompt_dir(self) -> Path | None:
        """The prompt's directory on the host, MOUNT_POINT inside the sandbox."""
        return self.workspace.directory if self.workspace is not None else None

    @property
    def workdir(self) -> Path | None:
        """Where commands start, on the host: the prompt's directory or the row's cwd in it."""
        return self.workspace.workdir if self.workspace is not None else None

    async def start(self) -> None:
        """Take a sandbox started ahead of need (and start the next), else start one now."""
        if self.settings.keep_workdirs:     # named after its prompt and left behind: never a spare
            sandbox = await self._created(new_sandbox(self.settings, f"prompt-{self.prompt_index}-"))
        else:
            spare = spares.take(self.settings)
            spares.refill(self.settings)
            sandbox = spare or await self._created(new_sandbox(self.settings, "sandbox-"))
        workspace = HostWorkspace(self.settings, sandbox.directory, sandbox.cgroup, sandbox_mount=MOUNT_POINT)
        self.workspace, self._uid, self._shell = workspace, sandbox.uid, sandbox.shell
        workspace.processes.append(sandbox.shell.process)     # the workspace's close() kills and reaps these
        try:
            workspace.make_workdir(self.cwd)
            self._hand_workdir_over(workspace)
        except (EnvironmentSetupError, OSError) as exc:
            await self.close()      # a failed start is not followed by close()
            if isinstance(exc, EnvironmentSetupError):
                raise
            raise EnvironmentSetupError(f"cannot prepare the row's cwd {self.cwd!r}: {exc}") from exc
        workspace.start_watch(self.stop_processes)

    def stop_processes(self) -> None:
        """Kill the whole sandbox, its shell too: nothing in it is trusted to do the stopping. The next
        command gets a new sandbox around the same directory (close() reaps this one)."""
        shell, self._shell = self._shell, None
        if shell is not None:
            kill_group_of(shell.process)
        if self.workspace is not None:
            self.workspace.kill_processes()

    async def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Send ``command`` to the sandbox's shell; a dead or stuck shell is replaced afterwards."""
        workspace = self._running()
        limit = self.settings.command_timeout if timeout is None else timeout
        if "\0" in command:
            return CommandResult(output="", exit_code=None, error="a command cannot contain a NUL byte")
        async with self._lock:
            await workspace.before_command()
            if self._shell is None:
                try:
                    self._shell = await self._relaunch(workspace)
                except EnvironmentSetupError as exc:
                    return CommandResult(output="", exit_code=None, error=str(exc))
            shell = self._shell
            before = workspace.limit_events()
            collector = OutputCollector(self.settings.max_output_chars)
            try:
                status, expired = await shell.run(command, _inside(workspace), limit, collector.feed)
            except TimeoutError:    # the shell did not answer the time-out: it is stuck
                await self._discard_shell(workspace)
                output, truncated = collector.finish()
                return await workspace.with_limit_notes(CommandResult(output=output, exit_code=None, timed_out=True,
                                                                      truncated=truncated), before)
            except asyncio.CancelledError:
                # Mid-command, the shell's next words belong to this command; close() reaps it.
                self._shell = None
                kill_group_of(shell.process)
                raise
            output, truncated = collector.finish()
            if status is None:
                if self._shell is shell:
                    await self._discard_shell(workspace)
                stopped = workspace.watch.take_reason() if workspace.watch is not None else None
                return CommandResult(output=output, exit_code=None, truncated=truncated,
                                     error=stopped or "the sandbox's shell died; the next command gets a new one "
                                                      f"(files in {MOUNT_POINT} are kept)")
            if expired and status == _KILLED_STATUS:
                # What the command left running out of its process group (setsid, double-forked)
                # goes with it.
                try:
                    reaped = await within(SHELL_GRACE_SECONDS, shell.reap())
                except TimeoutError:
                    reaped = False
                if not reaped:
                    await self._discard_shell(workspace)
                return await workspace.with_limit_notes(CommandResult(output=output, exit_code=None, timed_out=True,
                                                                      truncated=truncated), before)
            return await workspace.with_limit_notes(CommandResult(output=output, exit_code=status,
                                                                  truncated=truncated), before)

    async def read_file(self, path: str) -> bytes:
        return await self._running().read_file(path)

    async def write_file(self, path: str, data: bytes) -> str:
        return await self._running().write_file(path, data)

    async def close(self) -> None:
        """Kill the sandbox (bwrap and the sandbox's init are one process group, and the kernel ends
        everything in a sandbox whose init dies), then the workspace's clean-up. A start that was cut
        short is let finish first, and what it made destroyed."""
        workspace = self.workspace
        shell, self._shell = self._shell, None
        if shell is not None and workspace is not None and not workspace.closed:
            await self._kill(shell, workspace)
        creating, self._creating = self._creating, None
        if creating is not None:
            with contextlib.suppress(Exception):
                await (await asyncio.shield(creating)).destroy()
        if workspace is not None:
            await workspace.close()
        release_sandbox_uid(self._uid)      # every process of its sandboxes is gone with the control group
        self._uid = None

    async def _created(self, creation: Coroutine[Any, Any, _Made]) -> _Made:
        """Run a sandbox's (or shell's) start to its end even when this prompt is cancelled meanwhile:
        asyncio's own clean-up of a start cut short kills the outer bwrap alone, which can orphan the
        sandbox's init and then waits for pipes the sandbox still holds. close() destroys what it made."""
        creating = asyncio.ensure_future(creation)
        try:
            return await asyncio.shield(creating)
        except asyncio.CancelledError:
            self._creating = creating
            raise

    @classmethod
    async def close_idle(cls) -> None:
        """Kill this process's spares (its work is done): all at once, as the kernel tears each one's
        namespaces down in its own time; then remove the control groups kept for further prompts."""
        await spares.close()
        close_root_descriptors()
        await asyncio.to_thread(remove_kept_groups)

    def _hand_workdir_over(self, workspace: HostWorkspace) -> None:
        """The row's cwd, made in the prompt directory, belongs to the sandbox's user (a few chown calls
        on directories just made: quick enough for the event loop)."""
        if self._uid is None:
            return
        directory = workspace.workdir
        while directory != workspace.directory:
            os.chown(directory, self._uid, self._uid, follow_symlinks=False)
            directory = directory.parent

    def _running(self) -> HostWorkspace:
        """The workspace; using an environment before start() or after close() is a bug."""
        if self.workspace is None or self.workspace.closed:
            raise RuntimeError("the bubblewrap environment is not running (start() not called, or closed)")
        return self.workspace

    async def _relaunch(self, workspace: HostWorkspace) -> Shell:
        """A new sandbox around this prompt's directory and control group, its shell dead or stuck."""
        shell = await self._created(start_shell(self.settings, workspace.directory, workspace.cgroup, self._uid))
        workspace.processes.append(shell.process)
        return shell

    async def _discard_shell(self, workspace: HostWorkspace) -> None:
        shell, self._shell = self._shell, None
        if shell is not None:
            await self._kill(shell, workspace)

    @staticmethod
    async def _kill(shell: Shell, workspace: HostWorkspace) -> None:
        """Kill a shell's sandbox and forget its process group, whose id may serve another group later."""
        await shell.kill()
        if shell.process in workspace.processes:
            workspace.processes.remove(shell.process)


def _inside(workspace: HostWorkspace) -> str:
    """Where the working directory is as the sandbox sees it."""
    return posixpath.normpath(posixpath.join(MOUNT_POINT, os.path.relpath(workspace.workdir, workspace.directory)))


def _under_mount(path: str) -> str | None:
    """The rest of a path under MOUNT_POINT ('' for MOUNT_POINT itself); None for other paths."""
    if path == MOUNT_POINT:
        return ""
    if path.startswith(MOUNT_POINT + "/"):
        return path[len(MOUNT_POINT) + 1:]
    return None
