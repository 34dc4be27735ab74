"""Tests for the scripted OpenAI-compatible endpoint, driven by the real openai client."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scripted_endpoint import (
    MALFORMED_KINDS,
    DirectiveError,
    ScriptedEndpoint,
    parse_directives,
    strip_directives,
)

pytestmark = pytest.mark.timeout(60)

MODEL = "test-model"
TOOLS = [
    {
        "type": "function",
        "function": {"name": "terminal", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}},
    }
]


@pytest.fixture(scope="module")
def endpoint():
    with ScriptedEndpoint() as ep:
        yield ep


@pytest.fixture()
def ep(endpoint):
    endpoint.reset()
    endpoint.script = None
    return endpoint


def client_for(ep: ScriptedEndpoint, api_key: str = "sk-test") -> openai.OpenAI:
    return openai.OpenAI(api_key=api_key, base_url=ep.base_url, max_retries=0, timeout=10)


def ask(client, messages, model=MODEL):
    return client.chat.completions.create(model=model, messages=messages, tools=TOOLS)


def run_conversation(client, prompt, max_turns=10):
    """Drive a tool loop: send back assistant + tool messages until a final answer."""
    messages = [{"role": "system", "content": "You are a test agent."}, {"role": "user", "content": prompt}]
    turns = []
    for _ in range(max_turns):
        resp = ask(client, messages)
        msg = resp.choices[0].message
        turns.append(resp)
        if not msg.tool_calls:
            return turns, messages
        messages.append(msg.model_dump(exclude_none=True))
        for tc in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": f"ran {tc.function.name}"})
    return turns, messages


# --------------------------------------------------------------------------- parsing


def test_parse_directives_grammar():
    s = parse_directives(
        'Do it [[call terminal {"command": "echo ]] inside"}]] [[calls [{"name": "a", "arguments": {"x": [[1]]}},'
        ' {"name": "b"}]]] [[final Done!]] [[reasoning think]] [[fail 429 2 retry_after=3]] [[drop 1]]'
        " [[sleep 0.1]] [[length]] [[unknown thing]] now"
    )
    assert [[(c.name, json.loads(c.arguments)) for c in turn] for turn in s.turns] == [
        [("terminal", {"command": "echo ]] inside"})],
        [("a", {"x": [[1]]}), ("b", {})],
    ]
    assert (s.final, s.reasoning, s.fail_status, s.fail_count, s.retry_after) == ("Done!", "think", 429, 2, "3")
    assert (s.drop_count, s.sleep, s.length_count) == (1, 0.1, float("inf"))
    assert s.text == "Do it [[unknown thing]] now"
    assert parse_directives("[[fail 500 always]]").fail_count == float("inf")
    assert parse_directives("[[call t]]").turns[0][0].arguments == "{}"
    assert strip_directives("  hello [[invent]]  world ") == "hello world"
    with pytest.raises(DirectiveError):
        parse_directives("[[reasoning bogus]]")


# --------------------------------------------------------------------------- chat


def test_plain_prompt_gets_final_answer_with_reasoning(ep):
    client = client_for(ep)
    resp = ask(client, [{"role": "user", "content": "What is 2+2?"}])
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == "Final answer."
    assert not choice.message.tool_calls
    assert choice.message.model_extra["reasoning"] == "Reasoning for turn 0."
    assert resp.model == MODEL
    assert resp.usage.prompt_tokens == 100 and resp.usage.completion_tokens == 20 and resp.usage.total_tokens == 120
    assert resp.usage.completion_tokens_details.reasoning_tokens == 5
    assert resp.usage.prompt_tokens_details.cached_tokens == 10
    assert resp.usage.model_extra["cost"] == 0.001
    assert len(ep.requests) == 1 and ep.requests[0]["tools"] == TOOLS


def test_call_directives_produce_turns_in_order(ep):
    client = client_for(ep)
    prompt = (
        'List then read. [[call terminal {"command": "ls"}]] [[call read_file {"path": "a.txt"}]]'
        ' [[calls [{"name": "x", "arguments": {"n": 1}}, {"name": "y", "arguments": "{}"}]]] [[final All done.]]'
    )
    turns, messages = run_conversation(client, prompt)
    assert len(turns) == 4
    calls = [[(tc.id, tc.function.name, json.loads(tc.function.arguments)) for tc in r.choices[0].message.tool_calls] for r in turns[:3]]
    assert calls == [
        [("call_0_0", "terminal", {"command": "ls"})],
        [("call_1_0", "read_file", {"path": "a.txt"})],
        [("call_2_0", "x", {"n": 1}), ("call_2_1", "y", {})],
    ]
    for r in turns[:3]:
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.content == ""
    assert [r.choices[0].message.model_extra["reasoning"] for r in turns] == [f"Reasoning for turn {t}." for t in range(4)]
    final = turns[-1].choices[0]
    assert (final.finish_reason, final.message.content) == ("stop", "All done.")
    assert len(ep.chat_requests_for("List then read.")) == 4
    assert ep.chat_requests_for("no such prompt") == []
    assert ep.requests[-1]["messages"][-1]["role"] == "tool"


@pytest.mark.parametrize(
    "form",
    ["reasoning", "reasoning_content", "reasoning_details", "think", "scratchpad", "none"],
)
def test_reasoning_forms(ep, form):
    client = client_for(ep)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": f"[[reasoning {form}]] [[call terminal {{}}]] hi"}]
    )
    msg = json.loads(raw.text)["choices"][0]["message"]
    text = "Reasoning for turn 0."
    extra_keys = {"reasoning", "reasoning_content", "reasoning_details"} & msg.keys()
    if form in ("reasoning", "reasoning_content"):
        assert msg[form] == text and extra_keys == {form} and msg["content"] == ""
    elif form == "reasoning_details":
        assert msg[form] == [{"type": "reasoning.text", "text": text, "signature": "sig-0",
                              "format": "anthropic-claude-v1", "index": 0}] and extra_keys == {form}
    elif form == "think":
        assert msg["content"] == f"<think>{text}</think>" and not extra_keys
    elif form == "scratchpad":
        assert msg["content"] == f"<REASONING_SCRATCHPAD>{text}</REASONING_SCRATCHPAD>" and not extra_keys
    else:
        assert msg["content"] == "" and not extra_keys
    assert msg["tool_calls"][0]["function"] == {"name": "terminal", "arguments": "{}"}

    # parsed through the client too, on the final turn
    parsed = raw.parse()
    messages = [
        {"role": "user", "content": f"[[reasoning {form}]] [[call terminal {{}}]] hi"},
        parsed.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": "call_0_0", "content": "ok"},
    ]
    final = client.chat.completions.create(model=MODEL, messages=messages).choices[0].message
    if form == "think":
        assert final.content == "<think>Reasoning for turn 1.</think>Final answer."
    elif form == "scratchpad":
        assert final.content == "<REASONING_SCRATCHPAD>Reasoning for turn 1.</REASONING_SCRATCHPAD>Final answer."
    elif form == "none":
        assert final.content == "Final answer." and not (final.model_extra or {})
    else:
        assert final.content == "Final answer." and form in final.model_extra


def test_fail_directive_then_success_with_retry_after(ep):
    client = client_for(ep)
    messages = [{"role": "user", "content": "[[fail 429 2 retry_after=7]] flaky prompt"}]
    for _ in range(2):
        with pytest.raises(openai.RateLimitError) as info:
            ask(client, messages)
        assert info.value.status_code == 429
        assert info.value.response.headers["retry-after"] == "7"
        assert info.value.code == "rate_limit_exceeded"
    assert ask(client, messages).choices[0].message.content == "Final answer."
    assert len(ep.chat_requests_for("flaky prompt")) == 3

    messages = [{"role": "user", "content": "[[fail 503 always]] down"}]
    for _ in range(3):
        with pytest.raises(openai.InternalServerError) as info:
            ask(client, messages)
        assert info.value.status_code == 503 and "retry-after" not in info.value.response.headers

    ep.reset()  # counters reset too
    with pytest.raises(openai.RateLimitError):
        ask(client, [{"role": "user", "content": "[[fail 429 2 retry_after=7]] flaky prompt"}])


def test_drop_sleep_invent_bad_json_length(ep):
    client = client_for(ep)
    with pytest.raises(openai.APIConnectionError):
        ask(client, [{"role": "user", "content": "[[drop 1]] dropped"}])
    assert ask(client, [{"role": "user", "content": "[[drop 1]] dropped"}]).choices[0].finish_reason == "stop"

    t0 = time.monotonic()
    ask(client, [{"role": "user", "content": "[[sleep 0.3]] slow"}])
    assert time.monotonic() - t0 >= 0.3

    turns, _ = run_conversation(client, "[[invent]] hallucinate", max_turns=3)
    assert len(turns) == 3
    for r in turns:
        (tc,) = r.choices[0].message.tool_calls
        assert (tc.function.name, tc.function.arguments) == ("made_up_tool", "{}")

    turns, _ = run_conversation(client, '[[bad_json]] [[call terminal {"command": "ls"}]] [[length]] broken')
    assert turns[0].choices[0].message.tool_calls[0].function.arguments == '{"command": "echo hi"'
    assert turns[0].choices[0].message.tool_calls[0].function.name == "terminal"
    assert json.loads(turns[1].choices[0].message.tool_calls[0].function.arguments) == {"command": "ls"}
    assert len(turns) == 3 and turns[2].choices[0].finish_reason == "length"


def test_malformed_directive_grammar():
    assert (parse_directives("[[malformed message_null]] x").malformed,
            parse_directives("[[malformed message_null]] x").malformed_count) == ("message_null", 1)
    assert parse_directives("[[malformed not_json always]]").malformed_count == float("inf")
    for bad in ("[[malformed]]", "[[malformed bogus]]", "[[malformed no_choices 1 2]]"):
        with pytest.raises(DirectiveError):
            parse_directives(bad)


def post_raw(ep: ScriptedEndpoint, prompt: str) -> tuple[int, str, bytes]:
    """(status, content type, body) of one chat request, without a client that would parse the body."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt}]}).encode()
    request = urllib.request.Request(ep.base_url + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, response.headers["Content-Type"], response.read()


@pytest.mark.parametrize("kind", MALFORMED_KINDS)
def test_malformed_directive_breaks_the_first_replies_with_status_200(ep, kind):
    status, content_type, body = post_raw(ep, f"[[malformed {kind}]] broken")
    assert status == 200
    if kind == "not_json":
        assert content_type == "text/html"
        with pytest.raises(ValueError):
            json.loads(body)
    else:
        reply = json.loads(body)
        choices = reply["choices"]
        if kind == "no_choices":
            assert choices == []
        elif kind == "choices_not_list":
            assert isinstance(choices, dict) and choices["message"]["content"] == "Final answer."
        elif kind == "message_null":
            assert choices[0]["message"] is None
        elif kind == "message_not_object":
            assert choices[0]["message"] == "Final answer."
        else:
            assert choices[0]["message"]["tool_calls"] == {"name": "terminal", "arguments": "{}"}
    _, _, body = post_raw(ep, f"[[malformed {kind}]] broken")    # the second request is answered normally
    assert json.loads(body)["choices"][0]["message"]["content"] == "Final answer."


def test_script_override_hook(ep):
    client = client_for(ep)
    ep.script = lambda body: (400, {"error": {"message": "context too long", "type": "invalid_request_error"}}, {}) if "huge" in json.dumps(body) else None
    with pytest.raises(openai.BadRequestError):
        ask(client, [{"role": "user", "content": "huge"}])
    assert ask(client, [{"role": "user", "content": "small"}]).choices[0].message.content == "Final answer."
    assert len(ep.requests) == 2


def test_streaming(ep):
    client = client_for(ep)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": '[[call terminal {"command": "ls"}]] stream'}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    tc = chunks[0].choices[0].delta.tool_calls[0]
    assert (tc.id, tc.function.name, tc.function.arguments) == ("call_0_0", "terminal", '{"command": "ls"}')
    assert chunks[1].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].usage.total_tokens == 120


