"""The names of outcomes: why a session ended (EndReason) and what its row counts as (RowStatus), kept
in one place because the session produces them, rows store them, and statistics, the console, the report
and --export read them back.

Both are StrEnums: a member is its string (equal to it, hashed like it, written by json and msgspec as
it), so rows are byte for byte what plain strings wrote, and rows read back keep plain strings.
"""

from __future__ import annotations

from enum import StrEnum


class EndReason(StrEnum):
    FINAL_ANSWER = "final_answer"
    MAX_TURNS = "max_turns"
    INVENTED_TOOLS = "invented_tools"
    TRUNCATED = "truncated"
    EMPTY_ANSWER = "empty_answer"
    CONTEXT_LENGTH = "context_length"
    PROMPT_TIMEOUT = "prompt_timeout"
    CONTENT_FILTER = "content_filter"
    ERROR = "error"


MAX_TURNS_REACHED = "--max_turns model calls were made"

# Why a session ended. Only a final answer completes a row; every other reason but "error" (a failure
# row, retried on resume) leaves a partial trajectory of the turns it paid for.
END_REASONS: dict[EndReason, str] = {
    EndReason.FINAL_ANSWER: "the model answered without calling a tool",
    EndReason.MAX_TURNS: f"{MAX_TURNS_REACHED} (then one more, without tools, asked for a summary)",
    EndReason.INVENTED_TOOLS: "the model called tools it was not offered in 3 turns in a row",
    EndReason.TRUNCATED: "a reply stayed cut off by the output limit (after 3 requests to continue, its tool "
                         "calls twice in a row, or while it reasoned)",
    EndReason.EMPTY_ANSWER: "the model's answer had no text after 3 more requests",
    EndReason.CONTEXT_LENGTH: "the conversation outgrew the model's context",
    EndReason.PROMPT_TIMEOUT: "the prompt's --prompt_timeout passed",
    EndReason.CONTENT_FILTER: "the endpoint's content filter stopped a reply (not kept)",
    EndReason.ERROR: "the prompt failed; resume runs it again",
}
COMPLETED_END_REASONS = frozenset({EndReason.FINAL_ANSWER})


class RowStatus(StrEnum):
    """What a stored row counts as (see read_stored_row)."""

    COMPLETED = "completed"
    PARTIAL = "partial"
    DISCARDED = "discarded"
    FAILED = "failed"


# The names the readers of statuses use (rows.FAILED...).
COMPLETED, PARTIAL, DISCARDED, FAILED = RowStatus.COMPLETED, RowStatus.PARTIAL, RowStatus.DISCARDED, RowStatus.FAILED
NO_REASONING = "no_reasoning"       # the one discard reason so far
