"""The local backend: every prompt gets a fresh directory on this machine, and commands run there.

It controls where a command starts and what it inherits (a scrubbed environment, a private HOME, its
own process group so a time-out kills everything it started, the limits of ``limits.ResourceLimits``),
not what it can reach: a command may still touch anything the user can. Runs choose it explicitly
(TERMINAL_ENV=local), never by fallback. Where a control group can be made, every process a prompt
started is in it, so closing the prompt kills ``setsid`` and double-forked children too. The file
tools, the model's structured way to touch files, are confined to the prompt's directory here
(``workspace.HostWorkspace``, which the bubblewrap backend holds too).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from batchrun.environments.base import (
    CommandResult,
    Environment,
    EnvironmentSettings,
    EnvironmentSetupError,
    scrubbed_environment,
)
from batchrun.environments.command_output import run_merged
from batchrun.environments.limits import (
    ENTER_GROUPS,
    PromptCgroup,
    ResourceLimits,
    mechanism,
    remove_kept_groups,
)
from batchrun.environments.workspace import HostWorkspace, new_prompt_directory

# One shell joins the prompt's control groups (if any), applies the ulimit command, and becomes the
# model's command as bash -c runs it: arguments are the groups' procs files, "--", ulimit, command.
_LIMITED_BASH = f'{ENTER_GROUPS}; eval "$1" || exit 126; exec bash -c "$2"'


class LocalEnvironment(Environment):
    """One prompt's private directory under ``settings.work_root``; commands run there via bash."""

    kind = "local"
    start_can_fail_alone = False      # a directory and a control group: if one can be made, all can
    runs_images = False
    shares_user_process_limit = True

    def __init__(self, settings: EnvironmentSettings, *, prompt_index: int,
                 image: str | None = None, cwd: str | None = None) -> None:
        super().__init__(settings, prompt_index=prompt_index, image=image, cwd=cwd)
        self.workspace: HostWorkspace | None = None      # from start() on

    @classmethod
    def startup_check(cls) -> str:
        return ("chosen by TERMINAL_ENV; NO isolation: commands can read and change whatever your "
                "user can and reach the network; only the environment's secrets are withheld")

    @classmethod
    def limits_line(cls, limits: ResourceLimits) -> str:
        return (f"{limits.memory_mb} MB memory, {limits.processes} processes, {limits.workspace_mb} MB workspace"
                f" · {mechanism()}")

    @classmethod
    async def close_idle(cls) -> None:
        """Remove the control groups kept for further prompts of this process."""
        await asyncio.to_thread(remove_kept_groups)

    @property
    def prompt_dir(self) -> Path | None:
        """The prompt's directory, HOME of its commands."""
        return self.workspace.directory if self.workspace is not None else None

    @property
    def workdir(self) -> Path | None:
        """Where commands start: the prompt's directory or the row's cwd in it."""
        return self.workspace.workdir if self.workspace is not None else None

    async def start(self) -> None:
        """Create a fresh directory for this prompt (never the user's cwd)."""
        directory = new_prompt_directory(self.settings, f"prompt-{self.prompt_index}-")
        workspace = HostWorkspace(self.settings, directory,
                                  PromptCgroup.create(self.settings.run_label, self.settings.limits))
        try:
            workspace.make_workdir(self.cwd)
        except EnvironmentSetupError:
            # A failed start is not followed by close() (``async with`` skips __aexit__), so tidy up here.
            workspace.discard()
            raise
        workspace.start_watch(workspace.kill_processes)
        self.workspace = workspace

    async def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Run ``bash -c command`` in its own process group; kill the whole group on time-out."""
        workspace = self._running()
        limit = self.settings.command_timeout if timeout is None else timeout
        cgroup = workspace.cgroup
        groups = cgroup.procs_files() if cgroup is not None else []
        argv = ["bash", "-c", _LIMITED_BASH, "bash", *groups, "--",
                self.settings.limits.ulimit_command(memory=cgroup is None), command]
        await workspace.before_command()
        before = workspace.limit_events()
        try:
            result = await run_merged(argv, timeout=limit,
                                      max_output_chars=self.settings.max_output_chars, cwd=workspace.workdir,
                                      env=scrubbed_environment(home=str(workspace.directory)),
                                      on_start=workspace.processes.append)
        except OSError as exc:
            return CommandResult(output="", exit_code=None, error=f"could not start bash: {exc}")
        if result.timed_out and cgroup is not None:
            # What the command left running (setsid or double-forked, out of its process group's
            # reach) goes with it: the prompt's processes are killed, as in the sandbox.
            await asyncio.to_thread(cgroup.kill)
        workspace.forget_finished_groups()
        return await workspace.with_limit_notes(result, before)

    async def read_file(self, path: str) -> bytes:
        return await self._running().read_file(path)

    async def write_file(self, path: str, data: bytes) -> str:
        return await self._running().write_file(path, data)

    async def close(self) -> None:
        """Kill every process group this prompt started, then remove its directory (unless kept)."""
        if self.workspace is not None:
            await self.workspace.close()

    def _running(self) -> HostWorkspace:
        """The workspace; using an environment before start() or after close() is a bug."""
        if self.workspace is None or self.workspace.closed:
            raise RuntimeError("the local environment is not running (start() not called, or closed)")
        return self.workspace
