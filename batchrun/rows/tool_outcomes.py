"""How a session's tool calls are judged: the success rule for a result, the invented-tool rule, and
the per-tool counts a row carries. Apart from rendering: the session, the row builder, statistics and the
report all apply these rules, and each must apply the same ones."""

from __future__ import annotations

import json
from collections.abc import Iterable

from batchrun.registry import TOOL_NAMES
from batchrun.rows.records import Turn, calls_of


def tool_result_failed(result: str) -> bool:
    """Whether a tool result counts as a failure: a JSON result with a non-null ``error`` (also inside ``content``) or
    ``"success": false`` is a failure; so is non-JSON text that is empty or starts with ``Error:``."""
    try:
        parsed = json.loads(result)
    except (ValueError, TypeError):
        text = (result or "").strip()
        return not text or text.lower().startswith("error:")
    if isinstance(parsed, dict):
        if parsed.get("error") is not None or parsed.get("success") is False:
            return True
        inner = parsed.get("content")
        if isinstance(inner, dict) and (inner.get("error") is not None or inner.get("success") is False):
            return True
    return False


def is_invented(tool: str, offered_tools: Iterable[str]) -> bool:
    """The one rule for an invented tool call: it names a tool this prompt was not offered. A tool of
    the registry that the system turn did not list is as made up, to the model, as one that exists
    nowhere: the session answers it with an error (and ends a prompt that keeps doing it), the row
    counts it, the statistics book it to no tool, and the merge leaves the row out."""
    return tool not in offered_tools


# What the run's own files and messages note of one row's invented tools. A model may invent a thousand
# per reply, each named at any length: the row keeps them all, statistics.json, the merge's record and the
# run's "left out" line a few, cut short.
MOST_INVENTED_NAMES_NOTED = 5
MOST_INVENTED_NAME_CHARS = 100


def noted_invented_tools(names: list[str]) -> list[str]:
    """The first MOST_INVENTED_NAMES_NOTED of a row's invented ``names``, each cut to MOST_INVENTED_NAME_CHARS,
    and how many more there are."""
    noted = [name if len(name) <= MOST_INVENTED_NAME_CHARS else
             f"{name[:MOST_INVENTED_NAME_CHARS]}… ({len(name):,} characters)"
             for name in names[:MOST_INVENTED_NAMES_NOTED]]
    if len(names) > MOST_INVENTED_NAMES_NOTED:
        noted.append(f"and {len(names) - MOST_INVENTED_NAMES_NOTED:,} more")
    return noted


def tool_stats(turns: list[Turn], offered_tools: list[str]) -> tuple[dict, dict]:
    """(tool_stats, tool_error_counts) over the fixed registry: the same keys in every row."""
    stats = {name: {"count": 0, "success": 0, "failure": 0} for name in TOOL_NAMES}
    for call in calls_of(turns):
        if call.result is None or is_invented(call.name, offered_tools):
            continue
        entry = stats[call.name]
        entry["count"] += 1
        entry["failure" if tool_result_failed(call.result) else "success"] += 1
    return stats, {name: entry["failure"] for name, entry in stats.items()}


def invented_call_count(turns: list[Turn], offered_tools: list[str]) -> int:
    return sum(is_invented(call.name, offered_tools) for call in calls_of(turns))
