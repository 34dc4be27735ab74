"""Checks of tool arguments shared by several tools: one wording of each complaint to the model."""

from __future__ import annotations

from batchrun.tools import ToolError


def positive_int(args: dict, name: str, default: int) -> int:
    """A positive integer argument (2.0 counts as 2), or ``default`` when absent or null."""
    value = args.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ToolError(f"'{name}' must be a positive integer, not {value!r}")
    return value


def non_empty_text(args: dict, name: str) -> str:
    """A string argument with something besides whitespace in it, stripped."""
    value = args.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ToolError(f"'{name}' must be a non-empty string")
    return value.strip()
