"""web_search, web_extract, vision_analyze and image_generate against real HTTP servers on 127.0.0.1.

Search services, image APIs and web pages are stood in for by a small stdlib server per test; the
multimodal model by the scripted endpoint's ``script`` hook. Nothing leaves the machine.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import gzip
import json
import os
import resource
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import openai
import pytest
import trafilatura
from conftest import batch_rows, endpoint_args, run_cli, write_dataset
from scripted_endpoint import ScriptedEndpoint

import model_tools
from batchrun.endpoint import MAX_REPLY_BYTES
from batchrun.environments.base import EnvironmentSettings
from batchrun.environments.local import LocalEnvironment
from batchrun.install_hint import install_hint
from batchrun.tools import ModelAccess, ToolContext, ToolError, clients, configuration, extract
from batchrun.tools.address_policy import address_refusal, allowed_addresses
from batchrun.tools.clients import MAX_SERVICE_BYTES
from batchrun.tools.extract import MAX_CHARS, MAX_PAGE_BYTES, web_extract
from batchrun.tools.image_gen import image_generate
from batchrun.tools.search import MAX_SNIPPET_CHARS, MAX_TITLE_CHARS, web_search
from batchrun.tools.vision import vision_analyze

TOOL_VARIABLES = ("WEB_SEARCH_BACKEND", "SEARXNG_URL", "BRAVE_SEARCH_API_KEY", "BRAVE_SEARCH_BASE_URL",
                  "TAVILY_API_KEY", "TAVILY_BASE_URL", "WEB_ALLOW_PRIVATE", "WEB_ALLOW_LINK_LOCAL",
                  "VISION_MODEL", "VISION_BASE_URL", "VISION_API_KEY", "IMAGE_GEN_PROVIDER",
                  "IMAGE_GEN_BASE_URL", "IMAGE_GEN_API_KEY", "IMAGE_GEN_MODEL", "FAL_KEY", "FAL_BASE_URL",
                  "FAL_IMAGE_MODEL")
RUN_KEY = "run-key-0123456789"
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJ"
                       "RU5ErkJggg==")     # a 1x1 PNG

ARTICLE = """<!doctype html><html><head><title>Cats guide</title></head><body>
<nav><a href="/">Home</a> | <a href="/about">About us</a> | <a href="/shop">Shop</a></nav>
<header><div class="menu">Menu · Sign in · Subscribe</div></header>
<main><article><h1>All about cats</h1>
<p>Cats are small carnivorous mammals that have lived alongside humans for thousands of years. They are
valued for companionship and for their ability to hunt vermin.</p>
<h2>Care</h2>
<p>A healthy cat needs fresh water, a balanced diet and regular visits to a veterinarian. Indoor cats
live longer on average than outdoor cats.</p>
<ul><li>Feed twice a day</li><li>Brush weekly</li></ul>
</article></main>
<footer>Copyright 2024 Example Corp. All rights reserved. Privacy policy. Cookie settings.</footer>
</body></html>"""


# --- a local web server ---------------------------------------------------------------------------

@dataclass
class Reply:
    status: int = 200
    body: bytes | str | dict | list = b""
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "text/html; charset=utf-8"
    send_length: bool = True            # False: no Content-Length, the body ends when the connection does


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]            # names in lower case
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


Route = Reply | Callable[[Request], Reply]


class LocalSite:
    """A stdlib HTTP server on 127.0.0.1 answering each path from ``routes``; records every request."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.requests: list[Request] = []
        site = self

        class Handler(BaseHTTPRequestHandler):
            disable_nagle_algorithm = True

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._answer()

            def do_POST(self) -> None:
                self._answer()

            def _answer(self) -> None:
                parts = urlsplit(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {name.lower(): value for name, value in self.headers.items()}
                request = Request(self.command, parts.path, parse_qs(parts.query), headers, body)
                site.requests.append(request)
                route = site.routes.get(parts.path, Reply(404, "not found", content_type="text/plain"))
                reply = route(request) if callable(route) else route
                data = reply.body
                if isinstance(data, (dict, list)):
                    data = json.dumps(data)
                if isinstance(data, str):
                    data = data.encode()
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.content_type)
                if reply.send_length:
                    self.send_header("Content-Length", str(len(data)))
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):   # the client stopped reading: expected
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def json_reply(body: dict, status: int = 200) -> Reply:
    return Reply(status, body, content_type="application/json")


@pytest.fixture
def site():
    server = LocalSite()
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()


@pytest.fixture(autouse=True)
def clean_tool_variables(monkeypatch):
    """Each test configures the tools itself, whatever the developer's shell has set."""
    for name in TOOL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def allow_private(monkeypatch):
    monkeypatch.setenv("WEB_ALLOW_PRIVATE", "1")


@pytest.fixture
def workspace(tmp_path):
    env = LocalEnvironment(EnvironmentSettings(work_root=tmp_path / "work", run_label="test"), prompt_index=0)
    asyncio.run(env.start())
    yield env
    asyncio.run(env.close())


def call(handler: Callable[[dict, ToolContext], Awaitable[dict]], args: dict, *,
         env: LocalEnvironment | None = None, base_url: str | None = None) -> dict:
    """Run one tool call the way a session does, with the run's endpoint at ``base_url``."""
    async def run() -> dict:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=RUN_KEY) if base_url else None
        model = ModelAccess(base_url, RUN_KEY, "scripted-model", client) if base_url else None
        settings = env.settings if env else EnvironmentSettings(work_root=Path("/nonexistent"), run_label="test")
        ctx = ToolContext(env=env, settings=settings, model=model)
        try:
            return await handler(args, ctx)
        finally:
            for cleanup in ctx.cleanups:
                await cleanup()
            if client is not None:
                await client.close()
    return asyncio.run(run())


# --- web_search -----------------------------------------------------------------------------------

def test_searxng_results_are_mapped(site, monkeypatch):
    site.routes["/searx/search"] = json_reply({"results": [
        {"title": "First <b>hit</b>", "url": "https://one.example/", "content": "Snippet &amp; more", "engine": "x"},
        {"title": "Second", "url": "https://two.example/", "content": "Two"},
        {"title": "No URL", "content": "dropped"},
        {"title": "Third", "url": "https://three.example/", "content": "Three"}]})
    monkeypatch.setenv("SEARXNG_URL", site.url("/searx/"))
    result = call(web_search, {"query": " cats ", "max_results": 2})
    assert result == {"results": [
        {"title": "First hit", "url": "https://one.example/", "snippet": "Snippet & more"},
        {"title": "Second", "url": "https://two.example/", "snippet": "Two"}]}
    [request] = site.requests
    assert request.query == {"q": ["cats"], "format": ["json"]}


