"""Reading rendered turns back: a gpt turn's reasoning, text and calls (by its recorded layout, proven by
rendering it again, or by the older rules of its text), a tool turn's responses, and the tools a system
turn lists. Apart from render.py: the readers (the stored-row reader, --export, the report) need only
this, and it is the inverse of the renderer, checked against it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from batchrun.rows.records import AssistantTurn, ToolCallRecord
from batchrun.rows.render import (
    EMPTY_THINK,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    GptLayout,
    arguments_text,
    parsed_or_raw,
    render_gpt_turn,
)


def split_rendered_reasoning(value: str) -> tuple[str, str]:
    """(reasoning, the rest) of a rendered gpt turn: the inverse of :func:`render_gpt_turn`'s think
    block. Also reads format 1's empty block, ``<think>\n\n</think>\n``."""
    if value.startswith(EMPTY_THINK.rstrip("\n")):
        return "", value[len(EMPTY_THINK) - 1:].removeprefix("\n")
    if value.startswith(THINK_OPEN):
        close = value.find(THINK_CLOSE.rstrip("\n"), len(THINK_OPEN) - 1)
        if close >= 0:
            rest = value[close + len(THINK_CLOSE) - 1:]
            return value[len(THINK_OPEN):close], rest.removeprefix("\n")
    return "", value


_RENDERED_CALL = re.compile(r"<tool_call>\n(.*)\n</tool_call>")     # the payload is one JSON line
_RENDERED_RESPONSE = re.compile(r"<tool_response>\n(.*)\n</tool_response>")
_TOOLS_LIST = re.compile(r"<tools>\n(.*)\n</tools>", re.DOTALL)


def rendered_calls(gpt_value: str) -> list[dict]:
    """The calls of a rendered gpt turn, each ``{"name": ..., "arguments": ...}`` as the turn wrote them."""
    calls = []
    for payload in _RENDERED_CALL.findall(gpt_value):
        call = parsed_or_raw(payload)
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            calls.append(call)
    return calls


def split_rendered_calls(rest: str) -> tuple[str, list[dict]]:
    """(text, calls) of a rendered gpt turn less its think block (the rest that
    :func:`split_rendered_reasoning` returns): the inverse of :func:`render_gpt_turn`'s call blocks.
    Calls are taken from the end, one block at a time, as the renderer appended them, so text in which
    the model merely wrote a ``<tool_call>`` stays text."""
    calls: list[dict] = []
    text = rest
    while text.endswith(TOOL_CALL_CLOSE):
        start = text.rfind(TOOL_CALL_OPEN)
        opens_a_line = start == 0 or (start > 0 and text[start - 1] == "\n")
        block = rendered_calls(text[start:]) if opens_a_line else []
        if len(block) != 1:
            break
        calls.insert(0, block[0])
        text = text[:max(start - 1, 0)]
    return text, calls


class LayoutError(ValueError):
    """A gpt turn whose text is not what its recorded layout renders (a row edited by hand)."""


@dataclass
class ReadGptTurn:
    """A rendered gpt turn read back: the parts render_gpt_turn was given."""

    reasoning: str
    text: str
    calls: list[dict]       # {"name": ..., "arguments": ...} as the turn wrote them
    shown: str              # the turn as the row shows it, less its calls: think block and text


def read_gpt_turn(value: str, layout: GptLayout | None) -> ReadGptTurn:
    """The one reader of a gpt turn: by its recorded layout, and proven by rendering it again; by
    the rules its text was written under for a row from before layouts were recorded (``None``).
    Raises LayoutError when the turn is not what its layout renders."""
    if layout is None:
        return _read_by_text(value)
    reasoning_chars, call_count = layout
    head, calls = _take_calls(value, call_count)
    if reasoning_chars:
        close = len(THINK_OPEN) + reasoning_chars
        reasoning = head[len(THINK_OPEN):close]
        text = head[close + len(THINK_CLOSE) - 1:].removeprefix("\n")
    else:
        # An empty block, or none when the text holds a "<think>"; a session's text never starts
        # with a think block (split_reasoning takes them all out), so a leading one is the empty block.
        empty = EMPTY_THINK.rstrip("\n")
        reasoning, text = "", head[len(empty):].removeprefix("\n") if head.startswith(empty) else head
    turn = ReadGptTurn(reasoning=reasoning, text=text, calls=calls, shown=head)
    if _rendered(turn) != value:
        raise LayoutError(f"a gpt turn is not what its record ({reasoning_chars} characters of reasoning, "
                          f"{call_count} calls) renders")
    return turn


