"""What each answer (or silence) of the endpoint means: transient, this prompt's failure, or the run's end.

Errors come from real calls: the scripted server on 127.0.0.1 or a closed port there. Only a DNS
failure is built by hand (no network here), with the exception chain the HTTP stack raises for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.utils
import gzip
import http.server
import json
import os
import resource
import socket
import threading
import time
import tracemalloc

import openai
import pytest
from conftest import batch_rows, read_jsonl, run_cli, write_dataset
from scripted_endpoint import OVERFLOW_ERRORS, ScriptedEndpoint
from test_session import ENDPOINT

from batchrun.concurrency import Outcome
from batchrun.endpoint import (
    MAX_REPLY_BYTES,
    MAX_RETRY_AFTER,
    MalformedReplyError,
    OpenAIEndpoint,
    call_model,
    classify,
    make_client,
    parse_reply,
    retry_after_seconds,
    transport,
)
from batchrun.endpoint.errors import BACKOFF_CAP, backoff_delay
from batchrun.env_vars import Proxy, proxy_for
from batchrun.environments.base import EnvironmentSettings
from batchrun.model import CONTEXT_LENGTH, ModelReply, PromptFailedError, RunFatalError
from batchrun.rate_limit import RateGate
from batchrun.rows import Usage, split_reasoning
from batchrun.tools import ToolContext
from batchrun.tools.clients import openai_client

pytestmark = pytest.mark.timeout(120)

MODEL = "scripted-model"


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on: connecting to it is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def request_body(prompt: str) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt}]}).encode()


def error_from(base_url: str, prompt: str = "q", timeout: float = 10) -> openai.APIError:
    """The error one real call to ``base_url`` raises."""
    async def call() -> openai.APIError:
        async with make_client(base_url, "sk-test", timeout=timeout) as client:
            try:
                await client.post("/chat/completions", cast_to=bytes, content=request_body(prompt))
            except openai.APIError as exc:
                return exc
        raise AssertionError("the call succeeded")
    return asyncio.run(call())


def call_once(base_url: str, prompt: str, *, max_retries: int = 0, timeout: float = 10,
              on_refused=lambda usage, source: None):
    """One call_model call through a fresh client and gate, as a session makes it."""
    async def call():
        async with make_client(base_url, "sk-test", timeout=timeout) as client:
            return await call_model(client, RateGate(), body=request_body(prompt), model=MODEL,
                                    max_retries=max_retries, base_url=base_url, on_refused=on_refused)
    return asyncio.run(call())


def classify_here(exc: Exception, *, answered: bool, base_url: str = "http://127.0.0.1:1/v1") -> float | None:
    return classify(exc, model=MODEL, base_url=base_url, endpoint_answered=answered, request=request_body("q"))


@pytest.fixture(scope="module")
def server():
    with ScriptedEndpoint() as running:
        yield running


@pytest.fixture
def ep(server):
    server.reset()
    server.script = None
    return server


# -- HTTP status codes ------------------------------------------------------------------------

@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504])
def test_transient_statuses_are_retried(ep, status):
    exc = error_from(ep.base_url, f"[[fail {status}]] busy")
    assert exc.status_code == status
    assert classify_here(exc, answered=True) is None


@pytest.mark.parametrize("status", [400, 403, 422])
def test_request_the_endpoint_refuses_fails_only_this_prompt(ep, status):
    exc = error_from(ep.base_url, f"[[fail {status}]] refused")
    with pytest.raises(PromptFailedError) as failure:
        classify_here(exc, answered=True)
    assert failure.value.error_type == f"http_{status}" and f"HTTP {status}" in str(failure.value)


CONTEXT_OVERFLOWS = {
    **{f"scripted_{name}": (400, {"error": {"message": text, "type": kind, "code": code}})
       for name, (text, kind, code) in OVERFLOW_ERRORS.items()},
    "openrouter": (400, {"error": {"message": "This endpoint's maximum context length is 131072 tokens. However, "
                                              "you requested about 140000 tokens.", "code": 400}}),
    "code_only": (400, {"error": {"message": "Bad request", "code": "context_length_exceeded"}}),
    "payload_too_large": (413, {"error": {"message": "prompt is too long for this model's context window"}}),
}


@pytest.mark.parametrize("case", CONTEXT_OVERFLOWS)
def test_a_context_overflow_fails_the_prompt_as_context_length_in_every_providers_words(ep, case):
    status, body = CONTEXT_OVERFLOWS[case]
    ep.script = lambda _body: (status, body, {})
    with pytest.raises(PromptFailedError) as failure:
        classify_here(error_from(ep.base_url), answered=True)
    assert failure.value.error_type == "context_length"
    assert "no longer fits the model's context" in str(failure.value)


@pytest.mark.parametrize("message", ["Invalid value for 'temperature'", "tools[0].function.name is too long"])
def test_a_bad_request_that_is_not_about_the_context_stays_an_http_400(ep, message):
    ep.script = lambda _body: (400, {"error": {"message": message}}, {})
    with pytest.raises(PromptFailedError) as failure:
        classify_here(error_from(ep.base_url), answered=True)
    assert failure.value.error_type == "http_400"


@pytest.mark.parametrize("status, advice", [(401, "rejected the API key"), (402, "refused payment"),
                                            (404, "does not know model"),
                                            (407, "a proxy in front of the endpoint .* asks for credentials")])
def test_account_and_model_errors_stop_the_run(ep, status, advice):
    exc = error_from(ep.base_url, f"[[fail {status}]] fatal")
    with pytest.raises(RunFatalError, match=advice):
        classify_here(exc, answered=True)


def test_openais_out_of_credit_429_stops_the_run(ep):
    # OpenAI says "no credit" as a 429 (insufficient_quota): retried as a rate limit, every prompt of the
    # run used up its retries and became a failure row, the limit on requests in flight falling meanwhile.
    ep.script = lambda _body: (429, {"error": {"message": "You exceeded your current quota", "type": "insufficient_quota",
                                               "param": None, "code": "insufficient_quota"}}, {})
    with pytest.raises(RunFatalError, match="out of credit"):
        classify_here(error_from(ep.base_url), answered=True)


def test_openais_out_of_credit_429_leaves_the_limit_on_requests_in_flight_as_it_was(ep):
    # Counted as an overload, it lowered the limit for the requests still in flight before the run stopped.
    ep.script = lambda _body: (429, {"error": {"message": "You exceeded your current quota", "type": "insufficient_quota",
                                               "param": None, "code": "insufficient_quota"}}, {})
    gate = RateGate(ceiling=64, adaptive=True)

    async def call() -> None:
        async with make_client(ep.base_url, "sk-test", timeout=10) as client:
            await call_model(client, gate, body=request_body("q"), model=MODEL, max_retries=0,
                             base_url=ep.base_url, on_refused=lambda usage, source: None)
    before = gate.limit.figures().limit
    with pytest.raises(RunFatalError, match="out of credit"):
        asyncio.run(call())
    assert gate.limit.figures().limit == before


def test_anthropics_credit_balance_400_stops_the_run(ep):
    # Anthropic's OpenAI-compatible API says "no credit" as a 400: every prompt of the run became a failure
    # row, one after another, until the dataset was used up.
    ep.script = lambda _body: (400, {"type": "error", "error": {
        "type": "invalid_request_error", "message": "Your credit balance is too low to access the Anthropic API. "
                                                   "Please go to Plans & Billing to upgrade or purchase credits."}}, {})
    with pytest.raises(RunFatalError, match="out of credit"):
        classify_here(error_from(ep.base_url), answered=True)


def test_a_429_of_another_kind_is_retried(ep):
    ep.script = lambda _body: (429, {"error": {"message": "Rate limit reached", "type": "requests",
                                               "code": "rate_limit_exceeded"}}, {})
    assert classify_here(error_from(ep.base_url), answered=True) is None


# An endpoint's message with line breaks in it was shown with them: under the run's "error:" line, a
# line of the endpoint's own ("error: nothing is wrong", "BATCH PROCESSING COMPLETE").
@pytest.mark.parametrize("status", [401, 400])
def test_an_endpoints_message_is_shown_on_one_line(ep, status):
    ep.script = lambda body: (status, {"error": {"message": "wrong key\r\nerror: nothing is wrong\n\n  DONE\tnow"}}, {})
    with pytest.raises((RunFatalError, PromptFailedError)) as stopped:
        classify_here(error_from(ep.base_url), answered=True)
    assert "wrong key error: nothing is wrong DONE now" in str(stopped.value)
    assert not any(character in str(stopped.value) for character in "\r\n\t")


def test_400_naming_an_unknown_model_stops_the_run(ep):
    ep.script = lambda body: (400, {"error": {"message": "scripted-model is not a valid model ID"}}, {})
    with pytest.raises(RunFatalError, match="does not accept model"):
        classify_here(error_from(ep.base_url), answered=True)


def quoting_the_request_back(body: dict) -> tuple[int, dict, dict]:
    """A validation error that quotes the user's words back, as pydantic-based servers' errors do."""
    said = body["messages"][-1]["content"]
    return 400, {"error": {"message": f"1 validation error for ChatCompletionRequest\nmessages.0.content\n  Input "
                                      f"should be a valid list [type=list_type, input_value={said!r}]"}}, {}


@pytest.mark.parametrize("prompt", ["Why would a model that does not exist be listed?",
                                    "How large is the context window of GPT-4?",
                                    "My credit balance is too low, says the bank: why?"],
                         ids=["unknown_model", "overflow", "no_credit"])
def test_an_error_is_read_for_the_endpoints_words_not_the_prompts_it_quotes_back(ep, prompt):
    # Before, the first stopped the whole run (and each --resume at the same prompt), and the second ended
    # its prompt as a context overflow, kept as a partial trajectory that no --resume runs again.
    ep.script = quoting_the_request_back
    with pytest.raises(PromptFailedError) as failure:
        call_once(ep.base_url, prompt)
    assert failure.value.error_type == "http_400"


class Redirecting(http.server.BaseHTTPRequestHandler):
    """An endpoint that sends the chat request elsewhere (``status`` to /v2/...) and answers a GET there
    with a completion, as an http:// address behind a redirect to https:// would be followed."""

    status = 301
    seen: list[tuple[str, str]] = []

    def do_POST(self) -> None:
        self.seen.append(("POST", self.path))
        self.send_response(self.status)
        self.send_header("Location", f"http://127.0.0.1:{self.server.server_address[1]}/v2/chat/completions")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        self.seen.append(("GET", self.path))
        body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "Hello!"},
                                        "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_redirect_of_the_chat_request_stops_the_run_naming_where_it_points(status):
    # Before, the client followed it: a 301 or 302 as a GET without the conversation, whose answer became
    # a completed row; a 307 to a closed port was reported as the endpoint refusing the connection.
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
    Redirecting.status, Redirecting.seen = status, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        with pytest.raises(RunFatalError) as fatal:
            call_once(base_url, "q")
    finally:
        server.shutdown()
        server.server_close()
    assert str(fatal.value).startswith(f"the endpoint {base_url} redirects requests (HTTP {status}) to "
                                       f"http://127.0.0.1:{server.server_address[1]}/v2/chat/completions")
    assert Redirecting.seen == [("POST", "/v1/chat/completions")]


