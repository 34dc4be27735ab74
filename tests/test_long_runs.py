"""Nothing grows with the length of a run: open descriptors, and what the parent, the dataset
reader and the report's helper hold, depend on the prompts in flight, not on the prompts done."""

from __future__ import annotations

import json
import os
import pathlib
import resource
import subprocess
import sys
import tracemalloc
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import (
    REPO,
    batch_rows,
    batch_runner_command,
    cli_environment,
    endpoint_args,
    finished_row_count,
    read_jsonl,
    run_cli,
    write_dataset,
)
from test_report import page_data

from batchrun import report, rows
from batchrun.dataset import iter_pending, plan_dataset
from batchrun.report.summary import MAX_INVENTED_NAMES, RunSummary
from batchrun.report_follower import BatchFollower, OpenBatches
from batchrun.run_dir import RunDirectory


def limited_to(soft: int, hard: int) -> Callable[[], None]:
    """preexec_fn: the child starts with these limits on open descriptors, as under ``ulimit -n``."""
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def run_limited(tmp_path: Path, endpoint, prompts: list[str], soft: int, hard: int, *extra: str):
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    return subprocess.run(
        batch_runner_command(f"--dataset_file={dataset}", "--run_name=run", "--distribution=terminal_only",
                             *endpoint_args(endpoint), *extra),
        cwd=tmp_path, env=cli_environment(tmp_path, {"TERMINAL_ENV": "local"}), capture_output=True, text=True,
        timeout=300, stdin=subprocess.DEVNULL, preexec_fn=limited_to(soft, hard))


def test_a_run_of_more_batch_files_than_it_may_open_descriptors_writes_every_row(tmp_path, endpoint):
    prompts = [f"question {number}" for number in range(400)]
    result = run_limited(tmp_path, endpoint, prompts, 200, 200, "--batch_size=1", "--num_workers=4")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    run_dir = tmp_path / "data" / "run"
    assert len(list(run_dir.glob("batch_*.jsonl"))) == 400
    assert sorted(row["prompt_index"] for row in read_jsonl(run_dir / "trajectories.jsonl")) == list(range(400))


def test_sessions_in_flight_are_not_held_to_a_soft_descriptor_limit_below_the_hard_one(tmp_path, endpoint):
    # 256 sessions in 4 worker processes, every one in a command at once: each holds the command's
    # pipes and its connection to the endpoint, far more than 128 descriptors per process.
    prompts = [f'[[call terminal {{"command": "sleep 1; echo {number}"}}]] wait {number}' for number in range(256)]
    result = run_limited(tmp_path, endpoint, prompts, 128, 8192, "--batch_size=64", "--num_workers=256")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows_written = batch_rows(tmp_path / "data" / "run")
    assert len(rows_written) == 256 and all(row["completed"] for row in rows_written)
    assert all("Too many open files" not in json.dumps(row) for row in rows_written)


def test_the_run_directory_holds_no_descriptor_between_appends(tmp_path):
    directory = RunDirectory(tmp_path / "run")
    directory.acquire()
    before = len(os.listdir("/proc/self/fd"))
    for batch_num in range(300):
        directory.append(batch_num, b'{"row": %d}\n' % batch_num)
    assert len(os.listdir("/proc/self/fd")) == before
    directory.release()


def test_the_open_file_limit_is_lifted_to_the_hard_one(tmp_path):
    code = ("import resource; from batchrun.workers import raise_open_file_limit; raise_open_file_limit(); "
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                            preexec_fn=limited_to(100, 4096))
    assert result.stdout.split() == ["4096", "4096"]


# ---------------------------------------------------------------------------------------------
# Memory: what a structure holds after N prompts does not depend on N


