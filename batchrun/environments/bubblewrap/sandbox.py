"""Making one sandbox, and each worker's sandboxes started ahead of need.

**Every prompt gets a sandbox no earlier prompt used.** A sandbox holds state that no reset can be shown
to clear: the shell that would do the resetting runs as the commands' own user, so a command can rewrite
its memory or change its limits and scheduling; a network namespace keeps sockets in TIME_WAIT; PID and
tmpfs counters carry over. So a finished prompt's sandbox is killed, and the latency of making a new one
is hidden instead: each worker process keeps a few sandboxes started ahead of need (spares), never used,
each handed to exactly one prompt.
"""

from __future__ import annotations

import asyncio
import collections
import os
import secrets
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchrun.environments.base import EnvironmentSettings, EnvironmentSetupError
from batchrun.environments.bubblewrap.program import (
    RUNNING_AS_ROOT,
    STARTUP_SECONDS,
    Descriptors,
    release_sandbox_uid,
    root_descriptor,
    sandbox_command,
    sandbox_environment,
    sandbox_uid,
    working_bwrap,
)
from batchrun.environments.bubblewrap.shell import MAX_SHELL_WORDS, SHELL, Shell
from batchrun.environments.command_output import kill_group_of
from batchrun.environments.limits import ENTER_GROUPS, PromptCgroup
from batchrun.environments.tree_removal import remove_tree
from batchrun.environments.workspace import new_prompt_directory
from batchrun.time_limit import within

# How many of the latest failed spare starts a worker remembers, for whoever looks into a slow run.
_FAILED_STARTS_KEPT = 8


@dataclass(frozen=True)
class Sandbox:
    """A started sandbox nobody used yet: its shell, the host directory bound at /workspace (empty), its
    control group, and the uid its commands run as outside (root runs)."""

    shell: Shell
    directory: Path
    cgroup: PromptCgroup | None
    uid: int | None

    async def destroy(self) -> None:
        await self.shell.kill()
        await asyncio.to_thread(self._remove)
        release_sandbox_uid(self.uid)

    def _remove(self) -> None:
        if self.cgroup is not None:
            self.cgroup.release()
        remove_tree(self.directory)


async def new_sandbox(settings: EnvironmentSettings, prefix: str) -> Sandbox:
    """A fresh directory, control group and sandbox; nothing is left behind when it fails."""
    directory = new_prompt_directory(settings, prefix)
    cgroup = PromptCgroup.create(settings.run_label, settings.limits)
    uid = sandbox_uid() if RUNNING_AS_ROOT else None
    try:
        if uid is not None:
            os.chown(directory, uid, uid)
        shell = await start_shell(settings, directory, cgroup, uid)
    except BaseException:
        if cgroup is not None:
            cgroup.release()
        remove_tree(directory)
        release_sandbox_uid(uid)
        raise
    return Sandbox(shell, directory, cgroup, uid)


