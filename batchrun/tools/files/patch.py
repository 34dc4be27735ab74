"""patch: an exact string replaced, or a unified diff applied (batchrun/tools/files/diff.py)."""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import shlex
from dataclasses import dataclass, field

from batchrun.environments.confined_files import climbs_after_a_name
from batchrun.time_limit import within
from batchrun.tools import ToolContext, ToolError
from batchrun.tools.files.arguments import editable_text, encode_text, optional_string, required_string, switch
from batchrun.tools.files.diff import FilePatch, Hunk, Lines, apply_hunks, parse_diff

# How long the files a diff already wrote may take to be put back once its call was stopped: as long as
# writing them took, in any sandbox that is not itself stuck.
_PUT_BACK_SECONDS = 10.0


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
    # Off the event loop: decoding, counting and replacing in a file of 10 MB takes a good part of a
    # second, which the worker's other sessions would wait for.
    result, count = await asyncio.to_thread(_replaced, data, path, old, new, replace_all, ctx.settings.max_file_bytes)
    written = await ctx.environment().write_file(path, result)
    return {"path": written, "replacements": count}


def _replaced(data: bytes, path: str, old: str, new: str, replace_all: bool, limit: int) -> tuple[bytes, int]:
    """The file with ``old`` replaced by ``new``, and how many times."""
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
    if size > limit:
        raise ToolError(f"the result would be {size} bytes, more than the file tools' limit of {limit} bytes")
    return encode_text(text.replace(old, new)), count


@dataclass
class _FileEdit:
    """One file a diff changes, however many times and under whatever spellings it names the file."""

    path: str                       # the first spelling, by which the file tools read and write it
    original: bytes | None          # None: the diff creates the file
    sections: list[list[Hunk]] = field(default_factory=list)   # each naming's hunks, applied in turn
    result: bytes = b""


async def _apply_diff(diff: str, default_path: str | None, ctx: ToolContext) -> dict:
    """Apply every file's hunks in memory first; write only if all of them apply and fit, and put back
    what was written if the environment then refuses a later file, so the diff changes all or none."""
    patches = await asyncio.to_thread(parse_diff, diff, default_path)
    edits = await _file_edits(patches, ctx)
    limit = ctx.settings.max_file_bytes
    for edit in edits:
        edit.result = await _edited(edit)
        if len(edit.result) > limit:
            raise ToolError(f"{edit.path!r} would be {len(edit.result)} bytes, more than the file tools' limit "
                            f"of {limit} bytes. Nothing was written")
    return {"files": await _write_all(edits, ctx)}


async def _file_edits(patches: list[FilePatch], ctx: ToolContext) -> list[_FileEdit]:
    """The files the diff names, each once, read (or, for a file it creates, checked to be new)."""
    targets = [_target(file_patch) for file_patch in patches]
    edits: dict[str, _FileEdit] = {}
    for key, target, file_patch in zip(await _file_keys(targets, ctx), targets, patches, strict=True):
        if key not in edits:
            edits[key] = await _file_edit(target, file_patch.old_path is None, ctx)
        edits[key].sections.append(file_patch.hunks)
    return list(edits.values())


def _target(file_patch: FilePatch) -> str:
    if file_patch.new_path is None:
        raise ToolError(f"the diff deletes {file_patch.old_path!r}; delete files with the terminal tool")
    return file_patch.new_path


async def _file_keys(paths: list[str], ctx: ToolContext) -> list[str]:
    """One key per file for every spelling of it, normalised as the file tools name the file they wrote
    (ConfinedPath.relative_to_start, container_path: '.' taken by name): 'f' and './f' are one file. A
    diff that names files both ways has its relative paths made absolute under the working directory's
    name as commands see it, the name absolute paths are resolved under. Two names for one file through
    a symlink stay two keys: only the lookup itself could tell. So a '..' after a name is refused: 'd/../f'
    is 'f' if 'd' is a directory, and another file if it is a symlink, and either key would be wrong for
    one of them (two edits of one file, one lost; or one file's hunks applied to another)."""
    for path in paths:
        if climbs_after_a_name(path):
            raise ToolError(f"the diff names {path!r}, with '..' after a directory's name; name the file by its "
                            "own path (without '..' past a name). Nothing was written")
    keys = [_normalised(path) for path in paths]
    if len({key.startswith("/") for key in keys}) < 2:
        return keys
    start = await _working_directory(ctx)
    return [_normalised(posixpath.join(start, key)) for key in keys]


