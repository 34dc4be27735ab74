"""Sharing one call in progress among the sessions of a process that ask the same question at once.

A run starts hundreds of sessions together; without this each would ask the engine whether it runs
and whether the image is there — hundreds of CLI processes for two answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


class SingleFlight:
    """``await flights.run(key, make)``: callers with the same key while a call is running get its
    result (or exception) instead of starting another. Finished calls are forgotten; caching the
    answer is the caller's business."""

    def __init__(self) -> None:
        self._running: dict[Hashable, asyncio.Future] = {}

    async def run(self, key: Hashable, make: Callable[[], Awaitable[T]]) -> T:
        flight = self._running.get(key)
        if flight is None or flight.get_loop() is not asyncio.get_running_loop():
            flight = asyncio.ensure_future(make())
            self._running[key] = flight
            flight.add_done_callback(lambda done: self._forget(key, done))
        # Shielded: one caller being cancelled must not cancel the call the others wait for.
        return await asyncio.shield(flight)

    def _forget(self, key: Hashable, done: asyncio.Future) -> None:
        if self._running.get(key) is done:
            del self._running[key]
        if not done.cancelled():
            done.exception()    # retrieved, so a failure every waiter left behind is not logged as lost
