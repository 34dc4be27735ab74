"""File access confined to a prompt's directory, safe while the prompt's processes change that tree.

The file tools act on a prompt's directory from the host while the prompt's own processes may rename,
swap and link things in it at the same moment. Resolving a path first and opening it afterwards
loses that race (a directory swapped for a symlink in between sends the open outside), so no path the
model chose is ever looked up by name on the host. Every component is resolved relative to a
descriptor of the directory above it, no symlink is followed by the kernel unless it stays beneath
the prompt directory, and only regular files are read or written.

Where the kernel has openat2 (Linux 5.6), RESOLVE_BENEATH does a whole lookup in one system call;
whenever it is missing or refuses, a component walk with O_NOFOLLOW decides. The walk also follows
symlinks whose target is an absolute path under the name the commands know the directory by (a model
in the sandbox writes ``ln -s /workspace/src/x.py x.py``), which the kernel cannot know, and creates
missing parent directories.

Both lookups, and the reads and writes on their descriptors, stay in this one module on
purpose, over 400 lines: the race-freedom argument is read in one place, not pieced together across
files.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import posixpath
import secrets
import stat
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from batchrun.environments.base import ToolError

# As the kernel: a loop of links ends in an error, not a hang.
_MAX_SYMLINKS = 40
# The kernel's PATH_MAX: no command can name a longer path either. A longer one would have the walk make
# and hold open a directory per component (the worker, whose prompts share it, out of descriptors).
PATH_MOST_BYTES = 4096
# The walk holds a descriptor per directory it stands in: far deeper than any real tree, and bounded
# however symlinks chain.
MOST_DIRECTORIES_DEEP = 256
# Directories a write may make (each takes a block the workspace's limit counts only after the write).
MOST_DIRECTORIES_MADE = 64
# O_NONBLOCK: opening a FIFO must not wait for a writer (the type is checked after opening).
# O_NOCTTY: a terminal device must not become the worker's controlling terminal.
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_DIRECTORY_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
# The first read asks for the size fstat reported (plus one byte, to see the end); a file that grows
# meanwhile is read on in chunks of this size, up to the limit.
_READ_CHUNK_BYTES = 1 << 20
# Written files replace their target under a name of this form, created next to it.
_TEMPORARY_PREFIX = ".batchrun-write-"
# Bits a replaced file keeps: permissions, not setuid/setgid/sticky.
_KEPT_MODE_BITS = 0o777
_RUNNING_AS_ROOT = os.geteuid() == 0
_NOT_REGULAR = ("is not a regular file (a FIFO, socket or device); "
                "the file tools only read and write regular files")

T = TypeVar("T")


@dataclass(frozen=True)
class ConfinedPath:
    """A path the model named, to be resolved beneath ``root`` and nowhere else."""

    root: Path              # the prompt directory on the host
    start: str              # the commands' working directory, relative to root ("." for root)
    path: str               # as the model gave it: relative to start, or absolute under root_name
    root_name: str          # the absolute name commands know root by (absolute symlinks under it stay inside)
    allow_hard_links: bool  # False where commands could hard-link the user's own files into root

    def relative_to_start(self) -> str:
        """The path relative to the working directory, normalized, as the model should refer to it; as
        given where it climbs after a name, which only the lookup could normalize."""
        if climbs_after_a_name(self.path):
            return self.path
        if self.path.startswith("/"):
            rest = _beneath_root(self.path, self.root_name)
            assert rest is not None     # the path was resolved, so it is under root_name
            return posixpath.relpath(posixpath.join("/", rest), posixpath.join("/", self.start))
        return posixpath.normpath(self.path)


def climbs_after_a_name(path: str) -> bool:
    """Whether ``path`` has a '..' after a named component ('a/../f'). The kernel climbs from where 'a'
    leads, which is elsewhere when 'a' is a symlink; normpath climbs by name, and so names another file."""
    named = False
    for part in path.split("/"):
        if part == "..":
            if named:
                return True
        elif part not in ("", "."):
            named = True
    return False


class _Refused(Exception):
    """The file tools will not touch this path; the message follows the path in the tool error."""


@dataclass(frozen=True)
class _Symlink:
    """The final component turned out to be a symlink: the walk goes on at its target."""

    target: str


def read_regular_file(target: ConfinedPath, limit: int) -> bytes:
    """The bytes of the regular file ``target`` names, refused over ``limit`` bytes."""
    with _as_tool_errors(target.path, "read"):
        components = _components_of(target)
        with _root_descriptor(target.root) as root:
            fd = _open_beneath(root, "/".join(components), _READ_FLAGS)
            if fd is None:
                fd = _walk(root, target.root_name, components, _open_for_reading, create_directories=False)
        try:
            status = os.fstat(fd)
            _require_regular(status, target.allow_hard_links)
            data = _read_at_most(fd, limit + 1, status.st_size)
        finally:
            os.close(fd)
    if len(data) > limit:
        raise ToolError(f"{target.path!r} is larger than the file tools' limit of {limit} bytes")
    return data


def write_regular_file(target: ConfinedPath, data: bytes) -> None:
    """Create or replace the regular file ``target`` names, creating missing parent directories.

    The data goes to a new file in the target's directory (a descriptor held since the lookup), which
    is then renamed over the target: the write never opens an existing file, so a FIFO, device or
    symlink swapped in at the last moment is replaced rather than written through, and a reader sees
    the old content or the new, never half of it.
    """
    with _as_tool_errors(target.path, "write"):
        components = _components_of(target)

        def replace(directory: int, name: str) -> None | _Symlink:
            return _replace_file(directory, name, data, target.allow_hard_links)

        with _root_descriptor(target.root) as root:
            if _replace_beneath(root, components, replace):
                return
            _walk(root, target.root_name, components, replace, create_directories=True)


# --- resolution -----------------------------------------------------------------------------------

def _components_of(target: ConfinedPath) -> list[str]:
    """The names to walk from the root; refuses an absolute path not under the root's name."""
    if "\0" in target.path:
        raise _Refused("is not a valid path: it contains a NUL byte")
    try:    # as the path is given to the kernel: a byte that is not UTF-8 stands as \udc80-\udcff
        size = len(target.path.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:
        raise _Refused("is not a valid path: it holds a lone surrogate (\\ud800-\\udfff), which is not text") from None
    if size > PATH_MOST_BYTES:
        raise _Refused(f"is longer than {PATH_MOST_BYTES:,} bytes, the most a path may have")
    if target.path.startswith("/"):
        rest = _beneath_root(target.path, target.root_name)
        if rest is None:
            raise _outside(target.root_name)
        return _components(rest)
    return _components(target.start) + _components(target.path)


def _components(path: str) -> list[str]:
    """The names along a relative path. A path that names a directory (empty, '.', or ending in '/')
    ends in '.', so that a file of that name is not taken for it."""
    names = [name for name in path.split("/") if name not in ("", ".")]
    if not names or path.endswith(("/", "/.")):
        names.append(".")
    return names


def _beneath_root(absolute: str, root_name: str) -> str | None:
    """What follows ``root_name`` in an absolute path ('' for root_name itself); None if elsewhere."""
    if absolute == root_name:
        return ""
    prefix = root_name.rstrip("/") + "/"
    return absolute[len(prefix):] if absolute.startswith(prefix) else None


def _outside(root_name: str) -> _Refused:
    return _Refused(f"is outside the working directory; the file tools only reach files under {root_name}")


@contextlib.contextmanager
def _root_descriptor(root: Path) -> Iterator[int]:
    """A descriptor of the prompt directory, the anchor of every lookup (not a symlink itself)."""
    fd = os.open(root, _DIRECTORY_FLAGS | os.O_NOFOLLOW)
    try:
        yield fd
    finally:
        os.close(fd)


class _Walk:
    """Where a component walk stands: descriptors of the directories from the root down to it.

    '..' pops a descriptor rather than asking the kernel for a parent, so it can never climb above
    the root, and every name is opened with O_NOFOLLOW relative to the descriptor above it.
    """

    def __init__(self, root: int, root_name: str) -> None:
        self._root = root
        self._root_name = root_name
        self._below_root: list[int] = []
        self._links_followed = 0
        self._directories_made = 0

    @property
    def here(self) -> int:
        return self._below_root[-1] if self._below_root else self._root

    def close(self) -> None:
        while self._below_root:
            os.close(self._below_root.pop())

    def up(self) -> None:
        if not self._below_root:
            raise _outside(self._root_name)
        os.close(self._below_root.pop())

    def down(self, name: str, create: bool) -> str | None:
        """Enter the directory ``name``; if ``name`` is a symlink, its target instead (nothing entered)."""
        if len(self._below_root) >= MOST_DIRECTORIES_DEEP:
            raise _Refused(f"lies more than {MOST_DIRECTORIES_DEEP} directories deep; the file tools go no deeper")
        try:
            fd = os.open(name, _DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=self.here)
        except FileNotFoundError:
            if not create:
                raise
            self._directories_made += 1
            if self._directories_made > MOST_DIRECTORIES_MADE:
                raise _Refused(f"would make more than {MOST_DIRECTORIES_MADE} missing directories; a write makes "
                               f"at most {MOST_DIRECTORIES_MADE}") from None
            try:
                os.mkdir(name, dir_fd=self.here)
                _take_owner(os.fstat(self.here), name, self.here)
            except FileExistsError:     # made meanwhile: used if a directory
                pass
            fd = os.open(name, _DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=self.here)
        except NotADirectoryError:      # a file, or a symlink (O_NOFOLLOW never enters one)
            target = _symlink_target(name, self.here)
            if target is None:
                raise
            return target
        self._below_root.append(fd)
        return None

    def follow(self, target: str) -> list[str]:
        """The names to walk next for a symlink found where the walk stands."""
        self._links_followed += 1
        if self._links_followed > _MAX_SYMLINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
        if target.startswith("/"):
            rest = _beneath_root(target, self._root_name)
            if rest is None:
                raise _outside(self._root_name)
            self.close()                # back at the root
            return _components(rest)
        return _components(target)


def _walk(root: int, root_name: str, components: list[str],
          final: Callable[[int, str], T | _Symlink], create_directories: bool) -> T:
    """Walk ``components`` from ``root`` and hand the last to ``final`` with its directory's
    descriptor; symlinks on the way (the last one too, when ``final`` reports one) are followed
    while they stay beneath the root."""
    walk = _Walk(root, root_name)
    pending = deque(components)
    try:
        while True:
            name = pending.popleft()
            if name == "..":
                walk.up()
                name = "."
            if name == "." and pending:
                continue
            if pending:
                target = walk.down(name, create_directories)
            else:
                outcome = final(walk.here, name)
                if not isinstance(outcome, _Symlink):
                    return outcome
                target = outcome.target
            if target is not None:
                pending.extendleft(reversed(walk.follow(target)))
    finally:
        walk.close()


def _symlink_target(name: str, directory: int) -> str | None:
    """The target of the symlink ``name``; None if ``name`` is not a symlink."""
    try:
        return os.readlink(name, dir_fd=directory)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


# --- openat2 --------------------------------------------------------------------------------------

# The system call number is the same on both; elsewhere the walk does every lookup.
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(platform.machine())
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_BENEATH = 0x08
_openat2_usable = _SYS_OPENAT2 is not None     # until the kernel (or a seccomp filter) says otherwise
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _open_beneath(directory: int, path: str, flags: int) -> int | None:
    """A descriptor for ``path`` looked up by the kernel without leaving ``directory`` (symlinks
    followed only while they stay beneath it, /proc's magic links never); None whenever openat2
    cannot or will not, and the walk decides."""
    global _openat2_usable
    if not _openat2_usable or _SYS_OPENAT2 is None:    # usable implies a number; this says so to mypy
        return None
    how = _OpenHow(flags, 0, _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(directory),
                       ctypes.c_char_p(os.fsencode(path)), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    if fd >= 0:
        return fd
    if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):     # an old kernel, or a filter forbids it
        _openat2_usable = False
    return None


def _replace_beneath(root: int, components: list[str],
                     replace: Callable[[int, str], None | _Symlink]) -> bool:
    """``replace`` the last component in its directory, found by openat2; False when the walk must
    do it (no openat2, a missing or refused directory, or a symlink as the last component)."""
    name = components[-1]
    if name in (".", ".."):
        return False
    directory = _open_beneath(root, "/".join(components[:-1]) or ".", _DIRECTORY_FLAGS)
    if directory is None:
        return False
    try:
        return replace(directory, name) is None
    finally:
        os.close(directory)


# --- reading and writing --------------------------------------------------------------------------

def _open_for_reading(directory: int, name: str) -> int | _Symlink:
    try:
        return os.open(name, _READ_FLAGS | os.O_NOFOLLOW, dir_fd=directory)
    except OSError as exc:
        target = _symlink_target(name, directory) if exc.errno == errno.ELOOP else None
        if target is None:
            raise
        return _Symlink(target)


def _require_regular(status: os.stat_result, allow_hard_links: bool) -> None:
    if stat.S_ISDIR(status.st_mode):
        raise _Refused("is a directory, not a file")
    if not stat.S_ISREG(status.st_mode):
        raise _Refused(_NOT_REGULAR)
    if status.st_nlink > 1 and not allow_hard_links:
        raise _Refused("has other hard links, which may be outside the working directory; "
                       "the file tools refuse such files")


def _read_at_most(fd: int, most: int, expected: int) -> bytes:
    """Up to ``most`` bytes: bounded even if the file grows while it is read."""
    chunks = []
    size = min(most, expected + 1)
    while most > 0 and (chunk := os.read(fd, size)):
        chunks.append(chunk)
        most -= len(chunk)
        size = min(most, _READ_CHUNK_BYTES)
    return b"".join(chunks)


def _replace_file(directory: int, name: str, data: bytes, allow_hard_links: bool) -> None | _Symlink:
    """Write ``data`` to a new file in ``directory`` and rename it over ``name``, which must be
    missing or a regular file (a symlink is reported, to be followed)."""
    try:
        status = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        status = None
    if status is not None and stat.S_ISLNK(status.st_mode):
        target = _symlink_target(name, directory)
        if target is not None:
            return _Symlink(target)
        status = os.stat(name, dir_fd=directory, follow_symlinks=False)    # replaced meanwhile
    if status is not None:
        _require_regular(status, allow_hard_links)
    temporary = f"{_TEMPORARY_PREFIX}{secrets.token_hex(8)}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666,
                 dir_fd=directory)
    try:
        try:
            _take_owner(status or os.fstat(directory), fd)
            if status is not None:      # an edit keeps the file's permissions (a script stays executable)
                os.fchmod(fd, stat.S_IMODE(status.st_mode) & _KEPT_MODE_BITS)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=directory)
        raise
    return None