def test_search_results_are_cut_to_what_a_result_needs(site, monkeypatch):
    # A service's answer may be 16 MiB: one result of it must not become a tool result of that size.
    site.routes["/searx/search"] = json_reply({"results": [
        {"title": "T" * 100_000, "url": "https://one.example/", "content": "S" * 100_000},
        {"title": "Long URL", "url": "https://two.example/" + "a" * 100_000, "content": "dropped"}]})
    monkeypatch.setenv("SEARXNG_URL", site.url("/searx/"))
    [result] = call(web_search, {"query": "cats"})["results"]
    assert len(result["title"]) <= MAX_TITLE_CHARS + 1
    assert len(result["snippet"]) <= MAX_SNIPPET_CHARS + 1
    assert result["title"].endswith("…") and result["snippet"].endswith("…")


def test_searxng_without_json_format_explains_the_setting(site, monkeypatch):
    site.routes["/search"] = Reply(403, "Forbidden", content_type="text/plain")
    monkeypatch.setenv("SEARXNG_URL", site.url())
    with pytest.raises(ToolError, match=r"HTTP 403 .*search\.formats"):
        call(web_search, {"query": "cats"})


def brave_route(request: Request) -> Reply:
    if request.headers.get("x-subscription-token") != "brave-key-123456":
        return json_reply({"error": {"detail": "invalid token"}}, 401)
    return json_reply({"type": "search", "web": {"results": [
        {"title": "Brave <strong>one</strong>", "url": "https://b1.example/",
         "description": "About <strong>cats</strong>"}]}})


def test_brave_search_sends_the_key_header(site, monkeypatch):
    site.routes["/res/v1/web/search"] = brave_route
    monkeypatch.setenv("BRAVE_SEARCH_API_KEY", "brave-key-123456")
    monkeypatch.setenv("BRAVE_SEARCH_BASE_URL", site.url("/res/v1"))
    assert call(web_search, {"query": "cats", "max_results": 3}) == {"results": [
        {"title": "Brave one", "url": "https://b1.example/", "snippet": "About cats"}]}
    assert site.requests[0].query == {"q": ["cats"], "count": ["3"]}

    monkeypatch.setenv("BRAVE_SEARCH_API_KEY", "wrong-key-123456")
    with pytest.raises(ToolError, match="brave search failed: HTTP 401"):
        call(web_search, {"query": "cats"})


def tavily_route(request: Request) -> Reply:
    if request.headers.get("authorization") != "Bearer tvly-key-123456":
        return json_reply({"detail": {"error": "Unauthorized"}}, 401)
    body = request.json()
    return json_reply({"query": body["query"], "results": [
        {"title": f"Result {i}", "url": f"https://t{i}.example/", "content": f"Content {i}", "score": 0.9}
        for i in range(body["max_results"])]})


def test_tavily_search_posts_the_query_with_a_bearer_key(site, monkeypatch):
    site.routes["/search"] = tavily_route
    monkeypatch.setenv("TAVILY_API_KEY", "tvly-key-123456")
    monkeypatch.setenv("TAVILY_BASE_URL", site.url())
    result = call(web_search, {"query": "cats", "max_results": 2})
    assert result["results"] == [{"title": "Result 0", "url": "https://t0.example/", "snippet": "Content 0"},
                                 {"title": "Result 1", "url": "https://t1.example/", "snippet": "Content 1"}]
    assert site.requests[0].json() == {"query": "cats", "max_results": 2}


def test_backend_choice_follows_the_documented_order_unless_one_is_named(site, monkeypatch):
    monkeypatch.setenv("SEARXNG_URL", "http://127.0.0.1:9/")
    monkeypatch.setenv("TAVILY_API_KEY", "tvly-key-123456")
    assert configuration.search_backend().name == "searxng"
    monkeypatch.setenv("WEB_SEARCH_BACKEND", "Tavily")
    assert configuration.search_backend().name == "tavily"
    monkeypatch.setenv("WEB_SEARCH_BACKEND", "brave")
    assert model_tools.unavailable_tools()["web_search"] == "WEB_SEARCH_BACKEND=brave needs BRAVE_SEARCH_API_KEY"
    monkeypatch.setenv("WEB_SEARCH_BACKEND", "google")
    assert "is not one of searxng, brave, tavily, ddgs" in model_tools.unavailable_tools()["web_search"]


# Each was offered to the model, and then every call of the tool failed (InvalidURL, UnsupportedProtocol).
@pytest.mark.parametrize(("tool", "settings"), [
    ("web_search", {"SEARXNG_URL": "searx.local:8080"}),
    ("web_search", {"SEARXNG_URL": "http://[::1"}),
    ("web_search", {"TAVILY_API_KEY": "tvly-key-123456", "TAVILY_BASE_URL": "http://127.0.0.1:99999"}),
    ("web_search", {"BRAVE_SEARCH_API_KEY": "brave-key", "BRAVE_SEARCH_BASE_URL": "ftp://brave.local"}),
    ("image_generate", {"IMAGE_GEN_BASE_URL": "http://images.local\n/v1"}),
    ("image_generate", {"FAL_KEY": "fal-key", "FAL_BASE_URL": "fal.run"}),
    ("vision_analyze", {"VISION_BASE_URL": "vision.local/v1"})])
def test_a_service_url_no_http_client_can_use_leaves_its_tool_unavailable_saying_which(monkeypatch, tool, settings):
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    url_variable = next(name for name in settings if name.endswith("URL"))
    assert model_tools.unavailable_tools()[tool] == f"{url_variable} is not an http(s) URL such as http://localhost:8080"


def test_a_search_service_answering_more_than_any_results_page_is_a_tool_error(site, monkeypatch):
    site.routes["/search"] = Reply(body=b"[" + b"0," * MAX_SERVICE_BYTES + b"0]", content_type="application/json",
                                   send_length=False)
    monkeypatch.setenv("SEARXNG_URL", site.url())
    with pytest.raises(ToolError, match=f"searxng search failed: the response is larger than "
                                        f"{MAX_SERVICE_BYTES // 2**20} MiB"):
        call(web_search, {"query": "cats"})


