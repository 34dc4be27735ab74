"""Building the rows the runner writes: a trajectory row from a SessionResult, a failure row, a
tombstone of a discarded trajectory; the format number they carry, their key order, and their encoding as
one JSONL line."""

from __future__ import annotations

import json

from batchrun.registry import toolsets_offering
from batchrun.rows.outcome import COMPLETED_END_REASONS
from batchrun.rows.records import AssistantTurn, SessionResult
from batchrun.rows.render import gpt_layout, render_conversations
from batchrun.rows.tool_outcomes import invented_call_count, tool_stats

# Every row carries "format": ROW_FORMAT. A reader refuses rows of a higher format (their meaning may
# have changed) and reads older ones: format 1 (or no key) put a "tool_calls" list on gpt turns and
# judged invented tools by the registry; formats 1 and 2 kept no "gpt_turns" (their turns are read by
# their text, see read_gpt_turn); formats 1 to 3 kept no "sample_index" (every row was sample 0, and
# resume must not take a later sample for another occurrence of its prompt). The merge writes such rows
# upgraded (StoredRow.upgraded).
ROW_FORMAT = 4


def trajectory_row(result: SessionResult, *, batch_num: int, model: str, timestamp: str) -> dict:
    stats, error_counts = tool_stats(result.turns, result.offered_tools)
    completed = result.end_reason in COMPLETED_END_REASONS
    return {
        "format": ROW_FORMAT,
        "prompt_index": result.prompt_index,
        "sample_index": result.sample_index,
        "content_key": result.content_key,
        "conversations": render_conversations(result.offered_tools, result.prompt, result.turns),
        "metadata": {"batch_num": batch_num, "timestamp": timestamp, "model": model},
        "gpt_turns": [gpt_layout(turn) for turn in result.turns if isinstance(turn, AssistantTurn)],
        "completed": completed,
        "partial": not completed,
        "api_calls": result.api_calls,
        # What the model was given; a sampled toolset whose tools this machine cannot run is only
        # in toolsets_sampled.
        "toolsets_used": toolsets_offering(result.toolsets, result.offered_tools),
        "toolsets_sampled": result.toolsets,
        "tool_stats": stats,
        "tool_error_counts": error_counts,
        "invented_tool_calls": invented_call_count(result.turns, result.offered_tools),
        "usage": result.usage.as_dict(),
        "wall_time_seconds": round(result.wall_time, 3),
        "end_reason": result.end_reason,
    }


# The keys of a trajectory row in the order it writes them; an upgraded older row follows it too.
KEY_ORDER = {key: position for position, key in enumerate((
    "format", "prompt_index", "sample_index", "content_key", "conversations", "metadata", "gpt_turns", "completed",
    "partial", "api_calls",
    "toolsets_used", "toolsets_sampled", "tool_stats", "tool_error_counts", "invented_tool_calls", "usage",
    "wall_time_seconds", "end_reason", "discarded"))}


def tombstone_row(trajectory: dict, reason: str) -> dict:
    """A discarded trajectory keeps everything it had, so it can be inspected, counted (its turns
    belong to the run's reasoning coverage) and filtered again; ``discarded`` keeps it out of the
    merged file and marks its prompt done."""
    return {**trajectory, "discarded": reason, "prompt": trajectory["conversations"][1]["value"]}


def failure_row(result: SessionResult) -> dict:
    return {"format": ROW_FORMAT, "prompt_index": result.prompt_index, "sample_index": result.sample_index,
            "content_key": result.content_key, "failed": True, "error": result.error, "error_type": result.error_type,
            "prompt": result.prompt, "api_calls": result.api_calls,
            "usage": result.usage.as_dict(), "wall_time_seconds": round(result.wall_time, 3),
            "end_reason": result.end_reason}


# JSON allows these raw inside strings, but Python's str.splitlines, codecs' line readers and some JSONL
# loaders break lines at them, and would cut a row in pieces: escaped, the line holds the same JSON.
_LINE_BREAKS_JSON_ALLOWS = {"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def encode_row(row: dict) -> bytes:
    """One JSONL line, always valid UTF-8 whatever bytes a tool produced (lone surrogates -> '?'),
    always JSON (a NaN or an infinity raises here rather than make a line no reader takes), and one
    line to any line reader."""
    text = json.dumps(row, ensure_ascii=False, allow_nan=False)
    for character, escaped in _LINE_BREAKS_JSON_ALLOWS.items():
        if character in text:       # rare; a quick look where the text has no character beyond ASCII
            text = text.replace(character, escaped)
    return (text + "\n").encode("utf-8", "replace")
