"""Tool implementations. Each handler is ``async def handler(args: dict, ctx: ToolContext) -> dict``.

A handler returns a JSON-serialisable dict (the tool result the model sees) or raises
:class:`ToolError`; the session turns that into ``{"error": message}`` so statistics count it as a
failure. The schemas and the toolset of every tool live in ``model_tools.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchrun.environments.base import Environment, EnvironmentSettings, ToolError

__all__ = ["ToolContext", "ToolError"]


@dataclass
class ToolContext:
    """What a tool handler may touch: the prompt's own environment and the run's settings."""

    env: Environment
    settings: EnvironmentSettings
