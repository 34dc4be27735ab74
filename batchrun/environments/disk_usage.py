"""How much disk a workspace takes: a walk of its tree that can pause and go on later."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

# Entries of the workspace walked on the event loop after a command (a few hundred microseconds).
INLINE_WALK_ENTRIES = 200


class DiskUsageWalk:
    """Whether the files under ``root`` take more than ``limit_bytes`` of disk (blocks, so a sparse
    file counts what it really uses). Links are not followed; the walk stops once over. It can pause
    after some entries and go on later (in a thread) where it left off."""

    def __init__(self, root: Path, limit_bytes: int) -> None:
        self._limit = limit_bytes
        self.used = 0       # bytes counted so far (all of them once run() returns False)
        self._pending = [str(root)]
        self._directory: Iterator[os.DirEntry[str]] | None = None      # being read

    def run(self, max_entries: int | None = None) -> bool | None:
        """True once over the limit, False when all is walked, None after ``max_entries`` entries."""
        seen = 0
        while True:
            if self._directory is None:
                if not self._pending:
                    return False
                try:
                    self._directory = os.scandir(self._pending.pop())
                except OSError:
                    continue
            for entry in self._directory:
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                self.used += info.st_blocks * 512
                if self.used > self._limit:
                    self._close()
                    return True
                if stat.S_ISDIR(info.st_mode):
                    self._pending.append(entry.path)
                seen += 1
                if max_entries is not None and seen >= max_entries:
                    return None
            self._close()

    def _close(self) -> None:
        if self._directory is not None:
            self._directory.close()       # type: ignore[attr-defined]  # a scandir iterator
            self._directory = None



def disk_usage(root: Path) -> int:
    """The bytes of disk the files under ``root`` take (blocks: a sparse file counts what it uses)."""
    walk = DiskUsageWalk(root, 1 << 62)
    walk.run()
    return walk.used
