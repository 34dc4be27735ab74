"""Keeping the user's secrets out of everything the runner writes.

Tool environments never receive secrets (see environments.base.scrubbed_environment); this is the
second line: any text bound for a row, a log line or the console passes through ``redact``, which
replaces the literal values of the API key and of every secret-looking environment variable.
"""

from __future__ import annotations

import os
import re

_SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH)", re.IGNORECASE)
# Shorter values ("1", "true") would redact ordinary words. The same length bounds what a cut may
# leave: a cap (a tool's output limit, a preview) can cut a secret anywhere, so any run of at least
# this many of its first or last characters is replaced too.
_MIN_SECRET_LENGTH = 8
REDACTED = "[REDACTED]"


def _any_prefix(secret: str) -> str:
    """A pattern matching the longest prefix of ``secret`` that has at least _MIN_SECRET_LENGTH characters."""
    pattern = ""
    for char in reversed(secret[_MIN_SECRET_LENGTH:]):
        pattern = f"(?:{re.escape(char)}{pattern})?"
    return re.escape(secret[:_MIN_SECRET_LENGTH]) + pattern


def _pattern(secrets: list[str]) -> re.Pattern[str] | None:
    return re.compile("|".join(map(_any_prefix, secrets))) if secrets else None


class Redactor:
    def __init__(self, secrets: list[str]) -> None:
        values = sorted({s for s in secrets if s and len(s) >= _MIN_SECRET_LENGTH}, key=len, reverse=True)
        self._prefixes = _pattern(values)
        # A suffix of a secret is a prefix of the reversed secret in the reversed text.
        self._suffixes = _pattern([value[::-1] for value in values])

    @classmethod
    def from_environment(cls, api_key: str) -> Redactor:
        secrets = [api_key] + [value for name, value in os.environ.items() if _SECRET_NAME.search(name)]
        return cls(secrets)

    def __call__(self, text: str) -> str:
        if self._prefixes is None or self._suffixes is None or not text:
            return text
        spans = [match.span() for match in self._prefixes.finditer(text)]
        end = len(text)
        spans += [(end - match.end(), end - match.start()) for match in self._suffixes.finditer(text[::-1])]
        if not spans:
            return text
        parts, position = [], 0
        for start, stop in _merged(spans):
            parts += [text[position:start], REDACTED]
            position = stop
        parts.append(text[position:])
        return "".join(parts)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The spans, overlapping or touching ones joined, in order."""
    merged: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged
