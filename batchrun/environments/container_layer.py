"""Holding a container's writable layer to the workspace limit while its commands write.

An engine's storage has no size limit of its own on most hosts (``--storage-opt size`` needs overlay on
XFS with project quotas), and it usually shares a disk with the run directory. Where the engine keeps a
container's writable layer as a directory of this machine (Docker's and Podman's overlay drivers, run by
the runner's user), everything the container writes outside its /tmp (a tmpfs, capped on its own) lands
in that directory, so the worker's disk guard watches it as it watches a sandbox's workspace: walked
while commands run, its holders' unnamed files counted, the disk reserve kept. The files the engine makes
for the container and mounts into it (``/etc/hosts``, ``/etc/hostname``, ``/etc/resolv.conf``, Podman's
``/run/.containerenv``) lie outside the layer, on this machine's disk too, and root in the container may
write them: they count with it.

Over the limit, the container's first process is killed: the kernel kills every other process of its
PID namespace with it, whatever those processes were changed to do. The container is started again
before its next command, its files as they were. The first process is held by a pidfd, so a kill never
reaches a process that took its number after it ended.

The engines' system-call filters allow ``fallocate``, and ``fallocate --keep-size`` reserves any amount
past a file's end in one call, which no file size limit bounds: one call can take the disk, the run's
reserve included. The look that follows stops the container, and once its processes are gone the stop
gives that space back: each file of the layer, and each of the engine's files, that holds space past its
end is truncated to the length it has, which frees the space on ext4 and XFS and leaves the file's bytes,
size and modification time as they were.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import stat
import time
from pathlib import Path

from batchrun import kernel_files
from batchrun.environments.disk_guard import WorkspaceWatch, guard_for
from batchrun.environments.limits import MIB, ResourceLimits
from batchrun.environments.tree_cursor import Moved, TreeCursor

#: The ``inspect --format`` template whose answer :func:`parse_layer` reads: the first process, the layer, and
#: the engine's files mounted into the container (a path is empty where the engine made no such file).
LAYER_FORMAT = "{{.State.Pid}}\t{{.GraphDriver.Data.UpperDir}}\t{{.HostsPath}}\t{{.HostnamePath}}\t{{.ResolvConfPath}}"
# How /proc's mount tables write a space, tab, newline or backslash in a path: an octal escape.
_MOUNTINFO_ESCAPE = re.compile(rb"\\([0-7]{3})")
# How long a killed container's processes may take to be gone before space is given back. No file is
# touched while one lives: it could be writing the file being truncated.
_DYING_SECONDS = 2.0
# Opens a file only to truncate it: never through a link, never waiting for a FIFO's reader.
_TRUNCATE_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def parse_layer(answer: str) -> tuple[int, Path, tuple[Path, ...]] | None:
    """(the first process's pid on this machine, the writable layer's directory, the engine's files mounted
    into the container) from an answer to LAYER_FORMAT; None where the layer cannot be watched from here:
    another storage driver, an engine on another machine or behind another user's permissions, or a pid
    that names another process here (a runner in a PID namespace of its own). The process is told to be
    the container's by its root: the kernel's table of its mounts shows an overlay at / whose upper
    directory is that layer (the runner may be in a mount namespace of its own, where the engine's mounts
    are not seen)."""
    fields = answer.strip().split("\t")
    if len(fields) < 2 or not fields[0].isdigit() or int(fields[0]) <= 0 or not fields[1].startswith("/"):
        return None
    pid, upper = int(fields[0]), Path(fields[1])
    files = tuple(Path(field) for field in fields[2:] if field.startswith("/"))
    try:
        if not os.path.isdir(upper) or not os.access(upper, os.R_OK | os.X_OK):
            return None
        mounts = kernel_files.read(f"/proc/{pid}/mountinfo")
    except (OSError, ValueError):
        return None
    return (pid, upper, files) if root_upper_dir(mounts) == os.fsencode(upper) else None


def root_upper_dir(mountinfo: bytes) -> bytes | None:
    """The upper directory of the overlay mounted at / in a /proc/PID/mountinfo table (the last mount
    there, which covers any before it), or None where / is not an overlay."""
    upper = None
    for line in mountinfo.splitlines():
        mount, separator, filesystem = line.partition(b" - ")
        fields, described = mount.split(b" "), filesystem.split(b" ")
        if not separator or len(fields) < 5 or fields[4] != b"/":
            continue
        upper = None
        if described[0] == b"overlay" and len(described) >= 3:
            for option in described[2].split(b","):
                if option.startswith(b"upperdir="):
                    upper = _MOUNTINFO_ESCAPE.sub(lambda code: bytes([int(code[1], 8)]), option[len(b"upperdir="):])
    return upper


class LayerWatch:
    """The watch over one container's writable layer, and the handle on its first process."""

    def __init__(self, directory: Path, first_pid: int, limits: ResourceLimits, files: tuple[Path, ...] = ()) -> None:
        self._first = -1
        self._namespace = ""
        #: Set when the watch killed the container's processes: it must be started again before use.
        self.killed = False
        self._giving_back: asyncio.Future[None] | None = None
        self.watch: WorkspaceWatch = guard_for(limits.disk_reserve_mb * MIB).watch(
            directory, limits.workspace_mb * MIB, self._kill, self.holders, files)
        try:
            self.restarted(first_pid)
        except OSError:
            self.close()
            raise

    def restarted(self, first_pid: int) -> None:
        """The container was started again (its first process is new). Where that process is gone
        already, OSError, and the watch holds no process until the next start: a closed descriptor's
        number, soon another's, must never be signalled."""
        previous, self._first = self._first, -1
        if previous >= 0:
            os.close(previous)
        self._first = os.pidfd_open(first_pid)
        self._namespace = os.readlink(f"/proc/{first_pid}/ns/pid")
        # The container's processes see its files on the overlay's own device, made anew by each start,
        # not on the layer's: the files they hold with no name left are found by it.
        self.watch.device = os.stat(f"/proc/{first_pid}/root").st_dev
        self.killed = False

    def _kill(self) -> None:
        """Called by the disk guard's task, which watches every container of the worker: never raises.
        Once the processes are gone, the space the layer's files hold past their ends is given back
        (see the module)."""
        self.killed = True
        if self._first < 0:
            return              # no process held (see restarted): none known to wait for before giving back
        try:
            signal.pidfd_send_signal(self._first, signal.SIGKILL)
        except OSError:
            pass                # already gone: a time-out's stop, or the engine
        if self._giving_back is None or self._giving_back.done():
            self._giving_back = asyncio.ensure_future(asyncio.to_thread(self._give_back))

    async def given_back(self) -> None:
        """Wait until a stop has given back what it could: before the container's next command or start,
        and before its processes' effect on the disk is judged."""
        if self._giving_back is not None:
            await self._giving_back

    def _give_back(self) -> None:
        deadline = time.monotonic() + _DYING_SECONDS
        while self.holders():
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        free_past_ends(self.watch.directory)
        for path in self.watch.files:
            free_past_end(path)

    def holders(self) -> list[int]:
        """Every process of the container's PID namespace: ``exec`` starts programs in it from outside,
        so they are not below its first process."""
        found = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    if os.readlink(f"/proc/{entry.name}/ns/pid") == self._namespace:
                        found.append(int(entry.name))
                except OSError:
                    continue
        return found

    def close(self) -> None:
        self.watch.close()
        if self._first >= 0:
            os.close(self._first)
            self._first = -1