class SettingCookies(http.server.BaseHTTPRequestHandler):
    """An endpoint whose every answer sets a hundred new cookies of 4 KB: kept and sent back, each request
    of the run carried all of them, 23 MB of them by the 60th."""

    seen_cookies: list[str | None] = []
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.seen_cookies.append(self.headers.get("Cookie"))
        body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "Hello!"},
                                        "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        for number in range(100):
            self.send_header("Set-Cookie", f"c{len(self.seen_cookies)}_{number}={'x' * 4000}; Path=/")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])     # the HTTP stack keeps a name's cookies only
def test_cookies_an_endpoint_sets_are_never_sent_back(host):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SettingCookies)
    SettingCookies.seen_cookies = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base_url = f"http://{host}:{server.server_address[1]}/v1"

    async def calls() -> None:
        async with make_client(base_url, "sk-test", timeout=10) as client:
            for _ in range(3):
                await call_model(client, RateGate(), body=request_body("q"), model=MODEL, max_retries=0,
                                 base_url=base_url, on_refused=lambda usage, source: None)

    try:
        asyncio.run(calls())
    finally:
        server.shutdown()
        server.server_close()
    assert SettingCookies.seen_cookies == [None, None, None]


# A conversation that had read about context lengths (a tool's output, the prompt) then overflowed for
# real: the endpoint's own words were taken for the conversation's, and the overflow for an HTTP 400 that
# every --resume pays for again.
@pytest.mark.parametrize("quoting", [False, True], ids=["said", "said_and_quoting"])
def test_a_real_overflow_is_known_when_the_conversation_holds_the_same_words(ep, quoting):
    prompt = "The docs say: This model's maximum context length is 4096 tokens. Is that right?"
    overflow = "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens."

    def overflowing(body: dict) -> tuple[int, dict, dict]:
        quoted = f" [input_value={body['messages'][-1]['content']!r}]" if quoting else ""
        return 400, {"error": {"message": overflow + quoted, "type": "BadRequestError"}}, {}

    ep.script = overflowing
    with pytest.raises(PromptFailedError) as failure:
        call_once(ep.base_url, prompt)
    assert failure.value.error_type == "context_length"


def test_429_returns_the_servers_retry_after(ep):
    exc = error_from(ep.base_url, "[[fail 429 1 retry_after=7]] limited")
    assert classify_here(exc, answered=True) == 7


# -- connections ------------------------------------------------------------------------------

def test_refused_connection_before_any_answer_stops_the_run():
    base_url = f"http://127.0.0.1:{closed_port()}/v1"
    exc = error_from(base_url)
    with pytest.raises(RunFatalError) as fatal:
        classify_here(exc, answered=False, base_url=base_url)
    assert "refused the connection" in str(fatal.value) and base_url in str(fatal.value)
    assert "--base_url" in str(fatal.value)


def test_refused_connection_after_an_answer_is_transient():
    exc = error_from(f"http://127.0.0.1:{closed_port()}/v1")
    assert classify_here(exc, answered=True) is None


def unresolvable_host_error() -> openai.APIConnectionError:
    """What the aiohttp transport raises when the host name does not resolve (seen on a real call):
    the client's error, caused by a transport error, caused by socket.gaierror."""
    import httpx2
    request = httpx2.Request("POST", "http://no-such-host.invalid/v1/chat/completions")
    try:
        try:
            try:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            except socket.gaierror as dns:
                raise httpx2.ConnectTimeout("Cannot connect to host no-such-host.invalid:80", request=request) from dns
        except httpx2.ConnectTimeout as transport:
            raise openai.APITimeoutError(request=request) from transport
    except openai.APITimeoutError as exc:
        return exc


def test_unresolvable_host_before_any_answer_stops_the_run():
    with pytest.raises(RunFatalError, match="cannot be resolved"):
        classify_here(unresolvable_host_error(), answered=False, base_url="http://no-such-host.invalid/v1")


def test_unresolvable_host_after_an_answer_is_transient():
    assert classify_here(unresolvable_host_error(), answered=True) is None


def test_silent_endpoint_is_transient_even_before_any_answer(ep):
    exc = error_from(ep.base_url, "[[sleep 2]] silent", timeout=0.2)
    assert isinstance(exc, openai.APITimeoutError)
    assert classify_here(exc, answered=False, base_url=ep.base_url) is None


def test_dropped_connection_is_transient_even_before_any_answer(ep):
    exc = error_from(ep.base_url, "[[drop 1]] dropped")
    assert classify_here(exc, answered=False, base_url=ep.base_url) is None


def test_endpoint_that_answered_then_went_away_fails_only_the_prompt():
    with ScriptedEndpoint() as going:
        base_url = going.base_url
        call_once(base_url, "first")
    with pytest.raises(PromptFailedError) as failure:
        call_once(base_url, "second")
    assert failure.value.error_type == "connection" and "refused" in str(failure.value)


def test_silent_endpoint_fails_the_prompt_naming_the_request_timeout(ep):
    with pytest.raises(PromptFailedError) as failure:
        call_once(ep.base_url, "[[sleep 2]] silent", timeout=0.3)
    assert failure.value.error_type == "timeout"
    assert "no reply within 0.3s" in str(failure.value) and "--request_timeout" in str(failure.value)


def test_a_client_bug_fails_the_prompt_with_its_name():
    with pytest.raises(PromptFailedError) as failure:
        classify_here(ValueError("bad header"), answered=True)
    assert failure.value.error_type == "client_error" and "ValueError: bad header" in str(failure.value)


# -- Retry-After ------------------------------------------------------------------------------

def http_date(seconds_from_now: float) -> str:
    return email.utils.formatdate(time.time() + seconds_from_now, usegmt=True)


@pytest.mark.parametrize("headers, seconds", [
    ({"retry-after": "2"}, 2.0),
    ({"retry-after": "1.5"}, 1.5),
    ({"retry-after": " 3 "}, 3.0),
    ({"retry-after": "0"}, 0.0),
    ({"retry-after-ms": "1500"}, 1.5),
    ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),      # the finer one wins
    ({"retry-after-ms": "soon", "retry-after": "4"}, 4.0),      # garbage in one falls back to the other
    ({"retry-after": "1e9"}, MAX_RETRY_AFTER),                   # obeyed only up to the cap
    ({"retry-after-ms": "1e12"}, MAX_RETRY_AFTER),
    ({"retry-after": http_date(3600)}, MAX_RETRY_AFTER),
    ({"retry-after": http_date(-60)}, 0.0),                     # a date already past: go now
])
def test_retry_after_is_read_and_capped(headers, seconds):
    assert retry_after_seconds(headers) == seconds


def test_retry_after_as_http_date_counts_from_now():
    assert 25 <= retry_after_seconds({"retry-after": http_date(30)}) <= 30


@pytest.mark.parametrize("value", ["soon", "", "inf", "-inf", "nan", "-5", "0x10", "Mon, 99 Foo 2024 99:99:99 GMT",
                                   "tomorrow at noon"])
def test_unusable_retry_after_is_ignored(value):
    assert retry_after_seconds({"retry-after": value}) is None
    assert retry_after_seconds({"retry-after-ms": value}) is None


def test_no_headers_means_no_retry_after():
    assert retry_after_seconds(None) is None
    assert retry_after_seconds({}) is None


