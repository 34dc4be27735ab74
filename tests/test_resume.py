"""Resume: after kill -9, Ctrl-C or a normal end, every prompt is done exactly once."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest
from conftest import (
    REPO,
    REPORTED_COST,
    HeldReplies,
    OutputLines,
    batch_rows,
    batch_runner_command,
    cli_environment,
    default_stop_signals,
    endpoint_args,
    finished_row_count,
    human_prompt,
    last_user_message,
    paused_cli_command,
    process_state,
    read_jsonl,
    run_cli,
    spent_by_prompt,
    usage_of_replies,
    wait_for,
    write_dataset,
)

from batchrun import rows
from batchrun.dataset import plan_dataset
from batchrun.environments.base import run_identity
from batchrun.messages import Finished, Spent
from batchrun.report import summary
from batchrun.report.scan import RunScan
from batchrun.run_dir import DiskFull, RunDirectory, SpentLedger, lines_at, reading, scan_ranges, split_ranges


def base_args(tmp_path: Path, endpoint, dataset: Path, *extra: str, batch_size: int = 3) -> list[str]:
    return [f"--dataset_file={dataset}", f"--batch_size={batch_size}", "--run_name=run",
            "--distribution=terminal_only", *endpoint_args(endpoint), *extra]


def merged_prompts(tmp_path: Path) -> Counter:
    return Counter(human_prompt(row) for row in read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl"))


def test_kill_9_then_resume_runs_every_prompt_exactly_once_without_redoing_finished_ones(tmp_path, endpoint):
    prompts = [f"[[sleep 0.4]] slow prompt {i}" for i in range(16)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    run_dir = tmp_path / "data" / "run"
    process = subprocess.Popen(batch_runner_command(*base_args(tmp_path, endpoint, dataset, "--num_workers=4")),
                               cwd=tmp_path, env=cli_environment(tmp_path), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    wait_for(lambda: finished_row_count(run_dir) >= 5)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    done_before = {human_prompt(row) for row in batch_rows(run_dir)}
    assert 5 <= len(done_before) < 16
    endpoint.reset()

    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--num_workers=4", "--resume"))
    assert result.returncode == 0, result.stderr
    assert merged_prompts(tmp_path) == Counter(prompts)
    rerun = {last_user_message(request) for request in endpoint.requests}
    assert not rerun & done_before
    assert f"{len(done_before)} already done" in result.stdout


def test_workers_and_the_report_process_exit_when_the_parent_is_killed(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"[[sleep 5]] long {i}" for i in range(4)])
    process = subprocess.Popen(batch_runner_command(*base_args(tmp_path, endpoint, dataset, "--num_workers=2")),
                               cwd=tmp_path, env=cli_environment(tmp_path), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    wait_for(lambda: len(endpoint.requests) >= 2)
    children = [int(pid) for pid in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()]
    assert len(children) == 3      # two worker processes and the report's
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() and process_state(pid) != "Z" for pid in children), 10)


def test_the_helpers_reading_a_big_run_directory_exit_when_the_parent_is_killed(tmp_path):
    # A resume's scan, or a merge, of a run directory over PARALLEL_READ_MIN_BYTES reads it in forked
    # helpers: killed then, the parent left them waiting on their pipes for ever.
    reading = (f"import sys, time; sys.path.insert(0, {str(REPO)!r}); "
               "from batchrun.run_dir.reading import reading_pool; "
               "pool = reading_pool(2); [pool.submit(time.sleep, 30) for _ in range(2)]; "
               "print('reading', flush=True); time.sleep(30)")
    process = subprocess.Popen([sys.executable, "-c", reading], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "reading\n"
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    wait_for(lambda: len(children.read_text().split()) == 2, 10)
    helpers = [int(pid) for pid in children.read_text().split()]
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() and process_state(pid) != "Z" for pid in helpers), 10)


def test_ctrl_c_saves_finished_work_and_resume_completes(tmp_path, endpoint):
    prompts = [f"[[sleep 0.3]] prompt {i}" for i in range(10)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    run_dir = tmp_path / "data" / "run"
    process = subprocess.Popen(batch_runner_command(*base_args(tmp_path, endpoint, dataset, "--num_workers=2")),
                               cwd=tmp_path, env=cli_environment(tmp_path), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=default_stop_signals)
    wait_for(lambda: finished_row_count(run_dir) >= 2)
    os.killpg(process.pid, signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "--resume" in stdout and "Traceback" not in stderr
    assert "BATCH PROCESSING COMPLETE" not in stdout
    assert stdout.index("Interrupted.") < stdout.index("BATCH PROCESSING INTERRUPTED")
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0
    assert merged_prompts(tmp_path) == Counter(prompts)


def test_what_sessions_cut_off_by_ctrl_c_spent_counts_in_this_runs_usage(tmp_path, endpoint):
    """The first invocation's sessions were cut off after their first reply: statistics.json and the summary
    said "this run" spent nothing, beside a whole run that had spent it."""
    dataset = write_dataset(tmp_path / "dataset.jsonl", ['[[call terminal {"command": "sleep 60"}]] p0'])
    run_dir = tmp_path / "data" / "run"
    process = subprocess.Popen(batch_runner_command(*base_args(tmp_path, endpoint, dataset)), cwd=tmp_path,
                               env=cli_environment(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True, preexec_fn=default_stop_signals)
    wait_for(lambda: b'"spent"' in (run_dir / "spent.jsonl").read_bytes() if (run_dir / "spent.jsonl").exists()
             else False)
    os.killpg(process.pid, signal.SIGINT)
    said, _ = process.communicate(timeout=60)
    assert process.returncode == 130, said
    statistics = json.loads((run_dir / "statistics.json").read_text(encoding="utf-8"))
    assert statistics["this_run"]["usage"]["prompt_tokens"] > 0
    assert statistics["this_run"]["usage"] == statistics["usage"] == statistics["spent_by_unfinished_sessions"]


def start_paused(tmp_path: Path, module: str, name: str, *args: str) -> tuple[subprocess.Popen, OutputLines]:
    """The CLI in a session of its own (a terminal's Ctrl-C reaches its whole process group), pausing
    at ``name`` until tmp_path/go exists."""
    process = subprocess.Popen(paused_cli_command(module, name, tmp_path / "go", *args), cwd=tmp_path,
                               env=cli_environment(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True, preexec_fn=default_stop_signals)
    return process, OutputLines(process)


def stopped_output(process: subprocess.Popen, output: OutputLines) -> str:
    try:
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return output.text()


@pytest.mark.parametrize(("module", "name"), [
    ("batch_runner", "build_config"),                # before the run directory exists
    ("batchrun.runner", "plan_dataset"),             # the run directory locked, the dataset being read
    # An earlier run's leftovers being removed: a container engine that does not answer takes minutes.
    ("batchrun.runner", "BatchRunner._environment_settings"),
    ("batchrun.runner", "BatchRunner._start_pool"),  # the report's helper started, the workers starting
])
def test_ctrl_c_while_the_run_starts_says_so_in_one_line_and_resume_runs_every_prompt(tmp_path, endpoint,
                                                                                        module, name):
    prompts = [f"prompt {i}" for i in range(4)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    process, output = start_paused(tmp_path, module, name, *base_args(tmp_path, endpoint, dataset))
    output.wait_for(f"paused at {name}")
    os.killpg(process.pid, signal.SIGINT)
    said = stopped_output(process, output)
    assert process.returncode == 130, said
    assert "Traceback" not in said and "KeyboardInterrupt" not in said
    assert said.count("Interrupted.") == 1 and "--resume" in said
    assert not endpoint.requests
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0, result.stderr
    assert merged_prompts(tmp_path) == Counter(prompts)


@pytest.mark.parametrize(("signum", "code", "line"), [
    (signal.SIGINT, 130, "Interrupted."),
    (signal.SIGTERM, 143, "Stopped by SIGTERM."),     # before: killed by it, without a word
    (signal.SIGHUP, 129, "Stopped by SIGHUP."),
], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_stop_signal_while_the_program_loads_ends_it_in_one_line(tmp_path, endpoint, signum, code, line):
    """The modules take about half a second to load; Ctrl-C then printed Python's traceback of an import.
    ``-X importtime`` says when a module has loaded: the signal comes once fire has, with the project's
    own (most of the time) still to load."""
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["p"])
    process = subprocess.Popen([sys.executable, "-X", "importtime", *batch_runner_command(
        *base_args(tmp_path, endpoint, dataset))[1:]], cwd=tmp_path, env=cli_environment(tmp_path),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=default_stop_signals)
    output = OutputLines(process)
    output.wait_for("| fire\n")
    os.killpg(process.pid, signum)
    said = "".join(said_line for said_line in stopped_output(process, output).splitlines(keepends=True)
                   if not said_line.startswith("import time:"))
    assert process.returncode == code, said
    assert said == f"{line}\n"
    assert not (tmp_path / "data").exists() and not endpoint.requests


@pytest.mark.parametrize(("module", "name"), [
    ("batchrun.workers", "ProcessPool.stop"),           # the workers not stopped yet: nothing merged
    ("batchrun.run_dir", "RunDirectory.merge"),
    ("batchrun.report_follower", "ReportFollower.finish"),
])
def test_ctrl_c_again_while_the_run_stops_only_says_so_and_every_row_is_kept_and_merged(tmp_path, endpoint,
                                                                                         module, name):
    prompts = [f"[[sleep 0.3]] prompt {i}" for i in range(10)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    run_dir = tmp_path / "data" / "run"
    process, output = start_paused(tmp_path, module, name, *base_args(tmp_path, endpoint, dataset,
                                                                       "--num_workers=2"))
    wait_for(lambda: finished_row_count(run_dir) >= 2)
    os.killpg(process.pid, signal.SIGINT)
    output.wait_for(f"paused at {name}")
    os.killpg(process.pid, signal.SIGINT)
    output.wait_for("Already stopping")
    os.killpg(process.pid, signal.SIGINT)
    (tmp_path / "go").touch()
    said = stopped_output(process, output)
    assert process.returncode == 130, said
    assert "Traceback" not in said and "KeyboardInterrupt" not in said
    assert said.count("Interrupted.") == 1 and said.count("Already stopping") == 1
    assert "BATCH PROCESSING INTERRUPTED" in said
    kept = Counter(human_prompt(row) for row in batch_rows(run_dir))
    assert merged_prompts(tmp_path) == kept and len(kept) < len(prompts)
    assert json.loads((run_dir / "statistics.json").read_text())
    endpoint.reset()
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0, result.stderr
    assert merged_prompts(tmp_path) == Counter(prompts)
    assert not {last_user_message(request) for request in endpoint.requests} & set(kept)


def test_ctrl_c_just_after_a_row_was_received_keeps_it(tmp_path, endpoint):
    """The parent took a finished row from its worker and was stopped before writing it: the row was
    lost, and paid for again by the resume. Received is kept: only the wait for rows is interrupted."""
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["prompt 0"])
    process, output = start_paused(tmp_path, "batchrun.workers", "Places.give_back",     # right after recv()
                                   *base_args(tmp_path, endpoint, dataset))
    output.wait_for("paused at Places.give_back")
    os.killpg(process.pid, signal.SIGINT)
    (tmp_path / "go").touch()
    said = stopped_output(process, output)
    assert process.returncode == 130, said
    assert [human_prompt(row) for row in batch_rows(tmp_path / "data" / "run")] == ["prompt 0"]
    endpoint.reset()
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0, result.stderr
    assert endpoint.requests == []


@pytest.mark.parametrize(("module", "name", "extra"), [
    ("batchrun.workers", "ProcessPool.stop", ()),           # the workers stopping after the last row
    ("batchrun.run_dir", "RunDirectory.merge", ()),
    ("batchrun.run_dir", "RunDirectory.merge", ("--resume",)),     # a resume with nothing left to run
], ids=["workers_stopping", "merge", "merge_nothing_left"])
def test_a_stop_signal_once_every_prompt_has_run_stops_nothing_and_the_run_ends_complete(tmp_path, endpoint, module,
                                                                                           name, extra):
    """Every prompt had its row: the run said "Interrupted ... --resume to continue" (and BATCH PROCESSING
    INTERRUPTED, or COMPLETE before it) and exited 130, though there was nothing to continue."""
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["prompt 0"])
    if extra:
        assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset)).returncode == 0
    process, output = start_paused(tmp_path, module, name, *base_args(tmp_path, endpoint, dataset, *extra))
    output.wait_for(f"paused at {name}")
    os.killpg(process.pid, signal.SIGINT)
    (tmp_path / "go").touch()
    said = stopped_output(process, output)
    assert process.returncode == 0, said
    assert "Interrupted" not in said and "--resume" not in said and "BATCH PROCESSING COMPLETE" in said
    assert "A stop signal came once every prompt had run: it had nothing left to stop" in said
    assert merged_prompts(tmp_path) == Counter(["prompt 0"])


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGINT], ids=["nohup, terminal closed", "&, Ctrl-C"])
def test_a_run_started_with_a_stop_signal_ignored_goes_on_when_that_signal_comes(tmp_path, endpoint, signum):
    """nohup starts a command with SIGHUP ignored so that it outlives its terminal, and a shell script's
    background job (&) has SIGINT ignored so that it outlives Ctrl-C; the run took SIGHUP as a stop all the
    same, and the days-long run a user left behind stopped when the ssh session ended."""
    prompts = [f"[[sleep 0.3]] prompt {i}" for i in range(6)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    run_dir = tmp_path / "data" / "run"

    def as_started_ignoring_it() -> None:
        default_stop_signals()
        signal.signal(signum, signal.SIG_IGN)

    process = subprocess.Popen(batch_runner_command(*base_args(tmp_path, endpoint, dataset, "--num_workers=2")),
                               cwd=tmp_path, env=cli_environment(tmp_path), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               preexec_fn=as_started_ignoring_it)
    wait_for(lambda: finished_row_count(run_dir) >= 2)
    os.killpg(process.pid, signum)
    said, _ = process.communicate(timeout=60)
    assert process.returncode == 0, said
    assert "Stopped by" not in said
    assert merged_prompts(tmp_path) == Counter(prompts)


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)],
                         ids=["SIGTERM", "SIGHUP"])
def test_sigterm_or_sighup_to_the_process_group_stops_the_run_as_ctrl_c_does_and_exits_128_plus_it(
        tmp_path, endpoint, signum, code):
    """A job scheduler's stop, SIGTERM, or the terminal closed, SIGHUP: to every process of the job or
    of the terminal, workers included."""
    prompts = [f"[[sleep 0.3]] prompt {i}" for i in range(10)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    run_dir = tmp_path / "data" / "run"
    process = subprocess.Popen(batch_runner_command(*base_args(tmp_path, endpoint, dataset, "--num_workers=2")),
                               cwd=tmp_path, env=cli_environment(tmp_path), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               preexec_fn=default_stop_signals)
    wait_for(lambda: finished_row_count(run_dir) >= 2)
    os.killpg(process.pid, signum)
    said, _ = process.communicate(timeout=60)
    assert process.returncode == code, said
    assert "Traceback" not in said and "--resume" in said
    assert said.index(f"Stopped by {signum.name}.") < said.index("BATCH PROCESSING INTERRUPTED")
    written = batch_rows(run_dir)
    assert not [row for row in written if row.get("failed")]    # the workers stopped when told, not at the signal
    assert merged_prompts(tmp_path) == Counter(human_prompt(row) for row in written)
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0, result.stderr
    assert merged_prompts(tmp_path) == Counter(prompts)


def test_truncated_last_line_is_ignored_and_its_prompt_rerun(tmp_path, endpoint):
    prompts = [f"prompt {i}" for i in range(3)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset)).returncode == 0
    batch = tmp_path / "data" / "run" / "batch_0.jsonl"
    lines = batch.read_bytes().splitlines(keepends=True)
    cut = json.loads(lines[-1])
    batch.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])   # died mid-write
    endpoint.reset()

    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0, result.stderr
    assert [last_user_message(r) for r in endpoint.requests] == [human_prompt(cut)]
    assert merged_prompts(tmp_path) == Counter(prompts)


def test_duplicate_prompts_are_separate_units_of_work(tmp_path, endpoint):
    first = write_dataset(tmp_path / "first.jsonl", ["same", "other"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, first)).returncode == 0
    endpoint.reset()
    second = write_dataset(tmp_path / "second.jsonl", ["same", "same", "other", "same"])
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, second, "--resume"))
    assert result.returncode == 0
    assert [last_user_message(r) for r in endpoint.requests] == ["same", "same"]
    assert merged_prompts(tmp_path) == Counter({"same": 3, "other": 1})


def test_resume_runs_the_occurrence_of_a_repeated_prompt_whose_row_is_missing(tmp_path, endpoint):
    # The first request of the repeated text fails: prompt 0 gets a failure row, prompt 1 its trajectory.
    same = "[[fail 400 1]] [[final done]] same task"
    dataset = write_dataset(tmp_path / "dataset.jsonl", [same, same, "other task"])
    args = base_args(tmp_path, endpoint, dataset, "--num_workers=1", batch_size=10)
    assert run_cli(tmp_path, *args).returncode == 2
    before = len(endpoint.requests)     # not reset: the failure was the text's only one
    result = run_cli(tmp_path, *args, "--resume")
    assert result.returncode == 0, result.stderr
    assert [last_user_message(request) for request in endpoint.requests[before:]] == [same]
    merged = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    assert sorted(row["prompt_index"] for row in merged) == [0, 1, 2]


def test_an_edited_line_runs_again_and_its_old_row_counts_for_no_other_line(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b", "a"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset)).returncode == 0
    endpoint.reset()
    write_dataset(dataset, ["a", "b", "c", "a"])      # the second "a" edited, then one more "a"
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0, result.stderr
    # Row 2 ("a") no longer matches its line: it counts by content, for the new line 3.
    assert [last_user_message(request) for request in endpoint.requests] == ["c"]
    assert merged_prompts(tmp_path) == Counter({"a": 2, "b": 1, "c": 1})


def test_reordered_dataset_resumes_by_content(tmp_path, endpoint):
    prompts = [f"prompt {i}" for i in range(6)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--max_samples=3")).returncode == 0
    endpoint.reset()
    reordered = write_dataset(tmp_path / "reordered.jsonl", list(reversed(prompts)))
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, reordered, "--resume"))
    assert result.returncode == 0
    assert sorted(last_user_message(r) for r in endpoint.requests) == prompts[3:]
    assert merged_prompts(tmp_path) == Counter(prompts)


def unit_of(index: int, text: str, sample: int = 0) -> str:
    """The unit key of the row of ``text``'s sample written at ``index``."""
    return rows.unit_key(index, rows.sample_key(rows.content_key(text, None, None), sample))


def relocated(tmp_path: Path, lines: list[str], done: list[tuple[int, str, int]], *, samples_per_prompt: int = 1,
              failed: tuple[tuple[int, str, int], ...] = (), max_samples: int | None = None) -> dict[str, int]:
    """Where the planner finds, in ``lines``, the units of finished rows and failed ones, each named by
    the prompt index, text and sample index it was written with."""
    dataset = write_dataset(tmp_path / "planned.jsonl", lines)
    return plan_dataset(dataset, max_samples=max_samples, done_units=Counter(unit_of(*row) for row in done),
                        warn=lambda _warning: None, samples_per_prompt=samples_per_prompt,
                        other_units=[unit_of(*row) for row in failed]).relocated


def test_the_rows_whose_line_moved_are_found_where_their_prompt_is_now(tmp_path):
    assert relocated(tmp_path, ["c", "a", "b"], [(0, "a", 0), (1, "b", 0), (2, "c", 0)]) == \
        {unit_of(0, "a"): 1, unit_of(1, "b"): 2, unit_of(2, "c"): 0}


def test_rows_on_a_line_that_still_holds_their_prompt_are_not_relocated(tmp_path):
    assert relocated(tmp_path, ["a", "b"], [(0, "a", 0), (1, "b", 0)]) == {}
    # Samples past --samples_per_prompt on their own line: not counted now, and not moved either.
    assert relocated(tmp_path, ["a"], [(0, "a", 0), (0, "a", 1)]) == {}


def test_a_prompt_no_longer_in_the_dataset_has_no_place(tmp_path):
    assert relocated(tmp_path, ["b"], [(0, "a", 0)]) == {unit_of(0, "a"): None}


def test_a_failed_row_is_found_where_its_content_is_now(tmp_path):
    assert relocated(tmp_path, ["b", "a"], [], failed=((0, "a", 0),)) == {unit_of(0, "a"): 1}
    assert relocated(tmp_path, ["a", "b"], [], failed=((0, "a", 0),)) == {}
    # A failed row of a text on two lines: which of them it was a try of is not known, so it has no place.
    assert relocated(tmp_path, ["a", "a"], [], failed=((3, "a", 0),)) == {unit_of(3, "a"): None}


def test_each_row_of_a_repeated_prompt_goes_to_the_line_it_counted_for(tmp_path):
    # "a" was on lines 0 and 2: line 2 still holds it, line 0's rows count for the "a" now on line 1.
    assert relocated(tmp_path, ["b", "a", "a"], [(0, "a", 0), (2, "a", 0)], samples_per_prompt=2) == \
        {unit_of(0, "a"): 1}
    # "a" at 0 has only its second sample, "a" at 1 both: each sample goes to a line without one.
    places = relocated(tmp_path, ["x", "y", "a", "a"], [(0, "a", 1), (1, "a", 0), (1, "a", 1)],
                       samples_per_prompt=2, failed=((0, "a", 0),))
    assert places[unit_of(1, "a", 0)] == 2 and {places[unit_of(0, "a", 1)], places[unit_of(1, "a", 1)]} == {2, 3}


def test_a_prompt_moved_past_max_samples_is_found_where_it_is_now(tmp_path):
    assert relocated(tmp_path, ["b", "a"], [(0, "a", 0)], max_samples=1) == {unit_of(0, "a"): 1}


def test_a_finished_sample_a_line_already_has_has_no_place(tmp_path):
    # "a" was on two lines and is on one now: the second line's row is one sample too many there.
    assert relocated(tmp_path, ["a"], [(0, "a", 0), (1, "a", 0)], samples_per_prompt=2) == {unit_of(1, "a"): None}
    assert relocated(tmp_path, ["b", "a"], [(0, "a", 0), (2, "a", 0)], max_samples=1) == \
        {unit_of(0, "a"): 1, unit_of(2, "a"): None}


def test_a_finished_sample_of_a_text_on_several_lines_that_each_have_it_has_no_place(tmp_path):
    # "a" was on three lines and is on two now, each with its own row: the third row is one too many.
    assert relocated(tmp_path, ["a", "a", "c"], [(0, "a", 0), (1, "a", 0), (2, "a", 0)]) == {unit_of(2, "a"): None}


def merged_places(run_dir: Path) -> list[tuple[int, int, str]]:
    return sorted((row["prompt_index"], row["sample_index"], human_prompt(row))
                  for row in read_jsonl(run_dir / "trajectories.jsonl"))


def test_the_row_of_an_edited_line_is_left_out_of_the_merged_file_and_counted(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["alpha", "bteta typo", "gamma"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset)).returncode == 0
    write_dataset(dataset, ["alpha", "beta fixed", "gamma"])
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "data" / "run"
    assert merged_places(run_dir) == [(0, 0, "alpha"), (1, 0, "beta fixed"), (2, 0, "gamma")]
    statistics = json.loads((run_dir / "statistics.json").read_text())
    assert statistics["completed_in_merged_file"] == 3
    assert statistics["filtered_prompt_gone"] == 1
    assert "no longer in the dataset" in statistics["filtered_prompt_gone_why"]
    assert "1 row left out: its prompt is no longer in the dataset" in " ".join(result.stdout.split())
    assert "bteta typo" in {human_prompt(row) for row in batch_rows(run_dir)}     # nothing written is lost


def test_the_row_of_a_removed_line_is_left_out_and_no_other_prompt_shares_its_place(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["A", "B", "C"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset)).returncode == 0
    write_dataset(dataset, ["A", "C"])
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "data" / "run"
    assert merged_places(run_dir) == [(0, 0, "A"), (1, 0, "C")]
    assert json.loads((run_dir / "statistics.json").read_text())["filtered_prompt_gone"] == 1


def test_the_samples_of_a_removed_line_are_left_out_of_the_per_prompt_figures(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["A", "B", "C"])
    args = ("--samples_per_prompt=2",)
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, *args)).returncode == 0
    write_dataset(dataset, ["A", "C"])
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, *args, "--resume"))
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "data" / "run"
    assert merged_places(run_dir) == [(0, 0, "A"), (0, 1, "A"), (1, 0, "C"), (1, 1, "C")]
    statistics = json.loads((run_dir / "statistics.json").read_text())
    assert statistics["samples"]["prompts_with_rows"] == 2
    assert statistics["samples"]["prompts_by_completed_samples"] == {"2": 2}
    assert statistics["filtered_prompt_gone"] == 2


