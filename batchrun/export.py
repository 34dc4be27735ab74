"""--export: a run's rows in the formats trainers load, filtered again without generating again.

The source is the batch files, not trajectories.jsonl: only they hold the rows the run's own filters
left out (tombstones keep their whole trajectory, corrupted rows stay where they were written), so a
filter can be turned off here as well as on. Each prompt counts by its latest attempt, as in the merge:
failure rows hold no trajectory, and corrupted rows that a ``--rerun_corrupted`` resume replaced
(``superseded_corrupted`` in checkpoint.json) are earlier attempts.

Everything streams: rows are read line by line and written as they come (Parquet a row group at a
time), so memory stays bounded however many rows a run has. Every exported row can be traced to the
row it came from: its ``prompt_index`` and ``content_key``, in the row itself, or (``openai``, whose
lines hold only what OpenAI's format defines) in a manifest beside the file.

Rows keep only ``{from, value}`` per turn and a record of how each gpt turn was rendered; the
``openai`` format reads the structured calls back by that record (rows.read_gpt_turn), losslessly:
see docs/export.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from batchrun import rows
from batchrun.config import UsageError, boolean, choice, non_negative_int, text, validate_run_name
from batchrun.install_hint import install_hint
from batchrun.rows import AssistantTurn, HumanTurn, ToolCallRecord, Turn
from batchrun.run_dir import RunDirectory, atomic_write_json, line_number, lines_at, superseded_corrupted, temp_beside

FORMATS = ("openai", "sharegpt", "parquet", "hf")
# Where a turn's reasoning goes in the openai format: inline as the row's own think block, a
# `reasoning_content` field, or nowhere (the default: a model trained on OpenAI's format must not
# learn to print it).
REASONING_MODES = ("think", "field", "drop")
DEFAULT_OUT = {"openai": "export/openai.jsonl", "sharegpt": "export/sharegpt.jsonl",
               "parquet": "export/trajectories.parquet", "hf": "export/hf"}
REQUIRED_MODULES = {"parquet": ("pyarrow",), "hf": ("pyarrow", "datasets")}
# The flags only --export reads, with their defaults (a run refuses them: they would do nothing there).
FLAG_DEFAULTS: dict[str, Any] = {"out": None, "reasoning": None, "end_reasons": None, "min_tool_calls": 0,
                                 "last_call_succeeded": False, "discard_invented": True, "best_of": None}
# --best_of: one row per prompt, chosen among its samples (--samples_per_prompt) that pass the filters.
# Each rule names which samples are good, and the best of those; ties go to the lower sample index.
BEST_OF_RULES = {
    "first_completed": "the completed sample with the lowest sample index",
    "fewest_calls": "of the completed samples whose last tool call succeeded (or that called no tool), the one "
                    "with the fewest model calls",
    "longest_reasoning": "of the completed samples, the one with the most reasoning",
}
EXPORT_FLAGS = ("export", *FLAG_DEFAULTS)

# Why a row was left out, in the order the reasons are tried: each row is counted under the first.
DROP_REASONS = {
    "failed": "failure rows: no trajectory (--resume retries them)",
    "unreadable": "lines that are not JSON (cut short by a crash)",
    "superseded": "corrupted attempts a --rerun_corrupted resume redid",
    "no_trajectory": "older tombstones, which kept no trajectory",
    "invented_tools": "called tools not offered (--discard_invented=False)",
    "no_reasoning": "no reasoning (--discard_no_reasoning=False)",
    "end_reason": "an end reason that --end_reasons does not list",
    "min_tool_calls": "fewer tool calls than --min_tool_calls",
    "last_call_failed": "the last tool call failed or got no result",
    "unfinished": "no answer after the last tool call (--export=sharegpt keeps them)",
    "unconvertible": "turns that do not read as one conversation",
    "best_of": "another sample of the prompt was chosen, or none was good (--best_of)",
}

ROW_GROUP_ROWS = 1000
ROW_GROUP_BYTES = 64 << 20      # a row group is held in memory while it fills: bound it for big rows too


class ExportError(Exception):
    """The export cannot be done as asked (no run directory, an --out it must not overwrite, a line of
    the run that is JSON but not a row); one line for the user."""


class ConversionError(ValueError):
    """A row whose turns do not read back as one conversation: left out, and counted."""


# ---------------------------------------------------------------------------------------------
# Options


@dataclass(frozen=True)
class ExportOptions:
    format: str
    run_dir: Path
    out: Path
    reasoning: str = "drop"
    discard_no_reasoning: bool | None = None       # None: each row as the run decided (see drop_reason)
    discard_invented: bool = True
    end_reasons: frozenset[str] | None = None      # None: every end reason
    min_tool_calls: int = 0
    last_call_succeeded: bool = False
    best_of: str | None = None                     # None: every sample (see BEST_OF_RULES)

    @property
    def needs_conversation(self) -> bool:
        return self.format == "openai" or self.min_tool_calls > 0 or self.last_call_succeeded


def export_options(*, export: Any, run_name: Any, out: Any, reasoning: Any, discard_no_reasoning: Any,
                   discard_invented: Any, end_reasons: Any, min_tool_calls: Any,
                   last_call_succeeded: Any, best_of: Any = None) -> ExportOptions:
    """Validate the export's flags as the run validates its own: one UsageError naming the flag."""
    fmt = None if export is True else choice("export", export, FORMATS)
    if fmt is None:
        raise UsageError(f"--export needs a format: --export={'|'.join(FORMATS)}")
    run_dir = Path("data") / validate_run_name(run_name)
    for module in REQUIRED_MODULES.get(fmt, ()):
        if importlib.util.find_spec(module) is None:
            raise UsageError(f"--export={fmt} needs {module}, an optional extra: {install_hint('export')}")
    if reasoning is not None and fmt != "openai":
        raise UsageError(f"--reasoning applies to --export=openai; --export={fmt} keeps the rows' own turns")
    out_text = text("out", out)
    return ExportOptions(
        format=fmt, run_dir=run_dir, out=Path(out_text) if out_text else run_dir / DEFAULT_OUT[fmt],
        reasoning=choice("reasoning", reasoning, REASONING_MODES) or "drop",
        discard_no_reasoning=None if discard_no_reasoning is None else boolean("discard_no_reasoning",
                                                                                discard_no_reasoning),
        discard_invented=boolean("discard_invented", discard_invented),
        end_reasons=_end_reasons(end_reasons), min_tool_calls=non_negative_int("min_tool_calls", min_tool_calls),
        last_call_succeeded=boolean("last_call_succeeded", last_call_succeeded),
        best_of=choice("best_of", best_of, tuple(BEST_OF_RULES)))


