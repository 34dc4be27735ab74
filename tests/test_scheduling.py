"""Scheduling and limits: per-prompt slots, run-wide rate limits, time limits, caps."""

from __future__ import annotations

import time

from conftest import (
    PROMPTS_BESIDE_IT,
    RATE_LIMITED_PROMPT,
    REPORTED_COST,
    arrivals_around_a_429,
    assert_the_429_paused_every_other_session,
    batch_rows,
    endpoint_args,
    holding_until_rows,
    human_prompt,
    last_user_message,
    read_jsonl,
    record_arrivals,
    run_cli,
    write_dataset,
)
from container_backends import install_stand_in_clis
from scripted_endpoint import ScriptedEndpoint

from batchrun.workers import Places, process_count


def run(tmp_path, endpoint, prompts, *extra, env=None, distribution="terminal_only"):
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    return run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=100", "--run_name=run",
                   f"--distribution={distribution}", *endpoint_args(endpoint), *extra, env=env)


def test_a_429_pauses_new_requests_of_every_session_across_processes(tmp_path, endpoint):
    arrivals = arrivals_around_a_429(endpoint)
    result = run(tmp_path, endpoint, [RATE_LIMITED_PROMPT, *PROMPTS_BESIDE_IT], "--num_workers=4")
    assert result.returncode == 0, result.stderr
    assert_the_429_paused_every_other_session(arrivals)
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 4


def test_requests_per_minute_paces_requests_across_all_workers(tmp_path, endpoint):
    arrivals = record_arrivals(endpoint)
    # Web tools only (none called): no sandbox starting beside the requests delays their delivery.
    result = run(tmp_path, endpoint, [f"paced {i}" for i in range(6)], "--num_workers=6", "--requests_per_minute=120",
                 distribution="minimal")
    assert result.returncode == 0, result.stderr
    times = sorted(t for t, _ in arrivals)
    # 120/min = one every 0.5 s: six requests span 2.5 s (unpaced, they would arrive together). A
    # request goes out at its slot, but the first of a worker process may arrive late (its client
    # connects first), which shortens the span by up to one interval.
    assert len(times) == 6 and times[-1] - times[0] >= 2.0


def test_prompt_time_limit_keeps_the_turns_so_far_as_a_partial_row(tmp_path, endpoint):
    # The limit leaves "quick" room for its sandbox's start (about a second here), which it covers too.
    prompt = '[[call terminal {"command": "sleep 30"}]] too slow'
    result = run(tmp_path, endpoint, [prompt, "quick"], "--prompt_timeout=4")
    assert result.returncode == 0, result.stderr
    slow = next(row for row in batch_rows(tmp_path / "data" / "run") if row.get("conversations")
                and human_prompt(row) == prompt)
    assert slow["end_reason"] == "prompt_timeout" and slow["partial"] is True and slow["api_calls"] == 1


def test_prompt_time_limit_before_any_reply_fails_the_prompt_for_a_retry(tmp_path, endpoint):
    result = run(tmp_path, endpoint, ["[[sleep 5]] no reply in time"], "--prompt_timeout=1")
    assert result.returncode == 2, result.stderr   # a failure row: resume retries it
    [row] = batch_rows(tmp_path / "data" / "run")
    assert row["failed"] is True and row["error_type"] == "prompt_timeout"


def test_prompt_time_limit_covers_an_environment_that_is_slow_to_start(tmp_path, endpoint, monkeypatch):
    install_stand_in_clis(tmp_path, monkeypatch, "docker")
    monkeypatch.setenv("FAKE_RUN_SECONDS", "5")        # creating the container outlasts the limit
    result = run(tmp_path, endpoint, ["waits for its container"], "--prompt_timeout=1",
                 env={"TERMINAL_ENV": "docker"})
    assert result.returncode == 2, result.stderr
    [row] = batch_rows(tmp_path / "data" / "run")
    assert row["failed"] is True and row["error_type"] == "prompt_timeout"
    assert "while its environment was starting" in row["error"]
    assert endpoint.requests == []


