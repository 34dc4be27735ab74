"""What the console prints, recorded by a real rich Console at a given width: live progress,
per-prompt lines, the end summary, in a terminal and in a log file."""

from __future__ import annotations

import dataclasses
import io
import re
import time
from collections import Counter

import pytest
from conftest import endpoint_args, read_jsonl, run_cli, write_dataset
from rich.cells import cell_len
from rich.console import Console

from batchrun import rows
from batchrun.concurrency import ConcurrencyFigures
from batchrun.console import RunConsole
from batchrun.console import run_console as run_console_module
from batchrun.console.run_console import PAUSE_NOTE_SECONDS, PLAIN_STATUS_EVERY
from batchrun.messages import Finished
from batchrun.security import Redactor
from batchrun.stats import MergeStatistics, ThisRun, build_statistics, empty_usage
from batchrun.worker_process import MAX_CALL_PREVIEWS, call_previews

LONG_PROMPT = ("Write a detailed essay about the history of the Roman empire, its institutions, its wars "
               "and its fall, with citations for every claim")


def recording_console(*, terminal: bool, width: int = 80) -> Console:
    # Not interactive: rich then draws the live display once, when it stops, instead of redrawing it
    # in place, so the recorded text is what the user is left looking at.
    return Console(file=io.StringIO(), width=width, record=True, force_terminal=terminal, force_interactive=False)


def run_console(out: Console, *, verbose: bool = False, redact=lambda text: text) -> RunConsole:
    return RunConsole(redact, verbose=verbose, out=out)


def finished(prompt_index: int, status: str = rows.COMPLETED, *, preview: str = LONG_PROMPT,
             error: str | None = None, usage: dict | None = None,
             tool_calls: tuple[tuple[str, int, int], ...] = (("terminal", 1, 0),),
             call_previews: tuple[str, ...] = ()) -> Finished:
    return Finished(prompt_index=prompt_index, unit=prompt_index, batch_num=0, status=status, row=b"", api_calls=3,
                    usage=usage or {"prompt_tokens": 1234, "completion_tokens": 567, "cost": 0.0123},
                    wall_time=0.4, end_reason="max_turns", error=error,
                    error_type="http_400" if status == rows.FAILED else None, prompt_preview=preview,
                    toolsets=("terminal", "file"), tool_calls=tool_calls, call_previews=call_previews)


def record(console: RunConsole, this_run: ThisRun, outcome: Finished) -> None:
    """As the runner does: count the outcome for this run, then show it."""
    this_run.record(outcome.status, outcome.usage, outcome.api_calls, outcome.error_type)
    console.prompt_finished(outcome)


def statistics(this_run: ThisRun, merge: MergeStatistics) -> dict:
    return build_statistics(run_name="run", distribution="default", model="m", batch_size=10, total_prompts=100,
                            skipped_dataset_lines=0, duration=12.3, merge=merge, this_run=this_run,
                            superseded_corrupted=Counter(), unfinished=empty_usage(), unfinished_this_run=empty_usage(),
                            replies=this_run.replies)


def usage(prompt: int, completion: int, reasoning: int = 0, cached: int = 0, cost: float = 0.0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "reasoning_tokens": reasoning,
            "cached_tokens": cached, "cost": cost}


def lines_of(out: Console) -> list[str]:
    return out.export_text().rstrip("\n").split("\n")


def widest(lines: list[str]) -> int:
    return max(cell_len(line) for line in lines)


def test_progress_at_80_columns_shows_count_rate_elapsed_eta_counts_tokens_and_cost_whole():
    out = recording_console(terminal=True)
    console, this_run = run_console(out), ThisRun()
    console.start_progress(10_000, 9_990, this_run)
    for index, status in enumerate([rows.COMPLETED, rows.COMPLETED, rows.PARTIAL, rows.FAILED]):
        record(console, this_run, finished(index, status, error="bad request"))
    console.stop_progress()
    timing, counts = lines_of(out)[-2:]
    assert widest([timing, counts]) <= 80
    assert re.search(r"9,994/10,000 prompts · \d+\.\d\d/s · \d:\d\d:\d\d elapsed · ETA \d:\d\d:\d\d \(ends \d\d:\d\d\)$",
                     timing)
    assert counts == "✅ 2 ⚠️ 1 ❌ 1 🚫 0 · 7,204 tok · $0.0492 → ~$0.1230"


