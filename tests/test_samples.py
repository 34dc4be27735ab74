"""--samples_per_prompt: K rows per prompt, each sample its own session, resumed per (prompt, sample);
--best_of chooses one sample per prompt at export."""

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
    batch_runner_command,
    cli_environment,
    endpoint_args,
    finished_row_count,
    human_prompt,
    last_user_message,
    read_jsonl,
    run_cli,
    wait_for,
    write_dataset,
)

from batchrun import rows
from batchrun.flag_values import MAX_SAMPLES_PER_PROMPT
from batchrun.report.scan import RunScan
from batchrun.rows import AssistantTurn, SessionResult, ToolCallRecord, Usage

PROMPTS = [f"prompt number {index}" for index in range(10)]


def sample_run(tmp_path: Path, endpoint, dataset: Path, *extra: str, run_name: str = "run",
               expect: int = 0) -> subprocess.CompletedProcess:
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=4", f"--run_name={run_name}",
                     "--distribution=minimal", *endpoint_args(endpoint), *extra)
    assert result.returncode == expect, result.stderr
    return result


def samples_by_prompt(row_list: list[dict]) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for row in row_list:
        found.setdefault(human_prompt(row), []).append(row["sample_index"])
    return {prompt: sorted(indexes) for prompt, indexes in found.items()}


def merged(tmp_path: Path, run_name: str = "run") -> list[dict]:
    return read_jsonl(tmp_path / "data" / run_name / "trajectories.jsonl")


def test_each_prompt_gives_k_rows_with_sample_indices_0_to_k_minus_1(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS)
    sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=3")
    assert len(merged(tmp_path)) == 30
    assert samples_by_prompt(merged(tmp_path)) == {prompt: [0, 1, 2] for prompt in PROMPTS}
    assert len(endpoint.requests) == 30       # one session, and here one model call, per sample


def test_the_samples_of_a_prompt_are_spread_through_the_run_not_run_back_to_back(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS[:4])
    sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=3", "--num_workers=1")
    assert [last_user_message(request) for request in endpoint.requests] == PROMPTS[:4] * 3


def test_kill_9_midway_then_resume_finishes_with_every_sample_exactly_once(tmp_path, endpoint):
    prompts = [f"[[sleep 0.3]] slow prompt {index}" for index in range(10)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    run_dir = tmp_path / "data" / "run"
    args = [f"--dataset_file={dataset}", "--batch_size=4", "--run_name=run", "--distribution=minimal",
            "--num_workers=4", "--samples_per_prompt=3", *endpoint_args(endpoint)]
    process = subprocess.Popen(batch_runner_command(*args), cwd=tmp_path, env=cli_environment(tmp_path),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: finished_row_count(run_dir) >= 8)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    done_before = len(batch_rows(run_dir))
    assert 8 <= done_before < 30
    endpoint.reset()

    result = run_cli(tmp_path, *args, "--resume")
    assert result.returncode == 0, result.stderr
    written = [(row["prompt_index"], row["sample_index"]) for row in batch_rows(run_dir)]
    assert len(written) == len(set(written)) == 30            # no sample twice, none missing
    assert samples_by_prompt(merged(tmp_path)) == {prompt: [0, 1, 2] for prompt in prompts}
    assert len(endpoint.requests) == 30 - done_before
    assert f"{done_before} samples already done" in result.stdout


def test_raising_k_on_resume_runs_only_the_new_samples(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS)
    sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=3")
    endpoint.reset()
    sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=5", "--resume")
    assert len(endpoint.requests) == 20
    assert samples_by_prompt(merged(tmp_path)) == {prompt: [0, 1, 2, 3, 4] for prompt in PROMPTS}


def test_lowering_k_on_resume_runs_nothing_and_keeps_every_sample(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS[:3])
    sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=3")
    endpoint.reset()
    result = sample_run(tmp_path, endpoint, dataset, "--resume")
    assert endpoint.requests == []
    assert "All prompts have already been processed!" in result.stdout
    assert len(merged(tmp_path)) == 9
    # Before, nothing said that the rows beyond K stay in the merged file and its figures.
    assert ("resume: 6 samples past --samples_per_prompt=1 (up to 3 per prompt) stay in trajectories.jsonl "
            "and count in its figures") in " ".join(result.stdout.split())


def test_lowering_k_on_resume_says_that_failed_samples_past_it_are_not_run_again(tmp_path, endpoint):
    # Failure rows past K were said to stay in trajectories.jsonl (no failure row goes there) and to be retried.
    def first_samples_only(body):
        first_samples_only.requests += 1        # type: ignore[attr-defined]
        if first_samples_only.requests > 2:     # type: ignore[attr-defined]  # one worker: both samples 0 first
            return 400, {"error": {"message": "refused", "type": "invalid_request_error"}}, {}
        return None
    first_samples_only.requests = 0             # type: ignore[attr-defined]
    endpoint.script = first_samples_only
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS[:2])
    sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=3", "--num_workers=1", expect=2)
    endpoint.reset()
    result = sample_run(tmp_path, endpoint, dataset, "--resume")
    out = " ".join(result.stdout.split())
    assert endpoint.requests == []
    assert ("resume: 4 failed samples past --samples_per_prompt=1 are not run again; --samples_per_prompt=3 "
            "retries them") in out
    assert "stay in trajectories.jsonl" not in out and "failed before" not in out


