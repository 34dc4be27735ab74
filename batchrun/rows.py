"""The row format: one place each for the schema, the ShareGPT rendering, the success rule,
reasoning detection, the resume content key, and the encoding and the one reader of stored rows.

Every kind of row the runner writes carries ``format``, ``prompt_index``, ``content_key`` and
``end_reason``, so the resume scan and the merge can classify a line without caring which kind it is:

* a trajectory row (completed or partial) — the Hermes ShareGPT format (README, Output);
* a tombstone ``{"discarded": "no_reasoning", ...}`` — done, never re-run, never merged;
* a failure row ``{"failed": true, "error": ...}`` — retried on resume, never merged.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec

from batchrun.registry import REGISTRY, TOOL_NAMES, toolsets_offering

# ---------------------------------------------------------------------------------------------
# Identity of a unit of work


def content_key(prompt: str, image: str | None, cwd: str | None) -> str:
    """Identifies a prompt by what it is, not where it sits, so resume survives reordered datasets."""
    canonical = json.dumps([prompt, image, cwd], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def sample_key(key: str, sample_index: int) -> str:
    """What resume counts done: one sample of a prompt. Sample 0 is the prompt's content key itself, so
    a run of one sample per prompt (and every row written before samples existed) counts as it always has."""
    return key if sample_index == 0 else f"{key}#{sample_index}"


# ---------------------------------------------------------------------------------------------
# Reasoning

_THINK_BLOCK = re.compile(r"<(think|REASONING_SCRATCHPAD)>(.*?)</\1>", re.DOTALL | re.IGNORECASE)
_UNCLOSED_THINK = re.compile(r"^\s*<(think|REASONING_SCRATCHPAD)>(.*)$", re.DOTALL | re.IGNORECASE)


def _details_text(details: Any) -> str:
    """Text of OpenRouter-style ``reasoning_details`` (reasoning.text / reasoning.summary items)."""
    if not isinstance(details, list):
        return ""
    parts = []
    for item in details:
        if isinstance(item, dict):
            text = item.get("text") or item.get("summary")
            if isinstance(text, str) and text.strip():
                parts.append(text)
    return "\n".join(parts)


def split_reasoning(message: dict) -> tuple[str, str]:
    """(reasoning, visible content) of one assistant message, from every form endpoints use.

    Structured fields win; reasoning written inline as <think>/<REASONING_SCRATCHPAD> blocks is
    also taken out of the visible text so a trajectory never shows it twice.
    """
    content = message.get("content") or ""
    if not isinstance(content, str):
        content = ""
    found: list[str] = []
    for key in ("reasoning", "reasoning_content"):
        value = message.get(key)
        if isinstance(value, str) and value.strip():
            found.append(value.strip())
            break
    if not found:
        details = _details_text(message.get("reasoning_details"))
        if details.strip():
            found.append(details.strip())
    # Taken out until none is left: taking one out can join the text around it into another
    # ("<thi<think></think>nk>...</think>"), and the visible text never holds a think block.
    inline: list[str] = []
    while blocks := [m.group(2).strip() for m in _THINK_BLOCK.finditer(content)]:
        inline += blocks
        content = _THINK_BLOCK.sub("", content)
    if not inline:
        unclosed = _UNCLOSED_THINK.match(content)
        if unclosed:  # a truncated reply may open a think block it never closes
            inline = [unclosed.group(2).strip()]
            content = ""
    found.extend(text for text in inline if text and text not in found)
    return "\n\n".join(found), content.strip()


# ---------------------------------------------------------------------------------------------
# The success rule


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


# ---------------------------------------------------------------------------------------------
# One session's record, and its rendering


@dataclass
class ToolCallRecord:
    id: str
    name: str
    arguments: str          # exactly as the model wrote it
    result: str | None = None


@dataclass
class AssistantTurn:
    reasoning: str
    content: str
    tool_calls: list[ToolCallRecord] = field(default_factory=list)


@dataclass
class HumanTurn:
    """A message the runner itself sent the model mid-session (asking it to continue a cut-off reply,
    or to sum up at --max_turns): the model answered it, so the trajectory shows it."""

    text: str


Turn = AssistantTurn | HumanTurn


def calls_of(turns: Iterable[Turn]) -> Iterable[ToolCallRecord]:
    return (call for turn in turns if isinstance(turn, AssistantTurn) for call in turn.tool_calls)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    cost: float = 0.0

    def add(self, other: Usage) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.reasoning_tokens += other.reasoning_tokens
        self.cached_tokens += other.cached_tokens
        self.cost += other.cost

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "reasoning_tokens": self.reasoning_tokens, "cached_tokens": self.cached_tokens,
                "cost": round(self.cost, 8)}


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
    Python reads, plain output) as the text."""
    try:
        return json.loads(text)
    except (ValueError, TypeError, RecursionError):
        return text