def test_no_search_backend_makes_web_search_unavailable(monkeypatch):
    monkeypatch.setattr(configuration, "installed", lambda module: module != "ddgs")
    reason = model_tools.unavailable_tools()["web_search"]
    assert "SEARXNG_URL" in reason and "BRAVE_SEARCH_API_KEY" in reason and "TAVILY_API_KEY" in reason
    assert "web_extract" not in model_tools.unavailable_tools()     # needs no configuration
    with pytest.raises(ToolError, match="not configured"):
        call(web_search, {"query": "cats"})


def test_missing_web_extra_names_the_install_command(monkeypatch):
    monkeypatch.setattr(configuration, "installed", lambda module: module != "trafilatura")
    assert model_tools.unavailable_tools()["web_extract"] == install_hint("web")


def test_search_refuses_bad_arguments(monkeypatch):
    monkeypatch.setenv("SEARXNG_URL", "http://127.0.0.1:9")
    for args in ({}, {"query": "  "}, {"query": "x", "max_results": 0}, {"query": "x", "max_results": "5"}):
        with pytest.raises(ToolError):
            call(web_search, args)


def test_unreachable_search_service_is_a_tool_error(monkeypatch):
    with socket.socket() as sock:          # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("SEARXNG_URL", f"http://127.0.0.1:{port}")
    with pytest.raises(ToolError, match="searxng search failed: ConnectError"):
        call(web_search, {"query": "cats"})


# --- web_extract ----------------------------------------------------------------------------------

def test_extract_returns_the_main_text_as_markdown(site, allow_private):
    site.routes["/cats"] = Reply(body=ARTICLE)
    [page] = call(web_extract, {"urls": [site.url("/cats")]})["results"]
    assert page["url"] == site.url("/cats") and page["title"] in {"Cats guide", "All about cats"}
    content = page["content"]
    assert content.startswith("# All about cats")
    assert "## Care" in content and "- Feed twice a day" in content
    assert "Cats are small carnivorous mammals" in content
    for boilerplate in ("About us", "Sign in", "Privacy policy", "Copyright"):
        assert boilerplate not in content


def test_extract_returns_other_text_as_it_is_and_refuses_binary(site, allow_private):
    site.routes["/notes.txt"] = Reply(body="line one\nline two — ünïcode\n",
                                      content_type="text/plain; charset=utf-8")
    site.routes["/data.json"] = Reply(body='{"a": 1}', content_type="application/json")
    site.routes["/latin1.txt"] = Reply(body="café".encode("latin-1"), content_type="text/plain; charset=iso-8859-1")
    site.routes["/image.png"] = Reply(body=PNG, content_type="image/png")
    results = call(web_extract, {"urls": [site.url(p) for p in ("/notes.txt", "/data.json", "/latin1.txt",
                                                                "/image.png")]})["results"]
    assert [r.get("content") for r in results[:3]] == ["line one\nline two — ünïcode", '{"a": 1}', "café"]
    assert "image/png" in results[3]["error"]


@pytest.mark.parametrize("charset", ["rot13", "hex", "base64", "zlib", "no-such-charset", "idna", "punycode",
                                     "undefined", "unicode_escape"])
def test_a_page_naming_a_charset_that_is_no_text_encoding_is_read_as_utf8(site, allow_private, charset):
    # Python knows these names, as codecs from bytes to bytes or str to str: decoding a page with one
    # raised out of the tool, and the other pages of the call were lost with it.
    site.routes["/odd.txt"] = Reply(body=b"plain text", content_type=f"text/plain; charset={charset}")
    site.routes["/cats"] = Reply(body=ARTICLE)
    results = call(web_extract, {"urls": [site.url("/odd.txt"), site.url("/cats")]})["results"]
    assert results[0]["content"] == "plain text" and "All about cats" in results[1]["content"]


def test_extract_cuts_a_page_title_as_search_results_are_cut(site, allow_private):
    # The content is cut to MAX_CHARS; a title of megabytes (one <title> element) came back whole.
    site.routes["/titled"] = Reply(body=f"<html><head><title>{'T ' * 1_000_000}</title></head>"
                                        f"<body><p>{'Some text. ' * 50}</p></body></html>")
    [page] = call(web_extract, {"urls": [site.url("/titled")]})["results"]
    assert len(page["title"]) <= MAX_TITLE_CHARS + 1 and page["title"].endswith("…")


def test_extract_reports_each_failing_url_and_fails_only_when_all_fail(site, allow_private):
    site.routes["/cats"] = Reply(body=ARTICLE)
    good, missing = site.url("/cats"), site.url("/missing")
    results = call(web_extract, {"urls": [good, missing]})["results"]
    assert "All about cats" in results[0]["content"]
    assert results[1] == {"url": missing, "error": "HTTP 404 Not Found"}
    with pytest.raises(ToolError, match=r"/missing: HTTP 404.*/gone: HTTP 404"):
        call(web_extract, {"urls": [missing, site.url("/gone")]})


@pytest.mark.parametrize("url, reason", [
    ("file:///etc/passwd", "only http and https"),
    ("ftp://ftp.example.org/file.txt", "only http and https"),
    ("javascript:alert(1)", "only http and https"),
    ("http://169.254.169.254/latest/meta-data/", "link-local or cloud-metadata"),
    ("http://[::ffff:169.254.169.254]/latest/meta-data/", "link-local or cloud-metadata"),
    ("http://[fd00:ec2::254]/latest/meta-data/", "link-local or cloud-metadata"),
    ("http://[fd00:c1::a9fe:a9fe]/opc/v2/instance/", "link-local or cloud-metadata"),
    ("http://192.0.0.192/latest/", "link-local or cloud-metadata"),
    ("http://[fe80::1]/", "link-local or cloud-metadata"),
    ("http://metadata.google.internal/computeMetadata/v1/", "cloud-metadata host"),
    ("http://metadata/computeMetadata/v1/", "cloud-metadata host"),             # GCP's short name
    ("http://instance-data/latest/meta-data/", "cloud-metadata host"),          # EC2's
    ("http://instance-data.ec2.internal/latest/meta-data/", "cloud-metadata host"),
    ("http://instance-data.us-east-1.compute.internal/latest/meta-data/", "cloud-metadata host"),
    ("http://168.63.129.16/machine?comp=goalstate", "link-local or cloud-metadata"),
    ("http://[64:ff9b::a9fe:a9fe]/latest/meta-data/", "embeds 169.254.169.254, which is a link-local"),
])
def test_extract_refuses_other_schemes_and_metadata_addresses(url, reason, allow_private):
    with pytest.raises(ToolError, match=reason):
        call(web_extract, {"urls": [url]})


