"""search_files: a regular expression over file contents (grep) or a glob over names (find), run through
the environment's shell behind a guard that keeps the search inside the working directory."""

from __future__ import annotations

import posixpath
import shlex
from pathlib import PurePosixPath

from batchrun.environments.base import CommandResult
from batchrun.environments.command_output import TRUNCATION_NOTE as _TRUNCATION_NOTE
from batchrun.tools import ToolContext, ToolError
from batchrun.tools.arguments import positive_int, shell_word
from batchrun.tools.files.arguments import optional_string, required_string

DEFAULT_MAX_RESULTS = 50
# One match of a minified file is a single huge line; the model needs where it is, not all of it.
_MATCH_TEXT_CHARS = 500
# Exit statuses of the guard in front of every search command (grep uses 0-2, find 0-1).
_SEARCH_PATH_ESCAPES = 3
_SEARCH_PATH_MISSING = 4
_SEARCH_PATH_NOT_SEARCHABLE = 5
# What stands between a search's results and its messages (_messages_last): grep --null's and find
# -print0's output never holds two NULs in a row.
_MESSAGES = "\0\0messages\0"


async def search_files(args: dict, ctx: ToolContext) -> dict:
    """A regex over file contents (grep) or a glob over file names (find), through the shell."""
    pattern = shell_word("pattern", required_string(args, "pattern"))
    target = optional_string(args, "target") or "content"
    if target not in ("content", "files"):
        raise ToolError(f"'target' must be 'content' or 'files', not {target!r}")
    root = _search_root(shell_word("path", optional_string(args, "path") or "."))
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
    """``command`` behind a check that ``root`` exists, its real path (symlinks followed) is inside
    the working directory (grep -r follows a symlink given as the starting point), and it is a file or
    a directory: grep reads a FIFO named as its start until the time-out."""
    quoted = shlex.quote(root)
    return (f"[ -e {quoted} ] || exit {_SEARCH_PATH_MISSING}; "
            f"real=$(readlink -f -- {quoted}) || exit {_SEARCH_PATH_MISSING}; here=$(pwd -P); "
            f'case "$real/" in "${{here%/}}"/*) ;; *) exit {_SEARCH_PATH_ESCAPES};; esac; '
            f'[ -f "$real" ] || [ -d "$real" ] || exit {_SEARCH_PATH_NOT_SEARCHABLE}; '
            f"{command}")


async def _run_search(root: str, command: str, ctx: ToolContext) -> tuple[CommandResult, str, list[str]]:
    """The result, what the command wrote to stdout (less a part line, when the output was cut) and its
    messages (stderr's lines)."""
    result = await ctx.environment().run(_guarded(root, _messages_last(command)))
    if result.timed_out:
        raise ToolError("the search timed out; narrow it with a more specific 'path' or pattern")
    if result.exit_code == _SEARCH_PATH_MISSING:
        raise ToolError(f"{root!r} does not exist")
    if result.exit_code == _SEARCH_PATH_ESCAPES:
        raise ToolError(f"{root!r} leads outside the working directory")
    if result.exit_code == _SEARCH_PATH_NOT_SEARCHABLE:
        raise ToolError(f"{root!r} is not a regular file or a directory (a FIFO, socket or device); "
                        "search a file or a directory")
    output = result.output.rpartition(_TRUNCATION_NOTE)[0] if result.truncated else result.output
    found, _, messages = output.partition(_MESSAGES)
    return result, found, messages.splitlines()


def _messages_last(command: str) -> str:
    """``command`` with its stderr held back and written after its stdout, behind _MESSAGES. A file name
    may hold a newline, so a message between two results could pass for part of a name, and a name for
    a message or a result of its own (a directory named "a\n." listed as "a" and "passwd")."""
    return (f"exec 3>&1; messages=$({command} 2>&1 >&3); status=$?; "
            f"printf '\\000\\000messages\\000%s' \"$messages\"; exit $status")


def _failure(tool: str, result: CommandResult, messages: list[str]) -> ToolError:
    detail = "\n".join(messages).strip() or f"exit status {result.exit_code}"
    return ToolError(f"{tool} failed: {detail[:_MATCH_TEXT_CHARS]}")


def _grep_matches(found: str) -> list[dict]:
    """The matches of grep --null's output, ``path NUL line:text NEWLINE`` each. A path may hold a
    newline and no NUL, a text line neither: after each NUL comes a line of its match, then the next path.
    A part line at the end (the output cut there) is no match."""
    matches = []
    chunks = found.split("\0")
    name = chunks[0]
    for chunk in chunks[1:]:
        line, newline, following = chunk.partition("\n")
        number, colon, text = line.partition(":")
        if not newline:
            break
        if colon and number.isdigit() and name.startswith("./"):
            matches.append({"path": posixpath.normpath(name), "line": int(number), "text": text[:_MATCH_TEXT_CHARS]})
        name = following
        # grep before 3.5 writes its note on a binary file that matches ("Binary file ./b matches") among
        # the results: the next path starts after it.
        while "\n" in name and not name.startswith("./"):
            name = name.partition("\n")[2]
    return matches


async def _search_content(pattern: str, root: str, max_results: int, ctx: ToolContext) -> dict:
    # -D skip: a start swapped for a FIFO after the guard's look is skipped, not read until the time-out.
    command = (f"grep -rnIE -D skip --null --exclude-dir=.git -e {shlex.quote(pattern)} -- "
               f"{shlex.quote(root)}")
    result, found, messages = await _run_search(root, command, ctx)
    matches = _grep_matches(found)
    # Exit 1 is "no match"; 2 is an error, fatal only if nothing was found (an unreadable file
    # among many readable ones should not hide their matches).
    if result.exit_code not in (0, 1) and not matches:
        raise _failure("grep", result, messages)
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
               f"{test} {shlex.quote(glob)} -print0")
    result, found, messages = await _run_search(root, command, ctx)
    # Each name ends with a NUL: what follows the last one is nothing, or a part name (the output cut there).
    files = sorted(posixpath.normpath(name) for name in found.split("\0")[:-1] if name.startswith("./"))
    if result.exit_code != 0 and not files:
        raise _failure("find", result, messages)
    return {"files": files[:max_results], "truncated": len(files) > max_results or result.truncated}
