"""The environment protocol: where one prompt's model-written commands and file edits happen.

Every backend (a local directory, the bubblewrap sandbox, a docker, podman, singularity or apptainer
container, a Modal sandbox) is a class implementing :class:`Environment`. One instance serves exactly
one prompt: it is started before the prompt's first model call, used by the terminal and file tools,
and closed when the session ends — also on errors and cancellation — so no state leaks between prompts.
The methods' docstrings are the contract every backend keeps; tests/test_environment_contract.py
holds each backend present to it.
"""

from __future__ import annotations

import abc
import hashlib
import os
import re
import stat
import tempfile
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


class EnvironmentLostError(RuntimeError):
    """The prompt's environment is gone mid-prompt, through no command of its own (its container engine
    died, its container was removed behind the runner's back): nothing the model asks for can run now.

    The session fails the prompt with this message, so that --resume runs it again, instead of handing
    the model an error for every later call and keeping what it makes of them as a finished row.
    """


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
    """One prompt's sandbox. A backend is a subclass in a module of its own and one line in
    ``ENVIRONMENT_KINDS``; its class methods answer for the backend, its instances for one prompt."""

    #: The name users select with TERMINAL_ENV and the start-up summary shows.
    kind: str = ""
    #: Whether one prompt's start can fail while others' succeed (an image that cannot be pulled). Such
    #: an environment starts before the prompt's first model call, so that the prompt spends nothing;
    #: one whose start fails only with the machine (which the start-up check finds once) starts while
    #: the first reply is written.
    start_can_fail_alone: ClassVar[bool] = True
    #: Whether a prompt's container image (the dataset's ``image`` field) is what its commands run in. A
    #: backend on this machine's own files runs them without it, and the start-up summary says so.
    runs_images: ClassVar[bool] = True
    #: Whether the prompts' processes all count against the runner's user's process limit (``ulimit -u``),
    #: as those of sandboxes on this machine's kernel under the runner's uid do; a container engine's or a
    #: service's are kept apart by it.
    shares_user_process_limit: ClassVar[bool] = False

    def __init__(self, settings: EnvironmentSettings, *, prompt_index: int,
                 image: str | None = None, cwd: str | None = None) -> None:
        self.settings = settings
        self.prompt_index = prompt_index
        self.image = image
        self.cwd = cwd

    @classmethod
    def startup_check(cls) -> str:
        """Called once in the parent when TERMINAL_ENV names this backend, before anything of the run
        exists. Returns what the start-up summary says about the choice (what this backend is here);
        raises EnvironmentSetupError with the one line that stops the run when no prompt could start
        (the backend is not installed, has no credentials, cannot work on this machine). What only some
        prompts need (an image) is left to their start. Backends that need something extend this."""
        return "chosen by TERMINAL_ENV"

    @classmethod
    def limits_line(cls, limits: ResourceLimits) -> str | None:
        """What the start-up summary says this backend holds each prompt to, or None where the backend's own
        engine sets the limits (a container's). Backends that apply ``limits`` themselves override this."""
        return None

    @classmethod
    def remove_leftovers(cls, settings: EnvironmentSettings) -> None:
        """Called once in the parent before a run starts: remove what a crashed earlier run under the
        same run label left behind (directories, containers, control groups), and nothing of any other
        run's. Never raises for a backend that is missing or unreachable: then there is nothing it could
        remove. Backends extend this."""
        remove_run_leftovers(settings.run_label)
        if settings.work_root.exists() and not settings.keep_workdirs:
            remove_tree(settings.work_root)

    @classmethod
    def remove_node_leftovers(cls, settings: EnvironmentSettings) -> None:
        """What :meth:`remove_leftovers` removes that lives on this machine, for a Ray node other than the
        runner's: all of it, for a backend whose environments live on the machine. A backend whose
        environments are a service's removes those once, in the runner, and extends this."""
        cls.remove_leftovers(settings)

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
        """Create the environment: fresh, holding nothing of another prompt, its working directory the
        row's cwd (made if missing) or the backend's default. Raises EnvironmentSetupError, one line
        naming what failed (a cwd that leads outside, an image that cannot be pulled), when it cannot
        exist; a failed start leaves nothing behind, as close() is not called after it."""

    @abc.abstractmethod
    async def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Run a shell command in the prompt's working directory, reading end-of-file from its input,
        and return its output: stdout and stderr merged in the order written, undecodable bytes
        replaced, cut at ``settings.max_output_chars`` with a note saying how much more there was
        (``truncated``). A non-zero exit is a result, not an error. The command sees none of the user's
        environment variables beyond the allowed ones. Past ``timeout`` (else the settings'
        ``command_timeout``) the command is killed, and the result is ``timed_out`` with no exit code
        and the output so far; the environment runs the next command as before. What the command could
        not be run for, or a limit it ran into where the backend can tell, is in ``error``."""

    @abc.abstractmethod
    async def read_file(self, path: str) -> bytes:
        """Read a file, path relative to the working directory (what commands write there, the file tools
        read). Raises ToolError, a message for the model, for a path that does not exist, is a directory
        or not a regular file, is larger than ``settings.max_file_bytes``, or leads out of where the file
        tools may go: the prompt's directory for the backends that keep it on this machine, the
        container's root for the container backends; never the host's files."""

    @abc.abstractmethod
    async def write_file(self, path: str, data: bytes) -> str:
        """Write a file (creating parents) and return the path as the model should refer to it: relative
        to the working directory when it is beneath it. Commands see the file at once. Raises ToolError
        as read_file does, and for data larger than ``settings.max_file_bytes``."""

    async def release(self) -> None:
        """The prompt is done with the environment. A backend may keep what can serve the next prompt
        of this process (until close_idle), never anything the prompt left: the next prompt's
        environment finds none of its files or processes. By default, close()."""
        await self.close()

    @abc.abstractmethod
    async def close(self) -> None:
        """Tear everything down: every process the prompt started, its container, its directory (unless
        ``settings.keep_workdirs``), also while a command still runs or a start was cut short.
        Idempotent; never raises."""

    async def __aenter__(self) -> Environment:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def work_root_of(run_label: str) -> Path:
    """``$TMPDIR/batch_runner-<uid>/<run>``, where a run's environments are made. The level above the run is
    the user's own by name: with one name for all, the first user to run (root, from CI or a container) made
    it, and every other user's run on the machine found it not theirs and was refused."""
    return Path(tempfile.gettempdir()) / f"batch_runner-{os.geteuid()}" / run_label


