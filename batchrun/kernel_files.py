"""The kernel's own small files (/proc, control groups), read and written with one system call each.

A prompt reads and writes a score of them (its control group's limits and counters, its sandbox's
processes), on the event loop every session of its worker shares. Python's text files cost several
times the system calls themselves: a buffered reader, a text decoder, a terminal check, a seek
(docs/performance.md). These files are ASCII, and the kernel makes each read or write whole.
"""

from __future__ import annotations

import os
from pathlib import Path

_CHUNK_BYTES = 65536


def read(path: str | Path) -> bytes:
    """The whole file; OSError as open() would raise it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, _CHUNK_BYTES):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write(path: str | Path, value: str) -> None:
    """Write ``value`` to an existing file in one call, as the kernel takes a setting; OSError as the
    kernel refuses it (a value out of range, a file that does not exist)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode("ascii"))
    finally:
        os.close(fd)
