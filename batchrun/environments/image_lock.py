"""A lock per container image, shared by every worker process of a run.

Many prompts usually name the same image, and they start at once in several processes. Whoever holds
an image's lock pulls it; the others wait, then find it present — one pull, not one per prompt.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import re
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

    async def __aenter__(self) -> ImageLock:
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

    async def __aexit__(self, *exc_info: object) -> None:
        if self._fd is not None:
            os.close(self._fd)      # closing the descriptor releases the lock
            self._fd = None
