"""The Model on an OpenAI-compatible endpoint: the worker's clients, each conversation's request body kept
encoded between calls, and the price of a reply that carries no cost."""

from __future__ import annotations

import asyncio
import itertools
import json
import ssl
from collections.abc import Callable, Sequence
from typing import Any

import openai

from batchrun.config import EndpointConfig
from batchrun.endpoint.call import call_model
from batchrun.endpoint.transport import MODEL_REPLIES, BoundedAioHttpClient
from batchrun.model import CONTEXT_LENGTH, Message, ModelReply, PromptFailedError
from batchrun.rate_limit import Gate
from batchrun.rows import Usage

# The system's CA store, loaded once per process (at import, so before the pool forks workers share
# it): loading it per client would be paid again for every client of every worker. Not
# tools.clients' context: that one is httpx's, and httpx comes only with the optional web extra.
TLS_CONTEXT = ssl.create_default_context()


def make_client(base_url: str, api_key: str, *, timeout: float) -> openai.AsyncOpenAI:
    """The client on its aiohttp transport: with hundreds of sessions per process, the default
    transport's pure-Python HTTP handling cost more CPU than everything else a session does. Each
    reply's size is bounded (:mod:`batchrun.endpoint.transport`); ``timeout`` (--request_timeout)
    bounds each wait for the server, and :func:`call_model` the whole reply. A redirect is not
    followed: a 301 or 302 turns the chat request into a GET without the conversation, whose answer
    would be taken for the model's; it stops the run instead, naming where it points."""
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout,
                              http_client=BoundedAioHttpClient(timeout=timeout, verify=TLS_CONTEXT,
                                                               follow_redirects=False, reading=MODEL_REPLIES))


def preload_http_stack() -> None:
    """Import what the HTTP stack loads only when its first client is built (about a hundred modules).
    The pool calls this before forking, so workers share them instead of each loading its own; the
    client built here opens nothing and is dropped."""
    BoundedAioHttpClient(verify=TLS_CONTEXT, reading=MODEL_REPLIES)


# The largest conversation sent: no model reads more (about eight million tokens, four times the largest
# context served). Replies under every limit of their own add up, each sent back with every later request:
# twelve MiB of answer a turn took a gigabyte of a worker's memory per session in ten turns.
MAX_CONVERSATION_BYTES = 32 * 2**20


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

    def __init__(self, client: openai.AsyncOpenAI, gate: Gate, config: EndpointConfig,
                 tools: Sequence[Message]) -> None:
        self._client, self._gate, self._config = client, gate, config
        self._tools = list(tools)
        self._bodies: dict[bool, ConversationBody] = {}

    async def reply(self, messages: Sequence[Message], *, with_tools: bool,
                    on_send: Callable[[], None] = lambda: None,
                    on_refused: Callable[[Usage, str], None] = lambda usage, cost_source: None) -> ModelReply:
        body = self._bodies.get(with_tools)
        if body is None:
            body = self._bodies[with_tools] = ConversationBody(self._fields(with_tools))
        config = self._config
        encoded = body.encode(messages)
        if len(encoded) > MAX_CONVERSATION_BYTES:
            raise PromptFailedError(f"the conversation is {len(encoded) / 2**20:.2f} MiB, more than any model reads "
                                    f"(at most {MAX_CONVERSATION_BYTES / 2**20:g} MiB are sent)", CONTEXT_LENGTH)
        reply = await call_model(self._client, self._gate, body=encoded, model=config.model,
                                 max_retries=config.max_retries, base_url=config.base_url, on_send=on_send,
                                 on_refused=lambda usage, source: on_refused(usage, self._priced(usage, source)))
        reply.cost_source = self._priced(reply.usage, reply.cost_source)
        return reply

    def _priced(self, usage: Usage, cost_source: str) -> str:
        """Where ``usage``'s cost comes from, once a reply that said nothing of cost is priced (in place),
        if a price is known. A reply that counted no tokens (no usage at all, as some servers and proxies
        send) has nothing to price: its cost stays unknown rather than $0, which the caps would believe."""
        if cost_source == "unknown" and (usage.prompt_tokens or usage.completion_tokens):
            cost = self._config.pricing.cost(usage)
            if cost is not None:
                usage.cost, cost_source = cost, self._config.pricing.source
        return cost_source

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

    def __init__(self, config: EndpointConfig, gate: Gate, *, clients: int) -> None:
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
