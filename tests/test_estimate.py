"""--estimate: a sample of the dataset runs, the rest is projected; the sample's rows are the run's first."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import REPORTED_COST, batch_rows, human_prompt, last_user_message, run_cli, write_dataset
from scripted_endpoint import ScriptedEndpoint

from batchrun import estimate


def mixed_length_prompts(count: int) -> list[str]:
    """Prompts from a few words to a few thousand, in no order."""
    return [f"task {index}: " + "word " * (10 + (index * 7919) % 1990) for index in range(count)]


def run(tmp_path: Path, server: ScriptedEndpoint, dataset: Path, *flags: str, expect: int = 0):
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=50", "--run_name=run",
                     "--distribution=minimal", f"--base_url={server.base_url}", "--model=scripted-model", *flags,
                     timeout=600)
    assert result.returncode == expect, result.stderr
    return result


def estimate_json(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "data" / "run" / "estimate.json").read_text())


def test_the_estimate_projects_the_whole_runs_tokens_and_the_resume_does_not_run_the_sample_again(tmp_path):
    prompts = mixed_length_prompts(2000)
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    with ScriptedEndpoint(tokens_by_length=True) as server:
        result = run(tmp_path, server, dataset, "--estimate", "--seed=5", "--num_workers=8")
        sampled = {human_prompt(row) for row in batch_rows(tmp_path / "data" / "run")}
        assert len(sampled) == 20 and len(server.requests) == 20
        projected = estimate_json(tmp_path)["whole_run"]["tokens"]
        assert "Estimate from 20 samples drawn across the dataset" in " ".join(result.stdout.split())
        server.reset()

        run(tmp_path, server, dataset, "--resume", "--num_workers=32")
        assert not {last_user_message(request) for request in server.requests} & sampled
        assert len(server.requests) == 2000 - 20
    usage = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())["usage"]
    used = usage["prompt_tokens"] + usage["completion_tokens"]
    assert abs(projected["estimate"] - used) / used < 0.15, (projected, used)
    assert projected["low"] <= projected["estimate"] <= projected["high"]


def test_the_sample_is_drawn_from_end_to_end_of_the_dataset(tmp_path):
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"prompt {index}" for index in range(400)])
    with ScriptedEndpoint() as server:
        run(tmp_path, server, dataset, "--estimate=10")
    indexes = sorted(row["prompt_index"] for row in batch_rows(tmp_path / "data" / "run"))
    assert len(indexes) == 10
    assert indexes[0] < 40 and indexes[-1] >= 360
    assert all(later - earlier <= 80 for earlier, later in zip(indexes, indexes[1:], strict=False))


def test_the_estimate_counts_samples_when_prompts_run_several_times(tmp_path):
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"prompt {index}" for index in range(10)])
    with ScriptedEndpoint() as server:
        run(tmp_path, server, dataset, "--estimate=6", "--samples_per_prompt=3")
    assert len(batch_rows(tmp_path / "data" / "run")) == 6
    assert estimate_json(tmp_path)["remaining"]["samples"] == 24


def test_with_several_samples_per_prompt_the_sample_is_still_drawn_from_end_to_end_of_the_dataset(tmp_path):
    """Spaced over the samples in the order they run (every prompt's first, then every second...), the
    draw fell on the same few prompts again and again: 10 of 100 prompts x 5 samples were 2 prompts."""
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"prompt {index}" for index in range(100)])
    with ScriptedEndpoint() as server:
        run(tmp_path, server, dataset, "--estimate=10", "--samples_per_prompt=5")
    indexes = sorted(row["prompt_index"] for row in batch_rows(tmp_path / "data" / "run"))
    assert len(set(indexes)) == 10, indexes
    assert indexes[0] < 10 and indexes[-1] >= 90


def test_the_estimate_gives_per_sample_figures_and_the_remaining_cost(tmp_path):
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"prompt {index}" for index in range(50)])
    with ScriptedEndpoint() as server:
        run(tmp_path, server, dataset, "--estimate=5")
    figures = estimate_json(tmp_path)
    assert figures["per_sample"]["model_calls"] == {"median": 1.0, "p10": 1.0, "p90": 1.0}
    assert figures["per_sample"]["tokens"]["median"] == 120
    assert figures["remaining"]["cost"]["estimate"] == pytest.approx(45 * 0.001)
    assert figures["whole_run"]["cost"]["estimate"] == pytest.approx(50 * 0.001)
    assert figures["remaining"]["bounded_by"] == "sessions"


def test_a_rate_limit_that_binds_is_named_as_what_bounds_the_duration(tmp_path):
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"prompt {index}" for index in range(50)])
    with ScriptedEndpoint() as server:
        result = run(tmp_path, server, dataset, "--estimate=4", "--requests_per_minute=60")
    remaining = estimate_json(tmp_path)["remaining"]
    assert remaining["bounded_by"] == "rate_limit"
    assert remaining["duration_seconds"]["estimate"] == pytest.approx(46 * 1, rel=0.01)
    assert "bounded by --requests_per_minute=60" in " ".join(result.stdout.split())     # as wrapped at 80 columns


def test_with_no_price_known_the_estimate_says_its_cost_is_unknown(tmp_path):
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"prompt {index}" for index in range(20)])
    with ScriptedEndpoint(reports_cost=False) as server:
        result = run(tmp_path, server, dataset, "--estimate=4")
    figures = estimate_json(tmp_path)
    assert figures["remaining"]["cost"] is None and figures["cost_unknown_replies"] == 4
    assert "cost unknown" in result.stdout


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_bad_estimate_size_gets_one_error_naming_the_flag(tmp_path, value):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["prompt"])
    with ScriptedEndpoint() as server:
        result = run(tmp_path, server, dataset, f"--estimate={value}", expect=1)
    assert "--estimate takes the number of samples to run" in result.stderr


def test_a_regression_on_prompt_length_recovers_a_total_that_grows_with_length():
    rng = random.Random(1)
    lengths = [rng.randrange(10, 5000) for _ in range(2000)]
    tokens = [300 + length // 4 for length in lengths]
    chosen = sorted(estimate.chosen_units(list(range(2000)), 20, rng))
    total = estimate.regression_total([lengths[i] for i in chosen], [tokens[i] for i in chosen], 2000, sum(lengths))
    assert total == pytest.approx(sum(tokens), rel=0.01)


class CountingRandom(random.Random):
    """Counts the draws of the bootstrap (one randrange per resampled run)."""

    draws = 0

    def randrange(self, *args, **kwargs):  # type: ignore[override]
        self.draws += 1
        return super().randrange(*args, **kwargs)


def sampled_runs(count: int) -> list[estimate.SampledRun]:
    return [estimate.SampledRun(prompt_chars=100 + index % 50, tokens=500 + index % 70, cost=0.001, model_calls=2,
                                tool_calls=1, wall_time=3.0 + index % 5, failed=False) for index in range(count)]


def report_of(runs: list[estimate.SampledRun], remaining: int, rng: random.Random) -> dict:
    return estimate.estimate_report(runs, remaining=remaining, remaining_chars=remaining * 120, sessions=64,
                                    requests_per_minute=None, concurrency=None, tokenless_replies=0,
                                    unpriced_replies=0, spent_tokens=0, spent_cost=0.0, rng=rng)


# A whole dataset run under --estimate: before, each of 2,000 rounds redrew all of its samples for each of four
# projections, minutes at the end of the run for a hundred thousand (where Ctrl-C no longer stops anything),
# with nothing left to project.
def test_nothing_left_to_project_draws_no_resample():
    rng = CountingRandom(1)
    figures = report_of(sampled_runs(20_000), 0, rng)
    assert rng.draws == 0 and figures["interval"] == "none: nothing is left to project"
    assert figures["remaining"]["cost"] == {"estimate": 0.0, "low": 0.0, "high": 0.0}
    assert figures["remaining"]["duration_seconds"]["estimate"] == 0.0


def test_a_large_sample_is_resampled_in_fewer_rounds_of_fewer_draws():
    # Failed samples are left to project: one of them made a whole dataset's resampling as long as before.
    rng = CountingRandom(1)
    figures = report_of(sampled_runs(5_000), 1000, rng)
    assert rng.draws == 4 * 200 * 5_000        # tokens, cost, model calls and duration: 200 rounds each
    rng = CountingRandom(1)
    report_of(sampled_runs(50_000), 1, rng)
    assert rng.draws == 4 * 200 * 5_000
    assert figures["interval"] == "10th to 90th percentile of 200 bootstrap resamples of the sample"
    assert report_of(sampled_runs(50), 1000, random.Random(1))["interval"].endswith(" 2000 bootstrap resamples of "
                                                                                      "the sample")


def test_a_resample_of_fewer_draws_than_samples_keeps_the_spread_of_the_whole_sample():
    # Drawn from ten times fewer, a resample's total spreads about three times wider: shrunk back, the range
    # of 50,000 samples is narrower than that of 5,000 like them, not as wide.
    def cost_range(count: int) -> float:
        rng = random.Random(7)
        runs = [estimate.SampledRun(prompt_chars=100, tokens=500, cost=rng.uniform(0.0, 0.02), model_calls=2,
                                    tool_calls=1, wall_time=3.0, failed=False) for _ in range(count)]
        cost = report_of(runs, 10_000, random.Random(1))["remaining"]["cost"]
        return cost["high"] - cost["low"]
    assert 0.2 < cost_range(50_000) / cost_range(5_000) < 0.5


def test_an_estimate_as_big_as_what_is_pending_runs_it_all_and_projects_nothing_more(tmp_path):
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"prompt {index}" for index in range(5)])
    with ScriptedEndpoint() as server:
        run(tmp_path, server, dataset, "--estimate=50")
        assert len(server.requests) == 5
    figures = estimate_json(tmp_path)
    assert figures["remaining"]["samples"] == 0
    assert figures["remaining"]["tokens"] == {"estimate": 0.0, "low": 0.0, "high": 0.0}
    assert figures["whole_run"]["tokens"]["estimate"] == 5 * 120


def test_a_sampled_prompt_that_failed_is_counted_among_the_samples_the_resume_runs(tmp_path):
    """A failed sample's row is retried by --resume: the estimate counted it as done, projecting 0 samples
    left and saying none of the sample would run again, and the resume then ran both failed prompts."""
    prompts = ["fails [[fail 400 always]]", "works", "fails too [[fail 400 always]]", "works too"]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    with ScriptedEndpoint() as server:
        result = run(tmp_path, server, dataset, "--estimate=4", expect=2)     # 2: some prompts failed
        figures = estimate_json(tmp_path)
        assert figures["sampled"] == 4 and figures["sampled_failed"] == 2
        assert figures["remaining"]["samples"] == 2
        assert "2 of them failed" in " ".join(result.stdout.split())
        server.reset()

        run(tmp_path, server, dataset, "--resume", expect=2)
        assert {last_user_message(request) for request in server.requests} == {prompts[0], prompts[2]}


def test_on_a_resumed_run_the_whole_runs_projection_counts_what_earlier_invocations_spent(tmp_path):
    """whole_run was the sample plus the rest: after a first invocation had run every prompt once, raising
    --samples_per_prompt to 2 with --estimate projected 1,200 tokens for a run that had already used 1,200."""
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"prompt {index}" for index in range(10)])
    with ScriptedEndpoint() as server:
        run(tmp_path, server, dataset)
        run(tmp_path, server, dataset, "--resume", "--samples_per_prompt=2", "--estimate=2")
    whole_run = estimate_json(tmp_path)["whole_run"]
    assert whole_run["tokens"]["estimate"] == 20 * 120
    assert whole_run["cost"]["estimate"] == pytest.approx(20 * 0.001)


def test_the_progress_of_an_estimate_counts_the_samples_it_runs_not_the_whole_dataset(tmp_path):
    # Before: each line counted against the whole dataset ("[2/6]"), and the live line's ETA and projected
    # cost were those of the six prompts, for an invocation that runs two.
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"prompt {index}" for index in range(6)])
    with ScriptedEndpoint() as server:
        result = run(tmp_path, server, dataset, "--estimate=2", "--num_workers=1")
    assert "[2/2] prompt" in result.stdout
    assert "/6]" not in result.stdout


def test_an_estimate_stopped_by_the_cap_counts_only_its_own_samples_as_not_started(tmp_path):
    # Before: "5 prompts were not started", counting the whole dataset's pending prompts, of which the
    # estimate was only ever to run two.
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"prompt {index}" for index in range(6)])
    with ScriptedEndpoint() as server:
        result = run(tmp_path, server, dataset, "--estimate=2", "--num_workers=1", "--max_cost=0.0005",
                     *REPORTED_COST)
    assert len(batch_rows(tmp_path / "data" / "run")) == 1
    assert "1 prompt was not started" in " ".join(result.stdout.split())
