"""The user's environment variables as the runner reads them: a value (blank counts as unset), a
yes/no switch, a URL to check, or the proxy the endpoint's requests go through. Read by the configuration
of tools and sandboxes alike (and the URL check by --base_url's), so it sits below them."""

from __future__ import annotations

import os
import urllib.request
from typing import NamedTuple
from urllib.parse import urlparse, urlsplit


def variable(name: str) -> str | None:
    """An environment variable's value, None when unset or blank."""
    value = os.environ.get(name, "").strip()
    return value or None


_YES = frozenset({"1", "true", "yes", "on"})
_NO = frozenset({"0", "false", "no", "off"})


def yes_or_no(text: str) -> bool | None:
    """True for 1, true, yes or on, False for 0, false, no or off, in any case; None for anything else."""
    word = text.strip().lower()
    return True if word in _YES else False if word in _NO else None


def enabled(name: str) -> bool:
    """A yes/no environment variable: 1, true, yes or on."""
    return yes_or_no(variable(name) or "") is True


def switch_problem(name: str) -> str | None:
    """Why a yes/no variable's value is neither, else None: read as no, "y" or "enable" would keep
    closed what the user meant to open, without a word."""
    value = variable(name)
    if value is None or yes_or_no(value) is not None:
        return None
    return f"{name} is a switch: 1 to allow, 0 or unset not to; got {value!r}"


def usable_http_url(url: str) -> bool:
    """An http(s) URL with a host the HTTP client can use (see url_problem)."""
    return url_problem(url, ("http", "https")) is None


def url_problem(url: str, schemes: tuple[str, ...]) -> str | None:
    """Why the HTTP client cannot use ``url`` with one of ``schemes``, else None: it refuses a control
    character or a byte that is not UTF-8 in every request, and a broken IPv6 bracket, a port out of
    range or no host fail every request (urlsplit raises on the first two)."""
    if not url.isprintable():
        return "it holds a character that is not printable"
    try:
        parsed = urlsplit(url)
    except ValueError as exc:
        return f"it is not a URL ({exc})"
    if parsed.scheme not in schemes:
        return f"its scheme {parsed.scheme!r} is none of {', '.join(schemes)}"
    try:
        _ = parsed.port
    except ValueError:      # out of range, or not a number
        return "its port is not a number from 1 to 65535"
    return None if parsed.hostname else "it names no host"


def names_host(url: str, domain: str) -> bool:
    """Whether the URL's host is ``domain`` or a subdomain of it; a host that merely ends in the same
    letters (notopenrouter.ai) is another party, and must get neither its key nor its treatment."""
    host = (urlparse(url).hostname or "").lower()
    return host == domain or host.endswith(f".{domain}")


# The schemes whose proxy variables the endpoint's HTTP client (httpx) reads: http_proxy, https_proxy,
# all_proxy; the ones it can speak to.
_PROXIED_SCHEMES = ("http", "https", "all")
_PROXY_SCHEMES = ("http", "https", "socks5", "socks5h")


def _proxy_variables() -> dict[str, tuple[str, str]]:
    """scheme -> (variable, URL) of each proxy the HTTP client takes from the environment, read as
    urllib reads them (httpx asks it): the lower-case variable over the upper-case one, and a blank
    lower-case one unsets the scheme's proxy. A URL without a scheme is an http:// one."""
    found = {}
    for scheme in _PROXIED_SCHEMES:
        lower, upper = f"{scheme}_proxy", f"{scheme.upper()}_PROXY"
        name = lower if lower in os.environ else upper
        if value := os.environ.get(name, ""):
            found[scheme] = (name, value if "://" in value else f"http://{value}")
    return found


def proxy_problem() -> str | None:
    """Why a proxy variable the HTTP client reads cannot be used, else None. The client builds every
    one of them with its first request, and would fail each request (or the pool's start) on it.
    Never shows the URL: it may hold a password."""
    for name, url in _proxy_variables().values():
        problem = url_problem(url, _PROXY_SCHEMES)
        if problem is None and urlsplit(url).port == 0:
            problem = "its port is not a number from 1 to 65535"
        if problem is not None:
            return (f"the proxy variable {name} is not a proxy URL the HTTP client can use: {problem}. Give it as "
                    "http://HOST:PORT (or https://, socks5://), or unset it")
    return None


class Proxy(NamedTuple):
    """A proxy the HTTP client uses, and the variable that set it (what the user has to change)."""

    variable: str
    url: str


def proxy_for(url: str) -> Proxy | None:
    """The proxy the HTTP client sends requests to ``url`` through, else None (none is set for its
    scheme, or NO_PROXY names its host)."""
    parsed = urlparse(url)
    proxies = _proxy_variables()
    found = proxies.get(parsed.scheme) or proxies.get("all")
    if found is None or urllib.request.proxy_bypass(parsed.hostname or ""):
        return None
    return Proxy(*found)
