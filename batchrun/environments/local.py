"""The local backend: every prompt gets a fresh directory on this machine, and commands run there.

It controls where a command starts and what it inherits (a scrubbed environment, a private HOME, its
own process group so a time-out kills everything it started, the limits of ``limits.ResourceLimits``),
not what it can reach: a command may still touch anything the user can. Runs choose it explicitly
(TERMINAL_ENV=local), never by fallback. Where a control group can be made, every process a prompt
started is in it, so closing the prompt kills ``setsid`` and double-forked children too. The file
tools, the model's structured way to touch files, are confined to the prompt's directory here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import posixpath
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
from batchrun.environments.command_output import ChildProcess, kill_group, kill_group_of, run_merged
from batchrun.environments.confined_files import ConfinedPath, read_regular_file, write_regular_file
from batchrun.environments.disk_guard import WorkspaceWatch, guard_for
from batchrun.environments.limits import ENTER_GROUPS, MIB, LimitEvents, PromptCgroup
from batchrun.environments.tree_removal import remove_tree
from batchrun.proc import descendants

# close() waits this long for killed commands, so they are reaped while the loop still runs.
_REAP_SECONDS = 2.0
# One shell joins the prompt's control groups (if any), applies the ulimit command, and becomes the
# model's command as bash -c runs it: arguments are the groups' procs files, "--", ulimit, command.
_LIMITED_BASH = f'{ENTER_GROUPS}; eval "$1" || exit 126; exec bash -c "$2"'


class LocalEnvironment(Environment):
    """One prompt's private directory under ``settings.work_root``; commands run there via bash."""

    kind = "local"
    start_can_fail_alone = False      # a directory and a control group: if one can be made, all can

    def __init__(self, settings: EnvironmentSettings, *, prompt_index: int,
                 image: str | None = None, cwd: str | None = None) -> None:
        super().__init__(settings, prompt_index=prompt_index, image=image, cwd=cwd)
        self.prompt_dir: Path | None = None      # the per-prompt directory; HOME of its commands
        self.workdir: Path | None = None         # where commands start: prompt_dir or the row's cwd in it
        # Commands, and (for the bubblewrap backend, which starts them from the event loop) sandboxes.
        self._processes: list[ChildProcess | asyncio.subprocess.Process] = []
        self._cgroup: PromptCgroup | None = None
        self._watch: WorkspaceWatch | None = None     # the workspace's limit, held while its processes run
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
        self._cgroup = PromptCgroup.create(self.settings.run_label, self.prompt_dir.name, self.settings.limits)
        try:
            self.workdir = self._make_workdir(self.prompt_dir)
        except EnvironmentSetupError:
            # A failed start is not followed by close() (``async with`` skips __aexit__), so tidy up here.
            remove_tree(self.prompt_dir)
            if self._cgroup is not None:
                self._cgroup.remove()
            raise
        self.watch_workspace()

    def watch_workspace(self) -> None:
        """Hold the prompt directory to the workspace limit from now until close()."""
        prompt_dir, _ = self._require_started()
        limits = self.settings.limits
        self._watch = guard_for(limits.disk_reserve_mb * MIB).watch(prompt_dir, limits.workspace_mb * MIB,
                                                                    self.stop_processes, self.workspace_holders)

    def workspace_holders(self) -> list[int]:
        """The prompt's processes, which may hold files of its workspace open: its control group's, else
        those below the processes it started (a sandbox's shell: everything in the sandbox)."""
        if self._cgroup is not None:
            return self._cgroup.pids()
        return descendants([process.pid for process in list(self._processes)])

    def stop_processes(self) -> None:
        """Kill every process the prompt's commands started (the workspace went over its limit)."""
        self._kill_command_groups()
        if self._cgroup is not None:
            self._cgroup.kill()

    def _kill_command_groups(self) -> None:
        """Kill the process groups of the prompt's commands. Where a control group holds the prompt,
        only groups whose leader is not reaped yet (their ids are still ours; the control group ends
        the rest); without one, a command's group is the only handle on what it left running, so a
        group whose leader is gone is killed too, if it still existed after the prompt's last command
        (see _forget_finished_groups)."""
        for process in self._processes:
            if self._cgroup is None and process.returncode is not None:
                kill_group(process.pid)
            else:
                kill_group_of(process)

    def _make_workdir(self, prompt_dir: Path) -> Path:
        """The row's cwd, taken relative to the prompt directory and required to stay inside it.

        The directory was just created and no command has run in it, so it holds no symlink: the
        path can be judged by its text.
        """
        if not self.cwd:
            return prompt_dir
        relative = posixpath.normpath(self.cwd.lstrip("/") or ".")
        if relative == ".." or relative.startswith("../"):
            raise EnvironmentSetupError(f"the row's cwd {self.cwd!r} leads outside the prompt's directory")
        workdir = prompt_dir / relative
        try:
            workdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EnvironmentSetupError(f"cannot create the row's cwd {self.cwd!r}: {exc}") from exc
        return workdir

    async def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Run ``bash -c command`` in its own process group; kill the whole group on time-out."""
        prompt_dir, workdir = self._require_started()
        limit = self.settings.command_timeout if timeout is None else timeout
        limits = self.settings.limits
        groups = self._cgroup.procs_files() if self._cgroup is not None else []
        argv = ["bash", "-c", _LIMITED_BASH, "bash", *groups, "--",
                limits.ulimit_command(memory=self._cgroup is None), command]
        before = self.limit_events()
        try:
            result = await run_merged(argv, timeout=limit,
                                      max_output_chars=self.settings.max_output_chars, cwd=workdir,
                                      env=scrubbed_environment(home=str(prompt_dir)),
                                      on_start=self._processes.append)
        except OSError as exc:
            return CommandResult(output="", exit_code=None, error=f"could not start bash: {exc}")
        if result.timed_out and self._cgroup is not None:
            # What the command left running (setsid or double-forked, out of its process group's
            # reach) goes with it: the prompt's processes are killed, as in the sandbox.
            await asyncio.to_thread(self._cgroup.kill)
        self._forget_finished_groups()
        return await self.with_limit_notes(result, before)

    def limit_events(self) -> LimitEvents:
        """The prompt's limit counters so far; zero where no control group counts them."""
        return self._cgroup.events() if self._cgroup is not None else LimitEvents()

    async def with_limit_notes(self, result: CommandResult, before: LimitEvents) -> CommandResult:
        """``result`` with an error saying which limit the command ran into, if it ran into one.

        The workspace's own look at the disk comes first: a command that wrote past the limit just before
        it ended is caught here rather than at the next tick."""
        limits = self.settings.limits
        notes = [note] if (note := limits.exceeded(self.limit_events() - before)) else []
        if self._watch is not None:
            await self._watch.look()
            if reason := self._watch.take_reason():
                notes.append(reason)
            elif self._watch.used > self._watch.limit_bytes:
                notes.append(f"the workspace holds more than its limit of {limits.workspace_mb} MB; "
                             "delete files before writing more")
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
        if self._watch is not None and (refusal := self._watch.refuses(len(data))):
            raise ToolError(refusal)
        target = self._resolve(path)
        await asyncio.to_thread(write_regular_file, target, data)
        return target.relative_to_start()

    async def close(self) -> None:
        """Kill every process group this prompt started, then remove its directory (unless kept)."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.close()
        self._kill_command_groups()
        if self._cgroup is not None:
            await asyncio.to_thread(self._cgroup.kill)     # what left the process groups (setsid)
        await _reap(self._processes)
        self._processes.clear()
        if self._cgroup is not None:
            await asyncio.to_thread(self._cgroup.remove)
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

    def _resolve(self, path: str) -> ConfinedPath:
        """``path`` as the file tools look it up: beneath the prompt directory, relative to the
        working directory, or absolute under the prompt directory's own (real) path, which is also
        where an absolute symlink must point to be followed. Files with other hard links are
        refused: commands run as the user and could link the user's own files in here."""
        prompt_dir, workdir = self._require_started()
        return ConfinedPath(root=prompt_dir, start=os.path.relpath(workdir, prompt_dir), path=path,
                            root_name=str(prompt_dir), allow_hard_links=False)

    def _forget_finished_groups(self) -> None:
        """Stop tracking groups with no process left, so close() never signals a reused group id."""
        self._processes = [process for process in self._processes if _group_exists(process.pid)]


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except OSError:     # gone, or (PermissionError) reused by someone else's process
        return False
    return True


async def _reap(processes: list[ChildProcess | asyncio.subprocess.Process]) -> None:
    """Wait briefly for killed commands, so they are reaped rather than left as zombies."""
    if not processes:
        return
    waiters = [asyncio.ensure_future(process.wait()) for process in processes]
    _, pending = await asyncio.wait(waiters, timeout=_REAP_SECONDS)
    for waiter in pending:
        waiter.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
