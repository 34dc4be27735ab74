"""One prompt's directory on this machine, and everything that goes with it, for the backends that keep it here.

The local backend runs commands in the directory itself; the bubblewrap backend runs them in a sandbox
that binds it at /workspace. Either way the directory is the prompt's one lasting place, and the same
things come with it: the row's cwd made inside it, the control group and process groups of what the
prompt started (which may write to it), the disk watch that holds it to its limit, the notes on limits
a command ran into, the file tools' confined access from the host, and the tear-down that kills those
processes and removes it. Each of the two backends holds one :class:`HostWorkspace`; how commands reach
the directory is the backend's own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import posixpath
import tempfile
from collections.abc import Callable
from pathlib import Path

from batchrun.environments.base import (
    CommandResult,
    EnvironmentSettings,
    EnvironmentSetupError,
    ToolError,
    WorkRootError,
    claim_work_root,
)
from batchrun.environments.command_output import ChildProcess, kill_group, kill_group_of
from batchrun.environments.confined_files import ConfinedPath, read_regular_file, write_regular_file
from batchrun.environments.disk_guard import WorkspaceWatch, guard_for
from batchrun.environments.limits import MIB, LimitEvents, PromptCgroup
from batchrun.environments.tree_removal import remove_tree
from batchrun.proc import descendants

# close() waits this long for killed processes, so they are reaped while the loop still runs.
_REAP_SECONDS = 2.0


def new_prompt_directory(settings: EnvironmentSettings, prefix: str) -> Path:
    """A fresh directory under the run's work root, resolved once so that the confinement checks
    compare real paths with real paths (never the user's cwd)."""
    try:
        claim_work_root(settings.work_root)
        created = tempfile.mkdtemp(prefix=prefix, dir=settings.work_root)
    except (OSError, WorkRootError) as exc:
        raise EnvironmentSetupError(f"cannot create a working directory under {settings.work_root}: {exc}") from exc
    return Path(os.path.realpath(created))


class HostWorkspace:
    """A prompt's directory on this machine, the processes that may write to it, and its limits.

    ``sandbox_mount`` says how commands see the directory. None: they run here as the runner's user
    (the local backend), so absolute paths are the directory's real one, and the file tools refuse
    files with other hard links (a command could link the user's own files in). A path: they run in a
    sandbox with PID namespaces of its own that binds the directory there (bubblewrap), so absolute
    paths are taken as the sandbox sees them, hard links are allowed (the sandbox sees no file of the
    user's to link, and tools such as uv and pip make them), and a reaped process left nothing behind.
    """

    def __init__(self, settings: EnvironmentSettings, directory: Path, cgroup: PromptCgroup | None, *,
                 sandbox_mount: str | None = None) -> None:
        self.settings = settings
        self.directory = directory           # HOME of the local backend's commands
        self.workdir = directory             # where commands start: the directory or the row's cwd in it
        self.cgroup = cgroup
        self.sandbox_mount = sandbox_mount
        # Commands (local), or the sandboxes' shells (bubblewrap), which hold everything in their sandbox.
        self.processes: list[ChildProcess | asyncio.subprocess.Process] = []
        self.watch: WorkspaceWatch | None = None     # the workspace's limit, held while its processes run
        self.closed = False

    def make_workdir(self, cwd: str | None) -> None:
        """The row's cwd, taken relative to the directory and required to stay inside it.

        The directory was just created and no command has run in it, so it holds no symlink: the
        path can be judged by its text.
        """
        if not cwd:
            return
        relative = posixpath.normpath(cwd.lstrip("/") or ".")
        if relative == ".." or relative.startswith("../"):
            raise EnvironmentSetupError(f"the row's cwd {cwd!r} leads outside the prompt's directory")
        workdir = self.directory / relative
        try:
            workdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EnvironmentSetupError(f"cannot create the row's cwd {cwd!r}: {exc}") from exc
        self.workdir = workdir

    def discard(self) -> None:
        """Remove what a start that failed before any command made (no process has run)."""
        remove_tree(self.directory)
        if self.cgroup is not None:
            self.cgroup.release()

    def start_watch(self, stop: Callable[[], None]) -> None:
        """Hold the directory to the workspace limit from now until close(); ``stop`` kills whatever
        writes to it."""
        limits = self.settings.limits
        self.watch = guard_for(limits.disk_reserve_mb * MIB).watch(self.directory, limits.workspace_mb * MIB,
                                                                   stop, self.holders)

    def holders(self) -> list[int]:
        """The prompt's processes, which may hold files of the workspace open: its control group's, else
        those below the processes it started (a sandbox's shell: everything in the sandbox)."""
        if self.cgroup is not None:
            return self.cgroup.pids()
        return descendants([process.pid for process in list(self.processes)])

    def kill_processes(self) -> None:
        """Kill every process the prompt started (the workspace went over its limit)."""
        self._kill_groups()
        if self.cgroup is not None:
            self.cgroup.kill()

    def _kill_groups(self) -> None:
        """Kill the process groups of the prompt's processes. A group whose leader is reaped may have
        another owner by now, so it is killed only where it is the one handle on what a command left
        running: no control group holds the prompt, the commands run here (in a sandbox, a reaped bwrap
        took its PID namespace and everything in it along), and the group still existed after the
        prompt's last command (see forget_finished_groups)."""
        for process in self.processes:
            if self.sandbox_mount is None and self.cgroup is None and process.returncode is not None:
                kill_group(process.pid)
            else:
                kill_group_of(process)

    def forget_finished_groups(self) -> None:
        """Stop tracking groups with no process left, so close() never signals a reused group id."""
        self.processes = [process for process in self.processes if _group_exists(process.pid)]

    async def before_command(self) -> None:
        """Called before each command starts: a workspace whose processes were stopped for its size takes
        its new baseline first (see WorkspaceWatch.counted)."""
        if self.watch is not None:
            await self.watch.settle()

    def limit_events(self) -> LimitEvents:
        """The prompt's limit counters so far; zero where no control group counts them."""
        return self.cgroup.events() if self.cgroup is not None else LimitEvents()

    async def with_limit_notes(self, result: CommandResult, before: LimitEvents) -> CommandResult:
        """``result`` with an error saying which limit the command ran into, if it ran into one.

        The workspace's own look at the disk comes first: a command that wrote past the limit just before
        it ended is caught here rather than at the next tick."""
        notes = [note] if (note := self.settings.limits.exceeded(self.limit_events() - before)) else []
        if self.watch is not None and (note := await self.watch.note_after_command()):
            notes.append(note)
        if not notes:
            return result
        error = "; ".join(([result.error] if result.error else []) + notes)
        return dataclasses.replace(result, error=error)

    async def read_file(self, path: str) -> bytes:
        """The file's bytes; refuses escapes, anything but a regular file, and files over the size limit.

        The lookup and read run in a thread: a file on a slow disk must not stall every other prompt.
        """
        target = self._resolve(path)
        return await asyncio.to_thread(read_regular_file, target, self.settings.max_file_bytes)

    async def write_file(self, path: str, data: bytes) -> str:
        """Write the file, creating parent directories; returns its path relative to the working dir."""
        limit = self.settings.max_file_bytes
        if len(data) > limit:
            raise ToolError(f"{len(data)} bytes is more than the file tools' limit of {limit} bytes")
        if self.watch is not None and (refusal := self.watch.refuses(len(data))):
            raise ToolError(refusal)
        target = self._resolve(path)
        await asyncio.to_thread(write_regular_file, target, data)
        return target.relative_to_start()

    def _resolve(self, path: str) -> ConfinedPath:
        """``path`` as the file tools look it up: beneath the directory, relative to the working
        directory, or absolute under the directory's name as commands see it, which is also where an
        absolute symlink must point to be followed."""
        return ConfinedPath(root=self.directory, start=os.path.relpath(self.workdir, self.directory), path=path,
                            root_name=self.sandbox_mount or str(self.directory),
                            allow_hard_links=self.sandbox_mount is not None)

    async def close(self) -> None:
        """Kill every process the prompt started, then remove the directory (unless kept). Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.watch is not None:
            self.watch.close()
        self._kill_groups()
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.kill)     # what left the process groups (setsid)
        await _reap(self.processes)
        self.processes.clear()
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.release)
        if not self.settings.keep_workdirs:
            try:
                os.rmdir(self.directory)        # many prompts leave nothing behind: no thread needed
            except OSError:
                await asyncio.to_thread(remove_tree, self.directory)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except OSError:     # gone, or (PermissionError) reused by someone else's process
        return False
    return True


async def _reap(processes: list[ChildProcess | asyncio.subprocess.Process]) -> None:
    """Wait briefly for killed processes, so they are reaped rather than left as zombies."""
    if not processes:
        return
    waiters = [asyncio.ensure_future(process.wait()) for process in processes]
    _, pending = await asyncio.wait(waiters, timeout=_REAP_SECONDS)
    for waiter in pending:
        waiter.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
