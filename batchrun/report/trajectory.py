"""A sampled row as the report's trajectory browser needs it: its facts, and its turns parsed (calls,
results, reasoning) and trimmed so that the page stays small however long the trajectories are."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

from batchrun import rows

TEXT_LIMIT = 2500               # characters kept of one text of a sampled row (reasoning, reply, result)
SYSTEM_TEXT_LIMIT = 1200        # the system turn is the same long tool list in every row
ROW_BUDGET = 24_000             # characters of turns kept per sampled row; the middle turns go first
CALLS_PER_TURN = 20             # tool calls / results kept per turn
NAME_LIMIT = 200                # characters kept of a tool name (a model can make one up of any length)


def clip(text: str, limit: int = TEXT_LIMIT) -> str:
    """Head and tail of a long text with a visible note of what was left out."""
    if len(text) <= limit:
        return text
    head, tail = limit * 3 // 4, limit // 4
    return f"{text[:head]}\n… [{len(text) - head - tail:,} characters not shown] …\n{text[-tail:]}"


def clip_name(name: str) -> str:
    return clip(name, NAME_LIMIT)


def _text(value: Any) -> str:
    """A field the page shows as text, whatever a row edited by hand holds there (the row reader checks only
    the fields every reader needs): the browser searches and slices it."""
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _clip_value(value: Any) -> Any:
    """A JSON value kept as structure when small (the page pretty-prints it), else trimmed text."""
    if isinstance(value, str):
        return clip(value)
    encoded = json.dumps(value, ensure_ascii=False, indent=2)
    return value if len(encoded) <= TEXT_LIMIT else clip(encoded)


def _system_turn(text: str) -> dict:
    return {"r": "system", "t": clip(text, SYSTEM_TEXT_LIMIT), "tools": rows.offered_tool_names(text)}


def _gpt_turn(turn: dict, offered: list[str], layout: rows.GptLayout | None) -> dict:
    text = turn.get("value") or ""
    try:
        read = rows.read_gpt_turn(text, layout)
    except rows.LayoutError:        # a row edited by hand: shown as the text it is
        read = rows.ReadGptTurn(reasoning="", text=text, calls=[], shown=text)
    reasoning, visible, found = read.reasoning, read.text, read.calls
    calls = [{"n": clip_name(call["name"]), "a": _clip_value(call.get("arguments")),
              "inv": rows.is_invented(call["name"], offered)}
             for call in found[:CALLS_PER_TURN]]
    return {"r": "gpt", "think": clip(reasoning), "t": clip(visible.strip()), "calls": calls,
            "more": max(0, len(found) - CALLS_PER_TURN)}


def _tool_turn(turn: dict) -> dict:
    results = []
    blocks = rows.rendered_tool_responses(turn.get("value") or "")
    for block in blocks[:CALLS_PER_TURN]:
        payload = rows.parsed_or_raw(block)
        if not isinstance(payload, dict):
            results.append({"id": None, "n": None, "c": clip(block), "x": False})
            continue
        content = payload.get("content")
        raw = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        name = payload.get("name")
        call_id = payload.get("tool_call_id")
        results.append({"id": None if call_id is None else clip_name(_text(call_id)),
                        "n": clip_name(name) if isinstance(name, str) else name,
                        "c": _clip_value(content),
                        "x": rows.tool_result_failed(raw)})
    return {"r": "tool", "res": results, "more": max(0, len(blocks) - CALLS_PER_TURN)}


def _turn(turn: dict, offered: list[str], layouts: Iterator[rows.GptLayout | None]) -> dict:
    role = turn.get("from")
    if role == "system":
        return _system_turn(turn.get("value") or "")
    if role == "gpt":
        return _gpt_turn(turn, offered, next(layouts, None))
    if role == "tool":
        return _tool_turn(turn)
    return {"r": "human" if role == "human" else str(role), "t": clip(turn.get("value") or "")}


def _within_budget(turns: list[dict]) -> list[dict]:
    """First turns (system, prompt, ...) and the last two (how it ended) always; the middle ones
    while the row's budget lasts, then one marker saying how many were left out."""
    sizes = [len(json.dumps(turn, ensure_ascii=False)) for turn in turns]
    if sum(sizes) <= ROW_BUDGET or len(turns) <= 4:
        return turns
    spent = sizes[0] + sizes[1] + sizes[-1] + sizes[-2]
    keep = 2
    while keep < len(turns) - 2 and spent + sizes[keep] <= ROW_BUDGET:
        spent += sizes[keep]
        keep += 1
    return turns[:keep] + [{"r": "gap", "n": len(turns) - 2 - keep}] + turns[-2:]


def _decoded(row: rows.StoredRow) -> dict:
    """The row's JSON. JSON is read as deep as the stack leaves room for, and the row reader, higher up, read
    this one: a row nested that deep (by hand) is shown by the facts that reader found, its turns not."""
    try:
        return json.loads(row.line)
    except RecursionError:
        return {"end_reason": row.end_reason(), "prompt": "(not shown: this row holds JSON nested deeper than any "
                                                          "row; fix or remove its line)"}


def _metadata(row: rows.StoredRow) -> dict[str, str]:
    found = row.metadata()
    return {} if found is None else {"time": clip_name(found[0]), "model": clip_name(found[1])}


def sampled_row(row: rows.StoredRow, status: str, batch_file: str) -> dict:
    """A row as the browser needs it: its facts, and its turns parsed and trimmed."""
    data = _decoded(row)
    calls = data.get("api_calls")
    item: dict[str, Any] = {"id": row.prompt_index, "si": row.sample_index, "s": status,
                            "e": clip_name(row.end_reason()), "f": batch_file, "u": data.get("usage") or {},
                            "calls": calls if isinstance(calls, int) else clip_name(_text(calls)),
                            "wall": data.get("wall_time_seconds")}
    if "conversations" not in data:               # failure rows and tombstones keep only the prompt
        # An endpoint's own message is as long as it chose to make it.
        item.update(p=clip(_text(data.get("prompt"))), err=clip(_text(data.get("error"))),
                    et=clip_name(_text(data.get("error_type"))), dr=clip_name(_text(data.get("discarded"))),
                    turns=[], tools=[], tf=[], inv=[])
        return item
    conversations = [turn for turn in data["conversations"] if isinstance(turn, dict)]
    system = next((turn.get("value") or "" for turn in conversations if turn.get("from") == "system"), "")
    recorded = row.layouts()      # None for a row of format 1 or 2: its turns are read by their text
    layouts: Iterator[rows.GptLayout | None] = iter(recorded) if recorded is not None else itertools.repeat(None)
    turns = [_turn(turn, rows.offered_tool_names(system), layouts) for turn in conversations]
    stats = data.get("tool_stats") or {}
    item.update(p=next((t["t"] for t in turns if t["r"] == "human"), ""), turns=_within_budget(turns),
                tools=[clip_name(n) for n, e in stats.items() if isinstance(e, dict) and e.get("count")],
                tf=[clip_name(n) for n, e in stats.items() if isinstance(e, dict) and e.get("failure")],
                inv=[clip_name(name) for name in row.invented_tools()], ts=list(map(clip_name, row.toolsets_used())),
                **_metadata(row))
    return item
