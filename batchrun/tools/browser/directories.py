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
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

_PREFIX = "batchrun-browser-"
# Made only once the directory is locked: a directory without it is one being made, and is left alone.
_HELD = "held"
# Chromium's singleton socket goes to $TMPDIR/org.chromium.Chromium.XXXXXX/SingletonSocket (45 more
# characters), and a Unix socket path holds at most 107: Chromium aborts at start under a deeper TMPDIR.
TMPDIR_CHARS = 60


def browser_temporary() -> str:
    """Where browsers' directories go, and the TMPDIR of their driver and Chromium."""
    temporary = tempfile.gettempdir()
    return "/tmp" if len(temporary) > TMPDIR_CHARS else temporary


def new_browser_directory() -> tuple[Path, int]:
    """A new directory for this process's browser, and the descriptor that holds it (close it once the
    directory is removed). Locked before it is marked held, so that a directory marked held and not
    locked is one whose worker is gone."""
    directory = Path(tempfile.mkdtemp(prefix=_PREFIX, dir=browser_temporary()))
    lock = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)     # not inherited: the browser's processes
    fcntl.flock(lock, fcntl.LOCK_EX)                            # must not keep it after the worker
    (directory / _HELD).touch()
    return directory, lock


def remove_abandoned_browser_directories() -> None:
    """Remove the browser directories of workers that are gone, of whatever run; those of this user only,
    and never through a link."""
    temporary = Path(browser_temporary())
    with contextlib.suppress(OSError):
        for entry in os.scandir(temporary):
            if entry.name.startswith(_PREFIX):
                _remove_if_abandoned(temporary / entry.name)


def _remove_if_abandoned(directory: Path) -> None:
    try:
        lock = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        if os.fstat(lock).st_uid != os.geteuid() or not (directory / _HELD).exists():
            return
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return                  # its worker is alive
        shutil.rmtree(directory, ignore_errors=True)
    finally:
        os.close(lock)
