"""The merge: trajectories.jsonl brought up to date with every batch file, and counted on the way.

Apart from the scan because it writes: it keeps a record of where it stopped (``.merge.json``), so the
next merge reads and copies only what is new, and it copies kept rows without passing their bytes
through Python. Every row is read by rows.read_stored_row; a line that is JSON but not a row this
version understands stops the merge with a RunDirectoryError naming its file and line.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from batchrun import rows
from batchrun.registry import REGISTRY
from batchrun.run_dir.durable import atomic_write_json, replacing
from batchrun.run_dir.errors import write_failure_named
from batchrun.run_dir.reading import (
    FileRange,
    lines_at,
    read_processes,
    read_whole,
    reading_pool,
    record_json,
    refused_line,
    split_ranges,
)
from batchrun.run_dir.relocations import relocations_digest
from batchrun.run_dir.scan import FirstFinished
from batchrun.stats import MergeStatistics

TRAJECTORIES = "trajectories.jsonl"
MERGE_RECORD = ".merge.json"
# A record is only trusted by a merge with the same rules: the same registry decides what is corrupted,
# and the same form of the figures it carries.
MERGE_RECORD_FORMAT = f"4:{rows.ROW_FORMAT}:" + hashlib.sha256(" ".join(sorted(REGISTRY)).encode()).hexdigest()[:16]
MERGE_RECORD_TAIL_BYTES = 4096
MERGE_BUFFER_BYTES = 1 << 20

# A corrupted row as the merge reports it: batch file, prompt index, invented tools, content key.
OnCorrupted = Callable[[str, int, list[str], str], None]
# A line of a batch file: the file's name and where the line starts.
LinePlace = tuple[str, int]
# What a merge made: its figures, where each batch file was read to, the lines read that were no rows.
Merged = tuple[MergeStatistics, dict[str, int], list[LinePlace]]


def merge_batch_files(directory: Path, files: list[Path], on_corrupted: OnCorrupted, *,
                      per_prompt: bool = False, relocated: Mapping[str, int | None] | None = None,
                      repeats: Counter[str] | None = None) -> MergeStatistics:
    """Bring trajectories.jsonl up to date with these batch files, and count what it holds.

    Trajectory rows that call no invented tool are kept; tombstones, failures, corrupted rows
    (each passed to ``on_corrupted``), rows whose prompt is no longer in the dataset
    (StoredRow.placeless) and broken lines are left out. Batch files only grow, so when
    the record of the last merge still matches the files, only rows written since are read and
    appended; otherwise the whole file is rewritten (a big directory shared out over one process per
    core) and atomically replaced. ``per_prompt``: count each prompt's completed samples too
    (MergeStatistics.prompt_samples); once counted, a run goes on counting them. ``relocated``: where
    prompts are now whose rows name another place (see relocations.py); a merge done under other places
    is done again.

    Of a unit's rows, the one kept is the one resume counted done: failures and corrupted rows are left
    out, and so are the finished rows after a unit's first (a row appended twice), which the resume scan
    found (``repeats``: see ScanResult.repeats; None where no scan ran, and the record is trusted). A
    record made under other repeats is not appended to, since a row repeated since would be copied as a
    new one: the merge is done again, keeping each unit's first finished row.
    """
    relocated = relocated or {}
    digest = relocations_digest(relocated)
    previous = _read_merge_record(directory, files, digest)
    if previous is not None and per_prompt and previous.statistics.prompt_samples is None:
        previous = None     # the figures so far lack them: count everything again
    repeated_rows = None if repeats is None else sum(repeats.values())
    if previous is not None and repeated_rows is not None and previous.repeated_rows != repeated_rows:
        previous = None
    if previous is None:
        statistics, ends, unreadable = _rewrite_trajectories(directory, files, on_corrupted, per_prompt, relocated,
                                                             frozenset(repeats or ()))
    else:
        statistics, ends, unreadable = _append_to_trajectories(directory, files, previous, on_corrupted, relocated)
    statistics.batch_files = len(files)
    _write_merge_record(directory, statistics, ends, digest, unreadable,
                        previous.repeated_rows if previous is not None else repeated_rows or 0)
    return statistics


def forget_merge_over_damage(directory: Path, unreadable: list[LinePlace]) -> None:
    """Make the next merge read everything when a line it already read is no row now (``unreadable``:
    what a scan of the batch files found): a row damaged in place, its file's length kept, passes the
    record's checks of where each file ended, and the row its prompt gets again would be merged beside
    the copy merged before."""
    if not unreadable:
        return
    try:
        data = record_json(read_whole(directory / MERGE_RECORD))
        merged_to = {name: int(end) for name, (end, _) in data["files"].items()}
        known = {(name, int(offset)) for name, offset in data.get("unreadable", [])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return      # no record, or one the merge will not use
    if any(offset < merged_to.get(name, 0) and (name, offset) not in known for name, offset in unreadable):
        (directory / MERGE_RECORD).unlink(missing_ok=True)


@dataclass
class MergeRecord:
    """What the last merge read and wrote: where to go on from, and its figures so far."""

    trajectories_bytes: int
    offsets: dict[str, int]
    statistics: MergeStatistics
    unreadable: list[LinePlace]     # the lines it read that were no rows (see forget_merge_over_damage)
    repeated_rows: int              # what the scan found when it was made (see merge_batch_files)


@dataclass
class MergePart:
    """What one process found in its byte ranges of the batch files."""

    statistics: MergeStatistics = field(default_factory=MergeStatistics)
    kept: list[FileRange | bytes] = field(default_factory=list)   # kept rows, adjacent ones joined
    kept_bytes: int = 0
    ends: dict[str, int] = field(default_factory=dict)        # per file: the end of its last complete line
    unreadable: list[LinePlace] = field(default_factory=list)

    def keep(self, path: Path, offset: int, line: bytes, row: rows.StoredRow) -> None:
        if not row.is_verbatim:                # an earlier format, or relocated: merged upgraded
            line = row.upgraded()
            self.kept.append(line)
        elif self.kept and isinstance(self.kept[-1], tuple) and self.kept[-1][0] == path \
                and self.kept[-1][2] == offset:
            self.kept[-1] = (path, self.kept[-1][1], offset + len(line))
        else:
            self.kept.append((path, offset, offset + len(line)))
        self.kept_bytes += len(line)


def _rewrite_trajectories(directory: Path, files: list[Path], on_corrupted: OnCorrupted, per_prompt: bool,
                          relocated: Mapping[str, int | None], repeated: frozenset[str]) -> Merged:
    # Which of a unit's finished rows comes first takes reading them in order: one process where any
    # repeats (rare: an edit by hand), so no part of the rows needs what another found.
    groups = split_ranges(files, 1 if repeated else read_processes(files))
    target = directory / TRAJECTORIES
    if len(groups) == 1:
        parts = [read_merge_part(groups[0], per_prompt, relocated, repeated)]
        with replacing(target, needed=parts[0].kept_bytes) as out:
            copy_kept_rows(out.fileno(), 0, parts[0].kept)
    else:
        with reading_pool(len(groups)) as pool:
            parts = list(pool.map(read_merge_part, groups, [per_prompt] * len(groups), [relocated] * len(groups)))
            starts = [sum(part.kept_bytes for part in parts[:index]) for index in range(len(parts))]
            with replacing(target, needed=sum(part.kept_bytes for part in parts)) as out:
                # Each process copies its rows into place; the kernel moves the bytes.
                list(pool.map(_copy_into, [Path(out.name)] * len(parts), starts, [part.kept for part in parts]))
    return _combined(parts, {}, [], MergeStatistics(prompt_samples=Counter() if per_prompt else None), on_corrupted)


def _append_to_trajectories(directory: Path, files: list[Path], previous: MergeRecord, on_corrupted: OnCorrupted,
                            relocated: Mapping[str, int | None]) -> Merged:
    part = read_merge_part([(path, previous.offsets.get(path.name, 0), path.stat().st_size) for path in files],
                           previous.statistics.prompt_samples is not None, relocated)
    path = directory / TRAJECTORIES
    with write_failure_named(path, part.kept_bytes), path.open("r+b") as out:
        # A merge that crashed after appending left rows past the recorded size: they go, and
        # their batch lines are read again.
        out.truncate(previous.trajectories_bytes)
        try:
            copy_kept_rows(out.fileno(), previous.trajectories_bytes, part.kept)
            os.fsync(out.fileno())
        except OSError:     # what was merged before stays whole, without a half row after it
            out.truncate(previous.trajectories_bytes)
            raise
    return _combined([part], previous.offsets, previous.unreadable, previous.statistics, on_corrupted)


def _read_merge_record(directory: Path, files: list[Path], relocations: str) -> MergeRecord | None:
    """The last merge's record, if trajectories.jsonl and every batch file it read are still
    what it left (same tail bytes at the recorded sizes) and it placed rows as ``relocations`` (a
    relocations_digest) does; None means: rewrite everything."""
    try:
        data = record_json(read_whole(directory / MERGE_RECORD))
        if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
            return None
        if data.get("format") != MERGE_RECORD_FORMAT or data.get("relocations", "") != relocations:
            return None
        names = {path.name for path in files}
        if not set(data["files"]) <= names:       # a batch file that was merged is gone
            return None
        trajectories_bytes = data["trajectories"][0]
        if not _has_tail(directory / TRAJECTORIES, *data["trajectories"]):
            return None
        offsets = {}
        for name, (offset, tail) in data["files"].items():
            if not _has_tail(directory / name, offset, tail):
                return None
            offsets[name] = offset
        unreadable = [(str(name), int(offset)) for name, offset in data.get("unreadable", [])]
        repeated_rows = int(data.get("repeated_rows", 0))     # a record from before repeats were left out
        return MergeRecord(trajectories_bytes, offsets, MergeStatistics.from_state(data["statistics"]), unreadable,
                           repeated_rows)
    except (OSError, ValueError, KeyError, TypeError, IndexError):    # damaged: only a shortcut is lost
        return None


def _write_merge_record(directory: Path, statistics: MergeStatistics, ends: dict[str, int],
                        relocations: str, unreadable: list[LinePlace], repeated_rows: int) -> None:
    size = (directory / TRAJECTORIES).stat().st_size
    atomic_write_json(directory / MERGE_RECORD, {
        "format": MERGE_RECORD_FORMAT,
        "relocations": relocations,
        "trajectories": [size, _tail_digest(directory / TRAJECTORIES, size)],
        "files": {name: [end, _tail_digest(directory / name, end)] for name, end in ends.items()},
        "statistics": statistics.to_state(),
        "unreadable": unreadable,
        "repeated_rows": repeated_rows,
    })


def read_merge_part(ranges: list[FileRange], per_prompt: bool = False,
                    relocated: Mapping[str, int | None] | None = None,
                    repeated: Collection[str] = frozenset()) -> MergePart:
    """Classify and count the rows that begin in these byte ranges, each at its prompt's place now
    (see merge_batch_files); of the units ``repeated``, the rows after each one's first finished row
    are not rows at all."""
    part = MergePart(MergeStatistics(prompt_samples=Counter() if per_prompt else None))
    statistics = part.statistics
    first_finished = FirstFinished(among=repeated)
    for path, start, end in ranges:
        for offset, line in lines_at(path, start, end):
            part.ends[path.name] = offset + len(line)
            try:
                row = rows.read_stored_row(line)
            except rows.RowError as exc:
                raise refused_line(path, offset, exc) from None
            if row is None:
                part.unreadable.append((path.name, offset))
                continue
            if repeated and first_finished.is_repeat(row):
                continue
            if relocated:
                row.relocate(relocated)
                if row.placeless:
                    statistics.on_placeless(row)
                    continue
            if row.status in (rows.FAILED, rows.DISCARDED):
                statistics.on_row(row)
                continue
            invented = row.invented_tools()
            if invented:
                statistics.on_corrupted(path.name, row, rows.noted_invented_tools(invented))
                continue
            statistics.on_row(row)
            part.keep(path, offset, line, row)
    return part


def _combined(parts: list[MergePart], offsets: dict[str, int], unreadable: list[LinePlace],
              statistics: MergeStatistics, on_corrupted: OnCorrupted) -> Merged:
    """The parts' figures added to ``statistics``, where each batch file has been read to, and the
    lines read that were no rows."""
    ends, unreadable = dict(offsets), list(unreadable)
    for part in parts:
        statistics.add(part.statistics)
        for corrupted in part.statistics.corrupted:
            on_corrupted(corrupted.batch_file, corrupted.prompt_index, corrupted.invented, corrupted.key)
        for name, end in part.ends.items():
            ends[name] = max(ends.get(name, 0), end)
        unreadable += part.unreadable
    return statistics, ends, unreadable


def copy_kept_rows(out: int, position: int, kept: list[FileRange | bytes]) -> None:
    """Copy byte ranges of batch files to ``out`` from ``position`` on, without passing the bytes
    through Python (copy_file_range; plain reads and writes where a filesystem refuses it); rows
    given as bytes are written as they are."""
    for entry in kept:
        if isinstance(entry, bytes):
            position += _write_all(out, entry, position)
            continue
        path, start, end = entry
        with path.open("rb") as source:
            while start < end:
                try:
                    copied = os.copy_file_range(source.fileno(), out, end - start, start, position)
                except OSError as exc:
                    if exc.errno not in (errno.ENOSYS, errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP):
                        raise
                    copied = os.pwrite(out, os.pread(source.fileno(), min(end - start, MERGE_BUFFER_BYTES), start),
                                       position)
                if copied == 0:
                    raise OSError(f"{path} ended while it was being merged")
                start += copied
                position += copied


def _write_all(out: int, data: bytes, position: int) -> int:
    written = 0
    while written < len(data):
        written += os.pwrite(out, data[written:], position + written)
    return written


def _copy_into(path: Path, position: int, kept: list[FileRange | bytes]) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        copy_kept_rows(fd, position, kept)
    finally:
        os.close(fd)


def _tail_digest(path: Path, size: int) -> str:
    """A fingerprint of the bytes just before ``size``: enough to tell an appended-to file from a
    rewritten one."""
    with path.open("rb") as handle:
        handle.seek(max(0, size - MERGE_RECORD_TAIL_BYTES))
        tail = handle.read(min(size, MERGE_RECORD_TAIL_BYTES))
    return hashlib.sha256(tail).hexdigest()


def _has_tail(path: Path, size: int, digest: str) -> bool:
    try:
        return path.stat().st_size >= size and _tail_digest(path, size) == digest
    except OSError:
        return False
