"""The row format: one place each for the schema, the ShareGPT rendering, the success rule,
reasoning detection, the resume content key and the byte encoding of a row.

Every kind of row the runner writes carries ``prompt_index`` and ``content_key`` first, so the
resume scan and the merge can classify a line without caring which kind it is:

* a trajectory row (completed or partial) — the Hermes ShareGPT format of SPEC §7;
* a tombstone ``{"discarded": "no_reasoning", ...}`` — done, never re-run, never merged;
* a failure row ``{"failed": true, "error": ...}`` — retried on resume, never merged.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from model_tools import REGISTRY, TOOL_NAMES

# ---------------------------------------------------------------------------------------------
# Identity of a unit of work


def content_key(prompt: str, image: str | None, cwd: str | None) -> str:
    """Identifies a prompt by what it is, not where it sits, so resume survives reordered datasets."""
    canonical = json.dumps([prompt, image, cwd], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:32]


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
    inline = [m.group(2).strip() for m in _THINK_BLOCK.finditer(content)]
    if inline:
        content = _THINK_BLOCK.sub("", content)
    else:
        unclosed = _UNCLOSED_THINK.match(content)
        if unclosed:  # a truncated reply may open a think block it never closes
            inline = [unclosed.group(2).strip()]
            content = ""
    found.extend(text for text in inline if text and text not in found)
    return "\n\n".join(found), content.strip()


# ---------------------------------------------------------------------------------------------
# The success rule


def tool_result_failed(result: str) -> bool:
    """SPEC §7: a JSON result with a non-null ``error`` (also inside ``content``) or
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
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    cost: float = 0.0

    def add(self, other: "Usage") -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.reasoning_tokens += other.reasoning_tokens
        self.cached_tokens += other.cached_tokens
        self.cost += other.cost

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "reasoning_tokens": self.reasoning_tokens, "cached_tokens": self.cached_tokens,
                "cost": round(self.cost, 8)}


SYSTEM_PREAMBLE = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools> </tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. After calling & executing the "
    "functions, you will be provided with function results within <tool_response> </tool_response> "
    "XML tags. Here are the available tools:\n<tools>\n"
)
SYSTEM_POSTAMBLE = (
    "\n</tools>\nFor each function call return a JSON object with the function name and arguments, "
    "following this schema:\n"
    '{"title": "FunctionCall", "type": "object", "properties": {"name": {"title": "Name", '
    '"type": "string"}, "arguments": {"title": "Arguments", "type": "object"}}, '
    '"required": ["name", "arguments"]}\n'
    "Each function call should be enclosed within <tool_call> </tool_call> XML tags, for example:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-dict>}\n</tool_call>"
)


def render_system_turn(tool_names: Iterable[str]) -> str:
    """The Hermes function-calling system turn listing exactly the tools this prompt was offered."""
    signatures = [REGISTRY[name].schema for name in tool_names]
    return SYSTEM_PREAMBLE + json.dumps(signatures, ensure_ascii=False) + SYSTEM_POSTAMBLE


def parsed_or_raw(text: str) -> Any:
    """JSON text as its value; anything else (invalid JSON a model wrote, plain output) as the text."""
    try:
        return json.loads(text)
    except (ValueError, TypeError):
        return text


THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n"
EMPTY_THINK = THINK_OPEN + THINK_CLOSE     # how a gpt turn without reasoning starts


def split_rendered_reasoning(value: str) -> tuple[str, str]:
    """(reasoning, the rest) of a rendered gpt turn: the inverse of the think block written below."""
    if value.startswith(THINK_OPEN):
        close = value.find(THINK_CLOSE, len(THINK_OPEN))
        if close >= 0:
            return value[len(THINK_OPEN):close], value[close + len(THINK_CLOSE):]
    return "", value


def render_gpt_turn(turn: AssistantTurn) -> dict:
    parts = [turn.content] if turn.content else []
    for call in turn.tool_calls:
        payload = json.dumps({"name": call.name, "arguments": parsed_or_raw(call.arguments)},
                             ensure_ascii=False)
        parts.append(f"<tool_call>\n{payload}\n</tool_call>")
    rendered: dict[str, Any] = {"from": "gpt", "value": THINK_OPEN + turn.reasoning + THINK_CLOSE + "\n".join(parts)}
    if turn.tool_calls:
        rendered["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments}
                                  for c in turn.tool_calls]
    return rendered


def render_tool_turn(calls: list[ToolCallRecord]) -> dict:
    blocks = []
    for call in calls:
        payload = json.dumps({"tool_call_id": call.id, "name": call.name,
                              "content": parsed_or_raw(call.result or "")}, ensure_ascii=False)
        blocks.append(f"<tool_response>\n{payload}\n</tool_response>")
    return {"from": "tool", "value": "\n".join(blocks)}


def render_conversations(offered_tools: list[str], prompt: str, turns: list[AssistantTurn]) -> list[dict]:
    conversations = [{"from": "system", "value": render_system_turn(offered_tools)},
                     {"from": "human", "value": prompt}]
    for turn in turns:
        conversations.append(render_gpt_turn(turn))
        answered = [call for call in turn.tool_calls if call.result is not None]
        if answered:
            conversations.append(render_tool_turn(answered))
    return conversations


