"""What an endpoint's error means — the run cannot go on, this prompt failed, or try again — and how long
to wait before trying again (back-off, the server's Retry-After)."""

from __future__ import annotations

import email.utils
import errno
import itertools
import math
import random
import re
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC
from typing import Any
from urllib.parse import urlparse

import aiohttp
import openai

from batchrun.env_vars import Proxy, proxy_for
from batchrun.model import CONTEXT_LENGTH, PromptFailedError, RunFatalError

# The server says it has more than it can take: adaptive concurrency lowers the limit (batchrun.concurrency).
OVERLOAD_STATUSES = (429, 503)
# A gateway with no server behind it, or a server that cannot serve: what an endpoint that is down answers.
DOWN_STATUSES = (502, 503)
BACKOFF_BASE = 1.0       # seconds before the first retry; doubles per attempt, with full jitter
BACKOFF_CAP = 60.0
# A server's Retry-After is obeyed up to this: "1e9" or a date next year would otherwise stall every
# session of the run (a 429 pauses them all) for as long as the server cares to say.
MAX_RETRY_AFTER = BACKOFF_CAP


def retry_after_seconds(headers: Mapping[str, str] | None) -> float | None:
    """Seconds the server asked us to wait: Retry-After-Ms, else Retry-After (seconds or an HTTP
    date), at most MAX_RETRY_AFTER. None when neither is there or readable: a value like "soon" must
    not turn a retryable error into a crash; the back-off applies instead."""
    if not headers:
        return None
    seconds = _delay_seconds(headers.get("retry-after-ms"), per_second=1000)
    if seconds is None:
        value = headers.get("retry-after")
        seconds = _delay_seconds(value, per_second=1)
        if seconds is None:
            seconds = _seconds_until(value)
    return None if seconds is None else min(seconds, MAX_RETRY_AFTER)


def _delay_seconds(value: str | None, *, per_second: float) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number / per_second if math.isfinite(number) and number >= 0 else None


def _seconds_until(value: str | None) -> float | None:
    """An HTTP date as seconds from now; a date already past means now."""
    if not value:
        return None
    try:
        moment = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if moment.tzinfo is None:      # "-0000": HTTP dates are GMT
        moment = moment.replace(tzinfo=UTC)
    return max(0.0, moment.timestamp() - time.time())


def _error_text(exc: openai.APIStatusError) -> str:
    """What the endpoint said. The client hands on the body's "error" where it has one: text there is
    the message itself ({"error": "..."}, as Text Generation Inference and Ollama's own API say it),
    as is a body that is not JSON at all (a proxy's "502 Bad Gateway" page)."""
    body = exc.body
    if isinstance(body, str) and body.strip():
        return body.strip()
    if isinstance(body, dict):
        inner = body.get("error")
        message = inner.get("message") if isinstance(inner, dict) else body.get("message")
        if message:
            return str(message)
    return str(exc.message)


# Of an endpoint's error message, what a failure row or the run's error line shows; the whole message is
# still read for what it means (a context overflow, an unknown model).
MOST_ERROR_CHARS = 1_000


def _shown(detail: str) -> str:
    """The error message as shown: on one line, and its start and its length when longer than
    MOST_ERROR_CHARS. An endpoint quoting a large request back, or a proxy's error page, would otherwise
    put megabytes into each prompt's failure row; and its line breaks would put lines of the endpoint's
    own under the run's "error:" line. The start alone is taken apart (the message may be megabytes)."""
    start = " ".join(detail[:2 * MOST_ERROR_CHARS].split())
    if len(detail) <= MOST_ERROR_CHARS:
        return start
    return f"{start[:MOST_ERROR_CHARS]}... ({len(detail):,} characters)"


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception, then what it was raised from (or while handling), innermost last. The HTTP
    stack wraps the socket's error twice and reports even a refused connection as a time-out, so
    only the innermost errors tell what happened."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _stop_if_unreachable(exc: openai.APIConnectionError, base_url: str) -> None:
    """RunFatalError when nothing can ever answer at ``base_url`` (refused, or no such host), naming the
    proxy where requests go through one: it is the proxy that did not answer."""
    proxy = proxy_for(base_url)
    for cause in _causes(exc):
        if isinstance(cause, ConnectionRefusedError) and proxy is not None:
            raise RunFatalError(f"{_through(proxy, base_url)} refused the connection: nothing is listening there. "
                                f"Start the proxy, or {_exempt(base_url)}.")
        if isinstance(cause, ConnectionRefusedError):
            raise RunFatalError(f"the endpoint {base_url} refused the connection: nothing is listening there. "
                                "Start the server, or check --base_url.")
        if isinstance(cause, socket.gaierror) and proxy is not None:
            raise RunFatalError(f"{_through(proxy, base_url)} cannot be reached: its host name "
                                f"{urlparse(proxy.url).hostname!r} cannot be resolved. Check that variable, or "
                                f"{_exempt(base_url)}.")
        if isinstance(cause, socket.gaierror):
            raise RunFatalError(f"the endpoint {base_url} cannot be reached: its host name "
                                f"{urlparse(base_url).hostname!r} cannot be resolved. Check --base_url.")