def test_a_resume_says_failed_before_only_of_the_samples_it_runs_again(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["[[fail 400 1]] fickle", "easy"])
    sample_run(tmp_path, endpoint, dataset, expect=2)
    retried = sample_run(tmp_path, endpoint, dataset, "--resume")
    assert "1 remaining (1 of them failed before)" in " ".join(retried.stdout.split())
    again = sample_run(tmp_path, endpoint, dataset, "--resume")     # the failure row is still in its batch file
    assert "0 remaining" in again.stdout and "failed before" not in again.stdout


def test_a_single_sample_run_resumed_with_more_samples_keeps_its_rows_as_the_first_samples(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS[:3])
    sample_run(tmp_path, endpoint, dataset)
    assert [row["sample_index"] for row in merged(tmp_path)] == [0, 0, 0]
    endpoint.reset()
    sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=2", "--resume")
    assert len(endpoint.requests) == 3
    assert samples_by_prompt(merged(tmp_path)) == {prompt: [0, 1] for prompt in PROMPTS[:3]}


def test_each_occurrence_of_a_repeated_prompt_gets_its_own_samples(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["same", "same", "other"])
    sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=2")
    by_occurrence = Counter((row["prompt_index"], row["sample_index"]) for row in merged(tmp_path))
    assert by_occurrence == Counter({(index, sample): 1 for index in range(3) for sample in range(2)})
    endpoint.reset()
    sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=3", "--resume")
    assert Counter(last_user_message(request) for request in endpoint.requests) == {"same": 2, "other": 1}


def test_resume_runs_exactly_the_samples_of_repeated_prompts_that_have_no_row(tmp_path, endpoint):
    # The first request of the repeated text fails: sample 0 of prompt 0; every other sample completes.
    same = "[[fail 400 1]] [[final done]] same task"
    dataset = write_dataset(tmp_path / "dataset.jsonl", [same, same, "other task"])
    flags = ("--samples_per_prompt=2", "--num_workers=1")
    sample_run(tmp_path, endpoint, dataset, *flags, expect=2)
    before = len(endpoint.requests)     # not reset: the failure was the text's only one
    sample_run(tmp_path, endpoint, dataset, *flags, "--resume")
    assert [last_user_message(request) for request in endpoint.requests[before:]] == [same]
    units = Counter((row["prompt_index"], row["sample_index"]) for row in merged(tmp_path))
    assert units == Counter({(index, sample): 1 for index in range(3) for sample in range(2)})
    statistics = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    assert statistics["samples"]["prompts_by_completed_samples"] == {"2": 3}


