"""The user's environment variables as the runner reads them: a value (blank counts as unset) or a
yes/no switch. Read by the configuration of tools and sandboxes alike, so it sits below both."""

from __future__ import annotations

import os


def variable(name: str) -> str | None:
    """An environment variable's value, None when unset or blank."""
    value = os.environ.get(name, "").strip()
    return value or None


def enabled(name: str) -> bool:
    """A yes/no environment variable: 1, true, yes or on."""
    return (variable(name) or "").lower() in {"1", "true", "yes", "on"}
