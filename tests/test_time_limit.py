"""within(): a time limit on an awaitable, as asyncio.wait_for, without a task of its own."""

from __future__ import annotations

import asyncio
import sys

import pytest

from batchrun.time_limit import within


def test_the_result_comes_back_when_it_is_in_time() -> None:
    async def quick() -> str:
        await asyncio.sleep(0.01)
        return "done"

    assert asyncio.run(within(5, quick())) == "done"


def test_past_the_limit_it_raises_timeout_and_cancels_what_it_awaited() -> None:
    cancelled = []

    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await within(0.05, slow())

    asyncio.run(main())
    assert cancelled == [True]


def test_none_means_no_limit() -> None:
    assert asyncio.run(within(None, asyncio.sleep(0.01, result=7))) == 7


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 has only asyncio.wait_for")
def test_it_runs_in_the_awaiting_task_rather_than_a_new_one() -> None:
    async def current() -> asyncio.Task:
        return asyncio.current_task()

    async def main() -> bool:
        return await within(5, current()) is asyncio.current_task()

    assert asyncio.run(main())