def test_each_sample_draws_its_own_toolsets_and_the_first_draws_as_a_one_sample_run(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS[:6])
    flags = ("--distribution=research", "--seed=7")
    sample_run(tmp_path, endpoint, dataset, *flags, run_name="single")
    sample_run(tmp_path, endpoint, dataset, *flags, "--samples_per_prompt=4", run_name="four")
    single = {row["prompt_index"]: row["toolsets_sampled"] for row in batch_rows(tmp_path / "data" / "single")}
    draws: dict[int, list] = {}
    for row in batch_rows(tmp_path / "data" / "four"):
        draws.setdefault(row["prompt_index"], [None] * 4)[row["sample_index"]] = row["toolsets_sampled"]
    assert {index: samples[0] for index, samples in draws.items()} == single
    assert any(len({tuple(draw) for draw in samples}) > 1 for samples in draws.values())


def test_statistics_count_the_prompts_with_a_completed_sample(tmp_path, endpoint):
    # The scripted endpoint fails the first two requests of the first prompt: both its samples.
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["[[fail 400 2]] hard", "easy", "[[fail 400 1]] fickle"])
    sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=2", "--num_workers=1", expect=2)
    statistics = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    assert statistics["samples_per_prompt"] == 2
    assert statistics["samples"] == {"prompts_with_rows": 3, "prompts_with_a_completed_sample": 2,
                                     "prompts_by_completed_samples": {"0": 1, "1": 1, "2": 1}}


def test_the_report_shows_the_prompts_with_a_completed_sample_and_names_each_sample(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["[[fail 400 2]] hard", "easy"])
    sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=2", "--num_workers=1", expect=2)
    page = (tmp_path / "data" / "run" / "report.html").read_text()
    assert "prompts with a completed sample" in page
    assert "1 of 2 prompts (2 samples asked each); by completed samples: 1 with 0, 1 with 2" in page
    assert '"si": 1' in page or '"si":1' in page


def test_statistics_of_a_one_sample_run_have_no_per_prompt_section(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS[:2])
    sample_run(tmp_path, endpoint, dataset)
    statistics = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    assert "samples" not in statistics and "samples_per_prompt" not in statistics


def test_the_progress_counts_samples_and_each_line_names_its_sample(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS[:2])
    result = sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=2")
    assert "2 prompts × 2 samples" in result.stdout
    assert "[4/4] prompt" in result.stdout
    assert "prompt 1 sample 1" in result.stdout
    assert "2 of 2 prompts have a completed sample" in result.stdout


def test_the_checkpoint_counts_samples(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS[:3])
    sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=2")
    checkpoint = json.loads((tmp_path / "data" / "run" / "checkpoint.json").read_text())
    assert (checkpoint["total_prompts"], checkpoint["samples_per_prompt"], checkpoint["total_samples"],
            checkpoint["completed_samples"]) == (3, 2, 6, 6)


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_bad_samples_per_prompt_gets_one_error_naming_the_flag(tmp_path, endpoint, value):
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS[:1])
    result = sample_run(tmp_path, endpoint, dataset, f"--samples_per_prompt={value}", expect=1)
    assert "--samples_per_prompt must be a positive integer" in result.stderr
    assert endpoint.requests == [] and not (tmp_path / "data" / "run").exists()


# The plan keeps a round per sample: 10**400 sat silent, filling memory, and left a run directory behind.
def test_more_samples_per_prompt_than_the_plan_can_hold_is_refused_before_anything(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS[:1])
    result = sample_run(tmp_path, endpoint, dataset, f"--samples_per_prompt={10**400}", expect=1)
    assert result.stderr.strip() == f"error: --samples_per_prompt is at most {MAX_SAMPLES_PER_PROMPT:,}, got a 401-digit number"
    assert endpoint.requests == [] and not (tmp_path / "data" / "run").exists()


def test_rows_of_runs_with_and_without_samples_load_together_with_datasets(tmp_path, endpoint):
    datasets = pytest.importorskip("datasets")
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS[:3])
    sample_run(tmp_path, endpoint, dataset, run_name="single")
    sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=3", run_name="three")
    files = [str(tmp_path / "data" / name / "trajectories.jsonl") for name in ("single", "three")]
    loaded = datasets.load_dataset("json", data_files=files, split="train", cache_dir=str(tmp_path / "cache"))
    assert sorted(loaded["sample_index"]) == [0] * 6 + [1] * 3 + [2] * 3


