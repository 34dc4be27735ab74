"""How much disk a workspace takes: a walk of its tree that can pause and go on later."""

from __future__ import annotations

import os
import stat
from collections.abc import Generator
from pathlib import Path

from batchrun.environments.tree_cursor import Moved, TreeCursor

# Entries of the workspace walked on the event loop after a command (a few hundred microseconds).
INLINE_WALK_ENTRIES = 200


class DiskUsageWalk:
    """Whether the files under ``root`` take more than ``limit_bytes`` of disk (blocks, so a sparse
    file counts what it really uses, and at least ``least_per_file`` for each entry: an empty file takes
    an inode, which a disk with a fixed number of them runs out of). It stops once over, and can pause
    after some entries and go on later (in a thread) where it left off.

    Nothing a command does hides files from it: it goes by descriptors (``TreeCursor``), so a tree
    deeper than PATH_MAX is walked to its end, and a directory the runner's own user may not read is
    made readable to it (the workspace is the prompt's; root reads it as it is). It follows no link."""

    def __init__(self, root: Path, limit_bytes: int, least_per_file: int = 0) -> None:
        self._root = root
        self._limit = limit_bytes
        self._least_per_file = least_per_file
        self.used = 0       # bytes counted so far (all of them once run() returns False)
        self._cursor: TreeCursor | None = None
        self._entries: Generator[tuple[str, os.stat_result], None, None] | None = None
        self._restarts = 0
        self._answer: bool | None = None

    def run(self, max_entries: int | None = None) -> bool | None:
        """True once over the limit, False when all is walked, None after ``max_entries`` entries."""
        if self._answer is not None:
            return self._answer
        if self._cursor is None:
            self._cursor = TreeCursor.at(self._root, stat.S_IRUSR | stat.S_IXUSR)
            if self._cursor is None:
                return self._finish(False)
            self._entries = self._cursor.entries()
        while True:
            try:
                return self._count(max_entries)
            except Moved:
                # Only a process moving directories while the walk runs gets here: past a few times,
                # what it may be hiding counts as over.
                if self._restarts == _WALK_RESTARTS:
                    return self._finish(True)
                self._restarts += 1
                self.used = 0
                self._cursor.restart()
                self._entries = self._cursor.entries()

    def _count(self, max_entries: int | None) -> bool | None:
        seen = 0
        for _, info in self._entries or ():
            self.used += max(info.st_blocks * 512, self._least_per_file)
            if self.used > self._limit:
                return self._finish(True)
            seen += 1
            if max_entries is not None and seen >= max_entries:
                return None
        return self._finish(False)

    def _finish(self, over: bool) -> bool:
        if self._entries is not None:
            self._entries.close()       # its directory's listing
        if self._cursor is not None:
            self._cursor.close()
        self._answer = over
        return over


# Times the workspace walk starts again because a directory moved under it, before it gives up.
_WALK_RESTARTS = 8


def disk_usage(root: Path, least_per_file: int = 0) -> int:
    """The bytes of disk the files under ``root`` take (blocks: a sparse file counts what it uses; each
    at least ``least_per_file``); a tree that kept moving under the walk counts as full."""
    walk = DiskUsageWalk(root, FULL, least_per_file)
    return FULL if walk.run() else walk.used


#: What disk_usage answers for a tree it could not walk to the end.
FULL = 1 << 62


# Descriptors and mappings of a prompt's processes looked at per count; a prompt holding more cannot be
# checked in time, and counts as full, as a walk that gives up does.
MAX_HELD_ENTRIES = 100_000


def unnamed_usage(pids: list[int], device: int) -> int | None:
    """Disk on ``device`` taken by files with no name left (deleted while open, or made by O_TMPFILE)
    that the processes ``pids`` hold open or mapped: no walk of the workspace sees them, and the prompt
    keeps their space for as long as it holds them. None if they hold more than MAX_HELD_ENTRIES
    descriptors and mappings. Only what the kernel marks deleted is looked at more closely."""
    seen: set[int] = set()
    used = entries = 0
    for pid in pids:
        held = _deleted_held(pid)
        if held is None:
            continue
        count, paths = held
        entries += count
        if entries > MAX_HELD_ENTRIES:
            return None
        for path in paths:
            try:
                info = os.stat(path)
            except OSError:
                continue
            if (info.st_nlink == 0 and info.st_dev == device and stat.S_ISREG(info.st_mode)
                    and info.st_ino not in seen):
                seen.add(info.st_ino)
                used += info.st_blocks * 512
    return used


def _deleted_held(pid: int) -> tuple[int, list[str]] | None:
    """(descriptors and mappings of process ``pid``, /proc paths of those whose file is deleted); None
    for a process that is gone."""
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
        with open(f"/proc/{pid}/maps", "rb") as maps:
            mappings = maps.read().splitlines()
    except OSError:
        return None
    paths = []
    for name in descriptors:
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}").endswith(" (deleted)"):
                paths.append(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
    for line in mappings:
        if line.endswith(b" (deleted)"):
            paths.append(f"/proc/{pid}/map_files/{line.split(maxsplit=1)[0].decode()}")
    return len(descriptors) + len(mappings), paths
