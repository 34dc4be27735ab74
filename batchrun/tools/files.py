"""The file tools: read, write, patch and search files in the prompt's environment.

File I/O goes through the environment's ``read_file``/``write_file`` and searching runs grep/find
through its shell, so the same handlers serve every backend (local directory, containers). The
environment enforces confinement; these handlers validate the model's arguments, refuse binary
files, and shape the results the model sees.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from batchrun.environments.base import CommandResult
from batchrun.tools import ToolContext, ToolError
from batchrun.tools.arguments import positive_int

DEFAULT_READ_LIMIT = 500
DEFAULT_MAX_RESULTS = 50
# One match of a minified file is a single huge line; the model needs where it is, not all of it.
_MATCH_TEXT_CHARS = 500
# Exit statuses of the guard in front of every search command (grep uses 0-2, find 0-1).
_SEARCH_PATH_ESCAPES = 3
_SEARCH_PATH_MISSING = 4
_HUNK_HEADER = re.compile(r"@@ -(\d+)(?:,(\d+))?")


# --- argument validation ------------------------------------------------------------------------

def _optional_string(args: dict, name: str, *, allow_empty: bool = False) -> str | None:
    """A string argument, or None when absent or null (models send null for unused options)."""
    value = args.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ToolError(f"'{name}' must be a string, not {type(value).__name__}")
    if not value and not allow_empty:
        raise ToolError(f"'{name}' must not be empty")
    return value


def _required_string(args: dict, name: str, *, allow_empty: bool = False) -> str:
    value = _optional_string(args, name, allow_empty=allow_empty)
    if value is None:
        raise ToolError(f"missing required argument '{name}'")
    return value


def _boolean(args: dict, name: str) -> bool:
    value = args.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ToolError(f"'{name}' must be true or false, not {value!r}")
    return value


# --- text helpers -------------------------------------------------------------------------------

def _refuse_binary(data: bytes, path: str) -> None:
    """A NUL byte marks a binary file, the same test grep -I uses."""
    if b"\0" in data:
        raise ToolError(f"{path!r} is a binary file; the file tools handle text only")


def _editable_text(data: bytes, path: str) -> str:
    """Strictly decoded text: an edit must not silently rewrite bytes that are not UTF-8."""
    _refuse_binary(data, path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"{path!r} is not UTF-8 text, so it cannot be edited safely") from None


def _encode(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise ToolError("the content contains characters that are not valid Unicode text") from None


def _split_lines(text: str) -> list[str]:
    """Lines with their '\\n' kept; unlike str.splitlines, form feeds and the like split nothing."""
    parts = text.split("\n")
    lines = [part + "\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


# --- read_file, write_file ----------------------------------------------------------------------

async def read_file(args: dict, ctx: ToolContext) -> dict:
    """A window of a text file's lines (1-based ``offset``, ``limit`` lines)."""
    path = _required_string(args, "path")
    offset = positive_int(args, "offset", 1)
    limit = positive_int(args, "limit", DEFAULT_READ_LIMIT)
    data = await ctx.environment().read_file(path)
    _refuse_binary(data, path)
    lines = _split_lines(data.decode("utf-8", errors="replace"))
    if offset > max(len(lines), 1):
        raise ToolError(f"offset {offset} is past the end of {path!r}, which has {len(lines)} lines")
    window = lines[offset - 1:offset - 1 + limit]
    return {"path": path, "content": "".join(window), "total_lines": len(lines), "offset": offset,
            "lines_returned": len(window), "truncated": offset - 1 + len(window) < len(lines)}


async def write_file(args: dict, ctx: ToolContext) -> dict:
    """Create or replace a file with ``content``."""
    path = _required_string(args, "path")
    content = _required_string(args, "content", allow_empty=True)
    data = _encode(content)
    written = await ctx.environment().write_file(path, data)
    return {"path": written, "bytes_written": len(data)}


# --- patch --------------------------------------------------------------------------------------

async def patch(args: dict, ctx: ToolContext) -> dict:
    """Replace an exact string in one file, or apply a unified diff (one or more files)."""
    diff = _optional_string(args, "diff")
    if diff is None:
        return await _replace_string(args, ctx)
    if args.get("old_string") is not None or args.get("new_string") is not None:
        raise ToolError("give either 'diff' or 'old_string'/'new_string', not both")
    return await _apply_diff(diff, _optional_string(args, "path"), ctx)