def _normalised(path: str) -> str:
    """``path`` without '.', '..' and repeated slashes (posixpath keeps a leading '//', the tools do not)."""
    normal = posixpath.normpath(path)
    return "/" + normal.lstrip("/") if normal.startswith("/") else normal


async def _working_directory(ctx: ToolContext) -> str:
    """The working directory's absolute name as commands (and so the file tools' absolute paths) see it:
    the host's for the local backend, /workspace/... in a sandbox or container."""
    result = await ctx.environment().run("pwd")
    directory = result.output.removesuffix("\n")
    if result.exit_code != 0 or not directory.startswith("/"):
        raise ToolError("the diff names files by absolute and by relative paths, and the working directory "
                        "could not be found to tell which are one file; name them all the same way")
    return directory


async def _file_edit(path: str, creates: bool, ctx: ToolContext) -> _FileEdit:
    if creates:
        await _refuse_existing(path, ctx)
        return _FileEdit(path, None)
    return _FileEdit(path, await ctx.environment().read_file(path))


async def _edited(edit: _FileEdit) -> bytes:
    """The file's new content. Decoding, the hunk search and rendering take time in proportion to the
    file (up to max_file_bytes) and the diff: each step runs in a thread, so that the worker's other
    sessions go on meanwhile, and a --tool_timeout ends the call at the next step."""
    lines = await asyncio.to_thread(_lines_of, edit)
    for hunks in edit.sections:
        lines = await asyncio.to_thread(apply_hunks, lines, hunks, edit.path)
    return await asyncio.to_thread(_encoded, lines)


def _lines_of(edit: _FileEdit) -> Lines:
    if edit.original is None:
        return Lines([], True)
    return Lines.parse(editable_text(edit.original, edit.path))


def _encoded(lines: Lines) -> bytes:
    return encode_text(lines.render())


async def _write_all(edits: list[_FileEdit], ctx: ToolContext) -> list[dict]:
    """Write every file. The environment may still refuse one after others were written (a path it will
    not create, the workspace's disk limit), or the call's time limit strike between two writes: those
    written are then put back as they were, as the model is told nothing was changed."""
    files = []
    for done, edit in enumerate(edits):
        try:
            written = await ctx.environment().write_file(edit.path, edit.result)
        except ToolError as exc:
            raise ToolError(f"{exc}. {await _undo(edits[:done], ctx)}") from None
        except asyncio.CancelledError:
            # The cancelled task may still await: the put-back is bounded, as the time limit was.
            with contextlib.suppress(TimeoutError):
                await within(_PUT_BACK_SECONDS, _undo(edits[:done], ctx))
            raise
        files.append({"path": written, "created": edit.original is None})
    return files


async def _undo(written: list[_FileEdit], ctx: ToolContext) -> str:
    """Put back the files already written, newest first; says what that left."""
    if not written:
        return "Nothing was written"
    kept = [repr(edit.path) for edit in reversed(written) if not await _put_back(edit, ctx)]
    if kept:
        return f"The files written before it could not all be put back: {', '.join(kept)} hold the diff's changes"
    return "Nothing was changed: the files written before it were put back"


async def _put_back(edit: _FileEdit, ctx: ToolContext) -> bool:
    """The file as it was before the diff, a created one removed (the file tools themselves never delete)."""
    try:
        if edit.original is None:
            return (await ctx.environment().run(f"rm -f -- {shlex.quote(edit.path)}")).exit_code == 0
        await ctx.environment().write_file(edit.path, edit.original)
    except ToolError:
        return False
    return True


async def _refuse_existing(path: str, ctx: ToolContext) -> None:
    """A diff from /dev/null creates a file; overwriting one that exists would lose it."""
    result = await ctx.environment().run(f"test -e {shlex.quote(path)}")
    if result.exit_code == 0:
        raise ToolError(f"the diff creates {path!r}, which already exists; diff against its content instead")
