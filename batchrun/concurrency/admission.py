"""One model request's admission against the run-wide limit, whatever holds the limit: a slot taken before
the request goes, held while it is in flight, and what came of it told to the controller."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Protocol

from batchrun.concurrency.aimd import Outcome, Ticket


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

    def retrying(self, change: int, cause: str = "") -> None:
        """``change`` more of this holder's requests wait to go again after a failure (see note_retrying)."""

    async def failed(self, seen: int) -> tuple[int, bool]:
        """A request failed as only an endpoint that is down fails it (see note_failure)."""


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