async def _replace_string(args: dict, ctx: ToolContext) -> dict:
    path = _required_string(args, "path")
    old = _required_string(args, "old_string")
    new = _required_string(args, "new_string", allow_empty=True)
    replace_all = _boolean(args, "replace_all")
    text = _editable_text(await ctx.environment().read_file(path), path)
    count = text.count(old)
    if count == 0:
        raise ToolError(f"old_string was not found in {path!r}; read the file and copy the text "
                        "exactly, including whitespace and indentation")
    if count > 1 and not replace_all:
        raise ToolError(f"old_string occurs {count} times in {path!r}; add surrounding context to "
                        "make it unique, or set replace_all to true to replace every occurrence")
    written = await ctx.environment().write_file(path, _encode(text.replace(old, new)))
    return {"path": written, "replacements": count}


@dataclass
class _Hunk:
    """One ``@@`` block: the lines it expects (old) and the lines it leaves (new), without '\\n'."""

    start: int | None                   # 0-based index the header points at; a hint, context decides
    old: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    old_missing_newline: bool = False   # "\ No newline at end of file" after an old-side line
    new_missing_newline: bool = False
    last_kind: str = " "

    def add(self, kind: str, text: str) -> None:
        if kind != "+":
            self.old.append(text)
        if kind != "-":
            self.new.append(text)
        self.last_kind = kind

    def mark_missing_newline(self) -> None:
        """The marker refers to the line before it: old side, new side, or both for context."""
        if self.last_kind != "+":
            self.old_missing_newline = True
        if self.last_kind != "-":
            self.new_missing_newline = True


@dataclass
class _FilePatch:
    old_path: str | None                # None for /dev/null: the diff creates the file
    new_path: str | None                # None for /dev/null: the diff deletes the file
    hunks: list[_Hunk] = field(default_factory=list)


@dataclass
class _Lines:
    """A file as lines without terminators, plus whether it ends with a newline."""

    lines: list[str]
    ends_with_newline: bool

    @classmethod
    def parse(cls, text: str) -> _Lines:
        lines = text.split("\n")
        if text.endswith("\n") or not text:
            lines.pop()
            return cls(lines, True)
        return cls(lines, False)

    def render(self) -> str:
        return "\n".join(self.lines) + ("\n" if self.lines and self.ends_with_newline else "")


def _header_path(line: str, prefix: str) -> str | None:
    """The path of a ``---``/``+++`` line: timestamp dropped, ``a/``/``b/`` stripped, /dev/null None."""
    name = line[4:].split("\t")[0].strip()
    if name == "/dev/null":
        return None
    return name[len(prefix):] if name.startswith(prefix) else name


def _new_hunk(line: str) -> _Hunk:
    """A hunk from its header; a header without line numbers (``@@ @@``) searches from the top."""
    match = _HUNK_HEADER.match(line)
    if match is None:
        return _Hunk(None)
    first, count = int(match.group(1)), match.group(2)
    # "-5,0" (nothing removed) means "after line 5", so the block starts at index 5, not 4.
    return _Hunk(first if count == "0" else max(first - 1, 0))


def _parse_diff(diff: str, default_path: str | None) -> list[_FilePatch]:
    """Split a unified diff into per-file hunks.

    Line counts in ``@@`` headers are ignored (models often get them wrong); a hunk ends at the next
    header. A bare empty line inside a hunk is taken as an empty context line (editors strip the
    space), except at the end of a hunk, where it is only the gap before the next file.
    """
    lines = diff.split("\n")
    patches: list[_FilePatch] = []
    hunk: _Hunk | None = None
    blank_lines = 0
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("--- ") and index + 1 < len(lines) and lines[index + 1].startswith("+++ "):
            patches.append(_FilePatch(_header_path(line, "a/"), _header_path(lines[index + 1], "b/")))
            hunk, blank_lines, index = None, 0, index + 2
            continue
        if line.startswith("@@"):
            if not patches:
                if default_path is None:
                    raise ToolError("the diff has no '--- a/FILE' / '+++ b/FILE' headers; "
                                    "add them or give the file in 'path'")
                patches.append(_FilePatch(default_path, default_path))
            hunk, blank_lines = _new_hunk(line), 0
            patches[-1].hunks.append(hunk)
        elif hunk is None or line.startswith("diff "):
            hunk = None                       # git/diff headers and commentary between files
        elif line == "":
            blank_lines += 1
        elif line[0] in " -+":
            for _ in range(blank_lines):
                hunk.add(" ", "")
            blank_lines = 0
            hunk.add(line[0], line[1:])
        elif line.startswith("\\"):
            hunk.mark_missing_newline()
        else:
            raise ToolError(f"line {index + 1} of the diff is not a hunk line (it must start with "
                            f"' ', '-' or '+'): {line[:80]!r}")
        index += 1
    if not any(file_patch.hunks for file_patch in patches):
        raise ToolError("the diff contains no hunks ('@@ -N,M +N,M @@' followed by lines)")
    return patches


