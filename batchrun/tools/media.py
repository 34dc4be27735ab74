"""Recognising image data by its first bytes.

The file name (or a server's content type) can lie; the signature cannot. These are the formats
that multimodal chat APIs accept and that image APIs return.
"""

from __future__ import annotations

_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"),
               (b"GIF87a", "image/gif"), (b"GIF89a", "image/gif"))
EXTENSIONS = {"image/png": "png", "image/jpeg": "jpg", "image/gif": "gif", "image/webp": "webp"}


def image_type(data: bytes) -> str | None:
    """The MIME type of PNG, JPEG, GIF or WebP data; None for anything else."""
    for signature, mime in _SIGNATURES:
        if data.startswith(signature):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None
