"""Talking to the OpenAI-compatible endpoint: one call with retries, and what each error means.

The retry loop is our own rather than the client's because a 429 must pause *every* session of
the run, across processes (:class:`RateGate`), not only the one that received it.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import ssl
import time
from dataclasses import dataclass
from typing import Any

import openai

from batchrun.rate_limit import RateGate
from batchrun.rows import Usage

BACKOFF_BASE = 1.0       # seconds before the first retry; doubles per attempt, with full jitter
BACKOFF_CAP = 60.0
REQUEST_TIMEOUT = 600.0  # one model call; long generations from slow self-hosted servers are legitimate
# The system's CA store, loaded once per process (at import, so before the pool forks workers share
# it): every client loading its own cost 30 ms, times a client per 16 sessions in each worker. Not
# tools.clients' context: that one is httpx's, and httpx comes only with the optional web extra.
TLS_CONTEXT = ssl.create_default_context()


class RunFatalError(Exception):
    """The whole run cannot work (bad key, unknown model, no credit): stop instead of failing every prompt."""


class PromptFailedError(Exception):
    """This prompt cannot be completed now; it leaves a failure row and is retried on resume."""

    def __init__(self, message: str, error_type: str) -> None:
        super().__init__(message)
        self.error_type = error_type


@dataclass
class ModelReply:
    message: dict
    finish_reason: str | None
    usage: Usage


def make_client(base_url: str, api_key: str) -> openai.AsyncOpenAI:
    """The client on its aiohttp transport: with hundreds of sessions per process, the default
    transport's pure-Python HTTP handling cost more CPU than everything else a session does."""
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=REQUEST_TIMEOUT,
                              http_client=openai.DefaultAioHttpClient(timeout=REQUEST_TIMEOUT, verify=TLS_CONTEXT))


def preload_http_stack() -> None:
    """Import what the HTTP stack loads only when its first client is built (a hundred modules, 60 ms).
    The pool calls this before forking, so workers share them instead of each loading its own; the
    client built here opens nothing and is dropped."""
    openai.DefaultAioHttpClient(verify=TLS_CONTEXT)


class ConversationBody:
    """The request bodies of one session's calls, encoded by json's C encoder (the client's own
    encoder is pure Python). A session's messages only grow, so each is encoded once, and the rest
    of the body (model, tools, options) once per session: a call costs its new messages, not the
    whole conversation and tool list again."""

    def __init__(self, fields: dict) -> None:
        rest = _encode(fields)
        self._tail = b"]" + (b"," + rest[1:] if fields else b"}")
        self._messages: list[bytes] = []

    def encode(self, messages: list[dict]) -> bytes:
        for message in messages[len(self._messages):]:
            self._messages.append(_encode(message))
        return b'{"messages":[' + b",".join(self._messages) + self._tail