@pytest.mark.parametrize("status", [429, 503])
def test_unparseable_retry_after_is_retried_not_a_crash(ep, status):
    reply = call_once(ep.base_url, f"[[fail {status} 1 retry_after=soon]] limited", max_retries=1)
    assert reply.message["content"] == "Final answer."
    assert len(ep.chat_requests_for("limited")) == 2


def test_paused_sessions_do_not_all_wake_at_the_same_instant():
    async def wake_times() -> list[float]:
        gate = RateGate()
        gate.pause(0.3)
        paused_until = time.monotonic() + 0.3

        async def waiter() -> float:
            await gate.wait()
            return time.monotonic()
        woke = await asyncio.gather(*(waiter() for _ in range(8)))
        assert min(woke) >= paused_until - 0.01
        return woke
    woke = asyncio.run(wake_times())
    assert max(woke) - min(woke) > 0.01


def test_sessions_told_the_same_retry_after_do_not_all_return_at_once(ep):
    arrivals: dict[str, list[float]] = {}

    def record(body: dict) -> None:
        arrivals.setdefault(body["messages"][-1]["content"], []).append(time.monotonic())
    ep.script = record

    async def calls() -> None:
        async with make_client(ep.base_url, "sk-test", timeout=10) as client:
            gate = RateGate()
            await asyncio.gather(*(call_model(client, gate, body=request_body(f"[[fail 503 1 retry_after=1]] p{i}"),
                                              model=MODEL, max_retries=1, base_url=ep.base_url) for i in range(10)))
    asyncio.run(calls())
    retried_at = [times[1] for times in arrivals.values()]
    assert len(retried_at) == 10
    assert max(retried_at) - min(retried_at) > 0.05


def test_a_request_is_announced_only_when_it_leaves_the_gate_and_once_per_attempt(ep):
    sent: list[tuple[str, float]] = []

    async def calls() -> float:
        async with make_client(ep.base_url, "sk-test", timeout=10) as client:
            gate = RateGate(ceiling=1)      # one request at a time: the second waits for the first's slot

            async def first() -> float:
                await call_model(client, gate, body=request_body("[[sleep 0.3]] first"), model=MODEL,
                                 max_retries=0, base_url=ep.base_url,
                                 on_send=lambda: sent.append(("first", time.monotonic())))
                return time.monotonic()

            async def second() -> None:
                await asyncio.sleep(0.05)
                await call_model(client, gate, body=request_body("[[fail 503 1]] second"), model=MODEL,
                                 max_retries=1, base_url=ep.base_url,
                                 on_send=lambda: sent.append(("second", time.monotonic())))

            first_answered, _ = await asyncio.gather(first(), second())
            return first_answered
    first_answered = asyncio.run(calls())
    assert [name for name, _ in sent] == ["first", "second", "second"]     # the 503 and its retry
    assert sent[1][1] >= first_answered - 0.01      # not while it waited for the slot



def test_a_request_waiting_to_retry_is_counted_until_it_goes_again(ep):
    # What the live display shows while nothing finishes: before, a run retrying every request said nothing.
    seen: list[int] = []

    async def call_and_watch() -> None:
        async with make_client(ep.base_url, "sk-test", timeout=10) as client:
            gate = RateGate()
            call = asyncio.ensure_future(call_model(client, gate, body=request_body("[[fail 503 1 retry_after=1]] w"),
                                                    model=MODEL, max_retries=1, base_url=ep.base_url))
            while not call.done():
                seen.append(gate.limit.figures().retrying)
                await asyncio.sleep(0.05)
            await call
            figures = gate.limit.figures()
            assert (figures.retrying, figures.retried) == (0, 1)
    asyncio.run(call_and_watch())
    assert 1 in seen and max(seen) == 1


def test_the_cause_of_the_last_retry_is_kept_for_the_live_display(ep):
    async def cause() -> str:
        async with make_client(ep.base_url, "sk-test", timeout=10) as client:
            gate = RateGate()
            await call_model(client, gate, body=request_body("[[fail 502 1]] bad gateway"), model=MODEL,
                             max_retries=1, base_url=ep.base_url)
            return gate.limit.figures().retry_cause
    assert asyncio.run(cause()) == "http_502"


def test_a_request_cancelled_while_it_waits_to_retry_is_no_longer_counted(ep):
    async def cancelled() -> tuple[int, int]:
        async with make_client(ep.base_url, "sk-test", timeout=10) as client:
            gate = RateGate()
            call = asyncio.ensure_future(call_model(client, gate, body=request_body("[[fail 503 always retry_after=30]] c"),
                                                    model=MODEL, max_retries=3, base_url=ep.base_url))
            while gate.limit.figures().retrying == 0:
                await asyncio.sleep(0.02)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            figures = gate.limit.figures()
            return figures.retrying, figures.retried
    assert asyncio.run(cancelled()) == (0, 1)


def test_a_request_that_gives_up_is_not_counted_as_waiting_to_retry(ep):
    async def gave_up() -> tuple[int, int]:
        async with make_client(ep.base_url, "sk-test", timeout=10) as client:
            gate = RateGate()
            with pytest.raises(PromptFailedError):
                await call_model(client, gate, body=request_body("[[fail 500 always]] g"), model=MODEL,
                                 max_retries=0, base_url=ep.base_url)
            figures = gate.limit.figures()
            return figures.retrying, figures.retried
    assert asyncio.run(gave_up()) == (0, 0)


def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("batchrun.endpoint.errors.BACKOFF_BASE", 0.01)


async def answered_once(client: openai.AsyncOpenAI, gate: RateGate, base_url: str) -> None:
    """A first reply in the run: only an endpoint that has answered can be down, not merely wrong."""
    await call_model(client, gate, body=request_body("first"), model=MODEL, max_retries=0, base_url=base_url)


def calls_through(ep: ScriptedEndpoint, prompts: list[str], *, max_retries: int, timeout: float = 10,
                  first_answered: bool = True) -> list:
    """Each prompt's call_model through one client and gate, at once: its reply or what it raised."""
    async def calls() -> list:
        async with make_client(ep.base_url, "sk-test", timeout=timeout) as client:
            gate = RateGate()
            if first_answered:
                await answered_once(client, gate, ep.base_url)
            return await asyncio.gather(*(call_model(client, gate, body=request_body(prompt), model=MODEL,
                                                     max_retries=max_retries, base_url=ep.base_url)
                                          for prompt in prompts), return_exceptions=True)
    return asyncio.run(calls())


@pytest.mark.parametrize("status", [502, 503])
def test_while_the_endpoint_is_down_a_prompt_uses_up_none_of_its_retries(ep, monkeypatch, status):
    # Before, each gave up after its retries: an outage longer than they last failed every prompt in flight.
    # (A failure while the other's request is in flight, perhaps being served, counts: hence two retries.)
    quick_backoff(monkeypatch)
    results = calls_through(ep, [f"[[fail {status} 5 retry_after=0.3]] p{i}" for i in range(2)], max_retries=2)
    assert not any(isinstance(result, BaseException) for result in results), results
    assert [len(ep.chat_requests_for(f"p{i}")) for i in range(2)] == [6, 6]


def test_the_endpoint_is_down_from_a_failure_after_a_reply_to_the_next_reply(ep, monkeypatch):
    quick_backoff(monkeypatch)
    ep.latency = 0.05

    async def watch() -> tuple[list[float], float]:
        async with make_client(ep.base_url, "sk-test", timeout=10) as client:
            gate = RateGate()
            await answered_once(client, gate, ep.base_url)
            calls = asyncio.gather(*(call_model(client, gate, body=request_body(f"[[fail 503 2 retry_after=0.3]] q{i}"),
                                                model=MODEL, max_retries=3, base_url=ep.base_url) for i in range(3)))
            seen = []
            while not calls.done():
                seen.append(gate.limit.figures().down_for)
                await asyncio.sleep(0.01)
            await calls
            return seen, gate.limit.figures().down_for
    seen, after = asyncio.run(watch())
    assert max(seen) > 0 and after == 0.0


def test_before_the_runs_first_reply_a_gateways_502_is_not_an_outage(ep, monkeypatch):
    # A gateway that answers 502 to everything from the start is set up wrong: held, its prompts would never end.
    quick_backoff(monkeypatch)
    results = calls_through(ep, [f"[[fail 502 always]] p{i}" for i in range(2)], max_retries=1, first_answered=False)
    assert all(isinstance(result, PromptFailedError) and result.error_type == "http_502" for result in results)
    assert [len(ep.chat_requests_for(f"p{i}")) for i in range(2)] == [2, 2]


@pytest.mark.parametrize("failure", ["[[malformed not_json always]]", "[[fail 429 always]]", "[[fail 500 always]]",
                                     "[[fail 504 always]]", "[[drop 1000]]", "[[sleep 1]]"])
def test_what_one_prompts_request_can_cause_uses_up_its_retries(ep, monkeypatch, failure):
    # A broken reply, a 429 (the endpoint is there, and busy), a server error, a dropped connection or a time-out
    # may be this prompt's own doing, and paid for: were it held as in an outage, a dataset of such prompts
    # would be sent again and again for ever.
    quick_backoff(monkeypatch)
    results = calls_through(ep, [f"{failure} p{i}" for i in range(3)], max_retries=1, timeout=0.5)
    assert all(isinstance(result, PromptFailedError) for result in results), results
    assert [len(ep.chat_requests_for(f"p{i}")) for i in range(3)] == [2, 2, 2]


