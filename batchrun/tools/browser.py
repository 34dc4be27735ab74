"""The browser tools: a real Chromium driven by Playwright, one private tab per session.

Chromium is heavy (about 0.4 GB and 1.5 s to start), so a worker process launches one browser on
first use and shares it among all its sessions; each session gets its own browser context (cookies,
storage, cache) and page, created on its first browser call and closed when the session ends. The
model reads a page as Playwright's AI accessibility snapshot and passes its ``[ref=eN]`` references
back to click and type.

Every connection a session's browser context opens - the model's navigations, but also the page's
images, scripts, frames and redirects - goes through that session's SOCKS5 gate in this process. The
gate resolves the host itself, applies the address policy shared with the web tools
(batchrun.tools.address_policy: ``WEB_ALLOW_PRIVATE``, ``WEB_ALLOW_LINK_LOCAL``), and connects to the
very address it checked, so neither a redirect nor DNS rebinding slips past it. A proxy setting only
covers what Chromium chooses to proxy (WebRTC sent UDP straight to its targets), so where bubblewrap
can make one, Chromium runs in a network namespace of its own that holds nothing but a loopback
interface and the gate's listening socket: no protocol, present or future, has another way out.

There Chromium also runs in a sandbox like the terminal's, since a page is as hostile as a command:
not as root (a root run's Chromium is a user of its own; an ordinary user's has a user namespace
without capabilities), with the system read-only and no file of the host's beyond what Chromium
reads, its profile in a size-capped /tmp of its own, and none of the runner's environment.

A page chooses its title, URLs and texts and may stop answering altogether, so every result is cut
to fixed sizes (saying what was cut), every call that waits on the page is bounded, and a page that
stops answering is closed with its tab rather than left to block the session's later calls.

Playwright is imported lazily: the parent process only asks :func:`unavailable_reason`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import ipaddress
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, TypeVar
from urllib.parse import urlsplit

from batchrun.environments.base import DEFAULT_PATH, scrubbed_environment
from batchrun.environments.limits import MIB
from batchrun.install_hint import install_hint
from batchrun.time_limit import within
from batchrun.tools import ToolContext, ToolError
from batchrun.tools.address_policy import allowed_addresses

if TYPE_CHECKING:
    from playwright.async_api import Browser, BrowserContext, BrowserType, Locator, Page, Playwright

T = TypeVar("T")

NAVIGATION_TIMEOUT_S = 15.0
ACTION_TIMEOUT_S = 5.0        # also what the page gets to answer any other call, and to prove it is alive
LAUNCH_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0
# What one result may hold. Each text is cut to its limit (an AI snapshot of a big page runs to hundreds
# of kilobytes, a script can make a title or an image URL megabytes long), then the whole result, as the
# JSON the model reads, to RESULT_CHARS: images are dropped from the end of the list, then the snapshot
# is cut further.
SNAPSHOT_CHARS = 20_000
TITLE_CHARS = 500
URL_CHARS = 2_000             # the page's URL and each image's
ALT_CHARS = 300
TEXT_CHARS = 1_000            # any other text: a message, a note
RESULT_CHARS = 30_000
NOTES_CHARS = 1_000           # kept free in RESULT_CHARS for the notes on what was cut
MAX_IMAGES = 50
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
# Playwright adds --headless itself; the rest keeps Chromium from phoning home, from speaking QUIC, and
# WebRTC from sending UDP that no proxy carries (each would bypass the gate where Chromium shares the
# host's network).
CHROMIUM_ARGS = ("--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--webrtc-ip-handling-policy=disable_non_proxied_udp", "--force-webrtc-ip-handling-policy")
GATE_PORT = 1080              # in Chromium's own network namespace, where nothing else listens
# Chromium's sandbox keeps its profile (PROFILE) and its pages' shared memory (Playwright passes
# --disable-dev-shm-usage) in a /tmp of its own, in memory: each of /tmp and /dev/shm holds at most this.
SANDBOX_TMP_MB = 1024
PROFILE = "/tmp/profile"
# What of /etc Chromium reads besides what every program does: its policies, the settings Debian's
# launcher sources, and fontconfig's.
_CHROMIUM_ETC = ("chromium", "chromium.d", "fonts")
_RUNNING_AS_ROOT = os.geteuid() == 0
# The first process of Chromium's network namespace, which still sees the host's files: it opens the
# gate's listening socket there, hands it to the worker through a Unix socket (a path, which network
# namespaces do not separate), and becomes Chromium's sandbox, given PROFILE for the profile that
# Playwright made on the host (Chromium never sees that directory). Python itself is the one
# interpreter sure to be there.
_ENTER_NAMESPACE = f"""
import os, socket, sys
gate = socket.create_server(("0.0.0.0", {GATE_PORT}), backlog=socket.SOMAXCONN)
with socket.socket(socket.AF_UNIX) as handover:
    handover.connect(sys.argv[1])
    socket.send_fds(handover, [b"gate"], [gate.fileno()])
