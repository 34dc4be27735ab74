"""Writing data/<run_name>/report.html: in one pass over the run (write_report, what --report and the
end of a run do), or from a scan that has followed the run (save, what the report's helper does)."""

from __future__ import annotations

from pathlib import Path

from batchrun.report.page import Plots, render
from batchrun.report.sample import SAMPLE_LIMIT
from batchrun.report.scan import RunScan
from batchrun.run_dir import replacing

REPORT_FILE = "report.html"


def write_report(run_dir: Path, sample_limit: int = SAMPLE_LIMIT) -> Path:
    """Build data/<run_name>/report.html from the run directory in one pass."""
    scan = RunScan(run_dir, sample_limit)
    scan.read_new_rows()
    return save(scan)


def save(scan: RunScan, drawn: Plots | None = None) -> Path:
    """Write the page of what ``scan`` has read; replaced atomically so an open page never sees half a file."""
    run_dir = scan.run_dir.path
    page = render(run_dir, scan.summary, scan.sample, drawn)
    target = run_dir / REPORT_FILE
    data = page.encode("utf-8")
    with replacing(target, needed=len(data), durable=False) as handle:    # a page, not a record: no fsync
        handle.write(data)
    return target
