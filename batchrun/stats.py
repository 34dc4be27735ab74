"""Aggregate statistics: built during the merge pass, plus this invocation's counters.

Figures about the merged file and the run directory cover every run under the name; figures about
this invocation live under ``this_run``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, NamedTuple, NotRequired, TypedDict, get_args

from batchrun import rows
from batchrun.concurrency import ConcurrencyFigures
from batchrun.registry import TOOL_NAMES


class UsageTotals(TypedDict):
    """Usage added up over replies or rows, every key present, written to JSON as it is in this order.
    ``cost`` starts as the int 0, so a run that spent nothing writes ``0``, as it always has."""

    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    cached_tokens: int
    cost: float


UsageKey = Literal["prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens", "cost"]
USAGE_KEYS: tuple[UsageKey, ...] = get_args(UsageKey)


def add_usage(total: UsageTotals, usage: Mapping[str, Any] | None) -> None:
    """Add ``usage`` to ``total``: a reply's, a row's or a line's of spent.jsonl, where a missing or
    null key counts 0."""
    for key in USAGE_KEYS:
        total[key] += (usage or {}).get(key) or 0


def empty_usage() -> UsageTotals:
    return {"prompt_tokens": 0, "completion_tokens": 0, "reasoning_tokens": 0, "cached_tokens": 0, "cost": 0}


def usage_totals(data: Mapping[str, Any]) -> UsageTotals:
    """Totals as a JSON file kept them; KeyError if one is missing."""
    return {"prompt_tokens": data["prompt_tokens"], "completion_tokens": data["completion_tokens"],
            "reasoning_tokens": data["reasoning_tokens"], "cached_tokens": data["cached_tokens"],
            "cost": data["cost"]}


def rounded_usage(usage: UsageTotals) -> UsageTotals:
    """As written: a cost added up from many replies carries float noise past the 8th decimal."""
    return {**usage, "cost": round(usage["cost"], 8)}


class ToolFigures(TypedDict):
    count: int
    success: int
    failure: int


class ToolStatistics(ToolFigures):
    success_rate: float
    failure_rate: float


class ReasoningStatistics(TypedDict):
    total_assistant_turns: int
    turns_with_reasoning: int
    turns_without_reasoning: int
    coverage_percent: float


class SampleStatistics(TypedDict):
    prompts_with_rows: int
    prompts_with_a_completed_sample: int
    prompts_by_completed_samples: dict[str, int]


class ThisRunStatistics(TypedDict):
    prompts_processed: int
    completed: int
    partial: int
    failed: int
    discarded_no_reasoning: int
    api_calls: int
    usage: UsageTotals
    spent_by_unfinished_sessions: UsageTotals
    replies_by_cost_source: dict[str, int]
    duration_seconds: float
    concurrency: NotRequired[dict[str, Any]]


@dataclass
class ReplyCounts:
    """Replies by where their cost came from, and those that counted no tokens: what --max_cost and
    --max_total_tokens cannot see, which stops them from being held."""

    cost_sources: Counter = field(default_factory=Counter)
    tokenless: int = 0

    def count(self, usage: Mapping[str, Any], cost_source: str) -> None:
        self.cost_sources[cost_source] += 1
        if not (usage.get("prompt_tokens") or usage.get("completion_tokens")):      # no usage, or none readable
            self.tokenless += 1

    @property
    def unpriced(self) -> int:
        """Replies whose cost is unknown (the endpoint said none, and no price was known)."""
        return self.cost_sources["unknown"]


@dataclass
class ThisRun:
    """Counters of the current invocation, fed as rows arrive."""

    statuses: Counter = field(default_factory=Counter)
    failures_by_cause: Counter = field(default_factory=Counter)
    usage: UsageTotals = field(default_factory=empty_usage)
    api_calls: int = 0
    concurrency: ConcurrencyFigures | None = None     # as the pool last reported it
    replies: ReplyCounts = field(default_factory=ReplyCounts)

    def record(self, status: str, usage: Mapping[str, Any], api_calls: int, error_type: str | None) -> None:
        self.statuses[status] += 1
        add_usage(self.usage, usage)
        self.api_calls += api_calls
        if status == rows.FAILED:
            self.failures_by_cause[error_type or "unknown"] += 1

    @property
    def processed(self) -> int:
        return sum(self.statuses.values())


class CorruptedRow(NamedTuple):
    """A corrupted row as the merge counts it: where it is, the tools it made up, its sample key (which a
    --rerun_corrupted attempt replaces it by), and its assistant turns with and without reasoning."""

    batch_file: str
    prompt_index: int
    invented: list[str]
    key: str
    turns_with_reasoning: int
    turns_without_reasoning: int


@dataclass
class MergeStatistics:
    """Everything counted while streaming the batch files into trajectories.jsonl."""

    tool_entries: Counter = field(default_factory=Counter)      # (tool, count, success, failure) -> rows
    turns_with_reasoning: int = 0
    turns_without_reasoning: int = 0
    merged: int = 0
    merged_by_status: Counter = field(default_factory=Counter)
    end_reasons: Counter = field(default_factory=Counter)
    discarded: int = 0
    corrupted: list[CorruptedRow] = field(default_factory=list)
    usage: UsageTotals = field(default_factory=empty_usage)
    batch_files: int = 0
    placeless: int = 0      # rows of any kind whose prompt is no longer in the dataset (StoredRow.placeless)
    # Per prompt (StoredRow.prompt_key), its completed samples; None unless the run has several samples per
    # prompt (a dict the size of the dataset is kept only where it says something).
    prompt_samples: Counter | None = None

    def on_row(self, row: rows.StoredRow) -> None:
        """Called for every readable row that is not corrupted; merged rows are trajectory rows."""
        add_usage(self.usage, row.usage())
        self._count_sample(row, completed=row.status == rows.COMPLETED)
        if row.status == rows.FAILED:
            return
        # Reasoning coverage is over every assistant turn of the run, the discarded ones' too.
        with_reasoning, without = row.reasoning_counts()
        self.turns_with_reasoning += with_reasoning
        self.turns_without_reasoning += without
        if row.status == rows.DISCARDED:
            self.discarded += 1
            return
        self.merged += 1
        self.merged_by_status[row.status] += 1
        self.end_reasons[row.end_reason()] += 1
        self.tool_entries.update(row.tool_counts())

    def on_placeless(self, row: rows.StoredRow) -> None:
        """Counted apart from every other figure but what was spent, which was spent all the same."""
        add_usage(self.usage, row.usage())
        self.placeless += 1

    def _count_sample(self, row: rows.StoredRow, *, completed: bool) -> None:
        if self.prompt_samples is not None:
            self.prompt_samples[row.prompt_key] += completed     # a prompt without a completed sample counts too

    def add(self, other: MergeStatistics) -> None:
        """Take in what another process counted over other rows."""
        if self.prompt_samples is not None and other.prompt_samples is not None:
            self.prompt_samples.update(other.prompt_samples)
        self.tool_entries.update(other.tool_entries)
        self.turns_with_reasoning += other.turns_with_reasoning
        self.turns_without_reasoning += other.turns_without_reasoning
        self.merged += other.merged
        self.merged_by_status.update(other.merged_by_status)
        self.end_reasons.update(other.end_reasons)
        self.discarded += other.discarded
        self.placeless += other.placeless
        self.corrupted.extend(other.corrupted)
        add_usage(self.usage, other.usage)

    def to_state(self) -> dict[str, Any]:
        """Everything counted, as JSON, so a later merge can go on counting (see run_dir.merge)."""
        return {"tool_entries": [[*entry, rows_with_it] for entry, rows_with_it in self.tool_entries.items()],
                "turns_with_reasoning": self.turns_with_reasoning,
                "turns_without_reasoning": self.turns_without_reasoning,
                "merged": self.merged, "merged_by_status": dict(self.merged_by_status),
                "end_reasons": dict(self.end_reasons), "discarded": self.discarded, "placeless": self.placeless,
                "corrupted": [list(entry) for entry in self.corrupted], "usage": self.usage.copy(),
                "prompt_samples": None if self.prompt_samples is None else dict(self.prompt_samples)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> MergeStatistics:
        return cls(tool_entries=Counter({(name, count, success, failure): rows_with_it
                                         for name, count, success, failure, rows_with_it in state["tool_entries"]}),
                   turns_with_reasoning=state["turns_with_reasoning"],
                   turns_without_reasoning=state["turns_without_reasoning"],
                   merged=state["merged"], merged_by_status=Counter(state["merged_by_status"]),
                   end_reasons=Counter(state["end_reasons"]), discarded=state["discarded"],
                   # A record from before rows could be placeless counts none: any there are now came with a
                   # relocations.json it was not made under, which no merge appends to.
                   placeless=state.get("placeless", 0),
                   corrupted=[CorruptedRow(*entry) for entry in state["corrupted"]],
                   usage=usage_totals(state["usage"]),
                   prompt_samples=None if state.get("prompt_samples") is None else Counter(state["prompt_samples"]))

    def on_corrupted(self, batch_file: str, row: rows.StoredRow, invented: list[str]) -> None:
        add_usage(self.usage, row.usage())
        self._count_sample(row, completed=False)
        self.corrupted.append(CorruptedRow(batch_file, row.prompt_index, invented, row.sample_key,
                                           *row.reasoning_counts()))

    def live_corrupted(self, superseded: Counter) -> list[CorruptedRow]:
        """The corrupted rows no later attempt replaced (see not_superseded)."""
        flags = not_superseded((entry.key for entry in self.corrupted), superseded)
        return [entry for entry, live in zip(self.corrupted, flags, strict=True) if live]

    def tool_counts(self) -> dict[str, ToolFigures]:
        totals: dict[str, ToolFigures] = {name: {"count": 0, "success": 0, "failure": 0} for name in TOOL_NAMES}
        for (name, count, success, failure), rows_with_it in self.tool_entries.items():
            if name in totals:
                totals[name]["count"] += count * rows_with_it
                totals[name]["success"] += success * rows_with_it
                totals[name]["failure"] += failure * rows_with_it
        return totals

    def tool_statistics(self) -> dict[str, ToolStatistics]:
        table: dict[str, ToolStatistics] = {}
        for name, entry in self.tool_counts().items():
            count = entry["count"]
            table[name] = {**entry,
                           "success_rate": round(100 * entry["success"] / count, 2) if count else 0.0,
                           "failure_rate": round(100 * entry["failure"] / count, 2) if count else 0.0}
        return table

    def sample_statistics(self) -> SampleStatistics | None:
        """Success per prompt over its samples: how many prompts had at least one completed sample
        (pass@k, k the samples each had), and how many had 0, 1, 2... completed samples."""
        if self.prompt_samples is None:
            return None
        spread = Counter(self.prompt_samples.values())
        return {"prompts_with_rows": len(self.prompt_samples),
                "prompts_with_a_completed_sample": len(self.prompt_samples) - spread[0],
                "prompts_by_completed_samples": {str(count): spread[count] for count in sorted(spread)}}

    def reasoning_statistics(self, live_corrupted: list[CorruptedRow]) -> ReasoningStatistics:
        """Over every assistant turn of the run: its kept, discarded and ``live_corrupted`` rows'."""
        with_reasoning = self.turns_with_reasoning + sum(row.turns_with_reasoning for row in live_corrupted)
        without = self.turns_without_reasoning + sum(row.turns_without_reasoning for row in live_corrupted)
        total = with_reasoning + without
        return {"total_assistant_turns": total, "turns_with_reasoning": with_reasoning,
                "turns_without_reasoning": without,
                "coverage_percent": round(100 * with_reasoning / total, 2) if total else 0.0}


