"""What the container backends share: one container per prompt, commands and file tools run in it.

The life cycle (image ready before the first model call, container created, working directory made,
container removed on close whatever happened) and the terminal and file operations are the same for
every backend and live in :class:`ContainerEnvironment`. A backend says how to reach its runtime,
make and remove a container, and run a program in it: Docker/Podman and Singularity/Apptainer
through their command-line programs (:class:`CliContainerEnvironment`, which also pulls each image
once across worker processes), Modal through its SDK.

Inside a container the container itself is the boundary, so the file tools may reach any path in it;
paths are still normalised (no climbing above ``/``) and size limits still hold.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import hashlib
import math
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import ClassVar, TypeVar

from batchrun.environments.base import (
    CommandResult,
    Environment,
    EnvironmentSettings,
    EnvironmentSetupError,
    ToolError,
    WorkRootError,
    claim_work_root,
)
from batchrun.environments.command_output import run_merged
from batchrun.environments.container_cli import STDOUT_BYTES, CliResult, call_cli
from batchrun.environments.image_lock import ImageLock
from batchrun.environments.limits import MIB, open_files_per_process

T = TypeVar("T")

#: Where commands start when the row gives no ``cwd``; a relative ``cwd`` is taken from here.
WORKSPACE = "/workspace"
# Housekeeping calls (inspect, create, remove, file I/O) that take longer than this are stuck.
HOUSEKEEPING_TIMEOUT = 120.0
# Pulls of large images take minutes on a slow link; one that takes longer than this is stuck.
PULL_TIMEOUT = 1800.0
# A setup failure is one line a person reads in the console, which shows a failure's first 200
# characters: the message fits in them whole. An engine's reason that is too long loses its start,
# whole words of it: engines chain their errors outermost first, so the cause is at the end.
SETUP_MESSAGE_CHARS = 200
# The variables a runtime fills from a proxy setting of the user's (a URL that may hold a password):
# Docker's CLI from its configuration file, Singularity and Apptainer from their own environment even
# under --cleanenv.
PROXY_VARIABLES = frozenset(name for variable in ("HTTP_PROXY", "HTTPS_PROXY", "FTP_PROXY", "NO_PROXY", "ALL_PROXY")
                            for name in (variable, variable.lower()))
# The in-container `timeout` is the real limit; ours, this much later, only catches a hung CLI.
_CLI_GRACE_SECONDS = 5.0
# `timeout -s KILL` exits 128 + SIGKILL when it had to kill the command.
_KILLED_BY_TIMEOUT = 137
# Exit statuses of the file scripts below (sh itself and the CLIs use 1, 2, 125-127 and 255).
_MISSING, _IS_DIRECTORY, _NOT_REGULAR = 3, 4, 5
# How long reading a file may take: a regular file of the largest size the tools read takes milliseconds,
# and a command may swap the file for a FIFO between the look at it and its opening, which then waits
# for a writer that never comes.
_READ_SECONDS = 10
# $1: the file, $2: how many bytes to read at most (one more than allowed, to notice a larger file).
_READ_SCRIPT = (f'[ -e "$1" ] || exit {_MISSING}; [ -d "$1" ] && exit {_IS_DIRECTORY}; '
                f'[ -f "$1" ] || exit {_NOT_REGULAR}; exec timeout -s KILL {_READ_SECONDS} head -c "$2" "$1"')
# $1: the file, $2: its new size; the content comes on stdin. Only a regular file is replaced: a FIFO
# would wait for a reader that never comes, and a device or socket is no file to keep what the model wrote.
# A symbolic link is followed, as the other backends' file tools follow one. The content goes to a new
# file beside the target, renamed over it once whole (with its owner where the writer may give it, and its
# permission bits, or the umask's): readers see the old content or the new, a write cut short (a full
# disk, content that came short) leaves the old one, and a hard link's other names keep theirs. Where no
# file can be made beside it (a directory the user may not write) or renamed over it (a file bind-mounted
# into the container: /etc/hosts), it is written in place. Directories are taken with a mark after the
# newline dirname and readlink end with, which $() would take with any newline ending a name of its own.
_WRITE_SCRIPT = (f'[ -d "$1" ] && exit {_IS_DIRECTORY}; [ -e "$1" ] && [ ! -f "$1" ] && exit {_NOT_REGULAR}; '
                 'parent=$(dirname -- "$1"; echo .); parent=${parent%??}; mkdir -p -- "$parent" || exit 1; '
                 'target=$(readlink -f -- "$1" && echo .); target=${target%??}; [ -n "$target" ] || target=$1; '
                 'if [ -e "$target" ] && [ ! -w "$target" ]; then echo "$1: Permission denied" >&2; exit 1; fi; '
                 'directory=$(dirname -- "$target"; echo .); directory=${directory%??}; '
                 'temporary=$(mktemp "$directory/.batchrun-write-XXXXXXXX" 2>/dev/null) || exec cat > "$target"; '
                 'if [ -f "$target" ]; then mode=$((0$(stat -c %a -- "$target") & 0777)); '
                 'chown "$(stat -c %u:%g -- "$target")" "$temporary" 2>/dev/null; '
                 'else mode=$((0666 & ~0$(umask))); fi; '
                 'if cat > "$temporary" && [ $(wc -c < "$temporary") -eq "$2" ] '
                 '&& chmod "$(printf %o $mode)" "$temporary" '
                 '&& { mv -f -- "$temporary" "$target" 2>/dev/null || cat "$temporary" > "$target"; }; '
                 'then rm -f -- "$temporary"; exit 0; fi; rm -f -- "$temporary"; exit 1')
# Runs its arguments after the first with stderr into stdout inside the container, so that the two stay in
# the order written: a runtime forwarding them as two streams (docker and podman exec do) mixes them up.
# The first caps the size of every file they write, in the 512-byte blocks of POSIX `ulimit -f`: the one
# bound on `fallocate`, which the engines' system-call filters allow and which takes gigabytes in one call,
# faster than any look at the disk. The second caps the files each process may have open (the machine's
# table of them is shared with every other prompt: limits.open_files_per_process). The soft and the hard
# limits are set, and no capability is left to raise the hard ones again; where a lower one already holds,
# it stays. The third is the working directory,
# made again where a command removed it (the runtime, told to start there, would fail every later call);
# where it cannot be, the command runs in / after the shell's word on why. The command is the first the
# kernel kills when the container runs out of memory (an oom_score_adj of 1000, which any process may raise
# its own to): at a tie of small processes, a second kill while the first one's memory was still being
# freed could take the container's first process, and the container ended with the command.
# The wrapper starts no program of its own before the command (`[` is the shell's): with the container's
# processes at their limit, a failed fork there ended every later command with status 2 and no word.
_MERGED = ('ulimit -f "$1" 2>/dev/null; ulimit -n "$2" 2>/dev/null; '
           'echo 1000 > /proc/self/oom_score_adj 2>/dev/null; '
           '[ -d "$3" ] || mkdir -p "$3" 2>/dev/null; cd "$3" || cd /; shift 3; exec "$@" 2>&1')
_ULIMIT_BLOCK = 512


def container_path(base: str, path: str) -> str:
    """``path`` made absolute against ``base`` and normalised; ValueError if it climbs above ``/``
    or holds a NUL byte (no program could be given it)."""
    if "\0" in path:
        raise ValueError("it contains a NUL byte")
    parts: list[str] = []
    for part in (path if path.startswith("/") else f"{base}/{path}").split("/"):
        if part == "..":
            if not parts:
                raise ValueError("it climbs above the container's root directory")
            parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return "/" + "/".join(parts)


def run_prefix(run_label: str) -> str:
    """The start of every container name of a run: a digest keeps runs apart whatever their labels
    look like (run "a" must not claim the containers of run "a-1")."""
    return f"batch_runner-{hashlib.sha256(run_label.encode()).hexdigest()[:12]}-"


def setup_error(summary: str, reason: str) -> EnvironmentSetupError:
    """``summary: reason`` in at most SETUP_MESSAGE_CHARS, the reason's start dropped if need be."""
    room = SETUP_MESSAGE_CHARS - len(summary) - 2
    if len(reason) > room:
        tail = reason[len(reason) - max(room - 1, 0):]
        reason = "…" + (tail.split(" ", 1)[1] if " " in tail else tail)
    return EnvironmentSetupError(f"{summary}: {reason}")