def test_the_export_counts_only_the_prompts_still_in_the_dataset(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["A", "B", "C"])
    args = ("--samples_per_prompt=2",)
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, *args)).returncode == 0
    write_dataset(dataset, ["A", "C"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, *args, "--resume")).returncode == 0
    out = tmp_path / "out.jsonl"
    result = run_cli(tmp_path, "--run_name=run", "--export=sharegpt", "--best_of=first_completed", f"--out={out}")
    assert result.returncode == 0, result.stderr
    assert "2 of 2 prompts kept" in result.stdout
    assert "prompt_gone" in result.stdout
    assert sorted((row["prompt_index"], human_prompt(row)) for row in read_jsonl(out)) == [(0, "A"), (1, "C")]


def test_the_report_leaves_out_the_rows_of_a_removed_line(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["A", "B", "C"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset)).returncode == 0
    write_dataset(dataset, ["A", "C"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume")).returncode == 0
    scan = RunScan(tmp_path / "data" / "run")
    scan.read_new_rows()
    assert scan.summary.kept == 2 and scan.summary.statuses[summary.PROMPT_GONE] == 1


def test_putting_a_removed_line_back_brings_its_row_back_without_running_it(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["A", "B", "C"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset)).returncode == 0
    write_dataset(dataset, ["A", "C"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume")).returncode == 0
    endpoint.reset()
    write_dataset(dataset, ["A", "B", "C"])
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0, result.stderr
    assert endpoint.requests == []
    run_dir = tmp_path / "data" / "run"
    assert merged_places(run_dir) == [(0, 0, "A"), (1, 0, "B"), (2, 0, "C")]
    assert json.loads((run_dir / "statistics.json").read_text())["filtered_prompt_gone"] == 0
    assert not (run_dir / "relocations.json").exists()


def test_a_resume_over_an_unchanged_dataset_writes_no_record_of_relocations(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["A", "B", "C"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--max_samples=2")).returncode == 0
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "data" / "run"
    assert not (run_dir / "relocations.json").exists()
    assert "no longer in the dataset" not in result.stdout
    assert json.loads((run_dir / "statistics.json").read_text())["filtered_prompt_gone"] == 0


def test_after_the_dataset_is_put_back_in_order_the_rows_name_their_own_places_again(tmp_path, endpoint):
    prompts = [f"prompt {i}" for i in range(3)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset)).returncode == 0
    write_dataset(dataset, prompts[::-1])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume")).returncode == 0
    run_dir = tmp_path / "data" / "run"
    assert (run_dir / "relocations.json").exists()
    assert {human_prompt(row): row["prompt_index"] for row in read_jsonl(run_dir / "trajectories.jsonl")} == \
        {prompt: 2 - index for index, prompt in enumerate(prompts)}
    write_dataset(dataset, prompts)
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume")).returncode == 0
    assert not (run_dir / "relocations.json").exists()
    assert {human_prompt(row): row["prompt_index"] for row in read_jsonl(run_dir / "trajectories.jsonl")} == \
        {prompt: index for index, prompt in enumerate(prompts)}


def test_an_unreadable_record_of_relocated_prompts_stops_the_export_saying_how_to_mend_it(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset)).returncode == 0
    (tmp_path / "data" / "run" / "relocations.json").write_text('{"places": {"0:x": "one"}}')
    result = run_cli(tmp_path, "--run_name=run", "--export=sharegpt", f"--out={tmp_path / 'out.jsonl'}")
    assert result.returncode == 1, result.stderr
    assert "relocations.json" in result.stderr and "--resume" in result.stderr
    assert "Traceback" not in result.stderr
    # A resumed run writes the record anew.
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume")).returncode == 0
    assert not (tmp_path / "data" / "run" / "relocations.json").exists()


def test_changed_batch_size_loses_and_duplicates_nothing(tmp_path, endpoint):
    prompts = [f"prompt {i}" for i in range(7)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--max_samples=4", batch_size=2)).returncode == 0
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume", batch_size=5))
    assert result.returncode == 0
    assert merged_prompts(tmp_path) == Counter(prompts)
    assert len(batch_rows(tmp_path / "data" / "run")) == 7


# A resume with nothing left to run started no pool, and the pool's start is where an earlier run's
# leftovers (its sandboxes' directories, its containers, its control groups) were removed: they stayed.
@pytest.mark.parametrize("left", ["all-done", "budget-spent"])
def test_a_resume_that_runs_no_prompt_still_removes_what_a_crashed_run_left(tmp_path, endpoint, left):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b"])
    limit = ["--max_total_tokens=1", "--num_workers=1"] if left == "budget-spent" else []
    run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, *limit))
    leftover = tmp_path / "tmp" / f"batch_runner-{os.geteuid()}" / run_identity(str(tmp_path / "data" / "run")) / "prompt-7"
    leftover.mkdir(parents=True)
    (leftover / "made.txt").write_text("left by a run killed with -9")
    endpoint.reset()
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume", *limit))
    assert result.returncode in (0, 2), result.stderr
    assert endpoint.requests == []
    assert not leftover.parent.exists()


def test_all_done_makes_no_model_call_and_still_writes_outputs(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset)).returncode == 0
    run_dir = tmp_path / "data" / "run"
    (run_dir / "trajectories.jsonl").unlink()
    (run_dir / "statistics.json").unlink()
    endpoint.reset()
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0
    assert "All prompts have already been processed!" in result.stdout
    assert endpoint.requests == []
    assert merged_prompts(tmp_path) == Counter(["a", "b"])
    assert json.loads((run_dir / "statistics.json").read_text())["trajectories_in_merged_file"] == 2


def test_failed_prompts_are_retried_on_resume(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["[[fail 400 1]] flaky", "fine"])
    first = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset))
    assert first.returncode == 2 and merged_prompts(tmp_path) == Counter(["fine"])     # 2: a prompt failed
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0
    assert merged_prompts(tmp_path) == Counter(["[[fail 400 1]] flaky", "fine"])
    statistics = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    assert statistics["failed_prompts"] == 0


