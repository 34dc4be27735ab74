"""HTTP and model clients for the tools that call services themselves.

Building a TLS context reads the whole CA bundle (tens of milliseconds of CPU on the worker's event
loop, which every other session shares), so one context serves every HTTP client of the process.
Model clients for a separately configured endpoint live as long as their session and are closed
with it.
"""

from __future__ import annotations

import functools
import ssl

import httpx
import openai

from batchrun.tools import ToolContext

USER_AGENT = "Mozilla/5.0 (compatible; batch_runner/0.1; +https://pypi.org/project/batch-runner/)"


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def http_client(timeout: float, *, headers: dict[str, str] | None = None,
                trust_env: bool = True) -> httpx.AsyncClient:
    """An httpx client with the shared TLS context and our User-Agent; use it with ``async with``."""
    return httpx.AsyncClient(verify=_tls_context(), timeout=timeout,
                             headers={"User-Agent": USER_AGENT, **(headers or {})}, trust_env=trust_env)


def openai_client(ctx: ToolContext, slot: str, *, base_url: str, api_key: str | None,
                  timeout: float) -> openai.AsyncOpenAI:
    """A client for an endpoint other than the run's, kept in the session under ``slot``.

    A local server may need no key; the client library insists on one, so a placeholder is sent.
    """
    client = ctx.state.get(slot)
    if client is None:
        # openai 3 annotates http_client as an httpx2 client but accepts an httpx one too (it checks for
        # either); openai 2 annotates httpx, where this ignore is unused.
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "unused", timeout=timeout,
                                    max_retries=2,
                                    http_client=http_client(timeout))  # type: ignore[arg-type, unused-ignore]
        ctx.state[slot] = client
        ctx.cleanups.append(client.close)
    return client