def growth(warm_up: Callable[[], object], step: Callable[[], object]) -> int:
    """How much more memory Python holds after ``step`` than after ``warm_up`` (both traced, so what
    ``step`` frees of what ``warm_up`` made counts too). Left out: the interpreter's table of interned
    strings, which pathlib adds every new file name to and which grows in steps of its own."""
    ignored = [tracemalloc.Filter(False, pathlib.__file__), tracemalloc.Filter(False, tracemalloc.__file__)]
    tracemalloc.start()
    try:
        warm_up()
        before = tracemalloc.take_snapshot().filter_traces(ignored)
        step()
        after = tracemalloc.take_snapshot().filter_traces(ignored)
        return sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    finally:
        tracemalloc.stop()


def test_handing_out_prompts_holds_nothing_per_prompt_already_handed_out(tmp_path):
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"distinct prompt {number}" for number in range(30_000)])
    plan = plan_dataset(dataset, max_samples=None, done_units=Counter(), warn=print)
    records = iter_pending(plan)

    def hand_out(count: int) -> None:
        for _ in range(count):
            next(records)

    grown = growth(lambda: hand_out(1_000), lambda: hand_out(25_000))
    assert grown < 64 * 1024, f"{grown:,} bytes more after 25,000 more prompts"


def test_duplicates_keep_their_occurrence_numbers(tmp_path):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b", "a", "a", "b"])
    done = Counter({rows.unit_key(0, rows.content_key("a", None, None)): 1})
    plan = plan_dataset(dataset, max_samples=None, done_units=done, warn=print)
    found = [(record.prompt, record.occurrence) for record in iter_pending(plan)]
    assert found == [("b", 0), ("a", 1), ("a", 2), ("b", 1)]


@pytest.fixture(scope="module")
def stored_lines(tmp_path_factory) -> dict[str, bytes]:
    """One real row of each kind this module needs, as a run writes it."""
    from scripted_endpoint import ScriptedEndpoint

    home = tmp_path_factory.mktemp("rows")
    prompts = ['[[call terminal {"command": "echo hi"}]] plain', "[[call made_up_00000 {}]] invented"]
    with ScriptedEndpoint() as server:
        dataset = write_dataset(home / "dataset.jsonl", prompts)
        result = run_cli(home, f"--dataset_file={dataset}", "--batch_size=10", "--run_name=run",
                         "--distribution=terminal_only", *endpoint_args(server), env={"TERMINAL_ENV": "local"})
    assert result.returncode == 0, result.stderr
    lines = (home / "data" / "run" / "batch_0.jsonl").read_bytes().splitlines(keepends=True)
    by_index = {json.loads(line)["prompt_index"]: line for line in lines}
    return {"plain": by_index[0], "invented": by_index[1]}


def test_the_report_helper_holds_nothing_per_batch_file_the_run_is_done_with(tmp_path, stored_lines):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    open_batches = OpenBatches(8)
    follower = BatchFollower(report.RunScan(run_dir, repeated=frozenset()), open_batches)   # as in a run

    def run_through(first: int, last: int) -> None:
        """Batch files first..last each get their one row, as a run with --batch_size=1 writes them."""
        for number in range(first, last):
            open_batches.publish(number, [number])
            (run_dir / f"batch_{number}.jsonl").write_bytes(stored_lines["plain"])
            open_batches.publish(number, [])
            follower.read_new()

    # The trajectory sample fills its quotas within the first few thousand rows; after that it holds
    # as much as it lets go, give or take the row it holds and its tables' resizing: tens of KB whatever
    # the number of files. Anything kept per file (a name, an offset) is 36 bytes or more each.
    grown = growth(lambda: (follower.read_existing(), run_through(0, 3_000)), lambda: run_through(3_000, 11_000))
    assert grown < 8_000 * 16, f"{grown:,} bytes more after 8,000 more batch files"
    follower.read_new()
    assert follower.scan.summary.row_count == 11_000 and follower.scan.summary.batch_files == 11_000