def _end_reasons(value: Any) -> frozenset[str] | None:
    """'a,b' (fire may already have made it a tuple) -> the set, each a reason a trajectory row can have."""
    if value is None:
        return None
    allowed = [reason for reason in rows.END_REASONS if reason != "error"]    # "error" leaves no trajectory
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, (tuple, list)) else [value]
    names = [item.strip() for item in items if isinstance(item, str) and item.strip()]
    if not names or len(names) != len(items) or any(name not in allowed for name in names):
        raise UsageError(f"--end_reasons takes comma-separated end reasons from {', '.join(allowed)}; got {value!r}")
    return frozenset(names)


def flags_without_export(flags: dict[str, Any]) -> list[str]:
    """Export flags set on a command that exports nothing."""
    return [name for name, default in FLAG_DEFAULTS.items() if flags.get(name, default) != default]


# ---------------------------------------------------------------------------------------------
# Rows back into conversations: the inverse of rows.render_conversations


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
# Formats


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
    return out.with_name(f"{out.name.removesuffix('.jsonl')}.manifest.jsonl")


def arrow_schema() -> Any:
    """The one Arrow schema of the parquet and hf formats: the ShareGPT row, its registry-wide tool map
    as a list (so the columns do not change with the registry), every field typed."""
    import pyarrow as pa

    counts = [pa.field(name, pa.int64()) for name in ("count", "success", "failure")]
    usage = [pa.field(name, pa.int64()) for name in ("prompt_tokens", "completion_tokens", "reasoning_tokens",
                                                     "cached_tokens")] + [pa.field("cost", pa.float64())]
    return pa.schema([
        pa.field("prompt_index", pa.int64()), pa.field("sample_index", pa.int64()),
        pa.field("content_key", pa.string()),
        pa.field("conversations", pa.list_(pa.struct([pa.field("from", pa.string()),
                                                      pa.field("value", pa.string())]))),
        pa.field("gpt_turns", pa.list_(pa.struct([pa.field("reasoning_chars", pa.int64()),
                                                  pa.field("tool_calls", pa.int64())]))),
        pa.field("model", pa.string()), pa.field("timestamp", pa.string()), pa.field("batch_num", pa.int64()),
        pa.field("completed", pa.bool_()), pa.field("partial", pa.bool_()), pa.field("end_reason", pa.string()),
        pa.field("api_calls", pa.int64()),
        pa.field("toolsets_used", pa.list_(pa.string())), pa.field("toolsets_sampled", pa.list_(pa.string())),
        pa.field("tool_stats", pa.list_(pa.struct([pa.field("tool", pa.string()), *counts]))),
        pa.field("invented_tool_calls", pa.int64()), pa.field("usage", pa.struct(usage)),
        pa.field("wall_time_seconds", pa.float64()),
    ])


