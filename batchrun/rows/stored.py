"""The one reader of stored rows (resume, merge, statistics, the report, --export): StoredRow and
read_stored_row, built on msgspec for speed; the upgrade of older formats to the current one, and the
refusal of newer ones."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Annotated

import msgspec

from batchrun.registry import REGISTRY
from batchrun.rows.build import KEY_ORDER, ROW_FORMAT, encode_row
from batchrun.rows.keys import sample_key, unit_key
from batchrun.rows.outcome import RowStatus
from batchrun.rows.read_back import (
    LayoutError,
    layout_by_text,
    offered_tool_names,
    read_gpt_turn,
    split_rendered_reasoning,
)
from batchrun.rows.render import EMPTY_THINK, GptLayout
from batchrun.rows.tool_outcomes import is_invented


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


# A place in the dataset, or a sample of it: a negative one names none, and would be merged beside the
# row resume runs again in its stead.
_Index = Annotated[int, msgspec.Meta(ge=0)]


class _Row(msgspec.Struct):
    prompt_index: _Index
    content_key: str
    end_reason: str
    sample_index: _Index = 0                   # 0 in a row of format 1 to 3
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

    __slots__ = ("line", "status", "_row", "_as_written", "_invented", "_place", "_placeless")

    def __init__(self, line: bytes, status: RowStatus, row: _Row, as_written: bool = True,
                 invented: list[str] | None = None) -> None:
        self.line = line
        self.status = status
        self._row = row
        self._as_written = as_written   # read as strict JSON, not only by Python's rules (_decoded_by_python_rules)
        self._invented = invented       # read with the row when it has any (read_stored_row)
        self._place: int | None = None  # see relocate
        self._placeless = False

    @property
    def prompt_index(self) -> int:
        return self._row.prompt_index if self._place is None else self._place

    def relocate(self, places: Mapping[str, int | None]) -> None:
        """Give the row its place in the dataset now, where a resumed run found it moved since the row was
        written (``places``: see DatasetPlan.relocated), so that every row of one prompt names one place:
        the row's prompt index, its keys and the line the merge and the export write. A row it found no
        place for is then :attr:`placeless`."""
        unit = unit_key(self._row.prompt_index, self.sample_key)
        self._place = places.get(unit)
        self._placeless = unit in places and self._place is None

    @property
    def placeless(self) -> bool:
        """Whether the last resumed run found no line of its dataset for this row: its prompt is no longer
        there (see DatasetPlan.relocated). Every reader leaves such a row out, as the place it was written
        with is another prompt's now or may become one; the batch file keeps it, and a resume over a
        dataset that holds the line again gives it its place back."""
        return self._placeless

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
        that two occurrences of one prompt text (each its own prompt) keep their samples apart: the unit
        key of its first sample."""
        return unit_key(self.prompt_index, self._row.content_key)

    @property
    def unit_key(self) -> str:
        """The unit of work this row is (see unit_key)."""
        return unit_key(self.prompt_index, self.sample_key)

    @property
    def is_current(self) -> bool:
        """False for a row of an earlier format (see ROW_FORMAT)."""
        return self._row.format == ROW_FORMAT

    @property
    def is_verbatim(self) -> bool:
        """Whether the line as written is the row as the merge and the export write it: of the current
        format, not relocated, and strict JSON. A line only Python's rules read (a byte order mark an
        editor put before it, a lone surrogate escape) is one that datasets refuses, and pandas or
        json.loads too for the mark, so it is written re-encoded."""
        return self.is_current and self._place is None and self._as_written

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
        if self.status == RowStatus.FAILED and not self._row.failed:
            return self._row.end_reason
        return self._row.error_type

    def discard_reason(self) -> str | None:
        return self._row.discarded

    def upgraded(self) -> bytes:
        """The line in the current format, so that every row of the merged file has the same keys
        of the same types, as loaders such as ``datasets.load_dataset("json")`` require: a format 1
        row loses the ``tool_calls`` lists of its turns and gains the newer keys. A relocated row names its
        prompt's place now."""
        if self.is_verbatim:
            return self.line
        row = json.loads(self.line)
        row["prompt_index"] = self.prompt_index
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
        last = len(KEY_ORDER)      # a key of the row's own (added by hand, say) goes after ours
        return encode_row({key: row[key] for key in sorted(row, key=lambda key: KEY_ORDER.get(key, last))})


def read_stored_row(line: bytes) -> StoredRow | None:
    """The row on a line; None for a line that is not JSON (cut short by a crash, or blank).

    Raises RowError for JSON that is not a row, and for a row of a newer format than this version's.
    A row without a single gpt turn reads as a failure (older versions wrote such rows when a model
    gave only empty answers): it holds nothing to train on, and resume runs its prompt again.
    """
    decoded = _decoded(line)
    if decoded is None:
        return None
    row, as_written = decoded
    if row.conversations and not _utf8(line):
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
        status = RowStatus.FAILED
    elif row.conversations is not None and not gpt_turns:
        status = RowStatus.FAILED
    elif row.discarded is not None:
        status = RowStatus.DISCARDED
    elif row.conversations is not None:
        status = RowStatus.COMPLETED if row.completed else RowStatus.PARTIAL
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
    return StoredRow(line, status, row, as_written, invented)


def _utf8(line: bytes) -> bool:
    """Whether a line is UTF-8, as JSON must be: msgspec checks the text it decodes, but keeps the turns'
    values raw, and a byte a disk or a copy damaged there would break every later reader of the row (the
    line is not JSON: Python's json refuses it)."""
    if line.isascii():
        return True
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


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


def _decoded(line: bytes) -> tuple[_Row, bool] | None:
    """The row on the line, and whether it was read as written (see StoredRow.is_verbatim)."""
    try:
        return _ROW.decode(line), True
    except msgspec.ValidationError as exc:
        _refuse_newer_format(line)
        raise RowError(f"not a batch_runner row ({exc}); fix or remove this line") from None
    except msgspec.DecodeError:
        return _decoded_by_python_rules(line)
    except RecursionError:
        raise _too_deep() from None


def _decoded_by_python_rules(line: bytes) -> tuple[_Row, bool] | None:
    """msgspec refuses lone UTF-16 surrogates (``"\\udc80"``), which Python's json writes and reads: a
    line that is JSON by Python's rules is read once more with them replaced, never taken for debris."""
    try:
        value = json.loads(line, parse_constant=_not_json_constant)
    except _NotJsonConstant:
        raise RowError("not a batch_runner row (NaN or Infinity, which JSON does not have); "
                       "fix or remove this line") from None
    except ValueError:
        return None
    except RecursionError:
        raise _too_deep() from None
    decoded = _decoded(encode_row(value))     # encode_row writes each lone surrogate as "?"
    return None if decoded is None else (decoded[0], False)


class _NotJsonConstant(Exception):
    """Python's json reads NaN and Infinity, which msgspec (and JSON) refuse: read again, such a line
    would be refused again, for ever."""


def _not_json_constant(name: str) -> float:
    raise _NotJsonConstant(name)


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
