"""One session's tab: its own browser context (cookies, storage, cache) of the process's Chromium, with
its own gate, the page the model is looking at, and the bounds on every call that waits on that page.

The tab is opened on the session's first browser call and closed when the session ends. A page may
stop answering altogether (a script that never yields), so every call that waits on it is bounded, and
a page that stopped is reported as :class:`Unresponsive`, for its tab to be closed rather than left to
block the session's later calls. Apart from the actions because this is the state they share; they say
what to do with a page, this says how long the page gets and what its failures mean.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from batchrun.time_limit import within
from batchrun.tools import ToolContext, ToolError
from batchrun.tools.browser.caps import TEXT_CHARS, TITLE_CHARS, cut_text, first_line
from batchrun.tools.browser.gate import Gate, Gates
from batchrun.tools.browser.launch import TabLimits, current_host

if TYPE_CHECKING:
    from playwright.async_api import Browser, BrowserContext, CDPSession, Page

T = TypeVar("T")

NAVIGATION_TIMEOUT_S = 15.0
ACTION_TIMEOUT_S = 5.0        # also what the page gets to answer any other call, and to prove it is alive
# The windows a session's context keeps open: a page that opens one whenever it may (the popup blocker
# lets one through per user action, and each of Playwright's scripts on the page counts as one) would
# otherwise pile up renderers in the worker's one browser.
MAX_WINDOWS = 4
# The most a document (a page's or a frame's) may hold after decompression: a few hundred kilobytes of
# gzip inflate to gigabytes, which the renderer takes in for as long as the navigation may last (3 GB of
# memory in 15 s), and stops answering meanwhile.
MAX_DOCUMENT_BYTES = 10 * 2**20
# The most a page's AI snapshot may come to, as the tools reckon it before taking one (_MEASURE_SCRIPT): a
# page's scripts can make it any size (a 100-million-character link), and all of it would cross
# Playwright's driver into the worker, which every prompt of the worker shares, before it is cut. Twice
# MAX_DOCUMENT_BYTES, so that a page of plain text whose loading was stopped there is still shown: more
# arrives before the stop takes effect (a mebibyte or more).
MAX_PAGE_CHARS = 2 * MAX_DOCUMENT_BYTES
_STATE_KEY = "browser"


class Unresponsive(Exception):
    """The page stopped answering during ``what`` (a script that never yields blocks every later
    call on it, the next navigation included), or its renderer crashed (which fails every later call)."""

    def __init__(self, what: str, why: str = "the page did not respond (a script that never yields?)") -> None:
        super().__init__(what)
        self.what = what
        self.why = why


@dataclass
class Tab:
    """A session's browser context, the page the model is looking at, and the context's gate."""

    browser: Browser
    context: BrowserContext
    page: Page
    gate: Gate
    gates: Gates
    limits: TabLimits
    crashed: dict[Page, str] = field(default_factory=dict)      # the pages whose renderer died, and why
    # Each page's CDP session and main frame, for reading the page in a world of the tools' own.
    _frames: dict[Page, tuple[CDPSession, str]] = field(default_factory=dict)
    oversized: set[Page] = field(default_factory=set)       # those whose loading was stopped, until shown
    _stopping: set[asyncio.Task] = field(default_factory=set)

    async def watch(self, page: Page) -> None:
        """Note the page's renderer crashing (Playwright keeps a crashed page, failing every call on it),
        and stop the page's loading when a document passes MAX_DOCUMENT_BYTES."""
        from playwright.async_api import Error

        page.on("crash", self._crashed)
        documents: dict[str, int] = {}          # request id: bytes received, after decompression

        def response(event: dict[str, Any]) -> None:
            if event["type"] == "Document":
                documents[event["requestId"]] = 0

        def data(event: dict[str, Any]) -> None:
            received = documents.get(event["requestId"])
            if received is None:
                return
            documents[event["requestId"]] = received = received + event["dataLength"]
            if received > MAX_DOCUMENT_BYTES:
                del documents[event["requestId"]]
                self.oversized.add(page)
                stopping = asyncio.ensure_future(_stop_loading(cdp))
                self._stopping.add(stopping)
                stopping.add_done_callback(self._stopping.discard)

        def ended(event: dict[str, Any]) -> None:
            documents.pop(event["requestId"], None)

        with contextlib.suppress(Error):        # a window closed as soon as it opened
            cdp = await self.context.new_cdp_session(page)
            cdp.on("Network.responseReceived", response)
            cdp.on("Network.dataReceived", data)
            cdp.on("Network.loadingFinished", ended)
            cdp.on("Network.loadingFailed", ended)
            # Without buffers, or it would keep its own copy of every body a script fetched.
            await cdp.send("Network.enable", {"maxTotalBufferSize": 0, "maxResourceBufferSize": 0})

    async def evaluate_isolated(self, expression: str) -> Any:
        """The value of ``expression`` evaluated in the page's main frame, in a world of the tools' own:
        the page's scripts cannot reach it, so they can neither change the builtins it calls nor see it
        run. Chromium keeps one world per name and frame, and gives a new document a new one."""
        if self.page not in self._frames:
            cdp = await answer(self.context.new_cdp_session(self.page))
            # A page's main frame has the id of its target, whatever documents it holds.
            target = await answer(cdp.send("Target.getTargetInfo"))
            self._frames[self.page] = cdp, target["targetInfo"]["targetId"]
        cdp, frame = self._frames[self.page]
        world = await answer(cdp.send("Page.createIsolatedWorld", {"frameId": frame, "worldName": "batchrun",
                                                                   "grantUniveralAccess": True}))
        evaluated = await answer(cdp.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                               "contextId": world["executionContextId"]}))
        if "exceptionDetails" in evaluated:
            thrown = str(evaluated["exceptionDetails"].get("text"))
            raise ToolError(f"reading the page failed: {cut_text(thrown, TEXT_CHARS)}")
        return evaluated["result"].get("value")

    def _crashed(self, page: Page) -> None:
        self.crashed[page] = self.limits.struck() or "the page crashed (too big or too deep for the browser?)"

    async def follow(self, page: Page) -> None:
        """A link opened in a new window: the model carries on there, as a person would; the oldest
        windows beyond MAX_WINDOWS are closed."""
        from playwright.async_api import Error

        self.page = page
        await self.watch(page)
        for old in self.context.pages[:-MAX_WINDOWS]:
            with contextlib.suppress(Error, TimeoutError):
                await within(ACTION_TIMEOUT_S, old.close())

    async def close(self) -> None:
        """Close the context, its pages and their renderers (a hung one included)."""
        with contextlib.suppress(Exception):
            await within(ACTION_TIMEOUT_S, self.context.close())
        self.limits.tab_closed()
        self.gates.remove(self.gate)
        self.gate.close()

    @contextlib.asynccontextmanager
    async def acting(self, what: str) -> AsyncIterator[None]:
        """Turn Playwright's errors during an action into a ToolError the model can act on, and a time-out
        on a page that no longer answers into Unresponsive."""
        from playwright.async_api import Error
        from playwright.async_api import TimeoutError as PlaywrightTimeout

        self.gate.failures.clear()
        try:
            yield
        except (TimeoutError, PlaywrightTimeout) as exc:
            if not await responds(self.page):
                raise Unresponsive(what) from None
            raise ToolError(f"{what} failed: "
                            f"{first_line(exc) or f'no answer within {ACTION_TIMEOUT_S:g} s'}") from None
        except Error as exc:
            if self.page in self.crashed:
                raise Unresponsive(what, self.crashed[self.page]) from None
            message = first_line(exc)
            if "ERR_SOCKS_CONNECTION_FAILED" in message and self.gate.failures:
                message = self.gate.failures[-1]
            raise ToolError(f"{what} failed: {message}") from None


