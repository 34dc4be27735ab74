"""The browser tools against the system Chromium and a small site on 127.0.0.1.

One event loop (so one browser) serves the whole module; each test opens its own sessions. Skipped
with the reason when Playwright or Chromium is missing (CI installs both).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Coroutine, Iterator
from urllib.parse import parse_qs, urlsplit

import pytest

import model_tools
from batchrun.environments.base import EnvironmentSettings
from batchrun.tools import ToolContext, ToolError
from batchrun.tools import browser
from conftest import batch_rows, endpoint_args, run_cli, write_dataset

METADATA = "http://169.254.169.254/latest/meta-data/"
# The smallest valid PNG: one transparent pixel.
PIXEL = bytes.fromhex("89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
                      "0000000d49444154789c6360000002000100ffff03000006000557bfabd400000000"
                      "49454e44ae426082")
PAGES = {
    "/": "<title>Home</title><h1>Welcome</h1><a href='/form'>Go to form</a>"
         "<img src='/cat.png' alt='A cat'><img src='data:image/png;base64,AAAA' alt='inline'>",
    "/form": "<title>Form</title><form action='/result'><label>Name <input name='name'></label>"
             "<button type='submit'>Send</button></form>",
    "/leaky": f"<title>Leaky</title><p>Look</p><img src='{METADATA}' alt='metadata'>",
    "/long": "<title>Long</title>" + "".join(f"<p>Paragraph number {i} of a long page.</p>" for i in range(2000)),
}


class SiteHandler(BaseHTTPRequestHandler):
    """Static pages, a result page echoing the form, a cookie jar probe and a redirect to metadata."""

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if url.path == "/cat.png":
            self.reply(PIXEL, "image/png")
        elif url.path == "/result":
            self.reply(f"<title>Result</title><p>Hello {query.get('name', ['nobody'])[0]}</p>")
        elif url.path == "/set-cookie":
            self.reply("<title>Set</title><p>set</p>", cookie=f"who={query['who'][0]}")
        elif url.path == "/show-cookie":
            self.reply(f"<title>Cookie</title><p>cookie: {self.headers.get('Cookie', 'none')}</p>")
        elif url.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", METADATA)
            self.end_headers()
        elif url.path in PAGES:
            self.reply(PAGES[url.path])
        else:
            self.send_error(404)

    def reply(self, body: str | bytes, content_type: str = "text/html", cookie: str | None = None) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if cookie:
            self.send_header("Set-Cookie", cookie)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), SiteHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """The module's event loop: the browser launched on it serves every test, and closes at the end."""
    reason = browser.unavailable_reason()
    if reason:
        pytest.skip(f"browser tools unavailable: {reason}")
    loop = asyncio.new_event_loop()
    yield loop
    loop.run_until_complete(browser.close_browser())
    loop.close()