def test_private_and_loopback_addresses_need_the_allow_variable(site, monkeypatch):
    site.routes["/cats"] = Reply(body=ARTICLE)
    for host in ("127.0.0.1", "localhost"):      # the literal, and a name resolving to it
        with pytest.raises(ToolError, match="private, loopback or reserved address .*WEB_ALLOW_PRIVATE=1"):
            call(web_extract, {"urls": [f"http://{host}:{site.port}/cats"]})
    with pytest.raises(ToolError, match="private"):
        call(web_extract, {"urls": ["http://10.0.0.1/"]})
    assert site.requests == []
    monkeypatch.setenv("WEB_ALLOW_PRIVATE", "1")
    [page] = call(web_extract, {"urls": [f"http://localhost:{site.port}/cats"]})["results"]
    assert "All about cats" in page["content"]


# The address policy itself, for the forms Python's ipaddress flags call global although they reach
# a refused address. Judged by the function only: nothing is sent to any of these addresses.
@pytest.mark.parametrize("address, embedded", [
    ("::127.0.0.1", "127.0.0.1"),                 # IPv4-compatible
    ("::ffff:127.0.0.1", "127.0.0.1"),            # IPv4-mapped
    ("::ffff:0:7f00:1", "127.0.0.1"),             # IPv4-translated
    ("64:ff9b::7f00:1", "127.0.0.1"),             # NAT64
    ("64:ff9b::a00:1", "10.0.0.1"),
    ("2002:7f00:1::", "127.0.0.1"),               # 6to4
    ("2002:c0a8:101::1", "192.168.1.1"),
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", "127.0.0.1"),     # Teredo, the client's address
])
def test_ipv6_forms_of_a_private_ipv4_address_are_judged_by_it(address, embedded, monkeypatch):
    assert address_refusal(address).endswith(f" embeds {embedded}, which is a private, loopback or reserved "
                                             f"address (allowed only with WEB_ALLOW_PRIVATE=1)")
    monkeypatch.setenv("WEB_ALLOW_PRIVATE", "1")
    assert address_refusal(address) is None


@pytest.mark.parametrize("address", ["::169.254.169.254", "::ffff:0:a9fe:a9fe", "64:ff9b::a9fe:a9fe",
                                     "2002:a9fe:a9fe::1"])
def test_ipv6_forms_of_the_metadata_address_need_the_link_local_switch(address, monkeypatch):
    monkeypatch.setenv("WEB_ALLOW_PRIVATE", "1")
    assert "embeds 169.254.169.254, which is a link-local or cloud-metadata" in address_refusal(address)
    monkeypatch.setenv("WEB_ALLOW_LINK_LOCAL", "1")
    assert address_refusal(address) is None


@pytest.mark.parametrize("address", ["::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::1"])
def test_ipv6_forms_of_a_public_ipv4_address_are_allowed(address):
    assert address_refusal(address) is None


@pytest.mark.parametrize("address", ["224.0.0.251", "239.255.255.250", "233.252.0.1", "ff02::1", "ff0e::1",
                                     "::ffff:224.0.0.251", "64:ff9b::e000:fb"])
def test_multicast_addresses_are_refused_whatever_is_allowed(address, monkeypatch):
    monkeypatch.setenv("WEB_ALLOW_PRIVATE", "1")
    monkeypatch.setenv("WEB_ALLOW_LINK_LOCAL", "1")
    assert "a multicast address" in address_refusal(address)


@pytest.mark.parametrize("address", ["fec0::1", "64:ff9b:1::a00:1"])      # site-local, local-use NAT64
def test_addresses_for_local_use_only_need_the_private_switch(address, monkeypatch):
    assert "private, loopback or reserved" in address_refusal(address)
    monkeypatch.setenv("WEB_ALLOW_PRIVATE", "1")
    assert address_refusal(address) is None


def test_azure_wireserver_is_a_cloud_metadata_address(monkeypatch):
    monkeypatch.setenv("WEB_ALLOW_PRIVATE", "1")
    assert address_refusal("168.63.129.16") == ("168.63.129.16 is a link-local or cloud-metadata address "
                                                "(allowed only with WEB_ALLOW_LINK_LOCAL=1)")
    monkeypatch.setenv("WEB_ALLOW_LINK_LOCAL", "1")
    assert address_refusal("168.63.129.16") is None