def test_progress_on_a_wide_terminal_is_one_line_with_a_bar():
    out = recording_console(terminal=True, width=160)
    console, this_run = run_console(out), ThisRun()
    console.start_progress(10, 0, this_run)
    record(console, this_run, finished(0))
    console.stop_progress()
    progress = lines_of(out)[-1]
    assert progress.startswith("━") and "1/10 prompts" in progress and progress.endswith("1,801 tok · $0.0123 → ~$0.1230")


def test_per_prompt_line_shortens_a_long_prompt_to_the_80_columns_and_keeps_the_figures():
    out = recording_console(terminal=True)
    console, this_run = run_console(out), ThisRun()
    console.start_progress(10, 2, this_run)
    record(console, this_run, finished(7))
    console.stop_progress()
    line = next(line for line in lines_of(out) if "[3/10]" in line)
    assert cell_len(line) <= 80 and line.endswith("…")
    assert line.startswith("✅ [3/10] prompt 7 · 3 model calls · 0.4s · Write a detailed essay")


def test_per_prompt_line_uses_the_width_of_a_wider_terminal_for_the_prompt():
    out = recording_console(terminal=True, width=200)
    console, this_run = run_console(out), ThisRun()
    console.start_progress(10, 0, this_run)
    record(console, this_run, finished(0))
    console.stop_progress()
    assert any(line.endswith(LONG_PROMPT) for line in lines_of(out))


def test_failed_prompt_line_says_it_will_be_retried_and_wraps_its_error_between_words():
    out = recording_console(terminal=True)
    console, this_run = run_console(out), ThisRun()
    console.start_progress(10, 0, this_run)
    error = "HTTP 400: the model does not accept tool definitions of 12345 bytes or more; " * 2
    record(console, this_run, finished(4, rows.FAILED, error=error))
    console.stop_progress()
    printed = lines_of(out)
    start = next(i for i, line in enumerate(printed) if "[1/10] prompt 4" in line)
    assert "failed — will retry on resume" in printed[start]
    error_lines = printed[start + 1:start + 4]
    assert widest(error_lines) <= 80 and all(line.startswith("    ") for line in error_lines)
    assert " ".join(line.strip() for line in error_lines) == f"http_400: {error.strip()}"


def test_verbose_details_wrap_at_separators_not_inside_figures():
    out = recording_console(terminal=True)
    console, this_run = run_console(out, verbose=True), ThisRun()
    console.start_progress(10, 0, this_run)
    record(console, this_run, finished(0, usage={"prompt_tokens": 1_234_567, "completion_tokens": 7_654_321,
                                                 "cost": 123.4567}))
    console.stop_progress()
    details = [line for line in lines_of(out) if line.startswith("    ")]
    assert widest(details) <= 80
    assert "tokens 1,234,567+7,654,321" in "\n".join(details) and "$123.4567" in "\n".join(details)


def test_verbose_details_count_the_failed_calls_of_each_tool():
    out = recording_console(terminal=True, width=160)
    console, this_run = run_console(out, verbose=True), ThisRun()
    console.start_progress(10, 0, this_run)
    record(console, this_run, finished(0, tool_calls=(("terminal", 3, 0), ("read_file", 2, 1), ("patch", 1, 1))))
    console.stop_progress()
    assert "tools used: terminal×3, read_file×2 (1 failed), patch×1 (1 failed)" in "\n".join(lines_of(out))