command = ["--user-data-dir={PROFILE}" if word.startswith("--user-data-dir=") else word for word in sys.argv[2:]]
os.execv(command[0], command)
"""
# Chromium's singleton socket goes to $TMPDIR/org.chromium.Chromium.XXXXXX/SingletonSocket (45 more
# characters), and a Unix socket path holds at most 107: Chromium aborts at start under a deeper TMPDIR.
TMPDIR_CHARS = 60
INSTALL_HINT = f"{install_hint('browser')} and apt-get install chromium"
_STATE_KEY = "browser"
_REF = re.compile(r"(?:f\d+)?e\d+")
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*:(?!\d)", re.IGNORECASE)    # "localhost:8000" has none


# --- availability -------------------------------------------------------------------------------

def chromium_executable() -> str | None:
    """``BROWSER_EXECUTABLE`` if set, else the first Chromium on PATH (Playwright's own download is
    never used: the runner drives the system browser)."""
    configured = os.environ.get("BROWSER_EXECUTABLE", "").strip()
    if configured:
        return shutil.which(configured)
    return next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)


def unavailable_reason() -> str | None:
    """The one line that makes the browser tools available, or None when they are."""
    if importlib.util.find_spec("playwright") is None or chromium_executable() is None:
        return INSTALL_HINT + " (or set BROWSER_EXECUTABLE)"
    return None


# --- which addresses the browser may reach ------------------------------------------------------

class _Gate:
    """The SOCKS5 server of one browser context: every connection the context makes passes here.

    Chromium reports any proxy failure as ERR_SOCKS_CONNECTION_FAILED, so the gate keeps the reasons
    of its recent failures for the tool to tell the model.
    """

    def __init__(self) -> None:
        self.failures: deque[str] = deque(maxlen=8)
        self._streams: set[asyncio.StreamWriter] = set()

    def close(self) -> None:
        for stream in list(self._streams):     # open tunnels end with their streams
            stream.close()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._streams.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            _, method_count = await reader.readexactly(2)
            await reader.readexactly(method_count)
            writer.write(b"\x05\x00")                                # no authentication
            _, command, _, address_type = await reader.readexactly(4)
            if address_type == 1:
                host = socket.inet_ntop(socket.AF_INET, await reader.readexactly(4))
            elif address_type == 4:
                host = socket.inet_ntop(socket.AF_INET6, await reader.readexactly(16))
            else:
                host = (await reader.readexactly((await reader.readexactly(1))[0])).decode("ascii", "replace")
            port = int.from_bytes(await reader.readexactly(2), "big")
            if command != 1:                                         # only CONNECT
                writer.write(b"\x05\x07\x00\x01" + bytes(6))
                return
            try:
                upstream_reader, upstream = await self._connect(host, port)
            except (TimeoutError, ToolError, OSError) as exc:
                self.failures.append(str(exc) or f"cannot connect to {host}:{port}")
                writer.write(b"\x05\x02\x00\x01" + bytes(6))
                return
            self._streams.add(upstream)
            writer.write(b"\x05\x00\x00\x01" + bytes(6))
            await asyncio.gather(_pump(reader, upstream), _pump(upstream_reader, writer))
        except (asyncio.IncompleteReadError, OSError):
            pass
        finally:
            for stream in (writer, upstream):
                if stream is not None:
                    stream.close()
                    self._streams.discard(stream)

    @staticmethod
    async def _connect(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect to the first reachable checked address of the host."""
        error: Exception = OSError(f"cannot connect to {host}:{port}")
        for address in await allowed_addresses(host, port):
            try:
                return await within(CONNECT_TIMEOUT_S, asyncio.open_connection(address, port))
            except (TimeoutError, OSError) as exc:
                error = OSError(f"cannot connect to {host}:{port}: {exc or 'timed out'}")
        raise error


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction of a tunnel until end of file, then pass the half-close on."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()


class _Gates(Protocol):
    """Where the browser's contexts reach their gates."""

    async def add(self, gate: _Gate) -> str:
        """Start serving ``gate``; returns the proxy URL for its browser context."""

    def remove(self, gate: _Gate) -> None: ...

    def close(self) -> None: ...


