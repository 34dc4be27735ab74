"""The run directory: durable appends, atomic checkpoint, resume scan, merge, lock.

Only the parent process writes these files. Every read streams line by line, so the resume scan and
the merge take linear time and memory bounded by the number of distinct prompts, not of rows; the
merge also remembers where it stopped (``.merge.json``), so the next one reads only what is new.
Every row is read by :func:`rows.read_stored_row`; a line that is JSON but not a row this version
understands stops the scan or the merge with a RunDirectoryError naming its file and line.

A write that fails (a full disk above all) leaves every file as it was: rows are appended whole or
not at all, and a file that is rewritten (checkpoint, statistics, the merged file and its record,
the report) is written beside itself under a name of its own and renamed over the old one only once
it is complete and durable.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import multiprocessing
import os
import re
import secrets
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO

from batchrun import rows
from batchrun.messages import Finished, Spent
from batchrun.registry import REGISTRY
from batchrun.stats import USAGE_KEYS, MergeStatistics, add_usage, empty_usage

BATCH_FILE = re.compile(r"^batch_(\d+)\.jsonl$")
TRAJECTORIES = "trajectories.jsonl"
CHECKPOINT = "checkpoint.json"
STATISTICS = "statistics.json"
ESTIMATE = "estimate.json"
LOCK = ".lock"
SPENT = "spent.jsonl"
MERGE_RECORD = ".merge.json"
# A record is only trusted by a merge with the same rules: the same registry decides what is corrupted,
# and the same form of the figures it carries.
MERGE_RECORD_FORMAT = f"3:{rows.ROW_FORMAT}:" + hashlib.sha256(" ".join(sorted(REGISTRY)).encode()).hexdigest()[:16]
MERGE_RECORD_TAIL_BYTES = 4096
MERGE_BUFFER_BYTES = 1 << 20
READ_BUFFER_BYTES = 1 << 20
# Below this much data a resume scan or a merge is over before helper processes would have started.
PARALLEL_READ_MIN_BYTES = 64 << 20
MAX_READ_PROCESSES = 8


class RunDirectoryError(Exception):
    """The run directory cannot be used as asked (locked, holds results without --resume, or holds a
    line that is not a row this version understands)."""


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


class DiskFull(RunDirectoryError):
    """A write found no room on its filesystem (ENOSPC, or the user's quota: EDQUOT). The message
    says which file, the filesystem that holds it, what is free there and what the write needed."""

    def __init__(self, path: Path, needed: int) -> None:
        self.path, self.needed = path, needed
        mount, kind = filesystem_of(path)
        usage = os.statvfs(mount)
        free, total = usage.f_bavail * usage.f_frsize, usage.f_blocks * usage.f_frsize
        wanted = f"writing it needs about {size_text(needed)}, and " if needed else ""
        super().__init__(f"no space left on the disk for {path}: {wanted}the filesystem that holds it ({kind} at "
                         f"{mount}) has {size_text(free)} free of {size_text(total)}")


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


@contextmanager
def full_disk_named(path: Path, needed: int = 0) -> Iterator[None]:
    """A full disk met inside the block becomes DiskFull for ``path`` (see DiskFull)."""
    try:
        yield
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFull(path, needed) from exc
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


def temp_beside(path: Path) -> Path:
    """A temporary name beside ``path`` that no other writer uses: two processes may rewrite one file
    at once (the run's report process and ``--report``), and each must rename its own whole file."""
    return path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


@contextmanager
def replacing(path: Path, *, needed: int = 0, durable: bool = True) -> Iterator[IO[bytes]]:
    """A new version of ``path``: written to a temporary file beside it, made durable (unless
    ``durable`` is False), and renamed over the old one when the block ends. If anything fails on the
    way, the temporary file is removed and ``path`` keeps its old content; a full disk raises
    DiskFull (``needed``: the size of the new version, where known)."""
    temp = temp_beside(path)
    with full_disk_named(path, needed):
        try:
            with temp.open("xb") as handle:
                yield handle
                handle.flush()
                if durable:
                    os.fsync(handle.fileno())
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
    if durable:
        _fsync_dir(path.parent)


def atomic_write_json(path: Path, data: dict, *, indent: int | None = None) -> None:
    """A reader (or a crash, or a full disk) sees the old file or the new one, never half."""
    encoded = json.dumps(data, ensure_ascii=False, indent=indent).encode("utf-8")
    with replacing(path, needed=len(encoded)) as handle:
        handle.write(encoded)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


@dataclass
class Checkpoint:
    """checkpoint.json, the same size however long the run: prompts done as a count, and rows per
    outcome. Resume finds done prompts, and counts rows per outcome, in the batch files, never here
    (rows written after the last checkpoint, before a kill, are there only); it reads the arguments
    here, to warn when they changed."""

    run_name: str
    dataset_file: str
    distribution: str
    model: str
    batch_size: int
    total_prompts: int
    completed_samples: int          # samples done (completed, partial or discarded), every invocation
    batch_stats: Counter            # rows written per outcome (completed, partial, failed, discarded)
    # Per sample key, how many of its corrupted rows a --rerun_corrupted resume has replaced: those
    # are attempts, like failure rows, and no longer count as done or as filtered_corrupted.
    superseded_corrupted: Counter = field(default_factory=Counter)
    samples_per_prompt: int = 1
    total_samples: int = 0

    def as_json(self) -> dict:
        # With one sample per prompt, samples are prompts and the file keeps the keys it always had.
        done = ({"completed_prompts": self.completed_samples} if self.samples_per_prompt == 1 else
                {"samples_per_prompt": self.samples_per_prompt, "total_samples": self.total_samples,
                 "completed_samples": self.completed_samples})
        return {"run_name": self.run_name, "dataset_file": self.dataset_file, "distribution": self.distribution,
                "model": self.model, "batch_size": self.batch_size, "total_prompts": self.total_prompts,
                **done, "batch_stats": dict(self.batch_stats),
                "superseded_corrupted": dict(self.superseded_corrupted),
                "last_updated": datetime.now().isoformat(timespec="seconds")}


def superseded_corrupted(checkpoint: dict) -> Counter:
    """The checkpoint's superseded corrupted rows per sample key (none in an older checkpoint)."""
    recorded = checkpoint.get("superseded_corrupted")
    return Counter({key: count for key, count in recorded.items() if isinstance(key, str) and isinstance(count, int)}
                   if isinstance(recorded, dict) else {})


@dataclass
class ScanResult:
    """What earlier runs left: finished rows per sample key (rows.sample_key), and what counts as done."""

    done_counts: Counter = field(default_factory=Counter)        # corrupted rows not included
    rows_by_status: Counter = field(default_factory=Counter)
    corrupted_by_key: Counter = field(default_factory=Counter)   # corrupted rows, ever, per sample key
    unreadable_lines: int = 0
    usage: dict = field(default_factory=empty_usage)             # of every row
    most_samples: int = 1                                        # the highest sample index of a row, plus one

    def add(self, other: ScanResult) -> None:
        add_usage(self.usage, other.usage)
        self.most_samples = max(self.most_samples, other.most_samples)
        self.done_counts.update(other.done_counts)
        self.rows_by_status.update(other.rows_by_status)
        self.corrupted_by_key.update(other.corrupted_by_key)
        self.unreadable_lines += other.unreadable_lines

    def live_corrupted(self, superseded: Counter) -> Counter:
        """Corrupted rows per key that no later attempt replaced (``superseded``: see Checkpoint)."""
        return +Counter({key: count - superseded[key] for key, count in self.corrupted_by_key.items()})

    def done(self, *, rerun_corrupted: bool, superseded: Counter) -> Counter:
        """Finished rows per sample key: a live corrupted row is done unless the user asked to run
        it again; a superseded one never is (its prompt's later attempt is what counts)."""
        if rerun_corrupted:
            return Counter(self.done_counts)
        return self.done_counts + self.live_corrupted(superseded)


@dataclass(frozen=True)
class RowPlace:
    """Where a row is about to be appended: its task's unit (see messages.Task), the usage it carries,
    its batch file (a name in the run directory), the byte range it will take there, and the sample
    it is (which the row there must be)."""

    unit: int
    usage: dict
    batch_file: str
    offset: int
    length: int
    prompt_index: int
    sample_index: int


class SpentLedger:
    """spent.jsonl: what sessions spent, reply by reply, until their rows carry it.

    A row holds its session's whole usage, but a session cut off (kill -9, a stop, a worker that
    died) leaves none, and its replies were paid for all the same. The parent appends a line per
    reply (``{"prompt": unit, "spent": usage}``, the task's unit: see messages.Task); what a task spent
    beyond its row, or without one, was spent by a session cut off. A group of rows is announced before it
    is appended, each with where it will be (``{"prompt": unit, "row": usage, "at": [batch file, offset,
    length, prompt index, sample index]}``), and made durable
    with the replies so far; once the rows are appended one line lists those that were
    (``{"landed": [i, ...]}``). So a kill at any point leaves no row whose spending counts twice: rows
    announced with no such line after them (the last group before a kill) count as written only if
    the batch file holds them where announced. Replies alone are not synced (a killed runner's writes
    stay in the kernel's cache). Each invocation starts by folding the file into one line,
    ``{"carried": usage}``, so it stays small however long the run; spending cut off before any row
    was written counts too, with or without --resume.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._carried = empty_usage()            # cut off in earlier invocations
        self._cut_off = empty_usage()            # prompts of this invocation that spent beyond their rows
        self._open: dict[int, dict] = {}         # task unit -> spent so far, no row yet
        self._open_total = empty_usage()
        self._fd: int | None = None

    def start(self) -> None:
        """Take in what earlier invocations left, as one line."""
        if self.path.exists():
            announced: list[RowPlace] = []     # rows announced since the last "landed" line
            for _, line in lines_at(self.path):
                try:
                    record = json.loads(line)
                    if "row" in record:
                        announced.append(_announced(record))
                    elif "landed" in record:
                        landed = set(record["landed"])
                        for place in announced:
                            if place.unit in landed:
                                self._take_row(place)
                        announced = []
                    else:
                        self._take(record)
                except (ValueError, TypeError, KeyError, AttributeError):
                    continue     # not a line this version wrote: it counts nothing
            for place in announced:
                if self._holds(place):
                    self._take_row(place)
            self._carried = self.unfinished()
            self._cut_off, self._open, self._open_total = empty_usage(), {}, empty_usage()
        with replacing(self.path) as handle:
            handle.write(json.dumps({"carried": self._carried}).encode() + b"\n")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)

    def unfinished(self) -> dict:
        """Spent by sessions that left no row (or spent beyond it), every invocation so far."""
        total = dict(self._carried)
        add_usage(total, self._cut_off)
        add_usage(total, self._open_total)
        return {key: round(value, 8) if key == "cost" else value for key, value in total.items()}

    def record(self, spent: list[Spent], rows_to_write: list[RowPlace]) -> None:
        """Replies' usage as it arrives, and the rows about to be appended, announced where they will be;
        durable before those rows are written (see the class)."""
        for event in spent:        # spent all the same if the disk cannot take the line
            self._take({"prompt": event.unit, "spent": event.usage})
        self._append([{"prompt": event.unit, "spent": event.usage} for event in spent]
                     + [{"prompt": row.unit, "row": row.usage,
                         "at": [row.batch_file, row.offset, row.length, row.prompt_index, row.sample_index]}
                        for row in rows_to_write], sync=bool(rows_to_write))

    def landed(self, rows_written: list[RowPlace]) -> None:
        """The announced rows that were appended. Not synced: without this line the rows are found
        where they were announced, and one not found there never counted."""
        if rows_written:
            try:
                self._append([{"landed": [row.unit for row in rows_written]}], sync=False)
            except DiskFull:
                pass
            for row in rows_written:
                self._take_row(row)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _append(self, records: list[dict], *, sync: bool) -> None:
        """Whole lines or none: a write the disk cut short is taken back (a later line would be glued
        to the piece, and both be lost)."""
        if not records or self._fd is None:
            return
        data = b"".join(json.dumps(record).encode() + b"\n" for record in records)
        with full_disk_named(self.path, len(data)):
            start = os.lseek(self._fd, 0, os.SEEK_END)
            try:
                written = 0
                while written < len(data):
                    written += os.write(self._fd, data[written:])
                if sync:
                    os.fdatasync(self._fd)
            except OSError:
                os.ftruncate(self._fd, start)
                raise

    def _holds(self, place: RowPlace) -> bool:
        """Whether the batch file holds the announced row where it was announced."""
        batch = self.path.parent / place.batch_file
        try:
            for _, line in lines_at(batch, place.offset, place.offset + 1):
                stored = rows.read_stored_row(line)
                return (len(line) == place.length and stored is not None
                        and (stored.prompt_index, stored.sample_index) == (place.prompt_index, place.sample_index))
        except (OSError, rows.RowError):
            pass
        return False

    def _take(self, record: dict) -> None:
        if "carried" in record:
            add_usage(self._carried, record["carried"])
        elif "spent" in record:
            add_usage(self._open.setdefault(record["prompt"], empty_usage()), record["spent"])
            add_usage(self._open_total, record["spent"])

    def _take_row(self, row: RowPlace) -> None:
        if (spent := self._open.pop(row.unit, None)) is not None:
            add_usage(self._open_total, {key: -spent[key] for key in USAGE_KEYS})
            add_usage(self._cut_off, {key: max(0, round(spent[key] - (row.usage.get(key) or 0), 8))
                                      for key in USAGE_KEYS})


def _announced(record: dict) -> RowPlace:
    """A row announced in spent.jsonl. A line of a version before samples names the batch file, offset
    and length only: its unit was the prompt's index, and every row was sample 0."""
    batch_file, offset, length, *identity = record["at"]
    prompt_index, sample_index = identity or (record["prompt"], 0)
    return RowPlace(record["prompt"], record["row"], batch_file, offset, length, prompt_index, sample_index)


FileRange = tuple[Path, int, int]


def scan_ranges(ranges: list[FileRange]) -> ScanResult:
    """Count finished prompts by content key in these byte ranges. Failed rows are not
    done; corrupted rows are counted apart (see ScanResult.done)."""
    result = ScanResult()
    for path, start, end in ranges:
        for offset, line in lines_at(path, start, end):
            try:
                row = rows.read_stored_row(line)
            except rows.RowError as exc:
                raise refused_line(path, offset, exc) from None
            if row is None:
                result.unreadable_lines += 1
                continue
            result.rows_by_status[row.status] += 1
            add_usage(result.usage, row.usage())
            result.most_samples = max(result.most_samples, row.sample_index + 1)
            if row.status == rows.FAILED:
                continue
            if row.status != rows.DISCARDED and row.invented_tools():
                result.corrupted_by_key[row.sample_key] += 1
                continue
            result.done_counts[row.sample_key] += 1
    return result


def read_processes(files: list[Path]) -> int:
    """How many processes share the reading of these files: one per core once they are big."""
    if sum(path.stat().st_size for path in files) < PARALLEL_READ_MIN_BYTES:
        return 1
    return min(os.cpu_count() or 1, MAX_READ_PROCESSES)


def _reading_pool(processes: int) -> ProcessPoolExecutor:
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


class RunDirectory:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_fd: int | None = None
        self._created = False       # a batch file was created since the last sync_names()

    # -- ownership ------------------------------------------------------------------------------

    def acquire(self) -> None:
        lock = self.path / LOCK
        with full_disk_named(lock):
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            # A POSIX record lock belongs to this process alone: forked workers do not inherit it,
            # so a killed runner frees the directory at once even while its workers wind down.
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunDirectoryError(
                f"{self.path} is in use by batch_runner (pid {holder}). Wait for that run to finish, "
                "or start a separate one with a different --run_name.") from None
        self._lock_fd = fd
        os.ftruncate(fd, 0)
        try:
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except OSError as exc:      # the pid only names the holder to a second run; the lock holds without it
            if not is_disk_full(exc):
                raise

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def batch_files(self) -> list[Path]:
        found = [(int(m.group(1)), p) for p in self.path.glob("batch_*.jsonl") if (m := BATCH_FILE.match(p.name))]
        return [path for _, path in sorted(found)]

    def existing_results(self) -> list[str]:
        """Names of result files with content, for the 'use --resume' message."""
        candidates = self.batch_files() + [self.path / TRAJECTORIES]
        return [p.name for p in candidates if p.exists() and p.stat().st_size > 0]

    # -- resume ---------------------------------------------------------------------------------

    def scan(self) -> ScanResult:
        """What the batch files hold (see :func:`scan_ranges`), once torn tails are cut off. Reading a
        row costs CPU, not disk (the reads are line-sized), so a big run directory is shared out over
        one process per core. Only a resumed run scans, with the lock held and before it appends."""
        self.cut_torn_tails()
        files = self.batch_files()
        groups = split_ranges(files, read_processes(files))
        if len(groups) == 1:
            return scan_ranges(groups[0])
        result = ScanResult()
        with _reading_pool(len(groups)) as pool:
            for part in pool.map(scan_ranges, groups):
                result.add(part)
        return result

    def cut_torn_tails(self) -> None:
        """Cut off what a crash left after the last newline of each batch file.

        Such a tail is never counted as done, so its prompt runs again. Left in place, the next
        append would end it with a newline: a tail that lacked only that would become a second row
        for the prompt, and a shorter one a broken line before every later row.
        """
        for path in self.batch_files():
            with path.open("r+b") as handle:
                size = handle.seek(0, os.SEEK_END)
                end = _end_of_last_line(handle, size)
                if end < size:
                    handle.truncate(end)
                    os.fsync(handle.fileno())

    # -- writing --------------------------------------------------------------------------------

    def append(self, batch_num: int, rows_data: bytes) -> None:
        """Append whole rows to a batch file and make them durable before returning.

        The file is open only meanwhile, so the descriptors a run holds do not grow with its number
        of batch files (opening costs microseconds; the fdatasync, milliseconds). Rows that do not
        all fit, or cannot be synced, are cut off again: half a row left at the end would be glued
        to the next row a later run appends. The name of a file this creates is durable once
        :meth:`sync_names` has run (one directory sync for all the files of a group commit).
        """
        path = self.path / f"batch_{batch_num}.jsonl"
        with full_disk_named(path, len(rows_data)):
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                start = os.lseek(fd, 0, os.SEEK_END)
                try:
                    written = 0
                    while written < len(rows_data):
                        written += os.write(fd, rows_data[written:])
                    os.fdatasync(fd)
                except OSError:
                    os.ftruncate(fd, start)
                    raise
            finally:
                os.close(fd)
        self._created |= start == 0

    def row_places(self, batch_num: int, finished: list[Finished]) -> list[RowPlace]:
        """Where these rows will be once appended to their batch file, in this order."""
        name = f"batch_{batch_num}.jsonl"
        try:
            offset = (self.path / name).stat().st_size
        except FileNotFoundError:
            offset = 0
        places = []
        for message in finished:
            places.append(RowPlace(message.unit, message.usage, name, offset, len(message.row),
                                   message.prompt_index, message.sample_index))
            offset += len(message.row)
        return places

    def sync_names(self) -> None:
        """Make the names of the batch files created since the last call durable."""
        if self._created:
            _fsync_dir(self.path)
            self._created = False

    def write_checkpoint(self, checkpoint: Checkpoint) -> None:
        atomic_write_json(self.path / CHECKPOINT, checkpoint.as_json())

    def read_checkpoint(self) -> dict | None:
        try:
            return json.loads((self.path / CHECKPOINT).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def write_estimate(self, data: dict) -> None:
        atomic_write_json(self.path / ESTIMATE, data, indent=2)

    def write_statistics(self, data: dict) -> None:
        atomic_write_json(self.path / STATISTICS, data, indent=2)

    # -- merge ----------------------------------------------------------------------------------

    def merge(self, on_corrupted: Callable[[str, int, list[str], str], None], *,
              per_prompt: bool = False) -> MergeStatistics:
        """Bring trajectories.jsonl up to date with every batch file, and count what it holds.

        Trajectory rows that call no invented tool are kept; tombstones, failures, corrupted rows
        (each passed to ``on_corrupted`` as batch file, prompt index, invented tools, content key) and broken
        lines are left out. Batch files only grow, so when the record of the last merge still
        matches the files, only rows written since are read and appended; otherwise the whole file
        is rewritten (a big directory shared out over one process per core) and atomically replaced.
        ``per_prompt``: count each prompt's completed samples too (MergeStatistics.prompt_samples); once
        counted, a run goes on counting them.
        """
        files = self.batch_files()
        previous = self._read_merge_record(files)
        if previous is not None and per_prompt and previous.statistics.prompt_samples is None:
            previous = None     # the figures so far lack them: count everything again
        if previous is None:
            statistics, ends = self._rewrite_trajectories(files, on_corrupted, per_prompt)
        else:
            statistics, ends = self._append_to_trajectories(files, previous, on_corrupted)
        statistics.batch_files = len(files)
        self._write_merge_record(statistics, ends)
        return statistics

    def _rewrite_trajectories(self, files: list[Path], on_corrupted: Callable,
                              per_prompt: bool) -> tuple[MergeStatistics, dict]:
        groups = split_ranges(files, read_processes(files))
        target = self.path / TRAJECTORIES
        if len(groups) == 1:
            parts = [read_merge_part(groups[0], per_prompt)]
            with replacing(target, needed=parts[0].kept_bytes) as out:
                copy_kept_rows(out.fileno(), 0, parts[0].kept)
        else:
            with _reading_pool(len(groups)) as pool:
                parts = list(pool.map(read_merge_part, groups, [per_prompt] * len(groups)))
                starts = [sum(part.kept_bytes for part in parts[:index]) for index in range(len(parts))]
                with replacing(target, needed=sum(part.kept_bytes for part in parts)) as out:
                    # Each process copies its rows into place; the kernel moves the bytes.
                    list(pool.map(_copy_into, [Path(out.name)] * len(parts), starts, [part.kept for part in parts]))
        return _combined(parts, {}, MergeStatistics(prompt_samples=Counter() if per_prompt else None), on_corrupted)

    def _append_to_trajectories(self, files: list[Path], previous: MergeRecord,
                                on_corrupted: Callable) -> tuple[MergeStatistics, dict]:
        part = read_merge_part([(path, previous.offsets.get(path.name, 0), path.stat().st_size) for path in files],
                               previous.statistics.prompt_samples is not None)
        path = self.path / TRAJECTORIES
        with path.open("r+b") as out, full_disk_named(path, part.kept_bytes):
            # A merge that crashed after appending left rows past the recorded size: they go, and
            # their batch lines are read again.
            out.truncate(previous.trajectories_bytes)
            try:
                copy_kept_rows(out.fileno(), previous.trajectories_bytes, part.kept)
                os.fsync(out.fileno())
            except OSError:     # what was merged before stays whole, without a half row after it
                out.truncate(previous.trajectories_bytes)
                raise
        return _combined([part], previous.offsets, previous.statistics, on_corrupted)

    def _read_merge_record(self, files: list[Path]) -> MergeRecord | None:
        """The last merge's record, if trajectories.jsonl and every batch file it read are still
        what it left (same tail bytes at the recorded sizes); None means: rewrite everything."""
        try:
            data = json.loads((self.path / MERGE_RECORD).read_text(encoding="utf-8"))
            if data.get("format") != MERGE_RECORD_FORMAT:
                return None
            names = {path.name for path in files}
            if not set(data["files"]) <= names:       # a batch file that was merged is gone
                return None
            trajectories_bytes = data["trajectories"][0]
            if not _has_tail(self.path / TRAJECTORIES, *data["trajectories"]):
                return None
            offsets = {}
            for name, (offset, tail) in data["files"].items():
                if not _has_tail(self.path / name, offset, tail):
                    return None
                offsets[name] = offset
            return MergeRecord(trajectories_bytes, offsets, MergeStatistics.from_state(data["statistics"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _write_merge_record(self, statistics: MergeStatistics, ends: dict[str, int]) -> None:
        size = (self.path / TRAJECTORIES).stat().st_size
        atomic_write_json(self.path / MERGE_RECORD, {
            "format": MERGE_RECORD_FORMAT,
            "trajectories": [size, _tail_digest(self.path / TRAJECTORIES, size)],
            "files": {name: [end, _tail_digest(self.path / name, end)] for name, end in ends.items()},
            "statistics": statistics.to_state(),
        })


@dataclass
class MergeRecord:
    """What the last merge read and wrote: where to go on from, and its figures so far."""

    trajectories_bytes: int
    offsets: dict[str, int]
    statistics: MergeStatistics


@dataclass
class MergePart:
    """What one process found in its byte ranges of the batch files."""

    statistics: MergeStatistics = field(default_factory=MergeStatistics)
    kept: list[FileRange | bytes] = field(default_factory=list)   # kept rows, adjacent ones joined
    kept_bytes: int = 0
    ends: dict[str, int] = field(default_factory=dict)        # per file: the end of its last complete line

    def keep(self, path: Path, offset: int, line: bytes, row: rows.StoredRow) -> None:
        if not row.is_current:                 # a row of an earlier format: merged upgraded
            line = row.upgraded()
            self.kept.append(line)
        elif self.kept and isinstance(self.kept[-1], tuple) and self.kept[-1][0] == path \
                and self.kept[-1][2] == offset:
            self.kept[-1] = (path, self.kept[-1][1], offset + len(line))
        else:
            self.kept.append((path, offset, offset + len(line)))
        self.kept_bytes += len(line)


def read_merge_part(ranges: list[FileRange], per_prompt: bool = False) -> MergePart:
    """Classify and count the rows that begin in these byte ranges (see RunDirectory.merge)."""
    part = MergePart(MergeStatistics(prompt_samples=Counter() if per_prompt else None))
    statistics = part.statistics
    for path, start, end in ranges:
        for offset, line in lines_at(path, start, end):
            part.ends[path.name] = offset + len(line)
            try:
                row = rows.read_stored_row(line)
            except rows.RowError as exc:
                raise refused_line(path, offset, exc) from None
            if row is None:
                continue
            if row.status in (rows.FAILED, rows.DISCARDED):
                statistics.on_row(row)
                continue
            invented = row.invented_tools()
            if invented:
                statistics.on_corrupted(path.name, row, invented)
                continue
            statistics.on_row(row)
            part.keep(path, offset, line, row)
    return part


def _combined(parts: list[MergePart], offsets: dict[str, int], statistics: MergeStatistics,
              on_corrupted: Callable) -> tuple[MergeStatistics, dict[str, int]]:
    """The parts' figures added to ``statistics``, and where each batch file has been read to."""
    ends = dict(offsets)
    for part in parts:
        statistics.add(part.statistics)
        for corrupted in part.statistics.corrupted:
            on_corrupted(*corrupted)
        for name, end in part.ends.items():
            ends[name] = max(ends.get(name, 0), end)
    return statistics, ends


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


def _end_of_last_line(handle: IO[bytes], size: int) -> int:
    """Where the last newline of a file ends (0 without one), reading backwards from ``size``."""
    end = size
    while end > 0:
        start = max(0, end - READ_BUFFER_BYTES)
        handle.seek(start)
        newline = handle.read(end - start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


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
