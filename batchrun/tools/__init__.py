"""Tool implementations. Each handler is ``async def handler(args: dict, ctx: ToolContext) -> dict``.

A handler returns a JSON-serialisable dict (the tool result the model sees) or raises
:class:`ToolError`; the session turns that into ``{"error": message}`` so statistics count it as a
failure. The schemas and the toolset of every tool live in ``batchrun/registry.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from batchrun.environments.base import Environment, EnvironmentSettings, ToolError

__all__ = ["ModelAccess", "ToolContext", "ToolError"]


@dataclass(frozen=True)
class ModelAccess:
    """The run's endpoint, for tools that call a model themselves (vision, image generation).

    The key stays in the worker process: it is used for HTTP calls, never put in a tool's result
    or a command's environment.
    """

    base_url: str
    api_key: str = field(repr=False)
    model: str
    client: Any                    # the worker's openai.AsyncOpenAI for this endpoint


@dataclass
class ToolContext:
    """What a tool handler may touch: the prompt's own environment, the run's settings, the endpoint,
    and per-session state. One context lives as long as its session.

    ``state`` holds what a toolset keeps between calls of one session (a browser page, say);
    ``cleanups`` are awaited when the session ends, whatever way it ends.
    """

    env: Environment | None
    settings: EnvironmentSettings
    model: ModelAccess | None = None
    state: dict[str, Any] = field(default_factory=dict)
    cleanups: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    def environment(self) -> Environment:
        """The prompt's environment, for the tools that cannot work without one (a session offers them
        only with one, so its absence is reported, not assumed away)."""
        if self.env is None:
            raise ToolError("this tool needs the prompt's working directory, and this session has none")
        return self.env