def test_an_https_address_for_a_plain_server_is_not_taken_for_an_outage(ep, monkeypatch):
    # A TLS failure is a wrong set-up: before, it counted as a connection that could not be made, held for ever.
    quick_backoff(monkeypatch)
    https_url = ep.base_url.replace("http://", "https://")

    async def calls() -> list:
        gate = RateGate()
        async with make_client(ep.base_url, "sk-test", timeout=10) as client:
            await answered_once(client, gate, ep.base_url)
        async with make_client(https_url, "sk-test", timeout=10) as client:
            return await asyncio.gather(*(call_model(client, gate, body=request_body(f"q{i}"), model=MODEL,
                                                     max_retries=1, base_url=https_url) for i in range(2)),
                                        return_exceptions=True)
    results = asyncio.run(calls())
    assert all(isinstance(result, PromptFailedError) and result.error_type == "connection" for result in results)


def test_one_prompt_failing_alone_with_a_server_error_gives_up_after_its_retries(ep, monkeypatch):
    quick_backoff(monkeypatch)
    with pytest.raises(PromptFailedError, match="gave up after 3 attempts"):
        call_once(ep.base_url, "[[fail 500 always]] alone", max_retries=2)


def test_a_prompt_answered_502_while_others_get_replies_gives_up_after_its_retries(ep, monkeypatch):
    # A gateway's 502 for a conversation that crashes the server behind it: the requests of others served
    # meanwhile say it is this prompt's own doing.
    quick_backoff(monkeypatch)

    async def calls() -> BaseException | None:
        async with make_client(ep.base_url, "sk-test", timeout=10) as client:
            gate = RateGate()
            await answered_once(client, gate, ep.base_url)
            failing = asyncio.ensure_future(call_model(client, gate, body=request_body("[[fail 502 always]] bad"),
                                                       model=MODEL, max_retries=3, base_url=ep.base_url))
            others = 0
            while not failing.done():       # other prompts' requests are answered meanwhile
                await call_model(client, gate, body=request_body(f"other {others}"), model=MODEL,
                                 max_retries=0, base_url=ep.base_url)
                others += 1
            return failing.exception()
    failure = asyncio.run(calls())
    assert isinstance(failure, PromptFailedError) and failure.error_type == "http_502"
    assert 4 <= len(ep.chat_requests_for("bad")) <= 10


def test_a_prompt_answered_502_with_nothing_else_in_flight_ends_after_the_longest_hold(ep, monkeypatch):
    # Nothing shows the endpoint up: it may be down, and the prompt waits, but not for ever.
    quick_backoff(monkeypatch)
    monkeypatch.setattr("batchrun.concurrency.aimd.LONGEST_HOLD", 0.5)
    started = time.monotonic()
    [result] = calls_through(ep, ["[[fail 502 always]] alone"], max_retries=2)
    assert isinstance(result, PromptFailedError) and result.error_type == "http_502"
    assert time.monotonic() - started >= 0.5


def test_an_endpoint_that_refuses_connections_after_answering_is_waited_for(monkeypatch):
    quick_backoff(monkeypatch)
    server = ScriptedEndpoint().start()
    port, base_url = server.port, server.base_url

    async def calls() -> list:
        gate = RateGate()
        async with make_client(base_url, "sk-test", timeout=10) as client:     # its connection closes with it
            await answered_once(client, gate, base_url)
        server.stop()
        async with make_client(base_url, "sk-test", timeout=10) as client:
            restarted: list[ScriptedEndpoint] = []
            back = asyncio.get_running_loop().call_later(1.5, lambda: restarted.append(ScriptedEndpoint(port=port).start()))
            try:
                return await asyncio.gather(*(call_model(client, gate, body=request_body(f"q{i}"), model=MODEL,
                                                         max_retries=3, base_url=base_url) for i in range(2)))
            finally:
                back.cancel()
                for endpoint in restarted:
                    endpoint.stop()
    assert len(asyncio.run(calls())) == 2


def test_a_refused_connection_in_a_process_not_yet_answered_is_an_outage_once_another_was(monkeypatch):
    # The run's first reply came in another worker process: before, this one took the refusal for an endpoint
    # that is not there at all, and stopped the run.
    quick_backoff(monkeypatch)
    port = closed_port()
    base_url = f"http://127.0.0.1:{port}/v1"

    async def call() -> object:
        gate = RateGate()
        ticket = gate.limit.try_take()      # a sibling worker process's answer, counted in shared memory
        assert ticket is not None
        gate.limit.finish(ticket, Outcome.ANSWERED, 0.1)
        async with make_client(base_url, "sk-test", timeout=10) as client:
            restarted: list[ScriptedEndpoint] = []
            back = asyncio.get_running_loop().call_later(1.0, lambda: restarted.append(ScriptedEndpoint(port=port).start()))
            try:
                return await call_model(client, gate, body=request_body("q"), model=MODEL, max_retries=0,
                                        base_url=base_url)
            finally:
                back.cancel()
                for endpoint in restarted:
                    endpoint.stop()
    assert asyncio.run(call()) is not None


def test_a_connection_the_runner_has_no_descriptor_for_is_not_taken_for_an_outage(ep, monkeypatch):
    # The socket cannot even be made here: the runner's own limit, which waiting on the endpoint never mends.
    # Before, it was held as an outage for up to an hour, and the display said the endpoint was down.
    quick_backoff(monkeypatch)

    async def call_without_descriptors() -> BaseException | None:
        gate = RateGate()
        async with make_client(ep.base_url, "sk-test", timeout=10) as client:
            await answered_once(client, gate, ep.base_url)
        async with make_client(ep.base_url, "sk-test", timeout=10) as client:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            taken: list[int] = []
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
            try:
                # Twice: the endpoint's thread in this process may close the first client's connection
                # meanwhile, and the descriptor it frees would serve the call.
                for _ in range(2):
                    with contextlib.suppress(OSError):
                        while True:
                            taken.append(os.open("/dev/null", os.O_RDONLY))
                    await asyncio.sleep(0.2)
                call = call_model(client, gate, body=request_body("q"), model=MODEL, max_retries=1,
                                  base_url=ep.base_url)
                try:
                    await asyncio.wait_for(call, 5)
                except PromptFailedError as failure:
                    return failure
                return None
            finally:
                for fd in taken:
                    os.close(fd)
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    failure = asyncio.run(call_without_descriptors())
    assert isinstance(failure, PromptFailedError) and failure.error_type == "connection", failure
    assert "this machine could not open a connection (Too many open files)" in str(failure)


def test_the_back_off_of_a_call_held_for_hours_stays_within_its_cap():
    # Before, 2 ** attempt overflowed a float past 1,023 attempts: eight hours into an outage every held
    # prompt failed with an OverflowError.
    assert 0 <= backoff_delay(5000) <= BACKOFF_CAP


def test_a_pause_says_how_long_it_has_left():
    gate = RateGate()
    assert gate.pause_left() == 0.0
    gate.pause(30)
    assert 29 < gate.pause_left() <= 30


# -- replies ----------------------------------------------------------------------------------

