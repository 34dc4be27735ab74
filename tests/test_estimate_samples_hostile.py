"""--estimate under conditions its figures cannot see through: no usage reported, a single sample, a run
with nothing left; each once gave a projection that looked certain and was wrong."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import REPORTED_COST, run_cli, write_dataset
from scripted_endpoint import ScriptedEndpoint


def run(tmp_path: Path, server: ScriptedEndpoint, dataset: Path, *flags: str, expect: int = 0):
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=50", "--run_name=run",
                     "--distribution=minimal", f"--base_url={server.base_url}", "--model=scripted-model", *flags)
    assert result.returncode == expect, result.stderr
    return result


def estimate_path(tmp_path: Path) -> Path:
    return tmp_path / "data" / "run" / "estimate.json"


def test_when_the_endpoint_reports_no_usage_the_estimate_says_its_tokens_are_unknown_not_zero(tmp_path):
    # Before: "the other 7 samples: tokens 0 (0 to 0)", and the whole run 0 tokens, for replies that
    # reported no usage at all.
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"prompt {index}" for index in range(10)])
    with ScriptedEndpoint(reports_usage=False) as server:
        result = run(tmp_path, server, dataset, "--estimate=3", "--price_per_mtok=1,1")
    figures = json.loads(estimate_path(tmp_path).read_text())
    assert figures["per_sample"]["tokens"] is None
    assert figures["remaining"]["tokens"] is None and figures["whole_run"]["tokens"] is None
    assert figures["tokens_unknown_replies"] == 3
    assert "tokens unknown" in " ".join(result.stdout.split())


def test_an_estimate_from_a_single_sample_gives_no_range_rather_than_a_certain_one(tmp_path):
    # Before: every bootstrap resample of one sample is that sample, so each range was as wide as nothing
    # ("tokens 1,080 (1,080 to 1,080)"): a certainty that one sample cannot give.
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"prompt {index}" for index in range(10)])
    with ScriptedEndpoint() as server:
        result = run(tmp_path, server, dataset, "--estimate=1")
    remaining = json.loads(estimate_path(tmp_path).read_text())["remaining"]
    assert remaining["tokens"] == {"estimate": 9 * 120, "low": None, "high": None}
    assert remaining["duration_seconds"]["low"] is None and remaining["duration_seconds"]["high"] is None
    assert "1,080 (1,080 to 1,080)" not in result.stdout
    said = " ".join(result.stdout.split())
    assert "no range from one sample" in said and "Estimate from 1 sample drawn" in said


def test_an_estimate_of_a_run_with_nothing_left_says_so_and_leaves_no_earlier_projection(tmp_path):
    # Before: "All prompts have already been processed!", and the estimate.json of the earlier --estimate
    # stayed, projecting 7 samples still to run for a run that had none.
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"prompt {index}" for index in range(10)])
    with ScriptedEndpoint() as server:
        run(tmp_path, server, dataset, "--estimate=3")
        run(tmp_path, server, dataset, "--resume")
        result = run(tmp_path, server, dataset, "--resume", "--estimate")
    assert not estimate_path(tmp_path).exists()
    assert "nothing left to estimate" in " ".join(result.stdout.split())


def test_a_small_projected_cost_is_shown_rather_than_rounded_to_nothing(tmp_path):
    # Before: "the other 2 samples: ... cost $0.00 ($0.00 to $0.00)" for $0.002.
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"prompt {index}" for index in range(5)])
    with ScriptedEndpoint() as server:
        result = run(tmp_path, server, dataset, "--estimate=3", *REPORTED_COST)
    assert "cost $0.0020 ($0.0020 to $0.0020)" in " ".join(result.stdout.split())


def test_an_estimate_that_ran_every_sample_does_not_send_the_user_to_resume(tmp_path):
    # Before: "The whole run: the same command with --resume ..." though the sample was the whole run.
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"prompt {index}" for index in range(3)])
    with ScriptedEndpoint() as server:
        result = run(tmp_path, server, dataset, "--estimate=5")
    said = " ".join(result.stdout.split())
    assert "The sample was the whole run" in said and "with --resume and without --estimate" not in said
