"""The image_generate tool over the provider the user configured (see :mod:`batchrun.tools.configuration`).

``openai``: any OpenAI-compatible images API (POST {base}/images/generations), which answers with a
URL or with the image itself as base64. ``fal``: fal.ai's synchronous endpoint (POST {base}/{model}
with ``Authorization: Key ...``), which answers with image URLs. An image that arrives as data is
saved in the prompt's environment, so the model gets a path its other tools can use.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from typing import cast

import openai

from batchrun.endpoint import MalformedReplyError
from batchrun.time_limit import within
from batchrun.tools import ToolContext, ToolError
from batchrun.tools.clients import openai_client, service_answer
from batchrun.tools.configuration import Backend, NotConfigured, image_provider
from batchrun.tools.media import EXTENSIONS, image_type

IMAGE_SECONDS = 110.0
IMAGE_DIRECTORY = "images"


async def image_generate(args: dict, ctx: ToolContext) -> dict:
    """``{"url": ...}`` or ``{"path": ...}`` of one image generated from ``prompt``."""
    prompt = args.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ToolError("'prompt' must be a non-empty string")
    try:
        provider = image_provider()
    except NotConfigured as exc:
        raise ToolError(f"image_generate is not configured: {exc}") from None
    generate = _fal(provider, prompt) if provider.name == "fal" else _openai_images(provider, prompt, ctx)
    try:
        image = await within(IMAGE_SECONDS, generate)
    except TimeoutError:
        raise ToolError(f"no image within {IMAGE_SECONDS:g}s") from None
    if isinstance(image, str) and image.startswith("data:"):
        image = _data_url_bytes(image)
    if isinstance(image, str):
        return {"url": image}
    return {"path": await _save(ctx, image)}


async def _openai_images(provider: Backend, prompt: str, ctx: ToolContext) -> str | bytes:
    """The image's URL or its bytes. response_format is not sent: gpt-image models refuse it."""
    # configuration gives the openai provider a base URL always (OpenAI's own unless one is set).
    client = openai_client(ctx, "image_gen_client", base_url=cast(str, provider.base_url),
                           api_key=provider.api_key, timeout=IMAGE_SECONDS)
    try:
        response = await client.images.generate(model=provider.model, prompt=prompt, n=1)
    except (openai.APIError, MalformedReplyError) as exc:
        raise ToolError(f"image generation failed: {exc}") from None
    item = response.data[0] if response.data else None
    if item is not None and item.url:
        return item.url
    if item is not None and item.b64_json:
        return _base64_bytes(item.b64_json)
    raise ToolError("the images API answered without an image")


async def _fal(provider: Backend, prompt: str) -> str:
    """The first image URL of a synchronous fal.ai run (a data: URL when the model runs in sync_mode)."""
    failed = "fal.ai image generation failed"
    status, body = await service_answer(IMAGE_SECONDS, failed, "POST", f"{provider.base_url}/{provider.model}",
                                        json={"prompt": prompt}, headers={"Authorization": f"Key {provider.api_key}"})
    if status != 200:
        raise ToolError(f"{failed}: HTTP {status}: {body[:300].decode('utf-8', 'replace')}")
    try:
        images = json.loads(body).get("images")
        url = images[0]["url"]
    except (ValueError, AttributeError, TypeError, LookupError):
        raise ToolError("fal.ai answered without an image URL") from None
    if not isinstance(url, str) or not url:
        raise ToolError("fal.ai answered without an image URL")
    return url


def _base64_bytes(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ToolError("the provider sent image data that is not valid base64") from None


def _data_url_bytes(url: str) -> bytes:
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ToolError("the provider sent a data URL that is not base64")
    return _base64_bytes(payload)


async def _save(ctx: ToolContext, data: bytes) -> str:
    """Write the image into the prompt's environment; returns the path the model should use."""
    mime = image_type(data)
    if mime is None:
        raise ToolError("the provider sent data that is not a PNG, JPEG, GIF or WebP image")
    if ctx.env is None:
        raise ToolError("the image arrived as data but there is no working directory to save it in")
    return await ctx.env.write_file(f"{IMAGE_DIRECTORY}/image-{uuid.uuid4().hex[:12]}.{EXTENSIONS[mime]}", data)
