"""A chat completion's bytes -> ModelReply, refusing what is not one (a proxy's error page, a reply cut
short, counts that are not numbers) as MalformedReplyError, which the call retries."""

from __future__ import annotations

import json
import math
from typing import Any

from batchrun.model import ModelReply
from batchrun.rows import Usage
from batchrun.rows.reasoning import content_part_text

# The most tool calls a reply may hold (the session runs the first 128 of them: see session.py).
MAX_TOOL_CALLS = 1024
# The most JSON values a reply may hold, counted before it is read as its brackets and commas (those in
# its text too: a million commas is far beyond any answer, some megabytes of prose). Each becomes a Python
# object: a reply of nothing but "{}," takes 24 times its size once read (60 MiB of it, 1.7 GB), one of
# short strings 15 times, in the worker every other session of it shares.
MAX_REPLY_VALUES = 1_000_000


class MalformedReplyError(Exception):
    """A 200 response that is not a chat completion (an error body, a broken proxy, a buggy server).
    It fails the prompt, to be retried on resume: never read as an empty answer, which the
    no-reasoning filter would discard for good. ``usage`` (with ``cost_source``) is the reply's usage
    where it could be read: the endpoint billed that reply, refused or not."""

    def __init__(self, message: str, usage: Usage | None = None, cost_source: str = "unknown") -> None:
        super().__init__(message)
        self.usage, self.cost_source = usage, cost_source


def _preview(value: Any) -> str:
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else json.dumps(value, ensure_ascii=False)
    return text[:300]


# No reply's token count or cost (in dollars) comes near this: above it a number is a server's fault,
# and below it the totals of any run stay finite (statistics.json stays JSON).
_MOST_PER_REPLY = 1e9


def _count(section: dict, key: str, where: str) -> float:
    """A count or cost of the reply's usage. A negative one is refused: it would lower what the run
    has spent and so lift --max_cost and --max_total_tokens."""
    value = section.get(key)
    if value is None:
        return 0.0
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    except OverflowError:      # an integer of hundreds of digits, beyond any float
        number = math.inf if value > 0 else -math.inf
    if isinstance(value, bool) or math.isnan(number):
        raise MalformedReplyError(f"{where}.{key} is not a number: {_preview(value)}")
    if number < 0:
        raise MalformedReplyError(f"{where}.{key} is negative: {_preview(value)}")
    if number > _MOST_PER_REPLY:
        raise MalformedReplyError(f"{where}.{key} is more than any reply's: {_preview(value)}")
    return number


def _object(section: dict, key: str, where: str) -> dict:
    value = section.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise MalformedReplyError(f"{where}.{key} is not an object: {_preview(value)}")
    return value


def _usage_from(usage: dict) -> Usage:
    completion_details = _object(usage, "completion_tokens_details", "usage")
    prompt_details = _object(usage, "prompt_tokens_details", "usage")
    reasoning = _count(completion_details, "reasoning_tokens", "usage.completion_tokens_details")
    return Usage(prompt_tokens=int(_count(usage, "prompt_tokens", "usage")),
                 completion_tokens=int(_count(usage, "completion_tokens", "usage")),
                 reasoning_tokens=int(reasoning),
                 cached_tokens=int(_count(prompt_details, "cached_tokens", "usage.prompt_tokens_details")),
                 cost=_count(usage, "cost", "usage"))


def _objects(message: dict, key: str) -> list[dict]:
    """The message's list of objects under ``key`` ([] where it has none); refused in any other shape."""
    items = message.get(key)
    if items is None:
        return []
    if not isinstance(items, list):
        raise MalformedReplyError(f"choices[0].message.{key} is not a list: {_preview(items)}")
    for position, item in enumerate(items):
        if not isinstance(item, dict):
            raise MalformedReplyError(f"choices[0].message.{key}[{position}] is not an object: {_preview(item)}")
    return items


