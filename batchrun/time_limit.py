"""Awaiting something under a time limit without a task of its own.

``asyncio.wait_for`` (before Python 3.12) runs what it waits for as a new task: two more turns of
the event loop to start and to finish it. With hundreds of sessions in one loop each turn waits
behind every other session's work, so on a tool call's path those turns cost milliseconds of wall
time per call. ``asyncio.timeout`` (3.11+) cancels the awaiting task itself and costs none.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(seconds: float | None, awaitable: Awaitable[T]) -> T:
    """``await awaitable``, raising TimeoutError (after cancelling it) once ``seconds`` have passed;
    None means no limit."""
    async with asyncio.timeout(seconds):
        return await awaitable
