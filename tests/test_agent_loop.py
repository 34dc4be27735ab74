"""The agent loop as the rows show it, through the real CLI against the scripted endpoint: empty
answers asked for again, cut-off answers continued, a context overflow keeping the paid-for turns,
the summary at --max_turns, reasoning sent back as received, and the one rule for invented tools."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from conftest import batch_rows, endpoint_args, read_jsonl, run_cli, write_dataset
from scripted_endpoint import FILTERED_TEXT, OVERFLOW_ERRORS

from batchrun.session import CONTINUE_REQUEST, MAX_CONTINUATIONS, MAX_EMPTY_RETRIES, SUMMARY_REQUEST
from model_tools import TOOLSETS

TERMINAL_CALL = '[[call terminal {"command": "echo hi"}]]'


def run(tmp_path, endpoint, prompts, *extra, distribution="terminal_only", run_name="run"):
    dataset = write_dataset(tmp_path / f"{run_name}.jsonl", prompts)
    return run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=5", f"--run_name={run_name}",
                   f"--distribution={distribution}",
                   *endpoint_args(endpoint), *extra)


def only_row(tmp_path, run_name="run") -> dict:
    [row] = batch_rows(tmp_path / "data" / run_name)
    return row


def dialogue(row: dict) -> list[tuple[str, str]]:
    """(speaker, text) of the turns after the system turn and the prompt."""
    return [(turn["from"], turn["value"]) for turn in row["conversations"][2:]]


# --- empty answers --------------------------------------------------------------------------------

def test_an_empty_final_answer_is_asked_for_again_and_only_the_real_answer_is_kept(tmp_path, endpoint):
    assert run(tmp_path, endpoint, ["[[empty 2]] answer me"]).returncode == 0
    row = only_row(tmp_path)
    assert (row["completed"], row["end_reason"], row["api_calls"]) == (True, "final_answer", 3)
    assert dialogue(row) == [("gpt", "<think>\nReasoning for turn 0.\n</think>\nFinal answer.")]


def test_an_answer_holding_only_a_think_block_counts_as_empty(tmp_path, endpoint):
    assert run(tmp_path, endpoint, ["[[empty 1 think]] answer me"]).returncode == 0
    row = only_row(tmp_path)
    assert (row["completed"], row["api_calls"]) == (True, 2)
    assert dialogue(row)[-1][1].endswith("\nFinal answer.")


def test_an_answer_that_stays_empty_ends_the_row_partial_with_empty_answer(tmp_path, endpoint):
    assert run(tmp_path, endpoint, [f"{TERMINAL_CALL} [[empty always]] answer me"]).returncode == 0
    row = only_row(tmp_path)
    assert (row["completed"], row["partial"], row["end_reason"]) == (False, True, "empty_answer")
    assert row["api_calls"] == 2 + MAX_EMPTY_RETRIES
    assert [speaker for speaker, _ in dialogue(row)] == ["gpt", "tool"]      # no empty gpt turn is kept


@pytest.mark.parametrize("filter_flag", [(), ("--discard_no_reasoning=False",)], ids=["filter_on", "filter_off"])
@pytest.mark.parametrize("empty", ["[[empty always]]", "[[empty always think]]"], ids=["empty", "think_only"])
def test_a_model_that_never_gives_a_usable_reply_leaves_a_failure_row_resume_runs_again(tmp_path, endpoint,
                                                                                      empty, filter_flag):
    result = run(tmp_path, endpoint, [f"{empty} answer me"], *filter_flag)
    assert result.returncode == 2, result.stdout            # some prompts failed: resume retries them
    row = only_row(tmp_path)
    assert (row.get("failed"), row["error_type"], row["api_calls"]) == (True, "empty_answer", 1 + MAX_EMPTY_RETRIES)
    assert "discarded" not in row and "conversations" not in row
    assert (tmp_path / "data" / "run" / "trajectories.jsonl").read_bytes() == b""
    endpoint.reset()
    run(tmp_path, endpoint, [f"{empty} answer me"], "--resume", *filter_flag)
    assert len(endpoint.requests) == 1 + MAX_EMPTY_RETRIES


# --- answers cut off by the output limit ----------------------------------------------------------------

def test_a_cut_off_answer_is_asked_to_continue_and_every_piece_is_kept(tmp_path, endpoint):
    assert run(tmp_path, endpoint, ["[[length 2]] a long answer"]).returncode == 0
    row = only_row(tmp_path)
    assert (row["completed"], row["end_reason"], row["api_calls"]) == (True, "final_answer", 3)
    assert dialogue(row) == [
        ("gpt", "<think>\nReasoning for turn 0.\n</think>\nPart 1 of the answer."), ("human", CONTINUE_REQUEST),
        ("gpt", "<think>\nReasoning for turn 1.\n</think>\nPart 2 of the answer."), ("human", CONTINUE_REQUEST),
        ("gpt", "<think>\nReasoning for turn 2.\n</think>\nFinal answer.")]


def test_the_request_to_continue_reaches_the_model_as_a_user_message_after_the_cut_piece(tmp_path, endpoint):
    assert run(tmp_path, endpoint, ["[[length 1]] a long answer"]).returncode == 0
    second = endpoint.requests[1]["messages"]
    assert [m["role"] for m in second[-2:]] == ["assistant", "user"]
    assert second[-2]["content"] == "Part 1 of the answer." and second[-1]["content"] == CONTINUE_REQUEST


# --- a content filter ------------------------------------------------------------------------------

def test_an_answer_a_content_filter_stopped_ends_the_row_partial_without_it(tmp_path, endpoint):
    # Before, the filter's cut-off text was kept as the model's final answer, in a completed row.
    assert run(tmp_path, endpoint, [f"{TERMINAL_CALL} [[filtered]] answer me"]).returncode == 0
    row = only_row(tmp_path)
    assert (row["completed"], row["partial"], row["end_reason"], row["api_calls"]) == (False, True, "content_filter", 2)
    assert [speaker for speaker, _ in dialogue(row)] == ["gpt", "tool"]
    assert FILTERED_TEXT not in json.dumps(row)


def test_a_first_reply_a_content_filter_stopped_fails_the_prompt_for_resume(tmp_path, endpoint):
    assert run(tmp_path, endpoint, ["[[filtered]] answer me"]).returncode == 2
    row = only_row(tmp_path)
    assert (row["failed"], row["error_type"]) == (True, "content_filter")
    assert "content filter" in row["error"]


def test_an_answer_still_cut_off_after_three_requests_to_continue_ends_truncated(tmp_path, endpoint):
    assert run(tmp_path, endpoint, ["[[length always]] an endless answer"]).returncode == 0
    row = only_row(tmp_path)
    assert (row["partial"], row["end_reason"], row["api_calls"]) == (True, "truncated", MAX_CONTINUATIONS + 1)
    speakers = [speaker for speaker, _ in dialogue(row)]
    assert speakers.count("gpt") == MAX_CONTINUATIONS + 1 and speakers[-1] == "gpt"


# --- a conversation that outgrows the context --------------------------------------------------------------

@pytest.mark.parametrize("server", OVERFLOW_ERRORS)
def test_a_context_overflow_keeps_the_paid_for_turns_as_a_partial_row(tmp_path, endpoint, server):
    assert run(tmp_path, endpoint, [f"{TERMINAL_CALL} {TERMINAL_CALL} [[overflow 1 {server}]] grow"]).returncode == 0
    row = only_row(tmp_path)
    assert (row["partial"], row["end_reason"]) == (True, "context_length")
    assert [speaker for speaker, _ in dialogue(row)] == ["gpt", "tool"]
    assert row["tool_stats"]["terminal"]["count"] == 1


def test_a_context_overflow_row_counts_as_done_on_resume(tmp_path, endpoint):
    prompts = [f"{TERMINAL_CALL} [[overflow 1]] grow"]
    assert run(tmp_path, endpoint, prompts).returncode == 0
    endpoint.reset()
    resumed = run(tmp_path, endpoint, prompts, "--resume")
    assert "All prompts have already been processed!" in resumed.stdout
    assert endpoint.requests == []


def test_a_prompt_too_long_for_the_context_by_itself_fails_saying_so(tmp_path, endpoint):
    result = run(tmp_path, endpoint, ["[[overflow 0]] far too long"])
    row = only_row(tmp_path)
    assert (row["failed"], row["error_type"]) == (True, "context_length")
    assert "no longer fits the model's context" in row["error"]
    assert result.returncode == 2


# --- --max_turns -------------------------------------------------------------------------------------------

def test_at_max_turns_one_call_without_tools_asks_for_a_summary_that_ends_the_row(tmp_path, endpoint):
    calls = " ".join([TERMINAL_CALL] * 5)
    assert run(tmp_path, endpoint, [f"{calls} [[final What I found.]] keep going"], "--max_turns=2").returncode == 0
    row = only_row(tmp_path)
    assert (row["completed"], row["partial"], row["end_reason"], row["api_calls"]) == (False, True, "max_turns", 3)
    assert [speaker for speaker, _ in dialogue(row)] == ["gpt", "tool", "gpt", "tool", "human", "gpt"]
    assert dialogue(row)[-2:] == [("human", SUMMARY_REQUEST),
                                  ("gpt", "<think>\nReasoning for turn 2.\n</think>\nWhat I found.")]
    assert ["tools" in request for request in endpoint.requests] == [True, True, False]


def test_a_summary_the_endpoint_refuses_leaves_the_row_ending_on_its_last_tool_turn(tmp_path, endpoint):
    calls = " ".join([TERMINAL_CALL] * 5)
    assert run(tmp_path, endpoint, [f"{calls} [[overflow 2]] keep going"], "--max_turns=2").returncode == 0
    row = only_row(tmp_path)
    assert (row["end_reason"], row["partial"]) == ("max_turns", True)
    assert [speaker for speaker, _ in dialogue(row)] == ["gpt", "tool", "gpt", "tool"]


# The request offered no tool; the row showed the reply's text alone, as if the model had answered
# without calling any, and a call to a tool never offered was no invented call.
def test_a_summary_that_also_calls_tools_is_not_kept(tmp_path, endpoint):
    def calls_even_when_summing_up(body: dict) -> tuple[int, dict, dict]:
        call = {"id": f"c{len(body['messages'])}", "type": "function",
                "function": {"name": "terminal", "arguments": '{"command": "echo hi"}'}}
        content = "Summary text." if "tools" not in body else ""
        message = {"role": "assistant", "content": content, "tool_calls": [call]}
        return 200, {"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]}, {}

    endpoint.script = calls_even_when_summing_up
    assert run(tmp_path, endpoint, ["keep going"], "--max_turns=2").returncode == 0
    row = only_row(tmp_path)
    assert (row["end_reason"], row["partial"], row["api_calls"]) == ("max_turns", True, 3)
    assert [speaker for speaker, _ in dialogue(row)] == ["gpt", "tool", "gpt", "tool"]


# A refusal in the field OpenAI gives it (content null) was an empty answer, asked for three times more
# and then a failure row that said the model gave no text; one as a content part was a malformed reply.
@pytest.mark.parametrize("message", [{"role": "assistant", "content": None, "refusal": "I can't help with that."},
                                     {"role": "assistant", "content": [{"type": "refusal",
                                                                        "refusal": "I can't help with that."}]}],
                         ids=["field", "content-part"])
def test_a_refusal_is_the_models_answer(tmp_path, endpoint, message):
    endpoint.script = lambda body: (200, {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}, {})
    assert run(tmp_path, endpoint, ["do something bad"]).returncode == 0
    row = only_row(tmp_path)
    assert (row["completed"], row["end_reason"], row["api_calls"]) == (True, "final_answer", 1)
    assert dialogue(row)[-1] == ("gpt", "<think>\n</think>\nI can't help with that.")


# --- reasoning goes back to the endpoint as it came ------------------------------------------------------------

@pytest.mark.parametrize("form", ["reasoning", "reasoning_content", "reasoning_details"])
def test_reasoning_is_sent_back_exactly_as_the_endpoint_returned_it(tmp_path, endpoint, form):
    prompt = f"[[reasoning_back]] [[reasoning {form}]] {TERMINAL_CALL} {TERMINAL_CALL} think aloud"
    assert run(tmp_path, endpoint, [prompt]).returncode == 0
    row = only_row(tmp_path)
    assert (row.get("failed"), row["end_reason"]) == (None, "final_answer")
    assert form in endpoint.requests[-1]["messages"][-2] or form in endpoint.requests[-1]["messages"][-4]


def test_a_tool_call_goes_back_with_every_field_the_endpoint_gave_it(tmp_path, endpoint):
    assert run(tmp_path, endpoint, [f"{TERMINAL_CALL} call once"]).returncode == 0
    [echoed] = endpoint.requests[1]["messages"][-2]["tool_calls"]
    assert echoed == {"id": "call_0_0", "type": "function",
                      "function": {"name": "terminal", "arguments": '{"command": "echo hi"}'}}


def calls_once_with_id(call_id: object) -> Callable[[dict], tuple[int, dict, dict]]:
    """An endpoint's script: one terminal call whose id is ``call_id``, then, once its result is in, the answer."""
    def script(body: dict) -> tuple[int, dict, dict]:
        if body["messages"][-1]["role"] == "tool":
            message = {"role": "assistant", "content": "Done."}
        else:
            message = {"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "terminal", "arguments": '{"command": "echo hi"}'}}]}
        return 200, {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}, {}
    return script


def test_a_tool_call_id_that_is_not_text_is_replaced_by_one_of_the_runners(tmp_path, endpoint):
    # Before, {"x": [1, 2]} went into the row and back to the endpoint as the text "{'x': [1, 2]}".
    endpoint.script = calls_once_with_id({"x": [1, 2]})
    assert run(tmp_path, endpoint, ["call once"]).returncode == 0
    [echoed] = endpoint.requests[1]["messages"][-2]["tool_calls"]
    assert echoed["id"] == "call_0_0" and endpoint.requests[1]["messages"][-1]["tool_call_id"] == "call_0_0"
    assert "{'x'" not in json.dumps(only_row(tmp_path))


def test_a_tool_call_id_longer_than_any_endpoints_is_replaced_by_one_of_the_runners(tmp_path, endpoint):
    # Before, a megabyte of id went into the row (and every request after it), whole.
    endpoint.script = calls_once_with_id("c" * 1_000_000)
    assert run(tmp_path, endpoint, ["call once"]).returncode == 0
    [echoed] = endpoint.requests[1]["messages"][-2]["tool_calls"]
    assert echoed["id"] == "call_0_0" and endpoint.requests[1]["messages"][-1]["tool_call_id"] == "call_0_0"
    assert "c" * 1000 not in json.dumps(only_row(tmp_path))


def tool_results(row: dict) -> list[dict]:
    """The content of each tool response of the row."""
    return [json.loads(value.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>"))["content"]
            for speaker, value in dialogue(row) if speaker == "tool"]


@pytest.mark.parametrize("call", ['[[call terminal {"command": "echo \\ud800"}]]',
                                  '[[call search_files {"pattern": "\\udfff"}]]'], ids=["terminal", "search_files"])
def test_an_argument_holding_a_lone_surrogate_is_refused_as_not_text(tmp_path, endpoint, call):
    # Before: "terminal failed: UnicodeEncodeError: ... surrogates not allowed", from the catch-all for tool bugs.
    assert run(tmp_path, endpoint, [f"{call} odd text"], distribution="default").returncode == 0
    [result] = tool_results(only_row(tmp_path))
    assert "lone surrogate" in result["error"] and "UnicodeEncodeError" not in result["error"]


@pytest.mark.parametrize("environment", ["local", "bubblewrap"])
@pytest.mark.parametrize(("call", "argument"), [('[[call terminal {"command": "echo a\\u0000b"}]]', "command"),
                                                ('[[call search_files {"pattern": "a\\u0000b"}]]', "pattern")],
                         ids=["terminal", "search_files"])
def test_a_nul_byte_bound_for_the_shell_is_refused_alike_in_every_environment(tmp_path, endpoint, environment,
                                                                              call, argument):
    # Before, local said "terminal failed: ValueError: embedded null byte", and a search under bubblewrap
    # "grep failed: exit status None".
    dataset = write_dataset(tmp_path / "run.jsonl", [f"{call} nul"])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=5", "--run_name=run",
                     "--distribution=default", *endpoint_args(endpoint), env={"TERMINAL_ENV": environment})
    assert result.returncode == 0, result.stderr
    [outcome] = tool_results(only_row(tmp_path))
    assert outcome["error"] == f"'{argument}' cannot contain a NUL byte"


# --- invented tools: one rule ----------------------------------------------------------------------------------

def test_a_registry_tool_the_prompt_was_not_offered_is_an_invented_call(tmp_path, endpoint):
    result = run(tmp_path, endpoint, ['[[call web_search {"query": "x"}]] search anyway', "plain question"])
    assert result.returncode == 0
    row = next(row for row in batch_rows(tmp_path / "data" / "run") if row["prompt_index"] == 0)
    assert row["invented_tool_calls"] == 1 and row["tool_stats"]["web_search"]["count"] == 0
    tool_turn = next(value for speaker, value in dialogue(row) if speaker == "tool")
    assert "unknown tool 'web_search'" in tool_turn
    merged = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    assert [row["prompt_index"] for row in merged] == [1]
    statistics = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    assert statistics["filtered_corrupted"] == 1
    assert statistics["tool_statistics"]["web_search"]["count"] == 0


def test_a_prompt_that_invents_tools_again_after_a_rerun_is_counted_once(tmp_path, endpoint):
    prompts = ["[[invent]] make things up", "plain question"]
    assert run(tmp_path, endpoint, prompts).returncode == 0
    for _ in range(2):
        assert run(tmp_path, endpoint, prompts, "--resume", "--rerun_corrupted").returncode == 0
    statistics = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    assert statistics["filtered_corrupted"] == 1
    assert len(statistics["corrupted_entries"]) == 1
    resumed = run(tmp_path, endpoint, prompts, "--resume")
    assert "All prompts have already been processed!" in resumed.stdout


def test_reasoning_coverage_counts_the_turns_of_corrupted_rows_but_not_of_replaced_ones(tmp_path, endpoint):
    # Coverage is over every assistant turn of the run; a corrupted row's turns were left out of it.
    prompts = ["[[invent]] make things up", "plain question"]
    assert run(tmp_path, endpoint, prompts, "--max_turns=2").returncode == 0
    assert run(tmp_path, endpoint, prompts, "--max_turns=2", "--resume", "--rerun_corrupted").returncode == 0
    statistics = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    assert statistics["filtered_corrupted"] == 1
    # The plain answer's one turn, and the latest attempt's three (the made-up calls of 2 turns, and the
    # summary asked for at --max_turns), each with reasoning; the replaced attempt's not at all.
    assert statistics["reasoning_statistics"]["turns_with_reasoning"] == 4


def test_the_row_a_rerun_invents_tools_in_again_is_named_as_left_out(tmp_path, endpoint):
    prompts = ["[[invent]] make things up"]
    first = run(tmp_path, endpoint, prompts)
    assert first.stdout.count("left out of trajectories.jsonl") == 1
    rerun = run(tmp_path, endpoint, prompts, "--resume", "--rerun_corrupted")
    assert rerun.stdout.count("left out of trajectories.jsonl") == 1, rerun.stdout


def test_a_rerun_that_fails_leaves_its_prompt_to_the_next_resume(tmp_path, endpoint):
    assert run(tmp_path, endpoint, ["[[invent]] make things up"]).returncode == 0
    endpoint.script = lambda body: (500, {"error": {"message": "down"}}, {})
    assert run(tmp_path, endpoint, ["[[invent]] make things up"], "--resume", "--rerun_corrupted",
               "--max_retries=0").returncode == 2
    endpoint.script = None
    endpoint.reset()
    assert run(tmp_path, endpoint, ["[[invent]] make things up"], "--resume").returncode == 0
    assert len(endpoint.requests) > 0            # the replaced corrupted row no longer counts as done


# --- the one schema across runs ----------------------------------------------------------------------------------

def test_two_different_runs_load_together_with_hugging_face_datasets(tmp_path, endpoint):
    datasets = pytest.importorskip("datasets")
    assert run(tmp_path, endpoint, ["plain answer"], run_name="quiet").returncode == 0
    assert run(tmp_path, endpoint, [f"{TERMINAL_CALL} [[calls [{{\"name\": \"terminal\", \"arguments\": "
                                    f"{{\"command\": \"ls\"}}}}, {{\"name\": \"read_file\", \"arguments\": "
                                    f"{{\"path\": \"x\"}}}}]]] busy", "[[length 1]] long"],
               run_name="busy").returncode == 0
    files = [str(tmp_path / "data" / name / "trajectories.jsonl") for name in ("quiet", "busy")]
    loaded = datasets.load_dataset("json", data_files=files, split="train", cache_dir=str(tmp_path / "hf"))
    assert loaded.num_rows == 3
    assert all(set(turn) == {"from", "value"} for row in loaded for turn in row["conversations"])


def test_an_empty_merged_file_loads_beside_a_full_one(tmp_path, endpoint):
    datasets = pytest.importorskip("datasets")
    assert run(tmp_path, endpoint, ["plain answer"], run_name="full").returncode == 0
    assert run(tmp_path, endpoint, ["[[reasoning none]] no thoughts"], run_name="empty").returncode == 0
    empty = tmp_path / "data" / "empty" / "trajectories.jsonl"
    assert empty.read_bytes() == b""
    files = [str(tmp_path / "data" / name / "trajectories.jsonl") for name in ("full", "empty")]
    assert datasets.load_dataset("json", data_files=files, split="train", cache_dir=str(tmp_path / "hf")).num_rows == 1


# --- what the run announces ---------------------------------------------------------------------------------------

def test_a_run_never_starts_more_sessions_than_it_has_prompts(tmp_path, endpoint):
    result = run(tmp_path, endpoint, ["only one"], "--num_workers=4")
    assert result.returncode == 0
    assert "1 concurrent sessions in 1 worker process" in result.stdout


def test_prompts_naming_an_image_the_sandbox_does_not_use_are_announced_once(tmp_path, endpoint):
    result = run(tmp_path, endpoint, [{"prompt": "a", "image": "python:3.11"}, {"prompt": "b", "image": "node:20"}])
    assert result.returncode == 0
    assert result.stderr.count("name a container image") == 1
    assert "2 prompts name a container image" in result.stderr


@pytest.mark.parametrize("effort", ["max", "ultra"])
def test_reasoning_efforts_the_reference_accepts_are_passed_through(tmp_path, endpoint, effort):
    assert run(tmp_path, endpoint, ["think hard"], f"--reasoning_effort={effort}").returncode == 0
    assert endpoint.requests[0]["reasoning"] == {"effort": effort}


def test_toolsets_used_lists_only_toolsets_whose_tools_the_model_was_offered(tmp_path, endpoint):
    assert run(tmp_path, endpoint, [f"question {i}" for i in range(6)], "--seed=3", distribution="default").returncode == 0
    for row in batch_rows(tmp_path / "data" / "run"):
        offered = {tool["name"] for tool in json.loads(
            row["conversations"][0]["value"].split("<tools>\n")[1].split("\n</tools>")[0])}
        assert set(row["toolsets_used"]) <= set(row["toolsets_sampled"])
        for toolset in row["toolsets_sampled"]:
            assert (toolset in row["toolsets_used"]) == bool(offered & set(TOOLSETS[toolset]))