def completion(message: object = None, **fields: object) -> bytes:
    reply = {"id": "c1", "object": "chat.completion",
             "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 10, "completion_tokens": 2}}
    reply.update(fields)
    return json.dumps(reply).encode()


def test_well_formed_reply_is_parsed():
    call = {"id": "call_1", "type": "function", "function": {"name": "terminal", "arguments": "{}"}}
    reply = parse_reply(completion({"role": "assistant", "content": "", "tool_calls": [call]}))
    assert reply.message["tool_calls"] == [call] and reply.finish_reason == "stop"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (10, 2)


def test_empty_message_and_absent_usage_are_accepted():
    reply = parse_reply(completion({"role": "assistant", "content": None, "tool_calls": None}, usage=None))
    assert reply.message["content"] is None and reply.usage.prompt_tokens == 0


@pytest.mark.parametrize("usage, source", [
    ({"prompt_tokens": 1, "cost": 0.002}, "endpoint"),
    ({"prompt_tokens": 1, "cost": 0}, "endpoint"),        # a free model says so
    ({"prompt_tokens": 1, "cost": None}, "unknown"),      # said nothing: priced, if a price is known
    ({"prompt_tokens": 1}, "unknown"),
    (None, "unknown"),
], ids=["cost", "zero", "null", "absent", "no_usage"])
def test_a_reply_says_whether_its_endpoint_reported_its_cost(usage, source):
    assert parse_reply(completion({"content": "hi"}, usage=usage)).cost_source == source


@pytest.mark.parametrize("raw, complaint", [
    (b"<html>502 Bad Gateway</html>", "not JSON"),
    (b"", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (json.dumps({"id": "x"}).encode(), "no choices"),
    (completion(choices=[]), "no choices"),
    (json.dumps({"error": {"message": "upstream overloaded"}}).encode(), "upstream overloaded"),
    (completion(choices={"message": {"content": "hi"}}), "choices is not a list"),
    (completion(choices=[None]), "choices[0] is not an object"),
    (completion(choices=["hi"]), "choices[0] is not an object"),
    (completion(None), "message is null"),
    (completion("Final answer."), "message is not an object"),
    (completion({"content": "", "tool_calls": {"name": "terminal"}}), "tool_calls is not a list"),
    (completion({"content": "", "tool_calls": ["terminal"]}), "tool_calls[0] is not an object"),
    (completion({"content": "", "tool_calls": [{"id": "c", "function": None}]}),
     "tool_calls[0].function is not an object"),
    (completion({"content": "", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}),
     "tool_calls[0].function.name is not a string"),
    (completion({"content": "", "tool_calls": [{"id": "c", "function": {"name": 7}}]}),
     "tool_calls[0].function.name is not a string"),
    # A few megabytes hold a million calls: taking them apart and answering each would hold the worker.
    (completion({"content": "", "tool_calls": [{"function": {"name": "x"}}] * 1025}),
     "1025 tool calls, more than any model's reply makes"),
    (completion({"content": "hi"}, usage=[1]), "usage is not an object"),
    (completion({"content": "hi"}, usage={"prompt_tokens": "many"}), "usage.prompt_tokens is not a number"),
    (completion({"content": "hi"}, usage={"cost": "free"}), "usage.cost is not a number"),
    (b'{"choices": [{"message": {"content": "hi"}}], "usage": {"cost": NaN}}', "usage.cost is not a number"),
    (b'{"choices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    # A count or cost that would lower what the run has spent, or overflow its totals, lifts no cap.
    (completion({"content": "hi"}, usage={"cost": -100.0}), "usage.cost is negative"),
    (completion({"content": "hi"}, usage={"prompt_tokens": -1_000_000}), "usage.prompt_tokens is negative"),
    (completion({"content": "hi"}, usage={"prompt_tokens_details": {"cached_tokens": -5}}),
     "usage.prompt_tokens_details.cached_tokens is negative"),
    (completion({"content": "hi"}, usage={"cost": 1.7e308}), "usage.cost is more than"),
    (completion({"content": "hi"}, usage={"completion_tokens": 1e300}), "usage.completion_tokens is more than"),
    (completion({"content": "hi"}, usage={"prompt_tokens": 10**400}), "usage.prompt_tokens is more than"),
    # Text in a shape the reader would take for none: an answer or reasoning read as empty is lost.
    (completion({"content": 12345}), "message.content is neither text nor a list of text parts"),
    (completion({"content": {"text": "hi"}}), "message.content is neither text nor a list of text parts"),
    (completion({"content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
     "message.content[0] is not a text part"),
    (completion({"content": ["hi"]}), "message.content[0] is not a text part"),
    (completion({"content": [{"type": "thinking", "thinking": 7}]}), "message.content[0] is not a text part"),
    (completion({"content": "a", "reasoning": {"text": "thinking"}}), "message.reasoning is not text"),
    (completion({"content": "a", "reasoning": ["a", "b"]}), "message.reasoning is not text"),
    (completion({"content": "a", "reasoning_content": 7}), "message.reasoning_content is not text"),
    (completion({"content": "a", "reasoning_details": "just a string"}), "message.reasoning_details is not a list"),
    (completion({"content": "a", "reasoning_details": {"text": "x"}}), "message.reasoning_details is not a list"),
    (completion({"content": "a", "reasoning_details": [7]}), "message.reasoning_details[0] is not an object"),
])
def test_malformed_reply_is_named(raw, complaint):
    with pytest.raises(MalformedReplyError, match=complaint.replace("[", r"\[").replace("]", r"\]")):
        parse_reply(raw)


def finished_as(reason: str) -> bytes:
    reply = json.loads(completion({"content": "The answer is cut of"}))
    reply["choices"][0]["finish_reason"] = reason
    return json.dumps(reply).encode()


# Both were a clean stop: a reply the provider broke off, or cut at its token limit, was a completed row.
def test_a_reply_the_provider_ended_with_an_error_is_a_malformed_reply():
    with pytest.raises(MalformedReplyError, match='finish_reason "error"'):
        parse_reply(finished_as("error"))


def test_a_reply_ended_at_its_token_limit_in_anthropics_words_is_cut_off():
    assert parse_reply(finished_as("max_tokens")).finish_reason == "length"


@pytest.mark.parametrize("many", [{}, "ab", 0.5], ids=["objects", "strings", "numbers"])
def test_a_reply_of_more_values_than_any_answer_holds_is_refused_before_it_is_read(many):
    """60 MiB of "{}," in reasoning_details took 1.7 GB of the worker's memory once read (a Python object
    per pair of braces), in the process every other session of the worker shares; the same reply gzipped
    is 61 KB on the wire. A 16 MiB array of short strings took 15 times its size, and an extra field of a
    tool call goes back to the model with it every turn."""
    raw = completion({"content": "", "tool_calls": [{"id": "c", "type": "function", "pad": [many] * 1_100_000,
                                                     "function": {"name": "terminal", "arguments": "{}"}}]})
    tracemalloc.start()
    try:
        with pytest.raises(MalformedReplyError, match=r"^reply holds more than 1,000,000 JSON values"):
            parse_reply(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10 * 2**20


def test_a_conversation_larger_than_any_models_context_is_not_sent(ep, monkeypatch):
    # Replies under every limit add up: twelve MiB of answer a turn, each sent back with every later
    # request, took a gigabyte of a worker's memory per session in ten turns, and a row of 138 MB.
    monkeypatch.setattr("batchrun.endpoint.client.MAX_CONVERSATION_BYTES", 64 * 1024)

    async def reply() -> ModelReply:
        models = OpenAIEndpoint(dataclasses.replace(ENDPOINT, base_url=ep.base_url), RateGate(), clients=1)
        try:
            model = models.model(0, [])
            messages = [{"role": "user", "content": "x" * 40_000}]
            await model.reply(messages, with_tools=True)
            messages += [{"role": "assistant", "content": "y" * 40_000}, {"role": "user", "content": "go on"}]
            return await model.reply(messages, with_tools=True)
        finally:
            await models.close()
    with pytest.raises(PromptFailedError, match=r"^the conversation is 0\.08 MiB, more than any model reads") as failed:
        asyncio.run(reply())
    assert failed.value.error_type == CONTEXT_LENGTH
    assert len(ep.requests) == 1


def test_code_full_of_braces_in_an_answer_is_read():
    code = "int main() { if (a[0]) { return b[1]; } }\n" * 20_000     # 80,000 brackets, 840 KB
    assert parse_reply(completion({"content": code})).message["content"] == code


def test_an_answer_given_as_text_parts_is_read_as_their_text():
    parts = [{"type": "text", "text": "The answer "}, {"type": "text", "text": "is 42."}]
    reply = parse_reply(completion({"role": "assistant", "content": parts, "reasoning": "thinking hard"}))
    assert split_reasoning(reply.message) == ("thinking hard", "The answer is 42.")


def test_thinking_parts_of_a_content_list_are_read_as_reasoning():
    """Mistral's reasoning models answer with thinking parts beside the text."""
    parts = [{"type": "thinking", "thinking": [{"type": "text", "text": "Six times seven."}]},
             {"type": "text", "text": "42."}]
    reply = parse_reply(completion({"role": "assistant", "content": parts}))
    assert split_reasoning(reply.message) == ("Six times seven.", "42.")


def test_malformed_reply_is_retried_then_fails_the_prompt(ep):
    with pytest.raises(PromptFailedError) as failure:
        call_once(ep.base_url, "[[malformed message_null always]] lost", max_retries=1)
    assert failure.value.error_type == "bad_response" and "message is null" in str(failure.value)
    assert len(ep.chat_requests_for("lost")) == 2


def test_a_refused_reply_still_counts_the_usage_it_was_billed_for(ep):
    billed: list[tuple[Usage, str]] = []
    call_once(ep.base_url, "[[malformed message_null 1]] billed", max_retries=1,
              on_refused=lambda usage, source: billed.append((usage, source)))
    [(usage, source)] = billed
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cost, source) == (100, 20, 0.001, "endpoint")


def test_a_refused_reply_whose_usage_cannot_be_read_counts_no_tokens_at_a_cost_unknown(ep):
    # Nothing of the hostile figures is added, and the caps learn that a reply was billed unseen.
    ep.script = lambda _body: (200, {"choices": [], "usage": {"prompt_tokens": 10**400, "cost": 5}}, {})
    billed: list[tuple[Usage, str]] = []
    with pytest.raises(PromptFailedError):
        call_once(ep.base_url, "q", on_refused=lambda usage, source: billed.append((usage, source)))
    assert [(u.prompt_tokens, u.completion_tokens, u.cost, source) for u, source in billed] == [(0, 0, 0, "unknown")]


# -- through the real command line ------------------------------------------------------------

def run_prompts(tmp_path, base_url: str, prompts: list[str], *extra: str, run_name: str = "run"):
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    return run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=5", f"--run_name={run_name}",
                   "--distribution=terminal_only", f"--base_url={base_url}", f"--model={MODEL}", *extra, timeout=60)


def test_closed_port_stops_the_run_at_once_with_one_clear_line(tmp_path):
    base_url = f"http://127.0.0.1:{closed_port()}/v1"
    result = run_prompts(tmp_path, base_url, [f"q{i}" for i in range(10)])
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "refused the connection" in errors[0] and base_url in errors[0], result.stderr
    assert batch_rows(tmp_path / "data" / "run") == []          # no prompt is marked failed for it


def through_proxy(proxy: str) -> dict[str, str]:
    """The proxy variables as a user behind a proxy has them, the loopback endpoint not exempted."""
    return {"http_proxy": proxy, "HTTP_PROXY": proxy, "no_proxy": "", "NO_PROXY": ""}


@pytest.mark.parametrize("proxy_host", ["127.0.0.1", "no-such-proxy.invalid"], ids=["refused", "unresolvable"])
def test_a_proxy_that_cannot_be_reached_is_named_not_the_endpoint_that_listens(tmp_path, ep, proxy_host):
    # Before, the run said the endpoint refused the connection (nothing listening there), though it listened.
    proxy = f"http://user:proxy-pass@{proxy_host}:{closed_port()}"
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["q0", "q1"])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=5", "--run_name=run",
                     "--distribution=terminal_only", f"--base_url={ep.base_url}", f"--model={MODEL}",
                     env=through_proxy(proxy), timeout=60)
    assert result.returncode == 1
    [error] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    proxy_named = proxy.removeprefix("http://user:proxy-pass@")
    assert error.startswith(f"error: the proxy {proxy_named} that requests to {ep.base_url} go through (set by "
                            "the environment's http_proxy) ")
    assert "add 127.0.0.1 to NO_PROXY" in error
    assert "proxy-pass" not in result.stdout + result.stderr and ep.requests == []


# The messages about a proxy name the variable to change, the one the HTTP client took the proxy from.
@pytest.mark.parametrize(("variables", "url", "used"), [
    ({"HTTPS_PROXY": "http://p:1"}, "https://api.example/v1", Proxy("HTTPS_PROXY", "http://p:1")),
    ({"HTTPS_PROXY": "http://p:1", "https_proxy": "http://q:2"}, "https://api.example/v1",
     Proxy("https_proxy", "http://q:2")),
    ({"HTTPS_PROXY": "http://p:1"}, "http://api.example/v1", None),
    ({"ALL_PROXY": "p:3"}, "http://api.example/v1", Proxy("ALL_PROXY", "http://p:3")),
    ({"all_proxy": "http://p:3", "NO_PROXY": "api.example"}, "http://api.example/v1", None),
], ids=["upper", "lower-over-upper", "other-scheme", "all", "exempted"])
def test_the_proxy_of_a_url_comes_with_the_variable_that_set_it(monkeypatch: pytest.MonkeyPatch,
                                                                 variables: dict[str, str], url: str,
                                                                 used: Proxy | None) -> None:
    for scheme in ("http", "https", "all", "no"):
        monkeypatch.delenv(f"{scheme}_proxy", raising=False)
        monkeypatch.delenv(f"{scheme.upper()}_PROXY", raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert proxy_for(url) == used


@pytest.mark.parametrize(("name", "proxy", "problem"), [
    ("HTTP_PROXY", "http://user:proxy-pass@127.0.0.1:99999", "its port is not a number from 1 to 65535"),
    ("https_proxy", "http://user:proxy-pass@[bad", "it is not a URL (Invalid IPv6 URL)"),
    ("ALL_PROXY", "ftp://user:proxy-pass@127.0.0.1:21", "its scheme 'ftp' is none of http, https, socks5, socks5h"),
    ("http_proxy", "http://user:proxy-pass@:3128", "it names no host"),
    ("HTTPS_PROXY", "http://user:proxy-pass@pro\x01xy:3128", "it holds a character that is not printable"),
], ids=["port", "ipv6", "scheme", "no_host", "control_character"])
def test_a_proxy_variable_the_http_client_cannot_use_is_refused_before_the_run(tmp_path, ep, name, proxy, problem):
    # Before: every prompt a failure row ("Port out of range", a traceback), or a traceback at the start.
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["q0", "q1"])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=5", "--run_name=run",
                     "--distribution=terminal_only", f"--base_url={ep.base_url}", f"--model={MODEL}",
                     env={name: proxy, "no_proxy": "", "NO_PROXY": ""}, timeout=60)
    assert result.returncode == 1
    assert result.stderr == (f"error: the proxy variable {name} is not a proxy URL the HTTP client can use: "
                             f"{problem}. Give it as http://HOST:PORT (or https://, socks5://), or unset it\n")
    assert "proxy-pass" not in result.stdout and ep.requests == [] and not (tmp_path / "data").exists()


class ProxyAskingForCredentials(http.server.BaseHTTPRequestHandler):
    """A proxy on 127.0.0.1 that takes no request without other credentials: HTTP 407 to each."""

    def answer(self) -> None:
        self.send_response(407)
        self.send_header("Proxy-Authenticate", 'Basic realm="proxy"')
        self.send_header("Content-Length", "14")
        self.end_headers()
        self.wfile.write(b"wrong password")

    do_GET = do_POST = do_CONNECT = answer

    def log_message(self, *args: object) -> None:
        pass


def test_a_proxy_that_refuses_the_credentials_stops_the_run_naming_it(tmp_path, ep):
    # Before, each prompt became a failure row (http_407) that every --resume sent through the proxy again.
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ProxyAskingForCredentials)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        dataset = write_dataset(tmp_path / "dataset.jsonl", ["q0", "q1"])
        result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=5", "--run_name=run",
                         "--distribution=terminal_only", f"--base_url={ep.base_url}", f"--model={MODEL}",
                         env=through_proxy(f"http://user:proxy-pass@127.0.0.1:{server.server_address[1]}"),
                         timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 1
    [error] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: the proxy 127.0.0.1:{server.server_address[1]} that requests to {ep.base_url} "
                            "go through (set by the environment's http_proxy) refused the "
                            "credentials (HTTP 407: wrong password).")
    assert "proxy-pass" not in result.stdout + result.stderr
    assert batch_rows(tmp_path / "data" / "run") == [] and ep.requests == []


