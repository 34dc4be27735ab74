"""Every task handed to a worker ends in exactly one message, whatever raises on the way."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from batchrun import rows, worker_process
from batchrun.messages import Finished, Task

TASK = Task(prompt_index=7, prompt="a prompt", image=None, cwd=None, content_key="key", toolsets=("terminal",),
            unit=7)
# What making a row reads of the run's config (batchrun.config.RunConfig's parts).
CONFIG = SimpleNamespace(output=SimpleNamespace(batch_size=5, discard_no_reasoning=False),
                         endpoint=SimpleNamespace(model="m"), console=SimpleNamespace(log_prefix_chars=100))


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