async def responds(page: Page) -> bool:
    """Whether the page's renderer still runs scripts."""
    from playwright.async_api import Error

    try:
        await answer(page.evaluate("0"))
    except TimeoutError:
        return False
    except Error:           # closed, or between two documents: not stuck
        pass
    return True


async def session_tab(ctx: ToolContext) -> Tab:
    """The session's tab, opened on its first browser call (and again after the browser crashed or
    the tab was discarded)."""
    tab: Tab | None = ctx.state.get(_STATE_KEY)
    if tab is not None and current_host().serves(tab.browser) and tab.page not in tab.crashed:
        if tab.page.is_closed():    # the window it followed was closed: back to the newest one left
            tab.page = tab.context.pages[-1] if tab.context.pages else await tab.context.new_page()
        return tab
    if _STATE_KEY not in ctx.state:
        ctx.cleanups.append(functools.partial(_close_tab, ctx))
    elif tab is not None:
        await tab.close()
    ctx.state[_STATE_KEY] = None
    from playwright.async_api import Error

    browser, gates, limits = await current_host().browser(ctx.settings.limits, ctx.settings.run_label)
    gate = Gate()
    limits.tab_opening()
    context: BrowserContext | None = None
    try:
        context = await browser.new_context(proxy={"server": await gates.add(gate)}, service_workers="block",
                                            accept_downloads=False)
        context.set_default_timeout(ACTION_TIMEOUT_S * 1000)
        context.set_default_navigation_timeout(NAVIGATION_TIMEOUT_S * 1000)
        tab = Tab(browser=browser, context=context, page=await context.new_page(), gate=gate, gates=gates,
                  limits=limits)
        await tab.watch(tab.page)
    except BaseException as exc:
        if context is not None:         # else it stays open in the browser for the worker's life
            with contextlib.suppress(Exception):
                await within(ACTION_TIMEOUT_S, context.close())
        limits.tab_closed()
        gates.remove(gate)
        gate.close()
        if isinstance(exc, Error):
            raise ToolError(f"could not open a tab: {limits.struck() or first_line(exc)}") from None
        raise
    context.on("page", tab.follow)
    ctx.state[_STATE_KEY] = tab
    return tab


