"""Reasoning capture: an assistant message's reasoning and its visible text, from every form endpoints
use (structured fields, OpenRouter's reasoning_details, inline think blocks). Apart because it reads what
an endpoint sent, not anything the runner writes."""

from __future__ import annotations

import re
from typing import Any

_THINK_TAG_NAMES = ("think", "reasoning_scratchpad")
_THINK_TAG = re.compile(r"</?(?:think|REASONING_SCRATCHPAD)>", re.IGNORECASE)
_LONGEST_TAG = len("</REASONING_SCRATCHPAD>")
# The tags that can change anything, by the names open: an open tag of a name not yet open, a closing
# tag of one that is. The rest (a second open, a close with nothing open) are text, skipped by the regex.
_TAGS_THAT_MATTER = {
    frozenset(opened): re.compile("|".join([f"</{name}>" for name in opened] +
                                           [f"<{name}>" for name in _THINK_TAG_NAMES if name not in opened]),
                                  re.IGNORECASE)
    for opened in ((), ("think",), ("reasoning_scratchpad",), _THINK_TAG_NAMES)}
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
    if kind == "refusal":       # OpenAI's: the model's answer all the same
        return ("text", part["refusal"]) if isinstance(part.get("refusal"), str) else None
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
    """(reasoning, visible content) of one assistant message, from every form endpoints use; a refusal
    the endpoint gives in a content part, or in a field of its own where there is no content, is visible
    content.

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
    inline, content = _take_out_think_blocks(content)
    inline = [text.strip() for text in inline]
    if not inline:
        unclosed = _UNCLOSED_THINK.match(content)
        if unclosed:  # a truncated reply may open a think block it never closes
            inline = [unclosed.group(2).strip()]
            content = ""
    # A set beside the list: a reply of a hundred thousand different blocks must not compare each with all.
    seen = set(found)
    for text in inline:
        if text and text not in seen:
            seen.add(text)
            found.append(text)
    # OpenAI's refusal field, beside a null content: the model's answer all the same.
    refusal = message.get("refusal")
    if not content.strip() and isinstance(refusal, str):
        content = refusal
    return "\n\n".join(found), content.strip()


class _Visible:
    """The visible text of a reply while its think blocks are taken out: pieces of the reply kept as
    (text, start, end), so that cutting the last characters copies nothing, with the first open tag
    of each name a piece of its own. Only the first matters: a block closed runs from it, and takes
    out with it every tag opened after."""

    def __init__(self) -> None:
        self.pieces: list[tuple[str, int, int]] = []
        self.first_open: dict[str, int] = {}      # per tag name: the piece of its first open tag still there
        self.blocks: list[str] = []

    def add_text(self, text: str, start: int, end: int) -> None:
        """Text that follows the last piece in the reply extends it, and a piece shorter than a tag
        takes in the next: the tail is then in a piece or two, however many blocks were taken out."""
        if start == end:
            return
        if self.pieces and len(self.pieces) - 1 not in self.first_open.values():
            last_text, last_start, last_end = self.pieces[-1]
            if last_text is text and last_end == start:
                self.pieces[-1] = (text, last_start, end)
                return
            if last_end - last_start < _LONGEST_TAG:
                joined = last_text[last_start:last_end] + text[start:end]
                self.pieces[-1] = (joined, 0, len(joined))
                return
        self.pieces.append((text, start, end))

    def tags_that_matter(self) -> re.Pattern[str]:
        return _TAGS_THAT_MATTER[frozenset(self.first_open)]

    def add_tag(self, tag: re.Match[str]) -> bool:
        """Whether the tag closed a block, which is then taken out: from the first tag of its name still
        open (as a regex taking the shortest block from the leftmost open tag would)."""
        closing, name = tag.group(0)[1] == "/", tag.group(0).strip("</>").lower()
        first = self.first_open.get(name)
        if not closing and first is None:
            self.first_open[name] = len(self.pieces)
            self.pieces.append((tag.string, tag.start(), tag.end()))
            return False
        if not closing or first is None:
            self.add_text(tag.string, tag.start(), tag.end())
            return False
        self.blocks.append("".join(text[start:end] for text, start, end in self.pieces[first + 1:]))
        del self.pieces[first:]
        self.first_open = {other: piece for other, piece in self.first_open.items() if piece < first}
        return True

    def tail(self) -> str:
        """The last characters, as many as a tag can have but one: what may begin a tag that the
        text after a block taken out completes."""
        parts, size = [], 0
        for text, start, end in reversed(self.pieces):
            parts.append(text[max(start, end - _LONGEST_TAG):end])
            size += len(parts[-1])
            if size >= _LONGEST_TAG:
                break
        return "".join(reversed(parts))[1 - _LONGEST_TAG:]

    def cut(self, count: int) -> None:
        """Take off the last ``count`` characters: the start of a tag that the text after them completes."""
        while count:
            text, start, end = self.pieces.pop()
            if end - start > count:
                self.pieces.append((text, start, end - count))
                count = 0
            else:
                count -= end - start

    def text(self) -> str:
        return "".join(text[start:end] for text, start, end in self.pieces)


def _take_out_think_blocks(content: str) -> tuple[list[str], str]:
    """(every think block's text, what is left) in one pass over the content. Taken out until none is
    left: taking one out can join the text around it into another tag ("<thi<think></think>nk>...
    </think>"), and the visible text never holds a think block. One pass, because a regex run again
    until nothing matches costs a pass per block so formed, and its shortest match a scan to the end
    from each tag never closed: a reply of a few hundred kilobytes would hold the worker's event
    loop for minutes."""
    visible = _Visible()
    position = 0
    while tag := visible.tags_that_matter().search(content, position):
        visible.add_text(content, position, tag.start())
        position = tag.end()
        closed = visible.add_tag(tag)
        while closed and (joined := _tag_across(visible.tail(), content, position)) is not None:
            joined_tag, kept = joined
            visible.cut(kept)
            position += joined_tag.end() - kept
            closed = visible.add_tag(joined_tag)
    visible.add_text(content, position, len(content))
    return visible.blocks, visible.text()


def _tag_across(tail: str, content: str, position: int) -> tuple[re.Match[str], int] | None:
    """The tag that the end of the visible text (``tail``) and the content from ``position`` form
    together, and how many of its characters were the tail's; None where they form none."""
    opening = tail.rfind("<")      # a tag holds one "<", its first character
    if opening < 0:
        return None
    kept = len(tail) - opening
    tag = _THINK_TAG.match(tail[opening:] + content[position:position + _LONGEST_TAG])
    return (tag, kept) if tag is not None and tag.end() > kept else None
