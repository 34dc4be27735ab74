"""The vision_analyze tool: one multimodal chat call about an image.

The model is the run's own unless ``VISION_MODEL`` names another; the endpoint is the run's unless
``VISION_BASE_URL`` / ``VISION_API_KEY`` point elsewhere. An image URL is passed on for the provider
to fetch; a file from the prompt's environment is sent inline as a base64 data URL.
"""

from __future__ import annotations

import base64
import re

import openai
from openai.types.chat import ChatCompletionContentPartParam

from batchrun.endpoint import MalformedReplyError
from batchrun.env_vars import variable
from batchrun.time_limit import within
from batchrun.tools import ToolContext, ToolError
from batchrun.tools.arguments import non_empty_text
from batchrun.tools.clients import openai_client
from batchrun.tools.configuration import NotConfigured, vision_endpoint
from batchrun.tools.media import image_type
from batchrun.tools.net import check_visible_destination, http_url

VISION_SECONDS = 90.0
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


async def vision_analyze(args: dict, ctx: ToolContext) -> dict:
    """``{"answer": ...}``: the vision model's reply to ``question`` about ``image``."""
    image, question = non_empty_text(args, "image"), non_empty_text(args, "question")
    content: list[ChatCompletionContentPartParam] = [
        {"type": "text", "text": question},
        {"type": "image_url", "image_url": {"url": await _image_url(image, ctx)}}]
    client, model = _vision_model(ctx)
    call = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}])
    try:
        response = await within(VISION_SECONDS, call)
    except (openai.APIError, MalformedReplyError) as exc:
        raise ToolError(f"the vision model call failed: {exc}") from None
    except TimeoutError:
        raise ToolError(f"the vision model did not answer within {VISION_SECONDS:g}s") from None
    answer = response.choices[0].message.content if response.choices else None
    if not answer or not answer.strip():
        raise ToolError("the vision model returned no answer")
    return {"answer": answer}


def _vision_model(ctx: ToolContext) -> tuple[openai.AsyncOpenAI, str]:
    """(client, model). The run's key is never sent to an endpoint other than the run's."""
    try:
        base_url = vision_endpoint()
    except NotConfigured as exc:
        raise ToolError(f"vision_analyze is not configured: {exc}") from None
    api_key = variable("VISION_API_KEY")
    model = variable("VISION_MODEL") or (ctx.model.model if ctx.model else None)
    if model is None:
        raise ToolError("no vision model: set VISION_MODEL")
    if base_url is None:
        if ctx.model is None:
            raise ToolError("no vision endpoint: set VISION_BASE_URL")
        if api_key is None:
            return ctx.model.client.with_options(timeout=VISION_SECONDS, max_retries=2), model
        base_url = ctx.model.base_url
    return openai_client(ctx, "vision_client", base_url=base_url, api_key=api_key, timeout=VISION_SECONDS), model


async def _image_url(image: str, ctx: ToolContext) -> str:
    """An http(s) URL as it is; a path becomes a data URL of the file's bytes."""
    if _URL.match(image):
        url = http_url(image)
        check_visible_destination(url)
        return str(url)
    if ctx.env is None:
        raise ToolError("no working directory to read the image from; give an http(s) URL")
    data = await ctx.env.read_file(image)
    mime = image_type(data)
    if mime is None:
        raise ToolError(f"{image!r} is not a PNG, JPEG, GIF or WebP image")
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
