"""Keeping the user's secrets out of everything the runner writes.

Tool environments never receive secrets (see environments.base.scrubbed_environment); this is the
second line: any text bound for a row, a log line or the console passes through ``redact``, which
replaces the literal values of the API key and of every secret-looking environment variable.
"""

from __future__ import annotations

import os
import re

_SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH)", re.IGNORECASE)
_MIN_SECRET_LENGTH = 8     # shorter values ("1", "true") would redact ordinary words
REDACTED = "[REDACTED]"


class Redactor:
    def __init__(self, secrets: list[str]) -> None:
        values = sorted({s for s in secrets if s and len(s) >= _MIN_SECRET_LENGTH}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, values))) if values else None

    @classmethod
    def from_environment(cls, api_key: str) -> Redactor:
        secrets = [api_key] + [value for name, value in os.environ.items() if _SECRET_NAME.search(name)]
        return cls(secrets)

    def __call__(self, text: str) -> str:
        if self._pattern is None or not text:
            return text
        return self._pattern.sub(REDACTED, text)
