"""The session loop on its own, over an in-process model that plays a script: what it asks the model
again, what it keeps, and what each call is sent. No HTTP here; tests/test_agent_loop.py checks the
same rules end to end through the CLI and the scripted endpoint."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import threading
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import pytest

import model_tools
from batchrun import rows
from batchrun import session as session_module
from batchrun.config import EndpointConfig, SessionConfig
from batchrun.environments.base import EnvironmentLostError, EnvironmentSettings, EnvironmentSetupError
from batchrun.environments.local import LocalEnvironment
from batchrun.messages import Task
from batchrun.model import CONTEXT_LENGTH, Message, ModelReply, PromptFailedError
from batchrun.pricing import Pricing
from batchrun.rows import AssistantTurn, HumanTurn, SessionResult, Usage
from batchrun.security import Redactor
from batchrun.session import (
    CONTINUE_REQUEST,
    MAX_CONTINUATIONS,
    MAX_EMPTY_RETRIES,
    SUMMARY_REQUEST,
    Session,
    SessionServices,
)

ECHO = {"command": "echo hi"}


def say(content: str, *, finish_reason: str = "stop", **fields: Any) -> ModelReply:
    return ModelReply(message={"role": "assistant", "content": content, **fields}, finish_reason=finish_reason,
                      usage=Usage(prompt_tokens=10, completion_tokens=5))


def call(name: str, arguments: dict[str, Any], **fields: Any) -> ModelReply:
    tool_call = {"id": f"call_{name}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(arguments)}}
    return ModelReply(message={"role": "assistant", "content": "", "tool_calls": [tool_call], **fields},
                      finish_reason="tool_calls", usage=Usage(prompt_tokens=10, completion_tokens=5))


class ScriptedModel:
    """Answers each call with the next reply of its script (an exception is raised instead), and
    keeps what every call was sent."""

    def __init__(self, script: list[ModelReply | Exception]) -> None:
        self.script = list(script)
        self.calls: list[tuple[list[Message], bool]] = []

    async def reply(self, messages: Sequence[Message], *, with_tools: bool,
                    on_send: Callable[[], None] = lambda: None,
                    on_refused: Callable[[Usage, str], None] = lambda usage, cost_source: None) -> ModelReply:
        on_send()
        self.calls.append((copy.deepcopy(list(messages)), with_tools))
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step


class ScriptedModels:
    """The ModelSource of a worker whose every session plays the same script."""

    def __init__(self, model: ScriptedModel) -> None:
        self.scripted = model
        self.offered: list[Sequence[Message]] = []

    def model(self, prompt_index: int, tools: Sequence[Message]) -> ScriptedModel:
        self.offered.append(tools)
        return self.scripted

    def tool_client(self, prompt_index: int) -> None:
        return None

    async def close(self) -> None:
        pass


def session_config(**fields: Any) -> SessionConfig:
    """The command line's defaults for a session; a test changes only what it is about."""
    return SessionConfig(**{"max_turns": 10, "prompt_timeout": None, "tool_timeout": 120.0,
                            "ephemeral_system_prompt": None, "prefill_messages": (), **fields})


# Tools that ask the model themselves would use it; the sessions here are driven by an in-process model.
ENDPOINT = EndpointConfig(model="scripted-model", base_url="http://127.0.0.1:9/v1", api_key="sk-test",
                          max_tokens=None, extra_body={}, max_retries=0, request_timeout=10.0,
                          reasoning_disabled=False, pricing=Pricing("unknown", "not asked"))


TASK = Task(prompt_index=0, prompt="do the task", image=None, cwd=None, content_key="key", toolsets=("terminal",), unit=0)
WITH_FILES = dataclasses.replace(TASK, toolsets=("terminal", "file"))


def worker_services(tmp_path: Path, models: ScriptedModels, **fields: Any) -> SessionServices:
    return SessionServices(config=session_config(**fields), endpoint=ENDPOINT, environment_kind="local", models=models,
                           env_settings=EnvironmentSettings(work_root=tmp_path, run_label="session-test"),
                           available_tools=frozenset(model_tools.TOOL_NAMES), redact=Redactor([]))


