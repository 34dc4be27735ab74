"""Unified diffs: parsed into hunks per file, and applied to a file's lines, each hunk found near where
it says (the model's line numbers are often off), never where it does not match."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from itertools import repeat

from batchrun.tools import ToolError

_HUNK_HEADER = re.compile(r"@@ -(\d+)(?:,(\d+))?")
# The hunk search reads at most this many times the file's lines, plus the allowance (which keeps
# diffs of many hunks on small files clear of the bound): a fraction of a second on the largest file.
_SEARCH_PASSES = 8
_SEARCH_ALLOWANCE = 1_000_000
# How far either side of the expected line the first search looks.
_FIRST_REACH = 64
# Lines a hunk may expect are told apart by one character each, from chr(1) up ('\0' is the others').
_DISTINCT_LINES = sys.maxunicode
# Lines coded per join: one join over ten million lines holds the GIL for a quarter of a second, in which
# the worker's event loop cannot run; between two joins it can.
_LINES_PER_JOIN = 65_536


@dataclass
class Hunk:
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
class FilePatch:
    old_path: str | None                # None for /dev/null: the diff creates the file
    new_path: str | None                # None for /dev/null: the diff deletes the file
    hunks: list[Hunk] = field(default_factory=list)


@dataclass
class Lines:
    """A file as lines without terminators, plus whether it ends with a newline."""

    lines: list[str]
    ends_with_newline: bool

    @classmethod
    def parse(cls, text: str) -> Lines:
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


def _new_hunk(line: str) -> Hunk:
    """A hunk from its header; a header without line numbers (``@@ @@``) searches from the top."""
    match = _HUNK_HEADER.match(line)
    if match is None:
        return Hunk(None)
    first, count = int(match.group(1)), match.group(2)
    # "-5,0" (nothing removed) means "after line 5", so the block starts at index 5, not 4.
    return Hunk(first if count == "0" else max(first - 1, 0))


def parse_diff(diff: str, default_path: str | None) -> list[FilePatch]:
    """Split a unified diff into per-file hunks.

    Line counts in ``@@`` headers are ignored (models often get them wrong); a hunk ends at the next
    header. A bare empty line inside a hunk is taken as an empty context line (editors strip the
    space), except at the end of a hunk, where it is only the gap before the next file.
    """
    lines = diff.split("\n")
    patches: list[FilePatch] = []
    hunk: Hunk | None = None
    blank_lines = 0
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("--- ") and index + 1 < len(lines) and lines[index + 1].startswith("+++ "):
            patches.append(FilePatch(_header_path(line, "a/"), _header_path(lines[index + 1], "b/")))
            hunk, blank_lines, index = None, 0, index + 2
            continue
        if line.startswith("@@"):
            if not patches:
                if default_path is None:
                    raise ToolError("the diff has no '--- a/FILE' / '+++ b/FILE' headers; "
                                    "add them or give the file in 'path'")
                patches.append(FilePatch(default_path, default_path))
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


class _LineIndex:
    """A file's lines as one character each, so that a hunk is found by ``str.find`` (C, linear in what
    it reads) rather than by a list comparison at every position: a hunk of 20,000 context lines that
    matches nowhere in a million lines was half a minute that way. Each line a hunk expects gets a
    character of its own; every other line of the file is '\\0', which no hunk holds.

    What the searches of one file may read is bounded: hunks near where their headers say, or in order
    without line numbers, take about one pass over the file in all, while headers sending each search
    to the far end of a large file would take a pass per hunk. Past the bound the diff is refused.
    """

    def __init__(self, lines: list[str], hunks: list[Hunk], path: str) -> None:
        wanted = dict.fromkeys(line for hunk in hunks for line in hunk.old)
        if len(wanted) > _DISTINCT_LINES:
            raise ToolError(f"the diff for {path!r} has more than {_DISTINCT_LINES} different lines to match; "
                            "apply it in parts, or write the file whole")
        self._codes = {line: chr(code) for code, line in enumerate(wanted, 1)}
        self._text = "".join("".join(map(self._codes.get, lines[at:at + _LINES_PER_JOIN], repeat("\0")))
                             for at in range(0, len(lines), _LINES_PER_JOIN))
        self._budget = _SEARCH_PASSES * len(lines) + _SEARCH_ALLOWANCE
        self._path = path

    def locate(self, old: list[str], expected: int, floor: int) -> int | None:
        """Where ``old`` occurs at or after ``floor``, nearest to ``expected`` (offset drift), the earlier
        of two equally near; None if nowhere. The window around ``expected`` widens fourfold until it
        holds an occurrence or the whole range: a match inside it at distance d is the nearest, as
        everything outside is farther than d."""
        pattern = "".join(map(self._codes.__getitem__, old))
        last = len(self._text) - len(pattern)
        if last < floor:
            return None
        expected = min(max(expected, floor), last)
        reach = _FIRST_REACH
        while True:
            low, high = max(expected - reach, floor), min(expected + reach, last)
            self._spend(high - low + len(pattern))
            before = self._text.rfind(pattern, low, expected + len(pattern))     # starts in [low, expected]
            after = self._text.find(pattern, expected + 1, high + len(pattern))  # starts in (expected, high]
            if before >= 0 and (after < 0 or expected - before <= after - expected):
                return before
            if after >= 0:
                return after
            if (low, high) == (floor, last):
                return None
            reach *= 4

    def _spend(self, positions: int) -> None:
        self._budget -= positions
        if self._budget < 0:
            raise ToolError(
                f"the hunks of the diff for {self._path!r} are too far from the lines their '@@' headers give: "
                f"finding them would search the file more than {_SEARCH_PASSES} times over. Nothing was "
                "written; correct the line numbers in the headers, or leave them out ('@@ @@') to find "
                "each hunk after the one before")


def apply_hunks(current: Lines, hunks: list[Hunk], path: str) -> Lines:
    """The file after every hunk, applied in order; raises ToolError at the first that does not fit.

    Hunks apply in order and never overlap, so what follows a hunk is still the file as it was: each
    is found in the original lines, and the result is built once at the end (a list insertion per
    hunk would move the rest of the file each time).
    """
    index = _LineIndex(current.lines, hunks, path)
    placed: list[tuple[int, Hunk]] = []
    ends_with_newline = current.ends_with_newline
    offset = 0      # how far from its header's line the last numbered hunk was found
    floor = 0
    for number, hunk in enumerate(hunks, 1):
        expected = floor if hunk.start is None else hunk.start + offset
        at = index.locate(hunk.old, expected, floor)
        if at is None:
            raise ToolError(
                f"hunk {number} of the diff for {path!r} does not apply: its context and removed lines "
                f"were not found (expected near line {expected + 1}). Nothing was written; read the "
                "file again and make those lines match it exactly")
        floor = at + len(hunk.old)
        if floor == len(current.lines) and (hunk.old_missing_newline or hunk.new_missing_newline):
            ends_with_newline = not hunk.new_missing_newline
        if hunk.start is not None:
            offset = at - hunk.start
        placed.append((at, hunk))
    return Lines(_spliced(current.lines, placed), ends_with_newline)


def _spliced(lines: list[str], placed: list[tuple[int, Hunk]]) -> list[str]:
    """``lines`` with each placed hunk's old lines replaced by its new ones, in one pass."""
    result: list[str] = []
    kept = 0
    for at, hunk in placed:
        result += lines[kept:at]
        result += hunk.new
        kept = at + len(hunk.old)
    result += lines[kept:]
    return result