def free_past_ends(root: Path) -> None:
    """Give back the space the files under ``root`` hold past their ends, keeping each byte and time of
    them. Goes by descriptors and follows no link (see TreeCursor); a file changed into anything but
    that regular file between the look and the open is left alone."""
    cursor = TreeCursor.at(root, stat.S_IRUSR | stat.S_IXUSR)
    if cursor is None:
        return
    with cursor:
        try:
            for name, info in cursor.entries():
                if stat.S_ISREG(info.st_mode) and _holds_past_end(info):
                    _truncate_to_length(cursor.fd, name, info)
        except Moved:
            return          # no process lives to move directories: nothing is left to do safely


def free_past_end(path: Path) -> None:
    """Give back the space one file of the engine's holds past its end, as free_past_ends does. The engine
    made it and its directory, which the container reaches only through the file's contents."""
    try:
        info = os.lstat(path)
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if stat.S_ISREG(info.st_mode) and _holds_past_end(info):
            _truncate_to_length(directory, path.name, info)
    finally:
        os.close(directory)


def _holds_past_end(info: os.stat_result) -> bool:
    """Whether the file has more blocks than its length needs (a preallocation past its end)."""
    blocks_needed = -(-info.st_size // info.st_blksize) * info.st_blksize
    return info.st_blocks * 512 > blocks_needed


def _truncate_to_length(directory: int, name: str, seen: os.stat_result) -> None:
    try:
        fd = os.open(name, _TRUNCATE_FLAGS, dir_fd=directory)
    except OSError:
        return
    try:
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and (info.st_dev, info.st_ino) == (seen.st_dev, seen.st_ino):
            os.ftruncate(fd, info.st_size)
            os.utime(fd, ns=(info.st_atime_ns, info.st_mtime_ns))
    except OSError:
        pass
    finally:
        os.close(fd)