def tool_stats(turns: list[AssistantTurn]) -> tuple[dict, dict]:
    """(tool_stats, tool_error_counts) over the fixed registry: the same keys in every row."""
    stats = {name: {"count": 0, "success": 0, "failure": 0} for name in TOOL_NAMES}
    for turn in turns:
        for call in turn.tool_calls:
            entry = stats.get(call.name)
            if entry is None or call.result is None:
                continue  # invented tools have no column; the merge filter deals with them
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
    turns: list[AssistantTurn]
    api_calls: int
    usage: Usage
    wall_time: float
    end_reason: str            # final_answer | max_turns | invented_tools | truncated | error
    error: str | None = None
    error_type: str | None = None


COMPLETED_END_REASONS = frozenset({"final_answer"})


def trajectory_row(result: SessionResult, *, batch_num: int, model: str, timestamp: str) -> dict:
    stats, error_counts = tool_stats(result.turns)
    completed = result.end_reason in COMPLETED_END_REASONS
    return {
        "prompt_index": result.prompt_index,
        "content_key": result.content_key,
        "conversations": render_conversations(result.offered_tools, result.prompt, result.turns),
        "metadata": {"batch_num": batch_num, "timestamp": timestamp, "model": model},
        "completed": completed,
        "partial": not completed,
        "api_calls": result.api_calls,
        "toolsets_used": result.toolsets,
        "tool_stats": stats,
        "tool_error_counts": error_counts,
        "usage": result.usage.as_dict(),
        "wall_time_seconds": round(result.wall_time, 3),
        "end_reason": result.end_reason,
    }


def tombstone_row(result: SessionResult) -> dict:
    return {"prompt_index": result.prompt_index, "content_key": result.content_key,
            "discarded": "no_reasoning", "prompt": result.prompt,
            "api_calls": result.api_calls, "usage": result.usage.as_dict(),
            "wall_time_seconds": round(result.wall_time, 3), "end_reason": result.end_reason}


def failure_row(result: SessionResult) -> dict:
    return {"prompt_index": result.prompt_index, "content_key": result.content_key,
            "failed": True, "error": result.error, "error_type": result.error_type,
            "prompt": result.prompt, "api_calls": result.api_calls,
            "usage": result.usage.as_dict(), "wall_time_seconds": round(result.wall_time, 3),
            "end_reason": result.end_reason}


def encode_finished(result: SessionResult, *, batch_num: int, model: str, timestamp: str,
                    discard_no_reasoning: bool) -> bytes:
    """The single decision of which kind of row a finished session becomes, already encoded."""
    if result.end_reason == "error":
        return encode_row(failure_row(result))
    line = encode_row(trajectory_row(result, batch_num=batch_num, model=model, timestamp=timestamp))
    if discard_no_reasoning and read_stored_row(line).reasoning_counts()[0] == 0:
        return encode_row(tombstone_row(result))
    return line


# ---------------------------------------------------------------------------------------------
# Classification and encoding of stored rows

COMPLETED, PARTIAL, DISCARDED, FAILED = "completed", "partial", "discarded", "failed"