@pytest.fixture(autouse=True)
def allow_private(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test site is on loopback; tests about refusing it remove the variable again."""
    monkeypatch.setenv("WEB_ALLOW_PRIVATE", "1")


class Session:
    """One agent session's view of the browser tools: its own ToolContext, called through the registry."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.ctx = ToolContext(env=None, settings=EnvironmentSettings(work_root=Path("."), run_label="test"))

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return self.loop.run_until_complete(coroutine)

    def call(self, tool: str, **args: object) -> dict:
        return self.run(model_tools.dispatch(f"browser_{tool}", args, self.ctx))

    def fails(self, tool: str, **args: object) -> str:
        with pytest.raises(ToolError) as failure:
            self.call(tool, **args)
        return str(failure.value)

    def end(self) -> None:
        """What the session does when it ends: run the tools' cleanups."""
        for cleanup in reversed(self.ctx.cleanups):
            self.run(cleanup())


@pytest.fixture
def session(loop: asyncio.AbstractEventLoop) -> Iterator[Session]:
    opened = Session(loop)
    yield opened
    opened.end()


def ref(view: dict, text: str) -> str:
    """The ref of the snapshot line that contains ``text``."""
    line = next(line for line in view["snapshot"].splitlines() if text in line)
    return re.search(r"\[ref=(\w+)\]", line).group(1)


# --- pages, links, forms -------------------------------------------------------------------------

def test_navigate_follow_a_link_fill_a_form_submit_and_go_back(session: Session, site: str) -> None:
    home = session.call("navigate", url=site + "/")
    assert (home["status"], home["url"], home["title"]) == (200, site + "/", "Home")
    assert 'heading "Welcome"' in home["snapshot"]

    form = session.call("click", ref=ref(home, 'link "Go to form"'))
    assert form["url"] == site + "/form" and form["result"].startswith("clicked")
    typed = session.call("type", ref=ref(form, 'textbox "Name"'), text="Ada")
    assert ": Ada" in typed["snapshot"]
    result = session.call("click", ref=ref(typed, 'button "Send"'))
    assert result["url"] == site + "/result?name=Ada"
    again = session.call("snapshot")
    assert "Hello Ada" in again["snapshot"] and again["title"] == "Result"

    assert session.call("back")["url"] == site + "/form"
    assert session.call("back")["url"] == site + "/"
    assert "no previous page" in session.fails("back")


def test_enter_submits_the_field_just_typed_into(session: Session, site: str) -> None:
    form = session.call("navigate", url=site + "/form")
    session.call("type", ref=f"[ref={ref(form, 'textbox')}]", text="Grace")     # the snapshot's own notation
    assert "Hello Grace" in session.call("press", key="Enter")["snapshot"]
    assert "Unknown key" in session.fails("press", key="NoSuchKey")


def test_get_images_lists_absolute_http_urls_with_alt_text(session: Session, site: str) -> None:
    session.call("navigate", url=site + "/")
    listed = session.call("get_images")
    assert listed["images"] == [{"src": site + "/cat.png", "alt": "A cat"}]    # the data: URL is left out
    assert listed["count"] == 1


def test_long_page_snapshot_is_capped_and_scroll_moves_down(session: Session, site: str) -> None:
    view = session.call("navigate", url=site + "/long")
    assert len(view["snapshot"]) <= browser.SNAPSHOT_CHARS and "snapshot cut" in view["note"]
    scrolled = session.call("scroll", direction="down")
    assert re.match(r"scrolled down to [1-9]\d* of \d+ px", scrolled["result"])
    assert "'direction' must be 'up' or 'down'" in session.fails("scroll", direction="sideways")


def test_unknown_or_malformed_ref_says_to_take_a_new_snapshot(session: Session, site: str) -> None:
    session.call("navigate", url=site + "/")
    started = time.monotonic()
    assert "take a new browser_snapshot" in session.fails("click", ref="e999")
    assert time.monotonic() - started < browser.ACTION_TIMEOUT_S       # not waited out
    assert "element reference" in session.fails("type", ref="the search box", text="x")


def test_actions_before_any_navigation_ask_for_one(session: Session) -> None:
    assert "call browser_navigate first" in session.fails("snapshot")


# --- what the browser may reach ------------------------------------------------------------------

@pytest.mark.parametrize(("url", "message"), [
    ("file:///etc/passwd", "only http and https"),
    ("javascript:alert(1)", "only http and https"),
    (METADATA, "link-local"),
    ("http://[::ffff:169.254.169.254]/", "link-local"),
])
def test_refused_urls(session: Session, url: str, message: str) -> None:
    assert message in session.fails("navigate", url=url)
    assert session.ctx.state == {}       # refused before any browser context was opened


def test_loopback_is_refused_unless_allowed(session: Session, site: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEB_ALLOW_PRIVATE")
    assert "WEB_ALLOW_PRIVATE=1" in session.fails("navigate", url=site + "/")
    assert "WEB_ALLOW_PRIVATE=1" in session.fails("navigate", url="http://10.1.2.3/")


def test_redirect_to_metadata_is_refused(session: Session, site: str) -> None:
    message = session.fails("navigate", url=site + "/redirect")
    assert "refused 169.254.169.254" in message and "link-local" in message


def test_page_cannot_load_from_metadata_address(session: Session, site: str) -> None:
    session.call("navigate", url=site + "/leaky")
    gate = session.ctx.state["browser"].gate
    deadline = time.monotonic() + 5
    while not gate.failures and time.monotonic() < deadline:      # the image may load after the snapshot
        session.run(asyncio.sleep(0.05))
    assert any("refused 169.254.169.254" in failure for failure in gate.failures)


# --- sessions ------------------------------------------------------------------------------------

def test_concurrent_sessions_do_not_share_cookies(loop: asyncio.AbstractEventLoop, site: str) -> None:
    first, second = Session(loop), Session(loop)

    async def both_set_a_cookie() -> None:
        await asyncio.gather(
            model_tools.dispatch("browser_navigate", {"url": site + "/set-cookie?who=first"}, first.ctx),
            model_tools.dispatch("browser_navigate", {"url": site + "/set-cookie?who=second"}, second.ctx))

    try:
        loop.run_until_complete(both_set_a_cookie())
        assert "cookie: who=first" in first.call("navigate", url=site + "/show-cookie")["snapshot"]
        assert "cookie: who=second" in second.call("navigate", url=site + "/show-cookie")["snapshot"]
        fresh = Session(loop)
        assert "cookie: none" in fresh.call("navigate", url=site + "/show-cookie")["snapshot"]
        fresh.end()
    finally:
        first.end()
        second.end()


def test_ending_the_session_closes_its_context(loop: asyncio.AbstractEventLoop, site: str) -> None:
    ended = Session(loop)
    ended.call("navigate", url=site + "/")
    tab = ended.ctx.state["browser"]
    assert tab.context in tab.browser.contexts and len(ended.ctx.cleanups) == 1
    ended.end()
    assert tab.context not in tab.browser.contexts and ended.ctx.state == {}


def test_a_session_carries_on_after_the_browser_died(session: Session, site: str) -> None:
    session.call("navigate", url=site + "/")
    session.run(session.ctx.state["browser"].browser.close())          # as if Chromium had crashed
    assert session.call("navigate", url=site + "/form")["title"] == "Form"


# --- availability and the real CLI ---------------------------------------------------------------

def test_missing_chromium_makes_the_tools_unavailable_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BROWSER_EXECUTABLE", "/nonexistent/chromium")
    reasons = model_tools.unavailable_tools()
    assert {reasons[name] for name in model_tools.TOOLSETS["browser"]} == {browser.unavailable_reason()}
    assert "pip install 'batch-runner[browser]'" in reasons["browser_navigate"]


def chromium_processes(marker: str) -> list[str]:
    found = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "chrom" in line]


def test_cli_run_browses_and_leaves_no_chromium_behind(loop, tmp_path: Path, endpoint, site: str) -> None:
    prompt = f'[[call browser_navigate {{"url": "{site}/"}}]] [[final Done.]] open the home page'
    dataset = write_dataset(tmp_path / "dataset.jsonl", [prompt])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run",
                     "--distribution=browser_only",
                     *endpoint_args(endpoint), env={"WEB_ALLOW_PRIVATE": "1"})
    assert result.returncode == 0, result.stderr
    [row] = batch_rows(tmp_path / "data" / "run")
    assert row["tool_stats"]["browser_navigate"] == {"count": 1, "success": 1, "failure": 0}
    tool_turn = next(turn for turn in row["conversations"] if turn["from"] == "tool")
    assert "Welcome" in tool_turn["value"]
    # Chromium's profile lives under the run's TMPDIR (tmp_path/tmp), which names its processes.
    deadline = time.monotonic() + 10
    while chromium_processes(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert chromium_processes(str(tmp_path)) == []