def _take_calls(value: str, count: int) -> tuple[str, list[dict]]:
    """(the rest, the last ``count`` call blocks of a rendered gpt turn). Each block is its own three
    lines, its payload one JSON line, so from the end each block is found exactly."""
    calls: list[dict] = []
    rest = value
    for taken in range(count):
        if taken:
            rest = rest.removesuffix("\n")      # blocks are joined by a newline
        start = rest.rfind(TOOL_CALL_OPEN)
        payload = rest[start + len(TOOL_CALL_OPEN):len(rest) - len(TOOL_CALL_CLOSE)]
        call = parsed_or_raw(payload)
        if (start < 0 or not rest.endswith(TOOL_CALL_CLOSE) or "\n" in payload or not isinstance(call, dict)
                or not isinstance(call.get("name"), str)):
            raise LayoutError(f"a gpt turn has fewer than the {count} calls its record names")
        calls.insert(0, call)
        rest = rest[:start]
    return (rest.removesuffix("\n") if count else rest), calls


def _rendered(turn: ReadGptTurn) -> str:
    calls = [ToolCallRecord(id="", name=call["name"], arguments=arguments_text(call.get("arguments", {})))
             for call in turn.calls]
    return render_gpt_turn(AssistantTurn(reasoning=turn.reasoning, content=turn.text, tool_calls=calls))["value"]


def _read_by_text(value: str) -> ReadGptTurn:
    """How rows of formats 1 and 2, which kept no layout, are read: reasoning up to the first closing
    tag, calls taken from the end while the text ends in a call block."""
    reasoning, rest = split_rendered_reasoning(value)
    text, calls = split_rendered_calls(rest)
    shown = value[:len(value) - len(rest) + len(text)]
    return ReadGptTurn(reasoning=reasoning, text=text, calls=calls, shown=shown if text else shown.removesuffix("\n"))


def layout_by_text(value: str) -> dict:
    """The layout rows of formats 1 and 2 are read by (see _read_by_text), for their upgrade."""
    turn = _read_by_text(value)
    return {"reasoning_chars": len(turn.reasoning), "tool_calls": len(turn.calls)}


def rendered_tool_responses(value: str, *, exact: bool = False) -> list[str]:
    """The payloads (one JSON line each) of a rendered tool turn's ``<tool_response>`` blocks. With
    ``exact``, none unless the turn is those blocks and nothing else, as :func:`render_tool_turn` wrote it."""
    payloads = _RENDERED_RESPONSE.findall(value)
    if exact and "\n".join(TOOL_RESPONSE_OPEN + payload + TOOL_RESPONSE_CLOSE for payload in payloads) != value:
        return []
    return payloads


def offered_tool_signatures(system_value: str) -> list[dict]:
    """The entries of a rendered system turn's tool list: name, description and parameters each
    (format 1 listed OpenAI tool schemas, ``{"type": "function", "function": {...}}``)."""
    listed = _TOOLS_LIST.search(system_value)
    signatures = parsed_or_raw(listed.group(1)) if listed else []
    return [item for item in signatures if isinstance(item, dict)] if isinstance(signatures, list) else []


def offered_tool_names(system_value: str) -> list[str]:
    """The tools a rendered system turn lists."""
    names = [item.get("name", (item.get("function") or {}).get("name"))
             for item in offered_tool_signatures(system_value)]
    return [name for name in names if isinstance(name, str)]