def _locate(lines: list[str], old: list[str], expected: int, floor: int) -> int | None:
    """Where ``old`` occurs at or after ``floor``, nearest to ``expected`` (offset drift); None if nowhere."""
    last = len(lines) - len(old)
    if last < floor:
        return None
    expected = min(max(expected, floor), last)
    for distance in range(max(expected - floor, last - expected) + 1):
        for at in (expected - distance, expected + distance):
            if floor <= at <= last and lines[at:at + len(old)] == old:
                return at
    return None


def _apply_hunks(current: _Lines, hunks: list[_Hunk], path: str) -> _Lines:
    """The file after every hunk, applied in order; raises ToolError at the first that does not fit."""
    lines, ends_with_newline = list(current.lines), current.ends_with_newline
    shift = 0       # how far the previous hunk moved things from the positions the headers assume
    floor = 0       # hunks apply in order and never overlap
    for number, hunk in enumerate(hunks, 1):
        expected = floor if hunk.start is None else hunk.start + shift
        at = _locate(lines, hunk.old, expected, floor)
        if at is None:
            raise ToolError(
                f"hunk {number} of the diff for {path!r} does not apply: its context and removed lines "
                f"were not found (expected near line {expected + 1}). Nothing was written; read the "
                "file again and make those lines match it exactly")
        reaches_end = at + len(hunk.old) == len(lines)
        lines[at:at + len(hunk.old)] = hunk.new
        if reaches_end and (hunk.old_missing_newline or hunk.new_missing_newline):
            ends_with_newline = not hunk.new_missing_newline
        if hunk.start is not None:
            shift = at - hunk.start + len(hunk.new) - len(hunk.old)
        floor = at + len(hunk.new)
    return _Lines(lines, ends_with_newline)


async def _apply_diff(diff: str, default_path: str | None, ctx: ToolContext) -> dict:
    """Apply every file's hunks in memory first; write only if all of them apply."""
    results: dict[str, _Lines] = {}
    created: set[str] = set()
    for file_patch in _parse_diff(diff, default_path):
        target = file_patch.new_path
        if target is None:
            raise ToolError(f"the diff deletes {file_patch.old_path!r}; delete files with the terminal tool")
        if target in results:
            current = results[target]
        elif file_patch.old_path is None:
            await _refuse_existing(target, ctx)
            created.add(target)
            current = _Lines([], True)
        else:
            current = _Lines.parse(_editable_text(await ctx.environment().read_file(target), target))
        results[target] = _apply_hunks(current, file_patch.hunks, target)
    files = []
    for target, text in results.items():
        written = await ctx.environment().write_file(target, _encode(text.render()))
        files.append({"path": written, "created": target in created})
    return {"files": files}


async def _refuse_existing(path: str, ctx: ToolContext) -> None:
    """A diff from /dev/null creates a file; overwriting one that exists would lose it."""
    result = await ctx.environment().run(f"test -e {shlex.quote(path)}")
    if result.exit_code == 0:
        raise ToolError(f"the diff creates {path!r}, which already exists; diff against its content instead")


# --- search_files -------------------------------------------------------------------------------

async def search_files(args: dict, ctx: ToolContext) -> dict:
    """A regex over file contents (grep) or a glob over file names (find), through the shell."""
    pattern = _required_string(args, "pattern")
    target = _optional_string(args, "target") or "content"
    if target not in ("content", "files"):
        raise ToolError(f"'target' must be 'content' or 'files', not {target!r}")
    root = _search_root(_optional_string(args, "path") or ".")
    max_results = positive_int(args, "max_results", DEFAULT_MAX_RESULTS)
    if target == "content":
        return await _search_content(pattern, root, max_results, ctx)
    return await _search_names(pattern, root, max_results, ctx)


