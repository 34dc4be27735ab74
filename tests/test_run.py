"""A whole run through the real CLI against the scripted endpoint: what lands in data/<run_name>/."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter

import pyarrow as pa
import pyarrow.json as paj
import pytest
from conftest import (
    batch_rows,
    cli_environment,
    endpoint_args,
    human_prompt,
    last_user_message,
    read_jsonl,
    run_cli,
    write_dataset,
)

from model_tools import TOOL_NAMES

TOOL_PROMPT = ('make a file [[call write_file {"path": "notes/a.txt", "content": "hello"}]] '
               '[[call terminal {"command": "cat notes/a.txt && exit 3"}]]')


def run_prompts(tmp_path, endpoint, prompts, *extra, batch_size=3, run_name="run", distribution="terminal_only",
                env=None, prefix=()):
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    return run_cli(tmp_path, f"--dataset_file={dataset}", f"--batch_size={batch_size}", f"--run_name={run_name}",
                   f"--distribution={distribution}", *endpoint_args(endpoint), *extra, env=env, prefix=prefix)


def test_full_run_writes_batches_checkpoint_statistics_and_merged_file(tmp_path, endpoint):
    prompts = [f"question {i}" for i in range(6)] + [TOOL_PROMPT]
    result = run_prompts(tmp_path, endpoint, prompts)
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "data" / "run"
    assert sorted(p.name for p in run_dir.glob("batch_*.jsonl")) == ["batch_0.jsonl", "batch_1.jsonl", "batch_2.jsonl"]
    for path in run_dir.glob("batch_*.jsonl"):
        number = int(path.stem.split("_")[1])
        assert all(row["prompt_index"] // 3 == number for row in read_jsonl(path))
    merged = read_jsonl(run_dir / "trajectories.jsonl")
    assert sorted(row["prompt_index"] for row in merged) == list(range(7))
    checkpoint = json.loads((run_dir / "checkpoint.json").read_text())
    assert checkpoint["completed_prompts"] == 7
    assert checkpoint["run_name"] == "run"
    statistics = json.loads((run_dir / "statistics.json").read_text())
    assert statistics["total_prompts"] == 7
    assert statistics["trajectories_in_merged_file"] == 7
    assert statistics["tool_statistics"]["terminal"] == {"count": 1, "success": 1, "failure": 0,
                                                         "success_rate": 100.0, "failure_rate": 0.0}
    assert statistics["reasoning_statistics"]["coverage_percent"] == 100.0
    assert "BATCH PROCESSING COMPLETE" in result.stdout


def test_row_has_the_hermes_sharegpt_shape(tmp_path, endpoint):
    assert run_prompts(tmp_path, endpoint, [TOOL_PROMPT]).returncode == 0
    [row] = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    system, human, first, tool, second, tool2, final = row["conversations"]
    assert [t["from"] for t in row["conversations"]] == ["system", "human", "gpt", "tool", "gpt", "tool", "gpt"]
    assert "<tools>" in system["value"] and '"name": "terminal"' in system["value"]
    assert '"name": "web_search"' not in system["value"]          # only the tools this prompt was offered
    assert human["value"] == TOOL_PROMPT
    assert first["value"].startswith("<think>\nReasoning for turn 0.\n</think>\n<tool_call>\n")
    assert first["value"].endswith('<tool_call>\n{"name": "write_file", "arguments": {"path": "notes/a.txt", '
                                   '"content": "hello"}}\n</tool_call>')
    assert all(list(turn) == ["from", "value"] for turn in row["conversations"])
    response = json.loads(tool2["value"].removeprefix("<tool_response>\n").removesuffix("\n</tool_response>"))
    assert response["name"] == "terminal" and response["tool_call_id"] == "call_1_0"
    assert response["content"]["exit_code"] == 3 and response["content"]["output"].startswith("hello")
    assert final["value"] == "<think>\nReasoning for turn 2.\n</think>\nFinal answer."
    assert row["completed"] is True and row["partial"] is False and row["api_calls"] == 3
    assert row["toolsets_used"] == ["terminal", "file"]
    assert set(row["tool_stats"]) == set(TOOL_NAMES) == set(row["tool_error_counts"])
    assert row["tool_stats"]["write_file"] == {"count": 1, "success": 1, "failure": 0}
    assert row["metadata"]["model"] == "scripted-model" and row["metadata"]["batch_num"] == 0
    assert row["usage"] == {"prompt_tokens": 300, "completion_tokens": 60, "reasoning_tokens": 15,
                            "cached_tokens": 30, "cost": 0.003}
    assert row["end_reason"] == "final_answer" and row["wall_time_seconds"] > 0


def test_merged_file_loads_into_one_arrow_schema_across_blocks(tmp_path, endpoint):
    prompts = ["plain answer", TOOL_PROMPT, "another plain one", "[[invent]] invented then stop",
               '[[call read_file {"path": "missing.txt"}]] a failing tool call']
    assert run_prompts(tmp_path, endpoint, prompts, batch_size=2).returncode == 0
    path = tmp_path / "data" / "run" / "trajectories.jsonl"
    longest = max(len(line) for line in path.read_bytes().splitlines())
    # Blocks of about one row each: every row must infer the same schema on its own.
    table = paj.read_json(path, read_options=paj.ReadOptions(block_size=longest + 2))
    assert table.num_rows == 4
    assert pa.types.is_list(table.schema.field("conversations").type)


def test_failing_tool_call_is_counted_as_failure(tmp_path, endpoint):
    assert run_prompts(tmp_path, endpoint, ['[[call read_file {"path": "missing.txt"}]] read it']).returncode == 0
    [row] = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    assert row["tool_stats"]["read_file"] == {"count": 1, "success": 0, "failure": 1}
    assert row["tool_error_counts"]["read_file"] == 1


def test_prompt_without_reasoning_leaves_a_tombstone_and_is_not_merged(tmp_path, endpoint):
    result = run_prompts(tmp_path, endpoint, ["[[reasoning none]] no thoughts", "with thoughts"])
    assert result.returncode == 0
    rows = batch_rows(tmp_path / "data" / "run")
    tombstone = next(row for row in rows if row.get("discarded"))
    assert tombstone["discarded"] == "no_reasoning" and tombstone["prompt"] == "[[reasoning none]] no thoughts"
    merged = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    assert [human_prompt(row) for row in merged] == ["with thoughts"]
    assert json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())["discarded_no_reasoning"] == 1


def test_discard_filter_can_be_turned_off(tmp_path, endpoint):
    result = run_prompts(tmp_path, endpoint, ["[[reasoning none]] no thoughts"], "--discard_no_reasoning=False")
    assert result.returncode == 0
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 1


def test_every_reasoning_form_is_captured(tmp_path, endpoint):
    forms = ["reasoning", "reasoning_content", "reasoning_details", "think", "scratchpad"]
    result = run_prompts(tmp_path, endpoint, [f"[[reasoning {form}]] form {form}" for form in forms])
    assert result.returncode == 0
    merged = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    assert len(merged) == len(forms)
    for row in merged:
        final = row["conversations"][-1]["value"]
        assert final == "<think>\nReasoning for turn 0.\n</think>\nFinal answer.", human_prompt(row)


def test_corrupted_rows_are_filtered_from_merge_but_counted_and_reported(tmp_path, endpoint):
    result = run_prompts(tmp_path, endpoint, ["[[invent]] make things up", "fine"])
    assert result.returncode == 0
    run_dir = tmp_path / "data" / "run"
    assert [human_prompt(row) for row in read_jsonl(run_dir / "trajectories.jsonl")] == ["fine"]
    assert any("made_up_tool" in json.dumps(row) for row in batch_rows(run_dir))   # raw row kept
    statistics = json.loads((run_dir / "statistics.json").read_text())
    assert statistics["filtered_corrupted"] == 1
    assert "batch_0.jsonl" in result.stdout and "made_up_tool" in result.stdout


def test_session_inventing_tools_three_turns_in_a_row_stops_partial(tmp_path, endpoint):
    assert run_prompts(tmp_path, endpoint, ["[[invent]] keep inventing"]).returncode == 0
    [row] = batch_rows(tmp_path / "data" / "run")
    assert row["partial"] is True and row["completed"] is False
    assert row["end_reason"] == "invented_tools" and row["api_calls"] == 3
    tool_turn = row["conversations"][3]["value"]
    assert "unknown tool" in tool_turn and "terminal" in tool_turn     # names the real tools


# A model that invents 200 tools of 5,000 characters a turn: statistics.json and .merge.json held every
# name in full (megabytes for one row), as did the run's "left out" line.
def test_what_the_run_notes_of_invented_tools_is_a_few_names_cut_short(tmp_path, endpoint):
    assert run_prompts(tmp_path, endpoint, ["[[invent 200 5000]] inventing wildly"]).returncode == 0
    run_dir = tmp_path / "data" / "run"
    [entry] = json.loads((run_dir / "statistics.json").read_text())["corrupted_entries"]
    noted = entry["invented_tools"]
    assert noted[0].startswith("made_up_0_xxx") and noted[-1] == "and 195 more"
    assert len(noted) == 6 and all(len(name) < 150 for name in noted)
    assert (run_dir / "statistics.json").stat().st_size < 20_000
    assert (run_dir / ".merge.json").stat().st_size < 20_000
    [row] = batch_rows(run_dir)
    assert len(json.dumps(row)) > 3 * 200 * 5000       # the row keeps what the model wrote


def test_malformed_arguments_get_an_error_result_and_the_model_continues(tmp_path, endpoint):
    assert run_prompts(tmp_path, endpoint, ["[[bad_json]] broken arguments"]).returncode == 0
    [row] = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    assert "not valid JSON" in row["conversations"][3]["value"]
    assert row["completed"] is True and row["tool_stats"]["terminal"]["failure"] == 1


def test_burst_of_429s_is_absorbed(tmp_path, endpoint):
    prompts = [f"[[fail 429 3 retry_after=0.05]] busy {i}" for i in range(4)]
    result = run_prompts(tmp_path, endpoint, prompts)
    assert result.returncode == 0, result.stderr
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 4
    assert len(endpoint.requests) == 16


@pytest.mark.parametrize("status", [502, 503])
def test_an_outage_of_the_endpoint_holds_its_prompts_and_fails_none(tmp_path, endpoint, status):
    # Before, each prompt gave up after its retries: an endpoint down for longer than they last turned every
    # prompt the run started meanwhile into a failure row.
    # A failure while another request is in flight counts (the endpoint may be serving it): three retries
    # cover the outage's first moments; four attempts, a second apart, the outage's whole length before.
    endpoint.outage = (status, 4.0)
    result = run_prompts(tmp_path, endpoint, [f"question {i}" for i in range(6)], "--max_retries=3",
                         "--num_workers=3", distribution="minimal")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = batch_rows(tmp_path / "data" / "run")
    assert len(rows) == 6 and not any(row.get("failed") for row in rows)
    assert len(endpoint.requests) > 6 + 2      # the outage was met, by more than one prompt


def test_a_pause_the_endpoint_asks_for_is_said_in_the_log_and_retries_are_counted(tmp_path, endpoint):
    # Before, a 429's pause left the log silent: the run looked hung until its requests went again.
    result = run_prompts(tmp_path, endpoint, ["[[fail 429 1 retry_after=5]] limited"], distribution="minimal")
    assert result.returncode == 0, result.stderr
    assert "the endpoint answered 429 (too many requests): no model request goes out before" in result.stdout
    statistics = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    assert statistics["this_run"]["concurrency"]["retried_requests"] == 1


def test_non_retryable_error_fails_prompt_with_a_failure_row(tmp_path, endpoint):
    result = run_prompts(tmp_path, endpoint, ["[[fail 400 always]] rejected", "fine"])
    assert result.returncode == 2       # finished, with a failure that --resume retries
    rows = batch_rows(tmp_path / "data" / "run")
    failed = next(row for row in rows if row.get("failed"))
    assert failed["error_type"] == "http_400" and "400" in failed["error"]
    assert len(endpoint.chat_requests_for("rejected")) == 1          # not retried
    statistics = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    assert statistics["failed_prompts"] == 1 and statistics["failures_by_cause"] == {"http_400": 1}
    assert "will retry on resume" in result.stdout


def test_a_run_whose_prompts_all_end_as_rows_exits_zero_and_one_with_failures_exits_two(tmp_path, endpoint):
    assert run_prompts(tmp_path, endpoint, ["fine"], run_name="clean").returncode == 0
    failing = run_prompts(tmp_path, endpoint, ["[[fail 400 always]] rejected"], run_name="failing")
    assert failing.returncode == 2
    assert "1 prompt failed" in failing.stdout and "--resume" in failing.stdout


def test_bad_api_key_stops_the_run_with_one_clear_message_and_no_rows(tmp_path):
    from scripted_endpoint import ScriptedEndpoint
    with ScriptedEndpoint(api_key="right-key") as server:
        result = run_prompts(tmp_path, server, [f"q{i}" for i in range(8)], "--api_key=wrong-key-123456")
    assert result.returncode == 1
    assert "rejected the API key" in result.stderr and "Traceback" not in result.stderr
    assert "wrong-key-123456" not in result.stdout + result.stderr
    assert batch_rows(tmp_path / "data" / "run") == []


def test_unknown_model_stops_the_run(tmp_path):
    from scripted_endpoint import ScriptedEndpoint
    with ScriptedEndpoint(models={"real-model"}) as server:
        result = run_prompts(tmp_path, server, ["q"])
    assert result.returncode == 1 and "scripted-model" in result.stderr and "--model" in result.stderr


def test_ephemeral_prompt_and_prefill_reach_the_model_but_not_the_trajectory(tmp_path, endpoint):
    prefill = tmp_path / "prefill.json"
    prefill.write_text(json.dumps([{"role": "user", "content": "EXAMPLE-Q"},
                                   {"role": "assistant", "content": "EXAMPLE-A"}]))
    result = run_prompts(tmp_path, endpoint, ["the real question"], "--ephemeral_system_prompt=SECRET-STYLE",
                         f"--prefill_messages_file={prefill}")
    assert result.returncode == 0
    [request] = endpoint.requests
    assert "SECRET-STYLE" in request["messages"][0]["content"]
    assert [m["content"] for m in request["messages"][1:3]] == ["EXAMPLE-Q", "EXAMPLE-A"]
    text = (tmp_path / "data" / "run" / "trajectories.jsonl").read_text()
    assert "SECRET-STYLE" not in text and "EXAMPLE-Q" not in text


def test_provider_and_reasoning_flags_reach_the_request_body(tmp_path, endpoint):
    result = run_prompts(tmp_path, endpoint, ["q"], "--providers_allowed=a,b", "--providers_order=b",
                         "--provider_sort=price", "--reasoning_effort=high", "--max_tokens=50")
    assert result.returncode == 0, result.stderr
    [request] = endpoint.requests
    assert request["provider"] == {"only": ["a", "b"], "order": ["b"], "sort": "price"}
    assert request["reasoning"] == {"effort": "high"} and request["max_tokens"] == 50


@pytest.mark.bubblewrap
def test_default_environment_is_the_bubblewrap_sandbox_when_it_works(tmp_path, endpoint):
    result = run_prompts(tmp_path, endpoint, ['[[call terminal {"command": "pwd; touch made-here"}]] where am i'])
    assert result.returncode == 0, result.stderr
    assert "environment bubblewrap (isolated sandbox, " in result.stdout and "limits per prompt:" in result.stdout
    [row] = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    assert '"output": "/workspace\\n"' in row["conversations"][3]["value"]
    assert not (tmp_path / "made-here").exists()


def test_secrets_never_reach_tools_or_outputs(tmp_path, endpoint):
    secret = "sk-test-SECRET-value-987654321"
    result = run_prompts(tmp_path, endpoint, ['[[call terminal {"command": "env; echo $OPENAI_API_KEY"}]] show env'],
                         env={"OPENAI_API_KEY": secret, "GITHUB_TOKEN": "ghp_anothersecret123"})
    assert result.returncode == 0
    everything = "".join(p.read_text() for p in (tmp_path / "data" / "run").iterdir() if p.is_file())
    assert secret not in everything and "ghp_anothersecret123" not in everything
    assert secret not in result.stdout + result.stderr
    assert "HOME=" in everything     # the command did run and print its environment


def test_local_environment_runs_commands_in_a_fresh_directory_not_the_users(tmp_path, endpoint):
    result = run_prompts(tmp_path, endpoint, ['[[call terminal {"command": "pwd; touch made-here"}]] where am i'],
                         env={"TERMINAL_ENV": "local"})
    assert result.returncode == 0
    assert not (tmp_path / "made-here").exists()
    [row] = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    assert str(tmp_path / "tmp" / f"batch_runner-{os.geteuid()}" / "run") in row["conversations"][3]["value"]
    assert list((tmp_path / "tmp" / f"batch_runner-{os.geteuid()}").glob("run/*")) == []      # removed afterwards


@pytest.mark.parametrize("terminal_env", ["local", pytest.param("bubblewrap", marks=pytest.mark.bubblewrap)])
def test_a_command_can_interrupt_what_it_started(tmp_path, endpoint, terminal_env):
    # Ctrl-C must not stop the workers, but the programs a command starts get SIGINT as on any
    # shell: an ignored SIGINT would stay ignored in every one of them. A program that sends itself
    # SIGINT dies of it (status 130) before its next line. It runs in the foreground: bash starts
    # background jobs (`&`) with SIGINT ignored whatever it inherited.
    prompt = ('[[call terminal {"command": "sh -c \'kill -INT $$; echo survived\'; echo status=$?"}]] '
              'interrupt it')
    result = run_prompts(tmp_path, endpoint, [prompt], env={"TERMINAL_ENV": terminal_env})
    assert result.returncode == 0, result.stdout + result.stderr
    [row] = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    output = row["conversations"][3]["value"]
    assert "status=130" in output and "survived" not in output


def test_verbose_shows_a_failed_tool_call_as_failed(tmp_path, endpoint):
    prompt = '[[call read_file {"path": "missing.txt"}]] [[call terminal {"command": "true"}]] read it'
    result = run_prompts(tmp_path, endpoint, [prompt], "--verbose")
    assert result.returncode == 0, result.stderr
    assert "tools used: terminal×1, read_file×1 (1 failed)" in " ".join(result.stdout.split())


def test_verbose_shows_toolsets_tools_and_tokens_per_prompt(tmp_path, endpoint):
    result = run_prompts(tmp_path, endpoint, [TOOL_PROMPT], "--verbose")
    assert result.returncode == 0, result.stderr
    assert "toolsets terminal, file · tools used: terminal×1, write_file×1" in result.stdout
    assert "tokens 300+60" in result.stdout


# The command's text differs from its output: the prompt preview shows the one, only a call's line the other.
SPELLING_PROMPT = '[[call terminal {"command": "printf %s%s hidden- result"}]] spell it'


def test_verbose_shows_each_tool_call_and_the_start_of_its_result(tmp_path, endpoint):
    # As the reference runner logs them: the call and what it returned, --log_prefix_chars of each.
    result = run_prompts(tmp_path, endpoint, [SPELLING_PROMPT], "--verbose", "--log_prefix_chars=200")
    assert result.returncode == 0, result.stderr
    said = " ".join(result.stdout.split())
    assert 'terminal {"command": "printf %s%s hidden- result"} → {"output": "hidden-result"' in said


def test_verbose_cuts_a_tool_call_and_its_result_at_log_prefix_chars(tmp_path, endpoint):
    result = run_prompts(tmp_path, endpoint, [SPELLING_PROMPT], "--verbose", "--log_prefix_chars=8")
    assert result.returncode == 0, result.stderr
    said = " ".join(result.stdout.split())
    assert 'terminal {"comman… → {"output…' in said and "hidden-result" not in said


def test_without_verbose_no_tool_call_is_shown(tmp_path, endpoint):
    result = run_prompts(tmp_path, endpoint, [SPELLING_PROMPT])
    assert result.returncode == 0, result.stderr
    assert "hidden-result" not in result.stdout


def test_each_call_sends_the_whole_conversation_so_far_with_the_offered_tools(tmp_path, endpoint):
    prompt = '[[call terminal {"command": "echo one"}]] [[call terminal {"command": "echo two"}]] go'
    assert run_prompts(tmp_path, endpoint, [prompt]).returncode == 0
    requests = endpoint.requests
    assert [len(r["messages"]) for r in requests] == [2, 4, 6]
    for earlier, later in itertools.pairwise(requests):
        assert later["messages"][:len(earlier["messages"])] == earlier["messages"]
        assert later["tools"] == earlier["tools"] and later["model"] == "scripted-model"
    assert "one" in requests[1]["messages"][-1]["content"] and "two" in requests[2]["messages"][-1]["content"]


def test_a_run_whose_every_row_was_discarded_names_the_flag_that_keeps_them(tmp_path, endpoint):
    result = run_prompts(tmp_path, endpoint, ["[[reasoning none]] no thoughts", "[[reasoning none]] none either"])
    assert result.returncode == 0, result.stderr
    said = " ".join(result.stdout.split())
    assert "Every row of this run was discarded: no assistant turn had reasoning" in said
    assert "--discard_no_reasoning=False keeps such rows" in said
    assert "--export=sharegpt --run_name=run --discard_no_reasoning=False exports them" in said


def test_a_run_with_a_kept_row_does_not_speak_of_every_row_discarded(tmp_path, endpoint):
    result = run_prompts(tmp_path, endpoint, ["[[reasoning none]] no thoughts", "with thoughts"])
    assert result.returncode == 0, result.stderr
    assert "Every row of this run was discarded" not in " ".join(result.stdout.split())


def test_a_bug_in_the_scheduling_loop_shows_its_traceback_rather_than_a_resume_hint(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["question"])
    bug = ("import sys, batch_runner\n"
           "def broken(self):\n"
           "    raise RuntimeError('a bug in the loop')\n"
           "batch_runner.BatchRunner._publish_progress = broken\n"
           "sys.argv = ['batch_runner.py', *sys.argv[1:]]\n"
           "batch_runner.cli()\n")
    result = subprocess.run([sys.executable, "-c", bug, f"--dataset_file={dataset}", "--batch_size=1",
                             "--run_name=run", *endpoint_args(endpoint)], cwd=tmp_path, env=cli_environment(tmp_path),
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "RuntimeError: a bug in the loop" in result.stderr
    assert "continue with --resume" not in result.stderr


def test_a_dataset_rewritten_during_the_run_stops_it_and_no_row_holds_a_prompt_not_planned(tmp_path, endpoint):
    # Lines of about 1 KB: the reader's buffer holds several, so a rewrite lands amid buffered old bytes.
    prompts = [f"task {number:02d} " + f"<{number:02d}>" * 250 for number in range(40)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    second_version = write_dataset(tmp_path / "v2.jsonl", ["a new first task", *prompts])

    def rewrite_at_the_fourth_prompt(body: dict) -> None:
        if last_user_message(body) == prompts[3] and not rewritten:
            rewritten.append(True)
            shutil.copyfile(second_version, dataset)      # as cp does: the same file, truncated and rewritten
        return None

    rewritten: list[bool] = []
    endpoint.script = rewrite_at_the_fourth_prompt
    args = (f"--dataset_file={dataset}", "--batch_size=4", "--num_workers=2", "--run_name=run",
            "--distribution=terminal_only", *endpoint_args(endpoint))
    result = run_cli(tmp_path, *args)
    assert rewritten and result.returncode == 1, result.stdout[-2000:] + result.stderr
    said = " ".join(result.stderr.split())
    assert f"{dataset} changed while the run read it" in said and "--resume" in said, said
    assert "BATCH PROCESSING COMPLETE" not in result.stdout
    written = batch_rows(tmp_path / "data" / "run")
    assert 4 <= len(written) < 40
    assert all(human_prompt(row) == prompts[row["prompt_index"]] for row in written)

    result = run_cli(tmp_path, *args, "--resume")      # the dataset is stable now: the rest runs
    assert result.returncode == 0, result.stderr
    merged = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    assert Counter(human_prompt(row) for row in merged) == Counter(["a new first task", *prompts])


def test_a_small_dataset_with_a_line_rewritten_in_place_during_the_run_stops_it(tmp_path, endpoint):
    # The whole file (~150 bytes) fits in one read of a buffered reader: a line must still be read from the
    # file when its prompt starts, not from bytes read for an earlier prompt before the rewrite.
    prompts = [f"task {number}" for number in range(10)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    edited = [*prompts[:6], "task 6 edited", *prompts[7:]]
    second_version = write_dataset(tmp_path / "v2.jsonl", edited)

    def rewrite_at_the_first_prompt(body: dict) -> None:
        if last_user_message(body) == prompts[0] and not rewritten:
            rewritten.append(True)
            shutil.copyfile(second_version, dataset)      # the same file, truncated and rewritten; lines 0-5 stay
        return None

    rewritten: list[bool] = []
    endpoint.script = rewrite_at_the_first_prompt
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=2", "--num_workers=1", "--run_name=run",
                     "--distribution=terminal_only", *endpoint_args(endpoint))
    assert rewritten and result.returncode == 1, result.stdout[-2000:] + result.stderr
    said = " ".join(result.stderr.split())
    assert f"{dataset} changed while the run read it: the line of prompt 6" in said, said
    written = batch_rows(tmp_path / "data" / "run")
    assert sorted(human_prompt(row) for row in written) == prompts[:6]


def test_a_work_directory_of_another_user_stops_the_run_before_any_prompt(tmp_path, endpoint):
    # Every sandbox's root and directory are made under $TMPDIR/batch_runner-<uid>: before, a local user who made
    # it first (its name is known ahead) owned the / and /etc of every sandbox, and could poison every prompt.
    if os.geteuid() != 0:
        pytest.skip("only root can give a directory to another user")
    shared = tmp_path / "tmp" / f"batch_runner-{os.geteuid()}"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    os.chown(shared, 65534, 65534)
    result = run_prompts(tmp_path, endpoint, ['[[call terminal {"command": "cat /etc/hosts"}]] q'])
    assert result.returncode == 1
    assert f"{shared} is uid 65534's" in result.stderr, result.stderr
    assert "Remove it, or set TMPDIR to a directory of your own" in result.stderr
    assert endpoint.requests == [] and "Traceback" not in result.stderr


def test_another_users_work_directories_in_a_shared_temporary_directory_are_no_obstacle(tmp_path, endpoint):
    # Before, all users shared $TMPDIR/batch_runner: once root had run (CI, a container), every other user's
    # run on the machine was refused as that directory was not theirs.
    if os.geteuid() != 0:
        pytest.skip("only root can give a directory to another user")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    temporary.chmod(0o1777)
    for name in ("batch_runner", "batch_runner-65534"):
        (temporary / name).mkdir(0o755)
        os.chown(temporary / name, 65534, 65534)
    result = run_prompts(tmp_path, endpoint, ['[[call terminal {"command": "true"}]] q'])
    assert result.returncode == 0, result.stderr
    assert (temporary / f"batch_runner-{os.geteuid()}").stat().st_uid == os.geteuid()


def test_a_temporary_directory_any_user_may_rename_in_stops_the_run_before_any_prompt(tmp_path, endpoint):
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp").chmod(0o777)       # not sticky, as /tmp is: anyone could replace batch_runner in it
    result = run_prompts(tmp_path, endpoint, ["q"])
    assert result.returncode == 1
    assert "is open to other users" in result.stderr and "not sticky" in result.stderr, result.stderr
    assert endpoint.requests == []


def test_the_work_directories_are_the_runners_alone_whatever_the_umask(tmp_path, endpoint):
    # Before, they took their mode from the umask: under 0 (some daemons, containers) writable by every user
    # from the first sandbox on; under 002 (ordinary users' default) the next run refused its own directory.
    own = tmp_path / "tmp" / f"batch_runner-{os.geteuid()}"
    own.mkdir(parents=True)
    own.chmod(0o775)         # as an earlier version made it under umask 002
    command = f"stat -c '%a %n' {own} {own}/*/"
    result = run_prompts(tmp_path, endpoint, [f"[[call terminal {json.dumps({'command': command})}]] q"],
                         env={"TERMINAL_ENV": "local"}, prefix=("sh", "-c", 'umask 0 && exec "$@"', "sh"))
    assert result.returncode == 0, result.stderr
    [row] = batch_rows(tmp_path / "data" / "run")
    [result_text] = [turn["value"] for turn in row["conversations"] if turn["from"] == "tool"]
    assert re.findall(r"(\d+) /\S*/batch_runner-\d+", result_text) == ["755", "755"], result_text


def test_a_link_to_nowhere_in_place_of_the_work_directory_is_one_message(tmp_path, endpoint):
    # Before the second review, the link was followed unchecked: a FileNotFoundError traceback.
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp" / f"batch_runner-{os.geteuid()}").symlink_to(tmp_path / "nowhere")
    result = run_prompts(tmp_path, endpoint, ["q"])
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"batch_runner-{os.geteuid()}: No such file or directory. Remove it, or set TMPDIR" in result.stderr, \
        result.stderr
    assert endpoint.requests == []
