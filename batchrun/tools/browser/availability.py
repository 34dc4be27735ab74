"""Whether the browser tools can run here: a Playwright to drive and a system Chromium to drive.

Apart from the rest of the package so that the parent process, which only asks :func:`unavailable_reason`,
loads nothing of the tools themselves.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

from batchrun.install_hint import install_hint
from batchrun.tools.browser.directories import NO_TEMPORARY, browser_temporary

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
INSTALL_HINT = f"{install_hint('browser')} and apt-get install chromium"


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
    if browser_temporary() is None:
        return NO_TEMPORARY
    return None
