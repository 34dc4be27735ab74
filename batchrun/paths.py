"""Paths the runner did not make: what one is, in the words a one-line message can use, and how to open one
that must be a regular file when another program may have put something else there."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class NotRegularFile(Exception):
    """What :func:`open_regular` found where a regular file should be; ``kind`` says it in a message's words."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def open_regular(path: Path, flags: int = os.O_RDONLY, mode: int = 0o666) -> int:
    """A descriptor of ``path`` opened with ``flags``, if it is a regular file. A file the runner checked
    earlier may have been replaced since by another program, so the open is the check: it never waits
    (O_NONBLOCK), as it would for the other end of a FIFO, and what it opened is what it judges.
    NotRegularFile names anything else; OSError as os.open raises it otherwise."""
    try:
        descriptor = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.EISDIR:       # a directory opened to write
            raise NotRegularFile("a directory") from None
        if exc.errno == errno.ENXIO:        # a FIFO opened to write that no process reads, or a device
            raise NotRegularFile(file_kind(path)) from None
        raise
    found = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(found):
        os.close(descriptor)
        raise NotRegularFile(kind_of(found))
    return descriptor


def file_kind(path: Path) -> str:
    """What a path that is not a regular file is, for a message that names it."""
    try:
        return kind_of(path.stat().st_mode)
    except OSError:
        return "a device"


def kind_of(mode: int) -> str:
    """What a file of this ``mode`` that is not a regular file is, for a message that names it."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (a pipe, such as <(command) makes)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device"


def lookup_error(path: Path) -> str | None:
    """The system's reason ``path`` cannot be looked up (a loop of symbolic links, a directory on the way
    this user may not search), else None, also when nothing is there: pathlib's checks read a loop as
    "not there" and raise on a directory they may not search, so each caller asks this first."""
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def unexpanded_home(path: Path, flag: str) -> str:
    """For a path not found: how to write it, where it starts with a "~" the shell left as it was (no shell
    expands one after "="); else nothing."""
    if not str(path).startswith("~"):
        return ""
    return (f" (the shell expands ~ only at the start of a word: write {flag} {path}, or {flag}=$HOME"
            f"{str(path).removeprefix('~')})")
