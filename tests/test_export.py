"""--export: a run's rows in the formats trainers load, filtered again without generating again.

The openai format is lossless against the row: rendering an exported line back with the row renderer
(rows.render_*) gives the row's turns byte for byte, for every rendering rule. The exports are checked
against the openai package's own types and loaded back with pyarrow and datasets; the filters and the
summary are checked through the real CLI on a run made against the scripted endpoint.
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    REPO,
    OutputLines,
    batch_rows,
    cli_environment,
    endpoint_args,
    paused_cli_command,
    peak_python_bytes,
    read_jsonl,
    run_cli,
    write_dataset,
)
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionMessageParam,
    ChatCompletionToolMessageParam,
    ChatCompletionToolParam,
    ChatCompletionUserMessageParam,
)
from openai.types.shared_params import FunctionDefinition
from pydantic import TypeAdapter
from scripted_endpoint import ScriptedEndpoint
from test_rows import FORMAT_1_SESSION, format_1_line, random_result

from batchrun import export, rows
from batchrun.install_hint import install_hint
from batchrun.rows import AssistantTurn, HumanTurn, SessionResult, ToolCallRecord, Usage
from batchrun.session import CONTINUE_REQUEST, SUMMARY_REQUEST

RUN = "run"
TERMINAL_CALL = '[[call terminal {"command": "echo hi"}]]'
TWO_CALLS = ('[[calls [{"name": "terminal", "arguments": {"command": "echo a"}}, '
             '{"name": "terminal", "arguments": {"command": "echo b"}}]]]')
PROMPTS = {
    "plain": "plain question",
    "one_call": f"{TERMINAL_CALL} one call",
    "two_calls": f"{TWO_CALLS} two calls in one turn",
    "bad_json": "[[bad_json]] arguments that are not JSON",
    "continued": "[[length 1]] an answer cut off once",
    "summary": f"{' '.join([TERMINAL_CALL] * 4)} [[final What I found.]] past --max_turns",
    "inline_think": f"{TERMINAL_CALL} [[reasoning think]] reasoning inline",
    "no_reasoning": f"{TERMINAL_CALL} [[reasoning none]] no reasoning",
    "invented": "[[invent]] inventive",
    "failed": "[[fail 400]] refused",
}
REASONING_MODES = ("think", "field", "drop")
# The formats that write a file at --out; hf writes a folder.
FILE_FORMATS = [fmt for fmt in export.FORMATS if fmt != "hf"]


# -- a run made with the real CLI -------------------------------------------------------------------

@pytest.fixture(scope="module")
def run_home(tmp_path_factory) -> Path:
    """One run over every kind of row, shared by the tests that export it: they only read it."""
    home = tmp_path_factory.mktemp("export_run")
    dataset = write_dataset(home / "dataset.jsonl", list(PROMPTS.values()))
    with ScriptedEndpoint() as server:
        result = run_cli(home, f"--dataset_file={dataset}", "--batch_size=4", f"--run_name={RUN}",
                         "--distribution=terminal_only", f"--base_url={server.base_url}", "--model=scripted-model",
                         "--max_turns=3")
    assert result.returncode == 2, result.stderr         # the "[[fail 400]]" prompt failed
    return home


def export_cli(home: Path, *flags: str) -> subprocess.CompletedProcess:
    result = run_cli(home, f"--run_name={RUN}", *flags)
    assert result.returncode == 0, result.stderr
    return result


def exported(home: Path, tmp_path: Path, fmt: str, *flags: str) -> Path:
    out = tmp_path / {"openai": "out.jsonl", "sharegpt": "out.jsonl", "parquet": "out.parquet", "hf": "hf"}[fmt]
    export_cli(home, f"--export={fmt}", f"--out={out}", *flags)
    return out


def run_rows(home: Path) -> dict[str, dict]:
    """The run's rows with a trajectory, by the key of their prompt in PROMPTS."""
    by_prompt = {row["conversations"][1]["value"]: row for row in batch_rows(home / "data" / RUN)
                 if "conversations" in row}
    return {name: by_prompt[prompt] for name, prompt in PROMPTS.items() if prompt in by_prompt}


def prompt_names(lines: list[dict]) -> set[str]:
    names = {prompt: name for name, prompt in PROMPTS.items()}
    return {names[line["messages"][0]["content"] if "messages" in line else line["conversations"][1]["value"]]
            for line in lines}


# -- rendering an openai line back, the way a trainer's view maps onto the row -----------------------

def rendered_back(line: dict, reasoning: str) -> list[dict]:
    """The row turns that rows.render_* make of an exported line: the row's own, if nothing was lost."""
    messages = line["messages"]
    turns = [{"from": "system", "value": rows.render_system_turn(tool["function"]["name"] for tool in line["tools"])},
             {"from": "human", "value": messages[0]["content"]}]
    calls: list[ToolCallRecord] = []

    def answer_turn() -> None:
        answered = [call for call in calls if call.result is not None]
        if answered:
            turns.append(rows.render_tool_turn(answered))
        calls.clear()

    for message in messages[1:]:
        if message["role"] == "tool":
            call = next(c for c in calls if c.id == message["tool_call_id"] and c.result is None)
            call.result = message["content"]
            continue
        answer_turn()
        if message["role"] == "user":
            turns.append({"from": "human", "value": message["content"]})
            continue
        content = message["content"] or ""
        if reasoning == "think":
            thought, content = rows.split_rendered_reasoning(content)
        else:
            thought = message.get("reasoning_content", "")
        calls.extend(ToolCallRecord(id=call["id"], name=call["function"]["name"],
                                    arguments=call["function"]["arguments"]) for call in message.get("tool_calls", ()))
        turns.append(rows.render_gpt_turn(AssistantTurn(thought, content, list(calls))))
    answer_turn()
    return turns


def encoded(turns: list[dict]) -> bytes:
    return rows.encode_row(turns)


def openai_line_of(row: dict, reasoning: str) -> dict:
    chat = export.conversation(row["conversations"], export.layouts_of(row))
    return {"messages": export.openai_messages(chat, reasoning), "tools": chat.tools}


def traced(out: Path) -> list[tuple[dict, dict]]:
    """Each exported openai line with its manifest line."""
    lines, manifest = read_jsonl(out), read_jsonl(export.manifest_path(out))
    assert len(lines) == len(manifest)
    return list(zip(lines, manifest, strict=True))


def trajectory(turns: list, *, offered: tuple[str, ...] = ("terminal", "read_file"), prompt: str = "Do it.",
               end_reason: str = "final_answer") -> dict:
    result = SessionResult(prompt_index=0, content_key=rows.content_key(prompt, None, None), prompt=prompt,
                           toolsets=["terminal", "file"], offered_tools=list(offered), turns=turns,
                           api_calls=len(turns), usage=Usage(), wall_time=1.0, end_reason=end_reason)
    return json.loads(rows.encode_row(rows.trajectory_row(result, batch_num=0, model="m", timestamp="t")))


def call(name: str = "terminal", arguments: str = '{"command": "ls"}', result: str | None = '{"output": "a\\n"}',
         id: str | None = None) -> ToolCallRecord:
    return ToolCallRecord(id=id or f"call_{name}", name=name, arguments=arguments, result=result)