def test_discarded_prompts_are_not_rerun(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["[[reasoning none]] silent", "fine"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset)).returncode == 0
    endpoint.reset()
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0 and endpoint.requests == []


def test_corrupted_prompts_rerun_only_when_asked(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["[[invent]] inventive", "fine"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset)).returncode == 0
    endpoint.reset()
    plain = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert plain.returncode == 0 and endpoint.requests == []
    assert "1 corrupted rows (invented tool names) count as done; --rerun_corrupted" in plain.stdout
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume", "--rerun_corrupted"))
    assert result.returncode == 0
    assert {last_user_message(r) for r in endpoint.requests} == {"[[invent]] inventive"}


def complete_lines(path: Path, start: int = 0, end: int | None = None) -> list[bytes]:
    return [line for _, line in lines_at(path, start, end)]


def test_byte_ranges_that_tile_a_batch_file_yield_each_complete_line_once(tmp_path):
    path = tmp_path / "batch_0.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"bb": 22}\n{"ccc": 333}\n{"cut short')
    whole = complete_lines(path)
    assert whole == [b'{"a": 1}\n', b"\n", b'{"bb": 22}\n', b'{"ccc": 333}\n']
    size = path.stat().st_size
    for cut in range(size + 1):
        assert complete_lines(path, 0, cut) + complete_lines(path, cut, size) == whole, cut
    for parts in (2, 3, 7):
        shared = [line for group in split_ranges([path], parts) for p, start, end in group
                  for line in complete_lines(p, start, end)]
        assert shared == whole, parts