class _NamespaceGates:
    """The gates of a Chromium in a network namespace of its own, served here, on the host's network.

    The one socket listening in the namespace (on all its addresses, which are only loopback ones)
    takes every context's connections; each context gets its own loopback address as its proxy, so
    the address a connection arrived at tells whose gate it passes.
    """

    def __init__(self, listener: socket.socket) -> None:
        self._listener = listener
        self._server: asyncio.Server | None = None
        self._gates: dict[str, _Gate] = {}
        self._addresses: dict[_Gate, str] = {}
        self._last = 1

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._route, sock=self._listener)

    async def add(self, gate: _Gate) -> str:
        while True:         # round the 16 million addresses of 127.0.0.0/8, skipping those in use
            self._last = self._last % 0xFFFFFD + 2
            address = str(ipaddress.IPv4Address(0x7F000000 + self._last))
            if address not in self._gates:
                break
        self._gates[address], self._addresses[gate] = gate, address
        return f"socks5://{address}:{GATE_PORT}"

    def remove(self, gate: _Gate) -> None:
        address = self._addresses.pop(gate, None)
        if address is not None:
            del self._gates[address]

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._listener.close()

    async def _route(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        gate = self._gates.get(writer.get_extra_info("sockname")[0])
        if gate is None:                # a context already closed
            writer.close()
            return
        await gate.serve(reader, writer)


class _LoopbackGates:
    """The gates of a Chromium that shares the host's network: each listens on a port of 127.0.0.1."""

    def __init__(self) -> None:
        self._servers: dict[_Gate, asyncio.Server] = {}

    async def add(self, gate: _Gate) -> str:
        server = self._servers[gate] = await asyncio.start_server(gate.serve, "127.0.0.1", 0)
        return f"socks5://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    def remove(self, gate: _Gate) -> None:
        server = self._servers.pop(gate, None)
        if server is not None:
            server.close()

    def close(self) -> None:
        for gate in list(self._servers):
            self.remove(gate)


# --- the process's browser ----------------------------------------------------------------------

_namespace_probes: dict[str, bool] = {}


def _namespace_argv(bwrap: str) -> list[str]:
    """bwrap's options for the network namespace's first process: the host's files as they are, and a
    network of its own."""
    return [bwrap, "--dev-bind", "/", "/", "--unshare-net", "--die-with-parent", "--"]


def _sandbox_argv(bwrap: str, uid: int | None, installation: str | None) -> list[str]:
    """The command prefix that runs a program in Chromium's sandbox, inside the network namespace.

    The sandbox sees the system read-only (/usr, and of /etc what Chromium and its libraries read),
    ``installation`` read-only (the directory of a Chromium outside /usr), its own size-capped /tmp and
    /dev/shm, and nothing else of the host: no home, no run directory, none of the runner's environment.
    In a root run (``uid`` given) it has no user namespace, as the terminal sandbox: it runs as ``uid``,
    a user of its own, on nosuid mounts; otherwise in a user namespace without capabilities.
    """
    from batchrun.environments.bubblewrap.program import as_user
    from batchrun.environments.bubblewrap.root import ETC_ENTRIES, SYSTEM_LINKS

    argv = [bwrap, "--die-with-parent", "--new-session"]
    if uid is None:
        argv += ["--unshare-all", "--share-net", "--cap-drop", "ALL"]
    else:
        argv += ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
                 "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for name in SYSTEM_LINKS:
        host = f"/{name}"
        if os.path.islink(host):
            argv += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            argv += ["--ro-bind", host, host]
    # bwrap makes the parents of mount points private (0700), which a root run's sandbox user could not enter.
    argv += ["--perms", "0755", "--dir", "/etc", "--perms", "0755", "--dir", "/etc/ssl"]
    for name in ETC_ENTRIES + _CHROMIUM_ETC:
        argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    argv += ["--dev", "/dev", "--proc", "/proc"]
    for place in ("/tmp", "/dev/shm"):     # made by bwrap, so open to all, as on a host
        argv += ["--perms", "1777", "--size", str(SANDBOX_TMP_MB * MIB), "--tmpfs", place]
    if installation is not None:            # after /tmp, which would hide one there
        for parent in reversed(Path(installation).parents[:-1]):
            argv += ["--perms", "0755", "--dir", str(parent)]
        argv += ["--ro-bind", installation, installation]
    # Last, as bwrap creates mount points in order: the root, a tmpfs holding them, read-only.
    argv += ["--remount-ro", "/", "--clearenv"]
    for name, value in {**scrubbed_environment(home="/tmp"), "PATH": DEFAULT_PATH}.items():
        argv += ["--setenv", name, value]
    return [*argv, "--", *as_user(uid)]


def _installation(program: str) -> str | None:
    """The directory to show Chromium's sandbox for ``program`` (a resolved path): none for one in /usr."""
    return None if program.startswith("/usr/") else os.path.dirname(program)


async def _isolating_bwrap() -> str | None:
    """The first bwrap (the system's, then the bundled one: the sandbox's own choice) that can make
    Chromium's network namespace and its sandbox here (installed is not enough: a container may forbid
    namespaces); each is tried once per process."""
    from batchrun.environments.bubblewrap.program import bwrap_candidates, sandbox_uid

    for candidate in bwrap_candidates():
        bwrap = candidate.path
        if bwrap not in _namespace_probes:
            uid = sandbox_uid() if _RUNNING_AS_ROOT else None
            _namespace_probes[bwrap] = await _runs(
                *_namespace_argv(bwrap), sys.executable, "-I", "-S", "-c",
                "import os, sys; os.execv(sys.argv[1], sys.argv[1:])", *_sandbox_argv(bwrap, uid, None), "true")
        if _namespace_probes[bwrap]:
            return bwrap
    return None


async def _runs(*argv: str) -> bool:
    """Whether the command starts and exits with status 0 within LAUNCH_TIMEOUT_S."""
    try:
        process = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                       stderr=subprocess.DEVNULL)
    except OSError:
        return False
    try:
        return await within(LAUNCH_TIMEOUT_S, process.wait()) == 0
    except TimeoutError:
        process.kill()
        await process.wait()
        return False


