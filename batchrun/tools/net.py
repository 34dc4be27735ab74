"""Fetching a URL the model chose, within the limits the README's Security section promises.

Only http(s) is fetched. Every hop of a redirect chain is judged again by the address policy
(batchrun.tools.address_policy), and the connection goes to a checked address itself, so a second DNS
answer cannot swap in another one (DNS rebinding); TLS still verifies the certificate against the
host name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import httpx

from batchrun.bounded_body import BodyError, bounded_chunks, gzipped_within
from batchrun.env_vars import enabled, url_problem
from batchrun.tools import ToolError
from batchrun.tools.address_policy import ALLOW_PRIVATE, allowed_addresses, host_refusal

MAX_REDIRECTS = 5
# A page's title as every tool gives it (a search result's, an extracted page's): a page may hold one of
# megabytes, which must not make a tool result of that size.
MAX_TITLE_CHARS = 300
# What a host name (IDNA names already in their ASCII form) or an IPv4 address is made of. httpx takes
# more, which other URL parsers read otherwise: a WHATWG one (browsers, Node) reads a backslash as a
# slash and decodes escapes, so "169.254.169.254\.example.com" and "169%2e254%2e169%2e254" are
# 169.254.169.254 to a provider that fetches them.
_HOST_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Page:
    """A fetched response body, after redirects."""

    url: str
    redirects: int             # how many were followed to get here
    content_type: str          # media type, lower case, without parameters ("" when not sent)
    charset: str | None
    body: bytes


def shortened(text: str, limit: int) -> str:
    """``text`` at most ``limit`` characters long, with an ellipsis where it was cut."""
    return text if len(text) <= limit else text[:limit] + "…"


def http_url(text: str) -> httpx.URL:
    """``text`` as an http(s) URL with a host; anything else (file:, ftp:, data:...) is refused."""
    try:
        url = httpx.URL(text.strip())
        named = url.host    # decodes a punycode host, which may decode to no name ("xn--localhost-": IDNAError)
    except (httpx.InvalidURL, UnicodeError) as exc:
        raise ToolError(f"{text!r} is not a valid URL: {exc}") from None
    if url.scheme not in ("http", "https"):
        raise ToolError(f"only http and https URLs are allowed, not {text!r}")
    if not named:
        raise ToolError(f"{text!r} has no host name")
    host = url.raw_host.decode("ascii")
    if ":" not in host and not _HOST_NAME.fullmatch(host):     # IPv6 literals httpx checks itself
        raise ToolError(f"{text!r} has no valid host name: {host!r} holds characters no host name holds")
    # httpx takes a port above 65535, which only the connection then refuses (OverflowError, not an
    # httpx error); the URL as httpx will send it gets the check every other URL the runner uses gets.
    problem = url_problem(str(url), ("http", "https"))
    if problem:
        raise ToolError(f"{text!r} is not a valid URL: {problem}")
    return url


def check_visible_destination(url: httpx.URL) -> None:
    """Refuse what the URL itself shows; all that can be judged for a URL someone else fetches. That
    includes a loopback name (RFC 6761: localhost and every name under it), which the fetcher resolves
    to its own loopback, as a fetch of our own would find by resolving it."""
    host = url.host.rstrip(".").lower()
    if (host == "localhost" or host.endswith(".localhost")) and not enabled(ALLOW_PRIVATE):
        raise ToolError(f"refused {url}: {host} is a loopback name (allowed only with {ALLOW_PRIVATE}=1)")
    reason = host_refusal(url.host)
    if reason:
        raise ToolError(f"refused {url}: {reason}")


async def _send_pinned(client: httpx.AsyncClient, url: httpx.URL) -> httpx.Response:
    """GET ``url`` over a connection to one of its checked addresses (the next one if it refuses)."""
    failure: httpx.ConnectError | None = None
    host = url.raw_host.decode("ascii")
    for address in await allowed_addresses(host, url.port or (443 if url.scheme == "https" else 80)):
        request = client.build_request("GET", url.copy_with(host=address),
                                       headers={"Host": url.netloc.decode("ascii")},
                                       extensions={"sni_hostname": host})
        try:
            return await client.send(request, stream=True)
        except httpx.ConnectError as exc:
            failure = exc
    raise ToolError(f"cannot connect to {host}: {failure}")


async def read_capped(response: httpx.Response, max_bytes: int) -> bytes:
    """The body of a streamed response, inflated if gzipped, refused as soon as it passes
    ``max_bytes`` (:mod:`batchrun.bounded_body`: httpx would inflate it without a bound)."""
    try:
        gzip = gzipped_within(response.headers.get_list("content-encoding"), response.headers.get("content-length"),
                              limit=max_bytes)
        return b"".join([chunk async for chunk in bounded_chunks(response.aiter_raw(), gzip=gzip, limit=max_bytes)])
    except BodyError as exc:
        raise ToolError(f"the response {exc}") from None


async def fetch(client: httpx.AsyncClient, text: str, *, max_bytes: int) -> Page:
    """GET a model-chosen URL: redirects followed by hand so that each hop is checked like the first.

    ``client`` must not follow redirects itself nor use a proxy (a proxy would connect elsewhere
    than the address checked here).
    """
    url = http_url(text)
    try:
        for redirects in range(MAX_REDIRECTS + 1):
            response = await _send_pinned(client, url)
            try:
                if response.is_redirect:
                    url = http_url(str(url.join(response.headers["location"])))
                    continue
                if not response.is_success:
                    raise ToolError(f"HTTP {response.status_code} {response.reason_phrase}".rstrip())
                body = await read_capped(response, max_bytes)
            finally:
                await response.aclose()
            media_type = response.headers.get("content-type", "").partition(";")[0].strip().lower()
            return Page(str(url), redirects, media_type, response.charset_encoding, body)
    except httpx.TimeoutException:
        raise ToolError("the server did not answer in time") from None
    except httpx.HTTPError as exc:
        raise ToolError(f"{type(exc).__name__}: {exc}") from None
    raise ToolError(f"more than {MAX_REDIRECTS} redirects")