@pytest.mark.parametrize(("cost", "shown"), [(0.0, "unknown"), (0.25, "≥ $0.2500")])
def test_verbose_details_say_a_prompts_cost_is_unknown_where_a_reply_had_no_price(cost, shown):
    # A prompt whose replies reported no usage was shown as "$0.0000".
    out = recording_console(terminal=True, width=160)
    console, this_run = run_console(out, verbose=True), ThisRun()
    console.start_progress(10, 0, this_run)
    outcome = dataclasses.replace(finished(0, usage={"prompt_tokens": 0, "completion_tokens": 0, "cost": cost}),
                                  unpriced_replies=1)
    record(console, this_run, outcome)
    console.stop_progress()
    details = "\n".join(line for line in lines_of(out) if line.startswith("    "))
    assert f"· {shown} ·" in details and "$0.0000" not in details


def test_log_file_lines_are_laid_out_for_80_columns_whatever_width_rich_assumes():
    out = recording_console(terminal=False, width=200)
    console, this_run = run_console(out), ThisRun()
    console.start_progress(10, 0, this_run)
    record(console, this_run, finished(0))
    console.status_line()
    printed = lines_of(out)
    assert widest(printed) <= 80
    assert printed[0].startswith("✅ [1/10] prompt 0 · 3 model calls · 0.4s · Write") and printed[0].endswith("…")
    assert printed[1].startswith("progress: 1/10 prompts · ") and "ETA" in " ".join(printed[1:])


def test_a_log_file_gets_the_status_line_while_nothing_finishes(monkeypatch):
    # Before: only a finished prompt brought it, and an endpoint answering slowly (or a trickle of bytes,
    # retried for the request time-out each time) left a log without a line for an hour.
    out = recording_console(terminal=False)
    console = run_console(out)
    console.start_progress(10, 0, ThisRun())
    started = time.monotonic()
    console.tick()
    assert out.file.getvalue() == ""
    monkeypatch.setattr(run_console_module.time, "monotonic", lambda: started + PLAIN_STATUS_EVERY + 1)
    console.tick()
    console.tick()
    printed = lines_of(out)
    assert printed[0].startswith("progress: 0/10 prompts · ")
    assert sum(line.startswith("progress:") for line in printed) == 1


def figures_with(*, retrying: int = 0, pause_left: float = 0.0, adaptive: bool = False, down_since: float = 0.0,
                 down_for: float = 0.0) -> ConcurrencyFigures:
    return ConcurrencyFigures(adaptive=adaptive, ceiling=64, limit=64, lowest=64, highest=64, requests=10,
                              rate_limited=1, retrying=retrying, retried=retrying,
                              retry_cause="http_503" if retrying else "", pause_left=pause_left,
                              down_since=down_since, down_for=down_for)


def test_progress_shows_a_pause_the_endpoint_asked_for_and_the_requests_waiting_to_retry():
    # Before, a run paused for a minute by a 429, or retrying every request, showed figures that did not move.
    out = recording_console(terminal=True)
    console, this_run = run_console(out), ThisRun()
    this_run.concurrency = figures_with(retrying=3, pause_left=41.2)
    console.start_progress(10, 0, this_run)
    console.stop_progress()
    shown = " ".join(lines_of(out))
    assert "paused by the endpoint, 42s left" in shown and "3 requests retrying (last: http_503)" in shown
    assert widest(lines_of(out)) <= 80


def test_progress_says_nothing_of_retries_or_pauses_when_there_are_none():
    out = recording_console(terminal=True)
    console, this_run = run_console(out), ThisRun()
    this_run.concurrency = figures_with()
    console.start_progress(10, 0, this_run)
    console.stop_progress()
    assert "paused" not in out.export_text() and "retrying" not in out.export_text()


def test_a_pause_the_endpoint_asked_for_gets_a_line_of_its_own_once():
    out = recording_console(terminal=False)
    console, this_run = run_console(out), ThisRun()
    console.start_progress(10, 0, this_run)
    this_run.concurrency = figures_with(pause_left=60)
    console.tick()
    this_run.concurrency = figures_with(pause_left=59)
    console.tick()
    printed = " ".join(line.strip() for line in lines_of(out))
    assert re.match(r"the endpoint answered 429 \(too many requests\): no model request goes out before "
                    r"\d\d:\d\d:\d\d \(0:01:00 from now\)$", printed)