def test_the_report_helper_holds_and_reads_nothing_per_batch_file_finished_behind_a_slow_prompt(
        tmp_path, stored_lines, monkeypatch):
    # The oldest prompt still running (a long tool call) held the helper's window open at its batch: every
    # file finished since was kept and read again every round, with --batch_size=1 one per row of the run.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    open_batches = OpenBatches(8)
    follower = BatchFollower(report.RunScan(run_dir, repeated=frozenset()), open_batches)
    reads = Counter[str]()
    read = BatchFollower._read

    def counted_read(self: BatchFollower, number: int) -> None:
        reads["files"] += 1
        read(self, number)
    monkeypatch.setattr(BatchFollower, "_read", counted_read)

    def run_through(first: int, last: int) -> None:
        for number in range(first, last):
            open_batches.publish(number, [0, number])       # batch 0's prompt runs all along
            (run_dir / f"batch_{number}.jsonl").write_bytes(stored_lines["plain"])
            open_batches.publish(number, [0])
            follower.read_new()

    grown = growth(lambda: (follower.read_existing(), run_through(1, 3_000)), lambda: run_through(3_000, 11_000))
    assert grown < 8_000 * 16, f"{grown:,} bytes more after 8,000 more batch files"
    assert reads["files"] < 3 * 11_000      # each file about twice (handed out, then finished), batch 0 each round
    (run_dir / "batch_0.jsonl").write_bytes(stored_lines["plain"])
    open_batches.publish(10_999, [])
    follower.read_new()
    assert follower.scan.summary.row_count == 11_000 and follower.scan.summary.batch_files == 11_000


def test_the_report_helper_reads_every_row_once_however_the_batches_close(tmp_path, stored_lines):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for number in range(5):                             # an earlier invocation's files
        (run_dir / f"batch_{number}.jsonl").write_bytes(stored_lines["plain"] * 2)
    open_batches = OpenBatches(8)
    follower = BatchFollower(report.RunScan(run_dir, repeated=frozenset()), open_batches)   # as in a run
    follower.read_existing()
    for number, still_open in ((1, [1]), (3, [1, 3]), (7, [1, 7]), (9, [1, 7, 9])):     # retries, then new files
        open_batches.publish(number, still_open)
        with (run_dir / f"batch_{number}.jsonl").open("ab") as handle:
            handle.write(stored_lines["plain"])
        follower.read_new()
    open_batches.publish(9, [9])                        # batches 1 and 7 finished between two rounds
    for number in (1, 7):
        with (run_dir / f"batch_{number}.jsonl").open("ab") as handle:
            handle.write(stored_lines["plain"])
    follower.read_new()
    with (run_dir / "batch_11.jsonl").open("ab") as handle:     # handed out and written after the last round
        handle.write(stored_lines["plain"])
    open_batches.publish(11, [])                        # the parent's last word, before it asks for the report
    follower.read_new()
    summary = follower.scan.summary
    assert summary.row_count == 10 + 7 and summary.batch_files == 8


def test_a_jump_of_the_highest_batch_is_walked_without_holding_it(tmp_path):
    # A resume whose first pending prompt lies millions of batches in (--batch_size=1): the helper made a set
    # of every batch number skipped, 275 MB for three million.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    open_batches = OpenBatches(8)
    follower = BatchFollower(report.RunScan(run_dir, repeated=frozenset()), open_batches)
    open_batches.publish(300_000, [300_000])
    tracemalloc.start()
    try:
        follower.read_new()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"{peak:,} bytes at the most"


def test_a_parent_killed_in_the_middle_of_its_word_leaves_the_helper_free_to_end():
    # Before, the helper waited for the word's end for ever, and never saw that its parent was gone.
    open_batches = OpenBatches(2)
    open_batches._shared[0] = 1             # odd: a word begun, never ended
    assert open_batches.snapshot() is None


