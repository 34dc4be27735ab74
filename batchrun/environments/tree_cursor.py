"""Walking a prompt's directory tree by descriptors, while the prompt's processes may be changing it.

Every directory is opened by its name in its parent's descriptor without following a symlink, so no
path a command can redirect is ever resolved. Only the root's descriptor and the current directory's
are held, so a tree of any depth (deeper than PATH_MAX too) costs two. Going up opens ".." and checks
that it is the directory the walk came down through: one moved elsewhere while the walk was in it
would otherwise lead out of the tree. A directory on another filesystem is never entered.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Names a directory without granting any access to it: all that opening one takes is search
# permission on its parent.
_HANDLE = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

T = TypeVar("T")


class Moved(Exception):
    """The current directory is no longer below the one the walk came down through: start again."""


@dataclass
class _Level:
    identity: tuple[int, int]           # st_dev, st_ino
    name: str                           # its name in its parent ("" for the root)
    pending: list[str] = field(default_factory=list)


class TreeCursor:
    """A position in a tree: its root, held open throughout, and the current directory below it.

    Where a permission refuses what the walk needs (a command may have made any directory unreadable or
    read-only), the directory in the way gets the owner bits ``loosen`` and the step is tried again.
    That happens only after a refusal, so a walk as root, which is never refused, changes no mode."""

    def __init__(self, root_fd: int, loosen: int) -> None:
        self._root_fd = self.fd = root_fd       # fd: the current directory
        info = os.fstat(root_fd)
        self._device = info.st_dev
        self._loosen = loosen
        self._levels = [_Level((info.st_dev, info.st_ino), "")]

    @classmethod
    def open(cls, parent_fd: int, name: str, loosen: int) -> TreeCursor | None:
        """A cursor at directory ``name`` of ``parent_fd``; None when that is not a directory (or is
        gone). The parent is never loosened: it is the runner's, not the prompt's."""
        fd = _open_directory(name, dir_fd=parent_fd, loosen=loosen)
        return None if fd is None else cls(fd, loosen)

    @classmethod
    def at(cls, root: Path, loosen: int) -> TreeCursor | None:
        """A cursor at directory ``root``; None when that is not a directory or cannot be opened."""
        try:
            parent = os.open(root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            return cls.open(parent, root.name, loosen)
        except OSError:
            return None
        finally:
            os.close(parent)

    def __enter__(self) -> TreeCursor:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()        # a walk abandoned half way

    @property
    def pending(self) -> list[str]:
        """Subdirectories of the current directory still to enter: the walker fills and empties it."""
        return self._levels[-1].pending

    @property
    def at_root(self) -> bool:
        return len(self._levels) == 1

    def attempt(self, function: Callable[..., T], name: str) -> T:
        """``function(name, dir_fd=current)``, tried again once the current directory is loosened if
        a permission refused it."""
        try:
            return function(name, dir_fd=self.fd)
        except PermissionError:
            info = os.fstat(self.fd)
            os.fchmod(self.fd, stat.S_IMODE(info.st_mode) | self._loosen)
            return function(name, dir_fd=self.fd)

    def enter(self, name: str) -> bool:
        """Make subdirectory ``name`` current. False, staying where it is, when that is gone, not a
        directory (any more), on another filesystem, or closed to the walk even loosened."""
        try:
            fd = self.attempt(self._open_subdirectory, name)
            if fd is None:
                return False
            info = os.fstat(fd)
        except OSError:
            return False
        if info.st_dev != self._device:
            os.close(fd)
            return False
        self._close_current()
        self.fd = fd
        self._levels.append(_Level((info.st_dev, info.st_ino), name))
        return True

    def leave(self) -> str:
        """Make the parent current again; returns the name of the directory left. Raises Moved when
        the parent is not the directory the walk came down through."""
        if len(self._levels) == 2:
            parent = self._root_fd      # wherever the directory went, the root is where it was
        else:
            try:
                parent = os.open("..", _DIRECTORY, dir_fd=self.fd)
            except OSError as exc:
                raise Moved from exc
            try:
                info = os.fstat(parent)
            except OSError:
                info = None
            if info is None or (info.st_dev, info.st_ino) != self._levels[-2].identity:
                os.close(parent)
                raise Moved
        self._close_current()
        self.fd = parent
        return self._levels.pop().name

    def entries(self) -> Generator[tuple[str, os.stat_result], None, None]:
        """Each entry of the tree, with what ``lstat`` says of it, for a cursor at its root (new or
        restarted); entries gone since their directory was listed are left out. While an entry is
        yielded, ``fd`` is the directory holding it, so the walker may act on it by name there. A
        walker that stops early may go on later from where it stopped. Raises Moved as ``leave`` does;
        the cursor then needs a ``restart`` before it walks again."""
        listing = _listing(self.fd)
        while True:
            if listing is not None:
                with listing:
                    for entry in listing:
                        try:
                            info = self.attempt(os.lstat, entry.name)
                        except OSError:
                            continue            # gone since it was listed
                        if stat.S_ISDIR(info.st_mode):
                            self.pending.append(entry.name)
                        yield entry.name, info
                listing = None
            elif self.pending:
                if self.enter(self.pending.pop()):
                    listing = _listing(self.fd)
            elif self.at_root:
                return
            else:
                self.leave()

    def restart(self) -> None:
        """Back to the root, with nothing pending."""
        self._close_current()
        self.fd = self._root_fd
        del self._levels[1:]
        self._levels[0].pending.clear()

    def close(self) -> None:
        if self._root_fd >= 0:
            self._close_current()
            os.close(self._root_fd)
            self._root_fd = self.fd = -1

    def _close_current(self) -> None:
        if self.fd != self._root_fd:
            os.close(self.fd)

    def _open_subdirectory(self, name: str, dir_fd: int) -> int | None:
        return _open_directory(name, dir_fd=dir_fd, loosen=self._loosen)


def _listing(fd: int) -> os._ScandirIterator[str] | None:
    """The entries of directory ``fd``, read as they are asked for; None when it cannot be read."""
    try:
        return os.scandir(fd)
    except OSError:
        return None


def _open_directory(name: str, *, dir_fd: int, loosen: int) -> int | None:
    """Directory ``name`` of ``dir_fd`` opened for listing; None when it is not a directory (a symlink
    included) or is gone. One the walk may not read is first given the owner bits ``loosen``: through
    a handle on that very directory (its /proc/self/fd entry), so a name swapped meanwhile cannot
    redirect the change."""
    try:
        return os.open(name, _DIRECTORY, dir_fd=dir_fd)
    except PermissionError:
        pass
    except OSError:             # gone, a symlink (ELOOP), not a directory
        return None
    try:
        handle = os.open(name, _HANDLE, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        by_handle = f"/proc/self/fd/{handle}"
        os.chmod(by_handle, stat.S_IMODE(os.fstat(handle).st_mode) | loosen)
        return os.open(by_handle, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    finally:
        os.close(handle)
