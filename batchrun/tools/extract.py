"""The web_extract tool: fetch pages and return the main text of each, as markdown.

trafilatura finds the article in a page and drops navigation, headers, footers and other
boilerplate, which would otherwise fill the model's context. Pages are fetched with httpx through
:mod:`batchrun.tools.net` (trafilatura's own fetcher applies none of our limits). One URL failing
is reported in its own result; the call fails only when every URL failed.

What parsing a page costs follows its shape more than its size: a 4.4 MB book of 90,000 elements took
234 MB and 9 s of CPU, a 4.8 MB page of 600,000 bare ``<p>`` elements 1 GB and 33 s, and 20,000
elements of 50 attributes each 1.4 GB. No cheap look at the bytes bounds that, so each page is parsed in
a child process forked for it, which the kernel holds to PARSE_MEMORY_MB more than the worker and which
is killed after PARSE_SECONDS; a worker runs one such child at a time. The worker, which runs dozens of
prompts, never holds a parse's memory, and a parse the call gave up on does not go on.
"""

from __future__ import annotations

import asyncio
import codecs
import gc
import json
import math
import os
import resource
import signal
import socket
import sys
import traceback
import weakref
from pathlib import Path
from typing import NoReturn

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
# A page's parse, in its child process: twice what the largest real page measured took (see above).
PARSE_MEMORY_MB = 512
PARSE_SECONDS = 20.0
_HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
_TEXT_TYPES = frozenset({"application/json", "application/xml", "application/javascript",
                         "application/x-ndjson", "application/yaml"})
_ACCEPT = "text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.5"


async def web_extract(args: dict, ctx: ToolContext) -> dict:
    """``{"results": [...]}``, one entry per URL in order: its content, or its error."""
    urls = _urls(args)
    own_turns = ctx.state.setdefault(_OWN_TURNS, asyncio.Lock())
    async with http_client(FETCH_SECONDS, trust_env=False, headers={"Accept": _ACCEPT}) as client:
        results = await asyncio.gather(*(_extract_one(client, url, own_turns) for url in urls))
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


async def _extract_one(client: httpx.AsyncClient, url: str, own_turns: asyncio.Lock) -> dict:
    """This URL's entry of the results: its content, or why it has none."""
    try:
        page = await within(FETCH_SECONDS, fetch(client, url, max_bytes=MAX_PAGE_BYTES))
        title, content = await _parsed(page, own_turns)
    except ToolError as exc:
        return {"url": url, "error": str(exc)}
    except TimeoutError:
        return {"url": url, "error": f"no complete response within {FETCH_SECONDS:g}s"}
    except Exception as exc:    # a surprise from a library or a bug: this URL's failure, not the others' too
        return {"url": url, "error": f"{type(exc).__name__}: {exc}"}
    result = {"url": url}
    if page.redirects:
        result["final_url"] = page.url
    if title:
        result["title"] = title
    result["content"] = content
    return result


# One parse at a time in each worker process (one event loop each), so that a worker holds at most one
# child's PARSE_MEMORY_MB. The turn is given in order of asking, and a session asks for it for one of its
# pages at a time (its lock, kept in the session's state under _OWN_TURNS): so the turn goes round the
# sessions, and one prompt's five pages that parse for PARSE_SECONDS each keep another prompt's page
# waiting for one of them, not for all five (which outlasted that prompt's tool time limit).
_parse_turns: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()
_OWN_TURNS = "web_extract.parse_turns"


async def _parsed(page: Page, own_turns: asyncio.Lock) -> tuple[str | None, str]:
    """(title, content) of the page as its entry shows them, from a child process forked to parse it.

    Forked, not started afresh: the child has trafilatura loaded already (a new interpreter would take
    0.3 s of CPU to load it for each page), and multiprocessing refuses to start children of a daemonic
    worker process. The worker has threads (the file tools', the disk guard's), and a fork copies their
    locks as they are, which the report's plots avoid by not forking then (report/plots.py); here the
    child is bounded instead: one stuck on such a lock is killed at PARSE_SECONDS, and only its page fails.
    """
    async with own_turns, _parse_turns.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(1)):
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            _parse_in_child(page, theirs)
        theirs.close()
        try:
            answer = await _answer_from(ours)
        finally:
            # One that answered has exited: its memory is gone before its end of the socket closes, so
            # reaping it is quick. One that has not must not go on.
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
    if not answer:
        raise ToolError(f"the process parsing the page ended without an answer ({_how_it_ended(status)})")
    reply = json.loads(answer)
    if "error" in reply:
        raise ToolError(reply["error"])
    return reply["title"], reply["content"]


async def _answer_from(ours: socket.socket) -> bytes:
    """All the child sends, which ends when it exits; empty if it died first."""
    reader, writer = await asyncio.open_connection(sock=ours)
    try:
        return await within(PARSE_SECONDS, reader.read())
    except TimeoutError:
        raise ToolError(f"parsing the page took longer than {PARSE_SECONDS:g}s, the most web_extract gives "
                        f"one page") from None
    finally:
        writer.close()


