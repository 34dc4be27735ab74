"""The docker backend (TERMINAL_ENV=docker): one container per prompt from the row's image, driven
through ``docker`` or, with TERMINAL_CONTAINER_CLI=podman, through Podman (same command lines).

The container idles (a shell that reaps orphans) while commands run in it through ``exec``. Its name starts
with the run's prefix and it carries labels naming the run and the prompt, so the containers of a
crashed run can be found and removed before the next run under the same name starts.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from batchrun.env_vars import variable
from batchrun.environments.base import CommandResult, EnvironmentLostError, EnvironmentSettings, ToolError
from batchrun.environments.container import (
    HOUSEKEEPING_TIMEOUT,
    PROXY_VARIABLES,
    PULL_TIMEOUT,
    CliContainerEnvironment,
    run_prefix,
    setup_error,
)
from batchrun.environments.container_cli import call_cli_blocking
from batchrun.environments.container_layer import LAYER_FORMAT, LayerWatch, parse_layer
from batchrun.environments.limits import MIB, open_files_per_process
from batchrun.environments.single_flight import SingleFlight

RUN_LABEL = "batch_runner.run"
PROMPT_LABEL = "batch_runner.prompt"
#: Names the container CLI: ``docker`` unless set; ``podman`` (or a path to either) works too.
CLI_VARIABLE = "TERMINAL_CONTAINER_CLI"

# Per process: the engines (by CLI path) that answered once, and the images known to be present.
# An engine that did not answer is asked again, so a daemon started mid-run is noticed. Sessions
# asking at the same moment share one question.
_reachable_engines: set[str] = set()
_podman_engines: set[str] = set()          # of those, the ones that are Podman
_present_images: set[tuple[str, str]] = set()
_questions = SingleFlight()
# The container's first process: it must reap the orphans the kernel hands it (`sleep infinity` never
# did, and each zombie held a place in the process limit until the prompt ended), and outlive whatever a
# command kills. The kernel keeps every signal from inside the container off it but those it handles, and
# it handles none; a `sleep` of its own, killed, is started again. (The engines' `--init` dies with its
# one child, which a `kill -9 -1` or `pkill sleep` would end, and Podman's needs catatonit installed.)
_FIRST_PROCESS = 'trap "" TERM INT HUP; while :; do sleep infinity & wait; done'
# What runs in a container while no command does: that shell and its `sleep`.
_IDLE_PROCESSES = 2
# The exit statuses with which the CLIs say they could not run a command in the container (no engine, no
# such container, one not running, the connection lost mid-command; 126 where the container ended while the
# command was being started in it), and 137, the SIGKILL with which the kernel ends the command when its
# container is killed, stopped or removed meanwhile. A command may exit with them too (137 also where the
# memory limit killed it): only where the engine then does not show the container running is the command
# taken as not run.
_LOST_CONTAINER_STATUSES = frozenset({1, 125, 126, 137, 255})
# Of those, the ones a container's end gives the command itself: the engine may not show that end yet.
_ENDED_WITH_THE_CONTAINER = frozenset({126, 137})
# A running engine answers `version` at once; a node check must not hold up the actor for long.
_NODE_CHECK_TIMEOUT = 30.0
# What root in the container keeps of the engine's default capabilities: what ordinary work as root in a
# system of one's own takes (package managers change owners and drop to users of their own, servers bind
# low ports, root signals processes it started as another user). Gone: making device nodes, raw sockets,
# file capabilities, chroot, changing the capability sets, writing the audit log.
_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "NET_BIND_SERVICE")


class DockerEnvironment(CliContainerEnvironment):
    kind = "docker"
    program = "docker"
    install_hint = ("install Docker (https://docs.docker.com/engine/install/), or Podman and set "
                    f"{CLI_VARIABLE}=podman")

    def __init__(self, settings: EnvironmentSettings, *, prompt_index: int,
                 image: str | None = None, cwd: str | None = None) -> None:
        super().__init__(settings, prompt_index=prompt_index, image=image, cwd=cwd)
        self._layer: LayerWatch | None = None   # the watch on what the container writes, where it can be had

    @classmethod
    def cli(cls) -> str:
        return variable(CLI_VARIABLE) or cls.program

    @classmethod
    def startup_check(cls) -> str:
        return f"chosen by TERMINAL_ENV, through `{cls.cli()}`"

    @classmethod
    def node_problem(cls) -> str | None:
        """The CLI alone starts no container: its engine must answer too."""
        executable = shutil.which(cls.cli())
        if executable is None:
            return super().node_problem()
        answer = call_cli_blocking([executable, "version", "--format", "{{.Server.Version}}"],
                                   timeout=_NODE_CHECK_TIMEOUT)
        if not answer.ok:
            return f"the container engine ({cls.cli()}) is not reachable: {answer.message()}"
        return None

    async def _check_runtime(self) -> None:
        """``image inspect`` fails alike for "no engine" and "no image", so ask the engine first."""
        if self.executable not in _reachable_engines:
            await _questions.run(("engine", self.executable), self._ask_engine)

    async def _ask_engine(self) -> None:
        answer = await self._call([self.executable, "version", "--format", "{{.Server.Version}}"])
        if not answer.ok:
            raise setup_error(f"the {self.cli()} engine is not reachable (start it, or choose another "
                              "TERMINAL_ENV)", answer.message())
        named = await self._call([self.executable, "--version"])
        if named.ok and named.stdout.lower().startswith(b"podman"):
            _podman_engines.add(self.executable)
        _reachable_engines.add(self.executable)

    async def _image_present(self) -> bool:
        key = (self.executable, self.image)
        return key in _present_images or await _questions.run(("image", *key), self._inspect_image)

    async def _inspect_image(self) -> bool:
        found = await self._call([self.executable, "image", "inspect", "--format", "{{.Id}}", self.image])
        if found.ok:
            _present_images.add((self.executable, self.image))
        return found.ok

    async def _pull(self) -> None:
        pulled = await self._call([self.executable, "pull", self.image], timeout=PULL_TIMEOUT)
        if not pulled.ok:
            raise setup_error(f"image {self.image!r} is not here and pulling it failed", pulled.message())
        _present_images.add((self.executable, self.image))

    async def _create(self) -> None:
        network = [] if self.settings.allow_network else ["--network", "none"]
        caps = self.settings.limits
        # The engine's control groups cap the container as a whole; swap equal to memory means none.
        limits = ["--memory", f"{caps.memory_mb}m", "--memory-swap", f"{caps.memory_mb}m",
                  "--pids-limit", str(caps.processes), "--tmpfs", f"/tmp:size={caps.tmp_mb}m",
                  *self._file_limits(), *self._no_proxy_variables(),
                  "--cap-drop=ALL", *(f"--cap-add={capability}" for capability in _CAPABILITIES)]
        # No stop time-out: the first process ignores SIGTERM, and Podman's `rm -f` would wait 10 s for it.
        # No log: the engines keep the first process's output in a file on this machine's disk until the
        # container is removed, which no limit of the prompt's counts, and root in the container may write
        # to that process's descriptors (`yes > /proc/1/fd/1`).
        created = await self._call([
            self.executable, "run", "-d", "--label", f"{RUN_LABEL}={self.settings.run_label}",
            "--label", f"{PROMPT_LABEL}={self.prompt_index}", "--name", self.name, *network, *limits,
            "--log-driver", "none", "--stop-timeout", "0", "--entrypoint", "sh", self.image, "-c", _FIRST_PROCESS])
        if not created.ok:
            raise setup_error(f"cannot start a container from {self.image}", created.message())
        await self._watch_layer()

    def _file_limits(self) -> list[str]:
        """Docker's own caps on the size of any file and on each process's open files, which no program in
        the container can lift (each command's `sh` also sets them, but a command can replace the image's
        `sh`). Not for Podman: given one limit, it drops the limits its configuration names and raises open
        files and processes to its defaults, which fails every container where it lacks CAP_SYS_RESOURCE."""
        if self.executable in _podman_engines:
            return []
        open_files = open_files_per_process(self.settings.limits.processes)
        return ["--ulimit", f"fsize={self.settings.limits.workspace_mb * MIB}",
                "--ulimit", f"nofile={open_files}:{open_files}"]

    def _no_proxy_variables(self) -> list[str]:
        """The engines copy the user's proxy settings, whose URLs may carry a password, into every
        container they start: Podman those of the environment it runs in, unless told not to; Docker's
        CLI those of its configuration file (``proxies`` in ~/.docker/config.json) for each variable not
        given. A variable given without a value is removed from the container, but the CLI fills such a
        variable from its own environment where it is set there, so that one is given empty (the CLI
        keeps its environment: a daemon reached through a proxy needs it). A command sees no setting of
        the user's."""
        if self.executable in _podman_engines:
            return ["--http-proxy=false"]
        return [option for name in sorted(PROXY_VARIABLES)
                for option in ("--env", f"{name}=" if name in os.environ else name)]

    async def _watch_layer(self) -> None:
        """Watch the container's writable layer where this machine holds it (see container_layer), or
        take note that its first process is a new one (the container was started again)."""
        answer = await self._call([self.executable, "inspect", "--format", LAYER_FORMAT, self.name])
        found = parse_layer(answer.stdout.decode("utf-8", "replace")) if answer.ok else None
        try:
            if found is not None and self._layer is not None:
                self._layer.restarted(found[0])
            elif found is not None:
                self._layer = LayerWatch(found[1], found[0], self.settings.limits, self._engine_files(found[2]))
        except OSError:         # the first process ended between the answer and now
            pass

    def _engine_files(self, named: tuple[Path, ...]) -> tuple[Path, ...]:
        """The engine's files mounted into the container: those its inspect names and, under Podman, the
        /run/.containerenv it writes beside them in the container's run directory."""
        if self.executable not in _podman_engines or not named:
            return named
        return (*named, named[0].parent / ".containerenv")

    async def _ready(self) -> None:
        """Start the container again where the disk watch killed its processes, once the space its
        files held past their ends is given back."""
        if self._layer is not None and self._layer.killed:
            await self._layer.given_back()
            started = await self._call([self.executable, "start", self.name])
            if not started.ok:
                raise ToolError(f"the container could not be started again: {started.message()}")
            await self._watch_layer()

    async def run(self, command: str, timeout: float | None = None) -> CommandResult:
        try:
            await self._ready()
        except ToolError as exc:
            return CommandResult(output="", exit_code=None, error=str(exc))
        layer = self._layer
        if layer is not None:
            await layer.watch.settle()
        result = await super().run(command, timeout)
        if layer is None or not layer.killed:       # a container the disk watch stopped is not lost: it says why
            await self._require_not_lost(result)
        if layer is None:
            return result
        await layer.given_back()
        if (note := await layer.watch.note_after_command()) is None:
            return result
        return dataclasses.replace(result, error="; ".join([*([result.error] if result.error else []), note]))

    async def _require_not_lost(self, result: CommandResult) -> None:
        """EnvironmentLostError where ``result``'s status may be the CLI's own or the container's end and the
        engine does not show the container running: the CLI's complaint, or a kill from outside, is no result
        of the command's, and nothing the prompt asks for later can run either."""
        if result.exit_code not in _LOST_CONTAINER_STATUSES:
            return
        answer = await self._call([self.executable, "inspect", "--format", "{{.State.Running}}", self.name])
        running = answer.ok and answer.stdout.strip() == b"true"
        if running and (result.exit_code not in _ENDED_WITH_THE_CONTAINER or await self._runs_commands()):
            return
        reason = answer.message() if not answer.ok else "the container is no longer running"
        raise EnvironmentLostError(f"the command could not run to its end in the container: {reason}")

    async def _runs_commands(self) -> bool:
        """Whether a command still runs in the container. The engines learn that a command was killed with
        its container before they learn of the container's end, and may show it running a moment longer;
        a container whose first process is gone takes no command. `sh`, which every command runs in, so any
        image that runs commands has it. (A prompt that replaced the container's `sh` loses its own
        environment here, nothing more.)"""
        return (await self._call(self.exec_argv(["sh", "-c", ":"], workdir="/"))).ok

    async def read_file(self, path: str) -> bytes:
        await self._ready()
        return await super().read_file(path)

    async def write_file(self, path: str, data: bytes) -> str:
        await self._ready()
        if self._layer is not None and (refusal := self._layer.watch.refuses(len(data))):
            raise ToolError(refusal)
        return await super().write_file(path, data)

    async def _end_processes(self) -> str | None:
        """Where the engine lists more than the first process and its `sleep`, stop and start the container:
        the engine kills its first process, and the kernel every other one of its PID namespace with it,
        whatever the programs in the container were changed to do. The files stay (the workspace), `/tmp`
        is a new tmpfs. The listing is the engine's (a heading, then a line per process), and no process
        can take a line away."""
        if self._layer is not None:
            await self._layer.given_back()      # nothing starts while files are truncated
        listed = await self._call([self.executable, "top", self.name])
        if listed.ok and len(listed.stdout.splitlines()) <= 1 + _IDLE_PROCESSES:
            return None
        for step in ("stop", "start"):
            done = await self._call([self.executable, step, *(["--time", "0"] if step == "stop" else []), self.name])
            if not done.ok:
                return done.message()
        await self._watch_layer()
        return None

    async def _remove(self) -> None:
        if self._layer is not None:
            self._layer.close()
        # With its anonymous volumes (an image's VOLUME): the engines keep them, and what was written in
        # them, unless told.
        await self._call([self.executable, "rm", "-f", "-v", self.name])

    def exec_argv(self, argv: list[str], *, workdir: str, stdin: bool = False) -> list[str]:
        return [self.executable, "exec", *(["-i"] if stdin else []), "-w", workdir, self.name, *argv]

    @classmethod
    def remove_leftovers(cls, settings: EnvironmentSettings) -> None:
        """Remove the containers a crashed run under this label left; without an engine there are none
        to reach, and the run's first prompt will say why. Podman also keeps containers only in its
        storage (a ``run`` killed half-way); ``--external`` lists those, by name only."""
        executable = shutil.which(cls.cli())
        if executable is not None:
            podman = _is_podman(executable)
            listed = call_cli_blocking([executable, "ps", "-a", *(["--external"] if podman else []),
                                        "--filter", f"name=^{run_prefix(settings.run_label)}",
                                        "--format", "{{.Names}}"], timeout=HOUSEKEEPING_TIMEOUT)
            leftovers = listed.stdout.decode("utf-8", "replace").split() if listed.ok else []
            if leftovers:
                call_cli_blocking([executable, "rm", "-f", "-v", *leftovers], timeout=HOUSEKEEPING_TIMEOUT)
        super().remove_leftovers(settings)


def _is_podman(executable: str) -> bool:
    """Whether the CLI is Podman (also when installed under the name docker)."""
    answer = call_cli_blocking([executable, "--version"], timeout=HOUSEKEEPING_TIMEOUT)
    return answer.ok and answer.stdout.lower().startswith(b"podman")