def _stop_at_proxy_authentication(base_url: str, detail: str) -> None:
    """HTTP 407: every request will get it until the credentials change, so the run stops."""
    if (proxy := proxy_for(base_url)) is not None:
        raise RunFatalError(f"{_through(proxy, base_url)} refused the credentials (HTTP 407: {detail}). Check the user "
                            f"name and password that variable gives the proxy, or {_exempt(base_url)}.")
    raise RunFatalError(f"a proxy in front of the endpoint {base_url} asks for credentials (HTTP 407: {detail}), and "
                        "none is set for it here: give them in HTTPS_PROXY or HTTP_PROXY (http://USER:PASSWORD@HOST:PORT).")


def _through(proxy: Proxy, base_url: str) -> str:
    """The proxy by its address alone (its URL may hold a user name and password) and the variable to
    change."""
    where = urlparse(proxy.url)
    address = f"{where.hostname}:{where.port}" if where.port else where.hostname
    return f"the proxy {address} that requests to {base_url} go through (set by the environment's {proxy.variable})"


def _exempt(base_url: str) -> str:
    return f"add {urlparse(base_url).hostname} to NO_PROXY if the endpoint needs none"


# How providers say a conversation no longer fits the model's context: OpenAI and vLLM ("maximum
# context length", code context_length_exceeded), OpenRouter (passes the provider's words on),
# llama.cpp ("exceeds the available context size", type exceed_context_size_error), Anthropic
# ("prompt is too long"), and others ("context window", "reduce the length of the messages").
_CONTEXT_OVERFLOW_PHRASES = ("context_length_exceeded", "exceed_context_size", "maximum context length",
                             "context length", "context size", "context window", "prompt is too long",
                             "reduce the length of the messages", "too many tokens in the prompt")


# How endpoints say a 400 is about the model named: the run cannot go on with it.
_UNKNOWN_MODEL_PHRASES = ("not a valid model", "does not exist", "invalid model", "unknown model")
# Anthropic's "no credit" comes as a 400 (OpenAI's as a 429, see out_of_credit).
_NO_CREDIT_PHRASES = ("credit balance is too low",)


def _context_overflow(exc: openai.APIStatusError, said: str, request: bytes) -> bool:
    if exc.status_code not in (400, 413, 422):
        return False
    body = exc.body if isinstance(exc.body, dict) else {}
    error = body.get("error")
    inner = error if isinstance(error, dict) else body
    codes = " ".join(str(part) for part in (inner.get("code"), inner.get("type")) if part).lower()
    return (any(phrase in codes for phrase in _CONTEXT_OVERFLOW_PHRASES)
            or _endpoint_says_beside_quotes(said, _CONTEXT_OVERFLOW_PHRASES, request))


def _endpoint_says(said: str, phrases: tuple[str, ...], request: bytes) -> bool:
    """Whether the error's text holds one of ``phrases`` that the request does not. Servers quote the
    request back in their errors (a validation error's input_value), so a phrase the request itself
    holds may be the prompt's: read as the endpoint's, one prompt's words would stop the whole run.
    Where a wrong reading stops the run, only a phrase the request lacks counts."""
    lowered, sent = said.lower(), request.lower()
    return any(phrase in lowered and phrase.encode() not in sent for phrase in phrases)


