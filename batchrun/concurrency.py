"""Adaptive concurrency: how many model requests the whole run keeps in flight at once.

An endpoint with a per-key concurrency limit answers 429 (or 503) to whatever goes beyond it. With more
sessions than that limit, a fixed worker count meets the limit on every round of requests, and a pause
shared by every session only brings them back together. So the run looks for the limit and stays just
under it, the way TCP's congestion window does (AIMD):

* every request is admitted against one run-wide limit on requests in flight: requests, not sessions,
  because a session busy in a tool asks nothing of the endpoint;
* the start, until something first pushes back: every answer raises the limit by one (it doubles per
  round of answers, like TCP's slow start), and while requests wait for a slot it also doubles once
  no request has gone out for START_DOUBLING seconds. A refusal comes back at once, an answer only
  after the model wrote it: against an endpoint that takes many seconds per answer, waiting for
  answers would keep most sessions idle for minutes, while time without a refusal already says the
  server took what it was sent (and against a quick one, answers keep requests going out, and
  answers raise the limit);
* after the start, each answer raises the limit by ``step / limit``, so by ``step`` per round of
  answers; the step doubles every round in which nothing pushed back. After a decrease the step
  starts small: the limit creeps up to where the server refused last and probes past it only after a
  few rounds, yet a raised endpoint limit is found within a few more;
* a 429 or 503 lowers the limit to BACKOFF times (and at least one below) the requests in flight when
  it comes back. Refusals come back at once, so those are the requests the server holds plus the
  refusals still on their way: a burst of refusals walks the limit down to just under what the server
  takes, about a slot per refusal, instead of multiplying it by BACKOFF once per refusal. The step
  starts again at STEP_AFTER_DECREASE;
* a round of answers slower on average than LATENCY_TOLERANCE times the usual lowers it as well: a
  server that queues requests instead of refusing them shows its limit in latency. Whole rounds, not
  single answers, because the first answers to come back are the quickest ones: measured against
  them, the usual answers of an endpoint whose answers vary in length would look like queueing.

Answers move the limit only while requests are waiting for a slot (the limit, not the sessions, holds
the run back) and only if they were sent under the limit as it is now.

The limit stays between 1 and the ceiling (--num_workers: there are never more requests than sessions);
with --adaptive_concurrency=False it stays at the ceiling. The controller is plain functions over
:class:`AimdState`, a ctypes structure, so that the same code runs over shared memory for the worker
processes (:class:`SharedLimit`) and inside the Ray gate actor (batchrun.ray_pool.GateKeeper).
"""

from __future__ import annotations

import asyncio
import ctypes
import enum
import math
import multiprocessing
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

_FORK = multiprocessing.get_context("fork")

INITIAL_LIMIT = 16          # requests at once before anything is known
# While requests wait, the start doubles the limit this often. Longer than a refusal takes to come back
# (one round trip, a new connection's handshakes included), so that a doubling past the server's limit
# is refused before the next one.
START_DOUBLING = 0.5
# A worker whose loop runs its timers this much late was busy (sending what the last doubling let
# out, most often) and may hold refusals it has not read yet: the start's next doubling waits a whole
# START_DOUBLING after it.
LATE_LOOP = 0.1
BACKOFF = 0.95              # a refusal leaves this share of the concurrency at which it came
# Slots per round right after a decrease: the slot given up comes back after three or four rounds.
# A whole slot would probe past the server's limit every round or two when that limit is small (at 8,
# one request in eight or more would be refused).
STEP_AFTER_DECREASE = 0.125
# A round of answers this many times slower than usual means the server is queueing requests. Less would
# take the runner's own load (a busy event loop reads answers late) and the spread of answer lengths for
# queueing.
LATENCY_TOLERANCE = 3.0
UNLIMITED = 1 << 20         # the ceiling of a gate built without one (tests calling the endpoint directly)
# A worker process that died holding the shared lock never releases it; none holds it this long otherwise.
LOCK_TIMEOUT = 1.0


class Outcome(enum.Enum):
    ANSWERED = "answered"        # a reply came: its latency counts
    OVERLOADED = "overloaded"    # 429 or 503: the server has more than it can take
    OTHER = "other"              # any other failure: says nothing about the server's load
    UNSENT = "unsent"            # the slot was given back before a request went out