def _how_it_ended(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _parse_in_child(page: Page, theirs: socket.socket) -> NoReturn:
    """The forked child's whole life: it must never return into the worker's code, whatever happens."""
    code = 1
    try:
        address_space = _bound_this_child(theirs.fileno())
        theirs.sendall(json.dumps(_answer_for(page, address_space)).encode())
        code = 0
    except BaseException:
        traceback.print_exc()       # a bug: the worker's log shows it, the page's entry that no answer came
    finally:
        os._exit(code)


def _bound_this_child(keep: int) -> int:
    """Hold this child to PARSE_MEMORY_MB of memory more than the worker it was forked from, and to
    PARSE_SECONDS of CPU should the worker be gone and not kill it; the address space it may now map."""
    # The worker's objects are the worker's: never collected here (their finalizers would close its
    # connections), nor scanned, which would copy every page holding one.
    gc.freeze()
    # The worker's connections and pipes: one held open here would stay open after the worker closed it.
    os.closerange(3, keep)
    os.closerange(keep + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    _hold(resource.RLIMIT_CPU, math.ceil(PARSE_SECONDS))     # the same hard limit: SIGKILL, not SIGXCPU
    _hold(resource.RLIMIT_CORE, 0)          # a crash would dump the worker's memory
    return _hold(resource.RLIMIT_AS, _address_space("VmSize") + PARSE_MEMORY_MB * 2**20)


def _hold(limit: int, value: int) -> int:
    """Set ``limit`` to ``value`` for good (soft and hard), or to the hard limit where that is lower."""
    hard = resource.getrlimit(limit)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(limit, (value, value))
    return value


def _address_space(field: str) -> int:
    """This process's address space in bytes as /proc gives it: VmSize now, VmPeak at most so far."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(dict(line.split(":", 1) for line in lines)[field].split()[0]) * 1024


# A refused allocation is not always a MemoryError: lxml may stop the parse without a word and go on
# with part of the page, or none. Any refusal of a request smaller than this leaves the peak within it
# of the limit; the pages measured ended hundreds of MB below it.
_REFUSAL_MARGIN = 64 * 2**20


def _answer_for(page: Page, address_space: int) -> dict:
    """What the child sends back: the page's title and content, or why it has none."""
    # lxml reports errors it goes on from as unraisable: out of memory, hundreds of tracebacks that would
    # fill the worker's log. The peak below tells what they would.
    sys.unraisablehook = lambda unraisable: None
    out_of_memory = {"error": f"parsing the page needs more than {PARSE_MEMORY_MB} MB of memory, the most "
                              f"web_extract gives one page"}
    try:
        title, text = _readable_text(page)
        answer = {"title": title and shortened(title, MAX_TITLE_CHARS), "content": _capped(text)}
    except ToolError as exc:
        answer = {"error": str(exc)}
    except MemoryError:
        return out_of_memory
    return out_of_memory if _address_space("VmPeak") > address_space - _REFUSAL_MARGIN else answer


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
        # Only the title is used, which is settled before the date is looked for: the extensive date
        # search (dateparser trying some 200 locales) took most of the CPU of a large page, 2 s in a
        # fresh process such as the parse's.
        metadata = trafilatura.extract_metadata(page.body, default_url=page.url, extensive=False)
    except MemoryError:         # the child's bound: _answer_for says so
        raise
    except Exception as exc:    # a parser meeting arbitrary bytes: this page's failure, not the whole call's
        raise ToolError(f"could not parse the page: {type(exc).__name__}: {exc}") from None
    return (metadata.title if metadata else None), text


def _looks_like_html(body: bytes) -> bool:
    head = body[:1024].lstrip().lower()
    return head.startswith((b"<!doctype html", b"<html")) or b"<body" in head


_NO_CHARSETS = frozenset({"idna", "punycode", "undefined", "unicode-escape", "raw-unicode-escape"})


def _codec(charset: str | None) -> str:
    """The server's charset when Python knows it as a text encoding, else UTF-8."""
    if charset:
        try:
            info = codecs.lookup(charset)
        except LookupError:
            return "utf-8"
        # Python also knows codecs that are no text encodings (rot13, hex, zlib): decode() refuses them;
        # and text encodings that are no charset: idna and undefined raise whatever errors= says (the page's
        # parse process died with a traceback on the console), punycode and the escapes make other text.
        if info._is_text_encoding and info.name not in _NO_CHARSETS:
            return info.name
    return "utf-8"


def _capped(text: str) -> str:
    if len(text) <= MAX_CHARS:
        return text
    return (text[:MAX_CHARS] + f"\n\n[... cut here: the page has {len(text) - MAX_CHARS} more characters; "
            f"web_extract returns the first {MAX_CHARS}]")
