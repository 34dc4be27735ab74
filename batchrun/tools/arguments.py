"""Checks of tool arguments shared by several tools: one wording of each complaint to the model."""

from __future__ import annotations

import re

from batchrun.tools import ToolError

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


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


def holding_a_lone_surrogate(args: dict) -> str | None:
    """The name of an argument whose text (at any depth) holds a lone surrogate, else None. JSON's
    ``\\ud800`` escape decodes to one, which is not text: no command, pattern, path or file can be made
    of it, and each tool would fail on it its own way."""
    for name, value in args.items():
        pending = [value]
        while pending:
            item = pending.pop()
            if isinstance(item, str) and _LONE_SURROGATE.search(item):
                return str(name)
            if isinstance(item, dict):
                pending.extend(item.values())
            elif isinstance(item, list):
                pending.extend(item)
    return None


def shell_word(name: str, value: str) -> str:
    """``value``, refused if it holds a NUL byte: it goes into a command, and no program can be given one."""
    if "\0" in value:
        raise ToolError(f"'{name}' cannot contain a NUL byte")
    return value
