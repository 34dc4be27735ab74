"""How the container backends call their CLI (docker, podman, apptainer, modal): a real child process
that writes more than it may, or never ends, is stopped and its call answered at once."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import time

import pytest

from batchrun.environments.container_cli import CliResult, call_cli

# A program that writes 1 MiB in one piece through a pipe it first widened to hold it all, then waits:
# the runner's side receives more at once than its reader buffers before it stops reading the pipe.
WIDE_WRITER = ("import fcntl, os, sys, time\n"
               "fcntl.fcntl(1, 1031, 1 << 20)\n"        # F_SETPIPE_SZ
               "os.write(1, b'y' * (1 << 20))\n"
               "time.sleep(60)\n")


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_call_stopped_for_writing_too_much_is_answered_without_waiting_for_its_time_limit():
    """Once the writer is killed the pipe's end must still be seen, though what it had written past the
    limit was never read: else the call waits out its whole time limit and is taken for a stuck one."""
    began = time.monotonic()
    result = asyncio.run(call_cli([sys.executable, "-c", WIDE_WRITER], timeout=20, max_stdout=1000))
    took = time.monotonic() - began
    assert result.overflowed
    assert result.stdout == b"y" * 1001
    gc.collect()
    assert took < 10


# The same, a moment after it starts: what it writes arrives while the runner's loop is held up.
LATE_WIDE_WRITER = "import time\ntime.sleep(0.5)\n" + WIDE_WRITER


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_call_past_its_time_limit_is_killed_and_reaped_though_its_output_was_never_read():
    """The loop, held up (by other sessions' work) from before the output came until past the time limit,
    finds both due at once: the time limit ends the reading with the pipe's output unread. Its pipes are
    read to their end after the kill: else the process is never reaped within the loop (asyncio's wait()
    waits for the pipes' ends too) and is left behind when the loop closes."""
    async def held_up_call() -> CliResult:
        asyncio.get_running_loop().call_later(0.2, time.sleep, 1.5)
        return await call_cli([sys.executable, "-c", LATE_WIDE_WRITER], timeout=1, max_stdout=2 << 20)

    result = asyncio.run(held_up_call())
    gc.collect()
    assert result.returncode is None and not result.overflowed


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_cancelled_call_is_killed_and_its_pipes_closed_though_its_output_was_never_read():
    """A call cancelled (its prompt's time limit) with output arrived but unread: the kill alone leaves
    the pipe's reader stopped, the pipes' end is never seen, and two descriptors are held for the rest of
    the run, every such call two more."""
    async def cancelled_call() -> int:
        before = len(os.listdir("/proc/self/fd"))
        call = asyncio.create_task(call_cli([sys.executable, "-c", LATE_WIDE_WRITER], timeout=30,
                                            max_stdout=2 << 20))
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, time.sleep, 1.5)       # the output arrives meanwhile ...
        loop.call_later(0.21, call.cancel)          # ... and the cancellation with it
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(3)
        return len(os.listdir("/proc/self/fd")) - before

    assert asyncio.run(cancelled_call()) == 0
    gc.collect()
