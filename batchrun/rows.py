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


def has_reasoning(row: dict) -> bool:
    """True when any gpt turn of a trajectory row carries reasoning (the no-reasoning filter)."""
    return any(turn["from"] == "gpt" and _turn_reasoning(turn["value"])
               for turn in row.get("conversations", ()))


_RENDERED_THINK = re.compile(r"^<think>\n(.*?)\n</think>\n", re.DOTALL)


def _turn_reasoning(value: str) -> str:
    match = _RENDERED_THINK.match(value)
    return match.group(1).strip() if match else ""


def reasoning_counts(row: dict) -> tuple[int, int]:
    """(gpt turns with reasoning, gpt turns without) of a trajectory row."""
    with_reasoning = without = 0
    for turn in row.get("conversations", ()):
        if turn["from"] == "gpt":
            if _turn_reasoning(turn["value"]):
                with_reasoning += 1
            else:
                without += 1
    return with_reasoning, without


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


def _parsed_or_raw(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, TypeError):
        return text


def render_gpt_turn(turn: AssistantTurn) -> dict:
    parts = [turn.content] if turn.content else []
    for call in turn.tool_calls:
        payload = json.dumps({"name": call.name, "arguments": _parsed_or_raw(call.arguments)},
                             ensure_ascii=False)
        parts.append(f"<tool_call>\n{payload}\n</tool_call>")
    rendered: dict[str, Any] = {"from": "gpt", "value": f"<think>\n{turn.reasoning}\n</think>\n" + "\n".join(parts)}
    if turn.tool_calls:
        rendered["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments}
                                  for c in turn.tool_calls]
    return rendered


def render_tool_turn(calls: list[ToolCallRecord]) -> dict:
    blocks = []
    for call in calls:
        payload = json.dumps({"tool_call_id": call.id, "name": call.name,
                              "content": _parsed_or_raw(call.result or "")}, ensure_ascii=False)
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
            "wall_time_seconds": round(result.wall_time, 3)}


def failure_row(result: SessionResult) -> dict:
    return {"prompt_index": result.prompt_index, "content_key": result.content_key,
            "failed": True, "error": result.error, "error_type": result.error_type,
            "prompt": result.prompt, "api_calls": result.api_calls,
            "usage": result.usage.as_dict(), "wall_time_seconds": round(result.wall_time, 3)}


def row_for(result: SessionResult, *, batch_num: int, model: str, timestamp: str,
            discard_no_reasoning: bool) -> dict:
    """The single decision of which kind of row a finished session becomes."""
    if result.end_reason == "error":
        return failure_row(result)
    row = trajectory_row(result, batch_num=batch_num, model=model, timestamp=timestamp)
    if discard_no_reasoning and not has_reasoning(row):
        return tombstone_row(result)
    return row


# ---------------------------------------------------------------------------------------------
# Classification and encoding of stored rows

COMPLETED, PARTIAL, DISCARDED, FAILED = "completed", "partial", "discarded", "failed"


def row_status(row: dict) -> str:
    if row.get("failed"):
        return FAILED
    if row.get("discarded"):
        return DISCARDED
    return COMPLETED if row.get("completed") else PARTIAL


def invented_tool_names(row: dict) -> list[str]:
    """Tools a trajectory row calls that the registry does not have (the corrupted-entry test)."""
    names = []
    for turn in row.get("conversations", ()):
        for call in turn.get("tool_calls", ()) or ():
            name = call.get("name")
            if name not in REGISTRY and name not in names:
                names.append(name)
    return names


def encode_row(row: dict) -> bytes:
    """One JSONL line, always valid UTF-8 whatever bytes a tool produced (lone surrogates -> '?')."""
    return (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8", "replace")