# A mention of a phrase is a quote of the request when it sits in a stretch of the request's words at
# least this much longer than itself: a validation error's input_value quotes a prompt's sentence; an
# endpoint's own "This model's maximum context length is 8192 tokens. However, ..." shares a few words
# with a prompt that pasted such a message, never its numbers.
_QUOTE_CONTEXT_CHARACTERS = 24
# Mentions of one phrase looked at: each is a few searches of the request, and an error may be megabytes.
_MENTIONS_LOOKED_AT = 16


def _endpoint_says_beside_quotes(said: str, phrases: tuple[str, ...], request: bytes) -> bool:
    """Whether the error's text holds one of ``phrases`` in the endpoint's own words, though the request
    may hold it too (a conversation that read about context lengths, then overflowed): a mention counts
    unless it is a quote (see _QUOTE_CONTEXT_CHARACTERS). Compared as words alone, so that a quote's
    escaping (JSON's, Python's repr) does not matter. A quote of a few words beside the phrase passes for
    the endpoint's words: where that misreading would stop the run, _endpoint_says."""
    said_words, sent_words = _words(said), _words(request.decode("utf-8", "replace"))
    for phrase in phrases:
        mentions = re.finditer(re.escape(_words(phrase).strip()), said_words)
        for mention in itertools.islice(mentions, _MENTIONS_LOOKED_AT):
            if _quoted_length(said_words, mention.start(), mention.end(), sent_words) < (
                    mention.end() - mention.start() + _QUOTE_CONTEXT_CHARACTERS):
                return True
    return False


def _quoted_length(said: str, start: int, end: int, sent: str) -> int:
    """The length of a stretch of ``said`` around said[start:end] found in ``sent`` (widened to the left as
    far as it goes, then to the right): 0 if said[start:end] itself is not there."""
    if said[start:end] not in sent:
        return 0
    start = start - _widest(lambda more: said[start - more:end] in sent, start)
    end = end + _widest(lambda more: said[start:end + more] in sent, len(said) - end)
    return end - start


