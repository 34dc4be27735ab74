"""The bubblewrap backend: the local backend's per-prompt directory, seen from inside a sandbox.

Commands run under bwrap and see the system read-only (/usr and a root made once per run holding the
few /etc files programs need: ``root``), the prompt's directory at /workspace as the only writable place
that outlives a command, a private size-capped /tmp and /dev/shm, no home directory, none of the user's
environment, no capabilities, the system-call filter of ``environments.seccomp``, and, unless the run
allows it, no network at all (not even the host's 127.0.0.1), and the limits of
``limits.ResourceLimits``. The prompt's commands share one long-lived shell inside the sandbox
(``shell``), so a command costs what starting it costs (benchmarks/environment_overhead.py measures it).
Every prompt gets a sandbox no earlier prompt used (``sandbox``); who the commands are and which bwrap
makes the sandbox: ``program``.

The file tools act on the same directory from the host, with the local backend's confinement.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import signal
from collections.abc import Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from batchrun.environments.base import CommandResult, EnvironmentSettings, EnvironmentSetupError
from batchrun.environments.bubblewrap.program import bubblewrap_problem, release_sandbox_uid
from batchrun.environments.bubblewrap.root import MOUNT_POINT
from batchrun.environments.bubblewrap.sandbox import new_sandbox, spares, start_shell
from batchrun.environments.bubblewrap.shell import SHELL_GRACE_SECONDS, Shell
from batchrun.environments.command_output import OutputCollector, kill_group_of
from batchrun.environments.confined_files import ConfinedPath
from batchrun.environments.local import LocalEnvironment
from batchrun.time_limit import within

# How a command killed at its time limit ends.
_KILLED_STATUS = 128 + signal.SIGKILL


class _Destroyable(Protocol):
    async def destroy(self) -> None: ...


_Made = TypeVar("_Made", bound=_Destroyable)


class BubblewrapEnvironment(LocalEnvironment):
    """A LocalEnvironment whose commands run in a bwrap sandbox seeing only its directory."""

    kind = "bubblewrap"

    def __init__(self, settings: EnvironmentSettings, *, prompt_index: int,
                 image: str | None = None, cwd: str | None = None) -> None:
        # The row's cwd names a place inside the sandbox; the local backend takes it relative to the
        # prompt directory, so /workspace/src must reach it as src.
        inside = _under_mount(cwd) if cwd else None
        super().__init__(settings, prompt_index=prompt_index, image=image,
                         cwd=cwd if inside is None else inside)
        self._shell: Shell | None = None
        self._uid: int | None = None    # who commands run as outside the sandbox, if not the runner
        self._lock = asyncio.Lock()     # one shell runs one command at a time
        self._creating: asyncio.Future | None = None     # a sandbox or shell whose start was cut short

    @classmethod
    def node_problem(cls) -> str | None:
        return bubblewrap_problem()

    async def start(self) -> None:
        """Take a sandbox started ahead of need (and start the next), else start one now."""
        if self.settings.keep_workdirs:     # named after its prompt and left behind: never a spare
            sandbox = await self._created(new_sandbox(self.settings, f"prompt-{self.prompt_index}-"))
        else:
            spare = spares.take(self.settings)
            spares.refill(self.settings)
            sandbox = spare or await self._created(new_sandbox(self.settings, "sandbox-"))
        self.prompt_dir, self._cgroup, self._uid = sandbox.directory, sandbox.cgroup, sandbox.uid
        self._shell = sandbox.shell
        self._processes.append(sandbox.shell.process)     # LocalEnvironment.close() kills and reaps these
        try:
            self.workdir = self._make_workdir(sandbox.directory)
            self._hand_workdir_over()
        except (EnvironmentSetupError, OSError) as exc:
            await self.close()      # a failed start is not followed by close()
            if isinstance(exc, EnvironmentSetupError):
                raise
            raise EnvironmentSetupError(f"cannot prepare the row's cwd {self.cwd!r}: {exc}") from exc
        self.watch_workspace()

    def stop_processes(self) -> None:
        """Kill the whole sandbox, its shell too: nothing in it is trusted to do the stopping. The next
        command gets a new sandbox around the same directory (close() reaps this one)."""
        shell, self._shell = self._shell, None
        if shell is not None:
            kill_group_of(shell.process)
        super().stop_processes()

    def _kill_command_groups(self) -> None:
        """The prompt's processes are the sandboxes' shells: one whose bwrap is reaped left nothing
        behind (its PID namespace died with it), and its group id may name someone else's group now."""
        for process in self._processes:
            kill_group_of(process)

    async def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Send ``command`` to the sandbox's shell; a dead or stuck shell is replaced afterwards."""
        prompt_dir, workdir = self._require_started()
        limit = self.settings.command_timeout if timeout is None else timeout
        if "\0" in command:
            return CommandResult(output="", exit_code=None, error="a command cannot contain a NUL byte")
        async with self._lock:
            if self._shell is None:
                try:
                    self._shell = await self._relaunch()
                except EnvironmentSetupError as exc:
                    return CommandResult(output="", exit_code=None, error=str(exc))
            shell = self._shell
            before = self.limit_events()
            collector = OutputCollector(self.settings.max_output_chars)
            try:
                status, expired = await shell.run(command, _inside(prompt_dir, workdir), limit, collector.feed)
            except TimeoutError:    # the shell did not answer the time-out: it is stuck
                await self._discard_shell()
                output, truncated = collector.finish()
                return CommandResult(output=output, exit_code=None, timed_out=True, truncated=truncated)
            except asyncio.CancelledError:
                # Mid-command, the shell's next words belong to this command; close() reaps it.
                self._shell = None
                kill_group_of(shell.process)
                raise
            output, truncated = collector.finish()
            if status is None:
                if self._shell is shell:
                    await self._discard_shell()
                stopped = self._watch.take_reason() if self._watch is not None else None
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
                    await self._discard_shell()
                return CommandResult(output=output, exit_code=None, timed_out=True, truncated=truncated)
            return await self.with_limit_notes(CommandResult(output=output, exit_code=status, truncated=truncated),
                                               before)

    async def close(self) -> None:
        """Kill the sandbox (bwrap and the sandbox's init are one process group, and the kernel ends
        everything in a sandbox whose init dies), then the local backend's clean-up. A start that was cut
        short is let finish first, and what it made destroyed."""
        shell, self._shell = self._shell, None
        if shell is not None and not self._closed:
            await self._kill(shell)
        creating, self._creating = self._creating, None
        if creating is not None:
            with contextlib.suppress(Exception):
                await (await asyncio.shield(creating)).destroy()
        await super().close()
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
        namespaces down in its own time."""
        await spares.close()

    def _hand_workdir_over(self) -> None:
        """The row's cwd, made in the prompt directory, belongs to the sandbox's user (a few chown calls
        on directories just made: quick enough for the event loop)."""
        prompt_dir, workdir = self._require_started()
        if self._uid is None:
            return
        directory = workdir
        while directory != prompt_dir:
            os.chown(directory, self._uid, self._uid, follow_symlinks=False)
            directory = directory.parent

    def _resolve(self, path: str) -> ConfinedPath:
        """As the local backend looks paths up, but absolute paths and absolute symlinks name the
        prompt directory as the sandbox sees it (MOUNT_POINT). Hard links are allowed: the sandbox
        sees no file of the user's that it could link in, and tools (uv, pip caches) make them."""
        return replace(super()._resolve(path), root_name=MOUNT_POINT, allow_hard_links=True)

    async def _relaunch(self) -> Shell:
        """A new sandbox around this prompt's directory and control group, its shell dead or stuck."""
        prompt_dir, _ = self._require_started()
        shell = await self._created(start_shell(self.settings, prompt_dir, self._cgroup, self._uid))
        self._processes.append(shell.process)
        return shell

    async def _discard_shell(self) -> None:
        shell, self._shell = self._shell, None
        if shell is not None:
            await self._kill(shell)

    async def _kill(self, shell: Shell) -> None:
        """Kill a shell's sandbox and forget its process group, whose id may serve another group later."""
        await shell.kill()
        if shell.process in self._processes:
            self._processes.remove(shell.process)


def _inside(prompt_dir: Path, workdir: Path) -> str:
    """Where ``workdir`` is as the sandbox sees it."""
    return posixpath.normpath(posixpath.join(MOUNT_POINT, os.path.relpath(workdir, prompt_dir)))


def _under_mount(path: str) -> str | None:
    """The rest of a path under MOUNT_POINT ('' for MOUNT_POINT itself); None for other paths."""
    if path == MOUNT_POINT:
        return ""
    if path.startswith(MOUNT_POINT + "/"):
        return path[len(MOUNT_POINT) + 1:]
    return None
