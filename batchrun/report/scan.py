"""The report's pass over a run directory: each row of the batch files read once, counted into a
RunSummary and offered to the trajectory sample, in as many steps as the run needs (see RunScan)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from batchrun import rows
from batchrun.report.sample import SAMPLE_LIMIT, TrajectorySample, categories
from batchrun.report.summary import RunSummary
from batchrun.report.trajectory import sampled_row
from batchrun.run_dir import (
    CHECKPOINT,
    STATISTICS,
    RunDirectory,
    line_number,
    lines_at,
    require_regular_files,
    superseded_corrupted,
)
from batchrun.run_dir.errors import RunDirectoryError
from batchrun.run_dir.reading import read_whole, record_json
from batchrun.run_dir.relocations import RELOCATIONS
from batchrun.run_dir.scan import FirstFinished


class RunScan:
    """The report's pass over the batch files, in as many steps as needed: each
    :meth:`read_new_rows` reads the complete rows written since the last one, so a run can keep the
    figures current while it writes rows (batchrun.report_follower) and draw the page at the end
    without reading everything again."""

    def __init__(self, run_dir: Path, sample_limit: int = SAMPLE_LIMIT,
                 repeated: Collection[str] | None = None) -> None:
        require_regular_files(run_dir, (CHECKPOINT, STATISTICS, RELOCATIONS))
        self.run_dir = RunDirectory(run_dir)
        self.summary, self.sample = RunSummary(), TrajectorySample(sample_limit)
        self.summary.superseded = superseded_corrupted(read_json(run_dir / CHECKPOINT))
        self._relocated = self.run_dir.relocations()   # the rows shown name their prompts' places now
        self._read_up_to: dict[Path, int] = {}     # per batch file: the end of its last complete row read
        self._first_finished = FirstFinished(among=repeated)     # ``repeated``: see FirstFinished
        self._row_id = 0

    def read_new_rows(self) -> None:
        files = self.run_dir.batch_files()
        self.summary.batch_files = len(files)
        for path in files:
            self._read_up_to[path] = self.read_rows(path, self._read_up_to.get(path, 0))

    def read_rows(self, path: Path, start: int) -> int:
        """Count the complete rows of one batch file from byte ``start`` on; returns where they end
        (a row still being written is read next time)."""
        position = start
        for offset, line in lines_at(path, start):
            self._add(line, path, offset)
            position = offset + len(line)
        return position

    def _add(self, line: bytes, path: Path, offset: int) -> None:
        try:
            row = rows.read_stored_row(line)
        except rows.RowError as exc:
            # A run stops on such a line; the page still shows every other row, and names this one.
            self.summary.refused_lines += 1
            if not self.summary.first_refused:
                self.summary.first_refused = f"{path.name} line {line_number(path, offset)}: {exc}"
            return
        if row is None:
            self.summary.unreadable_lines += 1
            return
        if self._first_finished.is_repeat(row):     # counted once, as resume and trajectories.jsonl count it
            self.summary.repeated_rows += 1
            return
        if self._relocated:
            row.relocate(self._relocated)
        status, facts = self.summary.add(row)
        self.sample.offer(self._row_id, categories(status, facts),
                          lambda: sampled_row(row, status, path.name))
        self._row_id += 1


def read_json(path: Path) -> dict:
    """A JSON object of the run directory (checkpoint, statistics); {} where there is none (yet), or where
    it is no regular file (not waited on, however late another program put it there: see read_whole)."""
    try:
        data = record_json(read_whole(path))
    except (OSError, ValueError, RunDirectoryError):
        return {}
    return data if isinstance(data, dict) else {}