class _LaunchOptions(TypedDict):
    """What both launches (direct and through bwrap) pass to ``BrowserType.launch``."""

    args: list[str]
    env: dict[str, str | float | bool] | None     # Playwright's own type: it takes numbers too
    timeout: float


class _BrowserHost:
    """This process's Chromium, launched on first use and relaunched if it died; bound to one event
    loop, because Playwright's connection is."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        self._playwright: Playwright | None = None
        self._browser: Browser | None = None
        self._gates: _Gates | None = None
        self._directory: str | None = None

    async def browser(self) -> tuple[Browser, _Gates]:
        async with self._lock:
            if self._browser is None or self._gates is None or not self._browser.is_connected():
                await self._stop()
                await self._launch()
            assert self._browser is not None and self._gates is not None
            return self._browser, self._gates

    async def _launch(self) -> None:
        from playwright.async_api import Error, async_playwright

        executable = chromium_executable()
        if executable is None:
            raise ToolError(f"no Chromium found: {INSTALL_HINT}")
        environment: dict[str, str | float | bool] | None = None
        temporary = tempfile.gettempdir()
        if len(temporary) > TMPDIR_CHARS:
            environment, temporary = {**os.environ, "TMPDIR": "/tmp"}, "/tmp"
        options: _LaunchOptions = {"args": list(CHROMIUM_ARGS), "env": environment,
                                   "timeout": LAUNCH_TIMEOUT_S * 1000}
        try:
            self._playwright = await async_playwright().start()
            bwrap = await _isolating_bwrap()
            if bwrap is None:
                self._browser = await self._playwright.chromium.launch(executable_path=executable, **options)
                self._gates = _LoopbackGates()
                return
            self._directory = tempfile.mkdtemp(prefix="batchrun-browser-", dir=temporary)
            self._browser, listener = await _launch_isolated(self._playwright.chromium, bwrap, executable,
                                                             Path(self._directory), options)
            gates = _NamespaceGates(listener)
            self._gates = gates
            await gates.start()
        except Error as exc:
            fatal = re.search(r":FATAL:[^\]]*\] (.*)", str(exc))     # Chromium's own last words, if any
            raise ToolError(f"could not start Chromium ({executable}): "
                            f"{fatal.group(1) if fatal else _first_line(exc)}") from None

    async def close(self) -> None:
        async with self._lock:
            await self._stop()

    async def _stop(self) -> None:
        """Close whatever is left of the browser and its driver (a crashed one fails to close)."""
        if self._browser is not None:
            with contextlib.suppress(Exception):
                await self._browser.close()
        if self._playwright is not None:
            with contextlib.suppress(Exception):
                await self._playwright.stop()
        if self._gates is not None:
            self._gates.close()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
        self._browser = self._playwright = self._gates = self._directory = None


async def _launch_isolated(chromium: BrowserType, bwrap: str, executable: str, directory: Path,
                           options: _LaunchOptions) -> tuple[Browser, socket.socket]:
    """Launch Chromium in its sandbox, in a network namespace of its own; returns it and the socket
    listening for its gates in that namespace.

    Playwright starts a single executable, so a script in ``directory`` wraps Chromium in bwrap.
    """
    from batchrun.environments.bubblewrap.program import sandbox_uid

    handover_path = directory / "handover"
    wrapper = directory / "chromium"
    program = os.path.realpath(executable)
    sandbox = _sandbox_argv(bwrap, sandbox_uid() if _RUNNING_AS_ROOT else None, _installation(program))
    wrapper.write_text("#!/bin/sh\nexec " + shlex.join([*_namespace_argv(bwrap), sys.executable, "-I", "-S", "-c",
                                                        _ENTER_NAMESPACE, str(handover_path), *sandbox, program])
                       + ' "$@"\n')
    wrapper.chmod(0o700)
    with socket.socket(socket.AF_UNIX) as handover:
        handover.bind(str(handover_path))
        handover.listen(1)
        handover.setblocking(False)
        receiving = asyncio.ensure_future(_receive_socket(handover))
        try:
            browser = await chromium.launch(executable_path=str(wrapper), **options)
        except BaseException:
            if receiving.done() and not receiving.cancelled() and receiving.exception() is None:
                receiving.result().close()
            receiving.cancel()
            raise
        try:
            return browser, await within(LAUNCH_TIMEOUT_S, receiving)
        except BaseException:
            await browser.close()
            raise


async def _receive_socket(handover: socket.socket) -> socket.socket:
    """The socket that the namespace's first process sends over its connection to ``handover``."""
    loop = asyncio.get_running_loop()
    connection, _ = await loop.sock_accept(handover)
    with connection:
        arrived = loop.create_future()

        def readable() -> None:
            if not arrived.done():
                arrived.set_result(None)

        loop.add_reader(connection, readable)
        try:
            await arrived
        finally:
            loop.remove_reader(connection)
        _, descriptors, _, _ = socket.recv_fds(connection, 16, 1)
    if not descriptors:
        raise ToolError("Chromium's network namespace handed over no socket for its gates")
    return socket.socket(fileno=descriptors[0])


