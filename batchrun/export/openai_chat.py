"""--export=openai: OpenAI's chat fine-tuning format, one conversation a line, and beside it the
manifest that names the run row of each line (the format's lines may hold only the keys it defines)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from batchrun import rows
from batchrun.export.conversations import Candidate, Conversation, ReadAssistantTurn
from batchrun.export.files import beside, write_files, write_lines
from batchrun.export.options import ExportOptions
from batchrun.rows import HumanTurn


def write_openai(options: ExportOptions, candidates: Iterable[Candidate]) -> None:
    write_files([options.out, manifest_path(options.out)], lambda temps: write_lines(
        temps, ((openai_line(candidate, options.reasoning), manifest_line(candidate)) for candidate in candidates)))


def openai_messages(chat: Conversation, reasoning: str) -> list[dict]:
    """The conversation as OpenAI chat messages. There is no system message: what the model saw of its
    tools is ``tools`` (the row's system turn only lists them, in the Hermes prompt), and the runner's
    own agent prompt never reaches a row (docs/export.md)."""
    messages: list[dict] = [{"role": "user", "content": chat.prompt}]
    for turn in chat.turns:
        if isinstance(turn, HumanTurn):
            messages.append({"role": "user", "content": turn.text})
            continue
        messages.append(_assistant_message(turn, reasoning))
        messages.extend({"role": "tool", "tool_call_id": call.id, "content": call.result}
                        for call in turn.tool_calls if call.result is not None)
    return messages


def _assistant_message(turn: ReadAssistantTurn, reasoning: str) -> dict:
    content = turn.shown if reasoning == "think" else turn.content
    # weight 1 (train on this message) is OpenAI's default, written out: it gives assistant messages
    # keys that user messages lack in every file, so datasets reads the messages of any two exports
    # alike (as JSON values) whether or not either run made a tool call.
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if turn.tool_calls else ""),
                               "weight": 1}
    if reasoning == "field" and turn.reasoning:
        message["reasoning_content"] = turn.reasoning
    if turn.tool_calls:
        message["tool_calls"] = [{"id": call.id, "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}}
                                 for call in turn.tool_calls]
    return message


def openai_line(candidate: Candidate, reasoning: str) -> bytes:
    """A line of OpenAI's chat fine-tuning format, holding only the keys it defines. parallel_tool_calls
    is not written: runs never set it, so the model worked under its default (true), which is what an
    absent key means."""
    chat = candidate.conversation
    return rows.encode_row({"messages": openai_messages(chat, reasoning), "tools": chat.tools})


def manifest_line(candidate: Candidate) -> bytes:
    """The manifest's line for an exported line: which row of the run it came from."""
    return rows.encode_row({"prompt_index": candidate.stored.prompt_index,
                            "sample_index": candidate.stored.sample_index,
                            "content_key": candidate.stored.content_key})


def manifest_path(out: Path) -> Path:
    """Where the manifest of an openai export goes: beside it, ``openai.jsonl`` -> ``openai.manifest.jsonl``."""
    return beside(out, "manifest.jsonl")

