"""Talking to the OpenAI-compatible endpoint: one call with retries, and what each error means.

The retry loop is our own rather than the client's because a 429 concerns *every* session of the
run, across processes (:class:`RateGate`), not only the one that received it: it lowers the run-wide
concurrency limit, and when it says when to come back, it pauses them all.
"""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import json
import math
import random
import socket
import ssl
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC
from typing import Any
from urllib.parse import urlparse

import openai

from batchrun.config import RunConfig
from batchrun.model import CONTEXT_LENGTH, Message, ModelReply, PromptFailedError, RunFatalError
from batchrun.rate_limit import Gate, wake_delay
from batchrun.rows import Usage

# The server says it has more than it can take: adaptive concurrency lowers the limit (batchrun.concurrency).
OVERLOAD_STATUSES = (429, 503)
BACKOFF_BASE = 1.0       # seconds before the first retry; doubles per attempt, with full jitter
BACKOFF_CAP = 60.0
# A server's Retry-After is obeyed up to this: "1e9" or a date next year would otherwise stall every
# session of the run (a 429 pauses them all) for as long as the server cares to say.
MAX_RETRY_AFTER = BACKOFF_CAP
# The system's CA store, loaded once per process (at import, so before the pool forks workers share
# it): loading it per client would be paid again for every client of every worker. Not
# tools.clients' context: that one is httpx's, and httpx comes only with the optional web extra.
TLS_CONTEXT = ssl.create_default_context()


# Endpoints (base URLs) that have sent an HTTP response, any status, in this process. One that never
# has and refuses connections (or whose host does not resolve) is not there at all: the run stops at
# once instead of retrying every prompt. Once it has answered, the same errors are a transient outage.
_ANSWERED: set[str] = set()


def make_client(base_url: str, api_key: str, *, timeout: float) -> openai.AsyncOpenAI:
    """The client on its aiohttp transport: with hundreds of sessions per process, the default
    transport's pure-Python HTTP handling cost more CPU than everything else a session does.
    ``timeout`` (--request_timeout) bounds each wait for the server, so a silent one cannot hold a
    prompt for ever."""
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout,
                              http_client=openai.DefaultAioHttpClient(timeout=timeout, verify=TLS_CONTEXT))


def preload_http_stack() -> None:
    """Import what the HTTP stack loads only when its first client is built (about a hundred modules).
    The pool calls this before forking, so workers share them instead of each loading its own; the
    client built here opens nothing and is dropped."""
    openai.DefaultAioHttpClient(verify=TLS_CONTEXT)


class ConversationBody:
    """The request bodies of one session's calls, encoded by json's C encoder (the client's own
    encoder is pure Python). A session's messages only grow, so each is encoded once, and the rest
    of the body (model, tools, options) once per session: a call costs its new messages, not the
    whole conversation and tool list again."""

    def __init__(self, fields: Message) -> None:
        rest = _encode(fields)
        self._tail = b"]" + (b"," + rest[1:] if fields else b"}")
        self._messages: list[bytes] = []

    def encode(self, messages: Sequence[Message]) -> bytes:
        for message in messages[len(self._messages):]:
            self._messages.append(_encode(message))
        return b'{"messages":[' + b",".join(self._messages) + self._tail


class OpenAIModel:
    """A session's :class:`~batchrun.model.Model` on the run's OpenAI-compatible endpoint: its
    requests pass the run-wide ``gate`` and are retried by :func:`call_model`. The body with tools
    and the one without (the summary at --max_turns) each keep their encoded messages."""

    def __init__(self, client: openai.AsyncOpenAI, gate: Gate, config: RunConfig, tools: Sequence[Message]) -> None:
        self._client, self._gate, self._config = client, gate, config
        self._tools = list(tools)
        self._bodies: dict[bool, ConversationBody] = {}

    async def reply(self, messages: Sequence[Message], *, with_tools: bool) -> ModelReply:
        body = self._bodies.get(with_tools)
        if body is None:
            body = self._bodies[with_tools] = ConversationBody(self._fields(with_tools))
        config = self._config
        reply = await call_model(self._client, self._gate, body=body.encode(messages), model=config.model,
                                 max_retries=config.max_retries, base_url=config.base_url)
        if reply.cost_source == "unknown":      # the endpoint said nothing of cost: price it, if a price is known
            cost = config.pricing.cost(reply.usage)
            if cost is not None:
                reply.usage.cost, reply.cost_source = cost, config.pricing.source
        return reply

    def _fields(self, with_tools: bool) -> Message:
        """Every field of a chat-completions call but its messages (provider routing and reasoning included)."""
        fields: Message = {"model": self._config.model, **self._config.extra_body}
        if self._tools and with_tools:
            fields["tools"] = self._tools
        if self._config.max_tokens:
            fields["max_tokens"] = self._config.max_tokens
        return fields