_host: _BrowserHost | None = None


def _current_host() -> _BrowserHost:
    global _host
    if _host is None or _host.loop is not asyncio.get_running_loop():
        _host = _BrowserHost()   # a browser of an earlier loop died with that loop's driver pipe
    return _host


async def close_browser() -> None:
    """Close this process's browser, if it launched one: the worker's last step after its sessions.

    Without it Chromium still dies with the worker (the Playwright driver closes its browsers when
    its pipe to this process closes); this just makes the end orderly and immediate.
    """
    global _host
    host, _host = _host, None
    if host is not None and host.loop is asyncio.get_running_loop():
        await host.close()


# --- one session's tab --------------------------------------------------------------------------

class _Unresponsive(Exception):
    """The page stopped answering during ``what`` (a script that never yields blocks every later
    call on it, the next navigation included)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


@dataclass
class _Tab:
    """A session's browser context, the page the model is looking at, and the context's gate."""

    browser: Browser
    context: BrowserContext
    page: Page
    gate: _Gate
    gates: _Gates

    def follow(self, page: Page) -> None:
        """A link opened in a new window: the model carries on there, as a person would."""
        self.page = page

    async def close(self) -> None:
        """Close the context, its pages and their renderers (a hung one included)."""
        with contextlib.suppress(Exception):
            await within(ACTION_TIMEOUT_S, self.context.close())
        self.gates.remove(self.gate)
        self.gate.close()

    def element(self, args: dict) -> tuple[Locator, str]:
        """The element the model's ``ref`` names ('e12', also as 'ref=e12' or '[ref=e12]')."""
        ref = _string(args, "ref").strip().removeprefix("[").removesuffix("]").removeprefix("ref=")
        if not _REF.fullmatch(ref):
            raise ToolError(f"'ref' must be an element reference such as 'e12' from the latest snapshot, "
                            f"not {_cut(ref, TEXT_CHARS)!r}")
        return self.page.locator(f"aria-ref={ref}"), ref

    @contextlib.asynccontextmanager
    async def acting(self, what: str) -> AsyncIterator[None]:
        """Turn Playwright's errors during an action into a ToolError the model can act on, and a time-out
        on a page that no longer answers into _Unresponsive."""
        from playwright.async_api import Error
        from playwright.async_api import TimeoutError as PlaywrightTimeout

        self.gate.failures.clear()
        try:
            yield
        except (TimeoutError, PlaywrightTimeout) as exc:
            if not await _responds(self.page):
                raise _Unresponsive(what) from None
            raise ToolError(f"{what} failed: "
                            f"{_first_line(exc) or f'no answer within {ACTION_TIMEOUT_S:g} s'}") from None
        except Error as exc:
            message = _first_line(exc)
            if "ERR_SOCKS_CONNECTION_FAILED" in message and self.gate.failures:
                message = self.gate.failures[-1]
            raise ToolError(f"{what} failed: {message}") from None


