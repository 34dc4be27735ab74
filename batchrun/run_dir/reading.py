"""Streaming the run directory's JSONL files: their lines, in byte ranges that separate processes can
share, and a bad line named by its number.

Every read of a batch file goes through here, so the resume scan and the merge take linear time and
memory bounded by the number of distinct prompts, not of rows; a big directory is shared out over
one forked process per core.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from batchrun import rows
from batchrun.run_dir.errors import RunDirectoryError

READ_BUFFER_BYTES = 1 << 20
# Below this much data a resume scan or a merge is over before helper processes would have started.
PARALLEL_READ_MIN_BYTES = 64 << 20
MAX_READ_PROCESSES = 8

FileRange = tuple[Path, int, int]


def lines_at(path: Path, start: int = 0, end: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of each line of a JSONL file, without a last line still being written or cut
    short by a crash (it has no newline).

    With ``start``/``end``, only the lines that begin in that byte range: ranges that tile a file
    yield each of its lines exactly once, so separate processes can share one file.
    """
    with path.open("rb", buffering=READ_BUFFER_BYTES) as handle:
        if start:
            handle.seek(start - 1)
            position = start - 1 + len(handle.readline())   # the line holding start-1 is not ours
        else:
            position = 0
        for line in handle:   # rows are kilobytes long: a small buffer costs several reads per line
            if end is not None and position >= end:
                return
            if line.endswith(b"\n"):
                yield position, line
            position += len(line)


def refused_line(path: Path, offset: int, error: rows.RowError) -> RunDirectoryError:
    return RunDirectoryError(f"{path} line {line_number(path, offset)}: {error}. Stopped here rather than run "
                             "that prompt again or leave it out of trajectories.jsonl.")


def line_number(path: Path, offset: int) -> int:
    """The 1-based number of the line that starts at byte ``offset`` (read only to name a bad line)."""
    newlines = 0
    with path.open("rb") as handle:
        while offset > 0:
            chunk = handle.read(min(offset, READ_BUFFER_BYTES))
            if not chunk:
                break
            newlines += chunk.count(b"\n")
            offset -= len(chunk)
    return newlines + 1


def read_processes(files: list[Path]) -> int:
    """How many processes share the reading of these files: one per core once they are big."""
    if sum(path.stat().st_size for path in files) < PARALLEL_READ_MIN_BYTES:
        return 1
    return min(os.cpu_count() or 1, MAX_READ_PROCESSES)


def reading_pool(processes: int) -> ProcessPoolExecutor:
    # Forked, so the helpers need no imports and start in milliseconds.
    return ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork"))


def split_ranges(files: list[Path], parts: int) -> list[list[FileRange]]:
    """The files' bytes cut into ``parts`` groups of about equal size (a big file is shared)."""
    sizes = [(path, path.stat().st_size) for path in files]
    share = -(-sum(size for _, size in sizes) // parts) or 1
    groups: list[list[FileRange]] = [[]]
    room = share
    for path, size in sizes:
        start = 0
        while start < size:
            if room == 0:
                groups.append([])
                room = share
            end = min(size, start + room)
            groups[-1].append((path, start, end))
            room -= end - start
            start = end
    return groups
