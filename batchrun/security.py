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
from urllib.parse import quote, unquote, urlsplit

# Words in a variable's name that say it holds a secret, wherever they stand (OPENAI_API_KEY, APIKEY2,
# githubToken, PGPASSWORD, api-key); not the longer words that begin with one (KEYRING, KEYBOARD, TOKENIZERS,
# AUTHOR, but AUTHORIZATION is one), whose variables hold settings and names that rows and commands hold too.
_SECRET_NAME = re.compile(r"KEY(?!RING|BOARD)|TOKEN(?!IZER)|SECRET|PASS|CREDENTIAL|AUTH(?!OR(?!IZ))|COOKIE",
                          re.IGNORECASE)
# Shorter values ("1", "true", a local server's placeholder key "EMPTY") would redact ordinary words. The
# same length bounds what a cut may leave: a cap (a tool's output limit, a preview) can cut a secret
# anywhere, so any run of at least this many of its first or last characters is replaced too.
MIN_SECRET_LENGTH = 8
# The public marks of kinds of keys, at their start: text that names the kind (a row about OpenAI's
# project keys, `export OPENAI_API_KEY=sk-proj-...`) holds none of the secret.
_KIND_MARKS = ("sk-proj-", "sk-or-v1-", "sk-ant-api03-", "sk-ant-admin01-", "sk-svcacct-", "sk-admin-",
               "github_pat_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "glpat-", "hf_", "xoxb-", "xoxp-", "xoxa-",
               "xoxe-", "sk_live_", "sk_test_", "rk_live_", "rk_test_")
_SCHEME = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://")
_ADDRESS = re.compile(_SCHEME.pattern + r"[^/?#@\s]+/?")     # scheme, host and port alone
REDACTED = "[REDACTED]"


def shown_unless_a_key(word: str) -> str:
    """A word of the command line as a refusal may quote it, where it may be a key typed in the wrong place:
    whole if it is too short to be one or reads as a URL, a path or words (a scheme, a leading "/", "~/" or
    ".", a space; a "/", "." or ":" without capital letters, as host names and ports are written, where keys
    that hold them, AWS's and JWTs, mix cases), else its first four characters; the redactor knows only the
    key the run was given, not one pasted by mistake."""
    if (len(word) < MIN_SECRET_LENGTH or "://" in word or word.startswith(("/", "~/", ".")) or re.search(r"\s", word)
            or (re.search(r"[/.:]", word) and not re.search(r"[A-Z]", word))):
        return repr(word)
    return f"{word[:4]!r}… (the rest not shown: it may be an API key)"


class _Starts:
    """Where a text holds a run that starts one of the secrets and is long enough to count: the whole
    secret, or as many of its characters as it is given.

    A regex finds where one of the secrets' first characters start (at every position: runs of two
    secrets may overlap), and each is then followed in plain Python as far as it matches: a pattern
    that nests one optional group per character would fail to compile for a secret of a few hundred
    characters (session tokens, PEM keys)."""

    def __init__(self, secrets: dict[str, int]) -> None:
        self._by_start: dict[str, list[tuple[str, int]]] = {}
        for secret, least in secrets.items():
            self._by_start.setdefault(secret[:MIN_SECRET_LENGTH], []).append((secret, min(len(secret), least)))
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


def _written_forms(secret: str, *, start: bool = False) -> list[str]:
    """The secret as text holds it, as JSON text does (quotes, backslashes and control characters
    escaped, non-ASCII characters too or not: tool results and arguments are redacted as JSON), and as a
    server quoting a request may (percent-encoded; base64 of the secret alone, as in a header). Other
    encodings stay possible: an endpoint is sent the key and may write it back in any form. ``start``: the
    forms of a secret's start, as the forms of the whole begin (base64 only of its whole 3-byte groups)."""
    raw = secret.encode()
    if start:
        raw = raw[:len(raw) - len(raw) % 3]
    return [secret, json.dumps(secret, ensure_ascii=False)[1:-1], json.dumps(secret, ensure_ascii=True)[1:-1],
            quote(secret, safe=""), base64.b64encode(raw).decode().rstrip("=")]


def _public_head(secret: str) -> str:
    """The start of a secret that others' text holds too: the mark of its kind of key, a URL's scheme,
    host and port where no credentials are among them, or the directory of a path that is one here.
    A piece cut from the secret's start counts only with MIN_SECRET_LENGTH characters past it (the whole
    secret always counts)."""
    for mark in _KIND_MARKS:
        if secret.startswith(mark):
            return mark
    if scheme := _SCHEME.match(secret):
        rest = secret[scheme.end():]
        host = re.match(r"[^/?#]*", rest)
        if host is None or "@" in host.group(0):
            return scheme.group(0)
        return secret[:scheme.end() + host.end() + rest[host.end():].startswith("/")]
    directory = secret[:secret.rfind("/") + 1]
    if directory.startswith("/") and directory.strip("/") and os.path.isdir(directory):
        return directory
    return ""


def _names_a_place(text: str) -> bool:
    """Whether ``text`` is an address (NEXTAUTH_URL=http://localhost:3000: scheme, host and port alone, which
    commands and rows name) or a path of this machine (SSH_AUTH_SOCK, SSH_ASKPASS): what it names is the
    secret, if any, not its name."""
    return bool(_ADDRESS.fullmatch(text)) or (text.startswith("/") and os.path.exists(text))


def _secret_values(value: str) -> list[str]:
    """What of a secret-named variable's value is secret: the value, without the whitespace around it (it is
    sent without), unless it names a place, and where it has several words (a list of keys, a PEM block's
    lines) each but a URL's (whose credentials :func:`_url_credentials` takes) or a place's."""
    value = value.strip()
    if _names_a_place(value):
        return []
    words = value.split()
    if len(words) == 1:
        return [value]
    return [value, *(word for word in words if not _SCHEME.match(word) and not _names_a_place(word))]


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
        starts: dict[str, int] = {}     # each written form of each secret: how much of its start counts
        for secret in {secret.strip() for secret in secrets}:
            if len(secret) < MIN_SECRET_LENGTH:
                continue
            head = _public_head(secret)
            for form, head_form in zip(_written_forms(secret), _written_forms(head, start=True), strict=True):
                least = MIN_SECRET_LENGTH + (len(head_form) if head and form.startswith(head_form) else 0)
                starts[form] = min(starts.get(form, least), least)
        self._prefixes = _Starts(starts) if starts else None
        # A suffix of a secret is a prefix of the reversed secret in the reversed text.
        self._suffixes = _Starts({form[::-1]: MIN_SECRET_LENGTH for form in starts}) if starts else None

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