def _encode(value: Any) -> bytes:
    """Compact JSON; text a tool decoded badly cannot make the body invalid UTF-8."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


def retry_after_seconds(headers: Any) -> float | None:
    """Seconds the server asked us to wait (Retry-After-Ms, Retry-After as seconds or HTTP date)."""
    if headers is None:
        return None
    millis = headers.get("retry-after-ms")
    if millis:
        try:
            return max(0.0, float(millis) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(value) if value else None
        return max(0.0, parsed.timestamp() - time.time()) if parsed else None


def _error_text(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error")
        message = inner.get("message") if isinstance(inner, dict) else body.get("message")
        if message:
            return str(message)
    return str(exc.message)


def classify(exc: Exception, *, model: str, base_url: str) -> float | None:
    """Returns for a transient error (with the server's Retry-After, if any); raises RunFatalError
    when the whole run cannot work and PromptFailedError when only this prompt cannot."""
    if isinstance(exc, (openai.APITimeoutError, openai.APIConnectionError)):
        return None
    if not isinstance(exc, openai.APIStatusError):
        raise PromptFailedError(f"{type(exc).__name__}: {exc}", "client_error")
    status = exc.status_code
    detail = _error_text(exc)
    if status == 429 or status in (408, 409) or status >= 500:
        return retry_after_seconds(exc.response.headers)
    if status == 401:
        raise RunFatalError(f"the endpoint {base_url} rejected the API key (HTTP 401: {detail}). "
                            "Check --api_key, OPENROUTER_API_KEY or OPENAI_API_KEY.")
    if status == 402:
        raise RunFatalError(f"the endpoint {base_url} refused payment (HTTP 402: {detail}). "
                            "Add credit to the account, or lower the cost with --max_samples.")
    if status == 404:
        raise RunFatalError(f"the endpoint {base_url} does not know model {model!r} or this API path "
                            f"(HTTP 404: {detail}). Check --model and --base_url (it usually ends in /v1).")
    lowered = detail.lower()
    if status == 400 and "model" in lowered and any(
            phrase in lowered for phrase in ("not a valid model", "does not exist", "invalid model", "unknown model")):
        raise RunFatalError(f"the endpoint {base_url} does not accept model {model!r} (HTTP 400: {detail}).")
    raise PromptFailedError(f"HTTP {status}: {detail}", f"http_{status}")


def backoff_delay(attempt: int) -> float:
    return random.uniform(0, min(BACKOFF_CAP, BACKOFF_BASE * 2 ** attempt))


def _usage_from(data: dict) -> Usage:
    usage = data.get("usage") or {}
    completion_details = usage.get("completion_tokens_details") or {}
    prompt_details = usage.get("prompt_tokens_details") or {}
    return Usage(prompt_tokens=int(usage.get("prompt_tokens") or 0),
                 completion_tokens=int(usage.get("completion_tokens") or 0),
                 reasoning_tokens=int(completion_details.get("reasoning_tokens") or 0),
                 cached_tokens=int(prompt_details.get("cached_tokens") or 0),
                 cost=float(usage.get("cost") or 0.0))


class BodyError(Exception):
    """A 200 response that carries an error instead of a choice (some gateways do this)."""


def parse_reply(raw: bytes) -> ModelReply:
    data = json.loads(raw)
    choices = data.get("choices") if isinstance(data, dict) else None
    if not choices:
        error = data.get("error") if isinstance(data, dict) else None
        raise BodyError(f"response without choices: {json.dumps(error or data)[:300]}")
    choice = choices[0]
    return ModelReply(message=choice.get("message") or {}, finish_reason=choice.get("finish_reason"),
                      usage=_usage_from(data))


async def call_model(client: openai.AsyncOpenAI, gate: RateGate, *, body: bytes, model: str, max_retries: int,
                     base_url: str) -> ModelReply:
    """One chat completion, retried on transient errors with back-off honouring Retry-After."""
    attempt = 0
    while True:
        await gate.wait()
        retry_after = None
        try:
            # The client's documented raw-post path: same HTTP, auth, errors and timeouts as
            # chat.completions.create, without re-validating the whole conversation on every call
            # (that walk cost more CPU than the rest of a session).
            raw = await client.post("/chat/completions", cast_to=bytes, content=body)
            return parse_reply(raw)
        except openai.APIError as exc:
            retry_after = classify(exc, model=model, base_url=base_url)
            failure: Exception = exc
        except (BodyError, ValueError) as exc:   # an error body or undecodable JSON: a broken proxy
            failure = exc
        if attempt >= max_retries:
            raise PromptFailedError(f"gave up after {attempt + 1} attempts: {failure}",
                                    _exhausted_type(failure)) from None
        delay = retry_after if retry_after is not None else backoff_delay(attempt)
        if isinstance(failure, openai.RateLimitError):
            gate.pause(delay)
        attempt += 1
        await asyncio.sleep(delay)


def _exhausted_type(exc: Exception) -> str:
    if isinstance(exc, openai.RateLimitError):
        return "rate_limited"
    if isinstance(exc, openai.APIStatusError):
        return f"http_{exc.status_code}"
    if isinstance(exc, (openai.APITimeoutError, openai.APIConnectionError)):
        return "connection"
    return "bad_response"
