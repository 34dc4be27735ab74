"""What the user sees: live progress over prompts on a terminal, plain lines elsewhere,
and the end-of-run summary. Every line passes through the redactor first."""

from __future__ import annotations

import sys
import time
from typing import Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from batchrun import rows
from batchrun.messages import Finished
from batchrun.stats import ThisRun

STATUS_MARK = {rows.COMPLETED: "✅", rows.PARTIAL: "⚠️ ", rows.FAILED: "❌", rows.DISCARDED: "🚫"}
PLAIN_STATUS_EVERY = 30.0     # seconds between progress lines when output is a log file


def _one_line(text: str) -> str:
    return " ".join(text.split())


class RunConsole:
    def __init__(self, redact: Callable[[str], str], *, verbose: bool) -> None:
        self.redact = redact
        self.verbose = verbose
        self.out = Console(file=sys.stdout, soft_wrap=True, highlight=False)
        self.err = Console(file=sys.stderr, soft_wrap=True, highlight=False)
        self.interactive = self.out.is_terminal
        self._progress: Progress | None = None
        self._task_id = None
        self._total = 0
        self._done = 0
        self._started = 0.0
        self._last_status_line = 0.0
        self._this_run: ThisRun | None = None

    # -- plain output -----------------------------------------------------------------------------

    def print(self, text: str = "", style: str | None = None) -> None:
        if not self.interactive:   # a log file: plain text, and no rendering cost per line
            sys.stdout.write(self.redact(text) + "\n")
            return
        target = self._progress.console if self._progress else self.out
        target.print(escape(self.redact(text)), style=style)

    def warn(self, text: str) -> None:
        self.err.print(escape(self.redact(f"warning: {text}")), style="yellow")

    def error(self, text: str) -> None:
        """One clear ``error:`` line (or block) on stderr; the caller then exits 1."""
        text = text if text.startswith("error:") else f"error: {text}"
        self.err.print(self.redact(text), style="bold red", markup=False)

    # -- progress -------------------------------------------------------------------------------

    def start_progress(self, total: int, already_done: int, this_run: ThisRun) -> None:
        self._total, self._done, self._this_run = total, already_done, this_run
        self._started = self._last_status_line = time.monotonic()
        if not self.interactive:
            return
        self._progress = Progress(TextColumn("[bold]prompts"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                  TimeRemainingColumn(), TextColumn("{task.fields[counts]}"),
                                  console=self.out, refresh_per_second=4)
        self._task_id = self._progress.add_task("run", total=total, completed=already_done,
                                                rate="", counts=self._counts_text())
        self._progress.start()

    def _counts_text(self) -> str:
        run = self._this_run
        if run is None:
            return ""
        s = run.statuses
        tokens = run.usage["prompt_tokens"] + run.usage["completion_tokens"]
        return (f"✅ {s[rows.COMPLETED]} ⚠️ {s[rows.PARTIAL]} ❌ {s[rows.FAILED]} 🚫 {s[rows.DISCARDED]}"
                f" · {tokens:,} tok · ${run.usage['cost']:.4f}")

    def _rate(self) -> float:
        elapsed = time.monotonic() - self._started
        processed = self._this_run.processed if self._this_run else 0
        return processed / elapsed if elapsed > 0 else 0.0

    def prompt_finished(self, finished: Finished) -> None:
        self._done += 1
        detail = f"{finished.api_calls} calls · {finished.wall_time:.1f}s"
        if finished.status == rows.FAILED:
            error = finished.error or ""
            error = error if self.verbose else _one_line(error)[:200]
            detail = f"failed ({finished.error_type}: {error}) — will retry on resume"
        elif finished.status == rows.DISCARDED:
            detail += " · discarded: no reasoning"
        elif finished.status == rows.PARTIAL:
            detail += f" · partial: {finished.end_reason}"
        self.print(f"{STATUS_MARK[finished.status]} [{self._done}/{self._total}] prompt {finished.prompt_index} · "
                   f"{detail} · {_one_line(finished.prompt_preview)}")
        if self.verbose:
            usage = finished.usage
            tools = ", ".join(f"{name}×{count}" for name, count in finished.tool_calls) or "none"
            self.print(f"    toolsets {', '.join(finished.toolsets)} · tools used: {tools} · "
                       f"tokens {usage['prompt_tokens']:,}+{usage['completion_tokens']:,} · ${usage['cost']:.4f} · "
                       f"batch {finished.batch_num} · end {finished.end_reason}")
        if self._progress is not None:
            self._progress.update(self._task_id, completed=self._done, rate=f"{self._rate():.2f}/s",
                                  counts=self._counts_text())
        elif time.monotonic() - self._last_status_line >= PLAIN_STATUS_EVERY:
            self.status_line()

    def status_line(self) -> None:
        self._last_status_line = time.monotonic()
        rate = self._rate()
        remaining = self._total - self._done
        eta = f"{remaining / rate:.0f}s" if rate > 0 else "?"
        self.print(f"progress: {self._done}/{self._total} prompts · {rate:.2f}/s · ETA {eta} · {self._counts_text()}")

    def stop_progress(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    # -- summary --------------------------------------------------------------------------------

    def summary(self, statistics: dict, merged_batch_files: int) -> None:
        run = statistics["this_run"]
        self.print()
        self.print("=" * 60)
        self.print("BATCH PROCESSING COMPLETE", style="bold green")
        self.print("=" * 60)
        self.print(f"Prompts processed (this run): {run['prompts_processed']} "
                   f"(✅ {run['completed']} completed, ⚠️ {run['partial']} partial, "
                   f"❌ {run['failed']} failed, 🚫 {run['discarded_no_reasoning']} discarded)")
        self.print(f"Trajectories in merged file:  {statistics['trajectories_in_merged_file']}")
        self.print(f"Batch files merged:           {merged_batch_files}")
        self.print(f"Duration:                     {statistics['duration_seconds']:.1f}s")

        table = Table(title="Tool usage")
        for column in ("tool", "count", "success", "failure", "success rate"):
            table.add_column(column, justify="left" if column == "tool" else "right")
        used = [(n, e) for n, e in statistics["tool_statistics"].items() if e["count"]]
        for name, entry in sorted(used, key=lambda item: -item[1]["count"]):
            table.add_row(name, str(entry["count"]), str(entry["success"]), str(entry["failure"]),
                          f"{entry['success_rate']:.1f}%")
        if used:
            self.out.print(table)
        else:
            self.print("Tool usage: no tool calls in the merged file")

        reasoning = statistics["reasoning_statistics"]
        self.print(f"Reasoning coverage: {reasoning['turns_with_reasoning']} of {reasoning['total_assistant_turns']} "
                   f"assistant turns ({reasoning['coverage_percent']:.1f}%), "
                   f"{reasoning['turns_without_reasoning']} without")
        self.print(f"Samples discarded (no reasoning): {statistics['discarded_no_reasoning']}")
        if statistics["filtered_corrupted"]:
            self.print(f"Left out of the merged file as corrupted (invented tool names): "
                       f"{statistics['filtered_corrupted']} — kept in the batch files; "
                       "--resume --rerun_corrupted runs them again")
        if statistics["failed_prompts"]:
            causes = ", ".join(f"{cause}: {n}" for cause, n in sorted(statistics["failures_by_cause"].items()))
            self.print(f"Failed prompts: {statistics['failed_prompts']} ({causes}) — --resume retries them")
        usage = statistics["usage"]
        self.print(f"Tokens: {usage['prompt_tokens']:,} prompt, {usage['completion_tokens']:,} completion "
                   f"({usage['reasoning_tokens']:,} reasoning, {usage['cached_tokens']:,} cached prompt) · "
                   f"cost ${usage['cost']:.4f}")