# -- --best_of at export ------------------------------------------------------------------------


def finished_call(result: str) -> ToolCallRecord:
    return ToolCallRecord(id="c1", name="web_search", arguments='{"query": "q"}', result=result)


SUCCEEDED, FAILED_RESULT = '{"results": []}', '{"error": "no network"}'


def sample(prompt_index: int, sample_index: int, *, end_reason: str = "final_answer", calls: int = 1,
           reasoning: str = "thinking", last_result: str = SUCCEEDED) -> SessionResult:
    """A sample of prompt ``prompt_index``: ``calls`` model calls, the last the answer."""
    prompt = f"prompt {prompt_index}"
    turns = [AssistantTurn(reasoning, "", [finished_call(SUCCEEDED)]) for _ in range(calls - 2)]
    if calls > 1:
        turns.append(AssistantTurn(reasoning, "", [finished_call(last_result)]))
    turns.append(AssistantTurn(reasoning, "The answer."))
    return SessionResult(prompt_index=prompt_index, content_key=rows.content_key(prompt, None, None), prompt=prompt,
                         toolsets=["web"], offered_tools=["web_search"], turns=turns, api_calls=calls,
                         usage=Usage(), wall_time=1.0, end_reason=end_reason, sample_index=sample_index)


def write_samples(home: Path, results: list[SessionResult]) -> None:
    run_dir = home / "data" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "batch_0.jsonl").write_bytes(b"".join(
        rows.encode_finished(result, batch_num=0, model="m", timestamp="t", discard_no_reasoning=False)
        for result in results))


def exported_samples(home: Path, *flags: str) -> tuple[dict[int, int], subprocess.CompletedProcess]:
    out = home / "out.jsonl"
    result = run_cli(home, "--run_name=run", "--export=sharegpt", f"--out={out}", *flags)
    assert result.returncode == 0, result.stderr
    return {row["prompt_index"]: row["sample_index"] for row in read_jsonl(out)}, result


BEST_OF_RUN = [
    sample(0, 0, end_reason="max_turns", calls=2),        # partial: never good
    sample(0, 1, calls=4, reasoning="a long, long stretch of thinking"),
    sample(0, 2, calls=2, last_result=FAILED_RESULT),     # its last tool call failed
    sample(0, 3, calls=3),
    sample(1, 0, end_reason="max_turns"),
    sample(1, 1, end_reason="max_turns"),
    sample(2, 2, calls=1, reasoning="brief"),
    sample(2, 1, calls=1, reasoning="rather longer"),
]


def test_without_best_of_the_export_keeps_every_sample(tmp_path):
    write_samples(tmp_path, BEST_OF_RUN)
    out = tmp_path / "out.jsonl"
    assert run_cli(tmp_path, "--run_name=run", "--export=sharegpt", f"--out={out}").returncode == 0
    assert len(read_jsonl(out)) == len(BEST_OF_RUN)
    assert not (tmp_path / "out.best_of.json").exists()


def test_best_of_first_completed_keeps_the_completed_sample_of_the_lowest_index(tmp_path):
    write_samples(tmp_path, BEST_OF_RUN)
    assert exported_samples(tmp_path, "--best_of=first_completed")[0] == {0: 1, 2: 1}


def test_best_of_fewest_calls_keeps_the_shortest_completed_sample_whose_last_call_succeeded(tmp_path):
    write_samples(tmp_path, BEST_OF_RUN)
    assert exported_samples(tmp_path, "--best_of=fewest_calls")[0] == {0: 3, 2: 1}


def test_best_of_fewest_calls_ranks_a_sample_whose_call_count_was_edited_into_text_last(tmp_path):
    # Before, such a row (edited by hand) ended the export in a traceback (int('few')).
    write_samples(tmp_path, BEST_OF_RUN)
    batch = tmp_path / "data" / "run" / "batch_0.jsonl"
    edited = [json.loads(line) for line in batch.read_text().splitlines()]
    [shortest] = [row for row in edited if (row["prompt_index"], row["sample_index"]) == (0, 3)]
    shortest["api_calls"] = "few"
    batch.write_bytes(b"".join(rows.encode_row(row) for row in edited))
    assert exported_samples(tmp_path, "--best_of=fewest_calls")[0] == {0: 1, 2: 1}


