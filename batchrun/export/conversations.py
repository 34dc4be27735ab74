"""A run's rows read back into structured conversations: the inverse of rows.render_conversations, and
Candidate, a row as the export looks at it (decoded once, its conversation read only when asked).

Rows keep only ``{from, value}`` per turn and a record of how each gpt turn was rendered; the turns
are read back by that record (rows.read_gpt_turn), losslessly: see docs/export.md. Separate from the
writers because the filters and --best_of read conversations too, whatever the format.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from batchrun import rows
from batchrun.export.options import refused_line
from batchrun.rows import AssistantTurn, HumanTurn, ToolCallRecord, Turn


class ConversionError(ValueError):
    """A row whose turns do not read back as one conversation: left out, and counted."""


@dataclass
class Conversation:
    """What rows.render_conversations rendered: render_conversations(tool names, prompt, turns) gives
    the row's turns back byte for byte."""

    tools: list[dict]          # OpenAI tool params, from the system turn's list
    prompt: str
    turns: list[ReadAssistantTurn | HumanTurn]

    def calls(self) -> list[ToolCallRecord]:
        return list(rows.calls_of(self.turns))

    def ends_on_an_answer(self) -> bool:
        """Whether the last turn is an answer without calls: a conversation that ends on a tool result,
        or on calls that never got one (a --prompt_timeout while tools ran), is refused by strict
        validators and chat templates."""
        last = self.turns[-1] if self.turns else None
        return isinstance(last, AssistantTurn) and not last.tool_calls


def conversation(turns: list[dict], layouts: list[rows.GptLayout]) -> Conversation:
    """A row's ``conversations`` read back into the session record it was rendered from, each gpt
    turn by its layout (the row's ``gpt_turns``)."""
    if len(turns) < 2 or turns[0].get("from") != "system" or turns[1].get("from") != "human":
        raise ConversionError("a row starts with a system turn and the prompt")
    record: list[ReadAssistantTurn | HumanTurn] = []
    gpt_layouts = iter(layouts)
    for turn in turns[2:]:
        speaker, value = turn.get("from"), turn.get("value")
        if not isinstance(value, str):
            raise ConversionError(f"a turn from {speaker!r} without a text value")
        if speaker == "human":
            record.append(HumanTurn(value))
        elif speaker == "gpt":
            layout = next(gpt_layouts, None)
            if layout is None:
                raise ConversionError("more gpt turns than the row's gpt_turns records")
            record.append(assistant_turn(value, layout, len(record)))
        elif speaker == "tool":
            _answer(record, value)
        else:
            raise ConversionError(f"a turn from {speaker!r}")
    return Conversation(tools=offered_tools(turns[0]["value"]), prompt=turns[1]["value"], turns=record)


def layouts_of(row: dict) -> list[rows.GptLayout]:
    """A current row's ``gpt_turns`` as read_gpt_turn takes them."""
    recorded = row.get("gpt_turns")
    if not isinstance(recorded, list):
        raise ConversionError("a row without gpt_turns")
    try:
        return [(int(entry["reasoning_chars"]), int(entry["tool_calls"])) for entry in recorded]
    except (TypeError, KeyError, ValueError):
        raise ConversionError("a gpt_turns entry that is not {reasoning_chars, tool_calls}") from None


def offered_tools(system_value: str) -> list[dict]:
    """The tools a system turn lists, as OpenAI tool params: the schemas the prompt was offered when it
    ran, whatever the registry says today."""
    tools = []
    for item in rows.offered_tool_signatures(system_value):
        if item.get("type") == "function":    # format 1 listed OpenAI params
            tools.append(item)
        elif isinstance(item.get("name"), str):
            function = {key: item[key] for key in ("name", "description", "parameters") if item.get(key) is not None}
            tools.append({"type": "function", "function": function})
    return tools


@dataclass
class ReadAssistantTurn(AssistantTurn):
    """A gpt turn read back from a row, with its text as the row shows it: think block and text, less the
    calls (what --reasoning=think exports, exactly as the row has it)."""

    shown: str = ""


def assistant_turn(value: str, layout: rows.GptLayout, position: int) -> ReadAssistantTurn:
    """A rendered gpt turn, read by its layout. Calls get their ids from the tool turn that answers
    them; one left unanswered (a prompt time limit struck mid-turn) keeps the id made here."""
    try:
        read = rows.read_gpt_turn(value, layout)
    except rows.LayoutError as exc:
        raise ConversionError(str(exc)) from None
    calls = [ToolCallRecord(id=f"unanswered_{position}_{index}", name=call["name"],
                            arguments=rows.arguments_text(call.get("arguments", {})))
             for index, call in enumerate(read.calls)]
    return ReadAssistantTurn(reasoning=read.reasoning, content=read.text, tool_calls=calls, shown=read.shown)


def _answer(record: Sequence[Turn], value: str) -> None:
    """Give the calls of the gpt turn before a tool turn their ids and results: each response answers
    the next call of its name (the session answers a turn's calls in order; one it never ran, when a
    time limit struck, has no response)."""
    payloads = rows.rendered_tool_responses(value, exact=True)
    if not payloads:
        raise ConversionError("a tool turn that is not <tool_response> blocks")
    turn = record[-1] if record else None
    if not isinstance(turn, AssistantTurn) or any(call.result is not None for call in turn.tool_calls):
        raise ConversionError("a tool turn that answers no gpt turn")
    unanswered = iter(turn.tool_calls)
    for payload in payloads:
        response = rows.parsed_or_raw(payload)
        if not (isinstance(response, dict) and isinstance(response.get("tool_call_id"), str)
                and "content" in response):
            raise ConversionError("a tool response without an id or content")
        call = next((call for call in unanswered if call.name == response.get("name")), None)
        if call is None:
            raise ConversionError("a tool response to a call the gpt turn did not make")
        content = response["content"]
        call.id = response["tool_call_id"]
        call.result = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------
# A row of the run, as the filters and the writers look at it


class Candidate:
    """A row the filters are looking at; its JSON is decoded once, and only when something needs it."""

    def __init__(self, stored: rows.StoredRow, path: Path, offset: int) -> None:
        self.stored = stored
        self.path, self.offset = path, offset       # the batch file and where in it the row's line starts

    @property
    def place(self) -> tuple[str, int]:
        """Which line of the run it is: batch file name and offset."""
        return self.path.name, self.offset

    @cached_property
    def row(self) -> dict:
        """The trajectory row in the current format; a tombstone without its tombstone keys, so every
        exported row has the keys of a merged one."""
        try:
            row = json.loads(self.stored.upgraded())
        except RecursionError:
            # JSON is read as deep as the stack leaves room for: the row reader, higher up, read this row
            raise refused_line(self.path, self.offset, "not a batch_runner row (JSON nested deeper than any row); "
                               "fix or remove this line") from None
        row.pop("discarded", None)
        row.pop("prompt", None)
        return row

    @cached_property
    def conversation(self) -> Conversation:
        return conversation(self.row["conversations"], layouts_of(self.row))

    def sharegpt_line(self) -> bytes:
        """The row as the merge writes it: its own bytes when it is a current trajectory row."""
        if self.stored.status != rows.DISCARDED and self.stored.is_verbatim:
            return self.stored.line
        return rows.encode_row(self.row)
