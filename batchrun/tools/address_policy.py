"""Which network addresses a fetching tool may reach (SPEC §14); shared by web_extract, vision and the
browser, so one pair of switches governs them all.

Addresses are judged, not host names: every address a name resolves to must be allowed (a name that
resolves to both a public and a private address must not be a way in), and callers connect to the
checked address itself. By default only public addresses are reachable. ``WEB_ALLOW_PRIVATE=1`` also
allows private networks and loopback (a local test site, an intranet); ``WEB_ALLOW_LINK_LOCAL=1`` also
link-local and cloud-metadata addresses, where cloud credentials live.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

from batchrun.tools import ToolError
from batchrun.tools.configuration import enabled

ALLOW_PRIVATE = "WEB_ALLOW_PRIVATE"
ALLOW_LINK_LOCAL = "WEB_ALLOW_LINK_LOCAL"
METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata.goog"})
# AWS/GCP/Azure/Oracle (link-local anyway), AWS over IPv6 (a unique-local address), Alibaba Cloud.
_METADATA_ADDRESSES = frozenset(map(ipaddress.ip_address, ("169.254.169.254", "fd00:ec2::254",
                                                           "100.100.100.200")))

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def address_refusal(address: Address | str) -> str | None:
    """Why connecting to ``address`` is refused under the current allow variables, or None."""
    if isinstance(address, str):
        address = ipaddress.ip_address(address.partition("%")[0])      # drop an IPv6 zone index
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    if address in _METADATA_ADDRESSES or address.is_link_local:
        if enabled(ALLOW_LINK_LOCAL):
            return None
        return f"{address} is a link-local or cloud-metadata address (allowed only with {ALLOW_LINK_LOCAL}=1)"
    if address.is_global or enabled(ALLOW_PRIVATE):
        return None
    return f"{address} is a private, loopback or reserved address (allowed only with {ALLOW_PRIVATE}=1)"


def host_refusal(host: str) -> str | None:
    """What the host text itself shows: a cloud-metadata name or a refused IP literal (all that can be
    judged for a URL someone else fetches, such as a vision model's provider)."""
    host = host.strip("[]").rstrip(".").lower()
    if host in METADATA_HOSTS and not enabled(ALLOW_LINK_LOCAL):
        return f"{host} is a cloud-metadata host (allowed only with {ALLOW_LINK_LOCAL}=1)"
    try:
        return address_refusal(host)
    except ValueError:
        return None


async def allowed_addresses(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, all of them allowed; raises ToolError otherwise."""
    reason = host_refusal(host)
    if reason:
        raise ToolError(f"refused {host}: {reason}")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ToolError(f"cannot resolve {host}: {exc.strerror}") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for address in addresses:
        reason = address_refusal(address)
        if reason:
            raise ToolError(f"refused {host}: {reason}")
    return addresses