def pause_lines(monkeypatch, *ticks: tuple[float, float]) -> int:
    """The lines announcing a pause in a log file after the scheduling loop's ``ticks``: (seconds into the
    run, the pause's seconds left as the gate says then)."""
    out = recording_console(terminal=False)
    console, this_run = run_console(out), ThisRun()
    console.start_progress(10, 0, this_run)
    for at, pause_left in ticks:
        this_run.concurrency = figures_with(pause_left=pause_left)
        monkeypatch.setattr(run_console_module.time, "monotonic", lambda at=at: 1000 + at)
        console.tick()
    return out.file.getvalue().count("answered 429")


def test_a_pause_stretched_by_later_429s_gets_one_line(monkeypatch):
    # Many sessions' 429s come back spread over the reply time, each pushing the pause's end back: before,
    # a line for each, every two seconds, for one stretch without a request.
    assert pause_lines(monkeypatch, (0, 20), (3, 20), (6, 20), (9, 20)) == 1


def test_a_pause_after_the_last_one_ended_gets_a_line_of_its_own_too(monkeypatch):
    assert pause_lines(monkeypatch, (0, 20), (40, 20)) == 2


def test_a_pause_that_begins_a_moment_after_the_last_one_ended_gets_a_line_of_its_own(monkeypatch):
    # Requests go again spread over a quarter of a pause after it, and the next 429 may come within a second
    # or two: before, back-to-back pauses of a whole run were one stretch, with one line.
    assert pause_lines(monkeypatch, (0, 7), (8, 7), (16, 7)) == 3


def test_a_short_pause_that_grows_long_gets_its_line(monkeypatch):
    # With --adaptive_concurrency=False any 429 pauses the run a second or two; a Retry-After of a minute
    # may follow while it lasts.
    assert pause_lines(monkeypatch, (0, 1), (0.5, 60)) == 1


def test_a_pause_of_five_seconds_seen_a_second_and_a_half_late_gets_its_line(monkeypatch):
    # The scheduling loop looks about once a second (a Ray run's figures are up to half a second older):
    # before, a pause of five seconds had less than five left when seen, and no line.
    assert pause_lines(monkeypatch, (0, PAUSE_NOTE_SECONDS - 1.5)) == 1


def test_a_short_pause_shows_in_the_progress_line_only(monkeypatch):
    assert pause_lines(monkeypatch, (0, 2)) == 0


def test_log_file_output_has_no_escape_codes():
    out = recording_console(terminal=False)
    console, this_run = run_console(out, verbose=True), ThisRun()
    console.start_progress(10, 0, this_run)
    record(console, this_run, finished(0))
    record(console, this_run, finished(1, rows.FAILED, error="bad request"))
    console.status_line()
    console.stop_progress()
    merge = MergeStatistics()
    merge.tool_entries.update({("terminal", 1, 1, 0): 1})
    console.print("Interrupted.", style="yellow")
    console.summary(statistics(this_run, merge), 1)
    written = out.file.getvalue()
    assert "BATCH PROCESSING COMPLETE" in written and "terminal" in written
    assert "\x1b" not in written


def big_run() -> tuple[ThisRun, MergeStatistics]:
    """Figures long enough to be split, if anything split them."""
    this_run = ThisRun()
    for status, count in [(rows.COMPLETED, 123_456), (rows.PARTIAL, 23_456), (rows.FAILED, 3_456),
                          (rows.DISCARDED, 456)]:
        this_run.statuses[status] = count
    this_run.failures_by_cause.update({"http_400": 3_000, "request_timeout": 456})
    this_run.api_calls = 9_876_543
    this_run.usage.update(usage(1_234_567_890, 987_654_321, 123_456_789, 55_555_555, 9_876.54321))
    merge = MergeStatistics(merged=1_111_111, turns_with_reasoning=2_222_222, turns_without_reasoning=333_333,
                            discarded=44_444)
    merge.usage.update(usage(2_345_678_901, 1_098_765_432, 234_567_890, 66_666_666, 12_345.6789))
    merge.tool_entries.update({("browser_get_images", 1_234_567, 1_234_000, 567): 1, ("terminal", 3, 2, 1): 2})
    return this_run, merge


