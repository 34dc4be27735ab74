"""RunDirectory: one run's directory as the runner uses it, owned by one process at a time (the lock).

The face the runner, the report and the export call: the names of the batch files, the appends to
them and the files rewritten whole, with the resume scan and the merge behind it (scan.py, merge.py).
Only the parent process writes these files.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from batchrun.messages import Finished
from batchrun.paths import NotRegularFile, lookup_error, open_regular
from batchrun.run_dir.checkpoint import CHECKPOINT, Checkpoint
from batchrun.run_dir.durable import (
    append_whole,
    atomic_write_json,
    cut_torn_tail,
    fsync_dir,
    temps_in,
    writer_running,
)
from batchrun.run_dir.errors import (
    RunDirectoryError,
    WriteRefused,
    cannot_read,
    is_disk_full,
    not_a_regular_file,
    write_failure_named,
    write_refused,
)
from batchrun.run_dir.merge import MERGE_RECORD, TRAJECTORIES, OnCorrupted, forget_merge_over_damage, merge_batch_files
from batchrun.run_dir.reading import record_json
from batchrun.run_dir.relocations import RELOCATIONS, read_relocations, write_relocations
from batchrun.run_dir.scan import ScanResult, scan_files
from batchrun.run_dir.spent import SPENT, RowPlace
from batchrun.stats import MergeStatistics

# The names the runner writes: one per number. A copy named for the same number another way (batch_00,
# or other digits than ASCII's, which int() reads too) would be merged a second time.
BATCH_FILE = re.compile(r"^batch_(0|[1-9][0-9]*)\.jsonl$")
STATISTICS = "statistics.json"
ESTIMATE = "estimate.json"
LOCK = ".lock"
# The files a run reads, rewrites whole or appends to beside the batch files. One that is not a regular
# file is refused with the lock taken, before any prompt runs: met where the run first used it, it was a
# traceback after the prompts ran (the statistics, the merge), or a read that waits for ever (a FIFO).
# report.html is not among them: a report that cannot be written does not fail the run (its end says why).
RUN_FILES = (CHECKPOINT, STATISTICS, ESTIMATE, TRAJECTORIES, MERGE_RECORD, RELOCATIONS, SPENT)
# Of those, the ones written in place (appended to, cut, emptied) rather than replaced by a rename, as
# every batch file is too: such a file with a second name (a hard link: cp -al) is another directory's
# file as well, and the run would write its rows there too. A file replaced whole leaves its other names
# to what they held.
WRITTEN_IN_PLACE = (TRAJECTORIES,)


def require_readable(path: Path, command: str) -> None:
    """For ``command`` (--report, --export), which only reads a run directory: it is there and this user
    may list it. A directory that may not be listed would otherwise read as one without batch files."""
    try:
        os.scandir(path).close()
    except (FileNotFoundError, NotADirectoryError):
        raise RunDirectoryError(f"no run directory {path}/ here — {command} reads data/<run_name>/ under the "
                                "current directory; check --run_name or cd to where the run was started") from None
    except OSError as exc:      # this user may not list it, a loop of symbolic links, a failing disk
        raise cannot_read(f"the run directory {path}/", exc, command) from None


def require_regular_files(run_dir: Path, names: tuple[str, ...]) -> None:
    """The files of these ``names`` the run directory holds, which --report or --export reads beside the batch
    files, are regular files: one that is not is named in one error, as a run refuses it at its start
    (_require_own_files). By stat, never by opening: a FIFO would hold the read for ever, a link to
    /dev/zero fill memory."""
    for name in names:
        path = run_dir / name
        if path.exists() and not path.is_file():
            raise not_a_regular_file(path, "the run writes it")


def hard_linked(path: Path, names: int) -> RunDirectoryError:
    """The one message for a file the run writes in place that has other names (see WRITTEN_IN_PLACE)."""
    return RunDirectoryError(f"{path} is one file with {names} names (hard links, as cp -al makes): the run writes "
                             "it in place, so it would write under the other name too. Copy the run directory "
                             "without links (cp -a, without -l).")


def linked_elsewhere(path: Path) -> RunDirectoryError:
    """The one message for a file the run writes in place that is a symbolic link: appends and torn tails
    cut would go through it, into the file it names (another run's, say)."""
    return RunDirectoryError(f"{path} is a symbolic link to {os.readlink(path)}: the run writes its files in "
                             "place, so it would write there. Copy that file in its place.")


class RunDirectory:
    """data/<run_name>/: its lock, its batch files and the files rewritten whole beside them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_fd: int | None = None
        self._created = False       # a batch file was created since the last sync_names()
        self._repeats: Counter[str] | None = None   # what the resume scan found (ScanResult.repeats); None: no scan

    # -- ownership ------------------------------------------------------------------------------

    def acquire(self) -> None:
        lock = self.path / LOCK
        try:
            with write_failure_named(lock):
                self.path.mkdir(parents=True, exist_ok=True)
                # Never through a symbolic link: taking the lock empties the file to write the pid in it.
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
        except (FileExistsError, NotADirectoryError) as exc:
            if reason := lookup_error(self.path):   # a loop of symbolic links exists but is not "a file"
                raise RunDirectoryError(f"cannot use the run directory {self.path}: {reason}. Move it, or choose "
                                        "another --run_name.") from None
            in_the_way = Path(exc.filename)
            if in_the_way.is_symlink() and not in_the_way.exists():
                raise RunDirectoryError(f"{in_the_way} is a symbolic link to {os.readlink(in_the_way)}, which does "
                                        "not exist. Make that directory, remove the link, or choose another "
                                        "--run_name.") from None
            raise RunDirectoryError(f"{self.path} is not a directory: {exc.filename} is a file in the way. Move it, "
                                    "or choose another --run_name.") from None
        except WriteRefused as exc:     # before the run: said as the start's other checks say it
            raise (write_refused(self.path, cast(OSError, exc.__cause__))
                   or RunDirectoryError(f"{exc}. {exc.remedy}.")) from None
        except OSError as exc:
            if exc.errno == errno.EISDIR or (exc.errno == errno.ELOOP and lock.is_symlink()):
                raise not_a_regular_file(lock, "the run writes it") from None
            if (refused := write_refused(self.path, exc)) is None:
                raise
            raise refused from None
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):     # a FIFO takes no record lock, and holds no pid
            os.close(fd)
            raise not_a_regular_file(lock, "the run writes it")
        if status.st_nlink > 1:     # before it is emptied for the pid: the other name is another run's lock
            os.close(fd)
            raise hard_linked(lock, status.st_nlink)
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
        try:
            self._require_own_files()
            self._require_writable_directory()
        except BaseException:
            self.release()
            raise

    def _require_own_files(self) -> None:
        """Each file of the run there is a regular file of its own, and one the run writes in place, a file
        this user may read and write. Checked here, with the lock taken and before any prompt runs: met where
        the run first wrote it, a refusal was a traceback, after the prompts for trajectories.jsonl. By stat
        first, never opening what is no regular file (see batch_files); a file not there yet is made when
        first written."""
        batch_files = self.batch_files()
        in_place = {self.path / name for name in WRITTEN_IN_PLACE} | set(batch_files)
        for path in [*(self.path / name for name in RUN_FILES), *batch_files]:
            try:
                status = path.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(status.st_mode):
                raise linked_elsewhere(path)
            if not stat.S_ISREG(status.st_mode):
                raise not_a_regular_file(path, "the run writes it")
            if path in in_place:
                if status.st_nlink > 1:
                    raise hard_linked(path, status.st_nlink)
                self._require_read_write(path)

    def _require_read_write(self, path: Path) -> None:
        """This user may read and write ``path``; if not, which of the two it may not do."""
        try:
            os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW))
        except OSError as exc:
            try:
                os.close(os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW))
            except PermissionError as unreadable:
                raise cannot_read(str(path), unreadable) from None
            if (refused := write_refused(self.path, exc)) is None:
                raise
            raise refused from None

    def _require_writable_directory(self) -> None:
        """New files may be made here: the files the run replaces whole are written beside themselves, and
        a new batch file is made for each new batch. A file with no name, gone when closed, tells without
        leaving anything behind; where the filesystem cannot make one, the run's first write tells."""
        try:
            os.close(os.open(self.path, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600))
        except OSError as exc:
            if (refused := write_refused(self.path, exc)) is not None:
                raise refused from None

    def removed_behind(self, exc: FileNotFoundError) -> bool:
        """Whether ``exc`` means someone else removed this directory, or files the run made in it, while
        the run wrote there. Checked by the names the error carries, not only by whether the directory
        is still there: an ``rm -rf`` under way has removed the run's files before the directory."""
        if not self.path.is_dir():
            return True
        home = os.path.abspath(self.path)
        return any(isinstance(name, str) and os.path.dirname(os.path.abspath(name)) == home
                   for name in (exc.filename, exc.filename2))

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def batch_files(self) -> list[Path]:
        found = [(int(m.group(1)), p) for p in self.path.glob("batch_*.jsonl") if (m := BATCH_FILE.match(p.name))]
        for _, path in found:
            # By stat, never by opening: reading a FIFO would wait for ever, a link to /dev/zero would fill
            # memory with one endless line, and a directory or a broken link cannot be read.
            if not path.is_file():
                raise not_a_regular_file(path, "a batch file holds rows")
        return [path for _, path in sorted(found)]

    def existing_results(self) -> list[str]:
        """Names of result files with content, for the 'use --resume' message."""
        candidates = self.batch_files() + [self.path / TRAJECTORIES]
        return [p.name for p in candidates if p.exists() and p.stat().st_size > 0]

    # -- resume ---------------------------------------------------------------------------------

    def scan(self) -> ScanResult:
        """What the batch files hold (see scan.scan_files), once torn tails are cut off and the temporary
        files of rewrites cut short removed. Only a resumed run scans, with the lock held and before it
        appends."""
        self.cut_torn_tails()
        self.remove_unfinished_rewrites()
        result = scan_files(self.batch_files())
        forget_merge_over_damage(self.path, result.unreadable)
        self._repeats = result.repeats
        return result

    @property
    def repeats(self) -> Counter[str]:
        """The units whose finished rows the resume scan found more than once (see ScanResult.repeats);
        none where no scan was made: a run writes no repeats itself."""
        return self._repeats or Counter()

    def cut_torn_tails(self) -> None:
        """Cut off what a crash left after the last newline of each batch file (see durable.cut_torn_tail)."""
        for path in self.batch_files():
            cut_torn_tail(path)

    def remove_unfinished_rewrites(self) -> None:
        """Remove the new versions of files that a writer killed before its rename left beside them (see
        durable.replacing): each kill during a merge left a whole copy of trajectories.jsonl. The run's own
        files are rewritten by the lock's holder alone, so every such file of theirs is left over; another
        (report.html, which --report rewrites without the lock) only where its writer is gone."""
        for temp, name, pid in temps_in(self.path):
            if name in RUN_FILES or not writer_running(pid):
                temp.unlink(missing_ok=True)

    # -- writing --------------------------------------------------------------------------------

    def append(self, batch_num: int, rows_data: bytes) -> None:
        """Append whole rows to a batch file and make them durable before returning.

        The file is open only meanwhile, so the descriptors a run holds do not grow with its number
        of batch files (opening costs microseconds; the fdatasync, milliseconds). Rows that do not
        all fit, or cannot be synced, are cut off again (see durable.append_whole). The name of a
        file this creates is durable once :meth:`sync_names` has run (one directory sync for all the
        files of a group commit).
        """
        path = self.path / f"batch_{batch_num}.jsonl"
        with write_failure_named(path, len(rows_data)):
            fd = self._open_batch_file(path)
            try:
                start = append_whole(fd, rows_data, sync=True)
            finally:
                os.close(fd)
        self._created |= start == 0

    @staticmethod
    def _open_batch_file(path: Path) -> int:
        """``path`` opened to append to, made if missing. The start's checks (_require_own_files) cannot see
        what another program puts there while the run goes on: a symbolic link is not followed, so rows never
        land outside the run directory, and a FIFO not waited on for a reader (O_NONBLOCK), both refused in
        one line as at the start."""
        try:
            return open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW)
        except NotRegularFile:
            raise not_a_regular_file(path, "a batch file holds rows") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise linked_elsewhere(path) from None
            raise

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
            self._created = False       # a failure is said once, not again at the stop's rows
            with write_failure_named(self.path):
                fsync_dir(self.path)

    def write_checkpoint(self, checkpoint: Checkpoint) -> None:
        atomic_write_json(self.path / CHECKPOINT, checkpoint.as_json())

    def read_checkpoint(self) -> dict[str, Any] | None:
        """The checkpoint; None where there is none, or what is there is not one (cut short, edited),
        and the batch files, which it only summarises, count instead. One this user may not read is an
        error: taken for none, it would be replaced, and what only it holds (the corrupted rows a
        --rerun_corrupted resume replaced) lost."""
        path = self.path / CHECKPOINT
        try:
            checkpoint = record_json(path.read_bytes())
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise cannot_read(str(path), exc) from None
        except ValueError:
            return None
        return checkpoint if isinstance(checkpoint, dict) else None

    def write_estimate(self, data: dict[str, Any]) -> None:
        atomic_write_json(self.path / ESTIMATE, data, indent=2)

    def forget_estimate(self) -> None:
        """Remove an earlier estimate.json: it projected a rest that has changed since, and one that outlived
        an estimate that writes none (nothing left, a cap, a stop) would be read as that one's."""
        (self.path / ESTIMATE).unlink(missing_ok=True)

    def write_statistics(self, data: dict[str, Any]) -> None:
        atomic_write_json(self.path / STATISTICS, data, indent=2)

    # -- merge ----------------------------------------------------------------------------------

    def merge(self, on_corrupted: OnCorrupted, *, per_prompt: bool = False) -> MergeStatistics:
        """Bring trajectories.jsonl up to date with every batch file, and count what it holds
        (see merge.merge_batch_files)."""
        return merge_batch_files(self.path, self.batch_files(), on_corrupted, per_prompt=per_prompt,
                                 relocated=self.relocations(), repeats=self._repeats)

    def write_relocations(self, places: Mapping[str, int | None]) -> None:
        """Record where the rows written for lines that hold other content now belong (see relocations.py)."""
        write_relocations(self.path, places)

    def relocations(self) -> dict[str, int | None]:
        return read_relocations(self.path)

