"""The one directory each worker's browser leaves on the host (its driver's and Chromium's temporary files,
the profile among them), and the removal of those whose worker died without removing its own.

A worker killed (kill -9, the kernel's memory killer, a crashed node) cannot remove its browser's
directory, and every such death left one in the temporary directory for good: a profile of pages a
prompt visited, four more after each run of the test suite, thousands over days of crashes and resumes.
A worker's browser directory is held by a lock for as long as the worker lives (a lock goes with the
process, however it dies), so any run's start can tell the abandoned ones from those in use, its own
run's or another's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import socket
import tempfile
from pathlib import Path

_PREFIX = "batchrun-browser-"
# Made once the directory is locked, naming the machine whose lock it is: a directory without it is one being
# made, or one on a file system where locks cannot be taken, and is left alone.
_HELD = "held"
# Chromium's singleton socket goes to $TMPDIR/org.chromium.Chromium.XXXXXX/SingletonSocket (45 more
# characters), and a Unix socket path holds at most 107: Chromium aborts at start under a deeper TMPDIR.
# A browser's directory is the TMPDIR of its driver, and of Chromium where no sandbox has a /tmp of its own.
_TMPDIR_CHARS = 60
_DIRECTORY_NAME_CHARS = len(f"/{_PREFIX}") + 8     # mkdtemp's eight random characters
_NO_LOCKS = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP})
# Where a browser's directory goes when $TMPDIR is too deep for it, the first this user may write: a host
# that gives each job a long private TMPDIR may well close /tmp to its users. Then $XDG_RUNTIME_DIR, last:
# it, and the user's files in /dev/shm, are removed when the user's last login session ends.
SHORT_TEMPORARIES = ("/tmp", "/var/tmp", "/dev/shm")
NO_TEMPORARY = (f"the browser needs a directory whose path is at most {_TMPDIR_CHARS - _DIRECTORY_NAME_CHARS} "
                "characters long (Chromium's sockets go there), and TMPDIR is longer while none of /tmp, "
                "/var/tmp, /dev/shm and XDG_RUNTIME_DIR is writable: set TMPDIR to a shorter directory of your own")


def browser_temporary() -> str | None:
    """Where browsers' directories go: $TMPDIR, else the first of SHORT_TEMPORARIES or $XDG_RUNTIME_DIR short
    enough and writable; None where there is none (see NO_TEMPORARY)."""
    candidates = (tempfile.gettempdir(), *SHORT_TEMPORARIES, os.environ.get("XDG_RUNTIME_DIR", ""))
    return next((place for place in candidates if place and len(place) + _DIRECTORY_NAME_CHARS <= _TMPDIR_CHARS
                 and os.path.isdir(place) and os.access(place, os.W_OK | os.X_OK)), None)


def new_browser_directory() -> tuple[Path, int]:
    """A new directory for this process's browser, and the descriptor that holds it (close it once the
    directory is removed). Locked before it is marked held, so that a directory marked held by this
    machine and not locked is one whose worker is gone. On a file system that takes no locks it is left
    unmarked: a killed worker's is then left behind, as before, rather than a live one removed."""
    temporary = browser_temporary()
    if temporary is None:
        raise OSError(NO_TEMPORARY)
    directory = Path(tempfile.mkdtemp(prefix=_PREFIX, dir=temporary))
    lock = None
    try:
        lock = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)     # not inherited: the browser's processes
        try:                                                        # must not keep it after the worker
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in _NO_LOCKS:
                raise
            return directory, lock
        (directory / _HELD).write_text(_this_machine())
    except BaseException:
        if lock is not None:
            os.close(lock)
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory, lock


def remove_abandoned_browser_directories() -> None:
    """Remove the browser directories of workers that are gone, of whatever run on this machine; those of
    this user only, and never through a link."""
    place = browser_temporary()
    if place is None:
        return
    temporary, machine = Path(place), _this_machine()
    with contextlib.suppress(OSError):
        for entry in os.scandir(temporary):
            if entry.name.startswith(_PREFIX):
                _remove_if_abandoned(temporary / entry.name, machine)


def _this_machine() -> str:
    """This machine, as long as it runs: where $TMPDIR is shared between machines (NFS), the lock on a
    directory is seen only on the machine that took it, and another's run would take a live directory for
    an abandoned one."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def _remove_if_abandoned(directory: Path, machine: str) -> None:
    try:
        lock = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        if os.fstat(lock).st_uid != os.geteuid() or _held_by(lock) != machine:
            return
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return                  # its worker is alive
        shutil.rmtree(directory, ignore_errors=True)
    finally:
        os.close(lock)


def _held_by(directory: int) -> str | None:
    """The machine whose worker holds the directory open as ``directory``, if it was marked held."""
    try:
        held = os.open(_HELD, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=directory)
    except OSError:
        return None
    try:
        return os.read(held, 256).decode("ascii", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(held)
