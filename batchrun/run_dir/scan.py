"""The resume scan: what earlier runs left in the batch files, and which samples count as done.

Only a resumed run scans, with the lock held and before it appends. Every row is read by
rows.read_stored_row; a line that is JSON but not a row this version understands stops the scan
with a RunDirectoryError naming its file and line.
"""

from __future__ import annotations

from collections import Counter
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
    usage: UsageTotals = field(default_factory=empty_usage)      # of every row
    most_samples: int = 1                                        # the highest sample index of a row, plus one
    # The units of rows that count nothing done, failures and corrupted rows: the planner finds where
    # they are now when the dataset changed, as it does for the rows counted done.
    other_units: set[str] = field(default_factory=set)

    def add(self, other: ScanResult) -> None:
        add_usage(self.usage, other.usage)
        self.most_samples = max(self.most_samples, other.most_samples)
        self.done_units.update(other.done_units)
        self.rows_by_status.update(other.rows_by_status)
        self.corrupted_units.extend(other.corrupted_units)
        self.unreadable += other.unreadable
        self.other_units |= other.other_units

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
    return result


def scan_ranges(ranges: list[FileRange]) -> ScanResult:
    """Count finished samples by unit in these byte ranges. Failed rows are not done; corrupted rows
    are counted apart (see ScanResult.done)."""
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
            result.rows_by_status[row.status] += 1
            add_usage(result.usage, row.usage())
            result.most_samples = max(result.most_samples, row.sample_index + 1)
            if counts_done(row):
                result.done_units[row.unit_key] += 1
                continue
            result.other_units.add(row.unit_key)
            if row.status != rows.FAILED:
                result.corrupted_units.append(row.unit_key)
    return result


def counts_done(row: rows.StoredRow) -> bool:
    """Whether a row finishes its unit: neither a failure nor corrupted (a row that calls a tool it was not
    offered; a tombstone called none)."""
    return row.status != rows.FAILED and (row.status == rows.DISCARDED or not row.invented_tools())
