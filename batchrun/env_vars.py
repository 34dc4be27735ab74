"""The user's environment variables as the runner reads them: a value (blank counts as unset), a
yes/no switch, or a URL to check. Read by the configuration of tools and sandboxes alike (and the URL check
by --base_url's), so it sits below them."""

from __future__ import annotations

import os
from urllib.parse import urlparse


def variable(name: str) -> str | None:
    """An environment variable's value, None when unset or blank."""
    value = os.environ.get(name, "").strip()
    return value or None


_YES = frozenset({"1", "true", "yes", "on"})
_NO = frozenset({"0", "false", "no", "off"})


def enabled(name: str) -> bool:
    """A yes/no environment variable: 1, true, yes or on."""
    return (variable(name) or "").lower() in _YES


def switch_problem(name: str) -> str | None:
    """Why a yes/no variable's value is neither, else None: read as no, "y" or "enable" would keep
    closed what the user meant to open, without a word."""
    value = variable(name)
    if value is None or value.lower() in _YES | _NO:
        return None
    return f"{name} is a switch: 1 to allow, 0 or unset not to; got {value!r}"


def usable_http_url(url: str) -> bool:
    """An http(s) URL with a host the HTTP client can use: no control character or byte that is not UTF-8
    (which the client refuses in every request), a whole IPv6 bracket and a port that exists (which
    urlparse raises on, or the client fails every request with)."""
    if not url.isprintable():
        return False
    try:
        parsed = urlparse(url)
        _ = parsed.port     # raises on a port out of range
    except ValueError:
        return False
    return parsed.scheme in ("http", "https") and bool(parsed.hostname)


def names_host(url: str, domain: str) -> bool:
    """Whether the URL's host is ``domain`` or a subdomain of it; a host that merely ends in the same
    letters (notopenrouter.ai) is another party, and must get neither its key nor its treatment."""
    host = (urlparse(url).hostname or "").lower()
    return host == domain or host.endswith(f".{domain}")