def test_spending_cap_stops_admitting_prompts_and_resume_continues(tmp_path, endpoint):
    prompts = [f"costly {i}" for i in range(6)]            # each call reports a cost of 0.001
    result = run(tmp_path, endpoint, prompts, "--num_workers=1", "--max_cost=0.0025", *REPORTED_COST)
    assert result.returncode == 0, result.stderr
    assert len(batch_rows(tmp_path / "data" / "run")) == 3
    assert "spending cap reached" in result.stdout and "--resume" in result.stdout
    resumed = run(tmp_path, endpoint, prompts, "--num_workers=1", "--resume")
    assert resumed.returncode == 0
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 6


def test_a_resume_past_a_reached_cap_starts_no_worker_nor_sandbox(tmp_path, endpoint, monkeypatch):
    # Before, it started the pool (workers, the container engine's leftovers check) to admit nothing.
    prompts = [f"costly {i}" for i in range(3)]
    assert run(tmp_path, endpoint, prompts, "--num_workers=1", "--max_cost=0.001", *REPORTED_COST).returncode == 0
    backend = install_stand_in_clis(tmp_path, monkeypatch, "docker")
    endpoint.reset()
    resumed = run(tmp_path, endpoint, prompts, "--num_workers=1", "--max_cost=0.001", *REPORTED_COST, "--resume",
                  env={"TERMINAL_ENV": "docker"})
    assert resumed.returncode == 0, resumed.stderr
    assert "Stopped admitting prompts: spending cap reached" in " ".join(resumed.stdout.split())
    # The engine is asked whether it answers (the check of the flags) and what a crashed run under this run
    # directory left (removed even when no prompt runs); no container starts.
    calls = backend.calls("docker")
    assert calls[0] == ["version", "--format", "{{.Server.Version}}"] and endpoint.requests == []
    assert not any(call[0] in ("run", "create", "exec", "start") for call in calls), calls
    assert (tmp_path / "data" / "run" / "statistics.json").exists()


def test_token_cap_stops_admitting_prompts(tmp_path, endpoint):
    result = run(tmp_path, endpoint, [f"wordy {i}" for i in range(5)], "--num_workers=1", "--max_total_tokens=200")
    assert result.returncode == 0, result.stderr
    assert len(batch_rows(tmp_path / "data" / "run")) == 2          # 120 tokens per call
    assert "token cap reached" in result.stdout


def test_a_slow_prompt_holds_one_slot_while_the_others_finish(tmp_path, endpoint):
    # The straggler's reply waits until the nine other rows are written (a minute at most), which
    # they are only if they do not wait for it.
    run_dir = tmp_path / "data" / "run"
    endpoint.script = holding_until_rows(run_dir, "straggler", 9)
    prompts = ["straggler", *[f"quick {i}" for i in range(9)]]
    result = run(tmp_path, endpoint, prompts, "--num_workers=2")
    assert result.returncode == 0, result.stderr
    written = [human_prompt(row) for row in batch_rows(run_dir)]
    assert written[-1] == "straggler"
    assert sorted(written[:-1]) == sorted(prompts[1:])


def test_at_the_end_of_the_dataset_no_prompt_waits_behind_a_busy_process_while_others_idle(tmp_path, endpoint):
    # 64 sessions hold a few tasks waiting beyond their slots while many remain. Tasks are handed out
    # in turn to the least loaded process, so process 0 runs prompts 0, P, 2P, ...; their replies are
    # held until the last prompts have been asked, which the other processes' free sessions can do at
    # once only if none of the last prompts was left waiting in process 0.
    processes = process_count(64)
    blockers, last = [f"blocker {i}" for i in range(64)], [f"last {i}" for i in range(8)]
    held = {prompt for i, prompt in enumerate(blockers) if i % processes == 0}
    asked: list[str] = []
    released_after: list[list[str]] = []

    def hold_process_zero(body: dict) -> None:
        prompt = last_user_message(body)
        asked.append(prompt)
        if prompt in held:
            deadline = time.monotonic() + 30
            while not set(last) <= set(asked) and time.monotonic() < deadline:
                time.sleep(0.05)
            released_after.append([p for p in last if p in asked])
        return None

    endpoint.script = hold_process_zero
    result = run(tmp_path, endpoint, [*blockers, *last], "--num_workers=64", distribution="minimal")
    assert result.returncode == 0, result.stderr
    assert released_after and all(seen == last for seen in released_after)