def test_best_of_longest_reasoning_keeps_the_completed_sample_that_reasoned_most(tmp_path):
    write_samples(tmp_path, BEST_OF_RUN)
    assert exported_samples(tmp_path, "--best_of=longest_reasoning")[0] == {0: 1, 2: 1}


def test_best_of_prints_and_records_the_rule_and_the_prompts_by_good_samples(tmp_path):
    write_samples(tmp_path, BEST_OF_RUN)
    _, result = exported_samples(tmp_path, "--best_of=fewest_calls")
    record = json.loads((tmp_path / "out.best_of.json").read_text())
    assert record["best_of"] == "fewest_calls" and record["rule"]
    assert (record["prompts"], record["prompts_kept"], record["prompts_by_good_samples"]) == (3, 2, {"0": 1, "2": 2})
    assert "best of samples: fewest_calls" in result.stdout
    assert "2 of 3 prompts kept; prompts by good samples: 1 with 0, 2 with 2" in result.stdout
    assert "another sample of the prompt was chosen" in result.stdout


def test_a_later_export_without_best_of_removes_the_record_of_an_earlier_choice(tmp_path):
    write_samples(tmp_path, BEST_OF_RUN)
    exported_samples(tmp_path, "--best_of=first_completed")
    exported_samples(tmp_path)
    assert not (tmp_path / "out.best_of.json").exists()


# Named by the stem alone, one record served train.jsonl and train.parquet: a plain export of the one
# removed the record of the other.
def test_an_export_to_another_file_of_the_same_stem_keeps_the_record_of_an_earlier_choice(tmp_path):
    write_samples(tmp_path, BEST_OF_RUN)
    exported_samples(tmp_path, "--best_of=first_completed")
    result = run_cli(tmp_path, "--run_name=run", "--export=sharegpt", f"--out={tmp_path / 'out.json'}")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "out.best_of.json").read_text())["best_of"] == "first_completed"


def test_an_unknown_best_of_rule_is_refused_naming_the_rules(tmp_path):
    write_samples(tmp_path, BEST_OF_RUN)
    result = run_cli(tmp_path, "--run_name=run", "--export=sharegpt", "--best_of=shortest")
    assert result.returncode == 1
    assert "--best_of must be one of first_completed, fewest_calls, longest_reasoning" in result.stderr


# -- a dataset reordered between invocations ------------------------------------------------------


def reordered_run(tmp_path: Path, endpoint, before: list[str], after: list[str], *flags: str) -> Path:
    """A run of ``before`` with one sample per prompt, resumed with ``after`` and two samples per prompt."""
    dataset = write_dataset(tmp_path / "dataset.jsonl", before)
    sample_run(tmp_path, endpoint, dataset, *flags, expect=2 if any("[[fail" in line for line in before) else 0)
    write_dataset(dataset, after)
    sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=2", "--resume", *flags)
    return tmp_path / "data" / "run"


def test_after_a_reorder_the_merged_rows_of_a_prompt_carry_its_place_in_the_dataset_now(tmp_path, endpoint):
    run_dir = reordered_run(tmp_path, endpoint, PROMPTS[:4], PROMPTS[3::-1])
    places = {(human_prompt(row), row["prompt_index"]) for row in merged(tmp_path)}
    assert places == {(prompt, 3 - index) for index, prompt in enumerate(PROMPTS[:4])}
    assert {row["prompt_index"] for row in batch_rows(run_dir) if row["sample_index"] == 0} == {0, 1, 2, 3}


def test_after_a_reorder_statistics_count_each_prompt_once_with_all_its_samples(tmp_path, endpoint):
    run_dir = reordered_run(tmp_path, endpoint, PROMPTS[:4], PROMPTS[3::-1])
    statistics = json.loads((run_dir / "statistics.json").read_text())
    assert statistics["samples"] == {"prompts_with_rows": 4, "prompts_with_a_completed_sample": 4,
                                     "prompts_by_completed_samples": {"2": 4}}