# Each rendering rule of docs/rows.md, as a session whose row the export must give back byte for byte.
RENDERING_RULES = {
    "reasoning_and_text": [AssistantTurn("I should answer.", "Done.")],
    "no_reasoning": [AssistantTurn("", "Done.")],
    "reasoning_only": [AssistantTurn("Still thinking", "")],
    "text_and_a_call": [AssistantTurn("Look first.", "Listing.", [call()]), AssistantTurn("ok", "Done.")],
    "a_call_without_text_or_reasoning": [AssistantTurn("", "", [call()]), AssistantTurn("", "Done.")],
    "several_calls": [AssistantTurn("Both.", "", [call(id="a"), call("read_file", '{"path": "x"}', id="b"),
                                                  call(id="c")]), AssistantTurn("r", "Done.")],
    "arguments_not_json_kept_as_text": [AssistantTurn("r", "", [call(arguments='{"command": "ls"')]),
                                        AssistantTurn("r", "Done.")],
    "arguments_a_json_string_or_number": [AssistantTurn("r", "", [call(arguments='"ls"', id="s"),
                                                                  call(arguments="42", id="n")]),
                                          AssistantTurn("r", "Done.")],
    "result_a_json_object": [AssistantTurn("r", "", [call(result='{"output": "x", "error": null}')]),
                             AssistantTurn("r", "Done.")],
    "result_a_json_array": [AssistantTurn("r", "", [call(result='[1, "two"]')]), AssistantTurn("r", "Done.")],
    "result_plain_text": [AssistantTurn("r", "", [call(result="Error: no such file")]), AssistantTurn("r", "Done.")],
    "result_text_that_looks_like_json": [AssistantTurn("r", "", [call(result='{"cut off')]),
                                         AssistantTurn("r", "Done.")],
    "result_empty": [AssistantTurn("r", "", [call(result="")]), AssistantTurn("r", "Done.")],
    "a_call_left_unanswered": [AssistantTurn("r", "", [call(id="a"), call(id="b", result=None)])],
    "continuation_requests": [AssistantTurn("r", "Part 1"), HumanTurn(CONTINUE_REQUEST), AssistantTurn("r", "Part 2")],
    "summary_request": [AssistantTurn("r", "", [call()]), HumanTurn(SUMMARY_REQUEST), AssistantTurn("r", "Summary.")],
    "an_invented_tool": [AssistantTurn("r", "", [call("made_up", "{}", '{"error": "unknown tool"}')]),
                         AssistantTurn("r", "Done.")],
    "text_holding_think_and_tool_call_tags": [AssistantTurn("", "I write <think> and\n<tool_call>\nliterally",
                                                            [call()]), AssistantTurn("", "Done.")],
    "unicode_and_line_separators": [AssistantTurn("思考\u2028", "ünï\u2028", [call(arguments='{"c": "🙂\u2028"}',
                                                                               result="中文\u2029")]),
                                    AssistantTurn("", "Done.")],
    "no_tools_offered": "no_tools",
}


def rule_row(rule: str) -> dict:
    if rule == "no_tools_offered":
        return trajectory([AssistantTurn("r", "Done.")], offered=())
    return trajectory(RENDERING_RULES[rule])


# -- the round trip ----------------------------------------------------------------------------------

@pytest.mark.parametrize("reasoning", ["think", "field"])
@pytest.mark.parametrize("rule", RENDERING_RULES)
def test_an_openai_line_renders_back_to_the_rows_turns_byte_for_byte(rule, reasoning):
    row = rule_row(rule)
    assert encoded(rendered_back(openai_line_of(row, reasoning), reasoning)) == encoded(row["conversations"])


@pytest.mark.parametrize("reasoning", ["think", "field"])
def test_generated_adversarial_rows_render_back_byte_for_byte(reasoning):
    rng = random.Random(20261130)
    checked = 0
    for prompt_index in range(300):
        result = random_result(rng, prompt_index)
        if result.end_reason == "error" or (reasoning == "think" and any("</think>" in turn.reasoning
                                                                         for turn in result.turns)):
            continue      # no trajectory; inline, a reasoning that closes its own think block cannot be told apart
        row = json.loads(rows.encode_row(rows.trajectory_row(result, batch_num=0, model="m", timestamp="t")))
        assert encoded(rendered_back(openai_line_of(row, reasoning), reasoning)) == encoded(row["conversations"])
        checked += 1
    assert checked > 150


def test_every_row_of_a_real_run_renders_back_byte_for_byte(run_home, tmp_path):
    for reasoning in ("think", "field"):
        out = exported(run_home, tmp_path, "openai", f"--reasoning={reasoning}", "--discard_no_reasoning=False",
                       "--discard_invented=False")
        lines = traced(out)
        originals = {(row["prompt_index"], row["content_key"]): row for row in run_rows(run_home).values()}
        assert len(originals) == len(PROMPTS) - 1          # all but the failure row
        assert len(lines) == len(originals) - 1            # and the invented one, which ends on a tool result
        for line, source in lines:
            original = originals[(source["prompt_index"], source["content_key"])]
            assert encoded(rendered_back(line, reasoning)) == encoded(original["conversations"])


# -- the openai format -------------------------------------------------------------------------------

MESSAGE = TypeAdapter(ChatCompletionMessageParam)
TOOL = TypeAdapter(ChatCompletionToolParam)
MESSAGE_KEYS = {role: kind.__required_keys__ | kind.__optional_keys__ for role, kind in (
    ("user", ChatCompletionUserMessageParam), ("assistant", ChatCompletionAssistantMessageParam),
    ("tool", ChatCompletionToolMessageParam))}


# OpenAI's chat fine-tuning format is the chat API's messages and tools, and "weight" (0 or 1) on an
# assistant message: whether it is trained on.
FINE_TUNING_ASSISTANT_KEYS = frozenset({"weight"})


def assert_openai_types(line: dict, *, extra_assistant_keys: frozenset[str] = frozenset()) -> None:
    assert set(line) == {"messages", "tools"}
    for message in line["messages"]:
        weight = message.get("weight")
        validated = MESSAGE.validate_python({k: v for k, v in message.items() if k != "weight"}, strict=True)
        list(validated.get("tool_calls", ()))           # pydantic checks an iterable's items as they are read
        allowed = MESSAGE_KEYS[message["role"]] | (extra_assistant_keys | FINE_TUNING_ASSISTANT_KEYS
                                                   if message["role"] == "assistant" else set())
        assert set(message) <= allowed, message
        assert weight in ((1,) if message["role"] == "assistant" else (None,))
    for tool in line["tools"]:
        TOOL.validate_python(tool, strict=True)
        assert set(tool["function"]) <= FunctionDefinition.__required_keys__ | FunctionDefinition.__optional_keys__


@pytest.mark.parametrize("reasoning", REASONING_MODES)
def test_openai_lines_are_the_openai_packages_message_and_tool_params(run_home, tmp_path, reasoning):
    lines = read_jsonl(exported(run_home, tmp_path, "openai", f"--reasoning={reasoning}"))
    assert lines
    for line in lines:
        assert_openai_types(line, extra_assistant_keys=frozenset({"reasoning_content"} if reasoning == "field" else ()))


@pytest.mark.parametrize("rule", RENDERING_RULES)
def test_openai_messages_of_every_rendering_rule_are_the_openai_packages_types(rule):
    assert_openai_types(openai_line_of(rule_row(rule), "field"), extra_assistant_keys=frozenset({"reasoning_content"}))


def test_calls_carry_their_ids_names_and_arguments_as_json_text_and_results_answer_them_by_id():
    row = trajectory(RENDERING_RULES["several_calls"])
    messages = openai_line_of(row, "drop")["messages"]
    assert messages[1]["tool_calls"] == [
        {"id": "a", "type": "function", "function": {"name": "terminal", "arguments": '{"command": "ls"}'}},
        {"id": "b", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "x"}'}},
        {"id": "c", "type": "function", "function": {"name": "terminal", "arguments": '{"command": "ls"}'}}]
    assert [(m["role"], m["tool_call_id"]) for m in messages[2:5]] == [("tool", "a"), ("tool", "b"), ("tool", "c")]
    assert messages[2]["content"] == '{"output": "a\\n"}'