def test_more_open_batches_than_places_leave_every_one_above_them_open():
    open_batches = OpenBatches(2)
    open_batches.publish(9, [1, 4, 6, 8])
    assert open_batches.snapshot() == (9, frozenset({1, 4}), 4)
    open_batches.publish(9, [1, 4])
    assert open_batches.snapshot() == (9, frozenset({1, 4}), None)


def test_the_report_a_run_draws_counts_every_row_once_when_retries_land_in_old_batch_files(tmp_path, endpoint):
    prompts = [f"[[fail 400 1]] question {number}" if number % 7 == 0 else f"question {number}"
               for number in range(60)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    args = [f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run", "--distribution=terminal_only",
            *endpoint_args(endpoint)]
    assert run_cli(tmp_path, *args, env={"TERMINAL_ENV": "local"}).returncode == 2      # 9 failed
    resumed = run_cli(tmp_path, *args, "--resume", env={"TERMINAL_ENV": "local"})
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    run_dir = tmp_path / "data" / "run"
    page = (run_dir / report.REPORT_FILE).read_text(encoding="utf-8")
    assert page_data(page)["total"] == finished_row_count(run_dir) == 60 + 9


def test_the_report_of_a_run_whose_first_prompt_outlasts_the_others_counts_every_row_once(tmp_path, endpoint):
    # The batches finished behind the slow prompt are forgotten by the helper once read; the slow one's is not.
    prompts = ["[[sleep 4]] slow question", *(f"question {number}" for number in range(1, 80))]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run",
                     "--distribution=minimal", "--num_workers=4", *endpoint_args(endpoint))
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "data" / "run"
    page = (run_dir / report.REPORT_FILE).read_text(encoding="utf-8")
    assert page_data(page)["total"] == finished_row_count(run_dir) == 80


def test_the_report_counts_the_rows_of_batches_handed_out_after_the_runners_last_periodic_word(tmp_path, endpoint):
    # The runner tells the helper the open batches at most every half second; a run this short hands most of
    # its batches out after its first word, and the helper's last read follows only what the runner says.
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"question {number}" for number in range(40)])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run",
                     "--distribution=minimal", "--num_workers=4", *endpoint_args(endpoint))
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "data" / "run"
    assert page_data((run_dir / report.REPORT_FILE).read_text(encoding="utf-8"))["total"] == 40


def test_the_report_helpers_last_read_lists_no_run_directory(tmp_path, stored_lines, monkeypatch):
    # It listed every batch file at the end (and again at the finish), holding a path per file: 100 MB and
    # 2 s for 200,000 files of a --batch_size=1 run.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    open_batches = OpenBatches(8)
    follower = BatchFollower(report.RunScan(run_dir, repeated=frozenset()), open_batches)
    follower.read_existing()
    for number in range(50):
        open_batches.publish(number, [number])
        (run_dir / f"batch_{number}.jsonl").write_bytes(stored_lines["plain"])
        follower.read_new()
    open_batches.publish(52, [])                        # 50 to 52 handed out and written since the last round
    for number in range(50, 53):
        (run_dir / f"batch_{number}.jsonl").write_bytes(stored_lines["plain"])

    def listed() -> list[Path]:
        raise AssertionError("the run directory was listed")
    monkeypatch.setattr(follower.scan.run_dir, "batch_files", listed)
    follower.read_new()
    assert follower.scan.summary.row_count == 53 and follower.scan.summary.batch_files == 53


def test_the_report_counts_a_bounded_number_of_distinct_invented_names(stored_lines):
    summary = RunSummary()
    for number in range(3 * MAX_INVENTED_NAMES):
        line = stored_lines["invented"].replace(b"made_up_00000", b"made_up_%05d" % number)
        row = rows.read_stored_row(line)
        assert row is not None and row.invented_tools() == [f"made_up_{number:05d}"]
        summary.add(row)
    assert len(summary.invented_tools) <= MAX_INVENTED_NAMES + 1
    assert sum(summary.invented_tools.values()) == 3 * MAX_INVENTED_NAMES
