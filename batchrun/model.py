"""What a session asks of a model: one call, a reply, and errors that say what they mean.

A session depends on this protocol, not on an HTTP client: the run's endpoint is one implementation
(:class:`batchrun.endpoint.OpenAIModel`), and a test can script another in-process. Nothing here
imports the HTTP stack.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from batchrun.rows import Usage

Message = dict[str, Any]       # one chat message, as the chat-completions API spells it

CONTEXT_LENGTH = "context_length"     # error type of a conversation too long for the model


class RunFatalError(Exception):
    """The whole run cannot work (bad key, unknown model, no credit): stop instead of failing every prompt."""


class PromptFailedError(Exception):
    """This prompt cannot be completed now; it leaves a failure row and is retried on resume."""

    def __init__(self, message: str, error_type: str) -> None:
        super().__init__(message)
        self.error_type = error_type


@dataclass
class ModelReply:
    message: Message              # the assistant message, as received (reasoning fields, tool calls)
    finish_reason: str | None
    usage: Usage
    cost_source: str = "endpoint"     # where usage.cost came from: one of pricing.COST_SOURCES


class Model(Protocol):
    """One session's model. Its tools are fixed for the session; each call either offers them or,
    for the summary at --max_turns, does not.

    ``messages`` only grows from one call to the next (an implementation may keep what it made of
    the earlier ones). A call retries what is worth retrying itself; what it cannot recover from it
    raises as :class:`PromptFailedError` (this prompt) or :class:`RunFatalError` (the whole run).
    ``on_send`` is called each time a request of the call is let through the run's gate and goes out;
    ``on_refused`` with the usage (and where its cost came from) of each reply the call refused whose
    usage could be read: the endpoint billed it, and the session counts it as it counts a reply."""

    async def reply(self, messages: Sequence[Message], *, with_tools: bool,
                    on_send: Callable[[], None] = lambda: None,
                    on_refused: Callable[[Usage, str], None] = lambda usage, cost_source: None) -> ModelReply: ...


class ModelSource(Protocol):
    """What builds each session's :class:`Model`, shared by the sessions of one worker (connections,
    the run-wide rate gate)."""

    def model(self, prompt_index: int, tools: Sequence[Message]) -> Model:
        """The model for one session, offering ``tools`` (their schemas; none: a plain chat)."""
        ...

    def tool_client(self, prompt_index: int) -> Any:
        """The client tools that call a model themselves use (vision, image generation); None if none."""
        ...

    async def close(self) -> None:
        """Close the connections, once every session is done."""
        ...
