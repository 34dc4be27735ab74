"""The run's limits under load and against a hostile endpoint: a cap holds while the run goes on, not
after the damage, and no reply can blind it."""

from __future__ import annotations

import json

import pytest
from conftest import REPORTED_COST, batch_rows, endpoint_args, run_cli, write_dataset
from scripted_endpoint import prompt_text

from batchrun.workers import process_count, waiting_places

# A reply the endpoint billed, whose usage says a cost no run can add up.
NEGATIVE_COST_REPLY = (b'{"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": [{"index": 0, '
                       b'"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}], '
                       b'"usage": {"prompt_tokens": 10, "completion_tokens": 5, "cost": -5}}')


def run(tmp_path, endpoint, prompts, *extra):
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    return run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=100", "--run_name=run",
                   "--distribution=minimal", *endpoint_args(endpoint), *extra)


def test_no_prompt_starts_after_a_cap_is_reached_not_even_one_handed_to_a_worker_early(tmp_path, endpoint):
    # Before: each worker process held a task beyond its sessions (one per eight), which started once a
    # session ended, after the first replies had reached the cap: 36 prompts ran under --num_workers=32.
    sessions = 8 * process_count(1 << 20)
    if sessions > 64:
        pytest.skip("so many cores that the test would run hundreds of sessions")
    assert waiting_places(sessions // process_count(sessions)) > 0
    # Twice as many prompts left as sessions: the waiting places are not given up for the last round yet.
    result = run(tmp_path, endpoint, [f"[[sleep 0.3]] capped {i}" for i in range(3 * sessions)],
                 f"--num_workers={sessions}", "--max_cost=0.0005", *REPORTED_COST)
    assert result.returncode == 0, result.stderr
    assert len(batch_rows(tmp_path / "data" / "run")) == sessions
    assert f"{2 * sessions} prompts were not started" in " ".join(result.stdout.split())


@pytest.mark.parametrize("cap", ["--max_total_tokens=1000", "--max_cost=1"])
def test_a_reply_whose_usage_cannot_be_read_stops_admitting_prompts_under_a_cap(tmp_path, endpoint, cap):
    # Before: the reply was refused and its usage counted as nothing, so every prompt of the dataset ran,
    # each paid for, under a cap that saw no spending at all.
    endpoint.script = lambda body: (200, NEGATIVE_COST_REPLY, {}) if "hostile" in prompt_text(body) else None
    result = run(tmp_path, endpoint, [f"hostile {i}" for i in range(3)], "--num_workers=1", "--max_retries=0", cap,
                 *REPORTED_COST)
    assert result.returncode == 2, result.stderr
    assert len(batch_rows(tmp_path / "data" / "run")) == 1
    assert "cannot be held" in " ".join(result.stdout.split())
    statistics = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    assert statistics["this_run"]["replies_by_cost_source"] == {"unknown": 1}
