"""Removing a prompt's directory on the host: whatever a command did to it, and nothing outside it."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from batchrun.environments.tree_cursor import Moved, TreeCursor

# A process of the prompt still running may add or move entries while the tree is removed: what a
# pass misses, the next one takes, up to this many.
_PASSES = 8


def remove_tree(root: Path) -> None:
    """Delete ``root`` and everything in it; never raises.

    Nothing outside ``root`` is ever opened, changed or removed, whatever a process of the prompt does
    meanwhile: symlinks are removed, never followed, and a filesystem mounted inside is left alone.
    Directories a command made unreadable or read-only (Go's module cache is, for one) are given back
    to their owner first, when that is who removes them (root needs no permission)."""
    try:
        parent = os.open(root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)     # the runner's
    except OSError:
        return
    try:
        _remove(parent, root.name)
    finally:
        os.close(parent)


def _remove(parent: int, name: str) -> None:
    try:
        cursor = TreeCursor.open(parent, name, stat.S_IRWXU)
    except OSError:
        return
    if cursor is None:              # a file, a symlink, or nothing
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=parent)
        return
    with cursor:
        for _ in range(_PASSES):
            try:
                _empty(cursor)
                os.rmdir(name, dir_fd=parent)
                return
            except FileNotFoundError:
                return
            except (Moved, OSError):        # moved under the walk, or filled again meanwhile
                cursor.restart()


def _empty(cursor: TreeCursor) -> None:
    """Remove what the cursor's root holds, depth first."""
    _clear(cursor)
    while True:
        if cursor.pending:
            name = cursor.pending.pop()
            if cursor.enter(name):
                _clear(cursor)
            else:           # not a directory any more (swapped for a symlink, say), or not to enter
                _unlink(cursor, name)
        elif cursor.at_root:
            return
        else:
            left = cursor.leave()
            with contextlib.suppress(OSError):
                cursor.attempt(os.rmdir, left)


def _clear(cursor: TreeCursor) -> None:
    """Unlink all but the directories in the current directory, and queue those. FIFOs, sockets and
    device nodes are unlinked like files, never opened."""
    try:
        with os.scandir(cursor.fd) as entries:
            listed = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
    except OSError:
        return
    for name, is_directory in listed:
        if is_directory or not _unlink(cursor, name):
            cursor.pending.append(name)


def _unlink(cursor: TreeCursor, name: str) -> bool:
    """Unlink ``name`` unless it is a directory (False then)."""
    try:
        cursor.attempt(os.unlink, name)
    except IsADirectoryError:
        return False
    except OSError:
        pass
    return True