def run_session(tmp_path: Path, script: list[ModelReply | Exception], task: Task = TASK,
                **fields: Any) -> tuple[SessionResult, ScriptedModel]:
    model = ScriptedModel(script)
    services = worker_services(tmp_path, ScriptedModels(model), **fields)

    async def session() -> SessionResult:
        try:
            return await Session(task, services).run()
        finally:
            await services.close()

    return asyncio.run(session()), model


def test_an_empty_answer_is_asked_for_again_and_only_the_real_answer_is_kept(tmp_path):
    result, model = run_session(tmp_path, [say(""), say("The answer.")])
    assert (result.end_reason, result.api_calls) == ("final_answer", 2)
    assert result.turns == [AssistantTurn(reasoning="", content="The answer.")]
    assert model.calls[0][0] == model.calls[1][0]     # asked again with the same conversation


def test_an_answer_that_stays_empty_after_a_kept_turn_ends_the_session_with_empty_answer(tmp_path):
    result, _ = run_session(tmp_path, [call("terminal", ECHO)] + [say("")] * (MAX_EMPTY_RETRIES + 1))
    assert (result.end_reason, len(result.turns)) == ("empty_answer", 1)


@pytest.mark.parametrize("script, cause", [
    ([say("")] * (MAX_EMPTY_RETRIES + 1), "empty_answer"),
    ([say("<think>only thoughts</think>")] * (MAX_EMPTY_RETRIES + 1), "empty_answer"),
    ([say("", reasoning="thinking on and on", finish_reason="length")], "truncated"),
    ([say("")] * 2, "max_turns"),
], ids=["empty_answers", "think_blocks_only", "reasoning_cut_off", "max_turns_of_empty_answers"])
def test_a_session_that_kept_no_reply_is_a_failure_naming_its_cause(tmp_path, script, cause):
    """Nothing to train on, and nothing that says the prompt cannot work: resume runs it again."""
    result, _ = run_session(tmp_path, script, max_turns=2 if cause == "max_turns" else 10)
    assert (result.end_reason, result.error_type, result.turns) == ("error", cause, [])
    assert result.error
    assert result.api_calls == len(script)


def test_a_session_that_kept_no_reply_by_max_turns_does_not_claim_a_summary_was_asked_for(tmp_path):
    result, model = run_session(tmp_path, [say("")] * 2, max_turns=2)
    assert len(model.calls) == 2
    assert result.error == "the model gave no reply with text or a tool call: --max_turns model calls were made"


def test_a_cut_off_answer_is_asked_to_continue_and_every_piece_is_kept(tmp_path):
    result, model = run_session(tmp_path, [say("First half", finish_reason="length"), say("second half.")])
    assert result.end_reason == "final_answer"
    assert result.turns == [AssistantTurn(reasoning="", content="First half"), HumanTurn(CONTINUE_REQUEST),
                            AssistantTurn(reasoning="", content="second half.")]
    assert model.calls[1][0][-2:] == [{"role": "assistant", "content": "First half"},
                                      {"role": "user", "content": CONTINUE_REQUEST}]


def test_a_context_overflow_after_a_tool_turn_keeps_that_turn(tmp_path):
    overflow = PromptFailedError("the conversation no longer fits the model's context", CONTEXT_LENGTH)
    result, _ = run_session(tmp_path, [call("terminal", ECHO), overflow])
    assert (result.end_reason, result.error) == (CONTEXT_LENGTH, None)
    [turn] = result.turns
    assert isinstance(turn, AssistantTurn) and turn.tool_calls[0].name == "terminal"
    assert "hi" in (turn.tool_calls[0].result or "")


def test_a_context_overflow_before_any_answer_fails_the_prompt(tmp_path):
    overflow = PromptFailedError("the conversation no longer fits the model's context", CONTEXT_LENGTH)
    result, _ = run_session(tmp_path, [overflow])
    assert (result.end_reason, result.error_type) == ("error", CONTEXT_LENGTH)


def test_at_max_turns_one_call_without_tools_asks_for_a_summary(tmp_path):
    script = [call("terminal", ECHO), call("terminal", ECHO), say("What I found.")]
    result, model = run_session(tmp_path, script, max_turns=2)
    assert (result.end_reason, result.api_calls) == ("max_turns", 3)
    assert [with_tools for _, with_tools in model.calls] == [True, True, False]
    assert model.calls[-1][0][-1] == {"role": "user", "content": SUMMARY_REQUEST}
    assert result.turns[-2:] == [HumanTurn(SUMMARY_REQUEST), AssistantTurn(reasoning="", content="What I found.")]