class WorkRootError(Exception):
    """The directory the run's environments are made in is not the runner's alone."""


def claim_work_root(work_root: Path) -> None:
    """Make ``work_root`` (:func:`work_root_of`) and its parent where missing, and refuse either
    where another user could change it: its name is known ahead, and whoever made it first could swap the
    sandboxes' root (their ``/`` and ``/etc``) or a prompt's directory between the runner's steps. Every
    making of them comes here, so none takes its mode from the umask (0 in some daemons and containers).
    ``$TMPDIR`` itself may be open to all, as ``/tmp`` is, where its sticky bit keeps our entries ours."""
    temporary = work_root.parent.parent
    try:
        os.makedirs(temporary, mode=0o700, exist_ok=True)
        found = temporary.stat()
    except OSError as exc:
        raise WorkRootError(f"cannot use {temporary}: {exc.strerror}; set TMPDIR to a directory of your "
                            "own") from None
    # Writable by the runner's group is its user's own way (a private group, umask 002), not refused.
    if found.st_uid not in (os.geteuid(), 0) or (found.st_mode & 0o002 and not found.st_mode & stat.S_ISVTX):
        raise WorkRootError(f"{temporary} is open to other users, who could replace the directories of the run's "
                            "sandboxes in it (another user's, or writable by all and not sticky as /tmp is); "
                            "set TMPDIR to a directory of your own")
    for directory in (work_root.parent, work_root):
        try:
            os.mkdir(directory, 0o755)
        except FileExistsError:
            pass
        except OSError as exc:
            raise WorkRootError(f"cannot make {directory}: {exc.strerror}; set TMPDIR to a directory of your "
                                "own") from None
        _check_own(directory)


def _check_own(directory: Path) -> None:
    """``directory`` (or the link that names it, and what it names) is the runner's, and writable by the runner
    alone: one of its own that is writable by its group (made under a umask of 002) is made so."""
    refusal = (f"{directory} is {{}}, and the run's sandboxes are made in it: another user could change what "
               "every prompt sees. Remove it, or set TMPDIR to a directory of your own")
    try:
        named = os.lstat(directory)
        if named.st_uid != os.geteuid():        # before a link is followed: another's may lead anywhere
            raise WorkRootError(refusal.format(f"uid {named.st_uid}'s"))
        found = os.stat(directory) if stat.S_ISLNK(named.st_mode) else named
        if not stat.S_ISDIR(found.st_mode):
            raise WorkRootError(refusal.format("not a directory"))
        if found.st_uid != os.geteuid():
            raise WorkRootError(refusal.format(f"a link to uid {found.st_uid}'s directory"))
        if found.st_mode & 0o022:
            os.chmod(directory, stat.S_IMODE(found.st_mode) & ~0o022)
    except OSError as exc:      # a link to nowhere, a loop of links, a filesystem that takes no chmod
        raise WorkRootError(f"cannot use {directory}: {exc.strerror}. Remove it, or set TMPDIR to a directory of "
                            "your own") from None
