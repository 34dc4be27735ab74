"""HTTP and model clients for the tools that call services themselves.

Building a TLS context reads the whole CA bundle (tens of milliseconds of CPU on the worker's event
loop, which every other session shares), so one context serves every HTTP client of the process.
Model clients for a separately configured endpoint are the run's kind (the reply's size bounded) and
live as long as their session, which closes them.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx
import openai

from batchrun.bounded_body import ACCEPT_ENCODING
from batchrun.endpoint.client import TLS_CONTEXT
from batchrun.endpoint.transport import TOOL_REPLIES, BoundedAioHttpClient
from batchrun.tools import ToolContext, ToolError
from batchrun.tools.net import read_capped

USER_AGENT = "Mozilla/5.0 (compatible; batch_runner/0.1; +https://pypi.org/project/batch-runner/)"
# The most a search or image service may answer: a page of results is kilobytes; fal's synchronous
# mode answers with the whole image as a data URL, a few megabytes.
MAX_SERVICE_BYTES = 16 * 2**20


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def http_client(timeout: float, *, headers: dict[str, str] | None = None,
                trust_env: bool = True) -> httpx.AsyncClient:
    """An httpx client with the shared TLS context and our User-Agent, asking for the one compression
    :func:`batchrun.tools.net.read_capped` inflates within its limit; use it with ``async with``."""
    return httpx.AsyncClient(verify=_tls_context(), timeout=timeout, trust_env=trust_env,
                             headers={"User-Agent": USER_AGENT, "Accept-Encoding": ACCEPT_ENCODING, **(headers or {})})


async def service_answer(timeout: float, failed: str, method: str, url: str, **request: Any) -> tuple[int, bytes]:
    """(status, body) of one call to a configured service, the body read within MAX_SERVICE_BYTES; a
    transport error or a body refused is a ToolError that starts with ``failed``."""
    async with http_client(timeout) as client:
        try:
            async with client.stream(method, url, **request) as response:
                return response.status_code, await read_capped(response, MAX_SERVICE_BYTES)
        except httpx.HTTPError as exc:
            raise ToolError(f"{failed}: {type(exc).__name__}: {exc}") from None
        except ToolError as exc:
            raise ToolError(f"{failed}: {exc}") from None


def openai_client(ctx: ToolContext, slot: str, *, base_url: str, api_key: str | None,
                  timeout: float) -> openai.AsyncOpenAI:
    """A client for an endpoint other than the run's, kept in the session under ``slot``.

    A local server may need no key; the client library insists on one, so a placeholder is sent.
    """
    client = ctx.state.get(slot)
    if client is None:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "unused", timeout=timeout, max_retries=2,
                                    http_client=BoundedAioHttpClient(timeout=timeout, verify=TLS_CONTEXT,
                                                                     reading=TOOL_REPLIES))
        ctx.state[slot] = client
        ctx.cleanups.append(client.close)
    return client