def test_an_unfinished_last_line_is_never_read_into_memory(tmp_path):
    """A batch file's last line without a newline (a row cut short, or damage) may be any size: the
    resume scan, the merge and the report step over it rather than hold it whole."""
    path = tmp_path / "batch_0.jsonl"
    path.write_bytes(b'{"a": 1}\n')
    with path.open("r+b") as handle:
        handle.truncate(512 << 20)            # a sparse tail of 512 MB without a newline
    tracemalloc.start()
    try:
        assert complete_lines(path) == [b'{"a": 1}\n']
        assert complete_lines(path, 1) == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


def test_resume_scan_shared_out_over_processes_counts_what_one_process_counts(tmp_path, endpoint, monkeypatch):
    prompts = [f"prompt {i}" for i in range(12)] + ["[[invent]] inventive", "[[fail 400]] refused", "prompt 3"]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, batch_size=4)).returncode == 2   # one failed
    directory = RunDirectory(tmp_path / "data" / "run")
    alone = scan_ranges([(p, 0, p.stat().st_size) for p in directory.batch_files()])
    monkeypatch.setattr(reading, "PARALLEL_READ_MIN_BYTES", 0)
    shared = directory.scan()
    assert shared.usage == pytest.approx(alone.usage)      # costs added in another order
    shared.usage = alone.usage
    assert shared == alone
    assert shared.rows_by_status[rows.FAILED] == 1 and sum(shared.corrupted_by_key.values()) == 1
    assert sum(shared.done(rerun_corrupted=False, superseded=Counter()).values()) == 14


