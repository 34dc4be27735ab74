"""The dataset as a careless user or an attacker gives it: odd line ends, files that are not JSONL, a file
that goes away or turns into something else under the run, and a resume that names it another way."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest
from conftest import (
    cli_environment,
    endpoint_args,
    paused_cli_command,
    run_cli,
    write_dataset,
)

from batchrun.dataset import DatasetChanged, DatasetError, iter_pending, plan_dataset, require_valid_prompt


def run_args(dataset: Path, endpoint, *extra: str) -> list[str]:
    return [f"--dataset_file={dataset}", "--batch_size=2", "--run_name=run", "--distribution=terminal_only",
            *endpoint_args(endpoint), *extra]


def test_many_bad_lines_before_the_first_valid_one_take_no_memory_for_their_warnings(tmp_path):
    # The check before the run kept a warning string per bad line until it found a valid one: a file of
    # millions of bad lines took hundreds of MB before the run started (the file is to be streamed).
    dataset = tmp_path / "dataset.jsonl"
    dataset.write_bytes(b"not json\n" * 200_000 + b'{"prompt": "ok"}\n')
    warned: list[str] = []
    tracemalloc.start()
    try:
        require_valid_prompt(dataset, warn=warned.append)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert warned == []
    assert peak < 2 << 20


def test_a_dataset_without_a_valid_line_still_names_its_first_bad_lines_and_counts_the_rest(tmp_path):
    dataset = tmp_path / "dataset.jsonl"
    dataset.write_bytes(b"not json\n" * 8)
    warned: list[str] = []
    with pytest.raises(DatasetError, match="no valid prompt"):
        require_valid_prompt(dataset, warn=warned.append)
    assert [line.split(":")[0] for line in warned[:5]] == [f"line {number}" for number in range(1, 6)]
    assert warned[5:] == ["3 more bad lines skipped (8 in all); fix them and run the same command again"]


def paused_before_the_first_prompt(tmp_path: Path, endpoint, dataset: Path) -> tuple[subprocess.Popen, Path]:
    """The CLI, paused once the dataset is planned and before its first line is read again."""
    go = tmp_path / "go"
    process = subprocess.Popen(paused_cli_command("batchrun.runner", "BatchRunner._start_pool", go,
                                                  *run_args(dataset, endpoint)),
                               cwd=tmp_path, env=cli_environment(tmp_path, {"TERMINAL_ENV": "local"}),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if "paused at" in line:
            break
    return process, go


def test_a_dataset_removed_before_its_first_prompt_is_read_stops_the_run_with_one_error(tmp_path, endpoint):
    # A traceback (FileNotFoundError from iter_pending's open).
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b", "c"])
    process, go = paused_before_the_first_prompt(tmp_path, endpoint, dataset)
    dataset.unlink()
    go.touch()
    output, _ = process.communicate(timeout=60)
    said = " ".join(output.split())
    assert process.returncode == 1, said
    assert "Traceback" not in said
    assert f"{dataset} could no longer be read" in said and "--resume" in said, said
    assert endpoint.requests == []


def test_a_dataset_replaced_by_a_fifo_before_its_first_prompt_is_read_is_refused_rather_than_waited_on(
        tmp_path, endpoint):
    # The run hung for good in open(), waiting for a writer to the FIFO.
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b", "c"])
    process, go = paused_before_the_first_prompt(tmp_path, endpoint, dataset)
    dataset.unlink()
    os.mkfifo(dataset)
    go.touch()
    try:
        output, _ = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        output = process.communicate()[0] + "\n(still waiting after 60 s)"
    said = " ".join(output.split())
    assert process.returncode == 1, said
    assert f"{dataset} could no longer be read" in said and "FIFO" in said, said


def test_a_dataset_that_fails_to_read_during_the_run_stops_admitting_prompts_as_a_changed_one_does(
        tmp_path, monkeypatch):
    # OSError (EIO) out of the scheduling loop: a traceback, where a changed file gets one error line.
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a", "b"])
    plan = plan_dataset(dataset, max_samples=None, done_units=Counter(), warn=lambda _warning: None)

    def failing_disk(*_args: object) -> bytes:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "pread", failing_disk)
    with pytest.raises(DatasetChanged, match=f"{re.escape(str(dataset))} could no longer be read: Input/output"):
        next(iter_pending(plan))


def test_a_resume_that_names_the_same_dataset_another_way_warns_about_nothing(tmp_path, endpoint):
    # "warning: resuming with --dataset_file=/abs/dataset.jsonl, but this run's last invocation used dataset.jsonl".
    write_dataset(tmp_path / "dataset.jsonl", ["a", "b"])
    assert run_cli(tmp_path, *run_args(Path("dataset.jsonl"), endpoint)).returncode == 0
    result = run_cli(tmp_path, *run_args(tmp_path / "dataset.jsonl", endpoint, "--resume"))
    assert result.returncode == 0, result.stderr
    assert "resuming with --dataset_file" not in " ".join(result.stderr.split()), result.stderr


def test_a_resume_over_another_dataset_file_still_warns(tmp_path, endpoint):
    write_dataset(tmp_path / "dataset.jsonl", ["a", "b"])
    write_dataset(tmp_path / "other.jsonl", ["a", "b"])
    assert run_cli(tmp_path, *run_args(Path("dataset.jsonl"), endpoint)).returncode == 0
    result = run_cli(tmp_path, *run_args(Path("other.jsonl"), endpoint, "--resume"))
    assert result.returncode == 0, result.stderr
    assert "resuming with --dataset_file=other.jsonl, but this run's last invocation used dataset.jsonl" in \
        " ".join(result.stderr.split())