class AimdState(ctypes.Structure):
    """The whole controller state, plain numbers so that it can live in shared memory."""

    _fields_ = [("limit", ctypes.c_double), ("ceiling", ctypes.c_double), ("adaptive", ctypes.c_bool),
                ("in_flight", ctypes.c_long), ("waiting", ctypes.c_long),   # requests waiting for a slot
                ("starting", ctypes.c_bool),            # nothing has pushed back yet
                ("next_doubling", ctypes.c_double),     # CLOCK_MONOTONIC when the start may double (0: not set)
                ("step", ctypes.c_double),
                ("epoch", ctypes.c_long),               # bumped by every decrease
                ("round_size", ctypes.c_long),          # judged answers that make this round
                ("round_limit", ctypes.c_double),       # the limit when it began
                ("round_answers", ctypes.c_long), ("round_latency", ctypes.c_double),   # so far, seconds summed
                ("usual_latency", ctypes.c_double),     # the lowest mean of a round, raised by latency decreases
                ("lowest", ctypes.c_double), ("highest", ctypes.c_double),
                ("requests", ctypes.c_long), ("overloaded", ctypes.c_long)]


@dataclass(frozen=True)
class Ticket:
    """One admitted request, as the controller needs to judge its outcome."""

    epoch: int          # sent under the limit as it was after this many decreases


@dataclass(frozen=True)
class ConcurrencyFigures:
    """What the live display and statistics.json show."""

    adaptive: bool
    ceiling: int
    limit: int
    lowest: int
    highest: int
    requests: int
    rate_limited: int

    def as_dict(self) -> dict:
        """statistics.json's ``this_run.concurrency`` (docs/report.md)."""
        return {"adaptive": self.adaptive, "ceiling": self.ceiling, "final": self.limit, "min": self.lowest,
                "max": self.highest, "requests": self.requests, "rate_limited_requests": self.rate_limited}


# -- the controller ---------------------------------------------------------------------------------


def reset(state: AimdState, ceiling: int, adaptive: bool) -> AimdState:
    ceiling = max(1, ceiling)
    start = float(min(ceiling, INITIAL_LIMIT) if adaptive else ceiling)
    state.limit = state.lowest = state.highest = start
    state.ceiling, state.adaptive, state.starting = float(ceiling), adaptive, adaptive
    state.step = STEP_AFTER_DECREASE
    state.in_flight = state.waiting = state.epoch = state.requests = state.overloaded = 0
    state.next_doubling = state.usual_latency = 0.0
    _begin_round(state)
    return state


def new_state(ceiling: int, adaptive: bool) -> AimdState:
    return reset(AimdState(), ceiling, adaptive)


def slots(state: AimdState) -> int:
    """Requests the limit lets be in flight at once."""
    return int(state.limit)


def has_room(state: AimdState) -> bool:
    return state.in_flight < slots(state)


def admit(state: AimdState) -> Ticket:
    """Count one request in flight (the caller has checked there is room)."""
    state.in_flight += 1
    return Ticket(epoch=state.epoch)


def finish(state: AimdState, ticket: Ticket, outcome: Outcome, latency: float = 0.0) -> None:
    """A request is over: count it, and let what came of it move the limit."""
    in_flight = state.in_flight      # this request still included
    state.in_flight -= 1
    if outcome is Outcome.UNSENT:
        return
    state.requests += 1
    if outcome is Outcome.OVERLOADED:
        state.overloaded += 1
        if state.adaptive:
            _refused(state, in_flight)
    elif outcome is Outcome.ANSWERED and state.adaptive:
        _answered(state, ticket, latency)


def _refused(state: AimdState, refused_at: int) -> None:
    # At least a whole slot lower: under a small server limit BACKOFF alone would leave as many slots.
    target = min(BACKOFF * refused_at, refused_at - 1.0)
    if target < state.limit:
        _lower(state, target)


def _answered(state: AimdState, ticket: Ticket, latency: float) -> None:
    # Sent under the limit as it is now, while the limit keeps requests waiting: else the answer says
    # nothing about this limit.
    if ticket.epoch != state.epoch or state.waiting == 0:
        return
    state.round_answers += 1
    state.round_latency += latency
    if state.round_answers < state.round_size:
        _raise(state)
    elif _round_slower_than_usual(state, state.round_latency / state.round_answers):
        # What the round's answers raised is taken back: they were the slow ones.
        _lower(state, BACKOFF * min(state.limit, state.round_limit))
        # A model that is simply slower now (longer answers) should cost a few decreases, not the whole
        # limit: each one asks the latency to rise further before the next.
        state.usual_latency /= BACKOFF
    else:
        _raise(state)
        if not state.starting:
            state.step = min(2 * state.step, state.limit)      # at most doubling the limit per round
        _begin_round(state)


def _round_slower_than_usual(state: AimdState, mean: float) -> bool:
    if state.usual_latency == 0.0 or mean < state.usual_latency:
        state.usual_latency = mean
        return False
    return mean > LATENCY_TOLERANCE * state.usual_latency


