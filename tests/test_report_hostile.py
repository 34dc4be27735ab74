"""--report and --export against run directories no run writes: rows edited or appended by hand, fields
of the wrong type, files in the run directory that are not regular files. Each case gets the page or the
export the rows allow, or one error line saying what is wrong and how to fix it; never a traceback, a
hang, or a figure that disagrees with what resume and the merge count.

Small synthetic runs, read in process: fast, and independent of the scripted endpoint.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import stat
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import made_a_fifo_once_checked, read_jsonl

from batchrun import export, report, rows
from batchrun.export import files as export_files
from batchrun.report import scan as report_scan
from batchrun.rows import AssistantTurn, SessionResult, ToolCallRecord, Usage
from batchrun.run_dir import RunDirectoryError
from batchrun.run_dir import scan as scan_module
from batchrun.run_dir.directory import require_regular_files
from batchrun.run_dir.reading import lines_at
from batchrun.run_dir.scan import scan_files

COST = 0.25


def session(index: int) -> SessionResult:
    """A completed session with one tool call and reasoning in every turn: a row every filter keeps."""
    prompt = f"prompt {index}"
    turns = [AssistantTurn("thinking", "", [ToolCallRecord("call_0", "terminal", '{"command": "ls"}',
                                                           '{"output": "a.txt"}')]),
             AssistantTurn("thinking", "Done.")]
    return SessionResult(prompt_index=index, content_key=rows.content_key(prompt, None, None), prompt=prompt,
                         toolsets=["terminal"], offered_tools=["terminal"], turns=turns, api_calls=2,
                         usage=Usage(100, 10, 5, 0, COST), wall_time=1.0, end_reason="final_answer")


def finished_line(index: int) -> bytes:
    return rows.encode_row(rows.trajectory_row(session(index), batch_num=0, model="m",
                                               timestamp="2026-01-01T00:00:00"))


def write_run(run_dir: Path, batches: list[list[bytes]]) -> Path:
    run_dir.mkdir(parents=True)
    for number, lines in enumerate(batches):
        (run_dir / f"batch_{number}.jsonl").write_bytes(b"".join(lines))
    return run_dir


def scanned(run_dir: Path) -> report.RunScan:
    scan = report.RunScan(run_dir)
    scan.read_new_rows()
    return scan


def page_of(run_dir: Path) -> str:
    """The page of the run, without its plots (drawing them takes seconds, and none of these tests looks at them)."""
    scan = scanned(run_dir)
    return report.render(run_dir, scan.summary, scan.sample, report.Plots({}, "", scan.summary.row_count))


def exported(run_dir: Path, out: Path, fmt: str = "sharegpt") -> export.ExportSummary:
    return export.export_run(export.ExportOptions(format=fmt, run_dir=run_dir, out=out))


# -- a finished row appended twice: counted once, as resume and the merge count it -----------------------


@pytest.fixture
def repeated_run(tmp_path: Path) -> Path:
    """Three finished rows, the first appended once more to its own batch file and once to another."""
    first = finished_line(0)
    return write_run(tmp_path / "data" / "run", [[first, finished_line(1), first], [finished_line(2), first]])


def test_the_report_counts_a_finished_row_appended_twice_once(repeated_run: Path) -> None:
    summary = scanned(repeated_run).summary
    assert summary.row_count == 3 and summary.statuses[rows.COMPLETED] == 3
    assert summary.usage["cost"] == pytest.approx(3 * COST) and summary.tools["terminal"][0] == 3


def test_the_report_says_how_many_repeated_rows_it_left_out(repeated_run: Path) -> None:
    assert "<b>repeated rows</b> 2" in page_of(repeated_run)


def test_an_export_writes_a_finished_row_appended_twice_once_and_says_so(repeated_run: Path, tmp_path: Path) -> None:
    summary = exported(repeated_run, tmp_path / "out.jsonl")
    written = read_jsonl(tmp_path / "out.jsonl")
    assert sorted(row["prompt_index"] for row in written) == [0, 1, 2]
    assert (summary.kept, dict(summary.dropped)) == (3, {"repeated": 2})
    assert any(line.strip().startswith("2 repeated") for line in summary.lines())


def test_best_of_counts_a_prompt_whose_row_was_appended_twice_with_one_good_sample(repeated_run: Path,
                                                                                   tmp_path: Path) -> None:
    summary = export.export_run(export.ExportOptions(format="sharegpt", run_dir=repeated_run,
                                                     out=tmp_path / "out.jsonl", best_of="first_completed"))
    assert summary.best_of is not None and summary.best_of.spread() == {"1": 3}
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 3


def test_the_report_following_a_run_leaves_out_the_repeats_the_resume_scan_found(repeated_run: Path) -> None:
    scan = report.RunScan(repeated_run, repeated=scan_files(sorted(repeated_run.glob("batch_*.jsonl"))).repeats)
    scan.read_new_rows()
    assert (scan.summary.row_count, scan.summary.repeated_rows) == (3, 2)


# The report's helper follows a run from its start to its end: telling every finished row from repeats
# of it took a key per prompt, memory that grew with the run (about 110 MB a million prompts).
def test_the_report_following_a_run_without_repeats_holds_nothing_per_prompt(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "data" / "run", [[finished_line(index) for index in range(2_000)]])
    tracemalloc.start()
    try:
        scan = report.RunScan(run_dir, repeated=frozenset())
        scan.read_new_rows()
        following = tracemalloc.get_traced_memory()[0]
        scan = report.RunScan(run_dir)
        scan.read_new_rows()
        standalone = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert scan.summary.row_count == 2_000
    assert standalone - following > 2_000 * 50       # --report alone keeps a key per finished prompt


def test_the_resume_scan_counts_what_a_repeated_row_spent_once(repeated_run: Path) -> None:
    scan = scan_files(sorted(repeated_run.glob("batch_*.jsonl")))
    assert scan.usage["cost"] == pytest.approx(3 * COST) and scan.usage["prompt_tokens"] == 300
    assert scan.rows_by_status[rows.COMPLETED] == 3


def test_the_resume_scan_shared_out_over_processes_counts_what_a_repeated_row_spent_once(
        repeated_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan_module, "read_processes", lambda files: 2)
    scan = scan_files(sorted(repeated_run.glob("batch_*.jsonl")))
    assert scan.usage["cost"] == pytest.approx(3 * COST) and scan.usage["prompt_tokens"] == 300
    assert scan.repeats == {rows.unit_key(0, rows.content_key("prompt 0", None, None)): 2}


# -- fields of the wrong type ----------------------------------------------------------------------------


def page_rows(run_dir: Path) -> list[dict]:
    page = page_of(run_dir)
    start = page.index('<script type="application/json" id="report-data">')
    return json.loads(page[page.index(">", start) + 1:page.index("</script>", start)])["rows"]


def failure_line(index: int, **edits: object) -> bytes:
    result = session(index)
    result.end_reason, result.error, result.error_type = "error", "HTTP 400", "http_400"
    return rows.encode_row({**rows.failure_row(result), **edits})


# A failure row (or a tombstone) keeps its prompt as a field the row reader does not check: a number there
# was a TypeError and no page; an object was embedded as it was, and the browser's search and list, which
# read it as text, stopped with a TypeError.
@pytest.mark.parametrize("prompt", [5, {"text": ["a"]}, ["a", 1], True], ids=["number", "object", "list", "bool"])
def test_a_failure_row_whose_prompt_is_not_text_is_shown_with_its_prompt_as_json_text(tmp_path: Path,
                                                                                      prompt: object) -> None:
    run_dir = write_run(tmp_path / "data" / "run", [[finished_line(0), failure_line(1, prompt=prompt)]])
    shown = {row["s"]: row["p"] for row in page_rows(run_dir)}
    assert shown == {"completed": "prompt 0", "failed": json.dumps(prompt, ensure_ascii=False)}


# -- files of the run directory that are not regular files ---------------------------------------------


class StillWaiting(Exception):
    """Not an OSError, which the code under test may catch and go on to the next read."""


@contextlib.contextmanager
def at_most(seconds: int) -> Iterator[None]:
    """A read that would wait for ever (a FIFO with no writer) fails the test instead of hanging it."""
    def interrupt(signum: int, frame: object) -> None:
        raise StillWaiting(f"still waiting after {seconds} s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


READ_BY_THE_REPORT = ("checkpoint.json", "statistics.json", "relocations.json")
READ_BY_THE_EXPORT = ("checkpoint.json", "relocations.json")


def with_a_fifo(tmp_path: Path, name: str) -> Path:
    run_dir = write_run(tmp_path / "data" / "run", [[finished_line(0)]])
    os.mkfifo(run_dir / name)
    return run_dir


# --report and --export read these files beside the batch files; a FIFO there held them for ever (a link to
# /dev/zero filled memory), where the run refuses both before it starts.
@pytest.mark.parametrize("name", READ_BY_THE_REPORT)
def test_the_report_refuses_a_file_beside_the_rows_that_is_a_fifo_naming_it(tmp_path: Path, name: str) -> None:
    run_dir = with_a_fifo(tmp_path, name)
    with at_most(5), pytest.raises(RunDirectoryError, match=rf"{name} is not a regular file.*Move it out of"):
        report.write_report(run_dir)
    assert not (run_dir / report.REPORT_FILE).exists()


@pytest.mark.parametrize("name", READ_BY_THE_EXPORT)
def test_an_export_refuses_a_file_beside_the_rows_that_is_a_fifo_naming_it(tmp_path: Path, name: str) -> None:
    run_dir = with_a_fifo(tmp_path, name)
    out = tmp_path / "out.jsonl"
    out.write_text("an earlier export\n")
    with at_most(5), pytest.raises(RunDirectoryError, match=rf"{name} is not a regular file.*Move it out of"):
        exported(run_dir, out)
    assert out.read_text() == "an earlier export\n"


# The page reads the checkpoint and the statistics once the checks above are done; one made a FIFO after
# it was looked at (another program at work in the directory) was opened, and waited on for a writer for ever.
@pytest.mark.parametrize("name", ("checkpoint.json", "statistics.json"))
def test_the_report_never_waits_on_a_record_made_a_fifo_after_it_was_looked_at(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    run_dir = write_run(tmp_path / "data" / "run", [[finished_line(0)]])
    record = run_dir / name
    record.write_text(json.dumps({"distribution": "default"}))
    made_a_fifo_once_checked(monkeypatch, record, "is_file")
    require_regular_files(run_dir, (name,))     # the report's look at it, passed ...
    with at_most(5):
        read = report_scan.read_json(record)    # ... and its read, after the FIFO took its place
    assert read in ({}, {"distribution": "default"})      # what it held, or nothing: never a wait
    assert stat.S_ISFIFO(os.lstat(record).st_mode)


# Every reader of the run's JSONL files (the resume scan, the merge, the export, the spent ledger, the report
# and its helper following a run) reads through lines_at, after the file was listed by stat: one made a FIFO in
# between was opened and waited on for a writer for ever (the helper held the run's end with it).
def test_a_jsonl_file_made_a_fifo_after_it_was_listed_is_refused_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "batch_0.jsonl")
    with at_most(5), pytest.raises(RunDirectoryError, match=r"batch_0.jsonl is not a regular file.*Move it out of"):
        list(lines_at(tmp_path / "batch_0.jsonl"))


# Any other reader of these records reads through the report's: it must not wait on a FIFO either.
def test_the_reports_reader_of_a_record_says_nothing_of_a_fifo_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "statistics.json")
    with at_most(5):
        assert report_scan.read_json(tmp_path / "statistics.json") == {}


def test_export_flags_never_open_a_checkpoint_that_is_a_fifo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with_a_fifo(tmp_path, "checkpoint.json")
    monkeypatch.chdir(tmp_path)
    with at_most(5):
        options = export.export_options(export="sharegpt", run_name="run", out="out.jsonl", reasoning=None,
                                        discard_no_reasoning=None, discard_invented=True, end_reasons=None,
                                        min_tool_calls=0, last_call_succeeded=False)
    assert options.out == Path("out.jsonl")


# -- what an export writes beside --out ---------------------------------------------------------------------


# The record of a --best_of choice goes beside --out (and an export without --best_of removes an earlier
# one). Where a directory stood there, the export replaced --out and then failed on the record: exit 1 and
# "cannot write", with the earlier export already gone.
@pytest.mark.parametrize("best_of", [None, "first_completed"], ids=["without_best_of", "with_best_of"])
def test_an_export_whose_best_of_record_is_a_directory_is_refused_before_it_writes(tmp_path: Path,
                                                                                  best_of: str | None) -> None:
    run_dir = write_run(tmp_path / "data" / "run", [[finished_line(0)]])
    out = tmp_path / "out.jsonl"
    out.write_text("an earlier export\n")
    (tmp_path / "out.best_of.json").mkdir()
    with pytest.raises(export.ExportError, match=r"out\.best_of\.json is a directory.*remove it or choose another"):
        export.export_run(export.ExportOptions(format="sharegpt", run_dir=run_dir, out=out, best_of=best_of))
    assert out.read_text() == "an earlier export\n"


def test_an_export_to_a_folder_that_cannot_be_locked_is_written_all_the_same(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # NFS refuses a lock on a directory (EBADF, or ENOLCK where it is mounted nolock): every export there
    # failed once exports to one folder waited for each other.
    def refused(descriptor: int, operation: int) -> None:
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(export_files.fcntl, "flock", refused)
    run_dir = write_run(tmp_path / "data" / "run", [[finished_line(0)]])
    out = tmp_path / "out.jsonl"
    assert export.export_run(export.ExportOptions(format="sharegpt", run_dir=run_dir, out=out)).kept == 1
    assert len(out.read_text().splitlines()) == 1


# -- nesting at the edge of what Python reads -----------------------------------------------------------------


def nested_line(index: int, depth: int) -> bytes:
    """A finished row with a key of its own added by hand, nested ``depth`` lists deep."""
    return finished_line(index)[:-2] + b', "added": ' + b"[" * depth + b"]" * depth + b"}\n"


# Python's recursion limit bounds how deep JSON can be read, counted from the depth of the stack that reads
# it; the row reader read such a row, and the report's and the export's second reading of the row, from
# deeper in the stack, ended in a RecursionError traceback.
NEAR_THE_LIMIT = range(sys.getrecursionlimit() - 120, sys.getrecursionlimit() + 1)


def test_a_row_nested_near_the_limit_of_what_python_reads_still_gives_the_page(tmp_path: Path) -> None:
    for depth in NEAR_THE_LIMIT:
        run_dir = write_run(tmp_path / f"depth_{depth}" / "data" / "run", [[finished_line(0), nested_line(1, depth)]])
        assert "prompt 0" in page_of(run_dir)


def test_a_row_nested_near_the_limit_of_what_python_reads_is_exported_or_named(tmp_path: Path) -> None:
    for depth in NEAR_THE_LIMIT:
        run_dir = write_run(tmp_path / f"depth_{depth}" / "data" / "run", [[finished_line(0), nested_line(1, depth)]])
        try:
            summary = exported(run_dir, tmp_path / "out.jsonl", "openai")
        except export.ExportError as exc:
            assert "batch_0.jsonl line 2: not a batch_runner row (JSON nested deeper than any row)" in str(exc)
        else:
            assert summary.kept == 2


# -- huge texts ------------------------------------------------------------------------------------------------

HUGE = "x" * 1_000_000


def huge_field(field: str) -> bytes:
    """A row with ``field`` edited by hand to a megabyte of text."""
    row = json.loads(finished_line(1))
    if field == "error_type":
        return failure_line(1, error_type=HUGE)
    if field == "discarded":
        return rows.encode_row({**rows.tombstone_row(row, rows.NO_REASONING), "discarded": HUGE})
    if field == "model":
        row["metadata"]["model"] = HUGE
    elif field == "toolset":
        row["toolsets_used"].append(HUGE)
        row["toolsets_sampled"].append(HUGE)
    elif field == "tool":
        row["tool_stats"][HUGE] = {"count": 1, "success": 1, "failure": 0}
    elif field == "tool_call_id":       # a tool turn's result answers its call by id: the last turns, always shown
        payload = json.dumps({"tool_call_id": HUGE, "name": "terminal", "content": "ok"})
        row["conversations"].append({"from": "tool", "value": f"<tool_response>\n{payload}\n</tool_response>"})
    else:
        row[field] = HUGE
    return rows.encode_row(row)


# The page trims every long text of a row, as it trims turns: a megabyte edited into one of the fields it
# shows beside them was embedded whole, twice or three times (the trajectory's facts, a table), for each of
# up to 500 sampled rows.
@pytest.mark.parametrize("field", ["end_reason", "api_calls", "model", "toolset", "tool", "error_type", "discarded",
                                   "tool_call_id"])
def test_a_huge_text_in_any_field_of_a_row_is_trimmed_on_the_page(tmp_path: Path, field: str) -> None:
    plain = page_of(write_run(tmp_path / "plain" / "data" / "run", [[finished_line(0), finished_line(1)]]))
    page = page_of(write_run(tmp_path / "huge" / "data" / "run", [[finished_line(0), huge_field(field)]]))
    assert len(page) < len(plain) + 20_000