# -- rows as they may be found: torn, re-encoded, older, newer, foreign ----------------------------------------

def results(run_dir: Path) -> dict[str, bytes]:
    """The bytes of every file the run wrote (the lock file holds only the last pid)."""
    return {path.name: path.read_bytes() for path in run_dir.iterdir() if path.is_file() and path.name != ".lock"}


def rewrite_rows(run_dir: Path, change) -> None:
    """Every row of every batch file replaced by ``change(row)`` (bytes, with its newline)."""
    for path in run_dir.glob("batch_*.jsonl"):
        path.write_bytes(b"".join(change(json.loads(line)) for line in path.read_bytes().splitlines()))


def test_a_row_cut_just_before_its_newline_is_cut_off_and_its_prompt_gets_exactly_one_row(tmp_path, endpoint):
    prompts = [f"prompt {i}" for i in range(3)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset)).returncode == 0
    batch = tmp_path / "data" / "run" / "batch_0.jsonl"
    batch.write_bytes(batch.read_bytes()[:-1])           # died after the row's last byte, before its newline
    endpoint.reset()

    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0, result.stderr
    assert len(endpoint.requests) == 1
    assert merged_prompts(tmp_path) == Counter(prompts)
    assert Counter(human_prompt(row) for row in batch_rows(tmp_path / "data" / "run")) == Counter(prompts)


@pytest.mark.parametrize("encoding", [{"sort_keys": True}, {"separators": (",", ":")}, {"ensure_ascii": True}],
                         ids=["sorted_keys", "compact_separators", "ascii_escapes"])
def test_rows_written_by_another_json_encoder_resume_without_running_anything_again(tmp_path, endpoint, encoding):
    prompts = [f"prompt {i} ünï" for i in range(5)] + ["[[invent]] inventive", "[[reasoning none]] silent"]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset)).returncode == 0
    run_dir = tmp_path / "data" / "run"
    merged_before = merged_prompts(tmp_path)
    rewrite_rows(run_dir, lambda row: json.dumps(row, **encoding).encode() + b"\n")
    endpoint.reset()

    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0, result.stderr
    assert endpoint.requests == []
    assert "All prompts have already been processed!" in result.stdout
    assert merged_prompts(tmp_path) == merged_before == Counter(prompts[:5])


def as_format_1(row: dict, *, with_format_key: bool) -> bytes:
    """A row as format 1 wrote it (or, without the key, the versions before): a "tool_calls" list on gpt
    turns with calls, the empty think block as "<think>\\n\\n</think>\\n", no toolsets_sampled or
    invented_tool_calls."""
    old = {key: value for key, value in row.items() if key not in ("format", "toolsets_sampled", "invented_tool_calls")}
    if with_format_key:
        old["format"] = 1
    for turn in old.get("conversations", []):
        if turn["from"] != "gpt":
            continue
        if turn["value"].startswith("<think>\n</think>"):
            turn["value"] = "<think>\n\n</think>\n" + turn["value"][len("<think>\n</think>"):].lstrip("\n")
        calls = [json.loads(payload) for payload in re.findall(r"<tool_call>\n(.*)\n</tool_call>", turn["value"])]
        if calls:
            turn["tool_calls"] = [{"id": f"call_{i}", "name": call["name"], "arguments": json.dumps(call["arguments"])}
                                  for i, call in enumerate(calls)]
    return json.dumps(old).encode() + b"\n"