# Arguments nested deeper stay text in a call block: written one level deeper inside it, a value Python
# only just managed to read could not be read back, and the row would be refused.
MAX_ARGUMENT_DEPTH = 500


def arguments_value(text: str) -> Any:
    """A call's arguments as its block holds them: their JSON value, or the text (not JSON, or nested
    deeper than MAX_ARGUMENT_DEPTH)."""
    value = parsed_or_raw(text)
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


# How a gpt turn was rendered, recorded beside the conversation (a row's "gpt_turns", one entry per gpt
# turn): the length of its reasoning (0: none) and how many calls it made. Its text cannot tell: a
# reply may itself write "</think>" or end in a "<tool_call>" block, and a reader of the text alone
# would take that for reasoning, or for a call that was never made.
GptLayout = tuple[int, int]       # (reasoning characters, tool calls)


def gpt_layout(turn: AssistantTurn) -> dict:
    return {"reasoning_chars": len(turn.reasoning) if turn.reasoning.strip() else 0,
            "tool_calls": len(turn.tool_calls)}


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


def is_invented(tool: str, offered_tools: Iterable[str]) -> bool:
    """The one rule for an invented tool call: it names a tool this prompt was not offered. A tool of
    the registry that the system turn did not list is as made up, to the model, as one that exists
    nowhere: the session answers it with an error (and ends a prompt that keeps doing it), the row
    counts it, the statistics book it to no tool, and the merge leaves the row out."""
    return tool not in offered_tools


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


# ---------------------------------------------------------------------------------------------
# Row construction


@dataclass
class SessionResult:
    """What a worker hands back for one prompt; the parent only persists it."""

    prompt_index: int
    content_key: str
    prompt: str
    toolsets: list[str]
    offered_tools: list[str]
    turns: list[Turn]
    api_calls: int
    usage: Usage
    wall_time: float
    end_reason: str            # one of END_REASONS
    error: str | None = None
    error_type: str | None = None
    sample_index: int = 0      # which of the prompt's --samples_per_prompt runs this is


# Why a session ended. Only a final answer completes a row; every other reason but "error" (a failure
# row, retried on resume) leaves a partial trajectory of the turns it paid for.
END_REASONS = {
    "final_answer": "the model answered without calling a tool",
    "max_turns": "--max_turns model calls were made (then one more, without tools, asked for a summary)",
    "invented_tools": "the model called tools it was not offered in 3 turns in a row",
    "truncated": "a reply stayed cut off by the output limit (after 3 requests to continue, its tool calls "
                 "twice in a row, or while it reasoned)",
    "empty_answer": "the model's answer had no text after 3 more requests",
    "context_length": "the conversation outgrew the model's context",
    "prompt_timeout": "the prompt's --prompt_timeout passed",
    "error": "the prompt failed; resume runs it again",
}
COMPLETED_END_REASONS = frozenset({"final_answer"})

# Every row carries "format": ROW_FORMAT. A reader refuses rows of a higher format (their meaning may
# have changed) and reads older ones: format 1 (or no key) put a "tool_calls" list on gpt turns and
# judged invented tools by the registry; formats 1 and 2 kept no "gpt_turns" (their turns are read by
# their text, see read_gpt_turn); formats 1 to 3 kept no "sample_index" (every row was sample 0, and
# resume must not take a later sample for another occurrence of its prompt). The merge writes such rows
# upgraded (StoredRow.upgraded).
ROW_FORMAT = 4


