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
from collections.abc import Callable
from urllib.parse import parse_qsl, quote, unquote, urlsplit

# A part of a variable's name that is or ends with one of these words (OPENAI_API_KEY, APIKEY, PGPASSWORD,
# GITHUB_TOKEN) says it holds a secret; one that only begins with one (KEYRING, TOKENIZERS, AUTHOR) does not.
_SECRET_NAME = re.compile(r"(?:^|_)[A-Z0-9]*(?:KEYS?|TOKENS?|SECRETS?|PASS|PASSWORD|PASSWD|PASSPHRASE|CREDENTIALS?|"
                          r"AUTH|AUTHORIZATION|COOKIES?)(?:_|$)", re.IGNORECASE)
# Shorter values ("1", "true", a local server's placeholder key "EMPTY") would redact ordinary words. The
# same length bounds what a cut may leave: a cap (a tool's output limit, a preview) can cut a secret
# anywhere, so any run of at least this many of its first or last characters is replaced too.
MIN_SECRET_LENGTH = 8
# The public mark of a kind of key at its start (sk-proj-, sk-or-v1-, sk-ant-api03-, ghp_, hf_, xoxb-): text
# that names the kind holds none of the secret, so a piece cut from a key's start counts from as many
# characters past its mark.
_KIND_MARK = re.compile(r"(?:[a-z]{1,7}[0-9]{0,2}[-_]){1,3}")
REDACTED = "[REDACTED]"


def shown_unless_a_key(word: str) -> str:
    """A word of the command line as a refusal may quote it, where it may be a key typed in the wrong place:
    whole if it is too short to be one or reads as a URL, a path or words (a scheme, a leading "/", "~" or
    ".", a space; a "/", "." or ":" without capital letters, as host names and ports are written, where keys
    that hold them, AWS's and JWTs, mix cases), else its first four characters; the redactor knows only the
    key the run was given, not one pasted by mistake."""
    if (len(word) < MIN_SECRET_LENGTH or "://" in word or word.startswith(("/", "~", ".")) or re.search(r"\s", word)
            or (re.search(r"[/.:]", word) and not re.search(r"[A-Z]", word))):
        return repr(word)
    return f"{word[:4]!r}… (the rest not shown: it may be an API key)"


class _Starts:
    """Where a text holds a run that starts one of the secrets and is long enough to count: the whole
    secret, or ``least(secret)`` of its characters.

    A regex finds where one of the secrets' first characters start (at every position: runs of two
    secrets may overlap), and each is then followed in plain Python as far as it matches: a pattern
    that nests one optional group per character would fail to compile for a secret of a few hundred
    characters (session tokens, PEM keys)."""

    def __init__(self, secrets: list[str], least: Callable[[str], int]) -> None:
        self._by_start: dict[str, list[tuple[str, int]]] = {}
        for secret in secrets:
            self._by_start.setdefault(secret[:MIN_SECRET_LENGTH], []).append((secret, min(len(secret), least(secret))))
        self._starts = re.compile("(?=(" + "|".join(map(re.escape, self._by_start)) + "))")

    def spans(self, text: str) -> list[tuple[int, int]]:
        spans = []
        for match in self._starts.finditer(text):
            start = match.start()
            runs = [run for secret, needed in self._by_start[match.group(1)]
                    if (run := len(os.path.commonprefix([text[start:start + len(secret)], secret]))) >= needed]
            if runs:
                spans.append((start, start + max(runs)))
        return spans


def _least_from_start(secret: str) -> int:
    """How much of a secret's start a piece must hold to count: MIN_SECRET_LENGTH past its kind's mark."""
    mark = _KIND_MARK.match(secret)
    return (mark.end() if mark else 0) + MIN_SECRET_LENGTH


def _written_forms(secret: str) -> set[str]:
    """The secret as text holds it, as JSON text does (quotes, backslashes and control characters
    escaped, non-ASCII characters too or not: tool results and arguments are redacted as JSON), and as a
    server quoting a request may (percent-encoded, base64 as in a header). Other encodings stay possible:
    an endpoint is sent the key and may write it back in any form."""
    return {secret, *(json.dumps(secret, ensure_ascii=ascii_only)[1:-1] for ascii_only in (False, True)),
            quote(secret, safe=""), base64.b64encode(secret.encode()).decode().rstrip("=")}


def _secret_values(value: str) -> list[str]:
    """What of a secret-named variable's value is secret. Not a path (SSH_AUTH_SOCK, SSH_ASKPASS, a
    credentials file: the file is the secret, not its name, and a path's start is every path's); not a URL
    (NEXTAUTH_URL), whose credentials :func:`_url_credentials` takes and whose query's values are taken
    here. Sent without the whitespace around it, so found without it."""
    value = value.strip()
    if "://" in value:
        try:
            return [v for _, v in parse_qsl(urlsplit(value).query)]
        except ValueError:
            return [value]
    if value.startswith(("/", "~/")):
        place = os.path.expanduser(value)
        parent = os.path.dirname(place)
        if os.path.exists(place) or (parent != "/" and os.path.isdir(parent)):
            return []
    return [value]


def _url_credentials(value: str, *, proxy: bool = False) -> list[str]:
    """The credentials of each URL in an environment variable's value, whatever the variable's name (a
    proxy's, a database's, a search service's): the password as the URL writes it and decoded, and the
    Basic credentials an HTTP client sends for it, which a proxy or service may quote back in an error.
    A user name alone is a token (https://TOKEN@github.com, a Sentry DSN) where a scheme says it is a
    URL; without one, only a password makes one (user:password@proxy:3128, as proxy variables allow),
    so an e-mail address is not, except in a ``proxy`` variable, which HTTP clients read as a URL
    (TOKEN@proxy:3128 is sent as the proxy's Basic credentials)."""
    found = []
    for word in value.split():
        schemed = "://" in word
        try:
            parts = urlsplit(word if schemed else f"//{word}")
            user, password = parts.username, parts.password
        except ValueError:      # a broken IPv6 bracket: no URL the clients could use either
            continue
        if user is None or (password is None and not (schemed or proxy)):
            continue
        written = user if password is None else password
        basic = f"{unquote(user)}:{unquote(password or '')}"
        found += [written, unquote(written), base64.b64encode(basic.encode()).decode()]
    return found


class Redactor:
    def __init__(self, secrets: list[str]) -> None:
        # A key is sent without the whitespace a file or a paste left around it, so it is found without it.
        found = {secret.strip() for secret in secrets}
        values = sorted({form for s in found if len(s) >= MIN_SECRET_LENGTH for form in _written_forms(s)},
                        key=len, reverse=True)
        self._prefixes = _Starts(values, _least_from_start) if values else None
        # A suffix of a secret is a prefix of the reversed secret in the reversed text.
        self._suffixes = _Starts([value[::-1] for value in values], lambda _: MIN_SECRET_LENGTH) if values else None

    @classmethod
    def from_environment(cls, api_key: str) -> Redactor:
        secrets = [api_key] + [secret for name, value in os.environ.items() if _SECRET_NAME.search(name)
                               for secret in _secret_values(value)]
        return cls(secrets + [credential for name, value in os.environ.items()
                              for credential in _url_credentials(value, proxy=name.lower().endswith("_proxy"))])

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