def test_summary_at_80_columns_keeps_every_figure_on_one_line():
    out = recording_console(terminal=True)
    this_run, merge = big_run()
    run_console(out).summary(statistics(this_run, merge), 1_234)
    printed = lines_of(out)
    assert widest(printed) <= 80
    text = "\n".join(printed)
    for figure in ["150,824 prompts processed", "✅ 123,456 completed", "⚠️ 23,456 partial", "❌ 3,456 failed",
                   "🚫 456 discarded", "9,876,543 API calls", "12.3s", "1,111,111 trajectories", "1,234 batch files",
                   "2,222,222 of 2,555,555 assistant turns (87.0%)", "333,333 without", "44,444 samples",
                   "3,456 prompts this run", "http_400: 3,000", "request_timeout: 456",
                   "1,234,567,890 prompt (55,555,555 cached)", "987,654,321 completion (123,456,789 reasoning)",
                   "cost $9876.5432", "2,345,678,901 prompt (66,666,666 cached)", "cost $12345.6789"]:
        assert figure in text


@pytest.mark.parametrize("terminal", [False, True], ids=["log_file", "terminal"])
def test_the_tool_table_keeps_every_name_and_figure_whatever_the_width(terminal):
    # Before: at COLUMNS=40 (a log file takes rich's width from it) the table lost its tools' names and cut
    # its figures to "cou…"; at 5, empty boxes.
    out = recording_console(terminal=terminal, width=40)
    this_run, merge = big_run()
    run_console(out).summary(statistics(this_run, merge), 1_234)
    printed = lines_of(out)
    assert widest(printed) <= (40 if terminal else 80)
    text = "\n".join(printed)
    for figure in ["browser_get_images", "1,234,567", "1,234,000", "567", "terminal", "6", "4", "2"]:
        assert figure in text
    assert "…" not in text


def test_summary_counts_one_of_a_thing_in_the_singular():
    out = recording_console(terminal=True)
    this_run = ThisRun()
    this_run.statuses[rows.COMPLETED], this_run.api_calls = 1, 1
    run_console(out).summary(statistics(this_run, MergeStatistics(merged=1)), 1)
    text = "\n".join(lines_of(out))
    for figure in ["1 prompt processed", "1 API call ", "1 trajectory in the merged file", "1 batch file"]:
        assert figure in text + " ", figure


def test_per_prompt_line_counts_one_model_call_in_the_singular():
    out = recording_console(terminal=True)
    console, this_run = run_console(out), ThisRun()
    console.start_progress(10, 0, this_run)
    record(console, this_run, dataclasses.replace(finished(0), api_calls=1))
    console.stop_progress()
    line = next(line for line in lines_of(out) if "[1/10]" in line)
    assert " · 1 model call · " in line


def test_tool_usage_table_fits_80_columns_with_its_figures_whole():
    out = recording_console(terminal=True)
    this_run, merge = big_run()
    run_console(out).summary(statistics(this_run, merge), 1)
    row = next(line for line in lines_of(out) if "browser_get_images" in line)
    assert cell_len(row) <= 80
    assert re.search(r"browser_get_images\s+│\s+1,234,567\s+│\s+1,234,000\s+│\s+567\s+│\s+100\.0%", row)


