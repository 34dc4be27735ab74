"""The row format: what a session records, how it is rendered and read back, how its outcome is judged,
the rows the runner writes and the one reader of stored rows.

Every kind of row the runner writes carries ``format``, ``prompt_index``, ``content_key`` and
``end_reason``, so the resume scan and the merge can classify a line without caring which kind it is:

* a trajectory row (completed or partial) — the Hermes ShareGPT format (README, Output);
* a tombstone ``{"discarded": "no_reasoning", ...}`` — done, never re-run, never merged;
* a failure row ``{"failed": true, "error": ...}`` — retried on resume, never merged.

The files, each one job (this module gathers the format's vocabulary that the rest of the code uses):

* ``keys.py`` — a prompt's content key, a sample's key and a unit's key (what resume counts done);
* ``reasoning.py`` — an assistant message's reasoning and visible text, from every form endpoints use;
* ``records.py`` — what a session records: turns, tool calls, usage, the SessionResult a worker returns;
* ``outcome.py`` — EndReason (with END_REASONS' descriptions) and RowStatus, the names of outcomes;
* ``tool_outcomes.py`` — the success rule for a tool result, the invented-tool rule, per-tool stats;
* ``render.py`` — a session rendered as ShareGPT turns (system, gpt, tool) and each gpt turn's layout;
* ``read_back.py`` — rendered turns read back: a gpt turn by its layout, tool responses, offered tools;
* ``build.py`` — trajectory, failure and tombstone rows, ROW_FORMAT, their key order and encoding;
* ``stored.py`` — the msgspec reader of stored rows (StoredRow), older formats upgraded, newer refused;
* ``finished.py`` — which kind of row a finished session becomes, encoded.
"""

from batchrun.rows.build import ROW_FORMAT, encode_row, failure_row, tombstone_row, trajectory_row
from batchrun.rows.finished import encode_finished
from batchrun.rows.keys import (
    content_key,
    content_key_of_sample,
    sample_index_of,
    sample_key,
    sample_key_of_unit,
    split_unit,
    unit_key,
)
from batchrun.rows.outcome import (
    COMPLETED,
    DISCARDED,
    END_REASONS,
    FAILED,
    MAX_TURNS_REACHED,
    NO_REASONING,
    PARTIAL,
    EndReason,
    RowStatus,
)
from batchrun.rows.read_back import (
    LayoutError,
    ReadGptTurn,
    offered_tool_names,
    offered_tool_signatures,
    read_gpt_turn,
    rendered_tool_responses,
    split_rendered_calls,
    split_rendered_reasoning,
)
from batchrun.rows.reasoning import split_reasoning
from batchrun.rows.records import AssistantTurn, HumanTurn, SessionResult, ToolCallRecord, Turn, Usage, calls_of
from batchrun.rows.render import (
    GptLayout,
    arguments_text,
    parsed_or_raw,
    render_conversations,
    render_gpt_turn,
    render_system_turn,
    render_tool_turn,
)
from batchrun.rows.stored import RowError, StoredRow, read_stored_row
from batchrun.rows.tool_outcomes import is_invented, noted_invented_tools, tool_result_failed

__all__ = [
    "COMPLETED", "DISCARDED", "END_REASONS", "FAILED", "MAX_TURNS_REACHED", "NO_REASONING", "PARTIAL",
    "ROW_FORMAT", "AssistantTurn", "EndReason", "GptLayout", "HumanTurn", "LayoutError", "ReadGptTurn",
    "RowError", "RowStatus", "SessionResult", "StoredRow", "ToolCallRecord", "Turn", "Usage", "arguments_text",
    "calls_of", "content_key", "content_key_of_sample", "encode_finished", "encode_row", "failure_row", "is_invented",
    "noted_invented_tools",
    "offered_tool_names", "offered_tool_signatures", "parsed_or_raw", "read_gpt_turn", "read_stored_row",
    "render_conversations", "render_gpt_turn", "render_system_turn", "render_tool_turn",
    "rendered_tool_responses", "sample_index_of", "sample_key", "sample_key_of_unit", "split_reasoning",
    "split_rendered_calls",
    "split_rendered_reasoning", "split_unit", "tombstone_row", "tool_result_failed", "trajectory_row", "unit_key",
]