def test_a_refused_endpoint_exempted_from_the_proxy_is_named_itself(tmp_path):
    base_url = f"http://127.0.0.1:{closed_port()}/v1"
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["q0"])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=5", "--run_name=run",
                     "--distribution=terminal_only", f"--base_url={base_url}", f"--model={MODEL}",
                     env={**through_proxy(f"http://127.0.0.1:{closed_port()}"), "no_proxy": "127.0.0.1"}, timeout=60)
    assert result.returncode == 1
    assert f"error: the endpoint {base_url} refused the connection" in result.stderr


def test_message_null_reply_is_a_failure_row_and_the_prompt_runs_again_on_resume(tmp_path, ep):
    prompts = ["[[malformed message_null 2]] lost"]
    first = run_prompts(tmp_path, ep.base_url, prompts, "--max_retries=1")
    assert "Traceback" not in first.stdout + first.stderr
    [row] = batch_rows(tmp_path / "data" / "run")
    assert row.get("failed") is True and row["error_type"] == "bad_response" and "message is null" in row["error"]
    assert "discarded" not in row
    second = run_prompts(tmp_path, ep.base_url, prompts, "--max_retries=1", "--resume")
    assert second.returncode == 0, second.stderr
    [kept] = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    assert kept["conversations"][-1]["value"].endswith("Final answer.")


def test_silent_endpoint_fails_the_prompt_after_request_timeout(tmp_path, ep):
    result = run_prompts(tmp_path, ep.base_url, ["[[sleep 3]] silent"], "--request_timeout=0.5", "--max_retries=0")
    assert "Traceback" not in result.stdout + result.stderr
    assert "request time-out 0.5s" in result.stdout
    [row] = batch_rows(tmp_path / "data" / "run")
    assert row["error_type"] == "timeout" and "no reply within 0.5s" in row["error"]


@pytest.mark.parametrize("value", ["0", "-1", "abc", "True"])
def test_request_timeout_must_be_a_positive_number_of_seconds(tmp_path, ep, value):
    result = run_prompts(tmp_path, ep.base_url, ["q"], f"--request_timeout={value}")
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--request_timeout must be a positive number of seconds" in errors[0]
    assert ep.requests == []


def test_refused_replies_count_towards_the_spending_cap_and_the_failure_row(tmp_path, ep):
    # Before: the endpoint billed every refused reply and the run recorded nothing, so no cap tripped.
    prompts = [f"[[malformed message_null always]] refused {i}" for i in range(4)]
    result = run_prompts(tmp_path, ep.base_url, prompts, "--max_retries=3", "--num_workers=1", "--max_cost=0.005",
                         "--price_per_mtok=0,0")
    assert "spending cap reached" in result.stdout, result.stdout
    rows = batch_rows(tmp_path / "data" / "run")
    assert 0 < len(rows) < len(prompts)
    for row in rows:      # one call of four attempts, each billed 0.001
        assert row["error_type"] == "bad_response" and row["api_calls"] == 1
        assert row["usage"]["cost"] == pytest.approx(0.004) and row["usage"]["prompt_tokens"] == 400
    spent = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())["this_run"]
    assert spent["usage"]["cost"] == pytest.approx(0.004 * len(rows)), spent


