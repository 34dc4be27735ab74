"""What the user sees: live progress over prompts on a terminal, plain lines elsewhere, and the end-of-run
summary. Every line passes through the redactor first, then :func:`batchrun.console.layout.shown`; free text
(a message, a prompt preview, an error) is shown before it is laid out, and each message is bounded."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from batchrun import rows
from batchrun.console.layout import (
    INDENT,
    PLAIN_WIDTH,
    SEPARATOR,
    append_tail,
    bounded,
    clock,
    cost_text,
    label_column,
    labelled,
    one_line,
    pack,
    shortened,
    shown,
    shown_block,
    usage_segments,
    wrapped,
)
from batchrun.messages import Finished
from batchrun.stats import ThisRun

STATUS_MARK = {rows.COMPLETED: "✅", rows.PARTIAL: "⚠️ ", rows.FAILED: "❌", rows.DISCARDED: "🚫"}
PLAIN_STATUS_EVERY = 30.0     # seconds between progress lines when output is a log file
MIN_BAR, MAX_BAR = 10, 40     # a shorter progress bar is noise; a longer one adds nothing
RULE_WIDTH = 60
MAX_ERROR_CHARS = 200         # without --verbose a failure's message is one line of at most this
# A pause the endpoint asked for (a 429) this long or longer gets a line of its own; a shorter one shows in
# the progress line only (with --adaptive_concurrency=False every 429 pauses the run, a second or two).
PAUSE_NOTE_SECONDS = 5.0
# How late the console may see a pause begin: the scheduling loop looks about once a second, and a Ray
# run's figures are up to half a second older.
PAUSE_SEEN_LATE = 1.5
# An endpoint down this long gets a line (and another when it is up again); a blip shows in the progress line
# only.
OUTAGE_NOTE_SECONDS = 5.0


def counted(number: int, noun: str, plural: str | None = None) -> str:
    """``number`` of ``noun``, the noun in the plural unless there is one: "1 prompt", "2 prompts"."""
    return f"{number:,} {noun if number == 1 else plural or noun + 's'}"


class _Fitted:
    """A renderable laid out afresh at every refresh, for the width the terminal has at that moment."""

    def __init__(self, layout: Callable[[int], list[Text]]) -> None:
        self._layout = layout

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text("\n").join(self._layout(options.max_width))


class RunConsole:
    """The run's output. ``out`` and ``err`` default to stdout and stderr; a caller (a test) may pass
    its own rich consoles, whose terminal-ness then decides the layout, and a terminal's width its width
    (``out`` not a terminal is a log file: it is set to PLAIN_WIDTH)."""

    def __init__(self, redact: Callable[[str], str], *, verbose: bool, out: Console | None = None,
                 err: Console | None = None) -> None:
        self.redact = redact
        self.verbose = verbose
        self.out = out or Console(file=sys.stdout, soft_wrap=True, highlight=False)
        self.err = err or Console(file=sys.stderr, soft_wrap=True, highlight=False)
        # Rich takes FORCE_COLOR (which CI systems set for colour in their logs) and TTY_COMPATIBLE for a
        # terminal: colour then, but the live display, redrawn in place, only on a real one (else it went
        # into the log four times a second). A console the caller gives decides for itself.
        self.interactive = self.out.is_terminal and (out is not None or self.out.file.isatty())
        if not self.interactive:
            # Rich takes COLUMNS for a file's width, and cuts what it draws (the tool table) to it.
            self.out.width = PLAIN_WIDTH
        self._live: Live | None = None
        self._total = 0
        self._done = 0
        self._samples = False
        self._started = 0.0
        self._last_status_line = 0.0
        self._pause_ends = 0.0            # time.monotonic() when the pause known last ends, as last known
        self._pause_announced = False     # that pause had its line
        self._down_since = 0.0            # the outage known last, as its figures name it (0: none)
        self._down_began = 0.0            # time.monotonic() when it began
        self._down_announced = False      # it had its line
        self._this_run: ThisRun | None = None

    @property
    def width(self) -> int:
        """Cells per line: the terminal's (read each time, as it may be resized), or PLAIN_WIDTH."""
        return self.out.width if self.interactive else PLAIN_WIDTH

    # -- plain output -----------------------------------------------------------------------------

    def print(self, text: str = "", style: str | None = None) -> None:
        """Prose: word-wrapped (never inside a word, so never inside a number), by the terminal or,
        in a log file, here at PLAIN_WIDTH."""
        text = self._message(text)
        for line in ([text] if self.interactive else wrapped(text)):
            self._emit(line, style)

    def _emit(self, line: str, style: str | None = None) -> None:
        """Every write to stdout ends here, so that a live progress display stays below it. A log
        file gets the line as laid out (rich does not wrap it again at whatever width it guesses).
        A Text is neither markup nor emoji codes, so a prompt's brackets and colons print as they are."""
        self.out.print(Text(shown(line), style=style or ""), soft_wrap=not self.interactive)

    def _emit_lines(self, lines: Iterable[str], style: str | None = None) -> None:
        for line in lines:
            self._emit(self.redact(line), style)

    def _message(self, text: str) -> str:
        """A message's text as it will be shown: redacted first (a cut could leave a secret's prefix
        unrecognised), on one line, bounded. Laid out only then, as escapes are longer than what they
        stand for."""
        return bounded(shown(self.redact(text)))

    def warn(self, text: str) -> None:
        text = self._message(f"warning: {text}")
        for line in ([text] if self.err.is_terminal else wrapped(text)):
            self.err.print(Text(line, style="yellow"), soft_wrap=not self.err.is_terminal)

    def error(self, text: str) -> None:
        """One clear ``error:`` line (or block: the lines the caller wrote) on stderr; the caller then
        exits 1. A Text, as every line: neither markup nor emoji codes (":skull:") in an endpoint's words."""
        text = text if text.startswith("error:") else f"error: {text}"
        self.err.print(Text(bounded(shown_block(self.redact(text))), style="bold red"))

    # -- progress -------------------------------------------------------------------------------

    def start_progress(self, total: int, already_done: int, this_run: ThisRun, *, samples: bool = False) -> None:
        """``samples``: each prompt runs several times, and the progress counts its samples."""
        self._total, self._done, self._this_run, self._samples = total, already_done, this_run, samples
        self._started = self._last_status_line = time.monotonic()
        if not self.interactive:
            return
        self._live = Live(_Fitted(self._progress_lines), console=self.out, refresh_per_second=4)
        self._live.start(refresh=True)

    def _rate(self) -> float:
        elapsed = time.monotonic() - self._started
        processed = self._this_run.processed if self._this_run else 0
        return processed / elapsed if elapsed > 0 else 0.0

    def _timing_segments(self) -> list[str]:
        rate = self._rate()
        remaining = max(self._total - self._done, 0)
        eta = "-:--:--"
        if rate > 0:
            finish = datetime.now() + timedelta(seconds=remaining / rate)
            eta = f"{clock(remaining / rate)} (ends {finish:%H:%M})"
        return [f"{self._done:,}/{self._total:,} {'samples' if self._samples else 'prompts'}", f"{rate:.2f}/s",
                f"{clock(time.monotonic() - self._started)} elapsed", f"ETA {eta}"]

    def _count_segments(self) -> list[str]:
        run = self._this_run
        if run is None:
            return []
        counts = " ".join(f"{STATUS_MARK[status].strip()} {run.statuses[status]:,}" for status in STATUS_MARK)
        tokens = run.usage["prompt_tokens"] + run.usage["completion_tokens"]
        cost = cost_text(run.usage["cost"], run.replies.unpriced) + self._cost_to_come()
        segments = [counts, f"{tokens:,} tok", cost]
        if (figures := run.concurrency) is None:
            return segments
        if figures.adaptive:
            # Model requests the run lets be in flight now, of the most it would (--num_workers).
            segments.append(f"requests {figures.limit:,}/{figures.ceiling:,} at once")
        # Why figures stand still: without these a run paused or retrying looked hung.
        if figures.pause_left > 0:
            segments.append(f"paused by the endpoint, {math.ceil(figures.pause_left)}s left")
        if figures.down_for:
            segments.append(f"endpoint down for {clock(figures.down_for)}")
        if figures.retrying:
            segments.append(f"{counted(figures.retrying, 'request')} retrying (last: {figures.retry_cause})")
        return segments

    def _cost_to_come(self) -> str:
        """What this invocation will have spent at the end, at what each finished sample cost so far."""
        run = self._this_run
        remaining = max(self._total - self._done, 0)
        if run is None or not run.processed or not remaining or run.replies.unpriced:
            return ""
        return f" → ~${run.usage['cost'] * (1 + remaining / run.processed):.4f}"

    def _progress_lines(self, width: int) -> list[Text]:
        """One line with a bar where everything fits; else timing and counts on lines of their own,
        the bar shrunk to the room left on the first, or dropped."""
        timing, counts = self._timing_segments(), self._count_segments()
        lines = [SEPARATOR.join(timing + counts)]
        if cell_len(lines[0]) + 1 + MIN_BAR > width:
            lines = pack(timing, width) + pack(counts, width)
        lines = [self.redact(line) for line in lines]
        texts = [Text(line) for line in lines]
        room = width - cell_len(lines[0]) - 1
        if room >= MIN_BAR:
            texts[0] = Text.assemble(self._bar(min(room, MAX_BAR)), " ", texts[0])
        return texts

    def _bar(self, width: int) -> Text:
        filled = round(width * self._done / self._total) if self._total else width
        return Text.assemble(("━" * filled, "bar.complete"), ("━" * (width - filled), "bar.back"))

    def prompt_finished(self, finished: Finished) -> None:
        self._done += 1
        width = self.width
        figures = [f"{STATUS_MARK[finished.status]} [{self._done:,}/{self._total:,}] prompt {finished.prompt_index}"
                   + (f" sample {finished.sample_index}" if self._samples else "")]
        if finished.status == rows.FAILED:
            figures.append("failed — will retry on resume")
        else:
            figures += [counted(finished.api_calls, "model call"), f"{finished.wall_time:.1f}s"]
        if finished.status == rows.DISCARDED:
            figures.append("discarded: no reasoning")
        elif finished.status == rows.PARTIAL:
            figures.append(f"partial: {finished.end_reason}")
        # Redacted before it is shortened: a cut could otherwise leave a secret's prefix unrecognised.
        preview = shown(one_line(self.redact(finished.prompt_preview)))
        self._emit_lines(append_tail(pack(figures, width), preview, width))
        if finished.status == rows.FAILED:
            self._print_error(finished, width)
        if self.verbose:
            details = pack(self._detail_segments(finished), width - len(INDENT), indent="")
            self._emit_lines(INDENT + line for line in details)
            for preview in finished.call_previews:
                # Redacted before it is shown, as the prompt's preview; a model's text is escaped.
                wrapped = Text(shown(self.redact(preview))).wrap(self.out, width - len(INDENT))
                self._emit_lines(INDENT + line.plain.rstrip() for line in wrapped)
        if not self.interactive and time.monotonic() - self._last_status_line >= PLAIN_STATUS_EVERY:
            self.status_line()

    def _print_error(self, finished: Finished, width: int) -> None:
        """The failure's message under its line, word-wrapped: with --verbose all of it (bounded as any
        message is), else its first MAX_ERROR_CHARS characters on one line."""
        error = self.redact(finished.error or "")
        error = bounded(shown_block(error)) if self.verbose else shortened(shown(one_line(error)), MAX_ERROR_CHARS)
        wrapped = Text(f"{finished.error_type}: {error}").wrap(self.out, width - len(INDENT))
        self._emit_lines(INDENT + line.plain.rstrip() for line in wrapped)

    @staticmethod
    def _detail_segments(finished: Finished) -> list[str]:
        usage = finished.usage
        tools = ", ".join(f"{name}×{count}" + (f" ({failed} failed)" if failed else "")
                          for name, count, failed in finished.tool_calls) or "none"
        return [f"toolsets {', '.join(finished.toolsets)}", f"tools used: {tools}",
                f"tokens {usage['prompt_tokens']:,}+{usage['completion_tokens']:,}",
                cost_text(usage["cost"], finished.unpriced_replies),
                f"batch {finished.batch_num}", f"end {finished.end_reason}"]

    def tick(self) -> None:
        """Called by the scheduling loop about once a second. In a log file, the status line comes every
        PLAIN_STATUS_EVERY though no prompt finishes: a slow endpoint (or one retried for the whole request
        time-out, attempt after attempt) left a log without a line for an hour."""
        self._announce_a_new_pause()
        self._announce_an_outage()
        if not self.interactive and self._total and time.monotonic() - self._last_status_line >= PLAIN_STATUS_EVERY:
            self.status_line()

    def _announce_a_new_pause(self) -> None:
        """A line when the endpoint pauses the run (a 429, see batchrun.rate_limit.Gate): nothing moves
        until it ends, and a log file would otherwise say why only in the next status line. One line per
        pause, however many 429s push its end back while it lasts (many sessions' 429s come back spread
        over the reply time); a pause begun after the last one ended gets its own."""
        figures = self._this_run.concurrency if self._this_run else None
        if figures is None or figures.pause_left <= 0:
            return
        now = time.monotonic()
        if now > self._pause_ends:      # the pause known had ended: requests went again since
            self._pause_announced = False
        self._pause_ends = max(self._pause_ends, now + figures.pause_left)
        if self._pause_announced or figures.pause_left < PAUSE_NOTE_SECONDS - PAUSE_SEEN_LATE:
            return
        self._pause_announced = True
        # "Before": paused requests go again spread over a few seconds after it (rate_limit.wake_delay).
        until = datetime.now() + timedelta(seconds=figures.pause_left)
        self.print(f"the endpoint answered 429 (too many requests): no model request goes out before "
                   f"{until:%H:%M:%S} ({clock(math.ceil(figures.pause_left))} from now)")

    def _announce_an_outage(self) -> None:
        """A line once the endpoint has been down for OUTAGE_NOTE_SECONDS (batchrun.concurrency.note_failure:
        its prompts wait for it instead of failing, so nothing moves), and one when it is up again. An
        outage is known by when it began in the figures' own clock (a Ray run's come from another node,
        and may be a second or two old); how long it lasted, by this one's."""
        figures = self._this_run.concurrency if self._this_run else None
        down_since = figures.down_since if figures else 0.0
        now = time.monotonic()
        if self._down_since and down_since != self._down_since:      # up now, or down again since
            if self._down_announced:
                self.print(f"the endpoint is up again, after {clock(now - self._down_began)} down")
            self._down_since, self._down_began, self._down_announced = 0.0, 0.0, False
        if figures is None or not down_since:
            return
        if not self._down_since:
            self._down_since, self._down_began = down_since, now - figures.down_for
        if not self._down_announced and figures.down_for >= OUTAGE_NOTE_SECONDS:
            self._down_announced = True
            cause = f" (last: {figures.retry_cause})" if figures.retry_cause else ""
            since = datetime.now() - timedelta(seconds=figures.down_for)
            self.print(f"the endpoint has been down since {since:%H:%M:%S}{cause}: the prompts in flight wait for "
                       f"it without using up their retries, for an hour at most; Ctrl-C stops the run and "
                       f"--resume goes on")

    def status_line(self) -> None:
        """Progress in a log file, where there is no live display: the same figures as plain lines."""
        self._last_status_line = time.monotonic()
        timing = self._timing_segments()
        timing[0] = f"progress: {timing[0]}"
        self._emit_lines(pack([*timing, *self._count_segments()], self.width))

    def stop_progress(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    # -- summary --------------------------------------------------------------------------------

    def summary(self, statistics: dict, merged_batch_files: int, *, interrupted: bool = False) -> None:
        """The end-of-run figures; after Ctrl-C under a heading that says the run did not complete."""
        self._announce_an_outage()      # one that ended after the last look, as the run's last replies came
        width = self.width
        before = self._run_rows(statistics, merged_batch_files)
        after = self._merged_file_rows(statistics) + self._token_rows(statistics)
        labels = label_column(before + after)      # one value column for both blocks
        rule = "=" * min(RULE_WIDTH, width)
        self._emit("")
        self._emit_lines([rule])
        if interrupted:
            self._emit_lines(["BATCH PROCESSING INTERRUPTED"], style="bold yellow")
        else:
            self._emit_lines(["BATCH PROCESSING COMPLETE"], style="bold green")
        self._emit_lines([rule])
        self._emit_lines(labelled(before, width, labels))
        self._print_tool_table(statistics["tool_statistics"], width)
        self._emit_lines(labelled(after, width, labels))

    @staticmethod
    def _run_rows(statistics: dict, merged_batch_files: int) -> list[tuple[str, list[str]]]:
        run = statistics["this_run"]
        return [("This run", [f"{counted(run['prompts_processed'], 'prompt')} processed",
                              f"✅ {run['completed']:,} completed",
                              f"⚠️ {run['partial']:,} partial", f"❌ {run['failed']:,} failed",
                              f"🚫 {run['discarded_no_reasoning']:,} discarded",
                              counted(run['api_calls'], 'API call'), f"{statistics['duration_seconds']:.1f}s"]),
                ("All runs", [f"{counted(statistics['trajectories_in_merged_file'], 'trajectory', 'trajectories')} "
                              "in the merged file", counted(merged_batch_files, "batch file")])]

    @staticmethod
    def _merged_file_rows(statistics: dict) -> list[tuple[str, list[str]]]:
        reasoning = statistics["reasoning_statistics"]
        result = [("Reasoning", [f"{reasoning['turns_with_reasoning']:,} of {reasoning['total_assistant_turns']:,} "
                                 f"assistant turns ({reasoning['coverage_percent']:.1f}%)",
                                 f"{reasoning['turns_without_reasoning']:,} without"]),
                  ("Discarded", [f"{statistics['discarded_no_reasoning']:,} samples without reasoning (all runs)"])]
        if samples := statistics.get("samples"):
            spread = ", ".join(f"{prompts:,} with {count}"
                               for count, prompts in samples["prompts_by_completed_samples"].items())
            result.append(("Samples", [f"{samples['prompts_with_a_completed_sample']:,} of "
                                       f"{samples['prompts_with_rows']:,} prompts have a completed sample "
                                       f"({statistics['samples_per_prompt']} per prompt asked)",
                                       f"prompts by completed samples: {spread}"]))
        if skipped := statistics["skipped_dataset_lines"]:
            result.append(("Dataset", [f"{counted(skipped, 'bad line')} skipped",
                                       "see the warnings at the start"]))
        if corrupted := statistics["filtered_corrupted"]:
            result.append(("Corrupted", [f"{corrupted:,} left out of the merged file (invented tool names)",
                                         "kept in the batch files", "--resume --rerun_corrupted runs them again"]))
        if why := statistics.get("filtered_prompt_gone_why"):
            result.append(("Dataset changed", [why]))
        if failed := statistics["failed_prompts"]:
            causes = [f"{cause}: {n:,}" for cause, n in sorted(statistics["failures_by_cause"].items())]
            result.append(("Failed", [f"{counted(failed, 'prompt')} this run", *causes,
                                      "--resume retries them"]))
        return result

    @staticmethod
    def _token_rows(statistics: dict) -> list[tuple[str, list[str]]]:
        """After a resume the merged file also holds earlier runs' usage: both figures, each labelled."""
        this_run = usage_segments(statistics["this_run"]["usage"],
                                  statistics["this_run"]["replies_by_cost_source"].get("unknown", 0))
        all_runs = usage_segments(statistics["usage"], statistics["replies_by_cost_source"].get("unknown", 0))
        if this_run == all_runs:
            return [("Tokens", this_run)]
        return [("Tokens, this run", this_run), ("Tokens, all runs", all_runs)]

    def _print_tool_table(self, tool_statistics: dict, width: int) -> None:
        used = [(n, e) for n, e in tool_statistics.items() if e["count"]]
        if not used:
            self._emit_lines(["Tool usage: no tool calls in the merged file"])
            return
        used.sort(key=lambda item: -item[1]["count"])
        table = Table()
        table.add_column("tool", overflow="fold")
        for column in ("count", "success", "failure", "success rate"):
            table.add_column(column, justify="right", no_wrap=True)    # a figure is never wrapped
        for name, entry in used:
            table.add_row(*(Text(shown(self.redact(cell))) for cell in (
                name, f"{entry['count']:,}", f"{entry['success']:,}", f"{entry['failure']:,}",
                f"{entry['success_rate']:.1f}%")))
        self._emit_lines(["Tool usage (merged file, all runs):"])
        unbounded = self.out.options.update_width(1 << 16)     # measured against the console's width, all fits
        if Measurement.get(self.out, unbounded, table).maximum > width:
            # Too narrow for the table whole, which would cut its figures and drop the tools' names.
            entries = [(shown(name), [f"{entry['count']:,} calls", f"{entry['success']:,} ok",
                                      f"{entry['failure']:,} failed", f"{entry['success_rate']:.1f}%"])
                       for name, entry in used]
            self._emit_lines(labelled(entries, width, label_column(entries)))
            return
        self.out.print(table, width=width, soft_wrap=False)
