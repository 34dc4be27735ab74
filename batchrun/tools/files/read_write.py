"""read_file and write_file: a window of a text file's lines, and a whole file written."""

from __future__ import annotations

from batchrun.tools import ToolContext, ToolError
from batchrun.tools.arguments import positive_int
from batchrun.tools.files.arguments import encode_text, refuse_binary, required_string

DEFAULT_READ_LIMIT = 500


async def read_file(args: dict, ctx: ToolContext) -> dict:
    """A window of a text file's lines (1-based ``offset``, ``limit`` lines)."""
    path = required_string(args, "path")
    offset = positive_int(args, "offset", 1)
    limit = positive_int(args, "limit", DEFAULT_READ_LIMIT)
    data = await ctx.environment().read_file(path)
    refuse_binary(data, path)
    total = _line_count(data)
    if offset > max(total, 1):
        raise ToolError(f"offset {offset} is past the end of {path!r}, which has {total} lines")
    window = data[_line_start(data, offset - 1, total):_line_start(data, offset - 1 + limit, total)]
    returned = _line_count(window)
    # The window alone is decoded: a newline byte is never part of a longer UTF-8 sequence, so a bad
    # byte is replaced alike whether the whole file is decoded or its lines one by one.
    return {"path": path, "content": window.decode("utf-8", errors="replace"), "total_lines": total,
            "offset": offset, "lines_returned": returned, "truncated": offset - 1 + returned < total}


def _line_count(data: bytes) -> int:
    """Lines split at newlines only (a form feed or U+2028 splits nothing); a last one without a newline counts."""
    return data.count(b"\n") + (not data.endswith(b"\n") and bool(data))


def _line_start(data: bytes, lines: int, total: int) -> int:
    """Where the line after the first ``lines`` lines starts (the end of the file if it has no more than
    those: ``total`` lines in all).

    Found by halving the range and counting newlines in one half, each count one pass of C over the bytes:
    about two passes over the file in all, and no object per line (a file of millions of short lines
    split into strings took tens of MB and a second of the event loop every session of the worker shares).
    """
    if lines <= 0:
        return 0
    low, high = 0, len(data)
    if lines >= total:
        return high
    # The lines-th newline lies in data[low:high], and ``lines`` counts the newlines from ``low`` on.
    while high - low > 1:
        middle = (low + high) // 2
        before = data.count(b"\n", low, middle)
        if before >= lines:
            high = middle
        else:
            low, lines = middle, lines - before
    return high


async def write_file(args: dict, ctx: ToolContext) -> dict:
    """Create or replace a file with ``content``."""
    path = required_string(args, "path")
    content = required_string(args, "content", allow_empty=True)
    data = encode_text(content)
    written = await ctx.environment().write_file(path, data)
    return {"path": written, "bytes_written": len(data)}
