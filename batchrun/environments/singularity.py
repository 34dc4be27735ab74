"""The Singularity/Apptainer backend (TERMINAL_ENV=singularity or apptainer): one instance per prompt.

Images come from ``docker://<image>`` (or any source given with its own ``scheme://``) and are
converted once per run into a SIF file under the run's work root. Each prompt's instance is
contained (``--containall``: own PID/IPC namespaces, no host files, environment cleaned) with a
fresh host directory bound at /workspace and a writable tmpfs elsewhere, so state never reaches
another prompt. Singularity passes the host environment into containers unless told not to, so
``--cleanenv`` goes on every start and exec: the user's API keys must not reach the commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from batchrun.environments.base import EnvironmentSettings, EnvironmentSetupError
from batchrun.environments.container import (
    HOUSEKEEPING_TIMEOUT,
    PULL_TIMEOUT,
    WORKSPACE,
    ContainerEnvironment,
    run_prefix,
)
from batchrun.environments.container_cli import call_cli_blocking
from batchrun.environments.image_lock import image_file_stem
from batchrun.environments.tree_removal import remove_tree


class SingularityEnvironment(ContainerEnvironment):
    kind = "singularity"
    program = "singularity"
    install_hint = ("install SingularityCE (https://docs.sylabs.io/guides/latest/admin-guide/) "
                    "or use TERMINAL_ENV=apptainer with Apptainer installed")

    def __init__(self, settings: EnvironmentSettings, *, prompt_index: int,
                 image: str | None = None, cwd: str | None = None) -> None:
        super().__init__(settings, prompt_index=prompt_index, image=image, cwd=cwd)
        self.sif = settings.work_root / "images" / f"{image_file_stem(self.image)}.sif"
        self.prompt_dir: Path | None = None     # host directory bound at /workspace

    @property
    def source(self) -> str:
        return self.image if "://" in self.image else f"docker://{self.image}"

    async def _image_present(self) -> bool:
        return self.sif.is_file()

    async def _pull(self) -> None:
        """Pull into a temporary file and rename it: a half-written SIF must never look present."""
        self.sif.parent.mkdir(parents=True, exist_ok=True)
        partial = self.sif.with_name(f"{self.sif.stem}.{secrets.token_hex(4)}.partial")
        try:
            pulled = await self._call([self.executable, "pull", str(partial), self.source], timeout=PULL_TIMEOUT)
            if not pulled.ok:
                raise EnvironmentSetupError(f"image {self.image!r} could not be pulled from {self.source}: "
                                            f"{pulled.message()}")
            os.replace(partial, self.sif)
        finally:
            with contextlib.suppress(OSError):
                partial.unlink()

    async def _create(self) -> None:
        try:
            self.prompt_dir = Path(tempfile.mkdtemp(prefix=f"prompt-{self.prompt_index}-",
                                                    dir=self.settings.work_root))
        except OSError as exc:
            raise EnvironmentSetupError(f"cannot create a working directory under {self.settings.work_root}: "
                                        f"{exc}") from exc
        network = [] if self.settings.allow_network else ["--net", "--network", "none"]
        started = await self._call([
            self.executable, "instance", "start", "--containall", "--cleanenv", "--no-home", "--writable-tmpfs",
            *network, "--bind", f"{self.prompt_dir}:{WORKSPACE}", str(self.sif), self.name])
        if not started.ok:
            raise EnvironmentSetupError(f"cannot start an instance of {self.image}: {started.message()}")

    async def _remove(self) -> None:
        await self._call([self.executable, "instance", "stop", "--force", self.name])
        if self.prompt_dir is not None and not self.settings.keep_workdirs:
            await asyncio.to_thread(remove_tree, self.prompt_dir)

    def exec_argv(self, argv: list[str], *, workdir: str, stdin: bool = False) -> list[str]:
        # singularity exec always passes its stdin through, so ``stdin`` needs no flag here.
        return [self.executable, "exec", "--cleanenv", "--pwd", workdir, f"instance://{self.name}", *argv]

    @classmethod
    def remove_leftovers(cls, settings: EnvironmentSettings) -> None:
        """Stop the instances a crashed run under this label left (their names start with the run's
        prefix); without the program there are none."""
        executable = shutil.which(cls.program)
        if executable is not None:
            listed = call_cli_blocking([executable, "instance", "list", "--json"], timeout=HOUSEKEEPING_TIMEOUT)
            prefix = run_prefix(settings.run_label)
            for name in _instance_names(listed.stdout) if listed.ok else []:
                if name.startswith(prefix):
                    call_cli_blocking([executable, "instance", "stop", "--force", name], timeout=HOUSEKEEPING_TIMEOUT)
        super().remove_leftovers(settings)


class ApptainerEnvironment(SingularityEnvironment):
    """Apptainer is Singularity renamed: the same command lines under another program name."""

    kind = "apptainer"
    program = "apptainer"
    install_hint = "install Apptainer (https://apptainer.org/docs/admin/main/installation.html)"


def _instance_names(listing: bytes) -> list[str]:
    """Names from ``instance list --json``: {"instances": [{"instance": NAME, ...}, ...]}."""
    try:
        instances = json.loads(listing).get("instances") or []
        return [entry["instance"] for entry in instances if isinstance(entry.get("instance"), str)]
    except (ValueError, AttributeError, TypeError):
        return []
