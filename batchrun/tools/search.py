"""The web_search tool over the backend the user configured (see :mod:`batchrun.tools.configuration`).

Each backend is one documented HTTP call (ddgs: one library call) mapped to the same result shape,
``{"title", "url", "snippet"}``, so trajectories do not depend on which search engine produced them.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from batchrun.time_limit import within
from batchrun.tools import ToolContext, ToolError
from batchrun.tools.arguments import non_empty_text, positive_int
from batchrun.tools.clients import service_answer
from batchrun.tools.configuration import Backend, NotConfigured, search_backend
from batchrun.tools.net import MAX_TITLE_CHARS, shortened

SEARCH_SECONDS = 20.0
DEFAULT_RESULTS = 5
MAX_RESULTS = 20
# What a result needs of its snippet (and title: MAX_TITLE_CHARS), and the longest URL it may name
# (browsers' practical limit): a service's answer may be 16 MiB, and one result of it must not be a tool
# result of that size.
MAX_SNIPPET_CHARS = 1_000
MAX_URL_CHARS = 2_048
_TAG = re.compile(r"<[^>]+>")
_SPACE = re.compile(r"\s+")


async def web_search(args: dict, ctx: ToolContext) -> dict:
    """``{"results": [{"title", "url", "snippet"}, ...]}`` for ``query``."""
    query = non_empty_text(args, "query")
    count = min(positive_int(args, "max_results", DEFAULT_RESULTS), MAX_RESULTS)
    try:
        backend = search_backend()
    except NotConfigured as exc:
        raise ToolError(f"web_search is not configured: {exc}") from None
    try:
        results = await within(SEARCH_SECONDS, _SEARCHES[backend.name](backend, query, count))
    except TimeoutError:
        raise ToolError(f"{backend.name} search did not answer within {SEARCH_SECONDS:g}s") from None
    return {"results": [result for result in results if result["url"]][:count]}


def _plain(text: object, limit: int) -> str:
    """Snippets arrive with highlighting markup (<strong>) and entities; the model wants text, at most
    ``limit`` characters of it (and an ellipsis where cut)."""
    if not isinstance(text, str):
        return ""
    return shortened(_SPACE.sub(" ", html.unescape(_TAG.sub("", text))).strip(), limit)


def _result(title: object, url: object, snippet: object) -> dict:
    """A result; one whose URL is longer than any link can be has none, and is left out."""
    usable = isinstance(url, str) and len(url) <= MAX_URL_CHARS
    return {"title": _plain(title, MAX_TITLE_CHARS), "url": url if usable else "",
            "snippet": _plain(snippet, MAX_SNIPPET_CHARS)}


async def _json(backend: Backend, method: str, url: str, **request: Any) -> dict:
    """One API call's JSON object; transport errors, answers too large and non-200 answers become
    tool errors."""
    failed = f"{backend.name} search failed"
    status, body = await service_answer(SEARCH_SECONDS, failed, method, url, **request)
    if status != 200:
        hint = (" (enable the json format under search.formats in the SearXNG settings)"
                if backend.name == "searxng" and status == 403 else "")
        raise ToolError(f"{failed}: HTTP {status}{hint}: {body[:300].decode('utf-8', 'replace')}")
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise ToolError(f"{backend.name} search answered something that is not a JSON object")
    return data


def _items(value: object) -> list[dict]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


async def _searxng(backend: Backend, query: str, count: int) -> list[dict]:
    """SearXNG's JSON API: GET /search?q=...&format=json -> results[].title/url/content."""
    data = await _json(backend, "GET", f"{backend.base_url}/search", params={"q": query, "format": "json"})
    return [_result(item.get("title"), item.get("url"), item.get("content"))
            for item in _items(data.get("results"))]


async def _brave(backend: Backend, query: str, count: int) -> list[dict]:
    """Brave Search API: GET /web/search with X-Subscription-Token -> web.results[].title/url/description."""
    data = await _json(backend, "GET", f"{backend.base_url}/web/search", params={"q": query, "count": count},
                       headers={"X-Subscription-Token": backend.api_key, "Accept": "application/json"})
    web = data.get("web")
    return [_result(item.get("title"), item.get("url"), item.get("description"))
            for item in _items(web.get("results") if isinstance(web, dict) else None)]


async def _tavily(backend: Backend, query: str, count: int) -> list[dict]:
    """Tavily: POST /search with a bearer key -> results[].title/url/content."""
    data = await _json(backend, "POST", f"{backend.base_url}/search", json={"query": query, "max_results": count},
                       headers={"Authorization": f"Bearer {backend.api_key}"})
    return [_result(item.get("title"), item.get("url"), item.get("content"))
            for item in _items(data.get("results"))]


async def _ddgs(backend: Backend, query: str, count: int) -> list[dict]:
    """The ddgs library (synchronous, so in a thread) -> title/href/body."""
    from ddgs import DDGS
    from ddgs.exceptions import DDGSException

    def search() -> list[dict]:
        return DDGS(timeout=int(SEARCH_SECONDS)).text(query, max_results=count)

    try:
        items = await asyncio.to_thread(search)
    except DDGSException as exc:
        raise ToolError(f"ddgs search failed: {exc}") from None
    return [_result(item.get("title"), item.get("href"), item.get("body")) for item in _items(items)]


_SEARCHES: dict[str, Callable[[Backend, str, int], Awaitable[list[dict]]]] = {
    "searxng": _searxng, "brave": _brave, "tavily": _tavily, "ddgs": _ddgs}
