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

It follows only the batch files that can still grow: the parent publishes, in shared memory
(:class:`OpenBatches`), the highest batch handed a prompt and each lower one with a prompt still running
or waiting, so what the helper holds and reads per round depends on the prompts in flight, not on the
length of the run, nor on how long ago the oldest of them started. The parent publishes at most every
half second while prompts run, and once more before it asks for the report, so the last read needs no
listing of the run directory either (a million files, with ``--batch_size=1``).
"""

from __future__ import annotations

import heapq
import multiprocessing
import os
import signal
import time
from collections.abc import Collection, Sequence
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

    def __init__(self, run_dir: Path, repeated: Collection[str], sessions: int) -> None:
        """``repeated``: the units whose finished rows the resume scan found more than once (none in a new
        run directory): the only ones the helper tells a first row from its repeats for, so that it holds
        nothing per prompt (see FirstFinished). ``sessions``: the run's sessions, which bound the prompts in
        flight."""
        parent_end, child_end = _FORK.Pipe(duplex=True)
        # Each worker process also holds a few tasks waiting for a session (workers.waiting_places), and a
        # Ray run's prompts of a lost actor wait for a slot: room for twice the sessions.
        self._open = OpenBatches(2 * sessions + 16)
        self._process = _FORK.Process(target=_follow,
                                      args=(child_end, run_dir, frozenset(repeated), os.getpid(), self._open),
                                      daemon=True, name="report")
        self._process.start()
        child_end.close()
        self._conn = parent_end

    def progress(self, highest: int, open_batches: Sequence[int]) -> None:
        """``highest``: the highest batch handed a prompt; ``open_batches`` (ascending): those below it with a
        prompt still running or waiting. No other batch below it gets a row in this run. Called with the
        run's last word before :meth:`rows_written` and :meth:`finish`: their reads follow what it says."""
        self._open.publish(highest, open_batches)

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


class OpenBatches:
    """The batch files the run can still append to, as the parent tells the helper, in shared memory: the
    highest batch handed a prompt, then those below it with one running or waiting, at most one per
    session. Tasks are handed out in the order of their units, so a batch below the highest that has none
    open gets no more rows in this run.

    A sequence lock: the parent makes the version odd while it writes, and the helper takes a copy only
    between two readings of one even version. More open batches than sessions (never expected) are
    published as the lowest ``capacity`` and a count below zero: every batch above them is then open."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._shared = _FORK.RawArray("q", 3 + capacity)      # version, highest, count, batches
        self._shared[1] = -1

    def publish(self, highest: int, open_batches: Sequence[int]) -> None:
        shared, listed = self._shared, open_batches[:self._capacity]
        version = shared[0]
        shared[0] = version + 1
        shared[1] = highest
        shared[2] = len(listed) if len(listed) == len(open_batches) else -len(listed)
        shared[3:3 + len(listed)] = list(listed)
        shared[0] = version + 2

    def snapshot(self) -> tuple[int, frozenset[int], int | None] | None:
        """(highest, the open batches listed, the number above which every batch is open or None); None
        where the parent has been writing for a second: it was killed in the middle."""
        shared = self._shared
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            version = shared[0]
            if version % 2 == 0:
                highest, count = shared[1], shared[2]
                listed = shared[3:3 + abs(count)]
                if shared[0] == version:
                    above = (listed[-1] if listed else -1) if count < 0 else None
                    return highest, frozenset(listed), above
            time.sleep(0.001)
        return None


class BatchFollower:
    """Reads the rows of a run directory as they are written, rereading only the batch files the
    run can still append to (see :class:`OpenBatches`): every round reads the files open at the last
    one and those handed out since, and forgets each that is no longer open once read."""

    def __init__(self, scan: report.RunScan, open_batches: OpenBatches) -> None:
        self.scan = scan
        self._directory = str(scan.run_dir.path)
        self._open = open_batches
        self._highest = -1                  # the highest batch handed out at the last round
        self._followed: set[int] = set()    # the batches open at the last round, with a file yet or not
        # Where the rows read end, per batch file followed.
        self._ends: dict[int, int] = {}
        # The same for the files of earlier invocations above the highest, until the run hands them a prompt
        # (by number: a stray file named like a batch file, batch_999999999999.jsonl, takes one entry).
        self._earlier: dict[int, int] = {}
        self._files = 0

    def read_existing(self) -> None:
        """Every row already written (once, at the start)."""
        for number in self._file_numbers():
            self._read(number)
            if number in self._ends:        # not removed meanwhile
                self._earlier[number] = self._ends.pop(number)
        self.scan.summary.batch_files = self._files

    def read_new(self) -> None:
        """The rows written since the last round: of the batches open then, those open now, and those handed
        out since. Each that is no longer open is read for the last time, and forgotten."""
        if (published := self._open.snapshot()) is None:
            return
        highest, listed, above = published
        followed = set()
        # The batches handed out since the last round are walked, never held: after a resume's first
        # jump, millions of them.
        handed_out = range(self._highest + 1, highest + 1)
        known = sorted(number for number in {*self._followed, *listed} if number not in handed_out)
        for number in heapq.merge(known, handed_out):
            self._follow(number)
            if number >= highest or number in listed or (above is not None and number > above):
                followed.add(number)
            else:
                self._ends.pop(number, None)
        self._followed, self._highest = followed, max(self._highest, highest)
        self.scan.summary.batch_files = self._files

    def _file_numbers(self) -> list[int]:
        """The numbers of the run directory's batch files, in order."""
        numbers = []
        for path in self.scan.run_dir.batch_files():
            match = BATCH_FILE.match(path.name)
            assert match is not None        # batch_files() lists only names that match
            numbers.append(int(match.group(1)))
        return numbers

    def _follow(self, number: int) -> None:
        if number in self._earlier:
            self._ends[number] = self._earlier.pop(number)
        self._read(number)

    def _read(self, number: int) -> None:
        # A plain string to stat: pathlib keeps every name it parses (interned) for the life of the process.
        name = os.path.join(self._directory, f"batch_{number}.jsonl")
        try:
            size = os.stat(name).st_size
        except FileNotFoundError:
            return
        if number not in self._ends:
            self._files += 1
        end = self._ends.get(number, 0)
        if size > end:
            end = self.scan.read_rows(Path(name), end)
        self._ends[number] = end


def _follow(conn: Connection, run_dir: Path, repeated: frozenset[str], parent_pid: int,
            open_batches: OpenBatches) -> None:
    # Ctrl-C and a closed terminal's SIGHUP reach the group, a scheduler's SIGTERM maybe too; the parent
    # decides (see stop_signals).
    for signum in stop_signals.HANDLED:
        signal.signal(signum, signal.SIG_IGN)
    try:
        plots.preload()
        scan = report.RunScan(run_dir, repeated=repeated)
        follower = BatchFollower(scan, open_batches)
        follower.read_existing()
        drawn = None
        while True:
            if not conn.poll(FOLLOW_INTERVAL_SECONDS):
                if os.getppid() != parent_pid:
                    return
                follower.read_new()
                continue
            distribution = conn.recv()     # the run's distribution once every row is written, None to finish
            follower.read_new()            # the parent published its last word before it asked
            if distribution is None:
                break
            drawn = report.draw_plots(scan.summary, distribution)
        outcome = ("done", str(report.save(scan, drawn)))     # drawn again if rows came after all
    except EOFError:
        return
    except Exception as exc:
        outcome = ("error", f"{type(exc).__name__}: {exc}")
    conn.send(outcome)