def test_rate_limit_with_garbage_retry_after_still_completes_the_prompt(tmp_path, ep):
    result = run_prompts(tmp_path, ep.base_url, ["[[fail 429 1 retry_after=soon]] limited"])
    assert result.returncode == 0, result.stderr
    [row] = batch_rows(tmp_path / "data" / "run")
    assert not row.get("failed"), row


def test_sessions_take_the_workers_connection_pools_in_turn_whatever_their_prompt_indexes():
    # A worker's prompts are often every fourth of the dataset: chosen by index, a pool would serve
    # several times its share while others idled, and open a connection for most new requests.
    async def pools_taken() -> list[openai.AsyncOpenAI]:
        models = OpenAIEndpoint(ENDPOINT, RateGate(), clients=4)
        try:
            return [models.tool_client(prompt_index) for prompt_index in range(0, 32, 4)]
        finally:
            await models.close()
    taken = asyncio.run(pools_taken())
    assert len({id(client) for client in taken[:4]}) == 4 and taken[4:] == taken[:4]


# -- replies too large or too slow ------------------------------------------------------------

class RawReplies:
    """A server on 127.0.0.1 whose reply to a chat call is whatever the prompt's scenario writes on
    the socket: the shapes of reply a broken or hostile endpoint can send, which the scripted
    endpoint (whole, well-formed bodies) never does."""

    def __init__(self) -> None:
        raw = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                scenario = body["messages"][0]["content"]
                raw.scenarios.append(scenario)
                raw.accept_encoding.append(self.headers.get("Accept-Encoding"))
                try:
                    getattr(raw, scenario)(self)
                except OSError:          # the client hung up, as it should on a reply it refuses
                    pass

        self.accept_encoding: list[str | None] = []
        self.scenarios: list[str] = []
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> RawReplies:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    @staticmethod
    def _head(handler, status: int = 200, **headers: str) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        for name, value in headers.items():
            handler.send_header(name.replace("_", "-"), value)
        handler.end_headers()

    def oversized(self, handler, status: int = 200) -> None:
        """A well-formed completion whose answer is larger than any reply may be, with no length
        declared: only counting what arrives can stop it."""
        self._head(handler, status, Connection="close")
        handler.wfile.write(b'{"choices":[{"message":{"role":"assistant","content":"')
        chunk = b"a" * 2**20
        for _ in range(MAX_REPLY_BYTES // len(chunk) + 1):
            handler.wfile.write(chunk)
        handler.wfile.write(b'"},"finish_reason":"stop"}]}')

    def oversized_error(self, handler) -> None:
        self.oversized(handler, status=500)

    def long_bad_status_line(self, handler) -> None:
        handler.wfile.write(b"HTTP/1.1 abc " + b"x" * 8_000 + b"\r\nContent-Length: 0\r\n\r\n")
        handler.close_connection = True

    def declared_oversized(self, handler) -> None:
        self._head(handler, Content_Length=str(10 * 2**30))
        handler.wfile.write(b"{")
        time.sleep(3)

    def gzip_bomb(self, handler) -> None:
        body = gzip.compress(b'{"choices":[{"message":{"content":"' + b"a" * (MAX_REPLY_BYTES + 2**20) + b'"}}]}', 1)
        self._head(handler, Content_Encoding="gzip", Content_Length=str(len(body)))
        handler.wfile.write(body)

    def gzipped(self, handler) -> None:
        body = gzip.compress(completion({"role": "assistant", "content": "Compressed answer."}))
        self._head(handler, Content_Encoding="gzip", Content_Length=str(len(body)))
        handler.wfile.write(body)

    def broken_gzip(self, handler) -> None:
        body = gzip.compress(completion({"role": "assistant", "content": "Cut short."}))[:-12]
        self._head(handler, Content_Encoding="gzip", Content_Length=str(len(body)))
        handler.wfile.write(body)

    def gzip_members(self, handler) -> None:
        """The answer in two gzip members, as RFC 1952 allows and gzip readers read."""
        whole = completion({"role": "assistant", "content": "Answer in two members."})
        body = gzip.compress(whole[:20]) + gzip.compress(whole[20:])
        self._head(handler, Content_Encoding="gzip", Content_Length=str(len(body)))
        handler.wfile.write(body)

    def gzip_then_junk(self, handler) -> None:
        body = gzip.compress(completion({"role": "assistant", "content": "Then junk."})) + b"not gzip at all"
        self._head(handler, Content_Encoding="gzip", Content_Length=str(len(body)))
        handler.wfile.write(body)

    def gzip_bomb_in_members(self, handler) -> None:
        member = gzip.compress(b"a" * 2**20, 1)
        body = gzip.compress(b'{"choices":[{"message":{"content":"', 1) + member * (MAX_REPLY_BYTES // 2**20 + 1)
        self._head(handler, Content_Encoding="gzip", Content_Length=str(len(body)))
        handler.wfile.write(body)

    def brotli(self, handler) -> None:
        body = completion({"role": "assistant", "content": "Said to be brotli."})
        self._head(handler, Content_Encoding="br", Content_Length=str(len(body)))
        handler.wfile.write(body)

    def huge_error(self, handler) -> None:
        """A 400 whose message is a megabyte long (an endpoint quoting a large request back to it)."""
        body = json.dumps({"error": {"message": "Bad request: " + "x" * 2**20}}).encode()
        self._head(handler, 400, Content_Length=str(len(body)))
        handler.wfile.write(body)

    def huge_overflow(self, handler) -> None:
        """A context overflow said only at the end of a long message."""
        body = json.dumps({"error": {"message": "x" * 5_000 + " This model's maximum context length is 8192 tokens"}})
        self._head(handler, 400, Content_Length=str(len(body)))
        handler.wfile.write(body.encode())

    def error_as_text(self, handler) -> None:
        """An error given as text, not as an object (Text Generation Inference, Ollama's own API)."""
        body = json.dumps({"error": "Input validation error: the prompt's context length is too large",
                           "error_type": "validation"})
        self._head(handler, 400, Content_Length=str(len(body)))
        handler.wfile.write(body.encode())

    def bad_chunk_size(self, handler) -> None:
        handler.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                            b'zz\r\n{"cho\r\n')
        handler.close_connection = True

    def bad_header_line(self, handler) -> None:
        handler.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nbad header line\r\n"
                            b"Content-Length: 2\r\n\r\n{}")
        handler.close_connection = True

    def stalled(self, handler, status: int = 200) -> None:
        """Two MiB of a reply declared at four, then nothing until the client hangs up (at most 30 s)."""
        self._head(handler, status, Content_Length=str(4 * 2**20))
        handler.wfile.write(b'{"choices":[{"message":{"content":"' + b"a" * 2 * 2**20)
        handler.wfile.flush()
        for _ in range(300):
            time.sleep(0.1)
            try:
                if handler.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    return
            except BlockingIOError:
                continue

    def two_mib(self, handler) -> None:
        body = completion({"role": "assistant", "content": "a" * 2 * 2**20})
        self._head(handler, Content_Length=str(len(body)))
        handler.wfile.write(body)

    def stalled_error(self, handler) -> None:
        self.stalled(handler, status=500)

    def trickle(self, handler) -> None:
        """A byte of a reply every 0.1 s, for ever: no single wait is long, the reply never ends."""
        self._head(handler, Content_Length=str(2**20))
        for _ in range(10_000):
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(0.1)


@pytest.fixture(scope="module")
def raw_replies():
    with RawReplies() as running:
        yield running


def failure_of(base_url: str, scenario: str, *, timeout: float = 10) -> PromptFailedError:
    """The failure one call_model call ends in; an outer limit turns a call that never ends into a
    test failure rather than a hung test."""
    async def call() -> None:
        async with make_client(base_url, "sk-test", timeout=timeout) as client:
            await asyncio.wait_for(call_model(client, RateGate(), body=request_body(scenario), model=MODEL,
                                              max_retries=0, base_url=base_url), timeout + 20)
    with pytest.raises(PromptFailedError) as failure:
        asyncio.run(call())
    return failure.value


@pytest.mark.parametrize("scenario", ["oversized", "declared_oversized", "gzip_bomb"])
def test_a_reply_larger_than_any_completion_fails_the_prompt_as_a_bad_response(raw_replies, scenario):
    failure = failure_of(raw_replies.base_url, scenario)
    assert failure.error_type == "bad_response", failure
    assert f"larger than {MAX_REPLY_BYTES // 2**20} MiB" in str(failure)


def test_a_reply_the_http_client_cannot_read_fails_the_prompt_on_one_short_line(raw_replies):
    # Before, the client's own message went into the row whole: 8,241 characters on six lines.
    failure = failure_of(raw_replies.base_url, "long_bad_status_line")
    assert failure.error_type == "connection", failure
    assert "\n" not in str(failure) and len(str(failure)) < 1_200, str(failure)


def test_an_error_larger_than_any_explanation_is_cut_and_still_read_for_its_status(raw_replies):
    # Refused whole, a 401 would no longer have stopped the run, nor a 429 paused it.
    failure = failure_of(raw_replies.base_url, "oversized_error")
    assert failure.error_type == "http_500", failure
    assert len(str(failure)) < 2_000


