"""Every task handed to a worker ends in exactly one message, whatever raises on the way."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from types import SimpleNamespace

import pytest

from batchrun import rows, worker_process
from batchrun.messages import Finished, Task

TASK = Task(prompt_index=7, prompt="a prompt", image=None, cwd=None, content_key="key", toolsets=("terminal",),
            unit=7)
# What making a row reads of the run's config (batchrun.config.RunConfig's parts).
CONFIG = SimpleNamespace(output=SimpleNamespace(batch_size=5, discard_no_reasoning=False),
                         endpoint=SimpleNamespace(model="m", api_key="sk-test"), console=SimpleNamespace(log_prefix_chars=100, verbose=False))


class FinishedSession:
    def __init__(self, task: Task, services: object) -> None:
        self.task = task

    async def run(self) -> rows.SessionResult:
        return rows.SessionResult(prompt_index=self.task.prompt_index, content_key=self.task.content_key,
                                  prompt=self.task.prompt, toolsets=["terminal"], offered_tools=["terminal"],
                                  turns=[], api_calls=1, usage=rows.Usage(), wall_time=0.1,
                                  end_reason="final_answer")


def test_an_exception_while_the_row_is_encoded_becomes_a_failure_row(monkeypatch: pytest.MonkeyPatch) -> None:
    encode = worker_process._finished
    calls = []

    def breaks_once(task: Task, result: rows.SessionResult, config: object) -> Finished:
        calls.append(result)
        if len(calls) == 1:
            raise ValueError("the row could not be encoded")
        return encode(task, result, config)

    monkeypatch.setattr(worker_process, "Session", FinishedSession)
    monkeypatch.setattr(worker_process, "_finished", breaks_once)
    services = SimpleNamespace(redact=lambda text: text)
    message = asyncio.run(worker_process.outcome(TASK, services, CONFIG))
    assert isinstance(message, Finished)
    assert message.status == rows.FAILED and message.prompt_index == 7 and message.batch_num == 1
    row = json.loads(message.row)
    assert row["failed"] is True and "the row could not be encoded" in row["error"]


class SessionThatBreaks:
    """A session with a bug that strikes after it has paid for replies."""

    def __init__(self, task: Task, services: object) -> None:
        self.api_calls, self.usage = 0, rows.Usage()

    async def run(self) -> rows.SessionResult:
        self.api_calls = 3
        self.usage.add(rows.Usage(prompt_tokens=200, completion_tokens=40, cost=0.002))
        raise RuntimeError("a bug in the session")


def test_the_failure_row_of_a_session_that_broke_keeps_what_it_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: such a row said 0 calls and no usage, though the replies were paid for.
    monkeypatch.setattr(worker_process, "Session", SessionThatBreaks)
    services = SimpleNamespace(redact=lambda text: text)
    message = asyncio.run(worker_process.outcome(TASK, services, CONFIG))
    assert isinstance(message, Finished) and message.status == rows.FAILED
    row = json.loads(message.row)
    assert row["error_type"] == "internal_error" and "a bug in the session" in row["error"]
    assert (row["api_calls"], row["usage"]["prompt_tokens"], row["usage"]["cost"]) == (3, 200, 0.002)
    assert (message.api_calls, message.usage["cost"]) == (3, 0.002)


class Unsendable:
    """A message the pipe cannot carry, as one the worker has no memory left to pickle."""

    def __reduce__(self) -> tuple:
        raise MemoryError("no memory left to pickle the row")


def send_unsendable(conn) -> None:
    outbox = worker_process._Outbox(conn)
    outbox.put(Unsendable())        # type: ignore[arg-type]
    outbox.put(Unsendable())        # type: ignore[arg-type]
    time.sleep(30)                  # the worker's loop goes on; only its messages stop


def test_a_worker_that_can_no_longer_send_its_rows_ends_instead_of_leaving_the_parent_waiting():
    # The parent fails the prompts of a worker that died and goes on; one that lives on without
    # sending would hold their rows, and the run's end, for ever.
    parent, child = multiprocessing.Pipe()
    process = multiprocessing.get_context("fork").Process(target=send_unsendable, args=(child,))
    process.start()
    process.join(10)
    ended = process.exitcode
    if ended is None:
        process.kill()
        process.join()
    assert ended not in (None, 0)
