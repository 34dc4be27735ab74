"""What the run report counts, fed one stored row at a time: the figures its tables show and its plots
(:mod:`batchrun.report.plots`) draw, in memory bounded whatever the size of the run.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime

from batchrun import rows
from batchrun.registry import TOOL_NAMES
from batchrun.report.trajectory import clip_name

MAX_TRACKED_FAILURES = 100_000  # failed prompts followed to see whether a retry succeeded
MAX_INVENTED_NAMES = 200        # invented tool names counted one by one; the page lists the commonest
OTHER_INVENTED_NAMES = "(other names)"
TIMELINE_BUCKETS = 2000         # time buckets at most; they widen as a long run needs
BINS_PER_DECADE = 10
CORRUPTED = "corrupted"         # a trajectory row naming an invented tool: left out of the merged file
SUPERSEDED = "superseded"       # a corrupted row whose prompt a --rerun_corrupted resume ran again
PROMPT_GONE = "prompt_gone"     # a row whose prompt is no longer in the dataset (StoredRow.placeless)


@dataclass
class LogHistogram:
    """Counts of values in fixed log-spaced bins: bounded memory whatever the range of values."""

    bins: Counter = field(default_factory=Counter)
    zeros: int = 0
    total: float = 0.0
    count: int = 0

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        if value <= 0:
            self.zeros += 1
        else:
            self.bins[math.floor(math.log10(value) * BINS_PER_DECADE)] += 1

    @staticmethod
    def edges(index: int) -> tuple[float, float]:
        return 10 ** (index / BINS_PER_DECADE), 10 ** ((index + 1) / BINS_PER_DECADE)

    def quantile(self, q: float) -> float:
        """Approximate quantile (the upper edge of the bin that holds it): good enough for a glance."""
        rank, seen = q * self.count, self.zeros
        if rank <= seen:
            return 0.0
        for index in sorted(self.bins):
            seen += self.bins[index]
            if seen >= rank:
                return self.edges(index)[1]
        return 0.0

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


@dataclass
class Timeline:
    """Trajectory rows per time bucket, by kind; buckets double in width when there are too many,
    so a run of months takes as little memory as one of minutes."""

    width: int = 1                                   # seconds per bucket
    counts: dict[int, list[int]] = field(default_factory=dict)   # bucket -> [completed, partial]
    starts: dict[int, float] = field(default_factory=dict)       # bucket -> earliest start of its rows

    def add(self, epoch: int, completed: bool, wall_time: float = 0.0) -> None:
        key = epoch // self.width
        bucket = self.counts.setdefault(key, [0, 0])
        bucket[0 if completed else 1] += 1
        self.starts[key] = min(self.starts.get(key, math.inf), epoch - wall_time)
        if len(self.counts) > TIMELINE_BUCKETS:
            self._widen()

    def _widen(self) -> None:
        widened: dict[int, list[int]] = {}
        starts: dict[int, float] = {}
        for key, (completed, partial) in self.counts.items():
            bucket = widened.setdefault(key // 2, [0, 0])
            bucket[0] += completed
            bucket[1] += partial
            starts[key // 2] = min(starts.get(key // 2, math.inf), self.starts[key])
        self.width *= 2
        self.counts, self.starts = widened, starts

    def active_seconds(self) -> float:
        """How long rows were being worked on: the union over buckets of [earliest start, bucket end],
        so the pauses between invocations do not count and rows arriving seldom are not taken for one
        a second."""
        total, span_start = 0.0, 0.0        # span_start means something once span_end is set
        span_end: float | None = None
        for key in sorted(self.counts):
            start, end = min(self.starts[key], key * self.width), (key + 1) * self.width
            if span_end is not None and start <= span_end:
                span_end = max(span_end, end)
                continue
            if span_end is not None:
                total += span_end - span_start
            span_start, span_end = start, end
        return total + (span_end - span_start if span_end is not None else 0.0)

    def points(self) -> list[tuple[datetime, int, int]]:
        """(bucket start, completed, partial) in time order."""
        return [(datetime.fromtimestamp(key * self.width, UTC).replace(tzinfo=None), completed, partial)
                for key, (completed, partial) in sorted(self.counts.items())]


# The times a row can hold but from an edit by hand: the timeline's axis, padded either side, must stay
# within datetime's range (year 1 or 9999 ran past it, and no page was written).
_EARLIEST, _LATEST = datetime(1970, 1, 1), datetime(9000, 1, 1)


@functools.lru_cache(maxsize=1024)       # many rows share each second
def _epoch(timestamp: str) -> int | None:
    """Seconds of a row's naive ISO timestamp, read as UTC only to get a stable number; None for a time
    no run wrote."""
    try:
        written = datetime.fromisoformat(timestamp)
    except ValueError:
        return None
    if not _EARLIEST <= written.replace(tzinfo=None) < _LATEST:
        return None
    return int(written.replace(tzinfo=UTC).timestamp())


@dataclass
class RunSummary:
    """Everything the page shows about the rows, fed one stored row at a time. Each name a row gives (end
    reason, cause, tool, toolset, model) is counted by its head and tail (clip_name): a row edited by hand can
    make one any length, and the tables and the plots show every name."""

    statuses: Counter = field(default_factory=Counter)           # completed/partial/failed/discarded/corrupted/...
    end_reasons: Counter = field(default_factory=Counter)        # kept trajectory rows
    failure_causes: Counter = field(default_factory=Counter)     # every failure row (each failed attempt)
    discard_reasons: Counter = field(default_factory=Counter)
    invented_tools: Counter = field(default_factory=Counter)     # corrupted rows per invented name
    tools: dict[str, list[int]] = field(default_factory=lambda: {n: [0, 0, 0, 0] for n in TOOL_NAMES})
    turns_with_reasoning: int = 0
    turns_without_reasoning: int = 0
    trajectory_reasoning: Counter = field(default_factory=Counter)   # all / some / none turns with reasoning
    toolsets: Counter = field(default_factory=Counter)           # sampled, per kept trajectory
    toolsets_offered: Counter = field(default_factory=Counter)   # gave the model at least one tool
    toolset_rows: int = 0
    turns: Counter = field(default_factory=Counter)              # assistant turns per kept trajectory
    tokens: LogHistogram = field(default_factory=LogHistogram)
    cost: LogHistogram = field(default_factory=LogHistogram)
    wall_time: LogHistogram = field(default_factory=LogHistogram)
    usage: dict = field(default_factory=lambda: dict.fromkeys(("prompt_tokens", "completion_tokens",
                                                                "reasoning_tokens", "cached_tokens", "cost"), 0))
    models: Counter = field(default_factory=Counter)
    timeline: Timeline = field(default_factory=Timeline)
    unreadable_lines: int = 0
    repeated_rows: int = 0                                       # finished rows after their unit's first
    refused_lines: int = 0                                       # JSON, but not rows this version understands
    first_refused: str = ""                                      # which line, and why
    batch_files: int = 0
    open_failures: dict[str, str] = field(default_factory=dict)  # content key -> cause, until a retry succeeds
    open_failures_exact: bool = True
    # Per content key, corrupted rows a --rerun_corrupted resume replaced (the checkpoint's record).
    superseded: Counter = field(default_factory=Counter)

    @property
    def row_count(self) -> int:
        return sum(self.statuses.values())

    @property
    def kept(self) -> int:
        return self.statuses[rows.COMPLETED] + self.statuses[rows.PARTIAL]

    def add(self, row: rows.StoredRow) -> tuple[str, dict]:
        """Count one row; returns its status (``corrupted`` included) and facts the sampler needs."""
        usage = row.usage()
        for key in self.usage:
            self.usage[key] += usage.get(key) or 0
        if row.placeless:
            self.statuses[PROMPT_GONE] += 1
            return PROMPT_GONE, {}
        if row.status == rows.FAILED:
            return self._add_failure(row)
        self.open_failures.pop(row.sample_key, None)    # a retry that succeeded (or was discarded)
        if row.status == rows.DISCARDED:
            reason = clip_name(row.discard_reason() or "unknown")
            self.statuses[rows.DISCARDED] += 1
            self.discard_reasons[reason] += 1
            self.trajectory_reasoning["none (discarded)"] += 1
            self._add_reasoning(row)     # coverage is over every assistant turn of the run
            return rows.DISCARDED, {}
        invented = row.invented_tools()
        if invented:
            if self.superseded[row.sample_key] > 0:     # replaced by a --rerun_corrupted attempt
                self.superseded[row.sample_key] -= 1
                self.statuses[SUPERSEDED] += 1
                return SUPERSEDED, {}
            self.statuses[CORRUPTED] += 1
            self._add_reasoning(row)     # its turns are the run's, left out of the merged file with it
            for name in map(clip_name, invented):       # a model can make up a new name in every row
                known = name in self.invented_tools or len(self.invented_tools) < MAX_INVENTED_NAMES
                self.invented_tools[name if known else OTHER_INVENTED_NAMES] += 1
            return CORRUPTED, {}
        return row.status, self._add_trajectory(row, usage)

    def _add_reasoning(self, row: rows.StoredRow) -> tuple[int, int]:
        with_reasoning, without = row.reasoning_counts()
        self.turns_with_reasoning += with_reasoning
        self.turns_without_reasoning += without
        return with_reasoning, without

    def _add_failure(self, row: rows.StoredRow) -> tuple[str, dict]:
        cause = clip_name(row.error_type() or "unknown")
        self.statuses[rows.FAILED] += 1
        self.failure_causes[cause] += 1
        if row.sample_key in self.open_failures or len(self.open_failures) < MAX_TRACKED_FAILURES:
            self.open_failures[row.sample_key] = cause
        else:
            self.open_failures_exact = False
        return rows.FAILED, {"cause": cause}

    def _add_trajectory(self, row: rows.StoredRow, usage: dict) -> dict:
        self.statuses[row.status] += 1
        end_reason = clip_name(row.end_reason())
        self.end_reasons[end_reason] += 1
        used, failed = [], []
        for full_name, count, success, failure in row.tool_counts():
            name = clip_name(full_name)
            entry = self.tools.setdefault(name, [0, 0, 0, 0])
            entry[0] += count
            entry[1] += success
            entry[2] += failure
            entry[3] += 1                                 # trajectories using it
            used.append(name)
            if failure:
                failed.append(name)
        with_reasoning, without = self._add_reasoning(row)
        self.trajectory_reasoning["all turns" if not without else "no turn" if not with_reasoning
                                  else "some turns"] += 1
        self.turns[with_reasoning + without] += 1
        self.toolsets.update(map(clip_name, row.toolsets_sampled()))
        self.toolsets_offered.update(map(clip_name, row.toolsets_used()))
        self.toolset_rows += 1
        self.tokens.add((usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0))
        self.cost.add(usage.get("cost") or 0.0)
        found = row.metadata()
        if found:
            timestamp, model = found
            self.models[clip_name(model)] += 1
            if (epoch := _epoch(timestamp)) is not None:
                self.timeline.add(epoch, row.status == rows.COMPLETED, row.wall_time())
        self.wall_time.add(row.wall_time())
        return {"end_reason": end_reason, "tools": used, "tools_failed": failed}

    def open_failure_causes(self) -> Counter:
        """Failed prompts no later row of the batch files shows done: what --resume would retry."""
        return Counter(self.open_failures.values())
