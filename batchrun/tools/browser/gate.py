"""The address gate: the SOCKS5 server through which every connection of a session's browser context passes.

The model's navigations, but also the page's images, scripts, frames and redirects, reach the network
only here. The gate resolves the host itself, applies the address policy shared with the web tools
(batchrun.tools.address_policy: ``WEB_ALLOW_PRIVATE``, ``WEB_ALLOW_LINK_LOCAL``), and connects to the
very address it checked, so neither a redirect nor DNS rebinding slips past it. A file of its own
because it is the one place the browser's address policy is enforced, the same whether Chromium shares
the host's network (:class:`LoopbackGates`) or has a namespace of its own (:class:`NamespaceGates`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections import deque
from typing import Protocol

from batchrun.time_limit import within
from batchrun.tools import ToolError
from batchrun.tools.address_policy import allowed_addresses

CONNECT_TIMEOUT_S = 10.0
GATE_PORT = 1080              # in Chromium's own network namespace, where nothing else listens


class Gate:
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


class Gates(Protocol):
    """Where the browser's contexts reach their gates."""

    async def add(self, gate: Gate) -> str:
        """Start serving ``gate``; returns the proxy URL for its browser context."""

    def remove(self, gate: Gate) -> None: ...

    def close(self) -> None: ...


class NamespaceGates:
    """The gates of a Chromium in a network namespace of its own, served here, on the host's network.

    The one socket listening in the namespace (on all its addresses, which are only loopback ones)
    takes every context's connections; each context gets its own loopback address as its proxy, so
    the address a connection arrived at tells whose gate it passes.
    """

    def __init__(self, listener: socket.socket) -> None:
        self._listener = listener
        self._server: asyncio.Server | None = None
        self._gates: dict[str, Gate] = {}
        self._addresses: dict[Gate, str] = {}
        self._last = 1

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._route, sock=self._listener)

    async def add(self, gate: Gate) -> str:
        while True:         # round the 16 million addresses of 127.0.0.0/8, skipping those in use
            self._last = self._last % 0xFFFFFD + 2
            address = str(ipaddress.IPv4Address(0x7F000000 + self._last))
            if address not in self._gates:
                break
        self._gates[address], self._addresses[gate] = gate, address
        return f"socks5://{address}:{GATE_PORT}"

    def remove(self, gate: Gate) -> None:
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


class LoopbackGates:
    """The gates of a Chromium that shares the host's network: each listens on a port of 127.0.0.1."""

    def __init__(self) -> None:
        self._servers: dict[Gate, asyncio.Server] = {}

    async def add(self, gate: Gate) -> str:
        server = self._servers[gate] = await asyncio.start_server(gate.serve, "127.0.0.1", 0)
        return f"socks5://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    def remove(self, gate: Gate) -> None:
        server = self._servers.pop(gate, None)
        if server is not None:
            server.close()

    def close(self) -> None:
        for gate in list(self._servers):
            self.remove(gate)