async def _responds(page: Page) -> bool:
    """Whether the page's renderer still runs scripts."""
    from playwright.async_api import Error

    try:
        await _answer(page.evaluate("0"))
    except TimeoutError:
        return False
    except Error:           # closed, or between two documents: not stuck
        pass
    return True


async def _tab(ctx: ToolContext) -> _Tab:
    """The session's tab, opened on its first browser call (and again after the browser crashed or
    the tab was discarded)."""
    tab: _Tab | None = ctx.state.get(_STATE_KEY)
    if tab is not None and tab.browser.is_connected():
        if tab.page.is_closed():    # the window it followed was closed: back to the newest one left
            tab.page = tab.context.pages[-1] if tab.context.pages else await tab.context.new_page()
        return tab
    if _STATE_KEY not in ctx.state:
        ctx.cleanups.append(functools.partial(_close_tab, ctx))
    elif tab is not None:
        await tab.close()
    ctx.state[_STATE_KEY] = None
    browser, gates = await _current_host().browser()
    gate = _Gate()
    try:
        context = await browser.new_context(proxy={"server": await gates.add(gate)}, service_workers="block",
                                            accept_downloads=False)
        context.set_default_timeout(ACTION_TIMEOUT_S * 1000)
        context.set_default_navigation_timeout(NAVIGATION_TIMEOUT_S * 1000)
        tab = _Tab(browser=browser, context=context, page=await context.new_page(), gate=gate, gates=gates)
    except BaseException:
        gates.remove(gate)
        gate.close()
        raise
    context.on("page", tab.follow)
    ctx.state[_STATE_KEY] = tab
    return tab


async def _open_tab(ctx: ToolContext) -> _Tab:
    """The session's tab for an action that needs a page already loaded."""
    tab = await _tab(ctx)
    if tab.page.url == "about:blank":
        raise ToolError("no page is open; call browser_navigate first")
    return tab


async def _discard_tab(ctx: ToolContext) -> None:
    """Close the session's tab; its next browser call opens a fresh one."""
    tab: _Tab | None = ctx.state.get(_STATE_KEY)
    ctx.state[_STATE_KEY] = None
    if tab is not None:
        await tab.close()


async def _close_tab(ctx: ToolContext) -> None:
    tab: _Tab | None = ctx.state.pop(_STATE_KEY, None)
    if tab is not None:
        await tab.close()


async def _answer(awaitable: Awaitable[T]) -> T:
    """A call the page's renderer must answer (a script, the title, a key press): Playwright would wait
    for ever on a page whose script never yields."""
    return await within(ACTION_TIMEOUT_S, awaitable)


async def _view(tab: _Tab) -> dict:
    """What the model sees of the page: url, title and the AI snapshot (cut to size by the tool)."""
    from playwright.async_api import Error

    page = tab.page

    async def read() -> tuple[str, str]:
        with contextlib.suppress(Error):
            await page.wait_for_load_state("domcontentloaded", timeout=NAVIGATION_TIMEOUT_S * 1000)
        return await _answer(_tree_and_title(page))

    try:
        tree, title = await read()
    except Error:       # a navigation replaced the document mid-snapshot; a second failure is real
        tree, title = await read()
    return {"url": page.url, "title": title, "snapshot": tree}


async def _tree_and_title(page: Page) -> tuple[str, str]:
    return await page.aria_snapshot(mode="ai", timeout=0), await page.title()


# --- what a result may hold ---------------------------------------------------------------------

_FIELD_CHARS = {"title": TITLE_CHARS, "url": URL_CHARS, "src": URL_CHARS, "alt": ALT_CHARS}


