"""A chat completion's bytes -> ModelReply, refusing what is not one (a proxy's error page, a reply cut
short, counts that are not numbers) as MalformedReplyError, which the call retries."""

from __future__ import annotations

import json
import math
from typing import Any

from batchrun.model import ModelReply
from batchrun.rows import Usage


class MalformedReplyError(Exception):
    """A 200 response that is not a chat completion (an error body, a broken proxy, a buggy server).
    It fails the prompt, to be retried on resume: never read as an empty answer, which the
    no-reasoning filter would discard for good."""


def _preview(value: Any) -> str:
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else json.dumps(value, ensure_ascii=False)
    return text[:300]


def _count(section: dict, key: str, where: str) -> float:
    value = section.get(key)
    if value is None:
        return 0.0
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number):
        raise MalformedReplyError(f"{where}.{key} is not a number: {_preview(value)}")
    return number


def _object(section: dict, key: str, where: str) -> dict:
    value = section.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise MalformedReplyError(f"{where}.{key} is not an object: {_preview(value)}")
    return value


def _usage_from(data: dict) -> Usage:
    usage = _object(data, "usage", "reply")
    completion_details = _object(usage, "completion_tokens_details", "usage")
    prompt_details = _object(usage, "prompt_tokens_details", "usage")
    reasoning = _count(completion_details, "reasoning_tokens", "usage.completion_tokens_details")
    return Usage(prompt_tokens=int(_count(usage, "prompt_tokens", "usage")),
                 completion_tokens=int(_count(usage, "completion_tokens", "usage")),
                 reasoning_tokens=int(reasoning),
                 cached_tokens=int(_count(prompt_details, "cached_tokens", "usage.prompt_tokens_details")),
                 cost=_count(usage, "cost", "usage"))


def _check_tool_calls(message: dict) -> None:
    """Each tool call must name a function; its arguments may be text or an object (the session
    turns them into text and tells the model when they do not parse)."""
    calls = message.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise MalformedReplyError(f"choices[0].message.tool_calls is not a list: {_preview(calls)}")
    for position, call in enumerate(calls):
        where = f"choices[0].message.tool_calls[{position}]"
        if not isinstance(call, dict):
            raise MalformedReplyError(f"{where} is not an object: {_preview(call)}")
        function = call.get("function")
        if not isinstance(function, dict):
            raise MalformedReplyError(f"{where}.function is not an object: {_preview(function)}")
        if not isinstance(function.get("name"), str):
            raise MalformedReplyError(f"{where}.function.name is not a string: {_preview(function.get('name'))}")


def parse_reply(raw: bytes) -> ModelReply:
    """The first choice of a chat completion; MalformedReplyError naming what is wrong otherwise."""
    try:
        data = json.loads(raw)
    except ValueError:
        raise MalformedReplyError(f"reply is not JSON: {_preview(raw)!r}") from None
    except RecursionError:
        raise MalformedReplyError(f"reply is nested too deeply to read: {_preview(raw)!r}") from None
    if not isinstance(data, dict):
        raise MalformedReplyError(f"reply is not a JSON object: {_preview(raw)}")
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
    usage = data.get("usage")
    reported = isinstance(usage, dict) and usage.get("cost") is not None
    return ModelReply(message=message, finish_reason=choice.get("finish_reason"), usage=_usage_from(data),
                      cost_source="endpoint" if reported else "unknown")