def arrow_record(candidate: Candidate) -> dict:
    row = candidate.row
    metadata = row.get("metadata") or {}
    return {**{key: row.get(key) for key in ("prompt_index", "sample_index", "content_key", "gpt_turns", "completed",
                                             "partial",
                                             "end_reason", "api_calls", "toolsets_used", "toolsets_sampled",
                                             "invented_tool_calls", "usage", "wall_time_seconds")},
            "conversations": [{"from": turn["from"], "value": turn["value"]} for turn in row["conversations"]],
            "model": metadata.get("model"), "timestamp": metadata.get("timestamp"),
            "batch_num": metadata.get("batch_num"),
            "tool_stats": [{"tool": name, **counts} for name, counts in (row.get("tool_stats") or {}).items()]}


# ---------------------------------------------------------------------------------------------
# Reading and filtering


class Candidate:
    """A row the filters are looking at; its JSON is decoded once, and only when something needs it."""

    def __init__(self, stored: rows.StoredRow, place: tuple[str, int] = ("", 0)) -> None:
        self.stored = stored
        self.place = place          # batch file name and offset: which line of the run it is

    @cached_property
    def row(self) -> dict:
        """The trajectory row in the current format; a tombstone without its tombstone keys, so every
        exported row has the keys of a merged one."""
        row = json.loads(self.stored.upgraded())
        row.pop("discarded", None)
        row.pop("prompt", None)
        return row

    @cached_property
    def conversation(self) -> Conversation:
        return conversation(self.row["conversations"], layouts_of(self.row))

    def sharegpt_line(self) -> bytes:
        """The row as the merge writes it: its own bytes when it is a current trajectory row."""
        if self.stored.status != rows.DISCARDED and self.stored.is_current:
            return self.stored.line
        return rows.encode_row(self.row)


@dataclass
class ExportSummary:
    options: ExportOptions
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    best_of: BestOf | None = None

    def lines(self) -> list[str]:
        options = self.options
        described = {"openai": f"OpenAI chat JSONL, reasoning {_REASONING_WORDS[options.reasoning]}",
                     "sharegpt": "ShareGPT JSONL", "parquet": "Parquet", "hf": "a datasets folder (load_from_disk)"}
        total = self.kept + sum(self.dropped.values())
        lines = [f"exported {self.kept} of {total} rows of {options.run_dir}/ to {options.out}",
                 f"format: {described[options.format]}"]
        if options.format == "openai":
            lines.append(f"manifest: {manifest_path(options.out)} (the run row of each line)")
        if self.best_of is not None:
            lines += self.best_of.lines(options)
        if self.dropped:
            lines.append("left out:")
            width = max(len(str(count)) for count in self.dropped.values())
            name_width = max(len(reason) for reason in self.dropped)
            order = list(DROP_REASONS)
            for reason, count in sorted(self.dropped.items(),
                                        key=lambda item: order.index(item[0]) if item[0] in order else len(order)):
                lines.append(f"  {count:>{width}} {reason:<{name_width}}  "
                             f"{DROP_REASONS.get(reason, 'discarded by the run')}")
        return lines