def test_the_connection_goes_to_the_checked_address(site, allow_private, monkeypatch):
    """A host name is resolved once, checked, and connected to by address; the Host header keeps the name."""
    site.routes["/cats"] = Reply(body=ARTICLE)
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):
        return real("127.0.0.1" if host == "cats.test" else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    [page] = call(web_extract, {"urls": [f"http://cats.test:{site.port}/cats"]})["results"]
    assert "All about cats" in page["content"]
    assert site.requests[0].headers["host"] == f"cats.test:{site.port}"


def self_signed_certificate(directory: Path, host: str) -> tuple[Path, Path]:
    """(certificate, key) files of a certificate valid for ``host`` only."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(hours=1))
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_tls_is_verified_against_the_host_name_while_connecting_by_address(site, allow_private, monkeypatch,
                                                                          tmp_path):
    cert_path, key_path = self_signed_certificate(tmp_path, "cats.test")
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert_path, key_path)
    site.server.socket = server_tls.wrap_socket(site.server.socket, server_side=True)
    site.routes["/cats"] = Reply(body=ARTICLE)
    monkeypatch.setattr(clients, "_tls_context", lambda: ssl.create_default_context(cafile=str(cert_path)))
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo",
                        lambda host, *args, **kwargs: real("127.0.0.1" if host.endswith(".test") else host,
                                                           *args, **kwargs))
    [page] = call(web_extract, {"urls": [f"https://cats.test:{site.port}/cats"]})["results"]
    assert "All about cats" in page["content"]
    with pytest.raises(ToolError, match="certificate verify failed"):     # same address, another name
        call(web_extract, {"urls": [f"https://dogs.test:{site.port}/cats"]})


def test_a_redirect_hop_is_checked_like_the_first_url(site, allow_private):
    site.routes["/cats"] = Reply(body=ARTICLE)
    site.routes["/moved"] = Reply(301, headers={"Location": "/cats"})
    site.routes["/to-metadata"] = Reply(302, headers={"Location": "http://169.254.169.254/latest/meta-data/"})
    site.routes["/to-file"] = Reply(302, headers={"Location": "file:///etc/passwd"})
    moved, metadata, to_file = (site.url(p) for p in ("/moved", "/to-metadata", "/to-file"))
    results = call(web_extract, {"urls": [moved, metadata, to_file]})["results"]
    assert results[0]["final_url"] == site.url("/cats") and "All about cats" in results[0]["content"]
    assert "169.254.169.254 is a link-local or cloud-metadata address" in results[1]["error"]
    assert "only http and https" in results[2]["error"]


def test_a_port_out_of_range_fails_its_own_url_only(site, allow_private):
    # Before, httpx took the port and the connection raised OverflowError inside a task group: the whole
    # call failed with "ExceptionGroup: unhandled errors in a TaskGroup", the other URLs' results lost.
    site.routes["/cats"] = Reply(body=ARTICLE)
    site.routes["/to-bad-port"] = Reply(302, headers={"Location": "http://127.0.0.1:99999/cats"})
    urls = [site.url("/cats"), "http://1.1.1.1:99999/", site.url("/to-bad-port")]
    cats, bad_port, redirected = call(web_extract, {"urls": urls})["results"]
    assert "All about cats" in cats["content"]
    reason = "is not a valid URL: its port is not a number from 1 to 65535"
    assert bad_port["error"] == f"'http://1.1.1.1:99999/' {reason}"
    assert redirected["error"] == f"'http://127.0.0.1:99999/cats' {reason}"


def test_a_punycode_host_that_decodes_to_no_name_fails_its_own_url_as_invalid(allow_private):
    # Before, "IDNAError: A-label must not end with a hyphen", a library's error, as the URL's result.
    with pytest.raises(ToolError, match="'http://xn--localhost-/' is not a valid URL: A-label must not end"):
        call(web_extract, {"urls": ["http://xn--localhost-/"]})


# Python's resolver call raised UnicodeError for a name with an empty label or one over 63 characters:
# the URL's error was "UnicodeError: encoding with 'idna' codec failed", and the browser's gate logged a
# traceback per request.
@pytest.mark.parametrize("host", ["a..example", "a" * 64 + ".example"], ids=["empty-label", "long-label"])
def test_a_host_name_no_resolver_takes_is_one_that_cannot_be_resolved(host, allow_private):
    with pytest.raises(ToolError, match=f"^cannot resolve {host}: not a valid host name"):
        asyncio.run(allowed_addresses(host, 80))


def test_an_unexpected_failure_of_one_url_costs_that_url_only(site, allow_private, monkeypatch):
    # One URL's surprise (a library raising what no one expected of it) is that URL's result, not the call's.
    site.routes["/cats"] = Reply(body=ARTICLE)
    real_fetch = extract.fetch

    async def fetch(client, url, **kwargs):
        if url.endswith("/odd"):
            raise OverflowError("connect(): port must be 0-65535.")
        return await real_fetch(client, url, **kwargs)

    monkeypatch.setattr(extract, "fetch", fetch)
    results = call(web_extract, {"urls": [site.url("/cats"), site.url("/odd")]})["results"]
    assert "All about cats" in results[0]["content"]
    assert results[1] == {"url": site.url("/odd"), "error": "OverflowError: connect(): port must be 0-65535."}


def test_redirects_are_limited(site, allow_private):
    for hop in range(10):
        site.routes[f"/hop{hop}"] = Reply(302, headers={"Location": f"/hop{hop + 1}"})
    site.routes["/hop10"] = Reply(body=ARTICLE)
    with pytest.raises(ToolError, match="more than 5 redirects"):
        call(web_extract, {"urls": [site.url("/hop0")]})
    assert "All about cats" in call(web_extract, {"urls": [site.url("/hop5")]})["results"][0]["content"]


def test_pages_over_the_size_cap_are_refused(site, allow_private):
    big = "<html><body><p>" + "x" * (MAX_PAGE_BYTES + 1) + "</p></body></html>"
    site.routes["/declared"] = Reply(body=big)
    site.routes["/streamed"] = Reply(body=big, send_length=False)
    for path in ("/declared", "/streamed"):      # refused from the header, and while reading
        with pytest.raises(ToolError, match=f"larger than {MAX_PAGE_BYTES:,} bytes"):
            call(web_extract, {"urls": [site.url(path)]})


def test_a_gzipped_page_is_read_and_gzip_is_the_one_coding_asked_for(site, allow_private):
    site.routes["/article"] = Reply(body=gzip.compress(ARTICLE.encode()), headers={"Content-Encoding": "gzip"})
    [result] = call(web_extract, {"urls": [site.url("/article")]})["results"]
    assert "Indoor cats live longer" in result["content"]
    assert site.requests[0].headers["accept-encoding"] == "gzip"


def test_a_page_that_inflates_past_the_size_cap_is_refused(site, allow_private):
    bomb = gzip.compress(b"<html><body><p>" + b"x" * (4 * MAX_PAGE_BYTES) + b"</p></body></html>", 9)
    site.routes["/bomb"] = Reply(body=bomb, headers={"Content-Encoding": "gzip"})
    with pytest.raises(ToolError, match=f"larger than {MAX_PAGE_BYTES:,} bytes"):
        call(web_extract, {"urls": [site.url("/bomb")]})


def test_a_gzip_body_that_inflates_to_nothing_is_refused_past_twice_the_size_cap(site, allow_private):
    # Empty gzip members without end: before, read (and inflated, a core busy) until the fetch's time limit.
    empty_member = gzip.compress(b"")
    body = gzip.compress(b"<p>short</p>") + empty_member * (2 * MAX_PAGE_BYTES // len(empty_member) + 1)
    site.routes["/nothing"] = Reply(body=body, headers={"Content-Encoding": "gzip"}, send_length=False)
    with pytest.raises(ToolError, match=f"larger than {MAX_PAGE_BYTES:,} bytes"):
        call(web_extract, {"urls": [site.url("/nothing")]})


def test_a_page_in_a_coding_that_was_not_asked_for_is_refused(site, allow_private):
    # A coding the client cannot inflate within the cap (brotli, zstd) is refused, whether or not the
    # library that would inflate it without a bound is installed.
    site.routes["/br"] = Reply(body=ARTICLE, headers={"Content-Encoding": "br"})
    with pytest.raises(ToolError, match="encoded as 'br', which was not asked for"):
        call(web_extract, {"urls": [site.url("/br")]})


def test_long_pages_are_cut_with_a_note(site, allow_private):
    paragraphs = "".join(f"<p>Paragraph {i} about the long history of domestic cats and their care.</p>"
                         for i in range(600))
    site.routes["/long"] = Reply(body=f"<html><body><article><h1>Long</h1>{paragraphs}</article></body></html>")
    content = call(web_extract, {"urls": [site.url("/long")]})["results"][0]["content"]
    assert len(content) < MAX_CHARS + 200
    assert content.endswith(f"web_extract returns the first {MAX_CHARS}]")


def test_a_page_too_costly_to_parse_fails_alone_and_costs_the_worker_nothing(site, allow_private):
    # The report's page: 4.8 MB (under the page limit) of 600,000 <p> elements. Parsed in a thread of the
    # worker it took about 1 GB and 37 s of CPU (five of them took the worker to 3.8 GB), and went on
    # after the call had given up. Now a child process parses it, held to PARSE_MEMORY_MB.
    site.routes["/cats"] = Reply(body=ARTICLE)
    site.routes["/heavy"] = Reply(body=b"<html><body>" + b"<p>word " * 600_000 + b"</body></html>")
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results = call(web_extract, {"urls": [site.url("/heavy"), site.url("/cats")]})["results"]
    assert "error" in results[0]
    assert results[0]["error"].startswith(f"parsing the page needs more than {extract.PARSE_MEMORY_MB} MB")
    assert "All about cats" in results[1]["content"]
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert grown_mb < 100      # the page and its copies in the HTTP client; the parse's memory was the child's


def test_a_parse_that_does_not_end_is_stopped_and_its_process_ended(site, allow_private, monkeypatch, tmp_path):
    # A parse that never ends (trafilatura made to hang here) fails its page once PARSE_SECONDS have passed,
    # and nothing of it goes on: before, the parse thread ran on after the call had given up on it.
    site.routes["/cats"] = Reply(body=ARTICLE)
    site.routes["/endless"] = Reply(body=ARTICLE)
    real_extract = trafilatura.extract
    pid_file = tmp_path / "parser.pid"

    def extract_forever(body, url=None, **kwargs):
        if url and url.endswith("/endless"):
            pid_file.write_text(str(os.getpid()))
            time.sleep(3600)
        return real_extract(body, url=url, **kwargs)

    monkeypatch.setattr(trafilatura, "extract", extract_forever)
    monkeypatch.setattr(extract, "PARSE_SECONDS", 3.0)       # /cats's parse, in a new process, must fit
    results = call(web_extract, {"urls": [site.url("/endless"), site.url("/cats")]})["results"]
    assert results[0]["error"] == "parsing the page took longer than 3s, the most web_extract gives one page"
    assert "All about cats" in results[1]["content"]
    parser = int(pid_file.read_text())
    assert parser != os.getpid()
    with pytest.raises(ProcessLookupError):     # killed, and reaped
        os.kill(parser, 0)


def test_a_worker_parses_one_page_at_a_time(site, allow_private, monkeypatch, tmp_path):
    # Each parse may take PARSE_MEMORY_MB: a worker holds one such process, not one per URL of each call.
    busy = tmp_path / "parsing"
    real_extract = trafilatura.extract

    def extract_alone(body, **kwargs):
        busy.touch(exist_ok=False)      # FileExistsError, the page's failure, while another parse is on
        time.sleep(0.2)                 # long enough for an overlap to show
        busy.unlink()
        return real_extract(body, **kwargs)

    site.routes["/cats"] = Reply(body=ARTICLE)
    monkeypatch.setattr(trafilatura, "extract", extract_alone)
    results = call(web_extract, {"urls": [site.url(f"/cats?{i}") for i in range(5)]})["results"]
    assert all("All about cats" in result.get("content", result) for result in results), results


def test_one_prompts_slow_pages_do_not_hold_the_parse_turn_from_another_prompts(site, allow_private, monkeypatch,
                                                                                tmp_path):
    # Before, the worker's one parse turn went in order of asking: a prompt's five pages that each parse for the
    # longest allowed (20 s) held it for 100 s, and another prompt's page queued behind them failed at its
    # tool's time limit. The turn goes round the prompts now, one page of each at a time.
    started = tmp_path / "slow-parse-started"
    real_extract = trafilatura.extract

    def extract_slowly(body, url=None, **kwargs):
        if url and "/slow" in url:
            started.touch()
            time.sleep(0.5)
        return real_extract(body, url=url, **kwargs)

    site.routes["/cats"] = Reply(body=ARTICLE)
    site.routes["/slow"] = Reply(body=ARTICLE)
    monkeypatch.setattr(trafilatura, "extract", extract_slowly)
    settings = EnvironmentSettings(work_root=Path("/nonexistent"), run_label="test")

    async def both() -> list[str]:
        finished: list[str] = []

        async def session(name: str, urls: list[str]) -> None:
            await web_extract({"urls": urls}, ToolContext(env=None, settings=settings))
            finished.append(name)

        slow = asyncio.create_task(session("slow", [site.url(f"/slow?{i}") for i in range(5)]))
        while not started.exists():      # the slow prompt's pages are all waiting for the turn, or parsing
            await asyncio.sleep(0.01)
        await asyncio.gather(slow, session("quick", [site.url("/cats")]))
        return finished

    assert asyncio.run(both()) == ["quick", "slow"]


def test_extract_refuses_bad_arguments():
    six = [f"http://site{i}.example/" for i in range(6)]
    for args in ({}, {"urls": []}, {"urls": [1]}, {"urls": six}):
        with pytest.raises(ToolError):
            call(web_extract, args)


# --- vision_analyze -------------------------------------------------------------------------------

def completion(text: str) -> dict:
    return {"id": "chatcmpl-vision", "object": "chat.completion", "created": 0, "model": "scripted-model",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}}


def authorization(headers: dict[str, str]) -> str | None:
    return next((value for name, value in headers.items() if name.lower() == "authorization"), None)


def image_part(body: dict) -> tuple[str, str]:
    """(question, image URL) of a vision request body."""
    [message] = body["messages"]
    text, image = message["content"]
    return text["text"], image["image_url"]["url"]


def test_vision_sends_a_file_from_the_environment_as_a_data_url(endpoint, workspace):
    (workspace.workdir / "shots").mkdir()
    (workspace.workdir / "shots" / "pixel.png").write_bytes(PNG)
    endpoint.script = lambda body: (200, completion("A single red pixel."), {})
    result = call(vision_analyze, {"image": "shots/pixel.png", "question": "What colour?"}, env=workspace,
                  base_url=endpoint.base_url)
    assert result == {"answer": "A single red pixel."}
    [body] = endpoint.requests
    question, url = image_part(body)
    assert question == "What colour?" and body["model"] == "scripted-model"
    assert url == "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert authorization(endpoint.request_headers[0]) == f"Bearer {RUN_KEY}"


def test_vision_passes_an_image_url_on_and_uses_the_configured_model(endpoint, monkeypatch):
    monkeypatch.setenv("VISION_MODEL", "vision-model")
    endpoint.script = lambda body: (200, completion("A cat."), {})
    result = call(vision_analyze, {"image": "https://images.example/cat.png", "question": "What animal?"},
                  base_url=endpoint.base_url)
    assert result == {"answer": "A cat."}
    [body] = endpoint.requests
    assert image_part(body)[1] == "https://images.example/cat.png" and body["model"] == "vision-model"


def test_vision_override_endpoint_never_gets_the_run_key(endpoint, monkeypatch):
    with ScriptedEndpoint(api_key="vision-key-123456") as vision_server:
        vision_server.script = lambda body: (200, completion("Seen."), {})
        monkeypatch.setenv("VISION_BASE_URL", vision_server.base_url)
        monkeypatch.setenv("VISION_API_KEY", "vision-key-123456")
        assert call(vision_analyze, {"image": "https://images.example/a.jpg", "question": "?"},
                    base_url=endpoint.base_url) == {"answer": "Seen."}
        assert authorization(vision_server.request_headers[0]) == "Bearer vision-key-123456"
    assert endpoint.requests == []


def test_vision_override_endpoint_without_a_key_of_its_own_never_gets_the_run_key(endpoint, monkeypatch):
    # The client library takes OPENAI_API_KEY from the environment where it is given no key.
    with ScriptedEndpoint() as vision_server:
        vision_server.script = lambda body: (200, completion("Seen."), {})
        monkeypatch.setenv("VISION_BASE_URL", vision_server.base_url)
        for name in ("OPENAI_API_KEY", "OPENROUTER_API_KEY"):
            monkeypatch.setenv(name, RUN_KEY)
        assert call(vision_analyze, {"image": "https://images.example/a.jpg", "question": "?"},
                    base_url=endpoint.base_url) == {"answer": "Seen."}
        assert RUN_KEY not in (authorization(vision_server.request_headers[0]) or "")
    assert endpoint.requests == []


def test_vision_refuses_non_images_metadata_urls_and_other_schemes(endpoint, workspace):
    (workspace.workdir / "notes.txt").write_text("not an image")
    cases = {"notes.txt": "not a PNG, JPEG, GIF or WebP image", "missing.png": "does not exist",
             "http://169.254.169.254/latest/meta-data/": "link-local or cloud-metadata",
             "file:///etc/passwd": "only http and https"}
    for image, message in cases.items():
        with pytest.raises(ToolError, match=message):
            call(vision_analyze, {"image": image, "question": "?"}, env=workspace, base_url=endpoint.base_url)
    assert endpoint.requests == []


@pytest.mark.parametrize("host", ["0xa9fea9fe", "2852039166", "169.254.43518", "0xa9.0xfe.0xa9.0xfe", "0x7f.1", "127.1",
                                  "0x7f.0x.0x.1", "127.0.0x.1", "0x", "0xc0.0xa8.0x.1", "10.0x.0x.1", "08.1",
                                  "1" * 5000])
def test_vision_refuses_an_address_written_in_another_ipv4_notation(endpoint, host):
    # Before, only dotted-decimal addresses were judged: the provider's fetcher (glibc, a WHATWG URL
    # parser) reads 0xa9fea9fe as 169.254.169.254, and the URL was passed on as public. Then a bare '0x',
    # which a WHATWG parser reads as 0 and inet_aton refused, passed as no address: Node fetched
    # 0x7f.0x.0x.1 from 127.0.0.1. A number notation that makes no address is refused too (thousands of
    # digits raised a ValueError out of the tool).
    with pytest.raises(ToolError, match="refused"):
        call(vision_analyze, {"image": f"http://{host}/latest/meta-data/", "question": "?"},
             base_url=endpoint.base_url)
    assert endpoint.requests == []


@pytest.mark.parametrize("host", ["169.254.169.254\\.example.com", "169%2e254%2e169%2e254", "%31%36%39.254.169.254"])
def test_vision_refuses_a_host_that_another_url_parser_reads_as_an_address(endpoint, host):
    # Before, httpx kept these as names: a WHATWG URL parser (browsers, Node) reads the backslash as a
    # slash and decodes the escapes, so the provider fetched 169.254.169.254.
    with pytest.raises(ToolError, match="host name"):
        call(vision_analyze, {"image": f"http://{host}/latest/meta-data/", "question": "?"},
             base_url=endpoint.base_url)
    assert endpoint.requests == []


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST.", "metadata.localhost"])
def test_vision_refuses_a_loopback_host_name(endpoint, host):
    # Before, only addresses were judged: http://localhost/ reaches the provider's own loopback, which
    # web_extract and the browser refuse.
    with pytest.raises(ToolError, match="WEB_ALLOW_PRIVATE=1"):
        call(vision_analyze, {"image": f"http://{host}:8080/admin.png", "question": "?"}, base_url=endpoint.base_url)
    assert endpoint.requests == []


def test_vision_model_errors_are_tool_errors(endpoint):
    endpoint.script = lambda body: (400, {"error": {"message": "this model does not accept images"}}, {})
    with pytest.raises(ToolError, match="does not accept images"):
        call(vision_analyze, {"image": "https://images.example/a.png", "question": "?"}, base_url=endpoint.base_url)


# --- image_generate -------------------------------------------------------------------------------

def images_route(answer: dict) -> Callable[[Request], Reply]:
    def route(request: Request) -> Reply:
        if request.headers.get("authorization") != "Bearer images-key-123456":
            return json_reply({"error": {"message": "bad key", "type": "invalid_request_error"}}, 401)
        return json_reply({"created": 0, "data": [answer]})
    return route


@pytest.fixture
def images_api(site, monkeypatch):
    monkeypatch.setenv("IMAGE_GEN_BASE_URL", site.url("/v1"))
    monkeypatch.setenv("IMAGE_GEN_API_KEY", "images-key-123456")
    monkeypatch.setenv("IMAGE_GEN_MODEL", "image-model")
    return site


def test_image_generate_returns_the_url_the_api_gives(images_api, workspace):
    images_api.routes["/v1/images/generations"] = images_route({"url": "https://cdn.example/cat.png"})
    assert call(image_generate, {"prompt": "a cat"}, env=workspace) == {"url": "https://cdn.example/cat.png"}
    assert images_api.requests[0].json() == {"model": "image-model", "prompt": "a cat", "n": 1}


def test_image_generate_saves_base64_images_in_the_environment(images_api, workspace):
    images_api.routes["/v1/images/generations"] = images_route({"b64_json": base64.b64encode(PNG).decode()})
    result = call(image_generate, {"prompt": "a red pixel"}, env=workspace)
    assert result["path"].startswith("images/") and result["path"].endswith(".png")
    assert (workspace.workdir / result["path"]).read_bytes() == PNG


def test_an_image_endpoint_without_a_key_of_its_own_never_gets_the_run_key(images_api, workspace, monkeypatch):
    # The client library takes OPENAI_API_KEY from the environment where it is given no key.
    monkeypatch.delenv("IMAGE_GEN_API_KEY")
    for name in ("OPENAI_API_KEY", "OPENROUTER_API_KEY"):
        monkeypatch.setenv(name, RUN_KEY)
    images_api.routes["/v1/images/generations"] = lambda request: json_reply(
        {"created": 0, "data": [{"url": "https://cdn.example/cat.png"}]})
    assert call(image_generate, {"prompt": "a cat"}, env=workspace) == {"url": "https://cdn.example/cat.png"}
    assert RUN_KEY not in (images_api.requests[0].headers.get("authorization") or "")


def test_image_generate_refuses_data_that_is_not_an_image(images_api, workspace):
    images_api.routes["/v1/images/generations"] = images_route({"b64_json": base64.b64encode(b"hello").decode()})
    with pytest.raises(ToolError, match="not a PNG"):
        call(image_generate, {"prompt": "x"}, env=workspace)


def test_image_generate_api_errors_are_tool_errors(images_api, workspace, monkeypatch):
    images_api.routes["/v1/images/generations"] = images_route({"url": "https://cdn.example/cat.png"})
    monkeypatch.setenv("IMAGE_GEN_API_KEY", "wrong-key-123456")
    with pytest.raises(ToolError, match="image generation failed"):
        call(image_generate, {"prompt": "x"}, env=workspace)


def test_an_images_api_answering_more_than_any_reply_is_a_tool_error(images_api, workspace):
    images_api.routes["/v1/images/generations"] = Reply(
        body=b'{"data": [{"url": "' + b"x" * MAX_REPLY_BYTES + b'"}]}', content_type="application/json",
        send_length=False)
    with pytest.raises(ToolError, match=f"image generation failed: the reply is larger than "
                                        f"{MAX_REPLY_BYTES // 2**20} MiB"):
        call(image_generate, {"prompt": "a cat"}, env=workspace)


def test_fal_provider_posts_to_the_model_path_with_its_key(site, monkeypatch, workspace):
    def route(request: Request) -> Reply:
        if request.headers.get("authorization") != "Key fal-key-123456":
            return json_reply({"detail": "unauthorized"}, 401)
        return json_reply({"images": [{"url": "https://fal.media/files/cat.png", "width": 1024, "height": 768,
                                       "content_type": "image/png"}], "prompt": request.json()["prompt"]})
    site.routes["/fal-ai/flux/schnell"] = route
    monkeypatch.setenv("FAL_KEY", "fal-key-123456")
    monkeypatch.setenv("FAL_BASE_URL", site.url())
    assert call(image_generate, {"prompt": "a cat"}, env=workspace) == {"url": "https://fal.media/files/cat.png"}
    assert site.requests[0].json() == {"prompt": "a cat"}


def test_image_generate_is_unavailable_until_configured(monkeypatch):
    reason = model_tools.unavailable_tools()["image_generate"]
    assert "IMAGE_GEN_API_KEY" in reason and "IMAGE_GEN_BASE_URL" in reason and "FAL_KEY" in reason
    monkeypatch.setenv("FAL_KEY", "fal-key-123456")
    assert "image_generate" not in model_tools.unavailable_tools()
    monkeypatch.setenv("IMAGE_GEN_PROVIDER", "openai")
    assert model_tools.unavailable_tools()["image_generate"] == \
        "IMAGE_GEN_PROVIDER=openai needs IMAGE_GEN_API_KEY or IMAGE_GEN_BASE_URL"


# --- through the CLI ------------------------------------------------------------------------------

def test_cli_counts_a_successful_web_search(tmp_path, endpoint, site):
    site.routes["/search"] = json_reply({"results": [{"title": "X", "url": "https://x.example/", "content": "x"}]})
    prompt = '[[call web_search {"query": "x"}]] Search for x.'
    dataset = write_dataset(tmp_path / "prompts.jsonl", [prompt])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=1", "--run_name=web",
                     "--distribution=minimal", *endpoint_args(endpoint),
                     env={"SEARXNG_URL": site.url(), "OPENAI_API_KEY": "unused-key-123"})
    assert result.returncode == 0, result.stdout + result.stderr
    [row] = batch_rows(tmp_path / "data" / "web")
    assert row["tool_stats"]["web_search"] == {"count": 1, "success": 1, "failure": 0}
    assert site.requests[0].query == {"q": ["x"], "format": ["json"]}
    tool_turn = next(turn for turn in row["conversations"] if turn["from"] == "tool")
    assert "https://x.example/" in tool_turn["value"]
