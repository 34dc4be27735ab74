"""Which backend each configurable tool uses, read from the user's environment variables.

The parent process asks these questions at start-up (to list unavailable tools) and the workers ask
them again at call time, so this module stays light: no HTTP client or model library is imported,
installed packages are only looked up. A tool that cannot run raises :class:`NotConfigured` with the
one line that makes it available; the registry shows that line, the handler turns it into a ToolError.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

from batchrun.env_vars import usable_http_url, variable
from batchrun.install_hint import install_hint

WEB_EXTRA_HINT = install_hint("web")

# web_search backends are tried in the order of _SEARCH_CANDIDATES when WEB_SEARCH_BACKEND does not pick
# one: the self-hosted, keyless SearXNG first, then the hosted APIs, then the ddgs scraper library, which
# needs no account but is the least dependable.
_SEARCH_NEEDS = {"searxng": "SEARXNG_URL", "brave": "BRAVE_SEARCH_API_KEY", "tavily": "TAVILY_API_KEY",
                 "ddgs": f"the ddgs package ({install_hint('search')})"}
BRAVE_BASE_URL = "https://api.search.brave.com/res/v1"
TAVILY_BASE_URL = "https://api.tavily.com"

# image_generate providers, likewise (_IMAGE_CANDIDATES).
OPENAI_IMAGES_BASE_URL = "https://api.openai.com/v1"
OPENAI_IMAGES_MODEL = "gpt-image-1"
FAL_BASE_URL = "https://fal.run"
FAL_IMAGE_MODEL = "fal-ai/flux/schnell"


class NotConfigured(Exception):
    """A tool's backend is not configured or not installed; the message says what enables it."""


@dataclass(frozen=True)
class Backend:
    """A chosen backend: its name, where it is, and how to authenticate (the key never leaves the
    worker's HTTP requests)."""

    name: str
    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    model: str | None = None


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (start-up stays fast)."""
    return importlib.util.find_spec(module) is not None


def unavailable_line(choose: Callable[[], object]) -> Callable[[], str | None]:
    """A registry ``unavailable_reason``: None when ``choose`` succeeds, else its one line."""
    def reason() -> str | None:
        try:
            choose()
        except NotConfigured as exc:
            return str(exc)
        return None
    return reason


def _service_url(name: str, default: str | None = None) -> str | None:
    """The URL in variable ``name`` (else ``default``) without a trailing '/'. One no HTTP client can use
    leaves its tool unavailable, said at start, rather than offered to fail every call; the value is not
    shown, as a URL may carry credentials."""
    url = variable(name) or default
    if url is not None and not usable_http_url(url):
        raise NotConfigured(f"{name} is not an http(s) URL such as http://localhost:8080")
    return url.rstrip("/") if url else None


# --- web_search ---------------------------------------------------------------------------------

def _searxng() -> Backend | None:
    url = _service_url("SEARXNG_URL")
    return Backend("searxng", url) if url else None


def _brave() -> Backend | None:
    key = variable("BRAVE_SEARCH_API_KEY")
    return Backend("brave", _service_url("BRAVE_SEARCH_BASE_URL", BRAVE_BASE_URL), key) if key else None


def _tavily() -> Backend | None:
    key = variable("TAVILY_API_KEY")
    return Backend("tavily", _service_url("TAVILY_BASE_URL", TAVILY_BASE_URL), key) if key else None


def _ddgs() -> Backend | None:
    return Backend("ddgs") if installed("ddgs") else None


_SEARCH_CANDIDATES: dict[str, Callable[[], Backend | None]] = {
    "searxng": _searxng, "brave": _brave, "tavily": _tavily, "ddgs": _ddgs}


def _choose(selector: str, candidates: dict[str, Callable[[], Backend | None]], needs: dict[str, str],
            nothing_configured: str) -> Backend:
    """The backend named by the ``selector`` variable, else the first configured candidate in order."""
    chosen = (variable(selector) or "").lower()
    if chosen:
        if chosen not in candidates:
            raise NotConfigured(f"{selector}={chosen} is not one of {', '.join(candidates)}")
        backend = candidates[chosen]()
        if backend is None:
            raise NotConfigured(f"{selector}={chosen} needs {needs[chosen]}")
        return backend
    for candidate in candidates.values():
        backend = candidate()
        if backend is not None:
            return backend
    raise NotConfigured(nothing_configured)


def search_backend() -> Backend:
    """The backend web_search uses: WEB_SEARCH_BACKEND if set, else the first configured one."""
    if not installed("httpx"):
        raise NotConfigured(WEB_EXTRA_HINT)
    return _choose("WEB_SEARCH_BACKEND", _SEARCH_CANDIDATES, _SEARCH_NEEDS,
                   "set SEARXNG_URL (a self-hosted SearXNG), BRAVE_SEARCH_API_KEY or TAVILY_API_KEY, "
                   f"or {install_hint('search')} for ddgs")


# --- web_extract --------------------------------------------------------------------------------

def extract_backend() -> Backend:
    """web_extract needs only its libraries; lxml_html_clean is a separate package trafilatura imports."""
    if not all(map(installed, ("httpx", "trafilatura", "lxml_html_clean"))):
        raise NotConfigured(WEB_EXTRA_HINT)
    return Backend("trafilatura")


# --- vision_analyze ---------------------------------------------------------------------------

def vision_endpoint() -> str | None:
    """VISION_BASE_URL, or None for the run's own endpoint: vision_analyze needs nothing configured."""
    return _service_url("VISION_BASE_URL")


# --- image_generate -----------------------------------------------------------------------------

def _openai_images() -> Backend | None:
    base_url, key = variable("IMAGE_GEN_BASE_URL"), variable("IMAGE_GEN_API_KEY")
    if not (base_url or key):
        return None
    return Backend("openai", _service_url("IMAGE_GEN_BASE_URL", OPENAI_IMAGES_BASE_URL), key,
                   variable("IMAGE_GEN_MODEL") or OPENAI_IMAGES_MODEL)


def _fal() -> Backend | None:
    key = variable("FAL_KEY")
    if not key:
        return None
    return Backend("fal", _service_url("FAL_BASE_URL", FAL_BASE_URL), key,
                   (variable("FAL_IMAGE_MODEL") or FAL_IMAGE_MODEL).strip("/"))


_IMAGE_CANDIDATES: dict[str, Callable[[], Backend | None]] = {"openai": _openai_images, "fal": _fal}
_IMAGE_NEEDS = {"openai": "IMAGE_GEN_API_KEY or IMAGE_GEN_BASE_URL", "fal": "FAL_KEY"}


def image_provider() -> Backend:
    """The provider image_generate uses: IMAGE_GEN_PROVIDER if set, else the first configured one."""
    return _choose("IMAGE_GEN_PROVIDER", _IMAGE_CANDIDATES, _IMAGE_NEEDS,
                   "set IMAGE_GEN_API_KEY (OpenAI images API) or IMAGE_GEN_BASE_URL and IMAGE_GEN_MODEL "
                   "(any OpenAI-compatible images API), or FAL_KEY (fal.ai)")