async def _stop_loading(cdp: CDPSession) -> None:
    """Stop the page's loading, as its Stop button does: in the browser process, however busy the
    renderer is."""
    from playwright.async_api import Error

    with contextlib.suppress(Error):        # closed meanwhile
        await cdp.send("Page.stopLoading")


async def open_tab(ctx: ToolContext) -> Tab:
    """The session's tab for an action that needs a page already loaded."""
    tab = await session_tab(ctx)
    if tab.page.url == "about:blank":
        raise ToolError("no page is open; call browser_navigate first")
    return tab


async def discard_tab(ctx: ToolContext) -> None:
    """Close the session's tab; its next browser call opens a fresh one."""
    tab: Tab | None = ctx.state.get(_STATE_KEY)
    ctx.state[_STATE_KEY] = None
    if tab is not None:
        await tab.close()


async def _close_tab(ctx: ToolContext) -> None:
    tab: Tab | None = ctx.state.pop(_STATE_KEY, None)
    if tab is not None:
        await tab.close()


async def answer(awaitable: Awaitable[T]) -> T:
    """A call the page's renderer must answer (a script, the title, a key press): Playwright would wait
    for ever on a page whose script never yields."""
    return await within(ACTION_TIMEOUT_S, awaitable)


async def page_view(tab: Tab, since: float | None = None) -> dict:
    """What the model sees of the page: url, title and the AI snapshot (cut to size by the tool), and a
    note when the page had not finished loading or its frames were left out of it. The document gets
    NAVIGATION_TIMEOUT_S to be parsed, from ``since`` (the event loop's time a navigation began) or now."""
    from playwright.async_api import Error

    page = tab.page
    deadline = (asyncio.get_running_loop().time() if since is None else since) + NAVIGATION_TIMEOUT_S

    async def read() -> tuple[str, str, bool, bool]:
        parsed = await _parsed(tab, deadline)
        title, has_body = await _measured(tab)
        tree, whole = await _tree(page, has_body)
        return tree, title, parsed, whole

    try:
        tree, title, parsed, whole = await read()
    except Error:       # a navigation replaced the document mid-snapshot; a second failure is real
        tree, title, parsed, whole = await read()
    view = {"url": page.url, "title": title, "snapshot": tree}
    notes = []
    if page.url.startswith("chrome-error:") and tab.gate.failures:     # its error page tells no reason
        notes.append(f"the browser could not open the page: {tab.gate.failures[-1]}")
    if page in tab.oversized:
        tab.oversized.discard(page)
        notes.append(f"the page is larger than {MAX_DOCUMENT_BYTES // 2**20} MiB (after decompression), so its "
                     f"loading was stopped there")
    if not parsed:
        notes.append(f"the page had not finished loading within {NAVIGATION_TIMEOUT_S:g} s (a slow or stalled "
                     f"server?), so this is as much of it as had arrived")
    if not whole:
        notes.append(f"the page's frames (iframes) did not answer within {ACTION_TIMEOUT_S:g} s, so their "
                     f"content is left out of the snapshot")
    if notes:
        view["note"] = "; ".join(notes)
    return view


