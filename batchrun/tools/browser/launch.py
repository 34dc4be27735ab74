"""This process's Chromium: launched on first use, in its network namespace and sandbox where bwrap can
make them (else sharing the host's network, behind the WebRTC flags alone), in a control group of its
own where one can be made, relaunched if it died, closed at the worker's end.

Chromium is heavy (about 0.4 GB and 1.5 s to start), so a worker process launches one browser and
shares it among all its sessions; each session's tab (batchrun.tools.browser.tab) is a browser context
of it. Playwright is imported only here and in the tab, on first use.

A page is as hostile as a command (one filled 4 GB of buffers in its renderer), so the browser's whole
process tree is held to a prompt's memory and process limits for each tab open (TabLimits): the wrapper
script that Playwright starts joins the group before it execs anything, so no process of the browser
ever runs outside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from batchrun.environments.base import scrubbed_environment
from batchrun.environments.limits import (
    ENTER_GROUPS,
    MOST_MB,
    MOST_PROCESSES,
    LimitEvents,
    PromptCgroup,
    ResourceLimits,
)
from batchrun.time_limit import within
from batchrun.tools import ToolError
from batchrun.tools.browser.availability import INSTALL_HINT, chromium_executable
from batchrun.tools.browser.caps import first_line
from batchrun.tools.browser.directories import new_browser_directory
from batchrun.tools.browser.gate import GATE_PORT, Gates, LoopbackGates, NamespaceGates
from batchrun.tools.browser.isolation import (
    PROFILE,
    chromium_installation,
    namespace_argv,
    sandbox_argv,
    sandbox_user,
)

if TYPE_CHECKING:
    from playwright.async_api import Browser, BrowserType, Playwright

LAUNCH_TIMEOUT_S = 30.0
# Playwright adds --headless itself; the rest keeps Chromium from phoning home, from speaking QUIC, and
# WebRTC from sending UDP that no proxy carries (each would bypass the gate where Chromium shares the
# host's network).
CHROMIUM_ARGS = ("--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--webrtc-ip-handling-policy=disable_non_proxied_udp", "--force-webrtc-ip-handling-policy")
# Of the flags Playwright adds for its tests, those that take a browser's defences against a page away:
# the IPC flooding protection, without which a page's 100,000 history.pushState calls kept Chromium's
# browser process, and so every session's tab, busy for minutes; and the popup blocker, without which a
# page's 200 window.open calls on load each opened a window, and its navigation failed after 23 s.
PLAYWRIGHT_ARGS_LEFT_OUT = ("--disable-ipc-flooding-protection", "--disable-popup-blocking")
#: The programs of the namespace's first process and of what dies with its parent, as python -c runs them.
_ENTER_NAMESPACE = resources.files(__package__).joinpath("enter_namespace.py").read_text(encoding="utf-8")
_DIE_WITH_PARENT = resources.files(__package__).joinpath("die_with_parent.py").read_text(encoding="utf-8")
_NODE_VARIABLE = "PLAYWRIGHT_NODEJS_PATH"
_namespace_probes: dict[str, bool] = {}


async def isolating_bwrap() -> str | None:
    """The first bwrap (the system's, then the bundled one: the sandbox's own choice) that can make
    Chromium's network namespace and its sandbox here (installed is not enough: a container may forbid
    namespaces); each is tried once per process."""
    from batchrun.environments.bubblewrap.program import bwrap_candidates

    for candidate in bwrap_candidates():
        bwrap = candidate.path
        if bwrap not in _namespace_probes:
            uid = sandbox_user()
            _namespace_probes[bwrap] = await _runs(
                *namespace_argv(bwrap), sys.executable, "-I", "-S", "-c",
                "import os, sys; os.execv(sys.argv[1], sys.argv[1:])", *sandbox_argv(bwrap, uid, None), "true")
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
    ignore_default_args: list[str]


class TabLimits:
    """The limits of the browser's control group: a prompt's for each tab open in it, as the tabs of all
    the prompts a worker runs at once share one browser (a tab takes about 25 processes and threads, the
    browser about 85 of its own: one prompt's 1,024 held about 35 tabs, and the next tab's renderer
    could not start). And which limit, if any, struck when a page's renderer died."""

    def __init__(self, cgroup: PromptCgroup | None, limits: ResourceLimits) -> None:
        self._cgroup = cgroup
        self.limits = limits
        self._tabs = 0
        self._seen = LimitEvents() if cgroup is None else cgroup.events()

    def tab_opening(self) -> None:
        """Before a tab opens: its renderer's processes must fit."""
        self._tabs += 1
        self._resize()

    def tab_closed(self) -> None:
        self._tabs -= 1
        self._resize()

    def _resize(self) -> None:
        if self._cgroup is None:
            return
        tabs = max(1, self._tabs)
        shared = replace(self.limits, memory_mb=min(MOST_MB, self.limits.memory_mb * tabs),
                         processes=min(MOST_PROCESSES, self.limits.processes * tabs))
        with contextlib.suppress(OSError):      # the group of a browser that died, removed meanwhile
            self._cgroup.set_limits(shared)

    def struck(self) -> str | None:
        """What the kernel did to the browser for its limits since the last call, if anything: killed a
        process for memory (counted before the process dies, so before its page's crash is reported),
        or refused a process or thread."""
        if self._cgroup is None:
            return None
        events = self._cgroup.events()
        new, self._seen = events - self._seen, events
        if new.memory:
            return (f"the page used more memory than the limit of {self.limits.memory_mb} MB (TERMINAL_MEMORY_MB) "
                    "and was killed")
        if new.processes:
            return (f"the browser could not start a process or thread: it reached its limit of "
                    f"{self.limits.processes} for each open tab (TERMINAL_MAX_PROCESSES)")
        return None


