"""The model client's HTTP transport, with every reply's body bounded as it arrives.

A reply is read whole into the worker's memory, which every other session of the worker shares: an
endpoint streaming without end or sending a gzip bomb would take the worker down with all its
prompts. Here a reply is refused as soon as its decoded size passes MAX_REPLY_BYTES, and an error's body
cut at MAX_ERROR_BYTES (:mod:`batchrun.bounded_body` does the counting and the bounded inflating). The
replies a worker process is reading at once are bounded together as well (MAX_READING_BYTES): those of the
run's endpoint, and apart from them those of the services the tools call (vision, image generation).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx2
import openai
from openai._vendor.httpx_aiohttp.transport import AiohttpTransport

from batchrun.bounded_body import ACCEPT_ENCODING, BodyError, BodyTooLarge, bounded_chunks, gzipped_within
from batchrun.endpoint.replies import MalformedReplyError

# No chat completion comes near this: the longest answers models give (128k tokens, reasoning included) are
# a MiB or two of JSON.
MAX_REPLY_BYTES = 16 * 2**20
# An error's body says why in a sentence; the client reads it whole into Python objects, several times its
# size, before anything here looks at it. One longer is cut here (its start says why).
MAX_ERROR_BYTES = 2 * 2**20
# Bounded alone, replies that each stall just under their limit would hold sessions x MAX_REPLY_BYTES (64
# sessions passed 1 GB). Together they may hold this much per worker process; a reply that would take them
# past it is refused (an error's body cut). High, as a refused reply is retried and billed again: 256 MiB
# refused honest 12 MiB replies of 128 sessions (32 per process) read over seconds each.
MAX_READING_BYTES = 512 * 2**20
# What an error's body keeps however little room is left: its start says why (a context overflow, an
# unknown model), and cut to nothing it would be taken for a plain failure of its status.
ERROR_START_BYTES = 64 * 2**10


class ReadingBytes:
    """The decoded bytes of the replies this process is reading now from one kind of endpoint (one event
    loop reads them all)."""

    def __init__(self) -> None:
        self.held = 0


# Apart, so that a service a tool calls cannot take the room of the run's own replies.
MODEL_REPLIES = ReadingBytes()
TOOL_REPLIES = ReadingBytes()


class BoundedAioHttpClient(openai.DefaultAioHttpClient):
    """openai's aiohttp client (its defaults kept), with each of its transports, the direct one and
    any proxy's from the environment, bounded; ``reading`` counts its replies being read."""

    def __init__(self, *, reading: ReadingBytes, **kwargs: Any) -> None:
        self._reading = reading         # before the base class makes the transports
        super().__init__(**kwargs)

    def _init_transport(self, *args: Any, **kwargs: Any) -> httpx2.AsyncBaseTransport:
        return BoundedTransport(_keeping_no_cookies(super()._init_transport(*args, **kwargs)), self._reading)

    def _init_proxy_transport(self, *args: Any, **kwargs: Any) -> httpx2.AsyncBaseTransport:
        return BoundedTransport(_keeping_no_cookies(super()._init_proxy_transport(*args, **kwargs)), self._reading)


def _keeping_no_cookies(transport: httpx2.AsyncBaseTransport) -> httpx2.AsyncBaseTransport:
    """The transport, its aiohttp session keeping no cookies. An API client needs none, and a session keeps
    every cookie a named host sets and sends them all back: an endpoint setting new ones with each answer
    made every request larger, until its front end refused them (HTTP 431) for the rest of the run."""
    if (isinstance(transport, AiohttpTransport) and transport.client is None and transport.uds is None
            and transport.local_address is None):
        transport.client = functools.partial(_session_without_cookies, transport)
    return transport


def _session_without_cookies(transport: AiohttpTransport) -> aiohttp.ClientSession:
    """The session the transport makes for itself (a connector with its limits and TLS context), with a
    cookie jar that keeps nothing."""
    limits = transport.limits
    connector = aiohttp.TCPConnector(keepalive_timeout=limits.keepalive_expiry, ssl=transport.ssl_context,
                                     limit=limits.max_connections or 0)     # None is no limit, aiohttp's 0
    return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())


