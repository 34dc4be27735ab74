"""patch: an exact string replaced, or a unified diff applied (batchrun/tools/files/diff.py)."""

from __future__ import annotations

import shlex

from batchrun.tools import ToolContext, ToolError
from batchrun.tools.files.arguments import editable_text, encode_text, optional_string, required_string, switch
from batchrun.tools.files.diff import Lines, apply_hunks, parse_diff


async def patch(args: dict, ctx: ToolContext) -> dict:
    """Replace an exact string in one file, or apply a unified diff (one or more files)."""
    diff = optional_string(args, "diff")
    if diff is None:
        return await _replace_string(args, ctx)
    if args.get("old_string") is not None or args.get("new_string") is not None:
        raise ToolError("give either 'diff' or 'old_string'/'new_string', not both")
    return await _apply_diff(diff, optional_string(args, "path"), ctx)


async def _replace_string(args: dict, ctx: ToolContext) -> dict:
    path = required_string(args, "path")
    old = required_string(args, "old_string")
    new = required_string(args, "new_string", allow_empty=True)
    replace_all = switch(args, "replace_all")
    data = await ctx.environment().read_file(path)
    text = editable_text(data, path)
    count = text.count(old)
    if count == 0:
        raise ToolError(f"old_string was not found in {path!r}; read the file and copy the text "
                        "exactly, including whitespace and indentation")
    if count > 1 and not replace_all:
        raise ToolError(f"old_string occurs {count} times in {path!r}; add surrounding context to "
                        "make it unique, or set replace_all to true to replace every occurrence")
    # Sized before it is built: a short file and a long new_string replaced everywhere multiply into
    # gigabytes, in the worker that every other prompt of it shares.
    size = len(data) + count * (len(encode_text(new)) - len(old.encode("utf-8")))
    if size > (limit := ctx.settings.max_file_bytes):
        raise ToolError(f"the result would be {size} bytes, more than the file tools' limit of {limit} bytes")
    written = await ctx.environment().write_file(path, encode_text(text.replace(old, new)))
    return {"path": written, "replacements": count}


async def _apply_diff(diff: str, default_path: str | None, ctx: ToolContext) -> dict:
    """Apply every file's hunks in memory first; write only if all of them apply."""
    results: dict[str, Lines] = {}
    created: set[str] = set()
    for file_patch in parse_diff(diff, default_path):
        target = file_patch.new_path
        if target is None:
            raise ToolError(f"the diff deletes {file_patch.old_path!r}; delete files with the terminal tool")
        if target in results:
            current = results[target]
        elif file_patch.old_path is None:
            await _refuse_existing(target, ctx)
            created.add(target)
            current = Lines([], True)
        else:
            current = Lines.parse(editable_text(await ctx.environment().read_file(target), target))
        results[target] = apply_hunks(current, file_patch.hunks, target)
    files = []
    for target, text in results.items():
        written = await ctx.environment().write_file(target, encode_text(text.render()))
        files.append({"path": written, "created": target in created})
    return {"files": files}


async def _refuse_existing(path: str, ctx: ToolContext) -> None:
    """A diff from /dev/null creates a file; overwriting one that exists would lose it."""
    result = await ctx.environment().run(f"test -e {shlex.quote(path)}")
    if result.exit_code == 0:
        raise ToolError(f"the diff creates {path!r}, which already exists; diff against its content instead")
