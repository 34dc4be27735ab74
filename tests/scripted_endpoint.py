"""A scripted, OpenAI-compatible HTTP endpoint for tests and benchmarks.

It stands in for a paid chat-completions API.  Stdlib only.  Replies are
scripted by directives written inside the *last* ``role == "user"`` message
of each request (the dataset prompt), so one dataset line can describe the
whole conversation the agent will have::

    [[call terminal {"command": "ls"}]] [[call read_file {"path": "a.txt"}]]
    [[final All done.]] [[reasoning think]] List the files, then read a.txt.

Directive grammar (tokens may appear anywhere; everything else is prompt text):

``[[call NAME {json}]]``      one turn with one tool call (JSON optional -> ``{}``;
                              text that is not valid JSON is sent verbatim).
                              Several call directives = successive turns.
``[[calls [{"name": N, "arguments": {...}}, ...]]]``
                              one turn with several tool calls.
``[[final TEXT]]``            text of the final answer (default ``Final answer.``).
``[[reasoning FORM]]``        reasoning, reasoning_content, reasoning_details,
                              think, scratchpad or none (default ``reasoning``).
``[[fail STATUS [N|always] [retry_after=S]]]``
                              first N (default 1) requests for this prompt get
                              HTTP STATUS with an OpenAI-style error body.
``[[drop N]]``                first N requests for this prompt: connection closed
                              with no response.
``[[malformed KIND [N|always]]]``
                              first N (default 1) requests for this prompt get
                              HTTP 200 with a reply broken as KIND names (one of
                              ``MALFORMED_KINDS``: message_null, message_not_object,
                              no_choices, choices_not_list, tool_calls_not_list,
                              not_json).
``[[sleep S]]``               extra latency (seconds) per request for this prompt.
``[[invent]]``                every turn calls ``made_up_tool`` with ``{}``.
``[[invent N L]]``            every turn calls N made-up tools, each name L characters.
``[[bad_json]]``              an extra first turn calling ``terminal`` with the
                              invalid arguments string ``{"command": "echo hi"``;
                              later turns follow the script.
``[[length [N|always]]]``     the final answer comes cut off (``finish_reason:
                              "length"``, text "Part K of the answer.") N times
                              (default always), then whole.
``[[filtered]]``              the final answer is stopped by a content filter
                              (``finish_reason: "content_filter"``, text
                              ``FILTERED_TEXT``).
``[[empty [N|always] [think]]]``
                              the first N (default 1) requests for the final
                              answer get a reply with no text and no tool call
                              (``think``: only a think block).
``[[overflow T [openai|vllm|anthropic]]]``
                              every request from turn T on gets the HTTP 400 a
                              server sends when the conversation exceeds its
                              context (llama.cpp's wording unless named).
``[[reasoning_back]]``        every assistant message in a request must carry
                              back, unchanged, the reasoning fields this server
                              sent in it (as providers that sign reasoning
                              require); otherwise HTTP 400.

The *script message* is the last user message holding a directive (else the
last user message): messages the client adds itself later in a conversation
(a request to continue, or to sum up) do not replace the script. Turn number
``t`` = number of assistant messages after the script message. A request
without ``tools`` that follows a message of the client's own is answered with
the final text (a summary asked for without tools).
Request counters (fail/drop/malformed/empty) are per distinct script text,
server-wide, and cover every request of a conversation (all turns); ``reset()``
clears them.

``max_concurrent`` (constructor argument, attribute, ``--max-concurrent``) caps the chat requests
served at once, as a per-key concurrency limit does: one beyond it is answered HTTP 429 at once, with no
Retry-After, and is counted in ``rejected`` (not recorded in ``requests``). It may be changed while the
server runs; ``None`` (the default) means no cap.

``outage`` (attribute) ``(STATUS, SECONDS)``: an outage of the whole endpoint once it has answered, begun by
the first chat request that comes after a chat completion was sent: every chat request for SECONDS from then
gets HTTP STATUS with an OpenAI-style error body and ``Retry-After: 1``, as a server down for maintenance
says (recorded as any other); ``None`` (the default): none.

``reports_cost=False`` leaves ``cost`` out of each reply's usage (as OpenAI, vLLM and llama.cpp do);
``reports_usage=False`` leaves ``usage`` out of each reply altogether (as some servers and proxies do);
``tokens_by_length=True`` reports ``prompt_tokens`` as the characters of the request's messages // 4, so
longer prompts cost more tokens, as with a real model.

Run standalone: ``python tests/scripted_endpoint.py --port 8000 --latency 0.2``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = [
    "ScriptedEndpoint",
    "Script",
    "ToolCall",
    "DirectiveError",
    "parse_directives",
    "strip_directives",
    "prompt_text",
    "DEFAULT_MODEL",
    "REASONING_FORMS",
    "MALFORMED_KINDS",
    "FILTERED_TEXT",
]

DEFAULT_MODEL = "scripted-model"
DEFAULT_FINAL = "Final answer."
REASONING_FORMS = ("reasoning", "reasoning_content", "reasoning_details", "think", "scratchpad", "none")
MALFORMED_KINDS = ("message_null", "message_not_object", "no_choices", "choices_not_list", "tool_calls_not_list",
                   "not_json")
FILTERED_TEXT = "Here is how to"     # an answer a content filter stopped
BAD_JSON_ARGS = '{"command": "echo hi"'
USAGE = {
    "prompt_tokens": 100,
    "completion_tokens": 20,
    "total_tokens": 120,
    "completion_tokens_details": {"reasoning_tokens": 5},
    "prompt_tokens_details": {"cached_tokens": 10},
    "cost": 0.001,
}

ScriptHook = Callable[[dict], "tuple[int, dict, dict] | None"]


# --------------------------------------------------------------------------- parsing


class DirectiveError(ValueError):
    """A malformed ``[[...]]`` directive (answered with HTTP 400)."""


@dataclass
class ToolCall:
    name: str
    arguments: str  # the raw arguments string sent to the client


@dataclass
class Script:
    turns: list[list[ToolCall]] = field(default_factory=list)
    final: str = DEFAULT_FINAL
    reasoning: str = "reasoning"
    fail_status: int | None = None
    fail_count: float = 0  # math.inf for "always"
    retry_after: str | None = None
    drop_count: float = 0
    malformed: str | None = None  # one of MALFORMED_KINDS
    malformed_count: float = 0
    sleep: float = 0.0
    invent: bool = False
    invent_count: int = 1
    invent_name_chars: int = 0      # 0: the name made_up_tool
    bad_json: bool = False
    length_count: float = 0
    filtered: bool = False
    empty_count: float = 0
    empty_think: bool = False
    overflow_turn: int | None = None
    overflow_style: str = "llamacpp"
    reasoning_back: bool = False
    text: str = ""  # the prompt with directives removed

    def plan(self) -> list[list[ToolCall]]:
        """Tool-call turns before the final answer (not used when ``invent``)."""
        head = [[ToolCall("terminal", BAD_JSON_ARGS)]] if self.bad_json else []
        return head + self.turns


_OPEN = re.compile(r"\[\[([A-Za-z_]+)")
_DECODER = json.JSONDecoder()


def _count(token: str, what: str) -> float:
    if token == "always":
        return float("inf")
    try:
        n = int(token)
    except ValueError:
        raise DirectiveError(f"{what}: expected a count or 'always', got {token!r}") from None
    if n < 0:
        raise DirectiveError(f"{what}: negative count")
    return n


def _args_text(value: Any) -> str:
    if value is None:
        return "{}"
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _parse_call(text: str, pos: int) -> tuple[ToolCall, int]:
    """Parse ``NAME [json]]]`` starting at ``pos``; return call and index after ``]]``."""
    m = re.compile(r"\s*([^\s\]]+)\s*").match(text, pos)
    if not m:
        raise DirectiveError("call: missing tool name")
    name, pos = m.group(1), m.end()
    if text.startswith("]]", pos):
        return ToolCall(name, "{}"), pos + 2
    try:
        _, end = _DECODER.raw_decode(text, pos)
        tail = re.compile(r"\s*\]\]").match(text, end)
        if tail:
            return ToolCall(name, text[pos:end]), tail.end()
    except json.JSONDecodeError:
        pass
    close = text.find("]]", pos)  # not JSON: send the raw text verbatim
    if close < 0:
        raise DirectiveError("call: missing closing ]]")
    return ToolCall(name, text[pos:close].strip()), close + 2


def _parse_calls(text: str, pos: int) -> tuple[list[ToolCall], int]:
    m = re.compile(r"\s*").match(text, pos)
    try:
        value, end = _DECODER.raw_decode(text, m.end())
    except json.JSONDecodeError as exc:
        raise DirectiveError(f"calls: invalid JSON list: {exc}") from None
    tail = re.compile(r"\s*\]\]").match(text, end)
    if not tail:
        raise DirectiveError("calls: missing closing ]]")
    if not isinstance(value, list) or not value:
        raise DirectiveError("calls: expected a non-empty JSON list")
    calls = []
    for item in value:
        if not isinstance(item, dict) or "name" not in item:
            raise DirectiveError('calls: each item needs "name" (and optional "arguments")')
        calls.append(ToolCall(str(item["name"]), _args_text(item.get("arguments"))))
    return calls, tail.end()


def parse_directives(text: str) -> Script:
    """Parse every ``[[...]]`` directive in ``text``.  Unknown keywords are left as text."""
    script = Script()
    kept: list[str] = []
    pos = 0
    while True:
        m = _OPEN.search(text, pos)
        if not m:
            kept.append(text[pos:])
            break
        kw = m.group(1).lower()
        start, after = m.start(), m.end()
        if kw == "call":
            call, end = _parse_call(text, after)
            script.turns.append([call])
        elif kw == "calls":
            calls, end = _parse_calls(text, after)
            script.turns.append(calls)
        elif kw in ("final", "reasoning", "fail", "drop", "malformed", "sleep", "invent", "bad_json", "length",
                    "filtered", "empty", "overflow", "reasoning_back"):
            close = text.find("]]", after)
            if close < 0:
                raise DirectiveError(f"{kw}: missing closing ]]")
            arg = text[after:close].strip()
            end = close + 2
            if kw == "final":
                script.final = arg
            elif kw == "reasoning":
                if arg not in REASONING_FORMS:
                    raise DirectiveError(f"reasoning: unknown form {arg!r}; one of {REASONING_FORMS}")
                script.reasoning = arg
            elif kw == "fail":
                parts = arg.split()
                rest = []
                for p in parts:
                    if p.startswith("retry_after="):
                        script.retry_after = p.split("=", 1)[1]
                    else:
                        rest.append(p)
                if not rest or not rest[0].isdigit():
                    raise DirectiveError("fail: expected [[fail STATUS [N|always] [retry_after=S]]]")
                script.fail_status = int(rest[0])
                script.fail_count = _count(rest[1], "fail") if len(rest) > 1 else 1
            elif kw == "drop":
                script.drop_count = _count(arg or "1", "drop")
            elif kw == "malformed":
                parts = arg.split()
                if len(parts) not in (1, 2) or parts[0] not in MALFORMED_KINDS:
                    raise DirectiveError("malformed: expected [[malformed KIND [N|always]]], "
                                         f"KIND one of {MALFORMED_KINDS}")
                script.malformed = parts[0]
                script.malformed_count = _count(parts[1], "malformed") if len(parts) > 1 else 1
            elif kw == "sleep":
                try:
                    script.sleep = float(arg)
                except ValueError:
                    raise DirectiveError(f"sleep: expected seconds, got {arg!r}") from None
            elif kw == "invent":
                script.invent = True
                if arg:
                    try:
                        script.invent_count, script.invent_name_chars = map(int, arg.split())
                    except ValueError:
                        raise DirectiveError(f"invent: expected [[invent]] or [[invent N L]], got {arg!r}") from None
            elif kw == "bad_json":
                script.bad_json = True
            elif kw == "length":
                script.length_count = _count(arg or "always", "length")
            elif kw == "filtered":
                script.filtered = True
            elif kw == "empty":
                parts = arg.split()
                script.empty_think = "think" in parts
                counts = [p for p in parts if p != "think"]
                script.empty_count = _count(counts[0], "empty") if counts else 1
            elif kw == "overflow":
                parts = arg.split()
                if not parts or not parts[0].isdigit() or (len(parts) > 1 and parts[1] not in OVERFLOW_ERRORS):
                    raise DirectiveError(f"overflow: expected [[overflow T [{'|'.join(OVERFLOW_ERRORS)}]]]")
                script.overflow_turn = int(parts[0])
                script.overflow_style = parts[1] if len(parts) > 1 else "llamacpp"
            elif kw == "reasoning_back":
                script.reasoning_back = True
        else:  # not a directive: keep it as prompt text
            kept.append(text[pos:after])
            pos = after
            continue
        kept.append(text[pos:start])
        pos = end
    script.text = re.sub(r"\s+", " ", "".join(kept)).strip()
    return script


def strip_directives(text: str) -> str:
    """The prompt text with all directives removed (whitespace collapsed)."""
    return parse_directives(text).text


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _user_messages(messages: list) -> list[tuple[int, str]]:
    return [(i, _content_text(m.get("content"))) for i, m in enumerate(messages)
            if isinstance(m, dict) and m.get("role") == "user"]


def _script_message(messages: list) -> tuple[int, str]:
    """(index, text) of the script message: the last user message holding a directive, else the last one."""
    users = _user_messages(messages)
    for i, text in reversed(users):
        if _OPEN.search(text):
            return i, text
    return users[-1] if users else (-1, "")


def prompt_text(body: dict) -> str:
    """Text of the script message of a chat request body."""
    messages = body.get("messages") if isinstance(body, dict) else None
    return _script_message(messages if isinstance(messages, list) else [])[1]


# --------------------------------------------------------------------------- replies


def _error_body(status: int, message: str, etype: str | None = None, code: str | None = None) -> dict:
    if etype is None:
        etype = {
            400: "invalid_request_error",
            401: "invalid_request_error",
            403: "permission_error",
            404: "invalid_request_error",
            429: "requests",
        }.get(status, "server_error" if status >= 500 else "invalid_request_error")
    if code is None and status == 429:
        code = "rate_limit_exceeded"
    return {"error": {"message": message, "type": etype, "param": None, "code": code}}


def _assistant_message(script: Script, t: int, content: str, calls: list[ToolCall]) -> dict:
    reasoning = f"Reasoning for turn {t}."
    form = script.reasoning
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if form == "think":
        msg["content"] = f"<think>{reasoning}</think>{content}"
    elif form == "scratchpad":
        msg["content"] = f"<REASONING_SCRATCHPAD>{reasoning}</REASONING_SCRATCHPAD>{content}"
    elif form == "reasoning":
        msg["reasoning"] = reasoning
    elif form == "reasoning_content":
        msg["reasoning_content"] = reasoning
    elif form == "reasoning_details":    # signed, as providers that check it on the next call send it
        msg["reasoning_details"] = [{"type": "reasoning.text", "text": reasoning, "signature": f"sig-{t}",
                                     "format": "anthropic-claude-v1", "index": 0}]
    if calls:
        msg["tool_calls"] = [
            {"id": f"call_{t}_{i}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)
        ]
    return msg


def _invented_calls(script: Script) -> list[ToolCall]:
    if not script.invent_name_chars:
        return [ToolCall("made_up_tool", "{}")]
    return [ToolCall(f"made_up_{i}_".ljust(script.invent_name_chars, "x"), "{}") for i in range(script.invent_count)]


def build_turn(script: Script, t: int) -> tuple[dict, str]:
    """The assistant message and finish_reason for turn ``t`` of ``script``."""
    if script.invent:
        return _assistant_message(script, t, "", _invented_calls(script)), "tool_calls"
    plan = script.plan()
    if t < len(plan):
        return _assistant_message(script, t, "", plan[t]), "tool_calls"
    piece = t - len(plan)
    if piece < script.length_count:
        return _assistant_message(script, t, f"Part {piece + 1} of the answer.", []), "length"
    if script.filtered:
        return _assistant_message(script, t, FILTERED_TEXT, []), "content_filter"
    return _assistant_message(script, t, script.final, []), "stop"


def empty_turn(script: Script, t: int) -> dict:
    """A final answer with no text: nothing at all, or (``think``) only a think block."""
    message = _assistant_message(script, t, "", [])
    if script.empty_think:
        message = {"role": "assistant", "content": f"<think>Reasoning for turn {t}.</think>"}
    return message


# What servers answer (HTTP 400) when a conversation no longer fits the model's context.
OVERFLOW_ERRORS = {
    "llamacpp": ("the request exceeds the available context size, try increasing it", "exceed_context_size_error",
                 None),
    "openai": ("This model's maximum context length is 8192 tokens. However, your messages resulted in 9001 "
               "tokens. Please reduce the length of the messages.", "invalid_request_error", "context_length_exceeded"),
    "vllm": ("This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
             "(4000 in the messages, 1000 in the completion). Please reduce the length of the messages or "
             "completion.", "BadRequestError", None),
    "anthropic": ("prompt is too long: 210000 tokens > 200000 maximum", "invalid_request_error", None),
}


def reasoning_not_sent_back(script: Script, messages: list, script_index: int) -> str | None:
    """What is wrong with the reasoning the client sent back in its assistant messages, if anything:
    each must carry the reasoning field this server put in it, exactly."""
    t = 0
    for message in messages[script_index + 1:]:
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        sent = _assistant_message(script, t, "", [])
        for key in ("reasoning", "reasoning_content", "reasoning_details"):
            if key in sent and message.get(key) != sent[key]:
                return f"assistant message {t}: {key} was not sent back as received"
        t += 1
    return None


def malformed_reply(kind: str, completion: dict) -> tuple[Any, str]:
    """``completion`` broken the way ``kind`` names, as (body, content type): what a buggy server or
    proxy sends with HTTP 200."""
    if kind == "not_json":
        return "<html><body>502 Bad Gateway</body></html>", "text/html"
    broken = json.loads(json.dumps(completion))
    choice = broken["choices"][0]
    if kind == "message_null":
        choice["message"] = None
    elif kind == "message_not_object":
        choice["message"] = choice["message"]["content"]
    elif kind == "no_choices":
        broken["choices"] = []
    elif kind == "choices_not_list":
        broken["choices"] = choice
    elif kind == "tool_calls_not_list":
        choice["message"]["tool_calls"] = {"name": "terminal", "arguments": "{}"}
    return broken, "application/json"


def _sse(completion: dict, include_usage: bool) -> bytes:
    """Render a completion as a chat.completion.chunk event stream."""
    base = {k: completion[k] for k in ("id", "created", "model")}
    base["object"] = "chat.completion.chunk"
    choice = completion["choices"][0]
    msg = dict(choice["message"])
    delta: dict[str, Any] = {k: v for k, v in msg.items() if k != "tool_calls"}
    if "tool_calls" in msg:
        delta["tool_calls"] = [dict(tc, index=i) for i, tc in enumerate(msg["tool_calls"])]
    chunks = [
        dict(base, choices=[{"index": 0, "delta": delta, "finish_reason": None}]),
        dict(base, choices=[{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]),
    ]
    if include_usage:
        chunks.append(dict(base, choices=[], usage=completion["usage"]))
    out = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return out.encode()


# --------------------------------------------------------------------------- server


class _Server(ThreadingHTTPServer):
    request_queue_size = 256
    daemon_threads = True
    allow_reuse_address = True
    endpoint: ScriptedEndpoint

    def handle_error(self, request, client_address):  # silence client disconnects etc.
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format, *args):
        pass

    # -- plumbing
    def _send(self, status: int, body: Any, headers: dict | None = None, content_type: str = "application/json"):
        if isinstance(body, (bytes, bytearray)):
            data = bytes(body)
        elif isinstance(body, str):
            data = body.encode()
        else:
            data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _drop(self):
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _authorized(self) -> bool:
        key = self.server.endpoint.api_key
        if key is None:
            return True
        if self.headers.get("Authorization", "") == f"Bearer {key}":
            return True
        self._send(401, _error_body(401, "Incorrect API key provided", "invalid_request_error", "invalid_api_key"))
        return False

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/")

    # -- verbs
    def do_GET(self):
        self._read_body()
        if self._path() in ("/v1/models", "/models"):
            if not self._authorized():
                return
            ep = self.server.endpoint
            names = sorted(ep.models) if ep.models else [DEFAULT_MODEL]
            data = [{"id": m, "object": "model", "created": 0, "owned_by": "scripted"} for m in names]
            self._send(200, {"object": "list", "data": data})
        else:
            self._send(404, _error_body(404, f"Unknown path {self.path}"))

    def do_POST(self):
        raw = self._read_body()
        if self._path() not in ("/v1/chat/completions", "/chat/completions"):
            self._send(404, _error_body(404, f"Unknown path {self.path}"))
            return
        try:
            body = json.loads(raw or b"null")
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as exc:
            self._send(400, _error_body(400, f"Invalid JSON body: {exc}"))
            return
        ep = self.server.endpoint
        if not ep._admit():
            self._send(429, _error_body(429, f"Too many requests at once (at most {ep.max_concurrent})"))
            return
        try:
            reply = ep._handle_chat(body, self.headers)
        finally:
            ep._release()
        if reply is None:
            self._drop()
            return
        status, payload, headers, ctype = reply
        self._send(status, payload, headers, ctype)


class ScriptedEndpoint:
    """Scripted OpenAI-compatible server.  See the module docstring for directives.

    Attributes: ``requests`` (every chat request body, errors included),
    ``request_headers`` (parallel list of header dicts), ``counts`` (requests
    per prompt text), ``script`` (optional override hook: ``body -> (status,
    body, headers) | None``).
    """

    def __init__(
        self,
        api_key: str | None = None,
        models: set[str] | None = None,
        latency: float = 0.0,
        port: int = 0,
        host: str = "127.0.0.1",
        max_concurrent: int | None = None,
        reports_cost: bool = True,
        tokens_by_length: bool = False,
        reports_usage: bool = True,
    ):
        self.api_key = api_key
        self.reports_cost = reports_cost            # False: usage without "cost", as most endpoints send it
        self.tokens_by_length = tokens_by_length    # True: prompt_tokens = characters of the messages // 4
        self.reports_usage = reports_usage          # False: no "usage" in the reply, as some servers and proxies
        self.models = set(models) if models else None
        self.latency = latency
        self.max_concurrent = max_concurrent
        self.outage: tuple[int, float] | None = None     # (status, seconds) once a completion was sent
        self._outage_ends: float | None = None
        self._completed = False      # a chat completion was sent
        self.rejected = 0          # requests answered 429 for exceeding max_concurrent
        self._serving = 0          # chat requests being served now
        self.script: ScriptHook | None = None
        self.requests: list[dict] = []
        self.request_headers: list[dict] = []
        self.counts: dict[str, int] = {}
        self.empty_counts: dict[str, int] = {}   # final-answer requests per script text (for [[empty]])
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._server = _Server((host, port), _Handler)
        self._server.endpoint = self
        self._thread: threading.Thread | None = None

    # -- lifecycle
    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> ScriptedEndpoint:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="scripted-endpoint", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> ScriptedEndpoint:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- inspection
    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.request_headers.clear()
            self.counts.clear()
            self.empty_counts.clear()

    def chat_requests_for(self, text: str) -> list[dict]:
        """Recorded chat bodies whose last user message contains ``text``."""
        with self._lock:
            bodies = list(self.requests)
        return [b for b in bodies if text in prompt_text(b)]

    # -- request handling (called from handler threads)
    def _admit(self) -> bool:
        """Room for one more chat request under ``max_concurrent``; counted in ``rejected`` otherwise."""
        with self._lock:
            if self.max_concurrent is not None and self._serving >= self.max_concurrent:
                self.rejected += 1
                return False
            self._serving += 1
            return True

    def _release(self) -> None:
        with self._lock:
            self._serving -= 1

    def _handle_chat(self, body: dict, headers) -> tuple[int, Any, dict, str] | None:
        """Returns (status, payload, headers, content_type), or None to drop the connection."""
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        user_idx, prompt = _script_message(messages)
        with self._lock:
            self.requests.append(body)
            self.request_headers.append(dict(headers.items()))
            k = self.counts.get(prompt, 0)
            self.counts[prompt] = k + 1

        if self.latency:
            time.sleep(self.latency)
        if (outage := self.outage) is not None:
            status, seconds = outage
            with self._lock:
                if self._outage_ends is None and self._completed:
                    self._outage_ends = time.monotonic() + seconds
                down = self._outage_ends is not None and time.monotonic() < self._outage_ends
            if down:
                return status, _error_body(status, "The service is down"), {"Retry-After": "1"}, "application/json"
        if self.api_key is not None and headers.get("Authorization", "") != f"Bearer {self.api_key}":
            return 401, _error_body(401, "Incorrect API key provided", "invalid_request_error", "invalid_api_key"), {}, "application/json"
        model = body.get("model")
        if self.models is not None and model not in self.models:
            return 404, _error_body(404, f"The model `{model}` does not exist", "invalid_request_error", "model_not_found"), {}, "application/json"

        hook = self.script
        if hook is not None:
            out = hook(body)
            if out is not None:
                status, payload, extra = out
                return status, payload, dict(extra or {}), "application/json"

        try:
            script = parse_directives(prompt)
        except DirectiveError as exc:
            return 400, _error_body(400, f"Bad scripted directive: {exc}"), {}, "application/json"
        if script.sleep:
            time.sleep(script.sleep)
        if k < script.drop_count:
            return None
        if script.fail_status is not None and k < script.fail_count:
            extra = {"Retry-After": script.retry_after} if script.retry_after is not None else {}
            msg = f"Scripted failure {script.fail_status} (request {k + 1} for this prompt)"
            return script.fail_status, _error_body(script.fail_status, msg), extra, "application/json"

        t = sum(1 for m in messages[user_idx + 1 :] if isinstance(m, dict) and m.get("role") == "assistant")
        if script.reasoning_back and (wrong := reasoning_not_sent_back(script, messages, user_idx)):
            return 400, _error_body(400, wrong), {}, "application/json"
        if script.overflow_turn is not None and t >= script.overflow_turn:
            text, etype, code = OVERFLOW_ERRORS[script.overflow_style]
            return 400, _error_body(400, text, etype, code), {}, "application/json"
        own_message_last = _user_messages(messages)[-1][0] != user_idx if user_idx >= 0 else False
        if "tools" not in body and own_message_last:      # a summary asked for without tools
            message, finish = _assistant_message(script, t, script.final, []), "stop"
        else:
            message, finish = build_turn(script, t)
            if finish == "stop" and script.empty_count:
                with self._lock:
                    empties = self.empty_counts.get(prompt, 0)
                    self.empty_counts[prompt] = empties + 1
                if empties < script.empty_count:
                    message = empty_turn(script, t)
        completion = {
            "id": f"chatcmpl-scripted-{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model if model is not None else DEFAULT_MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": self._usage(messages),
        }
        if not self.reports_usage:
            del completion["usage"]
        self._completed = True
        if k < script.malformed_count:
            broken, content_type = malformed_reply(script.malformed, completion)
            return 200, broken, {}, content_type
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            return 200, _sse(completion, bool(opts.get("include_usage"))), {"Cache-Control": "no-cache"}, "text/event-stream"
        return 200, completion, {}, "application/json"


    def _usage(self, messages: list) -> dict:
        usage = json.loads(json.dumps(USAGE))
        if self.tokens_by_length:
            usage["prompt_tokens"] = sum(len(json.dumps(m)) for m in messages) // 4
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if not self.reports_cost:
            del usage["cost"]
        return usage


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Scripted OpenAI-compatible endpoint (for tests, benchmarks, demos).")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--latency", type=float, default=0.0, help="seconds of sleep per chat request")
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    ap.add_argument("--models", default=None, help="comma-separated accepted model names (default: any)")
    ap.add_argument("--max-concurrent", type=int, default=None,
                    help="serve at most this many chat requests at once; answer 429 (no Retry-After) beyond")
    args = ap.parse_args(argv)
    models = {m.strip() for m in args.models.split(",") if m.strip()} if args.models else None
    ep = ScriptedEndpoint(api_key=args.api_key, models=models, latency=args.latency, port=args.port, host=args.host,
                          max_concurrent=args.max_concurrent)
    print(f"http://{args.host}:{ep.port}/v1", flush=True)

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)  # benchmarks stop it with SIGTERM
    signal.signal(signal.SIGINT, _interrupt)
    try:
        ep._server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        ep._server.server_close()


if __name__ == "__main__":
    main()
