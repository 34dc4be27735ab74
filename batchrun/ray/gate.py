"""The run-wide rate limits across Ray actors: the :class:`GateKeeper` actor that holds them, and each
session actor's side of them (:class:`RayRateGate`, :class:`KeeperLimit`).

Apart from the session actor and the pool because it is the one place the actors share state: the limit
on model requests at once (adaptive, see batchrun.concurrency), the 429 pause and the requests-per-minute
pace, as batchrun.rate_limit keeps them in shared memory for worker processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections import Counter, deque
from typing import Any

from batchrun import concurrency
from batchrun.concurrency import ConcurrencyFigures, Outcome, Ticket
from batchrun.model import RunFatalError
from batchrun.rate_limit import GIVEN_BACK_MOST, Gate, pace_interval, take_pace_slot

FOLLOW_AGAIN_SECONDS = 1.0


class KeeperLost(RunFatalError):
    """The GateKeeper no longer answers: no session can send a model request under the run's limits. It lives
    on the runner's node, so this is mostly the cluster's head gone with it (the pool says so then). A stop
    of the run, never a failure row of the prompt that asked: its session did nothing wrong."""


async def _answer(call: Any) -> Any:
    """The keeper's answer to ``call`` (an ObjectRef), or KeeperLost where the keeper is gone or cannot be
    reached."""
    from ray.exceptions import RayActorError  # in the actor's process, which has Ray

    try:
        return await call
    except RayActorError as exc:
        raise KeeperLost("the run's rate-limit keeper (a Ray actor on the runner's node) cannot be reached: "
                         f"{type(exc).__name__}") from None


class GateKeeper:
    """The run-wide rate limits (see :class:`batchrun.rate_limit.Gate`) as a tiny actor.

    Request slots are counted per holder (one per session actor), so that a lost actor's slots can be
    given back (:meth:`forget`); requests wait for a slot here, in arrival order."""

    def __init__(self, requests_per_minute: int | None, ceiling: int, adaptive: bool) -> None:
        self._resume_at = 0.0           # wall clock: nodes' monotonic clocks are unrelated
        self._next_slot = 0.0
        self._given_back: list[float] = []
        self._interval = pace_interval(requests_per_minute)
        self._changed = asyncio.Event()
        self._limit = concurrency.new_state(ceiling, adaptive)
        self._held: Counter[str] = Counter()
        self._retrying: Counter[str] = Counter()
        self._lost: set[str] = set()
        self._waiting: deque[tuple[str, asyncio.Future[Ticket]]] = deque()
        self._growth: asyncio.TimerHandle | None = None

    async def admit(self, holder: str) -> Ticket:
        if not self._waiting and concurrency.has_room(self._limit):
            return self._take(holder)
        waiter: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        self._waiting.append((holder, waiter))
        if self._growth is None:
            self._grow_with_time()
        return await waiter

    def _grow_with_time(self) -> None:
        """At the start of the run, time raises the limit while requests wait (concurrency.grow_with_time)."""
        self._growth = None
        self._limit.waiting = len(self._waiting)
        delay = concurrency.grow_with_time(self._limit, time.monotonic())
        self._serve()
        if delay is not None and self._waiting:
            self._growth = asyncio.get_running_loop().call_later(delay, self._grow_with_time)

    async def finish(self, holder: str, ticket: Ticket, outcome: Outcome, latency: float) -> None:
        if holder in self._lost:
            return      # its slots were given back when it was lost
        self._held[holder] -= 1
        self._limit.waiting = len(self._waiting)
        concurrency.finish(self._limit, ticket, outcome, latency)
        self._serve()

    async def forget(self, holder: str) -> None:
        """A session actor was lost: the requests it had in flight are over, and it waits for none."""
        self._lost.add(holder)
        self._limit.in_flight -= self._held.pop(holder, 0)
        self._limit.retrying -= self._retrying.pop(holder, 0)
        self._serve()

    async def retrying(self, holder: str, change: int, cause: str = "") -> None:
        if holder not in self._lost:
            self._retrying[holder] += change
            concurrency.note_retrying(self._limit, change, cause)

    async def failed(self, seen: int) -> tuple[int, bool]:
        return concurrency.note_failure(self._limit, seen, time.time())

    async def figures(self) -> ConcurrencyFigures:
        # Its times are the keeper's: nodes' clocks may disagree.
        return dataclasses.replace(concurrency.figures(self._limit, time.time()),
                                   pause_left=max(0.0, self._resume_at - time.time()))

    def _take(self, holder: str) -> Ticket:
        self._held[holder] += 1
        concurrency.note_sent(self._limit, time.monotonic())     # see KeeperLimit.sent
        return concurrency.admit(self._limit)

    def _serve(self) -> None:
        while self._waiting and concurrency.has_room(self._limit):
            holder, waiter = self._waiting.popleft()
            if holder in self._lost:
                waiter.cancel()
            elif not waiter.cancelled():
                waiter.set_result(self._take(holder))

    async def pause(self, until: float) -> None:
        if until > self._resume_at:
            self._resume_at = until
            self._changed.set()
            self._changed = asyncio.Event()

    async def next_pause(self, known: float) -> float:
        """The pause end, as soon as it is later than ``known`` (a long poll)."""
        while self._resume_at <= known:
            await self._changed.wait()
        return self._resume_at

    async def reserve(self) -> float:
        slot, self._next_slot = take_pace_slot(self._next_slot, time.time(), self._interval, self._given_back)
        return slot

    async def give_back(self, slot: float) -> None:
        if len(self._given_back) < GIVEN_BACK_MOST:
            self._given_back.append(slot)


class KeeperLimit:
    """One actor's side of the run-wide request slots the GateKeeper holds (concurrency.Limit)."""

    def __init__(self, keeper: Any) -> None:
        self._keeper = keeper
        self.holder = secrets.token_hex(8)     # this actor's name at the keeper: one per unpickled copy

    async def admit(self) -> Ticket:
        admitted = self._keeper.admit.remote(self.holder)
        try:
            return await _answer(admitted)
        except asyncio.CancelledError:
            # The keeper hands the slot out all the same once one is free: give it back then.
            asyncio.ensure_future(self._give_back(admitted))
            raise

    def sent(self) -> None:
        """The keeper counts a request as gone when it hands out its slot: one more call to it per
        request, to say so a moment later, would cost more than the difference."""

    def finish(self, ticket: Ticket, outcome: Outcome, latency: float = 0.0) -> None:
        self._keeper.finish.remote(self.holder, ticket, outcome, latency)

    def retrying(self, change: int, cause: str = "") -> None:
        self._keeper.retrying.remote(self.holder, change, cause)

    async def failed(self, seen: int) -> tuple[int, bool]:
        replies, held = await _answer(self._keeper.failed.remote(seen))
        return int(replies), bool(held)

    async def _give_back(self, admitted: Any) -> None:
        try:
            ticket = await admitted
        except Exception:
            return
        self.finish(ticket, Outcome.UNSENT)


