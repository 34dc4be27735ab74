"""The browser tools the model calls: navigate, snapshot, click, type, scroll, back, press, get_images.

The model reads a page as Playwright's AI accessibility snapshot and passes its ``[ref=eN]`` references
back to click and type. Each tool checks its arguments, acts on the session's tab, and returns what the
model sees, cut to size; a page that stopped answering has its tab closed, so that the session's next
call opens a fresh one instead of waiting on it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from batchrun.tools import ToolContext, ToolError
from batchrun.tools.address_policy import allowed_addresses
from batchrun.tools.browser.caps import (
    ALT_CHARS,
    MAX_IMAGES,
    TEXT_CHARS,
    URL_CHARS,
    cap_result,
    cut_text,
    first_line,
)
from batchrun.tools.browser.tab import (
    ACTION_TIMEOUT_S,
    NAVIGATION_TIMEOUT_S,
    Tab,
    Unresponsive,
    answer,
    discard_tab,
    open_tab,
    page_view,
    responds,
    session_tab,
)

if TYPE_CHECKING:
    from playwright.async_api import Locator, Page

_REF = re.compile(r"(?:f\d+)?e\d+")
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*:(?!\d)", re.IGNORECASE)    # "localhost:8000" has none


Tool = Callable[[dict, ToolContext], Awaitable[dict]]


def _browser_tool(tool: Tool) -> Tool:
    """A tool whose result is cut to size, and which closes the tab of a page that stopped answering
    (the session's next call then opens a fresh one instead of waiting on it again)."""

    @functools.wraps(tool)
    async def run(args: dict, ctx: ToolContext) -> dict:
        try:
            result = await tool(args, ctx)
        except Unresponsive as stuck:
            await discard_tab(ctx)
            raise ToolError(f"{stuck.what} failed: {stuck.why}, so its tab was closed; the next browser call "
                            f"opens a fresh tab, without the old tab's cookies and history: call browser_navigate "
                            f"to go on") from None
        return cap_result(result)

    return run


# --- the tools ----------------------------------------------------------------------------------

@_browser_tool
async def navigate(args: dict, ctx: ToolContext) -> dict:
    """Open an http(s) URL (one without a scheme gets https://) and return the page's snapshot."""
    url = _string(args, "url").strip()
    if not _SCHEME.match(url):
        url = "https://" + url
    await allowed_addresses(*_host_and_port(url))      # refuse before the browser is even started
    tab = await session_tab(ctx)
    note = {}
    if tab.page.url != "about:blank" and not await responds(tab.page):
        await discard_tab(ctx)             # leaving it would wait on it: its renderer must unload it
        tab = await session_tab(ctx)
        note["note"] = ("the previous page did not respond, so its tab was closed and this page opened in a "
                        "fresh tab, without the old tab's cookies and history")
    async with tab.acting(f"opening {cut_text(url, URL_CHARS)}"):
        began = asyncio.get_running_loop().time()
        response = await tab.page.goto(url, wait_until="commit")      # page_view waits for the document
        view = await page_view(tab, since=began)
    if "note" in view and note:
        note["note"] += "; " + view["note"]
    return {"status": response.status if response else None, **view, **note}


@_browser_tool
async def snapshot(args: dict, ctx: ToolContext) -> dict:
    """The current page again (after it changed by itself, or to refresh the refs)."""
    tab = await open_tab(ctx)
    async with tab.acting("snapshot"):
        return await page_view(tab)


# Whether a click on the element opens a new window: it is in a link, or in a form's submit button, aimed
# at `_blank`. (A script's window.open cannot be told beforehand: its window is the session's page from the
# next call on.) The attributes, not the properties: an SVG link's target is an object, and a form's
# `target` is its field of that name if it has one.
_OPENS_WINDOW_SCRIPT = """e => {
  const link = e.closest('a[href], a[*|href], area[href]'), control = e.closest('button, input');
  const submits = control && control.form && ['submit', 'image'].includes(control.type);
  const target = link ? link.getAttribute('target')
    : submits ? (control.getAttribute('formtarget') || control.form.getAttribute('target')) : '';
  return (target || '').toLowerCase() === '_blank';
}"""


@_browser_tool
async def click(args: dict, ctx: ToolContext) -> dict:
    """Click an element by ref; a navigation it starts, or the window it opens, is waited for before the
    snapshot. Playwright tells of a new window only after the click has returned."""
    tab = await open_tab(ctx)
    element, ref = _element(tab, args)
    async with tab.acting(f"click on {ref}"):
        await _require(element, ref)
        opener = tab.page
        if await answer(element.evaluate(_OPENS_WINDOW_SCRIPT)):
            await _click_into_new_window(tab, element)
        else:
            await element.click()
        return {"result": f"clicked {ref}", **await _view_after_click(tab, opener)}


async def _view_after_click(tab: Tab, opener: Page) -> dict:
    """The view of the window the click left the session in, or of ``opener``, the page clicked on, when
    that window closed itself (a page may close a window it opened, before or while it is shown)."""
    from playwright.async_api import Error

    if not tab.page.is_closed():
        try:
            return await page_view(tab)
        except Error:
            if not tab.page.is_closed():
                raise
    tab.page = opener
    return await page_view(tab)


async def _click_into_new_window(tab: Tab, element: Locator) -> None:
    """Click, and make the window that opens the session's page once its document is there. A page may
    keep the click to itself (a script's handler): after ACTION_TIMEOUT_S with no window, it stays."""
    from playwright.async_api import Error
    from playwright.async_api import TimeoutError as PlaywrightTimeout

    clicked = False
    try:
        async with tab.context.expect_page(timeout=ACTION_TIMEOUT_S * 1000) as opened:
            await element.click()
            clicked = True
    except PlaywrightTimeout:
        if clicked:             # the wait for the window ran out, not the click
            return
        raise
    tab.page = await opened.value       # as tab.follow does, whichever comes first
    # A slow page is shown as far as it got; one that closed itself (an Error) is not shown at all.
    with contextlib.suppress(PlaywrightTimeout, Error):
        await tab.page.wait_for_load_state("domcontentloaded", timeout=NAVIGATION_TIMEOUT_S * 1000)


@_browser_tool
async def type_text(args: dict, ctx: ToolContext) -> dict:
    """Replace the content of an input or editable element with ``text``."""
    tab = await open_tab(ctx)
    element, ref = _element(tab, args)
    text = _string(args, "text", allow_empty=True)
    async with tab.acting(f"typing into {ref}"):
        await _require(element, ref)
        await element.fill(text)
        return {"result": f"typed into {ref}", **await page_view(tab)}


@_browser_tool
async def scroll(args: dict, ctx: ToolContext) -> dict:
    """Scroll the window by most of a screen, so lazily loaded content appears."""
    direction = args.get("direction")
    if direction not in ("up", "down"):
        raise ToolError(f"'direction' must be 'up' or 'down', not {cut_text(repr(direction), TEXT_CHARS)}")
    tab = await open_tab(ctx)
    async with tab.acting(f"scrolling {direction}"):
        position = await answer(tab.page.evaluate(
            "down => { scrollBy(0, (down ? 0.8 : -0.8) * innerHeight);"
            " return [Math.round(scrollY), document.documentElement.scrollHeight]; }", direction == "down"))
        if not (isinstance(position, list) and len(position) == 2 and all(map(_is_number, position))):
            raise _garbled(f"scrolling {direction}")
        return {"result": f"scrolled {direction} to {position[0]} of {position[1]} px", **await page_view(tab)}


@_browser_tool
async def back(args: dict, ctx: ToolContext) -> dict:
    """Go back one page in this session's history."""
    tab = await open_tab(ctx)
    async with tab.acting("going back"):
        cdp = await answer(tab.context.new_cdp_session(tab.page))
        history = await answer(cdp.send("Page.getNavigationHistory"))
        await answer(cdp.detach())
        index = history["currentIndex"]
        if index == 0 or history["entries"][index - 1]["url"] == "about:blank":
            raise ToolError("there is no previous page to go back to")
        await tab.page.go_back(wait_until="domcontentloaded")
        return {"result": "went back", **await page_view(tab)}


@_browser_tool
async def press(args: dict, ctx: ToolContext) -> dict:
    """Press a key in the focused element (the one last typed into), or the page when none is."""
    key = _string(args, "key").strip()
    tab = await open_tab(ctx)
    focused = tab.page.locator("*:focus")
    async with tab.acting(f"pressing {cut_text(key, TEXT_CHARS)}"):
        if await answer(focused.count()):
            await focused.first.press(key)      # unlike keyboard.press, waits for a navigation it starts
        else:
            await answer(tab.page.keyboard.press(key))
        return {"result": f"pressed {key}", **await page_view(tab)}


# The page's http(s) images, each URL once, at most MAX_IMAGES of them with their texts one character
# over the limit (so the cut is seen and noted): a page's own sizes never cross the driver's pipe.
_IMAGES_SCRIPT = """([most, urlChars, altChars]) => {
  const seen = new Set(), images = [];
  for (const img of document.images) {
    const src = img.currentSrc || img.src;
    if (!(src.startsWith('http://') || src.startsWith('https://')) || seen.has(src)) continue;
    seen.add(src);
    if (images.length < most)
      images.push({src: src.slice(0, urlChars + 1), alt: (img.alt || '').slice(0, altChars + 1)});
  }
  return {images, count: seen.size};
}"""


@_browser_tool
async def get_images(args: dict, ctx: ToolContext) -> dict:
    """The page's images as absolute http(s) URLs with their alt text (data: URLs left out)."""
    tab = await open_tab(ctx)
    async with tab.acting("listing images"):
        found = await answer(tab.page.evaluate(_IMAGES_SCRIPT, [MAX_IMAGES, URL_CHARS, ALT_CHARS]))
    if not (isinstance(found, dict) and isinstance(found.get("images"), list) and _is_number(found.get("count"))
            and all(isinstance(image, dict) and set(image) == {"src", "alt"} and all(map(_is_text, image.values()))
                    for image in found["images"])):
        raise _garbled("listing images")
    return {"url": tab.page.url, "images": found["images"][:MAX_IMAGES], "count": found["count"]}


# --- helpers ------------------------------------------------------------------------------------

def _host_and_port(url: str) -> tuple[str, int]:
    """The host and port an http(s) ``url`` names; a ToolError for any other URL, or one whose host or
    port cannot be read (the parser raises ValueError for an unclosed '[' or a port out of range)."""
    try:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ToolError(f"only http and https URLs can be opened, not {cut_text(parts.scheme, TEXT_CHARS)}:")
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise ToolError(f"{cut_text(url, URL_CHARS)!r} cannot be opened: {first_line(exc)}") from None
    if not host:
        raise ToolError(f"no host in {cut_text(url, URL_CHARS)!r}")
    return host, port


def _garbled(what: str) -> ToolError:
    """A script's answer without the shape the script gives it: it runs among the page's own scripts,
    which can replace any builtin it calls (Set, Math.round...), Playwright's serialising ones too."""
    return ToolError(f"{what} failed: the page's own scripts garbled the answer (they replaced functions "
                     f"the browser provides)")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_text(value: object) -> bool:
    return isinstance(value, str)

def _string(args: dict, name: str, *, allow_empty: bool = False) -> str:
    value = args.get(name)
    if not isinstance(value, str):
        raise ToolError(f"missing string argument '{name}'")
    if not value.strip() and not allow_empty:
        raise ToolError(f"'{name}' must not be empty")
    return value


async def _require(element: Locator, ref: str) -> None:
    """Fail at once on a ref the page does not have, instead of waiting out the action's time limit."""
    if not await answer(element.count()):
        raise ToolError(f"no element with ref {ref} on the current page; refs change when the page does, so "
                        f"take a new browser_snapshot and use a ref from it")


def _element(tab: Tab, args: dict) -> tuple[Locator, str]:
    """The element the model's ``ref`` names ('e12', also as 'ref=e12' or '[ref=e12]')."""
    ref = _string(args, "ref").strip().removeprefix("[").removesuffix("]").removeprefix("ref=")
    if not _REF.fullmatch(ref):
        raise ToolError(f"'ref' must be an element reference such as 'e12' from the latest snapshot, "
                        f"not {cut_text(ref, TEXT_CHARS)!r}")
    return tab.page.locator(f"aria-ref={ref}"), ref
