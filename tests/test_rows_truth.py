"""Rows tell the truth: what a row says of a session, checked against what the scripted endpoint
actually sent and received, through the real CLI. Each test is a case a row once got wrong."""

from __future__ import annotations

import json

from conftest import batch_rows, endpoint_args, run_cli, write_dataset

from batchrun.rows import rendered_tool_responses


def run(tmp_path, endpoint, prompts, *extra):
    dataset = write_dataset(tmp_path / "run.jsonl", prompts)
    return run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=5", "--run_name=run",
                   "--distribution=terminal_only", *endpoint_args(endpoint), *extra, env={"TERMINAL_ENV": "local"})


def only_row(tmp_path) -> dict:
    [row] = batch_rows(tmp_path / "data" / "run")
    return row


def replying_with_calls(ids: list[object]) -> object:
    """An endpoint script: the first reply calls terminal once per id (an id of None: the call has none),
    the next one answers."""
    def script(body: dict) -> tuple[int, dict, dict]:
        if body["messages"][-1]["role"] == "tool":
            message = {"role": "assistant", "content": "Done.", "reasoning": "checked"}
        else:
            calls = [{"type": "function", "function": {"name": "terminal", "arguments": f'{{"command": "echo {n}"}}'}}
                     for n in range(len(ids))]
            for call, call_id in zip(calls, ids, strict=True):
                if call_id is not None:
                    call["id"] = call_id
            message = {"role": "assistant", "content": "", "reasoning": "calling", "tool_calls": calls}
        return 200, {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}, {}
    return script


def response_ids(row: dict) -> list[str]:
    """The tool_call_id of each tool response of the row, in order."""
    return [json.loads(payload)["tool_call_id"] for turn in row["conversations"] if turn["from"] == "tool"
            for payload in rendered_tool_responses(turn["value"])]


def echoed_ids(request: dict) -> tuple[list[str], list[str]]:
    """(the ids of the calls the request sends back, the ids its tool messages answer)."""
    [assistant] = [message for message in request["messages"] if message["role"] == "assistant"]
    return ([call["id"] for call in assistant["tool_calls"]],
            [message["tool_call_id"] for message in request["messages"] if message["role"] == "tool"])


def test_calls_of_one_reply_sharing_an_id_each_get_an_id_of_their_own(tmp_path, endpoint):
    # Before, both results went into the row (and back to the endpoint) as answers to "dup": which
    # result was which call's could not be told, and providers refuse a conversation so made.
    endpoint.script = replying_with_calls(["dup", "dup"])
    assert run(tmp_path, endpoint, ["call twice"]).returncode == 0
    ids = response_ids(only_row(tmp_path))
    assert ids[0] == "dup" and len(set(ids)) == 2
    assert echoed_ids(endpoint.requests[1]) == (ids, ids)


def test_an_id_the_runner_makes_never_repeats_one_the_model_gave_in_the_same_reply(tmp_path, endpoint):
    # The runner names a call without an id call_<turn>_<position>; the model may have used that name already.
    endpoint.script = replying_with_calls(["call_0_1", None])
    assert run(tmp_path, endpoint, ["call twice"]).returncode == 0
    ids = response_ids(only_row(tmp_path))
    assert ids[0] == "call_0_1" and len(set(ids)) == 2
    assert echoed_ids(endpoint.requests[1]) == (ids, ids)
