"""Rate limits shared by every worker process: honoured across workers, not per session."""

from __future__ import annotations

import abc
import asyncio
import multiprocessing
import random
import time
from contextlib import AbstractAsyncContextManager

from batchrun.concurrency import UNLIMITED, Limit, Request, SharedLimit, request_slot

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


def pace_interval(requests_per_minute: int | None) -> float:
    """Seconds between two requests of the run under --requests_per_minute (0: no pace)."""
    return 60.0 / requests_per_minute if requests_per_minute else 0.0


# Slots given back and not taken again that the run keeps (see take_pace_slot); one more is lost, as every
# such slot was before, which costs pace, never the limit.
GIVEN_BACK_MOST = 256


def take_pace_slot(next_free: float, now: float, interval: float, given_back: list[float]) -> tuple[float, float]:
    """(when this request may go, the slot after it): each request takes the next free slot of the
    run's pace, and a slot left unused in the past is not saved up for a burst later. A slot still
    ahead that its request gave back (its session was cut off while it waited) is taken first: left
    taken, it would push every later request back, until sessions with a --prompt_timeout time out
    waiting, each leaving one more. ``given_back`` loses the slots taken and those now past."""
    given_back[:] = [slot for slot in given_back if slot > now]
    if given_back:
        earliest = min(given_back)
        given_back.remove(earliest)
        return earliest, next_free
    slot = max(next_free, now)
    return slot, slot + interval


class Gate(abc.ABC):
    """The run-wide limits every model request passes (what :func:`batchrun.endpoint.call_model` uses):

    * concurrency: at most so many requests in flight, a limit that adapts to the endpoint
      (batchrun.concurrency) unless ``adaptive`` is off;
    * a pause: after a 429 that says when to come back, nobody sends until then (and then not
      everybody at once: :func:`wake_delay`); with adaptive concurrency off, after any 429;
    * an optional requests-per-minute pace: each request takes the next free slot, so the
      processes together never exceed it.

    A backend says where the pause and the pace are kept (shared memory, a Ray actor) and by which
    clock; the waiting is the same for every backend.
    """

    limit: Limit
    adaptive: bool

    def __init__(self, requests_per_minute: int | None) -> None:
        self._interval = pace_interval(requests_per_minute)

    def slot(self) -> AbstractAsyncContextManager[Request]:
        """``async with gate.slot() as request``: wait until one more request may go (a slot, then any
        pause and pace), holding the slot while it is in flight; the caller tells ``request`` what came
        of it."""
        return request_slot(self.limit, self.wait)

    def pause(self, seconds: float) -> None:
        self._pause_until(self._now() + seconds)

    def pause_left(self) -> float:
        """Seconds until the run's pause ends, as far as this process knows (0: none)."""
        return max(0.0, self._resume_at() - self._now())

    async def wait(self) -> None:
        while (delay := self._resume_at() - self._now()) > 0:
            await asyncio.sleep(wake_delay(delay))     # not every session of the run at the same instant
        if self._interval:
            slot = await self._reserve()
            try:
                if (delay := slot - self._now()) > 0:
                    await asyncio.sleep(delay)
            except asyncio.CancelledError:
                self._give_back(slot)
                raise

    @abc.abstractmethod
    def _now(self) -> float:
        """The clock pauses and paced slots are kept in."""

    @abc.abstractmethod
    def _resume_at(self) -> float:
        """When the run's pause ends, as far as this process knows."""

    @abc.abstractmethod
    def _pause_until(self, until: float) -> None:
        """Hold every request of the run until ``until`` (a later pause already set stays)."""

    @abc.abstractmethod
    async def _reserve(self) -> float:
        """This request's slot of the run's pace (see :func:`take_pace_slot`)."""

    @abc.abstractmethod
    def _give_back(self, slot: float) -> None:
        """A slot its request will not use, for the next request to take (see :func:`take_pace_slot`)."""


class RateGate(Gate):
    """The worker processes' gate: the limits in shared memory, inherited by the forked workers.

    ``workers``: how many worker processes take slots (each counts its own, see SharedLimit.reclaim).
    """

    def __init__(self, requests_per_minute: int | None = None, *, ceiling: int = UNLIMITED,
                 adaptive: bool = False, workers: int = 1) -> None:
        super().__init__(requests_per_minute)
        self._resume = _FORK.Value("d", 0.0)
        self._next_slot = _FORK.Value("d", 0.0)     # its lock guards the slots given back too
        self._given_back = _FORK.Array("d", GIVEN_BACK_MOST, lock=False)
        self._given_back_count = _FORK.Value("i", 0, lock=False)
        self.limit: SharedLimit = SharedLimit(ceiling, adaptive, workers)
        self.adaptive = adaptive

    def _now(self) -> float:
        return time.monotonic()

    def _resume_at(self) -> float:
        return float(self._resume.value)

    def _pause_until(self, until: float) -> None:
        with self._resume.get_lock():
            self._resume.value = max(self._resume.value, until)

    async def _reserve(self) -> float:
        with self._next_slot.get_lock():
            given_back = list(self._given_back[:self._given_back_count.value])
            slot, self._next_slot.value = take_pace_slot(self._next_slot.value, self._now(), self._interval,
                                                         given_back)
            self._given_back[:len(given_back)] = given_back
            self._given_back_count.value = len(given_back)
        return slot

    def _give_back(self, slot: float) -> None:
        with self._next_slot.get_lock():
            if (count := self._given_back_count.value) < GIVEN_BACK_MOST:
                self._given_back[count] = slot
                self._given_back_count.value = count + 1
