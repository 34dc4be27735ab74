"""The web_extract tool: fetch pages and return the main text of each, as markdown.

trafilatura finds the article in a page and drops navigation, headers, footers and other
boilerplate, which would otherwise fill the model's context. Pages are fetched with httpx through
:mod:`batchrun.tools.net` (trafilatura's own fetcher applies none of our limits). One URL failing
is reported in its own result; the call fails only when every URL failed.
"""

from __future__ import annotations

import asyncio
import codecs

import httpx
import trafilatura

from batchrun.time_limit import within
from batchrun.tools import ToolContext, ToolError
from batchrun.tools.clients import http_client
from batchrun.tools.net import MAX_TITLE_CHARS, Page, fetch, shortened

MAX_URLS = 5
MAX_PAGE_BYTES = 5_000_000
FETCH_SECONDS = 30.0
MAX_CHARS = 20_000          # per page: about 5,000 tokens
_HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
_TEXT_TYPES = frozenset({"application/json", "application/xml", "application/javascript",
                         "application/x-ndjson", "application/yaml"})
_ACCEPT = "text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.5"


async def web_extract(args: dict, ctx: ToolContext) -> dict:
    """``{"results": [...]}``, one entry per URL in order: its content, or its error."""
    urls = _urls(args)
    async with http_client(FETCH_SECONDS, trust_env=False, headers={"Accept": _ACCEPT}) as client:
        results = await asyncio.gather(*(_extract_one(client, url) for url in urls))
    if all("error" in result for result in results):
        raise ToolError("; ".join(f"{result['url']}: {result['error']}" for result in results))
    return {"results": results}


def _urls(args: dict) -> list[str]:
    urls = args.get("urls")
    if isinstance(urls, str):          # models often send one URL bare
        urls = [urls]
    if not isinstance(urls, list) or not urls or not all(isinstance(url, str) and url.strip() for url in urls):
        raise ToolError("'urls' must be a non-empty list of URL strings")
    if len(urls) > MAX_URLS:
        raise ToolError(f"at most {MAX_URLS} URLs per call, got {len(urls)}")
    return list(dict.fromkeys(url.strip() for url in urls))


async def _extract_one(client: httpx.AsyncClient, url: str) -> dict:
    try:
        page = await within(FETCH_SECONDS, fetch(client, url, max_bytes=MAX_PAGE_BYTES))
        title, text = await asyncio.to_thread(_readable_text, page)   # parsing is CPU work
    except ToolError as exc:
        return {"url": url, "error": str(exc)}
    except TimeoutError:
        return {"url": url, "error": f"no complete response within {FETCH_SECONDS:g}s"}
    result = {"url": url}
    if page.redirects:
        result["final_url"] = page.url
    if title:
        result["title"] = shortened(title, MAX_TITLE_CHARS)
    result["content"] = _capped(text)
    return result


def _readable_text(page: Page) -> tuple[str | None, str]:
    """(title, text): the main text of an HTML page as markdown, any other text page as it is."""
    if page.content_type in _HTML_TYPES or (not page.content_type and _looks_like_html(page.body)):
        title, text = _html_text(page)
    elif page.content_type.startswith("text/") or page.content_type in _TEXT_TYPES \
            or page.content_type.endswith(("+json", "+xml")):
        title, text = None, page.body.decode(_codec(page.charset), errors="replace")
    else:
        raise ToolError(f"the page is {page.content_type or 'of unknown type'}, not HTML or text")
    if not text or not text.strip():
        raise ToolError("the page has no readable text")
    return title, text.strip()


def _html_text(page: Page) -> tuple[str | None, str | None]:
    """trafilatura's main text; all of the page's text when it finds no article (a list page, an app
    shell)."""
    try:
        text = trafilatura.extract(page.body, url=page.url, output_format="markdown", include_links=True,
                                   include_tables=True, include_comments=False)
        if not text:
            text = trafilatura.html2txt(page.body)
        metadata = trafilatura.extract_metadata(page.body, default_url=page.url)
    except Exception as exc:    # a parser meeting arbitrary bytes: this page's failure, not the whole call's
        raise ToolError(f"could not parse the page: {type(exc).__name__}: {exc}") from None
    return (metadata.title if metadata else None), text


def _looks_like_html(body: bytes) -> bool:
    head = body[:1024].lstrip().lower()
    return head.startswith((b"<!doctype html", b"<html")) or b"<body" in head


def _codec(charset: str | None) -> str:
    """The server's charset when Python knows it as a text encoding, else UTF-8."""
    if charset:
        try:
            info = codecs.lookup(charset)
        except LookupError:
            return "utf-8"
        # Python also knows codecs that are no text encodings (rot13, hex, zlib): decode() refuses them.
        if info._is_text_encoding:
            return info.name
    return "utf-8"


def _capped(text: str) -> str:
    if len(text) <= MAX_CHARS:
        return text
    return (text[:MAX_CHARS] + f"\n\n[... cut here: the page has {len(text) - MAX_CHARS} more characters; "
            f"web_extract returns the first {MAX_CHARS}]")