class OpenAIEndpoint:
    """A worker's :class:`~batchrun.model.ModelSource`: its clients of the run's endpoint and the
    run-wide rate gate, shared by its sessions."""

    def __init__(self, config: RunConfig, gate: Gate, *, clients: int) -> None:
        self._config, self.gate = config, gate
        self._clients = [make_client(config.base_url, config.api_key, timeout=config.request_timeout)
                         for _ in range(clients)]
        # Several small connection pools: the HTTP pool scans its connections on every request, so one
        # pool shared by hundreds of sessions would cost O(sessions) per call. Sessions take them in turn
        # as they start, so each pool serves about its share at once and a new session finds a connection
        # to reuse (chosen by prompt index, some pools served several times their share, opening a new
        # connection for most requests).
        self._turn = itertools.cycle(self._clients)

    def model(self, prompt_index: int, tools: Sequence[Message]) -> OpenAIModel:
        return OpenAIModel(next(self._turn), self.gate, self._config, tools)

    def tool_client(self, prompt_index: int) -> openai.AsyncOpenAI:
        return next(self._turn)

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self._clients), return_exceptions=True)


def _encode(value: Any) -> bytes:
    """Compact JSON; text a tool decoded badly cannot make the body invalid UTF-8."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


def retry_after_seconds(headers: Mapping[str, str] | None) -> float | None:
    """Seconds the server asked us to wait: Retry-After-Ms, else Retry-After (seconds or an HTTP
    date), at most MAX_RETRY_AFTER. None when neither is there or readable: a value like "soon" must
    not turn a retryable error into a crash; the back-off applies instead."""
    if not headers:
        return None
    seconds = _delay_seconds(headers.get("retry-after-ms"), per_second=1000)
    if seconds is None:
        value = headers.get("retry-after")
        seconds = _delay_seconds(value, per_second=1)
        if seconds is None:
            seconds = _seconds_until(value)
    return None if seconds is None else min(seconds, MAX_RETRY_AFTER)


def _delay_seconds(value: str | None, *, per_second: float) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number / per_second if math.isfinite(number) and number >= 0 else None


def _seconds_until(value: str | None) -> float | None:
    """An HTTP date as seconds from now; a date already past means now."""
    if not value:
        return None
    try:
        moment = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if moment.tzinfo is None:      # "-0000": HTTP dates are GMT
        moment = moment.replace(tzinfo=UTC)
    return max(0.0, moment.timestamp() - time.time())


def _error_text(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error")
        message = inner.get("message") if isinstance(inner, dict) else body.get("message")
        if message:
            return str(message)
    return str(exc.message)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception, then what it was raised from (or while handling), innermost last. The HTTP
    stack wraps the socket's error twice and reports even a refused connection as a time-out, so
    only the innermost errors tell what happened."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _stop_if_unreachable(exc: openai.APIConnectionError, base_url: str) -> None:
    """RunFatalError when nothing can ever answer at ``base_url`` (refused, or no such host)."""
    for cause in _causes(exc):
        if isinstance(cause, ConnectionRefusedError):
            raise RunFatalError(f"the endpoint {base_url} refused the connection: nothing is listening there. "
                                "Start the server, or check --base_url.")
        if isinstance(cause, socket.gaierror):
            raise RunFatalError(f"the endpoint {base_url} cannot be reached: its host name "
                                f"{urlparse(base_url).hostname!r} cannot be resolved. Check --base_url.")


# How providers say a conversation no longer fits the model's context: OpenAI and vLLM ("maximum
# context length", code context_length_exceeded), OpenRouter (passes the provider's words on),
# llama.cpp ("exceeds the available context size", type exceed_context_size_error), Anthropic
# ("prompt is too long"), and others ("context window", "reduce the length of the messages").
_CONTEXT_OVERFLOW_PHRASES = ("context_length_exceeded", "exceed_context_size", "maximum context length",
                             "context length", "context size", "context window", "prompt is too long",
                             "reduce the length of the messages", "too many tokens in the prompt")


def _context_overflow(exc: openai.APIStatusError, detail: str) -> bool:
    if exc.status_code not in (400, 413, 422):
        return False
    body = exc.body if isinstance(exc.body, dict) else {}
    error = body.get("error")
    inner = error if isinstance(error, dict) else body
    said = " ".join(str(part) for part in (detail, inner.get("code"), inner.get("type")) if part).lower()
    return any(phrase in said for phrase in _CONTEXT_OVERFLOW_PHRASES)


def classify(exc: Exception, *, model: str, base_url: str, endpoint_answered: bool) -> float | None:
    """Returns for a transient error (with the server's Retry-After, if any); raises RunFatalError
    when the whole run cannot work and PromptFailedError when only this prompt cannot.
    ``endpoint_answered``: the endpoint has sent a response in this process, so a connection it
    refuses now is an outage to wait out, not a wrong --base_url."""
    if isinstance(exc, openai.APIConnectionError):     # time-outs and dropped connections included
        if not endpoint_answered:
            _stop_if_unreachable(exc, base_url)
        return None
    if not isinstance(exc, openai.APIStatusError):
        raise PromptFailedError(f"{type(exc).__name__}: {exc}", "client_error")
    status = exc.status_code
    detail = _error_text(exc)
    if status == 429 or status in (408, 409) or status >= 500:
        return retry_after_seconds(exc.response.headers)
    if status == 401:
        raise RunFatalError(f"the endpoint {base_url} rejected the API key (HTTP 401: {detail}). "
                            "Check --api_key, OPENROUTER_API_KEY or OPENAI_API_KEY.")
    if status == 402:
        raise RunFatalError(f"the endpoint {base_url} refused payment (HTTP 402: {detail}). "
                            "Add credit to the account, or lower the cost with --max_samples.")
    if status == 404:
        raise RunFatalError(f"the endpoint {base_url} does not know model {model!r} or this API path "
                            f"(HTTP 404: {detail}). Check --model and --base_url (it usually ends in /v1).")
    if _context_overflow(exc, detail):
        raise PromptFailedError(f"the conversation no longer fits the model's context (HTTP {status}: {detail})",
                                CONTEXT_LENGTH)
    lowered = detail.lower()
    if status == 400 and "model" in lowered and any(
            phrase in lowered for phrase in ("not a valid model", "does not exist", "invalid model", "unknown model")):
        raise RunFatalError(f"the endpoint {base_url} does not accept model {model!r} (HTTP 400: {detail}).")
    raise PromptFailedError(f"HTTP {status}: {detail}", f"http_{status}")


def backoff_delay(attempt: int) -> float:
    return random.uniform(0, min(BACKOFF_CAP, BACKOFF_BASE * 2 ** attempt))


class MalformedReplyError(Exception):
    """A 200 response that is not a chat completion (an error body, a broken proxy, a buggy server).
    It fails the prompt, to be retried on resume: never read as an empty answer, which the
    no-reasoning filter would discard for good."""


def _preview(value: Any) -> str:
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else json.dumps(value, ensure_ascii=False)
    return text[:300]


def _count(section: dict, key: str, where: str) -> float:
    value = section.get(key)
    if value is None:
        return 0.0
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number):
        raise MalformedReplyError(f"{where}.{key} is not a number: {_preview(value)}")
    return number


def _object(section: dict, key: str, where: str) -> dict:
    value = section.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise MalformedReplyError(f"{where}.{key} is not an object: {_preview(value)}")
    return value


def _usage_from(data: dict) -> Usage:
    usage = _object(data, "usage", "reply")
    completion_details = _object(usage, "completion_tokens_details", "usage")
    prompt_details = _object(usage, "prompt_tokens_details", "usage")
    reasoning = _count(completion_details, "reasoning_tokens", "usage.completion_tokens_details")
    return Usage(prompt_tokens=int(_count(usage, "prompt_tokens", "usage")),
                 completion_tokens=int(_count(usage, "completion_tokens", "usage")),
                 reasoning_tokens=int(reasoning),
                 cached_tokens=int(_count(prompt_details, "cached_tokens", "usage.prompt_tokens_details")),
                 cost=_count(usage, "cost", "usage"))


def _check_tool_calls(message: dict) -> None:
    """Each tool call must name a function; its arguments may be text or an object (the session
    turns them into text and tells the model when they do not parse)."""
    calls = message.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise MalformedReplyError(f"choices[0].message.tool_calls is not a list: {_preview(calls)}")
    for position, call in enumerate(calls):
        where = f"choices[0].message.tool_calls[{position}]"
        if not isinstance(call, dict):
            raise MalformedReplyError(f"{where} is not an object: {_preview(call)}")
        function = call.get("function")
        if not isinstance(function, dict):
            raise MalformedReplyError(f"{where}.function is not an object: {_preview(function)}")
        if not isinstance(function.get("name"), str):
            raise MalformedReplyError(f"{where}.function.name is not a string: {_preview(function.get('name'))}")


def parse_reply(raw: bytes) -> ModelReply:
    """The first choice of a chat completion; MalformedReplyError naming what is wrong otherwise."""
    try:
        data = json.loads(raw)
    except ValueError:
        raise MalformedReplyError(f"reply is not JSON: {_preview(raw)!r}") from None
    except RecursionError:
        raise MalformedReplyError(f"reply is nested too deeply to read: {_preview(raw)!r}") from None
    if not isinstance(data, dict):
        raise MalformedReplyError(f"reply is not a JSON object: {_preview(raw)}")
    choices = data.get("choices")
    if not choices:
        raise MalformedReplyError(f"reply has no choices: {_preview(data.get('error') or data)}")
    if not isinstance(choices, list):
        raise MalformedReplyError(f"reply's choices is not a list: {_preview(choices)}")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise MalformedReplyError(f"reply's choices[0] is not an object: {_preview(choice)}")
    message = choice.get("message")
    if message is None:
        raise MalformedReplyError("choices[0].message is null")
    if not isinstance(message, dict):
        raise MalformedReplyError(f"choices[0].message is not an object: {_preview(message)}")
    _check_tool_calls(message)
    usage = data.get("usage")
    reported = isinstance(usage, dict) and usage.get("cost") is not None
    return ModelReply(message=message, finish_reason=choice.get("finish_reason"), usage=_usage_from(data),
                      cost_source="endpoint" if reported else "unknown")


async def call_model(client: openai.AsyncOpenAI, gate: Gate, *, body: bytes, model: str, max_retries: int,
                     base_url: str) -> ModelReply:
    """One chat completion, retried on transient errors with back-off honouring Retry-After."""
    attempt = 0
    while True:
        retry_after, overloaded = None, False
        async with gate.slot() as request:
            try:
                # The client's documented raw-post path: same HTTP, auth, errors and timeouts as
                # chat.completions.create, without re-validating the whole conversation on every call
                # (that walk cost more CPU than the rest of a session).
                raw = await client.post("/chat/completions", cast_to=bytes, content=body)
                request.answered()
                _ANSWERED.add(base_url)
                return parse_reply(raw)
            except openai.APIError as exc:
                if isinstance(exc, openai.APIStatusError):
                    _ANSWERED.add(base_url)
                    if overloaded := exc.status_code in OVERLOAD_STATUSES:
                        request.overloaded()
                retry_after = classify(exc, model=model, base_url=base_url, endpoint_answered=base_url in _ANSWERED)
                failure: Exception = exc
            except MalformedReplyError as exc:   # perhaps a proxy's passing fault: worth another attempt
                failure = exc
        if attempt >= max_retries:
            text, error_type = _failure(failure, client.timeout)
            attempts = f"{attempt + 1} attempt{'s' if attempt else ''}"
            raise PromptFailedError(f"gave up after {attempts}: {text}", error_type) from None
        if retry_after is not None:
            delay = retry_after
        elif overloaded and gate.adaptive and attempt == 0:
            # The limit was just lowered for this refusal: the retry waits for a slot under it, in line
            # with every other request. Sleeping as well would only leave its prompt behind (at the end
            # of a run, the whole run).
            delay = 0.0
        else:
            delay = backoff_delay(attempt)
        attempt += 1
        # A 429 that says when to come back holds every session until then. One that does not, under
        # adaptive concurrency, only lowers the limit: pausing the run for it would bring every session
        # back at once, to meet the limit again.
        if isinstance(failure, openai.RateLimitError) and (retry_after is not None or not gate.adaptive):
            gate.pause(delay)      # every session waits it out, this one too, in its next gate.slot()
        else:
            # A Retry-After told to many sessions at once would bring them all back at once.
            await asyncio.sleep(delay if retry_after is None else wake_delay(delay))


def _failure(exc: Exception, timeout: Any) -> tuple[str, str]:
    """(what went wrong, error type) for the failure row of a call that used up its retries."""
    if isinstance(exc, openai.APIStatusError):
        kind = "rate_limited" if isinstance(exc, openai.RateLimitError) else f"http_{exc.status_code}"
        return f"HTTP {exc.status_code}: {_error_text(exc)}", kind
    if isinstance(exc, openai.APIConnectionError):
        return _connection_failure(exc, timeout)
    return f"malformed reply: {exc}", "bad_response"


def _connection_failure(exc: openai.APIConnectionError, timeout: Any) -> tuple[str, str]:
    causes = list(_causes(exc))
    for cause in causes:
        if isinstance(cause, ConnectionRefusedError):
            return "the endpoint refused the connection", "connection"
        if isinstance(cause, socket.gaierror):
            return "the endpoint's host name cannot be resolved", "connection"
        if isinstance(cause, TimeoutError):
            seconds = f"{timeout:g}s" if isinstance(timeout, (int, float)) else str(timeout)
            return f"no reply within {seconds} (--request_timeout)", "timeout"
    return f"connection failed: {causes[-1]}", "connection"