def test_summary_after_a_resume_labels_this_runs_tokens_and_all_runs_tokens():
    this_run = ThisRun()
    this_run.record(rows.COMPLETED, usage(6_025, 900, cost=0.5), 6, None)
    merge = MergeStatistics(merged=10)
    merge.usage.update(usage(10_312, 1_500, cost=0.9))
    out = recording_console(terminal=True)
    run_console(out).summary(statistics(this_run, merge), 2)
    tokens = [line for line in lines_of(out) if line.startswith("Tokens")]
    assert tokens[0].startswith("Tokens, this run:") and "6,025 prompt" in tokens[0]
    assert tokens[1].startswith("Tokens, all runs:") and "10,312 prompt" in tokens[1]


def test_summary_of_a_run_that_made_the_whole_merged_file_has_one_tokens_line():
    this_run = ThisRun()
    this_run.record(rows.COMPLETED, usage(6_025, 900, cost=0.5), 6, None)
    merge = MergeStatistics(merged=1)
    merge.usage.update(usage(6_025, 900, cost=0.5))
    out = recording_console(terminal=True)
    run_console(out).summary(statistics(this_run, merge), 1)
    printed = lines_of(out)
    assert [line.split(":")[0] for line in printed if line.startswith("Tokens")] == ["Tokens"]
    assert "\n".join(printed).count("6,025 prompt") == 1


def test_a_secret_where_the_preview_is_cut_is_redacted_not_half_shown():
    secret = "sk-live-0123456789abcdef0123456789"
    out = recording_console(terminal=False)
    console, this_run = run_console(out, redact=Redactor([secret])), ThisRun()
    console.start_progress(10, 0, this_run)
    record(console, this_run, finished(0, preview="use the key " + secret + " to call the API and report back"))
    printed = out.file.getvalue()
    assert "sk-live" not in printed and "[REDACTED]" in printed


# -- untrusted text on the console --------------------------------------------------------------------------

CLEAR_SCREEN = "\x1b[2J"
CLIPBOARD_WRITE = "\x1b]52;c;cm0gLXJmIH4=\x07"     # OSC 52: set the terminal's clipboard


def run_with_console(tmp_path, endpoint, prompts, *extra, env=None):
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    return run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=5", "--run_name=run",
                   "--distribution=terminal_only", *endpoint_args(endpoint), *extra, env=env)


def assert_escaped(output: str, *sequences: str) -> None:
    assert "\x1b" not in output and "\x07" not in output
    for sequence in sequences:
        assert sequence.encode("unicode_escape").decode() in output


def test_control_characters_of_a_dataset_prompt_are_shown_escaped(tmp_path, endpoint):
    result = run_with_console(tmp_path, endpoint, [f"{CLEAR_SCREEN}{CLIPBOARD_WRITE}"])    # fits the preview
    assert result.returncode == 0, result.stderr
    assert_escaped(result.stdout, CLEAR_SCREEN, CLIPBOARD_WRITE)


def test_control_characters_of_a_model_reply_are_shown_escaped_in_verbose_lines(tmp_path, endpoint):
    result = run_with_console(tmp_path, endpoint, [f"[[call evil{CLEAR_SCREEN}tool]] call it"], "--verbose")
    assert result.returncode == 0, result.stderr
    assert "tools used" in result.stdout
    assert_escaped(result.stdout + result.stderr, CLEAR_SCREEN)


def test_bidi_controls_of_a_dataset_prompt_are_shown_escaped(tmp_path, endpoint):
    """Right-to-left override and isolates: raw, the rest of the line would be shown reordered."""
    result = run_with_console(tmp_path, endpoint, ["abc \u202edef\u2067 ghi"])
    assert result.returncode == 0, result.stderr
    assert "abc \\u202edef\\u2067 ghi" in result.stdout
    assert "\u202e" not in result.stdout and "\u2067" not in result.stdout


def test_a_dataset_prompt_holding_a_lone_surrogate_is_skipped_with_a_warning_and_the_run_goes_on(tmp_path, endpoint):
    result = run_with_console(tmp_path, endpoint, ["lone \ud800 surrogate", "low \udc00 x", "plain"])
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if "lone surrogate" in line] == [
        'warning: line 1: "prompt" is not valid Unicode (a lone surrogate); skipped',
        'warning: line 2: "prompt" is not valid Unicode (a lone surrogate); skipped']
    assert [request["messages"][-1]["content"] for request in endpoint.requests] == ["plain"]