class _BrowserHost:
    """This process's Chromium, launched on first use and relaunched if it died; bound to one event
    loop, because Playwright's connection is."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        self._playwright: Playwright | None = None
        self._browser: Browser | None = None
        self._gates: Gates | None = None
        self._directory: Path | None = None
        self._directory_lock: int | None = None      # held while the directory is in use (see directories)
        self._cgroup: PromptCgroup | None = None
        self._tab_limits: TabLimits | None = None
        self._driver_exit: int | None = None      # a pidfd of the driver: readable once it has exited

    def serves(self, browser: Browser) -> bool:
        """Whether ``browser`` is this host's and usable: connected, and its driver running. A driver
        that died (killed for memory, say) leaves Playwright's browser connected, and every call on it
        failing, for as long as the worker lived."""
        return browser is self._browser and browser.is_connected() and not self._driver_exited()

    def _driver_exited(self) -> bool:
        if self._driver_exit is None:
            return False
        readable = select.poll()        # not select(): a worker's descriptors may number past 1024
        readable.register(self._driver_exit, select.POLLIN)
        return bool(readable.poll(0))

    async def browser(self, limits: ResourceLimits, run_label: str) -> tuple[Browser, Gates, TabLimits]:
        """The browser, launched (if it is not running) in a control group with ``limits`` under the
        run's groups (``run_label``), so that the run's next start removes a killed worker's."""
        async with self._lock:
            if self._browser is None or self._gates is None or not self.serves(self._browser):
                await self._stop()
                await self._launch(limits, run_label)
            assert self._browser is not None and self._gates is not None and self._tab_limits is not None
            return self._browser, self._gates, self._tab_limits

    async def _launch(self, limits: ResourceLimits, run_label: str) -> None:
        from playwright.async_api import Error

        executable = chromium_executable()
        if executable is None:
            raise ToolError(f"no Chromium found: {INSTALL_HINT}")
        try:
            self._directory, self._directory_lock = new_browser_directory()
        except OSError as exc:
            raise ToolError(f"cannot make the browser's directory: {exc}") from None
        # A page's renderer is the prompt's doing, as a command is: it gets the prompt's limits.
        self._cgroup = PromptCgroup.create(run_label, limits)
        self._tab_limits = TabLimits(self._cgroup, limits)
        groups = [] if self._cgroup is None else self._cgroup.procs_files()
        # A tool's environment, never the runner's (its API key): where no sandbox can be made, Chromium
        # runs on the host with it. TMPDIR is named, as the driver's is the browser's directory (see
        # _start_driver).
        environment: dict[str, str | float | bool] = {**scrubbed_environment(home=str(self._directory)),
                                                      "TMPDIR": str(self._directory.parent)}
        options: _LaunchOptions = {"args": list(CHROMIUM_ARGS), "env": environment,
                                   "timeout": LAUNCH_TIMEOUT_S * 1000,
                                   "ignore_default_args": list(PLAYWRIGHT_ARGS_LEFT_OUT)}
        try:
            self._playwright, self._driver_exit = await _start_driver(self._directory)
            bwrap = await isolating_bwrap()
            if bwrap is None:
                # Chromium on the host makes its singleton directory in TMPDIR: in the browser's, it goes with it.
                environment["TMPDIR"] = str(self._directory)
                unsandboxed = _dying_with_parent(self._directory / "chromium", '"$PPID"', executable, groups)
                self._browser = await self._playwright.chromium.launch(executable_path=unsandboxed, **options)
                self._gates = LoopbackGates()
                return
            self._browser, listener = await _launch_isolated(self._playwright.chromium, bwrap, executable,
                                                             self._directory, groups, options)
            gates = NamespaceGates(listener)
            self._gates = gates
            await gates.start()
        except Error as exc:
            fatal = re.search(r":FATAL:[^\]]*\] (.*)", str(exc))     # Chromium's own last words, if any
            raise ToolError(f"could not start Chromium ({executable}): "
                            f"{fatal.group(1) if fatal else first_line(exc)}") from None

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
        if self._directory_lock is not None:
            os.close(self._directory_lock)
        if self._cgroup is not None:
            await asyncio.to_thread(self._cgroup.destroy)
        if self._driver_exit is not None:
            os.close(self._driver_exit)
        self._browser = self._playwright = self._gates = self._directory = self._cgroup = self._driver_exit = None
        self._directory_lock = None
        self._tab_limits = None


