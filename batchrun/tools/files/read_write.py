"""read_file and write_file: a window of a text file's lines, and a whole file written."""

from __future__ import annotations

from batchrun.tools import ToolContext, ToolError
from batchrun.tools.arguments import positive_int
from batchrun.tools.files.arguments import encode_text, refuse_binary, required_string, split_lines

DEFAULT_READ_LIMIT = 500


async def read_file(args: dict, ctx: ToolContext) -> dict:
    """A window of a text file's lines (1-based ``offset``, ``limit`` lines)."""
    path = required_string(args, "path")
    offset = positive_int(args, "offset", 1)
    limit = positive_int(args, "limit", DEFAULT_READ_LIMIT)
    data = await ctx.environment().read_file(path)
    refuse_binary(data, path)
    lines = split_lines(data.decode("utf-8", errors="replace"))
    if offset > max(len(lines), 1):
        raise ToolError(f"offset {offset} is past the end of {path!r}, which has {len(lines)} lines")
    window = lines[offset - 1:offset - 1 + limit]
    return {"path": path, "content": "".join(window), "total_lines": len(lines), "offset": offset,
            "lines_returned": len(window), "truncated": offset - 1 + len(window) < len(lines)}


async def write_file(args: dict, ctx: ToolContext) -> dict:
    """Create or replace a file with ``content``."""
    path = required_string(args, "path")
    content = required_string(args, "content", allow_empty=True)
    data = encode_text(content)
    written = await ctx.environment().write_file(path, data)
    return {"path": written, "bytes_written": len(data)}