async def _parsed(tab: Tab, deadline: float) -> bool:
    """Wait until the page's document has been parsed (a navigation may have just begun); whether it was
    by ``deadline`` (the event loop's time). A document whose loading was stopped (window.stop()) is parsed
    as far as it will ever be, yet never fires the DOMContentLoaded that Playwright's load states wait
    for: its readyState tells."""
    from playwright.async_api import Error
    from playwright.async_api import TimeoutError as PlaywrightTimeout

    page = tab.page
    try:
        if await answer(page.evaluate("document.readyState")) != "loading":
            return True
        left_ms = (deadline - asyncio.get_running_loop().time()) * 1000
        if left_ms < 1:         # Playwright reads a timeout of 0 as none at all
            return False
        await page.wait_for_function("document.readyState !== 'loading'", polling=100, timeout=left_ms)
    except PlaywrightTimeout:
        return False
    except Error:               # between two documents, the next one parsed or not: the snapshot tells
        if page in tab.crashed:     # Playwright would wait on it for ever
            raise
    return True


# The page's title, one character over the limit (so the cut is seen and noted), whether it has a body,
# and what its AI snapshot may come to, counted up to just past the limit: its text, except where display
# is none (a <head>, whose <title> may be huge); every attribute (a link's URL, an accessible name, what
# CSS's attr() may show) and form value; CSS's ::before and ::after content; each element's line and
# indentation; and its accessible name, which Playwright shows up to 900 characters long, so that 100,000
# buttons named by one long text (aria-labelledby) count as much as they show. It reaches into shadow roots
# and the frames it can reach: those of the page's origin (another origin's are not reckoned); Playwright's
# snapshot shows no closed shadow root either.
_MEASURE_SCRIPT = """(([limit, titleChars]) => {
  const NAME_CHARS = 900, LINE_CHARS = 40;
  const contentChars = (style, attributeChars) => {
    const content = style ? style.content : 'none';
    if (!content || content === 'none' || content === 'normal') return 0;
    return content.length + (content.split('attr(').length - 1) * attributeChars;
  };
  const ownChars = (element, view) => {
    let attributeChars = 0;
    for (const attribute of element.attributes) attributeChars += attribute.value.length;
    const value = typeof element.value === 'string' ? element.value.length : 0;
    return attributeChars + value + contentChars(view.getComputedStyle(element, '::before'), attributeChars)
      + contentChars(view.getComputedStyle(element, '::after'), attributeChars);
  };
  const parents = [], texts = [], named = [];
  let size = 0;
  const stack = [[document, -1, 0]];
  while (stack.length && size <= limit) {
    const [node, parent, depth] = stack.pop();
    if (node.nodeType === Node.TEXT_NODE) {
      size += node.data.length;
      if (parent >= 0) texts[parent] += node.data.length;
      continue;
    }
    let index = parent;
    if (node.nodeType === Node.ELEMENT_NODE) {
      const view = node.ownerDocument.defaultView;
      if (!view || view.getComputedStyle(node).display === 'none') continue;
      index = parents.length;
      parents.push(parent);
      texts.push(0);
      named.push(node.hasAttribute('aria-labelledby') || (node.labels && node.labels.length > 0));
      size += LINE_CHARS + 2 * depth + ownChars(node, view);
      if (node.shadowRoot) stack.push([node.shadowRoot, index, depth + 1]);
      if (node.contentDocument) stack.push([node.contentDocument, index, depth + 1]);
    }
    for (let child = node.lastChild; child; child = child.previousSibling) stack.push([child, index, depth + 1]);
  }
  for (let index = parents.length - 1; index >= 0 && size <= limit; index--) {
    size += named[index] ? NAME_CHARS : Math.min(NAME_CHARS, texts[index]);
    if (parents[index] >= 0) texts[parents[index]] += texts[index];
  }
  return [String(document.title).slice(0, titleChars + 1), !!document.body, size];
})"""


