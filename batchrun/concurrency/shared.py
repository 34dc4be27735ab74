"""The run-wide limit for the worker processes: the controller's state in shared memory, its free slots a
process-shared semaphore, and each process's line of sessions waiting for a slot."""

from __future__ import annotations

import asyncio
import ctypes
import math
import multiprocessing
import threading
import time
from collections import deque

from batchrun.concurrency.aimd import (
    AimdState,
    ConcurrencyFigures,
    Outcome,
    Ticket,
    admit,
    figures,
    finish,
    grow_with_time,
    hold_growth,
    note_failure,
    note_retrying,
    note_sent,
    reset,
    slots,
)

_FORK = multiprocessing.get_context("fork")
# A worker whose loop runs its timers this much late was busy (sending what the last doubling let
# out, most often) and may hold refusals it has not read yet: the start's next doubling waits a whole
# START_DOUBLING after it.
LATE_LOOP = 0.1
# A worker process that died holding the shared lock never releases it; none holds it this long otherwise.
LOCK_TIMEOUT = 1.0


class SharedLimit:
    """The run-wide limit for the worker processes, in shared memory; forked children inherit it.

    Free slots are a process-shared semaphore, so a session waiting in one process is woken by a request
    finishing in another without polling; each process takes its share of them. A lower limit takes free
    slots back, or owes them (``debt``) until requests in flight finish. Each process counts the slots it
    holds and the requests it has waiting, so that a worker process that dies leaves neither behind
    (:meth:`reclaim`).
    """

    def __init__(self, ceiling: int, adaptive: bool, holders: int = 1) -> None:
        self.adaptive = adaptive
        self._state = reset(_FORK.RawValue(AimdState), ceiling, adaptive)
        self._held = _FORK.RawArray(ctypes.c_long, holders)    # slots per worker process
        self._queued = _FORK.RawArray(ctypes.c_long, holders)  # requests waiting, per worker process
        self._retrying = _FORK.RawArray(ctypes.c_long, holders)  # requests waiting to retry, per process
        self._debt = _FORK.RawValue(ctypes.c_long, 0)
        self._lock = _FORK.Lock()
        self._free = _FORK.Semaphore(slots(self._state))
        self._holder = 0
        self._line: _Line | None = None          # this process's waiting sessions, made on first use

    def bind(self, holder: int) -> None:
        """In a worker process: the slots it takes are counted as worker ``holder``'s."""
        self._holder = holder

    async def admit(self) -> Ticket:
        if self._line is None:
            self._line = _Line(self)
        return await self._line.admit()

    def sent(self) -> None:
        # Read without the lock: neither comes back once over (only a decrease lowers the limit from
        # the ceiling, and it ends the start), and an endpoint that never pushes back keeps the start.
        if self._state.starting and self._state.limit < self._state.ceiling:
            with self._lock:
                note_sent(self._state, time.monotonic())

    def try_take(self) -> Ticket | None:
        """A slot at once, if one is free."""
        if not self._free.acquire(False):
            return None
        with self._lock:
            return self._take()

    def join_line(self) -> None:
        """One more request of this process waits for a slot (the line fetches one for it)."""
        with self._lock:
            self._queued[self._holder] += 1
            self._state.waiting += 1

    def wait_and_take(self, most: int) -> list[Ticket]:
        """Slots for up to ``most`` requests in the line: blocking this thread until one is free, then
        this process's share of the others free, by the requests each process has waiting (one
        process taking them all would leave its loop to send them alone while the others idle)."""
        self._free.acquire()
        with self._lock:
            free = 1 + self._free.get_value()
            share = math.ceil(free * self._queued[self._holder] / max(1, self._state.waiting))
            count = 1
            while count < min(most, share) and self._free.acquire(False):
                count += 1
            self._queued[self._holder] -= count
            self._state.waiting -= count
            return [self._take() for _ in range(count)]

    def _take(self) -> Ticket:
        self._held[self._holder] += 1
        return admit(self._state)

    def finish(self, ticket: Ticket, outcome: Outcome, latency: float = 0.0) -> None:
        with self._lock:
            self._held[self._holder] -= 1
            before = slots(self._state)
            finish(self._state, ticket, outcome, latency)
            self._return_slots(1)
            self._resize(before)

    def retrying(self, change: int, cause: str = "") -> None:
        with self._lock:
            self._retrying[self._holder] += change
            note_retrying(self._state, change, cause)

    async def failed(self, seen: int) -> tuple[int, bool]:
        with self._lock:
            return note_failure(self._state, seen, time.time())

    def grow_with_time(self, *, hold: bool = False) -> float | None:
        """The start's growth with time (:func:`grow_with_time`), or with ``hold`` its next doubling
        postponed (:func:`hold_growth`); the seconds until it should be asked again."""
        with self._lock:
            before = slots(self._state)
            if hold:
                hold_growth(self._state, time.monotonic())
            delay = grow_with_time(self._state, time.monotonic())
            self._resize(before)
            return delay

    def reclaim(self, holder: int) -> None:
        """In the parent, once worker ``holder`` has died: its slots are free again."""
        # Not acquired in time: it died holding the lock. The lock is a semaphore, so the release
        # below frees it.
        self._lock.acquire(timeout=LOCK_TIMEOUT)
        try:
            lost, self._held[holder], self._queued[holder], self._retrying[holder] = self._held[holder], 0, 0, 0
            # Summed from what each process counts: one killed between two updates leaves them apart.
            self._state.in_flight, self._state.waiting = sum(self._held), sum(self._queued)
            self._state.retrying = sum(self._retrying)
            self._return_slots(lost)
        finally:
            self._lock.release()

    def figures(self) -> ConcurrencyFigures:
        with self._lock:
            return figures(self._state, time.time())

    def _return_slots(self, count: int) -> None:
        for _ in range(count):
            if self._debt.value:
                self._debt.value -= 1
            else:
                self._free.release()

    def _resize(self, before: int) -> None:
        after = slots(self._state)
        self._return_slots(max(0, after - before))
        for _ in range(before - after):
            if not self._free.acquire(False):
                self._debt.value += 1