@pytest.mark.parametrize("with_format_key", [True, False], ids=["format_1", "before_formats"])
def test_rows_of_an_older_format_resume_and_are_merged_in_the_current_one(tmp_path, endpoint, with_format_key):
    datasets = pytest.importorskip("datasets")
    prompts = [f"prompt {i}" for i in range(3)] + ['[[call terminal {"command": "ls"}]] [[reasoning none]] a call']
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts + ["one more"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--max_samples=4",
                                        "--discard_no_reasoning=False")).returncode == 0
    run_dir = tmp_path / "data" / "run"
    rewrite_rows(run_dir, lambda row: as_format_1(row, with_format_key=with_format_key))
    (run_dir / "trajectories.jsonl").unlink()
    endpoint.reset()

    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume", "--discard_no_reasoning=False"))
    assert result.returncode == 0, result.stderr
    assert [last_user_message(r) for r in endpoint.requests] == ["one more"]
    merged = read_jsonl(run_dir / "trajectories.jsonl")
    assert Counter(human_prompt(row) for row in merged) == Counter(prompts + ["one more"])
    assert [row["format"] for row in merged] == [rows.ROW_FORMAT] * 5
    assert len({tuple(row) for row in merged}) == 1                          # the same keys in every row
    assert all(list(turn) == ["from", "value"] for row in merged for turn in row["conversations"])
    loaded = datasets.load_dataset("json", data_files=str(run_dir / "trajectories.jsonl"), split="train",
                                   cache_dir=str(tmp_path / "hf"))
    assert loaded.num_rows == 5


def test_a_line_that_is_not_json_amid_the_rows_is_skipped(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset)).returncode == 0
    batch = tmp_path / "data" / "run" / "batch_0.jsonl"
    first, second = batch.read_bytes().splitlines(keepends=True)
    batch.write_bytes(first + b'{"format": 1, "prompt_index": 7, "conte\n' + second)   # what old crashes left
    endpoint.reset()
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0, result.stderr
    assert endpoint.requests == [] and merged_prompts(tmp_path) == Counter(["a", "b"])


@pytest.mark.parametrize("line, complaint", [
    (b'{"format": 5, "prompt_index": 1, "content_key": "ab", "conversations": [], "end_reason": "final_answer"}',
     "row format 5 is newer than this batch_runner reads (format 4)"),
    (b'{"prompt": "a dataset line pasted here by mistake"}', "not a batch_runner row"),
    (b"[1, 2, 3]", "not a batch_runner row"),
], ids=["newer_format", "a_dataset_line", "an_array"])
def test_a_line_of_json_that_is_no_row_this_version_reads_stops_resume_naming_it(tmp_path, endpoint, line, complaint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b", "c"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--max_samples=2")).returncode == 0
    batch = tmp_path / "data" / "run" / "batch_0.jsonl"
    first, second = batch.read_bytes().splitlines(keepends=True)
    batch.write_bytes(first + line + b"\n" + second)
    before = results(batch.parent)
    endpoint.reset()

    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    errors = [text for text in result.stderr.splitlines() if text.startswith("error:")]
    assert len(errors) == 1 and "batch_0.jsonl line 2: " in errors[0] and complaint in errors[0], result.stderr
    assert endpoint.requests == []
    assert results(batch.parent) == before


# -- the checkpoint -----------------------------------------------------------------------------------------

def test_the_checkpoint_counts_done_prompts_and_rows_per_outcome_over_every_invocation(tmp_path, endpoint):
    prompts = ["a", "[[reasoning none]] silent", "[[fail 400 always]] no", "b"]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--max_samples=3")).returncode == 2
    checkpoint_path = tmp_path / "data" / "run" / "checkpoint.json"
    first = json.loads(checkpoint_path.read_text())
    assert (first["completed_prompts"], first["batch_stats"]) == (2, {"completed": 1, "discarded": 1, "failed": 1})

    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume")).returncode == 2
    checkpoint = json.loads(checkpoint_path.read_text())
    assert checkpoint["completed_prompts"] == 3         # a, silent, b; the failing prompt is not done
    assert checkpoint["batch_stats"] == {"completed": 2, "discarded": 1, "failed": 2}
    assert {"run_name", "last_updated", "total_prompts"} <= set(checkpoint) and checkpoint["total_prompts"] == 4


def test_a_checkpoint_of_an_earlier_version_is_replaced_by_counts_of_the_batch_files(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--max_samples=1")).returncode == 0
    checkpoint_path = tmp_path / "data" / "run" / "checkpoint.json"
    earlier = {**json.loads(checkpoint_path.read_text()), "completed_prompts": [0],
               "batch_stats": {"0": {"completed": 1, "failed": 3}}}             # per batch, as it used to be
    checkpoint_path.write_text(json.dumps(earlier))
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume")).returncode == 0
    checkpoint = json.loads(checkpoint_path.read_text())
    assert (checkpoint["completed_prompts"], checkpoint["batch_stats"]) == (2, {"completed": 2})


@pytest.mark.parametrize("content", ["[1, 2]", '"text"', "{truncated"], ids=["array", "string", "not-json"])
def test_a_checkpoint_that_is_not_a_json_object_is_rebuilt_from_the_batch_files(tmp_path, endpoint, content):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--max_samples=1")).returncode == 0
    checkpoint_path = tmp_path / "data" / "run" / "checkpoint.json"
    checkpoint_path.write_text(content)
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0, result.stderr
    checkpoint = json.loads(checkpoint_path.read_text())
    assert (checkpoint["completed_prompts"], checkpoint["batch_stats"]) == (2, {"completed": 2})


def test_resume_warns_when_an_argument_differs_from_the_checkpoint(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--max_samples=1")).returncode == 0
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume", "--model=another-model"))
    assert result.returncode == 0, result.stderr
    assert "resuming with --model=another-model, but this run's last invocation used scripted-model" in \
        " ".join(result.stderr.split())         # wrapped at 80 columns in a log file


# It named the model of the last invocation as the one the run "started with".
def test_resume_names_the_model_of_the_last_invocation(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b", "c"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--max_samples=1")).returncode == 0
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--max_samples=2", "--resume",
                                        "--model=another-model")).returncode == 0
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 0, result.stderr
    assert "resuming with --model=scripted-model, but this run's last invocation used another-model" in \
        " ".join(result.stderr.split())


# -- the figures after kill -9 ------------------------------------------------------------------------------

def recount(run_dir: Path) -> Counter:
    """Rows per outcome, read from the batch files themselves."""
    found: Counter = Counter()
    for path in sorted(run_dir.glob("batch_*.jsonl")):
        for _, line in lines_at(path):
            row = rows.read_stored_row(line)
            assert row is not None
            found[row.status] += 1
    return found


def rows_usage(run_dir: Path) -> dict:
    total = Counter()
    for path in sorted(run_dir.glob("batch_*.jsonl")):
        for _, line in lines_at(path):
            total.update(rows.read_stored_row(line).usage())
    return dict(total)


CUT_OFF_PROMPT = '[[call terminal {"command": "echo four"}]] fourth, cut off by the kill'


