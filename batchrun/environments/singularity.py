"""The Singularity/Apptainer backend (TERMINAL_ENV=singularity or apptainer): one instance per prompt.

Images come from ``docker://<image>`` (or any source given with its own ``scheme://``) and are
converted once into a SIF file in the user's cache (``$XDG_CACHE_HOME/batch_runner/sif``, else
``~/.cache/batch_runner/sif``), which every later run reuses. Each prompt's instance is
contained (``--containall``: own PID/IPC namespaces, no host files, environment cleaned) with a
fresh host directory bound at /workspace and a writable tmpfs elsewhere, so state never reaches
another prompt. Singularity passes the host environment into containers unless told not to, so
``--cleanenv`` goes on every start and exec: the user's API keys must not reach the commands. Even
then it passes the proxy variables, sets what ``SINGULARITYENV_``/``APPTAINERENV_`` variables name, and
binds what ``SINGULARITY_BIND``/``APPTAINER_BIND`` name (a cluster often sets these for every
container): the CLI starts instances and runs commands without any of them in its environment.
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

from batchrun.environments.base import EnvironmentSettings, WorkRootError, claim_work_root
from batchrun.environments.container import (
    HOUSEKEEPING_TIMEOUT,
    PROXY_VARIABLES,
    PULL_TIMEOUT,
    WORKSPACE,
    CliContainerEnvironment,
    run_prefix,
    setup_error,
)
from batchrun.environments.container_cli import call_cli_blocking
from batchrun.environments.image_lock import image_file_stem
from batchrun.environments.tree_removal import remove_tree

# The runtimes take every option of their commands from a variable as well (SINGULARITY_MOUNT, _ENV_FILE,
# _BIND, _OVERLAY, _KEEP_PRIVS, _ADD_CAPS, ...) and set in their containers what SINGULARITYENV_NAME
# names; Apptainer reads both spellings. A cluster often sets some for every container: host paths
# bound in, a file of secrets read into the environment, an overlay that every prompt would share.
# Only the variables that say where the runtime keeps its own files reach it.
_RUNTIMES = ("SINGULARITY", "APPTAINER")
_RUNTIMES_OWN_FILES = frozenset(f"{runtime}_{kind}" for runtime in _RUNTIMES
                                for kind in ("CACHEDIR", "TMPDIR", "CONFIGDIR"))
# A --bind names SRC:DEST pairs, separated by commas, and has no quoting.
_BIND_SEPARATORS = ",:"


class SingularityEnvironment(CliContainerEnvironment):
    kind = "singularity"
    program = "singularity"
    install_hint = ("install SingularityCE (https://docs.sylabs.io/guides/latest/admin-guide/) "
                    "or use TERMINAL_ENV=apptainer with Apptainer installed")

    def __init__(self, settings: EnvironmentSettings, *, prompt_index: int,
                 image: str | None = None, cwd: str | None = None) -> None:
        super().__init__(settings, prompt_index=prompt_index, image=image, cwd=cwd)
        self.sif = sif_cache() / f"{image_file_stem(self.image)}.sif"
        self.prompt_dir: Path | None = None     # host directory bound at /workspace

    @classmethod
    def node_problem(cls) -> str | None:
        return _unbindable_work_root() or super().node_problem()

    @property
    def source(self) -> str:
        return self.image if "://" in self.image else f"docker://{self.image}"

    async def _image_present(self) -> bool:
        return self.sif.is_file()

    def _lock_directory(self) -> Path:
        """Beside the SIF files: runs share them, so their pulls are locked across runs too."""
        return self.sif.parent

    async def _pull(self) -> None:
        """Pull into a temporary file and rename it: a half-written SIF must never look present.
        The image's lock is held, so a partial file of it already there is a dead pull's: removed."""
        self.sif.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        for stale in self.sif.parent.glob(f"{self.sif.stem}.*.partial"):
            stale.unlink(missing_ok=True)
        partial = self.sif.with_name(f"{self.sif.stem}.{secrets.token_hex(4)}.partial")
        try:
            pulled = await self._call([self.executable, "pull", str(partial), self.source], timeout=PULL_TIMEOUT)
            if not pulled.ok:
                raise setup_error(f"image {self.image!r} could not be pulled from {self.source}", pulled.message())
            os.replace(partial, self.sif)
        finally:
            with contextlib.suppress(OSError):
                partial.unlink()

    async def _create(self) -> None:
        try:
            claim_work_root(self.settings.work_root)
            self.prompt_dir = Path(tempfile.mkdtemp(prefix=f"prompt-{self.prompt_index}-",
                                                    dir=self.settings.work_root))
        except (OSError, WorkRootError) as exc:
            raise setup_error(f"cannot create a working directory under {self.settings.work_root}", str(exc)) from exc
        network = [] if self.settings.allow_network else ["--net", "--network", "none"]
        started = await self._call([
            # --no-privs: as root, the runtimes give the container's root every capability by default
            # (enough to mount the host's disks), where Docker's keeps a few.
            self.executable, "instance", "start", "--containall", "--cleanenv", "--no-home", "--no-privs",
            "--writable-tmpfs",
            *network, "--bind", f"{self.prompt_dir}:{WORKSPACE}", str(self.sif), self.name],
            env=self._entering_environment())
        if not started.ok:
            raise setup_error(f"cannot start an instance of {self.image}", started.message())

    async def _remove(self) -> None:
        await self._call([self.executable, "instance", "stop", "--force", self.name])
        if self.prompt_dir is not None and not self.settings.keep_workdirs:
            await asyncio.to_thread(remove_tree, self.prompt_dir)

    def _entering_environment(self) -> dict[str, str]:
        return {name: value for name, value in os.environ.items()
                if name not in PROXY_VARIABLES and (not name.startswith(_RUNTIMES) or name in _RUNTIMES_OWN_FILES)}

    def exec_argv(self, argv: list[str], *, workdir: str, stdin: bool = False) -> list[str]:
        # singularity exec always passes its stdin through, so ``stdin`` needs no flag here.
        return [self.executable, "exec", "--cleanenv", "--no-privs", "--pwd", workdir, f"instance://{self.name}",
                *argv]

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


def _unbindable_work_root() -> str | None:
    """Why the prompts' directories, under $TMPDIR, cannot be bound at /workspace, if they cannot: with a
    comma in it, the --bind of /tmp/a,b/... bound /tmp/a, a host directory, into the container."""
    temporary = tempfile.gettempdir()
    if found := sorted(set(temporary) & set(_BIND_SEPARATORS)):
        return (f"TMPDIR ({temporary}) holds {' and '.join(repr(c) for c in found)}, which Singularity's --bind "
                "reads as a separator: set TMPDIR to a directory whose path has neither")
    return None


def sif_cache() -> Path:
    """The user's SIF files, shared by all runs: converting an image takes minutes, so once is enough."""
    cache_home = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache_home) / "batch_runner" / "sif"


def _instance_names(listing: bytes) -> list[str]:
    """Names from ``instance list --json``: {"instances": [{"instance": NAME, ...}, ...]}."""
    try:
        instances = json.loads(listing).get("instances") or []
        return [entry["instance"] for entry in instances if isinstance(entry.get("instance"), str)]
    except (ValueError, AttributeError, TypeError):
        return []
