"""export_run: one export from start to end. The rows the filters keep (or --best_of chooses) go to the
format's writer as they are read, so memory stays bounded however many rows a run has."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from batchrun.export.best_of import BestOf, best_of_path, chosen_samples
from batchrun.export.files import alone_in
from batchrun.export.filters import selected_rows
from batchrun.export.formats import EXPORT_FORMATS
from batchrun.export.options import ExportError, ExportOptions
from batchrun.export.summary import ExportSummary
from batchrun.run_dir import CHECKPOINT, atomic_write_json, require_readable, require_regular_files
from batchrun.run_dir.relocations import RELOCATIONS


def export_run(options: ExportOptions, waiting: Callable[[Path], object] = lambda folder: None) -> ExportSummary:
    """Write the export; the summary says what was kept and what was left out, by reason. ``waiting`` is
    told when another export is writing in --out's folder, which this one waits for."""
    require_readable(options.run_dir, "--export")
    require_regular_files(options.run_dir, (CHECKPOINT, RELOCATIONS))     # what the filters read beside the rows
    _require_record_place(options.out)
    summary = ExportSummary(options)

    def counted(records: Iterable[Any]) -> Iterator[Any]:
        for record in records:
            summary.kept += 1
            yield record

    if options.best_of is None:
        candidates = selected_rows(options, summary.dropped)
    else:
        summary.best_of = BestOf(options.best_of)
        candidates = chosen_samples(options, summary.best_of, summary.dropped)
    with alone_in(options.out.parent, waiting):
        EXPORT_FORMATS[options.format].write(options, counted(candidates))
        if summary.best_of is not None:
            atomic_write_json(best_of_path(options.out), summary.best_of.as_json(), indent=2)
        else:       # a record of an earlier export's choice would describe rows this file does not hold
            best_of_path(options.out).unlink(missing_ok=True)
    return summary


def _require_record_place(out: Path) -> None:
    """The --best_of record beside ``out`` can be written or removed once the export is: a directory
    there, met only then, failed the command after the export had replaced the earlier one."""
    record = best_of_path(out)
    if record.is_dir() and not record.is_symlink():
        raise ExportError(f"{record} is a directory, where an export to {out} records its --best_of choice (or "
                          "removes an earlier one); remove it or choose another --out")