def placeless_line(count: int) -> str:
    """Why rows of the batch files are missing from everything merged and counted, and what brings them back."""
    if count == 1:
        return ("1 row left out: its prompt is no longer in the dataset (its line was edited or removed); it stays "
                "in its batch file, and a --resume with that line back in the dataset brings it back")
    return (f"{count:,} rows left out: their prompts are no longer in the dataset (their lines were edited or "
            "removed); they stay in the batch files, and a --resume with those lines back in the dataset brings "
            "them back")


def build_statistics(*, run_name: str, distribution: str, model: str, batch_size: int, total_prompts: int,
                     skipped_dataset_lines: int, duration: float, merge: MergeStatistics, this_run: ThisRun,
                     superseded_corrupted: Counter, unfinished: UsageTotals, unfinished_this_run: UsageTotals,
                     replies: ReplyCounts, samples_per_prompt: int = 1,
                     pricing: dict[str, Any] | None = None) -> dict[str, Any]:
    """``unfinished``: spent by sessions that left no row (cut off by a kill or a stop), which the
    run's usage includes beside its rows'; ``unfinished_this_run`` the part of it this invocation's
    sessions spent, which its own usage includes. ``replies``: every invocation's, by cost source."""
    corrupted = merge.live_corrupted(superseded_corrupted)
    usage = merge.usage.copy()
    add_usage(usage, unfinished)
    return {
        "run_name": run_name,
        "distribution": distribution,
        "model": model,
        "total_prompts": total_prompts,
        **({"samples_per_prompt": samples_per_prompt, "samples": samples}
           if (samples := merge.sample_statistics()) is not None else {}),
        "skipped_dataset_lines": skipped_dataset_lines,
        "total_batches": merge.batch_files,
        "batch_size": batch_size,
        "completed_at": datetime.now().isoformat(timespec="seconds"),
        "duration_seconds": round(duration, 3),
        "trajectories_in_merged_file": merge.merged,
        "completed_in_merged_file": merge.merged_by_status[rows.COMPLETED],
        "partial_in_merged_file": merge.merged_by_status[rows.PARTIAL],
        "end_reasons": dict(merge.end_reasons),
        "tool_statistics": merge.tool_statistics(),
        "reasoning_statistics": merge.reasoning_statistics(corrupted),
        "discarded_no_reasoning": merge.discarded,
        "failed_prompts": this_run.statuses[rows.FAILED],
        "failures_by_cause": dict(this_run.failures_by_cause),
        "filtered_corrupted": len(corrupted),
        "corrupted_entries": [{"batch_file": row.batch_file, "prompt_index": row.prompt_index,
                               "invented_tools": row.invented} for row in corrupted[:100]],
        "filtered_prompt_gone": merge.placeless,
        **({"filtered_prompt_gone_why": placeless_line(merge.placeless)} if merge.placeless else {}),
        "usage": rounded_usage(usage),
        "spent_by_unfinished_sessions": rounded_usage(unfinished),
        # Every invocation's replies by where their cost came from ("unknown": "cost" above leaves them out).
        "replies_by_cost_source": dict(replies.cost_sources),
        # How replies without a cost of their own were priced.
        **({"pricing": pricing} if pricing is not None else {}),
        "this_run": _this_run_statistics(this_run, duration, unfinished_this_run),
    }