def _capped(result: dict) -> dict:
    """``result`` with every text within its limit and the whole within RESULT_CHARS as JSON, and a
    ``truncated`` list saying what was cut."""
    cut: set[str] = set()

    def text(field: str, value: object) -> object:
        limit = _FIELD_CHARS.get(field, TEXT_CHARS)
        if not isinstance(value, str) or len(value) <= limit:
            return value
        cut.add(field)
        return value[:limit]

    capped: dict[str, Any] = {key: value if key == "snapshot" else text(key, value)
                              for key, value in result.items()}
    if "images" in capped:
        capped["images"] = [{field: text(field, value) for field, value in image.items()}
                            for image in capped["images"]]
    snapshot_chars = len(capped.get("snapshot", ""))
    if snapshot_chars > SNAPSHOT_CHARS:
        capped["snapshot"] = _cut_at_line(capped["snapshot"], SNAPSHOT_CHARS)
    _fit(capped)
    notes = [f"{'image ' * (field in ('src', 'alt'))}{field} cut to {_FIELD_CHARS.get(field, TEXT_CHARS)} "
             f"characters{' where longer' * (field in ('src', 'alt'))}" for field in sorted(cut)]
    if "images" in capped and len(capped["images"]) < capped.get("count", 0):
        notes.append(f"{len(capped['images'])} of {capped['count']} images listed (at most {MAX_IMAGES}, and "
                     f"as many as fit in {RESULT_CHARS} characters)")
    if len(capped.get("snapshot", "")) < snapshot_chars:
        notes.append(f"snapshot cut to {len(capped['snapshot'])} of {snapshot_chars} characters; elements "
                     f"further down the page are not listed")
    if notes:
        capped["truncated"] = notes
    return capped


def _fit(result: dict) -> None:
    """Drop images from the end of the list, then cut the snapshot, until the result (with room for
    the notes) fits RESULT_CHARS: escaped characters make JSON longer than the texts it holds."""
    room = RESULT_CHARS - NOTES_CHARS
    images = result.get("images")
    if images:
        size, kept = _json_chars({**result, "images": []}), 0
        for image in images:
            size += _json_chars(image) + 2          # and the ", " before it
            if size > room:
                break
            kept += 1
        del images[kept:]
    excess = _json_chars(result) - room
    if excess > 0 and result.get("snapshot"):
        result["snapshot"] = _cut_at_line(result["snapshot"], max(0, len(result["snapshot"]) - excess))


def _json_chars(value: object) -> int:
    return len(json.dumps(value, ensure_ascii=False))


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _cut_at_line(text: str, limit: int) -> str:
    """At most ``limit`` characters of ``text``, ending after a whole line where there is one."""
    return text[:text.rfind("\n", 0, limit) + 1 or limit]


Tool = Callable[[dict, ToolContext], Awaitable[dict]]


def _browser_tool(tool: Tool) -> Tool:
    """A tool whose result is cut to size, and which closes the tab of a page that stopped answering
    (the session's next call then opens a fresh one instead of waiting on it again)."""

    @functools.wraps(tool)
    async def run(args: dict, ctx: ToolContext) -> dict:
        try:
            result = await tool(args, ctx)
        except _Unresponsive as stuck:
            await _discard_tab(ctx)
            raise ToolError(f"{stuck.what} failed: the page did not respond (a script that never yields?), so "
                            f"its tab was closed; the next browser call opens a fresh tab, without the old "
                            f"tab's cookies and history: call browser_navigate to go on") from None
        return _capped(result)

    return run


# --- the tools ----------------------------------------------------------------------------------

@_browser_tool
async def navigate(args: dict, ctx: ToolContext) -> dict:
    """Open an http(s) URL (one without a scheme gets https://) and return the page's snapshot."""
    url = _string(args, "url").strip()
    if not _SCHEME.match(url):
        url = "https://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ToolError(f"only http and https URLs can be opened, not {_cut(parts.scheme, TEXT_CHARS)}:")
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ToolError(f"invalid port in {_cut(url, URL_CHARS)!r}") from None
    if not host:
        raise ToolError(f"no host in {_cut(url, URL_CHARS)!r}")
    await allowed_addresses(host, port)      # refuse before the browser is even started
    tab = await _tab(ctx)
    note = {}
    if tab.page.url != "about:blank" and not await _responds(tab.page):
        await _discard_tab(ctx)             # leaving it would wait on it: its renderer must unload it
        tab = await _tab(ctx)
        note["note"] = ("the previous page did not respond, so its tab was closed and this page opened in a "
                        "fresh tab, without the old tab's cookies and history")
    async with tab.acting(f"opening {_cut(url, URL_CHARS)}"):
        response = await tab.page.goto(url, wait_until="domcontentloaded")
        view = await _view(tab)
    return {"status": response.status if response else None, **view, **note}


