"""spent.jsonl: what sessions spent, reply by reply, so a session cut off before its row still counts.

Apart from the batch files because it is a ledger of money, not of results: the rows say what the
sessions that finished spent, this file what the others did (see SpentLedger).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchrun import rows
from batchrun.messages import Spent
from batchrun.run_dir.durable import append_whole, replacing
from batchrun.run_dir.errors import WriteFailed, write_failure_named
from batchrun.run_dir.reading import lines_at, record_json
from batchrun.stats import USAGE_KEYS, ReplyCounts, UsageTotals, add_usage, empty_usage, rounded_usage

SPENT = "spent.jsonl"


@dataclass(frozen=True)
class RowPlace:
    """Where a row is about to be appended: its task's unit (see messages.Task), the usage it carries,
    its batch file (a name in the run directory), the byte range it will take there, and the sample
    it is (which the row there must be)."""

    unit: int
    usage: dict[str, Any]       # as the row carries it, or as an earlier line of spent.jsonl said
    batch_file: str
    offset: int
    length: int
    prompt_index: int
    sample_index: int


class SpentLedger:
    """spent.jsonl: what sessions spent, reply by reply, until their rows carry it.

    A row holds its session's whole usage, but a session cut off (kill -9, a stop, a worker that
    died) leaves none, and its replies were paid for all the same. The parent appends a line per
    reply (``{"prompt": unit, "spent": usage, "source": cost source}``, the task's unit: see
    messages.Task); what a task spent beyond its row, or without one, was spent by a session cut off. A
    group of rows is announced before it is appended, each with where it will be (``{"prompt": unit,
    "row": usage, "at": [batch file, offset, length, prompt index, sample index]}``), and made durable
    with the replies so far; once the rows are appended one line lists those that were
    (``{"landed": [i, ...]}``). So a kill at any point leaves no row whose spending counts twice: rows
    announced with no such line after them (the last group before a kill) count as written only if
    the batch file holds them where announced. Replies alone are not synced (a killed runner's writes
    stay in the kernel's cache). Each invocation starts by folding the file into one line,
    ``{"carried": usage, "replies": {"by_cost_source": {...}, "tokenless": n}}``, so it stays small
    however long the run; spending cut off before any row was written counts too, with or without
    --resume. The replies' counts are every reply's, row or not: a reply whose cost or tokens were
    unknown keeps --max_cost or --max_total_tokens from being held in every later invocation.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._carried = empty_usage()            # cut off in earlier invocations
        self._cut_off = empty_usage()            # prompts of this invocation that spent beyond their rows
        self._open: dict[int, UsageTotals] = {}  # task unit -> spent so far, no row yet
        self._open_total = empty_usage()
        self._fd: int | None = None
        self.replies = ReplyCounts()             # every invocation's

    def start(self) -> None:
        """Take in what earlier invocations left, as one line."""
        if self.path.exists():
            announced: list[RowPlace] = []     # rows announced since the last "landed" line
            for _, line in lines_at(self.path):
                try:
                    record = record_json(line)
                    if "row" in record:
                        announced.append(_announced(record))
                    elif "landed" in record:
                        landed = set(record["landed"])
                        for place in announced:
                            if place.unit in landed:
                                self._take_row(place)
                        announced = []
                    else:
                        self._take(record)
                except (ValueError, TypeError, KeyError, AttributeError):
                    continue     # not a line this version wrote: it counts nothing
            for place in announced:
                if self._holds(place):
                    self._take_row(place)
            self._carried = self.unfinished()
            self._cut_off, self._open, self._open_total = empty_usage(), {}, empty_usage()
        replies = {"by_cost_source": dict(self.replies.cost_sources), "tokenless": self.replies.tokenless}
        with replacing(self.path) as handle:
            handle.write(json.dumps({"carried": self._carried, "replies": replies}).encode() + b"\n")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)

    def unfinished(self) -> UsageTotals:
        """Spent by sessions that left no row (or spent beyond it), every invocation so far."""
        total = self._carried.copy()
        add_usage(total, self._unfinished_now())
        return rounded_usage(total)

    def unfinished_this_invocation(self) -> UsageTotals:
        """Spent by this invocation's sessions that left no row (or spent beyond it)."""
        return rounded_usage(self._unfinished_now())

    def _unfinished_now(self) -> UsageTotals:
        total = self._cut_off.copy()
        add_usage(total, self._open_total)
        return total

    def record(self, spent: list[Spent], rows_to_write: list[RowPlace]) -> None:
        """Replies' usage as it arrives, and the rows about to be appended, announced where they will be;
        durable before those rows are written (see the class)."""
        lines = [{"prompt": event.unit, "spent": event.usage, "source": event.cost_source} for event in spent]
        for line in lines:        # spent all the same if the disk cannot take the line
            self._take(line)
        announced = [{"prompt": row.unit, "row": row.usage,
                      "at": [row.batch_file, row.offset, row.length, row.prompt_index, row.sample_index]}
                     for row in rows_to_write]
        self._append(lines + announced, sync=bool(rows_to_write))

    def landed(self, rows_written: list[RowPlace]) -> None:
        """The announced rows that were appended. Not synced: without this line the rows are found
        where they were announced, and one not found there never counted."""
        if rows_written:
            try:
                self._append([{"landed": [row.unit for row in rows_written]}], sync=False)
            except WriteFailed:
                pass
            for row in rows_written:
                self._take_row(row)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _append(self, records: list[dict[str, Any]], *, sync: bool) -> None:
        """Whole lines or none (see durable.append_whole)."""
        if not records or self._fd is None:
            return
        data = b"".join(json.dumps(record).encode() + b"\n" for record in records)
        with write_failure_named(self.path, len(data)):
            append_whole(self._fd, data, sync=sync)

    def _holds(self, place: RowPlace) -> bool:
        """Whether the batch file holds the announced row where it was announced."""
        batch = self.path.parent / place.batch_file
        try:
            for _, line in lines_at(batch, place.offset, place.offset + 1):
                stored = rows.read_stored_row(line)
                return (len(line) == place.length and stored is not None
                        and (stored.prompt_index, stored.sample_index) == (place.prompt_index, place.sample_index))
        except (OSError, rows.RowError):
            pass
        return False

    def _take(self, record: dict[str, Any]) -> None:
        if "carried" in record:
            add_usage(self._carried, record["carried"])
            carried = _carried_replies(record.get("replies"))
            self.replies.cost_sources.update(carried.cost_sources)
            self.replies.tokenless += carried.tokenless
        elif "spent" in record:
            add_usage(self._open.setdefault(record["prompt"], empty_usage()), record["spent"])
            add_usage(self._open_total, record["spent"])
            if "source" in record:                      # else written by a version that did not say
                self.replies.count(record["spent"], str(record["source"]))

    def _take_row(self, row: RowPlace) -> None:
        if (spent := self._open.pop(row.unit, None)) is not None:
            add_usage(self._open_total, {key: -spent[key] for key in USAGE_KEYS})
            add_usage(self._cut_off, {key: max(0, round(spent[key] - (row.usage.get(key) or 0), 8))
                                      for key in USAGE_KEYS})


def _carried_replies(value: Any) -> ReplyCounts:
    """The reply counts of a carried line; none from a line of a version before they were kept, or from one
    edited out of shape: the usage beside them is what must not be lost."""
    try:
        sources = Counter({str(source): max(0, int(n)) for source, n in value["by_cost_source"].items()})
        return ReplyCounts(sources, max(0, int(value["tokenless"])))
    except (TypeError, KeyError, ValueError, AttributeError, OverflowError):
        return ReplyCounts()


def _announced(record: dict[str, Any]) -> RowPlace:
    """A row announced in spent.jsonl. A line of a version before samples names the batch file, offset
    and length only: its unit was the prompt's index, and every row was sample 0."""
    batch_file, offset, length, *identity = record["at"]
    prompt_index, sample_index = identity or (record["prompt"], 0)
    return RowPlace(record["prompt"], record["row"], batch_file, offset, length, prompt_index, sample_index)
