"""The run report: ``data/<run_name>/report.html``, one self-contained page that says at a glance
whether a run's data is good — tools and their failures, reasoning, outcomes, tokens and cost,
throughput — and lets a person open trajectories and read them the way the model lived them.

It is built from the run directory alone, during a run or after it, and streams every batch file
once: the figures come from each row's few facts read by :func:`rows.read_stored_row` and counted
by summary.py (a million rows are never decoded whole), and only a bounded, stratified sample of rows
is decoded, trimmed and embedded for the trajectory browser. The page needs no network: CSS, JS, data
and the matplotlib plots (inline SVG, see plots.py) are all inside it.

One job a module: scan.py reads the run (into summary.py's RunSummary and sample.py's
TrajectorySample, each sampled row made by trajectory.py), page.py assembles the page from cards.py,
tables.py (both written with markup.py) and plots.py into template.html, and write.py writes it.
batchrun/report_follower.py, beside the package, runs the scan in a helper process while a run goes on.
"""

from batchrun.report.page import Plots, draw_plots, render
from batchrun.report.sample import QUOTAS, SAMPLE_LIMIT, TrajectorySample
from batchrun.report.scan import RunScan
from batchrun.report.tables import expected_toolset_shares
from batchrun.report.trajectory import ROW_BUDGET, sampled_row
from batchrun.report.write import REPORT_FILE, save, write_report

__all__ = ["QUOTAS", "REPORT_FILE", "ROW_BUDGET", "SAMPLE_LIMIT", "Plots", "RunScan", "TrajectorySample",
           "draw_plots", "expected_toolset_shares", "render", "sampled_row", "save", "write_report"]
