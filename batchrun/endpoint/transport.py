"""The model client's HTTP transport, with every reply's body bounded as it arrives.

A reply is read whole into the worker's memory, which every other session of the worker shares: an
endpoint streaming without end or sending a gzip bomb would take the worker down with all its
prompts. Here a reply, error bodies included, is refused as soon as its decoded size passes
MAX_REPLY_BYTES (:mod:`batchrun.bounded_body` does the counting and the bounded inflating).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx2
import openai

from batchrun.bounded_body import ACCEPT_ENCODING, BodyError, bounded_chunks, gzipped_within
from batchrun.endpoint.replies import MalformedReplyError

# No chat completion comes near this: a million tokens of answer and reasoning are a few MiB of JSON.
MAX_REPLY_BYTES = 64 * 2**20


class BoundedAioHttpClient(openai.DefaultAioHttpClient):
    """openai's aiohttp client (its defaults kept), with each of its transports, the direct one and
    any proxy's from the environment, bounded."""

    def _init_transport(self, *args: Any, **kwargs: Any) -> httpx2.AsyncBaseTransport:
        return BoundedTransport(super()._init_transport(*args, **kwargs))

    def _init_proxy_transport(self, *args: Any, **kwargs: Any) -> httpx2.AsyncBaseTransport:
        return BoundedTransport(super()._init_proxy_transport(*args, **kwargs))


class BoundedTransport(httpx2.AsyncBaseTransport):
    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        request.headers["Accept-Encoding"] = ACCEPT_ENCODING
        try:
            response = await self._inner.handle_async_request(request)
        except aiohttp.ClientError as exc:
            raise _broken_http(exc) from exc
        try:
            gzip = gzipped_within(response.headers.get_list("content-encoding"),
                                  response.headers.get("content-length"), limit=MAX_REPLY_BYTES)
        except BodyError as exc:
            await response.aclose()
            raise _reply_error(exc) from None
        # The body is handed on decoded, so the HTTP stack must neither decode it again nor hold it to
        # the encoded length.
        headers = [(name, value) for name, value in response.headers.raw
                   if name.lower() not in (b"content-encoding", b"content-length")]
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        return httpx2.Response(response.status_code, headers=headers, request=request,
                               stream=_BoundedReply(response.stream, gzip=gzip), extensions=response.extensions)

    async def aclose(self) -> None:
        await self._inner.aclose()


class _BoundedReply(httpx2.AsyncByteStream):
    def __init__(self, raw: httpx2.AsyncByteStream, *, gzip: bool) -> None:
        self._raw, self._gzip = raw, gzip

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in bounded_chunks(self._raw, gzip=self._gzip, limit=MAX_REPLY_BYTES):
                yield chunk
        except BodyError as exc:
            raise _reply_error(exc) from None
        except aiohttp.ClientError as exc:
            raise _broken_http(exc) from exc

    async def aclose(self) -> None:
        await self._raw.aclose()


def _broken_http(exc: aiohttp.ClientError) -> httpx2.RemoteProtocolError:
    """An error of aiohttp that openai's transport does not translate (a response that breaks HTTP: a
    bad chunk size or header line), as the error the client turns into a connection failure: retried
    like a dropped connection, instead of escaping the client as an internal error."""
    return httpx2.RemoteProtocolError(str(exc), request=None)


def _reply_error(exc: BodyError) -> MalformedReplyError:
    """A bad body is a bad reply: retried, then the prompt's failure (bad_response)."""
    return MalformedReplyError(f"the reply {exc}")
