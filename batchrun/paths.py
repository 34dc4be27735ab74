"""What a path named on the command line is, in the words a one-line message can use."""

from __future__ import annotations

from pathlib import Path


def file_kind(path: Path) -> str:
    """What a path that is not a regular file is, for a message that names it."""
    if path.is_fifo():
        return "a FIFO (a pipe, such as <(command) makes)"
    if path.is_socket():
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