_REASONING_WORDS = {"think": "inline as <think> blocks", "field": "as reasoning_content",
                    "drop": "dropped (--reasoning=think or field keeps it)"}


def selected_rows(options: ExportOptions, summary: ExportSummary,
                  on_row: Callable[[rows.StoredRow], None] | None = None) -> Iterator[Candidate]:
    """The run's rows that pass every filter, in batch file order; the others counted by reason.
    ``on_row`` sees every readable row, kept or not."""
    directory = RunDirectory(options.run_dir)
    superseded = superseded_corrupted(directory.read_checkpoint() or {})
    for path in directory.batch_files():
        for offset, line in lines_at(path):
            try:
                stored = rows.read_stored_row(line)
            except rows.RowError as exc:
                raise ExportError(f"{path} line {line_number(path, offset)}: {exc}. The export stopped here "
                                  "rather than leave the row out without a word.") from None
            if stored is None:
                summary.dropped["unreadable"] += 1
                continue
            if on_row is not None:
                on_row(stored)
            candidate = Candidate(stored, (path.name, offset))
            try:
                reason = drop_reason(candidate, options, superseded)
            except ConversionError:
                reason = "unconvertible"
            if reason is None:
                yield candidate
            else:
                summary.dropped[reason] += 1


def drop_reason(candidate: Candidate, options: ExportOptions, superseded: Counter) -> str | None:
    """Why this row is left out (the first of DROP_REASONS that applies), or None to keep it.
    ``superseded`` counts down as the earlier attempts it names go by."""
    stored = candidate.stored
    if stored.status == rows.FAILED:
        return "failed"
    invented = stored.invented_tools()
    if invented and stored.status != rows.DISCARDED and superseded[stored.sample_key] > 0:
        superseded[stored.sample_key] -= 1
        return "superseded"
    discarded = stored.discard_reason()
    if discarded is not None and discarded != rows.NO_REASONING:
        return discarded
    if invented and options.discard_invented:
        return "invented_tools"
    # Unless told, as the run decided for each row: a tombstone is a row its filter discarded, and a
    # row without reasoning that is no tombstone was written with the filter off.
    if (discarded == rows.NO_REASONING if options.discard_no_reasoning is None
            else options.discard_no_reasoning and stored.reasoning_counts()[0] == 0):
        return "no_reasoning"
    if discarded is not None and candidate.row.get("conversations") is None:
        return "no_trajectory"
    if options.end_reasons is not None and stored.end_reason() not in options.end_reasons:
        return "end_reason"
    if options.needs_conversation:
        calls = candidate.conversation.calls()     # also proves the row converts
        if len(calls) < options.min_tool_calls:
            return "min_tool_calls"
        if options.last_call_succeeded and calls and (calls[-1].result is None
                                                      or rows.tool_result_failed(calls[-1].result)):
            return "last_call_failed"
        if options.format == "openai" and not candidate.conversation.ends_on_an_answer():
            return "unfinished"
    return None


# ---------------------------------------------------------------------------------------------
# Choosing among a prompt's samples (--best_of)


def sample_rank(candidate: Candidate, rule: str) -> tuple[int, ...] | None:
    """Where a sample stands under ``rule`` (lower is better), or None when it is not good."""
    stored = candidate.stored
    if stored.status != rows.COMPLETED:
        return None
    if rule == "first_completed":
        return (stored.sample_index,)
    if rule == "fewest_calls":
        try:
            calls = candidate.conversation.calls()
        except ConversionError:
            return None
        if calls and (calls[-1].result is None or rows.tool_result_failed(calls[-1].result)):
            return None
        return (int(candidate.row.get("api_calls") or 0), stored.sample_index)
    return (-sum(reasoning for reasoning, _calls in layouts_of(candidate.row)), stored.sample_index)


