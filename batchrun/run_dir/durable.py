"""Writes that leave every file whole: a crash, a kill or a full disk leaves each file as it was.

Rows are appended whole or not at all (and what a crash left after a file's last newline is cut off
before the next append); a file that is rewritten (checkpoint, statistics, the merged file and its
record, the report) is written beside itself under a name of its own and renamed over the old one
only once it is complete and durable. Only the parent process writes the run directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from batchrun import kernel_files
from batchrun.run_dir.errors import not_a_regular_file, write_failure_named
from batchrun.run_dir.reading import READ_BUFFER_BYTES


def append_whole(fd: int, data: bytes, *, sync: bool) -> int:
    """Append ``data`` to an open file, made durable if ``sync``; returns the offset it begins at.
    Data that does not all fit, or cannot be synced, is cut off again: half a line left at the end
    would be glued to the next line a later write appends, and both be lost."""
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
        if sync:
            os.fdatasync(fd)
    except OSError:
        os.ftruncate(fd, start)
        raise
    return start


def cut_torn_tail(path: Path) -> None:
    """Cut off what a crash left after the last newline of a file.

    Such a tail of a batch file is never counted as done, so its prompt runs again. Left in place,
    the next append would end it with a newline: a tail that lacked only that would become a second
    row for the prompt, and a shorter one a broken line before every later row.
    """
    with path.open("r+b") as handle:
        size = handle.seek(0, os.SEEK_END)
        end = _end_of_last_line(handle, size)
        if end < size:
            handle.truncate(end)
            os.fsync(handle.fileno())


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


def temp_beside(path: Path) -> Path:
    """A temporary name beside ``path`` that no other writer uses: two processes may rewrite one file
    at once (the run's report process and ``--report``), and each must rename its own whole file."""
    return path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


# temp_beside's names: the file's own name, the pid of the process writing it, a random part.
_TEMP_NAME = re.compile(r"^(?P<name>.+)\.(?P<pid>[0-9]+)\.[0-9a-f]{8}\.tmp$")


def temps_in(directory: Path, *, folders: bool = False) -> list[tuple[Path, str, int]]:
    """The temporary files of rewrites in ``directory`` (temp_beside's names), and with ``folders`` the
    temporary folders so named too (a datasets export's), each with the name of what it is to replace and
    the pid of the process that wrote it. A writer killed before its rename (kill -9, a power cut) leaves
    its file there: nothing else ever removes it."""
    with os.scandir(directory) as entries:
        return [(Path(entry.path), match["name"], int(match["pid"])) for entry in entries
                if (match := _TEMP_NAME.match(entry.name))
                and (entry.is_file(follow_symlinks=False) or folders and entry.is_dir(follow_symlinks=False))]


def writer_running(pid: int) -> bool:
    """Whether process ``pid`` runs, other than this one, which has rewritten nothing yet when it asks. A
    zombie has ended: a killed run's processes stay so where no init reaps them (some containers)."""
    if pid == os.getpid():
        return False
    try:
        stat_line = kernel_files.read(f"/proc/{pid}/stat")
    except FileNotFoundError:
        return False
    except OSError:     # /proc not there to tell: taken as running, so its file stays
        return True
    return stat_line.rpartition(b")")[2].split()[:1] not in ([b"Z"], [b"X"])


def remove_temps_of_gone_writers(directory: Path, names: set[str]) -> None:
    """Remove what writers of the files ``names`` in ``directory``, killed before their rename, left there
    (temps_in, folders too); a writer still running keeps its own."""
    for temp, name, pid in temps_in(directory, folders=True):
        if name in names and not writer_running(pid):
            if temp.is_dir():
                shutil.rmtree(temp, ignore_errors=True)
            else:
                temp.unlink(missing_ok=True)


@contextmanager
def replacing(path: Path, *, needed: int = 0, durable: bool = True) -> Iterator[IO[bytes]]:
    """A new version of ``path``: written to a temporary file beside it, made durable (unless
    ``durable`` is False), and renamed over the old one when the block ends. If anything fails on the
    way, the temporary file is removed and ``path`` keeps its old content; a full disk raises
    DiskFull (``needed``: the size of the new version, where known), a refused write WriteRefused."""
    temp = temp_beside(path)
    with write_failure_named(path, needed):
        try:
            with temp.open("xb") as handle:
                yield handle
                handle.flush()
                if durable:
                    os.fsync(handle.fileno())
            _rename_over(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):      # the failure to report is the one that got here
                temp.unlink(missing_ok=True)
            raise
    if durable:
        with write_failure_named(path.parent):
            fsync_dir(path.parent)


def _rename_over(temp: Path, path: Path) -> None:
    try:
        os.replace(temp, path)
    except IsADirectoryError:      # a rename puts no file in a directory's place, however often it is tried
        raise not_a_regular_file(path, "the run writes it") from None


def atomic_write_json(path: Path, data: dict[str, Any], *, indent: int | None = None) -> None:
    """A reader (or a crash, or a full disk) sees the old file or the new one, never half."""
    encoded = json.dumps(data, ensure_ascii=False, indent=indent).encode("utf-8")
    with replacing(path, needed=len(encoded)) as handle:
        handle.write(encoded)


def fsync_dir(path: Path) -> None:
    """Make the names in a directory durable (a file it gained, or one renamed into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
