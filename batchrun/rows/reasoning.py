"""Reasoning capture: an assistant message's reasoning and its visible text, from every form endpoints
use (structured fields, OpenRouter's reasoning_details, inline think blocks). Apart because it reads what
an endpoint sent, not anything the runner writes."""

from __future__ import annotations

import re
from typing import Any

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


def content_part_text(part: Any) -> tuple[str, str] | None:
    """(kind, text) of one part of a content list: ("text", ...) for a text part, ("thinking", ...) for
    a thinking part (its ``thinking`` a list of text parts, or text); None for anything else."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type", "text")
    if kind == "text":
        return ("text", part["text"]) if isinstance(part.get("text"), str) else None
    if kind != "thinking":
        return None
    thinking = part.get("thinking")
    if isinstance(thinking, str):
        return "thinking", thinking
    if isinstance(thinking, list):
        texts = [content_part_text(inner) for inner in thinking]
        if all(text is not None and text[0] == "text" for text in texts):
            return "thinking", "".join(text[1] for text in texts if text is not None)
    return None


def _content_texts(content: Any) -> tuple[str, str]:
    """(thinking, text) of a message's content: text as it is, or the parts of a content list."""
    if isinstance(content, str):
        return "", content
    if not isinstance(content, list):
        return "", ""
    parts = [text for part in content if (text := content_part_text(part)) is not None]
    return ("\n\n".join(text for kind, text in parts if kind == "thinking" and text.strip()),
            "".join(text for kind, text in parts if kind == "text"))


def split_reasoning(message: dict) -> tuple[str, str]:
    """(reasoning, visible content) of one assistant message, from every form endpoints use.

    Structured fields win, then reasoning_details, then thinking parts of a content list; reasoning
    written inline as <think>/<REASONING_SCRATCHPAD> blocks is also taken out of the visible text so
    a trajectory never shows it twice.
    """
    thinking, content = _content_texts(message.get("content"))
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
        elif thinking:
            found.append(thinking.strip())
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
