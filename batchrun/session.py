"""One agent session: a prompt, its environment, the model/tool loop, the record.

A session never writes anything; it returns a :class:`SessionResult` that the worker turns into a
row and the parent persists.

Over 400 lines, on purpose: the loop's rules from one reply to the next (ask again for an empty answer,
go on after a cut one, stop a session that invents tools, the summary at --max_turns) and the accounting
of every reply read and change one session's state; split across modules, a reader would have to put
that order back together.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from batchrun import registry
from batchrun.config import EndpointConfig, SessionConfig
from batchrun.environments import create_environment, environment_class
from batchrun.environments.base import Environment, EnvironmentLostError, EnvironmentSettings, EnvironmentSetupError
from batchrun.messages import Task
from batchrun.model import CONTEXT_LENGTH, Message, ModelReply, ModelSource, PromptFailedError
from batchrun.rows import (
    END_REASONS,
    MAX_TURNS_REACHED,
    AssistantTurn,
    EndReason,
    HumanTurn,
    SessionResult,
    ToolCallRecord,
    Turn,
    Usage,
    is_invented,
    split_reasoning,
    tool_result_failed,
)
from batchrun.security import Redactor
from batchrun.time_limit import within
from batchrun.tools import ModelAccess, ToolContext, ToolError
from batchrun.tools.arguments import holding_a_lone_surrogate

AGENT_PROMPT = (
    "You are an autonomous agent completing the user's task with the tools you are given. "
    "Work step by step, check what each tool call returns before relying on it, and finish with a "
    "clear final answer once the task is done."
)
MAX_INVENTED_TURNS = 3       # consecutive turns calling tools it was not offered before giving up
MAX_EMPTY_RETRIES = 3        # a reply with no text and no tool call is asked for again this often
MAX_CONTINUATIONS = 3        # a reply cut off by the output limit is asked to go on this often
# What the runner says to the model itself, worded as the reference runner words it, so that rows of both
# read alike to a trainer.
CONTINUE_REQUEST = ("[System: Your previous response was truncated by the output length limit. Continue exactly "
                    "where you left off. Do not restart or repeat prior text. Finish the answer directly.]")
SUMMARY_REQUEST = ("You've reached the maximum number of tool-calling iterations allowed. Please provide a final "
                   "response summarizing what you've found and accomplished so far, without calling any more tools.")
# Reasoning fields of an assistant message, sent back exactly as received: providers need their reasoning
# blocks (Anthropic thinking signatures, Gemini thought signatures) on the following calls.
REASONING_FIELDS = ("reasoning", "reasoning_content", "reasoning_details")
ENVIRONMENT_STARTS_AT_ONCE = 8
KEPT_ARGUMENT_CHARS = 2_000      # of arguments too large for any tool, which the tool refused
CALL_ID_LONGEST = 256            # providers' ids are a few dozen characters
READ_ASIDE_CHARS = 64 * 1024     # a reply's text and arguments from which it is taken apart in a thread
_CALL_CHARS = 256                # what taking one call apart costs, as characters of text would
# What one prompt's tools may do for the model. A reply of a few megabytes holds a million calls, each of
# which may run up to its time limit and return up to the largest file the tools read: past these, calls
# are answered without running, so that no reply holds a session for ever or makes a row (and the
# requests after it) of gigabytes. No model's context holds this much.
MAX_CALLS_PER_REPLY = 128
MAX_RESULT_CHARS = 20_000_000       # of every result of the prompt's calls together


@dataclass
class SessionServices:
    """What every session of a worker process shares."""

    config: SessionConfig
    endpoint: EndpointConfig   # the run's endpoint, for tools that ask the model themselves
    environment_kind: str      # the backend every session's environment comes from
    models: ModelSource        # each session's model (the run's endpoint: batchrun.endpoint.OpenAIEndpoint)
    env_settings: EnvironmentSettings
    available_tools: frozenset[str]
    redact: Redactor
    closing: set[asyncio.Task] = field(default_factory=set)    # environments being closed
    # Environments starting at once in this process: when hundreds of sessions begin together, the
    # first few get their sandboxes (and send their first requests) without waiting for them all.
    starting: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(ENVIRONMENT_STARTS_AT_ONCE))
    # Told of every model call's usage as its reply arrives (the task's unit, usage, where its cost came
    # from): see messages.Spent.
    on_spent: Callable[[int, Usage, str], None] | None = None

    async def retire(self, env: Environment) -> None:
        """Release a finished session's environment before its row is made: a prompt that filled the disk
        has its directory gone before the row needs the space. The release runs to its end even when the
        session is cancelled meanwhile (close() waits for it)."""
        closing = asyncio.get_running_loop().create_task(env.release())
        self.closing.add(closing)
        closing.add_done_callback(self.closing.discard)
        await asyncio.shield(closing)

    async def close(self) -> None:
        """Finish closing environments (and end those kept for further prompts), then the model's
        connections, while the loop still runs."""
        await asyncio.gather(*self.closing, return_exceptions=True)
        await environment_class(self.environment_kind).close_idle()
        await self.models.close()


def runtime_messages(config: SessionConfig, prompt: str) -> list[Message]:
    """What the model sees first; the ephemeral prompt and prefill never reach the trajectory."""
    system = AGENT_PROMPT
    if config.ephemeral_system_prompt:
        system += "\n\n" + config.ephemeral_system_prompt
    return [{"role": "system", "content": system}, *map(dict, config.prefill_messages),
            {"role": "user", "content": prompt}]


async def _read_reply(message: Message, turn_number: int, redact: Redactor) -> tuple[str, str, list[ToolCallRecord]]:
    """The reply's reasoning, visible text and tool calls, redacted; in a thread for a long reply. Its
    size is the endpoint's to choose, and taking it apart costs microseconds per think block and per
    escape in a call's arguments (seconds for a few megabytes), while the worker's other sessions
    share this event loop. Content that is not one string (a list of parts) goes to the thread too."""
    calls = message.get("tool_calls") or ()
    texts = [message.get("content") or "", message.get("refusal") or "",
             *((call.get("function") or {}).get("arguments") or "" for call in calls)]
    # Each call also costs its id, name and records, whatever its arguments.
    size = _CALL_CHARS * len(calls) + sum(len(text) if isinstance(text, str) else READ_ASIDE_CHARS for text in texts)
    size += sum(len(str(message[field])) for field in REASONING_FIELDS if message.get(field))
    if size < READ_ASIDE_CHARS:
        return _taken_apart(message, turn_number, redact)
    return await asyncio.to_thread(_taken_apart, message, turn_number, redact)


def _taken_apart(message: Message, turn_number: int, redact: Redactor) -> tuple[str, str, list[ToolCallRecord]]:
    reasoning, visible = split_reasoning(message)
    return redact(reasoning), redact(visible), _tool_calls_of(message, turn_number, redact)


def _tool_calls_of(message: Message, turn_number: int, redact: Redactor) -> list[ToolCallRecord]:
    """The reply's calls, redacted: an endpoint that echoes a secret into a call must not hand it to
    the tool (and through it to a command or a web request), nor to the row."""
    calls = []
    taken: set[str] = set()      # the ids of the reply's calls so far
    for position, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):   # a few servers send an object; the row wants text
            arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
        call_id = _call_id(call.get("id"), turn_number, position, taken, redact)
        taken.add(call_id)
        calls.append(ToolCallRecord(id=call_id, name=redact(str(function.get("name") or "")),
                                    arguments=redact.json_text(arguments)))
    return calls


def _call_id(given: object, turn_number: int, position: int, taken: set[str], redact: Redactor) -> str:
    """The call's id, redacted, unless the reply's calls before it have ``taken`` it: each result
    answers its call by id, in the row and back at the endpoint, so two calls of one reply never
    share one. An id that is not text (an object, a number) is the runner's own, as a missing one:
    its repr would go into the row and back to the endpoint; so is one longer than CALL_ID_LONGEST,
    which would go into the row and every later request whole."""
    call_id = redact(given) if isinstance(given, str) and len(given) <= CALL_ID_LONGEST else ""
    if call_id and call_id not in taken:
        return call_id
    own = f"call_{turn_number}_{position}"
    while own in taken:      # a name the model gave an earlier call of this reply
        own += "_"
    return own


def _kept_arguments(call: ToolCallRecord, limit: int) -> str:
    """What the row keeps of a call's arguments: all of them, unless they are longer than any tool
    takes (``limit``: the largest file the file tools write) and the tool refused them; then their
    start and their size, so that one refused 100 MB write does not make a 100 MB row."""
    if len(call.arguments) <= limit or not tool_result_failed(call.result or ""):
        return call.arguments
    return (call.arguments[:KEPT_ARGUMENT_CHARS]
            + f"\n[arguments cut: {len(call.arguments):,} characters, the first {KEPT_ARGUMENT_CHARS:,} kept]")


def _assistant_message(message: Message, calls: list[ToolCallRecord]) -> Message:
    """The reply as it goes back to the endpoint in the conversation: as received, reasoning fields
    and each call's own extra fields included, with only what servers need filled in (an id, the
    arguments as text)."""
    # "" rather than None: some servers (llama.cpp) reject a null content beside tool_calls.
    echoed: Message = {"role": "assistant", "content": message.get("content") or ""}
    for key in REASONING_FIELDS:
        if message.get(key) is not None:
            echoed[key] = message[key]
    if calls:
        received = message.get("tool_calls") or []
        echoed["tool_calls"] = [{**original, "id": call.id, "type": original.get("type") or "function",
                                 "function": {**original["function"], "arguments": call.arguments}}
                                for original, call in zip(received, calls, strict=True)]
    return echoed


class Session:
    def __init__(self, task: Task, services: SessionServices) -> None:
        self.task = task
        self.services = services
        self.config = services.config
        self.offered_tools = [name for name in registry.tools_for_toolsets(task.toolsets)
                              if name in services.available_tools]
        self.model = services.models.model(task.prompt_index,
                                           [registry.REGISTRY[name].schema for name in self.offered_tools])
        self.turns: list[Turn] = []
        self.usage = Usage()
        self.unpriced_replies = 0
        self.api_calls = 0
        self._result_chars = 0      # of every tool result so far (see MAX_RESULT_CHARS)
        self.env: Environment | None = None
        self._environment_start: asyncio.Future[None] | None = None
        self._awaiting_environment = False
        self.tools: ToolContext | None = None
        self._request_out = asyncio.Event()    # the first model request left the gate (or came back)

    async def run(self) -> SessionResult:
        started = time.monotonic()
        end_reason, error, error_type = EndReason.ERROR, None, None
        try:
            # The time limit covers the environment's start (a slow image pull or Modal start) too.
            end_reason = await within(self.config.prompt_timeout, self._started_then_loop())
        except PromptFailedError as exc:
            if exc.error_type == CONTEXT_LENGTH and self._answered():
                end_reason = EndReason.CONTEXT_LENGTH     # keep the paid-for turns; rerunning would overflow again
            else:
                error, error_type = str(exc), exc.error_type
        except (EnvironmentSetupError, EnvironmentLostError) as exc:
            error, error_type = str(exc), "environment"
        except TimeoutError:
            if self._answered():    # keep what the paid-for turns produced, as a partial row
                end_reason = EndReason.PROMPT_TIMEOUT
            else:
                waiting = ("while its environment was starting" if self._awaiting_environment
                           else "before the first model reply")
                error = f"prompt time limit of {self.config.prompt_timeout:g}s reached {waiting}"
                error_type = "prompt_timeout"
        finally:
            await self._close_tools()
            await self._abandon_environment_start()
            if self.env is not None:
                await self.services.retire(self.env)
        while self.turns and isinstance(self.turns[-1], HumanTurn):    # a request the model never answered
            self.turns.pop()
        redact = self.services.redact
        return SessionResult(
            prompt_index=self.task.prompt_index, content_key=self.task.content_key, prompt=self.task.prompt,
            toolsets=list(self.task.toolsets), offered_tools=self.offered_tools, turns=self.turns,
            api_calls=self.api_calls, usage=self.usage, wall_time=time.monotonic() - started,
            end_reason=end_reason, error=redact(error) if error else None, error_type=error_type,
            sample_index=self.task.sample_index, unpriced_replies=self.unpriced_replies)

    async def _started_then_loop(self) -> EndReason:
        if registry.needs_environment(self.offered_tools):
            # A start that can fail for this prompt alone (an image that cannot be pulled, the row's cwd)
            # comes before any model call, so that such a prompt spends nothing; any other runs while the
            # first reply is written, and the first tool call that needs it waits for it.
            if environment_class(self.services.environment_kind).start_can_fail_alone or self.task.cwd:
                self._environment_start = asyncio.ensure_future(self._start_environment())
                await self._environment_ready()
            else:
                self._environment_start = asyncio.ensure_future(self._start_environment_once_requested())
        return await self._loop()

    async def _environment_ready(self) -> None:
        """Wait for the environment's start; one that failed raises EnvironmentSetupError, which fails the
        prompt. The start is not cancelled with the wait: the session's end cuts it short."""
        assert self._environment_start is not None
        self._awaiting_environment = True
        await asyncio.shield(self._environment_start)
        self._awaiting_environment = False

    async def _start_environment_once_requested(self) -> None:
        """Start the environment once the first request has gone out. While requests wait for a slot
        (the start of adaptive concurrency, an endpoint's limit), the first tool call is a slot and a
        reply away, and sandboxes started for sessions that send nothing yet would take the CPU that
        the requests which may go out need (docs/performance.md, thousands of sessions)."""
        await self._request_out.wait()
        await self._start_environment()

    async def _start_environment(self) -> None:
        self.env = create_environment(self.services.environment_kind, self.services.env_settings,
                                      prompt_index=self.task.prompt_index, image=self.task.image,
                                      cwd=self.task.cwd)
        async with self.services.starting:
            await self.env.start()

    async def _abandon_environment_start(self) -> None:
        """A start still running when the session ends is cut short (retire() then removes what it made);
        one that failed unseen, because no tool call needed it, has nothing more to say."""
        start = self._environment_start
        if start is None:
            return
        start.cancel()
        try:
            await start
        except (asyncio.CancelledError, EnvironmentSetupError):
            pass

    def _tool_context(self) -> ToolContext:
        if self.tools is None:
            endpoint = self.services.endpoint
            self.tools = ToolContext(env=self.env, settings=self.services.env_settings,
                                     model=ModelAccess(base_url=endpoint.base_url, api_key=endpoint.api_key,
                                                       model=endpoint.model,
                                                       client=self.services.models.tool_client(self.task.prompt_index)))
        return self.tools

    async def _close_tools(self) -> None:
        """Run the tools' per-session cleanups (browser contexts...); one failing must not stop the rest."""
        if self.tools is None:
            return
        for cleanup in reversed(self.tools.cleanups):
            try:
                await cleanup()
            except Exception:   # cleanup of a finished session: nothing useful to report to anyone
                pass

    def _answered(self) -> bool:
        return any(isinstance(turn, AssistantTurn) for turn in self.turns)

    async def _call(self, messages: list[Message], *, with_tools: bool = True) -> ModelReply:
        # Every request sent counts, also one the endpoint refuses (a context overflow); one the prompt's
        # time limit cut off while it waited at the run's gate was never sent, and does not.
        sent = False

        def going_out() -> None:
            nonlocal sent
            if not sent:
                sent = True
                self.api_calls += 1
            self._request_out.set()

        try:
            reply = await self.model.reply(messages, with_tools=with_tools, on_send=going_out, on_refused=self._spend)
        finally:
            self._request_out.set()     # a model that never said its request went out has answered by now
        if not sent:
            going_out()
        self._spend(reply.usage, reply.cost_source)
        return reply

    def _spend(self, usage: Usage, cost_source: str) -> None:
        """Count what one reply was billed for, as it arrives: towards this row, the run's ledger and its caps."""
        self.usage.add(usage)
        self.unpriced_replies += cost_source == "unknown"
        if self.services.on_spent is not None:
            self.services.on_spent(self.task.unit, usage, cost_source)

    def _record(self, messages: list[Message], reply: ModelReply, turn: AssistantTurn) -> None:
        self.turns.append(turn)
        messages.append(_assistant_message(reply.message, turn.tool_calls))

    def _ask(self, messages: list[Message], text: str) -> None:
        self.turns.append(HumanTurn(text))
        messages.append({"role": "user", "content": text})

    async def _loop(self) -> EndReason:
        """The conversation, then why it ended; a session that kept no reply at all (only empty
        answers, or only reasoning) fails, so that resume runs its prompt again."""
        end_reason = await self._converse()
        if not self._answered():
            # With no reply kept there was nothing to summarise, so no summary was asked for either.
            why = MAX_TURNS_REACHED if end_reason is EndReason.MAX_TURNS else END_REASONS[end_reason]
            raise PromptFailedError(f"the model gave no reply with text or a tool call: {why}", end_reason)
        return end_reason

    async def _converse(self) -> EndReason:
        """Call the model and run its tools until it answers, as the reference loop does: an answer
        with no text is asked for again, one cut off by the output limit is asked to go on, and at
        --max_turns calls one more, without tools, asks for a summary. Each counter of requests
        again concerns one reply: it starts over once a reply is kept (once one is not cut off, for
        requests to continue)."""
        messages = runtime_messages(self.config, self.task.prompt)
        redact = self.services.redact
        empty_retries = continuations = invented_streak = cut_calls = 0
        while self.api_calls < self.config.max_turns:
            reply = await self._call(messages)
            if reply.finish_reason == "content_filter":     # withheld or cut by the provider: not the model's answer
                return EndReason.CONTENT_FILTER
            reasoning, visible, calls = await _read_reply(reply.message, self.api_calls - 1, redact)
            cut_off = reply.finish_reason == "length"
            if calls and cut_off:        # its last call's arguments may be cut mid-way: ask once more
                if cut_calls:
                    return EndReason.TRUNCATED
                cut_calls += 1
                continue
            if not calls and not visible:
                if cut_off:              # the output limit went on reasoning: asking to go on repeats that
                    return EndReason.TRUNCATED
                if empty_retries == MAX_EMPTY_RETRIES:
                    return EndReason.EMPTY_ANSWER
                empty_retries += 1
                continue
            empty_retries = cut_calls = 0
            self._record(messages, reply, AssistantTurn(reasoning=reasoning, content=visible, tool_calls=calls))
            if not cut_off:
                continuations = 0
            if not calls:
                if not cut_off:
                    return EndReason.FINAL_ANSWER
                if continuations == MAX_CONTINUATIONS:
                    return EndReason.TRUNCATED
                continuations += 1
                self._ask(messages, CONTINUE_REQUEST)
                continue
            invented = False
            for position, call in enumerate(calls):
                call.result, was_invented = await self._answer(call, position)
                invented |= was_invented
                messages.append({"role": "tool", "tool_call_id": call.id, "content": call.result})
                call.arguments = _kept_arguments(call, self.services.env_settings.max_file_bytes)
            invented_streak = invented_streak + 1 if invented else 0
            if invented_streak >= MAX_INVENTED_TURNS:
                return EndReason.INVENTED_TOOLS
        await self._summarise(messages)
        return EndReason.MAX_TURNS

    async def _summarise(self, messages: list[Message]) -> None:
        """At --max_turns, one call without tools asks for a summary; the row keeps it (and the request)
        when the model gives one. A failure here only loses the summary, never the turns before it. A
        summary that also calls tools (none were offered) is not kept: without its calls, which no tool
        answers, the row would show an answer the model did not give."""
        if not self._answered() or isinstance(self.turns[-1], HumanTurn):
            return
        request = [*messages, {"role": "user", "content": SUMMARY_REQUEST}]
        try:
            reply = await self._call(request, with_tools=False)
        except PromptFailedError:
            return
        reasoning, visible, calls = await _read_reply(reply.message, self.api_calls - 1, self.services.redact)
        if visible and not calls and reply.finish_reason != "content_filter":
            self._ask(messages, SUMMARY_REQUEST)
            self._record(messages, reply, AssistantTurn(reasoning=reasoning, content=visible))

    async def _answer(self, call: ToolCallRecord, position: int) -> tuple[str, bool]:
        """(the result of the reply's call at ``position``, whether the model invented its tool); calls
        past what one reply or one prompt may have run are answered without running."""
        if position >= MAX_CALLS_PER_REPLY:
            return _error(f"not run: a reply may call at most {MAX_CALLS_PER_REPLY} tools; call fewer at "
                          "once"), False
        if self._result_chars >= MAX_RESULT_CHARS:
            return _error(f"not run: this prompt's tool results already hold {self._result_chars:,} characters, "
                          f"as many as a prompt's may ({MAX_RESULT_CHARS:,}); answer with what you have"), False
        result, invented = await self._run_tool(call)
        # Checked against the result as the model reads it: JSON writes a control character as six, so
        # a file read within the tools' 10 MB could come to 60 million characters.
        room = MAX_RESULT_CHARS - self._result_chars
        if len(result) > room:
            result = _error(f"ran, but its result is not kept: it held {len(result):,} characters, more than this "
                            f"prompt's tool results may still take ({room:,} of {MAX_RESULT_CHARS:,}); ask for less "
                            "at once (a window of a file's lines, a narrower search)")
        self._result_chars += len(result)
        return result, invented

    async def _run_tool(self, call: ToolCallRecord) -> tuple[str, bool]:
        """(result JSON text, whether the model invented the tool)."""
        if is_invented(call.name, self.offered_tools):
            available = ", ".join(self.offered_tools) or "none"
            return _error(f"unknown tool {call.name!r}; the tools you can call are: {available}"), True
        try:
            args = json.loads(call.arguments) if call.arguments.strip() else {}
        except ValueError as exc:
            return _error(f"arguments are not valid JSON ({exc}); send a JSON object matching the "
                          f"{call.name} schema"), False
        except RecursionError:
            return _error(f"arguments are nested too deeply to read; send a JSON object matching the "
                          f"{call.name} schema"), False
        if not isinstance(args, dict):
            return _error(f"arguments must be a JSON object, got {type(args).__name__}"), False
        if (name := holding_a_lone_surrogate(args)) is not None:
            return _error(f"argument {name!r} holds a lone surrogate (an unpaired \\ud800-\\udfff), which is "
                          "not text; send it as UTF-8 text"), False
        if self._environment_start is not None and registry.REGISTRY[call.name].needs_environment:
            await self._environment_ready()
        try:
            result = await within(self.config.tool_timeout,
                                  registry.dispatch(call.name, args, self._tool_context()))
            return await _result_text(result, self.services.redact), False
        except ToolError as exc:
            text = _error(str(exc))
        except TimeoutError:
            text = _error(f"{call.name} did not finish within {self.config.tool_timeout:g}s")
        except EnvironmentLostError:
            raise
        except Exception as exc:  # a tool bug must cost one tool call, not the whole prompt
            text = _error(f"{call.name} failed: {type(exc).__name__}: {exc}")
        return self.services.redact(text), False


async def _result_text(result: object, redact: Redactor) -> str:
    """A tool's result as the JSON the model reads, redacted; in a thread for a large one. A result may
    hold a file of 10 MB, which takes a second to encode and redact, while the worker's other sessions
    share this event loop."""
    if _strings_size(result) < READ_ASIDE_CHARS:
        return redact(json.dumps(result, ensure_ascii=False))
    return await asyncio.to_thread(lambda: redact(json.dumps(result, ensure_ascii=False)))


def _strings_size(value: object) -> int:
    """The characters of the strings ``value`` holds, its keys' included: what its JSON's size grows with."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(str(key)) + _strings_size(item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_strings_size(item) for item in value)
    return 0


def _error(message: str) -> str:
    return json.dumps({"error": message}, ensure_ascii=False)