async def _measured(tab: Tab) -> tuple[str, bool]:
    """The page's title (one character over TITLE_CHARS at most) and whether it has a body, read in the
    tools' own world; a ToolError if its snapshot could come to more than MAX_PAGE_CHARS. Playwright's
    title and snapshot have no size limit: all of a page's 100 million characters would cross its driver
    into the worker before the result was cut."""
    title, has_body, size = await tab.evaluate_isolated(
        f"{_MEASURE_SCRIPT}({json.dumps([MAX_PAGE_CHARS, TITLE_CHARS])})")
    if size > MAX_PAGE_CHARS:
        raise ToolError(f"the page is too large to show: its text, attributes and elements come to more than "
                        f"{MAX_PAGE_CHARS:,} characters (its scripts may have made it so); open a smaller page "
                        f"instead, such as one section of the site or a search within it")
    return title, has_body


# Hides every frame element, in shadow roots too, from the snapshot (which lists what is visible, even
# when aria-hidden), keeping the layout; returns them with the style attribute each had, for
# _SHOW_FRAMES to put back.
_HIDE_FRAMES = """() => {
  const hidden = [], roots = [document];
  while (roots.length)
    for (const element of roots.pop().querySelectorAll('*')) {
      if (element.shadowRoot) roots.push(element.shadowRoot);
      if (element.localName !== 'iframe' && element.localName !== 'frame') continue;
      hidden.push([element, element.getAttribute('style')]);
      element.style.setProperty('visibility', 'hidden', 'important');
    }
  return hidden;
}"""
_SHOW_FRAMES = """hidden => { for (const [element, style] of hidden)
  style === null ? element.removeAttribute('style') : element.setAttribute('style', style); }"""


async def _tree(page: Page, has_body: bool) -> tuple[str, bool]:
    """The page's AI snapshot, and whether its frames are in it.

    Playwright's snapshot waits for every frame's document, and one may never come (a frame the browser
    refused to load, a server that never answers, a script looping in another renderer): then, if the
    page itself still answers, it is snapshotted again with its frames hidden, rather than not at all.
    Playwright's snapshot of a page is one of its body, which it waits for: a document without one (SVG,
    XML) is snapshotted from its root element instead.
    """
    root = page if has_body else page.locator(":root")
    try:
        return await answer(root.aria_snapshot(mode="ai", timeout=0)), True
    except TimeoutError:
        if not await responds(page):
            raise
    hidden = await answer(page.evaluate_handle(_HIDE_FRAMES))
    try:
        return await answer(root.aria_snapshot(mode="ai", timeout=0)), False
    finally:
        await answer(hidden.evaluate(_SHOW_FRAMES))
        await answer(hidden.dispose())