def test_arguments_that_are_not_json_are_exported_as_the_model_wrote_them():
    row = trajectory(RENDERING_RULES["arguments_not_json_kept_as_text"])
    [tool_call] = openai_line_of(row, "drop")["messages"][1]["tool_calls"]
    assert tool_call["function"]["arguments"] == '{"command": "ls"'


def test_tools_are_the_schemas_the_system_turn_listed_as_openai_function_tools():
    row = trajectory([AssistantTurn("r", "Done.")], offered=("terminal", "read_file"))
    tools = openai_line_of(row, "drop")["tools"]
    listed = json.loads(row["conversations"][0]["value"].split("<tools>\n")[1].split("\n</tools>")[0])
    assert tools == [{"type": "function", "function": {"name": item["name"], "description": item["description"],
                                                       "parameters": item["parameters"]}} for item in listed]
    assert [tool["function"]["name"] for tool in tools] == ["terminal", "read_file"]


def test_there_is_no_system_message_the_conversation_starts_with_the_prompt():
    messages = openai_line_of(trajectory([AssistantTurn("r", "Done.")], prompt="the prompt"), "drop")["messages"]
    assert messages[0] == {"role": "user", "content": "the prompt"}
    assert all(message["role"] != "system" for message in messages)


def test_reasoning_think_keeps_the_rows_think_block_inline_in_the_content():
    turns = [AssistantTurn("Plan.", "Listing.", [call()]), AssistantTurn("", "Done.")]
    messages = openai_line_of(trajectory(turns), "think")["messages"]
    assert messages[1]["content"] == "<think>\nPlan.\n</think>\nListing."
    assert messages[3]["content"] == "<think>\n</think>\nDone."          # the row's empty block, as in ShareGPT


def test_reasoning_field_puts_it_in_reasoning_content_and_only_where_there_was_some():
    turns = [AssistantTurn("Plan.", "Listing.", [call()]), AssistantTurn("", "Done.")]
    messages = openai_line_of(trajectory(turns), "field")["messages"]
    assert (messages[1]["reasoning_content"], messages[1]["content"]) == ("Plan.", "Listing.")
    assert "reasoning_content" not in messages[3] and messages[3]["content"] == "Done."


def test_reasoning_drop_leaves_only_the_visible_text():
    turns = [AssistantTurn("Plan.", "", [call()]), AssistantTurn("Plan 2.", "Done.")]
    messages = openai_line_of(trajectory(turns), "drop")["messages"]
    assert [(m.get("content"), "reasoning_content" in m) for m in messages if m["role"] == "assistant"] == [
        (None, False), ("Done.", False)]


def test_a_mid_session_request_of_the_runner_is_a_user_message_where_it_was_sent():
    messages = openai_line_of(trajectory(RENDERING_RULES["continuation_requests"]), "drop")["messages"]
    assert [(m["role"], m["content"]) for m in messages] == [
        ("user", "Do it."), ("assistant", "Part 1"), ("user", CONTINUE_REQUEST), ("assistant", "Part 2")]


def test_the_manifest_beside_an_openai_export_names_the_run_row_of_each_line(run_home, tmp_path):
    lines = traced(exported(run_home, tmp_path, "openai"))
    originals = {(row["prompt_index"], row["content_key"]): row for row in run_rows(run_home).values()}
    assert lines
    for line, source in lines:
        assert set(source) == {"prompt_index", "sample_index", "content_key"}
        assert originals[(source["prompt_index"], source["content_key"])]["conversations"][1]["value"] == \
            line["messages"][0]["content"]


def test_a_format_1_row_exports_as_the_current_row_of_the_same_session(tmp_path):
    run_dir = tmp_path / "data" / RUN
    run_dir.mkdir(parents=True)
    (run_dir / "batch_0.jsonl").write_bytes(format_1_line(FORMAT_1_SESSION))
    out = tmp_path / "out.jsonl"
    export.export_run(export.ExportOptions(format="openai", run_dir=run_dir, out=out, reasoning="field",
                                           discard_invented=False))
    [line] = read_jsonl(out)
    current = json.loads(rows.encode_row(rows.trajectory_row(FORMAT_1_SESSION, batch_num=0, model="m", timestamp="t")))
    assert {key: line[key] for key in ("messages", "tools")} == openai_line_of(current, "field")


# -- filters ------------------------------------------------------------------------------------------

def test_sharegpt_with_the_runs_own_filters_is_the_merged_file_byte_for_byte(run_home, tmp_path):
    out = exported(run_home, tmp_path, "sharegpt")
    assert out.read_bytes() == (run_home / "data" / RUN / "trajectories.jsonl").read_bytes()


def test_sharegpt_of_a_batch_file_saved_with_a_byte_order_mark_is_the_merged_file_without_it(run_home, tmp_path):
    home = tmp_path / "home"
    (home / "data" / RUN).mkdir(parents=True)
    for path in (run_home / "data" / RUN).glob("batch_*.jsonl"):
        (home / "data" / RUN / path.name).write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    out = exported(home, tmp_path, "sharegpt")
    assert out.read_bytes() == (run_home / "data" / RUN / "trajectories.jsonl").read_bytes()


def test_the_export_says_what_it_kept_and_what_it_left_out_by_reason(run_home, tmp_path):
    out = tmp_path / "out.jsonl"
    result = export_cli(run_home, "--export=openai", f"--out={out}")
    said = " ".join(result.stdout.split())           # a log is wrapped at 80 columns
    assert f"exported {len(PROMPTS) - 3} of {len(PROMPTS)} rows of data/{RUN}/ to {out} " in said
    reasons = {reason: int(count) for count, reason in re.findall(r"^  (\d+) (\w+)  ", result.stdout, re.MULTILINE)}
    assert reasons == {"failed": 1, "invented_tools": 1, "no_reasoning": 1}


def test_turning_the_no_reasoning_filter_off_readmits_the_tombstone_as_a_plain_row(run_home, tmp_path):
    lines = read_jsonl(exported(run_home, tmp_path, "sharegpt", "--discard_no_reasoning=False"))
    merged = read_jsonl(run_home / "data" / RUN / "trajectories.jsonl")
    [readmitted] = [line for line in lines if line["conversations"][1]["value"] == PROMPTS["no_reasoning"]]
    assert list(readmitted) == list(merged[0])             # no "discarded" or "prompt": the keys of a merged row
    assert readmitted["conversations"] == run_rows(run_home)["no_reasoning"]["conversations"]


def test_turning_the_invented_tools_filter_off_admits_the_corrupted_row(run_home, tmp_path):
    lines = read_jsonl(exported(run_home, tmp_path, "sharegpt", "--discard_invented=False"))
    assert prompt_names(lines) == set(PROMPTS) - {"failed", "no_reasoning"}


def test_end_reasons_keeps_only_rows_that_ended_for_those_reasons(run_home, tmp_path):
    lines = read_jsonl(exported(run_home, tmp_path, "sharegpt", "--end_reasons=max_turns,truncated"))
    assert prompt_names(lines) == {"summary"}


def test_min_tool_calls_leaves_out_rows_with_fewer_calls(run_home, tmp_path):
    lines = read_jsonl(exported(run_home, tmp_path, "openai", "--min_tool_calls=2"))
    assert prompt_names(lines) == {"two_calls", "summary"}


def test_last_call_succeeded_leaves_out_rows_whose_last_tool_call_failed(run_home, tmp_path):
    lines = read_jsonl(exported(run_home, tmp_path, "openai", "--last_call_succeeded"))
    assert "bad_json" not in prompt_names(lines)
    assert {"plain", "one_call", "two_calls"} <= prompt_names(lines)     # a row without calls has nothing failed