def test_after_a_reorder_best_of_keeps_one_sample_per_prompt(tmp_path, endpoint):
    reordered_run(tmp_path, endpoint, PROMPTS[:4], PROMPTS[3::-1])
    kept, _result = exported_samples(tmp_path, "--best_of=first_completed")
    assert kept == {0: 0, 1: 0, 2: 0, 3: 0}


def test_after_a_reorder_a_prompt_whose_only_earlier_row_failed_is_one_prompt(tmp_path, endpoint):
    hard = "[[fail 400 1]] hard"
    run_dir = reordered_run(tmp_path, endpoint, [hard, *PROMPTS[:2]], [*PROMPTS[:2], hard], "--num_workers=1")
    statistics = json.loads((run_dir / "statistics.json").read_text())
    assert statistics["samples"]["prompts_with_rows"] == 3


def test_after_a_reorder_the_occurrences_of_a_repeated_prompt_keep_their_samples_apart(tmp_path, endpoint):
    run_dir = reordered_run(tmp_path, endpoint, ["same", "other", "same"], ["other", "same", "same"])
    assert Counter((row["prompt_index"], row["sample_index"]) for row in merged(tmp_path)) == \
        Counter({(index, sample): 1 for index in range(3) for sample in range(2)})
    statistics = json.loads((run_dir / "statistics.json").read_text())
    assert statistics["samples"]["prompts_by_completed_samples"] == {"2": 3}


def test_after_a_reorder_the_report_shows_each_row_at_its_prompts_place_now(tmp_path, endpoint):
    run_dir = reordered_run(tmp_path, endpoint, PROMPTS[:4], PROMPTS[3::-1])
    scan = RunScan(run_dir)
    scan.read_new_rows()
    chosen = scan.sample.chosen()
    assert len(chosen) == 8
    assert {(row["p"], row["id"]) for row in chosen} == {(prompt, 3 - index) for index, prompt in enumerate(PROMPTS[:4])}


def places_of_prompts(tmp_path: Path) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {}
    for row in merged(tmp_path):
        found.setdefault(human_prompt(row), set()).add(row["prompt_index"])
    return found


def merged_samples(tmp_path: Path) -> Counter:
    return Counter((row["prompt_index"], row["content_key"], row["sample_index"]) for row in merged(tmp_path))


def test_a_resume_with_a_lower_max_samples_keeps_the_rows_of_a_moved_prompt_at_one_place(tmp_path, endpoint):
    run_dir = reordered_run(tmp_path, endpoint, PROMPTS[:4], PROMPTS[3::-1])
    sample_run(tmp_path, endpoint, tmp_path / "dataset.jsonl", "--samples_per_prompt=2", "--resume",
               "--max_samples=2")
    assert places_of_prompts(tmp_path) == {prompt: {3 - index} for index, prompt in enumerate(PROMPTS[:4])}
    statistics = json.loads((run_dir / "statistics.json").read_text())
    assert statistics["samples"]["prompts_by_completed_samples"] == {"2": 4}


def test_a_repeated_prompt_cut_to_one_line_does_not_give_that_line_a_sample_twice(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["same", "same"])
    sample_run(tmp_path, endpoint, dataset)
    write_dataset(dataset, ["same"])
    sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=2", "--resume")
    assert max(merged_samples(tmp_path).values()) == 1, merged_samples(tmp_path)


@pytest.mark.parametrize("after", [["x", "y", "same", "same"], ["same", "other"]])
def test_after_a_reorder_no_line_of_a_repeated_prompt_has_a_sample_twice(tmp_path, endpoint, after):
    # The first request fails: the first occurrence has only its second sample, the other both.
    repeated = "[[fail 400 1]] same"
    dataset = write_dataset(tmp_path / "dataset.jsonl", [repeated, repeated])
    sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=2", "--num_workers=1", expect=2)
    write_dataset(dataset, [repeated if line == "same" else line for line in after])
    sample_run(tmp_path, endpoint, dataset, "--samples_per_prompt=2", "--resume")
    assert max(merged_samples(tmp_path).values()) == 1, merged_samples(tmp_path)
