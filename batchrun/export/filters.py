"""Which of a run's rows an export keeps: each row read from the batch files and tried against the
filters, the first reason to leave it out counted (DROP_REASONS), whatever the format.

The source is the batch files, not trajectories.jsonl: only they hold the rows the run's own filters
left out (tombstones keep their whole trajectory, corrupted rows stay where they were written), so a
filter can be turned off here as well as on. Each prompt counts by its latest attempt, as in the merge:
failure rows hold no trajectory, and corrupted rows that a ``--rerun_corrupted`` resume replaced
(``superseded_corrupted`` in checkpoint.json) are earlier attempts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from batchrun import rows
from batchrun.export.conversations import Candidate, ConversionError
from batchrun.export.formats import EXPORT_FORMATS
from batchrun.export.options import ExportOptions, refused_line
from batchrun.run_dir import RunDirectory, lines_at, superseded_corrupted
from batchrun.run_dir.scan import FirstFinished

# Why a row was left out, in the order the reasons are tried: each row is counted under the first.
DROP_REASONS = {
    "failed": "failure rows: no trajectory (--resume retries them)",
    "unreadable": "lines that are not JSON (cut short by a crash)",
    "repeated": "finished rows appended twice (resume and the merge count each once)",
    "prompt_gone": "prompts no longer in the dataset (--resume with their lines back brings them back)",
    "superseded": "corrupted attempts a --rerun_corrupted resume redid",
    "no_trajectory": "older tombstones, which kept no trajectory",
    "invented_tools": "called tools not offered (--discard_invented=False)",
    "no_reasoning": "no reasoning (--discard_no_reasoning=False)",
    "end_reason": "an end reason that --end_reasons does not list",
    "min_tool_calls": "fewer tool calls than --min_tool_calls",
    "last_call_failed": "the last tool call failed or got no result",
    "unfinished": "no answer after the last tool call (--export=sharegpt keeps them)",
    "unconvertible": "turns that do not read as one conversation",
    "best_of": "another sample of the prompt was chosen, or none was good (--best_of)",
}


def selected_rows(options: ExportOptions, dropped: Counter,
                  on_row: Callable[[rows.StoredRow], None] | None = None) -> Iterator[Candidate]:
    """The run's rows that pass every filter, in batch file order; the others counted by reason in
    ``dropped``. ``on_row`` sees every readable row of a prompt in the dataset, kept or not."""
    directory = RunDirectory(options.run_dir)
    superseded = superseded_corrupted(directory.read_checkpoint() or {})
    relocated = directory.relocations()
    first_finished = FirstFinished()
    for path in directory.batch_files():
        for offset, line in lines_at(path):
            try:
                stored = rows.read_stored_row(line)
            except rows.RowError as exc:
                raise refused_line(path, offset, str(exc)) from None
            if stored is None:
                dropped["unreadable"] += 1
                continue
            if first_finished.is_repeat(stored):
                dropped["repeated"] += 1
                continue
            if relocated:
                stored.relocate(relocated)
                if stored.placeless:    # no prompt of the dataset is its, so on_row does not count one for it
                    dropped["prompt_gone"] += 1
                    continue
            if on_row is not None:
                on_row(stored)
            candidate = Candidate(stored, path, offset)
            try:
                reason = drop_reason(candidate, options, superseded)
            except ConversionError:
                reason = "unconvertible"
            if reason is None:
                yield candidate
            else:
                dropped[reason] += 1


def drop_reason(candidate: Candidate, options: ExportOptions, superseded: Counter) -> str | None:
    """Why this row is left out (the first of DROP_REASONS that applies), or None to keep it.
    ``superseded`` counts down as the earlier attempts it names go by."""
    stored = candidate.stored
    if stored.status == rows.FAILED:
        return "failed"
    invented = stored.invented_tools()
    if invented and stored.status != rows.DISCARDED and superseded[stored.sample_key] > 0:
        superseded[stored.sample_key] -= 1
        return "superseded"
    discarded = stored.discard_reason()
    if discarded is not None and discarded != rows.NO_REASONING:
        return discarded
    if invented and options.discard_invented:
        return "invented_tools"
    # Unless told, as the run decided for each row: a tombstone is a row its filter discarded, and a
    # row without reasoning that is no tombstone was written with the filter off.
    if (discarded == rows.NO_REASONING if options.discard_no_reasoning is None
            else options.discard_no_reasoning and stored.reasoning_counts()[0] == 0):
        return "no_reasoning"
    if discarded is not None and candidate.row.get("conversations") is None:
        return "no_trajectory"
    if options.end_reasons is not None and stored.end_reason() not in options.end_reasons:
        return "end_reason"
    chat_messages = EXPORT_FORMATS[options.format].chat_messages
    if chat_messages or options.min_tool_calls > 0 or options.last_call_succeeded:
        calls = candidate.conversation.calls()     # also proves the row converts
        if len(calls) < options.min_tool_calls:
            return "min_tool_calls"
        if options.last_call_succeeded and calls and (calls[-1].result is None
                                                      or rows.tool_result_failed(calls[-1].result)):
            return "last_call_failed"
        if chat_messages and not candidate.conversation.ends_on_an_answer():
            return "unfinished"
    return None

