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

It follows only the batch files that can still grow: the parent publishes, in shared memory, the
lowest batch that has a prompt still running or waiting and the highest that has been handed one, so
what the helper holds and reads per round depends on the prompts in flight, not on the length of the run.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Collection, MutableSequence
from multiprocessing.connection import Connection
from pathlib import Path

from batchrun import report, stop_signals
from batchrun.report import plots
from batchrun.run_dir import BATCH_FILE

_FORK = multiprocessing.get_context("fork")
FOLLOW_INTERVAL_SECONDS = 2.0


class ReportFailed(Exception):
    """The helper could not write the report; the message says why."""


class ReportFollower:
    """The helper process of one run; :meth:`finish` (or :meth:`cancel`) ends it."""

    def __init__(self, run_dir: Path, repeated: Collection[str]) -> None:
        """``repeated``: the units whose finished rows the resume scan found more than once (none in a new
        run directory): the only ones the helper tells a first row from its repeats for, so that it holds
        nothing per prompt (see FirstFinished)."""
        parent_end, child_end = _FORK.Pipe(duplex=True)
        # [lowest batch with a prompt still open, highest batch handed a prompt]: nothing handed out yet.
        self._window = _FORK.RawArray("q", [0, -1])
        self._process = _FORK.Process(target=_follow,
                                      args=(child_end, run_dir, frozenset(repeated), os.getpid(), self._window),
                                      daemon=True, name="report")
        self._process.start()
        child_end.close()
        self._conn = parent_end

    def progress(self, lowest_open: int, highest: int) -> None:
        """Batch files below ``lowest_open`` will get no more rows in this run; none above ``highest``
        has been handed a prompt yet."""
        self._window[1] = highest       # highest first: the helper reads lowest first (see BatchFollower)
        self._window[0] = lowest_open

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


class BatchFollower:
    """Reads the rows of a run directory as they are written, rereading only the batch files the
    run can still append to (see the module's docstring): every round finishes the files that fell
    below the window and rereads those inside it."""

    def __init__(self, scan: report.RunScan, window: MutableSequence[int]) -> None:
        self.scan = scan
        self._window = window
        self._base = 0                      # below it, every file was read for the last time
        # Per batch number from _base with a file: where the rows read end. By number, not a slot for each
        # number up to the highest: a stray file named like a batch file (batch_999999999999.jsonl, copied
        # in by hand) would take memory for every number below it.
        self._ends: dict[int, int] = {}
        self._files = 0

    def read_existing(self) -> None:
        """Every row already written (once, at the start)."""
        for path in self.scan.run_dir.batch_files():
            match = BATCH_FILE.match(path.name)
            assert match is not None        # batch_files() lists only names that match
            self._read(int(match.group(1)))
        self.scan.summary.batch_files = self._files

    def read_new(self) -> None:
        """The rows written since the last round."""
        lowest = self._window[0]            # before highest: the parent writes them the other way round
        highest = self._window[1]
        if lowest > self._base:             # done in this run: read one last time, then forgotten
            for number in range(self._base, lowest):
                self._read(number)
                self._ends.pop(number, None)
            self._base = lowest
        for number in range(self._base, highest + 1):
            self._read(number)
        self.scan.summary.batch_files = self._files

    def read_all(self) -> None:
        """Every row written so far: the run's work is over, so the window no longer matters."""
        for number in sorted({*range(self._base, self._window[1] + 1), *self._ends}):
            self._read(number)
        self.scan.summary.batch_files = self._files

    def _read(self, number: int) -> None:
        path = self.scan.run_dir.path / f"batch_{number}.jsonl"
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return
        if number not in self._ends:
            self._files += 1
        end = self._ends.get(number, 0)
        if size > end:
            end = self.scan.read_rows(path, end)
        self._ends[number] = end


def _follow(conn: Connection, run_dir: Path, repeated: frozenset[str], parent_pid: int,
            window: MutableSequence[int]) -> None:
    # Ctrl-C and a closed terminal's SIGHUP reach the group, a scheduler's SIGTERM maybe too; the parent
    # decides (see stop_signals).
    for signum in stop_signals.HANDLED:
        signal.signal(signum, signal.SIG_IGN)
    try:
        plots.preload()
        scan = report.RunScan(run_dir, repeated=repeated)
        follower = BatchFollower(scan, window)
        follower.read_existing()
        drawn = None
        while True:
            if not conn.poll(FOLLOW_INTERVAL_SECONDS):
                if os.getppid() != parent_pid:
                    return
                follower.read_new()
                continue
            distribution = conn.recv()     # the run's distribution once every row is written, None to finish
            follower.read_all()
            if distribution is None:
                break
            drawn = report.draw_plots(scan.summary, distribution)
        outcome = ("done", str(report.save(scan, drawn)))     # drawn again if rows came after all
    except EOFError:
        return
    except Exception as exc:
        outcome = ("error", f"{type(exc).__name__}: {exc}")
    conn.send(outcome)