class BoundedTransport(httpx2.AsyncBaseTransport):
    def __init__(self, inner: httpx2.AsyncBaseTransport, reading: ReadingBytes) -> None:
        self._inner, self._reading = inner, reading

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        request.headers["Accept-Encoding"] = ACCEPT_ENCODING
        try:
            response = await self._inner.handle_async_request(request)
        except aiohttp.ClientError as exc:
            raise _broken_http(exc) from exc
        # An error's body is cut at its limit, not refused: its status says what it is (the run's end, a
        # pause, this prompt's failure), and its start why.
        is_error = response.status_code >= 400
        try:
            gzip = gzipped_within(response.headers.get_list("content-encoding"),
                                  None if is_error else response.headers.get("content-length"),
                                  limit=MAX_REPLY_BYTES)
        except BodyError as exc:
            await response.aclose()
            raise _reply_error(exc) from None
        # The body is handed on decoded, so the HTTP stack must neither decode it again nor hold it to
        # the encoded length. Cookies are not handed on either: the client would keep every one and send
        # them all back with each request (see make_client).
        headers = [(name, value) for name, value in response.headers.raw
                   if name.lower() not in (b"content-encoding", b"content-length", b"set-cookie")]
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        return httpx2.Response(response.status_code, headers=headers, request=request,
                               stream=_BoundedReply(response.stream, self._reading, gzip=gzip, is_error=is_error),
                               extensions=response.extensions)

    async def aclose(self) -> None:
        await self._inner.aclose()


class _BoundedReply(httpx2.AsyncByteStream):
    def __init__(self, raw: httpx2.AsyncByteStream, reading: ReadingBytes, *, gzip: bool, is_error: bool) -> None:
        self._raw, self._reading, self._gzip, self._is_error = raw, reading, gzip, is_error
        self._held = 0          # of reading's, given back once read, refused or closed

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in bounded_chunks(self._raw, gzip=self._gzip,
                                              limit=MAX_ERROR_BYTES if self._is_error else MAX_REPLY_BYTES):
                room = MAX_READING_BYTES - self._reading.held
                if self._is_error:
                    room = max(room, ERROR_START_BYTES - self._held)
                if len(chunk) > room:
                    if not self._is_error:
                        raise BodyTooLarge(MAX_READING_BYTES, together=True)
                    if kept := chunk[:max(0, room)]:
                        self._hold(kept)
                        yield kept
                    return          # an error's body is cut where the room ends
                self._hold(chunk)
                yield chunk
        except BodyTooLarge as exc:
            if not self._is_error:
                raise _reply_error(exc) from None
        except BodyError as exc:
            raise _reply_error(exc) from None
        except aiohttp.ClientError as exc:
            raise _broken_http(exc) from exc
        finally:
            self._give_back()

    async def aclose(self) -> None:
        self._give_back()       # also where the client stopped reading without closing the iteration
        await self._raw.aclose()

    def _hold(self, chunk: bytes) -> None:
        self._reading.held += len(chunk)
        self._held += len(chunk)

    def _give_back(self) -> None:
        self._reading.held -= self._held
        self._held = 0


def _broken_http(exc: aiohttp.ClientError) -> httpx2.RemoteProtocolError:
    """An error of aiohttp that openai's transport does not translate (a response that breaks HTTP: a
    bad chunk size or header line), as the error the client turns into a connection failure: retried
    like a dropped connection, instead of escaping the client as an internal error."""
    return httpx2.RemoteProtocolError(str(exc), request=None)


def _reply_error(exc: BodyError) -> MalformedReplyError:
    """A bad body is a bad reply: retried, then the prompt's failure (bad_response)."""
    return MalformedReplyError(f"the reply {exc}")
