"""A lock per container image, shared by every worker process of a run.

Many prompts usually name the same image, and they start at once in several processes. Whoever holds
an image's lock pulls it; the others wait, then find it present — one pull, not one per prompt. A pull
that fails leaves its message in the lock's file, and those that waited for it fail with it: pulled
again, one waiter after another, an image that cannot be pulled would hold each prompt for a pull's time.
A prompt that comes later pulls again, so that a registry that recovers is noticed.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import re
import time
from pathlib import Path

# Pulls take seconds to minutes, so a waiter checking ten times a second loses nothing, and polling
# with LOCK_NB (unlike a blocking flock in a thread) can be cancelled without leaving the lock taken.
_POLL_SECONDS = 0.1


def image_file_stem(image: str) -> str:
    """A file name for ``image`` (its lock, its SIF): readable, made unique by a digest of the exact name."""
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", image)[:60]
    return f"{readable}-{hashlib.sha256(image.encode()).hexdigest()[:12]}"


class ImageLock:
    """``async with ImageLock(directory, image):`` — exclusive across processes (flock) and, since
    each holder opens the file anew, across the sessions of one process too."""

    def __init__(self, directory: Path, image: str) -> None:
        self._path = directory / f"{image_file_stem(image)}.lock"
        self._fd: int | None = None
        self._waiting_since = 0       # when this holder began to wait (time.time_ns: across processes)

    async def __aenter__(self) -> ImageLock:
        self._waiting_since = time.time_ns()
        self._path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(_POLL_SECONDS)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def failure_while_waiting(self) -> str | None:
        """The message of a pull that failed while this holder waited for the lock, if one did."""
        assert self._fd is not None
        recorded = os.pread(self._fd, 65536, 0).decode("utf-8", "replace")
        when, _, message = recorded.partition("\n")
        return message if when.isdigit() and int(when) >= self._waiting_since and message else None

    def record_failure(self, message: str | None) -> None:
        """Leave the message of the pull that failed for those waiting; None: the pull succeeded."""
        assert self._fd is not None
        os.ftruncate(self._fd, 0)
        if message is not None:
            os.pwrite(self._fd, f"{time.time_ns()}\n{message}".encode(), 0)

    async def __aexit__(self, *exc_info: object) -> None:
        if self._fd is not None:
            os.close(self._fd)      # closing the descriptor releases the lock
            self._fd = None
