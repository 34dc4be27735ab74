"""What goes wrong with a run directory, in words the user can act on.

RunDirectoryError is what every part of the package raises when the directory cannot be used as
asked; WriteFailed, the kind met mid-run, stops the run keeping every row written before: DiskFull
names the file, the filesystem that holds it and what is free there, WriteRefused a filesystem gone
read-only or failing. Kept apart because the runner catches and words these too, without reading any file. The
one-line messages for a file that may not be written or read, or is no regular file, are made here
once, for every part that meets one (the lock, the start's checks, the reads, the atomic rewrites).
"""

from __future__ import annotations

import errno
import os
import re
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class RunDirectoryError(Exception):
    """The run directory cannot be used as asked (locked, holds results without --resume, or holds a
    line that is not a row this version understands)."""


class WriteFailed(RunDirectoryError):
    """A write to the run directory failed mid-run in a way no retry mends: the run stops, every row
    written before kept. ``remedy`` says what to do before --resume."""

    remedy: str


class WriteRefused(WriteFailed):
    """The filesystem no longer takes writes: turned read-only (as the kernel does to one it finds an error
    in), or failing (EIO)."""

    def __init__(self, path: Path, exc: OSError) -> None:
        mount, kind = filesystem_of(path)
        super().__init__(f"cannot write {path}: {exc.strerror} ({kind} at {mount})")
        if exc.errno == errno.EIO:
            self.remedy = "Check the disk (the kernel's log says what failed; a filesystem check may mend it)"
        else:
            self.remedy = ("Make its filesystem writable (one the kernel made read-only for an error it found "
                           "wants a filesystem check first)")


# What a filesystem that took the run's writes says once it takes no more.
_REFUSED_WRITES = (errno.EROFS, errno.EIO)


class DiskFull(WriteFailed):
    """A write found no room: none left on its filesystem (ENOSPC, or the user's quota: EDQUOT), or
    the file at the largest size this process may write (EFBIG: ``ulimit -f``, or the filesystem's
    largest file). The message says which file and why; for a full filesystem, which one, what is free
    there and what the write needed. ``remedy`` says what to do before --resume."""

    def __init__(self, path: Path, needed: int, *, too_large: bool = False) -> None:
        self.path, self.needed, self.out_of_files = path, needed, False
        wanted = f"writing it needs about {size_text(needed)}, and " if needed else ""
        mount, kind = filesystem_of(path)
        if too_large:
            super().__init__(f"{path} cannot grow any larger: {wanted}{_largest_file(kind, mount)}")
            self.remedy = "Raise the limit (ulimit -f) or move the run to a filesystem that takes larger files"
            return
        usage = os.statvfs(mount)
        free, total = usage.f_bavail * usage.f_frsize, usage.f_blocks * usage.f_frsize
        # A filesystem out of inodes refuses a new file however many bytes are free, and says ENOSPC all the same.
        self.out_of_files = usage.f_files > 0 and usage.f_favail == 0
        if self.out_of_files:
            super().__init__(f"no file can be made on the disk for {path}: the filesystem that holds it ({kind} at "
                             f"{mount}) has all its {usage.f_files:,} inodes in use, with {size_text(free)} free "
                             f"of {size_text(total)}")
            self.remedy = "Remove files there, or give the filesystem more inodes"
            return
        super().__init__(f"no space left on the disk for {path}: {wanted}the filesystem that holds it ({kind} at "
                         f"{mount}) has {size_text(free)} free of {size_text(total)}")
        self.remedy = "Make room there"


def _largest_file(kind: str, mount: str) -> str:
    soft, _hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        return f"it is at the largest file this process may write ({size_text(soft)}, ulimit -f)"
    return f"it is at the largest file its filesystem ({kind} at {mount}) takes"


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def write_refusal_remedy(exc: OSError) -> str | None:
    """How to get past a write the system refuses until something changes (permissions, a filesystem
    mounted read-only), as the end of "run ... "; None for any other failure."""
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "as a user who may write there"
    if exc.errno == errno.EROFS:
        return "once its filesystem is mounted writable"
    return None


def write_refused(directory: Path, exc: OSError) -> RunDirectoryError | None:
    """The one message for a write in the run directory that the system refuses (``exc.filename``: the file
    or the directory itself); None for any other failure (see write_refusal_remedy)."""
    if (remedy := write_refusal_remedy(exc)) is None:
        return None
    return RunDirectoryError(f"cannot write in {directory}: {exc.strerror} ({exc.filename}). Run {remedy}, or "
                             "choose another --run_name.")


def cannot_read(what: str, exc: OSError, command: str = "") -> RunDirectoryError:
    """The one message for a part of the run directory that cannot be read (``what`` names it); where
    permissions refuse it, who may (``command``: the command to run as that user, where it matters)."""
    if exc.errno == errno.EIO:
        return RunDirectoryError(f"cannot read {what}: {exc.strerror}. Check the disk that holds it (the kernel's "
                                 "log says what failed), then run again.")
    if exc.errno not in (errno.EACCES, errno.EPERM):
        return RunDirectoryError(f"cannot read {what}: {exc.strerror}.")
    return RunDirectoryError(f"cannot read {what}: {exc.strerror}. Run {command + ' ' if command else ''}as a user "
                             "who may read it.")


def not_a_regular_file(path: Path, what_it_holds: str) -> RunDirectoryError:
    """The one message for a file of the run directory that is not a regular file (a directory, a FIFO, a device)."""
    return RunDirectoryError(f"{path} is not a regular file: {what_it_holds}. Move it out of {path.parent}/.")


@contextmanager
def write_failure_named(path: Path, needed: int = 0) -> Iterator[None]:
    """A full disk met inside the block becomes DiskFull for ``path``, a refused write WriteRefused."""
    try:
        yield
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFull(path, needed, too_large=exc.errno == errno.EFBIG) from exc
        if exc.errno in _REFUSED_WRITES:
            raise WriteRefused(path, exc) from exc
        raise


def filesystem_of(path: Path) -> tuple[str, str]:
    """(mount point, filesystem type) of the filesystem that holds ``path`` (or would)."""
    mount = os.path.realpath(path)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    kind = "filesystem"
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            for line in mounts:       # the last entry for a mount point is the one in effect
                fields = line.split()
                if len(fields) > 2 and _unescaped(fields[1]) == mount:
                    kind = fields[2]
    except OSError:
        pass
    return mount, kind


def _unescaped(field: str) -> str:
    """A path as /proc/self/mounts writes it, its spaces, tabs and backslashes as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def size_text(count: int) -> str:
    if count < 1024:
        return f"{count} byte{'s' if count != 1 else ''}"
    if count < 1 << 20:
        return f"{count / 1024:.0f} KB"
    if count < 1 << 30:
        return f"{count / (1 << 20):.1f} MB"
    return f"{count / (1 << 30):.1f} GB"
