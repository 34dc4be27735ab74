"""A run directory tampered with by hand, by another tool or by a broken disk, between invocations or
during a run: no traceback, no hang, no row lost or duplicated, and one line where the run cannot go on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from conftest import (
    batch_rows,
    cli_environment,
    endpoint_args,
    paused_cli_command,
    read_jsonl,
    run_cli,
    write_dataset,
)

from batchrun import report


def base_args(endpoint, dataset: Path, *extra: str) -> list[str]:
    return [f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run", "--distribution=minimal",
            *endpoint_args(endpoint), *extra]


def run_paused_at(method: str, tmp_path: Path, endpoint, dataset: Path, tamper, *,
                  module: str = "batchrun.run_dir.directory") -> subprocess.CompletedProcess:
    """A run whose first call of ``method`` (RunDirectory's, or a function of ``module``) waits until
    ``tamper`` (given the run directory) has run."""
    go = tmp_path / "go"
    name = f"RunDirectory.{method}" if module == "batchrun.run_dir.directory" else method
    process = subprocess.Popen(paused_cli_command(module, name, go, *base_args(endpoint, dataset)),
                               cwd=tmp_path, env=cli_environment(tmp_path), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if "paused at" in line:
                break
        tamper(tmp_path / "data" / "run")
        go.touch()
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def test_a_batch_file_made_a_directory_during_the_run_stops_it_in_one_line(tmp_path, endpoint):
    # Before: the append met the directory and the run ended in a traceback (IsADirectoryError).
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a"])
    result = run_paused_at("append", tmp_path, endpoint, dataset,
                           lambda run_dir: (run_dir / "batch_0.jsonl").mkdir())
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: data/run/batch_0.jsonl is not a regular file: a batch file holds rows. Move it out of data/run/."]


def test_a_file_of_the_run_removed_while_it_is_written_is_one_line_though_the_directory_stays(tmp_path, endpoint):
    # Before: a removal under way (`rm -rf` had taken the files, not yet the directory) was a traceback, as only
    # a missing directory was taken for a removal.
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a"])

    def remove_files(run_dir: Path) -> None:
        for path in run_dir.iterdir():
            path.unlink()

    result = run_paused_at("_rename_over", tmp_path, endpoint, dataset, remove_files,
                           module="batchrun.run_dir.durable")
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: files of data/run were removed while the run was writing"), line


def test_a_batch_file_made_a_fifo_during_the_run_stops_it_rather_than_waiting_for_a_reader(tmp_path, endpoint):
    # Before: opening the FIFO to append waited for a reader for ever; the run hung.
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a"])
    result = run_paused_at("append", tmp_path, endpoint, dataset,
                           lambda run_dir: os.mkfifo(run_dir / "batch_0.jsonl"))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: data/run/batch_0.jsonl is not a regular file: a batch file holds rows. Move it out of data/run/."]


def test_a_batch_file_made_a_symbolic_link_during_the_run_takes_none_of_its_rows(tmp_path, endpoint):
    # Before: the rows were appended through the link, to a file outside the run directory.
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a"])
    outside = tmp_path / "outside.jsonl"
    outside.write_bytes(b"")
    result = run_paused_at("append", tmp_path, endpoint, dataset,
                           lambda run_dir: (run_dir / "batch_0.jsonl").symlink_to(outside))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: data/run/batch_0.jsonl is a symbolic link to {outside}: the run writes its files in place, so it "
        "would write there. Copy that file in its place."]
    assert outside.read_bytes() == b""


@pytest.mark.parametrize("name", [".merge.json", "relocations.json"])
def test_a_record_made_a_fifo_before_the_merge_stops_the_run_in_one_line_and_keeps_its_rows(tmp_path, endpoint,
                                                                                             name):
    # Before: the merge opened the FIFO to read the record and waited for a writer for ever; the run hung.
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a"])
    result = run_paused_at("merge", tmp_path, endpoint, dataset, lambda run_dir: os.mkfifo(run_dir / name))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: data/run/{name} is not a regular file: the run writes it. Move it out of data/run/."]
    run_dir = tmp_path / "data" / "run"
    (run_dir / name).unlink()
    endpoint.reset()
    resumed = run_cli(tmp_path, *base_args(endpoint, dataset, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert endpoint.requests == []
    assert len(batch_rows(run_dir)) == len(read_jsonl(run_dir / "trajectories.jsonl")) == 1


@pytest.mark.parametrize("number", ["999999999999", "9" * 40])
def test_a_stray_batch_file_of_a_huge_number_leaves_the_runs_report_whole(tmp_path, endpoint, number):
    # Before: the report's helper kept a slot for every batch number up to the highest, so the run ended
    # without its report (MemoryError, or OverflowError past 2**63).
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b"])
    assert run_cli(tmp_path, *base_args(endpoint, dataset, "--max_samples=1")).returncode == 0
    run_dir = tmp_path / "data" / "run"
    (run_dir / "report.html").unlink()
    (run_dir / f"batch_{number}.jsonl").write_bytes((run_dir / "batch_0.jsonl").read_bytes())
    resumed = run_cli(tmp_path, *base_args(endpoint, dataset, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr == ""
    assert (run_dir / report.REPORT_FILE).is_file()
    assert Counter(row["prompt_index"] for row in read_jsonl(run_dir / "trajectories.jsonl")) == {0: 1, 1: 1}


@pytest.mark.parametrize("edit", [
    {"total_prompts": 10**400},
    {"replies_by_cost_source": {"unknown": 10**400}},
    {"samples": {"prompts_with_a_completed_sample": float("inf"), "prompts_with_rows": 3,
                 "prompts_by_completed_samples": {"1": 3}}},
    {"samples": {"prompts_with_a_completed_sample": 10**400, "prompts_with_rows": 1,
                 "prompts_by_completed_samples": {"0": 10**400}}},
], ids=["total_prompts", "unpriced_replies", "infinite_samples", "huge_samples"])
def test_a_statistics_file_edited_to_numbers_no_count_can_be_still_gives_the_page(tmp_path, endpoint, edit):
    # Before: --report ended in a traceback (OverflowError) turning the number into a float.
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a"])
    assert run_cli(tmp_path, *base_args(endpoint, dataset)).returncode == 0
    run_dir = tmp_path / "data" / "run"
    statistics = json.loads((run_dir / "statistics.json").read_text(encoding="utf-8"))
    (run_dir / "statistics.json").write_text(json.dumps({**statistics, **edit}), encoding="utf-8")
    (run_dir / report.REPORT_FILE).unlink()
    result = run_cli(tmp_path, "--report", "--run_name=run")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert (run_dir / report.REPORT_FILE).is_file()


NESTED_TOO_DEEPLY = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("name", ["checkpoint.json", ".merge.json", "relocations.json", "spent.jsonl",
                                  "statistics.json"])
def test_a_record_nested_too_deeply_to_read_is_damage_the_report_passes_over_and_the_resume_writes_anew(
        tmp_path, endpoint, name):
    # Before: json's RecursionError escaped every reader of the run's records, and --report and --resume
    # ended in a traceback.
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a"])
    assert run_cli(tmp_path, *base_args(endpoint, dataset)).returncode == 0
    run_dir = tmp_path / "data" / "run"
    (run_dir / name).write_text(f'{{"places": {NESTED_TOO_DEEPLY}}}\n', encoding="utf-8")
    reported = run_cli(tmp_path, "--report", "--run_name=run")
    assert "Traceback" not in reported.stderr
    resumed = run_cli(tmp_path, *base_args(endpoint, dataset, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert len(read_jsonl(run_dir / "trajectories.jsonl")) == 1