@dataclass
class BestOf:
    """What --best_of found: the chosen line of each prompt, and how many good samples each prompt had."""

    rule: str
    chosen: dict[str, tuple[tuple[int, ...], tuple[str, int]]] = field(default_factory=dict)  # rank, place
    good: Counter = field(default_factory=Counter)        # per prompt (StoredRow.prompt_key), 0 for none

    def see(self, stored: rows.StoredRow) -> None:
        self.good[stored.prompt_key] += 0

    def consider(self, candidate: Candidate) -> None:
        try:
            rank = sample_rank(candidate, self.rule)
        except ConversionError:
            rank = None
        if rank is None:
            return
        key = candidate.stored.prompt_key
        self.good[key] += 1
        if key not in self.chosen or rank < self.chosen[key][0]:
            self.chosen[key] = (rank, candidate.place)

    def places(self) -> set[tuple[str, int]]:
        return {place for _rank, place in self.chosen.values()}

    def spread(self) -> dict[str, int]:
        """Prompts by how many good samples they had."""
        counts = Counter(self.good.values())
        return {str(count): counts[count] for count in sorted(counts)}

    def as_json(self) -> dict:
        return {"best_of": self.rule, "rule": BEST_OF_RULES[self.rule], "prompts": len(self.good),
                "prompts_kept": len(self.chosen), "prompts_by_good_samples": self.spread()}

    def lines(self, options: ExportOptions) -> list[str]:
        spread = ", ".join(f"{prompts} with {count}" for count, prompts in self.spread().items())
        return [f"best of samples: {self.rule} ({BEST_OF_RULES[self.rule]})",
                f"  {len(self.chosen)} of {len(self.good)} prompts kept; prompts by good samples: {spread or 'none'}",
                f"  record: {best_of_path(options.out)}"]


def best_of_path(out: Path) -> Path:
    """Where the record of a --best_of choice goes: beside the export, ``openai.jsonl`` -> ``openai.best_of.json``."""
    return out.with_name(f"{out.stem}.best_of.json")


def chosen_samples(options: ExportOptions, summary: ExportSummary) -> Iterator[Candidate]:
    """One row per prompt, as options.best_of says: a first pass over the run ranks every sample that
    passes the filters (holding one entry per prompt), a second yields the chosen ones in batch file
    order; the others are counted as left out."""
    assert options.best_of is not None
    best = BestOf(options.best_of)
    for candidate in selected_rows(options, ExportSummary(options), on_row=best.see):
        best.consider(candidate)
    summary.best_of = best
    places = best.places()
    for candidate in selected_rows(options, summary):
        if candidate.place in places:
            yield candidate
        else:
            summary.dropped["best_of"] += 1


# ---------------------------------------------------------------------------------------------
# Writing


def export_run(options: ExportOptions) -> ExportSummary:
    """Write the export; the summary says what was kept and what was left out, by reason."""
    if not options.run_dir.is_dir():
        raise ExportError(f"no run directory {options.run_dir}/ here — --export reads data/<run_name>/ under the "
                          "current directory; check --run_name or cd to where the run was started")
    summary = ExportSummary(options)

    def counted(records: Iterable[Any]) -> Iterator[Any]:
        for record in records:
            summary.kept += 1
            yield record

    candidates = counted(selected_rows(options, summary) if options.best_of is None
                         else chosen_samples(options, summary))
    if options.format == "hf":
        _write_hf(options.out, candidates)
    elif options.format == "parquet":
        _write_file(options.out, lambda temp: _write_parquet(temp, candidates))
    elif options.format == "openai":
        _write_files([options.out, manifest_path(options.out)], lambda temps: _write_lines(
            temps, ((openai_line(candidate, options.reasoning), manifest_line(candidate)) for candidate in candidates)))
    else:
        _write_files([options.out], lambda temps: _write_lines(temps, ((line.sharegpt_line(),) for line in candidates)))
    if summary.best_of is not None:
        atomic_write_json(best_of_path(options.out), summary.best_of.as_json(), indent=2)
    else:       # a record of an earlier export's choice would describe rows this file does not hold
        best_of_path(options.out).unlink(missing_ok=True)
    return summary