def _begin_round(state: AimdState) -> None:
    """The next ``slots`` judged answers make a round: the requests in flight under this limit."""
    state.round_size, state.round_limit, state.round_answers, state.round_latency = slots(state), state.limit, 0, 0.0


def _lower(state: AimdState, target: float) -> None:
    state.limit = max(1.0, target)
    state.lowest = min(state.lowest, state.limit)
    state.step, state.starting = STEP_AFTER_DECREASE, False
    state.epoch += 1
    _begin_round(state)


def _raise(state: AimdState) -> None:
    state.limit = min(state.ceiling, state.limit + (1.0 if state.starting else state.step / state.limit))
    state.highest = max(state.highest, state.limit)


def note_sent(state: AimdState, now: float) -> None:
    """A request goes out at ``now``: the start doubles no sooner than START_DOUBLING after it (slots
    whose requests have not gone yet tell nothing of the server)."""
    if state.starting:
        state.next_doubling = max(state.next_doubling, now + START_DOUBLING)


def grow_with_time(state: AimdState, now: float) -> float | None:
    """The start's growth without answers: while requests wait and nothing has pushed back, the limit
    doubles once no request has gone out for START_DOUBLING seconds (``now``: CLOCK_MONOTONIC, which
    every process shares). Callers ask while requests wait for a slot; the answer is how many seconds
    until they should ask again, None once time will not raise the limit any more."""
    if not state.starting or state.limit >= state.ceiling:
        return None
    if state.waiting == 0:
        return START_DOUBLING
    if state.next_doubling == 0.0:      # no request said it went out: those admitted so far go now
        state.next_doubling = now + START_DOUBLING
    if (due := state.next_doubling - now) > 0:
        return due
    state.limit = min(state.ceiling, 2 * state.limit)
    state.highest = max(state.highest, state.limit)
    state.next_doubling = now + START_DOUBLING
    # A round is the answers to what this limit lets out: one begun under the old limit would be made
    # of the quickest answers among more requests than it counts, too quick for the usual latency.
    _begin_round(state)
    return START_DOUBLING if state.limit < state.ceiling else None


def hold_growth(state: AimdState, now: float) -> None:
    """A worker's loop ran late at ``now``: refusals of what it sent last may have come back unread,
    so the start doubles no sooner than START_DOUBLING from now."""
    if state.starting and state.next_doubling:
        state.next_doubling = max(state.next_doubling, now + START_DOUBLING)


def figures(state: AimdState) -> ConcurrencyFigures:
    return ConcurrencyFigures(adaptive=state.adaptive, ceiling=int(state.ceiling), limit=slots(state),
                              lowest=int(state.lowest), highest=int(state.highest), requests=state.requests,
                              rate_limited=state.overloaded)


# -- one request's admission ------------------------------------------------------------------------


class Request:
    """An admitted model request; the caller says what came of it, the gate tells the controller."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.outcome = Outcome.OTHER
        self.latency = 0.0

    def answered(self) -> None:
        self.outcome = Outcome.ANSWERED
        self.latency = time.monotonic() - self.started

    def overloaded(self) -> None:
        self.outcome = Outcome.OVERLOADED


class Limit(Protocol):
    """Where requests get their slots: shared memory (SharedLimit) or the Ray gate actor."""

    async def admit(self) -> Ticket: ...

    def sent(self) -> None:
        """A request admitted earlier goes out now (see :func:`note_sent`)."""

    def finish(self, ticket: Ticket, outcome: Outcome, latency: float = 0.0) -> None: ...


@asynccontextmanager
async def request_slot(limit: Limit, ready: Callable[[], Awaitable[None]]) -> AsyncIterator[Request]:
    """A slot for one request, held while it is in flight. ``ready`` waits out the other limits (a
    pause, a pace) once the slot is held, so that they are checked just before the request goes."""
    ticket = await limit.admit()
    request: Request | None = None
    try:
        await ready()
        limit.sent()
        request = Request()
        yield request
    finally:
        if request is None:
            limit.finish(ticket, Outcome.UNSENT)
        else:
            limit.finish(ticket, request.outcome, request.latency)


# -- the worker processes' shared limit -------------------------------------------------------------


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
            lost, self._held[holder], self._queued[holder] = self._held[holder], 0, 0
            # Summed from what each process counts: one killed between two updates leaves them apart.
            self._state.in_flight, self._state.waiting = sum(self._held), sum(self._queued)
            self._return_slots(lost)
        finally:
            self._lock.release()

    def figures(self) -> ConcurrencyFigures:
        with self._lock:
            return figures(self._state)

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