def test_a_corrupted_attempt_replaced_by_rerun_corrupted_is_exported_once(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["[[invent]] inventive", "plain"])
    args = [f"--dataset_file={dataset}", "--batch_size=4", f"--run_name={RUN}", "--distribution=terminal_only",
            f"--base_url={endpoint.base_url}", "--model=scripted-model"]
    assert run_cli(tmp_path, *args).returncode == 0
    assert run_cli(tmp_path, *args, "--resume", "--rerun_corrupted").returncode == 0
    assert len(batch_rows(tmp_path / "data" / RUN)) == 3
    result = export_cli(tmp_path, "--export=sharegpt", "--discard_invented=False", f"--out={tmp_path / 'out.jsonl'}")
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 2
    assert "  1 superseded" in result.stdout


# -- parquet and hf ------------------------------------------------------------------------------------

def test_parquet_loads_back_with_the_fixed_schema_and_the_rows_turns(run_home, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    table = pq.read_table(exported(run_home, tmp_path, "parquet"))
    assert table.schema == export.arrow_schema()
    merged = read_jsonl(run_home / "data" / RUN / "trajectories.jsonl")
    loaded = table.to_pylist()
    assert [(r["prompt_index"], r["content_key"], r["conversations"]) for r in loaded] == [
        (r["prompt_index"], r["content_key"], r["conversations"]) for r in merged]
    assert [r["usage"] for r in loaded] == [r["usage"] for r in merged]
    assert {entry["tool"] for entry in loaded[0]["tool_stats"]} == set(merged[0]["tool_stats"])


def test_parquet_of_no_rows_is_a_valid_empty_file_with_the_schema(run_home, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    table = pq.read_table(exported(run_home, tmp_path, "parquet", "--end_reasons=prompt_timeout"))
    assert (table.num_rows, table.schema) == (0, export.arrow_schema())


def write_many_rows(home: Path, count: int) -> Path:
    """A run directory of ``count`` small finished rows, a prompt each, as the run writes them: many rows
    in a second or two, which a run against the scripted endpoint would take minutes to make."""
    run_dir = home / "data" / RUN
    run_dir.mkdir(parents=True)
    with (run_dir / "batch_0.jsonl").open("wb") as handle:
        for index in range(count):
            prompt = f"prompt {index}"
            result = SessionResult(prompt_index=index, content_key=rows.content_key(prompt, None, None),
                                   prompt=prompt, toolsets=["terminal"], offered_tools=["terminal"],
                                   turns=[AssistantTurn("r", "Done.")], api_calls=1, usage=Usage(), wall_time=1.0,
                                   end_reason=rows.EndReason.FINAL_ANSWER)
            handle.write(rows.encode_finished(result, batch_num=0, model="m", timestamp="t",
                                              discard_no_reasoning=True))
    return run_dir


def test_parquet_is_written_in_row_groups_of_at_most_1000_rows(tmp_path):
    # A row group is held in memory while it fills: one group of every row would hold the whole run.
    pq = pytest.importorskip("pyarrow.parquet")
    count = 2001
    out = tmp_path / "out.parquet"
    export.export_run(export.ExportOptions(format="parquet", run_dir=write_many_rows(tmp_path, count), out=out))
    metadata = pq.ParquetFile(out).metadata
    assert metadata.num_rows == count and metadata.num_row_groups == math.ceil(count / 1000)
    assert [metadata.row_group(group).num_rows for group in range(metadata.num_row_groups)] == [1000, 1000, 1]


@pytest.fixture(scope="module")
def many_rows_runs(tmp_path_factory) -> dict[int, Path]:
    """Runs of 10, 2,000 and 8,000 small rows, shared by the memory tests: they only read them."""
    home = tmp_path_factory.mktemp("many_rows")
    return {count: write_many_rows(home / str(count), count) for count in (10, 2000, 8000)}


@pytest.mark.parametrize("fmt", FILE_FORMATS)
def test_an_export_of_four_times_the_rows_holds_a_small_part_of_the_rows_added(many_rows_runs, tmp_path, fmt):
    # docs/export.md: a run of a million rows exports in bounded memory. What grows with the rows is a
    # key per prompt (as resume holds, some 150 bytes); the rows themselves are held a line, or a row
    # group of 1,000, at a time (so from 2,000 rows, as parquet's peak is the same from a whole group
    # on). Holding every row costs more than its bytes, so the 6,000 rows added would cost more than four
    # times what is allowed here.
    for module in export.EXPORT_FORMATS[fmt].modules:
        pytest.importorskip(module)

    def exporting(count: int) -> Callable[[], object]:
        return lambda: export.export_run(export.ExportOptions(format=fmt, run_dir=many_rows_runs[count],
                                                              out=tmp_path / f"{count}.out"))

    exporting(10)()             # imports (pyarrow's among them) are not what the rows cost
    small, large = peak_python_bytes(exporting(2000)), peak_python_bytes(exporting(8000))
    added = (many_rows_runs[8000] / "batch_0.jsonl").stat().st_size - \
        (many_rows_runs[2000] / "batch_0.jsonl").stat().st_size
    assert large - small < added / 4, f"{small:,} bytes at most for 2,000 rows, {large:,} for 8,000 ({added:,} more)"


# Rows edited by hand that every reader of rows takes, with a value the Parquet column cannot hold.
UNFIT_FOR_PARQUET = {"api_calls_as_text": ("api_calls", lambda row: row.update(api_calls="3")),
                     "batch_num_as_text": ("batch_num", lambda row: row["metadata"].update(batch_num="x")),
                     "tokens_beyond_int64": ("usage", lambda row: row["usage"].update(prompt_tokens=2 ** 63)),
                     # pyarrow wrote 2.5 as 2, and 0.9 as 0, without a word
                     "api_calls_fractional": ("api_calls", lambda row: row.update(api_calls=2.5)),
                     "batch_num_fractional": ("batch_num", lambda row: row["metadata"].update(batch_num=0.9))}


# A whole number written as a float (3.0, as a round trip through pandas writes it) loses nothing.
def test_a_whole_number_written_as_a_float_is_exported_to_parquet_as_its_integer(run_home, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    home = tmp_path / "home"
    (home / "data" / RUN).mkdir(parents=True)
    for path in (run_home / "data" / RUN).glob("batch_*.jsonl"):
        edited = []
        for line in path.read_bytes().splitlines(keepends=True):
            row = json.loads(line)
            if "api_calls" in row:
                row["api_calls"] = float(row["api_calls"])
            edited.append(rows.encode_row(row))
        (home / "data" / RUN / path.name).write_bytes(b"".join(edited))
    out = tmp_path / "out.parquet"
    export_cli(home, "--export=parquet", f"--out={out}")
    assert all(isinstance(calls, int) and calls > 0 for calls in pq.read_table(out).column("api_calls").to_pylist())


@pytest.mark.parametrize("edit", list(UNFIT_FOR_PARQUET))
def test_a_row_whose_value_does_not_fit_its_parquet_column_stops_the_export_naming_it(run_home, tmp_path, edit):
    pytest.importorskip("pyarrow")
    column, change = UNFIT_FOR_PARQUET[edit]
    home = tmp_path / "home"
    (home / "data" / RUN).mkdir(parents=True)
    lines = (run_home / "data" / RUN / "batch_0.jsonl").read_bytes().splitlines(keepends=True)
    merged = set((run_home / "data" / RUN / "trajectories.jsonl").read_bytes().splitlines(keepends=True))
    number = next(number for number, line in enumerate(lines) if line in merged)     # a row the export keeps
    row = json.loads(lines[number])
    change(row)
    lines[number] = rows.encode_row(row)
    (home / "data" / RUN / "batch_0.jsonl").write_bytes(b"".join(lines))
    out = tmp_path / "out.parquet"
    result = run_cli(home, f"--run_name={RUN}", "--export=parquet", f"--out={out}")
    assert result.returncode == 1
    [message] = result.stderr.strip().splitlines()
    assert message.startswith(f"error: data/{RUN}/batch_0.jsonl line {number + 1}: not a batch_runner row "
                              f"(its {column!r} ")
    assert not list(tmp_path.glob("out*"))


# pyarrow's error names no file: "cannot write None".
@pytest.mark.parametrize("fmt", ["sharegpt", "parquet"])
def test_an_export_to_a_place_no_file_can_be_made_names_the_out_it_was_given(run_home, fmt):
    pytest.importorskip("pyarrow")
    result = run_cli(run_home, f"--run_name={RUN}", f"--export={fmt}", "--out=/proc/self/rows.out")
    assert result.returncode == 1
    [message] = result.stderr.strip().splitlines()
    assert message.startswith("error: cannot write /proc/self/rows.out") and message.endswith("Choose another --out.")


def test_an_export_without_out_to_a_place_no_file_can_be_made_names_the_out_it_chose(run_home, tmp_path):
    pytest.importorskip("pyarrow")
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    subprocess.run(["cp", "-a", str(run_home / "data" / RUN), str(home / "data" / RUN)], check=True)
    shutil.rmtree(home / "data" / RUN / "export", ignore_errors=True)
    (home / "data" / RUN / "export").symlink_to("/proc/self")
    result = run_cli(home, f"--run_name={RUN}", "--export=parquet")
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: cannot write data/{RUN}/export/")


def test_hf_folder_opens_with_load_from_disk_holding_the_parquet_rows(run_home, tmp_path):
    datasets = pytest.importorskip("datasets")
    pq = pytest.importorskip("pyarrow.parquet")
    loaded = datasets.load_from_disk(str(exported(run_home, tmp_path, "hf")))
    assert loaded.to_list() == pq.read_table(exported(run_home, tmp_path, "parquet")).to_pylist()


def test_hf_export_replaces_an_earlier_one_and_opens_empty_when_no_row_passes(run_home, tmp_path):
    datasets = pytest.importorskip("datasets")
    out = exported(run_home, tmp_path, "hf")
    exported(run_home, tmp_path, "hf", "--end_reasons=prompt_timeout")
    loaded = datasets.load_from_disk(str(out))
    assert (loaded.num_rows, loaded.column_names) == (0, export.arrow_schema().names)


class Killed(BaseException):
    """Stands in for a kill -9: nothing after it in the export runs, as nothing would."""


def test_an_hf_export_stopped_while_it_removes_the_earlier_one_leaves_a_loadable_folder(run_home, tmp_path,
                                                                                       monkeypatch):
    # Before, the earlier folder was removed at --out and only then the new one renamed in: stopped during
    # the removal, --out was half a folder that datasets would not load and the next export refused as
    # "not a datasets folder".
    datasets = pytest.importorskip("datasets")
    from batchrun.export import arrow

    out = tmp_path / "hf"
    earlier = export.ExportOptions(format="hf", run_dir=run_home / "data" / RUN, out=out)
    later = export.ExportOptions(format="hf", run_dir=run_home / "data" / RUN, out=out,
                                 end_reasons=frozenset({"prompt_timeout"}))      # no row: told apart by its size
    earlier_rows = export.export_run(earlier).kept
    assert earlier_rows > 0
    remove = shutil.rmtree

    def stopped_after_one_file(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> None:
        # Only the removal of a whole saved folder (the earlier export) is stopped; the export's own
        # work folder, which holds no state.json, is removed as ever.
        if (Path(path) / "state.json").is_file():
            (Path(path) / "state.json").unlink()
            raise Killed
        remove(path, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(arrow.shutil, "rmtree", stopped_after_one_file)
        with pytest.raises(Killed):
            export.export_run(later)
    assert datasets.load_from_disk(str(out)).num_rows in (earlier_rows, 0)
    assert export.export_run(later).kept == 0           # the next export takes --out as a datasets folder
    assert datasets.load_from_disk(str(out)).num_rows == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf"]     # nothing left beside it


def test_an_hf_export_whose_folder_cannot_be_renamed_in_leaves_the_earlier_one_at_out(run_home, tmp_path,
                                                                                      monkeypatch):
    # The earlier folder is renamed aside before the new one goes in: if that rename fails, the earlier
    # one goes back, rather than leave --out empty with the earlier export under a temporary name.
    datasets = pytest.importorskip("datasets")
    from batchrun.export import arrow

    out = tmp_path / "hf"
    run_dir = run_home / "data" / RUN
    earlier_rows = export.export_run(export.ExportOptions(format="hf", run_dir=run_dir, out=out)).kept
    replace = os.replace

    def refused_at_out(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        if Path(target) == out and Path(source).parent != tmp_path:      # the new folder, from the work folder
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(target))
        replace(source, target)

    with monkeypatch.context() as patched:
        patched.setattr(arrow.os, "replace", refused_at_out)
        with pytest.raises(OSError):
            export.export_run(export.ExportOptions(format="hf", run_dir=run_dir, out=out,
                                                   end_reasons=frozenset({"prompt_timeout"})))
    assert datasets.load_from_disk(str(out)).num_rows == earlier_rows > 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf"]


def test_hf_export_never_replaces_a_folder_that_is_not_a_dataset(run_home, tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "mine.txt").write_text("keep me")
    result = run_cli(run_home, f"--run_name={RUN}", "--export=hf", f"--out={tmp_path / 'hf'}")
    assert result.returncode == 1 and "is not a datasets folder" in result.stderr
    assert (tmp_path / "hf" / "mine.txt").read_text() == "keep me"


def test_hf_export_over_a_link_to_an_earlier_one_replaces_the_link_and_leaves_that_folder(run_home, tmp_path):
    # As the file formats do; it said "error: cannot write None: None" (rmtree refuses a link).
    datasets = pytest.importorskip("datasets")
    elsewhere = exported(run_home, tmp_path, "hf")
    before = {path.name: path.read_bytes() for path in elsewhere.iterdir()}
    link = tmp_path / "linked_hf"
    link.symlink_to(elsewhere)
    export_cli(run_home, "--export=hf", f"--out={link}", "--end_reasons=prompt_timeout")
    assert not link.is_symlink() and datasets.load_from_disk(str(link)).num_rows == 0
    assert {path.name: path.read_bytes() for path in elsewhere.iterdir()} == before


@pytest.mark.parametrize("fmt", FILE_FORMATS)
def test_a_file_export_over_a_symbolic_link_replaces_the_link_and_leaves_what_it_pointed_to(run_home, tmp_path,
                                                                                           fmt):
    # Written through the link, the export would overwrite a file the user never named (the link's target),
    # and its manifest would land beside that file rather than beside --out.
    for module in export.EXPORT_FORMATS[fmt].modules:
        pytest.importorskip(module)
    elsewhere, exports = tmp_path / "elsewhere", tmp_path / "exports"
    elsewhere.mkdir()
    exports.mkdir()
    victim = elsewhere / "precious.jsonl"
    victim.write_bytes(b'{"not": "an export"}\n')
    out = exports / ("out.parquet" if fmt == "parquet" else "out.jsonl")
    out.symlink_to(victim)
    export_cli(run_home, f"--export={fmt}", f"--out={out}")
    assert victim.read_bytes() == b'{"not": "an export"}\n'
    assert [path.name for path in elsewhere.iterdir()] == ["precious.jsonl"]       # nothing written beside it
    assert out.is_file() and not out.is_symlink() and out.stat().st_size > 0
    if (manifest := export.EXPORT_FORMATS[fmt].manifest) is not None:
        assert manifest(out).parent == exports and manifest(out).is_file() and not manifest(out).is_symlink()


def test_a_missing_extra_is_named_with_the_command_that_installs_it(run_home):
    blocked = (f"import runpy, sys; sys.path.insert(0, {str(REPO)!r}); sys.modules['pyarrow'] = None; "
               f"sys.argv = ['batch_runner.py', '--export=parquet', '--run_name={RUN}']; "
               f"runpy.run_path({str(REPO / 'batch_runner.py')!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", blocked], cwd=run_home, env=cli_environment(run_home),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == f"error: --export=parquet needs pyarrow, an optional extra: {install_hint('export')}"


# -- the command line ----------------------------------------------------------------------------------

def test_export_flags_on_a_run_are_refused_before_anything_starts(tmp_path):
    result = run_cli(tmp_path, "--dataset_file=x.jsonl", "--batch_size=1", "--run_name=r", "--min_tool_calls=2")
    assert result.returncode == 1
    assert result.stderr.strip() == "error: --min_tool_calls applies only with --export=FORMAT"
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("flags, message", [
    (["--export"], "--export needs a format: --export=openai|sharegpt|parquet|hf"),
    (["--export=csv"], "--export must be one of openai, sharegpt, parquet, hf; got 'csv'"),
    (["--export=openai", "--reasoning=hide"], "--reasoning must be one of think, field, drop; got 'hide'"),
    (["--export=parquet", "--reasoning=drop"], "--reasoning applies to --export=openai"),
    (["--export=openai", "--end_reasons=final_answer,error"], "--end_reasons takes comma-separated end reasons"),
    (["--export=openai", "--min_tool_calls=-1"], "--min_tool_calls must be an integer >= 0"),
])
def test_a_bad_export_flag_gets_one_error_line_naming_it(run_home, flags, message):
    result = run_cli(run_home, f"--run_name={RUN}", *flags)
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: {message}") and len(result.stderr.strip().splitlines()) == 1


def test_export_of_a_run_directory_that_is_not_there_names_it(tmp_path):
    result = run_cli(tmp_path, "--export=openai", "--run_name=absent")
    assert result.returncode == 1
    assert result.stderr.startswith("error: no run directory data/absent/ here")


# A loop in --out's path ended the export in a traceback (RuntimeError from resolving it).
@pytest.mark.parametrize("out", ["loop", "loop/rows.jsonl"])
def test_an_out_path_through_a_symlink_loop_is_one_error_line(run_home, tmp_path, out):
    (tmp_path / "loop").symlink_to("loop")
    result = run_cli(run_home, f"--run_name={RUN}", "--export=openai", f"--out={tmp_path / out}")
    assert result.returncode == 1
    assert result.stderr.startswith("error: --out=") and "Too many levels of symbolic links" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# Before, a file on the way was "cannot write notes.txt: File exists".
@pytest.mark.parametrize("export", ["openai", "hf"])
@pytest.mark.parametrize("out", ["notes.txt/rows.jsonl", "notes.txt/new/rows.jsonl"])
def test_an_out_path_through_a_file_names_that_file_as_not_a_directory(run_home, tmp_path, export, out):
    (tmp_path / "notes.txt").write_text("kept")
    result = run_cli(run_home, f"--run_name={RUN}", f"--export={export}", f"--out={tmp_path / out}")
    assert result.returncode == 1
    assert result.stderr == (f"error: --out={tmp_path / out} goes through {tmp_path / 'notes.txt'}, which is a file, "
                             "not a directory; choose another --out\n")
    assert (tmp_path / "notes.txt").read_text() == "kept"


def test_a_line_that_is_json_but_not_a_row_stops_the_export_and_keeps_the_earlier_file(run_home, tmp_path):
    home = tmp_path / "home"
    (home / "data" / RUN).mkdir(parents=True)
    for path in (run_home / "data" / RUN).glob("batch_*.jsonl"):
        (home / "data" / RUN / path.name).write_bytes(path.read_bytes())
    out = exported(home, tmp_path, "openai")
    before = out.read_bytes()
    with (home / "data" / RUN / "batch_0.jsonl").open("ab") as handle:
        handle.write(b'{"not": "a row"}\n')
    result = run_cli(home, f"--run_name={RUN}", "--export=openai", f"--out={out}")
    assert result.returncode == 1
    assert f"data/{RUN}/batch_0.jsonl line 5: not a batch_runner row" in result.stderr
    assert out.read_bytes() == before and not list(out.parent.glob(out.name + ".*tmp"))


@pytest.mark.parametrize("name", ["batch_0.jsonl", "trajectories.jsonl", "checkpoint.json", "new.jsonl",
                                  "export/new/../../batch_0.jsonl"])
def test_an_export_never_writes_among_the_run_directorys_own_files(run_home, tmp_path, name):
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    subprocess.run(["cp", "-a", str(run_home / "data" / RUN), str(home / "data" / RUN)], check=True)
    before = {path.name: path.read_bytes() for path in (home / "data" / RUN).iterdir() if path.is_file()}
    result = run_cli(home, f"--run_name={RUN}", "--export=openai", f"--out=data/{RUN}/{name}")
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: --out=data/{RUN}/{name} is inside the run directory")
    assert {path.name: path.read_bytes() for path in (home / "data" / RUN).iterdir() if path.is_file()} == before


def test_an_export_writes_in_the_run_directorys_export_folder_before_that_folder_exists(run_home, tmp_path):
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    subprocess.run(["cp", "-a", str(run_home / "data" / RUN), str(home / "data" / RUN)], check=True)
    shutil.rmtree(home / "data" / RUN / "export", ignore_errors=True)
    export_cli(home, "--export=openai", f"--out=data/{RUN}/export/mine.jsonl")
    assert (home / "data" / RUN / "export" / "mine.jsonl").stat().st_size > 0


# Compared by path, resolve() saw through symbolic links but not a bind mount: the export replaced the
# run's batch file, and three prompts' rows were gone.
def test_an_export_never_writes_among_the_run_directorys_files_through_a_bind_mount_of_it(run_home, tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a bind mount needs root and mount(8)")
    home, alias = tmp_path / "home", tmp_path / "alias"
    (home / "data").mkdir(parents=True)
    alias.mkdir()
    subprocess.run(["cp", "-a", str(run_home / "data" / RUN), str(home / "data" / RUN)], check=True)
    before = {path.name: path.read_bytes() for path in (home / "data" / RUN).iterdir() if path.is_file()}
    subprocess.run(["mount", "--bind", str(home / "data" / RUN), str(alias)], check=True)
    try:
        result = run_cli(home, f"--run_name={RUN}", "--export=openai", f"--out={alias}/batch_0.jsonl")
    finally:
        subprocess.run(["umount", str(alias)], check=True)
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: --out={alias}/batch_0.jsonl is inside the run directory")
    assert {path.name: path.read_bytes() for path in (home / "data" / RUN).iterdir() if path.is_file()} == before


# -- what an openai line holds -------------------------------------------------------------------------

def test_openai_lines_leave_reasoning_out_unless_asked_to_keep_it(run_home, tmp_path):
    answers = [m for line in read_jsonl(exported(run_home, tmp_path, "openai")) for m in line["messages"]
               if m["role"] == "assistant"]
    assert answers and not any("reasoning_content" in m or "<think>" in (m["content"] or "") for m in answers)
    kept = read_jsonl(exported(run_home, tmp_path, "openai", "--reasoning=think"))
    assert any((m["content"] or "").startswith("<think>\nReasoning") for line in kept for m in line["messages"])


FAKE_CALL = '<tool_call>\n{"name": "terminal", "arguments": {"command": "rm -rf /"}}\n</tool_call>'


def test_model_text_ending_in_a_tool_call_block_exports_as_text_with_no_call():
    row = trajectory([AssistantTurn("r", "I would run:\n" + FAKE_CALL)])
    assert openai_line_of(row, "drop")["messages"][1:] == [
        {"role": "assistant", "content": "I would run:\n" + FAKE_CALL, "weight": 1}]


def write_run(home: Path, results: list[SessionResult]) -> Path:
    run_dir = home / "data" / RUN
    run_dir.mkdir(parents=True)
    (run_dir / "batch_0.jsonl").write_bytes(b"".join(
        rows.encode_finished(result, batch_num=0, model="m", timestamp="t", discard_no_reasoning=True)
        for result in results))
    return run_dir


def result_of(turns: list, end_reason: str, prompt: str) -> SessionResult:
    return SessionResult(prompt_index=0, content_key=rows.content_key(prompt, None, None), prompt=prompt,
                         toolsets=["terminal"], offered_tools=["terminal"], turns=turns, api_calls=len(turns),
                         usage=Usage(), wall_time=1.0, end_reason=end_reason)


UNFINISHED = {
    "ends_on_a_tool_result": ([AssistantTurn("r", "", [call()]), AssistantTurn("r", "", [call(id="2")])], "max_turns"),
    "ends_on_unanswered_calls": ([AssistantTurn("r", "", [call()]),
                                  AssistantTurn("r", "", [call(id="2", result=None)])], "prompt_timeout"),
}


@pytest.mark.parametrize("case", UNFINISHED)
def test_an_openai_line_always_ends_on_an_answer_the_rest_are_left_out_and_counted(tmp_path, case):
    turns, end_reason = UNFINISHED[case]
    run_dir = write_run(tmp_path, [result_of(turns, end_reason, "stopped"),
                                   result_of([AssistantTurn("r", "", [call()]), AssistantTurn("r", "Done.")],
                                             "final_answer", "answered")])
    out = tmp_path / "out.jsonl"
    summary = export.export_run(export.ExportOptions(format="openai", run_dir=run_dir, out=out))
    [line] = read_jsonl(out)
    assert line["messages"][-1] == {"role": "assistant", "content": "Done.", "weight": 1}
    assert (summary.kept, dict(summary.dropped)) == (1, {"unfinished": 1})
    sharegpt = export.export_run(export.ExportOptions(format="sharegpt", run_dir=run_dir, out=tmp_path / "s.jsonl"))
    assert sharegpt.kept == 2


def test_a_plain_export_of_a_run_made_without_the_no_reasoning_filter_keeps_what_the_run_kept(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["[[reasoning none]] no thoughts", "thoughts"])
    assert run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=4", f"--run_name={RUN}",
                   "--distribution=terminal_only", *endpoint_args(endpoint), "--discard_no_reasoning=False").returncode == 0
    merged = tmp_path / "data" / RUN / "trajectories.jsonl"
    assert len(read_jsonl(merged)) == 2
    out = tmp_path / "out.jsonl"
    export_cli(tmp_path, "--export=sharegpt", f"--out={out}")
    assert out.read_bytes() == merged.read_bytes()
    result = export_cli(tmp_path, "--export=sharegpt", f"--out={out}", "--discard_no_reasoning")
    assert len(read_jsonl(out)) == 1 and "  1 no_reasoning" in result.stdout


# -- exports of different runs load together -------------------------------------------------------------

TWO_RUNS = {   # run name: (prompts, distribution)
    "quiet": (["plain question", "another plain one"], "terminal_only"),
    "busy": ([f"{TERMINAL_CALL} one call", f"{TWO_CALLS} two calls"], "terminal_only"),
    "other_tools": ([f"{TERMINAL_CALL} with a web tool offered too"], "terminal_web"),
}


@pytest.fixture(scope="module")
def runs_home(tmp_path_factory) -> Path:
    """Runs that differ in what they hold: no tool call at all, tool calls, another set of tools."""
    home = tmp_path_factory.mktemp("runs")
    with ScriptedEndpoint() as server:
        for name, (prompts, distribution) in TWO_RUNS.items():
            dataset = write_dataset(home / f"{name}.jsonl", prompts)
            result = run_cli(home, f"--dataset_file={dataset}", "--batch_size=4", f"--run_name={name}",
                             f"--distribution={distribution}", f"--base_url={server.base_url}",
                             "--model=scripted-model")
            assert result.returncode == 0, result.stderr
    return home


def export_of(home: Path, run: str, fmt: str, out_dir: Path) -> Path:
    out = out_dir / f"{run}.{ {'parquet': 'parquet', 'hf': 'hf'}.get(fmt, 'jsonl') }"
    summary = export.export_run(export.ExportOptions(format=fmt, run_dir=home / "data" / run, out=out))
    assert summary.kept == len(TWO_RUNS[run][0])
    return out


def loaded_together(fmt: str, paths: list[Path], cache: Path):
    datasets = pytest.importorskip("datasets")
    if fmt == "hf":
        return datasets.concatenate_datasets([datasets.load_from_disk(str(path)) for path in paths])
    return datasets.load_dataset("parquet" if fmt == "parquet" else "json", data_files=[str(p) for p in paths],
                                 split="train", cache_dir=str(cache))


@pytest.mark.parametrize("fmt", export.FORMATS)
@pytest.mark.parametrize("runs", [("quiet", "busy"), ("busy", "quiet"), ("quiet", "other_tools"),
                                  ("other_tools", "quiet")], ids="-then-".join)
def test_exports_of_two_runs_load_together_with_datasets_in_either_order(runs_home, tmp_path, fmt, runs):
    paths = [export_of(runs_home, run, fmt, tmp_path) for run in runs]
    loaded = loaded_together(fmt, paths, tmp_path / "cache")
    assert loaded.num_rows == sum(len(TWO_RUNS[run][0]) for run in runs)
    if fmt == "openai":
        assert {message["role"] for row in loaded for message in row["messages"]} >= {"user", "assistant"}


def test_openai_exports_of_runs_offering_one_tool_load_with_the_features_the_docs_give(runs_home, tmp_path):
    datasets = pytest.importorskip("datasets")
    home = tmp_path / "home"
    home.mkdir()
    with ScriptedEndpoint() as server:
        dataset = write_dataset(tmp_path / "one.jsonl", ["only web_extract is offered"])
        assert run_cli(home, f"--dataset_file={dataset}", "--batch_size=4", "--run_name=one_tool",
                       "--distribution=minimal", f"--base_url={server.base_url}",
                       "--model=scripted-model").returncode == 0
    one = tmp_path / "one.jsonl"
    export.export_run(export.ExportOptions(format="openai", run_dir=home / "data" / "one_tool", out=one))
    assert [len(line["tools"]) for line in read_jsonl(one)] == [1]
    features = datasets.Features({"messages": datasets.List(datasets.Json()), "tools": datasets.List(datasets.Json())})
    loaded = datasets.load_dataset("json", data_files=[str(one), str(export_of(runs_home, "busy", "openai", tmp_path))],
                                   split="train", cache_dir=str(tmp_path / "cache"), features=features)
    assert loaded.num_rows == 3 and loaded[0]["tools"][0]["function"]["name"] == "web_extract"


def test_a_row_whose_arguments_are_nested_too_deep_to_parse_exports_them_as_text():
    deep = "[" * 100_000 + "]" * 100_000
    row = trajectory([AssistantTurn("r", "", [call(arguments=deep, result='{"error": "too deep"}')]),
                      AssistantTurn("r", "Done.")])
    [tool_call] = openai_line_of(row, "drop")["messages"][1]["tool_calls"]
    assert tool_call["function"]["arguments"] == deep


def test_a_row_whose_turn_is_not_utf8_is_left_out_as_unreadable(run_home, tmp_path):
    home = tmp_path / "home"
    (home / "data" / RUN).mkdir(parents=True)
    source = next(line for line in (run_home / "data" / RUN / "batch_0.jsonl").read_bytes().split(b"\n") if b'"human"' in line)
    damaged = source.replace(b'"from": "human", "value": "', b'"from": "human", "value": "\xff', 1)   # a flipped bit
    assert damaged != source
    (home / "data" / RUN / "batch_0.jsonl").write_bytes(damaged + b"\n")
    result = export_cli(home, "--export=openai", f"--out={tmp_path / 'out.jsonl'}")
    assert "1 unreadable" in result.stdout and "Traceback" not in result.stderr


def test_an_export_during_the_run_leaves_out_the_row_being_written_without_a_word(run_home, tmp_path):
    # The run appends each row with one write, so an export that reads meanwhile may find the start of a
    # row without its newline at the end of a batch file. It is the row still being written, not damage:
    # counted as "unreadable", every export of a running run would report a crash that never happened.
    home = tmp_path / "home"
    (home / "data" / RUN).mkdir(parents=True)
    batch_files = sorted((run_home / "data" / RUN).glob("batch_*.jsonl"))
    for path in batch_files:
        (home / "data" / RUN / path.name).write_bytes(path.read_bytes())
    (tmp_path / "whole").mkdir()
    whole = exported(home, tmp_path / "whole", "sharegpt").read_bytes()
    row = next(line for line in batch_files[-1].read_bytes().splitlines() if b'"conversations"' in line)
    with (home / "data" / RUN / batch_files[-1].name).open("ab") as handle:
        handle.write(row[:len(row) // 2])
    out = tmp_path / "out.jsonl"
    result = export_cli(home, "--export=sharegpt", f"--out={out}")
    assert "unreadable" not in result.stdout
    assert out.read_bytes() == whole


NOT_A_FILE = {"directory": lambda path: path.mkdir(), "fifo": lambda path: os.mkfifo(path),
              "link_to_dev_zero": lambda path: path.symlink_to("/dev/zero"),
              "dangling_link": lambda path: path.symlink_to(path.parent / "gone")}


@pytest.mark.parametrize("command", ["--report", "--export=openai"])
@pytest.mark.parametrize("kind", list(NOT_A_FILE))
def test_a_batch_file_that_is_not_a_regular_file_is_named_in_one_error(run_home, tmp_path, kind, command):
    # A FIFO would block the read for ever, /dev/zero would fill memory, the others gave a traceback.
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    subprocess.run(["cp", "-a", str(run_home / "data" / RUN), str(home / "data" / RUN)], check=True)
    for path in (home / "data" / RUN).glob("report.html"):
        path.unlink()
    NOT_A_FILE[kind](home / "data" / RUN / "batch_7.jsonl")
    out = tmp_path / "out.jsonl"
    result = run_cli(home, f"--run_name={RUN}", command, *([f"--out={out}"] if command != "--report" else []),
                     timeout=30)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: data/{RUN}/batch_7.jsonl is not a regular file: a batch file holds rows. Move it out of data/{RUN}/."]
    assert not (home / "data" / RUN / "report.html").exists() and not list(tmp_path.glob("out*"))


def kill_export_before_its_rename(run_home: Path, tmp_path: Path, module: str, *flags: str) -> None:
    """Run an export until ``module`` renames its first file into place, and kill it there (kill -9)."""
    process = subprocess.Popen(paused_cli_command(module, "os.replace", tmp_path / "go", f"--run_name={RUN}", *flags),
                               cwd=run_home, env=cli_environment(run_home), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        assert process.stdout is not None and "paused at" in process.stdout.readline()
    finally:
        process.kill()
        process.wait()


def test_an_openai_export_renames_its_manifest_into_place_before_its_file(run_home, tmp_path, monkeypatch):
    # A reader that finds the new file finds its manifest already there, never the earlier export's
    # manifest naming other rows line by line.
    from batchrun.export import files

    renamed: list[Path] = []
    replace = os.replace

    def recorded(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        renamed.append(Path(target))
        replace(source, target)

    monkeypatch.setattr(files.os, "replace", recorded)
    out = tmp_path / "out.jsonl"
    export.export_run(export.ExportOptions(format="openai", run_dir=run_home / "data" / RUN, out=out))
    assert renamed == [export.manifest_path(out), out]


def test_an_openai_export_whose_file_cannot_be_renamed_into_place_leaves_the_earlier_file(run_home, tmp_path,
                                                                                         monkeypatch):
    # Whatever stops the export before its file is renamed in, the file at --out is the earlier export,
    # whole: never removed first, never half of the new one.
    from batchrun.export import files

    out = tmp_path / "out.jsonl"
    run_dir = run_home / "data" / RUN
    export.export_run(export.ExportOptions(format="openai", run_dir=run_dir, out=out, min_tool_calls=2))
    earlier = out.read_bytes()
    replace = os.replace
    renames = 0

    def second_fails(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        nonlocal renames
        renames += 1
        if renames == 2:        # the manifest's went first; this is the file's
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(target))
        replace(source, target)

    monkeypatch.setattr(files.os, "replace", second_fails)
    with pytest.raises(OSError):
        export.export_run(export.ExportOptions(format="openai", run_dir=run_dir, out=out))
    assert out.read_bytes() == earlier and len(read_jsonl(out)) == 2    # the earlier export kept two rows
    assert not list(tmp_path.glob("*.tmp"))


def test_an_export_to_a_folder_another_export_is_writing_in_waits_for_it(run_home, tmp_path):
    # Before, the two interleaved: the --best_of export, paused between its renames and its record, wrote
    # its record after the plain export had replaced the file, so the record described rows the file did
    # not hold. Each is whole now, the later one last.
    out = tmp_path / "out.jsonl"
    go = tmp_path / "go"
    first = subprocess.Popen(paused_cli_command("batchrun.export.run", "atomic_write_json", go, f"--run_name={RUN}",
                                                "--export=sharegpt", f"--out={out}", "--best_of=first_completed"),
                             cwd=run_home, env=cli_environment(run_home), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        first_lines = OutputLines(first)
        first_lines.wait_for("paused at")
        second = subprocess.Popen([sys.executable, str(REPO / "batch_runner.py"), f"--run_name={RUN}",
                                   "--export=sharegpt", f"--out={out}"], cwd=run_home, env=cli_environment(run_home),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        second_lines = OutputLines(second)
        second_lines.wait_for("another export is writing in")
        go.touch()
        assert first.wait(60) == 0, first_lines.text()
        assert second.wait(60) == 0, second_lines.text()
    finally:
        go.touch()
        first.wait(60)
    assert not (tmp_path / "out.best_of.json").exists()
    assert out.read_bytes() == exported(run_home, tmp_path / "alone", "sharegpt").read_bytes()


def test_what_an_hf_export_killed_before_its_rename_left_is_removed_by_the_next_one(run_home, tmp_path):
    # Before, its folder (a whole copy and datasets' cache) stayed beside --out for good.
    pytest.importorskip("datasets")
    out = tmp_path / "hf"
    kill_export_before_its_rename(run_home, tmp_path, "batchrun.export.arrow", "--export=hf", f"--out={out}")
    assert [path.is_dir() for path in tmp_path.glob("hf.*.tmp")] == [True]
    export_cli(run_home, "--export=hf", f"--out={out}")
    assert not list(tmp_path.glob("hf.*.tmp")) and (out / "state.json").is_file()


def test_what_an_export_killed_before_its_renames_left_is_removed_by_the_next_one(run_home, tmp_path):
    # Before, each kill -9 of an export left a whole copy of the file and of its manifest beside them for good.
    out = tmp_path / "openai.jsonl"
    kill_export_before_its_rename(run_home, tmp_path, "batchrun.export.files", "--export=openai", f"--out={out}")
    left = sorted(path.name for path in tmp_path.glob("*.tmp"))
    assert len(left) == 2, left                 # the file's and its manifest's
    alive = tmp_path / f"openai.jsonl.{os.getpid()}.0123abcd.tmp"      # another export's, still being written
    alive.write_text("")
    export_cli(run_home, "--export=openai", f"--out={out}")
    assert sorted(path.name for path in tmp_path.glob("*.tmp")) == [alive.name]
    assert out.exists() and (tmp_path / "openai.manifest.jsonl").exists()
