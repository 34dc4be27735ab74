"""What the container backends share: one container per prompt, driven through a container CLI.

Docker and Singularity/Apptainer differ only in the words of their command lines — how to check the
runtime, find or pull an image, start a container, run a program in it and remove it. The life cycle
(image ready before the first model call, pulled once per image across worker processes, removed on
close whatever happened) and the terminal and file operations are the same, and live here.

Inside a container the container itself is the boundary, so the file tools may reach any path in it;
paths are still normalised (no climbing above ``/``) and size limits still hold.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import math
import secrets
import shutil
import time
from typing import ClassVar

from batchrun.environments.base import (
    CommandResult,
    Environment,
    EnvironmentSettings,
    EnvironmentSetupError,
    ToolError,
)
from batchrun.environments.command_output import run_merged
from batchrun.environments.container_cli import CliResult, call_cli
from batchrun.environments.image_lock import ImageLock

#: Where commands start when the row gives no ``cwd``; a relative ``cwd`` is taken from here.
WORKSPACE = "/workspace"
# Housekeeping calls (inspect, create, remove, file I/O) that take longer than this are stuck.
HOUSEKEEPING_TIMEOUT = 120.0
# Pulls of large images take minutes on a slow link; one that takes longer than this is stuck.
PULL_TIMEOUT = 1800.0
# The in-container `timeout` is the real limit; ours, this much later, only catches a hung CLI.
_CLI_GRACE_SECONDS = 5.0
# `timeout -s KILL` exits 128 + SIGKILL when it had to kill the command.
_KILLED_BY_TIMEOUT = 137
# Exit statuses of the file scripts below (sh itself and the CLIs use 1, 2, 125-127 and 255).
_MISSING, _IS_DIRECTORY, _NOT_REGULAR = 3, 4, 5
# $1: the file, $2: how many bytes to read at most (one more than allowed, to notice a larger file).
_READ_SCRIPT = (f'[ -e "$1" ] || exit {_MISSING}; [ -d "$1" ] && exit {_IS_DIRECTORY}; '
                f'[ -f "$1" ] || exit {_NOT_REGULAR}; exec head -c "$2" "$1"')
# $1: the file; the content comes on stdin.
_WRITE_SCRIPT = f'[ -d "$1" ] && exit {_IS_DIRECTORY}; mkdir -p "$(dirname "$1")" && cat > "$1"'


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


class ContainerEnvironment(Environment):
    """One container per prompt; subclasses supply the CLI's command lines."""

    #: The CLI program, looked up on PATH.
    program: ClassVar[str]
    #: What to do when the program is missing (shown in the prompt's error).
    install_hint: ClassVar[str]

    def __init__(self, settings: EnvironmentSettings, *, prompt_index: int,
                 image: str | None = None, cwd: str | None = None) -> None:
        super().__init__(settings, prompt_index=prompt_index, image=image or settings.default_image, cwd=cwd)
        self.name = f"{run_prefix(settings.run_label)}{prompt_index}-{secrets.token_hex(4)}"
        self.executable = ""                   # the program's path, found by start()
        self.workdir = WORKSPACE               # where commands start inside the container
        self._creating = False                 # from then on close() must remove whatever exists
        self._closed = False

    # -- life cycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Runtime, image, container, working directory — in that order, before any model call."""
        self.executable = self.find_program()
        try:
            self.workdir = container_path(WORKSPACE, self.cwd or ".")
        except ValueError as exc:
            raise EnvironmentSetupError(f"the row's cwd {self.cwd!r} is not usable: {exc}") from None
        await self._check_runtime()
        await self._ensure_image()
        self._creating = True
        try:
            await self._create()
            made = await self._call(self.exec_argv(["mkdir", "-p", self.workdir], workdir="/"))
            if not made.ok:
                raise EnvironmentSetupError(f"cannot create the working directory {self.workdir} in the "
                                            f"container from {self.image}: {made.message()}")
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
                await self._remove()
            except Exception:       # noqa: BLE001 — a failed clean-up must not fail the prompt
                pass

    @classmethod
    def find_program(cls) -> str:
        executable = shutil.which(cls.program)
        if executable is None:
            raise EnvironmentSetupError(f"`{cls.program}` was not found on PATH; {cls.install_hint}, "
                                        "or choose another TERMINAL_ENV")
        return executable

    async def _ensure_image(self) -> None:
        """Pull the image unless present. Only the holder of the image's lock pulls; the others
        wait for it and then find the image there."""
        if await self._image_present():
            return
        try:
            async with ImageLock(self.settings.work_root / "image-locks", self.image):
                if not await self._image_present():
                    await self._pull()
        except OSError as exc:      # the lock's directory or the image cache cannot be written
            raise EnvironmentSetupError(f"cannot prepare image {self.image!r}: {exc}") from exc

    async def _call(self, argv: list[str], *, stdin: bytes | None = None,
                    timeout: float = HOUSEKEEPING_TIMEOUT) -> CliResult:
        try:
            return await call_cli(argv, timeout=timeout, stdin=stdin)
        except OSError as exc:
            return CliResult(returncode=127, stdout=b"", stderr=f"cannot run {argv[0]}: {exc}")

    # -- what the tools use ----------------------------------------------------------------------

    async def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """``sh -c command`` in the container (images may lack bash), killed by ``timeout`` inside
        the container and, should the CLI hang, by us a little later."""
        limit = self.settings.command_timeout if timeout is None else timeout
        argv = self.exec_argv(["timeout", "-s", "KILL", str(max(1, math.ceil(limit))), "sh", "-c", command],
                              workdir=self.workdir)
        began = time.monotonic()
        try:
            result = await run_merged(argv, timeout=limit + _CLI_GRACE_SECONDS,
                                      max_output_chars=self.settings.max_output_chars)
        except OSError as exc:
            return CommandResult(output="", exit_code=None, error=f"could not start {self.program}: {exc}")
        if result.exit_code == _KILLED_BY_TIMEOUT and time.monotonic() - began >= limit:
            return dataclasses.replace(result, exit_code=None, timed_out=True)
        return result

    async def read_file(self, path: str) -> bytes:
        target = self._path(path)
        limit = self.settings.max_file_bytes
        result = await self._call(self.exec_argv(["sh", "-c", _READ_SCRIPT, "sh", target, str(limit + 1)],
                                                  workdir=self.workdir))
        if result.returncode == _MISSING:
            raise ToolError(f"{path!r} does not exist")
        if result.returncode == _IS_DIRECTORY:
            raise ToolError(f"{path!r} is a directory, not a file")
        if result.returncode == _NOT_REGULAR:
            raise ToolError(f"{path!r} is not a regular file")
        if not result.ok:
            raise ToolError(f"cannot read {path!r}: {result.message()}")
        if len(result.stdout) > limit:
            raise ToolError(f"{path!r} is larger than the file tools' limit of {limit} bytes")
        return result.stdout

    async def write_file(self, path: str, data: bytes) -> str:
        limit = self.settings.max_file_bytes
        if len(data) > limit:
            raise ToolError(f"{len(data)} bytes is more than the file tools' limit of {limit} bytes")
        target = self._path(path)
        result = await self._call(self.exec_argv(["sh", "-c", _WRITE_SCRIPT, "sh", target], workdir=self.workdir,
                                                  stdin=True),
                                  stdin=data)
        if result.returncode == _IS_DIRECTORY:
            raise ToolError(f"{path!r} is a directory, not a file")
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

    # -- what each CLI says differently ----------------------------------------------------------

    async def _check_runtime(self) -> None:
        """Fail early, with a useful message, when the runtime behind the CLI cannot work.
        Finding the program is all some runtimes need."""

    @abc.abstractmethod
    async def _image_present(self) -> bool:
        """Whether the image is ready to start containers from, without pulling."""

    @abc.abstractmethod
    async def _pull(self) -> None:
        """Fetch the image; raises EnvironmentSetupError with the runtime's message on failure."""

    @abc.abstractmethod
    async def _create(self) -> None:
        """Start the prompt's container, named ``self.name``, idle until commands are executed in it."""

    @abc.abstractmethod
    async def _remove(self) -> None:
        """Remove the container and everything kept for it; called once, also after a failed start."""

    @abc.abstractmethod
    def exec_argv(self, argv: list[str], *, workdir: str, stdin: bool = False) -> list[str]:
        """The command line that runs ``argv`` in the container, starting in ``workdir``; with
        ``stdin`` the program reads our input."""