def kill_after_a_checkpoint_with_rows_behind_it(tmp_path: Path, endpoint, dataset: Path, *extra: str,
                                                spend_recorded: bool = True) -> HeldReplies:
    """The first invocation, killed with kill -9 once checkpoint.json counts two rows, a third row is
    written after it, and a fourth session has had one reply (recorded as spent, with ``spend_recorded``)
    and waits for its second."""
    run = tmp_path / "data" / "run"
    held = HeldReplies(endpoint, {"third": 0, "fourth": 1})
    process = subprocess.Popen(batch_runner_command(*base_args(tmp_path, endpoint, dataset, "--num_workers=4",
                                                               *extra, batch_size=2)),
                               cwd=tmp_path, env=cli_environment(tmp_path), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (run / "checkpoint.json").exists(), what="the first checkpoint")
        assert json.loads((run / "checkpoint.json").read_text())["batch_stats"] == {"completed": 2}
        held.release("third")
        wait_for(lambda: finished_row_count(run) == 3, what="the third row")
        assert held.arrived["fourth"].wait(60)
        if spend_recorded:
            wait_for(lambda: spent_by_prompt(run, 3) == 1, what="the fourth session's reply recorded")
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    held.open_all()
    return held


def test_after_kill_9_and_resume_the_checkpoint_counts_every_row_in_the_batch_files(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["first", "second", "third", CUT_OFF_PROMPT])
    kill_after_a_checkpoint_with_rows_behind_it(tmp_path, endpoint, dataset, spend_recorded=False)
    run = tmp_path / "data" / "run"
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume", batch_size=2))
    assert result.returncode == 0, result.stderr
    checkpoint = json.loads((run / "checkpoint.json").read_text())
    assert checkpoint["batch_stats"] == recount(run) == {"completed": 4}
    assert checkpoint["completed_prompts"] == 4


def test_after_kill_9_and_resume_statistics_equal_a_recount_plus_the_cut_off_sessions_spend(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["first", "second", "third", CUT_OFF_PROMPT])
    held = kill_after_a_checkpoint_with_rows_behind_it(tmp_path, endpoint, dataset)
    assert held.seen["fourth"] == 2       # one reply, then the request the kill cut off
    run = tmp_path / "data" / "run"
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume", batch_size=2))
    assert result.returncode == 0, result.stderr
    statistics = json.loads((run / "statistics.json").read_text())
    found = recount(run)
    assert json.loads((run / "checkpoint.json").read_text())["batch_stats"] == found
    assert statistics["trajectories_in_merged_file"] == found["completed"] + found["partial"] == 4
    assert statistics["spent_by_unfinished_sessions"] == usage_of_replies(1)
    in_rows = rows_usage(run)
    assert statistics["usage"] == {key: pytest.approx(value + usage_of_replies(1)[key])
                                   for key, value in in_rows.items()}
    assert in_rows["prompt_tokens"] == 100 * len(batch_rows(run)) + 100    # the fourth's row has two replies


def test_max_cost_counts_what_earlier_invocations_spent_cut_off_sessions_included(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["first", "second", "third", CUT_OFF_PROMPT])
    # Three rows at $0.001 spent $0.003, below the cap; the cut-off session's one reply takes the run over.
    kill_after_a_checkpoint_with_rows_behind_it(tmp_path, endpoint, dataset, "--max_cost=0.0035", *REPORTED_COST)
    endpoint.reset()
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume", "--max_cost=0.0035", *REPORTED_COST,
                                          batch_size=2))
    assert result.returncode == 0, result.stderr
    assert endpoint.requests == []
    said = " ".join(result.stdout.split())
    assert "spending cap reached: $0.0040 of --max_cost=$0.0035" in said
    assert "the cap counts the whole run, earlier invocations included" in said


def test_max_cost_reached_by_one_invocation_stops_the_next_at_once(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["first", "second"])
    arguments = base_args(tmp_path, endpoint, dataset, "--num_workers=1", "--max_cost=0.001", *REPORTED_COST)
    assert run_cli(tmp_path, *arguments).returncode == 0
    assert len(endpoint.requests) == 1
    endpoint.reset()
    result = run_cli(tmp_path, *arguments, "--resume")
    assert result.returncode == 0, result.stderr
    assert endpoint.requests == []
    assert "spending cap reached: $0.0010 of --max_cost=$0.001" in " ".join(result.stdout.split())


# -- the spent ledger: a kill at any moment of a group commit counts every reply once ------------------------

def ledger_row(prompt_index: int, cost: float) -> Finished:
    """A finished prompt's row as a worker sends it, with the usage it carries."""
    result = rows.SessionResult(prompt_index=prompt_index, content_key=f"key{prompt_index}", prompt=f"p{prompt_index}",
                                toolsets=[], offered_tools=[], turns=[rows.AssistantTurn("why", "Done.")], api_calls=1,
                                usage=rows.Usage(prompt_tokens=10, completion_tokens=5, cost=cost), wall_time=1.0,
                                end_reason="final_answer")
    line = rows.encode_finished(result, batch_num=0, model="m", timestamp="t", discard_no_reasoning=False)
    return Finished(prompt_index=prompt_index, unit=prompt_index, batch_num=0, status=rows.COMPLETED, row=line, api_calls=1,
                    usage=result.usage.as_dict(), wall_time=1.0, end_reason="final_answer", error=None, error_type=None,
                    prompt_preview="", toolsets=(), tool_calls=())


def one_reply(prompt_index: int, cost: float) -> Spent:
    return Spent(prompt_index, rows.Usage(prompt_tokens=10, completion_tokens=5, cost=cost).as_dict())


@pytest.fixture
def ledger_dir(tmp_path) -> RunDirectory:
    directory = RunDirectory(tmp_path / "run")
    directory.acquire()
    yield directory
    directory.release()


def reopened(directory: RunDirectory) -> SpentLedger:
    ledger = SpentLedger(directory.path / "spent.jsonl")
    ledger.start()
    return ledger


def test_a_kill_after_a_row_was_appended_but_before_it_was_said_so_counts_its_replies_once(ledger_dir):
    ledger = reopened(ledger_dir)
    row = ledger_row(0, 0.5)
    ledger.record([one_reply(0, 0.5)], ledger_dir.row_places(0, [row]))
    ledger_dir.append(0, row.row)
    ledger.close()                              # killed before the "landed" line
    assert reopened(ledger_dir).unfinished()["cost"] == 0      # the row carries the reply's cost


def test_a_kill_after_a_row_was_announced_but_before_it_was_appended_counts_its_replies_as_cut_off(ledger_dir):
    ledger = reopened(ledger_dir)
    row = ledger_row(0, 0.5)
    ledger.record([one_reply(0, 0.5)], ledger_dir.row_places(0, [row]))
    ledger.close()
    assert reopened(ledger_dir).unfinished()["cost"] == 0.5


def test_an_announced_row_whose_place_another_row_took_later_still_counts_as_cut_off(ledger_dir):
    ledger = reopened(ledger_dir)
    ledger.record([one_reply(0, 0.5)], ledger_dir.row_places(0, [ledger_row(0, 0.5)]))
    ledger.close()
    ledger_dir.append(0, ledger_row(1, 0.25).row)        # the next invocation's first row, where row 0 was to be
    assert reopened(ledger_dir).unfinished()["cost"] == 0.5


