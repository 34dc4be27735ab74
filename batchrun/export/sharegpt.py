"""--export=sharegpt: the rows as the merge writes them (trajectories.jsonl), filtered again."""

from __future__ import annotations

from collections.abc import Iterable

from batchrun.export.conversations import Candidate
from batchrun.export.files import write_files, write_lines
from batchrun.export.options import ExportOptions


def write_sharegpt(options: ExportOptions, candidates: Iterable[Candidate]) -> None:
    write_files([options.out], lambda temps: write_lines(temps, ((line.sharegpt_line(),) for line in candidates)))