def _take_owner(model: os.stat_result, created: int | str, directory: int | None = None) -> None:
    """Give what a tool just created (an open file, or a name in ``directory``) the owner of ``model``:
    the file it replaces, else its directory. Only a runner started as root creates files for another
    user: the bubblewrap sandbox's commands then run unprivileged in a directory they own, and must be
    able to change what the tools wrote."""
    if not _RUNNING_AS_ROOT or (model.st_uid, model.st_gid) == (0, 0):
        return
    if isinstance(created, int):
        os.fchown(created, model.st_uid, model.st_gid)
    else:
        os.chown(created, model.st_uid, model.st_gid, dir_fd=directory, follow_symlinks=False)


@contextlib.contextmanager
def _as_tool_errors(given: str, doing: str) -> Iterator[None]:
    """One clear tool error, naming the path as the model gave it, for whatever refused the call."""
    try:
        yield
    except _Refused as exc:
        raise ToolError(f"{given!r} {exc}") from None
    except FileNotFoundError:
        raise ToolError(f"{given!r} does not exist") from None
    except IsADirectoryError:
        raise ToolError(f"{given!r} is a directory, not a file") from None
    except OSError as exc:
        if exc.errno == errno.ENXIO:      # a socket, or a FIFO nobody reads
            raise ToolError(f"{given!r} {_NOT_REGULAR}") from None
        raise ToolError(f"cannot {doing} {given!r}: {exc.strerror or exc}") from None