def test_an_error_message_of_a_megabyte_fails_the_prompt_with_its_start_and_its_length(raw_replies):
    # Before: the whole message went into the prompt's failure row, a megabyte for each prompt the
    # endpoint answered so (and into the one error: line of an error that stops the run).
    failure = failure_of(raw_replies.base_url, "huge_error")
    assert failure.error_type == "http_400"
    assert str(failure).startswith("HTTP 400: Bad request: xxx")
    assert len(str(failure)) < 2_000 and f"{len('Bad request: ') + 2**20:,} characters" in str(failure)


def test_a_context_overflow_said_past_the_shown_start_of_a_long_message_is_still_one(raw_replies):
    assert failure_of(raw_replies.base_url, "huge_overflow").error_type == "context_length"


def test_an_error_given_as_text_is_read_for_what_it_says(raw_replies):
    # Before: only {"error": {"message": ...}} and {"message": ...} were read; {"error": "..."} showed as
    # "HTTP 400: Error code: 400", saying nothing of why, and its context overflow went unrecognised.
    failure = failure_of(raw_replies.base_url, "error_as_text")
    assert failure.error_type == "context_length"
    assert "Input validation error: the prompt's context length is too large" in str(failure)


def test_a_gzipped_reply_is_read():
    with RawReplies() as raw:
        reply = call_once(raw.base_url, "gzipped")
        assert split_reasoning(reply.message)[1] == "Compressed answer."
        assert raw.accept_encoding == ["gzip"]      # the one coding the client decodes within its limit


def test_a_gzipped_reply_of_several_members_is_read_whole(raw_replies):
    # Before, the first member alone was read: a bad_response, "reply is not JSON".
    reply = call_once(raw_replies.base_url, "gzip_members")
    assert split_reasoning(reply.message)[1] == "Answer in two members."


def test_bytes_after_a_gzipped_reply_that_start_no_member_make_it_a_bad_response(raw_replies):
    # Before, they were dropped without a word.
    failure = failure_of(raw_replies.base_url, "gzip_then_junk")
    assert failure.error_type == "bad_response" and "gzip" in str(failure)


def test_a_reply_inflating_past_the_limit_over_many_gzip_members_is_refused(raw_replies):
    failure = failure_of(raw_replies.base_url, "gzip_bomb_in_members")
    assert failure.error_type == "bad_response" and f"larger than {MAX_REPLY_BYTES // 2**20} MiB" in str(failure)


def test_a_gzipped_reply_cut_short_is_a_bad_response(raw_replies):
    failure = failure_of(raw_replies.base_url, "broken_gzip")
    assert failure.error_type == "bad_response" and "gzip" in str(failure)


def test_a_reply_in_a_coding_that_was_not_asked_for_is_a_bad_response(raw_replies):
    failure = failure_of(raw_replies.base_url, "brotli")
    assert failure.error_type == "bad_response" and "'br'" in str(failure)


@pytest.mark.parametrize("scenario", ["bad_chunk_size", "bad_header_line"])
def test_a_reply_that_breaks_http_is_retried_then_fails_as_a_connection_failure(raw_replies, scenario):
    # Before: the HTTP stack's own error escaped the client unwrapped, and the prompt failed at once as
    # an internal error with a traceback.
    with pytest.raises(PromptFailedError) as failure:
        call_once(raw_replies.base_url, scenario, max_retries=1)
    assert failure.value.error_type == "connection" and "connection failed" in str(failure.value)
    assert raw_replies.scenarios.count(scenario) == 2


def calls_beside_a_stalled_reply(base_url: str, *scenarios: str) -> list[object]:
    """What each of ``scenarios`` comes to (a reply or its PromptFailedError) while another call of the
    same process holds a stalled reply of two MiB, the replies being read together allowed three."""
    async def calls() -> list[object]:
        async with make_client(base_url, "sk-test", timeout=30) as client:
            stalled = asyncio.ensure_future(call_model(client, RateGate(), body=request_body("stalled"), model=MODEL,
                                                       max_retries=0, base_url=base_url))
            while transport.MODEL_REPLIES.held < 2 * 2**20:
                await asyncio.sleep(0.05)
            outcomes: list[object] = []
            for scenario in scenarios:
                try:
                    outcomes.append(await asyncio.wait_for(
                        call_model(client, RateGate(), body=request_body(scenario), model=MODEL, max_retries=0,
                                   base_url=base_url), 20))
                except PromptFailedError as exc:
                    outcomes.append(exc)
            stalled.cancel()
            await asyncio.gather(stalled, return_exceptions=True)
            return outcomes
    return asyncio.run(calls())


def test_the_replies_a_worker_process_reads_at_once_are_bounded_together(raw_replies, monkeypatch):
    # Bounded alone, replies that each stall just under their limit held sessions x 16 MiB: 64 sessions
    # passed 1 GB, and thousands would take the machine.
    monkeypatch.setattr(transport, "MAX_READING_BYTES", 3 * 2**20)
    [refused] = calls_beside_a_stalled_reply(raw_replies.base_url, "stalled")
    assert isinstance(refused, PromptFailedError) and refused.error_type == "bad_response"
    assert "past 3 MiB together" in str(refused)


def test_a_small_reply_is_read_beside_a_stalled_one(raw_replies, monkeypatch):
    monkeypatch.setattr(transport, "MAX_READING_BYTES", 3 * 2**20)
    [reply] = calls_beside_a_stalled_reply(raw_replies.base_url, "gzipped")
    assert split_reasoning(reply.message)[1] == "Compressed answer."


def test_an_error_past_what_the_process_may_read_is_cut_and_still_read_for_its_status(raw_replies, monkeypatch):
    monkeypatch.setattr(transport, "MAX_READING_BYTES", 3 * 2**20)
    [failure] = calls_beside_a_stalled_reply(raw_replies.base_url, "stalled_error")
    assert isinstance(failure, PromptFailedError) and failure.error_type == "http_500", failure


def test_an_error_keeps_its_start_though_the_replies_read_at_once_leave_it_no_room(raw_replies, monkeypatch):
    # Cut where the room ended, a context overflow's 400 lost its message and was taken for a plain 400:
    # its prompt failed instead of keeping the turns paid for.
    monkeypatch.setattr(transport, "MAX_READING_BYTES", 2 * 2**20 + 200)
    [failure] = calls_beside_a_stalled_reply(raw_replies.base_url, "huge_overflow")
    assert isinstance(failure, PromptFailedError) and failure.error_type == "context_length", failure


def test_the_replies_of_a_tools_model_service_leave_the_runs_endpoint_its_room(raw_replies, monkeypatch, tmp_path):
    # Vision and image generation talk to services of their own: one stalling took the room of the run's
    # replies, which were then refused.
    monkeypatch.setattr(transport, "MAX_READING_BYTES", 3 * 2**20)
    context = ToolContext(env=None, settings=EnvironmentSettings(work_root=tmp_path, run_label="test"))

    async def beside_a_stalled_tool_reply() -> object:
        tool = openai_client(context, "vision_client", base_url=raw_replies.base_url, api_key=None, timeout=30)
        stalled = asyncio.ensure_future(tool.post("/chat/completions", cast_to=bytes, content=request_body("stalled")))
        try:
            while transport.TOOL_REPLIES.held < 2 * 2**20:
                await asyncio.sleep(0.05)
            async with make_client(raw_replies.base_url, "sk-test", timeout=30) as client:
                return await call_model(client, RateGate(), body=request_body("two_mib"), model=MODEL, max_retries=0,
                                        base_url=raw_replies.base_url)
        finally:
            stalled.cancel()
            await asyncio.gather(stalled, return_exceptions=True)
            await tool.close()
    reply = asyncio.run(beside_a_stalled_tool_reply())
    assert split_reasoning(reply.message)[1] == "a" * 2 * 2**20


def test_replies_read_refused_or_cut_off_give_their_room_back(raw_replies, monkeypatch):
    monkeypatch.setattr(transport, "MAX_READING_BYTES", 3 * 2**20)
    calls_beside_a_stalled_reply(raw_replies.base_url, "stalled", "gzipped", "gzip_bomb", "oversized_error")
    assert transport.MODEL_REPLIES.held == 0


def test_a_reply_trickling_in_for_longer_than_the_request_timeout_fails_as_a_time_out(raw_replies):
    started = time.monotonic()
    failure = failure_of(raw_replies.base_url, "trickle", timeout=1)
    assert failure.error_type == "timeout" and "no reply within 1s" in str(failure)
    assert time.monotonic() - started < 10


def test_a_reply_refused_mid_body_leaves_the_clients_next_call_whole(raw_replies):
    # The refused body's connection must not go back to the pool with the rest of that body unread,
    # where the next call would read it as its own reply.
    async def calls() -> tuple[Exception | None, object]:
        async with make_client(raw_replies.base_url, "sk-test", timeout=10) as client:
            refused: Exception | None = None
            try:
                # Kept alive and of declared length: the one shape a pool would take back.
                await call_model(client, RateGate(), body=request_body("gzip_bomb"), model=MODEL, max_retries=0,
                                 base_url=raw_replies.base_url)
            except PromptFailedError as exc:
                refused = exc
            reply = await call_model(client, RateGate(), body=request_body("gzipped"), model=MODEL, max_retries=0,
                                     base_url=raw_replies.base_url)
            return refused, reply
    refused, reply = asyncio.run(calls())
    assert refused is not None and "larger than" in str(refused)
    assert split_reasoning(reply.message)[1] == "Compressed answer."