class _Line:
    """One process's sessions waiting for a slot, in arrival order. A thread of its own blocks on the
    shared semaphore while any wait and hands the slots it gets to the first of them: all the free
    slots they want in one wake-up of the loop, because each wake-up waits for the loop to let go of
    the interpreter, and a busy loop does so only every few milliseconds.

    While sessions wait at the start of the run, the loop (not the thread) asks for the limit's growth
    with time: the growth assumes that a refusal would have been read by now, which holds only for a
    loop that runs on time."""

    def __init__(self, limit: SharedLimit) -> None:
        self._limit = limit
        self._loop = asyncio.get_running_loop()
        self._waiting: deque[asyncio.Future[Ticket]] = deque()
        self._wanted = 0                          # slots the line still has to fetch
        self._wanted_changed = threading.Condition()
        self._growth: asyncio.TimerHandle | None = None
        self._grown = False                       # time will not raise the limit any more
        threading.Thread(target=self._fetch, name="concurrency-line", daemon=True).start()

    async def admit(self) -> Ticket:
        if not self._waiting and (ticket := self._limit.try_take()) is not None:
            return ticket
        waiter: asyncio.Future[Ticket] = self._loop.create_future()
        self._waiting.append(waiter)
        self._limit.join_line()
        with self._wanted_changed:
            self._wanted += 1
            self._wanted_changed.notify()
        if self._growth is None and not self._grown:
            self.grow(due=self._loop.time())
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():     # handed a slot just as it gave up
                self._limit.finish(waiter.result(), Outcome.UNSENT)
            raise

    def grow(self, due: float) -> None:
        """The timer of the start's growth, meant to run at ``due`` (loop time)."""
        self._growth = None
        if not self._waiting:
            return
        delay = self._limit.grow_with_time(hold=self._loop.time() - due > LATE_LOOP)
        if delay is None:
            self._grown = True
        else:
            self._growth = self._loop.call_later(delay, self.grow, self._loop.time() + delay)

    def _fetch(self) -> None:
        while True:
            with self._wanted_changed:
                self._wanted_changed.wait_for(lambda: self._wanted > 0)
                wanted = self._wanted
            tickets = self._limit.wait_and_take(wanted)
            with self._wanted_changed:
                self._wanted -= len(tickets)
            try:
                self._loop.call_soon_threadsafe(self._hand_over, tickets)
            except RuntimeError:      # the loop is closed: the process is ending
                return

    def _hand_over(self, tickets: list[Ticket]) -> None:
        for ticket in tickets:
            while self._waiting:
                waiter = self._waiting.popleft()
                if not waiter.cancelled():
                    waiter.set_result(ticket)
                    break
            else:
                self._limit.finish(ticket, Outcome.UNSENT)     # whoever wanted it gave up meanwhile