def test_a_full_disk_cuts_no_line_of_the_ledger_short(ledger_dir, monkeypatch):
    ledger = reopened(ledger_dir)
    real_write = os.write

    def half_then_full(fd: int, data: bytes) -> int:
        monkeypatch.setattr(os, "write", full)
        return real_write(fd, data[:10])

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(DiskFull):
        ledger.record([one_reply(0, 0.5)], [])
    monkeypatch.setattr(os, "write", real_write)
    ledger.record([one_reply(1, 0.25)], [])
    ledger.close()
    assert [json.loads(line) for line in (ledger_dir.path / "spent.jsonl").read_bytes().splitlines()][1:] == [
        {"prompt": 1, "spent": one_reply(1, 0.25).usage, "source": "endpoint"}]


def test_spending_of_an_invocation_killed_before_its_first_row_counts_for_the_next_one(ledger_dir):
    ledger = reopened(ledger_dir)
    ledger.record([one_reply(0, 0.5)], [])
    ledger.close()
    assert ledger_dir.existing_results() == []              # so the next invocation may start without --resume
    assert reopened(ledger_dir).unfinished()["cost"] == 0.5


@pytest.mark.parametrize("name", ["checkpoint.json", "statistics.json", "trajectories.jsonl", "spent.jsonl",
                                  ".merge.json", "relocations.json", ".lock"])
def test_a_directory_in_place_of_a_file_of_the_run_stops_the_resume_before_any_prompt_runs(tmp_path, endpoint, name):
    # Found only where the run first wrote the file, it was a traceback: after the prompts ran (statistics,
    # the merge), or before (the ledger, the lock).
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b", "c"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--max_samples=2")).returncode == 0
    run_dir = tmp_path / "data" / "run"
    (run_dir / name).unlink(missing_ok=True)
    (run_dir / name).mkdir()
    endpoint.reset()
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: data/run/{name} is not a regular file: the run writes it. Move it out of data/run/."]
    assert endpoint.requests == []


@pytest.mark.parametrize("name", ["checkpoint.json", ".lock"])
def test_a_fifo_in_place_of_a_file_of_the_run_is_refused_in_one_line_rather_than_waited_on(tmp_path, endpoint, name):
    # A FIFO checkpoint was read for ever; a FIFO lock ended the run in a traceback (Invalid argument).
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--max_samples=1")).returncode == 0
    run_dir = tmp_path / "data" / "run"
    (run_dir / name).unlink()
    os.mkfifo(run_dir / name)
    endpoint.reset()
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"), timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: data/run/{name} is not a regular file: the run writes it. Move it out of data/run/."]
    assert endpoint.requests == []


def test_a_lock_that_is_a_symbolic_link_is_refused_and_the_file_it_names_left_as_it_was(tmp_path, endpoint):
    # The lock was opened through the link and emptied to take the runner's pid: the file it named was lost.
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--max_samples=1")).returncode == 0
    run_dir = tmp_path / "data" / "run"
    precious = tmp_path / "notes.txt"
    precious.write_text("kept\n")
    (run_dir / ".lock").unlink()
    (run_dir / ".lock").symlink_to(precious)
    endpoint.reset()
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: data/run/.lock is not a regular file: the run writes it. Move it out of data/run/."]
    assert precious.read_text() == "kept\n"
    assert endpoint.requests == []


def test_a_batch_file_linked_from_another_run_is_refused_and_that_run_left_as_it_was(tmp_path, endpoint):
    # A run made by linking an earlier run's batch files appended its rows, and cut torn tails, through the
    # links: into the earlier run's files.
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b"])
    assert run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--max_samples=1")).returncode == 0
    earlier = tmp_path / "data" / "run"
    earlier.rename(tmp_path / "data" / "earlier")
    earlier = tmp_path / "data" / "earlier"
    before = (earlier / "batch_0.jsonl").read_bytes()
    (tmp_path / "data" / "run").mkdir()
    (tmp_path / "data" / "run" / "batch_0.jsonl").symlink_to(earlier / "batch_0.jsonl")
    endpoint.reset()
    result = run_cli(tmp_path, *base_args(tmp_path, endpoint, dataset, "--resume"))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: data/run/batch_0.jsonl is a symbolic link to {earlier / 'batch_0.jsonl'}: the run writes its "
        "files in place, so it would write there. Copy that file in its place."]
    assert (earlier / "batch_0.jsonl").read_bytes() == before
    assert endpoint.requests == []


def test_the_ledger_counts_every_invocations_replies_without_a_cost_or_tokens(ledger_dir):
    ledger = reopened(ledger_dir)
    ledger.record([Spent(0, rows.Usage().as_dict(), "unknown"), one_reply(1, 0.5)], [])
    ledger.close()
    reopened(ledger_dir).close()                # folded into the carried line, and read back from it
    ledger = reopened(ledger_dir)
    ledger.record([Spent(2, rows.Usage().as_dict(), "unknown")], [])
    ledger.close()
    assert (ledger.replies.cost_sources, ledger.replies.tokenless) == ({"unknown": 2, "endpoint": 1}, 2)


def test_a_ledger_written_before_replies_were_counted_still_counts_what_was_spent(ledger_dir):
    usage = rows.Usage(prompt_tokens=10, completion_tokens=5, cost=0.5).as_dict()
    (ledger_dir.path / "spent.jsonl").write_text(
        json.dumps({"carried": usage}) + "\n" + json.dumps({"prompt": 3, "spent": usage}) + "\n")
    ledger = reopened(ledger_dir)
    ledger.close()
    assert ledger.unfinished()["cost"] == 1.0
    assert (ledger.replies.cost_sources, ledger.replies.tokenless) == ({}, 0)


@pytest.mark.parametrize("replies", [None, [], {"by_cost_source": []}, {"by_cost_source": {"unknown": "x"}},
                                     {"by_cost_source": {}}, {"by_cost_source": {}, "tokenless": 1e400}])
def test_a_carried_line_whose_reply_counts_were_edited_out_of_shape_keeps_its_usage(ledger_dir, replies):
    # Before: the line counted nothing (the earlier invocations' spending was lost for good at the next
    # fold), and an infinite count ended the start with a traceback.
    usage = rows.Usage(prompt_tokens=10, completion_tokens=5, cost=1.5).as_dict()
    (ledger_dir.path / "spent.jsonl").write_text(json.dumps({"carried": usage, "replies": replies}) + "\n")
    ledger = reopened(ledger_dir)
    ledger.close()
    assert ledger.unfinished()["cost"] == 1.5
    assert (ledger.replies.cost_sources, ledger.replies.tokenless) == ({}, 0)


def test_a_carried_line_with_negative_reply_counts_counts_none(ledger_dir):
    (ledger_dir.path / "spent.jsonl").write_text(
        json.dumps({"carried": {}, "replies": {"by_cost_source": {"unknown": -2}, "tokenless": -1}}) + "\n")
    ledger = reopened(ledger_dir)
    ledger.close()
    assert (ledger.replies.unpriced, ledger.replies.tokenless) == (0, 0)


def test_a_failed_prompt_whose_rows_name_two_lines_counts_once_among_those_that_failed_before(tmp_path):
    # The dataset changed between two failures of one prompt (a line put before it): its failure rows name
    # line 0 and line 1, both now its line 1, and the resume said "(2 of them failed before)" of one sample.
    from batchrun.run_dir import ScanResult
    from batchrun.runner import _failures_retried

    failed = rows.content_key("P", None, None)
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["Q", "P"])
    scan = ScanResult(failed_units={rows.unit_key(0, failed), rows.unit_key(1, failed)})
    plan = plan_dataset(dataset, max_samples=None, done_units=Counter(), warn=print, other_units=scan.other_units)
    assert plan.pending == 2 and _failures_retried(scan, plan) == 1
