"""Keeping the user's secrets out of everything the runner writes.

Tool environments never receive secrets (see environments.base.scrubbed_environment); this is the
second line: any text bound for a row, a log line or the console passes through ``redact``, which
replaces the literal values of the API key, of every secret-looking environment variable, and of the
credentials any variable's URL holds.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
from urllib.parse import unquote, urlsplit

_SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASS|CREDENTIAL|AUTH(?!OR)|COOKIE)", re.IGNORECASE)
# Shorter values ("1", "true") would redact ordinary words. The same length bounds what a cut may
# leave: a cap (a tool's output limit, a preview) can cut a secret anywhere, so any run of at least
# this many of its first or last characters is replaced too.
MIN_SECRET_LENGTH = 8
REDACTED = "[REDACTED]"


def shown_unless_a_key(word: str) -> str:
    """A word of the command line as a refusal may quote it, where it may be a key typed in the wrong place:
    whole if it is too short to be one or reads as a URL, a path or words (a "/", ".", ":" or space, which
    API keys do not hold), else its first four characters; the redactor knows only the key the run was
    given, not one pasted by mistake."""
    if len(word) < MIN_SECRET_LENGTH or re.search(r"[/.:\s]", word):
        return repr(word)
    return f"{word[:4]!r}… (the rest not shown: it may be an API key)"


class _Starts:
    """Where a text holds a run of at least MIN_SECRET_LENGTH characters that starts one of the secrets.

    A regex finds where one of the secrets' first characters start (at every position: runs of two
    secrets may overlap), and each is then followed in plain Python as far as it matches: a pattern
    that nests one optional group per character would fail to compile for a secret of a few hundred
    characters (session tokens, PEM keys)."""

    def __init__(self, secrets: list[str]) -> None:
        self._by_start: dict[str, list[str]] = {}
        for secret in secrets:
            self._by_start.setdefault(secret[:MIN_SECRET_LENGTH], []).append(secret)
        self._starts = re.compile("(?=(" + "|".join(map(re.escape, self._by_start)) + "))")

    def spans(self, text: str) -> list[tuple[int, int]]:
        spans = []
        for match in self._starts.finditer(text):
            start = match.start()
            longest = max(len(os.path.commonprefix([text[start:start + len(secret)], secret]))
                          for secret in self._by_start[match.group(1)])
            spans.append((start, start + longest))
        return spans


def _written_forms(secret: str) -> set[str]:
    """The secret as text holds it, and as JSON text does (quotes, backslashes and control characters
    escaped, non-ASCII characters too or not): tool results and arguments are redacted as JSON."""
    return {secret, *(json.dumps(secret, ensure_ascii=ascii_only)[1:-1] for ascii_only in (False, True))}


def _url_credentials(value: str) -> list[str]:
    """The credentials of each URL in an environment variable's value, whatever the variable's name (a
    proxy's, a database's, a search service's): the password as the URL writes it and decoded, and the
    Basic credentials an HTTP client sends for it, which a proxy or service may quote back in an error.
    A user name alone is a token (https://TOKEN@github.com, a Sentry DSN) where a scheme says it is a
    URL; without one, only a password makes one (user:password@proxy:3128, as proxy variables allow),
    so an e-mail address is not."""
    found = []
    for word in value.split():
        schemed = "://" in word
        try:
            parts = urlsplit(word if schemed else f"//{word}")
            user, password = parts.username, parts.password
        except ValueError:      # a broken IPv6 bracket: no URL the clients could use either
            continue
        if user is None or (password is None and not schemed):
            continue
        written = user if password is None else password
        basic = f"{unquote(user)}:{unquote(password or '')}"
        found += [written, unquote(written), base64.b64encode(basic.encode()).decode()]
    return found


class Redactor:
    def __init__(self, secrets: list[str]) -> None:
        values = sorted({form for s in secrets if s and len(s) >= MIN_SECRET_LENGTH for form in _written_forms(s)},
                        key=len, reverse=True)
        self._prefixes = _Starts(values) if values else None
        # A suffix of a secret is a prefix of the reversed secret in the reversed text.
        self._suffixes = _Starts([value[::-1] for value in values]) if values else None

    @classmethod
    def from_environment(cls, api_key: str) -> Redactor:
        secrets = [api_key] + [value for name, value in os.environ.items() if _SECRET_NAME.search(name)]
        return cls(secrets + [credential for value in os.environ.values() for credential in _url_credentials(value)])

    @staticmethod
    @functools.lru_cache(maxsize=4)
    def of_run(api_key: str) -> Redactor:
        """The redactor of a run's process (its key and its environment's secrets), built once: its
        patterns are compiled for every secret, and each row asks for it."""
        return Redactor.from_environment(api_key)

    def __call__(self, text: str) -> str:
        if self._prefixes is None or self._suffixes is None or not text:
            return text
        spans = self._prefixes.spans(text)
        end = len(text)
        spans += [(end - stop, end - start) for start, stop in self._suffixes.spans(text[::-1])]
        if not spans:
            return text
        parts, position = [], 0
        for start, stop in _merged(spans):
            parts += [text[position:start], REDACTED]
            position = stop
        parts.append(text[position:])
        return "".join(parts)

    def json_text(self, text: str) -> str:
        """JSON text a model wrote (a tool call's arguments) redacted whatever way its strings escape a
        secret; left as written where no escape hides one."""
        canonical = canonical_json_escapes(text)
        redacted = self(canonical)
        return text if redacted == canonical else redacted


# One escape of a JSON string: a surrogate pair, a \uXXXX, or a backslash and one character (which
# consumes an escaped backslash whole, so the "u0073" of "\\u0073" is never read as an escape).
_JSON_ESCAPE = re.compile(r"\\(?:ud[89ab][0-9a-f]{2}\\ud[c-f][0-9a-f]{2}|u[0-9a-f]{4}|.)", re.DOTALL | re.IGNORECASE)


def _canonical_escape(match: re.Match[str]) -> str:
    return _canonical(match.group(0))


@functools.lru_cache(maxsize=4096)      # text a model escapes repeats its few escapes many times over
def _canonical(escape: str) -> str:
    """An escape as json.dumps writes its character (itself where it is not valid JSON)."""
    try:
        return json.dumps(json.loads(f'"{escape}"'), ensure_ascii=False)[1:-1]
    except ValueError:
        return escape


def canonical_json_escapes(text: str) -> str:
    """JSON text with every string escape written as json.dumps writes it (``\\u0073`` as ``s``), which
    leaves the text's value the same: any character of a string may be escaped, so a secret can hide
    from a match on its written forms until the text is decoded. Textual, so no depth of nesting
    stops it."""
    return _JSON_ESCAPE.sub(_canonical_escape, text) if "\\" in text else text


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The spans, overlapping or touching ones joined, in order."""
    merged: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged
