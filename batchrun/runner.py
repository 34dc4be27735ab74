"""The run itself, once its config is known: plans the work, feeds the worker pool, persists every row as
the one writer, checkpoints, merges, writes statistics and the report, and says what happened.

One class, over 400 lines, on purpose: it is the parent process's single writer, and every step that
touches the run directory in order (plan, persist, checkpoint, stop, merge) reads the same state; split
across modules, that order would have to be re-assembled by a reader from several files.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from pathlib import Path

from batchrun import distributions, estimate, registry, report, rows
from batchrun.config import (
    RunConfig,
    provider_routing_note,
)
from batchrun.console import RunConsole, counted
from batchrun.dataset import DatasetChanged, DatasetError, DatasetPlan, iter_pending, plan_dataset
from batchrun.environments import environment_class
from batchrun.environments.base import (
    EnvironmentSettings,
    WorkRootError,
    claim_work_root,
    run_identity,
    work_root_of,
)
from batchrun.environments.limits import process_limit_note, user_process_limit
from batchrun.install_hint import program
from batchrun.messages import Fatal, Finished, Spent, Task
from batchrun.pricing import reports_cost
from batchrun.report_follower import ReportFailed, ReportFollower
from batchrun.run_dir import (
    SPENT,
    Checkpoint,
    DiskFull,
    RunDirectory,
    RunDirectoryError,
    ScanResult,
    SpentLedger,
    WriteFailed,
    size_text,
    superseded_corrupted,
)
from batchrun.stats import ThisRun, UsageTotals, add_usage, build_statistics, empty_usage
from batchrun.stop_signals import STOP_SIGNALS, Interrupted, exit_code, stopped_line
from batchrun.tools.browser.directories import remove_abandoned_browser_directories
from batchrun.workers import PoolStartError, ProcessPool, WorkerPool, process_count, raise_open_file_limit

CHECKPOINT_MIN_INTERVAL = 1.0     # seconds; coalesces checkpoint rewrites when batches are tiny
PROGRESS_INTERVAL = 0.5           # seconds between two notes to the report's helper of the batches still open
MAX_CORRUPTED_LINES_SHOWN = 20
# Sandboxes each worker process keeps started ahead of need: a prompt takes one and never waits for its
# sandbox, and the next is ready long before another prompt ends.
SPARE_SANDBOXES = 2
# Exit codes: every prompt of this invocation done / the run stopped (bad input, a run-wide endpoint
# error, the lock, a full disk, the dataset changed under it) / the run finished but some prompts failed
# (--resume retries them); a stop signal's are stop_signals.exit_code.
EXIT_OK, EXIT_ERROR, EXIT_SOME_FAILED = 0, 1, 2


def _same_file(before: str, now: Path) -> bool:
    """Whether the checkpoint's --dataset_file is the file given now under another spelling (absolute or
    relative, through a link): only another file is worth a warning."""
    try:
        return os.path.samefile(before, now)
    except OSError:     # the earlier one is gone: it is not the file given now
        return False


def _failures_retried(scan: ScanResult, plan: DatasetPlan) -> int:
    """The samples this resume runs that an earlier invocation's failure row is of: not those finished since
    (their failure row stays in its batch file), nor those past --samples_per_prompt; each once, though rows
    written for two lines (the dataset changed between them) be of it."""
    retried = set()
    for unit in scan.failed_units:
        written, key = rows.split_unit(unit)
        # Where the dataset changed, the row's prompt may be on another line now, or on none.
        index, sample = plan.relocated.get(unit, written), rows.sample_index_of(key)
        if index is not None and plan.is_pending(index, sample):
            retried.add((index, sample))
    return len(retried)


def _samples_past_k_lines(scan: ScanResult, samples_per_prompt: int) -> list[str]:
    """What a resume with a lower --samples_per_prompt than earlier invocations had says about the samples past
    it: those in trajectories.jsonl stay there, and those that failed are not run again."""
    if scan.most_samples <= samples_per_prompt:
        return []
    flag = f"--samples_per_prompt={samples_per_prompt}"
    merged = sum(count for index, count in scan.merged_by_sample.items() if index >= samples_per_prompt)
    failed = sum(1 for unit in scan.failed_units if unit not in scan.done_units
                 and rows.sample_index_of(rows.sample_key_of_unit(unit)) >= samples_per_prompt)
    lines = [f"resume: {counted(merged, 'sample')} past {flag} (up to {max(scan.merged_by_sample) + 1} per prompt) "
             "stay in trajectories.jsonl and count in its figures"] if merged else []
    if failed:
        lines.append(f"resume: {counted(failed, 'failed sample')} past {flag} {'is' if failed == 1 else 'are'} not "
                     f"run again; --samples_per_prompt={scan.most_samples} retries {'it' if failed == 1 else 'them'}")
    return lines


class BatchRunner:
    """Plans the work, feeds the worker pool, persists every row, checkpoints, merges, reports."""

    def __init__(self, config: RunConfig, console: RunConsole) -> None:
        self.config = config
        self.console = console
        self.run_dir = RunDirectory(config.output.run_dir)
        self.this_run = ThisRun()
        self.started = time.monotonic()
        self.batch_stats: Counter = Counter()     # rows per outcome, every invocation under this run name
        self.done_samples = 0                     # completed, partial or discarded, every invocation (a prompt's
                                                  # samples each count: see --samples_per_prompt)
        self.superseded_corrupted: Counter = Counter()   # see run_dir.Checkpoint
        self.spent = SpentLedger(self.run_dir.path / SPENT)
        self._earlier_rows_usage = empty_usage()  # what the rows of earlier invocations spent
        self._checkpoint_due = False
        self._last_checkpoint = 0.0
        self._total_prompts = 0
        self._per_prompt = False                  # statistics per prompt over its samples (see _run_locked)
        self._sessions_asked = 0                  # --num_workers, before it is cut to the samples to run
        # --estimate: the units of the samples it runs, their prompts' lengths until they finish, and what they used
        self._estimate_units: set[int] | None = None
        self._estimate_chars: dict[int, int] = {}
        self._estimate_runs: list[estimate.SampledRun] = []
        self._pending_samples = 0                 # of this invocation's plan
        self._report: ReportFollower | None = None     # the report's helper, while prompts run
        self._held_back: list[Finished] = []      # rows a full disk refused, tried once more at the stop
        self._row_bytes = self._rows_written = 0  # this invocation's, to tell a full disk what is needed
        # Tasks handed out whose rows are not written yet, by unit (messages.Task), in the order handed
        # out, which is the order of their units: the first is the lowest (see _publish_progress).
        self._open_units: OrderedDict[int, None] = OrderedDict()
        self._highest_unit = -1                   # of the tasks handed out
        self._progress_published = 0.0
        self._dataset_changed: DatasetChanged | None = None    # why no further prompt was admitted, if so
        # Every prompt this invocation was going to run has run: a stop signal from then on stops nothing.
        self._ran_to_the_end = False

    # -- the run --------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            return self._run()
        finally:
            STOP_SIGNALS.ended()

    def _run(self) -> int:
        raise_open_file_limit()
        try:
            self.run_dir.acquire()
        except RunDirectoryError as exc:
            self.console.error(str(exc))
            return EXIT_ERROR
        try:
            return self._run_locked()
        except WriteFailed as exc:  # a checkpoint, the merge or the statistics found no room, or a disk failing
            if self._report is not None:
                self._report.cancel()
            self.console.error(self._write_failed_message(exc))
            return EXIT_ERROR
        except RunDirectoryError as exc:    # a batch file line the resume scan or the merge cannot read
            self.console.error(str(exc))
            return EXIT_ERROR
        except FileNotFoundError as exc:
            if not self.run_dir.removed_behind(exc):
                raise
            if self._report is not None:
                self._report.cancel()
            gone = f"{self.run_dir.path} was removed" if not self.run_dir.path.is_dir() else \
                f"files of {self.run_dir.path} were removed"
            self.console.error(f"{gone} while the run was writing ({exc.filename} could not be written), and "
                               "with them the rows written so far. Run the same command again to start over, or "
                               "put the files back and add --resume.")
            return EXIT_ERROR
        finally:
            self.spent.close()
            self.run_dir.release()

    def _run_locked(self) -> int:
        config = self.config
        existing = self.run_dir.existing_results()
        if existing and not config.output.resume:
            self.console.error(f"{self.run_dir.path}/ already holds results ({', '.join(existing[:5])}"
                        f"{', ...' if len(existing) > 5 else ''}). Pass --resume to continue that run, "
                        "or choose a new --run_name to start fresh.")
            return EXIT_ERROR
        if config.output.resume:
            scan = self.run_dir.scan()
            self._continue_checkpoint()
            # From the rows themselves: the checkpoint misses those written after it, before a kill.
            self.batch_stats = Counter(scan.rows_by_status)
            self._earlier_rows_usage = scan.usage
        else:   # a run killed before its first result is started again so, and may have left these
            self.run_dir.remove_unfinished_rewrites()
            scan = ScanResult()
        self.spent.start()
        # Several samples per prompt, now or in an earlier invocation: the statistics count per prompt.
        self._per_prompt = config.samples_per_prompt > 1 or scan.most_samples > 1
        live_corrupted = sum(scan.live_corrupted(self.superseded_corrupted).values())
        done_units = scan.done(rerun_corrupted=config.output.rerun_corrupted, superseded=self.superseded_corrupted)
        if config.output.rerun_corrupted:    # every corrupted row so far is replaced by the attempt about to run
            self.superseded_corrupted = scan.corrupted_by_key
        try:
            plan = plan_dataset(config.dataset_file, max_samples=config.max_samples, done_units=done_units,
                                warn=self.console.warn, samples_per_prompt=config.samples_per_prompt,
                                other_units=scan.other_units)
        except DatasetError as exc:
            self.console.error(str(exc))
            return EXIT_ERROR
        if config.output.resume:
            self.run_dir.write_relocations(plan.relocated)
        self.done_samples = plan.already_done
        self._total_prompts = plan.total
        self._total_samples = plan.units
        self._pending_samples = plan.pending
        self._sessions_asked = config.pool.num_workers
        if config.estimate is not None:     # only a sample of what is pending runs
            self.run_dir.forget_estimate()
            chosen = estimate.chosen_units(plan.pending_units_in_dataset_order(), config.estimate,
                                            random.Random(config.seed))
            self._estimate_units, self._pending_samples = chosen, len(chosen)
        if self._pending_samples:     # never more sessions (nor worker processes) than prompts to run
            pool = dataclasses.replace(config.pool, num_workers=min(config.pool.num_workers, self._pending_samples))
            self.config = config = dataclasses.replace(config, pool=pool)
        self._print_startup(plan, scan, live_corrupted)
        if config.output.rerun_corrupted:     # the report follows the batch files from the start: it must know now
            self._write_checkpoint()
        if plan.pending == 0:
            self.console.print("All prompts have already been processed!", style="bold green")
            if config.estimate is not None:
                self.console.print("--estimate: nothing left to estimate; every sample of the run has its row.")
            self._remove_leftovers()
            with STOP_SIGNALS.shielded():     # the merge is not cut short
                self._write_checkpoint()
                self._finish(plan)
                self._say_if_a_stop_signal_came()
            return EXIT_OK
        if self._budget_spent():     # earlier invocations reached a cap: no prompt may start, no pool to start
            self._remove_leftovers()
            self._ran_to_the_end = True
            with STOP_SIGNALS.shielded():
                return self._conclude(plan)
        return self._execute(plan)

    def _say_if_a_stop_signal_came(self) -> None:
        """Every prompt has run, and the merge and the report are done: a stop signal received meanwhile had
        nothing to stop, and is answered here rather than raised."""
        if STOP_SIGNALS.take() is not None:
            self.console.print("A stop signal came once every prompt had run: it had nothing left to stop, and the "
                               "merge and the report were finished.", style="yellow")

    def _remove_leftovers(self) -> None:
        """What a crashed earlier run under this run's label left (its sandboxes' directories, containers,
        control groups) goes even when no prompt runs now: a pool's start is where it goes otherwise."""
        with STOP_SIGNALS.interruptible():
            self._environment_settings()

    def _execute(self, plan: DatasetPlan) -> int:
        # Shielded from here to the end: a stop signal interrupts only the start (an earlier run's leftovers
        # removed, the pool started) and the scheduling loop; the stop, the merge and the report always run
        # to their end (see stop_signals).
        with STOP_SIGNALS.shielded():
            available = frozenset(registry.TOOL_NAMES) - set(registry.unavailable_tools())
            self._report = follower = ReportFollower(self.run_dir.path, self.run_dir.repeats,
                                                     self.config.pool.num_workers)
            try:
                with STOP_SIGNALS.interruptible():
                    env_settings = self._environment_settings(claimed=True)    # refused here, not per prompt
                    pool = self._start_pool(env_settings, available)
            except (PoolStartError, WorkRootError) as exc:
                follower.cancel()
                self.console.error(str(exc))
                return EXIT_ERROR
            except Interrupted:
                follower.cancel()
                raise
            return self._run_pool(plan, pool, env_settings, follower)

    def _run_pool(self, plan: DatasetPlan, pool: WorkerPool, env_settings: EnvironmentSettings,
                  follower: ReportFollower) -> int:
        """The scheduling loop, then the stop, then the end of the run; its exit code."""
        # Out of what this invocation will have done: under --estimate only its sample runs, and a total
        # of the whole dataset would project the live line's ETA and cost for samples it never starts.
        self.console.start_progress(plan.already_done + self._pending_samples, plan.already_done, self.this_run,
                                    samples=plan.samples_per_prompt > 1)
        fatal, write_failed = None, None
        try:
            with STOP_SIGNALS.interruptible():
                fatal = self._feed(pool, self._planned_tasks(plan))
            self._ran_to_the_end = fatal is None and self._dataset_changed is None
            if fatal is None:       # every row is written: the report's plots are drawn while the run ends
                self._publish_progress(last=True)
                follower.rows_written(self.config.distribution)
        except Interrupted:
            pass                    # the stop below keeps what finished meanwhile
        except WriteFailed as exc:
            write_failed = exc
        finally:
            self.console.stop_progress()
            write_failed = self._stop(pool, env_settings) or write_failed
        if write_failed is not None:
            follower.cancel()
            self.console.error(self._write_failed_message(write_failed))
            return EXIT_ERROR
        if fatal is not None:
            follower.cancel()
            self.console.error(f"{fatal.message}\nThe run stopped; finished prompts are saved. Fix the problem and "
                        "continue with --resume.")
            return EXIT_ERROR
        if self._dataset_changed is not None and STOP_SIGNALS.received is None:
            follower.cancel()
            self.console.error(self._dataset_changed_message())
            return EXIT_ERROR
        return self._conclude(plan)

    def _conclude(self, plan: DatasetPlan) -> int:
        """Merge, write the statistics and the report, say how the run ended; its exit code. A stop
        signal that comes from here on stops nothing: the workers are done."""
        received = STOP_SIGNALS.take()
        # One that came once every prompt had run (while the workers stopped) stopped nothing either: the run
        # said "Interrupted ... --resume to continue", with nothing to continue.
        stopped_by = None if self._ran_to_the_end else received
        if stopped_by is not None:
            self.console.print(stopped_line(stopped_by), style="yellow")
        self._finish(plan, interrupted=stopped_by is not None)
        if stopped_by is None:
            self._say_if_a_stop_signal_came()
        if self._estimate_units is not None and stopped_by is None and self._estimate_runs:
            self._report_estimate(plan)
        # Of this invocation's own: under --estimate that is its sample, not every pending prompt.
        if (cap := self._budget_spent()) and (left := self._pending_samples - self.this_run.processed) > 0:
            self.console.print(f"Stopped admitting prompts: {cap}. {counted(left, self._unit)} "
                               f"{'was' if left == 1 else 'were'} not started.", style="yellow")
        if self._every_row_discarded():
            self.console.print(f"Every row of this run was discarded: no assistant turn had reasoning. "
                               f"--discard_no_reasoning=False keeps such rows (the batch files hold them: "
                               f"{program()} --export=sharegpt --run_name={self.config.output.run_name} "
                               f"--discard_no_reasoning=False exports them).", style="yellow")
        if stopped_by is not None:
            return exit_code(stopped_by)
        if failed := self.this_run.statuses[rows.FAILED]:
            self.console.print(f"{counted(failed, 'prompt')} failed (see failures by cause "
                               "above); run the same command with --resume to retry them.", style="yellow")
            return EXIT_SOME_FAILED
        return EXIT_OK

    def _every_row_discarded(self) -> bool:
        """This invocation wrote rows, and the no-reasoning filter discarded every one it did not fail."""
        statuses = self.this_run.statuses
        return statuses[rows.DISCARDED] > 0 and statuses[rows.COMPLETED] + statuses[rows.PARTIAL] == 0

    def _start_pool(self, env_settings: EnvironmentSettings, available: frozenset[str]) -> WorkerPool:
        pool: WorkerPool
        if self.config.pool.backend == "ray":
            from batchrun.ray.pool import RayWorkerPool  # Ray is imported only when a run asks for it

            pool = RayWorkerPool(self.config, env_settings, available)
        else:
            pool = ProcessPool(self.config, env_settings, available)
        if where := pool.describe():
            self.console.print(where)
        return pool

    def _feed(self, pool: WorkerPool, tasks: Iterator[Task]) -> Fatal | None:
        """The scheduling loop: one task per free slot, every finished row persisted at once."""
        exhausted = False
        left = self._pending_samples
        if self.config.max_cost is not None or self.config.max_total_tokens is not None:
            # Under a cap a task goes only to a free session: one handed to a worker to wait behind a running
            # session would start there once that ends, when the cap may have been reached meanwhile.
            pool.last_round()
        while True:
            while not exhausted and pool.free_slots:
                task = None if self._budget_spent() else self._next_task(tasks)
                if task is None:
                    exhausted = True
                else:
                    pool.submit(task)
                    self._open_units[task.unit] = None
                    self._highest_unit = task.unit
                    left -= 1
                    if left == self.config.pool.num_workers - 1:
                        pool.last_round()
            if pool.in_flight == 0:
                return None
            # A stop signal may interrupt the wait for rows (and the handing out of tasks above), never what
            # follows it: one that comes once rows are received is raised after they are written (a row
            # dropped there was paid for again by the resume).
            with STOP_SIGNALS.shielded():
                messages = pool.receive(timeout=1.0)
                self.this_run.concurrency = pool.concurrency
                # Every row that arrived is kept, also those that came with a run-wide failure.
                self._persist([message for message in messages if isinstance(message, Finished)],
                              [message for message in messages if isinstance(message, Spent)])
                self._publish_progress()    # a stop in the middle would leave the helper's copy unreadable
            if fatal := next((message for message in messages if isinstance(message, Fatal)), None):
                return fatal
            self._maybe_checkpoint()
            self.console.tick()

    def _next_task(self, tasks: Iterator[Task]) -> Task | None:
        """The next task, or None: none is left, or the dataset changed under the run. Then no further
        prompt starts, and those running finish: each was read before the change, and checked."""
        try:
            return next(tasks, None)
        except DatasetChanged as exc:
            self._dataset_changed = exc
            return None

    def _dataset_changed_message(self) -> str:
        left = self._pending_samples - self.this_run.processed
        return (f"{self._dataset_changed}. The run stopped admitting prompts ({counted(left, self._unit)} not "
                "started); every row written is kept. Run the same command with --resume once the dataset file "
                "no longer changes.")

    @property
    def _unit(self) -> str:
        """What the run counts: a prompt, or a sample of one when each runs several times."""
        return "sample" if self.config.samples_per_prompt > 1 else "prompt"

    def _publish_progress(self, *, last: bool = False) -> None:
        """Tell the report's helper which batch files can still grow (ReportFollower.progress), at most every
        PROGRESS_INTERVAL while prompts run (it reads them every FOLLOW_INTERVAL_SECONDS), and always as the
        ``last`` word before the helper's final reads, which follow only what this says."""
        now = time.monotonic()
        if self._report is None or (not last and now - self._progress_published < PROGRESS_INTERVAL):
            return
        self._progress_published = now
        batch_size = self.config.output.batch_size
        open_batches: dict[int, None] = {}      # _open_units is in the order of the units: so are these
        for unit in self._open_units:
            open_batches[unit // batch_size] = None
        self._report.progress(self._highest_unit // batch_size, list(open_batches))

    def _persist(self, finished: list[Finished], spent: list[Spent]) -> None:
        """Append rows to their batch files and make them durable before they count as done: one
        write and one fdatasync per batch file, one sync of the directory for the files created (a
        group commit). The replies' usage and the rows about to be appended go to the spent ledger
        first (see SpentLedger). When the disk is full, the rows not written are held back for one more
        try at the stop (see _stop), and WriteFailed goes up."""
        with STOP_SIGNALS.shielded():     # a group commit is not cut short: it is written and counted whole
            self._persist_group(finished, spent)

    def _persist_group(self, finished: list[Finished], spent: list[Spent]) -> None:
        for event in spent:
            self.this_run.replies.count(event.usage, event.cost_source)
        by_batch: dict[int, list[Finished]] = {}
        for message in finished:
            by_batch.setdefault(message.batch_num, []).append(message)
        groups = list(by_batch.values())
        places = [self.run_dir.row_places(messages[0].batch_num, messages) for messages in groups]
        written = 0
        try:
            self.spent.record(spent, [place for group in places for place in group])
            for messages in groups:
                data = b"".join(message.row for message in messages)
                self.run_dir.append(messages[0].batch_num, data)
                self._row_bytes += len(data)
                written += 1
        except WriteFailed:
            self._held_back = [message for messages in groups[written:] for message in messages]
            raise
        finally:
            self.run_dir.sync_names()
            kept = [message for messages in groups[:written] for message in messages]
            self._rows_written += len(kept)
            for message in kept:
                self._record(message)
            self.spent.landed([place for group in places[:written] for place in group])

    def _stop(self, pool: WorkerPool, env_settings: EnvironmentSettings) -> WriteFailed | None:
        """End the workers (their sessions stop, their environments close) and keep the rows that
        finished meanwhile, with those a full disk held back: the sandboxes that are gone by then may
        have made room. The environments' leftovers are removed whatever happens."""
        held_back, self._held_back = self._held_back, []
        try:
            stopped = pool.stop()
            self.this_run.concurrency = pool.concurrency
            self._persist([*held_back, *(message for message in stopped if isinstance(message, Finished))],
                          [message for message in stopped if isinstance(message, Spent)])
            self._write_checkpoint()
        except WriteFailed as exc:
            return exc
        finally:
            self._remove_tool_leftovers(env_settings)
        return None

    def _write_failed_message(self, exc: WriteFailed) -> str:
        """What failed (for a full disk, what it needs), what was kept and what to do, as one message."""
        lines = [f"{exc}.", "The run stopped; every row written before is kept."]
        if lost := len(self._held_back):
            lines.append(f"{counted(lost, 'finished prompt')} could not be written; --resume runs "
                         f"{'them' if lost != 1 else 'it'} again.")
        left = self._pending_samples - self.this_run.processed
        rows_known = self._rows_written + lost
        if isinstance(exc, DiskFull) and not exc.out_of_files and left > 0 and rows_known:
            per_row = (self._row_bytes + sum(len(message.row) for message in self._held_back)) // rows_known
            lines.append(f"Finishing the run needs roughly {size_text(2 * left * per_row)} more: "
                         f"{counted(left, self._unit)} left at about {size_text(per_row)} a row, each written to its "
                         "batch file and again to trajectories.jsonl.")
        lines.append(f"{exc.remedy}, then run the same command with --resume.")
        return " ".join(lines)

    def _run_spend(self) -> UsageTotals:
        """What the whole run has spent, every invocation: rows, and sessions cut off or still running."""
        usage = self._earlier_rows_usage.copy()
        add_usage(usage, self.this_run.usage)
        add_usage(usage, self.spent.unfinished())
        return usage

    def _budget_spent(self) -> str | None:
        """Why no further prompt may start (--max_cost / --max_total_tokens reached by the whole run, or
        a cap past knowing), if so."""
        usage, config = self._run_spend(), self.config
        higher = (" (the cap counts the whole run, earlier invocations included: --resume with a higher cap "
                  "continues them)")
        replies = self.spent.replies        # every invocation's: what earlier ones could not count still is not
        if config.max_cost is not None and (unknown := replies.unpriced):
            # What those replies cost is not in the sum: going on could spend any amount past the cap.
            if earlier := unknown - self.this_run.replies.unpriced:
                return (f"--max_cost cannot be held: the cost of {counted(unknown, 'reply', 'replies')} is unknown "
                        f"({counted(earlier, 'reply', 'replies')} of earlier invocations, which no price priced then: "
                        "a price given now prices only the replies to come); run on without --max_cost, or under "
                        "a new --run_name")
            return (f"--max_cost cannot be held: the cost of {counted(unknown, 'reply', 'replies')} is unknown "
                    "(the endpoint reported no usage or cost for it, or none that could be read, and no price "
                    "applies)")
        if config.max_cost is not None and usage["cost"] >= config.max_cost:
            return f"spending cap reached: ${usage['cost']:.4f} of --max_cost=${config.max_cost:g}{higher}"
        if config.max_total_tokens is not None and (tokenless := replies.tokenless):
            return (f"--max_total_tokens cannot be held: {counted(tokenless, 'reply', 'replies')} counted no tokens "
                    "(the endpoint reported no usage for it, or none that could be read)")
        tokens = usage["prompt_tokens"] + usage["completion_tokens"]
        if config.max_total_tokens is not None and tokens >= config.max_total_tokens:
            return f"token cap reached: {tokens:,} of --max_total_tokens={config.max_total_tokens:,}{higher}"
        return None

    def _record(self, finished: Finished) -> None:
        self._open_units.pop(finished.unit, None)
        self.this_run.record(finished.status, finished.usage, finished.api_calls, finished.error_type)
        self.batch_stats[finished.status] += 1
        if finished.status != rows.FAILED:
            self.done_samples += 1
        if self._estimate_units is not None:
            self._estimate_runs.append(estimate.SampledRun(
                prompt_chars=self._estimate_chars.pop(finished.unit, 0),
                tokens=finished.usage["prompt_tokens"] + finished.usage["completion_tokens"],
                cost=finished.usage["cost"], model_calls=finished.api_calls,
                tool_calls=sum(count for _name, count, _failed in finished.tool_calls), wall_time=finished.wall_time,
                failed=finished.status == rows.FAILED))
        if self.this_run.processed % self.config.output.batch_size == 0:
            self._checkpoint_due = True
        self.console.prompt_finished(finished)

    def _planned_tasks(self, plan: DatasetPlan) -> Iterator[Task]:
        """Dataset records -> tasks with their sampled toolsets (reproducible per prompt with --seed)."""
        for record in iter_pending(plan, only=self._estimate_units):
            unit = plan.unit(record.prompt_index, record.sample_index)
            if self._estimate_units is not None:
                self._estimate_chars[unit] = len(record.prompt)
            # A prompt's first sample draws as a run of one sample per prompt does, so --seed gives it the
            # same toolsets whatever --samples_per_prompt is.
            draw = f"{record.key}:{record.occurrence}" + (f":{record.sample_index}" if record.sample_index else "")
            rng = distributions.rng_for_prompt(self.config.seed, draw)
            yield Task(prompt_index=record.prompt_index, prompt=record.prompt, image=record.image, cwd=record.cwd,
                       content_key=record.key,
                       toolsets=tuple(distributions.sample_toolsets(self.config.distribution, rng)),
                       sample_index=record.sample_index, unit=unit)

    def _environment_settings(self, *, claimed: bool = False) -> EnvironmentSettings:
        """The settings of this run's environments, once what a crashed earlier run under the same label
        left has been removed; ``claimed``: once the work root is found the runner's alone, before anything
        in it is removed (WorkRootError), where prompts are to run."""
        environment = self.config.environment
        identity = run_identity(self.config.output.run_dir)
        settings = EnvironmentSettings(work_root=work_root_of(identity),
                                       run_label=identity, command_timeout=environment.command_timeout,
                                       keep_workdirs=environment.keep_workdirs, default_image=environment.default_image,
                                       allow_network=environment.allow_network, limits=environment.limits,
                                       spare_sandboxes=SPARE_SANDBOXES)
        if claimed:
            claim_work_root(settings.work_root)
        self._remove_tool_leftovers(settings)
        return settings

    def _remove_tool_leftovers(self, settings: EnvironmentSettings) -> None:
        """What killed workers left on this machine: their environments' under this run's label, and the
        browser directories of any run's workers that are gone."""
        environment_class(self.config.environment.kind).remove_leftovers(settings)
        remove_abandoned_browser_directories()

    # -- persistence and reporting --------------------------------------------------------------

    def _maybe_checkpoint(self) -> None:
        if self._checkpoint_due and time.monotonic() - self._last_checkpoint >= CHECKPOINT_MIN_INTERVAL:
            self._write_checkpoint()

    def _write_checkpoint(self) -> None:
        config = self.config
        self.run_dir.write_checkpoint(Checkpoint(
            run_name=config.output.run_name, dataset_file=str(config.dataset_file), distribution=config.distribution,
            model=config.endpoint.model, batch_size=config.output.batch_size, total_prompts=self._total_prompts,
            completed_samples=self.done_samples, batch_stats=self.batch_stats,
            samples_per_prompt=config.samples_per_prompt, total_samples=self._total_samples,
            superseded_corrupted=self.superseded_corrupted))
        self._checkpoint_due = False
        self._last_checkpoint = time.monotonic()

    def _continue_checkpoint(self) -> None:
        """On resume: keep the corrupted rows superseded so far; warn about changed arguments."""
        previous = self.run_dir.read_checkpoint() or {}
        self.superseded_corrupted = superseded_corrupted(previous)
        config = self.config
        for key, value in (("model", config.endpoint.model), ("distribution", config.distribution),
                           ("dataset_file", config.dataset_file)):
            before, now = previous.get(key), str(value)
            if before is not None and str(before) != now and not (key == "dataset_file" and
                                                                  _same_file(str(before), config.dataset_file)):
                # The checkpoint holds the last invocation's arguments, not the first's.
                self.console.warn(f"resuming with --{key}={now}, but this run's last invocation used {before}")

    def _finish(self, plan: DatasetPlan, *, interrupted: bool = False) -> None:
        found: set[tuple[str, int, str]] = set()      # corrupted rows this merge read for the first time

        def on_corrupted(batch_file: str, prompt_index: int, invented: list[str], key: str) -> None:
            found.add((batch_file, prompt_index, key))

        merge = self.run_dir.merge(on_corrupted, per_prompt=self._per_prompt)
        # Only the live ones: a row a --rerun_corrupted resume replaced is an earlier attempt.
        new = [row for row in merge.live_corrupted(self.superseded_corrupted)
               if (row.batch_file, row.prompt_index, row.key) in found]
        for row in new[:MAX_CORRUPTED_LINES_SHOWN]:
            self.console.print(f"⚠️  left out of trajectories.jsonl: {row.batch_file} prompt {row.prompt_index} "
                               f"calls invented tool(s) {', '.join(row.invented)}")
        if len(new) > MAX_CORRUPTED_LINES_SHOWN:
            self.console.print(f"... and {len(new) - MAX_CORRUPTED_LINES_SHOWN} more corrupted rows")
        statistics = build_statistics(run_name=self.config.output.run_name, distribution=self.config.distribution,
                                      model=self.config.endpoint.model, batch_size=self.config.output.batch_size,
                                      total_prompts=plan.total, skipped_dataset_lines=plan.skipped_lines,
                                      duration=time.monotonic() - self.started, merge=merge, this_run=self.this_run,
                                      superseded_corrupted=self.superseded_corrupted,
                                      unfinished=self.spent.unfinished(),
                                      unfinished_this_run=self.spent.unfinished_this_invocation(),
                                      replies=self.spent.replies,
                                      samples_per_prompt=self.config.samples_per_prompt,
                                      pricing=self.config.endpoint.pricing.as_dict())
        self.run_dir.write_statistics(statistics)
        self.console.summary(statistics, merge.batch_files, interrupted=interrupted)
        self._write_report()

    def _write_report(self) -> None:
        """The HTML run report is a convenience: a failure to draw it must never fail the run."""
        try:
            if self._report is None:
                path = report.write_report(self.run_dir.path)
            else:
                self._publish_progress(last=True)
                path = self._report.finish()
        except ReportFailed as exc:
            self._report_not_written(str(exc))
            return
        except Exception as exc:
            self._report_not_written(f"{type(exc).__name__}: {exc}")
            return
        self.console.print(f"Report: {path}")

    def _report_not_written(self, reason: str) -> None:
        self.console.warn(f"the run report was not written ({reason}); "
                          f"{program()} --report --run_name={self.config.output.run_name} retries it")

    def _report_estimate(self, plan: DatasetPlan) -> None:
        """Project the rest of the run from the samples --estimate ran; print it and write estimate.json."""
        runs = self._estimate_runs
        # A failed sample is still pending: --resume runs it again.
        done = [run for run in runs if not run.failed]
        done_chars = sum(run.prompt_chars for run in done)
        spent = self._run_spend()
        projection = estimate.estimate_report(
            runs, remaining=plan.pending - len(done), remaining_chars=max(plan.pending_chars - done_chars, 0),
            sessions=self._sessions_asked, requests_per_minute=self.config.pool.requests_per_minute,
            concurrency=self.this_run.concurrency, tokenless_replies=self.this_run.replies.tokenless,
            unpriced_replies=self.this_run.replies.unpriced,
            spent_tokens=spent["prompt_tokens"] + spent["completion_tokens"], spent_cost=spent["cost"],
            rng=random.Random(self.config.seed))
        self.run_dir.write_estimate(projection)
        for line in estimate.report_lines(projection):
            self.console.print(line)
        if projection["remaining"]["samples"]:
            advice = ("The whole run: the same command with --resume and without --estimate (the samples above "
                      "that did not fail are not run again).")
        else:
            advice = "The sample was the whole run: every sample of it has its row."
        self.console.print(f"Written to {self.run_dir.path}/estimate.json. {advice}", style="bold")

    def _print_pricing(self) -> None:
        """How replies will be priced, said once: by the endpoint, by a price, or not at all."""
        config = self.config
        pricing = config.endpoint.pricing
        if reports_cost(config.endpoint.base_url):
            self.console.print("cost: as the endpoint reports it with each reply")
        elif pricing.source == "unknown":
            # Said, not warned: many such endpoints do report a cost, which the first reply shows.
            self.console.print(f"cost: as the endpoint reports it, else unknown: {pricing.description} "
                               "(--price_per_mtok=INPUT,OUTPUT[,CACHED], USD per million tokens, gives one)")
        else:
            self.console.print(f"cost: as the endpoint reports it, else by {pricing.description}")

    def _print_startup(self, plan: DatasetPlan, scan: ScanResult, live_corrupted: int) -> None:
        config, out = self.config, self.console
        processes = process_count(config.pool.num_workers)
        out.print(f"batch_runner · run {config.output.run_name} · model {config.endpoint.model} · "
                  f"endpoint {config.endpoint.base_url} "
                  f"(request time-out {config.endpoint.request_timeout:g}s)")
        out.print(f"distribution {config.distribution} · {config.pool.num_workers} concurrent sessions in "
                  + ("Ray actors" if config.pool.backend == "ray" else
                     f"{processes} worker process{'es' if processes > 1 else ''}"))
        out.print(f"environment {config.environment.kind} ({config.environment.reason})"
                  + (" · network allowed" if config.environment.allow_network else ""))
        self._print_pricing()
        backend = environment_class(config.environment.kind)
        if plan.pending_with_image and not backend.runs_images:
            out.warn(f"{plan.pending_with_image} prompt{'s name' if plan.pending_with_image > 1 else ' names'} "
                     f"a container image, which TERMINAL_ENV={config.environment.kind} does not use: their "
                     "commands run without it. TERMINAL_ENV=docker (or singularity) runs each in its image.")
        if held := backend.limits_line(config.environment.limits):
            out.print(f"limits per prompt: {held}")
        # A Ray run's sessions count against each node's own limit: its pool warns of a node once they are placed.
        if backend.shares_user_process_limit and config.pool.backend != "ray" and (
                note := process_limit_note(config.pool.num_workers, config.environment.limits.processes,
                                           user_process_limit())):
            out.warn(note)
        for line in registry.unavailable_lines(registry.unavailable_tools()):
            out.print(f"unavailable: {line}")
        if routing := provider_routing_note(config.endpoint):
            out.warn(routing)
        if config.endpoint.reasoning_disabled and config.output.discard_no_reasoning:
            out.warn("--reasoning_disabled: the no-reasoning filter will discard every sample. "
                     "Add --discard_no_reasoning=False to keep them.")
        samples = f" × {plan.samples_per_prompt} samples" if plan.samples_per_prompt > 1 else ""
        if config.output.resume:
            retried = _failures_retried(scan, plan)
            out.print(f"resume: {plan.total} prompts in the dataset{samples}, {plan.already_done} "
                      f"{'samples ' if samples else ''}already done, {plan.pending} remaining"
                      + (f" ({retried} of them failed before)" if retried else ""))
            for line in _samples_past_k_lines(scan, plan.samples_per_prompt):
                out.print(line)
            if live_corrupted:
                out.print(f"resume: {live_corrupted} corrupted rows (invented tool names) "
                          + ("are run again (--rerun_corrupted)" if config.output.rerun_corrupted
                             else "count as done; --rerun_corrupted runs them again"))
        else:
            out.print(f"{plan.total} prompts{samples} · batch size {config.output.batch_size} · "
                      f"output {self.run_dir.path}/")
