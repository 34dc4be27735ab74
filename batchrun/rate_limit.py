"""A run-wide pause shared by every worker process (SPEC §13: rate limits honoured across workers)."""

from __future__ import annotations

import asyncio
import multiprocessing
import time


class RateGate:
    """A run-wide pause shared by all worker processes: after a 429, nobody sends until it passes."""

    def __init__(self) -> None:
        self._resume_at = multiprocessing.get_context("fork").Value("d", 0.0)

    def pause(self, seconds: float) -> None:
        with self._resume_at.get_lock():
            self._resume_at.value = max(self._resume_at.value, time.monotonic() + seconds)

    async def wait(self) -> None:
        while (delay := self._resume_at.value - time.monotonic()) > 0:
            await asyncio.sleep(delay)