# --------------------------------------------------------------------------- auth / models / concurrency


def test_api_key_and_models():
    with ScriptedEndpoint(api_key="sk-right", models={"m1", "m2"}) as ep:
        with pytest.raises(openai.AuthenticationError) as info:
            client_for(ep, "sk-wrong").chat.completions.create(model="m1", messages=[{"role": "user", "content": "x"}])
        assert info.value.code == "invalid_api_key"
        good = client_for(ep, "sk-right")
        with pytest.raises(openai.NotFoundError) as info:
            good.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        assert info.value.code == "model_not_found" and "`nope`" in info.value.message
        assert good.chat.completions.create(model="m2", messages=[{"role": "user", "content": "x"}]).model == "m2"
        assert sorted(m.id for m in good.models.list()) == ["m1", "m2"]
        with pytest.raises(openai.AuthenticationError):
            client_for(ep, "sk-wrong").models.list()
        assert len(ep.requests) == 3  # errors are recorded too


def test_models_default_and_standalone_url():
    with ScriptedEndpoint() as ep:
        assert ep.base_url == f"http://127.0.0.1:{ep.port}/v1"
        with urllib.request.urlopen(ep.base_url + "/models", timeout=5) as r:
            assert [m["id"] for m in json.load(r)["data"]] == ["scripted-model"]


def test_concurrent_clients_with_latency():
    with ScriptedEndpoint(latency=0.2) as ep:

        clients = [client_for(ep) for _ in range(20)]

        def one(i):
            resp = ask(clients[i], [{"role": "user", "content": f'[[call terminal {{"i": {i}}}]] worker {i}'}])
            return json.loads(resp.choices[0].message.tool_calls[0].function.arguments)["i"]

        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=20) as pool:
            results = list(pool.map(one, range(20)))
        elapsed = time.monotonic() - t0
        assert results == list(range(20))
        assert len(ep.requests) == 20
        # One after another they take 4 s at least.
        assert elapsed < 3.5, f"requests were not served concurrently ({elapsed:.2f}s)"
