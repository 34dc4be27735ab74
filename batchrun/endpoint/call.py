"""One chat completion through the run's gate, retried on transient errors.

The retry loop is our own rather than the client's because a 429 concerns *every* session of the
run, across processes (:class:`RateGate`), not only the one that received it: it lowers the run-wide
concurrency limit, and when it says when to come back, it pauses them all."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import openai

from batchrun.endpoint.errors import (
    OVERLOAD_STATUSES,
    backoff_delay,
    classify,
    failure_summary,
    out_of_credit,
    says_endpoint_down,
)
from batchrun.endpoint.replies import MalformedReplyError, parse_reply
from batchrun.model import ModelReply, PromptFailedError
from batchrun.rate_limit import Gate, wake_delay
from batchrun.rows import Usage

# Endpoints (base URLs) that have sent an HTTP response, any status, in this process. One that never
# has and refuses connections (or whose host does not resolve) is not there at all: the run stops at
# once instead of retrying every prompt. Once it has answered, the same errors are a transient outage.
_ANSWERED: set[str] = set()


async def call_model(client: openai.AsyncOpenAI, gate: Gate, *, body: bytes, model: str, max_retries: int,
                     base_url: str, on_send: Callable[[], None] = lambda: None,
                     on_refused: Callable[[Usage, str], None] = lambda usage, cost_source: None) -> ModelReply:
    """One chat completion, retried on transient errors with back-off honouring Retry-After; while the
    endpoint is down (concurrency.note_failure), they do not count against ``max_retries``. ``on_send`` is
    called as each attempt leaves the gate, ``on_refused`` with the usage (and its cost's source) of each
    reply refused as malformed whose usage could be read."""
    attempt = 0          # failed attempts so far: the back-off grows with them
    counted = 0          # those that count against max_retries: not those held for an outage
    seen = -1            # the gate's answer at this call's last failure as of a down endpoint (note_failure)
    # The client's time-out bounds each wait for the next bytes; this bounds the whole reply, which a
    # server sending a byte now and then would otherwise hold open for ever.
    deadline = client.timeout if isinstance(client.timeout, (int, float)) else None
    # Waiting to go again after a failure: counted at the gate for the live display, until it goes or
    # this call ends (given up, or cancelled with its prompt).
    retrying = False
    try:
        while True:
            retry_after, overloaded, held = None, False, False
            async with gate.slot() as request:
                if retrying:
                    gate.limit.retrying(-1)
                    retrying = False
                on_send()
                try:
                    # The client's documented raw-post path: same HTTP, auth, errors and timeouts as
                    # chat.completions.create, without re-validating the whole conversation on every call
                    # (that walk cost more CPU than the rest of a session).
                    async with asyncio.timeout(deadline):
                        raw = await client.post("/chat/completions", cast_to=bytes, content=body)
                    request.answered()
                    _ANSWERED.add(base_url)
                    return parse_reply(raw)
                except openai.APIError as exc:
                    if isinstance(exc, openai.APIStatusError):
                        _ANSWERED.add(base_url)
                        if overloaded := exc.status_code in OVERLOAD_STATUSES and not out_of_credit(exc):
                            request.overloaded()
                    if says_endpoint_down(exc):
                        seen, held = await gate.limit.failed(seen)
                    retry_after = classify(exc, model=model, base_url=base_url,
                                           endpoint_answered=base_url in _ANSWERED or seen > 0, request=body)
                    failure: Exception = exc
                except MalformedReplyError as exc:   # perhaps a passing fault: worth another attempt
                    if exc.usage is not None:       # the endpoint billed it all the same
                        on_refused(exc.usage, exc.cost_source)
                    failure = exc
                except TimeoutError as exc:
                    failure = exc
            text, error_type = failure_summary(failure, client.timeout)
            if not held:
                if counted >= max_retries:
                    attempts = f"{attempt + 1} attempt{'s' if attempt else ''}"
                    raise PromptFailedError(f"gave up after {attempts}: {text}", error_type) from None
                counted += 1
            if retry_after is not None:
                delay = retry_after
            elif overloaded and gate.adaptive and attempt == 0:
                # The limit was just lowered for this refusal: the retry waits for a slot under it, in line
                # with every other request. Sleeping as well would only leave its prompt behind (at the end
                # of a run, the whole run).
                delay = 0.0
            else:
                delay = backoff_delay(attempt)
            attempt += 1
            gate.limit.retrying(1, error_type)
            retrying = True
            # A 429 that says when to come back holds every session until then. One that does not, under
            # adaptive concurrency, only lowers the limit: pausing the run for it would bring every session
            # back at once, to meet the limit again.
            if isinstance(failure, openai.RateLimitError) and (retry_after is not None or not gate.adaptive):
                gate.pause(delay)      # every session waits it out, this one too, in its next gate.slot()
            else:
                # A Retry-After told to many sessions at once would bring them all back at once.
                await asyncio.sleep(delay if retry_after is None else wake_delay(delay))
    finally:
        if retrying:
            gate.limit.retrying(-1)
