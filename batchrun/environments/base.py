"""The environment protocol: where one prompt's model-written commands and file edits happen.

Every backend (a local directory, the bubblewrap sandbox, a docker, podman, singularity or apptainer
container, a Modal sandbox) is a class implementing :class:`Environment`. One instance serves exactly
one prompt: it is started before the prompt's first model call, used by the terminal and file tools,
and closed when the session ends — also on errors and cancellation — so no state leaks between prompts.
"""

from __future__ import annotations

import abc
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from batchrun.environments.limits import ResourceLimits, remove_run_leftovers
from batchrun.environments.tree_removal import remove_tree

# Variables a model-written command may see. Everything else in the user's environment (API keys,
# tokens, cloud credentials) is withheld: an allow-list cannot leak a secret nobody thought of.
ALLOWED_ENV_VARS = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def scrubbed_environment(home: str) -> dict[str, str]:
    """The environment for a tool process: the allow-listed variables plus a private HOME."""
    env = {name: os.environ[name] for name in ALLOWED_ENV_VARS if name in os.environ}
    env.setdefault("PATH", DEFAULT_PATH)
    env.setdefault("LANG", "C.UTF-8")
    env["HOME"] = home
    env["TERM"] = env.get("TERM", "dumb")
    return env


def run_identity(run_dir: Path) -> str:
    """The name under which a run's sandboxes, containers and leftovers are kept apart from every
    other run's: the run name for people, a digest of the run directory's absolute path so that two
    runs with one name in two directories never touch each other's (one directory is one run at a
    time: its lock)."""
    absolute = os.path.abspath(run_dir)
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(absolute))[:40]
    return f"{readable}-{hashlib.sha256(absolute.encode('utf-8', 'surrogateescape')).hexdigest()[:12]}"


class ToolError(Exception):
    """A tool (or the environment on its behalf) could not do what the model asked; the message is
    shown to the model as ``{"error": message}``."""


class EnvironmentSetupError(RuntimeError):
    """The prompt's environment could not be created (missing image, no engine, ...).

    The session fails the prompt with this message before making any model call.
    """


@dataclass
class CommandResult:
    """What one shell command produced. A non-zero exit code is a result, not a failure."""

    output: str
    exit_code: int | None
    timed_out: bool = False
    truncated: bool = False
    error: str | None = None


@dataclass
class EnvironmentSettings:
    """Run-wide settings every backend reads; one object shared by all prompts of a run."""

    work_root: Path                      # parent of the per-prompt directories
    run_label: str                       # this run's identity (run_identity): containers, groups, leftovers
    command_timeout: float = 60.0        # default time limit of one terminal command (seconds)
    max_output_chars: int = 50_000       # terminal output kept per command; the rest is cut with a note
    max_file_bytes: int = 10_000_000     # largest file the tools read or write (generated images fit)
    keep_workdirs: bool = False          # leave per-prompt directories behind for inspection
    default_image: str = "python:3.11-slim"
    allow_network: bool = False          # isolated backends: let commands reach the network
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    spare_sandboxes: int = 0             # sandboxes a worker keeps started ahead of need (bubblewrap)


class Environment(abc.ABC):
    """One prompt's sandbox. Subclasses are small; shared behaviour lives here."""

    #: The name users select with TERMINAL_ENV and the start-up summary shows.
    kind: str = ""
    #: Whether one prompt's start can fail while others' succeed (an image that cannot be pulled). Such
    #: an environment starts before the prompt's first model call, so that the prompt spends nothing;
    #: one whose start fails only with the machine (which the start-up check finds once) starts while
    #: the first reply is written.
    start_can_fail_alone: ClassVar[bool] = True

    def __init__(self, settings: EnvironmentSettings, *, prompt_index: int,
                 image: str | None = None, cwd: str | None = None) -> None:
        self.settings = settings
        self.prompt_index = prompt_index
        self.image = image
        self.cwd = cwd

    @classmethod
    def remove_leftovers(cls, settings: EnvironmentSettings) -> None:
        """Called once in the parent before a run starts: remove what a crashed earlier run under the
        same run label left behind (directories, containers, control groups). Backends extend this."""
        remove_run_leftovers(settings.run_label)
        if settings.work_root.exists() and not settings.keep_workdirs:
            remove_tree(settings.work_root)

    @classmethod
    def node_problem(cls) -> str | None:
        """None when this backend can work on the machine this runs on, else one line saying why not.
        A Ray actor asks once, so a node that cannot run the run's environments is found before it takes
        prompts; it must be cheap. Backends that need something of the machine extend this."""
        return None

    @classmethod  # noqa: B027 - empty on purpose: most backends keep nothing between prompts
    async def close_idle(cls) -> None:
        """Called once in each worker after its last prompt: end whatever the backend keeps between
        prompts of the process. Backends that keep something extend this."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Create the environment. Raises EnvironmentSetupError when it cannot exist."""

    @abc.abstractmethod
    async def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Run a shell command in the prompt's working directory and return its combined output."""

    @abc.abstractmethod
    async def read_file(self, path: str) -> bytes:
        """Read a file, path relative to the working directory; raises ToolError on refusal."""

    @abc.abstractmethod
    async def write_file(self, path: str, data: bytes) -> str:
        """Write a file (creating parents) and return the path as the model should refer to it."""

    async def release(self) -> None:
        """The prompt is done with the environment. A backend may keep what can serve the next prompt
        of this process (until close_idle), never anything the prompt left; by default, close()."""
        await self.close()

    @abc.abstractmethod
    async def close(self) -> None:
        """Tear everything down. Idempotent; never raises."""

    async def __aenter__(self) -> Environment:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
