"""The trajectory sample the report's browser shows: stratified reservoirs, so rare kinds (failures,
each tool, each end reason) are always represented, in memory bounded by the quotas, never by the
run's size. Apart from the scan that feeds it because what it keeps is a policy of its own."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from batchrun import rows
from batchrun.report.summary import CORRUPTED, PROMPT_GONE, SUPERSEDED

SAMPLE_LIMIT = 500              # trajectories embedded in the page at most

# How many rows of each kind the sample keeps, and which kinds are shown first when it is full.
QUOTAS = {"failed": 30, "corrupted": 30, "partial": 30, "tool_failed": 20, "discarded": 30, "tool": 20,
          "completed": 120}
PRIORITY = tuple(QUOTAS)


def categories(status: str, facts: dict) -> list[tuple[str, str]]:
    """The categories (kind, detail) a row is sampled in, by what RunSummary.add found of it."""
    if status == rows.FAILED:
        return [("failed", facts["cause"])]
    if status in (rows.DISCARDED, CORRUPTED):
        return [(status, "")]
    if status in (SUPERSEDED, PROMPT_GONE):
        return []
    found = [("partial", facts["end_reason"])] if status == rows.PARTIAL else [("completed", "")]
    found += [("tool", name) for name in facts["tools"]]
    found += [("tool_failed", name) for name in facts["tools_failed"]]
    return found


@dataclass
class _Reservoir:
    quota: int
    seen: int = 0
    ids: list[int] = field(default_factory=list)


class TrajectorySample:
    """Keeps, per category, a uniform random sample of its rows (reservoir sampling); a row is
    decoded and trimmed only when some reservoir takes it, and dropped when none holds it any more."""

    def __init__(self, limit: int = SAMPLE_LIMIT, seed: int = 0) -> None:
        self.limit = limit
        self._rng = random.Random(seed)
        self._reservoirs: dict[tuple[str, str], _Reservoir] = {}
        self._rows: dict[int, dict] = {}
        self._holders: Counter = Counter()

    def offer(self, row_id: int, categories: list[tuple[str, str]], build: Callable[[], dict]) -> None:
        for category in categories:
            reservoir = self._reservoirs.get(category)
            if reservoir is None:
                reservoir = self._reservoirs[category] = _Reservoir(QUOTAS[category[0]])
            reservoir.seen += 1
            if len(reservoir.ids) < reservoir.quota:
                self._hold(reservoir.ids, len(reservoir.ids), row_id, build)
            elif (slot := self._rng.randrange(reservoir.seen)) < reservoir.quota:
                self._release(reservoir.ids[slot])
                self._hold(reservoir.ids, slot, row_id, build)

    def _hold(self, ids: list[int], slot: int, row_id: int, build: Callable[[], dict]) -> None:
        if row_id not in self._rows:
            self._rows[row_id] = build()
        self._holders[row_id] += 1
        if slot == len(ids):
            ids.append(row_id)
        else:
            ids[slot] = row_id

    def _release(self, row_id: int) -> None:
        self._holders[row_id] -= 1
        if not self._holders[row_id]:
            del self._holders[row_id]
            del self._rows[row_id]

    def chosen(self) -> list[dict]:
        """Up to ``limit`` rows, taken round-robin over the categories (most telling kinds first)
        so every category is represented before any gets a second row; in row order."""
        ordered = self._ordered()
        picked: dict[int, None] = {}
        for position in range(max((len(r.ids) for _, r in ordered), default=0)):
            for _, reservoir in ordered:
                if len(picked) >= self.limit:
                    break
                if position < len(reservoir.ids):
                    picked.setdefault(reservoir.ids[position])
        return [self._rows[row_id] for row_id in sorted(picked)]

    def coverage(self) -> list[tuple[str, str, int, int]]:
        """(kind, detail, rows held, rows seen) per category, for the page's sampling note."""
        return [(kind, detail, len(r.ids), r.seen) for (kind, detail), r in self._ordered()]

    def _ordered(self) -> list[tuple[tuple[str, str], _Reservoir]]:
        return sorted(self._reservoirs.items(), key=lambda item: (PRIORITY.index(item[0][0]), item[0][1]))