def test_waiting_places_hold_one_task_per_eight_slots_until_the_last_round():
    places = Places([16, 16])
    taken = [places.take() for _ in range(36)]
    assert places.free == 0 and sorted(taken) == [0] * 18 + [1] * 18
    places.give_back(1)
    places.last_round()
    assert (places.free, places.held) == (0, 35)        # process 1 runs 16 with one more waiting
    for _ in range(3):
        places.give_back(0)
    assert places.free == 1 and places.take() == 0 and places.free == 0


def test_token_cap_admits_no_prompt_once_a_reply_counted_no_tokens(tmp_path):
    # Before: replies without usage counted 0 tokens, and a run under --max_total_tokens=1 ran every prompt.
    with ScriptedEndpoint(reports_usage=False) as server:
        result = run(tmp_path, server, [f"wordy {i}" for i in range(3)], "--num_workers=1", "--max_total_tokens=1")
    assert result.returncode == 0, result.stderr
    assert len(batch_rows(tmp_path / "data" / "run")) == 1
    said = " ".join(result.stdout.split())
    assert "Stopped admitting prompts: --max_total_tokens cannot be held: 1 reply counted no tokens" in said


def test_a_prompt_that_timed_out_waiting_for_its_pace_slot_counts_no_model_call(tmp_path, endpoint):
    # Before: its failure row said api_calls 1, and the summary counted a request the endpoint never saw.
    result = run(tmp_path, endpoint, ["first", "second"], "--num_workers=2", "--requests_per_minute=1",
                 "--prompt_timeout=2")
    assert result.returncode == 2, result.stderr
    failed = [row for row in batch_rows(tmp_path / "data" / "run") if row.get("failed")]
    assert len(failed) == 1 and failed[0]["error_type"] == "prompt_timeout"
    assert failed[0]["api_calls"] == 0
    assert len(endpoint.requests) == 1



def test_a_pace_slot_left_by_a_prompt_that_timed_out_waiting_goes_to_the_next_request(tmp_path, endpoint):
    # One request every 6 s, six prompts, three at once, each with 9 s. The first three take the slots at
    # 0, 6 and 12 s; the fourth starts as the first ends and takes 18 s, the fifth as the second ends (6 s) and
    # takes 24 s: those of 12, 18 and 24 s time out waiting. The sixth starts as the one of 12 s times out and
    # takes the slot it left, well within its own limit. Before, a slot whose prompt was cut off while it
    # waited stayed taken: the sixth got 30 s and timed out without a request, as every later prompt would.
    # (Each request has 3 s to be answered within its prompt's limit, a loaded machine's lag included.)
    prompts = [f"prompt {index}" for index in range(6)]
    result = run(tmp_path, endpoint, prompts, "--num_workers=3", "--requests_per_minute=10", "--prompt_timeout=9")
    assert result.returncode == 2, result.stderr
    rows = batch_rows(tmp_path / "data" / "run")
    assert sum(not row.get("failed") for row in rows) == 3
    assert len(endpoint.requests) == 3


def test_a_resume_under_the_token_cap_admits_no_prompt_once_an_earlier_reply_counted_no_tokens(tmp_path):
    # Before: each --resume forgot such replies and started --num_workers more prompts before stopping.
    prompts = [f"wordy {i}" for i in range(3)]
    with ScriptedEndpoint(reports_usage=False) as server:
        run(tmp_path, server, prompts, "--num_workers=1", "--max_total_tokens=1")
        resumed = run(tmp_path, server, prompts, "--num_workers=1", "--max_total_tokens=1", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert len(batch_rows(tmp_path / "data" / "run")) == 1
    said = " ".join(resumed.stdout.split())
    assert "Stopped admitting prompts: --max_total_tokens cannot be held: 1 reply counted no tokens" in said