def _check_tool_calls(message: dict) -> None:
    """Each tool call must name a function; its arguments may be text or an object (the session
    turns them into text and tells the model when they do not parse). A reply of more calls than any
    model makes is refused: a few megabytes hold a million, and taking them apart and answering each
    would hold every session of the worker."""
    calls = _objects(message, "tool_calls")
    if len(calls) > MAX_TOOL_CALLS:
        raise MalformedReplyError(f"choices[0].message has {len(calls)} tool calls, more than any model's reply "
                                  f"makes ({MAX_TOOL_CALLS})")
    for position, call in enumerate(calls):
        where = f"choices[0].message.tool_calls[{position}]"
        function = call.get("function")
        if not isinstance(function, dict):
            raise MalformedReplyError(f"{where}.function is not an object: {_preview(function)}")
        if not isinstance(function.get("name"), str):
            raise MalformedReplyError(f"{where}.function.name is not a string: {_preview(function.get('name'))}")


def _check_content(message: dict) -> None:
    """The answer as text, or as a list of text parts and thinking parts (the chat format's list form,
    which Mistral's reasoning models answer in); any other shape is refused rather than read as no
    answer."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise MalformedReplyError(f"choices[0].message.content is neither text nor a list of text parts: "
                                  f"{_preview(content)}")
    for position, part in enumerate(content):
        if content_part_text(part) is None:
            raise MalformedReplyError(f"choices[0].message.content[{position}] is not a text part: {_preview(part)}")


def _check_reasoning(message: dict) -> None:
    """Reasoning, where a reply has it, in the shapes the reasoning reader takes: in any other, it would
    be read as none, and the no-reasoning filter would discard the trajectory for good."""
    for key in ("reasoning", "reasoning_content"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise MalformedReplyError(f"choices[0].message.{key} is not text: {_preview(value)}")
    _objects(message, "reasoning_details")


def parse_reply(raw: bytes) -> ModelReply:
    """The first choice of a chat completion; MalformedReplyError naming what is wrong otherwise."""
    if raw.count(b"{") + raw.count(b"[") + raw.count(b",") > MAX_REPLY_VALUES:
        raise MalformedReplyError(f"reply holds more than {MAX_REPLY_VALUES:,} JSON values, more than any model's "
                                  f"answer: {_preview(raw)!r}")
    try:
        data = json.loads(raw)
    except ValueError:
        raise MalformedReplyError(f"reply is not JSON: {_preview(raw)!r}") from None
    except RecursionError:
        raise MalformedReplyError(f"reply is nested too deeply to read: {_preview(raw)!r}") from None
    if not isinstance(data, dict):
        raise MalformedReplyError(f"reply is not a JSON object: {_preview(raw)}")
    try:
        section = _object(data, "usage", "reply")
        usage = _usage_from(section)
    except MalformedReplyError as exc:
        # The reply was billed at figures that cannot be read: no tokens counted and a cost unknown, so that
        # --max_cost and --max_total_tokens say they cannot be held, instead of counting nothing.
        exc.usage = Usage()
        raise
    cost_source = "endpoint" if section.get("cost") is not None else "unknown"
    try:
        message, finish_reason = _first_choice(data)
    except MalformedReplyError as exc:
        if section:
            exc.usage, exc.cost_source = usage, cost_source
        raise
    return ModelReply(message=message, finish_reason=finish_reason, usage=usage, cost_source=cost_source)


def _first_choice(data: dict) -> tuple[dict, Any]:
    """The first choice's message and finish reason, checked."""
    choices = data.get("choices")
    if not choices:
        raise MalformedReplyError(f"reply has no choices: {_preview(data.get('error') or data)}")
    if not isinstance(choices, list):
        raise MalformedReplyError(f"reply's choices is not a list: {_preview(choices)}")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise MalformedReplyError(f"reply's choices[0] is not an object: {_preview(choice)}")
    message = choice.get("message")
    if message is None:
        raise MalformedReplyError("choices[0].message is null")
    if not isinstance(message, dict):
        raise MalformedReplyError(f"choices[0].message is not an object: {_preview(message)}")
    _check_tool_calls(message)
    _check_content(message)
    _check_reasoning(message)
    finish_reason = choice.get("finish_reason")
    if finish_reason == "error":    # OpenRouter's, for a reply its provider broke off: what came is not the answer
        raise MalformedReplyError('the endpoint ended the reply with finish_reason "error" (its provider failed '
                                  'mid-reply)')
    # Anthropic's name for a reply cut at its token limit, which some gateways pass on as it is.
    return message, "length" if finish_reason == "max_tokens" else finish_reason
