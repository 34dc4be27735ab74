"""Streaming the run directory's JSONL files: their lines, in byte ranges that separate processes can
share, and a bad line named by its number.

Every read of a batch file goes through here, so the resume scan and the merge take linear time and
memory bounded by the number of distinct prompts, not of rows; a big directory is shared out over
one forked process per core.
"""

from __future__ import annotations

import ctypes
import errno
import json
import multiprocessing
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from batchrun import rows
from batchrun.paths import NotRegularFile, open_regular
from batchrun.run_dir.errors import RunDirectoryError, cannot_read, not_a_regular_file

READ_BUFFER_BYTES = 1 << 20
# Below this much data a resume scan or a merge is over before helper processes would have started.
PARALLEL_READ_MIN_BYTES = 64 << 20
MAX_READ_PROCESSES = 8
PR_SET_PDEATHSIG = 1

FileRange = tuple[Path, int, int]


def lines_at(path: Path, start: int = 0, end: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of each line of a JSONL file, without a last line still being written or cut
    short by a crash (it has no newline).

    With ``start``/``end``, only the lines that begin in that byte range: ranges that tile a file
    yield each of its lines exactly once, so separate processes can share one file. A file this user may
    not read, one no longer a regular file, or a read the disk fails (EIO) is a RunDirectoryError that says
    so: every reader (resume, merge, report, export) words it alike, and none takes a failing read for a
    failure of what it was writing meanwhile. A file gone is FileNotFoundError, which some readers expect.
    """
    try:
        yield from _lines_between(path, start, end)
    except OSError as exc:
        if exc.errno != errno.EIO:
            raise
        raise cannot_read(str(path), exc) from None


def _lines_between(path: Path, start: int, end: int | None) -> Iterator[tuple[int, bytes]]:
    with _opened(path) as handle:
        # A line without a newline may be any size (damage, or a row cut short): never read into it.
        complete = _end_of_last_newline(handle, start)
        end = complete if end is None else min(end, complete)
        if start >= end:
            return
        if start:
            handle.seek(start - 1)
            position = start - 1 + len(handle.readline())   # the line holding start-1 is not ours
        else:
            position = 0
        while position < end:   # rows are kilobytes long: a small buffer costs several reads per line
            line = handle.readline()
            if not line.endswith(b"\n"):   # the file was cut shorter while being read
                return
            yield position, line
            position += len(line)


def _end_of_last_newline(handle: BinaryIO, start: int) -> int:
    """Where the file's last newline at or after ``start`` ends, or ``start`` if it has none there.

    Read backwards, one byte first (a batch file nearly always ends with its newline), then in
    bounded chunks; leaves the file at its start."""
    position = handle.seek(0, os.SEEK_END)
    step = 1
    while position > start:
        chunk_start = max(start, position - step)
        handle.seek(chunk_start)
        newline = handle.read(position - chunk_start).rfind(b"\n")
        if newline >= 0:
            position = chunk_start + newline + 1
            break
        position, step = chunk_start, READ_BUFFER_BYTES
    handle.seek(0)
    return max(position, start)


def _opened(path: Path) -> BinaryIO:
    """A JSONL file of the run directory opened to read. It was listed by stat, and another program may have
    put something else in its place since: a FIFO is refused rather than waited on for a writer (see
    open_regular); a file this user may not read is a RunDirectoryError that says so."""
    try:
        descriptor = open_regular(path)
    except NotRegularFile:
        raise not_a_regular_file(path, "the run writes it") from None
    except PermissionError as exc:
        raise cannot_read(str(path), exc) from None
    return open(descriptor, "rb", buffering=READ_BUFFER_BYTES)


def read_whole(path: Path) -> bytes:
    """The whole of a small file of the run directory (a record, the checkpoint). The start's checks cannot
    see what another program puts in its place while the run goes on: a FIFO is opened without waiting for a
    writer (O_NONBLOCK), and it or a device is refused in one line rather than waited on or read for ever.
    OSError as open() raises it."""
    try:
        descriptor = open_regular(path)
    except NotRegularFile:
        raise not_a_regular_file(path, "the run writes it") from None
    with open(descriptor, "rb") as handle:
        return handle.read()


def record_json(data: bytes | str) -> Any:
    """The JSON of a record of the run directory, or a line of one. JSON nested deeper than Python reads is
    a ValueError like any other damage, so that each reader does with it what it does with damage (writes
    the record anew, counts nothing for the line, says what to do) instead of ending in a RecursionError."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None


def refused_line(path: Path, offset: int, error: rows.RowError) -> RunDirectoryError:
    return RunDirectoryError(f"{path} line {line_number(path, offset)}: {error}. Stopped here rather than run "
                             "that prompt again or leave it out of trajectories.jsonl.")


def line_number(path: Path, offset: int) -> int:
    """The 1-based number of the line that starts at byte ``offset`` (read only to name a bad line)."""
    newlines = 0
    with _opened(path) as handle:
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
    """Forked, so the helpers need no imports and start in milliseconds; each dies with the process that
    made it. Killed (kill -9, the OOM killer, a scheduler's preemption), that process left them waiting
    on their pipes for ever, each holding what it had read."""
    return ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork"),
                               initializer=_die_with, initargs=(os.getpid(),))


def _die_with(parent: int) -> None:
    """Ask the kernel for SIGKILL when ``parent`` (the thread that forked this process) ends, unless it
    has ended already. Where it cannot be asked (no prctl, or a system-call filter refuses it), the
    helper reads as it did before, outliving a parent killed outright."""
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is not None and prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0 and os.getppid() != parent:
        os._exit(1)


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