def _write_file(out: Path, write: Callable[[Path], object]) -> None:
    _write_files([out], lambda temps: write(temps[0]))


def _write_files(outs: list[Path], write: Callable[[list[Path]], object]) -> None:
    """Write beside each of ``outs`` and rename over them, the first last: an export that stops
    halfway leaves the old files (or none), never half of one that looks whole."""
    for out in outs:
        if out.is_dir():
            raise ExportError(f"--out={out} is a directory; --export writes a file there")
    outs[0].parent.mkdir(parents=True, exist_ok=True)
    # another export (or the same command twice) may be writing beside them too
    temps = [temp_beside(out) for out in outs]
    try:
        write(temps)
        for temp, out in reversed(list(zip(temps, outs, strict=True))):
            os.replace(temp, out)
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)


def _write_lines(paths: list[Path], lines: Iterable[tuple[bytes, ...]]) -> None:
    """Each item's lines, one to each of ``paths``, in order."""
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(path.open("wb")) for path in paths]
        for items in lines:
            for handle, line in zip(handles, items, strict=True):
                handle.write(line)


def _row_groups(candidates: Iterable[Candidate]) -> Iterator[list[dict]]:
    """Records in groups of at most ROW_GROUP_ROWS rows and about ROW_GROUP_BYTES of row text."""
    group: list[dict] = []
    size = 0
    for candidate in candidates:
        group.append(arrow_record(candidate))
        size += len(candidate.stored.line)
        if len(group) >= ROW_GROUP_ROWS or size >= ROW_GROUP_BYTES:
            yield group
            group, size = [], 0
    if group:
        yield group


def _write_parquet(path: Path, candidates: Iterable[Candidate]) -> int:
    """The rows as one Parquet file, a row group at a time; how many were written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = arrow_schema()
    written = 0
    with pq.ParquetWriter(path, schema) as writer:      # an export with no rows is still a valid file
        for group in _row_groups(candidates):
            writer.write_table(pa.Table.from_pylist(group, schema=schema))
            written += len(group)
    return written


def _write_hf(out: Path, candidates: Iterable[Candidate]) -> None:
    """A ``datasets`` folder (save_to_disk), made from a Parquet file of the rows in a temporary folder
    beside ``out``: datasets reads it in batches, its cache lives and dies in that folder (so a stale one
    never stands in for the rows), and the folder is renamed into place only once it is whole."""
    import datasets

    if out.exists() and not _is_saved_dataset(out):
        raise ExportError(f"--out={out} exists and is not a datasets folder; remove it or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()        # the export prints its own summary
    try:
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as work:
            schema = arrow_schema()
            features = datasets.Features.from_arrow_schema(schema)
            if _write_parquet(Path(work) / "rows.parquet", candidates):
                dataset = datasets.Dataset.from_parquet(f"{work}/rows.parquet", features=features,
                                                        cache_dir=f"{work}/cache")
                dataset.save_to_disk(f"{work}/saved")
            else:     # datasets reads no rows from an empty file, and loads no folder of 0 shards
                empty = datasets.Dataset.from_dict({name: [] for name in schema.names}, features=features)
                empty.save_to_disk(f"{work}/saved", num_shards=1)
            if out.exists():
                shutil.rmtree(out)
            os.replace(f"{work}/saved", out)
    finally:
        if bars:
            datasets.enable_progress_bars()


def _is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is what save_to_disk writes, and so safe to replace."""
    return path.is_dir() and (path / "dataset_info.json").is_file() and (path / "state.json").is_file()
