"""An HTTP body read within a size limit, counted after decompression as it arrives.

Whatever answers over HTTP (the model endpoint, a search or image service, a page the model chose)
can send more than anyone asked for: a body without end, a declared ten gigabytes, or a few kilobytes
of gzip that inflate to gigabytes. The HTTP stacks inflate without a bound (brotli and zstd, where
installed, by far more than gzip's thousandfold), so callers ask for gzip alone, and it is inflated
here, never more than one byte past the limit; a body in a coding nobody asked for is refused.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterable, AsyncIterator, Iterable

# The coding every bounded request asks for: one whose inflation this module can bound.
ACCEPT_ENCODING = "gzip"
_MIB = 2**20


class BodyError(Exception):
    """A body that cannot be read as sent (a coding not asked for, broken gzip, too large). Its text
    goes after the caller's name for the body: "the reply " + "is not valid gzip"."""


class BodyTooLarge(BodyError):
    """``together``: the limit is on the bodies being read at once, this one would take them past it."""

    def __init__(self, limit: int, declared: int | None = None, *, together: bool = False) -> None:
        if together:
            super().__init__(f"would take the replies being read at once past {_limit_text(limit)} together")
        elif declared is None:
            super().__init__(f"is larger than {_limit_text(limit)}")
        else:
            super().__init__(f"declares {declared:,} bytes, larger than {_limit_text(limit)}")


def _limit_text(size: int) -> str:
    return f"{size // _MIB} MiB" if size % _MIB == 0 else f"{size:,} bytes"


def gzipped_within(content_encoding: Iterable[str], content_length: str | None, *, limit: int) -> bool:
    """Whether a body with these headers is gzip (else it is sent as it is), after refusing what the
    headers already show: any other coding (BodyError), a plain body declaring more than ``limit``
    (BodyTooLarge, before a byte of it is read)."""
    codings = [coding.strip().lower() for value in content_encoding for coding in value.split(",")]
    codings = [coding for coding in codings if coding and coding != "identity"]
    if not codings:
        if content_length and content_length.isdigit() and int(content_length) > limit:
            raise BodyTooLarge(limit, int(content_length))
        return False
    if codings in (["gzip"], ["x-gzip"]):
        return True
    raise BodyError(f"is encoded as {', '.join(map(repr, codings))}, which was not asked for")


async def bounded_chunks(raw: AsyncIterable[bytes], *, gzip: bool, limit: int) -> AsyncIterator[bytes]:
    """The body's bytes (inflated when ``gzip``), BodyTooLarge as soon as they pass ``limit``, or the bytes
    received pass twice that: gzip that inflates to nothing (empty members without end, a header's comment
    that never ends) was read until the time limit, inflated all the while."""
    inflater = _GzipMembers() if gzip else None
    size = received = 0
    async for chunk in raw:
        received += len(chunk)
        if received > 2 * limit:
            raise BodyTooLarge(limit)
        if inflater is not None:
            # At most one byte past the room left: a few kilobytes of gzip can stand for gigabytes.
            chunk = inflater.inflate(chunk, limit - size + 1)
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        yield chunk
    if inflater is not None and not inflater.complete:
        raise BodyError("ends early: its gzip stream is cut short")


class _GzipMembers:
    """A gzip body inflated member after member: RFC 1952 lets a body hold several, and gzip readers
    read them all. Bytes after a member that start no other are refused, not dropped unread."""

    def __init__(self) -> None:
        self._member = zlib.decompressobj(16 + zlib.MAX_WBITS)

    @property
    def complete(self) -> bool:
        return self._member.eof

    def inflate(self, data: bytes, most: int) -> bytes:
        """What ``data`` inflates to, at most ``most`` bytes (more means the body is too large anyway)."""
        out = b""
        while data and len(out) < most:
            if self._member.eof:
                self._member = zlib.decompressobj(16 + zlib.MAX_WBITS)
            try:
                out += self._member.decompress(data, most - len(out))
            except zlib.error as exc:
                raise BodyError(f"is not valid gzip ({exc})") from None
            data = self._member.unused_data
        return out