async def _start_driver(directory: Path) -> tuple[Playwright, int | None]:
    """Start Playwright's driver, to be killed by the kernel when this process dies, however it dies;
    returns it and a pidfd of the driver's process (None where the kernel has none).

    The driver ends its browser when its pipe from this process closes, but gracefully: it waited up to
    30 s for a busy browser to close, and the driver, the sandboxes and Chromium outlived the worker
    meanwhile. Killed at once, the driver takes Chromium with it: the sandboxes' bwrap die with their
    parent (--die-with-parent), and a Chromium started without them is started as the driver is.
    Playwright takes the driver's Node.js from PLAYWRIGHT_NODEJS_PATH alone, so a script in
    ``directory`` stands in for it, named there while the driver starts. (The kernel kills it when the
    thread that started it ends: the event loop's, whose end leaves the driver unused anyway.) A driver
    killed leaves its temporary directories (Chromium's profile on the host among them), so it makes
    them in ``directory``: all that a killed worker's browser leaves is that one directory. The script
    writes its process id (the driver's, after the execs) to ``directory``/driver.pid.
    """
    import playwright
    from playwright.async_api import async_playwright

    chosen = os.environ.get(_NODE_VARIABLE)
    node = chosen or str(Path(playwright.__file__).parent / "driver" / "node")
    pid_file = directory / "driver.pid"
    os.environ[_NODE_VARIABLE] = _dying_with_parent(directory / "node", str(os.getpid()), node, pid_file=pid_file,
                                                    TMPDIR=str(directory))
    try:
        driver = await async_playwright().start()
    finally:
        if chosen is None:
            del os.environ[_NODE_VARIABLE]
        else:
            os.environ[_NODE_VARIABLE] = chosen
    try:
        # A child of this process: its id names no other process until it has exited and been reaped.
        return driver, os.pidfd_open(int(pid_file.read_text()))
    except (OSError, ValueError):
        return driver, None


def _dying_with_parent(script: Path, parent: str, program: str, groups: Sequence[str] = (),
                       pid_file: Path | None = None, **environment: str) -> str:
    """Write ``script``, which runs ``program`` with the script's arguments and ``environment``, in the
    control groups whose procs files are ``groups``, to be killed when its parent dies: process
    ``parent``, or the script's own parent for '"$PPID"'; it writes its process id to ``pid_file``."""
    exports = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in environment.items())
    recorded = "" if pid_file is None else f"echo $$ > {shlex.quote(str(pid_file))}\n"
    script.write_text("#!/bin/sh\n" + _joining(groups) + recorded + exports + "exec "
                      + shlex.join([sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT])
                      + f" {parent} " + shlex.quote(program) + ' "$@"\n')
    script.chmod(0o700)
    return str(script)


def _joining(groups: Sequence[str]) -> str:
    """Shell lines that move the script into the control groups whose procs files are ``groups``."""
    return f'set -- {shlex.join(groups)} -- "$@"\n{ENTER_GROUPS}\n' if groups else ""


async def _launch_isolated(chromium: BrowserType, bwrap: str, executable: str, directory: Path,
                           groups: Sequence[str], options: _LaunchOptions) -> tuple[Browser, socket.socket]:
    """Launch Chromium in its sandbox, in a network namespace of its own and the control groups whose
    procs files are ``groups``; returns it and the socket listening for its gates in that namespace.

    Playwright starts a single executable, so a script in ``directory`` wraps Chromium in bwrap.
    """
    handover_path = directory / "handover"
    wrapper = directory / "chromium"
    program = os.path.realpath(executable)
    sandbox = sandbox_argv(bwrap, sandbox_user(), chromium_installation(program))
    command = [*namespace_argv(bwrap), sys.executable, "-I", "-S", "-c", _ENTER_NAMESPACE, str(handover_path),
               str(GATE_PORT), PROFILE, *sandbox, program]
    wrapper.write_text("#!/bin/sh\n" + _joining(groups) + "exec " + shlex.join(command) + ' "$@"\n')
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


def current_host() -> _BrowserHost:
    global _host
    if _host is None or _host.loop is not asyncio.get_running_loop():
        _host = _BrowserHost()   # a browser of an earlier loop died with that loop's driver pipe
    return _host


async def close_browser() -> None:
    """Close this process's browser, if it launched one: the worker's last step after its sessions.

    Without it Chromium still dies with the worker (the kernel kills the driver, and the driver's
    death Chromium); this makes the end orderly, the browser's temporary files removed.
    """
    global _host
    host, _host = _host, None
    if host is not None and host.loop is asyncio.get_running_loop():
        await host.close()

