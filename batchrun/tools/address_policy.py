"""Which network addresses a fetching tool may reach; shared by web_extract, vision and the browser,
so one pair of switches governs them all.

Addresses are judged, not host names: every address a name resolves to must be allowed (a name that
resolves to both a public and a private address must not be a way in), and callers connect to the
checked address itself. By default only public addresses are reachable. ``WEB_ALLOW_PRIVATE=1`` also
allows private networks and loopback (a local test site, an intranet); ``WEB_ALLOW_LINK_LOCAL=1`` also
link-local and cloud-metadata addresses, where cloud credentials live. Multicast addresses are never
reachable: nothing is fetched from one over TCP.

An IPv6 address that carries an IPv4 address (mapped, compatible, translated, NAT64, 6to4, Teredo) is
judged by that IPv4 address, which is where its packets end up: Python's ipaddress calls
``::127.0.0.1`` or ``64:ff9b::a9fe:a9fe`` global.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket

from batchrun.env_vars import enabled
from batchrun.tools import ToolError

ALLOW_PRIVATE = "WEB_ALLOW_PRIVATE"
ALLOW_LINK_LOCAL = "WEB_ALLOW_LINK_LOCAL"
# GCP's names for its metadata server (and "metadata", its short one), and EC2's ("instance-data"): names a
# provider's fetcher in that cloud resolves to 169.254.169.254 where its own resolver answers them.
METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata.goog", "metadata", "instance-data"})
# AWS/GCP/Azure/Oracle (link-local anyway), AWS and Oracle over IPv6 (unique-local addresses), Oracle's
# older one (in the IETF's 192.0.0.0/24), Alibaba Cloud, and Azure's WireServer (a public address that hands
# a VM its configuration and certificates): WEB_ALLOW_PRIVATE, meant for an intranet, opens none of them.
_METADATA_ADDRESSES = frozenset(map(ipaddress.ip_address, ("169.254.169.254", "fd00:ec2::254", "fd00:c1::a9fe:a9fe",
                                                           "192.0.0.192", "100.100.100.200", "168.63.129.16")))
# The IPv6 ranges whose last 32 bits are an IPv4 address: compatible (::a.b.c.d), mapped, translated,
# and NAT64's well-known prefix.
_IPV4_IN_LAST_32_BITS = tuple(map(ipaddress.ip_network, ("::/96", "::ffff:0:0/96", "::ffff:0:0:0/96",
                                                         "64:ff9b::/96")))
# For local use only, though Python's ipaddress calls them global: site-local, and NAT64 within a site.
_LOCAL_USE = tuple(map(ipaddress.ip_network, ("fec0::/10", "64:ff9b:1::/48")))

# The other notations C's inet_aton, and so whatever fetches a URL for someone else, reads as an IPv4
# address: hex and octal parts, and fewer than four parts ("0xa9fea9fe", "2852039166", "127.1").
_IPV4_NOTATION = re.compile(r"(?:0x[0-9a-f]*|[0-9]+)(?:\.(?:0x[0-9a-f]*|[0-9]+)){0,3}", re.IGNORECASE)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def address_refusal(address: Address | str) -> str | None:
    """Why connecting to ``address`` is refused under the current allow variables, or None."""
    if isinstance(address, str):
        address = ipaddress.ip_address(address.partition("%")[0])      # drop an IPv6 zone index
    embedded = _embedded_ipv4(address) if isinstance(address, ipaddress.IPv6Address) else None
    reason = _refusal(embedded or address)
    if reason is None:
        return None
    return f"{address} embeds {embedded}, which {reason}" if embedded else f"{address} {reason}"


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address that ``address`` carries, if it carries one (for Teredo, the client's)."""
    if address.sixtofour:
        return address.sixtofour
    if address.teredo:
        return address.teredo[1]
    if int(address) > 1 and any(address in network for network in _IPV4_IN_LAST_32_BITS):   # not :: or ::1
        return ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF)
    return None


def _refusal(address: Address) -> str | None:
    """Why ``address`` (no IPv4 carrier) is refused, as the rest of a sentence that names it."""
    if address.is_multicast:
        return "is a multicast address (never allowed: nothing is fetched from one)"
    if address in _METADATA_ADDRESSES or address.is_link_local:
        if enabled(ALLOW_LINK_LOCAL):
            return None
        return f"is a link-local or cloud-metadata address (allowed only with {ALLOW_LINK_LOCAL}=1)"
    local_use = any(address in network for network in _LOCAL_USE)
    if (address.is_global and not local_use) or enabled(ALLOW_PRIVATE):
        return None
    return f"is a private, loopback or reserved address (allowed only with {ALLOW_PRIVATE}=1)"


def host_refusal(host: str) -> str | None:
    """What the host text itself shows: a cloud-metadata name or a refused IP literal (all that can be
    judged for a URL someone else fetches, such as a vision model's provider)."""
    host = host.strip("[]").rstrip(".").lower()
    if _metadata_host(host) and not enabled(ALLOW_LINK_LOCAL):
        return f"{host} is a cloud-metadata host (allowed only with {ALLOW_LINK_LOCAL}=1)"
    try:
        return address_refusal(host)
    except ValueError:
        pass
    if not _IPV4_NOTATION.fullmatch(host):
        return None
    address = _ipv4_number(host)
    if address is None:
        return f"{host} is written as an IPv4 address that is none; name the host, or write its address plainly"
    reason = _refusal(address)
    return f"{host} is {address}, which {reason}" if reason else None


def _ipv4_number(host: str) -> ipaddress.IPv4Address | None:
    """The address a URL parser reads in ``host`` (an _IPV4_NOTATION), or None where its parts make none.
    By the rules of C's inet_aton and of WHATWG's URL parser (browsers, Node) alike, with the latter's
    '0x' alone read as 0, which inet_aton refused: '0x7f.0x.0x.1' passed as no address, and Node fetched
    127.0.0.1. (Digits alone with a leading zero, which other parsers read as decimal, httpx refuses first.)"""
    values = []
    try:
        for part in host.split("."):
            if part[:2].lower() == "0x":
                values.append(int(part[2:] or "0", 16))
            elif len(part) > 1 and part.startswith("0"):
                values.append(int(part, 8))     # '08': no octal number, ValueError
            else:
                values.append(int(part))        # thousands of digits: ValueError too
    except ValueError:
        return None
    *leading, last = values
    if any(value > 255 for value in leading) or last >= 256 ** (5 - len(values)):
        return None
    return ipaddress.IPv4Address(sum(value << 8 * (3 - place) for place, value in enumerate(leading)) + last)


def _metadata_host(host: str) -> bool:
    """A cloud-metadata name: METADATA_HOSTS, or EC2's own, instance-data.ec2.internal and
    instance-data.REGION.compute.internal."""
    return host in METADATA_HOSTS or (host.startswith("instance-data.") and host.endswith(".internal"))


async def allowed_addresses(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, all of them allowed; raises ToolError otherwise."""
    reason = host_refusal(host)
    if reason:
        raise ToolError(f"refused {host}: {reason}")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ToolError(f"cannot resolve {host}: {exc.strerror}") from None
    except UnicodeError:    # Python's IDNA encoding of the name: an empty label, one over 63 characters
        raise ToolError(f"cannot resolve {host}: not a valid host name") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for address in addresses:
        reason = address_refusal(address)
        if reason:
            raise ToolError(f"refused {host}: {reason}")
    return addresses