async def start_shell(settings: EnvironmentSettings, directory: Path, cgroup: PromptCgroup | None,
                      uid: int | None) -> Shell:
    """Start bwrap around ``directory`` with the shell inside, in ``cgroup``, and wait until the shell says
    it is ready."""
    # The first call in a process starts a probe sandbox; later ones read the cache.
    bwrap = working_bwrap() if working_bwrap.cache_info().currsize else await asyncio.to_thread(working_bwrap)
    if isinstance(bwrap, str):
        raise EnvironmentSetupError(bwrap)
    ready = secrets.token_hex(16)
    limits = settings.limits
    descriptors = Descriptors(await root_descriptor(settings.work_root, settings.allow_network), directory, uid)
    try:
        argv = sandbox_command(bwrap.path, settings.allow_network, limits, descriptors, uid,
                               ["bash", "--noprofile", "--norc", "-c", SHELL, "batchrun-shell", ready,
                                limits.ulimit_command(memory=cgroup is None)])
        if cgroup is not None:
            argv = _in_group(cgroup, argv)
        # bwrap's own environment is the sandbox's too: inside, /proc/1/environ shows it.
        try:
            with descriptors.guarded() as passed:
                process = await asyncio.create_subprocess_exec(
                    *argv, env=sandbox_environment(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT, start_new_session=True, pass_fds=passed)
        except OSError as exc:
            raise EnvironmentSetupError(f"cannot start bubblewrap: {exc}") from exc
    finally:
        descriptors.close()     # bwrap has its own copies once it runs
    shell = Shell(process)
    said = bytearray()
    try:
        started = await within(STARTUP_SECONDS, shell.read_until(f"{ready}\n".encode(), said.extend, MAX_SHELL_WORDS))
    except TimeoutError:
        started = False
    if started:
        started = shell.watch()
        problem = None if started else "its processes could not be found"
    else:
        problem = said.decode("utf-8", errors="replace").strip() or "no message"
    if not started:
        await shell.kill()
        raise EnvironmentSetupError(f"the bubblewrap sandbox did not start: {problem}")
    return shell


def _in_group(cgroup: PromptCgroup, argv: list[str]) -> list[str]:
    """``argv`` started in ``cgroup``: bwrap makes the sandbox's cgroup namespace, whose root is the group
    it runs in then. Moved in once started, the sandbox had the worker's group as its root, and a command
    read its prompt's group from /proc/self/cgroup (the worker's pid, the run's name, and whether it was
    the group of an earlier prompt, which that prompt could decide: a channel from one to the next). The
    shell would add PWD, the worker's directory on the host, to the environment bwrap passes on."""
    return ["/bin/sh", "-c", f'{ENTER_GROUPS}; unset PWD; exec "$@"', "batchrun-enter-group", *cgroup.procs_files(),
            "--", *argv]


class Spares:
    """Each worker process's sandboxes started ahead of need, by the settings they were made with and the
    event loop that owns their pipes. A spare has never run a command; taking it starts the next one.

    A spare is only a head start: when one cannot be started, the prompt that finds none starts its own
    and reports why that fails. So a failed spare start ends nothing, but it is kept (newest last, the
    latest few) in ``failed_starts``: a run whose prompts all start their own sandboxes is slower for a
    reason someone will want to see."""

    def __init__(self) -> None:
        self._ready: dict[tuple, list[Sandbox]] = {}
        self._starting: dict[tuple, set[asyncio.Task]] = {}
        self._tearing_down: set[asyncio.Task] = set()
        self.failed_starts: collections.deque[str] = collections.deque(maxlen=_FAILED_STARTS_KEPT)

    @staticmethod
    def _key(settings: EnvironmentSettings) -> tuple:
        return (id(asyncio.get_running_loop()), settings.work_root, settings.run_label, settings.allow_network,
                settings.limits)

    def ready(self) -> list[Sandbox]:
        """The spares waiting now (all settings)."""
        return [sandbox for waiting in self._ready.values() for sandbox in waiting]

    def take(self, settings: EnvironmentSettings) -> Sandbox | None:
        waiting = self._ready.get(self._key(settings))
        while waiting:
            sandbox = waiting.pop()
            if sandbox.shell.process.returncode is None:     # not killed while it waited
                return sandbox
            self.tear_down(sandbox.destroy())
        return None

    def refill(self, settings: EnvironmentSettings) -> None:
        key = self._key(settings)
        starting = self._starting.setdefault(key, set())
        while len(self._ready.get(key, ())) + len(starting) < settings.spare_sandboxes:
            task = asyncio.get_running_loop().create_task(self._start(key, settings))
            starting.add(task)
            task.add_done_callback(starting.discard)

    async def _start(self, key: tuple, settings: EnvironmentSettings) -> None:
        try:
            sandbox = await new_sandbox(settings, "sandbox-")
        except Exception as exc:    # whatever it is, nobody awaits this task: it must not vanish with it
            self.failed_starts.append(f"{type(exc).__name__}: {exc}")
            return
        self._ready.setdefault(key, []).append(sandbox)

    def tear_down(self, work: Coroutine[Any, Any, None]) -> None:
        """Tear-down that nobody waits for; close() waits for it before the loop ends."""
        task = asyncio.get_running_loop().create_task(work)
        self._tearing_down.add(task)
        task.add_done_callback(self._tearing_down.discard)

    async def close(self) -> None:
        """Kill the spares of the running loop, and what is still being torn down: all at once, as the
        kernel tears each sandbox's namespaces down in its own time."""
        loop = id(asyncio.get_running_loop())
        starting = [task for key in [key for key in self._starting if key[0] == loop]
                    for task in self._starting.pop(key)]
        await asyncio.gather(*starting, return_exceptions=True)
        ready = [sandbox for key in [key for key in self._ready if key[0] == loop] for sandbox in self._ready.pop(key)]
        for sandbox in ready:
            kill_group_of(sandbox.shell.process)
        await asyncio.gather(*(sandbox.destroy() for sandbox in ready), return_exceptions=True)
        await asyncio.gather(*list(self._tearing_down), return_exceptions=True)


spares = Spares()