def _widest(fits: Callable[[int], bool], most: int) -> int:
    """The largest n in 0..most with fits(n), for a fits that holds up to some n and not beyond."""
    low, high = 0, most
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _words(text: str) -> str:
    """``text`` lower-cased, every run of characters other than letters and digits one space."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower())


def classify(exc: Exception, *, model: str, base_url: str, endpoint_answered: bool, request: bytes) -> float | None:
    """Returns for a transient error (with the server's Retry-After, if any); raises RunFatalError
    when the whole run cannot work and PromptFailedError when only this prompt cannot.
    ``endpoint_answered``: the endpoint has sent a response in this process, or a reply to any in the run,
    so a connection it refuses now is an outage to wait out, not a wrong --base_url. ``request``: the body sent, whose
    words an error may quote back."""
    if isinstance(exc, openai.APIConnectionError):     # time-outs and dropped connections included
        if not endpoint_answered:
            _stop_if_unreachable(exc, base_url)
        return None
    if not isinstance(exc, openai.APIStatusError):
        raise PromptFailedError(f"{type(exc).__name__}: {exc}", "client_error")
    status = exc.status_code
    said = _error_text(exc)
    detail = _shown(said)
    if out_of_credit(exc) or (status == 400 and _endpoint_says(said, _NO_CREDIT_PHRASES, request)):
        raise RunFatalError(f"the endpoint {base_url} says the account is out of credit (HTTP {status}: {detail}). "
                            "Add credit to the account, or lower the cost with --max_samples.")
    if status == 429 or status in (408, 409) or status >= 500:
        return retry_after_seconds(exc.response.headers)
    if 300 <= status < 400:
        where = _shown(exc.response.headers.get("location", "nowhere (no Location)"))
        raise RunFatalError(f"the endpoint {base_url} redirects requests (HTTP {status}) to {where}, which the "
                            "run does not follow: give the address it points to as --base_url (up to its /v1).")
    if status == 401:
        raise RunFatalError(f"the endpoint {base_url} rejected the API key (HTTP 401: {detail}). "
                            "Check --api_key, OPENROUTER_API_KEY or OPENAI_API_KEY.")
    if status == 407:
        _stop_at_proxy_authentication(base_url, detail)
    if status == 402:
        raise RunFatalError(f"the endpoint {base_url} refused payment (HTTP 402: {detail}). "
                            "Add credit to the account, or lower the cost with --max_samples.")
    if status == 404:
        raise RunFatalError(f"the endpoint {base_url} does not know model {model!r} or this API path "
                            f"(HTTP 404: {detail}). Check --model and --base_url (it usually ends in /v1).")
    if _context_overflow(exc, said, request):
        raise PromptFailedError(f"the conversation no longer fits the model's context (HTTP {status}: {detail})",
                                CONTEXT_LENGTH)
    if status == 400 and "model" in said.lower() and _endpoint_says(said, _UNKNOWN_MODEL_PHRASES, request):
        raise RunFatalError(f"the endpoint {base_url} does not accept model {model!r} (HTTP 400: {detail}).")
    raise PromptFailedError(f"HTTP {status}: {detail}", f"http_{status}")


def out_of_credit(exc: openai.APIStatusError) -> bool:
    """OpenAI's "no credit": a 429 (insufficient_quota), which no wait mends; no overload either, so the
    limit on requests in flight is left as it is."""
    return exc.status_code == 429 and "insufficient_quota" in (exc.code, exc.type)


def says_endpoint_down(exc: Exception) -> bool:
    """What only an endpoint that is down does, at no cost: no connection could be made (the request was never
    sent), or a gateway or server said it cannot serve (502, 503). Not a time-out, a dropped connection nor
    another server error: one prompt's request can cause those (a reply too long for the time-out, a
    conversation that crashes the server), and the endpoint may have billed its work; held, that prompt would
    be sent, and paid for, again and again (batchrun.endpoint.call). Nor a TLS failure: a certificate or an
    https address for a plain server is wrong set-up, not an outage."""
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in DOWN_STATUSES
    return isinstance(exc, openai.APIConnectionError) and any(
        isinstance(cause, aiohttp.ClientConnectorError) and not isinstance(cause, aiohttp.ClientSSLError)
        and cause.os_error.errno not in _RUNNERS_OWN_ERRNOS for cause in _causes(exc))


# A connection that failed for want of the runner's own means (descriptors, memory, local ports): waiting on
# the endpoint never mends it, so it is no outage.
_RUNNERS_OWN_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL})


def backoff_delay(attempt: int) -> float:
    # The exponent bounded: a call held through an outage of hours counts thousands of attempts, and 2.0 ** 1024
    # does not fit a float.
    return random.uniform(0, min(BACKOFF_CAP, BACKOFF_BASE * 2 ** min(attempt, 32)))


def failure_summary(exc: Exception, timeout: Any) -> tuple[str, str]:
    """(what went wrong, error type) of a failed attempt: the failure row's once the retries are used up,
    and the live display's cause of a retry before that."""
    if isinstance(exc, openai.APIStatusError):
        kind = "rate_limited" if isinstance(exc, openai.RateLimitError) else f"http_{exc.status_code}"
        return f"HTTP {exc.status_code}: {_shown(_error_text(exc))}", kind
    if isinstance(exc, openai.APIConnectionError):
        return _connection_failure(exc, timeout)
    if isinstance(exc, TimeoutError):
        return _no_reply_within(timeout), "timeout"
    return f"malformed reply: {exc}", "bad_response"


def _connection_failure(exc: openai.APIConnectionError, timeout: Any) -> tuple[str, str]:
    causes = list(_causes(exc))
    for cause in causes:
        if isinstance(cause, ConnectionRefusedError):
            return "the endpoint refused the connection", "connection"
        if isinstance(cause, socket.gaierror):
            return "the endpoint's host name cannot be resolved", "connection"
        if isinstance(cause, TimeoutError):
            return _no_reply_within(timeout), "timeout"
        if isinstance(cause, OSError) and cause.errno in _RUNNERS_OWN_ERRNOS:
            return (f"this machine could not open a connection ({cause.strerror}): not the endpoint's doing",
                    "connection")
    return f"connection failed: {_shown(str(causes[-1]))}", "connection"


def _no_reply_within(timeout: Any) -> str:
    seconds = f"{timeout:g}s" if isinstance(timeout, (int, float)) else str(timeout)
    return f"no reply within {seconds} (--request_timeout)"