def _this_run_statistics(this_run: ThisRun, duration: float, unfinished: UsageTotals) -> ThisRunStatistics:
    usage = this_run.usage.copy()
    add_usage(usage, unfinished)
    section: ThisRunStatistics = {
        "prompts_processed": this_run.processed,
        "completed": this_run.statuses[rows.COMPLETED],
        "partial": this_run.statuses[rows.PARTIAL],
        "failed": this_run.statuses[rows.FAILED],
        "discarded_no_reasoning": this_run.statuses[rows.DISCARDED],
        "api_calls": this_run.api_calls,
        "usage": rounded_usage(usage),
        "spent_by_unfinished_sessions": unfinished,
        "replies_by_cost_source": dict(this_run.replies.cost_sources),
        "duration_seconds": round(duration, 3),
    }
    if this_run.concurrency:
        section["concurrency"] = this_run.concurrency.as_dict()
    return section


def not_superseded(sample_keys: Iterable[str], superseded: Counter) -> Iterator[bool]:
    """Whether each corrupted row, named by its sample key in batch-file order, still counts: of each
    sample key's rows, the first ``superseded`` are the ones a --rerun_corrupted resume ran again."""
    skip = Counter(superseded)
    for key in sample_keys:
        if skip[key] > 0:
            skip[key] -= 1
            yield False
        else:
            yield True