def _search_root(path: str) -> str:
    """The search path as ``./relative``, so every result line starts with './' and errors don't."""
    if path.startswith("/") or ".." in PurePosixPath(path).parts:
        raise ToolError(f"'path' must be relative to the working directory and stay inside it, "
                        f"not {path!r}")
    normal = posixpath.normpath(path)
    return "." if normal == "." else f"./{normal}"


def _guarded(root: str, command: str) -> str:
    """``command`` behind a check that ``root`` exists and its real path (symlinks followed) is inside
    the working directory: grep -r follows a symlink given as the starting point."""
    quoted = shlex.quote(root)
    return (f"[ -e {quoted} ] || exit {_SEARCH_PATH_MISSING}; "
            f"real=$(readlink -f -- {quoted}) || exit {_SEARCH_PATH_MISSING}; here=$(pwd -P); "
            f'case "$real/" in "${{here%/}}"/*) ;; *) exit {_SEARCH_PATH_ESCAPES};; esac; '
            f"{command}")


async def _run_search(root: str, command: str, ctx: ToolContext) -> CommandResult:
    result = await ctx.environment().run(_guarded(root, command))
    if result.timed_out:
        raise ToolError("the search timed out; narrow it with a more specific 'path' or pattern")
    if result.exit_code == _SEARCH_PATH_MISSING:
        raise ToolError(f"{root!r} does not exist")
    if result.exit_code == _SEARCH_PATH_ESCAPES:
        raise ToolError(f"{root!r} leads outside the working directory")
    return result


def _failure(tool: str, result: CommandResult) -> ToolError:
    """The error lines of grep/find (results start with './', messages with 'grep:'/'find:')."""
    messages = [line for line in result.output.splitlines() if line.startswith(f"{tool}:")]
    detail = "\n".join(messages) or result.output.strip() or f"exit status {result.exit_code}"
    return ToolError(f"{tool} failed: {detail[:_MATCH_TEXT_CHARS]}")


def _grep_match(line: str) -> dict | None:
    """``path NUL line:text`` (grep --null) as a match; None for anything else (messages, notes)."""
    name, nul, rest = line.partition("\0")
    number, colon, text = rest.partition(":")
    if not nul or not colon or not number.isdigit() or not name.startswith("."):
        return None
    return {"path": posixpath.normpath(name), "line": int(number), "text": text[:_MATCH_TEXT_CHARS]}


async def _search_content(pattern: str, root: str, max_results: int, ctx: ToolContext) -> dict:
    command = (f"grep -rnIE --null --exclude-dir=.git -e {shlex.quote(pattern)} -- "
               f"{shlex.quote(root)}")
    result = await _run_search(root, command, ctx)
    matches = [match for line in result.output.split("\n") if (match := _grep_match(line))]
    # Exit 1 is "no match"; 2 is an error, fatal only if nothing was found (an unreadable file
    # among many readable ones should not hide their matches).
    if result.exit_code not in (0, 1) and not matches:
        raise _failure("grep", result)
    matches.sort(key=lambda match: (match["path"], match["line"]))
    return {"matches": matches[:max_results],
            "truncated": len(matches) > max_results or result.truncated}


def _name_test(pattern: str) -> tuple[str, str]:
    """find's test for a glob: -name for a bare name, -path when it names directories too.

    A leading ``**/`` means "at any depth", which is what -name already does.
    """
    while pattern.startswith("**/"):
        pattern = pattern[3:]
    if "/" in pattern:
        return "-path", f"*/{pattern.removeprefix('./')}"
    return "-name", pattern


async def _search_names(pattern: str, root: str, max_results: int, ctx: ToolContext) -> dict:
    test, glob = _name_test(pattern)
    command = (f"find {shlex.quote(root)} -mindepth 1 -name .git -prune -o "
               f"{test} {shlex.quote(glob)} -print")
    result = await _run_search(root, command, ctx)
    files = sorted(posixpath.normpath(line) for line in result.output.split("\n")
                   if line.startswith("./"))
    if result.exit_code != 0 and not files:
        raise _failure("find", result)
    return {"files": files[:max_results], "truncated": len(files) > max_results or result.truncated}