async def to_completion(step: Awaitable[T]) -> T:
    """``await step`` and let it finish even when the caller is cancelled meanwhile; the cancellation
    is passed on once it has. Creating and removing a container must not be cut short: a Podman
    killed half-way through ``run`` leaves a runtime container and its monitor process behind that
    no ``podman ps`` lists."""
    task = asyncio.ensure_future(step)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        if not task.cancelled():
            task.exception()    # retrieved: the caller was cancelled, which is all it needs to hear
        raise


class ContainerEnvironment(Environment):
    """One container per prompt; subclasses reach the runtime and run programs in the container."""

    image: str      # never None here: the settings' default image stands in for a row without one

    def __init__(self, settings: EnvironmentSettings, *, prompt_index: int,
                 image: str | None = None, cwd: str | None = None) -> None:
        super().__init__(settings, prompt_index=prompt_index, image=image or settings.default_image, cwd=cwd)
        self.name = f"{run_prefix(settings.run_label)}{prompt_index}-{secrets.token_hex(4)}"
        self.workdir = WORKSPACE               # where commands start inside the container
        self._creating = False                 # from then on close() must remove whatever exists
        self._closed = False

    # -- life cycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Runtime, image, container, working directory — in that order, before any model call."""
        self._find_runtime()
        try:
            self.workdir = container_path(WORKSPACE, self.cwd or ".")
        except ValueError as exc:
            raise EnvironmentSetupError(f"the row's cwd {self.cwd!r} is not usable: {exc}") from None
        await self._check_runtime()
        await self._ensure_image()
        self._creating = True
        try:
            await to_completion(self._create())
            # Made here rather than by the runtime: Podman refuses to start in a directory the image lacks.
            made = await self._exec(["mkdir", "-p", self.workdir], workdir="/")
            if not made.ok:
                raise setup_error(f"cannot create the working directory {self.workdir} in the container "
                                  f"from {self.image}", made.message())
        except BaseException:
            await self.close()      # ``async with`` skips __aexit__ when start() fails
            raise

    async def close(self) -> None:
        """Remove the container (and what belongs to it); idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        if self._creating:
            try:
                await to_completion(self._remove())
            except Exception:
                pass

    # -- what the tools use ----------------------------------------------------------------------

    async def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """``sh -c command`` in the container (images may lack bash), killed by ``timeout`` inside
        the container and, should the runtime hang, given up on by us a little later."""
        limit = self.settings.command_timeout if timeout is None else timeout
        file_blocks = self.settings.limits.workspace_mb * MIB // _ULIMIT_BLOCK
        open_files = open_files_per_process(self.settings.limits.processes)
        argv = ["sh", "-c", _MERGED, "sh", str(file_blocks), str(open_files), self.workdir,
                "timeout", "-s", "KILL", str(max(1, math.ceil(limit))), "sh", "-c", command]
        began = time.monotonic()
        result = await self._exec_merged(argv, timeout=limit + _CLI_GRACE_SECONDS)
        if result.exit_code == _KILLED_BY_TIMEOUT and time.monotonic() - began >= limit:
            result = dataclasses.replace(result, exit_code=None, timed_out=True)
        if result.timed_out:
            problem = await to_completion(self._end_processes())
            if problem is not None:
                return dataclasses.replace(result, error=f"the processes it left could not be ended: {problem}")
        return result

    async def read_file(self, path: str) -> bytes:
        target = self._path(path)
        limit = self.settings.max_file_bytes
        result = await self._exec(["sh", "-c", _READ_SCRIPT, "sh", target, str(limit + 1)], workdir="/")
        if len(result.stdout) > limit:
            raise ToolError(f"{path!r} is larger than the file tools' limit of {limit} bytes")
        if result.returncode == _MISSING:
            raise ToolError(f"{path!r} does not exist")
        if result.returncode == _IS_DIRECTORY:
            raise ToolError(f"{path!r} is a directory, not a file")
        if result.returncode == _NOT_REGULAR:
            raise ToolError(f"{path!r} is not a regular file")
        if not result.ok:
            raise ToolError(f"cannot read {path!r}: {result.message()}")
        return result.stdout

    async def write_file(self, path: str, data: bytes) -> str:
        limit = self.settings.max_file_bytes
        if len(data) > limit:
            raise ToolError(f"{len(data)} bytes is more than the file tools' limit of {limit} bytes")
        target = self._path(path)
        result = await self._exec(["sh", "-c", _WRITE_SCRIPT, "sh", target, str(len(data))], workdir="/",
                                  stdin=data)
        if result.returncode == _IS_DIRECTORY:
            raise ToolError(f"{path!r} is a directory, not a file")
        if result.returncode == _NOT_REGULAR:
            raise ToolError(f"{path!r} is not a regular file")
        if not result.ok:
            raise ToolError(f"cannot write {path!r}: {result.message()}")
        if target.startswith(self.workdir.rstrip("/") + "/"):
            return target[len(self.workdir.rstrip("/")) + 1:]
        return target

    def _path(self, path: str) -> str:
        try:
            return container_path(self.workdir, path)
        except ValueError as exc:
            raise ToolError(f"invalid path {path!r}: {exc}") from None

    # -- what each backend does its own way --------------------------------------------------------

    @abc.abstractmethod
    def _find_runtime(self) -> None:
        """Find the program or library that drives the runtime; EnvironmentSetupError saying how to
        install it when it is missing."""

    async def _check_runtime(self) -> None:
        """Fail early, with a useful message, when the runtime cannot work. Finding it is all some
        runtimes need."""

    @abc.abstractmethod
    async def _ensure_image(self) -> None:
        """Make the image ready to start containers from; EnvironmentSetupError naming it if it cannot be."""

    @abc.abstractmethod
    async def _create(self) -> None:
        """Start the prompt's container, named ``self.name``, idle until programs are run in it."""

    @abc.abstractmethod
    async def _remove(self) -> None:
        """Remove the container and everything kept for it; called once, also after a failed start."""

    async def _end_processes(self) -> str | None:
        """After a time-out: end every process of the container but its first, also those the command
        detached from its process group; None, or why that failed. Runtimes that cannot leave it as it is."""
        return None

    @abc.abstractmethod
    async def _exec(self, argv: list[str], *, workdir: str, stdin: bytes | None = None) -> CliResult:
        """Run ``argv`` in the container, starting in ``workdir``, reading ``stdin``; its stdout as
        data and its stderr as the explanation. Never raises for the program's or runtime's failures."""

    @abc.abstractmethod
    async def _exec_merged(self, argv: list[str], *, timeout: float) -> CommandResult:
        """Run ``argv`` (which writes everything to its stdout and goes to the working directory itself) in
        the container, starting in ``/``, its output capped at the settings' limit; given up on after
        ``timeout`` seconds."""