def test_a_summary_that_fails_leaves_the_session_ending_on_its_last_tool_turn(tmp_path):
    script = [call("terminal", ECHO), call("terminal", ECHO), PromptFailedError("HTTP 400: no", "http_400")]
    result, _ = run_session(tmp_path, script, max_turns=2)
    assert (result.end_reason, result.error) == ("max_turns", None)
    assert [type(turn) for turn in result.turns] == [AssistantTurn, AssistantTurn]


def test_calling_a_tool_that_was_not_offered_three_turns_running_ends_with_invented_tools(tmp_path):
    result, model = run_session(tmp_path, [call("web_search", {"query": "x"})] * 3)
    assert result.end_reason == "invented_tools"
    answer = json.loads(model.calls[1][0][-1]["content"])
    assert "unknown tool 'web_search'" in answer["error"] and "terminal" in answer["error"]


@pytest.mark.parametrize("form", ["reasoning", "reasoning_content", "reasoning_details"])
def test_reasoning_goes_back_to_the_model_exactly_as_it_came(tmp_path, form):
    reasoning: Any = [{"type": "reasoning.text", "text": "Because.", "signature": "sig"}] \
        if form == "reasoning_details" else "Because."
    result, model = run_session(tmp_path, [call("terminal", ECHO, **{form: reasoning}), say("Done.")])
    assert result.end_reason == "final_answer"
    echoed = model.calls[1][0][-2]
    assert echoed["role"] == "assistant" and echoed[form] == reasoning


def test_the_model_is_built_offering_the_schemas_of_the_offered_tools(tmp_path):
    source = ScriptedModels(ScriptedModel([]))
    session = Session(TASK, worker_services(tmp_path, source))
    assert [schema["function"]["name"] for schema in source.offered[0]] == session.offered_tools == ["terminal"]


# --- counters that are per reply ------------------------------------------------------------------

def cut(reply: ModelReply) -> ModelReply:
    return ModelReply(message=reply.message, finish_reason="length", usage=reply.usage)


def test_tool_calls_cut_once_in_each_of_two_replies_are_asked_for_again_each_time(tmp_path):
    script = [cut(call("terminal", ECHO)), call("terminal", ECHO), cut(call("terminal", ECHO)),
              call("terminal", ECHO), say("Done.")]
    result, _ = run_session(tmp_path, script)
    assert (result.end_reason, len(result.turns), result.api_calls) == ("final_answer", 3, 5)


def test_tool_calls_cut_twice_in_one_reply_end_the_session_truncated(tmp_path):
    script = [call("terminal", ECHO), cut(call("terminal", ECHO)), cut(call("terminal", ECHO))]
    result, _ = run_session(tmp_path, script)
    assert (result.end_reason, len(result.turns)) == ("truncated", 1)


def test_each_answer_gets_its_own_requests_after_an_empty_reply(tmp_path):
    script = [*[say("")] * MAX_EMPTY_RETRIES, call("terminal", ECHO), *[say("")] * MAX_EMPTY_RETRIES, say("Done.")]
    result, _ = run_session(tmp_path, script, max_turns=len(script))
    assert (result.end_reason, len(result.turns)) == ("final_answer", 2)


def test_each_cut_off_answer_gets_its_own_requests_to_continue(tmp_path):
    script = [*[say("part", finish_reason="length")] * MAX_CONTINUATIONS, call("terminal", ECHO),
              *[say("part", finish_reason="length")] * MAX_CONTINUATIONS, say("Done.")]
    result, _ = run_session(tmp_path, script, max_turns=len(script))
    assert result.end_reason == "final_answer"


# --- api_calls ----------------------------------------------------------------------------------------

def test_the_request_that_overflowed_the_context_counts_as_a_call(tmp_path):
    overflow = PromptFailedError("the conversation no longer fits the model's context", CONTEXT_LENGTH)
    result, _ = run_session(tmp_path, [call("terminal", ECHO), overflow])
    assert (result.end_reason, result.api_calls) == (CONTEXT_LENGTH, 2)


