"""The row format: reasoning capture, the tool success rule, the resume content key,
the Hermes ShareGPT rendering, which kind of row a finished session becomes, and the one reader of stored
rows that resume, merge, statistics and the report use."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import threading
import time

import msgspec
import pytest

from batchrun import rows
from batchrun.rows import (
    END_REASONS,
    ROW_FORMAT,
    AssistantTurn,
    EndReason,
    HumanTurn,
    RowError,
    SessionResult,
    ToolCallRecord,
    Usage,
    content_key,
    encode_finished,
    encode_row,
    read_stored_row,
    split_reasoning,
    tool_result_failed,
    trajectory_row,
)
from model_tools import REGISTRY, TOOL_NAMES

EMPTY_THINK = "<think>\n</think>\n"
TIMESTAMP = "2026-01-15T10:30:00"


# --- building sessions and rows -----------------------------------------------------------------------

def call(name: str, arguments: str = "{}", result: str | None = '{"ok": true}', id: str | None = None) -> ToolCallRecord:
    return ToolCallRecord(id=id or f"call_{name}", name=name, arguments=arguments, result=result)


def session(turns: list[AssistantTurn] | None = None, *, end_reason: str = "final_answer", prompt: str = "Do it.",
            offered: list[str] | None = None, prompt_index: int = 0, usage: Usage | None = None,
            error: str | None = None, error_type: str | None = None, api_calls: int | None = None,
            wall_time: float = 1.25) -> SessionResult:
    turns = [AssistantTurn("thinking", "Done.")] if turns is None else turns
    return SessionResult(prompt_index=prompt_index, content_key=content_key(prompt, None, None), prompt=prompt,
                         toolsets=["terminal", "file"],
                         offered_tools=["terminal", "read_file"] if offered is None else offered,
                         turns=turns, api_calls=len(turns) if api_calls is None else api_calls,
                         usage=usage or Usage(), wall_time=wall_time, end_reason=end_reason,
                         error=error, error_type=error_type)


def row_of(result: SessionResult) -> dict:
    return trajectory_row(result, batch_num=4, model="test/model", timestamp=TIMESTAMP)


def encode(result: SessionResult, *, discard_no_reasoning: bool = False) -> bytes:
    return encode_finished(result, batch_num=4, model="test/model", timestamp=TIMESTAMP,
                           discard_no_reasoning=discard_no_reasoning)


def turns_from(row: dict, speaker: str) -> list[dict]:
    return [turn for turn in row["conversations"] if turn["from"] == speaker]


def tagged_payloads(text: str, tag: str) -> list:
    return [json.loads(payload) for payload in re.findall(rf"<{tag}>\n(.*?)\n</{tag}>", text, re.DOTALL)]


# --- split_reasoning --------------------------------------------------------------------------------

@pytest.mark.parametrize("message, reasoning, visible", [
    ({"content": "Answer.", "reasoning": "I thought."}, "I thought.", "Answer."),
    ({"content": "Answer.", "reasoning_content": "I thought."}, "I thought.", "Answer."),
    ({"content": "Answer.", "reasoning": "  ", "reasoning_content": "I thought."}, "I thought.", "Answer."),
    ({"content": "Answer.", "reasoning_details": [{"type": "reasoning.text", "text": "Step one."},
                                                  {"type": "reasoning.text", "text": "Step two."}]},
     "Step one.\nStep two.", "Answer."),
    ({"content": "Answer.", "reasoning_details": [{"type": "reasoning.summary", "summary": "In short."}]},
     "In short.", "Answer."),
    ({"content": "Answer.", "reasoning_details": [{"type": "reasoning.encrypted", "data": "b64=="},
                                                  {"type": "reasoning.text", "text": "Readable."}]},
     "Readable.", "Answer."),
    ({"content": "<think>I thought.</think>Answer."}, "I thought.", "Answer."),
    ({"content": "<think>\nI thought.\n</think>\n\nAnswer."}, "I thought.", "Answer."),
    ({"content": "<REASONING_SCRATCHPAD>I thought.</REASONING_SCRATCHPAD>Answer."}, "I thought.", "Answer."),
    ({"content": "<think>half a thought, then the reply was cut"}, "half a thought, then the reply was cut", ""),
    ({"content": "I thought.", "reasoning": "I thought."}, "I thought.", "I thought."),
    ({"content": "Just an answer."}, "", "Just an answer."),
    ({"content": None}, "", ""),
    ({"content": None, "reasoning": "Only thoughts."}, "Only thoughts.", ""),
    ({}, "", ""),
], ids=["reasoning", "reasoning_content", "blank_reasoning_falls_back_to_reasoning_content",
        "reasoning_details_text", "reasoning_details_summary", "reasoning_details_skips_encrypted",
        "think_tag", "think_tag_with_newlines", "reasoning_scratchpad_tag", "unclosed_think_of_truncated_reply",
        "content_equal_to_reasoning_is_kept", "no_reasoning", "content_none", "content_none_with_reasoning",
        "empty_message"])
def test_split_reasoning_reads_every_form_endpoints_use(message, reasoning, visible):
    assert split_reasoning(message) == (reasoning, visible)


@pytest.mark.parametrize("message", [
    {"content": "Answer.", "reasoning": " \n\t "},
    {"content": "Answer.", "reasoning_content": "\n"},
    {"content": "Answer.", "reasoning_details": [{"type": "reasoning.text", "text": "  "}]},
    {"content": "Answer.", "reasoning_details": [{"type": "reasoning.summary", "summary": "\n\n"}]},
    {"content": "<think>  \n </think>Answer."},
    {"content": "<REASONING_SCRATCHPAD>\n</REASONING_SCRATCHPAD>Answer."},
], ids=["reasoning", "reasoning_content", "details_text", "details_summary", "think_tag", "scratchpad_tag"])
def test_split_reasoning_counts_whitespace_only_reasoning_as_none(message):
    assert split_reasoning(message) == ("", "Answer.")


def test_split_reasoning_takes_an_inline_think_block_out_of_the_visible_text_wherever_it_sits():
    reasoning, visible = split_reasoning({"content": "Before. <think>hidden</think> After."})
    assert reasoning == "hidden"
    assert "hidden" not in visible and "<think>" not in visible and "</think>" not in visible
    assert visible.startswith("Before.") and visible.endswith("After.")


def test_split_reasoning_does_not_repeat_an_inline_block_that_the_structured_field_already_gave():
    assert split_reasoning({"reasoning": "Same.", "content": "<think>Same.</think>Answer."}) == ("Same.", "Answer.")


def test_split_reasoning_keeps_both_structured_and_different_inline_reasoning():
    reasoning, visible = split_reasoning({"reasoning": "Structured.", "content": "<think>Inline.</think>Answer."})
    assert "Structured." in reasoning and "Inline." in reasoning
    assert visible == "Answer."


# Texts an endpoint can send that each cost the old think-block regex a scan to the end from every tag
# (opens never closed), or a full pass per block taken out (blocks nested by the tags their removal forms).
ADVERSARIAL_THINK_TAGS = {
    "opens_never_closed": "<think>" * 40_000,
    "scratchpad_opens_never_closed": "<REASONING_SCRATCHPAD>" * 15_000,
    "blocks_forming_blocks": "<thi" * 20_000 + "<think></think>" + "nk>x</think>" * 20_000,
    "many_different_blocks": "".join(f"<think>{n}</think>" for n in range(100_000)),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("content", ADVERSARIAL_THINK_TAGS.values(), ids=ADVERSARIAL_THINK_TAGS.keys())
def test_split_reasoning_takes_time_in_proportion_to_the_text_whatever_tags_it_holds(content):
    # Before: 280 KB of "<think>" took minutes (112 KB: 19 s, 1.5 MB: more than 8 minutes), all of it
    # on the worker's event loop, where every other session of the worker and the prompt time limit wait.
    started = time.monotonic()
    split_reasoning({"content": content + "Answer."})
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("content, reasoning, visible", [
    ("<think>a</think>b<think>c</think>d", "a\n\nc", "bd"),
    ("<think>a<think>b</think>c</think>", "a<think>b", "c</think>"),
    ("<THINK>a</think>b", "a", "b"),
    ("</think>a<think>b</think>", "b", "</think>a"),
    ("<think>a</REASONING_SCRATCHPAD>b", "a</REASONING_SCRATCHPAD>b", ""),
    ("<th<thi<think></think>nk></think>ink>c</think>d", "c", "d"),
    ("x<th<think>a</think>ink>b", "a", "x<think>b"),
    ("<think>a<REASONING_SCRATCHPAD>b</think>c</REASONING_SCRATCHPAD>d", "a<REASONING_SCRATCHPAD>b",
     "c</REASONING_SCRATCHPAD>d"),
    ("<think>a</think><think>a</think>b", "a", "b"),
], ids=["two_blocks", "nested_same_tag", "case_differs", "stray_close_first", "unclosed_with_other_close",
        "blocks_forming_blocks_twice", "an_open_tag_formed_after_a_block_is_not_an_unclosed_block",
        "a_block_holding_an_open_tag_of_the_other_kind", "a_repeated_block_is_kept_once"])
def test_split_reasoning_takes_out_every_think_block_even_those_taking_another_out_forms(content, reasoning, visible):
    assert split_reasoning({"content": content}) == (reasoning, visible)


# --- the success rule ---------------------------------------------------------------------

@pytest.mark.parametrize("result, failed", [
    ('{"error": "file not found"}', True),
    ('{"error": ""}', True),
    ('{"error": null, "output": "fine"}', False),
    ('{"success": false}', True),
    ('{"success": true}', False),
    ('{"content": {"error": "nested failure"}}', True),
    ('{"content": {"error": null}}', False),
    ('{"content": "text that mentions an error"}', False),
    ('{"exit_code": 2, "error": null}', False),
    ('{"exit_code": 1, "output": "grep found nothing"}', False),
    ("", True),
    ("   \n", True),
    ("Error: x", True),
    ("error: x", True),
    ("ERROR: x", True),
    ("  Error: leading spaces", True),
    ("Some output text", False),
    ("An Error: in the middle is fine", False),
    ("Errors: none", False),
    ("[1, 2, 3]", False),
    ('[{"error": "inside a list"}]', False),
    ("42", False),
], ids=lambda value: repr(value) if isinstance(value, str) else str(value))
def test_tool_result_success_rule(result, failed):
    assert tool_result_failed(result) is failed


# --- the resume content key -------------------------------------------------------------------------

def test_content_key_is_stable_for_the_same_prompt_image_and_cwd():
    assert content_key("Write a function", "python:3.11", "/src") == content_key("Write a function", "python:3.11", "/src")


def test_content_key_is_32_lowercase_hex_characters():
    assert re.fullmatch(r"[0-9a-f]{32}", content_key("Write a function", None, None))


@pytest.mark.parametrize("other", [
    ("Write a function!", "python:3.11", "/src"),
    ("Write a function", "python:3.12", "/src"),
    ("Write a function", "python:3.11", "/src2"),
    ("Write a function", None, "/src"),
    ("Write a function", "python:3.11", None),
    ("Write a function", "/src", "python:3.11"),
], ids=["prompt", "image", "cwd", "no_image", "no_cwd", "image_and_cwd_swapped"])
def test_content_key_differs_when_prompt_image_or_cwd_differs(other):
    assert content_key(*other) != content_key("Write a function", "python:3.11", "/src")


def test_content_key_tells_no_image_from_an_empty_image():
    assert content_key("p", None, None) != content_key("p", "", None)


@pytest.mark.parametrize("prompt", ["ünïcødé 中文 🙂", "lone \udc80 surrogate", "\ud800", "\x00 nul"],
                         ids=["non_ascii", "lone_low_surrogate", "lone_high_surrogate", "nul"])
def test_content_key_handles_any_text_without_raising(prompt):
    key = content_key(prompt, prompt, prompt)
    assert re.fullmatch(r"[0-9a-f]{32}", key)
    assert key == content_key(prompt, prompt, prompt)


def test_content_key_tells_different_lone_surrogates_apart():
    assert content_key("\udc80", None, None) != content_key("\udc81", None, None)


# --- rendering: the system and human turns ----------------------------------------------------------

def offered_signatures(system_value: str) -> list[dict]:
    match = re.search(r"<tools>\n(.*)\n</tools>", system_value, re.DOTALL)
    assert match, "the system turn has no <tools></tools> block"
    return json.loads(match.group(1))


@pytest.mark.parametrize("offered", [["terminal", "read_file"], ["web_search"], list(TOOL_NAMES), []],
                         ids=["two", "one", "all", "none"])
def test_system_turn_lists_exactly_the_offered_tools_inside_tools_tags(offered):
    system = row_of(session(offered=offered))["conversations"][0]
    assert system["from"] == "system"
    assert offered_signatures(system["value"]) == [
        {"name": name, "description": REGISTRY[name].description, "parameters": REGISTRY[name].parameters,
         "required": None} for name in offered]


def test_system_turn_explains_the_tool_call_and_tool_response_format():
    value = row_of(session())["conversations"][0]["value"]
    for words in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "'name'", "'arguments'"):
        assert words in value


def test_human_turn_is_the_prompt_and_follows_the_system_turn():
    conversations = row_of(session(prompt="Write a function\nthat adds."))["conversations"]
    assert [turn["from"] for turn in conversations[:2]] == ["system", "human"]
    assert conversations[1]["value"] == "Write a function\nthat adds."


# --- rendering: gpt turns -----------------------------------------------------------------------------

@pytest.mark.parametrize("turn, value", [
    (AssistantTurn("I thought.", "Here it is."), "<think>\nI thought.\n</think>\nHere it is."),
    (AssistantTurn("", "Here it is."), "<think>\n</think>\nHere it is."),
    (AssistantTurn("", ""), "<think>\n</think>"),
    (AssistantTurn("I thought.", ""), "<think>\nI thought.\n</think>"),
    (AssistantTurn("", "Use <think> tags."), "Use <think> tags."),
    (AssistantTurn("I thought.", "I'll look.", [call("terminal", '{"command": "ls"}', id="call_1")]),
     '<think>\nI thought.\n</think>\nI\'ll look.\n<tool_call>\n{"name": "terminal", "arguments": {"command": "ls"}}\n</tool_call>'),
    (AssistantTurn("I thought.", "", [call("terminal", '{"command": "ls"}', id="call_1")]),
     '<think>\nI thought.\n</think>\n<tool_call>\n{"name": "terminal", "arguments": {"command": "ls"}}\n</tool_call>'),
    (AssistantTurn("", "", [call("terminal", '{"command": "ls"}', id="call_1"),
                            call("read_file", '{"path": "a.txt"}', id="call_2")]),
     '<think>\n</think>\n<tool_call>\n{"name": "terminal", "arguments": {"command": "ls"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>'),
], ids=["reasoning_and_text", "empty_think_block_without_reasoning", "nothing_at_all_ends_without_a_newline",
        "reasoning_only_ends_without_a_newline", "text_holding_a_think_tag_gets_no_empty_block", "text_and_call",
        "call_without_text_has_no_blank_line", "two_calls"])
def test_gpt_turn_is_think_block_then_text_then_one_tool_call_block_per_call(turn, value):
    assert turns_from(row_of(session([turn])), "gpt")[0]["value"] == value


def test_every_turn_has_exactly_the_keys_from_and_value():
    turns = [AssistantTurn("r", "", [call("terminal", id="c1")]), HumanTurn("Go on."), AssistantTurn("", "Final.")]
    assert all(list(turn) == ["from", "value"] for turn in row_of(session(turns))["conversations"])


def test_a_message_the_runner_sent_mid_session_is_a_human_turn_where_it_was_sent():
    turns = [AssistantTurn("r", "The first half"), HumanTurn("Continue."), AssistantTurn("", "the second half.")]
    conversations = row_of(session(turns))["conversations"]
    assert [(turn["from"], turn["value"]) for turn in conversations[2:]] == [
        ("gpt", "<think>\nr\n</think>\nThe first half"), ("human", "Continue."),
        ("gpt", "<think>\n</think>\nthe second half.")]


def test_tool_call_block_carries_valid_arguments_as_a_json_object():
    gpt = turns_from(row_of(session([AssistantTurn("", "", [call("terminal", '{ "command" : "ls" }')])])), "gpt")[0]
    assert tagged_payloads(gpt["value"], "tool_call") == [{"name": "terminal", "arguments": {"command": "ls"}}]


@pytest.mark.parametrize("arguments", ['{"command": "ls"', "ls -la", ""], ids=["truncated_json", "not_json", "empty"])
def test_tool_call_block_carries_invalid_arguments_as_the_raw_string(arguments):
    gpt = turns_from(row_of(session([AssistantTurn("", "", [call("terminal", arguments)])])), "gpt")[0]
    assert tagged_payloads(gpt["value"], "tool_call") == [{"name": "terminal", "arguments": arguments}]


def test_a_call_block_an_earlier_version_wrote_with_nan_still_reads_back():
    # Earlier versions wrote a model's NaN into the block as it was: their rows must still read.
    rest = 'Let me look.\n<tool_call>\n{"name": "terminal", "arguments": {"timeout": NaN}}\n</tool_call>'
    text, [call_read] = rows.split_rendered_calls(rest)
    assert text == "Let me look." and math.isnan(call_read["arguments"]["timeout"])


def strict_json(text: str) -> object:
    """JSON as strict parsers (JavaScript's JSON.parse, most others) read it: no NaN or Infinity."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("arguments", ['{"timeout": NaN}', '{"timeout": -Infinity}', '{"timeout": 1e400}'])
def test_arguments_with_numbers_json_cannot_hold_stay_the_text_the_model_wrote(arguments):
    gpt = turns_from(row_of(session([AssistantTurn("", "", [call("terminal", arguments)])])), "gpt")[0]
    [payload] = [strict_json(line) for line in re.findall(r"<tool_call>\n(.*)\n</tool_call>", gpt["value"])]
    assert payload == {"name": "terminal", "arguments": arguments}


# --- rendering: tool turns -----------------------------------------------------------------------------

def test_each_gpt_turn_with_calls_is_followed_by_exactly_one_tool_turn():
    turns = [AssistantTurn("a", "", [call("terminal", id="c1"), call("read_file", id="c2")]),
             AssistantTurn("b", "", [call("terminal", id="c3")]),
             AssistantTurn("c", "Done.")]
    speakers = [turn["from"] for turn in row_of(session(turns))["conversations"]]
    assert speakers == ["system", "human", "gpt", "tool", "gpt", "tool", "gpt"]


def test_tool_turn_has_one_response_block_per_call_in_call_order_named_by_call_id():
    calls = [call("read_file", result='{"content": "a"}', id="call_b"),
             call("terminal", result='{"output": "b", "exit_code": 0}', id="call_a"),
             call("read_file", result='{"content": "c"}', id="call_c")]
    tool = turns_from(row_of(session([AssistantTurn("", "", calls)])), "tool")[0]
    assert [(block["tool_call_id"], block["name"]) for block in tagged_payloads(tool["value"], "tool_response")] == \
        [("call_b", "read_file"), ("call_a", "terminal"), ("call_c", "read_file")]


@pytest.mark.parametrize("result, content", [
    ('{"output": "hi", "exit_code": 0}', {"output": "hi", "exit_code": 0}),
    ("[1, 2]", [1, 2]),
    ("7", "7"),
    ('"quoted"', '"quoted"'),
    ("  {\"padded\": true}  ", {"padded": True}),
    ("{not json", "{not json"),
    ("plain text output", "plain text output"),
    ("Error: boom", "Error: boom"),
    ("", ""),
], ids=["json_object", "json_array", "json_number_stays_text", "json_string_stays_text", "padded_object",
        "broken_object", "text", "error_text", "empty"])
def test_tool_response_content_is_parsed_when_the_result_is_a_json_object_or_array_else_the_text(result, content):
    tool = turns_from(row_of(session([AssistantTurn("", "", [call("terminal", result=result, id="c1")])])), "tool")[0]
    assert tagged_payloads(tool["value"], "tool_response") == [{"tool_call_id": "c1", "name": "terminal", "content": content}]


def test_a_call_that_never_got_a_result_gets_no_tool_response():
    calls = [call("terminal", id="answered"), call("read_file", result=None, id="interrupted")]
    row = row_of(session([AssistantTurn("", "", calls)], end_reason="prompt_timeout"))
    assert [c["name"] for c in tagged_payloads(turns_from(row, "gpt")[0]["value"], "tool_call")] == \
        ["terminal", "read_file"]
    assert [b["tool_call_id"] for b in tagged_payloads(turns_from(row, "tool")[0]["value"], "tool_response")] == ["answered"]


# --- rendering: tool statistics, status and usage ------------------------------------------------------

def test_tool_stats_and_error_counts_cover_every_registry_tool_with_zero_defaults():
    row = row_of(session([AssistantTurn("r", "No tools needed.")]))
    assert row["tool_stats"] == {name: {"count": 0, "success": 0, "failure": 0} for name in TOOL_NAMES}
    assert row["tool_error_counts"] == {name: 0 for name in TOOL_NAMES}


def test_tool_stats_count_successes_and_failures_by_the_success_rule():
    calls = [call("terminal", result='{"exit_code": 2, "error": null}', id="1"),
             call("terminal", result='{"error": "timed out"}', id="2"),
             call("terminal", result="Error: x", id="3"),
             call("read_file", result="file text", id="4")]
    row = row_of(session([AssistantTurn("", "", calls[:2]), AssistantTurn("", "", calls[2:])]))
    assert row["tool_stats"]["terminal"] == {"count": 3, "success": 1, "failure": 2}
    assert row["tool_stats"]["read_file"] == {"count": 1, "success": 1, "failure": 0}
    assert row["tool_error_counts"]["terminal"] == 2 and row["tool_error_counts"]["read_file"] == 0
    assert all(row["tool_stats"][name]["count"] == 0 for name in TOOL_NAMES if name not in ("terminal", "read_file"))


def test_an_invented_tool_gets_no_tool_stats_column():
    row = row_of(session([AssistantTurn("", "", [call("evil_tool", result='{"error": "unknown tool"}')])],
                         end_reason="invented_tools"))
    assert set(row["tool_stats"]) == set(TOOL_NAMES)
    assert set(row["tool_error_counts"]) == set(TOOL_NAMES)
    assert row["invented_tool_calls"] == 1


def test_a_registry_tool_the_prompt_was_not_offered_is_invented_and_not_booked_to_that_tool():
    calls = [call("web_search", result='{"error": "unknown tool"}', id="c1"), call("terminal", id="c2")]
    row = row_of(session([AssistantTurn("", "", calls)], offered=["terminal"]))
    assert row["invented_tool_calls"] == 1
    assert row["tool_stats"]["web_search"] == {"count": 0, "success": 0, "failure": 0}
    assert row["tool_stats"]["terminal"]["count"] == 1
    assert read_stored_row(encode(session([AssistantTurn("", "", calls)], offered=["terminal"]))).invented_tools() \
        == ["web_search"]


def test_toolsets_used_names_only_the_sampled_toolsets_that_gave_the_model_a_tool():
    row = row_of(session(offered=["terminal"]))
    assert (row["toolsets_used"], row["toolsets_sampled"]) == (["terminal"], ["terminal", "file"])


@pytest.mark.parametrize("end_reason, completed", [
    ("final_answer", True), ("max_turns", False), ("invented_tools", False), ("truncated", False),
    ("prompt_timeout", False)])
def test_completed_and_partial_follow_the_end_reason(end_reason, completed):
    row = row_of(session(end_reason=end_reason))
    assert (row["completed"], row["partial"], row["end_reason"]) == (completed, not completed, end_reason)


@pytest.mark.parametrize("end_reason", list(EndReason))
def test_a_row_is_the_same_bytes_whether_its_end_reason_is_the_enum_or_its_string(end_reason):
    turns = [AssistantTurn("", "", [call("terminal")]), AssistantTurn("", "Done.")]
    for discard_no_reasoning in (False, True):
        as_enum = encode(session(turns, end_reason=end_reason, error_type=end_reason),
                         discard_no_reasoning=discard_no_reasoning)
        as_text = encode(session(turns, end_reason=str.__str__(end_reason), error_type=str.__str__(end_reason)),
                         discard_no_reasoning=discard_no_reasoning)
        assert as_enum == as_text
    assert msgspec.json.encode(end_reason) == json.dumps(end_reason).encode() == json.dumps(end_reason.value).encode()
    assert set(END_REASONS) == set(EndReason)


def test_a_row_read_back_keeps_its_end_reason_as_a_plain_string():
    stored = read_stored_row(encode(session(end_reason=EndReason.MAX_TURNS)))
    assert type(stored.end_reason()) is str and stored.end_reason() == "max_turns"


def test_usage_reports_tokens_and_cost_under_fixed_keys():
    usage = Usage(prompt_tokens=100, completion_tokens=20, reasoning_tokens=5, cached_tokens=50, cost=0.0012)
    assert row_of(session(usage=usage))["usage"] == {"prompt_tokens": 100, "completion_tokens": 20,
                                                     "reasoning_tokens": 5, "cached_tokens": 50, "cost": 0.0012}


def test_trajectory_rows_have_the_same_keys_whatever_happened():
    quiet = row_of(session([AssistantTurn("", "Done.")]))
    busy = row_of(session([AssistantTurn("r", "", [call("terminal"), call("evil_tool")])] * 3, end_reason="max_turns",
                          usage=Usage(1, 2, 3, 4, 0.5)))
    assert list(quiet) == list(busy)
    for key in ("prompt_index", "content_key", "conversations", "metadata", "completed", "partial", "api_calls",
                "toolsets_used", "toolsets_sampled", "tool_stats", "tool_error_counts", "invented_tool_calls", "usage",
                "wall_time_seconds", "end_reason"):
        assert key in quiet


def test_trajectory_row_records_batch_model_timestamp_and_calls():
    row = row_of(session(api_calls=3, prompt_index=42))
    assert row["metadata"] == {"batch_num": 4, "timestamp": TIMESTAMP, "model": "test/model"}
    assert (row["prompt_index"], row["api_calls"], row["toolsets_used"]) == (42, 3, ["terminal", "file"])


# --- which kind of row a finished session becomes ---------------------------------------------------------

@pytest.mark.parametrize("discard_no_reasoning", [True, False])
def test_a_session_that_ended_in_error_becomes_a_failure_row(discard_no_reasoning):
    result = session([AssistantTurn("r", "", [call("terminal")])], end_reason="error", prompt="P",
                     error="HTTP 401: bad key", error_type="auth")
    row = json.loads(encode(result, discard_no_reasoning=discard_no_reasoning))
    assert row["failed"] is True
    assert (row["error"], row["error_type"], row["prompt"], row["end_reason"]) == ("HTTP 401: bad key", "auth", "P", "error")
    assert (row["prompt_index"], row["content_key"]) == (result.prompt_index, result.content_key)
    assert "conversations" not in row


def test_a_session_without_any_reasoning_becomes_a_tombstone_when_the_filter_is_on():
    result = session([AssistantTurn("", "", [call("terminal")]), AssistantTurn("", "Done.")], prompt="P")
    row = json.loads(encode(result, discard_no_reasoning=True))
    assert row["discarded"] == "no_reasoning"
    assert (row["prompt_index"], row["content_key"]) == (result.prompt_index, result.content_key)


def test_a_tombstone_keeps_the_whole_trajectory_so_the_discard_can_be_inspected_and_filtered_again():
    result = session([AssistantTurn("", "", [call("terminal")]), AssistantTurn("", "Done.")], prompt="P",
                     usage=Usage(10, 5), end_reason="final_answer")
    row = json.loads(encode(result, discard_no_reasoning=True))
    assert {key: value for key, value in row.items() if key not in ("discarded", "prompt")} == row_of(result)
    assert row["prompt"] == "P"
    assert read_stored_row(encode(result, discard_no_reasoning=True)).reasoning_counts() == (0, 2)


def test_one_turn_with_reasoning_is_enough_to_keep_the_trajectory_when_the_filter_is_on():
    result = session([AssistantTurn("", "", [call("terminal")]), AssistantTurn("thought", "Done.")])
    assert json.loads(encode(result, discard_no_reasoning=True)) == row_of(result)


def test_a_session_without_reasoning_keeps_its_trajectory_when_the_filter_is_off():
    result = session([AssistantTurn("", "Done.")])
    row = json.loads(encode(result, discard_no_reasoning=False))
    assert row == row_of(result)
    assert turns_from(row, "gpt")[0]["value"].startswith(EMPTY_THINK)


SURROGATE_PLACES = {
    "tool_result": lambda s: session([AssistantTurn("r", "", [call("terminal", result=s)])]),
    "json_tool_result": lambda s: session([AssistantTurn("r", "", [call("terminal", result='{"output": "\\udc80"}')])]),
    "prompt": lambda s: session(prompt=s),
    "reply": lambda s: session([AssistantTurn("r", s)]),
    "reasoning": lambda s: session([AssistantTurn(s, "Done.")]),
    "tool_name": lambda s: session([AssistantTurn("r", "", [call(s)])]),
    "arguments": lambda s: session([AssistantTurn("r", "", [call("terminal", arguments=s)])]),
    "error": lambda s: session(end_reason="error", error=s, error_type="x"),
    "tombstone_prompt": lambda s: session([AssistantTurn("", "Done.")], prompt=s),
}


@pytest.mark.parametrize("place", SURROGATE_PLACES)
def test_encoded_row_is_one_valid_utf8_line_even_with_a_lone_surrogate(place):
    line = encode(SURROGATE_PLACES[place]("bad \udc80 byte"), discard_no_reasoning=True)
    text = line.decode("utf-8")          # strict: raises on anything that is not valid UTF-8
    assert text.endswith("\n") and text.count("\n") == 1
    assert isinstance(json.loads(text), dict)
    assert read_stored_row(line) is not None


def test_encoded_row_keeps_non_ascii_text_as_utf8():
    line = encode(session(prompt="ünïcødé 中文 🙂"))
    assert "ünïcødé 中文 🙂".encode() in line
    assert json.loads(line)["conversations"][1]["value"] == "ünïcødé 中文 🙂"


# --- the reader against a full parse ---------------------------------------------------------------------

def facts_read(line: bytes) -> dict:
    stored = read_stored_row(line)
    assert stored is not None, f"a complete row was not recognised: {line[:200]!r}"
    return {"status": stored.status, "prompt_index": stored.prompt_index, "content_key": stored.content_key,
            "invented_tools": stored.invented_tools(), "usage": stored.usage(), "end_reason": stored.end_reason(),
            "tool_counts": stored.tool_counts(), "reasoning_counts": stored.reasoning_counts(),
            "toolsets_used": stored.toolsets_used(), "metadata": stored.metadata(), "wall_time": stored.wall_time(),
            "error_type": stored.error_type(), "discard_reason": stored.discard_reason()}


def facts_from_parsed_row(line: bytes) -> dict:
    """The same facts, from json.loads of the whole line: the reference the reader must equal."""
    row = json.loads(line)
    if row.get("failed") is True:
        status = "failed"
    elif "discarded" in row:
        status = "discarded"
    else:
        status = "completed" if row["completed"] else "partial"
    conversations = row.get("conversations", [])
    gpt_turns = [turn for turn in conversations if turn["from"] == "gpt"]
    if not gpt_turns and "conversations" in row:
        status = "failed"                   # no reply was kept: nothing to train on, run again
    invented: list[str] = []
    if row.get("invented_tool_calls"):
        offered = [tool["name"] for tool in offered_signatures(conversations[0]["value"])]
        for turn, layout in zip(gpt_turns, row["gpt_turns"], strict=True):
            payloads = re.findall(r"<tool_call>\n(.*)\n</tool_call>", turn["value"])   # one JSON line each
            for payload in payloads[len(payloads) - layout["tool_calls"]:]:   # the calls come last
                name = json.loads(payload)["name"]
                if name not in offered and name not in invented:
                    invented.append(name)
    with_reasoning = sum(layout["reasoning_chars"] > 0 for layout in row.get("gpt_turns", ()))
    return {"status": status, "prompt_index": row["prompt_index"], "content_key": row["content_key"],
            "invented_tools": invented, "usage": row["usage"], "end_reason": row["end_reason"],
            "tool_counts": [(name, s["count"], s["success"], s["failure"])
                            for name, s in row.get("tool_stats", {}).items() if s["count"] > 0],
            "reasoning_counts": (with_reasoning, len(gpt_turns) - with_reasoning),
            "toolsets_used": row.get("toolsets_used", []),
            "metadata": (row["metadata"]["timestamp"], row["metadata"]["model"]) if "metadata" in row else None,
            "wall_time": row["wall_time_seconds"],
            "error_type": row["end_reason"] if status == "failed" and not row.get("failed") else row.get("error_type"),
            "discard_reason": row.get("discarded")}


LOOKALIKES = [
    '{"id": "x", "name": "evil_tool", "arguments": "{}"}',
    '"tool_calls": [{"id": "x", "name": "evil_tool", "arguments": "{}"}]',
    '"completed": true',
    '"completed": false',
    '"end_reason": "final_answer"}',
    '"end_reason": "final_answer"}\n',
    '"tool_stats": {',
    '"tool_stats": {"terminal": {"count": 9, "success": 0, "failure": 9}}, "tool_error_counts": {',
    '{"count": 5, "success": 5, "failure": 0}',
    '"usage": {"prompt_tokens": 999}',
    '{"from": "gpt", "value": "<think>\n\n</think>\n',
    '{"from": "gpt", "value": "<think>\nfake\n</think>\n',
    '{"prompt_index": 7, "content_key": "abc", "conversations": [',
    '"discarded": "no_reasoning"',
    '"failed": true',
]
AWKWARD = ['"', "\\", '\\"', '"\\', "\n", "\r\n", "\t", "\x00", "ünïcødé", "中文", "🙂👍🏽", "\u2028", "\udc80",
           "<think>", "</think>", "<tool_call>", "</tool_response>", "Error: nope", " ", "plain words"]
INVENTED_NAMES = ["evil_tool", 'ev"il', "back\\slash", "ünïcode_tool", "工具", "🔧", "", 'x", "name": "terminal',
                  '"arguments": "{}"}', "name\udc80", "tab\there"]


def adversarial_text(rng: random.Random, pieces: int = 4) -> str:
    return "".join(rng.choice(LOOKALIKES + AWKWARD) for _ in range(rng.randint(0, pieces)))


def random_result(rng: random.Random, prompt_index: int) -> SessionResult:
    offered = rng.sample(TOOL_NAMES, rng.randint(0, 4))
    turns = []
    for _ in range(rng.randint(0, 5)):
        calls = []
        for position in range(rng.choice([0, 0, 1, 2, 3, 12])):
            name = rng.choice(list(TOOL_NAMES) + INVENTED_NAMES)
            arguments = rng.choice(['{"command": "ls"}', '{"command": ', json.dumps({"text": adversarial_text(rng)}),
                                    adversarial_text(rng)])
            result = rng.choice([None, '{"error": "x"}', '{"error": null}', '{"success": false}', "Error: x", "",
                                 json.dumps({"output": adversarial_text(rng)}, ensure_ascii=False),
                                 adversarial_text(rng)])
            calls.append(ToolCallRecord(id=rng.choice([f"call_{position}", adversarial_text(rng, 2)]),
                                        name=name, arguments=arguments, result=result))
        reasoning = rng.choice(["", "", adversarial_text(rng).strip()])
        turns.append(AssistantTurn(reasoning=reasoning, content=adversarial_text(rng), tool_calls=calls))
    prompt = adversarial_text(rng, 6)
    end_reason = rng.choice(["final_answer", "final_answer", "max_turns", "invented_tools", "truncated",
                             "prompt_timeout", "error"])
    return SessionResult(prompt_index=prompt_index, content_key=content_key(prompt, None, None), prompt=prompt,
                         toolsets=["terminal"], offered_tools=offered, turns=turns, api_calls=len(turns),
                         usage=Usage(rng.randint(0, 10**6), rng.randint(0, 10**5), rng.randint(0, 10**4),
                                     rng.randint(0, 10**5), rng.choice([0.0, 1e-05, 0.123456789, 3.5])),
                         wall_time=rng.random() * 100, end_reason=end_reason,
                         error=adversarial_text(rng) if end_reason == "error" else None,
                         error_type="http" if end_reason == "error" else None)


def test_reader_agrees_with_a_full_parse_on_200_generated_adversarial_rows():
    rng = random.Random(20260115)
    seen_statuses, seen_invented = set(), 0
    for prompt_index in range(200):
        line = encode(random_result(rng, prompt_index), discard_no_reasoning=rng.random() < 0.5)
        assert facts_read(line) == facts_from_parsed_row(line), line
        seen_statuses.add(read_stored_row(line).status)
        seen_invented += bool(read_stored_row(line).invented_tools())
    assert seen_statuses == {"completed", "partial", "discarded", "failed"}   # the generator covers every kind
    assert seen_invented > 20


ADVERSARIAL_TEXT = "".join(LOOKALIKES) + "".join(AWKWARD)


@pytest.mark.parametrize("place", ["prompt", "reply", "reasoning", "tool_result", "arguments", "call_id"])
def test_text_that_looks_like_row_structure_does_not_fool_the_reader(place):
    text = ADVERSARIAL_TEXT
    turn = AssistantTurn(reasoning=text.strip() if place == "reasoning" else "",
                         content=text if place == "reply" else "Looking.",
                         tool_calls=[call("terminal", arguments=text if place == "arguments" else '{"command": "ls"}',
                                          result=text if place == "tool_result" else '{"output": "ok"}',
                                          id=text if place == "call_id" else "call_1")])
    line = encode(session([turn], end_reason="max_turns", prompt=text if place == "prompt" else "P", offered=["terminal"]))
    facts = facts_read(line)
    assert facts == facts_from_parsed_row(line)
    assert (facts["status"], facts["invented_tools"], facts["end_reason"]) == ("partial", [], "max_turns")
    assert facts["reasoning_counts"] == ((1, 0) if place == "reasoning" else (0, 1))
    assert [name for name, *_ in facts["tool_counts"]] == ["terminal"]


@pytest.mark.parametrize("place", ["prompt", "error"])
def test_text_that_looks_like_row_structure_does_not_fool_the_reader_of_a_failure_row(place):
    line = encode(session(end_reason="error", prompt=ADVERSARIAL_TEXT if place == "prompt" else "P",
                          error=ADVERSARIAL_TEXT if place == "error" else "boom", error_type="http"))
    facts = facts_read(line)
    assert facts == facts_from_parsed_row(line)
    assert (facts["status"], facts["end_reason"], facts["invented_tools"]) == ("failed", "error", [])


def test_text_that_looks_like_row_structure_does_not_fool_the_reader_of_a_tombstone():
    line = encode(session([AssistantTurn("", ADVERSARIAL_TEXT)], prompt=ADVERSARIAL_TEXT), discard_no_reasoning=True)
    facts = facts_read(line)
    assert facts == facts_from_parsed_row(line)
    assert (facts["status"], facts["end_reason"]) == ("discarded", "final_answer")


def test_reader_lists_invented_tools_once_each_in_order_of_first_call():
    names = ["terminal", "evil", 'q"uote', "evil", "ünï", "read_file", "🔧", 'q"uote', "back\\slash"]
    calls = [call(name, id=f"c{i}") for i, name in enumerate(names)]
    line = encode(session([AssistantTurn("r", "", calls[:4]), AssistantTurn("r", "", calls[4:])],
                          end_reason="invented_tools"))
    assert read_stored_row(line).invented_tools() == ["evil", 'q"uote', "ünï", "🔧", "back\\slash"]
    assert facts_read(line) == facts_from_parsed_row(line)


def test_reader_finds_an_invented_tool_among_many_calls_in_one_turn():
    calls = [call("terminal", arguments=json.dumps({"command": f"echo {i} \"q\" \\"}), id=f"c{i}") for i in range(60)]
    calls.insert(47, call("hallucinated_tool", id="c_bad"))
    line = encode(session([AssistantTurn("r", "Many.", calls)], end_reason="max_turns"))
    assert read_stored_row(line).invented_tools() == ["hallucinated_tool"]
    assert facts_read(line) == facts_from_parsed_row(line)


def test_reader_finds_no_invented_tool_in_a_row_that_only_calls_offered_tools():
    line = encode(session([AssistantTurn("r", "", [call(name, id=name) for name in TOOL_NAMES])],
                          offered=list(TOOL_NAMES)))
    assert read_stored_row(line).invented_tools() == []


@pytest.mark.parametrize("result, status", [
    (session(end_reason="final_answer"), "completed"),
    (session(end_reason="max_turns"), "partial"),
    (session(end_reason="error", error="boom", error_type="http"), "failed"),
    (session([AssistantTurn("", "Done.")]), "discarded"),
], ids=["completed", "partial", "failed", "discarded"])
def test_reader_classifies_every_kind_of_row(result, status):
    line = encode(result, discard_no_reasoning=True)
    stored = read_stored_row(line)
    assert (stored.status, stored.prompt_index, stored.content_key) == (status, result.prompt_index, result.content_key)


# --- rows in any JSON encoding, of any version ------------------------------------------------------------

CUT_ROWS = {
    "trajectory": session([AssistantTurn("thought ünï 🙂", 'Reply "quoted" \\ done', [
                              call("terminal", '{"command": "echo \\"hi\\""}', result='{"output": "hi\\n"}', id="c1"),
                              call("evil_tool", "{}", result='{"error": "unknown tool"}', id="c2")]),
                           AssistantTurn("", "Final 中文.")], prompt="Prompt with \"quotes\" and ünïcødé",
                          usage=Usage(10, 20, 3, 4, 0.01)),
    "tombstone": session([AssistantTurn("", "No thoughts.")], prompt="Tombstone 🙂 in /tmp"),
    "failure": session(end_reason="error", prompt="Failed ünï", error='HTTP 400: "bad" request to /v1',
                       error_type="http"),
}


def reencoded(row: dict) -> dict[str, bytes]:
    """The same row as other JSON encoders (or a person editing the file) might write it."""
    reversed_keys = dict(reversed(list(row.items())))
    return {
        "compact_separators": json.dumps(row, ensure_ascii=False, separators=(",", ":")).encode() + b"\n",
        "sorted_keys": json.dumps(row, ensure_ascii=False, sort_keys=True).encode() + b"\n",
        "ascii_escapes": json.dumps(row, ensure_ascii=True).encode() + b"\n",
        "keys_reversed": json.dumps(reversed_keys, ensure_ascii=False).encode() + b"\n",
        "spaces_around_everything": json.dumps(row, ensure_ascii=False, separators=(" , ", " : ")).encode() + b" \n",
        "slashes_escaped": json.dumps(row, ensure_ascii=False).replace("/", "\\/").encode() + b"\n",
    }


@pytest.mark.parametrize("kind", CUT_ROWS)
@pytest.mark.parametrize("encoding", reencoded({}))
def test_reader_reads_a_row_the_same_whatever_its_json_encoding(kind, encoding):
    line = encode(CUT_ROWS[kind], discard_no_reasoning=True)
    again = reencoded(json.loads(line))[encoding]
    assert again != line
    assert facts_read(again) == facts_read(line) == facts_from_parsed_row(line)


def with_lone_surrogate(row: dict) -> dict:
    """The row with its prompt holding a lone surrogate, wherever its kind keeps the prompt."""
    if "prompt" in row:
        return {**row, "prompt": "lone \udc80 surrogate"}
    conversations = [dict(turn) for turn in row["conversations"]]
    conversations[1]["value"] = "lone \udc80 surrogate"
    return {**row, "conversations": conversations}


@pytest.mark.parametrize("kind", CUT_ROWS)
def test_reader_reads_a_row_holding_a_lone_surrogate_as_python_json_writes_it(kind):
    line = encode(CUT_ROWS[kind], discard_no_reasoning=True)
    written = json.dumps(with_lone_surrogate(json.loads(line))).encode() + b"\n"
    assert b"\\udc80" in written                        # valid JSON to Python, refused by msgspec alone
    assert facts_read(written) == facts_read(line)
    assert read_stored_row(written).line == written


@pytest.mark.parametrize("constant", [b"Infinity", b"-Infinity", b"NaN"])
def test_a_line_holding_nan_or_infinity_is_refused_as_not_json_not_taken_for_deep_nesting(constant):
    with pytest.raises(RowError, match="NaN or Infinity"):
        read_stored_row(b'{"failed": true, "usage": {"cost": ' + constant + b'}}\n')


def test_a_row_is_never_written_with_nan_or_infinity():
    with pytest.raises(ValueError):
        encode_row({"failed": True, "usage": {"cost": math.inf}})


@pytest.mark.parametrize("kind", CUT_ROWS)
def test_every_kind_of_row_carries_the_format_version(kind):
    assert json.loads(encode(CUT_ROWS[kind], discard_no_reasoning=True))["format"] == ROW_FORMAT == 4


def format_1_line(result: SessionResult, *, with_format_key: bool = True) -> bytes:
    """The row as format 1 wrote it: a "tool_calls" list on each gpt turn with calls, an empty think
    block of "<think>\\n\\n</think>\\n", no toolsets_sampled or invented_tool_calls (and, before that,
    no "format" key)."""
    row = json.loads(encode(result))
    for key in ("toolsets_sampled", "invented_tool_calls", "gpt_turns", *(("format",) if not with_format_key else ())):
        del row[key]
    if with_format_key:
        row["format"] = 1
    calls = iter([call for turn in result.turns for call in turn.tool_calls])
    for turn in row["conversations"]:
        if turn["from"] != "gpt":
            continue
        if turn["value"].startswith("<think>\n</think>"):
            turn["value"] = "<think>\n\n</think>\n" + turn["value"][len("<think>\n</think>"):].lstrip("\n")
        blocks = tagged_payloads(turn["value"], "tool_call")
        if blocks:
            records = [next(calls) for _ in blocks]
            turn["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in records]
    return json.dumps(row, ensure_ascii=False).encode() + b"\n"


FORMAT_1_SESSION = session([AssistantTurn("", "Looking.", [call("terminal", '{"command": "ls"}', id="c1"),
                                                             call("web_search", id="c2"), call("made_up", id="c3")]),
                            AssistantTurn("thought", "Done.")], offered=["terminal"])


@pytest.mark.parametrize("with_format_key", [True, False], ids=["format_1", "before_formats"])
def test_a_format_1_row_is_read_with_the_rules_it_was_written_under(with_format_key):
    stored = read_stored_row(format_1_line(FORMAT_1_SESSION, with_format_key=with_format_key))
    assert not stored.is_current
    assert stored.invented_tools() == ["made_up"]          # format 1 judged by the registry alone
    assert stored.reasoning_counts() == (1, 1)


def test_a_format_1_row_keeps_a_key_of_its_own_when_upgraded():
    row = json.loads(format_1_line(FORMAT_1_SESSION))
    line = json.dumps({**row, "notes": "added by hand"}).encode() + b"\n"
    upgraded = json.loads(read_stored_row(line).upgraded())
    assert upgraded["notes"] == "added by hand" and list(upgraded)[-1] == "notes"


@pytest.mark.parametrize("with_format_key", [True, False], ids=["format_1", "before_formats"])
def test_a_format_1_row_is_upgraded_to_the_keys_and_turn_shape_of_a_current_row(with_format_key):
    upgraded = json.loads(read_stored_row(format_1_line(FORMAT_1_SESSION, with_format_key=with_format_key)).upgraded())
    current = json.loads(encode(FORMAT_1_SESSION))
    assert list(upgraded) == list(current)
    assert upgraded["format"] == ROW_FORMAT
    assert all(list(turn) == ["from", "value"] for turn in upgraded["conversations"])
    assert (upgraded["invented_tool_calls"], upgraded["toolsets_sampled"]) == (1, current["toolsets_used"])
    assert (upgraded["gpt_turns"], upgraded["conversations"]) == (current["gpt_turns"], current["conversations"])
    assert read_stored_row(encode(FORMAT_1_SESSION)).upgraded() == encode(FORMAT_1_SESSION)


@pytest.mark.parametrize("line", [
    b'{"format": 5, "prompt_index": 0, "content_key": "ab", "conversations": [], "end_reason": "final_answer"}\n',
    b'{"format": 5, "id": "a row of a shape this version has never seen"}\n',
    b'{"prompt_index": "zero", "format": 7}\n',
], ids=["same_shape", "new_shape", "wrong_types"])
def test_reader_refuses_a_row_of_a_newer_format_saying_so(line):
    with pytest.raises(RowError, match=r"row format \d is newer than this batch_runner reads \(format 4\)"):
        read_stored_row(line)


def other_rows() -> dict[str, bytes]:
    row = json.loads(encode(CUT_ROWS["trajectory"]))
    no_value = json.loads(json.dumps(row))
    no_value["conversations"][1]["value"] = 5
    return {
        "array": b"[1, 2, 3]\n", "string": b'"a string"\n', "null": b"null\n", "number": b"42\n",
        "other_program_row": b'{"conversations": [], "completed": true, "end_reason": "final_answer"}\n',
        "string_prompt_index": json.dumps({**row, "prompt_index": "3"}).encode() + b"\n",
        "negative_prompt_index": json.dumps({**row, "prompt_index": -1}).encode() + b"\n",
        "negative_sample_index": json.dumps({**row, "sample_index": -1}).encode() + b"\n",
        "no_content_key": json.dumps({k: v for k, v in row.items() if k != "content_key"}).encode() + b"\n",
        "no_kind": json.dumps({k: v for k, v in row.items() if k != "conversations"}).encode() + b"\n",
        "turn_value_not_text": json.dumps(no_value).encode() + b"\n",
        "string_format": json.dumps({**row, "format": "1"}).encode() + b"\n",
        "nested_deeper_than_any_row": b'{"prompt_index": 0, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
    }


@pytest.mark.parametrize("kind", other_rows())
def test_reader_refuses_json_that_is_not_a_row_instead_of_skipping_it(kind):
    with pytest.raises(RowError, match="not a batch_runner row"):
        read_stored_row(other_rows()[kind])


def test_a_row_is_one_line_to_readers_that_split_at_every_unicode_line_break():
    # JSON allows U+0085, U+2028 and U+2029 raw inside strings; Python's str.splitlines, codecs' line
    # readers and some JSONL loaders break lines there and would cut the row in pieces.
    text = "a\u0085b\u2028c\u2029d"
    line = rows.encode_row({"value": text})
    assert len(line.decode("utf-8").splitlines()) == 1
    assert json.loads(line) == {"value": text}


# --- lines that are not JSON: what a crash leaves --------------------------------------------------------------

@pytest.mark.parametrize("kind", CUT_ROWS)
def test_reader_takes_a_row_cut_anywhere_short_of_its_end_for_no_row(kind):
    line = encode(CUT_ROWS[kind], discard_no_reasoning=True)
    assert read_stored_row(line) is not None
    accepted = [cut for cut in range(len(line) - 1) if read_stored_row(line[:cut] + b"\n") is not None]
    assert accepted == []


def test_reader_takes_a_cut_row_without_a_newline_for_no_row_too():
    line = encode(CUT_ROWS["trajectory"])
    assert [cut for cut in range(len(line) - 2) if read_stored_row(line[:cut]) is not None] == []


@pytest.mark.parametrize("line", [
    b"", b"\n", b"   \n", b"not json at all\n",
    b'{"prompt_index": 1, "content_key": "00ff", "conversations": [garbage\n',
    b'{"prompt_index": 1, "content_key": "00ff", "conversations": garbage "end_reason": "final_answer"\n',
], ids=["empty", "newline", "blank", "words", "cut_head", "garbage_without_closing_brace"])
def test_reader_takes_a_line_that_is_not_json_for_no_row(line):
    assert read_stored_row(line) is None


def test_reader_takes_a_crash_fragment_followed_directly_by_another_row_for_no_row():
    first, second = encode(CUT_ROWS["trajectory"]), encode(CUT_ROWS["failure"])
    spliced = first[:len(first) // 2] + second
    with pytest.raises(ValueError):
        json.loads(spliced)
    assert read_stored_row(spliced) is None


# --- byte parity with the reference runner ------------------------------------------------------------------

REFERENCE_SYSTEM_WITHOUT_TOOLS = (
    "You are a function calling AI model. You are provided with function signatures within <tools> </tools> XML "
    "tags. You may call one or more functions to assist with the user query. If available tools are not relevant in "
    "assisting with user query, just respond in natural conversational language. Don't make assumptions about what "
    "values to plug into functions. After calling & executing the functions, you will be provided with function "
    "results within <tool_response> </tool_response> XML tags. Here are the available tools:\n<tools>\n[]\n</tools>\n"
    "For each function call return a JSON object, with the following pydantic model json schema for each:\n"
    "{'title': 'FunctionCall', 'type': 'object', 'properties': {'name': {'title': 'Name', 'type': 'string'}, "
    "'arguments': {'title': 'Arguments', 'type': 'object'}}, 'required': ['name', 'arguments']}\n"
    "Each function call should be enclosed within <tool_call> </tool_call> XML tags.\nExample:\n<tool_call>\n"
    "{'name': <function-name>,'arguments': <args-dict>}\n</tool_call>")


def test_conversations_match_the_reference_runner_byte_for_byte():
    turns = [AssistantTurn("plan", "", [call("terminal", '{"command":"ls"}', result='{"output":"a","exit_code":0}',
                                             id="c1")]),
             AssistantTurn("", "Let me look.", [call("read_file", '{"path": "a"}', result="Error: no such file", id="c2"),
                                                call("terminal", '{"command": "cat a"}', result="", id="c3")]),
             AssistantTurn("", "Done.")]
    line = encode(session(turns, prompt="  Q with spaces  ", offered=[]))
    assert line.split(b'"conversations": ')[1].split(b', "metadata"')[0].decode() == json.dumps([
        {"from": "system", "value": REFERENCE_SYSTEM_WITHOUT_TOOLS},
        {"from": "human", "value": "  Q with spaces  "},
        {"from": "gpt", "value": '<think>\nplan\n</think>\n<tool_call>\n{"name": "terminal", "arguments": '
                                 '{"command": "ls"}}\n</tool_call>'},
        {"from": "tool", "value": '<tool_response>\n{"tool_call_id": "c1", "name": "terminal", "content": '
                                  '{"output": "a", "exit_code": 0}}\n</tool_response>'},
        {"from": "gpt", "value": '<think>\n</think>\nLet me look.\n<tool_call>\n{"name": "read_file", "arguments": '
                                 '{"path": "a"}}\n</tool_call>\n<tool_call>\n{"name": "terminal", "arguments": '
                                 '{"command": "cat a"}}\n</tool_call>'},
        {"from": "tool", "value": '<tool_response>\n{"tool_call_id": "c2", "name": "read_file", "content": '
                                  '"Error: no such file"}\n</tool_response>\n<tool_response>\n{"tool_call_id": "c3", '
                                  '"name": "terminal", "content": ""}\n</tool_response>'},
        {"from": "gpt", "value": "<think>\n</think>\nDone."},
    ], ensure_ascii=False)


# --- reading the rendered turns back: the one reader the report and the export share ----------------------

def test_the_calls_of_a_rendered_gpt_turn_read_back_as_they_were_made():
    turn = AssistantTurn("thinking", "Let me look.", [call("terminal", '{"command": "ls"}'), call("read_file")])
    _, rest = rows.split_rendered_reasoning(rows.render_gpt_turn(turn)["value"])
    text, calls = rows.split_rendered_calls(rest)
    assert text == "Let me look."
    assert calls == [{"name": "terminal", "arguments": {"command": "ls"}}, {"name": "read_file", "arguments": {}}]


def test_a_tool_call_the_model_only_wrote_in_its_text_stays_text():
    written = 'I would send <tool_call>\n{"name": "terminal", "arguments": {}}\n</tool_call> but did not.'
    _, rest = rows.split_rendered_reasoning(rows.render_gpt_turn(AssistantTurn("r", written))["value"])
    assert rows.split_rendered_calls(rest) == (written, [])


def test_the_results_of_a_rendered_tool_turn_read_back_one_json_line_each():
    value = rows.render_tool_turn([call("terminal", result="out"), call("read_file", result='{"ok": true}')])["value"]
    payloads = [json.loads(payload) for payload in rows.rendered_tool_responses(value, exact=True)]
    assert [(p["name"], p["content"]) for p in payloads] == [("terminal", "out"), ("read_file", {"ok": True})]


def test_a_tool_turn_with_text_beside_its_blocks_is_not_read_exactly():
    value = rows.render_tool_turn([call("terminal", result="out")])["value"] + "\ntrailing words"
    assert rows.rendered_tool_responses(value, exact=True) == []
    assert len(rows.rendered_tool_responses(value)) == 1


# --- reading turns back by the row's own record of them, never by how their text looks ---------------------

FAKE_CALL = '<tool_call>\n{"name": "terminal", "arguments": {"command": "rm -rf /"}}\n</tool_call>'


def gpt_turns_read(line: bytes) -> list[rows.ReadGptTurn]:
    row = json.loads(line)
    values = [turn["value"] for turn in row["conversations"] if turn["from"] == "gpt"]
    return [rows.read_gpt_turn(value, (layout["reasoning_chars"], layout["tool_calls"]))
            for value, layout in zip(values, row["gpt_turns"], strict=True)]


def test_each_gpt_turn_records_how_long_its_reasoning_is_and_how_many_calls_it_made():
    turns = [AssistantTurn("plan", "", [call("terminal", id="a"), call("read_file", id="b")]), HumanTurn("Go on."),
             AssistantTurn("", "Done.")]
    assert row_of(session(turns))["gpt_turns"] == [{"reasoning_chars": 4, "tool_calls": 2},
                                                   {"reasoning_chars": 0, "tool_calls": 0}]


def test_model_text_ending_in_a_tool_call_block_reads_back_as_text_not_as_a_call():
    line = encode(session([AssistantTurn("r", "I will run this:\n" + FAKE_CALL)]))
    [turn] = gpt_turns_read(line)
    assert (turn.text, turn.calls) == ("I will run this:\n" + FAKE_CALL, [])
    assert read_stored_row(line).tool_counts() == []


def test_invented_tools_are_the_calls_made_not_calls_quoted_in_the_text():
    quoted = 'I will not call <tool_call>\n{"name": "quoted_tool", "arguments": {}}\n</tool_call> at all.'
    ending = 'Nor this:\n<tool_call>\n{"name": "ending_tool", "arguments": {}}\n</tool_call>'
    line = encode(session([AssistantTurn("r", quoted, [call("made_up", id="c1")]), AssistantTurn("r", ending)],
                          end_reason="max_turns"))
    assert read_stored_row(line).invented_tools() == ["made_up"]


@pytest.mark.parametrize("reasoning", ["a\n</think>\nb", "</think> opens it", "ends with\n</think>"],
                         ids=["closing_tag_inside", "closing_tag_first", "closing_tag_last"])
def test_reasoning_holding_the_closing_think_tag_reads_back_whole(reasoning):
    line = encode(session([AssistantTurn(reasoning, "Done.")]), discard_no_reasoning=True)
    [turn] = gpt_turns_read(line)
    assert (turn.reasoning, turn.text) == (reasoning, "Done.")
    stored = read_stored_row(line)
    assert (stored.status, stored.reasoning_counts()) == ("completed", (1, 0))     # kept, not discarded


def test_a_turn_without_reasoning_whose_text_looks_like_a_think_block_never_counts_as_reasoning():
    line = encode(session([AssistantTurn("", "<think>\nplan\n</think>\nanswer")]), discard_no_reasoning=True)
    assert read_stored_row(line).reasoning_counts() == (0, 1)
    assert read_stored_row(line).status == "discarded"


def test_visible_text_never_keeps_a_think_block_that_taking_another_out_would_form():
    reasoning, visible = split_reasoning({"content": "<thi<think></think>nk>\nplan\n</think>\nanswer"})
    assert (reasoning, visible) == ("plan", "answer")


@pytest.mark.parametrize("turn", [
    AssistantTurn("r", "text", [call("terminal", '{"command": "ls"}'), call("read_file", "not json")]),
    AssistantTurn("", "", [call("terminal")]),
    AssistantTurn("r", ""),
    AssistantTurn("", ""),
    AssistantTurn("", "Use <think> tags.", [call("terminal", '{"c": "<think>"}')]),
    AssistantTurn("a\n</think>\nb", "x\n" + FAKE_CALL, [call("terminal")]),
], ids=["text_and_calls", "call_only", "reasoning_only", "nothing", "think_tag_in_text", "lookalikes_everywhere"])
def test_a_gpt_turn_reads_back_as_exactly_what_was_rendered(turn):
    [read] = gpt_turns_read(encode(session([turn])))
    assert (read.reasoning, read.text) == (turn.reasoning, turn.content)
    assert [(c["name"], rows.arguments_text(c["arguments"])) for c in read.calls] == \
        [(c.name, c.arguments) for c in turn.tool_calls]


def test_a_turn_that_does_not_fit_its_record_is_refused_not_guessed():
    value = rows.render_gpt_turn(AssistantTurn("r", "text"))["value"]
    with pytest.raises(rows.LayoutError):
        rows.read_gpt_turn(value, (1, 1))


def test_a_current_row_whose_turn_record_does_not_match_its_turns_is_refused():
    row = json.loads(encode(session([AssistantTurn("r", "a")])))
    row["gpt_turns"] = []
    with pytest.raises(RowError, match="not a batch_runner row"):
        read_stored_row(json.dumps(row).encode() + b"\n")


DEEP = "[" * 100_000 + "]" * 100_000


def test_arguments_nested_deeper_than_json_reads_are_rendered_and_read_back_as_text():
    line = encode(session([AssistantTurn("r", "", [call("terminal", DEEP, result='{"error": "too deep"}')])]))
    [turn] = gpt_turns_read(line)
    assert turn.calls == [{"name": "terminal", "arguments": DEEP}]
    assert read_stored_row(line).tool_counts() == [("terminal", 1, 0, 1)]


def format_2_line(result: SessionResult) -> bytes:
    """The row as format 2 wrote it: the current row without gpt_turns or sample_index."""
    row = json.loads(encode(result))
    del row["gpt_turns"], row["sample_index"]
    row["format"] = 2
    return json.dumps(row, ensure_ascii=False).encode() + b"\n"


def format_3_line(result: SessionResult) -> bytes:
    """The row as format 3 wrote it: the current row without sample_index."""
    row = json.loads(encode(result))
    del row["sample_index"]
    row["format"] = 3
    return json.dumps(row, ensure_ascii=False).encode() + b"\n"


def test_a_format_3_row_is_the_first_sample_of_its_prompt():
    stored = read_stored_row(format_3_line(FORMAT_1_SESSION))
    assert not stored.is_current
    assert (stored.sample_index, stored.sample_key) == (0, stored.content_key)


def test_a_format_3_row_is_upgraded_to_the_current_row_keeping_its_record_of_turns():
    assert read_stored_row(format_3_line(FORMAT_1_SESSION)).upgraded() == encode(FORMAT_1_SESSION)


def test_a_later_sample_is_counted_apart_from_the_first_by_resume():
    first, third = (read_stored_row(encode(dataclasses.replace(FORMAT_1_SESSION, sample_index=index)))
                    for index in (0, 2))
    assert (first.content_key, first.prompt_key) == (third.content_key, third.prompt_key)
    assert first.sample_key != third.sample_key
    assert (third.sample_index, json.loads(third.line)["sample_index"]) == (2, 2)


def test_a_format_2_row_is_read_by_its_turns_text_as_it_was_written():
    stored = read_stored_row(format_2_line(FORMAT_1_SESSION))
    assert not stored.is_current
    assert (stored.invented_tools(), stored.reasoning_counts()) == (["web_search", "made_up"], (1, 1))


def test_a_format_2_row_is_upgraded_with_the_record_of_its_turns():
    upgraded = read_stored_row(format_2_line(FORMAT_1_SESSION)).upgraded()
    assert upgraded == encode(FORMAT_1_SESSION)


@pytest.mark.parametrize("discarded", [False, True], ids=["trajectory", "tombstone"])
def test_an_older_row_that_kept_no_reply_reads_as_a_failure_resume_runs_again(discarded):
    row = json.loads(format_2_line(session([AssistantTurn("r", "a")])))
    row["conversations"] = row["conversations"][:2]            # system and prompt only
    if discarded:
        row.update(discarded="no_reasoning", prompt="Do it.")
    row["end_reason"] = "empty_answer"
    stored = read_stored_row(json.dumps(row).encode() + b"\n")
    assert (stored.status, stored.error_type()) == ("failed", "empty_answer")


def deeper(levels: int, then):
    """``then()`` called from ``levels`` frames further down the stack."""
    return then() if levels == 0 else deeper(levels - 1, then)


@pytest.mark.parametrize("depth", [400, 960, 990])
def test_arguments_nested_about_as_deep_as_python_reads_are_kept_in_a_row_that_reads_back(depth):
    # Written one level deeper inside their call block, arguments that Python only just read where the
    # row was made (a worker's shallow stack) could not be read back where it is read (a deeper one):
    # the row was refused, and resume and the merge stopped at it.
    arguments = "[" * depth + "]" * depth
    result = session([AssistantTurn("r", "", [call("made_up", arguments, '{"error": "unknown tool"}')]),
                      AssistantTurn("r", "Done.")])
    made: list[bytes] = []
    maker = threading.Thread(target=lambda: made.append(encode(result)))
    maker.start()
    maker.join()
    stored = deeper(100, lambda: rows.read_stored_row(made[0]))
    assert stored is not None and stored.status == rows.COMPLETED
    first_turn = next(turn for turn in json.loads(made[0])["conversations"] if turn["from"] == "gpt")
    [read_call] = rows.read_gpt_turn(first_turn["value"], (0, 1)).calls
    assert rows.arguments_text(read_call["arguments"]) == arguments


@pytest.mark.parametrize("arguments", ['"str"', '"5"', '"{}"', "str", '""'])
def test_arguments_that_are_a_json_string_read_back_as_the_text_the_model_sent(arguments):
    # A JSON string's value and text that is no JSON at all would both be a string in the call block:
    # `"str"` came back as `str`.
    result = session([AssistantTurn("r", "", [call("made_up", arguments, '{"error": "unknown tool"}')]),
                      AssistantTurn("r", "Done.")])
    first_turn = next(turn for turn in json.loads(encode(result))["conversations"] if turn["from"] == "gpt")
    [read_call] = rows.read_gpt_turn(first_turn["value"], (0, 1)).calls
    assert rows.arguments_text(read_call["arguments"]) == arguments