@_browser_tool
async def snapshot(args: dict, ctx: ToolContext) -> dict:
    """The current page again (after it changed by itself, or to refresh the refs)."""
    tab = await _open_tab(ctx)
    async with tab.acting("snapshot"):
        return await _view(tab)


@_browser_tool
async def click(args: dict, ctx: ToolContext) -> dict:
    """Click an element by ref; a navigation it starts is waited for before the snapshot."""
    tab = await _open_tab(ctx)
    element, ref = tab.element(args)
    async with tab.acting(f"click on {ref}"):
        await _require(element, ref)
        await element.click()
        return {"result": f"clicked {ref}", **await _view(tab)}


@_browser_tool
async def type_text(args: dict, ctx: ToolContext) -> dict:
    """Replace the content of an input or editable element with ``text``."""
    tab = await _open_tab(ctx)
    element, ref = tab.element(args)
    text = _string(args, "text", allow_empty=True)
    async with tab.acting(f"typing into {ref}"):
        await _require(element, ref)
        await element.fill(text)
        return {"result": f"typed into {ref}", **await _view(tab)}


@_browser_tool
async def scroll(args: dict, ctx: ToolContext) -> dict:
    """Scroll the window by most of a screen, so lazily loaded content appears."""
    direction = args.get("direction")
    if direction not in ("up", "down"):
        raise ToolError(f"'direction' must be 'up' or 'down', not {_cut(repr(direction), TEXT_CHARS)}")
    tab = await _open_tab(ctx)
    async with tab.acting(f"scrolling {direction}"):
        position = await _answer(tab.page.evaluate(
            "down => { scrollBy(0, (down ? 0.8 : -0.8) * innerHeight);"
            " return [Math.round(scrollY), document.documentElement.scrollHeight]; }", direction == "down"))
        return {"result": f"scrolled {direction} to {position[0]} of {position[1]} px", **await _view(tab)}


@_browser_tool
async def back(args: dict, ctx: ToolContext) -> dict:
    """Go back one page in this session's history."""
    tab = await _open_tab(ctx)
    async with tab.acting("going back"):
        cdp = await _answer(tab.context.new_cdp_session(tab.page))
        history = await _answer(cdp.send("Page.getNavigationHistory"))
        await _answer(cdp.detach())
        index = history["currentIndex"]
        if index == 0 or history["entries"][index - 1]["url"] == "about:blank":
            raise ToolError("there is no previous page to go back to")
        await tab.page.go_back(wait_until="domcontentloaded")
        return {"result": "went back", **await _view(tab)}


@_browser_tool
async def press(args: dict, ctx: ToolContext) -> dict:
    """Press a key in the focused element (the one last typed into), or the page when none is."""
    key = _string(args, "key").strip()
    tab = await _open_tab(ctx)
    focused = tab.page.locator("*:focus")
    async with tab.acting(f"pressing {_cut(key, TEXT_CHARS)}"):
        if await _answer(focused.count()):
            await focused.first.press(key)      # unlike keyboard.press, waits for a navigation it starts
        else:
            await _answer(tab.page.keyboard.press(key))
        return {"result": f"pressed {key}", **await _view(tab)}


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
    tab = await _open_tab(ctx)
    async with tab.acting("listing images"):
        found = await _answer(tab.page.evaluate(_IMAGES_SCRIPT, [MAX_IMAGES, URL_CHARS, ALT_CHARS]))
    return {"url": tab.page.url, "images": found["images"][:MAX_IMAGES], "count": found["count"]}


# --- helpers ------------------------------------------------------------------------------------

def _string(args: dict, name: str, *, allow_empty: bool = False) -> str:
    value = args.get(name)
    if not isinstance(value, str):
        raise ToolError(f"missing string argument '{name}'")
    if not value.strip() and not allow_empty:
        raise ToolError(f"'{name}' must not be empty")
    return value


async def _require(element: Locator, ref: str) -> None:
    """Fail at once on a ref the page does not have, instead of waiting out the action's time limit."""
    if not await _answer(element.count()):
        raise ToolError(f"no element with ref {ref} on the current page; refs change when the page does, so "
                        f"take a new browser_snapshot and use a ref from it")


def _first_line(exc: BaseException) -> str:
    """Playwright's message without its call log (and without its 'Page.goto: ' prefix), cut to size:
    it may quote what the page made (a thrown error, a long URL)."""
    line = str(exc).strip().split("\n", 1)[0]
    return _cut(re.sub(r"^\w+\.\w+: ", "", line), TEXT_CHARS)
