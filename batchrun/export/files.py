"""An export's files, each written beside its place and renamed over it (write_files): shared by the
writers of plain files, the JSONL formats and Parquet, so none of them can leave half a file."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from batchrun.export.options import ExportError
from batchrun.run_dir import remove_temps_of_gone_writers, temp_beside


def beside(out: Path, suffix: str) -> Path:
    """A file that goes with the export ``out`` (its manifest, its --best_of record), named after it less
    a .jsonl ending: ``x.jsonl`` -> ``x.<suffix>``, ``x.parquet`` -> ``x.parquet.<suffix>``. Named by the
    stem alone, x.jsonl's and x.parquet's would be one file, and an export of either its undoing."""
    return out.with_name(f"{out.name.removesuffix('.jsonl')}.{suffix}")


@contextlib.contextmanager
def alone_in(folder: Path, waiting: Callable[[Path], object]) -> Iterator[None]:
    """Hold ``folder`` (made if need be) against other exports to it while one writes there; ``waiting``
    is told of a wait. An export's files are renamed into place one by one and its --best_of record
    written or removed after them: two exports to one --out at once, each step interleaved, left one's
    file beside the other's manifest or record, or (hf) failed on the other's folder."""
    folder.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waiting(folder)
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        except OSError:
            # A filesystem that locks no directory (NFS: EBADF or ENOLCK): exports there run as they did
            # before the lock, one at a time only if the user runs them so.
            pass
        yield
    finally:
        os.close(descriptor)        # and the lock with it


def write_file(out: Path, write: Callable[[Path], object]) -> None:
    write_files([out], lambda temps: write(temps[0]))


def write_files(outs: list[Path], write: Callable[[list[Path]], object]) -> None:
    """Write beside each of ``outs`` and rename over them, the first last: an export that stops
    halfway leaves the old files (or none), never half of one that looks whole."""
    for out in outs:
        if out.is_dir():
            raise ExportError(f"--out={out} is a directory; --export writes a file there")
    # What an export killed before its renames (kill -9) left beside them, a whole copy each, went nowhere
    # else; another export (or the same command twice) may be writing beside them still, and keeps its own.
    for directory in {out.parent for out in outs}:
        remove_temps_of_gone_writers(directory, {out.name for out in outs if out.parent == directory})
    temps = [temp_beside(out) for out in outs]
    try:
        write(temps)
        for temp, out in reversed(list(zip(temps, outs, strict=True))):
            os.replace(temp, out)
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)


def write_lines(paths: list[Path], lines: Iterable[tuple[bytes, ...]]) -> None:
    """Each item's lines, one to each of ``paths``, in order."""
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(path.open("wb")) for path in paths]
        for items in lines:
            for handle, line in zip(handles, items, strict=True):
                handle.write(line)