class RayRateGate(Gate):
    """The gate inside an actor: one limit on model requests at once across every actor, a 429
    anywhere pauses every actor's new requests, and the requests-per-minute pace is one sequence of
    slots for the whole run, all kept by the :class:`GateKeeper`."""

    def __init__(self, keeper: Any, requests_per_minute: int | None, adaptive: bool) -> None:
        super().__init__(requests_per_minute)
        self._keeper = keeper
        self._requests_per_minute = requests_per_minute
        self._resume = 0.0
        self._follower: asyncio.Future[None] | None = None
        self.adaptive = adaptive
        self.limit: KeeperLimit = KeeperLimit(keeper)

    def __reduce__(self) -> tuple[Any, ...]:
        return RayRateGate, (self._keeper, self._requests_per_minute, self.adaptive)

    def _now(self) -> float:
        return time.time()        # wall clock: nodes' monotonic clocks are unrelated

    def _resume_at(self) -> float:
        if self._follower is None:
            self._follower = asyncio.ensure_future(self._follow())
        return self._resume

    def _pause_until(self, until: float) -> None:
        self._resume = max(self._resume, until)
        self._keeper.pause.remote(until)

    async def _reserve(self) -> float:
        return float(await _answer(self._keeper.reserve.remote()))

    def _give_back(self, slot: float) -> None:
        self._keeper.give_back.remote(slot)

    async def _follow(self) -> None:
        """Learn of other actors' pauses as they happen. A poll that fails is made again a second later: the
        keeper out of reach for a moment (ActorUnavailableError) must not leave this actor deaf to pauses for
        the rest of the run. A keeper gone for good ends it (the next admission says so: KeeperLost), and so
        does any other failure, which another poll would only meet again."""
        from ray.exceptions import ActorUnavailableError  # in the actor's process, which has Ray

        while True:
            try:
                self._resume = max(self._resume, await self._keeper.next_pause.remote(self._resume))
            except ActorUnavailableError:
                await asyncio.sleep(FOLLOW_AGAIN_SECONDS)
            except Exception:
                return
