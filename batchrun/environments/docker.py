"""The docker backend (TERMINAL_ENV=docker): one container per prompt from the row's image.

The container idles (``sleep infinity``) while commands run in it through ``docker exec``; it carries
labels naming the run and the prompt, so the containers of a crashed run can be found and removed
before the next run under the same name starts.
"""

from __future__ import annotations

import shutil

from batchrun.environments.base import EnvironmentSettings, EnvironmentSetupError
from batchrun.environments.container import HOUSEKEEPING_TIMEOUT, PULL_TIMEOUT, ContainerEnvironment
from batchrun.environments.container_cli import call_cli_blocking
from batchrun.environments.single_flight import SingleFlight

RUN_LABEL = "batch_runner.run"
PROMPT_LABEL = "batch_runner.prompt"

# Per process: the engines (by CLI path) that answered once, and the images known to be present.
# An engine that did not answer is asked again, so a daemon started mid-run is noticed. Sessions
# asking at the same moment share one question.
_reachable_engines: set[str] = set()
_present_images: set[tuple[str, str]] = set()
_questions = SingleFlight()


class DockerEnvironment(ContainerEnvironment):
    kind = "docker"
    program = "docker"
    install_hint = "install Docker (https://docs.docker.com/engine/install/)"

    async def _check_runtime(self) -> None:
        """``docker image inspect`` fails alike for "no engine" and "no image", so ask the engine first."""
        if self.executable not in _reachable_engines:
            await _questions.run(("engine", self.executable), self._ask_engine)

    async def _ask_engine(self) -> None:
        answer = await self._call([self.executable, "version", "--format", "{{.Server.Version}}"])
        if not answer.ok:
            raise EnvironmentSetupError(f"Docker engine is not reachable: {answer.message()}; "
                                        "start the daemon or choose another TERMINAL_ENV")
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
            raise EnvironmentSetupError(f"image {self.image!r} is not available locally and pulling it "
                                        f"failed: {pulled.message()}")
        _present_images.add((self.executable, self.image))

    async def _create(self) -> None:
        network = [] if self.settings.allow_network else ["--network", "none"]
        caps = self.settings.limits
        # The engine's control groups cap the container as a whole; swap equal to memory means none.
        limits = ["--memory", f"{caps.memory_mb}m", "--memory-swap", f"{caps.memory_mb}m",
                  "--pids-limit", str(caps.processes), "--tmpfs", f"/tmp:size={caps.tmp_mb}m"]
        created = await self._call([
            self.executable, "run", "-d", "--label", f"{RUN_LABEL}={self.settings.run_label}",
            "--label", f"{PROMPT_LABEL}={self.prompt_index}", "--name", self.name, *network, *limits,
            "-w", self.workdir, "--entrypoint", "sleep", self.image, "infinity"])
        if not created.ok:
            raise EnvironmentSetupError(f"cannot start a container from {self.image}: {created.message()}")

    async def _remove(self) -> None:
        await self._call([self.executable, "rm", "-f", self.name])

    def exec_argv(self, argv: list[str], *, workdir: str, stdin: bool = False) -> list[str]:
        return [self.executable, "exec", *(["-i"] if stdin else []), "-w", workdir, self.name, *argv]

    @classmethod
    def remove_leftovers(cls, settings: EnvironmentSettings) -> None:
        """Remove the containers a crashed run under this label left; without an engine there are none
        to reach, and the run's first prompt will say why."""
        executable = shutil.which(cls.program)
        if executable is not None:
            listed = call_cli_blocking([executable, "ps", "-aq", "--filter", f"label={RUN_LABEL}={settings.run_label}"],
                                       timeout=HOUSEKEEPING_TIMEOUT)
            leftovers = listed.stdout.decode("utf-8", "replace").split() if listed.ok else []
            if leftovers:
                call_cli_blocking([executable, "rm", "-f", *leftovers], timeout=HOUSEKEEPING_TIMEOUT)
        super().remove_leftovers(settings)