def test_a_request_that_failed_the_prompt_counts_as_a_call(tmp_path):
    result, _ = run_session(tmp_path, [say(""), PromptFailedError("HTTP 400: refused", "http_400")])
    assert (result.error_type, result.api_calls) == ("http_400", 2)


# --- what the model sends is never trusted ------------------------------------------------------------

def raw_call(name: str, arguments: str, call_id: str = "call_1") -> ModelReply:
    return ModelReply(message={"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        finish_reason="tool_calls", usage=Usage())


def test_arguments_nested_too_deep_to_parse_cost_one_failed_tool_call(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    result, model = run_session(tmp_path, [raw_call("terminal", deep), say("Done.")])
    assert result.end_reason == "final_answer"
    [answered] = result.turns[0].tool_calls
    assert "nested" in json.loads(answered.result or "")["error"]
    rows.encode_finished(result, batch_num=0, model="m", timestamp="t", discard_no_reasoning=False)


SECRET = "sk-test-ECHOED-0123456789abcdef"


def run_redacting_session(tmp_path: Path, script: list[ModelReply | Exception]) -> tuple[SessionResult, bytes]:
    """The session run by a worker that redacts SECRET, and the row it makes."""
    services = worker_services(tmp_path, ScriptedModels(ScriptedModel(script)))
    services.redact = Redactor([SECRET])

    async def session() -> SessionResult:
        try:
            return await Session(TASK, services).run()
        finally:
            await services.close()

    result = asyncio.run(session())
    return result, rows.encode_finished(result, batch_num=0, model="m", timestamp="t", discard_no_reasoning=False)


def test_a_secret_the_endpoint_echoes_never_reaches_the_record_or_the_tool(tmp_path):
    script = [ModelReply(message={"role": "assistant", "content": f"The key is {SECRET}.", "reasoning": f"I saw {SECRET}",
                                  "tool_calls": [{"id": f"id-{SECRET}", "type": "function", "function": {
                                      "name": "terminal", "arguments": json.dumps({"command": f"echo '{SECRET}'"})}}]},
                          finish_reason="tool_calls", usage=Usage()),
              say(f"Done with {SECRET[:20]}")]
    result, line = run_redacting_session(tmp_path, script)
    assert SECRET[:8].encode() not in line and b"[REDACTED]" in line
    [answered] = result.turns[0].tool_calls
    assert json.loads(answered.result or "")["output"] == "[REDACTED]\n"     # the command never held it


def escaped(text: str) -> str:
    """``text`` with every character written as a JSON \\u escape, as a model may write any of them."""
    return "".join(f"\\u{ord(char):04x}" for char in text)


@pytest.mark.parametrize("hidden", [f"\\u0073{SECRET[1:-1]}\\u0066", escaped(SECRET), f"{SECRET[:5]}{escaped(SECRET[5:9])}{SECRET[9:]}"],
                         ids=["first-and-last", "every-character", "middle"])
def test_a_secret_hidden_by_json_escapes_in_arguments_never_reaches_the_tool_or_the_record(tmp_path, hidden):
    arguments = '{"command": "echo \'' + hidden + '\' | rev"}'
    assert json.loads(arguments)["command"] == f"echo '{SECRET}' | rev"
    result, line = run_redacting_session(tmp_path, [raw_call("terminal", arguments), say("Done.")])
    [answered] = result.turns[0].tool_calls
    assert json.loads(answered.arguments) == {"command": "echo '[REDACTED]' | rev"}
    assert SECRET[::-1][:8] not in json.loads(answered.result or "")["output"]     # the command never held it
    assert SECRET[:8].encode() not in line and b"[REDACTED]" in line


def test_arguments_without_a_secret_are_kept_as_the_model_wrote_them(tmp_path):
    arguments = '{"command":  "echo \\u0068i"}'
    result, _ = run_session(tmp_path, [raw_call("terminal", arguments), say("Done.")])
    [answered] = result.turns[0].tool_calls
    assert answered.arguments == arguments


FILE_TASK = Task(prompt_index=0, prompt="write it", image=None, cwd=None, content_key="key",
                 toolsets=("terminal", "file"), unit=0)


def run_file_session(tmp_path: Path, script: list[ModelReply | Exception], limit: int) -> SessionResult:
    services = worker_services(tmp_path, ScriptedModels(ScriptedModel(script)))
    services.env_settings.max_file_bytes = limit

    async def session() -> SessionResult:
        try:
            return await Session(FILE_TASK, services).run()
        finally:
            await services.close()

    return asyncio.run(session())


def test_arguments_larger_than_the_tool_takes_are_stored_cut_with_their_size(tmp_path):
    arguments = json.dumps({"path": "big.txt", "content": "x" * 50_000})
    result = run_file_session(tmp_path, [raw_call("write_file", arguments), say("Done.")], limit=10_000)
    [stored] = result.turns[0].tool_calls
    assert json.loads(stored.result or "")["error"]          # the tool refused it
    assert len(stored.arguments) < 5_000 and stored.arguments.startswith(arguments[:1_000])
    assert f"{len(arguments):,} characters" in stored.arguments


def test_arguments_the_tool_took_are_stored_whole(tmp_path):
    arguments = json.dumps({"path": "small.txt", "content": "x" * 5_000})
    result = run_file_session(tmp_path, [raw_call("write_file", arguments), say("Done.")], limit=10_000)
    [stored] = result.turns[0].tool_calls
    assert json.loads(stored.result or "")["bytes_written"] == 5_000
    assert stored.arguments == arguments


def test_the_prompts_directory_is_gone_before_its_session_returns_the_result(tmp_path):
    # The row is written after the session returns: a prompt that filled the disk frees it first.
    services = worker_services(tmp_path, ScriptedModels(ScriptedModel(
        [call("terminal", {"command": "head -c 100000 /dev/zero > big"}), say("Done.")])))

    async def session() -> bool:
        try:
            session = Session(TASK, services)
            await session.run()
            assert session.env is not None
            return session.env.prompt_dir.exists()      # type: ignore[attr-defined]  # the local backend's
        finally:
            await services.close()
    assert asyncio.run(session()) is False


# ---------------------------------------------------------------------------------------------
# The environment's start and the first model call


class StartWatch:
    """Replaces the local backend's start: it waits until the model has been called (or not, with
    ``wait_for_call=False``), can fail, and notes what happened in which order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, wait_for_call: bool = True,
                 failure: str | None = None, forever: bool = False) -> None:
        self.events: list[str] = []
        self.forever = forever
        self.model_called: asyncio.Event | None = None      # made on the session's loop
        self.start_begun: asyncio.Event | None = None
        self.closed = 0
        original_start, original_close = LocalEnvironment.start, LocalEnvironment.close
        watch = self

        async def start(env: LocalEnvironment) -> None:
            watch.events.append("start begun")
            watch.begun().set()
            if forever:
                await asyncio.Event().wait()
            if wait_for_call:
                await asyncio.wait_for(watch.called().wait(), 5)      # 5 s: the call never came first
            if failure:
                raise EnvironmentSetupError(failure)
            await original_start(env)
            watch.events.append("started")

        async def close(env: LocalEnvironment) -> None:
            watch.closed += 1
            await original_close(env)

        monkeypatch.setattr(LocalEnvironment, "start", start)
        monkeypatch.setattr(LocalEnvironment, "close", close)

    def called(self) -> asyncio.Event:
        if self.model_called is None:
            self.model_called = asyncio.Event()
        return self.model_called

    def begun(self) -> asyncio.Event:
        if self.start_begun is None:
            self.start_begun = asyncio.Event()
        return self.start_begun


class WatchedModel(ScriptedModel):
    def __init__(self, script: list[ModelReply | Exception], watch: StartWatch) -> None:
        super().__init__(script)
        self.watch = watch

    async def reply(self, messages: Sequence[Message], *, with_tools: bool,
                    on_send: Callable[[], None] = lambda: None,
                    on_refused: Callable[[Usage, str], None] = lambda usage, cost_source: None) -> ModelReply:
        on_send()
        if self.watch.forever:      # the start is under way when the session ends
            await self.watch.begun().wait()
        self.watch.events.append("model called")
        self.watch.called().set()
        return await super().reply(messages, with_tools=with_tools)


def run_watched(tmp_path: Path, watch: StartWatch, script: list[ModelReply | Exception],
                task: Task = TASK) -> SessionResult:
    services = worker_services(tmp_path, ScriptedModels(WatchedModel(script, watch)))

    async def session() -> SessionResult:
        try:
            return await Session(task, services).run()
        finally:
            await services.close()
    return asyncio.run(session())


def test_the_first_model_call_goes_out_while_a_sandbox_starts(tmp_path, monkeypatch):
    watch = StartWatch(monkeypatch)
    result = run_watched(tmp_path, watch, [call("terminal", ECHO), say("Done.")])
    assert result.end_reason == "final_answer" and result.error is None
    assert json.loads(result.turns[0].tool_calls[0].result or "")["output"].strip() == "hi"
    assert watch.events.index("model called") < watch.events.index("started")


class HeldModel(ScriptedModel):
    """Its first request waits for a slot (``release``) before it goes out, as under a concurrency limit."""

    def __init__(self, script: list[ModelReply | Exception], events: list[str]) -> None:
        super().__init__(script)
        self.events = events
        self.release: asyncio.Event | None = None       # made on the session's loop

    async def reply(self, messages: Sequence[Message], *, with_tools: bool,
                    on_send: Callable[[], None] = lambda: None,
                    on_refused: Callable[[Usage, str], None] = lambda usage, cost_source: None) -> ModelReply:
        if not self.calls:
            self.release = asyncio.Event()
            await self.release.wait()
        self.events.append("request sent")
        on_send()
        return await super().reply(messages, with_tools=with_tools)


def test_a_sandbox_does_not_start_while_the_first_request_waits_for_a_slot(tmp_path, monkeypatch):
    watch = StartWatch(monkeypatch, wait_for_call=False)
    model = HeldModel([call("terminal", ECHO), say("Done.")], watch.events)
    services = worker_services(tmp_path, ScriptedModels(model))

    async def session() -> tuple[list[str], SessionResult]:
        try:
            running = asyncio.ensure_future(Session(TASK, services).run())
            await asyncio.sleep(0.2)
            before = list(watch.events)
            assert model.release is not None
            model.release.set()
            return before, await running
        finally:
            await services.close()
    before, result = asyncio.run(session())
    assert before == []
    assert result.end_reason == "final_answer" and result.error is None
    assert watch.events[:2] == ["request sent", "start begun"]


def test_an_environment_whose_start_can_fail_for_one_prompt_starts_before_any_model_call(tmp_path, monkeypatch):
    monkeypatch.setattr(LocalEnvironment, "start_can_fail_alone", True)     # as a container backend's
    watch = StartWatch(monkeypatch, wait_for_call=False)
    run_watched(tmp_path, watch, [call("terminal", ECHO), say("Done.")])
    assert watch.events[:3] == ["start begun", "started", "model called"]


def test_a_row_with_a_cwd_starts_its_environment_before_any_model_call(tmp_path, monkeypatch):
    watch = StartWatch(monkeypatch, wait_for_call=False)
    task = Task(prompt_index=0, prompt="do the task", image=None, cwd="src", content_key="key", toolsets=("terminal",), unit=0)
    run_watched(tmp_path, watch, [call("terminal", ECHO), say("Done.")], task)
    assert watch.events[:3] == ["start begun", "started", "model called"]


def test_an_environment_that_cannot_start_fails_the_prompt_at_its_first_tool_call(tmp_path, monkeypatch):
    watch = StartWatch(monkeypatch, failure="the sandbox did not start: no message")
    result = run_watched(tmp_path, watch, [call("terminal", ECHO), say("Done.")])
    assert (result.error_type, result.error, result.api_calls) == (
        "environment", "the sandbox did not start: no message", 1)


# An environment lost mid-prompt (its container engine died, its container removed behind the runner's
# back) answered every later command with an error, and the model went on to a row that passed for
# completed: never run again, though nothing it did after the loss ran.
def test_an_environment_lost_mid_prompt_fails_the_prompt_for_resume(tmp_path, monkeypatch):
    async def lost(env: LocalEnvironment, command: str, timeout: float | None = None) -> None:
        raise EnvironmentLostError("the command could not run to its end in the container: no such container")

    monkeypatch.setattr(LocalEnvironment, "run", lost)
    result, _ = run_session(tmp_path, [call("terminal", ECHO), say("Done anyway.")])
    assert (result.error_type, result.error, result.api_calls) == (
        "environment", "the command could not run to its end in the container: no such container", 1)


def test_a_prompt_that_ends_before_its_environment_started_cuts_the_start_short(tmp_path, monkeypatch):
    watch = StartWatch(monkeypatch, forever=True)
    result = run_watched(tmp_path, watch, [say("No tools needed.")])
    assert result.end_reason == "final_answer" and result.error is None
    assert watch.closed >= 1 and "started" not in watch.events
    assert not list(tmp_path.iterdir())       # the directory it began with is gone


def run_beside(services: SessionServices, another_session: Callable[[], Coroutine[Any, Any, None]],
               task: Task = TASK) -> SessionResult:
    """``task``'s session, with ``another_session`` running on the same event loop until it ends, as the
    worker's other sessions do."""
    async def both() -> SessionResult:
        other = asyncio.create_task(another_session())
        try:
            return await Session(task, services).run()
        finally:
            other.cancel()
            await services.close()
    return asyncio.run(both())


def test_the_worker_keeps_serving_its_other_sessions_while_a_huge_reply_is_read(tmp_path, monkeypatch):
    # Half a megabyte of tiny think blocks takes a good fraction of a second to take apart; the other
    # sessions of the worker share its event loop, and must not wait for it.
    huge = "<think>a</think>b" * 30_000
    reading = {"now": False, "others_served": 0}
    split = session_module.split_reasoning

    def observed_split(message: dict) -> tuple[str, str]:
        reading["now"] = True
        try:
            return split(message)
        finally:
            reading["now"] = False

    monkeypatch.setattr(session_module, "split_reasoning", observed_split)
    model = ScriptedModel([say(huge)])
    services = worker_services(tmp_path, ScriptedModels(model))

    async def another_session() -> None:
        while True:
            await asyncio.sleep(0.001)
            reading["others_served"] += reading["now"]

    result = run_beside(services, another_session)
    assert result.end_reason == rows.EndReason.FINAL_ANSWER
    assert result.turns[-1].content == "b" * 30_000
    assert reading["others_served"] > 0


class RedactionServedMeanwhile:
    """Redactor's ``method``, for texts of ``from_chars`` characters or more, made to wait until another
    session of the event loop has run (``another_session``, which sets ``served``): on the event loop
    itself, none ever could, and the wait runs out."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, method: str, from_chars: int = 0) -> None:
        self.redacting, self.served = threading.Event(), threading.Event()
        original = getattr(Redactor, method)

        def observed(redactor: Redactor, text: str) -> str:
            if len(text) < from_chars:
                return original(redactor, text)
            self.redacting.set()
            try:
                self.served.wait(timeout=10)
                return original(redactor, text)
            finally:
                self.redacting.clear()

        monkeypatch.setattr(Redactor, method, observed)

    async def another_session(self) -> None:
        while True:
            await asyncio.sleep(0.001)
            if self.redacting.is_set():
                self.served.set()


def test_the_worker_keeps_serving_its_other_sessions_while_a_huge_tool_call_is_redacted(tmp_path, monkeypatch):
    # Every escape in a call's arguments is written out before the secrets are looked for, and a few
    # megabytes of them take seconds; the other sessions of the worker share its event loop. The
    # redaction here waits until another session has run: on the event loop, none ever could.
    escaped = "\\u0041" * 100_000
    reply = call("terminal", {"command": "true"})
    reply.message["tool_calls"][0]["function"]["arguments"] = '{"command": "echo ' + escaped + '"}'
    redaction = RedactionServedMeanwhile(monkeypatch, "json_text")
    services = worker_services(tmp_path, ScriptedModels(ScriptedModel([reply, say("Done.")])))
    result = run_beside(services, redaction.another_session)
    assert result.end_reason == rows.EndReason.FINAL_ANSWER
    assert redaction.served.is_set()


def calls(name: str, arguments: list[dict[str, Any]]) -> ModelReply:
    """One reply calling ``name`` once with each of ``arguments``."""
    tool_calls = [{"id": f"call_{number}", "type": "function",
                   "function": {"name": name, "arguments": json.dumps(value)}} for number, value in enumerate(arguments)]
    return ModelReply(message={"role": "assistant", "content": "", "tool_calls": tool_calls},
                      finish_reason="tool_calls", usage=Usage(prompt_tokens=10, completion_tokens=5))


def test_the_calls_of_a_reply_past_the_most_one_reply_may_make_are_answered_without_running(tmp_path):
    # A reply of a few megabytes holds a million calls: run one after another, they would hold the
    # session for as long as they take, each up to its time limit.
    many = session_module.MAX_CALLS_PER_REPLY + 2
    result, _ = run_session(tmp_path, [calls("terminal", [{"command": f"echo ran {n}"} for n in range(many)]), say("Done.")])
    answered = [json.loads(call.result or "") for call in result.turns[0].tool_calls]
    assert [answer.get("output") for answer in answered[:-2]] == [f"ran {n}\n" for n in range(many - 2)]
    assert all("not run" in answer["error"] for answer in answered[-2:])
    assert result.end_reason == "final_answer"


def test_a_result_that_would_take_the_prompts_results_past_their_bound_is_not_kept(tmp_path, monkeypatch):
    # Each result may be as large as the largest file the tools read: a few calls per reply for each of
    # --max_turns replies would otherwise make a row, and the requests, of gigabytes.
    monkeypatch.setattr(session_module, "MAX_RESULT_CHARS", 5_000)
    command = {"command": "head -c 3000 /dev/zero | tr '\\0' x"}
    result, _ = run_session(tmp_path, [calls("terminal", [command] * 2 + [ECHO]), say("Done.")])
    kept, refused, small = [json.loads(call.result or "") for call in result.turns[0].tool_calls]
    assert len(kept["output"]) == 3000
    assert "not kept" in refused["error"] and "5,000" in refused["error"]
    assert "output" in small                # what still fits is kept


def test_tool_calls_once_a_prompts_results_hold_their_bound_are_answered_without_running(tmp_path, monkeypatch):
    monkeypatch.setattr(session_module, "MAX_RESULT_CHARS", 3_200)
    command = {"command": "head -c 3000 /dev/zero | tr '\\0' x"}
    result, _ = run_session(tmp_path, [calls("terminal", [command] * 2), calls("terminal", [ECHO]), say("Done.")])
    first, second = [[json.loads(call.result or "") for call in turn.tool_calls]
                     for turn in result.turns if isinstance(turn, AssistantTurn) and turn.tool_calls]
    assert len(first[0]["output"]) == 3000 and "not kept" in first[1]["error"]
    assert "not run" in second[0]["error"] and "3,200" in second[0]["error"]


def test_a_file_read_is_bounded_as_the_json_the_model_reads(tmp_path, monkeypatch):
    # JSON writes a control character as six: a file of 10 MB, within what the tools read, came to 60
    # million characters, three times the bound, and ended the prompt (context_length) at its next request.
    monkeypatch.setattr(session_module, "MAX_RESULT_CHARS", 5_000)
    script = [call("terminal", {"command": "head -c 1000 /dev/zero | tr '\\0' '\\1' > c"}),
              call("read_file", {"path": "c"}), say("Done.")]
    result, _ = run_session(tmp_path, script, task=WITH_FILES)
    read = json.loads(result.turns[1].tool_calls[0].result or "")
    assert "not kept" in read["error"], read
    assert result.end_reason == "final_answer"


def test_the_worker_keeps_serving_its_other_sessions_while_a_large_tool_result_is_encoded(tmp_path, monkeypatch):
    # A result may hold a file of 10 MB: encoding it as JSON and redacting it took seconds of the event
    # loop the worker's other sessions share. The redaction here waits until another session has run: on
    # the event loop, none ever could.
    size = 4 * session_module.READ_ASIDE_CHARS
    script = [call("terminal", {"command": f"head -c {size} /dev/zero | tr '\\0' x > big"}),
              call("read_file", {"path": "big"}), say("Done.")]
    redaction = RedactionServedMeanwhile(monkeypatch, "__call__", from_chars=size)
    services = worker_services(tmp_path, ScriptedModels(ScriptedModel(script)))
    result = run_beside(services, redaction.another_session, task=WITH_FILES)
    assert len(json.loads(result.turns[1].tool_calls[0].result or "")["content"]) == size
    assert redaction.served.is_set()


def test_a_session_counts_the_replies_whose_cost_is_unknown(tmp_path):
    # The row's usage.cost leaves them out; the console says the prompt's cost is unknown (or a floor) then.
    result, _ = run_session(tmp_path, [dataclasses.replace(call("terminal", ECHO), cost_source="unknown"),
                                       say("Done.")])
    assert result.unpriced_replies == 1
