"""The resume scan: what earlier runs left in the batch files, and which samples count as done.

Only a resumed run scans, with the lock held and before it appends. Every row is read by
rows.read_stored_row; a line that is JSON but not a row this version understands stops the scan
with a RunDirectoryError naming its file and line.

Which rows finish their unit (counts_done), and that of a unit's finished rows only the first counts
(FirstFinished, ScanResult.repeats), is decided here for every reader: resume, the merge, the report
and the export.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from batchrun import rows
from batchrun.run_dir.reading import FileRange, lines_at, read_processes, reading_pool, refused_line, split_ranges
from batchrun.stats import UsageTotals, add_usage, empty_usage, not_superseded


@dataclass
class ScanResult:
    """What earlier runs left: finished rows per unit (rows.unit_key), and what counts as done."""

    done_units: Counter = field(default_factory=Counter)         # corrupted rows not included
    rows_by_status: Counter = field(default_factory=Counter)
    corrupted_units: list[str] = field(default_factory=list)     # corrupted rows' units, in batch-file order
    unreadable: list[tuple[str, int]] = field(default_factory=list)     # lines that are no rows: (file, offset)
    usage: UsageTotals = field(default_factory=empty_usage)      # of every row but repeats (see repeats)
    most_samples: int = 1                                        # the highest sample index of a row, plus one
    # Rows the merge writes to trajectories.jsonl, by sample index (a few numbers, whatever the run's length).
    merged_by_sample: Counter = field(default_factory=Counter)
    failed_units: set[str] = field(default_factory=set)          # the units of failure rows

    def add(self, other: ScanResult) -> None:
        add_usage(self.usage, other.usage)
        self.most_samples = max(self.most_samples, other.most_samples)
        self.merged_by_sample.update(other.merged_by_sample)
        self.failed_units |= other.failed_units
        self.done_units.update(other.done_units)
        self.rows_by_status.update(other.rows_by_status)
        self.corrupted_units.extend(other.corrupted_units)
        self.unreadable += other.unreadable

    @property
    def other_units(self) -> set[str]:
        """The units of rows that count nothing done, failures and corrupted rows: the planner finds where
        they are now when the dataset changed, as it does for the rows counted done."""
        return self.failed_units.union(self.corrupted_units)

    @property
    def corrupted_by_key(self) -> Counter:
        """Corrupted rows, ever, per sample key."""
        return Counter(map(rows.sample_key_of_unit, self.corrupted_units))

    @property
    def repeats(self) -> Counter:
        """Per unit, its finished rows beyond the first: a row appended twice (a batch file restored by
        appending a copy, say). Resume counts the unit done once, and the merge keeps the first."""
        return Counter({unit: count - 1 for unit, count in self.done_units.items() if count > 1})

    def live_corrupted(self, superseded: Counter) -> Counter:
        """Corrupted rows per key that no later attempt replaced (``superseded``: see Checkpoint)."""
        return +Counter({key: count - superseded[key] for key, count in self.corrupted_by_key.items()})

    def done(self, *, rerun_corrupted: bool, superseded: Counter) -> Counter:
        """Finished rows per unit key: a live corrupted row is done unless the user asked to run
        it again; a superseded one never is (its prompt's later attempt is what counts)."""
        done = Counter(self.done_units)
        if not rerun_corrupted:
            flags = not_superseded(map(rows.sample_key_of_unit, self.corrupted_units), superseded)
            done.update(unit for unit, live in zip(self.corrupted_units, flags, strict=True) if live)
        return done


def scan_files(files: list[Path]) -> ScanResult:
    """What these batch files hold (see :func:`scan_ranges`). Reading a row costs CPU, not disk (the
    reads are line-sized), so a big run directory is shared out over one process per core."""
    groups = split_ranges(files, read_processes(files))
    if len(groups) == 1:
        return scan_ranges(groups[0])
    result = ScanResult()
    with reading_pool(len(groups)) as pool:
        for part in pool.map(scan_ranges, groups):
            result.add(part)
    if result.repeats:
        # A part that read only a repeat counted it as a row of its own. Telling it from its first takes
        # reading in order: one process (rare, an edit by hand), as the merge does.
        return scan_ranges([file_range for group in groups for file_range in group])
    return result


def scan_ranges(ranges: list[FileRange]) -> ScanResult:
    """Count finished samples by unit in these byte ranges. Failed rows are not done; corrupted rows
    are counted apart (see ScanResult.done); a finished row after its unit's first is a repeat, counted
    in done_units alone (see ScanResult.repeats)."""
    result = ScanResult()
    for path, start, end in ranges:
        for offset, line in lines_at(path, start, end):
            try:
                row = rows.read_stored_row(line)
            except rows.RowError as exc:
                raise refused_line(path, offset, exc) from None
            if row is None:
                result.unreadable.append((path.name, offset))
                continue
            done = counts_done(row)
            if done and result.done_units[row.unit_key]:    # a copy of a row: nothing was spent or written twice
                result.done_units[row.unit_key] += 1
                continue
            result.rows_by_status[row.status] += 1
            add_usage(result.usage, row.usage())
            result.most_samples = max(result.most_samples, row.sample_index + 1)
            if done:
                result.done_units[row.unit_key] += 1
                if row.status != rows.DISCARDED:
                    result.merged_by_sample[row.sample_index] += 1
                continue
            if row.status == rows.FAILED:
                result.failed_units.add(row.unit_key)
            else:
                result.corrupted_units.append(row.unit_key)
    return result


def counts_done(row: rows.StoredRow) -> bool:
    """Whether a row finishes its unit: neither a failure nor corrupted (a row that calls a tool it was not
    offered; a tombstone called none)."""
    return row.status != rows.FAILED and (row.status == rows.DISCARDED or not row.invented_tools())


class FirstFinished:
    """Tells each unit's first finished row from the finished rows after it (a row appended twice by hand,
    say), which resume counts done once: the merge, the report and the export leave those repeats out.
    ``among``: the only units that may have repeats (ScanResult.repeats, where a resume scan found them;
    a run writes none itself), so that a reader following a run holds nothing per prompt; None where no
    scan was made (--report, --export), at the cost of one key per finished unit read."""

    def __init__(self, among: Collection[str] | None = None) -> None:
        self._among = among
        self._finished: set[str] = set()

    def is_repeat(self, row: rows.StoredRow) -> bool:
        """Whether ``row`` finishes a unit that a row read before finished. By the unit as written, as
        resume counts it: ask before StoredRow.relocate."""
        unit = row.unit_key
        if (self._among is not None and unit not in self._among) or not counts_done(row):
            return False
        if unit in self._finished:
            return True
        self._finished.add(unit)
        return False
