"""Rate limits shared by every worker process: honoured across workers, not per session."""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import time
from typing import AsyncContextManager

from batchrun.concurrency import UNLIMITED, Request, SharedLimit, request_slot

_FORK = multiprocessing.get_context("fork")
# Paused requests resume spread over a quarter of the pause (0.1 s to 10 s) after it ends: were they
# all sent in the same instant, they would meet the server's limit again at once.
WAKE_SPREAD = 0.25
WAKE_SPREAD_MIN = 0.1
WAKE_SPREAD_MAX = 10.0


def wake_delay(remaining: float) -> float:
    """How long a request waits when ``remaining`` seconds of a pause are left: to its end, and a
    random share of the spread beyond it."""
    spread = min(WAKE_SPREAD_MAX, max(WAKE_SPREAD_MIN, remaining * WAKE_SPREAD))
    return remaining + random.uniform(0, spread)


class RateGate:
    """Three run-wide limits in shared memory, consulted before every model request:

    * concurrency: at most so many requests in flight, a limit that adapts to the endpoint
      (batchrun.concurrency) unless ``adaptive`` is off;
    * a pause: after a 429 that says when to come back, nobody sends until then (and then not
      everybody at once: :func:`wake_delay`); with adaptive concurrency off, after any 429;
    * an optional requests-per-minute pace: each request takes the next free slot, so the
      processes together never exceed it.

    ``workers``: how many worker processes take slots (each counts its own, see SharedLimit.reclaim).
    """

    def __init__(self, requests_per_minute: int | None = None, *, ceiling: int = UNLIMITED,
                 adaptive: bool = False, workers: int = 1) -> None:
        self._resume_at = _FORK.Value("d", 0.0)
        self._next_slot = _FORK.Value("d", 0.0)
        self._interval = 60.0 / requests_per_minute if requests_per_minute else 0.0
        self.limit = SharedLimit(ceiling, adaptive, workers)

    @property
    def adaptive(self) -> bool:
        return self.limit.adaptive

    def slot(self) -> AsyncContextManager[Request]:
        """``async with gate.slot() as request``: wait until one more request may go (a slot, then any
        pause and pace), holding the slot while it is in flight; the caller tells ``request`` what came
        of it."""
        return request_slot(self.limit, self.wait)

    def pause(self, seconds: float) -> None:
        with self._resume_at.get_lock():
            self._resume_at.value = max(self._resume_at.value, time.monotonic() + seconds)

    async def wait(self) -> None:
        while (delay := self._resume_at.value - time.monotonic()) > 0:
            await asyncio.sleep(wake_delay(delay))
        if self._interval:
            with self._next_slot.get_lock():
                slot = max(self._next_slot.value, time.monotonic())
                self._next_slot.value = slot + self._interval
            if (delay := slot - time.monotonic()) > 0:
                await asyncio.sleep(delay)
