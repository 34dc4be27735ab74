"""Rendering a session into Hermes ShareGPT turns: the system turn listing the offered tools, gpt turns
(a think block, the text, one <tool_call> block per call), tool turns (one <tool_response> block per
result), and the layout of each gpt turn recorded beside them. The byte-exact texts live here only;
read_back.py reads them back."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from batchrun.registry import REGISTRY
from batchrun.rows.records import AssistantTurn, HumanTurn, ToolCallRecord, Turn

# The Hermes function-calling system turn, byte for byte as the reference runner writes it: trainers
# of these models expect exactly this text around the tools' signatures.
SYSTEM_PREAMBLE = (
    "You are a function calling AI model. You are provided with function signatures within <tools> </tools> "
    "XML tags. You may call one or more functions to assist with the user query. If available tools are not "
    "relevant in assisting with user query, just respond in natural conversational language. Don't make "
    "assumptions about what values to plug into functions. After calling & executing the functions, you will be "
    "provided with function results within <tool_response> </tool_response> XML tags. Here are the available "
    "tools:\n<tools>\n"
)
SYSTEM_POSTAMBLE = (
    "\n</tools>\nFor each function call return a JSON object, with the following pydantic model json schema for "
    "each:\n{'title': 'FunctionCall', 'type': 'object', 'properties': {'name': {'title': 'Name', 'type': "
    "'string'}, 'arguments': {'title': 'Arguments', 'type': 'object'}}, 'required': ['name', 'arguments']}\n"
    "Each function call should be enclosed within <tool_call> </tool_call> XML tags.\nExample:\n<tool_call>\n"
    "{'name': <function-name>,'arguments': <args-dict>}\n</tool_call>"
)


def render_system_turn(tool_names: Iterable[str]) -> str:
    """The system turn listing exactly the tools this prompt was offered, each as its name,
    description and parameters."""
    signatures = [{"name": name, "description": REGISTRY[name].description,
                   "parameters": REGISTRY[name].parameters, "required": None} for name in tool_names]
    return SYSTEM_PREAMBLE + json.dumps(signatures, ensure_ascii=False) + SYSTEM_POSTAMBLE


def parsed_or_raw(text: str) -> Any:
    """JSON text as its value; anything else (invalid JSON a model wrote, JSON nested deeper than
    Python reads, plain output) as the text. Reads what rows hold, written by any version."""
    try:
        return json.loads(text)
    except (ValueError, TypeError, RecursionError):
        return text


def _strict_value_or_text(text: str) -> Any:
    """parsed_or_raw for what is about to be written: text holding NaN, Infinity or a number too large
    for a float stays text, as Python would write its value back as NaN or Infinity, which strict JSON
    parsers refuse."""
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, TypeError, RecursionError):
        return text


def _refuse_constant(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is too large for a float")
    return value


# Arguments nested deeper stay text in a call block: written one level deeper inside it, a value Python
# only just managed to read could not be read back, and the row would be refused.
MAX_ARGUMENT_DEPTH = 500


def arguments_value(text: str) -> Any:
    """A call's arguments as its block holds them: their JSON value, or the text (not JSON, a JSON
    string, or nested deeper than MAX_ARGUMENT_DEPTH). A string in the block is always the text the
    model sent: a JSON string's value would read back as text without its quotes."""
    value = _strict_value_or_text(text)
    if isinstance(value, str):
        return text
    if text.count("[") + text.count("{") > MAX_ARGUMENT_DEPTH and _depth(value) > MAX_ARGUMENT_DEPTH:
        return text
    return value


def _depth(value: Any) -> int:
    """How deeply lists and objects nest in ``value`` (without recursion: it may be deep)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def arguments_text(arguments: Any) -> str:
    """A call's arguments as rendered (see :func:`render_gpt_turn`) back into the text the model sent:
    arguments that parse as JSON were written as their value and any other text as it was, so such
    text goes back unchanged and everything else as JSON."""
    if isinstance(arguments, str) and arguments_value(arguments) == arguments:
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


def tool_response_content(result: str) -> Any:
    """A tool result as the tool turn holds it: parsed when it is a JSON object or array, else the text."""
    if result.strip()[:1] in ("{", "["):
        try:
            return json.loads(result)
        except ValueError:
            pass
    return result


# A gpt turn opens with its reasoning in a think block, or with an empty block when it had none (unless
# its text already holds a <think>), and carries no trailing whitespace.
THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n"
EMPTY_THINK = "<think>\n</think>\n"
# Each call of a gpt turn, and each result of a tool turn, is one block holding one JSON line.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>"


def render_gpt_turn(turn: AssistantTurn) -> dict:
    parts = [turn.content] if turn.content else []
    for call in turn.tool_calls:
        payload = json.dumps({"name": call.name, "arguments": arguments_value(call.arguments)},
                             ensure_ascii=False)
        parts.append(TOOL_CALL_OPEN + payload + TOOL_CALL_CLOSE)
    body = "\n".join(parts)
    if turn.reasoning.strip():
        value = THINK_OPEN + turn.reasoning + THINK_CLOSE + body
    else:
        value = body if "<think>" in body else EMPTY_THINK + body
    return {"from": "gpt", "value": value.rstrip()}


# How a gpt turn was rendered, recorded beside the conversation (a row's "gpt_turns", one entry per gpt
# turn): the length of its reasoning (0: none) and how many calls it made. Its text cannot tell: a
# reply may itself write "</think>" or end in a "<tool_call>" block, and a reader of the text alone
# would take that for reasoning, or for a call that was never made.
GptLayout = tuple[int, int]       # (reasoning characters, tool calls)


def gpt_layout(turn: AssistantTurn) -> dict:
    return {"reasoning_chars": len(turn.reasoning) if turn.reasoning.strip() else 0,
            "tool_calls": len(turn.tool_calls)}


def render_tool_turn(calls: list[ToolCallRecord]) -> dict:
    blocks = []
    for call in calls:
        payload = json.dumps({"tool_call_id": call.id, "name": call.name,
                              "content": tool_response_content(call.result or "")}, ensure_ascii=False)
        blocks.append(TOOL_RESPONSE_OPEN + payload + TOOL_RESPONSE_CLOSE)
    return {"from": "tool", "value": "\n".join(blocks)}


def render_conversations(offered_tools: list[str], prompt: str, turns: list[Turn]) -> list[dict]:
    conversations = [{"from": "system", "value": render_system_turn(offered_tools)},
                     {"from": "human", "value": prompt}]
    for turn in turns:
        if isinstance(turn, HumanTurn):
            conversations.append({"from": "human", "value": turn.text})
            continue
        conversations.append(render_gpt_turn(turn))
        answered = [call for call in turn.tool_calls if call.result is not None]
        if answered:
            conversations.append(render_tool_turn(answered))
    return conversations
