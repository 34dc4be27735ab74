"""The end-of-run report, prepared while the run goes on, in a helper process.

Drawing the report only once the last row is in cost every run a second or more before it could
exit (importing matplotlib, then drawing), plus a read of every batch file: tens of seconds for a
million rows. The helper loads matplotlib at once and follows the batch files as the parent writes
them; once the last row is written it draws the plots while the run ends (workers stopping, the
merge), then the page. It never writes anything but the report, and it ends by itself when the
parent is gone (even after kill -9).

It runs at the run's own CPU priority: the end of the run waits for it, and a process at a lower one,
on a machine busy with other work, gets next to no CPU time (its priority cannot be raised again
without privileges).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from multiprocessing.connection import Connection
from pathlib import Path

from batchrun import report, report_plots

_FORK = multiprocessing.get_context("fork")
FOLLOW_INTERVAL_SECONDS = 2.0


class ReportFailed(Exception):
    """The helper could not write the report; the message says why."""


class ReportFollower:
    """The helper process of one run; :meth:`finish` (or :meth:`cancel`) ends it."""

    def __init__(self, run_dir: Path) -> None:
        parent_end, child_end = _FORK.Pipe(duplex=True)
        self._process = _FORK.Process(target=_follow, args=(child_end, run_dir, os.getpid()), daemon=True,
                                      name="report")
        self._process.start()
        child_end.close()
        self._conn = parent_end

    def rows_written(self, distribution: str) -> None:
        """Every row of the run is written: the helper draws the plots now, while the run ends (stops
        its workers, merges, writes the statistics the page also shows)."""
        try:
            self._conn.send(distribution)
        except OSError:
            pass    # it ended early; finish() says why

    def finish(self) -> Path:
        """The report of every row written so far, once the helper has drawn it."""
        try:
            try:
                self._conn.send(None)
            except OSError:
                pass    # it ended early; what it sent before ending is still to be read
            try:
                outcome, detail = self._conn.recv()
            except EOFError:
                raise ReportFailed(f"the report process ended unexpectedly (exit code "
                                   f"{self._end()})") from None
            if outcome == "error":
                raise ReportFailed(detail)
            return Path(detail)
        finally:
            self._end()

    def cancel(self) -> None:
        """End the helper without a report (the run stopped on an error)."""
        self._process.kill()
        self._end()

    def _end(self) -> int | None:
        self._conn.close()
        self._process.join()
        return self._process.exitcode


def _follow(conn: Connection, run_dir: Path, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C reaches the group; the parent decides
    try:
        report_plots.preload()
        scan = report.RunScan(run_dir)
        drawn = None
        while True:
            if not conn.poll(FOLLOW_INTERVAL_SECONDS):
                if os.getppid() != parent_pid:
                    return
                scan.read_new_rows()
                continue
            distribution = conn.recv()     # the run's distribution once every row is written, None to finish
            scan.read_new_rows()
            if distribution is None:
                break
            drawn = report.draw_plots(scan.summary, distribution)
        outcome = ("done", str(report.save(scan, drawn)))     # drawn again if rows came after all
    except EOFError:
        return
    except Exception as exc:
        outcome = ("error", f"{type(exc).__name__}: {exc}")
    conn.send(outcome)