def invented_call_count(turns: list[Turn], offered_tools: list[str]) -> int:
    return sum(is_invented(call.name, offered_tools) for call in calls_of(turns))


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
_KEY_ORDER = {key: position for position, key in enumerate((
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


def encode_finished(result: SessionResult, *, batch_num: int, model: str, timestamp: str,
                    discard_no_reasoning: bool) -> bytes:
    """The single decision of which kind of row a finished session becomes, already encoded."""
    if result.end_reason == "error":
        return encode_row(failure_row(result))
    trajectory = trajectory_row(result, batch_num=batch_num, model=model, timestamp=timestamp)
    line = encode_row(trajectory)
    # A line just encoded from a trajectory is always a row, never None.
    if discard_no_reasoning and cast(StoredRow, read_stored_row(line)).reasoning_counts()[0] == 0:
        return encode_row(tombstone_row(trajectory, NO_REASONING))
    return line


# ---------------------------------------------------------------------------------------------
# Encoding and reading stored rows

COMPLETED, PARTIAL, DISCARDED, FAILED = "completed", "partial", "discarded", "failed"
NO_REASONING = "no_reasoning"       # the one discard reason so far


def encode_row(row: dict) -> bytes:
    """One JSONL line, always valid UTF-8 whatever bytes a tool produced (lone surrogates -> '?')."""
    return (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8", "replace")


class RowError(ValueError):
    """A line that is JSON but not a row this version understands. Skipping it would make resume run
    its prompt again and the merge drop it without a word, so whoever reads it stops and names it."""


# The reader decodes only the fields below (msgspec skips every other key without building it), so a
# row is read by its JSON structure, whatever the key order, spacing or escaping, at the speed a
# million-row resume scan or merge needs. Turn texts are kept as raw JSON and decoded only on demand.

class _ToolCall(msgspec.Struct):
    name: str


class _Turn(msgspec.Struct, rename={"speaker": "from"}):
    speaker: str
    value: msgspec.Raw
    tool_calls: list[_ToolCall] = []


class _Outcomes(msgspec.Struct):
    count: int = 0
    success: int = 0
    failure: int = 0


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    cost: float = 0.0


class _Metadata(msgspec.Struct):
    timestamp: str = ""
    model: str = ""


class _GptLayout(msgspec.Struct):
    reasoning_chars: int
    tool_calls: int


class _Row(msgspec.Struct):
    prompt_index: int
    content_key: str
    end_reason: str
    sample_index: int = 0                      # 0 in a row of format 1 to 3
    format: int | None = None                  # None: written before rows carried a format
    conversations: list[_Turn] | None = None   # a trajectory row (a tombstone keeps it too)
    gpt_turns: list[_GptLayout] | None = None  # None: a row of format 1 or 2
    invented_tool_calls: int | None = None     # None: a format 1 row
    discarded: str | None = None               # a tombstone
    failed: bool = False                       # a failure row
    completed: bool = False
    tool_stats: dict[str, _Outcomes] = {}
    usage: _Usage = msgspec.field(default_factory=_Usage)
    toolsets_used: list[str] = []
    toolsets_sampled: list[str] | None = None   # None: a format 1 row, whose toolsets_used were the sampled ones
    metadata: _Metadata | None = None
    wall_time_seconds: float = 0.0
    error_type: str | None = None


class _Versioned(msgspec.Struct):
    format: int = 0


_ROW = msgspec.json.Decoder(_Row)
_VERSION = msgspec.json.Decoder(_Versioned)
_TEXT = msgspec.json.Decoder(str)
_EMPTY_THINK_JSON = json.dumps(EMPTY_THINK.rstrip("\n")).encode()[:-1]   # how a turn without reasoning starts, encoded
_FORMAT_1_EMPTY_THINK = re.compile(r"\A<think>\n\n</think>")


class StoredRow:
    """One row of a batch file, with the facts resume, merge, statistics and the report need."""

    __slots__ = ("line", "status", "_row", "_invented")

    def __init__(self, line: bytes, status: str, row: _Row, invented: list[str] | None = None) -> None:
        self.line = line
        self.status = status
        self._row = row
        self._invented = invented       # read with the row when it has any (read_stored_row)

    @property
    def prompt_index(self) -> int:
        return self._row.prompt_index

    @property
    def content_key(self) -> str:
        return self._row.content_key

    @property
    def sample_index(self) -> int:
        return self._row.sample_index

    @property
    def sample_key(self) -> str:
        """What resume counts done (see sample_key)."""
        return sample_key(self._row.content_key, self._row.sample_index)

    @property
    def prompt_key(self) -> str:
        """Names the dataset prompt this row is a sample of: its place in the dataset and its content, so
        that two occurrences of one prompt text (each its own prompt) keep their samples apart."""
        return f"{self._row.prompt_index}:{self._row.content_key}"

    @property
    def is_current(self) -> bool:
        """False for a row of an earlier format (see ROW_FORMAT)."""
        return self._row.format == ROW_FORMAT

    def layouts(self) -> list[GptLayout] | None:
        """How each gpt turn was rendered (see read_gpt_turn); None for a row of format 1 or 2."""
        recorded = self._row.gpt_turns
        return None if recorded is None else [(turn.reasoning_chars, turn.tool_calls) for turn in recorded]

    def invented_tools(self) -> list[str]:
        """The tools this row calls that it was not offered (see is_invented): a row that names
        any is corrupted, left out of the merged file."""
        row = self._row
        if row.invented_tool_calls is None:      # format 1: what it recorded, judged by the registry
            return list(dict.fromkeys(call.name for turn in row.conversations or () for call in turn.tool_calls
                                      if call.name not in REGISTRY))
        if self._invented is None:
            self._invented = _invented_names(row) if row.invented_tool_calls else []
        return self._invented

    def reasoning_counts(self) -> tuple[int, int]:
        """(gpt turns with reasoning, gpt turns without)."""
        if self._row.gpt_turns is not None:
            with_reasoning = sum(turn.reasoning_chars > 0 for turn in self._row.gpt_turns)
            return with_reasoning, len(self._row.gpt_turns) - with_reasoning
        with_reasoning = without = 0
        for turn in self._row.conversations or ():
            if turn.speaker != "gpt":
                continue
            raw = bytes(turn.value)
            if raw.startswith(_EMPTY_THINK_JSON) or not split_rendered_reasoning(_TEXT.decode(raw))[0]:
                without += 1
            else:
                with_reasoning += 1
        return with_reasoning, without

    def tool_counts(self) -> list[tuple[str, int, int, int]]:
        """(tool, count, success, failure) for every tool this row used."""
        return [(name, entry.count, entry.success, entry.failure)
                for name, entry in self._row.tool_stats.items() if entry.count > 0]

    def usage(self) -> dict:
        usage = self._row.usage
        return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                "reasoning_tokens": usage.reasoning_tokens, "cached_tokens": usage.cached_tokens,
                "cost": usage.cost}

    def end_reason(self) -> str:
        return self._row.end_reason

    def toolsets_used(self) -> list[str]:
        """The toolsets whose tools the model was offered."""
        return self._row.toolsets_used

    def toolsets_sampled(self) -> list[str]:
        """The toolsets the distribution drew for the prompt (some may have had no tool available)."""
        sampled = self._row.toolsets_sampled
        return self._row.toolsets_used if sampled is None else sampled

    def metadata(self) -> tuple[str, str] | None:
        """(timestamp, model) of a trajectory row."""
        metadata = self._row.metadata
        return None if metadata is None else (metadata.timestamp, metadata.model)

    def wall_time(self) -> float:
        return self._row.wall_time_seconds

    def error_type(self) -> str | None:
        """A failure's cause; for an older row that kept no reply, why its session stopped asking."""
        if self.status == FAILED and not self._row.failed:
            return self._row.end_reason
        return self._row.error_type

    def discard_reason(self) -> str | None:
        return self._row.discarded

    def upgraded(self) -> bytes:
        """The line in the current format, so that every row of the merged file has the same keys
        of the same types, as loaders such as ``datasets.load_dataset("json")`` require: a format 1
        row loses the ``tool_calls`` lists of its turns and gains the newer keys."""
        if self.is_current:
            return self.line
        row = json.loads(self.line)
        conversations = row.get("conversations") or ()
        for turn in conversations:
            turn.pop("tool_calls", None)
            if self._row.invented_tool_calls is None and turn.get("from") == "gpt":   # format 1's empty block
                turn["value"] = _FORMAT_1_EMPTY_THINK.sub(EMPTY_THINK.rstrip("\n"), turn["value"], count=1)
        row["format"] = ROW_FORMAT
        row.setdefault("sample_index", 0)
        row.setdefault("toolsets_sampled", row.get("toolsets_used") or [])
        if self._row.invented_tool_calls is None:
            row["invented_tool_calls"] = sum(call.name not in REGISTRY for turn in self._row.conversations or ()
                                             for call in turn.tool_calls)
        if self._row.gpt_turns is None:    # format 3 recorded them
            row["gpt_turns"] = [layout_by_text(turn["value"]) for turn in conversations if turn.get("from") == "gpt"]
        last = len(_KEY_ORDER)      # a key of the row's own (added by hand, say) goes after ours
        return encode_row({key: row[key] for key in sorted(row, key=lambda key: _KEY_ORDER.get(key, last))})


def read_stored_row(line: bytes) -> StoredRow | None:
    """The row on a line; None for a line that is not JSON (cut short by a crash, or blank).

    Raises RowError for JSON that is not a row, and for a row of a newer format than this version's.
    A row without a single gpt turn reads as a failure (older versions wrote such rows when a model
    gave only empty answers): it holds nothing to train on, and resume runs its prompt again.
    """
    row = _decoded(line)
    if row is None:
        return None
    if row.format is not None and row.format > ROW_FORMAT:
        raise _newer_format(row.format)
    gpt_turns = 0
    for turn in row.conversations or ():
        if memoryview(turn.value)[:1] != b'"':
            raise RowError(f'not a batch_runner row (a "{turn.speaker}" turn\'s "value" is not text); '
                           "fix or remove this line")
        gpt_turns += turn.speaker == "gpt"
    if row.failed:
        status = FAILED
    elif row.conversations is not None and not gpt_turns:
        status = FAILED
    elif row.discarded is not None:
        status = DISCARDED
    elif row.conversations is not None:
        status = COMPLETED if row.completed else PARTIAL
    else:
        raise RowError('not a batch_runner row (none of "conversations", "discarded", "failed"); '
                       "fix or remove this line")
    recorded = row.gpt_turns is not None or (row.format or 0) >= 3
    if row.conversations is not None and recorded and len(row.gpt_turns or ()) != gpt_turns:
        raise RowError(f'not a batch_runner row ("gpt_turns" records {len(row.gpt_turns or ())} gpt turns, '
                       f'"conversations" holds {gpt_turns}); fix or remove this line')
    # Read now, when the row has any, so that a turn that is not what its record renders is refused
    # here, with the line it is on.
    invented = _invented_names(row) if row.gpt_turns is not None and row.invented_tool_calls else None
    return StoredRow(line, status, row, invented)


def _invented_names(row: _Row) -> list[str]:
    """The invented tools a row of format 2 or later calls, once each in order of first call: the
    calls its gpt turns made, by the one reader of turns (read_gpt_turn)."""
    turns = [(turn.speaker, _TEXT.decode(turn.value)) for turn in row.conversations or ()]
    offered = next((offered_tool_names(text) for speaker, text in turns if speaker == "system"), [])
    gpt_values = [text for speaker, text in turns if speaker == "gpt"]
    layouts: list[GptLayout | None] = ([(turn.reasoning_chars, turn.tool_calls) for turn in row.gpt_turns]
                                       if row.gpt_turns is not None else [None] * len(gpt_values))
    try:
        calls = [call for text, layout in zip(gpt_values, layouts, strict=True)
                 for call in read_gpt_turn(text, layout).calls]
    except LayoutError as exc:
        raise RowError(f"not a batch_runner row ({exc}); fix or remove this line") from None
    return list(dict.fromkeys(call["name"] for call in calls if is_invented(call["name"], offered)))


def _decoded(line: bytes) -> _Row | None:
    try:
        return _ROW.decode(line)
    except msgspec.ValidationError as exc:
        _refuse_newer_format(line)
        raise RowError(f"not a batch_runner row ({exc}); fix or remove this line") from None
    except msgspec.DecodeError:
        return _decoded_by_python_rules(line)
    except RecursionError:
        raise _too_deep() from None


def _decoded_by_python_rules(line: bytes) -> _Row | None:
    """msgspec refuses lone UTF-16 surrogates (``"\\udc80"``), which Python's json writes and reads: a
    line that is JSON by Python's rules is read once more with them replaced, never taken for debris."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    except RecursionError:
        raise _too_deep() from None
    return _decoded(encode_row(value))      # encode_row writes each lone surrogate as "?"


def _too_deep() -> RowError:
    return RowError("not a batch_runner row (JSON nested deeper than any row); fix or remove this line")


def _refuse_newer_format(line: bytes) -> None:
    """A row of a newer format may not fit this version's idea of a row at all: say that, not "not a row"."""
    try:
        version = _VERSION.decode(line).format
    except (msgspec.DecodeError, RecursionError):
        return
    if version > ROW_FORMAT:
        raise _newer_format(version)


def _newer_format(version: int) -> RowError:
    return RowError(f"row format {version} is newer than this batch_runner reads (format {ROW_FORMAT}); "
                    "upgrade batch_runner to continue this run")