def encode_row(row: dict) -> bytes:
    """One JSONL line, always valid UTF-8 whatever bytes a tool produced (lone surrogates -> '?').

    The layout is fixed (json's default separators, ``prompt_index`` and ``content_key`` first,
    ``end_reason`` last in every kind of row); :func:`read_stored_row` relies on it to classify a
    line, and to tell a complete line from a fragment, without parsing all of it.
    """
    return (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8", "replace")


# Reading stored rows. A million-row resume scan or merge cannot afford to parse every row (most of
# each is the conversation), so the few facts they need are read from the encoded line. Every pattern
# is structural: each holds a quote that follows a byte other than a backslash, and inside a JSON
# string every quote is escaped, so text a model or a tool wrote can never look like these keys.
# Top-level keys near the end of a row are found with rfind, which reads only the last bytes.
_HEAD_START = b'{"prompt_index": '
_HEAD = re.compile(rb'\{"prompt_index": (-?\d+), "content_key": "([0-9a-f]+)", "(conversations|discarded|failed)"')
_COMPLETED = b'"completed": '
_CALL_NAME = b', "name": "'           # only tool_calls entries have a "name" key
_TOOL_COUNT = b'{"count": '
_TOOL_OUTCOMES = re.compile(rb'(\d+), "success": (\d+), "failure": (\d+)')
_USAGE = b'"usage": {'
_USAGE_FIGURES = re.compile(rb'"usage": \{"prompt_tokens": (\d+), "completion_tokens": (\d+), '
                            rb'"reasoning_tokens": (\d+), "cached_tokens": (\d+), "cost": ([0-9.eE+-]+)\}')
_END_REASON = re.compile(rb'"end_reason": "(\w+)"\}\n?$')
_TAIL_BYTES = 64                      # the end_reason key is within the last bytes of a whole row
_TOOL_STATS_START = b'"tool_stats": {'
_GPT_TURN = b'{"from": "gpt", "value": "'
_EMPTY_THINK_ENCODED = json.dumps(EMPTY_THINK).encode()[1:-1]
_REGISTERED_NAMES = frozenset(name.encode() for name in REGISTRY)


@dataclass(slots=True)
class StoredRow:
    """One line of a batch file, with what resume and merge need read straight from its bytes."""

    line: bytes
    prompt_index: int
    content_key: str
    status: str

    def invented_tools(self) -> list[str]:
        """Tools this row calls that the registry does not have (the corrupted-entry test)."""
        line = self.line
        names: list[str] = []
        position = line.find(_CALL_NAME)
        while position >= 0:
            start = position + len(_CALL_NAME)
            end = line.index(b'"', start)
            while line[end - 1] == 0x5C and not _quote_ends_string(line, start, end):
                end = line.index(b'"', end + 1)
            raw = line[start:end]
            if raw not in _REGISTERED_NAMES:
                name = json.loads(b'"' + raw + b'"') if b"\\" in raw else raw.decode("utf-8", "replace")
                if name not in names:
                    names.append(name)
            position = line.find(_CALL_NAME, end)
        return names

    def reasoning_counts(self) -> tuple[int, int]:
        """(gpt turns with reasoning, gpt turns without)."""
        line = self.line
        with_reasoning = without = 0
        position = line.find(_GPT_TURN)
        while position >= 0:
            position += len(_GPT_TURN)
            if line.startswith(_EMPTY_THINK_ENCODED, position):
                without += 1
            else:
                with_reasoning += 1
            position = line.find(_GPT_TURN, position)
        return with_reasoning, without

    def tool_entries(self) -> list[tuple[bytes, bytes]]:
        """Every tool this row used, as its raw (name, outcomes) bytes: see :func:`parse_tool_entry`.

        Rows repeat the same few entries endlessly, so aggregates over a million rows count these
        and parse each distinct entry once.
        """
        line = self.line
        start = line.rfind(_TOOL_STATS_START)
        if start < 0:
            return []
        # One piece per tool, each after its '{"count": ' (what follows the last tool holds no such
        # text). JSON writes no leading zeros, so only an unused tool's piece starts with "0".
        pieces = line[start:].split(_TOOL_COUNT)
        used = []
        for index in range(1, len(pieces)):
            piece = pieces[index]
            if piece[0] != 0x30:
                before = pieces[index - 1]                      # ends with '"name": '
                used.append((before[before.rfind(b'"', 0, -3) + 1:-3], piece[:piece.index(b"}")]))
        return used

    def tool_counts(self) -> list[tuple[str, int, int, int]]:
        """(tool, count, success, failure) for every tool this row used."""
        return [parse_tool_entry(entry) for entry in self.tool_entries()]

    def usage(self) -> dict:
        start = self.line.rfind(_USAGE)
        if start < 0:
            return {}
        figures = _USAGE_FIGURES.match(self.line, start)
        if figures is None:                 # a cost written in another notation: parse it in full
            start += len(_USAGE) - 1
            return json.loads(self.line[start:self.line.index(b"}", start) + 1])
        prompt, completion, reasoning, cached, cost = figures.groups()
        return {"prompt_tokens": int(prompt), "completion_tokens": int(completion),
                "reasoning_tokens": int(reasoning), "cached_tokens": int(cached), "cost": float(cost)}

    def end_reason(self) -> str:
        return _tail(self.line).group(1).decode()


def parse_tool_entry(entry: tuple[bytes, bytes]) -> tuple[str, int, int, int]:
    """(tool, count, success, failure) of one entry of :meth:`StoredRow.tool_entries`."""
    name, outcomes = entry
    count, success, failure = _TOOL_OUTCOMES.match(outcomes).groups()
    return name.decode(), int(count), int(success), int(failure)


def _quote_ends_string(line: bytes, start: int, quote: int) -> bool:
    """Whether the quote at ``quote`` closes the string begun at ``start`` (an even run of
    backslashes before it escapes only themselves)."""
    backslashes = 0
    while quote - backslashes - 1 >= start and line[quote - backslashes - 1] == 0x5C:
        backslashes += 1
    return backslashes % 2 == 0


def _tail(line: bytes) -> re.Match | None:
    return _END_REASON.search(line, max(0, len(line) - _TAIL_BYTES))


def read_stored_row(line: bytes) -> StoredRow | None:
    """The row on a complete line, or None for a line that is not one of ours (or is broken)."""
    head = _HEAD.match(line)
    if head is None or _tail(line) is None:   # not ours, or cut short by a crash
        return None
    if line.find(_HEAD_START, 1) >= 0:        # a fragment with the next row glued on
        return None
    kind = head.group(3)
    if kind == b"failed":
        status = FAILED
    elif kind == b"discarded":
        status = DISCARDED
    else:
        completed = line.rfind(_COMPLETED)
        status = COMPLETED if completed >= 0 and line.startswith(b"true", completed + len(_COMPLETED)) else PARTIAL
    return StoredRow(line=line, prompt_index=int(head.group(1)), content_key=head.group(2).decode(), status=status)