class CliContainerEnvironment(ContainerEnvironment):
    """A backend driven through a container CLI; subclasses supply its command lines."""

    #: The CLI program, looked up on PATH.
    program: ClassVar[str]
    #: What to do when the program is missing (shown in the prompt's error).
    install_hint: ClassVar[str]

    def __init__(self, settings: EnvironmentSettings, *, prompt_index: int,
                 image: str | None = None, cwd: str | None = None) -> None:
        super().__init__(settings, prompt_index=prompt_index, image=image, cwd=cwd)
        self.executable = ""                   # the program's path, found by start()

    @classmethod
    def cli(cls) -> str:
        """The program this run drives (a name looked up on PATH, or a path)."""
        return cls.program

    @classmethod
    def node_problem(cls) -> str | None:
        if shutil.which(cls.cli()) is None:
            return f"`{cls.cli()}` was not found on PATH"
        return None

    @classmethod
    def find_program(cls) -> str:
        executable = shutil.which(cls.cli())
        if executable is None:
            raise EnvironmentSetupError(f"`{cls.cli()}` was not found on PATH; {cls.install_hint}, "
                                        "or choose another TERMINAL_ENV")
        return executable

    def _find_runtime(self) -> None:
        self.executable = self.find_program()

    async def _ensure_image(self) -> None:
        """Pull the image unless present. Only the holder of the image's lock pulls; the others
        wait for it and then find the image there, or fail as its pull did."""
        if await self._image_present():
            return
        try:
            async with ImageLock(self._lock_directory(), self.image) as lock:
                if (failure := lock.failure_while_waiting()) is not None:
                    raise EnvironmentSetupError(failure)
                if not await self._image_present():
                    try:
                        await self._pull()
                    except EnvironmentSetupError as exc:
                        lock.record_failure(str(exc))
                        raise
                    lock.record_failure(None)
        except OSError as exc:      # the lock's directory or the image cache cannot be written
            raise setup_error(f"cannot prepare image {self.image!r}", str(exc)) from exc

    def _lock_directory(self) -> Path:
        """Where the image locks live: with the run, for runtimes whose image store needs no
        protection across runs."""
        return self.settings.work_root / "image-locks"

    async def start(self) -> None:
        try:
            claim_work_root(self.settings.work_root)      # see _cli_directory
        except WorkRootError as exc:
            raise setup_error(f"cannot create the run's working directory {self.settings.work_root}",
                              str(exc)) from exc
        await super().start()

    def _cli_directory(self) -> Path | None:
        """Where the CLI runs: the run's own directory, made at the start. An engine's helpers write
        there (Podman's monitor of a command leaves `oom` and `oomKilled` files where it runs), never
        where the user started the runner. Once the run removed it (its end, a crashed run's clean-up),
        the calls left are removals, which leave nothing."""
        return self.settings.work_root if self.settings.work_root.is_dir() else None

    async def _started_in_cli_directory(self, start: Callable[[Path | None], Awaitable[T]]) -> T:
        """``start(cwd)`` in the CLI's directory; again in none when the run removed that directory
        between the look and the start, which raises FileNotFoundError before the program runs."""
        directory = self._cli_directory()
        try:
            return await start(directory)
        except FileNotFoundError:
            if directory is None or directory.is_dir():
                raise               # the program itself is missing
        return await start(None)

    async def _call(self, argv: list[str], *, stdin: bytes | None = None, timeout: float = HOUSEKEEPING_TIMEOUT,
                    max_stdout: int = STDOUT_BYTES, env: dict[str, str] | None = None) -> CliResult:
        try:
            return await self._started_in_cli_directory(
                lambda cwd: call_cli(argv, timeout=timeout, stdin=stdin, max_stdout=max_stdout, cwd=cwd, env=env))
        except OSError as exc:
            return CliResult(returncode=127, stdout=b"", stderr=f"cannot run {argv[0]}: {exc}")

    def _entering_environment(self) -> dict[str, str] | None:
        """The CLI's environment where it starts the container or runs a program in it, for a runtime
        that copies some of it in (None: this process's, as for every other call)."""
        return None

    async def _exec(self, argv: list[str], *, workdir: str, stdin: bytes | None = None) -> CliResult:
        """What a program in the container writes is kept up to one byte past the largest file the tools
        read: a program the prompt replaced may write without end."""
        return await self._call(self.exec_argv(argv, workdir=workdir, stdin=stdin is not None), stdin=stdin,
                                max_stdout=self.settings.max_file_bytes, env=self._entering_environment())

    async def _exec_merged(self, argv: list[str], *, timeout: float) -> CommandResult:
        try:
            return await self._started_in_cli_directory(
                lambda cwd: run_merged(self.exec_argv(argv, workdir="/"), timeout=timeout,
                                       max_output_chars=self.settings.max_output_chars, cwd=cwd,
                                       env=self._entering_environment()))
        except OSError as exc:
            return CommandResult(output="", exit_code=None, error=f"could not start {self.executable}: {exc}")

    @abc.abstractmethod
    async def _image_present(self) -> bool:
        """Whether the image is ready to start containers from, without pulling."""

    @abc.abstractmethod
    async def _pull(self) -> None:
        """Fetch the image; raises EnvironmentSetupError with the runtime's message on failure."""

    @abc.abstractmethod
    def exec_argv(self, argv: list[str], *, workdir: str, stdin: bool = False) -> list[str]:
        """The command line that runs ``argv`` in the container, starting in ``workdir``; with
        ``stdin`` the program reads our input."""