def test_a_lone_surrogate_in_a_model_reply_is_shown_escaped_in_verbose_lines(tmp_path, endpoint):
    # The script's JSON escape becomes the lone surrogate in the endpoint's reply (the prompt holds none).
    result = run_with_console(tmp_path, endpoint, ['[[calls [{"name": "evil\\udc80tool", "arguments": {}}]]] call it'],
                              "--verbose")
    assert result.returncode == 0, result.stderr
    assert "\\udc80" in result.stdout + result.stderr


def test_control_characters_of_an_endpoint_error_are_shown_escaped(tmp_path, endpoint):
    endpoint.script = lambda body: (400, {"error": {"message": f"refused {CLIPBOARD_WRITE} {CLEAR_SCREEN}",
                                                    "type": "invalid_request_error"}}, {})
    result = run_with_console(tmp_path, endpoint, ["any prompt"], "--verbose")
    assert result.returncode == 2, result.stderr
    assert "refused" in result.stdout
    assert_escaped(result.stdout + result.stderr, CLEAR_SCREEN, CLIPBOARD_WRITE[:-1])  # its BEL is dropped on the way



def test_output_in_an_encoding_without_the_consoles_characters_shows_them_escaped_and_the_run_completes(
        tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["[[final done]] wait… 3×4 ✓", "plain"])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=5", "--run_name=run",
                     "--distribution=terminal_only", "--verbose", *endpoint_args(endpoint),
                     env={"PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0, result.stderr
    assert "wait\\u2026 3\\xd74 \\u2713" in result.stdout
    assert "BATCH PROCESSING COMPLETE" in result.stdout
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 2


# What rich's live display writes to redraw itself in place: hide the cursor, go up a line, clear it.
LIVE_DISPLAY_CODES = ("\x1b[?25l", "\x1b[1A", "\x1b[2K")


@pytest.mark.parametrize("variable", ["FORCE_COLOR", "TTY_COMPATIBLE"])
def test_a_log_file_gets_plain_lines_though_the_environment_forces_colour(tmp_path, endpoint, variable):
    """CI systems set FORCE_COLOR for colour; rich took it for a terminal and drew the live progress
    display into the log, redrawn four times a second."""
    result = run_with_console(tmp_path, endpoint, ["q1", "q2"], env={variable: "1"})
    assert result.returncode == 0, result.stderr
    assert not any(code in result.stdout + result.stderr for code in LIVE_DISPLAY_CODES)
    assert "[2/2]" in result.stdout and "BATCH PROCESSING COMPLETE" in result.stdout


def test_a_log_file_keeps_the_colour_the_environment_asks_for(tmp_path, endpoint):
    result = run_with_console(tmp_path, endpoint, ["q1"], env={"FORCE_COLOR": "1"})
    assert result.returncode == 0, result.stderr
    assert "\x1b[1;32m" in result.stdout       # the summary's bold green


def test_verbose_shows_at_most_twenty_calls_of_a_prompt_then_how_many_more():
    calls = [rows.ToolCallRecord(id=f"c{i}", name="terminal", arguments="{}", result="{}") for i in range(25)]
    previews = call_previews([rows.AssistantTurn(reasoning="", content="", tool_calls=calls)], chars=100)
    assert len(previews) == MAX_CALL_PREVIEWS + 1 and previews[-1] == "… and 5 more tool calls"


def test_a_verbose_call_preview_is_escaped_and_redacted():
    key = "sk-live-0123456789abcdef"
    out = recording_console(terminal=True, width=160)
    console, this_run = RunConsole(Redactor([key]), verbose=True, out=out), ThisRun()
    console.start_progress(10, 0, this_run)
    record(console, this_run, finished(0, call_previews=(f"terminal {{}} → \x1b[2J {key}",)))
    console.stop_progress()
    printed = "\n".join(lines_of(out))
    assert "terminal {} → \\x1b[2J [REDACTED]" in printed and key not in printed


def test_progress_says_how_long_the_endpoint_has_been_down():
    out = recording_console(terminal=True)
    console, this_run = run_console(out), ThisRun()
    this_run.concurrency = figures_with(retrying=64, down_since=1_000_000.0, down_for=133)
    console.start_progress(10, 0, this_run)
    console.stop_progress()
    shown = " ".join(lines_of(out))
    assert "endpoint down for 0:02:13" in shown and "64 requests retrying (last: http_503)" in shown


def outage_lines(monkeypatch, *ticks: tuple[float, float, float], summary: bool = False) -> list[str]:
    """The lines about the endpoint a log file gets after the scheduling loop's ``ticks``: (seconds into the
    run, since when the endpoint has been down by the figures' clock (0: it is up), for how long as the
    figures say), each message on one line."""
    out = recording_console(terminal=False)
    console, this_run = run_console(out), ThisRun()
    console.start_progress(10, 0, this_run)
    for at, since, down_for in ticks:
        this_run.concurrency = figures_with(retrying=8 if since else 0, down_since=since, down_for=down_for)
        monkeypatch.setattr(run_console_module.time, "monotonic", lambda at=at: 1000 + at)
        console.tick()
    if summary:
        this_run.concurrency = figures_with()
        console.summary(statistics(this_run, MergeStatistics()), 0)
    text = " ".join(line.strip() for line in lines_of(out))
    return [line.strip() for line in re.split(r"(?=the endpoint )", text) if line.startswith("the endpoint ")]


def test_an_endpoint_down_for_seconds_gets_a_line_and_one_when_it_is_up_again(monkeypatch):
    # Before, a log said nothing of an outage: its prompts failed one after another, or, since they wait,
    # nothing at all moved.
    down, up = outage_lines(monkeypatch, (10, 9, 1), (11, 9, 2), (14, 9, 5), (80, 9, 71), (81, 0, 0), (82, 0, 0))
    assert re.match(r"the endpoint has been down since \d\d:\d\d:\d\d \(last: http_503\): the prompts in flight "
                    r"wait for it without using up their retries, for an hour at most; Ctrl-C stops the run and "
                    r"--resume goes on$", down)
    assert up == "the endpoint is up again, after 0:01:12 down"


def test_an_outage_of_a_moment_shows_in_the_progress_line_only(monkeypatch):
    assert outage_lines(monkeypatch, (10, 9, 1), (11, 0, 0)) == []


def test_each_outage_gets_its_lines(monkeypatch):
    assert len(outage_lines(monkeypatch, (10, 1, 9), (20, 0, 0), (40, 10, 30), (50, 0, 0))) == 4


def test_an_outage_begun_again_between_two_looks_gets_its_lines(monkeypatch):
    # Up for a moment between two looks of the scheduling loop: the first outage still gets its end.
    lines = outage_lines(monkeypatch, (10, 1, 9), (11, 1, 10), (20, 11.5, 8.5))
    assert [line.split(",")[0].split(" since")[0] for line in lines] == [
        "the endpoint has been down", "the endpoint is up again", "the endpoint has been down"]


def test_figures_seconds_old_are_the_same_outage(monkeypatch):
    # A Ray run's figures come from another node, and may be a second or two old: before, an outage seen
    # through them ended and began again, with lines for each.
    lines = outage_lines(monkeypatch, (10, 1, 9), (11, 1, 10), (12, 1, 10), (13, 1, 10), (14, 1, 10))
    assert len(lines) == 1


def test_an_outage_that_ends_as_the_run_ends_gets_its_end_line(monkeypatch):
    # The last look of the scheduling loop may come before the last replies: the summary looks once more.
    lines = outage_lines(monkeypatch, (10, 1, 9), summary=True)
    assert lines[-1].startswith("the endpoint is up again, after")
